"""The `qwen_text_encoder` fixture of `tools/gen_fixtures.py`: Qwen-Image's text encoder at tiny widths.

A tiny random `Qwen2_5_VLForConditionalGeneration` (the class `QwenImagePipeline` loads as its `text_encoder`, vision
tower and `lm_head` included, so a loader has to skip them as it must in a real folder), a tiny byte-level BPE Qwen
tokenizer made in code whose vocabulary holds every word of the pipeline's prompt template (the template's system
part then tokenizes to 34 tokens, as it does with the real tokenizer, so the pipeline's hard-coded
`prompt_template_encode_start_idx = 34` drops exactly the system part here too), and the references:

* the text encoder's call as `QwenImagePipeline._get_qwen_prompt_embeds` makes it (two templated prompts of
  different lengths, padded by the tokenizer, `output_hidden_states=True`), with per-layer intermediates;
* `QwenImagePipeline.encode_prompt` for the two prompts, for the first alone, and with a short
  `max_sequence_length`.

Run through `gen_fixtures.py --only qwen_text_encoder` (and `--verify --only qwen_text_encoder`); the helpers of
`gen_fixtures.py` it needs come in as `h`.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import pre_tokenizers
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline

NAME = "qwen_text_encoder"
SEED = 1008

# Words made single tokens by the tiny BPE (byte-level, a leading space as `Ġ`): every word of the prompt template
# (so its system part is 34 tokens, as with Qwen's own vocabulary) and a few prompt words. Other words fall apart
# into shorter pieces and single bytes, as rare words do with the real vocabulary.
WORDS = [
    "system", "user", "assistant", "Describe", " the", " image", " by", " detailing", " color", " shape", " size",
    " texture", " quantity", " text", " spatial", " relationships", " of", " objects", " and", " background",
    " a", " red", " on", " at", " in", " sea", " light", " house", " fox", " snow", " with", " small", " boat",
]  # fmt: skip
# Qwen2.5-VL's special tokens the template and the VL config use, after the BPE vocabulary (as Qwen's are, from
# 151643 on): `<|endoftext|>` is the pad token, `<|im_end|>` the end of a turn.
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>"]  # fmt: skip
# The model's vocabulary is padded past the tokenizer's, as Qwen2.5-VL's (152064 rows for 151665 tokens).
VOCAB_ROWS = 416

# DDO's `qwen-text-tiny`: Qwen2.5-VL's text layout (GQA with 2 query heads per kv head, q/k/v biases, SwiGLU,
# RMSNorm eps 1e-6, rope theta 1e6, an mrope section per axis) at width 32.
TEXT_CONFIG = dict(
    vocab_size=VOCAB_ROWS,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1000000.0},
    pad_token_id=None,
)
# A vision tower as small as the class allows (patch 2, one block): present in the checkpoint, never run.
VISION_CONFIG = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    out_hidden_size=32,
    patch_size=2,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=8,
    fullatt_block_indexes=[0],
)

PROMPTS = [
    "A red fox in the snow",
    "A lighthouse at dawn on a rocky coast, with gulls and a small boat. Caf\u00e9!",
]
SHORT_MAX_SEQUENCE_LENGTH = 8


def byte_chars() -> dict[int, str]:
    """The byte-level alphabet: printable Latin-1 bytes stand for themselves, the others for code points from 256."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    assert set(out.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    return out


