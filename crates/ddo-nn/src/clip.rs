//! Transformers' `CLIPTextModel` (the `text_encoder` of SD and Flux pipelines), on the
//! `Ops` plane with its weights as leaves.
//!
//! Matches `transformers` 5.x `modeling_clip.py`:
//!
//! - embeddings: `token_embedding(ids) + position_embedding(0..L)`;
//! - pre-norm encoder layers with a causal mask (always applied; no padding mask, as the
//!   SD / Flux pipelines call it): `x + out_proj(attn(layer_norm1(x)))`, then
//!   `x + fc2(act(fc1(layer_norm2(x))))`, attention scaled by `head_dim^-0.5`;
//! - `final_layer_norm`, giving `last_hidden_state`;
//! - `pooler_output` = `last_hidden_state` at the pooled position: when
//!   `eos_token_id == 2` (configs written before transformers PR #24773, e.g.
//!   `openai/clip-vit-large-patch14`), the position of the highest token id (first on
//!   ties); otherwise the first position whose id is `eos_token_id` (0 when none is).
//!
//! Weight names: transformers 5.x writes `embeddings.token_embedding.weight`, ...;
//! checkpoints written by 4.x (the `text_encoder` folders of SD / Flux repos) prefix every
//! name with `text_model.`. [`ClipTextModel::build`] accepts both: it uses the prefixed
//! names when the source has `text_model.embeddings.token_embedding.weight` and not the
//! plain one, and the component's module tree then has the `text_model` level too.

use std::path::Path;
use std::sync::Arc;

use ddo_core::{
    BinaryOp, Component, ComponentProgram, CoreError, DType, Device, ForwardContext, Ops, Result,
    Tensor, UnaryOp,
};
use serde::Deserialize;

use crate::builder::ModelBuilder;
use crate::error::{LoadError, LoadResult};
use crate::layers::{Embedding, LayerNorm, Linear, ops};
use crate::t5::{check_ids, dtype_min, ids_from_tensor, split_heads};
use crate::weights::{CheckpointWeights, UnusedWeights, WeightSource};

/// The component name of the CLIP text encoder in SD / Flux pipelines.
pub const COMPONENT_NAME: &str = "text_encoder";
/// The Transformers class this module ports.
pub const CLASS_NAME: &str = "CLIPTextModel";
/// The prefix of transformers 4.x checkpoint names.
pub const LEGACY_PREFIX: &str = "text_model";

/// The prefixes a checkpoint may put the text model under: a tensor both under
/// `text_model.` and bare is refused when loaded (`LoadError::DuplicateTensor`).
const LAYOUT_PREFIXES: [&str; 2] = ["text_model.", ""];

fn default_vocab_size() -> usize {
    49408
}
fn default_hidden_size() -> usize {
    512
}
fn default_intermediate_size() -> usize {
    2048
}
fn default_num_hidden_layers() -> usize {
    12
}
fn default_num_attention_heads() -> usize {
    8
}
fn default_max_position_embeddings() -> usize {
    77
}
fn default_hidden_act() -> String {
    "quick_gelu".into()
}
fn default_layer_norm_eps() -> f64 {
    1e-5
}
fn default_eos_token_id() -> i64 {
    49407
}
fn default_bos_token_id() -> i64 {
    49406
}
fn default_projection_dim() -> Option<usize> {
    Some(512)
}

