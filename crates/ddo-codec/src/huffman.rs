//! The exponent code: optimal length-limited Huffman code lengths (package-merge), the
//! canonical code they define, its encode table and its decode table.
//!
//! Codes are canonical (DEFLATE's rule: shorter codes first, equal lengths in symbol order)
//! and at most [`MAX_CODE_LEN`] = 12 bits, so any code over the 256 exponents exists and
//! one table of `2^max_len` entries decodes a symbol with a single lookup: no escape path.
//! Bits are written least significant first, so codes are stored bit-reversed and a
//! decoder indexes the table with the low `max_len` bits of its bit buffer. A table entry
//! is `len << 8 | symbol` (`u16`); 0 marks a bit pattern no code starts with (only the
//! one-symbol code, `0`, leaves any). Each unit takes the length limit (at most 12) whose
//! code plus decode table is smallest ([`best_code_lengths`]).

use crate::error::{CodecError, Result};

/// Longest code, in bits.
pub const MAX_CODE_LEN: u8 = 12;

/// A canonical prefix code over the 256 exponent values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CodeTable {
    /// `counts[l]`: symbols with an `l`-bit code (`counts[0]` unused, 0).
    pub counts: [u16; MAX_CODE_LEN as usize + 1],
    /// The symbols in canonical order (by length, then value).
    pub symbols: Vec<u8>,
}

/// Optimal code lengths (0 for absent symbols) of at most [`MAX_CODE_LEN`] bits for the
/// symbol frequencies `hist`, by package-merge; a lone symbol gets length 1.
#[cfg(test)]
pub(crate) fn code_lengths(hist: &[u64; 256]) -> [u8; 256] {
    limited_lengths(hist, MAX_CODE_LEN)
}

/// The code lengths for `hist` that make the smallest unit: the coded exponents plus the
/// decode table (`2^max_len` entries of 2 bytes), over every length limit from the least
/// the alphabet allows to [`MAX_CODE_LEN`]. Large units take the 12-bit limit (the table
/// is nothing beside them); small ones a shorter limit and a small table.
pub(crate) fn best_code_lengths(hist: &[u64; 256]) -> [u8; 256] {
    let present = hist.iter().filter(|&&c| c > 0).count() as u32;
    let least = present.max(2).next_power_of_two().trailing_zeros() as u8;
    let mut best: Option<(u64, [u8; 256])> = None;
    for limit in least..=MAX_CODE_LEN {
        let lengths = limited_lengths(hist, limit);
        let bits: u64 = hist
            .iter()
            .zip(&lengths)
            .map(|(&c, &l)| c.saturating_mul(u64::from(l)))
            .fold(0, u64::saturating_add);
        let max = lengths.iter().copied().max().unwrap_or(0);
        let cost = bits.div_ceil(8).saturating_add(2 << max);
        if best.as_ref().is_none_or(|(c, _)| cost < *c) {
            best = Some((cost, lengths));
        }
    }
    best.map_or([0; 256], |(_, l)| l)
}