def bpe_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The 256 byte symbols, then each word of WORDS built left to right by one merge per character."""
    chars = byte_chars()
    vocab = {chars[b]: b for b in range(256)}
    merges: list[tuple[str, str]] = []
    for word in WORDS:
        symbols = "".join(chars[b] for b in word.encode())
        current = symbols[0]
        for ch in symbols[1:]:
            if (current, ch) not in merges:
                merges.append((current, ch))
            current += ch
            vocab.setdefault(current, len(vocab))
    return vocab, merges


def write_slow_tokenizer(d: Path):
    """`vocab.json`, `merges.txt` and a `tokenizer_config.json` with the special tokens in `added_tokens_decoder`."""
    vocab, merges = bpe_vocab_and_merges()
    d.mkdir(parents=True)
    (d / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False) + "\n")
    (d / "merges.txt").write_text("#version: 0.2\n" + "\n".join(f"{a} {b}" for a, b in merges) + "\n")
    added = OrderedDict(
        (
            str(len(vocab) + i),
            dict(content=t, lstrip=False, normalized=False, rstrip=False, single_word=False, special=True),
        )
        for i, t in enumerate(SPECIAL)
    )
    config = OrderedDict(
        add_prefix_space=False,
        added_tokens_decoder=added,
        additional_special_tokens=SPECIAL[1:],
        bos_token=None,
        clean_up_tokenization_spaces=False,
        eos_token="<|im_end|>",
        errors="replace",
        model_max_length=131072,
        pad_token="<|endoftext|>",
        split_special_tokens=False,
        tokenizer_class="Qwen2Tokenizer",
        unk_token=None,
    )
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def special_ids() -> dict[str, int]:
    base = len(bpe_vocab_and_merges()[0])
    return {t: base + i for i, t in enumerate(SPECIAL)}


def build_model(h):
    ids = special_ids()
    torch.manual_seed(SEED)
    config = Qwen2_5_VLConfig(
        text_config=dict(TEXT_CONFIG, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"]),
        vision_config=VISION_CONFIG,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval()
    perturbed = h.perturb_constant_params(model, SEED + 7)
    return model, perturbed


def load_model(d: Path):
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(d / "text_encoder"), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
        for b in model.buffers():
            b.data = b.data.clone()
    return model.eval()


def pipeline(model, tokenizer) -> QwenImagePipeline:
    """`QwenImagePipeline` with only what prompt encoding uses (no VAE, no transformer)."""
    return QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=model, tokenizer=tokenizer,
        transformer=None,
    )  # fmt: skip


CAPTURED = ["embed_tokens", "rotary_emb", "norm"]
CAPTURED_PER_LAYER = ["", ".input_layernorm", ".self_attn", ".post_attention_layernorm", ".mlp"]


def captured_modules(model) -> set[str]:
    base = "model.language_model"
    names = {f"{base}.{m}" for m in CAPTURED}
    for i in range(model.config.text_config.num_hidden_layers):
        names |= {f"{base}.layers.{i}{m}" for m in CAPTURED_PER_LAYER}
    return names


def run(h, model, tokenizer, capture: bool):
    """(inputs, outputs, intermediates) of the fixture's calls."""
    pipe = pipeline(model, tokenizer)
    template, drop = pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx
    ins: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    outs: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    inter: "OrderedDict[str, torch.Tensor]" = OrderedDict()
    with torch.no_grad():
        # The tokenizer call and the text encoder call of `_get_qwen_prompt_embeds`, spelled out.
        tokens = tokenizer(
            [template.format(p) for p in PROMPTS],
            max_length=pipe.tokenizer_max_length + drop,
            padding=True,
            truncation=True,
            return_tensors="pt",
        )
        ins["input_ids"] = tokens.input_ids
        ins["input_ids_f32"] = tokens.input_ids.to(torch.float32)
        ins["attention_mask"] = tokens.attention_mask
        ins["attention_mask_f32"] = tokens.attention_mask.to(torch.float32)
        cap = h.Capture(model, 99, only=captured_modules(model)) if capture else None
        out = model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True)
        if cap:
            cap.remove()
            inter.update(cap.tensors())
        for i, hs in enumerate(out.hidden_states):
            outs[f"hidden_states.{i}"] = h.f32c(hs)
        outs["last_hidden_state"] = h.f32c(out.hidden_states[-1])

        embeds, mask = pipe.encode_prompt(PROMPTS, device=torch.device("cpu"))
        outs["prompt_embeds"] = h.f32c(embeds)
        outs["prompt_embeds_mask"] = mask
        outs["prompt_embeds_mask_f32"] = mask.to(torch.float32)
        one, one_mask = pipe.encode_prompt(PROMPTS[:1], device=torch.device("cpu"))
        assert one_mask is None, "a single prompt's mask is all ones, which encode_prompt drops"
        outs["prompt_embeds_first"] = h.f32c(one)
        short, short_mask = pipe.encode_prompt(
            PROMPTS, device=torch.device("cpu"), max_sequence_length=SHORT_MAX_SEQUENCE_LENGTH
        )
        assert short_mask is None, "both prompts fill the short length"
        outs["prompt_embeds_short"] = h.f32c(short)
    return ins, outs, inter


