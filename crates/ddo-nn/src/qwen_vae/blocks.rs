//! The decoder's layers on one frame: the causal 3-D convolution as the 2-D convolution it
//! is there, the RMS norm over channels, the residual block, the attention block, the up
//! block, and the tensor helpers they run with.

use ddo_core::{
    BinaryOp, Conv2dParams, CoreError, DType, ForwardContext, LeafId, LeafKind, Ops, ParamKind,
    ReduceOp, Result, Tensor, UnaryOp,
};

use super::NORMALIZE_EPS;
use super::config::{UpBlockSpec, Upsampler};
use crate::builder::ModelBuilder;
use crate::error::LoadResult;
use crate::layers::{Conv2d, ops};

/// Runs `f` on `x`, then drops `x`: an intermediate is freed as soon as the op consuming it
/// has produced its output (the lifetimes the estimates model).
pub(super) fn consume<T>(x: Tensor, f: impl FnOnce(&Tensor) -> Result<T>) -> Result<T> {
    f(&x)
}

/// `x` as `[batch, channels, height, width]`.
pub(super) fn dims4(x: &Tensor, what: &str) -> Result<(usize, usize, usize, usize)> {
    match x.shape() {
        [b, c, h, w] => Ok((*b, *c, *h, *w)),
        s => Err(CoreError::Shape {
            what: what.into(),
            message: format!("expected a [batch, channels, height, width] tensor, got {s:?}"),
        }),
    }
}

/// Diffusers' `QwenImageCausalConv3d` (kernel `k × k × k`, padding `k / 2`, stride 1) on one
/// frame: it pads `2 · (k / 2)` frames of zeros in front (the first chunk has no cache), so
/// only the kernel's last temporal slice meets data, and it is the 2-D convolution with
/// that slice. The leaf's `weight` is that slice, `[out, in, k, k]`
/// ([`crate::WeightSource::last_time_slice`]), its `bias` the convolution's.
#[derive(Debug, Clone, Copy)]
pub(super) struct CausalConv {
    leaf: LeafId,
    params: Conv2dParams,
}

impl CausalConv {
    pub(super) fn build(
        b: &mut ModelBuilder<'_>,
        name: &str,
        cin: usize,
        cout: usize,
        kernel: usize,
    ) -> LoadResult<Self> {
        let path = b.path(name);
        let weight = b.weights().last_time_slice(
            &format!("{path}.weight"),
            &[cout, cin, kernel, kernel],
            kernel,
            ParamKind::Parameter,
        )?;
        let bias = b
            .weights()
            .param(&format!("{path}.bias"), &[cout], ParamKind::Parameter)?;
        let leaf = b.leaf_with(
            name,
            LeafKind::Conv2d,
            vec![("weight".into(), weight), ("bias".into(), bias)],
        )?;
        Ok(Self {
            leaf,
            params: Conv2dParams::new(1, kernel / 2),
        })
    }

    /// `x [n, in, h, w]` → `[n, out, h, w]`.
    pub(super) fn forward(&self, ctx: &mut ForwardContext<'_>, x: &Tensor) -> Result<Tensor> {
        let o = ops(ctx)?;
        let params = self.params;
        ctx.run_leaf(self.leaf, |w| {
            o.conv2d(x, w.get("weight")?, Some(w.get("bias")?), params)
        })
    }
}

/// Diffusers' `QwenImageRMS_norm` (`channel_first`, no bias): `F.normalize(x, dim=1) ·
/// √C · gamma`, composed from plain ops ([`channel_rms_norm`]). `gamma` keeps its
/// checkpoint shape, `[C, 1, 1, 1]` in the residual blocks and `norm_out` (`images=False`),
/// `[C, 1, 1]` in the attention block.
#[derive(Debug, Clone, Copy)]
pub(super) struct RmsNorm {
    leaf: LeafId,
    channels: usize,
}

