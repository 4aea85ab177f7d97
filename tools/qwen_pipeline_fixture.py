"""The `qwen_pipeline` fixture of `tools/gen_fixtures.py`: a 3-step `QwenImagePipeline` run with true CFG.

A tiny Diffusers `QwenImagePipeline` made of the `qwen_image_transformer` and `qwen_vae` fixtures' models (loaded
with `from_pretrained` from their folders, so those fixtures must exist first) and Qwen-Image's scheduler config,
saved with the pipeline's own `save_pretrained` (no text encoder or tokenizer: the prompts come as embeddings), and
the references of one call with GIVEN prompt embeddings and masks (positive and negative), GIVEN packed initial
noise, `true_cfg_scale=4.0`, 3 steps, `output_type="latent"`, then the decode branch of `__call__` on the final
latents (`_unpack_latents`, the latents' mean/std, `vae.decode(latents)[0][:, :, 0]`), and of the same call at
`true_cfg_scale=1.0` (no true CFG: one transformer pass per step).

Run through `gen_fixtures.py --only qwen_pipeline` (and `--verify --only qwen_pipeline`); the helpers of
`gen_fixtures.py` it needs come in as `h`.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors.torch import load_file

from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline

NAME = "qwen_pipeline"
SEED = 1009

# The `Qwen/Qwen-Image` repository's scheduler/scheduler_config.json (what `QwenImagePipeline.from_pretrained`
# loads there; DDO's `FlowMatchEulerConfig::qwen_image`).
QWEN_SCHEDULER = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    invert_sigmas=False,
    max_image_seq_len=8192,
    max_shift=0.9,
    num_train_timesteps=1000,
    shift=1.0,
    shift_terminal=0.02,
    stochastic_sampling=False,
    time_shift_type="exponential",
    use_beta_sigmas=False,
    use_dynamic_shifting=True,
    use_exponential_sigmas=False,
    use_karras_sigmas=False,
)

HEIGHT, WIDTH = 32, 48
STEPS = 3
TRUE_CFG_SCALE = 4.0
PROMPT_LEN, PROMPT_REAL = 7, 5  # the prompt: 7 tokens, the last 2 padding (mask 0, states zero)
NEGATIVE_LEN = 5  # the negative prompt: 5 real tokens (its all-ones mask is dropped by encode_prompt)


def build_pipeline(h) -> QwenImagePipeline:
    fixtures = h.FIXTURES
    transformer = h.load_saved_model("qwen_image_transformer", fixtures / "qwen_image_transformer")
    vae = h.load_saved_model("qwen_vae", fixtures / "qwen_vae")
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_SCHEDULER)
    pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def make_inputs(pipe) -> "OrderedDict[str, torch.Tensor]":
    gen = torch.Generator().manual_seed(SEED + 100)
    d = pipe.transformer.config.joint_attention_dim
    prompt = torch.randn(1, PROMPT_LEN, d, generator=gen)
    prompt[:, PROMPT_REAL:] = 0.0  # encode_prompt zero-pads
    mask = torch.zeros(1, PROMPT_LEN, dtype=torch.int64)
    mask[:, :PROMPT_REAL] = 1
    negative = torch.randn(1, NEGATIVE_LEN, d, generator=gen)
    negative_mask = torch.ones(1, NEGATIVE_LEN, dtype=torch.int64)
    f = pipe.vae_scale_factor
    tokens = (HEIGHT // (2 * f)) * (WIDTH // (2 * f))
    latents = torch.randn(1, tokens, pipe.transformer.config.in_channels, generator=gen)
    return OrderedDict(
        prompt_embeds=prompt,
        prompt_embeds_mask=mask,
        negative_prompt_embeds=negative,
        negative_prompt_embeds_mask=negative_mask,
        latents=latents,
    )


def decode(pipe, latents: torch.Tensor) -> torch.Tensor:
    """The `output_type != "latent"` branch of `QwenImagePipeline.__call__`, before the image processor."""
    latents = pipe._unpack_latents(latents, HEIGHT, WIDTH, pipe.vae_scale_factor)
    latents = latents.to(pipe.vae.dtype)
    z = pipe.vae.config.z_dim
    latents_mean = torch.tensor(pipe.vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
    latents_std = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, z, 1, 1, 1).to(
        latents.device, latents.dtype
    )
    latents = latents / latents_std + latents_mean
    return pipe.vae.decode(latents, return_dict=False)[0][:, :, 0]


def run(pipe, ins) -> tuple["OrderedDict[str, torch.Tensor]", dict]:
    calls = []
    hook = pipe.transformer.register_forward_hook(lambda *_: calls.append(1))
    outs = OrderedDict()
    steps = OrderedDict()

    def on_step(p, i, t, kw):
        steps[f"latents_step{i}"] = kw["latents"].clone()
        return {}

    try:
        with torch.no_grad():
            for label, scale in [("", TRUE_CFG_SCALE), ("_no_cfg", 1.0)]:
                calls.clear()
                latents = pipe(
                    prompt_embeds=ins["prompt_embeds"],
                    prompt_embeds_mask=ins["prompt_embeds_mask"],
                    negative_prompt_embeds=ins["negative_prompt_embeds"],
                    negative_prompt_embeds_mask=ins["negative_prompt_embeds_mask"],
                    true_cfg_scale=scale,
                    num_inference_steps=STEPS,
                    height=HEIGHT,
                    width=WIDTH,
                    latents=ins["latents"].clone(),
                    output_type="latent",
                    return_dict=False,
                    callback_on_step_end=on_step if label == "" else None,
                )[0]
                outs[f"latents{label}"] = latents.contiguous()
                outs[f"image{label}"] = decode(pipe, latents).contiguous()
                outs[f"transformer_calls{label}"] = torch.tensor([float(len(calls))])
                if label == "":
                    outs["timesteps"] = pipe.scheduler.timesteps.to(torch.float32).clone()
                    outs["sigmas"] = pipe.scheduler.sigmas.to(torch.float32).clone()
    finally:
        hook.remove()
    for k, v in steps.items():
        outs[k] = v.contiguous()
    return outs, dict(calls=int(outs["transformer_calls"].item()), calls_no_cfg=int(outs["transformer_calls_no_cfg"].item()))


def f32_inputs(ins):
    return OrderedDict((k, v.to(torch.float32).contiguous()) for k, v in ins.items())


def generate(h, d: Path) -> dict:
    pipe = build_pipeline(h)
    pipe.save_pretrained(str(d), safe_serialization=True)
    ins = make_inputs(pipe)
    outs, extra = run(pipe, ins)
    outs2, _ = run(pipe, ins)
    for k in outs:
        assert torch.equal(outs[k], outs2[k]), f"{NAME}: {k} differs between two runs"
    assert extra["calls"] == 2 * STEPS and extra["calls_no_cfg"] == STEPS, extra
    h.save_tensors(d / "inputs.safetensors", f32_inputs(ins))
    h.save_tensors(d / "outputs.safetensors", outs)
    print(f"[gen] {NAME}: " + ", ".join(f"{k}{list(v.shape)}" for k, v in outs.items()))
    return dict(extra=extra)


def verify(h, d: Path) -> bool:
    pipe = build_pipeline(h)
    ins = make_inputs(pipe)
    outs, _ = run(pipe, ins)
    ok = True
    for file, mine in [("inputs", f32_inputs(ins)), ("outputs", outs)]:
        ref = load_file(str(d / f"{file}.safetensors"))
        same = set(ref) == set(mine) and all(torch.equal(mine[k], ref[k]) for k in ref)
        ok &= same
        print(f"[verify] {NAME} {file} ({len(ref)} tensors): {'bit-exact' if same else 'MISMATCH'}")
    # The saved components are the source fixtures' weights.
    for comp, src in [("transformer", "qwen_image_transformer"), ("vae", "qwen_vae")]:
        a = load_file(str(d / comp / "diffusion_pytorch_model.safetensors"))
        b = load_file(str(h.FIXTURES / src / "diffusion_pytorch_model.safetensors"))
        same = set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
        ok &= same
        print(f"[verify] {NAME} {comp}/ weights vs {src}: {'bit-exact' if same else 'MISMATCH'}")
    return ok


DOC = """\
Diffusers' `QwenImagePipeline` (diffusers 0.42.1 `pipeline_qwenimage.py`) at tiny widths, run for {steps} steps with
true CFG from GIVEN prompt embeddings and noise.

