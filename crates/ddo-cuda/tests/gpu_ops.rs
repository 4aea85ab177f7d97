//! GPU tests of the CUDA backend's compute plane (element-wise, normalisation, layout ops):
//! every op against the host backend's [`Ops`] (the reference) on the same seeded random
//! inputs, in f32, f16 and bf16, with broadcasting, odd and large sizes, offsets into
//! buffers, and the typed errors; the vectorised fast paths (16-byte element-wise and rope
//! kernels, unit copies, the warp-per-row norm, the group-norm statistics and apply) on
//! shapes on both sides of their conditions; the fused `group_norm_silu` against the host's
//! group norm then SiLU; `unary_owned` in place and its fallbacks; `linear_concat` against
//! `linear` of the concatenation; the fused `layer_norm_modulate` and `gated_add` against
//! the host's compositions, on each kernel and on the composition's layouts. Without a
//! driver or a device each test prints
//! "skipped: no CUDA device" and passes (unless `DDO_REQUIRE_GPU=1`), like `tests/gpu.rs`.

use std::sync::Arc;

use ddo_core::rng::SplitMix64;
use ddo_core::{
    BinaryOp, CoreError, DType, Device, HostBuffer, Ops, ReduceOp, Tensor, TensorStorage, UnaryOp,
};
use ddo_cuda::CudaDevice;
use ddo_host::HostDevice;

mod common;

/// Device 0, or `None` (after saying so) when there is no driver library or no device;
/// with `DDO_REQUIRE_GPU=1` a missing device fails the test instead.
fn gpu() -> Option<Arc<CudaDevice>> {
    common::open_gpu(false)
}

const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Relative L2 tolerance of a result stored as `dtype`.
fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 1e-5,
        DType::F16 => 2e-3,
        _ => 1e-2,
    }
}

fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "length");
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        let (g, w) = (f64::from(g), f64::from(w));
        if g.is_nan() && w.is_nan() || g == w {
            continue;
        }
        num += (g - w).powi(2);
        den += w * w;
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// The GPU under test beside the host reference.
struct Pair {
    gpu: Arc<CudaDevice>,
    host: Arc<HostDevice>,
    rng: SplitMix64,
}

impl Pair {
    fn new(seed: u64) -> Option<Self> {
        Some(Self {
            gpu: gpu()?,
            host: HostDevice::with_capacity(8 << 30).unwrap(),
            rng: SplitMix64::new(seed),
        })
    }

    fn random(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.rng.next_signed()).collect()
    }

    /// The same values on both devices.
    fn put(&self, shape: &[usize], dtype: DType, values: &[f32]) -> (Tensor, Tensor) {
        (
            self.gpu.tensor_from_f32(shape, dtype, values).unwrap(),
            self.host.tensor_from_f32(shape, dtype, values).unwrap(),
        )
    }

    /// Fresh random values (in [-1, 1)) on both devices.
    fn rand(&mut self, shape: &[usize], dtype: DType) -> (Tensor, Tensor) {
        let v = self.random(shape.iter().product());
        self.put(shape, dtype, &v)
    }

    /// Checks a GPU result against the host's: shape, dtype and values.
    #[track_caller]
    fn check(&self, what: &str, got: &Tensor, want: &Tensor) {
        assert!(got.is_on_device());
        assert_eq!(got.shape(), want.shape(), "{what}: shape");
        assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
        let g = self.gpu.to_f32_vec(got).unwrap();
        let w = self.host.to_f32_vec(want).unwrap();
        let e = rel_l2(&g, &w);
        let t = tol(want.dtype());
        assert!(e <= t, "{what}: relative L2 error {e:e} > {t:e}");
    }

    /// [`Pair::check`] with the plain relative L2, every element in both sums
    /// ([`common::rel_l2`]).
    fn check_all(&self, what: &str, got: &Tensor, want: &Tensor) {
        assert!(got.is_on_device());
        assert_eq!(got.shape(), want.shape(), "{what}: shape");
        assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
        let g = self.gpu.to_f32_vec(got).unwrap();
        let w = self.host.to_f32_vec(want).unwrap();
        let e = common::rel_l2(&g, &w);
        let t = tol(want.dtype());
        assert!(e <= t, "{what}: relative L2 error {e:e} > {t:e}");
    }

    /// Checks that a GPU result equals the host's exactly (layout ops, casts).
    #[track_caller]
    fn check_exact(&self, what: &str, got: &Tensor, want: &Tensor) {
        assert_eq!(got.shape(), want.shape(), "{what}: shape");
        assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
        let g = self.gpu.to_f32_vec(got).unwrap();
        let w = self.host.to_f32_vec(want).unwrap();
        assert_eq!(g.len(), w.len(), "{what}: length");
        if let Some(i) = g
            .iter()
            .zip(&w)
            .position(|(a, b)| a.to_bits() != b.to_bits() && !(a.is_nan() && b.is_nan()))
        {
            panic!("{what}: element {i} is {:?}, the host has {:?}", g[i], w[i]);
        }
    }

    /// Nothing allocated on the GPU any more.
    fn assert_clean(&self) {
        self.gpu.synchronize().unwrap();
        assert_eq!(
            self.gpu.memory_info().allocated,
            0,
            "{:?}",
            self.gpu.allocator_stats()
        );
    }
}

const UNARY: [UnaryOp; 12] = [
    UnaryOp::Silu,
    UnaryOp::GeluTanh,
    UnaryOp::GeluErf,
    UnaryOp::QuickGelu,
    UnaryOp::Sigmoid,
    UnaryOp::Tanh,
    UnaryOp::Relu,
    UnaryOp::Exp,
    UnaryOp::Neg,
    UnaryOp::Square,
    UnaryOp::Sqrt,
    UnaryOp::Recip,
];

const BINARY: [BinaryOp; 6] = [
    BinaryOp::Add,
    BinaryOp::Sub,
    BinaryOp::Mul,
    BinaryOp::Div,
    BinaryOp::Max,
    BinaryOp::Min,
];

#[test]
fn unary_ops_match_the_host() {
    let Some(mut p) = Pair::new(1) else { return };
    for dtype in DTYPES {
        for n in [1usize, 31, 1000, 4099] {
            // Wide range (tails of GELU, sigmoid); positive for sqrt and recip.
            let wide: Vec<f32> = p.random(n).iter().map(|v| v * 12.0).collect();
            let positive: Vec<f32> = wide.iter().map(|v| v.abs() + 0.05).collect();
            for op in UNARY {
                let values = match op {
                    UnaryOp::Sqrt | UnaryOp::Recip => &positive,
                    UnaryOp::Exp => &p.random(n).iter().map(|v| v * 6.0).collect(),
                    _ => &wide,
                };
                let (g, h) = p.put(&[n], dtype, values);
                let what = format!("{op:?} {dtype} n={n}");
                p.check(
                    &what,
                    &p.gpu.unary(&g, op).unwrap(),
                    &p.host.unary(&h, op).unwrap(),
                );
            }
        }
    }
    p.assert_clean();
}

#[test]
fn gelu_erf_tails_are_precise_elementwise() {
    let Some(p) = Pair::new(2) else { return };
    let xs: Vec<f32> = (-120..=40).map(|i| i as f32 * 0.125).collect();
    let (g, h) = p.put(&[xs.len()], DType::F32, &xs);
    let got = p
        .gpu
        .to_f32_vec(&p.gpu.unary(&g, UnaryOp::GeluErf).unwrap())
        .unwrap();
    let want = p
        .host
        .to_f32_vec(&p.host.unary(&h, UnaryOp::GeluErf).unwrap())
        .unwrap();
    for ((x, a), b) in xs.iter().zip(&got).zip(&want) {
        let err = (a - b).abs() / b.abs().max(1e-30);
        assert!(err < 1e-5 || a == b, "gelu_erf({x}): {a} vs {b}");
    }
}

#[test]
fn binary_ops_broadcast_like_the_host() {
    let Some(mut p) = Pair::new(3) else { return };
    let cases: [(&[usize], &[usize]); 9] = [
        (&[257], &[257]),
        (&[3, 1, 5], &[4, 5]),
        (&[2, 3, 4, 5], &[5]),
        (&[1], &[7, 1]),
        (&[6, 1], &[1, 9]),
        (&[2, 3, 4, 5], &[2, 1, 4, 1]),
        (&[1, 1, 1], &[1]),
        // Seven dims that do not coalesce below six: more than one launch.
        (&[2, 1, 3, 1, 5, 1, 2], &[1, 4, 1, 6, 1, 3, 1]),
        (&[0, 3], &[1, 3]),
    ];
    for (sa, sb) in cases {
        for (da, db) in [
            (DType::F32, DType::F32),
            (DType::BF16, DType::BF16),
            (DType::F16, DType::F32),
            (DType::F32, DType::BF16),
        ] {
            let (ga, ha) = p.rand(sa, da);
            let bv: Vec<f32> = p
                .random(sb.iter().product())
                .iter()
                .map(|v| {
                    if v.abs() < 0.1 {
                        v.signum() * 0.5 + v
                    } else {
                        *v
                    }
                })
                .collect();
            let (gb, hb) = p.put(sb, db, &bv);
            for op in BINARY {
                let what = format!("{op:?} {sa:?}:{da} with {sb:?}:{db}");
                p.check(
                    &what,
                    &p.gpu.binary(&ga, &gb, op).unwrap(),
                    &p.host.binary(&ha, &hb, op).unwrap(),
                );
                // And the other way round.
                p.check(
                    &format!("{what} (swapped)"),
                    &p.gpu.binary(&gb, &ga, op).unwrap(),
                    &p.host.binary(&hb, &ha, op).unwrap(),
                );
            }
        }
    }
    p.assert_clean();
}

