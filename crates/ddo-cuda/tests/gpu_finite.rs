//! GPU tests of `Ops::count_non_finite` (issue 34): the CUDA count against the host
//! backend's on the same values, in f32, f16 and bf16, with and without NaN and ±Inf, on
//! sizes around the kernel's block and grid limits, at an offset into a buffer, through the
//! device's profiled ops handle, and after the work queued before it; fp8 and host tensors
//! are typed errors. Without a driver or a device each test prints "skipped: no CUDA
//! device" and passes (unless `DDO_REQUIRE_GPU=1`), like `tests/gpu.rs`.

use ddo_core::device::ops_of;
use ddo_core::rng::SplitMix64;
use ddo_core::{BinaryOp, DType, Device, HostBuffer, Ops, Tensor, TensorStorage};
use ddo_host::HostDevice;

mod common;

/// Seeded values in [-1, 1) with NaN, +Inf and -Inf at every `every`-th element (none for
/// `every == 0`).
fn values(n: usize, every: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..n)
        .map(|i| {
            if every > 0 && i % every == every - 1 {
                [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][(i / every) % 3]
            } else {
                rng.next_signed()
            }
        })
        .collect()
}

#[test]
fn the_count_matches_the_host_on_every_dtype_and_size() {
    let Some(gpu) = common::open_gpu(false) else {
        return;
    };
    let host = HostDevice::with_capacity(1 << 30).unwrap();
    // Sizes around one block (256), the first pass's 4 elements a thread, and its grid cap
    // (1024 blocks: 1,048,576 elements), and beyond it.
    let sizes = [
        1,
        7,
        255,
        256,
        1023,
        1025,
        4096 * 3 + 5,
        1 << 20,
        (1 << 20) + 3,
        3_000_001,
    ];
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (k, &n) in sizes.iter().enumerate() {
            for every in [0, 1, 2, 97, n.max(1)] {
                let v = values(n, every, k as u64);
                let g = gpu.tensor_from_f32(&[n], dtype, &v).unwrap();
                let h = host.tensor_from_f32(&[n], dtype, &v).unwrap();
                let want = host.count_non_finite(&h).unwrap();
                assert_eq!(
                    gpu.count_non_finite(&g).unwrap(),
                    want,
                    "{dtype} n={n} every={every}"
                );
                if every == 0 {
                    assert_eq!(want, 0, "{dtype} n={n}");
                }
            }
        }
    }
    // Values beyond f16's range are Inf there, finite in bf16 (as on the host).
    let big = [1e5f32, -7e4, 3e38, 1.0];
    for (dtype, want) in [(DType::F16, 3), (DType::BF16, 0), (DType::F32, 0)] {
        let g = gpu.tensor_from_f32(&[4], dtype, &big).unwrap();
        assert_eq!(gpu.count_non_finite(&g).unwrap(), want, "{dtype}");
    }
    // Through the device's (profiled) ops handle, on a multi-dimensional tensor.
    let v = values(2 * 3 * 40, 11, 9);
    let g = gpu.tensor_from_f32(&[2, 3, 40], DType::BF16, &v).unwrap();
    let h = host.tensor_from_f32(&[2, 3, 40], DType::BF16, &v).unwrap();
    assert_eq!(
        ops_of(&*gpu).unwrap().count_non_finite(&g).unwrap(),
        host.count_non_finite(&h).unwrap()
    );
}

