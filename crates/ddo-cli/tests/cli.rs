//! The `ddo` binary end to end (`std::process::Command`): `run --config tiny` (PNG, human
//! profile, JSON shape), `run` reproducing Diffusers' FluxPipeline from given embeddings and
//! noise, `decode` (the `vae_flux` fixture, and latents saved by `run`), `resolve --json`
//! (shape and the source of each value, environment included), `inspect` on a pipeline
//! folder, and every bad-input case: a non-zero exit and one line on stderr with a hint,
//! never a panic.

mod common;

use std::path::Path;
use std::process::Command;

use common::{ddo, ddo_with_env, fixture, json, max_abs, ok, repo, scratch, tensor, tiny_bench};
use serde_json::Value;

#[test]
fn run_tiny_writes_a_png_and_prints_the_phase_profile() {
    let d = scratch("tiny");
    let png = d.join("tiny.png");
    let out = ddo(&["run", "--config", "tiny", "--out", png.to_str().unwrap()]);
    let text = ok(&out);
    let bytes = std::fs::read(&png).expect("PNG written");
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    for needle in [
        "prompt_encoding",
        "denoise",
        "decode",
        "memory plan: budget 8.00 GiB",
        "transformer: none",
        "vae: diffusers_group_offload",
        "peak (exact)",
        "attach: transformer",
        "wrote",
    ] {
        assert!(text.contains(needle), "missing `{needle}` in:\n{text}");
    }
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The VAE's default (leaf, no stream) pins nothing by design, as Diffusers' no-stream
/// calls: `ddo run` prints no "copies from pageable memory ... would avoid it" note for it.
/// An explicit streamed route whose pinned limit is too small for its weights still gets
/// the note, naming a limit that would hold them.
#[test]
fn the_pageable_note_is_for_limits_that_refused_pinning_not_for_unpinned_defaults() {
    let d = scratch("pageable-note");
    let png = d.join("tiny.png");
    let text = ok(&ddo(&[
        "run",
        "--config",
        "tiny",
        "--out",
        png.to_str().unwrap(),
    ]));
    assert!(text.contains("vae: diffusers_group_offload"), "{text}");
    assert!(
        !text.contains("copies from pageable memory"),
        "a note for an unpinned-by-design default:\n{text}"
    );
    let text = ok(&ddo(&[
        "run",
        "--config",
        "tiny",
        "--route",
        "transformer=diffusers_group_offload:use_stream=true,pinned_limit=1KiB",
        "--out",
        png.to_str().unwrap(),
    ]));
    let notes: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("copies from pageable memory"))
        .collect();
    assert_eq!(notes.len(), 1, "{text}");
    assert!(
        notes[0].starts_with("note: transformer ") && notes[0].contains(":pinned_limit=1GiB"),
        "{text}"
    );
}

