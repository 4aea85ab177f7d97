//! A loaded pipeline that makes images on request (issue 38): what `ddo run` makes its
//! images with, once, and what `ddo serve` keeps warm across requests, so that the two
//! cannot drift apart.
//!
//! [`Session::load`] reads the weights, resolves every component's route once, opens the
//! device, applies the LoRAs and checks the routes' options; [`Session::generate`] plans
//! memory for the request's size (kept while the size, the image count, the decode tiling
//! and the LoRAs stay the same), attaches the routes the plan chose, runs the three phases
//! with the seed's cleanup between them, and hands back the image, the plan and each
//! route's metrics. Between requests the session holds the weights, the tokenizers, the
//! resolutions and the last plan; each request attaches and releases its routes, so a
//! failed request leaves nothing on the device for the next one.
//!
//! [`Request`] is what one request asks for, with `ddo run`'s defaults and checks
//! ([`Request::check`]: steps, image count, initial noise), the same for both callers.

mod request;

pub use request::{Checked, Request};
pub(crate) use request::{GivenEmbeds, Prompts, flux_prompt};

use std::sync::Arc;
use std::time::Instant;

use ddo_core::{DType, Device, HostBudget, Preset, Resolution};
use ddo_nn::pipeline::{PipelineRequest, PipelineRun, QwenImageRequest, TiledDecode};
use ddo_routes::{PipelinePlan, enable_planned_pipeline_offload};
use serde_json::Value;

use crate::cli::LoraArg;
use crate::error::{CliError, CliResult};
use crate::family::{AnyPipeline, Family};
use crate::progress::ProgressBar;
use crate::run::report::Stopwatch;
use crate::run::{
    ComponentFiles, Source, build_pipeline, check_weights_unchanged, plan_budget, plan_memory,
    planned_explanations, unused_weights,
};
use crate::setup::{
    DeviceChoice, DeviceNeeds, Explanation, Routing, check_host_budget, host_budget, open_device,
};
use crate::tokenize::PipelineTokenizers;

/// The share of the device budget one warm-up linear may take (operands and product:
/// [`ddo_core::Device::prepare_linears`]); FLUX.1-dev's largest at 1024x1024 takes 169 MiB.
const WARM_UP_BUDGET_SHARE: u64 = 16;

/// What a [`Session`] loads: the model, its routes, the device, the budgets and the LoRAs
/// (`ddo run`'s and `ddo serve`'s loading options).
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// `--config NAME` or `--weights DIR`.
    pub(crate) source: Source,
    /// `--transformer`, `--text-encoder`, `--text-encoder-2`, `--vae`.
    pub(crate) files: ComponentFiles,
    /// `--dtype` (E4M3 under `--compute fp8`).
    pub dtype: Option<DType>,
    /// `--compute`.
    pub compute: crate::cli::values::Compute,
    /// `--max-sequence-length`.
    pub max_sequence_length: Option<usize>,
    /// `--allow-unused-weights`.
    pub allow_unused_weights: bool,
    /// `--preset`.
    pub preset: Option<Preset>,
    /// `--route COMPONENT=ROUTE[:k=v,...]`.
    pub routes: Vec<String>,
    /// `--no-env`.
    pub no_env: bool,
    /// `--host-budget`.
    pub host_budget: Option<u64>,
    /// `--device`.
    pub device: DeviceChoice,
    /// `--vram-budget`.
    pub vram_budget: Option<u64>,
    /// `--lora FILE[:STRENGTH]` (applied at load).
    pub loras: Vec<LoraArg>,
    /// `--lora-allow-unmatched`.
    pub lora_allow_unmatched: bool,
    /// `--lora-fuse`.
    pub lora_fuse: bool,
}

