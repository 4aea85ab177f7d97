//! `cargo xtask bench --peer diffusers --full`: DDO against Diffusers on the full FLUX.1-dev
//! config (random bf16 weights) in one job on one GPU — the transformer step and the whole
//! pipeline.
//!
//! The GPU machine has no Rust toolchain and no network, so this task builds here, into
//! `gpu-bundle/bench-full/` (ignored by git), everything the job needs:
//!
//! - `ddo`, the command, in release;
//! - `peer_pipeline.py` (Diffusers' side; with `gpu_peer.py` and `bench_peer.py`, whose model
//!   configs and measurements it reuses) and `bench_full_report.py` (the report, standard
//!   library only);
//! - `wheels/`: Diffusers 0.42.1 and importlib_metadata (from `--wheels DIR`, else
//!   `$DDO_WHEELS`, else `wheels/` at the root, else `../shared/wheels`);
//! - `pywheels/`: what `diffusers.FluxPipeline` needs beyond PyTorch's image ([`FALLBACK_WHEELS`]:
//!   transformers and its pure dependencies, for CPython 3.12 on x86-64), fetched once with
//!   `pip download` into `target/bench-full-wheels/`, with `pywheels/MODULES` naming each
//!   wheel's import; the job installs the ones whose module is missing, and only when
//!   `transformers` does not import;
//! - `run-bench-full.sh` ([`run_full_script`]), which runs the parts one after another, never
//!   two at once (each holds tens of GiB of host memory), each under `timeout` so that one that
//!   fails or runs out of time leaves the others' results, the whole job within
//!   `DDO_JOB_SECONDS` (570 s by default):
//!   1. `ddo bench --config flux-dev --component transformer`: resident, leaf + stream (zero
//!      budget), block + stream, leaf + stream with `budget=10GiB`, and `--preset auto` under
//!      `--vram-budget 12GiB`, with the link bandwidth it measures;
//!   2. `ddo run --config flux-dev --vram-budget 12GiB --steps 28 --json` (phases, setup, peaks,
//!      per-component counters), under `/usr/bin/time -v` for its peak RSS;
//!   3. `peer_pipeline.py step`: Diffusers' transformer step, resident, leaf + stream and block +
//!      stream group offload;
//!   4. `peer_pipeline.py pipeline`: `diffusers.FluxPipeline` under the same 12 GiB budget, its
//!      text encoders running, each phase timed;
//!   5. `bench_full_report.py`: `bench_full.json` and `bench_full.md`.
//!
//! The bundle must stay under [`MAX_BUNDLE_BYTES`] (it travels with the working tree).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::gpu::make_executable;
use crate::{run, workspace_root};

/// The full bench bundle's folder, relative to the workspace root (ignored by git).
pub const FULL_DIR: &str = "gpu-bundle/bench-full";

/// The most the bundle may weigh: a GPU job carries 64 MiB, the working tree (about 22 MiB,
/// most of it fixtures) included.
pub const MAX_BUNDLE_BYTES: u64 = 40 << 20;

/// The line each job's script runs first (after `here=`): the bundle's `ddo` travels
/// xz-compressed (`ddo.xz`, about a quarter of its 17 MiB) and is unpacked beside it once.
pub const UNPACK_DDO: &str = r#"[ -x "$here/ddo" ] || { xz -dc "$here/ddo.xz" > "$here/ddo.tmp" && chmod +x "$here/ddo.tmp" && mv "$here/ddo.tmp" "$here/ddo"; }"#;

/// `script` with [`UNPACK_DDO`] after its `here=` line (unchanged without one).
pub fn with_unpack(script: &str) -> String {
    const HERE: &str = "here=\"$(cd \"$(dirname \"$0\")\" && pwd)\"\n";
    script.replacen(HERE, &format!("{HERE}{UNPACK_DDO}\n"), 1)
}

/// Python files the job needs, from `tools/`.
const SCRIPTS: [&str; 4] = [
    "gpu_peer.py",
    "bench_peer.py",
    "peer_pipeline.py",
    "bench_full_report.py",
];

/// A wheel carried for a GPU machine whose Python lacks it.
#[derive(Debug, Clone, Copy)]
pub struct PyWheel {
    /// Distribution name on the package index.
    pub dist: &'static str,
    /// Exact version.
    pub version: &'static str,
    /// The module `import` checks.
    pub module: &'static str,
}

const fn wheel(dist: &'static str, version: &'static str, module: &'static str) -> PyWheel {
    PyWheel {
        dist,
        version,
        module,
    }
}

