//! 2-D convolution on the host: im2col in bounded chunks of output rows, then one GEMM per
//! chunk (a 1×1, stride-1, unpadded convolution is a GEMM on the input directly).

use super::gemm::{Mat, gemm};
use super::read_opt;
use crate::device::HostDevice;
use ddo_core::error::Result;
use ddo_core::host_memory::try_vec;
use ddo_core::ops::Conv2dParams;
use ddo_core::tensor::Tensor;

/// Largest im2col scratch of a convolution, in f32 elements (16 MiB).
const IM2COL_CHUNK: usize = 1 << 22;

pub(super) fn conv2d(
    dev: &HostDevice,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    params: Conv2dParams,
) -> Result<Tensor> {
    const OP: &str = "conv2d";
    let Conv2dParams {
        stride: (sh, sw),
        padding: (ph, pw),
    } = params;
    let ddo_core::shape::Conv2dGeometry {
        n,
        c,
        h,
        w: wd,
        o,
        kh,
        kw,
        oh,
        ow,
    } = ddo_core::shape::conv2d_geometry(OP, x.shape(), w.shape(), params)?;
    let xi = dev.input(OP, x)?;
    let wi = dev.input(OP, w)?;
    let bi = dev.optional_vector(OP, "bias", bias, o)?;
    let output = dev.new_output(OP, vec![n, o, oh, ow], x.dtype())?;
    dev.fence()?;
    let xv = xi.f32()?;
    let bv = read_opt(bi.as_ref())?;
    let kdim = c * kh * kw;
    let plane = oh * ow;
    let mut out = try_vec(n * o * plane, 0.0f32, "a convolution's output")?;
    if let Some(b) = &bv {
        for img in out.chunks_mut((o * plane).max(1)) {
            for (ch, &bias) in img.chunks_mut(plane.max(1)).zip(b) {
                ch.fill(bias);
            }
        }
    }
    let beta = if bv.is_some() { 1.0 } else { 0.0 };
    let direct = kh == 1 && kw == 1 && sh == 1 && sw == 1 && ph == 0 && pw == 0;
    let rows_per_chunk = (IM2COL_CHUNK / (kdim * ow).max(1)).clamp(1, oh.max(1));
    let mut cols = if direct {
        Vec::new()
    } else {
        try_vec(
            kdim * rows_per_chunk * ow,
            0.0f32,
            "a convolution's im2col columns",
        )?
    };
    wi.with_f32(|wv| {
        let wm = Mat::new(wv, kdim, 1);
        for img in 0..n {
            let xin = &xv[img * c * h * wd..(img + 1) * c * h * wd];
            let oimg = &mut out[img * o * plane..(img + 1) * o * plane];
            if direct {
                let b = Mat::new(xin, h * wd, 1);
                gemm(o, kdim, plane, 1.0, wm, b, beta, oimg, plane);
                continue;
            }
            for r0 in (0..oh).step_by(rows_per_chunk) {
                let rows = rows_per_chunk.min(oh - r0);
                let ncol = rows * ow;
                im2col(
                    xin,
                    (c, h, wd),
                    (kh, kw),
                    params,
                    (r0, rows, ow),
                    &mut cols[..kdim * ncol],
                );
                let b = Mat::new(&cols[..kdim * ncol], ncol, 1);
                gemm(o, kdim, ncol, 1.0, wm, b, beta, &mut oimg[r0 * ow..], plane);
            }
        }
    })?;
    output.write_f32(&out)
}

