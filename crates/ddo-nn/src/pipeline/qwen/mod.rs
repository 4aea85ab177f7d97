//! Diffusers' `QwenImagePipeline` on DDO: prompt encoding (Qwen2.5-VL's language model with
//! the pipeline's template, [`crate::qwen_text`]), the denoising loop with true
//! classifier-free guidance (two transformer passes per step) on the flow-matching scheduler,
//! and the Qwen VAE decode of the one frame — each phase running its component through
//! whatever route is attached to it, on the phase driver Flux's pipeline uses (the seed's
//! cleanup at every phase boundary: the transformer is released before the VAE loads).
//!
//! Values follow diffusers 0.42.1 `pipelines/qwenimage/pipeline_qwenimage.py`:
//!
//! - latents `[B, 1, C, h, w]` with `h = 2·(height // (2f))`, `w = 2·(width // (2f))`
//!   (`f` = `vae_scale_factor` = `2^len(temperal_downsample)`, 8 for Qwen-Image), packed into
//!   2×2 patches `[B, (h/2)·(w/2), 4·C]` by `_pack_latents` — for one frame the same packing
//!   as Flux's ([`pack_latents`](crate::flux::pack_latents));
//! - `img_shapes = [(1, h/2, w/2)]`; the text padding mask is the prompt's
//!   `prompt_embeds_mask` (dropped when every token is real);
//! - `sigmas = np.linspace(1, 1/steps, steps)`, `mu = calculate_shift(image_seq_len, ...)`
//!   from the scheduler config's `base_image_seq_len`, `max_image_seq_len`, `base_shift`,
//!   `max_shift` ([`FlowMatchEulerConfig::mu`]), the timesteps from `set_timesteps(sigmas,
//!   mu)` (Qwen-Image's config stretches them to `shift_terminal` 0.02);
//! - per step `timestep = t / 1000` in the latents' dtype, no guidance embedding; with true
//!   CFG (`true_cfg_scale > 1` and a negative prompt) a second pass on the negative prompt,
//!   `comb = neg + scale·(pos − neg)`, `noise_pred = comb · (‖pos‖ / ‖comb‖)` over the last
//!   dimension; the Euler step;
//! - after the loop `_unpack_latents`, `latents / (1 / latents_std) + latents_mean`
//!   ([`QwenVaeConfig::denormalize_latents`]) and `vae.decode(...)[:, :, 0]`.
//!
//! Initial noise from a seed is DDO's own ([`gaussian_noise`](super::gaussian_noise)); to
//! reproduce a Diffusers run exactly, pass its noise ([`InitLatents::Given`]) and embeddings
//! ([`QwenPromptInput::Embeddings`]).

mod decode;
mod denoise;
mod detect;
mod memory;
mod phases;
mod request;

use std::path::Path;
use std::sync::Arc;

use ddo_core::{Component, CoreError, DType, Result};
use ddo_routes::Pipeline;

use crate::error::{LoadError, LoadResult};
use crate::flux;
use crate::qwen_image::{QwenImageTransformer, QwenImageTransformerConfig};
use crate::qwen_text::{
    DEFAULT_MAX_SEQUENCE_LENGTH, QwenTextEncoder, QwenTextEncoderConfig, QwenTokenizer,
};
use crate::qwen_vae::{QwenVae, QwenVaeConfig};
use crate::scheduler::FlowMatchEulerConfig;
use crate::weights::{RandomWeights, UnusedWeights};

use super::invalid;

pub use decode::plan_qwen_decode_on;
pub use denoise::{STAND_IN_SUFFIX_TOKENS, stand_in_ids};
pub use detect::{PipelineKind, config_class};
pub use memory::{estimate_qwen_image_activation_bytes, estimate_qwen_text_activation_bytes};
pub use request::{QwenImageRequest, QwenPromptInput};

#[cfg(doc)]
use super::InitLatents;

/// The text encoder's component name.
pub const QWEN_TEXT_ENCODER: &str = crate::qwen_text::COMPONENT_NAME;
/// The transformer's component name.
pub const QWEN_TRANSFORMER: &str = "transformer";
/// The VAE's component name.
pub const QWEN_VAE: &str = crate::qwen_vae::COMPONENT_NAME;
/// The tokenizer's folder in a pipeline folder.
pub const QWEN_TOKENIZER: &str = "tokenizer";

