//! Host memory of three kinds: pageable (owned, aligned bytes), pinned (owned bytes
//! registered with a device and counted against its pinned limit), and checkpoint-mapped
//! (a byte range of an `Arc`'d memory map of a safetensors file).
//!
//! All host bytes DDO owns are 64-byte aligned, so any element type can be viewed in place,
//! and live behind a lock so asynchronous copy engines and compute can share them without
//! `unsafe`. A mapped range is read-only.
//!
//! A checkpoint mapping can also be page-locked where it is ([`Device::register_host`]):
//! the backend hands back a *registered view* ([`HostBuffer::registered`]) of the same
//! bytes, of kind [`HostMemoryKind::Pinned`], that unregisters when its last handle goes.
//! Registrations cover whole [`REGISTER_ALIGN`] blocks of the mapping ([`register_span`]).
//!
//! The safetensors reader that opens a checkpoint file over a [`CheckpointMap`] and hands
//! its tensors out as mapped buffers is [`crate::checkpoint`].
//!
//! [`Device::register_host`]: crate::Device::register_host
//!
//! The operating system's side (fallible allocation, `/proc` figures, page-cache advice,
//! file opening and renames) is in `os`, the mappings in `map`, coded units in `coded`;
//! this module re-exports them.

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytemuck::{Pod, Zeroable};
use parking_lot::{Mutex, RwLock};

use crate::error::{CoreError, Result};

mod coded;
mod map;
mod os;

pub use coded::{CODED_DECODE_THREADS, CODED_FAILURE_WORD, CODED_READ_AHEAD, CodedSource};
pub use map::{
    CheckpointMap, READ_THROUGH_PIECE, REGISTER_ALIGN, merge_spans, register_span, register_target,
};
use os::drop_file_range;
pub use os::{
    NotRegular, address_space_limit, drop_file_cache, heap_in_use, mem_available, mem_total,
    meminfo_bytes, one_heap_arena, open_regular, process_read_bytes, process_status_bytes,
    process_status_snapshot, rename_noreplace, return_free_heap, try_vec, try_with_capacity,
};

#[repr(C, align(64))]
#[derive(Clone, Copy, Pod, Zeroable)]
struct CacheLine([u8; 64]);

/// Owned, zero-initialised, 64-byte aligned bytes.
///
/// Buffers of [`HUGE_PAGE`] bytes or more get an anonymous memory mapping of their own,
/// advised for transparent huge pages: they start on a page boundary (so a device can
/// page-lock one in place without touching a neighbour), and on a machine with THP each
/// first touch commits 2 MiB, not 4 KiB (measured on an H200 host VM: faulting in 5.3 GiB/s
/// on one thread against 1.3, and page-locking 40 GiB/s against 20).
pub struct AlignedBytes {
    storage: Storage,
    len: usize,
}

/// Fills the disjoint windows `parts` (each an item, its byte offset in `out` and its
/// length, in offset order) of `out` with `fill`, on up to 8 threads, and returns the first
/// error. A panic in `fill` is resumed on the calling thread. For one host buffer made of
/// many pieces encoded or decoded independently (LoRA factors, a GGUF file dequantized).
pub fn fill_in_parallel<T: Sync, E: Send>(
    out: &mut [u8],
    parts: &[(T, usize, usize)],
    fill: impl Fn(&T, &mut [u8]) -> std::result::Result<(), E> + Sync,
) -> std::result::Result<(), E> {
    let mut windows: Vec<(&T, &mut [u8])> = Vec::with_capacity(parts.len());
    let mut rest = out;
    let mut at = 0;
    for (item, offset, len) in parts {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(offset - at);
        let (window, tail) = tail.split_at_mut(*len);
        windows.push((item, window));
        rest = tail;
        at = offset + len;
    }
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 8)
        .min(windows.len().max(1));
    let per = windows.len().div_ceil(threads).max(1);
    let fill = &fill;
    std::thread::scope(|scope| {
        let handles: Vec<_> = windows
            .chunks_mut(per)
            .map(|chunk| scope.spawn(move || chunk.iter_mut().try_for_each(|(t, w)| fill(t, w))))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect::<std::result::Result<Vec<()>, E>>()
    })?;
    Ok(())
}

/// Where [`AlignedBytes`] keep their bytes.
enum Storage {
    /// Small buffers: the global allocator's zeroed cache lines.
    Lines(Box<[CacheLine]>),
    /// Large buffers: a private anonymous mapping (zero pages until touched).
    Mapped(memmap2::MmapMut),
}

