//! [`QwenTextEncoderConfig`]: the language model's fields of a Transformers `config.json` of
//! `Qwen2_5_VLForConditionalGeneration`, in either layout Transformers writes.
//!
//! - transformers 5.x (and 4.5x, which also kept the fields at the top level): the text
//!   fields under `text_config`, the rotary settings in `rope_parameters`
//!   (`{"rope_type": "default", "mrope_section": [...], "rope_theta": ...}`). As in 5.x
//!   (`Qwen2_5_VLConfig.__post_init__`), a `text_config` object is used alone when present.
//! - older files (`Qwen/Qwen2.5-VL-7B-Instruct` as published): the text fields at the top
//!   level, `rope_theta` beside them and `rope_scaling` `{"type": "mrope", "mrope_section": ...}`,
//!   which 5.x reads as `rope_type` `default` (`convert_rope_params_to_dict`).
//!
//! Missing fields take `Qwen2_5_VLTextConfig`'s defaults (transformers 5.24), unknown fields
//! (the vision config, token ids, `tie_word_embeddings`, ...) are ignored. What DDO does not
//! run is refused by name: a sliding window, a rotary type other than the default (or
//! `mrope`, the same thing for text), an `mrope_section` that does not cover the rotary pairs.

use std::path::Path;

use ddo_core::UnaryOp;
use serde::Deserialize;

use crate::error::{LoadError, LoadResult};

/// The language model's config (Transformers' `Qwen2_5_VLTextConfig` fields the encoder uses).
#[derive(Debug, Clone, PartialEq)]
pub struct QwenTextEncoderConfig {
    /// Rows of the token embedding (Qwen2.5-VL: 152064, past the tokenizer's 151665 ids).
    pub vocab_size: usize,
    /// Hidden size.
    pub hidden_size: usize,
    /// Inner width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads; a head is `hidden_size / num_attention_heads` wide.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention: each serves
    /// `num_attention_heads / num_key_value_heads` query heads).
    pub num_key_value_heads: usize,
    /// The MLP's gate activation (`silu` for Qwen).
    pub hidden_act: String,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// The multimodal rotary split of the pairs over (time, height, width); text-only input
    /// has the same position on the three axes, so it does not change the rotation (checked
    /// against `head_dim / 2` as Transformers' split would need).
    pub mrope_section: Option<Vec<usize>>,
    /// Longest sequence the model was trained for (informational: rotary positions are
    /// computed for any length, as Transformers does).
    pub max_position_embeddings: usize,
}

/// The rotary settings, as `rope_parameters` (5.x) or `rope_scaling` (older) spell them.
#[derive(Debug, Default, Deserialize)]
struct RawRope {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    legacy_type: Option<String>,
    rope_theta: Option<f64>,
    mrope_section: Option<Vec<usize>>,
}

/// A field that is present, `null` or not: `Some(value)`.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Option<usize>>, D::Error> {
    Option::<usize>::deserialize(d).map(Some)
}

/// The JSON fields read, all optional (Transformers' defaults fill the rest).
#[derive(Debug, Default, Deserialize)]
struct RawTextConfig {
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    /// Outer `None`: absent (the class default); `Some(None)`: JSON `null`.
    #[serde(default, deserialize_with = "present")]
    num_key_value_heads: Option<Option<usize>>,
    hidden_act: Option<String>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_parameters: Option<RawRope>,
    rope_scaling: Option<RawRope>,
    max_position_embeddings: Option<usize>,
    use_sliding_window: Option<bool>,
}

impl Default for QwenTextEncoderConfig {
    /// `Qwen2_5_VLTextConfig`'s defaults in transformers 5.24 (its 72B widths; real configs
    /// give every field).
    fn default() -> Self {
        Self {
            vocab_size: 152064,
            hidden_size: 8192,
            intermediate_size: 29568,
            num_hidden_layers: 80,
            num_attention_heads: 64,
            num_key_value_heads: 8,
            hidden_act: "silu".into(),
            rms_norm_eps: 1e-5,
            rope_theta: 1e6,
            mrope_section: None,
            max_position_embeddings: 32768,
        }
    }
}

impl QwenTextEncoderConfig {
    /// Qwen2.5-VL 7B's language model, Qwen-Image's `text_encoder`: hidden 3584, 28 layers,
    /// 28 heads of 128 with 4 kv heads, SwiGLU width 18944, vocabulary 152064, rope theta
    /// 1e6, RMSNorm eps 1e-6, mrope section (16, 24, 24).
    pub fn qwen2_5_vl_7b() -> Self {
        Self {
            vocab_size: 152064,
            hidden_size: 3584,
            intermediate_size: 18944,
            num_hidden_layers: 28,
            num_attention_heads: 28,
            num_key_value_heads: 4,
            hidden_act: "silu".into(),
            rms_norm_eps: 1e-6,
            rope_theta: 1e6,
            mrope_section: Some(vec![16, 24, 24]),
            max_position_embeddings: 128000,
        }
    }

