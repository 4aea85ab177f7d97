//! The caching allocator: PyTorch-style size classes, best-fit reuse of cached blocks,
//! block splitting and merging within segments, stream-ordered reuse, an out-of-memory
//! retry, and exact accounting.
//!
//! The bookkeeping here is backend-free: it sits on two small traits, [`RawMemory`] (the
//! driver's `cuMemAlloc`/`cuMemFree`, or [`FakeMemory`]) and [`FreeEvent`] (a CUDA event
//! recorded where a block was freed, or [`FakeEvent`]), so every rule below is tested on
//! CPU, including by property tests.
//!
//! Rules:
//! - Requests round up to a multiple of 512 B ([`round_size`]). Rounded sizes up to 1 MiB
//!   come from the small pool, carved out of 2 MiB segments; larger ones from the large pool,
//!   whose segments are 20 MiB for requests under 10 MiB and the request rounded up to 2 MiB
//!   otherwise ([`segment_size`]). A block never moves between pools.
//! - An allocation takes the smallest cached free block of its pool that fits and that it
//!   may use (best fit), splitting off the rest when the rest is worth keeping (at least
//!   512 B in the small pool, more than 1 MiB in the large pool).
//! - A freed block merges with free neighbours in its segment, so a segment never holds two
//!   adjacent free blocks.
//! - Stream order: a free carries marks, each an event recorded on a stream at the free. An
//!   allocation for stream `S` may take a block whose pending marks are all on `S` (work on
//!   `S` runs in order); an allocation for another stream, or for no stream in particular,
//!   only once those events have completed.
//! - Out of memory: wait for every pending mark, retry the cache, return every idle segment
//!   to the driver, retry the driver once; then a typed [`CudaError::OutOfMemory`].
//! - [`CachingAllocator::empty_cache`] returns idle whole segments to the driver.
//! - Accounting is exact: `allocated` is the sum of the bytes asked for by live
//!   allocations, `reserved` the sum of the segments held; peaks of both.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::error::{CudaError, Result};

/// Smallest block, and the rounding of every request.
pub const MIN_BLOCK: u64 = 512;
/// Largest rounded size served by the small pool.
pub const SMALL_SIZE: u64 = 1 << 20;
/// Segment size of the small pool.
pub const SMALL_SEGMENT: u64 = 2 << 20;
/// Requests of the large pool below this size share [`LARGE_SEGMENT`]-sized segments.
pub const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// Segment size for large requests under [`MIN_LARGE_ALLOC`].
pub const LARGE_SEGMENT: u64 = 20 << 20;
/// Larger segments are the request rounded up to this.
pub const ROUND_LARGE: u64 = 2 << 20;

/// The size a request of `bytes` occupies: at least [`MIN_BLOCK`], rounded up to a multiple
/// of it.
pub fn round_size(bytes: u64) -> u64 {
    bytes.max(1).div_ceil(MIN_BLOCK).saturating_mul(MIN_BLOCK)
}

/// Which pool a rounded size comes from.
pub fn pool_of(rounded: u64) -> Pool {
    if rounded <= SMALL_SIZE {
        Pool::Small
    } else {
        Pool::Large
    }
}

/// The segment requested from the driver when no cached block fits a rounded size.
pub fn segment_size(rounded: u64) -> u64 {
    if rounded <= SMALL_SIZE {
        SMALL_SEGMENT
    } else if rounded < MIN_LARGE_ALLOC {
        LARGE_SEGMENT
    } else {
        rounded.div_ceil(ROUND_LARGE).saturating_mul(ROUND_LARGE)
    }
}

fn worth_splitting(pool: Pool, remaining: u64) -> bool {
    match pool {
        Pool::Small => remaining >= MIN_BLOCK,
        Pool::Large => remaining > SMALL_SIZE,
    }
}

/// The two pools of cached blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Pool {
    /// Rounded sizes up to 1 MiB, in 2 MiB segments.
    Small,
    /// Everything larger.
    Large,
}

/// Identifies a stream to the allocator (unique per device).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamKey(pub u64);

/// Why raw memory could not be allocated.
#[derive(Debug)]
pub enum RawAllocError {
    /// The device has no room (the allocator may free cached segments and retry).
    OutOfMemory,
    /// Anything else (returned to the caller as is).
    Failed(CudaError),
}

