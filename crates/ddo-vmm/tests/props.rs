//! Property tests of [`VmmPool`] over the fake: random sequences of alloc, growable alloc,
//! free, grow, release and injected failures (create, map, set access, unmap, release).
//!
//! After every step: live allocations never overlap and lie in the range; every live byte
//! is mapped with access and holds what was written to it (so no release, rollback or
//! remap ever touched a live byte); the pool's accounting balances (live = the sum of the
//! lengths, live ≤ mapped ≤ reserved, mapped = pages × granularity = the fake's mapped
//! bytes, chunks the fake holds = mapped pages + orphans: nothing leaks). Each release
//! returns exactly the pages with no live byte (plus earlier orphans). At the end, after
//! freeing everything and releasing, nothing is mapped or held, and dropping the pool frees
//! its range.

use std::collections::BTreeSet;
use std::sync::Arc;

use ddo_vmm::{
    FakeOp, FakePhysicalMemory, PoolAllocation, QuiescenceGate, VmmError, VmmPool, VmmPoolConfig,
    round_len,
};
use proptest::prelude::*;

const G: u64 = 4096;
const RANGE_PAGES: u64 = 48;
const PHYS_PAGES: u64 = 28;

type Pool = VmmPool<Arc<FakePhysicalMemory>>;

#[derive(Debug, Clone)]
enum Op {
    Alloc(u64),
    AllocGrowable(u64, u64),
    Free(usize),
    Grow(usize, u64),
    Release,
    ReleaseBusy,
    Inject(FakeOp, u64),
}

fn op() -> impl Strategy<Value = Op> {
    let injectable = prop_oneof![
        Just(FakeOp::Create),
        Just(FakeOp::Map),
        Just(FakeOp::SetAccess),
        Just(FakeOp::Unmap),
        Just(FakeOp::Release),
    ];
    prop_oneof![
        6 => (0..3 * G).prop_map(Op::Alloc),
        2 => (0..G, 0..6 * G).prop_map(|(a, b)| Op::AllocGrowable(a, b)),
        5 => any::<usize>().prop_map(Op::Free),
        3 => (any::<usize>(), 0..3 * G).prop_map(|(i, n)| Op::Grow(i, n)),
        2 => Just(Op::Release),
        1 => Just(Op::ReleaseBusy),
        2 => (injectable, 1..5u64).prop_map(|(o, n)| Op::Inject(o, n)),
    ]
}

fn pattern(a: &PoolAllocation, from: u64, to: u64) -> Vec<u8> {
    (from..to)
        .map(|i| (a.id() as u8).wrapping_mul(151) ^ (i as u8).wrapping_mul(13) ^ (i >> 8) as u8)
        .collect()
}

fn gate() -> QuiescenceGate {
    QuiescenceGate::quiescent("proptest: no streams exist")
}

/// Page indices (in the pool's range) of the fake's mappings.
fn mapped_pages(fake: &FakePhysicalMemory, pool: &Pool) -> BTreeSet<u64> {
    fake.mappings()
        .into_iter()
        .map(|(va, bytes, _)| {
            assert_eq!(bytes, G, "one chunk per page");
            (va - pool.range().base) / G
        })
        .collect()
}

/// Pages holding a byte of a live allocation.
fn busy_pages(pool: &Pool, live: &[PoolAllocation]) -> BTreeSet<u64> {
    let base = pool.range().base;
    live.iter()
        .flat_map(|a| {
            let start = (a.va() - base) / G;
            let end = (a.va() + round_len(a.len()).unwrap() - base).div_ceil(G);
            start..end
        })
        .collect()
}

/// Errors a step may legitimately end with; anything else (a contract break the fake
/// caught, a double free) is a bug.
fn expected(e: &VmmError) -> bool {
    matches!(
        e,
        VmmError::OutOfMemory { .. }
            | VmmError::AddressSpaceExhausted { .. }
            | VmmError::GrowBlocked { .. }
            | VmmError::Injected { .. }
    )
}

