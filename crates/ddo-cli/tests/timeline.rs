//! `ddo run --timeline`: the planned streamed routes record their first and last forward,
//! and nothing else about the run changes.

mod common;

use common::{ddo, json, scratch};

fn run(out: &std::path::Path, timeline: bool) -> serde_json::Value {
    let out = out.to_str().unwrap();
    let mut args = vec![
        "run",
        "--config",
        "tiny",
        "--height",
        "32",
        "--width",
        "32",
        "--steps",
        "2",
        "--vram-budget",
        "600KiB",
        "--json",
        "--out",
        out,
    ];
    if timeline {
        args.push("--timeline");
    }
    json(&ddo(&args))
}

fn component<'a>(v: &'a serde_json::Value, key: &str, name: &str) -> &'a serde_json::Value {
    v[key]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["component"] == name)
        .unwrap_or_else(|| panic!("no {name} in {key}: {v}"))
}

#[test]
fn timeline_records_the_planned_streamed_routes_and_changes_no_output() {
    let dir = scratch("timeline");
    let with = run(&dir.join("with.png"), true);
    let without = run(&dir.join("without.png"), false);
    // The transformer streams under this budget: its planned route records both
    // forwards' timelines, one entry per streamed unit, each with the host's time.
    let route = component(&with["memory_plan"], "components", "transformer")["route"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        route.contains("use_stream=true") && route.ends_with("timeline=true"),
        "{route}"
    );
    let metrics = &component(&with, "components", "transformer")["metrics"];
    for key in ["first_timeline", "timeline"] {
        let units = metrics[key]["units"]
            .as_array()
            .unwrap_or_else(|| panic!("{key}: {metrics}"));
        assert!(!units.is_empty(), "{key}");
        assert!(units.iter().all(|u| u["host_enter_ns"].is_u64()), "{key}");
    }
    // Routes that do not stream through the engine are left as planned, and the plan is
    // otherwise the same.
    let plain = |v: &serde_json::Value| {
        let mut c = v["memory_plan"]["components"].clone();
        for x in c.as_array_mut().unwrap() {
            let r = x["route"].as_str().unwrap().replace(" timeline=true", "");
            x["route"] = r.into();
        }
        c
    };
    assert_eq!(plain(&with), plain(&without));
    let vae = component(&with["memory_plan"], "components", "vae")["route"]
        .as_str()
        .unwrap();
    assert!(!vae.contains("timeline"), "{vae}");
    assert!(component(&without, "components", "transformer")["metrics"]["timeline"].is_null());
    // The same image, byte for byte.
    assert_eq!(
        std::fs::read(dir.join("with.png")).unwrap(),
        std::fs::read(dir.join("without.png")).unwrap()
    );
}
