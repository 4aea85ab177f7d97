#!/usr/bin/env python3
"""A tiny Flux transformer as a GGUF file in the original (BFL) layout, as city96's FLUX.1 GGUFs
hold it (issue 37): the committed `fixtures/flux_transformer_original/flux_pipeline-transformer.safetensors`
with every 2-D tensor whose rows are whole 32-element blocks quantized by gguf-py (`gguf.quants.quantize`),
the types taken in turn from Q8_0, Q4_0, Q5_1, Q4_1, Q5_0, and every other tensor kept F32;
`general.architecture` "flux".

Writes `fixtures/gguf/`:

* `flux_pipeline-transformer-mixed.gguf`;
* `flux_pipeline-transformer-mixed.dequantized.safetensors`: gguf-py's `dequantize` of every tensor as
  read back by `GGUFReader`, float32, under the same names and shapes: the original-layout safetensors
  file DDO's GGUF load must equal.

Usage (the venv of tools/gen_gguf_fixtures.py):
  /tmp/ggufvenv/bin/python tools/gen_gguf_flux.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter, GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from safetensors.numpy import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "fixtures" / "flux_transformer_original" / "flux_pipeline-transformer.safetensors"
OUT = ROOT / "fixtures" / "gguf"
NAME = "flux_pipeline-transformer-mixed"
TYPES = [T.Q8_0, T.Q4_0, T.Q5_1, T.Q4_1, T.Q5_0]


def main():
    tensors = load_file(str(SRC))
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{NAME}.gguf"
    w = GGUFWriter(str(path), "flux")
    k = 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name].astype(np.float32))
        if a.ndim == 2 and a.shape[-1] % 32 == 0:
            ty = TYPES[k % len(TYPES)]
            k += 1
            q = quantize(a, ty)
            w.add_tensor(name, q, raw_dtype=ty)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        out[t.name] = np.ascontiguousarray(dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32))
    save_file(out, str(OUT / f"{NAME}.dequantized.safetensors"))
    moved = max(float(np.abs(out[n] - tensors[n]).max()) for n in out)
    print(f"[gen] {path.name}: {len(out)} tensors, {k} quantized; largest |dequantized - original| {moved:.3e}")


if __name__ == "__main__":
    main()
