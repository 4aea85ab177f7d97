//! `ddo resolve` refuses what `ddo run` refuses: over a table of route options, `resolve
//! --config tiny` (the memory plan, every route's preflight) exits as `run --config tiny`
//! does with the same error; `resolve` without a model refuses every option a route
//! refuses from the spec alone (`Route::check_options`) or on run's default device
//! whatever the model (a `free-MARGIN` budget that leaves nothing), and accepts only what
//! depends on the weights. A `--route` for a component the model lacks is refused by both.

mod common;

use common::{ddo, scratch};

fn outcome(args: &[&str]) -> (Option<i32>, String) {
    let o = ddo(args);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    // The message after the context both commands add ("attaching routes: ", "planning
    // memory: ").
    let message = ["attaching routes: ", "planning memory: "]
        .iter()
        .find_map(|c| err.trim().rsplit_once(c))
        .map_or(err.trim().to_string(), |(_, m)| m.to_string());
    (o.status.code(), message)
}

#[test]
fn resolve_and_run_accept_and_refuse_the_same_route_options() {
    let d = scratch("agree");
    let out = d.join("x.png");
    // (route, whether the refusal needs the weights)
    let cases = [
        ("vae=none:budget=1KiB", false),
        ("text_encoder=none:use_stream=true", false),
        ("transformer=linear_convolution:use_stream=true", false),
        ("transformer=linear_convolution:budget=1GiB", false),
        ("transformer=diffusers_group_offload:budget=1GiB", false),
        (
            "transformer=diffusers_group_offload:use_stream=false,ring_slots=3",
            false,
        ),
        ("transformer=native_vmm:offload_type=leaf_level", false),
        ("vae=native_vmm", false),
        ("transformer=native_vmm:budget=1KiB", true),
        // Issue 34: run's default device (`--device cpu`) has at most 8 GiB free, so a
        // 9 GiB margin leaves nothing, whatever the model.
        ("transformer=native_vmm:budget=free-9GiB", false),
        (
            "transformer=diffusers_group_offload:use_stream=true,budget=free-9GiB",
            false,
        ),
        // Accepted by all three.
        (
            "transformer=diffusers_group_offload:use_stream=true,budget=1MiB",
            false,
        ),
        ("vae=linear_convolution", false),
    ];
    for (route, needs_weights) in cases {
        let run = outcome(&[
            "run",
            "--config",
            "tiny",
            "--steps",
            "1",
            "--route",
            route,
            "--out",
            out.to_str().unwrap(),
        ]);
        let planned = outcome(&["resolve", "--config", "tiny", "--route", route]);
        assert_eq!(planned, run, "{route}: resolve --config tiny vs run");
        let plain = outcome(&["resolve", "--route", route]);
        if run.0 == Some(0) || needs_weights {
            assert_eq!(plain.0, Some(0), "{route}: {}", plain.1);
        } else {
            assert_eq!(plain.0, run.0, "{route}: {}", plain.1);
            assert!(
                run.1.ends_with(&plain.1) || plain.1.ends_with(&run.1),
                "{route}: resolve said `{}`, run `{}`",
                plain.1,
                run.1
            );
        }
        let _ = std::fs::remove_file(&out);
    }
}

/// Issue 34: a `--route` for a component the model does not have is refused by `resolve`
/// with a model as `run` refuses it (a Qwen-Image pipeline has no `text_encoder_2`; the
/// plan used to drop it silently).
#[test]
fn resolve_and_run_refuse_a_route_for_a_component_the_model_lacks() {
    let d = scratch("agree-components");
    let out = d.join("x.png");
    for (config, route) in [
        ("qwen-tiny", "text_encoder_2=none"),
        ("tiny", "unet=linear_convolution"),
    ] {
        let run = outcome(&[
            "run",
            "--config",
            config,
            "--steps",
            "1",
            "--route",
            route,
            "--out",
            out.to_str().unwrap(),
        ]);
        assert_eq!(
            run.0,
            Some(2),
            "run --config {config} --route {route}: {}",
            run.1
        );
        assert!(run.1.contains("unknown component"), "{}", run.1);
        let planned = outcome(&["resolve", "--config", config, "--route", route]);
        assert_eq!(planned, run, "resolve --config {config} --route {route}");
        assert!(!out.exists());
    }
}
