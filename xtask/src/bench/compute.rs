//! `cargo xtask bench --compute` (issue 39): DDO's resident compute on the GPU in one job —
//! the FLUX.1-dev transformer step in bf16 and under `--compute fp8`, each against the compute
//! floor `ddo bench` measures, each with its profile (`--profile`: device time per op
//! class); PyTorch's `_scaled_mm` against bf16 at FLUX's linear shapes (`tools/fp8_peer.py`);
//! `--compute fp8`'s accuracy anchor (`tools/fp8_anchor.py`:
//! the fixture pipeline against TorchAO's float8 dynamic quantization); Diffusers' resident
//! step with and without `torch.compile` (`peer_pipeline.py step --cases
//! resident,resident_compiled`); and the 28-step pipeline under `--vram-budget 12GiB` in bf16
//! and under `--compute fp8`.
//!
//! Builds `gpu-bundle/bench-compute/` (ignored by git): the `ddo` binary, the scripts, the
//! Diffusers wheels and the fallback wheels (torchao among them), and `run-bench-compute.sh`.
//! The job reads `fixtures/flux_pipeline` from the working tree it runs in. Results in `$OUT`:
//! `bf16.json`, `fp8.json`, `anchor.json`, `peer_step.json`, `run_bf16.json`, `run_fp8.json`,
//! `gpu.txt`, `logs.txt`.

use super::full;
use crate::workspace_root;

/// The bundle's folder, relative to the workspace root (ignored by git).
pub const COMPUTE_DIR: &str = "gpu-bundle/bench-compute";

/// Builds the bundle, and runs it here with `run_here`.
pub fn bench_compute(run_here: bool) -> Result<(), String> {
    let root = workspace_root();
    let (script, size) = full::build_bundle(
        &root,
        COMPUTE_DIR,
        None,
        &[
            "fp8_anchor.py",
            "fp8_peer.py",
            "peer_pipeline.py",
            "gpu_peer.py",
            "bench_peer.py",
        ],
        "run-bench-compute.sh",
        SCRIPT,
    )?;
    full::announce(
        "--compute",
        (&root.join(COMPUTE_DIR), COMPUTE_DIR, size),
        ("run-bench-compute.sh", &script),
        run_here,
    )
}

/// The job's script: each part under `timeout`, in order of what issue 39 needs first, the
/// whole within `DDO_JOB_SECONDS` (570); `DDO_T_<PART>=0` skips a part.
pub(super) const SCRIPT: &str = concat!(
    r#"#!/usr/bin/env bash
# Issue 39 on one GPU, in one job (built by `cargo xtask bench --compute`). Run from the
# repository root (fixtures/flux_pipeline is read), carrying gpu-bundle/bench-compute; results
# in $OUT (default ./bench-compute-out). Parts, each under timeout (seconds: DDO_T_<PART>, 0
# skips it), the job within DDO_JOB_SECONDS (570), a part skipped with under 30 s left:
#   bench_bf16   ddo bench: the FLUX.1-dev transformer resident, bf16, and its compute floor
#   bench_fp8    the same under --compute fp8 (both with --profile: device time per op class)
#   fp8_peer     fp8_peer.py: PyTorch's _scaled_mm against bf16 linear at FLUX's shapes (in logs.txt)
#   anchor       fp8_anchor.py --device cuda: the fixture pipeline against TorchAO fp8
#   peer         Diffusers' resident step, eager and torch.compile (default mode)
#   run_bf16     ddo run --config flux-dev --vram-budget 12GiB --steps 28, bf16
#   run_fp8      the same under --compute fp8
set -u
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-$PWD/bench-compute-out}"
work="${DDO_BENCH_WORK:-/tmp/ddo-bench-compute}"
site="$work/site"
mkdir -p "$out" "$work" "$site"
log="$out/logs.txt"
: > "$log"
deadline=$(( $(date +%s) + ${DDO_JOB_SECONDS:-570} ))
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > "$out/gpu.txt" 2>&1
python3 -m pip install -q --no-index --no-deps --upgrade --target "$site" "$here"/wheels/*.whl >> "$log" 2>&1
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
if ! python3 -c "import torchao, transformers" >> "$log" 2>&1; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target "$site" "$here"/pywheels/*.whl >> "$log" 2>&1
fi
"#,
    part_fn!(),
    r#"bench=("$here/ddo" bench --config flux-dev --device cuda:0 --component transformer --route none
  --warmup 2 --repeats 5 --profile)
part bench_bf16 "${DDO_T_BENCH_BF16:-90}" "$work/bench_bf16.txt" "${bench[@]}" --out-json "$out/bf16.json"
part bench_fp8 "${DDO_T_BENCH_FP8:-90}" "$work/bench_fp8.txt" "${bench[@]}" --compute fp8 \
  --out-json "$out/fp8.json"
cat "$work"/bench_*.txt >> "$log" 2>/dev/null
part fp8_peer "${DDO_T_FP8_PEER:-45}" "$work/fp8_peer.txt" python3 "$here/fp8_peer.py"
cat "$work/fp8_peer.txt" >> "$log" 2>/dev/null
part anchor "${DDO_T_ANCHOR:-60}" "$work/anchor.txt" python3 "$here/fp8_anchor.py" "$out/anchor.json" \
  --ddo "$here/ddo" --device cuda --fixture "$PWD/fixtures/flux_pipeline"
part peer "${DDO_T_PEER:-240}" "$work/peer.txt" python3 "$here/peer_pipeline.py" step "$out/peer_step.json" \
  --cases resident,resident_compiled
part run_bf16 "${DDO_T_RUN_BF16:-80}" "$out/run_bf16.json" "$here/ddo" run --config flux-dev --device cuda:0 \
  --vram-budget 12GiB --steps 28 --json --no-env --out "$work/bf16.png"
part run_fp8 "${DDO_T_RUN_FP8:-80}" "$out/run_fp8.json" "$here/ddo" run --config flux-dev --device cuda:0 \
  --vram-budget 12GiB --steps 28 --json --no-env --compute fp8 --out "$work/fp8.png"
cat "$work"/anchor.txt "$work"/peer.txt >> "$log" 2>/dev/null
"#
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_runs_each_part_under_timeout_in_order_and_is_valid_bash() {
        let order = [
            "part bench_bf16 ",
            "part bench_fp8 ",
            "part fp8_peer ",
            "part anchor ",
            "part peer ",
            "part run_bf16 ",
            "part run_fp8 ",
        ];
        let at: Vec<usize> = order
            .iter()
            .map(|p| SCRIPT.find(p).unwrap_or_else(|| panic!("{p}")))
            .collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "{at:?}");
        assert!(SCRIPT.contains("--cases resident,resident_compiled"));
        assert!(SCRIPT.contains("\"${bench[@]}\" --compute fp8"));
        crate::bench::script_checks::assert_job_script(SCRIPT);
    }
}