    /// A tiny one for tests and CI (`qwen-text-tiny`, the `qwen_text_encoder` fixture's):
    /// hidden 32, 2 layers, 4 heads of 8 with 2 kv heads, SwiGLU width 64, 416 rows, mrope
    /// section (1, 1, 2).
    pub fn tiny() -> Self {
        Self {
            vocab_size: 416,
            hidden_size: 32,
            intermediate_size: 64,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            hidden_act: "silu".into(),
            rms_norm_eps: 1e-6,
            rope_theta: 1e6,
            mrope_section: Some(vec![1, 1, 2]),
            max_position_embeddings: 256,
        }
    }

    /// The names [`QwenTextEncoderConfig::named`] knows.
    pub const NAMES: [&'static str; 2] = ["qwen2.5-vl-7b", "qwen-text-tiny"];

    /// The config of a named model: `qwen2.5-vl-7b` or `qwen-text-tiny`.
    pub fn named(name: &str) -> Option<Self> {
        match name {
            "qwen2.5-vl-7b" | "qwen2_5_vl_7b" => Some(Self::qwen2_5_vl_7b()),
            "qwen-text-tiny" | "qwen_text_tiny" => Some(Self::tiny()),
            _ => None,
        }
    }

    /// Reads and validates a Transformers `config.json`.
    pub fn from_file(path: &Path) -> LoadResult<Self> {
        let text = crate::weights::read_text_file(path)?;
        Self::parse(&text, path)
    }

    /// Parses and validates config JSON text (`origin` names it in errors).
    pub fn parse(text: &str, origin: &Path) -> LoadResult<Self> {
        let bad = |e: serde_json::Error| LoadError::Config {
            file: origin.to_path_buf(),
            message: format!(
                "{e}; expected the config.json of a Qwen2_5_VLForConditionalGeneration (or its \
                 text model) as Transformers writes it"
            ),
        };
        let mut value: serde_json::Value = serde_json::from_str(text).map_err(bad)?;
        if let Some(text_config) = value.get_mut("text_config")
            && text_config.is_object()
        {
            value = text_config.take();
        }
        let raw: RawTextConfig = serde_json::from_value(value).map_err(bad)?;
        let config = Self::from_raw(raw)?;
        config.validate()?;
        Ok(config)
    }

    fn from_raw(raw: RawTextConfig) -> LoadResult<Self> {
        if raw.use_sliding_window == Some(true) {
            return Err(invalid(
                "use_sliding_window",
                "true".into(),
                "sliding-window attention is not implemented (Qwen2.5-VL's configs set it false, \
                 and Transformers' SDPA path does not apply it either)",
            ));
        }
        let d = Self::default();
        // 5.x: `rope_parameters`; older: `rope_scaling` plus a top-level `rope_theta`
        // (`convert_rope_params_to_dict`: `rope_scaling or rope_parameters`).
        let rope = raw.rope_scaling.or(raw.rope_parameters).unwrap_or_default();
        let kind = rope.rope_type.or(rope.legacy_type);
        if let Some(kind) = kind.as_deref()
            && kind != "default"
            && kind != "mrope"
        {
            return Err(invalid(
                "rope_parameters.rope_type",
                kind.into(),
                "only the default rotary embedding (`default`, or `mrope`, which is the same \
                 rotation for text) is implemented",
            ));
        }
        let heads = raw.num_attention_heads.unwrap_or(d.num_attention_heads);
        Ok(Self {
            vocab_size: raw.vocab_size.unwrap_or(d.vocab_size),
            hidden_size: raw.hidden_size.unwrap_or(d.hidden_size),
            intermediate_size: raw.intermediate_size.unwrap_or(d.intermediate_size),
            num_hidden_layers: raw.num_hidden_layers.unwrap_or(d.num_hidden_layers),
            num_attention_heads: heads,
            // `null` means one kv head per query head (Transformers' backward compatibility);
            // a missing field is the class default.
            num_key_value_heads: match raw.num_key_value_heads {
                Some(kv) => kv.unwrap_or(heads),
                None => d.num_key_value_heads,
            },
            hidden_act: raw.hidden_act.unwrap_or(d.hidden_act),
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(d.rms_norm_eps),
            rope_theta: rope.rope_theta.or(raw.rope_theta).unwrap_or(d.rope_theta),
            mrope_section: rope.mrope_section,
            max_position_embeddings: raw
                .max_position_embeddings
                .unwrap_or(d.max_position_embeddings),
        })
    }

    /// `hidden_size / num_attention_heads` (Transformers' attention ignores a `head_dim` field).
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads.max(1)
    }

