//! Soak: many cycles of attach → forward → phase boundary → remove, for every route
//! configuration, on any device, with the memory figures after the first and the last
//! cycle. `cargo xtask soak` runs it on the host backend (through the `soak` example),
//! `ddo-cuda`'s `gpu_soak` test on a GPU, and `tests/soak.rs` briefly in CI.
//!
//! One cycle, per route configuration: a two-component pipeline (a tiny Flux transformer
//! and a tiny VAE, random weights built once) is offloaded with that route for both
//! components (`enable_pipeline_offload` with component policies, environment off); the
//! transformer runs a forward, the phase ends (`phase_boundary`) and the transformer is
//! released; then the VAE decodes, its phase ends and it is released. Every output must
//! equal the first cycle's, bit for bit. Memory is read after each cycle once the device is
//! synchronised: device bytes allocated and reserved, pinned host bytes, and the process's
//! resident set (host memory, from `/proc/self/status`; `None` elsewhere).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ddo_core::rng::SplitMix64;
use ddo_core::{CoreError, DType, Device, Preset, Result, RouteSpec, Settings, Tensor};
use ddo_routes::{Pipeline, enable_pipeline_offload};

use crate::flux::{FluxInputs, FluxTransformer, latent_image_ids};
use crate::pipeline::FluxPipelineConfig;
use crate::vae::AutoencoderKL;
use crate::weights::RandomWeights;

/// One route configuration of the soak: a label, the spec, whether it needs the native
/// allocator.
#[derive(Debug, Clone)]
pub struct SoakRoute {
    /// Short label for reports.
    pub label: String,
    /// The route and its options.
    pub spec: RouteSpec,
    /// Whether the route needs a device with the native VMM allocator.
    pub native: bool,
}

/// Every route configuration: `none`, group offload (leaf and block level, with and without
/// a stream, `record_stream`, `low_cpu_mem_usage`, `pinned=false`), `linear_convolution`
/// (pinned and not) and `native_vmm` with a budget.
pub fn soak_routes() -> Vec<SoakRoute> {
    let g = "diffusers_group_offload";
    [
        ("none", "none".to_string(), false),
        ("leaf", format!("{g}:use_stream=false"), false),
        ("leaf+stream", format!("{g}:use_stream=true"), false),
        (
            "leaf+stream+record_stream",
            format!("{g}:use_stream=true,record_stream=true"),
            false,
        ),
        (
            "leaf+stream+low_cpu_mem_usage",
            format!("{g}:use_stream=true,low_cpu_mem_usage=true"),
            false,
        ),
        (
            "leaf+stream+pinned=false",
            format!("{g}:use_stream=true,pinned=false"),
            false,
        ),
        (
            "block",
            format!("{g}:offload_type=block_level,num_blocks_per_group=1"),
            false,
        ),
        (
            "block+stream",
            format!("{g}:offload_type=block_level,num_blocks_per_group=1,use_stream=true"),
            false,
        ),
        ("linear_convolution", "linear_convolution".into(), false),
        (
            "linear_convolution+pinned=false",
            "linear_convolution:pinned=false".into(),
            false,
        ),
        ("native_vmm", "native_vmm:budget=48KiB".into(), true),
    ]
    .into_iter()
    .map(|(label, spec, native)| SoakRoute {
        label: label.to_string(),
        spec: ddo_routes::parse_spec(&spec)
            .unwrap_or_else(|e| unreachable!("soak route `{spec}` does not parse: {e}")),
        native,
    })
    .collect()
}

/// Memory figures at one point of the soak.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SoakMemory {
    /// Device bytes in live allocations (of the caching and the native device together).
    pub device_allocated: u64,
    /// Device bytes the allocators hold, live or cached.
    pub device_reserved: u64,
    /// Pinned host bytes.
    pub pinned_host: u64,
    /// The process's resident set in bytes (Linux), `None` where it cannot be read.
    pub host_rss: Option<u64>,
}

/// What a soak run measured.
#[derive(Debug, Clone)]
pub struct SoakReport {
    /// Cycles run.
    pub cycles: usize,
    /// Route configurations per cycle.
    pub routes: Vec<String>,
    /// Forwards run in all (two per route per cycle).
    pub forwards: u64,
    /// Figures after the first cycle.
    pub after_first: SoakMemory,
    /// Figures after the last cycle.
    pub after_last: SoakMemory,
    /// Largest device peak of a phase, over the whole run.
    pub max_phase_peak: u64,
    /// Wall time.
    pub elapsed: Duration,
}

