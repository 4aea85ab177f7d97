//! DDO's task runner: `cargo xtask <task>`, for everything beyond `cargo build` and
//! `cargo test`. No dependencies beyond std, so it builds in seconds.
//!
//! Tasks:
//! - `ci`: what `.ci/run` does — format check, clippy with warnings denied, the tests,
//!   and `tidy`.
//! - `tidy`: the workspace's architecture invariants and code habits (see [`tidy`]).
//! - `test-gpu`: the CUDA backend's tests, on this machine's GPU (see [`gpu`]).
//! - `fuzz`: the cargo-fuzz targets in `fuzz/` for a while each (see [`fuzz`]).
//! - `soak`: 1,000 attach/forward/phase/remove cycles over every route (see [`soak`]).
//! - `gpu-bundle`: those tests built in release into `gpu-bundle/` with `run-all.sh`, for a
//!   GPU machine without a toolchain (see [`gpu`]).
//! - `bench --peer diffusers [--full]`: the streaming benchmark against Diffusers on the
//!   same weights, built into `gpu-bundle/bench/` with `run-bench.sh`; `--full`: the
//!   FLUX.1-dev transformer and whole pipeline, into `gpu-bundle/bench-full/` (see [`mod@bench`]).

mod bench;
mod fuzz;
mod gpu;
mod soak;
mod tidy;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn run(cmd: &mut Command) -> Result<(), String> {
    eprintln!("$ {cmd:?}");
    let status = cmd
        .current_dir(workspace_root())
        .status()
        .map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?} failed with {status}"))
    }
}

pub(crate) fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string()))
}

fn tidy_task() -> Result<(), String> {
    let problems = tidy::check_all(&workspace_root());
    if problems.is_empty() {
        eprintln!("tidy: ok");
        Ok(())
    } else {
        for p in &problems {
            eprintln!("tidy: {p}");
        }
        Err(format!("tidy found {} problem(s)", problems.len()))
    }
}

fn ci() -> Result<(), String> {
    run(cargo().args(["fmt", "--all", "--", "--check"]))?;
    run(cargo().args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--locked",
        "--",
        "-D",
        "warnings",
    ]))?;
    run(cargo().args(["test", "--workspace", "--locked"]))?;
    tidy_task()
}

fn main() -> ExitCode {
    let task = std::env::args().nth(1).unwrap_or_default();
    let result = match task.as_str() {
        "ci" => ci(),
        "tidy" => tidy_task(),
        "test-gpu" => gpu::test_gpu(),
        "gpu-bundle" => gpu::bundle(),
        "bench" => bench::bench(&std::env::args().skip(2).collect::<Vec<_>>()),
        "fuzz" => fuzz::fuzz(&std::env::args().skip(2).collect::<Vec<_>>()),
        "soak" => soak::soak(&std::env::args().skip(2).collect::<Vec<_>>()),
        _ => Err(format!(
            "unknown task `{task}`; tasks: ci, tidy, test-gpu, gpu-bundle, bench, fuzz, soak"
        )),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}