/// Raw device memory: what the allocator carves into blocks. Implementations just call the
/// driver (or fake it); all bookkeeping lives in [`CachingAllocator`].
pub trait RawMemory: Send + Sync {
    /// Allocates a segment of `bytes`; its device address.
    fn alloc(&self, bytes: u64) -> std::result::Result<u64, RawAllocError>;
    /// Frees a segment allocated by [`RawMemory::alloc`]. Called only when no block of it is
    /// live and no queued work uses it.
    fn free(&self, ptr: u64) -> Result<()>;
    /// Free bytes on the device, where known (for error messages).
    fn free_bytes(&self) -> Option<u64> {
        None
    }
}

impl<T: RawMemory + ?Sized> RawMemory for Arc<T> {
    fn alloc(&self, bytes: u64) -> std::result::Result<u64, RawAllocError> {
        (**self).alloc(bytes)
    }
    fn free(&self, ptr: u64) -> Result<()> {
        (**self).free(ptr)
    }
    fn free_bytes(&self) -> Option<u64> {
        (**self).free_bytes()
    }
}

/// An event recorded on a stream where a block was freed: the block is idle once it has
/// completed.
pub trait FreeEvent: Send {
    /// Whether the event has completed (never blocks).
    fn is_complete(&self) -> Result<bool>;
    /// Blocks until the event has completed.
    fn wait(&self) -> Result<()>;
}

/// A live allocation. Give it back with [`CachingAllocator::free`]; a block that is dropped
/// instead stays allocated (it leaks, visibly, in `allocated`).
#[derive(Debug)]
pub struct Block {
    ptr: u64,
    size: u64,
    requested: u64,
    owner: u64,
}

impl Block {
    /// Device address of the first byte.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes the block occupies (the rounded size, or more when a remainder was too small to
    /// split off).
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Bytes asked for.
    pub fn requested(&self) -> u64 {
        self.requested
    }
}

/// Exact figures of a [`CachingAllocator`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllocatorStats {
    /// Bytes asked for by live allocations.
    pub allocated: u64,
    /// Peak of `allocated` since the last reset.
    pub peak_allocated: u64,
    /// Bytes of segments held (live or cached).
    pub reserved: u64,
    /// Peak of `reserved` since the last reset.
    pub peak_reserved: u64,
    /// Segments held.
    pub segments: u64,
    /// Live allocations.
    pub active_blocks: u64,
    /// Cached free blocks.
    pub free_blocks: u64,
    /// Free events not yet seen complete.
    pub pending_events: u64,
    /// Segments requested from the driver, ever.
    pub driver_allocs: u64,
    /// Segments returned to the driver, ever.
    pub driver_frees: u64,
    /// Out-of-memory recoveries (wait, release idle segments, retry).
    pub oom_retries: u64,
}

/// One block of a [`SegmentSnapshot`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockSnapshot {
    /// Address.
    pub ptr: u64,
    /// Size.
    pub size: u64,
    /// Whether it is live.
    pub allocated: bool,
    /// Bytes asked for (0 for a free block).
    pub requested: u64,
    /// Streams of the free events it still waits for.
    pub pending_streams: Vec<StreamKey>,
}

/// A segment and its blocks in address order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentSnapshot {
    /// Base address.
    pub base: u64,
    /// Size.
    pub size: u64,
    /// Pool.
    pub pool: Pool,
    /// Blocks, tiling the segment.
    pub blocks: Vec<BlockSnapshot>,
}

struct BlockInfo {
    size: u64,
    segment: u64,
    allocated: bool,
    requested: u64,
    pending: Vec<u64>,
}

struct SegmentInfo {
    size: u64,
    pool: Pool,
}

struct Mark<E> {
    stream: StreamKey,
    event: E,
}

struct State<E> {
    blocks: BTreeMap<u64, BlockInfo>,
    segments: BTreeMap<u64, SegmentInfo>,
    free: BTreeSet<(Pool, u64, u64)>,
    marks: HashMap<u64, Mark<E>>,
    queues: BTreeMap<StreamKey, VecDeque<u64>>,
    next_mark: u64,
    stats: AllocatorStats,
}

