//! `cargo xtask bench --gguf [--base REV]` (issue 37): a FLUX.1-dev-sized GGUF transformer on
//! the GPU in one job: resident and streamed at zero budget (leaf + stream) for Q4_K and Q8_0,
//! against the bf16 resident step in the same job; one streamed Q4_K forward traced
//! (`--timeline`: where the copy engine sat idle, and the host's time per forward against the
//! device's); the 28-step pipeline under `--vram-budget 12GiB` with the Q4_K transformer; and,
//! with `--base`, the Q4_K streamed step of that revision's `ddo` right after this one's.
//!
//! Builds `gpu-bundle/bench-gguf/` (ignored by git): the `ddo` binary (and `ddo-base`), the
//! file writer (`tools/make_flux_gguf.py`, numpy only: random blocks in the original BFL layout,
//! about 6.9 GB as Q4_K and 12.7 GB as Q8_0) and `run-bench-gguf.sh`. No wheels: the bundle is
//! small enough to travel beside another. Results in `$OUT`: `bf16.json`, `q4.json`,
//! `q4_base.json`, `q8.json`, `run_q4.json`, `gpu.txt`, `logs.txt` (each part's table, the
//! timeline among them).

use super::{full, host_ram};
use crate::workspace_root;

/// The bundle's folder, relative to the workspace root (ignored by git).
pub const GGUF_DIR: &str = "gpu-bundle/bench-gguf";

/// Builds the bundle (with `base`, that revision's `ddo` as `ddo-base`), and runs it here with
/// `run_here`.
pub fn bench_gguf(base: Option<&str>, run_here: bool) -> Result<(), String> {
    let root = workspace_root();
    let (script, _) = full::build_lean_bundle(
        &root,
        GGUF_DIR,
        &["make_flux_gguf.py"],
        "run-bench-gguf.sh",
        SCRIPT,
    )?;
    let dir = root.join(GGUF_DIR);
    if let Some(rev) = base {
        host_ram::add_base(&root, &dir, rev)?;
    }
    let size = full::dir_bytes(&dir);
    full::announce(
        "--gguf",
        (&dir, GGUF_DIR, size),
        ("run-bench-gguf.sh", &script),
        run_here,
    )
}

