//! Diffusers' `QwenImageTransformer2DModel` (Qwen-Image, about 20B params): dual-stream
//! blocks — an image and a text stream, each modulated (AdaLN) from the timestep, meeting in
//! one joint attention with per-head RMS norms on q and k — after an RMS-normed text input
//! projection, with the 3-axis rotary embedding "MSRoPE" (centred image positions, text
//! positions after them) and the text padding mask applied to the joint attention's keys.
//!
//! Parameter names are Diffusers' exactly (`transformer_blocks.0.img_mod.1.weight`,
//! `transformer_blocks.0.attn.add_q_proj.weight`, ...), so a Diffusers checkpoint folder loads
//! as is ([`QwenImageTransformer::load`]); the block list is a block list of the component
//! tree, one child container per block, as Diffusers' `ModuleList` is grouped.
//!
//! What has no weights runs on the host and is uploaded: the sinusoidal timestep projection
//! ([`timestep_embedding`]), the rotary tables ([`rope_tables`]) and the additive attention
//! mask ([`attention_mask`]). Everything else runs through the device's
//! [`Ops`](ddo_core::Ops), every leaf through
//! [`ForwardContext::run_leaf`](ddo_core::ForwardContext::run_leaf).

mod blocks;
mod embeddings;
mod program;

use std::path::Path;
use std::sync::Arc;

use ddo_core::{Component, CoreError, DType, Device, Result, Tensor};
use serde::Deserialize;

use crate::builder::ModelBuilder;
use crate::error::{LoadError, LoadResult};
use crate::fp8::{QWEN_IMAGE_SKIP_PATTERNS, source_target, stored_as};
use crate::weights::{CheckpointWeights, RandomWeights, UnusedWeights, WeightSource};

pub use embeddings::{
    ROPE_TABLE_POSITIONS, attention_mask, image_positions, rope_tables, text_positions,
    timestep_embedding,
};
pub use program::{QwenImageProgram, QwenRope};

/// RoPE base of Qwen-Image (`QwenEmbedRope(theta=10000)`).
pub const ROPE_THETA: f32 = 10000.0;

/// Channels of the sinusoidal timestep projection (`Timesteps(num_channels=256)`).
pub const TIMESTEP_CHANNELS: usize = 256;

/// The factor the timestep projection multiplies its angles by (`Timesteps(scale=1000)`).
pub const TIMESTEP_SCALE: f32 = 1000.0;

/// `QwenImageTransformer2DModel`'s `config.json`. Unknown fields (`_class_name`,
/// `_diffusers_version`, the `pooled_projection_dim` Qwen-Image's own file carries, ...) are
/// ignored, as Diffusers ignores them; missing fields take Diffusers' defaults. The
/// variants' switches (`zero_cond_t`, `use_additional_t_cond`, `use_layer3d_rope`,
/// `guidance_embeds`) are read so that a checkpoint needing one is refused by name rather
/// than run as the base model.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct QwenImageTransformerConfig {
    /// Patch size of the pipeline's latent packing; `proj_out` predicts
    /// `patch_size² · out_channels` channels per token.
    pub patch_size: usize,
    /// Channels of a packed latent token (64 = 16 latent channels × 2 × 2).
    pub in_channels: usize,
    /// Output channels per patch position; `None` (JSON `null`) means `in_channels`.
    pub out_channels: Option<usize>,
    /// Number of dual-stream blocks (`transformer_blocks`).
    pub num_layers: usize,
    /// Width of one attention head.
    pub attention_head_dim: usize,
    /// Number of attention heads.
    pub num_attention_heads: usize,
    /// Width of the text encoder's hidden states (Qwen2.5-VL 7B: 3584).
    pub joint_attention_dim: usize,
    /// Diffusers' unused guidance switch; only `false` (see [`QwenImageTransformerConfig::validate`]).
    pub guidance_embeds: bool,
    /// RoPE widths of the three position axes (frame, row, column); they sum to
    /// `attention_head_dim`.
    pub axes_dims_rope: Vec<usize>,
    /// Qwen-Image-Edit-2511's zero-timestep conditioning of reference images; only `false`.
    pub zero_cond_t: bool,
    /// Qwen-Image-Layered's additional timestep embedding; only `false`.
    pub use_additional_t_cond: bool,
    /// Qwen-Image-Layered's layer-wise rotary embedding; only `false`.
    pub use_layer3d_rope: bool,
}

