//! The transformer's layers: the embedder MLP, the feed-forward, `FluxAttention`, the
//! adaLN-Zero modulation helpers, and the double- and single-stream blocks. The embedder
//! MLP, the feed-forward, the modulation helpers and [`Rope`] are the crate's for
//! Qwen-Image too ([`crate::qwen_image`]): the same Diffusers modules.

use ddo_core::{AttentionInput, BinaryOp, DType, ForwardContext, Ops, Result, Tensor, UnaryOp};

use super::{FluxTransformerConfig, shape_err};
use crate::builder::ModelBuilder;
use crate::error::LoadResult;
use crate::layers::{Linear, RmsNorm};

/// Epsilon of the adaLN layer norms, the FF layer norms and the q/k RMS norms.
pub(crate) const NORM_EPS: f32 = 1e-6;

/// FeedForward / single-block MLP width multiplier (`mlp_ratio = 4`).
const MLP_RATIO: usize = 4;

/// `TimestepEmbedding` / `PixArtAlphaTextProjection(act_fn="silu")`: `linear_2(silu(linear_1(x)))`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SiluMlp {
    linear_1: Linear,
    linear_2: Linear,
}

impl SiluMlp {
    pub(crate) fn build(
        b: &mut ModelBuilder<'_>,
        name: &str,
        inp: usize,
        dim: usize,
    ) -> LoadResult<Self> {
        b.scope(name, |b| {
            Ok(Self {
                linear_1: Linear::build(b, "linear_1", inp, dim, true)?,
                linear_2: Linear::build(b, "linear_2", dim, dim, true)?,
            })
        })
    }

    pub(crate) fn forward(
        &self,
        ctx: &mut ForwardContext<'_>,
        ops: &dyn Ops,
        x: &Tensor,
    ) -> Result<Tensor> {
        let h = ops.unary_owned(self.linear_1.forward(ctx, x)?, UnaryOp::Silu)?;
        self.linear_2.forward(ctx, &h)
    }
}

/// `FeedForward(dim, activation_fn="gelu-approximate")`: `net.2(gelu_tanh(net.0.proj(x)))`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FeedForward {
    proj: Linear,
    out: Linear,
}

impl FeedForward {
    pub(crate) fn build(b: &mut ModelBuilder<'_>, name: &str, dim: usize) -> LoadResult<Self> {
        b.scope(name, |b| {
            b.scope("net", |b| {
                let proj = b.scope("0", |b| {
                    Linear::build(b, "proj", dim, dim * MLP_RATIO, true)
                })?;
                let out = Linear::build(b, "2", dim * MLP_RATIO, dim, true)?;
                Ok(Self { proj, out })
            })
        })
    }

    pub(crate) fn forward(&self, ctx: &mut ForwardContext<'_>, x: &Tensor) -> Result<Tensor> {
        // The projection and its activation are one op (`linear_gelu_tanh`): in the GEMM's
        // epilogue where the backend can, else in place over the projection — this is the
        // widest tensor of a double block.
        let h = self.proj.forward_gelu_tanh(ctx, x)?;
        self.out.forward(ctx, &h)
    }
}

/// The context-stream projections of a double block's attention.
#[derive(Debug, Clone, Copy)]
struct AddedProjections {
    norm_added_q: RmsNorm,
    norm_added_k: RmsNorm,
    add_q_proj: Linear,
    add_k_proj: Linear,
    add_v_proj: Linear,
    to_add_out: Linear,
}

/// `FluxAttention` with `FluxAttnProcessor`: q/k RMS norms per head, joint attention over
/// `[text, image]` (double blocks) or the already joined sequence (single blocks), RoPE.
#[derive(Debug, Clone, Copy)]
struct FluxAttention {
    heads: usize,
    head_dim: usize,
    norm_q: RmsNorm,
    norm_k: RmsNorm,
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    to_out: Option<Linear>,
    added: Option<AddedProjections>,
}

/// The rotary tables of one forward, on the device: `[tokens, head_dim]` each.
#[derive(Debug, Clone)]
pub(crate) struct Rope {
    pub(crate) cos: Tensor,
    pub(crate) sin: Tensor,
}

