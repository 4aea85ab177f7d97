//! The host's memory and files as the operating system reports and handles them: fallible
//! allocation, regular-file opening, no-replace renames, `/proc` figures (memory available,
//! the process's resident set and read bytes), page-cache advice and the C heap's tuning.

use std::fs::File;
use std::path::Path;

use crate::error::{CoreError, Result};

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
pub(super) fn drop_file_range(file: &std::fs::File, offset: u64, len: u64) {
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
