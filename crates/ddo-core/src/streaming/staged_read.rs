//! How staged units are read (issue 35): the host side of [`StagingKind::Ring`] and of a
//! registered plan's units past the pinned room, where each unit is written into a pinned
//! staging buffer from the params' own bytes for every forward.
//!
//! Those bytes are a checkpoint mapping's pages: in the page cache while the machine has
//! room for them (the *page cache tier*), else read from the disk again for every forward
//! (the *disk tier*). `StagedReader` makes either run near its rate:
//!
//! - **Read ahead.** When a staged unit is copied, the mapped ranges of the staged units
//!   after it, up to [`READ_AHEAD_BYTES`], are handed to a reader thread, so the disk works
//!   while the link and compute do. The window wraps to the first units at the end of a
//!   forward, since the next forward starts there. A unit kept in the page cache is asked
//!   for (`MADV_WILLNEED`, [`CheckpointMap::prefetch`]); a disk-tier unit is read into the
//!   page cache by sequential `pread`s ([`CheckpointMap::read_into_cache`]), which the
//!   kernel's read-ahead serves at the disk's rate (on the GPU machine's disk, 2.0 GB/s
//!   against 0.63 for the advice), and skipped once its unit has been copied (a reader
//!   behind the copies would read evicted pages from the disk a second time).
//! - **Several threads fill a buffer.** A chunk of [`PARALLEL_FILL_BYTES`] or more is
//!   written by up to [`FILL_THREADS`] threads, each a contiguous part: page-cache copies
//!   run at several times one core's rate, and the disk serves several reads at once.
//! - **The disk tier reads, it does not map.** A unit past the page cache limit is read
//!   from its files with `pread` straight into the staging buffer
//!   ([`CheckpointMap::read_at`]): its pages never enter the process (no faults, nothing to
//!   unmap), and a file truncated meanwhile is a typed error, not a `SIGBUS`.
//! - **A page cache limit.** With `page_cache_limit` (the memory plan sets it from the host
//!   budget), the staged units past the first `limit` bytes give their pages back once
//!   copied ([`CheckpointMap::evict`]: this process's pages and the page cache's), so the
//!   memory they make the machine hold stays within the limit plus the read-ahead window
//!   instead of growing until the kernel reclaims something else. The units within the
//!   limit stay cached from one forward to the next.
//!
//! None of this changes a byte that reaches the device: the staging buffer holds exactly
//! the unit's params at their offsets, whichever thread wrote which part
//! (`tests/staged_read.rs` checks outputs against a pinned home).
//!
//! [`StagingKind::Ring`]: crate::streaming::StagingKind::Ring

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::thread::JoinHandle;

use crate::host_memory::{AlignedBytes, CheckpointMap};
use crate::param::ParamId;
use crate::streaming::TransferUnit;

/// Bytes of staged units read ahead of the unit being copied: 768 MiB, part of the
/// working memory a phase is planned with
/// ([`HOST_WORKING_BYTES`](crate::host_budget::HOST_WORKING_BYTES)). Staged units often
/// come last in a forward (the first ones registered), so the disk has the rest of the
/// forward to read them ahead: on one H100 host (disk about 2 GB/s) a 256 MiB window left
/// it idle for a fifth of each FLUX.1-dev step with 16 GiB available.
pub const READ_AHEAD_BYTES: u64 = 768 << 20;

/// Most threads that write one staging chunk.
pub const FILL_THREADS: usize = 4;

/// Chunks at least this large are written by several threads.
pub const PARALLEL_FILL_BYTES: u64 = 4 << 20;

/// A mapped range to read ahead.
type Ahead = (Arc<CheckpointMap>, Range<usize>);

/// What the read-ahead thread is handed: a unit's ranges, its place in the sequence of
/// staged copies (forwards counted: `forward * units + unit`, plus one), and whether it is
/// read into the page cache (a disk-tier unit) or only asked for.
struct AheadUnit {
    seq: u64,
    read: bool,
    ranges: Vec<Ahead>,
}

