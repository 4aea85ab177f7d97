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

use std::any::Any;
use std::fmt;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytemuck::{Pod, Zeroable};
use parking_lot::{Mutex, RwLock};

use crate::error::{CoreError, Result};

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

/// `len` copies of `value` in a new `Vec`, or [`CoreError::HostOutOfMemory`] (naming
/// `what`) where the allocator refuses, instead of aborting the process: the host backend's
/// large temporaries (decoded inputs, op outputs) are allocated through it.
pub fn try_vec<T: Clone>(len: usize, value: T, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| CoreError::HostOutOfMemory {
            requested: (len as u64).saturating_mul(std::mem::size_of::<T>() as u64),
            what: what.to_string(),
        })?;
    v.resize(len, value);
    Ok(v)
}

/// An empty `Vec` with room for `len` values, or [`CoreError::HostOutOfMemory`] (see
/// [`try_vec`]).
pub fn try_with_capacity<T>(len: usize, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| CoreError::HostOutOfMemory {
            requested: (len as u64).saturating_mul(std::mem::size_of::<T>() as u64),
            what: what.to_string(),
        })?;
    Ok(v)
}

/// Why [`open_regular`] did not open a file.
#[derive(Debug)]
pub enum NotRegular {
    /// The file system refused (missing, no permission, ...).
    Io(std::io::Error),
    /// Something that is not a regular file is there: what it is, in words (`a directory`,
    /// `a FIFO`, `a device`, `a symbolic link to nothing`, ...).
    Is(String),
}

/// Opens `path` for reading only when it is a regular file (through links), never blocking
/// on a FIFO and checked as opened (`ddo_codec::files::open_at`): every file DDO reads as
/// data goes through it — checkpoints, configs, the command's inputs.
pub fn open_regular(path: &Path) -> std::result::Result<File, NotRegular> {
    match ddo_codec::files::open_at(path) {
        Ok(ddo_codec::files::AtPath::File { file, .. }) => Ok(file),
        Ok(ddo_codec::files::AtPath::Other(what)) => Err(NotRegular::Is(what)),
        Ok(ddo_codec::files::AtPath::Absent) => Err(NotRegular::Io(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "no such file",
        ))),
        Err(e) => Err(NotRegular::Io(e)),
    }
}

/// Renames `from` to `to` only where nothing is at `to` (Linux `renameat2` with
/// `RENAME_NOREPLACE`: atomic, so a file or folder that appears at `to` meanwhile is never
/// replaced); elsewhere, or on a file system without it, a check then a rename.
pub fn rename_noreplace(from: &Path, to: &Path) -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::ffi::OsStrExt;
        let c = |p: &Path| {
            std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(|_| {
                std::io::Error::new(std::io::ErrorKind::InvalidInput, "a NUL in the path")
            })
        };
        let (a, b) = (c(from)?, c(to)?);
        // SAFETY: both are valid NUL-terminated paths that live across the call; the call
        // reads them and touches no memory of ours.
        let r = unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                a.as_ptr(),
                libc::AT_FDCWD,
                b.as_ptr(),
                libc::RENAME_NOREPLACE,
            )
        };
        if r == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if !matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS)) {
            return Err(e);
        }
    }
    if std::fs::symlink_metadata(to).is_ok() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            "something is there already",
        ));
    }
    std::fs::rename(from, to)
}

