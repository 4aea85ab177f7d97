//! Issue 34's "low" items on folder classes and messages: `ddo decode` refuses a folder of
//! another class by its config's class; `ddo inspect` names a single-model folder's
//! component by its class, so its routes are the resolver's and `--route vae=...` is taken,
//! says when a `--route` refuses the weights' dtype, and honours a route's `budget`; a
//! `model_index.json` or `scheduler_config.json` that is no regular file is refused; and
//! messages name what the user gave, not a computed value.

mod common;

use std::path::{Path, PathBuf};

use common::*;

/// A folder in `dir` named `name` holding only `fixture`'s `config.json` (no weights), its
/// `_class_name` replaced by `class` when given.
fn config_only(dir: &Path, name: &str, fixture_name: &str, class: Option<&str>) -> PathBuf {
    let to = dir.join(name);
    std::fs::create_dir_all(&to).unwrap();
    let text = std::fs::read_to_string(
        repo()
            .join("fixtures")
            .join(fixture_name)
            .join("config.json"),
    )
    .unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    if let Some(class) = class {
        json["_class_name"] = class.into();
    }
    std::fs::write(to.join("config.json"), json.to_string()).unwrap();
    to
}

/// A `latents` tensor [1, 4, 4, 4] of zeros in `dir`.
fn latents(dir: &Path) -> PathBuf {
    let path = dir.join("latents.safetensors");
    let data = vec![0u8; 4 * 4 * 4 * 4];
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1, 4, 4, 4], &data)
            .unwrap();
    safetensors::serialize_to_file([("latents".to_string(), view)], None, &path).unwrap();
    path
}

/// `ddo decode --weights DIR`: stderr and the exit status.
fn decode(weights: &Path, latents: &Path, out: &Path) -> (Option<i32>, String) {
    let o = ddo(&[
        "decode",
        "--weights",
        weights.to_str().unwrap(),
        "--latents",
        latents.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stderr).to_string(),
    )
}

/// Item 1: `ddo decode` reads the folder's class first and refuses any but AutoencoderKL,
/// saying what it found and what to give: a UNet (which parsed as an AutoencoderKL before),
/// Qwen-Image's VAE and the transformers (JSON parse errors before), a Qwen-Image pipeline
/// folder (its vae/), a Transformers text encoder (`architectures`). Nothing is written.
#[test]
fn decode_refuses_a_folder_of_another_class_by_its_class() {
    let d = scratch("decode-class");
    let lat = latents(&d);
    let out = d.join("out.png");
    let qwen_pipe = d.join("qwen_pipe");
    config_only(&qwen_pipe, "vae", "qwen_vae", None);
    let cases: [(PathBuf, &str, &[&str]); 6] = [
        (
            config_only(&d, "unet", "vae_sd", Some("UNet2DConditionModel")),
            "UNet2DConditionModel",
            &["not a VAE", "AutoencoderKL folder"],
        ),
        (
            config_only(&d, "qwen_vae", "qwen_vae", None),
            "AutoencoderKLQwenImage",
            &["QwenImagePipeline's VAE", "ddo run", "AutoencoderKL folder"],
        ),
        (
            qwen_pipe.clone(),
            "AutoencoderKLQwenImage",
            &["QwenImagePipeline's VAE", "ddo run"],
        ),
        (
            config_only(&d, "flux_transformer", "flux_transformer", None),
            "FluxTransformer2DModel",
            &["FluxPipeline's transformer, not a VAE", "vae/ folder"],
        ),
        (
            config_only(&d, "qwen_transformer", "qwen_image_transformer", None),
            "QwenImageTransformer2DModel",
            &["QwenImagePipeline's transformer, not a VAE", "ddo run"],
        ),
        (
            config_only(&d, "clip", "clip_text", None),
            "CLIPTextModel",
            &["FluxPipeline's text_encoder, not a VAE", "vae/ folder"],
        ),
    ];
    for (dir, class, says) in cases {
        let (code, err) = decode(&dir, &lat, &out);
        assert_eq!(code, Some(2), "{}: {err}", dir.display());
        assert!(err.contains(&format!("names {class}")), "{err}");
        for s in says {
            assert!(err.contains(s), "{}: `{s}` missing: {err}", dir.display());
        }
        assert!(
            !err.contains("invalid type") && !err.contains("missing field"),
            "{err}"
        );
        assert!(!out.exists(), "nothing written");
    }
}