#[test]
fn large_one_dimensional_tensors() {
    let Some(mut p) = Pair::new(4) else { return };
    let n = 3 * (1 << 20) + 17;
    for dtype in [DType::F32, DType::BF16] {
        let (ga, ha) = p.rand(&[n], dtype);
        let (gb, hb) = p.rand(&[n], dtype);
        p.check(
            "add 3M",
            &p.gpu.binary(&ga, &gb, BinaryOp::Add).unwrap(),
            &p.host.binary(&ha, &hb, BinaryOp::Add).unwrap(),
        );
        p.check(
            "silu 3M",
            &p.gpu.unary(&ga, UnaryOp::Silu).unwrap(),
            &p.host.unary(&ha, UnaryOp::Silu).unwrap(),
        );
        p.check(
            "affine 3M",
            &p.gpu.affine(&ga, 0.5, -2.0).unwrap(),
            &p.host.affine(&ha, 0.5, -2.0).unwrap(),
        );
        p.check(
            "softmax over one 3M row",
            &p.gpu.softmax(&ga).unwrap(),
            &p.host.softmax(&ha).unwrap(),
        );
        for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
            // A sum of 3M values in [-1, 1): compare with an absolute bound as well, since
            // the sum itself is small against the values' magnitude.
            let got = p
                .gpu
                .to_f32_vec(&p.gpu.reduce(&ga, 0, op).unwrap())
                .unwrap();
            let want = p
                .host
                .to_f32_vec(&p.host.reduce(&ha, 0, op).unwrap())
                .unwrap();
            let bound = match dtype {
                DType::F32 => 0.05f32,
                _ => want[0].abs() * 1e-2 + 0.05,
            };
            assert!(
                (got[0] - want[0]).abs() <= bound.max(want[0].abs() * 1e-5),
                "{op:?} over 3M {dtype}: {} vs {}",
                got[0],
                want[0]
            );
        }
        p.check(
            "layer_norm of one 3M row",
            &p.gpu.layer_norm(&ga, None, None, 1e-5).unwrap(),
            &p.host.layer_norm(&ha, None, None, 1e-5).unwrap(),
        );
        let shape = [n];
        let (g2, h2) = (
            ga.reshape(&[1, 1, n]).unwrap(),
            ha.reshape(&[1, 1, n]).unwrap(),
        );
        p.check(
            "group_norm of one 3M group",
            &p.gpu.group_norm(&g2, 1, None, None, 1e-6).unwrap(),
            &p.host.group_norm(&h2, 1, None, None, 1e-6).unwrap(),
        );
        let other = if dtype == DType::F32 {
            DType::BF16
        } else {
            DType::F32
        };
        p.check_exact(
            "cast 3M",
            &p.gpu.cast(&ga, other).unwrap(),
            &p.host.cast(&ha, other).unwrap(),
        );
        p.check_exact(
            "narrow 3M",
            &p.gpu.narrow(&ga, 0, 5, n - 9).unwrap(),
            &p.host.narrow(&ha, 0, 5, n - 9).unwrap(),
        );
        let _ = shape;
    }
    p.assert_clean();
}

#[test]
fn affine_cast_and_softmax_match_the_host() {
    let Some(mut p) = Pair::new(5) else { return };
    for dtype in DTYPES {
        let (g, h) = p.rand(&[3, 7, 33], dtype);
        p.check(
            "affine",
            &p.gpu.affine(&g, -1.5, 0.25).unwrap(),
            &p.host.affine(&h, -1.5, 0.25).unwrap(),
        );
        for to in DTYPES {
            p.check_exact(
                &format!("cast {dtype} -> {to}"),
                &p.gpu.cast(&g, to).unwrap(),
                &p.host.cast(&h, to).unwrap(),
            );
        }
        for d in [1usize, 7, 100, 1000, 5003] {
            let v: Vec<f32> = p.random(5 * d).iter().map(|x| x * 20.0).collect();
            let (g, h) = p.put(&[5, d], dtype, &v);
            p.check(
                &format!("softmax {dtype} d={d}"),
                &p.gpu.softmax(&g).unwrap(),
                &p.host.softmax(&h).unwrap(),
            );
        }
    }
    // Casting rounds to nearest even, like the host, including overflow and NaN.
    let special = [
        1.0f32 + 1.0 / 256.0,
        1.0 + 3.0 / 256.0,
        70000.0,
        -70000.0,
        f32::NAN,
        f32::INFINITY,
        1e-8,
        -0.0,
        3.0e38,
    ];
    let (g, h) = p.put(&[special.len()], DType::F32, &special);
    for to in [DType::F16, DType::BF16] {
        p.check_exact(
            &format!("cast special values to {to}"),
            &p.gpu.cast(&g, to).unwrap(),
            &p.host.cast(&h, to).unwrap(),
        );
    }
    drop((g, h));
    p.assert_clean();
}

#[test]
fn reductions_match_the_host() {
    let Some(mut p) = Pair::new(6) else { return };
    for dtype in DTYPES {
        for shape in [&[3usize, 5, 7][..], &[1, 4097], &[64, 3], &[2, 1, 9, 1]] {
            let (g, h) = p.rand(shape, dtype);
            for dim in 0..shape.len() {
                for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
                    p.check(
                        &format!("{op:?} over dim {dim} of {shape:?} {dtype}"),
                        &p.gpu.reduce(&g, dim, op).unwrap(),
                        &p.host.reduce(&h, dim, op).unwrap(),
                    );
                }
            }
        }
    }
    // An empty dim (in the middle, and last): sum -0 (Rust's empty float sum, as the host),
    // mean NaN, max refused.
    for (shape, dim) in [([2usize, 0, 3], 1usize), ([2, 3, 0], 2)] {
        let (g, h) = p.put(&shape, DType::F32, &[]);
        for op in [ReduceOp::Sum, ReduceOp::Mean] {
            p.check_exact(
                &format!("empty {op:?} over dim {dim} of {shape:?}"),
                &p.gpu.reduce(&g, dim, op).unwrap(),
                &p.host.reduce(&h, dim, op).unwrap(),
            );
        }
        assert!(matches!(
            p.gpu.reduce(&g, dim, ReduceOp::Max),
            Err(CoreError::Shape { .. })
        ));
    }
    p.assert_clean();
}

#[test]
fn normalisations_match_the_host() {
    let Some(mut p) = Pair::new(7) else { return };
    for dtype in DTYPES {
        for d in [1usize, 5, 64, 768, 3001] {
            let v: Vec<f32> = p.random(9 * d).iter().map(|x| x * 3.0 + 1.5).collect();
            let (g, h) = p.put(&[3, 3, d], dtype, &v);
            let (gw, hw) = p.rand(&[d], DType::F32);
            let (gb, hb) = p.rand(&[d], dtype);
            for (w, b) in [(false, false), (true, false), (true, true), (false, true)] {
                let what = format!("layer_norm {dtype} d={d} w={w} b={b}");
                p.check(
                    &what,
                    &p.gpu
                        .layer_norm(&g, w.then_some(&gw), b.then_some(&gb), 1e-5)
                        .unwrap(),
                    &p.host
                        .layer_norm(&h, w.then_some(&hw), b.then_some(&hb), 1e-5)
                        .unwrap(),
                );
            }
            for w in [false, true] {
                p.check(
                    &format!("rms_norm {dtype} d={d} w={w}"),
                    &p.gpu.rms_norm(&g, w.then_some(&gw), 1e-6).unwrap(),
                    &p.host.rms_norm(&h, w.then_some(&hw), 1e-6).unwrap(),
                );
            }
        }
        // Group norm: small groups, groups longer than one statistics chunk (8192), an
        // odd spatial size, and no spatial dims at all.
        for (shape, groups) in [
            (&[2usize, 64, 33, 33][..], 32usize),
            (&[1, 4, 100, 100], 2),
            (&[3, 6, 7], 3),
            (&[4, 8], 4),
            (&[1, 32, 9, 17, 3], 8),
        ] {
            let c = shape[1];
            let v: Vec<f32> = p
                .random(shape.iter().product())
                .iter()
                .map(|x| x * 2.0 - 0.7)
                .collect();
            let (g, h) = p.put(shape, dtype, &v);
            let (gw, hw) = p.rand(&[c], dtype);
            let (gb, hb) = p.rand(&[c], DType::F32);
            for affine in [false, true] {
                p.check(
                    &format!("group_norm {dtype} {shape:?} groups={groups} affine={affine}"),
                    &p.gpu
                        .group_norm(
                            &g,
                            groups,
                            affine.then_some(&gw),
                            affine.then_some(&gb),
                            1e-6,
                        )
                        .unwrap(),
                    &p.host
                        .group_norm(
                            &h,
                            groups,
                            affine.then_some(&hw),
                            affine.then_some(&hb),
                            1e-6,
                        )
                        .unwrap(),
                );
            }
        }
    }
    p.assert_clean();
}

#[test]
fn rope_matches_the_host() {
    let Some(mut p) = Pair::new(8) else { return };
    for dtype in DTYPES {
        for (b, h, l, d) in [(1, 1, 1, 2), (2, 3, 17, 64), (1, 24, 333, 128)] {
            let (gx, hx) = p.rand(&[b, h, l, d], dtype);
            let (gc, hc) = p.rand(&[l, d], DType::F32);
            let (gs, hs) = p.rand(&[l, d], dtype);
            p.check(
                &format!("rope {dtype} {:?}", [b, h, l, d]),
                &p.gpu.rope(&gx, &gc, &gs).unwrap(),
                &p.host.rope(&hx, &hc, &hs).unwrap(),
            );
        }
    }
    p.assert_clean();
}

#[test]
fn layout_ops_match_the_host_exactly() {
    let Some(mut p) = Pair::new(9) else { return };
    for dtype in DTYPES {
        let (ga, ha) = p.rand(&[2, 3, 5], dtype);
        let (gb, hb) = p.rand(&[2, 4, 5], dtype);
        let (gc, hc) = p.rand(&[2, 1, 5], DType::F32);
        p.check_exact(
            "concat dim 1 (mixed dtypes)",
            &p.gpu.concat(&[&ga, &gb, &gc], 1).unwrap(),
            &p.host.concat(&[&ha, &hb, &hc], 1).unwrap(),
        );
        p.check_exact(
            "concat dim 0",
            &p.gpu.concat(&[&ga, &ga], 0).unwrap(),
            &p.host.concat(&[&ha, &ha], 0).unwrap(),
        );
        p.check_exact(
            "concat dim 2",
            &p.gpu.concat(&[&ga, &ga, &ga], 2).unwrap(),
            &p.host.concat(&[&ha, &ha, &ha], 2).unwrap(),
        );
        let (ge, he) = p.rand(&[2, 0, 5], dtype);
        p.check_exact(
            "concat with an empty input",
            &p.gpu.concat(&[&ga, &ge], 1).unwrap(),
            &p.host.concat(&[&ha, &he], 1).unwrap(),
        );
        for (dim, start, len) in [(0, 1, 1), (1, 1, 2), (2, 0, 5), (2, 3, 2), (1, 3, 0)] {
            p.check_exact(
                &format!("narrow {dim} {start} {len}"),
                &p.gpu.narrow(&ga, dim, start, len).unwrap(),
                &p.host.narrow(&ha, dim, start, len).unwrap(),
            );
        }
        let (g4, h4) = p.rand(&[2, 3, 4, 5], dtype);
        for dims in [
            [0, 1, 2, 3],
            [0, 2, 1, 3],
            [3, 2, 1, 0],
            [1, 3, 0, 2],
            [0, 1, 3, 2],
        ] {
            p.check_exact(
                &format!("permute {dims:?}"),
                &p.gpu.permute(&g4, &dims).unwrap(),
                &p.host.permute(&h4, &dims).unwrap(),
            );
        }
        // Eight dims reversed: no coalescing, two launches of six dims.
        let shape8 = [2, 3, 2, 2, 3, 2, 2, 3];
        let (g8, h8) = p.rand(&shape8, dtype);
        let rev = [7, 6, 5, 4, 3, 2, 1, 0];
        p.check_exact(
            "permute of 8 dims",
            &p.gpu.permute(&g8, &rev).unwrap(),
            &p.host.permute(&h8, &rev).unwrap(),
        );
        for shape in [[1usize, 1, 1, 1], [2, 3, 5, 7], [1, 4, 64, 33]] {
            let (g, h) = p.rand(&shape, dtype);
            p.check_exact(
                &format!("upsample {shape:?}"),
                &p.gpu.upsample_nearest2x(&g).unwrap(),
                &p.host.upsample_nearest2x(&h).unwrap(),
            );
        }
        let (gt, ht) = p.rand(&[50, 33], dtype);
        for ids in [&[0u32, 49, 7, 7, 3][..], &[], &[12]] {
            p.check_exact(
                &format!("embedding {ids:?}"),
                &p.gpu.embedding(&gt, ids).unwrap(),
                &p.host.embedding(&ht, ids).unwrap(),
            );
        }
    }
    p.assert_clean();
}