impl RmsNorm {
    pub(super) fn build(
        b: &mut ModelBuilder<'_>,
        name: &str,
        channels: usize,
        images: bool,
    ) -> LoadResult<Self> {
        let gamma: &[usize] = if images {
            &[channels, 1, 1]
        } else {
            &[channels, 1, 1, 1]
        };
        let leaf = b.leaf(name, LeafKind::Norm, &[("gamma", gamma)])?;
        Ok(Self { leaf, channels })
    }

    /// Normalises `x [n, C, h, w]` over its channels.
    pub(super) fn forward(&self, ctx: &mut ForwardContext<'_>, x: &Tensor) -> Result<Tensor> {
        let o = ops(ctx)?;
        let c = self.channels;
        // `self.scale = dim ** 0.5`, a Python float the f32 multiply rounds to f32.
        let scale = (c as f64).sqrt() as f32;
        ctx.run_leaf(self.leaf, |w| {
            let gamma = w.get("gamma")?.reshape(&[c, 1, 1])?;
            channel_rms_norm(o, x, &gamma, scale)
        })
    }
}

/// `F.normalize(x, dim=1) * scale * gamma` for `x [n, C, h, w]` and `gamma [C, 1, 1]`, in
/// Diffusers' order: the L2 norm over channels (`sqrt(Σ x²)`, squares and sum in f32 — a
/// 16-bit `x` is cast first, as `QwenImageRMS_norm` normalises in float32), clamped below at
/// `1e-12`, `x / norm` rounded to `x`'s dtype, then `· scale`, then `· gamma`. Every op is
/// an existing one (square, sum, sqrt, max, broadcasting div and mul, affine): no backend
/// needs a kernel of its own. Full-size intermediates: the f32 squares (freed after the
/// sum), then one tensor of `x`'s size at a time beside its input.
pub(super) fn channel_rms_norm(
    o: &dyn Ops,
    x: &Tensor,
    gamma: &Tensor,
    scale: f32,
) -> Result<Tensor> {
    let sum = {
        let squares = if x.dtype() == DType::F32 {
            o.unary(x, UnaryOp::Square)?
        } else {
            o.unary_owned(o.cast(x, DType::F32)?, UnaryOp::Square)?
        };
        consume(squares, |s| o.reduce(s, 1, ReduceOp::Sum))?
    };
    let norm = o.unary_owned(sum, UnaryOp::Sqrt)?;
    let denom = {
        let eps = o.tensor_from_f32(&[1], DType::F32, &[NORMALIZE_EPS])?;
        consume(norm, |n| o.binary(n, &eps, BinaryOp::Max))?
    };
    let normalized = consume(denom, |d| o.binary(x, d, BinaryOp::Div))?;
    let scaled = consume(normalized, |n| o.affine(n, scale, 0.0))?;
    // `+ self.bias` is `+ 0.0` (`bias=False`): skipped.
    consume(scaled, |s| o.binary(s, gamma, BinaryOp::Mul))
}

/// Diffusers' `QwenImageResidualBlock`: `norm1`, SiLU, `conv1`, `norm2`, SiLU, (dropout),
/// `conv2`, plus the input through `conv_shortcut` (a 1×1×1 causal convolution) when the
/// width changes. Diffusers computes the shortcut first; it runs last here (the same values),
/// so the leaves run in the order the tree holds them and the input, not a wider shortcut
/// output, is what stays live.
#[derive(Debug, Clone, Copy)]
pub(super) struct ResidualBlock {
    norm1: RmsNorm,
    conv1: CausalConv,
    norm2: RmsNorm,
    conv2: CausalConv,
    conv_shortcut: Option<CausalConv>,
}

impl ResidualBlock {
    pub(super) fn build(
        b: &mut ModelBuilder<'_>,
        name: &str,
        cin: usize,
        cout: usize,
    ) -> LoadResult<Self> {
        b.scope(name, |b| {
            Ok(Self {
                norm1: RmsNorm::build(b, "norm1", cin, false)?,
                conv1: CausalConv::build(b, "conv1", cin, cout, 3)?,
                norm2: RmsNorm::build(b, "norm2", cout, false)?,
                conv2: CausalConv::build(b, "conv2", cout, cout, 3)?,
                conv_shortcut: if cin != cout {
                    Some(CausalConv::build(b, "conv_shortcut", cin, cout, 1)?)
                } else {
                    None
                },
            })
        })
    }

