//! DDO's side of `cargo xtask bench --peer diffusers`: runs the bench workloads on the CUDA
//! device on the weights `tools/bench_peer.py` saved (the same safetensors Diffusers
//! loaded), and writes the figures as JSON.
//!
//! Usage: `bench_peer PEER_DIR OUT_JSON [ROUTE_OPTIONS]` where `PEER_DIR` holds
//! `transformer/`, `vae/` and `bench_inputs.safetensors`, and `ROUTE_OPTIONS` (optional,
//! e.g. `unit_bytes=16MiB,ring_slots=3`) are added to every streamed route. Workloads:
//! the Flux-shaped transformer (5 double + 10 single blocks, bf16, 4608 image + 512 text
//! tokens) resident, leaf+stream with no budget and with a 4 GiB budget; the Flux VAE
//! decode 1024² resident, leaf without a stream and leaf with a stream. For each: median,
//! min and max ms of 10 forwards after 3 warm-ups (the first forward learns the schedule),
//! the exact device peak, bytes copied host→device per forward, the engine's plan, host RSS
//! (sampled during the timed forwards) and pinned host bytes. The pinned host→device
//! bandwidth is measured first (1 GiB, best of 5), in the same process. Streamed
//! transformer runs mark the model exclusively owned at load, call
//! `detach_auxiliary_cpu_sources` after attaching and before the first forward (the seed's
//! rule), and record its outcome under `detach_auxiliary_cpu_sources` in the JSON. Under the
//! default `pinned_source=register` it is refused (seen on an H200; on the host backend by
//! `ddo-routes/tests/detach.rs`): the route keeps the checkpoint mapping, page-locked in
//! place, as the weights' one host copy, so there is no mapping to drop. With
//! `pinned_source=home` among `ROUTE_OPTIONS` it succeeds and copies nothing: the pinned
//! home replaced the mapped bytes at attach.
//!
//! The inputs are on the device before the timed forwards, as `tools/bench_peer.py` holds
//! them for Diffusers: the transformer's as f32 except `hidden_states` in bf16 (the model
//! casts the others on the device each forward, as Diffusers' `run_transformer` does), the
//! VAE latents in bf16.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use ddo_core::{DType, Device, RouteSpec, Tensor};
use ddo_cuda::CudaDevice;
use ddo_nn::flux::{FluxInputs, FluxTransformer};
use ddo_nn::read_f32_tensor;
use ddo_nn::vae::AutoencoderKL;
use ddo_routes::enable_dynamic_offload;
use serde_json::{Value, json};

type BoxError = Box<dyn std::error::Error>;

/// `(VmRSS, RssAnon, RssFile)` of this process in bytes, from `/proc/self/status`.
fn rss() -> (u64, u64, u64) {
    use ddo_core::host_memory::process_status_bytes as field;
    (
        field("VmRSS").unwrap_or(0),
        field("RssAnon").unwrap_or(0),
        field("RssFile").unwrap_or(0),
    )
}

fn tensor(path: &Path, name: &str) -> Result<(Tensor, Vec<f32>), BoxError> {
    let (shape, values) = read_f32_tensor(path, name)?;
    Ok((Tensor::from_f32(shape, DType::F32, &values)?, values))
}

fn ids(values: &[f32]) -> Vec<[f32; 3]> {
    values.chunks_exact(3).map(|c| [c[0], c[1], c[2]]).collect()
}

/// `name` from `path` on the device in `dtype` (rounded on the host).
fn device_tensor(
    d: &CudaDevice,
    path: &Path,
    name: &str,
    dtype: DType,
) -> Result<Tensor, BoxError> {
    let (shape, values) = read_f32_tensor(path, name)?;
    Ok(Tensor::from_f32(shape, dtype, &values)?.to_device(d, &d.compute_stream())?)
}

fn flux_inputs(d: &CudaDevice, path: &Path) -> Result<FluxInputs, BoxError> {
    Ok(FluxInputs {
        hidden_states: device_tensor(d, path, "hidden_states", DType::BF16)?,
        encoder_hidden_states: device_tensor(d, path, "encoder_hidden_states", DType::F32)?,
        pooled_projections: device_tensor(d, path, "pooled_projections", DType::F32)?,
        timestep: tensor(path, "timestep")?.1,
        guidance: Some(tensor(path, "guidance")?.1),
        img_ids: ids(&tensor(path, "img_ids")?.1),
        txt_ids: ids(&tensor(path, "txt_ids")?.1),
    })
}

/// Host→device bandwidth in bytes per second, measured as `ddo bench` measures it
/// ([`ddo_cli::bench::link_bandwidth`] over a 256 MiB pinned buffer).
fn pinned_bandwidth(d: &CudaDevice) -> Result<f64, BoxError> {
    Ok(ddo_cli::bench::link_bandwidth(d, 256 << 20)?)
}

/// Times `f` (3 warm-ups, 10 runs), sampling RSS and pinned bytes after each run.
fn time(d: &CudaDevice, mut f: impl FnMut() -> Result<(), BoxError>) -> Result<Value, BoxError> {
    for _ in 0..3 {
        f()?;
    }
    d.synchronize()?;
    d.reset_peak();
    let before = d.memory_info().allocated;
    let mut times = Vec::new();
    let (mut rss_max, mut anon_max, mut file_max, mut pinned_max) = (0, 0, 0, 0);
    for _ in 0..10 {
        let t = Instant::now();
        f()?;
        d.synchronize()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
        let (r, a, fi) = rss();
        rss_max = rss_max.max(r);
        anon_max = anon_max.max(a);
        file_max = file_max.max(fi);
        pinned_max = pinned_max.max(d.memory_info().pinned_host);
    }
    times.sort_by(f64::total_cmp);
    let peak = d.memory_info().peak_allocated;
    Ok(json!({
        "median_ms": times[times.len() / 2],
        "min_ms": times[0],
        "max_ms": times[times.len() - 1],
        "peak_allocated_bytes": peak,
        "allocated_before_bytes": before,
        "host_rss_bytes": rss_max,
        "host_rss_anon_bytes": anon_max,
        "host_rss_file_bytes": file_max,
        "pinned_host_bytes": pinned_max,
    }))
}

