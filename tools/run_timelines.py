#!/usr/bin/env python3
"""Prints the first and the last streamed forward's timeline of each component of a `ddo run --json`
output (or a `ddo bench` candidate's metrics), run with the route option `timeline=true`, side by
side: the forward on the device, the host's time to queue it, the copy engine's busy time and rate,
when compute reached the first streamed unit, and the time compute waited between units. A phase's
first forward (it makes the resident part resident, takes a new ring and pays every first call)
reads apart from the steady ones. Standard library only.

Usage: python3 tools/run_timelines.py RUN.json [--units N] [--waits N]
       (--units N: also the first N units of each timeline: copy and compute, ms from the
       forward's start event, and when the host reached each unit, ms from when it recorded
       that event; --waits N: the N longest host calls into the driver or libraries while the
       host queued the forward (`host_waits`: each call, when it started and how long it took,
       ms; 10 by default), with the unit the host was at)
"""

import argparse
import json
import sys


def ms(ns):
    return ns / 1e6


def summary(t):
    """One timeline's figures (ms, GB) as a dict."""
    units = t["units"]
    busy = sum(ms(u["copy_end_ns"] - u["copy_start_ns"]) for u in units)
    waited = 0.0
    for prev, u in zip(units, units[1:]):
        waited += max(0.0, ms(u["compute_start_ns"] - prev["compute_end_ns"]))
    gb = sum(u["bytes"] for u in units) / 1e9
    # The device reached a unit no earlier than the host did (host time counted from the start
    # event's recording, which the device ran no earlier): it waited for the program there.
    begin = t.get("host_begin_ns", 0)
    traced = [u for u in units if u.get("host_enter_ns", 0) > 0]
    host_bound = sum(
        1 for u in traced if u["host_enter_ns"] - begin >= u["compute_start_ns"] - 200_000
    )
    return {
        "host_bound_units": host_bound,
        "host_traced_units": len(traced),
        "forward_ms": ms(t["forward_ns"]),
        "host_begin_ms": ms(t.get("host_begin_ns", 0)),
        "host_queue_ms": ms(t.get("host_forward_ns", 0)),
        "copy_busy_ms": busy,
        "copy_gb_s": gb / (busy / 1e3) if busy > 0 else 0.0,
        "gb": gb,
        "first_compute_ms": ms(units[0]["compute_start_ns"]) if units else 0.0,
        "compute_waited_ms": waited,
    }


def components(doc):
    """(name, metrics) of each component in a run output, or of each bench candidate."""
    if "components" in doc:
        for c in doc["components"]:
            yield c["component"], c.get("metrics", {})
    for c in doc.get("candidates", []):
        yield c.get("label", "?"), c.get("metrics") or {}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_json")
    ap.add_argument("--units", type=int, default=0)
    ap.add_argument("--waits", type=int, default=10)
    args = ap.parse_args()
    try:
        with open(args.run_json) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"{args.run_json}: not a readable JSON file ({e}); give a `ddo run --json` output")
    if not isinstance(doc, dict):
        sys.exit(f"{args.run_json}: not a `ddo run --json` output (a JSON object)")
    found = False
    for name, m in components(doc):
        for key in ("first_timeline", "timeline"):
            t = m.get(key)
            if not t:
                continue
            found = True
            s = summary(t)
            print(
                f"{name} {key}: forward {s['forward_ms']:.2f} ms, host queued it in "
                f"{s['host_queue_ms']:.2f} ms ({s['host_begin_ms']:.2f} before the start event), "
                f"copies busy {s['copy_busy_ms']:.2f} ms for {s['gb']:.2f} GB "
                f"({s['copy_gb_s']:.1f} GB/s), first streamed unit computed at "
                f"{s['first_compute_ms']:.2f} ms, compute waited {s['compute_waited_ms']:.2f} ms "
                "between units"
                + (
                    f"; the device reached {s['host_bound_units']} of {s['host_traced_units']} "
                    "units within 0.2 ms of the host (waiting for the program there)"
                    if s["host_traced_units"]
                    else ""
                )
            )
            waits = t.get("host_waits", [])
            if waits:
                total = sum(ms(w["ns"]) for w in waits)
                print(f"    host calls of 0.5 ms or more: {len(waits)}, {total:.2f} ms in all")
            for w in sorted(waits, key=lambda w: -w["ns"])[: args.waits]:
                at = w["at_ns"]
                unit = max(
                    (u for u in t["units"] if 0 < u.get("host_enter_ns", 0) <= at),
                    key=lambda u: u["host_enter_ns"],
                    default=None,
                )
                where = f"after unit {unit['unit']} ({unit['label'][:48]})" if unit else "before the first unit"
                print(f"      {w['call']:40s} at {ms(at):8.2f} ms, {ms(w['ns']):8.2f} ms, {where}")
            for u in t["units"][: args.units]:
                print(
                    f"    {u['unit']:4d} {u['label'][:56]:56s} {u['bytes'] / 1e6:8.1f} MB  copy "
                    f"{ms(u['copy_start_ns']):8.2f}-{ms(u['copy_end_ns']):8.2f}  compute "
                    f"{ms(u['compute_start_ns']):8.2f}-{ms(u['compute_end_ns']):8.2f}"
                    + (
                        f"  host {ms(u['host_enter_ns'] - t.get('host_begin_ns', 0)):8.2f}"
                        if u.get("host_enter_ns", 0) > 0
                        else ""
                    )
                )
    if not found:
        sys.exit("no timeline in the file: run with the route option timeline=true")


if __name__ == "__main__":
    main()
