//! Diffusers' `FluxPipeline` on DDO: prompt encoding (CLIP pooled + T5 sequence), the
//! denoising loop (latent packing, [`FlowMatchEulerScheduler`] with the resolution-dependent
//! shift, guidance embedding), and the VAE decode — each phase running its component
//! through whatever route is attached to it.
//!
//! [`FluxPipeline::run_phases`] is the driver a user of DDO wants: given a
//! [`PipelineOffload`](ddo_routes::PipelineOffload) (the pipeline's components with their
//! routes), it runs the three phases and, between them, does the seed's phase-boundary
//! cleanup: the finished component is released (hooks removed, device and pinned memory
//! freed, weights host-only), the phase's device state is dropped (what the next phase needs
//! is kept on the host), idle cached memory is returned (`empty_cache`), and the phase's
//! device peak is recorded with `phase_boundary`. Each phase reports its route, wall time
//! and peak.
//!
//! Values follow diffusers 0.42.1 `pipeline_flux.py`: latents `[1, C, 2·(H/(2f)), 2·(W/(2f))]`
//! packed into 2×2 patches; `image_seq_len` = packed tokens; `mu = calculate_shift(...)`;
//! per step `timestep = t / 1000` (in the latents' dtype), `guidance = [scale]` (f32) when
//! the transformer has a guidance embedder, `txt_ids` zeros, `img_ids` `(0, row, col)`;
//! after the loop `latents / scaling_factor + shift_factor` and `vae.decode`.
//!
//! Initial noise from a seed is DDO's own (SplitMix64 + Box–Muller, documented at
//! [`gaussian_noise`]), not PyTorch's generator: to reproduce a Diffusers run exactly,
//! pass its noise ([`InitLatents::Given`]) and embeddings ([`PromptInput::Embeddings`]).
//!
//! Diffusers' `QwenImagePipeline` ([`QwenImagePipeline`], true CFG, the Qwen models) runs on
//! the same phase driver (`phases.rs`: the error cleanup, the phase beginnings and the seed's
//! boundary are one piece of code both pipelines call); [`PipelineKind::detect`] tells the two
//! apart from a folder's `model_index.json`.

mod cancel;
mod decode_plan;
mod fp8_blame;
mod phases;
mod qwen;
mod request;

use std::path::Path;
use std::sync::Arc;

use ddo_core::finite::DeferredFiniteChecks;
use ddo_core::{Component, CoreError, DType, Device, Result, Tensor, check_finite, ops_of};
use ddo_routes::Pipeline;
use half::{bf16, f16};

use crate::clip::{self, ClipTextConfig, ClipTextModel};
use crate::error::{LoadError, LoadResult};
use crate::flux::{
    self, FluxInputs, FluxTransformer, FluxTransformerConfig, latent_image_ids, pack_latents,
    unpack_latents,
};
use crate::scheduler::{FlowMatchEulerConfig, FlowMatchEulerScheduler};
use crate::t5::{self, T5Config, T5Encoder};
use crate::tokenizer;
use crate::vae::{
    self, AutoencoderKL, AutoencoderKLConfig, TilingConfig, estimate_tiled_decode_peak_bytes_on,
};
use crate::weights::{RandomWeights, UnusedWeights};

use decode_plan::fallback_tiling;
pub use decode_plan::{DecodePlan, TiledDecode, plan_decode, plan_decode_on};
use fp8_blame::{StepInputs, name_fp8_layer};
pub use qwen::{
    PipelineKind, QWEN_TEXT_ENCODER, QWEN_TOKENIZER, QWEN_TRANSFORMER, QWEN_VAE, QwenImagePipeline,
    QwenImagePipelineConfig, QwenImageRequest, QwenPromptInput, STAND_IN_SUFFIX_TOKENS,
    config_class, estimate_qwen_image_activation_bytes, estimate_qwen_text_activation_bytes,
    plan_qwen_decode_on, stand_in_ids,
};
pub use request::{
    InitLatents, PhaseReport, PipelineRequest, PipelineRun, Progress, PromptEmbeds, PromptInput,
};

/// Phase names, in order (the names `phase_boundary` records).
pub const PHASES: [&str; 3] = ["prompt_encoding", "denoise", "decode"];

/// The prompt-encoding phase as [`CoreError::NonFinite`] names it.
const PHASE_PROMPT: &str = "prompt encoding";

/// Component names of a Flux pipeline, as Diffusers names its folders.
pub const TEXT_ENCODER: &str = clip::COMPONENT_NAME;
/// The T5 encoder's component name.
pub const TEXT_ENCODER_2: &str = t5::COMPONENT_NAME;
/// The transformer's component name.
pub const TRANSFORMER: &str = "transformer";
/// The VAE's component name.
pub const VAE: &str = vae::COMPONENT_NAME;