/// The process's address-space limit in bytes (`ulimit -v`, `RLIMIT_AS`, from
/// `/proc/self/limits`), or `None` where it is unlimited or cannot be read.
pub fn address_space_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = text.lines().find(|l| l.starts_with("Max address space"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// A field of the host's `/proc/meminfo` in bytes (`"MemTotal"`, `"MemAvailable"`), or
/// `None` where the file or the field cannot be read (not Linux, a sandbox).
pub fn meminfo_bytes(field: &str) -> Option<u64> {
    kib_field("/proc/meminfo", field)
}

/// A field of this process's `/proc/self/status` in bytes (`"VmRSS"`, `"VmHWM"`,
/// `"RssAnon"`, `"RssFile"`, `"RssShmem"`), or `None` where it cannot be read (not Linux).
pub fn process_status_bytes(field: &str) -> Option<u64> {
    kib_field("/proc/self/status", field)
}

/// Bytes this process has caused to be read from storage so far (`read_bytes` of
/// `/proc/self/io`: reads served by the page cache do not count), or `None` where it cannot
/// be read (not Linux, no task accounting). `ddo run` reports it, so a cold run shows what
/// it read from the disk (a coded-cache hit reads no raw checkpoint byte).
pub fn process_read_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/io").ok()?;
    let line = text.lines().find(|l| l.starts_with("read_bytes:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Several fields of this process's `/proc/self/status` in bytes, from one read of it, so
/// that figures which add up (`RssAnon + RssFile + RssShmem = VmRSS`) are of one instant
/// (`None` for a field it lacks; all `None` where it cannot be read).
pub fn process_status_snapshot<const N: usize>(fields: [&str; N]) -> [Option<u64>; N] {
    let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    fields.map(|f| kib_in(&text, f))
}

/// The `field: N kB` line of a `/proc` file, in bytes.
fn kib_field(path: &str, field: &str) -> Option<u64> {
    kib_in(&std::fs::read_to_string(path).ok()?, field)
}

/// The `field: N kB` line of `text`, in bytes.
fn kib_in(text: &str, field: &str) -> Option<u64> {
    let line = text.lines().find(|l| {
        l.strip_prefix(field)
            .is_some_and(|rest| rest.starts_with(':'))
    })?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Asks the kernel to drop `file`'s clean pages from the page cache
/// (`POSIX_FADV_DONTNEED`), so the next read of them comes from the disk (the disk probe,
/// [`crate::disk`]). Advice: a failure changes nothing, and pages another process holds
/// mapped stay cached.
pub fn drop_file_cache(file: &std::fs::File) {
    drop_file_range(file, 0, 0);
}

/// Drops the page cache's clean pages of `len` bytes of `file` from `offset` (`len` 0: to
/// the end), as [`drop_file_cache`] does for the whole file.
/// The largest `pread` [`CheckpointMap::read_into_cache`] makes: 8 MiB, the scratch it
/// reads through.
pub const READ_THROUGH_PIECE: usize = 8 << 20;

fn drop_file_range(file: &std::fs::File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    let (Ok(offset), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
        return;
    };
    let (fd, advice) = (file.as_raw_fd(), libc::POSIX_FADV_DONTNEED);
    // SAFETY: `posix_fadvise` reads no memory of ours; the descriptor is open for the
    // call's duration (borrowed from `file`), and the advice only affects the page cache.
    let _ = unsafe { libc::posix_fadvise(fd, offset, len, advice) };
}

/// Returns the heap's free memory to the kernel where the C library can (glibc's
/// `malloc_trim`): a long-lived process (`ddo serve`) calls it between requests, so memory
/// a request freed stops counting in its resident set. Advice: it changes no allocation.
pub fn return_free_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `malloc_trim` only releases free pages of the allocator's own heap; it
        // reads and writes no memory of ours and is safe to call from any thread.
        let _ = unsafe { libc::malloc_trim(0) };
    }
}

/// Makes every thread allocate from one heap arena (glibc's `M_ARENA_MAX` = 1; nothing
/// elsewhere). Called first by a long-lived process. glibc gives threads their own arenas,
/// up to eight per core, and a freed block stays in the arena of the thread that allocated
/// it; with many short-lived threads (the host ops', the readers', the server's) the
/// process's resident heap then drifts from one request to the next. Measured on
/// `ddo serve --config tiny`-sized pipelines: 10-12 MB resident anonymous memory that
/// moved by 20% over 1,000 requests, against 3.4 MB that held within 1% with one arena,
/// at the same speed.
pub fn one_heap_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `mallopt` sets one of the allocator's parameters under its own lock; it
        // touches no memory of ours. Arenas made before keep serving their threads.
        let _ = unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) };
    }
}

/// Bytes the allocator has handed out and not had back: glibc's `mallinfo2`, the in-use
/// bytes of every arena plus its directly mapped chunks (`None` off glibc). Unlike the
/// resident set, it does not move with how the allocator's free pages happen to lie, so a
/// leak shows in it and fragmentation does not.
pub fn heap_in_use() -> Option<u64> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `mallinfo2` takes each arena's lock, reads its counters and returns them
        // by value; it touches no memory of ours.
        let info = unsafe { libc::mallinfo2() };
        Some((info.uordblks as u64).saturating_add(info.hblkhd as u64))
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        None
    }
}

