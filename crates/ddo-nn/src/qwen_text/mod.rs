//! Qwen-Image's text encoder: the language model of Transformers'
//! `Qwen2_5_VLForConditionalGeneration` (Qwen2.5-VL 7B), for text-only prompts, with the
//! prompt encoding of Diffusers' `QwenImagePipeline` ([`QwenPromptEncoder`]) and the Qwen
//! tokenizer of a pipeline's `tokenizer/` folder ([`QwenTokenizer`]).
//!
//! Matches transformers 5.24 `modeling_qwen2_5_vl.py` (`Qwen2_5_VLTextModel`) for input ids
//! without images:
//!
//! - `embed_tokens`, then pre-norm decoder layers: `x + o_proj(attn(input_layernorm(x)))`,
//!   then `x + down_proj(silu(gate_proj(h)) * up_proj(h))` with `h =
//!   post_attention_layernorm(x)`, then the final `norm` (RMSNorm, `x * rsqrt(mean(x²) + eps) *
//!   weight`), whose output is `last_hidden_state` (and `hidden_states[-1]`, which the pipeline
//!   takes);
//! - grouped-query attention: q, k, v projections with biases, o without; `num_key_value_heads`
//!   k/v heads repeated to the query heads as `repeat_kv` does (kv head `j` serves query heads
//!   `j·g .. (j+1)·g`); scale `head_dim^-0.5`; a causal mask with the padding keys masked;
//! - rotary embedding in Transformers' rotate-half layout, `inv_freq_j = 1 / rope_theta^(2j /
//!   head_dim)`. For text-only input the multimodal rotary embedding is plain 1-D RoPE:
//!   `Qwen2_5_VLModel.compute_3d_position_ids` returns no positions without an image or video
//!   grid, so `Qwen2_5_VLTextModel.forward` uses `arange(seq)` expanded to the three axes
//!   (time, height, width) for every row, padded or not; `Qwen2_5_VLRotaryEmbedding` computes
//!   the same frequencies on the three axes, and `recomposition_frequencies` picks the
//!   `mrope_section` chunks of the pairs from axes 0, 1, 2 — the same values, so each pair
//!   `j` rotates by `position · inv_freq_j` whatever the sections. [`rope_tables`] computes
//!   that table.
//!
//! The vision tower (`visual.*`) is never loaded: its tensors and the unused `lm_head` are
//! skipped by name (checkpoint tensors are memory-mapped, so skipped ones are never read) and
//! not counted as unused weights. Weight names: transformers 5.24 `save_pretrained` writes
//! the legacy names of the published Qwen2.5-VL checkpoints, `model.embed_tokens.weight`,
//! `model.layers.<i>...`, `model.norm.weight`; the module tree of 5.x has
//! `model.language_model.<...>`, and a bare text model `embed_tokens.weight`, ... —
//! [`QwenTextEncoder::build`] takes whichever the source has (the component tree then has
//! the same levels).

mod config;
mod inputs;
mod program;
mod prompt;
mod tokenizer;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use ddo_core::{Component, DType, Device, Result, Tensor};

use crate::builder::ModelBuilder;
use crate::error::LoadResult;
use crate::fp8::{QWEN_TEXT_SKIP_PATTERNS, source_target, stored_as};
use crate::weights::{
    CheckpointWeights, RandomWeights, UnusedWeights, View, ViewKind, WeightSource,
};

pub use config::QwenTextEncoderConfig;
pub use inputs::QwenTextInputs;
pub use program::{QwenTextProgram, causal_mask, rope_tables};
pub use prompt::{
    DEFAULT_MAX_SEQUENCE_LENGTH, MAX_SEQUENCE_LENGTH_LIMIT, PROMPT_TEMPLATE,
    PROMPT_TEMPLATE_START_IDX, QwenPromptEmbeds, QwenPromptEncoder, TOKENIZER_MAX_LENGTH,
    split_prompt_states, templated,
};
pub use tokenizer::{DEFAULT_PAD_TOKEN, QWEN_SPLIT, QwenTokenizer};

/// The component name of the text encoder in a Qwen-Image pipeline.
pub const COMPONENT_NAME: &str = "text_encoder";
/// The Transformers class whose language model this ports.
pub const CLASS_NAME: &str = "Qwen2_5_VLForConditionalGeneration";

/// The name prefixes of the checkpoint that prompt encoding never reads: the vision tower
/// (legacy `visual.` and 5.x `model.visual.`) and the language-model head.
pub const SKIPPED_PREFIXES: [&str; 3] = ["visual.", "model.visual.", "lm_head."];

/// The `general.architecture` of the GGUF files [`QwenTextEncoder::load_file`] takes: llama.cpp
/// writes Qwen2.5-VL's language model as `qwen2vl` (and a Qwen2 text model, the same layers,
/// as `qwen2`).
pub const GGUF_ARCHITECTURES: [&str; 2] = ["qwen2vl", "qwen2"];

