//! GPU tests of the pool on the real driver ([`CudaPhysicalMemory`]), mirroring the sequence
//! seen on the H200 (reserve → create → map → set access → use → unmap → release → address
//! free). Each asks [`gpu`] for device 0 first: without the driver library or a device it
//! prints "skipped: no CUDA device" and passes (unless `DDO_REQUIRE_GPU=1`), so CPU-only CI
//! runs them harmlessly. Run them one at a time (`--test-threads=1`): they read the
//! driver's free-memory figure.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, result};
use ddo_core::CoreError;
use ddo_vmm::{
    CudaPhysicalMemory, PhysicalMemory, QuiescenceGate, VmmError, VmmPool, VmmPoolConfig,
    library_present,
};

const MIB: u64 = 1 << 20;

/// Device 0, or `None` (after saying so) when there is no driver library or no device.
/// With `DDO_REQUIRE_GPU=1` a missing device fails the test instead.
fn gpu() -> Option<CudaPhysicalMemory> {
    match CudaPhysicalMemory::new(0) {
        Ok(p) => Some(p),
        Err(e @ (VmmError::NoLibrary | VmmError::NoDevice { .. })) => {
            if std::env::var_os("DDO_REQUIRE_GPU").is_some_and(|v| v == "1") {
                panic!("DDO_REQUIRE_GPU=1 but there is no usable CUDA device: {e}");
            }
            println!("skipped: no CUDA device");
            None
        }
        Err(e) => panic!("a CUDA driver is present but device 0 failed: {e}"),
    }
}

fn pattern(len: u64, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ ((i >> 12) as u8))
        .collect()
}

/// Copies `bytes` to device address `va` and waits for the copy.
fn write(ctx: &CudaContext, va: u64, bytes: &[u8]) {
    ctx.bind_to_thread().unwrap();
    // SAFETY: every caller passes a range inside a live pool allocation, which the pool has
    // mapped with read-write access before returning it; `bytes` is a valid host slice and
    // the copy is synchronous, so nothing outlives the call.
    unsafe { result::memcpy_htod_sync(va, bytes) }.unwrap();
}

/// Copies `len` bytes from device address `va` back to the host.
fn read(ctx: &CudaContext, va: u64, len: u64) -> Vec<u8> {
    ctx.bind_to_thread().unwrap();
    let mut out = vec![0u8; len as usize];
    // SAFETY: as in `write`: the range lies in a live, mapped, accessible allocation; `out`
    // is an exclusively borrowed host buffer of `len` bytes and the copy is synchronous.
    unsafe { result::memcpy_dtoh_sync(&mut out, va) }.unwrap();
    out
}

fn driver_free(ctx: &CudaContext) -> u64 {
    ctx.mem_get_info().unwrap().0 as u64
}

#[test]
fn no_driver_is_a_typed_error_not_a_panic() {
    if library_present() {
        println!("skipped: a CUDA driver library is present (this test covers its absence)");
        return;
    }
    let err = CudaPhysicalMemory::new(0).unwrap_err();
    assert!(matches!(err, VmmError::NoLibrary), "{err}");
    assert!(err.to_string().contains("LD_LIBRARY_PATH"), "{err}");
    assert!(matches!(CoreError::from(err), CoreError::Backend { .. }));
}

