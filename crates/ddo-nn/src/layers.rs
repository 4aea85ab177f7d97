//! Layers whose weights are leaves of a component: each holds its [`LeafId`] and runs
//! through [`ForwardContext::run_leaf`], so whatever route is attached moves its weights.
//! Parameter names follow Diffusers/PyTorch (`weight`, `bias`).

use std::borrow::Cow;

use ddo_core::adapter::{adapter_sum, add_adapters};
use ddo_core::{
    AttentionInput, Conv2dParams, CoreError, DType, ForwardContext, LeafId, LeafKind, LeafWeights,
    Ops, Result, Tensor, UnaryOp, ops_of,
};

use crate::builder::ModelBuilder;
use crate::error::LoadResult;

/// The compute plane of the context's device.
pub fn ops<'a>(ctx: &ForwardContext<'a>) -> Result<&'a dyn Ops> {
    ops_of(ctx.device())
}

/// A linear leaf's weight as the GEMM takes it: a quantized weight's GGUF blocks
/// dequantized into the input's `dtype` first ([`Ops::dequantize`]: into scratch for this
/// call, the stored blocks untouched), any other weight as it is.
fn weight<'w>(ops: &dyn Ops, w: &'w LeafWeights<'_>, dtype: DType) -> Result<Cow<'w, Tensor>> {
    let stored = w.get("weight")?;
    if stored.quant().is_some() {
        let into = match dtype {
            DType::F32 | DType::F16 => dtype,
            _ => DType::BF16,
        };
        Ok(Cow::Owned(ops.dequantize(stored, into)?))
    } else {
        Ok(Cow::Borrowed(stored))
    }
}

/// What `--compute fp8` asks of the linears of a forward's component: whether they run in
/// fp8, whether each reads its input's finite check at the call
/// ([`ddo_core::Component::set_fp8_checks`]), and the component's name for the error.
#[derive(Debug, Clone, Copy)]
struct Fp8<'c> {
    on: bool,
    checks: bool,
    component: &'c str,
}

impl<'c> Fp8<'c> {
    fn of(ctx: &ForwardContext<'c>) -> Self {
        let c = ctx.component();
        Self {
            on: c.fp8_compute(),
            checks: c.fp8_checks(),
            component: c.name(),
        }
    }

    /// Whether a linear with `weight` runs in fp8: E4M3 codes do; any other weight upcasts
    /// as without `--compute fp8`.
    fn runs(&self, weight: &Tensor) -> bool {
        self.on && ddo_core::fp8_compute::takes_weight(weight)
    }

    /// The fp8 product of leaf `w`'s E4M3 `weight` and `xs` side by side on the last dim
    /// ([`Ops::linear_fp8`] of one input, [`Ops::linear_fp8_concat`] of several; with `gelu`,
    /// [`Ops::linear_fp8_gelu_tanh`]), a non-finite input named by its layer
    /// (`component.leaf`): found by the op (the host reference reads every input), or, with
    /// the checks at the call on, by a count of each input's NaN and Inf values read first.
    fn linear(
        &self,
        ops: &dyn Ops,
        w: &LeafWeights<'_>,
        xs: &[&Tensor],
        weight: &Tensor,
        bias: Option<&Tensor>,
        gelu: bool,
    ) -> Result<Tensor> {
        let named = || CoreError::NonFiniteActivation {
            layer: format!("{}.{}", self.component, w.leaf().path()),
        };
        if self.checks {
            for x in xs {
                if ops.count_non_finite(x)? > 0 {
                    return Err(named());
                }
            }
        }
        let y = match (xs, gelu) {
            ([x], true) => ops.linear_fp8_gelu_tanh(x, weight, bias),
            ([x], false) => ops.linear_fp8(x, weight, bias),
            (_, false) => ops.linear_fp8_concat(xs, weight, bias),
            (_, true) => ops
                .linear_fp8_concat(xs, weight, bias)
                .and_then(|y| ops.unary_owned(y, UnaryOp::GeluTanh)),
        };
        y.map_err(|e| match e {
            CoreError::NonFiniteActivation { layer } if layer.is_empty() => named(),
            e => e,
        })
    }
}

/// `nn.Linear`: weight `[out, in]`, optional bias `[out]`.
#[derive(Debug, Clone, Copy)]
pub struct Linear {
    leaf: LeafId,
    bias: bool,
    /// Input features.
    pub in_features: usize,
    /// Output features.
    pub out_features: usize,
}