/// The host's physical memory (`MemTotal`), where it can be read.
pub fn mem_total() -> Option<u64> {
    meminfo_bytes("MemTotal")
}

/// What the host can give without swapping (`MemAvailable`: free memory plus reclaimable
/// page cache), where it can be read.
pub fn mem_available() -> Option<u64> {
    meminfo_bytes("MemAvailable")
}

/// Granularity of host registrations, in bytes from the start of a checkpoint mapping:
/// 64 KiB. A registration page-locks whole pages, and two registrations must not share a
/// page (CUDA refuses the second with `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`), so
/// ranges are rounded out to blocks of this size, which is a multiple of every host page
/// size Linux uses (4, 16 and 64 KiB). A mapping starts on a page boundary, so a block
/// boundary counted from its start is a page boundary too.
pub const REGISTER_ALIGN: usize = 64 << 10;

/// The range of a mapping of `map_len` bytes that registering `offset..offset + len` of it
/// page-locks (and counts against the pinned limit): rounded out to [`REGISTER_ALIGN`]
/// blocks from the mapping's start, the end clamped to the mapping's end (the last page of
/// the file is then locked whole by the backend; the bytes past the end of the file are
/// not counted). An empty range stays empty.
pub fn register_span(map_len: usize, offset: usize, len: usize) -> std::ops::Range<usize> {
    let end = offset.saturating_add(len).min(map_len);
    let offset = offset.min(end);
    if offset == end {
        return offset..offset;
    }
    let start = offset / REGISTER_ALIGN * REGISTER_ALIGN;
    let end = end
        .div_ceil(REGISTER_ALIGN)
        .saturating_mul(REGISTER_ALIGN)
        .min(map_len);
    start..end
}

/// `ranges` sorted, with overlapping or touching ones merged and empty ones dropped: the
/// registrations a set of [`register_span`]s of one mapping needs (no two share a block).
pub fn merge_spans(mut ranges: Vec<std::ops::Range<usize>>) -> Vec<std::ops::Range<usize>> {
    ranges.sort_unstable_by_key(|r| r.start);
    let mut merged: Vec<std::ops::Range<usize>> = Vec::new();
    for r in ranges.into_iter().filter(|r| !r.is_empty()) {
        match merged.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => merged.push(r),
        }
    }
    merged
}

/// What registering `buffer` on `device` page-locks: its mapping and the range of it
/// ([`register_span`]). A buffer that is not checkpoint-mapped (owned memory, pinned or
/// not, or a registered view) is [`CoreError::HostRegisterUnsupported`]: owned memory is
/// pinned by allocating it pinned. Backends call this first in
/// [`Device::register_host`](crate::Device::register_host).
pub fn register_target(
    device: &str,
    buffer: &HostBuffer,
) -> Result<(Arc<CheckpointMap>, std::ops::Range<usize>)> {
    match buffer.mapping() {
        Some((map, offset, len)) => Ok((Arc::clone(map), register_span(map.len(), offset, len))),
        None => Err(CoreError::HostRegisterUnsupported {
            device: device.to_string(),
            reason: format!(
                "only checkpoint mappings are registered in place, not {:?} memory (owned memory is \
                 pinned by allocating it pinned)",
                buffer.kind()
            ),
        }),
    }
}

/// A read-only memory map of a checkpoint file, shared by every tensor that points into it.
pub struct CheckpointMap {
    path: PathBuf,
    /// The file's identity when mapped (`None`: bytes made in memory).
    identity: Option<crate::file_guard::FileIdentity>,
    /// The mapping's entry in the `SIGBUS` handler's table; declared before `mmap`, so it
    /// leaves the table before the range is unmapped.
    _entry: Option<crate::file_guard::MappedEntry>,
    /// The mapped file, kept open to advise the page cache about ranges of it
    /// ([`CheckpointMap::evict`]); `None` for bytes made in memory.
    file: Option<std::fs::File>,
    mmap: MapBytes,
    /// The end of the furthest range [`CheckpointMap::read_ahead`] has queued.
    read_ahead_end: std::sync::atomic::AtomicUsize,
}

