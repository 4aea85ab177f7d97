"""Diffusers' side of the Qwen-Image peer benchmark (issue 19; runs on the GPU machine, never by
CI): Diffusers 0.42.1 on the full Qwen-Image transformer and on the whole QwenImagePipeline,
random bf16 weights made on the GPU, 1024x1024 (4096 image tokens), true CFG.

Usage:
  python3 tools/peer_qwen.py step OUT.json [--seconds S] [--mask ones|none] [--tiny]
  python3 tools/peer_qwen.py pipeline OUT.json [--seconds S] [--steps N] [--text-offload model|leaf]
                                               [--no-block] [--tiny]

The models (configs written here; no hub downloads, no checkpoint files):
  transformer   QwenImageTransformer2DModel at Qwen/Qwen-Image's transformer/config.json, which are
                Diffusers 0.42.1's class defaults (transformer_qwenimage.py, __init__): patch_size 2,
                in_channels 64, out_channels 16, num_layers 60, attention_head_dim 128,
                num_attention_heads 24 (3072 wide), joint_attention_dim 3584 (Qwen2.5-VL-7B's
                hidden size), guidance_embeds False, axes_dims_rope (16, 56, 56); zero_cond_t,
                use_additional_t_cond, use_layer3d_rope False (the edit / layered variants' flags).
                20.43B parameters: 40,860,802,176 bytes in bf16 (679.7 MB a block).
  text_encoder  transformers' Qwen2_5_VLForConditionalGeneration at Qwen2.5-VL-7B-Instruct's
                config.json (Qwen-Image's text_encoder/config.json): text hidden 3584, 28 layers,
                28 heads, 4 kv heads, intermediate 18944, vocab 152064, rope theta 1e6, rms eps
                1e-6, mrope_section [16, 24, 24], untied lm_head; the vision tower too (depth 32,
                1280 wide, 16 heads, intermediate 3420, patch 14, out 3584, window 112, full
                attention in blocks 7/15/23/31), as the real checkpoint holds it, though a text
                prompt never runs it. In bf16: language model 14,141,238,528 bytes + lm_head
                1,089,994,752 (15.2 GB), vision tower 1,353,100,368 (1.35 GB): 16,584,333,648
                (16.6 GB = 15.4 GiB; OUT.json's text_encoder_parts_bytes). The text values are those
                of ddo-nn's qwen_text config for Qwen2.5-VL 7B (crates/ddo-nn/src/qwen_text/).
  vae           AutoencoderKLQwenImage(): Diffusers' class defaults are Qwen-Image's
                vae/config.json (base_dim 96, z_dim 16, dim_mult [1, 2, 4, 4], num_res_blocks 2,
                attn_scales [], temperal_downsample [False, True, True], dropout 0, the 16
                latents_mean / latents_std values), 8x spatial compression; 253,785,062 bytes.
  scheduler     FlowMatchEulerDiscreteScheduler with Qwen-Image's scheduler/scheduler_config.json
                (QWEN_SCHEDULER below: base_shift 0.5 and max_shift 0.9 over image sequence
                lengths 256..8192, shift 1.0, shift_terminal 0.02, time_shift_type "exponential",
                dynamic shifting), as public Qwen-Image training and inference code quotes the
                file; the ln(3) base and max shifts some snippets show are Qwen-Image-Lightning's
                distilled-model scheduler, not the base model's.
  tokenizer     a stand-in (no tokenizer files are offline), QwenStandInTokenizer below.
Random weights: each model is built on the GPU (its library's own initialisation runs there,
fast), the transformer's weight matrices (every parameter of 2 or more dimensions) are then
refilled with seeded N(0, 0.02) there (transformers already draws the text encoder's from
N(0, 0.02), its initializer_range; the VAE keeps Diffusers' initialisation), cast to bf16 and
moved to the host: the weights' home, as from_pretrained would leave them (peer_pipeline.build).

step: one transformer forward at 1024x1024: hidden_states [1, 4096, 64], img_shapes [(1, 64, 64)],
  64 text tokens (encoder_hidden_states [1, 64, 3584]; encoder_hidden_states_mask all ones, or
  None with --mask none, which is what QwenImagePipeline passes for a single prompt, since
  encode_prompt drops an all-ones mask; Diffusers 0.42.1's forward has no txt_seq_lens any more:
  it reads the text length off the mask), timestep 0.5, all held on the GPU; median of 5 timed
  forwards after 2 warm-ups (CUDA events) for `resident` (40.9 GB fits an H200), `leaf_stream`
  (enable_group_offload(leaf_level, use_stream=True)) and `block_stream` (block_level,
  num_blocks_per_group=1, use_stream=True), the last only when --seconds leaves time for it;
  `resident_compiled` (issue 39): the resident model through torch.compile, default mode, its
  first call apart as compile_seconds (peer_pipeline.compiled_case). --cases picks the cases.
  Each case starts from the weights in pageable host memory and gives its device and pinned
  memory back before the next (the host has 128 GiB; group offload pins a 40.9 GB copy). Also
  the pinned host->device bandwidth (bench_peer.bandwidth: 1 GiB, best of 5).

pipeline: diffusers.QwenImagePipeline from the models above, 1024x1024, --steps (default 4: each
  step runs the transformer twice, the prompt and the negative prompt, since true CFG is on),
  true_cfg_scale 4.0 with negative_prompt " ", max_sequence_length 512, seeded generator, under a
  16 GiB device budget with Diffusers' fastest offload that fits:
    prompt_encoding  the text encoder's language model and lm_head (15.2 GB: it fits 16 GiB; the
                     vision tower, which a text prompt never runs, stays on the host) moved to the
                     GPU, both prompts encoded by QwenImagePipeline.encode_prompt (the text encoder
                     runs on token ids from the stand-in tokenizer), moved back: model offload by
                     hand, one 15.2 GB copy for both prompts. That beats group offload, which
                     streams the weights once per prompt after pinning them (the whole text
                     encoder, 16.6 GB, would fit too, with 0.6 GB to spare, but copies 1.35 GB
                     that never runs). --text-offload leaf runs the whole text encoder under
                     apply_group_offloading(leaf_level, use_stream=True) instead, setup timed.
    denoise          the transformer under enable_group_offload(leaf_level, use_stream=True), set
                     up at the phase's start (setup_seconds: the call, which pins the weights), then
                     pipe(prompt_embeds=..., prompt_embeds_mask=..., negative_prompt_embeds=...,
                     negative_prompt_embeds_mask=..., true_cfg_scale=4.0, output_type="latent")
    decode           the VAE moved to the GPU; QwenImagePipeline's unpack, un-normalisation
                     (latents / (1 / latents_std) + latents_mean) and vae.decode of one frame
  then, unless --no-block or --seconds leaves no time, `denoise_block_level`: the same loop with
  the transformer under block_level, num_blocks_per_group=1, use_stream=True (the faster of the
  two denoise phases is Diffusers' fastest offload). Group offload is removed and its pinned
  copies freed between phases (peer_pipeline.remove_group_offload).

Per case / phase: seconds, setup_seconds, device peak (torch.cuda.max_memory_allocated, reset at
the start) and whether it fits the budget, host RSS peak (VmRSS sampled every 20 ms), pinned host
bytes (torch's host allocator); per denoise phase the seconds of each step (callback_on_step_end
timestamps); the total weight bytes of each component; and the process's peak RSS (getrusage).
OUT.json is rewritten after every case and phase, so a run stopped by `timeout` keeps what it
measured.

--tiny: tiny configs on the CPU (DDO's qwen-tiny / qwen-text-tiny fixture configs from
gen_fixtures.py and qwen_text_fixture.py), 64x64, 2 steps, without streams (they need CUDA):
runs every path of this script in seconds with a CPU build of torch, for checking it without a
GPU. The Env, the sampler, build, timing, group-offload removal and the JSON writing are
peer_pipeline.py's, imported.
"""

