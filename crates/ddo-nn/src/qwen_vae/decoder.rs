//! The decoder: [`QwenVaeProgram`], the untiled single-frame decode `component.forward`
//! runs, and [`QwenVae`], which builds, loads and runs it.

use std::path::Path;
use std::sync::Arc;

use ddo_core::{
    BinaryOp, Component, ComponentProgram, CoreError, DType, Device, ForwardContext, Ops, Result,
    Tensor, UnaryOp, check_finite,
};

use super::blocks::{CausalConv, MidBlock, RmsNorm, UpBlock, consume, dims4};
use super::config::Upsampler;
use super::{CLASS_NAME, COMPONENT_NAME, QwenVaeConfig, QwenVaeTiling};
use crate::builder::ModelBuilder;
use crate::error::LoadResult;
use crate::layers::ops;
use crate::weights::{CheckpointWeights, RandomWeights, UnusedWeights, WeightSource};

/// What a tap receives: the name of the Diffusers module whose output a tensor is, and the
/// tensor.
pub type Tap<'a> = dyn FnMut(&str, &Tensor) -> Result<()> + 'a;

/// The decoder's program: what `component.forward(device, latents)` runs (untiled).
#[derive(Debug, Clone)]
pub struct QwenVaeProgram {
    post_quant_conv: CausalConv,
    conv_in: CausalConv,
    mid_block: MidBlock,
    up_blocks: Vec<UpBlock>,
    norm_out: RmsNorm,
    conv_out: CausalConv,
    z_dim: usize,
    ratio: usize,
}

impl QwenVaeProgram {
    fn build(b: &mut ModelBuilder<'_>, config: &QwenVaeConfig) -> LoadResult<Self> {
        let z = config.z_dim;
        let top = config.top_width();
        let post_quant_conv = CausalConv::build(b, "post_quant_conv", z, z, 1)?;
        let (conv_in, mid_block, up_blocks, norm_out, conv_out) = b.scope("decoder", |b| {
            let conv_in = CausalConv::build(b, "conv_in", z, top, 3)?;
            let mid_block = MidBlock::build(b, top)?;
            b.enter_blocks("up_blocks");
            let up_blocks = config
                .up_blocks()
                .iter()
                .enumerate()
                .map(|(i, spec)| UpBlock::build(b, i, spec))
                .collect::<LoadResult<Vec<_>>>()?;
            b.exit();
            let last = config.last_width();
            let norm_out = RmsNorm::build(b, "norm_out", last, false)?;
            let conv_out = CausalConv::build(b, "conv_out", last, config.input_channels, 3)?;
            Ok((conv_in, mid_block, up_blocks, norm_out, conv_out))
        })?;
        Ok(Self {
            post_quant_conv,
            conv_in,
            mid_block,
            up_blocks,
            norm_out,
            conv_out,
            z_dim: z,
            ratio: config.spatial_compression_ratio(),
        })
    }

    /// Pixels per latent along each axis.
    pub fn spatial_compression_ratio(&self) -> usize {
        self.ratio
    }

    /// `post_quant_conv` and the decoder on `z` (a device tensor in the weights' dtype), not
    /// clamped: one tile of `tiled_decode`, or `_decode` before its clamp. `tap` gets each
    /// module's output under its Diffusers name.
    pub(super) fn decode_tile(
        &self,
        ctx: &mut ForwardContext<'_>,
        z: &Tensor,
        tap: &mut Tap<'_>,
    ) -> Result<Tensor> {
        let o = ops(ctx)?;
        let x = self.post_quant_conv.forward(ctx, z)?;
        tap("post_quant_conv", &x)?;
        let x = consume(x, |x| self.conv_in.forward(ctx, x))?;
        tap("decoder.conv_in", &x)?;
        let x = self.mid_block.resnet0.forward(ctx, x)?;
        tap("decoder.mid_block.resnets.0", &x)?;
        let x = self.mid_block.attention.forward(ctx, x)?;
        tap("decoder.mid_block.attentions.0", &x)?;
        let mut x = self.mid_block.resnet1.forward(ctx, x)?;
        tap("decoder.mid_block.resnets.1", &x)?;
        tap("decoder.mid_block", &x)?;
        for (i, block) in self.up_blocks.iter().enumerate() {
            for (k, r) in block.resnets.iter().enumerate() {
                x = r.forward(ctx, x)?;
                tap(&format!("decoder.up_blocks.{i}.resnets.{k}"), &x)?;
            }
            if let Some(conv) = &block.upsampler {
                let up = consume(x, |x| o.upsample_nearest2x(x))?;
                x = consume(up, |up| conv.forward(ctx, up))?;
                tap(&format!("decoder.up_blocks.{i}.upsamplers.0"), &x)?;
            }
            tap(&format!("decoder.up_blocks.{i}"), &x)?;
        }
        let x = consume(x, |x| self.norm_out.forward(ctx, x))?;
        tap("decoder.norm_out", &x)?;
        let x = o.unary_owned(x, UnaryOp::Silu)?;
        tap("decoder.nonlinearity", &x)?;
        let x = consume(x, |x| self.conv_out.forward(ctx, x))?;
        tap("decoder.conv_out", &x)?;
        tap("decoder", &x)?;
        Ok(x)
    }

