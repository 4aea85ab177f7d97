"""Diffusers' side of `cargo xtask bench --peer diffusers --full` (runs on the GPU machine,
never by CI): Diffusers 0.42.1 on the full FLUX.1-dev transformer and on the whole FLUX.1-dev
pipeline, random bf16 weights made on the GPU, 1024x1024 (4096 image + 512 text tokens).

Usage:
  python3 tools/peer_pipeline.py step OUT.json [--seconds S] [--tiny]
  python3 tools/peer_pipeline.py pipeline OUT.json [--seconds S] [--no-block] [--tiny]

step: one transformer step (19 double + 38 single blocks, 3072 wide, as gpu_peer.flux_transformer),
  inputs held on the GPU, median of 5 timed forwards after 2 warm-ups (CUDA events), for
  `resident`, `leaf_stream` (enable_group_offload(leaf_level, use_stream=True): Diffusers' best
  zero-budget setting) and `block_stream` (block_level, num_blocks_per_group=1, use_stream=True),
  the last only when --seconds leaves time for it; and `resident_compiled` (issue 39): the
  resident model through torch.compile in its default mode, the first call's time (the
  compile) reported apart as compile_seconds, when --seconds leaves 200 s for it. --cases
  picks the cases. Also the pinned host->device bandwidth
  (1 GiB, best of 5).

pipeline: diffusers.FluxPipeline built from random weights at FLUX.1-dev's configs (transformer
  as above; text_encoder CLIP-L; text_encoder_2 T5-XXL v1.1; the Flux AutoencoderKL;
  FlowMatchEulerDiscreteScheduler with FLUX.1-dev's config), 28 steps, guidance 3.5,
  max_sequence_length 512, under a 12 GiB device budget with Diffusers' fastest offload that fits:
    prompt_encoding  CLIP-L and T5-XXL (9.5 GB: it fits alone) moved to the GPU, encoded by
                     FluxPipeline.encode_prompt (the text encoders run; the token ids come from a
                     stand-in tokenizer, since no tokenizer files are offline), moved back: model
                     offload by hand (enable_model_cpu_offload refuses a pipeline with group offload)
    denoise          the transformer under enable_group_offload(leaf_level, use_stream=True), set
                     up at the phase's start (setup_seconds: the call, which pins the weights), then
                     pipe(prompt_embeds=..., pooled_prompt_embeds=..., output_type="latent")
    decode           the VAE moved to the GPU; unpack, unscale, vae.decode
  then, unless --no-block or --seconds leaves no time, `denoise_block_level`: the same loop with
  the transformer under block_level, num_blocks_per_group=1, use_stream=True.

Per case / phase: seconds, setup_seconds, device peak (torch.cuda.max_memory_allocated, reset at
the start), host RSS peak (VmRSS sampled every 20 ms), pinned host bytes (torch's host allocator),
and the process's peak RSS (getrusage). OUT.json is rewritten after every case and phase, so a run
stopped by `timeout` keeps what it measured.

--tiny: tiny configs on the CPU, 64x64, 2 steps, without streams (they need CUDA): runs every path
of this script in seconds with a CPU build of torch, for checking it without a GPU.
"""

import time

STARTED = time.time()  # before torch's import, which takes seconds: --seconds counts from here

import argparse  # noqa: E402
import gc  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import zlib  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402

from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_peer import bandwidth, pinned_now, rss  # noqa: E402
from gpu_peer import flux_transformer, flux_vae  # noqa: E402

GIB = 1 << 30
PROMPT = "a lighthouse on a rocky coast at dawn"  # ddo run's default prompt
VRAM_BUDGET = 12 * GIB

# FLUX.1-dev's scheduler/scheduler_config.json.
FLUX_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096,
                      max_shift=1.15, num_train_timesteps=1000, shift=3.0,
                      use_dynamic_shifting=True)

# FLUX.1-dev's text_encoder/config.json (CLIP-L) and text_encoder_2/config.json (T5-XXL v1.1).
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
              num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu",
              layer_norm_eps=1e-5, projection_dim=768, bos_token_id=0, eos_token_id=2,
              pad_token_id=1)
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
              num_decoder_layers=24, num_heads=64, relative_attention_num_buckets=32,
              relative_attention_max_distance=128, dropout_rate=0.1, layer_norm_epsilon=1e-6,
              initializer_factor=1.0, feed_forward_proj="gated-gelu", is_encoder_decoder=True,
              pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
              tie_word_embeddings=False)

