//! Row-wise ops on the host: group, layer and RMS normalisation (statistics in f64),
//! softmax over the last dim, reductions over one dim, and the count of non-finite values.

use super::{product, read_opt, shape_err};
use crate::device::HostDevice;
use ddo_core::error::Result;
use ddo_core::host_memory::try_vec;
use ddo_core::ops::ReduceOp;
use ddo_core::tensor::Tensor;

pub(super) fn group_norm(
    dev: &HostDevice,
    x: &Tensor,
    groups: usize,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f32,
) -> Result<Tensor> {
    const OP: &str = "group_norm";
    let xs = x.shape();
    if xs.len() < 2 || groups == 0 || !xs[1].is_multiple_of(groups) {
        return Err(shape_err(
            OP,
            format!(
                "x {xs:?} with {groups} groups: expected x [n, c, ...] with c divisible by \
                 groups"
            ),
        ));
    }
    let (n, c) = (xs[0], xs[1]);
    let spatial = product(&xs[2..]);
    let xi = dev.input(OP, x)?;
    let wi = dev.optional_vector(OP, "weight", weight, c)?;
    let bi = dev.optional_vector(OP, "bias", bias, c)?;
    let output = dev.new_output(OP, xs.to_vec(), x.dtype())?;
    dev.fence()?;
    let xv = xi.f32()?;
    let wv = read_opt(wi.as_ref())?;
    let bv = read_opt(bi.as_ref())?;
    let cg = c / groups;
    let group_len = cg * spatial;
    let mut out = try_vec(xv.len(), 0.0f32, "a norm's output")?;
    for ni in 0..n {
        for g in 0..groups {
            let start = (ni * c + g * cg) * spatial;
            let src = &xv[start..start + group_len];
            let (mean, inv) = mean_inv_std(src, eps);
            for cc in 0..cg {
                let ch = g * cg + cc;
                let scale = wv.as_ref().map_or(1.0, |w| f64::from(w[ch]));
                let shift = bv.as_ref().map_or(0.0, |b| f64::from(b[ch]));
                let range = start + cc * spatial..start + (cc + 1) * spatial;
                for (o, &v) in out[range.clone()].iter_mut().zip(&xv[range]) {
                    *o = ((f64::from(v) - mean) * inv * scale + shift) as f32;
                }
            }
        }
    }
    output.write_f32(&out)
}

pub(super) fn layer_norm(
    dev: &HostDevice,
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f32,
) -> Result<Tensor> {
    const OP: &str = "layer_norm";
    let xs = x.shape();
    let Some(&d) = xs.last() else {
        return Err(shape_err(OP, "x is a scalar; expected x [..., d]"));
    };
    let xi = dev.input(OP, x)?;
    let wi = dev.optional_vector(OP, "weight", weight, d)?;
    let bi = dev.optional_vector(OP, "bias", bias, d)?;
    let output = dev.new_output(OP, xs.to_vec(), x.dtype())?;
    dev.fence()?;
    let xv = xi.f32()?;
    let wv = read_opt(wi.as_ref())?;
    let bv = read_opt(bi.as_ref())?;
    let mut out = try_vec(xv.len(), 0.0f32, "a norm's output")?;
    for (orow, row) in out
        .chunks_exact_mut(d.max(1))
        .zip(xv.chunks_exact(d.max(1)))
    {
        let (mean, inv) = mean_inv_std(row, eps);
        for (j, (o, &v)) in orow.iter_mut().zip(row).enumerate() {
            let scale = wv.as_ref().map_or(1.0, |w| f64::from(w[j]));
            let shift = bv.as_ref().map_or(0.0, |b| f64::from(b[j]));
            *o = ((f64::from(v) - mean) * inv * scale + shift) as f32;
        }
    }
    output.write_f32(&out)
}

