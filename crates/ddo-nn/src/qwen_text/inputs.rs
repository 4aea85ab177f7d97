//! [`QwenTextInputs`]: a batch of token id rows with Transformers' `attention_mask`, as the
//! text encoder takes them.

use ddo_core::{CoreError, Result};

use super::program::input_err;

/// A batch of token id sequences of one length, as Transformers' `input_ids` and
/// `attention_mask` `[batch, seq]` (row-major).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QwenTextInputs {
    /// `batch × seq` token ids, row-major.
    pub input_ids: Vec<u32>,
    /// `batch × seq` flags, 1 for a token and 0 for padding (whose keys no query attends);
    /// `None` attends every token (causally).
    pub attention_mask: Option<Vec<u32>>,
    /// Rows.
    pub batch: usize,
}

impl QwenTextInputs {
    /// One sequence, no padding.
    pub fn single(input_ids: Vec<u32>) -> Self {
        Self {
            input_ids,
            attention_mask: None,
            batch: 1,
        }
    }

    /// Rows of equal length with their masks.
    pub fn new(input_ids: Vec<u32>, attention_mask: Option<Vec<u32>>, batch: usize) -> Self {
        Self {
            input_ids,
            attention_mask,
            batch,
        }
    }

    /// Tokens per row (0 for an empty or ill-shaped batch, which the forward refuses).
    pub fn seq_len(&self) -> usize {
        match self.batch {
            0 => 0,
            b => self.input_ids.len() / b,
        }
    }

    /// `(batch, seq)` once every id is below `vocab_size`, the rows are whole and non-empty,
    /// and the mask (if any) has one flag of 0 or 1 per token.
    pub(crate) fn check(&self, vocab_size: usize) -> Result<(usize, usize)> {
        let (batch, len) = (self.batch, self.seq_len());
        if batch == 0 || len == 0 || batch * len != self.input_ids.len() {
            return Err(input_err(
                "input_ids",
                format!(
                    "{} ids do not make {batch} non-empty rows of one length",
                    self.input_ids.len()
                ),
            ));
        }
        if let Some(bad) = self.input_ids.iter().find(|&&id| id as usize >= vocab_size) {
            return Err(CoreError::InvalidOption {
                option: "input_ids".into(),
                value: bad.to_string(),
                hint: format!("token ids must be below vocab_size = {vocab_size}"),
            });
        }
        if let Some(mask) = &self.attention_mask {
            if mask.len() != self.input_ids.len() {
                return Err(input_err(
                    "attention_mask",
                    format!("has {} entries for {batch} x {len} tokens", mask.len()),
                ));
            }
            if let Some(bad) = mask.iter().find(|&&m| m > 1) {
                return Err(CoreError::InvalidOption {
                    option: "attention_mask".into(),
                    value: bad.to_string(),
                    hint: "1 attends a token, 0 masks it (padding)".into(),
                });
            }
        }
        Ok((batch, len))
    }
}
