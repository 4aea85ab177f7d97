//! `cargo xtask bench --peer diffusers`: the streaming benchmark against Diffusers on the
//! same weights, in one job on one GPU.
//!
//! The GPU machine has no Rust toolchain, so this task builds here what the job needs into
//! `gpu-bundle/bench/` (ignored by git): DDO's side (`bench_peer`, the `ddo-cli` example
//! `crates/ddo-cli/examples/bench_peer.rs`, in release), Diffusers' side
//! (`tools/bench_peer.py`, with `tools/gpu_peer.py` for the model configs), the report
//! (`tools/bench_report.py`) and `run-bench.sh`, which on the GPU machine:
//!
//! 1. installs the carried Diffusers wheels (`wheels/`) into a private folder;
//! 2. runs `bench_peer.py`: builds the random weights once (Flux-shaped transformer 5 + 10
//!    blocks bf16, Flux VAE bf16) as safetensors, times Diffusers on them (resident,
//!    leaf+stream; VAE resident, leaf without and with a stream), measures pinned
//!    host→device bandwidth, host RSS and pinned bytes;
//! 3. runs `bench_peer` on the same files (resident, leaf+stream with no budget and with
//!    4 GiB, the VAE routes), with the same measurements;
//! 4. writes `$OUT/bench.json`, `$OUT/bench.md` (the table: ratios to the floor and to
//!    Diffusers, targets met or missed) and `$OUT/bench.svg`, plus both logs.
//!
//! With `--run` the script is run here too (a machine with a GPU and a toolchain).
//!
//! With `--full` it builds instead the benchmark at the full FLUX.1-dev config, the transformer
//! step and the whole pipeline, into `gpu-bundle/bench-full/` (see [`full`]).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::gpu::make_executable;
use crate::{cargo, run, workspace_root};

/// The `part` function of the compute and GGUF jobs' scripts (bash, a string literal for
/// `concat!`): each part under `timeout`, within what the job has left.
macro_rules! part_fn {
    () => {
        r#"# part NAME SECONDS DEST COMMAND...: COMMAND under timeout (at most SECONDS, and what the job
# has left before $deadline; under 30 s left, or SECONDS 0, it is skipped), its stdout to
# DEST, its stderr to $log; DDO_PART_SECONDS tells COMMAND its limit.
part() {
  local name="$1" want="$2" dest="$3"
  shift 3
  local left=$(( deadline - $(date +%s) ))
  if [ "$want" -eq 0 ] || [ "$left" -lt 30 ]; then
    echo "=== $name skipped (asked ${want} s, ${left} s left)" | tee -a "$log"
    return 0
  fi
  local secs=$(( want < left ? want : left ))
  echo "=== $name (timeout ${secs} s) at $(date +%T)" | tee -a "$log"
  DDO_PART_SECONDS="$secs" timeout -k 10 "$secs" "$@" > "$dest" 2>> "$log"
  echo "=== $name exit $?" | tee -a "$log"
}
"#
    };
}

mod compute;
mod full;
mod gguf;
mod host_ram;
mod serve;

/// The bench bundle's folder, relative to the workspace root (ignored by git).
pub const BENCH_DIR: &str = "gpu-bundle/bench";

/// Python files the job needs, from `tools/`.
const SCRIPTS: [&str; 3] = ["gpu_peer.py", "bench_peer.py", "bench_report.py"];

const USAGE: &str = "cargo xtask bench --peer diffusers [--full [--wheels DIR]] [--run] [--options OPTS] | cargo xtask bench --host-ram 32GiB,16GiB,8GiB [--steps N] [--base REV] [--run] | cargo xtask bench --serve [--run] | cargo xtask bench --compute [--run] | cargo xtask bench --gguf [--base REV] [--run]";

