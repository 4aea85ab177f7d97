#!/usr/bin/env python3
"""Writes a FLUX.1-dev-sized GGUF transformer with random weights in the original (BFL) layout, as
city96's FLUX.1 GGUFs hold it (issue 37's benchmark file): every 2-D weight whose rows are whole blocks
of TYPE (Q8_0: 32 elements, Q4_K: 256) stored as TYPE blocks of random bytes whose f16 scale fields are
set to small finite values (so the weights stay small and finite), every other tensor (biases, norm
scales, `img_in` under Q4_K) F32 with small random values; `general.architecture` "flux", GGUF v3,
alignment 32. Needs only numpy (the GPU machine has it); writes about 12.7 GB (Q8_0) or 6.9 GB (Q4_K).

Usage: python3 tools/make_flux_gguf.py OUT.gguf [--type Q8_0|Q4_K] [--double 19] [--single 38]
       [--seed 0]
"""

import argparse
import json
import struct

import numpy as np

H, HEAD, MLP, IN, CTX, VEC, TIME = 3072, 128, 12288, 64, 4096, 768, 256

# ggml type id, elements a block, bytes a block, (offset, f16 value) of each scale field.
TYPES = {
    "Q8_0": (8, 32, 34, [(0, 2.0**-11)]),
    "Q4_K": (12, 256, 144, [(0, 2.0**-14), (2, 2.0**-15)]),
}
F32 = 0
ALIGN = 32


def tensors(double: int, single: int):
    """(name, numpy shape) of every tensor, in file order."""
    out = []

    def lin(name, o, i):
        out.extend([(f"{name}.weight", (o, i)), (f"{name}.bias", (o,))])

    lin("img_in", H, IN)
    lin("txt_in", H, CTX)
    for e, i in [("time_in", TIME), ("guidance_in", TIME), ("vector_in", VEC)]:
        lin(f"{e}.in_layer", H, i)
        lin(f"{e}.out_layer", H, H)
    for b in range(double):
        for s in ("img", "txt"):
            p = f"double_blocks.{b}.{s}"
            lin(f"{p}_mod.lin", 6 * H, H)
            lin(f"{p}_attn.qkv", 3 * H, H)
            out.append((f"{p}_attn.norm.query_norm.scale", (HEAD,)))
            out.append((f"{p}_attn.norm.key_norm.scale", (HEAD,)))
            lin(f"{p}_attn.proj", H, H)
            lin(f"{p}_mlp.0", MLP, H)
            lin(f"{p}_mlp.2", H, MLP)
    for b in range(single):
        p = f"single_blocks.{b}"
        lin(f"{p}.linear1", 3 * H + MLP, H)
        lin(f"{p}.linear2", H, H + MLP)
        out.append((f"{p}.norm.query_norm.scale", (HEAD,)))
        out.append((f"{p}.norm.key_norm.scale", (HEAD,)))
        lin(f"{p}.modulation.lin", 3 * H, H)
    lin("final_layer.linear", IN, H)
    lin("final_layer.adaLN_modulation.1", 2 * H, H)
    return out


def gguf_string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--type", default="Q8_0", choices=sorted(TYPES))
    ap.add_argument("--double", type=int, default=19)
    ap.add_argument("--single", type=int, default=38)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    qid, qelems, qbytes, scales = TYPES[args.type]
    plan, at = [], 0
    for name, shape in tensors(args.double, args.single):
        n = int(np.prod(shape))
        if len(shape) == 2 and shape[1] % qelems == 0:
            ty, nbytes = qid, n // qelems * qbytes
        else:
            ty, nbytes = F32, 4 * n
        plan.append((name, shape, ty, at, nbytes))
        at += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    header = b"GGUF" + struct.pack("<IQQ", 3, len(plan), 1)
    header += gguf_string("general.architecture") + struct.pack("<I", 8) + gguf_string("flux")
    for name, shape, ty, off, _ in plan:
        dims = list(reversed(shape))
        header += gguf_string(name) + struct.pack("<I", len(dims))
        header += b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", ty, off)
    header += b"\0" * ((-len(header)) % ALIGN)
    rng = np.random.default_rng(args.seed)
    stored = 0
    with open(args.out, "wb") as f:
        f.write(header)
        for name, shape, ty, off, nbytes in plan:
            if ty == F32:
                data = (rng.standard_normal(int(np.prod(shape)), dtype=np.float32) * 0.02).tobytes()
            else:
                blocks = np.frombuffer(rng.bytes(nbytes), dtype=np.uint8).reshape(-1, qbytes).copy()
                for field, value in scales:
                    blocks[:, field : field + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
                data = blocks.tobytes()
            f.write(data)
            f.write(b"\0" * ((-nbytes) % ALIGN))
            stored += nbytes
    print(json.dumps({"out": args.out, "type": args.type, "tensors": len(plan), "bytes": len(header) + at,
                      "tensor_bytes": stored}))


if __name__ == "__main__":
    main()