/// A Qwen-Image pipeline folder in `dir/name`: links to the fixture's `transformer/` and
/// `vae/`, its own `scheduler/` and `model_index.json` (copies).
fn qwen_folder(dir: &Path, name: &str) -> PathBuf {
    let from = repo()
        .join("fixtures/qwen_pipeline")
        .canonicalize()
        .unwrap();
    let to = dir.join(name);
    std::fs::create_dir_all(to.join("scheduler")).unwrap();
    for c in ["transformer", "vae"] {
        std::os::unix::fs::symlink(from.join(c), to.join(c)).unwrap();
    }
    std::fs::copy(
        from.join("scheduler/scheduler_config.json"),
        to.join("scheduler/scheduler_config.json"),
    )
    .unwrap();
    std::fs::copy(from.join("model_index.json"), to.join("model_index.json")).unwrap();
    to
}

/// Replaces the file `p` with `what`: a directory, a FIFO, or a link to /dev/zero.
fn make_irregular(p: &Path, what: &str) {
    std::fs::remove_file(p).unwrap();
    match what {
        "a directory" => std::fs::create_dir(p).unwrap(),
        "a FIFO" => {
            let made = std::process::Command::new("mkfifo")
                .arg(p)
                .status()
                .unwrap();
            assert!(made.success());
        }
        _ => std::os::unix::fs::symlink("/dev/zero", p).unwrap(),
    }
}

/// `ddo resolve --weights DIR` (loads the pipeline and plans; runs nothing).
fn resolve_weights(dir: &Path) -> (Option<i32>, String) {
    let o = ddo(&["resolve", "--weights", dir.to_str().unwrap()]);
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stderr).to_string(),
    )
}

/// Item 4: a `model_index.json` or `scheduler/scheduler_config.json` that is there but is no
/// regular file (a directory, a FIFO, a link to /dev/zero) is refused naming what it is,
/// never opened (a FIFO would block) and never taken as absent (which made a Qwen-Image
/// folder "mix pipelines", and a scheduler config silently the default).
#[test]
fn a_model_index_or_scheduler_config_that_is_no_regular_file_is_refused_naming_it() {
    let d = scratch("irregular");
    let fine = qwen_folder(&d, "fine");
    assert_eq!(resolve_weights(&fine).0, Some(0), "the folder as made runs");
    for (i, (file, what, named)) in [
        ("model_index.json", "a directory", "a directory"),
        ("model_index.json", "a FIFO", "a FIFO"),
        (
            "model_index.json",
            "a character device",
            "a symbolic link to a device",
        ),
        (
            "scheduler/scheduler_config.json",
            "a directory",
            "a directory",
        ),
        ("scheduler/scheduler_config.json", "a FIFO", "a FIFO"),
    ]
    .into_iter()
    .enumerate()
    {
        let dir = qwen_folder(&d, &format!("case{i}"));
        make_irregular(&dir.join(file), what);
        let (code, err) = resolve_weights(&dir);
        assert_eq!(code, Some(1), "{file} {what}: {err}");
        assert!(err.contains(file), "{file} {what}: {err}");
        assert!(
            err.contains(&format!("{named}, not a regular file")),
            "{file} {what}: {err}"
        );
        assert!(!err.contains("mixes pipelines"), "{err}");
    }
}

/// Item 4: a Qwen-Image folder without `model_index.json` is refused saying the file is
/// missing and what a pipeline folder needs, not that it mixes pipelines.
#[test]
fn a_qwen_folder_without_model_index_is_told_the_file_is_missing() {
    let d = scratch("no-index");
    let dir = qwen_folder(&d, "qwen");
    std::fs::remove_file(dir.join("model_index.json")).unwrap();
    let (code, err) = resolve_weights(&dir);
    assert_eq!(code, Some(1), "{err}");
    assert!(!err.contains("mixes pipelines"), "{err}");
    for s in [
        "has no model_index.json",
        "QwenImageTransformer2DModel",
        "a QwenImagePipeline component",
        "a pipeline folder needs the model_index.json",
    ] {
        assert!(err.contains(s), "`{s}` missing: {err}");
    }
}

