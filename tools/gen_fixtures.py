#!/usr/bin/env python3
"""Generate small reference fixtures for the Rust model implementations.

Every fixture is built from a tiny config in code (no hub downloads), with
float32 weights on CPU, in eval mode, under torch.no_grad().  For each fixture
directory `fixtures/<name>/` this writes:

  config.json                             the model's own save_pretrained config
  diffusion_pytorch_model.safetensors     weights (Diffusers models), or
  model.safetensors                       weights (Transformers models),
                                          both exactly as save_pretrained(safe_serialization=True) writes them
  inputs.safetensors                      model inputs (f32, contiguous; int64 ids also kept)
  outputs.safetensors                     reference outputs (f32, contiguous)
  intermediates.safetensors               outputs of named submodules captured with forward hooks

and finally `fixtures/MANIFEST.md`.

Usage (see tools/README.md):

  .venv-fixtures/bin/python tools/gen_fixtures.py            # regenerate everything
  .venv-fixtures/bin/python tools/gen_fixtures.py --verify   # reload from disk, re-run, compare bit for bit
  .venv-fixtures/bin/python tools/gen_fixtures.py --only flux_pipeline   # rewrite one fixture only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import sys
import tempfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import diffusers
import transformers
import safetensors
from diffusers import (
    AutoencoderKL,
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    FluxTransformer2DModel,
    QwenImageTransformer2DModel,
)
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline, calculate_shift, retrieve_timesteps
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast

import qwen_pipeline_fixture
import qwen_text_fixture

REPO_ROOT = Path(__file__).resolve().parent.parent
FIXTURES = REPO_ROOT / "fixtures"

EXPECTED_VERSIONS = {
    "torch": "2.15.0",
    "diffusers": "0.42.1",
    "transformers": "5.24.0",
    "safetensors": "0.8.0",
}

# Extra perturbation applied after the library's own initialisation to every
# parameter that is constant (e.g. LayerNorm/GroupNorm weight=1, bias=0, zero
# linear biases), so that a Rust implementation that forgets an affine term or
# swaps weight/bias cannot accidentally match.
PERTURB_STD = 0.1


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def f32c(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float32).contiguous().clone()


def perturb_constant_params(model: torch.nn.Module, seed: int) -> list[str]:
    """Add N(0, PERTURB_STD) noise to every parameter whose elements are all equal."""
    g = torch.Generator().manual_seed(seed)
    touched = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            if flat.numel() > 0 and bool((flat == flat[0]).all()):
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * PERTURB_STD)
                touched.append(name)
    return touched


def module_depth(path: str) -> int:
    """Depth of a module path where a ModuleList index does not add depth.

    'decoder' -> 1, 'decoder.up_blocks.0' -> 2, 'decoder.up_blocks.0.resnets.1' -> 3.
    """
    return sum(1 for part in path.split(".") if not part.isdigit())


class Capture:
    """Forward hooks on every submodule up to `max_depth`, recording outputs by module path.

    Naming:
      * tensor output              -> '<path>'
      * tuple/list output          -> '<path>.0', '<path>.1', ... (None entries skipped)
      * dict / ModelOutput output  -> '<path>.<key>'
      * a module that runs more than once in one capture gets '@<k>' (k = call
        index from 0, in call order) appended to the module path of every call,
        e.g. 'time_text_embed.time_proj@0' (timestep), '...@1' (guidance).
    All tensors are stored as contiguous float32 (integer outputs are cast).
    """

    def __init__(self, model: torch.nn.Module, max_depth: int, prefix: str = "", only: set[str] | None = None):
        self.records: list[tuple[str, object]] = []
        self.handles = []
        self.prefix = prefix
        # remove_duplicate=False so a module shared under two names (T5's
        # shared / encoder.embed_tokens) is hooked under both.
        for path, mod in model.named_modules(remove_duplicate=False):
            if path == "":
                continue
            if isinstance(mod, (torch.nn.ModuleList, torch.nn.ModuleDict)):
                continue  # containers without forward: their elements are hooked individually
            if only is not None:
                if path not in only:
                    continue
            elif module_depth(path) > max_depth:
                continue
            self.handles.append(mod.register_forward_hook(self._make_hook(path)))

    def _make_hook(self, path):
        def hook(_mod, _inp, out):
            # flatten + clone *now*: callers may modify outputs in place afterwards
            # (e.g. AutoencoderKL.tiled_decode blends decoded tiles in place).
            flat: "OrderedDict[str, torch.Tensor]" = OrderedDict()
            self._flatten("", out, flat)
            self.records.append((path, flat))

        return hook

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []

    @staticmethod
    def _flatten(name, out, into: "OrderedDict[str, torch.Tensor]"):
        if out is None:
            return
        if isinstance(out, torch.Tensor) and torch.is_complex(out):
            # complex (Qwen-Image's rotary frequencies): [..., 2] = (real, imaginary)
            into[name] = f32c(torch.view_as_real(out))
        elif isinstance(out, torch.Tensor):
            into[name] = f32c(out)
        elif isinstance(out, (tuple, list)):
            for i, o in enumerate(out):
                Capture._flatten(f"{name}.{i}", o, into)
        elif isinstance(out, dict) or hasattr(out, "items"):
            for k, o in out.items():
                Capture._flatten(f"{name}.{k}", o, into)
        else:
            # non-tensor outputs (ints, caches, ...) are not recorded
            return

    def tensors(self) -> "OrderedDict[str, torch.Tensor]":
        counts: dict[str, int] = {}
        for path, _ in self.records:
            counts[path] = counts.get(path, 0) + 1
        seen: dict[str, int] = {}
        result: "OrderedDict[str, torch.Tensor]" = OrderedDict()
        for path, out in self.records:
            k = seen.get(path, 0)
            seen[path] = k + 1
            name = self.prefix + (path if counts[path] == 1 else f"{path}@{k}")
            for suffix, t in out.items():
                result[name + suffix] = t
        return result


def save_tensors(path: Path, tensors: "OrderedDict[str, torch.Tensor]"):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def reset_dir(d: Path):
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)


def randn(gen: torch.Generator, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32)


# --------------------------------------------------------------------------
# model builders (shared by generate and verify)
# --------------------------------------------------------------------------

VAE_COMMON = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    block_out_channels=(32, 64),
    layers_per_block=1,
    act_fn="silu",
    norm_num_groups=8,
    sample_size=32,
)

VAE_SD_CONFIG = dict(VAE_COMMON, latent_channels=4, use_quant_conv=True, use_post_quant_conv=True)
VAE_FLUX_CONFIG = dict(
    VAE_COMMON,
    latent_channels=16,
    use_quant_conv=False,
    use_post_quant_conv=False,
    scaling_factor=0.3611,
    shift_factor=0.1159,
)

# Tiling attributes set on the vae_flux instance for `sample_tiled`.
# (tile_sample_min_size must be tile_latent_min_size * 2**(len(block_out_channels)-1) = *2 here.)
VAE_FLUX_TILING = OrderedDict(
    tile_sample_min_size=16,
    tile_latent_min_size=8,
    tile_overlap_factor=0.25,
)

FLUX_CONFIG = dict(
    patch_size=1,
    in_channels=16,
    out_channels=None,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=16,
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),
)

# qwen_image_transformer: Qwen-Image's layout at tiny widths (DDO's `qwen-tiny` config): 4 latent channels packed
# 2x2 (in_channels 16, out_channels 4, patch_size 2), two dual-stream blocks of 2 heads x 16, text width 32.
QWEN_CONFIG = dict(
    patch_size=2,
    in_channels=16,
    out_channels=4,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    guidance_embeds=False,
    axes_dims_rope=(4, 6, 6),
)
# The images of one sample, (frames, rows, cols) of 2x2 patches: one 8x6 latent (odd column count: the centred
# positions are -2, -1, 0), and for `sample_two_images` that image followed by a 4x4 latent (the edit pipelines'
# layout: the second image's frame position is 1).
QWEN_IMG_SHAPES = [(1, 4, 3)]
QWEN_IMG_SHAPES_TWO = [(1, 4, 3), (1, 2, 2)]
QWEN_TEXT_TOKENS = 7
QWEN_TEXT_VALID = [7, 4]  # per sample: the second prompt is 3 tokens shorter (padding mask 0 there)

# qwen_vae: Qwen-Image's VAE (the Wan-style AutoencoderKLQwenImage) at tiny widths (DDO's `qwen-tiny`): decoder
# widths [16, 16, 16, 8] (base_dim 8 x [2] + reversed [1, 2, 2]), two resnets an up block, 4 latent channels, and
# temperal_downsample [False, True], so the decoder's up_blocks.0 upsamples with `upsample3d` (a time_conv that one
# frame never runs) and up_blocks.1 with `upsample2d`; 4x spatial compression. latents_mean / latents_std are
# made-up per-channel values (the real model's are 16 long).
QWEN_VAE_CONFIG = dict(
    base_dim=8,
    z_dim=4,
    dim_mult=[1, 2, 2],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[False, True],
    dropout=0.0,
    input_channels=3,
    latents_mean=[0.25, -0.5, 0.125, -0.0625],
    latents_std=[1.5, 0.75, 2.5, 1.25],
)
# enable_tiling(...) arguments of the `sample_tiled` call: 16 px tiles every 12 px (latent tiles of 4 every 3 at 4x
# compression, 4 px blended). Diffusers' defaults (256 / 192) would not tile a latent this small.
QWEN_VAE_TILING = OrderedDict(
    tile_sample_min_height=16,
    tile_sample_min_width=16,
    tile_sample_stride_height=12,
    tile_sample_stride_width=12,
)

T5_CONFIG = dict(
    vocab_size=100,
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    dropout_rate=0.0,
    layer_norm_epsilon=1e-6,
    feed_forward_proj="gated-gelu",
    is_encoder_decoder=False,
    use_cache=False,
    pad_token_id=0,
    eos_token_id=1,
)

CLIP_CONFIG = dict(
    vocab_size=100,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=16,
    hidden_act="quick_gelu",
    layer_norm_eps=1e-5,
    attention_dropout=0.0,
    dropout=0.0,
    bos_token_id=98,
    eos_token_id=99,
    pad_token_id=99,
)

SEEDS = {
    "vae_sd": 1001,
    "vae_flux": 1002,
    "flux_transformer": 1003,
    "t5_encoder": 1004,
    "clip_text": 1005,
    "flux_pipeline": 1006,
    "qwen_image_transformer": 1007,
    "qwen_vae": 1008,
}

# flux_pipeline: a whole FluxPipeline from the tiny configs above, made consistent with each other.
# The transformer is FLUX_CONFIG with the pooled width of CLIP_CONFIG (32); its joint_attention_dim (32) is
# T5_CONFIG's d_model. Its in_channels (16) = 4 x the VAE's latent_channels (4). The VAE is the Flux layout
# (no quant convs, scaling/shift factors of FLUX.1) at half of VAE_COMMON's widths, to keep the fixture small.
PIPE_FLUX_CONFIG = dict(FLUX_CONFIG, pooled_projection_dim=CLIP_CONFIG["hidden_size"])
PIPE_VAE_CONFIG = dict(
    VAE_COMMON,
    block_out_channels=(8, 16),
    norm_num_groups=4,
    latent_channels=PIPE_FLUX_CONFIG["in_channels"] // 4,
    use_quant_conv=False,
    use_post_quant_conv=False,
    scaling_factor=0.3611,
    shift_factor=0.1159,
)
# FLUX.1-dev's scheduler/scheduler_config.json.
PIPE_SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)
PIPE_CALL = dict(height=32, width=24, num_inference_steps=4, guidance_scale=3.5)
PIPE_TEXT_TOKENS = 8
# The text-prompt run: FluxPipeline.encode_prompt with real (tiny) tokenizers.
PIPE_PROMPT = "A photo of a lighthouse at dawn, the cat sat on the hot line!"
PIPE_MAX_SEQUENCE_LENGTH = 24
# (image_seq_len, steps) pairs whose FluxPipeline schedules go to schedules.json.
PIPE_SCHEDULES = [(48, 4), (256, 28), (1024, 28), (4096, 50), (4096, 1), (6144, 20), (16, 2)]


def build_model(name: str):
    """Build the model for fixture `name` with deterministic weights."""
    seed = SEEDS[name]
    torch.manual_seed(seed)
    if name == "vae_sd":
        model = AutoencoderKL(**VAE_SD_CONFIG)
    elif name == "vae_flux":
        model = AutoencoderKL(**VAE_FLUX_CONFIG)
    elif name == "flux_transformer":
        model = FluxTransformer2DModel(**FLUX_CONFIG)
    elif name == "qwen_image_transformer":
        model = QwenImageTransformer2DModel(**QWEN_CONFIG)
    elif name == "qwen_vae":
        model = AutoencoderKLQwenImage(**QWEN_VAE_CONFIG)
    elif name == "t5_encoder":
        model = T5EncoderModel(T5Config(**T5_CONFIG))
    elif name == "clip_text":
        model = CLIPTextModel(CLIPTextConfig(**CLIP_CONFIG))
    else:
        raise KeyError(name)
    model = model.to(torch.float32).eval()
    perturbed = perturb_constant_params(model, seed + 7)
    if name == "qwen_vae":
        # Its initialisation decodes to about [-0.7, 0.7]; a 3x conv_out makes part of the image leave [-1, 1],
        # so the untiled decode's clamp shows (and the tiled decode, which does not clamp, differs there).
        with torch.no_grad():
            model.decoder.conv_out.weight.mul_(3.0)
    return model, perturbed


def load_saved_model(name: str, d: Path, realign: bool = True):
    if name in ("vae_sd", "vae_flux"):
        model = AutoencoderKL.from_pretrained(str(d), torch_dtype=torch.float32)
    elif name == "flux_transformer":
        model = FluxTransformer2DModel.from_pretrained(str(d), torch_dtype=torch.float32)
    elif name == "qwen_image_transformer":
        model = QwenImageTransformer2DModel.from_pretrained(str(d), torch_dtype=torch.float32)
    elif name == "qwen_vae":
        model = AutoencoderKLQwenImage.from_pretrained(str(d), torch_dtype=torch.float32)
    elif name == "t5_encoder":
        model = T5EncoderModel.from_pretrained(str(d), dtype=torch.float32)
    elif name == "clip_text":
        model = CLIPTextModel.from_pretrained(str(d), dtype=torch.float32)
    else:
        raise KeyError(name)
    if realign:
        # Diffusers' from_pretrained can leave parameters as views into the safetensors
        # buffer that are not 64-byte aligned; CPU GEMM kernels then take a different
        # path and round differently (~1 ulp; seen on flux_transformer's time embedders).
        # Copy into freshly allocated (aligned) storage, like a model built in code.
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.clone()
            for b in model.buffers():
                b.data = b.data.clone()
    return model.eval()


# --------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------


def make_inputs(name: str) -> "OrderedDict[str, torch.Tensor]":
    g = torch.Generator().manual_seed(SEEDS[name] + 100)
    ins: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    if name == "vae_sd":
        ins["latents"] = randn(g, 1, 4, 8, 8)
    elif name == "vae_flux":
        ins["latents"] = randn(g, 1, 16, 8, 8)
        ins["latents_tiled"] = randn(g, 1, 16, 12, 12)
    elif name == "flux_transformer":
        # 4-channel 8x8 latent, packed 2x2 like FluxPipeline._pack_latents -> [1, 16 tokens, 16 ch]
        latents_unpacked = randn(g, 1, 4, 8, 8)
        hidden_states = FluxPipeline._pack_latents(latents_unpacked, 1, 4, 8, 8)
        ins["latents_unpacked"] = latents_unpacked
        ins["hidden_states"] = hidden_states
        ins["encoder_hidden_states"] = randn(g, 1, 8, 32)
        ins["pooled_projections"] = randn(g, 1, 16)
        ins["timestep"] = torch.tensor([0.5], dtype=torch.float32)  # = t / 1000 with t = 500
        ins["guidance"] = torch.tensor([3.5], dtype=torch.float32)  # = guidance_scale, NOT divided
        ins["img_ids"] = FluxPipeline._prepare_latent_image_ids(1, 4, 4, torch.device("cpu"), torch.float32)
        ins["txt_ids"] = torch.zeros(8, 3, dtype=torch.float32)
    elif name == "qwen_image_transformer":
        # Two samples of a 4-channel 8x6 latent, packed 2x2 like QwenImagePipeline._pack_latents -> [2, 12, 16]
        batch, ch = len(QWEN_TEXT_VALID), QWEN_CONFIG["in_channels"] // 4
        f, h, w = QWEN_IMG_SHAPES[0]
        latents_unpacked = randn(g, batch, ch, 2 * h, 2 * w)
        ins["latents_unpacked"] = latents_unpacked
        ins["hidden_states"] = QwenImagePipeline._pack_latents(latents_unpacked, batch, ch, 2 * h, 2 * w)
        ins["encoder_hidden_states"] = randn(g, batch, QWEN_TEXT_TOKENS, QWEN_CONFIG["joint_attention_dim"])
        mask = torch.tensor([[1] * n + [0] * (QWEN_TEXT_TOKENS - n) for n in QWEN_TEXT_VALID], dtype=torch.int64)
        ins["encoder_hidden_states_mask"] = mask
        ins["encoder_hidden_states_mask_f32"] = mask.to(torch.float32)
        ins["timestep"] = torch.tensor([0.75, 0.3], dtype=torch.float32)  # = t / 1000, one per sample
        ins["img_shapes"] = torch.tensor(QWEN_IMG_SHAPES, dtype=torch.int64)
        ins["img_shapes_f32"] = ins["img_shapes"].to(torch.float32)
        second = sum(a * b * c for a, b, c in QWEN_IMG_SHAPES_TWO[1:])
        extra_tokens = randn(g, batch, second, QWEN_CONFIG["in_channels"])
        ins["hidden_states_two_images"] = torch.cat([ins["hidden_states"], extra_tokens], dim=1)
        ins["img_shapes_two_images"] = torch.tensor(QWEN_IMG_SHAPES_TWO, dtype=torch.int64)
        ins["img_shapes_two_images_f32"] = ins["img_shapes_two_images"].to(torch.float32)
    elif name == "qwen_vae":
        # One frame of a 6x5 latent (odd width), batch 1 and batch 2, as 4-D [B, z, H, W]; the decode gets them
        # with the frame axis inserted ([B, z, 1, H, W]). `pipeline_latents` stand for the denoised latents the
        # pipeline unpacks (normalised); the pipeline un-normalises them before decoding (see run_fixture).
        z = QWEN_VAE_CONFIG["z_dim"]
        ins["latents"] = randn(g, 1, z, 6, 5)
        ins["latents_batch2"] = randn(g, 2, z, 6, 5)
        ins["latents_tiled"] = randn(g, 1, z, 7, 9)
        ins["pipeline_latents"] = randn(g, 1, z, 6, 5)
    elif name == "t5_encoder":
        # a few ids, then </s> (eos=1) and padding (pad=0), like a padded T5 tokenizer output
        ids = torch.tensor([[37, 5, 82, 14, 99, 3, 61, 1, 0, 0, 0, 0]], dtype=torch.int64)
        ins["input_ids"] = ids
        ins["input_ids_f32"] = ids.to(torch.float32)
    elif name == "clip_text":
        # bos(98) tokens... eos(99) then padding with eos (99), like the CLIP tokenizer
        # used by SD / Flux pipelines (pad token == <|endoftext|>).
        ids = torch.tensor([[98, 12, 45, 7, 83, 99, 99, 99, 99, 99]], dtype=torch.int64)
        ins["input_ids"] = ids
        ins["input_ids_f32"] = ids.to(torch.float32)
    return ins


# --------------------------------------------------------------------------
# running
# --------------------------------------------------------------------------

CAPTURE_DEPTH = {
    "vae_sd": 3,
    "vae_flux": 3,
    "flux_transformer": 2,
    "t5_encoder": 3,
    "clip_text": 3,
    "qwen_image_transformer": 2,
    "qwen_vae": 3,
}


def tiling_plan(latent_hw: tuple[int, int]) -> dict:
    """Mirror of AutoencoderKL.tiled_decode's tile arithmetic (diffusers 0.42.1)."""
    t = VAE_FLUX_TILING
    overlap_size = int(t["tile_latent_min_size"] * (1 - t["tile_overlap_factor"]))
    blend_extent = int(t["tile_sample_min_size"] * t["tile_overlap_factor"])
    row_limit = t["tile_sample_min_size"] - blend_extent
    H, W = latent_hw
    rows = list(range(0, H, overlap_size))
    cols = list(range(0, W, overlap_size))
    tiles = []
    for ri, i in enumerate(rows):
        for ci, j in enumerate(cols):
            h = min(i + t["tile_latent_min_size"], H) - i
            w = min(j + t["tile_latent_min_size"], W) - j
            tiles.append(
                dict(
                    call_index=len(tiles),
                    row=ri,
                    col=ci,
                    latent_y0=i,
                    latent_x0=j,
                    latent_h=h,
                    latent_w=w,
                )
            )
    return dict(
        overlap_size_latent=overlap_size,
        blend_extent_pixels=blend_extent,
        row_limit_pixels=row_limit,
        tile_rows=len(rows),
        tile_cols=len(cols),
        tiles=tiles,
    )


