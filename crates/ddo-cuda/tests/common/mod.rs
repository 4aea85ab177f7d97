//! Helpers shared by the GPU test binaries (`gpu`, `gpu_ops`, `gpu_heavy_ops`, `gpu_models`,
//! `gpu_native`, `gpu_soak`, ...): opening `cuda:0` or skipping without one, and synthetic
//! Flux inputs, the relative L2 error. Each test binary uses part of them.
#![allow(dead_code)]

use std::sync::Arc;

use ddo_cuda::{CudaDevice, CudaDeviceConfig, CudaError};
use ddo_nn::flux::{FluxInputs, FluxTransformerConfig};

/// `cuda:0`, with the native allocator installed when `native_vmm`; `None` (after printing
/// "skipped: no CUDA device") without a usable GPU, unless `DDO_REQUIRE_GPU=1`.
pub fn open_gpu(native_vmm: bool) -> Option<Arc<CudaDevice>> {
    let config = CudaDeviceConfig {
        native_vmm,
        ..CudaDeviceConfig::new(0)
    };
    match CudaDevice::with_config(config) {
        Ok(d) => Some(d),
        Err(e @ (CudaError::NoLibrary { .. } | CudaError::NoDevice { .. })) => {
            if gpu_required() {
                panic!("DDO_REQUIRE_GPU=1 but there is no usable CUDA device: {e}");
            }
            println!("skipped: no CUDA device");
            None
        }
        Err(e) => panic!("a CUDA driver is present but device 0 failed to open: {e}"),
    }
}

/// Whether this run requires the GPU and what its tests read from the environment
/// (`DDO_REQUIRE_GPU=1`, as `cargo xtask test-gpu` and the bundle's `run-all.sh` set).
pub fn gpu_required() -> bool {
    std::env::var_os("DDO_REQUIRE_GPU").is_some_and(|v| v == "1")
}

/// A test's input that the environment names is missing (`why`, and `fix`: what to set or
/// run): the test prints "skipped: ..." and returns `None`, or, under `DDO_REQUIRE_GPU=1`,
/// fails — `cargo xtask test-gpu` and the bundle provide every such input, so a run there
/// that lacks one is broken, not skipped.
pub fn missing<T>(why: &str, fix: &str) -> Option<T> {
    if gpu_required() {
        panic!("DDO_REQUIRE_GPU=1 but {why}: {fix}");
    }
    println!("skipped: {why} ({fix})");
    None
}

/// `len` deterministic values in [-1, 1).
pub fn rnd(len: usize, seed: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (((i * 2654435761 + seed) % 1000) as f32 / 500.0) - 1.0)
        .collect()
}

/// Flux inputs of `side`² image tokens and `txt` text tokens for FLUX.1-dev's widths
/// ([`FluxInputs::synthetic`]).
pub fn synthetic_flux_inputs(side: usize, txt: usize) -> FluxInputs {
    FluxInputs::synthetic(&FluxTransformerConfig::flux_dev(), side, txt).unwrap()
}

/// Relative L2 error of `got` against `want` over every element (NaN must match NaN and
/// is left out; absolute when `want` is all zeros).
pub fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "length");
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            g.is_nan(),
            w.is_nan(),
            "NaN mismatch at {i}: got {g}, want {w}"
        );
        if w.is_nan() {
            continue;
        }
        let (g, w) = (f64::from(g), f64::from(w));
        num += (g - w).powi(2);
        den += w * w;
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}
