"""Diffusers 0.42.1 on the full FLUX.1-dev transformer (19 double + 38 single blocks,
bf16, random weights made on the GPU), 1024x1024 (4096 image + 512 text tokens), inputs
held on the GPU: resident, and `enable_group_offload(leaf_level, use_stream=True)` (its best
zero-budget setting). Median of 5 timed forwards after 2 warm-ups, CUDA events; peak =
torch.cuda.max_memory_allocated; setup = the time enable_group_offload took. Runs on the
GPU machine beside `ddo bench --config flux-dev` (never by CI).

Usage: python3 tools/peer_full.py OUT.json
"""

import json
import statistics
import sys
import time

import torch

from diffusers import FluxTransformer2DModel


def events_ms(f, warmup=2, runs=5):
    for _ in range(warmup):
        f()
    torch.cuda.synchronize()
    out = []
    for _ in range(runs):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return out


def main():
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
            attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
            pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56),
        ).to(torch.bfloat16).eval()
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
        ms = events_ms(lambda: model(**inputs))
        results["resident"] = {"median_ms": statistics.median(ms), "ms": ms,
                               "peak_bytes": torch.cuda.max_memory_allocated()}
        print("resident", json.dumps(results["resident"]), flush=True)
        model = model.to("cpu")
        torch.cuda.empty_cache()
        t = time.time()
        model.enable_group_offload(onload_device=torch.device("cuda"),
                                   offload_device=torch.device("cpu"),
                                   offload_type="leaf_level", use_stream=True)
        setup = time.time() - t
        torch.cuda.reset_peak_memory_stats()
        ms = events_ms(lambda: model(**inputs))
        results["leaf_stream"] = {"median_ms": statistics.median(ms), "ms": ms,
                                  "peak_bytes": torch.cuda.max_memory_allocated(),
                                  "setup_s": setup}
        print("leaf_stream", json.dumps(results["leaf_stream"]), flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