/// The configs of a whole Qwen-Image pipeline.
#[derive(Debug, Clone, PartialEq)]
pub struct QwenImagePipelineConfig {
    /// Qwen2.5-VL's language model (`text_encoder`).
    pub text_encoder: QwenTextEncoderConfig,
    /// The transformer.
    pub transformer: QwenImageTransformerConfig,
    /// The VAE.
    pub vae: QwenVaeConfig,
    /// The scheduler ([`FlowMatchEulerConfig::qwen_image`]: the `Qwen/Qwen-Image`
    /// repository's `scheduler/scheduler_config.json`).
    pub scheduler: FlowMatchEulerConfig,
    /// Prompt tokens kept after the template (`max_sequence_length`, 512 by default).
    pub max_sequence_length: usize,
}

impl QwenImagePipelineConfig {
    /// The small pipeline of the `qwen_pipeline` fixture and CI: the `qwen-tiny`
    /// transformer (2 blocks of 2 heads × 16, text width 32, 4 latent channels), the
    /// `qwen-text-tiny` encoder (width 32, 2 layers), the `qwen-tiny` VAE (`vae_scale_factor`
    /// 4), Qwen-Image's scheduler; 512 prompt tokens at most.
    pub fn tiny() -> Self {
        Self {
            text_encoder: QwenTextEncoderConfig::tiny(),
            transformer: QwenImageTransformerConfig::tiny(),
            vae: QwenVaeConfig::tiny(),
            scheduler: FlowMatchEulerConfig::qwen_image(),
            max_sequence_length: DEFAULT_MAX_SEQUENCE_LENGTH,
        }
    }

    /// Qwen-Image at its real sizes: the 60-block transformer, Qwen2.5-VL 7B's language
    /// model, the Qwen-Image VAE (`vae_scale_factor` 8), its scheduler; 512 prompt tokens.
    pub fn qwen_image() -> Self {
        Self {
            text_encoder: QwenTextEncoderConfig::qwen2_5_vl_7b(),
            transformer: QwenImageTransformerConfig::qwen_image(),
            vae: QwenVaeConfig::qwen_image(),
            scheduler: FlowMatchEulerConfig::qwen_image(),
            max_sequence_length: DEFAULT_MAX_SEQUENCE_LENGTH,
        }
    }

    /// The config of a named pipeline: `qwen-tiny` or `qwen-image` (also `qwen_tiny`,
    /// `qwen_image`).
    pub fn named(name: &str) -> Option<Self> {
        match name {
            "qwen-tiny" | "qwen_tiny" => Some(Self::tiny()),
            "qwen-image" | "qwen_image" => Some(Self::qwen_image()),
            _ => None,
        }
    }

    /// The names [`QwenImagePipelineConfig::named`] knows.
    pub const NAMES: [&'static str; 2] = ["qwen-tiny", "qwen-image"];
}

/// Checks that the components fit together.
fn check_consistency(
    text: Option<&QwenTextEncoderConfig>,
    transformer: &QwenImageTransformerConfig,
    vae: &QwenVaeConfig,
) -> LoadResult<()> {
    let invalid = |field: &str, value: usize, hint: String| {
        Err(LoadError::InvalidConfig {
            field: field.into(),
            value: value.to_string(),
            hint,
        })
    };
    if transformer.patch_size != 2 {
        return invalid(
            "transformer.patch_size",
            transformer.patch_size,
            "QwenImagePipeline packs 2x2 latent patches: it must be 2".into(),
        );
    }
    if transformer.in_channels != 4 * vae.z_dim {
        return invalid(
            "transformer.in_channels",
            transformer.in_channels,
            format!(
                "QwenImagePipeline packs 2x2 latent patches: it must be 4 x vae.z_dim = {}",
                4 * vae.z_dim
            ),
        );
    }
    if transformer.proj_out_channels() != transformer.in_channels {
        return invalid(
            "transformer.out_channels",
            transformer.out_channels(),
            format!(
                "the Euler step adds the prediction to the packed latents: patch_size^2 x \
                 out_channels must equal in_channels = {} (out_channels {})",
                transformer.in_channels,
                transformer.in_channels / 4
            ),
        );
    }
    if let Some(t) = text
        && t.hidden_size != transformer.joint_attention_dim
    {
        return invalid(
            "transformer.joint_attention_dim",
            transformer.joint_attention_dim,
            format!("must equal text_encoder's hidden_size = {}", t.hidden_size),
        );
    }
    Ok(())
}

/// Diffusers' `QwenImagePipeline`: the models, the tokenizer and the scheduler config.
pub struct QwenImagePipeline {
    /// Qwen2.5-VL's language model (`text_encoder`); optional when prompts come as
    /// embeddings.
    pub text_encoder: Option<QwenTextEncoder>,
    /// The Qwen tokenizer of the folder's `tokenizer/`; `None` tokenizes text prompts with
    /// the documented stand-in ([`stand_in_ids`]).
    pub tokenizer: Option<QwenTokenizer>,
    /// The transformer.
    pub transformer: QwenImageTransformer,
    /// The VAE.
    pub vae: QwenVae,
    /// The scheduler's config.
    pub scheduler: FlowMatchEulerConfig,
    /// Prompt tokens kept after the template (`max_sequence_length`).
    pub max_sequence_length: usize,
}

impl std::fmt::Debug for QwenImagePipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QwenImagePipeline")
            .field("components", &self.component_names())
            .field("tokenizer", &self.tokenizer.as_ref().map(|t| t.source()))
            .finish()
    }
}

