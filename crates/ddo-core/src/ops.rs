//! The compute plane: the [`Ops`] trait, beside [`Device`](crate::Device).
//!
//! Every op takes dense, contiguous, row-major tensors on the op's device and returns a new
//! tensor on that device (an allocation counted by the device, so activations show in its
//! peak). Ops compute in f32 and store the result in the dtype of their first input unless
//! they say otherwise; f16/bf16 results are rounded once, at the end of the op (as PyTorch
//! does per op). Shapes are checked: a mismatch is [`CoreError::Shape`](crate::CoreError),
//! never a panic.
//!
//! Layout conventions: images are NCHW; attention tensors are `[batch, heads, seq, head_dim]`;
//! linear weights are `[out, in]` (PyTorch's); convolution weights are `[out, in, kh, kw]`.
//! Broadcasting in binary ops follows NumPy (shapes aligned on the right, size-1 dims
//! stretch).

use crate::dtype::DType;
use crate::error::{CoreError, Result};
use crate::tensor::Tensor;

/// Element-wise functions of one tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    /// `x * sigmoid(x)`.
    Silu,
    /// GELU, tanh approximation (`gelu_new`, Diffusers' `gelu-approximate`).
    GeluTanh,
    /// GELU, exact (erf).
    GeluErf,
    /// CLIP's `quick_gelu`: `x * sigmoid(1.702 x)`.
    QuickGelu,
    /// Logistic sigmoid.
    Sigmoid,
    /// Hyperbolic tangent.
    Tanh,
    /// `max(x, 0)`.
    Relu,
    /// `exp(x)`.
    Exp,
    /// `-x`.
    Neg,
    /// `x * x`.
    Square,
    /// `sqrt(x)`.
    Sqrt,
    /// `1 / x`.
    Recip,
}

/// Element-wise functions of two tensors (with broadcasting).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    /// `a + b`.
    Add,
    /// `a - b`.
    Sub,
    /// `a * b`.
    Mul,
    /// `a / b`.
    Div,
    /// `max(a, b)`.
    Max,
    /// `min(a, b)`.
    Min,
}

/// Stride and padding of a 2-D convolution (same along both axes unless given per axis).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Conv2dParams {
    /// Stride (height, width).
    pub stride: (usize, usize),
    /// Zero padding (height, width), on both sides.
    pub padding: (usize, usize),
}

impl Conv2dParams {
    /// Square stride and padding.
    pub const fn new(stride: usize, padding: usize) -> Self {
        Self {
            stride: (stride, stride),
            padding: (padding, padding),
        }
    }
}

/// Reductions along one dimension.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Mean.
    Mean,
    /// Maximum.
    Max,
}

/// The compute plane of a device. Implemented by the host backend (`HostDevice`) and, later,
/// by the CUDA backend, so models run unchanged on either.
pub trait Ops: Send + Sync {
    /// A device tensor holding `values` (encoded as `dtype`), shape `shape`.
    fn tensor_from_f32(&self, shape: &[usize], dtype: DType, values: &[f32]) -> Result<Tensor>;

    /// The values of a tensor as f32 (waits for pending work on the compute stream).
    fn to_f32_vec(&self, x: &Tensor) -> Result<Vec<f32>>;