impl Linear {
    /// Builds leaf `name` under the builder's current position.
    pub fn build(
        b: &mut ModelBuilder<'_>,
        name: &str,
        in_features: usize,
        out_features: usize,
        bias: bool,
    ) -> LoadResult<Self> {
        let w = [out_features, in_features];
        let bshape = [out_features];
        let params: Vec<(&str, &[usize])> = if bias {
            vec![("weight", &w), ("bias", &bshape)]
        } else {
            vec![("weight", &w)]
        };
        let leaf = b.leaf(name, LeafKind::Linear, &params)?;
        Ok(Self {
            leaf,
            bias,
            in_features,
            out_features,
        })
    }

    /// `x [..., in]` → `[..., out]`.
    pub fn forward(&self, ctx: &mut ForwardContext<'_>, x: &Tensor) -> Result<Tensor> {
        let ops = ops(ctx)?;
        let bias = self.bias;
        let fp8 = Fp8::of(ctx);
        ctx.run_leaf(self.leaf, |w| {
            let b = if bias { Some(w.get("bias")?) } else { None };
            let weight = weight(ops, w, x.dtype())?;
            if fp8.runs(&weight) {
                let y = fp8.linear(ops, w, &[x], &weight, b, false)?;
                return add_adapters(ops, &[x], y, w.adapters(), Some(w.down_cache()));
            }
            match adapter_sum(ops, &[x], w.adapters(), Some(w.down_cache()))? {
                None => ops.linear(x, &weight, b),
                // The base product added into the adapters' sum: one write of the output.
                Some(u) => ops.linear_accumulate(x, &weight, b, u, false),
            }
        })
    }

    /// `gelu_tanh(x · wᵀ + b)` ([`ddo_core::Ops::linear_gelu_tanh`]): the projection and
    /// its tanh-approximation GELU as one op inside the leaf (the same hooks as
    /// [`Linear::forward`]), so a backend can apply the activation in the GEMM's epilogue.
    pub fn forward_gelu_tanh(&self, ctx: &mut ForwardContext<'_>, x: &Tensor) -> Result<Tensor> {
        let ops = ops(ctx)?;
        let bias = self.bias;
        let fp8 = Fp8::of(ctx);
        ctx.run_leaf(self.leaf, |w| {
            let b = if bias { Some(w.get("bias")?) } else { None };
            let weight = weight(ops, w, x.dtype())?;
            if fp8.runs(&weight) {
                if w.adapters().is_empty() {
                    // The activation in the fp8 GEMM's epilogue where the backend has one.
                    return fp8.linear(ops, w, &[x], &weight, b, true);
                }
                let y = fp8.linear(ops, w, &[x], &weight, b, false)?;
                // The adapters go in before the activation.
                let y = add_adapters(ops, &[x], y, w.adapters(), Some(w.down_cache()))?;
                return ops.unary_owned(y, UnaryOp::GeluTanh);
            }
            match adapter_sum(ops, &[x], w.adapters(), Some(w.down_cache()))? {
                None => ops.linear_gelu_tanh(x, &weight, b),
                // The adapters go in before the activation.
                Some(u) => ops.linear_accumulate(x, &weight, b, u, true),
            }
        })
    }

    /// `concat(xs, last dim) [..., in]` → `[..., out]` without materialising the
    /// concatenation ([`ddo_core::Ops::linear_concat`]): Flux's single blocks feed
    /// `proj_out` the attention output and the MLP activation side by side.
    pub fn forward_concat(&self, ctx: &mut ForwardContext<'_>, xs: &[&Tensor]) -> Result<Tensor> {
        let ops = ops(ctx)?;
        let bias = self.bias;
        let fp8 = Fp8::of(ctx);
        ctx.run_leaf(self.leaf, |w| {
            let b = if bias { Some(w.get("bias")?) } else { None };
            let dtype = xs.first().map_or(DType::BF16, |x| x.dtype());
            let weight = weight(ops, w, dtype)?;
            let y = if fp8.runs(&weight) {
                // One activation, one scale, the parts side by side.
                fp8.linear(ops, w, xs, &weight, b, false)?
            } else {
                ops.linear_concat(xs, &weight, b)?
            };
            add_adapters(ops, xs, y, w.adapters(), Some(w.down_cache()))
        })
    }

    /// The leaf.
    pub fn leaf(&self) -> LeafId {
        self.leaf
    }
}