impl QwenImagePipeline {
    /// A pipeline of these models; checks that they fit together, the scheduler config and
    /// `max_sequence_length` (1 to 1024, `QwenImagePipeline.check_inputs`' limit).
    pub fn new(
        text_encoder: Option<QwenTextEncoder>,
        tokenizer: Option<QwenTokenizer>,
        transformer: QwenImageTransformer,
        vae: QwenVae,
        scheduler: FlowMatchEulerConfig,
        max_sequence_length: usize,
    ) -> LoadResult<Self> {
        scheduler.validate()?;
        check_consistency(
            text_encoder.as_ref().map(QwenTextEncoder::config),
            transformer.config(),
            vae.config(),
        )?;
        let limit = crate::qwen_text::MAX_SEQUENCE_LENGTH_LIMIT;
        if !(1..=limit).contains(&max_sequence_length) {
            return Err(LoadError::InvalidConfig {
                field: "max_sequence_length".into(),
                value: max_sequence_length.to_string(),
                hint: format!("must be between 1 and {limit} (QwenImagePipeline's limit)"),
            });
        }
        Ok(Self {
            text_encoder,
            tokenizer,
            transformer,
            vae,
            scheduler,
            max_sequence_length,
        })
    }

    /// A pipeline at `config` with seeded random weights stored as `dtype` (component `k` of
    /// text_encoder, transformer, vae uses seed `seed + k`) and no tokenizer: text prompts
    /// take the stand-in ids ([`stand_in_ids`]). An 8-bit float `dtype` stores the
    /// transformer's and the text encoder's linears as scaled fp8 and makes the VAE in bf16
    /// ([`crate::fp8`]).
    pub fn random(config: &QwenImagePipelineConfig, seed: u64, dtype: DType) -> LoadResult<Self> {
        Self::random_parts(config, seed, dtype, |_| true)
    }

    /// [`QwenImagePipeline::random`] where only the components `written` names
    /// (`text_encoder`, `transformer`, `vae`) get values, the same as `random`'s; the others
    /// are [`RandomWeights::unwritten`] (shapes and bytes, no memory behind them: not to be
    /// run). A bench of one component holds only its weights.
    pub fn random_parts(
        config: &QwenImagePipelineConfig,
        seed: u64,
        dtype: DType,
        written: impl Fn(&str) -> bool,
    ) -> LoadResult<Self> {
        Self::built_from(config, dtype, |k| {
            let name = ["text_encoder", "transformer", "vae"][k as usize];
            if written(name) {
                RandomWeights::new(seed.wrapping_add(k), dtype.compute())
            } else {
                RandomWeights::unwritten(dtype.compute())
            }
        })
    }

    /// [`QwenImagePipeline::random`] with weights never written
    /// ([`RandomWeights::unwritten`]): every param has its shape, dtype and bytes (fp8
    /// storage's one byte per cast weight too) and no memory behind it. For planning and
    /// preflight only: running it computes on zeros.
    pub fn unwritten(config: &QwenImagePipelineConfig, dtype: DType) -> LoadResult<Self> {
        Self::built_from(config, dtype, |_| RandomWeights::unwritten(dtype.compute()))
    }

