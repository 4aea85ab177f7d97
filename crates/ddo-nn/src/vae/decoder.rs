//! The decoder: [`DecoderProgram`], the untiled forward `component.forward` runs, and
//! [`AutoencoderKL`], which builds, loads and runs it.

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use ddo_core::{
    Component, ComponentProgram, CoreError, DType, Device, ForwardContext, Result, Tensor,
};

use super::blocks::{
    MidAttention, MidBlock, ResnetBlock, UpBlock, build_up_blocks, consume, dims4,
};
use super::{AutoencoderKLConfig, CLASS_NAME, COMPONENT_NAME, NORM_EPS, TilingConfig};
use crate::builder::ModelBuilder;
use crate::error::LoadResult;
use crate::layers::{Conv2d, GroupNorm, ops};
use crate::weights::{CheckpointWeights, UnusedWeights, WeightSource};

/// The decoder's program: what `component.forward(device, latents)` runs (untiled).
#[derive(Debug, Clone)]
pub struct DecoderProgram {
    post_quant_conv: Option<Conv2d>,
    conv_in: Conv2d,
    mid_block: MidBlock,
    up_blocks: Vec<UpBlock>,
    conv_norm_out: GroupNorm,
    conv_out: Conv2d,
    latent_channels: usize,
}

impl DecoderProgram {
    /// `post_quant_conv` (when present) and the decoder on `z`, a device tensor in the
    /// weights' dtype.
    pub(super) fn decode_tile(&self, ctx: &mut ForwardContext<'_>, z: &Tensor) -> Result<Tensor> {
        let x = match &self.post_quant_conv {
            Some(pqc) => {
                let z = pqc.forward(ctx, z)?;
                consume(z, |z| self.conv_in.forward(ctx, z))?
            }
            None => self.conv_in.forward(ctx, z)?,
        };
        let x = self.mid_block.resnet0.forward(ctx, x)?;
        let x = match &self.mid_block.attention {
            Some(a) => a.forward(ctx, x)?,
            None => x,
        };
        let mut x = self.mid_block.resnet1.forward(ctx, x)?;
        for block in &self.up_blocks {
            for r in &block.resnets {
                x = r.forward(ctx, x)?;
            }
            if let Some(conv) = &block.upsampler {
                let up = consume(x, |x| ops(ctx)?.upsample_nearest2x(x))?;
                x = consume(up, |up| conv.forward(ctx, up))?;
            }
        }
        let x = consume(x, |x| self.conv_norm_out.forward_silu(ctx, x))?;
        consume(x, |x| self.conv_out.forward(ctx, x))
    }

    /// Moves `latents` to the context's device and casts them to the weights' dtype
    /// (`latents.to(vae.dtype)`, as pipelines do), checking the shape.
    pub(super) fn prepare(&self, ctx: &ForwardContext<'_>, latents: &Tensor) -> Result<Tensor> {
        let (_, c, h, w) = dims4(latents, "AutoencoderKL.decode latents")?;
        if c != self.latent_channels || h == 0 || w == 0 {
            return Err(CoreError::Shape {
                what: "AutoencoderKL.decode latents".into(),
                message: format!(
                    "shape {:?}: the VAE takes {} latent channels and a non-empty image",
                    latents.shape(),
                    self.latent_channels
                ),
            });
        }
        let device = ctx.device();
        let on_device = latents.to_device(device, &device.compute_stream())?;
        let dtype = ctx
            .component()
            .leaf_by_path("decoder.conv_in")
            .and_then(|l| l.params().first())
            .map_or(on_device.dtype(), |(_, p)| p.dtype());
        if on_device.dtype() == dtype {
            Ok(on_device)
        } else {
            ops(ctx)?.cast(&on_device, dtype)
        }
    }

    pub(super) fn decode_untiled(
        &self,
        ctx: &mut ForwardContext<'_>,
        latents: &Tensor,
    ) -> Result<Tensor> {
        let z = self.prepare(ctx, latents)?;
        self.decode_tile(ctx, &z)
    }
}

