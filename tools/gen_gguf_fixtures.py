#!/usr/bin/env python3
"""GGUF reader fixtures (issue 37: GGUF weights).

Writes `fixtures/gguf/`:

* `types.gguf`: one tensor per GGML type DDO reads (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
  Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), each named after its type in lower case (`q4_k`, ...), numpy shape
  [2, 256] (ggml dims [256, 2]), plus `f32_3d` (F32, numpy shape [2, 3, 4]) for the row-major shape
  check; and metadata of every GGUF value type, a string array and a nested array (keys `ddo.test.*`,
  values listed in `METADATA` below). Written by gguf-py's `GGUFWriter` (GGUF v3, alignment 32).
* `dequantized.safetensors`: for every tensor, `gguf.quants.dequantize` of its bytes as read back by
  gguf-py's `GGUFReader`, float32, in the tensor's numpy shape. DDO's host dequantization must match it
  bit for bit.

The quantized tensors are random bytes (numpy `default_rng(SEED)`), with every f16 scale field (`d`, and
`m`/`dmin` where the format has one) overwritten by a finite value of moderate magnitude (sign random,
|x| in [2^-10, 4); the 8th, 16th, ... block's is zero), so every block is valid while the quantized
values and packed sub-scales keep every bit pattern. Float tensors are normal samples (F16 and BF16: rounded/truncated from float32).

Usage (versions of fixtures/gguf/README.md):
  python3 -m venv /tmp/ggufvenv
  /tmp/ggufvenv/bin/pip install gguf==0.19.0 numpy==2.4.6 safetensors==0.8.0
  /tmp/ggufvenv/bin/python tools/gen_gguf_fixtures.py
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter, GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize
from safetensors.numpy import save_file

SEED = 37
OUT = Path(__file__).resolve().parent.parent / "fixtures" / "gguf"
SHAPE = (2, 256)

# Byte offsets of the f16 scale fields in one block of each quantized type.
SCALE_FIELDS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}

METADATA = [
    ("ddo.test.u8", "add_uint8", 200),
    ("ddo.test.i8", "add_int8", -100),
    ("ddo.test.u16", "add_uint16", 60000),
    ("ddo.test.i16", "add_int16", -30000),
    ("ddo.test.u32", "add_uint32", 4000000000),
    ("ddo.test.i32", "add_int32", -2000000000),
    ("ddo.test.f32", "add_float32", 1.5),
    ("ddo.test.bool", "add_bool", True),
    ("ddo.test.string", "add_string", "grüße, GGUF"),
    ("ddo.test.u64", "add_uint64", 18000000000000000000),
    ("ddo.test.i64", "add_int64", -9000000000000000000),
    ("ddo.test.f64", "add_float64", 2.25),
    ("ddo.test.strings", "add_array", ["a", "bc", ""]),
    ("ddo.test.nested", "add_array", [[1, 2, 3], [-4, 5]]),
]


def scales(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite f16 values: sign random, magnitude 2^[-10, 2); the 8th, 16th, ... are zero (so the
    legacy types, 16 blocks each, get zero scales and the K-quants, 2 blocks each, none)."""
    mag = np.exp2(rng.uniform(-10.0, 2.0, size=n)).astype(np.float32)
    sign = np.where(rng.integers(0, 2, size=n) == 1, -1.0, 1.0).astype(np.float32)
    v = (mag * sign).astype(np.float16)
    v[7::8] = 0.0
    assert np.all(np.isfinite(v))
    return v


def quantized_bytes(rng: np.random.Generator, qtype: T) -> np.ndarray:
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    n_blocks = SHAPE[0] * SHAPE[1] // block_elems
    blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    for off in SCALE_FIELDS[qtype]:
        blocks[:, off : off + 2] = scales(rng, n_blocks).view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(SHAPE[0], -1)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    path = OUT / "types.gguf"
    writer = GGUFWriter(str(path), arch="ddo-test")
    for key, method, value in METADATA:
        getattr(writer, method)(key, value)

    writer.add_tensor("f32", rng.standard_normal(SHAPE).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal(SHAPE).astype(np.float16))
    bf16 = (rng.standard_normal(SHAPE).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    writer.add_tensor("bf16", bf16.view(np.uint8), raw_dtype=T.BF16)
    for qtype in SCALE_FIELDS:
        writer.add_tensor(qtype.name.lower(), quantized_bytes(rng, qtype), raw_dtype=qtype)
    writer.add_tensor("f32_3d", rng.standard_normal((2, 3, 4)).astype(np.float32))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    reader = GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        values = dequantize(np.ascontiguousarray(t.data), t.tensor_type)
        out[t.name] = np.ascontiguousarray(values.astype(np.float32, copy=False).reshape(shape))
    save_file(out, str(OUT / "dequantized.safetensors"))

    versions = {p: importlib.metadata.version(p) for p in ("gguf", "numpy", "safetensors")}
    print(f"wrote {path} and dequantized.safetensors ({len(out)} tensors) with {versions}, "
          f"Python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
