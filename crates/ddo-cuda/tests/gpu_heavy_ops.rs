//! GPU tests of the CUDA backend's heavy ops — linear (cuBLASLt with fused bias and GELU
//! epilogues, and cuBLAS), `linear_gelu_tanh`, matmul, conv2d (cuBLAS, im2col) and
//! attention (fused tensor-core, fused CUDA-core and chunked cuBLAS paths) — against the host
//! backend's [`Ops`] (the reference) on fresh seeded random inputs: relative L2 ≤ 1e-5 in
//! f32, ≤ 1e-2 in f16/bf16. `heavy_ops_timings` prints (never asserts) medians of 10 runs of
//! the shapes that matter for Flux. Without a driver or a device each test prints
//! "skipped: no CUDA device" and passes (unless `DDO_REQUIRE_GPU=1`), like `tests/gpu.rs`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ddo_core::rng::SplitMix64;
use ddo_core::{Conv2dParams, DType, Device, Ops, Tensor};
use ddo_cuda::CudaDevice;
use ddo_host::HostDevice;

mod common;

use common::rel_l2;

/// Device 0, or `None` (after saying so) when there is no driver library or no device;
/// with `DDO_REQUIRE_GPU=1` a missing device fails the test instead.
fn gpu() -> Option<Arc<CudaDevice>> {
    common::open_gpu(false)
}

/// The reference backend.
fn host() -> Arc<HostDevice> {
    HostDevice::with_capacity(32 << 30).unwrap()
}

/// Relative L2 tolerance of a result stored as `dtype`.
fn tol(dtype: DType) -> f64 {
    if dtype == DType::F32 { 1e-5 } else { 1e-2 }
}

fn random(rng: &mut SplitMix64, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.next_signed() * scale).collect()
}

/// One operand, on both backends (same dtype, so the same rounded values).
struct Pair {
    g: Tensor,
    h: Tensor,
}

/// A tensor of `dtype` on the GPU, uploaded on the compute stream (through the `Device`
/// copy path only, so these tests need no other op of the CUDA backend).
fn up(gd: &CudaDevice, shape: &[usize], dtype: DType, v: &[f32]) -> Tensor {
    Tensor::from_f32(shape.to_vec(), dtype, v)
        .unwrap()
        .to_device(gd, &gd.compute_stream())
        .unwrap()
}

/// The values of a GPU tensor (waits for the compute stream).
fn down(gd: &CudaDevice, t: &Tensor) -> Vec<f32> {
    t.to_f32_vec(gd, &gd.compute_stream()).unwrap()
}

fn pair(gd: &CudaDevice, hd: &HostDevice, shape: &[usize], dtype: DType, v: &[f32]) -> Pair {
    Pair {
        g: up(gd, shape, dtype, v),
        h: hd.tensor_from_f32(shape, dtype, v).unwrap(),
    }
}

fn rand_pair(
    gd: &CudaDevice,
    hd: &HostDevice,
    rng: &mut SplitMix64,
    shape: &[usize],
    dtype: DType,
    scale: f32,
) -> Pair {
    let v = random(rng, shape.iter().product(), scale);
    pair(gd, hd, shape, dtype, &v)
}

/// Compares a GPU result with the host's: shape, dtype and values within `tol(dtype)`.
fn check(what: &str, gd: &CudaDevice, hd: &HostDevice, got: &Tensor, want: &Tensor) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    let (g, w) = (down(gd, got), hd.to_f32_vec(want).unwrap());
    let err = rel_l2(&g, &w);
    println!("{what}: rel L2 {err:.2e}");
    assert!(
        err <= tol(got.dtype()),
        "{what}: relative L2 {err:e} > {}",
        tol(got.dtype())
    );
}

#[test]
fn linear_matches_host_with_and_without_bias_and_batch_dims() {
    let Some(gd) = gpu() else { return };
    let hd = host();
    let mut rng = SplitMix64::new(21);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (xs, (o, i)) in [
            (vec![2, 37, 96], (80, 96)),
            (vec![5, 3], (7, 3)),
            (vec![300, 1024], (512, 1024)),
            (vec![1, 1, 4, 64], (1, 64)),
        ] {
            let x = rand_pair(&gd, &hd, &mut rng, &xs, dtype, 1.0);
            let w = rand_pair(&gd, &hd, &mut rng, &[o, i], dtype, 1.0);
            let b = rand_pair(&gd, &hd, &mut rng, &[o], dtype, 1.0);
            for with_bias in [false, true] {
                let (bg, bh) = if with_bias {
                    (Some(&b.g), Some(&b.h))
                } else {
                    (None, None)
                };
                let got = gd.linear(&x.g, &w.g, bg).unwrap();
                let want = hd.linear(&x.h, &w.h, bh).unwrap();
                check(
                    &format!("linear {dtype:?} x {xs:?} w [{o}, {i}] bias {with_bias}"),
                    &gd,
                    &hd,
                    &got,
                    &want,
                );
            }
        }
    }
    // Empty inner dimension: the bias (or zeros).
    let x = rand_pair(&gd, &hd, &mut rng, &[3, 0], DType::F32, 1.0);
    let w = rand_pair(&gd, &hd, &mut rng, &[4, 0], DType::F32, 1.0);
    let b = rand_pair(&gd, &hd, &mut rng, &[4], DType::F32, 1.0);
    check(
        "linear in = 0",
        &gd,
        &hd,
        &gd.linear(&x.g, &w.g, Some(&b.g)).unwrap(),
        &hd.linear(&x.h, &w.h, Some(&b.h)).unwrap(),
    );
    check(
        "linear in = 0, no bias",
        &gd,
        &hd,
        &gd.linear(&x.g, &w.g, None).unwrap(),
        &hd.linear(&x.h, &w.h, None).unwrap(),
    );
    // Shape errors are typed.
    let err = gd.linear(&x.g, &b.g, None).unwrap_err();
    assert!(matches!(err, ddo_core::CoreError::Shape { .. }), "{err}");
}