impl LoadOptions {
    /// The loading options `load`, with `loras` applied at load
    /// (`--lora-allow-unmatched`, `--lora-fuse`).
    pub fn of(
        load: &crate::cli::LoadArgs,
        (loras, lora_allow_unmatched, lora_fuse): (&[LoraArg], bool, bool),
    ) -> CliResult<Self> {
        Ok(Self {
            source: crate::run::source_from_args(load.config.as_deref(), load.weights.as_deref())?,
            files: ComponentFiles {
                text_encoder: load.text_encoder.clone(),
                transformer: load.transformer.clone(),
                text_encoder_2: load.text_encoder_2.clone(),
                vae: load.vae.clone(),
            },
            dtype: load.compute.unwrap_or_default().weights_dtype(load.dtype)?,
            compute: load.compute.unwrap_or_default(),
            max_sequence_length: load.max_sequence_length,
            allow_unused_weights: load.allow_unused_weights,
            preset: load.preset,
            routes: load.route.clone(),
            no_env: load.no_env,
            host_budget: load.host_budget,
            device: load.device.unwrap_or(DeviceChoice::Cpu),
            vram_budget: load.vram_budget,
            loras: loras.to_vec(),
            lora_allow_unmatched,
            lora_fuse,
        })
    }

    /// The pipeline family the source holds.
    pub fn family(&self) -> CliResult<Family> {
        self.source.family()
    }

    /// Whether the source is a tiny config (smaller defaults).
    pub fn is_tiny(&self) -> bool {
        self.source.is_tiny()
    }
}

/// What a [`Session`] is told while it loads and generates: each step, and the plan before
/// the phases run.
pub trait Observer {
    /// The memory plan a request runs under, once its routes passed their preflight; an
    /// error stops the request before its phases.
    fn planned(&mut self, plan: &PipelinePlan) -> CliResult<()> {
        let _ = plan;
        Ok(())
    }

    /// `done` of `total` in `phase` (`prompt_encoding`, `denoise`, `decode`).
    fn progress(&mut self, phase: &str, done: usize, total: usize) {
        let _ = (phase, done, total);
    }

    /// A flag that, once set, stops the request at its next step boundary (a client
    /// went away); `None`: it runs to its end.
    fn cancel_flag(&self) -> Option<Arc<std::sync::atomic::AtomicBool>> {
        None
    }
}

/// The memory plan of one request shape, kept while the shape stays the same.
struct Planned {
    /// (height, width, images, decode tiling, LoRA bytes) it was made for.
    key: (usize, usize, usize, TiledDecode, u64),
    plan: Arc<PipelinePlan>,
    explanations: Arc<Vec<Explanation>>,
}

