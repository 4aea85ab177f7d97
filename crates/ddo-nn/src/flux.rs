//! Diffusers' `FluxTransformer2DModel` (FLUX.1 dev/schnell): double-stream (MMDiT) blocks,
//! then single-stream blocks, with adaLN-Zero modulation from the timestep, guidance and
//! pooled text embedding, and 3-axis rotary position embeddings.
//!
//! Parameter names are Diffusers' exactly (`transformer_blocks.0.attn.to_q.weight`, ...), so a
//! Diffusers checkpoint folder loads as is ([`FluxTransformer::load`]). The two block lists
//! are built as block lists of the component tree, one child container per block, so
//! block-level offload groups them as Diffusers' `ModuleList`s are grouped.
//!
//! What has no weights runs on the host and is uploaded: the sinusoidal timestep projection
//! ([`timestep_embedding`]) and the rotary tables ([`rope_tables`]). Everything else runs
//! through the device's [`Ops`], every leaf through [`ForwardContext::run_leaf`].
//!
//! Also here: FluxPipeline's latent packing helpers ([`pack_latents`], [`unpack_latents`],
//! [`latent_image_ids`]).

use std::path::Path;
use std::sync::Arc;

use ddo_core::{
    BinaryOp, Component, ComponentProgram, CoreError, DType, Device, ForwardContext, Ops, Result,
    Tensor, UnaryOp, ops_of,
};
use half::{bf16, f16};
use serde::Deserialize;

use crate::builder::ModelBuilder;
use crate::error::{LoadError, LoadResult};
use crate::layers::{Linear, RmsNorm};
use crate::weights::{CheckpointWeights, RandomWeights, UnusedWeights, WeightSource};

/// RoPE base of every Flux model (`FluxPosEmbed(theta=10000)`).
pub const ROPE_THETA: f64 = 10000.0;

/// Channels of the sinusoidal timestep projection (`Timesteps(num_channels=256)`).
pub const TIMESTEP_CHANNELS: usize = 256;

/// Epsilon of the adaLN layer norms, the FF layer norms and the q/k RMS norms.
const NORM_EPS: f32 = 1e-6;

/// FeedForward / single-block MLP width multiplier (`mlp_ratio = 4`).
const MLP_RATIO: usize = 4;

/// `FluxTransformer2DModel`'s `config.json`. Unknown fields (`_class_name`,
/// `_diffusers_version`, ...) are ignored; missing fields take Diffusers' defaults.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct FluxTransformerConfig {
    /// Patch size; only 1 (every released Flux checkpoint; FluxPipeline packs 2×2 patches).
    pub patch_size: usize,
    /// Channels of a packed latent token (64 = 16 latent channels × 2 × 2).
    pub in_channels: usize,
    /// Output channels; `None` means `in_channels`.
    pub out_channels: Option<usize>,
    /// Number of double-stream blocks (`transformer_blocks`).
    pub num_layers: usize,
    /// Number of single-stream blocks (`single_transformer_blocks`).
    pub num_single_layers: usize,
    /// Width of one attention head.
    pub attention_head_dim: usize,
    /// Number of attention heads.
    pub num_attention_heads: usize,
    /// Width of the text encoder's hidden states (T5: 4096).
    pub joint_attention_dim: usize,
    /// Width of the pooled text embedding (CLIP: 768).
    pub pooled_projection_dim: usize,
    /// Whether the model has a guidance embedder (dev: true; schnell: false).
    pub guidance_embeds: bool,
    /// RoPE widths of the three id axes; they sum to `attention_head_dim`.
    pub axes_dims_rope: Vec<usize>,
}

impl Default for FluxTransformerConfig {
    /// Diffusers' constructor defaults (`guidance_embeds=False`, i.e. schnell's layout).
    fn default() -> Self {
        Self {
            patch_size: 1,
            in_channels: 64,
            out_channels: None,
            num_layers: 19,
            num_single_layers: 38,
            attention_head_dim: 128,
            num_attention_heads: 24,
            joint_attention_dim: 4096,
            pooled_projection_dim: 768,
            guidance_embeds: false,
            axes_dims_rope: vec![16, 56, 56],
        }
    }
}

impl FluxTransformerConfig {
    /// FLUX.1-dev: 19 double and 38 single blocks, 24 heads × 128, T5 width 4096, CLIP
    /// pooled width 768, 64 input channels, guidance embedder, RoPE axes (16, 56, 56).
    pub fn flux_dev() -> Self {
        Self {
            guidance_embeds: true,
            ..Self::default()
        }
    }

    /// Reads and validates a Diffusers `config.json`.
    pub fn from_file(path: &Path) -> LoadResult<Self> {
        let text = crate::weights::read_text_file(path)?;
        Self::parse(&text, path)
    }

