//! Weight files that change while a run reads them (issue 35): a typed error naming the file,
//! never a crash or an image from changed weights.
//!
//! A checkpoint is read through a shared read-only mapping ([`CheckpointMap`]). Three things
//! can happen to its file during a run:
//! - **replaced** (another file renamed over the path) or **removed**: the mapping keeps
//!   the old inode and reads the same bytes, so nothing breaks, but the run no longer
//!   reads the file the path names;
//! - **rewritten or touched in place**: the bytes the run reads may change under it;
//! - **truncated**: touching a mapped page past the new end raises `SIGBUS`, which kills
//!   the process.
//!
//! [`FileIdentity`] (device, inode, size, modification time) is taken when a file is
//! mapped. [`CheckpointMap::check_unchanged`] compares it with the path now, and the
//! command checks every mapped file before it writes any output
//! ([`CoreError::CheckpointChanged`]). For truncation, [`install_truncation_handler`]
//! catches `SIGBUS`. Every file mapping is entered in a fixed table of address ranges, each
//! with its path, which the handler can read without allocating or locking. When the
//! faulting address lies in a mapped weight file, the handler writes one error line naming
//! the file to standard error and ends the process with status 1. Outputs are written only
//! after the phases (under `OUTPUT_PHASE` in `ddo-cli`), so nothing partial is left. Any
//! other `SIGBUS` gets the default action.
//!
//! [`CheckpointMap`]: crate::host_memory::CheckpointMap
//! [`CheckpointMap::check_unchanged`]: crate::host_memory::CheckpointMap::check_unchanged
//! [`CoreError::CheckpointChanged`]: crate::CoreError::CheckpointChanged

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

/// What identifies a file's contents cheaply: device, inode, size and modification time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileIdentity {
    dev: u64,
    ino: u64,
    len: u64,
    mtime_ns: i128,
}