/// 16-bit linears on cuBLASLt (bias in the epilogue) and on cuBLAS (`set_cublaslt(false)`)
/// against the host, on one row, odd sizes, batch dims, one output feature and a quartered
/// Flux projection.
#[test]
fn cublaslt_linears_match_the_host_with_and_without_bias() {
    let Some(gd) = gpu() else { return };
    let hd = host();
    let mut rng = SplitMix64::new(41);
    let shapes: [(Vec<usize>, (usize, usize)); 7] = [
        (vec![1, 64], (96, 64)),
        (vec![1, 1, 768], (4608, 768)),
        (vec![7, 33], (45, 33)),
        (vec![2, 5, 40], (24, 40)),
        (vec![3, 17], (1, 17)),
        (vec![9, 72], (131, 72)),
        (vec![1152, 768], (3072, 768)),
    ];
    for dtype in [DType::F16, DType::BF16] {
        for (xs, (o, i)) in &shapes {
            let x = rand_pair(&gd, &hd, &mut rng, xs, dtype, 1.0);
            let w = rand_pair(&gd, &hd, &mut rng, &[*o, *i], dtype, 0.5);
            let b = rand_pair(&gd, &hd, &mut rng, &[*o], dtype, 1.0);
            for with_bias in [false, true] {
                let (bg, bh) = if with_bias {
                    (Some(&b.g), Some(&b.h))
                } else {
                    (None, None)
                };
                let want = hd.linear(&x.h, &w.h, bh).unwrap();
                for lt in [true, false] {
                    gd.set_cublaslt(lt);
                    let before = gd.cublaslt_runs();
                    let got = gd.linear(&x.g, &w.g, bg).unwrap();
                    let ran = gd.cublaslt_runs() - before;
                    check(
                        &format!(
                            "linear {dtype:?} x {xs:?} w [{o}, {i}] bias {with_bias} \
                             cublaslt {lt} (ran {ran})"
                        ),
                        &gd,
                        &hd,
                        &got,
                        &want,
                    );
                    if !lt {
                        assert_eq!(ran, 0, "cuBLASLt ran while switched off");
                    }
                }
            }
        }
    }
    gd.set_cublaslt(true);
    if let Some(why) = gd.cublaslt_refusal() {
        println!("last cuBLASLt refusal: {why}");
    }
}

/// Where libcublasLt loads (it ships with libcublas), an aligned bf16 linear with a bias and
/// a `linear_gelu_tanh` run on it; f32 linears never do.
#[test]
fn cublaslt_runs_the_aligned_16_bit_linears() {
    let Some(gd) = gpu() else { return };
    let hd = host();
    let mut rng = SplitMix64::new(42);
    let x = rand_pair(&gd, &hd, &mut rng, &[256, 512], DType::BF16, 1.0);
    let w = rand_pair(&gd, &hd, &mut rng, &[1024, 512], DType::BF16, 0.1);
    let b = rand_pair(&gd, &hd, &mut rng, &[1024], DType::BF16, 1.0);
    let before = gd.cublaslt_runs();
    let y = gd.linear(&x.g, &w.g, Some(&b.g)).unwrap();
    let g = gd.linear_gelu_tanh(&x.g, &w.g, Some(&b.g)).unwrap();
    let ran = gd.cublaslt_runs() - before;
    assert_eq!(
        ran,
        2,
        "cuBLASLt ran {ran} of 2 linears: {:?}",
        gd.cublaslt_refusal()
    );
    check(
        "linear bf16 on cuBLASLt",
        &gd,
        &hd,
        &y,
        &hd.linear(&x.h, &w.h, Some(&b.h)).unwrap(),
    );
    check(
        "linear_gelu_tanh bf16 on cuBLASLt",
        &gd,
        &hd,
        &g,
        &hd.linear_gelu_tanh(&x.h, &w.h, Some(&b.h)).unwrap(),
    );
    let x32 = rand_pair(&gd, &hd, &mut rng, &[16, 64], DType::F32, 1.0);
    let w32 = rand_pair(&gd, &hd, &mut rng, &[32, 64], DType::F32, 1.0);
    let before = gd.cublaslt_runs();
    let y32 = gd.linear(&x32.g, &w32.g, None).unwrap();
    assert_eq!(gd.cublaslt_runs(), before, "f32 stays on cuBLAS");
    check(
        "linear f32 on cuBLAS",
        &gd,
        &hd,
        &y32,
        &hd.linear(&x32.h, &w32.h, None).unwrap(),
    );
}

