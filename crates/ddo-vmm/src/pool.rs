//! [`VmmPool`]: DDO's native allocator over one reserved virtual address range, and all of
//! its bookkeeping.
//!
//! Layout: the pool reserves one range at creation (its capacity: by default the device's
//! total memory; address space costs no memory) and divides it into pages of the
//! granularity (2 MiB on an H200). A page is either unmapped or backed by one physical chunk
//! of exactly that size, mapped with read-write access.
//!
//! Rules:
//! - Placement: requests round up to [`ALIGNMENT`] (512 B; a request of 0 B still takes
//!   512 B, so every live allocation has its own address). The allocation takes the start of
//!   the smallest free run of the range that fits (best fit, lowest address on ties); free
//!   runs merge with free neighbours, so the range never holds two adjacent free runs. The
//!   untouched end of the range is one large run, taken last, so allocations pack from the
//!   start like a bump allocator and holes are refilled first.
//! - Mapping on demand: an allocation maps (`create` + `map`, then `set_access` once per
//!   contiguous run) every page its rounded bytes touch that is not mapped yet. Allocations
//!   share pages: small neighbours live in one chunk.
//! - Growth without copying (the idea of PyTorch's expandable segments): [`VmmPool::grow`]
//!   keeps the address and maps the pages after the allocation, when the address range after
//!   it is free (always so within the room reserved by [`VmmPool::alloc_growable`]). When the
//!   range after it is held by another allocation, growth is a typed
//!   [`VmmError::GrowBlocked`]: the pool never moves memory (a move would be a device copy
//!   the pool cannot order against streams), so the caller allocates anew and copies.
//! - Freeing returns the address range at once and unmaps nothing: the pages stay mapped as
//!   the pool's cache and back the next allocations placed there.
//! - [`VmmPool::release_idle`] unmaps and releases every mapped page that holds no byte of a
//!   live allocation (never one that does), only through a quiescent
//!   [`QuiescenceGate`]. The pool never releases by itself: an out-of-memory is a typed
//!   [`VmmError::OutOfMemory`] that says how many idle bytes a release would return.
//! - Failures leave the pool consistent: an allocation or growth whose `create`, `map` or
//!   `set_access` fails unmaps and releases the pages it had mapped so far and changes
//!   nothing else; a page whose unmap fails stays mapped (and is given access again before
//!   use); a chunk whose release fails after its unmap is kept as an orphan and released by
//!   the next `release_idle` or at teardown. At every point, chunks held = mapped pages +
//!   orphans.
//! - Accounting is exact: `live` is the sum of the lengths asked for by live allocations,
//!   `va_in_use` the address range they hold (rounded, growth room included), `mapped` the
//!   mapped pages × granularity; `live ≤ mapped ≤ va_reserved`. Peaks of each since
//!   [`VmmPool::reset_peaks`], and counters of chunks mapped, unmapped and released.
//!
//! Stream order is the caller's: the pool cannot see streams. Free an allocation only when
//! no queued work uses it any more (the CUDA wiring defers frees behind events, as its
//! caching allocator does), and release only at a quiescent boundary.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::error::{Result, VmmError};
use crate::physical::{ChunkHandle, PhysicalMemory, VaRange};
use crate::quiescence::QuiescenceGate;

/// Alignment of every allocation, and the rounding of every request.
pub const ALIGNMENT: u64 = 512;

/// The address range a request of `len` bytes occupies: at least [`ALIGNMENT`], rounded
/// up to a multiple of it; `None` on overflow.
pub fn round_len(len: u64) -> Option<u64> {
    len.max(1).checked_next_multiple_of(ALIGNMENT)
}

/// Settings of a [`VmmPool`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmmPoolConfig {
    /// Bytes of virtual address space to reserve (rounded up to the granularity); `None`:
    /// the device's total memory according to [`PhysicalMemory::mem_info`].
    pub capacity: Option<u64>,
    /// The device, for error messages (`cuda:N`).
    pub label: String,
}

impl VmmPoolConfig {
    /// A pool for device `label` with the device's total memory as capacity.
    pub fn new(label: impl Into<String>) -> Self {
        Self {
            capacity: None,
            label: label.into(),
        }
    }

