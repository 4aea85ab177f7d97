//! What one request to a [`Session`](super::Session) asks for ([`Request`]), its defaults
//! and checks ([`Request::check`]: `ddo run`'s, the same for `ddo serve`), and the prompts
//! as each family takes them.

use std::path::Path;

use ddo_core::Tensor;
use ddo_nn::pipeline::{FluxPipeline, InitLatents, PromptEmbeds, PromptInput, TiledDecode};

use crate::error::{CliError, CliResult};
use crate::family::Family;
use crate::io::{HostTensor, read_optional_tensor, read_tensor, unpack_host};
use crate::run::{MAX_IMAGES, Source, qwen};
use crate::tokenize::PipelineTokenizers;

/// One request: the prompt, the size, the schedule, the seed and the image count; `None`
/// takes `ddo run`'s default.
#[derive(Debug, Clone, Default)]
pub struct Request {
    /// The prompt (default: [`DEFAULT_PROMPT`](crate::run::DEFAULT_PROMPT)).
    pub prompt: Option<String>,
    /// The negative prompt (Qwen-Image's true CFG).
    pub negative_prompt: Option<String>,
    /// Prompt embeddings read from a file instead of a text prompt.
    pub(crate) embeds: GivenEmbeds,
    /// Image height in pixels (1024; 128 for the tiny configs).
    pub height: Option<usize>,
    /// Image width in pixels (as the height).
    pub width: Option<usize>,
    /// Denoising steps (the family's default).
    pub steps: Option<usize>,
    /// Flux's guidance scale (3.5).
    pub guidance: Option<f32>,
    /// Qwen-Image's true CFG scale.
    pub true_cfg_scale: Option<f32>,
    /// The noise's seed (0).
    pub seed: Option<u64>,
    /// Images per prompt (1).
    pub num_images: Option<usize>,
    /// Initial noise given, one row per image (instead of the seed's).
    pub(crate) init: Option<Tensor>,
    /// The decode's tiling (auto).
    pub tiled_decode: Option<TiledDecode>,
    /// `--release-native-idle`.
    pub release_native_idle: bool,
    /// `--timeline`.
    pub timeline: bool,
}

/// A [`Request`] with its defaults filled in and checked.
#[derive(Debug, Clone)]
pub struct Checked {
    /// Height asked for (before rounding to whole latent patches).
    pub height: usize,
    /// Width asked for.
    pub width: usize,
    /// Denoising steps.
    pub steps: usize,
    /// Flux's guidance scale.
    pub guidance: f32,
    /// Qwen-Image's true CFG scale.
    pub true_cfg_scale: f32,
    /// The noise's seed.
    pub seed: u64,
    /// Images per prompt.
    pub num_images: usize,
    /// Prompts (1 for a text prompt; the rows of given embeddings).
    pub prompts: usize,
    /// Images in all (prompts × images per prompt).
    pub images: usize,
    /// The initial noise.
    pub init: InitLatents,
    /// The decode's tiling.
    pub tiled_decode: TiledDecode,
    /// `--release-native-idle`.
    pub release_native_idle: bool,
    /// `--timeline`.
    pub timeline: bool,
}

impl Request {
    /// `ddo run`'s request: its options, with `--prompt-embeds` and `--init-latents` read
    /// for `family`.
    pub(crate) fn of_run(args: &crate::cli::RunArgs, family: Family) -> CliResult<Self> {
        let embeds = match (&args.prompt_embeds, family) {
            (None, _) => GivenEmbeds::None,
            (Some(path), Family::Flux) => {
                let seq = read_tensor(path, &["prompt_embeds"], "--prompt-embeds")?;
                let pooled = read_tensor(path, &["pooled_prompt_embeds"], "--prompt-embeds")?;
                GivenEmbeds::Flux(PromptEmbeds {
                    prompt_embeds: seq.to_tensor()?,
                    pooled_prompt_embeds: pooled.to_tensor()?,
                })
            }
            (Some(path), Family::QwenImage) => GivenEmbeds::Qwen(qwen::read_embeds_file(path)?),
        };
        let init = args.init_latents.as_deref().map(read_init).transpose()?;
        Ok(Self {
            prompt: args.prompt.clone(),
            negative_prompt: args.negative_prompt.clone(),
            embeds,
            height: args.height,
            width: args.width,
            steps: args.steps,
            guidance: args.guidance,
            true_cfg_scale: args.true_cfg_scale,
            seed: args.seed,
            num_images: args.num_images,
            init,
            tiled_decode: args.tiled_decode,
            release_native_idle: args.release_native_idle,
            timeline: args.timeline,
        })
    }

