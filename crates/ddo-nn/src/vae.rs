//! Diffusers' `AutoencoderKL`, decoder side, on the `Ops` plane with its weights as leaves
//! of a [`Component`] named `vae`, so every route moves them unchanged.
//!
//! Matches diffusers 0.42 (`models/autoencoders/autoencoder_kl.py`, `autoencoders/vae.py`
//! `Decoder`, `models/resnet.py` `ResnetBlock2D`/`Upsample2D`, `unet_2d_blocks.py`
//! `UNetMidBlock2D`/`UpDecoderBlock2D`, `attention_processor.py` `Attention` with
//! `AttnProcessor2_0`):
//!
//! - `post_quant_conv` (1×1) when `use_post_quant_conv`, then `decoder.conv_in` (3×3) to
//!   `block_out_channels[-1]`;
//! - `decoder.mid_block`: `resnets.0`, `attentions.0` (when `mid_block_add_attention`),
//!   `resnets.1`. The attention is a single head of width `block_out_channels[-1]`:
//!   `group_norm` (`norm_num_groups` groups, eps 1e-6), `to_q`/`to_k`/`to_v` over the
//!   `h·w` positions, SDPA with scale `1/√C`, `to_out.0`, plus the residual;
//!   `rescale_output_factor` is 1;
//! - `decoder.up_blocks.i` over the reversed `block_out_channels`: `layers_per_block + 1`
//!   `ResnetBlock2D`s each (a 1×1 `conv_shortcut` where the channel count changes), then,
//!   for all but the last block, `upsamplers.0`: nearest ×2 and a 3×3 `conv`;
//! - `decoder.conv_norm_out` (GroupNorm, eps 1e-6), SiLU, `decoder.conv_out`.
//!
//! Every `ResnetBlock2D` is `norm1 → SiLU → conv1 → norm2 → SiLU → conv2`, plus the input
//! (through `conv_shortcut` when present); eps 1e-6, no time embedding, output scale 1.
//! Each GroupNorm followed by SiLU (`norm1`, `norm2`, `conv_norm_out`) runs as one op,
//! [`Ops::group_norm_silu`] (fused on CUDA; on the host backend the composition, bit for bit).
//! Dropout is the identity. The encoder and `quant_conv` are not built: their tensors in a
//! checkpoint are simply not loaded.
//!
//! [`AutoencoderKL::decode`] takes latents raw, as `AutoencoderKL.decode` does; pipelines
//! first apply [`AutoencoderKLConfig::unscale_latents`]. Tiled decoding
//! ([`TilingConfig`]) reproduces `AutoencoderKL.tiled_decode`, blending and cropping
//! included. [`estimate_decode_peak_bytes`] predicts the activation peak of a decode, to
//! choose between tiled and untiled decoding.

use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use ddo_core::{
    BinaryOp, Component, ComponentProgram, CoreError, DType, Device, ForwardContext, Ops, Result,
    Tensor,
};
use serde::{Deserialize, Deserializer, Serialize};

use crate::builder::ModelBuilder;
use crate::error::{LoadError, LoadResult};
use crate::layers::{Conv2d, GroupNorm, Linear, ops};
use crate::weights::{CheckpointWeights, UnusedWeights, WeightSource};

/// The component name of the VAE in Diffusers pipelines.
pub const COMPONENT_NAME: &str = "vae";
/// The Diffusers class this module ports.
pub const CLASS_NAME: &str = "AutoencoderKL";
/// The only up-block type the decoder supports.
pub const UP_DECODER_BLOCK: &str = "UpDecoderBlock2D";
/// Epsilon of every GroupNorm of the decoder (`resnet_eps`, the attention's norm and
/// `conv_norm_out`).
pub const NORM_EPS: f32 = 1e-6;

fn default_in_channels() -> usize {
    3
}
fn default_act_fn() -> String {
    "silu".into()
}
fn default_true() -> bool {
    true
}
fn default_scaling_factor() -> f64 {
    0.18215
}
fn default_sample_size() -> usize {
    32
}

/// `sample_size` is an int or, in some configs, `[height, width]`; Diffusers uses the
/// first entry for tiling.
fn sample_size<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<usize, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum SampleSize {
        One(usize),
        Many(Vec<usize>),
    }
    match SampleSize::deserialize(d)? {
        SampleSize::One(n) => Ok(n),
        SampleSize::Many(v) => v
            .first()
            .copied()
            .ok_or_else(|| serde::de::Error::custom("sample_size is an empty list")),
    }
}

/// The fields of Diffusers' `AutoencoderKL` config the decoder uses. Other fields of
/// `config.json` (`down_block_types`, `latents_mean`, `_class_name`, ...) are ignored.
///
/// Required: `out_channels`, `latent_channels`, `block_out_channels`, `layers_per_block`,
/// `norm_num_groups` (they fix the shapes of the weights). The others default as in
/// Diffusers, except `up_block_types`, which defaults to one `UpDecoderBlock2D` per entry
/// of `block_out_channels`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AutoencoderKLConfig {
    /// Image channels the encoder takes (unused by the decoder).
    #[serde(default = "default_in_channels")]
    pub in_channels: usize,
    /// Image channels the decoder produces.
    pub out_channels: usize,
    /// Latent channels.
    pub latent_channels: usize,
    /// Channels per resolution level, encoder order (the decoder runs them reversed).
    pub block_out_channels: Vec<usize>,
    /// Resnets per encoder block; decoder up blocks have one more.
    pub layers_per_block: usize,
    /// Groups of every GroupNorm.
    pub norm_num_groups: usize,
    /// Activation; only `silu` (or its alias `swish`) is supported.
    #[serde(default = "default_act_fn")]
    pub act_fn: String,
    /// Up-block types; only `UpDecoderBlock2D`.
    #[serde(default)]
    pub up_block_types: Vec<String>,
    /// Whether the model has `quant_conv` (encoder side; not built).
    #[serde(default = "default_true")]
    pub use_quant_conv: bool,
    /// Whether the model has `post_quant_conv` (run before the decoder).
    #[serde(default = "default_true")]
    pub use_post_quant_conv: bool,
    /// Whether the mid block has its attention.
    #[serde(default = "default_true")]
    pub mid_block_add_attention: bool,
    /// Latent scaling factor (pipelines divide by it before decoding).
    #[serde(default = "default_scaling_factor")]
    pub scaling_factor: f64,
    /// Latent shift (Flux, SD3: added after the division).
    #[serde(default)]
    pub shift_factor: Option<f64>,
    /// Image size the VAE was trained at; the default tile size of tiled decoding.
    #[serde(default = "default_sample_size", deserialize_with = "sample_size")]
    pub sample_size: usize,
    /// Whether pipelines run the VAE in f32 (informational).
    #[serde(default = "default_true")]
    pub force_upcast: bool,
}

