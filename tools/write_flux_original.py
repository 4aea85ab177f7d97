#!/usr/bin/env python3
"""Writes a random FLUX.1-dev-sized transformer as one safetensors file in the original (Black Forest Labs)
layout, as a ComfyUI scaled fp8 file is laid out: every 2-D weight float8_e4m3fn with a per-tensor
`<layer>.scale_weight` (float32, shape [], `amax / 448`), biases and norm scales bfloat16, the `scaled_fp8`
marker, no prefix. Weights are N(0, 0.02), made on the GPU when there is one. For real-scale measurements of
`ddo run/bench --transformer FILE` (issue 18); nothing in CI reads it.

Needs only torch (the safetensors header is written by hand).

  python3 tools/write_flux_original.py OUT.safetensors [--bf16] [--layers 19 --single-layers 38]
"""

from __future__ import annotations

import argparse
import json
import struct

import torch

D, HEAD, MLP, TXT, VEC, IN = 3072, 128, 12288, 4096, 768, 64


def shapes(layers: int, single: int):
    s = {}

    def lin(name, out_f, in_f):
        s[f"{name}.weight"] = (out_f, in_f)
        s[f"{name}.bias"] = (out_f,)

    lin("img_in", D, IN)
    lin("txt_in", D, TXT)
    for e, i in (("time_in", 256), ("vector_in", VEC), ("guidance_in", 256)):
        lin(f"{e}.in_layer", D, i)
        lin(f"{e}.out_layer", D, D)
    for b in range(layers):
        p = f"double_blocks.{b}"
        for s_ in ("img", "txt"):
            lin(f"{p}.{s_}_mod.lin", 6 * D, D)
            lin(f"{p}.{s_}_attn.qkv", 3 * D, D)
            lin(f"{p}.{s_}_attn.proj", D, D)
            s[f"{p}.{s_}_attn.norm.query_norm.scale"] = (HEAD,)
            s[f"{p}.{s_}_attn.norm.key_norm.scale"] = (HEAD,)
            lin(f"{p}.{s_}_mlp.0", MLP, D)
            lin(f"{p}.{s_}_mlp.2", D, MLP)
    for b in range(single):
        p = f"single_blocks.{b}"
        lin(f"{p}.modulation.lin", 3 * D, D)
        lin(f"{p}.linear1", 3 * D + MLP, D)
        lin(f"{p}.linear2", D, D + MLP)
        s[f"{p}.norm.query_norm.scale"] = (HEAD,)
        s[f"{p}.norm.key_norm.scale"] = (HEAD,)
    lin("final_layer.linear", IN, D)
    lin("final_layer.adaLN_modulation.1", 2 * D, D)
    return s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--bf16", action="store_true", help="every tensor bfloat16 (no fp8, no scales)")
    ap.add_argument("--layers", type=int, default=19)
    ap.add_argument("--single-layers", type=int, default=38)
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    tensors = {}
    for name, shape in shapes(a.layers, a.single_layers).items():
        if name.endswith(".scale"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=dev)
        else:
            t = 0.02 * torch.randn(shape, generator=gen, device=dev)
        if len(shape) == 2 and not a.bf16:
            scale = (t.abs().max() / 448.0).float()
            tensors[name] = (t / scale).to(torch.float8_e4m3fn).cpu()
            tensors[name[: -len(".weight")] + ".scale_weight"] = scale.reshape(()).cpu()
        else:
            tensors[name] = t.to(torch.bfloat16).cpu()
    if not a.bf16:
        tensors["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
    names = {torch.float8_e4m3fn: "F8_E4M3", torch.bfloat16: "BF16", torch.float32: "F32"}
    header, off = {}, 0
    for k, t in tensors.items():
        n = t.numel() * t.element_size()
        header[k] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(a.out, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for t in tensors.values():
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    print(f"wrote {a.out}: {len(tensors)} tensors, {off / 1e9:.3f} GB of data")


if __name__ == "__main__":
    main()
