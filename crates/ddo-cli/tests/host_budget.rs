//! `--host-budget` (issue 35) through the binary: the plan and the run's report say the budget
//! and where it came from, the run reports its peak pinned memory within it, a budget no plan
//! fits is refused naming the least (which then runs), and a budget of 0 is a usage error.

mod common;

use common::{ddo, json};

fn run_json(extra: &[&str]) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("o.png");
    let mut args = vec![
        "run",
        "--config",
        "tiny",
        "--steps",
        "1",
        "--json",
        "--out",
        out.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    json(&ddo(&args))
}

#[test]
fn the_run_reports_its_host_budget_and_its_peak_pinned_memory_within_it() {
    let budget: u64 = 3 << 30;
    let v = run_json(&[
        "--host-budget",
        "3GiB",
        "--route",
        "transformer=diffusers_group_offload:use_stream=true",
    ]);
    let host = &v["host"];
    assert_eq!(host["budget_bytes"].as_u64(), Some(budget), "{host}");
    assert_eq!(host["budget_source"], "--host-budget");
    let pinned = host["peak_pinned_bytes"].as_u64().unwrap();
    assert!(pinned > 0 && pinned <= budget, "{host}");
    assert!(host["peak_rss_bytes"].as_u64().unwrap() > 0);
    let plan = &v["memory_plan"];
    assert_eq!(plan["host_budget_bytes"].as_u64(), Some(budget));
    for phase in plan["phases"].as_array().unwrap() {
        assert!(phase["host_bytes"].as_u64().unwrap() <= budget, "{phase}");
    }
    // Without the option: MemAvailable less the reserve.
    let v = run_json(&[]);
    let source = v["host"]["budget_source"].as_str().unwrap();
    assert!(source.starts_with("MemAvailable"), "{source}");
}

#[test]
fn a_host_budget_no_plan_fits_is_refused_naming_one_that_plans() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("o.png");
    let o = ddo(&[
        "run",
        "--config",
        "tiny",
        "--steps",
        "1",
        "--host-budget",
        "1GiB",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("a host budget of 1.00 GiB (--host-budget) is too small"),
        "{err}"
    );
    let needed = err
        .split("give --host-budget ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .expect("a budget named")
        .to_string();
    assert!(!out.exists(), "nothing written");
    run_json(&["--host-budget", &needed]);
    let o = ddo(&["run", "--config", "tiny", "--host-budget", "0"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--host-budget 0"));
}