/// The size from which [`AlignedBytes`] get a mapping of their own (2 MiB, one x86-64
/// huge page).
pub const HUGE_PAGE: usize = 2 << 20;

impl AlignedBytes {
    /// `len` zero bytes. No byte is written here: the pages are committed only when first
    /// touched (by whoever fills them, on as many threads as they like). Large buffers
    /// ([`HUGE_PAGE`] or more) are mapped on their own and advised for huge pages; where the
    /// system refuses a mapping they fall back to the allocator.
    pub fn zeroed(len: usize) -> Self {
        match Self::try_zeroed(len) {
            Ok(bytes) => bytes,
            Err(_) => std::alloc::handle_alloc_error(
                std::alloc::Layout::from_size_align(len.max(1), 64)
                    .unwrap_or(std::alloc::Layout::new::<CacheLine>()),
            ),
        }
    }

    /// [`AlignedBytes::zeroed`], or [`CoreError::HostOutOfMemory`] where the system has no
    /// memory for them (an address-space limit, an exhausted heap) instead of aborting.
    pub fn try_zeroed(len: usize) -> Result<Self> {
        if len >= HUGE_PAGE
            && let Ok(map) = memmap2::MmapMut::map_anon(len.next_multiple_of(HUGE_PAGE))
        {
            // Advice only: a kernel without THP (or with it off) keeps 4 KiB pages.
            #[cfg(target_os = "linux")]
            let _ = map.advise(memmap2::Advice::HugePage);
            return Ok(Self {
                storage: Storage::Mapped(map),
                len,
            });
        }
        let lines = bytemuck::allocation::try_zeroed_slice_box::<CacheLine>(len.div_ceil(64))
            .map_err(|()| CoreError::HostOutOfMemory {
                requested: len as u64,
                what: "a host buffer".into(),
            })?;
        Ok(Self {
            storage: Storage::Lines(lines),
            len,
        })
    }

    /// Whether the bytes live in a mapping of their own (page-aligned, see
    /// [`AlignedBytes::zeroed`]).
    pub fn is_mapped(&self) -> bool {
        matches!(self.storage, Storage::Mapped(_))
    }

    /// The mapping of bytes that live in one of their own ([`AlignedBytes::is_mapped`]), no
    /// copy (it may be longer than [`AlignedBytes::len`]: a whole number of huge pages); the
    /// bytes back when they live in the allocator.
    pub fn into_mapping(self) -> std::result::Result<memmap2::MmapMut, Self> {
        match self.storage {
            Storage::Mapped(map) => Ok(map),
            storage => Err(Self {
                storage,
                len: self.len,
            }),
        }
    }

    /// [`AlignedBytes::zeroed`] with every page already committed, the pages touched on up
    /// to 8 threads: for memory about to be page-locked, whose registration would otherwise
    /// fault every page in (and zero it) on one thread.
    pub fn zeroed_committed(len: usize) -> Self {
        const PAGE: usize = 4096;
        let mut out = Self::zeroed(len);
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .clamp(1, 8);
        let bytes = out.as_mut_slice();
        if threads == 1 || bytes.len() < (64 << 20) {
            bytes.iter_mut().step_by(PAGE).for_each(|b| *b = 0);
            return out;
        }
        let part = bytes.len().div_ceil(threads).next_multiple_of(PAGE);
        std::thread::scope(|scope| {
            for chunk in bytes.chunks_mut(part) {
                scope.spawn(move || chunk.iter_mut().step_by(PAGE).for_each(|b| *b = 0));
            }
        });
        out
    }

    /// A copy of `bytes`.
    pub fn copy_from(bytes: &[u8]) -> Self {
        let mut out = Self::zeroed(bytes.len());
        out.as_mut_slice().copy_from_slice(bytes);
        out
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        match &self.storage {
            Storage::Lines(lines) => &bytemuck::cast_slice::<CacheLine, u8>(lines)[..self.len],
            Storage::Mapped(map) => &map[..self.len],
        }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match &mut self.storage {
            Storage::Lines(lines) => {
                &mut bytemuck::cast_slice_mut::<CacheLine, u8>(lines)[..self.len]
            }
            Storage::Mapped(map) => &mut map[..self.len],
        }
    }

    /// Number of bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl fmt::Debug for AlignedBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AlignedBytes({} B)", self.len)
    }
}

