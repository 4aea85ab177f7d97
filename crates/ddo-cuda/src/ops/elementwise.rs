//! Element-wise ops on the GPU: unary functions, affine, casts, binary ops with NumPy
//! broadcasting, rotary embedding, the fused gated residual `x + gate * y` (kernels in
//! `kernels/elementwise.cu`).

use ddo_core::{BinaryOp, DType, Result, Tensor, UnaryOp};

use super::kernels::{self, Arg, Dims6, grid_1d, launch};
use super::{
    In, Out, broadcast_shape, broadcast_strides, coalesce, contiguous_strides, fits_u32,
    for_each_block, input, mark_used, shape_err,
};
use crate::device::CudaDevice;
use crate::driver;
use crate::error::CudaError;

/// Name of this file's kernel source.
pub(crate) const SOURCE_NAME: &str = "elementwise.cu";
/// The kernel source.
pub(crate) const SOURCE: &str = include_str!("../../kernels/elementwise.cu");

/// Threads per block of the element-wise kernels.
const BLOCK: u32 = 256;

/// `U_AFFINE` in the source.
const U_AFFINE: i32 = 12;
/// `U_COPY` in the source.
const U_COPY: i32 = 13;

fn unary_code(op: UnaryOp) -> i32 {
    match op {
        UnaryOp::Silu => 0,
        UnaryOp::GeluTanh => 1,
        UnaryOp::GeluErf => 2,
        UnaryOp::QuickGelu => 3,
        UnaryOp::Sigmoid => 4,
        UnaryOp::Tanh => 5,
        UnaryOp::Relu => 6,
        UnaryOp::Exp => 7,
        UnaryOp::Neg => 8,
        UnaryOp::Square => 9,
        UnaryOp::Sqrt => 10,
        UnaryOp::Recip => 11,
    }
}

fn binary_code(op: BinaryOp) -> i32 {
    match op {
        BinaryOp::Add => 0,
        BinaryOp::Sub => 1,
        BinaryOp::Mul => 2,
        BinaryOp::Div => 3,
        BinaryOp::Max => 4,
        BinaryOp::Min => 5,
    }
}

/// `y = f(x)` element-wise into an output of `dtype`.
fn map(
    dev: &CudaDevice,
    op_name: &str,
    x: &Tensor,
    dtype: DType,
    code: i32,
    mul: f32,
    add: f32,
) -> Result<Tensor> {
    let xi = input(dev, op_name, x)?;
    let out = Out::new(dev, op_name, x.shape().to_vec(), dtype)?;
    if out.numel > 0 && xi.dtype == dtype && vectorizable(out.numel, dtype, &[xi.ptr, out.ptr]) {
        map_vec(
            dev, xi.ptr, out.ptr, out.code, out.numel, dtype, code, mul, add,
        )?;
    } else if out.numel > 0 {
        let f = dev.kernel(SOURCE_NAME, SOURCE, "ddo_unary")?;
        launch(
            dev,
            &f,
            grid_1d(out.numel as u64, BLOCK),
            &[
                Arg::Ptr(xi.ptr),
                Arg::I32(xi.code),
                Arg::Ptr(out.ptr),
                Arg::I32(out.code),
                Arg::I64(out.numel as i64),
                Arg::I32(code),
                Arg::F32(mul),
                Arg::F32(add),
            ],
        )?;
    }
    out.finish(dev, &[&xi])
}

/// Elements of `dtype` in one 16-byte vector of the `*_vec` kernels.
fn lanes(dtype: DType) -> usize {
    16 / dtype.size_in_bytes()
}

/// Whether `n` elements of `dtype` at each of `ptrs` can be walked in 16-byte vectors.
fn vectorizable(n: usize, dtype: DType, ptrs: &[u64]) -> bool {
    kernels::dtype_code(dtype).is_some()
        && n.is_multiple_of(lanes(dtype))
        && ptrs.iter().all(|p| p.is_multiple_of(16))
}