impl Default for QwenImageTransformerConfig {
    /// Diffusers' constructor defaults, which are Qwen-Image's
    /// ([`QwenImageTransformerConfig::qwen_image`]).
    fn default() -> Self {
        Self {
            patch_size: 2,
            in_channels: 64,
            out_channels: Some(16),
            num_layers: 60,
            attention_head_dim: 128,
            num_attention_heads: 24,
            joint_attention_dim: 3584,
            guidance_embeds: false,
            axes_dims_rope: vec![16, 56, 56],
            zero_cond_t: false,
            use_additional_t_cond: false,
            use_layer3d_rope: false,
        }
    }
}

impl QwenImageTransformerConfig {
    /// Qwen-Image (`Qwen/Qwen-Image`'s `transformer/config.json`): 60 dual-stream blocks,
    /// 24 heads × 128, text width 3584, 64 input channels, 16 output channels per patch
    /// position of a 2×2 patch, RoPE axes (16, 56, 56).
    pub fn qwen_image() -> Self {
        Self::default()
    }

    /// A tiny Qwen-Image for tests and CI (`qwen-tiny`, the `qwen_image_transformer`
    /// fixture's config): 2 blocks of 2 heads × 16, text width 32, 4 latent channels packed
    /// 2×2 (16 in), 4 out per patch position, RoPE axes (4, 6, 6).
    pub fn tiny() -> Self {
        Self {
            patch_size: 2,
            in_channels: 16,
            out_channels: Some(4),
            num_layers: 2,
            attention_head_dim: 16,
            num_attention_heads: 2,
            joint_attention_dim: 32,
            axes_dims_rope: vec![4, 6, 6],
            ..Self::default()
        }
    }

    /// The config of a named model: `qwen-image` or `qwen-tiny`.
    pub fn named(name: &str) -> Option<Self> {
        match name {
            "qwen-image" | "qwen_image" => Some(Self::qwen_image()),
            "qwen-tiny" | "qwen_tiny" => Some(Self::tiny()),
            _ => None,
        }
    }