impl<E: FreeEvent> State<E> {
    fn new() -> Self {
        Self {
            blocks: BTreeMap::new(),
            segments: BTreeMap::new(),
            free: BTreeSet::new(),
            marks: HashMap::new(),
            queues: BTreeMap::new(),
            next_mark: 0,
            stats: AllocatorStats::default(),
        }
    }

    /// Drops the marks whose events have completed. Events of one stream complete in the
    /// order they were recorded, so each stream's queue stops at its first pending event.
    fn poll(&mut self) -> Result<()> {
        for queue in self.queues.values_mut() {
            while let Some(&id) = queue.front() {
                match self.marks.get(&id) {
                    None => {
                        queue.pop_front();
                    }
                    Some(mark) => {
                        if mark.event.is_complete()? {
                            self.marks.remove(&id);
                            queue.pop_front();
                        } else {
                            break;
                        }
                    }
                }
            }
        }
        self.queues.retain(|_, q| !q.is_empty());
        Ok(())
    }

    /// Waits for every pending mark; afterwards every cached block is idle.
    fn wait_all(&mut self) -> Result<()> {
        for mark in self.marks.values() {
            mark.event.wait()?;
        }
        self.marks.clear();
        self.queues.clear();
        Ok(())
    }

    fn usable_by(&self, pending: &[u64], stream: Option<StreamKey>) -> bool {
        pending.iter().all(|id| match self.marks.get(id) {
            None => true,
            Some(mark) => Some(mark.stream) == stream,
        })
    }

    fn find_fit(&self, pool: Pool, size: u64, stream: Option<StreamKey>) -> Option<u64> {
        self.free
            .range((pool, size, 0)..)
            .take_while(|(p, _, _)| *p == pool)
            .find(|(_, _, ptr)| self.usable_by(&self.blocks[ptr].pending, stream))
            .map(|&(_, _, ptr)| ptr)
    }

    fn take(&mut self, ptr: u64, size: u64, requested: u64, owner: u64) -> Block {
        let pool = self.segments[&self.blocks[&ptr].segment].pool;
        let (block_size, segment, pending) = {
            let b = &self.blocks[&ptr];
            (b.size, b.segment, b.pending.clone())
        };
        self.free.remove(&(pool, block_size, ptr));
        let remaining = block_size - size;
        let size = if worth_splitting(pool, remaining) {
            let rest = ptr + size;
            self.blocks.insert(
                rest,
                BlockInfo {
                    size: remaining,
                    segment,
                    allocated: false,
                    requested: 0,
                    pending,
                },
            );
            self.free.insert((pool, remaining, rest));
            size
        } else {
            block_size
        };
        // A block taken while marks of its own stream pend keeps them: its next free must
        // still order other streams after the earlier owner's work.
        let mut pending =
            std::mem::take(&mut self.blocks.get_mut(&ptr).expect("block exists").pending);
        self.prune(&mut pending);
        let b = self.blocks.get_mut(&ptr).expect("block exists");
        b.size = size;
        b.allocated = true;
        b.requested = requested;
        b.pending = pending;
        let s = &mut self.stats;
        s.allocated += requested;
        s.peak_allocated = s.peak_allocated.max(s.allocated);
        s.active_blocks += 1;
        Block {
            ptr,
            size,
            requested,
            owner,
        }
    }

    fn add_segment(&mut self, base: u64, size: u64, pool: Pool) {
        self.segments.insert(base, SegmentInfo { size, pool });
        self.blocks.insert(
            base,
            BlockInfo {
                size,
                segment: base,
                allocated: false,
                requested: 0,
                pending: Vec::new(),
            },
        );
        self.free.insert((pool, size, base));
        let s = &mut self.stats;
        s.reserved += size;
        s.peak_reserved = s.peak_reserved.max(s.reserved);
        s.driver_allocs += 1;
    }

    fn add_mark(&mut self, stream: StreamKey, event: E) -> u64 {
        let id = self.next_mark;
        self.next_mark += 1;
        self.marks.insert(id, Mark { stream, event });
        self.queues.entry(stream).or_default().push_back(id);
        id
    }