fn check(pool: &Pool, fake: &FakePhysicalMemory, live: &[PoolAllocation]) {
    let mut sorted = live.to_vec();
    sorted.sort_by_key(|a| a.va());
    assert_eq!(pool.live_allocations(), sorted, "the pool's live set");
    let range = pool.range();
    for w in sorted.windows(2) {
        assert!(
            w[0].va() + round_len(w[0].len()).unwrap() <= w[1].va(),
            "overlap: {:?} and {:?}",
            w[0],
            w[1]
        );
    }
    for a in &sorted {
        assert!(range.contains(a.va(), round_len(a.len()).unwrap()), "{a:?}");
        assert_eq!(a.va() % 512, 0);
        fake.check_accessible(a.va(), round_len(a.len()).unwrap())
            .unwrap_or_else(|e| panic!("{a:?}: {e}"));
        assert_eq!(
            fake.read(a.va(), a.len()).unwrap(),
            pattern(a, 0, a.len()),
            "contents of {a:?}"
        );
    }
    let s = pool.stats();
    let live_sum: u64 = sorted.iter().map(|a| a.len()).sum();
    let rounded_sum: u64 = sorted.iter().map(|a| round_len(a.len()).unwrap()).sum();
    assert_eq!(s.live, live_sum);
    assert_eq!(s.live_allocations, sorted.len() as u64);
    assert!(s.va_in_use >= rounded_sum && s.va_in_use <= s.va_reserved);
    assert!(s.live <= s.mapped, "{s:?}");
    assert!(s.mapped <= s.va_reserved, "{s:?}");
    assert_eq!(s.mapped, s.mapped_chunks * G);
    assert_eq!(s.mapped, fake.mapped_bytes());
    assert_eq!(
        fake.chunks() as u64,
        s.mapped_chunks + s.orphaned_chunks,
        "a chunk leaked: {s:?}"
    );
    assert_eq!(fake.created_bytes(), fake.chunks() as u64 * G);
    assert_eq!(
        s.chunks_created - s.chunks_released,
        s.mapped_chunks + s.orphaned_chunks,
        "{s:?}"
    );
    assert!(s.peak_live >= s.live && s.peak_mapped >= s.mapped && s.peak_va_in_use >= s.va_in_use);
    assert_eq!(
        s.chunks_mapped - s.chunks_unmapped,
        s.mapped_chunks,
        "every mapped page was mapped once and not unmapped since: {s:?}"
    );
    // Every page of a live allocation is mapped (the accessible check above), and the
    // pool's idle figure is the mapped pages that hold no live byte.
    let idle = mapped_pages(fake, pool)
        .difference(&busy_pages(pool, &sorted))
        .count() as u64;
    assert_eq!(pool.idle_bytes(), idle * G);
}