/// The language model's Transformers names (the legacy `model.` layout) mapped onto
/// llama.cpp's GGUF names, as gguf-py's `tensor_mapping` maps them for `qwen2vl` (its
/// converter writes q and k unpermuted): `embed_tokens` is `token_embd`, the final `norm`
/// `output_norm`; per layer `input_layernorm` `attn_norm`, `self_attn.{q,k,v}_proj`
/// `attn_{q,k,v}` (weights and biases), `o_proj` `attn_output`, `post_attention_layernorm`
/// `ffn_norm`, `mlp.{gate,up,down}_proj` `ffn_{gate,up,down}`.
pub fn gguf_views(config: &QwenTextEncoderConfig) -> HashMap<String, View> {
    let whole = |t: String| View {
        tensor: t,
        kind: ViewKind::Whole,
    };
    let mut v = HashMap::new();
    v.insert(
        "model.embed_tokens.weight".to_string(),
        whole("token_embd.weight".into()),
    );
    v.insert(
        "model.norm.weight".to_string(),
        whole("output_norm.weight".into()),
    );
    for i in 0..config.num_hidden_layers {
        for (ours, theirs, kinds) in [
            ("input_layernorm", "attn_norm", &["weight"][..]),
            ("self_attn.q_proj", "attn_q", &["weight", "bias"][..]),
            ("self_attn.k_proj", "attn_k", &["weight", "bias"][..]),
            ("self_attn.v_proj", "attn_v", &["weight", "bias"][..]),
            ("self_attn.o_proj", "attn_output", &["weight"][..]),
            ("post_attention_layernorm", "ffn_norm", &["weight"][..]),
            ("mlp.gate_proj", "ffn_gate", &["weight"][..]),
            ("mlp.up_proj", "ffn_up", &["weight"][..]),
            ("mlp.down_proj", "ffn_down", &["weight"][..]),
        ] {
            for kind in kinds {
                v.insert(
                    format!("model.layers.{i}.{ours}.{kind}"),
                    whole(format!("blk.{i}.{theirs}.{kind}")),
                );
            }
        }
    }
    v
}

/// The layouts of the language model's names, most common first: `model.` (legacy, what
/// checkpoints hold), `model.language_model.` (transformers 5.x modules), and none (a bare
/// `Qwen2_5_VLTextModel`).
const LAYOUTS: [&[&str]; 3] = [&["model"], &["model", "language_model"], &[]];

/// Qwen2.5-VL's language model as the text encoder component (`text_encoder`).
#[derive(Debug, Clone)]
pub struct QwenTextEncoder {
    component: Arc<Component>,
    program: Arc<QwenTextProgram>,
    prefix: String,
}

impl QwenTextEncoder {
    /// Builds the encoder from `weights` under the first layout the source has
    /// (`model.embed_tokens.weight`, else `model.language_model.embed_tokens.weight`, else
    /// `embed_tokens.weight`; seeded random weights have every name and take the first).
    /// The component is named `text_encoder`, class `Qwen2_5_VLForConditionalGeneration`.
    pub fn build(
        weights: &mut dyn WeightSource,
        config: &QwenTextEncoderConfig,
    ) -> LoadResult<Self> {
        config.validate()?;
        let levels = LAYOUTS
            .iter()
            .find(|levels| {
                let mut name: Vec<&str> = levels.to_vec();
                name.push("embed_tokens.weight");
                weights.contains(&name.join("."))
            })
            .copied()
            .unwrap_or(LAYOUTS[0]);
        let mut b = ModelBuilder::new(weights);
        for level in levels {
            b.enter(*level);
        }
        let program = Arc::new(QwenTextProgram::build(&mut b, config)?);
        for _ in levels {
            b.exit();
        }
        let component = b.finish(COMPONENT_NAME, CLASS_NAME, program.clone())?;
        Ok(Self {
            component,
            program,
            prefix: levels.join("."),
        })
    }

    /// Loads a Transformers model folder (a pipeline's `text_encoder/`: `config.json` and
    /// the safetensors weights, single or sharded). `dtype` converts every param on load
    /// (an 8-bit float stores the linears' weights as scaled fp8, the embedding and norms in
    /// bf16); `None` keeps the file's dtype and the params checkpoint-backed.
    pub fn load(dir: &Path, dtype: Option<DType>) -> LoadResult<Self> {
        Self::load_checked(dir, dtype, UnusedWeights::Refuse)
    }

    /// [`QwenTextEncoder::load`], with what to do about checkpoint tensors the config leaves
    /// unused (refused by default; the vision tower and `lm_head` are never counted).
    pub fn load_checked(
        dir: &Path,
        dtype: Option<DType>,
        unused: UnusedWeights,
    ) -> LoadResult<Self> {
        let config = QwenTextEncoderConfig::from_file(&dir.join("config.json"))?;
        CheckpointWeights::build_in(dir, source_target(dtype), &SKIPPED_PREFIXES, unused, |w| {
            // A tensor under two of the layouts is refused (`LoadError::DuplicateTensor`).
            w.set_layout_prefixes(&["model.", "model.language_model.", ""]);
            stored_as(w, dtype, &QWEN_TEXT_SKIP_PATTERNS, |w| {
                Self::build(w, &config)
            })
        })
    }