fn spec(text: &str, extra: &str) -> Result<RouteSpec, BoxError> {
    let full = if extra.is_empty() || !text.contains("use_stream=true") {
        text.to_string()
    } else {
        format!("{text},{extra}")
    };
    Ok(ddo_routes::parse_spec(&full)?)
}

fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(dir), Some(out)) = (args.get(1), args.get(2)) else {
        return Err("usage: bench_peer PEER_DIR OUT_JSON [ROUTE_OPTIONS]".into());
    };
    let extra = args.get(3).cloned().unwrap_or_default();
    let dir = PathBuf::from(dir);
    let d = CudaDevice::new(0)?;
    let dev: Arc<dyn Device> = d.clone();
    let bandwidth = pinned_bandwidth(&d)?;
    println!("pinned host->device: {:.1} GB/s", bandwidth / 1e9);
    let mut results = serde_json::Map::new();
    let inputs_path = dir.join("bench_inputs.safetensors");

    let inputs = flux_inputs(&d, &inputs_path)?;
    let transformer_runs = [
        ("transformer_resident", "none".to_string()),
        (
            "transformer_leaf_stream",
            "diffusers_group_offload:offload_type=leaf_level,use_stream=true".to_string(),
        ),
        (
            "transformer_leaf_stream_budget_4GiB",
            "diffusers_group_offload:offload_type=leaf_level,use_stream=true,budget=4GiB"
                .to_string(),
        ),
    ];
    for (name, route) in transformer_runs {
        let (rss0, _, _) = rss();
        let model = FluxTransformer::load(&dir.join("transformer"), None)?;
        // Nothing else holds this model's tensors: say so before its first forward, as
        // detaching its checkpoint-backed sources requires (the seed's rule).
        model.component().set_exclusively_owned(true);
        let weight_bytes = model.component().param_bytes();
        let h = enable_dynamic_offload(model.component(), dev.clone(), spec(&route, &extra)?)?;
        // Before the first forward, as the seed requires. Under the default
        // `pinned_source=register` the route streams from the checkpoint mapping itself,
        // page-locked in place as the weights' one host copy, so the call is refused and
        // changes nothing; the JSON records the refusal, which is not bypassed
        // (`ddo-routes/tests/detach.rs` shows both outcomes on the host backend).
        let detach = if route.contains("use_stream=true") {
            match h.detach_auxiliary_cpu_sources(true, 256 << 20) {
                Ok(summary) => serde_json::to_value(&summary)?,
                Err(e) => json!({ "refused": e.to_string() }),
            }
        } else {
            Value::Null
        };
        // The first forward learns the schedule and builds the engine.
        model.forward(&*d, &inputs)?;
        let mut r = time(&d, || {
            model.forward(&*d, &inputs)?;
            Ok(())
        })?;
        r["detach_auxiliary_cpu_sources"] = detach;
        let snap = h.metrics_snapshot();
        let forwards = snap.counters.forwards.max(1);
        r["route"] = json!(h.spec().describe());
        r["weight_bytes"] = json!(weight_bytes);
        r["host_rss_at_load_start_bytes"] = json!(rss0);
        r["h2d_bytes_per_forward"] = json!(snap.counters.streamed_bytes_per_forward);
        r["h2d_bytes_total"] = json!(snap.counters.h2d_bytes);
        r["forwards"] = json!(forwards);
        r["counters"] = serde_json::to_value(&snap.counters)?;
        println!("{name}: {r}");
        results.insert(name.to_string(), r);
        drop(h);
        drop(model);
        d.synchronize()?;
        d.empty_cache()?;
    }

    let latents = device_tensor(&d, &inputs_path, "latents", DType::BF16)?;
    let vae_runs = [
        ("vae_resident", "none"),
        (
            "vae_leaf_no_stream",
            "diffusers_group_offload:offload_type=leaf_level,use_stream=false",
        ),
        (
            "vae_leaf_stream",
            "diffusers_group_offload:offload_type=leaf_level,use_stream=true",
        ),
    ];
    for (name, route) in vae_runs {
        let vae = AutoencoderKL::load(&dir.join("vae"), None)?;
        let h = enable_dynamic_offload(vae.component(), dev.clone(), spec(route, &extra)?)?;
        let mut r = time(&d, || {
            vae.decode(Some(&*d), &latents, None)?;
            Ok(())
        })?;
        let snap = h.metrics_snapshot();
        r["route"] = json!(h.spec().describe());
        r["weight_bytes"] = json!(vae.component().param_bytes());
        r["counters"] = serde_json::to_value(&snap.counters)?;
        println!("{name}: {r}");
        results.insert(name.to_string(), r);
        drop(h);
        drop(vae);
        d.synchronize()?;
        d.empty_cache()?;
    }
    let doc = json!({
        "side": "ddo",
        "pinned_h2d_bytes_per_sec": bandwidth,
        "route_options": extra,
        "results": results,
    });
    std::fs::write(out, serde_json::to_string_pretty(&doc)?)?;
    println!("wrote {out}");
    Ok(())
}