/// `linear_gelu_tanh` (cuBLASLt's GELU epilogue, or cuBLAS + the element-wise GELU) against
/// the host's composition `unary_owned(linear(..), GeluTanh)`, in every dtype.
#[test]
fn linear_gelu_tanh_matches_the_host_composition() {
    let Some(gd) = gpu() else { return };
    let hd = host();
    let mut rng = SplitMix64::new(43);
    let shapes: [(Vec<usize>, (usize, usize)); 5] = [
        (vec![1, 64], (96, 64)),
        (vec![7, 33], (45, 33)),
        (vec![2, 5, 40], (24, 40)),
        (vec![9, 72], (131, 72)),
        (vec![1152, 768], (3072, 768)),
    ];
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (xs, (o, i)) in &shapes {
            // Pre-activations of a few units: both GELU tails are exercised.
            let x = rand_pair(&gd, &hd, &mut rng, xs, dtype, 2.0);
            let w = rand_pair(&gd, &hd, &mut rng, &[*o, *i], dtype, 0.5);
            let b = rand_pair(&gd, &hd, &mut rng, &[*o], dtype, 2.0);
            for with_bias in [false, true] {
                let (bg, bh) = if with_bias {
                    (Some(&b.g), Some(&b.h))
                } else {
                    (None, None)
                };
                let want = hd.linear_gelu_tanh(&x.h, &w.h, bh).unwrap();
                for lt in [true, false] {
                    gd.set_cublaslt(lt);
                    let before = gd.cublaslt_runs();
                    let got = gd.linear_gelu_tanh(&x.g, &w.g, bg).unwrap();
                    let ran = gd.cublaslt_runs() - before;
                    check(
                        &format!(
                            "linear_gelu_tanh {dtype:?} x {xs:?} w [{o}, {i}] bias {with_bias} \
                             cublaslt {lt} (ran {ran})"
                        ),
                        &gd,
                        &hd,
                        &got,
                        &want,
                    );
                }
            }
        }
    }
    gd.set_cublaslt(true);
    // Shape errors are the linear's.
    let x = rand_pair(&gd, &hd, &mut rng, &[3, 8], DType::BF16, 1.0);
    let w = rand_pair(&gd, &hd, &mut rng, &[4, 9], DType::BF16, 1.0);
    let err = gd.linear_gelu_tanh(&x.g, &w.g, None).unwrap_err();
    assert!(matches!(err, ddo_core::CoreError::Shape { .. }), "{err}");
}

#[test]
fn matmul_matches_host_with_broadcast_batches() {
    let Some(gd) = gpu() else { return };
    let hd = host();
    let mut rng = SplitMix64::new(22);
    let cases: [(&[usize], &[usize]); 7] = [
        (&[33, 40], &[40, 50]),
        (&[2, 3, 33, 40], &[40, 50]),
        (&[4, 33, 40], &[4, 40, 50]),
        (&[33, 40], &[3, 40, 50]),
        (&[2, 1, 33, 40], &[1, 3, 40, 50]),
        (&[2, 3, 5, 17], &[2, 1, 17, 9]),
        (&[1, 24, 128, 64], &[1, 24, 64, 128]),
    ];
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for (as_, bs) in cases {
            let a = rand_pair(&gd, &hd, &mut rng, as_, dtype, 1.0);
            let b = rand_pair(&gd, &hd, &mut rng, bs, dtype, 1.0);
            let got = gd.matmul(&a.g, &b.g).unwrap();
            let want = hd.matmul(&a.h, &b.h).unwrap();
            check(
                &format!("matmul {dtype:?} {as_:?} x {bs:?}"),
                &gd,
                &hd,
                &got,
                &want,
            );
        }
    }
    let a = rand_pair(&gd, &hd, &mut rng, &[2, 5, 0], DType::F32, 1.0);
    let b = rand_pair(&gd, &hd, &mut rng, &[0, 3], DType::F32, 1.0);
    check(
        "matmul k = 0",
        &gd,
        &hd,
        &gd.matmul(&a.g, &b.g).unwrap(),
        &hd.matmul(&a.h, &b.h).unwrap(),
    );
}

/// Operands of different dtypes are cast to f32 (through the backend's `cast`), computed in
/// f32 and stored in the first input's dtype.
#[test]
fn mixed_dtypes_compute_in_f32() {
    let Some(gd) = gpu() else { return };
    let hd = host();
    let mut rng = SplitMix64::new(29);
    let x = rand_pair(&gd, &hd, &mut rng, &[9, 40], DType::BF16, 1.0);
    let w = rand_pair(&gd, &hd, &mut rng, &[24, 40], DType::F32, 1.0);
    let b = rand_pair(&gd, &hd, &mut rng, &[24], DType::F16, 1.0);
    let got = gd.linear(&x.g, &w.g, Some(&b.g)).unwrap();
    let want = hd.linear(&x.h, &w.h, Some(&b.h)).unwrap();
    check("linear mixed bf16 x f32 w f16 bias", &gd, &hd, &got, &want);
    let a = rand_pair(&gd, &hd, &mut rng, &[2, 5, 8], DType::F32, 1.0);
    let b = rand_pair(&gd, &hd, &mut rng, &[2, 8, 3], DType::BF16, 1.0);
    check(
        "matmul mixed f32 x bf16",
        &gd,
        &hd,
        &gd.matmul(&a.g, &b.g).unwrap(),
        &hd.matmul(&a.h, &b.h).unwrap(),
    );
    let x = rand_pair(&gd, &hd, &mut rng, &[2, 3, 9, 9], DType::BF16, 1.0);
    let w = rand_pair(&gd, &hd, &mut rng, &[4, 3, 3, 3], DType::F32, 0.3);
    check(
        "conv2d mixed bf16 x f32 w",
        &gd,
        &hd,
        &gd.conv2d(&x.g, &w.g, None, Conv2dParams::new(1, 1))
            .unwrap(),
        &hd.conv2d(&x.h, &w.h, None, Conv2dParams::new(1, 1))
            .unwrap(),
    );
}