    /// Moves `latents` to the context's device and casts them to the weights' dtype
    /// (`latents.to(vae.dtype)`, as the pipeline does), checking the shape.
    pub(super) fn prepare(&self, ctx: &ForwardContext<'_>, latents: &Tensor) -> Result<Tensor> {
        let what = "AutoencoderKLQwenImage.decode latents";
        let (_, c, h, w) = dims4(latents, what)?;
        if c != self.z_dim || h == 0 || w == 0 {
            return Err(CoreError::Shape {
                what: what.into(),
                message: format!(
                    "shape {:?}: the VAE takes one frame of {} latent channels, [batch, {}, \
                     height, width], non-empty",
                    latents.shape(),
                    self.z_dim,
                    self.z_dim
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

    /// `_decode` untiled: the decoder on the one frame, then `clamp(-1, 1)`. The decoder's
    /// output is checked before the clamp, which would turn a NaN into -1 and an Inf into
    /// ±1 (DDO's `Max`/`Min` keep the number, as `f32::max` does): a NaN or an Inf is
    /// [`ddo_core::CoreError::NonFinite`] (one count).
    pub(super) fn decode_untiled(
        &self,
        ctx: &mut ForwardContext<'_>,
        latents: &Tensor,
        tap: &mut Tap<'_>,
    ) -> Result<Tensor> {
        let z = self.prepare(ctx, latents)?;
        let x = self.decode_tile(ctx, &z, tap)?;
        check_finite(ops(ctx)?, &x, "decode", None, "the decoded image")?;
        consume(x, |x| clamp_unit(ops(ctx)?, x))
    }
}

/// `torch.clamp(x, -1, 1)`: a max with -1, then a min with 1.
fn clamp_unit(o: &dyn Ops, x: &Tensor) -> Result<Tensor> {
    let lo = o.tensor_from_f32(&[1], DType::F32, &[-1.0])?;
    let hi = o.tensor_from_f32(&[1], DType::F32, &[1.0])?;
    let floor = o.binary(x, &lo, BinaryOp::Max)?;
    consume(floor, |f| o.binary(f, &hi, BinaryOp::Min))
}

impl ComponentProgram for QwenVaeProgram {
    /// Decodes one frame of latents `[b, z_dim, h, w]`, untiled, clamped.
    fn forward(&self, ctx: &mut ForwardContext<'_>, input: Tensor) -> Result<Tensor> {
        self.decode_untiled(ctx, &input, &mut |_, _| Ok(()))
    }
}

/// Diffusers' `AutoencoderKLQwenImage`, decoder side, for single images (one latent frame).
pub struct QwenVae {
    component: Arc<Component>,
    program: Arc<QwenVaeProgram>,
    config: QwenVaeConfig,
    dtype: DType,
}

impl std::fmt::Debug for QwenVae {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QwenVae")
            .field("component", &self.component)
            .field("dtype", &self.dtype)
            .field("config", &self.config)
            .finish()
    }
}

impl QwenVae {
    /// Builds the decoder from `weights` (Diffusers names: `post_quant_conv.*`,
    /// `decoder.*`; each causal convolution's weight read at its last temporal slice), as
    /// component `vae` of class `AutoencoderKLQwenImage`, the tree in execution order.
    pub fn build(weights: &mut dyn WeightSource, config: QwenVaeConfig) -> LoadResult<Self> {
        config.validate()?;
        let mut b = ModelBuilder::new(weights);
        let program = Arc::new(QwenVaeProgram::build(&mut b, &config)?);
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
        })
    }

    /// Loads a Diffusers `vae/` folder (`config.json` and
    /// `diffusion_pytorch_model.safetensors`, single or sharded), memory-mapped; `dtype`
    /// converts every weight on load. The encoder's tensors, `quant_conv`'s and the
    /// `upsample3d` blocks' `time_conv`s are never read.
    pub fn load(dir: &Path, dtype: Option<DType>) -> LoadResult<Self> {
        Self::load_checked(dir, dtype, UnusedWeights::Refuse)
    }

    /// [`QwenVae::load`], with what to do about checkpoint tensors the config leaves unused
    /// (refused by default).
    pub fn load_checked(
        dir: &Path,
        dtype: Option<DType>,
        unused: UnusedWeights,
    ) -> LoadResult<Self> {
        let config = QwenVaeConfig::from_file(&dir.join("config.json"))?;
        let ignored = ignored_prefixes(&config);
        let ignored: Vec<&str> = ignored.iter().map(String::as_str).collect();
        CheckpointWeights::build_in(dir, dtype, &ignored, unused, |w| Self::build(w, config))
    }

    /// A decoder with seeded random weights stored as `dtype` ([`RandomWeights`]; f32, f16
    /// or bf16).
    pub fn random(config: QwenVaeConfig, seed: u64, dtype: DType) -> LoadResult<Self> {
        Self::build(&mut RandomWeights::new(seed, dtype), config)
    }

    /// The component (its leaves own the decoder's weights).
    pub fn component(&self) -> &Arc<Component> {
        &self.component
    }

    /// The program `component.forward` runs.
    pub fn program(&self) -> &Arc<QwenVaeProgram> {
        &self.program
    }

    /// The config.
    pub fn config(&self) -> &QwenVaeConfig {
        &self.config
    }

    /// The dtype of the weights (latents are cast to it).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Elements of the decoder's params, `post_quant_conv` included: each causal
    /// convolution's weight counts its one temporal slice.
    pub fn num_params(&self) -> usize {
        self.component
            .params()
            .iter()
            .map(|p| p.shape().iter().product::<usize>())
            .sum()
    }

    /// Decodes one frame of latents `[b, z_dim, h, w]` (already un-normalised:
    /// [`QwenVae::denormalize_latents`]) into images `[b, input_channels, h·f, w·f]`
    /// (`f` = [`QwenVaeConfig::spatial_compression_ratio`]) on `device`, through the attached
    /// route's hooks: Diffusers' `vae.decode(latents[:, :, None]).sample[:, :, 0]`. With
    /// `tiling`, latents larger than a tile are decoded as `tiled_decode` does (not clamped,
    /// as there); others untiled and clamped to [-1, 1], as `_decode` decides. The result
    /// stays on the device, in the weights' dtype. A decoded image holding a NaN or an Inf
    /// (before the clamp) is [`ddo_core::CoreError::NonFinite`].
    pub fn decode(
        &self,
        device: &dyn Device,
        latents: &Tensor,
        tiling: Option<QwenVaeTiling>,
    ) -> Result<Tensor> {
        let program = &self.program;
        let ratio = program.ratio;
        let tiled = match (tiling, latents.shape()) {
            (Some(t), [_, _, h, w]) if t.needs_tiling(*h, *w, ratio) => Some(t),
            _ => None,
        };
        self.component.run(device, |ctx| match &tiled {
            Some(t) => {
                let image = program.decode_tiled(ctx, latents, t)?;
                check_finite(ops(ctx)?, &image, "decode", None, "the decoded image")?;
                Ok(image)
            }
            None => program.decode_untiled(ctx, latents, &mut |_, _| Ok(())),
        })
    }

    /// [`QwenVae::decode`] untiled, handing `tap` each module's output under its Diffusers
    /// name (`post_quant_conv`, `decoder.conv_in`, `decoder.mid_block.resnets.0`,
    /// `decoder.mid_block.attentions.0`, `decoder.mid_block.resnets.1`, `decoder.mid_block`,
    /// `decoder.up_blocks.<i>.resnets.<k>`, `decoder.up_blocks.<i>.upsamplers.0`,
    /// `decoder.up_blocks.<i>`, `decoder.norm_out`, `decoder.nonlinearity`,
    /// `decoder.conv_out`, `decoder`: the fixture's intermediates, without their frame axis).
    /// The values are those of a plain decode.
    pub fn decode_with_taps(
        &self,
        device: &dyn Device,
        latents: &Tensor,
        tap: &mut Tap<'_>,
    ) -> Result<Tensor> {
        self.component
            .run(device, |ctx| self.program.decode_untiled(ctx, latents, tap))
    }

    /// [`QwenVaeConfig::denormalize_latents`] on `device` (uploading host latents): the step
    /// `QwenImagePipeline` runs on its unpacked latents before [`QwenVae::decode`].
    pub fn denormalize_latents(&self, device: &dyn Device, latents: &Tensor) -> Result<Tensor> {
        let o = ddo_core::ops_of(device)?;
        let on_device = latents.to_device(device, &device.compute_stream())?;
        self.config.denormalize_latents(o, &on_device)
    }
}

/// Checkpoint tensors the decoder never reads: the encoder, `quant_conv`, and the
/// `time_conv` of every `upsample3d` up block.
fn ignored_prefixes(config: &QwenVaeConfig) -> Vec<String> {
    let mut prefixes = vec!["encoder.".to_string(), "quant_conv.".to_string()];
    prefixes.extend(
        config
            .up_blocks()
            .iter()
            .enumerate()
            .filter(|(_, b)| b.upsampler == Some(Upsampler::SpatioTemporal))
            .map(|(i, _)| format!("decoder.up_blocks.{i}.upsamplers.0.time_conv.")),
    );
    prefixes
}