    /// Returns idle whole segments to `mem`; the bytes returned. Keeps going past a failed
    /// free and reports the first failure after the others were returned.
    fn release_idle(&mut self, mem: &dyn RawMemory) -> Result<u64> {
        let idle: Vec<(u64, u64, Pool)> = self
            .segments
            .iter()
            .filter(|(base, seg)| {
                let b = &self.blocks[*base];
                !b.allocated && b.size == seg.size && self.usable_by(&b.pending, None)
            })
            .map(|(base, seg)| (*base, seg.size, seg.pool))
            .collect();
        let mut returned = 0;
        let mut first_error = None;
        for (base, size, pool) in idle {
            match mem.free(base) {
                Ok(()) => {
                    self.segments.remove(&base);
                    self.blocks.remove(&base);
                    self.free.remove(&(pool, size, base));
                    self.stats.reserved -= size;
                    self.stats.driver_frees += 1;
                    returned += size;
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(returned),
        }
    }

    fn prune(&self, pending: &mut Vec<u64>) {
        pending.retain(|id| self.marks.contains_key(id));
    }
}

static NEXT_OWNER: AtomicU64 = AtomicU64::new(1);

/// A caching allocator over raw memory `M`, with free events `E`. See the module docs for
/// its rules.
pub struct CachingAllocator<M, E> {
    mem: M,
    device: String,
    owner: u64,
    state: Mutex<State<E>>,
}

impl<M: RawMemory, E: FreeEvent> CachingAllocator<M, E> {
    /// An empty allocator over `mem`; `device` names the device in errors.
    pub fn new(mem: M, device: impl Into<String>) -> Self {
        Self {
            mem,
            device: device.into(),
            owner: NEXT_OWNER.fetch_add(1, Ordering::Relaxed),
            state: Mutex::new(State::new()),
        }
    }

    /// The raw memory underneath.
    pub fn raw(&self) -> &M {
        &self.mem
    }

    /// Allocates `bytes` for use on `stream` (`None`: on any stream, so only idle blocks
    /// qualify). Contents are unspecified.
    pub fn allocate(&self, bytes: u64, stream: Option<StreamKey>) -> Result<Block> {
        let mut st = self.state.lock();
        st.poll()?;
        let size = round_size(bytes);
        let pool = pool_of(size);
        if let Some(ptr) = st.find_fit(pool, size, stream) {
            return Ok(st.take(ptr, size, bytes, self.owner));
        }
        let segment = segment_size(size);
        let t = std::time::Instant::now();
        let got = self.mem.alloc(segment);
        crate::setup_calls::device_alloc(t.elapsed());
        match got {
            Ok(base) => {
                st.add_segment(base, segment, pool);
                return Ok(st.take(base, size, bytes, self.owner));
            }
            Err(RawAllocError::Failed(e)) => return Err(e),
            Err(RawAllocError::OutOfMemory) => {}
        }
        // Out of memory: make every cached block idle, try the cache again, then give idle
        // segments back to the driver and ask once more.
        st.stats.oom_retries += 1;
        st.wait_all()?;
        if let Some(ptr) = st.find_fit(pool, size, stream) {
            return Ok(st.take(ptr, size, bytes, self.owner));
        }
        st.release_idle(&self.mem)?;
        match self.mem.alloc(segment) {
            Ok(base) => {
                st.add_segment(base, segment, pool);
                Ok(st.take(base, size, bytes, self.owner))
            }
            Err(RawAllocError::Failed(e)) => Err(e),
            Err(RawAllocError::OutOfMemory) => Err(CudaError::OutOfMemory {
                device: self.device.clone(),
                requested: bytes,
                allocated: st.stats.allocated,
                reserved: st.stats.reserved,
                free: self.mem.free_bytes().unwrap_or(0),
                total: 0,
            }),
        }
    }

    /// Gives `block` back. `marks` are events recorded where it was freed, each on its
    /// stream: the block is reusable at once by an allocation for a stream all its pending
    /// marks are on, by any other once they have completed. No marks: idle at once.
    /// A block of another allocator is ignored.
    pub fn free(&self, block: Block, marks: Vec<(StreamKey, E)>) {
        if block.owner != self.owner {
            debug_assert!(false, "block freed into the wrong allocator");
            return;
        }
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let mut pending: Vec<u64> = marks
            .into_iter()
            .map(|(stream, event)| st.add_mark(stream, event))
            .collect();
        let Some(info) = st.blocks.get(&block.ptr) else {
            debug_assert!(false, "freed block {:#x} is unknown", block.ptr);
            return;
        };
        if !info.allocated {
            debug_assert!(false, "block {:#x} freed twice", block.ptr);
            return;
        }
        let (segment, mut size, requested) = (info.segment, info.size, info.requested);
        pending.extend(info.pending.iter().copied());
        let pool = st.segments[&segment].pool;
        let mut ptr = block.ptr;
        st.stats.allocated -= requested;
        st.stats.active_blocks -= 1;
        // Merge with the free block before it.
        let prev = st
            .blocks
            .range(..ptr)
            .next_back()
            .filter(|(p, b)| b.segment == segment && !b.allocated && *p + b.size == ptr)
            .map(|(p, b)| (*p, b.size));
        if let Some((p, s)) = prev {
            st.free.remove(&(pool, s, p));
            let removed = st.blocks.remove(&ptr).expect("block exists");
            debug_assert_eq!(removed.size, size);
            let prev_block = st.blocks.get_mut(&p).expect("prev exists");
            pending.append(&mut prev_block.pending);
            ptr = p;
            size += s;
        }
        // Merge with the free block after it.
        let next = ptr + size;
        let after = st
            .blocks
            .get(&next)
            .filter(|b| b.segment == segment && !b.allocated)
            .map(|b| b.size);
        if let Some(s) = after {
            st.free.remove(&(pool, s, next));
            let mut removed = st.blocks.remove(&next).expect("next exists");
            pending.append(&mut removed.pending);
            size += s;
        }
        st.prune(&mut pending);
        pending.sort_unstable();
        pending.dedup();
        let b = st.blocks.get_mut(&ptr).expect("merged block exists");
        b.size = size;
        b.allocated = false;
        b.requested = 0;
        b.pending = pending;
        st.free.insert((pool, size, ptr));
    }

    /// Returns idle whole segments to the driver; the bytes returned. Segments whose free
    /// events have not completed stay (synchronise first to return everything idle).
    pub fn empty_cache(&self) -> Result<u64> {
        let mut st = self.state.lock();
        st.poll()?;
        st.release_idle(&self.mem)
    }

    /// Waits for every pending free event, then returns every idle segment to the driver.
    pub fn wait_and_empty_cache(&self) -> Result<u64> {
        let mut st = self.state.lock();
        st.wait_all()?;
        st.release_idle(&self.mem)
    }

    /// The figures now.
    pub fn stats(&self) -> AllocatorStats {
        let st = self.state.lock();
        let mut s = st.stats;
        s.segments = st.segments.len() as u64;
        s.free_blocks = st.free.len() as u64;
        s.pending_events = st.marks.len() as u64;
        s
    }

    /// Starts new peaks at the current levels.
    pub fn reset_peak(&self) {
        let mut st = self.state.lock();
        st.stats.peak_allocated = st.stats.allocated;
        st.stats.peak_reserved = st.stats.reserved;
    }

    /// Every segment and its blocks, in address order.
    pub fn snapshot(&self) -> Vec<SegmentSnapshot> {
        let st = self.state.lock();
        st.segments
            .iter()
            .map(|(&base, seg)| SegmentSnapshot {
                base,
                size: seg.size,
                pool: seg.pool,
                blocks: st
                    .blocks
                    .range(base..base + seg.size)
                    .filter(|(_, b)| b.segment == base)
                    .map(|(&ptr, b)| BlockSnapshot {
                        ptr,
                        size: b.size,
                        allocated: b.allocated,
                        requested: b.requested,
                        pending_streams: b
                            .pending
                            .iter()
                            .filter_map(|id| st.marks.get(id).map(|m| m.stream))
                            .collect(),
                    })
                    .collect(),
            })
            .collect()
    }

    /// Checks the bookkeeping's invariants; a description of the first broken one. Blocks
    /// tile each segment, no two free blocks are adjacent, the free index matches the
    /// blocks, and `allocated`/`reserved` equal the sums they stand for.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let st = self.state.lock();
        let mut reserved = 0;
        let mut allocated = 0;
        let mut free_seen = 0;
        for (&base, seg) in &st.segments {
            reserved += seg.size;
            let mut at = base;
            let mut prev_free = false;
            for (&ptr, b) in st.blocks.range(base..base + seg.size) {
                if b.segment != base {
                    return Err(format!(
                        "block {ptr:#x} in segment {base:#x}'s range belongs to {:#x}",
                        b.segment
                    ));
                }
                if ptr != at {
                    return Err(format!(
                        "segment {base:#x}: gap or overlap at {at:#x} (next block {ptr:#x})"
                    ));
                }
                if !b.allocated {
                    if prev_free {
                        return Err(format!(
                            "segment {base:#x}: adjacent free blocks at {ptr:#x}"
                        ));
                    }
                    if !st.free.contains(&(seg.pool, b.size, ptr)) {
                        return Err(format!("free block {ptr:#x} missing from the free index"));
                    }
                    free_seen += 1;
                } else {
                    allocated += b.requested;
                    if b.requested > b.size {
                        return Err(format!(
                            "block {ptr:#x} holds {} B of {} B",
                            b.requested, b.size
                        ));
                    }
                }
                prev_free = !b.allocated;
                at = ptr + b.size;
            }
            if at != base + seg.size {
                return Err(format!(
                    "segment {base:#x}: blocks end at {at:#x}, not {:#x}",
                    base + seg.size
                ));
            }
        }
        if free_seen != st.free.len() {
            return Err(format!(
                "free index has {} entries, {free_seen} free blocks exist",
                st.free.len()
            ));
        }
        if st
            .blocks
            .values()
            .any(|b| !st.segments.contains_key(&b.segment))
        {
            return Err("a block belongs to no segment".into());
        }
        if reserved != st.stats.reserved {
            return Err(format!(
                "reserved {} B, segments sum to {reserved} B",
                st.stats.reserved
            ));
        }
        if allocated != st.stats.allocated {
            return Err(format!(
                "allocated {} B, live blocks sum to {allocated} B",
                st.stats.allocated
            ));
        }
        if st.stats.allocated > st.stats.reserved {
            return Err("allocated exceeds reserved".into());
        }
        Ok(())
    }
}

impl<M, E> fmt::Debug for CachingAllocator<M, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CachingAllocator({})", self.device)
    }
}