/// The bytes of a [`CheckpointMap`].
enum MapBytes {
    /// A file, mapped read-only.
    File(memmap2::Mmap),
    /// Bytes made in memory ([`CheckpointMap::in_memory`]): writable as far as the system
    /// goes, never written through DDO (a mapped buffer hands out no mutable access).
    Memory(memmap2::MmapMut),
}

impl CheckpointMap {
    /// Weights made in memory (random weights, weights converted to another dtype), frozen
    /// read-only and from then on treated as a checkpoint mapping named `label` (which
    /// names no file): their params are read in place, page-locked in place for copies,
    /// and never written, exactly as a checkpoint file's.
    pub fn in_memory(label: impl Into<PathBuf>, bytes: memmap2::MmapMut) -> Arc<Self> {
        Arc::new(Self {
            path: label.into(),
            identity: None,
            _entry: None,
            file: None,
            mmap: MapBytes::Memory(bytes),
            read_ahead_end: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    /// Maps `path` read-only.
    pub fn open(path: &Path) -> Result<Arc<Self>> {
        let io = |source| CoreError::Io {
            path: path.to_path_buf(),
            source,
        };
        // Only regular files: opening a FIFO would wait for a writer, a device would map
        // without end. Looked at and opened without blocking, checked as opened.
        let file = open_regular(path).map_err(|e| match e {
            NotRegular::Io(source) => io(source),
            NotRegular::Is(what) => CoreError::Checkpoint {
                path: path.to_path_buf(),
                message: format!("is {what}, not a regular file; give a .safetensors file"),
            },
        })?;
        // SAFETY: the map is read-only and DDO never hands out mutable access. Another
        // process truncating or rewriting the file while it is mapped is outside what DDO
        // can guard against (SECURITY.md: checkpoint files are read, not trusted to stay
        // put); memmap2 documents the same caveat.
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        let identity = file
            .metadata()
            .map(|m| crate::file_guard::FileIdentity::of(&m))
            .map_err(io)?;
        let entry = crate::file_guard::enter_mapping(mmap.as_ptr() as usize, mmap.len(), path);
        Ok(Arc::new(Self {
            path: path.to_path_buf(),
            identity: Some(identity),
            _entry: Some(entry),
            file: Some(file),
            mmap: MapBytes::File(mmap),
            read_ahead_end: std::sync::atomic::AtomicUsize::new(0),
        }))
    }

    /// Whether the file at this map's path is still the one mapped, unchanged (device,
    /// inode, size, modification time): [`CoreError::CheckpointChanged`] naming the file
    /// and the change otherwise. Bytes made in memory never change.
    pub fn check_unchanged(&self) -> Result<()> {
        match self.identity.and_then(|id| id.change_at(&self.path)) {
            None => Ok(()),
            Some(change) => Err(CoreError::CheckpointChanged {
                path: self.path.clone(),
                change,
            }),
        }
    }

    /// The mapped file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether this maps a file ([`CheckpointMap::open`]), not bytes made in memory
    /// ([`CheckpointMap::in_memory`], whose path is only a label).
    pub fn is_file(&self) -> bool {
        matches!(self.mmap, MapBytes::File(_))
    }

    /// Size of the mapping in bytes.
    pub fn len(&self) -> usize {
        self.bytes().len()
    }

    /// Whether the mapping is empty.
    pub fn is_empty(&self) -> bool {
        self.bytes().is_empty()
    }

    /// The mapped bytes.
    pub fn bytes(&self) -> &[u8] {
        match &self.mmap {
            MapBytes::File(m) => m,
            MapBytes::Memory(m) => m,
        }
    }

    /// Whether the bytes were made in memory ([`CheckpointMap::in_memory`]), not mapped from
    /// a file.
    pub fn is_in_memory(&self) -> bool {
        matches!(self.mmap, MapBytes::Memory(_))
    }

    /// Drops this process's resident pages of `range` of a file mapping (the whole pages
    /// inside it), so they stop counting in its RSS: the bytes stay readable and read the
    /// same, faulted back in from the page cache or the file when touched. The streaming
    /// engine calls it for params whose one host copy is elsewhere (lossless-coded units).
    /// Returns the bytes released: 0 for bytes made in memory (releasing their pages would
    /// lose them), for a range holding no whole page, and where the system refuses (pages
    /// page-locked by a registration, say: the advice is then simply not taken).
    pub fn release_pages(&self, range: std::ops::Range<usize>) -> u64 {
        let MapBytes::File(map) = &self.mmap else {
            return 0;
        };
        // Linux's base page on the machines DDO runs on; on a system with larger pages an
        // unaligned range is refused (EINVAL) and nothing is released.
        let page = 4096;
        let start = range.start.div_ceil(page) * page;
        let end = (range.end.min(map.len()) / page) * page;
        if start >= end {
            return 0;
        }
        // SAFETY: `map` is a read-only shared mapping of a regular file that DDO never
        // writes through, so it holds no private (copy-on-write) pages: MADV_DONTNEED only
        // unmaps clean pages of the page cache from this process, and the next access to
        // them reads the same bytes back from the page cache or the file. No reference to
        // the bytes is invalidated (the mapping stays), which is what makes the advice
        // unchecked in memmap2.
        let advised = unsafe {
            map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
        };
        if advised.is_ok() {
            (end - start) as u64
        } else {
            0
        }
    }
}

impl CheckpointMap {
    /// Asks the kernel to start reading `range` of a file mapping into the page cache
    /// (`MADV_WILLNEED`: read-ahead queued, not waited for), so that a copy from it soon
    /// after finds the pages there. Nothing for bytes made in memory or an empty or
    /// out-of-bounds range; advice the system refuses is simply not taken.
    pub fn prefetch(&self, range: std::ops::Range<usize>) {
        let MapBytes::File(map) = &self.mmap else {
            return;
        };
        let end = range.end.min(map.len());
        if range.start >= end {
            return;
        }
        let _ = map.advise_range(memmap2::Advice::WillNeed, range.start, end - range.start);
    }

    /// Reads `range` of a mapped file into the page cache by `pread` through `scratch`
    /// (grown to at most [`READ_THROUGH_PIECE`] bytes, reused), so that a `pread` soon after
    /// finds the pages cached: sequential reads the kernel's own read-ahead serves at the
    /// disk's rate, where `MADV_WILLNEED` over the same range read the GPU machine's disk at
    /// a third of it (`tools/disk_read_methods.py`). `keep_going` is asked before each
    /// piece; `false` stops the read (what the range was read for has been read already).
    /// Advice only: nothing for bytes made in memory, and a read that fails stops quietly
    /// (the `pread` that needs the bytes reports it).
    pub fn read_into_cache(
        &self,
        range: std::ops::Range<usize>,
        scratch: &mut Vec<u8>,
        mut keep_going: impl FnMut() -> bool,
    ) {
        let (MapBytes::File(map), Some(file)) = (&self.mmap, &self.file) else {
            return;
        };
        use std::os::unix::fs::FileExt;
        let end = range.end.min(map.len());
        let mut at = range.start;
        while at < end && keep_going() {
            let n = (end - at).min(READ_THROUGH_PIECE);
            if scratch.len() < n {
                scratch.resize(n, 0);
            }
            match file.read_at(&mut scratch[..n], at as u64) {
                Ok(0) | Err(_) => return,
                Ok(read) => at += read,
            }
        }
    }

    /// Queues read-ahead of `len` bytes from `from` ([`CheckpointMap::prefetch`]) on the
    /// process's one read-ahead thread and returns at once: the advice blocks while the
    /// kernel queues a large range's reads, so a reader that asks for the file ahead of
    /// itself (a loader decoding coded tensors in file order) never waits on it. The part an
    /// earlier call asked for already is skipped. Advice only: nothing when the thread
    /// cannot be had.
    pub fn read_ahead(self: &Arc<Self>, from: usize, len: usize) {
        let end = from.saturating_add(len).min(self.len());
        let before = self.read_ahead_end.fetch_max(end, Ordering::Relaxed);
        if end <= before {
            return;
        }
        let start = before.max(from);
        if let Some(tx) = read_ahead_thread() {
            let _ = tx.send((Arc::clone(self), start..end));
        }
    }

    /// Reads `dst.len()` bytes at `offset` of the mapped bytes into `dst`: for a file with
    /// `pread` on the file as mapped (no page of the mapping is touched, so none is mapped
    /// into the process), for bytes made in memory by a copy. A read the file cannot give
    /// (it was truncated or replaced meanwhile) is [`CoreError::CheckpointChanged`] naming
    /// it, else [`CoreError::Io`].
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let end = offset.checked_add(dst.len()).filter(|&e| e <= self.len());
        let Some(end) = end else {
            return Err(CoreError::Checkpoint {
                path: self.path.clone(),
                message: format!(
                    "a read of {} B at {offset} passes the end of the {} B mapping",
                    dst.len(),
                    self.len()
                ),
            });
        };
        match (&self.mmap, &self.file) {
            (MapBytes::File(_), Some(file)) => {
                use std::os::unix::fs::FileExt;
                file.read_exact_at(dst, offset as u64).map_err(|source| {
                    match self.check_unchanged() {
                        Err(changed) => changed,
                        Ok(()) => CoreError::Io {
                            path: self.path.clone(),
                            source,
                        },
                    }
                })
            }
            _ => {
                dst.copy_from_slice(&self.bytes()[offset..end]);
                Ok(())
            }
        }
    }

    /// Gives back the memory `range` of a file mapping holds: this process's pages of it
    /// ([`CheckpointMap::release_pages`]) and then the page cache's
    /// (`POSIX_FADV_DONTNEED`, which leaves pages that someone still maps or has
    /// page-locked). The bytes stay readable: the next access reads them from the file.
    /// Returns the bytes whose pages this process released (0 for bytes made in memory).
    pub fn evict(&self, range: std::ops::Range<usize>) -> u64 {
        let released = self.release_pages(range.clone());
        if let Some(file) = &self.file {
            let end = range.end.min(self.len());
            if range.start < end {
                drop_file_range(file, range.start as u64, (end - range.start) as u64);
            }
        }
        released
    }
}

impl fmt::Debug for CheckpointMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CheckpointMap({}, {} B)",
            self.path.display(),
            self.len()
        )
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

/// A coded tensor's unit in a checkpoint mapping (a `ddo convert --compress lossless`
/// file): what a [`HostBuffer::coded`] decodes where it is read, and what coded streaming
/// copies as it is.
#[derive(Debug, Clone)]
pub struct CodedSource {
    /// The file's mapping.
    pub map: Arc<CheckpointMap>,
    /// The tensor's name, for errors.
    pub name: String,
    /// Where the unit starts in the mapping.
    pub offset: usize,
    /// The unit's (coded) length.
    pub len: usize,
    /// Its validated header.
    pub header: Arc<ddo_codec::UnitHeader>,
}

impl CodedSource {
    /// The unit's coded bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.map.bytes()[self.offset..self.offset + self.len]
    }