#[allow(clippy::too_many_arguments)]
fn check_conv(
    gd: &CudaDevice,
    hd: &HostDevice,
    rng: &mut SplitMix64,
    dtype: DType,
    xs: [usize; 4],
    ws: [usize; 4],
    params: Conv2dParams,
    with_bias: bool,
) {
    let x = rand_pair(gd, hd, rng, &xs, dtype, 1.0);
    let w = rand_pair(gd, hd, rng, &ws, dtype, 0.2);
    let b = rand_pair(gd, hd, rng, &[ws[0]], dtype, 1.0);
    let (bg, bh) = if with_bias {
        (Some(&b.g), Some(&b.h))
    } else {
        (None, None)
    };
    let got = gd.conv2d(&x.g, &w.g, bg, params).unwrap();
    let want = hd.conv2d(&x.h, &w.h, bh, params).unwrap();
    check(
        &format!("conv2d {dtype:?} x {xs:?} w {ws:?} {params:?} bias {with_bias}"),
        gd,
        hd,
        &got,
        &want,
    );
}

#[test]
fn conv2d_matches_host_3x3_strided_and_1x1() {
    let Some(gd) = gpu() else { return };
    let hd = host();
    let mut rng = SplitMix64::new(23);
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for with_bias in [false, true] {
            check_conv(
                &gd,
                &hd,
                &mut rng,
                dtype,
                [2, 8, 17, 19],
                [12, 8, 3, 3],
                Conv2dParams::new(1, 1),
                with_bias,
            );
            check_conv(
                &gd,
                &hd,
                &mut rng,
                dtype,
                [2, 8, 17, 19],
                [12, 8, 3, 3],
                Conv2dParams::new(2, 1),
                with_bias,
            );
            check_conv(
                &gd,
                &hd,
                &mut rng,
                dtype,
                [2, 8, 17, 19],
                [12, 8, 1, 1],
                Conv2dParams::new(1, 0),
                with_bias,
            );
        }
        // 1×1 with a stride, a kernel with no padding, unequal stride and padding per axis.
        check_conv(
            &gd,
            &hd,
            &mut rng,
            dtype,
            [1, 6, 9, 10],
            [4, 6, 1, 1],
            Conv2dParams::new(2, 0),
            true,
        );
        check_conv(
            &gd,
            &hd,
            &mut rng,
            dtype,
            [3, 5, 12, 7],
            [6, 5, 3, 3],
            Conv2dParams::new(1, 0),
            true,
        );
        check_conv(
            &gd,
            &hd,
            &mut rng,
            dtype,
            [1, 4, 11, 13],
            [5, 4, 3, 2],
            Conv2dParams {
                stride: (2, 1),
                padding: (0, 1),
            },
            true,
        );
    }
    // Implicit-GEMM path (16-bit, any kernel but 1×1 stride 1): several output-channel
    // tiles, channel counts that are not multiples of 32, VAE-like shapes, several images.
    check_conv(
        &gd,
        &hd,
        &mut rng,
        DType::BF16,
        [1, 16, 30, 40],
        [200, 16, 3, 3],
        Conv2dParams::new(1, 1),
        true,
    );
    check_conv(
        &gd,
        &hd,
        &mut rng,
        DType::F16,
        [2, 24, 33, 31],
        [40, 24, 3, 3],
        Conv2dParams::new(2, 1),
        false,
    );
    check_conv(
        &gd,
        &hd,
        &mut rng,
        DType::BF16,
        [1, 64, 64, 64],
        [128, 64, 3, 3],
        Conv2dParams::new(1, 1),
        true,
    );
    check_conv(
        &gd,
        &hd,
        &mut rng,
        DType::BF16,
        [3, 128, 96, 80],
        [128, 128, 3, 3],
        Conv2dParams::new(1, 1),
        true,
    );
    check_conv(
        &gd,
        &hd,
        &mut rng,
        DType::BF16,
        [1, 512, 32, 32],
        [512, 512, 3, 3],
        Conv2dParams::new(1, 1),
        true,
    );
    check_conv(
        &gd,
        &hd,
        &mut rng,
        DType::BF16,
        [1, 128, 256, 256],
        [3, 128, 3, 3],
        Conv2dParams::new(1, 1),
        true,
    );
    check_conv(
        &gd,
        &hd,
        &mut rng,
        DType::F16,
        [2, 32, 20, 24],
        [48, 32, 3, 3],
        Conv2dParams::new(1, 1),
        true,
    );
    // im2col path (f32) in chunks: one image per chunk (3 chunks), several images per chunk,
    // and one image larger than the scratch (bands of output rows); and a 5×5 kernel with
    // 36 channels on the implicit-GEMM path.
    check_conv(
        &gd,
        &hd,
        &mut rng,
        DType::F32,
        [3, 60, 256, 256],
        [8, 60, 3, 3],
        Conv2dParams::new(1, 1),
        true,
    );
    check_conv(
        &gd,
        &hd,
        &mut rng,
        DType::F32,
        [5, 20, 64, 64],
        [16, 20, 3, 3],
        Conv2dParams::new(1, 1),
        true,
    );
    check_conv(
        &gd,
        &hd,
        &mut rng,
        DType::BF16,
        [1, 36, 512, 512],
        [16, 36, 5, 5],
        Conv2dParams::new(1, 2),
        true,
    );
    check_conv(
        &gd,
        &hd,
        &mut rng,
        DType::F32,
        [1, 36, 512, 512],
        [16, 36, 5, 5],
        Conv2dParams::new(1, 2),
        true,
    );
    check_conv(
        &gd,
        &hd,
        &mut rng,
        DType::F32,
        [1, 128, 64, 64],
        [128, 128, 1, 1],
        Conv2dParams::new(1, 0),
        true,
    );
    // A shape error is typed.
    let x = rand_pair(&gd, &hd, &mut rng, &[1, 2, 4, 4], DType::F32, 1.0);
    let w = rand_pair(&gd, &hd, &mut rng, &[3, 4, 3, 3], DType::F32, 1.0);
    let err = gd
        .conv2d(&x.g, &w.g, None, Conv2dParams::new(1, 1))
        .unwrap_err();
    assert!(matches!(err, ddo_core::CoreError::Shape { .. }), "{err}");
}