def checks(tokenizer, tokenizer_json, ins, outs):
    """What the fixture relies on, asserted at generation and verification."""
    ids = special_ids()
    template = pipeline(None, tokenizer).prompt_template_encode
    prefix = tokenizer(template.split("{}")[0]).input_ids
    assert len(prefix) == 34, f"the template's system part is {len(prefix)} tokens, not 34"
    assert prefix[0] == ids["<|im_start|>"]
    for p in PROMPTS:
        text = template.format(p)
        assert tokenizer(text).input_ids == tokenizer_json(text).input_ids, "tokenizer.json and vocab+merges agree"
    mask = ins["attention_mask"]
    assert mask[0].sum() < mask.shape[1] and bool(mask[1].all()), "the first prompt is padded, the second is not"
    assert torch.equal(outs["hidden_states.2"], outs["last_hidden_state"])
    valid = [int(m.sum()) - 34 for m in mask]
    assert list(outs["prompt_embeds"].shape[:2]) == [2, max(valid)]
    for b, n in enumerate(valid):
        full = outs["last_hidden_state"][b][mask[b].bool()][34:]
        assert torch.equal(outs["prompt_embeds"][b, :n], full)
        assert bool((outs["prompt_embeds"][b, n:] == 0).all())


def generate(h, d: Path) -> dict:
    model, perturbed = build_model(h)
    model.save_pretrained(str(d / "text_encoder"), safe_serialization=True)
    write_slow_tokenizer(d / "tokenizer")
    tokenizer = Qwen2Tokenizer.from_pretrained(str(d / "tokenizer"))
    tokenizer.save_pretrained(str(d / "tokenizer_json"))
    tokenizer_json = Qwen2Tokenizer.from_pretrained(str(d / "tokenizer_json"))
    ins, outs, inter = run(h, model, tokenizer, capture=True)
    _, outs2, _ = run(h, model, tokenizer, capture=False)
    for k in outs:
        assert torch.equal(outs[k], outs2[k]), f"{NAME}: {k} differs with/without hooks"
    checks(tokenizer, tokenizer_json, ins, outs)
    h.save_tensors(d / "inputs.safetensors", ins)
    h.save_tensors(d / "outputs.safetensors", outs)
    h.save_tensors(d / "intermediates.safetensors", inter)
    template = pipeline(None, tokenizer)
    prompts = OrderedDict(
        prompts=PROMPTS,
        prompt_template_encode=template.prompt_template_encode,
        prompt_template_encode_start_idx=template.prompt_template_encode_start_idx,
        tokenizer_max_length=template.tokenizer_max_length,
        encode_prompt_max_sequence_length=1024,
        short_max_sequence_length=SHORT_MAX_SEQUENCE_LENGTH,
        tokens=[tokenizer.convert_ids_to_tokens(row[row_mask.bool()]) for row, row_mask in
                zip(ins["input_ids"], ins["attention_mask"])],
    )  # fmt: skip
    (d / "prompts.json").write_text(json.dumps(prompts, indent=2, ensure_ascii=False) + "\n")
    print(f"[gen] {NAME}: " + ", ".join(f"{k}{list(v.shape)}" for k, v in outs.items()))
    return dict(perturbed=perturbed)


def verify(h, d: Path) -> bool:
    model = load_model(d)
    tokenizer = Qwen2Tokenizer.from_pretrained(str(d / "tokenizer"))
    tokenizer_json = Qwen2Tokenizer.from_pretrained(str(d / "tokenizer_json"))
    ins, outs, inter = run(h, model, tokenizer, capture=True)
    checks(tokenizer, tokenizer_json, ins, outs)
    ok = True
    for file, mine in [("inputs", ins), ("outputs", outs), ("intermediates", inter)]:
        ref = load_file(str(d / f"{file}.safetensors"))
        same = set(ref) == set(mine) and all(torch.equal(mine[k], ref[k]) for k in ref)
        ok &= same
        print(f"[verify] {NAME} {file} ({len(ref)} tensors): {'bit-exact' if same else 'MISMATCH'}")
    fresh, _ = build_model(h)
    saved = load_file(str(d / "text_encoder" / "model.safetensors"))
    sd = fresh.state_dict()
    legacy = {k.replace("model.language_model.", "model.").replace("model.visual.", "visual."): v for k, v in sd.items()}
    w_same = all(k in legacy and torch.equal(legacy[k], v) for k, v in saved.items())
    ok &= w_same
    print(f"[verify] {NAME} weights ({len(saved)} tensors) vs fresh build: {'bit-exact' if w_same else 'MISMATCH'}")
    return ok