    /// The same, with a capacity of `bytes`.
    pub fn with_capacity(mut self, bytes: u64) -> Self {
        self.capacity = Some(bytes);
        self
    }
}

/// A live allocation of a [`VmmPool`]: plain data (`Copy`); the pool keeps the record.
/// Passing a stale copy (freed, or from another pool) is a typed error, never a wrong free.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PoolAllocation {
    pool: u64,
    id: u64,
    va: u64,
    len: u64,
}

impl PoolAllocation {
    /// Pool-unique id (never reused).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Device address of the first byte (512-byte aligned).
    pub fn va(&self) -> u64 {
        self.va
    }

    /// Length in bytes, as asked for (as of this copy: [`VmmPool::grow`] returns the new one).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the length is 0.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// One past the last byte.
    pub fn end(&self) -> u64 {
        self.va + self.len
    }
}

/// A [`VmmPool`]'s exact figures.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Bytes per page (chunk).
    pub granularity: u64,
    /// Bytes of virtual address space reserved (the capacity; fixed).
    pub va_reserved: u64,
    /// Bytes of the range held by live allocations (rounded, growth room included).
    pub va_in_use: u64,
    /// Peak of `va_in_use` since the last reset.
    pub peak_va_in_use: u64,
    /// Bytes of mapped pages (physical memory the pool holds).
    pub mapped: u64,
    /// Peak of `mapped` since the last reset.
    pub peak_mapped: u64,
    /// Bytes asked for by live allocations.
    pub live: u64,
    /// Peak of `live` since the last reset.
    pub peak_live: u64,
    /// Live allocations.
    pub live_allocations: u64,
    /// Pages mapped now (`mapped / granularity`).
    pub mapped_chunks: u64,
    /// Chunks created since the pool was created (`chunks_created - chunks_released =
    /// mapped_chunks + orphaned_chunks`).
    pub chunks_created: u64,
    /// Chunks mapped since the pool was created.
    pub chunks_mapped: u64,
    /// Chunks unmapped since the pool was created.
    pub chunks_unmapped: u64,
    /// Chunks released to the driver since the pool was created.
    pub chunks_released: u64,
    /// Bytes released to the driver since the pool was created.
    pub bytes_released: u64,
    /// Chunks unmapped whose release failed, awaiting the next `release_idle`.
    pub orphaned_chunks: u64,
}

/// What one [`VmmPool::release_idle`] returned to the driver.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleaseReport {
    /// Chunks released (idle pages, plus orphans from earlier failures).
    pub chunks: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Of `chunks`, orphans released (unmapped earlier, release retried now).
    pub orphans: u64,
    /// Free bytes according to the driver just before the release (sampled), where known.
    pub driver_free_before: Option<u64>,
    /// Free bytes according to the driver just after it, where known.
    pub driver_free_after: Option<u64>,
    /// The quiescence gate's basis.
    pub basis: String,
}

impl ReleaseReport {
    /// How far the driver's free figure rose across the release (0 if it fell), where known.
    pub fn driver_rise(&self) -> Option<u64> {
        Some(
            self.driver_free_after?
                .saturating_sub(self.driver_free_before?),
        )
    }

    /// Whether the driver agrees that at least `bytes` came back (its free figure rose by
    /// that much); `None` when the driver figure is unavailable. A sampled figure: memory
    /// freed or taken concurrently by others moves it too.
    pub fn driver_confirms(&self) -> Option<bool> {
        Some(self.driver_rise()? >= self.bytes)
    }
}

/// A live allocation's record, keyed by its address.
#[derive(Debug, Clone, Copy)]
struct Record {
    id: u64,
    len: u64,
    /// Address range held: `round_len(len)` plus growth room.
    extent: u64,
}

impl Record {
    fn occupied(&self) -> u64 {
        round_len(self.len).unwrap_or(self.extent)
    }
}

/// A mapped page.
struct Page {
    chunk: ChunkHandle,
    access: bool,
}

/// Free runs of the range, coalesced, indexed by start and by size.
#[derive(Default)]
struct FreeList {
    by_start: BTreeMap<u64, u64>,
    by_size: BTreeSet<(u64, u64)>,
}

impl FreeList {
    fn insert_raw(&mut self, start: u64, len: u64) {
        self.by_start.insert(start, len);
        self.by_size.insert((len, start));
    }