/// A transformer's rotary tables on a device for the positions `K` names (Flux: the joined
/// ids, [`super::FluxRope`]; Qwen-Image: the image shapes and the text length,
/// [`crate::qwen_image::QwenRope`]), made once and given to each forward over those
/// positions: a denoising loop uploads them once (2 x 2.4 MB for a 1024x1024 Flux image)
/// instead of every step, and a forward whose positions differ makes its own. Dropping it
/// frees them.
#[derive(Debug, Clone)]
pub struct DeviceRope<K> {
    key: K,
    tables: Rope,
}

impl<K: PartialEq> DeviceRope<K> {
    pub(crate) fn new(key: K, tables: Rope) -> Self {
        Self { key, tables }
    }

    /// The tables of `made` when they were made for `key` (tensor handles, no copy).
    pub(crate) fn tables_for(made: Option<&Self>, key: &K) -> Option<Rope> {
        made.filter(|r| r.key == *key).map(|r| r.tables.clone())
    }
}

impl FluxAttention {
    /// Builds `attn` with its leaves in the order the forward runs them (streamed routes
    /// predict their schedule from the leaf order): to_q, to_k, to_v, (add_q/k/v_proj),
    /// norm_q, norm_k, (norm_added_q, norm_added_k, to_out.0, to_add_out). The names are
    /// Diffusers'; only the tree order differs from its registration order.
    fn build(
        b: &mut ModelBuilder<'_>,
        dim: usize,
        heads: usize,
        head_dim: usize,
        joint: bool,
    ) -> LoadResult<Self> {
        b.scope("attn", |b| {
            let to_q = Linear::build(b, "to_q", dim, dim, true)?;
            let to_k = Linear::build(b, "to_k", dim, dim, true)?;
            let to_v = Linear::build(b, "to_v", dim, dim, true)?;
            let added_proj = if joint {
                Some((
                    Linear::build(b, "add_q_proj", dim, dim, true)?,
                    Linear::build(b, "add_k_proj", dim, dim, true)?,
                    Linear::build(b, "add_v_proj", dim, dim, true)?,
                ))
            } else {
                None
            };
            let norm_q = RmsNorm::build(b, "norm_q", head_dim, NORM_EPS)?;
            let norm_k = RmsNorm::build(b, "norm_k", head_dim, NORM_EPS)?;
            let (to_out, added) = match added_proj {
                Some((add_q_proj, add_k_proj, add_v_proj)) => {
                    let norm_added_q = RmsNorm::build(b, "norm_added_q", head_dim, NORM_EPS)?;
                    let norm_added_k = RmsNorm::build(b, "norm_added_k", head_dim, NORM_EPS)?;
                    let to_out = b.scope("to_out", |b| Linear::build(b, "0", dim, dim, true))?;
                    let added = AddedProjections {
                        norm_added_q,
                        norm_added_k,
                        add_q_proj,
                        add_k_proj,
                        add_v_proj,
                        to_add_out: Linear::build(b, "to_add_out", dim, dim, true)?,
                    };
                    (Some(to_out), Some(added))
                }
                None => (None, None),
            };
            Ok(Self {
                heads,
                head_dim,
                norm_q,
                norm_k,
                to_q,
                to_k,
                to_v,
                to_out,
                added,
            })
        })
    }