/// What `diffusers.FluxPipeline` (CLIPTextModel, T5EncoderModel) and group offloading import
/// beyond what Diffusers' own wheels and PyTorch's image bring: transformers 5.17.0 (the
/// image's; it takes huggingface_hub below 2, which Diffusers 0.42.1 wants at 1.32 or later)
/// and its runtime dependencies, accelerate (group offloading's `send_to_device`). The GPU
/// image had all of these when last read; they are carried in case it does not.
pub const FALLBACK_WHEELS: [PyWheel; 11] = [
    wheel("transformers", "5.17.0", "transformers"),
    wheel("tokenizers", "0.23.2", "tokenizers"),
    wheel("huggingface_hub", "1.33.0", "huggingface_hub"),
    wheel("safetensors", "0.8.0", "safetensors"),
    wheel("accelerate", "1.15.0", "accelerate"),
    wheel("regex", "2026.11.19", "regex"),
    wheel("pyyaml", "6.0.3", "yaml"),
    wheel("tqdm", "4.70.1", "tqdm"),
    wheel("packaging", "26.4", "packaging"),
    wheel("filelock", "4.3.1", "filelock"),
    // `bench --compute`'s fp8 anchor (issue 39); abi3, any CPython from 3.10.
    wheel("torchao", "0.18.0", "torchao"),
];

/// What `--full` was given.
#[derive(Debug, Clone, Default)]
pub struct FullOptions {
    /// Route options added to DDO's streamed candidates (the script's default for `$1`).
    pub route_options: String,
    /// The folder with the Diffusers wheels.
    pub wheels: Option<PathBuf>,
    /// Also run the script here.
    pub run_here: bool,
}

/// Builds `gpu-bundle/bench-full/` (and runs it with `run_here`).
pub fn bench_full(opts: &FullOptions) -> Result<(), String> {
    let root = workspace_root();
    let (script, size) = build_bundle(
        &root,
        FULL_DIR,
        opts.wheels.as_deref(),
        &SCRIPTS,
        "run-bench-full.sh",
        &run_full_script(&opts.route_options),
    )?;
    let dir = root.join(FULL_DIR);
    eprintln!(
        "bench: {} ready ({:.1} MiB); on the GPU machine, from the repository root, carrying {FULL_DIR}: \
         ./{FULL_DIR}/run-bench-full.sh [ROUTE_OPTIONS]   (results in $OUT, else ./bench-full-out)",
        dir.display(),
        size as f64 / (1 << 20) as f64
    );
    if opts.run_here {
        run(&mut Command::new(&script))?;
    }
    Ok(())
}

/// Builds a GPU job's bundle in `dir_rel` (cleared first): the release `ddo`, `scripts` from
/// `tools/`, the Diffusers wheels (`wheels/`, from [`wheels_dir`]), the fallback wheels
/// (`pywheels/` with `MODULES`), and the job's `script_name` holding `script_text`, checked by
/// `bash -n`. Everything that can be refused without building is checked first. Returns the
/// script's path and the bundle's bytes (at most [`MAX_BUNDLE_BYTES`]).
pub(super) fn build_bundle(
    root: &Path,
    dir_rel: &str,
    wheels: Option<&Path>,
    scripts: &[&str],
    script_name: &str,
    script_text: &str,
) -> Result<(PathBuf, u64), String> {
    assemble(
        root,
        dir_rel,
        Some(wheels),
        scripts,
        script_name,
        script_text,
    )
}

/// [`build_bundle`] without any wheels, for a job that needs no Python package beyond what the
/// GPU machine has (a few MiB: it travels beside another bundle).
pub(super) fn build_lean_bundle(
    root: &Path,
    dir_rel: &str,
    scripts: &[&str],
    script_name: &str,
    script_text: &str,
) -> Result<(PathBuf, u64), String> {
    assemble(root, dir_rel, None, scripts, script_name, script_text)
}

