//! Elementwise ops on the host: activations and other unary functions (an exact GELU
//! through a precise `erfc`), broadcasting binary ops, `affine` and rotary embedding.

use super::{product, shape_err, walk};
use crate::device::HostDevice;
use ddo_core::error::Result;
use ddo_core::host_memory::try_vec;
use ddo_core::ops::{BinaryOp, UnaryOp};
use ddo_core::shape::{broadcast_shape, broadcast_strides, coalesce};
use ddo_core::tensor::Tensor;

fn binary_kernel(
    a: &[f32],
    b: &[f32],
    shape: &[usize],
    sa: &[usize],
    sb: &[usize],
    f: impl Fn(f32, f32) -> f32,
) -> Vec<f32> {
    let (cs, [sa, sb]) = coalesce(shape, [sa, sb]);
    let r = cs.len();
    let (inner, ia, ib) = (cs[r - 1], sa[r - 1], sb[r - 1]);
    let mut out = Vec::with_capacity(product(&cs));
    walk(
        &cs[..r - 1],
        [&sa[..r - 1], &sb[..r - 1]],
        |[oa, ob]| match (ia, ib) {
            (1, 1) => out.extend(
                a[oa..oa + inner]
                    .iter()
                    .zip(&b[ob..ob + inner])
                    .map(|(&x, &y)| f(x, y)),
            ),
            (1, 0) => {
                let y = b[ob];
                out.extend(a[oa..oa + inner].iter().map(|&x| f(x, y)));
            }
            (0, 1) => {
                let x = a[oa];
                out.extend(b[ob..ob + inner].iter().map(|&y| f(x, y)));
            }
            _ => out.extend((0..inner).map(|j| f(a[oa + j * ia], b[ob + j * ib]))),
        },
    );
    out
}

// ---------------------------------------------------------------------------------------
// Scalar functions
// ---------------------------------------------------------------------------------------

/// Chebyshev coefficients of `ln(erfc(z) · e^{z²} / t)` in `u = 2t - 1`, `t = 2 / (2 + z)`
/// (fitted for this crate by Chebyshev interpolation at 20 nodes; relative error of
/// `erfc` below 1e-12 on `[0, 26]`).
const ERFC_CHEB: [f64; 20] = [
    -0.651326859890854,
    0.6419697923564892,
    0.019476473204186065,
    -0.009561514786808091,
    -0.0009465953444832254,
    0.0003668394978536771,
    4.252332480629839e-05,
    -2.0278578113686054e-05,
    -1.6242900031437914e-06,
    1.3036558339063476e-06,
    1.5626442007032894e-08,
    -8.523809569283003e-08,
    6.529053964143827e-09,
    5.05934455441448e-09,
    -9.913651233262045e-10,
    -2.27366819816055e-10,
    9.647033172299757e-11,
    2.3866075782308373e-12,
    -6.886960446372826e-12,
    1.0072831457819121e-12,
];

/// The complementary error function for `z >= 0`, with small relative error everywhere
/// (so tails such as GELU at large negative inputs stay precise).
fn erfc_nonneg(z: f64) -> f64 {
    let t = 2.0 / (2.0 + z);
    let u = 2.0 * t - 1.0;
    let (mut b1, mut b2) = (0.0f64, 0.0f64);
    for &c in ERFC_CHEB[1..].iter().rev() {
        (b1, b2) = (2.0 * u * b1 - b2 + c, b1);
    }
    let p = u * b1 - b2 + ERFC_CHEB[0];
    t * (-z * z + p).exp()
}

/// Exact GELU, `x Φ(x) = ½ x erfc(-x / √2)`, evaluated without cancellation.
fn gelu_erf(x: f32) -> f32 {
    let x = f64::from(x);
    let z = x * std::f64::consts::FRAC_1_SQRT_2;
    let y = if x >= 0.0 {
        x * (1.0 - 0.5 * erfc_nonneg(z))
    } else {
        0.5 * x * erfc_nonneg(-z)
    };
    y as f32
}

