//! Unit tests of [`VmmPool`] over the fake: placement and packing, growth in place and when
//! blocked, fragmentation, release of exactly the idle pages, the quiescence gate, typed
//! errors for bad input, rollback after injected failures, teardown, and error conversion.

use std::sync::Arc;

use ddo_core::CoreError;
use ddo_vmm::{
    FakeOp, FakePhysicalMemory, PhysicalMemory, PoolAllocation, QuiescenceGate, VmmError, VmmPool,
    VmmPoolConfig,
};

/// Fake granularity: small, so tests touch many pages cheaply.
const G: u64 = 4096;

type Pool = VmmPool<Arc<FakePhysicalMemory>>;

/// A pool of `range_pages` pages over a fake device of `phys_pages` pages.
fn pool(range_pages: u64, phys_pages: u64) -> (Arc<FakePhysicalMemory>, Pool) {
    let fake = Arc::new(FakePhysicalMemory::new(G, phys_pages * G));
    let pool = VmmPool::new(
        Arc::clone(&fake),
        VmmPoolConfig::new("fake:0").with_capacity(range_pages * G),
    )
    .unwrap();
    (fake, pool)
}

fn quiet() -> QuiescenceGate {
    QuiescenceGate::quiescent("tests: no streams exist")
}

fn pattern(a: &PoolAllocation, from: u64, to: u64) -> Vec<u8> {
    (from..to)
        .map(|i| (a.id() as u8).wrapping_mul(29) ^ (i as u8).wrapping_mul(7) ^ (i >> 9) as u8)
        .collect()
}

fn fill(fake: &FakePhysicalMemory, a: &PoolAllocation, from: u64) {
    fake.write(a.va() + from, &pattern(a, from, a.len()))
        .unwrap();
}

fn intact(fake: &FakePhysicalMemory, a: &PoolAllocation) -> bool {
    fake.read(a.va(), a.len()).unwrap() == pattern(a, 0, a.len())
}

/// The fake's mappings as page indices of the pool's range.
fn mapped_pages(fake: &FakePhysicalMemory, pool: &Pool) -> Vec<u64> {
    fake.mappings()
        .into_iter()
        .map(|(va, bytes, _)| {
            assert_eq!(bytes, G, "the pool maps one chunk per page");
            (va - pool.range().base) / G
        })
        .collect()
}

#[test]
fn allocations_pack_from_the_start_and_map_only_touched_pages() {
    let (fake, pool) = pool(64, 64);
    let base = pool.range().base;
    let a = pool.alloc(100).unwrap();
    assert_eq!(a.va(), base);
    assert_eq!(pool.stats().mapped, G);
    let b = pool.alloc(5000).unwrap();
    assert_eq!(b.va(), base + 512, "rounded to 512 B and packed");
    assert_eq!(mapped_pages(&fake, &pool), vec![0, 1]);
    let s = pool.stats();
    assert_eq!((s.live, s.mapped, s.va_in_use), (5100, 2 * G, 512 + 5120));
    assert_eq!(s.live_allocations, 2);
    assert_eq!(s.chunks_mapped, 2);
    // Zero-byte allocations get their own address.
    let z1 = pool.alloc(0).unwrap();
    let z2 = pool.alloc(0).unwrap();
    assert_ne!(z1.va(), z2.va());
    assert!(z1.is_empty());
    assert_eq!(z1.va() % 512, 0);
}