mod fake;
pub use fake::{FakeEvent, FakeMemory};

#[cfg(test)]
mod tests {
    use super::*;

    const S0: StreamKey = StreamKey(0);
    const S1: StreamKey = StreamKey(1);

    fn alloc(
        capacity: u64,
    ) -> (
        Arc<FakeMemory>,
        CachingAllocator<Arc<FakeMemory>, FakeEvent>,
    ) {
        let mem = FakeMemory::new(capacity);
        (mem.clone(), CachingAllocator::new(mem, "fake:0"))
    }

    #[test]
    fn sizes_round_to_512_and_segments_follow_the_pools() {
        assert_eq!(round_size(0), 512);
        assert_eq!(round_size(1), 512);
        assert_eq!(round_size(512), 512);
        assert_eq!(round_size(513), 1024);
        assert_eq!(pool_of(SMALL_SIZE), Pool::Small);
        assert_eq!(pool_of(SMALL_SIZE + 512), Pool::Large);
        assert_eq!(segment_size(512), SMALL_SEGMENT);
        assert_eq!(segment_size(SMALL_SIZE + 512), LARGE_SEGMENT);
        assert_eq!(segment_size(MIN_LARGE_ALLOC), MIN_LARGE_ALLOC);
        assert_eq!(
            segment_size(MIN_LARGE_ALLOC + 1),
            MIN_LARGE_ALLOC + ROUND_LARGE
        );
    }