    /// The names [`QwenImageTransformerConfig::named`] knows.
    pub const NAMES: [&'static str; 2] = ["qwen-image", "qwen-tiny"];

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
                "{e}; expected a QwenImageTransformer2DModel config.json as Diffusers writes it"
            ),
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks the values against each other and refuses what DDO does not run; the error
    /// names the field and what would be valid.
    pub fn validate(&self) -> LoadResult<()> {
        let invalid = |field: &str, value: String, hint: &str| {
            Err(LoadError::InvalidConfig {
                field: field.into(),
                value,
                hint: hint.into(),
            })
        };
        for (field, on, hint) in [
            (
                "zero_cond_t",
                self.zero_cond_t,
                "DDO runs the base Qwen-Image transformer; the zero-timestep conditioning of \
                 reference images (Qwen-Image-Edit-2511) is not implemented: use a checkpoint \
                 whose config sets it false",
            ),
            (
                "use_additional_t_cond",
                self.use_additional_t_cond,
                "the additional timestep embedding (Qwen-Image-Layered) is not implemented: \
                 use a checkpoint whose config sets it false",
            ),
            (
                "use_layer3d_rope",
                self.use_layer3d_rope,
                "the layer-wise rotary embedding (Qwen-Image-Layered) is not implemented: use \
                 a checkpoint whose config sets it false",
            ),
            (
                "guidance_embeds",
                self.guidance_embeds,
                "QwenImageTransformer2DModel has no guidance embedder (Diffusers 0.42.1's \
                 forward fails when guidance is passed); every Qwen-Image checkpoint sets false",
            ),
        ] {
            if on {
                return invalid(field, "true".into(), hint);
            }
        }
        for (field, v) in [
            ("patch_size", self.patch_size),
            ("in_channels", self.in_channels),
            ("num_attention_heads", self.num_attention_heads),
            ("attention_head_dim", self.attention_head_dim),
            ("joint_attention_dim", self.joint_attention_dim),
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
                "give three widths, one per position axis (frame, row, column), e.g. [16, 56, 56]",
            );
        }
        if self
            .axes_dims_rope
            .iter()
            .any(|d| *d == 0 || !d.is_multiple_of(2))
        {
            return invalid(
                "axes_dims_rope",
                axes,
                "every axis width must be even and positive (rotary pairs)",
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
        let widths = self
            .num_attention_heads
            .checked_mul(self.attention_head_dim)
            .and_then(|d| d.checked_mul(6))
            .zip(
                self.patch_size
                    .checked_mul(self.patch_size)
                    .and_then(|p| p.checked_mul(self.out_channels())),
            );
        if widths.is_none() {
            return invalid(
                "num_attention_heads",
                self.num_attention_heads.to_string(),
                "the model's widths (6 * num_attention_heads * attention_head_dim, \
                 patch_size^2 * out_channels) overflow",
            );
        }
        Ok(())
    }

    /// Model width: `num_attention_heads * attention_head_dim`.
    pub fn inner_dim(&self) -> usize {
        self.num_attention_heads * self.attention_head_dim
    }

    /// Output channels per patch position (`out_channels or in_channels`).
    pub fn out_channels(&self) -> usize {
        self.out_channels.unwrap_or(self.in_channels)
    }

    /// Channels `proj_out` predicts per token: `patch_size² · out_channels`.
    pub fn proj_out_channels(&self) -> usize {
        self.patch_size * self.patch_size * self.out_channels()
    }

    /// Params of one dual-stream block: `36·D² + 30·D + 4·head_dim` with `D` the inner width
    /// (two modulations `D→6D`, eight attention linears `D→D`, two feed-forwards `D→4D→D`,
    /// four RMS norms over a head).
    pub fn block_params(&self) -> u64 {
        let d = self.inner_dim() as u64;
        let hd = self.attention_head_dim as u64;
        36 * d * d + 30 * d + 4 * hd
    }

    /// Params outside the blocks: the timestep embedder, `txt_norm`, `txt_in`, `img_in`,
    /// `norm_out` and `proj_out`.
    pub fn shared_params(&self) -> u64 {
        let d = self.inner_dim() as u64;
        let t = TIMESTEP_CHANNELS as u64;
        let j = self.joint_attention_dim as u64;
        let out = self.proj_out_channels() as u64;
        (t * d + d + d * d + d)
            + j
            + (j * d + d)
            + (self.in_channels as u64 * d + d)
            + (2 * d * d + 2 * d)
            + (d * out + out)
    }

    /// Total params.
    pub fn param_count(&self) -> u64 {
        self.shared_params() + self.num_layers as u64 * self.block_params()
    }
}

/// The inputs of one transformer call, as `QwenImagePipeline` passes them. Tensors may be on
/// the host or on the execution device; they are moved to the device and cast to the model's
/// dtype inside [`QwenImageTransformer::forward`].
#[derive(Debug, Clone)]
pub struct QwenImageInputs {
    /// Packed image latents `[batch, img_tokens, in_channels]`: the tokens of every image of
    /// `img_shapes`, one after the other.
    pub hidden_states: Tensor,
    /// Text encoder states `[batch, txt_tokens, joint_attention_dim]`.
    pub encoder_hidden_states: Tensor,
    /// Diffusers' `encoder_hidden_states_mask`: `batch × txt_tokens` flags, row-major, `true`
    /// for a real token and `false` for padding, whose keys the joint attention then ignores;
    /// `None` attends to every token (what the pipeline passes when no prompt is padded).
    pub encoder_hidden_states_mask: Option<Vec<bool>>,
    /// Timestep per batch element (or one for all), already `t / 1000` as the pipeline passes
    /// it; the timestep projection multiplies by 1000 itself.
    pub timestep: Vec<f32>,
    /// `(frames, rows, cols)` of the images of one sample, in token order (the pipeline's
    /// `img_shapes[0]`: `[(1, height / 16, width / 16)]`; an edit pipeline adds its reference
    /// image). Every sample of the batch has these shapes, as Diffusers assumes: it reads
    /// the first sample's alone.
    pub img_shapes: Vec<[usize; 3]>,
}

impl QwenImageInputs {
    /// Deterministic host inputs for a model of `config`, for tests and benchmarks: one
    /// image of `rows × cols` patches, `txt` text tokens (none padded), values in [-1, 1)
    /// from a fixed integer hash, timestep 0.5 (batch 1).
    pub fn synthetic(
        config: &QwenImageTransformerConfig,
        rows: usize,
        cols: usize,
        txt: usize,
    ) -> Result<Self> {
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
            hidden_states: tensor(vec![1, rows * cols, config.in_channels], 1)?,
            encoder_hidden_states: tensor(vec![1, txt, config.joint_attention_dim], 2)?,
            encoder_hidden_states_mask: None,
            timestep: vec![0.5],
            img_shapes: vec![[1, rows, cols]],
        })
    }
}

