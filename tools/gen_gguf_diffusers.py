#!/usr/bin/env python3
"""Diffusers' own GGUF dequantization (issue 37's conformance reference): every tensor of the committed
GGUF fixtures (`fixtures/gguf/types.gguf`, `flux_pipeline-transformer-mixed.gguf`,
`flux_pipeline-t5-mixed.gguf`) read by `diffusers.models.model_loading_utils.load_gguf_checkpoint` and
dequantized by `diffusers.quantizers.gguf.utils.dequantize_gguf_tensor` (the torch code Diffusers' GGUF
models run), as float32 under the tensor's GGUF name and row-major shape.

Diffusers' `from_single_file` cannot load the tiny original-layout transformer itself: its converter
splits `linear1` at FLUX.1's widths (3072 x 3 + 12288). So the reference is Diffusers' dequantization,
which DDO's is checked against tensor by tensor (`crates/ddo-core/tests/gguf.rs`); the loader's name
mapping is checked against gguf-py's dequantization by `crates/ddo-cli/tests/gguf.rs`.

Writes `fixtures/gguf/diffusers_dequantized.safetensors` (`<file stem>/<tensor name>` keys) and prints
the types Diffusers refuses.

Needs torch, diffusers 0.42.1 and gguf (the GPU machine has torch; carry the wheels):

  python3 tools/gen_gguf_diffusers.py [--out fixtures/gguf]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors.torch import save_file

from diffusers.models.model_loading_utils import load_gguf_checkpoint
from diffusers.quantizers.gguf.utils import dequantize_gguf_tensor

ROOT = Path(__file__).resolve().parent.parent
FILES = ["types.gguf", "flux_pipeline-transformer-mixed.gguf", "flux_pipeline-t5-mixed.gguf"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "fixtures" / "gguf"))
    args = ap.parse_args()
    out = {}
    for f in FILES:
        path = ROOT / "fixtures" / "gguf" / f
        try:
            sd = load_gguf_checkpoint(str(path))
        except Exception as e:  # noqa: BLE001  (a type Diffusers refuses: said, and the next file)
            print(f"[gen] {f}: refused by Diffusers: {str(e).splitlines()[0]}")
            # Tensor by tensor, the types Diffusers reads.
            from gguf import GGUFReader
            from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES, GGUFParameter
            import gguf as g

            sd = {}
            for t in GGUFReader(str(path)).tensors:
                plain = t.tensor_type in (g.GGMLQuantizationType.F32, g.GGMLQuantizationType.F16)
                if not plain and t.tensor_type not in SUPPORTED_GGUF_QUANT_TYPES:
                    print(f"[gen]   {t.name}: {t.tensor_type.name} not supported by Diffusers")
                    continue
                w = torch.from_numpy(t.data.copy())
                sd[t.name] = w if plain else GGUFParameter(w, quant_type=t.tensor_type)
        stem = f.removesuffix(".gguf")
        for name, t in sd.items():
            q = getattr(t, "quant_type", None)
            v = dequantize_gguf_tensor(t)
            v = v.as_tensor() if hasattr(v, "as_tensor") else v
            out[f"{stem}/{name}"] = v.detach().to(torch.float32).contiguous()
            print(f"[gen] {stem}/{name}: {q.name if q is not None else t.dtype} -> {list(v.shape)} {v.dtype}")
    dest = Path(args.out)
    dest.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dest / "diffusers_dequantized.safetensors"))


if __name__ == "__main__":
    main()
