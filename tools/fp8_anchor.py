"""Issue 39's accuracy anchor for `ddo run --compute fp8` (never run by CI: it needs torch
2.11, diffusers 0.42.1 and torchao 0.18.0). On the GPU machine (`--device cuda`, an fp8
GPU) or on the host (`--device cpu`: torch 2.11 runs `torch._scaled_mm` on the CPU, and
TorchAO's check for an fp8 GPU, which only guards its choice of kernels, is skipped; said in
the JSON).

The fixture Flux pipeline (fixtures/flux_pipeline: tiny, f32 files) from its saved inputs
(prompt embeddings and initial latents), 4 steps at 32x24, guidance 3.5, as the fixture was
made. Against the fixture's own f32 result (Diffusers 0.42.1 in f32: the decoder's input,
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
                                  [--fixture fixtures/flux_pipeline]
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

from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

# As the fixture was made (tools/gen_fixtures.py: PIPE_CALL).
CALL = dict(height=32, width=24, num_inference_steps=4, guidance_scale=3.5)
# Diffusers' DEFAULT_SKIP_MODULES_PATTERN with FluxTransformer2DModel's own (ddo_nn::fp8).
SKIP = ["pos_embed", "patch_embed", "norm", "^proj_in$", "^proj_out$"]


def rel_l2(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float((a - b).norm() / b.norm())


def skipped(name):
    return any(re.search(p, name) for p in SKIP)


def diffusers_run(fixture, ins, quantize, dev):
    """Diffusers' decoder input (the latents unpacked and unscaled) and decoded image (f32, on
    the CPU) with the transformer in bf16 on `dev`, quantized by TorchAO first when
    `quantize`."""
    transformer = FluxTransformer2DModel.from_pretrained(
        fixture, subfolder="transformer", torch_dtype=torch.bfloat16).to(dev)
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


def ddo_run(ddo, fixture, extra, work):
    """`ddo run` on the fixture's inputs with `extra`; its latents and decoded image."""
    inputs = os.path.join(fixture, "inputs.safetensors")
    out = os.path.join(work, "out.safetensors")
    latents = os.path.join(work, "latents.safetensors")
    for f in (out, latents):
        if os.path.exists(f):
            os.remove(f)
    cmd = [ddo, "run", "--weights", fixture, "--prompt-embeds", inputs, "--init-latents", inputs,
           "--height", str(CALL["height"]), "--width", str(CALL["width"]),
           "--steps", str(CALL["num_inference_steps"]), "--guidance", str(CALL["guidance_scale"]),
           "--out", out, "--save-latents", latents, "--no-env"] + extra
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        return None, None, (p.stderr or p.stdout).strip()[-2000:]
    note = "\n".join(line for line in p.stdout.splitlines() if "--compute" in line)
    return load_file(latents)["latents"], load_file(out)["sample"], note


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the JSON to write")
    ap.add_argument("--ddo", required=True, help="the ddo binary")
    ap.add_argument("--fixture", default="fixtures/flux_pipeline")
    ap.add_argument("--device", choices=["cuda", "cpu"],
                    default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("fp8_anchor.py: no CUDA device (use --device cpu)")
    ins = load_file(os.path.join(args.fixture, "inputs.safetensors"))
    ref = {"image": load_file(os.path.join(args.fixture, "outputs.safetensors"))["image"],
           "latents": load_file(os.path.join(args.fixture, "intermediates.safetensors"))[
               "latents_unscaled"]}
    doc = {"torch": torch.__version__, "call": CALL, "cases": {}}
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

    def record(name, latents, image, extra=None):
        case = {"latents_rel_l2": rel_l2(latents, ref["latents"]),
                "image_rel_l2": rel_l2(image, ref["image"])}
        case.update(extra or {})
        doc["cases"][name] = case
        print(name, json.dumps(case), flush=True)

    for name, quantize in (("diffusers_bf16", False), ("diffusers_torchao", True)):
        try:
            latents, image, quantized = diffusers_run(args.fixture, ins, quantize, dev)
            record(name, latents, image, {"quantized_linears": len(quantized)} if quantize else None)
        except Exception as e:  # noqa: BLE001 - a failing case is a result
            doc["cases"][name] = {"error": f"{type(e).__name__}: {e}"}
            print(name, "error:", e, flush=True)
    with tempfile.TemporaryDirectory() as work:
        on = ["--device", "cuda:0"] if dev.type == "cuda" else []
        cases = [("ddo_bf16", ["--dtype", "bf16"] + on)]
        if dev.type == "cuda":
            cases.append(("ddo_fp8", ["--compute", "fp8"] + on))
        cases.append(("ddo_fp8_host", ["--compute", "fp8"]))
        for name, extra in cases:
            latents, image, note = ddo_run(args.ddo, args.fixture, extra, work)
            if latents is None:
                doc["cases"][name] = {"error": note}
                print(name, "error:", note, flush=True)
            else:
                record(name, latents, image, {"note": note} if note else None)
    c = doc["cases"]
    for ours in ("ddo_fp8", "ddo_fp8_host"):
        if "latents_rel_l2" in c.get(ours, {}) and "latents_rel_l2" in c.get("diffusers_torchao", {}):
            doc[f"{ours}_over_torchao"] = {
                k: c[ours][k] / c["diffusers_torchao"][k] for k in ("latents_rel_l2", "image_rel_l2")}
            print(f"{ours} / torchao:", json.dumps(doc[f"{ours}_over_torchao"]), flush=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