    /// Parses and validates config JSON text (`origin` names it in errors).
    pub fn parse(text: &str, origin: &Path) -> LoadResult<Self> {
        let config: Self = serde_json::from_str(text).map_err(|e| LoadError::Config {
            file: origin.to_path_buf(),
            message: format!(
                "{e}; expected a FluxTransformer2DModel config.json as Diffusers writes it"
            ),
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks the values against each other; the error names the field and what would be
    /// valid.
    pub fn validate(&self) -> LoadResult<()> {
        let invalid = |field: &str, value: String, hint: &str| {
            Err(LoadError::InvalidConfig {
                field: field.into(),
                value,
                hint: hint.into(),
            })
        };
        if self.patch_size != 1 {
            return invalid(
                "patch_size",
                self.patch_size.to_string(),
                "only patch_size=1 is supported (every Flux checkpoint uses 1; FluxPipeline packs 2x2 patches itself)",
            );
        }
        for (field, v) in [
            ("in_channels", self.in_channels),
            ("num_attention_heads", self.num_attention_heads),
            ("attention_head_dim", self.attention_head_dim),
            ("joint_attention_dim", self.joint_attention_dim),
            ("pooled_projection_dim", self.pooled_projection_dim),
        ] {
            if v == 0 {
                return invalid(field, "0".into(), "must be positive");
            }
        }
        if self.out_channels == Some(0) {
            return invalid(
                "out_channels",
                "0".into(),
                "must be positive, or null to use in_channels",
            );
        }
        if !self.attention_head_dim.is_multiple_of(2) {
            return invalid(
                "attention_head_dim",
                self.attention_head_dim.to_string(),
                "rotary embeddings rotate pairs of channels: the head width must be even",
            );
        }
        let axes = format!("{:?}", self.axes_dims_rope);
        if self.axes_dims_rope.len() != 3 {
            return invalid(
                "axes_dims_rope",
                axes,
                "give three widths, one per id axis (Flux ids are (t, row, col)), e.g. [16, 56, 56]",
            );
        }
        if self.axes_dims_rope.iter().any(|d| !d.is_multiple_of(2)) {
            return invalid(
                "axes_dims_rope",
                axes,
                "every axis width must be even (rotary pairs)",
            );
        }
        let sum: usize = self.axes_dims_rope.iter().sum();
        if sum != self.attention_head_dim {
            return invalid(
                "axes_dims_rope",
                axes,
                &format!(
                    "the widths sum to {sum} but must sum to attention_head_dim = {}",
                    self.attention_head_dim
                ),
            );
        }
        if self
            .num_attention_heads
            .checked_mul(self.attention_head_dim)
            .is_none()
        {
            return invalid(
                "num_attention_heads",
                self.num_attention_heads.to_string(),
                "num_attention_heads * attention_head_dim overflows",
            );
        }
        Ok(())
    }

    /// Model width: `num_attention_heads * attention_head_dim`.
    pub fn inner_dim(&self) -> usize {
        self.num_attention_heads * self.attention_head_dim
    }

    /// Output channels (`out_channels or in_channels`).
    pub fn out_channels(&self) -> usize {
        self.out_channels.unwrap_or(self.in_channels)
    }

    /// Params of one double-stream block: `36·D² + 30·D + 4·head_dim` with `D` the inner
    /// width (two adaLN-Zero linears `D→6D`, eight attention linears `D→D`, two
    /// feed-forwards `D→4D→D`, four RMS norms over a head).
    pub fn double_block_params(&self) -> u64 {
        let d = self.inner_dim() as u64;
        let hd = self.attention_head_dim as u64;
        36 * d * d + 30 * d + 4 * hd
    }

    /// Params of one single-stream block: `15·D² + 11·D + 2·head_dim` (adaLN `D→3D`, q/k/v
    /// `D→D`, MLP `D→4D`, output `5D→D`, two RMS norms).
    pub fn single_block_params(&self) -> u64 {
        let d = self.inner_dim() as u64;
        let hd = self.attention_head_dim as u64;
        15 * d * d + 11 * d + 2 * hd
    }

    /// Params outside the blocks: time/guidance/text embedders, the context and image
    /// embedders, `norm_out` and `proj_out`.
    pub fn shared_params(&self) -> u64 {
        let d = self.inner_dim() as u64;
        let t = TIMESTEP_CHANNELS as u64;
        let mlp = |inp: u64| inp * d + d + d * d + d;
        let out = (self.patch_size * self.patch_size * self.out_channels()) as u64;
        let guidance = if self.guidance_embeds { mlp(t) } else { 0 };
        mlp(t)
            + guidance
            + mlp(self.pooled_projection_dim as u64)
            + (self.joint_attention_dim as u64 * d + d)
            + (self.in_channels as u64 * d + d)
            + (2 * d * d + 2 * d)
            + (d * out + out)
    }

    /// Total params.
    pub fn param_count(&self) -> u64 {
        self.shared_params()
            + self.num_layers as u64 * self.double_block_params()
            + self.num_single_layers as u64 * self.single_block_params()
    }
}

/// The inputs of one transformer call, as FluxPipeline passes them. Tensors may be on the
/// host or on the execution device; they are moved to the device and cast to the model's
/// dtype inside [`FluxTransformer::forward`].
#[derive(Debug, Clone)]
pub struct FluxInputs {
    /// Packed image latents `[batch, img_tokens, in_channels]`.
    pub hidden_states: Tensor,
    /// Text encoder states `[batch, txt_tokens, joint_attention_dim]`.
    pub encoder_hidden_states: Tensor,
    /// Pooled text embedding `[batch, pooled_projection_dim]`.
    pub pooled_projections: Tensor,
    /// Timestep per batch element (or one for all), already `t / 1000` as FluxPipeline
    /// passes it; the model multiplies by 1000 itself.
    pub timestep: Vec<f32>,
    /// Guidance scale per batch element (or one for all), unscaled; required exactly when
    /// the model has `guidance_embeds`.
    pub guidance: Option<Vec<f32>>,
    /// Position ids of the image tokens (`(0, row, col)`), one per token.
    pub img_ids: Vec<[f32; 3]>,
    /// Position ids of the text tokens (zeros in FluxPipeline), one per token.
    pub txt_ids: Vec<[f32; 3]>,
}

impl FluxInputs {
    /// Deterministic host inputs for a model of `config`, for tests and benchmarks:
    /// `side`² image tokens at ids `(0, row, col)`, `txt` text tokens at zero ids, values
    /// in [-1, 1) from a fixed integer hash, timestep 0.5 and guidance 3.5 (batch 1).
    pub fn synthetic(config: &FluxTransformerConfig, side: usize, txt: usize) -> Result<Self> {
        let n = side * side;
        let wave = |len: usize, seed: usize| -> Vec<f32> {
            (0..len)
                .map(|i| (((i * 2_654_435_761 + seed) % 1000) as f32 / 500.0) - 1.0)
                .collect()
        };
        let tensor = |shape: Vec<usize>, seed: usize| -> Result<Tensor> {
            let len = shape.iter().product();
            Tensor::from_f32(shape, DType::F32, &wave(len, seed))
        };
        Ok(Self {
            hidden_states: tensor(vec![1, n, config.in_channels], 1)?,
            encoder_hidden_states: tensor(vec![1, txt, config.joint_attention_dim], 2)?,
            pooled_projections: tensor(vec![1, config.pooled_projection_dim], 3)?,
            timestep: vec![0.5],
            guidance: Some(vec![3.5]),
            img_ids: (0..n)
                .map(|i| [0.0, (i / side) as f32, (i % side) as f32])
                .collect(),
            txt_ids: vec![[0.0; 3]; txt],
        })
    }
}

fn shape_err(what: &str, message: impl Into<String>) -> CoreError {
    CoreError::Shape {
        what: what.into(),
        message: message.into(),
    }
}

/// Rounds `v` to `dtype` and back (what a PyTorch tensor of that dtype stores).
fn round_to(dtype: DType, v: f32) -> f32 {
    match dtype {
        DType::F16 => f16::from_f32(v).to_f32(),
        DType::BF16 => bf16::from_f32(v).to_f32(),
        _ => v,
    }
}

/// Diffusers' `get_timestep_embedding(t, dim, flip_sin_to_cos=True, downscale_freq_shift=0,
/// scale=1, max_period=10000)`: `[cos(t·f), sin(t·f)]` with `f_i = exp(-ln(10000)·i/(dim/2))`,
/// computed in f32 as PyTorch does (each transcendental correctly rounded). Row-major
/// `[timesteps.len(), dim]`.
pub fn timestep_embedding(timesteps: &[f32], dim: usize) -> Vec<f32> {
    let half = dim / 2;
    let neg_log = -(10000f64.ln()) as f32;
    let freqs: Vec<f32> = (0..half)
        .map(|i| {
            let exponent = (neg_log * i as f32) / half as f32;
            (exponent as f64).exp() as f32
        })
        .collect();
    let mut out = Vec::with_capacity(timesteps.len() * dim);
    for &t in timesteps {
        let args: Vec<f32> = freqs.iter().map(|&f| t * f).collect();
        out.extend(args.iter().map(|&a| (a as f64).cos() as f32));
        out.extend(args.iter().map(|&a| (a as f64).sin() as f32));
        if !dim.is_multiple_of(2) {
            out.push(0.0);
        }
    }
    out
}

/// `FluxPosEmbed(theta, axes_dims)(ids)`: for each axis, `get_1d_rotary_pos_embed` with
/// `use_real=True, repeat_interleave_real=True` in f64, rounded to f32, concatenated along
/// the width. Returns `(cos, sin)`, each row-major `[ids.len(), sum(axes_dims)]`.
pub fn rope_tables(ids: &[[f32; 3]], axes_dims: &[usize], theta: f64) -> (Vec<f32>, Vec<f32>) {
    let width: usize = axes_dims.iter().sum();
    let freqs: Vec<Vec<f64>> = axes_dims
        .iter()
        .map(|&d| {
            (0..d / 2)
                .map(|j| 1.0 / theta.powf((2 * j) as f64 / d as f64))
                .collect()
        })
        .collect();
    let mut cos = Vec::with_capacity(ids.len() * width);
    let mut sin = Vec::with_capacity(ids.len() * width);
    for id in ids {
        for (axis, fs) in freqs.iter().enumerate() {
            let pos = id.get(axis).copied().unwrap_or(0.0) as f64;
            for &f in fs {
                let angle = pos * f;
                let (c, s) = (angle.cos() as f32, angle.sin() as f32);
                cos.extend([c, c]);
                sin.extend([s, s]);
            }
        }
    }
    (cos, sin)
}

/// FluxPipeline's `_pack_latents`: `[b, c, h, w]` → `[b, (h/2)·(w/2), c·4]`, token =
/// `(row, col)` of a 2×2 patch in row-major order, channel = `c·4 + dy·2 + dx`. `latents` must
/// be on `ops`' device; `h` and `w` must be even.
pub fn pack_latents(ops: &dyn Ops, latents: &Tensor) -> Result<Tensor> {
    let &[b, c, h, w] = latents.shape() else {
        return Err(shape_err(
            "pack_latents",
            format!(
                "latents have shape {:?}, expected [b, c, h, w]",
                latents.shape()
            ),
        ));
    };
    if !h.is_multiple_of(2) || !w.is_multiple_of(2) {
        return Err(shape_err(
            "pack_latents",
            format!("latent height {h} and width {w} must be even (2x2 patches)"),
        ));
    }
    let x = latents.reshape(&[b, c, h / 2, 2, w / 2, 2])?;
    let x = ops.permute(&x, &[0, 2, 4, 1, 3, 5])?;
    x.reshape(&[b, (h / 2) * (w / 2), c * 4])
}

/// The latent grid FluxPipeline unpacks to for an image of `height × width` pixels:
/// `2·(height / (vae_scale_factor·2))` by the same for width.
pub fn latent_size(height: usize, width: usize, vae_scale_factor: usize) -> (usize, usize) {
    let f = vae_scale_factor.max(1) * 2;
    (2 * (height / f), 2 * (width / f))
}

/// FluxPipeline's `_unpack_latents(latents, height, width, vae_scale_factor)`:
/// `[b, tokens, c·4]` → `[b, c, h, w]` with `(h, w) = latent_size(height, width,
/// vae_scale_factor)` (`height`, `width` in pixels). `latents` must be on `ops`' device.
pub fn unpack_latents(
    ops: &dyn Ops,
    latents: &Tensor,
    height: usize,
    width: usize,
    vae_scale_factor: usize,
) -> Result<Tensor> {
    let &[b, tokens, channels] = latents.shape() else {
        return Err(shape_err(
            "unpack_latents",
            format!(
                "latents have shape {:?}, expected [b, tokens, channels]",
                latents.shape()
            ),
        ));
    };
    let (h, w) = latent_size(height, width, vae_scale_factor);
    if !channels.is_multiple_of(4) || tokens != (h / 2) * (w / 2) {
        return Err(shape_err(
            "unpack_latents",
            format!(
                "latents {:?} do not fit a {h}x{w} latent grid ({} tokens of 4·c channels) for a \
                 {height}x{width} image with vae_scale_factor {vae_scale_factor}",
                latents.shape(),
                (h / 2) * (w / 2)
            ),
        ));
    }
    let x = latents.reshape(&[b, h / 2, w / 2, channels / 4, 2, 2])?;
    let x = ops.permute(&x, &[0, 3, 1, 4, 2, 5])?;
    x.reshape(&[b, channels / 4, h, w])
}

/// FluxPipeline's `_prepare_latent_image_ids(batch, height, width)`: `(0, row, col)` for a
/// `height × width` token grid (`height`, `width` = latent size / 2), row-major.
pub fn latent_image_ids(height: usize, width: usize) -> Vec<[f32; 3]> {
    (0..height)
        .flat_map(|r| (0..width).map(move |c| [0.0, r as f32, c as f32]))
        .collect()
}

/// `TimestepEmbedding` / `PixArtAlphaTextProjection(act_fn="silu")`: `linear_2(silu(linear_1(x)))`.
#[derive(Debug, Clone, Copy)]
struct SiluMlp {
    linear_1: Linear,
    linear_2: Linear,
}

impl SiluMlp {
    fn build(b: &mut ModelBuilder<'_>, name: &str, inp: usize, dim: usize) -> LoadResult<Self> {
        b.scope(name, |b| {
            Ok(Self {
                linear_1: Linear::build(b, "linear_1", inp, dim, true)?,
                linear_2: Linear::build(b, "linear_2", dim, dim, true)?,
            })
        })
    }

    fn forward(&self, ctx: &mut ForwardContext<'_>, ops: &dyn Ops, x: &Tensor) -> Result<Tensor> {
        let h = ops.unary_owned(self.linear_1.forward(ctx, x)?, UnaryOp::Silu)?;
        self.linear_2.forward(ctx, &h)
    }
}

/// `FeedForward(dim, activation_fn="gelu-approximate")`: `net.2(gelu_tanh(net.0.proj(x)))`.
#[derive(Debug, Clone, Copy)]
struct FeedForward {
    proj: Linear,
    out: Linear,
}

impl FeedForward {
    fn build(b: &mut ModelBuilder<'_>, name: &str, dim: usize) -> LoadResult<Self> {
        b.scope(name, |b| {
            b.scope("net", |b| {
                let proj = b.scope("0", |b| {
                    Linear::build(b, "proj", dim, dim * MLP_RATIO, true)
                })?;
                let out = Linear::build(b, "2", dim * MLP_RATIO, dim, true)?;
                Ok(Self { proj, out })
            })
        })
    }

    fn forward(&self, ctx: &mut ForwardContext<'_>, x: &Tensor) -> Result<Tensor> {
        // The projection and its activation are one op (`linear_gelu_tanh`): in the GEMM's
        // epilogue where the backend can, else in place over the projection — this is the
        // widest tensor of a double block.
        let h = self.proj.forward_gelu_tanh(ctx, x)?;
        self.out.forward(ctx, &h)
    }
}

/// The context-stream projections of a double block's attention.
#[derive(Debug, Clone, Copy)]
struct AddedProjections {
    norm_added_q: RmsNorm,
    norm_added_k: RmsNorm,
    add_q_proj: Linear,
    add_k_proj: Linear,
    add_v_proj: Linear,
    to_add_out: Linear,
}

/// `FluxAttention` with `FluxAttnProcessor`: q/k RMS norms per head, joint attention over
/// `[text, image]` (double blocks) or the already joined sequence (single blocks), RoPE.
#[derive(Debug, Clone, Copy)]
struct FluxAttention {
    heads: usize,
    head_dim: usize,
    norm_q: RmsNorm,
    norm_k: RmsNorm,
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    to_out: Option<Linear>,
    added: Option<AddedProjections>,
}

/// The rotary tables of one forward, on the device: `[tokens, head_dim]` each.
struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl FluxAttention {
    /// Builds `attn` with its leaves in the order the forward runs them (streamed routes
    /// predict their schedule from the leaf order): to_q, to_k, to_v, (add_q/k/v_proj),
    /// norm_q, norm_k, (norm_added_q, norm_added_k, to_out.0, to_add_out). The names are
    /// Diffusers'; only the tree order differs from its registration order.
    fn build(
        b: &mut ModelBuilder<'_>,
        dim: usize,
        heads: usize,
        head_dim: usize,
        joint: bool,
    ) -> LoadResult<Self> {
        b.scope("attn", |b| {
            let to_q = Linear::build(b, "to_q", dim, dim, true)?;
            let to_k = Linear::build(b, "to_k", dim, dim, true)?;
            let to_v = Linear::build(b, "to_v", dim, dim, true)?;
            let added_proj = if joint {
                Some((
                    Linear::build(b, "add_q_proj", dim, dim, true)?,
                    Linear::build(b, "add_k_proj", dim, dim, true)?,
                    Linear::build(b, "add_v_proj", dim, dim, true)?,
                ))
            } else {
                None
            };
            let norm_q = RmsNorm::build(b, "norm_q", head_dim, NORM_EPS)?;
            let norm_k = RmsNorm::build(b, "norm_k", head_dim, NORM_EPS)?;
            let (to_out, added) = match added_proj {
                Some((add_q_proj, add_k_proj, add_v_proj)) => {
                    let norm_added_q = RmsNorm::build(b, "norm_added_q", head_dim, NORM_EPS)?;
                    let norm_added_k = RmsNorm::build(b, "norm_added_k", head_dim, NORM_EPS)?;
                    let to_out = b.scope("to_out", |b| Linear::build(b, "0", dim, dim, true))?;
                    let added = AddedProjections {
                        norm_added_q,
                        norm_added_k,
                        add_q_proj,
                        add_k_proj,
                        add_v_proj,
                        to_add_out: Linear::build(b, "to_add_out", dim, dim, true)?,
                    };
                    (Some(to_out), Some(added))
                }
                None => (None, None),
            };
            Ok(Self {
                heads,
                head_dim,
                norm_q,
                norm_k,
                to_q,
                to_k,
                to_v,
                to_out,
                added,
            })
        })
    }

    /// `[b, l, heads·head_dim]` viewed as `[b, l, heads, head_dim]`.
    fn split_heads(&self, x: &Tensor) -> Result<Tensor> {
        let s = x.shape();
        x.reshape(&[s[0], s[1], self.heads, self.head_dim])
    }

    /// Joint attention of `x [b, l, D]` (image stream, or the joined stream of a single
    /// block) and, for double blocks, `context [b, lt, D]` placed first. Returns the image
    /// (or joined) output, and the context output for double blocks.
    fn forward(
        &self,
        ctx: &mut ForwardContext<'_>,
        ops: &dyn Ops,
        x: &Tensor,
        context: Option<&Tensor>,
        rope: &Rope,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let mut q = self.split_heads(&self.to_q.forward(ctx, x)?)?;
        let mut k = self.split_heads(&self.to_k.forward(ctx, x)?)?;
        let mut v = self.split_heads(&self.to_v.forward(ctx, x)?)?;
        let mut context_len = None;
        match (&self.added, context) {
            (Some(a), Some(c)) => {
                let cq = self.split_heads(&a.add_q_proj.forward(ctx, c)?)?;
                let ck = self.split_heads(&a.add_k_proj.forward(ctx, c)?)?;
                let cv = self.split_heads(&a.add_v_proj.forward(ctx, c)?)?;
                q = self.norm_q.forward(ctx, &q)?;
                k = self.norm_k.forward(ctx, &k)?;
                let cq = a.norm_added_q.forward(ctx, &cq)?;
                let ck = a.norm_added_k.forward(ctx, &ck)?;
                q = ops.concat(&[&cq, &q], 1)?;
                k = ops.concat(&[&ck, &k], 1)?;
                v = ops.concat(&[&cv, &v], 1)?;
                drop((cq, ck, cv));
                context_len = Some(c.shape()[1]);
            }
            (None, None) => {
                q = self.norm_q.forward(ctx, &q)?;
                k = self.norm_k.forward(ctx, &k)?;
            }
            _ => {
                return Err(shape_err(
                    "flux attention",
                    "context states are given to exactly the attentions with added projections",
                ));
            }
        }
        // [b, l, h, d] -> [b, h, l, d] for rope and attention. Each step replaces its input
        // (assignment, not shadowing), so no stale copy of q, k or v stays alive.
        q = ops.permute(&q, &[0, 2, 1, 3])?;
        q = ops.rope(&q, &rope.cos, &rope.sin)?;
        k = ops.permute(&k, &[0, 2, 1, 3])?;
        k = ops.rope(&k, &rope.cos, &rope.sin)?;
        v = ops.permute(&v, &[0, 2, 1, 3])?;
        let scale = (1.0 / (self.head_dim as f64).sqrt()) as f32;
        let mut o = ops.attention(&q, &k, &v, None, scale)?;
        drop((q, k, v));
        o = ops.permute(&o, &[0, 2, 1, 3])?;
        let s = o.shape().to_vec();
        let o = o.reshape(&[s[0], s[1], s[2] * s[3]])?;
        match (context_len, &self.added, &self.to_out) {
            (Some(lt), Some(a), Some(to_out)) => {
                let c = ops.narrow(&o, 1, 0, lt)?;
                let x = ops.narrow(&o, 1, lt, s[1] - lt)?;
                drop(o);
                let x = to_out.forward(ctx, &x)?;
                let c = a.to_add_out.forward(ctx, &c)?;
                Ok((x, Some(c)))
            }
            _ => Ok((o, None)),
        }
    }
}

/// `chunk(n, dim=1)` of a modulation `[b, n·D]`, each viewed as `[b, 1, D]`.
fn chunks(ops: &dyn Ops, emb: &Tensor, n: usize) -> Result<Vec<Tensor>> {
    let b = emb.shape()[0];
    let d = emb.shape()[1] / n;
    (0..n)
        .map(|i| ops.narrow(emb, 1, i * d, d)?.reshape(&[b, 1, d]))
        .collect()
}

/// `norm(x) * (1 + scale) + shift` with `norm` a plain layer norm (eps 1e-6), as one op
/// ([`Ops::layer_norm_modulate`]: one kernel on CUDA; on the host the composition
/// `layer_norm`, `affine`, `Mul`, `Add`).
fn modulate(ops: &dyn Ops, x: &Tensor, scale: &Tensor, shift: &Tensor) -> Result<Tensor> {
    ops.layer_norm_modulate(x, NORM_EPS, scale, shift)
}

/// `x + gate * y`, as one op ([`Ops::gated_add`]: one kernel on CUDA; on the host `Mul`
/// then `Add`).
fn gated_add(ops: &dyn Ops, x: &Tensor, gate: &Tensor, y: &Tensor) -> Result<Tensor> {
    ops.gated_add(x, gate, y)
}

/// `x.clip(-65504, 65504)`, as the blocks do for f16 activations.
fn clip_f16(ops: &dyn Ops, x: Tensor) -> Result<Tensor> {
    if x.dtype() != DType::F16 {
        return Ok(x);
    }
    let hi = ops.tensor_from_f32(&[1], DType::F16, &[65504.0])?;
    let lo = ops.tensor_from_f32(&[1], DType::F16, &[-65504.0])?;
    let x = ops.binary(&x, &hi, BinaryOp::Min)?;
    ops.binary(&x, &lo, BinaryOp::Max)
}

/// `FluxTransformerBlock` (double stream).
#[derive(Debug, Clone, Copy)]
struct DoubleBlock {
    norm1: Linear,
    norm1_context: Linear,
    attn: FluxAttention,
    ff: FeedForward,
    ff_context: FeedForward,
}

impl DoubleBlock {
    fn build(b: &mut ModelBuilder<'_>, c: &FluxTransformerConfig) -> LoadResult<Self> {
        let d = c.inner_dim();
        let norm1 = b.scope("norm1", |b| Linear::build(b, "linear", d, 6 * d, true))?;
        let norm1_context = b.scope("norm1_context", |b| {
            Linear::build(b, "linear", d, 6 * d, true)
        })?;
        let attn = FluxAttention::build(b, d, c.num_attention_heads, c.attention_head_dim, true)?;
        let ff = FeedForward::build(b, "ff", d)?;
        let ff_context = FeedForward::build(b, "ff_context", d)?;
        Ok(Self {
            norm1,
            norm1_context,
            attn,
            ff,
            ff_context,
        })
    }

    /// Returns `(encoder_hidden_states, hidden_states)`, text first, as Diffusers does.
    fn forward(
        &self,
        ctx: &mut ForwardContext<'_>,
        ops: &dyn Ops,
        img: &Tensor,
        txt: &Tensor,
        temb_act: &Tensor,
        rope: &Rope,
    ) -> Result<(Tensor, Tensor)> {
        let m = chunks(ops, &self.norm1.forward(ctx, temb_act)?, 6)?;
        let (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp) =
            (&m[0], &m[1], &m[2], &m[3], &m[4], &m[5]);
        let norm_img = modulate(ops, img, scale_msa, shift_msa)?;
        let c = chunks(ops, &self.norm1_context.forward(ctx, temb_act)?, 6)?;
        let (c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp) =
            (&c[0], &c[1], &c[2], &c[3], &c[4], &c[5]);
        let norm_txt = modulate(ops, txt, c_scale_msa, c_shift_msa)?;

        let (attn_img, attn_txt) = self
            .attn
            .forward(ctx, ops, &norm_img, Some(&norm_txt), rope)?;
        drop((norm_img, norm_txt));
        let attn_txt =
            attn_txt.ok_or_else(|| shape_err("flux double block", "no context output"))?;

        // Each intermediate is dropped as soon as it is used: the block's activation peak is
        // what a streamed transformer adds to its ring.
        let img = {
            let img = gated_add(ops, img, gate_msa, &attn_img)?;
            drop(attn_img);
            let norm = modulate(ops, &img, scale_mlp, shift_mlp)?;
            let ff = self.ff.forward(ctx, &norm)?;
            drop(norm);
            gated_add(ops, &img, gate_mlp, &ff)?
        };
        let txt = {
            let txt = gated_add(ops, txt, c_gate_msa, &attn_txt)?;
            drop(attn_txt);
            let norm = modulate(ops, &txt, c_scale_mlp, c_shift_mlp)?;
            let ff = self.ff_context.forward(ctx, &norm)?;
            drop(norm);
            gated_add(ops, &txt, c_gate_mlp, &ff)?
        };
        let txt = clip_f16(ops, txt)?;
        Ok((txt, img))
    }
}

/// `FluxSingleTransformerBlock` (single stream over `[text, image]`).
#[derive(Debug, Clone, Copy)]
struct SingleBlock {
    norm: Linear,
    proj_mlp: Linear,
    proj_out: Linear,
    attn: FluxAttention,
}

impl SingleBlock {
    fn build(b: &mut ModelBuilder<'_>, c: &FluxTransformerConfig) -> LoadResult<Self> {
        let d = c.inner_dim();
        let mlp = d * MLP_RATIO;
        // Leaves in execution order (streamed routes predict their schedule from it).
        let norm = b.scope("norm", |b| Linear::build(b, "linear", d, 3 * d, true))?;
        let attn = FluxAttention::build(b, d, c.num_attention_heads, c.attention_head_dim, false)?;
        let proj_mlp = Linear::build(b, "proj_mlp", d, mlp, true)?;
        let proj_out = Linear::build(b, "proj_out", d + mlp, d, true)?;
        Ok(Self {
            norm,
            proj_mlp,
            proj_out,
            attn,
        })
    }

    /// The block on the joined stream `x = [text, image]` (Diffusers concatenates and
    /// splits around every single block; here the stream stays joined through all of them,
    /// which gives the same values without two copies per block).
    ///
    /// Diffusers computes the MLP branch before the attention; the two branches are
    /// independent, and running the attention first keeps the MLP's wide activation out of
    /// the attention's peak. `proj_out` reads both branches in place
    /// ([`Linear::forward_concat`]) instead of their concatenation.
    fn forward(
        &self,
        ctx: &mut ForwardContext<'_>,
        ops: &dyn Ops,
        x: &Tensor,
        temb_act: &Tensor,
        rope: &Rope,
    ) -> Result<Tensor> {
        let m = chunks(ops, &self.norm.forward(ctx, temb_act)?, 3)?;
        let (shift, scale, gate) = (&m[0], &m[1], &m[2]);
        let norm_x = modulate(ops, x, scale, shift)?;
        let (attn, _) = self.attn.forward(ctx, ops, &norm_x, None, rope)?;
        let mlp = self.proj_mlp.forward_gelu_tanh(ctx, &norm_x)?;
        drop(norm_x);
        let h = self.proj_out.forward_concat(ctx, &[&attn, &mlp])?;
        drop((attn, mlp));
        let x = gated_add(ops, x, gate, &h)?;
        clip_f16(ops, x)
    }
}

/// The transformer's layers and forward: the component's program.
#[derive(Debug, Clone)]
pub struct FluxProgram {
    config: FluxTransformerConfig,
    timestep_embedder: SiluMlp,
    guidance_embedder: Option<SiluMlp>,
    text_embedder: SiluMlp,
    context_embedder: Linear,
    x_embedder: Linear,
    double_blocks: Vec<DoubleBlock>,
    single_blocks: Vec<SingleBlock>,
    norm_out: Linear,
    proj_out: Linear,
    /// The rotary tables of the last ids seen (host values): the ids of a denoising loop do
    /// not change from step to step, and the tables cost ~1 ms of host trigonometry.
    rope_cache: Arc<std::sync::Mutex<Option<RopeCache>>>,
}

/// Host rotary tables for one set of position ids.
#[derive(Debug)]
struct RopeCache {
    ids: Vec<[f32; 3]>,
    cos: Arc<Vec<f32>>,
    sin: Arc<Vec<f32>>,
}

impl FluxProgram {
    /// The rotary tables of `ids` (cached for the last ids).
    fn rope_tables_cached(&self, ids: &[[f32; 3]]) -> (Arc<Vec<f32>>, Arc<Vec<f32>>) {
        // A poisoned lock only means another forward panicked mid-update: recompute.
        let mut cache = self
            .rope_cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(c) = cache.as_ref()
            && c.ids == ids
        {
            return (Arc::clone(&c.cos), Arc::clone(&c.sin));
        }
        let (cos, sin) = rope_tables(ids, &self.config.axes_dims_rope, ROPE_THETA);
        let (cos, sin) = (Arc::new(cos), Arc::new(sin));
        *cache = Some(RopeCache {
            ids: ids.to_vec(),
            cos: Arc::clone(&cos),
            sin: Arc::clone(&sin),
        });
        (cos, sin)
    }

    fn build(b: &mut ModelBuilder<'_>, c: &FluxTransformerConfig) -> LoadResult<Self> {
        let d = c.inner_dim();
        // Leaves in execution order (streamed routes predict their schedule from it).
        let x_embedder = Linear::build(b, "x_embedder", c.in_channels, d, true)?;
        let (timestep_embedder, guidance_embedder, text_embedder) =
            b.scope("time_text_embed", |b| {
                let t = SiluMlp::build(b, "timestep_embedder", TIMESTEP_CHANNELS, d)?;
                let g = if c.guidance_embeds {
                    Some(SiluMlp::build(
                        b,
                        "guidance_embedder",
                        TIMESTEP_CHANNELS,
                        d,
                    )?)
                } else {
                    None
                };
                let p = SiluMlp::build(b, "text_embedder", c.pooled_projection_dim, d)?;
                Ok((t, g, p))
            })?;
        let context_embedder =
            Linear::build(b, "context_embedder", c.joint_attention_dim, d, true)?;
        b.enter_blocks("transformer_blocks");
        let double_blocks = (0..c.num_layers)
            .map(|i| b.scope(i.to_string(), |b| DoubleBlock::build(b, c)))
            .collect::<LoadResult<Vec<_>>>();
        b.exit();
        let double_blocks = double_blocks?;
        b.enter_blocks("single_transformer_blocks");
        let single_blocks = (0..c.num_single_layers)
            .map(|i| b.scope(i.to_string(), |b| SingleBlock::build(b, c)))
            .collect::<LoadResult<Vec<_>>>();
        b.exit();
        let single_blocks = single_blocks?;
        let norm_out = b.scope("norm_out", |b| Linear::build(b, "linear", d, 2 * d, true))?;
        let out = c.patch_size * c.patch_size * c.out_channels();
        let proj_out = Linear::build(b, "proj_out", d, out, true)?;
        Ok(Self {
            config: c.clone(),
            timestep_embedder,
            guidance_embedder,
            text_embedder,
            context_embedder,
            x_embedder,
            double_blocks,
            single_blocks,
            norm_out,
            proj_out,
            rope_cache: Arc::default(),
        })
    }

    /// The config the program was built from.
    pub fn config(&self) -> &FluxTransformerConfig {
        &self.config
    }

    /// Checks `inputs` against the config; returns `(batch, img_tokens, txt_tokens)`.
    fn check_inputs(&self, inputs: &FluxInputs) -> Result<(usize, usize, usize)> {
        let c = &self.config;
        const WHAT: &str = "FluxTransformer inputs";
        let (b, li) = match inputs.hidden_states.shape() {
            &[b, li, ch] if ch == c.in_channels => (b, li),
            s => {
                return Err(shape_err(
                    WHAT,
                    format!(
                        "hidden_states {s:?}, expected [batch, img_tokens, {}]",
                        c.in_channels
                    ),
                ));
            }
        };
        let lt = match inputs.encoder_hidden_states.shape() {
            &[bb, lt, ch] if bb == b && ch == c.joint_attention_dim => lt,
            s => {
                return Err(shape_err(
                    WHAT,
                    format!(
                        "encoder_hidden_states {s:?}, expected [{b}, txt_tokens, {}]",
                        c.joint_attention_dim
                    ),
                ));
            }
        };
        if inputs.pooled_projections.shape() != [b, c.pooled_projection_dim] {
            return Err(shape_err(
                WHAT,
                format!(
                    "pooled_projections {:?}, expected [{b}, {}]",
                    inputs.pooled_projections.shape(),
                    c.pooled_projection_dim
                ),
            ));
        }
        let per_batch = |name: &str, n: usize| {
            if n == b || n == 1 {
                Ok(())
            } else {
                Err(shape_err(
                    WHAT,
                    format!(
                        "{name} has {n} values; give one per batch element ({b}) or one for all"
                    ),
                ))
            }
        };
        per_batch("timestep", inputs.timestep.len())?;
        match (&inputs.guidance, c.guidance_embeds) {
            (Some(g), true) => per_batch("guidance", g.len())?,
            (None, false) => {}
            (None, true) => {
                return Err(shape_err(
                    WHAT,
                    "this model has a guidance embedder (guidance_embeds=true): pass guidance (e.g. 3.5)",
                ));
            }
            (Some(_), false) => {
                return Err(shape_err(
                    WHAT,
                    "this model has no guidance embedder (guidance_embeds=false): pass guidance: None",
                ));
            }
        }
        if inputs.img_ids.len() != li || inputs.txt_ids.len() != lt {
            return Err(shape_err(
                WHAT,
                format!(
                    "{} img_ids and {} txt_ids for {li} image and {lt} text tokens; give one id per token",
                    inputs.img_ids.len(),
                    inputs.txt_ids.len()
                ),
            ));
        }
        Ok((b, li, lt))
    }

    /// The model's compute dtype: that of `x_embedder`'s weight (Diffusers' hidden dtype).
    fn dtype(&self, ctx: &ForwardContext<'_>) -> Result<DType> {
        let leaf = ctx.component().leaf(self.x_embedder.leaf())?;
        leaf.params()
            .first()
            .map(|(_, p)| p.dtype())
            .ok_or_else(|| shape_err("x_embedder", "has no weight"))
    }

    /// `time_proj` + embedder for per-batch `values` (already ×1000 and rounded).
    fn embed_scalar(
        &self,
        ctx: &mut ForwardContext<'_>,
        ops: &dyn Ops,
        mlp: &SiluMlp,
        values: &[f32],
        batch: usize,
        dtype: DType,
    ) -> Result<Tensor> {
        let values: Vec<f32> = if values.len() == 1 {
            vec![values[0]; batch]
        } else {
            values.to_vec()
        };
        let proj = timestep_embedding(&values, TIMESTEP_CHANNELS);
        let proj = ops.tensor_from_f32(&[batch, TIMESTEP_CHANNELS], dtype, &proj)?;
        mlp.forward(ctx, ops, &proj)
    }

    /// Diffusers' `FluxTransformer2DModel.forward` on `inputs`.
    pub fn run(&self, ctx: &mut ForwardContext<'_>, inputs: &FluxInputs) -> Result<Tensor> {
        let (batch, _li, _lt) = self.check_inputs(inputs)?;
        let device = ctx.device();
        let ops = ops_of(device)?;
        let stream = device.compute_stream();
        let dtype = self.dtype(ctx)?;
        // The forward's inputs and rotary tables are uploaded here, before the first leaf,
        // while a streamed route's first weight copies already run (a backend may hold the
        // host for a pageable upload; ddo-cuda stages them in pinned buffers instead).
        let prepare = |t: &Tensor| -> Result<Tensor> {
            if !t.is_on_device() && t.dtype() == DType::F32 && dtype != DType::F32 {
                // Rounded on the host (to nearest even, as the device's cast): the same
                // values, half the bytes to upload.
                let narrow = Tensor::from_f32(t.shape().to_vec(), dtype, &t.host_f32()?)?;
                return narrow.to_device(device, &stream);
            }
            let t = t.to_device(device, &stream)?;
            if t.dtype() == dtype {
                Ok(t)
            } else {
                ops.cast(&t, dtype)
            }
        };
        let hidden_states = prepare(&inputs.hidden_states)?;
        let encoder_hidden_states = prepare(&inputs.encoder_hidden_states)?;
        let pooled = prepare(&inputs.pooled_projections)?;
        let ids: Vec<[f32; 3]> = inputs
            .txt_ids
            .iter()
            .chain(inputs.img_ids.iter())
            .copied()
            .collect();
        let (cos, sin) = self.rope_tables_cached(&ids);
        let width = self.config.attention_head_dim;
        let rope = Rope {
            cos: ops.tensor_from_f32(&[ids.len(), width], DType::F32, &cos)?,
            sin: ops.tensor_from_f32(&[ids.len(), width], DType::F32, &sin)?,
        };

        let mut img = self.x_embedder.forward(ctx, &hidden_states)?;
        drop(hidden_states);

        // `timestep.to(dtype) * 1000` (and the same for guidance), rounded as the dtype does.
        let scale = |v: &[f32]| -> Vec<f32> {
            v.iter()
                .map(|&t| round_to(dtype, round_to(dtype, t) * 1000.0))
                .collect()
        };
        let mut temb = self.embed_scalar(
            ctx,
            ops,
            &self.timestep_embedder,
            &scale(&inputs.timestep),
            batch,
            dtype,
        )?;
        if let (Some(g), Some(mlp)) = (&inputs.guidance, &self.guidance_embedder) {
            let g = self.embed_scalar(ctx, ops, mlp, &scale(g), batch, dtype)?;
            temb = ops.binary(&temb, &g, BinaryOp::Add)?;
        }
        let pooled = self.text_embedder.forward(ctx, ops, &pooled)?;
        let temb = ops.binary(&temb, &pooled, BinaryOp::Add)?;
        drop(pooled);

        let mut txt = self.context_embedder.forward(ctx, &encoder_hidden_states)?;
        drop(encoder_hidden_states);

        // Every adaLN modulation starts from silu(temb); computed once.
        let temb_act = ops.unary(&temb, UnaryOp::Silu)?;
        for block in &self.double_blocks {
            (txt, img) = block.forward(ctx, ops, &img, &txt, &temb_act, &rope)?;
        }
        // The single blocks run on the joined stream [text, image].
        let lt = txt.shape()[1];
        let mut x = ops.concat(&[&txt, &img], 1)?;
        drop((txt, img));
        for block in &self.single_blocks {
            x = block.forward(ctx, ops, &x, &temb_act, &rope)?;
        }
        let img = ops.narrow(&x, 1, lt, x.shape()[1] - lt)?;
        drop(x);

        // AdaLayerNormContinuous: chunk order is (scale, shift).
        let emb = self.norm_out.forward(ctx, &temb_act)?;
        let m = chunks(ops, &emb, 2)?;
        let x = modulate(ops, &img, &m[0], &m[1])?;
        self.proj_out.forward(ctx, &x)
    }
}

impl ComponentProgram for FluxProgram {
    /// The transformer takes several inputs: this single-tensor entry point refuses.
    fn forward(&self, _ctx: &mut ForwardContext<'_>, input: Tensor) -> Result<Tensor> {
        Err(shape_err(
            "FluxTransformer2DModel forward",
            format!(
                "the Flux transformer takes several inputs, not one tensor ({:?}); call \
                 FluxTransformer::forward with FluxInputs",
                input.shape()
            ),
        ))
    }
}

/// Diffusers' `FluxTransformer2DModel` as a DDO component named `transformer`.
#[derive(Debug, Clone)]
pub struct FluxTransformer {
    component: Arc<Component>,
    program: Arc<FluxProgram>,
}

impl FluxTransformer {
    /// Builds the model from `weights` (Diffusers names) for `config`.
    pub fn build(
        weights: &mut dyn WeightSource,
        config: FluxTransformerConfig,
    ) -> LoadResult<Self> {
        config.validate()?;
        let mut b = ModelBuilder::new(weights);
        let program = Arc::new(FluxProgram::build(&mut b, &config)?);
        let component = b.finish("transformer", "FluxTransformer2DModel", program.clone())?;
        Ok(Self { component, program })
    }

    /// Loads a Diffusers model folder (`config.json` and the safetensors weights, single or
    /// sharded). `dtype` converts every param on load; `None` keeps the file's dtype and
    /// the params checkpoint-backed.
    pub fn load(dir: &Path, dtype: Option<DType>) -> LoadResult<Self> {
        Self::load_checked(dir, dtype, UnusedWeights::Refuse)
    }

    /// [`FluxTransformer::load`], with what to do about checkpoint tensors the config leaves unused
    /// (refused by default).
    pub fn load_checked(
        dir: &Path,
        dtype: Option<DType>,
        unused: UnusedWeights,
    ) -> LoadResult<Self> {
        let config = FluxTransformerConfig::from_file(&dir.join("config.json"))?;
        CheckpointWeights::build_in(dir, dtype, &[], unused, |w| Self::build(w, config))
    }

    /// A model with seeded random weights stored as `dtype`.
    pub fn random(config: FluxTransformerConfig, seed: u64, dtype: DType) -> LoadResult<Self> {
        Self::build(&mut RandomWeights::new(seed, dtype), config)
    }

    /// The component (attach routes to it).
    pub fn component(&self) -> &Arc<Component> {
        &self.component
    }

    /// The program (the layers).
    pub fn program(&self) -> &Arc<FluxProgram> {
        &self.program
    }

    /// The config.
    pub fn config(&self) -> &FluxTransformerConfig {
        &self.program.config
    }

    /// Runs the transformer on `device` through the attached route (if any): Diffusers'
    /// `forward(hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids,
    /// txt_ids, guidance, return_dict=False)[0]`. Returns `[batch, img_tokens, out_channels]`
    /// on `device`, in the model's dtype.
    pub fn forward(&self, device: &dyn Device, inputs: &FluxInputs) -> Result<Tensor> {
        self.component
            .run(device, |ctx| self.program.run(ctx, inputs))
    }
}
