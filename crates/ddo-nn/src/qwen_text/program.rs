//! [`QwenTextProgram`]: the language model's layers in execution order and its forward, with
//! the weightless tables it uploads (rotary cos/sin, the causal + padding mask) computed on
//! the host ([`rope_tables`], [`causal_mask`]).

use ddo_core::{
    BinaryOp, ComponentProgram, CoreError, ForwardContext, Ops, Result, Tensor, UnaryOp,
};

use super::config::QwenTextEncoderConfig;
use super::inputs::QwenTextInputs;
use crate::builder::ModelBuilder;
use crate::error::LoadResult;
use crate::layers::{Embedding, Linear, RmsNorm, ops};
use crate::t5::{dtype_min, ids_from_tensor};

/// One decoder layer's leaves (Transformers' `Qwen2_5_VLDecoderLayer`).
struct DecoderLayer {
    input_layernorm: RmsNorm,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    post_attention_layernorm: RmsNorm,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

/// The encoder's forward program (what the component runs).
pub struct QwenTextProgram {
    config: QwenTextEncoderConfig,
    act: UnaryOp,
    embed_tokens: Embedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
}

impl std::fmt::Debug for QwenTextProgram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QwenTextProgram")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// A hook handed each intermediate by name (see [`QwenTextProgram::run`]).
pub(crate) type Tap<'t> = &'t mut dyn FnMut(&str, &Tensor) -> Result<()>;

impl QwenTextProgram {
    /// Builds the leaves under the builder's current position (the language model's
    /// container), in the order the forward runs them: `embed_tokens`; per layer
    /// `input_layernorm`, `self_attn.{q,k,v,o}_proj`, `post_attention_layernorm`,
    /// `mlp.{gate,up,down}_proj`; `norm`.
    pub(crate) fn build(
        b: &mut ModelBuilder<'_>,
        config: &QwenTextEncoderConfig,
    ) -> LoadResult<Self> {
        config.validate()?;
        let act = config.activation()?;
        let (d, kv, ff) = (
            config.hidden_size,
            config.kv_dim(),
            config.intermediate_size,
        );
        let eps = config.rms_norm_eps as f32;
        let embed_tokens = Embedding::build(b, "embed_tokens", config.vocab_size, d)?;
        b.enter_blocks("layers");
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            b.enter(i.to_string());
            let input_layernorm = RmsNorm::build(b, "input_layernorm", d, eps)?;
            b.enter("self_attn");
            let q_proj = Linear::build(b, "q_proj", d, d, true)?;
            let k_proj = Linear::build(b, "k_proj", d, kv, true)?;
            let v_proj = Linear::build(b, "v_proj", d, kv, true)?;
            let o_proj = Linear::build(b, "o_proj", d, d, false)?;
            b.exit();
            let post_attention_layernorm = RmsNorm::build(b, "post_attention_layernorm", d, eps)?;
            b.enter("mlp");
            let gate_proj = Linear::build(b, "gate_proj", d, ff, false)?;
            let up_proj = Linear::build(b, "up_proj", d, ff, false)?;
            let down_proj = Linear::build(b, "down_proj", ff, d, false)?;
            b.exit();
            b.exit();
            layers.push(DecoderLayer {
                input_layernorm,
                q_proj,
                k_proj,
                v_proj,
                o_proj,
                post_attention_layernorm,
                gate_proj,
                up_proj,
                down_proj,
            });
        }
        b.exit();
        let norm = RmsNorm::build(b, "norm", d, eps)?;
        Ok(Self {
            config: config.clone(),
            act,
            embed_tokens,
            layers,
            norm,
        })
    }

    /// The config.
    pub fn config(&self) -> &QwenTextEncoderConfig {
        &self.config
    }

