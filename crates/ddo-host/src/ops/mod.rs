//! The host backend's compute plane: [`Ops`] for [`HostDevice`].
//!
//! Every op checks that its inputs are device tensors of this device, checks shapes (a
//! mismatch is [`CoreError::Shape`], never a panic), then fences the compute stream
//! ([`HostDevice::host_compute_fence`]) so it reads inputs only after the work queued
//! before it (copies ordered by `wait_event`), computes in f32 on the calling thread, and
//! writes its result into a fresh allocation made with [`Device::alloc`], so outputs count
//! in the device's memory accounting. f16/bf16 results are rounded once, when written.
//!
//! Matrix products (linear, matmul, the im2col convolution, attention blocks) run on
//! `matrixmultiply`'s sgemm, which threads large products itself. Normalisations
//! accumulate in f64. Attention is computed per (batch, head) in blocks of queries and
//! keys with an online softmax, so no full score matrix is ever held; heads run on scoped
//! threads when there is enough work.
//!
//! Files, by op family (as in `ddo-cuda`'s `ops/`): this one holds the operand and output
//! plumbing shared by every op, the strided walk, and the [`Ops`] impl that dispatches to
//! the families: `gemm` (the sgemm wrapper, linear, `linear_concat`, matmul), `conv`
//! (im2col convolution), `attention` (blocked online-softmax attention), `norm`
//! (group/layer/RMS norm, softmax, reduce, the non-finite count), `elementwise` (unary, binary with
//! broadcasting, affine, rope) and `layout` (upload/download, concat, narrow, permute,
//! upsample, cast, embedding); `tests` holds the tests of the plane as a whole
//! (dtypes, bad input, fp8, accounting, stream order) and `test_support` their helpers.

use half::{bf16, f16};

use crate::device::{HostAllocation, HostDevice};
use ddo_core::device::{Device, DeviceBuffer};
use ddo_core::dtype::DType;
use ddo_core::error::{CoreError, Result};
use ddo_core::ops::{BinaryOp, Conv2dParams, Ops, ReduceOp, UnaryOp};
use ddo_core::tensor::{Tensor, TensorStorage, byte_len, numel};

mod attention;
mod conv;
mod elementwise;
mod gemm;
mod layout;
mod norm;
mod quant;
#[cfg(test)]
mod test_support;

fn shape_err(what: &str, message: impl Into<String>) -> CoreError {
    CoreError::Shape {
        what: what.to_string(),
        message: message.into(),
    }
}

fn product(dims: &[usize]) -> usize {
    dims.iter().product()
}

/// An input operand: a byte range of an allocation of this device.
struct Input<'a> {
    alloc: &'a HostAllocation,
    range: std::ops::Range<usize>,
    dtype: DType,
    /// A scaled fp8 tensor's per-tensor scale (only [`HostDevice::dequant_input`] takes one).
    scale: Option<f32>,
}

impl Input<'_> {
    /// The values as f32 (a copy; a scaled tensor's scale applied).
    fn f32(&self) -> Result<Vec<f32>> {
        let mut values = self
            .alloc
            .with_bytes(|b| self.dtype.decode_f32(&b[self.range.clone()]))?;
        ddo_core::tensor::apply_scale(&mut values, self.scale);
        Ok(values)
    }

    /// The values as a dequantizing op computes on them: an 8-bit float decoded, scaled
    /// in f32, then rounded to the `compute` dtype (what CUDA's upcast into scratch of the
    /// input's dtype stores); any other dtype as [`Input::f32`].
    fn dequantized(&self, compute: DType) -> Result<Vec<f32>> {
        let values = self.f32()?;
        if !self.dtype.is_fp8() || compute == DType::F32 {
            return Ok(values);
        }
        compute.decode_f32(&compute.encode_f32(&values)?)
    }

    /// Runs `f` over the raw bytes.
    fn bytes<R>(&self, f: impl FnOnce(&[u8]) -> R) -> R {
        self.alloc.with_bytes(|b| f(&b[self.range.clone()]))
    }

    /// Runs `f` over the values as f32, in place when the bytes already are aligned
    /// little-endian f32 (no copy of large weights). Holds the allocation's read lock
    /// while `f` runs: never call it while holding another input's lock.
    fn with_f32<R>(&self, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
        self.alloc.with_bytes(|b| {
            let bytes = &b[self.range.clone()];
            if self.dtype == DType::F32
                && self.scale.is_none()
                && cfg!(target_endian = "little")
                && let Ok(values) = bytemuck::try_cast_slice::<u8, f32>(bytes)
            {
                return Ok(f(values));
            }
            let mut values = self.dtype.decode_f32(bytes)?;
            ddo_core::tensor::apply_scale(&mut values, self.scale);
            Ok(f(&values))
        })
    }
}