    /// Whether prompt embeddings were given (instead of text).
    pub fn has_embeds(&self) -> bool {
        !matches!(self.embeds, GivenEmbeds::None)
    }

    /// The request with `ddo run`'s defaults for `family` (`tiny`: the tiny configs'
    /// smaller size), checked: the schedule fits the host, at most [`MAX_IMAGES`] images,
    /// one row of given noise per image.
    pub fn check(&self, family: Family, tiny: bool) -> CliResult<Checked> {
        let steps = self.steps.unwrap_or(family.default_steps(tiny));
        ddo_nn::scheduler::check_schedule_memory(steps).map_err(|e| {
            CliError::usage(
                format!("--steps {steps}: more than this host can schedule"),
                match e {
                    ddo_core::CoreError::InvalidOption { hint, .. } => hint,
                    other => other.to_string(),
                },
            )
        })?;
        let default_side = if tiny { 128 } else { 1024 };
        let num_images = self.num_images.unwrap_or(1);
        let prompts = self.embeds.batch();
        let images = prompts
            .checked_mul(num_images)
            .filter(|&n| n <= MAX_IMAGES)
            .ok_or_else(|| {
                CliError::usage(
                    format!(
                        "--num-images {num_images} for {prompts} prompt(s): more than {MAX_IMAGES} images in one batch"
                    ),
                    format!(
                        "ask for at most {MAX_IMAGES} images in all, and run again (with another --seed) for more"
                    ),
                )
            })?;
        let seed = self.seed.unwrap_or(0);
        let init = match &self.init {
            Some(t) => InitLatents::Given(t.clone()),
            None => InitLatents::Seed(seed),
        };
        // One noise per image; the pipeline checks the rest of the shape.
        if let InitLatents::Given(t) = &init
            && t.shape().first() != Some(&images)
        {
            return Err(CliError::usage(
                format!(
                    "--init-latents: noise {:?} for {images} image(s)",
                    t.shape()
                ),
                format!(
                    "give one row per image ({prompts} prompt(s) x --num-images {num_images}), e.g. [{images}, C, h, w]"
                ),
            ));
        }
        Ok(Checked {
            height: self.height.unwrap_or(default_side),
            width: self.width.unwrap_or(default_side),
            steps,
            // Checked finite, its embedding too, by the parser (`cli::values::guidance`).
            guidance: self.guidance.unwrap_or(3.5),
            true_cfg_scale: self.true_cfg_scale.unwrap_or(qwen::DEFAULT_TRUE_CFG_SCALE),
            seed,
            num_images,
            prompts,
            images,
            init,
            tiled_decode: self.tiled_decode.unwrap_or(TiledDecode::Auto),
            release_native_idle: self.release_native_idle,
            timeline: self.timeline,
        })
    }
}

/// The initial noise of an `--init-latents` file: `latents` or `noise`, both only when they
/// hold the same noise.
fn read_init(p: &Path) -> CliResult<Tensor> {
    // Both names in one file are taken only when they hold the same noise (packed and
    // unpacked, as the fixtures keep it); otherwise which to use is a guess.
    if let (Some(latents), Some(noise)) = (
        read_optional_tensor(p, "latents", "--init-latents")?,
        read_optional_tensor(p, "noise", "--init-latents")?,
    ) && !same_noise(&latents, &noise)
    {
        return Err(CliError::usage(
            format!(
                "--init-latents {}: holds both `latents` {:?} and `noise` {:?}, which differ",
                p.display(),
                latents.shape,
                noise.shape
            ),
            "keep one of them in the file (the initial noise, one row per image)",
        ));
    }
    read_tensor(p, &["latents", "noise"], "--init-latents")?.to_tensor()
}