fn drift(first: u64, last: u64) -> i64 {
    last as i64 - first as i64
}

impl SoakReport {
    /// Growth from after the first cycle to after the last: device allocated, device
    /// reserved, pinned, host resident set (when known), in bytes (negative = shrank).
    pub fn drift(&self) -> (i64, i64, i64, Option<i64>) {
        let (a, b) = (&self.after_first, &self.after_last);
        (
            drift(a.device_allocated, b.device_allocated),
            drift(a.device_reserved, b.device_reserved),
            drift(a.pinned_host, b.pinned_host),
            a.host_rss.zip(b.host_rss).map(|(x, y)| drift(x, y)),
        )
    }

    /// Whether no figure grew by more than `tolerance` bytes.
    pub fn within(&self, tolerance: u64) -> bool {
        let t = tolerance as i64;
        let (d, r, p, h) = self.drift();
        d <= t && r <= t && p <= t && h.is_none_or(|h| h <= t)
    }

    /// The figures as text, one per line.
    pub fn format(&self) -> String {
        let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
        let (a, b) = (&self.after_first, &self.after_last);
        let (d, r, p, h) = self.drift();
        let rss = |m: &SoakMemory| {
            m.host_rss
                .map_or("n/a".to_string(), |v| format!("{:.2} MiB", mib(v)))
        };
        format!(
            "soak: {} cycles x {} routes ({}) = {} forwards in {:.1} s\n\
             after cycle 1:   device {} B allocated, {} B reserved, pinned {} B, host RSS {}\n\
             after cycle {}: device {} B allocated, {} B reserved, pinned {} B, host RSS {}\n\
             drift: device {d:+} B allocated, {r:+} B reserved, pinned {p:+} B, host RSS {}\n\
             largest phase peak: {:.2} MiB",
            self.cycles,
            self.routes.len(),
            self.routes.join(", "),
            self.forwards,
            self.elapsed.as_secs_f64(),
            a.device_allocated,
            a.device_reserved,
            a.pinned_host,
            rss(a),
            self.cycles,
            b.device_allocated,
            b.device_reserved,
            b.pinned_host,
            rss(b),
            h.map_or("n/a".to_string(), |h| format!("{h:+} B")),
            mib(self.max_phase_peak),
        )
    }
}

/// The process's resident set in bytes, from `/proc/self/status` (Linux only).
pub fn host_rss() -> Option<u64> {
    ddo_core::host_memory::process_status_bytes("VmRSS")
}

/// The soak's two models and their inputs (random weights and values, fixed seeds).
struct Models {
    transformer: FluxTransformer,
    vae: AutoencoderKL,
    flux_inputs: FluxInputs,
    latents: Tensor,
}

fn random_tensor(rng: &mut SplitMix64, shape: Vec<usize>) -> Result<Tensor> {
    let n = shape.iter().product();
    let values: Vec<f32> = (0..n).map(|_| rng.next_signed()).collect();
    Tensor::from_f32(shape, DType::F32, &values)
}

fn models(dtype: DType) -> Result<Models> {
    let config = FluxPipelineConfig::tiny();
    let load = |e: crate::LoadError| CoreError::InvalidOption {
        option: "soak model".into(),
        value: "tiny".into(),
        hint: e.to_string(),
    };
    let transformer =
        FluxTransformer::random(config.transformer.clone(), 11, dtype).map_err(load)?;
    let vae = AutoencoderKL::build(&mut RandomWeights::new(12, dtype), config.vae.clone())
        .map_err(load)?;
    let t = &config.transformer;
    let mut rng = SplitMix64::new(13);
    let (h, w, txt) = (4, 4, 8);
    let flux_inputs = FluxInputs {
        hidden_states: random_tensor(&mut rng, vec![1, h * w, t.in_channels])?,
        encoder_hidden_states: random_tensor(&mut rng, vec![1, txt, t.joint_attention_dim])?,
        pooled_projections: random_tensor(&mut rng, vec![1, t.pooled_projection_dim])?,
        timestep: vec![0.5],
        guidance: t.guidance_embeds.then(|| vec![3.5]),
        img_ids: latent_image_ids(h, w),
        txt_ids: vec![[0.0; 3]; txt],
    };
    let latents = random_tensor(&mut rng, vec![1, config.vae.latent_channels, 8, 8])?;
    Ok(Models {
        transformer,
        vae,
        flux_inputs,
        latents,
    })
}