/// `ddo_unary_vec`: `y = f(x)` over `n` elements of `dtype` (`x == y` is allowed).
#[allow(clippy::too_many_arguments)]
fn map_vec(
    dev: &CudaDevice,
    x: u64,
    y: u64,
    code: i32,
    n: usize,
    dtype: DType,
    op: i32,
    mul: f32,
    add: f32,
) -> Result<()> {
    let f = dev.kernel(SOURCE_NAME, SOURCE, "ddo_unary_vec")?;
    let nvec = (n / lanes(dtype)) as u64;
    launch(
        dev,
        &f,
        grid_1d(nvec, BLOCK),
        &[
            Arg::Ptr(x),
            Arg::Ptr(y),
            Arg::I32(code),
            Arg::I64(nvec as i64),
            Arg::I32(op),
            Arg::F32(mul),
            Arg::F32(add),
        ],
    )
}

/// [`ddo_core::Ops::unary_owned`]: over `x`'s own bytes when `x` alone holds them and the
/// vectorised kernel takes them (no second buffer), else [`unary`].
pub(crate) fn unary_owned(dev: &CudaDevice, mut x: Tensor, op: UnaryOp) -> Result<Tensor> {
    const OP: &str = "unary";
    if !x.has_exclusive_device_buffer() {
        return unary(dev, &x, op);
    }
    let xi = input(dev, OP, &x)?;
    if xi.numel == 0 || !vectorizable(xi.numel, xi.dtype, &[xi.ptr]) {
        return unary(dev, &x, op);
    }
    map_vec(
        dev,
        xi.ptr,
        xi.ptr,
        xi.code,
        xi.numel,
        xi.dtype,
        unary_code(op),
        1.0,
        0.0,
    )?;
    mark_used(dev, &[&xi])?;
    Ok(x)
}

/// [`ddo_core::Ops::unary`].
pub(crate) fn unary(dev: &CudaDevice, x: &Tensor, op: UnaryOp) -> Result<Tensor> {
    map(dev, "unary", x, x.dtype(), unary_code(op), 1.0, 0.0)
}

/// [`ddo_core::Ops::affine`].
pub(crate) fn affine(dev: &CudaDevice, x: &Tensor, mul: f32, add: f32) -> Result<Tensor> {
    map(dev, "affine", x, x.dtype(), U_AFFINE, mul, add)
}

/// [`ddo_core::Ops::cast`]: a byte copy when the dtype is unchanged (as the host does); an
/// 8-bit float source is decoded exactly ([`fp8_upcast`]).
pub(crate) fn cast(dev: &CudaDevice, x: &Tensor, dtype: DType) -> Result<Tensor> {
    const OP: &str = "cast";
    if x.dtype().is_fp8() && dtype != x.dtype() {
        return fp8_upcast(dev, x, dtype);
    }
    if dtype != x.dtype() {
        return map(dev, OP, x, dtype, U_COPY, 1.0, 0.0);
    }
    let xi = input(dev, OP, x)?;
    let out = Out::new(dev, OP, x.shape().to_vec(), dtype)?;
    copy_bytes(dev, out.ptr, &xi)?;
    out.finish(dev, &[&xi])
}

/// `x` (an 8-bit float tensor) decoded into a new tensor of the float `dtype`, times its
/// per-tensor scale when it has one: the decode is exact, as the host's
/// [`DType::decode_f32`] (every fp8 value is an f16, bf16 and f32 value), the scale
/// multiplies in f32 before rounding, as the host's dequantizing ops do. Encoding into fp8
/// on the device is refused by the output (`float_dtype`).
pub(crate) fn fp8_upcast(dev: &CudaDevice, x: &Tensor, dtype: DType) -> Result<Tensor> {
    const OP: &str = "fp8 upcast";
    let xi = super::stored_input(dev, x)?;
    if !xi.dtype.is_fp8() {
        return Err(super::shape_err(
            OP,
            format!("{} is not an 8-bit float", xi.dtype),
        ));
    }
    let out = Out::new(dev, OP, x.shape().to_vec(), dtype)?;
    if out.numel > 0 {
        // Into a 16-bit dtype from aligned bytes (every whole weight is): eight codes a
        // thread, 16-byte stores; the same values as one at a time.
        let vector = dtype != DType::F32 && xi.ptr % 8 == 0 && out.ptr % 16 == 0;
        let (name, items) = if vector {
            ("ddo_fp8_upcast_x8", (out.numel as u64).div_ceil(8))
        } else {
            ("ddo_fp8_upcast", out.numel as u64)
        };
        let f = dev.kernel(SOURCE_NAME, SOURCE, name)?;
        launch(
            dev,
            &f,
            grid_1d(items, BLOCK),
            &[
                Arg::Ptr(xi.ptr),
                Arg::I32(i32::from(xi.dtype == DType::F8E5M2)),
                Arg::F32(x.scale().unwrap_or(1.0)),
                Arg::Ptr(out.ptr),
                Arg::I32(out.code),
                Arg::I64(out.numel as i64),
            ],
        )?;
    }
    out.finish(dev, &[&xi])
}

