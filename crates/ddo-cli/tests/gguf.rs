//! GGUF transformers (issue 37): `--transformer FILE.gguf` on the fixture Flux pipeline (a
//! tiny transformer in the original layout, its 2-D weights quantized to Q8_0, Q4_0, Q4_1,
//! Q5_0 and Q5_1 by gguf-py: `tools/gen_gguf_flux.py`) gives the image of the
//! original-layout safetensors file holding gguf-py's dequantization of the same file:
//! dequantized at load (`--dtype f32`, `--dtype bf16`) bit for bit, kept as blocks (the
//! default: a fraction of the weight bytes, bf16 compute) the same on every route that takes
//! it and within bf16's rounding; a T5 encoder in llama.cpp's names likewise;
//! `ddo inspect` names its types; a malformed file is refused by `run` and `inspect` alike,
//! naming the file and the field, with no output written.

mod common;

use std::path::{Path, PathBuf};

use common::{ddo, fixture, json, ok, rel_l2, scratch, tensor};

const GGUF: &str = "gguf/flux_pipeline-transformer-mixed.gguf";
const DEQUANTIZED: &str = "gguf/flux_pipeline-transformer-mixed.dequantized.safetensors";

/// `ddo run` of the fixture pipeline from its embeddings and noise (2 steps, 32x24) with
/// `extra`, writing `out`.
fn run(out: &Path, extra: &[&str]) -> std::process::Output {
    let inputs = fixture("flux_pipeline/inputs.safetensors");
    let folder = fixture("flux_pipeline");
    let out = out.to_str().unwrap();
    let mut args = vec![
        "run",
        "--weights",
        &folder,
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
        out,
    ];
    args.extend_from_slice(extra);
    ddo(&args)
}

/// The transformer's weight bytes in a `ddo run --json` report's memory plan.
fn weight_bytes(v: &serde_json::Value) -> u64 {
    v["memory_plan"]["components"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["component"] == "transformer")
        .map(|c| c["footprint"]["weight_bytes"].as_u64().unwrap())
        .unwrap()
}

#[test]
fn a_gguf_transformer_runs_as_its_dequantization_does() {
    let d = scratch("gguf-run");
    let go = |name: &str, extra: &[&str]| -> (PathBuf, serde_json::Value) {
        let out = d.join(format!("{name}.safetensors"));
        let v = json(&run(&out, &[&["--json"], extra].concat()));
        (out, v)
    };
    let gguf = fixture(GGUF);
    let reference = fixture(DEQUANTIZED);
    let (b, vb) = go("dequantized", &["--transformer", &reference]);
    let (b16, _) = go(
        "dequantized-bf16",
        &["--transformer", &reference, "--dtype", "bf16"],
    );
    // As stored: the blocks stay quantized on the host and the device, each linear
    // dequantizes its weight where it runs, and the model computes in bf16 (a GGUF
    // transformer's compute dtype): the same bytes on every route that takes it (resident,
    // streamed, native, coded; `linear_convolution` refuses quantized storage), a fraction
    // of the weight bytes, and the image of the dequantized weights run in bf16 up to the
    // f32 biases and norms the GGUF keeps.
    let mut first: Option<Vec<f32>> = None;
    for (name, route) in [
        ("gguf-resident", "transformer=none"),
        (
            "gguf-streamed",
            "transformer=diffusers_group_offload:offload_type=leaf_level,use_stream=true",
        ),
        ("gguf-native", "transformer=native_vmm"),
        (
            "gguf-coded",
            "transformer=diffusers_group_offload:offload_type=leaf_level,use_stream=true,compress=lossless",
        ),
    ] {
        let (a, va) = go(name, &["--transformer", &gguf, "--route", route]);
        let latents = tensor(&a, "latents").1;
        match &first {
            None => first = Some(latents.clone()),
            Some(f) => assert_eq!(f, &latents, "{name}: routes disagree"),
        }
        let e = rel_l2(&latents, &tensor(&b16, "latents").1);
        assert!(
            e < 1e-2,
            "{name}: {e:e} from the dequantized weights in bf16"
        );
        let (q, f) = (weight_bytes(&va), weight_bytes(&vb));
        assert!(
            q * 2 < f,
            "{name}: {q} B of weights against {f} B dequantized"
        );
    }
    // Dequantized at load: into f32, the f32 file's image bit for bit; into bf16, the
    // bf16-converted file's.
    let (c, _) = go("gguf-f32", &["--transformer", &gguf, "--dtype", "f32"]);
    for t in ["latents", "sample"] {
        assert_eq!(tensor(&c, t), tensor(&b, t), "{t}");
    }
    let (h, _) = go("gguf-bf16", &["--transformer", &gguf, "--dtype", "bf16"]);
    assert_eq!(tensor(&h, "latents"), tensor(&b16, "latents"));
    // The quantization is real, and small: against the folder's own transformer.
    let (plain, _) = go("folder", &[]);
    let (q, f) = (tensor(&c, "latents").1, tensor(&plain, "latents").1);
    let moved = rel_l2(&q, &f);
    assert!(moved > 1e-4 && moved < 0.2, "GGUF latents moved {moved:e}");
    let _ = std::fs::remove_dir_all(&d);
}

