//! The byte format of one encoded unit (version 1) and its validated header,
//! [`UnitHeader`].
//!
//! All integers are little-endian; every section starts at a multiple of 16 bytes from the
//! unit's start, and every padding byte is zero. The 96-byte header:
//!
//! | offset | field | |
//! | --- | --- | --- |
//! | 0 | `[u8; 4]` magic `DDOC` | |
//! | 4 | `u16` version | 1 |
//! | 6 | `u8` mode | 0 raw, 1 Huffman |
//! | 7 | `u8` max code length | 1..=12 (0: raw, or no words) |
//! | 8 | `u64` word count `n` | |
//! | 16 | `u64` encoded length | the whole unit, a multiple of 16 |
//! | 24 | `u64` checksum | of the decoded words ([`crate::checksum`]) |
//! | 32 | `u64` metadata hash | header (this field zero), table, decode table, chunk table |
//! | 40 | `u32` chunk words | 4096 (Huffman), 0 (raw) |
//! | 44 | `u16` symbol count | distinct exponents with a code |
//! | 46 | `u16` reserved | 0 |
//! | 48 | `u64` table offset | Huffman: 96 |
//! | 56 | `u64` decode-table offset | |
//! | 64 | `u64` chunk-table offset | |
//! | 72 | `u64` mantissa offset | raw: the words themselves |
//! | 80 | `u64` stream offset | |
//! | 88 | `u64` stream words | 16-bit words of entropy-coded exponents |
//!
//! Huffman sections, in order: the **code table** (`u16` counts of 1- to 12-bit codes, then
//! the symbols in canonical order, one byte each); the **decode table** (`2^max_len` `u16`
//! entries `len << 8 | exponent`); the **chunk table** (`chunks + 1` `u32`s: where each
//! chunk's stream starts, in 16-bit words from the stream's start; the last is the
//! stream's length); the **sign+mantissa bytes** (`n` bytes, `sign << 7 | mantissa` of
//! each word); the **exponent stream** (`u16`s). Raw sections: the `2n` bytes of the words at the
//! mantissa offset, nothing else (offsets of absent sections are 0).
//!
//! A chunk is [`CHUNK_WORDS`] words (the last may be shorter); its exponents are coded as
//! [`LANES`] interleaved lanes so a GPU warp decodes one chunk with a lane per thread: see
//! `encode.rs`.

use crate::error::{CodecError, Result};
use crate::hash::meta_hash;
use crate::huffman::{CodeTable, MAX_CODE_LEN};

/// The magic every unit starts with.
pub const MAGIC: [u8; 4] = *b"DDOC";
/// The format version this build reads and writes.
pub const VERSION: u16 = 1;
/// Bytes of the fixed header.
pub const HEADER_BYTES: usize = 96;
/// Words per chunk: the unit of parallel decoding (one GPU warp each).
pub const CHUNK_WORDS: usize = 4096;
/// Interleaved lanes per chunk (a warp's threads).
pub const LANES: usize = 32;
/// Consecutive words a lane decodes per step (one `u64` store).
pub const GROUP: usize = 4;
/// Most 16-bit stream words one chunk can have: 32 lanes × 128 symbols × 12 bits / 16.
pub const MAX_CHUNK_STREAM_WORDS: usize =
    LANES * (CHUNK_WORDS / LANES) * MAX_CODE_LEN as usize / 16;
/// Alignment of every section (and of the unit's length).
pub const SECTION_ALIGN: usize = 16;
/// Bytes of the code table's length counts.
const COUNTS_BYTES: usize = 2 * MAX_CODE_LEN as usize;

/// How a unit stores its words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The words as they are (they did not compress).
    Raw,
    /// Sign+mantissa bytes and Huffman-coded exponents.
    Huffman,
}

/// A unit's header, checked against its bytes by [`UnitHeader::parse`]: the layout is the
/// one the format defines for its fields, the code and decode tables are valid and agree,
/// the chunk table is in bounds, the padding is zero and the metadata hash matches. Only
/// the checksum of the decoded words is left to the decoder. A GPU decoder may therefore
/// trust every offset and length of a parsed header for these bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitHeader {
    mode: Mode,
    max_code_len: u8,
    word_count: u64,
    encoded_len: u64,
    checksum: u64,
    symbol_count: u16,
    layout: Layout,
}

