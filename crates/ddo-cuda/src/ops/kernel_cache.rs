//! The compiled-image cache behind [`CudaDevice::kernel`](crate::CudaDevice): kernel sources
//! compiled once per process and architecture, in memory, and across processes on disk.
//!
//! [`ImageCache`] is generic over a [`Compiler`] (NVRTC in `kernels.rs`, counting fakes in
//! the tests below), needs no GPU and holds no `unsafe`:
//!
//! - **memory**: one slot per `(Arch, source name)`, a `OnceLock` shared through an `Arc`:
//!   the first caller (a background warm-up thread of [`ImageCache::prefetch`] or a
//!   device's `kernel` call) produces the image, every other caller waits for that result
//!   instead of compiling again. Failures are kept too (the same source fails the same way).
//! - **disk** ([`DiskCache`]): looked up when the slot is produced, before compiling; a
//!   compiled image is written back. One file per image, named by the hex of a 128-bit
//!   FNV-1a hash ([`DiskKey`]) over the format version, the compiler's identity (NVRTC's
//!   version, the options, the prelude), the source text, the architecture and the image
//!   kind. The file is a [`HEADER_LEN`]-byte header — magic `DDOKIMG\0`, format version,
//!   image kind, the key's hash, the image's length and its FNV-1a-64 checksum, little
//!   endian — then the image. A file that fails any check is ignored (and replaced by the
//!   next write); only a regular file is read, opened with `O_NONBLOCK` and checked by
//!   `fstat`, so a FIFO or device at an image's name never blocks a lookup. Writes go to a
//!   temporary file created with `O_CREAT|O_EXCL` under a random name in the same directory
//!   (`tempfile`: a link planted at any name is never opened), synced, then `rename`d, so a
//!   final name never shows a partial file; every IO error only means "compile instead".
//!
//! The checks catch corruption (a truncated or garbled file), not tampering: the cache
//! directory is trusted as the user's own files are.

use std::collections::HashMap;
use std::ffi::OsString;
use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

/// A GPU architecture: a compute capability `major.minor` (9.0 for Hopper).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Arch {
    /// The major version.
    pub major: i32,
    /// The minor version.
    pub minor: i32,
}

impl Arch {
    /// The real architecture, for cubins: `sm_90`.
    pub fn sm(self) -> String {
        format!("sm_{}{}", self.major, self.minor)
    }

    /// The virtual architecture, for PTX: `compute_90`.
    pub fn compute(self) -> String {
        format!("compute_{}{}", self.major, self.minor)
    }
}

/// What a compiled image holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum ImageKind {
    /// Machine code for one real architecture (loads without the driver's JIT).
    Cubin,
    /// PTX text (the driver JIT-compiles it at load).
    Ptx,
}

impl ImageKind {
    /// Every kind, in the order the disk is searched (the preferred first).
    pub const ALL: [ImageKind; 2] = [ImageKind::Cubin, ImageKind::Ptx];

    fn code(self) -> u32 {
        match self {
            ImageKind::Cubin => 1,
            ImageKind::Ptx => 2,
        }
    }

    fn name(self) -> &'static str {
        match self {
            ImageKind::Cubin => "cubin",
            ImageKind::Ptx => "ptx",
        }
    }
}

/// A compiled kernel source, ready for `cuModuleLoadData`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Image {
    /// Cubin or PTX.
    pub kind: ImageKind,
    /// The cubin, or the PTX text without a terminating NUL.
    pub bytes: Arc<[u8]>,
}

impl Image {
    /// An image of `kind` holding `bytes`.
    pub fn new(kind: ImageKind, bytes: Vec<u8>) -> Self {
        Self {
            kind,
            bytes: bytes.into(),
        }
    }
}

/// What turns a source into an [`Image`].
pub(crate) trait Compiler: Send + Sync + 'static {
    /// Everything besides the source, the architecture and the image kind that decides the
    /// image (compiler version, options, text put in front of every source), as text: part
    /// of the disk key. `Err` (the compiler is missing, say) skips the disk cache.
    fn identity(&self) -> Result<String, String>;

    /// Compiles `source` (named `name` in messages) for `arch`; `Err` is the message for
    /// the user (NVRTC's log for a source error).
    fn compile(&self, name: &str, source: &str, arch: Arch) -> Result<Image, String>;
}

