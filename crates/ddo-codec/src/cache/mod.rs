//! A file of coded units on disk, so weights are coded once, not at every attach.
//!
//! The streaming engine codes every transfer unit of a checkpoint at attach, which takes
//! seconds for a large model. [`write_cache`] stores the coded units with a caller-built
//! [`CacheKey`] (what the units were coded from); [`read_cache`] hands them back only when
//! the key matches and every byte of the file checks out, and otherwise says why
//! ([`CacheLookup`]), so the caller codes again and rewrites the file.
//!
//! # File format (version [`CACHE_VERSION`])
//!
//! All integers little-endian.
//!
//! | offset | bytes | field |
//! | --- | --- | --- |
//! | 0 | 8 | magic `b"DDOCACHE"` |
//! | 8 | 4 | version ([`CACHE_VERSION`]) |
//! | 12 | 4 | flags, 0 |
//! | 16 | 8 | unit count `n` |
//! | 24 | 8 | key length `k` |
//! | 32 | 8 | payload offset `p` (16-aligned; `64 + align16(k) + align16(x) + align16(24 n)`) |
//! | 40 | 8 | payload length (the sum of the units' lengths, each rounded up to 16) |
//! | 48 | 8 | index hash: [`fast_hash`] of bytes `0..48` followed by bytes `56..p` |
//! | 56 | 8 | extra length `x` |
//! | 64 | `k` | the key's bytes, then zeros to a multiple of 16 |
//! | | `x` | the caller's extra bytes (e.g. figures of the coding), then zeros to a multiple of 16 |
//! | | `24 n` | the index: per unit its offset in the payload, its length, and [`fast_hash`] of its bytes (3 × `u64`), then zeros to a multiple of 16 |
//! | `p` | | the payload: the coded units in order, each starting 16-aligned, zeros between and after |
//!
//! The file is exactly `p` + payload length bytes. The index hash covers the header, the
//! key, the index and their padding; each unit's hash covers its bytes; padding in the
//! payload must be zero; each unit must parse ([`UnitHeader::parse`], which checks its own
//! metadata hash) to exactly its indexed length. So a truncated file, an extended one, and
//! a flipped byte anywhere are all detected before anything is decoded (and the units'
//! checksums still guard the decoded words).
//!
//! # Writing is atomic and replaces only a DDO cache
//!
//! [`write_cache`] writes a temporary file in the destination's directory (created with
//! `O_CREAT|O_EXCL` under a random name by the `tempfile` crate, so a name planted in
//! advance, a symbolic link included, is never opened, let alone truncated), syncs it and
//! renames it over the destination: a reader sees the old file or the new one, never a
//! partial one, and a failed write removes its temporary file and leaves any old file as
//! it was.
//!
//! The destination is replaced only when it is absent or is a regular, writable file that
//! starts with the cache's magic (`DDOCACHE`: a cache, valid, stale or corrupt). Anything
//! else at that name (a file of the user's, a checkpoint shard, a read-only file, a
//! directory, a FIFO, a device, a symbolic link of any kind) is left as it is:
//! [`write_cache`] refuses it ([`CodecError::CacheRefused`]) and [`open_cache`] answers
//! [`Lookup::NotACache`].
//!
//! # Opening never blocks
//!
//! What is at the path is looked at with `lstat` first; only a regular file is opened, with
//! `O_NONBLOCK` (and `O_NOFOLLOW` unless the name is a symbolic link), and the opened file
//! must be the regular file looked at (its `fstat` device and inode): a FIFO or device put
//! there in between is not read and nothing waits on it. A symbolic link is *read* through
//! when it points to a regular file (a cache kept on another disk is used when its key
//! matches), but never written through nor replaced.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{CodecError, Result};
use crate::format::UnitHeader;
use crate::hash::{P1, P2, P4, P5, fmix64, round};

mod path;
use crate::files::{AtPath, open_at};
use path::{Dest, NO_MAGIC, replaceable};

/// The cache file format version this build reads and writes; a file of another version is
/// [`CacheLookup::Stale`].
pub const CACHE_VERSION: u32 = 1;

/// The file's magic.
const MAGIC: &[u8; 8] = b"DDOCACHE";
/// Bytes of the fixed header.
const HEADER: usize = 64;
/// Bytes of one index entry.
const ENTRY: usize = 24;
/// Alignment of the key, the index, the payload and every unit in it.
const ALIGN: u64 = 16;

