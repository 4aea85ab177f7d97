//! `cargo xtask bench --serve` (issue 38): `ddo serve` on a FLUX.1-dev Diffusers folder
//! (random bf16 weights, 33.7 GB) on the GPU, against `ddo run` with the same arguments in the
//! same job.
//!
//! Builds `gpu-bundle/bench-serve/` (ignored by git): the `ddo` binary, the scripts that write
//! the folder (`tools/save_random_pipeline.py` with `peer_pipeline.py`), the client
//! (`tools/bench_serve.py`, standard library only), the Diffusers wheels and the fallback
//! wheels, and `run-bench-serve.sh`, which on the GPU machine writes the folder once (the same
//! place as `--host-ram`'s, so one warm machine writes it once for both) and runs the client:
//! warm requests against their phases and PNG, many requests in a row with memory compared,
//! and eight concurrent clients against `ddo run`. Results: `$OUT/serve.json` and
//! `$OUT/serve.md`.

use super::full;
use crate::workspace_root;

/// The bundle's folder, relative to the workspace root (ignored by git).
pub const SERVE_DIR: &str = "gpu-bundle/bench-serve";

/// Builds the bundle, and runs it here with `run_here`.
pub fn bench_serve(run_here: bool) -> Result<(), String> {
    let root = workspace_root();
    let (script, size) = full::build_bundle(
        &root,
        SERVE_DIR,
        None,
        &super::host_ram::FOLDER_WRITER
            .into_iter()
            .chain(["bench_serve.py"])
            .collect::<Vec<_>>(),
        "run-bench-serve.sh",
        SCRIPT,
    )?;
    full::announce(
        "--serve",
        (&root.join(SERVE_DIR), SERVE_DIR, size),
        ("run-bench-serve.sh", &script),
        run_here,
    )
}

/// The job's script. `DDO_BIN` runs another `ddo`; `DDO_WARM_REQUESTS` and `DDO_MANY` set
/// how many warm requests and how many in a row (6 and 200); `DDO_SERVE_SECONDS` bounds the
/// whole job, the folder's writing included (the client gets what the folder left).
pub(super) const SCRIPT: &str = r#"#!/usr/bin/env bash
# ddo serve on a FLUX.1-dev Diffusers folder (issue 38), in one job (built by
# `cargo xtask bench --serve`). Run from the repository root, carrying gpu-bundle/bench-serve;
# results in $OUT (default ./bench-serve-out).
set -u
started=$(date +%s)
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-$PWD/bench-serve-out}"
work="${DDO_BENCH_WORK:-/tmp/ddo-host-ram}"
folder="${DDO_FOLDER:-$work/flux}"
site="$work/site"
mkdir -p "$out" "$work"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$out/gpu.txt" 2>&1
if [ ! -f "$folder/model_index.json" ]; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target "$site" "$here"/wheels/*.whl > "$out/pip.log" 2>&1
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  if ! python3 -c "from transformers import CLIPTextModel, T5EncoderModel" >> "$out/pip.log" 2>&1; then
    python3 -m pip install -q --no-index --no-deps --upgrade --target "$site" "$here"/pywheels/*.whl >> "$out/pip.log" 2>&1
  fi
  rm -rf "$work/qwen" "$work/qwen-coded"
  python3 "$here/save_random_pipeline.py" "$folder" > "$out/folder.json" || { echo "the folder could not be written"; exit 1; }
fi
# DDO_SERVE_SECONDS counts from the job's start: the client gets what writing the folder left.
if [ -n "${DDO_SERVE_SECONDS:-}" ]; then
  export DDO_SERVE_SECONDS=$(( DDO_SERVE_SECONDS - ($(date +%s) - started) ))
fi
PYTHONUNBUFFERED=1 python3 "$here/bench_serve.py" "$out" "$folder" "${DDO_BIN:-$here/ddo}" \
  "${DDO_WARM_REQUESTS:-6}" "${DDO_MANY:-200}"
# The client's scratch (LoRA files, images) stays behind; the rest in one archive too (a
# device job brings back at most 8 files: these are 7).
rm -rf "$out/work"
tar -czf "$work/results.tgz" -C "$out" . && mv "$work/results.tgz" "$out/results.tgz"
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_writes_the_folder_where_host_ram_does_and_runs_the_client() {
        assert!(SCRIPT.starts_with("#!/usr/bin/env bash"));
        let host_ram = crate::bench::host_ram::host_ram_script(&[8], 4);
        for shared in [
            r#"work="${DDO_BENCH_WORK:-/tmp/ddo-host-ram}""#,
            r#"site="$work/site""#,
        ] {
            assert!(
                SCRIPT.contains(shared) && host_ram.contains(shared),
                "{shared}"
            );
        }
        assert!(SCRIPT.contains(r#"folder="${DDO_FOLDER:-$work/flux}""#));
        let writer = SCRIPT.find("save_random_pipeline.py").unwrap();
        let client = SCRIPT
            .find("bench_serve.py\" \"$out\" \"$folder\"")
            .unwrap();
        assert!(writer < client);
        // The client's time is what the folder left of DDO_SERVE_SECONDS.
        let left = SCRIPT
            .find("DDO_SERVE_SECONDS - ($(date +%s) - started)")
            .unwrap();
        assert!(
            SCRIPT.find("started=$(date +%s)").unwrap() < writer && writer < left && left < client
        );
        let checked = std::process::Command::new("bash")
            .args(["-n", "-c", SCRIPT])
            .status()
            .unwrap();
        assert!(checked.success(), "bash -n refused the script");
    }
}
