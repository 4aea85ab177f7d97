//! `ddo bench`: one component of the pipeline under several routes or presets, in one
//! process, with the same workload: per candidate, a fresh attachment (and, on the host
//! backend, a fresh device), its inputs made once and held on the device, warm-up forwards,
//! then timed forwards. Prints a table — time
//! median/min/max, peak device memory (exact), bytes streamed per forward, and the ratio to
//! the link floor (streamed bytes / the host→device bandwidth measured first, in the same
//! process) — and writes JSON with `--json` / `--out-json`; `--plot PREFIX` draws time
//! against peak memory to `PREFIX.svg` and `PREFIX.png` ([`crate::plot`]). The files are
//! checked before any work and written whole at the end ([`crate::outputs`]); a workload
//! whose activations do not fit the budget, or more than [`MAX_FORWARDS`] forwards, is
//! refused before anything is allocated.

use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use ddo_core::{DType, Device, Preset, RouteSpec, RouteTarget, Settings, Tensor, ops_of};
use ddo_metrics::format_bytes;
use ddo_nn::flux::{FluxInputs, latent_image_ids};
use ddo_nn::pipeline::{FluxPipeline, QwenImagePipeline, TiledDecode, gaussian_noise};
use ddo_nn::qwen_image::QwenImageInputs;
use ddo_nn::qwen_text::QwenTextInputs;
use ddo_routes::{
    Pipeline, PlanRequest, enable_pipeline_offload_with_env, enable_planned_pipeline_offload,
    plan_pipeline,
};
use serde::Serialize;

use crate::cli::BenchArgs;
use crate::error::{CliError, CliResult};
use crate::family::AnyPipeline;
use crate::outputs::{Inputs, Outputs};
use crate::progress::ProgressBar;
use crate::run::{ComponentFiles, build_pipeline, source_from_args};
use crate::setup::{DeviceChoice, DeviceNeeds, check_budget, host_budget, open_device};
use crate::size::ImageSize;

pub mod report;

/// The candidates when none are given: every route, group offload in its three shapes.
const DEFAULT_ROUTES: [&str; 5] = [
    "none",
    "diffusers_group_offload:offload_type=leaf_level,use_stream=false",
    "diffusers_group_offload:offload_type=leaf_level,use_stream=true",
    "diffusers_group_offload:offload_type=block_level,num_blocks_per_group=1,use_stream=true",
    "linear_convolution",
];

/// One candidate's figures.
#[derive(Debug, Clone, Serialize)]
pub struct CandidateResult {
    /// `--route` or `--preset` text.
    pub label: String,
    /// The route and options that ran.
    pub route: String,
    /// Timed forwards, seconds.
    pub seconds: Vec<f64>,
    /// Median of `seconds`.
    pub median_seconds: f64,
    /// Minimum.
    pub min_seconds: f64,
    /// Maximum.
    pub max_seconds: f64,
    /// Device peak during the timed forwards (allocator, exact).
    pub peak_bytes: u64,
    /// Host→device bytes per timed forward.
    pub streamed_bytes_per_forward: u64,
    /// Bytes read from the disk per timed forward (the staged units past the route's
    /// `page_cache_limit`).
    pub disk_bytes_per_forward: u64,
    /// The floor: the larger of `streamed / link bandwidth` and, where the disk was
    /// measured (`--weights`), `disk bytes / the disk's best measured rate`, seconds.
    pub floor_seconds: f64,
    /// `median / floor` (none when nothing streams).
    pub ratio_to_floor: Option<f64>,
    /// `median /` the bench's compute floor (none where it was not measured).
    pub ratio_to_compute_floor: Option<f64>,
    /// Floating-point operations of one forward, counted by the op profiler on the first
    /// candidate that ran (and on every one with `--profile`; none where the device keeps no
    /// per-op profile).
    pub flops_per_forward: Option<u64>,
    /// The forward's linear call with the most flops.
    pub largest_linear: Option<ddo_core::GemmShape>,
    /// Why the candidate did not run.
    pub error: Option<String>,
    /// The last timed forward's timeline, added up (`--timeline`, streamed candidates).
    pub timeline: Option<ddo_metrics::TimelineSummary>,
    /// Seconds the candidate's attach took (a pinned home, registrations, resident uploads).
    pub setup_seconds: f64,
    /// The route's pinned host bytes at their peak.
    pub peak_pinned_host_bytes: u64,
    /// Device time per op class of one more forward (`--profile`, where the device keeps
    /// one).
    pub op_profile: Option<ddo_core::OpProfile>,
    /// This process's host memory right after the timed forwards, with the candidate still
    /// attached (`/proc/self/status`; `None` where it cannot be read).
    pub host_memory: Option<HostMemory>,
    /// Median seconds from a timed forward's start to the host having queued all of it
    /// (its `seconds` wait for the device too): near `median_seconds`, the host's own work
    /// set the step; far below, the device did.
    pub median_enqueued_seconds: Option<f64>,
    /// FNV-1a of the last timed forward's output bytes (hex): candidates that compute the
    /// same thing bit for bit (every route of one component, on one device) show the same.
    pub output_fnv1a: Option<String>,
    /// What lossless-coded streaming held (`compress=lossless`): coded size, exponent
    /// entropy, the cache, host pages released.
    pub coded: Option<ddo_metrics::CodedFigures>,
    /// `--lora` without `--lora-fuse`: changing the candidate's LoRAs with its route attached.
    pub lora_switch: Option<LoraSwitch>,
}

