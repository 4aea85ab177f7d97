//! GPU tests of issue 39's CUDA paths: `Ops::best_gemm_seconds` (the compute floor's search
//! of cuBLASLt's algorithms) and `Ops::linear_fp8` (`--compute fp8`): on a device with fp8 tensor
//! cores the cuBLASLt E4M3 GEMM against the host reference on the same operands (close: the
//! codes are the reference's, the sums run in cuBLASLt's order), through the device's
//! profiled ops; shapes it does not take (a width that is not a multiple of 16) run the
//! reference bit for bit; a NaN activation never gives a finite result. Without a driver or
//! a device each test prints "skipped: no CUDA device" and passes (unless
//! `DDO_REQUIRE_GPU=1`), like `tests/gpu.rs`.

use ddo_core::device::ops_of;
use ddo_core::rng::SplitMix64;
use ddo_core::{CoreError, DType, Device, Tensor};
use ddo_host::HostDevice;

mod common;

fn values(n: usize, span: f32, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..n).map(|_| rng.next_signed() * span).collect()
}

/// `linear_fp8` of the same operands on `dev` (through its profiled ops): x [2, rows, k] bf16,
/// w [n, k] E4M3 with a scale, a bf16 bias; the output's values.
fn run(
    dev: &dyn Device,
    rows: usize,
    k: usize,
    n: usize,
    nan: bool,
) -> Result<Vec<f32>, CoreError> {
    run_op(dev, rows, k, n, nan, false)
}

/// [`run`], through `linear_fp8_gelu_tanh` where `gelu`.
fn run_op(
    dev: &dyn Device,
    rows: usize,
    k: usize,
    n: usize,
    nan: bool,
    gelu: bool,
) -> Result<Vec<f32>, CoreError> {
    let ops = ops_of(dev)?;
    let on = |shape: &[usize], dtype: DType, v: &[f32]| {
        Tensor::from_f32(shape.to_vec(), dtype, v)?.to_device(dev, &dev.compute_stream())
    };
    let mut xv = values(2 * rows * k, 3.0, 1);
    if nan {
        xv[5] = f32::NAN;
    }
    let x = on(&[2, rows, k], DType::BF16, &xv)?;
    let w = on(&[n, k], DType::F8E4M3, &values(n * k, 200.0, 2))?.with_scale(Some(0.0078125))?;
    let b = on(&[n], DType::BF16, &values(n, 1.0, 3))?;
    let y: Tensor = if gelu {
        ops.linear_fp8_gelu_tanh(&x, &w, Some(&b))?
    } else {
        ops.linear_fp8(&x, &w, Some(&b))?
    };
    assert_eq!(y.shape(), [2, rows, n]);
    assert_eq!(y.dtype(), DType::BF16);
    ops.to_f32_vec(&y)
}

