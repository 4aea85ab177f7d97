"""Merges the parts of `cargo xtask bench --peer diffusers --full` into bench_full.json and a
markdown table, bench_full.md. Standard library only (runs where torch is not importable too).

Usage:
  python3 tools/bench_full_report.py OUT_DIR [WORK_DIR]
  python3 tools/bench_full_report.py measure TIME_FILE COMMAND...

OUT_DIR holds the parts' JSON, each optional (a part that failed or ran out of time is shown
as missing): ddo_bench.json (`ddo bench --out-json`), ddo_run.json (`ddo run --json`),
peer_step.json and peer_pipeline.json (tools/peer_pipeline.py). WORK_DIR (default OUT_DIR) holds
parts.tsv (name, exit status, milliseconds, timeout, one part a line) and NAME.time, each part's
`/usr/bin/time -v` output (its peak RSS).

Floors, with B = DDO's pinned host->device bandwidth measured in the same job (`ddo bench`'s
link_bytes_per_sec; torch's 1 GiB figure from peer_step.json when the bench did not run):
  streamed step           floor = streamed bytes per step / B (zero budget: the whole transformer)
  streamed under a budget floor = max(DDO's resident step, streamed bytes / B)
  denoise phase           floor = steps x streamed bytes per step / B

`measure` runs COMMAND and writes its peak RSS, wall time and exit status to TIME_FILE in
/usr/bin/time -v's words, for a machine without /usr/bin/time; it exits with COMMAND's status.
"""

import json
import os
import re
import resource
import subprocess
import sys
import time

GIB = float(1 << 30)
PART_FILES = {"ddo_bench": "ddo_bench.json", "ddo_run": "ddo_run.json",
                  "peer_step": "peer_step.json", "peer_pipeline": "peer_pipeline.json"}


def measure(time_file, cmd):
    t = time.time()
    try:
        rc = subprocess.call(cmd)
    except OSError as e:
        print(f"bench_full_report.py measure: cannot run {cmd[0]}: {e}", file=sys.stderr)
        rc = 127
    wall = time.time() - t
    kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    with open(time_file, "w") as f:
        f.write(f"\tCommand being timed: \"{' '.join(cmd)}\"\n"
                f"\tElapsed (wall clock) time (h:mm:ss or m:ss): {int(wall // 60)}:{wall % 60:05.2f}\n"
                f"\tMaximum resident set size (kbytes): {kib}\n"
                f"\tExit status: {rc if rc >= 0 else 128 - rc}\n")
    return rc if rc >= 0 else 128 - rc


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def peak_rss(path):
    """Peak RSS in bytes from a /usr/bin/time -v output, or None."""
    try:
        with open(path) as f:
            m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", f.read())
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def parts_table(work):
    rows = []
    try:
        with open(os.path.join(work, "parts.tsv")) as f:
            for line in f:
                cells = line.rstrip("\n").split("\t")
                if len(cells) != 4:
                    continue
                name, rc, ms, limit = cells
                ran = rc != "skipped"
                rows.append({"part": name, "exit": rc,
                             "seconds": int(ms) / 1e3 if ran and ms.isdigit() else None,
                             "timeout_seconds": int(limit) if ran and limit.isdigit() else None,
                             "timed_out": rc in ("124", "137"),
                             "peak_rss_bytes": peak_rss(os.path.join(work, name + ".time"))})
    except OSError:
        pass
    return rows


def ddo_candidates(bench):
    """DDO's bench candidates by workload: resident, leaf, block, budget, auto."""
    out = {}
    for c in (bench or {}).get("candidates", []):
        label = c.get("label", "")
        if label == "none":
            key = "resident"
        elif label.startswith("preset auto"):
            key = "auto"
        elif "budget=" in label:
            key = "budget"
        elif "block_level" in label:
            key = "block"
        elif "use_stream=true" in label:
            key = "leaf"
        else:
            continue
        out.setdefault(key, c)
    return out


