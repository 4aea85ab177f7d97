//! [`QwenPromptEncoder`]: Diffusers' `QwenImagePipeline.encode_prompt` (diffusers 0.42.1) —
//! the prompt template, the Qwen tokenizer, the text encoder, the template tokens dropped,
//! and the per-prompt embeddings zero-padded to the longest with their mask.
//!
//! `_get_qwen_prompt_embeds` formats each prompt into [`PROMPT_TEMPLATE`], tokenizes the batch
//! with `max_length = 1024 + 34`, `padding=True, truncation=True`, runs the text encoder
//! with the tokenizer's attention mask and takes `hidden_states[-1]` (the last hidden state,
//! after the final norm). Each prompt's real tokens (mask 1) are taken in order, the first
//! [`PROMPT_TEMPLATE_START_IDX`] (the template's system part) dropped, and the rest stacked,
//! zero-padded to the longest, with a mask of ones on them. `encode_prompt` then cuts both to
//! `max_sequence_length` and drops the mask when it is all ones.

use std::path::Path;

use ddo_core::{CoreError, DType, Device, Result, Tensor};

use super::{QwenTextEncoder, QwenTextInputs, QwenTokenizer};
use crate::error::LoadResult;

/// `QwenImagePipeline.prompt_template_encode`; the prompt replaces `{}`.
pub const PROMPT_TEMPLATE: &str = "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n";

/// `QwenImagePipeline.prompt_template_encode_start_idx`: the template tokens dropped from the
/// front of every prompt's states (the system part, 34 tokens with Qwen's tokenizer).
pub const PROMPT_TEMPLATE_START_IDX: usize = 34;

/// `QwenImagePipeline.tokenizer_max_length`: prompt tokens kept by the tokenizer (after the
/// dropped template tokens, which come on top).
pub const TOKENIZER_MAX_LENGTH: usize = 1024;

/// The `max_sequence_length` of `QwenImagePipeline.__call__` (its `encode_prompt` defaults to
/// 1024, the limit `check_inputs` enforces).
pub const DEFAULT_MAX_SEQUENCE_LENGTH: usize = 512;

/// The largest `max_sequence_length` the pipeline accepts.
pub const MAX_SEQUENCE_LENGTH_LIMIT: usize = 1024;

/// Prompt embeddings as `encode_prompt` returns them (one image per prompt).
#[derive(Debug, Clone)]
pub struct QwenPromptEmbeds {
    /// `[prompts, seq, hidden]` on the device, in the encoder's dtype: each prompt's kept
    /// tokens, then zeros.
    pub prompt_embeds: Tensor,
    /// `prompts × seq` flags (true on kept tokens), row-major; `None` when every flag is true,
    /// as `encode_prompt` returns then (the transformer's `encoder_hidden_states_mask`).
    pub prompt_embeds_mask: Option<Vec<bool>>,
    /// Kept tokens of each prompt (its true flags).
    pub lengths: Vec<usize>,
}

/// The text side of a Qwen-Image pipeline: the encoder and its tokenizer.
#[derive(Debug, Clone)]
pub struct QwenPromptEncoder {
    encoder: QwenTextEncoder,
    tokenizer: QwenTokenizer,
}

/// The template around `prompt` (Python's `template.format(prompt)`).
pub fn templated(prompt: &str) -> String {
    PROMPT_TEMPLATE.replacen("{}", prompt, 1)
}

/// The runs of consecutive 1s of one mask row: `(start, len)`.
fn runs(mask: &[u32]) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for (i, &m) in mask.iter().enumerate() {
        if m == 0 {
            continue;
        }
        match out.last_mut() {
            Some((start, len)) if *start + *len == i => *len += 1,
            _ => out.push((i, 1)),
        }
    }
    out
}

impl QwenPromptEncoder {
    /// The encoder with its tokenizer.
    pub fn new(encoder: QwenTextEncoder, tokenizer: QwenTokenizer) -> Self {
        Self { encoder, tokenizer }
    }

    /// Loads a pipeline folder's `text_encoder/` ([`QwenTextEncoder::load`] with `dtype`)
    /// and `tokenizer/` ([`QwenTokenizer::from_dir`]: a missing folder or file is a typed
    /// error naming it).
    pub fn load(pipeline_dir: &Path, dtype: Option<DType>) -> LoadResult<Self> {
        let tokenizer = QwenTokenizer::from_dir(&pipeline_dir.join("tokenizer"))?;
        let encoder = QwenTextEncoder::load(&pipeline_dir.join("text_encoder"), dtype)?;
        Ok(Self::new(encoder, tokenizer))
    }

