//! The encoder: [`encode_unit`] on one thread, [`Encoder`] over units on every core.
//!
//! # The lanes of a chunk
//!
//! A chunk's words are dealt to [`LANES`] lanes in groups of [`GROUP`]: at step `t` lane
//! `j` owns words `128t + 4j .. 128t + 4j + 4` of the chunk (the ones that exist). Each lane
//! codes its own words' exponents, in order, into its own bit string (least significant
//! bit first), cut into 16-bit stream words. The chunk's stream holds those words interleaved in the
//! order a decoding warp asks for them, which is what lets 32 threads decode one chunk in
//! lockstep with a single stored offset:
//!
//! - a decoding lane keeps a bit buffer and its count of valid bits (`bits`, starting at 0);
//! - sub-steps run `(t, r)` for `r` in `0..4`; at each, every lane that owns word
//!   `128t + 4j + r` looks its next `max_len` bits up in the decode table; when the code
//!   found is longer than `bits` it **refills**: takes the next 16-bit word of the chunk's
//!   stream into its buffer above its valid bits (`bits += 16`; a 32-bit buffer suffices,
//!   as `bits` stays below 12 + 16) and looks up again;
//! - the refilling lanes of one sub-step take consecutive words in lane order (a warp's
//!   ballot and population count), so the stream is exactly the lanes' words sorted by
//!   (sub-step at which the lane first needs it, lane).
//!
//! A lane needs its `k`-th word exactly when the code it is decoding ends past bit `16k`
//! of its string (a prefix-free code found among zero-padded bits is longer than the valid
//! bits whenever the real one is), so the encoder knows the order from the code lengths
//! alone: it records, per lane, the sub-step of each word's first use and sorts with a
//! per-sub-step bitmask of lanes. A lane reads exactly the words its string fills, so the
//! only padding is the unused top of each lane's last word (zero, and checked so): 8 bits
//! per lane per chunk on average, about 0.06 bit per word. (32-bit stream words would
//! double that; on a GPU the refill costs the same either way, since with 32 lanes some
//! lane refills at almost every sub-step.)

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::error::{CodecError, Result};
use crate::format::{
    CHUNK_WORDS, GROUP, HEADER_BYTES, LANES, Layout, Mode, UnitHeader, max_encoded_len,
    unit_meta_hash, write_header,
};
use crate::hash;
use crate::huffman::{CodeTable, MAX_CODE_LEN, best_code_lengths};
use crate::stats::Stats;

/// Words of one step of a chunk (32 lanes × 4).
const STEP_WORDS: usize = LANES * GROUP;
/// Sub-steps of a full chunk.
const SUB_STEPS: usize = CHUNK_WORDS / LANES;
/// Room per lane for its stream words (at most 128 × 12 / 16 = 96), a power of two so the
/// index can be masked instead of bounds-checked.
const LANE_ROOM: usize = 128;

/// One encoded unit: its bytes, its parsed header and its figures.
#[derive(Debug, Clone)]
pub struct EncodedUnit {
    bytes: Vec<u8>,
    header: UnitHeader,
    stats: Stats,
}

impl EncodedUnit {
    /// The unit's bytes (the format of [`crate::format`]).
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The unit's bytes, owned.
    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }

    /// Bytes of the encoded unit (a multiple of 16, never 0).
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Always false: a unit has at least its header.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The unit's header (what a GPU decode needs besides the bytes).
    pub fn header(&self) -> &UnitHeader {
        &self.header
    }

    /// The unit's figures.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }
}

/// Per-chunk working memory of the encoder.
struct Scratch {
    exps: [u8; CHUNK_WORDS],
    lane_words: [LaneWords; LANES],
    first_use: [[u8; LANE_ROOM]; LANES],
    lane_len: [usize; LANES],
}

impl Scratch {
    fn new() -> Box<Scratch> {
        Box::new(Scratch {
            exps: [0; CHUNK_WORDS],
            lane_words: [[0; 2 * (LANE_ROOM + GROUP)]; LANES],
            first_use: [[0; LANE_ROOM]; LANES],
            lane_len: [0; LANES],
        })
    }
}