    fn remove_raw(&mut self, start: u64) -> Option<u64> {
        let len = self.by_start.remove(&start)?;
        self.by_size.remove(&(len, start));
        Some(len)
    }

    /// Returns `start..start + len` (not free now), merging with free neighbours.
    fn insert(&mut self, mut start: u64, mut len: u64) {
        if let Some((&ps, &pl)) = self.by_start.range(..start).next_back()
            && ps + pl == start
        {
            self.remove_raw(ps);
            start = ps;
            len += pl;
        }
        if let Some(nl) = self.remove_raw(start + len) {
            len += nl;
        }
        self.insert_raw(start, len);
    }

    /// Takes `size` bytes at the start of the smallest run that fits.
    fn best_fit(&mut self, size: u64) -> Option<u64> {
        let &(len, start) = self.by_size.range((size, 0)..).next()?;
        self.remove_raw(start);
        if len > size {
            self.insert_raw(start + size, len - size);
        }
        Some(start)
    }

    /// Takes `start..start + len` if a free run starts at `start` and holds it; otherwise
    /// the first address from `start` on that is not free.
    fn take_at(&mut self, start: u64, len: u64) -> std::result::Result<(), u64> {
        match self.by_start.get(&start).copied() {
            Some(run) if run >= len => {
                self.remove_raw(start);
                if run > len {
                    self.insert_raw(start + len, run - len);
                }
                Ok(())
            }
            Some(run) => Err(start + run),
            None => Err(start),
        }
    }

    fn largest(&self) -> u64 {
        self.by_size.last().map_or(0, |&(len, _)| len)
    }
}

#[derive(Default)]
struct State {
    free: FreeList,
    live: BTreeMap<u64, Record>,
    /// Mapped pages by index in the range.
    pages: BTreeMap<u64, Page>,
    orphans: Vec<ChunkHandle>,
    next_id: u64,
    live_bytes: u64,
    va_in_use: u64,
    peak_live: u64,
    peak_mapped: u64,
    peak_va_in_use: u64,
    chunks_created: u64,
    chunks_mapped: u64,
    chunks_unmapped: u64,
    chunks_released: u64,
    bytes_released: u64,
    closed: bool,
}

/// DDO's native allocator on virtual memory: one reserved range, pages mapped on demand,
/// allocations that grow in place, idle pages released only at quiescent boundaries.
/// See the module documentation for the rules.
pub struct VmmPool<P: PhysicalMemory> {
    phys: P,
    range: VaRange,
    granularity: u64,
    label: String,
    instance: u64,
    state: Mutex<State>,
}