    /// [`attention_part`] with this attention's heads.
    fn part<'a>(
        &self,
        rope: Option<&'a Rope>,
        x: &'a Tensor,
        start: usize,
        total: usize,
    ) -> AttentionInput<'a> {
        attention_part(self.heads, rope, x, start, total)
    }

    /// Joint attention of `x [b, l, D]` (image stream, or the joined stream of a single
    /// block) and, for double blocks, `context [b, lt, D]` placed first. Returns the image
    /// (or joined) output, and the context output for double blocks.
    fn forward(
        &self,
        ctx: &mut ForwardContext<'_>,
        ops: &dyn Ops,
        x: &Tensor,
        context: Option<&Tensor>,
        rope: &Rope,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let q = self.to_q.forward(ctx, x)?;
        let k = self.to_k.forward(ctx, x)?;
        let v = self.to_v.forward(ctx, x)?;
        // Each stream's q and k are normed per head, joined (context first), moved to
        // [b, h, l, d] and rotated in one pass a stream (Ops::attention_input); v is joined
        // and moved likewise.
        let (q, k, v, context_len) = match (&self.added, context) {
            (Some(a), Some(c)) => {
                let cq = a.add_q_proj.forward(ctx, c)?;
                let ck = a.add_k_proj.forward(ctx, c)?;
                let cv = a.add_v_proj.forward(ctx, c)?;
                let lt = c.shape()[1];
                let total = lt + x.shape()[1];
                // The norms run in the order their leaves were built (streamed routes
                // predict it): the image's q and k, then the context's.
                let qj =
                    self.norm_q
                        .attention_input(ctx, self.part(Some(rope), &q, lt, total), None)?;
                let kj =
                    self.norm_k
                        .attention_input(ctx, self.part(Some(rope), &k, lt, total), None)?;
                drop((q, k));
                let qj = a.norm_added_q.attention_input(
                    ctx,
                    self.part(Some(rope), &cq, 0, total),
                    Some(qj),
                )?;
                let kj = a.norm_added_k.attention_input(
                    ctx,
                    self.part(Some(rope), &ck, 0, total),
                    Some(kj),
                )?;
                drop((cq, ck));
                let vj = ops.attention_input(&self.part(None, &cv, 0, total), None)?;
                let vj = ops.attention_input(&self.part(None, &v, lt, total), Some(vj))?;
                (qj, kj, vj, Some(lt))
            }
            (None, None) => {
                let total = x.shape()[1];
                let qj =
                    self.norm_q
                        .attention_input(ctx, self.part(Some(rope), &q, 0, total), None)?;
                drop(q);
                let kj =
                    self.norm_k
                        .attention_input(ctx, self.part(Some(rope), &k, 0, total), None)?;
                drop(k);
                let vj = ops.attention_input(&self.part(None, &v, 0, total), None)?;
                (qj, kj, vj, None)
            }
            _ => {
                return Err(shape_err(
                    "flux attention",
                    "context states are given to exactly the attentions with added projections",
                ));
            }
        };
        let scale = (1.0 / (self.head_dim as f64).sqrt()) as f32;
        // [b, L, h·d]: the token order the output projections read.
        let o = ops.attention_tokens(&q, &k, &v, None, scale)?;
        drop((q, k, v));
        let s = o.shape().to_vec();
        match (context_len, &self.added, &self.to_out) {
            (Some(lt), Some(a), Some(to_out)) => {
                let c = ops.narrow(&o, 1, 0, lt)?;
                let x = ops.narrow(&o, 1, lt, s[1] - lt)?;
                drop(o);
                let x = to_out.forward(ctx, &x)?;
                let c = a.to_add_out.forward(ctx, &c)?;
                Ok((x, Some(c)))
            }
            _ => Ok((o, None)),
        }
    }
}

/// The part of a joint attention's input that the projection `x` (`heads` heads) fills:
/// rows `start..start + l` of `total`, rotated with `rope` where given (q and k; v is not),
/// its norm added by the norm's leaf ([`RmsNorm::attention_input`]).
pub(crate) fn attention_part<'a>(
    heads: usize,
    rope: Option<&'a Rope>,
    x: &'a Tensor,
    start: usize,
    total: usize,
) -> AttentionInput<'a> {
    AttentionInput {
        x,
        heads,
        norm: None,
        rope: rope.map(|r| (&r.cos, &r.sin)),
        start,
        total,
    }
}

/// `chunk(n, dim=1)` of a modulation `[b, n·D]`, each viewed as `[b, 1, D]`.
pub(crate) fn chunks(ops: &dyn Ops, emb: &Tensor, n: usize) -> Result<Vec<Tensor>> {
    let b = emb.shape()[0];
    let d = emb.shape()[1] / n;
    (0..n)
        .map(|i| ops.narrow(emb, 1, i * d, d)?.reshape(&[b, 1, d]))
        .collect()
}

/// `norm(x) * (1 + scale) + shift` with `norm` a plain layer norm (eps 1e-6), as one op
/// ([`Ops::layer_norm_modulate`]: one kernel on CUDA; on the host the composition
/// `layer_norm`, `affine`, `Mul`, `Add`).
pub(crate) fn modulate(
    ops: &dyn Ops,
    x: &Tensor,
    scale: &Tensor,
    shift: &Tensor,
) -> Result<Tensor> {
    ops.layer_norm_modulate(x, NORM_EPS, scale, shift)
}

/// `x + gate * y`, as one op ([`Ops::gated_add`]: one kernel on CUDA; on the host `Mul`
/// then `Add`).
pub(crate) fn gated_add(ops: &dyn Ops, x: &Tensor, gate: &Tensor, y: &Tensor) -> Result<Tensor> {
    ops.gated_add(x, gate, y)
}

