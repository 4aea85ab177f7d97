//! `ddo resolve --config NAME`'s memory plan (issue 34): made from the config's shapes with
//! weights never written, so FLUX.1-dev plans on a machine that could not hold its random
//! weights, in a moment; its sizes are the stored bytes (`--dtype fp8`: fp8's), the same
//! `ddo run` plans with; and the size is rounded as `run` rounds it.

mod common;

use std::time::{Duration, Instant};

use serde_json::Value;

use common::{ddo, json, ok, scratch};

/// Each component's weight bytes in a `memory_plan`.
fn weight_bytes(plan: &Value) -> Vec<(String, u64)> {
    let mut v: Vec<(String, u64)> = plan["components"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["component"].as_str().unwrap().to_string(),
                c["footprint"]["weight_bytes"].as_u64().unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

fn transformer_bytes(plan: &Value) -> u64 {
    weight_bytes(plan)
        .into_iter()
        .find(|(c, _)| c == "transformer")
        .unwrap()
        .1
}

#[test]
fn flux_dev_is_planned_from_its_shapes_without_its_weights() {
    let plan = |dtype: &[&str]| {
        let started = Instant::now();
        let args = [
            &[
                "resolve",
                "--config",
                "flux-dev",
                "--vram-budget",
                "12GiB",
                "--json",
            ][..],
            dtype,
        ]
        .concat();
        let v = json(&ddo(&args));
        // Building 33 GB of random weights takes minutes (where the host holds them at
        // all: `run` refuses them on a machine under ~32 GiB); the shapes take a moment.
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{:?}",
            started.elapsed()
        );
        v["memory_plan"].clone()
    };
    let bf16 = plan(&[]);
    // FLUX.1-dev's transformer: 11,901,408,320 params of two bytes.
    assert_eq!(transformer_bytes(&bf16), 23_802_816_640);
    // Under fp8 storage the cast layers take one byte (the modulations, norms and proj_out
    // stay bf16, as Diffusers' layerwise casting leaves them): about two thirds.
    let fp8 = transformer_bytes(&plan(&["--dtype", "fp8"]));
    assert!(
        fp8 * 10 < 23_802_816_640 * 7 && fp8 * 2 > 23_802_816_640,
        "{fp8}"
    );
}

#[test]
fn resolve_plans_the_bytes_run_plans_with() {
    let d = scratch("resolve-plan-bytes");
    let out = d.join("x.png");
    for dtype in ["f32", "bf16", "fp8"] {
        let planned = json(&ddo(&[
            "resolve", "--config", "tiny", "--dtype", dtype, "--json",
        ]));
        let ran = json(&ddo(&[
            "run",
            "--config",
            "tiny",
            "--steps",
            "1",
            "--dtype",
            dtype,
            "--json",
            "--out",
            out.to_str().unwrap(),
        ]));
        assert_eq!(
            weight_bytes(&planned["memory_plan"]),
            weight_bytes(&ran["memory_plan"]),
            "{dtype}"
        );
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn resolve_rounds_the_size_as_run_does_and_says_so() {
    let text = ok(&ddo(&["resolve", "--config", "tiny", "--height", "7"]));
    assert!(text.starts_with("128x4 px\n"), "{text}");
    assert!(
        text.contains(
            "  note: 128x7 rounded down to 128x4: height and width must be multiples of 4"
        ),
        "{text}"
    );
}