fn run(ops: Vec<Op>) {
    let fake = Arc::new(FakePhysicalMemory::new(G, PHYS_PAGES * G));
    let pool = VmmPool::new(
        Arc::clone(&fake),
        VmmPoolConfig::new("fake:0").with_capacity(RANGE_PAGES * G),
    )
    .unwrap();
    let mut live: Vec<PoolAllocation> = Vec::new();
    let mut freed: Vec<PoolAllocation> = Vec::new();
    for op in ops {
        match op {
            Op::Alloc(n) => match pool.alloc(n) {
                Ok(a) => {
                    assert_eq!(a.len(), n);
                    fake.write(a.va(), &pattern(&a, 0, n)).unwrap();
                    live.push(a);
                }
                Err(e) => assert!(expected(&e), "alloc({n}): {e}"),
            },
            Op::AllocGrowable(n, room) => match pool.alloc_growable(n, room) {
                Ok(a) => {
                    fake.write(a.va(), &pattern(&a, 0, n)).unwrap();
                    // Growth within the room never meets another allocation.
                    match pool.grow(&a, n.max(room)) {
                        Ok(g) => {
                            assert_eq!(g.va(), a.va());
                            fake.write(g.va() + n, &pattern(&g, n, g.len())).unwrap();
                            live.push(g);
                        }
                        Err(e) => {
                            assert!(
                                matches!(
                                    e,
                                    VmmError::OutOfMemory { .. } | VmmError::Injected { .. }
                                ),
                                "growth within the room: {e}"
                            );
                            live.push(a);
                        }
                    }
                }
                Err(e) => assert!(expected(&e), "alloc_growable({n}, {room}): {e}"),
            },
            Op::Free(i) => {
                if live.is_empty() {
                    if let Some(old) = freed.last() {
                        assert!(matches!(
                            pool.free(old),
                            Err(VmmError::UnknownAllocation { .. })
                        ));
                    }
                    continue;
                }
                let a = live.swap_remove(i % live.len());
                pool.free(&a).unwrap();
                assert!(matches!(
                    pool.free(&a),
                    Err(VmmError::UnknownAllocation { .. })
                ));
                freed.push(a);
            }
            Op::Grow(i, extra) => {
                if live.is_empty() {
                    continue;
                }
                let i = i % live.len();
                let a = live[i];
                let before = pool.stats();
                match pool.grow(&a, a.len() + extra) {
                    Ok(g) => {
                        assert_eq!((g.va(), g.id(), g.len()), (a.va(), a.id(), a.len() + extra));
                        fake.write(g.va() + a.len(), &pattern(&g, a.len(), g.len()))
                            .unwrap();
                        live[i] = g;
                    }
                    Err(e) => {
                        assert!(expected(&e), "grow: {e}");
                        let after = pool.stats();
                        assert_eq!(
                            (after.live, after.va_in_use),
                            (before.live, before.va_in_use),
                            "a failed growth changes no allocation"
                        );
                    }
                }
            }
            Op::Release => {
                let before = mapped_pages(&fake, &pool);
                let idle: BTreeSet<u64> = before
                    .difference(&busy_pages(&pool, &live))
                    .copied()
                    .collect();
                let orphans = pool.stats().orphaned_chunks;
                match pool.release_idle(&gate()) {
                    Ok(r) => {
                        assert_eq!(r.chunks, idle.len() as u64 + orphans, "{r:?}");
                        assert_eq!(r.orphans, orphans);
                        assert_eq!(r.bytes, r.chunks * G);
                        assert_eq!(r.driver_confirms(), Some(true), "{r:?}");
                        let after = mapped_pages(&fake, &pool);
                        let expect: BTreeSet<u64> = before.difference(&idle).copied().collect();
                        assert_eq!(after, expect, "exactly the idle pages go");
                        assert_eq!(pool.idle_bytes(), 0);
                    }
                    Err(e) => {
                        assert!(matches!(e, VmmError::Injected { .. }), "release: {e}");
                        let after = mapped_pages(&fake, &pool);
                        assert!(after.is_subset(&before));
                        let gone: BTreeSet<u64> = before.difference(&after).copied().collect();
                        assert!(gone.is_subset(&idle), "a busy page went: {gone:?}");
                    }
                }
            }
            Op::ReleaseBusy => {
                let before = (pool.stats(), fake.mappings());
                assert!(matches!(
                    pool.release_idle(&QuiescenceGate::busy("a copy is in flight")),
                    Err(VmmError::NotQuiescent { .. })
                ));
                assert_eq!((pool.stats(), fake.mappings()), before);
            }
            Op::Inject(op, n) => fake.fail_nth(op, n),
        }
        check(&pool, &fake, &live);
    }
    fake.clear_failures();
    for a in live.drain(..) {
        pool.free(&a).unwrap();
    }
    pool.release_idle(&gate()).unwrap();
    check(&pool, &fake, &live);
    let s = pool.stats();
    assert_eq!(
        (s.mapped, s.live, s.va_in_use, s.orphaned_chunks),
        (0, 0, 0, 0)
    );
    assert_eq!(s.chunks_released, s.chunks_created, "{s:?}");
    assert_eq!((fake.chunks(), fake.mapped_bytes()), (0, 0));
    drop(pool);
    assert_eq!(fake.reservations(), 0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 320, ..ProptestConfig::default() })]

    #[test]
    fn random_sequences_keep_the_pool_sound(ops in prop::collection::vec(op(), 1..80)) {
        run(ops);
    }
}

#[test]
fn a_long_fixed_sequence_with_every_failure_kind() {
    let mut ops = Vec::new();
    for round in 0..6u64 {
        for k in 0..8u64 {
            ops.push(Op::Alloc((k * 1531 + round * 977) % (3 * G)));
        }
        ops.push(Op::Inject(FakeOp::ALL[(round % 7) as usize], 1 + round % 3));
        ops.push(Op::Grow(round as usize, G + 17));
        for k in 0..4 {
            ops.push(Op::Free((k * 3 + round as usize) % 7));
        }
        ops.push(Op::AllocGrowable(100, 3 * G));
        ops.push(Op::Release);
    }
    run(ops);
}
