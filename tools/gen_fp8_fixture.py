#!/usr/bin/env python3
"""fp8 references for the tiny Flux transformer (issue 18: fp8 weights).

Loads the committed `fixtures/flux_transformer/` (float32) and writes two folders beside it, each with
`config.json`, `diffusion_pytorch_model.safetensors`, `outputs.safetensors` and `README.md`; both take
`fixtures/flux_transformer/inputs.safetensors` as their inputs (cast to bfloat16 for the call).

* `flux_transformer_fp8/`: Diffusers' layerwise casting. The model is cast to bfloat16, then
  `model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)` (its
  default skip patterns: `DEFAULT_SKIP_MODULES_PATTERN` and the model's `_skip_layerwise_casting_patterns`);
  the weight file is the model's state dict as stored (the cast layers' weights and biases as float8_e4m3fn,
  no scale; the rest bfloat16), and `sample` is the layerwise-cast model's output.
* `flux_transformer_fp8_scaled/`: a scaled fp8 checkpoint as ComfyUI writes one. Each weight of the same cast
  layers is quantized from the float32 fixture with one scale: `scale = amax / 448`,
  `q = (w / scale).to(float8_e4m3fn)`, stored with `<layer>.scale_weight` (float32, shape []); every other
  tensor (biases, norms, modulations) is bfloat16. `sample` is the output of the bfloat16 model whose cast
  weights are `(q.float() * scale).to(bfloat16)`, what DDO's dequantizing linears compute on.

Usage (the venv of tools/README.md):

  .venv-fixtures/bin/python tools/gen_fp8_fixture.py
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections import OrderedDict
from pathlib import Path

import torch
from diffusers import FluxTransformer2DModel
from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_fixtures as g  # noqa: E402

SRC = g.FIXTURES / "flux_transformer"
FP8 = torch.float8_e4m3fn
CAST_TYPES = (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Embedding)


def load_bf16():
    model = g.load_saved_model("flux_transformer", SRC)
    return model.to(torch.bfloat16).eval()


def skip_patterns(model) -> tuple[str, ...]:
    pats = tuple(DEFAULT_SKIP_MODULES_PATTERN) + tuple(model._skip_layerwise_casting_patterns or ())
    return tuple(sorted(set(pats)))


def cast_modules(model) -> list[str]:
    pats = skip_patterns(model)
    names = []
    for name, m in model.named_modules():
        if isinstance(m, CAST_TYPES) and not any(re.search(p, name) for p in pats):
            # A parent matched by a pattern is skipped with its children, as Diffusers' walk does.
            parts = name.split(".")
            parents = [".".join(parts[:i]) for i in range(1, len(parts))]
            if not any(any(re.search(p, q) for p in pats) for q in parents):
                names.append(name)
    return names


def inputs_bf16():
    ins = load_file(str(SRC / "inputs.safetensors"))
    bf = lambda k: ins[k].to(torch.bfloat16)  # noqa: E731
    return dict(
        hidden_states=bf("hidden_states"),
        encoder_hidden_states=bf("encoder_hidden_states"),
        pooled_projections=bf("pooled_projections"),
        timestep=ins["timestep"],
        guidance=ins["guidance"],
        img_ids=ins["img_ids"],
        txt_ids=ins["txt_ids"],
    )


def run(model) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs_bf16(), joint_attention_kwargs=None, return_dict=False)[0]
    return out.float().contiguous()


def write(d: Path, weights: "OrderedDict[str, torch.Tensor]", sample: torch.Tensor, readme: str):
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    shutil.copy(SRC / "config.json", d / "config.json")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(d / "diffusion_pytorch_model.safetensors"))
    save_file({"sample": sample}, str(d / "outputs.safetensors"))
    (d / "README.md").write_text(readme)


def main():
    g.check_versions(strict="--allow-version-mismatch" not in sys.argv)
    versions = f"torch {torch.__version__}, diffusers {g.diffusers.__version__}"

    # Diffusers' layerwise casting.
    model = load_bf16()
    names = cast_modules(model)
    model.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.bfloat16)
    stored = OrderedDict((k, v.detach().clone()) for k, v in model.state_dict().items())
    fp8_keys = [k for k, v in stored.items() if v.dtype == FP8]
    assert fp8_keys, "layerwise casting stored nothing as fp8"
    sample = run(model)
    write(
        g.FIXTURES / "flux_transformer_fp8",
        stored,
        sample,
        "# `flux_transformer_fp8`\n\nWritten by `tools/gen_fp8_fixture.py` (see its docstring): the tiny Flux "
        "transformer of `../flux_transformer` in bfloat16 with Diffusers' "
        "`enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)`, its state "
        f"dict as stored ({len(fp8_keys)} float8_e4m3fn tensors: the weights and biases of "
        f"{len(names)} layers), and `sample`, its output on `../flux_transformer/inputs.safetensors` cast to "
        f"bfloat16. Skip patterns: {list(skip_patterns(model))}.\n\nCast layers: "
        + ", ".join(f"`{n}`" for n in names)
        + f".\n\nVersions: {versions}.\n",
    )
    print(f"[gen] flux_transformer_fp8: {len(fp8_keys)} fp8 tensors, sample {list(sample.shape)}")

    # A ComfyUI-style scaled fp8 checkpoint.
    src = load_file(str(SRC / "diffusion_pytorch_model.safetensors"))
    weights = OrderedDict()
    deq = {}
    for k, v in src.items():
        layer = k[: -len(".weight")] if k.endswith(".weight") else None
        if layer in names:
            w = v.float()
            amax = w.abs().max()
            scale = (amax / 448.0) if amax > 0 else torch.tensor(1.0)
            scale = scale.to(torch.float32)
            q = (w / scale).to(FP8)
            weights[k] = q
            weights[f"{layer}.scale_weight"] = scale.reshape(())
            deq[k] = (q.float() * scale).to(torch.bfloat16)
        else:
            weights[k] = v.to(torch.bfloat16)
    model = load_bf16()
    with torch.no_grad():
        for k, p in model.named_parameters():
            if k in deq:
                p.copy_(deq[k])
    sample = run(model)
    write(
        g.FIXTURES / "flux_transformer_fp8_scaled",
        weights,
        sample,
        "# `flux_transformer_fp8_scaled`\n\nWritten by `tools/gen_fp8_fixture.py` (see its docstring): the weights "
        f"of the {len(names)} layers Diffusers' layerwise casting casts, quantized from `../flux_transformer` "
        "(float32) as ComfyUI's scaled fp8 checkpoints are: `scale = amax / 448`, `q = (w / scale)."
        "to(float8_e4m3fn)`, stored with `<layer>.scale_weight` (float32, shape []); every other tensor in "
        "bfloat16. `sample`: the bfloat16 model whose cast weights are `(q.float() * scale).to(bfloat16)`, on "
        f"`../flux_transformer/inputs.safetensors` cast to bfloat16.\n\nVersions: {versions}.\n",
    )
    print(f"[gen] flux_transformer_fp8_scaled: {len(names)} scaled weights")
    json.dumps(names)


if __name__ == "__main__":
    main()