# peer_pipeline first: it notes the start time (peer_pipeline.STARTED, what --seconds counts from)
# before it imports torch, which takes seconds.
from peer_pipeline import (
    GIB,
    PROMPT,
    Env,
    RssPeak,
    StandInTokenizer,
    build,
    compiled_case,
    dump,
    pinned,
    release_pinned_cache,
    remove_group_offload,
    timed,
    versions,
    weight_bytes,
)

import argparse
import json
import os
import re
import statistics
import sys
import time

import torch

from bench_peer import bandwidth
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImageTransformer2DModel,
)

VRAM_BUDGET = 16 * GIB
NEGATIVE_PROMPT = " "  # QwenImagePipeline's documented negative prompt for true CFG
TRUE_CFG_SCALE = 4.0

# Qwen/Qwen-Image's scheduler/scheduler_config.json.
QWEN_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, invert_sigmas=False,
                      max_image_seq_len=8192, max_shift=0.9, num_train_timesteps=1000, shift=1.0,
                      shift_terminal=0.02, stochastic_sampling=False, time_shift_type="exponential",
                      use_beta_sigmas=False, use_dynamic_shifting=True,
                      use_exponential_sigmas=False, use_karras_sigmas=False)

# Qwen/Qwen-Image's transformer/config.json (= QwenImageTransformer2DModel's defaults, spelled out).
QWEN_TRANSFORMER = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60,
                        attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584,
                        guidance_embeds=False, axes_dims_rope=(16, 56, 56))