/// The configs of a whole pipeline.
#[derive(Debug, Clone, PartialEq)]
pub struct FluxPipelineConfig {
    /// CLIP text encoder (`text_encoder`).
    pub text_encoder: ClipTextConfig,
    /// T5 encoder (`text_encoder_2`).
    pub text_encoder_2: T5Config,
    /// The transformer.
    pub transformer: FluxTransformerConfig,
    /// The VAE.
    pub vae: AutoencoderKLConfig,
    /// The scheduler.
    pub scheduler: FlowMatchEulerConfig,
    /// T5 sequence length for text prompts (FluxPipeline's `max_sequence_length`).
    pub max_sequence_length: usize,
}

impl FluxPipelineConfig {
    /// The tiny pipeline of the `flux_pipeline` fixture: CLIP and T5 of width 32 with two
    /// layers, a Flux transformer with one double and one single block (2 heads × 16), a
    /// Flux-layout VAE with widths (8, 16) and 4 latent channels (`vae_scale_factor` 2),
    /// FLUX.1-dev's scheduler; T5 sequences of 32 tokens.
    pub fn tiny() -> Self {
        Self {
            text_encoder: ClipTextConfig {
                vocab_size: 100,
                hidden_size: 32,
                intermediate_size: 64,
                num_hidden_layers: 2,
                num_attention_heads: 4,
                max_position_embeddings: 16,
                hidden_act: "quick_gelu".into(),
                layer_norm_eps: 1e-5,
                eos_token_id: 99,
                bos_token_id: 98,
                projection_dim: Some(512),
            },
            text_encoder_2: T5Config {
                vocab_size: 100,
                d_model: 32,
                d_kv: 8,
                d_ff: 64,
                num_layers: 2,
                num_heads: 4,
                relative_attention_num_buckets: 32,
                relative_attention_max_distance: 128,
                layer_norm_epsilon: 1e-6,
                feed_forward_proj: "gated-gelu".into(),
            },
            transformer: FluxTransformerConfig {
                patch_size: 1,
                in_channels: 16,
                out_channels: None,
                num_layers: 1,
                num_single_layers: 1,
                attention_head_dim: 16,
                num_attention_heads: 2,
                joint_attention_dim: 32,
                pooled_projection_dim: 32,
                guidance_embeds: true,
                axes_dims_rope: vec![4, 6, 6],
            },
            vae: AutoencoderKLConfig {
                latent_channels: 4,
                block_out_channels: vec![8, 16],
                layers_per_block: 1,
                norm_num_groups: 4,
                up_block_types: vec![vae::UP_DECODER_BLOCK.into(); 2],
                sample_size: 32,
                ..AutoencoderKLConfig::flux()
            },
            scheduler: FlowMatchEulerConfig::flux(),
            max_sequence_length: 32,
        }
    }

    /// FLUX.1-dev at its real sizes: CLIP-L, T5-XXL, the 19 + 38 block transformer with
    /// guidance embedding, the Flux VAE, its scheduler; T5 sequences of 512 tokens.
    pub fn flux_dev() -> Self {
        Self {
            text_encoder: ClipTextConfig::clip_l(),
            text_encoder_2: T5Config::t5_xxl(),
            transformer: FluxTransformerConfig::flux_dev(),
            vae: AutoencoderKLConfig::flux(),
            scheduler: FlowMatchEulerConfig::flux(),
            max_sequence_length: 512,
        }
    }

    /// The config of a named pipeline: `tiny` or `flux-dev`.
    pub fn named(name: &str) -> Option<Self> {
        match name {
            "tiny" => Some(Self::tiny()),
            "flux-dev" | "flux_dev" => Some(Self::flux_dev()),
            _ => None,
        }
    }

    /// The names [`FluxPipelineConfig::named`] knows.
    pub const NAMES: [&'static str; 2] = ["tiny", "flux-dev"];
}

/// Checks that the components fit together.
fn check_consistency(
    clip: Option<&ClipTextConfig>,
    t5: Option<&T5Config>,
    transformer: &FluxTransformerConfig,
    vae: &AutoencoderKLConfig,
) -> LoadResult<()> {
    let invalid = |field: &str, value: usize, hint: String| {
        Err(LoadError::InvalidConfig {
            field: field.into(),
            value: value.to_string(),
            hint,
        })
    };
    if transformer.in_channels != 4 * vae.latent_channels {
        return invalid(
            "transformer.in_channels",
            transformer.in_channels,
            format!(
                "FluxPipeline packs 2x2 latent patches: it must be 4 x vae.latent_channels = {}",
                4 * vae.latent_channels
            ),
        );
    }
    if transformer.out_channels() != transformer.in_channels {
        return invalid(
            "transformer.out_channels",
            transformer.out_channels(),
            format!(
                "the Euler step adds the prediction to the latents: it must equal in_channels = {}",
                transformer.in_channels
            ),
        );
    }
    if let Some(t5) = t5
        && t5.d_model != transformer.joint_attention_dim
    {
        return invalid(
            "transformer.joint_attention_dim",
            transformer.joint_attention_dim,
            format!("must equal text_encoder_2's d_model = {}", t5.d_model),
        );
    }
    if let Some(clip) = clip
        && clip.hidden_size != transformer.pooled_projection_dim
    {
        return invalid(
            "transformer.pooled_projection_dim",
            transformer.pooled_projection_dim,
            format!(
                "must equal text_encoder's hidden_size = {}",
                clip.hidden_size
            ),
        );
    }
    Ok(())
}

/// `n` standard normal values from `seed`: SplitMix64 gives 64-bit words; each pair of words
/// gives two uniforms `u = (word >> 11 + 0.5) / 2^53` in (0, 1), and Box–Muller turns each
/// pair `(u1, u2)` into `r·cos θ, r·sin θ` with `r = √(−2 ln u1)`, `θ = 2π u2` (f64, rounded to
/// f32).
pub fn gaussian_noise(seed: u64, n: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n + 1);
    fill_gaussian_noise(seed, n, &mut out);
    out
}

