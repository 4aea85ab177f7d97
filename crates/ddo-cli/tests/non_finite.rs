//! Issue 34 item 5 through the binary: weights holding a NaN, an Inf or 3e38 (in the
//! transformer, the VAE, CLIP or T5; an fp8 NaN byte) make `ddo run` exit 1 naming the phase
//! and step, with no output written (they used to give an all-black image and exit 0);
//! `ddo inspect --check-values` names the first bad tensor and its file (an fp8 NaN byte and
//! a 1e38 fp8 scale included) and says "all finite" otherwise; degenerate scheduler and VAE
//! config numbers are refused at load, naming the file and the field. Each case runs on a
//! copy of a fixture, with one value changed.

mod common;

use std::path::{Path, PathBuf};

use common::{ddo, fixture, ok, scratch};
use ddo_core::DType;

/// Copies folder `src` into `dst`, recursively.
fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for entry in std::fs::read_dir(src).unwrap() {
        let entry = entry.unwrap();
        let to = dst.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &to);
        } else {
            std::fs::copy(entry.path(), &to).unwrap();
        }
    }
}

/// A copy of fixture folder `name` in the scratch folder `dir`.
fn copy_fixture(dir: &Path, name: &str) -> PathBuf {
    let to = dir.join(name);
    copy_dir(Path::new(&fixture(name)), &to);
    to
}

/// The header of a safetensors file and where its data starts.
fn header(bytes: &[u8]) -> (serde_json::Map<String, serde_json::Value>, usize) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (serde_json::from_slice(&bytes[8..8 + n]).unwrap(), 8 + n)
}

/// Overwrites element `index` of tensor `name` in `file` with the raw `element` bytes.
fn set_element(file: &Path, name: &str, index: usize, element: &[u8]) {
    let mut bytes = std::fs::read(file).unwrap();
    let (h, data) = header(&bytes);
    let start = h[name]["data_offsets"][0].as_u64().unwrap() as usize;
    let at = data + start + index * element.len();
    bytes[at..at + element.len()].copy_from_slice(element);
    std::fs::write(file, bytes).unwrap();
}