#[test]
fn grow_in_place_keeps_the_address_and_the_contents() {
    let (fake, pool) = pool(64, 64);
    let a = pool.alloc(G).unwrap();
    fill(&fake, &a, 0);
    let grown = pool.grow(&a, 3 * G + 100).unwrap();
    assert_eq!(
        (grown.va(), grown.id(), grown.len()),
        (a.va(), a.id(), 3 * G + 100)
    );
    assert_eq!(
        fake.read(a.va(), a.len()).unwrap(),
        pattern(&a, 0, a.len()),
        "bytes written before the growth are intact"
    );
    fill(&fake, &grown, a.len());
    assert!(intact(&fake, &grown));
    assert_eq!(pool.stats().mapped, 4 * G);
    assert_eq!(pool.stats().live, 3 * G + 100);
    // Growing to the same length is a no-op; shrinking is refused.
    assert_eq!(pool.grow(&grown, grown.len()).unwrap(), grown);
    assert!(matches!(
        pool.grow(&grown, 10),
        Err(VmmError::CannotShrink { requested: 10, .. })
    ));
    // A stale copy (the pre-growth length) still names the allocation; its free frees all.
    pool.free(&a).unwrap();
    assert_eq!(pool.stats().live, 0);
    assert_eq!(pool.stats().va_in_use, 0);
}

#[test]
fn grow_is_refused_with_a_typed_error_when_the_next_range_is_taken() {
    let (fake, pool) = pool(64, 64);
    let a = pool.alloc(1000).unwrap();
    let b = pool.alloc(1000).unwrap();
    fill(&fake, &a, 0);
    let before = pool.stats();
    let err = pool.grow(&a, 5000).unwrap_err();
    match &err {
        VmmError::GrowBlocked {
            va,
            len,
            requested,
            blocked_at,
        } => {
            assert_eq!(
                (*va, *len, *requested, *blocked_at),
                (a.va(), 1000, 5000, b.va())
            );
        }
        other => panic!("{other}"),
    }
    assert!(err.to_string().contains("allocate a new buffer"), "{err}");
    assert_eq!(pool.stats(), before, "a refused growth changes nothing");
    assert!(intact(&fake, &a));
    // Within the rounding, growth needs no free range.
    let a = pool.grow(&a, 1024).unwrap();
    assert_eq!(a.len(), 1024);
    // Once the neighbour is gone, the growth goes through.
    pool.free(&b).unwrap();
    let a = pool.grow(&a, 5000).unwrap();
    assert_eq!(a.len(), 5000);
}

#[test]
fn alloc_growable_holds_room_that_others_do_not_take() {
    let (_fake, pool) = pool(64, 64);
    let a = pool.alloc_growable(1000, 10 * G).unwrap();
    assert_eq!(pool.stats().mapped, G, "room is address space only");
    assert_eq!(pool.stats().va_in_use, 10 * G);
    let b = pool.alloc(1000).unwrap();
    assert!(b.va() >= a.va() + 10 * G, "{b:?} landed in {a:?}'s room");
    let a = pool.grow(&a, 10 * G).unwrap();
    assert_eq!(pool.stats().mapped, 11 * G);
    assert!(matches!(
        pool.grow(&a, 10 * G + 1),
        Err(VmmError::GrowBlocked { blocked_at, .. }) if blocked_at == b.va()
    ));
}

#[test]
fn freed_ranges_stay_mapped_and_are_refilled_best_fit_before_the_tail() {
    let (fake, pool) = pool(64, 64);
    let allocs: Vec<_> = (0..8).map(|_| pool.alloc(G).unwrap()).collect();
    for a in allocs.iter().step_by(2) {
        pool.free(a).unwrap();
    }
    // Four holes of one page each, all still mapped: the pool's cache.
    assert_eq!(pool.stats().mapped, 8 * G);
    assert_eq!(pool.idle_bytes(), 4 * G);
    let mapped = pool.stats().chunks_mapped;
    // A two-page request fits no hole: it goes to the tail and maps two new pages.
    let big = pool.alloc(2 * G).unwrap();
    assert_eq!(big.va(), allocs[7].va() + G);
    assert_eq!(pool.stats().chunks_mapped, mapped + 2);
    // A one-page request takes the lowest hole and maps nothing.
    let small = pool.alloc(G).unwrap();
    assert_eq!(small.va(), allocs[0].va());
    assert_eq!(pool.stats().chunks_mapped, mapped + 2);
    // A small request takes the smallest run that fits, a hole, not the tail.
    let tiny = pool.alloc(10).unwrap();
    assert_eq!(tiny.va(), allocs[2].va());
    // Release returns the two holes left untouched (pages 4 and 6), nothing else.
    let r = pool.release_idle(&quiet()).unwrap();
    assert_eq!((r.chunks, r.bytes), (2, 2 * G));
    let pages = mapped_pages(&fake, &pool);
    assert!(!pages.contains(&4) && !pages.contains(&6), "{pages:?}");
    assert_eq!(pages.len(), 8);
}

