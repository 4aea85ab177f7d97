//! The coded-unit cache beside a checkpoint (`compress=lossless`, issue 20) on the host
//! backend: the first attach codes and writes `<checkpoint>.ddo-coded`, the second reads it
//! (the figures say so), a corrupted cache is detected and rebuilt, a hit reads no raw byte
//! and trusts the files by size, modification time and inode (issue 35: a file replaced or
//! touched is stale, one rewritten in place keeping all three is served from the cache), weights
//! that are not mapped from a file never use a cache, and every forward reads exactly the
//! checkpoint's bytes. What is at the cache path and is not a DDO cache (a shard of the
//! checkpoint, a link to it, a user's or read-only file, a FIFO) is left as it is, without
//! blocking (issue 34).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ddo_core::device::download;
use ddo_core::streaming::{
    CodedCache, StagingKind, StreamingConfig, StreamingEngine, StreamingFigures, coded_cache_path,
};
use ddo_core::{Checkpoint, Compression, CoreError, DType, Device, DeviceBuffer, Param, ParamKind};
use ddo_host::HostDevice;
use ddo_metrics::RouteMetrics;

/// A fresh temporary directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "ddo-coded-cache-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Segment sizes (f32 elements per param).
const SIZES: [&[usize]; 6] = [
    &[1000, 64],
    &[1024],
    &[300, 300, 77],
    &[1000],
    &[1000, 1000],
    &[900],
];

/// Weight-like values for `(segment, param)`, varied by `seed`.
fn values(seed: u32, s: usize, i: usize, n: usize) -> Vec<f32> {
    let mut x = 0x9e37_79b9u32 ^ seed.wrapping_mul(0x85eb_ca6b) ^ ((s * 16 + i) as u32);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x as f32 / u32::MAX as f32 - 0.5) * 0.04
        })
        .collect()
}

/// Writes the checkpoint for `seed` to `path` (same tensors and sizes for every seed).
fn write_checkpoint(path: &Path, seed: u32) {
    write_shard(path, seed, 0..SIZES.len());
}

