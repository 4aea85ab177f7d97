//! The host decoder: [`decode_unit`] (one unit on the calling thread),
//! [`decode_unit_parallel`] (one unit's chunks on several threads) and
//! [`decode_units_parallel`]. It decodes exactly as the GPU kernel does — 32 lanes per
//! chunk in lockstep, refills in lane order (see `encode.rs`) — so a unit the host decodes
//! bit for bit is one the GPU decodes bit for bit.
//!
//! Nothing is trusted: the header and tables are validated first
//! ([`UnitHeader::parse`]), every stream read is bounds-checked, each chunk must consume
//! its stream exactly and leave only zero padding bits, and the decoded words must match
//! the stored checksum. Any defect is a typed error; on an error, `out` holds garbage.

use crate::encode::run_parallel;
use crate::error::{CodecError, Result};
use crate::format::{CHUNK_WORDS, GROUP, LANES, MAX_CHUNK_STREAM_WORDS, Mode, UnitHeader};
use crate::hash;

/// Decodes the unit `encoded` into `out` (exactly [`UnitHeader::decoded_len`] bytes:
/// the words' little-endian bytes) and checks the result against the unit's checksum.
///
/// Errors: a malformed or corrupt unit, a wrong `out` length, a stream that does not
/// decode, or [`CodecError::ChecksumMismatch`]. After an error `out`'s contents are
/// unspecified (garbage) and must not be used.
pub fn decode_unit(encoded: &[u8], out: &mut [u8]) -> Result<()> {
    let header = UnitHeader::parse(encoded)?;
    decode_parsed(&header, encoded, out)
}

/// [`decode_unit`] with the unit's chunks shared among up to `threads` threads (a large
/// coded tensor read on the host: each thread decodes a run of whole chunks, and their
/// checksum parts add up to the unit's). Same checks, same errors (of the lowest failing
/// chunk), same output as [`decode_unit`].
pub fn decode_unit_parallel(encoded: &[u8], out: &mut [u8], threads: usize) -> Result<()> {
    let header = UnitHeader::parse(encoded)?;
    if header.mode() == Mode::Raw || threads <= 1 {
        return decode_parsed(&header, encoded, out);
    }
    check_out_len(&header, out)?;
    let chunk_bytes = 2 * CHUNK_WORDS;
    let chunks = out.len().div_ceil(chunk_bytes);
    let per = chunks.div_ceil(threads.min(chunks).max(1)).max(1);
    let parts: Vec<std::sync::Mutex<(usize, &mut [u8])>> = out
        .chunks_mut(per * chunk_bytes)
        .enumerate()
        .map(|(i, o)| std::sync::Mutex::new((i * per, o)))
        .collect();
    let sums = run_parallel(parts.len(), parts.len(), |i| {
        let mut part = parts[i]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (first, ref mut o) = *part;
        decode_chunks(&header, encoded, first, o)
    })?;
    let sum = sums.into_iter().fold(0u64, u64::wrapping_add);
    check_sum(&header, hash::finish(sum, header.word_count()))
}

/// The typed error for an output buffer not of the unit's decoded length.
fn check_out_len(header: &UnitHeader, out: &[u8]) -> Result<()> {
    if out.len() as u64 != header.decoded_len() {
        return Err(CodecError::OutputSize {
            expected: header.decoded_len(),
            got: out.len() as u64,
        });
    }
    Ok(())
}

/// The checksum check of a decoded unit.
fn check_sum(header: &UnitHeader, computed: u64) -> Result<()> {
    if computed != header.checksum() {
        return Err(CodecError::ChecksumMismatch {
            stored: header.checksum(),
            computed,
        });
    }
    Ok(())
}

/// [`decode_unit`] with the header parsed already (from these bytes).
pub(crate) fn decode_parsed(header: &UnitHeader, encoded: &[u8], out: &mut [u8]) -> Result<()> {
    check_out_len(header, out)?;
    let computed = match header.mode() {
        Mode::Raw => {
            let at = header.mantissa_offset() as usize;
            out.copy_from_slice(&encoded[at..at + out.len()]);
            hash::checksum(out)
        }
        Mode::Huffman => decode_huffman(header, encoded, out)?,
    };
    check_sum(header, computed)
}

