//! [`NativeAllocator`]: ddo-vmm's [`VmmPool`] as a device allocator — the stream order of
//! frees the pool cannot see, the out-of-memory retry and the figures.
//!
//! The pool knows address ranges, not streams. A [`CudaDevice`](crate::CudaDevice) frees a
//! buffer when its last handle drops, often while kernels queued earlier still use it, so a
//! free comes here with the events of the streams that may still touch the memory (as it
//! does to the caching allocator). The range goes back to the pool **at once** — so best
//! fit and coalescing see it and the pool maps no page it does not need — and is kept in a
//! *quarantine* list with those events until they complete. An allocation that lands on
//! quarantined bytes is ordered behind their last users:
//!
//! - users on the stream the allocation is for (`Some(S)`, the compute ops' case): nothing
//!   to do — stream order already puts the new work after the old;
//! - users on the compute stream, for an allocation for any stream (`None`, the
//!   [`Device::alloc`](ddo_core::Device::alloc) case) or for another stream: the events
//!   become the allocation's *fences*; the device makes a copy stream wait for them on the
//!   GPU (`cuStreamWaitEvent`) before its first use of the allocation, and compute work is
//!   ordered by the stream itself — no host synchronisation;
//! - users on any other stream: the host waits for those events before handing the range
//!   out (rare: frees are normally ordered on the compute stream).
//!
//! Events on one stream complete in order, so the quarantine is reaped from its oldest end
//! and each call costs a few event queries, not one per pending free.
//!
//! Out of memory: wait for every quarantined free is not needed (their ranges are already
//! free); if mapped pages are idle, synchronise the context, release them through a
//! quiescent gate and retry once (what the caching allocator does with its cached
//! segments). The idle cache is otherwise released only by
//! [`NativeAllocator::release_idle`], which the device calls for `release_native_idle_cache`
//! at a boundary the caller vouches for.
//!
//! Generic over the physical layer and the event type, so every rule is tested on CPU with
//! [`FakePhysicalMemory`](ddo_vmm::FakePhysicalMemory) and
//! [`FakeEvent`](crate::allocator::FakeEvent).

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use ddo_metrics::{IdleCacheRelease, NativePoolFigures};
use ddo_vmm::{PhysicalMemory, PoolAllocation, QuiescenceGate, VmmError, VmmPool, round_len};
use parking_lot::Mutex;

use crate::allocator::{FreeEvent, StreamKey};

/// The stream whose frees become GPU-side fences rather than host waits.
pub const COMPUTE_STREAM: StreamKey = StreamKey(0);

/// A freed range whose last users may still be running.
struct Quarantined<E> {
    va: u64,
    end: u64,
    marks: Vec<(StreamKey, Arc<E>)>,
}

struct State<E> {
    /// Free order (oldest first), by sequence number.
    quarantine: VecDeque<u64>,
    /// Sequence number -> entry.
    entries: BTreeMap<u64, Quarantined<E>>,
    /// (start address, sequence number) of every entry, for overlap queries.
    by_va: BTreeMap<(u64, u64), ()>,
    /// Longest quarantined range (bounds the overlap search).
    longest: u64,
    next_seq: u64,
    /// Bytes asked for by allocations handed out and not yet freed.
    allocated: u64,
    peak_allocated: u64,
    /// Bytes of releases the driver's free figure confirmed.
    proven_bytes: u64,
    allocations: u64,
    host_waits: u64,
}

