//! `cargo xtask bench --host-ram 32GiB,16GiB,8GiB` (issue 35): DDO on a FLUX.1-dev Diffusers
//! folder (random bf16 weights, 33.7 GB) as it runs on machines with less RAM, simulated on
//! the GPU machine in one job.
//!
//! Builds `gpu-bundle/bench-host-ram/` (ignored by git): the `ddo` binary, the scripts that
//! write the folder (`tools/save_random_pipeline.py` with `peer_pipeline.py`) and make the
//! report (`tools/bench_host_ram_report.py`), the Diffusers wheels and the fallback wheels of
//! `--full`, and `run-bench-host-ram.sh`, which on the GPU machine:
//!
//! 1. writes the folder once (`$DDO_FOLDER`, default `/tmp/ddo-host-ram/flux`);
//! 2. measures the disk (`dd` with 16 MiB `O_DIRECT` reads, page cache dropped);
//!    (`DDO_MODEL=qwen`: a Qwen-Image folder at its real config, 57.7 GB, run under
//!    `--vram-budget 16GiB`, the FLUX folder removed first: the disk holds one);
//! 3. runs `ddo run --weights FOLDER --device cuda:0 --vram-budget 12GiB` with all RAM free,
//!    then for each size: a helper process allocates, touches and holds what leaves that
//!    much `MemAvailable`, the page cache is dropped (`sync; echo 3 >
//!    /proc/sys/vm/drop_caches`: the job runs as root there), and the run goes under
//!    `/usr/bin/time -v`, its lowest `MemAvailable` sampled, then whether the helper
//!    survived is recorded (the kernel's OOM killer takes the largest process);
//!    (`DDO_CODED=1`: the folder is also converted with `ddo convert --compress lossless`, and
//!    each case runs on the coded folder right after the raw one, `NAME-coded`);
//!    each case's GPU clocks, power, temperature and throttle reasons are sampled every 100 ms
//!    (`$OUT/NAME.smi.csv`);
//! 4. with `DDO_SERVE=1`, runs `--serve`'s job on the same folder (the bundle carries its
//!    script and client), so one carry and one job measure both;
//! 5. writes `$OUT/host_ram.json` and `$OUT/host_ram.md`: per case the time to the image,
//!    the phases, the steady step and its ratio to the all-free run's, the peak RSS, the
//!    plan's host budget, whether an image came and no other process was killed.

use std::process::Command;

use super::full;
use crate::{run, workspace_root};

/// The bundle's folder, relative to the workspace root (ignored by git).
pub const HOST_RAM_DIR: &str = "gpu-bundle/bench-host-ram";

/// The Python files that write the folder, from `tools/` (`save_random_pipeline.py` builds
/// the weights through `peer_pipeline.py`, which imports `bench_peer.py` and `gpu_peer.py`):
/// this bundle's and `--serve`'s.
pub(super) const FOLDER_WRITER: [&str; 5] = [
    "gpu_peer.py",
    "bench_peer.py",
    "peer_pipeline.py",
    "peer_qwen.py",
    "save_random_pipeline.py",
];

/// Python files the job needs: the folder's writer, the report, and `--serve`'s client (the
/// job's `DDO_SERVE=1` stage runs it on the same folder, so one carry serves both benches).
fn scripts() -> Vec<&'static str> {
    FOLDER_WRITER
        .into_iter()
        .chain(["bench_host_ram_report.py", "bench_serve.py"])
        .collect()
}

/// The `--serve` job's script in this bundle: `DDO_SERVE=1` runs it after the cases (it
/// finds the folder written and the `ddo` unpacked, both shared).
const SERVE_SCRIPT: &str = "run-bench-serve.sh";

/// The sizes of `32GiB,16GiB,8GiB` in whole GiB, largest first; an error names a bad one.
pub fn parse_sizes(text: &str) -> Result<Vec<u64>, String> {
    let mut sizes = Vec::new();
    for part in text.split(',') {
        let t = part.trim();
        let gib = t
            .strip_suffix("GiB")
            .and_then(|n| n.parse::<u64>().ok())
            .filter(|&n| (1..=1024).contains(&n))
            .ok_or_else(|| {
                format!(
                    "--host-ram `{t}`: give whole GiB from 1GiB to 1024GiB, e.g. 32GiB,16GiB,8GiB"
                )
            })?;
        if sizes.contains(&gib) {
            return Err(format!("--host-ram: {gib}GiB given twice"));
        }
        sizes.push(gib);
    }
    sizes.sort_unstable_by(|a, b| b.cmp(a));
    Ok(sizes)
}