/// What a cache's units were coded from, as the caller describes it: the file is used only
/// when the key given to [`read_cache`] is byte for byte the key it was written with.
///
/// Build it from everything that decides the coded bytes, e.g. the source file's size and
/// modification time, the units' layout (each unit's byte length) and a content hash of
/// each unit's raw image ([`fast_hash`]). Fields are appended in order with
/// [`CacheKey::push_u64`] / [`CacheKey::push_bytes`] (length-prefixed, so two different
/// sequences of fields never give the same key).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheKey {
    bytes: Vec<u8>,
}

impl CacheKey {
    /// An empty key.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a `u64` field.
    pub fn push_u64(&mut self, v: u64) -> &mut Self {
        self.bytes.push(b'u');
        self.bytes.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// Appends a byte-string field (length-prefixed).
    pub fn push_bytes(&mut self, b: &[u8]) -> &mut Self {
        self.bytes.push(b'b');
        self.bytes
            .extend_from_slice(&(b.len() as u64).to_le_bytes());
        self.bytes.extend_from_slice(b);
        self
    }

    /// The key's bytes, as stored in the file.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// A fast 64-bit hash of `bytes` (not cryptographic): four independent xxHash64-style
/// rounds over the little-endian `u64`s (the tail zero-padded), finished with the length.
/// It runs at several GB/s per core, so hashing every raw unit costs far less than coding
/// it. Used for the cache's integrity checks and offered to callers for their keys.
pub fn fast_hash(bytes: &[u8]) -> u64 {
    let mut s = [P1.wrapping_add(P2), P2, 0, 0u64.wrapping_sub(P1)];
    let mut blocks = bytes.chunks_exact(32);
    for b in &mut blocks {
        for (j, lane) in s.iter_mut().enumerate() {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[8 * j..8 * j + 8]);
            *lane = round(*lane, u64::from_le_bytes(w));
        }
    }
    let mut tail = [0u8; 32];
    let rest = blocks.remainder();
    tail[..rest.len()].copy_from_slice(rest);
    for (j, lane) in s.iter_mut().enumerate() {
        let mut w = [0u8; 8];
        w.copy_from_slice(&tail[8 * j..8 * j + 8]);
        *lane = round(*lane, u64::from_le_bytes(w));
    }
    let mixed = s.iter().enumerate().fold(P5, |acc, (j, &x)| {
        acc.rotate_left(17 + j as u32) ^ fmix64(x)
    });
    fmix64(mixed ^ (bytes.len() as u64).wrapping_mul(P4))
}

/// Coded units read back from a cache file ([`read_cache`]): the file's payload in one
/// buffer, and each unit's place in it with its validated header.
#[derive(Debug)]
pub struct CachedUnits {
    payload: Vec<u8>,
    extra: Vec<u8>,
    units: Vec<(u64, UnitHeader)>,
    file_bytes: u64,
}

impl CachedUnits {
    /// Number of units.
    pub fn len(&self) -> usize {
        self.units.len()
    }

    /// Whether there are no units.
    pub fn is_empty(&self) -> bool {
        self.units.is_empty()
    }

    /// Unit `i`'s coded bytes and header, or `None` past the end.
    pub fn unit(&self, i: usize) -> Option<(&[u8], &UnitHeader)> {
        let (at, header) = self.units.get(i)?;
        let at = *at as usize;
        let end = at + header.encoded_len() as usize;
        Some((self.payload.get(at..end)?, header))
    }

    /// Every unit in order.
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &UnitHeader)> {
        (0..self.len()).filter_map(|i| self.unit(i))
    }

    /// The extra bytes given to [`write_cache`].
    pub fn extra(&self) -> &[u8] {
        &self.extra
    }

    /// Bytes of the file read.
    pub fn file_bytes(&self) -> u64 {
        self.file_bytes
    }
}

/// What a cache lookup found ([`read_cache`]: the units; [`open_cache`]: a file whose
/// header, key and index check out, its payload still to be read). [`Lookup::Absent`],
/// [`Lookup::Stale`] and [`Lookup::Corrupt`] mean: code the units and [`write_cache`]
/// them again; [`Lookup::NotACache`]: code them, and leave the path alone.
#[derive(Debug)]
pub enum Lookup<T> {
    /// The file matches the key and checks out (so far as read).
    Hit(T),
    /// There is no file.
    Absent,
    /// The file is intact but was written for another key (or by another format version).
    Stale(String),
    /// The file is damaged: the reason says where.
    Corrupt(String),
    /// Something that is not a DDO cache is at the path (what it is): a file without the
    /// `DDOCACHE` magic, a directory, a FIFO, a device, a link to one of those. It is not
    /// read further, and [`write_cache`] does not replace it.
    NotACache(String),
}

