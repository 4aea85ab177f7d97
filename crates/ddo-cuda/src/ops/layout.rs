//! Layout ops on the GPU: upload and download, concat, narrow, permute (one general
//! strided copy), nearest 2× upsampling, embedding gathers (kernels in
//! `kernels/layout.cu`).

use ddo_core::device::download;
use ddo_core::tensor::numel;
use ddo_core::{DType, Device, HostBuffer, Result, Tensor, TensorStorage};

use super::kernels::{Arg, Dims6, grid_1d, launch};
use super::{
    In, MAX_DIMS, Out, coalesce, contiguous_strides, fits_u32, for_each_block, input, scratch,
    shape_err,
};
use crate::device::CudaDevice;

/// Name of this file's kernel source.
pub(crate) const SOURCE_NAME: &str = "layout.cu";
/// The kernel source.
pub(crate) const SOURCE: &str = include_str!("../../kernels/layout.cu");

/// Threads per block of the layout kernels.
const BLOCK: u32 = 256;

fn product(dims: &[usize]) -> usize {
    dims.iter().product()
}

/// [`ddo_core::Ops::tensor_from_f32`]: encoded on the host, copied on the compute stream
/// (from pageable memory, so the copy is complete when this returns).
pub(crate) fn tensor_from_f32(
    dev: &CudaDevice,
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
    let out = Out::new(dev, OP, shape.to_vec(), dtype)?;
    let bytes = dtype.encode_f32(values)?;
    let host = HostBuffer::pageable_from(&bytes);
    dev.copy_h2d(
        &host.slice_all(),
        &out.buffer.slice_all(),
        &dev.compute_stream(),
    )?;
    out.finish(dev, &[])
}

/// [`ddo_core::Ops::to_f32_vec`]: downloaded after the work queued on the compute stream.
pub(crate) fn to_f32_vec(dev: &CudaDevice, x: &Tensor) -> Result<Vec<f32>> {
    let xi = input(dev, "to_f32_vec", x)?;
    match x.storage() {
        TensorStorage::Device(slice) => {
            let bytes = download(dev, slice, &dev.compute_stream())?;
            xi.dtype.decode_f32(&bytes)
        }
        // `input` refuses host tensors; kept for completeness.
        TensorStorage::Host(_) => Err(shape_err("to_f32_vec", "x is a host tensor")),
    }
}

/// Queues `dst[walk(dstr) + dst_off] = src[walk(sstr) + src_off]` over `shape` (element
/// offsets and strides; the destination has dtype code `dst_code` at `dst_ptr`).
#[allow(clippy::too_many_arguments)]
fn copy_nd(
    dev: &CudaDevice,
    src: &In<'_>,
    src_off: usize,
    dst_ptr: u64,
    dst_dtype: DType,
    dst_code: i32,
    shape: &[usize],
    sstr: &[usize],
    dstr: &[usize],
) -> Result<()> {
    if product(shape) == 0 {
        return Ok(());
    }
    let (cs, [ss, ds]) = coalesce(shape, [sstr, dstr]);
    let src_ptr = src.ptr + (src_off * src.dtype.size_in_bytes()) as u64;
    if src.dtype == dst_dtype && copy_units(dev, src_ptr, dst_ptr, dst_dtype, &cs, &ss, &ds)? {
        return Ok(());
    }
    let wide = dev.kernel(SOURCE_NAME, SOURCE, "ddo_copy_nd")?;
    let narrow = dev.kernel(SOURCE_NAME, SOURCE, "ddo_copy_nd32")?;
    let (es, ed) = (
        src.dtype.size_in_bytes() as u64,
        dst_dtype.size_in_bytes() as u64,
    );
    for_each_block(&cs, [&ss, &ds], |[so, d_o], _, bs, [bss, bds]| {
        let n: usize = bs.iter().product();
        let f = if fits_u32(bs, &[bss, bds]) {
            &narrow
        } else {
            &wide
        };
        launch(
            dev,
            f,
            grid_1d(n as u64, BLOCK),
            &[
                Arg::Ptr(src.ptr + (src_off + so) as u64 * es),
                Arg::I32(src.code),
                Arg::Ptr(dst_ptr + d_o as u64 * ed),
                Arg::I32(dst_code),
                Arg::I64(n as i64),
                Arg::I32(bs.len() as i32),
                Arg::Dims(Dims6::from_slice(bs)),
                Arg::Dims(Dims6::from_slice(bss)),
                Arg::Dims(Dims6::from_slice(bds)),
            ],
        )
    })
}

