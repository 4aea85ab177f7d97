//! Shape arithmetic every `Ops` backend needs, in one place: NumPy broadcasting, strides
//! of contiguous and broadcast tensors, and the coalescing of strided walks. Pure
//! functions; backends (the host ops here, the CUDA ops in `ddo-cuda`) share them so that
//! shape rules and error messages agree across devices.

use crate::error::{CoreError, Result};
use crate::ops::Conv2dParams;

/// NumPy broadcast of two shapes; a typed error naming `op` when they do not broadcast.
pub fn broadcast_shape(op: &str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let r = a.len().max(b.len());
    let dim = |s: &[usize], i: usize| {
        if i + s.len() >= r {
            s[i + s.len() - r]
        } else {
            1
        }
    };
    (0..r)
        .map(|i| {
            let (da, db) = (dim(a, i), dim(b, i));
            if da == db || db == 1 {
                Ok(da)
            } else if da == 1 {
                Ok(db)
            } else {
                Err(CoreError::Shape {
                    what: op.to_string(),
                    message: format!(
                        "shapes {a:?} and {b:?} do not broadcast (dim {i}: {da} vs {db})"
                    ),
                })
            }
        })
        .collect()
}

/// Element strides of a contiguous tensor of `shape` read as broadcast to `out`
/// (right-aligned; size-1 dims get stride 0). `shape` must broadcast to `out`.
pub fn broadcast_strides(shape: &[usize], out: &[usize]) -> Vec<usize> {
    let off = out.len().saturating_sub(shape.len());
    let mut strides = vec![0; out.len()];
    let mut acc = 1usize;
    for i in (0..shape.len()).rev() {
        strides[off + i] = if shape[i] == 1 { 0 } else { acc };
        acc = acc.saturating_mul(shape[i]);
    }
    strides
}

/// Contiguous row-major element strides of `shape`.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut acc = 1usize;
    for (s, &d) in strides.iter_mut().zip(shape).rev() {
        *s = acc;
        acc = acc.saturating_mul(d);
    }
    strides
}

/// Merges adjacent dims that are contiguous in every one of `K` operands and drops size-1
/// dims; the walk order (row-major over `shape`) is unchanged. Always returns at least one
/// dim. Returns the merged shape and each operand's merged strides.
pub fn coalesce<const K: usize>(
    shape: &[usize],
    strides: [&[usize]; K],
) -> (Vec<usize>, [Vec<usize>; K]) {
    let mut out_shape: Vec<usize> = Vec::with_capacity(shape.len());
    let mut out_strides: [Vec<usize>; K] = std::array::from_fn(|_| Vec::new());
    for (i, &n) in shape.iter().enumerate() {
        if n == 1 {
            continue;
        }
        let merge = !out_shape.is_empty()
            && (0..K).all(|o| out_strides[o].last() == Some(&(strides[o][i] * n)));
        if merge {
            if let Some(last) = out_shape.last_mut() {
                *last *= n;
            }
            for (o, s) in out_strides.iter_mut().enumerate() {
                if let Some(last) = s.last_mut() {
                    *last = strides[o][i];
                }
            }
        } else {
            out_shape.push(n);
            for (o, s) in out_strides.iter_mut().enumerate() {
                s.push(strides[o][i]);
            }
        }
    }
    if out_shape.is_empty() {
        out_shape.push(1);
        for s in &mut out_strides {
            s.push(0);
        }
    }
    (out_shape, out_strides)
}

fn shape_err(op: &str, message: String) -> CoreError {
    CoreError::Shape {
        what: op.to_string(),
        message,
    }
}

/// The output shape of concatenating tensors of `shapes` along `dim` (every other dim
/// equal), or a typed error naming `op`.
pub fn concat_shape(op: &str, shapes: &[&[usize]], dim: usize) -> Result<Vec<usize>> {
    let Some(fs) = shapes.first() else {
        return Err(shape_err(op, "no tensors to concatenate".into()));
    };
    let ok = dim < fs.len()
        && shapes
            .iter()
            .all(|s| s.len() == fs.len() && (0..fs.len()).all(|i| i == dim || s[i] == fs[i]));
    if !ok {
        return Err(shape_err(
            op,
            format!("shapes {shapes:?} cannot be concatenated along dim {dim}"),
        ));
    }
    let Some(total) = shapes
        .iter()
        .try_fold(0usize, |acc, s| acc.checked_add(s[dim]))
    else {
        return Err(shape_err(
            op,
            format!("shapes {shapes:?} overflow along dim {dim}"),
        ));
    };
    let mut shape = fs.to_vec();
    shape[dim] = total;
    Ok(shape)
}

