//! Tests of [`FakePhysicalMemory`] itself: it must reject every contract break the pool
//! could commit (so the pool's tests mean something), mimic the driver's out-of-memory,
//! keep memory contents per chunk, and inject failures that change nothing.

use ddo_vmm::{FakeOp, FakePhysicalMemory, PhysicalMemory, VaRange, VmmError};

const G: u64 = 4096;

fn misuse(r: Result<(), VmmError>, call: &str, needle: &str) {
    match r {
        Err(VmmError::Misuse { call: c, message }) => {
            assert_eq!(c, call);
            assert!(message.contains(needle), "{message}");
        }
        other => panic!("expected a misuse of {call}, got {other:?}"),
    }
}

#[test]
fn a_full_cycle_mirrors_the_driver_sequence() {
    let fake = FakePhysicalMemory::new(G, 8 * G);
    let r = fake.reserve(4 * G).unwrap();
    assert_eq!(r.base % G, 0);
    let c = fake.create(2 * G).unwrap();
    fake.map(r.base + G, &c).unwrap();
    // Not accessible before set_access.
    assert!(fake.read(r.base + G, 1).is_err());
    fake.set_access(r.base + G, 2 * G).unwrap();
    fake.write(r.base + G + 10, b"hello").unwrap();
    assert_eq!(fake.read(r.base + G + 10, 5).unwrap(), b"hello");
    assert_eq!(fake.read(r.base + G, 2).unwrap(), [0, 0]);
    assert_eq!(fake.mem_info(), Some((6 * G, 8 * G)));
    assert_eq!(fake.mappings(), vec![(r.base + G, 2 * G, true)]);
    fake.unmap(r.base + G, 2 * G).unwrap();
    assert!(fake.read(r.base + G + 10, 5).is_err());
    fake.release(c).unwrap();
    fake.free_range(r).unwrap();
    assert_eq!(
        (fake.chunks(), fake.reservations(), fake.created_bytes()),
        (0, 0, 0)
    );
    assert_eq!(fake.calls(FakeOp::Map), 1);
}

#[test]
fn contract_breaks_are_rejected() {
    let fake = FakePhysicalMemory::new(G, 16 * G);
    let r = fake.reserve(8 * G).unwrap();
    let a = fake.create(G).unwrap();
    let b = fake.create(2 * G).unwrap();
    fake.map(r.base, &a).unwrap();
    misuse(fake.map(r.base, &b), "cuMemMap", "double map");
    misuse(fake.map(r.base + 4 * G, &a), "cuMemMap", "already mapped");
    misuse(
        fake.map(r.base + 7 * G, &b),
        "cuMemMap",
        "not inside a reserved range",
    );
    misuse(fake.map(r.base + 100, &b), "cuMemMap", "granularity");
    fake.map(r.base + 2 * G, &b).unwrap();
    let c = fake.create(G).unwrap();
    misuse(fake.map(r.base + 3 * G, &c), "cuMemMap", "double map");
    misuse(fake.unmap(r.base + G, G), "cuMemUnmap", "not mapped");
    misuse(
        fake.unmap(r.base + 3 * G, G),
        "cuMemUnmap",
        "not at its start",
    );
    misuse(
        fake.unmap(r.base + 2 * G, G),
        "cuMemUnmap",
        "inside the mapping",
    );
    misuse(
        fake.set_access(r.base, 2 * G),
        "cuMemSetAccess",
        "not mapped",
    );
    misuse(
        fake.release(handle_copy(&b)),
        "cuMemRelease",
        "while it is mapped",
    );
    misuse(fake.free_range(r), "cuMemAddressFree", "still mapped");
    misuse(
        fake.free_range(VaRange {
            base: r.base,
            len: G,
        }),
        "cuMemAddressFree",
        "not a reserved range",
    );
    misuse(fake.create(100).map(drop), "cuMemCreate", "granularity");
    misuse(fake.create(0).map(drop), "cuMemCreate", "0 bytes");
    misuse(fake.reserve(0).map(drop), "cuMemAddressReserve", "0 bytes");
    // Whole mappings can be unmapped together.
    fake.unmap(r.base, G).unwrap();
    fake.unmap(r.base + 2 * G, 2 * G).unwrap();
    fake.release(a).unwrap();
    let a_again = handle_copy(&c);
    fake.release(c).unwrap();
    misuse(fake.release(a_again), "cuMemRelease", "unknown");
    fake.release(b).unwrap();
    fake.free_range(r).unwrap();
}

/// A second handle value naming the same chunk (what a double release would pass).
fn handle_copy(h: &ddo_vmm::ChunkHandle) -> ddo_vmm::ChunkHandle {
    ddo_vmm::ChunkHandle::from_raw(h.raw(), h.bytes())
}

#[test]
fn creating_past_the_capacity_is_the_drivers_out_of_memory() {
    let fake = FakePhysicalMemory::new(G, 2 * G);
    let a = fake.create(2 * G).unwrap();
    let err = fake.create(G).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    assert!(
        matches!(&err, VmmError::Driver { call: "cuMemCreate", code, .. } if code == "CUDA_ERROR_OUT_OF_MEMORY")
    );
    fake.release(a).unwrap();
    fake.create(G).map(|c| fake.release(c)).unwrap().unwrap();
}

#[test]
fn injected_failures_hit_the_nth_call_once_and_change_nothing() {
    let fake = FakePhysicalMemory::new(G, 16 * G);
    let r = fake.reserve(4 * G).unwrap();
    fake.fail_nth(FakeOp::Create, 2);
    let a = fake.create(G).unwrap();
    let err = fake.create(G).unwrap_err();
    assert!(
        matches!(
            err,
            VmmError::Injected {
                call: "cuMemCreate",
                nth: 2
            }
        ),
        "{err}"
    );
    assert_eq!(fake.chunks(), 1);
    let b = fake.create(G).unwrap();
    fake.fail_nth(FakeOp::Map, 1);
    assert!(fake.map(r.base, &a).is_err());
    assert!(fake.mappings().is_empty());
    fake.map(r.base, &a).unwrap();
    fake.fail_nth(FakeOp::Unmap, 1);
    fake.fail_nth(FakeOp::Release, 1);
    assert!(fake.unmap(r.base, G).is_err());
    assert_eq!(fake.mappings().len(), 1);
    fake.unmap(r.base, G).unwrap();
    let b_again = handle_copy(&b);
    assert!(fake.release(b).is_err());
    assert_eq!(fake.chunks(), 2, "a failed release keeps the chunk");
    fake.release(b_again).unwrap();
    fake.fail_nth(FakeOp::SetAccess, 5);
    fake.clear_failures();
    fake.release(a).unwrap();
    fake.free_range(r).unwrap();
    assert_eq!(fake.calls(FakeOp::Create), 3);
}
