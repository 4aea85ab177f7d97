//! [`NativeAllocator`]: ddo-vmm's [`VmmPool`] as a device allocator — the stream-ordered
//! frees the pool cannot see, same-stream reuse, the out-of-memory retry and the figures.
//!
//! The pool knows address ranges, not streams. A [`CudaDevice`](crate::CudaDevice) frees a
//! buffer when its last handle drops, often while kernels queued earlier still read it; so
//! a free comes here with the events of the streams that may still use the memory (as it
//! does to the caching allocator), and the range stays held ("pending") until those events
//! have completed. Two things keep that from growing the pool while the host runs ahead of
//! the GPU:
//!
//! - **same-stream reuse**: a request for stream `S` ([`NativeAllocator::allocate`] with
//!   `Some(S)`, which is what the compute ops ask for) takes a pending range whose only
//!   unfinished users are on `S` and whose length is within [`REUSE_SLACK`] of the request:
//!   stream order makes that safe without waiting, as in PyTorch's allocator;
//! - **reaping**: every call first frees to the pool the pending ranges whose events have
//!   completed, so the pool's best-fit placement and coalescing see them.
//!
//! Out of memory: wait for every pending free and retry; then, if mapped pages are idle,
//! synchronise the context, release them through a quiescent gate and retry once more
//! (what the caching allocator does with its cached segments). The idle cache is otherwise
//! released only by [`NativeAllocator::release_idle`], which the device calls for
//! `release_native_idle_cache` at a boundary the caller vouches for.
//!
//! Generic over the physical layer and the event type, so every rule is tested on CPU with
//! [`FakePhysicalMemory`](ddo_vmm::FakePhysicalMemory) and
//! [`FakeEvent`](crate::allocator::FakeEvent).

use ddo_metrics::{IdleCacheRelease, NativePoolFigures};
use ddo_vmm::{PhysicalMemory, PoolAllocation, QuiescenceGate, VmmError, VmmPool};
use parking_lot::Mutex;

use crate::allocator::{FreeEvent, StreamKey};

/// How much longer than a request a pending range reused for it may be: `len / 8` (and at
/// least 4 KiB). Longer ranges wait for their events and go back to the pool.
pub const REUSE_SLACK_DIVISOR: u64 = 8;

/// The smallest slack allowed for same-stream reuse (bytes).
pub const REUSE_SLACK: u64 = 4096;

fn reuse_fits(range_len: u64, request: u64) -> bool {
    range_len >= request && range_len - request <= (request / REUSE_SLACK_DIVISOR).max(REUSE_SLACK)
}

/// A range freed by its owner whose last users may still be running.
struct PendingFree<E> {
    alloc: PoolAllocation,
    marks: Vec<(StreamKey, E)>,
}

struct State<E> {
    pending: Vec<PendingFree<E>>,
    /// Bytes asked for by allocations handed out and not yet freed.
    allocated: u64,
    peak_allocated: u64,
    /// Bytes of releases the driver's free figure confirmed.
    proven_bytes: u64,
    allocations: u64,
}

/// Where an allocation came from (for tests and figures).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// A fresh range of the pool.
    Pool,
    /// A pending range reused on the same stream.
    Reused,
}

/// The native VMM pool as a device allocator. See the module documentation.
pub struct NativeAllocator<P: PhysicalMemory, E: FreeEvent> {
    pool: VmmPool<P>,
    state: Mutex<State<E>>,
}

impl<P: PhysicalMemory, E: FreeEvent> NativeAllocator<P, E> {
    /// Wraps `pool`.
    pub fn new(pool: VmmPool<P>) -> Self {
        Self {
            pool,
            state: Mutex::new(State {
                pending: Vec::new(),
                allocated: 0,
                peak_allocated: 0,
                proven_bytes: 0,
                allocations: 0,
            }),
        }
    }

    /// The pool.
    pub fn pool(&self) -> &VmmPool<P> {
        &self.pool
    }