/// Fills `cols [c·kh·kw, rows·ow]` with the patches of output rows `r0..r0 + rows` of one
/// image `x [c, h, w]` (zeros where the kernel reads padding).
fn im2col(
    x: &[f32],
    (c, h, w): (usize, usize, usize),
    (kh, kw): (usize, usize),
    params: Conv2dParams,
    (r0, rows, ow): (usize, usize, usize),
    cols: &mut [f32],
) {
    let Conv2dParams {
        stride: (sh, sw),
        padding: (ph, pw),
    } = params;
    let ncol = rows * ow;
    // Output columns whose input column `ox·sw + kj - pw` lies inside `0..w`.
    let valid_cols = |kj: usize| {
        let lo = pw.saturating_sub(kj).div_ceil(sw);
        let hi = if w + pw > kj {
            ((w + pw - kj - 1) / sw + 1).min(ow)
        } else {
            0
        };
        (lo.min(hi), hi)
    };
    let mut chunks = cols.chunks_exact_mut(ncol.max(1));
    for ci in 0..c {
        let plane = &x[ci * h * w..(ci + 1) * h * w];
        for ki in 0..kh {
            for kj in 0..kw {
                let Some(dst) = chunks.next() else { return };
                let (lo, hi) = valid_cols(kj);
                for (r, drow) in dst.chunks_exact_mut(ow.max(1)).enumerate() {
                    let iy = (r0 + r) * sh + ki;
                    if iy < ph || iy - ph >= h {
                        drow.fill(0.0);
                        continue;
                    }
                    let src = &plane[(iy - ph) * w..(iy - ph + 1) * w];
                    drow[..lo].fill(0.0);
                    drow[hi..].fill(0.0);
                    if sw == 1 {
                        let ix0 = lo + kj - pw;
                        drow[lo..hi].copy_from_slice(&src[ix0..ix0 + (hi - lo)]);
                    } else {
                        for (ox, d) in drow[lo..hi].iter_mut().enumerate() {
                            *d = src[(lo + ox) * sw + kj - pw];
                        }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::test_support::*;
    use ddo_core::dtype::DType;
    use ddo_core::ops::Ops;
    use ddo_core::rng::SplitMix64;
    #[allow(clippy::too_many_arguments)]
    fn ref_conv(
        x: &[f32],
        [n, c, h, w]: [usize; 4],
        wt: &[f32],
        [o, kh, kw]: [usize; 3],
        b: Option<&[f32]>,
        (s, p): (usize, usize),
    ) -> (Vec<f64>, [usize; 4]) {
        let oh = (h + 2 * p - kh) / s + 1;
        let ow = (w + 2 * p - kw) / s + 1;
        let mut y = vec![0.0; n * o * oh * ow];
        for ni in 0..n {
            for oi in 0..o {
                for yi in 0..oh {
                    for xi in 0..ow {
                        let mut acc = b.map_or(0.0, |b| f64::from(b[oi]));
                        for ci in 0..c {
                            for ki in 0..kh {
                                for kj in 0..kw {
                                    let iy = (yi * s + ki) as isize - p as isize;
                                    let ix = (xi * s + kj) as isize - p as isize;
                                    if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                        continue;
                                    }
                                    let xv = x[((ni * c + ci) * h + iy as usize) * w + ix as usize];
                                    let wv = wt[((oi * c + ci) * kh + ki) * kw + kj];
                                    acc += f64::from(xv) * f64::from(wv);
                                }
                            }
                        }
                        y[((ni * o + oi) * oh + yi) * ow + xi] = acc;
                    }
                }
            }
        }
        (y, [n, o, oh, ow])
    }

    #[test]
    fn conv2d_matches_reference_with_stride_and_padding() {
        let d = dev();
        let mut rng = SplitMix64::new(4);
        // (x shape, (o, kh, kw), (stride, padding), bias)
        let cases = [
            ([2, 3, 9, 8], [4, 3, 3], (2, 1), true),
            ([1, 3, 7, 7], [5, 3, 3], (1, 1), false),
            ([2, 4, 5, 6], [3, 1, 1], (1, 0), true),
            ([1, 2, 6, 9], [2, 2, 3], (2, 0), true),
            ([1, 2, 4, 4], [2, 4, 4], (3, 2), false),
        ];
        for (xs, [o, kh, kw], (s, p), with_bias) in cases {
            let x = random(&mut rng, xs.iter().product());
            let w = random(&mut rng, o * xs[1] * kh * kw);
            let b = random(&mut rng, o);
            let bt = put(&d, &[o], DType::F32, &b);
            let y = d
                .conv2d(
                    &put(&d, &xs, DType::F32, &x),
                    &put(&d, &[o, xs[1], kh, kw], DType::F32, &w),
                    with_bias.then_some(&bt),
                    Conv2dParams::new(s, p),
                )
                .unwrap();
            let (want, wshape) =
                ref_conv(&x, xs, &w, [o, kh, kw], with_bias.then_some(&b[..]), (s, p));
            assert_eq!(y.shape(), &wshape);
            assert_close(
                &format!("conv {xs:?} k{kh}x{kw} s{s} p{p}"),
                &get(&d, &y),
                &want,
                F32_TOL,
            );
        }
    }
}