impl AutoencoderKLConfig {
    /// The SD 1.x / 2.x VAE (`stabilityai/sd-vae-ft-mse` layout): widths
    /// `[128, 256, 512, 512]`, 2 layers per block, 4 latent channels, 32 groups,
    /// `quant_conv` and `post_quant_conv`, scaling 0.18215, sample size 512.
    pub fn sd() -> Self {
        Self {
            in_channels: 3,
            out_channels: 3,
            latent_channels: 4,
            block_out_channels: vec![128, 256, 512, 512],
            layers_per_block: 2,
            norm_num_groups: 32,
            act_fn: "silu".into(),
            up_block_types: vec![UP_DECODER_BLOCK.into(); 4],
            use_quant_conv: true,
            use_post_quant_conv: true,
            mid_block_add_attention: true,
            scaling_factor: 0.18215,
            shift_factor: None,
            sample_size: 512,
            force_upcast: true,
        }
    }

    /// The Flux.1 VAE: SD's widths with 16 latent channels, no `quant_conv` /
    /// `post_quant_conv`, scaling 0.3611, shift 0.1159, sample size 1024.
    pub fn flux() -> Self {
        Self {
            latent_channels: 16,
            use_quant_conv: false,
            use_post_quant_conv: false,
            scaling_factor: 0.3611,
            shift_factor: Some(0.1159),
            sample_size: 1024,
            ..Self::sd()
        }
    }

    /// Reads and validates a Diffusers `config.json`.
    pub fn from_file(path: &Path) -> LoadResult<Self> {
        let text = crate::weights::read_text_file(path)?;
        Self::from_json(&text, path)
    }

    /// Parses and validates config JSON; `origin` names the file in errors.
    pub fn from_json(text: &str, origin: &Path) -> LoadResult<Self> {
        let mut config: Self = serde_json::from_str(text).map_err(|e| LoadError::Config {
            file: origin.to_path_buf(),
            message: format!("{e}; expected a Diffusers AutoencoderKL config.json"),
        })?;
        if config.up_block_types.is_empty() {
            config.up_block_types = vec![UP_DECODER_BLOCK.into(); config.block_out_channels.len()];
        }
        config.validate()?;
        Ok(config)
    }

    /// Checks what the decoder needs: positive channel counts, widths divisible by the
    /// group count, `silu`, one `UpDecoderBlock2D` per width, a usable scaling factor.
    pub fn validate(&self) -> LoadResult<()> {
        let invalid = |field: &str, value: String, hint: &str| LoadError::InvalidConfig {
            field: field.into(),
            value,
            hint: hint.into(),
        };
        for (field, v) in [
            ("in_channels", self.in_channels),
            ("out_channels", self.out_channels),
            ("latent_channels", self.latent_channels),
            ("norm_num_groups", self.norm_num_groups),
            ("sample_size", self.sample_size),
        ] {
            if v == 0 {
                return Err(invalid(field, "0".into(), "must be positive"));
            }
        }
        if self.block_out_channels.is_empty() {
            return Err(invalid(
                "block_out_channels",
                "[]".into(),
                "give at least one width, e.g. [128, 256, 512, 512]",
            ));
        }
        if let Some(c) = self
            .block_out_channels
            .iter()
            .find(|&&c| c == 0 || !c.is_multiple_of(self.norm_num_groups))
        {
            return Err(invalid(
                "block_out_channels",
                format!("{:?}", self.block_out_channels),
                &format!(
                    "every width must be positive and divisible by norm_num_groups = {} (found {c})",
                    self.norm_num_groups
                ),
            ));
        }
        if !matches!(self.act_fn.as_str(), "silu" | "swish") {
            return Err(invalid(
                "act_fn",
                self.act_fn.clone(),
                "DDO's AutoencoderKL supports `silu` only",
            ));
        }
        if let Some(t) = self.up_block_types.iter().find(|t| *t != UP_DECODER_BLOCK) {
            return Err(invalid(
                "up_block_types",
                t.clone(),
                "DDO's AutoencoderKL supports `UpDecoderBlock2D` only",
            ));
        }
        if self.up_block_types.len() != self.block_out_channels.len() {
            return Err(invalid(
                "up_block_types",
                format!("{:?}", self.up_block_types),
                &format!(
                    "give one up block per entry of block_out_channels ({})",
                    self.block_out_channels.len()
                ),
            ));
        }
        if !self.scaling_factor.is_finite() || self.scaling_factor == 0.0 {
            return Err(invalid(
                "scaling_factor",
                self.scaling_factor.to_string(),
                "must be finite and non-zero",
            ));
        }
        if let Some(s) = self.shift_factor
            && !s.is_finite()
        {
            return Err(invalid(
                "shift_factor",
                s.to_string(),
                "must be finite (or null)",
            ));
        }
        Ok(())
    }