TINY_CLIP = dict(CLIP_L, vocab_size=1000, hidden_size=32, intermediate_size=64,
                 num_hidden_layers=2, num_attention_heads=2, projection_dim=32)
TINY_T5 = dict(T5_XXL, vocab_size=1000, d_model=32, d_kv=8, d_ff=64, num_layers=2,
               num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=8,
               relative_attention_max_distance=16)
TINY_TRANSFORMER = dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                        pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
TINY_VAE = dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
                up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[8, 16, 16, 16],
                layers_per_block=1, latent_channels=4, norm_num_groups=4, sample_size=64,
                scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                use_post_quant_conv=False)


class Env:
    """Where it runs: the GPU (CUDA events, streams, device peaks) or, with --tiny, the CPU."""

    def __init__(self, tiny, seconds):
        self.tiny = tiny
        self.cuda = not tiny
        if self.cuda and not torch.cuda.is_available():
            sys.exit("peer_pipeline.py: no CUDA device (use --tiny to check the script on a CPU)")
        self.dev = torch.device("cuda" if self.cuda else "cpu")
        self.deadline = STARTED + seconds if seconds else float("inf")
        self.height = self.width = 64 if tiny else 1024
        self.steps = 2 if tiny else 28
        self.max_sequence_length = 32 if tiny else 512
        self.warmup, self.runs = (1, 2) if tiny else (2, 5)

    def left(self):
        return self.deadline - time.time()

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def fresh_peak(self):
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            reset = getattr(torch.cuda.memory, "reset_peak_host_memory_stats", None)
            if reset is not None:
                try:
                    reset()
                except Exception:  # noqa: BLE001 - older torch: the peak covers the process
                    pass

    def device_peak(self):
        return torch.cuda.max_memory_allocated() if self.cuda else None

    def group_offload(self, model, offload_type):
        """enable_group_offload as this run uses it; returns (seconds it took, its options)."""
        opts = dict(offload_type=offload_type, use_stream=self.cuda)
        if offload_type == "block_level":
            opts["num_blocks_per_group"] = 1
        t = time.perf_counter()
        model.enable_group_offload(onload_device=self.dev, offload_device=torch.device("cpu"),
                                   **opts)
        return time.perf_counter() - t, opts


class RssPeak:
    """The process's VmRSS sampled every `interval` seconds on a thread; `peak()` is the most
    seen since the last `reset()`."""

    def __init__(self, interval=0.02):
        self._lock = threading.Lock()
        self._peak = 0
        self._interval = interval
        threading.Thread(target=self._run, daemon=True).start()

    @staticmethod
    def now():
        return rss().get("VmRSS", 0)

    def _run(self):
        while True:
            v = self.now()
            with self._lock:
                self._peak = max(self._peak, v)
            time.sleep(self._interval)

    def reset(self):
        with self._lock:
            self._peak = self.now()

    def peak(self):
        v = self.now()
        with self._lock:
            self._peak = max(self._peak, v)
            return self._peak


def pinned(model):
    """Pinned host bytes now (torch's host allocator, else the hooks' pinned copies) and the
    host allocator's peak since the last reset, where torch reports it."""
    now, source = pinned_now(model)
    peak = None
    try:
        peak = int(torch.cuda.memory.host_memory_stats().get("allocated_bytes.peak"))
    except Exception:  # noqa: BLE001 - no CUDA, or an older torch
        pass
    return {"pinned_host_bytes": now, "pinned_host_peak_bytes": peak, "pinned_source": source}


