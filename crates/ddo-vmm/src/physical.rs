//! The [`PhysicalMemory`] trait: the handful of virtual-memory operations the pool is built
//! on, and the plain values they pass ([`VaRange`], [`ChunkHandle`]).
//!
//! Implementations validate nothing (as wgpu-hal under wgpu-core): the CUDA one just calls
//! the driver, the fake records what happened and rejects what the driver would reject or
//! what would be a bookkeeping bug. Every rule — which range is mapped, which chunk holds a
//! live byte, when a chunk may go — lives in [`VmmPool`](crate::VmmPool) above.

use std::sync::Arc;

use crate::error::Result;

/// A reserved virtual address range: `base..base + len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct VaRange {
    /// First address.
    pub base: u64,
    /// Length in bytes (a multiple of the granularity).
    pub len: u64,
}

impl VaRange {
    /// One past the last address.
    pub fn end(&self) -> u64 {
        self.base + self.len
    }

    /// Whether `va..va + len` lies inside this range.
    pub fn contains(&self, va: u64, len: u64) -> bool {
        va >= self.base && va.checked_add(len).is_some_and(|e| e <= self.end())
    }
}

/// A physical memory chunk (`CUmemGenericAllocationHandle`) and its size. Not `Clone`: a
/// handle is released once, by value.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct ChunkHandle {
    raw: u64,
    bytes: u64,
}

impl ChunkHandle {
    /// Wraps a raw handle of `bytes` (for [`PhysicalMemory`] implementations).
    pub fn from_raw(raw: u64, bytes: u64) -> Self {
        Self { raw, bytes }
    }

    /// The raw handle.
    pub fn raw(&self) -> u64 {
        self.raw
    }

    /// Size in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// The virtual-memory operations of one device, one call each.
///
/// Contract for callers (the pool keeps it; implementations may rely on it and need not
/// check it): sizes and addresses are multiples of [`granularity`](Self::granularity);
/// `map` targets an unmapped part of a range from `reserve`; `set_access` and `unmap` cover
/// whole mappings made by `map`; a chunk is released only when unmapped; a range is freed
/// only when nothing in it is mapped; and nothing is unmapped while queued device work may
/// still touch it.
pub trait PhysicalMemory: Send + Sync {
    /// The allocation granularity (2 MiB on an H200): chunk sizes, mapping offsets and
    /// lengths are multiples of it.
    fn granularity(&self) -> u64;

    /// Reserves `bytes` of virtual address space (no memory behind it).
    fn reserve(&self, bytes: u64) -> Result<VaRange>;

    /// Returns a reserved range to the address space.
    fn free_range(&self, range: VaRange) -> Result<()>;

    /// Creates a physical chunk of `bytes` on the device.
    fn create(&self, bytes: u64) -> Result<ChunkHandle>;

    /// Releases a chunk (its memory goes back to the driver once it is also unmapped).
    fn release(&self, chunk: ChunkHandle) -> Result<()>;

    /// Maps all of `chunk` at `va`.
    fn map(&self, va: u64, chunk: &ChunkHandle) -> Result<()>;

    /// Unmaps `va..va + bytes`.
    fn unmap(&self, va: u64, bytes: u64) -> Result<()>;

    /// Gives the device read-write access to the mapped range `va..va + bytes`.
    fn set_access(&self, va: u64, bytes: u64) -> Result<()>;

    /// `(free, total)` bytes of the device according to the driver, where available
    /// (a sampled figure: `None` when it cannot be read).
    fn mem_info(&self) -> Option<(u64, u64)> {
        None
    }
}

impl<T: PhysicalMemory + ?Sized> PhysicalMemory for Arc<T> {
    fn granularity(&self) -> u64 {
        (**self).granularity()
    }
    fn reserve(&self, bytes: u64) -> Result<VaRange> {
        (**self).reserve(bytes)
    }
    fn free_range(&self, range: VaRange) -> Result<()> {
        (**self).free_range(range)
    }
    fn create(&self, bytes: u64) -> Result<ChunkHandle> {
        (**self).create(bytes)
    }
    fn release(&self, chunk: ChunkHandle) -> Result<()> {
        (**self).release(chunk)
    }
    fn map(&self, va: u64, chunk: &ChunkHandle) -> Result<()> {
        (**self).map(va, chunk)
    }
    fn unmap(&self, va: u64, bytes: u64) -> Result<()> {
        (**self).unmap(va, bytes)
    }
    fn set_access(&self, va: u64, bytes: u64) -> Result<()> {
        (**self).set_access(va, bytes)
    }
    fn mem_info(&self) -> Option<(u64, u64)> {
        (**self).mem_info()
    }
}
