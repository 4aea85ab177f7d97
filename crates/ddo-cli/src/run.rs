//! `ddo run`: the Flux pipeline in phases (prompt encoding, denoise, decode) under a
//! preset and per-component routes, with the seed's cleanup between phases, writing the
//! image and printing each phase's route, time and peak from the handles' metrics.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use ddo_core::DType;
use ddo_core::FootprintContext;
use ddo_metrics::format_bytes;
use ddo_nn::pipeline::{
    FluxPipeline, FluxPipelineConfig, InitLatents, PipelineRequest, PipelineRun, PromptEmbeds,
    PromptInput, TiledDecode,
};
use ddo_routes::{PipelinePlan, PlanRequest, enable_planned_pipeline_offload, plan_pipeline};
use serde_json::{Value, json};

use crate::cli::RunArgs;
use crate::error::{CliError, CliResult};
use crate::io::{
    HostTensor, OutputKind, encode_png, encode_safetensors, output_kind, read_tensor, unpack_host,
};
use crate::outputs::{Outputs, image_paths};
use crate::progress::ProgressBar;
use crate::setup::{DeviceChoice, DeviceNeeds, Explanation, Routing, check_budget, open_device};
use crate::tokenize::PipelineTokenizers;

/// The prompt used when `--prompt` is not given.
pub const DEFAULT_PROMPT: &str = "a lighthouse on a rocky coast at dawn";

/// Where the models come from.
#[derive(Debug, Clone)]
pub(crate) enum Source {
    Config(String),
    Weights(PathBuf),
}

/// Parses a dtype name.
pub fn parse_dtype(text: &str) -> CliResult<DType> {
    match text {
        "f32" | "float32" => Ok(DType::F32),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        "f16" | "float16" => Ok(DType::F16),
        "fp8" | "fp8_e4m3" | "f8_e4m3" | "float8_e4m3fn" => Ok(DType::F8E4M3),
        "fp8_e5m2" | "f8_e5m2" | "float8_e5m2" => Ok(DType::F8E5M2),
        _ => Err(CliError::usage(
            format!("unknown dtype `{text}`"),
            "use f32, bf16, f16, or fp8_e4m3 (alias fp8) / fp8_e5m2 for the transformer's weights stored as fp8 with bf16 compute",
        )),
    }
}

/// `--allow-unused-weights`.
pub(crate) fn unused_weights(allow: bool) -> ddo_nn::UnusedWeights {
    if allow {
        ddo_nn::UnusedWeights::Allow
    } else {
        ddo_nn::UnusedWeights::Refuse
    }
}

/// The most images one `ddo run` makes (prompts × `--num-images`): a batch whose files are
/// named and probed before the run starts. Far beyond what one device denoises at once (the
/// memory plan refuses much smaller batches at FLUX.1-dev's size).
pub const MAX_IMAGES: usize = 4096;

/// The most T5 tokens FluxPipeline encodes (`max_sequence_length`; Diffusers refuses more).
pub const MAX_SEQUENCE_LENGTH: usize = 512;

/// Refuses random weights that would not fit in the host's available memory (building them
/// would get the process killed instead of failing cleanly).
fn check_host_memory(
    config: &FluxPipelineConfig,
    dtype: DType,
    files: &ComponentFiles,
) -> CliResult<()> {
    // Components given as files are mapped, not made.
    let random = |file: &Option<PathBuf>, count: u64| if file.is_some() { 0 } else { count };
    let params = random(&files.text_encoder, config.text_encoder.param_count())
        + random(&files.text_encoder_2, config.text_encoder_2.param_count())
        + random(&files.transformer, config.transformer.param_count());
    // fp8 storage builds each transformer weight in bf16 before storing it as fp8, and
    // keeps the modulations and the other components in bf16: counted at bf16, an upper
    // bound.
    let needed = params * dtype.compute().size_in_bytes() as u64;
    let available = ddo_core::host_memory::mem_available();
    match available {
        Some(free) if needed > free => Err(CliError::runtime(
            format!(
                "the random {dtype} weights of this config need about {} of host memory; {} is available",
                format_bytes(needed),
                format_bytes(free)
            ),
            "run it on a machine with more memory, or use --config tiny",
        )),
        _ => Ok(()),
    }
}

/// The components given as single files (`--transformer FILE`, `--text-encoder-2 FILE`),
/// which take the place of the folder's or the config's.
#[derive(Debug, Clone, Default)]
pub(crate) struct ComponentFiles {
    /// A CLIP text encoder in the Transformers layout.
    pub text_encoder: Option<PathBuf>,
    /// A transformer in the original Flux layout.
    pub transformer: Option<PathBuf>,
    /// A T5 encoder in the Transformers layout.
    pub text_encoder_2: Option<PathBuf>,
    /// A VAE in the original (LDM) layout.
    pub vae: Option<PathBuf>,
}