/// What [`read_cache`] found.
pub type CacheLookup = Lookup<CachedUnits>;

impl<T> Lookup<T> {
    /// Why the cache was not used (`None` for a hit).
    pub fn reason(&self) -> Option<String> {
        match self {
            Lookup::Hit(_) => None,
            Lookup::Absent => Some("no cache file".into()),
            Lookup::Stale(r) => Some(format!("stale: {r}")),
            Lookup::Corrupt(r) => Some(format!("corrupt: {r}")),
            Lookup::NotACache(r) => Some(format!("not a DDO cache: {r}")),
        }
    }

    /// The same miss for another hit type (`None` for a hit).
    fn miss<U>(self) -> Option<Lookup<U>> {
        match self {
            Lookup::Hit(_) => None,
            Lookup::Absent => Some(Lookup::Absent),
            Lookup::Stale(r) => Some(Lookup::Stale(r)),
            Lookup::Corrupt(r) => Some(Lookup::Corrupt(r)),
            Lookup::NotACache(r) => Some(Lookup::NotACache(r)),
        }
    }
}

fn align(v: u64) -> u64 {
    v.div_ceil(ALIGN) * ALIGN
}

fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    if let Some(s) = b.get(at..at + 8) {
        w.copy_from_slice(s);
    }
    u64::from_le_bytes(w)
}

/// The hash of the header (less its hash field), key and index.
fn index_hash(head: &[u8]) -> u64 {
    let mut v = Vec::with_capacity(head.len());
    v.extend_from_slice(&head[..48]);
    v.extend_from_slice(&head[56..]);
    fast_hash(&v)
}

/// Hashes every unit on up to `threads` threads.
fn hash_units(units: &[&[u8]]) -> Vec<u64> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(units.len().max(1));
    let per = units.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|scope| {
        let parts: Vec<_> = units
            .chunks(per)
            .map(|part| scope.spawn(move || part.iter().map(|u| fast_hash(u)).collect::<Vec<_>>()))
            .collect();
        parts
            .into_iter()
            .flat_map(|h| {
                // A hashing thread cannot panic (no indexing out of range); should one, its
                // units get a hash no unit has, so the file reads as corrupt.
                h.join().unwrap_or_default()
            })
            .collect()
    })
}

fn io_err(path: &Path, op: &'static str, e: &std::io::Error) -> CodecError {
    CodecError::CacheIo {
        path: path.to_path_buf(),
        op,
        message: e.to_string(),
    }
}

/// Writes `units` (each one whole coded unit, as the encoder wrote it) with `key` to
/// `path`, atomically (see the module docs). A unit that does not parse is refused with its
/// [`CodecError`] before any file is touched; something at `path` that is not a DDO cache
/// (or is read-only, or a symbolic link) is refused with [`CodecError::CacheRefused`] and
/// left as it is; a file system failure is [`CodecError::CacheIo`], with no temporary file
/// left behind.
///
/// `extra` is stored as it is and handed back by [`CachedUnits::extra`] (the engine keeps
/// the units' exponent entropy there, which a hit does not recompute).
pub fn write_cache(path: &Path, key: &CacheKey, extra: &[u8], units: &[&[u8]]) -> Result<()> {
    write_cache_failing_after(path, key, extra, units, None)
}