/// Rewrites `file` with tensor `name` (f32) stored as `F8_E4M3`, its element `index` the
/// NaN byte 0x7f: a checkpoint with one fp8 linear weight.
fn to_fp8_with_nan(file: &Path, name: &str, index: usize) {
    let bytes = std::fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (n, view) in st.tensors() {
        if n == name {
            let values = DType::F32.decode_f32(view.data()).unwrap();
            let mut codes = DType::F8E4M3.encode_f32(&values).unwrap();
            codes[index] = 0x7f;
            owned.push((n, safetensors::Dtype::F8_E4M3, view.shape().to_vec(), codes));
        } else {
            owned.push((n, view.dtype(), view.shape().to_vec(), view.data().to_vec()));
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = owned
        .iter()
        .map(|(n, d, s, b)| {
            let v = safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap();
            (n.clone(), v)
        })
        .collect();
    std::fs::write(file, safetensors::tensor::serialize(views, None).unwrap()).unwrap();
}

/// The one weights file of component folder `dir`.
fn weights_file(dir: &Path) -> PathBuf {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .unwrap()
}

/// Runs the tiny pipeline on `weights` writing into `out_dir`; returns the exit status and
/// stderr, after checking that nothing was written.
fn run_pipeline(weights: &Path, out_dir: &Path) -> (Option<i32>, String) {
    run_pipeline_with(weights, out_dir, &[])
}

/// [`run_pipeline`] with `extra` options.
fn run_pipeline_with(weights: &Path, out_dir: &Path, extra: &[&str]) -> (Option<i32>, String) {
    std::fs::create_dir_all(out_dir).unwrap();
    let out = out_dir.join("x.png");
    let latents = out_dir.join("latents.safetensors");
    let mut args = vec![
        "run",
        "--weights",
        weights.to_str().unwrap(),
        "--height",
        "32",
        "--width",
        "24",
        "--steps",
        "2",
        "--out",
        out.to_str().unwrap(),
        "--save-latents",
        latents.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let o = ddo(&args);
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    let left: Vec<_> = std::fs::read_dir(out_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(
        left.is_empty(),
        "written after a failure: {left:?}\n{stderr}"
    );
    (o.status.code(), stderr)
}

fn f32_element(v: f32) -> Vec<u8> {
    v.to_le_bytes().to_vec()
}

/// One NaN, Inf or 3e38 in a transformer, VAE, CLIP or T5 weight: exit 1, an error naming
/// the phase (and the step in denoise) and `ddo inspect --check-values`, no output file.
#[test]
fn bad_weights_stop_the_run_naming_the_phase_and_write_nothing() {
    let d = scratch("nonfinite-run");
    let cases: [(&str, &str, f32, &str); 7] = [
        (
            "transformer",
            "x_embedder.weight",
            f32::NAN,
            "denoise step 1 of 2",
        ),
        (
            "transformer",
            "x_embedder.weight",
            f32::INFINITY,
            "denoise step 1 of 2",
        ),
        (
            "transformer",
            "proj_out.weight",
            3e38,
            "denoise step 1 of 2",
        ),
        (
            "vae",
            "decoder.conv_out.weight",
            f32::NAN,
            "the decoded image after decode",
        ),
        (
            "vae",
            "decoder.conv_in.weight",
            3e38,
            "the decoded image after decode",
        ),
        (
            "text_encoder_2",
            "encoder.block.0.layer.0.SelfAttention.q.weight",
            f32::NAN,
            "T5 prompt embeddings (text_encoder_2) after prompt encoding",
        ),
        (
            "text_encoder",
            "encoder.layers.0.self_attn.q_proj.weight",
            f32::NAN,
            "CLIP pooled embeddings (text_encoder) after prompt encoding",
        ),
    ];
    for (i, (component, tensor, value, says)) in cases.into_iter().enumerate() {
        let case = d.join(format!("case{i}"));
        let weights = copy_fixture(&case, "flux_pipeline");
        set_element(
            &weights_file(&weights.join(component)),
            tensor,
            0,
            &f32_element(value),
        );
        let (code, stderr) = run_pipeline(&weights, &case.join("out"));
        let what = format!("{component} {tensor} = {value}");
        assert_eq!(code, Some(1), "{what}: {stderr}");
        assert!(stderr.contains("NaN/Inf value(s)"), "{what}: {stderr}");
        assert!(stderr.contains(says), "{what}: {stderr}");
        assert!(
            stderr.contains("ddo inspect --check-values"),
            "{what}: {stderr}"
        );
        assert_eq!(stderr.trim_end().lines().count(), 1, "{what}: {stderr}");
    }
    // The unchanged copy still runs and writes its image.
    let clean = copy_fixture(&d.join("clean"), "flux_pipeline");
    let out = d.join("clean-out/x.png");
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    ok(&ddo(&[
        "run",
        "--weights",
        clean.to_str().unwrap(),
        "--height",
        "32",
        "--width",
        "24",
        "--steps",
        "2",
        "--out",
        out.to_str().unwrap(),
    ]));
    assert!(out.is_file());
}

/// An fp8 weight whose bytes hold e4m3's NaN (0x7f) stops the run at the first denoise step
/// and is named by `ddo inspect --check-values`.
#[test]
fn an_fp8_nan_byte_stops_the_run_and_inspect_names_it() {
    let d = scratch("nonfinite-fp8");
    let weights = copy_fixture(&d, "flux_pipeline");
    let file = weights_file(&weights.join("transformer"));
    to_fp8_with_nan(&file, "context_embedder.weight", 5);
    let (code, stderr) = run_pipeline(&weights, &d.join("out"));
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stderr.contains("denoise step 1 of 2"), "{stderr}");
    let o = ddo(&["inspect", file.to_str().unwrap(), "--check-values"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("`context_embedder.weight`") && stderr.contains("element 5 is NaN"),
        "{stderr}"
    );
}

/// `ddo inspect --check-values`: a clean pipeline is "all finite" (exit 0); one NaN is named
/// with its tensor, component, file and element (exit 1), in text and in JSON; an fp8
/// fixture with a NaN byte and an fp8 scale of 1e38 are named too.
#[test]
fn inspect_check_values_names_the_first_bad_tensor() {
    let d = scratch("nonfinite-inspect");
    let out = ddo(&["inspect", &fixture("flux_pipeline"), "--check-values"]);
    let text = ok(&out);
    assert!(
        text.contains("values: 243 tensors checked, all finite"),
        "{text}"
    );
    let plain = ok(&ddo(&["inspect", &fixture("flux_pipeline")]));
    assert!(!plain.contains("values:"), "read only with --check-values");

    let weights = copy_fixture(&d, "flux_pipeline");
    let t5 = weights_file(&weights.join("text_encoder_2"));
    let tensor = "encoder.block.1.layer.0.SelfAttention.q.weight";
    set_element(&t5, tensor, 3, &f32_element(f32::NAN));
    let o = ddo(&["inspect", weights.to_str().unwrap(), "--check-values"]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    for says in [
        format!("`{tensor}`"),
        "(text_encoder_2)".to_string(),
        t5.display().to_string(),
        "element 3 is NaN".to_string(),
    ] {
        assert!(stderr.contains(&says), "{says}: {stderr}");
    }
    assert!(
        stdout.contains("values: 243 tensors checked, 1 with NaN/Inf"),
        "{stdout}"
    );
    let o = ddo(&[
        "inspect",
        weights.to_str().unwrap(),
        "--check-values",
        "--json",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let values = &v["values"];
    assert_eq!(values["all_finite"], false);
    assert_eq!(values["tensors_checked"], 243);
    assert_eq!(values["bad"][0]["tensor"], tensor);
    assert_eq!(values["bad"][0]["first_bad_element"], 3);
    assert_eq!(values["bad"][0]["non_finite"], 1);

    // fp8: e4m3's NaN byte in a stored fp8 weight.
    let fp8 = copy_fixture(&d, "flux_transformer_fp8");
    let file = weights_file(&fp8);
    set_element(&file, "context_embedder.weight", 7, &[0xff]);
    let o = ddo(&["inspect", fp8.to_str().unwrap(), "--check-values"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("`context_embedder.weight`") && stderr.contains("element 7 is NaN"),
        "{stderr}"
    );
    // A per-tensor scale of 1e38 beside an fp8 weight.
    let scaled = copy_fixture(&d, "flux_transformer_fp8_scaled");
    let file = weights_file(&scaled);
    set_element(
        &file,
        "context_embedder.scale_weight",
        0,
        &f32_element(1e38),
    );
    let o = ddo(&["inspect", file.to_str().unwrap(), "--check-values"]);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("`context_embedder.scale_weight`") && stderr.contains("fp8 scale"),
        "{stderr}"
    );
    // The fixtures themselves are clean.
    for name in ["flux_transformer_fp8", "flux_transformer_fp8_scaled"] {
        let text = ok(&ddo(&["inspect", &fixture(name), "--check-values"]));
        assert!(text.contains("all finite"), "{name}: {text}");
    }
}

/// The config numbers are refused when `ddo run` loads the folder (exit 1, the
/// file and the field named), before anything runs or is written.
#[test]
fn degenerate_config_numbers_are_refused_at_load() {
    let d = scratch("nonfinite-configs");
    let cases = [
        ("scheduler/scheduler_config.json", "shift", "1e-38"),
        ("scheduler/scheduler_config.json", "max_shift", "1e30"),
        ("vae/config.json", "scaling_factor", "1e-45"),
        ("vae/config.json", "shift_factor", "3e38"),
    ];
    for (i, (file, field, value)) in cases.into_iter().enumerate() {
        let case = d.join(format!("case{i}"));
        let weights = copy_fixture(&case, "flux_pipeline");
        let path = weights.join(file);
        let mut json: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        json.insert(field.into(), serde_json::from_str(value).unwrap());
        std::fs::write(&path, serde_json::Value::Object(json).to_string()).unwrap();
        let (code, stderr) = run_pipeline(&weights, &case.join("out"));
        let what = format!("{file} {field} = {value}");
        assert_eq!(code, Some(1), "{what}: {stderr}");
        assert!(
            stderr.contains(&format!("{}: {field}", path.display())),
            "{what}: {stderr}"
        );
        assert!(stderr.contains("must be a number in"), "{what}: {stderr}");
    }
}

/// `ddo decode` on a VAE with a NaN weight exits 1 naming the decoded image (it wrote an
/// all-black PNG and exited 0), writing nothing; the unchanged copy decodes.
#[test]
fn decode_with_a_nan_vae_weight_is_refused_and_writes_nothing() {
    let d = scratch("nonfinite-decode");
    let latents = d.join("z.safetensors");
    let data = vec![0u8; 4 * 8 * 8 * 4];
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1, 4, 8, 8], &data)
            .unwrap();
    safetensors::serialize_to_file([("latents".to_string(), view)], None, &latents).unwrap();
    let clean = copy_fixture(&d.join("clean"), "vae_sd");
    let bad = copy_fixture(&d.join("bad"), "vae_sd");
    set_element(
        &bad.join("diffusion_pytorch_model.safetensors"),
        "decoder.conv_out.weight",
        0,
        &f32_element(f32::NAN),
    );
    let decode = |weights: &Path, out: &Path| {
        ddo(&[
            "decode",
            "--weights",
            weights.to_str().unwrap(),
            "--latents",
            latents.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ])
    };
    let out = d.join("bad.png");
    let o = decode(&bad, &out);
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("NaN/Inf value(s)"), "{stderr}");
    assert!(stderr.contains("the decoded image"), "{stderr}");
    assert!(!out.exists(), "nothing written: {stderr}");
    let out = d.join("clean.png");
    ok(&decode(&clean, &out));
    assert!(out.is_file());
}

/// `--compute fp8`: a NaN in a weight kept in bf16 (`norm1.linear`, an adaLN modulation)
/// reaches the next fp8 linear's input, which has no fp8 scale: exit 1 naming that layer,
/// no output written.
#[test]
fn a_non_finite_activation_under_fp8_compute_names_the_layer() {
    let d = scratch("nonfinite-fp8-compute");
    let weights = copy_fixture(&d, "flux_pipeline");
    set_element(
        &weights_file(&weights.join("transformer")),
        "transformer_blocks.0.norm1.linear.weight",
        0,
        &f32_element(f32::NAN),
    );
    // Nothing written is checked by the helper.
    let (code, stderr) = run_pipeline_with(&weights, &d.join("out"), &["--compute", "fp8"]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("the input of `transformer.transformer_blocks.0."),
        "{stderr}"
    );
    assert!(stderr.contains("no fp8 scale"), "{stderr}");
    assert!(stderr.contains("--compute bf16"), "{stderr}");
}
