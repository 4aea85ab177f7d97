//! `AutoencoderKL` decode on the host backend: a small but realistic VAE
//! (`block_out_channels` [64, 128, 128, 128], one layer per block, 4 latent channels,
//! 32 groups) decoding a 32×32 latent into a 256×256 image, with seeded random weights
//! resident on the device. One warm-up decode, then `N` timed decodes per dtype; prints a
//! table and writes median/min/max to `target/bench/vae_decode.json`.
//!
//! Run with `cargo bench -p ddo-nn --bench vae_decode`.

use std::path::PathBuf;
use std::time::Instant;

use ddo_core::{DType, Device, Tensor};
use ddo_host::{HostDevice, HostDeviceConfig};
use ddo_nn::RandomWeights;
use ddo_nn::vae::{AutoencoderKL, AutoencoderKLConfig, estimate_decode_peak_bytes};

const N: usize = 3;
const LATENT: [usize; 4] = [1, 4, 32, 32];

fn config() -> AutoencoderKLConfig {
    AutoencoderKLConfig {
        block_out_channels: vec![64, 128, 128, 128],
        layers_per_block: 1,
        up_block_types: vec!["UpDecoderBlock2D".into(); 4],
        sample_size: 256,
        ..AutoencoderKLConfig::sd()
    }
}

struct Row {
    dtype: DType,
    params: usize,
    times_ms: Vec<f64>,
    peak_bytes: u64,
    estimate_bytes: u64,
}

fn stats(times: &[f64]) -> (f64, f64, f64) {
    let mut t = times.to_vec();
    t.sort_by(f64::total_cmp);
    (t[t.len() / 2], t[0], t[t.len() - 1])
}

fn run(dtype: DType) -> Row {
    let config = config();
    let mut weights = RandomWeights::new(2024, dtype);
    let vae = AutoencoderKL::build(&mut weights, config.clone()).expect("build");
    let device = HostDevice::new(HostDeviceConfig {
        capacity: 8 << 30,
        ..HostDeviceConfig::default()
    })
    .expect("device");
    let stream = device.compute_stream();
    vae.component()
        .to_device(&*device, &stream)
        .expect("to_device");
    let n: usize = LATENT.iter().product();
    let values: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    let latents = Tensor::from_f32(LATENT.to_vec(), dtype, &values).expect("latents");
    let weights_on_device = device.memory_info().allocated;

    let warm = vae
        .decode(Some(&*device), &latents, None)
        .expect("warm-up decode");
    assert_eq!(warm.shape(), &[1, 3, 256, 256]);
    drop(warm);
    device.reset_peak();
    let mut times_ms = Vec::with_capacity(N);
    for _ in 0..N {
        let start = Instant::now();
        let out = vae.decode(Some(&*device), &latents, None).expect("decode");
        device.synchronize().expect("sync");
        times_ms.push(start.elapsed().as_secs_f64() * 1e3);
        drop(out);
    }
    Row {
        dtype,
        params: vae.num_params(),
        times_ms,
        peak_bytes: device.memory_info().peak_allocated - weights_on_device,
        estimate_bytes: estimate_decode_peak_bytes(&config, &LATENT, dtype),
    }
}

fn out_path() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            // The workspace's target folder: crates/ddo-nn -> the workspace root.
            let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
            manifest
                .ancestors()
                .nth(2)
                .map_or_else(|| manifest.join("target"), |root| root.join("target"))
        });
    target.join("bench").join("vae_decode.json")
}

fn main() {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "vae_decode: AutoencoderKL decoder {:?}, layers_per_block 1, latent {:?} -> [1, 3, 256, 256], \
         host backend ({threads} threads), {N} runs after 1 warm-up",
        config().block_out_channels,
        LATENT
    );
    let rows: Vec<Row> = [DType::F32, DType::BF16].into_iter().map(run).collect();
    println!(
        "{:<6} {:>10} {:>12} {:>10} {:>10} {:>16} {:>16}",
        "dtype", "params", "median ms", "min ms", "max ms", "act. peak MiB", "estimate MiB"
    );
    let mut json = Vec::new();
    for r in &rows {
        let (median, min, max) = stats(&r.times_ms);
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        println!(
            "{:<6} {:>10} {:>12.1} {:>10.1} {:>10.1} {:>16.1} {:>16.1}",
            r.dtype.as_str(),
            r.params,
            median,
            min,
            max,
            mib(r.peak_bytes),
            mib(r.estimate_bytes)
        );
        json.push(serde_json::json!({
            "dtype": r.dtype.as_str(),
            "params": r.params,
            "runs": r.times_ms.len(),
            "times_ms": r.times_ms,
            "median_ms": median,
            "min_ms": min,
            "max_ms": max,
            "activation_peak_bytes": r.peak_bytes,
            "estimated_peak_bytes": r.estimate_bytes,
        }));
    }
    let report = serde_json::json!({
        "bench": "vae_decode",
        "model": {
            "block_out_channels": config().block_out_channels,
            "layers_per_block": 1,
            "latent_shape": LATENT,
            "output_shape": [1, 3, 256, 256],
        },
        "backend": "host",
        "threads": threads,
        "results": json,
    });
    let path = out_path();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).expect("create target/bench");
    }
    std::fs::write(&path, serde_json::to_string_pretty(&report).expect("json")).expect("write");
    println!("wrote {}", path.display());
}