fn shape_err(what: &str, message: impl Into<String>) -> CoreError {
    CoreError::Shape {
        what: what.into(),
        message: message.into(),
    }
}

/// The prefix of a Qwen-Image transformer's tensors in ComfyUI's full checkpoints (a
/// single file may also hold them bare, as Diffusers names them).
pub const QWEN_FILE_PREFIX: &str = "model.diffusion_model.";

/// A tensor every Qwen-Image transformer file holds: how a single file is told from another
/// architecture's.
pub const QWEN_FILE_MARKER: &str = "txt_norm.weight";

/// Diffusers' `QwenImageTransformer2DModel` as a DDO component named `transformer`.
#[derive(Debug, Clone)]
pub struct QwenImageTransformer {
    component: Arc<Component>,
    program: Arc<QwenImageProgram>,
}

impl QwenImageTransformer {
    /// Builds the model from `weights` (Diffusers names) for `config`.
    pub fn build(
        weights: &mut dyn WeightSource,
        config: QwenImageTransformerConfig,
    ) -> LoadResult<Self> {
        config.validate()?;
        let mut b = ModelBuilder::new(weights);
        let program = Arc::new(QwenImageProgram::build(&mut b, &config)?);
        let component = b.finish(
            "transformer",
            "QwenImageTransformer2DModel",
            program.clone(),
        )?;
        Ok(Self { component, program })
    }

    /// Loads a Diffusers model folder (`config.json` and the safetensors weights, single or
    /// sharded). `dtype` converts every param on load (an 8-bit float stores the cast
    /// layers' weights as scaled fp8, as for Flux); `None` keeps the file's dtype and the
    /// params checkpoint-backed.
    pub fn load(dir: &Path, dtype: Option<DType>) -> LoadResult<Self> {
        Self::load_checked(dir, dtype, UnusedWeights::Refuse)
    }

    /// [`QwenImageTransformer::load`], with what to do about checkpoint tensors the config
    /// leaves unused (refused by default).
    pub fn load_checked(
        dir: &Path,
        dtype: Option<DType>,
        unused: UnusedWeights,
    ) -> LoadResult<Self> {
        let config = QwenImageTransformerConfig::from_file(&dir.join("config.json"))?;
        CheckpointWeights::build_in(dir, source_target(dtype), &[], unused, |w| {
            stored_as(w, dtype, &QWEN_IMAGE_SKIP_PATTERNS, |w| {
                Self::build(w, config)
            })
        })
    }