/// Which kind of host memory a buffer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HostMemoryKind {
    /// Ordinary heap memory: copies from it are synchronous and slow on a GPU.
    Pageable,
    /// Page-locked (pinned) memory registered with a device.
    Pinned,
    /// A read-only range of a checkpoint file's memory map.
    CheckpointMapped,
}

/// Accounting of pinned host memory against a limit, shared by a device and every
/// registration it hands out.
#[derive(Debug)]
pub struct PinnedLedger {
    limit: u64,
    pinned: AtomicU64,
    peak: AtomicU64,
}

impl PinnedLedger {
    /// A ledger with the given limit in bytes.
    pub fn new(limit: u64) -> Arc<Self> {
        Arc::new(Self {
            limit,
            pinned: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        })
    }

    /// Bytes pinned now.
    pub fn pinned(&self) -> u64 {
        self.pinned.load(Ordering::Acquire)
    }

    /// Most bytes pinned at once.
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Acquire)
    }

    /// Starts the peak again from what is pinned now.
    pub fn reset_peak(&self) {
        self.peak.store(self.pinned(), Ordering::Release);
    }

    /// The limit.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Reserves `bytes` against the limit; the registration gives them back on drop.
    /// `backend` is the backend's own registration token (dropped first, e.g. to
    /// unregister page-locked memory).
    pub fn reserve(
        self: &Arc<Self>,
        bytes: u64,
        backend: Option<Box<dyn Any + Send + Sync>>,
    ) -> Result<PinnedRegistration> {
        let mut current = self.pinned.load(Ordering::Acquire);
        loop {
            let next = current.saturating_add(bytes);
            if next > self.limit {
                return Err(CoreError::PinnedLimit {
                    requested: bytes,
                    pinned: current,
                    limit: self.limit,
                });
            }
            match self.pinned.compare_exchange_weak(
                current,
                next,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    self.peak.fetch_max(next, Ordering::AcqRel);
                    return Ok(PinnedRegistration {
                        backend,
                        bytes,
                        ledger: Arc::clone(self),
                    });
                }
                Err(actual) => current = actual,
            }
        }
    }
}

/// Proof that some host bytes are pinned; unpins (and gives the bytes back to the ledger)
/// on drop.
pub struct PinnedRegistration {
    // Dropped first: the backend unregisters before the ledger forgets the bytes.
    backend: Option<Box<dyn Any + Send + Sync>>,
    bytes: u64,
    ledger: Arc<PinnedLedger>,
}

impl PinnedRegistration {
    /// Bytes this registration pins.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The backend's token, for the backend that made it.
    pub fn backend_token(&self) -> Option<&(dyn Any + Send + Sync)> {
        self.backend.as_deref()
    }
}

impl Drop for PinnedRegistration {
    fn drop(&mut self) {
        drop(self.backend.take());
        self.ledger.pinned.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

impl fmt::Debug for PinnedRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PinnedRegistration({} B)", self.bytes)
    }
}

enum HostStorage {
    Owned {
        // Dropped before `bytes`: unpin before the memory goes away. Taken out by
        // [`HostBuffer::unpin`], which leaves the same bytes pageable.
        pin: Mutex<Option<PinnedRegistration>>,
        // Address of the first byte; the bytes never move while `bytes` lives.
        addr: usize,
        bytes: RwLock<AlignedBytes>,
    },
    Mapped {
        map: Arc<CheckpointMap>,
        offset: usize,
        len: usize,
    },
    Registered {
        // Dropped before `base`: unregister before the mapping can go.
        pin: PinnedRegistration,
        // A mapped buffer; the registered view reads its bytes in place.
        base: HostBuffer,
    },
    Coded(CodedSource),
}

/// A shared host buffer: pageable, pinned or checkpoint-mapped. Cloning shares it.
#[derive(Clone)]
pub struct HostBuffer {
    inner: Arc<HostStorage>,
}

impl HostBuffer {
    /// Pageable, zeroed bytes.
    pub fn pageable_zeroed(len: usize) -> Self {
        Self::owned(AlignedBytes::zeroed(len), None)
    }

    /// Pageable copy of `bytes`.
    pub fn pageable_from(bytes: &[u8]) -> Self {
        Self::owned(AlignedBytes::copy_from(bytes), None)
    }