/// A `--base` revision: hex digits (4 to 40) or a name of letters, digits, `.`, `_`, `-`
/// and `/` (a tag or branch), never an option or a path outside the repository; an error
/// names what it takes.
pub fn parse_base(rev: &str) -> Result<String, String> {
    let ok = !rev.is_empty()
        && rev.len() <= 100
        && !rev.starts_with(['-', '/', '.'])
        && !rev.contains("..")
        && rev
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/'));
    if ok {
        Ok(rev.to_string())
    } else {
        Err(format!(
            "--base `{rev}`: give a git revision (a commit such as 45fcf60, a tag or a branch)"
        ))
    }
}

/// Builds `ddo` at revision `rev` in a worktree of its own (`target/base-src-REV`, target
/// folder `target/base-REV`, both reused) and puts it xz-compressed into the bundle as
/// `ddo-base.xz`, which the job runs as its baseline (`DDO_BASE_WARM`'s default).
pub(super) fn add_base(
    root: &std::path::Path,
    dir: &std::path::Path,
    rev: &str,
) -> Result<(), String> {
    let safe: String = rev
        .chars()
        .map(|c| if c == '/' { '_' } else { c })
        .collect();
    let src = root.join("target").join(format!("base-src-{safe}"));
    if !src.join("Cargo.toml").is_file() {
        run(Command::new("git")
            .current_dir(root)
            .args(["worktree", "add", "--detach"])
            .arg(&src)
            .arg(format!("{rev}^{{commit}}")))?;
    }
    let target = root.join("target").join(format!("base-{safe}"));
    // `run` starts commands in this workspace: the manifest path names the worktree's.
    run(crate::cargo()
        .env("CARGO_TARGET_DIR", &target)
        .args(["build", "--release", "--locked", "--manifest-path"])
        .arg(src.join("Cargo.toml"))
        .args(["-p", "ddo-cli", "--bin", "ddo"]))?;
    let exe = target.join("release/ddo");
    std::fs::copy(&exe, dir.join("ddo-base"))
        .map_err(|e| format!("cannot copy {}: {e}", exe.display()))?;
    run(Command::new("xz")
        .args(["-T2", "-6", "-f"])
        .arg(dir.join("ddo-base")))?;
    full::check_size(full::dir_bytes(dir))
}

/// Builds the bundle for `sizes` (GiB of `MemAvailable` to leave) with `steps` denoising
/// steps (and, with `base`, that revision's `ddo` as the baseline), and runs it here with
/// `run_here`.
pub fn bench_host_ram(
    sizes: &[u64],
    steps: u32,
    base: Option<&str>,
    run_here: bool,
) -> Result<(), String> {
    let root = workspace_root();
    let (script, size) = full::build_bundle(
        &root,
        HOST_RAM_DIR,
        None,
        &scripts(),
        "run-bench-host-ram.sh",
        &host_ram_script(sizes, steps),
    )?;
    let dir = root.join(HOST_RAM_DIR);
    let serve = dir.join(SERVE_SCRIPT);
    std::fs::write(&serve, full::with_unpack(super::serve::SCRIPT))
        .map_err(|e| format!("cannot write {}: {e}", serve.display()))?;
    crate::gpu::make_executable(&serve)?;
    run(Command::new("bash").arg("-n").arg(&serve))?;
    if let Some(rev) = base {
        add_base(&root, &dir, rev)?;
    }
    full::announce(
        "--host-ram",
        (&dir, HOST_RAM_DIR, size),
        ("run-bench-host-ram.sh", &script),
        run_here,
    )
}