/// A LoRA switch between two runs of one process (issue 36): the `--lora` files read again
/// (timed on their own: a warm process keeps the files it has read), then set at half their
/// strengths on the attached component ([`ddo_nn::lora::apply_loras`]: every factor scaled,
/// encoded and uploaded), timed to the end of the upload.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LoraSwitch {
    /// Seconds reading and checking the files (`LoraFile::open`).
    pub read_seconds: f64,
    /// Seconds from the files read to the factors on the device: the switch.
    pub seconds: f64,
    /// The factors' device bytes.
    pub bytes: u64,
    /// Issue 36's bound: 0.1 s plus the bytes over the link at its measured rate.
    pub bound_seconds: f64,
}

/// A process's resident host memory, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct HostMemory {
    /// `VmRSS`: every resident page.
    pub rss_bytes: u64,
    /// `RssAnon`: anonymous pages (owned copies, pinned homes).
    pub anon_bytes: u64,
    /// `RssFile`: pages of mapped files (checkpoint mappings).
    pub file_bytes: u64,
    /// `RssShmem`: shared memory pages.
    pub shmem_bytes: u64,
    /// Bytes the allocator has handed out (glibc's `mallinfo2`; `None` elsewhere): DDO's
    /// own heap inside the anonymous pages, the rest being the libraries' and the driver's
    /// mappings.
    pub heap_bytes: Option<u64>,
}

impl HostMemory {
    /// This process's figures now, from one read of `/proc/self/status` (read field by
    /// field, another thread's pages made the parts add up to more than the whole: the
    /// `bench_compares_routes_in_one_process` flake).
    pub fn now() -> Option<Self> {
        let [rss, anon, file, shmem] = ddo_core::host_memory::process_status_snapshot([
            "VmRSS", "RssAnon", "RssFile", "RssShmem",
        ]);
        Some(Self {
            rss_bytes: rss?,
            anon_bytes: anon.unwrap_or(0),
            file_bytes: file.unwrap_or(0),
            shmem_bytes: shmem.unwrap_or(0),
            heap_bytes: ddo_core::host_memory::heap_in_use(),
        })
    }
}

enum Candidate {
    Route(String, RouteSpec),
    Preset(Preset),
}

impl Candidate {
    fn label(&self) -> String {
        match self {
            Candidate::Route(text, _) => text.clone(),
            Candidate::Preset(p) => format!("preset {p}"),
        }
    }

    /// The settings a route candidate attaches with (`timeline=true` added to streamed
    /// routes when `timeline`).
    fn settings(&self, component: &str, timeline: bool) -> Settings {
        match self {
            Candidate::Route(_, spec) => {
                let mut s = Settings::default();
                let streams = ddo_routes::streams(spec);
                let spec = if timeline && streams && spec.options().timeline.is_none() {
                    RouteSpec::new(
                        spec.target(),
                        ddo_core::RouteOptions {
                            timeline: Some(true),
                            ..*spec.options()
                        },
                    )
                    .unwrap_or(*spec)
                } else {
                    *spec
                };
                s.component_policies.insert(component.to_string(), spec);
                s
            }
            Candidate::Preset(p) => Settings {
                preset: *p,
                ..Settings::default()
            },
        }
    }

    fn native(&self, component: &str) -> bool {
        let spec = match self {
            Candidate::Route(_, s) => *s,
            Candidate::Preset(p) => ddo_core::resolve::preset_default(
                *p,
                &ddo_core::ComponentKind::from_name(component),
            ),
        };
        ddo_routes::needs_native_allocator(&spec)
    }
}

/// The component's forward with a fixed workload.
struct Workload<'a> {
    pipe: &'a AnyPipeline,
    component: String,
    height: usize,
    width: usize,
}

