//! `ddo run`: a Flux or Qwen-Image pipeline in phases (prompt encoding, denoise, decode)
//! under a preset and per-component routes, with the seed's cleanup between phases, writing
//! the image and printing each phase's route, time and peak from the handles' metrics.

mod load;
pub(crate) mod qwen;
pub(crate) mod report;

pub(crate) use load::{ComponentFiles, build_pipeline};
pub(crate) use report::step_seconds;
use report::{Guidance, Report, Stopwatch};

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use ddo_core::DType;
use ddo_core::FootprintContext;
use ddo_core::HostBudget;
use ddo_core::Resolution;
use ddo_metrics::format_bytes;
use ddo_nn::pipeline::TiledDecode;
use ddo_routes::{PipelinePlan, PlanRequest, plan_resolved};

use crate::cli::RunArgs;
use crate::error::{CliError, CliResult};
use crate::family::{AnyPipeline, Family};
use crate::io::{HostTensor, OutputKind, encode_png, encode_safetensors, output_kind};
use crate::outputs::{Inputs, Outputs, image_paths};
use crate::progress::ProgressBar;
use crate::session::{LoadOptions, Observer, Request, Session};
use crate::setup::{DeviceChoice, Explanation, Routing, check_host_budget};

/// The prompt used when `--prompt` is not given.
pub const DEFAULT_PROMPT: &str = "a lighthouse on a rocky coast at dawn";