def reference_stitch(tiles: list[torch.Tensor], plan: dict) -> torch.Tensor:
    """Independent re-implementation of tiled_decode's blend/crop/concat, used as a self-check.

    Semantics (as in diffusers): tiles are visited row-major; each tile is first blended
    vertically with the *already blended, uncropped* tile above, then horizontally with the
    *already blended, uncropped* tile to its left (blending is in place), then cropped to
    row_limit x row_limit.
    """
    R, C = plan["tile_rows"], plan["tile_cols"]
    be = plan["blend_extent_pixels"]
    lim = plan["row_limit_pixels"]
    grid = [[tiles[r * C + c].clone() for c in range(C)] for r in range(R)]
    out_rows = []
    for r in range(R):
        row_out = []
        for c in range(C):
            b = grid[r][c]
            if r > 0:
                a = grid[r - 1][c]
                e = min(a.shape[2], b.shape[2], be)
                for y in range(e):
                    b[:, :, y, :] = a[:, :, -e + y, :] * (1 - y / e) + b[:, :, y, :] * (y / e)
            if c > 0:
                a = grid[r][c - 1]
                e = min(a.shape[3], b.shape[3], be)
                for x in range(e):
                    b[:, :, :, x] = a[:, :, :, -e + x] * (1 - x / e) + b[:, :, :, x] * (x / e)
            row_out.append(b[:, :, :lim, :lim])
        out_rows.append(torch.cat(row_out, dim=3))
    return torch.cat(out_rows, dim=2)