/// Decodes the chunks of a Huffman unit into `out`; returns the checksum of what it wrote.
fn decode_huffman(header: &UnitHeader, b: &[u8], out: &mut [u8]) -> Result<u64> {
    let sum = decode_chunks(header, b, 0, out)?;
    Ok(hash::finish(sum, header.word_count()))
}

/// Decodes the Huffman unit's chunks from chunk `first` on into `out` (whole chunks, the
/// last of the unit possibly shorter); returns the sum of their checksum parts.
fn decode_chunks(header: &UnitHeader, b: &[u8], first: usize, out: &mut [u8]) -> Result<u64> {
    let lut_at = header.decode_table_offset() as usize;
    let lut: Vec<u16> = b[lut_at..lut_at + (2usize << header.max_code_len())]
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect();
    let mask = (1usize << header.max_code_len()) - 1;
    let mant_at = header.mantissa_offset() as usize;
    let stream_at = header.stream_offset() as usize;
    let mut stream = [0u16; MAX_CHUNK_STREAM_WORDS];
    let mut sum = 0u64;
    for (i, out_chunk) in out.chunks_mut(2 * CHUNK_WORDS).enumerate() {
        let k = first + i;
        let k64 = k as u64;
        let corrupt = |reason| CodecError::CorruptStream { chunk: k64, reason };
        let (from, to) = (header.chunk_start(b, k64), header.chunk_start(b, k64 + 1));
        // The parsed chunk table is monotone and each span fits MAX_CHUNK_STREAM_WORDS.
        let len = (to - from) as usize;
        let src = &b[stream_at + 2 * from as usize..stream_at + 2 * to as usize];
        for (w, c) in stream.iter_mut().zip(src.chunks_exact(2)) {
            *w = u16::from_le_bytes([c[0], c[1]]);
        }
        let n = out_chunk.len() / 2;
        let mant = &b[mant_at + k * CHUNK_WORDS..mant_at + k * CHUNK_WORDS + n];
        let mut buf = [0u32; LANES];
        let mut bits = [0u32; LANES];
        let mut pos = 0usize;
        let mut step = 0;
        while step * LANES * GROUP < n {
            for r in 0..GROUP {
                for j in 0..LANES {
                    let w = step * LANES * GROUP + GROUP * j + r;
                    if w >= n {
                        break;
                    }
                    let mut e = lut[buf[j] as usize & mask];
                    let mut l = u32::from(e >> 8);
                    if l > bits[j] {
                        if pos >= len {
                            return Err(corrupt("a lane reads past the chunk's stream"));
                        }
                        buf[j] |= u32::from(stream[pos]) << bits[j];
                        bits[j] += 16;
                        pos += 1;
                        e = lut[buf[j] as usize & mask];
                        l = u32::from(e >> 8);
                    }
                    if l == 0 {
                        return Err(corrupt("bits that start no code"));
                    }
                    buf[j] >>= l;
                    bits[j] -= l;
                    let m = u16::from(mant[w]);
                    let v = (m & 0x80) << 8 | (e & 0xff) << 7 | (m & 0x7f);
                    out_chunk[2 * w..2 * w + 2].copy_from_slice(&v.to_le_bytes());
                }
            }
            step += 1;
        }
        if pos != len {
            return Err(corrupt("the lanes leave part of the chunk's stream unread"));
        }
        if buf.iter().any(|&x| x != 0) {
            return Err(corrupt("a lane's padding bits are not zero"));
        }
        sum = sum.wrapping_add(hash::chunk_part(k64, out_chunk));
    }
    Ok(sum)
}

/// Decodes each `(encoded, out)` pair ([`decode_unit`]) on up to `threads` threads; the
/// error of the first failing pair (by position) if any fails.
pub fn decode_units_parallel(pairs: &mut [(&[u8], &mut [u8])], threads: usize) -> Result<()> {
    let cells: Vec<std::sync::Mutex<&mut (&[u8], &mut [u8])>> =
        pairs.iter_mut().map(std::sync::Mutex::new).collect();
    run_parallel(threads, cells.len(), |i| {
        let mut pair = cells[i]
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (encoded, out) = &mut **pair;
        decode_unit(encoded, out)
    })
    .map(|_| ())
}