def ms_of(c):
    if not c or c.get("error") or not c.get("seconds"):
        return None
    return c["median_seconds"] * 1e3


def gib(v):
    return None if v is None else v / GIB


def step_rows(bench, peer, bw):
    d = ddo_candidates(bench)
    p = (peer or {}).get("results", {})
    resident_ms = ms_of(d.get("resident"))
    rows = []
    for key, workload, peer_key, budgeted in (
            ("resident", "resident", "resident", False),
            ("resident", "resident, Diffusers + torch.compile (default mode)", "resident_compiled",
             False),
            ("leaf", "leaf + stream, zero budget", "leaf_stream", False),
            ("block", "block + stream (1 block a group), zero budget", "block_stream", False),
            ("budget", "leaf + stream, budget=10GiB", None, True),
            ("auto", "--preset auto under --vram-budget 12GiB", None, True)):
        c = d.get(key) or {}
        q = p.get(peer_key, {}) if peer_key else {}
        q = {} if "skipped" in q else q
        streamed = c.get("streamed_bytes_per_forward") or 0
        floor = streamed / bw * 1e3 if streamed and bw else None
        if budgeted and floor is not None:
            floor = max(floor, resident_ms or 0.0)
        ours, theirs = ms_of(c), q.get("median_ms")
        setup_ns = c.get("staging_setup_ns")
        rows.append({
            "workload": workload,
            "ddo_label": c.get("label"),
            "ddo_error": c.get("error"),
            "ddo_ms": ours,
            "diffusers_ms": theirs,
            "floor_ms": floor,
            "ddo_ratio_to_floor": ours / floor if ours and floor else None,
            "diffusers_ratio_to_floor": theirs / floor if theirs and floor else None,
            "ddo_over_diffusers": ours / theirs if ours and theirs else None,
            "streamed_bytes_per_step": streamed or None,
            "ddo_peak_bytes": c.get("peak_bytes") if ours else None,
            "diffusers_peak_bytes": q.get("peak_bytes"),
            "diffusers_host_rss_bytes": q.get("host_rss_peak_bytes"),
            # `ddo bench` reports these per candidate only where its JSON has them.
            "ddo_pinned_bytes": c.get("peak_pinned_host_bytes"),
            "diffusers_pinned_bytes": q.get("pinned_host_bytes"),
            "ddo_setup_seconds": c.get("setup_seconds", setup_ns / 1e9 if setup_ns else None),
            "diffusers_setup_seconds": q.get("setup_seconds") if q else None,
            "diffusers_compile_seconds": q.get("compile_seconds") if q else None,
            "ddo_ratio_to_compute_floor": c.get("ratio_to_compute_floor"),
            "diffusers_skipped": p.get(peer_key, {}).get("skipped") if peer_key else None,
        })
    return rows


