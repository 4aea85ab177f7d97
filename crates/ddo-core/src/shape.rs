//! Shape arithmetic every `Ops` backend needs, in one place: NumPy broadcasting, strides
//! of contiguous and broadcast tensors, and the coalescing of strided walks. Pure
//! functions; backends (the host ops here, the CUDA ops in `ddo-cuda`) share them so that
//! shape rules and error messages agree across devices.

use crate::error::{CoreError, Result};

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