* The folder is the pipeline's own `save_pretrained` folder (`model_index.json` `_class_name` `QwenImagePipeline`,
  `text_encoder` and `tokenizer` null): `transformer/` is the `qwen_image_transformer` fixture's model, `vae/` the
  `qwen_vae` fixture's (both loaded with `from_pretrained` from those folders, parameters copied into fresh storage;
  the saved weights are bit-identical to theirs, `--verify` checks it), `scheduler/scheduler_config.json`
  Qwen-Image's scheduler (`Qwen/Qwen-Image`'s file: dynamic shifting between `base_shift` 0.5 at 256 tokens and
  `max_shift` 0.9 at 8192, `shift_terminal` 0.02): `{scheduler}`.
* The call: `pipe(prompt_embeds=, prompt_embeds_mask=, negative_prompt_embeds=, negative_prompt_embeds_mask=,
  true_cfg_scale={scale}, num_inference_steps={steps}, height={height}, width={width}, latents=, output_type="latent",
  return_dict=False)[0]` → `latents` (packed, `[1, tokens, 16]`); then the decode branch of `__call__` on them
  (`_unpack_latents`, `.to(vae.dtype)`, `latents / (1 / latents_std) + latents_mean`, `vae.decode(latents)[0][:, :,
  0]`, before the image processor: values in [-1, 1]) → `image`. `vae_scale_factor` = `2 ** len(temperal_downsample)`
  = 4, so the latent grid is 8 x 12 and 24 packed tokens; `img_shapes = [[(1, 4, 6)]]`.