/// Whether `latents` and `noise` of an `--init-latents` file are the same noise: equal, or
/// one the packed form (`[n, (h/2)(w/2), 4c]`) of the other (`[n, c, h, w]`).
fn same_noise(latents: &HostTensor, noise: &HostTensor) -> bool {
    if latents.shape == noise.shape {
        return latents.values == noise.values;
    }
    let unpacked = |packed: &HostTensor, other: &HostTensor| match other.shape.as_slice() {
        &[_, _, h, w] => unpack_host(packed, h, w)
            .is_ok_and(|u| u.shape == other.shape && u.values == other.values),
        _ => false,
    };
    unpacked(latents, noise) || unpacked(noise, latents)
}

/// Prompt embeddings given with `--prompt-embeds`, read as the family takes them.
#[derive(Debug, Clone, Default)]
pub(crate) enum GivenEmbeds {
    /// None given.
    #[default]
    None,
    /// Flux's `prompt_embeds` and `pooled_prompt_embeds`.
    Flux(PromptEmbeds),
    /// Qwen-Image's, with their masks and the negative prompt's.
    Qwen(qwen::QwenEmbedsFile),
}

impl GivenEmbeds {
    /// Prompts in the file (1 when none was given: the text prompt).
    fn batch(&self) -> usize {
        match self {
            GivenEmbeds::None => 1,
            GivenEmbeds::Flux(e) => e.batch(),
            GivenEmbeds::Qwen(e) => e.batch(),
        }
    }
}

/// The prompt of a request, as its family takes it.
pub(crate) enum Prompts {
    /// A Flux prompt.
    Flux(PromptInput),
    /// A Qwen-Image prompt and negative prompt.
    Qwen(qwen::QwenPrompts),
}

/// The prompt of a Flux request: the embeddings', or text through the folder's tokenizer
/// files (`tokenizers`, or the stand-in), and how the profile names it.
pub(crate) fn flux_prompt(
    pipe: &FluxPipeline,
    embeds: Option<PromptEmbeds>,
    text: Option<&str>,
    tokenizers: Option<&PipelineTokenizers>,
    source: &Source,
) -> CliResult<(PromptInput, String)> {
    match (embeds, text) {
        (Some(_), Some(_)) => Err(CliError::usage(
            "--prompt and --prompt-embeds both given",
            "give one: text, or embeddings from a file",
        )),
        (Some(e), None) => Ok((
            PromptInput::Embeddings(e),
            "embeddings from --prompt-embeds".to_string(),
        )),
        (None, text) => {
            let (Some(clip), Some(_)) = (&pipe.clip, &pipe.t5) else {
                return Err(CliError::usage(
                    "this pipeline folder has no text_encoder/ and text_encoder_2/",
                    "pass --prompt-embeds FILE.safetensors (tensors prompt_embeds and pooled_prompt_embeds)",
                ));
            };
            let text = text.unwrap_or(crate::run::DEFAULT_PROMPT).to_string();
            match tokenizers {
                Some(t) => {
                    let (clip_ids, t5_ids) = t.encode(
                        &text,
                        clip.config().max_position_embeddings,
                        pipe.max_sequence_length,
                    )?;
                    let label = format!(
                        "{text:?} (tokenizer files: {}, {}; {} + {} tokens)",
                        t.clip.source.display(),
                        t.t5.source.display(),
                        clip_ids.len(),
                        t5_ids.len()
                    );
                    Ok((
                        PromptInput::Tokens {
                            clip: clip_ids,
                            t5: t5_ids,
                        },
                        label,
                    ))
                }
                None => {
                    let label = format!(
                        "{text:?} (stand-in tokenizer: {})",
                        match source {
                            Source::Config(_) => "random weights have no tokenizer files",
                            Source::Weights(_) => "the folder has no tokenizer/ and tokenizer_2/",
                        }
                    );
                    Ok((PromptInput::Text(text), label))
                }
            }
        }
    }
}
