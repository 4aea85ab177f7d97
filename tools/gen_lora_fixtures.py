#!/usr/bin/env python3
"""LoRA conformance fixtures (issue 36): tiny LoRA files for the committed `fixtures/flux_pipeline`
transformer in the layouts Diffusers' `load_lora_weights` reads (kohya/sd-scripts, Diffusers/PEFT,
XLabs), and Diffusers' own latents with them, unfused and fused, in f32 — the reference `ddo run
--lora` is checked against.

Writes `fixtures/flux_lora/`:

  kohya.safetensors    lora_unet_double_blocks_0_img_attn_qkv / _txt_mlp_0 / single_blocks_0_linear1
                       / _linear2, lora_down / lora_up / alpha (alpha 2, rank 4)
  peft.safetensors     transformer.<module>.lora_A / lora_B (rank 4), no alpha (scale 1)
  xlabs.safetensors    double_blocks.0.processor.qkv_lora1 / proj_lora2, single_blocks.0.processor
                       .qkv_lora, down / up (rank 4)
  outputs.safetensors  `<name>_<strength>_latents` for each file at strengths 0.5 and 1.0,
                       `kohya_peft_latents` (both at 1.0), and `kohya_fused_latents` (fuse_lora at
                       1.0), each from fixtures/flux_pipeline/inputs.safetensors' prompt_embeds,
                       pooled_prompt_embeds and latents with gen_fixtures.py's PIPE_CALL

Needs torch, diffusers 0.42.1, transformers and peft (the GPU machine has them; not run by CI):

  python3 tools/gen_lora_fixtures.py [--out fixtures/flux_lora]
"""

from __future__ import annotations

import argparse
import sys
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_fixtures as gf  # noqa: E402  (PIPE_CALL, f32c, the pipeline fixture's conventions)

from diffusers import FluxPipeline  # noqa: E402

RANK = 4
ROOT = Path(__file__).resolve().parent.parent


def randn(g: torch.Generator, *shape, scale: float = 0.2) -> torch.Tensor:
    return (torch.randn(*shape, generator=g, dtype=torch.float32) * scale).contiguous()


def kohya(tr, g) -> "OrderedDict[str, torch.Tensor]":
    inner = tr.config.num_attention_heads * tr.config.attention_head_dim
    mlp = 4 * inner
    sd: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for name, (out, inp) in {
        "double_blocks_0_img_attn_qkv": (3 * inner, inner),
        "double_blocks_0_txt_mlp_0": (mlp, inner),
        "single_blocks_0_linear1": (3 * inner + mlp, inner),
        "single_blocks_0_linear2": (inner, inner + mlp),
    }.items():
        sd[f"lora_unet_{name}.lora_down.weight"] = randn(g, RANK, inp)
        sd[f"lora_unet_{name}.lora_up.weight"] = randn(g, out, RANK)
        sd[f"lora_unet_{name}.alpha"] = torch.tensor(2.0)
    return sd


def peft(tr, g) -> "OrderedDict[str, torch.Tensor]":
    inner = tr.config.num_attention_heads * tr.config.attention_head_dim
    sd: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for module, (out, inp) in {
        "transformer_blocks.0.attn.to_k": (inner, inner),
        "transformer_blocks.0.ff.net.2": (inner, 4 * inner),
        "single_transformer_blocks.0.proj_mlp": (4 * inner, inner),
        "proj_out": (tr.config.in_channels, inner),
    }.items():
        sd[f"transformer.{module}.lora_A.weight"] = randn(g, RANK, inp)
        sd[f"transformer.{module}.lora_B.weight"] = randn(g, out, RANK)
    return sd


def xlabs(tr, g) -> "OrderedDict[str, torch.Tensor]":
    inner = tr.config.num_attention_heads * tr.config.attention_head_dim
    sd: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for name, out in {
        "double_blocks.0.processor.qkv_lora1": 3 * inner,
        "double_blocks.0.processor.proj_lora2": inner,
        "single_blocks.0.processor.qkv_lora": 3 * inner,
    }.items():
        sd[f"{name}.down.weight"] = randn(g, RANK, inner)
        sd[f"{name}.up.weight"] = randn(g, out, RANK)
    return sd


def latents(pipe, ins) -> torch.Tensor:
    with torch.no_grad():
        out = pipe(
            prompt_embeds=ins["prompt_embeds"],
            pooled_prompt_embeds=ins["pooled_prompt_embeds"],
            latents=ins["latents"],
            output_type="latent",
            return_dict=False,
            **gf.PIPE_CALL,
        )[0]
    return gf.f32c(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "fixtures" / "flux_lora"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    src = ROOT / "fixtures" / "flux_pipeline"
    pipe = FluxPipeline.from_pretrained(str(src), torch_dtype=torch.float32)
    ins = load_file(str(src / "inputs.safetensors"))
    g = torch.Generator().manual_seed(3601)
    files = {}
    for name, make in [("kohya", kohya), ("peft", peft), ("xlabs", xlabs)]:
        path = out / f"{name}.safetensors"
        save_file(make(pipe.transformer, g), str(path))
        files[name] = path
    results: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    results["plain_latents"] = latents(pipe, ins)
    for name, path in files.items():
        pipe.load_lora_weights(str(path), adapter_name=name)
        for strength in (0.5, 1.0):
            pipe.set_adapters([name], adapter_weights=[strength])
            results[f"{name}_{strength}_latents"] = latents(pipe, ins)
        pipe.unload_lora_weights()
    pipe.load_lora_weights(str(files["kohya"]), adapter_name="kohya")
    pipe.load_lora_weights(str(files["peft"]), adapter_name="peft")
    pipe.set_adapters(["kohya", "peft"], adapter_weights=[1.0, 1.0])
    results["kohya_peft_latents"] = latents(pipe, ins)
    pipe.unload_lora_weights()
    pipe.load_lora_weights(str(files["kohya"]), adapter_name="kohya")
    pipe.fuse_lora(lora_scale=1.0)
    results["kohya_fused_latents"] = latents(pipe, ins)
    save_file(dict(results), str(out / "outputs.safetensors"))
    for k, v in results.items():
        moved = (v - results["plain_latents"]).norm() / results["plain_latents"].norm()
        print(f"[gen] flux_lora.{k}: {list(v.shape)}, relative change from plain {moved.item():.3e}")


if __name__ == "__main__":
    main()