    /// Owned bytes, pinned when a registration is given. Backends use this to build pinned
    /// buffers; the registration must cover exactly these bytes.
    pub fn owned(bytes: AlignedBytes, pin: Option<PinnedRegistration>) -> Self {
        let addr = bytes.as_slice().as_ptr() as usize;
        Self {
            inner: Arc::new(HostStorage::Owned {
                pin: Mutex::new(pin),
                addr,
                bytes: RwLock::new(bytes),
            }),
        }
    }

    /// `bytes` as a param's host copy, frozen: bytes in a mapping of their own
    /// ([`AlignedBytes::is_mapped`]) become a read-only [`CheckpointMap::in_memory`] named
    /// `label` and a mapped buffer over it (no copy), so they register in place like a
    /// checkpoint's; smaller ones stay owned and pageable.
    pub fn frozen(bytes: AlignedBytes, label: &str) -> Self {
        let len = bytes.len();
        match bytes.into_mapping() {
            // `AlignedBytes::zeroed` maps `len` rounded up to whole huge pages.
            Ok(map) => Self {
                inner: Arc::new(HostStorage::Mapped {
                    map: CheckpointMap::in_memory(label, map),
                    offset: 0,
                    len,
                }),
            },
            Err(bytes) => Self::owned(bytes, None),
        }
    }

    /// A read-only range of a checkpoint mapping.
    pub fn mapped(map: Arc<CheckpointMap>, offset: usize, len: usize) -> Result<Self> {
        if offset.checked_add(len).is_none_or(|end| end > map.len()) {
            return Err(CoreError::OutOfRange {
                what: "checkpoint range",
                offset,
                len,
                buffer_len: map.len(),
            });
        }
        Ok(Self {
            inner: Arc::new(HostStorage::Mapped { map, offset, len }),
        })
    }

    /// A coded tensor's unit (`len` bytes at `offset` of `map`, parsed as `header`) as a
    /// read-only buffer of the bytes it decodes to: [`HostMemoryKind::CheckpointMapped`],
    /// [`HostBuffer::len`] the decoded length, decoded on every read (no decoded copy is
    /// kept: the process holds only the coded pages it reads). Coded streaming takes the
    /// unit as it is ([`HostBuffer::coded_source`]).
    pub fn coded(
        map: Arc<CheckpointMap>,
        name: &str,
        offset: usize,
        len: usize,
        header: Arc<ddo_codec::UnitHeader>,
    ) -> Result<Self> {
        if offset.checked_add(len).is_none_or(|end| end > map.len()) {
            return Err(CoreError::OutOfRange {
                what: "coded checkpoint range",
                offset,
                len,
                buffer_len: map.len(),
            });
        }
        Ok(Self {
            inner: Arc::new(HostStorage::Coded(CodedSource {
                map,
                name: name.to_string(),
                offset,
                len,
                header,
            })),
        })
    }

    /// The coded unit a [`HostBuffer::coded`] buffer reads, `None` for any other buffer.
    pub fn coded_source(&self) -> Option<&CodedSource> {
        match &*self.inner {
            HostStorage::Coded(c) => Some(c),
            _ => None,
        }
    }

    /// Runs `f` over the bytes, as [`HostBuffer::with_bytes`]; a coded buffer that does not
    /// decode is the typed error (no call of `f`).
    pub fn try_with_bytes<R>(&self, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        match &*self.inner {
            HostStorage::Coded(c) => Ok(f(c.decode()?.as_slice())),
            HostStorage::Registered { base, .. } => base.try_with_bytes(f),
            _ => Ok(self.with_bytes(f)),
        }
    }

    /// A registered view of `base` (a checkpoint-mapped buffer page-locked in place by a
    /// backend's [`Device::register_host`](crate::Device::register_host)): the same bytes,
    /// read in place, of kind [`HostMemoryKind::Pinned`] so copies from it run
    /// asynchronously at pinned speed. `pin` must cover `base`'s bytes; it is dropped
    /// (unregistered) when the view's last handle goes, before `base`. Views of owned
    /// memory are refused: owned memory is pinned by allocating it pinned.
    pub fn registered(base: HostBuffer, pin: PinnedRegistration) -> Result<Self> {
        if base.mapping().is_none() {
            return Err(CoreError::Backend {
                device: "host".into(),
                message: format!(
                    "a registered view needs a checkpoint-mapped buffer, got {base:?}"
                ),
            });
        }
        Ok(Self {
            inner: Arc::new(HostStorage::Registered { pin, base }),
        })
    }

