//! [`QwenTokenizer`]: the Qwen2 tokenizer of a pipeline's `tokenizer/` folder, on the
//! `tokenizers` crate (the library transformers' tokenizers run on).
//!
//! - `tokenizer.json` when the folder has one (what transformers 5 writes);
//! - otherwise `vocab.json` + `merges.txt`, with the added tokens of `tokenizer_config.json`
//!   (`added_tokens_decoder`, else `added_tokens.json`), assembled into the tokenizer
//!   transformers 5.24's `Qwen2Tokenizer` builds from them: NFC; Qwen's split pattern,
//!   `Isolated`; byte-level (no prefix space, no regex of its own); BPE without an unknown
//!   token, word suffix or byte fallback; no template (no BOS or EOS added); the special tokens
//!   the config names (`eos_token`, `pad_token`, ...) added as special tokens.
//!
//! The pad token and side are `tokenizer_config.json`'s `pad_token` (Qwen: `<|endoftext|>`)
//! and `padding_side` (`right` unless it says `left`). [`QwenTokenizer::encode_batch`] is
//! `tokenizer(texts, max_length=..., padding=True, truncation=True)`: each text cut to
//! `max_length` tokens, then all padded to the longest.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ddo_core::{CoreError, Result};
use serde_json::{Value, json};
use tokenizers::{
    PostProcessor, Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy,
};

use super::inputs::QwenTextInputs;
use crate::error::{LoadError, LoadResult};
use crate::weights::read_text_file;

/// Qwen2's pre-tokenizer split pattern (transformers' `PRETOKENIZE_REGEX`).
pub const QWEN_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pad token when the config names none (`Qwen2Tokenizer`'s default).
pub const DEFAULT_PAD_TOKEN: &str = "<|endoftext|>";

/// The Qwen tokenizer of a folder, with its pad id and side.
#[derive(Clone)]
pub struct QwenTokenizer {
    tokenizer: Tokenizer,
    pad_id: u32,
    pad_left: bool,
    source: PathBuf,
}

impl std::fmt::Debug for QwenTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QwenTokenizer")
            .field("source", &self.source)
            .field("pad_id", &self.pad_id)
            .field("pad_left", &self.pad_left)
            .finish()
    }
}

fn bad(path: &Path, message: impl std::fmt::Display) -> LoadError {
    LoadError::Tokenizer {
        path: path.to_path_buf(),
        message: message.to_string(),
    }
}

fn read_json(path: &Path) -> LoadResult<Value> {
    let text = read_text_file(path)?;
    serde_json::from_str(&text).map_err(|e| bad(path, format!("not JSON: {e}")))
}

