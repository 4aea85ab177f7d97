"""Issue 39's accuracy anchor for `ddo run --compute fp8` (never run by CI: it needs torch
2.11, diffusers 0.42.1 and torchao 0.18.0). On the GPU machine (`--device cuda`, an fp8
GPU) or on the host (`--device cpu`: torch 2.11 runs `torch._scaled_mm` on the CPU, and
TorchAO's check for an fp8 GPU, which only guards its choice of kernels, is skipped; said in
the JSON).

The fixture Flux pipeline (fixtures/flux_pipeline: tiny, f32 files) from its saved inputs
(prompt embeddings and initial latents), 4 steps at 32x24, guidance 3.5, as the fixture was
made; and the fixture Qwen-Image pipeline (fixtures/qwen_pipeline) from its saved inputs, 3
steps at 32x48, true CFG 4, against its final packed latents and image (cases `qwen_*`). Against the fixture's own f32 result (Diffusers 0.42.1 in f32: the decoder's input,
intermediates.safetensors' `latents_unscaled`, which `ddo run --save-latents` writes, and the
decoded image, outputs.safetensors' `image`), the relative L2 of the latents and of the image
of:

  diffusers_bf16     Diffusers, the transformer in bf16 on the GPU
  diffusers_torchao  the same with TorchAO's float8 dynamic-activation quantization
                     (Float8DynamicActivationFloat8WeightConfig, per tensor) on the linears
                     DDO's --compute fp8 takes: every nn.Linear whose name matches none of
                     Diffusers' layerwise-casting skip patterns for Flux (pos_embed,
                     patch_embed, norm, ^proj_in$, ^proj_out$)
  ddo_bf16           `ddo run --dtype bf16` (on --device's device)
  ddo_fp8            `ddo run --compute fp8 --device cuda:0` (cuBLASLt's E4M3 GEMM where the
                     device has fp8 tensor cores; with --device cuda only)
  ddo_fp8_host       `ddo run --compute fp8` on the host backend (the reference implementation)

and DDO's fp8 over TorchAO's (issue 39's target: <= 1.2 for latents and image). The VAE
decodes in f32 in every case (only the transformer's precision differs).

Usage: python3 tools/fp8_anchor.py OUT.json --ddo PATH/TO/ddo [--device cuda|cpu]
                                  [--pipelines flux,qwen] [--fixture fixtures/flux_pipeline]
                                  [--qwen-fixture fixtures/qwen_pipeline]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file

from diffusers import (
    AutoencoderKL,
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)

# As the fixtures were made (tools/gen_fixtures.py: PIPE_CALL; tools/qwen_pipeline_fixture.py).
CALL = dict(height=32, width=24, num_inference_steps=4, guidance_scale=3.5)
QWEN_CALL = dict(height=32, width=48, num_inference_steps=3, true_cfg_scale=4.0)
# Diffusers' DEFAULT_SKIP_MODULES_PATTERN with FluxTransformer2DModel's own (ddo_nn::fp8).
SKIP = ["pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$"]


def rel_l2(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float((a - b).norm() / b.norm())


def skipped(name):
    return any(re.search(p, name) for p in SKIP)


def transformer_of(cls, fixture, quantize, dev):
    """The fixture's transformer in bf16 on `dev`, quantized by TorchAO first when `quantize`
    (on the linears --compute fp8 takes); the names it quantized."""
    transformer = cls.from_pretrained(fixture, subfolder="transformer",
                                      torch_dtype=torch.bfloat16).to(dev)
    quantized = []
    if quantize:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerTensor, quantize_
        if dev.type == "cpu":
            import torchao.quantization.quant_api as quant_api
            quant_api._check_hardware_support = lambda *a, **k: None

        def take(module, name):
            ok = isinstance(module, torch.nn.Linear) and not skipped(name)
            if ok:
                quantized.append(name)
            return ok

        quantize_(transformer, Float8DynamicActivationFloat8WeightConfig(granularity=PerTensor()),
                  filter_fn=take)
    return transformer, quantized


def diffusers_flux(fixture, ins, quantize, dev):
    """Diffusers' Flux decoder input (the latents unpacked and unscaled) and decoded image (f32,
    on the CPU), the transformer in bf16 (TorchAO's fp8 when `quantize`)."""
    transformer, quantized = transformer_of(FluxTransformer2DModel, fixture, quantize, dev)
    vae = AutoencoderKL.from_pretrained(fixture, subfolder="vae", torch_dtype=torch.float32).to(dev)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(fixture, subfolder="scheduler")
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=None, transformer=transformer)
    with torch.no_grad():
        latents = pipe(
            prompt_embeds=ins["prompt_embeds"].to(dev, torch.bfloat16),
            pooled_prompt_embeds=ins["pooled_prompt_embeds"].to(dev, torch.bfloat16),
            latents=ins["latents"].to(dev, torch.bfloat16),
            output_type="latent", return_dict=False, **CALL,
        )[0].float()
        unpacked = FluxPipeline._unpack_latents(latents, CALL["height"], CALL["width"],
                                                pipe.vae_scale_factor)
        unscaled = unpacked / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(unscaled, return_dict=False)[0]
    return unscaled.cpu(), image.float().cpu(), quantized