#[test]
fn uploads_and_downloads_round_trip() {
    let Some(mut p) = Pair::new(10) else { return };
    for dtype in DTYPES {
        let v = p.random(1001);
        let t = p.gpu.tensor_from_f32(&[7, 11, 13], dtype, &v).unwrap();
        assert_eq!(t.shape(), &[7, 11, 13]);
        let back = p.gpu.to_f32_vec(&t).unwrap();
        let encoded = dtype.decode_f32(&dtype.encode_f32(&v).unwrap()).unwrap();
        assert_eq!(back, encoded, "{dtype}");
        let empty = p.gpu.tensor_from_f32(&[0, 4], dtype, &[]).unwrap();
        assert!(p.gpu.to_f32_vec(&empty).unwrap().is_empty());
    }
    p.assert_clean();
}

#[test]
fn inputs_at_an_offset_in_their_buffer_are_read_from_there() {
    let Some(mut p) = Pair::new(11) else { return };
    let v = p.random(100);
    let bytes = DType::F32.encode_f32(&v).unwrap();
    let buffer = p.gpu.alloc(64 + bytes.len()).unwrap();
    let stream = p.gpu.compute_stream();
    p.gpu
        .copy_h2d(
            &HostBuffer::pageable_from(&bytes).slice_all(),
            &buffer.slice(64, bytes.len()).unwrap(),
            &stream,
        )
        .unwrap();
    let x = Tensor::new(
        vec![10, 10],
        DType::F32,
        TensorStorage::Device(buffer.slice(64, bytes.len()).unwrap()),
    )
    .unwrap();
    let (_, h) = p.put(&[10, 10], DType::F32, &v);
    p.check(
        "softmax at an offset",
        &p.gpu.softmax(&x).unwrap(),
        &p.host.softmax(&h).unwrap(),
    );
    p.check_exact(
        "permute at an offset",
        &p.gpu.permute(&x, &[1, 0]).unwrap(),
        &p.host.permute(&h, &[1, 0]).unwrap(),
    );
    drop((x, buffer));
    p.assert_clean();
}

#[test]
fn ops_read_what_a_pinned_copy_queued_before_them_wrote() {
    let Some(mut p) = Pair::new(12) else { return };
    let n = 1 << 20;
    let v = p.random(n);
    let bytes = DType::F32.encode_f32(&v).unwrap();
    let pinned = p.gpu.alloc_pinned(bytes.len()).unwrap();
    pinned
        .with_bytes_mut(|b| b.copy_from_slice(&bytes))
        .unwrap();
    let buffer = p.gpu.alloc(bytes.len()).unwrap();
    let stream = p.gpu.compute_stream();
    p.gpu
        .copy_h2d(&pinned.slice_all(), &buffer.slice_all(), &stream)
        .unwrap();
    let x = Tensor::new(
        vec![n],
        DType::F32,
        TensorStorage::Device(buffer.slice_all()),
    )
    .unwrap();
    let (_, h) = p.put(&[n], DType::F32, &v);
    p.check(
        "exp after a queued copy",
        &p.gpu.unary(&x, UnaryOp::Exp).unwrap(),
        &p.host.unary(&h, UnaryOp::Exp).unwrap(),
    );
    drop((x, buffer, pinned));
    p.assert_clean();
}

#[test]
fn bad_shapes_wrong_devices_and_ids_are_typed_errors() {
    let Some(mut p) = Pair::new(13) else { return };
    let shape_err = |r: ddo_core::Result<Tensor>| match r {
        Err(CoreError::Shape { .. }) => {}
        other => panic!("expected a shape error, got {other:?}"),
    };
    let (g, h) = p.rand(&[2, 3], DType::F32);
    let (g3, _) = p.rand(&[3, 2], DType::F32);
    shape_err(p.gpu.binary(&g, &g3, BinaryOp::Add));
    shape_err(p.gpu.reduce(&g, 2, ReduceOp::Sum));
    shape_err(p.gpu.narrow(&g, 1, 2, 2));
    shape_err(p.gpu.narrow(&g, 2, 0, 1));
    shape_err(p.gpu.permute(&g, &[0, 0]));
    shape_err(p.gpu.permute(&g, &[0]));
    shape_err(p.gpu.concat(&[&g, &g3], 0));
    shape_err(p.gpu.concat(&[], 0));
    shape_err(p.gpu.upsample_nearest2x(&g));
    shape_err(p.gpu.group_norm(&g, 2, None, None, 1e-5));
    shape_err(p.gpu.group_norm(&g, 0, None, None, 1e-5));
    shape_err(p.gpu.group_norm_silu(&g, 2, None, None, 1e-5));
    shape_err(
        p.gpu
            .group_norm_silu(&g.reshape(&[6]).unwrap(), 1, None, None, 1e-5),
    );
    shape_err(p.gpu.group_norm_silu(&g, 1, Some(&g3), None, 1e-5));
    shape_err(p.gpu.layer_norm(&g, Some(&g), None, 1e-5));
    shape_err(p.gpu.rms_norm(&g, Some(&g3), 1e-5));
    shape_err(p.gpu.rope(&g, &g3, &g3));
    shape_err(p.gpu.embedding(&g, &[2]));
    shape_err(p.gpu.embedding(&g3, &[0, 1, 2, 3]));
    shape_err(p.gpu.tensor_from_f32(&[2, 2], DType::F32, &[1.0]));
    shape_err(p.gpu.tensor_from_f32(&[1], DType::Quantized, &[1.0]));
    let scalar = p.gpu.tensor_from_f32(&[], DType::F32, &[1.0]).unwrap();
    shape_err(p.gpu.softmax(&scalar));
    shape_err(p.gpu.layer_norm(&scalar, None, None, 1e-5));
    // Tensors of the host, of host memory, or of another CudaDevice instance.
    let wrong = |r: ddo_core::Result<Tensor>| match r {
        Err(CoreError::WrongDevice { .. }) => {}
        other => panic!("expected a wrong-device error, got {other:?}"),
    };
    wrong(p.gpu.unary(&h, UnaryOp::Relu));
    wrong(p.gpu.binary(&g, &h, BinaryOp::Add));
    let host_tensor = Tensor::from_f32(vec![2], DType::F32, &[1.0, 2.0]).unwrap();
    wrong(p.gpu.softmax(&host_tensor));
    assert!(matches!(
        p.gpu.to_f32_vec(&host_tensor),
        Err(CoreError::WrongDevice { .. })
    ));
    let other = CudaDevice::new(0).unwrap();
    let foreign = other
        .tensor_from_f32(&[2], DType::F32, &[1.0, 2.0])
        .unwrap();
    wrong(p.gpu.affine(&foreign, 1.0, 0.0));
    // Nothing leaked by the refusals.
    drop((g, g3, scalar));
    p.assert_clean();
}

#[test]
fn the_device_exposes_its_ops_and_outputs_are_freed() {
    let Some(mut p) = Pair::new(14) else { return };
    assert!(p.gpu.ops().is_some());
    let (g, _) = p.rand(&[64, 64], DType::BF16);
    let ops = ddo_core::ops_of(&*p.gpu).unwrap();
    let before = p.gpu.memory_info().allocated;
    let y = ops.softmax(&g).unwrap();
    assert!(p.gpu.memory_info().allocated >= before + 64 * 64 * 2);
    // Drop the input while the kernel may still run: the free waits for it.
    drop(g);
    let z = ops.unary(&y, UnaryOp::Exp).unwrap();
    drop(y);
    assert_eq!(ops.to_f32_vec(&z).unwrap().len(), 64 * 64);
    drop(z);
    p.assert_clean();
}

/// Prints the effective bandwidth of a few large ops (informative; asserts only that they
/// run and that nothing leaks).
#[test]
fn large_ops_report_their_bandwidth() {
    let Some(p) = Pair::new(15) else { return };
    let g = &p.gpu;
    let time = |what: &str, bytes: usize, f: &dyn Fn() -> Tensor| {
        drop(f()); // compile and warm up
        g.synchronize().unwrap();
        let reps = 5;
        let start = std::time::Instant::now();
        for _ in 0..reps {
            drop(f());
        }
        g.synchronize().unwrap();
        let s = start.elapsed().as_secs_f64() / f64::from(reps);
        println!(
            "{what}: {:.3} ms, {:.0} GB/s",
            s * 1e3,
            bytes as f64 / s / 1e9
        );
    };
    let n = 64 << 20;
    let values: Vec<f32> = (0..n).map(|i| (i % 1000) as f32 * 1e-3).collect();
    let a = g.tensor_from_f32(&[n], DType::F32, &values).unwrap();
    let b = g.tensor_from_f32(&[n], DType::F32, &values).unwrap();
    time("add f32 64M", 3 * 4 * n, &|| {
        g.binary(&a, &b, BinaryOp::Add).unwrap()
    });
    let row = g
        .tensor_from_f32(&[1, 8192], DType::F32, &values[..8192])
        .unwrap();
    time("add f32 64M + broadcast row", 2 * 4 * n, &|| {
        g.binary(&a.reshape(&[n / 8192, 8192]).unwrap(), &row, BinaryOp::Add)
            .unwrap()
    });
    time("gelu_erf f32 64M", 2 * 4 * n, &|| {
        g.unary(&a, UnaryOp::GeluErf).unwrap()
    });
    let x = g
        .cast(&a, DType::BF16)
        .unwrap()
        .reshape(&[1, 256, 512, 512])
        .unwrap();
    time(
        "group_norm bf16 [1,256,512,512] 32 groups",
        2 * 2 * n,
        &|| g.group_norm(&x, 32, None, None, 1e-6).unwrap(),
    );
    time(
        "group_norm_silu bf16 [1,256,512,512] 32 groups",
        2 * 2 * n,
        &|| g.group_norm_silu(&x, 32, None, None, 1e-6).unwrap(),
    );
    // Planes of the Flux VAE decoder's last block ([1, 128, 1024, 1024]), half the
    // channels, with the affine.
    let wide = x.reshape(&[1, 64, 1024, 1024]).unwrap();
    let w128 = g
        .tensor_from_f32(&[64], DType::BF16, &values[..64])
        .unwrap();
    time(
        "group_norm_silu bf16 [1,64,1024,1024] 32 groups, affine",
        2 * 2 * n,
        &|| {
            g.group_norm_silu(&wide, 32, Some(&w128), Some(&w128), 1e-6)
                .unwrap()
        },
    );
    drop((wide, w128));
    let rows = x.reshape(&[16384, 4096]).unwrap();
    time("layer_norm bf16 [16384, 4096]", 2 * 2 * n, &|| {
        g.layer_norm(&rows, None, None, 1e-6).unwrap()
    });
    time("softmax bf16 [16384, 4096]", 2 * 2 * n, &|| {
        g.softmax(&rows).unwrap()
    });
    let heads = x.reshape(&[4, 4096, 32, 128]).unwrap();
    time(
        "permute bf16 [4,4096,32,128] -> [0,2,1,3]",
        2 * 2 * n,
        &|| g.permute(&heads, &[0, 2, 1, 3]).unwrap(),
    );
    let small = g.narrow(&x, 1, 0, 64).unwrap();
    time("upsample bf16 [1,64,512,512]", 5 * 2 * (n / 4), &|| {
        g.upsample_nearest2x(&small).unwrap()
    });
    drop((a, b, row, x, rows, heads, small));
    p.assert_clean();
}