    /// Which kind of memory this is (a registered view of a mapping is pinned).
    pub fn kind(&self) -> HostMemoryKind {
        match &*self.inner {
            HostStorage::Owned { pin, .. } if pin.lock().is_some() => HostMemoryKind::Pinned,
            HostStorage::Registered { .. } => HostMemoryKind::Pinned,
            HostStorage::Owned { .. } => HostMemoryKind::Pageable,
            HostStorage::Mapped { .. } | HostStorage::Coded(_) => HostMemoryKind::CheckpointMapped,
        }
    }

    /// Whether copies from this buffer can run asynchronously at full link speed.
    pub fn is_pinned(&self) -> bool {
        self.kind() == HostMemoryKind::Pinned
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match &*self.inner {
            HostStorage::Owned { bytes, .. } => bytes.read().len(),
            HostStorage::Mapped { len, .. } => *len,
            HostStorage::Registered { base, .. } => base.len(),
            HostStorage::Coded(c) => c.header.decoded_len() as usize,
        }
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether this handle is the buffer's only one: no clone and no slice of it (such as
    /// one a queued copy holds until it completes) is alive, so its bytes can be rewritten.
    pub fn is_exclusive(&mut self) -> bool {
        Arc::get_mut(&mut self.inner).is_some()
    }

    /// Runs `f` over the bytes (a shared lock for owned memory; a coded buffer decoded for
    /// the call, and read as [`CODED_FAILURE_WORD`]s where it does not decode: use
    /// [`HostBuffer::try_with_bytes`] where the error can be returned).
    pub fn with_bytes<R>(&self, f: impl FnOnce(&[u8]) -> R) -> R {
        match &*self.inner {
            HostStorage::Owned { bytes, .. } => f(bytes.read().as_slice()),
            HostStorage::Mapped { map, offset, len } => f(&map.bytes()[*offset..*offset + *len]),
            HostStorage::Registered { base, .. } => base.with_bytes(f),
            HostStorage::Coded(c) => match c.decode() {
                Ok(bytes) => f(bytes.as_slice()),
                Err(_) => {
                    let words = c.header.decoded_len() as usize / 2;
                    let failed: Vec<u8> =
                        std::iter::repeat_n(CODED_FAILURE_WORD.to_le_bytes(), words)
                            .flatten()
                            .collect();
                    f(&failed)
                }
            },
        }
    }

    /// Runs `f` over the bytes mutably (an exclusive lock). Mapped memory (registered or
    /// not) is read-only.
    pub fn with_bytes_mut<R>(&self, f: impl FnOnce(&mut [u8]) -> R) -> Result<R> {
        match &*self.inner {
            HostStorage::Owned { bytes, .. } => Ok(f(bytes.write().as_mut_slice())),
            HostStorage::Registered { base, .. } => base.with_bytes_mut(f),
            HostStorage::Mapped { map, .. } | HostStorage::Coded(CodedSource { map, .. }) => {
                Err(CoreError::Backend {
                    device: "host".into(),
                    message: format!(
                        "attempt to write into the read-only checkpoint mapping of {}",
                        map.path().display()
                    ),
                })
            }
        }
    }

    /// Address of the first byte, for backends that hand it to a copy engine. Stable for
    /// the buffer's lifetime. A coded buffer's is its coded unit's first byte (its decoded
    /// bytes exist only during a read).
    pub fn as_ptr(&self) -> *const u8 {
        match &*self.inner {
            HostStorage::Owned { addr, .. } => *addr as *const u8,
            HostStorage::Mapped { map, offset, .. }
            | HostStorage::Coded(CodedSource { map, offset, .. }) => {
                map.bytes()[*offset..].as_ptr()
            }
            HostStorage::Registered { base, .. } => base.as_ptr(),
        }
    }

    /// The checkpoint mapping and range, for a mapped buffer (not for a registered view of
    /// one: see [`HostBuffer::registered_base`]).
    pub fn mapping(&self) -> Option<(&Arc<CheckpointMap>, usize, usize)> {
        match &*self.inner {
            HostStorage::Mapped { map, offset, len } => Some((map, *offset, *len)),
            HostStorage::Owned { .. } | HostStorage::Registered { .. } | HostStorage::Coded(_) => {
                None
            }
        }
    }

    /// The mapped buffer a registered view reads in place.
    pub fn registered_base(&self) -> Option<&HostBuffer> {
        match &*self.inner {
            HostStorage::Registered { base, .. } => Some(base),
            HostStorage::Owned { .. } | HostStorage::Mapped { .. } | HostStorage::Coded(_) => None,
        }
    }

    /// Bytes the pinned registration counts, for a pinned buffer or a registered view.
    pub fn pinned_bytes(&self) -> Option<u64> {
        match &*self.inner {
            HostStorage::Owned { pin, .. } => pin.lock().as_ref().map(PinnedRegistration::bytes),
            HostStorage::Registered { pin, .. } => Some(pin.bytes()),
            HostStorage::Mapped { .. } | HostStorage::Coded(_) => None,
        }
    }

    /// Unpins an owned pinned buffer in place: its registration goes (`cuMemHostUnregister`
    /// on CUDA, and the pinned ledger gets the bytes back) and every handle to it now reads
    /// the same bytes as pageable memory, with no copy. The caller makes sure no queued
    /// copy still reads it. Returns whether it was pinned (registered views of mappings and
    /// pageable buffers are left as they are).
    pub fn unpin(&self) -> bool {
        match &*self.inner {
            HostStorage::Owned { pin, .. } => pin.lock().take().is_some(),
            HostStorage::Registered { .. } | HostStorage::Mapped { .. } | HostStorage::Coded(_) => {
                false
            }
        }
    }

    /// Whether two handles share one buffer.
    pub fn same_buffer(&self, other: &HostBuffer) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// How many handles share this buffer (the buffer's own reference count).
    pub fn handle_count(&self) -> usize {
        Arc::strong_count(&self.inner)
    }

    /// A view of the whole buffer.
    pub fn slice_all(&self) -> HostSlice {
        HostSlice {
            len: self.len(),
            buffer: self.clone(),
            offset: 0,
        }
    }

    /// A view of `offset..offset + len`.
    pub fn slice(&self, offset: usize, len: usize) -> Result<HostSlice> {
        let buffer_len = self.len();
        if offset.checked_add(len).is_none_or(|end| end > buffer_len) {
            return Err(CoreError::OutOfRange {
                what: "host slice",
                offset,
                len,
                buffer_len,
            });
        }
        Ok(HostSlice {
            buffer: self.clone(),
            offset,
            len,
        })
    }
}

impl fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostBuffer({:?}, {} B)", self.kind(), self.len())
    }
}