pub(super) fn rms_norm(
    dev: &HostDevice,
    x: &Tensor,
    weight: Option<&Tensor>,
    eps: f32,
) -> Result<Tensor> {
    const OP: &str = "rms_norm";
    let xs = x.shape();
    let Some(&d) = xs.last() else {
        return Err(shape_err(OP, "x is a scalar; expected x [..., d]"));
    };
    let xi = dev.input(OP, x)?;
    let wi = dev.optional_vector(OP, "weight", weight, d)?;
    let output = dev.new_output(OP, xs.to_vec(), x.dtype())?;
    dev.fence()?;
    let xv = xi.f32()?;
    let wv = read_opt(wi.as_ref())?;
    let mut out = try_vec(xv.len(), 0.0f32, "a norm's output")?;
    for (orow, row) in out
        .chunks_exact_mut(d.max(1))
        .zip(xv.chunks_exact(d.max(1)))
    {
        let ms = row
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>()
            / d as f64;
        let inv = 1.0 / (ms + f64::from(eps)).sqrt();
        for (j, (o, &v)) in orow.iter_mut().zip(row).enumerate() {
            let scale = wv.as_ref().map_or(1.0, |w| f64::from(w[j]));
            *o = (f64::from(v) * inv * scale) as f32;
        }
    }
    output.write_f32(&out)
}

pub(super) fn softmax(dev: &HostDevice, x: &Tensor) -> Result<Tensor> {
    const OP: &str = "softmax";
    let Some(&d) = x.shape().last() else {
        return Err(shape_err(OP, "x is a scalar; expected x [..., d]"));
    };
    let xi = dev.input(OP, x)?;
    let output = dev.new_output(OP, x.shape().to_vec(), x.dtype())?;
    dev.fence()?;
    let mut v = xi.f32()?;
    for row in v.chunks_exact_mut(d.max(1)) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f64;
        for e in row.iter_mut() {
            *e = (*e - max).exp();
            sum += f64::from(*e);
        }
        let inv = (1.0 / sum) as f32;
        for e in row.iter_mut() {
            *e *= inv;
        }
    }
    output.write_f32(&v)
}

pub(super) fn reduce(dev: &HostDevice, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
    const OP: &str = "reduce";
    let xs = x.shape();
    if dim >= xs.len() {
        return Err(shape_err(
            OP,
            format!("dim {dim} out of range for shape {xs:?}"),
        ));
    }
    let (outer, len, inner) = (product(&xs[..dim]), xs[dim], product(&xs[dim + 1..]));
    if len == 0 && op == ReduceOp::Max {
        return Err(shape_err(
            OP,
            format!("max over the empty dim {dim} of shape {xs:?}"),
        ));
    }
    let xi = dev.input(OP, x)?;
    let mut shape = xs.to_vec();
    shape[dim] = 1;
    let output = dev.new_output(OP, shape, x.dtype())?;
    dev.fence()?;
    let xv = xi.f32()?;
    let mut out = vec![0.0f32; outer * inner];
    for oi in 0..outer {
        for ii in 0..inner {
            let at = |j: usize| xv[(oi * len + j) * inner + ii];
            out[oi * inner + ii] = match op {
                ReduceOp::Sum => (0..len).map(|j| f64::from(at(j))).sum::<f64>() as f32,
                ReduceOp::Mean => {
                    ((0..len).map(|j| f64::from(at(j))).sum::<f64>() / len as f64) as f32
                }
                ReduceOp::Max => (0..len).map(at).fold(f32::NEG_INFINITY, f32::max),
            };
        }
    }
    output.write_f32(&out)
}

/// [`ddo_core::Ops::count_non_finite`]: bit tests on the stored bytes after the fence
/// ([`ddo_core::values::count_non_finite`]; fp8 read as stored, a scaled tensor refused as
/// by every op but cast and the linears).
pub(super) fn count_non_finite(dev: &HostDevice, x: &Tensor) -> Result<u64> {
    let xi = dev.input("count_non_finite", x)?;
    dev.fence()?;
    Ok(xi.bytes(|b| ddo_core::values::count_non_finite(xi.dtype, b)))
}