#[test]
fn a_fragmented_range_is_a_typed_error_naming_the_largest_free_run() {
    let (_fake, pool) = pool(8, 64);
    let allocs: Vec<_> = (0..8).map(|_| pool.alloc(G).unwrap()).collect();
    for a in allocs.iter().step_by(2) {
        pool.free(a).unwrap();
    }
    let err = pool.alloc(2 * G).unwrap_err();
    assert!(
        matches!(
            err,
            VmmError::AddressSpaceExhausted {
                requested,
                capacity,
                in_use,
                largest_free,
                ..
            } if requested == 2 * G && capacity == 8 * G && in_use == 4 * G && largest_free == G
        ),
        "{err}"
    );
    assert!(err.to_string().contains("larger capacity"), "{err}");
    // A request past u64 is the same error, not a panic.
    assert!(matches!(
        pool.alloc(u64::MAX),
        Err(VmmError::AddressSpaceExhausted { .. })
    ));
    assert!(matches!(
        pool.alloc_growable(1, u64::MAX - 3),
        Err(VmmError::AddressSpaceExhausted { .. })
    ));
}

#[test]
fn release_returns_exactly_the_pages_without_a_live_byte() {
    let (fake, pool) = pool(64, 64);
    // a: 0..2048 (page 0); b: 2048..10240 (pages 0-2); c: 10240..14336 (pages 2-3).
    let a = pool.alloc(2048).unwrap();
    let b = pool.alloc(8192).unwrap();
    let c = pool.alloc(4096).unwrap();
    for x in [&a, &b, &c] {
        fill(&fake, x, 0);
    }
    assert_eq!(mapped_pages(&fake, &pool), vec![0, 1, 2, 3]);
    pool.free(&b).unwrap();
    assert_eq!(pool.idle_bytes(), G, "only page 1 holds no live byte");
    let free_before = fake.mem_info().unwrap().0;
    let r = pool.release_idle(&quiet()).unwrap();
    assert_eq!((r.chunks, r.bytes, r.orphans), (1, G, 0));
    assert_eq!(r.driver_free_before, Some(free_before));
    assert_eq!(r.driver_rise(), Some(G));
    assert_eq!(r.driver_confirms(), Some(true));
    assert_eq!(r.basis, "tests: no streams exist");
    assert_eq!(mapped_pages(&fake, &pool), vec![0, 2, 3]);
    assert!(intact(&fake, &a) && intact(&fake, &c));
    // Nothing idle: a second release returns nothing.
    let r = pool.release_idle(&quiet()).unwrap();
    assert_eq!((r.chunks, r.bytes), (0, 0));
    // A new allocation over the released page maps it again.
    let d = pool.alloc(8192).unwrap();
    assert_eq!(d.va(), b.va());
    assert_eq!(mapped_pages(&fake, &pool), vec![0, 1, 2, 3]);
    let s = pool.stats();
    assert_eq!(
        (s.chunks_mapped, s.chunks_released, s.bytes_released),
        (5, 1, G)
    );
}