    /// Pixels per latent along each axis: `2^(len(block_out_channels) - 1)`.
    pub fn upsample_factor(&self) -> usize {
        1usize << self.block_out_channels.len().saturating_sub(1)
    }

    /// The decoded image's shape for latents of `latent_shape` (`[b, c, h, w]`).
    pub fn output_shape(&self, latent_shape: &[usize]) -> Vec<usize> {
        let f = self.upsample_factor();
        match latent_shape {
            [b, _, h, w] => vec![*b, self.out_channels, h * f, w * f],
            _ => Vec::new(),
        }
    }

    /// What pipelines do before `decode`: `latents / scaling_factor (+ shift_factor)`,
    /// computed as PyTorch does it (a division by the f32 scaling factor, then an
    /// addition), in the dtype of `latents`, on the device of `ops`.
    pub fn unscale_latents(&self, ops: &dyn Ops, latents: &Tensor) -> Result<Tensor> {
        let s = ops.tensor_from_f32(&[1], DType::F32, &[self.scaling_factor as f32])?;
        let scaled = ops.binary(latents, &s, BinaryOp::Div)?;
        match self.shift_factor {
            Some(shift) => ops.affine(&scaled, 1.0, shift as f32),
            None => Ok(scaled),
        }
    }
}

/// Tiled decoding, as Diffusers' `AutoencoderKL.tiled_decode` with the model's
/// `tile_latent_min_size`, `tile_sample_min_size` and `tile_overlap_factor` attributes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TilingConfig {
    /// Latent tile size (Diffusers: `int(sample_size / 2^(len(block_out_channels) - 1))`).
    pub tile_latent_min_size: usize,
    /// Decoded tile size (Diffusers: `sample_size`).
    pub tile_sample_min_size: usize,
    /// Overlap between neighbouring tiles, as a fraction (Diffusers: 0.25).
    pub tile_overlap_factor: f64,
}

impl TilingConfig {
    /// Diffusers' defaults for `config`.
    pub fn from_config(config: &AutoencoderKLConfig) -> Self {
        let levels = config.block_out_channels.len().saturating_sub(1) as i32;
        Self {
            // `int(sample_size / (2 ** levels))`: a float division, truncated.
            tile_latent_min_size: (config.sample_size as f64 / 2f64.powi(levels)) as usize,
            tile_sample_min_size: config.sample_size,
            tile_overlap_factor: 0.25,
        }
    }

    /// Latent stride between tile starts: `int(tile_latent_min_size * (1 - overlap))`.
    pub fn overlap_size(&self) -> usize {
        (self.tile_latent_min_size as f64 * (1.0 - self.tile_overlap_factor)) as usize
    }

    /// Pixels blended across a seam: `int(tile_sample_min_size * overlap)`.
    pub fn blend_extent(&self) -> usize {
        (self.tile_sample_min_size as f64 * self.tile_overlap_factor) as usize
    }

    /// Pixels kept of each tile along each axis: `tile_sample_min_size - blend_extent`.
    pub fn row_limit(&self) -> usize {
        self.tile_sample_min_size
            .saturating_sub(self.blend_extent())
    }

    /// Whether Diffusers would tile latents of `h × w` (`_decode`: either side larger
    /// than `tile_latent_min_size`).
    pub fn needs_tiling(&self, h: usize, w: usize) -> bool {
        h > self.tile_latent_min_size || w > self.tile_latent_min_size
    }

    /// Refuses values for which Diffusers' loop would not make progress or crop nothing.
    pub fn validate(&self) -> Result<()> {
        let bad = |option: &str, value: String, hint: &str| CoreError::InvalidOption {
            option: option.into(),
            value,
            hint: hint.into(),
        };
        if self.tile_latent_min_size == 0 || self.tile_sample_min_size == 0 {
            return Err(bad(
                "tile size",
                format!(
                    "{}/{}",
                    self.tile_latent_min_size, self.tile_sample_min_size
                ),
                "tile_latent_min_size and tile_sample_min_size must be positive",
            ));
        }
        if !(0.0..1.0).contains(&self.tile_overlap_factor) {
            return Err(bad(
                "tile_overlap_factor",
                self.tile_overlap_factor.to_string(),
                "must lie in [0, 1)",
            ));
        }
        if self.overlap_size() == 0 || self.row_limit() == 0 {
            return Err(bad(
                "tile_overlap_factor",
                self.tile_overlap_factor.to_string(),
                "leaves no stride between tiles or nothing of a tile; lower it or use larger tiles",
            ));
        }
        Ok(())
    }

    /// Latent offsets of tile starts along an axis of `len`: `range(0, len, overlap_size)`.
    pub fn tile_starts(&self, len: usize) -> Vec<usize> {
        (0..len).step_by(self.overlap_size().max(1)).collect()
    }
}

/// Runs `f` on `x`, then drops `x`: an intermediate is freed as soon as the op consuming
/// it has produced its output (the lifetimes [`estimate_decode_peak_bytes`] models).
fn consume<T>(x: Tensor, f: impl FnOnce(&Tensor) -> Result<T>) -> Result<T> {
    f(&x)
}

/// Diffusers' `ResnetBlock2D` without time embedding.
#[derive(Debug, Clone, Copy)]
struct ResnetBlock {
    norm1: GroupNorm,
    conv1: Conv2d,
    norm2: GroupNorm,
    conv2: Conv2d,
    conv_shortcut: Option<Conv2d>,
}