/// `nn.Conv2d` (groups = 1): weight `[out, in, k, k]`, optional bias `[out]`.
#[derive(Debug, Clone, Copy)]
pub struct Conv2d {
    leaf: LeafId,
    bias: bool,
    params: Conv2dParams,
}

impl Conv2d {
    /// Builds leaf `name` with a square `kernel`.
    #[allow(clippy::too_many_arguments)]
    pub fn build(
        b: &mut ModelBuilder<'_>,
        name: &str,
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        stride: usize,
        padding: usize,
        bias: bool,
    ) -> LoadResult<Self> {
        let w = [out_channels, in_channels, kernel, kernel];
        let bshape = [out_channels];
        let params: Vec<(&str, &[usize])> = if bias {
            vec![("weight", &w), ("bias", &bshape)]
        } else {
            vec![("weight", &w)]
        };
        let leaf = b.leaf(name, LeafKind::Conv2d, &params)?;
        Ok(Self {
            leaf,
            bias,
            params: Conv2dParams::new(stride, padding),
        })
    }

    /// `x [n, in, h, w]` → `[n, out, h', w']`.
    pub fn forward(&self, ctx: &mut ForwardContext<'_>, x: &Tensor) -> Result<Tensor> {
        let ops = ops(ctx)?;
        let (bias, params) = (self.bias, self.params);
        ctx.run_leaf(self.leaf, |w| {
            let b = if bias { Some(w.get("bias")?) } else { None };
            ops.conv2d(x, w.get("weight")?, b, params)
        })
    }
}

/// `nn.GroupNorm` with affine weight and bias `[channels]`.
#[derive(Debug, Clone, Copy)]
pub struct GroupNorm {
    leaf: LeafId,
    groups: usize,
    eps: f32,
}

impl GroupNorm {
    /// Builds leaf `name`.
    pub fn build(
        b: &mut ModelBuilder<'_>,
        name: &str,
        groups: usize,
        channels: usize,
        eps: f32,
    ) -> LoadResult<Self> {
        let s = [channels];
        let leaf = b.leaf(name, LeafKind::Norm, &[("weight", &s), ("bias", &s)])?;
        Ok(Self { leaf, groups, eps })
    }

    /// Normalises `x [n, c, ...]`.
    pub fn forward(&self, ctx: &mut ForwardContext<'_>, x: &Tensor) -> Result<Tensor> {
        let ops = ops(ctx)?;
        let (groups, eps) = (self.groups, self.eps);
        ctx.run_leaf(self.leaf, |w| {
            ops.group_norm(x, groups, Some(w.get("weight")?), Some(w.get("bias")?), eps)
        })
    }

    /// Normalises `x [n, c, ...]`, then applies SiLU: [`Ops::group_norm_silu`] in the leaf,
    /// entered and left exactly as [`GroupNorm::forward`] is (a backend may fuse the two; the
    /// host backend's values are those of `forward` then SiLU, bit for bit).
    ///
    /// [`Ops::group_norm_silu`]: ddo_core::Ops::group_norm_silu
    pub fn forward_silu(&self, ctx: &mut ForwardContext<'_>, x: &Tensor) -> Result<Tensor> {
        let ops = ops(ctx)?;
        let (groups, eps) = (self.groups, self.eps);
        ctx.run_leaf(self.leaf, |w| {
            ops.group_norm_silu(x, groups, Some(w.get("weight")?), Some(w.get("bias")?), eps)
        })
    }
}

/// `nn.LayerNorm` over the last dim; without affine params it owns no leaf.
#[derive(Debug, Clone, Copy)]
pub struct LayerNorm {
    leaf: Option<LeafId>,
    bias: bool,
    eps: f32,
}

impl LayerNorm {
    /// Builds leaf `name` with weight (and bias when `bias`) `[dim]`.
    pub fn build(
        b: &mut ModelBuilder<'_>,
        name: &str,
        dim: usize,
        eps: f32,
        bias: bool,
    ) -> LoadResult<Self> {
        let s = [dim];
        let params: Vec<(&str, &[usize])> = if bias {
            vec![("weight", &s), ("bias", &s)]
        } else {
            vec![("weight", &s)]
        };
        let leaf = Some(b.leaf(name, LeafKind::Norm, &params)?);
        Ok(Self { leaf, bias, eps })
    }

    /// A layer norm without affine params (`elementwise_affine=False`).
    pub fn plain(eps: f32) -> Self {
        Self {
            leaf: None,
            bias: false,
            eps,
        }
    }

