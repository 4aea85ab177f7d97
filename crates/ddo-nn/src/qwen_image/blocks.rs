//! Qwen-Image's dual-stream block (`QwenImageTransformerBlock`) and its joint attention
//! (`Attention` with `QwenDoubleStreamAttnProcessor2_0`). The feed-forward, the modulation
//! helpers and the rotary tables are Flux's ([`crate::flux::blocks`]): the same Diffusers
//! modules.

use ddo_core::{ForwardContext, Ops, Result, Tensor};

use super::QwenImageTransformerConfig;
use crate::builder::ModelBuilder;
use crate::error::LoadResult;
use crate::flux::blocks::{FeedForward, NORM_EPS, Rope, Stream, attention_part, chunks};
use crate::layers::{Linear, RmsNorm};

/// `Attention(added_kv_proj_dim=dim, qk_norm="rms_norm", context_pre_only=False, bias=True)`
/// with `QwenDoubleStreamAttnProcessor2_0`: q/k/v of both streams, per-head RMS norms on the
/// queries and keys, rotary embedding, one attention over `[text, image]` with the text
/// padding mask on the keys, and an output projection per stream.
#[derive(Debug, Clone, Copy)]
struct JointAttention {
    heads: usize,
    head_dim: usize,
    to_q: Linear,
    to_k: Linear,
    to_v: Linear,
    add_q_proj: Linear,
    add_k_proj: Linear,
    add_v_proj: Linear,
    norm_q: RmsNorm,
    norm_k: RmsNorm,
    norm_added_q: RmsNorm,
    norm_added_k: RmsNorm,
    to_out: Linear,
    to_add_out: Linear,
}

impl JointAttention {
    /// Builds `attn` with its leaves in the order the processor runs them (streamed routes
    /// predict their schedule from the leaf order): to_q, to_k, to_v, add_q/k/v_proj,
    /// norm_q, norm_k, norm_added_q, norm_added_k, to_out.0, to_add_out.
    fn build(b: &mut ModelBuilder<'_>, c: &QwenImageTransformerConfig) -> LoadResult<Self> {
        let d = c.inner_dim();
        let hd = c.attention_head_dim;
        b.scope("attn", |b| {
            Ok(Self {
                heads: c.num_attention_heads,
                head_dim: hd,
                to_q: Linear::build(b, "to_q", d, d, true)?,
                to_k: Linear::build(b, "to_k", d, d, true)?,
                to_v: Linear::build(b, "to_v", d, d, true)?,
                add_q_proj: Linear::build(b, "add_q_proj", d, d, true)?,
                add_k_proj: Linear::build(b, "add_k_proj", d, d, true)?,
                add_v_proj: Linear::build(b, "add_v_proj", d, d, true)?,
                norm_q: RmsNorm::build(b, "norm_q", hd, NORM_EPS)?,
                norm_k: RmsNorm::build(b, "norm_k", hd, NORM_EPS)?,
                norm_added_q: RmsNorm::build(b, "norm_added_q", hd, NORM_EPS)?,
                norm_added_k: RmsNorm::build(b, "norm_added_k", hd, NORM_EPS)?,
                to_out: b.scope("to_out", |b| Linear::build(b, "0", d, d, true))?,
                to_add_out: Linear::build(b, "to_add_out", d, d, true)?,
            })
        })
    }

    /// Joint attention of the image stream `img [b, li, D]` and the text stream
    /// `txt [b, lt, D]` (placed first), with `rope` over `[text, image]` and the additive
    /// key `mask` (`[b, 1, 1, lt + li]`) when some text token is padding. Returns
    /// `(image, text)` outputs, as the processor does.
    fn forward(
        &self,
        ctx: &mut ForwardContext<'_>,
        ops: &dyn Ops,
        img: &Tensor,
        txt: &Tensor,
        rope: &Rope,
        mask: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        let q = self.to_q.forward(ctx, img)?;
        let k = self.to_k.forward(ctx, img)?;
        let v = self.to_v.forward(ctx, img)?;
        let cq = self.add_q_proj.forward(ctx, txt)?;
        let ck = self.add_k_proj.forward(ctx, txt)?;
        let cv = self.add_v_proj.forward(ctx, txt)?;
        let lt = txt.shape()[1];
        let total = lt + img.shape()[1];
        // Diffusers rotates each stream with its own table and then joins them; the rotation
        // is per token, so each stream's rows of the joined output rotated with the joined
        // table's rows are the same values. Each stream's q and k are normed, placed at its
        // rows of [b, h, l, d] and rotated in one pass (Ops::attention_input), in the order
        // the norms' leaves were built (streamed routes predict it); v is placed likewise.
        let qj = self.norm_q.attention_input(
            ctx,
            attention_part(self.heads, Some(rope), &q, lt, total),
            None,
        )?;
        let kj = self.norm_k.attention_input(
            ctx,
            attention_part(self.heads, Some(rope), &k, lt, total),
            None,
        )?;
        drop((q, k));
        let q = self.norm_added_q.attention_input(
            ctx,
            attention_part(self.heads, Some(rope), &cq, 0, total),
            Some(qj),
        )?;
        let k = self.norm_added_k.attention_input(
            ctx,
            attention_part(self.heads, Some(rope), &ck, 0, total),
            Some(kj),
        )?;
        drop((cq, ck));
        let vj = ops.attention_input(&attention_part(self.heads, None, &v, lt, total), None)?;
        let v = ops.attention_input(&attention_part(self.heads, None, &cv, 0, total), Some(vj))?;
        drop(cv);
        let scale = (1.0 / (self.head_dim as f64).sqrt()) as f32;
        // [b, L, h·d]: the token order the output projections read.
        let o = ops.attention_tokens(&q, &k, &v, mask, scale)?;
        drop((q, k, v));
        let s = o.shape().to_vec();
        let txt_out = ops.narrow(&o, 1, 0, lt)?;
        let img_out = ops.narrow(&o, 1, lt, s[1] - lt)?;
        drop(o);
        let img_out = self.to_out.forward(ctx, &img_out)?;
        let txt_out = self.to_add_out.forward(ctx, &txt_out)?;
        Ok((img_out, txt_out))
    }
}

