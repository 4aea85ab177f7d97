//! The requests and results of a pipeline run: prompt inputs and embeddings, initial
//! latents, [`PipelineRequest`], and what a run returns ([`PipelineRun`], one
//! [`PhaseReport`] per phase).

use ddo_core::{Result, Tensor};
use ddo_metrics::{IdleCacheRelease, PhasePeak};
use serde::Serialize;

use super::{DecodePlan, TiledDecode, invalid};

/// Prompt embeddings as the transformer takes them, one row per prompt.
#[derive(Debug, Clone)]
pub struct PromptEmbeds {
    /// T5 sequence `[b, L, joint_attention_dim]`.
    pub prompt_embeds: Tensor,
    /// CLIP pooled `[b, pooled_projection_dim]`.
    pub pooled_prompt_embeds: Tensor,
}

impl PromptEmbeds {
    /// How many prompts (the leading dimension of `prompt_embeds`; 0 when it has none).
    pub fn batch(&self) -> usize {
        self.prompt_embeds.shape().first().copied().unwrap_or(0)
    }

    /// FluxPipeline's `num_images_per_prompt`: each prompt's rows repeated `n` times in a row
    /// (`prompt_embeds.repeat(1, n, 1).view(b·n, L, D)`, the pooled ones alike), as host
    /// tensors of the same dtypes. The embeddings must be on the host.
    pub fn repeat_each(&self, n: usize) -> Result<Self> {
        Ok(Self {
            prompt_embeds: repeat_rows(&self.prompt_embeds, n)?,
            pooled_prompt_embeds: repeat_rows(&self.pooled_prompt_embeds, n)?,
        })
    }
}

/// Host tensor `t` (`[b, ...]`) with each of its `b` rows repeated `n` times in a row.
pub(crate) fn repeat_rows(t: &Tensor, n: usize) -> Result<Tensor> {
    let values = t.host_f32()?;
    let shape = t.shape();
    let rows = shape.first().copied().unwrap_or(0);
    let row: usize = shape.iter().skip(1).product();
    let images = rows.checked_mul(n).filter(|_| n > 0).ok_or_else(|| {
        invalid(
            "num_images",
            n.to_string(),
            "give 1 or more images per prompt",
        )
    })?;
    let mut out = Vec::new();
    out.try_reserve_exact(images.saturating_mul(row))
        .map_err(|_| {
            invalid(
                "num_images",
                n.to_string(),
                "ask for fewer images: their prompt embeddings do not fit in host memory",
            )
        })?;
    for r in values.chunks_exact(row.max(1)).take(rows) {
        for _ in 0..n {
            out.extend_from_slice(r);
        }
    }
    let mut new_shape = shape.to_vec();
    if let Some(b) = new_shape.first_mut() {
        *b = images;
    }
    Tensor::from_f32(new_shape, t.dtype(), &out)
}

/// What prompt encoding starts from.
#[derive(Debug, Clone)]
pub enum PromptInput {
    /// Text, tokenized with the stand-in tokenizer ([`crate::tokenizer`]).
    Text(String),
    /// Token ids for CLIP and T5 (from a real tokenizer).
    Tokens {
        /// CLIP ids (FluxPipeline pads them to 77).
        clip: Vec<u32>,
        /// T5 ids (FluxPipeline pads them to `max_sequence_length`).
        t5: Vec<u32>,
    },
    /// Embeddings given: prompt encoding is skipped.
    Embeddings(PromptEmbeds),
}

/// Where the denoising loop starts.
#[derive(Debug, Clone)]
pub enum InitLatents {
    /// Noise from [`gaussian_noise`](super::gaussian_noise) with this seed.
    Seed(u64),
    /// Given noise, one row per image: unpacked `[n, C, h, w]` or packed `[n, tokens, 4·C]`.
    Given(Tensor),
}

/// What [`FluxPipeline::run_phases`](super::FluxPipeline::run_phases) runs.
#[derive(Debug, Clone)]
pub struct PipelineRequest {
    /// The prompt.
    pub prompt: PromptInput,
    /// Denoising steps.
    pub steps: usize,
    /// Guidance scale (Flux-dev's guidance embedding; ignored without one).
    pub guidance: f32,
    /// Image height in pixels.
    pub height: usize,
    /// Image width in pixels.
    pub width: usize,
    /// Initial noise.
    pub init: InitLatents,
    /// Images per prompt (FluxPipeline's `num_images_per_prompt`): `b` prompts give
    /// `b · num_images` images, each with its own noise; at least 1.
    pub num_images: usize,
    /// Tiled decode mode.
    pub tiled_decode: TiledDecode,
    /// The device memory DDO may use, bytes (auto decode compares against it; `None`: the
    /// device's capacity).
    pub vram_budget: Option<u64>,
    /// After each phase's cleanup, return the native VMM pool's idle chunks to the driver
    /// (`release_native_vmm_idle_cache`, the seed's low-memory combination). Needs the
    /// native allocator on the device: refused before anything runs otherwise.
    pub release_native_idle_cache: bool,
    /// Set by the caller to stop the run at the next denoising step boundary
    /// ([`CoreError::Cancelled`](ddo_core::CoreError::Cancelled); everything released).
    pub cancel: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
}

/// One finished phase.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PhaseReport {
    /// `prompt_encoding`, `denoise` or `decode`.
    pub phase: String,
    /// The components that ran, with their routes (`transformer: diffusers_group_offload
    /// offload_type=leaf_level use_stream=true`).
    pub components: Vec<String>,
    /// Wall time of the phase, cleanup included, seconds.
    pub seconds: f64,
    /// The device's peak during the phase and what was left after the cleanup.
    pub peak: PhasePeak,
    /// A note (skipped, tiled, ...).
    pub note: Option<String>,
    /// What the native pool's idle-cache release returned after the phase's cleanup, when
    /// the request asked for it.
    pub idle_release: Option<IdleCacheRelease>,
    /// Seconds each component's attach took when it was attached for this phase
    /// (pinning, uploads of resident weights); empty when the pipeline was attached up
    /// front. A component prepared during the phase before counts only the wait that was
    /// left.
    pub setup_seconds: Vec<(String, f64)>,
    /// Seconds each component attached in the background during the phase before took
    /// ([`PipelineOffload::prepare`](ddo_routes::PipelineOffload::prepare)).
    pub prepared_seconds: Vec<(String, f64)>,
    /// Seconds of the phase's cleanup (releasing its components, synchronising, emptying
    /// the cache), included in `seconds`.
    pub cleanup_seconds: f64,
    /// The device's first calls of each shape during the phase (library plans built and
    /// waited for, kernel modules loaded: [`Device::setup_calls`](ddo_core::Device::setup_calls)),
    /// counted from the phase's begin to its end: what a phase's first forward pays
    /// beyond a steady one.
    pub setup_calls: ddo_core::SetupCalls,
}

/// What [`FluxPipeline::run_phases`](super::FluxPipeline::run_phases) returns.
#[derive(Debug, Clone)]
pub struct PipelineRun {
    /// The three phases, in order.
    pub phases: Vec<PhaseReport>,
    /// Packed latents after the loop, on the host, f32 `[n, tokens, 4·C]`, one row per image.
    pub latents: Tensor,
    /// The decoded images on the host, f32 `[n, 3, H, W]`, about [-1, 1].
    pub image: Tensor,
    /// The schedule's timesteps.
    pub timesteps: Vec<f32>,
    /// The decode plan (tiled or not, and why).
    pub decode: DecodePlan,
}

/// Progress of a phase: `(phase, done, total)`.
pub type Progress<'a> = &'a mut dyn FnMut(&str, usize, usize);
