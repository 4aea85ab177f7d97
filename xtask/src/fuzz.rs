//! `cargo xtask fuzz [--seconds N] [--target NAME]`: runs the cargo-fuzz targets in
//! `fuzz/` (checkpoint headers, sharded indexes) for N seconds each (default 60), starting
//! from the committed seed corpus `fuzz/corpus/<target>/`, and reports the executions.
//!
//! Needs the nightly toolchain (`rustup toolchain install nightly`) and cargo-fuzz, which
//! this task installs with `cargo install cargo-fuzz` when it is missing. New inputs
//! libFuzzer finds go to `fuzz/target/corpus/<target>/` (ignored), never into the seeds;
//! crashes go to `fuzz/artifacts/<target>/` and fail the task. Each run is capped by
//! `-malloc_limit_mb=64` (an allocation that follows what a header claims is a crash) and
//! `-max_len=8192`. Not part of CI: CI is stable-only; the seeds are replayed on stable by
//! `crates/ddo-core/tests/safetensors.rs`.

use std::process::{Command, Stdio};

use crate::workspace_root;

/// The fuzz targets, in `fuzz/fuzz_targets/`.
pub const TARGETS: [&str; 2] = ["safetensors_header", "sharded_index"];

fn works(cmd: &mut Command) -> bool {
    cmd.stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Makes sure the nightly toolchain and cargo-fuzz are there (installing cargo-fuzz).
fn tools() -> Result<(), String> {
    if !works(Command::new("cargo").args(["+nightly", "--version"])) {
        return Err(
            "the nightly toolchain is missing (cargo-fuzz needs it): run \
                    `rustup toolchain install nightly`, then this task again"
                .into(),
        );
    }
    if !works(Command::new("cargo").args(["+nightly", "fuzz", "--version"])) {
        eprintln!("xtask fuzz: cargo-fuzz is missing; installing it (cargo install cargo-fuzz)");
        crate::run(Command::new("cargo").args(["install", "cargo-fuzz"])).map_err(|e| {
            format!("{e}; install cargo-fuzz by hand (`cargo install cargo-fuzz`) and retry")
        })?;
    }
    Ok(())
}

/// `Done N runs in S second(s)` from libFuzzer's output.
fn executions(output: &str) -> Option<u64> {
    output
        .lines()
        .filter_map(|l| l.trim().strip_prefix("Done "))
        .filter_map(|rest| rest.split_whitespace().next()?.parse().ok())
        .next_back()
}

/// Parses `--seconds N` and `--target NAME`.
fn parse(args: &[String]) -> Result<(u64, Vec<String>), String> {
    let mut seconds = 60;
    let mut targets = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--seconds" => {
                seconds = it
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|s| *s > 0)
                    .ok_or("--seconds takes a positive whole number")?;
            }
            "--target" => {
                let t = it.next().ok_or("--target takes a target name")?;
                if !TARGETS.contains(&t.as_str()) {
                    return Err(format!("unknown fuzz target `{t}`; targets: {TARGETS:?}"));
                }
                targets.push(t.clone());
            }
            other => {
                return Err(format!(
                    "unknown option `{other}`; usage: cargo xtask fuzz [--seconds N] [--target NAME]"
                ));
            }
        }
    }
    if targets.is_empty() {
        targets = TARGETS.iter().map(|t| t.to_string()).collect();
    }
    Ok((seconds, targets))
}

/// The task.
pub fn fuzz(args: &[String]) -> Result<(), String> {
    let (seconds, targets) = parse(args)?;
    tools()?;
    let root = workspace_root();
    let fuzz_dir = root.join("fuzz");
    let mut total = 0;
    let mut report = Vec::new();
    for target in &targets {
        let work = fuzz_dir.join("target/corpus").join(target);
        std::fs::create_dir_all(&work).map_err(|e| format!("{}: {e}", work.display()))?;
        let seeds = fuzz_dir.join("corpus").join(target);
        let mut cmd = Command::new("cargo");
        cmd.current_dir(&fuzz_dir)
            .args(["+nightly", "fuzz", "run", target.as_str()])
            .arg(&work)
            .arg(&seeds)
            .args([
                "--",
                &format!("-max_total_time={seconds}"),
                "-malloc_limit_mb=64",
                "-rss_limit_mb=2048",
                "-max_len=8192",
                "-print_final_stats=1",
            ]);
        eprintln!("$ {cmd:?}");
        let out = cmd
            .output()
            .map_err(|e| format!("cannot start cargo fuzz: {e}"))?;
        let text = String::from_utf8_lossy(&out.stderr).into_owned()
            + &String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            for l in tail.iter().rev() {
                eprintln!("{l}");
            }
            return Err(format!(
                "fuzz target {target} failed ({}); the crashing input is in fuzz/artifacts/{target}/",
                out.status
            ));
        }
        let n = executions(&text).ok_or_else(|| {
            format!("fuzz target {target}: no `Done N runs` line in libFuzzer's output")
        })?;
        total += n;
        report.push(format!("{target}: {n} executions in {seconds} s, no crash"));
    }
    for line in &report {
        println!("fuzz: {line}");
    }
    println!("fuzz: {total} executions in all");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_execution_count_and_options() {
        let out = "#2\tINITED\n#524288\tpulse\nDone 1234567 runs in 61 second(s)\nstat::x: 1";
        assert_eq!(executions(out), Some(1_234_567));
        assert_eq!(executions("nothing"), None);
        let args = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            parse(&args(&["--seconds", "5", "--target", "sharded_index"])).unwrap(),
            (5, vec!["sharded_index".to_string()])
        );
        assert_eq!(parse(&[]).unwrap().1.len(), TARGETS.len());
        assert!(parse(&args(&["--seconds", "0"])).is_err());
        assert!(parse(&args(&["--target", "nope"])).is_err());
    }
}
