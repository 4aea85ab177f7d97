#!/usr/bin/env python3
"""How much host->device copies on another stream slow the compute stream (issue 37).

A streamed Q4_K step runs 8-11 % slower per op than the same ops resident on an H100, and
every event interval on the compute stream gains about 6 us, including views that launch no
kernel. This measures, with PyTorch on the GPU machine, the GPU time of a queue of kernels of
several kinds with and without a stream of pinned host->device copies running beside them,
eagerly launched and replayed as a CUDA graph:

    python3 tools/gpu_copy_interference.py [OUT.json]

Each case queues a `torch.cuda._sleep` first so the host has queued every kernel before the
GPU reaches them (the GPU time is the GPU's, not the launcher's). Copies: 1 GiB pinned
buffers (or 8 MiB chunks), enough of them to cover the case.
"""
import json
import sys

import torch


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else None
    dev = torch.device("cuda")
    torch.manual_seed(0)
    host = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dst = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    copy_stream = torch.cuda.Stream()
    tiny = torch.zeros(1, device=dev)
    mid = torch.randn(4096, 3072, device=dev, dtype=torch.bfloat16)
    a = torch.randn(4608, 3072, device=dev, dtype=torch.bfloat16)
    w = torch.randn(3072, 3072, device=dev, dtype=torch.bfloat16)
    q = torch.randn(1, 24, 4608, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn_like(q)
    v = torch.randn_like(q)

    kinds = {
        # kernels, the kernel, the ring mode's copy (about a third of 4 kernels' time)
        "launch (1-element add)": (2000, lambda: tiny.add_(1.0), 64 << 10),
        "elementwise 4096x3072 bf16": (1000, lambda: mid.mul_(1.0), 1 << 20),
        "GEMM 4608x3072x3072": (200, lambda: torch.matmul(a, w), 8 << 20),
        "attention 24x4608x128": (40, lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), 32 << 20),
    }

    def copies(chunk, seconds):
        # Enough copies for `seconds` at about 55 GB/s.
        total = int(seconds * 55e9)
        with torch.cuda.stream(copy_stream):
            done = 0
            while done < total:
                n = min(chunk, dst.numel())
                dst[:n].copy_(host[:n], non_blocking=True)
                done += n

    done_event = torch.cuda.Event()
    done_event.record()

    def timed(n, fn, copy_chunk=None, graph=None, mode=None, ring_chunk=8 << 20):
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # about 50 ms: the host queues everything meanwhile
        if copy_chunk:
            # the copy stream is idle: they start at once, during the sleep, and run through
            # the timed window
            copies(copy_chunk, 0.25)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        if graph is not None:
            graph.replay()
        elif mode == "waits":
            # each kernel behind a wait on an event that completed long ago
            for _ in range(n):
                torch.cuda.current_stream().wait_event(done_event)
                fn()
        elif mode == "ring":
            # a leaf route's pattern: every 4th kernel frees a slot (an event the copy
            # stream waits on before a copy into it) and waits for the copy three slots back
            compute = torch.cuda.current_stream()
            ready = []
            for i in range(n):
                if i % 4 == 0:
                    if len(ready) >= 3:
                        compute.wait_event(ready[-3])
                    free = torch.cuda.Event()
                    free.record(compute)
                    copy_stream.wait_event(free)
                    with torch.cuda.stream(copy_stream):
                        dst[:ring_chunk].copy_(host[:ring_chunk], non_blocking=True)
                        done = torch.cuda.Event()
                        done.record(copy_stream)
                    ready.append(done)
                fn()
        else:
            for _ in range(n):
                fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / n  # us per kernel

    variants = (
        ("eager", None, False, None),
        ("eager + copies 1 GiB", 1 << 30, False, None),
        ("eager + copies 8 MiB", 8 << 20, False, None),
        ("eager, a done wait before each", None, False, "waits"),
        ("eager, ring-coupled copies", None, False, "ring"),
        ("graph", None, True, None),
        ("graph + copies 1 GiB", 1 << 30, True, None),
        ("graph + copies 8 MiB", 8 << 20, True, None),
    )
    results = []
    for name, (n, fn, ring_chunk) in kinds.items():
        for _ in range(3):
            fn()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
            with torch.cuda.graph(g):
                for _ in range(n):
                    fn()
        torch.cuda.current_stream().wait_stream(s)
        row = {"kind": name, "kernels": n}
        for label, chunk, use_graph, mode in variants:
            vals = sorted(timed(n, fn, chunk, g if use_graph else None, mode, ring_chunk) for _ in range(3))
            row[label] = vals[1]
        results.append(row)
        print(json.dumps(row), flush=True)

    cols = [v[0] for v in variants]
    print("| kind | " + " | ".join(c + " (us/kernel)" for c in cols) + " |")
    print("| --- |" + " ---: |" * len(cols))
    for r in results:
        print("| %s | %s |" % (r["kind"], " | ".join("%.2f" % r[c] for c in cols)))
    doc = {"device": torch.cuda.get_device_name(), "results": results}
    if out_path:
        with open(out_path, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
