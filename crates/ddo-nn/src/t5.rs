//! Transformers' `T5EncoderModel` (the encoder stack of T5 / T5 v1.1, as Flux and SD3 use
//! it for their second text encoder), on the `Ops` plane with its weights as leaves.
//!
//! Matches `transformers` 5.x `modeling_t5.py` for an encoder (`is_decoder=False`):
//!
//! - token embedding `shared` (no scaling); the encoder's `embed_tokens` is the same tied
//!   table, so only one leaf exists, loaded from `shared.weight` or, for checkpoints written
//!   with the other name only, `encoder.embed_tokens.weight`;
//! - T5LayerNorm: `x * rsqrt(mean(x²) + eps) * weight`, no mean subtraction, no bias;
//! - self-attention without the `1/√d_kv` scaling; the bidirectional relative position bias
//!   `[1, heads, L, L]` is computed by `encoder.block.0` (the only block that owns
//!   `relative_attention_bias`) and reused by every later block;
//! - feed-forward `wo(act(wi_0(x)) * wi_1(x))` for gated activations (`gated-gelu` =
//!   `gelu_new`, T5 v1.1 / XXL) or `wo(act(wi(x)))` otherwise (`relu`, original T5);
//! - pre-norm residual blocks, then `encoder.final_layer_norm`. Dropout is the identity.
//!   In f16, hidden states are clamped after each sub-layer as `T5Block` does (to
//!   ±(max − 1000) when any is infinite).
//!
//! Difference from Transformers in half precision: Transformers keeps `wo` in f32
//! (`_keep_in_fp32_modules`) and rounds T5LayerNorm's normalised value to the weight's
//! dtype before the multiply; here every leaf runs in the dtype of its params and each op
//! rounds once at its end. In f32 the two agree to rounding.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use ddo_core::{
    BinaryOp, Component, ComponentProgram, CoreError, DType, Device, ForwardContext, LeafKind, Ops,
    ParamKind, ReduceOp, Result, Tensor, UnaryOp,
};
use serde::Deserialize;

use crate::builder::ModelBuilder;
use crate::error::{LoadError, LoadResult};
use crate::fp8::{T5_SKIP_PATTERNS, source_target, stored_as};
use crate::layers::{Embedding, Linear, RmsNorm, ops};
use crate::weights::{CheckpointWeights, UnusedWeights, View, ViewKind, WeightSource};

/// The component name of the T5 encoder in Flux / SD3 pipelines.
pub const COMPONENT_NAME: &str = "text_encoder_2";
/// The Transformers class this module ports.
pub const CLASS_NAME: &str = "T5EncoderModel";

fn default_vocab_size() -> usize {
    32128
}
fn default_d_model() -> usize {
    512
}
fn default_d_kv() -> usize {
    64
}
fn default_d_ff() -> usize {
    2048
}
fn default_num_layers() -> usize {
    6
}
fn default_num_heads() -> usize {
    8
}
fn default_buckets() -> usize {
    32
}
fn default_max_distance() -> usize {
    128
}
fn default_eps() -> f64 {
    1e-6
}
fn default_feed_forward_proj() -> String {
    "relu".into()
}

/// The fields of Transformers' `T5Config` the encoder uses (the defaults are
/// Transformers'; other fields of `config.json` are ignored).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct T5Config {
    /// Rows of the token embedding.
    #[serde(default = "default_vocab_size")]
    pub vocab_size: usize,
    /// Hidden size.
    #[serde(default = "default_d_model")]
    pub d_model: usize,
    /// Size of one attention head.
    #[serde(default = "default_d_kv")]
    pub d_kv: usize,
    /// Inner size of the feed-forward layer.
    #[serde(default = "default_d_ff")]
    pub d_ff: usize,
    /// Encoder blocks.
    #[serde(default = "default_num_layers")]
    pub num_layers: usize,
    /// Attention heads.
    #[serde(default = "default_num_heads")]
    pub num_heads: usize,
    /// Relative position buckets (half per direction in the encoder).
    #[serde(default = "default_buckets")]
    pub relative_attention_num_buckets: usize,
    /// Distance from which all relative positions share the last bucket.
    #[serde(default = "default_max_distance")]
    pub relative_attention_max_distance: usize,
    /// T5LayerNorm epsilon.
    #[serde(default = "default_eps")]
    pub layer_norm_epsilon: f64,
    /// `"gated-gelu"` (T5 v1.1), `"relu"` (T5), or `[gated-]ACT` for another activation
    /// Transformers names (`gelu`, `gelu_new`, `silu`, ...).
    #[serde(default = "default_feed_forward_proj")]
    pub feed_forward_proj: String,
}