def diffusers_qwen(fixture, ins, quantize, dev):
    """Diffusers' Qwen-Image final latents (packed) and decoded image (f32, on the CPU), true
    CFG at 4, the transformer in bf16 (TorchAO's fp8 when `quantize`); the decode as
    QwenImagePipeline's (tools/qwen_pipeline_fixture.py's `decode`)."""
    transformer, quantized = transformer_of(QwenImageTransformer2DModel, fixture, quantize, dev)
    vae = AutoencoderKLQwenImage.from_pretrained(fixture, subfolder="vae",
                                                 torch_dtype=torch.float32).to(dev)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(fixture, subfolder="scheduler")
    pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None,
                             transformer=transformer)
    bf = lambda k: ins[k].to(dev, torch.bfloat16)  # noqa: E731
    with torch.no_grad():
        latents = pipe(
            prompt_embeds=bf("prompt_embeds"), prompt_embeds_mask=ins["prompt_embeds_mask"].to(dev),
            negative_prompt_embeds=bf("negative_prompt_embeds"),
            negative_prompt_embeds_mask=ins["negative_prompt_embeds_mask"].to(dev),
            latents=bf("latents"), output_type="latent", return_dict=False, **QWEN_CALL,
        )[0].float()
        z = vae.config.z_dim
        x = pipe._unpack_latents(latents, QWEN_CALL["height"], QWEN_CALL["width"],
                                 pipe.vae_scale_factor)
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(dev)
        std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(dev)
        image = vae.decode(x / std + mean, return_dict=False)[0][:, :, 0]
    return latents.cpu(), image.float().cpu(), quantized


def ddo_run(ddo, fixture, call_args, qwen, extra, work):
    """`ddo run` on the fixture's inputs with `call_args` and `extra`; its latents (Flux: the
    decoder input `--save-latents` writes; Qwen-Image: the final packed latents `--out`
    holds) and decoded image."""
    inputs = os.path.join(fixture, "inputs.safetensors")
    out = os.path.join(work, "out.safetensors")
    latents = os.path.join(work, "latents.safetensors")
    for f in (out, latents):
        if os.path.exists(f):
            os.remove(f)
    cmd = [ddo, "run", "--weights", fixture, "--prompt-embeds", inputs, "--init-latents", inputs,
           "--out", out, "--no-env"] + ([] if qwen else ["--save-latents", latents]) \
        + call_args + extra
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        return None, None, (p.stderr or p.stdout).strip()[-2000:]
    note = "\n".join(line for line in p.stdout.splitlines() if "--compute" in line)
    saved = load_file(out) if qwen else load_file(latents)
    return saved["latents"], load_file(out)["sample"], note


