"""The report of `cargo xtask bench --host-ram` (issue 35): reads OUT/cases.tsv (one line per
case: name, GiB of MemAvailable asked for (0: all free), exit status, MemAvailable at start in
MiB, lowest MemAvailable in KiB, maximum RSS in KiB, wall time, whether the helper process
survived) and each case's `ddo run --json` output (OUT/NAME.json), and writes OUT/host_ram.json
and OUT/host_ram.md. The steady step is the median denoise step after the first two; its
ratio is to the all-free case's of the same job.

Usage: python3 bench_host_ram_report.py OUT
"""

import json
import os
import statistics
import sys


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    cases = []
    with open(os.path.join(out, "cases.tsv")) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 8:
                continue
            name, gib, rc, before, low, rss, wall, alive = parts
            run = load(os.path.join(out, name + ".json")) or {}
            steps = run.get("denoise_step_seconds") or []
            steady = statistics.median(steps[2:]) if len(steps) > 2 else None
            phases = {p.get("phase"): p.get("seconds") for p in run.get("phases", [])}
            plan = run.get("memory_plan") or {}
            cases.append({
                "case": name,
                "available_gib_asked": int(gib),
                "available_mib_at_start": int(before),
                "lowest_available_mib": int(low or 0) // 1024,
                "exit": int(rc),
                "image": int(rc) == 0 and bool(run.get("outputs")),
                "other_process_survived": alive,
                "wall": wall,
                "total_seconds": run.get("total_seconds"),
                "phases_seconds": phases,
                "steady_step_seconds": steady,
                "max_rss_bytes": int(rss or 0) * 1024,
                "host_budget_bytes": plan.get("host_budget_bytes"),
                "host_budget_source": plan.get("host_budget_source"),
                "plan_host_bytes": {p.get("phase"): p.get("host_bytes") for p in plan.get("phases", [])},
            })
    free = next((c for c in cases if c["case"] == "free"), None)
    for c in cases:
        base = free and free["steady_step_seconds"]
        c["steady_vs_free"] = (c["steady_step_seconds"] / base) if base and c["steady_step_seconds"] else None
    disk = ""
    try:
        with open(os.path.join(out, "disk.txt")) as f:
            disk = f.read().strip().splitlines()[-1]
    except (OSError, IndexError):
        pass
    doc = {"disk": disk, "cases": cases}
    with open(os.path.join(out, "host_ram.json"), "w") as f:
        json.dump(doc, f, indent=2)
    gib = lambda b: "-" if b is None else "%.2f" % (b / 2**30)
    sec = lambda s: "-" if s is None else "%.3f" % s
    lines = [
        "# DDO under smaller machines (FLUX.1-dev folder, --vram-budget 12GiB, page cache dropped)",
        "",
        "disk: " + disk,
        "",
        "| case | MemAvailable at start (GiB) | image | other process survived | time to image (s) | prompt (s) | denoise (s) | steady step (s) | x free | max RSS (GiB) | host budget (GiB) | lowest MemAvailable (GiB) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in cases:
        p = c["phases_seconds"]
        lines.append("| %s | %.1f | %s | %s | %s | %s | %s | %s | %s | %s | %s | %.1f |" % (
            c["case"], c["available_mib_at_start"] / 1024, "yes" if c["image"] else "no (exit %d)" % c["exit"],
            c["other_process_survived"], sec(c["total_seconds"]), sec(p.get("prompt_encoding")),
            sec(p.get("denoise")), sec(c["steady_step_seconds"]),
            "-" if c["steady_vs_free"] is None else "%.3f" % c["steady_vs_free"],
            gib(c["max_rss_bytes"]), gib(c["host_budget_bytes"]), c["lowest_available_mib"] / 1024))
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "host_ram.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