impl ComponentFiles {
    /// The files given to `--text-encoder`, `--transformer`, `--text-encoder-2` and `--vae`,
    /// each checked to be a file.
    pub(crate) fn checked(self) -> CliResult<Self> {
        let file = |option: &str, f: Option<PathBuf>, what: &str| -> CliResult<Option<PathBuf>> {
            match f {
                Some(path) if !path.is_file() => Err(CliError::usage(
                    format!("--{option} {}: not a file", path.display()),
                    format!(
                        "give one .safetensors file ({what}); a Diffusers folder goes in --weights"
                    ),
                )),
                f => Ok(f),
            }
        };
        Ok(Self {
            text_encoder: file(
                "text-encoder",
                self.text_encoder,
                "a CLIP text encoder in the Transformers layout, e.g. clip_l.safetensors",
            )?,
            transformer: file(
                "transformer",
                self.transformer,
                "the original Flux layout, e.g. flux1-dev.safetensors or a ComfyUI fp8 file",
            )?,
            text_encoder_2: file(
                "text-encoder-2",
                self.text_encoder_2,
                "a T5 encoder in the Transformers layout, e.g. t5xxl_fp8_e4m3fn.safetensors",
            )?,
            vae: file(
                "vae",
                self.vae,
                "a VAE in the original LDM layout, e.g. Black Forest Labs' ae.safetensors",
            )?,
        })
    }
}

/// The component given as file `path` to `--option`, loaded by `load`; its errors name
/// the option and the file.
fn from_file<T>(
    option: &str,
    path: &Path,
    bar: &mut ProgressBar,
    load: impl FnOnce(&Path) -> ddo_nn::LoadResult<T>,
) -> CliResult<T> {
    bar.status(&format!("opening {}...", path.display()));
    load(path).map_err(|e| CliError::from(e).context(&format!("--{option} {}", path.display())))
}

/// The components of `files`, each with its config: `folder`'s `<component>/config.json`
/// when there is one, else `configs`' (the named config, or FLUX.1's for a folder without
/// one; the shapes are checked on load). A transformer file in a folder without a config
/// reads its config from its shapes. `dtype` converts as `--dtype` asks; an 8-bit float
/// stores the transformer's and T5's layers as fp8, CLIP and the VAE in bf16.
fn load_files(
    files: &ComponentFiles,
    configs: &FluxPipelineConfig,
    folder: Option<&Path>,
    dtype: Option<DType>,
    unused: ddo_nn::UnusedWeights,
    bar: &mut ProgressBar,
) -> CliResult<ddo_nn::pipeline::Loaded> {
    use ddo_nn::{clip, flux, t5, vae};
    // `Some(config)` from the folder's config.json, `None` without a folder or a file.
    fn in_folder<T>(
        folder: Option<&Path>,
        component: &str,
        read: fn(&Path) -> ddo_nn::LoadResult<T>,
    ) -> CliResult<Option<T>> {
        let Some(dir) = folder else { return Ok(None) };
        let file = dir.join(component).join("config.json");
        if !file.is_file() {
            return Ok(None);
        }
        read(&file)
            .map(Some)
            .map_err(|e| CliError::from(e).context(&format!("--weights {}", dir.display())))
    }
    let text_encoder = match files.text_encoder.as_deref() {
        Some(f) => {
            let c = in_folder(folder, "text_encoder", clip::ClipTextConfig::from_file)?
                .unwrap_or_else(|| configs.text_encoder.clone());
            Some(from_file("text-encoder", f, bar, |p| {
                clip::ClipTextModel::load_file(p, &c, dtype, unused)
            })?)
        }
        None => None,
    };
    let transformer = match files.transformer.as_deref() {
        Some(f) => {
            let c = match folder {
                Some(_) => in_folder(
                    folder,
                    "transformer",
                    flux::FluxTransformerConfig::from_file,
                )?,
                None => Some(configs.transformer.clone()),
            };
            Some(from_file("transformer", f, bar, |p| {
                flux::FluxTransformer::load_original(p, c, dtype, unused)
            })?)
        }
        None => None,
    };
    let text_encoder_2 = match files.text_encoder_2.as_deref() {
        Some(f) => {
            let c = in_folder(folder, "text_encoder_2", t5::T5Config::from_file)?
                .unwrap_or_else(|| configs.text_encoder_2.clone());
            Some(from_file("text-encoder-2", f, bar, |p| {
                t5::T5Encoder::load_file(p, &c, dtype, unused)
            })?)
        }
        None => None,
    };
    let vae = match files.vae.as_deref() {
        Some(f) => {
            let c = in_folder(folder, "vae", vae::AutoencoderKLConfig::from_file)?
                .unwrap_or_else(|| configs.vae.clone());
            // fp8 is not a VAE's storage.
            Some(from_file("vae", f, bar, |p| {
                vae::AutoencoderKL::load_original(p, c, dtype.map(DType::compute), unused)
            })?)
        }
        None => None,
    };
    Ok(ddo_nn::pipeline::Loaded {
        text_encoder,
        transformer,
        text_encoder_2,
        vae,
    })
}

