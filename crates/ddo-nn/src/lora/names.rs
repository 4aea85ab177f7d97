//! Where each format's module names land: the Diffusers module (a leaf of DDO's models) a
//! LoRA module adapts, and for the original layout's fused modules which rows of the
//! up-projection each part takes, as Diffusers' `lora_conversion_utils.py` converts them:
//!
//! - `double_blocks.N.img_attn.qkv` → `transformer_blocks.N.attn.{to_q,to_k,to_v}`, and
//!   `txt_attn.qkv` → `attn.{add_q_proj,add_k_proj,add_v_proj}`: the up rows in three equal
//!   parts, the down-projection shared;
//! - `single_blocks.N.linear1` → `single_transformer_blocks.N.{attn.to_q,attn.to_k,attn.to_v,
//!   proj_mlp}`: three parts of the hidden size (the down-projection's input width) and the
//!   MLP rest;
//! - `final_layer.adaLN_modulation.1` → `norm_out.linear` with the up rows' halves swapped
//!   (BFL orders `shift, scale`, Diffusers `scale, shift`);
//! - every other module one to one.

/// How a source module's up-projection rows split over its targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// One target, all rows.
    Whole,
    /// Three targets, three equal parts (fused q, k, v).
    Thirds,
    /// Four targets: three parts of the input width (the hidden size) and the rest
    /// (Flux's single-block `linear1`: q, k, v and the MLP input).
    QkvMlp,
    /// One target, the two halves of the rows swapped (`norm_out.linear`).
    SwapHalves,
}

/// The Diffusers modules a module of the original (BFL) Flux layout maps to, and how its
/// up rows split; `None` for a name that is not a Flux linear.
pub fn flux_original(name: &str) -> Option<(Vec<String>, Split)> {
    let one = |m: String| Some((vec![m], Split::Whole));
    let fixed = [
        ("img_in", "x_embedder"),
        ("txt_in", "context_embedder"),
        (
            "time_in.in_layer",
            "time_text_embed.timestep_embedder.linear_1",
        ),
        (
            "time_in.out_layer",
            "time_text_embed.timestep_embedder.linear_2",
        ),
        (
            "vector_in.in_layer",
            "time_text_embed.text_embedder.linear_1",
        ),
        (
            "vector_in.out_layer",
            "time_text_embed.text_embedder.linear_2",
        ),
        (
            "guidance_in.in_layer",
            "time_text_embed.guidance_embedder.linear_1",
        ),
        (
            "guidance_in.out_layer",
            "time_text_embed.guidance_embedder.linear_2",
        ),
        ("final_layer.linear", "proj_out"),
    ];
    if let Some((_, ours)) = fixed.iter().find(|(theirs, _)| *theirs == name) {
        return one((*ours).to_string());
    }
    if name == "final_layer.adaLN_modulation.1" {
        return Some((vec!["norm_out.linear".into()], Split::SwapHalves));
    }
    let (kind, rest) = name.split_once('.')?;
    let (index, module) = rest.split_once('.')?;
    let i: usize = index.parse().ok()?;
    match kind {
        "double_blocks" => {
            let b = format!("transformer_blocks.{i}");
            let m = |s: &str| format!("{b}.{s}");
            match module {
                "img_attn.qkv" => Some((
                    vec![m("attn.to_q"), m("attn.to_k"), m("attn.to_v")],
                    Split::Thirds,
                )),
                "txt_attn.qkv" => Some((
                    vec![
                        m("attn.add_q_proj"),
                        m("attn.add_k_proj"),
                        m("attn.add_v_proj"),
                    ],
                    Split::Thirds,
                )),
                "img_attn.proj" => one(m("attn.to_out.0")),
                "txt_attn.proj" => one(m("attn.to_add_out")),
                "img_mlp.0" => one(m("ff.net.0.proj")),
                "img_mlp.2" => one(m("ff.net.2")),
                "txt_mlp.0" => one(m("ff_context.net.0.proj")),
                "txt_mlp.2" => one(m("ff_context.net.2")),
                "img_mod.lin" => one(m("norm1.linear")),
                "txt_mod.lin" => one(m("norm1_context.linear")),
                _ => None,
            }
        }
        "single_blocks" => {
            let b = format!("single_transformer_blocks.{i}");
            let m = |s: &str| format!("{b}.{s}");
            match module {
                "linear1" => Some((
                    vec![
                        m("attn.to_q"),
                        m("attn.to_k"),
                        m("attn.to_v"),
                        m("proj_mlp"),
                    ],
                    Split::QkvMlp,
                )),
                "linear2" => one(m("proj_out")),
                "modulation.lin" => one(m("norm.linear")),
                _ => None,
            }
        }
        _ => None,
    }
}