    /// `x` stays live until the residual addition (or the shortcut).
    pub(super) fn forward(&self, ctx: &mut ForwardContext<'_>, x: Tensor) -> Result<Tensor> {
        let o = ops(ctx)?;
        let h = self.norm1.forward(ctx, &x)?;
        let h = o.unary_owned(h, UnaryOp::Silu)?;
        let h = consume(h, |h| self.conv1.forward(ctx, h))?;
        let h = consume(h, |h| self.norm2.forward(ctx, h))?;
        let h = o.unary_owned(h, UnaryOp::Silu)?;
        let h = consume(h, |h| self.conv2.forward(ctx, h))?;
        let shortcut = match &self.conv_shortcut {
            Some(c) => consume(x, |x| c.forward(ctx, x))?,
            None => x,
        };
        o.binary(&h, &shortcut, BinaryOp::Add)
    }
}

/// A 1×1 `nn.Conv2d` (weight `[out, in, 1, 1]`, bias `[out]`) run as a linear over tokens
/// `[.., in]`: the weight's bytes viewed as `[out, in]`, no copy.
#[derive(Debug, Clone, Copy)]
struct PointwiseConv {
    leaf: LeafId,
    cin: usize,
    cout: usize,
}

impl PointwiseConv {
    fn build(b: &mut ModelBuilder<'_>, name: &str, cin: usize, cout: usize) -> LoadResult<Self> {
        let leaf = b.leaf(
            name,
            LeafKind::Conv2d,
            &[("weight", &[cout, cin, 1, 1]), ("bias", &[cout])],
        )?;
        Ok(Self { leaf, cin, cout })
    }

    fn forward(&self, ctx: &mut ForwardContext<'_>, tokens: &Tensor) -> Result<Tensor> {
        let o = ops(ctx)?;
        let (cin, cout) = (self.cin, self.cout);
        ctx.run_leaf(self.leaf, |w| {
            let weight = w.get("weight")?.reshape(&[cout, cin])?;
            o.linear(tokens, &weight, Some(w.get("bias")?))
        })
    }
}

/// Diffusers' `QwenImageAttentionBlock`: `norm` (RMS over channels), the 1×1 `to_qkv`, one
/// SDPA head of width `C` over the `h·w` positions (q, k, v the three thirds of `to_qkv`'s
/// channels, scale `1/√C`), the 1×1 `proj`, plus the input.
#[derive(Debug, Clone, Copy)]
pub(super) struct AttentionBlock {
    norm: RmsNorm,
    to_qkv: PointwiseConv,
    proj: PointwiseConv,
}

impl AttentionBlock {
    pub(super) fn build(b: &mut ModelBuilder<'_>, name: &str, c: usize) -> LoadResult<Self> {
        b.scope(name, |b| {
            Ok(Self {
                norm: RmsNorm::build(b, "norm", c, true)?,
                to_qkv: PointwiseConv::build(b, "to_qkv", c, 3 * c)?,
                proj: PointwiseConv::build(b, "proj", c, c)?,
            })
        })
    }