    /// Decodes the unit on up to [`CODED_DECODE_THREADS`] threads, its checksum verified.
    /// Errors: no memory for the decoded bytes, or a unit that does not decode (the file
    /// changed or is corrupt), naming the file and the tensor.
    pub fn decode(&self) -> Result<AlignedBytes> {
        let mut out = AlignedBytes::try_zeroed(self.header.decoded_len() as usize)?;
        self.decode_into(out.as_mut_slice())?;
        Ok(out)
    }

    /// [`CodedSource::decode`] into `out` (exactly the decoded length: a backend's pinned
    /// upload buffer, say). After an error `out` holds garbage.
    pub fn decode_into(&self, out: &mut [u8]) -> Result<()> {
        // The unit and the file's next CODED_READ_AHEAD bytes behind it (the tensors a
        // loader reads next, in file order) are read ahead on the read-ahead thread: the
        // decoding threads fault in pages on their way, and the disk keeps reading while
        // this tensor decodes and copies.
        self.map
            .read_ahead(self.offset, self.len.saturating_add(CODED_READ_AHEAD));
        self.decode_in_place(out)
    }

    /// [`CodedSource::decode_into`] without the file-order read-ahead: for a reader that
    /// reads ahead in an order of its own (the staged units of a forward, in schedule
    /// order), where the next tensors in the file may be ones a later forward needs, or
    /// ones whose pages it has just given back.
    pub fn decode_in_place(&self, out: &mut [u8]) -> Result<()> {
        self.decode_from(self.bytes(), out)
    }

