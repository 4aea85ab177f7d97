//! Ops that move elements without arithmetic on the host: upload and download,
//! `concat`, `narrow`, `permute`, nearest 2× upsampling, `cast` and `embedding`.

use super::{encode_into, product, shape_err, walk};
use crate::device::HostDevice;
use ddo_core::AttentionInput;
use ddo_core::dtype::DType;
use ddo_core::error::Result;
use ddo_core::host_memory::try_with_capacity;
use ddo_core::ops::attention_input_composed;
use ddo_core::shape::{coalesce, contiguous_strides};
use ddo_core::tensor::{Tensor, numel};

pub(super) fn tensor_from_f32(
    dev: &HostDevice,
    shape: &[usize],
    dtype: DType,
    values: &[f32],
) -> Result<Tensor> {
    const OP: &str = "tensor_from_f32";
    if numel(shape) != Some(values.len()) {
        return Err(shape_err(
            OP,
            format!("{} values for shape {shape:?}", values.len()),
        ));
    }
    dev.new_output(OP, shape.to_vec(), dtype)?.write_f32(values)
}

pub(super) fn to_f32_vec(dev: &HostDevice, x: &Tensor) -> Result<Vec<f32>> {
    let xi = dev.dequant_input("to_f32_vec", x)?;
    dev.fence()?;
    xi.f32()
}

pub(super) fn upsample_nearest2x(dev: &HostDevice, x: &Tensor) -> Result<Tensor> {
    const OP: &str = "upsample_nearest2x";
    let xs = x.shape();
    if xs.len() != 4 {
        return Err(shape_err(OP, format!("x {xs:?}: expected [n, c, h, w]")));
    }
    let (h, w) = (xs[2], xs[3]);
    let (Some(h2), Some(w2)) = (h.checked_mul(2), w.checked_mul(2)) else {
        return Err(shape_err(OP, format!("x {xs:?} is too large to upsample")));
    };
    let xi = dev.input(OP, x)?;
    let output = dev.new_output(OP, vec![xs[0], xs[1], h2, w2], x.dtype())?;
    dev.fence()?;
    let xv = xi.f32()?;
    let mut out = try_with_capacity(xv.len() * 4, "an upsampled output")?;
    for row in xv.chunks_exact(w.max(1)) {
        let start = out.len();
        out.extend(row.iter().flat_map(|&v| [v, v]));
        out.extend_from_within(start..);
    }
    output.write_f32(&out)
}

pub(super) fn concat(dev: &HostDevice, xs: &[&Tensor], dim: usize) -> Result<Tensor> {
    const OP: &str = "concat";
    let shapes: Vec<&[usize]> = xs.iter().map(|t| t.shape()).collect();
    let shape = ddo_core::shape::concat_shape(OP, &shapes, dim)?;
    let total = shape[dim];
    let first = xs[0];
    let fs = first.shape();
    let dtype = first.dtype();
    let es = dtype.size_in_bytes();
    let inner = product(&fs[dim + 1..]);
    let inputs = xs
        .iter()
        .map(|t| dev.input(OP, t))
        .collect::<Result<Vec<_>>>()?;
    let output = dev.new_output(OP, shape, dtype)?;
    dev.fence()?;
    // Inputs of another dtype are re-encoded into the output's first.
    let converted = inputs
        .iter()
        .map(|input| {
            (input.dtype != dtype)
                .then(|| {
                    let values = input.f32()?;
                    let mut encoded = vec![0u8; values.len() * es];
                    encode_into(dtype, &values, &mut encoded);
                    Ok(encoded)
                })
                .transpose()
        })
        .collect::<Result<Vec<_>>>()?;
    let out_row = total * inner * es;
    output.write_bytes(|out| {
        let mut col = 0;
        for ((input, s), conv) in inputs.iter().zip(&shapes).zip(&converted) {
            let row = s[dim] * inner * es;
            let mut place = |src: &[u8]| {
                if row > 0 {
                    for (o, chunk) in out.chunks_exact_mut(out_row).zip(src.chunks_exact(row)) {
                        o[col..col + row].copy_from_slice(chunk);
                    }
                }
            };
            match conv {
                Some(bytes) => place(bytes),
                None => input.bytes(place),
            }
            col += row;
        }
    })
}

pub(super) fn narrow(
    dev: &HostDevice,
    x: &Tensor,
    dim: usize,
    start: usize,
    len: usize,
) -> Result<Tensor> {
    const OP: &str = "narrow";
    let xs = x.shape();
    let fits = dim < xs.len() && start.checked_add(len).is_some_and(|end| end <= xs[dim]);
    if !fits {
        return Err(shape_err(
            OP,
            format!("range {start}..{start}+{len} along dim {dim} is outside shape {xs:?}"),
        ));
    }
    let xi = dev.input(OP, x)?;
    let es = x.dtype().size_in_bytes();
    let inner = product(&xs[dim + 1..]);
    let (src_row, dst_row) = (xs[dim] * inner * es, len * inner * es);
    let skip = start * inner * es;
    let mut shape = xs.to_vec();
    shape[dim] = len;
    let output = dev.new_output(OP, shape, x.dtype())?;
    dev.fence()?;
    output.write_bytes(|out| {
        if dst_row > 0 {
            xi.bytes(|b| {
                for (o, src) in out.chunks_exact_mut(dst_row).zip(b.chunks_exact(src_row)) {
                    o.copy_from_slice(&src[skip..skip + dst_row]);
                }
            });
        }
    })
}