/// A loaded pipeline ready for requests (module docs).
pub struct Session {
    source: Source,
    pipe: AnyPipeline,
    model_label: String,
    names: Vec<String>,
    routing: Routing,
    resolutions: Vec<(String, Resolution)>,
    host: HostBudget,
    device: Arc<dyn Device>,
    vram_budget: Option<u64>,
    pipeline: ddo_routes::Pipeline,
    /// The folder's tokenizer files (Flux), read at the first text prompt.
    tokenizers: Option<Option<PipelineTokenizers>>,
    /// The LoRAs applied now and their factors' device bytes.
    loras: (Vec<LoraArg>, u64),
    lora_allow_unmatched: bool,
    planned: Option<Planned>,
    /// Whether the host memory the routes hand back stays pinned between requests, for the
    /// next request to reuse ([`Session::keep_host_between_requests`]).
    keep_host: bool,
    /// Wall time of the load by stage (`weights`, `device`).
    laps: Vec<(&'static str, f64)>,
}

/// What [`Session::generate`] made: the images and latents on the host, and what the
/// report of the request says.
pub struct Generated {
    /// The phases' result (image, latents, phases, decode plan, timesteps).
    pub run: PipelineRun,
    /// The memory plan it ran under.
    pub plan: Arc<PipelinePlan>,
    /// Each component's route explained, in the pipeline's order.
    pub explanations: Arc<Vec<Explanation>>,
    /// Each component's route metrics (JSON), in the same order.
    pub snapshots: Vec<Value>,
    /// Seconds of each denoising step (the first counts from the denoise phase's start).
    pub step_seconds: Vec<f64>,
    /// The size made (rounded to whole latent patches) and why it differs from the one
    /// asked for.
    pub size: (usize, usize, Option<String>),
    /// How the report names the prompt.
    pub prompt_label: String,
    /// Whether a negative prompt was given (Qwen-Image's true CFG runs only with one).
    pub negative_prompt: bool,
    /// The request with its defaults filled in.
    pub request: Checked,
    /// Wall time by stage (`plan`, `attach`, `phases`).
    pub laps: Vec<(&'static str, f64)>,
    /// Host ranges page-locked during the request ([`Device::host_registrations`]): 0 when
    /// every registration was one the session kept from the request before.
    ///
    /// [`Device::host_registrations`]: ddo_core::Device::host_registrations
    pub registrations: u64,
    /// Bytes the process read from storage during the request (`/proc/self/io`), where
    /// known.
    pub read_bytes: Option<u64>,
    /// The host memory the routes gave back being unpinned (joined by
    /// [`Generated::finish_unpinning`]).
    unpinning: Option<std::thread::JoinHandle<()>>,
}

impl Generated {
    /// Waits for the host memory the routes gave back to be unpinned.
    pub fn finish_unpinning(&mut self) {
        if let Some(t) = self.unpinning.take() {
            // A panic there was printed by the hook; the memory goes with the process.
            let _ = t.join();
        }
    }
}

impl Drop for Generated {
    fn drop(&mut self) {
        self.finish_unpinning();
    }
}

impl Session {
    /// Loads `options`: the weights (with `bar` showing it), the routes resolved once, the
    /// device, the LoRAs (said on `out` unless `json`).
    pub fn load(
        options: &LoadOptions,
        bar: &mut ProgressBar,
        out: &mut dyn std::io::Write,
        json: bool,
    ) -> CliResult<Self> {
        let mut laps = Stopwatch::new(Instant::now());
        check_host_budget(options.device, options.vram_budget)?;
        options.device.prepare_kernels();
        let (pipe, model_label) = build_pipeline(
            &options.source,
            &options.files.clone().checked()?,
            options.dtype,
            options.max_sequence_length,
            unused_weights(options.allow_unused_weights),
            None,
            bar,
        )?;
        laps.lap("weights");
        let names = pipe.component_names();
        let routing = Routing::new(options.preset, &options.routes, options.no_env, &names)?;
        // Each component is resolved here, once: the device's needs, the memory plan, the
        // routes' handles and the report all carry these resolutions (ARCHITECTURE.md).
        let resolutions = routing.resolve_all(&names)?;
        let host = host_budget(options.host_budget);
        let device = open_device(
            options.device,
            options.vram_budget,
            DeviceNeeds::of(resolutions.iter().map(|(_, r)| r)).within(&host),
        )?;
        laps.lap("device");
        let pipeline = pipe.offload_pipeline()?;
        crate::run::set_compute(options.compute, &pipeline, &*device, out, json);
        // LoRAs (issue 36): their factors go on the device now, resident while they are
        // applied, and the memory plan gets the budget less them.
        let lora_bytes = crate::lora::apply_run_loras(
            (
                &options.loras,
                options.lora_allow_unmatched,
                options.lora_fuse,
            ),
            &pipeline,
            &*device,
            out,
            json,
        )?;
        Ok(Self {
            source: options.source.clone(),
            pipe,
            model_label,
            names,
            routing,
            resolutions,
            host,
            device,
            vram_budget: options.vram_budget,
            pipeline,
            tokenizers: None,
            loras: (options.loras.clone(), lora_bytes),
            lora_allow_unmatched: options.lora_allow_unmatched,
            planned: None,
            keep_host: false,
            laps: laps.laps,
        })
    }

    /// Keeps the host memory the routes hand back at the end of a request pinned for the next
    /// one (`ddo serve`): the registrations of the weights' ranges are reused, so a request
    /// after the first pins nothing again. Not where the plan gives host memory back
    /// ([`PipelinePlan::gives_host_back`]: the budget cannot hold it all at once). Off by
    /// default: `ddo run` unpins beside its output's encoding.
    pub fn keep_host_between_requests(&mut self, keep: bool) {
        self.keep_host = keep;
    }

