//! GPU tests of the fused gated residual and modulated layer norm
//! (`Ops::gated_add_layer_norm_modulate`, `kernels/norm.cu`'s `ddo_gated_ln_modulate_vec_*`):
//! both outputs have the bytes of the two ops it replaces (`gated_add`, then
//! `layer_norm_modulate` of its result) on the same device, on the warp kernel's widths, the
//! block kernel's (Flux's 3072) and the widths and layouts that take the two ops; both are
//! within the dtype's tolerance of the host's composition; the fused kernel allocates its
//! two outputs and nothing else. Without a driver or a device each test prints "skipped: no
//! CUDA device" and passes (unless `DDO_REQUIRE_GPU=1`), like `tests/gpu.rs`.

use ddo_core::rng::SplitMix64;
use ddo_core::{DType, Device, Ops, Tensor};
use ddo_cuda::CudaDevice;
use ddo_host::HostDevice;

mod common;

const EPS: f32 = 1e-6;

/// Seeded values in [-1, 1) on both devices.
fn put(
    gpu: &CudaDevice,
    host: &HostDevice,
    rng: &mut SplitMix64,
    shape: &[usize],
    dtype: DType,
) -> (Tensor, Tensor) {
    let v: Vec<f32> = (0..shape.iter().product())
        .map(|_| rng.next_signed())
        .collect();
    (
        gpu.tensor_from_f32(shape, dtype, &v).unwrap(),
        host.tensor_from_f32(shape, dtype, &v).unwrap(),
    )
}

/// The stored bytes of a GPU tensor.
fn bytes(gpu: &CudaDevice, t: &Tensor) -> Vec<u8> {
    t.to_host_bytes(gpu, &gpu.compute_stream()).unwrap()
}

/// The fused op against the two ops on the GPU (bytes) and the host's composition (values),
/// for `x, y [2, 37, d]` and gate, scale and shift in the given shapes and dtypes.
#[test]
fn the_fused_op_gives_the_two_ops_bytes() {
    let Some(gpu) = common::open_gpu(false) else {
        return;
    };
    let host = HostDevice::with_capacity(1 << 30).unwrap();
    let mut rng = SplitMix64::new(41);
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        // 64 and 256: the warp kernel; 3072: the block kernel; 24, 520, 100: the two ops.
        for d in [64usize, 256, 3072, 24, 520, 100] {
            let layouts: [([usize; 3], DType); 4] = [
                ([2, 1, d], dtype),
                ([1, 1, d], DType::F32),
                ([2, 37, d], dtype),
                ([1, 37, d], dtype),
            ];
            for (shape, rdt) in layouts {
                let (gx, hx) = put(&gpu, &host, &mut rng, &[2, 37, d], dtype);
                let (gy, hy) = put(&gpu, &host, &mut rng, &[2, 37, d], dtype);
                let (gg, hg) = put(&gpu, &host, &mut rng, &shape, rdt);
                let (gs, hs) = put(&gpu, &host, &mut rng, &shape, rdt);
                let (gh, hh) = put(&gpu, &host, &mut rng, &[2, 1, d], dtype);
                let what = format!("{dtype} d={d} rows {shape:?} {rdt}");
                let (r, n) = gpu
                    .gated_add_layer_norm_modulate(&gx, &gg, &gy, EPS, &gs, &gh)
                    .unwrap();
                let r2 = gpu.gated_add(&gx, &gg, &gy).unwrap();
                let n2 = gpu.layer_norm_modulate(&r2, EPS, &gs, &gh).unwrap();
                assert_eq!(bytes(&gpu, &r), bytes(&gpu, &r2), "{what}: the residual");
                assert_eq!(bytes(&gpu, &n), bytes(&gpu, &n2), "{what}: the norm");
                let (hr, hn) = host
                    .gated_add_layer_norm_modulate(&hx, &hg, &hy, EPS, &hs, &hh)
                    .unwrap();
                let tol = if dtype == DType::F32 { 1e-5 } else { 2e-2 };
                for (what2, g, h) in [("residual", &r, &hr), ("norm", &n, &hn)] {
                    let gv = gpu.to_f32_vec(g).unwrap();
                    let hv = host.to_f32_vec(h).unwrap();
                    let e = common::rel_l2(&gv, &hv);
                    assert!(
                        e <= tol,
                        "{what}: {what2} relative L2 {e:e} against the host"
                    );
                }
            }
        }
    }
}

/// The fused kernel (bf16, Flux's width) allocates its two outputs and nothing else, and
/// every buffer is back once the results are dropped.
#[test]
fn the_fused_op_allocates_its_two_outputs_only() {
    let Some(gpu) = common::open_gpu(false) else {
        return;
    };
    let host = HostDevice::with_capacity(1 << 30).unwrap();
    let mut rng = SplitMix64::new(42);
    let shape = [2, 64, 3072];
    let (gx, _) = put(&gpu, &host, &mut rng, &shape, DType::BF16);
    let (gy, _) = put(&gpu, &host, &mut rng, &shape, DType::BF16);
    let (gg, _) = put(&gpu, &host, &mut rng, &[2, 1, 3072], DType::BF16);
    gpu.synchronize().unwrap();
    let before = gpu.memory_info().allocated;
    gpu.reset_peak();
    let (r, n) = gpu
        .gated_add_layer_norm_modulate(&gx, &gg, &gy, EPS, &gg, &gg)
        .unwrap();
    let peak = gpu.memory_info().peak_allocated;
    let outputs = (r.nbytes() as u64).next_multiple_of(512) * 2;
    assert!(
        peak.saturating_sub(before) <= outputs,
        "peak rose by {} B for two {} B outputs",
        peak.saturating_sub(before),
        r.nbytes()
    );
    drop((r, n, gx, gy, gg));
    gpu.synchronize().unwrap();
    assert_eq!(gpu.memory_info().allocated, 0);
}