/// `v` as a tensor of `shape` and `dtype` on `d`.
fn upload(d: &dyn Device, shape: &[usize], dtype: DType, v: &[f32]) -> Tensor {
    Tensor::from_f32(shape.to_vec(), dtype, v)
        .unwrap()
        .to_device(d, &d.compute_stream())
        .unwrap()
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

#[test]
fn the_fp8_gemm_is_close_to_the_reference_and_other_shapes_are_the_reference() {
    let Some(gpu) = common::open_gpu(false) else {
        return;
    };
    let host = HostDevice::with_capacity(1 << 28).unwrap();
    let (g, h): (&dyn Device, &dyn Device) = (&*gpu, &*host);
    let native = ops_of(g).unwrap().fp8_tensor_cores();
    println!(
        "fp8 tensor cores: {native} (cuBLASLt's last refusal: {:?})",
        gpu.cublaslt_refusal()
    );
    // The form the one-time check chose, or why every form was refused.
    println!("fp8 path: {}", ops_of(g).unwrap().fp8_reference_reason());
    // A width cuBLASLt's fp8 GEMM takes (multiples of 16), rows that are not.
    let before = gpu.cublaslt_runs();
    let (got, want) = (
        run(g, 37, 128, 96, false).unwrap(),
        run(h, 37, 128, 96, false).unwrap(),
    );
    let e = rel_l2(&got, &want);
    println!("fp8 GEMM against the reference: relative L2 {e:.3e}");
    if native {
        assert!(gpu.cublaslt_runs() > before, "{:?}", gpu.cublaslt_refusal());
        assert!(e < 1e-2, "{e}");
    } else {
        assert_eq!(got, want);
    }
    // With the GELU (in cuBLASLt's epilogue where it takes it): close to the host's
    // composition.
    let (got, want) = (
        run_op(g, 37, 128, 96, false, true).unwrap(),
        run_op(h, 37, 128, 96, false, true).unwrap(),
    );
    let e = rel_l2(&got, &want);
    println!("fp8 GEMM + GELU against the reference: relative L2 {e:.3e}");
    assert!(e < 1e-2, "{e}");
    // k = 40: not a multiple of 16, the reference on the GPU too: the same bytes.
    assert_eq!(
        run(g, 5, 40, 32, false).unwrap(),
        run(h, 5, 40, 32, false).unwrap()
    );
    // A NaN in the activation: an error (the reference) or NaNs (the GEMM), never a finite
    // answer.
    match run(g, 37, 128, 96, true) {
        Err(CoreError::NonFiniteActivation { .. }) => assert!(!native),
        Ok(v) => {
            assert!(native);
            assert!(
                v.iter().all(|x| x.is_nan()),
                "a finite value from a NaN input"
            );
        }
        Err(e) => panic!("{e}"),
    }
}

/// One activation read by several fp8 linears (Flux's q, k and v) is quantized once: each
/// product is the one a copy of the activation gives (the same bytes), through weights of
/// different scales; a new activation of other values is not taken for the kept one; and
/// after the forward's end nothing of them is left on the device.
#[test]
fn one_activation_read_by_several_fp8_linears_gives_what_a_copy_of_it_gives() {
    let Some(gpu) = common::open_gpu(false) else {
        return;
    };
    let d: &dyn Device = &*gpu;
    let ops = ops_of(d).unwrap();
    let on = |shape: &[usize], dtype: DType, v: &[f32]| upload(d, shape, dtype, v);
    let (rows, k, n) = (64, 128, 96);
    d.synchronize().unwrap();
    let before = d.memory_info().allocated;
    {
        let x = on(&[rows, k], DType::BF16, &values(rows * k, 3.0, 1));
        let ws: Vec<Tensor> = [0.0078125f32, 0.03125, 0.001953125]
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                on(&[n, k], DType::F8E4M3, &values(n * k, 200.0, 10 + i as u64))
                    .with_scale(Some(s))
                    .unwrap()
            })
            .collect();
        let shared: Vec<Vec<f32>> = ws
            .iter()
            .map(|w| {
                ops.to_f32_vec(&ops.linear_fp8(&x, w, None).unwrap())
                    .unwrap()
            })
            .collect();
        for (w, got) in ws.iter().zip(&shared) {
            let copy = on(&[rows, k], DType::BF16, &values(rows * k, 3.0, 1));
            let alone = ops
                .to_f32_vec(&ops.linear_fp8(&copy, w, None).unwrap())
                .unwrap();
            assert_eq!(got, &alone);
        }
        // Another activation right after: its own codes, not the kept ones.
        let other = on(&[rows, k], DType::BF16, &values(rows * k, 0.5, 7));
        let a = ops
            .to_f32_vec(&ops.linear_fp8(&other, &ws[0], None).unwrap())
            .unwrap();
        let other_copy = on(&[rows, k], DType::BF16, &values(rows * k, 0.5, 7));
        ops.end_forward().unwrap();
        let b = ops
            .to_f32_vec(&ops.linear_fp8(&other_copy, &ws[0], None).unwrap())
            .unwrap();
        assert_eq!(a, b);
        assert_ne!(a, shared[0]);
        ops.end_forward().unwrap();
    }
    // The cuBLAS handle's workspace (made at the first GEMM of this device) goes back too.
    d.synchronize().unwrap();
    gpu.release_blas_workspaces().unwrap();
    d.synchronize().unwrap();
    assert_eq!(d.memory_info().allocated, before);
}