/// A kohya / sd-scripts Flux transformer module (`lora_unet_` stripped:
/// `double_blocks_0_img_attn_qkv`) in the original layout's dotted form
/// (`double_blocks.0.img_attn.qkv`), or `None`.
pub fn kohya_flux_to_original(name: &str) -> Option<String> {
    const DOUBLE: [&str; 10] = [
        "img_attn_proj",
        "img_attn_qkv",
        "img_mlp_0",
        "img_mlp_2",
        "img_mod_lin",
        "txt_attn_proj",
        "txt_attn_qkv",
        "txt_mlp_0",
        "txt_mlp_2",
        "txt_mod_lin",
    ];
    const SINGLE: [&str; 3] = ["linear1", "linear2", "modulation_lin"];
    const FIXED: [(&str, &str); 11] = [
        ("img_in", "img_in"),
        ("txt_in", "txt_in"),
        ("time_in_in_layer", "time_in.in_layer"),
        ("time_in_out_layer", "time_in.out_layer"),
        ("vector_in_in_layer", "vector_in.in_layer"),
        ("vector_in_out_layer", "vector_in.out_layer"),
        ("guidance_in_in_layer", "guidance_in.in_layer"),
        ("guidance_in_out_layer", "guidance_in.out_layer"),
        ("final_layer_linear", "final_layer.linear"),
        (
            "final_layer_adaLN_modulation_1",
            "final_layer.adaLN_modulation.1",
        ),
        (
            "final_layer_adaln_modulation_1",
            "final_layer.adaLN_modulation.1",
        ),
    ];
    if let Some((_, dotted)) = FIXED.iter().find(|(k, _)| *k == name) {
        return Some((*dotted).to_string());
    }
    let dot = |s: &str| {
        // `img_attn_qkv` → `img_attn.qkv`, `img_mlp_0` → `img_mlp.0`, `modulation_lin` →
        // `modulation.lin`: the last `_` is the module separator.
        let (a, b) = s.rsplit_once('_').unwrap_or((s, ""));
        if b.is_empty() {
            a.to_string()
        } else {
            format!("{a}.{b}")
        }
    };
    for (kind, names) in [
        ("double_blocks", &DOUBLE[..]),
        ("single_blocks", &SINGLE[..]),
    ] {
        let Some(rest) = name.strip_prefix(kind).and_then(|r| r.strip_prefix('_')) else {
            continue;
        };
        let (index, module) = rest.split_once('_')?;
        let i: usize = index.parse().ok()?;
        if !names.contains(&module) {
            return None;
        }
        let module = if module == "linear1" || module == "linear2" {
            module.to_string()
        } else {
            dot(module)
        };
        return Some(format!("{kind}.{i}.{module}"));
    }
    None
}

/// A kohya CLIP-L module (`lora_te1_` or `lora_te_` stripped:
/// `text_model_encoder_layers_0_self_attn_q_proj`) as a module of DDO's CLIP text encoder
/// (`text_model.encoder.layers.0.self_attn.q_proj`), or `None`.
pub fn kohya_clip(name: &str) -> Option<String> {
    let rest = name.strip_prefix("text_model_encoder_layers_")?;
    let (index, module) = rest.split_once('_')?;
    let i: usize = index.parse().ok()?;
    let module = match module {
        "self_attn_q_proj" => "self_attn.q_proj",
        "self_attn_k_proj" => "self_attn.k_proj",
        "self_attn_v_proj" => "self_attn.v_proj",
        "self_attn_out_proj" => "self_attn.out_proj",
        "mlp_fc1" => "mlp.fc1",
        "mlp_fc2" => "mlp.fc2",
        _ => return None,
    };
    Some(format!("text_model.encoder.layers.{i}.{module}"))
}

