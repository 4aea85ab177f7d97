//! Matrix products on the host: the strided sgemm wrapper that every product runs on
//! (`matrixmultiply`, which threads large products itself), and the ops built directly on
//! it: `linear`, `linear_concat` (the parts joined in host scratch, never in device
//! memory) and `matmul` with broadcast batch dims.

use super::{product, walk};
use crate::device::HostDevice;
use ddo_core::error::Result;
use ddo_core::host_memory::try_vec;
use ddo_core::shape::broadcast_strides;
use ddo_core::tensor::Tensor;

/// A strided read-only matrix view.
#[derive(Clone, Copy)]
pub(super) struct Mat<'a> {
    data: &'a [f32],
    rs: usize,
    cs: usize,
}

impl<'a> Mat<'a> {
    pub(super) fn new(data: &'a [f32], rs: usize, cs: usize) -> Self {
        Self { data, rs, cs }
    }
}

/// Elements spanned by a `rows × cols` view with strides `rs`, `cs` (one past the last).
fn span(rows: usize, cols: usize, rs: usize, cs: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * rs + (cols - 1) * cs + 1
    }
}

/// `C ← alpha · A B + beta · C` with `A [m, k]`, `B [k, n]` and a row-major `C [m, n]`
/// of row stride `rsc`. With `beta == 0`, `C` is overwritten.
#[allow(clippy::too_many_arguments)]
pub(super) fn gemm(
    m: usize,
    k: usize,
    n: usize,
    alpha: f32,
    a: Mat<'_>,
    b: Mat<'_>,
    beta: f32,
    c: &mut [f32],
    rsc: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        rsc >= n && span(m, n, rsc, 1) <= c.len(),
        "gemm: output view out of bounds"
    );
    if k == 0 {
        for row in c.chunks_mut(rsc).take(m) {
            for v in &mut row[..n] {
                *v = if beta == 0.0 { 0.0 } else { *v * beta };
            }
        }
        return;
    }
    assert!(
        span(m, k, a.rs, a.cs) <= a.data.len() && span(k, n, b.rs, b.cs) <= b.data.len(),
        "gemm: input view out of bounds"
    );
    // SAFETY: the asserts above keep every element sgemm touches inside `a.data`,
    // `b.data` and `c`; `c` is a unique borrow, so it aliases neither input, and its
    // strides (`rsc >= n`, 1) address distinct elements. Strides fit in isize because
    // they index within slices.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            alpha,
            a.data.as_ptr(),
            a.rs as isize,
            a.cs as isize,
            b.data.as_ptr(),
            b.rs as isize,
            b.cs as isize,
            beta,
            c.as_mut_ptr(),
            rsc as isize,
            1,
        );
    }
}

impl HostDevice {
    /// `linear(concat(xs, last dim), w, bias)`: the parts' rows are joined in host scratch,
    /// never in device memory.
    fn linear_parts(
        &self,
        xs: &[&Tensor],
        w: &Tensor,
        bias: Option<&Tensor>,
        op: &str,
    ) -> Result<Tensor> {
        let shapes: Vec<&[usize]> = xs.iter().map(|x| x.shape()).collect();
        let g = ddo_core::shape::linear_geometry(op, &shapes, w.shape())?;
        let (out_f, in_f, m) = (g.out_features, g.in_features, g.rows);
        let inputs = xs
            .iter()
            .map(|x| self.input(op, x))
            .collect::<Result<Vec<_>>>()?;
        // The weight and bias may be (scaled) fp8: dequantized as CUDA's upcast does.
        let wi = self.dequant_input(op, w)?;
        let bi = self.optional_bias(op, bias, out_f)?;
        let compute = xs[0].dtype();
        let shape = g.out_shape.clone();
        let output = self.new_output(op, shape, xs[0].dtype())?;
        self.fence()?;
        let xv = if let [one] = inputs.as_slice() {
            one.f32()?
        } else {
            let mut joined = try_vec(m * in_f, 0.0f32, "a linear's joined input")?;
            let mut col = 0;
            for (xi, &width) in inputs.iter().zip(&g.widths) {
                let part = xi.f32()?;
                for (row, src) in joined
                    .chunks_exact_mut(in_f.max(1))
                    .zip(part.chunks_exact(width.max(1)))
                {
                    row[col..col + width].copy_from_slice(src);
                }
                col += width;
            }
            joined
        };
        let (mut out, beta) = match bi.as_ref().map(|b| b.dequantized(compute)).transpose()? {
            Some(b) => (b.repeat(m), 1.0),
            None => (try_vec(m * out_f, 0.0, "a linear's output")?, 0.0),
        };
        let mut run = |wv: &[f32]| {
            gemm(
                m,
                in_f,
                out_f,
                1.0,
                Mat::new(&xv, in_f, 1),
                // B[i][o] = w[o][i]: w read transposed through its strides.
                Mat::new(wv, 1, in_f),
                beta,
                &mut out,
                out_f,
            );
        };
        if wi.dtype.is_fp8() {
            run(&wi.dequantized(compute)?);
        } else {
            wi.with_f32(run)?;
        }
        output.write_f32(&out)
    }
}