// ---- Vectorised fast paths, in-place unary, linear over concatenated parts ---------------
//
// Each fast path (16-byte vector kernels, unit copies, the warp-per-row norm, the per-part
// GEMMs of `linear_concat`) against the host reference, with shapes on both sides of its
// conditions: whole vectors and not, aligned addresses and not, one dtype and mixed.

impl Pair {
    /// `values` on the GPU starting `offset` bytes into a larger buffer (so not 16-byte
    /// aligned unless `offset` is, and never the whole buffer), and on the host as usual.
    fn put_at(
        &self,
        offset: usize,
        shape: &[usize],
        dtype: DType,
        values: &[f32],
    ) -> (Tensor, Tensor) {
        let bytes = dtype.encode_f32(values).unwrap();
        let buffer = self.gpu.alloc(offset + bytes.len()).unwrap();
        let slice = buffer.slice(offset, bytes.len()).unwrap();
        self.gpu
            .copy_h2d(
                &HostBuffer::pageable_from(&bytes).slice_all(),
                &slice,
                &self.gpu.compute_stream(),
            )
            .unwrap();
        (
            Tensor::new(shape.to_vec(), dtype, TensorStorage::Device(slice)).unwrap(),
            self.host.tensor_from_f32(shape, dtype, values).unwrap(),
        )
    }

    /// Relative L2 distance between two GPU results.
    fn gpu_rel_l2(&self, got: &Tensor, want: &Tensor) -> f64 {
        assert_eq!(got.shape(), want.shape(), "shape");
        rel_l2(
            &self.gpu.to_f32_vec(got).unwrap(),
            &self.gpu.to_f32_vec(want).unwrap(),
        )
    }
}

#[test]
fn vectorised_binary_ops_match_the_host_exactly() {
    let Some(mut p) = Pair::new(16) else { return };
    let cases: [(&[usize], &[usize], DType, DType); 14] = [
        // Flux's gate: [1, L, 3072] * [1, 1, 3072], b moving along the vectors only.
        (&[1, 512, 3072], &[1, 1, 3072], DType::BF16, DType::BF16),
        // Same shapes (a residual add).
        (&[1, 256, 3072], &[1, 256, 3072], DType::BF16, DType::BF16),
        // A scalar: stride 0 along the innermost dim, one element repeated per vector.
        (&[1, 64, 3072], &[1], DType::BF16, DType::BF16),
        // A per-row scale: broadcast along the innermost dim, moving across rows.
        (&[64, 128], &[64, 1], DType::BF16, DType::BF16),
        // A broadcast middle dim.
        (&[3, 5, 8], &[1, 5, 8], DType::F16, DType::F16),
        // f32: 4 lanes per vector.
        (&[7, 12], &[12], DType::F32, DType::F32),
        (&[7, 12], &[7, 12], DType::F32, DType::F32),
        (&[7, 12], &[1], DType::F32, DType::F32),
        // Innermost dims that are no whole number of vectors: the scalar kernels.
        (&[4, 21], &[21], DType::BF16, DType::BF16),
        (&[3, 7], &[3, 7], DType::BF16, DType::BF16),
        (&[7, 10], &[10], DType::F32, DType::F32),
        (&[5, 12], &[1], DType::BF16, DType::BF16),
        (&[6, 4], &[6, 1], DType::BF16, DType::BF16),
        // Mixed dtypes: the scalar kernels.
        (&[4, 64], &[64], DType::F32, DType::BF16),
    ];
    for (sa, sb, dtype, bdtype) in cases {
        let (ga, ha) = p.rand(sa, dtype);
        // Divisors kept away from 0.
        let bv: Vec<f32> = p
            .random(sb.iter().product())
            .iter()
            .map(|v| v + v.signum() * 0.25)
            .collect();
        let (gb, hb) = p.put(sb, bdtype, &bv);
        for op in BINARY {
            // Every op is one IEEE operation rounded once: the same bits as the host.
            let what = format!("{op:?} {sa:?}:{dtype} with {sb:?}:{bdtype}");
            p.check_exact(
                &what,
                &p.gpu.binary(&ga, &gb, op).unwrap(),
                &p.host.binary(&ha, &hb, op).unwrap(),
            );
            p.check_exact(
                &format!("{what} (swapped)"),
                &p.gpu.binary(&gb, &ga, op).unwrap(),
                &p.host.binary(&hb, &ha, op).unwrap(),
            );
        }
    }
    // Operands (and whole vectors) at addresses that are not 16-byte aligned.
    for dtype in DTYPES {
        let esize = dtype.size_in_bytes();
        let av = p.random(4 * 64);
        let (ga, ha) = p.put_at(esize, &[4, 64], dtype, &av);
        let (gb, hb) = p.rand(&[64], dtype);
        let (gs, hs) = p.rand(&[1], dtype);
        for op in [BinaryOp::Add, BinaryOp::Mul] {
            p.check_exact(
                &format!("{op:?} {dtype} misaligned a"),
                &p.gpu.binary(&ga, &gb, op).unwrap(),
                &p.host.binary(&ha, &hb, op).unwrap(),
            );
            p.check_exact(
                &format!("{op:?} {dtype} misaligned b"),
                &p.gpu.binary(&gb, &ga, op).unwrap(),
                &p.host.binary(&hb, &ha, op).unwrap(),
            );
            p.check_exact(
                &format!("{op:?} {dtype} misaligned a with a scalar"),
                &p.gpu.binary(&ga, &gs, op).unwrap(),
                &p.host.binary(&ha, &hs, op).unwrap(),
            );
        }
    }
    p.assert_clean();
}

#[test]
fn vectorised_unary_and_affine_match_the_host() {
    let Some(mut p) = Pair::new(17) else { return };
    for dtype in DTYPES {
        // Whole vectors for every dtype (4096), for f32 only (12), for none (4099, 7).
        for n in [4096usize, 12, 4099, 7] {
            let wide: Vec<f32> = p.random(n).iter().map(|v| v * 8.0).collect();
            let positive: Vec<f32> = wide.iter().map(|v| v.abs() + 0.05).collect();
            let small: Vec<f32> = wide.iter().map(|v| v * 0.5).collect();
            for op in UNARY {
                let values = match op {
                    UnaryOp::Sqrt | UnaryOp::Recip => &positive,
                    UnaryOp::Exp => &small,
                    _ => &wide,
                };
                let (g, h) = p.put(&[n], dtype, values);
                p.check(
                    &format!("{op:?} {dtype} n={n}"),
                    &p.gpu.unary(&g, op).unwrap(),
                    &p.host.unary(&h, op).unwrap(),
                );
            }
            let (g, h) = p.put(&[n], dtype, &wide);
            p.check(
                &format!("affine {dtype} n={n}"),
                &p.gpu.affine(&g, 0.75, -1.25).unwrap(),
                &p.host.affine(&h, 0.75, -1.25).unwrap(),
            );
        }
        // Whole vectors, but not 16-byte aligned: the scalar kernel.
        let v = p.random(64);
        let (g, h) = p.put_at(dtype.size_in_bytes(), &[8, 8], dtype, &v);
        p.check(
            &format!("silu {dtype} misaligned"),
            &p.gpu.unary(&g, UnaryOp::Silu).unwrap(),
            &p.host.unary(&h, UnaryOp::Silu).unwrap(),
        );
        p.check(
            &format!("affine {dtype} misaligned"),
            &p.gpu.affine(&g, 2.0, 0.5).unwrap(),
            &p.host.affine(&h, 2.0, 0.5).unwrap(),
        );
    }
    p.assert_clean();
}

