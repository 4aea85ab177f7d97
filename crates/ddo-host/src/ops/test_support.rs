//! Helpers shared by the host ops' unit tests: a device, seeded inputs, upload and
//! download, tolerances, index arithmetic and the f64 references used by more than one
//! family.

use std::sync::Arc;

use crate::device::HostDevice;
use ddo_core::dtype::DType;
use ddo_core::ops::Ops;
use ddo_core::rng::SplitMix64;
use ddo_core::tensor::Tensor;

pub(super) fn dev() -> Arc<HostDevice> {
    HostDevice::with_capacity(1 << 28).unwrap()
}

pub(super) fn random(rng: &mut SplitMix64, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.next_signed()).collect()
}

pub(super) fn put(d: &HostDevice, shape: &[usize], dtype: DType, values: &[f32]) -> Tensor {
    d.tensor_from_f32(shape, dtype, values).unwrap()
}

pub(super) fn get(d: &HostDevice, t: &Tensor) -> Vec<f32> {
    d.to_f32_vec(t).unwrap()
}

pub(super) fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

/// Relative L2 error of `got` against `want`.
pub(super) fn rel_l2(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "length");
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        num += (f64::from(g) - w).powi(2);
        den += w * w;
    }
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

#[track_caller]
pub(super) fn assert_close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    let e = rel_l2(got, want);
    assert!(e <= tol, "{what}: relative L2 error {e:e} > {tol:e}");
}

pub(super) const F32_TOL: f64 = 1e-5;
pub(super) const BF16_TOL: f64 = 1e-2;

/// Row-major multi-index of flat index `i` in `shape`.
pub(super) fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        idx[d] = i % shape[d];
        i /= shape[d];
    }
    idx
}

/// Flat index in a tensor of `shape` of the (right-aligned, broadcast) index `idx`.
pub(super) fn ravel_broadcast(idx: &[usize], shape: &[usize]) -> usize {
    let off = idx.len() - shape.len();
    shape.iter().enumerate().fold(0, |acc, (d, &n)| {
        acc * n + if n == 1 { 0 } else { idx[off + d] }
    })
}

pub(super) fn ref_linear(
    x: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    inp: usize,
    out: usize,
) -> Vec<f64> {
    let m = x.len() / inp;
    let mut y = vec![0.0; m * out];
    for i in 0..m {
        for o in 0..out {
            let mut s = b.map_or(0.0, |b| f64::from(b[o]));
            for k in 0..inp {
                s += f64::from(x[i * inp + k]) * f64::from(w[o * inp + k]);
            }
            y[i * out + o] = s;
        }
    }
    y
}

/// `erfc(z)` for `z >= 0`: positive-term series of erf below 3, continued fraction above.
pub(super) fn ref_erfc(z: f64) -> f64 {
    let sqrt_pi = std::f64::consts::PI.sqrt();
    if z < 3.0 {
        // erf z = 2/√π e^{-z²} Σ 2ⁿ z^{2n+1} / (1·3·…·(2n+1)), all terms positive.
        let (mut term, mut sum) = (z, z);
        for n in 1..200 {
            term *= 2.0 * z * z / (2 * n + 1) as f64;
            sum += term;
        }
        1.0 - 2.0 / sqrt_pi * (-z * z).exp() * sum
    } else {
        let mut f = z;
        for n in (1..300).rev() {
            f = z + (n as f64 / 2.0) / f;
        }
        (-z * z).exp() / (sqrt_pi * f)
    }
}

pub(super) fn ref_gelu_erf(x: f64) -> f64 {
    let z = x / std::f64::consts::SQRT_2;
    if x >= 0.0 {
        x * (1.0 - 0.5 * ref_erfc(z))
    } else {
        0.5 * x * ref_erfc(-z)
    }
}