/// The thread that reads ranges ahead.
#[derive(Debug)]
struct ReadAhead {
    sender: Option<Sender<Vec<AheadUnit>>>,
    thread: Option<JoinHandle<()>>,
}

impl ReadAhead {
    /// The thread; `copied` is the sequence number of the last unit copied (0: none), so
    /// a disk-tier unit already copied is not read again.
    fn start(copied: Arc<AtomicU64>) -> Option<Self> {
        let (sender, receiver) = channel::<Vec<AheadUnit>>();
        let thread = std::thread::Builder::new()
            .name("ddo-read-ahead".into())
            .spawn(move || {
                let mut scratch = Vec::new();
                while let Ok(units) = receiver.recv() {
                    for unit in units {
                        let pending = || copied.load(Ordering::Acquire) < unit.seq;
                        for (map, range) in unit.ranges {
                            if !pending() {
                                break;
                            }
                            if unit.read {
                                map.read_into_cache(range, &mut scratch, pending);
                            } else {
                                map.prefetch(range);
                            }
                        }
                    }
                }
            })
            .ok()?;
        Some(Self {
            sender: Some(sender),
            thread: Some(thread),
        })
    }

    fn send(&self, units: Vec<AheadUnit>) {
        if let Some(s) = &self.sender {
            let _ = s.send(units);
        }
    }
}