    #[test]
    fn small_requests_share_a_segment_and_merge_back() {
        let (mem, a) = alloc(1 << 30);
        let x = a.allocate(100, None).unwrap();
        let y = a.allocate(1000, None).unwrap();
        assert_eq!(y.ptr(), x.ptr() + 512);
        assert_eq!(y.size(), 1024);
        let s = a.stats();
        assert_eq!(
            (s.allocated, s.reserved, s.segments),
            (1100, SMALL_SEGMENT, 1)
        );
        a.free(x, vec![]);
        a.free(y, vec![]);
        a.check_invariants().unwrap();
        let snap = a.snapshot();
        assert_eq!(snap[0].blocks.len(), 1, "{snap:?}");
        assert_eq!(a.stats().allocated, 0);
        assert_eq!(a.empty_cache().unwrap(), SMALL_SEGMENT);
        assert_eq!((a.stats().reserved, mem.live_bytes()), (0, 0));
    }

    #[test]
    fn best_fit_takes_the_smallest_block_that_fits() {
        let (_mem, a) = alloc(1 << 30);
        let blocks: Vec<Block> = [4096, 512, 8192, 512, 2048, 512]
            .iter()
            .map(|&b| a.allocate(b, None).unwrap())
            .collect();
        let addrs: Vec<u64> = blocks.iter().map(Block::ptr).collect();
        let mut it = blocks.into_iter();
        let (b4096, _k1, b8192, _k2, b2048, _k3) = (
            it.next().unwrap(),
            it.next().unwrap(),
            it.next().unwrap(),
            it.next().unwrap(),
            it.next().unwrap(),
            it.next().unwrap(),
        );
        a.free(b4096, vec![]);
        a.free(b8192, vec![]);
        a.free(b2048, vec![]);
        let got = a.allocate(2000, None).unwrap();
        assert_eq!(got.ptr(), addrs[4], "the 2048 B hole is the best fit");
        let got = a.allocate(3000, None).unwrap();
        assert_eq!(got.ptr(), addrs[0], "the 4096 B hole is next");
        a.check_invariants().unwrap();
    }