/// Counts of where images came from, since the cache was made (see `KernelCacheStats`).
#[derive(Debug, Default)]
struct Counters {
    from_memory: AtomicU64,
    from_disk: AtomicU64,
    compiled: AtomicU64,
    written: AtomicU64,
}

/// Where a process's kernel images came from; [`kernel_cache_stats`](crate::kernel_cache_stats).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct KernelCacheStats {
    /// Images a device got from memory: compiled (or read) earlier in this process, or by a
    /// warm-up that was still in flight and was waited for.
    pub from_memory: u64,
    /// Images read from the disk cache.
    pub from_disk: u64,
    /// Compilations run (successful or not).
    pub compiled: u64,
    /// Images written to the disk cache.
    pub written: u64,
}

type Slot = Arc<OnceLock<Result<Image, String>>>;

/// Compiled images by `(Arch, source name)`, in memory and on disk; see the module docs.
pub(crate) struct ImageCache<C> {
    compiler: C,
    disk: Option<DiskCache>,
    slots: Mutex<HashMap<(Arch, &'static str), Slot>>,
    counters: Counters,
}

impl<C: Compiler> ImageCache<C> {
    /// An empty cache compiling with `compiler`, with `disk` behind memory when given.
    pub fn new(compiler: C, disk: Option<DiskCache>) -> Self {
        Self {
            compiler,
            disk,
            slots: Mutex::new(HashMap::new()),
            counters: Counters::default(),
        }
    }

    /// The disk cache, when there is one.
    pub fn disk(&self) -> Option<&DiskCache> {
        self.disk.as_ref()
    }

    /// The slot of `(arch, name)` and whether this call made it.
    fn slot(&self, arch: Arch, name: &'static str) -> (Slot, bool) {
        let mut slots = self.slots.lock();
        match slots.get(&(arch, name)) {
            Some(s) => (Arc::clone(s), false),
            None => {
                let s = Slot::default();
                slots.insert((arch, name), Arc::clone(&s));
                (s, true)
            }
        }
    }

    /// The image of source `name` (text `source`; one name, one text) for `arch`: from
    /// memory, waiting for a production in flight; else from disk; else compiled (and
    /// written to disk).
    pub fn get(&self, arch: Arch, name: &'static str, source: &str) -> Result<Image, String> {
        let (slot, _) = self.slot(arch, name);
        let mut produced = false;
        let result = slot
            .get_or_init(|| {
                produced = true;
                self.produce(arch, name, source)
            })
            .clone();
        if !produced {
            self.counters.from_memory.fetch_add(1, Ordering::Relaxed);
        }
        result
    }

    /// Starts one thread per source of `sources` that has no slot yet for `arch`, each
    /// producing its image into the cache (as [`get`](Self::get) would); returns at once,
    /// with the number of threads started. Sources already cached or in flight are skipped,
    /// so a second call does no work. A thread that cannot be spawned is skipped: the first
    /// `get` produces that image instead.
    pub fn prefetch(
        self: &Arc<Self>,
        arch: Arch,
        sources: &[(&'static str, &'static str)],
    ) -> usize {
        let mut started = 0;
        for &(name, source) in sources {
            let (slot, new) = self.slot(arch, name);
            if !new {
                continue;
            }
            let cache = Arc::clone(self);
            let spawned = crate::background::spawn(format!("ddo-kernels-{name}"), move || {
                slot.get_or_init(|| cache.produce(arch, name, source));
            });
            if spawned.is_ok() {
                started += 1;
            }
        }
        started
    }

    /// Forgets every image held in memory (productions in flight finish, into nothing); the
    /// next `get` of each reads the disk or compiles.
    pub fn forget(&self) {
        self.slots.lock().clear();
    }

    /// Where the images came from so far.
    pub fn stats(&self) -> KernelCacheStats {
        let c = &self.counters;
        KernelCacheStats {
            from_memory: c.from_memory.load(Ordering::Relaxed),
            from_disk: c.from_disk.load(Ordering::Relaxed),
            compiled: c.compiled.load(Ordering::Relaxed),
            written: c.written.load(Ordering::Relaxed),
        }
    }