    /// The pipeline family.
    pub fn family(&self) -> Family {
        match self.pipe {
            AnyPipeline::Flux(_) => Family::Flux,
            AnyPipeline::QwenImage(_) => Family::QwenImage,
        }
    }

    /// Whether the source is a tiny config (smaller defaults).
    pub fn is_tiny(&self) -> bool {
        self.source.is_tiny()
    }

    /// How the report names the model.
    pub fn model_label(&self) -> &str {
        &self.model_label
    }

    /// The execution device.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    /// The host budget the plans are made within.
    pub fn host_budget(&self) -> HostBudget {
        self.host
    }

    /// The load's wall time by stage (`weights`, `device`).
    pub fn load_laps(&self) -> &[(&'static str, f64)] {
        &self.laps
    }

    /// The LoRAs applied now and their factors' device bytes.
    pub fn loras(&self) -> (&[LoraArg], u64) {
        (&self.loras.0, self.loras.1)
    }

    /// The last plan made, if any (what a request of the same shape reuses).
    pub fn last_plan(&self) -> Option<&Arc<PipelinePlan>> {
        self.planned.as_ref().map(|p| &p.plan)
    }

    /// Applies `loras` in place of the ones applied now (none: the base weights), unless
    /// they are the same: the factors are read and put on the device, the next request
    /// plans with the budget less them. A file that does not fit is refused before any
    /// component changes.
    pub fn set_loras(&mut self, loras: &[LoraArg]) -> CliResult<()> {
        let same = loras.len() == self.loras.0.len()
            && loras
                .iter()
                .zip(&self.loras.0)
                .all(|(a, b)| a.path == b.path && a.strength.to_bits() == b.strength.to_bits());
        if same {
            return Ok(());
        }
        let files = crate::lora::read_loras(loras, self.lora_allow_unmatched)?;
        let refs: Vec<(&ddo_nn::lora::LoraFile, f32)> =
            files.iter().map(|(f, s)| (f, *s)).collect();
        let (bytes, _) = ddo_nn::lora::set_pipeline_loras(
            &self.pipeline,
            &refs,
            &*self.device,
            self.lora_allow_unmatched,
        )?;
        self.loras = (loras.to_vec(), bytes);
        Ok(())
    }

    /// Runs `request` (checked against this session's family with [`Request::check`]):
    /// plans (or reuses the plan of the same shape), attaches the routes, runs the phases,
    /// checks the weight files did not change meanwhile.
    pub fn generate(
        &mut self,
        request: &Request,
        observer: &mut dyn Observer,
    ) -> CliResult<Generated> {
        let checked = request.check(self.family(), self.is_tiny())?;
        let mut laps = Stopwatch::new(Instant::now());
        let (registrations_before, read_before) = (
            self.device.host_registrations(),
            ddo_core::host_memory::process_read_bytes(),
        );
        // Diffusers rounds the size down to whole 2x2 latent patches (and warns): so does
        // this, and the profile says so (one rule for run, bench and resolve).
        let crate::size::ImageSize {
            height,
            width,
            note: size_note,
        } = crate::size::ImageSize::of(&self.pipe, checked.height, checked.width)?;
        let (prompt, prompt_label) = self.prompts(request)?;
        let negative_prompt = matches!(&prompt, Prompts::Qwen(p) if p.negative.is_some());
        let images = checked.images;
        let key = (height, width, images, checked.tiled_decode, self.loras.1);
        if self.planned.as_ref().is_none_or(|p| p.key != key) {
            // Another size: the backend's plans for the last one go (a server holds the
            // plans of the size it runs, not of every size it ran).
            if let Some(last) = &self.planned
                && (last.key.0, last.key.1, last.key.2) != (height, width, images)
            {
                self.device.forget_shape_plans()?;
            }
            self.planned = None;
            // What the last request's plan kept pinned goes now, while the device is idle:
            // another plan registers other ranges, and a copy from pages partly locked by a
            // kept registration is refused (CUDA_ERROR_INVALID_VALUE).
            self.device.unpin_released();
            // The backend may prepare per-shape work (cuDNN plans) while the routes attach
            // and the prompt is encoded.
            self.pipe
                .prepare_attention(&*self.device, checked.height, checked.width, images)?;
            let (plan_budget, budget_source) = plan_budget(&*self.device, self.vram_budget);
            let (plan_budget, budget_source) =
                crate::lora::budget_less_loras(plan_budget, budget_source, self.loras.1);
            let plan = plan_memory(
                &self.pipe,
                &self.pipeline,
                &self.resolutions,
                &*self.device,
                ((plan_budget, budget_source), self.host),
                (height, width, images),
                checked.tiled_decode,
            )?;
            // A size the plan takes: the transformer's GEMM kernels load now, while nothing
            // is queued, not inside the denoise phase's first forward (each call within a
            // sixteenth of the budget).
            laps.lap("memory_plan");
            self.pipe.prepare_first_forward(
                &*self.device,
                (checked.height, checked.width, images),
                plan_budget / WARM_UP_BUDGET_SHARE,
            )?;
            laps.lap("warm_up");
            let plan = if checked.timeline {
                plan.with_timelines()
                    .map_err(|e| CliError::from(e).context("--timeline"))?
            } else {
                plan
            };
            let explanations =
                planned_explanations(&self.routing, &self.names, &plan, &self.pipeline);
            self.planned = Some(Planned {
                key,
                plan: Arc::new(plan),
                explanations: Arc::new(explanations),
            });
        }
        let Some(planned) = &self.planned else {
            return Err(CliError::runtime("no memory plan", "this is a bug in ddo"));
        };
        let (plan, explanations) = (Arc::clone(&planned.plan), Arc::clone(&planned.explanations));
        // Every route's preflight runs here, before the plan is shown: a refusal is the
        // whole output.
        let mut offload =
            enable_planned_pipeline_offload(&self.pipeline, self.device.clone(), &plan)
                .map_err(|e| CliError::from(e).context("attaching routes"))?;
        observer.planned(&plan)?;
        laps.lap("plan");
        laps.lap("attach");
        let effective_budget = Some(plan_budget(&*self.device, self.vram_budget).0);
        // When each denoising step's host side finished (the streaming engine keeps the
        // host within a ring of the device, so these follow the device's pace).
        let mut step_ends: Vec<Instant> = Vec::new();
        let denoise_began = Instant::now();
        let cancel = observer.cancel_flag();
        let mut progress = |phase: &str, done: usize, total: usize| {
            if phase == "denoise" {
                step_ends.push(Instant::now());
            }
            observer.progress(phase, done, total);
        };
        let result = match (&self.pipe, prompt) {
            (AnyPipeline::Flux(flux), Prompts::Flux(prompt)) => flux.run_phases(
                &mut offload,
                &PipelineRequest {
                    prompt,
                    steps: checked.steps,
                    guidance: checked.guidance,
                    height,
                    width,
                    init: checked.init.clone(),
                    num_images: checked.num_images,
                    tiled_decode: checked.tiled_decode,
                    vram_budget: effective_budget,
                    release_native_idle_cache: checked.release_native_idle,
                    cancel: cancel.clone(),
                },
                &mut progress,
            ),
            (AnyPipeline::QwenImage(q), Prompts::Qwen(p)) => q.run_phases(
                &mut offload,
                &QwenImageRequest {
                    prompt: p.prompt,
                    negative_prompt: p.negative,
                    true_cfg_scale: checked.true_cfg_scale,
                    steps: checked.steps,
                    height,
                    width,
                    init: checked.init.clone(),
                    num_images: checked.num_images,
                    tiled_decode: checked.tiled_decode,
                    vram_budget: effective_budget,
                    release_native_idle_cache: checked.release_native_idle,
                    cancel: cancel.clone(),
                },
                &mut progress,
            ),
            _ => Err(ddo_core::CoreError::InvalidOption {
                option: "prompt".into(),
                value: "another family's".into(),
                hint: "the prompt was made for the other pipeline family".into(),
            }),
        };
        let step_seconds = crate::run::step_seconds(denoise_began, &step_ends);
        let run = result?;
        // No image from weight files that changed while they were read (issue 35).
        check_weights_unchanged(&self.pipeline)?;
        laps.lap("phases");
        // Host memory the routes handed back (`Device::release_host`) is unpinned now that
        // the device is idle, beside the output's encoding, unless the next request reuses it.
        let unpinning = (!self.keep_host || plan.gives_host_back()).then(|| {
            let device = Arc::clone(&self.device);
            std::thread::spawn(move || {
                device.unpin_released();
            })
        });
        let registrations = self
            .device
            .host_registrations()
            .saturating_sub(registrations_before);
        let read_bytes = ddo_core::host_memory::process_read_bytes()
            .zip(read_before)
            .map(|(after, before)| after.saturating_sub(before));
        let snapshots: Vec<Value> = self
            .names
            .iter()
            .map(|n| {
                offload
                    .handle(n)
                    .map(|h| serde_json::to_value(h.metrics_snapshot()).unwrap_or(Value::Null))
                    .unwrap_or(Value::Null)
            })
            .collect();
        Ok(Generated {
            run,
            plan,
            explanations,
            snapshots,
            step_seconds,
            size: (height, width, size_note),
            prompt_label,
            negative_prompt,
            request: checked,
            laps: laps.laps,
            registrations,
            read_bytes,
            unpinning,
        })
    }

    /// Flux's latents of `run` (made at `height × width`) as a VAE takes them: unpacked and
    /// unscaled (`--save-latents`); `None` for Qwen-Image.
    pub fn unscaled_latents(
        &self,
        run: &PipelineRun,
        height: usize,
        width: usize,
    ) -> CliResult<Option<crate::io::HostTensor>> {
        let Some(flux) = self.pipe.as_flux() else {
            return Ok(None);
        };
        let (h, w) = self.pipe.latent_grid(height, width)?;
        let unpacked =
            crate::io::unpack_host(&crate::io::HostTensor::from_tensor(&run.latents)?, h, w)?;
        let cfg = flux.vae.config();
        let (sf, shift) = (
            cfg.scaling_factor as f32,
            cfg.shift_factor.unwrap_or(0.0) as f32,
        );
        Ok(Some(crate::io::HostTensor {
            shape: unpacked.shape.clone(),
            values: unpacked.values.iter().map(|v| v / sf + shift).collect(),
        }))
    }

    /// The request's prompts as the family takes them, and how the report names them.
    fn prompts(&mut self, request: &Request) -> CliResult<(Prompts, String)> {
        let default = crate::run::DEFAULT_PROMPT;
        match &self.pipe {
            AnyPipeline::QwenImage(q) => {
                let embeds = match &request.embeds {
                    GivenEmbeds::Qwen(e) => Some(e.clone()),
                    _ => None,
                };
                let p = crate::run::qwen_prompts(
                    q,
                    embeds,
                    request.prompt.as_deref(),
                    request.negative_prompt.as_deref(),
                    default,
                )?;
                let label = p.label.clone();
                Ok((Prompts::Qwen(p), label))
            }
            AnyPipeline::Flux(flux) => {
                let embeds = match &request.embeds {
                    GivenEmbeds::Flux(e) => Some(e.clone()),
                    _ => None,
                };
                // The tokenizer files are read once, at the first text prompt.
                if embeds.is_none() && self.tokenizers.is_none() {
                    self.tokenizers = Some(match &self.source {
                        Source::Weights(dir) => PipelineTokenizers::load(dir)?,
                        Source::Config(_) => None,
                    });
                }
                let tokenizers = self.tokenizers.as_ref().and_then(Option::as_ref);
                let (prompt, label) = flux_prompt(
                    flux,
                    embeds,
                    request.prompt.as_deref(),
                    tokenizers,
                    &self.source,
                )?;
                Ok((Prompts::Flux(prompt), label))
            }
        }
    }
}