/// Encodes `values` into `out` (exactly `values.len()` elements of `dtype`).
fn encode_into(dtype: DType, values: &[f32], out: &mut [u8]) {
    match dtype {
        DType::F32 => {
            for (c, v) in out.chunks_exact_mut(4).zip(values) {
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        DType::F16 => {
            for (c, v) in out.chunks_exact_mut(2).zip(values) {
                c.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
            }
        }
        DType::BF16 => {
            for (c, v) in out.chunks_exact_mut(2).zip(values) {
                c.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
            }
        }
        // Refused by `float_dtype` before anything is allocated.
        DType::Quantized => {}
        // fp8 (and any float dtype `ddo-core` adds later, its enum being non-exhaustive
        // here): the dtype's own encoding (saturating for fp8, see `DType`), zipped as the
        // other arms are (never past `out`).
        _ => {
            let bytes = dtype.encode_f32(values).unwrap_or_default();
            for (o, b) in out.iter_mut().zip(bytes) {
                *o = b;
            }
        }
    }
}

fn float_dtype(op: &str, dtype: DType) -> Result<()> {
    if dtype.is_quantized() {
        Err(shape_err(
            op,
            "quantized storage has no element values to compute on; dequantize it first",
        ))
    } else {
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------
// Broadcasting and strided walks
// ---------------------------------------------------------------------------------------

/// Calls `f` with the operands' offsets for every index of `shape`, row-major.
fn walk<const K: usize>(shape: &[usize], strides: [&[usize]; K], mut f: impl FnMut([usize; K])) {
    if shape.contains(&0) {
        return;
    }
    let r = shape.len();
    let mut idx = vec![0usize; r];
    let mut off = [0usize; K];
    loop {
        f(off);
        let mut d = r;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            idx[d] += 1;
            for o in 0..K {
                off[o] += strides[o][d];
            }
            if idx[d] < shape[d] {
                break;
            }
            for o in 0..K {
                off[o] -= strides[o][d] * shape[d];
            }
            idx[d] = 0;
        }
    }
}

// ---------------------------------------------------------------------------------------
// The device's ops
// ---------------------------------------------------------------------------------------

impl HostDevice {
    /// Checks that `t` is a float tensor in this device's memory.
    fn input<'a>(&self, op: &str, t: &'a Tensor) -> Result<Input<'a>> {
        if t.scale().is_some() {
            return Err(shape_err(
                op,
                "a scaled fp8 tensor is read only by cast and the linears; cast it to a float dtype first",
            ));
        }
        self.dequant_input(op, t)
    }

    /// [`HostDevice::input`] for the ops that dequantize (cast, the linears' weight and
    /// bias): a scaled fp8 tensor is taken with its scale.
    fn dequant_input<'a>(&self, op: &str, t: &'a Tensor) -> Result<Input<'a>> {
        let input = self.raw_input(t)?;
        float_dtype(op, t.dtype())?;
        Ok(Input {
            scale: t.scale(),
            ..input
        })
    }

    /// The stored bytes of a device tensor of any dtype (a quantized weight's blocks), for
    /// [`Ops::dequantize`].
    fn raw_input<'a>(&self, t: &'a Tensor) -> Result<Input<'a>> {
        let slice = match t.storage() {
            TensorStorage::Device(s) => s,
            TensorStorage::Host(_) => {
                return Err(CoreError::WrongDevice {
                    what: "tensor",
                    expected: self.id().to_string(),
                    found: "host memory".into(),
                });
            }
        };
        Ok(Input {
            alloc: self.allocation(slice.buffer())?,
            range: slice.offset()..slice.offset() + slice.len(),
            dtype: t.dtype(),
            scale: None,
        })
    }

    /// Orders this op after the work queued on the compute stream so far.
    fn fence(&self) -> Result<()> {
        self.host_compute_fence(&self.compute_stream())
    }

    /// Allocates an op's output up front, before any host scratch is made, so a result
    /// too large for the device is a typed out-of-memory error.
    fn new_output(&self, op: &str, shape: Vec<usize>, dtype: DType) -> Result<Output<'_>> {
        float_dtype(op, dtype)?;
        let buffer = self.alloc(byte_len(&shape, dtype)?)?;
        Ok(Output {
            device: self,
            buffer,
            shape,
            dtype,
        })
    }

    /// Checks an optional per-feature vector (`[len]`) operand.
    fn optional_vector<'a>(
        &self,
        op: &str,
        what: &str,
        t: Option<&'a Tensor>,
        len: usize,
    ) -> Result<Option<Input<'a>>> {
        t.map(|t| {
            vector_shape(op, what, t, len)?;
            self.input(op, t)
        })
        .transpose()
    }

    /// [`HostDevice::optional_vector`] for a linear's bias, which may be scaled fp8.
    fn optional_bias<'a>(
        &self,
        op: &str,
        t: Option<&'a Tensor>,
        len: usize,
    ) -> Result<Option<Input<'a>>> {
        t.map(|t| {
            vector_shape(op, "bias", t, len)?;
            self.dequant_input(op, t)
        })
        .transpose()
    }
}

