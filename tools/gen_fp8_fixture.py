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

With `--original` it writes `flux_transformer_original/` instead: the same weights as single files in the
original Flux layout (float32; and a ComfyUI-style scaled fp8 file), see that folder's README.md.

Usage (the venv of tools/README.md):

  .venv-fixtures/bin/python tools/gen_fp8_fixture.py
  .venv-fixtures/bin/python tools/gen_fp8_fixture.py --original
  .venv-fixtures/bin/python tools/gen_fp8_fixture.py --vae      # vae_flux_original/: the VAE in ae.safetensors' layout
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


if __name__ == "__main__" and "--original" not in sys.argv and "--vae" not in sys.argv:
    main()


# --------------------------------------------------------------------------
# single files in the original (Black Forest Labs) layout
# --------------------------------------------------------------------------


def to_original(sd: "dict[str, torch.Tensor]", cfg) -> "OrderedDict[str, torch.Tensor]":
    """The inverse of Diffusers' `convert_flux_transformer_checkpoint_to_diffusers`, written from it by hand;
    `main_original` checks it by converting back with Diffusers' own function."""
    o = OrderedDict()
    both = lambda ours, theirs: [o.__setitem__(f"{theirs}.{p}", sd[f"{ours}.{p}"]) for p in ("weight", "bias")]  # noqa: E731
    for ours, theirs in [
        ("time_text_embed.timestep_embedder", "time_in"),
        ("time_text_embed.text_embedder", "vector_in"),
        ("time_text_embed.guidance_embedder", "guidance_in"),
    ]:
        both(f"{ours}.linear_1", f"{theirs}.in_layer")
        both(f"{ours}.linear_2", f"{theirs}.out_layer")
    both("context_embedder", "txt_in")
    both("x_embedder", "img_in")
    for i in range(cfg.num_layers):
        b, t = f"transformer_blocks.{i}", f"double_blocks.{i}"
        both(f"{b}.norm1.linear", f"{t}.img_mod.lin")
        both(f"{b}.norm1_context.linear", f"{t}.txt_mod.lin")
        for p in ("weight", "bias"):
            o[f"{t}.img_attn.qkv.{p}"] = torch.cat([sd[f"{b}.attn.to_{x}.{p}"] for x in "qkv"])
            o[f"{t}.txt_attn.qkv.{p}"] = torch.cat([sd[f"{b}.attn.add_{x}_proj.{p}"] for x in "qkv"])
        for ours, theirs in [
            ("norm_q", "img_attn.norm.query_norm"),
            ("norm_k", "img_attn.norm.key_norm"),
            ("norm_added_q", "txt_attn.norm.query_norm"),
            ("norm_added_k", "txt_attn.norm.key_norm"),
        ]:
            o[f"{t}.{theirs}.scale"] = sd[f"{b}.attn.{ours}.weight"]
        both(f"{b}.ff.net.0.proj", f"{t}.img_mlp.0")
        both(f"{b}.ff.net.2", f"{t}.img_mlp.2")
        both(f"{b}.ff_context.net.0.proj", f"{t}.txt_mlp.0")
        both(f"{b}.ff_context.net.2", f"{t}.txt_mlp.2")
        both(f"{b}.attn.to_out.0", f"{t}.img_attn.proj")
        both(f"{b}.attn.to_add_out", f"{t}.txt_attn.proj")
    for i in range(cfg.num_single_layers):
        b, t = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        both(f"{b}.norm.linear", f"{t}.modulation.lin")
        for p in ("weight", "bias"):
            o[f"{t}.linear1.{p}"] = torch.cat([sd[f"{b}.attn.to_{x}.{p}"] for x in "qkv"] + [sd[f"{b}.proj_mlp.{p}"]])
        o[f"{t}.norm.query_norm.scale"] = sd[f"{b}.attn.norm_q.weight"]
        o[f"{t}.norm.key_norm.scale"] = sd[f"{b}.attn.norm_k.weight"]
        both(f"{b}.proj_out", f"{t}.linear2")
    both("proj_out", "final_layer.linear")
    for p in ("weight", "bias"):
        scale, shift = sd[f"norm_out.linear.{p}"].chunk(2, dim=0)
        o[f"final_layer.adaLN_modulation.1.{p}"] = torch.cat([shift, scale])
    return o


FUSED_CAST = re.compile(
    r"(img_attn\.qkv|txt_attn\.qkv|img_attn\.proj|txt_attn\.proj|img_mlp\.[02]|txt_mlp\.[02]|linear1|linear2"
    r"|^img_in|^txt_in|time_in\..*|vector_in\..*|guidance_in\..*)\.weight$"
)


