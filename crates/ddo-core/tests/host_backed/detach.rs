//! `detach_auxiliary_cpu_sources` on components over checkpoint mappings: partial aliases
//! and views refused with nothing changed, and, with the component resident on a host
//! device, the seed's "does not change GPU residency or cache capacities".

use std::sync::Arc;

use ddo_core::component::{LeafKind, Module};
use ddo_core::detach::detach_auxiliary_cpu_sources;
use ddo_core::{
    CheckpointMap, Component, CoreError, DType, DetachRefusal, Device, HostBuffer, HostSlice,
    Param, ParamKind,
};
use ddo_host::HostDevice;

use ddo_core::reference::IdentityProgram as Identity;

/// 64 bytes made in memory and treated as a checkpoint mapping (`CheckpointMap::in_memory`).
fn mapping() -> Arc<CheckpointMap> {
    let mut bytes = memmap2::MmapMut::map_anon(64).unwrap();
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = i as u8;
    }
    CheckpointMap::in_memory("detach-test", bytes)
}

/// A bf16 param over `slice` (its whole length).
fn param(name: &str, slice: HostSlice) -> Arc<Param> {
    let elems = slice.len() / 2;
    Param::new(name, ParamKind::Parameter, DType::BF16, vec![elems], slice).unwrap()
}

/// An exclusively owned component of one leaf per param, in eval mode.
fn component(params: Vec<Arc<Param>>) -> Arc<Component> {
    let leaves = params
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            Module::leaf(
                format!("l{i}"),
                LeafKind::Linear,
                vec![("weight".into(), p)],
            )
        })
        .collect();
    let c = Component::new(
        "transformer",
        "Handmade",
        Module::container("", leaves),
        Arc::new(Identity),
    )
    .unwrap();
    c.set_exclusively_owned(true);
    c
}

/// The seed: detaching CPU sources "does not change GPU residency or cache capacities":
/// device copies stay the same buffers, and the device's allocated, reserved, capacity
/// and pinned figures are what they were.
#[test]
fn detach_leaves_device_residency_and_cache_capacities_alone() {
    let map = mapping();
    let a = HostBuffer::mapped(Arc::clone(&map), 0, 32).unwrap();
    let b = HostBuffer::mapped(Arc::clone(&map), 32, 32).unwrap();
    drop(map);
    let c = component(vec![
        param("a.weight", a.slice_all()),
        param("b.weight", b.slice_all()),
    ]);
    drop((a, b));
    let d = HostDevice::with_capacity(1 << 20).unwrap();
    c.to_device(&*d, &d.compute_stream()).unwrap();
    let before: Vec<_> = c.params().iter().map(|p| p.device().unwrap()).collect();
    let bytes = |d: &HostDevice, s: &ddo_core::DeviceSlice| {
        ddo_core::device::download(d, s, &d.compute_stream()).unwrap()
    };
    let m = d.memory_info();
    let report = detach_auxiliary_cpu_sources(&c, 0, true, u64::MAX).unwrap();
    assert_eq!(report.tensors_copied, 2);
    for (p, was) in c.params().iter().zip(&before) {
        let now = p.device().expect("still resident");
        assert!(now.buffer().same_buffer(was.buffer()), "{}", p.name());
        assert_eq!((now.offset(), now.len()), (was.offset(), was.len()));
        assert_eq!(bytes(&d, &now), p.host().to_vec());
    }
    let after = d.memory_info();
    assert_eq!(
        (
            after.allocated,
            after.reserved,
            after.capacity,
            after.pinned_host,
            after.pinned_limit
        ),
        (
            m.allocated,
            m.reserved,
            m.capacity,
            m.pinned_host,
            m.pinned_limit
        )
    );
}

/// Each param's host bytes and whether they are still the mapping's.
fn sources(c: &Component) -> Vec<(Vec<u8>, bool)> {
    c.params()
        .iter()
        .map(|p| (p.host().to_vec(), p.host().buffer().mapping().is_some()))
        .collect()
}

fn refusal(c: &Component) -> DetachRefusal {
    let before = sources(c);
    let err = detach_auxiliary_cpu_sources(c, 0, true, u64::MAX).unwrap_err();
    assert_eq!(sources(c), before, "a refusal changed the sources");
    match err {
        CoreError::DetachRefused { refusal, .. } => refusal,
        other => panic!("expected a refusal, got {other}"),
    }
}

/// A partial alias made of whole buffers (neither param a view of its own buffer): two
/// ranges of one mapping that overlap without being one registered param are refused,
/// changing nothing (the seed: "refuses ... overlapping native sources, partial aliases"),
/// however little they share: half of each, or exactly one byte (`0..32` and `31..63`,
/// `2..32` and `31..33`: the second range's first byte is the first range's last).
#[test]
fn partial_aliases_over_whole_buffers_are_refused() {
    for (a_at, a_len, b_at, b_len) in [(0, 32, 16, 32), (0, 32, 31, 32), (2, 30, 31, 2)] {
        let map = mapping();
        let a = HostBuffer::mapped(Arc::clone(&map), a_at, a_len).unwrap();
        let b = HostBuffer::mapped(Arc::clone(&map), b_at, b_len).unwrap();
        drop(map);
        let c = component(vec![
            param("a.weight", a.slice_all()),
            param("b.weight", b.slice_all()),
        ]);
        drop((a, b));
        let r = refusal(&c);
        assert!(
            matches!(&r, DetachRefusal::OverlappingSources { first, second, .. }
                if first == "a.weight" && second == "b.weight"),
            "{a_at}+{a_len} and {b_at}+{b_len}: {r:?}"
        );
    }
    // Apart, the same two ranges are copied and the mapping is released.
    let map = mapping();
    let a = HostBuffer::mapped(Arc::clone(&map), 0, 16).unwrap();
    let b = HostBuffer::mapped(Arc::clone(&map), 16, 32).unwrap();
    let weak = Arc::downgrade(&map);
    drop(map);
    let c = component(vec![
        param("a.weight", a.slice_all()),
        param("b.weight", b.slice_all()),
    ]);
    drop((a, b));
    let report = detach_auxiliary_cpu_sources(&c, 0, true, u64::MAX).unwrap();
    assert_eq!((report.tensors_copied, report.mappings_released), (2, 1));
    assert!(weak.upgrade().is_none());
    assert_eq!(
        c.params()[1].host().to_vec(),
        (16u8..48).collect::<Vec<_>>()
    );
}

/// Views are refused wherever they sit in their buffer: a prefix (offset 0, shorter than
/// the buffer), an interior range and a suffix.
#[test]
fn views_of_a_mapped_tensor_are_refused_at_any_offset() {
    for (offset, len) in [(0, 16), (8, 16), (16, 16)] {
        let map = mapping();
        let tensor = HostBuffer::mapped(map, 0, 32).unwrap();
        let c = component(vec![param("v.weight", tensor.slice(offset, len).unwrap())]);
        drop(tensor);
        let r = refusal(&c);
        assert!(
            matches!(&r, DetachRefusal::UnsupportedLayout { param, why }
                if param == "v.weight" && why.contains("view")),
            "view at {offset}+{len}: {r:?}"
        );
    }
}