/// Parts side by side (Flux's `proj_out` input): the codes written at each part's columns
/// give the bytes of the fp8 linear of their concatenation, for widths in eights and not.
#[test]
fn an_fp8_linear_of_parts_gives_the_bytes_of_the_linear_of_their_concatenation() {
    let Some(gpu) = common::open_gpu(false) else {
        return;
    };
    let d: &dyn Device = &*gpu;
    let ops = ops_of(d).unwrap();
    let on = |shape: &[usize], dtype: DType, v: &[f32]| upload(d, shape, dtype, v);
    for (k1, k2) in [(96, 160), (36, 28)] {
        let (rows, n) = (48, 80);
        let a = on(&[2, rows, k1], DType::BF16, &values(2 * rows * k1, 3.0, 4));
        let b = on(&[2, rows, k2], DType::BF16, &values(2 * rows * k2, 40.0, 5));
        let w = on(
            &[n, k1 + k2],
            DType::F8E4M3,
            &values(n * (k1 + k2), 200.0, 6),
        )
        .with_scale(Some(0.0078125))
        .unwrap();
        let bias = on(&[n], DType::BF16, &values(n, 1.0, 7));
        let parts = ops.linear_fp8_concat(&[&a, &b], &w, Some(&bias)).unwrap();
        assert_eq!(parts.shape(), [2, rows, n]);
        let joined = ops.concat(&[&a, &b], 2).unwrap();
        let whole = ops.linear_fp8(&joined, &w, Some(&bias)).unwrap();
        assert_eq!(
            ops.to_f32_vec(&parts).unwrap(),
            ops.to_f32_vec(&whole).unwrap(),
            "widths {k1} + {k2}"
        );
        ops.end_forward().unwrap();
    }
}

/// `Device::forget_shape_plans` drops the cuBLASLt plans a linear made (what `ddo serve`
/// does when a request's size changes), and the next linear plans again and gives the
/// same bytes.
#[test]
fn forgotten_shape_plans_are_made_again_with_the_same_result() {
    let Some(gpu) = common::open_gpu(false) else {
        return;
    };
    let d: &dyn Device = &*gpu;
    let ops = ops_of(d).unwrap();
    let x = upload(d, &[64, 256], DType::BF16, &values(64 * 256, 1.0, 1));
    let w = upload(d, &[128, 256], DType::BF16, &values(128 * 256, 0.1, 2));
    let first = ops.to_f32_vec(&ops.linear(&x, &w, None).unwrap()).unwrap();
    let (lt, _) = gpu.shape_plans().unwrap();
    println!("cuBLASLt plans after one linear: {lt}");
    d.forget_shape_plans().unwrap();
    assert_eq!(gpu.shape_plans().unwrap(), (0, 0));
    let again = ops.to_f32_vec(&ops.linear(&x, &w, None).unwrap()).unwrap();
    assert_eq!(first, again);
    assert_eq!(gpu.shape_plans().unwrap().0, lt);
}

#[test]
fn the_gemm_search_times_cublaslt_for_16_bit_shapes_only() {
    let Some(gpu) = common::open_gpu(false) else {
        return;
    };
    let ops = ops_of(&*gpu).unwrap();
    let shape = |dtype| ddo_core::GemmShape {
        rows: 512,
        k: 1024,
        n: 768,
        dtype,
    };
    let s = ops.best_gemm_seconds(&shape(DType::BF16), 5).unwrap();
    println!("cuBLASLt's fastest algorithm at 512x1024x768 bf16: {s:?} s");
    let s = s.expect("cuBLASLt runs bf16 linears");
    assert!(s > 0.0 && s < 1.0, "{s}");
    assert_eq!(ops.best_gemm_seconds(&shape(DType::F32), 5).unwrap(), None);
    // Nothing of the search is left allocated once the stream is done with it.
    gpu.synchronize().unwrap();
}