/// [`gaussian_noise`] into `out` (empty, with room for `n + 1` values).
fn fill_gaussian_noise(seed: u64, n: usize, out: &mut Vec<f32>) {
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut uniform = || ((next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    while out.len() < n {
        let (u1, u2) = (uniform(), uniform());
        let r = (-2.0 * u1.ln()).sqrt();
        let theta = 2.0 * std::f64::consts::PI * u2;
        out.push((r * theta.cos()) as f32);
        out.push((r * theta.sin()) as f32);
    }
    out.truncate(n);
}

fn round_to(dtype: DType, v: f32) -> f32 {
    match dtype {
        DType::F16 => f16::from_f32(v).to_f32(),
        DType::BF16 => bf16::from_f32(v).to_f32(),
        _ => v,
    }
}

fn invalid(option: &str, value: impl Into<String>, hint: impl Into<String>) -> CoreError {
    CoreError::InvalidOption {
        option: option.into(),
        value: value.into(),
        hint: hint.into(),
    }
}

fn to_host(device: &dyn Device, t: &Tensor) -> Result<Tensor> {
    let values = if t.is_on_device() {
        t.to_f32_vec(device, &device.compute_stream())?
    } else {
        t.host_f32()?
    };
    Tensor::from_f32(t.shape().to_vec(), DType::F32, &values)
}

/// The packed initial latents `[images, tokens, 4·c]` on `device` in `dtype`, for an image
/// of `size` (height, width) pixels on the latent `grid` (h, w) with `c` latent channels.
/// Seeded noise is one draw of `images · c · h · w` values, as `randn_tensor` draws
/// `[images, c, h, w]` from one generator: image 0 is the batch-1 noise of the same seed.
/// Given noise is unpacked `[images, c, h, w]` or packed `[images, tokens, 4·c]`.
pub(crate) fn packed_initial_latents(
    device: &dyn Device,
    init: &InitLatents,
    size: (usize, usize),
    images: usize,
    grid: (usize, usize),
    c: usize,
    dtype: DType,
) -> Result<Tensor> {
    let ops = ops_of(device)?;
    let stream = device.compute_stream();
    let (height, width) = size;
    let (h, w) = grid;
    let tokens = (h / 2) * (w / 2);
    let n = images;
    let packed = match init {
        InitLatents::Seed(seed) => {
            if n == 0 {
                return Err(invalid("num_images", "0", "give 1 or more images"));
            }
            let per_image = c.checked_mul(h).and_then(|k| k.checked_mul(w));
            let count = per_image.and_then(|k| k.checked_mul(n)).ok_or_else(|| {
                if per_image.is_none() {
                    invalid(
                        "height/width",
                        format!("{height}x{width}"),
                        "the initial noise of one image has more values than memory can address: give a smaller --height/--width",
                    )
                } else {
                    invalid(
                        "num_images",
                        n.to_string(),
                        "the images' initial noise has more values than memory can address: give a smaller --num-images or --height/--width",
                    )
                }
            })?;
            // The noise is made on the host first: refused, not aborted, when it does
            // not fit in host memory.
            let mut noise = Vec::new();
            noise
                .try_reserve_exact(count.saturating_add(1))
                .map_err(|_| {
                    invalid(
                        "height/width",
                        format!("{height}x{width}"),
                        format!(
                            "the initial noise of {n} image(s) ({count} values) does not fit in host memory: give a smaller --height/--width or --num-images"
                        ),
                    )
                })?;
            fill_gaussian_noise(*seed, count, &mut noise);
            let t = ops.tensor_from_f32(&[n, c, h, w], DType::F32, &noise)?;
            pack_latents(ops, &t)?
        }
        InitLatents::Given(t) => match t.shape() {
            [b, cc, hh, ww] if (*b, *cc, *hh, *ww) == (n, c, h, w) => {
                pack_latents(ops, &t.to_device(device, &stream)?)?
            }
            [b, tt, cc] if (*b, *tt, *cc) == (n, tokens, 4 * c) => t.to_device(device, &stream)?,
            s => {
                return Err(invalid(
                    "initial latents",
                    format!("{s:?}"),
                    format!(
                        "for {n} {height}x{width} image(s) give noise [{n}, {c}, {h}, {w}] (unpacked) or [{n}, {tokens}, {}] (packed), one row per image",
                        4 * c
                    ),
                ));
            }
        },
    };
    if packed.dtype() == dtype {
        Ok(packed)
    } else {
        ops.cast(&packed, dtype)
    }
}

/// Diffusers' `FluxPipeline`: the four models and the scheduler config.
pub struct FluxPipeline {
    /// CLIP (`text_encoder`); optional when prompts come as embeddings.
    pub clip: Option<ClipTextModel>,
    /// T5 (`text_encoder_2`); optional when prompts come as embeddings.
    pub t5: Option<T5Encoder>,
    /// The transformer.
    pub transformer: FluxTransformer,
    /// The VAE.
    pub vae: AutoencoderKL,
    /// The scheduler's config.
    pub scheduler: FlowMatchEulerConfig,
    /// T5 sequence length for text prompts.
    pub max_sequence_length: usize,
}

impl std::fmt::Debug for FluxPipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FluxPipeline")
            .field("components", &self.component_names())
            .finish()
    }
}

