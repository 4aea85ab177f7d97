//! Scaled dot-product attention on the host: per (batch, head), in blocks of queries and
//! keys with an online softmax (no full score matrix is ever held), the blocks spread over
//! scoped threads when there is enough work.

use super::gemm::{Mat, gemm};
use super::read_opt;
use crate::device::HostDevice;
use ddo_core::error::Result;
use ddo_core::host_memory::try_vec;
use ddo_core::tensor::Tensor;

/// Queries per attention block.
const ATTN_BLOCK_Q: usize = 64;
/// Keys per attention block.
const ATTN_BLOCK_K: usize = 256;

/// The mask operand of one (batch, head): values, base offset and strides along
/// queries and keys.
#[derive(Clone, Copy)]
struct HeadMask<'a> {
    values: &'a [f32],
    base: usize,
    sq: usize,
    sk: usize,
}

#[derive(Clone, Copy)]
struct AttnDims {
    lq: usize,
    lk: usize,
    d: usize,
    dv: usize,
    scale: f32,
}

/// Attention of one (batch, head) with an online softmax over blocks of keys.
fn attend_head(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    mask: Option<HeadMask<'_>>,
    dims: AttnDims,
    out: &mut [f32],
) {
    let AttnDims {
        lq,
        lk,
        d,
        dv,
        scale,
    } = dims;
    let mut scores = vec![0.0f32; ATTN_BLOCK_Q * ATTN_BLOCK_K];
    let mut row_max = vec![f32::NEG_INFINITY; ATTN_BLOCK_Q];
    let mut row_sum = vec![0.0f32; ATTN_BLOCK_Q];
    for q0 in (0..lq).step_by(ATTN_BLOCK_Q) {
        let bq = ATTN_BLOCK_Q.min(lq - q0);
        let o_blk = &mut out[q0 * dv..(q0 + bq) * dv];
        o_blk.fill(0.0);
        row_max[..bq].fill(f32::NEG_INFINITY);
        row_sum[..bq].fill(0.0);
        for k0 in (0..lk).step_by(ATTN_BLOCK_K) {
            let bk = ATTN_BLOCK_K.min(lk - k0);
            let s = &mut scores[..bq * bk];
            // S = scale · Q_blk · K_blkᵀ (K read transposed through its strides).
            gemm(
                bq,
                d,
                bk,
                scale,
                Mat::new(&q[q0 * d..], d, 1),
                Mat::new(&k[k0 * d..], 1, d),
                0.0,
                s,
                bk,
            );
            for (i, row) in s.chunks_exact_mut(bk).enumerate() {
                if let Some(m) = mask {
                    let base = m.base + (q0 + i) * m.sq + k0 * m.sk;
                    for (j, x) in row.iter_mut().enumerate() {
                        *x += m.values[base + j * m.sk];
                    }
                }
                let blk_max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let new_max = row_max[i].max(blk_max);
                if new_max == f32::NEG_INFINITY {
                    // Everything so far is masked out: nothing to accumulate.
                    row.fill(0.0);
                    continue;
                }
                let correction = (row_max[i] - new_max).exp();
                let mut sum = 0.0f32;
                for x in row.iter_mut() {
                    *x = (*x - new_max).exp();
                    sum += *x;
                }
                row_sum[i] = row_sum[i] * correction + sum;
                row_max[i] = new_max;
                if correction != 1.0 {
                    for o in &mut o_blk[i * dv..(i + 1) * dv] {
                        *o *= correction;
                    }
                }
            }
            // O_blk += P · V_blk.
            gemm(
                bq,
                bk,
                dv,
                1.0,
                Mat::new(s, bk, 1),
                Mat::new(&v[k0 * dv..], dv, 1),
                1.0,
                o_blk,
                dv,
            );
        }
        // A row with no unmasked key has sum 0 and gives NaN, as softmax over -inf does.
        for (i, row) in o_blk.chunks_exact_mut(dv.max(1)).enumerate().take(bq) {
            let inv = 1.0 / row_sum[i];
            for o in row {
                *o *= inv;
            }
        }
    }
}

