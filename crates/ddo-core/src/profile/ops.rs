//! [`ProfiledOps`]: the [`Ops`] a backend hands out, each op of the backend's own run
//! through the [`OpProfiler`] with its class, bytes and flops.

use std::fmt::{self, Debug};
use std::sync::Weak;

use super::{
    FlopCount, GemmShape, OpOutput, OpProfiler, attention_flops, conv2d_flops, linear_flops,
    matmul_flops, no_flops, tensor_bytes,
};
use crate::device::Device;
use crate::ops::{BinaryOp, Conv2dParams, Ops, ReduceOp, UnaryOp};
use crate::{CoreError, DType, Result, Tensor};

/// A device with a compute plane: what [`ProfiledOps`] runs ops on.
pub trait ComputeDevice: Device + Ops {}
impl<T: Device + Ops> ComputeDevice for T {}

/// The [`Ops`] a backend hands out from [`Device::ops`]: the backend's own ops (its `Ops`
/// impl), each run through the [`OpProfiler`] this holds. It refers to its device weakly
/// (the device owns it), so a backend builds it with `Arc::new_cyclic`.
pub struct ProfiledOps {
    device: Weak<dyn ComputeDevice>,
    profiler: OpProfiler,
}

impl Debug for ProfiledOps {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProfiledOps")
            .field("profiler", &self.profiler)
            .finish()
    }
}

/// Optional tensors as a list (for [`tensor_bytes`]).
fn some<'a>(ts: &[Option<&'a Tensor>]) -> Vec<&'a Tensor> {
    ts.iter().flatten().copied().collect()
}

impl ProfiledOps {
    /// The ops of `device`, profiled.
    pub fn new(device: Weak<dyn ComputeDevice>) -> Self {
        Self {
            device,
            profiler: OpProfiler::new(),
        }
    }

    /// The profiler ([`Device::begin_op_profile`] and [`Device::end_op_profile`] use it).
    pub fn profiler(&self) -> &OpProfiler {
        &self.profiler
    }

    fn device(&self) -> Result<std::sync::Arc<dyn ComputeDevice>> {
        self.device.upgrade().ok_or_else(|| CoreError::Backend {
            device: "dropped".into(),
            message: "the device of these ops has been dropped".into(),
        })
    }

    fn op<T: OpOutput>(
        &self,
        op: &str,
        variant: Option<&dyn Debug>,
        in_bytes: impl FnOnce() -> u64,
        flops: FlopCount<'_>,
        f: impl FnOnce(&dyn ComputeDevice) -> Result<T>,
    ) -> Result<T> {
        let dev = self.device()?;
        let d: &dyn ComputeDevice = &*dev;
        self.profiler
            .run(d, op, variant, None, in_bytes, flops, || f(d))
    }

    /// [`Self::op`] for a linear of `xs` (side by side on the last dim), `w [n, k]` and
    /// `bias`, reading `extra_bytes` more (an accumulator): noted for the compute floor, its
    /// bytes and flops counted (only while a profile is active), and timed by shape too.
    fn linear_op(
        &self,
        op: &str,
        xs: &[&Tensor],
        w: &Tensor,
        bias: Option<&Tensor>,
        extra_bytes: u64,
        f: impl FnOnce(&dyn ComputeDevice) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let shape = match (xs.first(), w.shape()) {
            (Some(x), &[n, k]) => self.profiler.note_linear(x, w).map(|s| GemmShape {
                rows: x.numel() / x.shape().last().copied().unwrap_or(1).max(1),
                k,
                n,
                ..s
            }),
            _ => None,
        };
        let dev = self.device()?;
        let d: &dyn ComputeDevice = &*dev;
        self.profiler.run(
            d,
            op,
            None,
            shape,
            || tensor_bytes(&[xs, &[w][..], &some(&[bias])].concat()) + extra_bytes,
            &|_| linear_flops(xs, w),
            || f(d),
        )
    }

    /// [`Self::op`] for an attention call (either output order): counted as `attention`,
    /// its inputs' bytes and its two GEMMs' flops.
    fn attention_op(
        &self,
        [q, k, v]: [&Tensor; 3],
        mask: Option<&Tensor>,
        f: impl FnOnce(&dyn ComputeDevice) -> Result<Tensor>,
    ) -> Result<Tensor> {
        self.op(
            "attention",
            None,
            || tensor_bytes(&[&[q, k, v][..], &some(&[mask])].concat()),
            &|out| attention_flops(q, k, out),
            f,
        )
    }
}

impl Ops for ProfiledOps {
    fn tensor_from_f32(&self, shape: &[usize], dtype: DType, values: &[f32]) -> Result<Tensor> {
        self.device()?.tensor_from_f32(shape, dtype, values)
    }

    fn to_f32_vec(&self, x: &Tensor) -> Result<Vec<f32>> {
        self.device()?.to_f32_vec(x)
    }

    /// The backend's own count (not profiled: it reads a scalar back, as `to_f32_vec`
    /// reads values).
    fn count_non_finite(&self, x: &Tensor) -> Result<u64> {
        self.device()?.count_non_finite(x)
    }

