//! The unit checksum and the metadata hash.
//!
//! **Checksum of decoded words** ([`checksum`]), designed so a GPU decoder can compute it
//! in registers while it writes: the unit's words, zero-padded to a multiple of 4, are read
//! as little-endian `u64`s; the `u64`s of chunk `k` (4,096 words, 1,024 `u64`s) are dealt
//! round-robin to 32 lanes (`u64` `i` of the chunk to lane `i % 32`, exactly the `u64` a
//! decoding warp's lane writes at each step). Lane `j` of chunk `k` starts at
//! `(32k + j + 1) * P1` and takes each of its `u64`s `v` in order with the xxHash64 round
//! `s = rotl(s + v * P2, 31) * P1`. The checksum is
//! `fmix64(Σ fmix64(s_kj) ^ n * P5 ^ P4)` over every lane of every chunk (wrapping sum;
//! `n` the word count; `fmix64` MurmurHash3's finaliser). Each step is a bijection of the
//! lane state, so any change confined to one lane always changes the checksum; changes
//! across lanes collide with probability about 2^-64. The sum makes the lanes' order
//! irrelevant, so warps can add their parts atomically in any order.
//!
//! **Metadata hash** (`meta_hash`): the same round chained over the bytes of the header
//! (its hash field zeroed), the code table, the decode table and the chunk offsets, which
//! lets [`crate::UnitHeader::parse`] reject corrupt metadata before anything is decoded.
//!
//! The constants are xxHash64's primes; the code is this crate's own.

use crate::format::{CHUNK_WORDS, LANES};

/// xxHash64's first prime.
pub(crate) const P1: u64 = 0x9E37_79B1_85EB_CA87;
/// xxHash64's second prime.
pub(crate) const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
/// xxHash64's fourth prime.
pub(crate) const P4: u64 = 0x85EB_CA77_C2B2_AE63;
/// xxHash64's fifth prime.
pub(crate) const P5: u64 = 0x27D4_EB2F_1656_67C5;

/// `u64`s per chunk.
const CHUNK_U64S: usize = CHUNK_WORDS / 4;

/// One xxHash64 round.
#[inline(always)]
pub(crate) fn round(s: u64, v: u64) -> u64 {
    s.wrapping_add(v.wrapping_mul(P2))
        .rotate_left(31)
        .wrapping_mul(P1)
}

/// MurmurHash3's 64-bit finaliser (a bijection).
#[inline(always)]
pub(crate) fn fmix64(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    x ^= x >> 33;
    x = x.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    x ^ (x >> 33)
}

/// Lane `lane`'s starting state in chunk `chunk`.
#[inline(always)]
fn seed(chunk: u64, lane: usize) -> u64 {
    (chunk
        .wrapping_mul(LANES as u64)
        .wrapping_add(lane as u64 + 1))
    .wrapping_mul(P1)
}

/// The little-endian `u64` of up to 8 bytes (missing bytes zero).
#[inline(always)]
fn u64_padded(bytes: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    let n = bytes.len().min(8);
    b[..n].copy_from_slice(&bytes[..n]);
    u64::from_le_bytes(b)
}

/// Chunk `chunk`'s part of the checksum: `Σ_j fmix64(s_j)` over its 32 lanes, from the
/// chunk's word bytes (at most `2 * CHUNK_WORDS`, even).
pub(crate) fn chunk_part(chunk: u64, bytes: &[u8]) -> u64 {
    let mut s = lane_seeds(chunk);
    let rows = bytes.chunks_exact(8 * LANES);
    let tail = rows.remainder();
    for row in rows {
        for (lane, v) in s.iter_mut().zip(row.chunks_exact(8)) {
            let mut b = [0u8; 8];
            b.copy_from_slice(v);
            *lane = round(*lane, u64::from_le_bytes(b));
        }
    }
    for (lane, v) in s.iter_mut().zip(tail.chunks(8)) {
        *lane = round(*lane, u64_padded(v));
    }
    debug_assert!(bytes.len() <= 8 * CHUNK_U64S);
    lanes_part(&s)
}

/// The 32 lanes' starting states in chunk `chunk` (for callers that run the rounds
/// themselves, fused with other work).
#[inline]
pub(crate) fn lane_seeds(chunk: u64) -> [u64; LANES] {
    let mut s = [0u64; LANES];
    for (j, lane) in s.iter_mut().enumerate() {
        *lane = seed(chunk, j);
    }
    s
}

/// A chunk's part of the checksum from its lanes' final states.
#[inline]
pub(crate) fn lanes_part(s: &[u64; LANES]) -> u64 {
    s.iter().fold(0u64, |acc, &x| acc.wrapping_add(fmix64(x)))
}