/// Writes the tensors of `segments` for `seed` to `path`.
fn write_shard(path: &Path, seed: u32, segments: std::ops::Range<usize>) {
    let bytes: Vec<(String, Vec<u8>, usize)> = SIZES
        .iter()
        .enumerate()
        .filter(|(s, _)| segments.contains(s))
        .flat_map(|(s, ps)| {
            ps.iter().enumerate().map(move |(i, &n)| {
                let b = values(seed, s, i, n)
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect();
                (format!("s{s}.p{i}"), b, n)
            })
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
        .iter()
        .map(|(name, data, n)| {
            (
                name.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![*n], data)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// The checkpoint's params, segment by segment.
fn load(path: &Path) -> Vec<Vec<Arc<Param>>> {
    load_shards(&[(path, 0..SIZES.len())])
}

/// The params of a checkpoint in shards (each file with the segments it holds).
fn load_shards(shards: &[(&Path, std::ops::Range<usize>)]) -> Vec<Vec<Arc<Param>>> {
    let files: Vec<(Checkpoint, std::ops::Range<usize>)> = shards
        .iter()
        .map(|(p, r)| (Checkpoint::open(p).unwrap(), r.clone()))
        .collect();
    SIZES
        .iter()
        .enumerate()
        .map(|(s, ps)| {
            let ckpt = &files.iter().find(|(_, r)| r.contains(&s)).unwrap().0;
            (0..ps.len())
                .map(|i| {
                    let name = format!("s{s}.p{i}");
                    Param::from_checkpoint(ckpt, &name, name.clone(), ParamKind::Parameter).unwrap()
                })
                .collect()
        })
        .collect()
}

/// Builds a lossless-coded engine over `segs` (small units, everything streamed), runs two
/// forwards checking every position reads exactly its params' bytes, and returns the
/// figures.
fn attach_and_run(segs: &[Vec<Arc<Param>>]) -> StreamingFigures {
    let want: Vec<Vec<u8>> = segs
        .iter()
        .map(|seg| seg.iter().flat_map(|p| p.host().to_vec()).collect())
        .collect();
    attach_and_expect(segs, &want)
}

/// [`attach_and_run`] with the bytes each position's forward must read given.
fn attach_and_expect(segs: &[Vec<Arc<Param>>], want: &[Vec<u8>]) -> StreamingFigures {
    let d = HostDevice::with_capacity(1 << 24).unwrap();
    let schedule: Vec<usize> = (0..segs.len()).collect();
    let dev: Arc<dyn Device> = d.clone();
    let mut engine = StreamingEngine::new(
        dev,
        d.create_stream().unwrap(),
        segs,
        &schedule,
        &StreamingConfig {
            unit_bytes: 4096,
            // No budget: every param is streamed.
            compress: Compression::Lossless,
            ..StreamingConfig::default()
        },
        Arc::new(RouteMetrics::new()),
    )
    .unwrap();
    let outputs: Vec<DeviceBuffer> = want.iter().map(|w| d.alloc(w.len()).unwrap()).collect();
    let compute = d.compute_stream();
    for _ in 0..2 {
        engine.begin_forward().unwrap();
        for (pos, &s) in schedule.iter().enumerate() {
            engine.enter(pos).unwrap();
            let mut at = 0;
            for p in &segs[s] {
                let src = p
                    .device()
                    .ok_or_else(|| CoreError::NotResident {
                        leaf: format!("position {pos}"),
                        param: p.name().to_string(),
                    })
                    .unwrap();
                d.copy_d2d(&src, &outputs[pos].slice(at, p.nbytes()).unwrap(), &compute)
                    .unwrap();
                at += p.nbytes();
            }
            engine.leave(pos).unwrap();
        }
        engine.end_forward().unwrap();
        d.synchronize().unwrap();
        let got: Vec<Vec<u8>> = outputs
            .iter()
            .map(|o| download(&*d, &o.slice_all(), &compute).unwrap())
            .collect();
        assert_eq!(got, want, "a forward did not read the checkpoint's bytes");
    }
    let f = engine.figures().clone();
    engine.teardown().unwrap();
    f
}

fn cache_state(f: &StreamingFigures) -> CodedCache {
    match f.staging {
        StagingKind::Coded { cache, .. } => cache,
        other => panic!("not coded: {other:?}"),
    }
}

#[test]
fn the_second_attach_reads_the_cache_and_a_corrupt_one_is_rebuilt() {
    let dir = TempDir::new();
    let ckpt = dir.0.join("diffusion_pytorch_model.safetensors");
    write_checkpoint(&ckpt, 1);
    let cache = coded_cache_path(&ckpt);
    assert_eq!(
        cache,
        dir.0.join("diffusion_pytorch_model.safetensors.ddo-coded")
    );

    let segs = load(&ckpt);
    let first = attach_and_run(&segs);
    assert_eq!(cache_state(&first), CodedCache::Built, "{first:?}");
    assert!(cache.is_file());
    assert_eq!(first.coded_cache_path.as_deref(), Some(cache.as_path()));
    let note = first.coded_cache_note.clone().unwrap_or_default();
    assert!(note.contains("no cache file"), "{note}");

    let second = attach_and_run(&segs);
    assert_eq!(cache_state(&second), CodedCache::Used, "{second:?}");
    assert_eq!(second.coded_cache_note, None);
    // The same coded units, the same figures (entropy kept in the cache).
    let (
        StagingKind::Coded {
            coded_bytes: a,
            exponent_entropy_millibits: ea,
            ..
        },
        StagingKind::Coded {
            coded_bytes: b,
            exponent_entropy_millibits: eb,
            ..
        },
    ) = (first.staging, second.staging)
    else {
        panic!("not coded");
    };
    assert_eq!((a, ea), (b, eb));

    // A flipped byte anywhere in the file: detected, rebuilt, and the outputs stay exact.
    let len = std::fs::metadata(&cache).unwrap().len() as usize;
    for at in [len / 2, len - 1, 20, 70] {
        let mut bytes = std::fs::read(&cache).unwrap();
        bytes[at] ^= 0x10;
        std::fs::write(&cache, &bytes).unwrap();
        let f = attach_and_run(&segs);
        assert_eq!(cache_state(&f), CodedCache::Built, "flip at {at}: {f:?}");
        let note = f.coded_cache_note.clone().unwrap_or_default();
        assert!(note.contains("corrupt"), "flip at {at}: {note}");
        assert_eq!(cache_state(&attach_and_run(&segs)), CodedCache::Used);
    }
    // A truncated file too.
    let bytes = std::fs::read(&cache).unwrap();
    std::fs::write(&cache, &bytes[..bytes.len() / 3]).unwrap();
    let f = attach_and_run(&segs);
    assert_eq!(cache_state(&f), CodedCache::Built);
    assert_eq!(cache_state(&attach_and_run(&segs)), CodedCache::Used);
}

/// The bytes each segment's params hold now.
fn bytes_now(segs: &[Vec<Arc<Param>>]) -> Vec<Vec<u8>> {
    segs.iter()
        .map(|seg| seg.iter().flat_map(|p| p.host().to_vec()).collect())
        .collect()
}

/// Writes `seed`'s checkpoint as a new file renamed over `path` (a new inode), keeping
/// `mtime`.
fn replace_keeping_time(path: &Path, seed: u32, mtime: std::time::SystemTime) {
    let tmp = path.with_extension("tmp");
    write_checkpoint(&tmp, seed);
    std::fs::File::options()
        .write(true)
        .open(&tmp)
        .unwrap()
        .set_modified(mtime)
        .unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// Issue 35: a cache hit reads no raw byte. The checkpoint is trusted by size, modification
/// time and inode: rewritten in place keeping all three, the hit still serves the coded
/// units of the bytes it was built from (which shows the raw bytes were not read); replaced
/// by another file (a new inode) or touched, it is stale and rebuilt.
#[test]
fn a_hit_trusts_size_time_and_inode_and_reads_no_raw_byte() {
    use std::os::unix::fs::MetadataExt;
    let dir = TempDir::new();
    let ckpt = dir.0.join("model.safetensors");
    write_checkpoint(&ckpt, 1);
    let segs = load(&ckpt);
    assert_eq!(cache_state(&attach_and_run(&segs)), CodedCache::Built);
    assert_eq!(cache_state(&attach_and_run(&segs)), CodedCache::Used);
    let first = bytes_now(&segs);
    let meta = std::fs::metadata(&ckpt).unwrap();
    let (size, mtime, inode) = (meta.len(), meta.modified().unwrap(), meta.ino());
    drop(segs);

    // Other bytes in place: the same size, time and inode. Trusted: the forward reads the
    // bytes the cache was built from, not the file's.
    let other = dir.0.join("other.safetensors");
    write_checkpoint(&other, 2);
    let bytes = std::fs::read(&other).unwrap();
    {
        use std::io::Write;
        let mut f = std::fs::File::options().write(true).open(&ckpt).unwrap();
        f.write_all(&bytes).unwrap();
        f.set_modified(mtime).unwrap();
    }
    let meta = std::fs::metadata(&ckpt).unwrap();
    assert_eq!(
        (meta.len(), meta.modified().unwrap(), meta.ino()),
        (size, mtime, inode)
    );
    let segs = load(&ckpt);
    assert_ne!(bytes_now(&segs), first);
    let f = attach_and_expect(&segs, &first);
    assert_eq!(cache_state(&f), CodedCache::Used, "{f:?}");
    drop(segs);

    // Replaced by another file with the same size and time: a new inode, stale.
    replace_keeping_time(&ckpt, 3, mtime);
    assert_ne!(std::fs::metadata(&ckpt).unwrap().ino(), inode);
    let segs = load(&ckpt);
    let f = attach_and_run(&segs);
    assert_eq!(cache_state(&f), CodedCache::Built, "{f:?}");
    let note = f.coded_cache_note.clone().unwrap_or_default();
    assert!(note.contains("stale"), "{note}");
    assert_eq!(cache_state(&attach_and_run(&segs)), CodedCache::Used);
    drop(segs);

    // Touched (another modification time): stale.
    std::fs::File::options()
        .write(true)
        .open(&ckpt)
        .unwrap()
        .set_modified(mtime + std::time::Duration::from_secs(5))
        .unwrap();
    let segs = load(&ckpt);
    let f = attach_and_run(&segs);
    assert_eq!(cache_state(&f), CodedCache::Built, "{f:?}");
}

#[test]
fn weights_not_mapped_from_a_file_never_use_a_cache() {
    let segs: Vec<Vec<Arc<Param>>> = SIZES
        .iter()
        .enumerate()
        .map(|(s, ps)| {
            ps.iter()
                .enumerate()
                .map(|(i, &n)| {
                    Param::from_f32(
                        format!("s{s}.p{i}"),
                        ParamKind::Parameter,
                        DType::F32,
                        vec![n],
                        &values(1, s, i, n),
                    )
                    .unwrap()
                })
                .collect()
        })
        .collect();
    let f = attach_and_run(&segs);
    assert_eq!(cache_state(&f), CodedCache::Unavailable);
    let note = f.coded_cache_note.clone().unwrap_or_default();
    assert!(note.contains("not mapped"), "{note}");
}

#[cfg(unix)]
#[test]
fn a_directory_that_is_not_writable_codes_without_a_cache() {
    use std::os::unix::fs::PermissionsExt;
    let dir = TempDir::new();
    let ckpt = dir.0.join("model.safetensors");
    write_checkpoint(&ckpt, 1);
    let segs = load(&ckpt);
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o555)).unwrap();
    // A superuser writes anyway: then there is nothing to check here.
    let probe = dir.0.join("probe");
    let writable = std::fs::write(&probe, b"").is_ok();
    let f = attach_and_run(&segs);
    std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    if writable {
        eprintln!(
            "a superuser writes a read-only directory: only the directory-in-the-way case runs"
        );
    } else {
        assert_eq!(cache_state(&f), CodedCache::Unavailable, "{f:?}");
        let note = f.coded_cache_note.clone().unwrap_or_default();
        assert!(note.contains("without a cache"), "{note}");
        assert!(!coded_cache_path(&ckpt).exists());
    }
    // A cache path that cannot be read or replaced (a directory in the way), as any user.
    let _ = std::fs::remove_file(&probe);
    let _ = std::fs::remove_file(coded_cache_path(&ckpt));
    std::fs::create_dir(coded_cache_path(&ckpt)).unwrap();
    std::fs::write(coded_cache_path(&ckpt).join("x"), b"x").unwrap();
    let f = attach_and_run(&segs);
    assert_eq!(cache_state(&f), CodedCache::Unavailable, "{f:?}");
    let note = f.coded_cache_note.clone().unwrap_or_default();
    assert!(note.contains("without a cache"), "{note}");
    assert!(coded_cache_path(&ckpt).is_dir());
}

#[test]
fn a_sharded_checkpoint_is_cached_beside_its_first_file_and_each_shard_is_checked() {
    let dir = TempDir::new();
    let a = dir
        .0
        .join("diffusion_pytorch_model-00001-of-00002.safetensors");
    let b = dir
        .0
        .join("diffusion_pytorch_model-00002-of-00002.safetensors");
    write_shard(&a, 1, 0..3);
    write_shard(&b, 1, 3..SIZES.len());
    // The shards given in reverse order: the cache still goes beside the first file.
    let shards = [(b.as_path(), 3..SIZES.len()), (a.as_path(), 0..3)];
    let segs = load_shards(&shards);
    let first = attach_and_run(&segs);
    assert_eq!(cache_state(&first), CodedCache::Built, "{first:?}");
    assert!(coded_cache_path(&a).is_file());
    assert!(!coded_cache_path(&b).exists());
    assert_eq!(cache_state(&attach_and_run(&segs)), CodedCache::Used);
    drop(segs);

    // The second shard rewritten with other bytes, the same size and modification time.
    let mtime = std::fs::metadata(&b).unwrap().modified().unwrap();
    write_shard(&b, 2, 3..SIZES.len());
    std::fs::File::options()
        .write(true)
        .open(&b)
        .unwrap()
        .set_modified(mtime)
        .unwrap();
    let segs = load_shards(&shards);
    let f = attach_and_run(&segs);
    assert_eq!(cache_state(&f), CodedCache::Built, "{f:?}");
    let note = f.coded_cache_note.clone().unwrap_or_default();
    assert!(note.contains("stale"), "{note}");
    assert_eq!(cache_state(&attach_and_run(&segs)), CodedCache::Used);
    drop(segs);

    // A shard renamed: another file name, so another key.
    let renamed = dir
        .0
        .join("diffusion_pytorch_model-00002-of-00002.renamed.safetensors");
    std::fs::rename(&b, &renamed).unwrap();
    let segs = load_shards(&[(renamed.as_path(), 3..SIZES.len()), (a.as_path(), 0..3)]);
    let f = attach_and_run(&segs);
    assert_eq!(cache_state(&f), CodedCache::Built, "{f:?}");
}

/// Params of `n` f32 elements each, large enough to hold whole pages.
fn big_checkpoint(path: &Path, n: usize, count: usize) -> Vec<Vec<Arc<Param>>> {
    let data: Vec<(String, Vec<u8>)> = (0..count)
        .map(|i| {
            let b = values(7, i, 0, n)
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            (format!("w{i}"), b)
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .map(|(name, b)| {
            (
                name.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![n], b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
    let ckpt = Checkpoint::open(path).unwrap();
    (0..count)
        .map(|i| {
            let name = format!("w{i}");
            vec![Param::from_checkpoint(&ckpt, &name, name.clone(), ParamKind::Parameter).unwrap()]
        })
        .collect()
}

/// Builds a lossless-coded engine with everything streamed and returns its figures.
fn attach_big(segs: &[Vec<Arc<Param>>]) -> StreamingFigures {
    let d = HostDevice::with_capacity(1 << 26).unwrap();
    let schedule: Vec<usize> = (0..segs.len()).collect();
    let dev: Arc<dyn Device> = d.clone();
    let mut engine = StreamingEngine::new(
        dev,
        d.create_stream().unwrap(),
        segs,
        &schedule,
        &StreamingConfig {
            compress: Compression::Lossless,
            ..StreamingConfig::default()
        },
        Arc::new(RouteMetrics::new()),
    )
    .unwrap();
    let f = engine.figures().clone();
    engine.teardown().unwrap();
    f
}

#[test]
fn the_coded_home_is_the_one_host_copy_of_mapped_weights() {
    let dir = TempDir::new();
    let ckpt = dir.0.join("model.safetensors");
    let (n, count) = (64 * 1024, 4);
    let segs = big_checkpoint(&ckpt, n, count);
    let sums: Vec<u64> = segs.iter().map(|s| s[0].host_checksum()).collect();
    let f = attach_big(&segs);
    // Every whole page of the streamed params is released from the process (at most one
    // partial page at each end of a param is kept).
    let payload = (n * 4 * count) as u64;
    assert!(
        f.host_bytes_released <= payload
            && f.host_bytes_released >= payload - 2 * 4096 * count as u64,
        "released {} of {payload}",
        f.host_bytes_released
    );
    // The params still read the checkpoint's bytes, and point into its mapping.
    for (s, want) in segs.iter().zip(&sums) {
        assert!(s[0].is_checkpoint_backed());
        assert_eq!(s[0].host_checksum(), *want);
    }
    // A second attach (from the cache) reads none of them and leaves none in the process.
    let g = attach_big(&segs);
    assert_eq!(cache_state(&g), CodedCache::Used);
    assert_eq!(g.host_bytes_released, f.host_bytes_released);

    // Weights made in memory keep their pages: releasing them would lose them.
    let owned: Vec<Vec<Arc<Param>>> = (0..count)
        .map(|i| {
            vec![
                Param::from_f32(
                    format!("w{i}"),
                    ParamKind::Parameter,
                    DType::F32,
                    vec![n],
                    &values(7, i, 0, n),
                )
                .unwrap(),
            ]
        })
        .collect();
    let sums: Vec<u64> = owned.iter().map(|s| s[0].host_checksum()).collect();
    let f = attach_big(&owned);
    assert_eq!(f.host_bytes_released, 0);
    for (s, want) in owned.iter().zip(&sums) {
        assert_eq!(s[0].host_checksum(), *want);
    }
}

/// [`attach_and_run`] on a thread of its own: fails, instead of hanging the test run, when
/// the attach has not returned within a minute (a FIFO opened for reading waits for a
/// writer forever).
fn attach_within_a_minute(segs: &[Vec<Arc<Param>>]) -> StreamingFigures {
    let segs = segs.to_vec();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(attach_and_run(&segs));
    });
    match rx.recv_timeout(std::time::Duration::from_secs(60)) {
        Ok(f) => f,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("the attach blocked on what is at the cache path")
        }
        Err(e) => panic!("the attach failed (its panic is printed above): {e}"),
    }
}

fn note(f: &StreamingFigures) -> String {
    f.coded_cache_note.clone().unwrap_or_default()
}

fn is_link(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_symlink())
}

/// Issue 34: a shard of the checkpoint named `<first shard>.ddo-coded` (the cache's name)
/// was coded over, destroying the checkpoint. The cache path is never an input.
#[test]
fn a_shard_at_the_cache_name_is_never_written() {
    let dir = TempDir::new();
    let a = dir.0.join("w.safetensors");
    let b = coded_cache_path(&a);
    assert_eq!(b, dir.0.join("w.safetensors.ddo-coded"));
    write_shard(&a, 1, 0..3);
    write_shard(&b, 1, 3..SIZES.len());
    let (bytes_a, bytes_b) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    let segs = load_shards(&[(a.as_path(), 0..3), (b.as_path(), 3..SIZES.len())]);
    for _ in 0..2 {
        let f = attach_and_run(&segs);
        assert_eq!(cache_state(&f), CodedCache::Unavailable, "{f:?}");
        assert!(note(&f).contains("is the checkpoint file"), "{}", note(&f));
        assert_eq!(std::fs::read(&b).unwrap(), bytes_b, "the shard was written");
        assert_eq!(std::fs::read(&a).unwrap(), bytes_a);
    }
    assert_eq!(std::fs::read_dir(&dir.0).unwrap().count(), 2);
}

/// A symbolic or hard link to the checkpoint at the cache name is the checkpoint: left as
/// it is, never replaced by a cache.
#[cfg(unix)]
#[test]
fn a_link_to_the_checkpoint_at_the_cache_name_is_left_alone() {
    use std::os::unix::fs::MetadataExt;
    let dir = TempDir::new();
    let ckpt = dir.0.join("model.safetensors");
    write_checkpoint(&ckpt, 1);
    let bytes = std::fs::read(&ckpt).unwrap();
    let cache = coded_cache_path(&ckpt);
    let segs = load(&ckpt);
    for hard in [false, true] {
        let _ = std::fs::remove_file(&cache);
        if hard {
            std::fs::hard_link(&ckpt, &cache).unwrap();
        } else {
            std::os::unix::fs::symlink(&ckpt, &cache).unwrap();
        }
        let f = attach_and_run(&segs);
        assert_eq!(
            cache_state(&f),
            CodedCache::Unavailable,
            "hard {hard}: {f:?}"
        );
        assert!(note(&f).contains("is the checkpoint file"), "{}", note(&f));
        assert_eq!(is_link(&cache), !hard);
        assert_eq!(
            std::fs::metadata(&cache).unwrap().ino(),
            std::fs::metadata(&ckpt).unwrap().ino()
        );
        assert_eq!(std::fs::read(&ckpt).unwrap(), bytes);
    }
}

/// A user's file (writable or read-only) at the cache name is not a DDO cache: left as it
/// is, the units coded without the cache; a DDO cache made read-only is used while it
/// matches and never replaced once stale.
#[cfg(unix)]
#[test]
fn a_file_that_is_not_a_cache_or_is_read_only_is_left_as_it_is() {
    use std::os::unix::fs::PermissionsExt;
    let dir = TempDir::new();
    let ckpt = dir.0.join("model.safetensors");
    write_checkpoint(&ckpt, 1);
    let cache = coded_cache_path(&ckpt);
    let segs = load(&ckpt);
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    for m in [0o644, 0o444] {
        let _ = std::fs::remove_file(&cache);
        std::fs::write(&cache, b"my own notes").unwrap();
        std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(m)).unwrap();
        let f = attach_and_run(&segs);
        assert_eq!(
            cache_state(&f),
            CodedCache::Unavailable,
            "mode {m:o}: {f:?}"
        );
        assert!(note(&f).contains("not a DDO cache"), "{}", note(&f));
        assert_eq!(std::fs::read(&cache).unwrap(), b"my own notes");
        assert_eq!(mode(&cache), m);
    }
    std::fs::remove_file(&cache).unwrap();
    assert_eq!(cache_state(&attach_and_run(&segs)), CodedCache::Built);
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o444)).unwrap();
    assert_eq!(cache_state(&attach_and_run(&segs)), CodedCache::Used);
    drop(segs);
    write_checkpoint(&ckpt, 2);
    let segs = load(&ckpt);
    let before = std::fs::read(&cache).unwrap();
    let f = attach_and_run(&segs);
    assert_eq!(cache_state(&f), CodedCache::Unavailable, "{f:?}");
    assert!(note(&f).contains("read-only"), "{}", note(&f));
    assert_eq!(std::fs::read(&cache).unwrap(), before);
    // Made writable again, the stale cache is replaced as any stale cache is.
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o644)).unwrap();
    let f = attach_and_run(&segs);
    assert_eq!(cache_state(&f), CodedCache::Built, "{f:?}");
    assert!(note(&f).contains("stale"), "{}", note(&f));
    assert_eq!(cache_state(&attach_and_run(&segs)), CodedCache::Used);
}