impl ResnetBlock {
    fn build(
        b: &mut ModelBuilder<'_>,
        name: &str,
        cin: usize,
        cout: usize,
        groups: usize,
    ) -> LoadResult<Self> {
        b.scope(name, |b| {
            Ok(Self {
                norm1: GroupNorm::build(b, "norm1", groups, cin, NORM_EPS)?,
                conv1: Conv2d::build(b, "conv1", cin, cout, 3, 1, 1, true)?,
                norm2: GroupNorm::build(b, "norm2", groups, cout, NORM_EPS)?,
                conv2: Conv2d::build(b, "conv2", cout, cout, 3, 1, 1, true)?,
                conv_shortcut: if cin != cout {
                    Some(Conv2d::build(b, "conv_shortcut", cin, cout, 1, 1, 0, true)?)
                } else {
                    None
                },
            })
        })
    }

    /// `x` stays live until the residual addition (or the shortcut conv).
    fn forward(&self, ctx: &mut ForwardContext<'_>, x: Tensor) -> Result<Tensor> {
        let h = self.norm1.forward_silu(ctx, &x)?;
        let h = consume(h, |h| self.conv1.forward(ctx, h))?;
        let h = consume(h, |h| self.norm2.forward_silu(ctx, h))?;
        let h = consume(h, |h| self.conv2.forward(ctx, h))?;
        let residual = match &self.conv_shortcut {
            Some(c) => consume(x, |x| c.forward(ctx, x))?,
            None => x,
        };
        ops(ctx)?.binary(&residual, &h, BinaryOp::Add)
    }
}

/// Diffusers' `Attention` as the VAE mid block builds it: one head over all channels,
/// group norm in front, residual connection, `AttnProcessor2_0`.
#[derive(Debug, Clone, Copy)]
struct MidAttention {
    group_norm: GroupNorm,
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    to_out: Linear,
}

impl MidAttention {
    fn build(
        b: &mut ModelBuilder<'_>,
        name: &str,
        channels: usize,
        groups: usize,
    ) -> LoadResult<Self> {
        b.scope(name, |b| {
            let group_norm = GroupNorm::build(b, "group_norm", groups, channels, NORM_EPS)?;
            let to_q = Linear::build(b, "to_q", channels, channels, true)?;
            let to_k = Linear::build(b, "to_k", channels, channels, true)?;
            let to_v = Linear::build(b, "to_v", channels, channels, true)?;
            b.enter_blocks("to_out");
            let to_out = Linear::build(b, "0", channels, channels, true)?;
            b.exit();
            Ok(Self {
                group_norm,
                to_q,
                to_k,
                to_v,
                to_out,
            })
        })
    }

    fn forward(&self, ctx: &mut ForwardContext<'_>, x: Tensor) -> Result<Tensor> {
        let o = ops(ctx)?;
        let (b, c, h, w) = dims4(&x, "mid-block attention")?;
        let hw = h * w;
        // [b, c, h, w] -> [b, c, hw] -> [b, hw, c]
        let normed = self.group_norm.forward(ctx, &x)?;
        let tokens = consume(normed, |n| o.permute(&n.reshape(&[b, c, hw])?, &[0, 2, 1]))?;
        let (q, k, v) = consume(tokens, |t| {
            Ok((
                self.to_q.forward(ctx, t)?,
                self.to_k.forward(ctx, t)?,
                self.to_v.forward(ctx, t)?,
            ))
        })?;
        let attended = {
            let heads = [b, 1, hw, c];
            let (q, k, v) = (view(q, &heads)?, view(k, &heads)?, view(v, &heads)?);
            // SDPA's default scale, 1/sqrt(head_dim); head_dim = c (one head).
            o.attention(&q, &k, &v, None, 1.0 / (c as f32).sqrt())?
        };
        let projected = {
            let attended = view(attended, &[b, hw, c])?;
            self.to_out.forward(ctx, &attended)?
        };
        let back = consume(projected, |p| {
            o.permute(p, &[0, 2, 1])?.reshape(&[b, c, h, w])
        })?;
        // hidden_states + residual, then / rescale_output_factor (1: exact, skipped).
        o.binary(&back, &x, BinaryOp::Add)
    }
}

/// `t` viewed as `shape`, consuming the original handle (the view keeps the storage).
fn view(t: Tensor, shape: &[usize]) -> Result<Tensor> {
    t.reshape(shape)
}

/// `UNetMidBlock2D` with one layer: resnet, attention, resnet.
#[derive(Debug, Clone, Copy)]
struct MidBlock {
    resnet0: ResnetBlock,
    attention: Option<MidAttention>,
    resnet1: ResnetBlock,
}

/// `UpDecoderBlock2D`: resnets, then the optional `Upsample2D` (nearest ×2 + conv).
#[derive(Debug, Clone)]
struct UpBlock {
    resnets: Vec<ResnetBlock>,
    upsampler: Option<Conv2d>,
}

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

fn dims4(x: &Tensor, what: &str) -> Result<(usize, usize, usize, usize)> {
    match x.shape() {
        [b, c, h, w] => Ok((*b, *c, *h, *w)),
        s => Err(CoreError::Shape {
            what: what.into(),
            message: format!("expected a [batch, channels, height, width] tensor, got {s:?}"),
        }),
    }
}

