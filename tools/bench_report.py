"""Merges the two sides of `cargo xtask bench --peer diffusers` into bench.json, a markdown
table (bench.md) and an SVG plot (bench.svg). Standard library only.

Usage: python3 tools/bench_report.py PEER_JSON DDO_JSON OUT_DIR [PINNED_LIMIT_BYTES]

Floors and targets (issue 6), with B = DDO's pinned host->device bandwidth measured in the
same run:
  transformer_leaf_stream              floor = streamed bytes / B; target <= 1.05 x floor,
                                       peak <= Diffusers' leaf+stream peak
  transformer_leaf_stream_budget_4GiB  floor = max(DDO resident step, streamed bytes / B);
                                       target <= 1.10 x floor
  vae_leaf_no_stream                   floor = DDO resident decode; target <= 1.10 x floor
  vae_leaf_stream                      floor = DDO resident decode; target <= 1.05 x floor
  host memory (zero-budget run)        RSS <= 1.10 x weight bytes; pinned <= pinned_limit
"""

import json
import os
import sys

GIB = float(1 << 30)


def load(path):
    with open(path) as f:
        return json.load(f)


def main():
    peer, ddo, out = load(sys.argv[1]), load(sys.argv[2]), sys.argv[3]
    pinned_limit = int(sys.argv[4]) if len(sys.argv) > 4 else 16 << 30
    os.makedirs(out, exist_ok=True)
    bw = ddo["pinned_h2d_bytes_per_sec"]
    d, p = ddo["results"], peer["results"]

    def ms(side, name):
        r = side.get(name)
        return r["median_ms"] if r else None

    rows = []

    def row(workload, ddo_name, peer_name, floor_ms, target, extra=""):
        ours = ms(d, ddo_name)
        theirs = ms(p, peer_name) if peer_name else None
        ratio_floor = ours / floor_ms if ours and floor_ms else None
        rows.append({
            "workload": workload,
            "ddo_ms": ours,
            "diffusers_ms": theirs,
            "floor_ms": floor_ms,
            "ratio_to_floor": ratio_floor,
            "ratio_to_diffusers": ours / theirs if ours and theirs else None,
            "target_ratio_to_floor": target,
            "meets_target": ratio_floor is not None and ratio_floor <= target,
            "ddo_peak_gib": d[ddo_name]["peak_allocated_bytes"] / GIB if ddo_name in d else None,
            "diffusers_peak_gib": (p[peer_name]["peak_allocated_bytes"] / GIB
                                   if peer_name and peer_name in p else None),
            "note": extra,
        })

    zero = d.get("transformer_leaf_stream", {})
    zero_bytes = zero.get("h2d_bytes_per_forward", 0)
    row("flux 5+10 resident", "transformer_resident", "transformer_resident", None, float("inf"))
    row("flux 5+10 leaf+stream, zero budget", "transformer_leaf_stream",
        "transformer_leaf_stream", zero_bytes / bw * 1e3 if zero_bytes else None, 1.05,
        f"{zero_bytes / GIB:.2f} GiB streamed per step")
    bud = d.get("transformer_leaf_stream_budget_4GiB", {})
    bud_bytes = bud.get("h2d_bytes_per_forward", 0)
    resident_ms = ms(d, "transformer_resident")
    bud_floor = max(resident_ms or 0.0, bud_bytes / bw * 1e3)
    row("flux 5+10 leaf+stream, 4 GiB budget", "transformer_leaf_stream_budget_4GiB",
        None, bud_floor, 1.10, f"{bud_bytes / GIB:.2f} GiB streamed per step")
    vae_res = ms(d, "vae_resident")
    row("vae decode 1024 resident", "vae_resident", "vae_resident", None, float("inf"))
    row("vae decode 1024 leaf, no stream", "vae_leaf_no_stream", "vae_leaf_no_stream",
        vae_res, 1.10)
    row("vae decode 1024 leaf+stream", "vae_leaf_stream", "vae_leaf_stream", vae_res, 1.05)

    peer_zero = p.get("transformer_leaf_stream", {})
    weights = zero.get("weight_bytes", 0)
    host = {
        "ddo_rss_bytes": zero.get("host_rss_bytes"),
        "ddo_rss_over_weights": zero.get("host_rss_bytes", 0) / weights if weights else None,
        "ddo_pinned_bytes": zero.get("pinned_host_bytes"),
        "pinned_limit_bytes": pinned_limit,
        "diffusers_rss_bytes": peer_zero.get("host_rss_bytes"),
        "diffusers_rss_over_weights": (peer_zero.get("host_rss_bytes", 0) / weights
                                       if weights else None),
        "diffusers_pinned_bytes": peer_zero.get("pinned_host_bytes"),
        "weight_bytes": weights,
    }
    host["meets_target"] = bool(
        host["ddo_rss_over_weights"] is not None and host["ddo_rss_over_weights"] <= 1.10
        and (host["ddo_pinned_bytes"] or 0) <= pinned_limit)
    peak_ok = (zero.get("peak_allocated_bytes", 1 << 62)
               <= peer_zero.get("peak_allocated_bytes", 0) or None)

    doc = {"gpu": peer.get("gpu"), "torch": peer.get("torch"),
           "diffusers": peer.get("diffusers"),
           "ddo_pinned_h2d_gbps": bw / 1e9,
           "torch_pinned_h2d_gbps": peer.get("pinned_h2d_bytes_per_sec", 0) / 1e9,
           "route_options": ddo.get("route_options", ""),
           "rows": rows, "host_memory_zero_budget": host,
           "zero_budget_peak_within_diffusers": peak_ok,
           "ddo": ddo, "diffusers_side": peer}
    with open(os.path.join(out, "bench.json"), "w") as f:
        json.dump(doc, f, indent=2)

    def fmt(v, spec=".1f"):
        return "-" if v is None else format(v, spec)

    lines = [
        f"GPU {peer.get('gpu')}, torch {peer.get('torch')}, Diffusers {peer.get('diffusers')}; "
        f"pinned h2d {bw / 1e9:.1f} GB/s (DDO), "
        f"{peer.get('pinned_h2d_bytes_per_sec', 0) / 1e9:.1f} GB/s (torch)",
        "",
        "| workload | DDO ms | Diffusers ms | floor ms | DDO/floor | target | DDO/Diffusers "
        "| DDO peak GiB | Diffusers peak GiB | note |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        target = "-" if r["target_ratio_to_floor"] == float("inf") else \
            f"<= {r['target_ratio_to_floor']:.2f}" + (" ok" if r["meets_target"] else " MISSED")
        lines.append(
            f"| {r['workload']} | {fmt(r['ddo_ms'])} | {fmt(r['diffusers_ms'])} "
            f"| {fmt(r['floor_ms'])} | {fmt(r['ratio_to_floor'], '.3f')} | {target} "
            f"| {fmt(r['ratio_to_diffusers'], '.3f')} | {fmt(r['ddo_peak_gib'], '.2f')} "
            f"| {fmt(r['diffusers_peak_gib'], '.2f')} | {r['note']} |")
    lines += [
        "",
        "Host memory during the zero-budget transformer run: "
        f"DDO RSS {fmt((host['ddo_rss_bytes'] or 0) / GIB, '.2f')} GiB "
        f"({fmt(host['ddo_rss_over_weights'], '.2f')}x weights), pinned "
        f"{fmt((host['ddo_pinned_bytes'] or 0) / GIB, '.2f')} GiB (limit "
        f"{pinned_limit / GIB:.2f} GiB); Diffusers RSS "
        f"{fmt((host['diffusers_rss_bytes'] or 0) / GIB, '.2f')} GiB "
        f"({fmt(host['diffusers_rss_over_weights'], '.2f')}x), pinned "
        f"{fmt((host['diffusers_pinned_bytes'] or 0) / GIB, '.2f')} GiB. "
        f"Target (RSS <= 1.10x, pinned <= limit): {'ok' if host['meets_target'] else 'MISSED'}.",
    ]
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))

    # SVG: one pair of bars (DDO, Diffusers) per workload, median ms, and the floor as a tick.
    width, bar_h, gap, left = 900, 14, 12, 300
    h = 40 + len(rows) * (2 * bar_h + gap) + 30
    top = max([v for r in rows for v in (r["ddo_ms"], r["diffusers_ms"], r["floor_ms"])
               if v] or [1.0])
    scale = (width - left - 80) / top
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{h}" '
           'font-family="sans-serif" font-size="12">',
           '<text x="10" y="20" font-size="14">median ms per step / decode '
           '(blue: DDO, orange: Diffusers, black tick: floor)</text>']
    y = 40
    for r in rows:
        svg.append(f'<text x="10" y="{y + bar_h + 4}">{r["workload"]}</text>')
        for i, (key, color) in enumerate((("ddo_ms", "#1f77b4"), ("diffusers_ms", "#ff7f0e"))):
            v = r[key]
            if v:
                yy = y + i * bar_h
                svg.append(f'<rect x="{left}" y="{yy}" width="{v * scale:.1f}" '
                           f'height="{bar_h - 2}" fill="{color}"/>')
                svg.append(f'<text x="{left + v * scale + 4:.1f}" y="{yy + bar_h - 3}">'
                           f'{v:.1f}</text>')
        if r["floor_ms"]:
            x = left + r["floor_ms"] * scale
            svg.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y - 2}" y2="{y + 2 * bar_h}" '
                       'stroke="black" stroke-width="2"/>')
        y += 2 * bar_h + gap
    svg.append("</svg>")
    with open(os.path.join(out, "bench.svg"), "w") as f:
        f.write("\n".join(svg) + "\n")


if __name__ == "__main__":
    main()
