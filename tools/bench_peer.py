"""Diffusers side of `cargo xtask bench --peer diffusers` (runs on the GPU machine).

Usage: python3 tools/bench_peer.py DIR

Builds the bench's random weights once and saves them where DDO loads them too:
  DIR/transformer/  FluxTransformer2DModel, FLUX.1-dev widths, 5 double + 10 single blocks,
                    seeded random weights, bf16 (5.92 GiB), save_pretrained (one file)
  DIR/vae/          the Flux AutoencoderKL, seeded random weights, bf16
  DIR/bench_inputs.safetensors  transformer inputs at 4608 image + 512 text tokens and
                    VAE latents [1,16,128,128] (decode to 1024x1024), float32
Then times Diffusers 0.42.1 on the same weights (median/min/max of 10 after 3 warm-ups,
CUDA events; peak = torch.cuda.max_memory_allocated) and writes DIR/peer_bench.json:
  transformer_resident, transformer_leaf_stream (enable_group_offload leaf_level,
  use_stream=True: Diffusers' best zero-budget setting), vae_resident, vae_leaf_no_stream,
  vae_leaf_stream; host RSS (VmRSS/RssAnon/RssFile, sampled after each timed run) and
  pinned host bytes (torch's host allocator stats where available, else the bytes of the
  pinned copies Diffusers makes with streams) during each run; pinned host->device
  bandwidth (1 GiB, best of 5).
"""

import gc
import json
import os
import statistics
import sys

import torch
from safetensors.torch import save_file

from diffusers import AutoencoderKL, FluxTransformer2DModel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_peer import flux_transformer, flux_vae, perturb_constants, transformer_inputs  # noqa: E402

DEV = "cuda"


def rss():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            for key in ("VmRSS", "RssAnon", "RssFile"):
                if line.startswith(key + ":"):
                    out[key] = int(line.split()[1]) * 1024
    return out


def pinned_now(model):
    stats = getattr(torch.cuda.memory, "host_memory_stats", None)
    if stats is not None:
        try:
            s = stats()
            for key in ("allocated_bytes.current", "allocated_bytes.all.current"):
                if key in s:
                    return int(s[key]), "torch host allocator"
        except Exception:  # noqa: BLE001 - older torch: fall through to the estimate
            pass
    total = 0
    for mod in model.modules():
        hook = getattr(mod, "_diffusers_hook", None)
        if hook is None:
            continue
        for h in getattr(hook, "hooks", {}).values():
            group = getattr(h, "group", None)
            cpu = getattr(group, "cpu_param_dict", None) if group is not None else None
            if cpu:
                total += sum(t.numel() * t.element_size() for t in cpu.values() if t.is_pinned())
    return total, "pinned copies in group offload hooks"


def time_cuda(fn, model, warmup=3, runs=10):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, rss_max, pinned = [], {}, (0, "")
    for _ in range(runs):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        for k, v in rss().items():
            rss_max[k] = max(rss_max.get(k, 0), v)
        p = pinned_now(model)
        if p[0] >= pinned[0]:
            pinned = p
    return {
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "max_ms": max(times),
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "host_rss_bytes": rss_max.get("VmRSS", 0),
        "host_rss_anon_bytes": rss_max.get("RssAnon", 0),
        "host_rss_file_bytes": rss_max.get("RssFile", 0),
        "pinned_host_bytes": pinned[0],
        "pinned_source": pinned[1],
    }


def bandwidth():
    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    dev = torch.empty(n, dtype=torch.uint8, device=DEV)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del host, dev
    return n / best


def weight_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run_transformer(model, inputs):
    dt = torch.bfloat16
    return model(
        hidden_states=inputs["hidden_states"],
        encoder_hidden_states=inputs["encoder_hidden_states"].to(dt),
        pooled_projections=inputs["pooled_projections"].to(dt),
        timestep=inputs["timestep"].to(dt),
        guidance=inputs["guidance"].to(dt),
        img_ids=inputs["img_ids"],
        txt_ids=inputs["txt_ids"],
        return_dict=False,
    )[0]


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    results = {}
    with torch.no_grad():
        tdir = os.path.join(out, "transformer")
        vdir = os.path.join(out, "vae")
        if not os.path.exists(os.path.join(tdir, "config.json")):
            torch.manual_seed(41)
            tr = flux_transformer(5, 10).eval()
            perturb_constants(tr, 42)
            tr = tr.to(torch.bfloat16)
            tr.save_pretrained(tdir, safe_serialization=True, max_shard_size="64GB")
            del tr
            torch.manual_seed(43)
            vae = flux_vae().eval()
            perturb_constants(vae, 44)
            vae.to(torch.bfloat16).save_pretrained(vdir, safe_serialization=True)
            del vae
            inputs = transformer_inputs(72, 512, 45)
            g = torch.Generator().manual_seed(46)
            tensors = {k: v.float().contiguous() for k, v in inputs.items()}
            tensors["latents"] = torch.randn(1, 16, 128, 128, generator=g)
            save_file(tensors, os.path.join(out, "bench_inputs.safetensors"))
            gc.collect()
        from safetensors.torch import load_file

        io = load_file(os.path.join(out, "bench_inputs.safetensors"))
        inputs = {k: io[k].to(DEV) for k in
                  ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep",
                   "guidance", "img_ids", "txt_ids")}
        inputs["hidden_states"] = inputs["hidden_states"].to(torch.bfloat16)
        latents = io["latents"].to(DEV, torch.bfloat16)
        bw = bandwidth()
        print(f"pinned host->device: {bw / 1e9:.1f} GB/s", flush=True)

        for name, mode in (("transformer_resident", None), ("transformer_leaf_stream", True)):
            model = FluxTransformer2DModel.from_pretrained(tdir, torch_dtype=torch.bfloat16).eval()
            wb = weight_bytes(model)
            if mode is None:
                model = model.to(DEV)
            else:
                model.enable_group_offload(onload_device=torch.device(DEV),
                                           offload_device=torch.device("cpu"),
                                           offload_type="leaf_level", use_stream=True)
            r = time_cuda(lambda: run_transformer(model, inputs), model)
            r["weight_bytes"] = wb
            results[name] = r
            print(name, json.dumps(r), flush=True)
            del model
            gc.collect()
            torch.cuda.empty_cache()

        for name, stream in (("vae_resident", None), ("vae_leaf_no_stream", False),
                             ("vae_leaf_stream", True)):
            vae = AutoencoderKL.from_pretrained(vdir, torch_dtype=torch.bfloat16).eval()
            wb = weight_bytes(vae.decoder)
            if stream is None:
                vae = vae.to(DEV)
            else:
                vae.enable_group_offload(onload_device=torch.device(DEV),
                                         offload_device=torch.device("cpu"),
                                         offload_type="leaf_level", use_stream=stream)
            r = time_cuda(lambda: vae.decode(latents).sample, vae)
            r["weight_bytes"] = wb
            results[name] = r
            print(name, json.dumps(r), flush=True)
            del vae
            gc.collect()
            torch.cuda.empty_cache()

    doc = {
        "side": "diffusers",
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "diffusers": __import__("diffusers").__version__,
        "pinned_h2d_bytes_per_sec": bw,
        "results": results,
    }
    with open(os.path.join(out, "peer_bench.json"), "w") as f:
        json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