/// Queues a device copy of all of `src`'s bytes to `dst` on the compute stream.
fn copy_bytes(dev: &CudaDevice, dst: u64, src: &In<'_>) -> Result<()> {
    if src.len == 0 {
        return Ok(());
    }
    let stream = kernels::compute_stream(dev)?;
    // Both ranges are live allocations of `dev` (the output was just allocated with
    // `src.len` bytes); the caller's `Out::finish` marks both used on the compute stream.
    driver::memcpy_dtod_async(dst, src.ptr, src.len, &stream)
        .map_err(|e: CudaError| e.into_core(&ddo_core::Device::id(dev).to_string()))
}

/// [`ddo_core::Ops::binary`]: the output has `a`'s dtype and the broadcast shape.
pub(crate) fn binary(dev: &CudaDevice, a: &Tensor, b: &Tensor, op: BinaryOp) -> Result<Tensor> {
    const OP: &str = "binary";
    let shape = broadcast_shape(OP, a.shape(), b.shape())?;
    let ai = input(dev, OP, a)?;
    let bi = input(dev, OP, b)?;
    let out = Out::new(dev, OP, shape.clone(), a.dtype())?;
    if out.numel > 0 {
        let sa = broadcast_strides(a.shape(), &shape);
        let sb = broadcast_strides(b.shape(), &shape);
        let so = contiguous_strides(&shape);
        let (cs, [sa, sb, _]) = coalesce(&shape, [&sa, &sb, &so]);
        if binary_vec(dev, &ai, &bi, &out, &cs, &sa, &sb, binary_code(op))? {
            return out.finish(dev, &[&ai, &bi]);
        }
        let wide = dev.kernel(SOURCE_NAME, SOURCE, "ddo_binary")?;
        let narrow = dev.kernel(SOURCE_NAME, SOURCE, "ddo_binary32")?;
        let (ea, eb, eo) = (
            ai.dtype.size_in_bytes() as u64,
            bi.dtype.size_in_bytes() as u64,
            out.dtype.size_in_bytes() as u64,
        );
        for_each_block(&cs, [&sa, &sb], |[oa, ob], first, bs, [ba, bb]| {
            let n: usize = bs.iter().product();
            let f = if fits_u32(bs, &[ba, bb]) {
                &narrow
            } else {
                &wide
            };
            launch(
                dev,
                f,
                grid_1d(n as u64, BLOCK),
                &[
                    Arg::Ptr(ai.ptr + oa as u64 * ea),
                    Arg::I32(ai.code),
                    Arg::Ptr(bi.ptr + ob as u64 * eb),
                    Arg::I32(bi.code),
                    Arg::Ptr(out.ptr + first as u64 * eo),
                    Arg::I32(out.code),
                    Arg::I64(n as i64),
                    Arg::I32(bs.len() as i32),
                    Arg::Dims(Dims6::from_slice(bs)),
                    Arg::Dims(Dims6::from_slice(ba)),
                    Arg::Dims(Dims6::from_slice(bb)),
                    Arg::I32(binary_code(op)),
                ],
            )
        })?;
    }
    out.finish(dev, &[&ai, &bi])
}