# Qwen2.5-VL-7B-Instruct's config.json, which Qwen-Image's text_encoder/config.json is: the text
# model and the vision tower. The token ids: 151643 regular tokens, then the special ones.
QWEN_TEXT = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                 rms_norm_eps=1e-6, max_position_embeddings=128000, hidden_act="silu",
                 rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24],
                                  "rope_theta": 1000000.0},
                 use_sliding_window=False, sliding_window=32768, max_window_layers=28,
                 attention_dropout=0.0, initializer_range=0.02)
QWEN_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                   in_channels=3, out_hidden_size=3584, patch_size=14, spatial_merge_size=2,
                   temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
                   tokens_per_second=2, hidden_act="silu")
QWEN_REGULAR_TOKENS = 151643
# The tiny text model's 416 rows (qwen_text_fixture.VOCAB_ROWS): 400 regular ids, then the special ones.
TINY_REGULAR_TOKENS = 400

# Offsets of Qwen2's special tokens from the first (<|endoftext|> = 151643 in Qwen2.5-VL).
SPECIAL = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<|vision_start|>": 9,
           "<|vision_end|>": 10, "<|vision_pad|>": 11, "<|image_pad|>": 12, "<|video_pad|>": 13}


class QwenEnv(Env):
    """peer_pipeline's Env with Qwen-Image's run: 4 steps (--steps), 64 text tokens in `step`."""

    def __init__(self, tiny, seconds, steps=None):
        if not tiny and not torch.cuda.is_available():
            sys.exit("peer_qwen.py: no CUDA device (use --tiny to check the script on a CPU)")
        super().__init__(tiny, seconds)
        self.steps = steps or (2 if tiny else 4)
        self.text_tokens = 8 if tiny else 64

    def apply_group_offload(self, module, offload_type):
        """Env.group_offload for a module that is not a Diffusers model (the text encoder)."""
        from diffusers.hooks import apply_group_offloading

        opts = dict(offload_type=offload_type, use_stream=self.cuda)
        if offload_type == "block_level":
            opts["num_blocks_per_group"] = 1
        t = time.perf_counter()
        apply_group_offloading(module, onload_device=self.dev, offload_device=torch.device("cpu"),
                               **opts)
        return time.perf_counter() - t, opts