/// A same-dtype strided copy over the coalesced walk `cs` moved in raw units of 16, 8 or 4
/// bytes (the widest that divides the innermost run, every other stride and both
/// addresses): `false`, with nothing queued, when no unit wider than the element fits, the
/// walk has more than 6 dims or its offsets do not fit 32 bits.
fn copy_units(
    dev: &CudaDevice,
    src: u64,
    dst: u64,
    dtype: DType,
    cs: &[usize],
    ss: &[usize],
    ds: &[usize],
) -> Result<bool> {
    let esize = dtype.size_in_bytes();
    let r = cs.len();
    if r == 0 || r > MAX_DIMS || ss[r - 1] != 1 || ds[r - 1] != 1 {
        return Ok(false);
    }
    let unit = [16usize, 8, 4].into_iter().find(|&u| {
        u > esize
            && u.is_multiple_of(esize)
            && (cs[r - 1] * esize).is_multiple_of(u)
            && ss[..r - 1]
                .iter()
                .chain(&ds[..r - 1])
                .all(|s| (s * esize).is_multiple_of(u))
            && src.is_multiple_of(u as u64)
            && dst.is_multiple_of(u as u64)
    });
    let Some(unit) = unit else {
        return Ok(false);
    };
    let per = unit / esize;
    let mut shape = cs.to_vec();
    shape[r - 1] /= per;
    let to_units = |st: &[usize]| -> Vec<usize> {
        let mut v: Vec<usize> = st.iter().map(|s| s / per).collect();
        v[r - 1] = 1;
        v
    };
    let (su, du) = (to_units(ss), to_units(ds));
    if !fits_u32(&shape, &[&su, &du]) {
        return Ok(false);
    }
    let n: usize = shape.iter().product();
    let name = match unit {
        16 => "ddo_copy_units16",
        8 => "ddo_copy_units8",
        _ => "ddo_copy_units4",
    };
    let f = dev.kernel(SOURCE_NAME, SOURCE, name)?;
    launch(
        dev,
        &f,
        grid_1d(n as u64, BLOCK),
        &[
            Arg::Ptr(src),
            Arg::Ptr(dst),
            Arg::U32(n as u32),
            Arg::I32(r as i32),
            Arg::Dims(Dims6::from_slice(&shape)),
            Arg::Dims(Dims6::from_slice(&su)),
            Arg::Dims(Dims6::from_slice(&du)),
        ],
    )?;
    Ok(true)
}

/// [`ddo_core::Ops::concat`]: inputs of another dtype are converted into the first's.
pub(crate) fn concat(dev: &CudaDevice, xs: &[&Tensor], dim: usize) -> Result<Tensor> {
    const OP: &str = "concat";
    let shapes: Vec<&[usize]> = xs.iter().map(|t| t.shape()).collect();
    let shape = ddo_core::shape::concat_shape(OP, &shapes, dim)?;
    let total = shape[dim];
    let first = xs[0];
    let fs = first.shape();
    let dtype = first.dtype();
    let (outer, inner) = (product(&fs[..dim]), product(&fs[dim + 1..]));
    let inputs = xs
        .iter()
        .map(|t| input(dev, OP, t))
        .collect::<Result<Vec<_>>>()?;
    let out = Out::new(dev, OP, shape, dtype)?;
    let out_row = total * inner;
    let mut col = 0;
    for (xi, s) in inputs.iter().zip(&shapes) {
        let row = s[dim] * inner;
        copy_nd(
            dev,
            xi,
            0,
            out.ptr + (col * dtype.size_in_bytes()) as u64,
            dtype,
            out.code,
            &[outer, row],
            &[row, 1],
            &[out_row, 1],
        )?;
        col += row;
    }
    let used: Vec<&In<'_>> = inputs.iter().collect();
    out.finish(dev, &used)
}

/// [`ddo_core::Ops::narrow`].
pub(crate) fn narrow(
    dev: &CudaDevice,
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
    let (outer, inner) = (product(&xs[..dim]), product(&xs[dim + 1..]));
    let mut shape = xs.to_vec();
    shape[dim] = len;
    if let Some(view) = narrow_view(x, outer, start * inner, &shape)? {
        return Ok(view);
    }
    let xi = input(dev, OP, x)?;
    let out = Out::new(dev, OP, shape, x.dtype())?;
    let (src_row, dst_row) = (xs[dim] * inner, len * inner);
    copy_nd(
        dev,
        &xi,
        start * inner,
        out.ptr,
        out.dtype,
        out.code,
        &[outer, dst_row],
        &[src_row, 1],
        &[dst_row, 1],
    )?;
    out.finish(dev, &[&xi])
}