/// A residual stream between blocks: its tensor, or its tensor with the block's last gated
/// add `x + gate * y` still to apply, which the next block's first modulated layer norm
/// applies in the same pass ([`Ops::gated_add_layer_norm_modulate`]: no pass reading the
/// sum back). Either gives the same values as applying the add at once.
#[derive(Debug)]
pub(crate) enum Stream {
    /// The stream's tensor.
    Ready(Tensor),
    /// `x + gate * y`, not yet applied.
    Gated {
        /// The residual.
        x: Tensor,
        /// The gate, one row per group of rows.
        gate: Tensor,
        /// The branch's output.
        y: Tensor,
    },
}

impl Stream {
    /// `x + gate * y`, left to the next norm; applied now (and clipped) where `clip` and
    /// the activations are f16, as the blocks clip their f16 outputs.
    pub(crate) fn gated(
        ops: &dyn Ops,
        x: Tensor,
        gate: &Tensor,
        y: Tensor,
        clip: bool,
    ) -> Result<Self> {
        if clip && x.dtype() == DType::F16 {
            return Ok(Self::Ready(clip_f16(ops, gated_add(ops, &x, gate, &y)?)?));
        }
        Ok(Self::Gated {
            x,
            gate: gate.clone(),
            y,
        })
    }

    /// The stream's tensor, the pending add applied.
    pub(crate) fn resolve(self, ops: &dyn Ops) -> Result<Tensor> {
        match self {
            Self::Ready(t) => Ok(t),
            Self::Gated { x, gate, y } => gated_add(ops, &x, &gate, &y),
        }
    }

    /// The stream's tensor and [`modulate`] of it, the pending add applied in the same op.
    pub(crate) fn modulate(
        self,
        ops: &dyn Ops,
        scale: &Tensor,
        shift: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        match self {
            Self::Ready(t) => {
                let n = modulate(ops, &t, scale, shift)?;
                Ok((t, n))
            }
            Self::Gated { x, gate, y } => {
                ops.gated_add_layer_norm_modulate(&x, &gate, &y, NORM_EPS, scale, shift)
            }
        }
    }
}

/// `x.clip(-65504, 65504)`, as the blocks do for f16 activations.
pub(crate) fn clip_f16(ops: &dyn Ops, x: Tensor) -> Result<Tensor> {
    if x.dtype() != DType::F16 {
        return Ok(x);
    }
    let hi = ops.tensor_from_f32(&[1], DType::F16, &[65504.0])?;
    let lo = ops.tensor_from_f32(&[1], DType::F16, &[-65504.0])?;
    let x = ops.binary(&x, &hi, BinaryOp::Min)?;
    ops.binary(&x, &lo, BinaryOp::Max)
}

/// `FluxTransformerBlock` (double stream).
#[derive(Debug, Clone, Copy)]
pub(super) struct DoubleBlock {
    norm1: Linear,
    norm1_context: Linear,
    attn: FluxAttention,
    ff: FeedForward,
    ff_context: FeedForward,
}

impl DoubleBlock {
    pub(super) fn build(b: &mut ModelBuilder<'_>, c: &FluxTransformerConfig) -> LoadResult<Self> {
        let d = c.inner_dim();
        let norm1 = b.scope("norm1", |b| Linear::build(b, "linear", d, 6 * d, true))?;
        let norm1_context = b.scope("norm1_context", |b| {
            Linear::build(b, "linear", d, 6 * d, true)
        })?;
        let attn = FluxAttention::build(b, d, c.num_attention_heads, c.attention_head_dim, true)?;
        let ff = FeedForward::build(b, "ff", d)?;
        let ff_context = FeedForward::build(b, "ff_context", d)?;
        Ok(Self {
            norm1,
            norm1_context,
            attn,
            ff,
            ff_context,
        })
    }

