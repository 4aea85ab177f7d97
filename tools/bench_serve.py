"""The client of `cargo xtask bench --serve` (issue 38): `ddo serve` on a FLUX.1-dev Diffusers
folder on the GPU, against `ddo run` with the same arguments in the same job. Standard library
only. Writes OUT/serve.json and OUT/serve.md.

1. `ddo run` of the 1024x1024 4-step image (seed 1), page cache warm: its wall time and PNG.
2. `ddo serve` starts (its load timed to /health), then WARM requests of that size in a row:
   each one's client wall time against its phases plus its PNG's encoding (the profile's
   `phases[].seconds` and `stage_seconds.output`), whether the plan was reused, and what it
   made the host do again (`request_host`: ranges page-locked, bytes read from storage).
   The first (seed 1) must give `ddo run`'s bytes.
3. MANY requests in a row, mixed sizes (one per 20 requests), seeds, steps and LoRAs (two
   random LoRAs written in PEFT's format into the server's --lora-dir, a set per 5 requests):
   errors, and the device, pinned and host memory (/metrics) after the first, after request
   80 (every size and LoRA set seen) and after the last.
4. 8 concurrent clients (512x512, 4 steps, seeds 100..107): the order the server ran them
   (each answer's `profile.order`) against the order they were queued, and each image
   against `ddo run` with the same arguments.

Usage: python3 bench_serve.py OUT FOLDER DDO [WARM] [MANY]

DDO_SERVE_SECONDS (environment): the seconds the client may take; the requests in a row stop
early (`many.stopped_after` says after how many) so that the last request, the memory
comparison and the concurrent clients still run within it.
"""

import base64
import json
import os
import random
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

PORT = 8917
BASE = f"http://127.0.0.1:{PORT}"
VRAM = "12GiB"