/// Section offsets (bytes from the unit's start) and sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Layout {
    pub table: u64,
    pub lut: u64,
    pub chunks: u64,
    pub mantissa: u64,
    pub stream: u64,
    pub stream_words: u64,
    pub end: u64,
}

/// `x` rounded up to [`SECTION_ALIGN`], `None` on overflow.
fn align(x: u64) -> Option<u64> {
    x.checked_add(SECTION_ALIGN as u64 - 1)
        .map(|v| v & !(SECTION_ALIGN as u64 - 1))
}

/// Chunks of `words` words.
pub(crate) fn chunk_count(words: u64) -> u64 {
    words.div_ceil(CHUNK_WORDS as u64)
}

impl Layout {
    /// The raw layout of `words` words.
    pub fn raw(words: u64) -> Option<Layout> {
        let mantissa = HEADER_BYTES as u64;
        let end = align(mantissa.checked_add(words.checked_mul(2)?)?)?;
        Some(Layout {
            mantissa,
            end,
            ..Layout::default()
        })
    }

    /// The Huffman layout of `words` words with `symbols` codes, a decode table of
    /// `2^max_len` entries and `stream_words` 16-bit stream words.
    pub fn huffman(words: u64, symbols: u64, max_len: u8, stream_words: u64) -> Option<Layout> {
        let table = HEADER_BYTES as u64;
        let lut = align(table + COUNTS_BYTES as u64 + symbols)?;
        let chunks = align(lut + (2u64 << max_len))?;
        let mantissa = align(chunks.checked_add(chunk_count(words).checked_add(1)? * 4)?)?;
        let stream = align(mantissa.checked_add(words)?)?;
        let end = align(stream.checked_add(stream_words.checked_mul(2)?)?)?;
        Some(Layout {
            table,
            lut,
            chunks,
            mantissa,
            stream,
            stream_words,
            end,
        })
    }
}

/// Reads a little-endian integer of `N` bytes at `at` (the caller checked the bounds).
fn le<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&b[at..at + N]);
    out
}

/// The fields as the header stores them (before validation).
struct RawFields {
    magic: [u8; 4],
    version: u16,
    mode: u8,
    max_len: u8,
    words: u64,
    encoded_len: u64,
    checksum: u64,
    meta: u64,
    chunk_words: u32,
    symbols: u16,
    reserved: u16,
    layout: Layout,
}

impl RawFields {
    fn read(b: &[u8]) -> RawFields {
        let u64_at = |at| u64::from_le_bytes(le(b, at));
        RawFields {
            magic: le(b, 0),
            version: u16::from_le_bytes(le(b, 4)),
            mode: b[6],
            max_len: b[7],
            words: u64_at(8),
            encoded_len: u64_at(16),
            checksum: u64_at(24),
            meta: u64_at(32),
            chunk_words: u32::from_le_bytes(le(b, 40)),
            symbols: u16::from_le_bytes(le(b, 44)),
            reserved: u16::from_le_bytes(le(b, 46)),
            layout: Layout {
                table: u64_at(48),
                lut: u64_at(56),
                chunks: u64_at(64),
                mantissa: u64_at(72),
                stream: u64_at(80),
                stream_words: u64_at(88),
                end: u64_at(16),
            },
        }
    }
}

/// Writes the header of a unit into `out[..HEADER_BYTES]`, with a zero metadata hash.
pub(crate) fn write_header(out: &mut [u8], h: &UnitHeader) {
    let l = &h.layout;
    out[..4].copy_from_slice(&MAGIC);
    out[4..6].copy_from_slice(&VERSION.to_le_bytes());
    out[6] = match h.mode {
        Mode::Raw => 0,
        Mode::Huffman => 1,
    };
    out[7] = h.max_code_len;
    out[8..16].copy_from_slice(&h.word_count.to_le_bytes());
    out[16..24].copy_from_slice(&h.encoded_len.to_le_bytes());
    out[24..32].copy_from_slice(&h.checksum.to_le_bytes());
    out[32..40].fill(0);
    let chunk_words = if h.mode == Mode::Huffman {
        CHUNK_WORDS as u32
    } else {
        0
    };
    out[40..44].copy_from_slice(&chunk_words.to_le_bytes());
    out[44..46].copy_from_slice(&h.symbol_count.to_le_bytes());
    out[46..48].fill(0);
    for (at, v) in [
        (48, l.table),
        (56, l.lut),
        (64, l.chunks),
        (72, l.mantissa),
        (80, l.stream),
        (88, l.stream_words),
    ] {
        out[at..at + 8].copy_from_slice(&v.to_le_bytes());
    }
}

