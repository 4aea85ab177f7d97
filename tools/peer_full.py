"""Diffusers 0.42.1 on the full FLUX.1-dev transformer (19 double + 38 single blocks,
bf16, random weights made on the GPU), 1024x1024 (4096 image + 512 text tokens), inputs
held on the GPU: resident, and `enable_group_offload(leaf_level, use_stream=True)` (its best
zero-budget setting). Median of 5 timed forwards after 2 warm-ups, CUDA events; peak =
torch.cuda.max_memory_allocated; setup = the time enable_group_offload took. Runs on the
GPU machine beside `ddo bench --config flux-dev` (never by CI).

Usage: python3 tools/peer_full.py OUT.json
"""

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_peer import flux_transformer, time_cuda  # noqa: E402


def main():
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = flux_transformer(19, 38).to(torch.bfloat16).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(1)
    side = 64
    ids = torch.zeros(side, side, 3, device="cuda")
    ids[..., 1] += torch.arange(side, device="cuda")[:, None]
    ids[..., 2] += torch.arange(side, device="cuda")[None, :]
    inputs = dict(
        hidden_states=torch.randn(1, side * side, 64, device="cuda", generator=g, dtype=dt),
        encoder_hidden_states=torch.randn(1, 512, 4096, device="cuda", generator=g, dtype=dt),
        pooled_projections=torch.randn(1, 768, device="cuda", generator=g, dtype=dt),
        timestep=torch.tensor([0.5], device="cuda", dtype=dt),
        guidance=torch.tensor([3.5], device="cuda", dtype=dt),
        img_ids=ids.reshape(-1, 3),
        txt_ids=torch.zeros(512, 3, device="cuda"),
        return_dict=False,
    )
    results = {"weight_bytes": weights}
    with torch.no_grad():
        torch.cuda.reset_peak_memory_stats()
        results["resident"] = time_cuda(lambda: model(**inputs), warmup=2, runs=5)
        results["resident"]["peak_bytes"] = torch.cuda.max_memory_allocated()
        print("resident", json.dumps(results["resident"]), flush=True)
        model = model.to("cpu")
        torch.cuda.empty_cache()
        t = time.time()
        model.enable_group_offload(onload_device=torch.device("cuda"),
                                   offload_device=torch.device("cpu"),
                                   offload_type="leaf_level", use_stream=True)
        setup = time.time() - t
        torch.cuda.reset_peak_memory_stats()
        results["leaf_stream"] = time_cuda(lambda: model(**inputs), warmup=2, runs=5)
        results["leaf_stream"]["peak_bytes"] = torch.cuda.max_memory_allocated()
        results["leaf_stream"]["setup_s"] = setup
        print("leaf_stream", json.dumps(results["leaf_stream"]), flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
