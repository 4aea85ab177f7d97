//! Single-file VAEs in the original (LDM) layout, as Black Forest Labs' `ae.safetensors`
//! and Stable Diffusion checkpoints keep them (`decoder.up.N.block.M`, `decoder.mid.block_1`,
//! `decoder.mid.attn_1.q`, ..., optionally under `first_stage_model.` or `vae.`).
//! [`ldm_views`] maps each decoder tensor onto its Diffusers name the way Diffusers'
//! `convert_ldm_vae_checkpoint` (`from_single_file`) converts it: the up blocks in reverse
//! order, `nin_shortcut` as `conv_shortcut`, the attention's 1x1 convolutions read as linears
//! (the same bytes under the linear's shape, no copy). The encoder is never read.

use std::collections::HashMap;
use std::path::Path;

use ddo_core::{Checkpoint, DType};

use super::{AutoencoderKL, AutoencoderKLConfig};
use crate::error::{LoadError, LoadResult};
use crate::weights::{CheckpointWeights, UnusedWeights, View, ViewKind};

/// The prefixes LDM checkpoints put the VAE under (Diffusers' `LDM_VAE_KEYS`), and none.
const PREFIXES: [&str; 3] = ["first_stage_model.", "vae.", ""];

/// The prefix of the LDM-layout VAE in `ckpt`, or `None` when it has none.
pub fn ldm_prefix(ckpt: &Checkpoint) -> Option<&'static str> {
    PREFIXES.into_iter().find(|p| {
        let marker = format!("{p}decoder.mid.block_1.conv1.weight");
        ckpt.names().any(|n| n == marker)
    })
}

/// The Diffusers name of LDM decoder tensor `name` (without the prefix) for a decoder of
/// `up_blocks` up blocks, and how it is read; `None` for tensors the decoder does not use.
fn diffusers_name(name: &str, up_blocks: usize) -> Option<(String, ViewKind)> {
    if let Some(rest) = name.strip_prefix("post_quant_conv.") {
        return Some((format!("post_quant_conv.{rest}"), ViewKind::Whole));
    }
    let rest = name.strip_prefix("decoder.")?;
    let mut kind = ViewKind::Whole;
    let mapped = if let Some(r) = rest.strip_prefix("norm_out.") {
        format!("conv_norm_out.{r}")
    } else if let Some(r) = rest.strip_prefix("up.") {
        let (block, r) = r.split_once('.')?;
        let block: usize = block.parse().ok()?;
        let i = up_blocks.checked_sub(block + 1)?;
        if let Some(r) = r.strip_prefix("block.") {
            format!(
                "up_blocks.{i}.resnets.{}",
                r.replace("nin_shortcut", "conv_shortcut")
            )
        } else if let Some(r) = r.strip_prefix("upsample.conv.") {
            format!("up_blocks.{i}.upsamplers.0.conv.{r}")
        } else {
            return None;
        }
    } else if let Some(r) = rest.strip_prefix("mid.block_") {
        let (n, r) = r.split_once('.')?;
        let n: usize = n.parse().ok()?;
        format!(
            "mid_block.resnets.{}.{}",
            n.checked_sub(1)?,
            r.replace("nin_shortcut", "conv_shortcut")
        )
    } else if let Some(r) = rest.strip_prefix("mid.attn_1.") {
        let (module, param) = r.split_once('.')?;
        let ours = match module {
            "norm" => "group_norm",
            "q" => "to_q",
            "k" => "to_k",
            "v" => "to_v",
            "proj_out" => "to_out.0",
            _ => return None,
        };
        if module != "norm" && param == "weight" {
            kind = ViewKind::Squeeze;
        }
        format!("mid_block.attentions.0.{ours}.{param}")
    } else {
        rest.to_string()
    };
    Some((format!("decoder.{mapped}"), kind))
}

/// Every decoder tensor of the LDM-layout checkpoint `ckpt` (under `prefix`) by its
/// Diffusers name, for a decoder of `up_blocks` up blocks.
pub fn ldm_views(ckpt: &Checkpoint, prefix: &str, up_blocks: usize) -> HashMap<String, View> {
    ckpt.names()
        .filter_map(|n| {
            let (ours, kind) = diffusers_name(n.strip_prefix(prefix)?, up_blocks)?;
            Some((
                ours,
                View {
                    tensor: n.to_string(),
                    kind,
                },
            ))
        })
        .collect()
}