def randomized(model, std=0.02):
    """`model` with every weight matrix (2 or more dimensions) refilled from N(0, std) where it
    lies (on the GPU in a real run: seconds for 20B parameters); 1-D parameters (norm scales,
    biases) keep their initialisation."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, std)
    return model


def make_transformer(env):
    if env.tiny:
        from gen_fixtures import QWEN_CONFIG
        return randomized(QwenImageTransformer2DModel(**QWEN_CONFIG))
    return randomized(QwenImageTransformer2DModel(**QWEN_TRANSFORMER))


def text_encoder_config(env, regular):
    from transformers import Qwen2_5_VLConfig

    if env.tiny:
        from qwen_text_fixture import TEXT_CONFIG, VISION_CONFIG
        text, vision = dict(TEXT_CONFIG), dict(VISION_CONFIG)
    else:
        text, vision = dict(QWEN_TEXT), dict(QWEN_VISION)
    ids = {k: regular + v for k, v in SPECIAL.items()}
    text.update(bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=None)
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision,
                            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                            vision_start_token_id=ids["<|vision_start|>"],
                            vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)


def make_vae(env):
    if env.tiny:
        from gen_fixtures import QWEN_VAE_CONFIG
        return AutoencoderKLQwenImage(**QWEN_VAE_CONFIG)
    return AutoencoderKLQwenImage()


def step_inputs(env, config, mask):
    """The transformer's inputs at the run's size, made once on the device (seeded), as
    QwenImagePipeline's loop passes them (the latents packed 2x2: 64 channels a token)."""
    dt = torch.bfloat16
    dev = env.dev
    g = torch.Generator(device=dev).manual_seed(1)
    side = env.height // 16  # 8x VAE compression, then 2x2 packing
    text = env.text_tokens
    return dict(
        hidden_states=torch.randn(1, side * side, config.in_channels, device=dev, generator=g,
                                  dtype=dt),
        encoder_hidden_states=torch.randn(1, text, config.joint_attention_dim, device=dev,
                                          generator=g, dtype=dt),
        encoder_hidden_states_mask=(torch.ones(1, text, dtype=torch.long, device=dev)
                                    if mask == "ones" else None),
        timestep=torch.tensor([0.5], device=dev, dtype=dt),
        img_shapes=[(1, side, side)],
        return_dict=False,
    )