/// One lane's bit packing in the encoder, a group of (up to) four symbols at a time.
#[derive(Debug, Clone, Copy, Default)]
struct Lane {
    /// Bits of the lane's string past its last finished word (fewer than 16 between
    /// groups, at most 63 within one).
    acc: u64,
    /// Bits of the lane's string so far: `pos / 16` words are finished.
    pos: u32,
}

/// A lane's stream words, as bytes, with room for a whole 8-byte store past the last.
type LaneWords = [u8; 2 * (LANE_ROOM + GROUP)];

impl Lane {
    /// Appends the codes of the exponents `exps` (four bytes of a `u32`; the first `have`
    /// are coded) of sub-steps `step0..step0 + have`; branch-free.
    #[inline(always)]
    fn group(
        &mut self,
        exps: u32,
        have: usize,
        step0: u8,
        codes: &[u32; 256],
        words: &mut LaneWords,
        first: &mut [u8; LANE_ROOM],
    ) {
        let base = self.pos & !15;
        let mut acc = self.acc;
        let mut pos = self.pos;
        for r in 0..have {
            let cl = codes[(exps >> (8 * r)) as u8 as usize];
            acc |= u64::from(cl & 0xffff) << (pos - base);
            // The decoder refills when the code ends past the words taken so far: the
            // word count ceil(pos / 16) goes up. The last step written at an index before
            // it goes up is the one that takes that word.
            first[((pos + 15) >> 4) as usize & (LANE_ROOM - 1)] = step0 + r as u8;
            pos += cl >> 16;
        }
        // The words finished and the one being filled (rewritten until it is).
        let at = 2 * ((base >> 4) as usize & (LANE_ROOM - 1));
        words[at..at + 8].copy_from_slice(&acc.to_le_bytes());
        self.acc = acc >> ((pos - base) & !15);
        self.pos = pos;
    }

    /// [`Lane::group`] of four symbols with the pair table (`pairs`: see [`pair_table`]):
    /// one lookup per two symbols.
    #[inline(always)]
    fn group4(
        &mut self,
        exps: u32,
        step0: u8,
        pairs: &[u32; 1 << 16],
        words: &mut LaneWords,
        first: &mut [u8; LANE_ROOM],
    ) {
        let base = self.pos & !15;
        let mut acc = self.acc;
        let mut pos = self.pos;
        for (i, half) in [exps & 0xffff, exps >> 16].into_iter().enumerate() {
            let p = pairs[half as usize];
            acc |= u64::from(p & 0x00ff_ffff) << (pos - base);
            let step = step0 + 2 * i as u8;
            first[((pos + 15) >> 4) as usize & (LANE_ROOM - 1)] = step;
            pos += (p >> 24) & 15;
            first[((pos + 15) >> 4) as usize & (LANE_ROOM - 1)] = step + 1;
            pos += p >> 28;
        }
        let at = 2 * ((base >> 4) as usize & (LANE_ROOM - 1));
        words[at..at + 8].copy_from_slice(&acc.to_le_bytes());
        self.acc = acc >> ((pos - base) & !15);
        self.pos = pos;
    }

    /// Words the lane's string fills.
    fn len(&self) -> usize {
        self.pos.div_ceil(16) as usize
    }
}

/// The codes of exponent pairs: entry `a | b << 8` is `code(a) | code(b) << len(a)` in
/// the low 24 bits, `len(a)` in bits 24..28 and `len(b)` in bits 28..32 (only pairs of
/// coded exponents are filled).
fn pair_table(codes: &[u32; 256], symbols: &[u8]) -> Box<[u32; 1 << 16]> {
    let mut pairs = Box::new([0u32; 1 << 16]);
    for &a in symbols {
        let (ca, la) = (codes[a as usize] & 0xffff, codes[a as usize] >> 16);
        for &b in symbols {
            let (cb, lb) = (codes[b as usize] & 0xffff, codes[b as usize] >> 16);
            pairs[a as usize | (b as usize) << 8] = (ca | cb << la) | la << 24 | lb << 28;
        }
    }
    pairs
}

