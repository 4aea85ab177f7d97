//! Every configuration gives the resident output bit for bit over several forwards (so
//! the streaming engine runs), copies each group once per forward (the engine: each
//! transfer unit once), and releases everything.

use ddo_core::reference::{ReferenceSpec, build};
use ddo_core::{DType, Device};

use crate::common::*;

fn check_case(spec: &ReferenceSpec, case: Case, link_bytes_per_sec: f64) {
    let c = build(spec).unwrap();
    let device = slow_device(1 << 20, link_bytes_per_sec);
    let xs = inputs(spec, 2, 3);
    let expected = baseline(&c, &xs);
    let start = device.memory_info().allocated;
    let (hooks, metrics) = attach(&c, &device, &case.spec());
    let config = hooks.config();
    if config.pinned && !config.use_stream {
        // One pinned home: every param once, each 256-byte aligned.
        let padded: u64 = c
            .params()
            .iter()
            .map(|p| (p.nbytes() as u64).next_multiple_of(256))
            .sum();
        assert_eq!(hooks.pinned_bytes(), padded, "{case:?}");
        assert_eq!(device.memory_info().pinned_host, padded, "{case:?}");
        assert_eq!(metrics.counters().pinned_host_bytes, padded);
        assert!(
            c.params()
                .iter()
                .all(|p| p.host().kind() == ddo_core::HostMemoryKind::Pinned)
        );
    } else {
        // With a stream the engine is built at attach (the schedule is predicted from the
        // leaf order): its pinned staging is all that is pinned.
        let staged = hooks.streaming_figures().map_or(0, |f| f.pinned_bytes);
        assert_eq!(device.memory_info().pinned_host, staged, "{case:?}");
        assert_eq!(config.use_stream, staged > 0, "{case:?}");
    }
    for (i, (x, want)) in xs.iter().zip(&expected).enumerate() {
        assert_eq!(&run(&c, &*device, x), want, "{case:?}, forward {i}");
        assert_eq!(
            device.memory_info().allocated,
            start,
            "{case:?}, forward {i}"
        );
    }
    let counters = metrics.counters();
    {
        let per_forward: u64 = hooks
            .plan()
            .groups()
            .iter()
            .map(|g| g.params().len() as u64)
            .sum();
        match hooks.streaming_figures() {
            // The schedule is predicted from the leaf order, which these programs run:
            // every forward streams, one copy per unit (and the unmatched group's params,
            // which the engine does not stream).
            Some(f) => {
                let unmatched = hooks
                    .plan()
                    .unmatched()
                    .map_or(0, |u| hooks.plan().groups()[u].params().len() as u64);
                let staged_one_copy_per_unit = matches!(
                    f.staging,
                    ddo_core::streaming::StagingKind::PinnedHome
                ) || matches!(f.staging, ddo_core::streaming::StagingKind::Ring { buffer_bytes, .. } if buffer_bytes >= f.slot_bytes);
                assert!(staged_one_copy_per_unit, "{case:?} {f:?}");
                assert_eq!(
                    counters.h2d_copies,
                    3 * (f.units as u64 + unmatched),
                    "{case:?}"
                );
                assert_eq!(counters.transfer_units, f.units as u64);
                assert_eq!(counters.streamed_bytes_per_forward, f.streamed_bytes);
            }
            None => assert_eq!(counters.h2d_copies, 3 * per_forward, "{case:?}"),
        }
    }
    assert_eq!(counters.leaves_streamed, c.leaves().len() as u64);
    assert_eq!(
        (counters.leaves_resident, counters.resident_weight_bytes),
        (0, 0)
    );
    assert_eq!(counters.schedule_relearned, 0, "{case:?}");
    let pinned_source = config.pinned || (config.use_stream && config.low_cpu_mem_usage);
    let pageable = !pinned_source;
    if pageable {
        // Copies from pageable memory block the host: that time is copy wait.
        assert!(counters.copy_wait_ns > 0, "{case:?}");
    }
    assert_eq!(hooks.schedule().is_some(), case.use_stream, "{case:?}");
    device.synchronize().unwrap();
    // Staging copies of low_cpu_mem_usage are gone once their copies ran; the engine
    // holds its pinned home or its staging buffers.
    let pinned_now = if config.use_stream {
        hooks.streaming_figures().unwrap().pinned_bytes
    } else if config.pinned {
        c.params()
            .iter()
            .map(|p| (p.nbytes() as u64).next_multiple_of(256))
            .sum()
    } else {
        0
    };
    assert_eq!(hooks.pinned_bytes(), pinned_now, "{case:?}");
    assert_eq!(device.memory_info().pinned_host, pinned_now, "{case:?}");
    let checksums: Vec<u64> = c.params().iter().map(|p| p.host_checksum()).collect();
    detach_and_check_released(&c, &device, hooks, start);
    assert_eq!(metrics.counters().pinned_host_bytes, 0);
    let after: Vec<u64> = c.params().iter().map(|p| p.host_checksum()).collect();
    assert_eq!(checksums, after, "host weights changed");
}

#[test]
fn every_configuration_matches_resident_execution_and_releases_everything() {
    let spec = ReferenceSpec::small("transformer", 4, 8, DType::BF16);
    let cases = all_cases();
    assert_eq!(cases.len(), 28);
    for case in cases {
        check_case(&spec, case, 1e6);
    }
}

#[test]
fn tied_weights_with_stream_prefetch_give_the_resident_output() {
    let mut spec = ReferenceSpec::small("transformer", 3, 6, DType::F16);
    spec.tie_head_to_stem = true;
    for case in all_cases() {
        check_case(&spec, case, 1e6);
    }
}
