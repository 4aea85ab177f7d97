//! GPU tasks: `test-gpu` runs the CUDA backend's tests on this machine (which needs a GPU
//! and a Rust toolchain); `gpu-bundle` builds them here, in release, into `gpu-bundle/`
//! with a `run-all.sh`, for a GPU machine that has no toolchain.
//!
//! Both set `DDO_REQUIRE_GPU=1` for the tests, so a machine without a usable device fails
//! loudly instead of printing "skipped: no CUDA device" and passing, and both give the
//! tests that read an environment variable what they need: `DDO_FIXTURES` (the committed
//! fixtures) and `DDO_PEER_DIR` (Diffusers' reference outputs, written first by
//! `tools/gpu_peer.py` with the Diffusers wheels of `../shared/wheels/` where Python has
//! torch; the bundle carries the script and the wheels). Under `DDO_REQUIRE_GPU=1` a test
//! missing such an input fails (`tests/common`'s `missing`) rather than skips. Only the
//! benchmarks behind `DDO_BENCH=1` stay opt-in.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Stdio;

use crate::{cargo, run, workspace_root};

/// The packages whose tests need a GPU.
const GPU_PACKAGES: [&str; 2] = ["ddo-cuda", "ddo-vmm"];

/// `-p NAME` for each GPU package.
fn package_args() -> Vec<&'static str> {
    GPU_PACKAGES.iter().flat_map(|p| ["-p", *p]).collect()
}

/// The bundle's folder, relative to the workspace root (ignored by git).
pub const BUNDLE_DIR: &str = "gpu-bundle";

/// Where the Diffusers wheels are kept, relative to the workspace root.
pub const WHEELS_DIR: &str = "../shared/wheels";

/// The Diffusers side of the conformance tests, relative to the workspace root.
pub const PEER_SCRIPT: &str = "tools/gpu_peer.py";

/// `cargo test -p ddo-cuda -p ddo-vmm --release -- --test-threads=1`, with a GPU required,
/// the fixtures named and Diffusers' references written first (by the script
/// [`peer_script`] prints, which `run-all.sh` runs too).
pub fn test_gpu() -> Result<(), String> {
    let root = workspace_root();
    let scratch = root.join("target").join("gpu-peer");
    let prepare = peer_script(
        &root.join(PEER_SCRIPT).to_string_lossy(),
        &root.join(WHEELS_DIR).to_string_lossy(),
        &scratch.to_string_lossy(),
    );
    let peer = std::process::Command::new("bash")
        .args([
            "-c",
            &format!("{prepare}\nprintf %s \"${{DDO_PEER_DIR:-}}\""),
        ])
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run bash: {e}"))?;
    let peer_dir = String::from_utf8_lossy(&peer.stdout).trim().to_string();
    let mut cmd = cargo();
    cmd.arg("test")
        .args(package_args())
        .args(["--release", "--"])
        .args(["--test-threads=1", "--nocapture"])
        .env("DDO_REQUIRE_GPU", "1")
        .env("DDO_FIXTURES", root.join("fixtures"));
    if !peer_dir.is_empty() {
        cmd.env("DDO_PEER_DIR", peer_dir);
    }
    run(&mut cmd)
}