impl ComponentProgram for DecoderProgram {
    /// Decodes raw latents `[b, latent_channels, h, w]`, untiled.
    fn forward(&self, ctx: &mut ForwardContext<'_>, input: Tensor) -> Result<Tensor> {
        self.decode_untiled(ctx, &input)
    }
}

/// Diffusers' `AutoencoderKL`, decoder side.
pub struct AutoencoderKL {
    component: Arc<Component>,
    program: Arc<DecoderProgram>,
    config: AutoencoderKLConfig,
    dtype: DType,
    execution_device: Mutex<Option<Arc<dyn Device>>>,
}

impl std::fmt::Debug for AutoencoderKL {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AutoencoderKL")
            .field("component", &self.component)
            .field("dtype", &self.dtype)
            .field("config", &self.config)
            .finish()
    }
}

impl AutoencoderKL {
    /// Builds the decoder from `weights` (Diffusers names: `post_quant_conv.*`,
    /// `decoder.*`), as component `vae` of class `AutoencoderKL`.
    pub fn build(weights: &mut dyn WeightSource, config: AutoencoderKLConfig) -> LoadResult<Self> {
        config.validate()?;
        let groups = config.norm_num_groups;
        let widths: Vec<usize> = config.block_out_channels.iter().rev().copied().collect();
        let top = widths[0];
        let lc = config.latent_channels;
        let mut b = ModelBuilder::new(weights);
        let post_quant_conv = if config.use_post_quant_conv {
            Some(Conv2d::build(
                &mut b,
                "post_quant_conv",
                lc,
                lc,
                1,
                1,
                0,
                true,
            )?)
        } else {
            None
        };
        let (conv_in, mid_block, up_blocks, conv_norm_out, conv_out) = b.scope("decoder", |b| {
            let conv_in = Conv2d::build(b, "conv_in", lc, top, 3, 1, 1, true)?;
            let mid_block = b.scope("mid_block", |b| {
                // On an error the whole build fails, so early returns need not leave scopes.
                b.enter_blocks("resnets");
                let resnet0 = ResnetBlock::build(b, "0", top, top, groups)?;
                let resnet1 = ResnetBlock::build(b, "1", top, top, groups)?;
                b.exit();
                let attention = if config.mid_block_add_attention {
                    b.enter_blocks("attentions");
                    let a = MidAttention::build(b, "0", top, groups)?;
                    b.exit();
                    Some(a)
                } else {
                    None
                };
                Ok(MidBlock {
                    resnet0,
                    attention,
                    resnet1,
                })
            })?;
            b.enter_blocks("up_blocks");
            let up_blocks = build_up_blocks(b, &widths, config.layers_per_block, groups)?;
            b.exit();
            let last = widths[widths.len() - 1];
            let conv_norm_out = GroupNorm::build(b, "conv_norm_out", groups, last, NORM_EPS)?;
            let conv_out = Conv2d::build(b, "conv_out", last, config.out_channels, 3, 1, 1, true)?;
            Ok((conv_in, mid_block, up_blocks, conv_norm_out, conv_out))
        })?;
        let program = Arc::new(DecoderProgram {
            post_quant_conv,
            conv_in,
            mid_block,
            up_blocks,
            conv_norm_out,
            conv_out,
            latent_channels: lc,
        });
        let component = b.finish(
            COMPONENT_NAME,
            CLASS_NAME,
            Arc::clone(&program) as Arc<dyn ComponentProgram>,
        )?;
        let dtype = component
            .leaf_by_path("decoder.conv_in")
            .and_then(|l| l.params().first())
            .map_or(DType::F32, |(_, p)| p.dtype());
        Ok(Self {
            component,
            program,
            config,
            dtype,
            execution_device: Mutex::new(None),
        })
    }

    /// Loads a Diffusers model folder (`config.json` and `diffusion_pytorch_model.safetensors`,
    /// single or sharded), memory-mapped; `dtype` converts every weight on load.
    pub fn load(dir: &Path, dtype: Option<DType>) -> LoadResult<Self> {
        Self::load_checked(dir, dtype, UnusedWeights::Refuse)
    }