#[test]
fn reserve_grow_free_and_release_returns_the_bytes_to_the_driver() {
    let Some(phys) = gpu() else { return };
    let ctx = Arc::clone(phys.context());
    let g = phys.granularity();
    println!("cuda:{}: allocation granularity {g} B", phys.ordinal());
    assert!(g.is_power_of_two() && g.is_multiple_of(512), "{g}");
    let pool = VmmPool::new(phys, VmmPoolConfig::new("cuda:0").with_capacity(1 << 30)).unwrap();
    assert_eq!(pool.range().len, 1 << 30);
    let t = Instant::now();

    // Allocate, fill, grow in place: same address, first bytes intact.
    let a = pool.alloc(100 * MIB + 123).unwrap();
    let head = pattern(a.len(), 1);
    write(&ctx, a.va(), &head);
    let a = pool.grow(&a, 300 * MIB).unwrap();
    assert_eq!(read(&ctx, a.va(), head.len() as u64), head);
    let tail = pattern(a.len() - head.len() as u64, 2);
    write(&ctx, a.va() + head.len() as u64, &tail);
    assert_eq!(
        read(&ctx, a.va() + head.len() as u64, tail.len() as u64),
        tail
    );

    // A neighbour blocks further growth: a typed error, nothing moved.
    let b = pool.alloc(64 * MIB).unwrap();
    write(&ctx, b.va(), &pattern(b.len(), 3));
    match pool.grow(&a, 600 * MIB) {
        Err(VmmError::GrowBlocked { blocked_at, .. }) => assert_eq!(blocked_at, b.va()),
        other => panic!("{other:?}"),
    }

    // Growth within reserved room, up to its last byte.
    let c = pool.alloc_growable(10 * MIB, 200 * MIB).unwrap();
    let c = pool.grow(&c, 200 * MIB).unwrap();
    write(&ctx, c.end() - 4096, &[7u8; 4096]);
    assert_eq!(read(&ctx, c.end() - 4096, 4096), vec![7u8; 4096]);
    assert_eq!(read(&ctx, b.va(), b.len()), pattern(b.len(), 3));

    let s = pool.stats();
    println!("after alloc/grow ({:?}): {s:?}", t.elapsed());
    assert_eq!(s.live, 564 * MIB);
    assert_eq!(s.mapped, s.mapped_chunks * g);
    assert!(s.live <= s.mapped && s.mapped <= s.live + 3 * g, "{s:?}");

    pool.free(&a).unwrap();
    pool.free(&b).unwrap();
    pool.free(&c).unwrap();
    let mapped = pool.stats().mapped;
    assert_eq!(pool.idle_bytes(), mapped);

    let gate = QuiescenceGate::after_synchronize(|| ctx.synchronize()).unwrap();
    let before = driver_free(&ctx);
    let t = Instant::now();
    let r = pool.release_idle(&gate).unwrap();
    let after = driver_free(&ctx);
    println!(
        "release_idle: {} chunks, {} B in {:?}; driver free {before} -> {after} (+{}); report {r:?}",
        r.chunks,
        r.bytes,
        t.elapsed(),
        after as i128 - before as i128
    );
    assert_eq!(r.bytes, mapped);
    assert_eq!(r.chunks * g, mapped);
    assert_eq!(r.driver_confirms(), Some(true), "{r:?}");
    assert!(
        after - before >= r.bytes,
        "driver free rose by {}",
        after - before
    );
    let s = pool.stats();
    assert_eq!((s.mapped, s.live, s.orphaned_chunks), (0, 0, 0));
    assert_eq!(s.chunks_released, s.chunks_created);
    pool.close().unwrap();
}

#[test]
fn release_keeps_live_bytes_and_returns_only_idle_pages() {
    let Some(_probe) = gpu() else { return };
    drop(_probe);
    let ctx = CudaContext::new(0).unwrap();
    let phys = CudaPhysicalMemory::from_context(Arc::clone(&ctx)).unwrap();
    let g = phys.granularity();
    let pool = VmmPool::new(phys, VmmPoolConfig::new("cuda:0").with_capacity(64 * g)).unwrap();
    // a: page 0; b: pages 0-3; c: pages 3-4.
    let a = pool.alloc(g / 2).unwrap();
    let b = pool.alloc(3 * g).unwrap();
    let c = pool.alloc(g).unwrap();
    for (x, seed) in [(&a, 11), (&b, 12), (&c, 13)] {
        write(&ctx, x.va(), &pattern(x.len(), seed));
    }
    assert_eq!(pool.stats().mapped, 5 * g);
    pool.free(&b).unwrap();
    assert_eq!(pool.idle_bytes(), 2 * g, "pages 1 and 2 hold no live byte");
    let gate = QuiescenceGate::after_synchronize(|| ctx.synchronize()).unwrap();
    let r = pool.release_idle(&gate).unwrap();
    println!("{r:?}");
    assert_eq!((r.chunks, r.bytes), (2, 2 * g));
    assert_eq!(r.driver_confirms(), Some(true), "{r:?}");
    // Live bytes on pages shared with the released range are intact and usable.
    assert_eq!(read(&ctx, a.va(), a.len()), pattern(a.len(), 11));
    assert_eq!(read(&ctx, c.va(), c.len()), pattern(c.len(), 13));
    // The released pages map again for a new allocation there.
    let d = pool.alloc(3 * g).unwrap();
    assert_eq!(d.va(), b.va());
    write(&ctx, d.va(), &pattern(d.len(), 14));
    assert_eq!(read(&ctx, d.va(), d.len()), pattern(d.len(), 14));
    // A busy gate is refused.
    assert!(matches!(
        pool.release_idle(&QuiescenceGate::busy("test: pretend a copy is in flight")),
        Err(VmmError::NotQuiescent { .. })
    ));
    for x in [&a, &c, &d] {
        pool.free(x).unwrap();
    }
    let gate = QuiescenceGate::after_synchronize(|| ctx.synchronize()).unwrap();
    assert_eq!(pool.release_idle(&gate).unwrap().bytes, 5 * g);
    pool.close().unwrap();
}

