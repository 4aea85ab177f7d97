#!/usr/bin/env bash
# One GPU session's checks, run on the GPU machine from the repository root:
#   1. Diffusers' side (tools/gpu_peer.py): same-weights fixtures and PyTorch eager timings;
#   2. DDO's GPU test binaries (gpu-bundle/, built here by `cargo xtask gpu-bundle`) with
#      DDO_PEER_DIR pointing at those fixtures and the benchmark enabled.
# Carry `gpu-bundle` and `wheels` (the Diffusers wheels from ../shared/wheels).
# Usage: tools/gpu_run.sh [--no-peer] [--no-bench]   (logs and JSON land in $OUT)
set -u
# $OUT returns at most 8 files: logs go to one folder, tarred at the end.
out="${OUT:-/tmp/ddo-out}"
logs=/tmp/ddo-logs
mkdir -p "$out" "$logs"
peer=/tmp/ddo-peer
bench=1
run_peer=1
for a in "$@"; do
  case "$a" in
    --no-peer) run_peer=0 ;;
    --no-bench) bench=0 ;;
  esac
done
if [ "$run_peer" = 1 ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site wheels/*.whl || exit 1
  export PYTHONPATH=/tmp/site
  flag=""
  [ "$bench" = 1 ] && flag="--bench"
  PYTHONUNBUFFERED=1 python3 tools/gpu_peer.py "$peer" $flag 2>&1 | tee "$logs/peer.log" | tail -30
  cp "$peer/peer.json" "$out/" 2>/dev/null || true
  export DDO_PEER_DIR="$peer"
fi
export DDO_BENCH="$bench" DDO_BENCH_OUT="$out"
./gpu-bundle/run-all.sh "$logs"
rc=$?
tar czf "$out/logs.tgz" -C "$logs" .
if [ -x gpu-bundle/ddo ]; then
  echo "=== ddo run --config tiny --device cuda:0"
  ./gpu-bundle/ddo run --config tiny --device cuda:0 --out "$out/tiny.png" 2>&1 | tee "$logs/ddo-tiny.log" | tail -20
  echo "=== ddo run --config flux-dev --vram-budget 12GiB --device cuda:0 --steps 2 --height 512 --width 512"
  timeout 180 ./gpu-bundle/ddo run --config flux-dev --vram-budget 12GiB --device cuda:0 --steps 2 \
    --height 512 --width 512 --out "$out/flux-dev.png" 2>&1 | tee "$logs/ddo-flux-dev.log" | tail -30
fi
tar czf "$out/logs.tgz" -C "$logs" .
exit $rc