/// `--host-ram SIZES [--steps N] [--base REV] [--run]` ([`host_ram`]).
fn bench_host_ram(args: &[String]) -> Result<(), String> {
    let (mut sizes, mut steps, mut run_here) = (None, 28u32, false);
    let mut base = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--host-ram" => {
                let text = it
                    .next()
                    .ok_or("--host-ram needs sizes, e.g. 32GiB,16GiB,8GiB")?;
                sizes = Some(host_ram::parse_sizes(text)?);
            }
            "--steps" => {
                steps = it
                    .next()
                    .and_then(|n| n.parse().ok())
                    .filter(|&n| n > 0)
                    .ok_or("--steps needs a positive whole number, e.g. 28")?;
            }
            "--base" => {
                let rev = it
                    .next()
                    .ok_or("--base needs a git revision, e.g. 45fcf60")?;
                base = Some(host_ram::parse_base(rev)?);
            }
            "--run" => run_here = true,
            other => {
                return Err(format!("unknown bench argument `{other}`; usage: {USAGE}"));
            }
        }
    }
    let sizes = sizes.ok_or("--host-ram needs sizes, e.g. 32GiB,16GiB,8GiB")?;
    host_ram::bench_host_ram(&sizes, steps, base.as_deref(), run_here)
}

/// `--gguf [--base REV] [--run]` ([`gguf`]).
fn bench_gguf(args: &[String]) -> Result<(), String> {
    let mut base = None;
    let mut run_here = false;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--gguf" => {}
            "--run" => run_here = true,
            "--base" => {
                let rev = it
                    .next()
                    .ok_or("--base needs a git revision, e.g. --base 45fcf60")?;
                base = Some(host_ram::parse_base(rev)?);
            }
            other => {
                return Err(format!(
                    "bench --gguf: unknown argument `{other}`; usage: {USAGE}"
                ));
            }
        }
    }
    gguf::bench_gguf(base.as_deref(), run_here)
}

/// Parses `--peer diffusers [--full [--wheels DIR]] [--run] [--options OPTS]` and builds (and
/// maybe runs) the bench: the quick one, or with `--full` the one at FLUX.1-dev's size.
pub fn bench(args: &[String]) -> Result<(), String> {
    if args.iter().any(|a| a == "--host-ram") {
        return bench_host_ram(args);
    }
    if args.iter().any(|a| a == "--gguf") {
        return bench_gguf(args);
    }
    if args.iter().any(|a| a == "--compute") {
        return match args.iter().find(|a| *a != "--compute" && *a != "--run") {
            Some(other) => Err(format!(
                "bench --compute: unknown argument `{other}`; usage: {USAGE}"
            )),
            None => compute::bench_compute(args.iter().any(|a| a == "--run")),
        };
    }
    if args.iter().any(|a| a == "--serve") {
        return match args.iter().find(|a| *a != "--serve" && *a != "--run") {
            Some(other) => Err(format!(
                "bench --serve: unknown argument `{other}`; usage: {USAGE}"
            )),
            None => serve::bench_serve(args.iter().any(|a| a == "--run")),
        };
    }
    let mut peer = None;
    let mut run_here = false;
    let mut options = String::new();
    let mut full_mode = false;
    let mut wheels = None;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--peer" => peer = it.next().cloned(),
            "--run" => run_here = true,
            "--full" => full_mode = true,
            "--wheels" => {
                wheels = Some(PathBuf::from(it.next().ok_or(
                    "--wheels needs the folder of the Diffusers wheels, e.g. ../shared/wheels",
                )?));
            }
            "--options" => {
                options = it
                    .next()
                    .cloned()
                    .ok_or("--options needs route options, e.g. unit_bytes=16MiB,ring_slots=3")?;
            }
            other => {
                return Err(format!("unknown bench argument `{other}`; usage: {USAGE}"));
            }
        }
    }
    match peer.as_deref() {
        Some("diffusers") => {}
        Some(other) => return Err(format!("unknown peer `{other}`; the peer is `diffusers`")),
        None => return Err("give the peer: cargo xtask bench --peer diffusers".into()),
    }
    if full_mode {
        // The options are written into the job's script: letters, digits and `_=,.` only.
        if !options
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_=,.".contains(c))
        {
            return Err(format!(
                "--options `{options}`: route options are key=value pairs joined by commas, e.g. ring_slots=3"
            ));
        }
        return full::bench_full(&full::FullOptions {
            route_options: options,
            wheels,
            run_here,
        });
    }
    if wheels.is_some() {
        return Err(format!(
            "--wheels is for --full (the quick bench installs ./wheels on the GPU machine); usage: {USAGE}"
        ));
    }
    let root = workspace_root();
    let (exe, _) = build_release(
        &root,
        "--example",
        "bench_peer",
        "release/examples/bench_peer",
    )?;
    let dir = root.join(BENCH_DIR);
    if dir.exists() {
        fs::remove_dir_all(&dir).map_err(|e| format!("cannot clear {}: {e}", dir.display()))?;
    }
    fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    copy(&exe, &dir.join("bench_peer"))?;
    for s in SCRIPTS {
        copy(&root.join("tools").join(s), &dir.join(s))?;
    }
    let script = dir.join("run-bench.sh");
    fs::write(&script, run_bench_script(&options))
        .map_err(|e| format!("cannot write {}: {e}", script.display()))?;
    make_executable(&script)?;
    run(Command::new("bash").arg("-n").arg(&script))?;
    eprintln!(
        "bench: {} ready; on the GPU machine, from the repository root (carry gpu-bundle and wheels): \
         ./{BENCH_DIR}/run-bench.sh [ROUTE_OPTIONS]",
        dir.display()
    );
    if run_here {
        run(&mut Command::new(&script))?;
    }
    Ok(())
}