DOC = """\
Qwen-Image's text encoder, `transformers.Qwen2_5_VLForConditionalGeneration` (the class `QwenImagePipeline` loads as
`text_encoder`), at tiny widths, with a tiny Qwen tokenizer and `QwenImagePipeline.encode_prompt` references.

* `text_encoder/`: the model's `save_pretrained` folder (`config.json`, `model.safetensors`). Constructor:
  `Qwen2_5_VLConfig(text_config={text}, vision_config={vision}, image_token_id, video_token_id,
  vision_start_token_id, vision_end_token_id` = the tokenizer's ids below, `tie_word_embeddings=False)`. The text
  config is DDO's `qwen-text-tiny` (hidden 32, 2 layers, 4 heads of 8, 2 kv heads: GQA groups of 2, SwiGLU width 64,
  RMSNorm eps 1e-6, rope theta 1e6, `mrope_section` [1, 1, 2]). transformers 5.24 writes the weights under the
  legacy names (`model.embed_tokens.weight`, `model.layers.<i>...`, `model.norm.weight`, `visual.<...>`,
  `lm_head.weight`), the names of the published Qwen2.5-VL checkpoints; its modules are
  `model.language_model.<...>` (the intermediates' names). The vision tower (`visual.*`, one block, patch 2) and the
  untied `lm_head` are in the file and take no part in prompt encoding.
* `tokenizer/`: a byte-level BPE as `vocab.json` + `merges.txt` ({vocab} entries: the 256 byte symbols, then the
  words {words} built by one merge per character, {merges} merges) and a `tokenizer_config.json` whose
  `added_tokens_decoder` holds the special tokens {special} (ids {special_ids}; pad `<|endoftext|>`, eos
  `<|im_end|>`, `tokenizer_class` `Qwen2Tokenizer`). Every word of the pipeline's template is one token, so the
  template's system part, `<|im_start|>system\\nDescribe ... background:<|im_end|>\\n<|im_start|>user\\n`, is 34
  tokens, as with Qwen's own vocabulary, and `prompt_template_encode_start_idx = 34` drops exactly it. The model's
  embedding has {rows} rows (padded past the tokenizer, as Qwen2.5-VL's 152064 for 151665 tokens).
* `tokenizer_json/`: the same tokenizer loaded by `Qwen2Tokenizer.from_pretrained(tokenizer/)` and saved again by
  transformers 5.24 (`tokenizer.json`: NFC, Qwen's split pattern `Isolated`, byte-level without its own regex, BPE
  without unknown token, the added tokens; `tokenizer_config.json`). The generator asserts both give the same ids.

**Text encoder call** (`inputs.safetensors`, `outputs.safetensors`, `intermediates.safetensors`): exactly the calls
of `QwenImagePipeline._get_qwen_prompt_embeds` (diffusers 0.42.1) for the prompts {prompts}:
`tokenizer([template.format(p) for p in prompts], max_length=1024 + 34, padding=True, truncation=True)` gives
`input_ids` / `attention_mask` [2, {seq}] (the first prompt padded on the right with `<|endoftext|>`, mask 0; the
second fills the sequence), then `text_encoder(input_ids=..., attention_mask=..., output_hidden_states=True)`.
`hidden_states.<i>` are its `hidden_states` (0: the embeddings, i: after decoder layer i - 1, the last one replaced
by the final norm's output, which transformers 5 does), `last_hidden_state` = `hidden_states[-1]`, the state the
pipeline takes. Padded positions are included (their rows attend to the real tokens before them).
What transformers 5.24 runs for text-only input: no image grid, so `compute_3d_position_ids` returns None and the
text model uses `arange(L)` on all three rotary axes, whatever the padding; `recomposition_frequencies` then takes the
`mrope_section` chunks of the three axes' identical frequencies, which is plain 1-D RoPE (rotate-half layout,
`inv_freq = 1 / theta ** (arange(0, d, 2) / d)` in float32, angle `position * inv_freq`). The causal mask with the
padding keys masked is built by `create_causal_mask` (SDPA, boolean); q/k/v projections have biases, o_proj none;
k/v heads are repeated to the query heads (`repeat_kv`: kv head j serves query heads 2j, 2j + 1); scale `head_dim ** -0.5`.
Intermediates: the language model's `embed_tokens`, `rotary_emb` (`.0` cos, `.1` sin, [2, {seq}, 8] after the
mrope recomposition: `cat(freqs, freqs)` of the rotate-half layout), each decoder layer (`layers.<i>`) and its `input_layernorm`, `self_attn` (`.0`: after `o_proj`),
`post_attention_layernorm`, `mlp`, and `norm`, under `model.language_model.`.

**Prompt encoding** (`outputs.safetensors`): `prompt_embeds` [2, {embeds}] and `prompt_embeds_mask` [2, {embeds_len}]
(int64 and `_f32`) = `pipe.encode_prompt(prompts)` with `pipe = QwenImagePipeline(scheduler, vae=None,
text_encoder, tokenizer, transformer=None)`: each prompt's real tokens of `last_hidden_state` (selected by the
tokenizer's mask), its first 34 (the template's system part) dropped, zero-padded to the longest, mask 1 on the
kept tokens; cut to `max_sequence_length` (1024 by default for `encode_prompt`; the pipeline's `__call__` passes
512). `prompt_embeds_first` = `encode_prompt(prompts[:1])` (mask all ones, so `encode_prompt` returns None for it),
`prompt_embeds_short` = `encode_prompt(prompts, max_sequence_length={short})` (both cut to {short}: mask None).
`prompts.json` holds the prompts, the template, the drop index and each sequence's tokens.
"""