/// The metadata hash of a unit's bytes (header with its hash field zeroed, the tables).
pub(crate) fn unit_meta_hash(b: &[u8], layout: &Layout, mode: Mode) -> u64 {
    let mut header = [0u8; HEADER_BYTES];
    header.copy_from_slice(&b[..HEADER_BYTES]);
    header[32..40].fill(0);
    match mode {
        Mode::Raw => meta_hash(&[&header]),
        Mode::Huffman => meta_hash(&[&header, &b[layout.table as usize..layout.mantissa as usize]]),
    }
}

fn bad(field: &'static str, reason: impl Into<String>) -> CodecError {
    CodecError::BadHeader {
        field,
        reason: reason.into(),
    }
}

impl UnitHeader {
    /// A header for the encoder.
    pub(crate) fn new(
        mode: Mode,
        max_code_len: u8,
        word_count: u64,
        checksum: u64,
        symbol_count: u16,
        layout: Layout,
    ) -> Self {
        Self {
            mode,
            max_code_len,
            word_count,
            encoded_len: layout.end,
            checksum,
            symbol_count,
            layout,
        }
    }

    /// Parses and validates the header of the unit `encoded` (exactly one whole unit); see
    /// the type's docs for what is checked. Never panics; every defect is a typed error.
    pub fn parse(encoded: &[u8]) -> Result<UnitHeader> {
        let got = encoded.len() as u64;
        if encoded.len() < HEADER_BYTES {
            return Err(CodecError::Truncated {
                needed: HEADER_BYTES as u64,
                got,
            });
        }
        let f = RawFields::read(encoded);
        if f.magic != MAGIC {
            return Err(CodecError::BadMagic { found: f.magic });
        }
        if f.version != VERSION {
            return Err(CodecError::UnsupportedVersion {
                found: f.version,
                supported: VERSION,
            });
        }
        if f.encoded_len > got {
            return Err(CodecError::Truncated {
                needed: f.encoded_len,
                got,
            });
        }
        if f.encoded_len < got {
            return Err(CodecError::TrailingBytes {
                expected: f.encoded_len,
                got,
            });
        }
        if f.reserved != 0 {
            return Err(bad("reserved", "is not zero"));
        }
        let mode = match f.mode {
            0 => Mode::Raw,
            1 => Mode::Huffman,
            m => {
                return Err(bad(
                    "mode",
                    format!("{m} is neither 0 (raw) nor 1 (Huffman)"),
                ));
            }
        };
        let too_large = CodecError::TooLarge { words: f.words };
        let want = match mode {
            Mode::Raw => {
                if f.max_len != 0 || f.symbols != 0 || f.chunk_words != 0 {
                    return Err(bad(
                        "max code length, symbol count or chunk words",
                        "is not zero in a raw unit",
                    ));
                }
                Layout::raw(f.words).ok_or(too_large)?
            }
            Mode::Huffman => {
                if f.chunk_words != CHUNK_WORDS as u32 {
                    return Err(bad(
                        "chunk words",
                        format!("is {}, expected {CHUNK_WORDS}", f.chunk_words),
                    ));
                }
                if f.max_len > MAX_CODE_LEN || u64::from(f.symbols) > 256 {
                    return Err(bad(
                        "max code length or symbol count",
                        format!("{} / {} out of range", f.max_len, f.symbols),
                    ));
                }
                if (f.words == 0) != (f.symbols == 0) {
                    return Err(bad("symbol count", "disagrees with the word count"));
                }
                Layout::huffman(
                    f.words,
                    u64::from(f.symbols),
                    f.max_len,
                    f.layout.stream_words,
                )
                .ok_or(too_large)?
            }
        };
        if want.end != f.encoded_len {
            return Err(bad(
                "encoded length",
                format!(
                    "is {}, the other fields call for {}",
                    f.encoded_len, want.end
                ),
            ));
        }
        if want != f.layout {
            return Err(bad(
                "section offsets",
                format!("{:?} differ from the format's {want:?}", f.layout),
            ));
        }
        let computed = unit_meta_hash(encoded, &want, mode);
        if computed != f.meta {
            return Err(CodecError::MetadataHashMismatch {
                stored: f.meta,
                computed,
            });
        }
        let header = UnitHeader {
            mode,
            max_code_len: f.max_len,
            word_count: f.words,
            encoded_len: f.encoded_len,
            checksum: f.checksum,
            symbol_count: f.symbols,
            layout: want,
        };
        if mode == Mode::Huffman {
            header.check_tables(encoded)?;
        }
        header.check_padding(encoded)?;
        Ok(header)
    }