    #[test]
    fn large_requests_get_their_own_pool_and_split_only_big_remainders() {
        let (_mem, a) = alloc(1 << 30);
        let x = a.allocate(3 << 20, None).unwrap();
        assert_eq!(a.stats().reserved, LARGE_SEGMENT);
        let y = a.allocate(2 << 20, None).unwrap();
        assert_eq!(
            y.ptr(),
            x.ptr() + (3 << 20),
            "carved from the same 20 MiB segment"
        );
        // A small request never comes from the large pool.
        let z = a.allocate(512, None).unwrap();
        assert_eq!(a.stats().reserved, LARGE_SEGMENT + SMALL_SEGMENT);
        a.free(z, vec![]);
        // 15 MiB are left; a 14.5 MiB request leaves 0.5 MiB, too little to split off.
        let w = a.allocate((29 << 20) / 2, None).unwrap();
        assert_eq!(w.size(), 15 << 20);
        a.check_invariants().unwrap();
        for b in [x, y, w] {
            a.free(b, vec![]);
        }
        assert_eq!(a.empty_cache().unwrap(), LARGE_SEGMENT + SMALL_SEGMENT);
    }

    #[test]
    fn a_block_freed_on_a_stream_is_reused_at_once_by_it_and_by_others_after_its_event() {
        let (_mem, a) = alloc(1 << 30);
        let x = a.allocate(4096, Some(S0)).unwrap();
        let guard = a.allocate(4096, Some(S0)).unwrap();
        let ptr = x.ptr();
        let event = FakeEvent::new();
        a.free(x, vec![(S0, event.clone())]);
        // Another stream, or any stream, must not get it yet (though it is the best fit).
        let other = a.allocate(4096, Some(S1)).unwrap();
        assert_ne!(other.ptr(), ptr);
        let any = a.allocate(4096, None).unwrap();
        assert_ne!(any.ptr(), ptr);
        // The freeing stream gets it at once.
        let same = a.allocate(4096, Some(S0)).unwrap();
        assert_eq!(same.ptr(), ptr);
        let event2 = FakeEvent::new();
        a.free(same, vec![(S0, event2.clone())]);
        event.complete();
        assert_ne!(
            a.allocate(4096, Some(S1)).unwrap().ptr(),
            ptr,
            "event2 pends"
        );
        event2.complete();
        let later = a.allocate(4096, Some(S1)).unwrap();
        assert_eq!(later.ptr(), ptr, "idle once the events completed");
        for b in [other, any, later, guard] {
            a.free(b, vec![]);
        }
        a.check_invariants().unwrap();
    }

    #[test]
    fn a_block_reused_by_its_stream_keeps_the_earlier_free_events() {
        let (_mem, a) = alloc(1 << 30);
        let x = a.allocate(4096, Some(S1)).unwrap();
        let guard = a.allocate(4096, None).unwrap();
        let ptr = x.ptr();
        let event = FakeEvent::new();
        a.free(x, vec![(S1, event.clone())]);
        // S1 takes it back at once, then frees it with no event of its own: work queued
        // on S1 before the first free may still use the bytes, so others must wait.
        let again = a.allocate(4096, Some(S1)).unwrap();
        assert_eq!(again.ptr(), ptr);
        a.free(again, vec![]);
        assert_ne!(a.allocate(4096, None).unwrap().ptr(), ptr);
        event.complete();
        assert_eq!(a.allocate(4096, None).unwrap().ptr(), ptr);
        a.free(guard, vec![]);
        a.check_invariants().unwrap();
    }