    /// The pipeline at `config`, component `k` (text_encoder, transformer, vae) from
    /// `weights(k)`, stored as `dtype` asks (the VAE in `weights`' compute dtype).
    fn built_from(
        config: &QwenImagePipelineConfig,
        dtype: DType,
        weights: impl Fn(u64) -> RandomWeights,
    ) -> LoadResult<Self> {
        check_consistency(Some(&config.text_encoder), &config.transformer, &config.vae)?;
        let text = QwenTextEncoder::build_as(&mut weights(0), &config.text_encoder, Some(dtype))?;
        let transformer = QwenImageTransformer::build_as(
            &mut weights(1),
            config.transformer.clone(),
            Some(dtype),
        )?;
        let vae = QwenVae::build(&mut weights(2), config.vae.clone())?;
        Self::new(
            Some(text),
            None,
            transformer,
            vae,
            config.scheduler.clone(),
            config.max_sequence_length,
        )
    }

    /// Loads a Diffusers `QwenImagePipeline` folder: `transformer/` and `vae/` (required);
    /// `text_encoder/` when present, and then `tokenizer/` too (a folder with a text encoder
    /// but no tokenizer is refused with [`LoadError::NoTokenizer`] naming the folder looked
    /// in); `scheduler/scheduler_config.json` (Qwen-Image's scheduler when absent).
    /// `dtype` converts weights on load; `None` keeps the files' dtype, memory-mapped. An
    /// 8-bit float `dtype` stores the transformer's and the text encoder's linears as scaled
    /// fp8 and converts the VAE to bf16. `unused`: what to do about checkpoint tensors a
    /// component's config leaves unused. The folder's `model_index.json` is checked first
    /// ([`PipelineKind::detect`]): a Flux folder, or one that mixes the families, is refused.
    pub fn load_checked(
        dir: &Path,
        dtype: Option<DType>,
        unused: UnusedWeights,
    ) -> LoadResult<Self> {
        Self::load_with_transformer(dir, None, dtype, unused)
    }

    /// [`QwenImagePipeline::load_checked`] with the transformer's weights from one file
    /// instead of the folder's `transformer/` weights (its `config.json` still gives the
    /// shapes): a safetensors or GGUF file, as
    /// [`QwenImageTransformer::load_file`] reads them.
    pub fn load_with_transformer(
        dir: &Path,
        transformer_file: Option<&Path>,
        dtype: Option<DType>,
        unused: UnusedWeights,
    ) -> LoadResult<Self> {
        Self::load_with_files(dir, transformer_file, None, dtype, unused)
    }