def host_peak_rss():
    """The process's peak RSS so far (getrusage: KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def weight_bytes(model):
    return sum(t.numel() * t.element_size()
               for t in itertools.chain(model.parameters(), model.buffers()))


def dump(path, doc):
    doc["process_peak_rss_bytes"] = host_peak_rss()
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
    os.replace(tmp, path)


def versions(env):
    import diffusers
    doc = {"side": "diffusers", "tiny": env.tiny, "torch": torch.__version__,
           "diffusers": diffusers.__version__,
           "gpu": torch.cuda.get_device_name(0) if env.cuda else "cpu (--tiny)"}
    try:
        import transformers
        doc["transformers"] = transformers.__version__
    except ImportError:
        pass
    return doc


def build(env, make, seed):
    """`make()` built on the run's device (random init there is fast), cast to bf16, moved to
    the host: the weights' home, as a checkpoint loaded with from_pretrained would be."""
    torch.manual_seed(seed)
    t = time.perf_counter()
    with torch.device(env.dev):
        model = make()
    model = model.to(torch.bfloat16).eval().requires_grad_(False)
    if env.cuda:
        model = model.to("cpu")
        torch.cuda.empty_cache()
    return model, time.perf_counter() - t


def make_transformer(env):
    if env.tiny:
        return FluxTransformer2DModel(**TINY_TRANSFORMER)
    return flux_transformer(19, 38)


def remove_group_offload(model):
    """Undoes enable_group_offload: its hooks removed, every weight back in pageable host memory
    (group offload with streams leaves them in its pinned copies), the freed pinned blocks handed
    back to the driver, so the next setup pins afresh, as on a fresh model."""
    from diffusers.hooks import HookRegistry
    from diffusers.hooks.group_offloading import (
        _GROUP_OFFLOADING,
        _LAYER_EXECUTION_TRACKER,
        _LAZY_PREFETCH_GROUP_OFFLOADING,
    )

    registry = HookRegistry.check_if_exists_or_initialize(model)
    for name in (_GROUP_OFFLOADING, _LAYER_EXECUTION_TRACKER, _LAZY_PREFETCH_GROUP_OFFLOADING):
        registry.remove_hook(name, recurse=True)
    gc.collect()
    moved = 0
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t.device.type != "cpu" or t.is_pinned():
            copy = torch.empty(t.shape, dtype=t.dtype, device="cpu")
            copy.copy_(t.data)
            t.data = copy
            moved += t.numel() * t.element_size()
            if moved >= 4 * GIB:
                release_pinned_cache()
                moved = 0
    release_pinned_cache()


def release_pinned_cache():
    """Hands torch's cached, unused pinned blocks back to the driver (and idle device memory)."""
    gc.collect()
    if torch.cuda.is_available():
        empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
        if empty_host_cache is not None:
            empty_host_cache()
        torch.cuda.empty_cache()


def timed(env, fn):
    """Median/min/max ms of env.runs calls of fn after env.warmup (CUDA events on the GPU)."""
    for _ in range(env.warmup):
        fn()
    env.sync()
    ms = []
    for _ in range(env.runs):
        if env.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            ms.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            ms.append((time.perf_counter() - t) * 1e3)
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "ms": ms}


def step_inputs(env, config):
    """The transformer's inputs at the run's size, made once on the device (seeded)."""
    dt = torch.bfloat16
    dev = env.dev
    g = torch.Generator(device=dev).manual_seed(1)
    side = env.height // 16
    ids = torch.zeros(side, side, 3, device=dev)
    ids[..., 1] += torch.arange(side, device=dev)[:, None]
    ids[..., 2] += torch.arange(side, device=dev)[None, :]
    text = env.max_sequence_length
    return dict(
        hidden_states=torch.randn(1, side * side, config.in_channels, device=dev, generator=g,
                                  dtype=dt),
        encoder_hidden_states=torch.randn(1, text, config.joint_attention_dim, device=dev,
                                          generator=g, dtype=dt),
        pooled_projections=torch.randn(1, config.pooled_projection_dim, device=dev, generator=g,
                                       dtype=dt),
        timestep=torch.tensor([0.5], device=dev, dtype=dt),
        guidance=torch.tensor([3.5], device=dev, dtype=dt),
        img_ids=ids.reshape(-1, 3),
        txt_ids=torch.zeros(text, 3, device=dev),
        return_dict=False,
    )


