//! Lossless compression of bf16 weights for streaming them below the link's floor.
//!
//! `ddo-codec` sits at the bottom of the workspace beside `ddo-metrics`: pure Rust, no
//! CUDA, no DDO dependency. The streaming engine (in `ddo-core`) will encode each transfer
//! unit once on the host and copy the smaller encoded unit over the link; `ddo-cuda`
//! decodes it on the GPU (`kernels/codec.cu`) from the ring slot into the weights' slot,
//! and this crate's host decoder decodes the same format on the CPU, so CI proves the
//! round trip bit for bit without a GPU.
//!
//! # What it does
//!
//! A bf16 word is 1 sign bit, 8 exponent bits and 7 mantissa bits. Trained weights use few
//! exponents (about 2.6 bits of information in 8 for N(0, 0.02)-like values), while sign
//! and mantissa are close to random. So a unit stores each word's sign and mantissa as one
//! raw byte, and entropy-codes the exponents with a per-unit Huffman code; units stay
//! independently decodable. Units whose words do not compress (random bits) are stored
//! raw, so no unit grows by more than its 96-byte header ([`max_encoded_len`]). The byte
//! format is documented in [`format`](mod@format); units carry a 64-bit checksum of their decoded
//! words ([`checksum`]), so a corrupt unit is a typed error ([`CodecError`]), never wrong
//! weights.
//!
//! # Why Huffman, and why these lanes
//!
//! The decoder must run far above the link rate on a GPU (≥ 110 GB/s of output on an
//! H200). Of the two usual entropy coders, rANS needs a multiply, a divide-free but
//! dependent state update and a renormalisation per symbol and codes within 0.01 bit of the
//! entropy; Huffman needs one table lookup and a shift, and on this source (a peaked,
//! geometric-tailed distribution) loses about 0.05 bit per word to it (N(0, 0.02): entropy
//! 2.545 bits, coded in 2.66 bits per word with the lanes' padding, a ratio of 0.667). Huffman wins on
//! decode speed for a small loss, so:
//!
//! - codes are **length-limited to 12 bits** (package-merge, optimal under the limit) so a
//!   single decode table of at most `2^12` `u16` entries (8 KiB, stored in the unit so the
//!   kernel builds nothing) sits in shared memory and every symbol is one lookup — no
//!   escape path; each unit takes the limit (up to 12) that makes it smallest, table
//!   included, so small units get a small table;
//! - a unit is cut into **chunks of 4,096 words**, each with one stored stream offset, so
//!   chunks decode in parallel (a 16 MiB unit is 2,048 chunks: one warp each);
//! - inside a chunk the words are dealt to **32 interleaved lanes** in groups of 4, each
//!   lane its own bit string, and the lanes' 16-bit words are interleaved in the order a
//!   warp in lockstep asks for them (refills in lane order, by ballot), so a warp decodes a
//!   chunk with one thread per lane, reads the raw bytes and writes the 16-bit outputs
//!   coalesced (a `u32` of 4 sign+mantissa bytes in, a `u64` of 4 words out per lane per
//!   step), and needs only the chunk's offset; the cost is the unused top of each lane's
//!   last word, 8 bits per lane per chunk on average (about 0.06 bit per word);
//! - the checksum is defined lane by lane in the same order, so the kernel can verify it
//!   in registers as it writes.
//!
//! # API
//!
//! - [`encode_unit`] (one unit, calling thread), [`Encoder`] / [`encode_units_parallel`]
//!   (many units on every core) → [`EncodedUnit`] (bytes, [`UnitHeader`], [`Stats`]);
//! - [`max_encoded_len`] (bound before encoding), [`EncodedUnit::len`] /
//!   [`UnitHeader::encoded_len`] (exact after);
//! - [`decode_unit`] / [`decode_unit_parallel`] / [`decode_units_parallel`] (host decode,
//!   verified);
//!   [`decoded_len`] sizes the output;
//! - [`UnitHeader::parse`]: the validated header with every section's offset — what a GPU
//!   launch takes;
//! - [`Stats`]: compressed bytes, ratio, exponent entropy (Shannon) and coded bits,
//!   mergeable over units;
//! - [`cache`]: a versioned file of coded units checked against a caller's [`cache::CacheKey`]
//!   ([`cache::write_cache`], atomic; [`cache::read_cache`], stale or corrupt files reported,
//!   never used; [`cache::open_cache`] checks the header, key and index and then reads the
//!   payload straight into a caller's buffer, checking every unit), so weights are coded
//!   once rather than at every attach.

pub mod cache;
pub mod decode;
pub mod encode;
pub mod error;
pub mod files;
pub mod format;
pub mod hash;
mod huffman;
pub mod stats;

#[cfg(test)]
mod tests;

pub use decode::{decode_unit, decode_unit_parallel, decode_units_parallel};
pub use encode::{EncodedUnit, Encoder, encode_unit, encode_unit_into, encode_units_parallel};
pub use error::{CodecError, Result};
pub use format::{
    CHUNK_WORDS, GROUP, HEADER_BYTES, LANES, MAX_CHUNK_STREAM_WORDS, Mode, SECTION_ALIGN,
    UnitHeader, VERSION, decoded_len, max_encoded_len,
};
pub use hash::checksum;
pub use huffman::MAX_CODE_LEN;
pub use stats::Stats;