def manifest_section(h, d: Path, result: dict) -> str:
    vocab, merges = bpe_vocab_and_merges()
    ins = load_file(str(d / "inputs.safetensors"))
    outs = load_file(str(d / "outputs.safetensors"))
    parts = [f"## `{NAME}`\n"]
    parts.append(
        f"Seed: `torch.manual_seed({SEED})` before construction, constant parameters perturbed with seed "
        f"`{SEED + 7}`; no random inputs (the ids come from the tokenizer).\n"
    )
    parts.append(
        DOC.format(
            text=json.dumps(TEXT_CONFIG),
            vision=json.dumps(VISION_CONFIG),
            vocab=len(vocab),
            words=", ".join(f"`{w}`" for w in WORDS),
            merges=len(merges),
            special=", ".join(f"`{t}`" for t in SPECIAL),
            special_ids=f"{len(vocab)}..{len(vocab) + len(SPECIAL) - 1}",
            rows=VOCAB_ROWS,
            prompts=json.dumps(PROMPTS, ensure_ascii=False),
            seq=ins["input_ids"].shape[1],
            embeds=", ".join(str(s) for s in outs["prompt_embeds"].shape[1:]),
            embeds_len=outs["prompt_embeds"].shape[1],
            short=SHORT_MAX_SEQUENCE_LENGTH,
        )
    )
    cfg_json = json.loads((d / "text_encoder" / "config.json").read_text())
    parts.append(
        "**text_encoder/config.json** (as written by save_pretrained):\n\n```json\n"
        + json.dumps(cfg_json, indent=2)
        + "\n```\n"
    )
    parts.append("**Inputs** (`inputs.safetensors`):\n\n" + h.table(h.st_listing(d / "inputs.safetensors")) + "\n")
    parts.append("**Outputs** (`outputs.safetensors`):\n\n" + h.table(h.st_listing(d / "outputs.safetensors")) + "\n")
    files = sorted(p for p in d.rglob("*") if p.is_file())
    total = sum(p.stat().st_size for p in files)
    parts.append(
        "**Files:** "
        + ", ".join(f"`{p.relative_to(d)}` ({h.human(p.stat().st_size)})" for p in files)
        + f"; {h.human(total)} in all. Parameters perturbed because constant after init: "
        + f"{len(result.get('perturbed', []))}.\n"
    )
    inter = h.st_listing(d / "intermediates.safetensors")
    parts.append(
        f"<details><summary>Intermediates ({len(inter)} tensors)</summary>\n\n" + h.table(inter) + "\n\n</details>\n"
    )
    w = h.st_listing(d / "text_encoder" / "model.safetensors")
    parts.append(
        f"<details><summary>Weights `text_encoder/model.safetensors` ({len(w)} tensors)</summary>\n\n"
        + h.table(w)
        + "\n\n</details>\n"
    )
    return "\n".join(parts)