/// Refuses a per-feature vector operand `what` of `op` whose shape is not `[len]`.
fn vector_shape(op: &str, what: &str, t: &Tensor, len: usize) -> Result<()> {
    if t.shape() == [len] {
        Ok(())
    } else {
        Err(shape_err(
            op,
            format!("{what} has shape {:?}, expected [{len}]", t.shape()),
        ))
    }
}

/// An op's output: its device allocation, written once the values are computed.
struct Output<'d> {
    device: &'d HostDevice,
    buffer: DeviceBuffer,
    shape: Vec<usize>,
    dtype: DType,
}

impl Output<'_> {
    /// Writes raw bytes (exactly the output's size) and returns the tensor.
    fn write_bytes(self, fill: impl FnOnce(&mut [u8])) -> Result<Tensor> {
        self.device.allocation(&self.buffer)?.with_bytes_mut(fill);
        Tensor::new(
            self.shape,
            self.dtype,
            TensorStorage::Device(self.buffer.slice_all()),
        )
    }

    /// Encodes `values` into the output and returns the tensor.
    fn write_f32(self, values: &[f32]) -> Result<Tensor> {
        if numel(&self.shape) != Some(values.len()) {
            return Err(shape_err(
                "host op output",
                format!("{} values do not fill shape {:?}", values.len(), self.shape),
            ));
        }
        let dtype = self.dtype;
        self.write_bytes(|b| encode_into(dtype, values, b))
    }
}

/// The f32 values of an optional input (read after the fence).
fn read_opt(input: Option<&Input<'_>>) -> Result<Option<Vec<f32>>> {
    input.map(Input::f32).transpose()
}

impl Ops for HostDevice {
    fn tensor_from_f32(&self, shape: &[usize], dtype: DType, values: &[f32]) -> Result<Tensor> {
        layout::tensor_from_f32(self, shape, dtype, values)
    }

