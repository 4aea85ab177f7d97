//! `timeline=true`: a streamed forward's timeline from timed device events — every unit
//! once, each copy before the compute that uses it, each overwrite after the use of the
//! bytes it replaces — published in the route's metrics.

mod common;

use common::*;
use ddo_core::reference::{self, ReferenceSpec};
use ddo_core::{DType, RouteSpec};
use ddo_routes::enable_dynamic_offload;

#[test]
fn a_streamed_forward_publishes_an_ordered_timeline() {
    let spec = ReferenceSpec::small("transformer", 6, 32, DType::F32);
    let c = reference::build(&spec).unwrap();
    let d = device(1 << 24);
    let route: RouteSpec = ddo_routes::parse_spec(
        "diffusers_group_offload:use_stream=true,unit_bytes=4KiB,timeline=true",
    )
    .unwrap();
    let h = enable_dynamic_offload(&c, dyn_device(&d), route).unwrap();
    // The first forward learns the schedule; the second streams and is traced.
    for step in 0..2 {
        let out = h
            .forward(reference::input(&spec, 2, step).unwrap())
            .unwrap();
        assert_eq!(
            bytes_of(&*d, &out),
            baseline(&reference::build(&spec).unwrap(), &spec, 2, step)
        );
    }
    let snap = h.metrics_snapshot();
    let t = snap.timeline.expect("a timeline after a streamed forward");
    assert_eq!(t.units.len() as u64, snap.counters.transfer_units);
    assert!(t.units.len() > 2, "several units: {}", t.units.len());
    let bytes: u64 = t.units.iter().map(|u| u.bytes).sum();
    assert_eq!(bytes, snap.counters.streamed_bytes_per_forward);
    for u in &t.units {
        assert!(u.copy_start_ns <= u.copy_end_ns, "{u:?}");
        assert!(
            u.copy_end_ns <= u.compute_start_ns,
            "compute waits for the copy: {u:?}"
        );
        assert!(u.compute_start_ns <= u.compute_end_ns, "{u:?}");
        if let Some(b) = u.blocker {
            assert!(
                t.units[b].compute_end_ns <= u.copy_start_ns,
                "unit {} overwrote unit {b} before its use ended",
                u.unit
            );
        }
        assert!(u.compute_end_ns <= t.forward_ns);
        // The host reached the unit after begin_forward's entry and before the end event.
        assert!(
            u.host_enter_ns >= t.host_begin_ns && u.host_enter_ns <= t.host_forward_ns,
            "{u:?} in {}..{}",
            t.host_begin_ns,
            t.host_forward_ns
        );
    }
    // The host reaches the units in schedule order.
    assert!(
        t.units
            .windows(2)
            .all(|w| w[0].host_enter_ns <= w[1].host_enter_ns),
        "host times out of order"
    );
    assert!(t.units.last().unwrap().host_enter_ns > 0);
    let summary = t.summary(3);
    assert_eq!(summary.bytes, bytes);
    assert!(summary.copy_busy_ms >= 0.0 && summary.forward_ms > 0.0);
    assert!(summary.format_text(None).contains("copies busy"));
    // Without the option nothing is traced.
    drop(h);
    let c = reference::build(&spec).unwrap();
    let h = enable_dynamic_offload(
        &c,
        dyn_device(&d),
        ddo_routes::parse_spec("diffusers_group_offload:use_stream=true").unwrap(),
    )
    .unwrap();
    for step in 0..2 {
        drop(
            h.forward(reference::input(&spec, 2, step).unwrap())
                .unwrap(),
        );
    }
    assert!(h.metrics_snapshot().timeline.is_none());
}
