//! Phase ends, detach, drop, and what the hooks report about themselves.

use std::sync::Arc;

use ddo_core::reference::{ReferenceSpec, build};
use ddo_core::{AttachedRoute, CoreError, DType, Device, Route, RouteId};
use ddo_metrics::RouteMetrics;
use ddo_route_leaf_group::GroupOffloadRoute;

use crate::common::*;

#[test]
fn end_phase_leaves_nothing_on_the_device_and_keeps_pinned_copies() {
    let spec = ReferenceSpec::small("transformer", 3, 8, DType::F16);
    for case in all_cases() {
        let c = build(&spec).unwrap();
        let device = slow_device(1 << 20, 4e6);
        let xs = inputs(&spec, 2, 2);
        let expected = baseline(&c, &xs);
        let (hooks, metrics) = attach(&c, &device, &case.spec());
        assert_eq!(run(&c, &*device, &xs[0]), expected[0]);
        // Pinned copies (no stream) or the streaming engine's staging (stream) stay.
        let pinned = hooks.pinned_bytes();
        // Hold a prefetched group and a current one, as a forward in flight would.
        hooks.before_forward().unwrap();
        hooks.before_leaf(&c.leaves()[0]).unwrap();
        assert!(device.memory_info().allocated > 0);
        hooks.end_phase().unwrap();
        assert_eq!(device.memory_info().allocated, 0, "{case:?}");
        assert_eq!(device.memory_info().pinned_host, pinned, "{case:?}");
        assert!(c.params().iter().all(|p| p.device().is_none()));
        // The next phase runs as before, on the schedule learned earlier.
        assert_eq!(run(&c, &*device, &xs[1]), expected[1], "{case:?}");
        assert_eq!(metrics.counters().schedule_relearned, 0, "{case:?}");
        detach_and_check_released(&c, &device, hooks, 0);
    }
}

#[test]
fn after_detach_the_hooks_refuse_to_run_and_drop_releases_without_detach() {
    let spec = ReferenceSpec::small("transformer", 2, 8, DType::F32);
    let c = build(&spec).unwrap();
    let device = slow_device(1 << 20, 4e6);
    let case = all_cases()
        .into_iter()
        .find(|k| k.use_stream && k.host == HostChoice::Pinned)
        .unwrap();
    let xs = inputs(&spec, 1, 1);
    let expected = baseline(&c, &xs);
    let (hooks, _metrics) = attach(&c, &device, &case.spec());
    assert_eq!(run(&c, &*device, &xs[0]), expected[0]);
    hooks.detach().unwrap();
    assert!(hooks.is_detached());
    let err = c.forward(&*device, xs[0].clone()).unwrap_err();
    assert!(matches!(err, CoreError::Detached { .. }), "{err}");
    hooks.end_phase().unwrap();
    let installed: Arc<dyn AttachedRoute> = hooks;
    assert!(c.remove_hooks(&installed));
    drop(installed);

    // Dropping the last reference releases what a never-detached route holds.
    let (hooks, _metrics) = attach(&c, &device, &case.spec());
    assert_eq!(run(&c, &*device, &xs[0]), expected[0]);
    hooks.before_forward().unwrap();
    assert!(device.memory_info().allocated > 0);
    assert!(device.memory_info().pinned_host > 0);
    let installed: Arc<dyn AttachedRoute> = hooks;
    assert!(c.remove_hooks(&installed));
    drop(installed);
    assert_eq!(device.memory_info().allocated, 0);
    assert_eq!(device.memory_info().pinned_host, 0);
    assert!(c.params().iter().all(|p| p.device().is_none()));
}