    /// The code table stored in `b` (bounds from a validated layout).
    pub(crate) fn code_table(&self, b: &[u8]) -> CodeTable {
        let t = self.layout.table as usize;
        let mut counts = [0u16; MAX_CODE_LEN as usize + 1];
        for (l, c) in counts.iter_mut().enumerate().skip(1) {
            *c = u16::from_le_bytes(le(b, t + 2 * (l - 1)));
        }
        let s = t + COUNTS_BYTES;
        CodeTable {
            counts,
            symbols: b[s..s + self.symbol_count as usize].to_vec(),
        }
    }

    /// Entry `i` of the chunk table.
    pub(crate) fn chunk_start(&self, b: &[u8], i: u64) -> u64 {
        u64::from(u32::from_le_bytes(le(
            b,
            (self.layout.chunks + 4 * i) as usize,
        )))
    }

    fn check_tables(&self, b: &[u8]) -> Result<()> {
        let table = self.code_table(b);
        table.validate()?;
        if table.max_len() != self.max_code_len {
            return Err(bad(
                "max code length",
                format!(
                    "is {}, the code table's is {}",
                    self.max_code_len,
                    table.max_len()
                ),
            ));
        }
        let lut = table.decode_table();
        let at = self.layout.lut as usize;
        let stored = b[at..at + 2 * lut.len()]
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]));
        if !lut.iter().copied().eq(stored) {
            return Err(CodecError::BadTable {
                reason: "the decode table does not match the code table".into(),
            });
        }
        let chunks = self.chunk_count();
        let mut prev = self.chunk_start(b, 0);
        if prev != 0 {
            return Err(bad("chunk table", "does not start at 0"));
        }
        for i in 1..=chunks {
            let next = self.chunk_start(b, i);
            if next < prev || next - prev > MAX_CHUNK_STREAM_WORDS as u64 {
                return Err(bad(
                    "chunk table",
                    format!("chunk {} spans stream words {prev}..{next}", i - 1),
                ));
            }
            prev = next;
        }
        if prev != self.layout.stream_words {
            return Err(bad(
                "chunk table",
                format!(
                    "ends at {prev}, the stream has {} words",
                    self.layout.stream_words
                ),
            ));
        }
        Ok(())
    }

    /// The gaps between sections and after the last are zero.
    fn check_padding(&self, b: &[u8]) -> Result<()> {
        let l = &self.layout;
        let gaps: Vec<(u64, u64)> = match self.mode {
            Mode::Raw => vec![(l.mantissa + 2 * self.word_count, l.end)],
            Mode::Huffman => vec![
                (
                    l.table + COUNTS_BYTES as u64 + u64::from(self.symbol_count),
                    l.lut,
                ),
                (l.lut + (2u64 << self.max_code_len), l.chunks),
                (l.chunks + 4 * (self.chunk_count() + 1), l.mantissa),
                (l.mantissa + self.word_count, l.stream),
                (l.stream + 2 * l.stream_words, l.end),
            ],
        };
        for (from, to) in gaps {
            if let Some(i) = b[from as usize..to as usize].iter().position(|&x| x != 0) {
                return Err(CodecError::NonZeroPadding {
                    offset: from + i as u64,
                });
            }
        }
        Ok(())
    }

    /// How the unit stores its words.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Words (bf16 values) in the unit.
    pub fn word_count(&self) -> u64 {
        self.word_count
    }

    /// Bytes the unit decodes to (`2 * word_count`).
    pub fn decoded_len(&self) -> u64 {
        2 * self.word_count
    }

    /// Bytes of the whole encoded unit.
    pub fn encoded_len(&self) -> u64 {
        self.encoded_len
    }

    /// The checksum of the decoded words ([`crate::checksum`]).
    pub fn checksum(&self) -> u64 {
        self.checksum
    }

    /// Longest exponent code in bits; the decode table has `2^max_code_len` entries (0 for
    /// raw units and units without words).
    pub fn max_code_len(&self) -> u8 {
        self.max_code_len
    }

    /// Distinct exponents with a code (0 for raw units).
    pub fn symbol_count(&self) -> u16 {
        self.symbol_count
    }

    /// Chunks of [`CHUNK_WORDS`] words (the last may be shorter).
    pub fn chunk_count(&self) -> u64 {
        chunk_count(self.word_count)
    }

    /// Offset of the decode table (`2^max_code_len` `u16` entries); 0 for raw units.
    pub fn decode_table_offset(&self) -> u64 {
        self.layout.lut
    }

    /// Offset of the chunk table (`chunk_count + 1` `u32` stream offsets); 0 for raw units.
    pub fn chunk_table_offset(&self) -> u64 {
        self.layout.chunks
    }

    /// Offset of the sign+mantissa bytes (raw units: of the words themselves).
    pub fn mantissa_offset(&self) -> u64 {
        self.layout.mantissa
    }

    /// Offset of the exponent stream; 0 for raw units.
    pub fn stream_offset(&self) -> u64 {
        self.layout.stream
    }

    /// 16-bit words in the exponent stream.
    pub fn stream_words(&self) -> u64 {
        self.layout.stream_words
    }

    pub(crate) fn layout(&self) -> &Layout {
        &self.layout
    }
}