impl AutoencoderKL {
    /// Loads the decoder of a single-file VAE in the LDM layout (see the [module
    /// docs](self)) with `config` (the file has none: a folder's `vae/config.json`, or a
    /// named config). `dtype` converts as [`AutoencoderKL::load`] does; `None` keeps the
    /// file's dtypes, the params the file's mapping. The encoder, `quant_conv` and whatever
    /// else the file holds besides the VAE are left alone; a decoder tensor the file holds
    /// under two of `first_stage_model.`, `vae.` and no prefix is refused
    /// ([`LoadError::DuplicateTensor`]).
    pub fn load_original(
        path: &Path,
        config: AutoencoderKLConfig,
        dtype: Option<DType>,
        unused: UnusedWeights,
    ) -> LoadResult<Self> {
        let weights = CheckpointWeights::open_file(path, dtype)?;
        let (views, ignored) = {
            let ckpt = weights
                .single_file()
                .ok_or_else(|| LoadError::CorruptFile {
                    file: path.to_path_buf(),
                    message: "not one safetensors file".into(),
                })?;
            let Some(prefix) = ldm_prefix(ckpt) else {
                return Err(LoadError::CorruptFile {
                    file: path.to_path_buf(),
                    message: "not a VAE in the original (LDM) layout (no `decoder.mid.block_1.conv1.weight`); a Diffusers vae folder loads with --weights".into(),
                });
            };
            let views = ldm_views(ckpt, prefix, config.block_out_channels.len());
            let read: std::collections::HashSet<&str> =
                views.values().map(|v| v.tensor.as_str()).collect();
            let decoder = format!("{prefix}decoder.");
            let ignored: Vec<String> = ckpt
                .names()
                .chain(ckpt.unsupported().map(|(n, _)| n))
                .filter(|n| !read.contains(n) && !n.starts_with(&decoder))
                .map(str::to_string)
                .collect();
            (views, ignored)
        };
        let mut weights = weights.with_views(views);
        // A tensor under two of the prefixes is refused, not resolved by their order.
        weights.set_layout_prefixes(&PREFIXES);
        let model = Self::build(&mut weights, config)?;
        let ignored: Vec<&str> = ignored.iter().map(String::as_str).collect();
        weights.check_unused(&ignored, unused)?;
        Ok(model)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldm_names_map_as_diffusers_converts_them() {
        let cases = [
            ("decoder.conv_in.weight", "decoder.conv_in.weight"),
            ("decoder.norm_out.bias", "decoder.conv_norm_out.bias"),
            (
                "decoder.up.3.block.0.norm1.weight",
                "decoder.up_blocks.0.resnets.0.norm1.weight",
            ),
            (
                "decoder.up.0.block.2.nin_shortcut.weight",
                "decoder.up_blocks.3.resnets.2.conv_shortcut.weight",
            ),
            (
                "decoder.up.1.upsample.conv.bias",
                "decoder.up_blocks.2.upsamplers.0.conv.bias",
            ),
            (
                "decoder.mid.block_2.conv1.weight",
                "decoder.mid_block.resnets.1.conv1.weight",
            ),
            (
                "decoder.mid.attn_1.norm.weight",
                "decoder.mid_block.attentions.0.group_norm.weight",
            ),
            (
                "decoder.mid.attn_1.proj_out.bias",
                "decoder.mid_block.attentions.0.to_out.0.bias",
            ),
        ];
        for (ldm, ours) in cases {
            assert_eq!(
                diffusers_name(ldm, 4),
                Some((ours.to_string(), ViewKind::Whole)),
                "{ldm}"
            );
        }
        assert_eq!(
            diffusers_name("decoder.mid.attn_1.q.weight", 4),
            Some((
                "decoder.mid_block.attentions.0.to_q.weight".to_string(),
                ViewKind::Squeeze
            ))
        );
        for unused in [
            "encoder.conv_in.weight",
            "quant_conv.weight",
            "decoder.up.4.block.0.conv1.weight",
        ] {
            assert_eq!(diffusers_name(unused, 4), None, "{unused}");
        }
    }
}
