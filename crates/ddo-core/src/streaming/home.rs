//! [`PinnedHome`]: one pinned host buffer that becomes the params' host bytes, so the
//! weights keep one host copy and every host→device copy runs at pinned speed.
//!
//! Building it copies each param's bytes into the buffer and then points the param's host
//! source at its place ([`Param::replace_host`]); the old source (a checkpoint mapping or
//! an owned copy) goes as soon as nobody else holds it. [`PinnedHome::restore`] gives each
//! param an owned pageable copy back before the pinned buffer goes, so a param never has
//! two copies for long and never none. The streaming engine lays its home out in transfer
//! units; the no-stream group offload lays the params one after another.

use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::device::Device;
use crate::error::{CoreError, Result};
use crate::host_memory::{HostBuffer, HostSlice};
use crate::param::{Param, ParamId};
use crate::streaming::layout::align_up;

/// Threads that copy the weights into a home: memory bandwidth, not cores, bounds a copy,
/// and a handful of threads reach it.
pub const COPY_THREADS: usize = 8;

/// Copies each `(param, offset)` of `items` (sorted by offset, not overlapping) into
/// `dst` at its offset, on up to [`COPY_THREADS`] threads balanced by bytes.
fn copy_disjoint(dst: &mut [u8], items: &[(&Arc<Param>, u64)]) {
    let mut pieces: Vec<(&mut [u8], &Arc<Param>)> = Vec::with_capacity(items.len());
    let mut rest = dst;
    let mut cursor = 0usize;
    for (p, at) in items {
        let at = *at as usize;
        let (_, tail) = rest.split_at_mut(at - cursor);
        let (piece, tail) = tail.split_at_mut(p.nbytes());
        pieces.push((piece, p));
        rest = tail;
        cursor = at + p.nbytes();
    }
    let total: usize = pieces.iter().map(|(d, _)| d.len()).sum();
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, COPY_THREADS);
    if threads == 1 || total < (8 << 20) {
        for (d, p) in pieces {
            p.host().with_bytes(|b| d.copy_from_slice(b));
        }
        return;
    }
    // Hand out consecutive pieces of about total / threads bytes each.
    let share = total.div_ceil(threads);
    let mut groups: Vec<Vec<(&mut [u8], &Arc<Param>)>> = Vec::new();
    let mut current = Vec::new();
    let mut bytes = 0usize;
    for piece in pieces {
        bytes += piece.0.len();
        current.push(piece);
        if bytes >= share {
            groups.push(std::mem::take(&mut current));
            bytes = 0;
        }
    }
    if !current.is_empty() {
        groups.push(current);
    }
    std::thread::scope(|s| {
        for group in groups {
            s.spawn(move || {
                for (d, p) in group {
                    p.host().with_bytes(|b| d.copy_from_slice(b));
                }
            });
        }
    });
}

/// Pinned memory holding the params' bytes, which replaced their host sources: one pinned
/// buffer per chunk of about [`CHUNK_BYTES`] (chunks end only where the caller allows, e.g.
/// between transfer units), so the home is pinned, filled and adopted chunk by chunk and the
/// host never holds much more than one copy of the weights while it is built.
#[derive(Debug)]
pub struct PinnedHome {
    /// `(start offset, buffer)` of each chunk, in order; together they cover `bytes`.
    chunks: Vec<(u64, HostBuffer)>,
    bytes: u64,
    /// `(param, offset)` of every param whose host bytes the home replaced.
    replaced: Vec<(Arc<Param>, u64)>,
    released: u64,
    times: BuildTimes,
}

/// Where the time of a [`PinnedHome`] build went: `pin`, `fill` and `adopt` are summed over
/// chunks (and over the workers that pinned and filled them in parallel); `wall` is the
/// whole build.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BuildTimes {
    /// Allocating and page-locking the chunks ([`Device::alloc_pinned`]).
    pub pin: Duration,
    /// Copying the params' bytes in.
    pub fill: Duration,
    /// Pointing the params at the home and freeing their old bytes.
    pub adopt: Duration,
    /// The build, start to end.
    pub wall: Duration,
}