    /// The text encoder.
    pub fn encoder(&self) -> &QwenTextEncoder {
        &self.encoder
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &QwenTokenizer {
        &self.tokenizer
    }

    /// The tokenizer call of `_get_qwen_prompt_embeds`: each prompt in the template,
    /// `max_length = 1024 + 34`, padded to the longest.
    pub fn tokenize(&self, prompts: &[&str]) -> Result<QwenTextInputs> {
        let texts: Vec<String> = prompts.iter().map(|p| templated(p)).collect();
        self.tokenizer
            .encode_batch(&texts, TOKENIZER_MAX_LENGTH + PROMPT_TEMPLATE_START_IDX)
    }

    /// `encode_prompt(prompts, max_sequence_length=max_sequence_length)` with one image per
    /// prompt, run on `device` through the encoder's attached route (if any).
    pub fn encode_prompt(
        &self,
        device: &dyn Device,
        prompts: &[&str],
        max_sequence_length: usize,
    ) -> Result<QwenPromptEmbeds> {
        if prompts.is_empty() {
            return Err(CoreError::InvalidOption {
                option: "prompt".into(),
                value: "[]".into(),
                hint: "give at least one prompt".into(),
            });
        }
        if !(1..=MAX_SEQUENCE_LENGTH_LIMIT).contains(&max_sequence_length) {
            return Err(CoreError::InvalidOption {
                option: "max_sequence_length".into(),
                value: max_sequence_length.to_string(),
                hint: format!(
                    "must be between 1 and {MAX_SEQUENCE_LENGTH_LIMIT} (QwenImagePipeline's limit)"
                ),
            });
        }
        let inputs = self.tokenize(prompts)?;
        let hidden = self.encoder.forward(device, &inputs)?;
        split_prompt_states(device, &inputs, &hidden, max_sequence_length)
    }
}

/// The rest of `encode_prompt` after the text encoder: `_extract_masked_hidden`, the dropped
/// template tokens ([`PROMPT_TEMPLATE_START_IDX`]), the zero padding and the cut to
/// `max_sequence_length`, over the encoder's `hidden [batch, seq, d]` for `inputs` (the
/// tokenizer's ids and mask), on `device`.
pub fn split_prompt_states(
    device: &dyn Device,
    inputs: &QwenTextInputs,
    hidden: &Tensor,
    max_sequence_length: usize,
) -> Result<QwenPromptEmbeds> {
    let ops = ddo_core::ops_of(device)?;
    let (batch, len) = (inputs.batch, inputs.seq_len());
    let d = hidden.shape().get(2).copied().unwrap_or(0);
    let all = vec![1u32; batch * len];
    let mask = inputs.attention_mask.as_deref().unwrap_or(&all);
    // Each row's kept positions, as runs: its real tokens after the first 34.
    let kept: Vec<Vec<(usize, usize)>> = mask
        .chunks(len.max(1))
        .map(|row| {
            let mut skip = PROMPT_TEMPLATE_START_IDX;
            let mut out = Vec::new();
            for (start, n) in runs(row) {
                let dropped = skip.min(n);
                skip -= dropped;
                if n > dropped {
                    out.push((start + dropped, n - dropped));
                }
            }
            out
        })
        .collect();
    let full: Vec<usize> = kept
        .iter()
        .map(|r| r.iter().map(|&(_, n)| n).sum())
        .collect();
    let seq = full
        .iter()
        .copied()
        .max()
        .unwrap_or(0)
        .min(max_sequence_length);
    if seq == 0 {
        return Err(CoreError::InvalidOption {
            option: "prompt".into(),
            value: format!("{len} tokens"),
            hint: format!(
                "no token is left after the {PROMPT_TEMPLATE_START_IDX} template tokens: the \
                     tokenizer does not produce the pipeline's template"
            ),
        });
    }
    let mut rows = Vec::with_capacity(batch);
    let mut lengths = Vec::with_capacity(batch);
    for (b, runs) in kept.iter().enumerate() {
        let row = ops.narrow(hidden, 0, b, 1)?;
        let mut parts = Vec::new();
        let mut left = seq;
        for &(start, n) in runs {
            let take = n.min(left);
            if take == 0 {
                break;
            }
            parts.push(ops.narrow(&row, 1, start, take)?);
            left -= take;
        }
        lengths.push(seq - left);
        if left > 0 {
            parts.push(ops.tensor_from_f32(&[1, left, d], hidden.dtype(), &vec![0.0; left * d])?);
        }
        let refs: Vec<&Tensor> = parts.iter().collect();
        rows.push(match refs.as_slice() {
            [one] => (*one).clone(),
            _ => ops.concat(&refs, 1)?,
        });
    }
    let refs: Vec<&Tensor> = rows.iter().collect();
    let prompt_embeds = match refs.as_slice() {
        [one] => (*one).clone(),
        _ => ops.concat(&refs, 0)?,
    };
    let flags: Vec<bool> = lengths
        .iter()
        .flat_map(|&n| (0..seq).map(move |j| j < n))
        .collect();
    Ok(QwenPromptEmbeds {
        prompt_embeds,
        prompt_embeds_mask: (!flags.iter().all(|&f| f)).then_some(flags),
        lengths,
    })
}