    fn to_f32_vec(&self, x: &Tensor) -> Result<Vec<f32>> {
        layout::to_f32_vec(self, x)
    }

    fn linear(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        gemm::linear(self, x, w, bias)
    }

    /// Exactly `linear(concat(xs), w, bias)` of this backend (the concatenation is exact
    /// when the parts share a dtype), without a device buffer for the concatenation.
    fn linear_concat(&self, xs: &[&Tensor], w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        gemm::linear_concat(self, xs, w, bias)
    }

    fn matmul(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        gemm::matmul(self, a, b)
    }

    fn conv2d(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        params: Conv2dParams,
    ) -> Result<Tensor> {
        conv::conv2d(self, x, w, bias, params)
    }

    fn group_norm(
        &self,
        x: &Tensor,
        groups: usize,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor> {
        norm::group_norm(self, x, groups, weight, bias, eps)
    }

    fn layer_norm(
        &self,
        x: &Tensor,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor> {
        norm::layer_norm(self, x, weight, bias, eps)
    }

    fn rms_norm(&self, x: &Tensor, weight: Option<&Tensor>, eps: f32) -> Result<Tensor> {
        norm::rms_norm(self, x, weight, eps)
    }

    fn unary(&self, x: &Tensor, op: UnaryOp) -> Result<Tensor> {
        elementwise::unary(self, x, op)
    }

    /// Reads `x`, lets it go, then allocates the output: when nothing else holds `x` its
    /// bytes are free again first, so the device's peak is that of an in-place op.
    fn attention_input(
        &self,
        part: &ddo_core::AttentionInput<'_>,
        dst: Option<Tensor>,
    ) -> Result<Tensor> {
        layout::attention_input(self, part, dst)
    }

    fn unary_owned(&self, x: Tensor, op: UnaryOp) -> Result<Tensor> {
        elementwise::unary_owned(self, x, op)
    }

    fn binary(&self, a: &Tensor, b: &Tensor, op: BinaryOp) -> Result<Tensor> {
        elementwise::binary(self, a, b, op)
    }

    fn affine(&self, x: &Tensor, mul: f32, add: f32) -> Result<Tensor> {
        elementwise::affine(self, x, mul, add)
    }

    fn softmax(&self, x: &Tensor) -> Result<Tensor> {
        norm::softmax(self, x)
    }

    fn reduce(&self, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        norm::reduce(self, x, dim, op)
    }

    fn count_non_finite(&self, x: &Tensor) -> Result<u64> {
        norm::count_non_finite(self, x)
    }

    fn upsample_nearest2x(&self, x: &Tensor) -> Result<Tensor> {
        layout::upsample_nearest2x(self, x)
    }

    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        scale: f32,
    ) -> Result<Tensor> {
        attention::attend(self, "attention", [q, k, v], mask, scale, false)
    }

    fn attention_tokens(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        scale: f32,
    ) -> Result<Tensor> {
        attention::attend(self, "attention_tokens", [q, k, v], mask, scale, true)
    }

    fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        elementwise::rope(self, x, cos, sin)
    }

    fn concat(&self, xs: &[&Tensor], dim: usize) -> Result<Tensor> {
        layout::concat(self, xs, dim)
    }

    fn narrow(&self, x: &Tensor, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        layout::narrow(self, x, dim, start, len)
    }

    fn permute(&self, x: &Tensor, dims: &[usize]) -> Result<Tensor> {
        layout::permute(self, x, dims)
    }

    fn dequantize(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        quant::dequantize(self, x, dtype)
    }

    fn cast(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        layout::cast(self, x, dtype)
    }

    fn embedding(&self, table: &Tensor, ids: &[u32]) -> Result<Tensor> {
        layout::embedding(self, table, ids)
    }
}

#[cfg(test)]
mod tests;