/// The exponent histogram of `words` (little-endian bf16 bytes, even length).
fn histogram(words: &[u8]) -> [u64; 256] {
    // Four tables so consecutive equal exponents do not wait on each other's increments.
    let mut h = [[0u32; 256]; 4];
    let mut total = [0u64; 256];
    // Flush before a u32 count could overflow.
    for block in words.chunks(1 << 30) {
        let quads = block.chunks_exact(8);
        let rest = quads.remainder();
        for q in quads {
            h[0][(u16::from_le_bytes([q[0], q[1]]) >> 7) as u8 as usize] += 1;
            h[1][(u16::from_le_bytes([q[2], q[3]]) >> 7) as u8 as usize] += 1;
            h[2][(u16::from_le_bytes([q[4], q[5]]) >> 7) as u8 as usize] += 1;
            h[3][(u16::from_le_bytes([q[6], q[7]]) >> 7) as u8 as usize] += 1;
        }
        for w in rest.chunks_exact(2) {
            h[0][(u16::from_le_bytes([w[0], w[1]]) >> 7) as u8 as usize] += 1;
        }
        for (e, tot) in total.iter_mut().enumerate() {
            *tot += h.iter().map(|x| u64::from(x[e])).sum::<u64>();
        }
        h = [[0; 256]; 4];
    }
    total
}

/// The sign+mantissa bytes and the exponents of four words (a little-endian `u64`), each
/// as four bytes in a `u32`.
#[inline(always)]
fn split4(q: u64) -> (u32, u32) {
    // Bytes 0, 2, 4, 6 of `x` packed into a u32.
    let pack = |x: u64| {
        let x = (x | (x >> 8)) & 0x0000_ffff_0000_ffff;
        (x | (x >> 16)) as u32
    };
    let exps = (q >> 7) & 0x00ff_00ff_00ff_00ff;
    let mant = (q & 0x007f_007f_007f_007f) | ((q >> 8) & 0x0080_0080_0080_0080);
    (pack(mant), pack(exps))
}

/// Splits a chunk's words into sign+mantissa bytes and exponents; returns the chunk's
/// part of the checksum, computed on the way.
fn split_chunk(chunk: u64, words: &[u8], mantissa: &mut [u8], exps: &mut [u8]) -> u64 {
    if words.len() != 2 * CHUNK_WORDS {
        for ((w, m), e) in words
            .chunks_exact(2)
            .zip(mantissa.iter_mut())
            .zip(exps.iter_mut())
        {
            let v = u16::from_le_bytes([w[0], w[1]]);
            *m = ((v >> 8) & 0x80) as u8 | (v & 0x7f) as u8;
            *e = (v >> 7) as u8;
        }
        return hash::chunk_part(chunk, words);
    }
    // A full chunk: rows of 32 u64s, u64 `j` of a row being checksum lane `j`'s.
    let mut lanes = hash::lane_seeds(chunk);
    let (qs, _) = words.as_chunks::<8>();
    let (ms, _) = mantissa.as_chunks_mut::<4>();
    let (es, _) = exps.as_chunks_mut::<4>();
    let rows = qs.as_chunks::<LANES>().0.iter();
    for ((q_row, m_row), e_row) in rows
        .zip(ms.as_chunks_mut::<LANES>().0)
        .zip(es.as_chunks_mut::<LANES>().0)
    {
        for j in 0..LANES {
            let q = u64::from_le_bytes(q_row[j]);
            lanes[j] = hash::round(lanes[j], q);
            let (m, e) = split4(q);
            m_row[j] = m.to_le_bytes();
            e_row[j] = e.to_le_bytes();
        }
    }
    hash::lanes_part(&lanes)
}

