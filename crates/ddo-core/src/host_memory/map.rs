//! Checkpoint mappings ([`CheckpointMap`]): a read-only memory map of a weights file shared
//! by every tensor in it, its page-cache advice and reads, and the registration spans that
//! page-lock ranges of it in place.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use parking_lot::Mutex;

use super::{HostBuffer, NotRegular, drop_file_range, open_regular};
use crate::error::{CoreError, Result};

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

/// The largest `pread` [`CheckpointMap::read_into_cache`] makes: 8 MiB, the scratch it
/// reads through.
pub const READ_THROUGH_PIECE: usize = 8 << 20;

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