/// A byte range of a [`HostBuffer`].
#[derive(Clone, Debug)]
pub struct HostSlice {
    buffer: HostBuffer,
    offset: usize,
    len: usize,
}

impl HostSlice {
    /// The buffer.
    pub fn buffer(&self) -> &HostBuffer {
        &self.buffer
    }

    /// Offset into the buffer.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the slice is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Kind of the underlying memory.
    pub fn kind(&self) -> HostMemoryKind {
        self.buffer.kind()
    }

    /// Runs `f` over the slice's bytes.
    pub fn with_bytes<R>(&self, f: impl FnOnce(&[u8]) -> R) -> R {
        self.buffer
            .with_bytes(|b| f(&b[self.offset..self.offset + self.len]))
    }

    /// Runs `f` over the slice's bytes, or the typed error of a coded buffer that does not
    /// decode ([`HostBuffer::try_with_bytes`]).
    pub fn try_with_bytes<R>(&self, f: impl FnOnce(&[u8]) -> R) -> Result<R> {
        self.buffer
            .try_with_bytes(|b| f(&b[self.offset..self.offset + self.len]))
    }

    /// The coded unit this slice reads, where it is the whole of a coded buffer (coded
    /// streaming copies the unit as it is).
    pub fn coded_source(&self) -> Option<&CodedSource> {
        self.buffer
            .coded_source()
            .filter(|c| self.offset == 0 && self.len as u64 == c.header.decoded_len())
    }

    /// Runs `f` over the slice's bytes mutably (owned memory only).
    pub fn with_bytes_mut<R>(&self, f: impl FnOnce(&mut [u8]) -> R) -> Result<R> {
        let (offset, len) = (self.offset, self.len);
        self.buffer
            .with_bytes_mut(|b| f(&mut b[offset..offset + len]))
    }

    /// A copy of the bytes.
    pub fn to_vec(&self) -> Vec<u8> {
        self.with_bytes(<[u8]>::to_vec)
    }

    /// The absolute byte range in the checkpoint file, for a mapped slice.
    pub fn mapped_range(&self) -> Option<(&Arc<CheckpointMap>, std::ops::Range<usize>)> {
        self.buffer.mapping().map(|(map, offset, _)| {
            let start = offset + self.offset;
            (map, start..start + self.len)
        })
    }

