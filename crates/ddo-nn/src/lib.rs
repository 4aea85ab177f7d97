//! DDO's layers and models, written against the `Ops` compute plane, with their weights as
//! leaves of a `Component` so that every route of `ddo-routes` moves them unchanged.
//!
//! This crate sits above `ddo-core` (it never talks to a backend directly) and beside the
//! route crates. It holds Diffusers-format loading ([`weights`]: memory-mapped safetensors,
//! single or sharded, with typed errors naming the tensor and the file; seeded random
//! weights at any config), the [`builder`] that turns a model's structure into a component
//! tree, the shared [`layers`], and the models: `AutoencoderKL`'s decoder, the Flux and
//! Qwen-Image transformers, Qwen-Image's VAE decoder (`AutoencoderKLQwenImage` on one
//! frame), the T5 and CLIP text encoders, and Qwen-Image's text encoder (Qwen2.5-VL's
//! language model, with its tokenizer and the pipeline's prompt encoding: [`qwen_text`]).
//!
//! On top of the models sits Diffusers' `FluxPipeline` ([`pipeline`]): the flow-matching
//! Euler [`scheduler`] with Flux's resolution-dependent shift, a documented stand-in
//! [`tokenizer`], and the phase driver `FluxPipeline::run_phases`, which runs prompt
//! encoding, denoise and decode on the routes of a `ddo_routes::PipelineOffload` with the
//! seed's cleanup between phases (the one place this crate uses `ddo-routes`).

pub mod builder;
pub mod clip;
pub mod error;
pub mod flux;
pub mod fp8;
pub mod layers;
pub mod lora;
pub mod memory;
pub mod pipeline;
pub mod qwen_image;
pub mod qwen_text;
pub mod qwen_vae;
pub mod scheduler;
pub mod soak;
pub mod t5;
pub mod tokenizer;
pub mod vae;
pub mod weights;

pub use builder::ModelBuilder;
pub use error::{LoadError, LoadResult};
pub use fp8::{
    FLUX_SKIP_PATTERNS, Fp8Storage, QWEN_IMAGE_SKIP_PATTERNS, QWEN_TEXT_SKIP_PATTERNS,
    T5_SKIP_PATTERNS,
};
pub use weights::{
    CheckpointWeights, MAX_TEXT_FILE_BYTES, RandomWeights, UnusedWeights, WeightSource,
    read_f32_tensor, read_mask_tensor, read_text_file,
};