pub(super) fn permute(dev: &HostDevice, x: &Tensor, dims: &[usize]) -> Result<Tensor> {
    const OP: &str = "permute";
    let xs = x.shape();
    let mut seen = vec![false; xs.len()];
    let valid = dims.len() == xs.len()
        && dims
            .iter()
            .all(|&d| d < xs.len() && !std::mem::replace(&mut seen[d], true));
    if !valid {
        return Err(shape_err(
            OP,
            format!("{dims:?} is not a permutation of the dims of shape {xs:?}"),
        ));
    }
    let xi = dev.input(OP, x)?;
    let es = x.dtype().size_in_bytes();
    let shape: Vec<usize> = dims.iter().map(|&d| xs[d]).collect();
    let src = contiguous_strides(xs);
    let strides: Vec<usize> = dims.iter().map(|&d| src[d]).collect();
    let (cs, [ss]) = coalesce(&shape, [&strides]);
    let r = cs.len();
    let (inner, is) = (cs[r - 1], ss[r - 1]);
    let output = dev.new_output(OP, shape, x.dtype())?;
    dev.fence()?;
    output.write_bytes(|out| {
        xi.bytes(|b| {
            let mut at = 0;
            walk(&cs[..r - 1], [&ss[..r - 1]], |[o]| {
                let dst = &mut out[at..at + inner * es];
                if is == 1 {
                    dst.copy_from_slice(&b[o * es..(o + inner) * es]);
                } else {
                    for (j, e) in dst.chunks_exact_mut(es).enumerate() {
                        let from = (o + j * is) * es;
                        e.copy_from_slice(&b[from..from + es]);
                    }
                }
                at += inner * es;
            });
        });
    })
}

pub(super) fn cast(dev: &HostDevice, x: &Tensor, dtype: DType) -> Result<Tensor> {
    const OP: &str = "cast";
    // Casting dequantizes: a scaled fp8 source is read with its scale.
    let xi = dev.dequant_input(OP, x)?;
    let output = dev.new_output(OP, x.shape().to_vec(), dtype)?;
    dev.fence()?;
    if dtype == x.dtype() {
        // The same bytes: a scaled tensor keeps its scale.
        return output
            .write_bytes(|out| xi.bytes(|b| out.copy_from_slice(b)))?
            .with_scale(x.scale());
    }
    let v = xi.f32()?;
    output.write_f32(&v)
}

pub(super) fn embedding(dev: &HostDevice, table: &Tensor, ids: &[u32]) -> Result<Tensor> {
    const OP: &str = "embedding";
    let ts = table.shape();
    if ts.len() != 2 {
        return Err(shape_err(OP, format!("table {ts:?}: expected [rows, d]")));
    }
    let (rows, d) = (ts[0], ts[1]);
    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= rows) {
        return Err(shape_err(
            OP,
            format!("id {bad} is out of range for a table of {rows} rows"),
        ));
    }
    let ti = dev.input(OP, table)?;
    let row = d * table.dtype().size_in_bytes();
    let output = dev.new_output(OP, vec![ids.len(), d], table.dtype())?;
    dev.fence()?;
    output.write_bytes(|out| {
        if row > 0 {
            ti.bytes(|b| {
                for (o, &id) in out.chunks_exact_mut(row).zip(ids) {
                    let at = id as usize * row;
                    o.copy_from_slice(&b[at..at + row]);
                }
            });
        }
    })
}