    /// [`CodedSource::decode_in_place`] of the unit read with `pread` into `scratch` on up
    /// to `readers` threads (its pages never mapped into the process): the disk tier, where
    /// page faults on the mapping would read the file a few pages a request. `scratch` grows
    /// to the unit's length and is kept for the next unit.
    pub fn read_decode_into(
        &self,
        scratch: &mut Vec<u8>,
        readers: usize,
        out: &mut [u8],
    ) -> Result<()> {
        if !self.map.is_file() {
            return self.decode_in_place(out);
        }
        scratch.resize(self.len, 0);
        let per = self.len.div_ceil(readers.max(1)).max(1 << 20);
        std::thread::scope(|s| {
            let parts: Vec<_> = scratch
                .chunks_mut(per)
                .enumerate()
                .map(|(i, part)| {
                    let at = self.offset + i * per;
                    s.spawn(move || self.map.read_at(at, part))
                })
                .collect();
            parts.into_iter().try_for_each(|p| {
                p.join().unwrap_or_else(|_| {
                    Err(CoreError::Checkpoint {
                        path: self.map.path().to_path_buf(),
                        message: "a read thread panicked".into(),
                    })
                })
            })
        })?;
        self.decode_from(scratch, out)
    }

    /// Decodes `encoded` (this unit's bytes, wherever they were read) into `out`.
    fn decode_from(&self, encoded: &[u8], out: &mut [u8]) -> Result<()> {
        let len = out.len();
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(CODED_DECODE_THREADS)
            .min(len.div_ceil(1 << 20).max(1));
        ddo_codec::decode_unit_parallel(encoded, out, threads).map_err(|e| CoreError::Checkpoint {
            path: self.map.path().to_path_buf(),
            message: format!(
                "coded tensor `{}` does not decode ({e}): the file changed or is corrupt; \
                     convert the folder again with ddo convert --compress lossless",
                self.name
            ),
        })
    }
}

