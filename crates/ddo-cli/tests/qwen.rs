//! The `ddo` binary on Qwen-Image: `run --config qwen-tiny` (true CFG on and off, the
//! phase profile, the VAE row of the seed's table), `resolve` and `bench` on its
//! components, and the options that belong to the other family, each refused in one line
//! with a hint.

mod common;

use common::{ddo, fixture, json, ok, scratch, tensor};

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

/// `ddo run --weights` on the `qwen_pipeline` fixture (a QwenImagePipeline folder without
/// a text encoder, found by its `model_index.json`) from the fixture's given embeddings,
/// masks and noise gives Diffusers' latents and image, with true CFG and without.
#[test]
fn run_weights_reproduces_diffusers_qwen_image_pipeline() {
    let d = scratch("qwen-fixture");
    let inputs = fixture("qwen_pipeline/inputs.safetensors");
    let expected = std::path::PathBuf::from(fixture("qwen_pipeline/outputs.safetensors"));
    for (scale, image_name, latents_name) in [
        ("4", "image", "latents"),
        ("1", "image_no_cfg", "latents_no_cfg"),
    ] {
        let out = d.join(format!("cfg{scale}.safetensors"));
        let v = json(&ddo(&[
            "run",
            "--weights",
            &fixture("qwen_pipeline"),
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
            scale,
            "--out",
            out.to_str().unwrap(),
            "--json",
        ]));
        assert_eq!(v["true_cfg"]["on"], scale == "4", "{v}");
        for (ours, theirs) in [("sample", image_name), ("latents", latents_name)] {
            let (s1, a) = tensor(&out, ours);
            let (s2, b) = tensor(&expected, theirs);
            assert_eq!(s1, s2, "{ours} vs {theirs}");
            let e = rel_l2(&a, &b);
            assert!(e <= 1e-5, "{ours} vs {theirs}: relative L2 {e}");
        }
    }
}

fn err_of(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).to_string()
}

