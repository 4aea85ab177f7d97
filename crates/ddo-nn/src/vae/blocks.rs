//! The decoder's layers: `ResnetBlock2D`, the mid block's attention, the mid and up
//! blocks, and the tensor helpers they run with.

use ddo_core::{BinaryOp, CoreError, ForwardContext, Result, Tensor};

use super::NORM_EPS;
#[cfg(doc)]
use super::estimate_decode_peak_bytes;
use crate::builder::ModelBuilder;
use crate::error::LoadResult;
use crate::layers::{Conv2d, GroupNorm, Linear, ops};

/// Runs `f` on `x`, then drops `x`: an intermediate is freed as soon as the op consuming
/// it has produced its output (the lifetimes [`estimate_decode_peak_bytes`] models).
pub(super) fn consume<T>(x: Tensor, f: impl FnOnce(&Tensor) -> Result<T>) -> Result<T> {
    f(&x)
}

/// Diffusers' `ResnetBlock2D` without time embedding.
#[derive(Debug, Clone, Copy)]
pub(super) struct ResnetBlock {
    norm1: GroupNorm,
    conv1: Conv2d,
    norm2: GroupNorm,
    conv2: Conv2d,
    conv_shortcut: Option<Conv2d>,
}

impl ResnetBlock {
    pub(super) fn build(
        b: &mut ModelBuilder<'_>,
        name: &str,
        cin: usize,
        cout: usize,
        groups: usize,
    ) -> LoadResult<Self> {
        b.scope(name, |b| {
            Ok(Self {
                norm1: GroupNorm::build(b, "norm1", groups, cin, NORM_EPS)?,
                conv1: Conv2d::build(b, "conv1", cin, cout, 3, 1, 1, true)?,
                norm2: GroupNorm::build(b, "norm2", groups, cout, NORM_EPS)?,
                conv2: Conv2d::build(b, "conv2", cout, cout, 3, 1, 1, true)?,
                conv_shortcut: if cin != cout {
                    Some(Conv2d::build(b, "conv_shortcut", cin, cout, 1, 1, 0, true)?)
                } else {
                    None
                },
            })
        })
    }

    /// `x` stays live until the residual addition (or the shortcut conv).
    pub(super) fn forward(&self, ctx: &mut ForwardContext<'_>, x: Tensor) -> Result<Tensor> {
        let h = self.norm1.forward_silu(ctx, &x)?;
        let h = consume(h, |h| self.conv1.forward(ctx, h))?;
        let h = consume(h, |h| self.norm2.forward_silu(ctx, h))?;
        let h = consume(h, |h| self.conv2.forward(ctx, h))?;
        let residual = match &self.conv_shortcut {
            Some(c) => consume(x, |x| c.forward(ctx, x))?,
            None => x,
        };
        ops(ctx)?.binary(&residual, &h, BinaryOp::Add)
    }
}

/// Diffusers' `Attention` as the VAE mid block builds it: one head over all channels,
/// group norm in front, residual connection, `AttnProcessor2_0`.
#[derive(Debug, Clone, Copy)]
pub(super) struct MidAttention {
    group_norm: GroupNorm,
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    to_out: Linear,
}

impl MidAttention {
    pub(super) fn build(
        b: &mut ModelBuilder<'_>,
        name: &str,
        channels: usize,
        groups: usize,
    ) -> LoadResult<Self> {
        b.scope(name, |b| {
            let group_norm = GroupNorm::build(b, "group_norm", groups, channels, NORM_EPS)?;
            let to_q = Linear::build(b, "to_q", channels, channels, true)?;
            let to_k = Linear::build(b, "to_k", channels, channels, true)?;
            let to_v = Linear::build(b, "to_v", channels, channels, true)?;
            b.enter_blocks("to_out");
            let to_out = Linear::build(b, "0", channels, channels, true)?;
            b.exit();
            Ok(Self {
                group_norm,
                to_q,
                to_k,
                to_v,
                to_out,
            })
        })
    }

