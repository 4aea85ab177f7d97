//! Element-wise ops on the GPU: unary functions, affine, casts, binary ops with NumPy
//! broadcasting, rotary embedding (kernels in `kernels/elementwise.cu`).

use ddo_core::{BinaryOp, DType, Result, Tensor, UnaryOp};

use super::kernels::{self, Arg, Dims6, grid_1d, launch};
use super::{
    In, Out, broadcast_shape, broadcast_strides, coalesce, contiguous_strides, fits_u32,
    for_each_block, input, shape_err,
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
    if out.numel > 0 {
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

/// [`ddo_core::Ops::unary`].
pub(crate) fn unary(dev: &CudaDevice, x: &Tensor, op: UnaryOp) -> Result<Tensor> {
    map(dev, "unary", x, x.dtype(), unary_code(op), 1.0, 0.0)
}

/// [`ddo_core::Ops::affine`].
pub(crate) fn affine(dev: &CudaDevice, x: &Tensor, mul: f32, add: f32) -> Result<Tensor> {
    map(dev, "affine", x, x.dtype(), U_AFFINE, mul, add)
}

/// [`ddo_core::Ops::cast`]: a byte copy when the dtype is unchanged (as the host does).
pub(crate) fn cast(dev: &CudaDevice, x: &Tensor, dtype: DType) -> Result<Tensor> {
    const OP: &str = "cast";
    if dtype != x.dtype() {
        return map(dev, OP, x, dtype, U_COPY, 1.0, 0.0);
    }
    let xi = input(dev, OP, x)?;
    let out = Out::new(dev, OP, x.shape().to_vec(), dtype)?;
    copy_bytes(dev, out.ptr, &xi)?;
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
    if out.numel > 0 {
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