    /// [`QwenImagePipeline::load_with_transformer`], with the text encoder's weights from one
    /// file too (`text_encoder_file`: a safetensors file or a Qwen2.5-VL GGUF, as
    /// [`QwenTextEncoder::load_file`] reads them). Its shapes come from the folder's
    /// `text_encoder/config.json` where there is one, else Qwen2.5-VL 7B's (a folder of
    /// configs and the tokenizer, the weights downloaded apart); the folder's `tokenizer/`
    /// is needed either way.
    pub fn load_with_files(
        dir: &Path,
        transformer_file: Option<&Path>,
        text_encoder_file: Option<&Path>,
        dtype: Option<DType>,
        unused: UnusedWeights,
    ) -> LoadResult<Self> {
        if !dir.is_dir() {
            return Err(LoadError::Io {
                path: dir.to_path_buf(),
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "not a directory (expected a Diffusers QwenImagePipeline folder with \
                     transformer/ and vae/)",
                ),
            });
        }
        if crate::weights::is_present(&dir.join(detect::MODEL_INDEX)) {
            let kind = PipelineKind::detect(dir)?;
            if kind != PipelineKind::QwenImage {
                return Err(LoadError::InvalidConfig {
                    field: format!("{}: _class_name", dir.join(detect::MODEL_INDEX).display()),
                    value: kind.class_name().into(),
                    hint: "this folder holds a FluxPipeline: load it as Flux (ddo run detects \
                           the pipeline from model_index.json)"
                        .into(),
                });
            }
        }
        let transformer = match transformer_file {
            None => QwenImageTransformer::load_checked(&dir.join(QWEN_TRANSFORMER), dtype, unused)?,
            Some(file) => {
                let config = crate::qwen_image::QwenImageTransformerConfig::from_file(
                    &dir.join(QWEN_TRANSFORMER).join("config.json"),
                )?;
                QwenImageTransformer::load_file(file, config, dtype, unused)?
            }
        };
        let vae = QwenVae::load_checked(&dir.join(QWEN_VAE), dtype.map(DType::compute), unused)?;
        let text_dir = dir.join(QWEN_TEXT_ENCODER);
        let (text_encoder, tokenizer) = if let Some(file) = text_encoder_file {
            let tokenizer = QwenTokenizer::from_dir(&dir.join(QWEN_TOKENIZER))?;
            let config_file = text_dir.join("config.json");
            let config = if crate::weights::is_present(&config_file) {
                QwenTextEncoderConfig::from_file(&config_file)?
            } else {
                QwenTextEncoderConfig::qwen2_5_vl_7b()
            };
            let encoder = QwenTextEncoder::load_file(file, &config, dtype, unused)?;
            (Some(encoder), Some(tokenizer))
        } else if text_dir.is_dir() {
            // The tokenizer first: a missing one is refused before the encoder's weights load.
            let tokenizer = QwenTokenizer::from_dir(&dir.join(QWEN_TOKENIZER))?;
            let encoder = QwenTextEncoder::load_checked(&text_dir, dtype, unused)?;
            (Some(encoder), Some(tokenizer))
        } else {
            (None, None)
        };
        let sched_file = dir.join("scheduler").join("scheduler_config.json");
        let scheduler = if crate::weights::is_present(&sched_file) {
            FlowMatchEulerConfig::from_file(&sched_file)?
        } else {
            FlowMatchEulerConfig::qwen_image()
        };
        Self::new(
            text_encoder,
            tokenizer,
            transformer,
            vae,
            scheduler,
            DEFAULT_MAX_SEQUENCE_LENGTH,
        )
    }

    /// [`QwenImagePipeline::load_checked`], refusing unused checkpoint tensors.
    pub fn load(dir: &Path, dtype: Option<DType>) -> LoadResult<Self> {
        Self::load_checked(dir, dtype, UnusedWeights::Refuse)
    }

    /// The components, in phase order (the text encoder when present, transformer, VAE).
    pub fn components(&self) -> Vec<Arc<Component>> {
        let mut v = Vec::new();
        if let Some(t) = &self.text_encoder {
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

    /// Pixels per latent: `2^len(temperal_downsample)` (8 for Qwen-Image's VAE), as the
    /// pipeline's `vae_scale_factor`.
    pub fn vae_scale_factor(&self) -> usize {
        self.vae.config().spatial_compression_ratio()
    }

    /// The latent grid `(h, w)` for an image of `height × width` pixels: Diffusers rounds
    /// the size down to multiples of `2 · vae_scale_factor` (`h = 2·(height // (2f))`); an
    /// image too small for one 2×2 patch is an error.
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

    /// The transformer's compute dtype (that of `img_in`'s weight; bf16 when it is stored
    /// as fp8).
    pub fn transformer_dtype(&self) -> DType {
        self.transformer
            .component()
            .leaf_by_path("img_in")
            .and_then(|l| l.params().first())
            .map_or(DType::F32, |(_, p)| p.dtype().compute())
    }

    fn text_encoder(&self) -> Result<&QwenTextEncoder> {
        self.text_encoder.as_ref().ok_or_else(|| {
            invalid(
                "prompt",
                "text",
                "this pipeline has no text_encoder: pass prompt embeddings instead",
            )
        })
    }
}

/// A device error as a [`CoreError`] (a scheduler config error, ...).
fn core_error(e: LoadError) -> CoreError {
    match e {
        LoadError::Core(c) => c,
        other => invalid("scheduler config", "", other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_configs_are_consistent() {
        for name in QwenImagePipelineConfig::NAMES {
            let c = QwenImagePipelineConfig::named(name).unwrap();
            check_consistency(Some(&c.text_encoder), &c.transformer, &c.vae).unwrap();
        }
        assert_eq!(
            QwenImagePipelineConfig::named("qwen_image"),
            Some(QwenImagePipelineConfig::qwen_image())
        );
        assert!(QwenImagePipelineConfig::named("tiny").is_none());
        let mut c = QwenImagePipelineConfig::tiny();
        c.transformer.joint_attention_dim = 64;
        assert!(matches!(
            check_consistency(Some(&c.text_encoder), &c.transformer, &c.vae),
            Err(LoadError::InvalidConfig { field, .. }) if field == "transformer.joint_attention_dim"
        ));
        let mut c = QwenImagePipelineConfig::tiny();
        c.vae.z_dim = 8;
        assert!(check_consistency(None, &c.transformer, &c.vae).is_err());
    }

    #[test]
    fn the_real_vae_scales_by_8_and_rounds_down() {
        let c = QwenImagePipelineConfig::qwen_image();
        assert_eq!(c.vae.spatial_compression_ratio(), 8);
        assert_eq!(flux::latent_size(1000, 1030, 8), (124, 128));
    }
}