/// An activation of T5's feed-forward layer, by Transformers' `ACT2FN` name.
fn activation(name: &str) -> Option<UnaryOp> {
    Some(match name {
        "relu" => UnaryOp::Relu,
        "gelu" => UnaryOp::GeluErf,
        "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => UnaryOp::GeluTanh,
        "silu" | "swish" => UnaryOp::Silu,
        "quick_gelu" => UnaryOp::QuickGelu,
        "sigmoid" => UnaryOp::Sigmoid,
        "tanh" => UnaryOp::Tanh,
        _ => return None,
    })
}

impl T5Config {
    /// `google/t5-v1_1-xxl`'s encoder, as `FLUX.1-dev/text_encoder_2` ships it.
    pub fn t5_xxl() -> Self {
        Self {
            vocab_size: 32128,
            d_model: 4096,
            d_kv: 64,
            d_ff: 10240,
            num_layers: 24,
            num_heads: 64,
            relative_attention_num_buckets: 32,
            relative_attention_max_distance: 128,
            layer_norm_epsilon: 1e-6,
            feed_forward_proj: "gated-gelu".into(),
        }
    }

    /// Reads a Transformers `config.json` and validates it.
    pub fn from_file(path: &Path) -> LoadResult<Self> {
        let text = crate::weights::read_text_file(path)?;
        Self::from_json_str(&text, path)
    }