/// Components loaded on their own (single files: `ddo run --transformer FILE
/// --text-encoder FILE --text-encoder-2 FILE --vae FILE`) that take the place of a folder's
/// or a config's.
#[derive(Debug, Default)]
pub struct Loaded {
    /// The CLIP text encoder (`text_encoder`).
    pub text_encoder: Option<ClipTextModel>,
    /// The transformer.
    pub transformer: Option<FluxTransformer>,
    /// The T5 encoder (`text_encoder_2`).
    pub text_encoder_2: Option<T5Encoder>,
    /// The VAE.
    pub vae: Option<AutoencoderKL>,
}

impl FluxPipeline {
    /// A pipeline of these models; checks that they fit together.
    pub fn new(
        clip: Option<ClipTextModel>,
        t5: Option<T5Encoder>,
        transformer: FluxTransformer,
        vae: AutoencoderKL,
        scheduler: FlowMatchEulerConfig,
        max_sequence_length: usize,
    ) -> LoadResult<Self> {
        scheduler.validate()?;
        check_consistency(
            clip.as_ref().map(ClipTextModel::config),
            t5.as_ref().map(T5Encoder::config),
            transformer.config(),
            vae.config(),
        )?;
        Ok(Self {
            clip,
            t5,
            transformer,
            vae,
            scheduler,
            max_sequence_length,
        })
    }

    /// A pipeline at `config` with seeded random weights stored as `dtype` (component `k`
    /// of text_encoder, text_encoder_2, transformer, vae uses seed `seed + k`). An 8-bit
    /// float `dtype` stores the transformer's cast layers and T5's linears as scaled fp8 and
    /// makes the rest in bf16 ([`crate::fp8`]).
    pub fn random(config: &FluxPipelineConfig, seed: u64, dtype: DType) -> LoadResult<Self> {
        Self::random_with(config, seed, dtype, Loaded::default())
    }

    /// [`FluxPipeline::random`] with the components of `loaded` (checkpoints loaded on their
    /// own, e.g. single files) in place of random ones: the others are random at `config`.
    pub fn random_with(
        config: &FluxPipelineConfig,
        seed: u64,
        dtype: DType,
        loaded: Loaded,
    ) -> LoadResult<Self> {
        Self::random_parts(config, seed, dtype, loaded, |_| true)
    }

    /// [`FluxPipeline::random_with`] where only the random components `written` names
    /// (`text_encoder`, `text_encoder_2`, `transformer`, `vae`) get values, the same as
    /// `random_with`'s; the others are [`RandomWeights::unwritten`] (shapes and bytes, no
    /// memory behind them: not to be run). A bench of one component holds only its weights.
    pub fn random_parts(
        config: &FluxPipelineConfig,
        seed: u64,
        dtype: DType,
        loaded: Loaded,
        written: impl Fn(&str) -> bool,
    ) -> LoadResult<Self> {
        Self::built_from(config, dtype, loaded, |k| {
            let name = ["text_encoder", "text_encoder_2", "transformer", "vae"][k as usize];
            if written(name) {
                RandomWeights::new(seed.wrapping_add(k), dtype.compute())
            } else {
                RandomWeights::unwritten(dtype.compute())
            }
        })
    }

