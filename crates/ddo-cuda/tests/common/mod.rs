//! Helpers shared by the GPU test binaries (`gpu`, `gpu_ops`, `gpu_heavy_ops`, `gpu_models`,
//! `gpu_native`, `gpu_soak`, ...): opening `cuda:0` or skipping without one, and synthetic
//! Flux inputs. Each test binary uses part of them.
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
            if std::env::var_os("DDO_REQUIRE_GPU").is_some_and(|v| v == "1") {
                panic!("DDO_REQUIRE_GPU=1 but there is no usable CUDA device: {e}");
            }
            println!("skipped: no CUDA device");
            None
        }
        Err(e) => panic!("a CUDA driver is present but device 0 failed to open: {e}"),
    }
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