    /// Parses config JSON (`origin` names it in errors) and validates it.
    pub fn from_json_str(text: &str, origin: &Path) -> LoadResult<Self> {
        let config: Self = serde_json::from_str(text).map_err(|e| LoadError::Config {
            file: origin.to_path_buf(),
            message: format!("not a T5 config: {e}"),
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Whether the feed-forward layer is gated (`gated-*`).
    pub fn is_gated_act(&self) -> bool {
        self.feed_forward_proj.split('-').next() == Some("gated")
    }

    /// The activation name Transformers derives from `feed_forward_proj` (its
    /// `dense_act_fn`; `gated-gelu` means `gelu_new` for backward compatibility).
    pub fn dense_act_fn(&self) -> &str {
        if self.feed_forward_proj == "gated-gelu" {
            "gelu_new"
        } else {
            self.feed_forward_proj
                .rsplit('-')
                .next()
                .unwrap_or(&self.feed_forward_proj)
        }
    }

    /// The feed-forward activation, or a typed error naming the valid ones.
    pub fn activation(&self) -> LoadResult<UnaryOp> {
        let parts: Vec<&str> = self.feed_forward_proj.split('-').collect();
        let well_formed = matches!(parts.as_slice(), [_] | ["gated", _]);
        let act = if well_formed {
            activation(self.dense_act_fn())
        } else {
            None
        };
        act.ok_or_else(|| LoadError::InvalidConfig {
            field: "feed_forward_proj".into(),
            value: self.feed_forward_proj.clone(),
            hint: "use `gated-gelu` (T5 v1.1), `relu` (T5), or `[gated-]ACT` with ACT one of \
                   relu, gelu, gelu_new, gelu_pytorch_tanh, gelu_fast, silu, swish, quick_gelu, \
                   sigmoid, tanh"
                .into(),
        })
    }

    /// `num_heads * d_kv`, the width of q, k, v.
    pub fn inner_dim(&self) -> usize {
        self.num_heads * self.d_kv
    }

    /// Checks every field; a bad one is [`LoadError::InvalidConfig`].
    pub fn validate(&self) -> LoadResult<()> {
        let bad = |field: &str, value: String, hint: &str| {
            Err(LoadError::InvalidConfig {
                field: field.into(),
                value,
                hint: hint.into(),
            })
        };
        for (field, v) in [
            ("vocab_size", self.vocab_size),
            ("d_model", self.d_model),
            ("d_kv", self.d_kv),
            ("d_ff", self.d_ff),
            ("num_layers", self.num_layers),
            ("num_heads", self.num_heads),
        ] {
            if v == 0 {
                return bad(field, "0".into(), "must be at least 1");
            }
        }
        if self.num_heads.checked_mul(self.d_kv).is_none() {
            return bad("d_kv", self.d_kv.to_string(), "num_heads * d_kv overflows");
        }
        if self.vocab_size > u32::MAX as usize {
            return bad(
                "vocab_size",
                self.vocab_size.to_string(),
                "token ids are u32: at most 4294967295",
            );
        }
        let buckets = self.relative_attention_num_buckets;
        if buckets < 4 {
            return bad(
                "relative_attention_num_buckets",
                buckets.to_string(),
                "the encoder's bidirectional buckets need at least 4 (2 exact, 2 logarithmic \
                 per direction); T5 uses 32",
            );
        }
        let max_exact = buckets / 4;
        if self.relative_attention_max_distance <= max_exact {
            return bad(
                "relative_attention_max_distance",
                self.relative_attention_max_distance.to_string(),
                &format!(
                    "must exceed relative_attention_num_buckets / 4 = {max_exact} (T5 uses 128)"
                ),
            );
        }
        if !self.layer_norm_epsilon.is_finite() || self.layer_norm_epsilon < 0.0 {
            return bad(
                "layer_norm_epsilon",
                self.layer_norm_epsilon.to_string(),
                "must be a finite number >= 0 (T5 uses 1e-6)",
            );
        }
        self.activation()?;
        Ok(())
    }

    /// Parameter count of `T5EncoderModel` at this config (the tied embedding once).
    pub fn param_count(&self) -> u64 {
        let (d, inner, ff) = (
            self.d_model as u64,
            self.inner_dim() as u64,
            self.d_ff as u64,
        );
        let ff_mats = if self.is_gated_act() { 3 } else { 2 };
        let block = 4 * d * inner + ff_mats * d * ff + 2 * d;
        self.vocab_size as u64 * d
            + self.num_layers as u64 * block
            + (self.relative_attention_num_buckets * self.num_heads) as u64
            + d
    }
}

/// Transformers' `T5Attention._relative_position_bucket`: the bucket of
/// `relative_position = key_position - query_position`. Bidirectional (encoder): half the
/// buckets for keys after the query; in each half, exact buckets for distances below
/// `num_buckets / 4`, then logarithmic bins up to `max_distance`, then the last bucket.
/// The logarithm is evaluated in f32, as PyTorch does, so bucket edges match.
pub fn relative_position_bucket(
    relative_position: i64,
    bidirectional: bool,
    num_buckets: usize,
    max_distance: usize,
) -> usize {
    let mut buckets = num_buckets as i64;
    let mut out = 0i64;
    let distance = if bidirectional {
        buckets /= 2;
        if relative_position > 0 {
            out += buckets;
        }
        relative_position.abs()
    } else {
        -relative_position.min(0)
    };
    let max_exact = buckets / 2;
    if distance < max_exact {
        return (out + distance) as usize;
    }
    let log_ratio = ((max_distance as f64) / (max_exact as f64)).ln() as f32;
    let scaled =
        (distance as f32 / max_exact as f32).ln() / log_ratio * (buckets - max_exact) as f32;
    let large = (max_exact + scaled as i64).min(buckets - 1);
    (out + large) as usize
}

/// Bucket ids `[q_len * k_len]` (row-major, query major) for an encoder's self-attention.
pub fn relative_position_buckets(config: &T5Config, q_len: usize, k_len: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(q_len * k_len);
    for q in 0..q_len as i64 {
        for k in 0..k_len as i64 {
            out.push(relative_position_bucket(
                k - q,
                true,
                config.relative_attention_num_buckets,
                config.relative_attention_max_distance,
            ) as u32);
        }
    }
    out
}

struct T5Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    relative_attention_bias: Option<Embedding>,
}

enum T5FeedForward {
    Gated {
        wi_0: Linear,
        wi_1: Linear,
        wo: Linear,
    },
    Plain {
        wi: Linear,
        wo: Linear,
    },
}

struct T5Block {
    attn_norm: RmsNorm,
    attn: T5Attention,
    ff_norm: RmsNorm,
    ff: T5FeedForward,
}

/// The encoder's forward program (what the component runs): ids in, `last_hidden_state` out.
pub struct T5EncoderProgram {
    config: T5Config,
    act: UnaryOp,
    shared: Embedding,
    blocks: Vec<T5Block>,
    final_layer_norm: RmsNorm,
}

/// Transformers' `T5EncoderModel` as a DDO component.
pub struct T5Encoder {
    component: Arc<Component>,
    program: Arc<T5EncoderProgram>,
}

impl std::fmt::Debug for T5Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("T5Encoder")
            .field("config", &self.program.config)
            .field("component", &self.component)
            .finish()
    }
}