/// The job's script for `sizes` (GiB, largest first) and `steps`.
pub fn host_ram_script(sizes: &[u64], steps: u32) -> String {
    let sizes: Vec<String> = sizes.iter().map(u64::to_string).collect();
    format!(
        r#"#!/usr/bin/env bash
# DDO on a FLUX.1-dev Diffusers folder under smaller machines (issue 35), in one job (built by
# `cargo xtask bench --host-ram ...`). Run as root from the repository root, carrying
# gpu-bundle/bench-host-ram. Cases: all RAM free, then MemAvailable of {sizes_text} GiB, each
# with the page cache dropped; results in $OUT (default ./bench-host-ram-out). DDO_BIN runs
# another ddo binary (a baseline) in the same job.
set -u
here="$(cd "$(dirname "$0")" && pwd)"
out="${{OUT:-$PWD/bench-host-ram-out}}"
work="${{DDO_BENCH_WORK:-/tmp/ddo-host-ram}}"
# DDO_MODEL=qwen: a Qwen-Image folder (57.7 GB) instead, under --vram-budget 16GiB; the other
# model's folder is removed first (the GPU machine's disk holds one of them).
model="${{DDO_MODEL:-flux}}"
folder="${{DDO_FOLDER:-$work/$model}}"
if [ "$model" = qwen ]; then writer_args=--qwen; vram="${{DDO_VRAM:-16GiB}}"; other=flux; else writer_args=; vram="${{DDO_VRAM:-12GiB}}"; other=qwen; fi
steps="${{DDO_STEPS:-{steps}}}"
# An empty DDO_HOST_RAM runs no sized case.
sizes="${{DDO_HOST_RAM-{sizes_list}}}"
# DDO_CODED=1: the folder is also converted (`ddo convert --compress lossless`, timed, page cache
# dropped) and every case runs on the coded folder too, right after the raw one (NAME-coded).
coded="${{DDO_CODED:-0}}"
cfolder="$folder-coded"
site="$work/site"
mkdir -p "$out" "$work"
log="$out/logs.txt"
: > "$log"
: > "$out/cases.tsv"
say() {{ echo "$(date +%T) $*" | tee -a "$log"; }}
avail_kib() {{ awk '/^MemAvailable:/ {{print $2}}' /proc/meminfo; }}
drop_caches() {{ sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || say "cannot drop the page cache (not root?)"; }}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$out/gpu.txt" 2>&1
# The host's NUMA nodes and the GPU's (a copy from pages on the far node crosses the
# sockets' link): each NVIDIA PCI function's node, each node's memory.
{{ for d in /sys/bus/pci/drivers/nvidia/0000:*; do [ -e "$d/numa_node" ] && echo "$(basename "$d") numa_node $(cat "$d/numa_node")"; done
   grep -h -E 'MemTotal|MemFree' /sys/devices/system/node/node*/meminfo; }} > "$out/numa.txt" 2>&1
if [ ! -f "$folder/model_index.json" ]; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target "$site" "$here"/wheels/*.whl >> "$log" 2>&1
  export PYTHONPATH="$site${{PYTHONPATH:+:$PYTHONPATH}}"
  if ! python3 -c "from transformers import CLIPTextModel, T5EncoderModel" >> "$log" 2>&1; then
    python3 -m pip install -q --no-index --no-deps --upgrade --target "$site" "$here"/pywheels/*.whl >> "$log" 2>&1
  fi
  rm -rf "$work/$other" "$work/$other-coded"
  say "writing the folder $folder"
  python3 "$here/save_random_pipeline.py" "$folder" $writer_args > "$out/folder.json" 2>> "$log" || {{ say "the folder could not be written"; exit 1; }}
fi
drop_caches
first=$(ls "$folder"/transformer/*.safetensors | head -n 1)
second=$(ls "$folder"/transformer/*.safetensors | tail -n 1)
dd if="$first" of=/dev/null bs=16M count=300 iflag=direct 2> "$out/disk.txt" > /dev/null
say "disk: $(tail -n 1 "$out/disk.txt")"

if [ "$coded" = 1 ] && [ ! -f "$cfolder/model_index.json" ]; then
  rm -rf "$cfolder"
  drop_caches
  say "converting the folder to $cfolder"
  /usr/bin/time -v -o "$out/convert.time" "${{DDO_BIN:-$here/ddo}}" convert --compress lossless "$folder" "$cfolder" --json > "$out/convert.json" 2>> "$log"
  say "convert: exit $?, $(grep -E 'Elapsed|Maximum resident' "$out/convert.time" | tr '\n' ' ')"
  du -sb "$folder" "$cfolder" >> "$log"
fi

# hold GIB: a helper process allocates, touches and holds what leaves GIB of MemAvailable
# (the raw and the coded case of one size share it); release: it goes, and whether it
# survived the cases is recorded.
holder=""; held=0
hold() {{
  holder=""; held=$(( $(avail_kib) / 1024 - $1 * 1024 ))
  if [ "$held" -gt 0 ]; then
    rm -f "$work/held"
    python3 -c "import numpy as np, time; a = np.ones($held << 20, dtype=np.uint8); open('$work/held', 'w').write('1'); time.sleep(3600)" &
    holder=$!
    for _ in $(seq 300); do [ -f "$work/held" ] && break; sleep 1; done
    sleep 2
  else
    held=0
  fi
}}
alive_now() {{ if [ -z "$holder" ]; then echo none; elif kill -0 "$holder" 2>/dev/null; then echo yes; else echo no; fi; }}
release() {{ [ -n "$holder" ] && {{ kill "$holder" 2>/dev/null; wait "$holder" 2>/dev/null; }}; holder=""; held=0; }}
pgpgin() {{ awk '/^pgpgin / {{print $2}}' /proc/vmstat; }}

# case NAME AVAILABLE_GIB FOLDER STEPS [cold|warm [BINARY]] (0 GiB: all free; warm: the page
# cache is kept, the folder read by the case before; BINARY: another ddo, default DDO_BIN's)
case_run() {{
  local name="$1" gib="$2" weights="$3" n="$4" cache="${{5:-cold}}" bin="${{6:-${{DDO_BIN:-$here/ddo}}}}"
  if [ "$cache" = cold ]; then
    drop_caches
    # The disk's rate next to this case, before and after it (a cloud volume's rate drifts
    # within a job): 1.6 GB of direct reads from the transformer's last shard each time.
    dd if="$second" of=/dev/null bs=16M count=100 iflag=direct 2> "$out/$name.disk" > /dev/null
  fi
  local before; before=$(avail_kib)
  # Each NUMA node's free memory as the case starts (where its pages can land).
  grep -h MemFree /sys/devices/system/node/node*/meminfo > "$out/$name.numa" 2>/dev/null
  say "=== $name: $n steps, page cache $cache, MemAvailable $(( before / 1024 )) MiB (a helper holds $held MiB)"
  : > "$work/$name.avail"
  ( while true; do avail_kib >> "$work/$name.avail"; sleep 0.5; done ) &
  local sampler=$!
  # The card's clocks, power, temperature and throttle reasons every 100 ms during the case
  # (a step time that drifts with them is the card's, not DDO's).
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv,noheader -lms 100 > "$out/$name.smi.csv" 2>/dev/null &
  local smi=$!
  local in0 t0; in0=$(pgpgin); t0=$(date +%s.%N)
  /usr/bin/time -v -o "$work/$name.time" timeout -k 10 "${{DDO_T_CASE:-300}}" "$bin" run --weights "$weights" \
    --device cuda:0 --vram-budget "$vram" --steps "$n" --json --out "$work/$name.png" \
    ${{case_args[@]+"${{case_args[@]}}"}} > "$out/$name.json" 2>> "$log"
  local rc=$?
  # KiB the block devices read during the case, and its seconds (the disk's achieved rate).
  echo "$(( $(pgpgin) - in0 )) $(awk "BEGIN {{print $(date +%s.%N) - $t0}}")" > "$out/$name.pgpgin"
  kill "$sampler" "$smi" 2>/dev/null
  [ "$cache" = cold ] && dd if="$second" of=/dev/null bs=16M count=100 skip=100 iflag=direct 2> "$out/$name.disk-after" > /dev/null
  local alive; alive=$(alive_now)
  local rss wall min
  rss=$(awk -F': ' '/Maximum resident set size/ {{print $2}}' "$work/$name.time")
  wall=$(awk -F': ' '/Elapsed \(wall clock\)/ {{print $2}}' "$work/$name.time")
  min=$(sort -n "$work/$name.avail" | head -n 1)
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$gib" "$rc" "$(( before / 1024 ))" "${{min:-0}}" "${{rss:-0}}" "$wall" "$alive" >> "$out/cases.tsv"
  say "=== $name: exit $rc, wall $wall, max RSS ${{rss:-?}} KiB, lowest MemAvailable $(( ${{min:-0}} / 1024 )) MiB, helper alive: $alive"
  dmesg 2>/dev/null | grep -i 'killed process' | tail -n 2 >> "$log"
}}

