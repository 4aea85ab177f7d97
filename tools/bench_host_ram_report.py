"""The report of `cargo xtask bench --host-ram` (issue 35): reads OUT/cases.tsv (one line per
case: name, GiB of MemAvailable asked for (0: all free), exit status, MemAvailable at start in
MiB, lowest MemAvailable in KiB, maximum RSS in KiB, wall time, whether the helper process
survived) and each case's `ddo run --json` output (OUT/NAME.json), and writes OUT/host_ram.json
and OUT/host_ram.md. The steady step is the median denoise step after the first two; its
ratio is to the all-free case's of the same job. A case's step bound is the largest of the
all-free case's steady step (compute and the link, at 1.0x the link floor there) and the
bytes its plan reads from the disk each step over the disk rate `dd` measured next to the
case (the mean of OUT/NAME.disk and OUT/NAME.disk-after, before and after it; else the job's
first measure, OUT/disk.txt).

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


def disk_rate(line):
    """Bytes per second from dd's last line (`N bytes (...) copied, S s, R GB/s`), or None."""
    try:
        head, tail = line.split(" copied, ")
        return int(head.split()[0]) / float(tail.split()[0])
    except (ValueError, IndexError):
        return None


def read_rate(path):
    """The rate in a dd output file, or None."""
    try:
        with open(path) as f:
            return disk_rate(f.read().strip().splitlines()[-1])
    except (OSError, IndexError):
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
            denoise_plan = next((p for p in plan.get("phases", []) if p.get("phase") == "denoise"), {})
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
                "plan_disk_bytes_per_step": denoise_plan.get("disk_bytes_per_forward", 0),
                "plan_streamed_bytes_per_step": denoise_plan.get("streamed_bytes_per_forward", 0),
                "plan_page_cache_bytes": denoise_plan.get("page_cache_bytes", 0),
                "steps": len(steps),
                "read_bytes": (run.get("host") or {}).get("read_bytes"),
            })
    disk = ""
    try:
        with open(os.path.join(out, "disk.txt")) as f:
            disk = f.read().strip().splitlines()[-1]
    except (OSError, IndexError):
        pass
    rate = disk_rate(disk)
    free = next((c for c in cases if c["case"] == "free"), None)
    for c in cases:
        base = free and free["steady_step_seconds"]
        c["steady_vs_free"] = (c["steady_step_seconds"] / base) if base and c["steady_step_seconds"] else None
        # The rate measured next to the case where there is one (a cloud volume drifts).
        near = [r for r in (read_rate(os.path.join(out, c["case"] + suffix)) for suffix in (".disk", ".disk-after")) if r]
        case_rate = sum(near) / len(near) if near else rate
        c["disk_bytes_per_second"] = case_rate
        disk_floor = c["plan_disk_bytes_per_step"] / case_rate if case_rate else None
        bound = max(x for x in (base, disk_floor, 0.0) if x is not None)
        c["disk_floor_seconds"] = disk_floor
        c["step_bound_seconds"] = bound or None
        c["steady_vs_bound"] = (c["steady_step_seconds"] / bound) if bound and c["steady_step_seconds"] else None
        # The block devices' reads during the case (/proc/vmstat pgpgin, KiB) over its seconds.
        try:
            with open(os.path.join(out, c["case"] + ".pgpgin")) as f:
                kib, secs = f.read().split()
            c["disk_read_bytes_in_case"] = int(kib) * 1024
            c["disk_read_rate_in_case"] = int(kib) * 1024 / float(secs) if float(secs) > 0 else None
        except (OSError, ValueError):
            c["disk_read_bytes_in_case"] = c["disk_read_rate_in_case"] = None
    folder = load(os.path.join(out, "folder.json")) or {}
    folder_bytes = folder.get("bytes")
    # The denoise's link bound (issue 35's "28-step denoise <= 1.03x its bound"): the steps
    # times the bytes the plan streams a step, at the link rate `ddo bench` measured in the
    # job (OUT/bench.json, DDO_BENCH=1).
    link = (load(os.path.join(out, "bench.json")) or {}).get("link_bytes_per_sec")
    for c in cases:
        denoise = (c.get("phases_seconds") or {}).get("denoise")
        streamed = c.get("plan_streamed_bytes_per_step") or 0
        bound = c["steps"] * streamed / link if link and streamed and c["steps"] else None
        c["denoise_link_bound_seconds"] = bound
        c["denoise_vs_link_bound"] = denoise / bound if denoise and bound else None
    for c in cases:
        # Issue 35's time-to-image bound: every byte of the folder read once from the disk,
        # plus the run's steps at its steady step.
        steps = c.pop("steps", 0)
        case_rate = c["disk_bytes_per_second"]
        if folder_bytes and case_rate and c["steady_step_seconds"]:
            c["image_bound_seconds"] = folder_bytes / case_rate + steps * c["steady_step_seconds"]
        else:
            c["image_bound_seconds"] = None
        t = c["total_seconds"]
        c["image_vs_bound"] = (t / c["image_bound_seconds"]) if t and c["image_bound_seconds"] else None
    # A coded folder's case (DDO_CODED=1) against the raw folder's of the same name.
    by_name = {c["case"]: c for c in cases}
    for c in cases:
        raw = by_name.get(c["case"][: -len("-coded")]) if c["case"].endswith("-coded") else None
        c["time_vs_raw"] = (
            c["total_seconds"] / raw["total_seconds"]
            if raw and c["total_seconds"] and raw["total_seconds"]
            else None
        )
    doc = {"disk": disk, "disk_bytes_per_second": rate, "folder_bytes": folder_bytes, "cases": cases}
    with open(os.path.join(out, "host_ram.json"), "w") as f:
        json.dump(doc, f, indent=2)
    gib = lambda b: "-" if b is None else "%.2f" % (b / 2**30)
    sec = lambda s: "-" if s is None else "%.3f" % s
    lines = [
        "# DDO under smaller machines (%s, page cache dropped)" % (folder.get("dir") or "the folder"),
        "",
        "disk: " + disk,
        "",
        "| case | MemAvailable at start (GiB) | image | other process survived | time to image (s) | x image bound | prompt (s) | denoise (s) | x link bound | steady step (s) | x free | disk/step (GiB) | disk (GB/s) | step bound (s) | x bound | max RSS (GiB) | host budget (GiB) | lowest MemAvailable (GiB) | read (GB) | time x raw | disk read in case (GB, GB/s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ratio = lambda x: "-" if x is None else "%.3f" % x
    for c in cases:
        p = c["phases_seconds"]
        lines.append("| %s | %.1f | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %.1f | %s | %s | %s |" % (
            c["case"], c["available_mib_at_start"] / 1024, "yes" if c["image"] else "no (exit %d)" % c["exit"],
            c["other_process_survived"], sec(c["total_seconds"]), ratio(c["image_vs_bound"]),
            sec(p.get("prompt_encoding")),
            sec(p.get("denoise")), ratio(c["denoise_vs_link_bound"]), sec(c["steady_step_seconds"]),
            ratio(c["steady_vs_free"]),
            gib(c["plan_disk_bytes_per_step"]),
            "-" if not c["disk_bytes_per_second"] else "%.2f" % (c["disk_bytes_per_second"] / 1e9),
            sec(c["step_bound_seconds"]), ratio(c["steady_vs_bound"]),
            gib(c["max_rss_bytes"]), gib(c["host_budget_bytes"]), c["lowest_available_mib"] / 1024,
            "-" if c["read_bytes"] is None else "%.2f" % (c["read_bytes"] / 1e9), ratio(c["time_vs_raw"]),
            "-" if c["disk_read_rate_in_case"] is None else "%.2f, %.2f" % (c["disk_read_bytes_in_case"] / 1e9, c["disk_read_rate_in_case"] / 1e9)))
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "host_ram.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