    pub(super) fn forward(&self, ctx: &mut ForwardContext<'_>, x: Tensor) -> Result<Tensor> {
        let o = ops(ctx)?;
        let (b, c, h, w) = dims4(&x, "Qwen-Image VAE attention")?;
        let hw = h * w;
        let normed = self.norm.forward(ctx, &x)?;
        // [b, c, h, w] -> [b, hw, c]: the tokens the 1x1 convolutions read as linears.
        let tokens = consume(normed, |n| o.permute(&n.reshape(&[b, c, hw])?, &[0, 2, 1]))?;
        let qkv = consume(tokens, |t| self.to_qkv.forward(ctx, t))?;
        let attended = {
            // `qkv.chunk(3, dim=-1)` of [b, 1, hw, 3c].
            let (q, k, v) = consume(qkv, |t| {
                Ok((
                    o.narrow(t, 2, 0, c)?,
                    o.narrow(t, 2, c, c)?,
                    o.narrow(t, 2, 2 * c, c)?,
                ))
            })?;
            let heads = [b, 1, hw, c];
            // SDPA's default scale, `1 / math.sqrt(E)` in double, applied as f32.
            let scale = (1.0 / (c as f64).sqrt()) as f32;
            o.attention(
                &q.reshape(&heads)?,
                &k.reshape(&heads)?,
                &v.reshape(&heads)?,
                None,
                scale,
            )?
        };
        let projected = consume(attended, |a| {
            self.proj.forward(ctx, &a.reshape(&[b, hw, c])?)
        })?;
        let back = consume(projected, |p| {
            o.permute(p, &[0, 2, 1])?.reshape(&[b, c, h, w])
        })?;
        o.binary(&back, &x, BinaryOp::Add)
    }
}

/// `QwenImageMidBlock` with one layer: resnet, attention, resnet.
#[derive(Debug, Clone, Copy)]
pub(super) struct MidBlock {
    pub(super) resnet0: ResidualBlock,
    pub(super) attention: AttentionBlock,
    pub(super) resnet1: ResidualBlock,
}

impl MidBlock {
    /// Built in execution order: `resnets.0`, `attentions.0`, `resnets.1` (the tree visits
    /// the `resnets` list twice, so a streamed route's predicted schedule holds).
    pub(super) fn build(b: &mut ModelBuilder<'_>, c: usize) -> LoadResult<Self> {
        b.scope("mid_block", |b| {
            // On an error the whole build fails, so early returns need not leave scopes.
            b.enter_blocks("resnets");
            let resnet0 = ResidualBlock::build(b, "0", c, c)?;
            b.exit();
            b.enter_blocks("attentions");
            let attention = AttentionBlock::build(b, "0", c)?;
            b.exit();
            b.enter_blocks("resnets");
            let resnet1 = ResidualBlock::build(b, "1", c, c)?;
            b.exit();
            Ok(Self {
                resnet0,
                attention,
                resnet1,
            })
        })
    }
}

/// `QwenImageUpBlock`: residual blocks, then the upsampler's spatial half (`resample`:
/// nearest 2× — `nearest-exact` at a factor of 2 picks the same pixels — and a 3×3
/// convolution to half the width). `upsample3d`'s `time_conv` is not built: on one frame
/// Diffusers marks its cache `"Rep"` and skips it.
#[derive(Debug, Clone)]
pub(super) struct UpBlock {
    pub(super) resnets: Vec<ResidualBlock>,
    pub(super) upsampler: Option<Conv2d>,
}

impl UpBlock {
    pub(super) fn build(
        b: &mut ModelBuilder<'_>,
        i: usize,
        spec: &UpBlockSpec,
    ) -> LoadResult<Self> {
        b.scope(i.to_string(), |b| {
            b.enter_blocks("resnets");
            let resnets = (0..spec.resnets)
                .map(|k| {
                    let cin = if k == 0 { spec.in_dim } else { spec.out_dim };
                    ResidualBlock::build(b, &k.to_string(), cin, spec.out_dim)
                })
                .collect::<LoadResult<Vec<_>>>()?;
            b.exit();
            let upsampler = match spec.upsampler {
                None => None,
                Some(Upsampler::Spatial | Upsampler::SpatioTemporal) => {
                    b.enter_blocks("upsamplers");
                    let (c, half) = (spec.out_dim, spec.out_dim / 2);
                    let conv = b.scope("0", |b| {
                        b.scope("resample", |b| {
                            Conv2d::build(b, "1", c, half, 3, 1, 1, true)
                        })
                    })?;
                    b.exit();
                    Some(conv)
                }
            };
            Ok(Self { resnets, upsampler })
        })
    }
}
