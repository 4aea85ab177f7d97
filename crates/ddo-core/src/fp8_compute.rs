//! Linears computed in fp8 (`--compute fp8`, issue 39): the activation quantized per tensor
//! to E4M3 with a scale found at run time, the weight's E4M3 codes as stored, the products
//! summed in f32, both scales applied to the sum, the bias added, rounded once.
//!
//! The recipe is TorchAO's float8 dynamic-activation quantization
//! (`Float8DynamicActivationFloat8WeightConfig`, per tensor): `scale = 448 / max(amax,
//! 1e-12)`, the codes `e4m3(clamp(x * scale, -448, 448))` rounded to nearest even, and
//! `torch._scaled_mm`'s `(A · Bᵀ) * (1 / scale) * weight_scale + bias`. This module is the
//! reference every backend's [`Ops::linear_fp8`] is held to: the host backend runs it; a
//! backend with fp8 tensor cores runs a GEMM that sums the same exact products in another
//! order.
//!
//! [`Ops::linear_fp8`]: crate::Ops::linear_fp8

use float8::F8E4M3;

use crate::error::{CoreError, Result};
use crate::{DType, Ops, Tensor};

/// E4M3's largest finite value.
pub const E4M3_MAX: f32 = 448.0;

/// The smallest amax a scale is made from (TorchAO's `EPS`): an all-zero activation gets a
/// finite scale.
pub const AMAX_FLOOR: f32 = 1e-12;

/// The per-tensor scale of an activation whose largest magnitude is `amax`: what its values
/// are multiplied by before they are rounded to E4M3. `None` when `amax` is NaN or infinite
/// (the activation has no fp8 scale).
pub fn activation_scale(amax: f32) -> Option<f32> {
    amax.is_finite().then(|| E4M3_MAX / amax.max(AMAX_FLOOR))
}

/// The largest magnitude of `values`; NaN when any value is NaN.
pub fn amax(values: &[f32]) -> f32 {
    values.iter().fold(0f32, |m, &v| {
        if m.is_nan() || v.is_nan() {
            f32::NAN
        } else {
            m.max(v.abs())
        }
    })
}

/// `v * scale` clamped to E4M3's range and rounded to nearest even, as the value of the code
/// (exact in f32).
pub fn quantize(v: f32, scale: f32) -> f32 {
    F8E4M3::from_f32((v * scale).clamp(-E4M3_MAX, E4M3_MAX)).to_f32()
}

/// The fp8 product of `x [rows, k]` (values) and the E4M3 codes of `w [n, k]` (their values,
/// exact in f32) with the weight's dequantization scale `w_scale`, plus `bias [n]`: each
/// output `(Σ_k q(x)[r, k] · w[c, k]) * (1 / scale) * w_scale + bias[c]` in f32, the sum
/// taken in order of `k`. `None` when `x` holds a NaN or an Inf.
pub fn linear_reference(
    x: &[f32],
    k: usize,
    w: &[f32],
    w_scale: f32,
    bias: Option<&[f32]>,
) -> Option<Vec<f32>> {
    let scale = activation_scale(amax(x))?;
    let q: Vec<f32> = x.iter().map(|&v| quantize(v, scale)).collect();
    let n = w.len() / k.max(1);
    let alpha = (1.0 / scale) * w_scale;
    let rows = x.len() / k.max(1);
    let mut out = vec![0f32; rows * n];
    let fill = |(r, dst): (usize, &mut [f32])| {
        let xr = &q[r * k..(r + 1) * k];
        for (c, o) in dst.iter_mut().enumerate() {
            let wc = &w[c * k..(c + 1) * k];
            let sum = xr.iter().zip(wc).fold(0f32, |s, (a, b)| s + a * b);
            *o = sum * alpha + bias.map_or(0.0, |b| b[c]);
        }
    };
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
    let per = rows.div_ceil(threads).max(1);
    std::thread::scope(|s| {
        for (i, part) in out.chunks_mut(per * n.max(1)).enumerate() {
            let fill = &fill;
            s.spawn(move || {
                for (j, dst) in part.chunks_mut(n.max(1)).enumerate() {
                    fill((i * per + j, dst));
                }
            });
        }
    });
    Some(out)
}

/// Whether `w` is a weight [`Ops::linear_fp8`] takes: E4M3 codes `[n, k]`, scaled or not.
pub fn takes_weight(w: &Tensor) -> bool {
    w.dtype() == DType::F8E4M3 && w.shape().len() == 2 && w.quant().is_none()
}

/// [`Ops::linear_fp8_concat`] as the concatenation of `xs` on the last dim ([`Ops::concat`])
/// and one [`Ops::linear_fp8`] (a single part is passed as it is): the trait's default, and
/// the fallback of a backend whose own path does not take the parts.
pub fn linear_fp8_of_concat<O: Ops + ?Sized>(
    ops: &O,
    xs: &[&Tensor],
    w: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    crate::ops::on_concat_last(ops, xs, |x| ops.linear_fp8(x, w, bias))
}