/// The fields of Transformers' `CLIPTextConfig` the text model uses (the defaults are
/// Transformers'; other fields of `config.json` are ignored).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ClipTextConfig {
    /// Rows of the token embedding.
    #[serde(default = "default_vocab_size")]
    pub vocab_size: usize,
    /// Hidden size.
    #[serde(default = "default_hidden_size")]
    pub hidden_size: usize,
    /// Inner size of the MLP.
    #[serde(default = "default_intermediate_size")]
    pub intermediate_size: usize,
    /// Encoder layers.
    #[serde(default = "default_num_hidden_layers")]
    pub num_hidden_layers: usize,
    /// Attention heads.
    #[serde(default = "default_num_attention_heads")]
    pub num_attention_heads: usize,
    /// Rows of the position embedding: the longest sequence.
    #[serde(default = "default_max_position_embeddings")]
    pub max_position_embeddings: usize,
    /// MLP activation: `quick_gelu` (CLIP), `gelu` (erf), `gelu_new` / `gelu_pytorch_tanh`.
    #[serde(default = "default_hidden_act")]
    pub hidden_act: String,
    /// Layer norm epsilon.
    #[serde(default = "default_layer_norm_eps")]
    pub layer_norm_eps: f64,
    /// End-of-text id; `2` selects the legacy argmax pooling rule.
    #[serde(default = "default_eos_token_id")]
    pub eos_token_id: i64,
    /// Start-of-text id (informational).
    #[serde(default = "default_bos_token_id")]
    pub bos_token_id: i64,
    /// Projection size of `CLIPTextModelWithProjection` (unused by the text model).
    #[serde(default = "default_projection_dim")]
    pub projection_dim: Option<usize>,
}

impl ClipTextConfig {
    /// `openai/clip-vit-large-patch14`'s text model (CLIP-L), as SD 1.x and Flux ship it
    /// (its config still has the legacy `eos_token_id = 2`).
    pub fn clip_l() -> Self {
        Self {
            vocab_size: 49408,
            hidden_size: 768,
            intermediate_size: 3072,
            num_hidden_layers: 12,
            num_attention_heads: 12,
            max_position_embeddings: 77,
            hidden_act: "quick_gelu".into(),
            layer_norm_eps: 1e-5,
            eos_token_id: 2,
            bos_token_id: 0,
            projection_dim: Some(768),
        }
    }

    /// Reads a Transformers `config.json` (a `CLIPTextConfig`, or a full `CLIPConfig`
    /// whose `text_config` is used) and validates it.
    pub fn from_file(path: &Path) -> LoadResult<Self> {
        let text = crate::weights::read_text_file(path)?;
        Self::from_json_str(&text, path)
    }

    /// Parses config JSON (`origin` names it in errors) and validates it.
    pub fn from_json_str(text: &str, origin: &Path) -> LoadResult<Self> {
        let bad = |e: serde_json::Error| LoadError::Config {
            file: origin.to_path_buf(),
            message: format!("not a CLIP text config: {e}"),
        };
        let mut value: serde_json::Value = serde_json::from_str(text).map_err(bad)?;
        if value.get("hidden_size").is_none()
            && let Some(text_config) = value.get_mut("text_config")
        {
            value = text_config.take();
        }
        let config: Self = serde_json::from_value(value).map_err(bad)?;
        config.validate()?;
        Ok(config)
    }

