//! A component is resolved once per run, and one "decided by" label goes from `ddo resolve`
//! to the metrics: for the same component, `ddo resolve --json` (without a model, and with
//! one: the memory plan), `ddo run --json`'s `source.route`, its memory plan's `decided_by`,
//! its metrics' `decided_by`, and the "decided by" column of `ddo run`'s text table all say
//! the same thing (ARCHITECTURE.md's invariant).

mod common;

use common::{ddo_with_env, json, ok, scratch};
use serde_json::Value;

/// The transformer's route given explicitly, the first text encoder's by the environment,
/// the second text encoder's by the memory plan, the VAE's by the preset table.
const ROUTE: &str = "transformer=diffusers_group_offload:use_stream=true";
const ENV: [(&str, &str); 1] = [("DDO_TEXT_ENCODER_ROUTE", "none")];
const COMPONENTS: [&str; 4] = ["text_encoder", "text_encoder_2", "transformer", "vae"];

fn by_component<'a>(list: &'a Value, name: &str) -> &'a Value {
    list.as_array()
        .unwrap_or_else(|| panic!("not a list: {list}"))
        .iter()
        .find(|c| c["component"] == name)
        .unwrap_or_else(|| panic!("no {name} in {list}"))
}

fn label(v: &Value, what: &str) -> String {
    v.as_str()
        .unwrap_or_else(|| panic!("{what} is not a string: {v}"))
        .to_string()
}

/// The "decided by" column of `ddo run`'s component table, by component: the row's last
/// field, after its last two-space gap (a label has single spaces only).
fn table_column(text: &str, name: &str) -> String {
    let header = text
        .lines()
        .position(|l| l.starts_with("component ") && l.ends_with("  decided by"))
        .unwrap_or_else(|| panic!("no component table in:\n{text}"));
    let row = text
        .lines()
        .skip(header + 1)
        .take_while(|l| !l.starts_with('*'))
        .find(|l| l.split_whitespace().next() == Some(name))
        .unwrap_or_else(|| panic!("no {name} row in:\n{text}"));
    row.rsplit_once("  ")
        .unwrap_or_else(|| panic!("no columns in the {name} row: {row}"))
        .1
        .to_string()
}

#[test]
fn one_decided_by_label_from_resolve_to_the_metrics() {
    let d = scratch("resolve-once");
    let png = d.join("out.png");
    let png = png.to_str().unwrap();
    let model = [
        "--config", "tiny", "--height", "16", "--width", "16", "--route", ROUTE,
    ];

    let alone = json(&ddo_with_env(
        &["resolve", "--route", ROUTE, "--json"],
        &ENV,
    ));
    let mut args = vec!["resolve"];
    args.extend(model);
    args.push("--json");
    let planned = json(&ddo_with_env(&args, &ENV));
    let mut args = vec!["run"];
    args.extend(model);
    args.extend(["--max-sequence-length", "8", "--out", png, "--json"]);
    let run = json(&ddo_with_env(&args, &ENV));
    let mut args = vec!["run"];
    args.extend(model);
    args.extend(["--max-sequence-length", "8", "--out", png]);
    let text = ok(&ddo_with_env(&args, &ENV));

    let mut labels = Vec::new();
    for name in COMPONENTS {
        let run_c = by_component(&run["components"], name);
        let from_run = label(&run_c["source"]["route"], "run source.route");
        let sources = [
            (
                "run metrics.decided_by",
                label(&run_c["metrics"]["decided_by"], "metrics"),
            ),
            (
                "run memory_plan decided_by",
                label(
                    &by_component(&run["memory_plan"]["components"], name)["decided_by"],
                    "plan",
                ),
            ),
            (
                "resolve --config source.route",
                label(
                    &by_component(&planned["components"], name)["source"]["route"],
                    "resolve",
                ),
            ),
            (
                "resolve --config memory_plan decided_by",
                label(
                    &by_component(&planned["memory_plan"]["components"], name)["decided_by"],
                    "resolve plan",
                ),
            ),
            ("run's text table", table_column(&text, name)),
        ];
        for (what, l) in &sources {
            assert_eq!(l, &from_run, "{name}: {what} against run's source.route");
        }
        // Without a model nothing is planned: the components the plan did not size say
        // what `ddo resolve` alone says.
        let alone_label = label(&by_component(&alone, name)["source"]["route"], "resolve");
        if run_c["source"]["route"] != by_component(&alone, name)["source"]["route"] {
            assert_eq!(
                by_component(&run["memory_plan"]["components"], name)["planned"],
                true,
                "{name}: `ddo resolve` says {alone_label}, `ddo run` {from_run}"
            );
        }
        // The options the route's decider gave name the same decider.
        let given: Vec<&str> = run_c["source"]["options"]
            .as_object()
            .unwrap()
            .values()
            .filter_map(Value::as_str)
            .filter(|s| *s != "route default")
            .collect();
        assert!(
            given.iter().all(|s| *s == from_run),
            "{name}: options from {given:?}, route from {from_run}"
        );
        labels.push(from_run);
    }
    // Four deciders, four labels, each the documented one.
    assert_eq!(
        labels,
        [
            "environment (DDO_TEXT_ENCODER_ROUTE)",
            "memory plan (one_shot_fast)",
            "explicit route",
            "preset default (one_shot_fast)",
        ]
    );
}