/// Builds ddo-cli's `kind` (`--bin` or `--example`) `name` in release and returns its
/// executable (`rel`, under the target directory) and the target directory.
pub(crate) fn build_release(
    root: &Path,
    kind: &str,
    name: &str,
    rel: &str,
) -> Result<(PathBuf, PathBuf), String> {
    run(cargo().args([
        "build",
        "--release",
        "--locked",
        "-p",
        "ddo-cli",
        kind,
        name,
    ]))?;
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let exe = target.join(rel);
    if !exe.is_file() {
        return Err(format!("cargo built no {}", exe.display()));
    }
    Ok((exe, target))
}

fn copy(from: &Path, to: &Path) -> Result<(), String> {
    fs::copy(from, to)
        .map(|_| ())
        .map_err(|e| format!("cannot copy {} to {}: {e}", from.display(), to.display()))
}

/// The job's script. `default_options` are the route options for DDO's streamed routes
/// when the script is run without an argument.
pub fn run_bench_script(default_options: &str) -> String {
    format!(
        r#"#!/usr/bin/env bash
# DDO vs Diffusers on the same weights, in one job on one GPU (built by
# `cargo xtask bench --peer diffusers`). Run from the repository root, carrying
# gpu-bundle and wheels (Diffusers 0.42.1 wheels; PyTorch is preinstalled).
# Usage: ./gpu-bundle/bench/run-bench.sh [ROUTE_OPTIONS]   e.g. unit_bytes=16MiB,ring_slots=3
# Writes $OUT/bench.json, bench.md, bench.svg, peer.log, ddo.log (default OUT: ./bench-out).
set -u
here="$(cd "$(dirname "$0")" && pwd)"
out="${{OUT:-$PWD/bench-out}}"
data="${{DDO_BENCH_DATA:-/tmp/ddo-bench}}"
wheels="${{DDO_WHEELS:-$PWD/wheels}}"
options="${{1:-{default_options}}}"
mkdir -p "$out" "$data"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
fi
python3 -m pip install -q --no-index --no-deps --target /tmp/ddo-bench-site "$wheels"/*.whl || exit 1
export PYTHONPATH=/tmp/ddo-bench-site
export PYTHONUNBUFFERED=1 RUST_BACKTRACE=1
echo "=== Diffusers side"
python3 "$here/bench_peer.py" "$data" 2>&1 | tee "$out/peer.log" | tail -20
rc=${{PIPESTATUS[0]}}
[ "$rc" -eq 0 ] || {{ echo "=== bench_peer.py failed (exit $rc)"; exit 1; }}
echo "=== DDO side (route options: ${{options:-none}})"
"$here/bench_peer" "$data" "$data/ddo_bench.json" "$options" 2>&1 | tee "$out/ddo.log" | tail -20
rc=${{PIPESTATUS[0]}}
[ "$rc" -eq 0 ] || {{ echo "=== bench_peer failed (exit $rc)"; exit 1; }}
echo "=== report"
python3 "$here/bench_report.py" "$data/peer_bench.json" "$data/ddo_bench.json" "$out"
"#
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_runs_both_sides_on_one_data_folder_and_reports() {
        let s = run_bench_script("ring_slots=3");
        assert!(s.starts_with("#!/usr/bin/env bash"));
        let peer = s.find("bench_peer.py\" \"$data\"").unwrap();
        let ddo = s.find("\"$here/bench_peer\" \"$data\"").unwrap();
        let report = s
            .find("bench_report.py\" \"$data/peer_bench.json\"")
            .unwrap();
        assert!(peer < ddo && ddo < report, "{s}");
        assert!(s.contains("options=\"${1:-ring_slots=3}\""));
        assert_eq!(s.matches("PIPESTATUS[0]").count(), 2);
        assert!(s.contains("--no-index"));
    }

    #[test]
    fn the_script_is_valid_bash() {
        let dir = std::env::temp_dir().join(format!("ddo-xtask-bench-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("run-bench.sh");
        fs::write(&path, run_bench_script("")).unwrap();
        let status = Command::new("bash").arg("-n").arg(&path).status();
        fs::remove_dir_all(&dir).unwrap();
        // bash is part of every machine this workspace builds on (.ci/run is bash).
        assert!(status.unwrap().success());
    }

    #[test]
    fn bad_arguments_are_refused_before_building() {
        assert!(bench(&[]).unwrap_err().contains("--peer diffusers"));
        assert!(
            bench(&["--peer".into(), "comfy".into()])
                .unwrap_err()
                .contains("unknown peer")
        );
        assert!(bench(&["--fast".into()]).unwrap_err().contains("unknown"));
    }

    fn args(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn bad_full_arguments_are_refused_before_building() {
        let full = |extra: &[&str]| {
            let mut a = args(&["--peer", "diffusers", "--full"]);
            a.extend(args(extra));
            bench(&a).unwrap_err()
        };
        assert!(
            bench(&args(&["--full"]))
                .unwrap_err()
                .contains("--peer diffusers")
        );
        assert!(
            bench(&args(&["--full", "--peer", "comfy"]))
                .unwrap_err()
                .contains("unknown peer")
        );
        assert!(full(&["--wheels"]).contains("--wheels needs"));
        assert!(full(&["--options"]).contains("--options needs"));
        assert!(full(&["--options", "ring_slots=3; rm -rf /"]).contains("key=value pairs"));
        assert!(
            full(&["--wheels", "/nonexistent/wheels"]).contains("cannot read the Diffusers wheels")
        );
        assert!(full(&["--big"]).contains("unknown bench argument `--big`"));
        // --wheels belongs to --full.
        assert!(
            bench(&args(&["--peer", "diffusers", "--wheels", "x"]))
                .unwrap_err()
                .contains("--wheels is for --full")
        );
    }
}

/// Checks of a job's script shared by the jobs' tests.
#[cfg(test)]
pub(crate) mod script_checks {
    /// `script` is valid bash (`bash -n`), runs its parts with the shared `part` function,
    /// and writes at most eight files under `$OUT` (what a device job brings back).
    pub fn assert_job_script(script: &str) {
        assert!(script.starts_with("#!/usr/bin/env bash"));
        assert!(script.contains("timeout -k 10 \"$secs\" \"$@\""));
        let outs: std::collections::BTreeSet<&str> = script
            .match_indices("\"$out/")
            .map(|(i, _)| {
                let rest = &script[i + 6..];
                &rest[..rest.find('"').unwrap()]
            })
            .collect();
        assert!(outs.len() <= 8, "{outs:?}");
        let checked = std::process::Command::new("bash")
            .args(["-n", "-c", script])
            .status()
            .expect("bash runs");
        assert!(checked.success(), "bash -n refused the script");
    }
}
