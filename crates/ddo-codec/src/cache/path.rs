//! What is at a cache's path, looked at without ever blocking ([`open_at`](crate::files::open_at)), and whether
//! [`write_cache`](super::write_cache) may replace it ([`replaceable`]): only nothing, or
//! a regular, writable file with the cache's magic. The rules are in the
//! [module docs](super).

use std::path::Path;

use super::{MAGIC, io_err, read_up_to};
use crate::error::{CodecError, Result};
use crate::files::{AtPath, open_at};

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