/// Where the models come from.
#[derive(Debug, Clone)]
pub enum Source {
    /// `--config NAME`: random weights at a named config.
    Config(String),
    /// `--weights DIR`: a Diffusers pipeline folder.
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
/// `--compute`: under fp8, every component's linears with E4M3 weights run in fp8
/// ([`ddo_core::Component::set_fp8_compute`]); said once on `out` (on stderr with `--json`):
/// how many linears, and, on a device without fp8 tensor cores, that the reference
/// implementation runs.
pub(crate) fn set_compute(
    compute: crate::cli::values::Compute,
    pipeline: &ddo_routes::Pipeline,
    device: &dyn ddo_core::Device,
    out: &mut dyn Write,
    json: bool,
) {
    let fp8 = compute == crate::cli::values::Compute::Fp8;
    let mut by_component = Vec::new();
    for c in pipeline.components() {
        c.set_fp8_compute(fp8);
        let linears = c
            .leaves()
            .iter()
            .filter(|l| l.kind() == ddo_core::LeafKind::Linear)
            .filter(|l| {
                l.params()
                    .iter()
                    .any(|(n, p)| n == "weight" && p.dtype() == DType::F8E4M3)
            })
            .count();
        if linears > 0 {
            by_component.push(format!("{} {linears}", c.name()));
        }
    }
    if !fp8 {
        return;
    }
    let native = device.ops().is_some_and(|o| o.fp8_tensor_cores());
    let mut note = format!(
        "--compute fp8: the linears with E4M3 weights run in fp8 ({}; weights of another dtype \
         were stored as E4M3 at load; the other linears compute in bf16)",
        if by_component.is_empty() {
            "none".to_string()
        } else {
            by_component.join(", ")
        }
    );
    if !native {
        let why = device
            .ops()
            .map_or_else(|| "no compute plane".into(), |o| o.fp8_reference_reason());
        note.push_str(&format!(
            "; on {} DDO's reference implementation runs ({why}): the same numbers, at the \
             host's speed",
            device.id()
        ));
    }
    if json {
        eprintln!("{note}");
    } else {
        let _ = writeln!(out, "{note}");
    }
}

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

/// Runs `ddo run` with `argv` (after `run`), writing the profile to `out`: a
/// [`Session`] loaded and one request made, its outputs written all or none.
pub fn run(args: &RunArgs, out: &mut dyn Write) -> CliResult<()> {
    let started = Instant::now();
    let options = LoadOptions::of(
        &args.load,
        (&args.lora, args.lora_allow_unmatched, args.lora_fuse),
    )?;
    let family = options.family()?;
    match family {
        Family::Flux => qwen::refuse_qwen_options(args)?,
        Family::QwenImage => qwen::refuse_flux_options(args)?,
    }
    let device_choice = args.load.device.unwrap_or(DeviceChoice::Cpu);
    check_host_budget(device_choice, args.load.vram_budget)?;
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
    let request = Request::of_run(args, family)?;
    let checked = request.check(family, options.is_tiny())?;
    if request.has_embeds() && args.load.max_sequence_length.is_some() {
        return Err(CliError::usage(
            "--max-sequence-length with --prompt-embeds",
            "--max-sequence-length sets how many tokens a text prompt is encoded to; given embeddings keep their own length: leave it out, or give --prompt",
        ));
    }

    // Outputs are checked against every path the command reads and each other, and for a
    // writable directory, before anything heavy is read or computed.
    let image_files = image_paths(&out_path, checked.images);
    let mut output_paths: Vec<(&'static str, &std::path::Path)> =
        image_files.iter().map(|p| ("--out", p.as_path())).collect();
    if let Some(p) = &save_latents {
        output_paths.push(("--save-latents", p));
    }
    let outputs = Outputs::plan(&output_paths, &Inputs::of(&args.paths_read()))?;

    let mut bar = ProgressBar::new();
    let load_began = Instant::now();
    let mut session = Session::load(&options, &mut bar, &mut *out, args.json)?;
    let mut observer = RunObserver {
        bar: &mut bar,
        out: &mut *out,
        json: args.json,
    };
    let generated = session.generate(&request, &mut observer);
    bar.finish();
    let mut generated = generated?;
    let (height, width, _) = generated.size.clone();
    let run = &generated.run;

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
    if save_latents.is_some()
        && let Some(unscaled) = session.unscaled_latents(run, height, width)?
    {
        files.push((
            "--save-latents",
            encode_safetensors(&[("latents", &unscaled)])?,
        ));
    }
    outputs.commit(&files)?;
    // The outputs are written: a panic while unpinning (printed by the panic hook) cannot
    // change them, and the process is about to let go of that memory anyway.
    generated.finish_unpinning();

    // The stages: the load's (its first counting from the command's start) and the
    // request's, then the output.
    let mut laps: Vec<(&'static str, f64)> = session.load_laps().to_vec();
    if let Some(first) = laps.first_mut() {
        first.1 += load_began.duration_since(started).as_secs_f64();
    }
    laps.extend(generated.laps.iter().copied());
    let mut stopwatch = Stopwatch::new(Instant::now());
    stopwatch.lap("output");
    laps.extend(stopwatch.laps);
    let total = started.elapsed().as_secs_f64();
    let report = profile(
        &session,
        &generated,
        (&image_files, save_latents.as_ref()),
        &laps,
        total,
        args.load.vram_budget,
    );
    let text = if args.json {
        serde_json::to_string_pretty(&report.json()).unwrap_or_default() + "\n"
    } else {
        report.human()
    };
    out.write_all(text.as_bytes())
        .map_err(|e| CliError::runtime(format!("cannot write the profile: {e}"), ""))
}

/// The profile of `generated`, made by `session` (`ddo run` prints it; `ddo serve` answers
/// with its JSON): the files the images went to, the stages' `laps`, the `total` seconds.
pub(crate) fn profile<'a>(
    session: &'a Session,
    generated: &'a crate::session::Generated,
    (out, save_latents): (&'a [PathBuf], Option<&'a PathBuf>),
    laps: &'a [(&'static str, f64)],
    total: f64,
    vram_budget: Option<u64>,
) -> Report<'a> {
    let c = &generated.request;
    let guidance = match session.family() {
        Family::Flux => Guidance::Flux(c.guidance),
        Family::QwenImage => {
            let (on, words) = qwen::true_cfg(c.true_cfg_scale, generated.negative_prompt);
            Guidance::TrueCfg {
                scale: c.true_cfg_scale,
                on,
                words,
            }
        }
    };
    let device = session.device();
    let (height, width, size_note) = &generated.size;
    Report {
        model: session.model_label(),
        device: device.id().to_string(),
        budget: Some(plan_budget(&**device, vram_budget).0),
        height: *height,
        width: *width,
        size_note: size_note.as_deref(),
        steps: c.steps,
        guidance,
        seed: c.seed,
        prompt: &generated.prompt_label,
        explanations: &generated.explanations,
        plan: &generated.plan,
        run: &generated.run,
        snapshots: &generated.snapshots,
        out,
        save_latents,
        laps,
        step_seconds: &generated.step_seconds,
        total,
        loras: session.loras(),
        host: report::HostUse {
            budget: session.host_budget(),
            peak_pinned: device.memory_info().pinned_peak,
            peak_rss: ddo_core::host_memory::process_status_bytes("VmHWM"),
            read_bytes: ddo_core::host_memory::process_read_bytes(),
        },
    }
}

/// `ddo run`'s [`Observer`]: the progress bar, and the plan printed before the phases
/// (unless `--json`).
struct RunObserver<'a> {
    bar: &'a mut ProgressBar,
    out: &'a mut dyn Write,
    json: bool,
}

impl Observer for RunObserver<'_> {
    fn planned(&mut self, plan: &PipelinePlan) -> CliResult<()> {
        if self.json {
            return Ok(());
        }
        self.out
            .write_all(plan.format_text().as_bytes())
            .map_err(|e| CliError::runtime(format!("cannot write the profile: {e}"), ""))
    }

    fn progress(&mut self, phase: &str, done: usize, total: usize) {
        self.bar.update(phase, done, total);
    }
}

/// The prompts of a Qwen-Image request: the embeddings', or text (the prompt and negative
/// prompt, `default_prompt` without one) through the folder's tokenizer or the stand-in.
pub(crate) fn qwen_prompts(
    pipe: &ddo_nn::pipeline::QwenImagePipeline,
    embeds: Option<qwen::QwenEmbedsFile>,
    prompt: Option<&str>,
    negative: Option<&str>,
    default_prompt: &str,
) -> CliResult<qwen::QwenPrompts> {
    qwen::prompts(pipe, embeds, prompt, negative, default_prompt)
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
                None,
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