/// One allocation handed out: the pool range and the compute-stream events a stream other
/// than the compute stream must wait for before touching it.
pub struct NativeGrant<E> {
    /// The pool range.
    pub range: PoolAllocation,
    /// Events of compute-stream work that may still use these bytes.
    pub fences: Vec<Arc<E>>,
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
                quarantine: VecDeque::new(),
                entries: BTreeMap::new(),
                by_va: BTreeMap::new(),
                longest: 0,
                next_seq: 0,
                allocated: 0,
                peak_allocated: 0,
                proven_bytes: 0,
                allocations: 0,
                host_waits: 0,
            }),
        }
    }

    /// The pool.
    pub fn pool(&self) -> &VmmPool<P> {
        &self.pool
    }

    /// Allocates `bytes` for work on `stream` (`None`: any stream). `synchronize` blocks
    /// until every stream of the device has drained; it runs only on the retry after an
    /// out-of-memory, before idle pages are released.
    pub fn allocate(
        &self,
        bytes: u64,
        stream: Option<StreamKey>,
        synchronize: impl FnOnce() -> Result<(), String>,
    ) -> Result<NativeGrant<E>, VmmError> {
        let mut st = self.state.lock();
        self.reap(&mut st);
        let range = match self.pool.alloc(bytes) {
            Ok(a) => a,
            Err(e) if e.is_out_of_memory() && self.pool.idle_bytes() > 0 => {
                // Idle pages hold address ranges that did not fit: return them to the
                // driver at a boundary made quiescent here, then map afresh.
                let gate = QuiescenceGate::after_synchronize(synchronize)
                    .map_err(|reason| VmmError::NotQuiescent { what: reason })?;
                self.clear_quarantine(&mut st);
                self.pool.release_idle(&gate)?;
                self.pool.alloc(bytes).map_err(|_| e)?
            }
            Err(e) => return Err(e),
        };
        let fences = self.order_behind_quarantine(&mut st, &range, stream);
        st.allocated += bytes;
        st.peak_allocated = st.peak_allocated.max(st.allocated);
        st.allocations += 1;
        Ok(NativeGrant { range, fences })
    }

    /// Frees an allocation of `requested` bytes: the range is free in the pool at once, and
    /// quarantined behind `marks` (the events of streams that may still use it) until they
    /// complete.
    pub fn free(&self, range: PoolAllocation, requested: u64, marks: Vec<(StreamKey, E)>) {
        let mut st = self.state.lock();
        st.allocated -= requested.min(st.allocated);
        // A stale range cannot reach here (the device frees each one once).
        let _ = self.pool.free(&range);
        if marks.is_empty() {
            return;
        }
        let seq = st.next_seq;
        st.next_seq += 1;
        let occupied = round_len(range.len()).unwrap_or(range.len());
        st.longest = st.longest.max(occupied);
        st.by_va.insert((range.va(), seq), ());
        st.entries.insert(
            seq,
            Quarantined {
                va: range.va(),
                end: range.va() + occupied,
                marks: marks.into_iter().map(|(k, e)| (k, Arc::new(e))).collect(),
            },
        );
        st.quarantine.push_back(seq);
    }

    /// Releases every idle chunk through `gate` and reports it, `proven` when the driver's
    /// free figure rose by at least the bytes released. A quiescent device has completed
    /// every quarantined free, so the quarantine is cleared first.
    pub fn release_idle(&self, gate: &QuiescenceGate) -> Result<IdleCacheRelease, VmmError> {
        if !gate.is_quiescent() {
            return Err(VmmError::NotQuiescent {
                what: gate.basis().to_string(),
            });
        }
        let mut st = self.state.lock();
        self.clear_quarantine(&mut st);
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

    /// How many allocations had to wait on the host for another stream's free.
    pub fn host_waits(&self) -> u64 {
        self.state.lock().host_waits
    }

    /// Freed ranges whose events have not all completed yet.
    pub fn quarantined(&self) -> usize {
        self.state.lock().entries.len()
    }

    /// Starts new peaks at the current levels.
    pub fn reset_peaks(&self) {
        let mut st = self.state.lock();
        st.peak_allocated = st.allocated;
        self.pool.reset_peaks();
    }

    /// Drops completed quarantine entries from the oldest end (events of one stream
    /// complete in order), stopping at the first that is still pending.
    fn reap(&self, st: &mut State<E>) {
        while let Some(&seq) = st.quarantine.front() {
            let done = st.entries.get_mut(&seq).is_none_or(|q| {
                q.marks
                    .retain(|(_, e)| !matches!(e.is_complete(), Ok(true)));
                q.marks.is_empty()
            });
            if !done {
                break;
            }
            st.quarantine.pop_front();
            Self::remove_entry(st, seq);
        }
    }

    fn remove_entry(st: &mut State<E>, seq: u64) {
        if let Some(q) = st.entries.remove(&seq) {
            st.by_va.remove(&(q.va, seq));
        }
        if st.entries.is_empty() {
            st.longest = 0;
        }
    }

    /// Orders `range`, about to be handed out for `stream`, behind the quarantined frees it
    /// overlaps: returns the compute-stream fences, waits on the host for the others.
    fn order_behind_quarantine(
        &self,
        st: &mut State<E>,
        range: &PoolAllocation,
        stream: Option<StreamKey>,
    ) -> Vec<Arc<E>> {
        if st.entries.is_empty() {
            // Nothing pending: the common case once the GPU has caught up.
            return Vec::new();
        }
        let start = range.va();
        let end = start + round_len(range.len()).unwrap_or(range.len());
        let from = start.saturating_sub(st.longest);
        let overlapping: Vec<u64> = st
            .by_va
            .range((from, 0)..(end, 0))
            .map(|(&(_, seq), _)| seq)
            .filter(|seq| {
                st.entries
                    .get(seq)
                    .is_some_and(|q| q.end > start && q.va < end)
            })
            .collect();
        let mut fences = Vec::new();
        for seq in overlapping {
            let Some(q) = st.entries.get(&seq) else {
                continue;
            };
            for (key, event) in &q.marks {
                if Some(*key) == stream {
                    continue; // stream order
                }
                if *key == COMPUTE_STREAM {
                    fences.push(Arc::clone(event));
                } else if !matches!(event.is_complete(), Ok(true)) {
                    st.host_waits += 1;
                    // A failed wait means the context is lost: nothing runs any more.
                    let _ = event.wait();
                }
            }
        }
        fences
    }

    fn clear_quarantine(&self, st: &mut State<E>) {
        for (_, q) in std::mem::take(&mut st.entries) {
            for (_, e) in &q.marks {
                let _ = e.wait();
            }
        }
        st.quarantine.clear();
        st.by_va.clear();
        st.longest = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocator::FakeEvent;
    use ddo_vmm::{FakePhysicalMemory, VmmPoolConfig};
    use proptest::prelude::*;

    const G: u64 = 2 << 20;
    const S0: StreamKey = COMPUTE_STREAM;
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
    fn a_compute_free_is_reused_at_once_by_compute_and_fenced_for_other_streams() {
        let a = allocator(64 * G);
        let x = a.allocate(3 << 20, Some(S0), no_sync).unwrap().range;
        let pending = FakeEvent::new();
        a.free(x, 3 << 20, vec![(S0, pending.clone())]);
        assert_eq!(a.quarantined(), 1);
        // Compute reuses the bytes without waiting: stream order covers it.
        let y = a.allocate(3 << 20, Some(S0), no_sync).unwrap();
        assert_eq!(y.range.va(), x.va());
        assert!(y.fences.is_empty());
        assert!(!pending.is_done(), "no host wait");
        a.free(y.range, 3 << 20, vec![(S0, FakeEvent::new())]);
        // Any-stream gets the same bytes with both compute events as fences, no host wait.
        let z = a.allocate(3 << 20, None, no_sync).unwrap();
        assert_eq!(z.range.va(), x.va());
        assert_eq!(z.fences.len(), 2);
        assert!(!pending.is_done());
        assert_eq!(a.host_waits(), 0);
    }

    #[test]
    fn a_free_on_another_stream_is_waited_for_on_the_host() {
        let a = allocator(64 * G);
        let x = a.allocate(G, None, no_sync).unwrap().range;
        let copy_done = FakeEvent::new();
        a.free(x, G, vec![(S1, copy_done.clone())]);
        let y = a.allocate(G, Some(S0), no_sync).unwrap();
        assert_eq!(y.range.va(), x.va());
        assert!(copy_done.is_done(), "the host waited for stream 1");
        assert_eq!(a.host_waits(), 1);
        // Stream 1 itself would not have waited.
        a.free(y.range, G, vec![(S1, FakeEvent::new())]);
        let w = a.allocate(G, Some(S1), no_sync).unwrap();
        assert!(w.fences.is_empty());
        assert_eq!(a.host_waits(), 1);
    }

    #[test]
    fn completed_frees_leave_the_quarantine_from_the_oldest_end() {
        let a = allocator(64 * G);
        let xs: Vec<_> = (0..3)
            .map(|_| a.allocate(G, Some(S0), no_sync).unwrap().range)
            .collect();
        let evs: Vec<FakeEvent> = (0..3).map(|_| FakeEvent::new()).collect();
        for (x, e) in xs.iter().zip(&evs) {
            a.free(*x, G, vec![(S0, e.clone())]);
        }
        evs[1].complete();
        let _ = a.allocate(1, Some(S0), no_sync).unwrap();
        assert_eq!(a.quarantined(), 3, "the oldest is still pending");
        evs[0].complete();
        let _ = a.allocate(1, Some(S0), no_sync).unwrap();
        assert_eq!(a.quarantined(), 1);
    }

    #[test]
    fn repeated_frees_behind_a_busy_gpu_do_not_grow_the_mapping() {
        // The host runs far ahead of the GPU: no free event ever completes here. The
        // mapping must stay at the high-water mark of what is live at once.
        let a = allocator(64 * G);
        let sizes = [5 << 20, 17 << 20, 3 << 20, 40 << 20, 9 << 20];
        for round in 0..50 {
            let live: Vec<_> = sizes
                .iter()
                .map(|&s| (a.allocate(s, Some(S0), no_sync).unwrap().range, s))
                .collect();
            for (r, s) in live {
                a.free(r, s, vec![(S0, FakeEvent::new())]);
            }
            let f = a.figures();
            assert!(
                f.peak_mapped_bytes <= f.peak_live_bytes + 2 * G,
                "round {round}: {f:?}"
            );
        }
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
            .map(|_| a.allocate(G, None, no_sync).unwrap().range)
            .collect();
        a.free(parts[0], G, vec![]);
        a.free(parts[2], G, vec![]);
        let mut synced = false;
        let w = a
            .allocate(2 * G, None, || {
                synced = true;
                Ok(())
            })
            .unwrap();
        assert!(synced, "idle pages are released only after synchronising");
        assert_eq!(w.range.len(), 2 * G);
        let f = a.figures();
        assert_eq!(f.chunks_released, 2);
        assert_eq!((f.live_bytes, f.mapped_bytes), (4 * G, 4 * G));
        // A failing synchronisation refuses the release and keeps the pages.
        a.free(parts[1], G, vec![]);
        let err = a
            .allocate(3 * G, None, || Err("stream 1 failed".into()))
            .err()
            .expect("refused");
        assert!(matches!(err, VmmError::NotQuiescent { .. }), "{err}");
        assert_eq!(a.figures().mapped_bytes, 4 * G);
    }

    #[test]
    fn out_of_memory_is_typed_when_nothing_can_be_returned() {
        let a = allocator(2 * G);
        let _x = a.allocate(2 * G, None, no_sync).unwrap();
        let err = a.allocate(G, None, no_sync).err().expect("out of memory");
        assert!(err.is_out_of_memory(), "{err}");
        assert_eq!(a.allocated().0, 2 * G);
    }

    #[test]
    fn release_refuses_a_busy_gate_and_returns_exactly_the_idle_chunks() {
        let a = allocator(64 * G);
        let x = a.allocate(3 * G, None, no_sync).unwrap().range;
        let _y = a.allocate(G, None, no_sync).unwrap();
        let ev = FakeEvent::new();
        a.free(x, 3 * G, vec![(S0, ev.clone())]);
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
        assert_eq!((f.mapped_bytes, f.live_bytes), (G, G));
        assert_eq!(a.quarantined(), 0);
    }

    #[derive(Debug, Clone)]
    enum Step {
        Alloc { bytes: u64, stream: u8 },
        Free { pick: usize, mark: u8 },
        Complete { pick: usize },
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (1u64..(6 << 20), 0u8..3).prop_map(|(bytes, stream)| Step::Alloc { bytes, stream }),
            (any::<usize>(), 0u8..3).prop_map(|(pick, mark)| Step::Free { pick, mark }),
            any::<usize>().prop_map(|pick| Step::Complete { pick }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Live allocations never overlap, and every handed-out range that overlaps a
        /// pending free of another stream is ordered behind it: fenced (compute) or
        /// waited for on the host (any other stream).
        #[test]
        fn every_grant_is_ordered_behind_the_pending_frees_it_overlaps(
            steps in prop::collection::vec(step(), 1..120)
        ) {
            let a = allocator(32 * G);
            let mut live: Vec<(PoolAllocation, u64)> = Vec::new();
            // (va, end, stream, event) of frees whose event is pending.
            let mut pending: Vec<(u64, u64, StreamKey, FakeEvent)> = Vec::new();
            for s in steps {
                match s {
                    Step::Alloc { bytes, stream } => {
                        let key = match stream { 0 => Some(S0), 1 => Some(S1), _ => None };
                        let Ok(g) = a.allocate(bytes, key, no_sync) else { continue };
                        let (va, end) = (g.range.va(), g.range.va() + bytes);
                        for (l, lb) in &live {
                            prop_assert!(end <= l.va() || l.va() + lb <= va, "overlap");
                        }
                        for (pva, pend, pkey, ev) in &pending {
                            let overlaps = *pend > va && *pva < end;
                            if !overlaps || ev.is_done() || Some(*pkey) == key {
                                continue;
                            }
                            prop_assert!(*pkey == S0, "a non-compute free must have been waited");
                            prop_assert!(
                                g.fences.iter().any(|f| !f.is_done()),
                                "a compute free must be a fence"
                            );
                        }
                        live.push((g.range, bytes));
                    }
                    Step::Free { pick, mark } if !live.is_empty() => {
                        let (r, b) = live.swap_remove(pick % live.len());
                        if mark == 2 {
                            a.free(r, b, vec![]);
                        } else {
                            let key = if mark == 0 { S0 } else { S1 };
                            let ev = FakeEvent::new();
                            a.free(r, b, vec![(key, ev.clone())]);
                            pending.push((r.va(), r.va() + round_len(b).unwrap(), key, ev));
                        }
                    }
                    Step::Complete { pick } if !pending.is_empty() => {
                        pending[pick % pending.len()].3.complete();
                    }
                    _ => {}
                }
                let f = a.figures();
                prop_assert_eq!(f.live_bytes, live.iter().map(|(_, b)| b).sum::<u64>());
                prop_assert!(f.live_bytes <= f.mapped_bytes);
            }
        }
    }
}
