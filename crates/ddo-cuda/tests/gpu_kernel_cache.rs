//! GPU test of the kernel-image cache: `prepare_kernels` returns at once and compiles every
//! kernel source in the background, the first ops find (or wait for) those images, the disk
//! cache gets one cubin file per source, and once the memory cache is forgotten a new
//! device loads its kernels from disk without compiling.
//!
//! The disk cache's directory is read once per process, so the test runs its body in a
//! child process (this binary again) with `DDO_KERNEL_CACHE` set to a fresh directory.
//! Without a driver or a device it prints "skipped: no CUDA device" and passes (unless
//! `DDO_REQUIRE_GPU=1`), like `tests/gpu.rs`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use ddo_core::{DType, Ops, UnaryOp};
use ddo_cuda::{CudaDevice, KernelCacheStats};

mod common;

/// Set in the child process that runs the test's body.
const CHILD: &str = "DDO_KERNEL_CACHE_TEST_CHILD";
const TEST: &str = "kernels_are_prepared_in_the_background_and_cached_on_disk";

#[test]
fn kernels_are_prepared_in_the_background_and_cached_on_disk() {
    if std::env::var_os(CHILD).is_some() {
        child();
        return;
    }
    if common::open_gpu(false).is_none() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("ddo-gpu-kernel-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(std::env::current_exe().unwrap())
        .args([TEST, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .env("DDO_KERNEL_CACHE", &dir)
        .output()
        .unwrap();
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "the child failed: {}", out.status);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("kernel cache: checked"),
        "the child ran no checks"
    );
}

/// The number of kernel sources: one per `kernels/*.cu`.
fn source_count() -> u64 {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter(|e| {
                e.as_ref()
                    .is_ok_and(|e| e.path().extension().is_some_and(|x| x == "cu"))
            })
            .count() as u64
        })
        // A bundle run away from the source tree: the five sources of today.
        .unwrap_or(5)
}

/// The finished image files of the cache (no temporary files).
fn image_files(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| !p.to_string_lossy().ends_with(".tmp"))
        .collect();
    files.sort();
    files
}

/// Silu and a softmax (the element-wise and normalisation sources) on `dev`, checked.
fn run_ops(dev: &CudaDevice) {
    let x = dev
        .tensor_from_f32(&[2, 3], DType::F32, &[1.0, 2.0, 3.0, -1.0, 0.0, 1.0])
        .unwrap();
    let silu = dev
        .to_f32_vec(&dev.unary(&x, UnaryOp::Silu).unwrap())
        .unwrap();
    let softmax = dev.to_f32_vec(&dev.softmax(&x).unwrap()).unwrap();
    let e = |v: f32| v.exp();
    let want_silu: Vec<f32> = [1.0f32, 2.0, 3.0, -1.0, 0.0, 1.0]
        .iter()
        .map(|&v| v / (1.0 + e(-v)))
        .collect();
    let row = |a: f32, b: f32, c: f32| {
        let s = e(a) + e(b) + e(c);
        [e(a) / s, e(b) / s, e(c) / s]
    };
    let want_softmax: Vec<f32> = [row(1.0, 2.0, 3.0), row(-1.0, 0.0, 1.0)].concat();
    for (got, want) in [(&silu, &want_silu), (&softmax, &want_softmax)] {
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-5, "{got:?} vs {want:?}");
        }
    }
}

/// Polls until `done` or `limit` passes.
fn wait_for(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < limit {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    done()
}

fn child() {
    let dir = PathBuf::from(std::env::var_os("DDO_KERNEL_CACHE").unwrap());
    assert_eq!(ddo_cuda::kernel_cache_dir(), Some(dir.clone()));
    assert!(image_files(&dir).is_empty(), "a fresh directory");
    let sources = source_count();
    // `cuInit` first, so the timing below is the warm-up's own.
    ddo_cuda::device_count().unwrap();

    let start = Instant::now();
    ddo_cuda::prepare_kernels(0).unwrap();
    let returned = start.elapsed();
    ddo_cuda::prepare_kernels(0).unwrap(); // a second call starts nothing
    println!("prepare_kernels returned in {returned:?}");
    assert!(returned < Duration::from_millis(500), "{returned:?}");

    let dev = common::open_gpu(false).unwrap();
    let t = Instant::now();
    run_ops(&dev);
    println!("first ops (waiting for the warm-up) took {:?}", t.elapsed());
    assert!(
        wait_for(Duration::from_secs(120), || image_files(&dir).len() as u64
            == sources),
        "expected {sources} image files, found {:?}",
        image_files(&dir)
    );
    let after_warm_up = ddo_cuda::kernel_cache_stats();
    println!(
        "every source compiled and written {:?} after prepare_kernels: {after_warm_up:?}",
        start.elapsed()
    );
    let files = image_files(&dir);
    println!("cache files: {files:?}");
    assert!(
        files
            .iter()
            .all(|f| f.extension().is_some_and(|x| x == "cubin")),
        "every image is a cubin: {files:?}"
    );
    assert_eq!(after_warm_up.compiled, sources, "each source compiled once");
    assert_eq!(after_warm_up.written, sources);
    assert_eq!(after_warm_up.from_disk, 0);

    // The memory cache forgotten, a new device: its kernels come from disk.
    ddo_cuda::forget_kernel_images();
    drop(dev);
    let dev = common::open_gpu(false).unwrap();
    let t = Instant::now();
    run_ops(&dev);
    println!("ops from the disk cache took {:?}", t.elapsed());
    let from_disk = ddo_cuda::kernel_cache_stats();
    println!("after the disk loads: {from_disk:?}");
    assert_eq!(from_disk.compiled, sources, "nothing compiled again");
    assert!(from_disk.from_disk >= 2, "{from_disk:?}");

    // A warm-up over a full disk cache reads every source and compiles none.
    ddo_cuda::forget_kernel_images();
    ddo_cuda::prepare_kernels(0).unwrap();
    let want = from_disk.from_disk + sources;
    assert!(
        wait_for(Duration::from_secs(30), || ddo_cuda::kernel_cache_stats()
            .from_disk
            == want),
        "{:?}",
        ddo_cuda::kernel_cache_stats()
    );
    let last: KernelCacheStats = ddo_cuda::kernel_cache_stats();
    assert_eq!(last.compiled, sources);
    assert_eq!(image_files(&dir).len() as u64, sources);
    println!("kernel cache: checked ({last:?})");
}