/// Bash that writes Diffusers' reference outputs with `script` into `scratch/peer` (Diffusers
/// installed from the wheels in `wheels` into `scratch/site`) and exports `DDO_PEER_DIR`,
/// unless it is set already; where Python, torch or the wheels are missing it says which and
/// leaves it unset (the conformance tests, which `DDO_REQUIRE_GPU=1` runs, then fail naming it).
pub fn peer_script(script: &str, wheels: &str, scratch: &str) -> String {
    format!(
        r#"if [ -z "${{DDO_PEER_DIR:-}}" ]; then
  if command -v python3 >/dev/null 2>&1 && python3 -c 'import torch' >/dev/null 2>&1 && ls "{wheels}"/*.whl >/dev/null 2>&1 && [ -f "{script}" ]; then
    mkdir -p "{scratch}"
    if python3 -m pip install -q --no-index --no-deps --target "{scratch}/site" "{wheels}"/*.whl >&2 \
      && PYTHONPATH="{scratch}/site${{PYTHONPATH:+:$PYTHONPATH}}" python3 "{script}" "{scratch}/peer" >&2; then
      export DDO_PEER_DIR="{scratch}/peer"
    else
      echo "Diffusers' reference outputs could not be written: the conformance tests will fail" >&2
    fi
  else
    echo "no python3 with torch, no wheels in {wheels} or no {script}: the conformance tests will fail" >&2
  fi
fi"#
    )
}

/// The `ddo` command's GPU tests (they run the `ddo` binary, which the bundle carries).
const CLI_GPU_TESTS: [&str; 1] = ["gpu_exit"];

/// Runs `cargo` with `args` (plus JSON messages) in release and returns its stdout.
fn cargo_json(args: &[&str]) -> Result<String, String> {
    let mut cmd = cargo();
    cmd.args(args)
        .args(["--message-format=json-render-diagnostics"])
        .current_dir(workspace_root())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    eprintln!("$ {cmd:?}");
    let output = cmd
        .output()
        .map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
    if !output.status.success() {
        return Err(format!("{cmd:?} failed with {}", output.status));
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Builds the GPU test binaries in release and writes `gpu-bundle/` with `run-all.sh`.
pub fn bundle() -> Result<(), String> {
    let root = workspace_root();
    let mut args = vec!["test", "--release", "--no-run"];
    args.extend(package_args());
    let mut executables = test_executables(&cargo_json(&args)?);
    if executables.is_empty() {
        return Err("cargo built no test executables for the GPU packages".into());
    }
    let mut cli = vec!["test", "--release", "--no-run", "-p", "ddo-cli"];
    for t in CLI_GPU_TESTS {
        cli.extend(["--test", t]);
    }
    executables.extend(test_executables(&cargo_json(&cli)?));
    let ddo = binary_executable(&cargo_json(&[
        "build",
        "--release",
        "-p",
        "ddo-cli",
        "--bin",
        "ddo",
    ])?)
    .ok_or("cargo built no `ddo` binary")?;
    let dir = root.join(BUNDLE_DIR);
    clear_keeping_bench_bundles(&dir)?;
    let mut names = Vec::new();
    for exe in &executables {
        let mut name = bundle_name(exe);
        // Two packages may each have a `tests/gpu.rs`: keep both.
        let base = name.clone();
        let mut n = 2;
        while names.contains(&name) {
            name = format!("{base}-{n}");
            n += 1;
        }
        let to = dir.join(&name);
        fs::copy(exe, &to)
            .map_err(|e| format!("cannot copy {} to {}: {e}", exe.display(), to.display()))?;
        eprintln!("gpu-bundle: {name} <- {}", exe.display());
        names.push(name);
    }
    // The binary the command's GPU tests run (`DDO_BIN` in run-all.sh).
    fs::copy(&ddo, dir.join("ddo")).map_err(|e| format!("cannot copy {}: {e}", ddo.display()))?;
    // xz-compressed (about a fifth of 98 MiB), so the bundle travels in one device call
    // beside the bench bundles; run-all.sh unpacks each once.
    for name in names.iter().map(String::as_str).chain(["ddo"]) {
        run(std::process::Command::new("xz")
            .args(["-T2", "-6", "-f"])
            .arg(dir.join(name)))?;
    }
    // The conformance tests' Diffusers side: the script and the wheels.
    let peer = root.join(PEER_SCRIPT);
    fs::copy(&peer, dir.join("gpu_peer.py"))
        .map_err(|e| format!("cannot copy {}: {e}", peer.display()))?;
    let wheels = root.join(WHEELS_DIR);
    let wheel_dir = dir.join("wheels");
    fs::create_dir_all(&wheel_dir)
        .map_err(|e| format!("cannot create {}: {e}", wheel_dir.display()))?;
    let mut copied = 0;
    if let Ok(entries) = fs::read_dir(&wheels) {
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "whl") {
                let to = wheel_dir.join(entry.file_name());
                fs::copy(&path, &to).map_err(|e| format!("cannot copy {}: {e}", path.display()))?;
                copied += 1;
            }
        }
    }
    if copied == 0 {
        eprintln!(
            "gpu-bundle: no wheels in {}: the Diffusers conformance tests will fail there",
            wheels.display()
        );
    }
    let script = dir.join("run-all.sh");
    fs::write(&script, run_all_script(&names))
        .map_err(|e| format!("cannot write {}: {e}", script.display()))?;
    make_executable(&script)?;
    eprintln!(
        "gpu-bundle: {} binaries and run-all.sh in {}; on the GPU machine: ./{BUNDLE_DIR}/run-all.sh [LOG_DIR]",
        names.len(),
        dir.display()
    );
    Ok(())
}

/// Empties `dir` (made if missing) but for the bench bundles beside the tests
/// (`bench*` folders, which `cargo xtask bench` builds), so one device call can carry both.
fn clear_keeping_bench_bundles(dir: &Path) -> Result<(), String> {
    fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let entries = fs::read_dir(dir).map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
    for entry in entries {
        let entry = entry.map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
        let path = entry.path();
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        if is_dir && entry.file_name().to_string_lossy().starts_with("bench") {
            continue;
        }
        let removed = if is_dir {
            fs::remove_dir_all(&path)
        } else {
            fs::remove_file(&path)
        };
        removed.map_err(|e| format!("cannot remove {}: {e}", path.display()))?;
    }
    Ok(())
}

/// Marks `path` executable (a no-op off Unix).
#[cfg(unix)]
pub fn make_executable(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(0o755))
        .map_err(|e| format!("cannot make {} executable: {e}", path.display()))
}

/// Marks `path` executable (a no-op off Unix).
#[cfg(not(unix))]
pub fn make_executable(_path: &Path) -> Result<(), String> {
    Ok(())
}

/// Test executables in cargo's JSON messages: `compiler-artifact` lines of a test profile
/// with a non-null `"executable"`.
pub fn test_executables(json_lines: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = json_lines
        .lines()
        .filter(|l| l.contains(r#""reason":"compiler-artifact""#) && profile_is_test(l))
        .filter_map(|l| string_field(l, "executable"))
        .map(PathBuf::from)
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Whether a `compiler-artifact` line's `"profile"` object says `"test":true` (its target
/// object has a `"test"` field of its own, true for a bin that has tests: the `ddo` binary
/// built for the command's integration tests is no test executable).
fn profile_is_test(line: &str) -> bool {
    line.find(r#""profile":{"#)
        .map(|start| &line[start..])
        .and_then(|profile| profile.find('}').map(|end| &profile[..end]))
        .is_some_and(|profile| profile.contains(r#""test":true"#))
}

/// The `ddo` executable in cargo's JSON messages of a build: the `compiler-artifact` line
/// of the `ddo` bin target.
pub fn binary_executable(json_lines: &str) -> Option<PathBuf> {
    json_lines
        .lines()
        .filter(|l| l.contains(r#""reason":"compiler-artifact""#))
        .filter(|l| l.contains(r#""kind":["bin"]"#) && l.contains(r#""name":"ddo""#))
        .find_map(|l| string_field(l, "executable"))
        .map(PathBuf::from)
}

/// The string value of `"key":"..."` in one JSON line (JSON escapes of `\\` and `\"` undone).
fn string_field(line: &str, key: &str) -> Option<String> {
    let start = line.find(&format!(r#""{key}":""#))? + key.len() + 4;
    let mut value = String::new();
    let mut chars = line[start..].chars();
    while let Some(c) = chars.next() {
        match c {
            '"' => return Some(value),
            '\\' => value.push(chars.next()?),
            c => value.push(c),
        }
    }
    None
}

/// `target/release/deps/gpu-0123abcd` -> `gpu`.
fn bundle_name(exe: &Path) -> String {
    let stem = exe
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    match stem.rsplit_once('-') {
        Some((name, hash)) if hash.chars().all(|c| c.is_ascii_hexdigit()) => name.to_string(),
        _ => stem,
    }
}

/// The bundle's runner: each binary one test at a time, output shown and kept in a log
/// (`$1`, else `$OUT`, else `logs/` beside the script); non-zero if any binary failed.
pub fn run_all_script(names: &[String]) -> String {
    let list = names.join(" ");
    let peer = peer_script(
        "$here/gpu_peer.py",
        "$here/wheels",
        "${TMPDIR:-/tmp}/ddo-gpu-peer",
    );
    format!(
        r#"#!/usr/bin/env bash
# Runs DDO's GPU test binaries (built by `cargo xtask gpu-bundle`), one test at a time.
# Usage: ./run-all.sh [LOG_DIR]   (default: $OUT when set, else ./logs beside this script)
# Needs libcuda (the NVIDIA driver) where the dynamic loader finds it; see README.md, "GPU".
set -u
here="$(cd "$(dirname "$0")" && pwd)"
log_dir="${{1:-${{OUT:-$here/logs}}}}"
mkdir -p "$log_dir"
export DDO_REQUIRE_GPU=1
export RUST_BACKTRACE=1
# The committed fixtures: the checkout this bundle sits in, unless named.
if [ -z "${{DDO_FIXTURES:-}}" ] && [ -d "$here/../fixtures" ]; then
  export DDO_FIXTURES="$(cd "$here/../fixtures" && pwd)"
fi
# The binaries travel xz-compressed: each unpacked once, beside its .xz.
for packed in "$here"/*.xz; do
  [ -e "$packed" ] || continue
  bin="${{packed%.xz}}"
  [ -x "$bin" ] || {{ xz -dc "$packed" > "$bin.tmp" && chmod +x "$bin.tmp" && mv "$bin.tmp" "$bin"; }} || exit 1
done
{peer}
# The `ddo` binary the command's GPU tests run.
if [ -x "$here/ddo" ]; then
  export DDO_BIN="$here/ddo"
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>&1 | tee "$log_dir/nvidia-smi.log"
fi
failed=()
for bin in {list}; do
  echo "=== $bin"
  "$here/$bin" --test-threads=1 --nocapture 2>&1 | tee "$log_dir/$bin.log"
  rc=${{PIPESTATUS[0]}}
  if [ "$rc" -ne 0 ]; then
    echo "=== $bin FAILED (exit $rc)"
    failed+=("$bin")
  fi
done
if [ "${{#failed[@]}}" -ne 0 ]; then
  echo "=== failed: ${{failed[*]}}"
  exit 1
fi
echo "=== all passed: {list}"
"#
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_test_executables_in_cargo_json() {
        let lines = [
            r#"{"reason":"compiler-artifact","package_id":"x","target":{"name":"cudarc","kind":["lib"]},"profile":{"opt_level":"3","test":false},"executable":null,"fresh":true}"#,
            r#"{"reason":"compiler-artifact","target":{"name":"gpu","kind":["test"]},"profile":{"opt_level":"3","test":true},"filenames":["/w/target/release/deps/gpu-0a1b"],"executable":"/w/target/release/deps/gpu-0a1b","fresh":false}"#,
            r#"{"reason":"compiler-artifact","target":{"name":"ddo_cuda","kind":["lib"]},"profile":{"test":true},"executable":"/w/tar\"get/release/deps/ddo_cuda-99ff","fresh":true}"#,
            r#"{"reason":"build-finished","success":true}"#,
        ]
        .join("\n");
        let exes = test_executables(&lines);
        assert_eq!(
            exes,
            vec![
                PathBuf::from("/w/tar\"get/release/deps/ddo_cuda-99ff"),
                PathBuf::from("/w/target/release/deps/gpu-0a1b"),
            ]
        );
        assert_eq!(bundle_name(&exes[1]), "gpu");
        let build = r#"{"reason":"compiler-artifact","target":{"kind":["bin"],"crate_types":["bin"],"name":"ddo","src_path":"/w/crates/ddo-cli/src/main.rs"},"profile":{"test":false},"executable":"/w/target/release/ddo","fresh":true}"#;
        assert_eq!(
            binary_executable(&format!("{lines}\n{build}")),
            Some(PathBuf::from("/w/target/release/ddo"))
        );
        assert_eq!(binary_executable(&lines), None);
        assert_eq!(bundle_name(Path::new("plain")), "plain");
        // A bin built for integration tests: its target says "test":true, its profile not.
        let bin = r#"{"reason":"compiler-artifact","target":{"name":"ddo","kind":["bin"],"doctest":false,"test":true},"profile":{"opt_level":"3","test":false},"executable":"/w/target/release/ddo","fresh":true}"#;
        assert_eq!(test_executables(&format!("{lines}\n{bin}")), exes);
    }

    #[test]
    fn the_runner_runs_each_binary_serially_and_fails_when_one_fails() {
        let script = run_all_script(&["ddo_cuda".into(), "gpu".into()]);
        assert!(script.starts_with("#!/usr/bin/env bash"));
        assert!(script.contains("for bin in ddo_cuda gpu; do"));
        assert!(script.contains("--test-threads=1"));
        assert!(script.contains("PIPESTATUS[0]"));
        assert!(script.contains("exit 1"));
        assert!(script.contains("DDO_REQUIRE_GPU=1"));
        assert!(script.contains(r#"export DDO_BIN="$here/ddo""#));
        // The tests that read the environment get it: fixtures, and Diffusers' outputs.
        assert!(script.contains("export DDO_FIXTURES="));
        assert!(script.contains(r#"export DDO_PEER_DIR="${TMPDIR:-/tmp}/ddo-gpu-peer/peer""#));
        assert!(script.contains(r#"python3 "$here/gpu_peer.py""#));
        // Before the first binary runs.
        assert!(script.find("DDO_PEER_DIR=").unwrap() < script.find("for bin in").unwrap());
        // The compressed binaries are unpacked first.
        let unpack = script.find(r#"xz -dc "$packed""#).unwrap();
        assert!(unpack < script.find("DDO_BIN=").unwrap());
        assert!(unpack < script.find("for bin in").unwrap());
    }

    #[test]
    fn clearing_the_bundle_keeps_the_bench_bundles() {
        // A folder of this test's own (xtask has no dependencies, tempfile neither).
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let root =
            std::env::temp_dir().join(format!("xtask-bundle-test-{}-{nanos}", std::process::id()));
        let b = root.join("gpu-bundle");
        fs::create_dir_all(b.join("bench-gguf")).unwrap();
        fs::write(b.join("bench-gguf/ddo.xz"), b"x").unwrap();
        fs::create_dir_all(b.join("logs")).unwrap();
        fs::write(b.join("gpu.xz"), b"x").unwrap();
        fs::write(b.join("run-all.sh"), b"x").unwrap();
        clear_keeping_bench_bundles(&b).unwrap();
        let left: Vec<String> = fs::read_dir(&b)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left, ["bench-gguf"]);
        assert!(b.join("bench-gguf/ddo.xz").exists());
        // A missing folder is made.
        let fresh = root.join("new");
        clear_keeping_bench_bundles(&fresh).unwrap();
        assert!(fresh.is_dir());
        fs::remove_dir_all(&root).unwrap();
    }
}