/// Optimal code lengths of at most `limit` bits (`2^limit` at least the number of
/// symbols present, `limit` at most [`MAX_CODE_LEN`]), by package-merge.
fn limited_lengths(hist: &[u64; 256], limit: u8) -> [u8; 256] {
    let mut lengths = [0u8; 256];
    // Leaves sorted by (weight, symbol): ties broken the same way on every machine.
    let mut leaves: Vec<(u64, u8)> = hist
        .iter()
        .enumerate()
        .filter(|&(_, &c)| c > 0)
        .map(|(s, &c)| (c, s as u8))
        .collect();
    leaves.sort_unstable();
    let n = leaves.len();
    if n == 0 {
        return lengths;
    }
    if n == 1 {
        lengths[leaves[0].1 as usize] = 1;
        return lengths;
    }
    let weights: Vec<u64> = leaves.iter().map(|&(w, _)| w).collect();
    // Level lists from the deepest (leaves only) up; each later one merges the leaves with
    // the packages (adjacent pairs) of the one below. `is_leaf[l][i]`: item i of list l.
    let levels = usize::from(limit.clamp(1, MAX_CODE_LEN));
    debug_assert!(n <= 1 << levels);
    let mut is_leaf: Vec<Vec<bool>> = Vec::with_capacity(levels);
    is_leaf.push(vec![true; n]);
    let mut list = weights.clone();
    for _ in 1..levels {
        let packages: Vec<u64> = list
            .chunks_exact(2)
            .map(|p| p[0].saturating_add(p[1]))
            .collect();
        let mut merged = Vec::with_capacity(n + packages.len());
        let mut flags = Vec::with_capacity(n + packages.len());
        let (mut a, mut b) = (0, 0);
        while a < n || b < packages.len() {
            // Leaves first on ties.
            if b == packages.len() || (a < n && weights[a] <= packages[b]) {
                merged.push(weights[a]);
                flags.push(true);
                a += 1;
            } else {
                merged.push(packages[b]);
                flags.push(false);
                b += 1;
            }
        }
        is_leaf.push(flags);
        list = merged;
    }
    // Take the 2n - 2 lightest items of the top list; walk down, each level's selected
    // packages selecting twice as many items of the level below. The selected leaves of a
    // level are a prefix of the sorted leaves; each selection adds one bit to its leaf.
    let mut take = 2 * n - 2;
    let mut bits = vec![0u8; n];
    for flags in is_leaf.iter().rev() {
        let take_here = take.min(flags.len());
        let leaves_taken = flags[..take_here].iter().filter(|&&f| f).count();
        for b in &mut bits[..leaves_taken] {
            *b += 1;
        }
        take = 2 * (take_here - leaves_taken);
    }
    for (&(_, s), &b) in leaves.iter().zip(&bits) {
        lengths[s as usize] = b;
    }
    lengths
}

/// Reverses the low `len` bits of `code`.
#[inline]
fn reverse(code: u32, len: u8) -> u32 {
    if len == 0 {
        0
    } else {
        code.reverse_bits() >> (32 - u32::from(len))
    }
}

impl CodeTable {
    /// The canonical code of `lengths` (each at most [`MAX_CODE_LEN`]).
    pub fn from_lengths(lengths: &[u8; 256]) -> Self {
        let mut counts = [0u16; MAX_CODE_LEN as usize + 1];
        let mut symbols = Vec::new();
        for len in 1..=MAX_CODE_LEN {
            for (s, &l) in lengths.iter().enumerate() {
                if l == len {
                    counts[len as usize] += 1;
                    symbols.push(s as u8);
                }
            }
        }
        Self { counts, symbols }
    }

    /// The longest code length (0 for the empty code).
    pub fn max_len(&self) -> u8 {
        (1..=MAX_CODE_LEN)
            .rev()
            .find(|&l| self.counts[l as usize] > 0)
            .unwrap_or(0)
    }