/// [`write_cache`], with (for tests) a simulated write failure after `fail_after` bytes.
fn write_cache_failing_after(
    path: &Path,
    key: &CacheKey,
    extra: &[u8],
    units: &[&[u8]],
    fail_after: Option<u64>,
) -> Result<()> {
    for u in units {
        UnitHeader::parse(u)?;
    }
    let n = units.len() as u64;
    let k = key.bytes.len() as u64;
    let x = extra.len() as u64;
    let payload_offset = HEADER as u64 + align(k) + align(x) + align(ENTRY as u64 * n);
    let hashes = hash_units(units);
    let mut head = vec![0u8; payload_offset as usize];
    head[..8].copy_from_slice(MAGIC);
    head[8..12].copy_from_slice(&CACHE_VERSION.to_le_bytes());
    head[16..24].copy_from_slice(&n.to_le_bytes());
    head[24..32].copy_from_slice(&k.to_le_bytes());
    head[32..40].copy_from_slice(&payload_offset.to_le_bytes());
    head[56..64].copy_from_slice(&x.to_le_bytes());
    head[HEADER..HEADER + key.bytes.len()].copy_from_slice(&key.bytes);
    let extra_at = HEADER + align(k) as usize;
    head[extra_at..extra_at + extra.len()].copy_from_slice(extra);
    let index_at = extra_at + align(x) as usize;
    let mut at = 0u64;
    for (i, (u, h)) in units.iter().zip(&hashes).enumerate() {
        let e = index_at + i * ENTRY;
        head[e..e + 8].copy_from_slice(&at.to_le_bytes());
        head[e + 8..e + 16].copy_from_slice(&(u.len() as u64).to_le_bytes());
        head[e + 16..e + 24].copy_from_slice(&h.to_le_bytes());
        at += align(u.len() as u64);
    }
    head[40..48].copy_from_slice(&at.to_le_bytes());
    let ih = index_hash(&head);
    head[48..56].copy_from_slice(&ih.to_le_bytes());

    // Refused before anything is written: the destination is not DDO's to replace.
    replaceable(path)?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let prefix = format!(
        ".{}.",
        path.file_name()
            .map_or_else(|| "cache".into(), |n| n.to_string_lossy().into_owned())
    );
    // O_CREAT|O_EXCL under a random name (retried on a clash), never opened again by name;
    // dropped (on any error below) it is removed.
    let tmp = {
        use std::os::unix::fs::PermissionsExt;
        tempfile::Builder::new()
            .prefix(&prefix)
            .suffix(".tmp")
            .permissions(std::fs::Permissions::from_mode(0o644))
            .tempfile_in(&dir)
            .map_err(|e| io_err(path, "create", &e))?
    };
    let mut out = std::io::BufWriter::with_capacity(
        1 << 20,
        Limited {
            inner: tmp.as_file(),
            left: fail_after,
        },
    );
    let w = |out: &mut std::io::BufWriter<Limited<'_>>, b: &[u8]| {
        out.write_all(b)
            .map_err(|e| io_err(tmp.path(), "write", &e))
    };
    w(&mut out, &head)?;
    let zeros = [0u8; ALIGN as usize];
    for u in units {
        w(&mut out, u)?;
        let pad = (align(u.len() as u64) - u.len() as u64) as usize;
        w(&mut out, &zeros[..pad])?;
    }
    out.flush().map_err(|e| io_err(tmp.path(), "write", &e))?;
    drop(out);
    tmp.as_file()
        .sync_all()
        .map_err(|e| io_err(tmp.path(), "sync", &e))?;
    // Looked at again right before the rename (the coding took a while). What remains is
    // a window of two system calls: something put at `path` after this check and before
    // the rename is replaced by it (its name, never its contents: rename(2) writes no
    // file). Where nothing was there, the rename refuses to replace anything
    // (RENAME_NOREPLACE, or a hard link where the file system lacks it), so that case has
    // no window.
    match replaceable(path)? {
        Dest::Cache => persist(tmp, path),
        Dest::Absent => match tmp.persist_noclobber(path) {
            Ok(_) => Ok(()),
            Err(tempfile::PersistError { error, file }) => match replaceable(path)? {
                // A cache written meanwhile (another process coding the same weights).
                Dest::Cache => persist(file, path),
                // Still nothing there: the file system renames only by replacing (no
                // RENAME_NOREPLACE, no hard links); the window above applies.
                Dest::Absent if error.kind() != std::io::ErrorKind::AlreadyExists => {
                    persist(file, path)
                }
                Dest::Absent => Err(io_err(path, "rename", &error)),
            },
        },
    }
}

/// Renames the synced temporary file to `path` (replacing what is there).
fn persist(tmp: tempfile::NamedTempFile, path: &Path) -> Result<()> {
    tmp.persist(path)
        .map(drop)
        .map_err(|e| io_err(path, "rename", &e.error))
}

/// A writer that fails once `left` bytes are spent (`None`: never).
struct Limited<'a> {
    inner: &'a std::fs::File,
    left: Option<u64>,
}