/// [`Ops::linear_fp8`] through [`linear_reference`] on any backend: the operands read to the
/// host, the product made there, the result written back in `x`'s dtype. The trait's default
/// (the host backend's op, and the fallback of a device without fp8 tensor cores).
pub fn linear_fp8_reference<O: Ops + ?Sized>(
    ops: &O,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    let shape_error = |message: String| CoreError::Shape {
        what: "linear_fp8".into(),
        message,
    };
    if !takes_weight(w) {
        return Err(shape_error(format!(
            "the weight must be 2-D E4M3 codes, not {} {:?}",
            w.dtype(),
            w.shape()
        )));
    }
    let (n, k) = (w.shape()[0], w.shape()[1]);
    let Some((&last, lead)) = x.shape().split_last() else {
        return Err(shape_error("the input is a scalar".into()));
    };
    if last != k {
        return Err(shape_error(format!(
            "the input's last dim {last} is not the weight's {k} (input {:?}, weight {:?})",
            x.shape(),
            w.shape()
        )));
    }
    if let Some(b) = bias
        && b.shape() != [n]
    {
        return Err(shape_error(format!(
            "the bias is {:?}, not [{n}]",
            b.shape()
        )));
    }
    let xs = ops.to_f32_vec(x)?;
    // The codes' values alone: the scale is applied to the sum.
    // Cast first: a backend reads 8-bit floats only through `cast` and the linears.
    let codes = ops.to_f32_vec(&ops.cast(&w.clone().with_scale(None)?, DType::F32)?)?;
    let b = bias.map(|b| ops.to_f32_vec(b)).transpose()?;
    let y = linear_reference(&xs, k, &codes, w.scale().unwrap_or(1.0), b.as_deref()).ok_or_else(
        || CoreError::NonFiniteActivation {
            layer: String::new(),
        },
    )?;
    let mut shape = lead.to_vec();
    shape.push(n);
    ops.tensor_from_f32(&shape, x.dtype(), &y)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scale_maps_amax_to_e4m3s_largest_value_and_refuses_non_finite() {
        assert_eq!(activation_scale(2.0), Some(224.0));
        assert_eq!(activation_scale(0.0), Some(E4M3_MAX / AMAX_FLOOR));
        assert_eq!(activation_scale(f32::INFINITY), None);
        assert_eq!(activation_scale(f32::NAN), None);
        assert!(amax(&[1.0, f32::NAN, 3.0]).is_nan());
        assert_eq!(amax(&[1.0, -5.0, 3.0]), 5.0);
        assert_eq!(amax(&[1.0, f32::NEG_INFINITY]), f32::INFINITY);
    }

    #[test]
    fn quantizing_saturates_and_rounds_to_nearest_even() {
        // The scaled amax lands on 448 exactly; past it, the clamp holds it there.
        assert_eq!(quantize(2.0, 224.0), 448.0);
        assert_eq!(quantize(-2.0000002, 224.0), -448.0);
        // E4M3 steps by 0.125 between 1 and 2: 1.0625 lies halfway, to even (1.0); 1.1875
        // halfway between 1.125 and 1.25, to even (1.25).
        assert_eq!(quantize(1.0625, 1.0), 1.0);
        assert_eq!(quantize(1.1875, 1.0), 1.25);
        // The smallest subnormal is 2^-9; half of it rounds to 0.
        assert_eq!(quantize(2f32.powi(-9), 1.0), 2f32.powi(-9));
        assert_eq!(quantize(2f32.powi(-10), 1.0), 0.0);
    }

    #[test]
    fn the_reference_is_the_scaled_sum_of_exact_products() {
        // x = [[1, -2], [0.5, 4]]: amax 4, scale 112, codes exact (112, -224, 56, 448).
        let x = [1.0, -2.0, 0.5, 4.0];
        let w = [1.0, 0.5, -2.0, 0.25]; // two output rows
        let y = linear_reference(&x, 2, &w, 0.5, Some(&[10.0, -1.0])).unwrap();
        let inv = (1.0 / 112.0f32) * 0.5;
        let want = [
            (112.0 * 1.0 + -224.0 * 0.5) * inv + 10.0,
            (112.0 * -2.0 + -224.0 * 0.25) * inv - 1.0,
            (56.0 * 1.0 + 448.0 * 0.5) * inv + 10.0,
            (56.0 * -2.0 + 448.0 * 0.25) * inv - 1.0,
        ];
        assert_eq!(y, want);
        assert!(linear_reference(&[1.0, f32::INFINITY], 2, &w, 1.0, None).is_none());
        assert!(linear_reference(&[f32::NAN, 0.0], 2, &w, 1.0, None).is_none());
    }
}