#[test]
fn release_is_refused_without_quiescence_and_changes_nothing() {
    let (fake, pool) = pool(64, 64);
    let a = pool.alloc(3 * G).unwrap();
    pool.free(&a).unwrap();
    let before = (pool.stats(), fake.mappings());
    let err = pool
        .release_idle(&QuiescenceGate::busy("2 streams have queued work"))
        .unwrap_err();
    assert!(
        matches!(&err, VmmError::NotQuiescent { what } if what == "2 streams have queued work"),
        "{err}"
    );
    assert!(
        err.to_string().contains("synchronise every stream"),
        "{err}"
    );
    assert_eq!((pool.stats(), fake.mappings()), before);
    // The gate built from a successful synchronisation lets it through; a failed one is
    // the synchronisation's error.
    let gate = QuiescenceGate::after_synchronize(|| Ok::<(), String>(())).unwrap();
    assert!(gate.is_quiescent());
    assert!(QuiescenceGate::after_synchronize(|| Err("sticky error".to_string())).is_err());
    assert_eq!(pool.release_idle(&gate).unwrap().chunks, 3);
}

#[test]
fn bad_frees_are_typed_errors_never_wrong_frees() {
    let (_fake, pool) = pool(64, 64);
    let a = pool.alloc(1000).unwrap();
    pool.free(&a).unwrap();
    assert!(matches!(
        pool.free(&a),
        Err(VmmError::UnknownAllocation { id, va }) if id == a.id() && va == a.va()
    ));
    // The address is reused by a new allocation: the stale handle still cannot free it.
    let b = pool.alloc(1000).unwrap();
    assert_eq!(b.va(), a.va());
    assert!(matches!(
        pool.free(&a),
        Err(VmmError::UnknownAllocation { .. })
    ));
    assert!(matches!(
        pool.grow(&a, 5000),
        Err(VmmError::UnknownAllocation { .. })
    ));
    assert_eq!(pool.live_allocations(), vec![b]);
    // An allocation of another pool.
    let (_f2, other) = self::pool(64, 64);
    let foreign = other.alloc(10).unwrap();
    assert!(matches!(
        pool.free(&foreign),
        Err(VmmError::WrongPool { .. })
    ));
    assert!(matches!(
        pool.grow(&foreign, 20),
        Err(VmmError::WrongPool { .. })
    ));
    pool.free(&b).unwrap();
}

#[test]
fn out_of_memory_is_typed_says_what_release_would_return_and_leaks_nothing() {
    let (fake, pool) = pool(64, 2);
    let a = pool.alloc(G).unwrap();
    let b = pool.alloc(G).unwrap();
    pool.free(&a).unwrap();
    let before = pool.stats();
    // Two pages at the tail: the device has no room left.
    let err = pool.alloc(2 * G).unwrap_err();
    match &err {
        VmmError::OutOfMemory {
            requested,
            live,
            mapped,
            idle,
            driver_free,
            capacity,
            ..
        } => {
            assert_eq!(
                (*requested, *live, *mapped, *idle, *driver_free, *capacity),
                (2 * G, G, 2 * G, G, Some(0), 2 * G)
            );
        }
        other => panic!("{other}"),
    }
    assert!(err.to_string().contains("release_idle"), "{err}");
    assert_eq!(pool.stats(), before, "a failed allocation changes nothing");
    assert_eq!(fake.chunks(), 2);
    // Releasing the idle page makes room for one more page, not two.
    pool.release_idle(&quiet()).unwrap();
    assert!(matches!(
        pool.alloc(2 * G),
        Err(VmmError::OutOfMemory { .. })
    ));
    assert_eq!(fake.chunks(), 1);
    let c = pool.alloc(G).unwrap();
    assert_eq!(c.va(), a.va(), "the hole is refilled");
    pool.free(&b).unwrap();
    pool.free(&c).unwrap();
}