    pub(super) fn forward(&self, ctx: &mut ForwardContext<'_>, x: Tensor) -> Result<Tensor> {
        let o = ops(ctx)?;
        let (b, c, h, w) = dims4(&x, "mid-block attention")?;
        let hw = h * w;
        // [b, c, h, w] -> [b, c, hw] -> [b, hw, c]
        let normed = self.group_norm.forward(ctx, &x)?;
        let tokens = consume(normed, |n| o.permute(&n.reshape(&[b, c, hw])?, &[0, 2, 1]))?;
        let (q, k, v) = consume(tokens, |t| {
            Ok((
                self.to_q.forward(ctx, t)?,
                self.to_k.forward(ctx, t)?,
                self.to_v.forward(ctx, t)?,
            ))
        })?;
        let attended = {
            let heads = [b, 1, hw, c];
            let (q, k, v) = (view(q, &heads)?, view(k, &heads)?, view(v, &heads)?);
            // SDPA's default scale, 1/sqrt(head_dim); head_dim = c (one head).
            o.attention(&q, &k, &v, None, 1.0 / (c as f32).sqrt())?
        };
        let projected = {
            let attended = view(attended, &[b, hw, c])?;
            self.to_out.forward(ctx, &attended)?
        };
        let back = consume(projected, |p| {
            o.permute(p, &[0, 2, 1])?.reshape(&[b, c, h, w])
        })?;
        // hidden_states + residual, then / rescale_output_factor (1: exact, skipped).
        o.binary(&back, &x, BinaryOp::Add)
    }
}

/// `t` viewed as `shape`, consuming the original handle (the view keeps the storage).
fn view(t: Tensor, shape: &[usize]) -> Result<Tensor> {
    t.reshape(shape)
}

/// `UNetMidBlock2D` with one layer: resnet, attention, resnet.
#[derive(Debug, Clone, Copy)]
pub(super) struct MidBlock {
    pub(super) resnet0: ResnetBlock,
    pub(super) attention: Option<MidAttention>,
    pub(super) resnet1: ResnetBlock,
}

/// `UpDecoderBlock2D`: resnets, then the optional `Upsample2D` (nearest ×2 + conv).
#[derive(Debug, Clone)]
pub(super) struct UpBlock {
    pub(super) resnets: Vec<ResnetBlock>,
    pub(super) upsampler: Option<Conv2d>,
}

pub(super) fn dims4(x: &Tensor, what: &str) -> Result<(usize, usize, usize, usize)> {
    match x.shape() {
        [b, c, h, w] => Ok((*b, *c, *h, *w)),
        s => Err(CoreError::Shape {
            what: what.into(),
            message: format!("expected a [batch, channels, height, width] tensor, got {s:?}"),
        }),
    }
}

pub(super) fn build_up_blocks(
    b: &mut ModelBuilder<'_>,
    widths: &[usize],
    layers_per_block: usize,
    groups: usize,
) -> LoadResult<Vec<UpBlock>> {
    let mut blocks = Vec::with_capacity(widths.len());
    let mut prev = widths[0];
    for (i, &out) in widths.iter().enumerate() {
        let last = i + 1 == widths.len();
        let block = b.scope(i.to_string(), |b| {
            b.enter_blocks("resnets");
            let resnets = (0..=layers_per_block)
                .map(|k| {
                    let cin = if k == 0 { prev } else { out };
                    ResnetBlock::build(b, &k.to_string(), cin, out, groups)
                })
                .collect::<LoadResult<Vec<ResnetBlock>>>()?;
            b.exit();
            let upsampler = if last {
                None
            } else {
                b.enter_blocks("upsamplers");
                let conv = b.scope("0", |b| Conv2d::build(b, "conv", out, out, 3, 1, 1, true))?;
                b.exit();
                Some(conv)
            };
            Ok(UpBlock { resnets, upsampler })
        })?;
        blocks.push(block);
        prev = out;
    }
    Ok(blocks)
}