impl Workload<'_> {
    fn component(&self) -> CliResult<Arc<ddo_core::Component>> {
        self.pipe.component(&self.component).ok_or_else(|| {
            CliError::usage(
                format!("this pipeline has no component `{}`", self.component),
                format!("components: {}", self.pipe.component_names().join(", ")),
            )
        })
    }

    /// The workload's inputs, made once per candidate and held on `device` before the
    /// timed forwards (as the Diffusers side of the peer bench holds them on the GPU), so
    /// a forward times the component, not building noise on the host or uploading it.
    fn prepare(&self, device: &dyn Device) -> ddo_core::Result<Prepared> {
        match self.pipe {
            AnyPipeline::Flux(p) => self.prepare_flux(p, device),
            AnyPipeline::QwenImage(p) => self.prepare_qwen(p, device),
        }
    }

    /// [`Workload::prepare`] for a Qwen-Image component: the transformer over one image's
    /// packed latents and [`QWEN_BENCH_TEXT_TOKENS`] text tokens (one pass of a step; true
    /// CFG runs two), the text encoder over a prompt's template of as many ids, the VAE over
    /// one image's latents.
    fn prepare_qwen(
        &self,
        p: &QwenImagePipeline,
        device: &dyn Device,
    ) -> ddo_core::Result<Prepared> {
        let ops = ops_of(device)?;
        let on_device = |shape: Vec<usize>, dtype: DType, values: &[f32]| {
            Tensor::from_f32(shape, dtype, values)?.to_device(device, &device.compute_stream())
        };
        let text = QWEN_BENCH_TEXT_TOKENS;
        Ok(match self.component.as_str() {
            "transformer" => {
                let c = p.transformer.config();
                let (h, w) = p.latent_grid(self.height, self.width)?;
                let (rows, cols) = (h / 2, w / 2);
                let tokens = rows * cols;
                Prepared::QwenTransformer(Box::new(QwenImageInputs {
                    hidden_states: on_device(
                        vec![1, tokens, c.in_channels],
                        p.transformer_dtype(),
                        &gaussian_noise(1, tokens * c.in_channels),
                    )?,
                    encoder_hidden_states: on_device(
                        vec![1, text, c.joint_attention_dim],
                        p.transformer_dtype(),
                        &gaussian_noise(2, text * c.joint_attention_dim),
                    )?,
                    encoder_hidden_states_mask: None,
                    timestep: vec![0.5],
                    img_shapes: vec![[1, rows, cols]],
                }))
            }
            "vae" => {
                let (h, w) = p.latent_grid(self.height, self.width)?;
                let c = p.vae.config().z_dim;
                Prepared::Latents(ops.tensor_from_f32(
                    &[1, c, h, w],
                    DType::F32,
                    &gaussian_noise(4, c * h * w),
                )?)
            }
            "text_encoder" => {
                let Some(e) = &p.text_encoder else {
                    return Err(no_text_encoder());
                };
                let vocab = e.config().vocab_size.max(1) as u32;
                let ids = (0..(text + ddo_nn::qwen_text::PROMPT_TEMPLATE_START_IDX) as u32)
                    .map(|i| i.wrapping_mul(2_654_435_761) % vocab)
                    .collect();
                Prepared::QwenTokens(QwenTextInputs::single(ids))
            }
            other => {
                return Err(ddo_core::CoreError::InvalidOption {
                    option: "component".into(),
                    value: other.into(),
                    hint: "use transformer, vae or text_encoder".into(),
                });
            }
        })
    }

    /// [`Workload::prepare`] for a Flux component.
    fn prepare_flux(&self, p: &FluxPipeline, device: &dyn Device) -> ddo_core::Result<Prepared> {
        let ops = ops_of(device)?;
        let on_device = |shape: Vec<usize>, dtype: DType, values: &[f32]| {
            Tensor::from_f32(shape, dtype, values)?.to_device(device, &device.compute_stream())
        };
        Ok(match self.component.as_str() {
            "transformer" => {
                let c = p.transformer.config();
                let (h, w) = p.latent_grid(self.height, self.width)?;
                let img_ids = latent_image_ids(h / 2, w / 2);
                let tokens = img_ids.len();
                let text = p.max_sequence_length;
                let noise = |n: usize, seed: u64| gaussian_noise(seed, n);
                Prepared::Transformer(Box::new(FluxInputs {
                    hidden_states: on_device(
                        vec![1, tokens, c.in_channels],
                        p.transformer_dtype(),
                        &noise(tokens * c.in_channels, 1),
                    )?,
                    // In the model's dtype, as the pipeline's text encoders hand them over
                    // (and as the peer bench holds them): a forward casts nothing.
                    encoder_hidden_states: on_device(
                        vec![1, text, c.joint_attention_dim],
                        p.transformer_dtype(),
                        &noise(text * c.joint_attention_dim, 2),
                    )?,
                    pooled_projections: on_device(
                        vec![1, c.pooled_projection_dim],
                        p.transformer_dtype(),
                        &noise(c.pooled_projection_dim, 3),
                    )?,
                    timestep: vec![0.5],
                    guidance: c.guidance_embeds.then(|| vec![3.5]),
                    img_ids,
                    txt_ids: vec![[0.0; 3]; text],
                }))
            }
            "vae" => {
                let (h, w) = p.latent_grid(self.height, self.width)?;
                let c = p.vae.config().latent_channels;
                Prepared::Latents(ops.tensor_from_f32(
                    &[1, c, h, w],
                    DType::F32,
                    &gaussian_noise(4, c * h * w),
                )?)
            }
            "text_encoder" | "text_encoder_2" => {
                let (clip_ids, t5_ids) = p.stand_in_tokens("a photo of a cat")?;
                Prepared::Tokens(if self.component == "text_encoder" {
                    clip_ids
                } else {
                    t5_ids
                })
            }
            other => {
                return Err(ddo_core::CoreError::InvalidOption {
                    option: "component".into(),
                    value: other.into(),
                    hint: "use transformer, vae, text_encoder or text_encoder_2".into(),
                });
            }
        })
    }

    /// One forward of the component on `inputs`, synchronised.
    fn forward(&self, device: &dyn Device, inputs: &Prepared) -> ddo_core::Result<()> {
        drop(self.output(device, inputs)?);
        Ok(())
    }

    /// One forward over `inputs`, its output kept (on the device), after the device is
    /// synchronised.
    fn output(&self, device: &dyn Device, inputs: &Prepared) -> ddo_core::Result<Tensor> {
        let out = self.enqueue(device, inputs)?;
        device.synchronize()?;
        Ok(out)
    }

    /// One forward over `inputs`, its output kept, as soon as the host has queued it (the
    /// device may still be running it).
    fn enqueue(&self, device: &dyn Device, inputs: &Prepared) -> ddo_core::Result<Tensor> {
        let out: Tensor = match (self.pipe, inputs) {
            (AnyPipeline::Flux(p), Prepared::Transformer(inputs)) => {
                p.transformer.forward(device, inputs)?
            }
            (AnyPipeline::Flux(p), Prepared::Latents(lat)) => {
                p.vae.decode(Some(device), lat, None)?
            }
            (AnyPipeline::QwenImage(p), Prepared::QwenTransformer(inputs)) => {
                p.transformer.forward(device, inputs)?
            }
            (AnyPipeline::QwenImage(p), Prepared::Latents(lat)) => {
                p.vae.decode(device, lat, None)?
            }
            (AnyPipeline::QwenImage(p), Prepared::QwenTokens(ids)) => match &p.text_encoder {
                Some(e) => e.forward(device, ids)?,
                None => return Err(no_text_encoder()),
            },
            (AnyPipeline::Flux(p), Prepared::Tokens(ids)) => {
                match (self.component.as_str(), &p.clip, &p.t5) {
                    ("text_encoder", Some(c), _) => c.forward(device, ids)?.pooler_output,
                    ("text_encoder_2", _, Some(t)) => t.forward(device, ids)?,
                    _ => return Err(no_text_encoder()),
                }
            }
            _ => {
                return Err(ddo_core::CoreError::InvalidOption {
                    option: "component".into(),
                    value: self.component.clone(),
                    hint: "inputs prepared for another pipeline family".into(),
                });
            }
        };
        Ok(out)
    }
}