/// `ddo_binary_vec` over the coalesced walk `cs` when it fits (one dtype, at most 6 dims,
/// whole vectors along the innermost dim, each operand moving along it with stride 1 or
/// broadcast with stride 0, vector loads aligned, 32-bit offsets); `false` when it does not
/// and nothing was queued.
#[allow(clippy::too_many_arguments)]
fn binary_vec(
    dev: &CudaDevice,
    a: &In<'_>,
    b: &In<'_>,
    out: &Out,
    cs: &[usize],
    sa: &[usize],
    sb: &[usize],
    op: i32,
) -> Result<bool> {
    let dtype = out.dtype;
    let w = lanes(dtype);
    let r = cs.len();
    let inner_ok = |st: &[usize], ptr: u64| match st.last() {
        Some(1) => ptr.is_multiple_of(16) && st[..r - 1].iter().all(|s| s.is_multiple_of(w)),
        Some(0) => true,
        _ => false,
    };
    let fits = a.dtype == dtype
        && b.dtype == dtype
        && (1..=MAX_VEC_DIMS).contains(&r)
        && cs[r - 1].is_multiple_of(w)
        && out.ptr.is_multiple_of(16)
        && inner_ok(sa, a.ptr)
        && inner_ok(sb, b.ptr)
        && fits_u32(cs, &[sa, sb]);
    if !fits {
        return Ok(false);
    }
    let mut vshape = cs.to_vec();
    vshape[r - 1] /= w;
    let nvec: usize = vshape.iter().product();
    let f = dev.kernel(SOURCE_NAME, SOURCE, "ddo_binary_vec")?;
    launch(
        dev,
        &f,
        grid_1d(nvec as u64, BLOCK),
        &[
            Arg::Ptr(a.ptr),
            Arg::Ptr(b.ptr),
            Arg::Ptr(out.ptr),
            Arg::I32(out.code),
            Arg::U32(nvec as u32),
            Arg::I32(r as i32),
            Arg::Dims(Dims6::from_slice(&vshape)),
            Arg::Dims(Dims6::from_slice(sa)),
            Arg::Dims(Dims6::from_slice(sb)),
            Arg::I32(i32::from(sa[r - 1] == 1)),
            Arg::I32(i32::from(sb[r - 1] == 1)),
            Arg::I32(op),
        ],
    )?;
    Ok(true)
}

/// Most coalesced dims of a vectorised binary launch.
const MAX_VEC_DIMS: usize = 6;

/// [`ddo_core::Ops::rope`].
pub(crate) fn rope(dev: &CudaDevice, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    const OP: &str = "rope";
    let xs = x.shape();
    let ok = xs.len() >= 2
        && cos.shape() == &xs[xs.len() - 2..]
        && sin.shape() == cos.shape()
        && xs[xs.len() - 1].is_multiple_of(2);
    if !ok {
        return Err(shape_err(
            OP,
            format!(
                "x {xs:?}, cos {:?}, sin {:?}: expected x [b, h, l, d] with d even and \
                 cos, sin [l, d]",
                cos.shape(),
                sin.shape()
            ),
        ));
    }
    let xi = input(dev, OP, x)?;
    let ci = input(dev, OP, cos)?;
    let si = input(dev, OP, sin)?;
    let out = Out::new(dev, OP, xs.to_vec(), x.dtype())?;
    let table = ci.numel;
    let vec_ok = matches!(xi.dtype, DType::F16 | DType::BF16)
        && out.dtype == xi.dtype
        && ci.dtype == DType::F32
        && si.dtype == DType::F32
        && table.is_multiple_of(8)
        && out.numel.is_multiple_of(8)
        && [xi.ptr, ci.ptr, si.ptr, out.ptr]
            .iter()
            .all(|p| p.is_multiple_of(16));
    if out.numel > 0 && vec_ok {
        let f = dev.kernel(SOURCE_NAME, SOURCE, "ddo_rope_vec")?;
        let nvec = (out.numel / 8) as u64;
        launch(
            dev,
            &f,
            grid_1d(nvec, BLOCK),
            &[
                Arg::Ptr(xi.ptr),
                Arg::Ptr(ci.ptr),
                Arg::Ptr(si.ptr),
                Arg::Ptr(out.ptr),
                Arg::I32(out.code),
                Arg::I64(nvec as i64),
                Arg::I64((table / 8) as i64),
            ],
        )?;
    } else if out.numel > 0 {
        let f = dev.kernel(SOURCE_NAME, SOURCE, "ddo_rope")?;
        let pairs = (out.numel / 2) as u64;
        launch(
            dev,
            &f,
            grid_1d(pairs, BLOCK),
            &[
                Arg::Ptr(xi.ptr),
                Arg::I32(xi.code),
                Arg::Ptr(ci.ptr),
                Arg::I32(ci.code),
                Arg::Ptr(si.ptr),
                Arg::I32(si.code),
                Arg::Ptr(out.ptr),
                Arg::I32(out.code),
                Arg::I64(pairs as i64),
                Arg::I64(ci.numel as i64),
            ],
        )?;
    }
    out.finish(dev, &[&xi, &ci, &si])
}