# Extra `ddo run` options of the next case (the plan A/B below sets them).
case_args=()
if [ "${{DDO_FREE:-1}}" = 1 ]; then
  case_run free 0 "$folder" "$steps"
fi
# DDO_PLAN_AB=N: N interleaved rounds, page cache warm, all RAM free, DDO_AB_STEPS (28) steps
# each, of the plan's defaults (ab-A-rK), T5 kept resident (`--route text_encoder_2=none`:
# no early upload of the transformer, ab-B-rK) and a 28 GiB host budget (the 32 GiB case's
# plan without its helper, ab-C-rK): which of the all-free plan's choices costs its steady
# step against the 32 GiB plan's (issue 35: 0.246 s against 0.239 s on an H100).
if [ "${{DDO_PLAN_AB:-0}}" -gt 0 ]; then
  cat "$folder"/*/*.safetensors > /dev/null
  for r in $(seq 1 "$DDO_PLAN_AB"); do
    case_args=(); case_run "ab-A-r$r" 0 "$folder" "${{DDO_AB_STEPS:-28}}" warm
    case_args=(--route text_encoder_2=none); case_run "ab-B-r$r" 0 "$folder" "${{DDO_AB_STEPS:-28}}" warm
    case_args=(--host-budget 28GiB); case_run "ab-C-r$r" 0 "$folder" "${{DDO_AB_STEPS:-28}}" warm
  done
  case_args=()
fi
# DDO_WARM=1: the raw folder again with the page cache warm, DDO_WARM_STEPS steps (4: issue 35's
# <= 3.5 s).
if [ "${{DDO_WARM:-1}}" = 1 ]; then
  cat "$folder"/*/*.safetensors > /dev/null
  case_run warm 0 "$folder" "${{DDO_WARM_STEPS:-4}}" warm
  # DDO_BASE_WARM=BINARY: the same case with an earlier ddo right after (NAME-base); by
  # default the bundle's ddo-base (`--base REV`), when it has one.
  if [ -z "${{DDO_BASE_WARM:-}}" ] && [ -f "$here/ddo-base.xz" ]; then
    xz -dc "$here/ddo-base.xz" > "$work/ddo-base" && chmod +x "$work/ddo-base" && DDO_BASE_WARM="$work/ddo-base"
  fi
  [ -n "${{DDO_BASE_WARM:-}}" ] && case_run warm-base 0 "$folder" "${{DDO_WARM_STEPS:-4}}" warm "$DDO_BASE_WARM"
  # DDO_ROUNDS=N: N - 1 more rounds of the warm case (and of its base, interleaved), NAME-rK.
  for r in $(seq 2 "${{DDO_ROUNDS:-1}}"); do
    case_run "warm-r$r" 0 "$folder" "${{DDO_WARM_STEPS:-4}}" warm
    [ -n "${{DDO_BASE_WARM:-}}" ] && case_run "warm-r$r-base" 0 "$folder" "${{DDO_WARM_STEPS:-4}}" warm "$DDO_BASE_WARM"
  done