impl T5Encoder {
    /// Builds the encoder with Transformers' weight names (`shared.weight`, falling back to
    /// `encoder.embed_tokens.weight`; `encoder.block.N.layer.0.SelfAttention.q.weight`, ...).
    /// The component is named `text_encoder_2`, class `T5EncoderModel`.
    pub fn build(weights: &mut dyn WeightSource, config: &T5Config) -> LoadResult<Self> {
        config.validate()?;
        let act = config.activation()?;
        let (d, inner, ff) = (config.d_model, config.inner_dim(), config.d_ff);
        let eps = config.layer_norm_epsilon as f32;
        let mut b = ModelBuilder::new(weights);

        let table = b.weights().param_any(
            &["shared.weight", "encoder.embed_tokens.weight"],
            &[config.vocab_size, d],
            ParamKind::Parameter,
        )?;
        let shared = Embedding::from_leaf(b.leaf_with(
            "shared",
            LeafKind::Embedding,
            vec![("weight".into(), table)],
        )?);

        b.enter("encoder");
        b.enter_blocks("block");
        let mut blocks = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            b.enter(i.to_string());
            b.enter_blocks("layer");

            // Leaves in execution order (streamed routes predict their schedule from it).
            b.enter("0");
            let attn_norm = RmsNorm::build(&mut b, "layer_norm", d, eps)?;
            b.enter("SelfAttention");
            let q = Linear::build(&mut b, "q", d, inner, false)?;
            let k = Linear::build(&mut b, "k", d, inner, false)?;
            let v = Linear::build(&mut b, "v", d, inner, false)?;
            let relative_attention_bias = if i == 0 {
                Some(Embedding::build(
                    &mut b,
                    "relative_attention_bias",
                    config.relative_attention_num_buckets,
                    config.num_heads,
                )?)
            } else {
                None
            };
            let o = Linear::build(&mut b, "o", inner, d, false)?;
            b.exit();
            b.exit();

            b.enter("1");
            let ff_norm = RmsNorm::build(&mut b, "layer_norm", d, eps)?;
            b.enter("DenseReluDense");
            let feed_forward = if config.is_gated_act() {
                T5FeedForward::Gated {
                    wi_0: Linear::build(&mut b, "wi_0", d, ff, false)?,
                    wi_1: Linear::build(&mut b, "wi_1", d, ff, false)?,
                    wo: Linear::build(&mut b, "wo", ff, d, false)?,
                }
            } else {
                T5FeedForward::Plain {
                    wi: Linear::build(&mut b, "wi", d, ff, false)?,
                    wo: Linear::build(&mut b, "wo", ff, d, false)?,
                }
            };
            b.exit();
            b.exit();

            b.exit(); // layer
            b.exit(); // block i
            blocks.push(T5Block {
                attn_norm,
                attn: T5Attention {
                    q,
                    k,
                    v,
                    o,
                    relative_attention_bias,
                },
                ff_norm,
                ff: feed_forward,
            });
        }
        b.exit(); // block
        let final_layer_norm = RmsNorm::build(&mut b, "final_layer_norm", d, eps)?;
        b.exit(); // encoder