    /// `hidden_size / num_attention_heads`.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads.max(1)
    }

    /// The MLP activation, or a typed error naming the valid ones.
    pub fn activation(&self) -> LoadResult<UnaryOp> {
        match self.hidden_act.as_str() {
            "quick_gelu" => Ok(UnaryOp::QuickGelu),
            "gelu" => Ok(UnaryOp::GeluErf),
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Ok(UnaryOp::GeluTanh),
            "relu" => Ok(UnaryOp::Relu),
            "silu" | "swish" => Ok(UnaryOp::Silu),
            other => Err(LoadError::InvalidConfig {
                field: "hidden_act".into(),
                value: other.into(),
                hint: "use quick_gelu (CLIP), gelu, gelu_new, gelu_pytorch_tanh, gelu_fast, relu \
                       or silu"
                    .into(),
            }),
        }
    }

    /// Checks every field; a bad one is [`LoadError::InvalidConfig`].
    pub fn validate(&self) -> LoadResult<()> {
        let bad = |field: &str, value: String, hint: String| {
            Err(LoadError::InvalidConfig {
                field: field.into(),
                value,
                hint,
            })
        };
        for (field, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return bad(field, "0".into(), "must be at least 1".into());
            }
        }
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return bad(
                "num_attention_heads",
                self.num_attention_heads.to_string(),
                format!(
                    "must divide hidden_size = {} (CLIP-L: 768 / 12)",
                    self.hidden_size
                ),
            );
        }
        if self.vocab_size > u32::MAX as usize {
            return bad(
                "vocab_size",
                self.vocab_size.to_string(),
                "token ids are u32: at most 4294967295".into(),
            );
        }
        if !self.layer_norm_eps.is_finite() || self.layer_norm_eps < 0.0 {
            return bad(
                "layer_norm_eps",
                self.layer_norm_eps.to_string(),
                "must be a finite number >= 0 (CLIP uses 1e-5)".into(),
            );
        }
        self.activation()?;
        Ok(())
    }

    /// Parameter count of `CLIPTextModel` at this config.
    pub fn param_count(&self) -> u64 {
        let (d, ff) = (self.hidden_size as u64, self.intermediate_size as u64);
        let layer = 4 * (d * d + d) + (d * ff + ff) + (ff * d + d) + 4 * d;
        (self.vocab_size + self.max_position_embeddings) as u64 * d
            + self.num_hidden_layers as u64 * layer
            + 2 * d
    }

    /// The position `pooler_output` is taken from, by Transformers' rule: with the legacy
    /// `eos_token_id == 2`, the first position of the highest id; otherwise the first
    /// position of `eos_token_id`, or 0 when there is none.
    pub fn pooled_index(&self, input_ids: &[u32]) -> usize {
        if self.eos_token_id == 2 {
            let mut best = 0;
            for (i, &id) in input_ids.iter().enumerate() {
                if id > input_ids[best] {
                    best = i;
                }
            }
            best
        } else {
            input_ids
                .iter()
                .position(|&id| i64::from(id) == self.eos_token_id)
                .unwrap_or(0)
        }
    }
}

/// The outputs of [`ClipTextModel::forward`].
#[derive(Debug, Clone)]
pub struct ClipOutput {
    /// `[1, L, hidden]`, after `final_layer_norm`.
    pub last_hidden_state: Tensor,
    /// `[1, hidden]`: `last_hidden_state` at the pooled position.
    pub pooler_output: Tensor,
}

struct ClipLayer {
    k_proj: Linear,
    v_proj: Linear,
    q_proj: Linear,
    out_proj: Linear,
    layer_norm1: LayerNorm,
    fc1: Linear,
    fc2: Linear,
    layer_norm2: LayerNorm,
}

/// The text model's forward program (what the component runs): ids in,
/// `last_hidden_state` out.
pub struct ClipTextProgram {
    config: ClipTextConfig,
    act: UnaryOp,
    token_embedding: Embedding,
    position_embedding: Embedding,
    layers: Vec<ClipLayer>,
    final_layer_norm: LayerNorm,
}

/// Transformers' `CLIPTextModel` as a DDO component.
pub struct ClipTextModel {
    component: Arc<Component>,
    program: Arc<ClipTextProgram>,
    prefixed: bool,
}

impl std::fmt::Debug for ClipTextModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClipTextModel")
            .field("config", &self.program.config)
            .field("prefixed", &self.prefixed)
            .field("component", &self.component)
            .finish()
    }
}

