//! `ddo resolve` refuses what `ddo run` refuses: over a table of route options, `resolve
//! --config tiny` (the memory plan, every route's preflight) exits as `run --config tiny`
//! does with the same error; `resolve` without a model refuses every option a route
//! refuses from the spec alone (`Route::check_options`), and accepts only what depends on
//! the weights.

mod common;

use common::{ddo, scratch};

fn outcome(args: &[&str]) -> (Option<i32>, String) {
    let o = ddo(args);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    // The message after the context both commands add ("attaching routes: ").
    let message = err
        .trim()
        .rsplit_once("attaching routes: ")
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