impl FileIdentity {
    /// The identity of an open file's metadata.
    pub fn of(meta: &std::fs::Metadata) -> Self {
        Self {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.len(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
        }
    }

    /// How the file at `path` differs from this identity, in words (`None`: the same).
    pub fn change_at(&self, path: &Path) -> Option<String> {
        let meta = match std::fs::metadata(path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Some("removed".into()),
            Err(e) => return Some(format!("no longer readable ({e})")),
        };
        let now = Self::of(&meta);
        if (now.dev, now.ino) != (self.dev, self.ino) {
            Some("replaced by another file".into())
        } else if now.len < self.len {
            Some(format!("truncated from {} to {} bytes", self.len, now.len))
        } else if now.len != self.len {
            Some(format!("grown from {} to {} bytes", self.len, now.len))
        } else if now.mtime_ns != self.mtime_ns {
            Some("modified".into())
        } else {
            None
        }
    }
}

/// Mapped weight files the `SIGBUS` handler can name: a fixed table, so the handler reads it
/// without allocating or locking.
const SLOTS: usize = 1024;

struct Slot {
    start: AtomicUsize,
    len: AtomicUsize,
    path: AtomicPtr<libc::c_char>,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Slot = Slot {
    start: AtomicUsize::new(0),
    len: AtomicUsize::new(0),
    path: AtomicPtr::new(std::ptr::null_mut()),
};

static TABLE: [Slot; SLOTS] = [EMPTY; SLOTS];

/// A mapping entered in the table; leaving it (drop) empties its slot. Where the table is
/// full the mapping is simply not named (the handler then leaves `SIGBUS` to its default).
#[derive(Debug)]
pub struct MappedEntry {
    slot: Option<usize>,
}

/// Enters `len` bytes at `start` as a mapping of `path`.
pub fn enter_mapping(start: usize, len: usize, path: &Path) -> MappedEntry {
    if len == 0 {
        return MappedEntry { slot: None };
    }
    let Ok(c) = CString::new(path.as_os_str().as_bytes()) else {
        return MappedEntry { slot: None };
    };
    for (i, s) in TABLE.iter().enumerate() {
        if s.start
            .compare_exchange(0, start, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            s.path.store(c.into_raw(), Ordering::Release);
            s.len.store(len, Ordering::Release);
            return MappedEntry { slot: Some(i) };
        }
    }
    MappedEntry { slot: None }
}

impl Drop for MappedEntry {
    fn drop(&mut self) {
        let Some(i) = self.slot else {
            return;
        };
        let s = &TABLE[i];
        s.len.store(0, Ordering::Release);
        let p = s.path.swap(std::ptr::null_mut(), Ordering::AcqRel);
        s.start.store(0, Ordering::Release);
        if !p.is_null() {
            // SAFETY: `p` came from `CString::into_raw` in `enter_mapping` and was swapped
            // out of the slot, so this is its one owner. The handler reads it only for a
            // fault inside this mapping, and a mapping's entry is dropped only once nothing
            // reads the mapping (its last `Arc<CheckpointMap>` went), so no such fault can
            // run beside this drop.
            drop(unsafe { CString::from_raw(p) });
        }
    }
}

/// The path of the mapping holding `addr`, from the table (async-signal-safe: atomics only).
fn path_at(addr: usize) -> *const libc::c_char {
    for s in &TABLE {
        let start = s.start.load(Ordering::Acquire);
        let len = s.len.load(Ordering::Acquire);
        if start != 0 && addr >= start && addr < start.saturating_add(len) {
            return s.path.load(Ordering::Acquire);
        }
    }
    std::ptr::null()
}

/// Writes `bytes` to standard error (async-signal-safe).
fn write_stderr(bytes: &[u8]) {
    // SAFETY: `write(2)` on fd 2 with a valid buffer and its length; async-signal-safe.
    let _ = unsafe { libc::write(2, bytes.as_ptr().cast(), bytes.len()) };
}

extern "C" fn on_sigbus(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel hands a valid `siginfo_t` to an SA_SIGINFO handler; `si_addr` is
    // the faulting address for SIGBUS.
    let addr = unsafe { (*info).si_addr() } as usize;
    let path = path_at(addr);
    if path.is_null() {
        // Not a weight file's page: the default action, on the fault's next attempt.
        // SAFETY: resetting a signal's disposition is async-signal-safe.
        unsafe { libc::signal(libc::SIGBUS, libc::SIG_DFL) };
        return;
    }
    write_stderr(b"ddo: error: the weight file ");
    // SAFETY: `path` is a NUL-terminated string the table owns (see `MappedEntry::drop`).
    let len = unsafe { libc::strlen(path) };
    // SAFETY: `len` bytes at `path` are the string's, before its NUL.
    write_stderr(unsafe { std::slice::from_raw_parts(path.cast::<u8>(), len) });
    write_stderr(
        b" was truncated while DDO read it; nothing was written; hint: leave weight files \
          unchanged while ddo runs, restore the file and run again\n",
    );
    // SAFETY: `_exit` is async-signal-safe and ends the process at once (no unwinding,
    // no atexit handlers, no buffered output of a half-done run).
    unsafe { libc::_exit(1) };
}

/// Installs the `SIGBUS` handler that turns a fault on a truncated weight file into one
/// error line and exit status 1 (the module docs). Idempotent; an error from the system is
/// returned as text.
pub fn install_truncation_handler() -> Result<(), String> {
    // SAFETY: a zeroed `sigaction` is a valid empty one; the handler is an `extern "C"`
    // function of the SA_SIGINFO signature that only reads atomics and calls
    // async-signal-safe functions (`write`, `strlen`, `signal`, `_exit`).
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigbus as *const () as usize;
        action.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut action.sa_mask);
        if libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut()) != 0 {
            return Err(std::io::Error::last_os_error().to_string());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("w.safetensors");
        std::fs::write(&p, vec![1u8; 10_000]).unwrap();
        let id = FileIdentity::of(&std::fs::metadata(&p).unwrap());
        assert_eq!(id.change_at(&p), None);
        let f = std::fs::File::options().write(true).open(&p).unwrap();
        f.set_len(4_000).unwrap();
        assert!(
            id.change_at(&p)
                .unwrap()
                .contains("truncated from 10000 to 4000")
        );
        f.set_len(10_000).unwrap();
        f.set_modified(std::time::SystemTime::UNIX_EPOCH).unwrap();
        assert_eq!(id.change_at(&p).as_deref(), Some("modified"));
        let other = dir.path().join("other");
        std::fs::write(&other, vec![1u8; 10_000]).unwrap();
        std::fs::rename(&other, &p).unwrap();
        assert_eq!(
            id.change_at(&p).as_deref(),
            Some("replaced by another file")
        );
        std::fs::remove_file(&p).unwrap();
        assert_eq!(id.change_at(&p).as_deref(), Some("removed"));
    }

    #[test]
    fn the_table_finds_a_mapping_and_forgets_it() {
        let a = enter_mapping(0x1000_0000, 0x2000, Path::new("/weights/a.safetensors"));
        let b = enter_mapping(0x2000_0000, 0x1000, Path::new("/weights/b.safetensors"));
        let name = |addr: usize| {
            let p = path_at(addr);
            // SAFETY: a non-null result is a NUL-terminated string the table owns.
            (!p.is_null()).then(|| unsafe { std::ffi::CStr::from_ptr(p) }.to_owned())
        };
        assert_eq!(
            name(0x1000_1fff).unwrap().to_str().unwrap(),
            "/weights/a.safetensors"
        );
        assert_eq!(
            name(0x2000_0000).unwrap().to_str().unwrap(),
            "/weights/b.safetensors"
        );
        assert!(name(0x1000_2000).is_none());
        drop(a);
        assert!(name(0x1000_0000).is_none());
        drop(b);
        assert!(name(0x2000_0000).is_none());
    }
}