/// The sizes of `linear(concat(parts, last dim), w)`, checked: each part `[..., in_i]` with
/// the same leading dims, `w [out, Σ in_i]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LinearGeometry {
    /// Rows: the product of the leading dims.
    pub rows: usize,
    /// `w`'s input width (the parts' widths summed).
    pub in_features: usize,
    /// `w`'s output width.
    pub out_features: usize,
    /// Each part's width, in order.
    pub widths: Vec<usize>,
    /// The output shape: the leading dims, then `out_features`.
    pub out_shape: Vec<usize>,
}

/// Checks the operands of a linear over the concatenation of `parts` (one part: a plain
/// linear) against `w`, or a typed error naming `op`.
pub fn linear_geometry(op: &str, parts: &[&[usize]], w: &[usize]) -> Result<LinearGeometry> {
    let lead = parts.first().copied().unwrap_or(&[]);
    let r = lead.len();
    let fits = r > 0
        && w.len() == 2
        && parts
            .iter()
            .all(|s| s.len() == r && s[..r - 1] == lead[..r - 1])
        && parts.iter().map(|s| s[r - 1]).sum::<usize>() == w[1];
    if !fits {
        return Err(shape_err(
            op,
            format!(
                "x {parts:?} and w {w:?}: expected x [..., in] (parts sharing their leading dims, \
                 widths summing to in) and w [out, in]"
            ),
        ));
    }
    let mut out_shape = lead.to_vec();
    out_shape[r - 1] = w[0];
    Ok(LinearGeometry {
        rows: lead[..r - 1].iter().product(),
        in_features: w[1],
        out_features: w[0],
        widths: parts.iter().map(|s| s[r - 1]).collect(),
        out_shape,
    })
}

/// The sizes of a batched matrix product `a [..., m, k] · b [..., k, n]`, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MatmulGeometry {
    /// `a`'s batch dims.
    pub a_batch: Vec<usize>,
    /// `b`'s batch dims.
    pub b_batch: Vec<usize>,
    /// The output's batch dims: `a_batch` and `b_batch` broadcast.
    pub batch: Vec<usize>,
    /// Rows of each product.
    pub m: usize,
    /// The inner dim.
    pub k: usize,
    /// Columns of each product.
    pub n: usize,
}

impl MatmulGeometry {
    /// The output shape: `batch`, then `[m, n]`.
    pub fn out_shape(&self) -> Vec<usize> {
        let mut shape = self.batch.clone();
        shape.extend([self.m, self.n]);
        shape
    }
}

/// Checks `a [..., m, k]` against `b [..., k, n]` (batch dims broadcasting), or a typed error
/// naming `op`.
pub fn matmul_geometry(op: &str, a: &[usize], b: &[usize]) -> Result<MatmulGeometry> {
    if a.len() < 2 || b.len() < 2 || a[a.len() - 1] != b[b.len() - 2] {
        return Err(shape_err(
            op,
            format!("a {a:?} and b {b:?}: expected a [..., m, k] and b [..., k, n]"),
        ));
    }
    let (a_batch, b_batch) = (&a[..a.len() - 2], &b[..b.len() - 2]);
    Ok(MatmulGeometry {
        batch: broadcast_shape(op, a_batch, b_batch)?,
        a_batch: a_batch.to_vec(),
        b_batch: b_batch.to_vec(),
        m: a[a.len() - 2],
        k: a[a.len() - 1],
        n: b[b.len() - 1],
    })
}