def pipeline_rows(run, peer, bw):
    """Per phase of the whole pipeline, both sides."""
    ddo_phases = {p["phase"]: p for p in (run or {}).get("phases", [])}
    peer_phases = {p["phase"]: p for p in (peer or {}).get("phases", [])}
    steps = (run or {}).get("steps") or (peer or {}).get("steps") or 28
    comps = {c["component"]: c for c in (run or {}).get("components", [])}

    def counters(name):
        return ((comps.get(name) or {}).get("metrics") or {}).get("counters") or {}

    streamed = counters("transformer").get("streamed_bytes_per_forward") or 0
    peer_weights = ((peer or {}).get("weight_bytes") or {}).get("transformer") or 0
    rows = []
    for name in ("prompt_encoding", "denoise", "decode", "denoise_block_level"):
        dp, pp = ddo_phases.get(name), peer_phases.get(name)
        if dp is None and pp is None and name == "denoise_block_level":
            continue
        d_setup = sum(s["seconds"] for s in dp.get("setup_seconds", [])) if dp else None
        # Seconds DDO spent attaching in the background during the phase before.
        d_prepared = sum(s["seconds"] for s in dp.get("prepared_seconds", [])) if dp else None
        row = {
            "phase": name,
            "ddo_seconds": dp["seconds"] if dp else None,
            "diffusers_seconds": pp["seconds"] if pp else None,
            "ddo_setup_seconds": d_setup,
            "ddo_prepared_seconds": d_prepared or None,
            "diffusers_setup_seconds": pp.get("setup_seconds") if pp else None,
            "ddo_peak_bytes": dp.get("peak_bytes") if dp else None,
            "diffusers_peak_bytes": pp.get("peak_bytes") if pp else None,
            "diffusers_host_rss_bytes": pp.get("host_rss_peak_bytes") if pp else None,
            "ddo_routes": dp.get("components") if dp else None,
            "diffusers_offload": pp.get("offload") if pp else None,
        }
        if name.startswith("denoise"):
            if dp:
                row["ddo_step_seconds"] = (dp["seconds"] - (d_setup or 0.0)) / steps
                row["ddo_floor_seconds"] = steps * streamed / bw if streamed and bw else None
            if pp:
                row["diffusers_step_seconds"] = pp.get("loop_seconds", 0.0) / steps
                row["diffusers_median_step_seconds"] = pp.get("median_step_seconds")
                row["diffusers_floor_seconds"] = (steps * peer_weights / bw
                                                  if peer_weights and bw else None)
        rows.append(row)
    main = [r for r in rows if r["phase"] != "denoise_block_level"]
    total = {"phase": "total (3 phases)"}
    for side in ("ddo", "diffusers"):
        vals = [r[f"{side}_seconds"] for r in main]
        total[f"{side}_seconds"] = sum(vals) if vals and all(v is not None for v in vals) else None
        peaks = [r[f"{side}_peak_bytes"] for r in main if r[f"{side}_peak_bytes"] is not None]
        total[f"{side}_peak_bytes"] = max(peaks) if peaks else None
    rows.append(total)
    components = []
    for name, c in comps.items():
        k = counters(name)
        components.append({
            "component": name,
            "route": c.get("route"),
            "streamed_bytes_per_forward": k.get("streamed_bytes_per_forward"),
            "resident_weight_bytes": k.get("resident_weight_bytes"),
            "peak_pinned_host_bytes": k.get("peak_pinned_host_bytes"),
            "staging_setup_seconds": (k["staging_setup_ns"] / 1e9
                                      if k.get("staging_setup_ns") is not None else None),
            "h2d_bytes": k.get("h2d_bytes"),
            "forwards": k.get("forwards"),
        })
    return rows, components


def fmt(v, spec=".1f", scale=1.0):
    return "-" if v is None else format(v * scale, spec)