/// [`build_bundle`] with the wheels (from `Some(folder)`, see [`wheels_dir`]) or without them
/// (`None`).
fn assemble(
    root: &Path,
    dir_rel: &str,
    wheels: Option<Option<&Path>>,
    scripts: &[&str],
    script_name: &str,
    script_text: &str,
) -> Result<(PathBuf, u64), String> {
    let diffusers = match wheels {
        Some(w) => diffusers_wheels(&wheels_dir(root, w))?,
        None => Vec::new(),
    };
    let (exe, target) = super::build_release(root, "--bin", "ddo", "release/ddo")?;
    let fallback = match wheels {
        Some(_) => fallback_wheels(&target.join("bench-full-wheels"))?,
        None => Vec::new(),
    };
    let dir = root.join(dir_rel);
    if dir.exists() {
        fs::remove_dir_all(&dir).map_err(|e| format!("cannot clear {}: {e}", dir.display()))?;
    }
    fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    copy(&exe, &dir.join("ddo"))?;
    run(Command::new("xz")
        .args(["-T2", "-6", "-f"])
        .arg(dir.join("ddo")))?;
    for s in scripts {
        copy(&root.join("tools").join(s), &dir.join(s))?;
    }
    if wheels.is_some() {
        for sub in ["wheels", "pywheels"] {
            let d = dir.join(sub);
            fs::create_dir_all(&d).map_err(|e| format!("cannot create {}: {e}", d.display()))?;
        }
        for w in &diffusers {
            copy(w, &dir.join("wheels").join(file_name(w)))?;
        }
        let mut modules = String::new();
        for (path, w) in &fallback {
            copy(path, &dir.join("pywheels").join(file_name(path)))?;
            modules += &format!("{} {}\n", file_name(path), w.module);
        }
        write(&dir.join("pywheels/MODULES"), &modules)?;
    }
    let script = dir.join(script_name);
    write(&script, &with_unpack(script_text))?;
    make_executable(&script)?;
    run(Command::new("bash").arg("-n").arg(&script))?;
    let size = dir_bytes(&dir);
    check_size(size)?;
    Ok((script, size))
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn copy(from: &Path, to: &Path) -> Result<(), String> {
    fs::copy(from, to)
        .map(|_| ())
        .map_err(|e| format!("cannot copy {} to {}: {e}", from.display(), to.display()))
}

fn write(path: &Path, text: &str) -> Result<(), String> {
    fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// Where the Diffusers wheels are: `--wheels`, else `$DDO_WHEELS`, else `wheels/` at the root
/// when it holds a Diffusers wheel, else `../shared/wheels`.
fn wheels_dir(root: &Path, given: Option<&Path>) -> PathBuf {
    if let Some(d) = given {
        return d.to_path_buf();
    }
    if let Some(d) = std::env::var_os("DDO_WHEELS") {
        return PathBuf::from(d);
    }
    let local = root.join("wheels");
    if diffusers_wheels(&local).is_ok() {
        return local;
    }
    root.join("../shared/wheels")
}

/// The Diffusers and importlib_metadata wheels in `dir`; an error unless a Diffusers one is there.
pub fn diffusers_wheels(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let entries = fs::read_dir(dir).map_err(|e| {
        format!(
            "cannot read the Diffusers wheels folder {}: {e}; give --wheels DIR (Diffusers 0.42.1 wheels, as in ../shared/wheels)",
            dir.display()
        )
    })?;
    let mut out: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let n = file_name(p);
            n.ends_with(".whl")
                && (n.starts_with("diffusers-") || n.starts_with("importlib_metadata-"))
        })
        .collect();
    out.sort();
    if !out.iter().any(|p| file_name(p).starts_with("diffusers-")) {
        return Err(format!(
            "no diffusers-*.whl in {}; give --wheels DIR (Diffusers 0.42.1 wheels, as in ../shared/wheels)",
            dir.display()
        ));
    }
    Ok(out)
}

/// The cached wheel of `w` among `names`: its normalised name and version, then a tag.
fn cached<'a>(names: &'a [String], w: &PyWheel) -> Option<&'a String> {
    let prefix = format!("{}-{}-", w.dist.replace('-', "_"), w.version).to_lowercase();
    names
        .iter()
        .find(|n| n.to_lowercase().starts_with(&prefix) && wheel_fits(n))
}

/// Whether a wheel's tags install on the GPU machine: CPython 3.12 on x86-64 Linux.
pub fn wheel_fits(name: &str) -> bool {
    let Some(stem) = name.strip_suffix(".whl") else {
        return false;
    };
    let tags: Vec<&str> = stem.rsplitn(4, '-').take(3).collect();
    let [platform, abi, python] = tags[..] else {
        return false;
    };
    let python_ok = python
        .split('.')
        .any(|t| t == "py3" || t == "cp312" || (t.starts_with("cp3") && abi == "abi3"));
    let abi_ok = abi
        .split('.')
        .any(|t| t == "none" || t == "abi3" || t == "cp312");
    let platform_ok = platform.split('.').any(|t| {
        t == "any"
            || (t.ends_with("_x86_64") && (t.starts_with("manylinux") || t.starts_with("linux")))
    });
    python_ok && abi_ok && platform_ok
}

