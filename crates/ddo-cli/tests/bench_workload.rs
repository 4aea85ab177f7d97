//! `ddo bench`'s workload and candidates (issue 34): preset `off` runs the component
//! unmanaged — its weights on the device as `ddo run` puts them, the same output as the
//! resident route, the host copy left for the next candidate — and `--height`/`--width`
//! are rounded to whole latent patches as `ddo run` rounds them, with run's note.

mod common;

use common::{ddo, json, ok};

#[test]
fn preset_off_runs_the_component_unmanaged_and_leaves_it_for_the_next_candidate() {
    let args = [
        "bench",
        "--config",
        "tiny",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--preset",
        "off",
        "--route",
        "none",
    ];
    let v = json(&ddo(&[&args[..], &["--json"]].concat()));
    let c = v["candidates"].as_array().unwrap();
    let by_label = |l: &str| c.iter().find(|r| r["label"] == l).unwrap().clone();
    let (off, none) = (by_label("preset off"), by_label("none"));
    assert!(off["error"].is_null(), "{off}");
    assert_eq!(off["route"], "unmanaged", "{off}");
    assert_eq!(off["streamed_bytes_per_forward"], 0, "{off}");
    // The weights were on the device: the same computation as resident, bit for bit.
    assert!(none["error"].is_null(), "the next candidate ran: {none}");
    assert!(off["output_fnv1a"].is_string(), "{off}");
    assert_eq!(off["output_fnv1a"], none["output_fnv1a"]);
    let text = ok(&ddo(&args));
    assert!(!text.contains("refused"), "{text}");
    assert!(!text.contains("bug"), "{text}");
}

#[test]
fn bench_rounds_the_size_as_run_does_and_says_so() {
    let args = [
        "bench",
        "--config",
        "tiny",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--route",
        "none",
        "--height",
        "7",
    ];
    let text = ok(&ddo(&args));
    let note = "128x7 rounded down to 128x4: height and width must be multiples of 4";
    assert!(text.contains(", 128x4 px,"), "{text}");
    assert!(text.contains(&format!("  note: {note}")), "{text}");
    let v = json(&ddo(&[&args[..], &["--json"]].concat()));
    assert_eq!(
        (v["height"].as_u64(), v["width"].as_u64()),
        (Some(4), Some(128))
    );
    assert!(v["size_note"].as_str().unwrap().starts_with(note), "{v}");
    // The words `ddo run` prints for the same size.
    let d = common::scratch("bench-size");
    let out = d.join("x.png");
    let run = ok(&ddo(&[
        "run",
        "--config",
        "tiny",
        "--steps",
        "1",
        "--height",
        "7",
        "--out",
        out.to_str().unwrap(),
    ]));
    assert!(run.contains(note), "{run}");
    let _ = std::fs::remove_dir_all(&d);
}