#[test]
fn run_qwen_tiny_writes_an_image_with_and_without_true_cfg() {
    let d = scratch("qwen-run");
    let png = d.join("q.png");
    let base = [
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
    ];
    let mut argv: Vec<&str> = base.to_vec();
    argv.extend(["--out", png.to_str().unwrap()]);
    let off = json(&ddo(&argv));
    let bytes = std::fs::read(&png).expect("PNG written");
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    let phases: Vec<&str> = off["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["phase"].as_str().unwrap())
        .collect();
    assert_eq!(phases, ["prompt_encoding", "denoise", "decode"]);
    assert_eq!(off["true_cfg"]["on"], false, "{off}");
    assert!(off["guidance"].is_null());
    let comps: Vec<&str> = off["components"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["component"].as_str().unwrap())
        .collect();
    assert_eq!(comps, ["text_encoder", "transformer", "vae"]);
    let forwards = |v: &serde_json::Value| {
        v["components"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["component"] == "transformer")
            .unwrap()["metrics"]["counters"]["forwards"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(forwards(&off), 2, "one pass per step without true CFG");

    let png2 = d.join("q2.png");
    let mut argv: Vec<&str> = base.to_vec();
    argv.extend(["--out", png2.to_str().unwrap(), "--negative-prompt", " "]);
    let on = json(&ddo(&argv));
    assert_eq!(on["true_cfg"]["on"], true, "{on}");
    assert_eq!(on["true_cfg"]["scale"], 4.0);
    assert_eq!(forwards(&on), 4, "two passes per step with true CFG");
    assert_ne!(
        std::fs::read(&png2).unwrap(),
        bytes,
        "true CFG changes the image"
    );
}

#[test]
fn the_other_familys_options_are_refused_before_any_work() {
    let d = scratch("qwen-refuse");
    let out_png = d.join("x.png");
    let out = out_png.to_str().unwrap();
    for (argv, needle) in [
        (
            vec!["run", "--config", "qwen-tiny", "--guidance", "3.5"],
            "--true-cfg-scale",
        ),
        (
            vec![
                "run",
                "--config",
                "qwen-tiny",
                "--save-latents",
                "l.safetensors",
            ],
            "--out OUT.safetensors",
        ),
        (
            vec![
                "run",
                "--config",
                "qwen-tiny",
                "--text-encoder-2",
                "t5.safetensors",
            ],
            "one text encoder",
        ),
        (
            vec!["run", "--config", "tiny", "--negative-prompt", " "],
            "--guidance",
        ),
        (
            vec!["run", "--config", "tiny", "--true-cfg-scale", "4"],
            "QwenImagePipeline",
        ),
        (
            vec!["run", "--config", "qwen-tiny", "--true-cfg-scale", "inf"],
            "finite",
        ),
        (vec!["run", "--config", "qwen-small"], "qwen-image"),
    ] {
        let mut a = argv.clone();
        a.extend(["--out", out]);
        let o = ddo(&a);
        let err = err_of(&o);
        assert_eq!(o.status.code(), Some(2), "{argv:?}: {err}");
        assert!(err.contains(needle), "{argv:?}: `{needle}` not in {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(!out_png.exists(), "{argv:?} wrote an output");
    }
}

#[test]
fn resolve_and_bench_know_the_qwen_components() {
    let v = json(&ddo(&[
        "resolve",
        "--config",
        "qwen-tiny",
        "--height",
        "32",
        "--width",
        "32",
        "--json",
    ]));
    let comps: Vec<(&str, &str)> = v["components"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["component"].as_str().unwrap(),
                c["route"].as_str().unwrap(),
            )
        })
        .collect();
    let names: Vec<&str> = comps.iter().map(|c| c.0).collect();
    assert_eq!(names, ["text_encoder", "transformer", "vae"], "{v}");
    // The seed's VAE table: auto resolves to one_shot_fast, whose VAE route is Diffusers'
    // leaf offload without a stream.
    let vae = comps.iter().find(|c| c.0 == "vae").unwrap().1;
    assert!(vae.contains("diffusers_group_offload"), "{v}");

    let d = scratch("qwen-bench");
    let j = d.join("b.json");
    let text = ok(&ddo(&[
        "bench",
        "--config",
        "qwen-tiny",
        "--component",
        "transformer",
        "--route",
        "none",
        "--route",
        "diffusers_group_offload:offload_type=leaf_level,use_stream=true",
        "--height",
        "32",
        "--width",
        "32",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--out-json",
        j.to_str().unwrap(),
    ]));
    assert!(text.contains("transformer"), "{text}");
    let b: serde_json::Value = serde_json::from_slice(&std::fs::read(&j).unwrap()).unwrap();
    let cands = b["candidates"].as_array().unwrap();
    assert_eq!(cands.len(), 2, "{b}");
    assert!(
        cands[1]["streamed_bytes_per_forward"].as_u64().unwrap() > 0,
        "{b}"
    );
    for component in ["text_encoder", "vae"] {
        ok(&ddo(&[
            "bench",
            "--config",
            "qwen-tiny",
            "--component",
            component,
            "--route",
            "none",
            "--height",
            "32",
            "--width",
            "32",
            "--repeats",
            "1",
            "--warmup",
            "0",
        ]));
    }
    let o = ddo(&[
        "bench",
        "--config",
        "qwen-tiny",
        "--component",
        "text_encoder_2",
    ]);
    let err = err_of(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("text_encoder, transformer, vae"),
        "names the components: {err}"
    );
}

/// The fixture's embeddings with the masks stored as `dtype` (values `mask(v)`), the other
/// tensors as they are, plus `extra` f32 tensors; `drop` names tensors left out.
fn embeds_with_masks(
    to: &std::path::Path,
    dtype: safetensors::Dtype,
    mask: impl Fn(f32) -> Vec<u8>,
    extra: &[(&str, Vec<usize>, Vec<f32>)],
    drop: &[&str],
) {
    let src = std::path::PathBuf::from(fixture("qwen_pipeline/inputs.safetensors"));
    let names = [
        "prompt_embeds",
        "prompt_embeds_mask",
        "negative_prompt_embeds",
        "negative_prompt_embeds_mask",
        "latents",
    ];
    let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for n in names.into_iter().filter(|n| !drop.contains(n)) {
        let (shape, values) = tensor(&src, n);
        if n.ends_with("_mask") {
            owned.push((
                n.into(),
                dtype,
                shape,
                values.iter().flat_map(|&v| mask(v)).collect(),
            ));
        } else {
            let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            owned.push((n.into(), safetensors::Dtype::F32, shape, bytes));
        }
    }
    for (n, shape, values) in extra {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        owned.push((n.to_string(), safetensors::Dtype::F32, shape.clone(), bytes));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = owned
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, to).unwrap();
}

/// Issue 34, item 8: the masks `QwenImagePipeline.encode_prompt` returns (int64), and
/// int32, bool and uint8 ones, give the float masks' image bit for bit; a mask value that is
/// neither 0 nor 1, a lone negative mask, Flux's pooled embeddings and a negative of the
/// wrong width are refused, each by its own name.
#[test]
fn integer_and_boolean_masks_are_taken_and_bad_embeddings_files_refused() {
    use safetensors::Dtype;
    let d = scratch("qwen-masks");
    let run = |embeds: &std::path::Path, out: &std::path::Path| {
        ddo(&[
            "run",
            "--weights",
            &fixture("qwen_pipeline"),
            "--prompt-embeds",
            embeds.to_str().unwrap(),
            "--init-latents",
            embeds.to_str().unwrap(),
            "--steps",
            "2",
            "--height",
            "32",
            "--width",
            "48",
            "--out",
            out.to_str().unwrap(),
        ])
    };
    let float = d.join("f32.safetensors");
    embeds_with_masks(&float, Dtype::F32, |v| v.to_le_bytes().to_vec(), &[], &[]);
    let reference = d.join("ref.safetensors");
    ok(&run(&float, &reference));
    let (_, want) = tensor(&reference, "sample");
    let as_int = |v: f32| v as i64;
    type MaskBytes = Box<dyn Fn(f32) -> Vec<u8>>;
    let cases: [(Dtype, MaskBytes); 4] = [
        (
            Dtype::I64,
            Box::new(move |v| as_int(v).to_le_bytes().to_vec()),
        ),
        (Dtype::I32, Box::new(|v| (v as i32).to_le_bytes().to_vec())),
        (Dtype::BOOL, Box::new(|v| vec![v as u8])),
        (Dtype::U8, Box::new(|v| vec![v as u8])),
    ];
    for (dtype, mask) in cases {
        let file = d.join(format!("{dtype:?}.safetensors"));
        embeds_with_masks(&file, dtype, mask, &[], &[]);
        let out = d.join(format!("{dtype:?}-out.safetensors"));
        ok(&run(&file, &out));
        assert_eq!(tensor(&out, "sample").1, want, "{dtype:?}");
    }
    let refusals: [(&str, std::path::PathBuf, &str); 4] = [
        ("two", d.join("two.safetensors"), "is not a mask: value"),
        (
            "lone",
            d.join("lone.safetensors"),
            "without `negative_prompt_embeds`",
        ),
        (
            "pooled",
            d.join("pooled.safetensors"),
            "`pooled_prompt_embeds` is FluxPipeline's",
        ),
        (
            "narrow",
            d.join("narrow.safetensors"),
            "`negative_prompt_embeds` [1, 5, 16]",
        ),
    ];
    embeds_with_masks(
        &refusals[0].1,
        Dtype::I64,
        |v| ((v as i64) * 2).to_le_bytes().to_vec(),
        &[],
        &[],
    );
    embeds_with_masks(
        &refusals[1].1,
        Dtype::I64,
        |v| (v as i64).to_le_bytes().to_vec(),
        &[],
        &["negative_prompt_embeds"],
    );
    embeds_with_masks(
        &refusals[2].1,
        Dtype::I64,
        |v| (v as i64).to_le_bytes().to_vec(),
        &[("pooled_prompt_embeds", vec![1, 8], vec![0.5; 8])],
        &[],
    );
    {
        // A negative of the wrong width: 16 instead of the transformer's 32.
        let file = &refusals[3].1;
        let src = std::path::PathBuf::from(fixture("qwen_pipeline/inputs.safetensors"));
        let (_, neg) = tensor(&src, "negative_prompt_embeds");
        embeds_with_masks(
            file,
            Dtype::F32,
            |v| v.to_le_bytes().to_vec(),
            &[("negative_prompt_embeds", vec![1, 5, 16], neg[..80].to_vec())],
            &["negative_prompt_embeds"],
        );
    }
    for (what, file, words) in &refusals {
        let out = d.join(format!("{what}-out.safetensors"));
        let o = run(file, &out);
        let err = err_of(&o);
        assert!(matches!(o.status.code(), Some(1 | 2)), "{what}: {err}");
        assert!(err.contains(words), "{what}: {err}");
        assert!(!out.exists(), "{what}");
    }
}