/// The wheels of [`FALLBACK_WHEELS`] in `cache`, downloading with pip the ones it lacks.
fn fallback_wheels(cache: &Path) -> Result<Vec<(PathBuf, PyWheel)>, String> {
    fs::create_dir_all(cache).map_err(|e| format!("cannot create {}: {e}", cache.display()))?;
    let list = |dir: &Path| -> Vec<String> {
        fs::read_dir(dir)
            .map(|rd| rd.flatten().map(|e| file_name(&e.path())).collect())
            .unwrap_or_default()
    };
    let names = list(cache);
    let missing: Vec<String> = FALLBACK_WHEELS
        .iter()
        .filter(|w| cached(&names, w).is_none())
        .map(|w| format!("{}=={}", w.dist, w.version))
        .collect();
    if !missing.is_empty() {
        let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
        run(Command::new(python)
            .args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:"])
            .args(["--python-version", "3.12", "--implementation", "cp"])
            .args(["--platform", "manylinux_2_28_x86_64"])
            .args(["--platform", "manylinux_2_17_x86_64"])
            .args(["--platform", "manylinux2014_x86_64"])
            .arg("-d")
            .arg(cache)
            .args(&missing))
        .map_err(|e| {
            format!("{e}; the job carries transformers and its dependencies as wheels: this needs PyPI once (then {} keeps them)", cache.display())
        })?;
    }
    let names = list(cache);
    FALLBACK_WHEELS
        .iter()
        .map(|w| match cached(&names, w) {
            Some(n) => Ok((cache.join(n), *w)),
            None => Err(format!(
                "pip left no CPython 3.12 x86-64 wheel of {}=={} in {}",
                w.dist,
                w.version,
                cache.display()
            )),
        })
        .collect()
}

/// Says where `flag`'s bundle is (`dir`, `rel` from the workspace root, `size` bytes) and how
/// to run `script_name` on the GPU machine, then runs `script` here with `run_here`.
pub(super) fn announce(
    flag: &str,
    (dir, rel, size): (&Path, &str, u64),
    (script_name, script): (&str, &Path),
    run_here: bool,
) -> Result<(), String> {
    eprintln!(
        "bench {flag}: {} ({} MiB); on the GPU machine: ./{rel}/{script_name} (results in $OUT)",
        dir.display(),
        size >> 20
    );
    if run_here {
        run(Command::new("bash").arg(script))?;
    }
    Ok(())
}

pub(super) fn dir_bytes(dir: &Path) -> u64 {
    fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| {
                    let p = e.path();
                    if p.is_dir() {
                        dir_bytes(&p)
                    } else {
                        e.metadata().map(|m| m.len()).unwrap_or(0)
                    }
                })
                .sum()
        })
        .unwrap_or(0)
}

/// Refuses a bundle over [`MAX_BUNDLE_BYTES`].
pub fn check_size(bytes: u64) -> Result<(), String> {
    if bytes > MAX_BUNDLE_BYTES {
        return Err(format!(
            "the bundle is {:.1} MiB, over its {} MiB: it travels with the working tree",
            bytes as f64 / (1 << 20) as f64,
            MAX_BUNDLE_BYTES >> 20
        ));
    }
    Ok(())
}