/// Encodes chunk `chunk` (`words`: its bytes, at most `2 * CHUNK_WORDS`): its
/// sign+mantissa bytes into `out[mant_at..]`, its stream appended to `out` (little-endian
/// 16-bit words); returns its part of the checksum.
fn encode_chunk(
    chunk: u64,
    words: &[u8],
    codes: &[u32; 256],
    pairs: &[u32; 1 << 16],
    out: &mut Vec<u8>,
    mant_at: usize,
    s: &mut Scratch,
) -> u64 {
    let n = words.len() / 2;
    let part = split_chunk(chunk, words, &mut out[mant_at..mant_at + n], &mut s.exps);
    let stream = out;
    // Each lane on its own: its bit string, and the sub-step of each word's first use.
    let (exps4, _) = s.exps.as_chunks::<GROUP>();
    if n == CHUNK_WORDS {
        // A full chunk: every lane has 32 full groups; two lanes at a time, so the CPU
        // overlaps their independent bit-packing chains.
        let (words2, _) = s.lane_words.as_chunks_mut::<2>();
        let (first2, _) = s.first_use.as_chunks_mut::<2>();
        let (len2, _) = s.lane_len.as_chunks_mut::<2>();
        for (q, ((w2, f2), l2)) in words2.iter_mut().zip(first2).zip(len2).enumerate() {
            let (mut a, mut b) = (Lane::default(), Lane::default());
            let ([wa, wb], [fa, fb]) = (w2, f2);
            for t in 0..CHUNK_WORDS / STEP_WORDS {
                let row = &exps4[t * LANES..];
                let step = (GROUP * t) as u8;
                let ea = u32::from_le_bytes(row[2 * q]);
                let eb = u32::from_le_bytes(row[2 * q + 1]);
                a.group4(ea, step, pairs, wa, fa);
                b.group4(eb, step, pairs, wb, fb);
            }
            *l2 = [a.len(), b.len()];
        }
    } else {
        for j in 0..LANES {
            let mut lane = Lane::default();
            let mut t = 0;
            while t * STEP_WORDS + GROUP * j < n {
                let base = t * STEP_WORDS + GROUP * j;
                let e = u32::from_le_bytes(exps4[base / GROUP]);
                let (words, first) = (&mut s.lane_words[j], &mut s.first_use[j]);
                lane.group(
                    e,
                    (n - base).min(GROUP),
                    (GROUP * t) as u8,
                    codes,
                    words,
                    first,
                );
                t += 1;
            }
            s.lane_len[j] = lane.len();
        }
    }
    // Order: by sub-step of first use, then lane. A lane's words are first used in
    // increasing sub-steps, so walking the sub-steps and, in each, the lanes that take a
    // word emits every lane's words in order. (No population counts: baseline x86-64 has
    // no instruction for them.)
    let mut mask = [0u32; SUB_STEPS];
    let mut total = 0;
    for j in 0..LANES {
        for &st in &s.first_use[j][..s.lane_len[j]] {
            mask[st as usize] |= 1 << j;
        }
        total += s.lane_len[j];
    }
    let start = stream.len();
    stream.resize(start + 2 * total, 0);
    let (out, _) = stream[start..].as_chunks_mut::<2>();
    let mut next = [0usize; LANES];
    let mut o = 0;
    for &m in &mask {
        let mut m = m;
        while m != 0 {
            let j = m.trailing_zeros() as usize;
            m &= m - 1;
            let at = 2 * (next[j] & (LANE_ROOM - 1));
            let w = &s.lane_words[j];
            if let Some(slot) = out.get_mut(o) {
                *slot = [w[at], w[at + 1]];
            }
            o += 1;
            next[j] += 1;
        }
    }
    debug_assert_eq!(o, total);
    part
}

/// The figures of a unit of `words` words with `histogram`.
fn stats_of(words: u64, histogram: [u64; 256], header: &UnitHeader) -> Stats {
    let huffman = header.mode() == Mode::Huffman;
    Stats {
        units: 1,
        raw_units: u64::from(!huffman),
        words,
        encoded_bytes: header.encoded_len(),
        stream_bytes: 2 * header.stream_words(),
        coded_words: if huffman { words } else { 0 },
        exponent_histogram: histogram,
    }
}

/// Writes the header and metadata hash of `bytes` (its sections filled).
fn seal(bytes: &mut [u8], header: &UnitHeader) {
    write_header(bytes, header);
    let meta = unit_meta_hash(bytes, header.layout(), header.mode());
    bytes[32..40].copy_from_slice(&meta.to_le_bytes());
}

