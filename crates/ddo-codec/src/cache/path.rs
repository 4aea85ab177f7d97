//! What is at a cache's path, looked at without ever blocking ([`open_at`]), and whether
//! [`write_cache`](super::write_cache) may replace it ([`replaceable`]): only nothing, or
//! a regular, writable file with the cache's magic. The rules are in the
//! [module docs](super).

use std::path::Path;

use super::{MAGIC, io_err, read_up_to};
use crate::error::{CodecError, Result};

/// What [`write_cache`] may put its file in place of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Dest {
    /// Nothing is at the path.
    Absent,
    /// A DDO cache: a regular, writable file with the magic (valid, stale or corrupt).
    Cache,
}

/// What is at `path`, when [`write_cache`] may replace it; otherwise
/// [`CodecError::CacheRefused`] saying what it is (never blocks: [`open_at`]).
pub(super) fn replaceable(path: &Path) -> Result<Dest> {
    let refused = |reason: String| CodecError::CacheRefused {
        path: path.to_path_buf(),
        reason,
    };
    match open_at(path).map_err(|e| io_err(path, "open", &e))? {
        AtPath::Absent => Ok(Dest::Absent),
        AtPath::Other(what) => Err(refused(what)),
        AtPath::File { link: true, .. } => Err(refused(
            "a symbolic link (DDO neither writes through a link nor replaces one)".into(),
        )),
        AtPath::File { file, meta, .. } => {
            if meta.permissions().readonly() {
                return Err(refused(
                    "a read-only file (DDO replaces only a writable cache)".into(),
                ));
            }
            let mut magic = [0u8; 8];
            let got = read_up_to(&file, 0, &mut magic).map_err(|e| io_err(path, "read", &e))?;
            if got < magic.len() || &magic != MAGIC {
                return Err(refused(format!("{NO_MAGIC} (not a file DDO wrote)")));
            }
            Ok(Dest::Cache)
        }
    }
}

/// Why a file without the magic is not a cache.
pub(super) const NO_MAGIC: &str = "a file that does not start with the `DDOCACHE` magic";

/// What is at a path ([`open_at`]).
#[derive(Debug)]
pub(super) enum AtPath {
    /// Nothing.
    Absent,
    /// A regular file, opened read-only (`link`: through a symbolic link), and its
    /// metadata as opened.
    File {
        file: std::fs::File,
        meta: std::fs::Metadata,
        link: bool,
    },
    /// Something that is not a regular file (or stopped being one while it was opened):
    /// what it is.
    Other(String),
}

/// Looks at `path` and opens it only when it is a regular file (through a symbolic link to
/// one), without ever blocking: `lstat` (and `stat` through a link) first, then `open` with
/// `O_NONBLOCK` (a FIFO put there meanwhile opens at once instead of waiting for a writer)
/// and `O_NOFOLLOW` unless the name was a link, then `fstat` of what was opened, which must
/// be the regular file looked at (same device and inode).
pub(super) fn open_at(path: &Path) -> std::io::Result<AtPath> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let not_found = |e: &std::io::Error| e.kind() == std::io::ErrorKind::NotFound;
    let lmeta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if not_found(&e) => return Ok(AtPath::Absent),
        Err(e) => return Err(e),
    };
    let link = lmeta.file_type().is_symlink();
    let meta = if link {
        match std::fs::metadata(path) {
            Ok(m) => m,
            Err(e) if not_found(&e) => {
                return Ok(AtPath::Other("a symbolic link to nothing".into()));
            }
            Err(e) => return Err(e),
        }
    } else {
        lmeta
    };
    if !meta.is_file() {
        return Ok(AtPath::Other(describe(&meta, link)));
    }
    let flags = libc::O_NONBLOCK | if link { 0 } else { libc::O_NOFOLLOW };
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(flags)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if not_found(&e) => return Ok(AtPath::Absent),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Ok(AtPath::Other(
                "a symbolic link (put there while it was opened)".into(),
            ));
        }
        Err(e) => return Err(e),
    };
    let opened = file.metadata()?;
    if !opened.is_file() || (opened.dev(), opened.ino()) != (meta.dev(), meta.ino()) {
        return Ok(AtPath::Other(format!(
            "{}, put there while it was opened",
            describe(&opened, false)
        )));
    }
    Ok(AtPath::File {
        file,
        meta: opened,
        link,
    })
}

/// What kind of file `meta` describes, in words (`link`: reached through a symbolic link).
fn describe(meta: &std::fs::Metadata, link: bool) -> String {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    let what = if t.is_file() {
        "a regular file"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() || t.is_block_device() {
        "a device"
    } else {
        "not a regular file"
    };
    if link {
        format!("a symbolic link to {what}")
    } else {
        what.into()
    }
}