def report(out, work):
    raw = {k: load(os.path.join(out, f)) for k, f in PART_FILES.items()}
    parts = parts_table(work)
    rss = {p["part"]: p["peak_rss_bytes"] for p in parts}
    bench, run = raw["ddo_bench"], raw["ddo_run"]
    peer_step, peer_pipe = raw["peer_step"], raw["peer_pipeline"]
    ddo_bw = (bench or {}).get("link_bytes_per_sec")
    torch_bw = (peer_step or {}).get("pinned_h2d_bytes_per_sec")
    bw = ddo_bw or torch_bw
    steps = step_rows(bench, peer_step, bw)
    phases, components = pipeline_rows(run, peer_pipe, bw)
    peer_any = peer_step or peer_pipe or {}
    host = {
        "ddo_bench_peak_rss_bytes": rss.get("ddo_bench"),
        "ddo_run_peak_rss_bytes": rss.get("ddo_run"),
        "diffusers_step_peak_rss_bytes": (peer_step or {}).get("process_peak_rss_bytes",
                                                               rss.get("peer_step")),
        "diffusers_pipeline_peak_rss_bytes": (peer_pipe or {}).get("process_peak_rss_bytes",
                                                                   rss.get("peer_pipeline")),
        "diffusers_weight_bytes": sum(((peer_pipe or {}).get("weight_bytes") or {}).values()) or None,
    }
    doc = {
        "gpu": peer_any.get("gpu"), "torch": peer_any.get("torch"),
        "diffusers": peer_any.get("diffusers"),
        "transformers": (peer_pipe or {}).get("transformers"),
        "ddo_model": (bench or run or {}).get("model"),
        "link": {"ddo_pinned_h2d_bytes_per_sec": ddo_bw, "torch_pinned_h2d_bytes_per_sec": torch_bw,
                 "floor_uses": "ddo" if ddo_bw else ("torch" if torch_bw else None)},
        "parts": parts, "transformer_step": steps, "pipeline": phases,
        "ddo_components": components, "host": host, "raw": raw,
    }
    with open(os.path.join(out, "bench_full.json"), "w") as f:
        json.dump(doc, f, indent=2)

    lines = [
        "# DDO vs Diffusers, FLUX.1-dev at full size (random bf16 weights), one job",
        "",
        f"GPU {doc['gpu'] or '-'}, torch {doc['torch'] or '-'}, Diffusers {doc['diffusers'] or '-'}, "
        f"transformers {doc['transformers'] or '-'}; pinned host->device "
        f"{fmt(ddo_bw, '.2f', 1e-9)} GB/s (DDO), {fmt(torch_bw, '.2f', 1e-9)} GB/s (torch); "
        f"floors use {doc['link']['floor_uses'] or 'no measurement'}.",
        "",
        "| part | exit | seconds | timeout | peak RSS GiB |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for p in parts:
        lines.append(f"| {p['part']} | {p['exit']}{' (timed out)' if p['timed_out'] else ''} "
                     f"| {fmt(p['seconds'])} | {p['timeout_seconds'] or '-'} "
                     f"| {fmt(gib(p['peak_rss_bytes']), '.2f')} |")
    lines += [
        "",
        "## Transformer step (1024x1024: 4096 image + 512 text tokens, inputs on the device)",
        "",
        "| workload | DDO ms | Diffusers ms | floor ms | DDO x floor | Diffusers x floor "
        "| DDO / Diffusers | DDO peak GiB | Diffusers peak GiB | Diffusers RSS GiB "
        "| DDO pinned GiB | Diffusers pinned GiB | DDO setup s | Diffusers setup s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in steps:
        ddo = fmt(r["ddo_ms"]) if not r["ddo_error"] else "refused"
        lines.append(
            f"| {r['workload']} | {ddo} | {fmt(r['diffusers_ms'])} | {fmt(r['floor_ms'])} "
            f"| {fmt(r['ddo_ratio_to_floor'], '.3f')} | {fmt(r['diffusers_ratio_to_floor'], '.3f')} "
            f"| {fmt(r['ddo_over_diffusers'], '.3f')} | {fmt(gib(r['ddo_peak_bytes']), '.2f')} "
            f"| {fmt(gib(r['diffusers_peak_bytes']), '.2f')} "
            f"| {fmt(gib(r['diffusers_host_rss_bytes']), '.2f')} "
            f"| {fmt(gib(r['ddo_pinned_bytes']), '.2f')} | {fmt(gib(r['diffusers_pinned_bytes']), '.2f')} "
            f"| {fmt(r['ddo_setup_seconds'], '.2f')} | {fmt(r['diffusers_setup_seconds'], '.2f')} |")
    notes = [f"{r['workload']}: DDO refused: {r['ddo_error']}" for r in steps if r["ddo_error"]]
    notes += [f"{r['workload']}: Diffusers skipped: {r['diffusers_skipped']}"
              for r in steps if r["diffusers_skipped"]]
    lines += [""] + [f"- {n}" for n in notes] + [
        f"- Host RSS: `ddo bench` peaked at {fmt(gib(host['ddo_bench_peak_rss_bytes']), '.2f')} GiB "
        "for the whole process (it builds every component of the pipeline; per candidate it "
        "reports no RSS); Diffusers' column is per case (VmRSS sampled every 20 ms).",
        "",
        "## Whole pipeline (1024x1024, 28 steps, guidance 3.5, 512 T5 tokens, 12 GiB device budget)",
        "",
        "| phase | DDO s | Diffusers s | DDO setup s | Diffusers setup s | DDO s/step "
        "| Diffusers s/step | floor s (DDO / Diffusers) | DDO peak GiB | Diffusers peak GiB "
        "| Diffusers RSS GiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in phases:
        floor = "-"
        if r.get("ddo_floor_seconds") or r.get("diffusers_floor_seconds"):
            floor = f"{fmt(r.get('ddo_floor_seconds'), '.2f')} / {fmt(r.get('diffusers_floor_seconds'), '.2f')}"
        lines.append(
            f"| {r['phase']} | {fmt(r['ddo_seconds'], '.2f')} | {fmt(r['diffusers_seconds'], '.2f')} "
            f"| {fmt(r.get('ddo_setup_seconds'), '.2f')} | {fmt(r.get('diffusers_setup_seconds'), '.2f')} "
            f"| {fmt(r.get('ddo_step_seconds'), '.3f')} | {fmt(r.get('diffusers_step_seconds'), '.3f')} "
            f"| {floor} | {fmt(gib(r['ddo_peak_bytes']), '.2f')} | {fmt(gib(r['diffusers_peak_bytes']), '.2f')} "
            f"| {fmt(gib(r.get('diffusers_host_rss_bytes')), '.2f')} |")
    lines += [
        "",
        f"Peak host RSS of the whole pipeline: DDO {fmt(gib(host['ddo_run_peak_rss_bytes']), '.2f')} GiB "
        f"(`ddo run`), Diffusers {fmt(gib(host['diffusers_pipeline_peak_rss_bytes']), '.2f')} GiB "
        f"for {fmt(gib(host['diffusers_weight_bytes']), '.2f')} GiB of weights. DDO's phases include "
        "each component's attach (setup; where DDO attached a component in the background "
        "during the phase before, that time overlaps the phase before: `ddo_prepared_seconds` "
        "in bench_full.json); its s/step excludes the setup. Diffusers' prompt "
        "encoding and decode move the models to the GPU and back inside the phase; its denoise "
        "setup is enable_group_offload (pinning the weights).",
        "",
        "Before the first phase: DDO "
        + (", ".join(f"{k} {v:.2f} s" for k, v in ((run or {}).get("stage_seconds") or {}).items()
                     if k not in ("phases", "output")) or "-")
        + "; Diffusers built its random weights in "
        + (", ".join(f"{k} {v:.2f} s" for k, v in ((peer_pipe or {}).get("build_seconds") or {}).items())
           or "-")
        + " (neither is part of the phases).",
        "",
        "| DDO component | route | streamed/step GiB | resident GiB | peak pinned GiB | staging setup s |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for c in components:
        lines.append(
            f"| {c['component']} | {c['route'] or '-'} | {fmt(gib(c['streamed_bytes_per_forward']), '.2f')} "
            f"| {fmt(gib(c['resident_weight_bytes']), '.2f')} | {fmt(gib(c['peak_pinned_host_bytes']), '.2f')} "
            f"| {fmt(c['staging_setup_seconds'], '.2f')} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "bench_full.md"), "w") as f:
        f.write(text)
    print(text)


def main():
    if len(sys.argv) >= 4 and sys.argv[1] == "measure":
        sys.exit(measure(sys.argv[2], sys.argv[3:]))
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    out = sys.argv[1]
    report(out, sys.argv[2] if len(sys.argv) == 3 else out)


if __name__ == "__main__":
    main()