/// Writes the raw unit of `words` into `out` (cleared first).
fn raw_into(
    words: &[u8],
    checksum: u64,
    histogram: [u64; 256],
    out: &mut Vec<u8>,
) -> Result<(UnitHeader, Stats)> {
    let n = (words.len() / 2) as u64;
    let layout = Layout::raw(n).ok_or(CodecError::TooLarge { words: n })?;
    out.clear();
    out.resize(HEADER_BYTES, 0);
    out.extend_from_slice(words);
    out.resize(to_usize(layout.end, n)?, 0);
    let header = UnitHeader::new(Mode::Raw, 0, n, checksum, 0, layout);
    seal(out, &header);
    let stats = stats_of(n, histogram, &header);
    Ok((header, stats))
}

fn to_usize(x: u64, words: u64) -> Result<usize> {
    usize::try_from(x).map_err(|_| CodecError::TooLarge { words })
}

/// Encodes one unit of bf16 words (`words`: their little-endian bytes; any even length,
/// 0 included) on the calling thread. The unit is stored raw when coding would not make
/// it smaller, so it never exceeds [`crate::max_encoded_len`].
pub fn encode_unit(words: &[u8]) -> Result<EncodedUnit> {
    let bound = max_encoded_len(words.len()).ok_or(CodecError::TooLarge {
        words: (words.len() / 2) as u64,
    })?;
    let mut bytes = Vec::with_capacity(usize::try_from(bound).unwrap_or(0));
    let (header, stats) = encode_unit_into(words, &mut bytes)?;
    bytes.shrink_to_fit();
    Ok(EncodedUnit {
        bytes,
        header,
        stats,
    })
}

/// [`encode_unit`] into `out` (cleared first, its capacity reused: a caller encoding many
/// units on one thread keeps one buffer and pays for its pages once). Returns the unit's
/// header and figures; `out` then holds exactly the unit.
pub fn encode_unit_into(words: &[u8], out: &mut Vec<u8>) -> Result<(UnitHeader, Stats)> {
    if !words.len().is_multiple_of(2) {
        return Err(CodecError::OddLength { bytes: words.len() });
    }
    let n = (words.len() / 2) as u64;
    let hist = histogram(words);
    let raw_len = Layout::raw(n).ok_or(CodecError::TooLarge { words: n })?.end;
    let lengths = best_code_lengths(&hist);
    let table = CodeTable::from_lengths(&lengths);
    let max_len = table.max_len();
    let nsym = table.symbols.len() as u64;
    let bits: u64 = hist
        .iter()
        .zip(&lengths)
        .map(|(&c, &l)| c * u64::from(l))
        .sum();
    // Smallest the coded unit can be: the stream without lane padding.
    let fits =
        Layout::huffman(n, nsym, max_len, bits.div_ceil(16)).is_some_and(|l| l.end < raw_len);
    if n == 0 || !fits {
        return raw_into(words, hash::checksum(words), hist, out);
    }
    let before_stream =
        Layout::huffman(n, nsym, max_len, 0).ok_or(CodecError::TooLarge { words: n })?;
    out.clear();
    out.reserve(to_usize(raw_len, n)?);
    out.resize(to_usize(before_stream.stream, n)?, 0);
    // Code table and decode table.
    let t = before_stream.table as usize;
    for l in 1..=MAX_CODE_LEN as usize {
        out[t + 2 * (l - 1)..t + 2 * l].copy_from_slice(&table.counts[l].to_le_bytes());
    }
    let sym_at = t + 2 * MAX_CODE_LEN as usize;
    out[sym_at..sym_at + table.symbols.len()].copy_from_slice(&table.symbols);
    let lut_at = before_stream.lut as usize;
    for (i, e) in table.decode_table().iter().enumerate() {
        out[lut_at + 2 * i..lut_at + 2 * i + 2].copy_from_slice(&e.to_le_bytes());
    }
    // Chunks: mantissas in place, streams appended, offsets in the chunk table.
    let codes = table.encode_table();
    let pairs = pair_table(&codes, &table.symbols);
    let mut s = Scratch::new();
    let stream_at = before_stream.stream as usize;
    let chunks_at = before_stream.chunks as usize;
    let mant_at = before_stream.mantissa as usize;
    let mut sum = 0u64;
    for (k, chunk) in words.chunks(2 * CHUNK_WORDS).enumerate() {
        let part = encode_chunk(
            k as u64,
            chunk,
            &codes,
            &pairs,
            out,
            mant_at + k * CHUNK_WORDS,
            &mut s,
        );
        sum = sum.wrapping_add(part);
        let end = ((out.len() - stream_at) / 2) as u32;
        out[chunks_at + 4 * (k + 1)..chunks_at + 4 * (k + 2)].copy_from_slice(&end.to_le_bytes());
    }
    let checksum = hash::finish(sum, n);
    let stream_words = ((out.len() - stream_at) / 2) as u64;
    let layout =
        Layout::huffman(n, nsym, max_len, stream_words).ok_or(CodecError::TooLarge { words: n })?;
    if layout.end >= raw_len {
        return raw_into(words, checksum, hist, out);
    }
    out.resize(to_usize(layout.end, n)?, 0);
    let header = UnitHeader::new(Mode::Huffman, max_len, n, checksum, nsym as u16, layout);
    seal(out, &header);
    let stats = stats_of(n, hist, &header);
    Ok((header, stats))
}

