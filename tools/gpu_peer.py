"""Diffusers side of DDO's GPU conformance and peer benchmark (runs on the GPU machine).

Usage: python3 tools/gpu_peer.py OUT_DIR [--bench]

Writes, under OUT_DIR:
  vae/            a Flux-family AutoencoderKL (real Flux VAE config, seeded random weights,
                  bf16), saved with save_pretrained
  vae_io.safetensors          `latents` [1,16,64,64], Diffusers' bf16 decode `sample`
                              (512x512) and `sample_f32`, the same weights run in f32 (the
                              reference both bf16 implementations are judged against)
  transformer/    FluxTransformer2DModel at FLUX.1-dev widths with 2 double + 2 single blocks
                  (seeded random weights, bf16)
  transformer_io.safetensors  inputs (hidden_states [1,1024,64], encoder_hidden_states
                              [1,512,4096], pooled_projections [1,768], timestep, guidance,
                              img_ids [1024,3], txt_ids [512,3]), Diffusers' bf16 `sample`
                              and its f32 `sample_f32` on the same weights
  peer.json       with --bench: PyTorch eager timings on this GPU (median/min/max ms of 10
                  runs after 3 warm-ups, CUDA events): resident Flux VAE decode 1024^2 bf16,
                  and a Flux-shaped transformer (5 double + 10 single blocks, 4608 image + 512
                  text tokens, bf16)

Random weights: Diffusers' own initialisation, then every parameter whose elements are all
equal gets seeded N(0, 0.02) noise so a dropped affine term cannot match by accident.
Diffusers 0.42.1 comes from the wheels DDO carries (the GPU image has torch).
"""

import copy
import json
import os
import statistics
import sys

import torch
from safetensors.torch import save_file

from diffusers import AutoencoderKL, FluxTransformer2DModel


def perturb_constants(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.detach().flatten()
            if flat.numel() > 0 and bool((flat == flat[0]).all()):
                p.add_(torch.randn(p.shape, generator=g) * 0.02)


def flux_vae():
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        block_out_channels=[128, 256, 512, 512],
        layers_per_block=2,
        latent_channels=16,
        norm_num_groups=32,
        sample_size=1024,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def flux_transformer(double, single):
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=64,
        num_layers=double,
        num_single_layers=single,
        attention_head_dim=128,
        num_attention_heads=24,
        joint_attention_dim=4096,
        pooled_projection_dim=768,
        guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
    )


def image_ids(h, w):
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = ids[..., 1] + torch.arange(h)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(w)[None, :]
    return ids.reshape(h * w, 3)


def transformer_inputs(img_side, txt_tokens, seed):
    g = torch.Generator().manual_seed(seed)
    n = img_side * img_side
    return {
        "hidden_states": torch.randn(1, n, 64, generator=g),
        "encoder_hidden_states": torch.randn(1, txt_tokens, 4096, generator=g),
        "pooled_projections": torch.randn(1, 768, generator=g),
        "timestep": torch.tensor([0.5]),
        "guidance": torch.tensor([3.5]),
        "img_ids": image_ids(img_side, img_side),
        "txt_ids": torch.zeros(txt_tokens, 3),
    }


def run_transformer(model, inputs, dt=torch.bfloat16):
    dev = "cuda"
    return model(
        hidden_states=inputs["hidden_states"].to(dev, dt),
        encoder_hidden_states=inputs["encoder_hidden_states"].to(dev, dt),
        pooled_projections=inputs["pooled_projections"].to(dev, dt),
        timestep=inputs["timestep"].to(dev, dt),
        guidance=inputs["guidance"].to(dev, dt),
        img_ids=inputs["img_ids"].to(dev),
        txt_ids=inputs["txt_ids"].to(dev),
        return_dict=False,
    )[0]


def time_cuda(fn, warmup=3, runs=10):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}


def main():
    out = sys.argv[1]
    bench = "--bench" in sys.argv
    os.makedirs(out, exist_ok=True)
    dev = "cuda"

    with torch.no_grad():
        torch.manual_seed(11)
        vae = flux_vae().eval()
        perturb_constants(vae, 12)
        vae = vae.to(torch.bfloat16)
        vae.save_pretrained(os.path.join(out, "vae"), safe_serialization=True)
        vae = vae.to(dev)
        g = torch.Generator().manual_seed(13)
        latents = torch.randn(1, 16, 64, 64, generator=g)
        sample = vae.decode(latents.to(dev, torch.bfloat16)).sample
        # The same (bf16-valued) weights in f32: the reference both bf16 runs are judged by.
        vae32 = copy.deepcopy(vae).float()
        sample32 = vae32.decode(latents.to(dev)).sample
        del vae32
        save_file(
            {
                "latents": latents.contiguous(),
                "sample": sample.float().cpu().contiguous(),
                "sample_f32": sample32.cpu().contiguous(),
            },
            os.path.join(out, "vae_io.safetensors"),
        )

        torch.manual_seed(21)
        tr = flux_transformer(2, 2).eval()
        perturb_constants(tr, 22)
        tr = tr.to(torch.bfloat16)
        tr.save_pretrained(os.path.join(out, "transformer"), safe_serialization=True)
        tr = tr.to(dev)
        inputs = transformer_inputs(32, 512, 23)
        sample = run_transformer(tr, inputs)
        tr32 = copy.deepcopy(tr).float()
        sample32 = run_transformer(tr32, inputs, torch.float32)
        del tr32
        tensors = {k: v.float().contiguous() for k, v in inputs.items()}
        tensors["sample"] = sample.float().cpu().contiguous()
        tensors["sample_f32"] = sample32.cpu().contiguous()
        save_file(tensors, os.path.join(out, "transformer_io.safetensors"))
        del tr
        torch.cuda.empty_cache()

        if bench:
            big_latents = torch.randn(1, 16, 128, 128, generator=g).to(dev, torch.bfloat16)
            torch.cuda.reset_peak_memory_stats()
            vae_t = time_cuda(lambda: vae.decode(big_latents).sample)
            vae_t["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
            del vae
            torch.cuda.empty_cache()
            torch.manual_seed(31)
            big = flux_transformer(5, 10).to(dev, torch.bfloat16).eval()
            big_inputs = transformer_inputs(72, 512, 32)
            torch.cuda.reset_peak_memory_stats()
            tr_t = time_cuda(lambda: run_transformer(big, big_inputs))
            tr_t["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
            result = {
                "gpu": torch.cuda.get_device_name(0),
                "torch": torch.__version__,
                "vae_decode_1024_bf16": vae_t,
                "flux_5x10_4608_bf16": tr_t,
            }
            with open(os.path.join(out, "peer.json"), "w") as f:
                json.dump(result, f, indent=2)
            print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
