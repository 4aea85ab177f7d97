#!/usr/bin/env python3
"""Compares two candidates' `--profile` of one `ddo bench --out-json` file call by call: where the
second loses device time against the first (a streamed route against resident, say), by class (time
inside the ops and the compute stream's idle time before them) and the calls that lost most. The two
forwards must run the same ops in the same order (one model, one workload). Standard library only.

Usage: python3 tools/profile_diff.py BENCH.json [A B] [--top 15] [--window 100]
       (A, B: candidate indexes or labels; default the first two; --window N: B-A over each
       run of N calls in order, with the classes in it, so a loss spread evenly over the
       forward reads apart from one that sits in a stretch of it)
"""

import argparse
import json
import sys
from collections import defaultdict


def pick(candidates, key):
    """The candidate at index `key`, or the one whose label is `key`."""
    if key.isdigit():
        return candidates[int(key)]
    for c in candidates:
        if c["label"] == key:
            return c
    sys.exit(f"no candidate {key!r}: {[c['label'] for c in candidates]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench_json")
    ap.add_argument("a", nargs="?", default="0")
    ap.add_argument("b", nargs="?", default="1")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--window", type=int, default=0)
    args = ap.parse_args()
    with open(args.bench_json) as f:
        bench = json.load(f)
    a, b = pick(bench["candidates"], args.a), pick(bench["candidates"], args.b)
    calls = []
    for c in (a, b):
        p = c.get("op_profile") or {}
        if not p.get("calls"):
            sys.exit(f"{c['label']}: no per-call profile (run ddo bench with --profile)")
        calls.append(p["calls"])
    ca, cb = calls
    if [x["op"] for x in ca] != [x["op"] for x in cb]:
        sys.exit(f"the two forwards ran different ops ({len(ca)} and {len(cb)} calls)")
    ms = 1e-6
    print(f"A: {a['label']}  median {a['median_seconds'] * 1e3:.2f} ms")
    print(f"B: {b['label']}  median {b['median_seconds'] * 1e3:.2f} ms")
    ta, tb = sum(x["ns"] for x in ca), sum(x["ns"] for x in cb)
    ia, ib = sum(x["idle_before_ns"] for x in ca), sum(x["idle_before_ns"] for x in cb)
    print(f"in ops: A {ta * ms:.3f} ms, B {tb * ms:.3f} ms ({(tb - ta) * ms:+.3f}); "
          f"idle between: A {ia * ms:.3f} ms, B {ib * ms:.3f} ms ({(ib - ia) * ms:+.3f})")
    by = defaultdict(lambda: [0, 0, 0])
    for x, y in zip(ca, cb):
        d = by[x["op"]]
        d[0] += 1
        d[1] += y["ns"] - x["ns"]
        d[2] += y["idle_before_ns"] - x["idle_before_ns"]
    print(f"\n{'class':<24} {'calls':>6} {'B-A in op':>12} {'B-A idle before':>16}")
    for op, (n, dop, didle) in sorted(by.items(), key=lambda kv: -(kv[1][1] + kv[1][2])):
        print(f"{op:<24} {n:>6} {dop * ms:>9.3f} ms {didle * ms:>13.3f} ms")
    if args.window > 0:
        print(f"\nB-A by runs of {args.window} calls (first call, A ms, B ms, B-A ms, classes):")
        for i in range(0, len(ca), args.window):
            wa = sum(x["ns"] + x["idle_before_ns"] for x in ca[i:i + args.window]) * ms
            wb = sum(y["ns"] + y["idle_before_ns"] for y in cb[i:i + args.window]) * ms
            ops = sorted({x["op"] for x in ca[i:i + args.window]})
            print(f"{i:>6} {wa:>9.3f} {wb:>9.3f} {wb - wa:>+8.3f}  {', '.join(ops)}")
    worst = sorted(range(len(ca)), key=lambda i: -((cb[i]["ns"] + cb[i]["idle_before_ns"])
                                                   - (ca[i]["ns"] + ca[i]["idle_before_ns"])))
    print(f"\nthe {args.top} calls B lost most on (position, class, A op/idle, B op/idle, us):")
    for i in worst[: args.top]:
        x, y = ca[i], cb[i]
        print(f"{i:>6} {x['op']:<24} {x['ns'] / 1e3:>9.1f} {x['idle_before_ns'] / 1e3:>9.1f}"
              f" {y['ns'] / 1e3:>9.1f} {y['idle_before_ns'] / 1e3:>9.1f}")


if __name__ == "__main__":
    main()
