"""Writes a Diffusers FluxPipeline folder with random bf16 weights at the real FLUX.1-dev
configs (transformer, CLIP-L, T5-XXL, VAE, scheduler; no tokenizers), each component saved
with `save_pretrained(..., safe_serialization=True)` as from_pretrained reads it, for the
"from a folder on disk" measurement of `ddo run --weights DIR`. Builds the weights on the
GPU (fast), as tools/peer_pipeline.py does. Runs on the GPU machine, never in CI.

With --qwen: a QwenImagePipeline folder at Qwen-Image's real configs instead (transformer
40.9 GB, Qwen2.5-VL text encoder 16.6 GB, VAE, scheduler; no tokenizer: `ddo run` uses its
stand-in), built as tools/peer_qwen.py builds it, one component in memory at a time.

Usage: python3 tools/save_random_pipeline.py DIR [--tiny] [--qwen]
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_pipeline as pp  # noqa: E402


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
        model, doc["build_seconds"][name] = pq.build(env, make, seed)
        doc["weight_bytes"][name] = pq.weight_bytes(model)
        t = time.perf_counter()
        model.save_pretrained(os.path.join(out, name), safe_serialization=True, max_shard_size="10GB")
        doc["save_seconds"][name] = time.perf_counter() - t
        del model
    FlowMatchEulerDiscreteScheduler(**pq.QWEN_SCHEDULER).save_pretrained(os.path.join(out, "scheduler"))
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