/// Encodes many units on several threads (each unit on one thread; the units spread over
/// the threads as they free up).
#[derive(Debug, Clone)]
pub struct Encoder {
    threads: usize,
}

impl Default for Encoder {
    fn default() -> Self {
        Self::new()
    }
}

impl Encoder {
    /// An encoder on every core (`std::thread::available_parallelism`).
    pub fn new() -> Self {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        Self { threads }
    }

    /// An encoder on `threads` threads (at least 1).
    pub fn with_threads(threads: usize) -> Self {
        Self {
            threads: threads.max(1),
        }
    }

    /// Threads it encodes on.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Encodes each of `units` ([`encode_unit`]), in parallel; the results in order. The
    /// first failing unit's error (by position) if any fails.
    pub fn encode_all(&self, units: &[&[u8]]) -> Result<Vec<EncodedUnit>> {
        run_parallel(self.threads, units.len(), |i| encode_unit(units[i]))
    }

    /// Cuts `words` into units of `unit_bytes` bytes (the last may be shorter; `unit_bytes`
    /// even and non-zero, else [`CodecError::OddLength`]) and encodes them in parallel.
    pub fn encode_split(&self, words: &[u8], unit_bytes: usize) -> Result<Vec<EncodedUnit>> {
        if unit_bytes == 0 || !unit_bytes.is_multiple_of(2) {
            return Err(CodecError::OddLength { bytes: unit_bytes });
        }
        if !words.len().is_multiple_of(2) {
            return Err(CodecError::OddLength { bytes: words.len() });
        }
        let units: Vec<&[u8]> = words.chunks(unit_bytes).collect();
        self.encode_all(&units)
    }
}

/// Encodes `units` on every core: `Encoder::new().encode_all(units)`.
pub fn encode_units_parallel(units: &[&[u8]]) -> Result<Vec<EncodedUnit>> {
    Encoder::new().encode_all(units)
}

/// Runs `job(0..count)` on up to `threads` threads, results in order; the error of the
/// lowest failing index.
pub(crate) fn run_parallel<T: Send>(
    threads: usize,
    count: usize,
    job: impl Fn(usize) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let threads = threads.clamp(1, count.max(1));
    if threads == 1 {
        return (0..count).map(job).collect();
    }
    let next = AtomicUsize::new(0);
    let done: Mutex<Vec<(usize, Result<T>)>> = Mutex::new(Vec::with_capacity(count));
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= count {
                        break;
                    }
                    let r = job(i);
                    if let Ok(mut d) = done.lock() {
                        d.push((i, r));
                    }
                }
            });
        }
    });
    let mut done = done.into_inner().unwrap_or_else(|p| p.into_inner());
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, r)| r).collect()
}