/// Attention on both backends; `dims = [b, h, lq, lk, d, dv]`, q/k/v dtypes, an optional
/// mask shape (values in [-2, 2) with every 7th entry -inf).
fn check_attention(
    gd: &CudaDevice,
    hd: &HostDevice,
    rng: &mut SplitMix64,
    dims: [usize; 6],
    dtypes: [DType; 3],
    mask_shape: Option<&[usize]>,
) {
    let [b, h, lq, lk, d, dv] = dims;
    let q = rand_pair(gd, hd, rng, &[b, h, lq, d], dtypes[0], 2.0);
    let k = rand_pair(gd, hd, rng, &[b, h, lk, d], dtypes[1], 2.0);
    let v = rand_pair(gd, hd, rng, &[b, h, lk, dv], dtypes[2], 1.0);
    let mask = mask_shape.map(|ms| {
        let mut m = random(rng, ms.iter().product(), 2.0);
        for (i, x) in m.iter_mut().enumerate() {
            if i % 7 == 3 {
                *x = f32::NEG_INFINITY;
            }
        }
        pair(gd, hd, ms, DType::F32, &m)
    });
    let scale = 1.0 / (d as f32).sqrt();
    let got = gd
        .attention(&q.g, &k.g, &v.g, mask.as_ref().map(|m| &m.g), scale)
        .unwrap();
    let want = hd
        .attention(&q.h, &k.h, &v.h, mask.as_ref().map(|m| &m.h), scale)
        .unwrap();
    check(
        &format!("attention {dims:?} {dtypes:?} mask {mask_shape:?}"),
        gd,
        hd,
        &got,
        &want,
    );
}

#[test]
fn attention_matches_host_on_every_path() {
    let Some(gd) = gpu() else { return };
    let hd = host();
    let mut rng = SplitMix64::new(24);
    let bf = [DType::BF16; 3];
    let f16 = [DType::F16; 3];
    let f32 = [DType::F32; 3];
    // Fused tensor-core path (16-bit, d = dv in {64, 128}): lq != lk, tails, masks.
    check_attention(&gd, &hd, &mut rng, [1, 3, 100, 130, 64, 64], bf, None);
    check_attention(
        &gd,
        &hd,
        &mut rng,
        [2, 2, 200, 333, 128, 128],
        bf,
        Some(&[2, 1, 200, 333]),
    );
    check_attention(
        &gd,
        &hd,
        &mut rng,
        [2, 3, 64, 64, 128, 128],
        f16,
        Some(&[64]),
    );
    check_attention(
        &gd,
        &hd,
        &mut rng,
        [1, 2, 77, 300, 64, 64],
        f16,
        Some(&[1, 2, 77, 300]),
    );
    check_attention(
        &gd,
        &hd,
        &mut rng,
        [1, 1, 5, 7, 128, 128],
        bf,
        Some(&[5, 1]),
    );
    // Fused CUDA-core path: f32, odd head sizes, d != dv, mixed dtypes (dv in two launches).
    check_attention(
        &gd,
        &hd,
        &mut rng,
        [2, 3, 70, 90, 64, 64],
        f32,
        Some(&[2, 3, 70, 90]),
    );
    check_attention(&gd, &hd, &mut rng, [1, 2, 100, 129, 128, 128], f32, None);
    check_attention(&gd, &hd, &mut rng, [1, 2, 50, 61, 40, 40], bf, Some(&[61]));
    check_attention(&gd, &hd, &mut rng, [1, 2, 50, 61, 128, 64], bf, None);
    check_attention(
        &gd,
        &hd,
        &mut rng,
        [1, 1, 40, 45, 600, 600],
        [DType::F32, DType::BF16, DType::BF16],
        Some(&[1, 1, 40, 45]),
    );
    // Chunked cuBLAS path (max(d, dv) > 128): the VAE's single-head d = 512.
    check_attention(
        &gd,
        &hd,
        &mut rng,
        [1, 1, 700, 700, 512, 512],
        bf,
        Some(&[700, 700]),
    );
    check_attention(&gd, &hd, &mut rng, [1, 1, 300, 257, 512, 512], f32, None);
    check_attention(
        &gd,
        &hd,
        &mut rng,
        [2, 2, 65, 80, 256, 192],
        f16,
        Some(&[2, 1, 1, 80]),
    );
}