/// A token of `tokenizer_config.json`: a string, or `{"content": ...}`.
fn token_text(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// `added_tokens_decoder` (id → token object), else `added_tokens.json` (token → id), as
/// the `added_tokens` entries of a `tokenizer.json`, by id.
fn added_tokens(
    dir: &Path,
    config: &Value,
    config_path: &Path,
) -> LoadResult<BTreeMap<u64, Value>> {
    let mut out = BTreeMap::new();
    if let Some(decoder) = config
        .get("added_tokens_decoder")
        .and_then(Value::as_object)
    {
        for (id, token) in decoder {
            let id: u64 = id.parse().map_err(|_| {
                bad(
                    config_path,
                    format!("added token id `{id}` is not a number"),
                )
            })?;
            let content = token_text(token)
                .ok_or_else(|| bad(config_path, format!("added token {id} has no content")))?;
            let flag = |key: &str, default: bool| {
                token.get(key).and_then(Value::as_bool).unwrap_or(default)
            };
            let special = flag("special", true);
            out.insert(
                id,
                json!({"id": id, "content": content, "single_word": flag("single_word", false),
                       "lstrip": flag("lstrip", false), "rstrip": flag("rstrip", false),
                       "normalized": flag("normalized", !special), "special": special}),
            );
        }
        return Ok(out);
    }
    let path = dir.join("added_tokens.json");
    if path.is_file() {
        let map = read_json(&path)?;
        let map = map
            .as_object()
            .ok_or_else(|| bad(&path, "not an object of token -> id"))?;
        for (content, id) in map {
            let id = id
                .as_u64()
                .ok_or_else(|| bad(&path, format!("the id of `{content}` is not a number")))?;
            out.insert(
                id,
                json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": false, "special": true}),
            );
        }
    }
    Ok(out)
}

/// The tokens `tokenizer_config.json` names as special (`eos_token`, `pad_token`, ...,
/// `additional_special_tokens` / `extra_special_tokens`).
fn special_tokens(config: &Value) -> Vec<String> {
    let mut out: Vec<String> = ["bos_token", "eos_token", "unk_token", "pad_token"]
        .iter()
        .filter_map(|k| config.get(*k).and_then(token_text))
        .collect();
    for key in ["additional_special_tokens", "extra_special_tokens"] {
        if let Some(list) = config.get(key).and_then(Value::as_array) {
            out.extend(list.iter().filter_map(token_text));
        }
    }
    out
}

/// The tokenizer transformers 5.24's `Qwen2Tokenizer` builds from `vocab.json` and
/// `merges.txt` (see the module docs).
fn from_vocab_merges(dir: &Path, config: &Value, config_path: &Path) -> LoadResult<Tokenizer> {
    let vocab_path = dir.join("vocab.json");
    let vocab = read_json(&vocab_path)?;
    let entries = vocab
        .as_object()
        .ok_or_else(|| bad(&vocab_path, "not an object of token -> id"))?;
    let mut next_id = 0u64;
    for (token, id) in entries {
        let id = id
            .as_u64()
            .ok_or_else(|| bad(&vocab_path, format!("the id of `{token}` is not a number")))?;
        next_id = next_id.max(id + 1);
    }
    let merges_path = dir.join("merges.txt");
    let merges: Vec<Value> = read_text_file(&merges_path)?
        .lines()
        .filter(|l| !l.starts_with("#version") && !l.trim().is_empty())
        .map(|l| {
            l.split_once(' ')
                .map(|(a, b)| json!([a, b]))
                .ok_or_else(|| bad(&merges_path, format!("`{l}` is not a pair of symbols")))
        })
        .collect::<LoadResult<_>>()?;

    let mut added = added_tokens(dir, config, config_path)?;
    if let Some(last) = added.keys().next_back() {
        next_id = next_id.max(last + 1);
    }
    // `self.add_tokens([AddedToken(t, special=True) for t in self.all_special_tokens])`:
    // a special token the added tokens lack keeps its vocabulary id, or gets the next one.
    for token in special_tokens(config) {
        if added.values().any(|t| t["content"] == token.as_str()) {
            continue;
        }
        let id = match entries.get(&token).and_then(Value::as_u64) {
            Some(id) => id,
            None => {
                next_id += 1;
                next_id - 1
            }
        };
        added.insert(
            id,
            json!({"id": id, "content": token, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true}),
        );
    }
    let add_prefix_space = config
        .get("add_prefix_space")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added.into_values().collect::<Vec<_>>(),
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN_SPLIT}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": true,
             "use_regex": false}
        ]},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges}
    });
    spec.to_string()
        .parse::<Tokenizer>()
        .map_err(|e| bad(&vocab_path, e))
}