/// [`ddo_core::Ops::attention_input`]: the part's own rows as the composition computes them
/// ([`attention_input_composed`] over the part alone, with the tables' rows of its
/// positions), then copied into `dst`'s rows in place when nothing else holds it (else into
/// a new output holding `dst`'s bytes, or zeros for a new one). The composition's bytes at
/// the peak of one joined output, as CUDA's in-place kernel.
pub(super) fn attention_input(
    dev: &HostDevice,
    part: &AttentionInput<'_>,
    mut dst: Option<Tensor>,
) -> Result<Tensor> {
    const OP: &str = "attention_input";
    let g = part.geometry(OP, dst.as_ref())?;
    let dtype = part.x.dtype();
    if g.l == g.total {
        return attention_input_composed(dev, part, dst);
    }
    let tables = part
        .rope
        .map(|(c, s)| -> Result<(Tensor, Tensor)> {
            Ok((
                narrow(dev, c, 0, g.start, g.l)?,
                narrow(dev, s, 0, g.start, g.l)?,
            ))
        })
        .transpose()?;
    let own = AttentionInput {
        rope: tables.as_ref().map(|(c, s)| (c, s)),
        start: 0,
        total: g.l,
        ..*part
    };
    let y = attention_input_composed(dev, &own, None)?;
    drop(tables);
    let es = dtype.size_in_bytes();
    let (seg, out_row, at) = (g.l * g.d * es, g.total * g.d * es, g.start * g.d * es);
    let rows = dev.input(OP, &y)?.bytes(<[u8]>::to_vec);
    drop(y);
    let place = |out: &mut [u8]| {
        if seg > 0 {
            for (o, src) in out.chunks_exact_mut(out_row).zip(rows.chunks_exact(seg)) {
                o[at..at + seg].copy_from_slice(src);
            }
        }
    };
    let in_place = dst
        .as_mut()
        .is_some_and(|t| t.has_exclusive_device_buffer());
    match dst {
        Some(t) if in_place => {
            dev.fence()?;
            let ti = dev.input(OP, &t)?;
            ti.alloc.with_bytes_mut(|b| place(&mut b[ti.range.clone()]));
            Ok(t)
        }
        other => {
            let output = dev.new_output(OP, g.out_shape(), dtype)?;
            dev.fence()?;
            let base = other.as_ref().map(|t| dev.input(OP, t)).transpose()?;
            let base = base.map(|b| b.bytes(<[u8]>::to_vec));
            output.write_bytes(|out| {
                match &base {
                    Some(b) => out.copy_from_slice(b),
                    None => out.fill(0),
                }
                place(out);
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use crate::ops::test_support::*;
    use ddo_core::dtype::DType;
    use ddo_core::ops::Ops;
    use ddo_core::rng::SplitMix64;
    #[test]
    fn layout_ops_cast_and_embedding() {
        let d = dev();
        let mut rng = SplitMix64::new(11);
        let a = random(&mut rng, 2 * 3 * 4);
        let b = random(&mut rng, 2 * 2 * 4);
        let (at, bt) = (
            put(&d, &[2, 3, 4], DType::F32, &a),
            put(&d, &[2, 2, 4], DType::F32, &b),
        );

        let c = d.concat(&[&at, &bt], 1).unwrap();
        assert_eq!(c.shape(), &[2, 5, 4]);
        let got = get(&d, &c);
        for (i, &g) in got.iter().enumerate() {
            let [n, r, k] = unravel(i, &[2, 5, 4])[..] else {
                unreachable!()
            };
            let want = if r < 3 {
                a[(n * 3 + r) * 4 + k]
            } else {
                b[(n * 2 + r - 3) * 4 + k]
            };
            assert_eq!(g, want);
        }
        // A bf16 input is converted to the first input's dtype.
        let bh = put(&d, &[2, 2, 4], DType::BF16, &b);
        let c = d.concat(&[&at, &bh], 1).unwrap();
        assert_eq!(c.dtype(), DType::F32);
        let cd = d.concat(&[&at, &at], 2).unwrap();
        assert_eq!(cd.shape(), &[2, 3, 8]);
        assert_eq!(get(&d, &cd)[4..8], a[0..4]);

        let nw = d.narrow(&at, 1, 1, 2).unwrap();
        assert_eq!(nw.shape(), &[2, 2, 4]);
        let got = get(&d, &nw);
        for (i, &g) in got.iter().enumerate() {
            let [n, r, k] = unravel(i, &[2, 2, 4])[..] else {
                unreachable!()
            };
            assert_eq!(g, a[(n * 3 + r + 1) * 4 + k]);
        }

        let x = random(&mut rng, 2 * 3 * 4 * 5);
        let xt = put(&d, &[2, 3, 4, 5], DType::F32, &x);
        for dims in [[0, 2, 1, 3], [3, 2, 1, 0], [0, 1, 2, 3], [1, 0, 3, 2]] {
            let p = d.permute(&xt, &dims).unwrap();
            let osh: Vec<usize> = dims.iter().map(|&i| [2, 3, 4, 5][i]).collect();
            assert_eq!(p.shape(), &osh[..]);
            let got = get(&d, &p);
            for (i, &g) in got.iter().enumerate() {
                let oi = unravel(i, &osh);
                let mut si = [0; 4];
                for (o, &src) in dims.iter().enumerate() {
                    si[src] = oi[o];
                }
                assert_eq!(
                    g,
                    x[((si[0] * 3 + si[1]) * 4 + si[2]) * 5 + si[3]],
                    "{dims:?}"
                );
            }
        }

        let h = d.cast(&at, DType::BF16).unwrap();
        assert_eq!(h.dtype(), DType::BF16);
        let want: Vec<f32> = a.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
        assert_eq!(get(&d, &h), want);
        assert_eq!(get(&d, &d.cast(&at, DType::F32).unwrap()), a);
        let f = d.cast(&h, DType::F16).unwrap();
        assert_close("cast chain", &get(&d, &f), &f64s(&want), 1e-3);

        let table = random(&mut rng, 5 * 3);
        let e = d
            .embedding(&put(&d, &[5, 3], DType::F32, &table), &[4, 0, 4, 2])
            .unwrap();
        assert_eq!(e.shape(), &[4, 3]);
        let want: Vec<f32> = [4, 0, 4, 2]
            .iter()
            .flat_map(|&r| table[r * 3..r * 3 + 3].to_vec())
            .collect();
        assert_eq!(get(&d, &e), want);
    }
}
