//! `ddo run --lora FILE[:STRENGTH]` (issue 36) on the fixture Flux pipeline folder: a LoRA
//! changes the image, strength 0 gives the image without it byte for byte, two files apply
//! together, the report names them, and a LoRA for another model or a bad strength is
//! refused before anything runs.

mod common;

use std::path::{Path, PathBuf};

use common::{ddo, fixture, json, scratch, write_f32_safetensors};

/// A kohya LoRA on the fixture pipeline (hidden 32): transformer modules by their kohya
/// names, text-encoder ones as `te1_…` (CLIP) or `te2_…` (T5); e.g. the img qkv of double block 0
/// and `linear1` of single block 0 (or `modules` given), alpha 4, rank 4.
fn write_lora(path: &Path, modules: &[(&str, usize, usize)]) {
    let rank = 4;
    let v = |n: usize, seed: f32| -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32) * 0.37 + seed).sin() * 0.5)
            .collect()
    };
    let mut t = Vec::new();
    for (k, (m, out, inp)) in modules.iter().enumerate() {
        // `te1_…`/`te2_…` name text-encoder modules (`lora_te1_…`), the rest the transformer's.
        let m = if m.starts_with("te") {
            format!("lora_{m}")
        } else {
            format!("lora_unet_{m}")
        };
        t.push((
            format!("{m}.lora_down.weight"),
            vec![rank, *inp],
            v(rank * inp, k as f32),
        ));
        t.push((
            format!("{m}.lora_up.weight"),
            vec![*out, rank],
            v(out * rank, 3.0 + k as f32),
        ));
        t.push((format!("{m}.alpha"), vec![], vec![4.0]));
    }
    write_f32_safetensors(path, &t);
}

/// `ddo run` on the fixture pipeline at 32x32 with `steps`, writing `out`, with `extra`.
fn ddo_run(out: &Path, steps: &str, extra: &[&str]) -> std::process::Output {
    let folder = fixture("flux_pipeline");
    let out = out.to_str().unwrap();
    let mut args = vec![
        "run",
        "--weights",
        &folder,
        "--steps",
        steps,
        "--height",
        "32",
        "--width",
        "32",
        "--out",
        out,
    ];
    args.extend_from_slice(extra);
    ddo(&args)
}

/// Runs the fixture pipeline with `extra`, returning the PNG bytes and the JSON report.
fn run(dir: &Path, name: &str, extra: &[&str]) -> (Vec<u8>, serde_json::Value) {
    let out = dir.join(format!("{name}.png"));
    let v = json(&ddo_run(&out, "2", &[&["--json"], extra].concat()));
    (std::fs::read(&out).unwrap(), v)
}