/// Threads that pin and fill a home's chunks in parallel (each chunk on one thread).
pub const PIN_WORKERS: usize = 8;

/// Bytes of one chunk of a pinned home (a chunk ends at the first allowed break past this):
/// 64 MiB.
pub const CHUNK_BYTES: u64 = 64 << 20;

impl PinnedHome {
    /// [`PinnedHome::build_chunked`] with no breaks: one pinned buffer.
    pub fn build<'a>(
        device: &dyn Device,
        placements: impl IntoIterator<Item = (&'a Arc<Param>, u64)>,
        bytes: u64,
    ) -> Result<Self> {
        Self::build_chunked(device, placements, bytes, &[])
    }

    /// Allocates `bytes` of pinned memory as chunks that end only at offsets in `breaks`
    /// (sorted; the first break at or past [`CHUNK_BYTES`] from a chunk's start ends it),
    /// writes each `(param, offset)` placement (a param may be placed more than once; its
    /// first place becomes its host bytes) and replaces the params' host sources. Each
    /// chunk is pinned and filled by one of up to [`PIN_WORKERS`] threads (a home of one chunk
    /// is filled on up to [`COPY_THREADS`]) and adopted by its params, in order,
    /// before the next is pinned, so a source the params alone held is freed chunk by
    /// chunk. A placement must not cross a break it is given. On error nothing changed
    /// (params already moved get their previous bytes back, as owned copies where their
    /// source was owned).
    pub fn build_chunked<'a>(
        device: &dyn Device,
        placements: impl IntoIterator<Item = (&'a Arc<Param>, u64)>,
        bytes: u64,
        breaks: &[u64],
    ) -> Result<Self> {
        Self::build_in_chunks(device, placements, bytes, breaks, CHUNK_BYTES)
    }