def main_original():
    # The Diffusers fixture's weights realigned into fresh storage (as g.load_saved_model does).
    model = g.load_saved_model("flux_transformer", SRC)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = model.config
    orig = to_original(sd, cfg)
    # Diffusers converts it back to exactly the fixture (its inner_dim is FLUX.1's 3072: the
    # split of linear1 needs it, so it is given the tiny width here).
    import diffusers.loaders.single_file_utils as sfu

    import types

    src_code = sfu.convert_flux_transformer_checkpoint_to_diffusers
    code = src_code.__code__
    consts = tuple(cfg.num_attention_heads * cfg.attention_head_dim if c == 3072 else c for c in code.co_consts)
    patched = types.FunctionType(code.replace(co_consts=consts), src_code.__globals__)
    back = patched({k: v.clone() for k, v in orig.items()})
    assert set(back) == set(sd), set(back) ^ set(sd)
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    d = g.FIXTURES / "flux_transformer_original"
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in orig.items()}, str(d / "flux1-tiny.safetensors"))

    # A ComfyUI-style scaled fp8 file: under model.diffusion_model., the cast layers' (fused) weights as
    # float8_e4m3fn with one scale each, everything else bfloat16, and the `scaled_fp8` marker.
    fp8 = OrderedDict()
    deq = OrderedDict()
    for k, v in orig.items():
        if FUSED_CAST.search(k):
            w = v.float()
            scale = (w.abs().max() / 448.0).to(torch.float32)
            q = (w / scale).to(FP8)
            fp8["model.diffusion_model." + k] = q
            fp8["model.diffusion_model." + k[: -len(".weight")] + ".scale_weight"] = scale.reshape(())
            deq[k] = (q.float() * scale).to(torch.bfloat16)
        else:
            fp8["model.diffusion_model." + k] = v.to(torch.bfloat16)
            deq[k] = v.to(torch.bfloat16)
    fp8["scaled_fp8"] = torch.zeros(0, dtype=FP8)
    save_file({k: v.contiguous() for k, v in fp8.items()}, str(d / "flux1-tiny-fp8-scaled.safetensors"))
    ref = load_bf16()
    converted = patched({k: v.clone() for k, v in deq.items()})
    ref.load_state_dict(converted, strict=True)
    sample = run(ref)
    save_file({"sample_fp8_scaled": sample}, str(d / "outputs.safetensors"))
    shutil.copy(SRC / "config.json", d / "config.json")
    # The pipeline fixture's transformer in the same layout (for `ddo run --weights
    # fixtures/flux_pipeline --transformer FILE`), checked the same way.
    pipe_model = FluxTransformer2DModel.from_pretrained(
        str(g.FIXTURES / "flux_pipeline" / "transformer"), torch_dtype=torch.float32
    )
    psd = {k: v.detach().clone() for k, v in pipe_model.state_dict().items()}
    porig = to_original(psd, pipe_model.config)
    pback = patched({k: v.clone() for k, v in porig.items()})
    assert set(pback) == set(psd) and all(torch.equal(pback[k], psd[k]) for k in psd)
    save_file({k: v.contiguous() for k, v in porig.items()}, str(d / "flux_pipeline-transformer.safetensors"))
    n_fp8 = sum(1 for v in fp8.values() if v.dtype == FP8 and v.numel() > 0)
    (d / "README.md").write_text(
        "# `flux_transformer_original`\n\nWritten by `tools/gen_fp8_fixture.py`: `../flux_transformer` as single "
        "files in the original Flux layout (`double_blocks.N.img_attn.qkv`, `single_blocks.N.linear1`, "
        "`final_layer.adaLN_modulation.1`, ...), made by the inverse of Diffusers' "
        "`convert_flux_transformer_checkpoint_to_diffusers` and checked by converting back with that function "
        "(its `inner_dim = 3072` set to the tiny width), which gives the fixture's state dict exactly.\n\n"
        "* `flux1-tiny.safetensors`: float32, no prefix.\n"
        "* `flux_pipeline-transformer.safetensors`: `../flux_pipeline/transformer` the same way (float32, no "
        "prefix), for `ddo run --weights fixtures/flux_pipeline --transformer FILE`.\n"
        f"* `flux1-tiny-fp8-scaled.safetensors`: as ComfyUI's scaled fp8 files: under `model.diffusion_model.`, "
        f"{n_fp8} (fused) weights as float8_e4m3fn with `<layer>.scale_weight` (`amax / 448`, float32, shape []), "
        "the rest bfloat16, and the `scaled_fp8` marker.\n"
        "* `outputs.safetensors`: `sample_fp8_scaled`, the bfloat16 Diffusers model on the dequantized weights "
        "(`(q.float() * scale).to(bfloat16)`, converted with Diffusers' function) on "
        "`../flux_transformer/inputs.safetensors` cast to bfloat16.\n"
        "* `config.json`: the tiny config (its RoPE axes cannot be read from the tensors).\n\n"
        f"Versions: torch {torch.__version__}, diffusers {g.diffusers.__version__}.\n"
    )
    print(f"[gen] flux_transformer_original: {len(orig)} tensors, {n_fp8} fp8")