#[test]
fn injected_create_map_or_access_failures_roll_back_completely() {
    for (op, n) in [
        (FakeOp::Create, 1),
        (FakeOp::Create, 3),
        (FakeOp::Map, 1),
        (FakeOp::Map, 3),
        (FakeOp::SetAccess, 1),
    ] {
        let (fake, pool) = pool(64, 64);
        let keep = pool.alloc(100).unwrap();
        let before = (pool.stats().live, pool.stats().va_in_use, fake.mappings());
        fake.fail_nth(op, n);
        let err = pool.alloc(4 * G).unwrap_err();
        assert!(matches!(err, VmmError::Injected { .. }), "{op:?}: {err}");
        assert_eq!(
            (pool.stats().live, pool.stats().va_in_use, fake.mappings()),
            before,
            "{op:?} #{n}"
        );
        assert_eq!(fake.chunks(), 1, "{op:?} #{n}: a chunk leaked");
        assert_eq!(pool.stats().orphaned_chunks, 0);
        // The pool works on.
        let a = pool.alloc(4 * G).unwrap();
        let grown = pool.grow(&keep, 200).unwrap();
        fake.fail_nth(op, 1);
        assert!(pool.grow(&a, 8 * G).is_err(), "{op:?}");
        assert_eq!(pool.live_allocations(), vec![grown, a]);
        pool.free(&a).unwrap();
        pool.free(&grown).unwrap();
        pool.release_idle(&quiet()).unwrap();
        assert_eq!(fake.chunks(), 0);
    }
}

#[test]
fn unmap_or_release_failures_keep_chunks_accounted_and_are_retried() {
    let (fake, pool) = pool(64, 64);
    let a = pool.alloc(3 * G).unwrap();
    pool.free(&a).unwrap();
    // An unmap fails: release stops there, that page stays mapped.
    fake.fail_nth(FakeOp::Unmap, 2);
    assert!(matches!(
        pool.release_idle(&quiet()),
        Err(VmmError::Injected { .. })
    ));
    assert_eq!(pool.stats().mapped, 2 * G);
    assert_eq!(fake.chunks(), 2);
    // A release fails after its unmap: the chunk is an orphan until the next release.
    fake.fail_nth(FakeOp::Release, 1);
    assert!(pool.release_idle(&quiet()).is_err());
    let s = pool.stats();
    assert_eq!((s.mapped, s.orphaned_chunks), (G, 1));
    assert_eq!(fake.chunks() as u64, s.mapped_chunks + s.orphaned_chunks);
    let r = pool.release_idle(&quiet()).unwrap();
    assert_eq!((r.chunks, r.orphans, r.bytes), (2, 1, 2 * G));
    assert_eq!(fake.chunks(), 0);
    assert_eq!(pool.stats().orphaned_chunks, 0);
    // An unmap failing while a failed allocation rolls back leaves that page mapped without
    // access; the next allocation there gives it access again.
    fake.fail_nth(FakeOp::Map, 2);
    fake.fail_nth(FakeOp::Unmap, 1);
    assert!(pool.alloc(2 * G).is_err());
    assert_eq!(fake.mappings(), vec![(pool.range().base, G, false)]);
    let b = pool.alloc(G).unwrap();
    fake.check_accessible(b.va(), G).unwrap();
    pool.free(&b).unwrap();
}

#[test]
fn close_and_drop_return_everything() {
    let (fake, pool) = pool(64, 64);
    let a = pool.alloc(5 * G).unwrap();
    let b = pool.alloc(G).unwrap();
    pool.free(&b).unwrap();
    let err = pool.close().unwrap_err();
    assert!(
        matches!(err, VmmError::LiveAllocations { count: 1, bytes } if bytes == a.len()),
        "{err}"
    );
    assert_eq!(
        (fake.chunks(), fake.mapped_bytes(), fake.reservations()),
        (0, 0, 0)
    );

    let (fake, pool) = self::pool(64, 64);
    let _live = pool.alloc(5 * G).unwrap();
    drop(pool);
    assert_eq!(
        (fake.chunks(), fake.mapped_bytes(), fake.reservations()),
        (0, 0, 0)
    );

    let (fake, pool) = self::pool(64, 64);
    let x = pool.alloc(G).unwrap();
    pool.free(&x).unwrap();
    pool.close().unwrap();
    assert_eq!((fake.chunks(), fake.reservations()), (0, 0));
}