impl Write for Limited<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Some(left) = self.left {
            if left < buf.len() as u64 {
                return Err(std::io::Error::other("simulated write failure"));
            }
            self.left = Some(left - buf.len() as u64);
        }
        self.inner.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Reads the cache at `path` for `key` into memory ([`open_cache`], then
/// [`OpenCache::read_into`] a buffer of its payload). Absent, stale and corrupt files are
/// [`CacheLookup`]s, never errors, so the caller just codes again; only a file that exists
/// but cannot be read is [`CodecError::CacheIo`].
pub fn read_cache(path: &Path, key: &CacheKey) -> Result<CacheLookup> {
    let open = match open_cache(path, key)? {
        Lookup::Hit(open) => open,
        miss => return Ok(miss.miss().unwrap_or(Lookup::Absent)),
    };
    let file_bytes = open.payload_offset + open.payload_len;
    let extra = open.extra.clone();
    let mut payload = vec![0u8; open.payload_len as usize];
    Ok(match open.read_into(&mut payload)? {
        Ok(units) => Lookup::Hit(CachedUnits {
            payload,
            extra,
            units,
            file_bytes,
        }),
        Err(reason) => Lookup::Corrupt(reason),
    })
}

/// A cache file whose header, key and index checked out ([`open_cache`]); its payload is
/// read and checked by [`OpenCache::read_into`], straight into the caller's buffer (the
/// streaming engine reads it into its pinned home: one copy of the coded units in memory,
/// not two).
#[derive(Debug)]
pub struct OpenCache {
    path: PathBuf,
    file: std::fs::File,
    head: Head,
    extra: Vec<u8>,
}

impl std::ops::Deref for OpenCache {
    type Target = Head;
    fn deref(&self) -> &Head {
        &self.head
    }
}

/// The checked header and index of a cache file.
#[derive(Debug, Clone)]
pub struct Head {
    payload_offset: u64,
    payload_len: u64,
    /// Per unit: offset in the payload, length, hash.
    index: Vec<(u64, u64, u64)>,
}

impl Head {
    /// Bytes of the payload (the coded units, each 16-aligned, zeros between).
    pub fn payload_len(&self) -> u64 {
        self.payload_len
    }

    /// Number of units.
    pub fn units(&self) -> usize {
        self.index.len()
    }
}

impl OpenCache {
    /// The extra bytes given to [`write_cache`].
    pub fn extra(&self) -> &[u8] {
        &self.extra
    }

    /// Reads the payload into `dst` (exactly [`Head::payload_len`] bytes) on several
    /// threads and checks every unit (padding zero, header parses to its indexed length,
    /// bytes match their hash). Returns each unit's offset in the payload and header, or
    /// why the payload is corrupt (then `dst` holds bytes that must not be used);
    /// [`CodecError::CacheIo`] when the file cannot be read.
    pub fn read_into(
        self,
        dst: &mut [u8],
    ) -> Result<std::result::Result<Vec<(u64, UnitHeader)>, String>> {
        if dst.len() as u64 != self.payload_len {
            return Err(CodecError::CacheIo {
                path: self.path.clone(),
                op: "read",
                message: format!(
                    "a {}-byte buffer for a {}-byte payload",
                    dst.len(),
                    self.payload_len
                ),
            });
        }
        read_parallel(&self.file, self.payload_offset, dst)
            .map_err(|e| io_err(&self.path, "read", &e))?;
        Ok(check_payload(&self.head, dst))
    }
}

/// Reads `dst.len()` bytes of `file` from `offset` on up to [`READ_THREADS`] threads.
fn read_parallel(file: &std::fs::File, offset: u64, dst: &mut [u8]) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    const CHUNK: usize = 64 << 20;
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, READ_THREADS);
    let chunks: Vec<(u64, &mut [u8])> = dst
        .chunks_mut(CHUNK)
        .enumerate()
        .map(|(i, c)| (offset + (i * CHUNK) as u64, c))
        .collect();
    let per = chunks.len().div_ceil(threads).max(1);
    let mut groups: Vec<Vec<(u64, &mut [u8])>> = Vec::new();
    let mut it = chunks.into_iter().peekable();
    while it.peek().is_some() {
        groups.push(it.by_ref().take(per).collect());
    }
    std::thread::scope(|scope| {
        let workers: Vec<_> = groups
            .into_iter()
            .map(|group| {
                scope.spawn(move || -> std::io::Result<()> {
                    for (at, c) in group {
                        file.read_exact_at(c, at)?;
                    }
                    Ok(())
                })
            })
            .collect();
        workers.into_iter().try_for_each(|w| {
            w.join()
                .unwrap_or_else(|_| Err(std::io::Error::other("a reading thread panicked")))
        })
    })
}