    /// `(symbol, length, canonical code)` in canonical order.
    fn codes(&self) -> impl Iterator<Item = (u8, u8, u32)> + '_ {
        let mut code = 0u32;
        let mut len = 1u8;
        let mut left = self.counts[1];
        self.symbols.iter().map(move |&s| {
            while left == 0 {
                code <<= 1;
                len += 1;
                left = self.counts.get(len as usize).copied().unwrap_or(1);
            }
            let c = code;
            code += 1;
            left -= 1;
            (s, len, c)
        })
    }

    /// Per symbol: its bit-reversed code in the low 16 bits and its length above
    /// (`code | len << 16`; 0 for symbols without a code).
    pub fn encode_table(&self) -> [u32; 256] {
        let mut table = [0u32; 256];
        for (s, len, code) in self.codes() {
            table[s as usize] = reverse(code, len) | u32::from(len) << 16;
        }
        table
    }

    /// The decode table: `2^max_len` entries `len << 8 | symbol`, indexed by the next
    /// `max_len` bits of the stream (least significant first); 0 where no code matches.
    pub fn decode_table(&self) -> Vec<u16> {
        let max = self.max_len();
        let mut lut = vec![0u16; 1usize << max];
        for (s, len, code) in self.codes() {
            let first = reverse(code, len) as usize;
            let entry = u16::from(len) << 8 | u16::from(s);
            for e in lut.iter_mut().skip(first).step_by(1usize << len) {
                *e = entry;
            }
        }
        lut
    }

    /// Checks that `counts` and `symbols` are a canonical code this codec writes: every
    /// symbol once, in canonical order, lengths 1 to [`MAX_CODE_LEN`], and a complete code
    /// (Kraft sum exactly 1) unless it has one symbol (the 1-bit code `0`).
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(CodecError::BadTable { reason });
        if self.counts[0] != 0 {
            return bad(format!("{} symbols of length 0", self.counts[0]));
        }
        let total: usize = self.counts.iter().map(|&c| c as usize).sum();
        if total != self.symbols.len() {
            return bad(format!(
                "the lengths count {total} symbols, the table lists {}",
                self.symbols.len()
            ));
        }
        let kraft: u64 = (1..=MAX_CODE_LEN)
            .map(|l| u64::from(self.counts[l as usize]) << (MAX_CODE_LEN - l))
            .sum();
        let full = 1u64 << MAX_CODE_LEN;
        match total {
            0 => {}
            1 if self.counts[1] == 1 => {}
            1 => return bad("a lone symbol must have the 1-bit code".into()),
            _ if kraft != full => {
                return bad(format!(
                    "the lengths are not a complete prefix code (Kraft sum {kraft}/{full})"
                ));
            }
            _ => {}
        }
        let mut seen = [false; 256];
        let mut at = 0usize;
        for len in 1..=MAX_CODE_LEN as usize {
            let group = &self.symbols[at..at + self.counts[len] as usize];
            if group.windows(2).any(|w| w[0] >= w[1]) {
                return bad(format!("the {len}-bit symbols are not in increasing order"));
            }
            for &s in group {
                if std::mem::replace(&mut seen[s as usize], true) {
                    return bad(format!("symbol {s} appears twice"));
                }
            }
            at += group.len();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;

    use proptest::prelude::*;

    use super::*;

    /// Cost (total bits) and depth of an unlimited Huffman code of `weights`.
    fn huffman(weights: &[u64]) -> (u64, u8) {
        if weights.len() < 2 {
            return (weights.iter().sum(), 1);
        }
        let mut heap: BinaryHeap<Reverse<(u64, u8)>> =
            weights.iter().map(|&w| Reverse((w, 0))).collect();
        let mut cost = 0;
        while heap.len() > 1 {
            let (Reverse((a, da)), Reverse((b, db))) = (heap.pop().unwrap(), heap.pop().unwrap());
            cost += a + b;
            heap.push(Reverse((a + b, da.max(db) + 1)));
        }
        (cost, heap.pop().unwrap().0.1)
    }

    fn huffman_cost(weights: &[u64]) -> u64 {
        huffman(weights).0
    }

    fn cost(hist: &[u64; 256], lengths: &[u8; 256]) -> u64 {
        hist.iter()
            .zip(lengths)
            .map(|(&c, &l)| c * u64::from(l))
            .sum()
    }

    fn kraft(lengths: &[u8; 256]) -> u64 {
        lengths
            .iter()
            .filter(|&&l| l > 0)
            .map(|&l| 1u64 << (MAX_CODE_LEN - l))
            .sum()
    }

    #[test]
    fn small_alphabets() {
        let mut h = [0u64; 256];
        assert_eq!(code_lengths(&h), [0u8; 256]);
        h[7] = 5;
        let l = code_lengths(&h);
        assert_eq!(l[7], 1);
        assert_eq!(l.iter().filter(|&&x| x > 0).count(), 1);
        h[9] = 1;
        let l = code_lengths(&h);
        assert_eq!((l[7], l[9]), (1, 1));
        h[200] = 1;
        let l = code_lengths(&h);
        assert_eq!((l[7], l[9], l[200]), (1, 2, 2));
    }

    #[test]
    fn a_geometric_tail_is_limited_to_twelve_bits_and_stays_near_optimal() {
        let mut h = [0u64; 256];
        for (i, c) in h.iter_mut().enumerate().take(40) {
            *c = 1u64 << (40 - i);
        }
        let l = code_lengths(&h);
        assert_eq!(l.iter().copied().max(), Some(MAX_CODE_LEN));
        assert_eq!(kraft(&l), 1 << MAX_CODE_LEN);
        let unlimited = huffman_cost(&h[..40]);
        let limited = cost(&h, &l);
        assert!(limited >= unlimited);
        let loss = (limited - unlimited) as f64 / unlimited as f64;
        println!(
            "12-bit limit on a 40-symbol geometric source: {:.4}% more bits",
            100.0 * loss
        );
        assert!(loss <= 1e-2, "{loss}");
    }

    #[test]
    fn small_units_take_a_shorter_limit_and_large_ones_twelve_bits() {
        let mut h = [0u64; 256];
        for (i, c) in h.iter_mut().enumerate().skip(100).take(40) {
            *c = 1u64 << (40 - (i - 100)).min(30);
        }
        let max = |l: [u8; 256]| l.iter().copied().max().unwrap_or(0);
        assert_eq!(max(best_code_lengths(&h)), MAX_CODE_LEN);
        let small: [u64; 256] = std::array::from_fn(|i| h[i].min(3));
        let l = best_code_lengths(&small);
        assert!(max(l) < MAX_CODE_LEN && max(l) >= 6, "{}", max(l));
        assert_eq!(kraft(&l), 1 << MAX_CODE_LEN);
        let mut one = [0u64; 256];
        one[5] = 9;
        assert_eq!(best_code_lengths(&one)[5], 1);
        assert_eq!(best_code_lengths(&[0; 256]), [0; 256]);
    }

    #[test]
    fn canonical_tables_decode_what_they_encode() {
        let mut h = [0u64; 256];
        for (i, c) in h.iter_mut().enumerate() {
            *c = (i as u64 * 7919) % 1000 + 1;
        }
        let t = CodeTable::from_lengths(&code_lengths(&h));
        t.validate().unwrap();
        let enc = t.encode_table();
        let lut = t.decode_table();
        let max = t.max_len();
        assert!(
            lut.iter().all(|&e| e != 0),
            "a complete code fills the table"
        );
        for (s, &cl) in enc.iter().enumerate() {
            let (code, len) = (cl & 0xffff, (cl >> 16) as u8);
            for pad in [0u32, 1, 0xfff] {
                let idx = (code | pad << len) as usize & ((1 << max) - 1);
                assert_eq!(lut[idx], u16::from(len) << 8 | s as u16, "symbol {s}");
            }
        }
    }

    #[test]
    fn validation_refuses_what_the_encoder_never_writes() {
        let mut h = [0u64; 256];
        h[1] = 3;
        h[2] = 2;
        h[3] = 1;
        let good = CodeTable::from_lengths(&code_lengths(&h));
        good.validate().unwrap();
        let mut t = good.clone();
        t.symbols.swap(1, 2);
        assert!(t.validate().is_err(), "order");
        let mut t = good.clone();
        t.symbols[2] = t.symbols[0];
        assert!(t.validate().is_err(), "duplicate");
        let mut t = good.clone();
        t.counts[2] += 1;
        t.symbols.push(9);
        assert!(t.validate().is_err(), "over-full");
        let mut t = good.clone();
        t.counts[3] = 1;
        assert!(t.validate().is_err(), "count mismatch");
        let lone = CodeTable {
            counts: [0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            symbols: vec![4],
        };
        assert!(lone.validate().is_err(), "a lone symbol has the 1-bit code");
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        /// Lengths are at most 12, a complete code, and as cheap as an unlimited Huffman
        /// code whenever that one fits in 12 bits.
        #[test]
        fn package_merge_is_optimal(weights in proptest::collection::vec(prop_oneof![0u64..4, 0u64..1_000_000, Just(1u64 << 40)], 1..256)) {
            let mut h = [0u64; 256];
            for (i, &w) in weights.iter().enumerate() {
                h[(i * 37) % 256] = w;
            }
            let l = code_lengths(&h);
            let present: Vec<u64> = h.iter().copied().filter(|&c| c > 0).collect();
            prop_assert!(l.iter().all(|&x| x <= MAX_CODE_LEN));
            for (c, x) in h.iter().zip(&l) {
                prop_assert_eq!(*c > 0, *x > 0);
            }
            if present.len() >= 2 {
                prop_assert_eq!(kraft(&l), 1 << MAX_CODE_LEN);
                let (unlimited, depth) = huffman(&present);
                prop_assert!(cost(&h, &l) >= unlimited);
                if depth <= MAX_CODE_LEN {
                    prop_assert_eq!(cost(&h, &l), unlimited);
                }
            }
            CodeTable::from_lengths(&l).validate().unwrap();
        }
    }
}