    /// Loads the language model from one file for `config` (the pipeline folder's
    /// `text_encoder/config.json`, or Qwen2.5-VL 7B's): a safetensors file in Transformers'
    /// names (any of the layouts [`QwenTextEncoder::build`] takes; the vision tower and
    /// `lm_head` skipped), or a GGUF file in llama.cpp's names (`token_embd`,
    /// `blk.N.attn_q` ..., architecture `qwen2vl` or `qwen2`: the Qwen2.5-VL GGUFs, whose
    /// vision tower is a separate mmproj file), read through [`gguf_views`], its quantized
    /// tensors kept as blocks unless `dtype` asks for a conversion (then dequantized at load,
    /// as any GGUF file: [`CheckpointWeights::open_file`]). A GGUF file of another
    /// architecture is refused naming it.
    pub fn load_file(
        path: &Path,
        config: &QwenTextEncoderConfig,
        dtype: Option<DType>,
        unused: UnusedWeights,
    ) -> LoadResult<Self> {
        let gguf = crate::weights::is_gguf(path);
        // The architecture first: a GGUF of another model is refused from its header, before
        // its tensors are read or dequantized.
        if gguf {
            let arch = crate::weights::gguf_architecture(path)?;
            if !arch
                .as_deref()
                .is_some_and(|a| GGUF_ARCHITECTURES.contains(&a))
            {
                return Err(crate::error::LoadError::CorruptFile {
                    file: path.to_path_buf(),
                    message: format!(
                        "a GGUF file of architecture {} is not a Qwen2.5-VL language model \
                         (architecture {}): give the text encoder's GGUF, not its mmproj or \
                         another model's",
                        arch.as_deref().unwrap_or("(none)"),
                        GGUF_ARCHITECTURES.join(" or ")
                    ),
                });
            }
        }
        let mut w = CheckpointWeights::open_file(path, source_target(dtype))?;
        let ignored: &[&str] = if gguf {
            w = w.with_views(gguf_views(config));
            &["output."]
        } else {
            w.set_layout_prefixes(&["model.", "model.language_model.", ""]);
            &SKIPPED_PREFIXES
        };
        let model = stored_as(&mut w, dtype, &QWEN_TEXT_SKIP_PATTERNS, |w| {
            Self::build(w, config)
        })?;
        w.check_unused(ignored, unused)?;
        Ok(model)
    }

    /// A model with seeded random weights stored as `dtype` (large params filled on all
    /// cores, [`RandomWeights`]; an 8-bit float as [`QwenTextEncoder::load`] stores it).
    pub fn random(config: &QwenTextEncoderConfig, seed: u64, dtype: DType) -> LoadResult<Self> {
        Self::build_as(
            &mut RandomWeights::new(seed, dtype.compute()),
            config,
            Some(dtype),
        )
    }

    /// [`QwenTextEncoder::build`] with the weights stored as `dtype` asks: an 8-bit float
    /// stores the linears' as scaled fp8 ([`crate::fp8`]), the rest as `weights` gives them.
    pub fn build_as(
        weights: &mut dyn WeightSource,
        config: &QwenTextEncoderConfig,
        dtype: Option<DType>,
    ) -> LoadResult<Self> {
        stored_as(weights, dtype, &QWEN_TEXT_SKIP_PATTERNS, |w| {
            Self::build(w, config)
        })
    }

    /// The component (attach routes to it).
    pub fn component(&self) -> &Arc<Component> {
        &self.component
    }

    /// The program the component runs.
    pub fn program(&self) -> &Arc<QwenTextProgram> {
        &self.program
    }

    /// The config.
    pub fn config(&self) -> &QwenTextEncoderConfig {
        self.program.config()
    }

    /// The name prefix the weights were found under (`model`, `model.language_model` or
    /// empty); the component tree has these levels above `embed_tokens`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// `last_hidden_state [batch, seq, hidden]` on `device`, in the model's dtype, through
    /// the attached route (if any): Transformers' `model(input_ids, attention_mask)`.
    pub fn forward(&self, device: &dyn Device, inputs: &QwenTextInputs) -> Result<Tensor> {
        self.component.run(device, |ctx| {
            self.program.run(ctx, inputs, &mut |_, _| Ok(()))
        })
    }

    /// [`QwenTextEncoder::forward`], handing `tap` the token embeddings (`embed_tokens`),
    /// each decoder layer's output (`layers.<i>`) and the final norm's (`norm`): the
    /// language model's module names (the fixture's intermediates, under
    /// `model.language_model.`). The values are those of a plain forward.
    pub fn forward_with_taps(
        &self,
        device: &dyn Device,
        inputs: &QwenTextInputs,
        tap: &mut dyn FnMut(&str, &Tensor) -> Result<()>,
    ) -> Result<Tensor> {
        self.component
            .run(device, |ctx| self.program.run(ctx, inputs, tap))
    }
}