/// cuDNN's fused attention (on by default where libcudnn loads) and DDO's NVRTC kernels
/// (with it switched off) both match the host, at Flux's, T5's and CLIP's head sizes, with
/// masks in the inputs' dtype broadcast over batch and heads, prepared ahead or not; every
/// call of an eligible shape runs on cuDNN (its counter moves: a call waits for its plan),
/// and with it off none does. The same for `attention_tokens` (the output in token order,
/// written by cuDNN through its strides), which says whether it gave the head order's bytes.
#[test]
fn attention_on_cudnn_and_on_the_nvrtc_kernels_match_the_host() {
    let Some(gd) = gpu() else { return };
    let hd = host();
    let mut rng = SplitMix64::new(31);
    for (dims, dtype, mask_shape) in [
        ([1, 4, 1024, 1024, 128], DType::BF16, None),
        ([2, 3, 100, 130, 64], DType::BF16, None),
        ([1, 3, 300, 300, 128], DType::F16, None),
        ([2, 4, 77, 77, 64], DType::BF16, Some(vec![1, 1, 77, 77])),
        ([1, 4, 96, 96, 64], DType::BF16, Some(vec![1, 4, 96, 96])),
    ] {
        let [b, h, lq, lk, d] = dims;
        let q = rand_pair(&gd, &hd, &mut rng, &[b, h, lq, d], dtype, 2.0);
        let k = rand_pair(&gd, &hd, &mut rng, &[b, h, lk, d], dtype, 2.0);
        let v = rand_pair(&gd, &hd, &mut rng, &[b, h, lk, d], dtype, 1.0);
        let mask = mask_shape.as_ref().map(|ms| {
            let m = random(&mut rng, ms.iter().product(), 2.0);
            pair(&gd, &hd, ms, dtype, &m)
        });
        let scale = 1.0 / (d as f32).sqrt();
        let want = hd
            .attention(&q.h, &k.h, &v.h, mask.as_ref().map(|m| &m.h), scale)
            .unwrap();
        for on in [true, false] {
            gd.set_cudnn_attention(on);
            if on && dims[0] == 2 {
                // A prepared shape builds in the background; the call waits for it either way.
                let q_shape = [b, h, lq, d];
                let k_shape = [b, h, lk, d];
                gd.prepare_attention(
                    &q_shape,
                    &k_shape,
                    &k_shape,
                    mask_shape.as_deref().map(|m| (m, dtype)),
                    dtype,
                );
            }
            let before = gd.cudnn_attention_runs();
            let got = gd
                .attention(&q.g, &k.g, &v.g, mask.as_ref().map(|m| &m.g), scale)
                .unwrap();
            let ran = gd.cudnn_attention_runs() - before;
            let what = format!("attention {dims:?} {dtype:?} mask {mask_shape:?} cudnn {on}");
            check(&what, &gd, &hd, &got, &want);
            assert_eq!(
                ran,
                u64::from(on),
                "{what}: cuDNN ran {ran} times; last refusal: {:?}",
                gd.cudnn_attention_refusal()
            );
            // In token order ([b, lq, h·d], the models' call): on cuDNN through the
            // output's strides, else the composition; the host's composition either way.
            let want_tokens = hd
                .attention_tokens(&q.h, &k.h, &v.h, mask.as_ref().map(|m| &m.h), scale)
                .unwrap();
            let before = gd.cudnn_attention_runs();
            let tokens = gd
                .attention_tokens(&q.g, &k.g, &v.g, mask.as_ref().map(|m| &m.g), scale)
                .unwrap();
            let ran = gd.cudnn_attention_runs() - before;
            assert_eq!(tokens.shape(), [b, lq, h * d]);
            check(&format!("{what} tokens"), &gd, &hd, &tokens, &want_tokens);
            assert_eq!(
                ran,
                u64::from(on),
                "{what} tokens: cuDNN ran {ran} times; last refusal: {:?}",
                gd.cudnn_attention_refusal()
            );
            let heads_order = gd
                .permute(&got, &[0, 2, 1, 3])
                .unwrap()
                .reshape(&[b, lq, h * d])
                .unwrap();
            let same = gd.to_f32_vec(&tokens).unwrap() == gd.to_f32_vec(&heads_order).unwrap();
            println!("{what}: token order gives the head order's bytes: {same}");
            if !on {
                assert!(same, "{what}: the composition is the same ops");
            }
        }
        gd.set_cudnn_attention(true);
    }
}

#[test]
fn attention_rows_with_every_key_masked_are_nan_like_the_host() {
    let Some(gd) = gpu() else { return };
    let hd = host();
    let mut rng = SplitMix64::new(25);
    for (dtype, d) in [(DType::BF16, 128), (DType::F32, 64), (DType::BF16, 512)] {
        let (lq, lk) = (9, 20);
        let q = rand_pair(&gd, &hd, &mut rng, &[1, 1, lq, d], dtype, 1.0);
        let k = rand_pair(&gd, &hd, &mut rng, &[1, 1, lk, d], dtype, 1.0);
        let v = rand_pair(&gd, &hd, &mut rng, &[1, 1, lk, d], dtype, 1.0);
        let mut m = vec![0.0f32; lq * lk];
        m[2 * lk..3 * lk].fill(f32::NEG_INFINITY);
        let mask = pair(&gd, &hd, &[lq, lk], DType::F32, &m);
        let got = gd.attention(&q.g, &k.g, &v.g, Some(&mask.g), 0.1).unwrap();
        let want = hd.attention(&q.h, &k.h, &v.h, Some(&mask.h), 0.1).unwrap();
        check(
            &format!("attention fully masked row {dtype:?} d {d}"),
            &gd,
            &hd,
            &got,
            &want,
        );
        assert!(down(&gd, &got)[2 * d..3 * d].iter().all(|x| x.is_nan()));
    }
}