* Inputs (`torch.Generator().manual_seed({gen_seed})`, in this order): `prompt_embeds` `[1, {plen}, 32]` randn with
  its last {pad} rows zeroed (as `encode_prompt` zero-pads) and `prompt_embeds_mask` `[1, {plen}]` ones then {pad}
  zeros (the transformer's `encoder_hidden_states_mask`); `negative_prompt_embeds` `[1, {nlen}, 32]` randn with an
  all-ones mask (which `encode_prompt` drops: no mask in the negative pass); `latents` `[1, 24, 16]` randn (the
  packed initial noise, used as given). Masks are stored as float32 0/1 (int64 in the call).
* Per step: `timestep = t / 1000` (no guidance), the positive pass, the negative pass, `comb_pred = neg + {scale} *
  (pos - neg)`, `noise_pred = comb_pred * (norm(pos, dim=-1) / norm(comb_pred, dim=-1))`, the Euler step. The
  transformer ran {calls} times (a forward hook counted them).
* `latents_no_cfg`, `image_no_cfg`: the same call at `true_cfg_scale=1.0` (negative prompt given, but
  `do_true_cfg = true_cfg_scale > 1 and has_neg_prompt` is false): {calls_no_cfg} transformer calls.
* `timesteps`, `sigmas`: `pipe.scheduler.timesteps` / `.sigmas` after the call (`sigmas = np.linspace(1, 1/{steps},
  {steps})`, `mu = calculate_shift(24, 256, 8192, 0.5, 0.9)`, stretched to the terminal); `latents_step<i>`: the
  latents after step `i` of the CFG run (`callback_on_step_end`); `transformer_calls*`: the counts above.
"""


def manifest_section(h, d: Path, result: dict) -> str:
    extra = result.get("extra", {})
    parts = [f"## `{NAME}`\n"]
    parts.append(
        f"No weights made here (the `qwen_image_transformer` and `qwen_vae` fixtures' are reused); inputs from "
        f"`torch.Generator().manual_seed({SEED + 100})`.\n"
    )
    parts.append(
        DOC.format(
            steps=STEPS,
            scale=TRUE_CFG_SCALE,
            height=HEIGHT,
            width=WIDTH,
            scheduler=json.dumps(QWEN_SCHEDULER),
            gen_seed=SEED + 100,
            plen=PROMPT_LEN,
            pad=PROMPT_LEN - PROMPT_REAL,
            nlen=NEGATIVE_LEN,
            calls=extra.get("calls", 2 * STEPS),
            calls_no_cfg=extra.get("calls_no_cfg", STEPS),
        )
    )
    index = json.loads((d / "model_index.json").read_text())
    parts.append("**model_index.json** (as written by save_pretrained):\n\n```json\n" + json.dumps(index, indent=2) + "\n```\n")
    parts.append("**Inputs** (`inputs.safetensors`):\n\n" + h.table(h.st_listing(d / "inputs.safetensors")) + "\n")
    parts.append("**Outputs** (`outputs.safetensors`):\n\n" + h.table(h.st_listing(d / "outputs.safetensors")) + "\n")
    files = sorted(p for p in d.rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    parts.append(
        "**Files:** "
        + ", ".join(f"`{p.relative_to(d)}` ({h.human(p.stat().st_size)})" for p in files)
        + f"; {h.human(total)} in all.\n"
    )
    return "\n".join(parts)