/// The memory plan under the default preset on the host backend: with 8 GiB the tiny
/// transformer stays fully resident (its weights cross once in four forwards); with a
/// budget below its weights a part stays resident and the rest streams; the image is the
/// same bit for bit.
#[test]
fn the_default_preset_keeps_what_fits_resident_and_streams_the_rest() {
    let d = scratch("plan");
    let run = |budget: &str, name: &str| {
        let out = d.join(name);
        let v = json(&ddo(&[
            "run",
            "--config",
            "tiny",
            "--height",
            "16",
            "--width",
            "16",
            "--max-sequence-length",
            "8",
            "--vram-budget",
            budget,
            "--json",
            "--out",
            out.to_str().unwrap(),
        ]));
        (v, tensor(&out, "sample"))
    };
    let component = |v: &Value, name: &str| -> (Value, Value) {
        let plan = v["memory_plan"]["components"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["component"] == name)
            .unwrap()
            .clone();
        let metrics = v["components"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["component"] == name)
            .unwrap()["metrics"]
            .clone();
        (plan, metrics)
    };
    let (roomy, image) = run("8GiB", "roomy.safetensors");
    let (plan, metrics) = component(&roomy, "transformer");
    assert_eq!(plan["route"], "none", "{plan}");
    assert_eq!(plan["planned"], true);
    assert_eq!(plan["footprint"]["streamed_bytes_per_forward"], 0);
    let weights = plan["footprint"]["weight_bytes"].as_u64().unwrap();
    assert_eq!(metrics["counters"]["forwards"], 4);
    assert_eq!(
        metrics["counters"]["h2d_bytes"].as_u64().unwrap(),
        weights,
        "the resident weights cross once"
    );

    let (tight, tight_image) = run("280KiB", "tight.safetensors");
    assert!(weights > 280 << 10, "the budget must be below the weights");
    let (plan, metrics) = component(&tight, "transformer");
    assert!(
        plan["route"]
            .as_str()
            .unwrap()
            .starts_with("diffusers_group_offload"),
        "{plan}"
    );
    let resident = plan["footprint"]["resident_bytes"].as_u64().unwrap();
    let streamed = plan["footprint"]["streamed_bytes_per_forward"]
        .as_u64()
        .unwrap();
    assert!(resident > 0 && streamed > 0, "{plan}");
    let crossed = metrics["counters"]["h2d_bytes"].as_u64().unwrap();
    assert!(
        crossed > weights && crossed < 4 * weights,
        "learning forward + resident once + three streamed forwards: {crossed} of {weights}"
    );
    for phase in tight["memory_plan"]["phases"].as_array().unwrap() {
        assert!(
            phase["peak_bytes"].as_u64().unwrap() <= 280 << 10,
            "{phase}"
        );
    }
    for phase in tight["phases"].as_array().unwrap() {
        assert!(
            phase["peak_bytes"].as_u64().unwrap() <= 280 << 10,
            "{phase}"
        );
    }
    assert_eq!(image, tight_image, "the image does not depend on the plan");

    // Too small for any plan: refused before anything runs, naming a budget that works.
    let out = ddo(&[
        "run",
        "--config",
        "tiny",
        "--height",
        "16",
        "--width",
        "16",
        "--vram-budget",
        "64KiB",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--vram-budget") && err.contains("too small"),
        "{err}"
    );
    // An image no device holds is refused by the plan too, with no overflow, for run and
    // resolve alike.
    for command in ["run", "resolve"] {
        let out = ddo(&[
            command,
            "--config",
            "tiny",
            "--height",
            "4294967296",
            "--width",
            "4294967296",
        ]);
        assert_eq!(out.status.code(), Some(1), "{command}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("too small") && !err.contains("internal"),
            "{command}: {err}"
        );
    }
    // A budget no host has is refused on the host device before any plan (issue 34, item
    // 7: it used to plan, then abort on the first allocation past the machine).
    let out = ddo(&[
        "run",
        "--config",
        "tiny",
        "--height",
        "4294967296",
        "--width",
        "4294967296",
        "--vram-budget",
        "18446744073709551615",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("holds at most"), "{err}");
    // The fixture's 2x VAE at 2^31 latent rows, 178 million tiles of Diffusers' tiling: the
    // plan bounds the tiled decode without walking the tiles, and refuses the budget.
    let out = ddo(&[
        "resolve",
        "--weights",
        repo().join("fixtures/flux_pipeline").to_str().unwrap(),
        "--height",
        "4294967297",
        "--width",
        "4",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("too small"), "{err}");
}

/// `--dtype fp8` (issue 18): the transformer's cast layers are stored as scaled fp8, so
/// its weights take fewer bytes than in bf16 (the plan and the copies count stored bytes),
/// and the image stays close to the bf16 run's.
#[test]
fn run_with_fp8_storage_moves_fewer_bytes_and_stays_close_to_bf16() {
    let d = scratch("fp8");
    let run = |dtype: &str| {
        let out = d.join(format!("{dtype}.safetensors"));
        let v = json(&ddo(&[
            "run",
            "--config",
            "tiny",
            "--height",
            "16",
            "--width",
            "16",
            "--max-sequence-length",
            "8",
            "--steps",
            "2",
            "--dtype",
            dtype,
            "--route",
            "transformer=diffusers_group_offload:offload_type=leaf_level,use_stream=true",
            "--json",
            "--out",
            out.to_str().unwrap(),
        ]));
        let transformer = v["memory_plan"]["components"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["component"] == "transformer")
            .unwrap()["footprint"]
            .clone();
        (v, transformer, tensor(&out, "sample").1)
    };
    let (_, bf16, bf16_image) = run("bf16");
    let (v, fp8, fp8_image) = run("fp8");
    assert!(
        v["model"].as_str().unwrap().contains("f8_e4m3"),
        "{}",
        v["model"]
    );
    let (b, f) = (
        bf16["streamed_bytes_per_forward"].as_u64().unwrap(),
        fp8["streamed_bytes_per_forward"].as_u64().unwrap(),
    );
    assert!(
        f < b * 3 / 4 && f > b / 3,
        "fp8 streams {f} B against bf16's {b} B"
    );
    let num: f64 = fp8_image
        .iter()
        .zip(&bf16_image)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let den: f64 = bf16_image.iter().map(|b| (*b as f64).powi(2)).sum();
    let rel = (num / den).sqrt();
    assert!(rel < 0.1, "fp8 image {rel:e} from the bf16 image");
}

/// `--transformer FILE`, `--text-encoder-2 FILE`, `--vae FILE` (issue 18): the pipeline
/// folder's components as single files (the original Flux layout, Transformers' T5 layout,
/// the LDM VAE layout) give the folder's image bit for bit; a missing file, a folder, or a
/// file in the Diffusers layout is a typed refusal naming the option.
#[test]
fn a_single_file_transformer_replaces_the_folders_bit_for_bit() {
    let d = scratch("single-file");
    let inputs = fixture("flux_pipeline/inputs.safetensors");
    let run = |extra: &[&str], name: &str| {
        let out = d.join(name);
        let mut argv = vec![
            "run",
            "--weights",
            &fixture("flux_pipeline"),
            "--prompt-embeds",
            &inputs,
            "--init-latents",
            &inputs,
            "--height",
            "32",
            "--width",
            "24",
            "--steps",
            "2",
            "--tiled-decode",
            "off",
            "--out",
            out.to_str().unwrap(),
        ]
        .into_iter()
        .map(str::to_string)
        .collect::<Vec<_>>();
        argv.extend(extra.iter().map(|s| s.to_string()));
        let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
        let v = ddo(&argv);
        (v, out)
    };
    let file = fixture("flux_transformer_original/flux_pipeline-transformer.safetensors");
    let (folder, a) = run(&[], "folder.safetensors");
    ok(&folder);
    let (single, b) = run(&["--transformer", &file], "single.safetensors");
    ok(&single);
    assert_eq!(tensor(&a, "sample"), tensor(&b, "sample"));
    assert_eq!(tensor(&a, "latents"), tensor(&b, "latents"));
    // And T5 as one file (the Transformers layout, as ComfyUI's T5 files are), with it.
    let t5 = fixture("flux_pipeline/text_encoder_2/model.safetensors");
    let (both, c) = run(
        &["--transformer", &file, "--text-encoder-2", &t5],
        "both.safetensors",
    );
    ok(&both);
    assert_eq!(tensor(&a, "sample"), tensor(&c, "sample"));
    // With a text prompt, T5 runs: the file's encoder gives the folder's image.
    let pipeline = fixture("flux_pipeline");
    let prompted = |extra: &[&str], name: &str| {
        let out = d.join(name);
        let mut argv = vec![
            "run",
            "--weights",
            &pipeline,
            "--prompt",
            "a lighthouse",
            "--init-latents",
            &inputs,
            "--height",
            "32",
            "--width",
            "24",
            "--steps",
            "2",
            "--out",
            out.to_str().unwrap(),
        ];
        argv.extend_from_slice(extra);
        ok(&ddo(&argv));
        tensor(&out, "sample")
    };
    let clip = fixture("flux_pipeline/text_encoder/model.safetensors");
    assert_eq!(
        prompted(&[], "prompt-folder.safetensors"),
        prompted(
            &["--text-encoder-2", &t5, "--text-encoder", &clip],
            "prompt-file.safetensors"
        )
    );
    let (bad_clip, _) = run(&["--text-encoder", &t5], "bad-clip.safetensors");
    assert!(!bad_clip.status.success());
    let err = String::from_utf8_lossy(&bad_clip.stderr);
    assert!(err.contains("--text-encoder "), "{err}");
    // And the VAE as one file in the original LDM layout (as ae.safetensors is).
    let vae = fixture("vae_flux_original/flux_pipeline-vae.safetensors");
    let (with_vae, e) = run(&["--vae", &vae], "vae.safetensors");
    ok(&with_vae);
    assert_eq!(tensor(&a, "sample"), tensor(&e, "sample"));
    let (bad_vae, _) = run(&["--vae", &file], "bad-vae.safetensors");
    assert!(!bad_vae.status.success());
    let err = String::from_utf8_lossy(&bad_vae.stderr);
    assert!(err.contains("--vae") && err.contains("LDM"), "{err}");
    let (bad_t5, _) = run(&["--text-encoder-2", &file], "bad-t5.safetensors");
    assert!(!bad_t5.status.success());
    let err = String::from_utf8_lossy(&bad_t5.stderr);
    assert!(err.contains("--text-encoder-2"), "{err}");
    for (bad, says) in [
        ("no-such-file.safetensors".to_string(), "no such file"),
        (fixture("flux_pipeline"), "is a directory, not a file"),
        (
            fixture("flux_transformer/diffusion_pytorch_model.safetensors"),
            "original layout",
        ),
    ] {
        let (out, _) = run(&["--transformer", &bad], "bad.safetensors");
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("--transformer") && err.contains(says),
            "{bad}: {err}"
        );
    }
}

#[test]
fn run_json_has_phases_components_and_the_decode_choice() {
    let d = scratch("json");
    let png = d.join("t.png");
    let v = json(&ddo(&[
        "run",
        "--config",
        "tiny",
        "--steps",
        "2",
        "--height",
        "32",
        "--width",
        "48",
        "--route",
        "vae=linear_convolution",
        "--json",
        "--out",
        png.to_str().unwrap(),
    ]));
    assert!(png.is_file());
    assert_eq!(v["command"], "run");
    assert_eq!(v["steps"], 2);
    assert_eq!(v["timesteps"].as_array().unwrap().len(), 2);
    let phases = v["phases"].as_array().unwrap();
    let names: Vec<&str> = phases
        .iter()
        .map(|p| p["phase"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["prompt_encoding", "denoise", "decode"]);
    for p in phases {
        for key in ["seconds", "peak_bytes", "end_bytes", "components"] {
            assert!(!p[key].is_null(), "{key} in {p}");
        }
        assert_eq!(p["end_bytes"], 0, "cleanup leaves nothing: {p}");
        assert!(p["peak_bytes"].as_u64().unwrap() > 0, "{p}");
        // The host backend builds no plans and loads no kernel modules: its first calls
        // cost nothing, and the phase says so.
        let setup = &p["setup_calls"];
        for key in [
            "plans_built",
            "plan_build_ns",
            "plan_wait_ns",
            "kernel_loads",
        ] {
            assert_eq!(setup[key], 0, "{key} in {p}");
        }
    }
    let comps = v["components"].as_array().unwrap();
    let names: Vec<&str> = comps
        .iter()
        .map(|c| c["component"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["text_encoder", "text_encoder_2", "transformer", "vae"]
    );
    for c in comps {
        for key in ["route", "options", "source", "metrics"] {
            assert!(!c[key].is_null(), "{key} in {c}");
        }
        assert!(
            c["metrics"]["counters"]["forwards"].as_u64().unwrap() >= 1,
            "{c}"
        );
    }
    assert_eq!(comps[3]["route"], "linear_convolution");
    assert_eq!(comps[3]["source"]["route"], "explicit route");
    assert_eq!(comps[2]["metrics"]["counters"]["forwards"], 2);
    assert_eq!(v["decode"]["mode"], "auto");
    assert_eq!(v["decode"]["tiled"], false);
    assert!(v["decode"]["reason"].as_str().unwrap().contains("auto"));
}

#[test]
fn run_reproduces_diffusers_from_given_embeddings_and_noise_and_decode_agrees() {
    let d = scratch("repro");
    let out_file = d.join("run.safetensors");
    let latents_file = d.join("latents.safetensors");
    let inputs = fixture("flux_pipeline/inputs.safetensors");
    ok(&ddo(&[
        "run",
        "--weights",
        &fixture("flux_pipeline"),
        "--prompt-embeds",
        &inputs,
        "--init-latents",
        &inputs,
        "--height",
        "32",
        "--width",
        "24",
        "--steps",
        "4",
        "--tiled-decode",
        "off",
        "--out",
        out_file.to_str().unwrap(),
        "--save-latents",
        latents_file.to_str().unwrap(),
    ]));
    let outputs = repo().join("fixtures/flux_pipeline/outputs.safetensors");
    let (shape, sample) = tensor(&out_file, "sample");
    let (ref_shape, reference) = tensor(&outputs, "image");
    assert_eq!(shape, ref_shape);
    let err = max_abs(&sample, &reference);
    assert!(err <= 1e-4, "image max |diff| {err:e}");
    let (_, latents) = tensor(&out_file, "latents");
    let (_, ref_latents) = tensor(&outputs, "latents");
    assert!(max_abs(&latents, &ref_latents) <= 1e-4);

    // The saved decoder input, decoded by `ddo decode`, gives the same image.
    let (lshape, _) = tensor(&latents_file, "latents");
    assert_eq!(lshape, [1, 4, 16, 12]);
    let decoded = d.join("decoded.safetensors");
    ok(&ddo(&[
        "decode",
        "--weights",
        &fixture("flux_pipeline"),
        "--latents",
        latents_file.to_str().unwrap(),
        "--out",
        decoded.to_str().unwrap(),
    ]));
    let (_, again) = tensor(&decoded, "sample");
    assert!(max_abs(&again, &sample) <= 1e-6);
}

#[test]
fn decode_matches_the_vae_flux_fixture() {
    let d = scratch("decode");
    let out_file = d.join("sample.safetensors");
    let v = json(&ddo(&[
        "decode",
        "--weights",
        &fixture("vae_flux"),
        "--latents",
        &fixture("vae_flux/inputs.safetensors"),
        "--out",
        out_file.to_str().unwrap(),
        "--json",
    ]));
    assert_eq!(v["command"], "decode");
    assert_eq!(v["component"]["route"], "diffusers_group_offload");
    assert_eq!(v["image_shape"], serde_json::json!([1, 3, 16, 16]));
    assert!(v["peak_bytes"].as_u64().unwrap() > 0);
    let (shape, sample) = tensor(&out_file, "sample");
    let (ref_shape, reference) = tensor(
        &repo().join("fixtures/vae_flux/outputs.safetensors"),
        "sample",
    );
    assert_eq!(shape, ref_shape);
    let err = max_abs(&sample, &reference);
    assert!(err <= 1e-4, "max |diff| {err:e}");

    let png = d.join("sample.png");
    let text = ok(&ddo(&[
        "decode",
        "--weights",
        &fixture("vae_flux"),
        "--latents",
        &fixture("vae_flux/inputs.safetensors"),
        "--out",
        png.to_str().unwrap(),
        "--route",
        "vae=none",
    ]));
    assert!(text.contains("vae: none"), "{text}");
    assert_eq!(&std::fs::read(&png).unwrap()[..4], b"\x89PNG");
}

const RESOLVE_KEYS: [&str; 6] = [
    "component",
    "options",
    "preset",
    "resolved_preset",
    "route",
    "source",
];

#[test]
fn resolve_json_shape_and_sources() {
    let v = json(&ddo(&["resolve", "--json"]));
    let all = v.as_array().unwrap();
    assert_eq!(all.len(), 4);
    for e in all {
        let mut keys: Vec<&str> = e.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort();
        assert_eq!(keys, RESOLVE_KEYS, "{e}");
        assert_eq!(e["preset"], "auto");
        assert_eq!(e["resolved_preset"], "one_shot_fast");
        assert_eq!(
            e["source"]["route"], "preset default (one_shot_fast)",
            "{e}"
        );
        assert_eq!(e["source"]["preset"], "default (auto)");
        for k in e["options"].as_object().unwrap().keys() {
            assert!(e["source"]["options"][k].is_string(), "{k} in {e}");
        }
    }
    // The seed's VAE row: leaf level, no stream, low_cpu_mem_usage=false.
    let vae = &all[3];
    assert_eq!(vae["component"], "vae");
    assert_eq!(vae["route"], "diffusers_group_offload");
    assert_eq!(vae["options"]["offload_type"], "leaf_level");
    assert_eq!(vae["options"]["use_stream"], false);
    assert_eq!(vae["options"]["low_cpu_mem_usage"], false);

    let v = json(&ddo(&[
        "resolve",
        "--json",
        "--preset",
        "low_ram_safe",
        "--route",
        "vae=linear_convolution:pinned=false",
        "--component",
        "vae",
    ]));
    let vae = &v[0];
    assert_eq!(v.as_array().unwrap().len(), 1);
    assert_eq!(vae["route"], "linear_convolution");
    assert_eq!(vae["options"]["pinned"], false);
    assert_eq!(vae["source"]["route"], "explicit route");
    assert_eq!(vae["source"]["options"]["pinned"], "explicit route");
    assert_eq!(vae["source"]["preset"], "--preset");

    // The environment: DDO_PRESET applies without --preset, --preset hides it, --no-env
    // ignores it; DDO_<COMPONENT>_ROUTE is named as the source.
    let env = [("DDO_PRESET", "warm_process"), ("DDO_VAE_ROUTE", "none")];
    let v = json(&ddo_with_env(&["resolve", "--json"], &env));
    assert_eq!(v[2]["preset"], "warm_process");
    assert_eq!(v[2]["source"]["preset"], "environment (DDO_PRESET)");
    assert_eq!(v[2]["route"], "none");
    assert_eq!(v[3]["source"]["route"], "environment (DDO_VAE_ROUTE)");
    let v = json(&ddo_with_env(
        &["resolve", "--json", "--preset", "nvme_baseline"],
        &env,
    ));
    assert_eq!(v[2]["preset"], "nvme_baseline");
    let v = json(&ddo_with_env(&["resolve", "--json", "--no-env"], &env));
    assert_eq!(v[2]["preset"], "auto");
    assert_eq!(v[3]["route"], "diffusers_group_offload");

    let text = ok(&ddo(&["resolve", "--preset", "off"]));
    assert!(text.contains("vae: unmanaged"), "{text}");

    // The streaming engine's settings are explained with their sources: given, preset
    // (wsl_compat caps pinned memory), or the route's default.
    let v = json(&ddo(&[
        "resolve",
        "--json",
        "--route",
        "transformer=diffusers_group_offload:use_stream=true,ring_slots=3",
        "--component",
        "transformer",
    ]));
    let t = &v[0];
    assert_eq!(t["options"]["ring_slots"], 3);
    assert_eq!(t["source"]["options"]["ring_slots"], "explicit route");
    assert_eq!(t["options"]["unit_bytes"], "16.00 MiB");
    assert_eq!(t["source"]["options"]["unit_bytes"], "route default");
    assert_eq!(t["options"]["pinned_source"], "register");
    assert_eq!(t["source"]["options"]["pinned_source"], "route default");
    let v = json(&ddo(&[
        "resolve",
        "--json",
        "--route",
        "transformer=native_vmm:pinned_source=register",
        "--component",
        "transformer",
    ]));
    assert_eq!(v[0]["options"]["pinned_source"], "register", "{v}");
    assert_eq!(
        v[0]["source"]["options"]["pinned_source"], "explicit route",
        "{v}"
    );
    let v = json(&ddo(&[
        "resolve",
        "--json",
        "--preset",
        "wsl_compat",
        "--route",
        "transformer=diffusers_group_offload:use_stream=true",
        "--component",
        "transformer",
    ]));
    // An explicit route keeps what it gives: the preset adds no pinned limit to it.
    assert_ne!(v[0]["options"]["pinned_limit"], "256.00 MiB", "{v}");
    assert_eq!(v[0]["source"]["route"], "explicit route", "{v}");
}

/// `ddo inspect` on fp8 checkpoints (issue 18): the fp8 tensors and their bytes, and how
/// many weights carry a per-tensor scale under which name.
#[test]
fn inspect_shows_fp8_tensors_and_their_scales() {
    let scaled = json(&ddo(&[
        "inspect",
        &fixture("flux_transformer_original/flux1-tiny-fp8-scaled.safetensors"),
        "--json",
    ]));
    let f = &scaled["components"][0]["fp8"];
    assert_eq!(
        (f["tensors"].as_u64(), f["scaled"].as_u64()),
        (Some(19), Some(18)),
        "{f}"
    );
    assert_eq!(f["scale_names"], serde_json::json!(["scale_weight"]));
    // The routes that refuse them, as the registry's routes say.
    assert_eq!(f["refused_by"], serde_json::json!(["linear_convolution"]));
    let plain = json(&ddo(&[
        "inspect",
        &fixture("flux_transformer_fp8"),
        "--json",
    ]));
    let f = &plain["components"][0]["fp8"];
    assert_eq!(
        (f["tensors"].as_u64(), f["scaled"].as_u64()),
        (Some(50), Some(0)),
        "{f}"
    );
    let none = json(&ddo(&["inspect", &fixture("flux_transformer"), "--json"]));
    assert!(none["components"][0]["fp8"].is_null());
    let text = ok(&ddo(&["inspect", &fixture("flux_transformer_fp8")]));
    assert!(
        text.contains("50 fp8 tensors")
            && text.contains("no scales")
            && text.contains("(refused by linear_convolution)"),
        "{text}"
    );
}

#[test]
fn inspect_reads_a_pipeline_folder_from_headers() {
    let v = json(&ddo(&[
        "inspect",
        &fixture("flux_pipeline"),
        "--vram-budget",
        "300KiB",
        "--json",
    ]));
    let comps = v["components"].as_array().unwrap();
    let names: Vec<&str> = comps
        .iter()
        .map(|c| c["component"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["text_encoder", "text_encoder_2", "transformer", "vae"]
    );
    let transformer = &comps[2];
    assert_eq!(transformer["class"], "FluxTransformer2DModel");
    assert_eq!(transformer["tensors"], 66);
    assert_eq!(transformer["params"], 78544);
    assert_eq!(transformer["bytes"], 78544 * 4);
    assert_eq!(transformer["by_dtype"]["F32"]["params"], 78544);
    assert!(transformer["largest_leaf"][1].as_u64().unwrap() > 0);
    let presets = v["presets"].as_array().unwrap();
    assert_eq!(presets.len(), 8);
    let warm = presets
        .iter()
        .find(|p| p["preset"] == "warm_process")
        .unwrap();
    let t = &warm["components"][2];
    assert_eq!(t["resident_bytes"], 78544 * 4);
    assert!(t["note"].as_str().unwrap().contains("does not fit"), "{t}");

    let text = ok(&ddo(&[
        "inspect",
        &fixture("vae_flux/diffusion_pytorch_model.safetensors"),
    ]));
    assert!(text.contains("AutoencoderKL"), "{text}");
    assert!(text.contains("F32"), "{text}");
}

/// Every bad input: a non-zero exit and exactly one line on stderr that names the problem
/// and carries a hint; never a panic or a backtrace.
#[test]
fn bad_inputs_exit_non_zero_with_one_line_and_a_hint() {
    let d = scratch("bad");
    let junk = d.join("junk.safetensors");
    std::fs::write(&junk, b"not a safetensors file").unwrap();
    let junk = junk.to_str().unwrap().to_string();
    let vae_flux = fixture("vae_flux");
    let vae_sd = fixture("vae_sd");
    let flux_latents = fixture("vae_flux/inputs.safetensors");
    let cases: Vec<(Vec<&str>, i32, &str)> = vec![
        (
            vec!["run", "--config", "tiny", "--preset", "fastest"],
            2,
            "unknown preset",
        ),
        (
            vec!["run", "--config", "tiny", "--dtype", "fp4"],
            2,
            "fp8_e4m3",
        ),
        (
            vec![
                "decode",
                "--weights",
                &vae_flux,
                "--latents",
                &flux_latents,
                "--dtype",
                "fp8",
                "--out",
                "never-written.png",
            ],
            2,
            "not stored as fp8",
        ),
        (
            vec!["run", "--config", "tiny", "--route", "vae=turbo"],
            2,
            "unknown route",
        ),
        (
            vec!["run", "--config", "tiny", "--route", "unet=none"],
            2,
            "unknown component",
        ),
        (
            vec!["resolve", "--component", "unet"],
            2,
            "unknown component",
        ),
        (
            vec!["run", "--config", "tiny", "--device", "gpu"],
            2,
            "unknown device",
        ),
        (
            vec!["run", "--config", "tiny", "--device", "cuda:x"],
            2,
            "unknown device",
        ),
        (vec!["run", "--config", "nope"], 2, "unknown config"),
        (
            vec!["run", "--weights", "/nonexistent/ddo"],
            1,
            "/nonexistent/ddo",
        ),
        (vec!["run", "--weights", &vae_flux], 1, "transformer"),
        (
            vec![
                "decode",
                "--weights",
                "/nonexistent",
                "--latents",
                &flux_latents,
                "--out",
                "/tmp/x.png",
            ],
            1,
            "/nonexistent",
        ),
        (
            vec![
                "decode",
                "--weights",
                &vae_flux,
                "--latents",
                &junk,
                "--out",
                "/tmp/x.png",
            ],
            1,
            "junk.safetensors",
        ),
        (vec!["inspect", &junk], 1, "junk.safetensors"),
        (
            vec!["run", "--config", "tiny", "--vram-budget", "1KiB"],
            1,
            "too small",
        ),
        (
            vec![
                "decode",
                "--weights",
                &vae_flux,
                "--latents",
                &flux_latents,
                "--out",
                "/tmp/x.png",
                "--vram-budget",
                "1KiB",
            ],
            2,
            "largest leaf",
        ),
        (
            vec!["run", "--config", "tiny", "--vram-budget", "lots"],
            2,
            "vram-budget",
        ),
        (
            vec![
                "run",
                "--config",
                "tiny",
                "--route",
                "vae=diffusers_group_offload:record_stream=true",
            ],
            2,
            "record_stream",
        ),
        (vec!["run", "--config", "tiny", "--steps", "0"], 2, "steps"),
        (vec!["run", "--config", "tiny", "--out", "x.jpg"], 2, ".png"),
        (
            vec!["run", "--config", "tiny", "--bogus"],
            2,
            "unknown option",
        ),
        (vec!["run"], 2, "--config tiny"),
        (vec!["frobnicate"], 2, "unknown command"),
        (vec![], 2, "no command"),
        (vec!["inspect"], 2, "PATH"),
        (
            vec![
                "decode",
                "--weights",
                &vae_sd,
                "--latents",
                &flux_latents,
                "--out",
                "/tmp/x.png",
            ],
            2,
            "latent",
        ),
    ];
    for (args, code, needle) in &cases {
        let out = ddo(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(*code), "ddo {args:?}: {stderr}");
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(
            lines.len(),
            1,
            "ddo {args:?}: stderr is not one line:\n{stderr}"
        );
        let line = lines[0];
        assert!(line.starts_with("ddo: error: "), "ddo {args:?}: {line}");
        assert!(
            line.contains(needle),
            "ddo {args:?}: `{needle}` not in {line}"
        );
        let hinted = line.contains("hint") || line.contains("; ") || line.contains(" or ");
        assert!(hinted, "ddo {args:?}: no hint in {line}");
        assert!(
            !line.contains("panicked") && !line.contains("RUST_BACKTRACE"),
            "{line}"
        );
    }
}

#[test]
fn help_lists_commands_and_options() {
    let text = ok(&ddo(&["help"]));
    for c in ["run", "decode", "resolve", "inspect"] {
        assert!(text.contains(c), "{text}");
    }
    let text = ok(&ddo(&["help", "run"]));
    for o in [
        "--config",
        "--route",
        "--tiled-decode",
        "--init-latents",
        "stand-in tokenizer",
    ] {
        assert!(text.contains(o), "{o} missing:\n{text}");
    }
}

#[test]
fn run_from_a_text_prompt_uses_the_folders_tokenizers_and_matches_diffusers() {
    let d = scratch("text");
    let out_file = d.join("text.safetensors");
    let prompt: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("fixtures/flux_pipeline/prompt.json")).unwrap(),
    )
    .unwrap();
    let text = ok(&ddo(&[
        "run",
        "--weights",
        &fixture("flux_pipeline"),
        "--prompt",
        prompt["prompt"].as_str().unwrap(),
        "--max-sequence-length",
        &prompt["max_sequence_length"].to_string(),
        "--init-latents",
        &fixture("flux_pipeline/inputs.safetensors"),
        "--height",
        "32",
        "--width",
        "24",
        "--steps",
        "4",
        "--out",
        out_file.to_str().unwrap(),
    ]));
    assert!(text.contains("tokenizer files"), "{text}");
    let (_, latents) = tensor(&out_file, "latents");
    let (_, reference) = tensor(
        &repo().join("fixtures/flux_pipeline/outputs.safetensors"),
        "text_latents",
    );
    let err = max_abs(&latents, &reference);
    assert!(err <= 1e-4, "latents from text: max |diff| {err:e}");
}

#[test]
fn bench_reports_coded_streaming_and_its_output_matches_the_uncompressed_route() {
    let v = json(&ddo(&[
        "bench",
        "--config",
        "tiny",
        "--height",
        "32",
        "--width",
        "32",
        "--dtype",
        "bf16",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--route",
        "diffusers_group_offload:offload_type=leaf_level,use_stream=true",
        "--route",
        "diffusers_group_offload:offload_type=leaf_level,use_stream=true,compress=lossless",
        "--json",
    ]));
    let cands = v["candidates"].as_array().unwrap();
    assert_eq!(cands.len(), 2);
    for c in cands {
        assert!(c["error"].is_null(), "{c}");
    }
    assert!(cands[0]["coded"].is_null(), "{}", cands[0]);
    let coded = &cands[1]["coded"];
    let (bytes, raw) = (
        coded["coded_bytes"].as_u64().unwrap(),
        coded["raw_bytes"].as_u64().unwrap(),
    );
    assert!(
        bytes > 0 && bytes < raw,
        "bf16 weights code smaller: {coded}"
    );
    assert_eq!(
        cands[1]["streamed_bytes_per_forward"].as_u64().unwrap(),
        bytes,
        "the link carries the coded bytes"
    );
    assert!(coded["exponent_entropy_millibits"].as_u64().unwrap() > 0);
    assert_eq!(
        coded["cache"], "unavailable",
        "random weights are not cached"
    );
    assert_eq!(cands[0]["output_fnv1a"], cands[1]["output_fnv1a"]);
}

/// The table says whether the candidates' outputs agree, with the one hash the JSON holds.
#[test]
fn bench_text_says_the_candidates_outputs_agree() {
    let args = tiny_bench(
        "1",
        &[
            "--route",
            "none",
            "--route",
            "diffusers_group_offload:offload_type=leaf_level,use_stream=true,copy_ahead=true",
        ],
    );
    let text = ok(&ddo(&args));
    let mut with_json = args.clone();
    with_json.push("--json");
    let v = json(&ddo(&with_json));
    let hash = v["candidates"][0]["output_fnv1a"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(v["candidates"][1]["output_fnv1a"], hash.as_str());
    assert!(
        text.contains(&format!(
            "output: the 2 candidates' last forwards gave one output (FNV-1a {hash})"
        )),
        "{text}"
    );
}

#[test]
fn bench_compares_routes_in_one_process() {
    let d = scratch("bench");
    let out_json = d.join("bench.json");
    let v = json(&ddo(&tiny_bench(
        "2",
        &["--json", "--out-json", out_json.to_str().unwrap()],
    )));
    assert_eq!(v["command"], "bench");
    assert_eq!(v["component"], "transformer");
    assert!(v["link_bytes_per_sec"].as_f64().unwrap() > 0.0);
    let cands = v["candidates"].as_array().unwrap();
    assert_eq!(cands.len(), 5);
    for c in cands {
        assert!(c["error"].is_null(), "{c}");
        assert_eq!(c["seconds"].as_array().unwrap().len(), 2);
        assert!(c["median_seconds"].as_f64().unwrap() > 0.0);
        assert!(c["peak_bytes"].as_u64().unwrap() > 0);
        // Host memory with the candidate attached (Linux): the process holds at least
        // its anonymous and file pages.
        if cfg!(target_os = "linux") {
            let m = &c["host_memory"];
            let rss = m["rss_bytes"].as_u64().unwrap();
            assert!(rss > 0, "{m}");
            assert!(
                m["anon_bytes"].as_u64().unwrap() + m["file_bytes"].as_u64().unwrap() <= rss,
                "{m}"
            );
            // glibc's count of the heap in use: the process has one.
            if cfg!(target_env = "gnu") {
                assert!(m["heap_bytes"].as_u64().unwrap() > 0, "{m}");
            }
        }
    }
    // Every route computes the resident output bit for bit.
    let sums: Vec<&str> = cands
        .iter()
        .map(|c| c["output_fnv1a"].as_str().unwrap())
        .collect();
    assert!(sums.iter().all(|s| *s == sums[0]), "{sums:?}");
    assert_eq!(
        cands[0]["streamed_bytes_per_forward"], 0,
        "none streams nothing"
    );
    assert!(cands[1]["streamed_bytes_per_forward"].as_u64().unwrap() > 0);
    assert!(cands[1]["ratio_to_floor"].as_f64().unwrap() > 0.0);
    let saved: Value = serde_json::from_str(&std::fs::read_to_string(&out_json).unwrap()).unwrap();
    assert_eq!(saved["candidates"].as_array().unwrap().len(), 5);
    assert!(cands[0]["op_profile"].is_null(), "no profile unless asked");

    // --profile: one more forward with every op timed, by class. The tiny transformer runs
    // its linears and one attention per block (2 double + 2 single blocks, with the
    // fixture's config) through the ops.
    let v = json(&ddo(&[
        "bench",
        "--config",
        "tiny",
        "--height",
        "32",
        "--width",
        "32",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--route",
        "none",
        "--profile",
        "--json",
    ]));
    let profile = &v["candidates"][0]["op_profile"]["classes"];
    let class = |name: &str| {
        profile
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["op"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("no {name} in {profile}"))
    };
    assert!(
        class("attention")["calls"].as_u64().unwrap() >= 2,
        "{profile}"
    );
    assert!(class("attention")["flops"].as_u64().unwrap() > 0);
    assert!(class("linear")["calls"].as_u64().unwrap() > 10, "{profile}");
    // The compute floor: the profiled forward's flops over the host GEMM's rate at its
    // largest linear, measured in the same process; each candidate's median against it.
    let floor = &v["compute_floor"];
    let all_flops: u64 = profile
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["flops"].as_u64().unwrap())
        .sum();
    assert_eq!(
        floor["flops_per_forward"].as_u64().unwrap(),
        all_flops,
        "{floor}"
    );
    let g = &floor["gemm"];
    let gemm_flops = 2 * ["rows", "k", "n"]
        .iter()
        .map(|d| g[d].as_u64().unwrap())
        .product::<u64>();
    assert!(gemm_flops > 0 && gemm_flops <= class("linear")["flops"].as_u64().unwrap());
    let (rate, seconds) = (
        floor["flops_per_sec"].as_f64().unwrap(),
        floor["seconds"].as_f64().unwrap(),
    );
    assert!(rate > 0.0 && (seconds - all_flops as f64 / rate).abs() <= seconds * 1e-9);
    let c0 = &v["candidates"][0];
    // The host's queueing time of a timed forward: positive, never past the forward's.
    let queued = c0["median_enqueued_seconds"].as_f64().unwrap();
    assert!(
        queued > 0.0 && queued <= c0["max_seconds"].as_f64().unwrap(),
        "{c0}"
    );
    // The linears by shape: every linear call of the profile is in one of them.
    let shapes = c0["op_profile"]["linears"].as_array().unwrap();
    let by_shape: u64 = shapes
        .iter()
        .filter(|l| l["op"] == "linear")
        .map(|l| l["calls"].as_u64().unwrap())
        .sum();
    assert_eq!(by_shape, class("linear")["calls"].as_u64().unwrap());
    let ratio = c0["ratio_to_compute_floor"].as_f64().unwrap();
    assert!(
        (ratio - c0["median_seconds"].as_f64().unwrap() / seconds).abs() <= ratio * 1e-9,
        "{c0}"
    );
    let text = ok(&ddo(&[
        "bench",
        "--config",
        "tiny",
        "--height",
        "32",
        "--width",
        "32",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--route",
        "none",
        "--profile",
    ]));
    assert!(
        text.contains("device time per op class") && text.contains("TFLOP/s"),
        "{text}"
    );
    assert!(
        text.contains("linear rowsxkxn") && text.contains("host: a timed forward queued in"),
        "{text}"
    );
    assert!(
        text.contains("compute floor: ") && text.contains("x compute"),
        "{text}"
    );

    // A candidate that is refused is reported, the others still run.
    let text = ok(&ddo(&[
        "bench",
        "--config",
        "tiny",
        "--component",
        "vae",
        "--height",
        "32",
        "--width",
        "32",
        "--repeats",
        "1",
        "--route",
        "native_vmm:budget=1KiB",
        "--preset",
        "auto",
    ]));
    assert!(text.contains("refused"), "{text}");
    assert!(text.contains("preset auto"), "{text}");
    let out = ddo(&["bench", "--config", "tiny", "--component", "unet"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn run_releases_the_native_idle_cache_only_under_the_native_allocator() {
    let d = scratch("native-idle");
    let png = d.join("t.png");
    let base = [
        "run",
        "--config",
        "tiny",
        "--steps",
        "1",
        "--height",
        "32",
        "--width",
        "32",
        "--release-native-idle",
        "--json",
        "--out",
        png.to_str().unwrap(),
    ];
    // Caching allocator (no route needs the native one): refused before anything runs.
    let out = ddo(&base);
    assert_ne!(out.status.code(), Some(0));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("native VMM allocator"), "{err}");
    assert!(!png.exists(), "nothing was written");
    // With the transformer on native_vmm the device runs the native allocator: every phase
    // reports the pool and the release.
    let mut args = base.to_vec();
    args.extend(["--route", "transformer=native_vmm:budget=64MiB"]);
    let v = json(&ddo(&args));
    for p in v["phases"].as_array().unwrap() {
        assert!(p["native_pool"].is_object(), "{p}");
        assert_eq!(
            p["idle_release"]["bytes"], 0,
            "host backend frees eagerly: {p}"
        );
        assert!(
            p["idle_release"]["basis"]
                .as_str()
                .unwrap()
                .contains("every stream idle"),
            "{p}"
        );
    }
    assert_eq!(v["components"][2]["metrics"]["allocator"], "native_vmm");
}

/// Outputs never touch inputs and are checked before any work: `--out` naming the VAE's
/// checkpoint, the latents file or a file inside the weights folder, and `--out` equal to
/// `--save-latents`, are refused (exit 2) with every file unchanged; an output directory that
/// does not exist is refused before the pipeline runs; a successful run leaves no temporary
/// file beside its outputs.
#[test]
fn outputs_never_overwrite_inputs_and_are_checked_first() {
    let d = scratch("outputs");
    let vae = repo().join("fixtures/vae_flux");
    let ckpt = vae.join("diffusion_pytorch_model.safetensors");
    let before = std::fs::read(&ckpt).unwrap();
    let latents = d.join("latents.safetensors");
    let out = ddo(&[
        "run",
        "--config",
        "tiny",
        "--out",
        d.join("a.png").to_str().unwrap(),
        "--save-latents",
        latents.to_str().unwrap(),
    ]);
    ok(&out);
    let mut names: Vec<String> = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["a.png", "latents.safetensors"],
        "no temporary file left"
    );
    let lat_before = std::fs::read(&latents).unwrap();
    let vae_s = vae.to_str().unwrap();
    let lat_s = latents.to_str().unwrap();
    let inside = vae.join("new.png");
    for (args, needle) in [
        (
            vec![
                "decode",
                "--weights",
                vae_s,
                "--latents",
                lat_s,
                "--out",
                ckpt.to_str().unwrap(),
            ],
            "destroy an input",
        ),
        (
            vec![
                "decode",
                "--weights",
                vae_s,
                "--latents",
                lat_s,
                "--out",
                lat_s,
            ],
            "destroy an input",
        ),
        (
            vec![
                "decode",
                "--weights",
                vae_s,
                "--latents",
                lat_s,
                "--out",
                inside.to_str().unwrap(),
            ],
            "inside the folder",
        ),
        (
            vec![
                "run",
                "--config",
                "tiny",
                "--out",
                lat_s,
                "--save-latents",
                lat_s,
            ],
            "name the same file",
        ),
        (
            vec![
                "run",
                "--config",
                "tiny",
                "--init-latents",
                lat_s,
                "--save-latents",
                lat_s,
            ],
            "destroy an input",
        ),
        (
            vec![
                "run",
                "--config",
                "tiny",
                "--out",
                d.join("missing/x.png").to_str().unwrap(),
            ],
            "cannot be used",
        ),
        (
            vec![
                "run",
                "--config",
                "tiny",
                "--save-latents",
                d.to_str().unwrap(),
            ],
            "--save-latents",
        ),
        (
            vec!["run", "--config", "tiny", "--out", d.to_str().unwrap()],
            "--out",
        ),
    ] {
        let out = ddo(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(
            !err.contains("prompt_encoding"),
            "refused before any phase: {err}"
        );
    }
    assert_eq!(
        std::fs::read(&ckpt).unwrap(),
        before,
        "the checkpoint is untouched"
    );
    assert_eq!(
        std::fs::read(&latents).unwrap(),
        lat_before,
        "the latents are untouched"
    );
    assert!(!inside.exists());
}

/// Sizes and values that would be silently wrong: a height that is not a multiple of 2x the
/// VAE factor is rounded down as Diffusers does and the profile says so (the PNG has the
/// size reported); a NaN in the latents is refused; a T5 length above FluxPipeline's 512 is
/// refused before any allocation.
#[test]
fn sizes_are_rounded_as_diffusers_does_and_non_finite_inputs_are_refused() {
    let d = scratch("sizes");
    let png = d.join("r.png");
    let v = json(&ddo(&[
        "run",
        "--config",
        "tiny",
        "--height",
        "70",
        "--width",
        "64",
        "--json",
        "--out",
        png.to_str().unwrap(),
    ]));
    assert_eq!(
        (v["height"].as_u64(), v["width"].as_u64()),
        (Some(68), Some(64))
    );
    assert!(
        v["size_note"].as_str().unwrap().contains("rounded down"),
        "{v}"
    );
    let bytes = std::fs::read(&png).unwrap();
    let dim = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap());
    assert_eq!((dim(16), dim(20)), (64, 68), "the PNG is the size reported");

    let nan = d.join("nan.safetensors");
    let mut values = vec![0.25f32; 16 * 8 * 8];
    values[5] = f32::NAN;
    let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1, 16, 8, 8], &data)
            .unwrap();
    safetensors::serialize_to_file([("latents".to_string(), view)], None, &nan).unwrap();
    let out = ddo(&[
        "decode",
        "--weights",
        &fixture("vae_flux"),
        "--latents",
        nan.to_str().unwrap(),
        "--out",
        d.join("n.png").to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("NaN or infinite"), "{err}");
    assert!(!d.join("n.png").exists());

    let out = ddo(&["run", "--config", "tiny", "--guidance", "1e38"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("overflows f32"), "{err}");

    let out = ddo(&["run", "--config", "tiny", "--max-sequence-length", "100000"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("cannot be greater than 1024"), "{err}");
    // T5's limit is FluxPipeline's: past it, a Flux run is refused before anything is built.
    let out = ddo(&["run", "--config", "tiny", "--max-sequence-length", "513"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("cannot be greater than 512"), "{err}");
}

/// Counts and arguments that used to abort or panic: a step count the host cannot schedule
/// is refused before any allocation, an argument that is not UTF-8 is refused in one line,
/// and `ddo help bench` (where errors point) lists bench's options.
#[test]
fn counts_and_arguments_that_would_abort_are_refused_in_one_line() {
    let out = ddo(&["run", "--config", "tiny", "--steps", "99999999999999"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("more than this host can schedule"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let out = Command::new(env!("CARGO_BIN_EXE_ddo"))
            .args(["run", "--config", "tiny", "--prompt"])
            .arg(std::ffi::OsStr::from_bytes(b"\xff\xfe"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains("not valid UTF-8"), "{err}");
    }
    let help = ok(&ddo(&["help", "bench"]));
    assert!(
        help.contains("--component") && help.contains("--timeline"),
        "{help}"
    );
    // A budget hint names a size the parser takes.
    let d = scratch("hint");
    let out_png = d.join("h.png");
    // Issue 34, item 10: the budget named is one the whole plan fits, also where a later
    // phase needs more than prompt encoding (256x384: denoise's activations).
    for (h, w) in [("128", "128"), ("256", "384")] {
        let base = [
            "run", "--config", "tiny", "--steps", "1", "--height", h, "--width", w,
        ];
        let mut args = base.to_vec();
        args.extend(["--vram-budget", "1KiB"]);
        let out = ddo(&args);
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        let size = err
            .split("give --vram-budget ")
            .nth(1)
            .and_then(|t| t.split([' ', ',']).next())
            .unwrap_or_else(|| panic!("{err}"))
            .to_string();
        let mut args = base.to_vec();
        args.extend(["--vram-budget", &size, "--out", out_png.to_str().unwrap()]);
        let again = ddo(&args);
        let err2 = String::from_utf8_lossy(&again.stderr);
        assert!(!err2.contains("invalid --vram-budget"), "{size}: {err2}");
        assert!(
            again.status.success(),
            "{h}x{w} at {size} (from: {err}): {err2}"
        );
    }
}

/// Files that are not files: a FIFO `config.json` or checkpoint, and a `config.json` that
/// links to `/dev/zero`, are refused at once (they used to hang or read without end).
#[cfg(unix)]
#[test]
fn fifos_and_devices_are_refused_not_read() {
    let d = scratch("fifo");
    let src = repo().join("fixtures/vae_flux");
    let latents = d.join("l.safetensors");
    ok(&ddo(&[
        "run",
        "--config",
        "tiny",
        "--out",
        d.join("a.png").to_str().unwrap(),
        "--save-latents",
        latents.to_str().unwrap(),
    ]));
    type Make<'a> = &'a dyn Fn(&Path);
    let cases: [(&str, Make); 3] = [
        ("config.json", &|p: &Path| {
            let status = Command::new("mkfifo").arg(p).status().unwrap();
            assert!(status.success());
        }),
        ("config.json", &|p: &Path| {
            std::os::unix::fs::symlink("/dev/zero", p).unwrap()
        }),
        ("diffusion_pytorch_model.safetensors", &|p: &Path| {
            let status = Command::new("mkfifo").arg(p).status().unwrap();
            assert!(status.success());
        }),
    ];
    for (i, (name, make)) in cases.iter().enumerate() {
        let vae = d.join(format!("vae{i}"));
        std::fs::create_dir_all(&vae).unwrap();
        for f in ["config.json", "diffusion_pytorch_model.safetensors"] {
            if f != *name {
                std::fs::copy(src.join(f), vae.join(f)).unwrap();
            }
        }
        make(&vae.join(name));
        let mut child = Command::new(env!("CARGO_BIN_EXE_ddo"))
            .args(["decode", "--weights", vae.to_str().unwrap(), "--latents"])
            .arg(&latents)
            .args(["--out", d.join(format!("o{i}.png")).to_str().unwrap()])
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let started = std::time::Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if started.elapsed().as_secs() > 20 {
                let _ = child.kill();
                panic!("case {i} ({name}): ddo decode hung");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let mut err = String::new();
        use std::io::Read;
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        assert!(!status.success(), "case {i}: {err}");
        // A FIFO checkpoint is not taken for weights at all.
        assert!(
            err.contains("not a regular file") || err.contains("no safetensors weights"),
            "case {i} ({name}): {err}"
        );
    }
}

/// Smaller ones: an option the chosen route does not take is a usage error (exit 2) before
/// any output; a bad `DDO_VAE_ROUTE` that `--route vae=` overrides is not read; latents
/// stored as I64 are named with their dtype, not "no tensor named latents".
#[test]
fn route_options_overrides_and_latent_dtypes_are_reported_as_they_are() {
    let d = scratch("smaller");
    let png = d.join("s.png");
    let out = ddo(&[
        "run",
        "--config",
        "tiny",
        "--route",
        "vae=none:budget=1KiB",
        "--out",
        png.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("cannot be honoured"), "{err}");
    assert!(out.stdout.is_empty(), "nothing printed before the refusal");
    ok(&ddo_with_env(
        &[
            "run",
            "--config",
            "tiny",
            "--route",
            "vae=linear_convolution",
            "--out",
            png.to_str().unwrap(),
        ],
        &[("DDO_VAE_ROUTE", "garbage")],
    ));
    let ints = d.join("ints.safetensors");
    let data: Vec<u8> = (0..16i64 * 4 * 4).flat_map(|v| v.to_le_bytes()).collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::I64, vec![1, 16, 4, 4], &data)
            .unwrap();
    safetensors::serialize_to_file([("latents".to_string(), view)], None, &ints).unwrap();
    let out = ddo(&[
        "decode",
        "--weights",
        &fixture("vae_flux"),
        "--latents",
        ints.to_str().unwrap(),
        "--out",
        d.join("i.png").to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("I64") && err.contains("does not load"),
        "{err}"
    );
}

/// `inspect` refuses exactly the files the loader refuses: over the fuzz seed corpus of
/// safetensors headers (duplicates, truncations, overflowing lengths, ...), `ddo inspect`
/// fails exactly when `Checkpoint::validate_bytes` (what `run` and `decode` open with) does;
/// and an index naming a shard outside its folder is refused.
#[test]
fn inspect_refuses_what_the_loader_refuses() {
    let d = scratch("inspect-corpus");
    let corpus = repo().join("fuzz/corpus/safetensors_header");
    let mut seen = 0;
    for entry in std::fs::read_dir(&corpus).unwrap() {
        let src = entry.unwrap().path();
        let bytes = std::fs::read(&src).unwrap();
        let file = d.join(format!("{seen}.safetensors"));
        std::fs::write(&file, &bytes).unwrap();
        let loader_refuses = ddo_core::Checkpoint::validate_bytes(&bytes, &file).is_err();
        let out = ddo(&["inspect", file.to_str().unwrap()]);
        assert_eq!(
            !out.status.success(),
            loader_refuses,
            "{}: inspect {} but the loader {}: {}",
            src.display(),
            if out.status.success() {
                "accepts"
            } else {
                "refuses"
            },
            if loader_refuses { "refuses" } else { "accepts" },
            String::from_utf8_lossy(&out.stderr)
        );
        seen += 1;
    }
    assert!(seen >= 5, "the corpus is there");
    let shards = d.join("sharded");
    std::fs::create_dir_all(&shards).unwrap();
    std::fs::write(
        shards.join("diffusion_pytorch_model.safetensors.index.json"),
        r#"{"weight_map": {"a": "../../etc/passwd"}}"#,
    )
    .unwrap();
    let out = ddo(&["inspect", shards.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("not a file name inside"), "{err}");
}

/// A config that leaves checkpoint tensors unused (here `mid_block_add_attention: false`
/// beside a checkpoint that has the attention) is refused, naming the flag that allows it;
/// with `--allow-unused-weights` it decodes.
#[test]
fn checkpoint_tensors_the_config_leaves_unused_are_refused_unless_allowed() {
    let d = scratch("unused");
    let src = repo().join("fixtures/vae_flux");
    let vae = d.join("vae");
    std::fs::create_dir_all(&vae).unwrap();
    std::fs::copy(
        src.join("diffusion_pytorch_model.safetensors"),
        vae.join("diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config["mid_block_add_attention"] = Value::Bool(false);
    std::fs::write(vae.join("config.json"), config.to_string()).unwrap();
    let latents = d.join("l.safetensors");
    let data: Vec<u8> = (0..16 * 8 * 8)
        .flat_map(|i| (i as f32 / 1024.0).to_le_bytes())
        .collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1, 16, 8, 8], &data)
            .unwrap();
    safetensors::serialize_to_file([("latents".to_string(), view)], None, &latents).unwrap();
    let png = d.join("o.png");
    let args = [
        "decode",
        "--weights",
        vae.to_str().unwrap(),
        "--latents",
        latents.to_str().unwrap(),
        "--out",
        png.to_str().unwrap(),
    ];
    let out = ddo(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("not used by its config") && err.contains("--allow-unused-weights"),
        "{err}"
    );
    assert!(err.contains("mid_block.attentions"), "{err}");
    let mut allowed = args.to_vec();
    allowed.push("--allow-unused-weights");
    ok(&ddo(&allowed));
    assert!(png.exists());
}

/// `ddo resolve` shows the ring a budgeted group offload really gets (3 slots under a
/// budget, 2 without), the route's own answer.
#[test]
fn resolve_shows_the_budgeted_ring() {
    let slots = |route: &str| {
        let v = json(&ddo(&[
            "resolve",
            "--route",
            route,
            "--component",
            "transformer",
            "--json",
        ]));
        v[0]["options"]["ring_slots"].as_u64()
    };
    assert_eq!(
        slots("transformer=diffusers_group_offload:use_stream=true,budget=10GiB"),
        Some(3)
    );
    assert_eq!(
        slots("transformer=diffusers_group_offload:use_stream=true"),
        Some(2)
    );
    assert_eq!(
        slots("transformer=diffusers_group_offload:use_stream=true,budget=10GiB,ring_slots=5"),
        Some(5)
    );
}
