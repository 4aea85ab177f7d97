//! `ddo run`: a Flux or Qwen-Image pipeline in phases (prompt encoding, denoise, decode)
//! under a preset and per-component routes, with the seed's cleanup between phases, writing
//! the image and printing each phase's route, time and peak from the handles' metrics.

mod load;
mod qwen;
mod report;

pub(crate) use load::{ComponentFiles, build_pipeline};
use report::{Guidance, Report, Stopwatch, step_seconds};

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use ddo_core::DType;
use ddo_core::FootprintContext;
use ddo_core::HostBudget;
use ddo_core::Resolution;
use ddo_metrics::format_bytes;
use ddo_nn::pipeline::{
    FluxPipeline, InitLatents, PipelineRequest, PromptEmbeds, PromptInput, QwenImageRequest,
    TiledDecode,
};
use ddo_routes::{PipelinePlan, PlanRequest, enable_planned_pipeline_offload, plan_resolved};
use serde_json::Value;

use crate::cli::RunArgs;
use crate::error::{CliError, CliResult};
use crate::family::{AnyPipeline, Family};
use crate::io::{
    HostTensor, OutputKind, encode_png, encode_safetensors, output_kind, read_optional_tensor,
    read_tensor, unpack_host,
};
use crate::outputs::{Inputs, Outputs, image_paths};
use crate::progress::ProgressBar;
use crate::setup::{
    DeviceChoice, DeviceNeeds, Explanation, Routing, check_host_budget, host_budget, open_device,
};
use crate::tokenize::PipelineTokenizers;

/// The prompt used when `--prompt` is not given.
pub const DEFAULT_PROMPT: &str = "a lighthouse on a rocky coast at dawn";

/// Where the models come from.
#[derive(Debug, Clone)]
pub(crate) enum Source {
    Config(String),
    Weights(PathBuf),
}

impl Source {
    /// The pipeline family: the config name's, or the folder's `model_index.json`'s.
    pub(crate) fn family(&self) -> CliResult<Family> {
        match self {
            Source::Config(name) => Family::of_config(name).ok_or_else(|| unknown_config(name)),
            Source::Weights(dir) => Family::of_folder(dir),
        }
    }

    /// Whether it is one of the tiny configs (for CI and the README): smaller defaults.
    pub(crate) fn is_tiny(&self) -> bool {
        matches!(self, Source::Config(n) if n == "tiny" || n == "qwen-tiny")
    }
}

