#!/usr/bin/env python3
"""Writes a random kohya-format LoRA for the FLUX.1-dev transformer (issue 36's benchmark
LoRA): rank R (default 32) on every attention and MLP linear of every block — double blocks'
img/txt qkv, proj, mlp.0 and mlp.2; single blocks' linear1 and linear2 — bf16 factors with
alpha = rank, small values so the image stays finite. With `--qwen`, the same for the
Qwen-Image transformer (`--double` blocks, default 60 then) in the Diffusers/PEFT layout:
`transformer.transformer_blocks.{i}.<module>.lora_A/lora_B.weight` and `.alpha` for the
attention's to_q/k/v, to_out.0, add_q/k/v_proj, to_add_out and both streams' MLPs. Needs only
numpy (the GPU machine has it).

Usage: python3 tools/make_flux_lora.py OUT.safetensors [--rank 32] [--hidden 3072]
       [--double 19] [--single 38] [--seed 0] [--qwen]
"""

import argparse
import json
import struct

import numpy as np


def bf16_bytes(a: np.ndarray) -> bytes:
    """Round-to-nearest-even f32 → bf16, little-endian."""
    u = a.astype(np.float32).view(np.uint32)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype(np.uint16).tobytes()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--double", type=int, default=19)
    ap.add_argument("--single", type=int, default=38)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--qwen", action="store_true")
    args = ap.parse_args()
    h, r = args.hidden, args.rank
    mlp = 4 * h
    modules = []
    if args.qwen:
        blocks = 60 if args.double == 19 else args.double
        for i in range(blocks):
            for m, out, inp in [
                ("attn.to_q", h, h),
                ("attn.to_k", h, h),
                ("attn.to_v", h, h),
                ("attn.to_out.0", h, h),
                ("attn.add_q_proj", h, h),
                ("attn.add_k_proj", h, h),
                ("attn.add_v_proj", h, h),
                ("attn.to_add_out", h, h),
                ("img_mlp.net.0.proj", mlp, h),
                ("img_mlp.net.2", h, mlp),
                ("txt_mlp.net.0.proj", mlp, h),
                ("txt_mlp.net.2", h, mlp),
            ]:
                modules.append((f"transformer.transformer_blocks.{i}.{m}", out, inp))
        args.single = 0
    for i in range(0 if args.qwen else args.double):
        for side in ("img", "txt"):
            modules += [
                (f"double_blocks_{i}_{side}_attn_qkv", 3 * h, h),
                (f"double_blocks_{i}_{side}_attn_proj", h, h),
                (f"double_blocks_{i}_{side}_mlp_0", mlp, h),
                (f"double_blocks_{i}_{side}_mlp_2", h, mlp),
            ]
    for i in range(args.single):
        modules += [
            (f"single_blocks_{i}_linear1", 3 * h + mlp, h),
            (f"single_blocks_{i}_linear2", h, h + mlp),
        ]
    rng = np.random.default_rng(args.seed)
    header, chunks, at = {}, [], 0

    def put(name, shape, data: bytes, dtype):
        nonlocal at
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(data)]}
        chunks.append(data)
        at += len(data)

    for name, out, inp in modules:
        down = rng.standard_normal((r, inp), dtype=np.float32) * (1.0 / np.sqrt(inp))
        up = rng.standard_normal((out, r), dtype=np.float32) * 0.01
        if args.qwen:
            put(f"{name}.lora_A.weight", [r, inp], bf16_bytes(down), "BF16")
            put(f"{name}.lora_B.weight", [out, r], bf16_bytes(up), "BF16")
            put(f"{name}.alpha", [], struct.pack("<f", float(r)), "F32")
            continue
        put(f"lora_unet_{name}.lora_down.weight", [r, inp], bf16_bytes(down), "BF16")
        put(f"lora_unet_{name}.lora_up.weight", [out, r], bf16_bytes(up), "BF16")
        put(f"lora_unet_{name}.alpha", [], struct.pack("<f", float(r)), "F32")
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * ((8 - len(head) % 8) % 8)
    with open(args.out, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for c in chunks:
            f.write(c)
    print(json.dumps({"out": args.out, "modules": len(modules), "rank": r, "bytes": 8 + len(head) + at}))


if __name__ == "__main__":
    main()