    /// Allocates `bytes` for work on `stream` (`None`: any stream). `synchronize` blocks
    /// until every stream of the device has drained; it is called only on the last retry
    /// after an out-of-memory.
    pub fn allocate(
        &self,
        bytes: u64,
        stream: Option<StreamKey>,
        synchronize: impl FnOnce() -> Result<(), String>,
    ) -> Result<(PoolAllocation, Source), VmmError> {
        let mut st = self.state.lock();
        self.reap(&mut st);
        if let Some(key) = stream
            && let Some(i) = Self::best_reusable(&st, bytes, key)
        {
            let reused = st.pending.swap_remove(i);
            Self::note_alloc(&mut st, bytes);
            return Ok((reused.alloc, Source::Reused));
        }
        let first = match self.pool.alloc(bytes) {
            Ok(a) => {
                Self::note_alloc(&mut st, bytes);
                return Ok((a, Source::Pool));
            }
            Err(e) if e.is_out_of_memory() => e,
            Err(e) => return Err(e),
        };
        // Retry 1: wait for every pending free.
        if !st.pending.is_empty() {
            self.drain_pending(&mut st);
            if let Ok(a) = self.pool.alloc(bytes) {
                Self::note_alloc(&mut st, bytes);
                return Ok((a, Source::Pool));
            }
        }
        // Retry 2: return idle pages (they hold address ranges that did not fit) to the
        // driver at a boundary this call makes quiescent, then map afresh.
        if self.pool.idle_bytes() > 0 {
            let gate = QuiescenceGate::after_synchronize(synchronize)
                .map_err(|reason| VmmError::NotQuiescent { what: reason })?;
            self.pool.release_idle(&gate)?;
            if let Ok(a) = self.pool.alloc(bytes) {
                Self::note_alloc(&mut st, bytes);
                return Ok((a, Source::Pool));
            }
        }
        Err(first)
    }

    /// Frees an allocation of `requested` bytes once every event in `marks` has completed
    /// (at once when there is none).
    pub fn free(&self, alloc: PoolAllocation, requested: u64, marks: Vec<(StreamKey, E)>) {
        let mut st = self.state.lock();
        st.allocated -= requested.min(st.allocated);
        if marks.is_empty() {
            // A stale allocation cannot reach here (the device holds each one once).
            let _ = self.pool.free(&alloc);
        } else {
            st.pending.push(PendingFree { alloc, marks });
        }
    }

    /// Releases every idle chunk through `gate` (after freeing every pending range, whose
    /// events a quiescent device has completed) and reports it, `proven` when the driver's
    /// free figure rose by at least the bytes released.
    pub fn release_idle(&self, gate: &QuiescenceGate) -> Result<IdleCacheRelease, VmmError> {
        if !gate.is_quiescent() {
            return Err(VmmError::NotQuiescent {
                what: gate.basis().to_string(),
            });
        }
        let mut st = self.state.lock();
        self.drain_pending(&mut st);
        let report = self.pool.release_idle(gate)?;
        let proven = report.driver_confirms() == Some(true);
        if proven {
            st.proven_bytes += report.bytes;
        }
        Ok(IdleCacheRelease {
            chunks: report.chunks,
            bytes: report.bytes,
            driver_free_before: report.driver_free_before,
            driver_free_after: report.driver_free_after,
            proven,
            basis: report.basis,
        })
    }

    /// The figures now (peaks since the last [`NativeAllocator::reset_peaks`]).
    pub fn figures(&self) -> NativePoolFigures {
        let st = self.state.lock();
        let p = self.pool.stats();
        NativePoolFigures {
            reserved_va_bytes: p.va_reserved,
            va_in_use_bytes: p.va_in_use,
            peak_va_in_use_bytes: p.peak_va_in_use,
            mapped_bytes: p.mapped,
            peak_mapped_bytes: p.peak_mapped,
            live_bytes: st.allocated,
            peak_live_bytes: st.peak_allocated,
            chunks_mapped: p.chunks_mapped,
            chunks_released: p.chunks_released,
            bytes_released: p.bytes_released,
            bytes_proven_returned: st.proven_bytes,
        }
    }

    /// Bytes handed out and not freed, and their peak.
    pub fn allocated(&self) -> (u64, u64) {
        let st = self.state.lock();
        (st.allocated, st.peak_allocated)
    }

    /// Allocations handed out since creation.
    pub fn allocations(&self) -> u64 {
        self.state.lock().allocations
    }

    /// Ranges freed whose events have not all completed yet.
    pub fn pending_frees(&self) -> usize {
        self.state.lock().pending.len()
    }

    /// Starts new peaks at the current levels.
    pub fn reset_peaks(&self) {
        let mut st = self.state.lock();
        st.peak_allocated = st.allocated;
        self.pool.reset_peaks();
    }

    /// Frees every pending range after waiting for its events (teardown, or after the
    /// device was synchronised).
    pub fn wait_pending(&self) {
        let mut st = self.state.lock();
        self.drain_pending(&mut st);
    }

