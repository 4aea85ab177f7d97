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
//! (group/layer/RMS norm, softmax, reduce), `elementwise` (unary, binary with
//! broadcasting, affine, rope) and `layout` (upload/download, concat, narrow, permute,
//! upsample, cast, embedding).

use half::{bf16, f16};

use crate::device::{Device, DeviceBuffer};
use crate::dtype::DType;
use crate::error::{CoreError, Result};
use crate::host_device::{HostAllocation, HostDevice};
use crate::ops::{BinaryOp, Conv2dParams, Ops, ReduceOp, UnaryOp};
use crate::tensor::{Tensor, TensorStorage, byte_len, numel};

mod attention;
mod conv;
mod elementwise;
mod gemm;
mod layout;
mod norm;
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
        crate::tensor::apply_scale(&mut values, self.scale);
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
            crate::tensor::apply_scale(&mut values, self.scale);
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
        DType::F8E4M3 | DType::F8E5M2 => {
            // One byte per element: the dtype's own encoding (saturating, see `DType`), zipped
            // as the other arms are (never past `out`).
            let bytes = dtype.encode_f32(values).unwrap_or_default();
            for (o, b) in out.iter_mut().zip(bytes) {
                *o = b;
            }
        }
        // Refused by `float_dtype` before anything is allocated.
        DType::Quantized => {}
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
        let alloc = self.allocation(slice.buffer())?;
        float_dtype(op, t.dtype())?;
        Ok(Input {
            alloc,
            range: slice.offset()..slice.offset() + slice.len(),
            dtype: t.dtype(),
            scale: t.scale(),
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
        attention::attention(self, q, k, v, mask, scale)
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

    fn cast(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        layout::cast(self, x, dtype)
    }

    fn embedding(&self, table: &Tensor, ids: &[u32]) -> Result<Tensor> {
        layout::embedding(self, table, ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::ops_of;
    use crate::host_device::HostDeviceConfig;
    use crate::host_ops::test_support::*;
    use crate::rng::SplitMix64;
    #[test]
    fn host_device_exposes_its_ops() {
        let d = dev();
        let ops = ops_of(&*d).unwrap();
        let t = ops.tensor_from_f32(&[2], DType::F32, &[1.0, 2.0]).unwrap();
        assert!(t.is_on_device());
        assert_eq!(ops.to_f32_vec(&t).unwrap(), vec![1.0, 2.0]);
    }

    #[test]
    fn bf16_inputs_stay_within_bf16_tolerance() {
        let d = dev();
        let mut rng = SplitMix64::new(2);
        let (inp, out) = (32, 16);
        let x = random(&mut rng, 4 * inp);
        let w = random(&mut rng, out * inp);
        let (xt, wt) = (
            put(&d, &[4, inp], DType::BF16, &x),
            put(&d, &[out, inp], DType::BF16, &w),
        );
        // The reference sees the bf16-rounded inputs; the output is rounded once.
        let (xr, wr) = (get(&d, &xt), get(&d, &wt));
        let y = d.linear(&xt, &wt, None).unwrap();
        assert_eq!(y.dtype(), DType::BF16);
        assert_close(
            "bf16 linear",
            &get(&d, &y),
            &ref_linear(&xr, &wr, None, inp, out),
            BF16_TOL,
        );
        let s = d.binary(&xt, &xt, BinaryOp::Mul).unwrap();
        let want: Vec<f64> = xr.iter().map(|&v| f64::from(v) * f64::from(v)).collect();
        assert_close("bf16 mul", &get(&d, &s), &want, BF16_TOL);
        let g = d.unary(&xt, UnaryOp::GeluErf).unwrap();
        let want: Vec<f64> = xr.iter().map(|&v| ref_gelu_erf(f64::from(v))).collect();
        assert_close("bf16 gelu", &get(&d, &g), &want, BF16_TOL);
    }

    #[test]
    fn affine_softmax_reduce_and_upsample() {
        let d = dev();
        let mut rng = SplitMix64::new(8);
        let x: Vec<f32> = random(&mut rng, 2 * 3 * 4)
            .iter()
            .map(|v| v * 8.0)
            .collect();
        let xt = put(&d, &[2, 3, 4], DType::F32, &x);

        let y = d.affine(&xt, 1.5, -0.25).unwrap();
        let want: Vec<f64> = x.iter().map(|&v| f64::from(v) * 1.5 - 0.25).collect();
        assert_close("affine", &get(&d, &y), &want, F32_TOL);

        let y = d.softmax(&xt).unwrap();
        let mut want = Vec::new();
        for row in x.chunks(4) {
            let e: Vec<f64> = row.iter().map(|&v| f64::from(v).exp()).collect();
            let s: f64 = e.iter().sum();
            want.extend(e.iter().map(|v| v / s));
        }
        assert_close("softmax", &get(&d, &y), &want, F32_TOL);

        let shape = [2, 3, 4];
        for dim in 0..3 {
            for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
                let y = d.reduce(&xt, dim, op).unwrap();
                let mut osh = shape;
                osh[dim] = 1;
                assert_eq!(y.shape(), &osh);
                let want: Vec<f64> = (0..osh.iter().product())
                    .map(|i| {
                        let mut idx = unravel(i, &osh);
                        let vals: Vec<f64> = (0..shape[dim])
                            .map(|j| {
                                idx[dim] = j;
                                f64::from(x[ravel_broadcast(&idx, &shape)])
                            })
                            .collect();
                        match op {
                            ReduceOp::Sum => vals.iter().sum(),
                            ReduceOp::Mean => vals.iter().sum::<f64>() / vals.len() as f64,
                            ReduceOp::Max => vals.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                        }
                    })
                    .collect();
                assert_close(
                    &format!("reduce {op:?} dim {dim}"),
                    &get(&d, &y),
                    &want,
                    F32_TOL,
                );
            }
        }

        let x = random(&mut rng, 2 * 2 * 3 * 5);
        let y = d
            .upsample_nearest2x(&put(&d, &[2, 2, 3, 5], DType::F32, &x))
            .unwrap();
        assert_eq!(y.shape(), &[2, 2, 6, 10]);
        let got = get(&d, &y);
        for (i, &g) in got.iter().enumerate() {
            let [n, c, yy, xx] = unravel(i, &[2, 2, 6, 10])[..] else {
                unreachable!()
            };
            assert_eq!(g, x[((n * 2 + c) * 3 + yy / 2) * 5 + xx / 2]);
        }
    }

    #[test]
    fn bad_shapes_wrong_devices_and_ids_are_typed_errors() {
        let d = dev();
        let t = |shape: &[usize]| put(&d, shape, DType::F32, &vec![0.5; shape.iter().product()]);
        let is_shape = |r: Result<Tensor>| matches!(r, Err(CoreError::Shape { .. }));
        assert!(is_shape(d.linear(&t(&[2, 3]), &t(&[4, 5]), None)));
        assert!(is_shape(d.linear(&t(&[2, 3]), &t(&[4, 3]), Some(&t(&[3])))));
        assert!(is_shape(d.matmul(&t(&[2, 3]), &t(&[4, 5]))));
        assert!(is_shape(d.matmul(&t(&[2, 2, 3]), &t(&[3, 3, 5]))));
        assert!(is_shape(d.matmul(&t(&[3]), &t(&[3, 5]))));
        assert!(is_shape(d.conv2d(
            &t(&[1, 2, 4, 4]),
            &t(&[3, 4, 3, 3]),
            None,
            Conv2dParams::new(1, 1)
        )));
        assert!(is_shape(d.conv2d(
            &t(&[1, 2, 2, 2]),
            &t(&[3, 2, 5, 5]),
            None,
            Conv2dParams::new(1, 0)
        )));
        assert!(is_shape(d.conv2d(
            &t(&[1, 2, 4, 4]),
            &t(&[3, 2, 3, 3]),
            None,
            Conv2dParams::new(0, 1)
        )));
        assert!(is_shape(d.group_norm(&t(&[1, 6, 2]), 4, None, None, 1e-5)));
        assert!(is_shape(d.layer_norm(
            &t(&[2, 3]),
            Some(&t(&[2])),
            None,
            1e-5
        )));
        assert!(is_shape(d.rms_norm(&t(&[]), None, 1e-5)));
        assert!(is_shape(d.binary(&t(&[2, 3]), &t(&[4]), BinaryOp::Add)));
        assert!(is_shape(d.reduce(&t(&[2, 3]), 2, ReduceOp::Sum)));
        assert!(is_shape(d.upsample_nearest2x(&t(&[2, 3]))));
        let (q, k) = (t(&[1, 2, 3, 4]), t(&[1, 2, 5, 4]));
        assert!(is_shape(d.attention(&q, &t(&[1, 2, 5, 3]), &k, None, 1.0)));
        assert!(is_shape(d.attention(&q, &k, &t(&[1, 2, 4, 4]), None, 1.0)));
        assert!(is_shape(d.attention(&q, &k, &k, Some(&t(&[3, 4])), 1.0)));
        assert!(is_shape(d.attention(
            &q,
            &k,
            &k,
            Some(&t(&[2, 2, 3, 5])),
            1.0
        )));
        assert!(is_shape(d.rope(
            &t(&[1, 1, 2, 3]),
            &t(&[2, 3]),
            &t(&[2, 3])
        )));
        assert!(is_shape(d.rope(
            &t(&[1, 1, 2, 4]),
            &t(&[3, 4]),
            &t(&[3, 4])
        )));
        assert!(is_shape(d.concat(&[&t(&[2, 3]), &t(&[3, 3])], 1)));
        assert!(is_shape(d.concat(&[], 0)));
        assert!(is_shape(d.narrow(&t(&[2, 3]), 1, 2, 2)));
        assert!(is_shape(d.narrow(&t(&[2, 3]), 1, usize::MAX, 2)));
        assert!(is_shape(d.permute(&t(&[2, 3]), &[0, 0])));
        assert!(is_shape(d.permute(&t(&[2, 3]), &[0, 1, 2])));
        assert!(is_shape(d.tensor_from_f32(&[2, 2], DType::F32, &[1.0; 3])));
        assert!(is_shape(d.cast(&t(&[2]), DType::Quantized)));
        // Absurd padding: an overflow is a shape error, a huge output a typed out-of-memory
        // (before any host scratch of that size is made).
        let (x, w) = (t(&[1, 2, 4, 4]), t(&[3, 2, 3, 3]));
        assert!(is_shape(d.conv2d(
            &x,
            &w,
            None,
            Conv2dParams::new(1, usize::MAX / 2)
        )));
        let err = d
            .conv2d(&x, &w, None, Conv2dParams::new(1, 1 << 20))
            .unwrap_err();
        assert!(matches!(err, CoreError::OutOfMemory { .. }), "{err}");
        // An id out of range.
        let err = d.embedding(&t(&[4, 2]), &[1, 4]).unwrap_err();
        assert!(
            matches!(&err, CoreError::Shape { message, .. } if message.contains("id 4")),
            "{err}"
        );

        // A tensor of another device, and a host tensor.
        let other = dev();
        let foreign = other
            .tensor_from_f32(&[2], DType::F32, &[1.0, 2.0])
            .unwrap();
        let err = d.unary(&foreign, UnaryOp::Relu).unwrap_err();
        assert!(matches!(err, CoreError::WrongDevice { .. }), "{err}");
        let err = d.binary(&t(&[2]), &foreign, BinaryOp::Add).unwrap_err();
        assert!(matches!(err, CoreError::WrongDevice { .. }), "{err}");
        let host = Tensor::from_f32(vec![2], DType::F32, &[1.0, 2.0]).unwrap();
        let err = d.affine(&host, 1.0, 0.0).unwrap_err();
        assert!(matches!(err, CoreError::WrongDevice { .. }), "{err}");
        assert!(d.to_f32_vec(&host).is_err());
    }

    /// The host backend computes on 8-bit float tensors by decoding them (exactly) to f32:
    /// a cast round trip gives the dtype's own encoding, and a linear over an fp8 weight
    /// equals the linear over that weight's decoded values.
    #[test]
    fn fp8_tensors_cast_exactly_and_compute_as_their_decoded_values() {
        let d = dev();
        let mut rng = SplitMix64::new(31);
        let values: Vec<f32> = random(&mut rng, 48).iter().map(|v| v * 300.0).collect();
        let x = put(&d, &[4, 12], DType::F32, &values);
        for dtype in [DType::F8E4M3, DType::F8E5M2] {
            let q = d.cast(&x, dtype).unwrap();
            assert_eq!((q.dtype(), q.nbytes()), (dtype, 48));
            let want = dtype
                .decode_f32(&dtype.encode_f32(&values).unwrap())
                .unwrap();
            assert_eq!(get(&d, &d.cast(&q, DType::F32).unwrap()), want, "{dtype}");
            let back = d.cast(&d.cast(&q, DType::BF16).unwrap(), dtype).unwrap();
            assert_eq!(get(&d, &back), want, "{dtype}: through bf16 and back");
            // A linear [3, 12] · [4, 12]^T with the fp8 tensor as the weight.
            let input = put(&d, &[3, 12], DType::F32, &random(&mut rng, 36));
            let decoded = put(&d, &[4, 12], DType::F32, &want);
            assert_eq!(
                get(&d, &d.linear(&input, &q, None).unwrap()),
                get(&d, &d.linear(&input, &decoded, None).unwrap()),
                "{dtype}"
            );
        }
    }

    /// A scaled fp8 weight (ComfyUI's scaled fp8, or `--dtype fp8_e4m3`) computes as its
    /// dequantized values `decode(byte) * scale`, rounded to the input's dtype, as CUDA's
    /// upcast into scratch stores them; casts dequantize; every other op refuses it.
    #[test]
    fn scaled_fp8_weights_compute_as_their_dequantized_values() {
        let d = dev();
        let mut rng = SplitMix64::new(32);
        let values: Vec<f32> = random(&mut rng, 48).iter().map(|v| v * 0.02).collect();
        for dtype in [DType::F8E4M3, DType::F8E5M2] {
            let (codes, scale) = dtype.quantize_scaled("w", &values).unwrap();
            let raw = put(&d, &[48], dtype, &dtype.decode_f32(&codes).unwrap());
            let q = raw
                .reshape(&[4, 12])
                .unwrap()
                .with_scale(Some(scale))
                .unwrap();
            assert_eq!(q.scale(), Some(scale));
            let dequant: Vec<f32> = dtype
                .decode_f32(&codes)
                .unwrap()
                .iter()
                .map(|v| v * scale)
                .collect();
            assert_eq!(
                get(&d, &d.cast(&q, DType::F32).unwrap()),
                dequant,
                "{dtype}"
            );
            for compute in [DType::F32, DType::BF16] {
                let rounded = compute
                    .decode_f32(&compute.encode_f32(&dequant).unwrap())
                    .unwrap();
                let x = d
                    .cast(
                        &put(&d, &[3, 12], DType::F32, &random(&mut rng, 36)),
                        compute,
                    )
                    .unwrap();
                let plain = put(&d, &[4, 12], compute, &rounded);
                let bias_codes = dtype
                    .quantize_scaled("b", &[0.5, -0.25, 0.125, 1.0])
                    .unwrap();
                let b = put(&d, &[4], dtype, &dtype.decode_f32(&bias_codes.0).unwrap())
                    .with_scale(Some(bias_codes.1))
                    .unwrap();
                let b_plain = put(
                    &d,
                    &[4],
                    compute,
                    &get(&d, &d.cast(&b, DType::F32).unwrap()),
                );
                assert_eq!(
                    get(&d, &d.linear(&x, &q, Some(&b)).unwrap()),
                    get(&d, &d.linear(&x, &plain, Some(&b_plain)).unwrap()),
                    "{dtype} into {compute}"
                );
            }
            // Scaling is not an unscaled fp8 value: an op that reads stored values refuses.
            let err = d.unary(&q, UnaryOp::Silu).unwrap_err();
            assert!(err.to_string().contains("scaled fp8"), "{err}");
            // A same-dtype cast keeps the bytes and the scale.
            assert_eq!(d.cast(&q, dtype).unwrap().scale(), Some(scale));
        }
    }

    #[test]
    fn outputs_are_accounted_and_freed() {
        let d = dev();
        let mut rng = SplitMix64::new(12);
        let x = put(&d, &[1, 2, 6, 6], DType::F32, &random(&mut rng, 72));
        let w = put(&d, &[3, 2, 3, 3], DType::F32, &random(&mut rng, 54));
        let before = d.memory_info().allocated;
        let y = d.conv2d(&x, &w, None, Conv2dParams::new(1, 1)).unwrap();
        assert_eq!(d.memory_info().allocated, before + y.nbytes() as u64);
        let outs = vec![
            d.upsample_nearest2x(&y).unwrap(),
            d.group_norm(&y, 3, None, None, 1e-6).unwrap(),
            d.unary(&y, UnaryOp::Silu).unwrap(),
            d.binary(&y, &x.reshape(&[2, 1, 6, 6]).unwrap(), BinaryOp::Add)
                .unwrap(),
            d.permute(&y, &[0, 2, 3, 1]).unwrap(),
            d.cast(&y, DType::BF16).unwrap(),
        ];
        assert!(d.memory_info().allocated > before);
        drop(outs);
        drop(y);
        assert_eq!(d.memory_info().allocated, before);
        // An op that fails for lack of memory leaves the accounting as it was.
        let tiny = HostDevice::with_capacity(64).unwrap();
        let t = tiny.tensor_from_f32(&[8], DType::F32, &[1.0; 8]).unwrap();
        let err = tiny
            .upsample_nearest2x(&t.reshape(&[1, 1, 2, 4]).unwrap())
            .unwrap_err();
        assert!(matches!(err, CoreError::OutOfMemory { .. }), "{err}");
        assert_eq!(tiny.memory_info().allocated, 32);
    }

    #[test]
    fn ops_run_after_copies_ordered_on_the_compute_stream() {
        let d = HostDevice::new(HostDeviceConfig {
            link_bytes_per_sec: Some(2_000.0), // 64 B take 32 ms
            ..HostDeviceConfig::default()
        })
        .unwrap();
        let copy = d.create_stream().unwrap();
        let src = d.alloc_pinned(64).unwrap();
        let values: Vec<f32> = (0..16).map(|i| i as f32).collect();
        let bytes = DType::F32.encode_f32(&values).unwrap();
        src.with_bytes_mut(|b| b.copy_from_slice(&bytes)).unwrap();
        let dst = d.alloc(64).unwrap();
        d.copy_h2d(&src.slice_all(), &dst.slice_all(), &copy)
            .unwrap();
        let done = d.record_event(&copy).unwrap();
        d.wait_event(&d.compute_stream(), &done).unwrap();
        let t = Tensor::new(vec![16], DType::F32, TensorStorage::Device(dst.slice_all())).unwrap();
        let y = d.affine(&t, 2.0, 1.0).unwrap();
        let want: Vec<f32> = values.iter().map(|v| v * 2.0 + 1.0).collect();
        assert_eq!(get(&d, &y), want);
    }

    #[test]
    fn exclusive_device_buffers_are_detected() {
        let d = dev();
        let mut x = put(&d, &[2, 4], DType::F32, &[1.0; 8]);
        assert!(x.has_exclusive_device_buffer(), "a fresh upload");
        let mut y = d.unary(&x, UnaryOp::Exp).unwrap();
        assert!(y.has_exclusive_device_buffer(), "a fresh op output");

        let mut c = y.clone();
        assert!(!y.has_exclusive_device_buffer(), "the original of a clone");
        assert!(!c.has_exclusive_device_buffer(), "a clone");
        drop(c);
        assert!(y.has_exclusive_device_buffer(), "after the clone is gone");

        let mut v = x.reshape(&[8]).unwrap();
        assert!(!x.has_exclusive_device_buffer(), "viewed by a reshape");
        assert!(!v.has_exclusive_device_buffer(), "a reshape view");
        drop(x);
        assert!(v.has_exclusive_device_buffer(), "the view alone");

        // A view of part of a buffer, even as its only handle.
        let buffer = d.alloc(64).unwrap();
        let mut part = Tensor::new(
            vec![4],
            DType::F32,
            TensorStorage::Device(buffer.slice(16, 16).unwrap()),
        )
        .unwrap();
        drop(buffer);
        assert!(!part.has_exclusive_device_buffer(), "part of a buffer");
        let buffer = d.alloc(16).unwrap();
        let mut whole = Tensor::new(
            vec![4],
            DType::F32,
            TensorStorage::Device(buffer.slice_all()),
        )
        .unwrap();
        assert!(
            !whole.has_exclusive_device_buffer(),
            "the buffer is still held"
        );
        drop(buffer);
        assert!(
            whole.has_exclusive_device_buffer(),
            "all of a buffer, alone"
        );

        let mut host = Tensor::from_f32(vec![2], DType::F32, &[1.0, 2.0]).unwrap();
        assert!(!host.has_exclusive_device_buffer(), "a host tensor");
    }
}