#[test]
fn a_lora_changes_the_image_and_strength_zero_does_not() {
    let dir = scratch("lora-run");
    let style = dir.join("style.safetensors");
    write_lora(
        &style,
        &[
            ("double_blocks_0_img_attn_qkv", 96, 32),
            ("single_blocks_0_linear1", 224, 32),
        ],
    );
    let detail = dir.join("detail.safetensors");
    write_lora(&detail, &[("double_blocks_0_img_mlp_0", 128, 32)]);
    let s = |p: &PathBuf, strength: &str| format!("{}{strength}", p.display());

    let (plain, _) = run(&dir, "plain", &[]);
    let (styled, v) = run(&dir, "styled", &["--lora", &s(&style, "")]);
    assert_ne!(plain, styled, "the LoRA changed nothing");
    assert_eq!(v["loras"][0]["strength"], 1.0);
    assert!(
        v["lora_device_bytes"].as_u64().unwrap() > 0,
        "{}",
        v["loras"]
    );
    assert!(
        v["memory_plan"]["budget_source"]
            .as_str()
            .unwrap()
            .contains("less"),
        "{}",
        v["memory_plan"]["budget_source"]
    );
    let (zero, _) = run(&dir, "zero", &["--lora", &s(&style, ":0")]);
    assert_eq!(zero, plain, "strength 0 is the plain image");
    let (both, v) = run(
        &dir,
        "both",
        &["--lora", &s(&style, ":0.8"), "--lora", &s(&detail, ":-0.5")],
    );
    assert_ne!(both, styled);
    assert_eq!(v["loras"].as_array().unwrap().len(), 2);
    assert_eq!(v["loras"][1]["strength"], -0.5);

    // Text encoders: a CLIP (`lora_te1_`, the fixture's CLIP saved without `text_model.`)
    // and a T5 (`lora_te2_`) module change the image too.
    let text = dir.join("text.safetensors");
    write_lora(
        &text,
        &[
            ("te1_text_model_encoder_layers_0_self_attn_q_proj", 32, 32),
            ("te2_encoder_block_1_layer_1_DenseReluDense_wo", 32, 64),
        ],
    );
    let (texted, v) = run(&dir, "text", &["--lora", &s(&text, "")]);
    assert_ne!(texted, plain, "the text encoder LoRA changed nothing");
    assert!(v["lora_device_bytes"].as_u64().unwrap() > 0);

    // A LoRA for a deeper model: refused by name before any phase, nothing written.
    let deep = dir.join("deep.safetensors");
    write_lora(&deep, &[("double_blocks_7_img_mlp_0", 128, 32)]);
    let out = dir.join("deep.png");
    let o = ddo_run(&out, "1", &["--lora", deep.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("transformer_blocks.7") && err.contains("deep.safetensors"),
        "{err}"
    );
    assert!(!out.exists());
    // A strength that is not finite is a usage error.
    let o = ddo(&["run", "--config", "tiny", "--lora", &s(&style, ":inf")]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `ddo resolve --lora`: the plan makes room for the factors, a LoRA that does not fit the
/// pipeline is refused as `ddo run` refuses it, and without a model `--lora` is a usage error.
#[test]
fn resolve_plans_with_the_loras_factors() {
    let dir = scratch("lora-resolve");
    let style = dir.join("style.safetensors");
    write_lora(&style, &[("double_blocks_0_img_attn_qkv", 96, 32)]);
    let folder = fixture("flux_pipeline");
    let plan = |extra: &[&str]| {
        let mut args = vec![
            "resolve",
            "--weights",
            &folder,
            "--vram-budget",
            "1GiB",
            "--height",
            "32",
            "--width",
            "32",
            "--json",
        ];
        args.extend_from_slice(extra);
        json(&ddo(&args))
    };
    let plain = plan(&[]);
    let with = plan(&["--lora", style.to_str().unwrap()]);
    let budget = |v: &serde_json::Value| v["memory_plan"]["budget_bytes"].as_u64().unwrap();
    // 3 adapters (q, k, v) of B [32, 4] sharing one A [4, 32], in f32.
    assert_eq!(
        budget(&plain) - budget(&with),
        (4 * 32 + 3 * 32 * 4) * 4,
        "{}",
        with["memory_plan"]
    );
    let deep = dir.join("deep.safetensors");
    write_lora(&deep, &[("double_blocks_3_img_mlp_0", 128, 32)]);
    let o = ddo(&[
        "resolve",
        "--weights",
        &folder,
        "--lora",
        deep.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("transformer_blocks.3"));
    let o = ddo(&["resolve", "--lora", style.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("--lora plans memory"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `ddo bench --lora`: every candidate runs the adapted component, so routes still agree
/// bit for bit with each other, and differ from the candidates without the LoRA.
#[test]
fn bench_runs_every_candidate_with_the_lora() {
    let dir = scratch("lora-bench");
    let style = dir.join("style.safetensors");
    write_lora(&style, &[("double_blocks_0_img_attn_qkv", 96, 32)]);
    let folder = fixture("flux_pipeline");
    let bench = |extra: &[&str]| {
        let mut args = vec![
            "bench",
            "--weights",
            &folder,
            "--component",
            "transformer",
            "--height",
            "32",
            "--width",
            "32",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--json",
            "--route",
            "none",
            "--route",
            "diffusers_group_offload:use_stream=true",
        ];
        args.extend_from_slice(extra);
        json(&ddo(&args))
    };
    let hashes = |v: &serde_json::Value| -> Vec<String> {
        v["candidates"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["output_fnv1a"].as_str().unwrap().to_string())
            .collect()
    };
    let plain_v = bench(&[]);
    let adapted_v = bench(&["--lora", style.to_str().unwrap()]);
    let (plain, adapted) = (hashes(&plain_v), hashes(&adapted_v));
    assert_eq!(adapted[0], adapted[1], "routes disagree with the LoRA");
    assert_ne!(adapted[0], plain[0], "the LoRA changed nothing");
    // Each adapted candidate times a switch with its route attached: the qkv module's A
    // once, shared by q, k and v, and its B in three row blocks, f32 like the weights.
    let link = adapted_v["link_bytes_per_sec"].as_f64().unwrap();
    for c in adapted_v["candidates"].as_array().unwrap() {
        let w = &c["lora_switch"];
        assert_eq!(w["bytes"], (4 * 32 + 3 * 32 * 4) * 4, "{c}");
        assert!(w["seconds"].as_f64().unwrap() > 0.0, "{c}");
        assert!(w["read_seconds"].as_f64().unwrap() > 0.0, "{c}");
        let bound = w["bound_seconds"].as_f64().unwrap();
        assert!((bound - (0.1 + 2048.0 / link)).abs() < 1e-9, "{c}");
    }
    assert!(plain_v["candidates"][0]["lora_switch"].is_null());
    // Folded at attach, a resident copy does not switch in place: no switch timed.
    let fused = bench(&["--lora", style.to_str().unwrap(), "--lora-fuse"]);
    assert!(fused["candidates"][0]["lora_switch"].is_null());
    assert_eq!(
        hashes(&fused)[1],
        adapted[1],
        "a streamed route does not fold"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Qwen-Image: a Diffusers/PEFT-format LoRA (`transformer.` keys, an alpha) on the tiny
/// random Qwen-Image pipeline changes the image; at strength 0 it is the plain image.
#[test]
fn a_qwen_image_lora_applies() {
    let dir = scratch("lora-qwen");
    let lora = dir.join("qwen.safetensors");
    let rank = 4usize;
    let v = |n: usize, seed: f32| -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32) * 0.29 + seed).cos() * 0.5)
            .collect()
    };
    let mut t = Vec::new();
    for (k, (m, out, inp)) in [
        ("transformer_blocks.0.img_mlp.net.0.proj", 128usize, 32usize),
        ("transformer_blocks.1.attn.to_add_out", 32, 32),
        ("transformer_blocks.1.img_mod.1", 192, 32),
    ]
    .into_iter()
    .enumerate()
    {
        let n = format!("transformer.{m}");
        t.push((
            format!("{n}.lora_A.weight"),
            vec![rank, inp],
            v(rank * inp, k as f32),
        ));
        t.push((
            format!("{n}.lora_B.weight"),
            vec![out, rank],
            v(out * rank, 5.0 + k as f32),
        ));
        t.push((format!("{n}.alpha"), vec![], vec![8.0]));
    }
    write_f32_safetensors(&lora, &t);
    let run = |name: &str, extra: &[&str]| {
        let png = dir.join(format!("{name}.png"));
        let mut args = vec![
            "run",
            "--config",
            "qwen-tiny",
            "--height",
            "32",
            "--width",
            "32",
            "--steps",
            "2",
            "--json",
            "--out",
            png.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let v = json(&ddo(&args));
        (std::fs::read(&png).unwrap(), v)
    };
    let (plain, _) = run("plain", &[]);
    let path = lora.to_str().unwrap().to_string();
    let (adapted, v) = run("adapted", &["--lora", &path]);
    assert_ne!(adapted, plain);
    assert!(v["lora_device_bytes"].as_u64().unwrap() > 0);
    let (zero, _) = run("zero", &["--lora", &format!("{path}:0")]);
    assert_eq!(zero, plain);
    // On a Flux pipeline it is refused as a Qwen-Image LoRA.
    let o = ddo(&["run", "--config", "tiny", "--steps", "1", "--lora", &path]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("it is a Qwen-Image LoRA and this is a Flux pipeline"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A LoRA that only partly matches the model: refused, naming the flag; with
/// `--lora-allow-unmatched` the matching modules apply and every other one is named.
#[test]
fn a_partly_matching_lora_needs_the_flag_and_names_what_it_leaves_out() {
    let dir = scratch("lora-partial");
    let partial = dir.join("partial.safetensors");
    write_lora(
        &partial,
        &[
            ("double_blocks_0_img_attn_qkv", 96, 32),
            ("double_blocks_4_img_mlp_0", 128, 32),
            ("input_blocks_1_0_emb_layers_1", 32, 32),
        ],
    );
    let out = dir.join("p.png");
    let lora = ["--lora", partial.to_str().unwrap()];
    let o = ddo_run(&out, "1", &lora);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--lora-allow-unmatched"), "{err}");
    assert!(!out.exists());
    let o = ddo_run(
        &out,
        "1",
        &[&lora[..], &["--lora-allow-unmatched"]].concat(),
    );
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("2 module(s) not applied"), "{text}");
    assert!(
        text.contains("lora_unet_input_blocks_1_0_emb_layers_1"),
        "{text}"
    );
    assert!(
        text.contains("transformer_blocks.4.ff.net.0.proj"),
        "{text}"
    );
    assert!(out.exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--lora-fuse`: the resident transformer runs with the LoRA folded into its weights; its
/// latents are the unfused run's to rounding, and not the plain ones.
#[test]
fn a_fused_lora_gives_the_unfused_latents() {
    let dir = scratch("lora-fuse");
    let style = dir.join("style.safetensors");
    write_lora(
        &style,
        &[
            ("double_blocks_0_img_attn_qkv", 96, 32),
            ("single_blocks_0_linear1", 224, 32),
        ],
    );
    let latents = |name: &str, extra: &[&str]| {
        let file = dir.join(format!("{name}.safetensors"));
        let mut args = vec!["--save-latents", file.to_str().unwrap()];
        args.extend_from_slice(extra);
        run(&dir, name, &args);
        common::tensor(&file, "latents").1
    };
    let path = style.to_str().unwrap();
    let plain = latents("plain", &[]);
    let unfused = latents("unfused", &["--lora", path]);
    let fused = latents("fused", &["--lora", path, "--lora-fuse"]);
    let rel = |a: &[f32], b: &[f32]| {
        let n: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
        let d: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
        (n / d).sqrt()
    };
    assert!(
        rel(&fused, &unfused) <= 1e-5,
        "fused vs unfused {}",
        rel(&fused, &unfused)
    );
    assert!(rel(&unfused, &plain) > 1e-3, "the LoRA changed nothing");
    // Folded, not added per step: the sums round differently (deterministically).
    assert_ne!(fused, unfused, "--lora-fuse folded nothing");
    let _ = std::fs::remove_dir_all(&dir);
}
