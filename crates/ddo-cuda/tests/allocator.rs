//! Property tests of the caching allocator over the fake raw memory: random sequences of
//! allocations (on streams or on any stream), stream-ordered frees, event completions,
//! `empty_cache` and injected driver failures never hand out overlapping live blocks, never
//! hand a block to a stream before the free events of other streams have completed, keep
//! the accounting exact, and leave nothing behind.

use std::sync::Arc;

use ddo_cuda::CudaError;
use ddo_cuda::allocator::{
    Block, CachingAllocator, FakeEvent, FakeMemory, StreamKey, round_size, segment_size,
};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Alloc {
        bytes: u64,
        stream: Option<u8>,
    },
    Free {
        pick: usize,
        stream: u8,
        event: bool,
    },
    CompleteOldest {
        count: usize,
    },
    EmptyCache,
    FailNext(u32),
}

fn bytes() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => 0u64..4096,
        3 => 4096u64..(2 << 20),
        2 => (1u64 << 20)..(12 << 20),
        1 => (10u64 << 20)..(40 << 20),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (bytes(), proptest::option::of(0u8..3)).prop_map(|(bytes, stream)| Op::Alloc { bytes, stream }),
        5 => (any::<usize>(), 0u8..3, any::<bool>()).prop_map(|(pick, stream, event)| Op::Free { pick, stream, event }),
        2 => (1usize..4).prop_map(|count| Op::CompleteOldest { count }),
        1 => Just(Op::EmptyCache),
        1 => (1u32..3).prop_map(Op::FailNext),
    ]
}

/// A region freed on a stream whose event may not have completed.
struct Freed {
    ptr: u64,
    len: u64,
    stream: StreamKey,
    event: FakeEvent,
}

fn overlaps(a: u64, alen: u64, b: u64, blen: u64) -> bool {
    a < b + blen && b < a + alen
}

