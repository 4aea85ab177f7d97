//! Single-file Flux checkpoints in the original (Black Forest Labs) layout, as
//! `flux1-dev.safetensors` and ComfyUI's fp8 files are: `double_blocks.N.img_attn.qkv`,
//! `single_blocks.N.linear1`, `final_layer.adaLN_modulation.1`, ..., optionally under
//! `model.diffusion_model.`. [`original_views`] maps every Diffusers param name onto the
//! file the way Diffusers' `convert_flux_transformer_checkpoint_to_diffusers`
//! (`from_single_file`) converts it; fused tensors split into zero-copy row ranges of the
//! mapping (a fused fp8 tensor's scale is each part's), and only the final modulation,
//! whose `shift, scale` halves Diffusers swaps, is copied. [`config_from_original`] reads
//! the config from the tensors' shapes where no `config.json` is given.

use std::collections::HashMap;
use std::path::Path;

use ddo_core::Checkpoint;

use super::FluxTransformerConfig;
use crate::error::{LoadError, LoadResult};
use crate::weights::{View, ViewKind};

/// The key Diffusers recognises the original Flux layout by.
const MARKER: &str = "double_blocks.0.img_attn.norm.key_norm.scale";

/// The prefix ComfyUI and the original repository's full checkpoints put the model under.
const PREFIX: &str = "model.diffusion_model.";

/// The prefix of the original-layout transformer tensors in `ckpt` (`""` or
/// `model.diffusion_model.`), or `None` when the file is not in that layout.
pub fn original_prefix(ckpt: &Checkpoint) -> Option<&'static str> {
    let has = |n: &str| ckpt.names().any(|k| k == n);
    if has(MARKER) {
        Some("")
    } else if has(&format!("{PREFIX}{MARKER}")) {
        Some(PREFIX)
    } else {
        None
    }
}

/// The shape of tensor `name` of `ckpt`, or a typed error naming it.
fn shape_of(ckpt: &Checkpoint, name: &str) -> LoadResult<Vec<usize>> {
    ckpt.tensor(name)
        .map(|t| t.shape.clone())
        .map_err(|_| LoadError::MissingTensor {
            name: name.to_string(),
            file: ckpt.path().to_path_buf(),
        })
}

/// Blocks `<prefix><kind>.N.` present in `ckpt`: one past the largest `N`.
fn count_blocks(ckpt: &Checkpoint, prefix: &str, kind: &str) -> usize {
    let lead = format!("{prefix}{kind}.");
    ckpt.names()
        .filter_map(|n| n.strip_prefix(&lead))
        .filter_map(|rest| rest.split('.').next()?.parse::<usize>().ok())
        .map(|i| i + 1)
        .max()
        .unwrap_or(0)
}

/// The transformer config of an original-layout checkpoint, from its tensors' shapes:
/// block counts, widths, whether it has a guidance embedder (dev) or not (schnell); the
/// RoPE axes are FLUX.1's `[16, 56, 56]`, which only a head width of 128 takes (another
/// width needs its `config.json`).
pub fn config_from_original(ckpt: &Checkpoint) -> LoadResult<FluxTransformerConfig> {
    let file = ckpt.path().to_path_buf();
    let Some(p) = original_prefix(ckpt) else {
        return Err(LoadError::CorruptFile {
            file,
            message: format!(
                "not a Flux checkpoint in the original layout (no `{MARKER}`); give a Diffusers transformer folder instead"
            ),
        });
    };
    let img_in = shape_of(ckpt, &format!("{p}img_in.weight"))?;
    let txt_in = shape_of(ckpt, &format!("{p}txt_in.weight"))?;
    let vector_in = shape_of(ckpt, &format!("{p}vector_in.in_layer.weight"))?;
    let head = shape_of(ckpt, &format!("{p}{MARKER}"))?;
    let out = shape_of(ckpt, &format!("{p}final_layer.linear.weight"))?;
    let two = |s: &[usize], what: &str| -> LoadResult<(usize, usize)> {
        match s {
            [a, b] => Ok((*a, *b)),
            _ => Err(LoadError::CorruptFile {
                file: file.clone(),
                message: format!("`{p}{what}` has shape {s:?}, expected two dims"),
            }),
        }
    };
    let (inner, in_channels) = two(&img_in, "img_in.weight")?;
    let (_, joint) = two(&txt_in, "txt_in.weight")?;
    let (_, pooled) = two(&vector_in, "vector_in.in_layer.weight")?;
    let (out_channels, _) = two(&out, "final_layer.linear.weight")?;
    let head_dim = head.first().copied().unwrap_or(0);
    if head_dim != 128 {
        return Err(LoadError::InvalidConfig {
            field: "attention_head_dim".into(),
            value: head_dim.to_string(),
            hint: "a single-file checkpoint's RoPE axes are known for FLUX.1's head width of 128 only; give the model's config.json (a Diffusers transformer folder)".into(),
        });
    }
    let config = FluxTransformerConfig {
        patch_size: 1,
        in_channels,
        out_channels: Some(out_channels),
        num_layers: count_blocks(ckpt, p, "double_blocks"),
        num_single_layers: count_blocks(ckpt, p, "single_blocks"),
        attention_head_dim: head_dim,
        num_attention_heads: inner / head_dim,
        joint_attention_dim: joint,
        pooled_projection_dim: pooled,
        guidance_embeds: ckpt
            .names()
            .any(|n| n == format!("{p}guidance_in.in_layer.weight")),
        axes_dims_rope: vec![16, 56, 56],
    };
    config.validate()?;
    Ok(config)
}