/// The job's script: each part under `timeout`, in order of what issue 37 needs first, the
/// whole within `DDO_JOB_SECONDS` (570); `DDO_T_<PART>=0` skips a part.
pub(super) const SCRIPT: &str = concat!(
    r#"#!/usr/bin/env bash
# Issue 37 on one GPU, in one job (built by `cargo xtask bench --gguf`). Run from the repository
# root carrying gpu-bundle/bench-gguf; results in $OUT (default ./bench-gguf-out). Parts, each
# under timeout (seconds: DDO_T_<PART>, 0 skips it), the job within DDO_JOB_SECONDS (570), a
# part skipped with under 30 s left:
#   write_q4     make_flux_gguf.py --type Q4_K (kept in DDO_BENCH_WORK for a later job)
#   bench_bf16   ddo bench: the FLUX.1-dev transformer resident in bf16 (the steps' reference)
#   bench_q4     the Q4_K file resident and leaf + stream at zero budget (--profile: each one's
#                device time per op class, so a streamed step's gap to resident shows where)
#   bench_q4_base  the same streamed candidate with the bundle's ddo-base (--base REV), if any
#   bench_q4_ahead the streamed candidate against it with copy_ahead=true at 7, 12, 16 and 24
#                ring slots, in one process (the next forward's first blocks copied during
#                this one's last)
#   timeline_q4  one traced leaf + stream run of the Q4_K file (--timeline, in logs.txt)
#   run_q4       ddo run, 28 steps under --vram-budget 12GiB, the Q4_K transformer
#   write_q8     make_flux_gguf.py --type Q8_0
#   bench_q8     the Q8_0 file resident and leaf + stream at zero budget
set -u
here="$(cd "$(dirname "$0")" && pwd)"
out="${OUT:-$PWD/bench-gguf-out}"
work="${DDO_BENCH_WORK:-/tmp/ddo-bench-gguf}"
mkdir -p "$out" "$work"
log="$out/logs.txt"
: > "$log"
deadline=$(( $(date +%s) + ${DDO_JOB_SECONDS:-570} ))
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > "$out/gpu.txt" 2>&1
"#,
    part_fn!(),
    r#"leaf=diffusers_group_offload:offload_type=leaf_level,use_stream=true
bench=(bench --config flux-dev --device cuda:0 --component transformer --warmup 2 --repeats 5)
[ -f "$work/q4.gguf" ] || part write_q4 "${DDO_T_WRITE_Q4:-90}" "$work/write_q4.txt" \
  python3 "$here/make_flux_gguf.py" "$work/q4.gguf" --type Q4_K
part bench_bf16 "${DDO_T_BENCH_BF16:-60}" "$work/bench_bf16.txt" "$here/ddo" "${bench[@]}" --route none \
  --out-json "$out/bf16.json"
part bench_q4 "${DDO_T_BENCH_Q4:-90}" "$work/bench_q4.txt" "$here/ddo" "${bench[@]}" \
  --transformer "$work/q4.gguf" --route none --route "$leaf" --out-json "$out/q4.json" --profile
if [ -f "$here/ddo-base.xz" ]; then
  [ -x "$work/ddo-base" ] || { xz -dc "$here/ddo-base.xz" > "$work/ddo-base" && chmod +x "$work/ddo-base"; }
  part bench_q4_base "${DDO_T_BENCH_Q4_BASE:-60}" "$work/bench_q4_base.txt" "$work/ddo-base" "${bench[@]}" \
    --transformer "$work/q4.gguf" --route "$leaf" --out-json "$out/q4_base.json"
fi
part bench_q4_ahead "${DDO_T_BENCH_Q4_AHEAD:-120}" "$work/bench_q4_ahead.txt" "$here/ddo" "${bench[@]}" \
  --transformer "$work/q4.gguf" --route "$leaf" --route "$leaf,copy_ahead=true" \
  --route "$leaf,copy_ahead=true,ring_slots=12" --route "$leaf,copy_ahead=true,ring_slots=16" \
  --route "$leaf,copy_ahead=true,ring_slots=24" --out-json "$out/q4_ahead.json"
part timeline_q4 "${DDO_T_TIMELINE_Q4:-60}" "$work/timeline_q4.txt" "$here/ddo" "${bench[@]}" \
  --transformer "$work/q4.gguf" --route "$leaf" --timeline
cat "$work"/bench_*.txt "$work"/timeline_q4.txt >> "$log" 2>/dev/null
part run_q4 "${DDO_T_RUN_Q4:-90}" "$out/run_q4.json" "$here/ddo" run --config flux-dev --device cuda:0 \
  --transformer "$work/q4.gguf" --vram-budget 12GiB --steps 28 --json --no-env --out "$work/q4.png"
[ -f "$work/q8.gguf" ] || part write_q8 "${DDO_T_WRITE_Q8:-120}" "$work/write_q8.txt" \
  python3 "$here/make_flux_gguf.py" "$work/q8.gguf" --type Q8_0
part bench_q8 "${DDO_T_BENCH_Q8:-90}" "$work/bench_q8.txt" "$here/ddo" "${bench[@]}" \
  --transformer "$work/q8.gguf" --route none --route "$leaf" --out-json "$out/q8.json"
cat "$work"/bench_q8.txt >> "$log" 2>/dev/null
"#
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_runs_each_part_under_timeout_in_order_and_is_valid_bash() {
        let order = [
            "part write_q4 ",
            "part bench_bf16 ",
            "part bench_q4 ",
            "part bench_q4_base ",
            "part bench_q4_ahead ",
            "part timeline_q4 ",
            "part run_q4 ",
            "part write_q8 ",
            "part bench_q8 ",
        ];
        let at: Vec<usize> = order
            .iter()
            .map(|p| SCRIPT.find(p).unwrap_or_else(|| panic!("{p}")))
            .collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "{at:?}");
        // Both files are streamed by the same route as resident, and the trace is of the
        // streamed route.
        for f in ["q4", "q8"] {
            assert!(
                SCRIPT.contains(&format!(
                    "--transformer \"$work/{f}.gguf\" --route none --route \"$leaf\""
                )),
                "{f}"
            );
        }
        assert!(SCRIPT.contains("--route \"$leaf\" --timeline"));
        crate::bench::script_checks::assert_job_script(SCRIPT);
    }
}
