//! [`Stats`]: what encoding a unit (or many, merged) gave — words, encoded bytes, the
//! ratio, the exponents' Shannon entropy and the bits the code actually spent on them.

use std::fmt;

/// Figures of one encoded unit, or of many merged with [`Stats::merge`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stats {
    /// Units counted.
    pub units: u64,
    /// Of those, units stored raw (coding would not have made them smaller).
    pub raw_units: u64,
    /// bf16 words.
    pub words: u64,
    /// Bytes of the encoded units, headers and tables included.
    pub encoded_bytes: u64,
    /// Bytes of entropy-coded exponent stream (Huffman units only).
    pub stream_bytes: u64,
    /// Words of the Huffman-coded units (the words [`Stats::stream_bytes`] code).
    pub coded_words: u64,
    /// How often each exponent value (bits 7..15 of a word) occurs.
    pub exponent_histogram: [u64; 256],
}

impl Default for Stats {
    fn default() -> Self {
        Self {
            units: 0,
            raw_units: 0,
            words: 0,
            encoded_bytes: 0,
            stream_bytes: 0,
            coded_words: 0,
            exponent_histogram: [0; 256],
        }
    }
}

impl Stats {
    /// Bytes of the words before encoding (`2 * words`).
    pub fn raw_bytes(&self) -> u64 {
        2 * self.words
    }

    /// Encoded bytes over raw bytes (1.0 for no words).
    pub fn ratio(&self) -> f64 {
        if self.words == 0 {
            1.0
        } else {
            self.encoded_bytes as f64 / self.raw_bytes() as f64
        }
    }

    /// Shannon entropy of the exponents, in bits per word: the floor of any code that
    /// codes each exponent on its own (0 for no words).
    pub fn exponent_entropy(&self) -> f64 {
        let total: u64 = self.exponent_histogram.iter().sum();
        if total == 0 {
            return 0.0;
        }
        let t = total as f64;
        self.exponent_histogram
            .iter()
            .filter(|&&c| c > 0)
            .map(|&c| {
                let p = c as f64 / t;
                -p * p.log2()
            })
            .sum()
    }

    /// Bits per word the exponent stream of the Huffman units takes, lane padding included
    /// (0 when none is coded).
    pub fn exponent_bits(&self) -> f64 {
        if self.coded_words == 0 {
            0.0
        } else {
            8.0 * self.stream_bytes as f64 / self.coded_words as f64
        }
    }

    /// Adds `other`'s figures to these.
    pub fn merge(&mut self, other: &Stats) {
        self.units += other.units;
        self.raw_units += other.raw_units;
        self.words += other.words;
        self.encoded_bytes += other.encoded_bytes;
        self.stream_bytes += other.stream_bytes;
        self.coded_words += other.coded_words;
        for (a, b) in self
            .exponent_histogram
            .iter_mut()
            .zip(&other.exponent_histogram)
        {
            *a += b;
        }
    }

    /// The merged figures of `stats`.
    pub fn total<'a>(stats: impl IntoIterator<Item = &'a Stats>) -> Stats {
        let mut t = Stats::default();
        for s in stats {
            t.merge(s);
        }
        t
    }
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} unit(s) ({} raw), {} words: {} B -> {} B (ratio {:.4}); exponents: entropy {:.3} bits/word, coded in {:.3} bits/word",
            self.units,
            self.raw_units,
            self.words,
            self.raw_bytes(),
            self.encoded_bytes,
            self.ratio(),
            self.exponent_entropy(),
            self.exponent_bits()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entropy_of_simple_histograms() {
        let mut s = Stats::default();
        assert_eq!(s.exponent_entropy(), 0.0);
        assert_eq!(s.ratio(), 1.0);
        s.exponent_histogram[3] = 10;
        assert_eq!(s.exponent_entropy(), 0.0);
        s.exponent_histogram[4] = 10;
        assert!((s.exponent_entropy() - 1.0).abs() < 1e-12);
        for c in s.exponent_histogram.iter_mut() {
            *c = 1;
        }
        assert!((s.exponent_entropy() - 8.0).abs() < 1e-12);
    }

    #[test]
    fn merging_adds_and_entropy_comes_from_the_merged_histogram() {
        let mut a = Stats {
            units: 1,
            words: 4,
            encoded_bytes: 6,
            ..Stats::default()
        };
        a.exponent_histogram[1] = 4;
        let mut b = Stats {
            units: 1,
            raw_units: 1,
            words: 4,
            encoded_bytes: 8,
            ..Stats::default()
        };
        b.exponent_histogram[2] = 4;
        let t = Stats::total([&a, &b]);
        assert_eq!(
            (t.units, t.raw_units, t.words, t.encoded_bytes),
            (2, 1, 8, 14)
        );
        assert!((t.exponent_entropy() - 1.0).abs() < 1e-12);
        assert!((t.ratio() - 14.0 / 16.0).abs() < 1e-12);
        assert!(t.to_string().contains("ratio 0.8750"));
    }
}
