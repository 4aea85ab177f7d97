//! Batches end to end: `ddo run` with two prompts' embeddings and with `--num-images 2`, and
//! `ddo decode` of `[2, C, h, w]` latents, against Diffusers' batch-2 references
//! (`fixtures/flux_pipeline/batch2.safetensors`, see `batch2.md` there); one PNG per image,
//! named `STEM-i.png`; wrong batch sizes refused before anything is written.

mod common;

use common::{ddo, fixture, json, max_abs, ok, repo, scratch, tensor};
use ddo_cli::io::{HostTensor, encode_safetensors};

fn batch2() -> String {
    fixture("flux_pipeline/batch2.safetensors")
}

fn reference(name: &str) -> (Vec<usize>, Vec<f32>) {
    tensor(
        &repo().join("fixtures/flux_pipeline/batch2.safetensors"),
        name,
    )
}

/// Diffusers' `postprocess(output_type="pt")`: `(x / 2 + 0.5)` clamped to [0, 1].
fn to_pt(image: &[f32]) -> Vec<f32> {
    image
        .iter()
        .map(|x| (x / 2.0 + 0.5).clamp(0.0, 1.0))
        .collect()
}

const SIZE: [&str; 8] = [
    "--height",
    "32",
    "--width",
    "24",
    "--steps",
    "4",
    "--tiled-decode",
    "off",
];

#[test]
fn two_prompts_give_two_images_that_match_diffusers() {
    let d = scratch("batch-embeds");
    let out = d.join("pair.safetensors");
    let saved = d.join("latents.safetensors");
    let (weights, batch) = (fixture("flux_pipeline"), batch2());
    let mut args = vec![
        "run",
        "--weights",
        &weights,
        "--prompt-embeds",
        &batch,
        "--init-latents",
        &batch,
        "--out",
        out.to_str().unwrap(),
        "--save-latents",
        saved.to_str().unwrap(),
        "--json",
    ];
    args.extend(SIZE);
    let v = json(&ddo(&args));
    assert_eq!(v["images"], 2);
    let (shape, sample) = tensor(&out, "sample");
    assert_eq!(shape, [2, 3, 32, 24]);
    let (_, want) = reference("embeds_image_pt");
    let err = max_abs(&to_pt(&sample), &want);
    let (_, latents) = tensor(&out, "latents");
    let err_latents = max_abs(&latents, &reference("embeds_latents").1);
    assert!(
        err <= 1e-4 && err_latents <= 1e-4,
        "{err:e} {err_latents:e}"
    );

    // The saved decoder input holds both images; `ddo decode` gives the same two images,
    // as one PNG each.
    let (lshape, _) = tensor(&saved, "latents");
    assert_eq!(lshape, [2, 4, 16, 12]);
    let decoded = d.join("again.safetensors");
    ok(&ddo(&[
        "decode",
        "--weights",
        &fixture("flux_pipeline"),
        "--latents",
        saved.to_str().unwrap(),
        "--out",
        decoded.to_str().unwrap(),
    ]));
    assert!(max_abs(&tensor(&decoded, "sample").1, &sample) <= 1e-6);
    let png = d.join("img.png");
    let text = ok(&ddo(&[
        "decode",
        "--weights",
        &fixture("flux_pipeline"),
        "--latents",
        saved.to_str().unwrap(),
        "--out",
        png.to_str().unwrap(),
    ]));
    for i in 0..2 {
        let p = d.join(format!("img-{i}.png"));
        assert_eq!(&std::fs::read(&p).unwrap()[..4], b"\x89PNG", "{text}");
        assert!(text.contains(p.to_str().unwrap()), "{text}");
    }
    assert!(!png.exists(), "no un-numbered file for a batch");
}

#[test]
fn num_images_repeats_a_text_prompt_as_diffusers_does() {
    let d = scratch("batch-text");
    let out = d.join("cats.png");
    let prompt: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("fixtures/flux_pipeline/prompt.json")).unwrap(),
    )
    .unwrap();
    let weights = fixture("flux_pipeline");
    let latents_file = d.join("latents.safetensors");
    let seq = prompt["max_sequence_length"].to_string();
    let batch = batch2();
    let mut args = vec![
        "run",
        "--weights",
        &weights,
        "--prompt",
        prompt["prompt"].as_str().unwrap(),
        "--max-sequence-length",
        &seq,
        "--num-images",
        "2",
        "--init-latents",
        &batch,
        "--out",
        out.to_str().unwrap(),
        "--save-latents",
        latents_file.to_str().unwrap(),
    ];
    args.extend(SIZE);
    let text = ok(&ddo(&args));
    assert!(text.contains("2 images"), "{text}");
    for i in 0..2 {
        assert!(d.join(format!("cats-{i}.png")).is_file(), "{text}");
    }
    assert!(!out.exists());
    // The saved latents are the reference's, unpacked and unscaled as `ddo decode` takes
    // them: decoding them reproduces Diffusers' images.
    let decoded = d.join("images.safetensors");
    ok(&ddo(&[
        "decode",
        "--weights",
        &weights,
        "--latents",
        latents_file.to_str().unwrap(),
        "--out",
        decoded.to_str().unwrap(),
    ]));
    let err = max_abs(
        &to_pt(&tensor(&decoded, "sample").1),
        &reference("text_image_pt").1,
    );
    assert!(err <= 1e-4, "text, 2 images: {err:e}");
}

#[test]
fn decode_of_a_batch_matches_diffusers() {
    let d = scratch("batch-decode");
    let (shape, values) = reference("vae_latents");
    let latents = d.join("z.safetensors");
    std::fs::write(
        &latents,
        encode_safetensors(&[("latents", &HostTensor { shape, values })]).unwrap(),
    )
    .unwrap();
    let out = d.join("x.safetensors");
    let v = json(&ddo(&[
        "decode",
        "--weights",
        &fixture("flux_pipeline/vae"),
        "--latents",
        latents.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--json",
    ]));
    assert_eq!(v["image_shape"], serde_json::json!([2, 3, 32, 24]));
    let err = max_abs(&tensor(&out, "sample").1, &reference("vae_sample").1);
    assert!(err <= 1e-4, "batch-2 decode: {err:e}");
}

#[test]
fn noise_for_another_number_of_images_is_refused_and_nothing_is_written() {
    let d = scratch("batch-wrong");
    let out = d.join("x.png");
    let weights = fixture("flux_pipeline");
    let batch = batch2();
    let inputs = fixture("flux_pipeline/inputs.safetensors");
    // Two noises for one image, and one noise for three images.
    for (init, images) in [(&batch, "1"), (&inputs, "3")] {
        let mut args = vec![
            "run",
            "--weights",
            &weights,
            "--prompt-embeds",
            &inputs,
            "--init-latents",
            init,
            "--num-images",
            images,
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend(SIZE);
        let o = ddo(&args);
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains("one row per image"), "{err}");
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 0, "{err}");
    }
    let o = ddo(&["run", "--config", "tiny", "--num-images", "0"]);
    assert_eq!(o.status.code(), Some(2));
    let o = ddo(&[
        "run",
        "--config",
        "tiny",
        "--num-images",
        "18446744073709551615",
        "--out",
        out.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--seed"), "{err}");
    assert_eq!(std::fs::read_dir(&d).unwrap().count(), 0);
}