    /// Drops the process's pages of this slice's [`HostSlice::file_range`]
    /// ([`CheckpointMap::release_pages`]: the bytes stay readable); returns the bytes released
    /// (0 for memory that is not a file mapping).
    pub fn release_pages(&self) -> u64 {
        self.file_range()
            .map_or(0, |(map, range)| map.release_pages(range))
    }

    /// The file range a read of this slice touches: its mapped range, or for a coded buffer
    /// its whole unit (what a read of any part decodes). `None` for memory that is not a
    /// file mapping.
    pub fn file_range(&self) -> Option<(&Arc<CheckpointMap>, std::ops::Range<usize>)> {
        match self.buffer.coded_source() {
            Some(c) => Some((&c.map, c.offset..c.offset + c.len)),
            None => self.mapped_range(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `read_into_cache` reads a file's range by `pread` in pieces of at most
    /// [`READ_THROUGH_PIECE`] through the scratch, asks before each piece and stops when
    /// told; a range past the end is clipped.
    #[test]
    fn read_into_cache_reads_in_pieces_and_stops_when_told() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.bin");
        let n = 2 * READ_THROUGH_PIECE + 4096 + 100;
        let bytes: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        let map = CheckpointMap::open(&path).unwrap();
        let mut scratch = Vec::new();
        let mut asked = 0;
        map.read_into_cache(100..n + 999, &mut scratch, || {
            asked += 1;
            true
        });
        assert_eq!(asked, 3);
        assert_eq!(scratch.len(), READ_THROUGH_PIECE);
        // The last piece is the range's tail, clipped at the file's end.
        let tail = n - 100 - 2 * READ_THROUGH_PIECE;
        assert_eq!(&scratch[..tail], &bytes[n - tail..]);
        let mut scratch = Vec::new();
        let mut asked = 0;
        map.read_into_cache(0..n, &mut scratch, || {
            asked += 1;
            asked == 1
        });
        assert_eq!(asked, 2);
        assert_eq!(&scratch[..], &bytes[..READ_THROUGH_PIECE]);
        // Told to stop at once: nothing read.
        let mut scratch = Vec::new();
        map.read_into_cache(0..n, &mut scratch, || false);
        assert!(scratch.is_empty());
    }

    /// `rename_noreplace` never replaces what is at the target: not a file, not an empty
    /// folder (which a plain `rename` of a folder would replace), not a symbolic link; with
    /// nothing there it renames.
    #[test]
    fn rename_noreplace_never_replaces_anything() {
        let dir = tempfile::tempdir().unwrap();
        let from = dir.path().join("new");
        std::fs::create_dir(&from).unwrap();
        std::fs::write(from.join("w.safetensors"), b"weights").unwrap();
        let file = dir.path().join("file");
        std::fs::write(&file, b"mine").unwrap();
        let empty = dir.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(dir.path().join("nowhere"), &link).unwrap();
        for taken in [&file, &empty, &link] {
            assert!(
                rename_noreplace(&from, taken).is_err(),
                "{}",
                taken.display()
            );
            assert!(from.join("w.safetensors").is_file());
        }
        assert_eq!(std::fs::read(&file).unwrap(), b"mine");
        assert!(std::fs::read_dir(&empty).unwrap().next().is_none());
        assert!(
            std::fs::symlink_metadata(&link)
                .unwrap()
                .file_type()
                .is_symlink()
        );
        let to = dir.path().join("out");
        rename_noreplace(&from, &to).unwrap();
        assert_eq!(std::fs::read(to.join("w.safetensors")).unwrap(), b"weights");
        assert!(!from.exists());
    }

    /// One read of `/proc/self/status`: the parts of `VmRSS` add up to it exactly, while
    /// other threads touch pages (read field by field they did not, now and then).
    #[test]
    fn a_status_snapshot_is_of_one_instant() {
        if !cfg!(target_os = "linux") {
            return;
        }
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let toucher = {
            let stop = std::sync::Arc::clone(&stop);
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let v = vec![1u8; 1 << 20];
                    std::hint::black_box(&v);
                }
            })
        };
        for _ in 0..200 {
            let [rss, anon, file, shmem, missing] =
                process_status_snapshot(["VmRSS", "RssAnon", "RssFile", "RssShmem", "NoSuchField"]);
            let (rss, anon, file, shmem) =
                (rss.unwrap(), anon.unwrap(), file.unwrap(), shmem.unwrap());
            assert_eq!(anon + file + shmem, rss);
            assert_eq!(missing, None);
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        toucher.join().unwrap();
    }