        let program = Arc::new(T5EncoderProgram {
            config: config.clone(),
            act,
            shared,
            blocks,
            final_layer_norm,
        });
        let component = b.finish(COMPONENT_NAME, CLASS_NAME, program.clone())?;
        Ok(Self { component, program })
    }

    /// Loads a Transformers model folder (`config.json` and `model.safetensors`, single or
    /// sharded), converting weights to `dtype` when given.
    pub fn from_dir(dir: &Path, dtype: Option<DType>) -> LoadResult<Self> {
        Self::from_dir_checked(dir, dtype, UnusedWeights::Refuse)
    }

    /// [`T5Encoder::from_dir`], with what to do about checkpoint tensors the config leaves unused
    /// (refused by default).
    pub fn from_dir_checked(
        dir: &Path,
        dtype: Option<DType>,
        unused: UnusedWeights,
    ) -> LoadResult<Self> {
        let config = T5Config::from_file(&dir.join("config.json"))?;
        // The tied duplicate of `shared.weight`, when a checkpoint keeps both names.
        let tied = ["encoder.embed_tokens.weight"];
        // fp8 storage: the linears' weights as scaled fp8, the rest as stored.
        CheckpointWeights::build_in(dir, source_target(dtype), &tied, unused, |w| {
            stored_as(w, dtype, &T5_SKIP_PATTERNS, |w| Self::build(w, &config))
        })
    }

    /// Loads a single safetensors file in the Transformers layout (`shared.weight`,
    /// `encoder.block.N...`, as a folder's `model.safetensors` and ComfyUI's
    /// `t5xxl_fp8_e4m3fn.safetensors` are) with `config`; `dtype` as
    /// [`T5Encoder::from_dir`]. ComfyUI's `scaled_fp8` marker is left alone. A `.gguf` file
    /// (city96's T5 encoders) is read in llama.cpp's names ([`gguf_views`]), its quantized
    /// tensors kept as blocks (or dequantized at load with a `dtype`, as for any GGUF file:
    /// [`CheckpointWeights::open_file`]).
    pub fn load_file(
        path: &Path,
        config: &T5Config,
        dtype: Option<DType>,
        unused: UnusedWeights,
    ) -> LoadResult<Self> {
        let mut w = CheckpointWeights::open_file(path, source_target(dtype))?;
        if crate::weights::is_gguf(path) {
            w = w.with_views(gguf_views(config));
        }
        let model = stored_as(&mut w, dtype, &T5_SKIP_PATTERNS, |w| Self::build(w, config))?;
        w.check_unused(
            &[
                "encoder.embed_tokens.weight",
                crate::flux::original::SCALED_FP8_MARKER,
            ],
            unused,
        )?;
        Ok(model)
    }

    /// A model with seeded random weights stored as `dtype` (an 8-bit float: bf16 weights,
    /// the linears' stored as scaled fp8, as [`T5Encoder::from_dir`] does).
    pub fn random(config: &T5Config, seed: u64, dtype: DType) -> LoadResult<Self> {
        Self::build_as(
            &mut crate::weights::RandomWeights::new(seed, dtype.compute()),
            config,
            Some(dtype),
        )
    }

    /// [`T5Encoder::build`] with the weights stored as `dtype` asks: an 8-bit float stores
    /// the linears' as scaled fp8 ([`crate::fp8`]), the rest as `weights` gives them.
    pub fn build_as(
        weights: &mut dyn WeightSource,
        config: &T5Config,
        dtype: Option<DType>,
    ) -> LoadResult<Self> {
        stored_as(weights, dtype, &T5_SKIP_PATTERNS, |w| {
            Self::build(w, config)
        })
    }

    /// The component (attach routes to it).
    pub fn component(&self) -> &Arc<Component> {
        &self.component
    }

    /// The config.
    pub fn config(&self) -> &T5Config {
        &self.program.config
    }

    /// The program the component runs (ids as an f32 tensor in, `last_hidden_state` out).
    pub fn program(&self) -> &Arc<T5EncoderProgram> {
        &self.program
    }

    /// `last_hidden_state [1, L, d_model]` of one sequence, every position attended (as
    /// FluxPipeline calls it: padding included, no mask).
    pub fn forward(&self, device: &dyn Device, input_ids: &[u32]) -> Result<Tensor> {
        self.forward_with_mask(device, input_ids, None)
    }

    /// As [`T5Encoder::forward`], with Transformers' `attention_mask` (1 = attend,
    /// 0 = padding: keys at 0 get the dtype's lowest value added to their scores).
    pub fn forward_with_mask(
        &self,
        device: &dyn Device,
        input_ids: &[u32],
        attention_mask: Option<&[u32]>,
    ) -> Result<Tensor> {
        self.component.run(device, |ctx| {
            self.program.run(ctx, input_ids, attention_mask)
        })
    }
}