fn gelu_tanh(x: f32) -> f32 {
    const K: f32 = 0.797_884_6; // √(2/π)
    0.5 * x * (1.0 + (K * (x + 0.044_715 * x * x * x)).tanh())
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn map_in_place(values: &mut [f32], f: impl Fn(f32) -> f32) {
    for v in values {
        *v = f(*v);
    }
}

fn apply_unary(values: &mut [f32], op: UnaryOp) {
    match op {
        UnaryOp::Silu => map_in_place(values, |x| x * sigmoid(x)),
        UnaryOp::GeluTanh => map_in_place(values, gelu_tanh),
        UnaryOp::GeluErf => map_in_place(values, gelu_erf),
        UnaryOp::QuickGelu => map_in_place(values, |x| x * sigmoid(1.702 * x)),
        UnaryOp::Sigmoid => map_in_place(values, sigmoid),
        UnaryOp::Tanh => map_in_place(values, f32::tanh),
        UnaryOp::Relu => map_in_place(values, |x| x.max(0.0)),
        UnaryOp::Exp => map_in_place(values, f32::exp),
        UnaryOp::Neg => map_in_place(values, |x| -x),
        UnaryOp::Square => map_in_place(values, |x| x * x),
        UnaryOp::Sqrt => map_in_place(values, f32::sqrt),
        UnaryOp::Recip => map_in_place(values, |x| 1.0 / x),
    }
}

pub(super) fn unary(dev: &HostDevice, x: &Tensor, op: UnaryOp) -> Result<Tensor> {
    let xi = dev.input("unary", x)?;
    let output = dev.new_output("unary", x.shape().to_vec(), x.dtype())?;
    dev.fence()?;
    let mut v = xi.f32()?;
    apply_unary(&mut v, op);
    output.write_f32(&v)
}

/// Reads `x`, lets it go, then allocates the output: when nothing else holds `x` its
/// bytes are free again first, so the device's peak is that of an in-place op.
pub(super) fn unary_owned(dev: &HostDevice, x: Tensor, op: UnaryOp) -> Result<Tensor> {
    let (shape, dtype) = (x.shape().to_vec(), x.dtype());
    let mut v = {
        let xi = dev.input("unary", &x)?;
        dev.fence()?;
        xi.f32()?
    };
    drop(x);
    let output = dev.new_output("unary", shape, dtype)?;
    apply_unary(&mut v, op);
    output.write_f32(&v)
}

pub(super) fn binary(dev: &HostDevice, a: &Tensor, b: &Tensor, op: BinaryOp) -> Result<Tensor> {
    const OP: &str = "binary";
    let shape = broadcast_shape(OP, a.shape(), b.shape())?;
    let ai = dev.input(OP, a)?;
    let bi = dev.input(OP, b)?;
    let output = dev.new_output(OP, shape.clone(), a.dtype())?;
    dev.fence()?;
    let av = ai.f32()?;
    let bv = bi.f32()?;
    let sa = broadcast_strides(a.shape(), &shape);
    let sb = broadcast_strides(b.shape(), &shape);
    let out = match op {
        BinaryOp::Add => binary_kernel(&av, &bv, &shape, &sa, &sb, |x, y| x + y),
        BinaryOp::Sub => binary_kernel(&av, &bv, &shape, &sa, &sb, |x, y| x - y),
        BinaryOp::Mul => binary_kernel(&av, &bv, &shape, &sa, &sb, |x, y| x * y),
        BinaryOp::Div => binary_kernel(&av, &bv, &shape, &sa, &sb, |x, y| x / y),
        BinaryOp::Max => binary_kernel(&av, &bv, &shape, &sa, &sb, f32::max),
        BinaryOp::Min => binary_kernel(&av, &bv, &shape, &sa, &sb, f32::min),
    };
    output.write_f32(&out)
}

pub(super) fn affine(dev: &HostDevice, x: &Tensor, mul: f32, add: f32) -> Result<Tensor> {
    let xi = dev.input("affine", x)?;
    let output = dev.new_output("affine", x.shape().to_vec(), x.dtype())?;
    dev.fence()?;
    let mut v = xi.f32()?;
    for e in &mut v {
        *e = *e * mul + add;
    }
    output.write_f32(&v)
}

pub(super) fn rope(dev: &HostDevice, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    const OP: &str = "rope";
    let xs = x.shape();
    let ok = xs.len() >= 2
        && cos.shape() == &xs[xs.len() - 2..]
        && sin.shape() == cos.shape()
        && xs[xs.len() - 1].is_multiple_of(2);
    if !ok {
        return Err(shape_err(
            OP,
            format!(
                "x {xs:?}, cos {:?}, sin {:?}: expected x [b, h, l, d] with d even and \
                 cos, sin [l, d]",
                cos.shape(),
                sin.shape()
            ),
        ));
    }
    let xi = dev.input(OP, x)?;
    let ci = dev.input(OP, cos)?;
    let si = dev.input(OP, sin)?;
    let output = dev.new_output(OP, xs.to_vec(), x.dtype())?;
    dev.fence()?;
    let xv = xi.f32()?;
    let cv = ci.f32()?;
    let sv = si.f32()?;
    let table = cv.len().max(1);
    let mut out = try_vec(xv.len(), 0.0f32, "rope's output")?;
    for (orows, xrows) in out.chunks_exact_mut(table).zip(xv.chunks_exact(table)) {
        for (((o, xp), c), s) in orows
            .chunks_exact_mut(2)
            .zip(xrows.chunks_exact(2))
            .zip(cv.chunks_exact(2))
            .zip(sv.chunks_exact(2))
        {
            o[0] = xp[0] * c[0] - xp[1] * s[0];
            o[1] = xp[1] * c[1] + xp[0] * s[1];
        }
    }
    output.write_f32(&out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::test_support::*;
    use ddo_core::device::Device;
    use ddo_core::dtype::DType;
    use ddo_core::error::CoreError;
    use ddo_core::ops::Ops;
    use ddo_core::rng::SplitMix64;
    fn ref_unary(x: f64, op: UnaryOp) -> f64 {
        let sig = |v: f64| 1.0 / (1.0 + (-v).exp());
        match op {
            UnaryOp::Silu => x * sig(x),
            UnaryOp::GeluTanh => {
                let k = (2.0 / std::f64::consts::PI).sqrt();
                0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh())
            }
            UnaryOp::GeluErf => ref_gelu_erf(x),
            UnaryOp::QuickGelu => x * sig(1.702 * x),
            UnaryOp::Sigmoid => sig(x),
            UnaryOp::Tanh => x.tanh(),
            UnaryOp::Relu => x.max(0.0),
            UnaryOp::Exp => x.exp(),
            UnaryOp::Neg => -x,
            UnaryOp::Square => x * x,
            UnaryOp::Sqrt => x.sqrt(),
            UnaryOp::Recip => 1.0 / x,
        }
    }

    #[test]
    fn unary_ops_match_f64_references() {
        let d = dev();
        let mut rng = SplitMix64::new(6);
        let x: Vec<f32> = random(&mut rng, 257).iter().map(|v| v * 4.0).collect();
        let positive: Vec<f32> = x.iter().map(|v| v.abs() + 0.1).collect();
        let ops = [
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
        for op in ops {
            let input = if matches!(op, UnaryOp::Sqrt | UnaryOp::Recip) {
                &positive
            } else {
                &x
            };
            let y = d
                .unary(&put(&d, &[input.len()], DType::F32, input), op)
                .unwrap();
            let want: Vec<f64> = input.iter().map(|&v| ref_unary(f64::from(v), op)).collect();
            assert_close(&format!("{op:?}"), &get(&d, &y), &want, F32_TOL);
        }
    }

    #[test]
    fn gelu_erf_is_precise_elementwise_including_tails() {
        for i in 0..=2600 {
            let z = f64::from(i) * 0.01;
            let (got, want) = (erfc_nonneg(z), ref_erfc(z));
            assert!(
                ((got - want) / want).abs() < 1e-10,
                "erfc({z}): {got} vs {want}"
            );
        }
        for i in -1200..=1200 {
            let x = i as f32 * 0.01;
            let want = ref_gelu_erf(f64::from(x));
            let got = f64::from(gelu_erf(x));
            let err = if want == 0.0 {
                got.abs()
            } else {
                ((got - want) / want).abs()
            };
            assert!(err <= 1e-6, "gelu_erf({x}): {got} vs {want}");
        }
    }

    #[test]
    fn binary_ops_broadcast_like_numpy() {
        let d = dev();
        let mut rng = SplitMix64::new(7);
        let cases: [(&[usize], &[usize]); 6] = [
            (&[2, 3, 4], &[2, 3, 4]),
            (&[2, 3, 4], &[1]),
            (&[2, 3, 4], &[3, 1]),
            (&[2, 1, 4], &[1, 3, 1]),
            (&[4], &[2, 3, 4]),
            (&[2, 5, 3, 3], &[5, 1, 1]),
        ];
        let ops = [
            BinaryOp::Add,
            BinaryOp::Sub,
            BinaryOp::Mul,
            BinaryOp::Div,
            BinaryOp::Max,
            BinaryOp::Min,
        ];
        for (ash, bsh) in cases {
            let a = random(&mut rng, ash.iter().product());
            let b: Vec<f32> = random(&mut rng, bsh.iter().product())
                .iter()
                .map(|v| v + 2.0)
                .collect();
            let (at, bt) = (put(&d, ash, DType::F32, &a), put(&d, bsh, DType::F32, &b));
            let osh = broadcast_shape("test", ash, bsh).unwrap();
            for op in ops {
                let y = d.binary(&at, &bt, op).unwrap();
                assert_eq!(y.shape(), &osh[..]);
                let want: Vec<f64> = (0..osh.iter().product())
                    .map(|i| {
                        let idx = unravel(i, &osh);
                        let x = f64::from(a[ravel_broadcast(&idx, ash)]);
                        let z = f64::from(b[ravel_broadcast(&idx, bsh)]);
                        match op {
                            BinaryOp::Add => x + z,
                            BinaryOp::Sub => x - z,
                            BinaryOp::Mul => x * z,
                            BinaryOp::Div => x / z,
                            BinaryOp::Max => x.max(z),
                            BinaryOp::Min => x.min(z),
                        }
                    })
                    .collect();
                assert_close(
                    &format!("{op:?} {ash:?} {bsh:?}"),
                    &get(&d, &y),
                    &want,
                    F32_TOL,
                );
            }
        }
    }

    #[test]
    fn rope_matches_a_naive_loop() {
        let d = dev();
        let mut rng = SplitMix64::new(10);
        let (b, h, l, hd) = (2, 3, 5, 8);
        let x = random(&mut rng, b * h * l * hd);
        let cos = random(&mut rng, l * hd);
        let sin = random(&mut rng, l * hd);
        let y = d
            .rope(
                &put(&d, &[b, h, l, hd], DType::F32, &x),
                &put(&d, &[l, hd], DType::F32, &cos),
                &put(&d, &[l, hd], DType::F32, &sin),
            )
            .unwrap();
        let mut want = vec![0.0; x.len()];
        for row in 0..b * h * l {
            let pos = row % l;
            for i in 0..hd / 2 {
                let (x0, x1) = (
                    f64::from(x[row * hd + 2 * i]),
                    f64::from(x[row * hd + 2 * i + 1]),
                );
                let at = |t: &[f32], j: usize| f64::from(t[pos * hd + j]);
                want[row * hd + 2 * i] = x0 * at(&cos, 2 * i) - x1 * at(&sin, 2 * i);
                want[row * hd + 2 * i + 1] = x1 * at(&cos, 2 * i + 1) + x0 * at(&sin, 2 * i + 1);
            }
        }
        assert_close("rope", &get(&d, &y), &want, F32_TOL);
    }

    /// `Ops::attention_input` for a joint attention's two streams gives the bytes of the
    /// sequence it replaces in Flux's attention: each stream normed per head, the streams
    /// joined (context first), moved to `[b, h, l, d]`, then rotated over the whole joined
    /// sequence; and a single stream likewise.
    #[test]
    fn attention_input_gives_the_bytes_of_norm_join_permute_rope() {
        use ddo_core::AttentionInput;
        let d = dev();
        let mut rng = SplitMix64::new(21);
        let (b, lt, li, h, hd) = (2, 3, 5, 2, 8);
        let total = lt + li;
        for dtype in [DType::F32, DType::BF16] {
            let t = |rng: &mut SplitMix64, shape: &[usize], dtype| {
                put(&d, shape, dtype, &random(rng, shape.iter().product()))
            };
            let (c, x) = (
                t(&mut rng, &[b, lt, h * hd], dtype),
                t(&mut rng, &[b, li, h * hd], dtype),
            );
            let (wc, wx) = (t(&mut rng, &[hd], dtype), t(&mut rng, &[hd], dtype));
            let (cos, sin) = (
                t(&mut rng, &[total, hd], DType::F32),
                t(&mut rng, &[total, hd], DType::F32),
            );
            // The old sequence.
            let heads = |x: &Tensor| x.reshape(&[b, x.shape()[1], h, hd]).unwrap();
            let nc = d.rms_norm(&heads(&c), Some(&wc), 1e-6).unwrap();
            let nx = d.rms_norm(&heads(&x), Some(&wx), 1e-6).unwrap();
            let j = d.concat(&[&nc, &nx], 1).unwrap();
            let j = d.permute(&j, &[0, 2, 1, 3]).unwrap();
            let want = d.rope(&j, &cos, &sin).unwrap();
            // The op, one call a stream.
            let part = |x, w, start| AttentionInput {
                x,
                heads: h,
                norm: Some((w, 1e-6)),
                rope: Some((&cos, &sin)),
                start,
                total,
            };
            let y = d.attention_input(&part(&c, &wc, 0), None).unwrap();
            let y = d.attention_input(&part(&x, &wx, lt), Some(y)).unwrap();
            assert_eq!(y.shape(), [b, h, total, hd]);
            assert_eq!(get(&d, &y), get(&d, &want), "{dtype:?}");
            // One stream: the whole sequence in one part, no norm, no tables (v).
            let all = t(&mut rng, &[b, total, h * hd], dtype);
            let v = d
                .attention_input(
                    &AttentionInput {
                        x: &all,
                        heads: h,
                        norm: None,
                        rope: None,
                        start: 0,
                        total,
                    },
                    None,
                )
                .unwrap();
            let want = d.permute(&heads(&all), &[0, 2, 1, 3]).unwrap();
            assert_eq!(get(&d, &v), get(&d, &want), "{dtype:?}");
        }
    }

    #[test]
    fn unary_owned_matches_unary_without_a_second_buffer() {
        let d = dev();
        let mut rng = SplitMix64::new(14);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for op in [
                UnaryOp::Silu,
                UnaryOp::GeluTanh,
                UnaryOp::Neg,
                UnaryOp::Square,
            ] {
                let v = random(&mut rng, 3 * 1000);
                let x = put(&d, &[3, 1000], dtype, &v);
                let want = get(&d, &d.unary(&x, op).unwrap());
                // Exclusively held: the op's peak is the live bytes before the call.
                let live = d.memory_info().allocated;
                d.reset_peak();
                let y = d.unary_owned(x, op).unwrap();
                let m = d.memory_info();
                assert!(
                    m.peak_allocated <= live,
                    "{op:?} {dtype}: peak {} > live {live}",
                    m.peak_allocated
                );
                assert_eq!(m.allocated, live, "{op:?} {dtype}");
                assert_eq!((y.shape(), y.dtype()), (&[3, 1000][..], dtype));
                assert_eq!(get(&d, &y), want, "{op:?} {dtype}");
                drop(y);

                // With a clone held: a second buffer, the same values, the clone unchanged.
                let x = put(&d, &[3, 1000], dtype, &v);
                let original = get(&d, &x);
                let keep = x.clone();
                let live = d.memory_info().allocated;
                d.reset_peak();
                let y = d.unary_owned(x, op).unwrap();
                assert_eq!(
                    d.memory_info().peak_allocated,
                    live + y.nbytes() as u64,
                    "{op:?} {dtype}: a shared x needs an output of its own"
                );
                assert_eq!(get(&d, &y), want, "{op:?} {dtype} (clone held)");
                assert_eq!(
                    get(&d, &keep),
                    original,
                    "{op:?} {dtype}: the clone changed"
                );
            }
        }
        // Errors are those of unary.
        let host = Tensor::from_f32(vec![2], DType::F32, &[1.0, 2.0]).unwrap();
        let err = d.unary_owned(host, UnaryOp::Relu).unwrap_err();
        assert!(matches!(err, CoreError::WrongDevice { .. }), "{err}");
        assert_eq!(d.memory_info().allocated, 0);
    }
}