pub(super) fn linear(
    dev: &HostDevice,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    dev.linear_parts(&[x], w, bias, "linear")
}

/// Exactly `linear(concat(xs), w, bias)` of this backend (the concatenation is exact
/// when the parts share a dtype), without a device buffer for the concatenation.
pub(super) fn linear_concat(
    dev: &HostDevice,
    xs: &[&Tensor],
    w: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    let same_dtype = xs.iter().all(|t| t.dtype() == xs[0].dtype());
    if xs.len() < 2 || !same_dtype {
        return ddo_core::ops::linear_concat_by_concat(dev, xs, w, bias);
    }
    dev.linear_parts(xs, w, bias, "linear_concat")
}

pub(super) fn matmul(dev: &HostDevice, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "matmul";
    let g = ddo_core::shape::matmul_geometry(OP, a.shape(), b.shape())?;
    let (ab, bb, batch) = (&g.a_batch[..], &g.b_batch[..], &g.batch[..]);
    let (m, k, n) = (g.m, g.k, g.n);
    let ai = dev.input(OP, a)?;
    let bi = dev.input(OP, b)?;
    let shape = g.out_shape();
    let output = dev.new_output(OP, shape, a.dtype())?;
    dev.fence()?;
    let av = ai.f32()?;
    let bv = bi.f32()?;
    let nb = product(batch);
    let mut out = try_vec(nb * m * n, 0.0f32, "a matmul's output")?;
    if product(bb) == 1 {
        // One shared right-hand matrix: fold a's batch into its rows.
        gemm(
            nb * m,
            k,
            n,
            1.0,
            Mat::new(&av, k, 1),
            Mat::new(&bv, n, 1),
            0.0,
            &mut out,
            n,
        );
    } else {
        let sa: Vec<usize> = broadcast_strides(ab, batch)
            .iter()
            .map(|s| s * m * k)
            .collect();
        let sb: Vec<usize> = broadcast_strides(bb, batch)
            .iter()
            .map(|s| s * k * n)
            .collect();
        let mut chunks = out.chunks_mut((m * n).max(1));
        walk(batch, [&sa, &sb], |[oa, ob]| {
            if let Some(c) = chunks.next() {
                gemm(
                    m,
                    k,
                    n,
                    1.0,
                    Mat::new(&av[oa..], k, 1),
                    Mat::new(&bv[ob..], n, 1),
                    0.0,
                    c,
                    n,
                );
            }
        });
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
    fn ref_matmul(a: &[f32], ash: &[usize], b: &[f32], bsh: &[usize], osh: &[usize]) -> Vec<f64> {
        let r = osh.len();
        let (m, k, n) = (osh[r - 2], ash[ash.len() - 1], osh[r - 1]);
        let (ab, bb) = (&ash[..ash.len() - 2], &bsh[..bsh.len() - 2]);
        let nb: usize = osh[..r - 2].iter().product();
        let mut y = vec![0.0; nb * m * n];
        for bi in 0..nb {
            let idx = unravel(bi, &osh[..r - 2]);
            let (ao, bo) = (ravel_broadcast(&idx, ab), ravel_broadcast(&idx, bb));
            for i in 0..m {
                for j in 0..n {
                    y[(bi * m + i) * n + j] = (0..k)
                        .map(|t| {
                            f64::from(a[(ao * m + i) * k + t]) * f64::from(b[(bo * k + t) * n + j])
                        })
                        .sum();
                }
            }
        }
        y
    }

    #[test]
    fn linear_matches_reference_with_and_without_bias() {
        let d = dev();
        let mut rng = SplitMix64::new(1);
        let (inp, out) = (19, 7);
        let x = random(&mut rng, 2 * 3 * inp);
        let w = random(&mut rng, out * inp);
        let b = random(&mut rng, out);
        let (xt, wt, bt) = (
            put(&d, &[2, 3, inp], DType::F32, &x),
            put(&d, &[out, inp], DType::F32, &w),
            put(&d, &[out], DType::F32, &b),
        );
        let y = d.linear(&xt, &wt, Some(&bt)).unwrap();
        assert_eq!(y.shape(), &[2, 3, out]);
        assert_close(
            "linear+bias",
            &get(&d, &y),
            &ref_linear(&x, &w, Some(&b), inp, out),
            F32_TOL,
        );
        let y = d.linear(&xt, &wt, None).unwrap();
        assert_close(
            "linear",
            &get(&d, &y),
            &ref_linear(&x, &w, None, inp, out),
            F32_TOL,
        );
    }

    #[test]
    fn matmul_broadcasts_batch_dims() {
        let d = dev();
        let mut rng = SplitMix64::new(3);
        let cases: [(&[usize], &[usize], &[usize]); 4] = [
            (&[2, 3, 4, 5], &[2, 3, 5, 6], &[2, 3, 4, 6]),
            (&[1, 3, 4, 5], &[2, 1, 5, 6], &[2, 3, 4, 6]),
            (&[2, 3, 4, 5], &[5, 6], &[2, 3, 4, 6]),
            (&[4, 5], &[3, 5, 2], &[3, 4, 2]),
        ];
        for (ash, bsh, osh) in cases {
            let a = random(&mut rng, ash.iter().product());
            let b = random(&mut rng, bsh.iter().product());
            let y = d
                .matmul(&put(&d, ash, DType::F32, &a), &put(&d, bsh, DType::F32, &b))
                .unwrap();
            assert_eq!(y.shape(), osh);
            let want = ref_matmul(&a, ash, &b, bsh, osh);
            assert_close(
                &format!("matmul {ash:?}x{bsh:?}"),
                &get(&d, &y),
                &want,
                F32_TOL,
            );
        }
    }

    /// A tensor's encoded bytes (for bit-for-bit comparisons).
    fn bytes(d: &HostDevice, t: &Tensor) -> Vec<u8> {
        t.to_host_bytes(d, &d.compute_stream()).unwrap()
    }

    #[test]
    fn linear_concat_equals_linear_of_the_concatenation_bit_for_bit() {
        let d = dev();
        let mut rng = SplitMix64::new(13);
        let out = 11;
        for dtype in [DType::F32, DType::BF16] {
            for widths in [&[5usize, 8][..], &[3, 16, 7], &[0, 9], &[4, 0, 4]] {
                let inp: usize = widths.iter().sum();
                let parts: Vec<Tensor> = widths
                    .iter()
                    .map(|&wd| put(&d, &[2, 3, wd], dtype, &random(&mut rng, 6 * wd)))
                    .collect();
                let refs: Vec<&Tensor> = parts.iter().collect();
                let w = put(&d, &[out, inp], dtype, &random(&mut rng, out * inp));
                let b = put(&d, &[out], dtype, &random(&mut rng, out));
                let joined = d.concat(&refs, 2).unwrap();
                for bias in [None, Some(&b)] {
                    let what = format!("{dtype} widths {widths:?} bias {}", bias.is_some());
                    let got = d.linear_concat(&refs, &w, bias).unwrap();
                    let want = d.linear(&joined, &w, bias).unwrap();
                    assert_eq!(got.shape(), &[2, 3, out], "{what}");
                    assert_eq!(got.dtype(), dtype, "{what}");
                    assert_eq!(bytes(&d, &got), bytes(&d, &want), "{what}");
                }
            }
            // One part is linear itself.
            let x = put(&d, &[4, 6], dtype, &random(&mut rng, 24));
            let w = put(&d, &[out, 6], dtype, &random(&mut rng, out * 6));
            let b = put(&d, &[out], dtype, &random(&mut rng, out));
            for bias in [None, Some(&b)] {
                assert_eq!(
                    bytes(&d, &d.linear_concat(&[&x], &w, bias).unwrap()),
                    bytes(&d, &d.linear(&x, &w, bias).unwrap()),
                    "{dtype} one part"
                );
            }
        }
        // Parts of different dtypes: the concatenation converts into the first's dtype.
        let xa = put(&d, &[3, 4], DType::F32, &random(&mut rng, 12));
        let xb = put(&d, &[3, 5], DType::BF16, &random(&mut rng, 15));
        let w = put(&d, &[out, 9], DType::F32, &random(&mut rng, out * 9));
        let got = d.linear_concat(&[&xa, &xb], &w, None).unwrap();
        assert_eq!(got.dtype(), DType::F32);
        let joined = d.concat(&[&xa, &xb], 1).unwrap();
        assert_eq!(
            bytes(&d, &got),
            bytes(&d, &d.linear(&joined, &w, None).unwrap())
        );
    }

    #[test]
    fn linear_concat_refuses_bad_shapes() {
        let d = dev();
        let t = |shape: &[usize]| put(&d, shape, DType::F32, &vec![0.5; shape.iter().product()]);
        let refused = |xs: &[&Tensor], w: &Tensor, b: Option<&Tensor>| {
            matches!(d.linear_concat(xs, w, b), Err(CoreError::Shape { .. }))
        };
        let w = t(&[4, 7]);
        // Leading dims that differ, or ranks that differ.
        assert!(refused(&[&t(&[2, 3]), &t(&[3, 4])], &w, None));
        assert!(refused(&[&t(&[2, 2, 3]), &t(&[2, 3, 4])], &w, None));
        assert!(refused(&[&t(&[2, 3]), &t(&[1, 2, 4])], &w, None));
        // Widths not summing to `in` (short and long).
        assert!(refused(&[&t(&[2, 3]), &t(&[2, 3])], &w, None));
        assert!(refused(&[&t(&[2, 3]), &t(&[2, 5])], &w, None));
        assert!(refused(&[&t(&[2, 3]), &t(&[2, 2]), &t(&[2, 3])], &w, None));
        // A weight that is not a matrix, a bias of the wrong length, scalar parts.
        assert!(refused(&[&t(&[2, 3]), &t(&[2, 4])], &t(&[28]), None));
        assert!(refused(&[&t(&[2, 3]), &t(&[2, 4])], &w, Some(&t(&[7]))));
        assert!(refused(&[&t(&[]), &t(&[])], &w, None));
        // No parts at all.
        assert!(refused(&[], &w, None));
        // A good call still works, and the refusals leaked nothing.
        let before = d.memory_info().allocated;
        let y = d
            .linear_concat(&[&t(&[2, 3]), &t(&[2, 4])], &w, Some(&t(&[4])))
            .unwrap();
        assert_eq!(y.shape(), &[2, 4]);
        drop(y);
        assert_eq!(d.memory_info().allocated, before);
    }
}
