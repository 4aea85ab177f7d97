//! Round trips, edge cases and corruption of whole units: the encoder and the host decoder
//! against each other, bit for bit, and every damaged unit refused with a typed error.

use proptest::prelude::*;

use crate::format::CHUNK_WORDS;
use crate::*;

/// A small deterministic generator (SplitMix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn uniform(&mut self) -> f64 {
        ((self.next() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// A normal sample (Box-Muller).
    fn normal(&mut self, sigma: f64) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        sigma * (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

/// `f` as bf16 bits, rounded to nearest even.
fn bf16(f: f32) -> u16 {
    let u = f.to_bits();
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

fn to_bytes(words: &[u16]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// `n` bf16 words drawn from N(0, 0.02), as bytes.
pub(crate) fn normal_words(n: usize, seed: u64) -> Vec<u8> {
    let mut r = Rng(seed);
    let w: Vec<u16> = (0..n).map(|_| bf16(r.normal(0.02) as f32)).collect();
    to_bytes(&w)
}

fn round_trip(words: &[u8]) -> EncodedUnit {
    let unit = encode_unit(words).unwrap();
    assert_eq!(unit.len() as u64, unit.header().encoded_len());
    assert_eq!(unit.len() % SECTION_ALIGN, 0);
    assert!(unit.len() as u64 <= max_encoded_len(words.len()).unwrap());
    assert_eq!(decoded_len(unit.bytes()).unwrap(), words.len() as u64);
    assert_eq!(unit.header(), &UnitHeader::parse(unit.bytes()).unwrap());
    assert_eq!(unit.header().checksum(), checksum(words));
    let mut out = vec![0xa5u8; words.len()];
    decode_unit(unit.bytes(), &mut out).unwrap();
    assert!(
        out == words,
        "round trip of {} words differs",
        words.len() / 2
    );
    for threads in [2, 3, 8] {
        let mut par = vec![0x5au8; words.len()];
        decode_unit_parallel(unit.bytes(), &mut par, threads).unwrap();
        assert!(
            par == words,
            "{threads}-thread decode of {} words differs",
            words.len() / 2
        );
    }
    unit
}

#[test]
fn normal_weights_compress_to_about_two_thirds() {
    let words = normal_words(1 << 21, 1);
    let unit = round_trip(&words);
    let s = unit.stats();
    assert_eq!(unit.header().mode(), Mode::Huffman);
    println!("N(0, 0.02), 4 MiB: {s}");
    assert!((0.66..=0.70).contains(&s.ratio()), "{s}");
    assert!((2.4..=2.8).contains(&s.exponent_entropy()), "{s}");
    // Huffman plus lane padding stays close to the entropy.
    assert!(s.exponent_bits() - s.exponent_entropy() < 0.2, "{s}");
}

#[test]
fn edge_lengths_round_trip() {
    let words = normal_words(3 * CHUNK_WORDS + 200, 2);
    for n in [
        0,
        1,
        2,
        3,
        4,
        5,
        127,
        128,
        129,
        CHUNK_WORDS - 1,
        CHUNK_WORDS,
        CHUNK_WORDS + 1,
        2 * CHUNK_WORDS - 1,
        2 * CHUNK_WORDS + 3,
        3 * CHUNK_WORDS + 200,
    ] {
        round_trip(&words[..2 * n]);
    }
    assert_eq!(encode_unit(&[]).unwrap().len(), HEADER_BYTES);
}

#[test]
fn all_equal_words_round_trip() {
    for v in [0u16, 0x8000, 0x3f80, 0x7f80, 0xffff, 0x0001] {
        for n in [1, 100, CHUNK_WORDS + 7] {
            let unit = round_trip(&to_bytes(&vec![v; n]));
            if n > CHUNK_WORDS {
                assert_eq!(unit.header().mode(), Mode::Huffman, "{v:#x} x {n}");
                assert!(unit.stats().ratio() < 0.6, "{}", unit.stats());
            }
        }
    }
}

#[test]
fn every_word_value_round_trips() {
    // All 65,536 patterns: every exponent with every sign and mantissa, so infinities,
    // NaNs, subnormals and both zeros. Uniform exponents do not compress: stored raw.
    let all: Vec<u16> = (0..=u16::MAX).collect();
    let unit = round_trip(&to_bytes(&all));
    assert_eq!(unit.header().mode(), Mode::Raw);
    // The same values sprinkled into normal weights: coded, every exponent with a code.
    let mut words = normal_words(1 << 20, 3);
    for (i, v) in (0..=u16::MAX).enumerate() {
        words[32 * i..32 * i + 2].copy_from_slice(&v.to_le_bytes());
    }
    let unit = round_trip(&words);
    assert_eq!(unit.header().mode(), Mode::Huffman);
    assert_eq!(unit.header().symbol_count(), 256);
    assert!(unit.header().max_code_len() >= 8);
}

#[test]
fn many_rare_exponents_take_twelve_bit_codes() {
    // Weights with every exponent a few times: giving the rare ones 12-bit codes leaves the
    // common ones the most room, worth more than a smaller decode table.
    let mut words = normal_words(1 << 21, 11);
    for i in 0..1024 {
        let v = (((i % 256) << 7) | (i % 128)) as u16;
        words[4096 * i..4096 * i + 2].copy_from_slice(&v.to_le_bytes());
    }
    let unit = round_trip(&words);
    assert_eq!(unit.header().mode(), Mode::Huffman);
    assert_eq!(
        unit.header().max_code_len(),
        MAX_CODE_LEN,
        "{}",
        unit.stats()
    );
}

#[test]
fn random_bits_are_stored_raw() {
    let mut r = Rng(9);
    let words: Vec<u8> = (0..40_000).map(|_| r.next() as u8).collect();
    let unit = round_trip(&words);
    assert_eq!(unit.header().mode(), Mode::Raw);
    assert_eq!(unit.stats().raw_units, 1);
    assert_eq!(unit.len() as u64, max_encoded_len(words.len()).unwrap());
}

#[test]
fn encoding_is_deterministic_and_parallel_agrees() {
    let words = normal_words(5 * CHUNK_WORDS + 11, 4);
    let a = encode_unit(&words).unwrap();
    assert_eq!(a.bytes(), encode_unit(&words).unwrap().bytes());
    let unit_bytes = 2 * 3000;
    let split = Encoder::with_threads(3)
        .encode_split(&words, unit_bytes)
        .unwrap();
    let serial: Vec<EncodedUnit> = words
        .chunks(unit_bytes)
        .map(|u| encode_unit(u).unwrap())
        .collect();
    assert_eq!(split.len(), serial.len());
    for (p, s) in split.iter().zip(&serial) {
        assert_eq!(p.bytes(), s.bytes());
    }
    let total = Stats::total(split.iter().map(|u| u.stats()));
    assert_eq!(total.words, (words.len() / 2) as u64);
    assert_eq!(total.units, split.len() as u64);
    // Parallel decode of the units into their parts of one buffer.
    let mut out = vec![0u8; words.len()];
    let mut pairs: Vec<(&[u8], &mut [u8])> = split
        .iter()
        .map(|u| u.bytes())
        .zip(out.chunks_mut(unit_bytes))
        .collect();
    decode_units_parallel(&mut pairs, 2).unwrap();
    assert!(out == words);
}

#[test]
fn wrong_inputs_are_typed_errors() {
    assert_eq!(
        encode_unit(&[1, 2, 3]).err(),
        Some(CodecError::OddLength { bytes: 3 })
    );
    assert!(matches!(
        Encoder::new().encode_split(&[0; 8], 3),
        Err(CodecError::OddLength { bytes: 3 })
    ));
    let words = normal_words(100, 5);
    let unit = encode_unit(&words).unwrap();
    let mut short = vec![0u8; words.len() - 2];
    assert_eq!(
        decode_unit(unit.bytes(), &mut short),
        Err(CodecError::OutputSize {
            expected: 200,
            got: 198
        })
    );
}

/// Decoding `bytes` fails (and, if it ever succeeded, gave exactly `words`).
fn refused(bytes: &[u8], words: &[u8]) -> bool {
    let mut out = vec![0u8; words.len()];
    match decode_unit(bytes, &mut out) {
        Err(_) => true,
        Ok(()) => {
            assert!(out == words, "a corrupt unit decoded into wrong words");
            false
        }
    }
}

#[test]
fn every_truncation_and_extension_is_refused() {
    let words = normal_words(700, 6);
    let unit = encode_unit(&words).unwrap();
    let b = unit.bytes();
    for len in 0..b.len() {
        assert!(refused(&b[..len], &words), "prefix of {len} bytes");
    }
    let mut longer = b.to_vec();
    longer.push(0);
    assert!(matches!(
        decode_unit(&longer, &mut vec![0; words.len()]),
        Err(CodecError::TrailingBytes { .. })
    ));
}

#[test]
fn every_byte_of_small_units_is_protected() {
    // A Huffman unit with a partial last chunk and a raw one: flipping any bit of any
    // byte is refused.
    let mut r = Rng(7);
    let raw: Vec<u8> = (0..300).map(|_| r.next() as u8).collect();
    for words in [normal_words(CHUNK_WORDS + 300, 8), raw] {
        let unit = encode_unit(&words).unwrap();
        let b = unit.bytes();
        for i in 0..b.len() {
            for flip in [0x01u8, 0x80] {
                let mut c = b.to_vec();
                c[i] ^= flip;
                assert!(
                    refused(&c, &words),
                    "byte {i} ^ {flip:#x} of a {:?} unit",
                    unit.header().mode()
                );
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Arbitrary words of arbitrary length round-trip.
    #[test]
    fn arbitrary_words_round_trip(words in proptest::collection::vec(any::<u16>(), 0..9000)) {
        round_trip(&to_bytes(&words));
    }

    /// Words with few exponents (coded, not raw) round-trip, whatever the mix.
    #[test]
    fn skewed_words_round_trip(
        exps in proptest::collection::vec(any::<u8>(), 1..6),
        picks in proptest::collection::vec((any::<u16>(), any::<u8>()), 0..9000),
    ) {
        let words: Vec<u16> = picks
            .iter()
            .map(|&(w, p)| (w & 0x807f) | u16::from(exps[p as usize % exps.len()]) << 7)
            .collect();
        let unit = round_trip(&to_bytes(&words));
        if words.len() > 200 {
            prop_assert_eq!(unit.header().mode(), Mode::Huffman);
        }
    }

    /// Any byte of a larger unit changed to any other value: refused.
    #[test]
    fn corrupt_units_are_refused(at in 0.0f64..1.0, xor in 1u8..=255, seed in 0u64..4) {
        let words = normal_words(2 * CHUNK_WORDS + 77, 100 + seed);
        let unit = encode_unit(&words).unwrap();
        let mut b = unit.into_bytes();
        let i = ((b.len() as f64 * at) as usize).min(b.len() - 1);
        b[i] ^= xor;
        prop_assert!(refused(&b, &words), "byte {} ^ {:#x}", i, xor);
        // Chunks shared among threads: refused too (a chunk of each thread, and the sum).
        let mut out = vec![0u8; words.len()];
        let par = decode_unit_parallel(&b, &mut out, 3);
        prop_assert!(par.is_err(), "3 threads took byte {} ^ {:#x}", i, xor);
    }
}