    fn note_alloc(st: &mut State<E>, bytes: u64) {
        st.allocated += bytes;
        st.peak_allocated = st.peak_allocated.max(st.allocated);
        st.allocations += 1;
    }

    /// The pending range that best fits `bytes` whose unfinished users are all on `key`.
    fn best_reusable(st: &State<E>, bytes: u64, key: StreamKey) -> Option<usize> {
        st.pending
            .iter()
            .enumerate()
            .filter(|(_, p)| reuse_fits(p.alloc.len(), bytes))
            .filter(|(_, p)| p.marks.iter().all(|(k, _)| *k == key))
            .min_by_key(|(_, p)| p.alloc.len())
            .map(|(i, _)| i)
    }

    /// Drops completed marks; frees ranges with none left. An event whose query fails is
    /// kept (its range waits for [`NativeAllocator::drain_pending`]).
    fn reap(&self, st: &mut State<E>) {
        let mut i = 0;
        while i < st.pending.len() {
            st.pending[i]
                .marks
                .retain(|(_, e)| !matches!(e.is_complete(), Ok(true)));
            if st.pending[i].marks.is_empty() {
                let done = st.pending.swap_remove(i);
                let _ = self.pool.free(&done.alloc);
            } else {
                i += 1;
            }
        }
    }

    fn drain_pending(&self, st: &mut State<E>) {
        for p in std::mem::take(&mut st.pending) {
            // A failed wait means the context is lost; the range is freed regardless, as
            // nothing can run on a lost context any more.
            for (_, e) in &p.marks {
                let _ = e.wait();
            }
            let _ = self.pool.free(&p.alloc);
        }
    }
}

