//! `ddo bench` measures the disk's read rate for the benched component's files (issue 35),
//! as it measures the link: one reader and four, every planned byte read, the files of the
//! folder's component (or its single file); weights made in memory have no disk figure.

mod common;

use common::{ddo, fixture, json};

fn bench_json(extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "bench",
        "--height",
        "32",
        "--width",
        "32",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--json",
        "--route",
        "none",
    ];
    args.extend_from_slice(extra);
    json(&ddo(&args))
}

#[test]
fn bench_reads_the_components_files_once_per_reader_count() {
    let folder = fixture("flux_pipeline");
    let v = bench_json(&["--weights", &folder, "--component", "vae"]);
    let disk = v["disk"].as_array().expect("a disk array");
    assert_eq!(disk.len(), 2, "{v}");
    let files: Vec<std::path::PathBuf> = std::fs::read_dir(format!("{folder}/vae"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    let size: u64 = files.iter().map(|p| p.metadata().unwrap().len()).sum();
    for (d, readers) in disk.iter().zip([1, 4]) {
        assert_eq!(d["bytes"].as_u64(), Some(size), "{d}");
        assert_eq!(d["readers"].as_u64(), Some(readers));
        assert_eq!(d["files"].as_u64(), Some(files.len() as u64));
        assert!(d["bytes_per_sec"].as_f64().unwrap() > 0.0);
    }
    // A single file given for the component is the one read.
    let single = fixture("vae_flux_original/flux_pipeline-vae.safetensors");
    let v = bench_json(&["--weights", &folder, "--component", "vae", "--vae", &single]);
    let len = std::fs::metadata(&single).unwrap().len();
    assert_eq!(v["disk"][0]["bytes"].as_u64(), Some(len), "{v}");
    assert_eq!(v["disk"][0]["files"].as_u64(), Some(1));
}

#[test]
fn random_weights_have_no_disk_figure() {
    let v = bench_json(&["--config", "tiny"]);
    assert_eq!(v["disk"], serde_json::json!([]));
}

/// A candidate that reads staged weights from the disk each forward (`page_cache_limit=0`)
/// reports those bytes, and its floor is at least them at the disk's best measured rate; a
/// candidate that keeps them cached reads none from the disk.
#[test]
fn a_disk_tier_candidate_has_a_disk_floor() {
    let folder = fixture("flux_pipeline");
    let v = bench_json(&[
        "--weights",
        &folder,
        "--component",
        "transformer",
        "--route",
        "diffusers_group_offload:use_stream=true,pinned=false,page_cache_limit=0",
        "--route",
        "diffusers_group_offload:use_stream=true,pinned=false",
    ]);
    let rate = v["disk"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["bytes_per_sec"].as_f64().unwrap())
        .fold(0.0, f64::max);
    assert!(rate > 0.0, "{v}");
    let results = v["candidates"].as_array().expect("candidates");
    let by = |needle: &str, cached: bool| {
        results
            .iter()
            .find(|r| {
                let label = r["label"].as_str().unwrap();
                label.contains(needle) && label.contains("page_cache_limit") != cached
            })
            .unwrap_or_else(|| panic!("no {needle} candidate in {v}"))
    };
    let disk = by("pinned=false", false);
    let bytes = disk["disk_bytes_per_forward"].as_u64().unwrap();
    assert!(bytes > 0, "{disk}");
    assert!(
        bytes <= disk["streamed_bytes_per_forward"].as_u64().unwrap(),
        "{disk}"
    );
    let floor = disk["floor_seconds"].as_f64().unwrap();
    assert!(floor >= bytes as f64 / rate * 0.999, "{disk}");
    let cached = by("pinned=false", true);
    assert_eq!(
        cached["disk_bytes_per_forward"].as_u64(),
        Some(0),
        "{cached}"
    );
    // Same weights, same outputs, whichever tier they came from.
    assert_eq!(disk["output_fnv1a"], cached["output_fnv1a"]);
}