def anchor(args, dev, qwen, doc):
    """One fixture pipeline's cases into `doc`."""
    fixture = args.qwen_fixture if qwen else args.fixture
    ins = load_file(os.path.join(fixture, "inputs.safetensors"))
    outputs = load_file(os.path.join(fixture, "outputs.safetensors"))
    if qwen:
        ref = {"image": outputs["image"], "latents": outputs["latents"]}
        call = ["--height", str(QWEN_CALL["height"]), "--width", str(QWEN_CALL["width"]),
                "--steps", str(QWEN_CALL["num_inference_steps"]),
                "--true-cfg-scale", str(QWEN_CALL["true_cfg_scale"])]
    else:
        ref = {"image": outputs["image"],
               "latents": load_file(os.path.join(fixture, "intermediates.safetensors"))[
                   "latents_unscaled"]}
        call = ["--height", str(CALL["height"]), "--width", str(CALL["width"]),
                "--steps", str(CALL["num_inference_steps"]),
                "--guidance", str(CALL["guidance_scale"])]
    cases = doc.setdefault("cases", {})
    prefix = "qwen_" if qwen else ""

    def record(name, latents, image, extra=None):
        case = {"latents_rel_l2": rel_l2(latents, ref["latents"]),
                "image_rel_l2": rel_l2(image, ref["image"])}
        case.update(extra or {})
        cases[prefix + name] = case
        print(prefix + name, json.dumps(case), flush=True)

    runner = diffusers_qwen if qwen else diffusers_flux
    for name, quantize in (("diffusers_bf16", False), ("diffusers_torchao", True)):
        try:
            latents, image, quantized = runner(fixture, ins, quantize, dev)
            record(name, latents, image, {"quantized_linears": len(quantized)} if quantize else None)
        except Exception as e:  # noqa: BLE001 - a failing case is a result
            cases[prefix + name] = {"error": f"{type(e).__name__}: {e}"}
            print(prefix + name, "error:", e, flush=True)
    with tempfile.TemporaryDirectory() as work:
        on = ["--device", "cuda:0"] if dev.type == "cuda" else []
        runs = [("ddo_bf16", ["--dtype", "bf16"] + on)]
        if dev.type == "cuda":
            runs.append(("ddo_fp8", ["--compute", "fp8"] + on))
        runs.append(("ddo_fp8_host", ["--compute", "fp8"]))
        for name, extra in runs:
            latents, image, note = ddo_run(args.ddo, fixture, call, qwen, extra, work)
            if latents is None:
                cases[prefix + name] = {"error": note}
                print(prefix + name, "error:", note, flush=True)
            else:
                record(name, latents, image, {"note": note} if note else None)
    for ours in ("ddo_fp8", "ddo_fp8_host"):
        a, b = cases.get(prefix + ours, {}), cases.get(prefix + "diffusers_torchao", {})
        if "latents_rel_l2" in a and "latents_rel_l2" in b:
            key = f"{prefix}{ours}_over_torchao"
            doc[key] = {k: a[k] / b[k] for k in ("latents_rel_l2", "image_rel_l2")}
            print(f"{key}:", json.dumps(doc[key]), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the JSON to write")
    ap.add_argument("--ddo", required=True, help="the ddo binary")
    ap.add_argument("--fixture", default="fixtures/flux_pipeline")
    ap.add_argument("--qwen-fixture", default="fixtures/qwen_pipeline")
    ap.add_argument("--pipelines", default="flux,qwen", help="flux, qwen or both (default)")
    ap.add_argument("--device", choices=["cuda", "cpu"],
                    default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("fp8_anchor.py: no CUDA device (use --device cpu)")
    doc = {"torch": torch.__version__, "call": CALL, "qwen_call": QWEN_CALL, "cases": {}}
    if dev.type == "cuda":
        doc["device"] = torch.cuda.get_device_name(0)
        doc["capability"] = list(torch.cuda.get_device_capability(0))
    else:
        doc["device"] = "cpu"
        doc["torchao_hardware_check"] = "skipped: torch._scaled_mm runs on the CPU"
    try:
        import torchao
        doc["torchao"] = torchao.__version__
    except ImportError as e:
        doc["torchao"] = f"not importable: {e}"
    wanted = set(args.pipelines.split(","))
    for qwen in (False, True):
        if ("qwen" if qwen else "flux") in wanted:
            anchor(args, dev, qwen, doc)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