fn run(ops: Vec<Op>, capacity: u64) -> Result<(), TestCaseError> {
    let mem = FakeMemory::new(capacity);
    let alloc: CachingAllocator<Arc<FakeMemory>, FakeEvent> =
        CachingAllocator::new(mem.clone(), "fake:0");
    let mut live: Vec<Block> = Vec::new();
    let mut freed: Vec<Freed> = Vec::new();
    for op in ops {
        match op {
            Op::Alloc { bytes, stream } => {
                let stream = stream.map(|s| StreamKey(u64::from(s)));
                let injected = mem.pending_failures();
                match alloc.allocate(bytes, stream) {
                    Ok(block) => {
                        prop_assert!(block.size() >= round_size(bytes));
                        prop_assert_eq!(block.requested(), bytes);
                        for other in &live {
                            prop_assert!(
                                !overlaps(block.ptr(), block.size(), other.ptr(), other.size()),
                                "{:?} overlaps live {:?}",
                                block,
                                other
                            );
                        }
                        // Stream order: no bytes freed on another stream whose event is pending.
                        for f in &freed {
                            if !f.event.is_done() && Some(f.stream) != stream {
                                prop_assert!(
                                    !overlaps(block.ptr(), block.size(), f.ptr, f.len),
                                    "{:?} for {:?} reuses bytes freed on {:?} before its event",
                                    block,
                                    stream,
                                    f.stream
                                );
                            }
                        }
                        // Inside a live driver segment.
                        let inside = mem.live_segments().iter().any(|&(base, size)| {
                            block.ptr() >= base && block.ptr() + block.size() <= base + size
                        });
                        prop_assert!(inside, "{:?} lies outside every live segment", block);
                        live.push(block);
                    }
                    Err(CudaError::OutOfMemory { requested, .. }) => {
                        prop_assert_eq!(requested, bytes);
                        // Only when the driver really had no room after the retry (or was
                        // told to fail).
                        let room = mem.capacity() - mem.live_bytes();
                        prop_assert!(
                            injected >= 2 || room < segment_size(round_size(bytes)),
                            "out of memory with {} B of room for {} B",
                            room,
                            bytes
                        );
                    }
                    Err(e) => return Err(TestCaseError::fail(format!("unexpected error {e}"))),
                }
            }
            Op::Free {
                pick,
                stream,
                event,
            } => {
                if live.is_empty() {
                    continue;
                }
                let block = live.swap_remove(pick % live.len());
                let stream = StreamKey(u64::from(stream));
                let marks = if event {
                    let e = FakeEvent::new();
                    freed.push(Freed {
                        ptr: block.ptr(),
                        len: block.size(),
                        stream,
                        event: e.clone(),
                    });
                    vec![(stream, e)]
                } else {
                    vec![]
                };
                alloc.free(block, marks);
            }
            Op::CompleteOldest { count } => {
                for f in freed.iter().filter(|f| !f.event.is_done()).take(count) {
                    f.event.complete();
                }
            }
            Op::EmptyCache => {
                let before = alloc.stats().reserved;
                let returned = alloc.empty_cache().expect("fake frees succeed");
                prop_assert_eq!(alloc.stats().reserved, before - returned);
            }
            Op::FailNext(n) => mem.fail_next(n),
        }
        freed.retain(|f| !f.event.is_done());
        alloc.check_invariants().map_err(TestCaseError::fail)?;
        let stats = alloc.stats();
        prop_assert_eq!(
            stats.allocated,
            live.iter().map(Block::requested).sum::<u64>()
        );
        prop_assert!(stats.allocated <= stats.reserved);
        prop_assert_eq!(stats.reserved, mem.live_bytes());
        prop_assert!(stats.peak_allocated >= stats.allocated);
        prop_assert!(stats.peak_reserved >= stats.reserved);
        prop_assert!(mem.live_bytes() <= mem.capacity());
        for seg in alloc.snapshot() {
            for pair in seg.blocks.windows(2) {
                prop_assert!(
                    pair[0].allocated || pair[1].allocated,
                    "adjacent free blocks in {:?}",
                    seg
                );
            }
        }
    }
    // Free everything, let every event complete, empty the cache: nothing is left.
    for block in live.drain(..) {
        let e = FakeEvent::new();
        alloc.free(block, vec![(StreamKey(0), e.clone())]);
        freed.push(Freed {
            ptr: 0,
            len: 0,
            stream: StreamKey(0),
            event: e,
        });
    }
    for f in &freed {
        f.event.complete();
    }
    alloc.empty_cache().expect("fake frees succeed");
    let stats = alloc.stats();
    prop_assert_eq!((stats.allocated, stats.reserved, stats.segments), (0, 0, 0));
    prop_assert_eq!(mem.live_bytes(), 0);
    prop_assert_eq!(mem.bad_frees(), 0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    #[test]
    fn random_sequences_keep_blocks_apart_and_accounting_exact(
        ops in prop::collection::vec(op(), 1..80),
        capacity_mib in 24u64..160,
    ) {
        run(ops, capacity_mib << 20)?;
    }
}

#[test]
fn out_of_memory_leaves_nothing_behind() {
    let mem = FakeMemory::new(64 << 20);
    let alloc: CachingAllocator<Arc<FakeMemory>, FakeEvent> =
        CachingAllocator::new(mem.clone(), "fake:0");
    let a = alloc.allocate(30 << 20, None).unwrap();
    let before = alloc.stats();
    let err = alloc.allocate(40 << 20, Some(StreamKey(1))).unwrap_err();
    assert!(
        matches!(err, CudaError::OutOfMemory { requested, free, .. } if requested == 40 << 20 && free == 34 << 20),
        "{err}"
    );
    let after = alloc.stats();
    assert_eq!(
        (after.allocated, after.reserved),
        (before.allocated, before.reserved)
    );
    assert_eq!(mem.live_bytes(), 30 << 20);
    alloc.free(a, vec![]);
    assert_eq!(alloc.empty_cache().unwrap(), 30 << 20);
    assert_eq!(mem.live_bytes(), 0);
}

#[test]
fn a_freed_size_is_served_from_the_cache_without_growing_reserved() {
    let mem = FakeMemory::new(1 << 30);
    let alloc: CachingAllocator<Arc<FakeMemory>, FakeEvent> =
        CachingAllocator::new(mem.clone(), "fake:0");
    for bytes in [100, 64 << 10, 3 << 20, 50 << 20] {
        let a = alloc.allocate(bytes, None).unwrap();
        let reserved = alloc.stats().reserved;
        alloc.free(a, vec![]);
        let b = alloc.allocate(bytes, None).unwrap();
        assert_eq!(alloc.stats().reserved, reserved, "{bytes} B");
        alloc.free(b, vec![]);
    }
    assert_eq!(
        alloc.stats().driver_allocs,
        3,
        "small, large (20 MiB), 50 MiB"
    );
}