/// Threads that read a cache payload: a handful reach a disk's or the page cache's rate.
pub const READ_THREADS: usize = 8;

/// Opens the cache at `path` for `key`: reads and checks its header, key and index (the
/// payload is not read yet: [`OpenCache::read_into`]). Never blocks (see the module docs):
/// anything but a regular file (or a symbolic link to one), and a file without the
/// `DDOCACHE` magic, is [`Lookup::NotACache`], not read further.
pub fn open_cache(path: &Path, key: &CacheKey) -> Result<Lookup<OpenCache>> {
    let (file, meta) = match open_at(path).map_err(|e| io_err(path, "open", &e))? {
        AtPath::Absent => return Ok(Lookup::Absent),
        AtPath::Other(what) => return Ok(Lookup::NotACache(what)),
        AtPath::File { file, meta, .. } => (file, meta),
    };
    let len = meta.len();
    let mut fixed = [0u8; HEADER];
    let got = read_up_to(&file, 0, &mut fixed).map_err(|e| io_err(path, "read", &e))?;
    if got < MAGIC.len() || &fixed[..MAGIC.len()] != MAGIC {
        return Ok(Lookup::NotACache(NO_MAGIC.into()));
    }
    let payload_offset = le_u64(&fixed, 32);
    let mut head = vec![0u8; payload_offset.min(len) as usize];
    if got < HEADER || payload_offset > len {
        head = fixed[..got].to_vec();
    } else {
        read_up_to(&file, 0, &mut head).map_err(|e| io_err(path, "read", &e))?;
    }
    Ok(match check_head(&head, len, key) {
        Lookup::Hit((head, extra)) => Lookup::Hit(OpenCache {
            path: path.to_path_buf(),
            file,
            head,
            extra,
        }),
        miss => miss.miss().unwrap_or(Lookup::Absent),
    })
}