/// The sizes of a 2-D convolution (groups = 1), checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv2dGeometry {
    /// Batch.
    pub n: usize,
    /// Input channels.
    pub c: usize,
    /// Input height.
    pub h: usize,
    /// Input width.
    pub w: usize,
    /// Output channels.
    pub o: usize,
    /// Kernel height.
    pub kh: usize,
    /// Kernel width.
    pub kw: usize,
    /// Output height.
    pub oh: usize,
    /// Output width.
    pub ow: usize,
}

/// Checks `x [n, c, h, w]` against `w [o, c, kh, kw]` and `params`; the convolution's sizes,
/// or a typed error naming `op`.
pub fn conv2d_geometry(
    op: &str,
    xs: &[usize],
    ws: &[usize],
    params: Conv2dParams,
) -> Result<Conv2dGeometry> {
    let Conv2dParams {
        stride: (sh, sw),
        padding: (ph, pw),
    } = params;
    if xs.len() != 4 || ws.len() != 4 || xs[1] != ws[1] {
        return Err(shape_err(
            op,
            format!(
                "x {xs:?} and w {ws:?}: expected x [n, c, h, w] and w [o, c, kh, kw] (groups = 1)"
            ),
        ));
    }
    if sh == 0 || sw == 0 {
        return Err(shape_err(
            op,
            format!("stride {:?} must be positive", params.stride),
        ));
    }
    let (n, c, h, w) = (xs[0], xs[1], xs[2], xs[3]);
    let (o, kh, kw) = (ws[0], ws[2], ws[3]);
    let padded = |len: usize, pad: usize| pad.checked_mul(2).and_then(|p| p.checked_add(len));
    let (Some(hp), Some(wp)) = (padded(h, ph), padded(w, pw)) else {
        return Err(shape_err(
            op,
            format!("padding {:?} overflows", params.padding),
        ));
    };
    if kh == 0 || kw == 0 || kh > hp || kw > wp {
        return Err(shape_err(
            op,
            format!(
                "kernel {kh}x{kw} does not fit input {h}x{w} with padding {:?}",
                params.padding
            ),
        ));
    }
    Ok(Conv2dGeometry {
        n,
        c,
        h,
        w,
        o,
        kh,
        kw,
        oh: (hp - kh) / sh + 1,
        ow: (wp - kw) / sw + 1,
    })
}

/// The sizes of an attention call, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttentionGeometry {
    /// Batch.
    pub b: usize,
    /// Heads.
    pub h: usize,
    /// Query length.
    pub lq: usize,
    /// Key length.
    pub lk: usize,
    /// Query/key head size.
    pub d: usize,
    /// Value head size.
    pub dv: usize,
    /// Element strides of the mask read as broadcast to `[b, h, lq, lk]`, when there is one.
    pub mask_strides: Option<Vec<usize>>,
}

/// Checks `q [b, h, lq, d]`, `k [b, h, lk, d]`, `v [b, h, lk, dv]` and a mask broadcastable
/// to `[b, h, lq, lk]`; the sizes, or a typed error naming `op`.
pub fn attention_geometry(
    op: &str,
    qs: &[usize],
    ks: &[usize],
    vs: &[usize],
    mask: Option<&[usize]>,
) -> Result<AttentionGeometry> {
    let ok = qs.len() == 4
        && ks.len() == 4
        && vs.len() == 4
        && qs[..2] == ks[..2]
        && ks[..3] == vs[..3]
        && qs[3] == ks[3];
    if !ok {
        return Err(shape_err(
            op,
            format!(
                "q {qs:?}, k {ks:?}, v {vs:?}: expected q [b, h, lq, d], k [b, h, lk, d], \
                 v [b, h, lk, dv]"
            ),
        ));
    }
    let (b, h, lq, d) = (qs[0], qs[1], qs[2], qs[3]);
    let (lk, dv) = (ks[2], vs[3]);
    let target = [b, h, lq, lk];
    let mask_strides = match mask {
        None => None,
        Some(ms) => {
            let fits = ms.len() <= 4 && broadcast_shape(op, ms, &target).is_ok_and(|s| s == target);
            if !fits {
                return Err(shape_err(
                    op,
                    format!("mask {ms:?} does not broadcast to [b, h, lq, lk] = {target:?}"),
                ));
            }
            Some(broadcast_strides(ms, &target))
        }
    };
    Ok(AttentionGeometry {
        b,
        h,
        lq,
        lk,
        d,
        dv,
        mask_strides,
    })
}