/// A kohya T5 module (`lora_te2_` stripped: `encoder_block_0_layer_0_SelfAttention_q`) as a
/// module of DDO's T5 encoder (`encoder.block.0.layer.0.SelfAttention.q`), or `None`.
pub fn kohya_t5(name: &str) -> Option<String> {
    let rest = name.strip_prefix("encoder_block_")?;
    let (index, module) = rest.split_once('_')?;
    let i: usize = index.parse().ok()?;
    let module = match module {
        "layer_0_SelfAttention_q" => "layer.0.SelfAttention.q",
        "layer_0_SelfAttention_k" => "layer.0.SelfAttention.k",
        "layer_0_SelfAttention_v" => "layer.0.SelfAttention.v",
        "layer_0_SelfAttention_o" => "layer.0.SelfAttention.o",
        "layer_1_DenseReluDense_wi_0" => "layer.1.DenseReluDense.wi_0",
        "layer_1_DenseReluDense_wi_1" => "layer.1.DenseReluDense.wi_1",
        "layer_1_DenseReluDense_wi" => "layer.1.DenseReluDense.wi",
        "layer_1_DenseReluDense_wo" => "layer.1.DenseReluDense.wo",
        _ => return None,
    };
    Some(format!("encoder.block.{i}.{module}"))
}