impl ClipTextModel {
    /// Builds the text model with Transformers' weight names, with or without the
    /// `text_model.` prefix (whichever the source has; unprefixed when it has both, as
    /// seeded random weights do). The component is named `text_encoder`, class
    /// `CLIPTextModel`.
    pub fn build(weights: &mut dyn WeightSource, config: &ClipTextConfig) -> LoadResult<Self> {
        config.validate()?;
        let act = config.activation()?;
        let (d, ff) = (config.hidden_size, config.intermediate_size);
        let eps = config.layer_norm_eps as f32;
        let plain = "embeddings.token_embedding.weight";
        let prefixed =
            !weights.contains(plain) && weights.contains(&format!("{LEGACY_PREFIX}.{plain}"));
        let mut b = ModelBuilder::new(weights);
        if prefixed {
            b.enter(LEGACY_PREFIX);
        }

        b.enter("embeddings");
        let token_embedding = Embedding::build(&mut b, "token_embedding", config.vocab_size, d)?;
        let position_embedding = Embedding::build(
            &mut b,
            "position_embedding",
            config.max_position_embeddings,
            d,
        )?;
        b.exit();

        b.enter("encoder");
        b.enter_blocks("layers");
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            // Leaves in execution order (streamed routes predict their schedule from it).
            b.enter(i.to_string());
            let layer_norm1 = LayerNorm::build(&mut b, "layer_norm1", d, eps, true)?;
            b.enter("self_attn");
            let q_proj = Linear::build(&mut b, "q_proj", d, d, true)?;
            let k_proj = Linear::build(&mut b, "k_proj", d, d, true)?;
            let v_proj = Linear::build(&mut b, "v_proj", d, d, true)?;
            let out_proj = Linear::build(&mut b, "out_proj", d, d, true)?;
            b.exit();
            let layer_norm2 = LayerNorm::build(&mut b, "layer_norm2", d, eps, true)?;
            b.enter("mlp");
            let fc1 = Linear::build(&mut b, "fc1", d, ff, true)?;
            let fc2 = Linear::build(&mut b, "fc2", ff, d, true)?;
            b.exit();
            b.exit();
            layers.push(ClipLayer {
                k_proj,
                v_proj,
                q_proj,
                out_proj,
                layer_norm1,
                fc1,
                fc2,
                layer_norm2,
            });
        }
        b.exit(); // layers
        b.exit(); // encoder
        let final_layer_norm = LayerNorm::build(&mut b, "final_layer_norm", d, eps, true)?;

        let program = Arc::new(ClipTextProgram {
            config: config.clone(),
            act,
            token_embedding,
            position_embedding,
            layers,
            final_layer_norm,
        });
        let component = b.finish(COMPONENT_NAME, CLASS_NAME, program.clone())?;
        Ok(Self {
            component,
            program,
            prefixed,
        })
    }

    /// Loads a Transformers model folder (`config.json` and `model.safetensors`, single or
    /// sharded), converting weights to `dtype` when given.
    pub fn from_dir(dir: &Path, dtype: Option<DType>) -> LoadResult<Self> {
        Self::from_dir_checked(dir, dtype, UnusedWeights::Refuse)
    }

    /// [`ClipTextModel::from_dir`], with what to do about checkpoint tensors the config leaves unused
    /// (refused by default).
    pub fn from_dir_checked(
        dir: &Path,
        dtype: Option<DType>,
        unused: UnusedWeights,
    ) -> LoadResult<Self> {
        let config = ClipTextConfig::from_file(&dir.join("config.json"))?;
        // A buffer older exports saved, and the projection head of CLIPTextModelWithProjection:
        // neither is part of the text model's forward.
        CheckpointWeights::build_in(
            dir,
            dtype,
            &["text_model.embeddings.position_ids", "text_projection."],
            unused,
            |w| {
                w.set_layout_prefixes(&LAYOUT_PREFIXES);
                Self::build(w, &config)
            },
        )
    }

    /// Loads a single safetensors file in the Transformers layout (`text_model.…`, as a
    /// folder's `model.safetensors` and ComfyUI's `clip_l.safetensors` are) with `config`;
    /// `dtype` converts on load (CLIP is never stored as fp8: an 8-bit float `dtype` loads
    /// it in bf16, as `--dtype fp8` does for a folder).
    pub fn load_file(
        path: &Path,
        config: &ClipTextConfig,
        dtype: Option<DType>,
        unused: UnusedWeights,
    ) -> LoadResult<Self> {
        let mut w = CheckpointWeights::open_file(path, dtype.map(DType::compute))?;
        w.set_layout_prefixes(&LAYOUT_PREFIXES);
        let model = Self::build(&mut w, config)?;
        w.check_unused(
            &[
                "text_model.embeddings.position_ids",
                "text_projection.",
                "logit_scale",
                crate::flux::original::SCALED_FP8_MARKER,
            ],
            unused,
        )?;
        Ok(model)
    }

    /// The component (attach routes to it).
    pub fn component(&self) -> &Arc<Component> {
        &self.component
    }

    /// The config.
    pub fn config(&self) -> &ClipTextConfig {
        &self.program.config
    }

    /// Whether the weights were loaded under `text_model.`-prefixed names (transformers
    /// 4.x checkpoints); the module tree then has a `text_model` level.
    pub fn has_legacy_prefix(&self) -> bool {
        self.prefixed
    }

    /// The program the component runs (ids as an f32 tensor in, `last_hidden_state` out).
    pub fn program(&self) -> &Arc<ClipTextProgram> {
        &self.program
    }

    /// `last_hidden_state` and `pooler_output` of one sequence (causal mask, no padding
    /// mask, as the SD / Flux pipelines call it).
    pub fn forward(&self, device: &dyn Device, input_ids: &[u32]) -> Result<ClipOutput> {
        self.component.run(device, |ctx| {
            let last_hidden_state = self.program.run(ctx, input_ids)?;
            let ops = ops(ctx)?;
            let index = self.program.config.pooled_index(input_ids);
            let d = self.program.config.hidden_size;
            let pooler_output = ops
                .narrow(&last_hidden_state, 1, index, 1)?
                .reshape(&[1, d])?;
            Ok(ClipOutput {
                last_hidden_state,
                pooler_output,
            })
        })
    }
}