/// `Ops::attention` (`tokens` false: the output `[b, h, lq, dv]`) and
/// `Ops::attention_tokens` (`tokens` true: the same values written in token order,
/// `[b, lq, h·dv]`, the f32 results placed there before their one rounding, so the bytes are
/// those of attention, permute and the merge of heads) on the host; `op` names the call in
/// a shape error.
pub(super) fn attend(
    dev: &HostDevice,
    op: &'static str,
    [q, k, v]: [&Tensor; 3],
    mask: Option<&Tensor>,
    scale: f32,
    tokens: bool,
) -> Result<Tensor> {
    let ddo_core::shape::AttentionGeometry {
        b,
        h,
        lq,
        lk,
        d,
        dv,
        mask_strides,
    } = ddo_core::shape::attention_geometry(
        op,
        q.shape(),
        k.shape(),
        v.shape(),
        mask.map(Tensor::shape),
    )?;
    let qi = dev.input(op, q)?;
    let ki = dev.input(op, k)?;
    let vi = dev.input(op, v)?;
    let mi = mask.map(|m| dev.input(op, m)).transpose()?;
    let shape = if tokens {
        vec![b, lq, h * dv]
    } else {
        vec![b, h, lq, dv]
    };
    let output = dev.new_output(op, shape, q.dtype())?;
    dev.fence()?;
    let qv = qi.f32()?;
    let kv = ki.f32()?;
    let vv = vi.f32()?;
    let mv = read_opt(mi.as_ref())?;
    let dims = AttnDims {
        lq,
        lk,
        d,
        dv,
        scale,
    };
    let heads = b * h;
    let mut out = try_vec(heads * lq * dv, 0.0f32, "attention's output")?;
    // Work units: one block of queries of one (batch, head), each with its own rows of
    // the output, so a single long head spreads over threads too.
    let run = |head: usize, q0: usize, o: &mut [f32]| {
        let bq = ATTN_BLOCK_Q.min(lq - q0);
        let head_mask = match (&mv, &mask_strides) {
            (Some(values), Some(s)) => Some(HeadMask {
                values,
                base: (head / h) * s[0] + (head % h) * s[1] + q0 * s[2],
                sq: s[2],
                sk: s[3],
            }),
            _ => None,
        };
        let rows = head * lq + q0;
        attend_head(
            &qv[rows * d..(rows + bq) * d],
            &kv[head * lk * d..(head + 1) * lk * d],
            &vv[head * lk * dv..(head + 1) * lk * dv],
            head_mask,
            AttnDims { lq: bq, ..dims },
            o,
        );
    };
    let mut units: Vec<(usize, usize, &mut [f32])> = Vec::new();
    if dv > 0 && lq > 0 {
        for (head, o) in out.chunks_mut(lq * dv).enumerate() {
            for (i, blk) in o.chunks_mut(ATTN_BLOCK_Q * dv).enumerate() {
                units.push((head, i * ATTN_BLOCK_Q, blk));
            }
        }
    }
    let work = [heads, lq, lk, d + dv]
        .iter()
        .fold(1usize, |acc, &n| acc.saturating_mul(n));
    let threads = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(units.len());
    if threads <= 1 || work < (1 << 22) {
        for (head, q0, o) in units {
            run(head, q0, o);
        }
    } else {
        let mut parts: Vec<Vec<_>> = (0..threads).map(|_| Vec::new()).collect();
        for (i, unit) in units.into_iter().enumerate() {
            parts[i % threads].push(unit);
        }
        std::thread::scope(|scope| {
            for part in parts {
                let run = &run;
                scope.spawn(move || {
                    for (head, q0, o) in part {
                        run(head, q0, o);
                    }
                });
            }
        });
    }
    if tokens && h > 1 && lq * dv > 0 {
        // [b, h, lq, dv] -> [b, lq, h, dv], in f32 before the one rounding.
        let mut placed = try_vec(out.len(), 0.0f32, "attention's output")?;
        for (head, rows) in out.chunks_exact(lq * dv).enumerate() {
            let (bi, hi) = (head / h, head % h);
            for (i, row) in rows.chunks_exact(dv).enumerate() {
                let at = ((bi * lq + i) * h + hi) * dv;
                placed[at..at + dv].copy_from_slice(row);
            }
        }
        out = placed;
    }
    output.write_f32(&out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::test_support::*;
    use ddo_core::dtype::DType;
    use ddo_core::ops::Ops;
    use ddo_core::rng::SplitMix64;
    #[allow(clippy::too_many_arguments)]
    fn ref_attention(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        mask: Option<(&[f32], &[usize])>,
        [b, h, lq, lk, d, dv]: [usize; 6],
        scale: f64,
    ) -> Vec<f64> {
        let mut out = vec![0.0; b * h * lq * dv];
        for bi in 0..b {
            for hi in 0..h {
                let head = bi * h + hi;
                for i in 0..lq {
                    let mut s: Vec<f64> = (0..lk)
                        .map(|j| {
                            let dot: f64 = (0..d)
                                .map(|t| {
                                    f64::from(q[(head * lq + i) * d + t])
                                        * f64::from(k[(head * lk + j) * d + t])
                                })
                                .sum();
                            let m = mask.map_or(0.0, |(mv, ms)| {
                                f64::from(mv[ravel_broadcast(&[bi, hi, i, j], ms)])
                            });
                            dot * scale + m
                        })
                        .collect();
                    let mx = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    s.iter_mut().for_each(|x| *x = (*x - mx).exp());
                    let sum: f64 = s.iter().sum();
                    for t in 0..dv {
                        out[(head * lq + i) * dv + t] = (0..lk)
                            .map(|j| s[j] / sum * f64::from(v[(head * lk + j) * dv + t]))
                            .sum();
                    }
                }
            }
        }
        out
    }

    fn check_attention(
        d: &HostDevice,
        rng: &mut SplitMix64,
        dims @ [b, h, lq, lk, hd, dv]: [usize; 6],
        mask_shape: Option<&[usize]>,
    ) {
        let q = random(rng, b * h * lq * hd);
        let k = random(rng, b * h * lk * hd);
        let v = random(rng, b * h * lk * dv);
        let mask = mask_shape.map(|ms| {
            let mut m: Vec<f32> = random(rng, ms.iter().product())
                .iter()
                .map(|x| x * 2.0)
                .collect();
            // Mask a few keys out entirely (never a whole row).
            for (i, x) in m.iter_mut().enumerate() {
                if i % 7 == 3 {
                    *x = f32::NEG_INFINITY;
                }
            }
            m
        });
        let mt = mask
            .as_ref()
            .map(|m| put(d, mask_shape.unwrap_or(&[]), DType::F32, m));
        let scale = 1.0 / (hd as f32).sqrt();
        let y = d
            .attention(
                &put(d, &[b, h, lq, hd], DType::F32, &q),
                &put(d, &[b, h, lk, hd], DType::F32, &k),
                &put(d, &[b, h, lk, dv], DType::F32, &v),
                mt.as_ref(),
                scale,
            )
            .unwrap();
        assert_eq!(y.shape(), &[b, h, lq, dv]);
        let want = ref_attention(
            &q,
            &k,
            &v,
            mask.as_deref().zip(mask_shape),
            dims,
            f64::from(scale),
        );
        assert_close(
            &format!("attention {dims:?} mask {mask_shape:?}"),
            &get(d, &y),
            &want,
            F32_TOL,
        );
    }

    #[test]
    fn attention_matches_naive_softmax_with_masks_and_unequal_lengths() {
        let d = dev();
        let mut rng = SplitMix64::new(9);
        check_attention(&d, &mut rng, [2, 3, 5, 7, 8, 8], None);
        check_attention(&d, &mut rng, [2, 3, 5, 7, 8, 6], Some(&[2, 1, 5, 7]));
        check_attention(&d, &mut rng, [1, 2, 4, 9, 4, 4], Some(&[9]));
        // Several query and key blocks, with a key tail.
        check_attention(&d, &mut rng, [1, 2, 300, 300, 16, 16], Some(&[300, 300]));
        check_attention(&d, &mut rng, [1, 1, 70, 520, 8, 8], Some(&[1, 1, 1, 520]));
    }

    /// The token-order output is the composition's bytes (attention, permute, merge of
    /// heads) in every dtype, with and without a mask, one head or several, and empty.
    #[test]
    fn attention_in_token_order_gives_the_compositions_bytes() {
        let d = dev();
        let mut rng = SplitMix64::new(13);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for ([b, h, lq, lk, hd, dv], mask) in [
                ([2, 3, 5, 7, 8, 6], Some(vec![2, 1, 5, 7])),
                ([1, 4, 300, 130, 16, 16], None),
                ([2, 1, 9, 4, 8, 8], Some(vec![1, 1, 1, 4])),
                ([1, 2, 0, 3, 8, 8], None),
                ([1, 2, 3, 3, 8, 0], None),
            ] {
                let q = put(
                    &d,
                    &[b, h, lq, hd],
                    dtype,
                    &random(&mut rng, b * h * lq * hd),
                );
                let k = put(
                    &d,
                    &[b, h, lk, hd],
                    dtype,
                    &random(&mut rng, b * h * lk * hd),
                );
                let v = put(
                    &d,
                    &[b, h, lk, dv],
                    dtype,
                    &random(&mut rng, b * h * lk * dv),
                );
                let m = mask
                    .as_ref()
                    .map(|ms| put(&d, ms, dtype, &random(&mut rng, ms.iter().product())));
                let scale = 0.3;
                let got = d.attention_tokens(&q, &k, &v, m.as_ref(), scale).unwrap();
                let want =
                    ddo_core::ops::attention_tokens_composed(&*d, &q, &k, &v, m.as_ref(), scale)
                        .unwrap();
                assert_eq!(got.shape(), [b, lq, h * dv]);
                assert_eq!(got.shape(), want.shape());
                assert_eq!(got.dtype(), dtype);
                let (g, w) = (get(&d, &got), get(&d, &want));
                assert!(
                    g.iter().zip(&w).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{dtype:?} {:?}",
                    [b, h, lq, lk, hd, dv]
                );
            }
        }
        // A bad shape is the attention's typed error, named by the op.
        let q = put(&d, &[1, 2, 3, 8], DType::F32, &[0.0; 48]);
        let k = put(&d, &[1, 3, 3, 8], DType::F32, &[0.0; 72]);
        let e = d.attention_tokens(&q, &k, &k, None, 1.0).unwrap_err();
        assert!(
            matches!(e, ddo_core::CoreError::Shape { ref what, .. } if what == "attention_tokens"),
            "{e}"
        );
    }
}