#[test]
fn unary_owned_runs_in_place_when_it_can_and_falls_back_otherwise() {
    let Some(mut p) = Pair::new(18) else { return };
    let cases: [(&[usize], DType); 4] = [
        (&[256, 3072], DType::BF16),
        (&[300, 12], DType::F32),
        (&[64, 128], DType::F16),
        (&[1, 4096], DType::BF16),
    ];
    for (shape, dtype) in cases {
        for op in [UnaryOp::GeluTanh, UnaryOp::Silu, UnaryOp::Neg] {
            let what = format!("{op:?} {dtype} {shape:?}");
            // Held by nobody else, whole vectors, aligned: in place.
            let (mut g, h) = p.rand(shape, dtype);
            assert!(g.has_exclusive_device_buffer(), "{what}: a fresh upload");
            let bytes = g.nbytes() as u64;
            p.gpu.reset_peak();
            let before = p.gpu.memory_info().allocated;
            let mut y = p.gpu.unary_owned(g, op).unwrap();
            let m = p.gpu.memory_info();
            assert_eq!(m.allocated, before, "{what}: allocated changed");
            assert!(
                m.peak_allocated < before + bytes,
                "{what}: peak {} reached x's {bytes} bytes over {before}: a second buffer",
                m.peak_allocated
            );
            assert!(y.has_exclusive_device_buffer(), "{what}: the result");
            p.check(&what, &y, &p.host.unary(&h, op).unwrap());

            // Again over its own output, right behind the kernel that wrote it.
            let y2 = p.gpu.unary_owned(y, op).unwrap();
            let h2 = p.host.unary(&p.host.unary(&h, op).unwrap(), op).unwrap();
            p.check(&format!("{what} twice in place"), &y2, &h2);
            drop(y2);

            // A clone held: a new buffer, and the clone keeps the original values.
            let (g, h) = p.rand(shape, dtype);
            let keep = g.clone();
            p.gpu.reset_peak();
            let before = p.gpu.memory_info().allocated;
            let y = p.gpu.unary_owned(g, op).unwrap();
            assert!(
                p.gpu.memory_info().peak_allocated >= before + bytes,
                "{what}: a shared x was not given an output of its own"
            );
            p.check(
                &format!("{what} (clone held)"),
                &y,
                &p.host.unary(&h, op).unwrap(),
            );
            p.check_exact(&format!("{what}: the clone"), &keep, &h);
            drop((y, keep));
        }
    }
    // Exclusive but no whole number of vectors, empty, or a part of a larger buffer: the
    // out-of-place kernel, same values.
    for (shape, dtype) in [
        (&[1001usize][..], DType::BF16),
        (&[3, 7], DType::F32),
        (&[0, 8], DType::BF16),
    ] {
        let (g, h) = p.rand(shape, dtype);
        p.check(
            &format!("silu {dtype} {shape:?} (scalar fallback)"),
            &p.gpu.unary_owned(g, UnaryOp::Silu).unwrap(),
            &p.host.unary(&h, UnaryOp::Silu).unwrap(),
        );
    }
    for offset in [2usize, 16] {
        let v = p.random(64);
        let (g, h) = p.put_at(offset, &[64], DType::BF16, &v);
        p.check(
            &format!("silu of a tensor {offset} bytes into its buffer"),
            &p.gpu.unary_owned(g, UnaryOp::Silu).unwrap(),
            &p.host.unary(&h, UnaryOp::Silu).unwrap(),
        );
    }
    // A view sharing the buffer is left as it was.
    let (g, h) = p.rand(&[16, 64], DType::BF16);
    let view = g.reshape(&[1024]).unwrap();
    p.check(
        "silu with a reshape view held",
        &p.gpu.unary_owned(g, UnaryOp::Silu).unwrap(),
        &p.host.unary(&h, UnaryOp::Silu).unwrap(),
    );
    p.check_exact("the reshape view", &view, &h.reshape(&[1024]).unwrap());
    drop(view);
    p.assert_clean();
}

#[test]
fn vectorised_rope_matches_the_host() {
    let Some(mut p) = Pair::new(19) else { return };
    for dtype in DTYPES {
        // f32 tables of whole vectors: the vector kernel for f16/bf16 x; tables of 6 or 42
        // elements, and f32 x, take the scalar one.
        for (b, h, l, d) in [
            (1, 24, 77, 128),
            (1, 24, 1, 128),
            (2, 3, 5, 16),
            (1, 2, 3, 2),
            (1, 1, 7, 6),
        ] {
            let (gx, hx) = p.rand(&[b, h, l, d], dtype);
            let (gc, hc) = p.rand(&[l, d], DType::F32);
            let (gs, hs) = p.rand(&[l, d], DType::F32);
            p.check(
                &format!("rope {dtype} {:?} f32 tables", [b, h, l, d]),
                &p.gpu.rope(&gx, &gc, &gs).unwrap(),
                &p.host.rope(&hx, &hc, &hs).unwrap(),
            );
        }
        // x not 16-byte aligned.
        let v = p.random(2 * 4 * 8);
        let (gx, hx) = p.put_at(dtype.size_in_bytes(), &[1, 2, 4, 8], dtype, &v);
        let (gc, hc) = p.rand(&[4, 8], DType::F32);
        let (gs, hs) = p.rand(&[4, 8], DType::F32);
        p.check(
            &format!("rope {dtype} misaligned x"),
            &p.gpu.rope(&gx, &gc, &gs).unwrap(),
            &p.host.rope(&hx, &hc, &hs).unwrap(),
        );
    }
    p.assert_clean();
}

#[test]
fn layout_unit_copies_match_the_host_exactly() {
    let Some(mut p) = Pair::new(20) else { return };
    for dtype in DTYPES {
        // Attention heads: [1, L, 24, d] <-> [1, 24, L, d]; rows of 16-byte units (d = 128),
        // 8- or 4-byte units (d = 4, 2), none (d = 5, 3, 1).
        for d in [128usize, 4, 2, 5, 3, 1] {
            let (g, h) = p.rand(&[1, 77, 24, d], dtype);
            let pg = p.gpu.permute(&g, &[0, 2, 1, 3]).unwrap();
            let ph = p.host.permute(&h, &[0, 2, 1, 3]).unwrap();
            p.check_exact(&format!("permute {dtype} d={d}"), &pg, &ph);
            p.check_exact(
                &format!("permute back {dtype} d={d}"),
                &p.gpu.permute(&pg, &[0, 2, 1, 3]).unwrap(),
                &p.host.permute(&ph, &[0, 2, 1, 3]).unwrap(),
            );
        }
        let (g, h) = p.rand(&[2, 3, 16, 64], dtype);
        p.check_exact(
            &format!("permute {dtype} [0, 3, 1, 2]"),
            &p.gpu.permute(&g, &[0, 3, 1, 2]).unwrap(),
            &p.host.permute(&h, &[0, 3, 1, 2]).unwrap(),
        );

        // Concat: along dim 1 (text and image tokens) and dim 2 (attention beside MLP), and
        // widths whose rows or offsets are no whole number of units.
        let concat_cases: [(&[&[usize]], usize); 8] = [
            (&[&[1, 77, 3072], &[1, 51, 3072]], 1),
            (&[&[2, 64, 128], &[2, 32, 128]], 1),
            (&[&[1, 9, 8], &[1, 9, 8], &[1, 9, 8]], 1),
            (&[&[2, 3, 5], &[2, 4, 5]], 1),
            (&[&[1, 77, 3072], &[1, 77, 12288]], 2),
            (&[&[1, 5, 4], &[1, 5, 6]], 2),
            (&[&[1, 5, 3], &[1, 5, 7]], 2),
            (&[&[3, 2, 1], &[3, 2, 8]], 2),
        ];
        for (shapes, dim) in concat_cases {
            let parts: Vec<(Tensor, Tensor)> = shapes.iter().map(|s| p.rand(s, dtype)).collect();
            let gs: Vec<&Tensor> = parts.iter().map(|(g, _)| g).collect();
            let hs: Vec<&Tensor> = parts.iter().map(|(_, h)| h).collect();
            p.check_exact(
                &format!("concat {dtype} {shapes:?} along {dim}"),
                &p.gpu.concat(&gs, dim).unwrap(),
                &p.host.concat(&hs, dim).unwrap(),
            );
        }

        // Narrow along dims 1 and 2, aligned and not.
        let (g, h) = p.rand(&[1, 300, 3072], dtype);
        for (dim, start, len) in [(1, 77, 100), (1, 0, 300), (2, 1024, 2048), (2, 0, 3072)] {
            p.check_exact(
                &format!("narrow {dtype} [1, 300, 3072] dim {dim} {start}+{len}"),
                &p.gpu.narrow(&g, dim, start, len).unwrap(),
                &p.host.narrow(&h, dim, start, len).unwrap(),
            );
        }
        let (g, h) = p.rand(&[2, 50, 24], dtype);
        for (dim, start, len) in [
            (2, 3, 5),
            (2, 1, 6),
            (2, 2, 6),
            (2, 4, 8),
            (2, 8, 16),
            (1, 1, 3),
            (1, 7, 40),
        ] {
            p.check_exact(
                &format!("narrow {dtype} [2, 50, 24] dim {dim} {start}+{len}"),
                &p.gpu.narrow(&g, dim, start, len).unwrap(),
                &p.host.narrow(&h, dim, start, len).unwrap(),
            );
        }
    }
    p.assert_clean();
}

#[test]
fn row_norms_match_the_host_on_the_warp_and_block_kernels() {
    let Some(mut p) = Pair::new(21) else { return };
    for dtype in [DType::BF16, DType::F32] {
        // d <= 512: a warp per row (128: Flux's per-head q/k norms; 33: a partial warp; 512:
        // the longest); d > 512: a block per row.
        for shape in [
            &[2usize, 64, 3072][..],
            &[1, 24, 64, 128],
            &[48, 33],
            &[48, 512],
            &[48, 513],
            &[40, 600],
        ] {
            let d = shape[shape.len() - 1];
            let v: Vec<f32> = p
                .random(shape.iter().product())
                .iter()
                .map(|x| x * 3.0 + 1.5)
                .collect();
            let (g, h) = p.put(shape, dtype, &v);
            let (gw, hw) = p.rand(&[d], dtype);
            let (gb, hb) = p.rand(&[d], dtype);
            for (w, b) in [(false, false), (true, true)] {
                p.check(
                    &format!("layer_norm {dtype} {shape:?} w={w} b={b}"),
                    &p.gpu
                        .layer_norm(&g, w.then_some(&gw), b.then_some(&gb), 1e-6)
                        .unwrap(),
                    &p.host
                        .layer_norm(&h, w.then_some(&hw), b.then_some(&hb), 1e-6)
                        .unwrap(),
                );
            }
            for w in [false, true] {
                p.check(
                    &format!("rms_norm {dtype} {shape:?} w={w}"),
                    &p.gpu.rms_norm(&g, w.then_some(&gw), 1e-6).unwrap(),
                    &p.host.rms_norm(&h, w.then_some(&hw), 1e-6).unwrap(),
                );
            }
        }
    }
    p.assert_clean();
}