#[test]
fn the_hooks_describe_themselves_and_are_owned_by_handle_and_component() {
    let spec = ReferenceSpec::small("vae", 2, 4, DType::F32);
    let c = build(&spec).unwrap();
    let device = slow_device(1 << 20, 4e6);
    let route_spec: ddo_core::RouteSpec = ddo_core::RouteSpec::parse(
        "diffusers_group_offload:offload_type=leaf_level,use_stream=false",
        &ddo_core::RouteId::BUILT_IN,
    )
    .unwrap();
    assert_eq!(GroupOffloadRoute.id(), RouteId::DIFFUSERS_GROUP_OFFLOAD);
    let dev: Arc<dyn Device> = device.clone();
    let metrics = Arc::new(RouteMetrics::new());
    let hooks = checked_attach(&c, dev.clone(), &route_spec, metrics.clone()).unwrap();
    assert_eq!(hooks.route(), RouteId::DIFFUSERS_GROUP_OFFLOAD);
    assert_eq!(hooks.route_name(), "diffusers_group_offload");
    assert_eq!(hooks.describe(), route_spec.describe());
    assert_eq!(hooks.device_id(), device.id());
    assert!(!hooks.removable());
    assert!(Arc::ptr_eq(hooks.metrics(), &metrics));
    assert!(format!("{hooks:?}").contains("AttachedGroupOffload"));
    let counters = metrics.counters();
    assert_eq!(counters.leaves_streamed, c.leaves().len() as u64);
    assert_eq!(counters.pinned_host_bytes, device.memory_info().pinned_host);
    // Attaching does not install; a second route on an installed component is refused
    // before it touches anything.
    assert!(c.attached().is_none());
    c.install_hooks(hooks.clone()).unwrap();
    let err = checked_attach(&c, dev, &route_spec, Arc::new(RouteMetrics::new())).unwrap_err();
    assert!(matches!(err, CoreError::AlreadyAttached { .. }), "{err}");
    hooks.detach().unwrap();
    assert!(c.remove_hooks(&hooks));
}

#[test]
fn weights_made_resident_before_attach_are_offloaded_by_it() {
    let spec = ReferenceSpec::small("transformer", 2, 8, DType::F32);
    let c = build(&spec).unwrap();
    let device = slow_device(1 << 20, 4e6);
    c.to_device(&*device, &device.compute_stream()).unwrap();
    assert_eq!(device.memory_info().allocated, c.param_bytes());
    // The route itself, below the registry (whose checks refuse weights already on a
    // device): it offloads them.
    let dev: Arc<dyn Device> = device.clone();
    let hooks = GroupOffloadRoute
        .attach_group_offload(
            &c,
            dev,
            &ddo_core::RouteSpec::leaf_group(false, false),
            Arc::new(RouteMetrics::new()),
        )
        .unwrap();
    c.install_hooks(hooks.clone()).unwrap();
    assert_eq!(device.memory_info().allocated, 0);
    // A device copy installed behind the route's back is dropped on detach too: every
    // param ends host-only.
    let p = &c.params()[0];
    let stray = device.alloc(p.nbytes()).unwrap();
    p.set_device(Some(stray.slice_all())).unwrap();
    drop(stray);
    detach_and_check_released(&c, &device, hooks, 0);
}

/// Without a stream nothing is pinned by default (Diffusers' no-stream calls, the seed's VAE
/// leaf policy), and the footprint does not call that pageable staging: there is no pinned
/// limit to raise, so `ddo run` prints no "would avoid it" note for it. Only `pinned=true`
/// that the limit cannot hold is pageable staging, naming the limit that would hold it.
#[test]
fn a_no_stream_default_is_unpinned_by_design_not_pageable_staging() {
    use ddo_core::{AllocatorKind, FootprintContext, RouteSpec};
    let spec = ReferenceSpec::small("vae", 3, 8, DType::F16);
    let c = build(&spec).unwrap();
    let weights = c.param_bytes();
    let context = |pinned_room| FootprintContext {
        free_device_bytes: 1 << 30,
        pinned_room,
        supports_streams: true,
        allocator: AllocatorKind::Caching,
    };
    let default = RouteSpec::leaf_group(false, false);
    for room in [0, 1 << 30] {
        let f = GroupOffloadRoute
            .footprint(&c, &default, &context(room))
            .unwrap();
        assert_eq!(f.pinned_host_bytes, 0, "room {room}");
        assert!(!f.pageable_staging, "room {room}: unpinned by design");
        assert_eq!(f.pinned_limit_to_avoid_pageable, 0, "room {room}");
    }
    let asked: RouteSpec = ddo_core::RouteSpec::parse(
        "diffusers_group_offload:use_stream=false,pinned=true",
        &ddo_core::RouteId::BUILT_IN,
    )
    .unwrap();
    let fits = GroupOffloadRoute
        .footprint(&c, &asked, &context(1 << 30))
        .unwrap();
    assert_eq!(fits.pinned_host_bytes, weights);
    assert!(!fits.pageable_staging);
    let short = GroupOffloadRoute
        .footprint(&c, &asked, &context(weights - 1))
        .unwrap();
    assert_eq!(short.pinned_host_bytes, 0);
    assert!(short.pageable_staging, "pinned=true the limit refused");
    assert_eq!(short.pinned_limit_to_avoid_pageable, weights);
}