impl DecoderProgram {
    /// `post_quant_conv` (when present) and the decoder on `z`, a device tensor in the
    /// weights' dtype.
    fn decode_tile(&self, ctx: &mut ForwardContext<'_>, z: &Tensor) -> Result<Tensor> {
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
    fn prepare(&self, ctx: &ForwardContext<'_>, latents: &Tensor) -> Result<Tensor> {
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

    fn decode_untiled(&self, ctx: &mut ForwardContext<'_>, latents: &Tensor) -> Result<Tensor> {
        let z = self.prepare(ctx, latents)?;
        self.decode_tile(ctx, &z)
    }

    /// Diffusers' `tiled_decode`: tiles of `tile_latent_min_size` latents every
    /// `overlap_size`, each decoded on its own; then, row-major, each decoded tile is
    /// blended in place with the (already blended) tile above, then with the one to its
    /// left, cropped to `row_limit`, and the crops are concatenated. Rows are decoded and
    /// blended one at a time (a row needs only the row above), which gives the same
    /// values as decoding every tile first.
    fn decode_tiled(
        &self,
        ctx: &mut ForwardContext<'_>,
        latents: &Tensor,
        tiling: &TilingConfig,
    ) -> Result<Tensor> {
        tiling.validate()?;
        let z = self.prepare(ctx, latents)?;
        let (_, _, h, w) = dims4(&z, "latents")?;
        let o = ops(ctx)?;
        let (size, extent, limit) = (
            tiling.tile_latent_min_size,
            tiling.blend_extent(),
            tiling.row_limit(),
        );
        let mut above: Vec<Tensor> = Vec::new();
        let mut rows: Vec<Tensor> = Vec::new();
        for i in tiling.tile_starts(h) {
            let mut current: Vec<Tensor> = Vec::new();
            let mut crops: Vec<Tensor> = Vec::new();
            for (col, j) in tiling.tile_starts(w).into_iter().enumerate() {
                let tile = {
                    let band = o.narrow(&z, 2, i, size.min(h - i))?;
                    o.narrow(&band, 3, j, size.min(w - j))?
                };
                let mut decoded = self.decode_tile(ctx, &tile)?;
                drop(tile);
                if let Some(a) = above.get(col) {
                    decoded = blend(o, a, decoded, extent, 2)?;
                }
                if let Some(left) = current.last() {
                    decoded = blend(o, left, decoded, extent, 3)?;
                }
                crops.push(crop(o, &decoded, limit)?);
                current.push(decoded);
            }
            above = current;
            rows.push(concat(o, crops, 3)?);
        }
        drop(above);
        concat(o, rows, 2)
    }
}

/// `blend_v` (`dim` 2) or `blend_h` (`dim` 3): the first `e = min(a, b, extent)` rows
/// (columns) of `b` become `a[-e + y] * (1 - y/e) + b[y] * (y/e)`. The weights are computed
/// in f64 and applied as f32 scalars, as PyTorch applies Python floats to a tensor.
fn blend(o: &dyn Ops, a: &Tensor, b: Tensor, extent: usize, dim: usize) -> Result<Tensor> {
    let (a_len, b_len) = (a.shape()[dim], b.shape()[dim]);
    let e = extent.min(a_len).min(b_len);
    if e == 0 {
        return Ok(b);
    }
    let mut shape = vec![1usize; 4];
    shape[dim] = e;
    let y_over_e: Vec<f64> = (0..e).map(|y| y as f64 / e as f64).collect();
    let wa: Vec<f32> = y_over_e.iter().map(|t| (1.0 - t) as f32).collect();
    let wb: Vec<f32> = y_over_e.iter().map(|&t| t as f32).collect();
    let wa = o.tensor_from_f32(&shape, DType::F32, &wa)?;
    let wb = o.tensor_from_f32(&shape, DType::F32, &wb)?;
    let head = {
        let a_tail = o.narrow(a, dim, a_len - e, e)?;
        let from_a = o.binary(&a_tail, &wa, BinaryOp::Mul)?;
        drop(a_tail);
        let b_head = o.narrow(&b, dim, 0, e)?;
        let from_b = o.binary(&b_head, &wb, BinaryOp::Mul)?;
        drop(b_head);
        o.binary(&from_a, &from_b, BinaryOp::Add)?
    };
    if e == b_len {
        return Ok(head);
    }
    let rest = o.narrow(&b, dim, e, b_len - e)?;
    drop(b);
    o.concat(&[&head, &rest], dim)
}

/// `tile[:, :, :limit, :limit]`.
fn crop(o: &dyn Ops, t: &Tensor, limit: usize) -> Result<Tensor> {
    let (_, _, h, w) = dims4(t, "tile")?;
    let rows = o.narrow(t, 2, 0, limit.min(h))?;
    o.narrow(&rows, 3, 0, limit.min(w))
}

fn concat(o: &dyn Ops, mut parts: Vec<Tensor>, dim: usize) -> Result<Tensor> {
    if parts.len() == 1
        && let Some(only) = parts.pop()
    {
        return Ok(only);
    }
    let refs: Vec<&Tensor> = parts.iter().collect();
    o.concat(&refs, dim)
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

fn build_up_blocks(
    b: &mut ModelBuilder<'_>,
    widths: &[usize],
    layers_per_block: usize,
    groups: usize,
) -> LoadResult<Vec<UpBlock>> {
    let mut blocks = Vec::with_capacity(widths.len());
    let mut prev = widths[0];
    for (i, &out) in widths.iter().enumerate() {
        let last = i + 1 == widths.len();
        let block = b.scope(i.to_string(), |b| {
            b.enter_blocks("resnets");
            let resnets = (0..=layers_per_block)
                .map(|k| {
                    let cin = if k == 0 { prev } else { out };
                    ResnetBlock::build(b, &k.to_string(), cin, out, groups)
                })
                .collect::<LoadResult<Vec<ResnetBlock>>>()?;
            b.exit();
            let upsampler = if last {
                None
            } else {
                b.enter_blocks("upsamplers");
                let conv = b.scope("0", |b| Conv2d::build(b, "conv", out, out, 3, 1, 1, true))?;
                b.exit();
                Some(conv)
            };
            Ok(UpBlock { resnets, upsampler })
        })?;
        blocks.push(block);
        prev = out;
    }
    Ok(blocks)
}

/// Live-byte bookkeeping of a simulated forward; `device` answers what each convolution
/// allocates besides its output ([`Device::conv2d_scratch_bytes`]; none without one).
struct PeakSim<'a> {
    elem: u64,
    dtype: DType,
    live: u64,
    peak: u64,
    device: Option<&'a dyn Device>,
}

impl<'a> PeakSim<'a> {
    fn new(dtype: DType, device: Option<&'a dyn Device>) -> Self {
        Self {
            elem: dtype.size_in_bytes() as u64,
            dtype,
            live: 0,
            peak: 0,
            device,
        }
    }

    /// A `k × k` convolution from `cin` to `cout` channels over `hw` elements per channel:
    /// its output, then the backend's scratch on top while it runs; frees `input`.
    fn conv(&mut self, input: u64, cin: usize, cout: usize, k: usize, hw: usize) -> u64 {
        let out = self.alloc(cout * hw);
        let scratch = self
            .device
            .map_or(0, |d| d.conv2d_scratch_bytes(hw, cin, cout, k, self.dtype));
        self.peak = self.peak.max(self.live + scratch);
        self.free(input);
        out
    }

    fn alloc(&mut self, elems: usize) -> u64 {
        let bytes = elems as u64 * self.elem;
        self.live += bytes;
        self.peak = self.peak.max(self.live);
        bytes
    }
    fn free(&mut self, bytes: u64) {
        self.live -= bytes;
    }
    fn alloc_f32(&mut self, elems: usize) -> u64 {
        let bytes = elems as u64 * 4;
        self.live += bytes;
        self.peak = self.peak.max(self.live);
        bytes
    }

    /// `blend` of a decoded tile of `len` along the blended axis and `cross` across it,
    /// `planes = batch × channels`, over `e` lines; returns the blended tile's bytes.
    fn blend(&mut self, dec: u64, planes: usize, e: usize, len: usize, cross: usize) -> u64 {
        if e == 0 {
            return dec;
        }
        let weights = self.alloc_f32(2 * e);
        let a_tail = self.alloc(planes * e * cross);
        let from_a = self.step(a_tail, planes * e * cross);
        let b_head = self.alloc(planes * e * cross);
        let from_b = self.step(b_head, planes * e * cross);
        let head = self.alloc(planes * e * cross);
        self.free(from_a + from_b);
        let out = if e == len {
            self.free(dec);
            head
        } else {
            let rest = self.alloc(planes * (len - e) * cross);
            self.free(dec);
            let joined = self.alloc(planes * len * cross);
            self.free(head + rest);
            joined
        };
        self.free(weights);
        out
    }

    /// An op that reads `input` (freed afterwards) and writes `out` elements.
    fn step(&mut self, input: u64, out: usize) -> u64 {
        let b = self.alloc(out);
        self.free(input);
        b
    }

    /// `group_norm_silu` counts as the host's composition (group norm's output, then the
    /// SiLU's); a fused backend (CUDA) never holds the first, so its live bytes there are
    /// lower. For the Flux VAE in bf16 on CUDA the peak is at a convolution (input, output
    /// and its channels-last scratch), which the fusion does not change.
    fn resnet(&mut self, x: u64, cin: usize, cout: usize, hw: usize) -> u64 {
        let mut h = self.alloc(cin * hw); // norm1
        h = self.step(h, cin * hw); // silu
        h = self.conv(h, cin, cout, 3, hw); // conv1
        h = self.step(h, cout * hw); // norm2
        h = self.step(h, cout * hw); // silu
        h = self.conv(h, cout, cout, 3, hw); // conv2
        let residual = if cin != cout {
            self.conv(x, cin, cout, 1, hw)
        } else {
            x
        };
        let out = self.alloc(cout * hw);
        self.free(residual);
        self.free(h);
        out
    }

    fn attention(&mut self, x: u64, c: usize, hw: usize) -> u64 {
        let normed = self.alloc(c * hw);
        let tokens = self.step(normed, c * hw); // permute
        let qkv = self.alloc(3 * c * hw);
        self.free(tokens);
        let attended = self.step(qkv, c * hw);
        let projected = self.step(attended, c * hw);
        let back = self.step(projected, c * hw); // permute
        let out = self.alloc(c * hw);
        self.free(back);
        self.free(x);
        out
    }

    /// The decoder on a `[b, latent, h, w]` tile that stays live; returns the output bytes.
    fn decoder(&mut self, config: &AutoencoderKLConfig, b: usize, h: usize, w: usize) -> u64 {
        let widths: Vec<usize> = config.block_out_channels.iter().rev().copied().collect();
        let top = widths[0];
        let lc = config.latent_channels;
        let mut hw = b * h * w;
        let mut x = if config.use_post_quant_conv {
            let z = self.alloc(lc * hw);
            self.conv(z, lc, top, 3, hw)
        } else {
            // conv_in reads the latents, live for the whole decode.
            let out = self.alloc(top * hw);
            let scratch = self
                .device
                .map_or(0, |d| d.conv2d_scratch_bytes(hw, lc, top, 3, self.dtype));
            self.peak = self.peak.max(self.live + scratch);
            out
        };
        x = self.resnet(x, top, top, hw);
        if config.mid_block_add_attention {
            x = self.attention(x, top, hw);
        }
        x = self.resnet(x, top, top, hw);
        let mut prev = top;
        for (i, &out) in widths.iter().enumerate() {
            for k in 0..=config.layers_per_block {
                let cin = if k == 0 { prev } else { out };
                x = self.resnet(x, cin, out, hw);
            }
            if i + 1 < widths.len() {
                hw *= 4;
                let up = self.step(x, out * hw);
                x = self.conv(up, out, out, 3, hw);
            }
            prev = out;
        }
        let last = widths[widths.len() - 1];
        x = self.step(x, last * hw); // conv_norm_out
        x = self.step(x, last * hw); // silu
        self.conv(x, last, config.out_channels, 3, hw)
    }
}

/// Predicted peak of the decoder's activations on the execution device, in bytes, for an
/// untiled decode of latents `[b, c, h, w]` stored as `dtype`.
///
/// How it is computed: a dry run of exactly the op sequence [`AutoencoderKL::decode`]
/// runs, with the same tensor lifetimes (each op allocates its output, and an
/// intermediate is freed as soon as the op that consumes it has produced its output;
/// a resnet's input stays live until the residual addition, the attention's input until
/// its residual addition). The peak of the live bytes over the run is returned. It
/// includes the latents (on the device for the whole decode) and the decoded image;
/// it excludes the weights (add `component.param_bytes()`, or what the route keeps on the
/// device) and backend scratch that is not a tensor (im2col or attention workspaces, which
/// the host backend keeps in host memory). Reshapes are views and cost nothing. The peak
/// usually falls in the last upsampler or the first resnet after it, where a tensor of
/// the full output resolution at a wide channel count is live with its input.
/// A shape that is not 4-D gives 0.
pub fn estimate_decode_peak_bytes(
    config: &AutoencoderKLConfig,
    latent_shape: &[usize],
    dtype: DType,
) -> u64 {
    estimate_decode_peak_bytes_on(None, config, latent_shape, dtype)
}

/// [`estimate_decode_peak_bytes`] on `device`: each convolution's scratch
/// ([`Device::conv2d_scratch_bytes`]: on CUDA the channels-last copy of a bf16 input, as
/// large as the input) counts on top of the tensors live while it runs. `None`, or the host
/// backend: the tensors alone, which is that backend's exact peak.
pub fn estimate_decode_peak_bytes_on(
    device: Option<&dyn Device>,
    config: &AutoencoderKLConfig,
    latent_shape: &[usize],
    dtype: DType,
) -> u64 {
    let [b, c, h, w] = *latent_shape else {
        return 0;
    };
    if beyond_any_device(config, latent_shape) {
        return u64::MAX;
    }
    let mut sim = PeakSim::new(dtype, device);
    sim.alloc(b * c * h * w); // the latents
    sim.decoder(config, b, h, w);
    sim.peak
}

/// Whether a decode of `latent_shape` is beyond any device: the widest channel count at the
/// full output resolution above 2^40 elements (2 TiB in bf16). The estimates then say
/// `u64::MAX` (which no budget holds) instead of overflowing their element counts or
/// walking billions of tiles.
fn beyond_any_device(config: &AutoencoderKLConfig, latent_shape: &[usize]) -> bool {
    let widest = config
        .block_out_channels
        .iter()
        .copied()
        .chain([config.latent_channels, config.out_channels])
        .max()
        .unwrap_or(1);
    let upscale = 1usize << (2 * config.block_out_channels.len().saturating_sub(1)).min(62);
    latent_shape
        .iter()
        .copied()
        .chain([widest, upscale])
        .try_fold(1usize, usize::checked_mul)
        .is_none_or(|n| n as u64 > 1 << 40)
}

/// [`estimate_decode_peak_bytes`] for a tiled decode with `tiling` (untiled when the
/// latents fit in one tile, as [`AutoencoderKL::decode`] decides). A dry run of the tiled
/// loop with the same lifetimes: the latents, the blended tiles of the row above and of
/// the current row, the crops and finished rows so far, one tile's decode on top, the
/// blends (f32 weights included), the crops and the concatenations.
pub fn estimate_tiled_decode_peak_bytes(
    config: &AutoencoderKLConfig,
    latent_shape: &[usize],
    dtype: DType,
    tiling: &TilingConfig,
) -> u64 {
    estimate_tiled_decode_peak_bytes_on(None, config, latent_shape, dtype, tiling)
}

/// Tiles above which [`estimate_tiled_decode_peak_bytes_on`] gives a closed-form bound
/// ([`tiled_decode_bound`]) instead of a dry run of every tile: a decode of more tiles is
/// days of work on any device, and walking millions of tiles would make a plan that refuses
/// it take minutes and gigabytes.
const MAX_SIMULATED_TILES: usize = 1 << 16;

/// Rows and columns of Diffusers' tile loop over latents of `h × w`.
fn tile_grid(tiling: &TilingConfig, h: usize, w: usize) -> (usize, usize) {
    let stride = tiling.overlap_size().max(1);
    (h.div_ceil(stride), w.div_ceil(stride))
}

/// An upper bound of the tiled decode's peak that does not walk the tiles: the latents,
/// one full tile's decode (its input band and the device's convolution scratch included,
/// as the dry run counts them), the blends' and crop's transients of one tile, two rows of
/// blended tiles, the current row's crops and their concatenation, and the finished image
/// twice (its rows, then their concatenation). Each term is at least what the dry run has
/// live for it, so the bound is never below the dry run's peak (tested).
fn tiled_decode_bound(
    device: Option<&dyn Device>,
    config: &AutoencoderKLConfig,
    latent_shape: &[usize],
    dtype: DType,
    tiling: &TilingConfig,
) -> u64 {
    let [b, c, h, w] = *latent_shape else {
        return 0;
    };
    let elem = dtype.size_in_bytes() as u64;
    let bytes = |dims: &[usize]| {
        dims.iter()
            .fold(elem, |acc, &d| acc.saturating_mul(d as u64))
    };
    let f = config.upsample_factor();
    let oc = config.out_channels;
    let size = tiling.tile_latent_min_size;
    let (th, tw) = (size.min(h), size.min(w));
    let mut one = PeakSim::new(dtype, device);
    let band = one.alloc(b * c * th * w);
    let tile = one.step(band, b * c * th * tw);
    one.decoder(config, b, th, tw);
    one.free(tile);
    let (rows, cols) = tile_grid(tiling, h, w);
    let limit = tiling.row_limit();
    let tile_out = bytes(&[b, oc, th * f, tw * f]);
    let blend_weights = 2 * 4 * 2 * tiling.blend_extent() as u64;
    let image = bytes(&[
        b,
        oc,
        rows.saturating_mul(limit),
        cols.saturating_mul(limit),
    ]);
    [
        bytes(&[b, c, h, w]),
        one.peak,
        tile_out.saturating_mul(7),
        blend_weights,
        tile_out.saturating_mul(cols as u64).saturating_mul(4),
        image.saturating_mul(2),
    ]
    .into_iter()
    .fold(0u64, u64::saturating_add)
}

/// [`estimate_tiled_decode_peak_bytes`] on `device`, its convolutions' scratch counted as
/// [`estimate_decode_peak_bytes_on`] counts it.
pub fn estimate_tiled_decode_peak_bytes_on(
    device: Option<&dyn Device>,
    config: &AutoencoderKLConfig,
    latent_shape: &[usize],
    dtype: DType,
    tiling: &TilingConfig,
) -> u64 {
    let [b, c, h, w] = *latent_shape else {
        return 0;
    };
    if !tiling.needs_tiling(h, w) || tiling.validate().is_err() {
        return estimate_decode_peak_bytes_on(device, config, latent_shape, dtype);
    }
    if beyond_any_device(config, latent_shape) {
        return u64::MAX;
    }
    let (rows, cols) = tile_grid(tiling, h, w);
    if rows.saturating_mul(cols) > MAX_SIMULATED_TILES {
        return tiled_decode_bound(device, config, latent_shape, dtype, tiling);
    }
    let f = config.upsample_factor();
    let oc = config.out_channels;
    let (size, extent, limit) = (
        tiling.tile_latent_min_size,
        tiling.blend_extent(),
        tiling.row_limit(),
    );
    let mut sim = PeakSim::new(dtype, device);
    sim.alloc(b * c * h * w);
    // (bytes, height, width) of the blended, uncropped tiles of the row above.
    let mut above: Vec<(u64, usize, usize)> = Vec::new();
    let mut rows: Vec<u64> = Vec::new();
    let (mut out_h, mut out_w) = (0usize, 0usize);
    for i in tiling.tile_starts(h) {
        let th = size.min(h - i);
        let mut current: Vec<(u64, usize, usize)> = Vec::new();
        let mut crops: Vec<u64> = Vec::new();
        let mut row_w = 0usize;
        for (col, j) in tiling.tile_starts(w).into_iter().enumerate() {
            let tw = size.min(w - j);
            let band = sim.alloc(b * c * th * w);
            let tile = sim.step(band, b * c * th * tw);
            let mut dec = sim.decoder(config, b, th, tw);
            sim.free(tile);
            let (ph, pw) = (th * f, tw * f);
            if let Some(&(_, ah, _)) = above.get(col) {
                dec = sim.blend(dec, b * oc, extent.min(ah).min(ph), ph, pw);
            }
            if let Some(&(_, _, lw)) = current.last() {
                dec = sim.blend(dec, b * oc, extent.min(lw).min(pw), pw, ph);
            }
            let (ch, cw) = (limit.min(ph), limit.min(pw));
            let rows_only = sim.alloc(b * oc * ch * pw);
            crops.push(sim.step(rows_only, b * oc * ch * cw));
            current.push((dec, ph, pw));
            row_w += cw;
        }
        for (bytes, _, _) in above.drain(..) {
            sim.free(bytes);
        }
        above = current;
        let row_h = limit.min(th * f);
        let row = if crops.len() == 1 {
            crops[0]
        } else {
            let r = sim.alloc(b * oc * row_h * row_w);
            sim.free(crops.iter().sum());
            r
        };
        rows.push(row);
        out_h += row_h;
        out_w = row_w;
    }
    for (bytes, _, _) in above.drain(..) {
        sim.free(bytes);
    }
    if rows.len() > 1 {
        sim.alloc(b * oc * out_h * out_w);
    }
    sim.peak
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The closed-form bound is never below the dry run, for the Flux VAE and a small
    /// two-level one, over grids from two tiles to a few hundred, edge tiles included; and a
    /// decode of 178 million tiles gets a bound (finite, at least its image) without a walk.
    #[test]
    fn the_tiled_bound_holds_the_dry_run_and_needs_no_walk() {
        let small = AutoencoderKLConfig {
            block_out_channels: vec![8, 16],
            norm_num_groups: 4,
            up_block_types: vec![UP_DECODER_BLOCK.into(); 2],
            sample_size: 32,
            layers_per_block: 1,
            latent_channels: 4,
            ..AutoencoderKLConfig::flux()
        };
        for config in [AutoencoderKLConfig::flux(), small.clone()] {
            let tiling = TilingConfig::from_config(&config);
            let size = tiling.tile_latent_min_size;
            for (h, w) in [
                (size + 1, size),
                (2 * size + 3, 5 * size - 1),
                (7 * size, 3),
                (4, 20 * size + 5),
            ] {
                let shape = [2, config.latent_channels, h, w];
                for dtype in [DType::F32, DType::BF16] {
                    let exact = estimate_tiled_decode_peak_bytes(&config, &shape, dtype, &tiling);
                    let bound = tiled_decode_bound(None, &config, &shape, dtype, &tiling);
                    assert!(
                        exact <= bound && bound < 64 * exact,
                        "{shape:?} {dtype:?}: dry run {exact}, bound {bound}"
                    );
                }
            }
        }
        // The fixture pipeline's VAE at 2^30 latent rows: 89 million tiles.
        let tiling = TilingConfig::from_config(&small);
        let huge = [1, small.latent_channels, 1 << 30, 2];
        let (rows, cols) = tile_grid(&tiling, huge[2], huge[3]);
        assert!(rows * cols > MAX_SIMULATED_TILES);
        let est = estimate_tiled_decode_peak_bytes(&small, &huge, DType::F32, &tiling);
        let f = small.upsample_factor();
        let image = (huge[2] * f * 2 * f * small.out_channels) as u64 * 4;
        assert!(est >= image && est < u64::MAX, "{est}");
    }
}