    /// Normalises over the last dim.
    pub fn forward(&self, ctx: &mut ForwardContext<'_>, x: &Tensor) -> Result<Tensor> {
        let ops = ops(ctx)?;
        let (bias, eps) = (self.bias, self.eps);
        match self.leaf {
            None => ops.layer_norm(x, None, None, eps),
            Some(leaf) => ctx.run_leaf(leaf, |w| {
                let b = if bias { Some(w.get("bias")?) } else { None };
                ops.layer_norm(x, Some(w.get("weight")?), b, eps)
            }),
        }
    }
}

/// RMS norm over the last dim with weight `[dim]`.
#[derive(Debug, Clone, Copy)]
pub struct RmsNorm {
    leaf: LeafId,
    eps: f32,
}

impl RmsNorm {
    /// Builds leaf `name`.
    pub fn build(b: &mut ModelBuilder<'_>, name: &str, dim: usize, eps: f32) -> LoadResult<Self> {
        let s = [dim];
        let leaf = b.leaf(name, LeafKind::Norm, &[("weight", &s)])?;
        Ok(Self { leaf, eps })
    }

    /// Normalises over the last dim.
    pub fn forward(&self, ctx: &mut ForwardContext<'_>, x: &Tensor) -> Result<Tensor> {
        let ops = ops(ctx)?;
        let eps = self.eps;
        ctx.run_leaf(self.leaf, |w| ops.rms_norm(x, Some(w.get("weight")?), eps))
    }

    /// [`Ops::attention_input`] of `part` normed by this leaf (its weight and eps as the
    /// part's norm), written into `dst`: a joint attention's per-head q or k norm fused with
    /// the join, the move to heads and the rotary embedding.
    pub fn attention_input(
        &self,
        ctx: &mut ForwardContext<'_>,
        part: AttentionInput<'_>,
        dst: Option<Tensor>,
    ) -> Result<Tensor> {
        let ops = ops(ctx)?;
        let eps = self.eps;
        ctx.run_leaf(self.leaf, |w| {
            let norm = Some((w.get("weight")?, eps));
            ops.attention_input(&AttentionInput { norm, ..part }, dst)
        })
    }
}

/// `nn.Embedding`: table `[rows, dim]`.
#[derive(Debug, Clone, Copy)]
pub struct Embedding {
    leaf: LeafId,
}

impl Embedding {
    /// Builds leaf `name`.
    pub fn build(
        b: &mut ModelBuilder<'_>,
        name: &str,
        rows: usize,
        dim: usize,
    ) -> LoadResult<Self> {
        let s = [rows, dim];
        let leaf = b.leaf(name, LeafKind::Embedding, &[("weight", &s)])?;
        Ok(Self { leaf })
    }

    /// Wraps an existing leaf (a tied table).
    pub fn from_leaf(leaf: LeafId) -> Self {
        Self { leaf }
    }

    /// Rows `ids` → `[ids.len(), dim]`. A table stored as GGUF blocks is dequantized into
    /// bf16 first (the compute dtype of quantized weights), for this call.
    pub fn forward(&self, ctx: &mut ForwardContext<'_>, ids: &[u32]) -> Result<Tensor> {
        let ops = ops(ctx)?;
        ctx.run_leaf(self.leaf, |w| {
            let table = w.get("weight")?;
            if table.quant().is_some() {
                ops.embedding(&ops.dequantize(table, DType::BF16)?, ids)
            } else {
                ops.embedding(table, ids)
            }
        })
    }

    /// The leaf.
    pub fn leaf(&self) -> LeafId {
        self.leaf
    }
}

/// Element-wise activation.
pub fn act(ctx: &ForwardContext<'_>, x: &Tensor, op: UnaryOp) -> Result<Tensor> {
    ops(ctx)?.unary(x, op)
}

/// A transformer's named linear calls ([`ddo_core::linear_calls`]) for `component`, whose
/// forward computes in `dtype`: `calls(dtype)`, or none under `--compute fp8` (those linears
/// run other kernels) or where the forward would refuse (`dtype` an error).
pub(crate) fn named_linear_calls(
    component: &ddo_core::Component,
    dtype: Result<ddo_core::DType>,
    calls: impl FnOnce(ddo_core::DType) -> Vec<ddo_core::LinearCall>,
) -> Vec<ddo_core::LinearCall> {
    match dtype {
        Ok(dtype) if !component.fp8_compute() => calls(dtype),
        _ => Vec::new(),
    }
}