/// The job's script. `default_options` are added to DDO's streamed transformer candidates
/// when the script is run without an argument.
pub fn run_full_script(default_options: &str) -> String {
    format!(
        r#"#!/usr/bin/env bash
# DDO vs Diffusers 0.42.1 on the full FLUX.1-dev config (random bf16 weights), in one job on
# one GPU (built by `cargo xtask bench --peer diffusers --full`). Run from the repository root,
# carrying gpu-bundle/bench-full (the ddo binary, the scripts and the wheels; no network needed).
# Usage: ./gpu-bundle/bench-full/run-bench-full.sh [ROUTE_OPTIONS]   e.g. ring_slots=3
#   ROUTE_OPTIONS are added to DDO's streamed transformer candidates.
# The parts run one after another, never two at once (each holds tens of GiB of host memory),
# each under `timeout`, so one that fails or runs out of time leaves the others' results:
#   ddo_bench      ddo bench: the transformer step, resident / leaf+stream / block+stream /
#                  budget=10GiB / --preset auto under --vram-budget 12GiB
#   ddo_run        ddo run: the whole pipeline, 28 steps, --vram-budget 12GiB
#   peer_step      Diffusers: the transformer step, resident / torch.compile (default mode;
#                  compile_seconds apart; run when the part has 200 s left) / leaf+stream /
#                  block+stream (DDO_STEP_CASES lists the cases to run)
#   peer_pipeline  Diffusers: FluxPipeline under a 12 GiB device budget
# then the report. The job keeps to DDO_JOB_SECONDS (default 570) in all: each part gets its own
# limit (DDO_T_BENCH 150, DDO_T_RUN 110, DDO_T_STEP 130, DDO_T_PIPELINE 200 s; 0 skips the part)
# or what is left less 20 s for the report, whichever is less, and is skipped with under 30 s
# left. Issue 39's resident job against torch.compile: DDO_T_RUN=0 DDO_T_PIPELINE=0
# DDO_T_STEP=400 DDO_STEP_CASES=resident,resident_compiled.
# Writes eight files to $OUT (default ./bench-full-out): ddo_bench.json, ddo_run.json, ddo.png,
# peer_step.json, peer_pipeline.json, logs.txt (every part's output and /usr/bin/time -v),
# bench_full.json and bench_full.md (the tables).
set -u
here="$(cd "$(dirname "$0")" && pwd)"
out="${{OUT:-$PWD/bench-full-out}}"
work="${{DDO_BENCH_WORK:-/tmp/ddo-bench-full}}"
site="$work/site"
extra="${{1:-{default_options}}}"
opts="${{extra:+,$extra}}"
deadline=$(( $(date +%s) + ${{DDO_JOB_SECONDS:-570}} ))
mkdir -p "$out" "$work"
rm -f "$work"/*.time "$work/parts.tsv" "$out/ddo_run.json"
log="$out/logs.txt"
: > "$log"
say() {{ echo "$*" | tee -a "$log"; }}

# part NAME SECONDS STDOUT COMMAND...: COMMAND under timeout (at most SECONDS, and what the job
# has left), its stdout appended to STDOUT, its stderr and /usr/bin/time -v to the log, its
# status to $work/parts.tsv; DDO_PART_SECONDS tells COMMAND its limit.
part() {{
  local name="$1" want="$2" dest="$3"
  shift 3
  local left=$(( deadline - $(date +%s) - 20 ))
  if [ "$want" -eq 0 ]; then
    say "=== $name skipped: asked for 0 s"
    printf '%s\tskipped\t0\t0\n' "$name" >> "$work/parts.tsv"
    return 0
  fi
  if [ "$left" -lt 30 ]; then
    say "=== $name skipped: ${{left}} s left"
    printf '%s\tskipped\t0\t0\n' "$name" >> "$work/parts.tsv"
    return 0
  fi
  local secs=$(( want < left ? want : left ))
  say "=== $name (timeout ${{secs}} s) at $(date +%T)"
  local t0 rc ms lines
  lines=$(wc -l < "$log")
  t0=$(date +%s%N)
  if [ -x /usr/bin/time ]; then
    DDO_PART_SECONDS="$secs" /usr/bin/time -v -o "$work/$name.time" \
      timeout -k 10 "$secs" "$@" >> "$dest" 2>> "$log"
  else
    DDO_PART_SECONDS="$secs" python3 "$here/bench_full_report.py" measure "$work/$name.time" \
      timeout -k 10 "$secs" "$@" >> "$dest" 2>> "$log"
  fi
  rc=$?
  ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  [ "$rc" -eq 0 ] || tail -n "+$(( lines + 1 ))" "$log" | tail -n 6 | sed 's/^/    /'
  cat "$work/$name.time" >> "$log" 2>/dev/null
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$ms" "$secs" >> "$work/parts.tsv"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    say "=== $name: timed out after $(( ms / 1000 )) s (exit $rc)"
  else
    say "=== $name: exit $rc after $(( ms / 1000 )) s"
  fi
  free -g 2>/dev/null | head -n 2 >> "$log"
  return 0
}}

if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>&1 | tee -a "$log"
fi
say "=== Python packages"
python3 -m pip install -q --no-index --no-deps --upgrade --target "$site" "$here"/wheels/*.whl >> "$log" 2>&1 \
  || say "=== the Diffusers wheels did not install (see logs.txt)"
export PYTHONPATH="$site${{PYTHONPATH:+:$PYTHONPATH}}" PYTHONUNBUFFERED=1 RUST_BACKTRACE=1
encoders() {{ python3 -c "from transformers import CLIPTextModel, T5EncoderModel" >> "$log" 2>&1; }}
if ! encoders; then
  missing=()
  while read -r wheel module; do
    python3 -c "import $module" >/dev/null 2>&1 || missing+=("$here/pywheels/$wheel")
  done < "$here/pywheels/MODULES"
  say "=== transformers does not import: installing ${{#missing[@]}} of the carried wheels"
  if [ "${{#missing[@]}}" -gt 0 ]; then
    python3 -m pip install -q --no-index --no-deps --upgrade --target "$site" "${{missing[@]}}" >> "$log" 2>&1
  fi
  if ! encoders; then
    say "=== transformers still does not import: installing every carried wheel over the image's"
    python3 -m pip install -q --no-index --no-deps --upgrade --target "$site" "$here"/pywheels/*.whl >> "$log" 2>&1
  fi
fi
python3 -c "import torch, diffusers, transformers; print('torch', torch.__version__, 'diffusers', diffusers.__version__, 'transformers', transformers.__version__)" 2>&1 | tee -a "$log"

part ddo_bench "${{DDO_T_BENCH:-150}}" "$log" "$here/ddo" bench --config flux-dev --device cuda:0 \
  --component transformer --vram-budget 12GiB --warmup 2 --repeats 5 \
  --route none \
  --route "diffusers_group_offload:offload_type=leaf_level,use_stream=true$opts" \
  --route "diffusers_group_offload:offload_type=block_level,num_blocks_per_group=1,use_stream=true$opts" \
  --route "diffusers_group_offload:offload_type=leaf_level,use_stream=true,budget=10GiB$opts" \
  --preset auto --out-json "$out/ddo_bench.json"
part ddo_run "${{DDO_T_RUN:-110}}" "$out/ddo_run.json" "$here/ddo" run --config flux-dev --device cuda:0 \
  --vram-budget 12GiB --steps 28 --json --no-env --out "$out/ddo.png"
part peer_step "${{DDO_T_STEP:-130}}" "$log" python3 "$here/peer_pipeline.py" step "$out/peer_step.json" \
  --cases "${{DDO_STEP_CASES:-resident,resident_compiled,leaf_stream,block_stream}}"
if encoders; then
  part peer_pipeline "${{DDO_T_PIPELINE:-200}}" "$log" python3 "$here/peer_pipeline.py" pipeline "$out/peer_pipeline.json"
else
  say "=== peer_pipeline skipped: transformers does not import (see logs.txt)"
  printf '%s\tskipped\t0\t0\n' peer_pipeline >> "$work/parts.tsv"
fi
say "=== report"
python3 "$here/bench_full_report.py" "$out" "$work" 2>&1 | tee -a "$log"
"#
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch folder of this test process, removed when dropped.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(name: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("ddo-xtask-{name}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn pos(s: &str, needle: &str) -> usize {
        s.find(needle)
            .unwrap_or_else(|| panic!("`{needle}` not in the script"))
    }

    #[test]
    fn the_full_script_runs_ddo_then_diffusers_one_part_at_a_time_and_reports() {
        let s = run_full_script("ring_slots=3");
        assert!(s.starts_with("#!/usr/bin/env bash"));
        let order = [
            "python3 -m pip install -q --no-index --no-deps --upgrade --target \"$site\" \"$here\"/wheels/*.whl",
            "part ddo_bench ",
            "part ddo_run ",
            "part peer_step ",
            "part peer_pipeline ",
            "bench_full_report.py\" \"$out\" \"$work\"",
        ];
        let at: Vec<usize> = order.iter().map(|n| pos(&s, n)).collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "{at:?}\n{s}");
        // Every part runs under timeout, whether /usr/bin/time is there or not.
        assert_eq!(s.matches("timeout -k 10 \"$secs\" \"$@\"").count(), 2);
        assert_eq!(
            s.lines()
                .filter(|l| l.trim_start().starts_with("part "))
                .count(),
            4
        );
        assert!(s.contains("extra=\"${1:-ring_slots=3}\""));
        assert!(s.contains("--route \"diffusers_group_offload:offload_type=leaf_level,use_stream=true,budget=10GiB$opts\""));
        assert!(s.contains("--preset auto --out-json \"$out/ddo_bench.json\""));
        assert!(s.contains(
            "run --config flux-dev --device cuda:0 \\\n  --vram-budget 12GiB --steps 28 --json"
        ));
        // The carried transformers wheels install only when transformers does not import.
        let check = pos(&s, "if ! encoders; then");
        assert!(check < pos(&s, "\"$here/pywheels/MODULES\""));
        assert!(
            !s.contains("set -e"),
            "one failing part must not end the job"
        );
    }

    #[test]
    fn the_full_script_is_valid_bash() {
        let dir = Scratch::new("bench-full-syntax");
        for options in ["", "unit_bytes=32MiB,ring_slots=3"] {
            let path = dir.0.join("run-bench-full.sh");
            fs::write(&path, run_full_script(options)).unwrap();
            let status = Command::new("bash").arg("-n").arg(&path).status();
            // bash is part of every machine this workspace builds on (.ci/run is bash).
            assert!(status.unwrap().success(), "{options}");
        }
    }

    /// Runs the script over stand-ins for `ddo` and `python3` that record their arguments: the
    /// parts run in order, a failing one leaves the rest, and a job out of time skips parts but
    /// still reports.
    fn run_with_stand_ins(dir: &Path, env: &[(&str, &str)]) -> (String, String) {
        let bundle = dir.join("bundle");
        let bin = dir.join("bin");
        for d in [
            &bundle,
            &bin,
            &bundle.join("wheels"),
            &bundle.join("pywheels"),
        ] {
            fs::create_dir_all(d).unwrap();
        }
        fs::write(
            bundle.join("pywheels/MODULES"),
            "transformers-5.17.0-py3-none-any.whl transformers\n",
        )
        .unwrap();
        let record = dir.join("calls.txt");
        let stand_in = |path: &Path, body: &str| {
            fs::write(
                path,
                format!(
                    "#!/usr/bin/env bash\necho \"$(basename \"$0\") $*\" >> '{}'\n{body}",
                    record.display()
                ),
            )
            .unwrap();
            make_executable(path).unwrap();
        };
        // `ddo bench` fails; `ddo run` prints its JSON.
        stand_in(
            &bundle.join("ddo"),
            "[ \"$1\" = run ] && echo '{}' && exit 0\nexit 3\n",
        );
        // python3: `measure` runs the command; everything else succeeds.
        stand_in(
            &bin.join("python3"),
            "if [ \"$2\" = measure ]; then shift 3; exec \"$@\"; fi\nexit 0\n",
        );
        let script = bundle.join("run-bench-full.sh");
        fs::write(&script, run_full_script("")).unwrap();
        make_executable(&script).unwrap();
        let path = format!(
            "{}:{}",
            bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let out = dir.join("out");
        let mut cmd = Command::new("bash");
        cmd.arg(&script)
            .env("PATH", path)
            .env("OUT", &out)
            .env("DDO_BENCH_WORK", dir.join("work"));
        for (k, v) in env {
            cmd.env(k, v);
        }
        let output = cmd.output().unwrap();
        assert!(output.status.success(), "{output:?}");
        let calls = fs::read_to_string(&record).unwrap_or_default();
        let parts = fs::read_to_string(dir.join("work/parts.tsv")).unwrap_or_default();
        (calls, parts)
    }

    #[test]
    fn a_failing_part_leaves_the_others_and_the_report() {
        let dir = Scratch::new("bench-full-run");
        let (calls, parts) = run_with_stand_ins(&dir.0, &[]);
        let order = [
            "ddo bench --config flux-dev",
            "ddo run --config flux-dev",
            "peer_pipeline.py step",
            "peer_pipeline.py pipeline",
        ];
        let at: Vec<usize> = order.iter().map(|n| pos(&calls, n)).collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "{calls}");
        let last = calls.lines().last().unwrap_or_default();
        assert!(
            last.contains("bench_full_report.py") && !last.contains("measure"),
            "{calls}"
        );
        let rows: Vec<Vec<&str>> = parts.lines().map(|l| l.split('\t').collect()).collect();
        let names: Vec<&str> = rows.iter().map(|r| r[0]).collect();
        assert_eq!(
            names,
            ["ddo_bench", "ddo_run", "peer_step", "peer_pipeline"]
        );
        let status: Vec<&str> = rows.iter().map(|r| r[1]).collect();
        assert_eq!(status, ["3", "0", "0", "0"], "{parts}");
        let limits: Vec<&str> = rows.iter().map(|r| r[3]).collect();
        assert_eq!(limits, ["150", "110", "130", "200"], "{parts}");
        assert_eq!(
            fs::read_to_string(dir.0.join("out/ddo_run.json"))
                .unwrap()
                .trim(),
            "{}"
        );
    }

    #[test]
    fn a_job_out_of_time_skips_its_parts_but_reports() {
        let dir = Scratch::new("bench-full-late");
        let (calls, parts) = run_with_stand_ins(&dir.0, &[("DDO_JOB_SECONDS", "40")]);
        assert!(!calls.contains("ddo bench"), "{calls}");
        assert!(calls.contains("bench_full_report.py"), "{calls}");
        assert_eq!(parts.matches("\tskipped\t").count(), 4, "{parts}");
    }

    #[test]
    fn wheel_tags_are_checked_for_cpython_3_12_on_x86_64() {
        for ok in [
            "transformers-5.17.0-py3-none-any.whl",
            "tokenizers-0.23.2-cp39-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
            "PyYAML-6.0.3-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl",
        ] {
            assert!(wheel_fits(ok), "{ok}");
        }
        for bad in [
            "PyYAML-6.0.3-cp311-cp311-manylinux2014_x86_64.whl",
            "regex-2026.11.19-cp312-cp312-manylinux2014_aarch64.whl",
            "tokenizers-0.23.2-cp39-abi3-macosx_11_0_arm64.whl",
            "transformers-5.17.0.tar.gz",
        ] {
            assert!(!wheel_fits(bad), "{bad}");
        }
        let names = vec![
            "PyYAML-6.0.3-cp312-cp312-manylinux2014_x86_64.whl".to_string(),
            "huggingface_hub-1.33.0-py3-none-any.whl".to_string(),
        ];
        let yaml = FALLBACK_WHEELS.iter().find(|w| w.module == "yaml").unwrap();
        assert_eq!(cached(&names, yaml), Some(&names[0]));
        let hub = FALLBACK_WHEELS
            .iter()
            .find(|w| w.module == "huggingface_hub")
            .unwrap();
        assert_eq!(cached(&names, hub), Some(&names[1]));
        let tok = FALLBACK_WHEELS
            .iter()
            .find(|w| w.module == "tokenizers")
            .unwrap();
        assert_eq!(cached(&names, tok), None);
    }

    #[test]
    fn fallback_wheels_are_listed_once_each() {
        for (i, a) in FALLBACK_WHEELS.iter().enumerate() {
            assert!(
                FALLBACK_WHEELS[i + 1..]
                    .iter()
                    .all(|b| b.dist != a.dist && b.module != a.module),
                "{a:?}"
            );
        }
    }

    #[test]
    fn the_diffusers_wheels_and_the_bundle_size_are_checked() {
        let dir = Scratch::new("bench-full-wheels");
        assert!(
            diffusers_wheels(&dir.0.join("absent"))
                .unwrap_err()
                .contains("--wheels DIR")
        );
        assert!(
            diffusers_wheels(&dir.0)
                .unwrap_err()
                .contains("no diffusers-*.whl")
        );
        for n in [
            "diffusers-0.42.1-py3-none-any.whl",
            "importlib_metadata-10.2.0-py3-none-any.whl",
            "other-1-py3-none-any.whl",
        ] {
            fs::write(dir.0.join(n), b"").unwrap();
        }
        let found: Vec<String> = diffusers_wheels(&dir.0)
            .unwrap()
            .iter()
            .map(|p| file_name(p))
            .collect();
        assert_eq!(
            found,
            [
                "diffusers-0.42.1-py3-none-any.whl",
                "importlib_metadata-10.2.0-py3-none-any.whl"
            ]
        );
        assert!(check_size(MAX_BUNDLE_BYTES).is_ok());
        assert!(
            check_size(MAX_BUNDLE_BYTES + 1)
                .unwrap_err()
                .contains("over its 40 MiB")
        );
    }

    /// Each job's script unpacks the compressed `ddo` right after it knows its folder,
    /// before anything runs it; a script without that line is left as it is.
    #[test]
    fn the_scripts_unpack_ddo_before_they_run_it() {
        for script in [
            super::super::serve::SCRIPT,
            super::super::compute::SCRIPT,
            &run_full_script(""),
            &super::super::host_ram::host_ram_script(&[32], 4),
        ] {
            let s = with_unpack(script);
            let at = s.find(UNPACK_DDO).expect("the unpack line");
            assert!(s[..at].ends_with("pwd)\"\n"), "right after here=");
            assert!(!s[..at].contains("$here/ddo\""), "ddo runs after it");
        }
        assert_eq!(with_unpack("echo hi\n"), "echo hi\n");
    }
}
