//! Prompt tokenization from a pipeline folder's tokenizer files, with the `tokenizers`
//! crate (the library transformers' fast tokenizers run on), padded and truncated as
//! FluxPipeline asks: CLIP to the tokenizer's `model_max_length` (77 for CLIP-L), T5 to
//! `max_sequence_length`, both `padding="max_length", truncation=True`.
//!
//! - `tokenizer/`: `tokenizer.json` when present; otherwise `vocab.json` + `merges.txt` (how
//!   FLUX.1-dev ships it), assembled into the tokenizer transformers 5 builds from them:
//!   NFC, whitespace runs to one space, lower case; CLIP's split pattern, byte-level; BPE with
//!   `</w>` word ends and `<|endoftext|>` as the unknown token; `<|startoftext|>` … `<|endoftext|>`
//!   around the pieces.
//! - `tokenizer_2/`: `tokenizer.json` (a `spiece.model` alone is not read).
//!
//! The pad token is `tokenizer_config.json`'s `pad_token` (CLIP: `<|endoftext|>`, T5: `<pad>`).
//! Without these folders the run falls back to `ddo_nn::tokenizer`'s documented stand-in.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use tokenizers::{
    PaddingDirection, PaddingParams, PaddingStrategy, Tokenizer, TruncationDirection,
    TruncationParams, TruncationStrategy,
};

use crate::error::{CliError, CliResult};

/// CLIP's split pattern as transformers 5 writes it for a CLIP tokenizer built from
/// `vocab.json` + `merges.txt`.
const CLIP_SPLIT: &str =
    r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+";

/// One tokenizer with its padding id and length limit.
pub struct FileTokenizer {
    /// Set to each call's length in place: a copy per call would copy the vocabulary and
    /// allocate a fresh BPE cache (about 0.8 MB) for every prompt, which a long-lived
    /// server's heap would feel, and the words it has split would be forgotten.
    tokenizer: std::sync::Mutex<Tokenizer>,
    pad_id: u32,
    pad_token: String,
    /// `model_max_length` of `tokenizer_config.json`, when sensible.
    pub model_max_length: Option<usize>,
    /// What was read.
    pub source: PathBuf,
}

impl std::fmt::Debug for FileTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FileTokenizer")
            .field("source", &self.source)
            .field("pad_id", &self.pad_id)
            .finish()
    }
}

/// The two tokenizers of a Flux pipeline folder.
#[derive(Debug)]
pub struct PipelineTokenizers {
    /// CLIP (`tokenizer/`).
    pub clip: FileTokenizer,
    /// T5 (`tokenizer_2/`).
    pub t5: FileTokenizer,
}

fn bad(path: &Path, message: impl std::fmt::Display) -> CliError {
    CliError::runtime(
        format!("cannot load the tokenizer {}: {message}", path.display()),
        "re-export it with transformers' save_pretrained, or pass --prompt-embeds",
    )
}

fn read_json(path: &Path) -> CliResult<Value> {
    let text = ddo_nn::read_text_file(path).map_err(|e| bad(path, e))?;
    serde_json::from_str(&text).map_err(|e| bad(path, e))
}

/// `tokenizer_config.json`'s `key` as a token string (plain, or `{"content": ...}`).
fn config_token(config: &Value, key: &str) -> Option<String> {
    match &config[key] {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// The CLIP tokenizer transformers 5 builds from `vocab.json` + `merges.txt`.
fn clip_from_vocab_merges(dir: &Path) -> CliResult<Tokenizer> {
    let vocab_path = dir.join("vocab.json");
    let vocab = read_json(&vocab_path)?;
    let merges_path = dir.join("merges.txt");
    let merges_text = ddo_nn::read_text_file(&merges_path).map_err(|e| bad(&merges_path, e))?;
    let merges: Vec<Value> = merges_text
        .lines()
        .filter(|l| !l.starts_with("#version") && !l.trim().is_empty())
        .filter_map(|l| l.split_once(' '))
        .map(|(a, b)| json!([a, b]))
        .collect();
    let id = |token: &str| {
        vocab[token]
            .as_u64()
            .ok_or_else(|| bad(&vocab_path, format!("no `{token}` in the vocabulary")))
    };
    let (bos, eos) = (id("<|startoftext|>")?, id("<|endoftext|>")?);
    let special = |id: u64, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false,
               "rstrip": false, "normalized": false, "special": true})
    };
    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(bos, "<|startoftext|>"), special(eos, "<|endoftext|>")],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "NFC"},
            {"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "},
            {"type": "Lowercase"}
        ]},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": CLIP_SPLIT}, "behavior": "Removed", "invert": true},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}
        ]},
        "post_processor": {"type": "RobertaProcessing",
            "sep": ["<|endoftext|>", eos], "cls": ["<|startoftext|>", bos],
            "trim_offsets": false, "add_prefix_space": false},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<|endoftext|>",
            "continuing_subword_prefix": "", "end_of_word_suffix": "</w>", "fuse_unk": false,
            "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merges}
    });
    spec.to_string()
        .parse::<Tokenizer>()
        .map_err(|e| bad(dir, e))
}