/// Loads or builds the pipeline; the components of `files` replace the folder's or the
/// config's.
pub(crate) fn build_pipeline(
    source: &Source,
    files: &ComponentFiles,
    dtype: Option<DType>,
    max_seq: Option<usize>,
    unused: ddo_nn::UnusedWeights,
    bar: &mut ProgressBar,
) -> CliResult<(FluxPipeline, String)> {
    match source {
        Source::Config(name) => {
            let Some(mut config) = FluxPipelineConfig::named(name) else {
                return Err(CliError::usage(
                    format!("unknown config `{name}`"),
                    format!("use one of: {}", FluxPipelineConfig::NAMES.join(", ")),
                ));
            };
            if let Some(n) = max_seq {
                config.max_sequence_length = n;
            }
            let asked = dtype;
            let dtype = dtype.unwrap_or(if name == "tiny" {
                DType::F32
            } else {
                DType::BF16
            });
            check_host_memory(&config, dtype, files)?;
            // The files as stored unless --dtype asks for a conversion.
            let loaded = load_files(files, &config, None, asked, unused, bar)?;
            bar.status(&format!("building {name} with random {dtype} weights..."));
            let pipe = FluxPipeline::random_with(&config, 0, dtype, loaded)?;
            bar.finish();
            let mut label = format!("{name} (random weights, {dtype}");
            for (what, f) in [
                ("text_encoder", &files.text_encoder),
                ("transformer", &files.transformer),
                ("text_encoder_2", &files.text_encoder_2),
                ("vae", &files.vae),
            ] {
                if let Some(f) = f {
                    label += &format!("; {what} {}", f.display());
                }
            }
            label += ")";
            Ok((pipe, label))
        }
        Source::Weights(dir) => {
            let loaded = load_files(
                files,
                &FluxPipelineConfig::flux_dev(),
                Some(dir),
                dtype,
                unused,
                bar,
            )?;
            bar.status(&format!("opening {}...", dir.display()));
            let mut pipe = FluxPipeline::load_with(dir, dtype, unused, loaded)
                .map_err(|e| CliError::from(e).context(&format!("--weights {}", dir.display())))?;
            bar.finish();
            if let Some(n) = max_seq {
                pipe.max_sequence_length = n;
            }
            Ok((
                pipe,
                format!(
                    "{} ({})",
                    dir.display(),
                    dtype.map_or("dtype as stored".to_string(), |d| d.to_string())
                ),
            ))
        }
    }
}

/// `--config NAME` or `--weights DIR` (exactly one).
pub(crate) fn source_from_args(config: Option<&str>, weights: Option<&Path>) -> CliResult<Source> {
    let source = match (config, weights) {
        (Some(c), None) => Source::Config(c.to_string()),
        (None, Some(w)) => Source::Weights(w.to_path_buf()),
        (Some(_), Some(_)) => {
            return Err(CliError::usage(
                "--config and --weights both given",
                "give one: --config tiny (random weights) or --weights DIR (a Diffusers pipeline folder)",
            ));
        }
        (None, None) => {
            return Err(CliError::usage(
                "no model given",
                "add --config tiny (random weights, runs anywhere) or --weights DIR (a Diffusers pipeline folder)",
            ));
        }
    };
    if let Source::Config(name) = &source
        && FluxPipelineConfig::named(name).is_none()
    {
        return Err(CliError::usage(
            format!("unknown config `{name}`"),
            format!("use one of: {}", FluxPipelineConfig::NAMES.join(", ")),
        ));
    }
    Ok(source)
}

/// The VRAM budget the memory plan is made for, and where it came from: `--vram-budget`;
/// else on a device with a driver what it has free less
/// [`DEFAULT_FREE_MARGIN`](ddo_routes::plan::DEFAULT_FREE_MARGIN); else (the host backend) its
/// capacity.
pub(crate) fn plan_budget(device: &dyn ddo_core::Device, given: Option<u64>) -> (u64, String) {
    let info = device.memory_info();
    match (given, info.driver_free) {
        (Some(b), _) => (b, "--vram-budget".into()),
        (None, Some(free)) => (
            free.saturating_sub(ddo_routes::plan::DEFAULT_FREE_MARGIN),
            format!(
                "the device's free {} less {}",
                format_bytes(free),
                format_bytes(ddo_routes::plan::DEFAULT_FREE_MARGIN)
            ),
        ),
        (None, None) => (info.capacity, "the host device's capacity".into()),
    }
}