/// The most bytes a unit of `word_bytes` bytes of words encodes to (the raw layout: the
/// encoder stores a unit raw when coding would not make it smaller); `None` if that does
/// not fit a `u64`.
pub fn max_encoded_len(word_bytes: usize) -> Option<u64> {
    Layout::raw((word_bytes / 2) as u64).map(|l| l.end)
}

/// The decoded length of the unit `encoded` (parsed and validated), for sizing the output.
pub fn decoded_len(encoded: &[u8]) -> Result<u64> {
    UnitHeader::parse(encoded).map(|h| h.decoded_len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_are_aligned_and_in_order() {
        for words in [1u64, 4095, 4096, 4097, 1 << 23] {
            let l = Layout::huffman(words, 40, 12, 12345).unwrap();
            let offsets = [l.table, l.lut, l.chunks, l.mantissa, l.stream, l.end];
            assert!(
                offsets.iter().all(|o| o % SECTION_ALIGN as u64 == 0),
                "{l:?}"
            );
            assert!(offsets.windows(2).all(|w| w[0] < w[1]), "{l:?}");
        }
        assert_eq!(Layout::raw(0).unwrap().end, HEADER_BYTES as u64);
        assert_eq!(Layout::raw(3).unwrap().end, 112);
        assert!(Layout::raw(u64::MAX / 2).is_none());
        assert!(Layout::huffman(u64::MAX - 3, 1, 1, 1).is_none());
        assert_eq!(max_encoded_len(2 * 4096), Some(96 + 8192));
    }

    #[test]
    fn the_largest_chunk_stream_is_what_twelve_bit_codes_take() {
        assert_eq!(MAX_CHUNK_STREAM_WORDS, 3072);
        assert_eq!(CHUNK_WORDS % (LANES * GROUP), 0);
    }

    #[test]
    fn short_and_foreign_bytes_are_refused() {
        assert!(matches!(
            UnitHeader::parse(&[0u8; 10]),
            Err(CodecError::Truncated {
                needed: 96,
                got: 10
            })
        ));
        assert!(matches!(
            UnitHeader::parse(&[0u8; 96]),
            Err(CodecError::BadMagic { .. })
        ));
    }
}
