//! The coded-unit cache beside a checkpoint (`compress=lossless`, issue 20) on the host
//! backend: the first attach codes and writes `<checkpoint>.ddo-coded`, the second reads it
//! (the figures say so), a corrupted cache is detected and rebuilt, a checkpoint changed in
//! place (same size, same modification time, other bytes) is detected as stale, weights
//! that are not mapped from a file never use a cache, and every forward reads exactly the
//! checkpoint's bytes.

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
    let want: Vec<Vec<u8>> = schedule
        .iter()
        .map(|&s| segs[s].iter().flat_map(|p| p.host().to_vec()).collect())
        .collect();
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

#[test]
fn a_checkpoint_changed_in_place_is_stale() {
    let dir = TempDir::new();
    let ckpt = dir.0.join("model.safetensors");
    write_checkpoint(&ckpt, 1);
    let segs = load(&ckpt);
    assert_eq!(cache_state(&attach_and_run(&segs)), CodedCache::Built);
    assert_eq!(cache_state(&attach_and_run(&segs)), CodedCache::Used);
    let size = std::fs::metadata(&ckpt).unwrap().len();
    let mtime = std::fs::metadata(&ckpt).unwrap().modified().unwrap();
    drop(segs);

    // Other bytes, the same size, the same modification time: only the content hash sees it.
    write_checkpoint(&ckpt, 2);
    std::fs::File::options()
        .write(true)
        .open(&ckpt)
        .unwrap()
        .set_modified(mtime)
        .unwrap();
    assert_eq!(std::fs::metadata(&ckpt).unwrap().len(), size);
    assert_eq!(std::fs::metadata(&ckpt).unwrap().modified().unwrap(), mtime);
    let segs = load(&ckpt);
    let f = attach_and_run(&segs);
    assert_eq!(cache_state(&f), CodedCache::Built, "{f:?}");
    let note = f.coded_cache_note.clone().unwrap_or_default();
    assert!(note.contains("stale"), "{note}");
    assert_eq!(cache_state(&attach_and_run(&segs)), CodedCache::Used);
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
    // A second attach (from the cache) releases them too.
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