/// A negative or zero scale reverses (or flattens) the scores' order: every path must still
/// match, including full unmasked tiles of the tensor-core path.
#[test]
fn attention_with_negative_and_zero_scale() {
    let Some(gd) = gpu() else { return };
    let hd = host();
    let mut rng = SplitMix64::new(30);
    for (dtype, d) in [
        (DType::BF16, 64),
        (DType::F16, 128),
        (DType::F32, 64),
        (DType::BF16, 512),
    ] {
        for scale in [-0.3f32, 0.0] {
            let q = rand_pair(&gd, &hd, &mut rng, &[1, 2, 100, d], dtype, 2.0);
            let k = rand_pair(&gd, &hd, &mut rng, &[1, 2, 128, d], dtype, 2.0);
            let v = rand_pair(&gd, &hd, &mut rng, &[1, 2, 128, d], dtype, 1.0);
            let got = gd.attention(&q.g, &k.g, &v.g, None, scale).unwrap();
            let want = hd.attention(&q.h, &k.h, &v.h, None, scale).unwrap();
            check(
                &format!("attention scale {scale} {dtype:?} d {d}"),
                &gd,
                &hd,
                &got,
                &want,
            );
        }
    }
}

#[test]
fn attention_long_sequence_on_a_subsample_of_heads() {
    let Some(gd) = gpu() else { return };
    let hd = host();
    let mut rng = SplitMix64::new(26);
    let (heads, l, d) = (24, 4096, 128);
    let n = heads * l * d;
    let (qv, kv, vv) = (
        random(&mut rng, n, 2.0),
        random(&mut rng, n, 2.0),
        random(&mut rng, n, 1.0),
    );
    let shape = [1, heads, l, d];
    let got = {
        let q = up(&gd, &shape, DType::BF16, &qv);
        let k = up(&gd, &shape, DType::BF16, &kv);
        let v = up(&gd, &shape, DType::BF16, &vv);
        let o = gd
            .attention(&q, &k, &v, None, 1.0 / (d as f32).sqrt())
            .unwrap();
        down(&gd, &o)
    };
    let picked = [0usize, 13, 23];
    let take = |v: &[f32]| -> Vec<f32> {
        picked
            .iter()
            .flat_map(|&hh| v[hh * l * d..(hh + 1) * l * d].to_vec())
            .collect()
    };
    let sub = [1, picked.len(), l, d];
    let q = hd.tensor_from_f32(&sub, DType::BF16, &take(&qv)).unwrap();
    let k = hd.tensor_from_f32(&sub, DType::BF16, &take(&kv)).unwrap();
    let v = hd.tensor_from_f32(&sub, DType::BF16, &take(&vv)).unwrap();
    let want = hd
        .attention(&q, &k, &v, None, 1.0 / (d as f32).sqrt())
        .unwrap();
    let err = rel_l2(&take(&got), &hd.to_f32_vec(&want).unwrap());
    println!("attention b1 h24 l4096 d128 bf16, heads {picked:?} vs host: rel L2 {err:.2e}");
    assert!(err <= 1e-2, "relative L2 {err:e}");
}

#[test]
fn blas_workspace_is_released_on_request_and_comes_back() {
    let Some(gd) = gpu() else { return };
    let hd = host();
    let mut rng = SplitMix64::new(27);
    let x = rand_pair(&gd, &hd, &mut rng, &[64, 256], DType::BF16, 1.0);
    let w = rand_pair(&gd, &hd, &mut rng, &[128, 256], DType::BF16, 1.0);
    let y = gd.linear(&x.g, &w.g, None).unwrap();
    gd.synchronize().unwrap();
    let before = gd.memory_info().allocated;
    let released = gd.release_blas_workspaces().unwrap();
    assert_eq!(released, 32 << 20);
    assert_eq!(gd.memory_info().allocated, before - released);
    assert_eq!(gd.release_blas_workspaces().unwrap(), 0);
    let y2 = gd.linear(&x.g, &w.g, None).unwrap();
    check(
        "linear after a workspace release",
        &gd,
        &hd,
        &y2,
        &hd.linear(&x.h, &w.h, None).unwrap(),
    );
    drop(y);
}

/// Median wall time of `f` over 10 runs after 3 warm-ups, each ended by a device sync.
fn median_ms(gd: &CudaDevice, mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    gd.synchronize().unwrap();
    let mut times: Vec<Duration> = (0..10)
        .map(|_| {
            let t = Instant::now();
            f();
            gd.synchronize().unwrap();
            t.elapsed()
        })
        .collect();
    times.sort();
    times[5].as_secs_f64() * 1e3
}