def qwen_vae_single_frame(model, latents: torch.Tensor) -> torch.Tensor:
    """AutoencoderKLQwenImage's decode of one frame `latents` [B, z, H, W] read as a 2-D network (what DDO runs).

    A QwenImageCausalConv3d pads `2 * padding` frames of zeros in front (its cache is None on the first chunk),
    so on one frame only the kernel's last temporal slice meets data: a Conv2d with `weight[:, :, -1]`. Resample's
    `upsample3d` marks its cache "Rep" on the first chunk and skips `time_conv`. Independent of DDO's code."""
    sd = model.state_dict()
    F = torch.nn.functional

    def conv(x, name):
        w = sd[name + ".weight"]
        w = w[:, :, -1] if w.dim() == 5 else w
        return F.conv2d(x, w, sd[name + ".bias"], padding=w.shape[-1] // 2)

    def rms(x, name):
        g = sd[name + ".gamma"]
        return F.normalize(x, dim=1) * x.shape[1] ** 0.5 * g.reshape(g.shape[0], 1, 1)

    def resnet(x, p):
        h = conv(F.silu(rms(x, p + ".norm1")), p + ".conv1")
        h = conv(F.silu(rms(h, p + ".norm2")), p + ".conv2")
        return h + (conv(x, p + ".conv_shortcut") if p + ".conv_shortcut.weight" in sd else x)

    def attention(x, p):
        b, c, h, w = x.shape
        qkv = conv(rms(x, p + ".norm"), p + ".to_qkv").reshape(b, 1, 3 * c, h * w).permute(0, 1, 3, 2)
        q, k, v = qkv.chunk(3, dim=-1)
        o = F.scaled_dot_product_attention(q, k, v).squeeze(1).permute(0, 2, 1).reshape(b, c, h, w)
        return conv(o, p + ".proj") + x

    with torch.no_grad():
        x = conv(conv(latents, "post_quant_conv"), "decoder.conv_in")
        x = resnet(x, "decoder.mid_block.resnets.0")
        x = attention(x, "decoder.mid_block.attentions.0")
        x = resnet(x, "decoder.mid_block.resnets.1")
        for i, block in enumerate(model.decoder.up_blocks):
            for k in range(len(block.resnets)):
                x = resnet(x, f"decoder.up_blocks.{i}.resnets.{k}")
            if block.upsamplers is not None:
                x = conv(F.interpolate(x, scale_factor=2.0, mode="nearest-exact"), f"decoder.up_blocks.{i}.upsamplers.0.resample.1")
        x = conv(F.silu(rms(x, "decoder.norm_out")), "decoder.conv_out")
        return x.clamp(-1.0, 1.0)


def run_fixture(name: str, model, ins, capture: bool):
    """Run the fixture's reference call(s). Returns (outputs, intermediates, extra)."""
    outs: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    inter: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    extra: dict = {}
    depth = CAPTURE_DEPTH[name]
    with torch.no_grad():
        if name in ("vae_sd", "vae_flux"):
            model.disable_tiling()
            cap = Capture(model, depth) if capture else None
            outs["sample"] = f32c(model.decode(ins["latents"]).sample)
            if cap:
                cap.remove()
                inter.update(cap.tensors())
            if name == "vae_flux":
                for k, v in VAE_FLUX_TILING.items():
                    setattr(model, k, v)
                model.enable_tiling()
                lat = ins["latents_tiled"]
                # the untiled decode of the same latents is useful to see what tiling changes
                model.use_tiling = False
                outs["sample_tiled_reference_untiled"] = f32c(model.decode(lat).sample)
                model.use_tiling = True
                cap = Capture(model, depth, prefix="tiled.", only={"decoder"}) if capture else None
                called = []
                orig = model.tiled_decode

                def spy(*a, **kw):
                    called.append(True)
                    return orig(*a, **kw)

                model.tiled_decode = spy
                outs["sample_tiled"] = f32c(model.decode(lat).sample)
                del model.tiled_decode
                assert called, "tiled_decode was not called: tiling path not exercised"
                plan = tiling_plan(tuple(lat.shape[-2:]))
                extra["tiling_plan"] = plan
                if cap:
                    cap.remove()
                    tiled = cap.tensors()
                    assert len(tiled) == len(plan["tiles"]), (len(tiled), len(plan["tiles"]))
                    inter.update(tiled)
                    tiles = [tiled[f"tiled.decoder@{t['call_index']}"] for t in plan["tiles"]]
                    stitched = reference_stitch(tiles, plan)
                    assert torch.equal(stitched, outs["sample_tiled"]), "reference stitching mismatch"
                    extra["stitch_selfcheck"] = "bit-exact"
                model.disable_tiling()
        elif name == "flux_transformer":
            cap = Capture(model, depth) if capture else None
            # Exactly the FluxPipeline.__call__ denoising-loop call (return_dict=False)[0]
            out = model(
                hidden_states=ins["hidden_states"],
                timestep=ins["timestep"],
                guidance=ins["guidance"],
                pooled_projections=ins["pooled_projections"],
                encoder_hidden_states=ins["encoder_hidden_states"],
                txt_ids=ins["txt_ids"],
                img_ids=ins["img_ids"],
                joint_attention_kwargs=None,
                return_dict=False,
            )[0]
            outs["sample"] = f32c(out)
            if cap:
                cap.remove()
                inter.update(cap.tensors())
        elif name == "qwen_image_transformer":
            batch = ins["hidden_states"].shape[0]

            def call(hidden_states, shapes, mask):
                # Exactly the QwenImagePipeline.__call__ denoising-loop call (return_dict=False)[0]:
                # img_shapes = [[(1, h, w)]] * batch, the tokenizer's attention mask (None when it is all ones)
                img_shapes = [[tuple(int(v) for v in s) for s in shapes.tolist()]] * batch
                return model(
                    hidden_states=hidden_states,
                    timestep=ins["timestep"],
                    guidance=None,
                    encoder_hidden_states_mask=mask,
                    encoder_hidden_states=ins["encoder_hidden_states"],
                    img_shapes=img_shapes,
                    attention_kwargs=None,
                    return_dict=False,
                )[0]

            cap = Capture(model, depth) if capture else None
            outs["sample"] = f32c(call(ins["hidden_states"], ins["img_shapes"], ins["encoder_hidden_states_mask"]))
            if cap:
                cap.remove()
                inter.update(cap.tensors())
            outs["sample_unmasked"] = f32c(call(ins["hidden_states"], ins["img_shapes"], None))
            outs["sample_two_images"] = f32c(
                call(ins["hidden_states_two_images"], ins["img_shapes_two_images"], ins["encoder_hidden_states_mask"])
            )
        elif name == "qwen_vae":
            model.disable_tiling()
            frames = lambda t: t.unsqueeze(2)  # [B, z, H, W] -> [B, z, 1, H, W]: one frame
            cap = Capture(model, depth) if capture else None
            outs["sample"] = f32c(model.decode(frames(ins["latents"])).sample[:, :, 0])
            if cap:
                cap.remove()
                inter.update(cap.tensors())
            outs["sample_batch2"] = f32c(model.decode(frames(ins["latents_batch2"])).sample[:, :, 0])
            # QwenImagePipeline.__call__'s decode, spelled out (its latents already unpacked to [B, z, 1, H, W]).
            latents = frames(ins["pipeline_latents"]).to(model.dtype)
            z = model.config.z_dim
            latents_mean = torch.tensor(model.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
            latents_std = 1.0 / torch.tensor(model.config.latents_std).view(1, z, 1, 1, 1).to(
                latents.device, latents.dtype
            )
            latents = latents / latents_std + latents_mean
            outs["pipeline_denormalized"] = f32c(latents[:, :, 0])
            outs["pipeline_image"] = f32c(model.decode(latents, return_dict=False)[0][:, :, 0])
            lat = frames(ins["latents_tiled"])
            outs["sample_tiled_reference_untiled"] = f32c(model.decode(lat).sample[:, :, 0])
            model.enable_tiling(**QWEN_VAE_TILING)
            called = []
            orig = model.tiled_decode

            def spy(*a, **kw):
                called.append(True)
                return orig(*a, **kw)

            model.tiled_decode = spy
            outs["sample_tiled"] = f32c(model.decode(lat).sample[:, :, 0])
            del model.tiled_decode
            assert called, "tiled_decode was not called: tiling path not exercised"
            # Diffusers' default tiles (256 px every 192) leave these latents untiled.
            model.enable_tiling(
                tile_sample_min_height=256,
                tile_sample_min_width=256,
                tile_sample_stride_height=192,
                tile_sample_stride_width=192,
            )
            assert torch.equal(f32c(model.decode(lat).sample[:, :, 0]), outs["sample_tiled_reference_untiled"])
            model.disable_tiling()
            # The frame loop of `_decode` with one frame is one decoder call on the first-chunk path. Check the
            # reading DDO implements against it: every causal convolution a 2-D one with its kernel's last
            # temporal slice (the causal padding is zeros), no time_conv, the RMS norms over channels.
            diff = (qwen_vae_single_frame(model, ins["latents_batch2"]) - outs["sample_batch2"]).abs().max().item()
            assert diff < 1e-5, f"the single-frame reading differs by {diff}"
            extra["single_frame_max_abs_diff"] = diff
            extra["clamped"] = float((outs["sample"].abs() == 1.0).float().mean())
        elif name == "t5_encoder":
            cap = Capture(model, depth) if capture else None
            o = model(input_ids=ins["input_ids"])
            outs["last_hidden_state"] = f32c(o.last_hidden_state)
            if cap:
                cap.remove()
                inter.update(cap.tensors())
        elif name == "clip_text":
            cap = Capture(model, depth) if capture else None
            o = model(input_ids=ins["input_ids"])
            outs["last_hidden_state"] = f32c(o.last_hidden_state)
            outs["pooler_output"] = f32c(o.pooler_output)
            if cap:
                cap.remove()
                inter.update(cap.tensors())
            ids = ins["input_ids"]
            eos_pos = int((ids == model.config.eos_token_id).int().argmax(dim=-1)[0])
            argmax_pos = int(ids.to(torch.int).argmax(dim=-1)[0])
            assert torch.equal(outs["pooler_output"][0], outs["last_hidden_state"][0, eos_pos])
            extra["pool_index"] = eos_pos
            extra["argmax_rule_index"] = argmax_pos
    return outs, inter, extra


# --------------------------------------------------------------------------
# flux_pipeline: a whole FluxPipeline run (4 steps, given embeddings and noise)
# --------------------------------------------------------------------------

# Component order fixes the seed offsets: component k is built after torch.manual_seed(seed + k).
PIPE_COMPONENTS = ["text_encoder", "text_encoder_2", "transformer", "vae"]


def pipeline_tokenizers(tmp: Path):
    """Tiny tokenizers consistent with CLIP_CONFIG / T5_CONFIG (100 ids each), built the way the real ones are.

    CLIP: a byte-level BPE from vocab.json + merges.txt (letters, letters + `</w>`, a few merges and punctuation,
    fillers up to id 97, then `<|startoftext|>` = 98 and `<|endoftext|>` = 99 = CLIP_CONFIG's bos/eos), loaded by
    `CLIPTokenizer` with `model_max_length` = CLIP's 16 positions. Returns the vocab/merges texts too, so the fixture
    keeps them beside the tokenizer.json that save_pretrained writes (FLUX.1-dev ships vocab.json + merges.txt).
    T5: a Unigram model (`<pad>` 0, `</s>` 1, `<unk>` 2, word and letter pieces, `<extra_k>` fillers to 100) with T5's
    Metaspace pre-tokenizer and `$A </s>` template, wrapped in `T5TokenizerFast`.
    """
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = {}
    for c in letters:
        vocab[c] = len(vocab)
    for c in letters:
        vocab[c + "</w>"] = len(vocab)
    merges = ["t h", "th e</w>", "a t</w>", "c at</w>", "o n</w>", "i n", "l i", "h o", "s e</w>", "g h", "o f</w>"]
    for m in merges:
        a, b = m.split()
        vocab[a + b] = len(vocab)
    for p in ",.!":
        vocab[p + "</w>"] = len(vocab)
    while len(vocab) < 98:
        vocab[f"x{len(vocab)}</w>"] = len(vocab)
    vocab["<|startoftext|>"] = 98
    vocab["<|endoftext|>"] = 99
    vocab_text = json.dumps(vocab)
    merges_text = "#version: 0.2\n" + "\n".join(merges) + "\n"
    (tmp / "vocab.json").write_text(vocab_text)
    (tmp / "merges.txt").write_text(merges_text)
    clip_tok = CLIPTokenizer(
        str(tmp / "vocab.json"), str(tmp / "merges.txt"), model_max_length=CLIP_CONFIG["max_position_embeddings"]
    )

    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    for w in ["\u2581the", "\u2581a", "\u2581cat", "\u2581photo", "\u2581of", "\u2581on", "\u2581light", "house",
              "\u2581at", "\u2581dawn", "\u2581sat", "\u2581hot", "\u2581line", "\u2581", ",", ".", "!"]:
        pieces.append((w, -2.0 - 0.1 * len(pieces)))
    for c in letters:
        pieces.append((c, -8.0))
        pieces.append(("\u2581" + c, -7.5))
    while len(pieces) < T5_CONFIG["vocab_size"]:
        pieces.append((f"<extra_{len(pieces)}>", -20.0))
    tok = Tokenizer(models.Unigram(pieces, unk_id=2, byte_fallback=False))
    tok.normalizer = normalizers.Sequence([normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    t5_tok = T5TokenizerFast(
        tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>", extra_ids=0, model_max_length=512
    )
    return clip_tok, t5_tok, vocab_text, merges_text


def build_pipeline():
    """FluxPipeline from PIPE_* configs with deterministic, perturbed weights and the tiny tokenizers.

    Returns (pipe, perturbed, (vocab_text, merges_text))."""
    seed = SEEDS["flux_pipeline"]
    models = {}
    perturbed = {}
    for k, comp in enumerate(PIPE_COMPONENTS):
        torch.manual_seed(seed + k)
        if comp == "text_encoder":
            m = CLIPTextModel(CLIPTextConfig(**CLIP_CONFIG))
        elif comp == "text_encoder_2":
            m = T5EncoderModel(T5Config(**T5_CONFIG))
        elif comp == "transformer":
            m = FluxTransformer2DModel(**PIPE_FLUX_CONFIG)
        else:
            m = AutoencoderKL(**PIPE_VAE_CONFIG)
        m = m.to(torch.float32).eval()
        perturbed[comp] = perturb_constant_params(m, seed + k + 7)
        models[comp] = m
    with tempfile.TemporaryDirectory() as tmp:
        clip_tok, t5_tok, vocab_text, merges_text = pipeline_tokenizers(Path(tmp))
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**PIPE_SCHEDULER_CONFIG),
        vae=models["vae"],
        text_encoder=models["text_encoder"],
        tokenizer=clip_tok,
        text_encoder_2=models["text_encoder_2"],
        tokenizer_2=t5_tok,
        transformer=models["transformer"],
    )
    return pipe, perturbed, (vocab_text, merges_text)


def pipeline_inputs(pipe) -> "OrderedDict[str, torch.Tensor]":
    g = torch.Generator().manual_seed(SEEDS["flux_pipeline"] + 100)
    h, w = PIPE_CALL["height"], PIPE_CALL["width"]
    c = pipe.transformer.config.in_channels // 4
    lh = 2 * (h // (pipe.vae_scale_factor * 2))
    lw = 2 * (w // (pipe.vae_scale_factor * 2))
    ins: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    ins["prompt_embeds"] = randn(g, 1, PIPE_TEXT_TOKENS, pipe.transformer.config.joint_attention_dim)
    ins["pooled_prompt_embeds"] = randn(g, 1, pipe.transformer.config.pooled_projection_dim)
    # FluxPipeline.prepare_latents draws [b, c, lh, lw] and packs it; here the draw is ours.
    ins["noise"] = randn(g, 1, c, lh, lw)
    ins["latents"] = FluxPipeline._pack_latents(ins["noise"], 1, c, lh, lw).contiguous()
    return ins


def run_pipeline(pipe, ins):
    """Returns (outputs, intermediates, extra)."""
    outs: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    inter: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    steps = []

    def on_step(_pipe, i, t, kw):
        steps.append((i, float(t), kw["latents"].clone()))
        return {}

    common = dict(
        prompt_embeds=ins["prompt_embeds"],
        pooled_prompt_embeds=ins["pooled_prompt_embeds"],
        latents=ins["latents"],
        return_dict=False,
        **PIPE_CALL,
    )
    with torch.no_grad():
        latents = pipe(
            output_type="latent",
            callback_on_step_end=on_step,
            callback_on_step_end_tensor_inputs=["latents"],
            **common,
        )[0]
        outs["latents"] = f32c(latents)
        outs["timesteps"] = f32c(pipe.scheduler.timesteps)
        outs["sigmas"] = f32c(pipe.scheduler.sigmas)
        for i, _t, lat in steps:
            inter[f"latents_after_step_{i}"] = f32c(lat)
        # The decode FluxPipeline runs after the loop, spelled out: unpack, unscale, decode.
        h, w = PIPE_CALL["height"], PIPE_CALL["width"]
        unpacked = FluxPipeline._unpack_latents(latents, h, w, pipe.vae_scale_factor)
        unscaled = (unpacked / pipe.vae.config.scaling_factor) + pipe.vae.config.shift_factor
        inter["latents_unpacked"] = f32c(unpacked)
        inter["latents_unscaled"] = f32c(unscaled)
        image = pipe.vae.decode(unscaled, return_dict=False)[0]
        outs["image"] = f32c(image)
        image_pt = pipe(output_type="pt", **common)[0]
        outs["image_pt"] = f32c(image_pt)
        assert torch.equal(
            pipe.image_processor.postprocess(image, output_type="pt"), image_pt
        ), "spelled-out decode differs from FluxPipeline's own"
        # From text: the tokenizers' ids as _get_clip_prompt_embeds / _get_t5_prompt_embeds make them, the
        # embeddings encode_prompt returns, and the latents of the same run started from the prompt.
        clip_ids = pipe.tokenizer(
            PIPE_PROMPT, padding="max_length", max_length=pipe.tokenizer_max_length, truncation=True,
            return_tensors="pt",
        ).input_ids
        t5_ids = pipe.tokenizer_2(
            PIPE_PROMPT, padding="max_length", max_length=PIPE_MAX_SEQUENCE_LENGTH, truncation=True,
            return_tensors="pt",
        ).input_ids
        pe, pooled, _ = pipe.encode_prompt(
            prompt=PIPE_PROMPT, prompt_2=None, device=torch.device("cpu"), max_sequence_length=PIPE_MAX_SEQUENCE_LENGTH
        )
        outs["text_clip_input_ids"] = clip_ids.to(torch.int64).contiguous()
        outs["text_clip_input_ids_f32"] = f32c(clip_ids)
        outs["text_t5_input_ids"] = t5_ids.to(torch.int64).contiguous()
        outs["text_t5_input_ids_f32"] = f32c(t5_ids)
        outs["text_prompt_embeds"] = f32c(pe)
        outs["text_pooled_prompt_embeds"] = f32c(pooled)
        text_latents = pipe(
            prompt=PIPE_PROMPT,
            latents=ins["latents"],
            max_sequence_length=PIPE_MAX_SEQUENCE_LENGTH,
            output_type="latent",
            return_dict=False,
            **PIPE_CALL,
        )[0]
        outs["text_latents"] = f32c(text_latents)
    mu = calculate_shift(
        latents.shape[1],
        PIPE_SCHEDULER_CONFIG["base_image_seq_len"],
        PIPE_SCHEDULER_CONFIG["max_image_seq_len"],
        PIPE_SCHEDULER_CONFIG["base_shift"],
        PIPE_SCHEDULER_CONFIG["max_shift"],
    )
    extra = dict(mu=mu, image_seq_len=int(latents.shape[1]), step_timesteps=[t for _, t, _ in steps])
    return outs, inter, extra


def pipeline_schedules() -> dict:
    """FluxPipeline's schedule (sigmas = linspace(1, 1/n, n), mu from the image sequence length) for
    several resolutions, plus one fixed-shift schedule (use_dynamic_shifting=False, no sigmas given)."""
    cases = []
    for seq_len, n in PIPE_SCHEDULES:
        sched = FlowMatchEulerDiscreteScheduler(**PIPE_SCHEDULER_CONFIG)
        mu = calculate_shift(
            seq_len,
            sched.config.get("base_image_seq_len", 256),
            sched.config.get("max_image_seq_len", 4096),
            sched.config.get("base_shift", 0.5),
            sched.config.get("max_shift", 1.15),
        )
        sigmas = np.linspace(1.0, 1 / n, n)
        timesteps, _ = retrieve_timesteps(sched, n, "cpu", sigmas=sigmas, mu=mu)
        cases.append(
            dict(
                image_seq_len=seq_len,
                num_inference_steps=n,
                mu=mu,
                timesteps=[float(x) for x in timesteps],
                sigmas=[float(x) for x in sched.sigmas],
            )
        )
    fixed = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    fixed.set_timesteps(28)
    return dict(
        scheduler_config=PIPE_SCHEDULER_CONFIG,
        how="mu = calculate_shift(image_seq_len, 256, 4096, 0.5, 1.15); "
        "retrieve_timesteps(scheduler, n, sigmas=np.linspace(1.0, 1 / n, n), mu=mu)",
        flux=cases,
        fixed_shift=dict(
            scheduler_config=dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False),
            how="scheduler.set_timesteps(28)",
            num_inference_steps=28,
            timesteps=[float(x) for x in fixed.timesteps],
            sigmas=[float(x) for x in fixed.sigmas],
        ),
    )


def generate_pipeline(d: Path) -> dict:
    pipe, perturbed, (vocab_text, merges_text) = build_pipeline()
    pipe.save_pretrained(str(d), safe_serialization=True)
    # FLUX.1-dev's tokenizer/ holds vocab.json + merges.txt; transformers 5 writes tokenizer.json. Keep both.
    (d / "tokenizer" / "vocab.json").write_text(vocab_text)
    (d / "tokenizer" / "merges.txt").write_text(merges_text)
    (d / "prompt.json").write_text(
        json.dumps(
            dict(
                prompt=PIPE_PROMPT,
                max_sequence_length=PIPE_MAX_SEQUENCE_LENGTH,
                clip_max_length=pipe.tokenizer_max_length,
            ),
            indent=2,
        )
        + "\n"
    )
    ins = pipeline_inputs(pipe)
    outs, inter, extra = run_pipeline(pipe, ins)
    outs2, _, _ = run_pipeline(pipe, ins)
    for k in outs:
        assert torch.equal(outs[k], outs2[k]), f"flux_pipeline: {k} differs between two runs"
    save_tensors(d / "inputs.safetensors", OrderedDict((k, v.contiguous()) for k, v in ins.items()))
    save_tensors(d / "outputs.safetensors", outs)
    save_tensors(d / "intermediates.safetensors", inter)
    (d / "schedules.json").write_text(json.dumps(pipeline_schedules(), indent=2) + "\n")
    print(f"[gen] flux_pipeline: " + ", ".join(f"{k}{list(v.shape)}" for k, v in outs.items()))
    return dict(perturbed=[f"{c}: {n}" for c, ps in perturbed.items() for n in ps], extra=extra)


def verify_pipeline(d: Path) -> bool:
    ok = True
    pipe = FluxPipeline.from_pretrained(str(d), torch_dtype=torch.float32)
    with torch.no_grad():
        for comp in PIPE_COMPONENTS:
            m = getattr(pipe, comp)
            for p in m.parameters():
                p.data = p.data.clone()
            m.eval()
    ins = OrderedDict(load_file(str(d / "inputs.safetensors")))
    outs, inter, _ = run_pipeline(pipe, ins)
    ref = load_file(str(d / "outputs.safetensors"))
    for k, v in ref.items():
        same = torch.equal(outs[k], v)
        ok &= same
        print(f"[verify] flux_pipeline.{k}: {'bit-exact' if same else 'MISMATCH'} (max |diff| {(outs[k] - v).abs().max().item():.3g})")
    ref_inter = load_file(str(d / "intermediates.safetensors"))
    inter_same = set(inter) == set(ref_inter) and all(torch.equal(inter[k], ref_inter[k]) for k in ref_inter)
    ok &= inter_same
    print(f"[verify] flux_pipeline intermediates ({len(ref_inter)} tensors): {'bit-exact' if inter_same else 'MISMATCH'}")
    fresh, _, _ = build_pipeline()
    for comp in PIPE_COMPONENTS:
        wf = "model.safetensors" if comp.startswith("text_encoder") else "diffusion_pytorch_model.safetensors"
        saved = load_file(str(d / comp / wf))
        sd = getattr(fresh, comp).state_dict()
        same = all(k in sd and torch.equal(sd[k], v) for k, v in saved.items())
        ok &= same
        print(f"[verify] flux_pipeline {comp} weights ({len(saved)} tensors) vs fresh build: {'bit-exact' if same else 'MISMATCH'}")
    schedules_same = json.loads((d / "schedules.json").read_text()) == json.loads(json.dumps(pipeline_schedules()))
    ok &= schedules_same
    print(f"[verify] flux_pipeline schedules.json: {'identical' if schedules_same else 'MISMATCH'}")
    return ok


# --------------------------------------------------------------------------
# generate / verify
# --------------------------------------------------------------------------

FIXTURE_NAMES = [
    "vae_sd",
    "vae_flux",
    "flux_transformer",
    "t5_encoder",
    "clip_text",
    "flux_pipeline",
    "qwen_image_transformer",
    "qwen_vae",
    "qwen_text_encoder",
    "qwen_pipeline",
]
DIFFUSERS_MODELS = ("vae_sd", "vae_flux", "flux_transformer", "qwen_image_transformer", "qwen_vae")


def weights_file(name: str) -> str:
    return "diffusion_pytorch_model.safetensors" if name in DIFFUSERS_MODELS else "model.safetensors"


def check_versions(strict: bool):
    got = {
        "torch": torch.__version__.split("+")[0],
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
    }
    bad = {k: (got[k], v) for k, v in EXPECTED_VERSIONS.items() if got[k] != v}
    if bad:
        msg = "version mismatch (got, expected): " + ", ".join(f"{k}={g} vs {e}" for k, (g, e) in bad.items())
        if strict:
            sys.exit(msg + "  (pass --allow-version-mismatch to proceed anyway)")
        print("WARNING:", msg, file=sys.stderr)


def generate(names):
    FIXTURES.mkdir(exist_ok=True)
    results = {}
    for name in names:
        d = FIXTURES / name
        reset_dir(d)
        if name == "flux_pipeline":
            results[name] = generate_pipeline(d)
            continue
        if name == qwen_text_fixture.NAME:
            results[name] = qwen_text_fixture.generate(helpers(), d)
            continue
        if name == qwen_pipeline_fixture.NAME:
            results[name] = qwen_pipeline_fixture.generate(helpers(), d)
            continue
        model, perturbed = build_model(name)
        model.save_pretrained(str(d), safe_serialization=True)
        ins = make_inputs(name)
        outs, inter, extra = run_fixture(name, model, ins, capture=True)
        # hooks must not change anything: re-run without them
        outs2, _, _ = run_fixture(name, model, ins, capture=False)
        for k in outs:
            assert torch.equal(outs[k], outs2[k]), f"{name}: {k} differs with/without hooks"
        save_tensors(d / "inputs.safetensors", OrderedDict((k, v.contiguous()) for k, v in ins.items()))
        save_tensors(d / "outputs.safetensors", outs)
        save_tensors(d / "intermediates.safetensors", inter)
        if name == "vae_flux":
            tiling = OrderedDict(
                attributes_set=OrderedDict(VAE_FLUX_TILING),
                how="vae.tile_sample_min_size=16; vae.tile_latent_min_size=8; vae.tile_overlap_factor=0.25; "
                "vae.enable_tiling(); vae.decode(latents_tiled).sample",
                latents_input="latents_tiled",
                latents_shape=list(ins["latents_tiled"].shape),
                output="sample_tiled",
                output_shape=list(outs["sample_tiled"].shape),
                trigger="AutoencoderKL._decode calls tiled_decode when use_tiling and "
                "(z.shape[-1] > tile_latent_min_size or z.shape[-2] > tile_latent_min_size)",
                **extra["tiling_plan"],
                per_tile_decoder_outputs="intermediates.safetensors: tiled.decoder@<call_index>",
            )
            (d / "tiling.json").write_text(json.dumps(tiling, indent=2) + "\n")
        if name == "qwen_vae":
            tiling = OrderedDict(
                enable_tiling=OrderedDict(QWEN_VAE_TILING),
                how="vae.enable_tiling(tile_sample_min_height=16, tile_sample_min_width=16, "
                "tile_sample_stride_height=12, tile_sample_stride_width=12); "
                "vae.decode(latents_tiled[:, :, None]).sample[:, :, 0]",
                latents_input="latents_tiled",
                latents_shape=list(ins["latents_tiled"].shape),
                output="sample_tiled",
                output_shape=list(outs["sample_tiled"].shape),
                trigger="AutoencoderKLQwenImage._decode calls tiled_decode when use_tiling and (z.shape[-1] > "
                "tile_sample_min_width // 4 or z.shape[-2] > tile_sample_min_height // 4)",
            )
            (d / "tiling.json").write_text(json.dumps(tiling, indent=2) + "\n")
        results[name] = dict(perturbed=perturbed, extra=extra)
        print(f"[gen] {name}: " + ", ".join(f"{k}{list(v.shape)}" for k, v in outs.items()))
    write_manifest(results)


def verify(names) -> bool:
    ok = True
    for name in names:
        d = FIXTURES / name
        if name == "flux_pipeline":
            ok &= verify_pipeline(d)
            continue
        if name == qwen_text_fixture.NAME:
            ok &= qwen_text_fixture.verify(helpers(), d)
            continue
        if name == qwen_pipeline_fixture.NAME:
            ok &= qwen_pipeline_fixture.verify(helpers(), d)
            continue
        model = load_saved_model(name, d)
        ins = OrderedDict(load_file(str(d / "inputs.safetensors")))
        ref = load_file(str(d / "outputs.safetensors"))
        # inputs come back from disk; keep the same key order as generation
        ins = OrderedDict((k, ins[k]) for k in make_inputs(name).keys())
        outs, inter, _ = run_fixture(name, model, ins, capture=True)
        ref_inter = load_file(str(d / "intermediates.safetensors"))
        for k, v in ref.items():
            same = torch.equal(outs[k], v)
            ok &= same
            maxdiff = (outs[k] - v).abs().max().item()
            print(f"[verify] {name}.{k}: {'bit-exact' if same else 'MISMATCH'} (max |diff| {maxdiff:.3g})")
        inter_same = set(inter) == set(ref_inter) and all(torch.equal(inter[k], ref_inter[k]) for k in ref_inter)
        ok &= inter_same
        print(f"[verify] {name} intermediates ({len(ref_inter)} tensors): {'bit-exact' if inter_same else 'MISMATCH'}")
        # also check that a fresh in-code build reproduces the saved weights exactly
        fresh, _ = build_model(name)
        saved = load_file(str(d / weights_file(name)))
        sd = fresh.state_dict()
        w_same = all(k in sd and torch.equal(sd[k], v) for k, v in saved.items())
        ok &= w_same
        print(f"[verify] {name} weights ({len(saved)} tensors) vs fresh build: {'bit-exact' if w_same else 'MISMATCH'}")
    return ok


# --------------------------------------------------------------------------
# manifest
# --------------------------------------------------------------------------


def st_listing(path: Path) -> list[tuple[str, list[int], str]]:
    rows = []
    with safe_open(str(path), framework="pt") as f:
        for k in f.keys():
            sl = f.get_slice(k)
            rows.append((k, list(sl.get_shape()), sl.get_dtype()))
    return rows


def table(rows) -> str:
    lines = ["| tensor | shape | dtype |", "|---|---|---|"]
    for k, s, dt in rows:
        lines.append(f"| `{k}` | `{s}` | {dt} |")
    return "\n".join(lines)


def human(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1024 * 1024 else f"{n / 1024 / 1024:.2f} MiB"


FIXTURE_DOCS = {
    "vae_sd": """\
`diffusers.AutoencoderKL`, SD-family layout (`latent_channels=4`, `quant_conv` and `post_quant_conv` present).
Constructor kwargs: `{cfg}`; all other arguments are AutoencoderKL defaults (see config.json), in particular
`scaling_factor=0.18215`, `shift_factor=None`, `mid_block_add_attention=True`, `force_upcast=True` (irrelevant in f32).

**Call:** `vae.decode(latents).sample` with tiling and slicing disabled (the defaults). `latents` is the raw
decoder input: no `1/scaling_factor` or shift is applied (a pipeline would do `latents / scaling_factor` first).
Decode path: `post_quant_conv` (1x1 conv) -> `decoder` (conv_in -> mid_block[resnet, attention, resnet] ->
up_blocks.0 (64ch, 2 resnets + 2x nearest upsample + conv) -> up_blocks.1 (32ch, 2 resnets, no upsampler) ->
conv_norm_out (GroupNorm 8, eps 1e-6) -> SiLU -> conv_out). Output is 2x the latent size (one upsampler for two blocks).
""",
    "vae_flux": """\
`diffusers.AutoencoderKL`, Flux/SD3-family layout (`latent_channels=16`, no `quant_conv`, no `post_quant_conv`).
Constructor kwargs: `{cfg}`; all other arguments are AutoencoderKL defaults (see config.json).
`scaling_factor`/`shift_factor` are only stored in the config; `decode` does not use them.

**Calls:**
* `sample` = `vae.decode(latents).sample`, tiling disabled. Raw decoder input: FluxPipeline would first compute
  `latents = latents / scaling_factor + shift_factor`; that is NOT applied here.
* `sample_tiled` = `vae.decode(latents_tiled).sample` after
  `vae.tile_sample_min_size = 16; vae.tile_latent_min_size = 8; vae.tile_overlap_factor = 0.25; vae.enable_tiling()`
  (`enable_tiling()` in 0.42.1 only sets `use_tiling = True`; it takes no arguments for AutoencoderKL).
  Without these assignments the defaults would be `tile_sample_min_size = config.sample_size = 32`,
  `tile_latent_min_size = int(32 / 2**(len(block_out_channels)-1)) = 16`, `tile_overlap_factor = 0.25`,
  and a 12x12 latent would not be tiled at all.
* `sample_tiled_reference_untiled` = `vae.decode(latents_tiled).sample` with tiling disabled (same weights/latents),
  to show what tiling changes (tiling is not exact; differences are expected near seams).

**Tiled decode algorithm (diffusers 0.42.1 `AutoencoderKL.tiled_decode`)**, with the values above:
`overlap_size = int(tile_latent_min_size * (1 - overlap)) = {ov}` (latent stride),
`blend_extent = int(tile_sample_min_size * overlap) = {be}` (pixels),
`row_limit = tile_sample_min_size - blend_extent = {rl}` (pixels).
Tiles start at latent offsets `range(0, H, {ov})` x `range(0, W, {ov})` = {starts} x {starts}, each
`z[:, :, i:i+8, j:j+8]` (clipped at the border, so the last row/column of tiles is {last}x{last} latents / {lastpx}x{lastpx} px).
Each tile is decoded independently (`decoder(tile)`; `post_quant_conv` only if `config.use_post_quant_conv`).
Then, visiting tiles row-major, each tile is blended **in place** first with the tile above
(`blend_v`: for y < e, `b[y] = a[-e+y] * (1 - y/e) + b[y] * (y/e)`, `e = min(a.h, b.h, blend_extent)`), then with
the tile to the left (`blend_h`, same along x). The neighbours `a` are the already-blended, *uncropped* tiles.
Each tile is then cropped to `[:row_limit, :row_limit]` and the crops are concatenated
(row-wise along W, then along H). Output {outshape}.
The per-tile decoder outputs are in `intermediates.safetensors` as `tiled.decoder@<k>`, k = row * tile_cols + col.
The generator re-implements the stitching independently and asserts it reproduces `sample_tiled` bit for bit
({stitch}). Parameters are also in `vae_flux/tiling.json`.
""",
    "flux_transformer": """\
`diffusers.FluxTransformer2DModel`. Constructor kwargs: `{cfg}`
(`inner_dim = 2 * 16 = 32`, `out_channels = in_channels = 16`, RoPE theta 10000, `sum(axes_dims_rope) = 16 = attention_head_dim`).

**Inputs:** `latents_unpacked` [1,4,8,8] (randn) is packed exactly like `FluxPipeline._pack_latents(latents, 1, 4, 8, 8)`
into `hidden_states` [1,16,16] (a 4x4 grid of 2x2 patches; token = (row, col) row-major; channel = c*4 + dy*2 + dx).
`img_ids` = `FluxPipeline._prepare_latent_image_ids(1, 4, 4, ...)`: [16,3] rows `(0, row, col)`.
`txt_ids` = zeros [8,3] (as in `FluxPipeline.encode_prompt`).

**Call** (identical to the FluxPipeline denoising loop, 2-D ids, no batch dim on ids):
```python
model(hidden_states=hidden_states, timestep=timestep, guidance=guidance,
      pooled_projections=pooled_projections, encoder_hidden_states=encoder_hidden_states,
      txt_ids=txt_ids, img_ids=img_ids, joint_attention_kwargs=None, return_dict=False)[0]
```
**Timestep / guidance scaling:** FluxPipeline passes `timestep = t / 1000` (t is the scheduler timestep, `sigma * 1000`)
and `guidance = guidance_scale` **unscaled** (`torch.full([1], guidance_scale)`). Inside `forward` (diffusers 0.42.1)
**both** are multiplied by 1000: `timestep = timestep * 1000`, `guidance = guidance * 1000`. So here the sinusoidal
`Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)` projection sees t = 500.0 and guidance = 3500.0.
Both use the same `time_text_embed.time_proj` module (hence `time_text_embed.time_proj@0` = timestep,
`@1` = guidance in the intermediates); `temb = timestep_embedder(proj(t)) + guidance_embedder(proj(g)) + text_embedder(pooled)`.

**Block outputs:** both `FluxTransformerBlock` (double) and `FluxSingleTransformerBlock` return the tuple
`(encoder_hidden_states, hidden_states)` -- text first. So `transformer_blocks.0.0` is the text stream [1,8,32] and
`transformer_blocks.0.1` the image stream [1,16,32]; likewise `single_transformer_blocks.0.0/.1` (the single block
concatenates `[text, image]` along the sequence internally and splits again). RoPE ids are `cat([txt_ids, img_ids])`
(text first); `pos_embed.0`/`pos_embed.1` are cos/sin [24,16] (repeat-interleaved, `use_real=True`).
""",
    "qwen_image_transformer": """\
`diffusers.QwenImageTransformer2DModel`. Constructor kwargs: `{cfg}` (DDO's `qwen-tiny` config;
`inner_dim = 2 * 16 = 32`, `proj_out` width `patch_size**2 * out_channels = 16`, RoPE theta 10000,
`sum(axes_dims_rope) = 16 = attention_head_dim`; `zero_cond_t`, `use_additional_t_cond` and `use_layer3d_rope` are False,
as in Qwen-Image's own config).

**Inputs:** `latents_unpacked` [2,4,8,6] (randn) is packed exactly like `QwenImagePipeline._pack_latents(latents, 2, 4, 8, 6)`
into `hidden_states` [2,12,16] (a 4x3 grid of 2x2 patches; token = (row, col) row-major; channel = c*4 + dy*2 + dx).
`img_shapes` [1,3] = `(frames, rows, cols)` of the images of one sample, `(1, 4, 3)`; the call passes
`[[(1, 4, 3)]] * 2` as `QwenImagePipeline` does (`[[(1, height // 16, width // 16)]] * batch_size`).
`encoder_hidden_states` [2,7,32] (randn); `encoder_hidden_states_mask` [2,7] int64 (the tokenizer's attention mask):
sample 0 has 7 real tokens, sample 1 has 4 and 3 padding tokens (mask 0). `timestep` [2] = `[0.75, 0.3]` (`t / 1000`,
one per sample). Int64 inputs are also stored as float32 (`..._f32`).

**Calls** (each the `QwenImagePipeline.__call__` denoising-loop call, `guidance=None`, `return_dict=False`, `[0]`):
* `sample`: `model(hidden_states, timestep=timestep, encoder_hidden_states_mask=mask, encoder_hidden_states=...,
  img_shapes=[[(1, 4, 3)]] * 2)`; the intermediates are captured from this call.
* `sample_unmasked`: the same with `encoder_hidden_states_mask=None` (what the pipeline passes when every prompt
  fills the sequence: `encode_prompt` drops an all-ones mask); padding tokens are attended to.
* `sample_two_images`: `hidden_states_two_images` [2,16,16] (`hidden_states` followed by 4 more randn tokens) with
  `img_shapes=[[(1, 4, 3), (1, 2, 2)]] * 2` (the edit pipelines' layout: a second image in the same sequence) and the mask.

**What the model does (diffusers 0.42.1):** `timestep` is cast to the model dtype and `time_proj =
Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0, scale=1000)` computes `[cos, sin](1000 * (t * f_i))`
(the 1000 is applied *after* the product with the frequencies, in float32, unlike Flux's `timestep * 1000` first);
`temb = timestep_embedder(time_proj(t))`. The text goes through `txt_norm` (RMSNorm, eps 1e-6) then `txt_in`; the
image through `img_in`. Rotary positions (`pos_embed`, `QwenEmbedRope(theta=10000, scale_rope=True)`): image `k` of a
sample (from 0) has frame positions `k .. k + frames - 1`, row positions centred, `-(rows - rows // 2) .. rows // 2 - 1`
(here -2, -1, 0, 1), column positions likewise (-2, -1, 0); the text tokens follow at `m, m + 1, ...` on all three
axes with `m = max(rows // 2, cols // 2)` over the sample's images (here 2). Frequencies are float32,
`1 / 10000 ** (arange(0, d, 2) / d)` per axis width d, angle `position * f`, as complex numbers (`pos_embed.0`: image,
`pos_embed.1`: text, stored as `view_as_real`: [tokens, 8, 2]). Each `QwenImageTransformerBlock` modulates both streams
from `img_mod(temb)` / `txt_mod(temb)` (`SiLU` then `Linear(D, 6D)`, chunks shift, scale, gate for the attention then
the MLP), runs joint attention over `[text, image]` (per-head RMS norms `norm_q`/`norm_k`/`norm_added_q`/`norm_added_k`,
rotary embedding as complex multiplication of interleaved pairs, key mask `cat([mask, ones(image)])[:, None, None, :]`
as a boolean SDPA mask), gated residuals, gelu-tanh MLPs, and returns `(encoder_hidden_states, hidden_states)` (text
first: `transformer_blocks.0.0` is the text stream [2,7,32], `.1` the image stream [2,12,32]); its attention returns
`(image, text)` (`transformer_blocks.0.attn.0` image). Then `norm_out` (AdaLayerNormContinuous: chunks scale, shift)
and `proj_out` on the image stream only.
""",
    "qwen_vae": """\
`diffusers.AutoencoderKLQwenImage` (Qwen-Image's Wan-style VAE) at tiny widths: constructor kwargs `{cfg}` (DDO's
`qwen-tiny` VAE config, whose 4 latent channels are the `qwen-tiny` transformer's). Decoder widths
`[base_dim * dim_mult[-1]] + [base_dim * m for m in reversed(dim_mult)]` = [16, 16, 16, 8]: `conv_in` (4 -> 16), `mid_block` (resnet, single-head attention, resnet at 16), `up_blocks.0`
(2 resnets at 16, `upsample3d`: nearest-exact 2x + Conv2d 16 -> 8; its `time_conv` is never run on one frame),
`up_blocks.1` (resnets 8 -> 16 with `conv_shortcut`, 16; `upsample2d`: 2x + Conv2d 16 -> 8), `up_blocks.2` (2 resnets
at 8), `norm_out`, SiLU, `conv_out` (8 -> 3); `spatial_compression_ratio = 2 ** len(temperal_downsample) = 4`.
`config.json` and the weights are what `save_pretrained` writes, encoder, `quant_conv` and `time_conv` included.
After the perturbation of constant params, `decoder.conv_out.weight` is multiplied by 3 so that part of the decoded
image leaves [-1, 1] and the untiled decode's `clamp(-1, 1)` matters (clamped: {clamped} of `sample`'s values).

**Calls** (latents are 4-D `[B, z, H, W]` in the files; each call inserts the frame axis, `latents[:, :, None]`, and
keeps the one decoded frame, `[:, :, 0]`, as `QwenImagePipeline` does):
* `sample` = `vae.decode(latents[:, :, None]).sample[:, :, 0]` (batch 1, tiling off); the intermediates are captured
  from this call (5-D, one frame: `[1, C, 1, h, w]`). `sample_batch2` likewise from `latents_batch2`.
* `pipeline_denormalized` / `pipeline_image`: `QwenImagePipeline.__call__`'s decode of `pipeline_latents` (as if
  unpacked from the transformer): `latents_mean = tensor(config.latents_mean).view(1, z, 1, 1, 1)`,
  `latents_std = 1.0 / tensor(config.latents_std).view(1, z, 1, 1, 1)` (float32, then the latents' dtype),
  `latents = latents / latents_std + latents_mean` (so `latents * std + mean`, divided by the reciprocal), then
  `vae.decode(latents, return_dict=False)[0][:, :, 0]`.
* `sample_tiled` = `vae.decode(latents_tiled[:, :, None]).sample[:, :, 0]` after
  `vae.enable_tiling(tile_sample_min_height=16, tile_sample_min_width=16, tile_sample_stride_height=12,
  tile_sample_stride_width=12)`; `sample_tiled_reference_untiled` is the same latents untiled (also what Diffusers'
  default tiles, 256 px every 192, give: checked). Parameters in `tiling.json`.

**What decode does (diffusers 0.42.1 `autoencoder_kl_qwenimage.py`):** `post_quant_conv` (a 1x1x1 causal conv) on
the 5-D latents, then `_decode`'s frame loop: one decoder call per latent frame with a feature cache made by
`clear_cache()` (all `None`), then `clamp(-1, 1)`. With one frame the first call is all there is: every
`QwenImageCausalConv3d` pads `(2 * padding)` frames in front with zeros (its cache entry is `None`), so a 3x3x3 kernel
meets data with its last temporal slice only; `upsample3d` finds its cache entry `None`, stores `"Rep"` and skips
`time_conv`. `QwenImageRMS_norm` is `F.normalize(x, dim=1) * sqrt(C) * gamma` (`x / max(||x||_2, 1e-12)` over
channels; `bias=False`, so `+ 0.0`; inputs in 16-bit floats are normalised in float32). The resnet is `h =
conv_shortcut(x)`, `norm1`, SiLU, `conv1`, `norm2`, SiLU, (dropout), `conv2`, `+ h`; the attention block normalises,
runs the 1x1 `to_qkv`, reshapes to `[B, 1, 3C, hw]`, permutes to `[B, 1, hw, 3C]`, `chunk(3, -1)` into q, k, v, one
SDPA head of width C (scale `1/sqrt(C)`), then the 1x1 `proj` and the residual. `QwenImageUpsample` is nearest-exact
2x in float32 (for a factor of 2 the same pixels as nearest). The generator checks this reading against Diffusers
(`qwen_vae_single_frame`: each causal conv a Conv2d with `weight[:, :, -1]`, no time_conv): max |diff| {single}.

**Tiled decode** (`tiled_decode`, used when `use_tiling` and a latent side exceeds `tile_sample_min // 4`):
latent tiles `z[:, :, k:k+1, i:i+4, j:j+4]` every `tile_sample_stride // 4 = 3` latents, each `post_quant_conv` +
decoder with a fresh cache (no clamp: `tiled_decode` returns before `_decode`'s clamp). Then row-major, each decoded
tile is blended in place with the (already blended, uncropped) tile above (`blend_v`) and to its left (`blend_h`) over
`blend = tile_sample_min - tile_sample_stride = 4` px (`b[y] = a[-e + y] * (1 - y / e) + b[y] * (y / e)`, `e = min(a,
b, blend)`), cropped to `[:12, :12]` (the sample stride), the crops concatenated along W then H, and the result
cropped to `[:H * 4, :W * 4]`: here 3 x 3 tiles of a 7x9 latent, output [1, 3, 28, 36].
""",
    "t5_encoder": """\
`transformers.T5EncoderModel(T5Config(**kwargs))` with kwargs `{cfg}`
(`gated-gelu` => `dense_act_fn = "gelu_new"` (tanh approximation) and `is_gated_act = True`; see config.json).

**Call:** `model(input_ids=input_ids).last_hidden_state`, no `attention_mask` (FluxPipeline's `_get_t5_prompt_embeds`
also passes only input ids). `input_ids` contains ids, then `</s>` (1), then padding (0); padding is attended to
because no mask is given. Notes for the port: T5 attention has **no** `1/sqrt(d_kv)` scaling; the relative position
bias is computed only in `encoder.block.0` (`has_relative_attention_bias=True`), and that bias tensor [1,4,12,12] is
reused by every later block (it is `encoder.block.<n>.1` in the intermediates, the second element of each block's output
tuple); RMS-style T5LayerNorm (no mean subtraction, no bias); no embedding scaling; `encoder.dropout` runs twice
(after the embedding and after `final_layer_norm`; identity in eval) hence `encoder.dropout@0/@1`.

**Weight names:** `shared` and `encoder.embed_tokens` are two `nn.Embedding` modules sharing one Parameter
(`_tied_weights_keys`); save_pretrained in transformers 5.24.0 writes only `shared.weight`. Checkpoints written by
other versions may also contain `encoder.embed_tokens.weight` (from_pretrained accepts both; checked). A Rust loader
should take `shared.weight` and fall back to `encoder.embed_tokens.weight`. Only block 0 has
`...SelfAttention.relative_attention_bias.weight` [num_buckets, num_heads].
""",
    "clip_text": """\
`transformers.CLIPTextModel(CLIPTextConfig(**kwargs))` with kwargs `{cfg}`.

**Call:** `out = model(input_ids=input_ids)` (no attention_mask, as the SD / Flux pipelines call it);
outputs `out.last_hidden_state` (after `final_layer_norm`) and `out.pooler_output`.
A causal mask is always applied. `input_ids` = bos(98), 4 tokens, eos(99), then padding with eos (99), like the
CLIP tokenizer used by SD/Flux (pad token = `<|endoftext|>`).

**Pooling rule (transformers 5.24.0, `CLIPTextModel.forward`):**
* if `config.eos_token_id == 2` (legacy configs written before transformers PR #24773): pooled token index =
  `input_ids.to(int).argmax(-1)` (position of the highest token id, first one on ties);
* otherwise (this fixture: `eos_token_id = 99`): index = `(input_ids == eos_token_id).int().argmax(-1)`, i.e. the
  **first** occurrence of the eos id.
Here both rules give index {pool} (argmax rule: {argmax}); `pooler_output == last_hidden_state[:, {pool}]` exactly.
Real checkpoints matter here: a text encoder config whose `eos_token_id` is 2 must use the argmax rule.

**Weight / module names:** in transformers 5.24.0 `CLIPTextModel` has `embeddings`, `encoder`, `final_layer_norm`
as direct children (there is no `text_model` wrapper module any more), and save_pretrained writes keys **without**
a `text_model.` prefix (`embeddings.token_embedding.weight`, `encoder.layers.0.self_attn.q_proj.weight`, ...).
Checkpoints written by transformers 4.x (e.g. the `text_encoder` of SD / Flux repos) use `text_model.`-prefixed keys;
from_pretrained in 5.24.0 loads those too (checked by re-prefixing this fixture's file). A Rust loader should
accept both. Intermediates are named after the 5.24.0 module paths (`encoder.layers.0`, not
`text_model.encoder.layers.0`). The attention module returns `(attn_output, attn_weights=None)`, hence
`encoder.layers.<n>.self_attn.0`.
""",
}


def previous_sections() -> dict:
    """The per-fixture sections of the current MANIFEST.md, by fixture name (text up to the next section)."""
    path = FIXTURES / "MANIFEST.md"
    if not path.exists():
        return {}
    text = path.read_text()
    sections = {}
    starts = [(m.start(), m.group(1)) for m in re.finditer(r"^## `([a-z0-9_]+)`$", text, flags=re.M)]
    for i, (start, name) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(text)
        sections[name] = text[start:end].rstrip("\n") + "\n"
    return sections


def pipeline_manifest_section(d: Path, result: dict) -> str:
    extra = result.get("extra", {})
    seed = SEEDS["flux_pipeline"]
    lines = [f"## `flux_pipeline`\n"]
    lines.append(
        f"Seeds: component k of {PIPE_COMPONENTS} is built after `torch.manual_seed({seed} + k)` and its constant "
        f"parameters perturbed with seed `{seed} + k + 7`; inputs from `torch.Generator().manual_seed({seed + 100})`.\n"
    )
    lines.append(
        f"""A whole `diffusers.FluxPipeline`, saved with `pipe.save_pretrained(dir, safe_serialization=True)` (a Diffusers
pipeline folder: `model_index.json`, `scheduler/`, `text_encoder/`, `text_encoder_2/`, `tokenizer/`, `tokenizer_2/`,
`transformer/`, `vae/`). The components reuse the tiny configs of the other fixtures, made consistent with each other:

* `text_encoder`: `CLIPTextModel(CLIPTextConfig(**CLIP_CONFIG))` (as `clip_text`; hidden size 32);
* `text_encoder_2`: `T5EncoderModel(T5Config(**T5_CONFIG))` (as `t5_encoder`; d_model 32);
* `transformer`: `FluxTransformer2DModel(**{json.dumps(PIPE_FLUX_CONFIG)})` (`flux_transformer`'s config with
  `pooled_projection_dim` = CLIP's hidden size; `joint_attention_dim` = T5's d_model; `in_channels` = 4 x the VAE's
  latent channels);
* `vae`: `AutoencoderKL(**{json.dumps(PIPE_VAE_CONFIG)})` (Flux layout at half `vae_sd`'s widths), so
  `vae_scale_factor` = 2;
* `scheduler`: `FlowMatchEulerDiscreteScheduler(**{json.dumps(PIPE_SCHEDULER_CONFIG)})` (FLUX.1-dev's
  scheduler config);
* `tokenizer`: `CLIPTokenizer(vocab.json, merges.txt, model_max_length=16)` over a 100-id byte-level BPE made in code
  (letters, letters + `</w>`, a few merges, punctuation, fillers, `<|startoftext|>` 98, `<|endoftext|>` 99 =
  CLIP_CONFIG's bos/eos). `tokenizer/` holds the `tokenizer.json` transformers 5 writes *and* the `vocab.json` +
  `merges.txt` it was built from (the layout FLUX.1-dev ships);
* `tokenizer_2`: `T5TokenizerFast` over a 100-piece Unigram model made in code (`<pad>` 0, `</s>` 1, `<unk>` 2,
  Metaspace pre-tokenizer, `$A </s>` template), saved as `tokenizer.json`.

**Call:** `pipe(prompt_embeds=prompt_embeds, pooled_prompt_embeds=pooled_prompt_embeds, latents=latents,
height={PIPE_CALL['height']}, width={PIPE_CALL['width']}, num_inference_steps={PIPE_CALL['num_inference_steps']},
guidance_scale={PIPE_CALL['guidance_scale']}, output_type="latent")` gives `latents` (packed, after the loop); the same
call with `output_type="pt"` gives `image_pt` (post-processed: `(image / 2 + 0.5).clamp(0, 1)`). `image` is the decode
FluxPipeline runs after the loop, spelled out: `_unpack_latents(latents, {PIPE_CALL['height']}, {PIPE_CALL['width']}, 2)`,
then `latents / scaling_factor + shift_factor`, then `vae.decode(...)[0]` (NCHW, about [-1, 1]); the generator checks
that post-processing it gives `image_pt` bit for bit.

What the pipeline does in between (diffusers 0.42.1 `pipeline_flux.py`): `sigmas = np.linspace(1.0, 1 / n, n)`;
`mu = calculate_shift(image_seq_len, 256, 4096, 0.5, 1.15)` with `image_seq_len = latents.shape[1]`
(= {extra.get('image_seq_len', '?')} here, so mu = {extra.get('mu', '?')!r}); `scheduler.set_timesteps(sigmas=sigmas, mu=mu)`:
sigmas cast to float32 and shifted with `exp(mu) / (exp(mu) + (1 / sigma - 1))` (NumPy float32 arithmetic: Python
scalars are weak under NumPy 2), `timesteps = sigmas * 1000`, a final sigma 0 appended. Each step calls the
transformer with `timestep = t / 1000`, `guidance = [3.5]` (float32; `guidance_embeds=True`), `txt_ids` zeros,
`img_ids` = `_prepare_latent_image_ids(1, lh / 2, lw / 2)`, and takes the Euler step
`latents = latents + (sigma_next - sigma) * noise_pred` (float32). Timesteps of the steps: {extra.get('step_timesteps', '?')}.

**From text** (`prompt.json`: prompt {PIPE_PROMPT!r}, `max_sequence_length` {PIPE_MAX_SEQUENCE_LENGTH}):
`text_clip_input_ids` = `pipe.tokenizer(prompt, padding="max_length", max_length=16, truncation=True)` and
`text_t5_input_ids` = `pipe.tokenizer_2(prompt, padding="max_length", max_length={PIPE_MAX_SEQUENCE_LENGTH}, truncation=True)`
(the calls `_get_clip_prompt_embeds` / `_get_t5_prompt_embeds` make; both truncate here), `text_prompt_embeds` and
`text_pooled_prompt_embeds` from `pipe.encode_prompt(prompt, max_sequence_length={PIPE_MAX_SEQUENCE_LENGTH})` (T5
`last_hidden_state`, CLIP `pooler_output`), and `text_latents` from the same call as `latents` but with `prompt=`
instead of the embeddings. Ids are stored as int64 and as float32 (`..._f32`).

`noise` is the unpacked initial noise `[1, 4, 16, 12]`; `latents` (input) is it packed by `_pack_latents`.
`schedules.json` holds FluxPipeline's timesteps and sigmas for several `(image_seq_len, steps)` pairs
({PIPE_SCHEDULES}), computed through `calculate_shift` and `retrieve_timesteps` exactly as above, and one fixed-shift
schedule (`shift=3.0`, `use_dynamic_shifting=False`, `set_timesteps(28)`: NumPy float64 arithmetic there).
"""
    )
    lines.append("**Inputs** (`inputs.safetensors`):\n\n" + table(st_listing(d / "inputs.safetensors")) + "\n")
    lines.append("**Outputs** (`outputs.safetensors`):\n\n" + table(st_listing(d / "outputs.safetensors")) + "\n")
    lines.append(
        "**Intermediates** (`intermediates.safetensors`; latents after each step come from `callback_on_step_end`):\n\n"
        + table(st_listing(d / "intermediates.safetensors"))
        + "\n"
    )
    files = sorted(p for p in d.rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    lines.append(
        "**Files:** "
        + ", ".join(f"`{p.relative_to(d)}` ({human(p.stat().st_size)})" for p in files)
        + f"; {human(total)} in all. Parameters perturbed because constant after init: "
        + f"{len(result.get('perturbed', []))}.\n"
    )
    return "\n".join(lines)


def helpers():
    """The helpers fixtures written in their own modules (`qwen_text_fixture.py`, `qwen_pipeline_fixture.py`) use."""
    from types import SimpleNamespace

    return SimpleNamespace(
        Capture=Capture,
        f32c=f32c,
        perturb_constant_params=perturb_constant_params,
        save_tensors=save_tensors,
        load_saved_model=load_saved_model,
        FIXTURES=FIXTURES,
        st_listing=st_listing,
        table=table,
        human=human,
    )


def write_manifest(results: dict):
    try:
        cpu = platform.processor() or platform.machine()
    except Exception:
        cpu = "?"
    parts = []
    parts.append("# Reference fixtures\n")
    parts.append(
        "Generated by `tools/gen_fixtures.py` (see `tools/README.md`). Do not edit by hand; regenerate instead.\n"
    )
    parts.append("## Environment\n")
    parts.append(
        "\n".join(
            [
                f"* torch `{torch.__version__}` (CPU execution, float32, `torch.get_num_threads()` = {torch.get_num_threads()})",
                f"* diffusers `{diffusers.__version__}`",
                f"* transformers `{transformers.__version__}`",
                f"* safetensors `{safetensors.__version__}`",
                f"* numpy `{np.__version__}`",
                f"* Python `{platform.python_version()}` on `{platform.system()} {platform.machine()}`",
            ]
        )
        + "\n"
    )
    parts.append(
        """## Conventions

* Every model is constructed from a config in code (no downloads) after `torch.manual_seed(<seed>)`, cast to float32,
  put in `eval()` mode and run under `torch.no_grad()` on CPU.
* After the library's own weight initialisation, every parameter whose elements are all equal (norm weights = 1,
  zero biases, ...) gets `N(0, 0.1)` noise added (seeded), so that dropped affine terms or swapped weight/bias are
  detectable. The saved weight file is the source of truth; the Rust side should load it, not re-create weights.
* `config.json` and the weight file are written by the model's own `save_pretrained(dir, safe_serialization=True)`:
  `diffusion_pytorch_model.safetensors` for Diffusers models, `model.safetensors` for Transformers models.
* `inputs.safetensors` / `outputs.safetensors`: all float32 and contiguous, except token ids, which are stored both as
  int64 (`input_ids`) and float32 (`input_ids_f32`).
* `intermediates.safetensors`: outputs of submodules captured with forward hooks (float32), named by module path
  (`named_modules()` names; a ModuleList index does not count as a level). Submodules up to depth 3 (VAEs, T5, CLIP)
  or 2 (Flux, Qwen-Image) are captured. Tuple outputs get `.0`, `.1`, ... (None entries skipped); dict/ModelOutput
  outputs get `.<key>`; a module that runs several times in one call gets `@<k>` (call order, from 0) on every call;
  a complex output is stored as `torch.view_as_real` (a last dim of 2: real, imaginary).
  Modules that did not run (e.g. the VAE encoder during decode, dropout in some paths) are absent.
* Outputs are bit-exact reproducible on the generating machine (`--verify` reloads the saved weights with
  `from_pretrained`, copies them into freshly allocated storage, re-runs, and compares with `torch.equal`).
  Bit-exactness is fragile even within PyTorch: running `flux_transformer` straight from `from_pretrained`
  (parameters left as unaligned views of the safetensors buffer) differs by up to 3e-7 because CPU GEMM kernels
  take another path. On other CPUs / in Rust, compare with a tolerance (e.g. max abs diff around 1e-5..1e-4).
"""
    )
    previous = previous_sections()
    for name in FIXTURE_NAMES:
        d = FIXTURES / name
        if not d.exists():
            continue
        if name not in results and name in previous:
            # Not regenerated this time (`--only`): keep its section as it was.
            parts.append(previous[name])
            continue
        if name == "flux_pipeline":
            parts.append(pipeline_manifest_section(d, results.get(name, {})))
            continue
        if name == qwen_text_fixture.NAME:
            parts.append(qwen_text_fixture.manifest_section(helpers(), d, results.get(name, {})))
            continue
        if name == qwen_pipeline_fixture.NAME:
            parts.append(qwen_pipeline_fixture.manifest_section(helpers(), d, results.get(name, {})))
            continue
        extra = results.get(name, {}).get("extra", {})
        cfg = {
            "vae_sd": VAE_SD_CONFIG,
            "vae_flux": VAE_FLUX_CONFIG,
            "flux_transformer": FLUX_CONFIG,
            "t5_encoder": T5_CONFIG,
            "clip_text": CLIP_CONFIG,
            "qwen_image_transformer": QWEN_CONFIG,
            "qwen_vae": QWEN_VAE_CONFIG,
        }[name]
        fmt = dict(cfg=json.dumps(cfg))
        if name == "vae_flux" and "tiling_plan" in extra:
            p = extra["tiling_plan"]
            starts = [t["latent_x0"] for t in p["tiles"] if t["row"] == 0]
            last = p["tiles"][-1]["latent_w"]
            outshape = list(load_file(str(d / "outputs.safetensors"))["sample_tiled"].shape)
            fmt.update(
                ov=p["overlap_size_latent"],
                be=p["blend_extent_pixels"],
                rl=p["row_limit_pixels"],
                starts=starts,
                last=last,
                lastpx=last * 2,
                outshape=outshape,
                stitch=extra.get("stitch_selfcheck", "?"),
            )
        if name == "qwen_vae":
            fmt.update(
                single=f"{extra.get('single_frame_max_abs_diff', float('nan')):.3g}",
                clamped=f"{100 * extra.get('clamped', float('nan')):.1f} %",
            )
        if name == "clip_text":
            fmt.update(pool=extra.get("pool_index", "?"), argmax=extra.get("argmax_rule_index", "?"))
        parts.append(f"## `{name}`\n")
        parts.append(f"Seed: `torch.manual_seed({SEEDS[name]})` before construction; inputs from "
                     f"`torch.Generator().manual_seed({SEEDS[name] + 100})`.\n")
        parts.append(FIXTURE_DOCS[name].format(**fmt))
        cfg_json = json.loads((d / "config.json").read_text())
        parts.append("**config.json** (as written by save_pretrained):\n\n```json\n" + json.dumps(cfg_json, indent=2) + "\n```\n")
        parts.append("**Inputs** (`inputs.safetensors`):\n\n" + table(st_listing(d / "inputs.safetensors")) + "\n")
        parts.append("**Outputs** (`outputs.safetensors`):\n\n" + table(st_listing(d / "outputs.safetensors")) + "\n")
        perturbed = results.get(name, {}).get("perturbed", [])
        files = sorted(p for p in d.iterdir() if p.is_file())
        parts.append(
            "**Files:** "
            + ", ".join(f"`{p.name}` ({human(p.stat().st_size)})" for p in files)
            + f". Parameters perturbed because constant after init: {len(perturbed)}.\n"
        )
        inter = st_listing(d / "intermediates.safetensors")
        parts.append(
            f"<details><summary>Intermediates ({len(inter)} tensors)</summary>\n\n" + table(inter) + "\n\n</details>\n"
        )
        w = st_listing(d / weights_file(name))
        parts.append(
            f"<details><summary>Weights `{weights_file(name)}` ({len(w)} tensors)</summary>\n\n" + table(w) + "\n\n</details>\n"
        )
    (FIXTURES / "MANIFEST.md").write_text("\n".join(parts))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--verify", action="store_true", help="reload fixtures from disk and check bit-exact reproduction")
    ap.add_argument(
        "--only",
        nargs="*",
        choices=FIXTURE_NAMES,
        help="restrict generation (other fixtures and their MANIFEST.md sections are kept) or --verify to these",
    )
    ap.add_argument("--allow-version-mismatch", action="store_true")
    args = ap.parse_args()
    names = args.only or FIXTURE_NAMES
    torch.use_deterministic_algorithms(True)
    check_versions(strict=not args.allow_version_mismatch)
    if args.verify:
        ok = verify(names)
        print("VERIFY", "OK" if ok else "FAILED")
        sys.exit(0 if ok else 1)
    # With --only, only the named fixtures are rewritten; MANIFEST.md keeps the other sections as they were.
    generate(names)


if __name__ == "__main__":
    main()