/// A T5 encoder's Transformers param names mapped onto llama.cpp's GGUF names
/// (`token_embd`, `enc.blk.N.attn_q` ..., as gguf-py's `tensor_mapping` maps them and
/// city96's T5 GGUFs hold them): `DenseReluDense.wi_0` is `ffn_gate`, `wi_1` `ffn_up`, `wo`
/// `ffn_down`; block 0's relative attention bias `attn_rel_b`.
pub fn gguf_views(config: &T5Config) -> HashMap<String, View> {
    let whole = |t: &str| View {
        tensor: t.to_string(),
        kind: ViewKind::Whole,
    };
    let mut v = HashMap::new();
    v.insert("shared.weight".to_string(), whole("token_embd.weight"));
    v.insert(
        "encoder.final_layer_norm.weight".to_string(),
        whole("enc.output_norm.weight"),
    );
    for i in 0..config.num_layers {
        let hf = format!("encoder.block.{i}.layer");
        let gg = format!("enc.blk.{i}");
        for (ours, theirs) in [
            ("0.SelfAttention.q", "attn_q"),
            ("0.SelfAttention.k", "attn_k"),
            ("0.SelfAttention.v", "attn_v"),
            ("0.SelfAttention.o", "attn_o"),
            ("0.SelfAttention.relative_attention_bias", "attn_rel_b"),
            ("0.layer_norm", "attn_norm"),
            ("1.layer_norm", "ffn_norm"),
            ("1.DenseReluDense.wi_0", "ffn_gate"),
            ("1.DenseReluDense.wi_1", "ffn_up"),
            ("1.DenseReluDense.wo", "ffn_down"),
        ] {
            v.insert(
                format!("{hf}.{ours}.weight"),
                whole(&format!("{gg}.{theirs}.weight")),
            );
        }
    }
    v
}

/// The lowest finite value of `dtype` (what Transformers adds for masked positions).
pub(crate) fn dtype_min(dtype: DType) -> f32 {
    match dtype {
        DType::F16 => -65504.0,
        DType::BF16 => -3.389_531_4e38,
        _ => f32::MIN,
    }
}

