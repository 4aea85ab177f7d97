//! `ddo inspect FILE` on LoRA files (issue 36): the format, the family, the ranks and the
//! modules per component, in text and JSON; a LoRA DDO cannot apply exits with the
//! loader's typed error; a weights file is still inspected as weights.

mod common;

use std::path::Path;

use common::{ddo, fixture, json, ok, scratch, write_f32_safetensors};

/// A kohya Flux LoRA: the img qkv of double block 0 and `linear1` of single block 0, rank
/// `rank_up` on the up side (4 on the down side), alpha 8.
fn write_kohya(path: &Path, rank_up: usize) {
    let (inp, rank) = (16usize, 4usize);
    let ramp = |n: usize| -> Vec<f32> { (0..n).map(|i| i as f32 / 64.0).collect() };
    let mut t = Vec::new();
    for (m, out, up_rank) in [
        ("double_blocks_0_img_attn_qkv", 3 * inp, rank_up),
        ("single_blocks_0_linear1", 7 * inp, rank),
    ] {
        t.push((
            format!("lora_unet_{m}.lora_down.weight"),
            vec![rank, inp],
            ramp(rank * inp),
        ));
        t.push((
            format!("lora_unet_{m}.lora_up.weight"),
            vec![out, up_rank],
            ramp(out * up_rank),
        ));
        t.push((format!("lora_unet_{m}.alpha"), vec![], vec![8.0]));
    }
    write_f32_safetensors(path, &t);
}

#[test]
fn inspect_names_a_loras_format_family_rank_and_modules() {
    let dir = scratch("lora-inspect");
    let file = dir.join("style.safetensors");
    write_kohya(&file, 4);
    let path = file.display().to_string();
    let text = ok(&ddo(&["inspect", &path]));
    assert!(
        text.contains("LoRA, kohya/sd-scripts format, fits flux"),
        "{text}"
    );
    assert!(text.contains("rank: 4 (7 modules)"), "{text}");
    assert!(text.contains("scale (alpha / rank): 2"), "{text}");
    assert!(
        text.contains("single_transformer_blocks.*.proj_mlp"),
        "{text}"
    );
    let v = json(&ddo(&["inspect", &path, "--json"]));
    let lora = &v["lora"];
    assert_eq!(lora["format"], "kohya/sd-scripts");
    assert_eq!(lora["family"], "flux");
    let modules = lora["modules"].as_array().unwrap();
    assert_eq!(modules.len(), 7);
    let mlp = modules
        .iter()
        .find(|m| m["module"] == "single_transformer_blocks.0.proj_mlp")
        .unwrap();
    assert_eq!(mlp["out_features"], 64);
    assert_eq!(mlp["in_features"], 16);
    assert_eq!(mlp["scale"], 2.0);

    // `--check-values` reads it as the weights file it also is.
    let checked = ok(&ddo(&["inspect", &path, "--check-values"]));
    assert!(!checked.contains("LoRA, "), "{checked}");
    assert!(checked.contains("values"), "{checked}");

    // Ranks that disagree: the loader's typed error, exit 1, nothing on stdout.
    let bad = dir.join("bad.safetensors");
    write_kohya(&bad, 5);
    let out = ddo(&["inspect", &bad.display().to_string()]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("is not a LoRA DDO applies") && err.contains("rank"),
        "{err}"
    );
    assert!(out.stdout.is_empty());

    // Weights are still weights.
    let vae = fixture("vae_flux_original/flux_pipeline-vae.safetensors");
    let text = ok(&ddo(&["inspect", &vae]));
    assert!(!text.contains("LoRA"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}