#[test]
fn the_count_reads_a_view_at_its_offset_after_the_queued_work() {
    let Some(gpu) = common::open_gpu(false) else {
        return;
    };
    // A narrow of a larger tensor whose NaNs lie outside the view: none counted.
    let mut v = vec![0.25f32; 64];
    v[..8].fill(f32::NAN);
    v[56..].fill(f32::INFINITY);
    let t = gpu.tensor_from_f32(&[64], DType::F16, &v).unwrap();
    let view = gpu.narrow(&t, 0, 8, 48).unwrap();
    assert_eq!(gpu.count_non_finite(&view).unwrap(), 0);
    assert_eq!(gpu.count_non_finite(&t).unwrap(), 16);
    // A result the kernels just queued: x / 0 gives Inf and NaN (0 / 0).
    let x = gpu
        .tensor_from_f32(&[4], DType::F32, &[1.0, 0.0, -2.0, 3.0])
        .unwrap();
    let zero = gpu.tensor_from_f32(&[1], DType::F32, &[0.0]).unwrap();
    let q = gpu.binary(&x, &zero, BinaryOp::Div).unwrap();
    assert_eq!(gpu.count_non_finite(&q).unwrap(), 4);
    drop((t, view, x, zero, q));
    gpu.synchronize().unwrap();
    assert_eq!(gpu.memory_info().allocated, 0, "scratch and outputs freed");
}

#[test]
fn fp8_and_host_tensors_are_typed_errors() {
    let Some(gpu) = common::open_gpu(false) else {
        return;
    };
    // The device encodes no fp8 (a cast into it is refused): the bytes are made on the host
    // and uploaded, as a checkpoint's fp8 weights are.
    let codes = DType::F8E4M3.encode_f32(&[1.0, 2.0, 3.0, 4.0]).unwrap();
    let q = Tensor::new(
        vec![4],
        DType::F8E4M3,
        TensorStorage::Host(HostBuffer::pageable_from(&codes).slice_all()),
    )
    .unwrap()
    .to_device(&*gpu, &gpu.compute_stream())
    .unwrap();
    let e = gpu.count_non_finite(&q).unwrap_err().to_string();
    assert!(e.contains("count_non_finite"), "{e}");
    let host = Tensor::from_f32(vec![2], DType::F32, &[1.0, f32::NAN]).unwrap();
    assert!(gpu.count_non_finite(&host).is_err());
}

/// The queued count (`Ops::queue_count_non_finite`, the denoising loops' deferred check)
/// lands in pinned memory once the event after it completes, equal to the synchronous
/// count, for a result just queued; `DeferredFiniteChecks` names the bad step one queue
/// later; the scratch is freed.
#[test]
fn the_queued_count_lands_after_its_event_and_names_its_step() {
    use ddo_core::finite::{COUNT_BYTES, DeferredFiniteChecks};
    let Some(gpu) = common::open_gpu(false) else {
        return;
    };
    let x = gpu
        .tensor_from_f32(&[4], DType::F32, &[1.0, 0.0, -2.0, 3.0])
        .unwrap();
    let zero = gpu.tensor_from_f32(&[1], DType::F32, &[0.0]).unwrap();
    let q = gpu.binary(&x, &zero, BinaryOp::Div).unwrap();
    let dst = gpu.alloc_pinned(COUNT_BYTES).unwrap();
    gpu.queue_count_non_finite(&q, &dst.slice_all()).unwrap();
    let event = gpu.record_event(&gpu.compute_stream()).unwrap();
    gpu.synchronize_event(&event).unwrap();
    let got = dst.slice_all().with_bytes(|b| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[..8]);
        u64::from_le_bytes(w)
    });
    assert_eq!(got, 4);
    assert_eq!(got, gpu.count_non_finite(&q).unwrap());

    let clean = gpu
        .tensor_from_f32(&[3], DType::BF16, &[1.0, 2.0, 3.0])
        .unwrap();
    let mut checks = DeferredFiniteChecks::new(&*gpu);
    checks
        .queue(&clean, "denoise", Some((1, 3)), "the latents")
        .unwrap();
    checks
        .queue(&q, "denoise", Some((2, 3)), "the latents")
        .unwrap();
    match checks.queue(&clean, "denoise", Some((3, 3)), "the latents") {
        Err(ddo_core::CoreError::NonFinite { step, count, .. }) => {
            assert_eq!((step, count), (Some((2, 3)), 4));
        }
        other => panic!("step 2 not named: {other:?}"),
    }
    drop(checks);
    drop((x, zero, q, clean, dst));
    gpu.synchronize().unwrap();
    assert_eq!(gpu.memory_info().allocated, 0, "scratch and outputs freed");
}
