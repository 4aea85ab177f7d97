#!/usr/bin/env python3
"""Batch-2 references for the Flux pipeline fixture (issue 16: batches).

Loads the committed `fixtures/flux_pipeline/` folder with `FluxPipeline.from_pretrained` (float32, CPU) and
writes `fixtures/flux_pipeline/batch2.safetensors` and `batch2.md` (what each tensor is and the exact calls).
The other files of the fixture are left as they are.

Three references:

* `embeds_*`: `pipe(prompt_embeds=[2, L, D], pooled_prompt_embeds=[2, P], latents=[2, tokens, 4c])`, two
  different prompts' embeddings and two noises in one batch (a batch mixes nothing between its images);
* `text_*`: `pipe(prompt=PIPE_PROMPT, num_images_per_prompt=2, latents=[2, tokens, 4c])`, what `ddo run
  --num-images 2` does (the prompt's embeddings repeated, one noise per image);
* `vae_*`: `pipe.vae.decode(z)` of unscaled latents `[2, c, h, w]`, what `ddo decode` does with a batch.

Usage (the venv of tools/README.md):

  .venv-fixtures/bin/python tools/gen_batch2_fixture.py
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from pathlib import Path

import torch
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_fixtures as g  # noqa: E402

D = g.FIXTURES / "flux_pipeline"


def main():
    g.check_versions(strict="--allow-version-mismatch" not in sys.argv)
    pipe = FluxPipeline.from_pretrained(str(D), torch_dtype=torch.float32)
    # Parameters copied into fresh storage, as gen_fixtures' --verify does (see MANIFEST.md).
    for comp in (pipe.text_encoder, pipe.text_encoder_2, pipe.transformer, pipe.vae):
        for p in comp.parameters():
            p.data = p.data.clone()
    gen = torch.Generator().manual_seed(g.SEEDS["flux_pipeline"] + 200)
    call = g.PIPE_CALL
    h, w = call["height"], call["width"]
    c = pipe.transformer.config.in_channels // 4
    lh = 2 * (h // (pipe.vae_scale_factor * 2))
    lw = 2 * (w // (pipe.vae_scale_factor * 2))
    t = OrderedDict()
    t["prompt_embeds"] = g.randn(gen, 2, g.PIPE_TEXT_TOKENS, pipe.transformer.config.joint_attention_dim)
    t["pooled_prompt_embeds"] = g.randn(gen, 2, pipe.transformer.config.pooled_projection_dim)
    t["noise"] = g.randn(gen, 2, c, lh, lw)
    t["latents_in"] = FluxPipeline._pack_latents(t["noise"], 2, c, lh, lw).contiguous()
    with torch.no_grad():
        common = dict(latents=t["latents_in"], return_dict=False, **call)
        lat = pipe(
            prompt_embeds=t["prompt_embeds"],
            pooled_prompt_embeds=t["pooled_prompt_embeds"],
            output_type="latent",
            **common,
        )[0]
        t["embeds_latents"] = g.f32c(lat)
        img = pipe(
            prompt_embeds=t["prompt_embeds"],
            pooled_prompt_embeds=t["pooled_prompt_embeds"],
            output_type="pt",
            **common,
        )[0]
        t["embeds_image_pt"] = g.f32c(img)
        text = dict(prompt=g.PIPE_PROMPT, num_images_per_prompt=2, max_sequence_length=g.PIPE_MAX_SEQUENCE_LENGTH)
        t["text_latents"] = g.f32c(pipe(output_type="latent", **text, **common)[0])
        t["text_image_pt"] = g.f32c(pipe(output_type="pt", **text, **common)[0])
        z = g.randn(gen, 2, pipe.vae.config.latent_channels, lh, lw)
        t["vae_latents"] = z
        t["vae_sample"] = g.f32c(pipe.vae.decode(z, return_dict=False)[0])
    g.save_tensors(D / "batch2.safetensors", t)
    lines = [
        "# `flux_pipeline/batch2.safetensors`",
        "",
        "Written by `tools/gen_batch2_fixture.py` from this folder (`FluxPipeline.from_pretrained`, float32, CPU,",
        f"parameters copied into fresh storage), inputs from `torch.Generator().manual_seed({g.SEEDS['flux_pipeline'] + 200})`",
        f"in this order. Call: `{call}`.",
        "",
        "| tensor | shape | what |",
        "| --- | --- | --- |",
    ]
    what = {
        "prompt_embeds": "two prompts' T5 embeddings (random)",
        "pooled_prompt_embeds": "their CLIP pooled embeddings (random)",
        "noise": "one noise per image, unpacked",
        "latents_in": "`FluxPipeline._pack_latents(noise, 2, c, h, w)`",
        "embeds_latents": "`pipe(prompt_embeds=, pooled_prompt_embeds=, latents=latents_in, output_type='latent')`",
        "embeds_image_pt": "the same with `output_type='pt'` (in [0, 1])",
        "text_latents": "`pipe(prompt=PIPE_PROMPT, num_images_per_prompt=2, max_sequence_length=24, latents=latents_in, "
        "output_type='latent')`",
        "text_image_pt": "the same with `output_type='pt'`",
        "vae_latents": "unscaled latents for the VAE alone (random)",
        "vae_sample": "`pipe.vae.decode(vae_latents).sample` (about [-1, 1])",
    }
    for k, v in t.items():
        lines.append(f"| `{k}` | {list(v.shape)} | {what[k]} |")
    lines.append("")
    lines.append(
        f"Versions: torch {torch.__version__}, diffusers {g.diffusers.__version__}, "
        f"transformers {g.transformers.__version__}."
    )
    (D / "batch2.md").write_text("\n".join(lines) + "\n")
    print("[gen] batch2: " + ", ".join(f"{k}{list(v.shape)}" for k, v in t.items()))


if __name__ == "__main__":
    main()