/// A workload's inputs, on the device.
enum Prepared {
    Transformer(Box<FluxInputs>),
    QwenTransformer(Box<QwenImageInputs>),
    Latents(Tensor),
    Tokens(Vec<u32>),
    QwenTokens(QwenTextInputs),
}

/// Text tokens of a Qwen-Image transformer or text encoder bench forward: a prompt of a
/// few dozen words after the template's dropped tokens (its length varies with the
/// prompt; the image's 4,096 tokens at 1024x1024 dominate the transformer's work).
pub const QWEN_BENCH_TEXT_TOKENS: usize = 64;

fn no_text_encoder() -> ddo_core::CoreError {
    ddo_core::CoreError::InvalidOption {
        option: "component".into(),
        value: "text_encoder".into(),
        hint: "this pipeline has no text encoders: bench the transformer or the vae".into(),
    }
}

/// Host→device bandwidth of `device`, bytes per second, as a streamed forward sees it: the
/// best of `LINK_TRIALS` trials, each `LINK_PASSES` back-to-back passes over a pinned
/// buffer of `bytes`, copied in `LINK_CHUNK` pieces and synchronised once. One copy of a
/// few hundred MiB timed with its own synchronisation read 2-3% under what the streamed
/// route then sustained on the same machine (an H200 host: 53.7 GB/s against 54.8), which
/// made every floor ratio look better than it was.
pub fn link_bandwidth(device: &dyn Device, bytes: usize) -> ddo_core::Result<f64> {
    let src = device.alloc_pinned(bytes)?;
    let dst = device.alloc(bytes)?;
    let stream = device.compute_stream();
    let chunks: Vec<(usize, usize)> = (0..bytes)
        .step_by(LINK_CHUNK)
        .map(|at| (at, LINK_CHUNK.min(bytes - at)))
        .collect();
    // One pass first: the first touch of the buffers is not the link.
    device.copy_h2d(&src.slice_all(), &dst.slice_all(), &stream)?;
    device.synchronize_stream(&stream)?;
    let mut best = f64::MAX;
    for _ in 0..LINK_TRIALS {
        let t0 = Instant::now();
        for _ in 0..LINK_PASSES {
            for &(at, len) in &chunks {
                device.copy_h2d(&src.slice(at, len)?, &dst.slice(at, len)?, &stream)?;
            }
        }
        device.synchronize_stream(&stream)?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    Ok((bytes * LINK_PASSES) as f64 / best.max(1e-9))
}

/// Seconds `disk_bytes` take at the best rate the disk probes measured (0 without a probe
/// or without disk bytes): the disk term of a candidate's floor.
fn disk_floor(disk_bytes: u64, probes: &[ddo_core::disk::DiskRate]) -> f64 {
    let rate = probes.iter().map(|d| d.bytes_per_sec).fold(0.0, f64::max);
    if disk_bytes == 0 || rate <= 0.0 {
        0.0
    } else {
        disk_bytes as f64 / rate
    }
}

/// The most bytes a disk probe reads: 2 GiB (about a second at a consumer NVMe's rate).
const DISK_PROBE_BYTES: u64 = 2 << 30;

/// Threads of the second disk probe (an NVMe serves several reads at once).
const DISK_READERS: usize = 4;

/// Trials of [`link_bandwidth`]; the best counts.
const LINK_TRIALS: usize = 3;
/// Passes over the buffer per trial (2 GiB per trial at the largest buffer).
const LINK_PASSES: usize = 8;
/// The size of each copy, about a streamed unit's.
const LINK_CHUNK: usize = 64 << 20;

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => 0.0,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// The most `--repeats` (and `--warmup`) forwards `ddo bench` runs: a larger count is a
/// typo, and its timing vector alone could not be allocated.
pub const MAX_FORWARDS: usize = 1_000_000;

/// `--repeats`/`--warmup` (`name`) at most [`MAX_FORWARDS`].
fn forwards(name: &str, n: usize) -> CliResult<usize> {
    if n > MAX_FORWARDS {
        return Err(CliError::usage(
            format!("--{name} {n}: more than {MAX_FORWARDS} forwards"),
            format!("give at most {MAX_FORWARDS}; a few forwards give a stable median"),
        ));
    }
    Ok(n)
}

fn candidates(args: &BenchArgs) -> CliResult<Vec<Candidate>> {
    let mut out = Vec::new();
    for r in &args.route {
        let spec: RouteSpec = ddo_routes::parse_spec(r).map_err(|e: ddo_core::CoreError| {
            CliError::usage(
                format!("--route {r}: {e}"),
                "write ROUTE or ROUTE:key=value,...",
            )
        })?;
        out.push(Candidate::Route(r.clone(), spec));
    }
    for p in &args.preset {
        out.push(Candidate::Preset(*p));
    }
    if out.is_empty() {
        for r in DEFAULT_ROUTES {
            out.push(Candidate::Route(r.to_string(), ddo_routes::parse_spec(r)?));
        }
    }
    Ok(out)
}

/// Runs `ddo bench` with its parsed options.
pub fn bench(args: &BenchArgs, out: &mut dyn Write) -> CliResult<()> {
    let source = source_from_args(args.config.as_deref(), args.weights.as_deref())?;
    let tiny = source.is_tiny();
    let dtype = args.compute.unwrap_or_default().weights_dtype(args.dtype)?;
    let side = if tiny { 128 } else { 1024 };
    let asked = (args.height.unwrap_or(side), args.width.unwrap_or(side));
    let repeats = forwards("repeats", args.repeats.unwrap_or(5))?;
    let warmup = forwards("warmup", args.warmup.unwrap_or(1))?;
    let device_choice = args.device.unwrap_or(DeviceChoice::Cpu);
    let budget = args.vram_budget;
    crate::setup::check_host_budget(device_choice, budget)?;
    device_choice.prepare_kernels();
    let list = candidates(args)?;
    let out_json = args.out_json.clone();
    let plot_prefix = args.plot.clone();
    let plot_paths = plot_prefix.as_deref().map(crate::plot::paths).transpose()?;
    // Outputs are checked against the weights and each other before any work.
    let mut output_paths: Vec<(&'static str, &std::path::Path)> = Vec::new();
    if let Some(p) = &out_json {
        output_paths.push(("--out-json", p));
    }
    if let Some((svg, png)) = &plot_paths {
        output_paths.push(("--plot", svg));
        output_paths.push(("--plot", png));
    }
    let outputs = Outputs::plan(&output_paths, &Inputs::of(&args.paths_read()))?;

    let mut bar = ProgressBar::new();
    let benched = args
        .component
        .clone()
        .unwrap_or_else(|| "transformer".to_string());
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
        None,
        crate::run::unused_weights(args.allow_unused_weights),
        // Random weights for the benched component alone: the others are never run.
        Some(&benched),
        &mut bar,
    )?;
    // Rounded to whole latent patches as `ddo run` rounds it, and said so.
    let size = ImageSize::of(&pipe, asked.0, asked.1)?;
    let (height, width) = (size.height, size.width);
    let workload = Workload {
        pipe: &pipe,
        component: benched,
        height,
        width,
    };
    let component = workload.component()?;
    // `--compute fp8`: its E4M3 linears in fp8 on every candidate.
    component.set_fp8_compute(args.compute == Some(crate::cli::values::Compute::Fp8));

    // A CUDA device is opened once and shared; the host backend gets a fresh one per
    // candidate (its allocator kind is fixed at creation).
    // Pinned memory is scarce for the whole run when a candidate is `wsl_compat`.
    let host = host_budget(args.host_budget);
    let scarce_pinned = list
        .iter()
        .any(|c| matches!(c, Candidate::Preset(p) if p.resolved() == Preset::WslCompat));
    let shared = match device_choice {
        DeviceChoice::Cuda(_) => Some(open_device(
            device_choice,
            budget,
            DeviceNeeds {
                native_allocator: false,
                scarce_pinned,
                pinned_limit: Some(host.pinned_room()),
            },
        )?),
        DeviceChoice::Cpu => None,
    };
    let device_for = |native: bool| -> CliResult<Arc<dyn Device>> {
        match &shared {
            Some(d) => Ok(Arc::clone(d)),
            None => open_device(
                DeviceChoice::Cpu,
                budget,
                DeviceNeeds {
                    native_allocator: native,
                    scarce_pinned,
                    pinned_limit: Some(host.pinned_room()),
                },
            ),
        }
    };
    let probe = device_for(false)?;
    let capacity = probe.memory_info().capacity;
    if let Some(b) = budget.or((capacity > 0).then_some(capacity)) {
        check_budget(b, std::slice::from_ref(&component))?;
    }
    let link_bytes = (component.param_bytes() as usize).clamp(1 << 20, 256 << 20);
    let bandwidth = link_bandwidth(&*probe, link_bytes)?;
    // The disk's read rate for the component's files, cold, as the link's: one reader and
    // DISK_READERS (none for weights made in memory).
    let disk_files: Vec<std::path::PathBuf> = component
        .mapped_files()
        .iter()
        .map(|m| m.path().to_path_buf())
        .collect();
    let disk = if disk_files.is_empty() {
        Vec::new()
    } else {
        [1, DISK_READERS]
            .into_iter()
            .map(|readers| {
                ddo_core::disk::probe_read_rate(&disk_files, DISK_PROBE_BYTES, readers)
                    .map_err(|e| CliError::from(e).context("measuring the disk"))
            })
            .collect::<CliResult<Vec<_>>>()?
    };
    // Preset candidates run as the memory plan sizes them for this component's phase.
    let (plan_budget, budget_source) = crate::run::plan_budget(&*probe, budget);
    // The VAE workload decodes untiled (`Workload::forward`).
    let demand = pipe
        .phase_demands(height, width, 1, TiledDecode::Off, plan_budget, &*probe)?
        .into_iter()
        .find(|d| d.components.iter().any(|c| c == component.name()))
        .map(|mut d| {
            d.components = vec![component.name().to_string()];
            d
        });
    // A workload whose activations alone exceed the budget is refused before its inputs
    // are made (they could not be allocated).
    if let Some(d) = &demand
        && d.activation_bytes > plan_budget
    {
        return Err(CliError::usage(
            format!(
                "the {} workload at {width}x{height} px needs about {} of activations; the budget ({budget_source}) is {}",
                component.name(),
                format_bytes(d.activation_bytes),
                format_bytes(plan_budget)
            ),
            "give a smaller --height/--width or a larger --vram-budget",
        ));
    }
    let context = ddo_core::FootprintContext::of(&*probe);
    drop(probe);
    let timeline = args.timeline;
    let profile = args.profile;

    // Candidates are explicit: the environment is never read (use_environment is false).
    let env = ddo_core::MapEnvironment::default();
    let name = component.name().to_string();
    // `--lora`: read once, applied to the component on each candidate's device.
    let loras = crate::lora::read_loras(&args.lora, args.lora_allow_unmatched)?;
    let lora_refs: Vec<(&ddo_nn::lora::LoraFile, f32)> =
        loras.iter().map(|(f, s)| (f, *s)).collect();
    let mut results: Vec<CandidateResult> = Vec::new();
    for (k, cand) in list.iter().enumerate() {
        // Every candidate computes the same forward: one counted forward makes the floor.
        let count = results.iter().all(|r| r.flops_per_forward.is_none());
        bar.update("bench", k, list.len());
        let label = cand.label();
        let outcome = (|| -> CliResult<CandidateResult> {
            let device = device_for(cand.native(&name))?;
            if !lora_refs.is_empty() {
                ddo_nn::lora::apply_loras(&component, &lora_refs, &*device)?;
                component.set_adapter_fusion(args.lora_fuse);
            }
            let pipeline = Pipeline::new(vec![Arc::clone(&component)])?;
            let attach_started = std::time::Instant::now();
            let mut offload = match (cand, &demand) {
                (Candidate::Preset(p), Some(demand)) => {
                    let plan = plan_pipeline(
                        &pipeline,
                        &Settings {
                            preset: *p,
                            ..Settings::default()
                        },
                        &[],
                        &env,
                        &PlanRequest {
                            budget_bytes: plan_budget,
                            budget_source: budget_source.clone(),
                            phases: vec![demand.clone()],
                            context,
                            host_budget: Some(host),
                        },
                    )?;
                    let mut offload =
                        enable_planned_pipeline_offload(&pipeline, Arc::clone(&device), &plan)?;
                    offload.begin_phase(&[name.as_str()])?;
                    offload
                }
                _ => enable_pipeline_offload_with_env(
                    &pipeline,
                    Arc::clone(&device),
                    &cand.settings(&name, timeline),
                    &env,
                )?,
            };
            let setup_seconds = attach_started.elapsed().as_secs_f64();
            let route = offload.handle(&name)?.spec().describe();
            // Left unmanaged (preset `off`: DDO attaches nothing), the component runs as
            // `pipe.to(device)` leaves it and as `ddo run` runs it: its weights moved to the
            // device first, and back to the host after (the next candidate starts from the
            // host).
            let unmanaged = offload.handle(&name)?.target() == RouteTarget::Unmanaged;
            let mut op_profile = None;
            let mut counted = None;
            let mut host_memory = None;
            let mut enqueued = Vec::with_capacity(repeats);
            let mut output_fnv1a = None;
            let run = (|| -> ddo_core::Result<(Vec<f64>, u64, u64)> {
                if unmanaged {
                    component.to_device(&*device, &device.compute_stream())?;
                }
                let inputs = workload.prepare(&*device)?;
                for _ in 0..warmup {
                    workload.forward(&*device, &inputs)?;
                }
                // What the warm-up started preparing (cuDNN plans) is ready before timing.
                if warmup > 0 {
                    device.settle(std::time::Duration::from_secs(60))?;
                }
                let before = offload.handle(&name)?.metrics_snapshot().counters.h2d_bytes;
                device.reset_peak();
                let mut seconds = Vec::with_capacity(repeats);
                let mut last = None;
                for i in 0..repeats {
                    let t0 = Instant::now();
                    let out = workload.enqueue(&*device, &inputs)?;
                    enqueued.push(t0.elapsed().as_secs_f64());
                    device.synchronize()?;
                    seconds.push(t0.elapsed().as_secs_f64());
                    // Only the last forward's output is kept (the others go at once).
                    last = (i + 1 == repeats).then_some(out);
                }
                if let Some(out) = last {
                    let bytes = out.to_host_bytes(&*device, &device.compute_stream())?;
                    output_fnv1a = Some(format!("{:016x}", ddo_core::param::fnv1a(&bytes)));
                }
                let peak = device.memory_info().peak_allocated;
                host_memory = HostMemory::now();
                let after = offload.handle(&name)?.metrics_snapshot().counters.h2d_bytes;
                // One more forward through the op profiler: its flops and largest linear
                // make the compute floor (the first candidate that counts one); its table is
                // shown with --profile.
                if (profile || count) && device.begin_op_profile() {
                    let forward = workload.forward(&*device, &inputs);
                    let ended = device.end_op_profile();
                    forward?;
                    let ended = ended?;
                    counted = ended.as_ref().map(|p| {
                        (
                            p.classes.iter().map(|c| c.flops).sum::<u64>(),
                            p.largest_linear,
                        )
                    });
                    op_profile = ended.filter(|_| profile);
                }
                Ok((seconds, peak, (after - before) / repeats as u64))
            })();
            // A LoRA switch with the route attached (a folded resident copy cannot switch:
            // it reattaches).
            let lora_switch = if !lora_refs.is_empty() && !args.lora_fuse && run.is_ok() {
                let t0 = Instant::now();
                let files = crate::lora::read_loras(&args.lora, args.lora_allow_unmatched)?;
                let read_seconds = t0.elapsed().as_secs_f64();
                let halves: Vec<(&ddo_nn::lora::LoraFile, f32)> =
                    files.iter().map(|(f, s)| (f, s * 0.5)).collect();
                let t1 = Instant::now();
                let bytes = ddo_nn::lora::apply_loras(&component, &halves, &*device)?;
                Some(LoraSwitch {
                    read_seconds,
                    seconds: t1.elapsed().as_secs_f64(),
                    bytes,
                    bound_seconds: 0.1 + bytes as f64 / bandwidth,
                })
            } else {
                None
            };
            let snapshot = offload.handle(&name).ok().map(|h| h.metrics_snapshot());
            let traced = snapshot
                .as_ref()
                .and_then(|m| m.timeline.as_ref())
                .map(|t| t.summary(5));
            let coded = snapshot.as_ref().and_then(|m| m.coded.clone());
            let disk_bytes = snapshot
                .as_ref()
                .map_or(0, |m| m.counters.disk_bytes_per_forward);
            let peak_pinned_host_bytes = snapshot.map_or(0, |m| m.counters.peak_pinned_host_bytes);
            let back = if unmanaged {
                component.to_host()
            } else {
                Ok(())
            };
            let _ = offload.release(&name);
            let (seconds, peak, streamed) = run?;
            back?;
            let med = median(&seconds);
            let floor = (streamed as f64 / bandwidth).max(disk_floor(disk_bytes, &disk));
            Ok(CandidateResult {
                label: label.clone(),
                route,
                median_seconds: med,
                min_seconds: seconds.iter().copied().fold(f64::MAX, f64::min),
                max_seconds: seconds.iter().copied().fold(0.0, f64::max),
                seconds,
                peak_bytes: peak,
                streamed_bytes_per_forward: streamed,
                disk_bytes_per_forward: disk_bytes,
                floor_seconds: floor,
                ratio_to_floor: (streamed > 0).then(|| med / floor.max(1e-12)),
                ratio_to_compute_floor: None,
                flops_per_forward: counted.map(|c| c.0),
                largest_linear: counted.and_then(|c| c.1),
                error: None,
                timeline: traced,
                setup_seconds,
                peak_pinned_host_bytes,
                op_profile,
                host_memory,
                median_enqueued_seconds: (!enqueued.is_empty()).then(|| median(&enqueued)),
                output_fnv1a,
                coded,
                lora_switch,
            })
        })();
        results.push(outcome.unwrap_or_else(|e| CandidateResult {
            label,
            route: String::new(),
            seconds: Vec::new(),
            median_seconds: 0.0,
            min_seconds: 0.0,
            max_seconds: 0.0,
            peak_bytes: 0,
            streamed_bytes_per_forward: 0,
            disk_bytes_per_forward: 0,
            floor_seconds: 0.0,
            ratio_to_floor: None,
            ratio_to_compute_floor: None,
            flops_per_forward: None,
            largest_linear: None,
            error: Some(e.message),
            timeline: None,
            setup_seconds: 0.0,
            peak_pinned_host_bytes: 0,
            op_profile: None,
            host_memory: None,
            median_enqueued_seconds: None,
            output_fnv1a: None,
            coded: None,
            lora_switch: None,
        }));
    }
    bar.finish();
    // `--compute fp8`: whether the device ran the linears on fp8 tensor cores or ran the
    // reference implementation.
    let compute = args.compute.unwrap_or_default();
    let (fp8_tensor_cores, fp8_reference_reason) = match compute {
        crate::cli::values::Compute::Fp8 => {
            let d = device_for(false)?;
            let native = d.ops().is_some_and(|o| o.fp8_tensor_cores());
            let why = (!native).then(|| {
                d.ops()
                    .map_or_else(|| "no compute plane".into(), |o| o.fp8_reference_reason())
            });
            (Some(native), why)
        }
        crate::cli::values::Compute::Bf16 => (None, None),
    };
    // The compute floor: the first counted forward's flops over the device's GEMM rate at
    // its largest linear, measured now (every candidate released).
    // A floor that cannot be measured (its GEMM's operands do not fit the budget, say) is
    // reported as such; the candidates' figures stand without it.
    let (compute_floor, compute_floor_error) = match results
        .iter()
        .find_map(|r| Some((r.flops_per_forward?, r.largest_linear?)))
    {
        Some((flops, gemm)) if flops > 0 => {
            match device_for(false).and_then(|d| {
                crate::compute_floor::measure(
                    &*d,
                    flops,
                    gemm,
                    compute == crate::cli::values::Compute::Fp8,
                )
            }) {
                Ok(floor) => {
                    for r in results.iter_mut().filter(|r| r.error.is_none()) {
                        r.ratio_to_compute_floor =
                            Some(r.median_seconds / floor.seconds.max(1e-12));
                    }
                    (Some(floor), None)
                }
                Err(e) => (None, Some(e.message)),
            }
        }
        _ => (None, None),
    };
    // The last candidate's adapters go with its device.
    if !lora_refs.is_empty() {
        component.set_adapter_fusion(false);
        component.set_adapters(Default::default())?;
    }

    let device_label = match device_choice {
        DeviceChoice::Cpu => "host (a fresh host device per candidate)".to_string(),
        DeviceChoice::Cuda(n) => format!("cuda:{n}"),
    };
    let report = report::BenchReport {
        command: "bench",
        model: model_label,
        component: name,
        device: device_label,
        height,
        width,
        size_note: size.note,
        repeats,
        warmup,
        link_bytes_per_sec: bandwidth,
        compute_floor,
        compute_floor_error,
        compute: compute.as_str(),
        fp8_tensor_cores,
        fp8_reference_reason,
        disk,
        candidates: results,
    };
    let json_text = serde_json::to_string_pretty(&report).unwrap_or_default() + "\n";
    // Every file is made before any is written: all of them or none.
    let mut files: Vec<(&'static str, Vec<u8>)> = Vec::new();
    if out_json.is_some() {
        files.push(("--out-json", json_text.clone().into_bytes()));
    }
    if plot_paths.is_some() {
        let (svg, png) = crate::plot::render_plot(
            &format!("ddo bench: {} on {}", report.component, report.device),
            &report.candidates,
        )?;
        files.push(("--plot", svg.into_bytes()));
        files.push(("--plot", png));
    }
    outputs.commit(&files)?;
    let plotted = plot_paths;
    let text = if args.json {
        json_text
    } else {
        report.format_text(profile, out_json.as_deref(), plotted.as_ref())
    };
    out.write_all(text.as_bytes())
        .map_err(|e| CliError::runtime(format!("cannot write: {e}"), ""))
}