impl<P: PhysicalMemory, E: FreeEvent> Drop for NativeAllocator<P, E> {
    fn drop(&mut self) {
        let st = self.state.get_mut();
        for p in std::mem::take(&mut st.pending) {
            for (_, e) in &p.marks {
                let _ = e.wait();
            }
            let _ = self.pool.free(&p.alloc);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocator::FakeEvent;
    use ddo_vmm::{FakePhysicalMemory, VmmPoolConfig};

    const G: u64 = 2 << 20;
    const S0: StreamKey = StreamKey(0);
    const S1: StreamKey = StreamKey(1);

    fn allocator(capacity: u64) -> NativeAllocator<FakePhysicalMemory, FakeEvent> {
        let pool = VmmPool::new(
            FakePhysicalMemory::new(G, capacity),
            VmmPoolConfig::new("cuda:test"),
        )
        .unwrap();
        NativeAllocator::new(pool)
    }

    fn no_sync() -> Result<(), String> {
        Ok(())
    }

    #[test]
    fn same_stream_free_is_reused_at_once_and_other_streams_wait() {
        let a = allocator(64 * G);
        let (x, src) = a.allocate(3 << 20, Some(S0), no_sync).unwrap();
        assert_eq!(src, Source::Pool);
        let pending = FakeEvent::new();
        a.free(x, 3 << 20, vec![(S0, pending.clone())]);
        assert_eq!(a.pending_frees(), 1);
        // Another stream (or any-stream) must not get the range while S0 may still use it.
        let (y, _) = a.allocate(3 << 20, Some(S1), no_sync).unwrap();
        assert_ne!(y.va(), x.va());
        let (z, _) = a.allocate(3 << 20, None, no_sync).unwrap();
        assert_ne!(z.va(), x.va());
        // The same stream reuses it without waiting.
        let (w, src) = a.allocate(3 << 20, Some(S0), no_sync).unwrap();
        assert_eq!((w.va(), src), (x.va(), Source::Reused));
        assert!(!pending.is_done(), "reuse must not wait for the event");
        assert_eq!(a.allocated().0, 9 << 20);
    }

    #[test]
    fn a_range_much_longer_than_the_request_is_not_reused() {
        let a = allocator(64 * G);
        let (x, _) = a.allocate(8 << 20, Some(S0), no_sync).unwrap();
        a.free(x, 8 << 20, vec![(S0, FakeEvent::new())]);
        let (y, src) = a.allocate(1 << 20, Some(S0), no_sync).unwrap();
        assert_eq!(src, Source::Pool);
        assert_ne!(y.va(), x.va());
    }

    #[test]
    fn completed_frees_are_reaped_into_the_pool_and_coalesce() {
        let a = allocator(64 * G);
        let (x, _) = a.allocate(G, None, no_sync).unwrap();
        let (y, _) = a.allocate(G, None, no_sync).unwrap();
        let (ex, ey) = (FakeEvent::new(), FakeEvent::new());
        a.free(x, G, vec![(S1, ex.clone())]);
        a.free(y, G, vec![(S1, ey.clone())]);
        ex.complete();
        ey.complete();
        // Both ranges are back and merged: a 2 G request lands at x without new pages.
        let mapped_before = a.figures().mapped_bytes;
        let (z, src) = a.allocate(2 * G, None, no_sync).unwrap();
        assert_eq!((z.va(), src), (x.va(), Source::Pool));
        assert_eq!(a.figures().mapped_bytes, mapped_before);
        assert_eq!(a.pending_frees(), 0);
    }

    #[test]
    fn out_of_memory_waits_for_pending_frees() {
        let a = allocator(4 * G);
        let (x, _) = a.allocate(2 * G, None, no_sync).unwrap();
        let (_y, _) = a.allocate(2 * G, None, no_sync).unwrap();
        let ev = FakeEvent::new();
        a.free(x, 2 * G, vec![(S0, ev.clone())]);
        // Needs x's range: only after waiting for its event.
        let (z, _) = a.allocate(2 * G, None, no_sync).unwrap();
        assert!(ev.is_done(), "the retry waited for the pending free");
        assert_eq!(z.va(), x.va());
    }

    #[test]
    fn out_of_memory_releases_idle_pages_after_synchronising() {
        // 16 G of address space over 4 G of physical memory: fragmented idle pages must go
        // back to the driver before a 2 G request can be mapped elsewhere.
        let pool = VmmPool::new(
            FakePhysicalMemory::new(G, 4 * G),
            VmmPoolConfig::new("cuda:test").with_capacity(16 * G),
        )
        .unwrap();
        let a: NativeAllocator<FakePhysicalMemory, FakeEvent> = NativeAllocator::new(pool);
        let parts: Vec<_> = (0..4)
            .map(|_| a.allocate(G, None, no_sync).unwrap().0)
            .collect();
        a.free(parts[0], G, vec![]);
        a.free(parts[2], G, vec![]);
        let mut synced = false;
        let (w, _) = a
            .allocate(2 * G, None, || {
                synced = true;
                Ok(())
            })
            .unwrap();
        assert!(synced, "idle pages are released only after synchronising");
        assert_eq!(w.len(), 2 * G);
        let f = a.figures();
        assert_eq!(f.chunks_released, 2);
        assert_eq!((f.live_bytes, f.mapped_bytes), (4 * G, 4 * G));
        // A failing synchronisation refuses the release and keeps the pages.
        a.free(parts[1], G, vec![]);
        let err = a
            .allocate(3 * G, None, || Err("stream 1 failed".into()))
            .unwrap_err();
        assert!(matches!(err, VmmError::NotQuiescent { .. }), "{err}");
        assert_eq!(a.figures().mapped_bytes, 4 * G);
    }

    #[test]
    fn out_of_memory_is_typed_when_nothing_can_be_returned() {
        let a = allocator(2 * G);
        let (_x, _) = a.allocate(2 * G, None, no_sync).unwrap();
        let err = a.allocate(G, None, no_sync).unwrap_err();
        assert!(err.is_out_of_memory(), "{err}");
        assert_eq!(a.allocated().0, 2 * G);
    }

    #[test]
    fn release_refuses_a_busy_gate_and_returns_exactly_the_idle_chunks() {
        let a = allocator(64 * G);
        let (x, _) = a.allocate(3 * G, None, no_sync).unwrap();
        let (y, _) = a.allocate(G, None, no_sync).unwrap();
        a.free(x, 3 * G, vec![(S0, FakeEvent::new())]);
        let err = a
            .release_idle(&QuiescenceGate::busy("stream 0 has queued work"))
            .unwrap_err();
        assert!(matches!(err, VmmError::NotQuiescent { .. }), "{err}");
        assert_eq!(a.figures().chunks_released, 0);
        let report = a
            .release_idle(&QuiescenceGate::quiescent("test: no stream"))
            .unwrap();
        assert_eq!((report.chunks, report.bytes), (3, 3 * G));
        let f = a.figures();
        assert_eq!(f.mapped_bytes, G);
        assert_eq!(f.live_bytes, G);
        assert_eq!(a.pending_frees(), 0);
        let _ = y;
    }
}