/// A LoRA on a GGUF transformer adapts it as it adapts the dequantized weights in bf16 (the
/// blocks untouched, the adapters added where each linear runs): the same image up to the
/// f32 biases and norms the GGUF keeps, far inside what the LoRA changes.
#[test]
fn a_lora_applies_to_a_gguf_transformer_unchanged() {
    let d = scratch("gguf-lora");
    let lora = d.join("style.safetensors");
    let v = |n: usize, seed: f32| -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32) * 0.37 + seed).sin() * 0.5)
            .collect()
    };
    let m = "lora_unet_double_blocks_0_img_attn_qkv";
    common::write_f32_safetensors(
        &lora,
        &[
            (format!("{m}.lora_down.weight"), vec![4, 32], v(128, 0.0)),
            (format!("{m}.lora_up.weight"), vec![96, 4], v(384, 3.0)),
            (format!("{m}.alpha"), vec![], vec![4.0]),
        ],
    );
    let go = |name: &str, transformer: &str, extra: &[&str]| -> PathBuf {
        let out = d.join(format!("{name}.safetensors"));
        let t = fixture(transformer);
        ok(&run(
            &out,
            &[&["--transformer", t.as_str()], extra].concat(),
        ));
        out
    };
    let l = lora.to_str().unwrap();
    let a = go("gguf", GGUF, &["--lora", l]);
    let b = go(
        "dequantized",
        DEQUANTIZED,
        &["--lora", l, "--dtype", "bf16"],
    );
    let plain = go("plain", GGUF, &[]);
    let (a, b, plain) = (
        tensor(&a, "latents").1,
        tensor(&b, "latents").1,
        tensor(&plain, "latents").1,
    );
    let (apart, moved) = (rel_l2(&a, &b), rel_l2(&b, &plain));
    eprintln!("GGUF + LoRA: {apart:e} from the dequantized weights, the LoRA moved {moved:e}");
    assert!(
        apart < 1e-2 && moved > 10.0 * apart,
        "{apart:e} apart, the LoRA moved {moved:e}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// `ddo resolve` plans a GGUF transformer with its blocks' bytes, and the denoise phase's
/// activations with room for the largest weight dequantized into bf16 (the fixture's
/// timestep and guidance embedders' first linears, `[32, 256]`: 16,384 B) beside what the
/// dequantized file needs.
#[test]
fn resolve_counts_the_blocks_and_the_dequantization_scratch() {
    let plan = |transformer: &str| {
        let folder = fixture("flux_pipeline");
        let t = fixture(transformer);
        json(&ddo(&[
            "resolve",
            "--weights",
            &folder,
            "--transformer",
            &t,
            "--height",
            "32",
            "--width",
            "32",
            "--json",
        ]))
    };
    let (q, f) = (plan(GGUF), plan(DEQUANTIZED));
    let denoise = |v: &serde_json::Value| v["memory_plan"]["phases"][1].clone();
    let (dq, df) = (denoise(&q), denoise(&f));
    assert_eq!(dq["phase"], "denoise");
    assert_eq!(
        dq["activation_bytes"].as_u64().unwrap(),
        df["activation_bytes"].as_u64().unwrap() + 32 * 256 * 2
    );
    let resident = |v: &serde_json::Value| v["resident_bytes"].as_u64().unwrap();
    // The blocks: 64,856 B of the file's 68,352 (its header and padding aside).
    assert!(resident(&dq) < resident(&df) / 4, "{dq} vs {df}");
}

/// `--text-encoder-2 FILE.gguf`: the fixture pipeline's T5 encoder in llama.cpp's names
/// (`tools/gen_gguf_flux.py`), run from a text prompt: dequantized at load (`--dtype f32`) it
/// gives the image of gguf-py's dequantization saved in Transformers' names, bit for bit;
/// kept as blocks (bf16 compute, the embedding table dequantized per call) it stays within
/// a tenth of what the quantization moved.
#[test]
fn a_gguf_t5_encoder_runs_as_its_dequantization_does() {
    let d = scratch("gguf-t5");
    let go = |name: &str, t5: &str, extra: &[&str]| -> Vec<f32> {
        let out = d.join(format!("{name}.safetensors"));
        let folder = fixture("flux_pipeline");
        let mut args = vec![
            "run",
            "--weights",
            &folder,
            "--prompt",
            "a lighthouse at dawn",
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
        ];
        let t5 = (!t5.is_empty()).then(|| fixture(t5));
        if let Some(t) = &t5 {
            args.extend_from_slice(&["--text-encoder-2", t]);
        }
        args.extend_from_slice(extra);
        ok(&ddo(&args));
        tensor(&out, "latents").1
    };
    let gguf = "gguf/flux_pipeline-t5-mixed.gguf";
    let reference = go(
        "dequantized",
        "gguf/flux_pipeline-t5-mixed.dequantized.safetensors",
        &[],
    );
    assert_eq!(go("gguf-f32", gguf, &["--dtype", "f32"]), reference);
    let blocks = go("gguf", gguf, &[]);
    let plain = go("folder", "", &[]);
    let (apart, moved) = (rel_l2(&blocks, &reference), rel_l2(&reference, &plain));
    assert!(moved > 1e-4, "the quantization moved {moved:e}");
    assert!(
        apart < moved / 10.0,
        "{apart:e} from the dequantization (moved {moved:e})"
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn inspect_names_a_gguf_files_types() {
    let gguf = fixture(GGUF);
    let text = ok(&ddo(&["inspect", &gguf]));
    assert!(
        text.contains("GGUF v3, architecture flux, 52 tensors"),
        "{text}"
    );
    for ty in ["F32", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"] {
        assert!(text.contains(&format!("  {ty}")), "{ty}: {text}");
    }
    assert!(text.contains("--transformer FILE"), "{text}");
    let v = json(&ddo(&["inspect", &gguf, "--json"]));
    let types = v["gguf"]["types"].as_array().unwrap();
    let count: u64 = types.iter().map(|t| t["tensors"].as_u64().unwrap()).sum();
    assert_eq!(count, 52);
    let bytes: u64 = types.iter().map(|t| t["bytes"].as_u64().unwrap()).sum();
    assert_eq!(v["gguf"]["bytes"].as_u64().unwrap(), bytes);
    let q8 = types.iter().find(|t| t["type"] == "Q8_0").unwrap();
    // 34 bytes per 32 weights.
    assert_eq!(
        q8["bytes"].as_u64().unwrap() * 32,
        q8["elements"].as_u64().unwrap() * 34
    );
    // A GGUF of another model: inspected, and named as nothing DDO loads.
    let other = ok(&ddo(&["inspect", &fixture("gguf/types.gguf")]));
    assert!(other.contains("loads as: nothing yet"), "{other}");
}

#[test]
fn malformed_or_foreign_gguf_files_are_refused_by_run_and_inspect_alike() {
    let d = scratch("gguf-bad");
    let bytes = std::fs::read(fixture(GGUF)).unwrap();
    // Cut inside the tensor data: the last tensor lies past the end.
    let cut = d.join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() - 100]).unwrap();
    let out = d.join("out.safetensors");
    let o = run(&out, &["--transformer", cut.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let run_err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(run_err.contains("cut.gguf"), "{run_err}");
    assert!(run_err.contains("past the end"), "{run_err}");
    assert!(!out.exists(), "no output after a refusal");
    let i = ddo(&["inspect", cut.to_str().unwrap()]);
    assert_eq!(i.status.code(), Some(1), "{i:?}");
    let inspect_err = String::from_utf8_lossy(&i.stderr).to_string();
    assert!(inspect_err.contains("past the end"), "{inspect_err}");
    // Another architecture's GGUF as the transformer: refused, nothing written.
    let o = run(
        &out,
        &[
            "--transformer",
            &fixture("gguf/types.gguf"),
            "--dtype",
            "f32",
        ],
    );
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("original layout"), "{e}");
    assert!(!out.exists());
    // The GGUF file is never written.
    assert_eq!(std::fs::read(fixture(GGUF)).unwrap(), bytes);
    let _ = std::fs::remove_dir_all(&d);
}

/// `ddo run` of the Qwen-Image fixture pipeline (3 steps, 32x48, true CFG 4) with `extra`,
/// writing `out`; the JSON report.
fn run_qwen(out: &Path, extra: &[&str]) -> serde_json::Value {
    let inputs = fixture("qwen_pipeline/inputs.safetensors");
    let folder = fixture("qwen_pipeline");
    let mut args = vec![
        "run",
        "--weights",
        &folder,
        "--prompt-embeds",
        &inputs,
        "--init-latents",
        &inputs,
        "--steps",
        "3",
        "--height",
        "32",
        "--width",
        "48",
        "--true-cfg-scale",
        "4",
        "--json",
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    json(&ddo(&args))
}

/// Issue 37: a Qwen-Image transformer from one file beside the pipeline folder
/// (`--transformer FILE`): a GGUF in Diffusers' names (`tools/gen_gguf_flux.py`: Q8_0, Q5_0
/// and Q4_1 by gguf-py) dequantized at load gives the image of the safetensors file of
/// gguf-py's dequantization bit for bit (f32 and bf16), and so does that file under
/// ComfyUI's `model.diffusion_model.` prefix; kept as blocks (the default: a fraction of
/// the weight bytes, bf16 compute) it gives one image on every route that takes it, within
/// bf16's rounding of the dequantized weights; a Flux file is refused naming it, as is
/// `--transformer` with `--config`.
#[test]
fn a_qwen_image_gguf_transformer_runs_as_its_dequantization_does() {
    let d = scratch("gguf-qwen");
    let gguf = fixture("gguf/qwen_pipeline-transformer-mixed.gguf");
    let reference = fixture("gguf/qwen_pipeline-transformer-mixed.dequantized.safetensors");
    let sample = |p: &Path| tensor(p, "sample").1;
    for dtype in ["f32", "bf16"] {
        let a = d.join(format!("gguf-{dtype}.safetensors"));
        let b = d.join(format!("ref-{dtype}.safetensors"));
        run_qwen(&a, &["--transformer", &gguf, "--dtype", dtype]);
        run_qwen(&b, &["--transformer", &reference, "--dtype", dtype]);
        assert!(
            sample(&a) == sample(&b),
            "{dtype}: the GGUF dequantized at load differs"
        );
    }
    // The reference under ComfyUI's prefix: the same image.
    let prefixed = d.join("prefixed.safetensors");
    {
        let bytes = std::fs::read(&reference).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
            .tensors()
            .into_iter()
            .map(|(n, v)| (format!("model.diffusion_model.{n}"), v))
            .collect();
        safetensors::serialize_to_file(views, None, &prefixed).unwrap();
    }
    let p = d.join("prefixed-out.safetensors");
    run_qwen(
        &p,
        &[
            "--transformer",
            prefixed.to_str().unwrap(),
            "--dtype",
            "f32",
        ],
    );
    assert!(
        sample(&p) == sample(&d.join("ref-f32.safetensors")),
        "the prefixed file differs"
    );
    // As stored: blocks on every route, bf16 compute, a fraction of the bytes.
    let reference_bytes = weight_bytes(&run_qwen(
        &d.join("ref-stored.safetensors"),
        &["--transformer", &reference],
    ));
    let mut first: Option<Vec<f32>> = None;
    for (name, route) in [
        ("none", "transformer=none"),
        (
            "stream",
            "transformer=diffusers_group_offload:offload_type=leaf_level,use_stream=true",
        ),
        ("native", "transformer=native_vmm:budget=64KiB"),
    ] {
        let out = d.join(format!("blocks-{name}.safetensors"));
        let v = run_qwen(&out, &["--transformer", &gguf, "--route", route]);
        let bytes = weight_bytes(&v);
        assert!(
            bytes * 2 < reference_bytes,
            "{name}: {bytes} B of weights against {reference_bytes} B dequantized"
        );
        let s = sample(&out);
        match &first {
            None => first = Some(s),
            Some(f) => assert!(*f == s, "{name}: the blocks' image differs between routes"),
        }
    }
    // Within bf16's own error: the blocks' image against the dequantized weights in bf16 is
    // no further than bf16 is from f32 on the same weights (both round the small tensors
    // to bf16; the blocks dequantize per linear).
    let bf16 = sample(&d.join("ref-bf16.safetensors"));
    let own = rel_l2(&bf16, &sample(&d.join("ref-f32.safetensors")));
    let e = rel_l2(first.as_ref().unwrap(), &bf16);
    assert!(
        e > 0.0 && e <= 2.0 * own,
        "blocks against bf16: relative L2 {e}; bf16 against f32: {own}"
    );
    // Another architecture, and no folder to take the shapes from: refused by name.
    let flux = fixture(GGUF);
    let out = ddo(&[
        "run",
        "--weights",
        &fixture("qwen_pipeline"),
        "--transformer",
        &flux,
        "--prompt-embeds",
        &fixture("qwen_pipeline/inputs.safetensors"),
        "--out",
        d.join("flux.png").to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("txt_norm.weight") && err.contains("flux_pipeline"),
        "{err}"
    );
    assert!(!d.join("flux.png").exists());
    let out = ddo(&[
        "run",
        "--config",
        "qwen-tiny",
        "--transformer",
        &gguf,
        "--out",
        d.join("c.png").to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--weights"), "{err}");
}

/// Copies the folder `from` into `to`, recursively.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_tree(&e.path(), &dest);
        } else {
            std::fs::copy(e.path(), dest).unwrap();
        }
    }
}

/// Issue 37: Qwen-Image's text encoder from one file beside the pipeline folder
/// (`--text-encoder FILE`): the Qwen2.5-VL GGUF in llama.cpp's names
/// (`tools/gen_gguf_flux.py qwen_text`) dequantized at load into f32 gives the image of the
/// safetensors file of gguf-py's dequantization bit for bit; kept as blocks (the default) it
/// makes an image too; the folder gives the shapes (`text_encoder/config.json`) and the
/// tokenizer; `ddo inspect` names the file as the text encoder; a T5 GGUF is refused naming
/// its architecture, and `--text-encoder` with a named config is refused.
#[test]
fn a_qwen_text_encoder_gguf_runs_as_its_dequantization_does() {
    let d = scratch("gguf-qwen-text");
    let folder = d.join("pipeline");
    copy_tree(Path::new(&fixture("qwen_pipeline")), &folder);
    copy_tree(
        Path::new(&fixture("qwen_text_encoder/tokenizer")),
        &folder.join("tokenizer"),
    );
    std::fs::create_dir_all(folder.join("text_encoder")).unwrap();
    std::fs::copy(
        fixture("qwen_text_encoder/text_encoder/config.json"),
        folder.join("text_encoder/config.json"),
    )
    .unwrap();
    let gguf = fixture("gguf/qwen_text_encoder-mixed.gguf");
    let reference = fixture("gguf/qwen_text_encoder-mixed.dequantized.safetensors");
    let run = |name: &str, file: &str, extra: &[&str]| {
        let out = d.join(format!("{name}.safetensors"));
        let mut args = vec![
            "run",
            "--weights",
            folder.to_str().unwrap(),
            "--text-encoder",
            file,
            "--prompt",
            "a lighthouse at dawn",
            "--negative-prompt",
            " ",
            "--steps",
            "2",
            "--height",
            "32",
            "--width",
            "48",
            "--json",
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let report = json(&ddo(&args));
        (tensor(&out, "sample").1, report)
    };
    let (want, report) = run("ref", &reference, &["--dtype", "f32"]);
    assert!(
        report["model"]
            .as_str()
            .unwrap()
            .contains("text encoder from"),
        "{}",
        report["model"]
    );
    let (got, _) = run("gguf-f32", &gguf, &["--dtype", "f32"]);
    assert!(got == want, "the GGUF dequantized at load differs");
    let (blocks, _) = run("gguf", &gguf, &[]);
    assert!(blocks.iter().all(|v| v.is_finite()));
    assert!(rel_l2(&blocks, &want) < 0.1, "{}", rel_l2(&blocks, &want));
    // inspect names it.
    let text = ok(&ddo(&["inspect", &gguf]));
    assert!(
        text.contains("architecture qwen2vl") && text.contains("Qwen-Image's text encoder"),
        "{text}"
    );
    // T5's GGUF as Qwen's text encoder: refused naming its architecture; no output.
    let t5 = fixture("gguf/flux_pipeline-t5-mixed.gguf");
    let out = d.join("t5.png");
    let o = ddo(&[
        "run",
        "--weights",
        folder.to_str().unwrap(),
        "--text-encoder",
        &t5,
        "--out",
        out.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("t5encoder") && err.contains("--text-encoder"),
        "{err}"
    );
    assert!(!out.exists());
    let o = ddo(&[
        "run",
        "--config",
        "qwen-tiny",
        "--text-encoder",
        &gguf,
        "--out",
        out.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("text_encoder/config.json"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&d);
}