    /// Loads a transformer from one file for `config` (the pipeline folder's): a safetensors
    /// file or a GGUF file (`.gguf`: QuantStack's and city96's Qwen-Image files) holding
    /// Diffusers' names, bare or under ComfyUI's [`QWEN_FILE_PREFIX`]. A GGUF's quantized
    /// blocks stay as stored (the linears dequantize them where they run, and the model
    /// computes in bf16) unless `dtype` asks for a conversion, which dequantizes at load. A
    /// file without the model's `txt_norm.weight` (another architecture: Flux's original
    /// layout has an `img_in` too) is refused naming
    /// it; tensors the config leaves unused are refused unless `unused` allows them.
    pub fn load_file(
        path: &Path,
        config: QwenImageTransformerConfig,
        dtype: Option<DType>,
        unused: UnusedWeights,
    ) -> LoadResult<Self> {
        let weights = CheckpointWeights::open_file(path, source_target(dtype))?;
        let (views, others) = {
            let ckpt = weights
                .single_file()
                .ok_or_else(|| LoadError::CorruptFile {
                    file: path.to_path_buf(),
                    message: "not one weight file".into(),
                })?;
            let names: Vec<&str> = ckpt
                .names()
                .chain(ckpt.unsupported().map(|(n, _)| n))
                .collect();
            let prefixed = names
                .iter()
                .any(|n| *n == format!("{QWEN_FILE_PREFIX}{QWEN_FILE_MARKER}"));
            if !prefixed && !names.contains(&QWEN_FILE_MARKER) {
                return Err(LoadError::CorruptFile {
                    file: path.to_path_buf(),
                    message: format!(
                        "not a Qwen-Image transformer (no `{QWEN_FILE_MARKER}`, bare or under                          `{QWEN_FILE_PREFIX}`): give a QwenImageTransformer2DModel's weights"
                    ),
                });
            }
            let views: Option<std::collections::HashMap<String, crate::weights::View>> = prefixed
                .then(|| {
                    names
                        .iter()
                        .filter_map(|n| {
                            n.strip_prefix(QWEN_FILE_PREFIX).map(|bare| {
                                (
                                    bare.to_string(),
                                    crate::weights::View {
                                        tensor: n.to_string(),
                                        kind: crate::weights::ViewKind::Whole,
                                    },
                                )
                            })
                        })
                        .collect()
                });
            // With the prefix, tensors outside it are another part of a full checkpoint.
            let others: Vec<String> = if prefixed {
                names
                    .iter()
                    .filter(|n| !n.starts_with(QWEN_FILE_PREFIX))
                    .map(|n| n.to_string())
                    .collect()
            } else {
                Vec::new()
            };
            (views, others)
        };
        let mut weights = match views {
            Some(v) => weights.with_views(v),
            None => weights,
        };
        let model = stored_as(&mut weights, dtype, &QWEN_IMAGE_SKIP_PATTERNS, |w| {
            Self::build(w, config)
        })?;
        let ignored: Vec<&str> = others.iter().map(String::as_str).collect();
        weights.check_unused(&ignored, unused)?;
        Ok(model)
    }

    /// A model with seeded random weights stored as `dtype` (large params filled on all
    /// cores, [`RandomWeights`]; the argument order of [`crate::flux::FluxTransformer::random`]);
    /// an 8-bit float `dtype` makes bf16 weights and stores the
    /// cast layers' as scaled fp8, as [`QwenImageTransformer::load`] does with a checkpoint.
    pub fn random(config: QwenImageTransformerConfig, seed: u64, dtype: DType) -> LoadResult<Self> {
        Self::build_as(
            &mut RandomWeights::new(seed, dtype.compute()),
            config,
            Some(dtype),
        )
    }