/// Most blocks of a row-per-block launch (the kernels loop over the rest).
const MAX_ROW_BLOCKS: usize = 1 << 20;

/// [`ddo_core::Ops::gated_add`]: `x + gate * y` in one pass (`ddo_gated_add*`: f32 math,
/// one rounding into `x`'s dtype) when `y` has `x`'s shape and `gate` holds one row per
/// group of their rows ([`ddo_core::shape::row_broadcast_group`]: `[b, 1, d]`, `[1, d]`,
/// `[d]`, ...); any other layout takes the composition of plain ops, as on the host.
pub(crate) fn gated_add(dev: &CudaDevice, x: &Tensor, gate: &Tensor, y: &Tensor) -> Result<Tensor> {
    const OP: &str = "gated_add";
    let group = ddo_core::shape::row_broadcast_group(x.shape(), gate.shape());
    let Some(gg) = group.filter(|_| y.shape() == x.shape()) else {
        return ddo_core::ops::gated_add_composed(dev, x, gate, y);
    };
    let xi = input(dev, OP, x)?;
    let gi = input(dev, OP, gate)?;
    let yi = input(dev, OP, y)?;
    let out = Out::new(dev, OP, x.shape().to_vec(), x.dtype())?;
    let d = x.shape().last().copied().unwrap_or(1);
    if out.numel > 0 && d > 0 {
        let rows = out.numel / d;
        let dtype = out.dtype;
        let vec = xi.dtype == dtype
            && yi.dtype == dtype
            && d.is_multiple_of(lanes(dtype))
            && [xi.ptr, yi.ptr, out.ptr]
                .iter()
                .all(|p| p.is_multiple_of(16));
        let width = if vec { d / lanes(dtype) } else { d };
        // About two items a thread, at least a warp, at most 256 threads.
        let threads = (width.div_ceil(2).div_ceil(32) * 32).clamp(32, 256) as u32;
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (rows.clamp(1, MAX_ROW_BLOCKS) as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        if vec {
            let f = dev.kernel(SOURCE_NAME, SOURCE, "ddo_gated_add_vec")?;
            launch(
                dev,
                &f,
                cfg,
                &[
                    Arg::Ptr(xi.ptr),
                    Arg::Ptr(gi.ptr),
                    Arg::I32(gi.code),
                    Arg::Ptr(yi.ptr),
                    Arg::Ptr(out.ptr),
                    Arg::I32(out.code),
                    Arg::I64(rows as i64),
                    Arg::I64(width as i64),
                    Arg::I64(gg.max(1) as i64),
                    // Row and vector counts in 32 bits where every index fits.
                    Arg::I32(i32::from(out.numel <= u32::MAX as usize)),
                ],
            )?;
        } else {
            let f = dev.kernel(SOURCE_NAME, SOURCE, "ddo_gated_add")?;
            launch(
                dev,
                &f,
                cfg,
                &[
                    Arg::Ptr(xi.ptr),
                    Arg::I32(xi.code),
                    Arg::Ptr(gi.ptr),
                    Arg::I32(gi.code),
                    Arg::Ptr(yi.ptr),
                    Arg::I32(yi.code),
                    Arg::Ptr(out.ptr),
                    Arg::I32(out.code),
                    Arg::I64(rows as i64),
                    Arg::I64(d as i64),
                    Arg::I64(gg.max(1) as i64),
                ],
            )?;
        }
    }
    out.finish(dev, &[&xi, &gi, &yi])
}