/// Issue 34: a FIFO at the cache name (or a symbolic link to one) hung the attach for
/// ever. It is neither opened for a blocking read nor replaced.
#[cfg(unix)]
#[test]
fn a_fifo_at_the_cache_name_does_not_block_the_attach() {
    use std::os::unix::fs::FileTypeExt;
    let dir = TempDir::new();
    let ckpt = dir.0.join("model.safetensors");
    write_checkpoint(&ckpt, 1);
    let cache = coded_cache_path(&ckpt);
    let segs = load(&ckpt);
    let pipe = dir.0.join("pipe");
    for (fifo, link) in [(cache.clone(), false), (pipe.clone(), true)] {
        let _ = std::fs::remove_file(&cache);
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        if link {
            std::os::unix::fs::symlink(&pipe, &cache).unwrap();
        }
        let f = attach_within_a_minute(&segs);
        assert_eq!(cache_state(&f), CodedCache::Unavailable, "{f:?}");
        assert!(note(&f).contains("FIFO"), "{}", note(&f));
        assert_eq!(is_link(&cache), link);
        assert!(std::fs::metadata(&cache).unwrap().file_type().is_fifo());
    }
}

/// Coded units over the pinned limit: the hint names what works with them (a pinned home
/// is what they are, so `low_cpu_mem_usage=true` or `pinned=false`, which compress=lossless
/// refuses, is not offered).
#[test]
fn coded_units_over_the_pinned_limit_get_a_hint_that_works() {
    let dir = TempDir::new();
    let ckpt = dir.0.join("model.safetensors");
    write_checkpoint(&ckpt, 1);
    let segs = load(&ckpt);
    let d = HostDevice::with_capacity(1 << 24).unwrap();
    let dev: Arc<dyn Device> = d.clone();
    let schedule: Vec<usize> = (0..segs.len()).collect();
    let made = StreamingEngine::new(
        dev,
        d.create_stream().unwrap(),
        &segs,
        &schedule,
        &StreamingConfig {
            unit_bytes: 4096,
            pinned_limit: 4096,
            compress: Compression::Lossless,
            ..StreamingConfig::default()
        },
        Arc::new(RouteMetrics::new()),
    );
    let Err(e) = made else {
        panic!("the coded units fit under a 4 KiB pinned limit");
    };
    let said = e.to_string();
    assert!(
        said.contains("pinned_limit") && said.contains("compress=none"),
        "{said}"
    );
    assert!(
        !said.contains("low_cpu_mem_usage") && !said.contains("pinned=false"),
        "{said}"
    );
    assert_eq!(d.memory_info().pinned_host, 0);
}