    /// Returns `(encoder_hidden_states, hidden_states)`, text first, as Diffusers does; each
    /// stream's last gated add is left to the next norm ([`Stream`]).
    pub(super) fn forward(
        &self,
        ctx: &mut ForwardContext<'_>,
        ops: &dyn Ops,
        img: Stream,
        txt: Stream,
        temb_act: &Tensor,
        rope: &Rope,
    ) -> Result<(Stream, Stream)> {
        let m = chunks(ops, &self.norm1.forward(ctx, temb_act)?, 6)?;
        let (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp) =
            (&m[0], &m[1], &m[2], &m[3], &m[4], &m[5]);
        let (img, norm_img) = img.modulate(ops, scale_msa, shift_msa)?;
        let c = chunks(ops, &self.norm1_context.forward(ctx, temb_act)?, 6)?;
        let (c_shift_msa, c_scale_msa, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp) =
            (&c[0], &c[1], &c[2], &c[3], &c[4], &c[5]);
        let (txt, norm_txt) = txt.modulate(ops, c_scale_msa, c_shift_msa)?;

        let (attn_img, attn_txt) = self
            .attn
            .forward(ctx, ops, &norm_img, Some(&norm_txt), rope)?;
        drop((norm_img, norm_txt));
        let attn_txt =
            attn_txt.ok_or_else(|| shape_err("flux double block", "no context output"))?;

        // Each intermediate is dropped as soon as it is used: the block's activation peak is
        // what a streamed transformer adds to its ring. Each stream's last gated add is left
        // to the next block's first norm (the text's clipped first where it is f16).
        let img = {
            let (img, norm) = ops.gated_add_layer_norm_modulate(
                &img, gate_msa, &attn_img, NORM_EPS, scale_mlp, shift_mlp,
            )?;
            drop(attn_img);
            let ff = self.ff.forward(ctx, &norm)?;
            drop(norm);
            Stream::gated(ops, img, gate_mlp, ff, false)?
        };
        let txt = {
            let (txt, norm) = ops.gated_add_layer_norm_modulate(
                &txt,
                c_gate_msa,
                &attn_txt,
                NORM_EPS,
                c_scale_mlp,
                c_shift_mlp,
            )?;
            drop(attn_txt);
            let ff = self.ff_context.forward(ctx, &norm)?;
            drop(norm);
            Stream::gated(ops, txt, c_gate_mlp, ff, true)?
        };
        Ok((txt, img))
    }
}

/// `FluxSingleTransformerBlock` (single stream over `[text, image]`).
#[derive(Debug, Clone, Copy)]
pub(super) struct SingleBlock {
    norm: Linear,
    proj_mlp: Linear,
    proj_out: Linear,
    attn: FluxAttention,
}

impl SingleBlock {
    pub(super) fn build(b: &mut ModelBuilder<'_>, c: &FluxTransformerConfig) -> LoadResult<Self> {
        let d = c.inner_dim();
        let mlp = d * MLP_RATIO;
        // Leaves in execution order (streamed routes predict their schedule from it).
        let norm = b.scope("norm", |b| Linear::build(b, "linear", d, 3 * d, true))?;
        let attn = FluxAttention::build(b, d, c.num_attention_heads, c.attention_head_dim, false)?;
        let proj_mlp = Linear::build(b, "proj_mlp", d, mlp, true)?;
        let proj_out = Linear::build(b, "proj_out", d + mlp, d, true)?;
        Ok(Self {
            norm,
            proj_mlp,
            proj_out,
            attn,
        })
    }

    /// The block on the joined stream `x = [text, image]` (Diffusers concatenates and
    /// splits around every single block; here the stream stays joined through all of them,
    /// which gives the same values without two copies per block).
    ///
    /// Diffusers computes the MLP branch before the attention; the two branches are
    /// independent, and running the attention first keeps the MLP's wide activation out of
    /// the attention's peak. `proj_out` reads both branches in place
    /// ([`Linear::forward_concat`]) instead of their concatenation.
    pub(super) fn forward(
        &self,
        ctx: &mut ForwardContext<'_>,
        ops: &dyn Ops,
        x: Stream,
        temb_act: &Tensor,
        rope: &Rope,
    ) -> Result<Stream> {
        let m = chunks(ops, &self.norm.forward(ctx, temb_act)?, 3)?;
        let (shift, scale, gate) = (&m[0], &m[1], &m[2]);
        let (x, norm_x) = x.modulate(ops, scale, shift)?;
        let (attn, _) = self.attn.forward(ctx, ops, &norm_x, None, rope)?;
        let mlp = self.proj_mlp.forward_gelu_tanh(ctx, &norm_x)?;
        drop(norm_x);
        let h = self.proj_out.forward_concat(ctx, &[&attn, &mlp])?;
        drop((attn, mlp));
        // The gated add is left to the next norm (applied and clipped now where f16).
        Stream::gated(ops, x, gate, h, true)
    }
}