impl<P: PhysicalMemory> VmmPool<P> {
    /// Reserves the pool's range on `phys`. Fails with [`VmmError::InvalidConfig`] for a
    /// granularity that is 0 or not a multiple of [`ALIGNMENT`], a capacity of 0, or no
    /// capacity where the device's total is unknown.
    pub fn new(phys: P, config: VmmPoolConfig) -> Result<Self> {
        let g = phys.granularity();
        if g == 0 || !g.is_multiple_of(ALIGNMENT) {
            return Err(VmmError::InvalidConfig {
                reason: format!(
                    "granularity {g} B is not a positive multiple of {ALIGNMENT} B; the physical layer is broken"
                ),
            });
        }
        let capacity = match config.capacity {
            Some(c) => c,
            None => {
                phys.mem_info()
                    .ok_or_else(|| VmmError::InvalidConfig {
                        reason: "the device's total memory is unknown; give a capacity".into(),
                    })?
                    .1
            }
        };
        let capacity = capacity
            .checked_next_multiple_of(g)
            .filter(|&c| c > 0)
            .ok_or_else(|| VmmError::InvalidConfig {
                reason: format!(
                    "capacity {capacity} B cannot be reserved; give a capacity between 1 B and {} B",
                    u64::MAX - g
                ),
            })?;
        let range = phys.reserve(capacity)?;
        let mut state = State::default();
        state.free.insert(range.base, range.len);
        static NEXT_INSTANCE: AtomicU64 = AtomicU64::new(1);
        Ok(Self {
            phys,
            range,
            granularity: g,
            label: config.label,
            instance: NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed),
            state: Mutex::new(state),
        })
    }

    /// The physical layer (e.g. [`CudaPhysicalMemory::context`](crate::CudaPhysicalMemory::context)).
    pub fn physical(&self) -> &P {
        &self.phys
    }

    /// The reserved range.
    pub fn range(&self) -> VaRange {
        self.range
    }

    /// Bytes per page.
    pub fn granularity(&self) -> u64 {
        self.granularity
    }

    /// The device label given at creation.
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Allocates `bytes` (contents unspecified), mapping the pages it needs.
    pub fn alloc(&self, bytes: u64) -> Result<PoolAllocation> {
        self.alloc_inner(bytes, bytes)
    }

    /// Allocates `bytes` and holds address range for `max_len` bytes after its start, so
    /// [`VmmPool::grow`] up to `max_len` never meets another allocation. The room is address
    /// space only: it is mapped as the allocation grows.
    pub fn alloc_growable(&self, bytes: u64, max_len: u64) -> Result<PoolAllocation> {
        self.alloc_inner(bytes, bytes.max(max_len))
    }

    fn alloc_inner(&self, bytes: u64, room: u64) -> Result<PoolAllocation> {
        let mut st = self.state.lock();
        let st = &mut *st;
        let (occupied, extent) = match (round_len(bytes), round_len(room)) {
            (Some(o), Some(e)) => (o, e),
            _ => return Err(self.exhausted(st, u64::MAX)),
        };
        let Some(va) = st.free.best_fit(extent) else {
            return Err(self.exhausted(st, extent));
        };
        if let Err(e) = self.map_range(st, va, va + occupied) {
            st.free.insert(va, extent);
            return Err(self.out_of_memory(st, bytes, e));
        }
        let id = st.next_id;
        st.next_id += 1;
        st.live.insert(
            va,
            Record {
                id,
                len: bytes,
                extent,
            },
        );
        st.live_bytes += bytes;
        st.va_in_use += extent;
        Self::note_peaks(st, self.granularity);
        Ok(PoolAllocation {
            pool: self.instance,
            id,
            va,
            len: bytes,
        })
    }

    /// Grows `alloc` to `new_len` bytes in place (same address, contents kept), mapping the
    /// pages after it. Returns the allocation with its new length. Refused with
    /// [`VmmError::GrowBlocked`] when the address range after it is held by another
    /// allocation (allocate anew and copy), [`VmmError::CannotShrink`] for a shorter length;
    /// on any failure the allocation is unchanged. `new_len` equal to the length is a no-op.
    pub fn grow(&self, alloc: &PoolAllocation, new_len: u64) -> Result<PoolAllocation> {
        let mut st = self.state.lock();
        let st = &mut *st;
        let rec = self.lookup(st, alloc)?;
        let va = alloc.va;
        let current = PoolAllocation {
            len: rec.len,
            ..*alloc
        };
        if new_len == rec.len {
            return Ok(current);
        }
        if new_len < rec.len {
            return Err(VmmError::CannotShrink {
                va,
                len: rec.len,
                requested: new_len,
            });
        }
        let old_occupied = rec.occupied();
        let Some(new_occupied) = round_len(new_len) else {
            return Err(self.exhausted(st, u64::MAX));
        };
        let mut taken = 0;
        if new_occupied > rec.extent {
            let need = new_occupied - rec.extent;
            if let Err(blocked_at) = st.free.take_at(va + rec.extent, need) {
                return Err(VmmError::GrowBlocked {
                    va,
                    len: rec.len,
                    requested: new_len,
                    blocked_at,
                });
            }
            taken = need;
        }
        if new_occupied > old_occupied
            && let Err(e) = self.map_range(st, va + old_occupied, va + new_occupied)
        {
            if taken > 0 {
                st.free.insert(va + rec.extent, taken);
            }
            return Err(self.out_of_memory(st, new_len - rec.len, e));
        }
        if let Some(r) = st.live.get_mut(&va) {
            r.len = new_len;
            r.extent += taken;
        }
        st.live_bytes += new_len - rec.len;
        st.va_in_use += taken;
        Self::note_peaks(st, self.granularity);
        Ok(PoolAllocation {
            len: new_len,
            ..*alloc
        })
    }

    /// Frees `alloc`: its address range is free at once, its pages stay mapped (the cache)
    /// until [`VmmPool::release_idle`]. Call it only when no queued device work uses the
    /// allocation any more. A freed or foreign allocation is a typed error.
    pub fn free(&self, alloc: &PoolAllocation) -> Result<()> {
        let mut st = self.state.lock();
        let st = &mut *st;
        let rec = self.lookup(st, alloc)?;
        st.live.remove(&alloc.va);
        st.free.insert(alloc.va, rec.extent);
        st.live_bytes -= rec.len;
        st.va_in_use -= rec.extent;
        Ok(())
    }

    /// Unmaps and releases to the driver every mapped page that holds no byte of a live
    /// allocation, and every orphaned chunk; the driver's free figure is sampled before and
    /// after. Refused with [`VmmError::NotQuiescent`] (nothing released) unless `gate` is
    /// quiescent: the pool cannot see streams, so the caller vouches that no queued work
    /// touches pool memory. On a driver failure it stops there and returns the error; what
    /// was released before shows in [`VmmPool::stats`].
    pub fn release_idle(&self, gate: &QuiescenceGate) -> Result<ReleaseReport> {
        if !gate.is_quiescent() {
            return Err(VmmError::NotQuiescent {
                what: gate.basis().to_string(),
            });
        }
        let mut st = self.state.lock();
        let st = &mut *st;
        let mut report = ReleaseReport {
            chunks: 0,
            bytes: 0,
            orphans: 0,
            driver_free_before: self.phys.mem_info().map(|(free, _)| free),
            driver_free_after: None,
            basis: gate.basis().to_string(),
        };
        let orphans = std::mem::take(&mut st.orphans);
        let mut orphans = orphans.into_iter();
        while let Some(chunk) = orphans.next() {
            let bytes = chunk.bytes();
            if let Err(e) = self.release_chunk(st, chunk) {
                st.orphans.extend(orphans);
                return Err(e);
            }
            report.chunks += 1;
            report.orphans += 1;
            report.bytes += bytes;
        }
        for p in self.idle_pages(st) {
            let Some(page) = st.pages.remove(&p) else {
                continue;
            };
            if let Err(e) = self.phys.unmap(self.page_va(p), self.granularity) {
                st.pages.insert(p, page);
                return Err(e);
            }
            st.chunks_unmapped += 1;
            self.release_chunk(st, page.chunk)?;
            report.chunks += 1;
            report.bytes += self.granularity;
        }
        report.driver_free_after = self.phys.mem_info().map(|(free, _)| free);
        Ok(report)
    }

    /// Bytes of mapped pages that hold no live byte (what [`VmmPool::release_idle`] would
    /// unmap now).
    pub fn idle_bytes(&self) -> u64 {
        let st = self.state.lock();
        self.idle_pages(&st).len() as u64 * self.granularity
    }

    /// The exact figures now.
    pub fn stats(&self) -> PoolStats {
        let st = self.state.lock();
        PoolStats {
            granularity: self.granularity,
            va_reserved: self.range.len,
            va_in_use: st.va_in_use,
            peak_va_in_use: st.peak_va_in_use,
            mapped: st.pages.len() as u64 * self.granularity,
            peak_mapped: st.peak_mapped,
            live: st.live_bytes,
            peak_live: st.peak_live,
            live_allocations: st.live.len() as u64,
            mapped_chunks: st.pages.len() as u64,
            chunks_created: st.chunks_created,
            chunks_mapped: st.chunks_mapped,
            chunks_unmapped: st.chunks_unmapped,
            chunks_released: st.chunks_released,
            bytes_released: st.bytes_released,
            orphaned_chunks: st.orphans.len() as u64,
        }
    }

    /// Starts new peaks at the current levels.
    pub fn reset_peaks(&self) {
        let mut st = self.state.lock();
        st.peak_live = st.live_bytes;
        st.peak_va_in_use = st.va_in_use;
        st.peak_mapped = st.pages.len() as u64 * self.granularity;
    }

    /// Every live allocation, in address order.
    pub fn live_allocations(&self) -> Vec<PoolAllocation> {
        let st = self.state.lock();
        st.live
            .iter()
            .map(|(&va, r)| PoolAllocation {
                pool: self.instance,
                id: r.id,
                va,
                len: r.len,
            })
            .collect()
    }

    /// Tears the pool down: unmaps and releases every page and orphan and frees the range.
    /// Fails with [`VmmError::LiveAllocations`] when allocations were still live (their
    /// addresses are invalid now), or with the first driver failure (what could not be
    /// returned stays with the driver until the process ends). Dropping the pool does the
    /// same and ignores the errors.
    pub fn close(self) -> Result<()> {
        let mut st = self.state.lock();
        let live = (st.live.len() as u64, st.live_bytes);
        self.teardown(&mut st)?;
        if live.0 > 0 {
            return Err(VmmError::LiveAllocations {
                count: live.0,
                bytes: live.1,
            });
        }
        Ok(())
    }

    // ----- internals (the lock is held) -----

    fn page_va(&self, page: u64) -> u64 {
        self.range.base + page * self.granularity
    }

    fn lookup(&self, st: &State, alloc: &PoolAllocation) -> Result<Record> {
        if alloc.pool != self.instance {
            return Err(VmmError::WrongPool {
                id: alloc.id,
                va: alloc.va,
            });
        }
        st.live
            .get(&alloc.va)
            .filter(|r| r.id == alloc.id)
            .copied()
            .ok_or(VmmError::UnknownAllocation {
                id: alloc.id,
                va: alloc.va,
            })
    }

    fn note_peaks(st: &mut State, granularity: u64) {
        st.peak_live = st.peak_live.max(st.live_bytes);
        st.peak_va_in_use = st.peak_va_in_use.max(st.va_in_use);
        st.peak_mapped = st.peak_mapped.max(st.pages.len() as u64 * granularity);
    }

    /// Mapped pages with no byte of a live allocation, in order.
    fn idle_pages(&self, st: &State) -> Vec<u64> {
        st.pages
            .keys()
            .copied()
            .filter(|&p| {
                let start = self.page_va(p);
                let end = start + self.granularity;
                // Live ranges are disjoint and sorted: only the last one starting before the
                // page's end can reach into it.
                st.live
                    .range(..end)
                    .next_back()
                    .is_none_or(|(&va, r)| va + r.occupied() <= start)
            })
            .collect()
    }

    /// Releases an unmapped chunk; on failure keeps it as an orphan.
    fn release_chunk(&self, st: &mut State, chunk: ChunkHandle) -> Result<()> {
        let (raw, bytes) = (chunk.raw(), chunk.bytes());
        match self.phys.release(chunk) {
            Ok(()) => {
                st.chunks_released += 1;
                st.bytes_released += bytes;
                Ok(())
            }
            Err(e) => {
                st.orphans.push(ChunkHandle::from_raw(raw, bytes));
                Err(e)
            }
        }
    }

    /// Undoes a page mapped by a failed `map_range`: unmap and release; a page whose unmap
    /// fails stays mapped (without access, so it is given access again before use).
    fn undo_page(&self, st: &mut State, page: u64, chunk: ChunkHandle) {
        match self.phys.unmap(self.page_va(page), self.granularity) {
            Ok(()) => {
                st.chunks_unmapped += 1;
                // On failure the chunk is kept as an orphan; the caller reports the first error.
                let _ = self.release_chunk(st, chunk);
            }
            Err(_) => {
                st.pages.insert(
                    page,
                    Page {
                        chunk,
                        access: false,
                    },
                );
                Self::note_peaks(st, self.granularity);
            }
        }
    }

    /// Makes every page touched by `start..end` mapped with access; all or nothing (pages
    /// that were mapped before stay mapped).
    fn map_range(&self, st: &mut State, start: u64, end: u64) -> Result<()> {
        let g = self.granularity;
        let first = (start - self.range.base) / g;
        let last = (end - self.range.base).div_ceil(g);
        let mut created: Vec<(u64, ChunkHandle)> = Vec::new();
        let mut need_access: Vec<u64> = Vec::new();
        let mut outcome = Ok(());
        for p in first..last {
            match st.pages.get(&p) {
                Some(page) if page.access => {}
                Some(_) => need_access.push(p),
                None => {
                    let chunk = match self.phys.create(g) {
                        Ok(c) => {
                            st.chunks_created += 1;
                            c
                        }
                        Err(e) => {
                            outcome = Err(e);
                            break;
                        }
                    };
                    if let Err(e) = self.phys.map(self.page_va(p), &chunk) {
                        // On failure the chunk is kept as an orphan; report the map error.
                        let _ = self.release_chunk(st, chunk);
                        outcome = Err(e);
                        break;
                    }
                    st.chunks_mapped += 1;
                    created.push((p, chunk));
                    need_access.push(p);
                }
            }
        }
        if outcome.is_ok() {
            let mut i = 0;
            while i < need_access.len() {
                let mut j = i + 1;
                while j < need_access.len() && need_access[j] == need_access[j - 1] + 1 {
                    j += 1;
                }
                let run = &need_access[i..j];
                if let Err(e) = self
                    .phys
                    .set_access(self.page_va(run[0]), run.len() as u64 * g)
                {
                    outcome = Err(e);
                    break;
                }
                for p in run {
                    if let Some(page) = st.pages.get_mut(p) {
                        page.access = true;
                    }
                }
                i = j;
            }
        }
        match outcome {
            Ok(()) => {
                for (p, chunk) in created {
                    st.pages.insert(
                        p,
                        Page {
                            chunk,
                            access: true,
                        },
                    );
                }
                Self::note_peaks(st, g);
                Ok(())
            }
            Err(e) => {
                for (p, chunk) in created.into_iter().rev() {
                    self.undo_page(st, p, chunk);
                }
                Err(e)
            }
        }
    }

    fn exhausted(&self, st: &State, requested: u64) -> VmmError {
        VmmError::AddressSpaceExhausted {
            device: self.label.clone(),
            requested,
            capacity: self.range.len,
            in_use: st.va_in_use,
            largest_free: st.free.largest(),
        }
    }

    /// Turns the driver's out-of-memory into [`VmmError::OutOfMemory`] with the pool's figures.
    fn out_of_memory(&self, st: &State, requested: u64, e: VmmError) -> VmmError {
        if !matches!(e, VmmError::Driver { .. }) || !e.is_out_of_memory() {
            return e;
        }
        let info = self.phys.mem_info();
        VmmError::OutOfMemory {
            device: self.label.clone(),
            requested,
            live: st.live_bytes,
            mapped: st.pages.len() as u64 * self.granularity,
            idle: self.idle_pages(st).len() as u64 * self.granularity,
            driver_free: info.map(|(free, _)| free),
            capacity: info.map_or(self.range.len, |(_, total)| total),
        }
    }

    /// Unmaps and releases everything and frees the range; the first error.
    fn teardown(&self, st: &mut State) -> Result<()> {
        if st.closed {
            return Ok(());
        }
        st.closed = true;
        let mut first: Option<VmmError> = None;
        let mut still_mapped = false;
        for (p, page) in std::mem::take(&mut st.pages) {
            match self.phys.unmap(self.page_va(p), self.granularity) {
                Ok(()) => {
                    st.chunks_unmapped += 1;
                    if let Err(e) = self.release_chunk(st, page.chunk) {
                        first.get_or_insert(e);
                    }
                }
                Err(e) => {
                    // Mapped memory cannot be released; it goes back when the context does.
                    still_mapped = true;
                    first.get_or_insert(e);
                }
            }
        }
        for chunk in std::mem::take(&mut st.orphans) {
            if let Err(e) = self.release_chunk(st, chunk) {
                first.get_or_insert(e);
            }
        }
        if !still_mapped && let Err(e) = self.phys.free_range(self.range) {
            first.get_or_insert(e);
        }
        st.live.clear();
        st.live_bytes = 0;
        st.va_in_use = 0;
        first.map_or(Ok(()), Err)
    }
}

impl<P: PhysicalMemory> Drop for VmmPool<P> {
    fn drop(&mut self) {
        let mut st = self.state.lock();
        // Errors have nowhere to go at teardown; `close` reports them to callers who care.
        let _ = self.teardown(&mut st);
    }
}

impl<P: PhysicalMemory> fmt::Debug for VmmPool<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.stats();
        write!(
            f,
            "VmmPool({}, {:#x}+{} B, {} B live, {} B mapped)",
            self.label, self.range.base, self.range.len, s.live, s.mapped
        )
    }
}