def step(args, env):
    doc = versions(env)
    doc.update(mode="step", height=env.height, width=env.width,
               text_tokens=env.max_sequence_length, warmup=env.warmup, runs=env.runs,
               results={})
    sampler = RssPeak()
    if env.cuda:
        doc["pinned_h2d_bytes_per_sec"] = bandwidth()
        print(f"pinned host->device: {doc['pinned_h2d_bytes_per_sec'] / 1e9:.1f} GB/s", flush=True)
        release_pinned_cache()  # the measurement's 1 GiB would count as pinned in every case
    model, doc["build_seconds"] = build(env, lambda: make_transformer(env), 0)
    doc["weight_bytes"] = weight_bytes(model)
    dump(args.out, doc)
    with torch.no_grad():
        inputs = step_inputs(env, model.config)
        forward = lambda: model(**inputs)  # noqa: E731
        cases = [("resident", None), ("leaf_stream", "leaf_level"), ("block_stream", "block_level")]
        wanted = set(args.cases.split(","))
        for name, offload_type in cases:
            if name not in wanted and not (name == "resident" and "resident_compiled" in wanted):
                continue
            last = doc["results"].get("leaf_stream", {})
            need = 1.3 * last.get("wall_seconds", 0) + 15
            if name == "block_stream" and env.left() < need:
                doc["results"][name] = {"skipped": f"{env.left():.0f} s left, about {need:.0f} s needed"}
                dump(args.out, doc)
                continue
            env.fresh_peak()
            sampler.reset()
            t = time.perf_counter()
            if offload_type is None:
                model.to(env.dev)
                r = timed(env, forward)
                r["setup_seconds"] = 0.0
                r["offload"] = "none (resident)"
            else:
                setup, opts = env.group_offload(model, offload_type)
                r = timed(env, forward)
                r["setup_seconds"] = setup
                r["offload"] = "enable_group_offload " + " ".join(f"{k}={v}" for k, v in opts.items())
            r["wall_seconds"] = time.perf_counter() - t
            r["peak_bytes"] = env.device_peak()
            r["host_rss_peak_bytes"] = sampler.peak()
            r.update(pinned(model))
            doc["results"][name] = r
            dump(args.out, doc)
            print(name, json.dumps({k: v for k, v in r.items() if k != "ms"}), flush=True)
            if offload_type is None:
                if "resident_compiled" in wanted:
                    compiled_case(args, env, doc, model, inputs, sampler)
                model.to("cpu")
            else:
                remove_group_offload(model)
    dump(args.out, doc)


# Compiling FLUX.1-dev's transformer took 122.8 s on one H200 (issue 39); with the timed runs.
COMPILE_SECONDS_NEEDED = 200


def compiled_case(args, env, doc, model, inputs, sampler):
    """`resident_compiled`: the resident transformer through torch.compile (default mode), in
    the same job as the other cases. The first call compiles: its time is reported apart
    (compile_seconds, including that call's run), then the step is timed as the others."""
    if env.left() < COMPILE_SECONDS_NEEDED:
        doc["results"]["resident_compiled"] = {
            "skipped": f"{env.left():.0f} s left, about {COMPILE_SECONDS_NEEDED} s needed"}
        dump(args.out, doc)
        return
    env.fresh_peak()
    sampler.reset()
    t = time.perf_counter()
    compiled = torch.compile(model)
    try:
        compiled(**inputs)
        env.sync()
        compile_seconds = time.perf_counter() - t
        r = timed(env, lambda: compiled(**inputs))
    except Exception as e:  # noqa: BLE001 - a compile failure is a result, not a crash
        doc["results"]["resident_compiled"] = {"error": f"{type(e).__name__}: {e}"}
        dump(args.out, doc)
        return
    r["compile_seconds"] = compile_seconds
    r["setup_seconds"] = 0.0
    r["offload"] = "none (resident), torch.compile(mode='default')"
    r["wall_seconds"] = time.perf_counter() - t
    r["peak_bytes"] = env.device_peak()
    r["host_rss_peak_bytes"] = sampler.peak()
    doc["results"]["resident_compiled"] = r
    dump(args.out, doc)
    print("resident_compiled", json.dumps({k: v for k, v in r.items() if k != "ms"}), flush=True)
    del compiled
    torch._dynamo.reset()