def step(args, env):
    doc = versions(env)
    doc.update(mode="step", model="Qwen-Image transformer", height=env.height, width=env.width,
               image_tokens=(env.height // 16) ** 2, text_tokens=env.text_tokens,
               encoder_hidden_states_mask=args.mask, warmup=env.warmup, runs=env.runs,
               results={})
    sampler = RssPeak()
    if env.cuda:
        doc["pinned_h2d_bytes_per_sec"] = bandwidth()
        print(f"pinned host->device: {doc['pinned_h2d_bytes_per_sec'] / 1e9:.1f} GB/s", flush=True)
        release_pinned_cache()  # the measurement's 1 GiB would count as pinned in every case
    model, doc["build_seconds"] = build(env, lambda: make_transformer(env), 0)
    doc["weight_bytes"] = weight_bytes(model)
    doc["config"] = {k: v for k, v in model.config.items() if not k.startswith("_")}
    doc["host_rss_after_build_bytes"] = RssPeak.now()
    dump(args.out, doc)
    with torch.no_grad():
        inputs = step_inputs(env, model.config, args.mask)
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
                env.sync()
                r = {"move_in_seconds": time.perf_counter() - t}
                r.update(timed(env, forward))
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
                release_pinned_cache()
            else:
                remove_group_offload(model)
    dump(args.out, doc)


class QwenStandInTokenizer(StandInTokenizer):
    """Token ids without tokenizer files (none are offline), laid out as Qwen2's tokenizer lays
    them out, so the text encoder runs on sequences of the real lengths: the special tokens
    (`<|im_start|>`, `<|im_end|>`, ...) get their own ids after the regular ones (151643 on in
    Qwen2.5-VL; `<|endoftext|>` pads), and the text between them splits as the byte-level BPE
    pre-tokenizer splits it, words with their leading space, each punctuation run and each
    newline a piece, each piece hashed (crc32, StandInTokenizer._ids) into the regular ids.
    Qwen-Image's template then has the real tokenizer's 34-token system part (checked where the
    pipeline is built), the part _get_qwen_prompt_embeds drops, and its 5-token tail. Implements
    the call QwenImagePipeline._get_qwen_prompt_embeds makes: tokenizer(texts, max_length=...,
    padding=True, truncation=True, return_tensors="pt") -> input_ids, attention_mask (padded on
    the right with <|endoftext|>, mask 0 there)."""

    PIECES = re.compile(r"\n| ?[A-Za-z0-9_]+| ?[^\sA-Za-z0-9_]+| +")

    def __init__(self, regular):
        self.special = {k: regular + v for k, v in SPECIAL.items()}
        super().__init__(regular, 131072, eos=self.special["<|im_end|>"],
                         pad=self.special["<|endoftext|>"], first=0, last=regular)
        self.split_special = re.compile("(" + "|".join(re.escape(k) for k in self.special) + ")")

    def tokenize(self, text):
        return self.PIECES.findall(text)

    def encode(self, text):
        ids = []
        for part in self.split_special.split(text):
            if part in self.special:
                ids.append(self.special[part])
            elif part:
                ids.extend(self._ids(part))
        return ids

    def __call__(self, prompt, padding=False, max_length=None, truncation=False,
                 return_tensors=None, **_):
        from transformers import BatchEncoding

        single = isinstance(prompt, str)
        rows = [self.encode(p) for p in ([prompt] if single else prompt)]
        if truncation and max_length:
            rows = [r[:max_length] for r in rows]
        if padding == "max_length":
            width = max_length or self.model_max_length
        elif padding:  # True / "longest"
            width = max(len(r) for r in rows)
        else:
            width = None
        mask = [[1] * len(r) for r in rows]
        if width is not None:
            mask = [m + [0] * (width - len(r)) for m, r in zip(mask, rows)]
            rows = [r + [self.pad] * (width - len(r)) for r in rows]
        if return_tensors == "pt":
            data = {"input_ids": torch.tensor(rows, dtype=torch.long),
                    "attention_mask": torch.tensor(mask, dtype=torch.long)}
        elif single:
            data = {"input_ids": rows[0], "attention_mask": mask[0]}
        else:
            data = {"input_ids": rows, "attention_mask": mask}
        return BatchEncoding(data)


def text_encoder_parts(te):
    """Bytes of the text encoder's parts: what prompt encoding runs and the vision tower."""
    inner = te.model
    return {"language_model": weight_bytes(inner.language_model),
            "lm_head": weight_bytes(te.lm_head), "visual": weight_bytes(inner.visual)}


def build_pipeline(env, doc, out):
    from diffusers import QwenImagePipeline
    from transformers import Qwen2_5_VLForConditionalGeneration

    regular = TINY_REGULAR_TOKENS if env.tiny else QWEN_REGULAR_TOKENS
    te_cfg = text_encoder_config(env, regular)
    makers = {
        "transformer": lambda: make_transformer(env),
        "text_encoder": lambda: Qwen2_5_VLForConditionalGeneration(te_cfg),
        "vae": lambda: make_vae(env),
    }
    models = {}
    for seed, (name, make) in enumerate(makers.items()):
        models[name], doc["build_seconds"][name] = build(env, make, seed)
        doc["weight_bytes"][name] = weight_bytes(models[name])
        dump(out, doc)
    doc["text_encoder_parts_bytes"] = text_encoder_parts(models["text_encoder"])
    tokenizer = QwenStandInTokenizer(regular)
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER),
        vae=models["vae"],
        text_encoder=models["text_encoder"],
        tokenizer=tokenizer,
        transformer=models["transformer"],
    )
    pipe.set_progress_bar_config(disable=True)
    template, drop = pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx
    prefix = tokenizer(template.split("{}")[0]).input_ids
    assert len(prefix) == drop, f"the template's system part is {len(prefix)} tokens, not {drop}"
    doc["template_tokens"] = {"dropped": drop, "prompt": len(tokenizer(template.format(PROMPT)).input_ids),
                              "negative_prompt": len(tokenizer(template.format(NEGATIVE_PROMPT)).input_ids)}
    return pipe