/// T5Block's fp16 guard: in f16, hidden states are clamped to ±(65504 − 1000) when any is
/// infinite, else to ±65504 (a no-op on finite values); other dtypes pass through.
fn clamp_f16(ops: &dyn Ops, x: Tensor) -> Result<Tensor> {
    if x.dtype() != DType::F16 || x.numel() == 0 {
        return Ok(x);
    }
    let flat = x.reshape(&[x.numel()])?;
    let high = ops.to_f32_vec(&ops.reduce(&flat, 0, ReduceOp::Max)?)?;
    let low = ops.to_f32_vec(&ops.reduce(&ops.unary(&flat, UnaryOp::Neg)?, 0, ReduceOp::Max)?)?;
    if !high.iter().chain(&low).any(|v| v.is_infinite()) {
        return Ok(x);
    }
    let limit = 65504.0 - 1000.0;
    let max = ops.tensor_from_f32(&[1], DType::F16, &[limit])?;
    let min = ops.tensor_from_f32(&[1], DType::F16, &[-limit])?;
    ops.binary(&ops.binary(&x, &max, BinaryOp::Min)?, &min, BinaryOp::Max)
}

/// Token ids from a `[L]` or `[1, L]` f32 tensor of whole numbers.
pub(crate) fn ids_from_tensor(ctx: &ForwardContext<'_>, input: &Tensor) -> Result<Vec<u32>> {
    let len = match input.shape() {
        [l] | [1, l] => *l,
        other => {
            return Err(CoreError::Shape {
                what: "input_ids".into(),
                message: format!("expected [L] or [1, L] (batch 1), got {other:?}"),
            });
        }
    };
    let values = if input.is_on_device() {
        ops(ctx)?.to_f32_vec(input)?
    } else {
        input.host_f32()?
    };
    let mut ids = Vec::with_capacity(len);
    for v in values {
        if !(v >= 0.0 && v.fract() == 0.0 && v <= u32::MAX as f32) {
            return Err(CoreError::InvalidOption {
                option: "input_ids".into(),
                value: v.to_string(),
                hint: "token ids are whole numbers >= 0".into(),
            });
        }
        ids.push(v as u32);
    }
    Ok(ids)
}

/// Refuses empty sequences and ids outside the vocabulary.
pub(crate) fn check_ids(ids: &[u32], vocab_size: usize) -> Result<()> {
    if ids.is_empty() {
        return Err(CoreError::InvalidOption {
            option: "input_ids".into(),
            value: "[]".into(),
            hint: "give at least one token".into(),
        });
    }
    if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab_size) {
        return Err(CoreError::InvalidOption {
            option: "input_ids".into(),
            value: bad.to_string(),
            hint: format!("token ids must be below vocab_size = {vocab_size}"),
        });
    }
    Ok(())
}

/// `[1, L, h * d]` → `[1, h, L, d]`.
pub(crate) fn split_heads(
    ops: &dyn Ops,
    x: &Tensor,
    heads: usize,
    head_dim: usize,
) -> Result<Tensor> {
    let len = x.shape()[1];
    ops.permute(&x.reshape(&[1, len, heads, head_dim])?, &[0, 2, 1, 3])
}