class StandInTokenizer:
    """Token ids without tokenizer files (none are offline): lower-cased words hashed (crc32)
    into the vocabulary, laid out as the real tokenizer lays them out — CLIP: bos, words, eos,
    padded with eos to 77; T5: words, eos (1), padded with 0 — so the text encoders run on
    sequences of the real shapes. Implements the part of the tokenizer interface FluxPipeline's
    _get_clip_prompt_embeds / _get_t5_prompt_embeds use."""

    added_tokens_encoder = {}

    def __init__(self, vocab, max_length, eos, pad, bos=None, first=0, last=None):
        self.model_max_length = max_length
        self.eos, self.pad, self.bos = eos, pad, bos
        self.first, self.last = first, last if last is not None else vocab

    @classmethod
    def clip(cls, vocab):
        return cls(vocab, 77, eos=vocab - 1, pad=vocab - 1, bos=vocab - 2, last=vocab - 2)

    @classmethod
    def t5(cls, vocab, max_length):
        return cls(vocab, max_length, eos=1, pad=0, first=3)

    def tokenize(self, text):
        return text.lower().split()

    def _ids(self, text):
        span = self.last - self.first
        return [self.first + zlib.crc32(w.encode()) % span for w in self.tokenize(text)]

    def __call__(self, prompt, padding="max_length", max_length=None, truncation=False,
                 return_tensors="pt", **_):
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        limit = max_length or self.model_max_length
        rows = []
        for p in prompts:
            ids = ([self.bos] if self.bos is not None else []) + self._ids(p)
            if truncation:
                ids = ids[:limit - 1]
            rows.append(ids + [self.eos])
        width = limit if padding == "max_length" else max(len(r) for r in rows)
        rows = [r + [self.pad] * (width - len(r)) for r in rows]
        return SimpleNamespace(input_ids=torch.tensor(rows, dtype=torch.long))

    def batch_decode(self, ids):
        return [" ".join(str(i) for i in row) for row in ids.tolist()]