fi
[ "${{DDO_FREE:-1}}" = 1 ] && [ "$coded" = 1 ] && case_run free-coded 0 "$cfolder" "$steps"
for gib in $sizes; do
  # DDO_STEPS_<GIB> (e.g. DDO_STEPS_8=4): this size's steps, else DDO_STEPS.
  eval "n=\${{DDO_STEPS_$gib:-$steps}}"
  hold "$gib"
  # DDO_RAW=0: only the coded folder's case; DDO_BASE_SIZED=BINARY: each case again with an
  # earlier ddo right after, under the same helper (NAME-base).
  if [ "${{DDO_RAW:-1}}" = 1 ]; then
    case_run "avail${{gib}}" "$gib" "$folder" "$n"
    [ -n "${{DDO_BASE_SIZED:-}}" ] && case_run "avail${{gib}}-base" "$gib" "$folder" "$n" cold "$DDO_BASE_SIZED"
  fi
  if [ "$coded" = 1 ]; then
    case_run "avail${{gib}}-coded" "$gib" "$cfolder" "$n"
    [ -n "${{DDO_BASE_SIZED:-}}" ] && case_run "avail${{gib}}-coded-base" "$gib" "$cfolder" "$n" cold "$DDO_BASE_SIZED"
  fi
  release
done
# DDO_CACHE_HIT=1: the raw folder with the transformer coded at attach (`compress=lossless`), 4 steps:
# the first run codes and writes the cache beside the checkpoint, the second (page cache dropped)
# is a hit, which must read none of the raw transformer's bytes (`read_bytes`, /proc/self/io).
if [ "${{DDO_CACHE_HIT:-0}}" = 1 ]; then
  # The cache (about 0.65x the transformer) and the coded folder do not both fit the GPU machine's disk.
  rm -rf "$cfolder"
  lossless=transformer=diffusers_group_offload:offload_type=leaf_level,use_stream=true,compress=lossless
  for k in 1 2; do
    drop_caches
    timeout -k 10 "${{DDO_T_CASE:-300}}" "${{DDO_BIN:-$here/ddo}}" run --weights "$folder" --route "$lossless" \
      --device cuda:0 --vram-budget "$vram" --steps 4 --json --out "$work/cache$k.png" > "$out/cache$k.json" 2>> "$log"
    say "coded cache run $k: exit $?"
  done
  ls -la "$folder"/transformer >> "$log"
  du -sb "$folder"/transformer/*.safetensors >> "$log"
fi
# DDO_BENCH=1 (with DDO_WARM=1): the transformer's step and its link floor under the same budget
# (`ddo bench`, link measured), last.
if [ "${{DDO_WARM:-1}}" = 1 ] && [ "${{DDO_BENCH:-1}}" = 1 ]; then
  timeout -k 10 120 "${{DDO_BIN:-$here/ddo}}" bench --weights "$folder" --component transformer --preset auto \
    --vram-budget "$vram" --device cuda:0 --repeats 3 --out-json "$out/bench.json" > "$out/bench.txt" 2>> "$log"
  say "bench: exit $?"
fi
# DDO_SERVE=1: `cargo xtask bench --serve`'s job on the same folder (DDO_MANY requests in a row,
# DDO_WARM_REQUESTS warm ones; DDO_T_SERVE seconds at most), its results in $OUT/serve (and so
# in the archive).
if [ "${{DDO_SERVE:-0}}" = 1 ]; then
  t_serve="${{DDO_T_SERVE:-300}}"
  OUT="$out/serve" DDO_SERVE_SECONDS=$(( t_serve - 20 )) timeout -k 10 "$t_serve" "$here/run-bench-serve.sh" > "$out/serve.out" 2>&1
  say "serve: exit $?"
fi
python3 "$here/bench_host_ram_report.py" "$out" | tee -a "$log"
# Everything in one archive; $OUT keeps it, the report and the log (a device job brings back
# at most 8 files, and drops the rest of a fuller folder).
tar -czf "$work/results.tgz" -C "$out" . && find "$out" -mindepth 1 -maxdepth 1 \
  ! -name host_ram.md ! -name host_ram.json ! -name logs.txt -exec rm -rf {{}} + \
  && mv "$work/results.tgz" "$out/results.tgz"
"#,
        sizes_text = sizes.join(", "),
        sizes_list = sizes.join(" "),
    )
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;

    /// `--base` takes a commit, a tag or a branch, never an option, a path or a shell word;
    /// the job runs the bundled baseline by default, after unpacking it.
    #[test]
    fn the_base_is_a_revision_and_the_job_runs_it_by_default() {
        for good in ["45fcf60", "v0.1", "main", "feature/host-ram", "HEAD"] {
            assert_eq!(parse_base(good).unwrap(), good);
        }
        for bad in [
            "",
            "--upload-pack=x",
            "../x",
            "/etc/passwd",
            "a b",
            "a;b",
            ".hidden",
        ] {
            let e = parse_base(bad).unwrap_err();
            assert!(e.contains("--base") && e.contains("45fcf60"), "{bad}: {e}");
        }
        let s = host_ram_script(&[32], 28);
        let unpack = s
            .find(r#"xz -dc "$here/ddo-base.xz""#)
            .expect("unpacks the base");
        let first_base_run = s.find("case_run warm-base").expect("runs the base");
        assert!(unpack < first_base_run);
    }

    #[test]
    fn sizes_are_whole_gib_largest_first_and_bad_ones_are_named() {
        assert_eq!(parse_sizes("8GiB,32GiB,16GiB").unwrap(), [32, 16, 8]);
        for bad in ["32", "0GiB", "1.5GiB", "16GB", "8GiB,8GiB", ""] {
            let e = parse_sizes(bad).unwrap_err();
            assert!(e.contains("--host-ram"), "{bad}: {e}");
        }
    }

    /// Every `tools/` module the carried scripts import is carried (the first GPU run of
    /// this bench failed on a missing `bench_peer`).
    #[test]
    fn the_carried_scripts_import_only_carried_modules() {
        let tools = workspace_root().join("tools");
        let carried = scripts();
        for script in &carried {
            let text = fs::read_to_string(tools.join(script)).unwrap();
            for line in text.lines() {
                let module = line
                    .strip_prefix("import ")
                    .or_else(|| line.strip_prefix("from "))
                    .and_then(|rest| rest.split([' ', '.']).next())
                    .unwrap_or("");
                if tools.join(format!("{module}.py")).is_file() {
                    assert!(
                        carried.contains(&format!("{module}.py").as_str()),
                        "{script} imports {module}, which the bundle does not carry"
                    );
                }
            }
        }
    }

    #[test]
    fn the_script_runs_every_case_after_the_free_one_and_reports() {
        let s = host_ram_script(&[32, 16, 8], 28);
        assert!(s.starts_with("#!/usr/bin/env bash"));
        assert!(s.contains(r#"sizes="${DDO_HOST_RAM-32 16 8}""#));
        assert!(s.contains(r#"steps="${DDO_STEPS:-28}""#));
        let free = s.find("case_run free 0").unwrap();
        let sized = s.find(r#"case_run "avail${gib}" "$gib""#).unwrap();
        let report = s.find("bench_host_ram_report.py\" \"$out\"").unwrap();
        assert!(free < sized && sized < report);
        // The plan A/B's three plans, each with its own run options.
        let ab = s.find(r#"case_run "ab-A-r$r""#).unwrap();
        assert!(s[ab..].contains("--route text_encoder_2=none"));
        assert!(s[ab..].contains("--host-budget 28GiB"));
        assert!(free < ab);
        // The serve stage (opt-in) runs on the same folder after the cases and the link
        // bench, and its results are in the archive.
        let bench = s.find("bench --weights \"$folder\"").unwrap();
        let serve = s.find("OUT=\"$out/serve\"").unwrap();
        let archive = s.find("tar -czf").unwrap();
        assert!(sized < bench && bench < serve && serve < report && report < archive);
        assert!(s.contains(r#"if [ "${DDO_SERVE:-0}" = 1 ]; then"#));
        assert!(scripts().contains(&"bench_serve.py"));
        assert!(s.contains("drop_caches"));
        assert!(s.contains(r#"vram="${DDO_VRAM:-12GiB}""#));
        assert!(s.contains(r#"--vram-budget "$vram""#));
        assert!(s.contains("save_random_pipeline.py\" \"$folder\" $writer_args"));
        let checked = Command::new("bash")
            .arg("-n")
            .arg("/dev/stdin")
            .stdin(std::process::Stdio::piped())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write;
                c.stdin.take().unwrap().write_all(s.as_bytes())?;
                c.wait()
            })
            .unwrap();
        assert!(checked.success(), "bash -n refused the script");
    }
}