#[test]
fn linear_concat_matches_linear_of_the_concatenation() {
    let Some(mut p) = Pair::new(22) else { return };
    // Flux's single-stream output projection: attention [.., 3072] beside the MLP's
    // [.., 12288]. `out` is kept small so the host reference stays quick.
    let (rows, out, wa, wb) = (64usize, 512usize, 3072usize, 12288usize);
    let inp = wa + wb;
    // Values rounded to bf16, so the host's f32 reference sees exactly the GPU's inputs.
    let bf16 = |v: Vec<f32>| {
        DType::BF16
            .decode_f32(&DType::BF16.encode_f32(&v).unwrap())
            .unwrap()
    };
    let (xa, xb) = (bf16(p.random(rows * wa)), bf16(p.random(rows * wb)));
    let (w, b) = (bf16(p.random(out * inp)), bf16(p.random(out)));
    let g = |shape: &[usize], v: &[f32]| p.gpu.tensor_from_f32(shape, DType::BF16, v).unwrap();
    let h = |shape: &[usize], v: &[f32]| p.host.tensor_from_f32(shape, DType::F32, v).unwrap();
    let (ga, gb, gw, gbias) = (
        g(&[1, rows, wa], &xa),
        g(&[1, rows, wb], &xb),
        g(&[out, inp], &w),
        g(&[out], &b),
    );
    let (ha, hb, hw, hbias) = (
        h(&[1, rows, wa], &xa),
        h(&[1, rows, wb], &xb),
        h(&[out, inp], &w),
        h(&[out], &b),
    );
    let joined = p.gpu.concat(&[&ga, &gb], 2).unwrap();
    for bias in [false, true] {
        let got = p
            .gpu
            .linear_concat(&[&ga, &gb], &gw, bias.then_some(&gbias))
            .unwrap();
        assert_eq!(got.shape(), &[1, rows, out]);
        assert_eq!(got.dtype(), DType::BF16);
        let plain = p.gpu.linear(&joined, &gw, bias.then_some(&gbias)).unwrap();
        let reference = p
            .host
            .linear_concat(&[&ha, &hb], &hw, bias.then_some(&hbias))
            .unwrap();
        let got_v = p.gpu.to_f32_vec(&got).unwrap();
        let ref_v = p.host.to_f32_vec(&reference).unwrap();
        let (e_plain, e_ref) = (p.gpu_rel_l2(&got, &plain), rel_l2(&got_v, &ref_v));
        let e_plain_ref = rel_l2(&p.gpu.to_f32_vec(&plain).unwrap(), &ref_v);
        println!(
            "linear_concat bf16 [{rows}, {wa} + {wb}] -> {out}, bias {bias}: rel L2 {e_plain:.2e} \
             vs linear of the concatenation, {e_ref:.2e} vs the host's f32 (linear itself: \
             {e_plain_ref:.2e})"
        );
        assert!(e_plain < 1e-2, "bias {bias}: {e_plain:e} vs linear(concat)");
        assert!(e_ref < 1e-2, "bias {bias}: {e_ref:e} vs the host's f32");
    }
    drop((ga, gb, gw, gbias, joined));

    // Small shapes in every dtype: odd widths (column windows at odd offsets), an empty part
    // (first and in the middle), three parts, one part.
    for dtype in DTYPES {
        for widths in [&[3usize, 5, 8][..], &[16, 16], &[0, 8], &[7, 0, 9], &[11]] {
            let inp: usize = widths.iter().sum();
            let parts: Vec<(Tensor, Tensor)> = widths
                .iter()
                .map(|&wd| p.rand(&[2, 5, wd], dtype))
                .collect();
            let gs: Vec<&Tensor> = parts.iter().map(|(g, _)| g).collect();
            let hs: Vec<&Tensor> = parts.iter().map(|(_, h)| h).collect();
            let (gw, hw) = p.rand(&[9, inp], dtype);
            let (gb, hb) = p.rand(&[9], dtype);
            for bias in [false, true] {
                p.check(
                    &format!("linear_concat {dtype} widths {widths:?} bias {bias}"),
                    &p.gpu.linear_concat(&gs, &gw, bias.then_some(&gb)).unwrap(),
                    &p.host.linear_concat(&hs, &hw, bias.then_some(&hb)).unwrap(),
                );
            }
        }
    }

    // Parts of another dtype than the weight, or of mixed dtypes: concat, then linear.
    let (ga, ha) = p.rand(&[6, 16], DType::BF16);
    let (gb, hb) = p.rand(&[6, 24], DType::F32);
    let (gc, hc) = p.rand(&[6, 24], DType::BF16);
    let (gw, hw) = p.rand(&[10, 40], DType::BF16);
    let (gw32, hw32) = p.rand(&[10, 40], DType::F32);
    p.check(
        "linear_concat bf16 + f32 parts, bf16 weight",
        &p.gpu.linear_concat(&[&ga, &gb], &gw, None).unwrap(),
        &p.host.linear_concat(&[&ha, &hb], &hw, None).unwrap(),
    );
    let (gb32, hb32) = p.rand(&[10], DType::F32);
    p.check(
        "linear_concat bf16 parts and weight, f32 bias",
        &p.gpu.linear_concat(&[&ga, &gc], &gw, Some(&gb32)).unwrap(),
        &p.host.linear_concat(&[&ha, &hc], &hw, Some(&hb32)).unwrap(),
    );
    p.check(
        "linear_concat bf16 parts, f32 weight",
        &p.gpu.linear_concat(&[&ga, &gc], &gw32, None).unwrap(),
        &p.host.linear_concat(&[&ha, &hc], &hw32, None).unwrap(),
    );

    // Refusals, as the host's.
    let refused = |r: ddo_core::Result<Tensor>| match r {
        Err(CoreError::Shape { .. }) => {}
        other => panic!("expected a shape error, got {other:?}"),
    };
    let (gd, _) = p.rand(&[5, 24], DType::BF16);
    let (gbad, _) = p.rand(&[7], DType::BF16);
    refused(p.gpu.linear_concat(&[], &gw, None));
    refused(p.gpu.linear_concat(&[&ga, &gd], &gw, None));
    refused(p.gpu.linear_concat(&[&ga, &gc, &gc], &gw, None));
    refused(p.gpu.linear_concat(&[&ga, &ga], &gw, None));
    refused(p.gpu.linear_concat(&[&ga, &gc], &gw, Some(&gbad)));
    drop((ga, gb, gc, gd, gbad, gw, gw32, gb32));
    p.gpu.release_blas_workspaces().unwrap();
    p.assert_clean();
}

/// `linear_accumulate` (a leaf's base linear added into its LoRA adapters' sum, or one
/// adapter's up-projection into another's): against the host's composition (`linear`, add,
/// GELU) in every dtype, with and without a bias and the GELU, at Flux shapes (a rank-32
/// up-projection into an MLP's 12,288 outputs; a 3,072-wide base linear with bias and GELU);
/// in place (no new buffer: the result is `acc`'s) where `acc` is held by nobody else; with a
/// clone held or mixed dtypes, the composition, the clone left as it was; shapes that do not
/// fit are refused as the host refuses them.
#[test]
fn linear_accumulate_adds_in_place_and_matches_the_host() {
    let Some(mut p) = Pair::new(23) else { return };
    // The GEMM handles' workspaces exist before memory is compared.
    for dtype in DTYPES {
        let (gx, _) = p.rand(&[4, 8], dtype);
        let (gw, _) = p.rand(&[6, 8], dtype);
        drop(p.gpu.linear(&gx, &gw, None).unwrap());
    }
    p.gpu.synchronize().unwrap();
    let cases: [(&[usize], usize, usize, DType); 6] = [
        (&[1, 256, 32], 12288, 32, DType::BF16),
        (&[1, 128, 3072], 768, 3072, DType::BF16),
        (&[2, 5, 4], 9, 4, DType::F32),
        (&[3, 16], 24, 16, DType::F16),
        (&[7, 8], 5, 8, DType::BF16),
        (&[0, 8], 5, 8, DType::BF16),
    ];
    for (xs, out, inp, dtype) in cases {
        for (bias, gelu) in [(false, false), (true, false), (false, true), (true, true)] {
            let what =
                format!("linear_accumulate {dtype} x {xs:?} -> {out}, bias {bias}, gelu {gelu}");
            let mut acc_shape = xs.to_vec();
            *acc_shape.last_mut().unwrap() = out;
            let (gx, hx) = p.rand(xs, dtype);
            let (gw, hw) = p.rand(&[out, inp], dtype);
            let (gb, hb) = p.rand(&[out], dtype);
            let want = |p: &Pair, ha: Tensor| {
                p.host
                    .linear_accumulate(&hx, &hw, bias.then_some(&hb), ha, gelu)
                    .unwrap()
            };
            let (mut ga, ha) = p.rand(&acc_shape, dtype);
            assert!(ga.has_exclusive_device_buffer(), "{what}: a fresh upload");
            let bytes = ga.nbytes() as u64;
            p.gpu.reset_peak();
            let before = p.gpu.memory_info().allocated;
            let got = p
                .gpu
                .linear_accumulate(&gx, &gw, bias.then_some(&gb), ga, gelu)
                .unwrap();
            let m = p.gpu.memory_info();
            // In place: a plain accumulation always; with a bias or the GELU, where cuBLASLt
            // takes the shape (the Flux-sized bf16 cases; off it, the bias is composed and a
            // small GELU may run out of place).
            if bytes > 0 && ((!bias && !gelu) || xs.iter().product::<usize>() >= 256 * 32) {
                assert_eq!(m.allocated, before, "{what}: allocated changed");
                assert!(
                    m.peak_allocated < before + bytes,
                    "{what}: peak {} reached acc's {bytes} bytes over {before}: a second buffer",
                    m.peak_allocated
                );
            }
            p.check(&what, &got, &want(&p, ha));
            drop(got);

            // A clone held: a buffer of its own, the clone unchanged.
            let (ga, ha) = p.rand(&acc_shape, dtype);
            let keep = ga.clone();
            let got = p
                .gpu
                .linear_accumulate(&gx, &gw, bias.then_some(&gb), ga, gelu)
                .unwrap();
            p.check(&format!("{what} (clone held)"), &got, &want(&p, ha.clone()));
            p.check_exact(&format!("{what}: the clone"), &keep, &ha);
            drop((got, keep, gx, gw, gb));
        }
    }
    // An f32 accumulator beside bf16 operands: the composition, in the accumulator's dtype.
    let (gx, hx) = p.rand(&[4, 8], DType::BF16);
    let (gw, hw) = p.rand(&[6, 8], DType::BF16);
    let (ga, ha) = p.rand(&[4, 6], DType::F32);
    let got = p.gpu.linear_accumulate(&gx, &gw, None, ga, false).unwrap();
    assert_eq!(got.dtype(), DType::F32);
    p.check(
        "linear_accumulate bf16 operands into f32",
        &got,
        &p.host.linear_accumulate(&hx, &hw, None, ha, false).unwrap(),
    );
    drop(got);
    // Refusals, as the host's.
    let refused = |r: ddo_core::Result<Tensor>| match r {
        Err(CoreError::Shape { .. }) => {}
        other => panic!("expected a shape error, got {other:?}"),
    };
    let (bad_w, _) = p.rand(&[6, 7], DType::BF16);
    let (bad_acc, _) = p.rand(&[4, 5], DType::BF16);
    let (acc, _) = p.rand(&[4, 6], DType::BF16);
    refused(p.gpu.linear_accumulate(&gx, &bad_w, None, acc, false));
    refused(p.gpu.linear_accumulate(&gx, &gw, None, bad_acc, false));
    drop((gx, gw, bad_w));
    p.gpu.release_blas_workspaces().unwrap();
    p.assert_clean();
}

// ---- Group norm and the fused group norm + SiLU ------------------------------------------