    /// Disk, else compile (then write the disk).
    fn produce(&self, arch: Arch, name: &str, source: &str) -> Result<Image, String> {
        let disk = self
            .disk
            .as_ref()
            .and_then(|d| Some((d, self.compiler.identity().ok()?)));
        if let Some((disk, identity)) = &disk {
            for kind in ImageKind::ALL {
                if let Some(image) = disk.read(&DiskKey::new(identity, source, arch, kind)) {
                    self.counters.from_disk.fetch_add(1, Ordering::Relaxed);
                    return Ok(image);
                }
            }
        }
        self.counters.compiled.fetch_add(1, Ordering::Relaxed);
        let image = self.compiler.compile(name, source, arch)?;
        if let Some((disk, identity)) = &disk {
            let key = DiskKey::new(identity, source, arch, image.kind);
            if disk.write(&key, &image).is_ok() {
                self.counters.written.fetch_add(1, Ordering::Relaxed);
            }
        }
        Ok(image)
    }
}

/// The environment variable naming the disk cache's directory (`off`, `0` or empty: none).
pub(crate) const CACHE_ENV: &str = "DDO_KERNEL_CACHE";

/// The disk cache's directory from the environment (`var` looks a variable up):
/// `DDO_KERNEL_CACHE` when set (`off`, `0` or empty disable the cache), else
/// `$XDG_CACHE_HOME/ddo/kernels` (an absolute path, as the XDG spec requires), else
/// `$HOME/.cache/ddo/kernels`, else none.
pub(crate) fn cache_dir_from(var: impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    if let Some(v) = var(CACHE_ENV) {
        return match v.to_str() {
            Some("" | "off" | "0") => None,
            _ => Some(PathBuf::from(v)),
        };
    }
    let nonempty = |name: &str| var(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(xdg) = nonempty("XDG_CACHE_HOME").filter(|p| p.is_absolute()) {
        return Some(xdg.join("ddo").join("kernels"));
    }
    nonempty("HOME").map(|home| home.join(".cache").join("ddo").join("kernels"))
}

/// The disk key of one image: a 128-bit hash of what decides it, and its kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct DiskKey {
    hash: u128,
    kind: ImageKind,
}

impl DiskKey {
    /// The key of the `kind` image of `source` for `arch` by a compiler of `identity`.
    pub fn new(identity: &str, source: &str, arch: Arch, kind: ImageKind) -> Self {
        let mut h = Fnv128::new();
        h.field(&FORMAT_VERSION.to_le_bytes());
        h.field(identity.as_bytes());
        h.field(source.as_bytes());
        h.field(arch.sm().as_bytes());
        h.field(kind.name().as_bytes());
        Self {
            hash: h.finish(),
            kind,
        }
    }

    /// The file name: 32 hex digits and the kind (`….cubin`, `….ptx`).
    pub fn file_name(&self) -> String {
        format!("{:032x}.{}", self.hash, self.kind.name())
    }
}

/// Version of the file format (and of the key's layout).
const FORMAT_VERSION: u32 = 1;
/// The first bytes of every cache file.
const MAGIC: &[u8; 8] = b"DDOKIMG\0";
/// Bytes before the image: magic, version, kind, key hash, length, checksum.
pub(crate) const HEADER_LEN: usize = 8 + 4 + 4 + 16 + 8 + 8;
/// Larger files are not read (no image comes near).
const MAX_FILE: u64 = 1 << 30;

/// The disk half of the image cache: one directory of checked image files.
#[derive(Debug, Clone)]
pub(crate) struct DiskCache {
    dir: PathBuf,
}

impl DiskCache {
    /// A cache in `dir` (created on the first write).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into() }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file of `key`.
    pub fn path(&self, key: &DiskKey) -> PathBuf {
        self.dir.join(key.file_name())
    }

    /// The image stored under `key`, when its file is a regular file (a link is followed
    /// to one) that passes every check. Never blocks: the file is opened with `O_NONBLOCK`
    /// and read only when `fstat` says it is a regular file of at most [`MAX_FILE`] bytes.
    pub fn read(&self, key: &DiskKey) -> Option<Image> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(self.path(key))
            .ok()?;
        let meta = file.metadata().ok()?;
        if !meta.is_file() || meta.len() > MAX_FILE {
            return None;
        }
        let mut bytes = Vec::with_capacity(meta.len() as usize);
        file.take(MAX_FILE + 1).read_to_end(&mut bytes).ok()?;
        decode(&bytes, key)
    }