def build_pipeline(env, doc):
    from diffusers import FluxPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    clip_cfg = CLIPTextConfig(**(TINY_CLIP if env.tiny else CLIP_L))
    t5_cfg = T5Config(**(TINY_T5 if env.tiny else T5_XXL))
    makers = {
        "transformer": lambda: make_transformer(env),
        "text_encoder_2": lambda: T5EncoderModel(t5_cfg),
        "text_encoder": lambda: CLIPTextModel(clip_cfg),
        "vae": lambda: AutoencoderKL(**TINY_VAE) if env.tiny else flux_vae(),
    }
    models = {}
    for seed, (name, make) in enumerate(makers.items()):
        models[name], doc["build_seconds"][name] = build(env, make, seed)
        doc["weight_bytes"][name] = weight_bytes(models[name])
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER),
        vae=models["vae"],
        text_encoder=models["text_encoder"],
        tokenizer=StandInTokenizer.clip(clip_cfg.vocab_size),
        text_encoder_2=models["text_encoder_2"],
        tokenizer_2=StandInTokenizer.t5(t5_cfg.vocab_size, env.max_sequence_length),
        transformer=models["transformer"],
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipeline(args, env):
    doc = versions(env)
    doc.update(mode="pipeline", height=env.height, width=env.width, steps=env.steps,
               guidance=3.5, max_sequence_length=env.max_sequence_length, dtype="bf16",
               vram_budget_bytes=VRAM_BUDGET, prompt=PROMPT, build_seconds={}, weight_bytes={},
               phases=[])
    sampler = RssPeak()
    started = time.perf_counter()
    pipe = build_pipeline(env, doc)
    doc["host_rss_after_build_bytes"] = RssPeak.now()
    dump(args.out, doc)

    def phase(name, components, offload, body):
        env.fresh_peak()
        sampler.reset()
        t = time.perf_counter()
        with torch.no_grad():
            extra = body()
        env.sync()
        p = {"phase": name, "components": components, "offload": offload,
             "seconds": time.perf_counter() - t, "setup_seconds": 0.0,
             "peak_bytes": env.device_peak(), "host_rss_peak_bytes": sampler.peak()}
        p.update(extra)
        p.update(pinned(pipe.transformer))
        p["fits_budget"] = p["peak_bytes"] is None or p["peak_bytes"] <= VRAM_BUDGET
        doc["phases"].append(p)
        dump(args.out, doc)
        print(name, json.dumps({k: v for k, v in p.items() if k != "step_seconds"}), flush=True)
        return p

    embeds = {}

    def encode():
        t = time.perf_counter()
        pipe.text_encoder.to(env.dev)
        pipe.text_encoder_2.to(env.dev)
        env.sync()
        moved_in = time.perf_counter() - t
        t = time.perf_counter()
        pe, ppe, _ = pipe.encode_prompt(prompt=PROMPT, prompt_2=None, device=env.dev,
                                        max_sequence_length=env.max_sequence_length)
        env.sync()
        forward = time.perf_counter() - t
        t = time.perf_counter()
        pipe.text_encoder.to("cpu")
        pipe.text_encoder_2.to("cpu")
        env.sync()
        embeds.update(prompt_embeds=pe, pooled_prompt_embeds=ppe)
        return {"move_in_seconds": moved_in, "forward_seconds": forward,
                "move_out_seconds": time.perf_counter() - t,
                "prompt_embeds_shape": list(pe.shape)}

    phase("prompt_encoding", ["text_encoder", "text_encoder_2"],
          "model offload: moved to the GPU for the phase and back", encode)

    latents = {}

    def denoise(offload_type):
        def body():
            setup, opts = env.group_offload(pipe.transformer, offload_type)
            marks = []

            def on_step(_pipe, _i, _t, kwargs):
                env.sync()
                marks.append(time.perf_counter())
                return kwargs

            t = time.perf_counter()
            out = pipe(prompt_embeds=embeds["prompt_embeds"],
                       pooled_prompt_embeds=embeds["pooled_prompt_embeds"],
                       height=env.height, width=env.width, num_inference_steps=env.steps,
                       guidance_scale=3.5, max_sequence_length=env.max_sequence_length,
                       generator=torch.Generator(device=env.dev).manual_seed(0),
                       output_type="latent", return_dict=False, callback_on_step_end=on_step)[0]
            env.sync()
            loop = time.perf_counter() - t
            latents["packed"] = out
            steps = [b - a for a, b in zip([t] + marks[:-1], marks)]
            return {"setup_seconds": setup, "loop_seconds": loop, "step_seconds": steps,
                    "median_step_seconds": statistics.median(steps[1:] or steps),
                    "offload_options": opts}
        return body

    leaf = phase("denoise", ["transformer"],
                 "enable_group_offload leaf_level, use_stream", denoise("leaf_level"))

    def decode():
        vae = pipe.vae
        t = time.perf_counter()
        vae.to(env.dev)
        env.sync()
        moved_in = time.perf_counter() - t
        lat = pipe._unpack_latents(latents["packed"], env.height, env.width, pipe.vae_scale_factor)
        lat = lat / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(lat, return_dict=False)[0]
        env.sync()
        vae.to("cpu")
        return {"move_in_seconds": moved_in, "image_shape": list(image.shape)}

    phase("decode", ["vae"], "model offload: moved to the GPU for the phase and back", decode)

    need = 1.3 * leaf["seconds"] + 15
    if args.no_block:
        doc["denoise_block_level"] = {"skipped": "--no-block"}
    elif env.left() < need:
        doc["denoise_block_level"] = {"skipped": f"{env.left():.0f} s left, about {need:.0f} s needed"}
    else:
        remove_group_offload(pipe.transformer)
        phase("denoise_block_level", ["transformer"],
              "enable_group_offload block_level, num_blocks_per_group=1, use_stream",
              denoise("block_level"))
    doc["total_seconds"] = time.perf_counter() - started
    dump(args.out, doc)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["step", "pipeline"])
    ap.add_argument("out", help="the JSON to write (rewritten as the run goes)")
    ap.add_argument("--seconds", type=float,
                    default=float(os.environ.get("DDO_PART_SECONDS") or 0),
                    help="time this process may take, counted from its start (default: "
                         "$DDO_PART_SECONDS, which run-bench-full.sh sets to the part's timeout); "
                         "optional cases are skipped when they would not fit")
    ap.add_argument("--cases", default="resident,resident_compiled,leaf_stream,block_stream",
                    help="step: the cases to run, comma-separated (resident_compiled: "
                         "torch.compile in its default mode, resident; it runs resident too)")
    ap.add_argument("--no-block", action="store_true",
                    help="pipeline: no second denoise with block-level group offload")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny configs on the CPU, 64x64, 2 steps (checks the script)")
    args = ap.parse_args()
    env = Env(args.tiny, args.seconds)
    (step if args.mode == "step" else pipeline)(args, env)


if __name__ == "__main__":
    main()