    /// [`FluxPipeline::random_with`] with weights never written
    /// ([`RandomWeights::unwritten`]): every param of the random components has its shape,
    /// dtype and bytes (fp8 storage's one byte per cast weight too) and no memory behind
    /// it, so FLUX.1-dev's plan (`ddo resolve`) costs no host memory for its weights. For
    /// planning and preflight only: running it computes on zeros.
    pub fn unwritten_with(
        config: &FluxPipelineConfig,
        dtype: DType,
        loaded: Loaded,
    ) -> LoadResult<Self> {
        Self::built_from(config, dtype, loaded, |_| {
            RandomWeights::unwritten(dtype.compute())
        })
    }

    /// The pipeline at `config`, component `k` (text_encoder, text_encoder_2, transformer,
    /// vae) from `weights(k)` where `loaded` has none, stored as `dtype` asks.
    fn built_from(
        config: &FluxPipelineConfig,
        dtype: DType,
        loaded: Loaded,
        weights: impl Fn(u64) -> RandomWeights,
    ) -> LoadResult<Self> {
        check_consistency(
            Some(&config.text_encoder),
            Some(&config.text_encoder_2),
            &config.transformer,
            &config.vae,
        )?;
        // fp8 storage is the transformer's and T5's linears'; CLIP and the VAE are made in
        // its compute dtype (`weights`').
        let clip = match loaded.text_encoder {
            Some(c) => c,
            None => ClipTextModel::build(&mut weights(0), &config.text_encoder)?,
        };
        let t5 = match loaded.text_encoder_2 {
            Some(t) => t,
            None => T5Encoder::build_as(&mut weights(1), &config.text_encoder_2, Some(dtype))?,
        };
        let transformer = match loaded.transformer {
            Some(t) => t,
            None => {
                FluxTransformer::build_as(&mut weights(2), config.transformer.clone(), Some(dtype))?
            }
        };
        let vae = match loaded.vae {
            Some(v) => v,
            None => AutoencoderKL::build(&mut weights(3), config.vae.clone())?,
        };
        Self::new(
            Some(clip),
            Some(t5),
            transformer,
            vae,
            config.scheduler.clone(),
            config.max_sequence_length,
        )
    }

    /// Loads a Diffusers pipeline folder: `transformer/` and `vae/` (required),
    /// `text_encoder/` and `text_encoder_2/` (when present), `scheduler/scheduler_config.json`
    /// (FLUX.1-dev's scheduler when absent). `dtype` converts weights on load; `None` keeps
    /// the files' dtype, memory-mapped. An 8-bit float `dtype` stores the transformer's
    /// cast layers and T5's linears as scaled fp8 and converts CLIP and the VAE to bf16
    /// ([`crate::fp8`]).
    pub fn load(dir: &Path, dtype: Option<DType>) -> LoadResult<Self> {
        Self::load_checked(dir, dtype, UnusedWeights::Refuse)
    }

    /// [`FluxPipeline::load`], with what to do about checkpoint tensors a component's config
    /// leaves unused (refused by default; a VAE's encoder is never needed).
    pub fn load_checked(
        dir: &Path,
        dtype: Option<DType>,
        unused: UnusedWeights,
    ) -> LoadResult<Self> {
        Self::load_with(dir, dtype, unused, Loaded::default())
    }