impl T5EncoderProgram {
    fn run(
        &self,
        ctx: &mut ForwardContext<'_>,
        ids: &[u32],
        attention_mask: Option<&[u32]>,
    ) -> Result<Tensor> {
        let cfg = &self.config;
        check_ids(ids, cfg.vocab_size)?;
        let len = ids.len();
        if let Some(mask) = attention_mask {
            if mask.len() != len {
                return Err(CoreError::Shape {
                    what: "attention_mask".into(),
                    message: format!("has {} entries for {len} tokens", mask.len()),
                });
            }
            if let Some(bad) = mask.iter().find(|&&m| m > 1) {
                return Err(CoreError::InvalidOption {
                    option: "attention_mask".into(),
                    value: bad.to_string(),
                    hint: "1 attends a token, 0 masks it".into(),
                });
            }
        }
        let ops = ops(ctx)?;
        let mut x = self
            .shared
            .forward(ctx, ids)?
            .reshape(&[1, len, cfg.d_model])?;
        // The additive attention term (relative position bias, plus the padding mask),
        // computed by block 0 and shared by every block.
        let mut bias: Option<Tensor> = None;
        for block in &self.blocks {
            let h = block.attn_norm.forward(ctx, &x)?;
            let attn = &block.attn;
            let q = split_heads(ops, &attn.q.forward(ctx, &h)?, cfg.num_heads, cfg.d_kv)?;
            let k = split_heads(ops, &attn.k.forward(ctx, &h)?, cfg.num_heads, cfg.d_kv)?;
            let v = split_heads(ops, &attn.v.forward(ctx, &h)?, cfg.num_heads, cfg.d_kv)?;
            if bias.is_none() {
                bias = Some(self.position_bias(ctx, attn, len, attention_mask)?);
            }
            let a = ops.attention_tokens(&q, &k, &v, bias.as_ref(), 1.0)?;
            let a = attn.o.forward(ctx, &a)?;
            x = clamp_f16(ops, ops.binary(&x, &a, BinaryOp::Add)?)?;

            let h = block.ff_norm.forward(ctx, &x)?;
            let y = match &block.ff {
                T5FeedForward::Gated { wi_0, wi_1, wo } => {
                    let gate = ops.unary(&wi_0.forward(ctx, &h)?, self.act)?;
                    let linear = wi_1.forward(ctx, &h)?;
                    wo.forward(ctx, &ops.binary(&gate, &linear, BinaryOp::Mul)?)?
                }
                T5FeedForward::Plain { wi, wo } => {
                    let hidden = ops.unary(&wi.forward(ctx, &h)?, self.act)?;
                    wo.forward(ctx, &hidden)?
                }
            };
            x = clamp_f16(ops, ops.binary(&x, &y, BinaryOp::Add)?)?;
        }
        self.final_layer_norm.forward(ctx, &x)
    }

    /// `[1, heads, L, L]`: the relative position bias of `attn` (block 0), with the padding
    /// mask's large negative value added on masked keys.
    fn position_bias(
        &self,
        ctx: &mut ForwardContext<'_>,
        attn: &T5Attention,
        len: usize,
        attention_mask: Option<&[u32]>,
    ) -> Result<Tensor> {
        let cfg = &self.config;
        let table = attn
            .relative_attention_bias
            .ok_or_else(|| CoreError::Shape {
                what: "T5 encoder".into(),
                message: "block 0 has no relative_attention_bias".into(),
            })?;
        let ops = ops(ctx)?;
        let buckets = relative_position_buckets(cfg, len, len);
        let values = table.forward(ctx, &buckets)?; // [L*L, heads]
        let bias = ops
            .permute(&values.reshape(&[len, len, cfg.num_heads])?, &[2, 0, 1])?
            .reshape(&[1, cfg.num_heads, len, len])?;
        match attention_mask {
            Some(mask) if mask.contains(&0) => {
                let min = dtype_min(bias.dtype());
                let additive: Vec<f32> = mask
                    .iter()
                    .map(|&m| if m == 0 { min } else { 0.0 })
                    .collect();
                let additive = ops.tensor_from_f32(&[1, 1, 1, len], bias.dtype(), &additive)?;
                ops.binary(&bias, &additive, BinaryOp::Add)
            }
            _ => Ok(bias),
        }
    }
}

impl ComponentProgram for T5EncoderProgram {
    /// `input`: token ids as f32, `[1, L]` (or `[L]`) → `last_hidden_state [1, L, d_model]`.
    fn forward(&self, ctx: &mut ForwardContext<'_>, input: Tensor) -> Result<Tensor> {
        let ids = ids_from_tensor(ctx, &input)?;
        self.run(ctx, &ids, None)
    }
}