/// The pipeline's memory plan at `height × width` under `budget` on `device`.
pub(crate) fn plan_memory(
    pipe: &FluxPipeline,
    pipeline: &ddo_routes::Pipeline,
    routing: &Routing,
    device: &dyn ddo_core::Device,
    budget: (u64, String),
    image: (usize, usize, usize),
    tiled: TiledDecode,
) -> CliResult<PipelinePlan> {
    let (height, width, images) = image;
    plan_pipeline(
        pipeline,
        &routing.plan_settings(),
        &routing.explicit_routes(),
        &routing.environment(),
        &PlanRequest {
            budget_bytes: budget.0,
            budget_source: budget.1,
            phases: pipe.phase_demands(height, width, images, tiled, budget.0, device)?,
            context: FootprintContext::of(device),
        },
    )
    .map_err(|e| CliError::from(e).context("planning memory"))
}

/// How `routing` explains the routes the plan chose for `names`, in that order.
pub(crate) fn planned_explanations(
    routing: &Routing,
    names: &[String],
    plan: &PipelinePlan,
) -> CliResult<Vec<Explanation>> {
    names
        .iter()
        .filter_map(|n| plan.component(n))
        .map(|p| routing.explain_planned(p))
        .collect()
}

/// Runs `ddo run` with `argv` (after `run`), writing the profile to `out`.
pub fn run(args: &RunArgs, out: &mut dyn Write) -> CliResult<()> {
    let started = Instant::now();
    let source = source_from_args(args.config.as_deref(), args.weights.as_deref())?;
    let tiny = matches!(&source, Source::Config(n) if n == "tiny");
    let dtype = args.dtype;
    let steps = args.steps.unwrap_or(if tiny { 4 } else { 28 });
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
    let height = args.height.unwrap_or(default_side);
    let width = args.width.unwrap_or(default_side);
    let seed = args.seed.unwrap_or(0);
    let num_images = args.num_images.unwrap_or(1);
    // Checked finite, its embedding too, by the parser (`cli::values::guidance`).
    let guidance = args.guidance.unwrap_or(3.5);
    let max_seq = args.max_sequence_length;
    let tiled_decode = args.tiled_decode.unwrap_or(TiledDecode::Auto);
    let device_choice = args.device.unwrap_or(DeviceChoice::Cpu);
    let budget = args.vram_budget;
    let out_path = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("ddo-out.png"));
    let out_kind = output_kind("--out", &out_path)?;
    let save_latents = args.save_latents.clone();
    if let Some(p) = &save_latents
        && output_kind("--save-latents", p).ok() != Some(OutputKind::Safetensors)
    {
        return Err(CliError::usage(
            format!("--save-latents {}: not a .safetensors name", p.display()),
            "end the name in .safetensors",
        ));
    }

    // Inputs given as files are read before anything heavy: the embeddings say how many
    // prompts there are, hence how many images.
    let prompt_embeds = match &args.prompt_embeds {
        Some(path) => {
            let seq = read_tensor(path, &["prompt_embeds"], "--prompt-embeds")?;
            let pooled = read_tensor(path, &["pooled_prompt_embeds"], "--prompt-embeds")?;
            Some(PromptEmbeds {
                prompt_embeds: seq.to_tensor()?,
                pooled_prompt_embeds: pooled.to_tensor()?,
            })
        }
        None => None,
    };
    let prompts = prompt_embeds.as_ref().map_or(1, PromptEmbeds::batch);
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
    let init = match &args.init_latents {
        Some(p) => InitLatents::Given(
            read_tensor(p, &["latents", "noise"], "--init-latents")?.to_tensor()?,
        ),
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

    // Outputs are checked against the inputs and each other, and for a writable
    // directory, before anything heavy is read or computed.
    let weights_dir = match &source {
        Source::Weights(dir) => Some(dir.clone()),
        Source::Config(_) => None,
    };
    let input_paths: Vec<(&'static str, PathBuf)> = [
        ("--weights", weights_dir),
        ("--prompt-embeds", args.prompt_embeds.clone()),
        ("--init-latents", args.init_latents.clone()),
    ]
    .into_iter()
    .filter_map(|(o, p)| p.map(|p| (o, p)))
    .collect();
    let image_files = image_paths(&out_path, images);
    let mut output_paths: Vec<(&'static str, &std::path::Path)> =
        image_files.iter().map(|p| ("--out", p.as_path())).collect();
    if let Some(p) = &save_latents {
        output_paths.push(("--save-latents", p));
    }
    let outputs = Outputs::plan(
        &output_paths,
        &input_paths
            .iter()
            .map(|(o, p)| (*o, p.as_path()))
            .collect::<Vec<_>>(),
    )?;

    device_choice.prepare_kernels();
    let mut bar = ProgressBar::new();
    let mut startup = Stopwatch::new(started);
    let (pipe, model_label) = build_pipeline(
        &source,
        &ComponentFiles {
            text_encoder: args.text_encoder.clone(),
            transformer: args.transformer.clone(),
            text_encoder_2: args.text_encoder_2.clone(),
            vae: args.vae.clone(),
        }
        .checked()?,
        dtype,
        max_seq,
        unused_weights(args.allow_unused_weights),
        &mut bar,
    )?;
    startup.lap("weights");
    let names = pipe.component_names();
    let routing = Routing::new(args.preset, &args.route, args.no_env, &names)?;
    let explanations = names
        .iter()
        .map(|n| routing.explain(n))
        .collect::<CliResult<Vec<Explanation>>>()?;
    let device = open_device(device_choice, budget, DeviceNeeds::of(&explanations))?;
    // The backend may prepare per-shape work (cuDNN plans) while the routes attach and the
    // prompt is encoded.
    pipe.prepare_attention(&*device, height, width, images)?;
    startup.lap("device");
    let (plan_budget, budget_source) = plan_budget(&*device, budget);
    let effective_budget = Some(plan_budget);
    check_budget(plan_budget, &pipe.components())?;
    // Diffusers rounds the size down to whole 2x2 latent patches (and warns): so does this,
    // and the profile says so.
    let (latent_h, latent_w) = pipe.latent_grid(height, width)?;
    let (asked_h, asked_w) = (height, width);
    let (height, width) = (
        latent_h * pipe.vae_scale_factor(),
        latent_w * pipe.vae_scale_factor(),
    );
    let size_note = ((height, width) != (asked_h, asked_w)).then(|| {
        format!(
            "{asked_w}x{asked_h} rounded down to {width}x{height}: height and width must be multiples of {} (whole 2x2 patches of the {}x VAE's latents), as Diffusers resizes them",
            2 * pipe.vae_scale_factor(),
            pipe.vae_scale_factor()
        )
    });

    let (prompt, prompt_label) = match (prompt_embeds, args.prompt.as_deref()) {
        (Some(_), Some(_)) => {
            return Err(CliError::usage(
                "--prompt and --prompt-embeds both given",
                "give one: text, or embeddings from a file",
            ));
        }
        (Some(e), None) => (
            PromptInput::Embeddings(e),
            "embeddings from --prompt-embeds".to_string(),
        ),
        (None, text) => {
            let (Some(clip), Some(_)) = (&pipe.clip, &pipe.t5) else {
                return Err(CliError::usage(
                    "this pipeline folder has no text_encoder/ and text_encoder_2/",
                    "pass --prompt-embeds FILE.safetensors (tensors prompt_embeds and pooled_prompt_embeds)",
                ));
            };
            let text = text.unwrap_or(DEFAULT_PROMPT).to_string();
            let files = match &source {
                Source::Weights(dir) => PipelineTokenizers::load(dir)?,
                Source::Config(_) => None,
            };
            match files {
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
                    (
                        PromptInput::Tokens {
                            clip: clip_ids,
                            t5: t5_ids,
                        },
                        label,
                    )
                }
                None => {
                    let label = format!(
                        "{text:?} (stand-in tokenizer: {})",
                        match &source {
                            Source::Config(_) => "random weights have no tokenizer files",
                            Source::Weights(_) => "the folder has no tokenizer/ and tokenizer_2/",
                        }
                    );
                    (PromptInput::Text(text), label)
                }
            }
        }
    };

    let pipeline = pipe.offload_pipeline()?;
    let plan = plan_memory(
        &pipe,
        &pipeline,
        &routing,
        &*device,
        (plan_budget, budget_source),
        (height, width, images),
        tiled_decode,
    )?;
    let explanations = planned_explanations(&routing, &names, &plan)?;
    // Every route's preflight runs here, before the plan is printed: a refusal is the
    // whole output.
    let mut offload = enable_planned_pipeline_offload(&pipeline, device.clone(), &plan)
        .map_err(|e| CliError::from(e).context("attaching routes"))?;
    if !args.json {
        out.write_all(plan.format_text().as_bytes())
            .map_err(|e| CliError::runtime(format!("cannot write the profile: {e}"), ""))?;
    }
    startup.lap("plan");
    startup.lap("attach");
    let request = PipelineRequest {
        prompt,
        steps,
        guidance,
        height,
        width,
        init,
        num_images,
        tiled_decode,
        vram_budget: effective_budget,
        release_native_idle_cache: args.release_native_idle,
    };
    // When each denoising step's host side finished (the streaming engine keeps the host
    // within a ring of the device, so these follow the device's pace).
    let mut step_ends: Vec<Instant> = Vec::new();
    let denoise_began = Instant::now();
    let result = pipe.run_phases(&mut offload, &request, &mut |phase, done, total| {
        if phase == "denoise" {
            step_ends.push(Instant::now());
        }
        bar.update(phase, done, total)
    });
    let step_seconds = step_seconds(denoise_began, &step_ends);
    bar.finish();
    let run = result?;
    startup.lap("phases");
    // Host memory the routes handed back (`Device::release_host`) is unpinned now that the
    // device is idle, beside the output's encoding.
    let unpinning = {
        let device = Arc::clone(&device);
        std::thread::spawn(move || device.unpin_released())
    };

    let image = HostTensor::from_tensor(&run.image)?;
    let mut files: Vec<(&'static str, Vec<u8>)> = match out_kind {
        OutputKind::Png => image
            .rows()
            .iter()
            .map(|row| Ok(("--out", encode_png(row)?)))
            .collect::<CliResult<_>>()?,
        OutputKind::Safetensors => {
            let latents = HostTensor::from_tensor(&run.latents)?;
            vec![(
                "--out",
                encode_safetensors(&[("sample", &image), ("latents", &latents)])?,
            )]
        }
    };
    if save_latents.is_some() {
        let (h, w) = pipe.latent_grid(height, width)?;
        let unpacked = unpack_host(&HostTensor::from_tensor(&run.latents)?, h, w)?;
        let cfg = pipe.vae.config();
        let (sf, shift) = (
            cfg.scaling_factor as f32,
            cfg.shift_factor.unwrap_or(0.0) as f32,
        );
        let unscaled = HostTensor {
            shape: unpacked.shape.clone(),
            values: unpacked.values.iter().map(|v| v / sf + shift).collect(),
        };
        files.push((
            "--save-latents",
            encode_safetensors(&[("latents", &unscaled)])?,
        ));
    }
    outputs.commit(&files)?;
    // The outputs are written: a panic while unpinning (printed by the panic hook) cannot
    // change them, and the process is about to let go of that memory anyway.
    let _ = unpinning.join();

    let snapshots: Vec<Value> = names
        .iter()
        .map(|n| {
            offload
                .handle(n)
                .map(|h| serde_json::to_value(h.metrics_snapshot()).unwrap_or(Value::Null))
                .unwrap_or(Value::Null)
        })
        .collect();
    startup.lap("output");
    let total = started.elapsed().as_secs_f64();
    let report = Report {
        model: &model_label,
        device: device.id().to_string(),
        budget: effective_budget,
        height,
        width,
        size_note: size_note.as_deref(),
        steps,
        guidance,
        seed,
        prompt: &prompt_label,
        explanations: &explanations,
        plan: &plan,
        run: &run,
        snapshots: &snapshots,
        out: &image_files,
        save_latents: save_latents.as_ref(),
        laps: &startup.laps,
        step_seconds: &step_seconds,
        total,
    };
    let text = if args.json {
        serde_json::to_string_pretty(&report.json()).unwrap_or_default() + "\n"
    } else {
        report.human()
    };
    out.write_all(text.as_bytes())
        .map_err(|e| CliError::runtime(format!("cannot write the profile: {e}"), ""))
}