if __name__ == "__main__" and "--original" in sys.argv:
    main_original()


# --------------------------------------------------------------------------
# the VAE as one file in the original (LDM / Black Forest Labs `ae.safetensors`) layout
# --------------------------------------------------------------------------


def vae_to_ldm(sd: "dict[str, torch.Tensor]", num_up: int) -> "OrderedDict[str, torch.Tensor]":
    """The inverse of Diffusers' `convert_ldm_vae_checkpoint`, written from it by hand;
    `main_vae` checks it by converting back with Diffusers' own function."""
    o = OrderedDict()
    for k, v in sd.items():
        n = k
        n = re.sub(r"^(encoder|decoder)\.conv_norm_out\.", r"\1.norm_out.", n)
        n = re.sub(r"encoder\.down_blocks\.(\d+)\.resnets\.", r"encoder.down.\1.block.", n)
        n = re.sub(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.conv\.", r"encoder.down.\1.downsample.conv.", n)
        m = re.match(r"decoder\.up_blocks\.(\d+)\.(resnets|upsamplers\.0\.conv)\.(.*)", n)
        if m:
            block = num_up - 1 - int(m.group(1))
            part = "block" if m.group(2) == "resnets" else "upsample.conv"
            n = f"decoder.up.{block}.{part}.{m.group(3)}"
        n = re.sub(r"mid_block\.resnets\.(\d+)\.", lambda mm: f"mid.block_{int(mm.group(1)) + 1}.", n)
        n = n.replace("conv_shortcut", "nin_shortcut")
        if ".mid_block.attentions.0." in n:
            n = n.replace(".mid_block.attentions.0.", ".mid.attn_1.")
            n = (
                n.replace("group_norm.", "norm.")
                .replace("to_q.", "q.")
                .replace("to_k.", "k.")
                .replace("to_v.", "v.")
                .replace("to_out.0.", "proj_out.")
            )
            if n.endswith(("q.weight", "k.weight", "v.weight", "proj_out.weight")):
                v = v[:, :, None, None]  # LDM keeps them as 1x1 convolutions
        o[n] = v
    return o


def main_vae():
    from diffusers import AutoencoderKL
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    src = g.FIXTURES / "vae_flux"
    model = AutoencoderKL.from_pretrained(str(src), torch_dtype=torch.float32)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ldm = vae_to_ldm(sd, len(model.config.up_block_types))
    back = convert_ldm_vae_checkpoint({k: v.clone() for k, v in ldm.items()}, dict(model.config))
    assert set(back) == set(sd), sorted(set(back) ^ set(sd))[:8]
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    d = g.FIXTURES / "vae_flux_original"
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in ldm.items()}, str(d / "ae-tiny.safetensors"))
    # The pipeline fixture's VAE the same way (for `ddo run --weights fixtures/flux_pipeline --vae FILE`).
    pvae = AutoencoderKL.from_pretrained(str(g.FIXTURES / "flux_pipeline" / "vae"), torch_dtype=torch.float32)
    psd = {k: v.detach().clone() for k, v in pvae.state_dict().items()}
    pldm = vae_to_ldm(psd, len(pvae.config.up_block_types))
    pback = convert_ldm_vae_checkpoint({k: v.clone() for k, v in pldm.items()}, dict(pvae.config))
    assert set(pback) == set(psd) and all(torch.equal(pback[k], psd[k]) for k in psd)
    save_file({k: v.contiguous() for k, v in pldm.items()}, str(d / "flux_pipeline-vae.safetensors"))
    (d / "README.md").write_text(
        "# `vae_flux_original`\n\nWritten by `tools/gen_fp8_fixture.py --vae`: `../vae_flux` (float32) as one file in "
        "the original layout of Black Forest Labs' `ae.safetensors` (LDM names: `decoder.up.N.block.M`, reversed "
        "block order, `mid.block_1`, `mid.attn_1.q` as 1x1 convolutions, `nin_shortcut`, `norm_out`), made by "
        "the inverse of Diffusers' `convert_ldm_vae_checkpoint` and checked by converting back with that function, "
        f"which gives the fixture's state dict exactly ({len(ldm)} tensors, encoder included). "
        "`flux_pipeline-vae.safetensors`: `../flux_pipeline/vae` the same way.\n\n"
        f"Versions: torch {torch.__version__}, diffusers {g.diffusers.__version__}.\n"
    )
    print(f"[gen] vae_flux_original: {len(ldm)} tensors")


if __name__ == "__main__" and "--vae" in sys.argv:
    main_vae()
