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
//! through the device's [`Ops`](ddo_core::Ops), every leaf through
//! [`ForwardContext::run_leaf`](ddo_core::ForwardContext::run_leaf).
//!
//! Also here: FluxPipeline's latent packing helpers ([`pack_latents`], [`unpack_latents`],
//! [`latent_image_ids`]).

pub(crate) mod blocks;
mod embeddings;
mod latents;
pub mod original;
mod program;

use std::path::Path;
use std::sync::Arc;

use ddo_core::{Component, CoreError, DType, Device, Result, Tensor};
use serde::Deserialize;

use crate::builder::ModelBuilder;
use crate::error::{LoadError, LoadResult};
use crate::fp8::{FLUX_SKIP_PATTERNS, source_target, stored_as};
use crate::weights::{CheckpointWeights, RandomWeights, UnusedWeights, WeightSource};

pub use blocks::DeviceRope;
pub use embeddings::{rope_tables, timestep_embedding};
pub use latents::{latent_image_ids, latent_size, pack_latents, unpack_latents};
pub use original::{config_from_original, original_prefix, original_views};
pub use program::{FluxProgram, FluxRope};

/// RoPE base of every Flux model (`FluxPosEmbed(theta=10000)`).
pub const ROPE_THETA: f64 = 10000.0;

/// Channels of the sinusoidal timestep projection (`Timesteps(num_channels=256)`).
pub const TIMESTEP_CHANNELS: usize = 256;

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
        // fp8 storage: the cast layers' weights stored as fp8 with a per-tensor scale, the
        // rest as stored ([`crate::fp8::Fp8Storage`]); weights already in fp8 load as stored.
        CheckpointWeights::build_in(dir, source_target(dtype), &[], unused, |w| {
            stored_as(w, dtype, &FLUX_SKIP_PATTERNS, |w| Self::build(w, config))
        })
    }

    /// A model with seeded random weights stored as `dtype`; an 8-bit float `dtype` makes
    /// bf16 weights and stores the cast layers' as scaled fp8, as [`FluxTransformer::load`]
    /// does with a checkpoint.
    pub fn random(config: FluxTransformerConfig, seed: u64, dtype: DType) -> LoadResult<Self> {
        Self::build_as(
            &mut RandomWeights::new(seed, dtype.compute()),
            config,
            Some(dtype),
        )
    }

    /// [`FluxTransformer::build`] with the weights stored as `dtype` asks: an 8-bit float
    /// stores the cast layers' as scaled fp8 ([`crate::fp8`]), the rest as `weights` gives
    /// them.
    pub fn build_as(
        weights: &mut dyn WeightSource,
        config: FluxTransformerConfig,
        dtype: Option<DType>,
    ) -> LoadResult<Self> {
        stored_as(weights, dtype, &FLUX_SKIP_PATTERNS, |w| {
            Self::build(w, config)
        })
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

    /// The linear calls one forward makes for `batch` images of `img_tokens` latent tokens
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

    /// Computes and keeps the rotary tables of a forward over `txt_tokens` text tokens (ids
    /// of zeros, as FluxPipeline gives them) and `img_ids`, so the first forward with those
    /// ids finds them made (about 5 ms of host time at 1024x1024, while a streamed forward's
    /// device would wait).
    pub fn prepare_rope(&self, txt_tokens: usize, img_ids: &[[f32; 3]]) {
        let ids = program::joined_ids(&vec![[0.0; 3]; txt_tokens], img_ids);
        drop(self.program.rope_tables_cached(&ids));
    }

    /// Runs the transformer on `device` through the attached route (if any): Diffusers'
    /// `forward(hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids,
    /// txt_ids, guidance, return_dict=False)[0]`. Returns `[batch, img_tokens, out_channels]`
    /// on `device`, in the model's dtype.
    pub fn forward(&self, device: &dyn Device, inputs: &FluxInputs) -> Result<Tensor> {
        self.component
            .run(device, |ctx| self.program.run(ctx, inputs))
    }

    /// The rotary tables of forwards over `inputs`' position ids, made on `device` once
    /// ([`FluxRope`]); give them to [`FluxTransformer::forward_with_rope`].
    pub fn make_rope(&self, device: &dyn Device, inputs: &FluxInputs) -> Result<FluxRope> {
        self.program.make_rope(device, inputs)
    }

    /// [`FluxTransformer::forward`] with the rotary tables `rope` (used when they were made
    /// for `inputs`' ids, else the forward makes its own): the same result, without the
    /// tables' upload.
    pub fn forward_with_rope(
        &self,
        device: &dyn Device,
        inputs: &FluxInputs,
        rope: &FluxRope,
    ) -> Result<Tensor> {
        self.component.run(device, |ctx| {
            self.program.run_with_rope(ctx, inputs, Some(rope))
        })
    }
}