    /// [`AutoencoderKL::load`], with what to do about checkpoint tensors the config leaves unused
    /// (refused by default).
    pub fn load_checked(
        dir: &Path,
        dtype: Option<DType>,
        unused: UnusedWeights,
    ) -> LoadResult<Self> {
        let config = AutoencoderKLConfig::from_file(&dir.join("config.json"))?;
        CheckpointWeights::build_in(dir, dtype, &["encoder.", "quant_conv."], unused, |w| {
            Self::build(w, config)
        })
    }

    /// The component (its leaves own the decoder's weights).
    pub fn component(&self) -> &Arc<Component> {
        &self.component
    }

    /// The program `component.forward` runs.
    pub fn program(&self) -> &Arc<DecoderProgram> {
        &self.program
    }

    /// The config.
    pub fn config(&self) -> &AutoencoderKLConfig {
        &self.config
    }

    /// The dtype of the weights (latents are cast to it).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of decoder parameters (elements), `post_quant_conv` included.
    pub fn num_params(&self) -> usize {
        self.component
            .params()
            .iter()
            .map(|p| p.shape().iter().product::<usize>())
            .sum()
    }

    /// Sets the device `decode(None, ..)` runs on (what a pipeline's `vae.device` would
    /// be); `None` forgets it.
    pub fn set_execution_device(&self, device: Option<Arc<dyn Device>>) {
        *self
            .execution_device
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = device;
    }

    /// Decodes raw latents `[b, latent_channels, h, w]` into images
    /// `[b, out_channels, h·f, w·f]` on `device`, through the attached route's hooks.
    /// With `tiling`, latents larger than a tile are decoded as Diffusers' `tiled_decode`
    /// does; smaller ones untiled (as `_decode` decides). The result stays on the device.
    ///
    /// `device` is the execution device. `None` uses the one given to
    /// [`AutoencoderKL::set_execution_device`]; without one it is an error, never a
    /// silent decode on the CPU.
    pub fn decode(
        &self,
        device: Option<&dyn Device>,
        latents: &Tensor,
        tiling: Option<TilingConfig>,
    ) -> Result<Tensor> {
        let remembered = self
            .execution_device
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let device: &dyn Device = match (device, remembered.as_deref()) {
            (Some(d), _) => d,
            (None, Some(d)) => d,
            (None, None) => return Err(self.no_device_error()),
        };
        let program = &self.program;
        let tiled = match (tiling, latents.shape()) {
            (Some(t), [_, _, h, w]) if t.needs_tiling(*h, *w) => Some(t),
            _ => None,
        };
        self.component.run(device, |ctx| match &tiled {
            Some(t) => program.decode_tiled(ctx, latents, t),
            None => program.decode_untiled(ctx, latents),
        })
    }

    /// [`AutoencoderKLConfig::unscale_latents`] on `device` (uploading host latents).
    pub fn unscale_latents(&self, device: &dyn Device, latents: &Tensor) -> Result<Tensor> {
        let ops = ddo_core::ops_of(device)?;
        let on_device = latents.to_device(device, &device.compute_stream())?;
        self.config.unscale_latents(ops, &on_device)
    }

    fn no_device_error(&self) -> CoreError {
        let where_ = if let Some(route) = self.component.attached() {
            format!(
                "route `{}` is attached on {}; pass that device",
                route.route_name(),
                route.device_id()
            )
        } else if self.component.params().iter().any(|p| p.device().is_some()) {
            "the weights were moved to a device without a route; pass that device".to_string()
        } else {
            "the weights are on the host and no route is attached: attach a route or move the \
             weights, and pass the device (DDO never decodes on the CPU silently)"
                .to_string()
        };
        CoreError::InvalidOption {
            option: "AutoencoderKL::decode device".into(),
            value: "None".into(),
            hint: format!("pass the execution device; {where_}"),
        }
    }
}