    fn linear(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        self.linear_op("linear", &[x], w, bias, 0, |d| d.linear(x, w, bias))
    }

    fn linear_concat(&self, xs: &[&Tensor], w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        self.linear_op("linear", xs, w, bias, 0, |d| d.linear_concat(xs, w, bias))
    }

    fn matmul(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        self.op(
            "matmul",
            None,
            || tensor_bytes(&[a, b]),
            &|out| matmul_flops(a, out),
            |d| d.matmul(a, b),
        )
    }

    fn conv2d(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        params: Conv2dParams,
    ) -> Result<Tensor> {
        self.op(
            "conv2d",
            None,
            || tensor_bytes(&[&[x, w][..], &some(&[bias])].concat()),
            &|out| conv2d_flops(w, out),
            |d| d.conv2d(x, w, bias, params),
        )
    }

    fn group_norm(
        &self,
        x: &Tensor,
        groups: usize,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor> {
        self.op(
            "group_norm",
            None,
            || tensor_bytes(&[&[x][..], &some(&[weight, bias])].concat()),
            &no_flops,
            |d| d.group_norm(x, groups, weight, bias, eps),
        )
    }

    /// A class of its own, `group_norm_silu`, with group norm's bytes (the input, the
    /// affine and the output; none of an intermediate a backend's composition may make).
    fn group_norm_silu(
        &self,
        x: &Tensor,
        groups: usize,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor> {
        self.op(
            "group_norm_silu",
            None,
            || tensor_bytes(&[&[x][..], &some(&[weight, bias])].concat()),
            &no_flops,
            |d| d.group_norm_silu(x, groups, weight, bias, eps),
        )
    }

    fn layer_norm(
        &self,
        x: &Tensor,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor> {
        self.op(
            "layer_norm",
            None,
            || tensor_bytes(&[&[x][..], &some(&[weight, bias])].concat()),
            &no_flops,
            |d| d.layer_norm(x, weight, bias, eps),
        )
    }

    fn rms_norm(&self, x: &Tensor, weight: Option<&Tensor>, eps: f32) -> Result<Tensor> {
        self.op(
            "rms_norm",
            None,
            || tensor_bytes(&[&[x][..], &some(&[weight])].concat()),
            &no_flops,
            |d| d.rms_norm(x, weight, eps),
        )
    }

    fn unary(&self, x: &Tensor, op: UnaryOp) -> Result<Tensor> {
        self.op(
            "unary",
            Some(&op),
            || tensor_bytes(&[x]),
            &no_flops,
            |d| d.unary(x, op),
        )
    }

    fn unary_owned(&self, x: Tensor, op: UnaryOp) -> Result<Tensor> {
        let bytes = x.nbytes() as u64;
        self.op(
            "unary",
            Some(&op),
            || bytes,
            &no_flops,
            |d| d.unary_owned(x, op),
        )
    }

    fn binary(&self, a: &Tensor, b: &Tensor, op: BinaryOp) -> Result<Tensor> {
        self.op(
            "binary",
            Some(&op),
            || tensor_bytes(&[a, b]),
            &no_flops,
            |d| d.binary(a, b, op),
        )
    }

    fn affine(&self, x: &Tensor, mul: f32, add: f32) -> Result<Tensor> {
        self.op(
            "affine",
            None,
            || tensor_bytes(&[x]),
            &no_flops,
            |d| d.affine(x, mul, add),
        )
    }

    fn softmax(&self, x: &Tensor) -> Result<Tensor> {
        self.op(
            "softmax",
            None,
            || tensor_bytes(&[x]),
            &no_flops,
            |d| d.softmax(x),
        )
    }

    fn reduce(&self, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        self.op(
            "reduce",
            Some(&op),
            || tensor_bytes(&[x]),
            &no_flops,
            |d| d.reduce(x, dim, op),
        )
    }

    fn upsample_nearest2x(&self, x: &Tensor) -> Result<Tensor> {
        self.op(
            "upsample_nearest2x",
            None,
            || tensor_bytes(&[x]),
            &no_flops,
            |d| d.upsample_nearest2x(x),
        )
    }

    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        scale: f32,
    ) -> Result<Tensor> {
        self.attention_op([q, k, v], mask, |d| d.attention(q, k, v, mask, scale))
    }

    fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        self.op(
            "rope",
            None,
            || tensor_bytes(&[x, cos, sin]),
            &no_flops,
            |d| d.rope(x, cos, sin),
        )
    }

    fn concat(&self, xs: &[&Tensor], dim: usize) -> Result<Tensor> {
        self.op(
            "concat",
            None,
            || tensor_bytes(xs),
            &no_flops,
            |d| d.concat(xs, dim),
        )
    }

    /// A view or a copy of the narrowed part: the bytes counted are the output's.
    fn narrow(&self, x: &Tensor, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        self.op(
            "narrow",
            None,
            || 0,
            &no_flops,
            |d| d.narrow(x, dim, start, len),
        )
    }

    fn permute(&self, x: &Tensor, dims: &[usize]) -> Result<Tensor> {
        self.op(
            "permute",
            None,
            || tensor_bytes(&[x]),
            &no_flops,
            |d| d.permute(x, dims),
        )
    }

    fn cast(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        self.op(
            "cast",
            None,
            || tensor_bytes(&[x]),
            &no_flops,
            |d| d.cast(x, dtype),
        )
    }

    /// The bytes counted are the output's (the table is read only where `ids` point).
    fn embedding(&self, table: &Tensor, ids: &[u32]) -> Result<Tensor> {
        self.op(
            "embedding",
            None,
            || 0,
            &no_flops,
            |d| d.embedding(table, ids),
        )
    }

    /// A class of its own, with the linear's flops (the activation's are not counted).
    fn linear_accumulate(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        acc: Tensor,
        gelu_tanh: bool,
    ) -> Result<Tensor> {
        let acc_bytes = acc.nbytes() as u64;
        self.linear_op("linear_accumulate", &[x], w, bias, acc_bytes, |d| {
            d.linear_accumulate(x, w, bias, acc, gelu_tanh)
        })
    }

    fn dequantize(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        self.op(
            "dequantize",
            None,
            || tensor_bytes(&[x]),
            &no_flops,
            |d| d.dequantize(x, dtype),
        )
    }

    fn linear_gelu_tanh(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        self.linear_op("linear_gelu_tanh", &[x], w, bias, 0, |d| {
            d.linear_gelu_tanh(x, w, bias)
        })
    }

    fn layer_norm_modulate(
        &self,
        x: &Tensor,
        eps: f32,
        scale: &Tensor,
        shift: &Tensor,
    ) -> Result<Tensor> {
        self.op(
            "layer_norm_modulate",
            None,
            || tensor_bytes(&[x, scale, shift]),
            &no_flops,
            |d| d.layer_norm_modulate(x, eps, scale, shift),
        )
    }

    /// A class of its own, with the linear's flops.
    fn linear_fp8(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        self.linear_op("linear_fp8", &[x], w, bias, 0, |d| d.linear_fp8(x, w, bias))
    }

    /// [`Ops::linear_fp8`]'s class, with the linear's flops.
    fn linear_fp8_concat(
        &self,
        xs: &[&Tensor],
        w: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        self.linear_op("linear_fp8", xs, w, bias, 0, |d| {
            d.linear_fp8_concat(xs, w, bias)
        })
    }

    /// A class of its own, with the linear's flops (the activation's are not counted).
    fn linear_fp8_gelu_tanh(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        self.linear_op("linear_fp8_gelu_tanh", &[x], w, bias, 0, |d| {
            d.linear_fp8_gelu_tanh(x, w, bias)
        })
    }

    /// Not an op of the forward: passed on untimed.
    fn end_forward(&self) -> Result<()> {
        self.device()?.end_forward()
    }

    fn fp8_tensor_cores(&self) -> bool {
        self.device().is_ok_and(|d| d.fp8_tensor_cores())
    }

    fn fp8_reference_reason(&self) -> String {
        self.device()
            .map_or_else(|e| e.to_string(), |d| d.fp8_reference_reason())
    }

    fn best_gemm_seconds(&self, shape: &GemmShape, calls: usize) -> Result<Option<f64>> {
        self.device()?.best_gemm_seconds(shape, calls)
    }

    fn gated_add(&self, x: &Tensor, gate: &Tensor, y: &Tensor) -> Result<Tensor> {
        self.op(
            "gated_add",
            None,
            || tensor_bytes(&[x, gate, y]),
            &no_flops,
            |d| d.gated_add(x, gate, y),
        )
    }

    /// One class, its bytes counting both outputs.
    fn gated_add_layer_norm_modulate(
        &self,
        x: &Tensor,
        gate: &Tensor,
        y: &Tensor,
        eps: f32,
        scale: &Tensor,
        shift: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        self.op(
            "gated_add_layer_norm_modulate",
            None,
            || tensor_bytes(&[x, gate, y, scale, shift]),
            &no_flops,
            |d| d.gated_add_layer_norm_modulate(x, gate, y, eps, scale, shift),
        )
    }

    fn attention_input(
        &self,
        part: &crate::ops::AttentionInput<'_>,
        dst: Option<Tensor>,
    ) -> Result<Tensor> {
        let mut ins = vec![part.x];
        ins.extend(part.norm.map(|(w, _)| w));
        ins.extend(part.rope.map(|(c, _)| c));
        ins.extend(part.rope.map(|(_, s)| s));
        self.op(
            "attention_input",
            None,
            || tensor_bytes(&ins),
            &no_flops,
            |d| d.attention_input(part, dst),
        )
    }

    fn attention_tokens(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        scale: f32,
    ) -> Result<Tensor> {
        // Counted as attention: the same work, its output written in another order.
        self.attention_op([q, k, v], mask, |d| {
            d.attention_tokens(q, k, v, mask, scale)
        })
    }
}