/// The sizes of one [`Ops::attention_input`](crate::Ops::attention_input) call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionInputGeometry {
    /// Batch.
    pub b: usize,
    /// The part's tokens (`x`'s second dim).
    pub l: usize,
    /// Heads.
    pub heads: usize,
    /// Head dim.
    pub d: usize,
    /// The part's first row in the joined sequence.
    pub start: usize,
    /// The joined sequence's length (`dst`'s third dim).
    pub total: usize,
}

impl AttentionInputGeometry {
    /// The output's shape, `[b, heads, total, d]`.
    pub fn out_shape(&self) -> Vec<usize> {
        vec![self.b, self.heads, self.total, self.d]
    }
}

/// Checks one part of attention's input: `x [b, l, heads·d]` with `heads > 0`, a norm weight
/// of `d` elements, rotary tables `cos, sin [total, d]` with `d` even, rows
/// `start..start + l` within `total`, and `dst [b, heads, total, d]` when given; the sizes,
/// or a typed error naming `op`.
#[allow(clippy::too_many_arguments)]
pub fn attention_input_geometry(
    op: &str,
    x: &[usize],
    heads: usize,
    norm: Option<&[usize]>,
    tables: Option<(&[usize], &[usize])>,
    dst: Option<&[usize]>,
    start: usize,
    total: usize,
) -> Result<AttentionInputGeometry> {
    let bad = |m: String| Err(shape_err(op, m));
    if x.len() != 3 || heads == 0 || !x[2].is_multiple_of(heads) {
        return bad(format!(
            "x {x:?} with {heads} heads: expected x [b, l, heads * d] with heads > 0"
        ));
    }
    let (b, l, d) = (x[0], x[1], x[2] / heads);
    if start.checked_add(l).is_none_or(|end| end > total) {
        return bad(format!(
            "rows {start}..{start}+{l} of x {x:?} do not fit a sequence of {total}"
        ));
    }
    if let Some(w) = norm
        && w != [d]
    {
        return bad(format!("norm weight {w:?}: expected [{d}] (the head dim)"));
    }
    if let Some((c, s)) = tables
        && (c != [total, d] || s != c || !d.is_multiple_of(2))
    {
        return bad(format!(
            "cos {c:?}, sin {s:?}: expected [{total}, {d}] with an even head dim"
        ));
    }
    let g = AttentionInputGeometry {
        b,
        l,
        heads,
        d,
        start,
        total,
    };
    if let Some(t) = dst
        && t != g.out_shape().as_slice()
    {
        return bad(format!("dst {t:?}: expected {:?}", g.out_shape()));
    }
    Ok(g)
}