/// The checksum of a unit from the sum of its chunks' parts and its word count.
#[inline]
pub(crate) fn finish(sum: u64, words: u64) -> u64 {
    fmix64(sum ^ words.wrapping_mul(P5) ^ P4)
}

/// The checksum of a unit's decoded words (`bytes`: the words' little-endian bytes, even
/// length); see the module docs.
pub fn checksum(bytes: &[u8]) -> u64 {
    let sum = bytes
        .chunks(2 * CHUNK_WORDS)
        .enumerate()
        .fold(0u64, |acc, (k, c)| {
            acc.wrapping_add(chunk_part(k as u64, c))
        });
    finish(sum, (bytes.len() / 2) as u64)
}

/// The metadata hash over `parts` in order, as one byte string zero-padded to 8.
pub(crate) fn meta_hash(parts: &[&[u8]]) -> u64 {
    let mut s = P5;
    let mut len = 0u64;
    let mut pending = [0u8; 8];
    let mut n = 0usize;
    for part in parts {
        for &b in *part {
            pending[n] = b;
            n += 1;
            if n == 8 {
                s = round(s, u64::from_le_bytes(pending));
                n = 0;
            }
        }
        len += part.len() as u64;
    }
    if n > 0 {
        pending[n..].fill(0);
        s = round(s, u64::from_le_bytes(pending));
    }
    fmix64(s ^ len.wrapping_mul(P1))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A direct transcription of the definition: lanes by index, no row batching.
    fn reference(bytes: &[u8]) -> u64 {
        let n = bytes.len() / 2;
        let mut padded = bytes.to_vec();
        while !padded.len().is_multiple_of(8) {
            padded.push(0);
        }
        let q: Vec<u64> = padded
            .chunks(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let chunks = n.div_ceil(CHUNK_WORDS);
        let mut sum = 0u64;
        for k in 0..chunks {
            for j in 0..LANES {
                let mut s = seed(k as u64, j);
                let mut i = k * CHUNK_U64S + j;
                while i < q.len() && i < (k + 1) * CHUNK_U64S {
                    s = round(s, q[i]);
                    i += LANES;
                }
                sum = sum.wrapping_add(fmix64(s));
            }
        }
        finish(sum, n as u64)
    }

    fn bytes(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed;
        (0..len)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (x >> 56) as u8
            })
            .collect()
    }

    #[test]
    fn checksum_follows_its_definition() {
        for len in [0, 2, 6, 8, 10, 254, 256, 8190, 8192, 8194, 3 * 8192 + 62] {
            let b = bytes(len, len as u64);
            assert_eq!(checksum(&b), reference(&b), "len {len}");
        }
    }

    #[test]
    fn every_single_bit_flip_changes_the_checksum() {
        let b = bytes(8 * LANES * 3 + 26, 7);
        let want = checksum(&b);
        for i in 0..b.len() {
            for bit in 0..8 {
                let mut c = b.clone();
                c[i] ^= 1 << bit;
                assert_ne!(checksum(&c), want, "byte {i} bit {bit}");
            }
        }
    }

    #[test]
    fn length_and_position_are_part_of_the_checksum() {
        assert_ne!(checksum(&[0, 0]), checksum(&[0, 0, 0, 0]));
        assert_ne!(checksum(&[]), checksum(&[0, 0]));
        // The same lane pattern in another chunk hashes differently.
        let mut a = vec![0u8; 4 * CHUNK_WORDS];
        let mut b = a.clone();
        a[0] = 1;
        b[2 * CHUNK_WORDS] = 1;
        assert_ne!(checksum(&a), checksum(&b));
        // Two sign-bit flips a lane's step apart do not cancel.
        let base = bytes(2 * CHUNK_WORDS, 3);
        let mut c = base.clone();
        c[7] ^= 0x80;
        c[7 + 8 * LANES] ^= 0x80;
        assert_ne!(checksum(&c), checksum(&base));
    }

    #[test]
    fn meta_hash_sees_every_byte_and_the_split_does_not_matter() {
        let b = bytes(77, 1);
        let h = meta_hash(&[&b]);
        assert_eq!(meta_hash(&[&b[..10], &b[10..]]), h);
        for i in 0..b.len() {
            let mut c = b.clone();
            c[i] ^= 0x10;
            assert_ne!(meta_hash(&[&c]), h, "byte {i}");
        }
        assert_ne!(meta_hash(&[&b, &[0]]), h, "a trailing zero counts");
    }
}