impl FileTokenizer {
    fn load(dir: &Path, kind: &str, default_pad: &str) -> CliResult<Self> {
        let json_file = dir.join("tokenizer.json");
        let (tokenizer, source) = if json_file.is_file() {
            (
                ddo_nn::read_text_file(&json_file)
                    .map_err(|e| bad(&json_file, e))
                    .and_then(|text| text.parse::<Tokenizer>().map_err(|e| bad(&json_file, e)))?,
                json_file,
            )
        } else if kind == "clip"
            && dir.join("vocab.json").is_file()
            && dir.join("merges.txt").is_file()
        {
            (clip_from_vocab_merges(dir)?, dir.join("vocab.json"))
        } else {
            let what = if kind == "clip" {
                "tokenizer.json, or vocab.json + merges.txt"
            } else {
                "tokenizer.json (a spiece.model alone is not read)"
            };
            return Err(CliError::runtime(
                format!("{} has no {what}", dir.display()),
                "re-export the tokenizer with transformers' save_pretrained, or pass --prompt-embeds",
            ));
        };
        let config_file = dir.join("tokenizer_config.json");
        let config = if config_file.is_file() {
            read_json(&config_file)?
        } else {
            Value::Null
        };
        let pad_token =
            config_token(&config, "pad_token").unwrap_or_else(|| default_pad.to_string());
        let pad_id = tokenizer.token_to_id(&pad_token).ok_or_else(|| {
            bad(
                dir,
                format!("the pad token `{pad_token}` is not in the vocabulary"),
            )
        })?;
        let model_max_length = config["model_max_length"]
            .as_u64()
            .filter(|&n| n > 0 && n < 1 << 20)
            .map(|n| n as usize);
        Ok(Self {
            tokenizer: std::sync::Mutex::new(tokenizer),
            pad_id,
            pad_token,
            model_max_length,
            source,
        })
    }

    /// Ids of `text` with special tokens, truncated and padded to `max_length`
    /// (`padding="max_length", truncation=True`).
    pub fn encode(&self, text: &str, max_length: usize) -> CliResult<Vec<u32>> {
        // A panic while it was held left nothing half-set that the next call does not set.
        let mut t = self
            .tokenizer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        t.with_truncation(Some(TruncationParams {
            max_length,
            strategy: TruncationStrategy::LongestFirst,
            stride: 0,
            direction: TruncationDirection::Right,
        }))
        .map_err(|e| bad(&self.source, e))?;
        t.with_padding(Some(PaddingParams {
            strategy: PaddingStrategy::Fixed(max_length),
            direction: PaddingDirection::Right,
            pad_to_multiple_of: None,
            pad_id: self.pad_id,
            pad_type_id: 0,
            pad_token: self.pad_token.clone(),
        }));
        let encoding = t.encode(text, true).map_err(|e| bad(&self.source, e))?;
        Ok(encoding.get_ids().to_vec())
    }
}

impl PipelineTokenizers {
    /// The tokenizers of pipeline folder `dir`; `None` when it has no `tokenizer/` or no
    /// `tokenizer_2/` folder (the caller falls back to the stand-in); an error when a folder
    /// is there but cannot be read.
    pub fn load(dir: &Path) -> CliResult<Option<Self>> {
        let (a, b) = (dir.join("tokenizer"), dir.join("tokenizer_2"));
        if !a.is_dir() || !b.is_dir() {
            return Ok(None);
        }
        Ok(Some(Self {
            clip: FileTokenizer::load(&a, "clip", "<|endoftext|>")?,
            t5: FileTokenizer::load(&b, "t5", "<pad>")?,
        }))
    }

    /// FluxPipeline's ids for `prompt`: CLIP padded to its `model_max_length` (else
    /// `clip_positions`), T5 to `max_sequence_length`.
    pub fn encode(
        &self,
        prompt: &str,
        clip_positions: usize,
        max_sequence_length: usize,
    ) -> CliResult<(Vec<u32>, Vec<u32>)> {
        let clip_len = self.clip.model_max_length.unwrap_or(clip_positions);
        Ok((
            self.clip.encode(prompt, clip_len)?,
            self.t5.encode(prompt, max_sequence_length)?,
        ))
    }
}