/// How a per-feature operand `v` (a modulation's scale or shift, a gate) broadcast over
/// `x [..., d]` is read row by row, for backends that fuse it into one pass over `x`'s
/// rows: `Some(group)` when `v` broadcasts to `x` without changing `x`'s shape, has `d`
/// elements along its last dim, and each of its rows serves `group` consecutive rows of `x`
/// (row `r` of `x` reads row `r / group` of `v`): `[b, 1, d]` over `[b, t, d]` gives `t`;
/// `[d]`, `[1, d]` or `[1, 1, d]` give every row; `x`'s own shape gives 1. `None` for any
/// other layout (a per-row scalar `[..., 1]`, rows that repeat cyclically such as
/// `[1, t, d]` over `[b, t, d]`, a `v` of higher rank than `x`) and for shapes that do not
/// broadcast — those take the composition of plain ops, whose shape rules apply.
pub fn row_broadcast_group(x: &[usize], v: &[usize]) -> Option<usize> {
    let (&d, row_dims) = x.split_last()?;
    if v.last() != Some(&d) || v.len() > x.len() {
        return None;
    }
    let off = x.len() - v.len();
    if v.iter().zip(&x[off..]).any(|(&a, &b)| a != b && a != 1) {
        return None;
    }
    let rows: usize = row_dims.iter().product();
    if rows == 0 || d == 0 {
        return Some(1);
    }
    let strides = broadcast_strides(v, x);
    let (sizes, [st]) = coalesce(row_dims, [&strides[..row_dims.len()]]);
    match (sizes.as_slice(), st.as_slice()) {
        ([_], [0]) => Some(rows),
        ([_], [s]) if *s == d => Some(1),
        ([_, t], [s, 0]) if *s == d => Some(*t),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Batch dims broadcast, the output shape is the batch then `[m, n]`, and operands that
    /// do not chain or broadcast are a shape error naming the op.
    #[test]
    fn matmul_geometry_broadcasts_batches_and_refuses_mismatches() {
        let g = matmul_geometry("matmul", &[2, 1, 3, 4], &[5, 4, 6]).unwrap();
        assert_eq!((g.m, g.k, g.n), (3, 4, 6));
        assert_eq!(
            (g.a_batch.clone(), g.b_batch.clone()),
            (vec![2, 1], vec![5])
        );
        assert_eq!(g.batch, vec![2, 5]);
        assert_eq!(g.out_shape(), vec![2, 5, 3, 6]);
        let plain = matmul_geometry("matmul", &[3, 4], &[4, 6]).unwrap();
        assert_eq!(plain.out_shape(), vec![3, 6]);
        for (a, b) in [
            (&[3, 4][..], &[5, 6][..]),
            (&[4][..], &[4, 6][..]),
            (&[2, 3, 4], &[3, 4, 6]),
        ] {
            let e = matmul_geometry("matmul", a, b).unwrap_err();
            assert!(
                matches!(&e, CoreError::Shape { what, .. } if what == "matmul"),
                "{a:?} {b:?}: {e}"
            );
        }
    }

    #[test]
    fn row_broadcasts_name_the_rows_each_row_of_v_serves() {
        let x = [2, 5, 8];
        assert_eq!(row_broadcast_group(&x, &[2, 1, 8]), Some(5));
        assert_eq!(row_broadcast_group(&x, &[8]), Some(10));
        assert_eq!(row_broadcast_group(&x, &[1, 8]), Some(10));
        assert_eq!(row_broadcast_group(&x, &[1, 1, 8]), Some(10));
        assert_eq!(row_broadcast_group(&x, &[2, 5, 8]), Some(1));
        assert_eq!(row_broadcast_group(&[1, 5, 8], &[1, 1, 8]), Some(5));
        assert_eq!(row_broadcast_group(&[8], &[8]), Some(1));
        assert_eq!(row_broadcast_group(&[3, 2, 5, 8], &[3, 2, 1, 8]), Some(5));
        // Not one row per group of rows: the composition handles them.
        assert_eq!(row_broadcast_group(&x, &[1, 5, 8]), None);
        assert_eq!(row_broadcast_group(&x, &[2, 5, 1]), None);
        assert_eq!(row_broadcast_group(&x, &[2, 1, 1]), None);
        assert_eq!(row_broadcast_group(&x, &[1, 2, 5, 8]), None);
        assert_eq!(row_broadcast_group(&x, &[3, 1, 8]), None);
        assert_eq!(row_broadcast_group(&x, &[7]), None);
        assert_eq!(row_broadcast_group(&[], &[1]), None);
        // No rows or no features: nothing to read.
        assert_eq!(row_broadcast_group(&[0, 8], &[8]), Some(1));
    }

    #[test]
    fn broadcasting_follows_numpy_and_names_the_op() {
        assert_eq!(
            broadcast_shape("add", &[2, 1, 3], &[4, 1]).unwrap(),
            vec![2, 4, 3]
        );
        assert_eq!(broadcast_shape("add", &[], &[5]).unwrap(), vec![5]);
        let e = broadcast_shape("mul", &[2, 3], &[4, 3]).unwrap_err();
        assert!(e.to_string().starts_with("mul:"), "{e}");
        assert_eq!(broadcast_strides(&[3, 1], &[2, 3, 4]), vec![0, 1, 0]);
        assert_eq!(contiguous_strides(&[2, 3, 4]), vec![12, 4, 1]);
    }

    #[test]
    fn concat_conv_and_attention_sizes_are_checked() {
        assert_eq!(
            concat_shape("c", &[&[2, 3], &[2, 5]], 1).unwrap(),
            vec![2, 8]
        );
        assert!(concat_shape("c", &[&[2, 3], &[3, 5]], 1).is_err());
        assert!(concat_shape("c", &[], 0).is_err());
        let g = conv2d_geometry(
            "conv",
            &[1, 4, 9, 9],
            &[8, 4, 3, 3],
            Conv2dParams::new(2, 1),
        )
        .unwrap();
        assert_eq!((g.o, g.oh, g.ow), (8, 5, 5));
        assert!(
            conv2d_geometry(
                "conv",
                &[1, 4, 2, 2],
                &[8, 4, 5, 5],
                Conv2dParams::new(1, 0)
            )
            .is_err()
        );
        assert!(
            conv2d_geometry(
                "conv",
                &[1, 4, 9, 9],
                &[8, 4, 3, 3],
                Conv2dParams::new(0, 0)
            )
            .is_err()
        );
        let a = attention_geometry(
            "attn",
            &[1, 2, 3, 4],
            &[1, 2, 5, 4],
            &[1, 2, 5, 6],
            Some(&[3, 5]),
        )
        .unwrap();
        assert_eq!((a.lq, a.lk, a.dv), (3, 5, 6));
        assert_eq!(a.mask_strides, Some(vec![0, 0, 5, 1]));
        assert!(
            attention_geometry("attn", &[1, 2, 3, 4], &[1, 2, 5, 7], &[1, 2, 5, 6], None).is_err()
        );
    }

    #[test]
    fn coalescing_merges_contiguous_dims_and_keeps_one() {
        let shape = [2, 3, 1, 4];
        let c = contiguous_strides(&shape);
        let b = broadcast_strides(&[1, 3, 1, 4], &shape);
        let (s, [cs, bs]) = coalesce(&shape, [&c, &b]);
        assert_eq!(s, vec![2, 12]);
        assert_eq!(cs, vec![12, 1]);
        assert_eq!(bs, vec![0, 1]);
        let (s, [st]) = coalesce(&[1, 1], [&[0, 0][..]]);
        assert_eq!((s, st), (vec![1], vec![0]));
    }

    /// One part of attention's input: the sizes of a part that fits, and a typed error
    /// for each way one does not (heads, rows past the end, a norm weight, tables, dst).
    #[test]
    fn attention_input_geometry_checks_every_operand() {
        let ok = attention_input_geometry(
            "t",
            &[2, 5, 24],
            3,
            Some(&[8]),
            Some((&[9, 8], &[9, 8])),
            Some(&[2, 3, 9, 8]),
            4,
            9,
        )
        .unwrap();
        assert_eq!(
            (ok.b, ok.l, ok.heads, ok.d, ok.start, ok.total),
            (2, 5, 3, 8, 4, 9)
        );
        assert_eq!(ok.out_shape(), [2, 3, 9, 8]);
        let bad = [
            attention_input_geometry("t", &[2, 5, 24], 5, None, None, None, 0, 5),
            attention_input_geometry("t", &[2, 5, 24], 0, None, None, None, 0, 5),
            attention_input_geometry("t", &[5, 24], 3, None, None, None, 0, 5),
            attention_input_geometry("t", &[2, 5, 24], 3, None, None, None, 5, 9),
            attention_input_geometry("t", &[2, 5, 24], 3, None, None, None, usize::MAX, 9),
            attention_input_geometry("t", &[2, 5, 24], 3, Some(&[24]), None, None, 0, 5),
            attention_input_geometry(
                "t",
                &[2, 5, 24],
                3,
                None,
                Some((&[5, 8], &[9, 8])),
                None,
                0,
                5,
            ),
            attention_input_geometry(
                "t",
                &[2, 5, 21],
                3,
                None,
                Some((&[5, 7], &[5, 7])),
                None,
                0,
                5,
            ),
            attention_input_geometry("t", &[2, 5, 24], 3, None, None, Some(&[2, 5, 3, 8]), 0, 5),
        ];
        for (i, r) in bad.into_iter().enumerate() {
            assert!(matches!(r, Err(CoreError::Shape { .. })), "case {i}: {r:?}");
        }
    }
}