impl Drop for ReadAhead {
    fn drop(&mut self) {
        // Closing the channel ends the thread after the ranges in hand; `copied` is left
        // as it is, so a reader being dropped mid-read finishes its piece and the queue.
        self.sender.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Reads the staged units of one engine (see the [module docs](self)).
#[derive(Debug)]
pub(crate) struct StagedReader {
    /// Per unit: whether it is staged.
    staged: Vec<bool>,
    /// Per unit: whether its pages are given back once copied (past the page cache limit).
    evict: Vec<bool>,
    /// Per unit: whether it holds a coded checkpoint tensor (filled by one thread: the
    /// tensor decodes on threads of its own).
    coded: Vec<bool>,
    /// What a unit holding coded tensors keeps between its chunks: the last decoded
    /// tensor, the disk tier's read scratch.
    decoded: parking_lot::Mutex<CodedFill>,
    /// Per unit: its mapped ranges (none for params made in memory).
    mapped: Vec<Vec<Ahead>>,
    /// Per unit: its bytes.
    bytes: Vec<u64>,
    /// Units read ahead so far, counted across forwards' wrap (one forward is
    /// `staged.len()` units).
    ahead_to: usize,
    /// The sequence number of the current forward's first unit, less one (forwards
    /// counted: `forward * units`).
    forward_base: u64,
    /// Whether a forward has begun.
    started: bool,
    /// The sequence number of the last unit copied (shared with the read-ahead thread).
    copied: Arc<AtomicU64>,
    read_ahead: Option<ReadAhead>,
    threads: usize,
    /// Bytes whose pages were given back, over the reader's life.
    evicted: u64,
}

impl StagedReader {
    /// A reader for `units`, of which those from `from` on are staged, with the pages of
    /// the staged units past the first `page_cache_limit` bytes given back once copied
    /// (`None`: all kept).
    pub(crate) fn new(units: &[TransferUnit], from: usize, page_cache_limit: Option<u64>) -> Self {
        let mut staged = vec![false; units.len()];
        let mut evict = vec![false; units.len()];
        let mut mapped = Vec::with_capacity(units.len());
        let mut kept = 0u64;
        for (i, u) in units.iter().enumerate() {
            let ranges: Vec<Ahead> = if i >= from {
                u.entries
                    .iter()
                    .filter_map(|e| {
                        // A coded param's file range is its unit (what its decode reads).
                        e.param
                            .host()
                            .file_range()
                            .filter(|(map, _)| map.is_file())
                            .map(|(map, range)| (Arc::clone(map), range))
                    })
                    .collect()
            } else {
                Vec::new()
            };
            if i >= from {
                staged[i] = true;
                kept += u.bytes;
                evict[i] = page_cache_limit.is_some_and(|limit| kept > limit);
            }
            mapped.push(ranges);
        }
        let any_mapped = mapped.iter().any(|m| !m.is_empty());
        let copied = Arc::new(AtomicU64::new(0));
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .clamp(1, FILL_THREADS);
        Self {
            staged,
            evict,
            coded: units
                .iter()
                .map(|u| {
                    u.entries
                        .iter()
                        .any(|e| e.param.host().buffer().coded_source().is_some())
                })
                .collect(),
            decoded: parking_lot::Mutex::new(CodedFill::default()),
            mapped,
            bytes: units.iter().map(|u| u.bytes).collect(),
            ahead_to: 0,
            forward_base: 0,
            started: false,
            read_ahead: if any_mapped {
                ReadAhead::start(Arc::clone(&copied))
            } else {
                None
            },
            copied,
            threads,
            evicted: 0,
        }
    }

    /// A forward begins: the read-ahead that wrapped past the last unit counts from the
    /// first again.
    pub(crate) fn begin_forward(&mut self) {
        let n = self.staged.len();
        self.ahead_to = self.ahead_to.saturating_sub(n).min(n);
        if self.started {
            self.forward_base += n as u64;
        }
        self.started = true;
    }

    /// The sequence number of the unit at `position` of the current forward's copies
    /// (`position` past the last unit: the next forward's).
    fn seq(&self, position: usize) -> u64 {
        self.forward_base + position as u64 + 1
    }

    /// Bytes of file pages the staged units past the limit give back after each copy, so
    /// read from the disk again every forward: their mapped params' bytes.
    pub(crate) fn evicted_per_forward(&self) -> u64 {
        self.evict
            .iter()
            .zip(&self.mapped)
            .filter(|(e, _)| **e)
            .flat_map(|(_, m)| m.iter().map(|(_, r)| r.len() as u64))
            .sum()
    }

    /// Bytes whose pages were given back so far.
    pub(crate) fn evicted(&self) -> u64 {
        self.evicted
    }

    /// Unit `u` is about to be copied: queue the read-ahead of the staged units after it
    /// within [`READ_AHEAD_BYTES`].
    pub(crate) fn read_ahead(&mut self, u: usize) {
        let n = self.staged.len();
        let Some(ra) = &self.read_ahead else {
            return;
        };
        if n == 0 {
            return;
        }
        self.ahead_to = self.ahead_to.max(u + 1);
        let mut window = 0u64;
        for v in u + 1..self.ahead_to.min(u + 1 + n) {
            if self.staged[v % n] {
                window += self.bytes[v % n];
            }
        }
        let mut units = Vec::new();
        while window < READ_AHEAD_BYTES && self.ahead_to < u + 1 + n {
            let position = self.ahead_to;
            let i = position % n;
            self.ahead_to += 1;
            if !self.staged[i] {
                continue;
            }
            window += self.bytes[i];
            if !self.mapped[i].is_empty() {
                units.push(AheadUnit {
                    seq: self.seq(position),
                    read: self.evict[i],
                    ranges: self.mapped[i].clone(),
                });
            }
        }
        if !units.is_empty() {
            ra.send(units);
        }
    }

    /// Writes `dst` with bytes `at..at + dst.len()` of unit `u` (its params at their
    /// offsets; padding untouched), on several threads for a large chunk. A unit past the
    /// page cache limit is read from its files with `pread` ([`CheckpointMap::read_at`]),
    /// so its pages are never mapped into the process; the others are copied from their
    /// host bytes (the mapping's pages, which stay cached).
    pub(crate) fn fill(
        &self,
        u: usize,
        dst: &mut [u8],
        unit: &TransferUnit,
        at: u64,
    ) -> crate::Result<()> {
        let read = self.evict.get(u).copied().unwrap_or(false);
        let n = dst.len();
        // A coded param decodes whole on its own threads: one fill, not one decode a thread.
        let coded = self.coded.get(u).copied().unwrap_or(false);
        if coded {
            let mut coded = self.decoded.lock();
            coded.readers = self.threads;
            return fill_range(dst, unit, at, read, Some(&mut coded));
        }
        if self.threads <= 1 || (n as u64) < PARALLEL_FILL_BYTES {
            return fill_range(dst, unit, at, read, None);
        }
        let page = 4096usize;
        let per = n.div_ceil(self.threads).div_ceil(page) * page;
        std::thread::scope(|s| {
            let (first, mut rest) = dst.split_at_mut(per.min(n));
            let mut off = at + first.len() as u64;
            let mut parts = Vec::new();
            while !rest.is_empty() {
                let take = per.min(rest.len());
                let (head, tail) = rest.split_at_mut(take);
                let from = off;
                parts.push(s.spawn(move || fill_range(head, unit, from, read, None)));
                off += take as u64;
                rest = tail;
            }
            let mut result = fill_range(first, unit, at, read, None);
            for part in parts {
                let r = part.join().unwrap_or_else(|_| {
                    Err(crate::CoreError::Backend {
                        device: "host".into(),
                        message: "a staging fill thread panicked".into(),
                    })
                });
                result = result.and(r);
            }
            result
        })
    }

    /// Unit `u` has been written into staging in full: past the page cache limit, its
    /// pages go back.
    pub(crate) fn done(&mut self, u: usize) {
        self.decoded.lock().last = None;
        self.copied.fetch_max(self.seq(u), Ordering::Release);
        if !self.evict.get(u).copied().unwrap_or(false) {
            return;
        }
        for (map, range) in &self.mapped[u] {
            map.evict(range.clone());
            self.evicted += range.len() as u64;
        }
    }
}

/// What the fill of a unit holding coded tensors keeps between its chunks.
#[derive(Debug, Default)]
pub(crate) struct CodedFill {
    /// The coded tensor decoded last, kept until its unit is done: a unit staged in several
    /// chunks decodes each of its coded tensors once, not once a chunk.
    last: Option<(ParamId, AlignedBytes)>,
    /// A disk-tier unit's coded bytes, read by `pread` (grown to the largest unit, reused).
    scratch: Vec<u8>,
    /// Threads that read one unit.
    readers: usize,
}

/// Writes `dst` with bytes `at..at + dst.len()` of `unit`: with `read`, a mapped param's
/// bytes come from its file by `pread`; otherwise from its host bytes. A coded param is
/// decoded (into `decoded.last`, the last one decoded, and read from there; a whole one
/// straight into `dst`) where `decoded` is given: with `read`, from its unit read by `pread`
/// into `decoded.scratch`.
fn fill_range(
    dst: &mut [u8],
    unit: &TransferUnit,
    at: u64,
    read: bool,
    mut decoded: Option<&mut CodedFill>,
) -> crate::Result<()> {
    let n = dst.len() as u64;
    for e in &unit.entries {
        let (lo, hi) = (e.offset.max(at), (e.offset + e.len).min(at + n));
        if lo >= hi {
            continue;
        }
        let s0 = (lo - e.offset) as usize;
        let d0 = (lo - at) as usize;
        let len = (hi - lo) as usize;
        let host = e.param.host();
        if let (Some(fill), Some(coded)) = (decoded.as_deref_mut(), host.buffer().coded_source()) {
            let CodedFill {
                last: cache,
                scratch,
                readers,
            } = fill;
            // The disk tier reads the unit with `pread` (large requests, several threads);
            // otherwise the decode reads the mapping's pages.
            let mut decode = |out: &mut [u8]| {
                if read {
                    coded.read_decode_into(scratch, *readers, out)
                } else {
                    coded.decode_in_place(out)
                }
            };
            // A whole coded tensor inside this chunk decodes straight into it: no decoded
            // copy to allocate and copy again (a view or a tensor split across chunks is
            // decoded once into `cache` and copied from there). The reader reads ahead
            // in schedule order, so the decode reads no more of the file than its unit.
            let whole = s0 == 0
                && len as u64 == e.len
                && host.offset() == 0
                && host.len() as u64 == coded.header.decoded_len();
            if whole && cache.as_ref().is_none_or(|(id, _)| *id != e.param.id()) {
                decode(&mut dst[d0..d0 + len])?;
                continue;
            }
            if cache.as_ref().is_none_or(|(id, _)| *id != e.param.id()) {
                let mut out = AlignedBytes::try_zeroed(coded.header.decoded_len() as usize)?;
                decode(out.as_mut_slice())?;
                *cache = Some((e.param.id(), out));
            }
            if let Some((_, bytes)) = cache.as_ref() {
                let from = host.offset() + s0;
                dst[d0..d0 + len].copy_from_slice(&bytes.as_slice()[from..from + len]);
            }
            continue;
        }
        match host.mapped_range().filter(|(map, _)| read && map.is_file()) {
            Some((map, range)) => map.read_at(range.start + s0, &mut dst[d0..d0 + len])?,
            // A coded param decodes here; one that does not is the error.
            None => host.try_with_bytes(|src| {
                dst[d0..d0 + len].copy_from_slice(&src[s0..s0 + len]);
            })?,
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;
    use crate::host_memory::HostBuffer;
    use crate::param::{Param, ParamKind};
    use crate::streaming::UnitEntry;

    fn unit_of(params: &[Arc<Param>]) -> TransferUnit {
        let mut entries = Vec::new();
        let mut at = 0u64;
        for p in params {
            entries.push(UnitEntry {
                param: Arc::clone(p),
                offset: at,
                len: p.nbytes() as u64,
            });
            at = crate::streaming::layout::align_up(at + p.nbytes() as u64);
        }
        TransferUnit {
            payload: params.iter().map(|p| p.nbytes() as u64).sum(),
            entries,
            bytes: at,
            first: 0,
            last: 0,
        }
    }

    fn param(name: &str, n: usize, seed: u8) -> Arc<Param> {
        let bytes: Vec<u8> = (0..n).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect();
        Param::new(
            name,
            ParamKind::Parameter,
            DType::Quantized,
            vec![n],
            HostBuffer::pageable_from(&bytes).slice_all(),
        )
        .unwrap()
    }

    /// Split over threads at any offset, the staged chunk holds the same bytes as one
    /// thread's copy.
    #[test]
    fn threads_fill_the_same_bytes_as_one() {
        let params = [
            param("a", 3 << 20, 1),
            param("b", (5 << 20) + 17, 2),
            param("c", 1 << 20, 3),
        ];
        let unit = unit_of(&params);
        let reader = StagedReader::new(std::slice::from_ref(&unit), 0, None);
        for (at, len) in [
            (0u64, unit.bytes),
            (1 << 20, 6 << 20),
            (3 << 20, 4096 * 1025 + 3),
        ] {
            let mut one = vec![0xAAu8; len as usize];
            fill_range(&mut one, &unit, at, false, None).unwrap();
            let mut many = vec![0xAAu8; len as usize];
            let threaded = StagedReader {
                threads: FILL_THREADS,
                ..StagedReader::new(std::slice::from_ref(&unit), 0, None)
            };
            threaded.fill(0, &mut many, &unit, at).unwrap();
            assert!(one == many, "chunk at {at} of {len} B differs");
            reader.fill(0, &mut many, &unit, at).unwrap();
            assert!(one == many);
        }
        // And it is the params' bytes.
        let mut all = vec![0u8; unit.bytes as usize];
        reader.fill(0, &mut all, &unit, 0).unwrap();
        let b = &unit.entries[1];
        assert_eq!(
            &all[b.offset as usize..(b.offset + b.len) as usize],
            params[1].host().to_vec()
        );
    }

    /// A unit past the page cache limit is read from its file with `pread`: the same bytes
    /// as a copy from the mapping, on one thread or several; a file cut short meanwhile is a
    /// typed error naming it.
    #[test]
    fn disk_tier_units_are_read_from_the_file_exactly() {
        use crate::host_memory::CheckpointMap;
        let dir = std::env::temp_dir().join(format!("ddo-staged-read-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w.bin");
        let bytes: Vec<u8> = (0..(9usize << 20) + 333)
            .map(|i| (i * 7 + i / 4099) as u8)
            .collect();
        std::fs::write(&path, &bytes).unwrap();
        let map = CheckpointMap::open(&path).unwrap();
        let spans = [
            (5usize, 3usize << 20),
            ((3 << 20) + 101, 1000),
            ((4 << 20) + 7, 5 << 20),
        ];
        let params: Vec<Arc<Param>> = spans
            .iter()
            .enumerate()
            .map(|(i, &(at, len))| {
                let host = HostBuffer::mapped(Arc::clone(&map), at, len)
                    .unwrap()
                    .slice_all();
                Param::new(
                    format!("p{i}"),
                    ParamKind::Parameter,
                    DType::Quantized,
                    vec![len],
                    host,
                )
                .unwrap()
            })
            .collect();
        let unit = unit_of(&params);
        let units = std::slice::from_ref(&unit);
        let mut want = vec![0u8; unit.bytes as usize];
        fill_range(&mut want, &unit, 0, false, None).unwrap();
        for threads in [1, FILL_THREADS] {
            let reader = StagedReader {
                threads,
                ..StagedReader::new(units, 0, Some(0))
            };
            assert!(reader.evict[0]);
            let mut got = vec![0u8; unit.bytes as usize];
            reader.fill(0, &mut got, &unit, 0).unwrap();
            assert!(got == want, "{threads} thread(s)");
            let mut part = vec![0u8; 3 << 20];
            reader.fill(0, &mut part, &unit, 1 << 20).unwrap();
            assert!(part[..] == want[1 << 20..4 << 20]);
        }
        // Cut short: the read fails with the file named, nothing panics.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(4 << 20)
            .unwrap();
        let reader = StagedReader::new(units, 0, Some(0));
        let mut got = vec![0u8; unit.bytes as usize];
        let e = reader.fill(0, &mut got, &unit, 0).unwrap_err();
        assert!(e.to_string().contains("w.bin"), "{e}");
        drop((reader, params, unit, map));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The units past the limit are the ones evicted, counted in schedule order from the
    /// first staged unit.
    #[test]
    fn units_past_the_page_cache_limit_are_evicted() {
        let units: Vec<TransferUnit> = (0..5)
            .map(|i| unit_of(&[param(&format!("p{i}"), 1 << 20, i as u8)]))
            .collect();
        let each = units[0].bytes;
        let r = StagedReader::new(&units, 1, Some(2 * each));
        assert_eq!(r.evict, [false, false, false, true, true]);
        assert!(StagedReader::new(&units, 0, None).evict.iter().all(|e| !e));
        assert!(
            StagedReader::new(&units, 0, Some(0))
                .evict
                .iter()
                .all(|e| *e)
        );
        // Params made in memory have no pages to give back: no disk bytes.
        assert_eq!(r.evicted_per_forward(), 0);
    }

    /// The read-ahead's sequence numbers follow the copies across forwards: a unit is
    /// numbered in the forward it will be copied in (the window wraps into the next), and
    /// `done` moves the shared count to it, which is what stops the thread from reading a
    /// disk-tier unit already copied (and its pages given back) a second time.
    #[test]
    fn read_ahead_numbers_units_in_the_forward_they_are_copied_in() {
        let units: Vec<TransferUnit> = (0..4)
            .map(|i| unit_of(&[param(&format!("p{i}"), 1 << 20, i as u8)]))
            .collect();
        let mut r = StagedReader::new(&units, 1, Some(0));
        r.begin_forward();
        assert_eq!((r.seq(1), r.seq(3), r.seq(5)), (2, 4, 6));
        r.done(1);
        r.done(3);
        assert_eq!(r.copied.load(Ordering::Acquire), 4);
        r.begin_forward();
        // The second forward's unit 1 is the first forward's position 5.
        assert_eq!(r.seq(1), 6);
        assert!(r.copied.load(Ordering::Acquire) < r.seq(1));
        r.done(1);
        assert_eq!(r.copied.load(Ordering::Acquire), 6);
        // Never backwards: a late `done` of an earlier unit leaves the count.
        r.copied.fetch_max(3, Ordering::Release);
        assert_eq!(r.copied.load(Ordering::Acquire), 6);
    }
}