/// Every param of a [`FluxTransformer`](super::FluxTransformer) at `config`, by its
/// Diffusers name, as a view of the original-layout checkpoint whose tensors sit under
/// `prefix` (Diffusers' `convert_flux_transformer_checkpoint_to_diffusers`).
pub fn original_views(config: &FluxTransformerConfig, prefix: &str) -> HashMap<String, View> {
    let inner = config.num_attention_heads * config.attention_head_dim;
    let mlp = 4 * inner;
    let mut v = HashMap::new();
    let mut put = |ours: String, theirs: String, kind: ViewKind| {
        v.insert(
            ours,
            View {
                tensor: format!("{prefix}{theirs}"),
                kind,
            },
        );
    };
    let both = |put: &mut dyn FnMut(String, String, ViewKind), ours: &str, theirs: &str| {
        for p in ["weight", "bias"] {
            put(
                format!("{ours}.{p}"),
                format!("{theirs}.{p}"),
                ViewKind::Whole,
            );
        }
    };
    let rows = |put: &mut dyn FnMut(String, String, ViewKind),
                ours: &str,
                theirs: &str,
                start: usize,
                len: usize| {
        for p in ["weight", "bias"] {
            put(
                format!("{ours}.{p}"),
                format!("{theirs}.{p}"),
                ViewKind::Rows { start, len },
            );
        }
    };
    for (ours, theirs) in [
        ("time_text_embed.timestep_embedder", "time_in"),
        ("time_text_embed.text_embedder", "vector_in"),
        ("time_text_embed.guidance_embedder", "guidance_in"),
    ] {
        if theirs == "guidance_in" && !config.guidance_embeds {
            continue;
        }
        both(
            &mut put,
            &format!("{ours}.linear_1"),
            &format!("{theirs}.in_layer"),
        );
        both(
            &mut put,
            &format!("{ours}.linear_2"),
            &format!("{theirs}.out_layer"),
        );
    }
    both(&mut put, "context_embedder", "txt_in");
    both(&mut put, "x_embedder", "img_in");
    for i in 0..config.num_layers {
        let (o, t) = (
            format!("transformer_blocks.{i}"),
            format!("double_blocks.{i}"),
        );
        both(
            &mut put,
            &format!("{o}.norm1.linear"),
            &format!("{t}.img_mod.lin"),
        );
        both(
            &mut put,
            &format!("{o}.norm1_context.linear"),
            &format!("{t}.txt_mod.lin"),
        );
        for (k, name) in ["to_q", "to_k", "to_v"].iter().enumerate() {
            rows(
                &mut put,
                &format!("{o}.attn.{name}"),
                &format!("{t}.img_attn.qkv"),
                k * inner,
                inner,
            );
        }
        for (k, name) in ["add_q_proj", "add_k_proj", "add_v_proj"]
            .iter()
            .enumerate()
        {
            rows(
                &mut put,
                &format!("{o}.attn.{name}"),
                &format!("{t}.txt_attn.qkv"),
                k * inner,
                inner,
            );
        }
        for (ours, theirs) in [
            ("norm_q", "img_attn.norm.query_norm"),
            ("norm_k", "img_attn.norm.key_norm"),
            ("norm_added_q", "txt_attn.norm.query_norm"),
            ("norm_added_k", "txt_attn.norm.key_norm"),
        ] {
            put(
                format!("{o}.attn.{ours}.weight"),
                format!("{t}.{theirs}.scale"),
                ViewKind::Whole,
            );
        }
        both(
            &mut put,
            &format!("{o}.ff.net.0.proj"),
            &format!("{t}.img_mlp.0"),
        );
        both(
            &mut put,
            &format!("{o}.ff.net.2"),
            &format!("{t}.img_mlp.2"),
        );
        both(
            &mut put,
            &format!("{o}.ff_context.net.0.proj"),
            &format!("{t}.txt_mlp.0"),
        );
        both(
            &mut put,
            &format!("{o}.ff_context.net.2"),
            &format!("{t}.txt_mlp.2"),
        );
        both(
            &mut put,
            &format!("{o}.attn.to_out.0"),
            &format!("{t}.img_attn.proj"),
        );
        both(
            &mut put,
            &format!("{o}.attn.to_add_out"),
            &format!("{t}.txt_attn.proj"),
        );
    }
    for i in 0..config.num_single_layers {
        let (o, t) = (
            format!("single_transformer_blocks.{i}"),
            format!("single_blocks.{i}"),
        );
        both(
            &mut put,
            &format!("{o}.norm.linear"),
            &format!("{t}.modulation.lin"),
        );
        for (k, name) in ["attn.to_q", "attn.to_k", "attn.to_v"].iter().enumerate() {
            rows(
                &mut put,
                &format!("{o}.{name}"),
                &format!("{t}.linear1"),
                k * inner,
                inner,
            );
        }
        rows(
            &mut put,
            &format!("{o}.proj_mlp"),
            &format!("{t}.linear1"),
            3 * inner,
            mlp,
        );
        put(
            format!("{o}.attn.norm_q.weight"),
            format!("{t}.norm.query_norm.scale"),
            ViewKind::Whole,
        );
        put(
            format!("{o}.attn.norm_k.weight"),
            format!("{t}.norm.key_norm.scale"),
            ViewKind::Whole,
        );
        both(&mut put, &format!("{o}.proj_out"), &format!("{t}.linear2"));
    }
    both(&mut put, "proj_out", "final_layer.linear");
    for p in ["weight", "bias"] {
        put(
            format!("norm_out.linear.{p}"),
            format!("final_layer.adaLN_modulation.1.{p}"),
            ViewKind::SwapHalves,
        );
    }
    v
}