struct Report<'a> {
    model: &'a str,
    device: String,
    budget: Option<u64>,
    height: usize,
    width: usize,
    /// Why the size differs from the one asked for.
    size_note: Option<&'a str>,
    steps: usize,
    guidance: f32,
    seed: u64,
    prompt: &'a str,
    explanations: &'a [Explanation],
    plan: &'a PipelinePlan,
    run: &'a PipelineRun,
    snapshots: &'a [Value],
    /// The files the images went to (one, or one per image).
    out: &'a [PathBuf],
    save_latents: Option<&'a PathBuf>,
    /// Wall time by stage (see [`Stopwatch`]).
    laps: &'a [(&'static str, f64)],
    /// Seconds of each denoising step but the first, which counts from the run's start
    /// (see [`step_seconds`]).
    step_seconds: &'a [f64],
    total: f64,
}

/// The time between consecutive denoising steps' ends; the first counts from `began` and
/// so also holds prompt encoding and the denoise phase's setup.
fn step_seconds(began: Instant, ends: &[Instant]) -> Vec<f64> {
    std::iter::once(began)
        .chain(ends.iter().copied())
        .zip(ends)
        .map(|(a, b)| b.duration_since(a).as_secs_f64())
        .collect()
}

/// Wall time of `ddo run` by stage: each lap is the time since the previous one (the first
/// counts from the process's start of `run`, argument parsing and input files included).
struct Stopwatch {
    last: Instant,
    laps: Vec<(&'static str, f64)>,
}

impl Stopwatch {
    fn new(started: Instant) -> Self {
        Self {
            last: started,
            laps: Vec::new(),
        }
    }