fn unknown_config(name: &str) -> CliError {
    CliError::usage(
        format!("unknown config `{name}`"),
        format!("use one of: {}", Family::config_names().join(", ")),
    )
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
        && Family::of_config(name).is_none()
    {
        return Err(unknown_config(name));
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

/// The pipeline's memory plan at `height × width` under `budget` on `device` and within
/// the host budget `host`, from the components' `resolutions` (made once, by
/// [`Routing::resolve_all`]: the plan resolves nothing again). A budget no plan fits is
/// refused naming the smallest budget that plans the whole pipeline — checked by planning
/// with it, the phases' demands made again for it (the decode's tiling follows the
/// budget); a host budget no plan fits, the smallest host budget, found the same way.
pub(crate) fn plan_memory(
    pipe: &AnyPipeline,
    pipeline: &ddo_routes::Pipeline,
    resolutions: &[(String, Resolution)],
    device: &dyn ddo_core::Device,
    (budget, host): ((u64, String), HostBudget),
    image: (usize, usize, usize),
    tiled: TiledDecode,
) -> CliResult<PipelinePlan> {
    let (height, width, images) = image;
    let plan_at =
        |bytes: u64, host: HostBudget| -> CliResult<Result<PipelinePlan, ddo_core::CoreError>> {
            Ok(plan_resolved(
                pipeline,
                resolutions,
                &PlanRequest {
                    budget_bytes: bytes,
                    budget_source: budget.1.clone(),
                    phases: pipe.phase_demands(height, width, images, tiled, bytes, device)?,
                    context: FootprintContext::of(device),
                    host_budget: Some(host),
                },
            ))
        };
    let planning = |e: ddo_core::CoreError| CliError::from(e).context("planning memory");
    let refusal = match plan_at(budget.0, host)? {
        Ok(plan) => return Ok(plan),
        Err(e @ ddo_core::CoreError::BudgetTooSmall { .. }) => e,
        Err(e @ ddo_core::CoreError::HostBudgetTooSmall { .. }) => {
            return Err(planning(smallest_working_budget(e, |b| {
                plan_at(budget.0, HostBudget { bytes: b, ..host }).map(|r| r.map(|_| ()))
            })?));
        }
        Err(e) => return Err(planning(e)),
    };
    Err(planning(smallest_working_budget(refusal, |b| {
        plan_at(b, host).map(|r| r.map(|_| ()))
    })?))
}

/// The refusal of a budget (device or host), its `needed` made the smallest budget that
/// plans: each phase's least need, then planning with it, and again with what that refusal
/// names (the phases' demands may grow with the budget), at most [`BUDGET_SEARCH_ROUNDS`]
/// times. A need no round confirms is reported as the planner named it.
pub(crate) fn smallest_working_budget(
    refusal: ddo_core::CoreError,
    mut plans: impl FnMut(u64) -> CliResult<Result<(), ddo_core::CoreError>>,
) -> CliResult<ddo_core::CoreError> {
    // The need of a refusal of the same budget as `refusal` (device or host): planning
    // with a device budget may meet a host refusal, which says nothing of the device's.
    let host = matches!(refusal, ddo_core::CoreError::HostBudgetTooSmall { .. });
    let needed_of = |e: &ddo_core::CoreError| match e {
        ddo_core::CoreError::BudgetTooSmall { needed, .. } if !host => Some(*needed),
        ddo_core::CoreError::HostBudgetTooSmall { needed, .. } if host => Some(*needed),
        _ => None,
    };
    let Some(mut candidate) = needed_of(&refusal) else {
        return Ok(refusal);
    };
    for _ in 0..BUDGET_SEARCH_ROUNDS {
        match plans(candidate)? {
            Err(e) if needed_of(&e).is_some_and(|n| n > candidate) => {
                candidate = needed_of(&e).unwrap_or(candidate);
            }
            _ => break,
        }
    }
    let mut refusal = refusal;
    if let ddo_core::CoreError::BudgetTooSmall { needed, .. }
    | ddo_core::CoreError::HostBudgetTooSmall { needed, .. } = &mut refusal
    {
        *needed = candidate;
    }
    Ok(refusal)
}

/// Refuses the run's result when a weight file it read changed meanwhile (replaced, removed,
/// rewritten or truncated: [`ddo_core::CoreError::CheckpointChanged`] names the first).
pub(crate) fn check_weights_unchanged(pipeline: &ddo_routes::Pipeline) -> CliResult<()> {
    for component in pipeline.components() {
        for map in component.mapped_files() {
            map.check_unchanged()?;
        }
    }
    Ok(())
}

/// How many times [`smallest_working_budget`] plans again.
const BUDGET_SEARCH_ROUNDS: usize = 8;

/// How `routing` explains the routes the plan chose for `names`, in that order, with the
/// defaults each component's weights give its route (`pipeline`'s components).
pub(crate) fn planned_explanations(
    routing: &Routing,
    names: &[String],
    plan: &PipelinePlan,
    pipeline: &ddo_routes::Pipeline,
) -> Vec<Explanation> {
    names
        .iter()
        .filter_map(|n| plan.component(n))
        .map(|p| {
            let weights = pipeline
                .components()
                .iter()
                .find(|c| c.name() == p.component);
            routing.explain_planned(p, weights.map(|c| &**c))
        })
        .collect()
}

/// Runs `ddo run` with `argv` (after `run`), writing the profile to `out`.
pub fn run(args: &RunArgs, out: &mut dyn Write) -> CliResult<()> {
    let started = Instant::now();
    let source = source_from_args(args.config.as_deref(), args.weights.as_deref())?;
    let family = source.family()?;
    match family {
        Family::Flux => qwen::refuse_qwen_options(args)?,
        Family::QwenImage => qwen::refuse_flux_options(args)?,
    }
    let tiny = source.is_tiny();
    let dtype = args.dtype;
    let steps = args.steps.unwrap_or(family.default_steps(tiny));
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
    let true_cfg_scale = args.true_cfg_scale.unwrap_or(qwen::DEFAULT_TRUE_CFG_SCALE);
    let max_seq = args.max_sequence_length;
    let tiled_decode = args.tiled_decode.unwrap_or(TiledDecode::Auto);
    let device_choice = args.device.unwrap_or(DeviceChoice::Cpu);
    let budget = args.vram_budget;
    check_host_budget(device_choice, budget)?;
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
    let given = match (&args.prompt_embeds, family) {
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
    let prompts = given.batch();
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
    if args.prompt_embeds.is_some() && max_seq.is_some() {
        return Err(CliError::usage(
            "--max-sequence-length with --prompt-embeds",
            "--max-sequence-length sets how many tokens a text prompt is encoded to; given embeddings keep their own length: leave it out, or give --prompt",
        ));
    }
    let init = match &args.init_latents {
        Some(p) => {
            // Both names in one file are taken only when they hold the same noise (packed
            // and unpacked, as the fixtures keep it); otherwise which to use is a guess.
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
            InitLatents::Given(
                read_tensor(p, &["latents", "noise"], "--init-latents")?.to_tensor()?,
            )
        }
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

    // Outputs are checked against every path the command reads and each other, and for a
    // writable directory, before anything heavy is read or computed.
    let image_files = image_paths(&out_path, images);
    let mut output_paths: Vec<(&'static str, &std::path::Path)> =
        image_files.iter().map(|p| ("--out", p.as_path())).collect();
    if let Some(p) = &save_latents {
        output_paths.push(("--save-latents", p));
    }
    let outputs = Outputs::plan(&output_paths, &Inputs::of(&args.paths_read()))?;

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
    // Each component is resolved here, once: the device's needs, the memory plan, the
    // routes' handles and the report all carry these resolutions (ARCHITECTURE.md).
    let resolutions = routing.resolve_all(&names)?;
    let host = host_budget(args.host_budget);
    let device = open_device(
        device_choice,
        budget,
        DeviceNeeds::of(resolutions.iter().map(|(_, r)| r)).within(&host),
    )?;
    // The backend may prepare per-shape work (cuDNN plans) while the routes attach and the
    // prompt is encoded.
    pipe.prepare_attention(&*device, height, width, images)?;
    startup.lap("device");
    let (plan_budget, budget_source) = plan_budget(&*device, budget);
    let effective_budget = Some(plan_budget);
    // A budget below the largest leaf, or any other no plan fits, is refused by the plan,
    // naming the smallest budget that plans the whole pipeline.
    // Diffusers rounds the size down to whole 2x2 latent patches (and warns): so does this,
    // and the profile says so (one rule for run, bench and resolve).
    let crate::size::ImageSize {
        height,
        width,
        note: size_note,
    } = crate::size::ImageSize::of(&pipe, height, width)?;

    let (prompt, prompt_label) = match (&pipe, given) {
        (AnyPipeline::QwenImage(q), GivenEmbeds::Qwen(e)) => {
            let p = qwen::prompts(q, Some(e), args, DEFAULT_PROMPT)?;
            let label = p.label.clone();
            (Prompts::Qwen(p), label)
        }
        (AnyPipeline::QwenImage(q), _) => {
            let p = qwen::prompts(q, None, args, DEFAULT_PROMPT)?;
            let label = p.label.clone();
            (Prompts::Qwen(p), label)
        }
        (AnyPipeline::Flux(flux), given) => {
            let embeds = match given {
                GivenEmbeds::Flux(e) => Some(e),
                _ => None,
            };
            let (prompt, label) = flux_prompt(flux, embeds, args.prompt.as_deref(), &source)?;
            (Prompts::Flux(prompt), label)
        }
    };

    let pipeline = pipe.offload_pipeline()?;
    // LoRAs (issue 36): their factors go on the device now, resident for the whole run, and
    // the memory plan gets the budget less them.
    let lora_bytes = crate::lora::apply_run_loras(
        (&args.lora, args.lora_allow_unmatched, args.lora_fuse),
        &pipeline,
        &*device,
        &mut *out,
        args.json,
    )?;
    let (plan_budget, budget_source) =
        crate::lora::budget_less_loras(plan_budget, budget_source, lora_bytes);
    let plan = plan_memory(
        &pipe,
        &pipeline,
        &resolutions,
        &*device,
        ((plan_budget, budget_source), host),
        (height, width, images),
        tiled_decode,
    )?;
    let explanations = planned_explanations(&routing, &names, &plan, &pipeline);
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
    let guidance_report = match &prompt {
        Prompts::Flux(_) => Guidance::Flux(guidance),
        Prompts::Qwen(p) => {
            let (on, words) = qwen::true_cfg(true_cfg_scale, p.negative.is_some());
            Guidance::TrueCfg {
                scale: true_cfg_scale,
                on,
                words,
            }
        }
    };
    // When each denoising step's host side finished (the streaming engine keeps the host
    // within a ring of the device, so these follow the device's pace).
    let mut step_ends: Vec<Instant> = Vec::new();
    let denoise_began = Instant::now();
    let mut progress = |phase: &str, done: usize, total: usize| {
        if phase == "denoise" {
            step_ends.push(Instant::now());
        }
        bar.update(phase, done, total)
    };
    let result = match (&pipe, prompt) {
        (AnyPipeline::Flux(flux), Prompts::Flux(prompt)) => flux.run_phases(
            &mut offload,
            &PipelineRequest {
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
            },
            &mut progress,
        ),
        (AnyPipeline::QwenImage(q), Prompts::Qwen(p)) => q.run_phases(
            &mut offload,
            &QwenImageRequest {
                prompt: p.prompt,
                negative_prompt: p.negative,
                true_cfg_scale,
                steps,
                height,
                width,
                init,
                num_images,
                tiled_decode,
                vram_budget: effective_budget,
                release_native_idle_cache: args.release_native_idle,
            },
            &mut progress,
        ),
        _ => Err(ddo_core::CoreError::InvalidOption {
            option: "prompt".into(),
            value: "another family's".into(),
            hint: "the prompt was made for the other pipeline family".into(),
        }),
    };
    let step_seconds = step_seconds(denoise_began, &step_ends);
    bar.finish();
    let run = result?;
    // No image from weight files that changed while they were read (issue 35).
    check_weights_unchanged(&pipeline)?;
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
    if let (Some(_), Some(flux)) = (&save_latents, pipe.as_flux()) {
        let (h, w) = pipe.latent_grid(height, width)?;
        let unpacked = unpack_host(&HostTensor::from_tensor(&run.latents)?, h, w)?;
        let cfg = flux.vae.config();
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
        guidance: guidance_report,
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
        loras: (&args.lora, lora_bytes),
        host: report::HostUse {
            budget: host,
            peak_pinned: device.memory_info().pinned_peak,
            peak_rss: ddo_core::host_memory::process_status_bytes("VmHWM"),
            read_bytes: ddo_core::host_memory::process_read_bytes(),
        },
    };
    let text = if args.json {
        serde_json::to_string_pretty(&report.json()).unwrap_or_default() + "\n"
    } else {
        report.human()
    };
    out.write_all(text.as_bytes())
        .map_err(|e| CliError::runtime(format!("cannot write the profile: {e}"), ""))
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
enum GivenEmbeds {
    /// None given.
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

/// The prompt of a run, as its family takes it.
enum Prompts {
    /// A Flux prompt.
    Flux(PromptInput),
    /// A Qwen-Image prompt and negative prompt.
    Qwen(qwen::QwenPrompts),
}

/// The prompt of a Flux run: the embeddings file's, or text through the folder's tokenizer
/// files (or the stand-in), and how the profile names it.
fn flux_prompt(
    pipe: &FluxPipeline,
    embeds: Option<PromptEmbeds>,
    text: Option<&str>,
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
            let text = text.unwrap_or(DEFAULT_PROMPT).to_string();
            let files = match source {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Copies the `flux_pipeline` fixture folder into `dir` (the weights a test may change).
    fn copy_fixture(dir: &Path) {
        let from = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/flux_pipeline");
        for entry in walk(&from) {
            let rel = entry.strip_prefix(&from).unwrap();
            let to = dir.join(rel);
            std::fs::create_dir_all(to.parent().unwrap()).unwrap();
            std::fs::copy(&entry, &to).unwrap();
        }
    }

    fn walk(d: &Path) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                out.extend(walk(&p));
            } else {
                out.push(p);
            }
        }
        out
    }

    /// Issue 35: a weight file replaced, rewritten or removed after the pipeline mapped it is
    /// refused before any output, naming the file; unchanged files pass.
    #[test]
    fn a_weight_file_changed_under_the_run_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        copy_fixture(dir.path());
        let load = || {
            let (pipe, _) = build_pipeline(
                &Source::Weights(dir.path().to_path_buf()),
                &ComponentFiles::default(),
                None,
                None,
                unused_weights(true),
                &mut ProgressBar::new(),
            )
            .unwrap();
            pipe.offload_pipeline().unwrap()
        };
        let pipeline = load();
        check_weights_unchanged(&pipeline).unwrap();
        let vae = walk(&dir.path().join("vae"))
            .into_iter()
            .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .unwrap();
        // Replaced by a copy of itself: another inode.
        let copy = dir.path().join("copy.safetensors");
        std::fs::copy(&vae, &copy).unwrap();
        std::fs::rename(&copy, &vae).unwrap();
        let e = check_weights_unchanged(&pipeline).unwrap_err().to_string();
        assert!(
            e.contains(&vae.display().to_string()) && e.contains("replaced"),
            "{e}"
        );
        drop(pipeline);
        // Touched in place, then removed.
        let pipeline = load();
        std::fs::File::options()
            .write(true)
            .open(&vae)
            .unwrap()
            .set_modified(std::time::SystemTime::UNIX_EPOCH)
            .unwrap();
        let e = check_weights_unchanged(&pipeline).unwrap_err().to_string();
        assert!(e.contains("was modified while DDO read it"), "{e}");
        std::fs::remove_file(&vae).unwrap();
        let e = check_weights_unchanged(&pipeline).unwrap_err().to_string();
        assert!(e.contains("was removed"), "{e}");
    }
}