    #[test]
    fn large_aligned_bytes_get_a_page_aligned_mapping_of_their_own() {
        let small = AlignedBytes::zeroed(HUGE_PAGE - 1);
        assert!(!small.is_mapped());
        assert_eq!(small.as_slice().as_ptr() as usize % 64, 0);
        for len in [HUGE_PAGE, HUGE_PAGE + 4097, 3 * HUGE_PAGE] {
            let mut big = AlignedBytes::zeroed(len);
            assert!(big.is_mapped(), "{len}");
            assert_eq!(big.len(), len);
            assert_eq!(big.as_slice().as_ptr() as usize % 4096, 0, "page-aligned");
            assert!(big.as_slice().iter().all(|b| *b == 0), "zero until written");
            big.as_mut_slice()[len - 1] = 7;
            let copy = AlignedBytes::copy_from(big.as_slice());
            assert_eq!(copy.as_slice()[len - 1], 7);
            assert_eq!(
                copy.len(),
                len,
                "the mapping's rounding is not part of the bytes"
            );
        }
        let committed = AlignedBytes::zeroed_committed(HUGE_PAGE * 40);
        assert!(committed.as_slice().iter().step_by(4096).all(|b| *b == 0));
    }

    #[test]
    fn meminfo_fields_are_read_by_exact_name() {
        // Linux CI has /proc/meminfo; elsewhere every field is None.
        if let Some(total) = mem_total() {
            let available = mem_available().expect("MemAvailable beside MemTotal");
            assert!(available <= total && total > 0);
        }
        assert_eq!(meminfo_bytes("Mem"), None, "a prefix is not a field");
    }

    #[test]
    fn aligned_bytes_are_aligned_and_sized() {
        let b = AlignedBytes::copy_from(&[1, 2, 3, 4, 5]);
        assert_eq!(b.as_slice(), &[1, 2, 3, 4, 5]);
        assert_eq!(b.as_slice().as_ptr() as usize % 64, 0);
        assert!(AlignedBytes::zeroed(0).is_empty());
    }

    #[test]
    fn a_host_buffer_is_exclusive_only_while_no_clone_or_slice_lives() {
        let mut b = HostBuffer::pageable_zeroed(16);
        assert!(b.is_exclusive());
        let view = b.slice(4, 8).unwrap();
        assert!(!b.is_exclusive());
        drop(view);
        let other = b.clone();
        assert!(!b.is_exclusive());
        drop(other);
        assert!(b.is_exclusive());
    }

    #[test]
    fn pinned_ledger_refuses_past_its_limit_and_returns_bytes_on_drop() {
        let ledger = PinnedLedger::new(100);
        let a = ledger.reserve(60, None).unwrap();
        assert!(matches!(
            ledger.reserve(50, None),
            Err(CoreError::PinnedLimit { pinned: 60, .. })
        ));
        drop(a);
        assert_eq!(ledger.pinned(), 0);
        assert_eq!(ledger.peak(), 60);
        let b = ledger.reserve(100, None).unwrap();
        assert_eq!(b.bytes(), 100);
    }

    #[test]
    fn register_spans_round_out_to_blocks_inside_the_mapping() {
        const A: usize = REGISTER_ALIGN;
        assert_eq!(register_span(10 * A, 5, 10), 0..A);
        assert_eq!(register_span(10 * A, A - 1, 2), 0..2 * A);
        assert_eq!(register_span(10 * A, 3 * A, A), 3 * A..4 * A);
        // The end is clamped to the mapping.
        assert_eq!(register_span(3 * A + 7, 2 * A + 1, A + 6), 2 * A..3 * A + 7);
        assert_eq!(register_span(100, 0, 100), 0..100);
        // Empty and out-of-range requests lock nothing.
        assert!(register_span(100, 40, 0).is_empty());
        assert!(register_span(100, 200, 10).is_empty());
    }

    #[test]
    fn slices_check_their_range() {
        let b = HostBuffer::pageable_from(&[0, 1, 2, 3]);
        assert_eq!(b.slice(1, 2).unwrap().to_vec(), vec![1, 2]);
        assert!(b.slice(3, 2).is_err());
        assert!(b.slice(usize::MAX, 2).is_err());
        assert_eq!(b.kind(), HostMemoryKind::Pageable);
    }
}