    /// [`PinnedHome::build_chunked`] with chunks of about `chunk_bytes` instead of
    /// [`CHUNK_BYTES`].
    pub fn build_in_chunks<'a>(
        device: &dyn Device,
        placements: impl IntoIterator<Item = (&'a Arc<Param>, u64)>,
        bytes: u64,
        breaks: &[u64],
        chunk_bytes: u64,
    ) -> Result<Self> {
        let mut placements: Vec<(&Arc<Param>, u64)> = placements.into_iter().collect();
        placements.sort_by_key(|(_, at)| *at);
        let overlapping = placements
            .windows(2)
            .any(|w| w[0].1 + w[0].0.nbytes() as u64 > w[1].1);
        // Chunk ends: the first break past CHUNK_BYTES from each chunk's start, then `bytes`.
        let mut ends = Vec::new();
        let mut chunk_start = 0u64;
        for &b in breaks {
            if b > chunk_start && b < bytes && b - chunk_start >= chunk_bytes {
                ends.push(b);
                chunk_start = b;
            }
        }
        ends.push(bytes);
        if placements.iter().any(|(p, at)| {
            let end = at + p.nbytes() as u64;
            end > bytes || ends.iter().any(|&e| *at < e && end > e)
        }) {
            return Err(CoreError::Backend {
                device: device.id().to_string(),
                message: "pinned home: a placement crosses a chunk boundary or the end".into(),
            });
        }
        // Each chunk's placements, relative to its start.
        let mut batches: Vec<(u64, u64, std::ops::Range<usize>)> = Vec::with_capacity(ends.len());
        let (mut lo, mut first) = (0u64, 0usize);
        for &hi in &ends {
            let mut last = first;
            while last < placements.len() && placements[last].1 < hi {
                last += 1;
            }
            batches.push((lo, hi, first..last));
            lo = hi;
            first = last;
        }
        let mut home = Self {
            chunks: Vec::with_capacity(ends.len()),
            bytes,
            replaced: Vec::new(),
            released: 0,
            times: BuildTimes::default(),
        };
        let started = Instant::now();
        let workers = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .clamp(1, PIN_WORKERS)
            .min(batches.len());
        // Chunk `i` pinned and filled (by whichever worker claimed it), with the time each
        // step took.
        // With one worker, a chunk's copy is spread over threads instead.
        let spread = workers <= 1 && !overlapping;
        let make = |i: usize| -> (usize, Result<HostBuffer>, Duration, Duration) {
            let (lo, hi, range) = &batches[i];
            let t = Instant::now();
            let buffer = device.alloc_pinned((hi - lo) as usize);
            let pinned = t.elapsed();
            let t = Instant::now();
            let filled = buffer.and_then(|buffer| {
                let batch = &placements[range.clone()];
                buffer.with_bytes_mut(|dst| {
                    if spread {
                        let relative: Vec<(&Arc<Param>, u64)> =
                            batch.iter().map(|(p, at)| (*p, at - lo)).collect();
                        copy_disjoint(dst, &relative);
                    } else {
                        for (p, at) in batch {
                            let at = (at - lo) as usize;
                            p.host()
                                .with_bytes(|b| dst[at..at + b.len()].copy_from_slice(b));
                        }
                    }
                })?;
                Ok(buffer)
            });
            (i, filled, pinned, t.elapsed())
        };
        let mut placed: HashSet<ParamId> = HashSet::new();
        let mut failure: Option<CoreError> = None;
        {
            // Adopt chunk `i` (in order): its params now read the home.
            let mut adopt = |home: &mut Self, i: usize, filled: Result<HostBuffer>| {
                let (lo, _, range) = &batches[i];
                let t = Instant::now();
                let adopted = filled.and_then(|buffer| {
                    home.chunks.push((*lo, buffer));
                    home.adopt(&placements[range.clone()], &mut placed)
                });
                home.times.adopt += t.elapsed();
                adopted
            };
            if workers <= 1 {
                for i in 0..batches.len() {
                    let (_, filled, pin, fill) = make(i);
                    home.times.pin += pin;
                    home.times.fill += fill;
                    if let Err(e) = adopt(&mut home, i, filled) {
                        failure = Some(e);
                        break;
                    }
                }
            } else {
                // Workers claim chunks in order, at most WINDOW ahead of the last one adopted
                // (so the host holds at most that many chunks twice); this thread adopts them
                // in order as they arrive.
                let window = workers;
                let state = Mutex::new((0usize, 0usize, false)); // (next to claim, adopted, stop)
                let wake = Condvar::new();
                let (tx, rx) = std::sync::mpsc::channel();
                std::thread::scope(|s| {
                    for _ in 0..workers {
                        let (tx, state, wake, make) = (tx.clone(), &state, &wake, &make);
                        let chunks = batches.len();
                        s.spawn(move || {
                            loop {
                                let i = {
                                    let mut g =
                                        state.lock().unwrap_or_else(PoisonError::into_inner);
                                    while !g.2 && g.0 < chunks && g.0 >= g.1 + window {
                                        g = wake.wait(g).unwrap_or_else(PoisonError::into_inner);
                                    }
                                    if g.2 || g.0 >= chunks {
                                        return;
                                    }
                                    g.0 += 1;
                                    g.0 - 1
                                };
                                if tx.send(make(i)).is_err() {
                                    return;
                                }
                            }
                        });
                    }
                    drop(tx);
                    let mut ready: BTreeMap<usize, Result<HostBuffer>> = BTreeMap::new();
                    let mut next = 0usize;
                    for (i, filled, pin, fill) in rx.iter() {
                        home.times.pin += pin;
                        home.times.fill += fill;
                        ready.insert(i, filled);
                        while failure.is_none()
                            && let Some(filled) = ready.remove(&next)
                        {
                            if let Err(e) = adopt(&mut home, next, filled) {
                                failure = Some(e);
                            }
                            next += 1;
                            let mut g = state.lock().unwrap_or_else(PoisonError::into_inner);
                            g.1 = next;
                            g.2 |= failure.is_some();
                            wake.notify_all();
                        }
                        if failure.is_some() {
                            // Chunks made after the failure are dropped (unpinned) here.
                            ready.clear();
                        }
                    }
                });
            }
        }
        home.times.wall = started.elapsed();
        if let Some(e) = failure {
            // Give the params moved so far their bytes back before the home goes.
            let _ = home.restore();
            return Err(e);
        }
        Ok(home)
    }