/// Group norm and the fused group norm + SiLU against the host (group norm, then SiLU for the
/// fused op: the GPU rounds once where the host rounds twice, well inside the tolerance) on
/// both sides of each vector condition: statistics in 16-byte vectors when a group is a
/// whole number of them and x is aligned (else scalar), the apply in vectors when a channel
/// plane is (else scalar). A VAE-like tensor, short planes, a partial last chunk, odd planes,
/// a group longer than a scalar chunk, one element a group or a plane, no spatial dims, a
/// mean far from 0; weight and bias present and absent.
#[test]
fn group_norm_and_its_fused_silu_match_the_host_on_the_vector_and_scalar_paths() {
    let Some(mut p) = Pair::new(23) else { return };
    // (shape, groups, where the values are centred)
    let cases: [(&[usize], usize, f32); 9] = [
        // Vector statistics (chunks of 2,048 vectors) and apply (128 tiles a plane).
        (&[1, 128, 256, 256], 32, 0.0),
        // Vector, short planes (32 vectors: a warp each), batch 2.
        (&[2, 512, 16, 16], 32, 0.0),
        // Vector, the last chunk of each group partial; values far from 0.
        (&[1, 64, 40, 64], 32, 20.0),
        // 16-bit: vector statistics (144 a group), scalar apply (36 a plane); f32: vector.
        (&[2, 64, 6, 6], 16, 0.0),
        // Odd planes and groups: scalar statistics and apply.
        (&[2, 64, 7, 9], 32, 0.0),
        // Odd, a group longer than one scalar chunk (8,192), far from 0.
        (&[1, 8, 4099], 4, 20.0),
        // One element a group.
        (&[1, 32, 1, 1], 32, 0.0),
        // One element a plane, four a group (f32: vector statistics, scalar apply).
        (&[1, 32, 1, 1], 8, 0.0),
        // No spatial dims.
        (&[3, 6], 3, 0.0),
    ];
    for dtype in DTYPES {
        for (shape, groups, centre) in cases {
            let c = shape[1];
            let v: Vec<f32> = p
                .random(shape.iter().product())
                .iter()
                .map(|x| x * 2.0 + centre - 0.7)
                .collect();
            let (g, h) = p.put(shape, dtype, &v);
            let (gw, hw) = p.rand(&[c], dtype);
            let (gb, hb) = p.rand(&[c], DType::F32);
            for affine in [false, true] {
                let (gwo, gbo) = (affine.then_some(&gw), affine.then_some(&gb));
                let (hwo, hbo) = (affine.then_some(&hw), affine.then_some(&hb));
                let what =
                    format!("{dtype} {shape:?} groups={groups} centre={centre} affine={affine}");
                // The reference in f32 from the same (rounded) inputs, rounded once into the
                // dtype, and judged by the relative L2 over every element: the file's
                // `check` leaves out equal elements, so a single output one unit (2^-24) off
                // an f16 subnormal reads as a large error (f16 [1,8,4099] centred at 20 with
                // the affine gave exactly 1/407 in two H200 runs: one element, 407 units,
                // by that reading).
                let h32 = p.host.cast(&h, DType::F32).unwrap();
                let normed = p.host.group_norm(&h32, groups, hwo, hbo, 1e-6).unwrap();
                let silu = p.host.unary(&normed, UnaryOp::Silu).unwrap();
                p.check_all(
                    &format!("group_norm {what}"),
                    &p.gpu.group_norm(&g, groups, gwo, gbo, 1e-6).unwrap(),
                    &p.host.cast(&normed, dtype).unwrap(),
                );
                p.check_all(
                    &format!("group_norm_silu {what}"),
                    &p.gpu.group_norm_silu(&g, groups, gwo, gbo, 1e-6).unwrap(),
                    &p.host.cast(&silu, dtype).unwrap(),
                );
            }
        }
    }
    p.assert_clean();
}

/// Inputs one element into their buffer (misaligned for 16-byte vectors: the scalar kernels)
/// and 16 bytes in (aligned: the vector kernels, at an offset), through `Device::ops` too.
#[test]
fn group_norm_reads_misaligned_and_offset_inputs() {
    let Some(mut p) = Pair::new(24) else { return };
    let shape = [2usize, 32, 16, 16];
    for dtype in DTYPES {
        let v: Vec<f32> = p
            .random(shape.iter().product())
            .iter()
            .map(|x| x * 3.0 + 1.5)
            .collect();
        let (gw, hw) = p.rand(&[32], DType::F32);
        let (gb, hb) = p.rand(&[32], dtype);
        for offset in [dtype.size_in_bytes(), 16] {
            let (g, h) = p.put_at(offset, &shape, dtype, &v);
            let what = format!("{dtype} {offset} bytes into its buffer");
            let normed = p
                .host
                .group_norm(&h, 8, Some(&hw), Some(&hb), 1e-5)
                .unwrap();
            p.check(
                &format!("group_norm {what}"),
                &p.gpu.group_norm(&g, 8, Some(&gw), Some(&gb), 1e-5).unwrap(),
                &normed,
            );
            let ops = ddo_core::ops_of(&*p.gpu).unwrap();
            p.check(
                &format!("group_norm_silu {what}"),
                &ops.group_norm_silu(&g, 8, Some(&gw), Some(&gb), 1e-5)
                    .unwrap(),
                &p.host.unary(&normed, UnaryOp::Silu).unwrap(),
            );
        }
    }
    p.assert_clean();
}

/// Shapes of a per-feature operand over `x [2, 37, d]`: the fused kernels' `[b, 1, d]`,
/// `[d]`, `[1, d]` and `x`'s own shape, and `[1, 37, d]`, which takes the composition.
fn modulation_shapes(d: usize) -> [Vec<usize>; 5] {
    [
        vec![2, 1, d],
        vec![d],
        vec![1, d],
        vec![2, 37, d],
        vec![1, 37, d],
    ]
}

/// Feature widths on both sides of the fused kernels' conditions: whole 16-byte chunks on
/// the warp kernel (64, 256), on the block kernel (3072, Flux's), and on the generic one
/// (24, 520), and widths that are not multiples of 8 (5, 100).
const FEATURES: [usize; 8] = [5, 24, 64, 100, 256, 520, 768, 3072];

/// `layer_norm_modulate` (one fused kernel where the scale and shift hold one row per group
/// of rows) against the host's composition `layer_norm`, `affine`, `Mul`, `Add`.
#[test]
fn layer_norm_modulate_matches_the_host_composition() {
    let Some(mut p) = Pair::new(31) else { return };
    for dtype in DTYPES {
        for d in FEATURES {
            let v: Vec<f32> = p.random(2 * 37 * d).iter().map(|x| x * 3.0 + 0.5).collect();
            let (gx, hx) = p.put(&[2, 37, d], dtype, &v);
            for (si, shape) in modulation_shapes(d).iter().enumerate() {
                let (gs, hs) = p.rand(shape, dtype);
                // The shift in another layout than the scale (and in f32 once).
                let hshape = &modulation_shapes(d)[(si + 1) % 4];
                let sdt = if si == 2 { DType::F32 } else { dtype };
                let (gh, hh) = p.rand(hshape, sdt);
                p.check(
                    &format!(
                        "layer_norm_modulate {dtype} d={d} scale {shape:?} shift {hshape:?} {sdt}"
                    ),
                    &p.gpu.layer_norm_modulate(&gx, 1e-6, &gs, &gh).unwrap(),
                    &p.host.layer_norm_modulate(&hx, 1e-6, &hs, &hh).unwrap(),
                );
            }
        }
    }
    // The fused kernel allocates its output and nothing else.
    let (gx, _) = p.rand(&[2, 64, 3072], DType::BF16);
    let (gs, _) = p.rand(&[2, 1, 3072], DType::BF16);
    p.gpu.synchronize().unwrap();
    let before = p.gpu.memory_info().allocated;
    p.gpu.reset_peak();
    let y = p.gpu.layer_norm_modulate(&gx, 1e-6, &gs, &gs).unwrap();
    let peak = p.gpu.memory_info().peak_allocated;
    assert!(
        peak.saturating_sub(before) <= (y.nbytes() as u64).next_multiple_of(512),
        "peak rose by {} B for a {} B output",
        peak.saturating_sub(before),
        y.nbytes()
    );
    // Shape errors are the composition's.
    let (gbad, _) = p.rand(&[3, 1, 3072], DType::BF16);
    let err = p
        .gpu
        .layer_norm_modulate(&gx, 1e-6, &gbad, &gs)
        .unwrap_err();
    assert!(matches!(err, CoreError::Shape { .. }), "{err}");
    drop((gx, gs, gbad, y));
    p.assert_clean();
}

/// `gated_add` (one fused pass where `y` has `x`'s shape and the gate one row per group of
/// rows) against the host's composition `Mul`, `Add`.
#[test]
fn gated_add_matches_the_host_composition() {
    let Some(mut p) = Pair::new(32) else { return };
    for dtype in DTYPES {
        for d in FEATURES {
            let (gx, hx) = p.rand(&[2, 37, d], dtype);
            let (gy, hy) = p.rand(&[2, 37, d], dtype);
            for (i, shape) in modulation_shapes(d).iter().enumerate() {
                let gdt = if i == 2 { DType::F32 } else { dtype };
                let (gg, hg) = p.rand(shape, gdt);
                p.check(
                    &format!("gated_add {dtype} d={d} gate {shape:?} {gdt}"),
                    &p.gpu.gated_add(&gx, &gg, &gy).unwrap(),
                    &p.host.gated_add(&hx, &hg, &hy).unwrap(),
                );
            }
            // y of another dtype, and y broadcast (the composition).
            let (gy32, hy32) = p.rand(&[2, 37, d], DType::F32);
            let (gg, hg) = p.rand(&[2, 1, d], dtype);
            p.check(
                &format!("gated_add {dtype} d={d} y f32"),
                &p.gpu.gated_add(&gx, &gg, &gy32).unwrap(),
                &p.host.gated_add(&hx, &hg, &hy32).unwrap(),
            );
            let (gyb, hyb) = p.rand(&[1, 37, d], dtype);
            p.check(
                &format!("gated_add {dtype} d={d} y [1, 37, d]"),
                &p.gpu.gated_add(&gx, &gg, &gyb).unwrap(),
                &p.host.gated_add(&hx, &hg, &hyb).unwrap(),
            );
        }
    }
    let (gx, _) = p.rand(&[2, 64, 3072], DType::BF16);
    let (gg, _) = p.rand(&[2, 1, 3072], DType::BF16);
    p.gpu.synchronize().unwrap();
    let before = p.gpu.memory_info().allocated;
    p.gpu.reset_peak();
    let y = p.gpu.gated_add(&gx, &gg, &gx).unwrap();
    let peak = p.gpu.memory_info().peak_allocated;
    assert!(
        peak.saturating_sub(before) <= (y.nbytes() as u64).next_multiple_of(512),
        "peak rose by {} B for a {} B output",
        peak.saturating_sub(before),
        y.nbytes()
    );
    let (gbad, _) = p.rand(&[2, 37, 3072], DType::BF16);
    let err = p.gpu.gated_add(&gx, &gg, &gbad).unwrap_err();
    assert!(matches!(err, CoreError::Shape { .. }), "{err}");
    drop((gx, gg, gbad, y));
    p.assert_clean();
}