/// `[1, 1, L, L]`: 0 where the key is at or before the query, the dtype's lowest value
/// after it (Transformers' eager causal mask).
fn causal_mask(ops: &dyn Ops, len: usize, dtype: DType) -> Result<Tensor> {
    let min = dtype_min(dtype);
    let values: Vec<f32> = (0..len)
        .flat_map(|q| (0..len).map(move |k| if k <= q { 0.0 } else { min }))
        .collect();
    ops.tensor_from_f32(&[1, 1, len, len], dtype, &values)
}

impl ClipTextProgram {
    fn run(&self, ctx: &mut ForwardContext<'_>, ids: &[u32]) -> Result<Tensor> {
        let cfg = &self.config;
        check_ids(ids, cfg.vocab_size)?;
        let len = ids.len();
        if len > cfg.max_position_embeddings {
            return Err(CoreError::InvalidOption {
                option: "input_ids".into(),
                value: format!("{len} tokens"),
                hint: format!(
                    "the sequence must not be longer than max_position_embeddings = {}",
                    cfg.max_position_embeddings
                ),
            });
        }
        let ops = ops(ctx)?;
        let (d, heads, head_dim) = (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim());
        let scale = (head_dim as f64).powf(-0.5) as f32;

        let tokens = self.token_embedding.forward(ctx, ids)?;
        let positions: Vec<u32> = (0..len as u32).collect();
        let pos = self.position_embedding.forward(ctx, &positions)?;
        let mut x = ops
            .binary(&tokens, &pos, BinaryOp::Add)?
            .reshape(&[1, len, d])?;
        let mask = causal_mask(ops, len, x.dtype())?;

        for layer in &self.layers {
            let h = layer.layer_norm1.forward(ctx, &x)?;
            let q = split_heads(ops, &layer.q_proj.forward(ctx, &h)?, heads, head_dim)?;
            let k = split_heads(ops, &layer.k_proj.forward(ctx, &h)?, heads, head_dim)?;
            let v = split_heads(ops, &layer.v_proj.forward(ctx, &h)?, heads, head_dim)?;
            let a = ops.attention_tokens(&q, &k, &v, Some(&mask), scale)?;
            let a = layer.out_proj.forward(ctx, &a)?;
            x = ops.binary(&x, &a, BinaryOp::Add)?;

            let h = layer.layer_norm2.forward(ctx, &x)?;
            let h = ops.unary(&layer.fc1.forward(ctx, &h)?, self.act)?;
            let h = layer.fc2.forward(ctx, &h)?;
            x = ops.binary(&x, &h, BinaryOp::Add)?;
        }
        self.final_layer_norm.forward(ctx, &x)
    }
}

impl ComponentProgram for ClipTextProgram {
    /// `input`: token ids as f32, `[1, L]` (or `[L]`) → `last_hidden_state [1, L, hidden]`.
    fn forward(&self, ctx: &mut ForwardContext<'_>, input: Tensor) -> Result<Tensor> {
        let ids = ids_from_tensor(ctx, &input)?;
        self.run(ctx, &ids)
    }
}