    /// Stores `image` under `key`: a temporary file created exclusively under a random
    /// name in the directory, synced, renamed over the final name, so the final name shows
    /// a whole file or none. On error nothing is left (the temporary file is removed when
    /// dropped).
    pub fn write(&self, key: &DiskKey, image: &Image) -> io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        fs::create_dir_all(&self.dir)?;
        let mut tmp = tempfile::Builder::new()
            .prefix(&format!(".{}.", key.file_name()))
            .suffix(".tmp")
            .permissions(fs::Permissions::from_mode(0o644))
            .tempfile_in(&self.dir)?;
        tmp.write_all(&encode(key, image))?;
        tmp.as_file().sync_data()?;
        tmp.persist(self.path(key)).map(drop).map_err(|e| e.error)
    }
}

/// The file bytes of `image` under `key`.
fn encode(key: &DiskKey, image: &Image) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + image.bytes.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&image.kind.code().to_le_bytes());
    out.extend_from_slice(&key.hash.to_le_bytes());
    out.extend_from_slice(&(image.bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(&fnv64(&image.bytes).to_le_bytes());
    out.extend_from_slice(&image.bytes);
    out
}

/// The image in `file` when it is a whole, intact file of `key`.
fn decode(file: &[u8], key: &DiskKey) -> Option<Image> {
    let (header, body) = file.split_at_checked(HEADER_LEN)?;
    let (magic, rest) = header.split_at(8);
    // Fields read without a panic whatever the file holds (a short header is no image).
    let u32_at = |at: usize| Some(u32::from_le_bytes(rest.get(at..at + 4)?.try_into().ok()?));
    let u64_at = |at: usize| Some(u64::from_le_bytes(rest.get(at..at + 8)?.try_into().ok()?));
    let hash = u128::from_le_bytes(rest.get(8..24)?.try_into().ok()?);
    let ok = magic == MAGIC
        && u32_at(0)? == FORMAT_VERSION
        && u32_at(4)? == key.kind.code()
        && hash == key.hash
        && u64_at(24)? == body.len() as u64
        && u64_at(32)? == fnv64(body)
        && !body.is_empty();
    ok.then(|| Image::new(key.kind, body.to_vec()))
}

/// FNV-1a, 64 bits: the image checksum.
fn fnv64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// FNV-1a, 128 bits, over length-prefixed fields: the disk key.
struct Fnv128(u128);

impl Fnv128 {
    const PRIME: u128 = 0x0000_0000_0100_0000_0000_0000_0000_013b;

    fn new() -> Self {
        Self(0x6c62_272e_07bb_0142_62b8_2175_6295_c58d)
    }

    fn bytes(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u128::from(b)).wrapping_mul(Self::PRIME);
        }
    }

    /// `bytes` after their length, so fields cannot run into each other.
    fn field(&mut self, bytes: &[u8]) {
        self.bytes(&(bytes.len() as u64).to_le_bytes());
        self.bytes(bytes);
    }

    fn finish(&self) -> u128 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Barrier;
    use std::time::Duration;

    use super::*;

    const ARCH: Arch = Arch { major: 9, minor: 0 };

    /// A compiler that counts its calls and "compiles" to the source's bytes.
    #[derive(Default)]
    struct Counting {
        calls: AtomicU64,
        delay: Duration,
        identity: String,
    }

    impl Compiler for Arc<Counting> {
        fn identity(&self) -> Result<String, String> {
            Ok(self.identity.clone())
        }

        fn compile(&self, name: &str, source: &str, arch: Arch) -> Result<Image, String> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(self.delay);
            if source.contains("syntax error") {
                return Err(format!("{name}: syntax error"));
            }
            Ok(Image::new(
                ImageKind::Cubin,
                format!("{}:{source}", arch.sm()).into_bytes(),
            ))
        }
    }

    fn counting(delay_ms: u64) -> Arc<Counting> {
        Arc::new(Counting {
            delay: Duration::from_millis(delay_ms),
            identity: "fake 1.0 --opt".into(),
            ..Counting::default()
        })
    }

    /// A fresh directory under the system's temporary directory, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(tag: &str) -> Self {
            static N: AtomicU64 = AtomicU64::new(0);
            let dir = std::env::temp_dir().join(format!(
                "ddo-kernel-cache-{tag}-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }

        fn files(&self) -> Vec<String> {
            let mut names: Vec<String> = fs::read_dir(&self.0)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            names.sort();
            names
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn cubin(bytes: &[u8]) -> Image {
        Image::new(ImageKind::Cubin, bytes.to_vec())
    }

    #[test]
    fn fnv_matches_the_published_test_vectors() {
        assert_eq!(fnv64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv64(b"a"), 0xaf63_dc4c_8601_ec8c);
        let mut h = Fnv128::new();
        h.bytes(b"a");
        assert_eq!(h.finish(), 0xd228_cb69_6f1a_8caf_7891_2b70_4e4a_8964);
    }

    #[test]
    fn the_key_changes_with_everything_that_decides_the_image() {
        let base = DiskKey::new("nvrtc 13.0 --std=c++17", "src", ARCH, ImageKind::Cubin);
        assert_eq!(
            base,
            DiskKey::new("nvrtc 13.0 --std=c++17", "src", ARCH, ImageKind::Cubin)
        );
        let others = [
            DiskKey::new("nvrtc 13.0 --std=c++17", "src ", ARCH, ImageKind::Cubin),
            DiskKey::new("nvrtc 13.0 --std=c++20", "src", ARCH, ImageKind::Cubin),
            DiskKey::new("nvrtc 13.1 --std=c++17", "src", ARCH, ImageKind::Cubin),
            DiskKey::new(
                "nvrtc 13.0 --std=c++17",
                "src",
                Arch {
                    major: 10,
                    minor: 0,
                },
                ImageKind::Cubin,
            ),
            DiskKey::new("nvrtc 13.0 --std=c++17", "src", ARCH, ImageKind::Ptx),
            // Fields are length-prefixed: moving bytes between them changes the key.
            DiskKey::new("nvrtc 13.0 --std=c++1", "7src", ARCH, ImageKind::Cubin),
        ];
        for (i, k) in others.iter().enumerate() {
            assert_ne!(k.hash, base.hash, "variant {i}");
            assert_ne!(k.file_name(), base.file_name(), "variant {i}");
        }
        assert_eq!(base.file_name().len(), 32 + ".cubin".len());
        assert!(base.file_name().ends_with(".cubin"));
        assert!(others[4].file_name().ends_with(".ptx"));
    }

    #[test]
    fn disk_round_trip() {
        let dir = TempDir::new("round-trip");
        let disk = DiskCache::new(dir.0.join("nested"));
        let key = DiskKey::new("id", "src", ARCH, ImageKind::Cubin);
        assert_eq!(disk.read(&key), None, "nothing stored yet");
        let image = cubin(b"\x7fELF some machine code");
        disk.write(&key, &image).unwrap();
        assert_eq!(disk.read(&key), Some(image.clone()));
        assert_eq!(dir.files(), ["nested"]);
        let stored = fs::read(disk.path(&key)).unwrap();
        assert_eq!(stored.len(), HEADER_LEN + image.bytes.len());
        assert_eq!(&stored[..8], MAGIC);
        // Another key (same kind, other source) does not find it.
        let other = DiskKey::new("id", "other", ARCH, ImageKind::Cubin);
        assert_eq!(disk.read(&other), None);
        // A file copied under another key's name is refused: the header names its key.
        fs::copy(disk.path(&key), disk.path(&other)).unwrap();
        assert_eq!(disk.read(&other), None);
        // Overwriting replaces the image, no temporary files stay behind.
        let newer = cubin(b"\x7fELF newer");
        disk.write(&key, &newer).unwrap();
        assert_eq!(disk.read(&key), Some(newer));
        let names: Vec<String> = fs::read_dir(disk.dir())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.ends_with(".tmp")), "{names:?}");
        assert_eq!(names.len(), 2);
    }

    #[test]
    fn corrupted_and_truncated_files_are_rejected_and_replaced() {
        let dir = TempDir::new("corrupt");
        let disk = DiskCache::new(&dir.0);
        let key = DiskKey::new("id", "src", ARCH, ImageKind::Cubin);
        let image = cubin(b"\x7fELF 0123456789abcdef");
        disk.write(&key, &image).unwrap();
        let good = fs::read(disk.path(&key)).unwrap();
        let mut bad_files = vec![
            good[..good.len() - 1].to_vec(),        // truncated image
            good[..HEADER_LEN].to_vec(),            // header only
            good[..10].to_vec(),                    // truncated header
            Vec::new(),                             // empty
            [good.clone(), b"x".to_vec()].concat(), // trailing bytes
        ];
        for at in [0, 8, 12, 16, 32, 40, HEADER_LEN + 3] {
            let mut flipped = good.clone();
            flipped[at] ^= 0x20; // magic, version, kind, key, length, checksum, image
            bad_files.push(flipped);
        }
        for (i, bad) in bad_files.iter().enumerate() {
            fs::write(disk.path(&key), bad).unwrap();
            assert_eq!(disk.read(&key), None, "bad file {i} was accepted");
        }
        // Through the cache: the bad file is ignored, the source compiled and the file
        // replaced by a good one.
        let compiler = counting(0);
        let cache = ImageCache::new(Arc::clone(&compiler), Some(DiskCache::new(&dir.0)));
        let key = DiskKey::new("fake 1.0 --opt", "text", ARCH, ImageKind::Cubin);
        fs::write(disk.path(&key), &good[..good.len() / 2]).unwrap();
        let got = cache.get(ARCH, "a.cu", "text").unwrap();
        assert_eq!(compiler.calls.load(Ordering::SeqCst), 1);
        assert_eq!(disk.read(&key), Some(got));
        assert_eq!(cache.stats().written, 1);
    }

    #[test]
    fn lookups_go_memory_then_disk_then_compile() {
        let dir = TempDir::new("order");
        let compiler = counting(0);
        let cache = ImageCache::new(Arc::clone(&compiler), Some(DiskCache::new(&dir.0)));
        let first = cache.get(ARCH, "a.cu", "text a").unwrap();
        assert_eq!(&*first.bytes, b"sm_90:text a");
        assert_eq!(dir.files().len(), 1, "one file per image");
        assert_eq!(cache.get(ARCH, "a.cu", "text a").unwrap(), first);
        let s = cache.stats();
        assert_eq!(
            (s.compiled, s.written, s.from_memory, s.from_disk),
            (1, 1, 1, 0)
        );
        // Memory forgotten: the disk answers, no compile.
        cache.forget();
        assert_eq!(cache.get(ARCH, "a.cu", "text a").unwrap(), first);
        assert_eq!(compiler.calls.load(Ordering::SeqCst), 1);
        assert_eq!(cache.stats().from_disk, 1);
        // A second process (a new cache on the same directory) reads the disk too.
        let compiler2 = counting(0);
        let cache2 = ImageCache::new(Arc::clone(&compiler2), Some(DiskCache::new(&dir.0)));
        assert_eq!(cache2.get(ARCH, "a.cu", "text a").unwrap(), first);
        assert_eq!(compiler2.calls.load(Ordering::SeqCst), 0);
        // Another architecture or another compiler identity is another image.
        cache2
            .get(Arch { major: 8, minor: 9 }, "a.cu", "text a")
            .unwrap();
        let other_id = Arc::new(Counting {
            identity: "fake 2.0 --opt".into(),
            ..Counting::default()
        });
        ImageCache::new(Arc::clone(&other_id), Some(DiskCache::new(&dir.0)))
            .get(ARCH, "a.cu", "text a")
            .unwrap();
        assert_eq!(compiler2.calls.load(Ordering::SeqCst), 1);
        assert_eq!(other_id.calls.load(Ordering::SeqCst), 1);
        assert_eq!(dir.files().len(), 3);
    }

    /// A FIFO at an image's name (or a link to one) is no image, and looking it up does not
    /// wait for a writer: the lookup runs on a thread of its own and must answer in time.
    #[test]
    fn a_fifo_at_an_image_name_is_not_read_and_does_not_block() {
        let dir = TempDir::new("fifo");
        let disk = DiskCache::new(&dir.0);
        let fifo = dir.0.join("pipe");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        let direct = DiskKey::new("id", "src", ARCH, ImageKind::Cubin);
        let linked = DiskKey::new("id", "src", ARCH, ImageKind::Ptx);
        fs::rename(&fifo, disk.path(&direct)).unwrap();
        std::os::unix::fs::symlink(disk.path(&direct), disk.path(&linked)).unwrap();
        for key in [direct, linked] {
            let (tx, rx) = std::sync::mpsc::channel();
            let d = disk.clone();
            std::thread::spawn(move || {
                let _ = tx.send(d.read(&key));
            });
            let got = rx
                .recv_timeout(Duration::from_secs(30))
                .expect("the lookup blocked on a FIFO");
            assert_eq!(got, None);
        }
        // A write replaces the name (DDO's own folder), never opening the FIFO.
        let image = cubin(b"\x7fELF fifo");
        disk.write(&direct, &image).unwrap();
        assert_eq!(disk.read(&direct), Some(image));
    }

    /// Temporary files get random names, created exclusively: links planted at every name
    /// of the old `.NAME.PID-N.tmp` scheme (N counted from 0 in each process) neither make
    /// a write fail nor get their target written.
    #[test]
    fn links_planted_at_temporary_names_neither_block_nor_redirect_a_write() {
        let dir = TempDir::new("planted");
        let disk = DiskCache::new(&dir.0);
        let key = DiskKey::new("id", "src", ARCH, ImageKind::Cubin);
        let victim = dir.0.join("victim");
        fs::write(&victim, b"precious").unwrap();
        for n in 0..512 {
            let name = format!(".{}.{}-{n}.tmp", key.file_name(), std::process::id());
            std::os::unix::fs::symlink(&victim, dir.0.join(name)).unwrap();
        }
        let image = cubin(b"\x7fELF planted");
        disk.write(&key, &image).unwrap();
        assert_eq!(disk.read(&key), Some(image));
        assert_eq!(fs::read(&victim).unwrap(), b"precious");
        assert_eq!(dir.files().len(), 512 + 2);
    }

    #[test]
    fn an_unwritable_directory_falls_back_to_compiling_without_error() {
        let dir = TempDir::new("unwritable");
        // A directory below a regular file can be neither created nor written, even by root.
        let blocker = dir.0.join("a-file");
        fs::write(&blocker, b"not a directory").unwrap();
        let compiler = counting(0);
        let cache = ImageCache::new(
            Arc::clone(&compiler),
            Some(DiskCache::new(blocker.join("kernels"))),
        );
        let image = cache.get(ARCH, "a.cu", "text").unwrap();
        assert_eq!(&*image.bytes, b"sm_90:text");
        cache.forget();
        cache.get(ARCH, "a.cu", "text").unwrap();
        assert_eq!(compiler.calls.load(Ordering::SeqCst), 2);
        let s = cache.stats();
        assert_eq!((s.written, s.from_disk), (0, 0));
        // A final name that cannot be replaced (a directory is in its way): the write
        // fails, the temporary file is removed, and nothing partial is left.
        let disk = DiskCache::new(dir.0.join("blocked"));
        let key = DiskKey::new("id", "src", ARCH, ImageKind::Cubin);
        fs::create_dir_all(disk.path(&key).join("inside")).unwrap();
        assert!(disk.write(&key, &cubin(b"\x7fELF")).is_err());
        let names: Vec<String> = fs::read_dir(disk.dir())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            [key.file_name()],
            "only the blocking directory remains"
        );
        assert_eq!(disk.read(&key), None);
    }

    #[test]
    fn a_compile_in_flight_is_waited_for_not_repeated() {
        let compiler = counting(100);
        let cache = Arc::new(ImageCache::new(Arc::clone(&compiler), None));
        let threads = 8;
        let barrier = Arc::new(Barrier::new(threads));
        let results: Vec<Image> = (0..threads)
            .map(|_| {
                let (cache, barrier) = (Arc::clone(&cache), Arc::clone(&barrier));
                std::thread::spawn(move || {
                    barrier.wait();
                    cache.get(ARCH, "a.cu", "text").unwrap()
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect();
        assert_eq!(compiler.calls.load(Ordering::SeqCst), 1);
        assert!(results.iter().all(|r| *r == results[0]));
        let s = cache.stats();
        assert_eq!((s.compiled, s.from_memory), (1, threads as u64 - 1));
    }

    #[test]
    fn prefetch_compiles_each_source_once_in_the_background() {
        let compiler = counting(100);
        let cache = Arc::new(ImageCache::new(Arc::clone(&compiler), None));
        let sources: [(&'static str, &'static str); 3] = [
            ("a.cu", "text a"),
            ("b.cu", "text b"),
            ("c.cu", "syntax error"),
        ];
        let t0 = std::time::Instant::now();
        assert_eq!(cache.prefetch(ARCH, &sources), 3);
        // A second warm-up for the same architecture starts nothing.
        assert_eq!(cache.prefetch(ARCH, &sources), 0);
        assert!(
            t0.elapsed() < Duration::from_millis(100),
            "prefetch must not wait for the compiles ({:?})",
            t0.elapsed()
        );
        // A `get` while they are in flight waits for them.
        assert_eq!(
            &*cache.get(ARCH, "b.cu", "text b").unwrap().bytes,
            b"sm_90:text b"
        );
        assert_eq!(
            &*cache.get(ARCH, "a.cu", "text a").unwrap().bytes,
            b"sm_90:text a"
        );
        // A failure in the background is reported by the later `get`, and not retried.
        assert_eq!(
            cache.get(ARCH, "c.cu", "syntax error"),
            Err("c.cu: syntax error".into())
        );
        assert_eq!(
            cache.get(ARCH, "c.cu", "syntax error"),
            Err("c.cu: syntax error".into())
        );
        assert_eq!(compiler.calls.load(Ordering::SeqCst), 3);
        // The three ran in parallel: well under three compile times.
        assert!(
            t0.elapsed() < Duration::from_millis(280),
            "{:?}",
            t0.elapsed()
        );
        // Another architecture is another warm-up.
        assert_eq!(
            cache.prefetch(Arch { major: 8, minor: 0 }, &sources[..1]),
            1
        );
        cache
            .get(Arch { major: 8, minor: 0 }, "a.cu", "text a")
            .unwrap();
        assert_eq!(compiler.calls.load(Ordering::SeqCst), 4);
    }

    #[test]
    fn the_directory_comes_from_the_environment() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| OsString::from(v))
            }
        };
        assert_eq!(
            cache_dir_from(env(&[("HOME", "/home/u")])),
            Some(PathBuf::from("/home/u/.cache/ddo/kernels"))
        );
        assert_eq!(
            cache_dir_from(env(&[("HOME", "/home/u"), ("XDG_CACHE_HOME", "/xdg")])),
            Some(PathBuf::from("/xdg/ddo/kernels"))
        );
        // A relative or empty XDG_CACHE_HOME is ignored, as the XDG spec says.
        assert_eq!(
            cache_dir_from(env(&[("HOME", "/home/u"), ("XDG_CACHE_HOME", "rel")])),
            Some(PathBuf::from("/home/u/.cache/ddo/kernels"))
        );
        assert_eq!(
            cache_dir_from(env(&[("HOME", "/home/u"), ("XDG_CACHE_HOME", "")])),
            Some(PathBuf::from("/home/u/.cache/ddo/kernels"))
        );
        assert_eq!(
            cache_dir_from(env(&[("HOME", "/home/u"), ("DDO_KERNEL_CACHE", "/k")])),
            Some(PathBuf::from("/k"))
        );
        for off in [
            &[
                ("HOME", "/h"),
                ("XDG_CACHE_HOME", "/x"),
                ("DDO_KERNEL_CACHE", "off"),
            ][..],
            &[("HOME", "/h"), ("DDO_KERNEL_CACHE", "0")],
            &[("HOME", "/h"), ("DDO_KERNEL_CACHE", "")],
        ] {
            assert_eq!(cache_dir_from(env(off)), None, "{off:?}");
        }
        assert_eq!(cache_dir_from(env(&[])), None);
        assert_eq!(cache_dir_from(env(&[("HOME", "")])), None);
    }
}