    /// `x [..., in] · wᵀ (+ bias)` with `w [out, in]`, `bias [out]` → `[..., out]`.
    fn linear(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor>;

    /// `linear(concat(xs, last dim), w, bias)` without materialising the concatenation:
    /// `xs[i] [..., in_i]` (same leading dims) against the column window of `w [out, Σ in_i]`
    /// that lines up with part `i`. A backend may sum the parts' products in the output
    /// dtype (one rounding per part), so values may differ from [`Ops::linear`] of the
    /// concatenation by that rounding; the host backend computes it exactly as that.
    fn linear_concat(&self, xs: &[&Tensor], w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        linear_concat_by_concat(self, xs, w, bias)
    }

    /// Batched matrix product `a [..., m, k] · b [..., k, n]` → `[..., m, n]`; batch dims
    /// broadcast.
    fn matmul(&self, a: &Tensor, b: &Tensor) -> Result<Tensor>;

    /// 2-D convolution of `x [n, c, h, w]` with `w [o, c, kh, kw]` (+ `bias [o]`).
    fn conv2d(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        params: Conv2dParams,
    ) -> Result<Tensor>;

    /// Group normalisation of `x [n, c, ...]` in `groups` groups, with optional per-channel
    /// affine `weight [c]`, `bias [c]`.
    fn group_norm(
        &self,
        x: &Tensor,
        groups: usize,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor>;

    /// [`Ops::group_norm`] followed by SiLU (`x * sigmoid(x)`) as one op, same arguments and
    /// the same shape checks and errors: what a VAE decoder's resnets and output norm do to
    /// every feature map. A backend may fuse the two (one pass writing the activated values,
    /// no intermediate tensor, one rounding into the output dtype instead of two), so its
    /// values may differ from the composition by that rounding. The default is the
    /// composition itself, [`Ops::group_norm`] then [`Ops::unary`] with [`UnaryOp::Silu`]
    /// (the host backend's values, bit for bit, and its intermediate allocation); wrappers of
    /// another backend's ops forward it to that backend's.
    fn group_norm_silu(
        &self,
        x: &Tensor,
        groups: usize,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor> {
        let normed = self.group_norm(x, groups, weight, bias, eps)?;
        self.unary(&normed, UnaryOp::Silu)
    }

    /// Layer normalisation over the last dimension, optional affine `[d]`.
    fn layer_norm(
        &self,
        x: &Tensor,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor>;

    /// RMS normalisation over the last dimension (`x / sqrt(mean(x²) + eps) * weight`).
    fn rms_norm(&self, x: &Tensor, weight: Option<&Tensor>, eps: f32) -> Result<Tensor>;

    /// An element-wise function.
    fn unary(&self, x: &Tensor, op: UnaryOp) -> Result<Tensor>;

    /// [`Ops::unary`] consuming `x`: a backend may write the result over `x`'s memory when
    /// nothing else holds it, so the call needs no second buffer the size of `x` (an
    /// activation after a wide projection is the largest tensor of a transformer block).
    /// The values are those of [`Ops::unary`].
    fn unary_owned(&self, x: Tensor, op: UnaryOp) -> Result<Tensor> {
        self.unary(&x, op)
    }

    /// An element-wise function of two tensors, broadcasting.
    fn binary(&self, a: &Tensor, b: &Tensor, op: BinaryOp) -> Result<Tensor>;

    /// `x * mul + add` with scalars.
    fn affine(&self, x: &Tensor, mul: f32, add: f32) -> Result<Tensor>;

    /// Softmax over the last dimension.
    fn softmax(&self, x: &Tensor) -> Result<Tensor>;

    /// Reduction over dimension `dim`, kept as size 1.
    fn reduce(&self, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor>;

    /// Nearest-neighbour 2× upsampling of `x [n, c, h, w]` → `[n, c, 2h, 2w]`.
    fn upsample_nearest2x(&self, x: &Tensor) -> Result<Tensor>;

    /// Scaled dot-product attention: `softmax(q kᵀ · scale + mask) v` with
    /// `q [b, h, lq, d]`, `k, v [b, h, lk, d]` and an optional additive `mask`
    /// broadcastable to `[b, h, lq, lk]`. Implementations must not need the full score
    /// matrix of long sequences at once.
    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        scale: f32,
    ) -> Result<Tensor>;

    /// Rotary embedding on interleaved pairs, as Diffusers' `apply_rotary_emb` with
    /// `use_real=True, use_real_unbind_dim=-1`: for `x [b, h, l, d]` and `cos, sin [l, d]`,
    /// `out = x * cos + rot(x) * sin` where `rot` maps each pair `(x0, x1)` to `(-x1, x0)`.
    fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor>;

    /// Concatenation along `dim`.
    fn concat(&self, xs: &[&Tensor], dim: usize) -> Result<Tensor>;

    /// The slice `start..start + len` along `dim`, as a new tensor.
    fn narrow(&self, x: &Tensor, dim: usize, start: usize, len: usize) -> Result<Tensor>;

    /// Permutation of dimensions, materialised (`dims[i]` is the source dim of output dim `i`).
    fn permute(&self, x: &Tensor, dims: &[usize]) -> Result<Tensor>;

    /// Conversion to `dtype`.
    fn cast(&self, x: &Tensor, dtype: DType) -> Result<Tensor>;

    /// Rows `ids` of `table [rows, d]` → `[ids.len(), d]`.
    fn embedding(&self, table: &Tensor, ids: &[u32]) -> Result<Tensor>;

    /// `gelu_tanh(linear(x, w, bias))`: a linear followed by the tanh-approximation GELU
    /// ([`UnaryOp::GeluTanh`]), as the first projection of a `gelu-approximate`
    /// FeedForward. The default is exactly that composition ([`Ops::linear`], then
    /// [`Ops::unary_owned`]), so a backend without a fused path gives its values bit for
    /// bit; a fused backend (CUDA: cuBLASLt's GELU epilogue) rounds once, after the
    /// activation, where the composition rounds after the linear and again after the GELU.
    fn linear_gelu_tanh(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let y = self.linear(x, w, bias)?;
        self.unary_owned(y, UnaryOp::GeluTanh)
    }

    /// `layer_norm(x, None, None, eps) * (1 + scale) + shift` — a layer norm without affine
    /// params followed by an AdaLN modulation, with `scale` and `shift` broadcast over `x`
    /// (NumPy rules; in DiT blocks `[b, 1, d]` over `x [b, t, d]`, or `[d]`). The result has
    /// `x`'s dtype and the broadcast shape. The default is exactly
    /// [`layer_norm_modulate_composed`] ([`Ops::layer_norm`], [`Ops::affine`] of `scale`,
    /// [`Ops::binary`] `Mul` then `Add`, each rounded into its dtype); a fused backend
    /// (CUDA, for `scale`/`shift` of one row per group of rows) computes it in f32 and
    /// rounds once.
    fn layer_norm_modulate(
        &self,
        x: &Tensor,
        eps: f32,
        scale: &Tensor,
        shift: &Tensor,
    ) -> Result<Tensor> {
        layer_norm_modulate_composed(self, x, eps, scale, shift)
    }

    /// The number of NaN and ±Inf elements of `x` (f32, f16 or bf16; the host backend also
    /// reads the 8-bit floats): one reduction over the whole tensor, read back as one
    /// integer, so it waits for the work queued on the compute stream before it, as
    /// [`Ops::to_f32_vec`] does, and for nothing else. A pipeline checks its latents after
    /// each step and its decoded image with it ([`check_finite`]). The default downloads
    /// the values ([`Ops::to_f32_vec`]) and counts them on the host; both backends count on
    /// the device (CUDA: one kernel pass and an 8-byte read).
    fn count_non_finite(&self, x: &Tensor) -> Result<u64> {
        let values = self.to_f32_vec(x)?;
        Ok(values.iter().filter(|v| !v.is_finite()).count() as u64)
    }

    /// [`Ops::count_non_finite`] queued on the compute stream, with the count's copy into
    /// `dst` (at least 8 bytes of pinned host memory; the count lands as a little-endian
    /// `u64` in its first 8), returning without waiting: `dst` holds the count once an event
    /// recorded on the compute stream after this call has completed
    /// ([`crate::finite::DeferredFiniteChecks`]). The default counts at once and writes
    /// `dst` before it returns; CUDA queues its two kernels and an asynchronous copy.
    fn queue_count_non_finite(&self, x: &Tensor, dst: &crate::HostSlice) -> Result<()> {
        let count = self.count_non_finite(x)?;
        crate::finite::write_count(dst, count)
    }

    /// `acc + linear(x, w, bias)`, then the tanh-approximation GELU where `gelu_tanh`: a
    /// linear whose output starts from `acc` (`x`'s leading dims with `out` last) — the
    /// base linear of a leaf with run-time LoRA adapters, `acc` holding their up-projections
    /// ([`crate::adapter`]), or an adapter's up-projection added into another's. `acc` is
    /// taken by value so a backend may write into its bytes when nothing else holds it.
    /// The default is exactly [`Ops::linear`], [`Ops::binary`] `Add` (`acc` first: its
    /// dtype), then [`Ops::unary_owned`] `GeluTanh`, each rounded; the CUDA backend runs one
    /// GEMM with `beta = 1` into `acc` (cuBLASLt, the bias and the GELU in its epilogue, for
    /// 16-bit operands of one dtype), rounding once.
    fn linear_accumulate(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        acc: Tensor,
        gelu_tanh: bool,
    ) -> Result<Tensor> {
        let y = self.linear(x, w, bias)?;
        let y = self.binary(&acc, &y, BinaryOp::Add)?;
        if gelu_tanh {
            self.unary_owned(y, UnaryOp::GeluTanh)
        } else {
            Ok(y)
        }
    }

    /// The values of a quantized weight — a [`DType::Quantized`] tensor carrying a
    /// [`QuantLayout`](crate::QuantLayout) (GGUF blocks, streamed as stored) — as a tensor
    /// of the layout's shape in `dtype` (f32, f16 or bf16): each block dequantized in f32
    /// exactly as [`crate::gguf::dequantize`] (gguf-py's reference) computes it, then rounded
    /// once. A tensor without a layout is a shape error. The default refuses: a backend
    /// that runs quantized weights implements it (the host and CUDA backends do).
    fn dequantize(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        Err(CoreError::Shape {
            what: "dequantize".into(),
            message: format!(
                "this backend does not dequantize GGUF blocks ({:?} of {} into {dtype})",
                x.shape(),
                x.dtype()
            ),
        })
    }

    /// `linear` computed in fp8 (`--compute fp8`): `x` quantized per tensor to E4M3 with a
    /// scale found from its amax, `w` a 2-D E4M3 weight (its per-tensor scale, if any,
    /// applied to the sum), the products summed in f32, plus `bias`, rounded once into `x`'s
    /// dtype; [`crate::fp8_compute`] is the recipe. An input holding a NaN or an Inf is
    /// [`CoreError::NonFiniteActivation`]. The default is the reference
    /// ([`crate::fp8_compute::linear_fp8_reference`]: through the host); a backend with fp8
    /// tensor cores overrides it and says so in [`Ops::fp8_tensor_cores`].
    fn linear_fp8(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        crate::fp8_compute::linear_fp8_reference(self, x, w, bias)
    }

    /// [`Ops::linear_fp8`] of `xs` side by side on the last dim (Flux's single blocks feed
    /// `proj_out` the attention output and the MLP activation): one activation, one scale.
    /// The default concatenates them ([`Ops::concat`]) and calls [`Ops::linear_fp8`]; a
    /// backend may write the parts' codes side by side instead, with the same values.
    fn linear_fp8_concat(
        &self,
        xs: &[&Tensor],
        w: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        crate::fp8_compute::linear_fp8_of_concat(self, xs, w, bias)
    }

    /// The end of one forward of a component ([`crate::Component::run`] calls it, after
    /// the body, whether it succeeded or not): a backend drops what it kept for the rest of
    /// the forward (the fp8 codes of an activation that several linears read). The default
    /// keeps nothing and does nothing.
    fn end_forward(&self) -> Result<()> {
        Ok(())
    }

    /// `gelu_tanh(linear_fp8(x, w, bias))`, so a backend can apply the activation in the fp8
    /// GEMM's epilogue. The default is exactly [`Ops::linear_fp8`] then [`Ops::unary_owned`]
    /// `GeluTanh`.
    fn linear_fp8_gelu_tanh(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        let y = self.linear_fp8(x, w, bias)?;
        self.unary_owned(y, UnaryOp::GeluTanh)
    }

    /// Whether [`Ops::linear_fp8`] runs on fp8 tensor cores; `false`: the reference
    /// implementation runs (the host backend, a GPU without fp8 support).
    fn fp8_tensor_cores(&self) -> bool {
        false
    }

    /// Why [`Ops::linear_fp8`] runs the reference here when [`Ops::fp8_tensor_cores`] is
    /// false, as a phrase for the run's note and the bench (a GPU says what it lacks, or
    /// what its check of the fp8 GEMM found). The default: the backend has no fp8 tensor
    /// cores.
    fn fp8_reference_reason(&self) -> String {
        "this backend has no fp8 tensor cores".into()
    }

    /// The fastest the backend's GEMM library runs [`Ops::linear`] at `shape`, in seconds a
    /// call over `calls` calls, where it can search its algorithms (`ddo bench`'s compute
    /// floor: the CUDA backend times the first eight of cuBLASLt's heuristic). `None`: the
    /// backend's own `linear` is the best it has (the default).
    fn best_gemm_seconds(
        &self,
        shape: &crate::profile::GemmShape,
        calls: usize,
    ) -> Result<Option<f64>> {
        let _ = (shape, calls);
        Ok(None)
    }

    /// `x + gate * y`, broadcasting (NumPy rules; a DiT block's gated residual: `gate`
    /// `[b, 1, d]` over `x, y [b, t, d]`). The result has `x`'s dtype. The default is exactly
    /// [`gated_add_composed`] ([`Ops::binary`] `Mul`, rounded into `gate`'s dtype, then
    /// `Add`); a fused backend (CUDA, for `y` of `x`'s shape and `gate` of one row per
    /// group of rows) computes it in f32 and rounds once.
    fn gated_add(&self, x: &Tensor, gate: &Tensor, y: &Tensor) -> Result<Tensor> {
        gated_add_composed(self, x, gate, y)
    }

    /// A DiT block's gated residual and the AdaLN-modulated layer norm that reads it, in
    /// one op: `r = x + gate * y` ([`Ops::gated_add`]) and
    /// `layer_norm_modulate(r, eps, scale, shift)` ([`Ops::layer_norm_modulate`]), returned
    /// as `(r, normed)`. The default is exactly those two ops, so their bytes; a fused
    /// backend (CUDA) writes both in one pass over the rows, computing each as its own op
    /// does (the norm reads `r` as stored, rounded into its dtype), and saves reading `r`
    /// back.
    fn gated_add_layer_norm_modulate(
        &self,
        x: &Tensor,
        gate: &Tensor,
        y: &Tensor,
        eps: f32,
        scale: &Tensor,
        shift: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let r = self.gated_add(x, gate, y)?;
        let normed = self.layer_norm_modulate(&r, eps, scale, shift)?;
        Ok((r, normed))
    }

    /// One part of attention's input in one pass: `part.x [b, l, heads·d]` (a projection's
    /// output) viewed as heads, RMS-normed per head where `part.norm` is given, moved to
    /// `[b, heads, ·, d]` at rows `part.start..part.start + l` of `dst` (`[b, heads, total,
    /// d]`, taken by value so a backend may write into its bytes, and returned with those
    /// rows written), then rotated ([`Ops::rope`]'s pairs) with the tables' rows of those
    /// positions where `part.rope` is given. `dst: None` makes a new one: its other rows are
    /// zero by the default and unspecified on a backend that writes in place, until a later
    /// part writes them. A joint attention calls it once per stream, in place of
    /// `rms_norm`, `concat`, `permute` and `rope`. The default is exactly
    /// [`attention_input_composed`] (those ops, each rounded), so a fused backend that
    /// rounds where they do gives their bytes.
    fn attention_input(&self, part: &AttentionInput<'_>, dst: Option<Tensor>) -> Result<Tensor> {
        attention_input_composed(self, part, dst)
    }

    /// [`Ops::attention`] with its output in token order: `[b, lq, h·dv]`, each query's
    /// heads side by side, the layout an output projection reads. A model calls it in place
    /// of `attention`, `permute(0, 2, 1, 3)` and the merge of heads. The default is exactly
    /// [`attention_tokens_composed`] (those ops), so a backend that writes the token order
    /// directly (CUDA: cuDNN's output strides) gives their bytes where its attention does.
    fn attention_tokens(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        scale: f32,
    ) -> Result<Tensor> {
        attention_tokens_composed(self, q, k, v, mask, scale)
    }
}

/// [`Ops::attention_tokens`] as its composition: [`Ops::attention`] into `[b, h, lq, dv]`,
/// [`Ops::permute`] to `[b, lq, h, dv]`, then a reshape to `[b, lq, h·dv]`. The trait's
/// default, and the fallback of backends for calls their direct path does not take.
pub fn attention_tokens_composed<O: Ops + ?Sized>(
    ops: &O,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f32,
) -> Result<Tensor> {
    let o = ops.attention(q, k, v, mask, scale)?;
    let o = ops.permute(&o, &[0, 2, 1, 3])?;
    let [b, lq, h, dv] = o.shape().try_into().map_err(|_| CoreError::Shape {
        what: "attention_tokens".into(),
        message: format!("output {:?}: expected [b, h, lq, dv]", o.shape()),
    })?;
    o.reshape(&[b, lq, h * dv])
}

/// One part of [`Ops::attention_input`]: the projection `x [b, l, heads·d]`, its per-head
/// RMS norm (weight `[d]`, eps), its rotary tables `cos, sin [total, d]` (the joined
/// sequence's), and where its rows go in the joined sequence of `total` rows.
#[derive(Debug, Clone, Copy)]
pub struct AttentionInput<'a> {
    /// The projection's output, `[b, l, heads·d]`.
    pub x: &'a Tensor,
    /// Heads.
    pub heads: usize,
    /// The per-head RMS norm's weight `[d]` and eps, if any.
    pub norm: Option<(&'a Tensor, f32)>,
    /// The rotary tables `cos, sin [total, d]`, if any.
    pub rope: Option<(&'a Tensor, &'a Tensor)>,
    /// The part's first row in the joined sequence.
    pub start: usize,
    /// The joined sequence's length.
    pub total: usize,
}

impl AttentionInput<'_> {
    /// The call's sizes against `dst` (its shape, and `x`'s dtype), or a typed shape error
    /// naming `op` ([`crate::shape::attention_input_geometry`]).
    pub fn geometry(
        &self,
        op: &str,
        dst: Option<&Tensor>,
    ) -> Result<crate::shape::AttentionInputGeometry> {
        if let Some(t) = dst
            && t.dtype() != self.x.dtype()
        {
            return Err(CoreError::Shape {
                what: op.to_string(),
                message: format!(
                    "dst is {:?}, x {:?}: expected one dtype",
                    t.dtype(),
                    self.x.dtype()
                ),
            });
        }
        crate::shape::attention_input_geometry(
            op,
            self.x.shape(),
            self.heads,
            self.norm.map(|(w, _)| w.shape()),
            self.rope.map(|(c, s)| (c.shape(), s.shape())),
            dst.map(Tensor::shape),
            self.start,
            self.total,
        )
    }
}

/// [`Ops::attention_input`] as its composition: `reshape` to heads, `rms_norm`, `permute` to
/// `[b, heads, l, d]`, `rope` with the tables' rows `start..start + l`, each rounded into
/// `x`'s dtype, then the rows placed into `dst` (a `concat` of `dst`'s rows before, the part
/// and `dst`'s rows after; a new `dst` is zeros). The trait's default, and the fallback of
/// backends for operands their fused kernel does not take.
pub fn attention_input_composed<O: Ops + ?Sized>(
    ops: &O,
    part: &AttentionInput<'_>,
    dst: Option<Tensor>,
) -> Result<Tensor> {
    const OP: &str = "attention_input";
    let g = part.geometry(OP, dst.as_ref())?;
    let mut y = part.x.reshape(&[g.b, g.l, g.heads, g.d])?;
    if let Some((w, eps)) = part.norm {
        y = ops.rms_norm(&y, Some(w), eps)?;
    }
    y = ops.permute(&y, &[0, 2, 1, 3])?;
    if let Some((cos, sin)) = part.rope {
        let (c, s) = if g.l == g.total {
            (cos.clone(), sin.clone())
        } else {
            (
                ops.narrow(cos, 0, g.start, g.l)?,
                ops.narrow(sin, 0, g.start, g.l)?,
            )
        };
        y = ops.rope(&y, &c, &s)?;
    }
    if g.l == g.total {
        return Ok(y);
    }
    let dst = match dst {
        Some(t) => t,
        None => ops.tensor_from_f32(
            &g.out_shape(),
            part.x.dtype(),
            &vec![0.0; g.out_shape().iter().product()],
        )?,
    };
    let before = (g.start > 0)
        .then(|| ops.narrow(&dst, 2, 0, g.start))
        .transpose()?;
    let end = g.start + g.l;
    let after = (end < g.total)
        .then(|| ops.narrow(&dst, 2, end, g.total - end))
        .transpose()?;
    let pieces: Vec<&Tensor> = before.iter().chain([&y]).chain(after.iter()).collect();
    ops.concat(&pieces, 2)
}

/// Stops a run on non-finite values: [`CoreError::NonFinite`](crate::CoreError) naming
/// `what`, the `phase` and the `step` (from 1, of the phase's steps) when `x` holds a NaN
/// or an Inf. One [`Ops::count_non_finite`]: one device reduction and one scalar read.
pub fn check_finite<O: Ops + ?Sized>(
    ops: &O,
    x: &Tensor,
    phase: &str,
    step: Option<(usize, usize)>,
    what: &str,
) -> Result<()> {
    match ops.count_non_finite(x)? {
        0 => Ok(()),
        count => Err(crate::CoreError::NonFinite {
            phase: phase.to_string(),
            step,
            what: what.to_string(),
            count,
        }),
    }
}

/// [`Ops::layer_norm_modulate`] as its composition: `layer_norm(x)`, `affine(scale, 1, 1)`,
/// their product, plus `shift` (four ops, each rounded into its output dtype). The trait's
/// default, and the fallback of backends for operands their fused kernel does not take.
pub fn layer_norm_modulate_composed<O: Ops + ?Sized>(
    ops: &O,
    x: &Tensor,
    eps: f32,
    scale: &Tensor,
    shift: &Tensor,
) -> Result<Tensor> {
    let n = ops.layer_norm(x, None, None, eps)?;
    let one_plus = ops.affine(scale, 1.0, 1.0)?;
    let y = ops.binary(&n, &one_plus, BinaryOp::Mul)?;
    drop(n);
    ops.binary(&y, shift, BinaryOp::Add)
}

/// [`Ops::gated_add`] as its composition: `gate * y`, then `x +` that (two ops, each
/// rounded into its output dtype). The trait's default, and the fallback of backends for
/// operands their fused kernel does not take.
pub fn gated_add_composed<O: Ops + ?Sized>(
    ops: &O,
    x: &Tensor,
    gate: &Tensor,
    y: &Tensor,
) -> Result<Tensor> {
    let g = ops.binary(gate, y, BinaryOp::Mul)?;
    ops.binary(x, &g, BinaryOp::Add)
}

/// [`Ops::linear_concat`] done the plain way: [`Ops::concat`] along the last dim, then
/// [`Ops::linear`]. The trait's default, and the fallback of backends for operands their
/// fused path does not take.
pub fn linear_concat_by_concat<O: Ops + ?Sized>(
    ops: &O,
    xs: &[&Tensor],
    w: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    match xs {
        [] => Err(crate::CoreError::Shape {
            what: "linear_concat".to_string(),
            message: "no inputs; expected at least one x [..., in]".to_string(),
        }),
        _ => on_concat_last(ops, xs, |x| ops.linear(x, w, bias)),
    }
}

/// `f` of `xs` joined along their last dim ([`Ops::concat`]; a single part passed as it
/// is): a "concatenate, then multiply" op done the plain way ([`linear_concat_by_concat`],
/// [`crate::fp8_compute::linear_fp8_of_concat`]).
pub fn on_concat_last<O: Ops + ?Sized>(
    ops: &O,
    xs: &[&Tensor],
    f: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    match xs {
        [x] => f(x),
        _ => {
            let dim = xs.first().map_or(0, |x| x.shape().len().saturating_sub(1));
            f(&ops.concat(xs, dim)?)
        }
    }
}
