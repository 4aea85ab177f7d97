//! `--compute fp8` (issue 39) through the binary on the fixture pipeline, on the host
//! backend (the reference implementation): the linears with E4M3 weights run in fp8 (the
//! latents differ from fp8 weights computed in bf16), the error against the f32 run stays
//! near that of fp8 storage alone, the run says what it did, and bad combinations are
//! refused.

mod common;

use common::{ddo, fixture, ok, rel_l2, scratch};

/// `ddo run` on the fixture pipeline with `extra`; its latents and stdout.
fn latents(dir: &std::path::Path, name: &str, extra: &[&str]) -> (Vec<f32>, String) {
    let out = dir.join(format!("{name}.png"));
    let latents = dir.join(format!("{name}.safetensors"));
    let weights = fixture("flux_pipeline");
    let mut args = vec![
        "run",
        "--weights",
        &weights,
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
    let stdout = ok(&ddo(&args));
    (common::tensor(&latents, "latents").1, stdout)
}

#[test]
fn fp8_compute_runs_its_linears_in_fp8_near_fp8_storages_error() {
    let d = scratch("compute-fp8");
    let (reference, _) = latents(&d, "f32", &[]);
    let (stored, plain) = latents(&d, "fp8-weights", &["--dtype", "fp8"]);
    let (computed, said) = latents(&d, "fp8-compute", &["--compute", "fp8"]);
    assert!(!plain.contains("--compute fp8"), "{plain}");
    assert!(
        said.contains("--compute fp8: the linears with E4M3 weights run in fp8 (")
            && said.contains("transformer "),
        "{said}"
    );
    assert!(
        said.contains("reference implementation runs (this backend has no fp8 tensor cores)"),
        "{said}"
    );
    assert!(computed.iter().all(|v| v.is_finite()));
    // The activations were quantized: not the bytes of fp8 weights computed in bf16.
    assert_ne!(stored, computed);
    let (e_stored, e_computed) = (rel_l2(&stored, &reference), rel_l2(&computed, &reference));
    eprintln!(
        "latents against f32: fp8 weights in bf16 {e_stored:.5}, --compute fp8 {e_computed:.5}"
    );
    assert!(
        e_computed <= 1.2 * e_stored,
        "--compute fp8 {e_computed} against fp8 storage's {e_stored}"
    );
    // Explicit E4M3 weights give the same bytes as the conversion --compute fp8 makes.
    let (explicit, _) = latents(&d, "fp8-both", &["--compute", "fp8", "--dtype", "fp8_e4m3"]);
    assert_eq!(explicit, computed);
}

#[test]
fn fp8_compute_refuses_e5m2_weights_and_unknown_names() {
    let weights = fixture("flux_pipeline");
    for (extra, says) in [
        (
            &["--compute", "fp8", "--dtype", "fp8_e5m2"][..],
            "--compute fp8 takes E4M3 weights",
        ),
        (&["--compute", "int8"][..], "invalid --compute `int8`"),
    ] {
        let mut args = vec!["run", "--weights", &weights, "--steps", "1"];
        args.extend_from_slice(extra);
        let o = ddo(&args);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {stderr}");
        assert!(stderr.contains(says), "{extra:?}: {stderr}");
        assert!(
            stderr.contains("--compute bf16") || stderr.contains("--dtype fp8"),
            "{stderr}"
        );
    }
}

#[test]
fn bench_says_which_compute_ran() {
    let bench = |extra: &[&str]| {
        let mut args = vec![
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
            "--json",
        ];
        args.extend_from_slice(extra);
        common::json(&ddo(&args))
    };
    let fp8 = bench(&["--compute", "fp8"]);
    assert_eq!(fp8["compute"], "fp8");
    // The host backend runs the reference implementation.
    assert_eq!(fp8["fp8_tensor_cores"], false);
    assert_eq!(
        fp8["fp8_reference_reason"],
        "this backend has no fp8 tensor cores"
    );
    assert!(fp8["compute_floor"]["seconds"].as_f64().unwrap() > 0.0);
    // The same E4M3 weights computed in bf16.
    let bf16 = bench(&["--dtype", "fp8"]);
    assert_eq!(bf16["compute"], "bf16");
    assert!(bf16["fp8_tensor_cores"].is_null());
    assert!(bf16["fp8_reference_reason"].is_null());
    // Not the same forward: the fp8 one quantized its activations.
    assert_ne!(
        fp8["candidates"][0]["output_fnv1a"],
        bf16["candidates"][0]["output_fnv1a"]
    );
}

/// `ddo serve --compute fp8`: /health says so, and a request's image is `ddo run
/// --compute fp8`'s with the same options.
#[test]
fn serve_takes_compute_fp8_as_run_does() {
    use common::server::Server;
    let weights = fixture("flux_pipeline");
    let server = Server::start(&["--weights", &weights, "--compute", "fp8"]);
    let (status, h) = server.json("GET", "/health", "");
    assert_eq!((status, h["compute"].as_str()), (200, Some("fp8")), "{h}");
    let body = r#"{"prompt": "a lighthouse", "height": 32, "width": 24, "steps": 2, "seed": 7}"#;
    let (status, v) = server.json("POST", "/v1/generate", body);
    assert_eq!(status, 200, "{v}");
    use base64::Engine;
    let png = base64::engine::general_purpose::STANDARD
        .decode(v["images"][0]["b64_png"].as_str().unwrap())
        .unwrap();
    let d = scratch("compute-fp8-serve");
    let out = d.join("run.png");
    ok(&ddo(&[
        "run",
        "--weights",
        &weights,
        "--compute",
        "fp8",
        "--prompt",
        "a lighthouse",
        "--height",
        "32",
        "--width",
        "24",
        "--steps",
        "2",
        "--seed",
        "7",
        "--out",
        out.to_str().unwrap(),
    ]));
    assert_eq!(std::fs::read(&out).unwrap(), png);
}