/// Where a narrow's elements are one contiguous range of `x` (`outer` is 1: nothing before
/// `dim` but unit dims) starting `first` elements in, at a 256-byte boundary of its buffer
/// (what cuBLASLt and the vectorised kernels assume of a fresh allocation): that range as a
/// view of `x`'s buffer, no copy. A view never covers its whole buffer, so no op writes it in
/// place (`DeviceSlice::is_exclusive`). `None` for a copy: another layout, a host tensor, a
/// quantized or scaled one, or an offset off the boundary.
fn narrow_view(x: &Tensor, outer: usize, first: usize, shape: &[usize]) -> Result<Option<Tensor>> {
    let TensorStorage::Device(s) = x.storage() else {
        return Ok(None);
    };
    let size = x.dtype().size_in_bytes();
    let at = s.offset() + first * size;
    if outer != 1 || x.quant().is_some() || x.scale().is_some() || !at.is_multiple_of(256) {
        return Ok(None);
    }
    let view = s.buffer().slice(at, product(shape) * size)?;
    Tensor::new(shape.to_vec(), x.dtype(), TensorStorage::Device(view)).map(Some)
}

/// [`ddo_core::Ops::permute`].
pub(crate) fn permute(dev: &CudaDevice, x: &Tensor, dims: &[usize]) -> Result<Tensor> {
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
    let xi = input(dev, OP, x)?;
    let shape: Vec<usize> = dims.iter().map(|&d| xs[d]).collect();
    let src = contiguous_strides(xs);
    let sstr: Vec<usize> = dims.iter().map(|&d| src[d]).collect();
    let dstr = contiguous_strides(&shape);
    let out = Out::new(dev, OP, shape.clone(), x.dtype())?;
    copy_nd(
        dev, &xi, 0, out.ptr, out.dtype, out.code, &shape, &sstr, &dstr,
    )?;
    out.finish(dev, &[&xi])
}

/// [`ddo_core::Ops::upsample_nearest2x`].
pub(crate) fn upsample_nearest2x(dev: &CudaDevice, x: &Tensor) -> Result<Tensor> {
    const OP: &str = "upsample_nearest2x";
    let xs = x.shape();
    if xs.len() != 4 {
        return Err(shape_err(OP, format!("x {xs:?}: expected [n, c, h, w]")));
    }
    let (h, w) = (xs[2], xs[3]);
    let (Some(h2), Some(w2)) = (h.checked_mul(2), w.checked_mul(2)) else {
        return Err(shape_err(OP, format!("x {xs:?} is too large to upsample")));
    };
    let xi = input(dev, OP, x)?;
    let out = Out::new(dev, OP, vec![xs[0], xs[1], h2, w2], x.dtype())?;
    if out.numel > 0 {
        let f = dev.kernel(SOURCE_NAME, SOURCE, "ddo_upsample2x")?;
        launch(
            dev,
            &f,
            grid_1d(out.numel as u64, BLOCK),
            &[
                Arg::Ptr(xi.ptr),
                Arg::Ptr(out.ptr),
                Arg::I32(out.code),
                Arg::I64(out.numel as i64),
                Arg::I64(w as i64),
            ],
        )?;
    }
    out.finish(dev, &[&xi])
}

/// [`ddo_core::Ops::embedding`]: ids are checked on the host, then uploaded.
pub(crate) fn embedding(dev: &CudaDevice, table: &Tensor, ids: &[u32]) -> Result<Tensor> {
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
    let ti = input(dev, OP, table)?;
    let out = Out::new(dev, OP, vec![ids.len(), d], table.dtype())?;
    if out.numel > 0 {
        let bytes: Vec<u8> = ids.iter().flat_map(|id| id.to_le_bytes()).collect();
        let (ids_buf, ids_ptr) = scratch(dev, bytes.len())?;
        let compute = dev.compute_stream();
        dev.copy_h2d(
            &HostBuffer::pageable_from(&bytes).slice_all(),
            &ids_buf.slice_all(),
            &compute,
        )?;
        let f = dev.kernel(SOURCE_NAME, SOURCE, "ddo_embedding")?;
        launch(
            dev,
            &f,
            grid_1d(out.numel as u64, BLOCK),
            &[
                Arg::Ptr(ti.ptr),
                Arg::Ptr(ids_ptr),
                Arg::Ptr(out.ptr),
                Arg::I32(out.code),
                Arg::I64(ids.len() as i64),
                Arg::I64(d as i64),
            ],
        )?;
    }
    out.finish(dev, &[&ti])
}