pub use crate::weights::SCALED_FP8_MARKER;

impl super::FluxTransformer {
    /// Loads a single-file checkpoint in the original Flux layout (see the [module
    /// docs](self)): `config` when given (a `config.json` beside it), else read from the
    /// tensors' shapes ([`config_from_original`]). `dtype` converts as
    /// [`FluxTransformer::load`](super::FluxTransformer::load) does (an 8-bit float stores
    /// the layerwise-cast layers as scaled fp8); `None` keeps the file's dtypes, the params
    /// slices of the file's mapping. Tensors outside the transformer (a full checkpoint's
    /// VAE and text encoders, ComfyUI's `scaled_fp8` marker) are left alone; other tensors
    /// no param reads are refused unless `unused` allows them, and so is a tensor read under
    /// `model.diffusion_model.` that the file also holds bare, or the other way round
    /// ([`LoadError::DuplicateTensor`]), and, in a file with the `scaled_fp8` marker, an fp8
    /// weight without its `scale_weight` ([`LoadError::MissingScale`]).
    pub fn load_original(
        path: &Path,
        config: Option<FluxTransformerConfig>,
        dtype: Option<ddo_core::DType>,
        unused: crate::weights::UnusedWeights,
    ) -> LoadResult<Self> {
        let weights =
            crate::weights::CheckpointWeights::open_file(path, crate::fp8::source_target(dtype))?;
        let (prefix, config, others) = {
            let ckpt = weights
                .single_file()
                .ok_or_else(|| LoadError::CorruptFile {
                    file: path.to_path_buf(),
                    message: "not one safetensors file".into(),
                })?;
            let Some(prefix) = original_prefix(ckpt) else {
                return Err(LoadError::CorruptFile {
                    file: path.to_path_buf(),
                    message: format!(
                        "not a Flux transformer in the original layout (no `{MARKER}`); a Diffusers transformer folder loads with --weights"
                    ),
                });
            };
            let config = match config {
                Some(c) => c,
                None => config_from_original(ckpt)?,
            };
            let others: Vec<String> = ckpt
                .names()
                .chain(ckpt.unsupported().map(|(n, _)| n))
                .filter(|n| !n.starts_with(prefix) || *n == SCALED_FP8_MARKER)
                .map(str::to_string)
                .collect();
            (prefix, config, others)
        };
        let mut weights = weights.with_views(original_views(&config, prefix));
        // A tensor both under the prefix and bare is refused, not resolved by the prefix.
        weights.set_layout_prefixes(&[PREFIX, ""]);
        let model =
            crate::fp8::stored_as(&mut weights, dtype, &crate::fp8::FLUX_SKIP_PATTERNS, |w| {
                Self::build(w, config)
            })?;
        let ignored: Vec<&str> = others.iter().map(String::as_str).collect();
        weights.check_unused(&ignored, unused)?;
        Ok(model)
    }
}