def post(path, body, timeout=600):
    req = urllib.request.Request(BASE + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def get_text(path):
    with urllib.request.urlopen(BASE + path, timeout=30) as r:
        return r.read().decode()


def metrics():
    out = {}
    for line in get_text("/metrics").splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def write_lora(path, pairs, rank, seed):
    """A PEFT-format LoRA: `transformer.NAME.lora_A.weight` [rank, in] and `lora_B` [out, rank],
    F32, small random values."""
    rng = random.Random(seed)
    tensors = []
    for name, (out_f, in_f) in pairs:
        for part, shape in (("lora_A", [rank, in_f]), ("lora_B", [out_f, rank])):
            n = shape[0] * shape[1]
            data = struct.pack(f"<{n}f", *(rng.uniform(-0.01, 0.01) for _ in range(n)))
            tensors.append((f"transformer.{name}.{part}.weight", shape, data))
    header, offset = {}, 0
    for key, shape, data in tensors:
        header[key] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for _, _, data in tensors:
            f.write(data)


def ddo_run(ddo, folder, out_png, h, w, steps, seed, prompt):
    t = time.time()
    p = subprocess.run([ddo, "run", "--weights", folder, "--device", "cuda:0", "--vram-budget", VRAM,
                        "--height", str(h), "--width", str(w), "--steps", str(steps), "--seed", str(seed),
                        "--prompt", prompt, "--out", out_png, "--json"],
                       capture_output=True, text=True)
    wall = time.time() - t
    if p.returncode != 0:
        return wall, None, p.stderr[-2000:]
    with open(out_png, "rb") as f:
        return wall, f.read(), json.loads(p.stdout)


def png_of(answer, i=0):
    return base64.b64decode(answer["images"][i]["b64_png"])


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    out, folder, ddo = sys.argv[1:4]
    # What the requests in a row leave for the last request and the concurrent clients.
    deadline = time.time() + float(os.environ.get("DDO_SERVE_SECONDS", "inf")) - 60.0
    warm_n = int(sys.argv[4]) if len(sys.argv) > 4 else 6
    many_n = int(sys.argv[5]) if len(sys.argv) > 5 else 200
    work = os.path.join(out, "work")
    os.makedirs(work, exist_ok=True)
    result = {"warm": [], "many": {}, "concurrent": {}}

    def save():
        with open(os.path.join(out, "serve.json"), "w") as f:
            json.dump(result, f, indent=1)

    # Page cache warm: every weight file read once.
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                while f.read(64 << 20):
                    pass
    prompt = "a lighthouse on a rocky coast at dawn"
    run_wall, run_png, run_json = ddo_run(ddo, folder, os.path.join(work, "run.png"), 1024, 1024, 4, 1, prompt)
    result["ddo_run"] = {"wall_seconds": run_wall, "ok": run_png is not None,
                         "total_seconds": run_json.get("total_seconds") if isinstance(run_json, dict) else None,
                         "error": None if run_png else run_json}
    save()
    print(f"ddo run: {run_wall:.2f} s", flush=True)

    loras = os.path.join(work, "loras")
    os.makedirs(loras, exist_ok=True)
    write_lora(os.path.join(loras, "style.safetensors"),
               [(f"transformer_blocks.{i}.attn.{p}", (3072, 3072)) for i in range(19) for p in ("to_q", "to_k", "to_v")],
               16, 1)
    write_lora(os.path.join(loras, "detail.safetensors"),
               [(f"single_transformer_blocks.{i}.proj_mlp", (12288, 3072)) for i in range(10)], 8, 2)

    log = open(os.path.join(out, "server.log"), "w")
    t0 = time.time()
    server = subprocess.Popen([ddo, "serve", "--weights", folder, "--device", "cuda:0", "--vram-budget", VRAM,
                               "--listen", f"127.0.0.1:{PORT}", "--lora-dir", loras, "--queue", "16"],
                              stdout=log, stderr=subprocess.STDOUT,
                              # As CI's soak: glibc's per-thread caches of freed blocks count as
                              # in use and fill at their own pace; off, the heap is what DDO holds.
                              env=dict(os.environ, GLIBC_TUNABLES="glibc.malloc.tcache_count=0"))
    try:
        while True:
            try:
                get_text("/health")
                break
            except (urllib.error.URLError, ConnectionError):
                if server.poll() is not None or time.time() - t0 > 300:
                    raise SystemExit("the server did not come up: see server.log")
                time.sleep(0.2)
        result["load_seconds"] = time.time() - t0
        print(f"serve up in {result['load_seconds']:.2f} s", flush=True)

        # 2. Warm requests of ddo run's shape.
        for i in range(warm_n):
            body = {"prompt": prompt, "height": 1024, "width": 1024, "steps": 4, "seed": 1 + i}
            t = time.time()
            status, a = post("/v1/generate", body)
            wall = time.time() - t
            if status != 200:
                result["warm"].append({"status": status, "error": a})
                save()
                continue
            prof = a["profile"]
            phases = sum(p["seconds"] for p in prof["phases"])
            output = prof["stage_seconds"].get("output", 0.0)
            row = {
                "request": i + 1, "wall_seconds": wall, "phases_seconds": phases,
                "output_seconds": output, "x_phases_and_png": wall / (phases + output),
                "stage_seconds": prof["stage_seconds"], "plan_reused": prof.get("plan_reused"),
                "request_host": prof.get("request_host"),
                "phase_seconds": {p["phase"]: p["seconds"] for p in prof["phases"]},
            }
            if i == 0:
                row["same_png_as_ddo_run"] = run_png is not None and png_of(a) == run_png
            result["warm"].append(row)
            print(json.dumps(row), flush=True)
            save()
        m_first = metrics()

        # 3. Many requests in a row.
        sizes = [(512, 512), (768, 1024), (1024, 1024), (1024, 768)]
        lora_sets = [[], [{"name": "style", "strength": 0.8}], [{"name": "detail"}],
                     [{"name": "style", "strength": 0.5}, {"name": "detail", "strength": 0.7}]]
        errors, walls, t_many = [], [], time.time()
        first_after = None
        # A size holds for 20 requests and a LoRA set for 5 (as a user's session changes
        # them), so each of the 16 pairs comes up by request 80; memory is compared after the
        # first, after that warm-up, and after the last.
        warm_at = 4 * 20
        after_warmup = None
        stopped_after = None
        for i in range(many_n):
            if time.time() > deadline:
                stopped_after = i
                break
            h, w = sizes[(i // 20) % len(sizes)]
            body = {"prompt": f"prompt {i % 7}", "height": h, "width": w, "steps": 1 + i % 3,
                    "seed": 1000 + i, "loras": lora_sets[(i // 5) % len(lora_sets)]}
            t = time.time()
            status, a = post("/v1/generate", body)
            walls.append(time.time() - t)
            if status != 200:
                errors.append({"request": i, "status": status, "error": a})
            if i == 0:
                first_after = metrics()
            if i + 1 == warm_at:
                after_warmup = metrics()
        # The last as the first (512x512, no LoRA), to compare memory like with like.
        status, a = post("/v1/generate", {"prompt": "prompt 0", "height": 512, "width": 512, "steps": 1,
                                          "seed": 1000, "loras": []})
        if status != 200:
            errors.append({"request": many_n, "status": status, "error": a})
        last = metrics()
        keys = ["ddo_device_allocated_bytes", "ddo_pinned_host_bytes", "ddo_host_resident_bytes",
                "ddo_host_anonymous_bytes", "ddo_host_heap_bytes", "ddo_host_registrations_total"]
        result["many"] = {
            "requests": (many_n if stopped_after is None else stopped_after) + 1,
            "stopped_after": stopped_after, "errors": errors, "seconds": time.time() - t_many,
            "mean_wall_seconds": sum(walls) / max(len(walls), 1),
            "after_first": {k: (first_after or {}).get(k) for k in keys},
            "after_warmup": {k: (after_warmup or {}).get(k) for k in keys},
            "after_last": {k: last.get(k) for k in keys},
            "jobs_ok": last.get('ddo_jobs_finished_total{outcome="ok"}'),
            "jobs_error": last.get('ddo_jobs_finished_total{outcome="error"}', 0.0),
        }
        result["many"]["change"] = {
            k: ((result["many"]["after_last"][k] or 0) - (result["many"]["after_first"][k] or 0))
            / max(result["many"]["after_first"][k] or 1, 1) for k in keys[:5]}
        result["many"]["change_after_warmup"] = {
            k: ((result["many"]["after_last"][k] or 0) - (result["many"]["after_warmup"][k] or 0))
            / max(result["many"]["after_warmup"][k] or 1, 1) for k in keys[:5]}
        result["metrics_after_warm"] = {k: m_first.get(k) for k in keys}
        print(json.dumps(result["many"]), flush=True)
        save()

        # 4. Eight concurrent clients.
        answers = [None] * 8
        def client(k):
            answers[k] = post("/v1/generate", {"prompt": prompt, "height": 512, "width": 512, "steps": 4,
                                               "seed": 100 + k})
        threads = []
        for k in range(8):
            th = threading.Thread(target=client, args=(k,))
            th.start()
            threads.append(th)
            time.sleep(0.05)  # queued in this order
        for th in threads:
            th.join()
        orders = [a[1].get("order") if a and a[0] == 200 else None for a in answers]
        result["concurrent"] = {"statuses": [a[0] if a else None for a in answers], "orders": orders,
                                "fifo": orders == sorted(orders) if None not in orders else False}
        save()
    finally:
        server.terminate()
        try:
            result["server_exit"] = server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            result["server_exit"] = "killed"
        log.close()
    same = []
    for k in range(8):
        _, png, _ = ddo_run(ddo, folder, os.path.join(work, f"c{k}.png"), 512, 512, 4, 100 + k, prompt)
        a = answers[k]
        same.append(bool(png) and a is not None and a[0] == 200 and png_of(a[1]) == png)
    result["concurrent"]["same_png_as_ddo_run"] = same
    save()
    write_md(out, result)


def write_md(out, r):
    lines = ["# ddo serve, FLUX.1-dev folder, --vram-budget 12GiB, warm page cache", ""]
    d = r.get("ddo_run", {})
    lines.append(f"- `ddo run` 1024x1024, 4 steps: {d.get('wall_seconds', 0):.2f} s wall "
                 f"(its own total {d.get('total_seconds')})")
    lines.append(f"- `ddo serve` load to /health: {r.get('load_seconds', 0):.2f} s")
    lines += ["", "| request | wall (s) | phases (s) | PNG (s) | x (phases + PNG) | plan reused | ranges pinned | bytes read |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for w in r["warm"]:
        if "wall_seconds" not in w:
            lines.append(f"| error | {w} |")
            continue
        rh = w.get("request_host") or {}
        lines.append(f"| {w['request']} | {w['wall_seconds']:.3f} | {w['phases_seconds']:.3f} | "
                     f"{w['output_seconds']:.3f} | {w['x_phases_and_png']:.3f} | {w['plan_reused']} | "
                     f"{rh.get('registrations')} | {rh.get('read_bytes')} |")
    if r["warm"] and "same_png_as_ddo_run" in r["warm"][0]:
        lines.append(f"\nFirst request's PNG byte-identical to `ddo run`'s: {r['warm'][0]['same_png_as_ddo_run']}")
    m = r.get("many") or {}
    if m:
        lines += ["", f"{m['requests']} requests in a row: {len(m['errors'])} errors, {m['seconds']:.1f} s "
                  f"(mean {m['mean_wall_seconds']:.3f} s)", "",
                  "| metric | after the first | after request 80 | after the last | change from first | change from 80 |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for k, v in m["after_first"].items():
            lines.append(f"| {k} | {v} | {m['after_warmup'][k]} | {m['after_last'][k]} | "
                         f"{m['change'].get(k, '')} | {m['change_after_warmup'].get(k, '')} |")
    c = r.get("concurrent") or {}
    if c:
        lines += ["", f"8 concurrent clients: statuses {c.get('statuses')}, run order {c.get('orders')}, "
                  f"FIFO {c.get('fifo')}, byte-identical to ddo run {c.get('same_png_as_ddo_run')}"]
    with open(os.path.join(out, "serve.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
