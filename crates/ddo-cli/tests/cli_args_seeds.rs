//! The `cli_args` fuzz target's seeds (`fuzz/corpus/cli_args/`), replayed on stable: each
//! seed becomes its argv through `ddo_cli::fuzz_argv::argv_from_bytes` and runs in the same
//! sandbox with the same checks as under `cargo xtask fuzz --target cli_args` (no panic,
//! caught or not; no input changed; no file left by a failed command; no temporary file
//! left). CI has no nightly toolchain and no cargo-fuzz: this is where the seeds run there.
//!
//! The sandbox is the process's working directory while a seed runs, so this file holds one
//! test.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use ddo_cli::fuzz_argv::{Sandbox, argv_from_bytes};

const TEST: &str = "every_cli_args_seed_replays_without_breaking_an_invariant";

#[test]
fn every_cli_args_seed_replays_without_breaking_an_invariant() {
    // The command reads DDO_* variables: run again without them where any is set.
    let set: Vec<String> = std::env::vars_os()
        .filter_map(|(k, _)| k.into_string().ok())
        .filter(|k| k.starts_with("DDO_"))
        .collect();
    if !set.is_empty() {
        let mut again = Command::new(std::env::current_exe().expect("test binary"));
        again.args(["--exact", TEST, "--nocapture"]);
        for k in &set {
            again.env_remove(k);
        }
        let status = again.status().expect("rerun without DDO_*");
        assert!(status.success(), "the rerun without {set:?} failed");
        return;
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/cli_args");
    let mut seeds: Vec<_> = std::fs::read_dir(&dir)
        .expect("seed corpus")
        .map(|e| e.expect("entry").path())
        .collect();
    seeds.sort();
    let mut sandbox = Sandbox::create_in_temp().expect("sandbox");
    let started = Instant::now();
    let mut failures = Vec::new();
    for seed in &seeds {
        let bytes = std::fs::read(seed).expect("seed");
        let argv = argv_from_bytes(&bytes);
        let t0 = Instant::now();
        if let Err(problem) = sandbox.run(&argv) {
            failures.push(format!("{}: {problem}", seed.display()));
        }
        let took = t0.elapsed().as_secs_f64();
        assert!(took < 10.0, "{}: {argv:?} took {took:.1} s", seed.display());
    }
    if let Err(e) = sandbox.verify_contents() {
        failures.push(e);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(
        seeds.len() >= 20,
        "only {} seeds in {}",
        seeds.len(),
        dir.display()
    );
    eprintln!(
        "{} seeds in {:.2} s",
        seeds.len(),
        started.elapsed().as_secs_f64()
    );
}
