//! What [`QwenImagePipeline::run_phases`](super::QwenImagePipeline::run_phases) runs: the
//! prompt inputs ([`QwenPromptInput`]) and the request ([`QwenImageRequest`]).

use crate::pipeline::{InitLatents, TiledDecode};
use crate::qwen_text::QwenPromptEmbeds;

/// What prompt encoding starts from, for the prompt or the negative prompt.
#[derive(Debug, Clone)]
pub enum QwenPromptInput {
    /// Text: formatted into the pipeline's template, tokenized with the folder's tokenizer
    /// (or the stand-in ids when the pipeline has none,
    /// [`stand_in_ids`](super::stand_in_ids)) and encoded by the text encoder.
    Text(String),
    /// Embeddings as `encode_prompt` returns them (on the host or the device):
    /// `prompt_embeds [b, L, joint_attention_dim]` and its mask (`None`: every token real).
    /// Prompt encoding is skipped for them; they are cut to `max_sequence_length` as
    /// `encode_prompt` cuts given embeddings.
    Embeddings(QwenPromptEmbeds),
}

/// A run of the Qwen-Image pipeline.
#[derive(Debug, Clone)]
pub struct QwenImageRequest {
    /// The prompt.
    pub prompt: QwenPromptInput,
    /// The negative prompt; true CFG runs when `true_cfg_scale > 1` and one is given, as
    /// Diffusers' `do_true_cfg = true_cfg_scale > 1 and has_neg_prompt` (`Text(" ")` is the
    /// usual one). Without it (or at a scale of 1 or less) one pass per step.
    pub negative_prompt: Option<QwenPromptInput>,
    /// `true_cfg_scale` (Diffusers' default 4.0).
    pub true_cfg_scale: f32,
    /// Denoising steps.
    pub steps: usize,
    /// Image height in pixels (rounded down to a multiple of `2 · vae_scale_factor`).
    pub height: usize,
    /// Image width in pixels (rounded down alike).
    pub width: usize,
    /// Initial noise: seeded, or given unpacked `[n, C, h, w]` or packed `[n, tokens, 4·C]`.
    pub init: InitLatents,
    /// Images per prompt (`num_images_per_prompt`), at least 1.
    pub num_images: usize,
    /// Tiled decode mode (Diffusers' default tiles: 256 pixels every 192).
    pub tiled_decode: TiledDecode,
    /// The device memory DDO may use, bytes (auto decode compares against it; `None`: the
    /// device's capacity).
    pub vram_budget: Option<u64>,
    /// After each phase's cleanup, return the native VMM pool's idle chunks to the driver
    /// (the seed's low-memory combination). Needs the native allocator on the device:
    /// refused before anything runs otherwise.
    pub release_native_idle_cache: bool,
    /// Set by the caller to stop the run at the next denoising step boundary
    /// ([`CoreError::Cancelled`](ddo_core::CoreError::Cancelled); everything released).
    pub cancel: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
}

impl QwenImageRequest {
    /// Whether this request runs true CFG (two transformer passes per step).
    pub fn does_true_cfg(&self) -> bool {
        self.true_cfg_scale > 1.0 && self.negative_prompt.is_some()
    }
}