def pipeline(args, env):
    doc = versions(env)
    doc.update(mode="pipeline", model="Qwen-Image", height=env.height, width=env.width,
               steps=env.steps, transformer_forwards=2 * env.steps, true_cfg_scale=TRUE_CFG_SCALE,
               negative_prompt=NEGATIVE_PROMPT, max_sequence_length=env.max_sequence_length,
               dtype="bf16", vram_budget_bytes=VRAM_BUDGET, prompt=PROMPT,
               scheduler=QWEN_SCHEDULER, build_seconds={}, weight_bytes={}, phases=[])
    sampler = RssPeak()
    started = time.perf_counter()
    pipe = build_pipeline(env, doc, args.out)
    doc["host_rss_after_build_bytes"] = RssPeak.now()
    dump(args.out, doc)

    def phase(name, components, offload, body, pinned_of):
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
        p.update(pinned(pinned_of))
        p["fits_budget"] = p["peak_bytes"] is None or p["peak_bytes"] <= VRAM_BUDGET
        doc["phases"].append(p)
        dump(args.out, doc)
        print(name, json.dumps({k: v for k, v in p.items() if k != "step_seconds"}), flush=True)
        return p

    embeds = {}
    te = pipe.text_encoder
    # What a text prompt runs: the language model and lm_head (the logits are made, then unused).
    ran = [te.model.language_model, te.lm_head]

    def encode():
        out = {}
        t = time.perf_counter()
        if args.text_offload == "model":
            for m in ran:
                m.to(env.dev)
        else:
            out["setup_seconds"], out["offload_options"] = env.apply_group_offload(te, "leaf_level")
        env.sync()
        out["move_in_seconds"] = time.perf_counter() - t
        t = time.perf_counter()
        for key, text in (("prompt", PROMPT), ("negative_prompt", NEGATIVE_PROMPT)):
            e, m = pipe.encode_prompt(prompt=text, device=env.dev,
                                      max_sequence_length=env.max_sequence_length)
            embeds[key + "_embeds"], embeds[key + "_embeds_mask"] = e, m
            out[key + "_embeds_shape"] = list(e.shape)
            out[key + "_embeds_mask"] = None if m is None else list(m.shape)
        env.sync()
        out["forward_seconds"] = time.perf_counter() - t
        t = time.perf_counter()
        if args.text_offload == "model":
            for m in ran:
                m.to("cpu")
        else:
            remove_group_offload(te)
        env.sync()
        out["move_out_seconds"] = time.perf_counter() - t
        return out

    if args.text_offload == "model":
        offload = ("model offload: text_encoder.model.language_model and lm_head moved to the GPU "
                   "for the phase and back (the vision tower stays on the host)")
    else:
        offload = "apply_group_offloading leaf_level, use_stream (the whole text encoder)"
    phase("prompt_encoding", ["text_encoder"], offload, encode, te)

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
                       prompt_embeds_mask=embeds["prompt_embeds_mask"],
                       negative_prompt_embeds=embeds["negative_prompt_embeds"],
                       negative_prompt_embeds_mask=embeds["negative_prompt_embeds_mask"],
                       true_cfg_scale=TRUE_CFG_SCALE, height=env.height, width=env.width,
                       num_inference_steps=env.steps, max_sequence_length=env.max_sequence_length,
                       generator=torch.Generator(device=env.dev).manual_seed(0),
                       output_type="latent", return_dict=False, callback_on_step_end=on_step)[0]
            env.sync()
            loop = time.perf_counter() - t
            latents["packed"] = out
            steps = [b - a for a, b in zip([t] + marks[:-1], marks)]
            return {"setup_seconds": setup, "loop_seconds": loop, "step_seconds": steps,
                    "median_step_seconds": statistics.median(steps[1:] or steps),
                    "offload_options": opts, "latents_shape": list(out.shape)}
        return body

    leaf = phase("denoise", ["transformer"], "enable_group_offload leaf_level, use_stream",
                 denoise("leaf_level"), pipe.transformer)

    def decode():
        vae = pipe.vae
        t = time.perf_counter()
        vae.to(env.dev)
        env.sync()
        moved_in = time.perf_counter() - t
        # QwenImagePipeline.__call__'s decode (output_type != "latent"), spelled out.
        lat = pipe._unpack_latents(latents["packed"], env.height, env.width, pipe.vae_scale_factor)
        lat = lat.to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(lat.device, lat.dtype)
        std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(lat.device, lat.dtype)
        lat = lat / std + mean
        image = vae.decode(lat, return_dict=False)[0][:, :, 0]
        env.sync()
        t = time.perf_counter()
        vae.to("cpu")
        env.sync()
        return {"move_in_seconds": moved_in, "move_out_seconds": time.perf_counter() - t,
                "image_shape": list(image.shape)}

    phase("decode", ["vae"], "model offload: moved to the GPU for the phase and back", decode,
          pipe.vae)

    need = 1.3 * leaf["seconds"] + 15
    if args.no_block:
        doc["denoise_block_level"] = {"skipped": "--no-block"}
    elif env.left() < need:
        doc["denoise_block_level"] = {"skipped": f"{env.left():.0f} s left, about {need:.0f} s needed"}
    else:
        remove_group_offload(pipe.transformer)
        phase("denoise_block_level", ["transformer"],
              "enable_group_offload block_level, num_blocks_per_group=1, use_stream",
              denoise("block_level"), pipe.transformer)
    doc["total_seconds"] = time.perf_counter() - started
    dump(args.out, doc)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["step", "pipeline"])
    ap.add_argument("out", help="the JSON to write (rewritten as the run goes)")
    ap.add_argument("--seconds", type=float,
                    default=float(os.environ.get("DDO_PART_SECONDS") or 0),
                    help="time this process may take, counted from its start (default: "
                         "$DDO_PART_SECONDS); optional cases are skipped when they would not fit")
    ap.add_argument("--steps", type=int, default=None,
                    help="pipeline: denoising steps (default 4; 2 with --tiny); each runs the "
                         "transformer twice (true CFG)")
    ap.add_argument("--mask", choices=["ones", "none"], default="ones",
                    help="step: encoder_hidden_states_mask all ones (default) or None, as the "
                         "pipeline passes it for one prompt")
    ap.add_argument("--text-offload", choices=["model", "leaf"], default="model",
                    help="pipeline: the text encoder's language model moved to the GPU (default) "
                         "or the whole text encoder under leaf-level group offload with streams")
    ap.add_argument("--no-block", action="store_true",
                    help="pipeline: no second denoise with block-level group offload")
    ap.add_argument("--cases", default="resident,resident_compiled,leaf_stream,block_stream",
                    help="step: the cases to run, comma-separated (resident_compiled: "
                         "torch.compile in its default mode, resident, as peer_pipeline.py)")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny configs on the CPU, 64x64, 2 steps (checks the script)")
    args = ap.parse_args()
    env = QwenEnv(args.tiny, args.seconds, args.steps)
    (step if args.mode == "step" else pipeline)(args, env)


if __name__ == "__main__":
    main()