/// Reads up to `dst.len()` bytes at `offset` (fewer only at the end of the file).
fn read_up_to(file: &std::fs::File, offset: u64, dst: &mut [u8]) -> std::io::Result<usize> {
    use std::os::unix::fs::FileExt;
    let mut done = 0;
    while done < dst.len() {
        match file.read_at(&mut dst[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// Validates a whole cache file's bytes against `key` (the checks [`open_cache`] and
/// [`OpenCache::read_into`] make, on bytes in memory).
#[cfg(test)]
fn check(bytes: Vec<u8>, key: &CacheKey) -> CacheLookup {
    let head_len = (le_u64(&bytes, 32) as usize).min(bytes.len());
    let head_bytes = if bytes.len() < HEADER {
        &bytes[..]
    } else {
        &bytes[..head_len]
    };
    let (head, extra) = match check_head(head_bytes, bytes.len() as u64, key) {
        Lookup::Hit(h) => h,
        miss => return miss.miss().unwrap_or(Lookup::Absent),
    };
    let payload = &bytes[head.payload_offset as usize..];
    match check_payload(&head, payload) {
        Ok(units) => Lookup::Hit(CachedUnits {
            payload: payload.to_vec(),
            extra,
            units,
            file_bytes: bytes.len() as u64,
        }),
        Err(reason) => Lookup::Corrupt(reason),
    }
}

/// Checks a cache file's header, key and index (`head`: the file's bytes up to the
/// payload; `len`: the file's length) against `key`; returns the index and the extra bytes.
fn check_head(head: &[u8], len: u64, key: &CacheKey) -> Lookup<(Head, Vec<u8>)> {
    let corrupt = |r: String| Lookup::Corrupt(r);
    if head.len() < HEADER {
        return corrupt(format!(
            "{len} bytes, shorter than the {HEADER}-byte header"
        ));
    }
    if &head[..8] != MAGIC {
        return corrupt("bad magic".into());
    }
    let version = u32::from_le_bytes([head[8], head[9], head[10], head[11]]);
    let n = le_u64(head, 16);
    let k = le_u64(head, 24);
    let payload_offset = le_u64(head, 32);
    let payload_len = le_u64(head, 40);
    let stored_hash = le_u64(head, 48);
    let x = le_u64(head, 56);
    let expect_offset = n
        .checked_mul(ENTRY as u64)
        .and_then(|i| align(k).checked_add(align(i)))
        .and_then(|v| v.checked_add(align(x)))
        .and_then(|v| v.checked_add(HEADER as u64));
    if expect_offset != Some(payload_offset)
        || payload_offset > len
        || head.len() as u64 != payload_offset
    {
        return corrupt(format!(
            "payload offset {payload_offset} does not follow from {n} units, a {k}-byte key and {x} extra bytes in a {len}-byte file"
        ));
    }
    let computed = index_hash(head);
    if computed != stored_hash {
        return corrupt(format!(
            "header/key/index hash {computed:#018x} is not the stored {stored_hash:#018x}"
        ));
    }
    if version != CACHE_VERSION {
        return Lookup::Stale(format!(
            "format version {version}, this build reads {CACHE_VERSION}"
        ));
    }
    if u32::from_le_bytes([head[12], head[13], head[14], head[15]]) != 0 {
        return corrupt("nonzero flags".into());
    }
    if payload_offset.checked_add(payload_len) != Some(len) {
        return corrupt(format!(
            "{len} bytes, but the header says {payload_offset} + {payload_len}"
        ));
    }
    let stored_key = &head[HEADER..HEADER + k as usize];
    if stored_key != key.as_bytes() {
        return Lookup::Stale("written for another key (the source or layout changed)".into());
    }
    let extra_at = HEADER + align(k) as usize;
    let extra = head[extra_at..extra_at + x as usize].to_vec();
    let index_at = extra_at + align(x) as usize;
    let mut index = Vec::with_capacity(n as usize);
    let mut at = 0u64;
    for i in 0..n as usize {
        let e = index_at + i * ENTRY;
        let (off, ulen, h) = (le_u64(head, e), le_u64(head, e + 8), le_u64(head, e + 16));
        if off != at {
            return corrupt(format!("unit {i} at {off}, expected {at}"));
        }
        let Some(end) = off
            .checked_add(ulen)
            .filter(|&end| align(end) <= payload_len)
        else {
            return corrupt(format!(
                "unit {i} ({ulen} bytes at {off}) runs past the payload"
            ));
        };
        index.push((off, ulen, h));
        at = align(end);
    }
    if at != payload_len {
        return corrupt(format!("units end at {at}, the payload at {payload_len}"));
    }
    Lookup::Hit((
        Head {
            payload_offset,
            payload_len,
            index,
        },
        extra,
    ))
}

/// Checks a payload against its checked index: padding zero, every unit parses to its
/// indexed length and matches its hash (hashed on every core).
fn check_payload(
    head: &Head,
    payload: &[u8],
) -> std::result::Result<Vec<(u64, UnitHeader)>, String> {
    if payload.len() as u64 != head.payload_len {
        return Err(format!(
            "payload of {} bytes, the header says {}",
            payload.len(),
            head.payload_len
        ));
    }
    let mut units = Vec::with_capacity(head.index.len());
    let mut slices: Vec<&[u8]> = Vec::with_capacity(head.index.len());
    for (i, &(off, ulen, _)) in head.index.iter().enumerate() {
        let end = off + ulen;
        if payload[end as usize..align(end) as usize]
            .iter()
            .any(|&b| b != 0)
        {
            return Err(format!("nonzero padding after unit {i}"));
        }
        let unit = &payload[off as usize..end as usize];
        match UnitHeader::parse(unit) {
            Ok(header) if header.encoded_len() == ulen => units.push((off, header)),
            Ok(header) => {
                return Err(format!(
                    "unit {i}: its header says {} bytes, the index {ulen}",
                    header.encoded_len()
                ));
            }
            Err(err) => return Err(format!("unit {i}: {err}")),
        }
        slices.push(unit);
    }
    let computed = hash_units(&slices);
    if let Some(i) = (0..slices.len()).find(|&i| computed.get(i) != head.index.get(i).map(|e| &e.2))
    {
        return Err(format!("unit {i}'s bytes do not match their hash"));
    }
    Ok(units)
}

#[cfg(test)]
mod tests;
