#!/usr/bin/env python3
"""A tiny Flux transformer as a GGUF file in the original (BFL) layout, as city96's FLUX.1 GGUFs
hold it (issue 37): the committed `fixtures/flux_transformer_original/flux_pipeline-transformer.safetensors`
with every 2-D tensor whose rows are whole 32-element blocks quantized by gguf-py (`gguf.quants.quantize`),
the types taken in turn from Q8_0, Q4_0, Q5_1, Q4_1, Q5_0, and every other tensor kept F32;
`general.architecture` "flux".

Writes `fixtures/gguf/` (and the T5 encoder's, the Qwen-Image transformer's and its text encoder's
files, see `t5`, `qwen` and `qwen_text` below; `... gen_gguf_flux.py qwen_text` writes one set):

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


def write_quantized(tensors, path: Path, arch: str, types, rename=lambda n: n):
    """Writes `tensors` (sorted names, renamed by `rename`) to the GGUF file `path`: each 2-D
    tensor of whole 32-element rows quantized to `types` in turn, the rest F32. Returns gguf-py's
    dequantization of every tensor as read back, under its original name, and how many were
    quantized."""
    w = GGUFWriter(str(path), arch)
    k = 0
    back = {}
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name].astype(np.float32))
        g = rename(name)
        back[g] = name
        if a.ndim == 2 and a.shape[-1] % 32 == 0:
            ty = types[k % len(types)]
            k += 1
            w.add_tensor(g, quantize(a, ty), raw_dtype=ty)
        else:
            w.add_tensor(g, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = {}
    for t in GGUFReader(str(path)).tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        out[back[t.name]] = np.ascontiguousarray(dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32))
    return out, k


def main():
    tensors = load_file(str(SRC))
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{NAME}.gguf"
    out, k = write_quantized(tensors, path, "flux", TYPES)
    save_file(out, str(OUT / f"{NAME}.dequantized.safetensors"))
    moved = max(float(np.abs(out[n] - tensors[n]).max()) for n in out)
    print(f"[gen] {path.name}: {len(out)} tensors, {k} quantized; largest |dequantized - original| {moved:.3e}")


# Transformers' T5 names → llama.cpp's (gguf-py's tensor_mapping for T5ENCODER).
T5_NAMES = {
    "0.SelfAttention.q": "attn_q",
    "0.SelfAttention.k": "attn_k",
    "0.SelfAttention.v": "attn_v",
    "0.SelfAttention.o": "attn_o",
    "0.SelfAttention.relative_attention_bias": "attn_rel_b",
    "0.layer_norm": "attn_norm",
    "1.layer_norm": "ffn_norm",
    "1.DenseReluDense.wi_0": "ffn_gate",
    "1.DenseReluDense.wi_1": "ffn_up",
    "1.DenseReluDense.wo": "ffn_down",
}


def t5_gguf_name(name: str) -> str:
    if name == "shared.weight":
        return "token_embd.weight"
    if name == "encoder.final_layer_norm.weight":
        return "enc.output_norm.weight"
    rest = name.removeprefix("encoder.block.")
    block, _, tail = rest.partition(".layer.")
    return f"enc.blk.{block}.{T5_NAMES[tail.removesuffix('.weight')]}.weight"


def t5():
    """The fixture pipeline's T5 encoder (`text_encoder_2`) in llama.cpp's names, as city96's T5
    GGUFs hold it: `flux_pipeline-t5-mixed.gguf` (architecture t5encoder; 2-D tensors of whole
    32-element rows quantized in turn to Q8_0, Q5_1, Q4_0; the rest F32) and its
    `.dequantized.safetensors` in Transformers' names (gguf-py's dequantization)."""
    src = ROOT / "fixtures" / "flux_pipeline" / "text_encoder_2" / "model.safetensors"
    path = OUT / "flux_pipeline-t5-mixed.gguf"
    out, k = write_quantized(load_file(str(src)), path, "t5encoder", [T.Q8_0, T.Q5_1, T.Q4_0], t5_gguf_name)
    save_file(out, str(OUT / "flux_pipeline-t5-mixed.dequantized.safetensors"))
    print(f"[gen] {path.name}: {len(out)} tensors, {k} quantized")


def qwen():
    """The Qwen-Image fixture pipeline's transformer (`fixtures/qwen_pipeline/transformer`) as a
    GGUF file in Diffusers' names, as QuantStack's and city96's Qwen-Image GGUFs hold it:
    `qwen_pipeline-transformer-mixed.gguf` (architecture qwen_image; 2-D tensors of whole
    32-element rows quantized in turn to Q8_0, Q5_0, Q4_1; the rest F32) and its
    `.dequantized.safetensors` (gguf-py's dequantization, float32)."""
    src = ROOT / "fixtures" / "qwen_pipeline" / "transformer" / "diffusion_pytorch_model.safetensors"
    path = OUT / "qwen_pipeline-transformer-mixed.gguf"
    out, k = write_quantized(load_file(str(src)), path, "qwen_image", [T.Q8_0, T.Q5_0, T.Q4_1])
    save_file(out, str(OUT / "qwen_pipeline-transformer-mixed.dequantized.safetensors"))
    print(f"[gen] {path.name}: {len(out)} tensors, {k} quantized")


# Transformers' Qwen2.5-VL language-model names → llama.cpp's (gguf-py's tensor_mapping for
# QWEN2VL; its converter writes q and k as they are, with no permutation).
QWEN_TEXT_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def qwen_text_gguf_name(name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    layer, _, tail = name.removeprefix("model.layers.").partition(".")
    module, _, kind = tail.rpartition(".")
    return f"blk.{layer}.{QWEN_TEXT_NAMES[module]}.{kind}"


def qwen_text():
    """The Qwen-Image fixture's text encoder (`fixtures/qwen_text_encoder/text_encoder`, the
    language model of Qwen2_5_VLForConditionalGeneration) in llama.cpp's names, as the
    Qwen2.5-VL GGUFs ComfyUI users load hold it (architecture qwen2vl; no vision tower, which
    those keep in a separate mmproj file; `lm_head` as `output.weight`):
    `qwen_text_encoder-mixed.gguf` (2-D tensors of whole 32-element rows quantized in turn to
    Q8_0, Q5_0, Q4_1; the rest F32) and its `.dequantized.safetensors` in Transformers' names
    (gguf-py's dequantization, float32)."""
    src = ROOT / "fixtures" / "qwen_text_encoder" / "text_encoder" / "model.safetensors"
    tensors = {n: t for n, t in load_file(str(src)).items() if not n.startswith("visual.")}
    path = OUT / "qwen_text_encoder-mixed.gguf"
    out, k = write_quantized(tensors, path, "qwen2vl", [T.Q8_0, T.Q5_0, T.Q4_1], qwen_text_gguf_name)
    save_file(out, str(OUT / "qwen_text_encoder-mixed.dequantized.safetensors"))
    print(f"[gen] {path.name}: {len(out)} tensors, {k} quantized")


if __name__ == "__main__":
    import sys

    # One file set by name (`qwen_text`), else all of them.
    only = sys.argv[1:]
    for step in (main, t5, qwen, qwen_text):
        if not only or step.__name__ in only:
            step()
