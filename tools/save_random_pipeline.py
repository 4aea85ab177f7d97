"""Writes a Diffusers FluxPipeline folder with random bf16 weights at the real FLUX.1-dev
configs (transformer, CLIP-L, T5-XXL, VAE, scheduler; no tokenizers), each component saved
with `save_pretrained(..., safe_serialization=True)` as from_pretrained reads it, for the
"from a folder on disk" measurement of `ddo run --weights DIR`. Builds the weights on the
GPU (fast), as tools/peer_pipeline.py does. Runs on the GPU machine, never in CI.

With --qwen: a QwenImagePipeline folder at Qwen-Image's real configs instead (transformer
40.9 GB, Qwen2.5-VL text encoder 16.6 GB, VAE, scheduler, and a tokenizer/ made in code:
`ddo run` refuses a Qwen folder with text_encoder/ but no tokenizer/), built as tools/peer_qwen.py
builds it, one component in memory at a time.

Usage: python3 tools/save_random_pipeline.py DIR [--tiny] [--qwen]
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_pipeline as pp  # noqa: E402


# Words the tokenizer below makes single tokens (byte-level, a leading space as `Ġ`): every word of
# QwenImagePipeline's prompt template, so its system part is 34 tokens as with Qwen's real
# vocabulary (prompt_template_encode_start_idx), and the words of ddo run's default prompt.
QWEN_WORDS = [
    "system", "user", "assistant", "Describe", " the", " image", " by", " detailing", " color",
    " shape", " size", " texture", " quantity", " text", " spatial", " relationships", " of",
    " objects", " and", " background", " a", " lighthouse", " on", " rocky", " coast", " at",
    " dawn", " cat",
]
# Qwen2's first 14 special tokens, in order from the first special id (peer_qwen.SPECIAL's offsets).
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
                "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
                "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
                "<|image_pad|>", "<|video_pad|>"]


def write_qwen_tokenizer(d, regular):
    """A Qwen2 tokenizer folder (vocab.json, merges.txt, tokenizer_config.json), laid out as
    Qwen's: `regular` BPE ids (the 256 byte symbols, then the merges that make each of QWEN_WORDS
    one token, unreachable fillers up to `regular`), then the special tokens from id `regular` on, as
    peer_qwen.text_encoder_config numbers them (built as tools/qwen_text_fixture.py builds its)."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    vocab = {chars[b]: b for b in range(256)}
    merges = {}  # pair -> rank

    def bpe(parts):  # BPE on one pre-token: the lowest-ranked pair merged first
        parts = list(parts)
        while len(parts) > 1:
            rank, i = min((merges.get(pair, len(merges)), i)
                          for i, pair in enumerate(zip(parts, parts[1:])))
            if rank == len(merges):
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return parts

    for word in QWEN_WORDS:  # each word one token: a merge of the first two pieces left, in turn
        parts = bpe(chars[b] for b in word.encode())
        while len(parts) > 1:
            merges[(parts[0], parts[1])] = len(merges)
            vocab.setdefault(parts[0] + parts[1], len(vocab))
            parts = bpe(parts)
    assert len(vocab) <= regular, f"{len(vocab)} BPE tokens do not fit {regular} regular ids"
    for i in range(len(vocab), regular):
        vocab[f"<|filler_{i}|>"] = i
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(d, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    added = {str(regular + i): dict(content=t, lstrip=False, normalized=False, rstrip=False,
                                    single_word=False, special=True)
             for i, t in enumerate(QWEN_SPECIAL)}
    config = dict(add_prefix_space=False, added_tokens_decoder=added,
                  additional_special_tokens=QWEN_SPECIAL[1:], bos_token=None,
                  clean_up_tokenization_spaces=False, eos_token="<|im_end|>", errors="replace",
                  model_max_length=131072, pad_token="<|endoftext|>", split_special_tokens=False,
                  tokenizer_class="Qwen2Tokenizer", unk_token=None)
    with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)


def bf16_default(make):
    """`make` with bf16 as torch's default dtype: the model is made in bf16 where it is built,
    not in fp32 and then cast (the transformer would take 81.7 GB of fp32 on the GPU first)."""
    import torch

    def made():
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            return make()
        finally:
            torch.set_default_dtype(previous)
    return made


def save_qwen(out, tiny):
    """The QwenImagePipeline folder (see the module docs); returns the doc to print."""
    import peer_qwen as pq  # imports torch and diffusers: only for --qwen
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import Qwen2_5_VLForConditionalGeneration

    env = pq.QwenEnv(tiny, 0)
    regular = pq.TINY_REGULAR_TOKENS if tiny else pq.QWEN_REGULAR_TOKENS
    te_cfg = pq.text_encoder_config(env, regular)
    doc = {"build_seconds": {}, "weight_bytes": {}, "save_seconds": {}}
    makers = [
        ("transformer", lambda: pq.make_transformer(env)),
        ("text_encoder", lambda: Qwen2_5_VLForConditionalGeneration(te_cfg)),
        ("vae", lambda: pq.make_vae(env)),
    ]
    for seed, (name, make) in enumerate(makers):
        model, doc["build_seconds"][name] = pq.build(env, bf16_default(make), seed)
        doc["weight_bytes"][name] = pq.weight_bytes(model)
        t = time.perf_counter()
        model.save_pretrained(os.path.join(out, name), safe_serialization=True, max_shard_size="10GB")
        doc["save_seconds"][name] = time.perf_counter() - t
        del model
    FlowMatchEulerDiscreteScheduler(**pq.QWEN_SCHEDULER).save_pretrained(os.path.join(out, "scheduler"))
    write_qwen_tokenizer(os.path.join(out, "tokenizer"), regular)
    with open(os.path.join(out, "model_index.json"), "w") as f:
        json.dump({"_class_name": "QwenImagePipeline", "_diffusers_version": "0.42.1"}, f)
    os.sync()
    return doc


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    tiny = "--tiny" in sys.argv[2:]
    if "--qwen" in sys.argv[2:]:
        doc = save_qwen(out, tiny)
        size = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(out) for n in ns)
        print(json.dumps({"dir": out, "bytes": size, **doc}))
        return
    env = pp.Env(tiny, 0)
    doc = {"build_seconds": {}, "weight_bytes": {}}
    t = time.perf_counter()
    pipe = pp.build_pipeline(env, doc)
    built = time.perf_counter() - t
    t = time.perf_counter()
    for name in ("transformer", "text_encoder", "text_encoder_2", "vae"):
        getattr(pipe, name).save_pretrained(os.path.join(out, name), safe_serialization=True,
                                            max_shard_size="10GB")
    pipe.scheduler.save_pretrained(os.path.join(out, "scheduler"))
    with open(os.path.join(out, "model_index.json"), "w") as f:
        json.dump({"_class_name": "FluxPipeline", "_diffusers_version": "0.42.1"}, f)
    os.sync()
    saved = time.perf_counter() - t
    size = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(out) for n in ns)
    print(json.dumps({"dir": out, "bytes": size, "build_seconds": built, "save_seconds": saved,
                      "weight_bytes": doc["weight_bytes"]}))


if __name__ == "__main__":
    main()