/// A kohya Qwen-Image transformer module (`lora_unet_` stripped:
/// `transformer_blocks_0_attn_to_q`) as a Diffusers module
/// (`transformer_blocks.0.attn.to_q`), or `None`: the flattened name is split on `_` except
/// inside the module names that hold one (`to_q`, `add_k_proj`, `img_mlp`, ...), as
/// Diffusers' `_convert_non_diffusers_qwen_lora_to_diffusers` does.
pub fn kohya_qwen(name: &str) -> Option<String> {
    const TOP: [(&str, &str); 6] = [
        ("img_in", "img_in"),
        ("txt_in", "txt_in"),
        ("proj_out", "proj_out"),
        ("norm_out_linear", "norm_out.linear"),
        (
            "time_text_embed_timestep_embedder_linear_1",
            "time_text_embed.timestep_embedder.linear_1",
        ),
        (
            "time_text_embed_timestep_embedder_linear_2",
            "time_text_embed.timestep_embedder.linear_2",
        ),
    ];
    if let Some((_, dotted)) = TOP.iter().find(|(k, _)| *k == name) {
        return Some((*dotted).to_string());
    }
    let rest = name.strip_prefix("transformer_blocks_")?;
    // Longest protected names first.
    const KEEP: [&str; 15] = [
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
        "txt_mlp",
        "img_mlp",
        "txt_mod",
        "img_mod",
        "to_out",
        "to_q",
        "to_k",
        "to_v",
        "add_q",
        "add_k",
        "add_v",
    ];
    let mut parts: Vec<String> = Vec::new();
    let mut s = rest;
    while !s.is_empty() {
        let kept = KEEP
            .iter()
            .filter(|k| {
                s.strip_prefix(**k)
                    .is_some_and(|r| r.is_empty() || r.starts_with('_'))
            })
            .max_by_key(|k| k.len());
        let (part, tail) = match kept {
            Some(k) => (*k, &s[k.len()..]),
            None => match s.split_once('_') {
                Some((p, t)) => (p, t),
                None => (s, ""),
            },
        };
        parts.push(part.to_string());
        s = tail.strip_prefix('_').unwrap_or(tail);
    }
    let i: usize = parts.first()?.parse().ok()?;
    Some(format!("transformer_blocks.{i}.{}", parts[1..].join(".")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_original_layout_maps_as_diffusers_converts_it() {
        let (t, s) = flux_original("double_blocks.3.img_attn.qkv").unwrap();
        assert_eq!(
            t,
            [
                "transformer_blocks.3.attn.to_q",
                "transformer_blocks.3.attn.to_k",
                "transformer_blocks.3.attn.to_v"
            ]
        );
        assert_eq!(s, Split::Thirds);
        let (t, s) = flux_original("single_blocks.37.linear1").unwrap();
        assert_eq!(t.len(), 4);
        assert_eq!(t[3], "single_transformer_blocks.37.proj_mlp");
        assert_eq!(s, Split::QkvMlp);
        assert_eq!(
            flux_original("final_layer.adaLN_modulation.1").unwrap(),
            (vec!["norm_out.linear".to_string()], Split::SwapHalves)
        );
        assert_eq!(
            flux_original("double_blocks.0.txt_mod.lin").unwrap().0,
            ["transformer_blocks.0.norm1_context.linear"]
        );
        assert_eq!(
            flux_original("guidance_in.out_layer").unwrap().0,
            ["time_text_embed.guidance_embedder.linear_2"]
        );
        for bad in [
            "double_blocks.x.img_attn.qkv",
            "double_blocks.0.nope",
            "img_attn",
        ] {
            assert!(flux_original(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn kohya_names_unflatten() {
        for (k, bfl) in [
            (
                "double_blocks_0_img_attn_qkv",
                "double_blocks.0.img_attn.qkv",
            ),
            ("double_blocks_18_txt_mlp_2", "double_blocks.18.txt_mlp.2"),
            ("double_blocks_2_img_mod_lin", "double_blocks.2.img_mod.lin"),
            ("single_blocks_37_linear1", "single_blocks.37.linear1"),
            (
                "single_blocks_5_modulation_lin",
                "single_blocks.5.modulation.lin",
            ),
            (
                "final_layer_adaLN_modulation_1",
                "final_layer.adaLN_modulation.1",
            ),
            ("time_in_in_layer", "time_in.in_layer"),
        ] {
            assert_eq!(kohya_flux_to_original(k).as_deref(), Some(bfl), "{k}");
            assert!(flux_original(bfl).is_some(), "{bfl}");
        }
        assert!(kohya_flux_to_original("double_blocks_0_img_attn_nope").is_none());
        assert_eq!(
            kohya_clip("text_model_encoder_layers_11_mlp_fc2").as_deref(),
            Some("text_model.encoder.layers.11.mlp.fc2")
        );
        assert_eq!(
            kohya_t5("encoder_block_23_layer_1_DenseReluDense_wi_0").as_deref(),
            Some("encoder.block.23.layer.1.DenseReluDense.wi_0")
        );
        for (k, d) in [
            (
                "transformer_blocks_0_attn_to_q",
                "transformer_blocks.0.attn.to_q",
            ),
            (
                "transformer_blocks_0_attn_to_out_0",
                "transformer_blocks.0.attn.to_out.0",
            ),
            (
                "transformer_blocks_7_attn_add_k_proj",
                "transformer_blocks.7.attn.add_k_proj",
            ),
            (
                "transformer_blocks_0_attn_to_add_out",
                "transformer_blocks.0.attn.to_add_out",
            ),
            (
                "transformer_blocks_0_img_mlp_net_0_proj",
                "transformer_blocks.0.img_mlp.net.0.proj",
            ),
            (
                "transformer_blocks_0_txt_mlp_net_2",
                "transformer_blocks.0.txt_mlp.net.2",
            ),
            (
                "transformer_blocks_59_img_mod_1",
                "transformer_blocks.59.img_mod.1",
            ),
            ("norm_out_linear", "norm_out.linear"),
        ] {
            assert_eq!(kohya_qwen(k).as_deref(), Some(d), "{k}");
        }
    }
}