impl QwenTokenizer {
    /// The tokenizer of folder `dir` (a pipeline's `tokenizer/`): a missing folder or one
    /// with neither `tokenizer.json` nor `vocab.json` + `merges.txt` is
    /// [`LoadError::NoTokenizer`] naming it; unreadable or invalid files are
    /// [`LoadError::Tokenizer`] (or [`LoadError::Io`]) naming the file.
    pub fn from_dir(dir: &Path) -> LoadResult<Self> {
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.is_file() {
            read_json(&config_path)?
        } else {
            Value::Null
        };
        let json_path = dir.join("tokenizer.json");
        let (mut tokenizer, source) = if json_path.is_file() {
            let text = read_text_file(&json_path)?;
            let tokenizer = text.parse::<Tokenizer>().map_err(|e| bad(&json_path, e))?;
            (tokenizer, json_path)
        } else if dir.join("vocab.json").is_file() && dir.join("merges.txt").is_file() {
            (
                from_vocab_merges(dir, &config, &config_path)?,
                dir.join("vocab.json"),
            )
        } else {
            return Err(LoadError::NoTokenizer {
                dir: dir.to_path_buf(),
                expected: "tokenizer.json, or vocab.json + merges.txt".into(),
            });
        };
        // Padding and truncation are the call's (`encode_batch`), not the file's.
        tokenizer.with_padding(None);
        tokenizer
            .with_truncation(None)
            .map_err(|e| bad(&source, e))?;
        let pad_token = config
            .get("pad_token")
            .and_then(token_text)
            .unwrap_or_else(|| DEFAULT_PAD_TOKEN.to_string());
        let pad_id = tokenizer.token_to_id(&pad_token).ok_or_else(|| {
            bad(
                &source,
                format!("the pad token `{pad_token}` is not in the vocabulary"),
            )
        })?;
        let pad_left = match config.get("padding_side").and_then(Value::as_str) {
            None | Some("right") => false,
            Some("left") => true,
            Some(other) => {
                return Err(bad(
                    &config_path,
                    format!("padding_side `{other}` is neither `right` nor `left`"),
                ));
            }
        };
        Ok(Self {
            tokenizer,
            pad_id,
            pad_left,
            source,
        })
    }

    /// The file the tokenizer was read from (`tokenizer.json` or `vocab.json`).
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// The pad token's id.
    pub fn pad_id(&self) -> u32 {
        self.pad_id
    }

    /// The id of `token` (a special token such as `<|im_start|>`, or a vocabulary entry).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// The ids of `text`, cut to `max_length` (transformers' default right truncation),
    /// without padding.
    pub fn encode(&self, text: &str, max_length: usize) -> Result<Vec<u32>> {
        let refused = |e: tokenizers::Error| CoreError::InvalidOption {
            option: "prompt".into(),
            value: format!("{} characters", text.chars().count()),
            hint: format!(
                "the tokenizer {} cannot encode it: {e}",
                self.source.display()
            ),
        };
        let adds_tokens = self
            .tokenizer
            .get_post_processor()
            .is_some_and(|p| p.added_tokens(false) > 0);
        if !adds_tokens {
            // Qwen's tokenizers add no special tokens around the text: truncation is a cut
            // of the encoding (without cloning the vocabulary for a truncating tokenizer).
            let mut encoding = self.tokenizer.encode(text, true).map_err(refused)?;
            encoding.truncate(max_length, 0, TruncationDirection::Right);
            return Ok(encoding.get_ids().to_vec());
        }
        // A template that adds tokens: the tokenizer truncates with room for them.
        let mut t = self.tokenizer.clone();
        t.with_truncation(Some(TruncationParams {
            max_length,
            strategy: TruncationStrategy::LongestFirst,
            stride: 0,
            direction: TruncationDirection::Right,
        }))
        .map_err(refused)?;
        Ok(t.encode(text, true).map_err(refused)?.get_ids().to_vec())
    }

    /// `tokenizer(texts, max_length=max_length, padding=True, truncation=True)`: every text
    /// cut to `max_length` tokens, the rows padded to the longest with the pad id (on the
    /// configured side), the mask (always given, as transformers returns it) 1 on tokens and
    /// 0 on padding.
    pub fn encode_batch(&self, texts: &[String], max_length: usize) -> Result<QwenTextInputs> {
        let rows: Vec<Vec<u32>> = texts
            .iter()
            .map(|t| self.encode(t, max_length))
            .collect::<Result<_>>()?;
        let len = rows.iter().map(Vec::len).max().unwrap_or(0);
        let mut ids = Vec::with_capacity(rows.len() * len);
        let mut mask = Vec::with_capacity(rows.len() * len);
        for row in &rows {
            let pad = len - row.len();
            let (ids_pad, mask_pad) = (vec![self.pad_id; pad], vec![0u32; pad]);
            if self.pad_left {
                ids.extend(&ids_pad);
                mask.extend(&mask_pad);
            }
            ids.extend(row);
            mask.extend(std::iter::repeat_n(1u32, row.len()));
            if !self.pad_left {
                ids.extend(&ids_pad);
                mask.extend(&mask_pad);
            }
        }
        Ok(QwenTextInputs::new(ids, Some(mask), rows.len()))
    }
}