/// A read-ahead request: a mapping and the range to advise.
type ReadAhead = (Arc<CheckpointMap>, std::ops::Range<usize>);

/// The process's read-ahead thread ([`CheckpointMap::read_ahead`]), started on first use;
/// `None` where it could not be started. It advises 64 MiB at a time, so a long request
/// does not hold the ones behind it for long.
fn read_ahead_thread() -> Option<std::sync::mpsc::Sender<ReadAhead>> {
    static THREAD: std::sync::OnceLock<Option<Mutex<std::sync::mpsc::Sender<ReadAhead>>>> =
        std::sync::OnceLock::new();
    THREAD
        .get_or_init(|| {
            let (tx, rx) = std::sync::mpsc::channel::<ReadAhead>();
            std::thread::Builder::new()
                .name("ddo-read-ahead".into())
                .spawn(move || {
                    while let Ok((map, range)) = rx.recv() {
                        let mut at = range.start;
                        while at < range.end {
                            let next = (at + (64 << 20)).min(range.end);
                            map.prefetch(at..next);
                            at = next;
                        }
                    }
                })
                .ok()
                .map(|_| Mutex::new(tx))
        })
        .as_ref()
        .map(|tx| tx.lock().clone())
}

/// Bytes of a coded file read ahead past a tensor decoded on the host
/// ([`CodedSource::decode`]).
pub const CODED_READ_AHEAD: usize = 512 << 20;

/// Most threads one coded tensor is decoded on where it is read on the host.
pub const CODED_DECODE_THREADS: usize = 16;

/// The 16-bit word a coded tensor that fails to decode reads as through the infallible
/// [`HostBuffer::with_bytes`]: NaN in bf16 and f16 alike, so the model's non-finite checks
/// stop the run rather than an image of wrong weights (the copies go through
/// [`HostBuffer::try_with_bytes`] and get the typed error).
pub const CODED_FAILURE_WORD: u16 = 0xffff;

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