/// An 8-bit float tensor of `codes` on `gpu` (uploaded as stored bytes).
fn fp8_tensor(gpu: &CudaDevice, dtype: DType, shape: &[usize], codes: &[u8]) -> Tensor {
    let host = Tensor::new(
        shape.to_vec(),
        dtype,
        TensorStorage::Host(HostBuffer::pageable_from(codes).slice_all()),
    )
    .unwrap();
    host.to_device(gpu, &gpu.compute_stream()).unwrap()
}

/// fp8 storage (issue 18): every code of both formats decodes on the device exactly as on
/// the host, into each float dtype; encoding into fp8 on the device is a typed refusal; and
/// a linear (plain, GELU, concatenated) over an fp8 weight and bias is, bit for bit, the
/// linear over their decoded values.
#[test]
fn fp8_decodes_exactly_and_linears_upcast_their_fp8_operands() {
    let Some(gpu) = gpu() else { return };
    let codes: Vec<u8> = (0..=255).collect();
    for fp8 in [DType::F8E4M3, DType::F8E5M2] {
        let t = fp8_tensor(&gpu, fp8, &[256], &codes);
        let want = fp8.decode_f32(&codes).unwrap();
        for dtype in DTYPES {
            let got = gpu.to_f32_vec(&gpu.cast(&t, dtype).unwrap()).unwrap();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                if w.is_nan() {
                    assert!(g.is_nan(), "{fp8} code {i:#04x} as {dtype}: {g}, want NaN");
                } else {
                    assert_eq!(g.to_bits(), w.to_bits(), "{fp8} code {i:#04x} as {dtype}");
                }
            }
        }
        let f = gpu.cast(&t, DType::F32).unwrap();
        assert!(
            matches!(gpu.cast(&f, fp8), Err(CoreError::Shape { .. })),
            "{fp8}: encoding on the device is refused"
        );

        let (m, k, n) = (37, 64, 48);
        let scaled = |len: usize, seed: usize| -> Vec<u8> {
            let v: Vec<f32> = common::rnd(len, seed).iter().map(|x| x * 0.5).collect();
            fp8.encode_f32(&v).unwrap()
        };
        let w8 = fp8_tensor(&gpu, fp8, &[n, k], &scaled(n * k, 11));
        let b8 = fp8_tensor(&gpu, fp8, &[n], &scaled(n, 12));
        let x = gpu
            .tensor_from_f32(&[m, k], DType::BF16, &common::rnd(m * k, 13))
            .unwrap();
        let w16 = gpu.cast(&w8, DType::BF16).unwrap();
        let b16 = gpu.cast(&b8, DType::BF16).unwrap();
        let bits = |t: &Tensor| -> Vec<u32> {
            gpu.to_f32_vec(t)
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        assert_eq!(
            bits(&gpu.linear(&x, &w8, Some(&b8)).unwrap()),
            bits(&gpu.linear(&x, &w16, Some(&b16)).unwrap()),
            "{fp8} linear"
        );
        assert_eq!(
            bits(&gpu.linear_gelu_tanh(&x, &w8, Some(&b16)).unwrap()),
            bits(&gpu.linear_gelu_tanh(&x, &w16, Some(&b16)).unwrap()),
            "{fp8} linear_gelu_tanh"
        );
        let halves = [
            gpu.tensor_from_f32(&[m, k / 2], DType::BF16, &common::rnd(m * k / 2, 14))
                .unwrap(),
            gpu.tensor_from_f32(&[m, k / 2], DType::BF16, &common::rnd(m * k / 2, 15))
                .unwrap(),
        ];
        let parts: Vec<&Tensor> = halves.iter().collect();
        assert_eq!(
            bits(&gpu.linear_concat(&parts, &w8, Some(&b8)).unwrap()),
            bits(&gpu.linear_concat(&parts, &w16, Some(&b16)).unwrap()),
            "{fp8} linear_concat"
        );

        // Scaled fp8 (a per-tensor scale, as ComfyUI's scaled checkpoints and
        // `--dtype fp8` store weights): cast and the linears dequantize, `decode * scale` in
        // f32 rounded to the output dtype, exactly as the host backend does.
        let scale = 0.0123f32;
        let ws = w8.clone().with_scale(Some(scale)).unwrap();
        let want: Vec<f32> = fp8
            .decode_f32(&scaled(n * k, 11))
            .unwrap()
            .iter()
            .map(|v| v * scale)
            .collect();
        let got = gpu.to_f32_vec(&gpu.cast(&ws, DType::F32).unwrap()).unwrap();
        assert_eq!(
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{fp8} scaled cast"
        );
        let host = ddo_host::HostDevice::with_capacity(1 << 24).unwrap();
        let host_w = host
            .cast(
                &host
                    .tensor_from_f32(&[n, k], fp8, &fp8.decode_f32(&scaled(n * k, 11)).unwrap())
                    .unwrap()
                    .with_scale(Some(scale))
                    .unwrap(),
                DType::BF16,
            )
            .unwrap();
        let ws16 = gpu
            .tensor_from_f32(&[n, k], DType::BF16, &host.to_f32_vec(&host_w).unwrap())
            .unwrap();
        assert_eq!(
            bits(&gpu.cast(&ws, DType::BF16).unwrap()),
            bits(&ws16),
            "{fp8} scaled upcast to bf16 rounds as the host"
        );
        assert_eq!(
            bits(&gpu.linear(&x, &ws, Some(&b16)).unwrap()),
            bits(&gpu.linear(&x, &ws16, Some(&b16)).unwrap()),
            "{fp8} scaled linear"
        );
        assert!(
            gpu.unary(&ws, ddo_core::UnaryOp::Silu).is_err(),
            "{fp8}: other ops refuse a scaled tensor"
        );

        // The 8-codes-a-thread upcast and its tail, and a source at an odd offset (the
        // one-at-a-time kernel): the same values as the host's, into each dtype.
        let long: Vec<u8> = (0..1029u32).map(|i| (i * 37 % 256) as u8).collect();
        let whole = fp8_tensor(&gpu, fp8, &[1029], &long);
        let TensorStorage::Device(slice) = whole.storage() else {
            panic!("device tensor")
        };
        let odd = Tensor::new(
            vec![1027],
            fp8,
            TensorStorage::Device(slice.buffer().slice(1, 1027).unwrap()),
        )
        .unwrap()
        .with_scale(Some(scale))
        .unwrap();
        let whole = whole.with_scale(Some(scale)).unwrap();
        for dtype in DTYPES {
            for (t, codes) in [(&whole, &long[..]), (&odd, &long[1..1028])] {
                let want: Vec<f32> = fp8
                    .decode_f32(codes)
                    .unwrap()
                    .iter()
                    .map(|v| v * scale)
                    .collect();
                let want = dtype.decode_f32(&dtype.encode_f32(&want).unwrap()).unwrap();
                let got = gpu.to_f32_vec(&gpu.cast(t, dtype).unwrap()).unwrap();
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                        "{fp8} into {dtype}, {} codes, element {i}: {g} vs {w}",
                        codes.len()
                    );
                }
            }
        }
    }
}

#[test]
fn an_aligned_contiguous_narrow_is_a_view_and_is_never_written_in_place() {
    let Some(mut p) = Pair::new(31) else { return };
    // [1, 8, 64] bf16: rows of 128 bytes; start 2 is 256 bytes in, start 1 is not.
    let (g, h) = p.rand(&[1, 8, 64], DType::BF16);
    let offset_of = |t: &Tensor| match t.storage() {
        TensorStorage::Device(s) => (s.offset(), s.buffer().len()),
        TensorStorage::Host(_) => panic!("on the host"),
    };
    p.gpu.reset_peak();
    let before = p.gpu.memory_info().allocated;
    let view = p.gpu.narrow(&g, 1, 2, 4).unwrap();
    assert_eq!(
        p.gpu.memory_info().peak_allocated,
        before,
        "a view allocates nothing"
    );
    assert_eq!(
        offset_of(&view),
        (256, offset_of(&g).1),
        "a view of x's buffer"
    );
    p.check_exact("the view", &view, &p.host.narrow(&h, 1, 2, 4).unwrap());
    // Off the 256-byte boundary, or with rows before the narrowed dim: a copy, same values.
    for (shape, dim, start, len) in [
        (&[1usize, 8, 64][..], 1usize, 1usize, 3usize),
        (&[2, 4, 64], 1, 2, 2),
    ] {
        let (g2, h2) = p.rand(shape, DType::BF16);
        let copy = p.gpu.narrow(&g2, dim, start, len).unwrap();
        assert_eq!(
            offset_of(&copy).0,
            0,
            "{shape:?} {start}: a buffer of its own"
        );
        p.check_exact(
            &format!("narrow {shape:?} dim {dim} from {start}"),
            &copy,
            &p.host.narrow(&h2, dim, start, len).unwrap(),
        );
    }
    // An op that may run in place over an exclusive input gives the view an output of its
    // own: x (a clone kept to compare, its first handle dropped) is left as it was.
    let hv = p.host.narrow(&h, 1, 2, 4).unwrap();
    let want = p.host.unary(&hv, UnaryOp::Neg).unwrap();
    let keep = g.clone();
    drop(g);
    let y = p.gpu.unary_owned(view, UnaryOp::Neg).unwrap();
    p.check_exact("neg of the view", &y, &want);
    p.check_exact("x after an op on its view", &keep, &h);
    // A view of a view (the offsets add).
    let inner = p.gpu.narrow(&keep, 1, 4, 4).unwrap();
    let inner2 = p.gpu.narrow(&inner, 1, 2, 2).unwrap();
    assert_eq!(offset_of(&inner2).0, 768);
    p.check_exact(
        "a view of a view",
        &inner2,
        &p.host.narrow(&h, 1, 6, 2).unwrap(),
    );
    drop((y, keep, inner, inner2));
    p.assert_clean();
}

/// `Device::prepare_linears` (issue 35: cuBLASLt's kernels load before the phases): each
/// distinct call within the limit runs once, a call past it is left out, and an empty list
/// runs nothing.
#[test]
fn prepare_linears_runs_each_distinct_call_within_the_limit() {
    use ddo_core::{LinearCall, LinearKind};
    let Some(g) = gpu() else {
        return;
    };
    let bf16 = DType::BF16;
    let small = LinearCall::new(LinearKind::Plain, 64, 128, 256, true, bf16);
    let calls = [
        small.clone(),
        small,
        LinearCall::new(LinearKind::GeluTanh, 64, 128, 512, true, bf16),
        LinearCall::new(LinearKind::Concat(vec![128, 64]), 64, 192, 128, false, bf16),
        // 100 MB of operands and product: past the 8 MiB limit.
        LinearCall::new(LinearKind::Plain, 4096, 4096, 4096, false, bf16),
    ];
    assert_eq!(g.prepare_linears(&calls, 8 << 20).unwrap(), 3);
    assert_eq!(g.prepare_linears(&[], 1 << 30).unwrap(), 0);
    g.synchronize().unwrap();
}