    fn lap(&mut self, stage: &'static str) {
        let now = Instant::now();
        self.laps
            .push((stage, now.duration_since(self.last).as_secs_f64()));
        self.last = now;
    }

    /// Seconds before the pipeline's first phase began (every lap before `phases`).
    fn before_phases(laps: &[(&'static str, f64)]) -> f64 {
        laps.iter()
            .take_while(|(stage, _)| *stage != "phases")
            .map(|(_, s)| s)
            .sum()
    }
}

fn ms(seconds: f64) -> String {
    if seconds < 1.0 {
        format!("{:.1} ms", seconds * 1e3)
    } else {
        format!("{seconds:.2} s")
    }
}

impl Report<'_> {
    fn json(&self) -> Value {
        let first = self.explanations.first();
        json!({
            "command": "run",
            "model": self.model,
            "device": self.device,
            "vram_budget_bytes": self.budget,
            "height": self.height,
            "width": self.width,
            "size_note": self.size_note,
            "steps": self.steps,
            "guidance": self.guidance,
            "seed": self.seed,
            "prompt": self.prompt,
            "memory_plan": self.plan.to_json(),
            "preset": first.map(|e| e.preset.clone()),
            "resolved_preset": first.map(|e| e.resolved_preset.clone()),
            "phases": self.run.phases.iter().map(|p| json!({
                "phase": p.phase,
                "components": p.components,
                "seconds": p.seconds,
                "peak_bytes": p.peak.allocator_peak_bytes,
                "end_bytes": p.peak.allocator_end_bytes,
                "driver_used_sampled_bytes": p.peak.driver_used_sampled_bytes,
                "native_pool": p.peak.native_pool,
                "idle_release": p.idle_release,
                "setup_seconds": p.setup_seconds.iter().map(|(c, s)| json!({"component": c, "seconds": s})).collect::<Vec<_>>(),
                "prepared_seconds": p.prepared_seconds.iter().map(|(c, s)| json!({"component": c, "seconds": s})).collect::<Vec<_>>(),
                "cleanup_seconds": p.cleanup_seconds,
                "note": p.note,
            })).collect::<Vec<_>>(),
            "components": self.explanations.iter().zip(self.snapshots).map(|(e, s)| json!({
                "component": e.component,
                "route": e.route,
                "options": e.options,
                "source": e.source,
                "metrics": s,
            })).collect::<Vec<_>>(),
            "decode": self.run.decode,
            "timesteps": self.run.timesteps,
            "output": self.out.first().map(|p| p.display().to_string()),
            "outputs": self.out.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
            "images": self.run.image.shape().first(),
            "latents_output": self.save_latents.map(|p| p.display().to_string()),
            "stage_seconds": self.laps.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "seconds_before_first_phase": Stopwatch::before_phases(self.laps),
            "denoise_step_seconds": self.step_seconds,
            "total_seconds": self.total,
        })
    }

    fn human(&self) -> String {
        let mut s = String::new();
        let first = self.explanations.first();
        let preset = first.map_or(String::new(), |e| {
            if e.preset == e.resolved_preset {
                e.preset.clone()
            } else {
                format!("{} -> {}", e.preset, e.resolved_preset)
            }
        });
        s += &format!(
            "ddo run: {} on {}, budget {}, preset {preset}\n",
            self.model,
            self.device,
            self.budget.map_or("none".into(), format_bytes)
        );
        s += &format!(
            "  {}x{} px, {} steps, guidance {}, seed {}, prompt {}\n",
            self.width, self.height, self.steps, self.guidance, self.seed, self.prompt
        );
        if let Some(n) = self.size_note {
            s += &format!("  note: {n}\n");
        }
        s += "\n";
        s += &format!(
            "{:<16} {:>10} {:>14} {:>14}  {}\n",
            "phase", "time", "peak (exact)", "after cleanup", "component: route"
        );
        for p in &self.run.phases {
            let comps = if p.components.is_empty() {
                vec!["-".to_string()]
            } else {
                p.components.clone()
            };
            for (i, c) in comps.iter().enumerate() {
                if i == 0 {
                    s += &format!(
                        "{:<16} {:>10} {:>14} {:>14}  {c}\n",
                        p.phase,
                        ms(p.seconds),
                        format_bytes(p.peak.allocator_peak_bytes),
                        format_bytes(p.peak.allocator_end_bytes)
                    );
                } else {
                    s += &format!("{:<16} {:>10} {:>14} {:>14}  {c}\n", "", "", "", "");
                }
            }
            if let Some(n) = &p.note {
                s += &format!("{:<16} {n}\n", "");
            }
            if !p.setup_seconds.is_empty() {
                let setups: Vec<String> = p
                    .setup_seconds
                    .iter()
                    .map(|(c, t)| match p.prepared_seconds.iter().find(|(n, _)| n == c) {
                        Some((_, b)) => format!(
                            "{c} {} (attached in the background during the phase before, in {})",
                            ms(*t),
                            ms(*b)
                        ),
                        None => format!("{c} {}", ms(*t)),
                    })
                    .collect();
                s += &format!("{:<16} attach: {}\n", "", setups.join(", "));
            }
            if let Some(pool) = &p.peak.native_pool {
                s += &format!("{:<16} {}\n", "", pool.format_line());
            }
            if let Some(r) = &p.idle_release {
                s += &format!(
                    "{:<16} native idle cache released: {} in {} chunks ({})\n",
                    "",
                    format_bytes(r.bytes),
                    r.chunks,
                    if r.proven {
                        "proven: the driver's free memory rose by as much"
                    } else {
                        "not proven by the driver"
                    }
                );
            }
        }
        s += &format!(
            "\n{:<16} {:<24} {:>8}  {:>26} {:>12} {:>12} {:>12}  {}\n",
            "component",
            "route",
            "forwards",
            "host->device",
            "resident*",
            "streamed/fwd*",
            "pinned peak",
            "decided by"
        );
        for (e, snap) in self.explanations.iter().zip(self.snapshots) {
            let c = &snap["counters"];
            let num = |k: &str| c[k].as_u64().unwrap_or(0);
            let planned = self.plan.component(&e.component);
            let decided = match e.source.route.split_once(" (") {
                Some(("preset table", rest)) => {
                    format!("preset {}", rest.split(',').next().unwrap_or(rest))
                }
                Some(("memory plan", rest)) => {
                    format!("memory plan, {}", rest.split(',').next().unwrap_or(rest))
                }
                _ => e.source.route.clone(),
            };
            s += &format!(
                "{:<16} {:<24} {:>8}  {:>26} {:>12} {:>12} {:>12}  {}\n",
                e.component,
                e.route,
                num("forwards"),
                format!(
                    "{} in {} copies",
                    format_bytes(num("h2d_bytes")),
                    num("h2d_copies")
                ),
                format_bytes(planned.map_or(0, |p| p.footprint.resident_bytes)),
                format_bytes(planned.map_or(0, |p| p.footprint.streamed_bytes_per_forward)),
                format_bytes(num("peak_pinned_host_bytes")),
                decided
            );
        }
        s += "* as planned (the route's footprint)\n";
        for c in &self.plan.components {
            if c.footprint.pageable_staging && c.footprint.pinned_limit_to_avoid_pageable > 0 {
                s += &format!(
                    "note: {} copies from pageable memory (the pinned limit is below its {} of streamed weights); \
                     --route {}=...:pinned_limit={} would avoid it\n",
                    c.component,
                    format_bytes(c.footprint.streamed_bytes_per_forward),
                    c.component,
                    c.footprint
                        .pinned_limit_to_avoid_pageable
                        .div_ceil(1 << 30)
                        .max(1)
                        .to_string()
                        + "GiB"
                );
            }
        }
        let images = self.run.image.shape().first().copied().unwrap_or(1);
        let first = self.out.first().map(|p| p.as_path());
        let kind = match first.and_then(|p| p.extension()).and_then(|e| e.to_str()) {
            Some("safetensors") if images > 1 => {
                format!("safetensors: sample and latents of {images} images")
            }
            Some("safetensors") => "safetensors: sample, latents".to_string(),
            _ if images > 1 => format!("{images} images, {}x{} PNG", self.width, self.height),
            _ => format!("{}x{} PNG", self.width, self.height),
        };
        let names: Vec<String> = self.out.iter().map(|p| p.display().to_string()).collect();
        s += &format!("\nwrote {} ({kind})", names.join(", "));
        if let Some(p) = self.save_latents {
            s += &format!(", latents to {}", p.display());
        }
        s += &format!("; total {}\n", ms(self.total));
        let laps: Vec<String> = self
            .laps
            .iter()
            .map(|(stage, t)| format!("{stage} {}", ms(*t)))
            .collect();
        s += &format!(
            "wall time: {} ({} before the first phase)\n",
            laps.join(", "),
            ms(Stopwatch::before_phases(self.laps))
        );
        s
    }
}
