//! Files DDO reads that must be regular files, opened without ever blocking: [`open_at`]
//! looks first (`lstat`, `stat` through a link), opens with `O_NONBLOCK` (a FIFO put there
//! meanwhile opens at once instead of waiting for a writer, so nothing hangs) and
//! `O_NOFOLLOW` unless the name was a link, then checks with `fstat` that what was opened
//! is the regular file looked at. [`describe`] says in words what something else is (a
//! directory, a FIFO, a device, ...). The caches here use it, and ddo-core's checkpoint
//! mapping, ddo-nn's config reader and the `ddo` command's inputs (through
//! `ddo_core::host_memory`).

use std::path::Path;

/// What is at a path ([`open_at`]).
#[derive(Debug)]
pub enum AtPath {
    /// Nothing.
    Absent,
    /// A regular file, opened read-only (`link`: through a symbolic link), and its
    /// metadata as opened.
    File {
        /// The open file.
        file: std::fs::File,
        /// Its metadata, as opened.
        meta: std::fs::Metadata,
        /// Whether the name was a symbolic link.
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
pub fn open_at(path: &Path) -> std::io::Result<AtPath> {
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
pub fn describe(meta: &std::fs::Metadata, link: bool) -> String {
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
