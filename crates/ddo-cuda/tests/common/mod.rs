//! Helpers shared by the whole-model GPU tests (`gpu_models`, `gpu_native`, `gpu_soak`):
//! opening `cuda:0` or skipping without one, and synthetic Flux inputs. Each test binary
//! uses part of them.
#![allow(dead_code)]

use std::sync::Arc;

use ddo_core::{DType, Tensor};
use ddo_cuda::{CudaDevice, CudaDeviceConfig, CudaError};
use ddo_nn::flux::FluxInputs;

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

/// Flux inputs of `side`² image tokens and `txt` text tokens of width `joint`.
pub fn synthetic_flux_inputs(side: usize, txt: usize, joint: usize) -> FluxInputs {
    let n = side * side;
    FluxInputs {
        hidden_states: Tensor::from_f32(vec![1, n, 64], DType::F32, &rnd(n * 64, 1)).unwrap(),
        encoder_hidden_states: Tensor::from_f32(
            vec![1, txt, joint],
            DType::F32,
            &rnd(txt * joint, 2),
        )
        .unwrap(),
        pooled_projections: Tensor::from_f32(vec![1, 768], DType::F32, &rnd(768, 3)).unwrap(),
        timestep: vec![0.5],
        guidance: Some(vec![3.5]),
        img_ids: (0..n)
            .map(|i| [0.0, (i / side) as f32, (i % side) as f32])
            .collect(),
        txt_ids: vec![[0.0; 3]; txt],
    }
}