fn memory(devices: &[&Arc<dyn Device>]) -> Result<SoakMemory> {
    let mut m = SoakMemory {
        host_rss: host_rss(),
        ..SoakMemory::default()
    };
    for d in devices {
        d.synchronize()?;
        // Host memory a route handed back is counted until the device unpins it.
        d.unpin_released();
        // Caches are not leaks: return the caching allocator's idle segments and the
        // native pool's idle chunks before reading what is held.
        d.empty_cache()?;
        if d.native_pool_figures().is_some() {
            d.release_native_idle_cache()?;
        }
        let info = d.memory_info();
        m.device_allocated += info.allocated;
        m.device_reserved += info.reserved;
        m.pinned_host += info.pinned_host;
    }
    Ok(m)
}

/// One route's cycle: attach both components, forward, phase boundary, release; returns
/// the two outputs' bytes and the larger phase peak.
fn cycle(models: &Models, route: &SoakRoute, device: &Arc<dyn Device>) -> Result<(Vec<u8>, u64)> {
    let pipeline = Pipeline::new(vec![
        Arc::clone(models.transformer.component()),
        Arc::clone(models.vae.component()),
    ])?;
    let settings = Settings {
        preset: Preset::Auto,
        component_policies: BTreeMap::from([
            ("transformer".to_string(), route.spec),
            ("vae".to_string(), route.spec),
        ]),
        use_environment: false,
    };
    let mut offload = enable_pipeline_offload(&pipeline, Arc::clone(device), &settings)?;
    let s = device.compute_stream();
    let mut out = offload.handle_mut("transformer")?.cleanup_on_error(|h| {
        models
            .transformer
            .forward(&**h.device(), &models.flux_inputs)?
            .to_host_bytes(&**h.device(), &s)
    })?;
    let p1 = offload.phase_boundary("denoise")?;
    offload.release("transformer")?;
    let image = offload.handle_mut("vae")?.cleanup_on_error(|h| {
        models
            .vae
            .decode(Some(&**h.device()), &models.latents, None)?
            .to_host_bytes(&**h.device(), &s)
    })?;
    let p2 = offload.phase_boundary("decode")?;
    offload.release("vae")?;
    out.extend_from_slice(&image);
    Ok((out, p1.allocator_peak_bytes.max(p2.allocator_peak_bytes)))
}

/// Runs `cycles` soak cycles over `routes` on `device` (routes that need the native
/// allocator run on `native`, and are skipped when it is `None`). `progress` is called after
/// each cycle with its number. Stops at the first error, or when an output differs from the
/// first cycle's (an `InvalidOption` naming the route and cycle).
pub fn run_soak(
    device: &Arc<dyn Device>,
    native: Option<&Arc<dyn Device>>,
    routes: &[SoakRoute],
    cycles: usize,
    dtype: DType,
    mut progress: impl FnMut(usize),
) -> Result<SoakReport> {
    if cycles == 0 {
        return Err(CoreError::InvalidOption {
            option: "cycles".into(),
            value: "0".into(),
            hint: "a soak needs at least one cycle".into(),
        });
    }
    let models = models(dtype)?;
    let routes: Vec<&SoakRoute> = routes
        .iter()
        .filter(|r| !r.native || native.is_some())
        .collect();
    let mut devices = vec![device];
    devices.extend(native);
    let start = Instant::now();
    let mut reference: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let (mut after_first, mut after_last) = (SoakMemory::default(), SoakMemory::default());
    let mut max_phase_peak = 0;
    let mut forwards = 0;
    for n in 1..=cycles {
        for route in &routes {
            let d = match (route.native, native) {
                (true, Some(nd)) => nd,
                _ => device,
            };
            let (out, peak) = cycle(&models, route, d)?;
            forwards += 2;
            max_phase_peak = max_phase_peak.max(peak);
            let first = reference
                .entry(route.label.clone())
                .or_insert_with(|| out.clone());
            if *first != out {
                return Err(CoreError::InvalidOption {
                    option: "soak output".into(),
                    value: format!("{} in cycle {n}", route.label),
                    hint: "differs from the first cycle's output: state leaked between cycles"
                        .into(),
                });
            }
        }
        let m = memory(&devices)?;
        if n == 1 {
            after_first = m;
        }
        after_last = m;
        progress(n);
    }
    Ok(SoakReport {
        cycles,
        routes: routes.iter().map(|r| r.label.clone()).collect(),
        forwards,
        after_first,
        after_last,
        max_phase_peak,
        elapsed: start.elapsed(),
    })
}