/// Mean and `1 / sqrt(var + eps)` (biased variance) of `values`, two-pass in f64.
fn mean_inv_std(values: &[f32], eps: f32) -> (f64, f64) {
    let n = values.len().max(1) as f64;
    let mean = values.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let var = values
        .iter()
        .map(|&v| {
            let c = f64::from(v) - mean;
            c * c
        })
        .sum::<f64>()
        / n;
    (mean, 1.0 / (var + f64::from(eps)).sqrt())
}

#[cfg(test)]
mod tests {
    use crate::ops::test_support::*;
    use ddo_core::dtype::DType;
    use ddo_core::ops::Ops;
    use ddo_core::rng::SplitMix64;
    fn ref_norm_rows(x: &[f32], d: usize, eps: f64, rms: bool) -> Vec<f64> {
        let mut y = Vec::with_capacity(x.len());
        for row in x.chunks(d) {
            let r = f64s(row);
            let n = d as f64;
            if rms {
                let ms = r.iter().map(|v| v * v).sum::<f64>() / n;
                y.extend(r.iter().map(|v| v / (ms + eps).sqrt()));
            } else {
                let mean = r.iter().sum::<f64>() / n;
                let var = r.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
                y.extend(r.iter().map(|v| (v - mean) / (var + eps).sqrt()));
            }
        }
        y
    }

    #[test]
    fn normalisations_match_f64_references() {
        let d = dev();
        let mut rng = SplitMix64::new(5);
        let eps = 1e-5f32;
        // An offset mean checks that statistics are accurate, not just roughly right.
        let x: Vec<f32> = random(&mut rng, 2 * 6 * 5 * 3)
            .iter()
            .map(|v| v + 50.0)
            .collect();
        let xt = put(&d, &[2, 6, 5, 3], DType::F32, &x);
        let w = random(&mut rng, 6);
        let b = random(&mut rng, 6);
        let (wt, bt) = (put(&d, &[6], DType::F32, &w), put(&d, &[6], DType::F32, &b));
        let y = d.group_norm(&xt, 3, Some(&wt), Some(&bt), eps).unwrap();
        // Group norm over [n, groups, 2·15] is a row norm, then a per-channel affine.
        let mut want = ref_norm_rows(&x, 2 * 15, f64::from(eps), false);
        for (i, v) in want.iter_mut().enumerate() {
            let ch = (i / 15) % 6;
            *v = *v * f64::from(w[ch]) + f64::from(b[ch]);
        }
        assert_close("group_norm", &get(&d, &y), &want, F32_TOL);
        let y = d.group_norm(&xt, 6, None, None, eps).unwrap();
        assert_close(
            "group_norm plain",
            &get(&d, &y),
            &ref_norm_rows(&x, 15, 1e-5, false),
            F32_TOL,
        );

        let x = random(&mut rng, 4 * 10);
        let xt = put(&d, &[4, 10], DType::F32, &x);
        let w = random(&mut rng, 10);
        let b = random(&mut rng, 10);
        let (wt, bt) = (
            put(&d, &[10], DType::F32, &w),
            put(&d, &[10], DType::F32, &b),
        );
        let y = d.layer_norm(&xt, Some(&wt), Some(&bt), eps).unwrap();
        let mut want = ref_norm_rows(&x, 10, f64::from(eps), false);
        for (i, v) in want.iter_mut().enumerate() {
            *v = *v * f64::from(w[i % 10]) + f64::from(b[i % 10]);
        }
        assert_close("layer_norm", &get(&d, &y), &want, F32_TOL);
        let y = d.rms_norm(&xt, Some(&wt), eps).unwrap();
        let mut want = ref_norm_rows(&x, 10, f64::from(eps), true);
        for (i, v) in want.iter_mut().enumerate() {
            *v *= f64::from(w[i % 10]);
        }
        assert_close("rms_norm", &get(&d, &y), &want, F32_TOL);
    }
}