    /// [`QwenImageTransformer::build`] with the weights stored as `dtype` asks: an 8-bit
    /// float stores the cast layers' as scaled fp8 ([`crate::fp8`]), the rest as `weights`
    /// gives them.
    pub fn build_as(
        weights: &mut dyn WeightSource,
        config: QwenImageTransformerConfig,
        dtype: Option<DType>,
    ) -> LoadResult<Self> {
        stored_as(weights, dtype, &QWEN_IMAGE_SKIP_PATTERNS, |w| {
            Self::build(w, config)
        })
    }

    /// The component (attach routes to it).
    pub fn component(&self) -> &Arc<Component> {
        &self.component
    }

    /// The program (the layers).
    pub fn program(&self) -> &Arc<QwenImageProgram> {
        &self.program
    }

    /// The config.
    pub fn config(&self) -> &QwenImageTransformerConfig {
        self.program.config()
    }

    /// The linear calls one forward makes for `batch` samples of `img_tokens` image tokens
    /// and `txt_tokens` text tokens, in the activations' dtype ([`ddo_core::linear_calls`]:
    /// a backend loads their kernels before the phase). None under `--compute fp8`, whose
    /// linears run other kernels, and none for a component its forward would refuse.
    pub fn linear_calls(
        &self,
        batch: usize,
        img_tokens: usize,
        txt_tokens: usize,
    ) -> Vec<ddo_core::LinearCall> {
        crate::layers::named_linear_calls(
            &self.component,
            self.program.compute_dtype(&self.component),
            |dtype| {
                self.program
                    .linear_calls(batch, img_tokens, txt_tokens, dtype)
            },
        )
    }

    /// Runs the transformer on `device` through the attached route (if any): Diffusers'
    /// `forward(hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep,
    /// img_shapes, return_dict=False)[0]`. Returns `[batch, img_tokens,
    /// patch_size² · out_channels]` on `device`, in the model's dtype.
    pub fn forward(&self, device: &dyn Device, inputs: &QwenImageInputs) -> Result<Tensor> {
        self.component.run(device, |ctx| {
            self.program.run_with_rope(ctx, inputs, None, None)
        })
    }

    /// The rotary tables of forwards over `inputs`' image shapes and text length, made on
    /// `device` once ([`QwenRope`]); give them to [`QwenImageTransformer::forward_with_rope`].
    pub fn make_rope(&self, device: &dyn Device, inputs: &QwenImageInputs) -> Result<QwenRope> {
        self.program.make_rope(device, inputs)
    }

    /// [`QwenImageTransformer::forward`] with the rotary tables `rope` (used when they were
    /// made for `inputs`' image shapes and text length, else the forward makes its own): the
    /// same result, without the tables' upload.
    pub fn forward_with_rope(
        &self,
        device: &dyn Device,
        inputs: &QwenImageInputs,
        rope: &QwenRope,
    ) -> Result<Tensor> {
        self.component.run(device, |ctx| {
            self.program.run_with_rope(ctx, inputs, Some(rope), None)
        })
    }

    /// [`QwenImageTransformer::forward`], handing `tap` each intermediate under the name of
    /// the Diffusers module whose output it is (the `intermediates.safetensors` names of the
    /// fixture: `img_in`, `txt_norm`, `txt_in`, `time_text_embed`,
    /// `transformer_blocks.<i>.0` — text — and `.1` — image —, `norm_out`), for
    /// layer-by-layer comparison. The values are those of a plain forward.
    pub fn forward_with_taps(
        &self,
        device: &dyn Device,
        inputs: &QwenImageInputs,
        tap: &mut dyn FnMut(&str, &Tensor) -> Result<()>,
    ) -> Result<Tensor> {
        self.component
            .run(device, |ctx| self.program.run(ctx, inputs, tap))
    }
}
