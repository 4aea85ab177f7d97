#!/usr/bin/env python3
"""LoRA conformance fixtures (issue 36): tiny LoRA files for the committed `fixtures/flux_pipeline`
transformer in the layouts Diffusers' `load_lora_weights` reads (kohya/sd-scripts, Diffusers/PEFT,
XLabs), and Diffusers' own latents with them, unfused and fused, in f32 — the reference `ddo run
--lora` is checked against.

Writes `fixtures/flux_lora/`:

  kohya.safetensors    lora_unet_double_blocks_0_img_attn_qkv / _txt_mlp_0 / single_blocks_0_linear2,
                       lora_down / lora_up / alpha (alpha 2, rank 4); no single_blocks_*_linear1:
                       Diffusers splits it at FLUX.1's widths (3072 x 3 + 12288), not the model's
  peft.safetensors     transformer.<module>.lora_A / lora_B (rank 4), no alpha (scale 1)
  xlabs.safetensors    double_blocks.0.processor.qkv_lora1 / proj_lora2, single_blocks.0.processor
                       .qkv_lora, down / up (rank 4)
  outputs.safetensors  `<name>_<strength>_latents` for each file at strengths 0.5 and 1.0,
                       `kohya_peft_latents` (both at 1.0), and `kohya_fused_latents` (fuse_lora at
                       1.0), each from fixtures/flux_pipeline/inputs.safetensors' prompt_embeds,
                       pooled_prompt_embeds and latents with gen_fixtures.py's PIPE_CALL

and for the committed `fixtures/qwen_pipeline` (Qwen-Image, no fused modules):

  qwen_kohya.safetensors  lora_unet_transformer_blocks_0_attn_to_q / _img_mlp_net_0_proj /
                          lora_unet_proj_out, lora_down / lora_up / alpha (alpha 2, rank 4)
  qwen_peft.safetensors   transformer.transformer_blocks.1.attn.add_k_proj / .txt_mlp.net.2,
                          lora_A / lora_B (rank 4)
  qwen_comfy.safetensors  diffusion_model.transformer_blocks.1.img_mod.1 / .attn.to_out.0,
                          lora_down / lora_up / alpha (alpha 8, rank 4)
  qwen_outputs.safetensors  the same names with the `qwen_` files (`qwen_kohya_qwen_peft_latents`,
                          `qwen_kohya_fused_latents`, `qwen_plain_latents`), each the packed latents of
                          qwen_pipeline_fixture.py's call (3 steps, true CFG 4.0) from
                          fixtures/qwen_pipeline/inputs.safetensors

Needs torch, diffusers 0.42.1, transformers and peft (the GPU machine has them; not run by CI):

  python3 tools/gen_lora_fixtures.py [--out fixtures/flux_lora]
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_fixtures as gf  # noqa: E402  (PIPE_CALL, f32c, the pipeline fixture's conventions)

from diffusers import FluxPipeline, QwenImagePipeline  # noqa: E402

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


def qwen_kohya(tr, g) -> "OrderedDict[str, torch.Tensor]":
    inner = tr.config.num_attention_heads * tr.config.attention_head_dim
    out_ch = tr.config.patch_size**2 * tr.config.out_channels
    sd: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for name, (out, inp) in {
        "transformer_blocks_0_attn_to_q": (inner, inner),
        "transformer_blocks_0_img_mlp_net_0_proj": (4 * inner, inner),
        "proj_out": (out_ch, inner),
    }.items():
        sd[f"lora_unet_{name}.lora_down.weight"] = randn(g, RANK, inp)
        sd[f"lora_unet_{name}.lora_up.weight"] = randn(g, out, RANK)
        sd[f"lora_unet_{name}.alpha"] = torch.tensor(2.0)
    return sd


def qwen_peft(tr, g) -> "OrderedDict[str, torch.Tensor]":
    inner = tr.config.num_attention_heads * tr.config.attention_head_dim
    sd: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for module, (out, inp) in {
        "transformer_blocks.1.attn.add_k_proj": (inner, inner),
        "transformer_blocks.1.txt_mlp.net.2": (inner, 4 * inner),
    }.items():
        sd[f"transformer.{module}.lora_A.weight"] = randn(g, RANK, inp)
        sd[f"transformer.{module}.lora_B.weight"] = randn(g, out, RANK)
    return sd


def qwen_comfy(tr, g) -> "OrderedDict[str, torch.Tensor]":
    inner = tr.config.num_attention_heads * tr.config.attention_head_dim
    sd: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    for module, (out, inp) in {
        "transformer_blocks.1.img_mod.1": (6 * inner, inner),
        "transformer_blocks.1.attn.to_out.0": (inner, inner),
    }.items():
        sd[f"diffusion_model.{module}.lora_down.weight"] = randn(g, RANK, inp)
        sd[f"diffusion_model.{module}.lora_up.weight"] = randn(g, out, RANK)
        sd[f"diffusion_model.{module}.alpha"] = torch.tensor(8.0)
    return sd


def qwen_latents(pipe, ins) -> torch.Tensor:
    import qwen_pipeline_fixture as qf

    with torch.no_grad():
        out = pipe(
            prompt_embeds=ins["prompt_embeds"],
            prompt_embeds_mask=ins["prompt_embeds_mask"].to(torch.int64),
            negative_prompt_embeds=ins["negative_prompt_embeds"],
            negative_prompt_embeds_mask=ins["negative_prompt_embeds_mask"].to(torch.int64),
            true_cfg_scale=qf.TRUE_CFG_SCALE,
            num_inference_steps=qf.STEPS,
            height=qf.HEIGHT,
            width=qf.WIDTH,
            latents=ins["latents"].clone(),
            output_type="latent",
            return_dict=False,
        )[0]
    return gf.f32c(out)


def run_family(pipe, run, makers, out: Path, prefix: str, g) -> "OrderedDict[str, torch.Tensor]":
    """Writes each maker's LoRA file and Diffusers' latents with them (see the module doc)."""
    files = {}
    for name, make in makers:
        path = out / f"{prefix}{name}.safetensors"
        save_file(make(pipe.transformer, g), str(path))
        files[name] = path
    first, second = list(files)[:2]
    results: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    results[f"{prefix}plain_latents"] = run()
    for name, path in files.items():
        pipe.load_lora_weights(str(path), adapter_name=name)
        for strength in (0.5, 1.0):
            pipe.set_adapters([name], adapter_weights=[strength])
            results[f"{prefix}{name}_{strength}_latents"] = run()
        pipe.unload_lora_weights()
    pipe.load_lora_weights(str(files[first]), adapter_name=first)
    pipe.load_lora_weights(str(files[second]), adapter_name=second)
    pipe.set_adapters([first, second], adapter_weights=[1.0, 1.0])
    results[f"{prefix}{first}_{prefix}{second}_latents"] = run()
    pipe.unload_lora_weights()
    pipe.load_lora_weights(str(files[first]), adapter_name=first)
    pipe.fuse_lora(lora_scale=1.0)
    results[f"{prefix}{first}_fused_latents"] = run()
    pipe.unfuse_lora()
    pipe.unload_lora_weights()
    plain = results[f"{prefix}plain_latents"]
    for k, v in results.items():
        moved = (v - plain).norm() / plain.norm()
        print(f"[gen] {prefix or 'flux_'}lora.{k}: {list(v.shape)}, relative change from plain {moved.item():.3e}")
    return results


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


def flux(out: Path, g) -> None:
    src = ROOT / "fixtures" / "flux_pipeline"
    pipe = FluxPipeline.from_pretrained(str(src), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    ins = load_file(str(src / "inputs.safetensors"))
    makers = [("kohya", kohya), ("peft", peft), ("xlabs", xlabs)]
    results = run_family(pipe, lambda: latents(pipe, ins), makers, out, "", g)
    save_file(dict(results), str(out / "outputs.safetensors"))


def qwen(out: Path, g) -> None:
    src = ROOT / "fixtures" / "qwen_pipeline"
    pipe = QwenImagePipeline.from_pretrained(
        str(src), text_encoder=None, tokenizer=None, torch_dtype=torch.float32
    )
    pipe.set_progress_bar_config(disable=True)
    ins = load_file(str(src / "inputs.safetensors"))
    makers = [("kohya", qwen_kohya), ("peft", qwen_peft), ("comfy", qwen_comfy)]
    results = run_family(pipe, lambda: qwen_latents(pipe, ins), makers, out, "qwen_", g)
    save_file(dict(results), str(out / "qwen_outputs.safetensors"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "fixtures" / "flux_lora"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    # One generator per family, so that either can be written again alone.
    for seed, family in [(3601, flux), (3602, qwen)]:
        try:
            family(out, torch.Generator().manual_seed(seed))
        except Exception:  # noqa: BLE001  (the other family still runs; the exit code says)
            traceback.print_exc()
            failed.append(family.__name__)
    if failed:
        sys.exit(f"failed: {failed}")


if __name__ == "__main__":
    main()