    #[test]
    fn out_of_memory_waits_releases_idle_segments_and_retries_once() {
        let (mem, a) = alloc(40 << 20);
        // Fill the fake with one idle cached large segment.
        let x = a.allocate(12 << 20, None).unwrap();
        let event = FakeEvent::new();
        a.free(x, vec![(S0, event.clone())]);
        assert_eq!(mem.live_bytes(), 12 << 20);
        // 30 MiB do not fit next to it; the allocator waits, returns the segment, retries.
        let y = a.allocate(30 << 20, None).unwrap();
        assert!(event.is_done());
        assert_eq!(mem.live_bytes(), 30 << 20);
        assert_eq!(a.stats().oom_retries, 1);
        // Beyond capacity: a typed error, and nothing changes.
        let before = a.stats();
        let err = a.allocate(64 << 20, None).unwrap_err();
        assert!(
            matches!(err, CudaError::OutOfMemory { requested, free, .. } if requested == 64 << 20 && free == 10 << 20),
            "{err}"
        );
        assert_eq!(a.stats().allocated, before.allocated);
        assert_eq!(a.stats().reserved, before.reserved);
        a.free(y, vec![]);
        a.check_invariants().unwrap();
    }

    #[test]
    fn a_failing_driver_surfaces_as_out_of_memory_after_one_retry() {
        let (mem, a) = alloc(1 << 30);
        mem.fail_next(2);
        assert!(matches!(
            a.allocate(100, None),
            Err(CudaError::OutOfMemory { .. })
        ));
        mem.fail_next(1);
        let x = a.allocate(100, None).unwrap();
        a.free(x, vec![]);
        assert_eq!(a.stats().oom_retries, 2);
    }

    #[test]
    fn empty_cache_keeps_segments_with_live_blocks_or_pending_events() {
        let (mem, a) = alloc(1 << 30);
        let live = a.allocate(100, None).unwrap();
        let pending = a.allocate(12 << 20, None).unwrap();
        let event = FakeEvent::new();
        a.free(pending, vec![(S1, event.clone())]);
        assert_eq!(a.empty_cache().unwrap(), 0);
        event.complete();
        assert_eq!(a.empty_cache().unwrap(), 12 << 20);
        a.free(live, vec![]);
        assert_eq!(a.empty_cache().unwrap(), SMALL_SEGMENT);
        assert_eq!(mem.live_bytes(), 0);
        assert_eq!(mem.bad_frees(), 0);
        let s = a.stats();
        assert_eq!(
            (s.reserved, s.peak_reserved),
            (0, SMALL_SEGMENT + (12 << 20))
        );
        a.reset_peak();
        assert_eq!(a.stats().peak_reserved, 0);
    }

    #[test]
    fn merging_unions_pending_marks() {
        let (_mem, a) = alloc(1 << 30);
        let x = a.allocate(512, None).unwrap();
        let y = a.allocate(512, None).unwrap();
        let _guard = a.allocate(512, None).unwrap();
        let (ex, ey) = (FakeEvent::new(), FakeEvent::new());
        let xp = x.ptr();
        a.free(x, vec![(S0, ex.clone())]);
        a.free(y, vec![(S1, ey.clone())]);
        let snap = a.snapshot();
        let merged = &snap[0].blocks[0];
        assert_eq!(
            (merged.ptr, merged.size, merged.allocated),
            (xp, 1024, false)
        );
        assert_eq!(merged.pending_streams, vec![S0, S1]);
        // The merged block waits for both streams: neither may take it at once.
        assert_ne!(a.allocate(1024, Some(S0)).unwrap().ptr(), xp);
        assert_ne!(a.allocate(1024, Some(S1)).unwrap().ptr(), xp);
        ey.complete();
        assert_eq!(a.allocate(1024, Some(S0)).unwrap().ptr(), xp);
        a.check_invariants().unwrap();
    }
}