    /// [`FluxPipeline::load_checked`] with the components of `loaded` (checkpoints loaded on
    /// their own, e.g. single files) in place of the folder's (which then needs none).
    pub fn load_with(
        dir: &Path,
        dtype: Option<DType>,
        unused: UnusedWeights,
        loaded: Loaded,
    ) -> LoadResult<Self> {
        if !dir.is_dir() {
            return Err(LoadError::Io {
                path: dir.to_path_buf(),
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "not a directory (expected a Diffusers pipeline folder with transformer/ and vae/)",
                ),
            });
        }
        let transformer = match loaded.transformer {
            Some(t) => t,
            None => FluxTransformer::load_checked(&dir.join(TRANSFORMER), dtype, unused)?,
        };
        // fp8 storage (`dtype` an 8-bit float) is the transformer's and T5's linears'; CLIP
        // and the VAE convert to its compute dtype.
        let t5_dtype = dtype;
        let dtype = dtype.map(DType::compute);
        let vae = match loaded.vae {
            Some(v) => v,
            None => AutoencoderKL::load_checked(&dir.join(VAE), dtype, unused)?,
        };
        let clip_dir = dir.join(TEXT_ENCODER);
        let clip = if let Some(c) = loaded.text_encoder {
            Some(c)
        } else if clip_dir.is_dir() {
            Some(ClipTextModel::from_dir_checked(&clip_dir, dtype, unused)?)
        } else {
            None
        };
        let t5_dir = dir.join(TEXT_ENCODER_2);
        let t5 = if let Some(t) = loaded.text_encoder_2 {
            Some(t)
        } else if t5_dir.is_dir() {
            Some(T5Encoder::from_dir_checked(&t5_dir, t5_dtype, unused)?)
        } else {
            None
        };
        let sched_file = dir.join("scheduler").join("scheduler_config.json");
        let scheduler = if crate::weights::is_present(&sched_file) {
            FlowMatchEulerConfig::from_file(&sched_file)?
        } else {
            FlowMatchEulerConfig::flux()
        };
        Self::new(clip, t5, transformer, vae, scheduler, 512)
    }

    /// The components, in phase order (text encoders present, transformer, VAE).
    pub fn components(&self) -> Vec<Arc<Component>> {
        let mut v = Vec::new();
        if let Some(c) = &self.clip {
            v.push(Arc::clone(c.component()));
        }
        if let Some(t) = &self.t5 {
            v.push(Arc::clone(t.component()));
        }
        v.push(Arc::clone(self.transformer.component()));
        v.push(Arc::clone(self.vae.component()));
        v
    }

    /// The component names, in phase order.
    pub fn component_names(&self) -> Vec<String> {
        self.components()
            .iter()
            .map(|c| c.name().to_string())
            .collect()
    }

    /// The components as a `ddo_routes::Pipeline`, to pass to `enable_pipeline_offload`.
    pub fn offload_pipeline(&self) -> Result<Pipeline> {
        Pipeline::new(self.components())
    }

    /// Pixels per latent (`2^(len(block_out_channels) − 1)`).
    pub fn vae_scale_factor(&self) -> usize {
        self.vae.config().upsample_factor()
    }

    /// The latent grid `(h, w)` for an image of `height × width` pixels; an image too small
    /// for one 2×2 patch is an error.
    pub fn latent_grid(&self, height: usize, width: usize) -> Result<(usize, usize)> {
        let f = self.vae_scale_factor();
        let (h, w) = flux::latent_size(height, width, f);
        if h == 0 || w == 0 {
            return Err(invalid(
                "height/width",
                format!("{height}x{width}"),
                format!(
                    "the image must be at least {0}x{0} pixels (2x2 latent patches of a {f}x VAE)",
                    2 * f
                ),
            ));
        }
        Ok((h, w))
    }

    /// The transformer's compute dtype (that of `x_embedder`'s weight; bf16 when it is
    /// stored as fp8).
    pub fn transformer_dtype(&self) -> DType {
        self.transformer
            .component()
            .leaf_by_path("x_embedder")
            .and_then(|l| l.params().first())
            .map_or(DType::F32, |(_, p)| p.dtype().compute())
    }

    /// Token ids for a text prompt with the stand-in tokenizer: CLIP padded to its
    /// `max_position_embeddings` (77 for CLIP-L), T5 to `max_sequence_length`.
    pub fn stand_in_tokens(&self, prompt: &str) -> Result<(Vec<u32>, Vec<u32>)> {
        let (clip, t5) = self.text_encoders()?;
        let clip_len = clip.config().max_position_embeddings;
        Ok((
            tokenizer::clip_ids(clip.config(), prompt, clip_len),
            tokenizer::t5_ids(t5.config(), prompt, self.max_sequence_length),
        ))
    }

    fn text_encoders(&self) -> Result<(&ClipTextModel, &T5Encoder)> {
        match (&self.clip, &self.t5) {
            (Some(c), Some(t)) => Ok((c, t)),
            _ => Err(invalid(
                "prompt",
                "text",
                "this pipeline has no text_encoder/text_encoder_2: pass prompt embeddings instead",
            )),
        }
    }

    /// Prompt encoding: CLIP's `pooler_output` and T5's `last_hidden_state`, on `device`,
    /// each through its component's route. Embeddings holding a NaN or an Inf are
    /// [`CoreError::NonFinite`] (one count each).
    pub fn encode_prompt(
        &self,
        device: &dyn Device,
        clip_ids: &[u32],
        t5_ids: &[u32],
    ) -> Result<PromptEmbeds> {
        let (clip, t5) = self.text_encoders()?;
        let ops = ops_of(device)?;
        let pooled = clip.forward(device, clip_ids)?.pooler_output;
        check_finite(
            ops,
            &pooled,
            PHASE_PROMPT,
            None,
            "the CLIP pooled embeddings (text_encoder)",
        )
        .map_err(|e| name_fp8_layer(clip.component(), e, || clip.forward(device, clip_ids)))?;
        let seq = t5.forward(device, t5_ids)?;
        check_finite(
            ops,
            &seq,
            PHASE_PROMPT,
            None,
            "the T5 prompt embeddings (text_encoder_2)",
        )
        .map_err(|e| name_fp8_layer(t5.component(), e, || t5.forward(device, t5_ids)))?;
        Ok(PromptEmbeds {
            prompt_embeds: seq,
            pooled_prompt_embeds: pooled,
        })
    }

    /// Checks embeddings against the transformer's widths.
    pub fn check_embeds(&self, e: &PromptEmbeds) -> Result<()> {
        let c = self.transformer.config();
        let ok_seq = matches!(e.prompt_embeds.shape(),
            [b, l, d] if *b > 0 && *l > 0 && *d == c.joint_attention_dim);
        let ok_pool = e.pooled_prompt_embeds.shape() == [e.batch(), c.pooled_projection_dim];
        if ok_seq && ok_pool {
            return Ok(());
        }
        Err(invalid(
            "prompt embeddings",
            format!(
                "prompt_embeds {:?}, pooled_prompt_embeds {:?}",
                e.prompt_embeds.shape(),
                e.pooled_prompt_embeds.shape()
            ),
            format!(
                "expected prompt_embeds [b, L, {}] and pooled_prompt_embeds [b, {}], one row per prompt",
                c.joint_attention_dim, c.pooled_projection_dim
            ),
        ))
    }

    /// The packed initial latents of `images` images on `device`, in the transformer's
    /// dtype. Seeded noise is one draw of `images · C · h · w` values, as `randn_tensor` draws
    /// `[images, C, h, w]` from one generator: image 0 is the batch-1 noise of the same seed.
    pub fn initial_latents(
        &self,
        device: &dyn Device,
        init: &InitLatents,
        height: usize,
        width: usize,
        images: usize,
    ) -> Result<Tensor> {
        let grid = self.latent_grid(height, width)?;
        let c = self.transformer.config().in_channels / 4;
        packed_initial_latents(
            device,
            init,
            (height, width),
            images,
            grid,
            c,
            self.transformer_dtype(),
        )
    }

    /// The denoising loop on `device`: `steps` Euler steps of the flow-matching scheduler
    /// (FluxPipeline's sigmas and shift for this resolution) from packed `latents`, each
    /// calling the transformer through its route. Returns the packed latents on `device`
    /// and the schedule's timesteps. Latents holding a NaN or an Inf after a step stop the
    /// loop with [`CoreError::NonFinite`] naming the step (one count per step).
    #[allow(clippy::too_many_arguments)]
    pub fn denoise(
        &self,
        device: &dyn Device,
        embeds: &PromptEmbeds,
        latents: Tensor,
        steps: usize,
        guidance: f32,
        height: usize,
        width: usize,
        progress: Progress<'_>,
    ) -> Result<(Tensor, Vec<f32>)> {
        self.check_embeds(embeds)?;
        if steps == 0 {
            return Err(invalid("steps", "0", "give at least one denoising step"));
        }
        let ops = ops_of(device)?;
        let stream = device.compute_stream();
        let (h, w) = self.latent_grid(height, width)?;
        let img_ids = latent_image_ids(h / 2, w / 2);
        let b = embeds.batch();
        if latents.shape() != [b, img_ids.len(), self.transformer.config().in_channels] {
            return Err(invalid(
                "latents",
                format!("{:?}", latents.shape()),
                format!(
                    "packed latents for {b} {height}x{width} image(s) (one per row of the prompt embeddings) are [{b}, {}, {}]",
                    img_ids.len(),
                    self.transformer.config().in_channels
                ),
            ));
        }
        let mut scheduler =
            FlowMatchEulerScheduler::new(self.scheduler.clone()).map_err(|e| match e {
                LoadError::Core(c) => c,
                other => invalid("scheduler config", "", other.to_string()),
            })?;
        scheduler.set_flux_schedule(steps, img_ids.len())?;
        let text_len = embeds.prompt_embeds.shape()[1];
        let txt_ids = vec![[0.0f32; 3]; text_len];
        let prompt_embeds = embeds.prompt_embeds.to_device(device, &stream)?;
        let pooled = embeds.pooled_prompt_embeds.to_device(device, &stream)?;
        let guidance = self
            .transformer
            .config()
            .guidance_embeds
            .then(|| vec![guidance]);
        let mut latents = latents;
        let timesteps = scheduler.timesteps().to_vec();
        let inputs = |latents: &Tensor, i: usize| {
            let ld = latents.dtype();
            // `t.expand(b).to(latents.dtype) / 1000`, in the latents' dtype.
            let timestep = round_to(ld, round_to(ld, timesteps[i]) / 1000.0);
            FluxInputs {
                hidden_states: latents.clone(),
                encoder_hidden_states: prompt_embeds.clone(),
                pooled_projections: pooled.clone(),
                timestep: vec![timestep],
                guidance: guidance.clone(),
                img_ids: img_ids.clone(),
                txt_ids: txt_ids.clone(),
            }
        };
        // Each step's check is read once the next step is queued (`DeferredFiniteChecks`):
        // the host never waits for the device between steps. Under `--compute fp8` the
        // step it names runs again from its input to name the layer (`fp8_blame`).
        let mut checks = DeferredFiniteChecks::new(device);
        let mut kept = StepInputs::new(self.transformer.component());
        // Every step's forward has the same position ids: their rotary tables go to the
        // device once, and are freed with the loop.
        let rope = self.transformer.make_rope(device, &inputs(&latents, 0))?;
        let blame = |kept: &StepInputs<'_>, e: CoreError| {
            kept.name(e, |latents, i| {
                self.transformer
                    .forward_with_rope(device, &inputs(latents, i), &rope)
                    .map(drop)
            })
        };
        for i in 0..timesteps.len() {
            kept.keep(i, &latents);
            let noise_pred =
                self.transformer
                    .forward_with_rope(device, &inputs(&latents, i), &rope)?;
            latents = scheduler.step(ops, &noise_pred, &latents, i)?;
            checks
                .queue(&latents, PHASES[1], Some((i + 1, steps)), "the latents")
                .map_err(|e| blame(&kept, e))?;
            progress("denoise", i + 1, steps);
            cancel::check(PHASES[1], i + 1)?;
        }
        checks.finish().map_err(|e| blame(&kept, e))?;
        Ok((latents, timesteps))
    }

    /// FluxPipeline's decode on `device`: unpack, `latents / scaling_factor + shift_factor`,
    /// `vae.decode` (tiled with `tiling` when the latents exceed a tile), through the VAE's
    /// route. Returns the images `[b, 3, H, W]` on `device`, one per row of `packed`; an
    /// image holding a NaN or an Inf is [`CoreError::NonFinite`] (one count).
    pub fn decode(
        &self,
        device: &dyn Device,
        packed: &Tensor,
        height: usize,
        width: usize,
        tiling: Option<TilingConfig>,
    ) -> Result<Tensor> {
        let ops = ops_of(device)?;
        let lat = packed.to_device(device, &device.compute_stream())?;
        let unpacked = unpack_latents(ops, &lat, height, width, self.vae_scale_factor())?;
        drop(lat);
        let unscaled = self.vae.config().unscale_latents(ops, &unpacked)?;
        drop(unpacked);
        let image = self.vae.decode(Some(device), &unscaled, tiling)?;
        check_finite(ops, &image, PHASES[2], None, "the decoded image")?;
        Ok(image)
    }

    /// [`FluxPipeline::decode`] as `plan` says; in auto mode, an untiled decode that runs out
    /// of device memory is retried once with Diffusers' default tiles when they split the
    /// latents, and `plan` records it. Tiles are never smaller than the default: when the
    /// latents fit in one default tile the out-of-memory error returns as it is.
    pub fn decode_planned(
        &self,
        device: &dyn Device,
        packed: &Tensor,
        height: usize,
        width: usize,
        plan: &mut DecodePlan,
    ) -> Result<Tensor> {
        match self.decode(device, packed, height, width, plan.tiling) {
            Err(e @ CoreError::OutOfMemory { .. })
                if !plan.tiled && plan.mode == TiledDecode::Auto =>
            {
                let (h, w) = self.latent_grid(height, width)?;
                let default = TilingConfig::from_config(self.vae.config());
                let Some(t) = fallback_tiling(&default, h, w) else {
                    return Err(e);
                };
                device.synchronize()?;
                let b = packed.shape().first().copied().unwrap_or(1);
                let latent_shape = [b, self.vae.config().latent_channels, h, w];
                plan.tiled = true;
                plan.tiling = Some(t);
                plan.retried_after_oom = true;
                plan.estimate_tiled_bytes = Some(estimate_tiled_decode_peak_bytes_on(
                    Some(device),
                    self.vae.config(),
                    &latent_shape,
                    self.vae.dtype(),
                    &t,
                ));
                plan.reason = format!(
                    "tiled (auto): the untiled decode ran out of device memory; retried once with \
                     {}-latent tiles",
                    t.tile_latent_min_size
                );
                self.decode(device, packed, height, width, Some(t))
            }
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gaussian_noise_is_deterministic_and_standard() {
        let a = gaussian_noise(7, 10_001);
        assert_eq!(a, gaussian_noise(7, 10_001));
        assert_ne!(a, gaussian_noise(8, 10_001));
        let mean: f64 = a.iter().map(|&x| x as f64).sum::<f64>() / a.len() as f64;
        let var: f64 = a.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / a.len() as f64;
        assert!(mean.abs() < 0.05, "{mean}");
        assert!((var - 1.0).abs() < 0.05, "{var}");
    }

    #[test]
    fn configs_are_consistent() {
        for name in FluxPipelineConfig::NAMES {
            let c = FluxPipelineConfig::named(name).unwrap();
            check_consistency(
                Some(&c.text_encoder),
                Some(&c.text_encoder_2),
                &c.transformer,
                &c.vae,
            )
            .unwrap();
        }
        let mut c = FluxPipelineConfig::tiny();
        c.transformer.in_channels = 64;
        c.transformer.out_channels = None;
        assert!(
            check_consistency(None, None, &c.transformer, &c.vae).is_err(),
            "in_channels must be 4 x latent channels"
        );
    }
}