/// The presets `ddo inspect --json` reports: every preset, in ddo-core's order.
fn presets(inspect: &serde_json::Value) -> Vec<String> {
    let names: Vec<String> = inspect["presets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["preset"].as_str().unwrap().to_string())
        .collect();
    let all: Vec<&str> = ddo_core::Preset::ALL.iter().map(|p| p.as_str()).collect();
    assert_eq!(names, all);
    names
}

/// Item 2: a single-model folder is named by its class (AutoencoderKL → `vae`), so the
/// route `ddo inspect` shows for it under each preset is the one `ddo resolve --component
/// vae --preset P` resolves (the seed's VAE table: leaf level without a stream, or
/// resident), option for option; and `--route vae=...` is taken.
#[test]
fn inspect_names_a_vae_folder_vae_and_shows_the_resolver_routes() {
    let v = json(&ddo(&["inspect", &fixture("vae_sd"), "--json"]));
    assert_eq!(v["components"][0]["component"], "vae", "{v}");
    for p in presets(&v) {
        let plan = v["presets"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["preset"] == p.as_str())
            .unwrap();
        let shown = plan["components"][0]["route"].as_str().unwrap();
        let r = json(&ddo(&[
            "resolve",
            "--component",
            "vae",
            "--preset",
            &p,
            "--no-env",
            "--json",
        ]));
        let mut words = shown.split(' ');
        assert_eq!(words.next(), r[0]["route"].as_str(), "{p}: {shown} vs {r}");
        for kv in words {
            let (k, val) = kv.split_once('=').unwrap();
            let resolved = &r[0]["options"][k];
            let resolved = resolved
                .as_str()
                .map_or_else(|| resolved.to_string(), str::to_string);
            assert_eq!(resolved, val, "{p}: `{k}` in {shown} vs {r}");
        }
    }
    // The VAE table itself: no stream under auto, resident under warm_process.
    let route_of = |p: &str| {
        v["presets"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["preset"] == p)
            .unwrap()["components"][0]["route"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert!(route_of("auto").contains("use_stream=false"), "{v}");
    assert_eq!(route_of("warm_process"), "none");

    let out = ddo(&[
        "inspect",
        &fixture("vae_sd"),
        "--route",
        "vae=none",
        "--json",
    ]);
    let v = json(&out);
    assert_eq!(v["routes"][0]["component"], "vae");
    assert_eq!(v["routes"][0]["route"], "none");
    // The other single-model folders by their classes.
    for (f, component) in [
        ("flux_transformer", "transformer"),
        ("qwen_image_transformer", "transformer"),
        ("clip_text", "text_encoder"),
        ("t5_encoder", "text_encoder_2"),
        ("qwen_vae", "vae"),
        ("vae_flux/diffusion_pytorch_model.safetensors", "vae"),
    ] {
        let v = json(&ddo(&["inspect", &fixture(f), "--json"]));
        assert_eq!(v["components"][0]["component"], component, "{f}");
    }
}

/// Item 3: `--route transformer=linear_convolution` on fp8 weights says the route refuses
/// them (as `ddo run`'s preflight does), and a route's `budget` option changes the
/// estimate (diffusers_group_offload with a stream: resident what the budget holds).
#[test]
fn inspect_route_says_when_it_refuses_fp8_and_honours_the_budget() {
    for f in ["flux_transformer_fp8", "flux_transformer_fp8_scaled"] {
        let v = json(&ddo(&[
            "inspect",
            &fixture(f),
            "--route",
            "transformer=linear_convolution",
            "--json",
        ]));
        let r = &v["routes"][0];
        assert_eq!(r["refused"], true, "{f}: {r}");
        let note = r["note"].as_str().unwrap();
        assert!(note.contains("refused"), "{note}");
        assert!(note.contains("F8_E4M3"), "{note}");
        assert!(note.contains("diffusers_group_offload"), "{note}");
        let text = ok(&ddo(&[
            "inspect",
            &fixture(f),
            "--route",
            "transformer=linear_convolution",
        ]));
        assert!(text.contains("refused: linear_convolution"), "{text}");
    }
    // An f32 folder is taken.
    let v = json(&ddo(&[
        "inspect",
        &fixture("flux_transformer"),
        "--route",
        "transformer=linear_convolution",
        "--json",
    ]));
    assert_eq!(v["routes"][0]["refused"], false, "{v}");

    let resident = |route: &str| {
        let v = json(&ddo(&[
            "inspect",
            &fixture("flux_transformer_fp8"),
            "--route",
            &format!("transformer={route}"),
            "--json",
        ]));
        let bytes = v["components"][0]["bytes"].as_u64().unwrap();
        (v["routes"][0]["resident_bytes"].as_u64().unwrap(), bytes)
    };
    let (without, bytes) = resident("diffusers_group_offload:use_stream=true");
    let (with, _) = resident("diffusers_group_offload:use_stream=true,budget=1MiB");
    assert_eq!(without, 0);
    assert_eq!(with, bytes, "a 1 MiB budget holds the whole fixture");
    let (free, _) = resident("diffusers_group_offload:use_stream=true,budget=free");
    assert_eq!(free, bytes, "free of the 8 GiB default budget holds it");
}

/// stderr and the exit status of `ddo ARGS`.
fn fails(args: &[&str]) -> (Option<i32>, String) {
    let o = ddo(args);
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stderr).to_string(),
    )
}

/// Item 5: a refusal names what the user gave and why, never a computed value as the user's
/// invalid value: `--steps 1` on Qwen-Image (was an empty `scheduler` value), a `free-9GiB`
/// budget on native_vmm and on diffusers_group_offload (was a budget of `0`), and a decode
/// that does not fit under `--tiled-decode auto` when it was not given (was an invalid
/// value `auto`).
#[test]
fn refusals_name_what_the_user_gave_not_a_computed_value() {
    let d = scratch("given");
    let out = d.join("out.png");
    let out = out.to_str().unwrap();

    let (code, err) = fails(&[
        "run",
        "--config",
        "qwen-tiny",
        "--steps",
        "1",
        "--height",
        "32",
        "--width",
        "32",
        "--out",
        out,
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("invalid value `1` for `steps`"), "{err}");
    assert!(err.contains("2 or more steps"), "{err}");
    assert!(!err.contains("``"), "{err}");

    let (code, err) = fails(&[
        "run",
        "--config",
        "tiny",
        "--route",
        "transformer=native_vmm:budget=free-9GiB",
        "--out",
        out,
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("budget free-9.00 GiB leaves 0 B: the device has"),
        "{err}"
    );
    assert!(!err.contains("budget of 0 B"), "{err}");

    let (code, err) = fails(&[
        "run",
        "--config",
        "tiny",
        "--route",
        "transformer=diffusers_group_offload:use_stream=true,budget=free-9GiB",
        "--out",
        out,
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("budget free-9.00 GiB leaves 0 B: the device has"),
        "{err}"
    );
    assert!(!err.contains("invalid value `0`"), "{err}");

    // 64x64 latents with a 1 MiB budget: neither untiled nor the default tiles fit.
    let lat = d.join("lat64.safetensors");
    let data = vec![0u8; 4 * 64 * 64 * 4];
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1, 4, 64, 64], &data)
            .unwrap();
    safetensors::serialize_to_file([("latents".to_string(), view)], None, &lat).unwrap();
    let (code, err) = fails(&[
        "decode",
        "--weights",
        &fixture("vae_sd"),
        "--latents",
        lat.to_str().unwrap(),
        "--out",
        out,
        "--vram-budget",
        "1MiB",
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("--tiled-decode auto (the default) found no decode that fits"),
        "{err}"
    );
    assert!(err.contains("--vram-budget 2MiB"), "{err}");
    assert!(!err.contains("invalid value `auto`"), "{err}");
    assert!(!Path::new(out).exists(), "nothing written");
}