/// `QwenImageTransformerBlock`: the image and text streams, each modulated from the
/// timestep embedding, through one joint attention and a feed-forward each.
#[derive(Debug, Clone, Copy)]
pub(super) struct DualStreamBlock {
    img_mod: Linear,
    txt_mod: Linear,
    attn: JointAttention,
    img_mlp: FeedForward,
    txt_mlp: FeedForward,
}

impl DualStreamBlock {
    /// Builds one block with its leaves in execution order: `img_mod.1`, `txt_mod.1`, the
    /// attention, `img_mlp`, `txt_mlp` (Diffusers registers `txt_mod` after the image
    /// stream's modules but runs it before the attention). The layer norms have no params.
    pub(super) fn build(
        b: &mut ModelBuilder<'_>,
        c: &QwenImageTransformerConfig,
    ) -> LoadResult<Self> {
        let d = c.inner_dim();
        // `nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))`: the linear is child `1`.
        let img_mod = b.scope("img_mod", |b| Linear::build(b, "1", d, 6 * d, true))?;
        let txt_mod = b.scope("txt_mod", |b| Linear::build(b, "1", d, 6 * d, true))?;
        let attn = JointAttention::build(b, c)?;
        let img_mlp = FeedForward::build(b, "img_mlp", d)?;
        let txt_mlp = FeedForward::build(b, "txt_mlp", d)?;
        Ok(Self {
            img_mod,
            txt_mod,
            attn,
            img_mlp,
            txt_mlp,
        })
    }

    /// The block on `img [b, li, D]` and `txt [b, lt, D]` with `temb_act = silu(temb)`
    /// (each modulation's `SiLU`, computed once for all blocks). Returns
    /// `(encoder_hidden_states, hidden_states)`, text first, as Diffusers does; each
    /// stream's last gated add is left to the next block's first norm ([`Stream`]; applied
    /// and clipped at once where f16).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward(
        &self,
        ctx: &mut ForwardContext<'_>,
        ops: &dyn Ops,
        img: Stream,
        txt: Stream,
        temb_act: &Tensor,
        rope: &Rope,
        mask: Option<&Tensor>,
    ) -> Result<(Stream, Stream)> {
        // Chunks (shift, scale, gate) for the attention, then for the MLP.
        let m = chunks(ops, &self.img_mod.forward(ctx, temb_act)?, 6)?;
        let c = chunks(ops, &self.txt_mod.forward(ctx, temb_act)?, 6)?;
        let (img, norm_img) = img.modulate(ops, &m[1], &m[0])?;
        let (txt, norm_txt) = txt.modulate(ops, &c[1], &c[0])?;
        let (attn_img, attn_txt) = self
            .attn
            .forward(ctx, ops, &norm_img, &norm_txt, rope, mask)?;
        drop((norm_img, norm_txt));

        // Each intermediate is dropped as soon as it is used: the block's activation peak is
        // what a streamed transformer adds to its ring.
        // Each stream's gated add and the norm that reads it are one op
        // (`gated_add_layer_norm_modulate`).
        let img = {
            let (img, norm) =
                ops.gated_add_layer_norm_modulate(&img, &m[2], &attn_img, NORM_EPS, &m[4], &m[3])?;
            drop(attn_img);
            let ff = self.img_mlp.forward(ctx, &norm)?;
            drop(norm);
            Stream::gated(ops, img, &m[5], ff, true)?
        };
        let txt = {
            let (txt, norm) =
                ops.gated_add_layer_norm_modulate(&txt, &c[2], &attn_txt, NORM_EPS, &c[4], &c[3])?;
            drop(attn_txt);
            let ff = self.txt_mlp.forward(ctx, &norm)?;
            drop(norm);
            Stream::gated(ops, txt, &c[5], ff, true)?
        };
        Ok((txt, img))
    }
}
