//! The residency table (`ddo_core::residency`) on a host device: shared params copied once,
//! a failed acquire leaves nothing, pinned copies under the limit.

use std::sync::Arc;

use ddo_core::residency::{FreeMode, ResidencyTable, pin_copy};
use ddo_core::{DType, Device, Param, ParamKind};
use ddo_host::HostDevice;
use ddo_metrics::RouteMetrics;

fn param(n: usize) -> Arc<Param> {
    Param::from_f32(
        "p",
        ParamKind::Parameter,
        DType::F32,
        vec![n],
        &vec![1.5; n],
    )
    .unwrap()
}

#[test]
fn shared_params_are_copied_once_and_freed_after_the_last_release() {
    let d = HostDevice::with_capacity(1 << 20).unwrap();
    let s = d.compute_stream();
    let m = RouteMetrics::new();
    let (a, b) = (param(4), param(8));
    let mut t = ResidencyTable::new();
    let host = |p: &Param| Ok(p.host());
    t.acquire(&*d, &[a.clone(), b.clone()], &host, &s, &m)
        .unwrap();
    t.acquire(&*d, std::slice::from_ref(&a), &host, &s, &m)
        .unwrap();
    assert_eq!(m.counters().h2d_copies, 2);
    assert_eq!(t.resident_bytes(), 48);
    t.release(&*d, &[a.clone(), b.clone()], FreeMode::Immediate, &s);
    assert!(a.device().is_some() && b.device().is_none());
    assert_eq!(d.memory_info().allocated, 16);
    t.release(
        &*d,
        std::slice::from_ref(&a),
        FreeMode::AfterComputeStream,
        &s,
    );
    d.synchronize().unwrap();
    assert!(a.device().is_none());
    assert_eq!(d.memory_info().allocated, 0);
}

#[test]
fn a_failed_acquire_leaves_nothing_behind() {
    let d = HostDevice::with_capacity(40).unwrap();
    let s = d.compute_stream();
    let m = RouteMetrics::new();
    let (a, b, c) = (param(4), param(4), param(8));
    let mut t = ResidencyTable::new();
    let host = |p: &Param| Ok(p.host());
    t.acquire(&*d, std::slice::from_ref(&a), &host, &s, &m)
        .unwrap();
    let err = t.acquire(&*d, &[a.clone(), b.clone(), c.clone()], &host, &s, &m);
    assert!(err.is_err());
    assert_eq!(d.memory_info().allocated, 16);
    assert!(b.device().is_none() && c.device().is_none());
    // `a` keeps exactly its first reference.
    t.release(&*d, std::slice::from_ref(&a), FreeMode::Immediate, &s);
    assert!(t.is_empty());
    assert_eq!(d.memory_info().allocated, 0);
}

#[test]
fn pinned_copies_respect_the_limit_and_unpin_on_drop() {
    let d = HostDevice::new(ddo_host::HostDeviceConfig {
        pinned_limit: 20,
        ..Default::default()
    })
    .unwrap();
    let ok = pin_copy(&*d, &param(4).host()).unwrap();
    assert_eq!(ok.len(), 16);
    assert!(ok.is_pinned());
    assert!(pin_copy(&*d, &param(2).host()).is_err());
    assert_eq!(d.memory_info().pinned_host, 16);
    drop(ok);
    assert_eq!(d.memory_info().pinned_host, 0);
}