    /// Query heads per key/value head.
    pub fn kv_groups(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads.max(1)
    }

    /// The width of k and v: `num_key_value_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim()
    }

    /// The MLP's gate activation, or a typed error naming the valid ones.
    pub fn activation(&self) -> LoadResult<UnaryOp> {
        match self.hidden_act.as_str() {
            "silu" | "swish" => Ok(UnaryOp::Silu),
            "gelu" => Ok(UnaryOp::GeluErf),
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Ok(UnaryOp::GeluTanh),
            "relu" => Ok(UnaryOp::Relu),
            other => Err(invalid(
                "hidden_act",
                other.into(),
                "use silu (Qwen), swish, gelu, gelu_new, gelu_pytorch_tanh, gelu_fast or relu",
            )),
        }
    }

    /// Checks every field; a bad one is [`LoadError::InvalidConfig`] naming it.
    pub fn validate(&self) -> LoadResult<()> {
        for (field, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
        ] {
            if v == 0 {
                return Err(invalid(field, "0".into(), "must be at least 1"));
            }
        }
        if self.vocab_size > u32::MAX as usize {
            return Err(invalid(
                "vocab_size",
                self.vocab_size.to_string(),
                "token ids are u32: at most 4294967295",
            ));
        }
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(invalid(
                "num_attention_heads",
                self.num_attention_heads.to_string(),
                &format!(
                    "must divide hidden_size = {} (Qwen2.5-VL 7B: 3584 / 28)",
                    self.hidden_size
                ),
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(invalid(
                "num_attention_heads",
                self.num_attention_heads.to_string(),
                &format!(
                    "the head width hidden_size / num_attention_heads = {} must be even (rotary pairs)",
                    self.head_dim()
                ),
            ));
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(invalid(
                "num_key_value_heads",
                self.num_key_value_heads.to_string(),
                &format!(
                    "must divide num_attention_heads = {} (grouped-query attention; Qwen2.5-VL \
                     7B: 28 / 4)",
                    self.num_attention_heads
                ),
            ));
        }
        if let Some(section) = &self.mrope_section {
            let sum: usize = section.iter().sum();
            if sum != self.head_dim() / 2 {
                return Err(invalid(
                    "rope_parameters.mrope_section",
                    format!("{section:?}"),
                    &format!(
                        "the sections sum to {sum} but must sum to head_dim / 2 = {} (Qwen2.5-VL \
                         7B: [16, 24, 24] of 64 pairs)",
                        self.head_dim() / 2
                    ),
                ));
            }
        }
        if !self.rms_norm_eps.is_finite() || self.rms_norm_eps < 0.0 {
            return Err(invalid(
                "rms_norm_eps",
                self.rms_norm_eps.to_string(),
                "must be a finite number >= 0 (Qwen2.5-VL uses 1e-6)",
            ));
        }
        if !self.rope_theta.is_finite() || self.rope_theta <= 0.0 {
            return Err(invalid(
                "rope_theta",
                self.rope_theta.to_string(),
                "must be a finite number > 0 (Qwen2.5-VL uses 1000000)",
            ));
        }
        let widths = self
            .num_key_value_heads
            .checked_mul(self.head_dim())
            .zip(self.hidden_size.checked_mul(self.intermediate_size))
            .zip(self.vocab_size.checked_mul(self.hidden_size));
        if widths.is_none() {
            return Err(invalid(
                "hidden_size",
                self.hidden_size.to_string(),
                "the model's weight sizes overflow",
            ));
        }
        self.activation()?;
        Ok(())
    }

    /// Params of one decoder layer: q, k, v (with biases), o, the three MLP matrices and two
    /// norms.
    pub fn layer_params(&self) -> u64 {
        let (d, kv, ff) = (
            self.hidden_size as u64,
            self.kv_dim() as u64,
            self.intermediate_size as u64,
        );
        (d * d + d) + 2 * (d * kv + kv) + d * d + 3 * d * ff + 2 * d
    }

    /// Params of the encoder: the token embedding, the layers and the final norm (no vision
    /// tower, no `lm_head`: neither takes part in prompt encoding).
    pub fn param_count(&self) -> u64 {
        let d = self.hidden_size as u64;
        self.vocab_size as u64 * d + self.num_hidden_layers as u64 * self.layer_params() + d
    }
}

fn invalid(field: &str, value: String, hint: &str) -> LoadError {
    LoadError::InvalidConfig {
        field: field.into(),
        value,
        hint: hint.into(),
    }
}