    /// How long building the home took, and its parts.
    pub fn build_times(&self) -> BuildTimes {
        self.times
    }

    /// `len` bytes of the home from `offset`, within one chunk.
    pub fn slice(&self, offset: u64, len: u64) -> Result<HostSlice> {
        let i = self.chunks.partition_point(|(start, _)| *start <= offset);
        let (start, buffer) =
            i.checked_sub(1)
                .and_then(|i| self.chunks.get(i))
                .ok_or(CoreError::OutOfRange {
                    what: "pinned home",
                    offset: offset as usize,
                    len: len as usize,
                    buffer_len: self.bytes as usize,
                })?;
        buffer.slice((offset - start) as usize, len as usize)
    }

    /// Points the params of `batch` placed here first at their place in the home.
    fn adopt(&mut self, batch: &[(&Arc<Param>, u64)], placed: &mut HashSet<ParamId>) -> Result<()> {
        for (p, offset) in batch {
            if !placed.insert(p.id()) {
                continue;
            }
            let slice = self.slice(*offset, p.nbytes() as u64)?;
            let old = p.replace_host(slice)?;
            // The old bytes go with their last handle; this was it when only ours is left.
            if old.buffer().handle_count() == 1 {
                self.released += old.len() as u64;
            }
            drop(old);
            self.replaced.push((Arc::clone(p), *offset));
        }
        Ok(())
    }

    /// `params` (each once) one after another, each aligned, within `limit` bytes (and what
    /// the device's pinned ledger has left). When they do not fit: `Ok(None)` (the weights
    /// stay where they are), or with `required` a [`CoreError::PinnedLimit`]. No params:
    /// `Ok(None)`.
    pub fn sequential(
        device: &dyn Device,
        params: &[Arc<Param>],
        limit: u64,
        required: bool,
    ) -> Result<Option<Self>> {
        let mut seen = HashSet::new();
        let mut at = 0u64;
        let mut placements = Vec::new();
        for p in params.iter().filter(|p| seen.insert(p.id())) {
            placements.push((p, at));
            at += align_up(p.nbytes() as u64);
        }
        let info = device.memory_info();
        let room = limit.min(info.pinned_room());
        if at == 0 {
            return Ok(None);
        }
        if at > room {
            return if required {
                Err(CoreError::PinnedLimit {
                    requested: at,
                    pinned: info.pinned_host,
                    limit: limit.min(info.pinned_limit),
                })
            } else {
                Ok(None)
            };
        }
        let breaks: Vec<u64> = placements.iter().map(|(_, at)| *at).collect();
        Self::build_chunked(device, placements, at, &breaks).map(Some)
    }

    /// Pinned bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Pinned buffers (chunks) the home is made of.
    pub fn chunks(&self) -> usize {
        self.chunks.len()
    }

    /// Host bytes of the params' previous sources that went when the home replaced them.
    pub fn host_bytes_released(&self) -> u64 {
        self.released
    }

    /// Leaves every param with pageable host bytes: the home is unpinned in place (the
    /// params keep reading the same bytes, now pageable, with no copy and no second host
    /// copy of the weights) when the home's memory is owned; otherwise each param gets an
    /// owned pageable copy and the pinned buffer goes. The caller makes sure no queued copy
    /// reads the home. The first failure is returned after every param was tried.
    pub fn restore(self) -> Result<()> {
        // Every chunk unpinned in place: the params read the same bytes, pageable.
        let unpinned: Vec<bool> = self.chunks.iter().map(|(_, b)| b.unpin()).collect();
        if unpinned.iter().all(|u| *u) {
            return Ok(());
        }
        let mut result = Ok(());
        for (p, offset) in &self.replaced {
            let copied = self
                .slice(*offset, p.nbytes() as u64)
                .map(|s| s.with_bytes(HostBuffer::pageable_from))
                .and_then(|bytes| p.replace_host(bytes.slice_all()).map(drop));
            if let Err(e) = copied
                && result.is_ok()
            {
                result = Err(e);
            }
        }
        result
    }
}