    /// The forward: `last_hidden_state [batch, seq, hidden]`, handing `tap` the token
    /// embeddings (`embed_tokens`), each layer's output (`layers.<i>`) and the final norm's
    /// (`norm`, the returned tensor), under the language model's module names.
    pub(crate) fn run(
        &self,
        ctx: &mut ForwardContext<'_>,
        inputs: &QwenTextInputs,
        tap: Tap<'_>,
    ) -> Result<Tensor> {
        let cfg = &self.config;
        let (batch, len) = inputs.check(cfg.vocab_size)?;
        let ops = ops(ctx)?;
        let (d, heads, kv_heads, hd) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim(),
        );
        let mut x = self
            .embed_tokens
            .forward(ctx, &inputs.input_ids)?
            .reshape(&[batch, len, d])?;
        tap("embed_tokens", &x)?;
        let dtype = x.dtype();
        let (cos, sin) = rope_tables(len, hd, cfg.rope_theta);
        let cos = ops.tensor_from_f32(&[len, hd], dtype, &cos)?;
        let sin = ops.tensor_from_f32(&[len, hd], dtype, &sin)?;
        let mask = causal_mask(
            inputs.attention_mask.as_deref(),
            batch,
            len,
            dtype_min(dtype),
        );
        let mask = ops.tensor_from_f32(&[batch, 1, len, len], dtype, &mask)?;
        let scale = (hd as f64).powf(-0.5) as f32;

        for (i, layer) in self.layers.iter().enumerate() {
            let h = layer.input_layernorm.forward(ctx, &x)?;
            let q = rotary_heads(ops, &layer.q_proj.forward(ctx, &h)?, heads, hd)?;
            let k = rotary_heads(ops, &layer.k_proj.forward(ctx, &h)?, kv_heads, hd)?;
            let v = ops.permute(
                &layer
                    .v_proj
                    .forward(ctx, &h)?
                    .reshape(&[batch, len, kv_heads, hd])?,
                &[0, 2, 1, 3],
            )?;
            let q = ops.rope(&q, &cos, &sin)?;
            let k = repeat_kv(ops, &ops.rope(&k, &cos, &sin)?, cfg.kv_groups())?;
            let v = repeat_kv(ops, &v, cfg.kv_groups())?;
            let a = ops.attention_tokens(&q, &k, &v, Some(&mask), scale)?;
            let a = layer.o_proj.forward(ctx, &a)?;
            x = ops.binary(&x, &a, BinaryOp::Add)?;

            let h = layer.post_attention_layernorm.forward(ctx, &x)?;
            let gate = ops.unary_owned(layer.gate_proj.forward(ctx, &h)?, self.act)?;
            let up = layer.up_proj.forward(ctx, &h)?;
            let y = layer
                .down_proj
                .forward(ctx, &ops.binary(&gate, &up, BinaryOp::Mul)?)?;
            x = ops.binary(&x, &y, BinaryOp::Add)?;
            tap(&format!("layers.{i}"), &x)?;
        }
        let out = self.norm.forward(ctx, &x)?;
        tap("norm", &out)?;
        Ok(out)
    }
}

/// `[b, L, h · d]` → `[b, h, L, d]` with each head's channels reordered from Transformers'
/// rotate-half layout (pair `j` = channels `j` and `j + d/2`) to interleaved pairs
/// (channels `2j`, `2j + 1`), the layout [`Ops::rope`] rotates. q and k are reordered alike,
/// so their dot products — the attention scores — are those of the original layout; v is
/// not reordered, so the attention output is in Transformers' channel order.
fn rotary_heads(ops: &dyn Ops, x: &Tensor, heads: usize, head_dim: usize) -> Result<Tensor> {
    let (b, len) = (x.shape()[0], x.shape()[1]);
    ops.permute(
        &x.reshape(&[b, len, heads, 2, head_dim / 2])?,
        &[0, 2, 1, 4, 3],
    )?
    .reshape(&[b, heads, len, head_dim])
}