#[test]
fn out_of_device_memory_is_typed_and_rolls_back() {
    let Some(phys) = gpu() else { return };
    let ctx = Arc::clone(phys.context());
    let (_, total) = phys.mem_info().unwrap();
    let g = phys.granularity();
    // Address space costs nothing: reserve more than the device has.
    let pool = VmmPool::new(phys, VmmPoolConfig::new("cuda:0").with_capacity(2 * total)).unwrap();
    let free_before = driver_free(&ctx);
    let t = Instant::now();
    let err = pool.alloc(total + g).unwrap_err();
    println!("alloc past the device: {err} ({:?})", t.elapsed());
    assert!(matches!(err, VmmError::OutOfMemory { .. }), "{err}");
    assert!(matches!(
        err.into_core("cuda:0"),
        CoreError::OutOfMemory { .. }
    ));
    let s = pool.stats();
    assert_eq!((s.mapped, s.live, s.orphaned_chunks), (0, 0, 0), "{s:?}");
    assert_eq!(s.chunks_created, s.chunks_released);
    let free_after = driver_free(&ctx);
    println!("driver free {free_before} -> {free_after}");
    assert!(
        free_after + 64 * MIB >= free_before,
        "the rollback returned the chunks"
    );
    // The pool works on.
    let a = pool.alloc(g).unwrap();
    pool.free(&a).unwrap();
    pool.close().unwrap();
}

#[test]
fn mapping_costs_are_printed() {
    let Some(phys) = gpu() else { return };
    let ctx = Arc::clone(phys.context());
    let g = phys.granularity();
    let pool = VmmPool::new(phys, VmmPoolConfig::new("cuda:0").with_capacity(4 << 30)).unwrap();
    let t = Instant::now();
    let a = pool.alloc(1 << 30).unwrap();
    let fresh = t.elapsed();
    pool.free(&a).unwrap();
    let t = Instant::now();
    let a = pool.alloc(1 << 30).unwrap();
    let cached = t.elapsed();
    pool.free(&a).unwrap();
    let t = Instant::now();
    let small: Vec<_> = (0..1000)
        .map(|i| pool.alloc(4096 + i * 512).unwrap())
        .collect();
    let thousand = t.elapsed();
    for s in &small {
        pool.free(s).unwrap();
    }
    let gate = QuiescenceGate::after_synchronize(|| ctx.synchronize()).unwrap();
    let t = Instant::now();
    let r = pool.release_idle(&gate).unwrap();
    let release = t.elapsed();
    println!(
        "1 GiB alloc mapping {} chunks of {g} B: {fresh:?}; same alloc from the cache: {cached:?}; \
         1000 small allocs (cached pages): {thousand:?}; release of {} chunks: {release:?}",
        (1u64 << 30) / g,
        r.chunks
    );
    assert_eq!(r.bytes, 1 << 30);
    pool.close().unwrap();
}