#[test]
fn peaks_follow_the_levels_and_reset() {
    let (_fake, pool) = pool(64, 64);
    let a = pool.alloc(3 * G).unwrap();
    let b = pool.alloc(G).unwrap();
    pool.free(&a).unwrap();
    let s = pool.stats();
    assert_eq!(
        (s.peak_live, s.peak_mapped, s.peak_va_in_use),
        (4 * G, 4 * G, 4 * G)
    );
    pool.release_idle(&quiet()).unwrap();
    pool.reset_peaks();
    let s = pool.stats();
    assert_eq!((s.peak_live, s.peak_mapped, s.peak_va_in_use), (G, G, G));
    pool.free(&b).unwrap();
    assert_eq!(pool.stats().peak_live, G);
}

#[test]
fn configuration_is_checked() {
    let fake = Arc::new(FakePhysicalMemory::new(G, 10 * G));
    // No capacity: the device's total.
    let p = VmmPool::new(Arc::clone(&fake), VmmPoolConfig::new("fake:0")).unwrap();
    assert_eq!(p.range().len, 10 * G);
    drop(p);
    // Rounded up to the granularity.
    let p = VmmPool::new(
        Arc::clone(&fake),
        VmmPoolConfig::new("fake:0").with_capacity(G + 1),
    )
    .unwrap();
    assert_eq!(p.stats().va_reserved, 2 * G);
    assert_eq!(p.label(), "fake:0");
    drop(p);
    for cap in [0, u64::MAX] {
        assert!(matches!(
            VmmPool::new(
                Arc::clone(&fake),
                VmmPoolConfig::new("fake:0").with_capacity(cap)
            ),
            Err(VmmError::InvalidConfig { .. })
        ));
    }
    let odd = FakePhysicalMemory::new(1000, 10_000);
    assert!(matches!(
        VmmPool::new(odd, VmmPoolConfig::new("x").with_capacity(10_000)),
        Err(VmmError::InvalidConfig { .. })
    ));
    fake.fail_nth(FakeOp::Reserve, 1);
    assert!(matches!(
        VmmPool::new(Arc::clone(&fake), VmmPoolConfig::new("fake:0")),
        Err(VmmError::Injected { .. })
    ));
    assert_eq!(fake.reservations(), 0);
}

#[test]
fn errors_become_core_errors() {
    let (_fake, pool) = pool(8, 1);
    let oom = pool.alloc(2 * G).unwrap_err();
    assert!(oom.is_out_of_memory());
    assert!(matches!(
        oom.into_core("cuda:0"),
        CoreError::OutOfMemory { device, requested, capacity, .. }
            if device == "cuda:0" && requested == 2 * G && capacity == G
    ));
    let full = pool.alloc(100 * G).unwrap_err();
    assert!(matches!(
        CoreError::from(full),
        CoreError::OutOfMemory { .. }
    ));
    let a = pool.alloc(1).unwrap();
    pool.free(&a).unwrap();
    let unknown = pool.free(&a).unwrap_err();
    assert!(!unknown.is_out_of_memory());
    assert!(matches!(
        unknown.into_core("cuda:0"),
        CoreError::Backend { device, message } if device == "cuda:0" && message.contains("double free")
    ));
    let injected = VmmError::Injected {
        call: "cuMemMap",
        nth: 2,
    };
    assert!(matches!(CoreError::from(injected), CoreError::Injected(_)));
}

#[test]
fn the_pool_can_be_shared_across_threads() {
    fn shareable<T: Send + Sync>() {}
    shareable::<VmmPool<ddo_vmm::CudaPhysicalMemory>>();
    shareable::<Pool>();
    let (fake, pool) = pool(256, 256);
    let pool = Arc::new(pool);
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let pool = Arc::clone(&pool);
            let fake = Arc::clone(&fake);
            std::thread::spawn(move || {
                for i in 0..50u64 {
                    let a = pool.alloc((t * 977 + i * 131) % (2 * G)).unwrap();
                    fill(&fake, &a, 0);
                    assert!(intact(&fake, &a));
                    pool.free(&a).unwrap();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(pool.stats().live, 0);
    pool.release_idle(&quiet()).unwrap();
    assert_eq!(fake.chunks(), 0);
}
