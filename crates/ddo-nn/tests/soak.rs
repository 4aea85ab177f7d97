//! A short soak in CI (`cargo xtask soak` runs 1,000 cycles): cycles of attach → forward →
//! phase boundary → remove over every route leave no device or pinned bytes, outputs stay
//! identical from cycle to cycle (checked inside `run_soak`), and host memory does not grow
//! past 1 MiB. Without a native device the native route is skipped; zero cycles are refused.

use std::sync::Arc;

use ddo_core::{AllocatorKind, CoreError, DType, Device};
use ddo_host::{HostDevice, HostDeviceConfig};
use ddo_nn::soak::{run_soak, soak_routes};

fn device(allocator: AllocatorKind) -> Arc<dyn Device> {
    HostDevice::new(HostDeviceConfig {
        capacity: 1 << 30,
        allocator,
        ..HostDeviceConfig::default()
    })
    .expect("host device")
}

#[test]
fn cycles_over_every_route_leave_nothing_behind_and_bad_soaks_are_refused() {
    let caching = device(AllocatorKind::Caching);
    let native = device(AllocatorKind::NativeVmm);
    let routes = soak_routes();
    let mut seen = 0;
    let report = run_soak(&caching, Some(&native), &routes, 4, DType::F32, |n| {
        seen = n
    })
    .expect("soak");
    println!("{}", report.format());
    assert_eq!(seen, 4);
    assert_eq!(report.routes.len(), routes.len(), "every route ran");
    assert_eq!(report.forwards, 2 * 4 * routes.len() as u64);
    for m in [report.after_first, report.after_last] {
        assert_eq!((m.device_allocated, m.pinned_host), (0, 0), "{m:?}");
    }
    assert!(report.max_phase_peak > 0);
    assert!(report.within(1 << 20), "{}", report.format());

    // One test (not two): the host figure is the whole process's resident set.
    let report = run_soak(&caching, None, &routes, 1, DType::F32, |_| {}).expect("soak");
    assert!(!report.routes.iter().any(|r| r == "native_vmm"));
    assert_eq!(report.routes.len(), routes.len() - 1);
    let err = run_soak(&caching, None, &routes, 0, DType::F32, |_| {}).unwrap_err();
    assert!(matches!(err, CoreError::InvalidOption { .. }), "{err}");
}