/// Transformers' `repeat_kv`: `[b, kv, L, d]` → `[b, kv · groups, L, d]`, kv head `j` serving
/// query heads `j · groups .. (j + 1) · groups`.
fn repeat_kv(ops: &dyn Ops, x: &Tensor, groups: usize) -> Result<Tensor> {
    if groups == 1 {
        return Ok(x.clone());
    }
    let (b, kv, len, d) = (x.shape()[0], x.shape()[1], x.shape()[2], x.shape()[3]);
    let flat = x.reshape(&[b, kv, 1, len * d])?;
    let copies = vec![&flat; groups];
    ops.concat(&copies, 2)?.reshape(&[b, kv * groups, len, d])
}

/// The rotary tables of positions `0..len` for heads of `head_dim`, as
/// `Qwen2_5_VLRotaryEmbedding` computes them for text (f32 throughout: `inv_freq_j = 1 /
/// theta^(2j / head_dim)`, angle `position · inv_freq_j`, then cos and sin, each correctly
/// rounded), laid out for [`Ops::rope`] on the reordered heads of the forward: each pair's
/// value repeated for its two channels. Returns `(cos, sin)`, each row-major `[len, head_dim]`.
///
/// Transformers 5.24 gives text-only input (no image grid) the positions `arange(len)` on
/// all three multimodal axes, padding or not, and recomposes the frequencies from the
/// `mrope_section` chunks of the three axes: the same frequencies, so plain 1-D RoPE.
pub fn rope_tables(len: usize, head_dim: usize, theta: f64) -> (Vec<f32>, Vec<f32>) {
    let theta = theta as f32;
    let inv_freq: Vec<f32> = (0..head_dim / 2)
        .map(|j| {
            let exponent = (2 * j) as f32 / head_dim as f32;
            1.0 / ((theta as f64).powf(exponent as f64) as f32)
        })
        .collect();
    let mut cos = Vec::with_capacity(len * head_dim);
    let mut sin = Vec::with_capacity(len * head_dim);
    for p in 0..len {
        for &f in &inv_freq {
            let angle = (p as f32 * f) as f64;
            let (c, s) = (angle.cos() as f32, angle.sin() as f32);
            cos.extend([c, c]);
            sin.extend([s, s]);
        }
    }
    (cos, sin)
}

/// The additive attention mask `[batch, 1, len, len]` row-major: `0` where query `q` may
/// attend key `k` — `k <= q` (causal) and key `k` not padding (`attention_mask[b · len + k]
/// == 1`) — and `masked` elsewhere (the dtype's lowest value, as Transformers' eager mask
/// adds; SDPA's boolean mask is the same on every row with a key left). Queries of padding
/// tokens keep their causal row, as in Transformers; a query with no key left (left padding)
/// gets every key masked alike, which attends evenly instead of giving NaN.
pub fn causal_mask(
    attention_mask: Option<&[u32]>,
    batch: usize,
    len: usize,
    masked: f32,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(batch * len * len);
    for b in 0..batch {
        for q in 0..len {
            out.extend((0..len).map(|k| {
                let padding = attention_mask.is_some_and(|m| m[b * len + k] == 0);
                if k <= q && !padding { 0.0 } else { masked }
            }));
        }
    }
    out
}

impl ComponentProgram for QwenTextProgram {
    /// `input`: token ids as f32, `[L]` or `[1, L]` → `last_hidden_state [1, L, hidden]`
    /// (causal, no padding mask).
    fn forward(&self, ctx: &mut ForwardContext<'_>, input: Tensor) -> Result<Tensor> {
        let ids = ids_from_tensor(ctx, &input)?;
        self.run(ctx, &QwenTextInputs::single(ids), &mut |_, _| Ok(()))
    }
}

/// A shape error of the inputs.
pub(crate) fn input_err(what: &str, message: impl Into<String>) -> CoreError {
    CoreError::Shape {
        what: what.into(),
        message: message.into(),
    }
}