#[test]
fn heavy_ops_timings() {
    let Some(gd) = gpu() else { return };
    let mut rng = SplitMix64::new(28);
    let mut t = |shape: &[usize], scale: f32| {
        let v = random(&mut rng, shape.iter().product(), scale);
        up(&gd, shape, DType::BF16, &v)
    };
    // Each timing is of work that ran: positive, and no faster than an H200's dense bf16
    // peak (about 990 TFLOP/s) allows; a time below that means the op was not waited for.
    let report = |what: &str, ms: f64, flops: f64| {
        let tflops = flops / ms / 1e9;
        println!("timing {what}: {ms:.3} ms ({tflops:.1} TFLOP/s)");
        assert!(ms > 0.0 && ms.is_finite(), "{what}: {ms} ms");
        assert!(
            tflops < 1500.0,
            "{what}: {tflops:.0} TFLOP/s is beyond the GPU"
        );
    };

    let (x, w, b) = (
        t(&[4608, 3072], 1.0),
        t(&[3072, 3072], 0.02),
        t(&[3072], 1.0),
    );
    let ms = median_ms(&gd, || drop(gd.linear(&x, &w, Some(&b)).unwrap()));
    report(
        "linear [4608,3072]x[3072,3072]^T + bias bf16",
        ms,
        2.0 * 4608.0 * 3072.0 * 3072.0,
    );
    let ms = median_ms(&gd, || drop(gd.linear(&x, &w, None).unwrap()));
    report(
        "linear [4608,3072]x[3072,3072]^T bf16",
        ms,
        2.0 * 4608.0 * 3072.0 * 3072.0,
    );
    gd.set_cublaslt(false);
    let ms = median_ms(&gd, || drop(gd.linear(&x, &w, Some(&b)).unwrap()));
    report(
        "linear [4608,3072]x[3072,3072]^T + bias bf16, cuBLAS (cuBLASLt off)",
        ms,
        2.0 * 4608.0 * 3072.0 * 3072.0,
    );
    let ms = median_ms(&gd, || drop(gd.linear(&x, &w, None).unwrap()));
    report(
        "linear [4608,3072]x[3072,3072]^T bf16, cuBLAS (cuBLASLt off)",
        ms,
        2.0 * 4608.0 * 3072.0 * 3072.0,
    );
    // The two paths timed compute the same linear.
    let on_cublas = down(&gd, &gd.linear(&x, &w, Some(&b)).unwrap());
    gd.set_cublaslt(true);
    let on_cublaslt = down(&gd, &gd.linear(&x, &w, Some(&b)).unwrap());
    let e = rel_l2(&on_cublaslt, &on_cublas);
    println!("linear on cuBLASLt against cuBLAS: relative L2 {e:.2e}");
    assert!(e <= tol(DType::BF16), "cuBLASLt and cuBLAS differ: {e:e}");
    drop((w, b));
    // Flux's MLP projection: 3072 -> 12288 with bias and GELU.
    let (w, b) = (t(&[12288, 3072], 0.02), t(&[12288], 1.0));
    let flops = 2.0 * 4608.0 * 3072.0 * 12288.0;
    for lt in [true, false] {
        gd.set_cublaslt(lt);
        let ms = median_ms(&gd, || drop(gd.linear_gelu_tanh(&x, &w, Some(&b)).unwrap()));
        report(
            &format!("linear_gelu_tanh [4608,3072]x[12288,3072]^T + bias bf16, cuBLASLt {lt}"),
            ms,
            flops,
        );
        let ms = median_ms(&gd, || drop(gd.linear(&x, &w, Some(&b)).unwrap()));
        report(
            &format!("linear [4608,3072]x[12288,3072]^T + bias bf16, cuBLASLt {lt}"),
            ms,
            flops,
        );
    }
    gd.set_cublaslt(true);
    drop((x, w, b));

    for (c_in, c_out, side) in [
        (512, 512, 128),
        (512, 512, 256),
        (512, 512, 512),
        (256, 256, 512),
        (256, 256, 1024),
        (128, 128, 1024),
        (128, 3, 1024),
    ] {
        let x = t(&[1, c_in, side, side], 1.0);
        let w = t(&[c_out, c_in, 3, 3], 0.02);
        let b = t(&[c_out], 1.0);
        let ms = median_ms(&gd, || {
            drop(
                gd.conv2d(&x, &w, Some(&b), Conv2dParams::new(1, 1))
                    .unwrap(),
            )
        });
        let flops = 2.0 * (c_out * c_in * 9) as f64 * (side * side) as f64;
        report(
            &format!("conv 3x3 {c_in}->{c_out} at {side}^2 bf16"),
            ms,
            flops,
        );
    }

    let (q, k, v) = (
        t(&[1, 24, 4608, 128], 2.0),
        t(&[1, 24, 4608, 128], 2.0),
        t(&[1, 24, 4608, 128], 1.0),
    );
    let ms = median_ms(&gd, || drop(gd.attention(&q, &k, &v, None, 0.088).unwrap()));
    report(
        "attention b1 h24 l4608 d128 bf16",
        ms,
        4.0 * 24.0 * 4608.0 * 4608.0 * 128.0,
    );
    drop((q, k, v));
    let (q, k, v) = (
        t(&[1, 1, 16384, 512], 1.0),
        t(&[1, 1, 16384, 512], 1.0),
        t(&[1, 1, 16384, 512], 1.0),
    );
    let ms = median_ms(&gd, || drop(gd.attention(&q, &k, &v, None, 0.044).unwrap()));
    report(
        "attention b1 h1 l16384 d512 bf16 (VAE mid-block)",
        ms,
        4.0 * 16384.0 * 16384.0 * 512.0,
    );
}
