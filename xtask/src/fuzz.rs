//! `cargo xtask fuzz [--seconds N] [--target NAME]`: runs the cargo-fuzz targets in
//! `fuzz/` (checkpoint headers, sharded indexes, `ddo` argument vectors) for N seconds each
//! (default 60), starting from the committed seed corpus `fuzz/corpus/<target>/`, and
//! reports the executions.
//!
//! Needs the nightly toolchain (`rustup toolchain install nightly`) and cargo-fuzz, which
//! this task installs with `cargo install cargo-fuzz` when it is missing. New inputs
//! libFuzzer finds go to `fuzz/target/corpus/<target>/` (ignored), never into the seeds;
//! crashes go to `fuzz/artifacts/<target>/` and fail the task (libFuzzer's whole output is
//! kept in `fuzz/target/<target>.log`). Each run is capped by
//! `-malloc_limit_mb=64` (an allocation that follows what a header claims is a crash),
//! `-max_len=8192` and the target's `-timeout` (an input running longer is a hang, a
//! crash). `DDO_*` variables are removed from the targets' environment (`cli_args` runs the
//! command, which would read them). Not part of CI: CI is stable-only; the seeds are
//! replayed on stable by `crates/ddo-core/tests/safetensors.rs` and
//! `crates/ddo-cli/tests/cli_args_seeds.rs`.

use std::process::{Command, Stdio};

use crate::workspace_root;

/// The fuzz targets, in `fuzz/fuzz_targets/`.
pub const TARGETS: [&str; 5] = [
    "safetensors_header",
    "gguf_header",
    "sharded_index",
    "cli_args",
    "serve_request",
];

/// How a target is built and run beyond what every target shares.
struct Profile {
    /// libFuzzer's `-timeout`, in seconds: one input running longer is a hang, a crash.
    timeout_seconds: u32,
    /// Options of `cargo fuzz run` itself.
    build: &'static [&'static str],
    /// A target folder of its own under `fuzz/target/` (builds with other options would
    /// otherwise rebuild each other).
    target_dir: Option<&'static str>,
    /// More libFuzzer options.
    run: &'static [&'static str],
}

/// The header targets parse a few KiB, with every comparison traced. `cli_args` may run the
/// tiny pipeline at 16x16 pixels (tens of milliseconds under AddressSanitizer, most of it in
/// the compute kernels): it is built without comparison tracing (its values come from
/// dictionaries, not from matching compared bytes; a fifth of its time went to the traced
/// comparisons of matrix packing) and slow inputs are mutated less often
/// (`-entropic_scale_per_exec_time`): with the limits of `ddo_cli::fuzz_argv`, about 1,200
/// executions per second on two cores instead of 500 when that was measured; since the
/// sandbox digests every input file after each execution (issue 34), 370-390 per second
/// (two 1,000-second runs on 2026-12-05): a million executions take about 45 minutes. Its largest single allocation stays
/// well under the shared 64 MB malloc limit. libFuzzer's leak check after an input is off
/// for it: the host backend's stream workers are detached threads that free their queue
/// and state after the device that owned them is dropped, so that check races with them (one
/// report in 400,000 executions, not reproduced by the input); memory that really grows is
/// still caught by `-rss_limit_mb`, and `cargo xtask soak` checks the resident set.
fn profile(target: &str) -> Profile {
    match target {
        "cli_args" => Profile {
            timeout_seconds: 10,
            build: &["--no-trace-compares"],
            target_dir: Some("target/no-trace-compares"),
            run: &["-entropic_scale_per_exec_time=1", "-detect_leaks=0"],
        },
        _ => Profile {
            timeout_seconds: 5,
            build: &[],
            target_dir: None,
            run: &[],
        },
    }
}

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
        let profile = profile(target);
        let mut cmd = Command::new("cargo");
        cmd.current_dir(&fuzz_dir)
            .args(["+nightly", "fuzz", "run"])
            .args(profile.build);
        if let Some(dir) = profile.target_dir {
            cmd.arg("--target-dir").arg(fuzz_dir.join(dir));
        }
        // The corpus folders are absolute: `cli_args` changes its working directory.
        cmd.arg(target.as_str())
            .arg(&work)
            .arg(&seeds)
            .args([
                "--",
                &format!("-max_total_time={seconds}"),
                "-malloc_limit_mb=64",
                "-rss_limit_mb=2048",
                "-max_len=8192",
                &format!("-timeout={}", profile.timeout_seconds),
                "-print_final_stats=1",
            ])
            .args(profile.run);
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("DDO_") {
                cmd.env_remove(key);
            }
        }
        eprintln!("$ {cmd:?}");
        let out = cmd
            .output()
            .map_err(|e| format!("cannot start cargo fuzz: {e}"))?;
        let text = String::from_utf8_lossy(&out.stderr).into_owned()
            + &String::from_utf8_lossy(&out.stdout);
        // The whole output (a leak or sanitizer report is longer than the tail shown).
        let log = fuzz_dir.join("target").join(format!("{target}.log"));
        let _ = std::fs::write(&log, &text);
        if !out.status.success() {
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            for l in tail.iter().rev() {
                eprintln!("{l}");
            }
            return Err(format!(
                "fuzz target {target} failed ({}); the crashing input is in fuzz/artifacts/{target}/, the whole output in {}",
                out.status,
                log.display()
            ));
        }
        let n = executions(&text).ok_or_else(|| {
            format!("fuzz target {target}: no `Done N runs` line in libFuzzer's output")
        })?;
        total += n;
        let done = text
            .lines()
            .rfind(|l| l.trim().starts_with("Done "))
            .unwrap_or_default()
            .trim();
        report.push(format!("{target}: {n} executions ({done}), no crash"));
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
        assert_eq!(
            parse(&args(&["--target", "cli_args"])).unwrap().1,
            ["cli_args"]
        );
        let manifest = std::fs::read_to_string(workspace_root().join("fuzz/Cargo.toml")).unwrap();
        for t in TARGETS {
            assert!(
                manifest.contains(&format!("name = \"{t}\"")),
                "{t}: no [[bin]]"
            );
            let source = workspace_root().join(format!("fuzz/fuzz_targets/{t}.rs"));
            assert!(source.is_file(), "{}", source.display());
            assert!(
                workspace_root().join("fuzz/corpus").join(t).is_dir(),
                "{t}: no seeds"
            );
            let p = profile(t);
            assert!(p.timeout_seconds > 0);
            assert!(p.target_dir.is_none_or(|d| d.starts_with("target/")), "{t}");
        }
        assert!(parse(&args(&["--seconds", "0"])).is_err());
        assert!(parse(&args(&["--target", "nope"])).is_err());
    }
}
