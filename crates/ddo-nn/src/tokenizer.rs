//! A documented, deterministic stand-in for the CLIP and T5 tokenizers, used when a run has
//! a prompt but no tokenizer files (random weights at a named config, or a pipeline folder
//! without `tokenizer/` and `tokenizer_2/`). It does not reproduce the real tokenizers' ids;
//! it gives every prompt a fixed, reproducible id sequence with the layout the encoders
//! expect, so the whole pipeline runs from text.
//!
//! The rule:
//!
//! 1. The prompt is lower-cased and split into pieces: runs of letters and digits, and every
//!    other non-space character on its own (`"A cat, 3D!"` → `a`, `cat`, `,`, `3d`, `!`).
//! 2. A piece's id is `FNV-1a-64(piece bytes) mod R`, offset into the ids that are not special
//!    (CLIP: `0..R` with `R = min(bos, eos)`; T5: `2..vocab` with `R = vocab − 2`, as 0 is padding
//!    and 1 is `</s>`).
//! 3. CLIP: `[bos] + pieces + [eos]`, pieces cut to `max_length − 2`, padded with `eos` to
//!    `max_length` (the CLIP tokenizer pads with `<|endoftext|>`; FluxPipeline uses 77). `bos`
//!    and `eos` are the config's ids, except for configs with the legacy `eos_token_id = 2`
//!    (CLIP-L as shipped), where they are `vocab − 2` and `vocab − 1` (49406 and 49407, the real
//!    ids), so the legacy argmax pooling still finds the end of the text.
//! 4. T5: `pieces + [1]`, pieces cut to `max_length − 1`, padded with 0 to `max_length`
//!    (FluxPipeline: `max_sequence_length`, 512 by default).

use crate::clip::ClipTextConfig;
use crate::t5::T5Config;

/// T5's padding id.
pub const T5_PAD: u32 = 0;
/// T5's end-of-sequence id (`</s>`).
pub const T5_EOS: u32 = 1;

/// FNV-1a, 64 bits.
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Step 1 of the rule: lower-case, then letter/digit runs and single other characters.
pub fn pieces(prompt: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    for c in prompt.to_lowercase().chars() {
        if c.is_alphanumeric() {
            word.push(c);
            continue;
        }
        if !word.is_empty() {
            out.push(std::mem::take(&mut word));
        }
        if !c.is_whitespace() {
            out.push(c.to_string());
        }
    }
    if !word.is_empty() {
        out.push(word);
    }
    out
}

/// The CLIP `bos` and `eos` ids the stand-in uses for `config` (step 3).
pub fn clip_special_ids(config: &ClipTextConfig) -> (u32, u32) {
    let vocab = config.vocab_size as u32;
    if config.eos_token_id == 2 || config.bos_token_id < 0 || config.eos_token_id < 0 {
        (vocab.saturating_sub(2), vocab.saturating_sub(1))
    } else {
        (config.bos_token_id as u32, config.eos_token_id as u32)
    }
}

/// CLIP ids for `prompt`, `max_length` long (the rule's steps 1–3).
pub fn clip_ids(config: &ClipTextConfig, prompt: &str, max_length: usize) -> Vec<u32> {
    let (bos, eos) = clip_special_ids(config);
    let range = u64::from(bos.min(eos)).max(1);
    let max_length = max_length.max(2);
    let mut ids = vec![bos];
    ids.extend(
        pieces(prompt)
            .iter()
            .take(max_length - 2)
            .map(|p| (fnv1a(p.as_bytes()) % range) as u32),
    );
    ids.push(eos);
    ids.resize(max_length, eos);
    ids
}

/// T5 ids for `prompt`, `max_length` long (the rule's steps 1, 2 and 4).
pub fn t5_ids(config: &T5Config, prompt: &str, max_length: usize) -> Vec<u32> {
    let range = (config.vocab_size as u64).saturating_sub(2).max(1);
    let max_length = max_length.max(1);
    let mut ids: Vec<u32> = pieces(prompt)
        .iter()
        .take(max_length - 1)
        .map(|p| 2 + (fnv1a(p.as_bytes()) % range) as u32)
        .collect();
    ids.push(T5_EOS);
    ids.resize(max_length, T5_PAD);
    ids
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_split_words_and_punctuation() {
        assert_eq!(pieces("A cat, 3D!"), ["a", "cat", ",", "3d", "!"]);
        assert!(pieces("   ").is_empty());
    }

    #[test]
    fn clip_layout_and_legacy_ids() {
        let c = ClipTextConfig::clip_l();
        let ids = clip_ids(&c, "a photo of a cat", 77);
        assert_eq!(ids.len(), 77);
        assert_eq!(ids[0], 49406);
        assert_eq!(ids[6], 49407);
        assert!(ids[1..6].iter().all(|&i| i < 49406));
        assert_eq!(c.pooled_index(&ids), 6);
        assert_eq!(ids, clip_ids(&c, "A photo of a CAT", 77));
    }

    #[test]
    fn t5_layout() {
        let c = T5Config::t5_xxl();
        let ids = t5_ids(&c, "a photo of a cat", 16);
        assert_eq!(ids.len(), 16);
        assert_eq!(ids[5], T5_EOS);
        assert!(ids[..5].iter().all(|&i| (2..32128).contains(&i)));
        assert!(ids[6..].iter().all(|&i| i == T5_PAD));
        let long: String = "word ".repeat(40);
        let ids = t5_ids(&c, &long, 16);
        assert_eq!(ids[15], T5_EOS);
    }
}
