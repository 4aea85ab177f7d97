//! The seed's contract through the public entry points: the VAE table row by row, explicit
//! routes never replaced, policies scoped to their component, the low-level API applying
//! exactly its config, ownership of hooks, and the environment switch.

mod common;

use ddo_route_leaf_group::GroupOffloadConfig;
use std::sync::Arc;

use common::*;
use ddo_core::Device;
use ddo_core::reference::{self, ReferenceSpec};
use ddo_core::{
    AllocatorKind, CoreError, DType, DecidedBy, MapEnvironment, OffloadType, Preset, Refusal,
    RouteId, RouteSpec, RouteTarget, Settings,
};
use ddo_routes::{
    OffloadOptions, Pipeline, enable_dynamic_offload, enable_offload_with_env,
    enable_pipeline_offload_with_env, remove_dynamic_offload,
};

fn vae() -> (Arc<ddo_core::Component>, ReferenceSpec) {
    let mut spec = ReferenceSpec::small("vae", 2, 8, DType::F32);
    spec.class_name = "AutoencoderKL".into();
    (reference::build(&spec).unwrap(), spec)
}

fn options(preset: Preset) -> OffloadOptions {
    OffloadOptions {
        settings: Settings {
            preset,
            ..Settings::default()
        },
        ..OffloadOptions::default()
    }
}

fn no_env() -> MapEnvironment {
    MapEnvironment::default()
}

fn assert_vae_leaf_no_stream(spec: &RouteSpec) {
    assert_eq!(spec.route_id(), Some(RouteId::DIFFUSERS_GROUP_OFFLOAD));
    let c = GroupOffloadConfig::from_spec(spec);
    assert_eq!(c.offload_type, OffloadType::LeafLevel);
    assert!(!c.use_stream, "VAE default must not use a stream");
    assert!(
        !c.low_cpu_mem_usage,
        "VAE default uses low_cpu_mem_usage=false"
    );
}

#[test]
fn vae_row_auto_attaches_leaf_no_stream_as_one_shot_fast() {
    let (c, spec) = vae();
    let d = device(1 << 24);
    let h = enable_offload_with_env(&c, dyn_device(&d), &options(Preset::Auto), &no_env()).unwrap();
    assert_vae_leaf_no_stream(h.spec());
    assert_eq!(h.preset(), Some(Preset::OneShotFast));
    assert_eq!(
        c.attached().unwrap().route(),
        RouteId::DIFFUSERS_GROUP_OFFLOAD
    );
    let out = h.forward(reference::input(&spec, 2, 1).unwrap()).unwrap();
    assert_eq!(
        bytes_of(&*d, &out),
        baseline(&c_for_baseline(&spec), &spec, 2, 1)
    );
}

// A second instance of the same weights for the baseline (the first is attached).
fn c_for_baseline(spec: &ReferenceSpec) -> Arc<ddo_core::Component> {
    reference::build(spec).unwrap()
}

#[test]
fn vae_rows_one_shot_fast_low_ram_safe_vmm_fast_attach_leaf_no_stream() {
    for preset in [Preset::OneShotFast, Preset::LowRamSafe, Preset::VmmFast] {
        let (c, _) = vae();
        let d = device(1 << 24);
        let h = enable_offload_with_env(&c, dyn_device(&d), &options(preset), &no_env())
            .unwrap_or_else(|e| panic!("{preset}: {e}"));
        assert_vae_leaf_no_stream(h.spec());
        // vmm_fast's VAE row needs no native allocator and installs none. Without a stream
        // nothing is page-locked, as Diffusers' no-stream calls pin nothing (the seed's
        // VAE leaf policy); the weights are copied from their own pageable bytes.
        assert_eq!(d.memory_info().pinned_host, 0, "{preset}: nothing pinned");
        assert!(
            c.params()
                .iter()
                .all(|p| p.host().kind() != ddo_core::HostMemoryKind::Pinned),
            "{preset}: the params' bytes stay as they were"
        );
        assert_eq!(ddo_core::Device::allocator(&*d), AllocatorKind::Caching);
    }
}

/// The seed's VAE row for vmm_fast holds on a device whose native allocator was installed
/// at bootstrap too: leaf, no stream, nothing pinned, the weights and activations served by
/// the native pool, the output byte-identical to the resident baseline, and the pool holding
/// no live bytes once the output is dropped (each leaf's weights go back after its call).
#[test]
fn vae_row_vmm_fast_on_a_native_device_is_leaf_no_stream() {
    let (c, spec) = vae();
    let n = native_device(2 << 30);
    assert_eq!(Device::allocator(&*n), AllocatorKind::NativeVmm);
    let h =
        enable_offload_with_env(&c, dyn_device(&n), &options(Preset::VmmFast), &no_env()).unwrap();
    assert_vae_leaf_no_stream(h.spec());
    assert_eq!(n.memory_info().pinned_host, 0, "nothing pinned");
    let out = h.forward(reference::input(&spec, 2, 1).unwrap()).unwrap();
    assert_eq!(
        bytes_of(&*n, &out),
        baseline(&c_for_baseline(&spec), &spec, 2, 1)
    );
    let pool = Device::native_pool_figures(&*n).expect("a native device reports its pool");
    assert!(
        pool.peak_live_bytes > 0,
        "the pool served the forward: {pool:?}"
    );
    drop(out);
    n.synchronize().unwrap();
    let pool = Device::native_pool_figures(&*n).unwrap();
    assert_eq!(
        pool.live_bytes, 0,
        "nothing of the VAE stays live: {pool:?}"
    );
    assert_eq!(Device::allocator(&*n), AllocatorKind::NativeVmm);
}

#[test]
fn vae_rows_warm_process_wsl_compat_nvme_baseline_attach_resident() {
    for preset in [Preset::WarmProcess, Preset::WslCompat, Preset::NvmeBaseline] {
        let (c, _) = vae();
        let d = device(1 << 24);
        let h = enable_offload_with_env(&c, dyn_device(&d), &options(preset), &no_env()).unwrap();
        assert_eq!(h.spec().route_id(), Some(RouteId::RESIDENT), "{preset}");
        assert_eq!(d.memory_info().allocated, c.param_bytes(), "{preset}");
    }
}

#[test]
fn vae_row_off_leaves_the_component_unmanaged() {
    let (c, spec) = vae();
    let d = device(1 << 24);
    let h = enable_offload_with_env(&c, dyn_device(&d), &options(Preset::Off), &no_env()).unwrap();
    assert_eq!(h.target(), RouteTarget::Unmanaged);
    assert!(c.attached().is_none());
    assert_eq!(d.memory_info().allocated, 0, "off moves nothing");
    // Unmanaged means the caller places the weights, as `pipe.to(device)` would.
    let err = h
        .forward(reference::input(&spec, 1, 1).unwrap())
        .unwrap_err();
    assert!(matches!(err, CoreError::NotResident { .. }), "{err}");
    c.to_device(&*d, &d.compute_stream()).unwrap();
    h.forward(reference::input(&spec, 1, 1).unwrap()).unwrap();
}

#[test]
fn vae_defaults_never_come_from_the_class_name() {
    // An AutoencoderKL registered as "decoder" follows the transformer row, not the VAE row.
    let mut spec = ReferenceSpec::small("decoder", 2, 8, DType::F32);
    spec.class_name = "AutoencoderKL".into();
    let c = reference::build(&spec).unwrap();
    let d = device(1 << 24);
    let h = enable_offload_with_env(&c, dyn_device(&d), &options(Preset::Auto), &no_env()).unwrap();
    assert!(
        GroupOffloadConfig::from_spec(h.spec()).use_stream,
        "decoder got the VAE row"
    );

    // And a component named "vae" gets the VAE row whatever its class.
    let mut spec = ReferenceSpec::small("vae", 2, 8, DType::F32);
    spec.class_name = "SomethingElse".into();
    let c = reference::build(&spec).unwrap();
    let h = enable_offload_with_env(&c, dyn_device(&d), &options(Preset::Auto), &no_env()).unwrap();
    assert_vae_leaf_no_stream(h.spec());
}

#[test]
fn an_explicit_route_is_never_replaced() {
    for preset in Preset::ALL {
        let (c, _) = vae();
        let d = device(1 << 24);
        let mut o = options(preset);
        o.route = Some(ddo_routes::parse_spec("linear_convolution").unwrap());
        let h = enable_offload_with_env(&c, dyn_device(&d), &o, &no_env()).unwrap();
        assert_eq!(
            h.spec().route_id(),
            Some(RouteId::LINEAR_CONVOLUTION),
            "{preset}"
        );
        assert_eq!(h.decided_by(), &DecidedBy::ExplicitRoute);
    }
    // An explicit route that cannot run is refused, not swapped for one that can.
    let (c, _) = vae();
    let d = device(1 << 24);
    let mut o = options(Preset::Auto);
    o.route = Some(ddo_routes::parse_spec("native_vmm:budget=1MiB").unwrap());
    let err = enable_offload_with_env(&c, dyn_device(&d), &o, &no_env()).unwrap_err();
    assert!(
        matches!(
            err,
            CoreError::Refused {
                refusal: Refusal::NativeAllocatorRequired,
                ..
            }
        ),
        "{err}"
    );
    assert!(c.attached().is_none());
    assert_eq!(d.memory_info().allocated, 0);
}

#[test]
fn a_vae_policy_does_not_change_the_transformer_policy() {
    let (v, _) = vae();
    let t = reference::build(&ReferenceSpec::small("transformer", 2, 8, DType::BF16)).unwrap();
    let pipeline = Pipeline::new(vec![v, t]).unwrap();
    let d = device(1 << 24);
    let mut settings = Settings::default();
    let before = enable_pipeline_offload_with_env(&pipeline, dyn_device(&d), &settings, &no_env())
        .unwrap()
        .handle("transformer")
        .unwrap()
        .spec()
        .to_owned();
    settings.component_policies.insert(
        "vae".into(),
        ddo_routes::parse_spec("linear_convolution").unwrap(),
    );
    let p = enable_pipeline_offload_with_env(&pipeline, dyn_device(&d), &settings, &no_env());
    // The first PipelineOffload's group-offload hooks stay on the components until they are
    // dropped (the seed's ownership rule), so the second attach is refused.
    let err = p.unwrap_err();
    assert!(matches!(err, CoreError::AlreadyAttached { .. }), "{err}");

    let (v, _) = vae();
    let t = reference::build(&ReferenceSpec::small("transformer", 2, 8, DType::BF16)).unwrap();
    let pipeline = Pipeline::new(vec![v, t]).unwrap();
    let p =
        enable_pipeline_offload_with_env(&pipeline, dyn_device(&d), &settings, &no_env()).unwrap();
    assert_eq!(
        p.handle("vae").unwrap().spec().route_id(),
        Some(RouteId::LINEAR_CONVOLUTION)
    );
    assert_eq!(
        p.handle("vae").unwrap().decided_by(),
        &DecidedBy::ComponentPolicy
    );
    assert_eq!(p.handle("transformer").unwrap().spec(), &before);
}

#[test]
fn the_low_level_api_attaches_exactly_its_config() {
    let (c, _) = vae();
    let d = device(1 << 24);
    // Leaf level with a stream on a component named "vae": the VAE table does not apply.
    let spec = RouteSpec::leaf_group(true, false);
    let h = enable_dynamic_offload(&c, dyn_device(&d), spec).unwrap();
    assert_eq!(h.spec(), &spec);
    assert_eq!(h.decided_by(), &DecidedBy::LowLevelConfig);
    assert_eq!(h.preset(), None);
}

#[test]
fn remove_dynamic_offload_removes_only_what_it_attached() {
    let d = device(1 << 24);
    let a = reference::build(&ReferenceSpec::small("a", 2, 8, DType::F32)).unwrap();
    let b = reference::build(&ReferenceSpec::small("b", 2, 8, DType::F32)).unwrap();
    let mut ha = enable_dynamic_offload(&a, dyn_device(&d), RouteSpec::resident()).unwrap();
    let _hb = enable_dynamic_offload(&b, dyn_device(&d), RouteSpec::resident()).unwrap();
    remove_dynamic_offload(&mut ha).unwrap();
    assert!(a.attached().is_none());
    assert!(b.attached().is_some(), "removing a's route touched b");
    assert_eq!(d.memory_info().allocated, b.param_bytes());
    assert!(a.params().iter().all(|p| p.device().is_none()));
    // Removing again is a no-op; the handle reports detached.
    remove_dynamic_offload(&mut ha).unwrap();
    assert!(ha.is_detached());
    assert!(matches!(
        ha.forward(reference::input(&ReferenceSpec::small("a", 2, 8, DType::F32), 1, 1).unwrap()),
        Err(CoreError::Detached { .. })
    ));
}

#[test]
fn group_offload_hooks_end_when_handle_and_component_are_dropped() {
    let d = device(1 << 24);
    let spec = ReferenceSpec::small("transformer", 3, 8, DType::F32);
    let c = reference::build(&spec).unwrap();
    let mut h =
        enable_dynamic_offload(&c, dyn_device(&d), RouteSpec::leaf_group(true, false)).unwrap();
    let err = remove_dynamic_offload(&mut h).unwrap_err();
    assert!(matches!(err, CoreError::NotOwned { .. }), "{err}");
    assert!(c.attached().is_some(), "a refused removal changed nothing");
    h.forward(reference::input(&spec, 1, 1).unwrap()).unwrap();
    assert!(
        d.memory_info().pinned_host > 0,
        "stream mode keeps pinned copies"
    );

    // Dropping the handle alone leaves the hooks with the component, still working.
    drop(h);
    assert!(c.attached().is_some());
    c.forward(&*d, reference::input(&spec, 1, 1).unwrap())
        .unwrap();

    // Dropping the component too releases everything.
    let weak = Arc::downgrade(&c);
    drop(c);
    assert!(weak.upgrade().is_none());
    ddo_core::Device::synchronize(&*d).unwrap();
    let m = d.memory_info();
    assert_eq!((m.allocated, m.pinned_host), (0, 0));
}

#[test]
fn dropping_a_managed_handle_removes_its_route() {
    let d = device(1 << 24);
    let c = reference::build(&ReferenceSpec::small("vae", 2, 8, DType::F32)).unwrap();
    let h = enable_dynamic_offload(
        &c,
        dyn_device(&d),
        ddo_routes::parse_spec("linear_convolution").unwrap(),
    )
    .unwrap();
    assert!(d.memory_info().pinned_host > 0);
    drop(h);
    assert!(c.attached().is_none());
    assert_eq!(
        (d.memory_info().allocated, d.memory_info().pinned_host),
        (0, 0)
    );
}

#[test]
fn a_second_route_or_weights_placed_by_hand_are_refused() {
    let d = device(1 << 24);
    let c = reference::build(&ReferenceSpec::small("vae", 2, 8, DType::F32)).unwrap();
    let _h = enable_dynamic_offload(&c, dyn_device(&d), RouteSpec::resident()).unwrap();
    let err = enable_dynamic_offload(
        &c,
        dyn_device(&d),
        ddo_routes::parse_spec("linear_convolution").unwrap(),
    )
    .unwrap_err();
    assert!(matches!(err, CoreError::AlreadyAttached { .. }), "{err}");

    let c2 = reference::build(&ReferenceSpec::small("vae", 2, 8, DType::F32)).unwrap();
    c2.to_device(&*d, &d.compute_stream()).unwrap();
    let err = enable_dynamic_offload(&c2, dyn_device(&d), RouteSpec::resident()).unwrap_err();
    assert!(
        matches!(
            err,
            CoreError::Refused {
                refusal: Refusal::WeightsAlreadyOnDevice { .. },
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn use_environment_false_ignores_ddo_preset() {
    let env = MapEnvironment::from_pairs([("DDO_PRESET", "off"), ("DDO_VAE_ROUTE", "none")]);
    let (c, _) = vae();
    let d = device(1 << 24);
    let h = enable_offload_with_env(&c, dyn_device(&d), &options(Preset::Auto), &env).unwrap();
    assert_vae_leaf_no_stream(h.spec());
    drop(h);

    let (c, _) = vae();
    let mut o = options(Preset::Auto);
    o.settings.use_environment = true;
    let env = MapEnvironment::from_pairs([("DDO_PRESET", "off")]);
    let h = enable_offload_with_env(&c, dyn_device(&d), &o, &env).unwrap();
    assert_eq!(h.target(), RouteTarget::Unmanaged);
}

#[test]
fn vmm_fast_never_installs_the_native_allocator() {
    let d = device(1 << 24);
    let t = reference::build(&ReferenceSpec::small("transformer", 2, 8, DType::F32)).unwrap();
    let err = enable_offload_with_env(&t, dyn_device(&d), &options(Preset::VmmFast), &no_env())
        .unwrap_err();
    assert!(
        matches!(
            err,
            CoreError::Refused {
                refusal: Refusal::NativeAllocatorRequired,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(ddo_core::Device::allocator(&*d), AllocatorKind::Caching);
    // With the allocator installed at bootstrap (a native device), the same call attaches;
    // the default budget is what is free minus a 1 GiB margin, so give it room.
    let n = native_device(2 << 30);
    let h =
        enable_offload_with_env(&t, dyn_device(&n), &options(Preset::VmmFast), &no_env()).unwrap();
    assert_eq!(h.spec().route_id(), Some(RouteId::NATIVE_VMM));
}

#[test]
fn metrics_snapshot_reports_route_preset_and_memory() {
    let (c, spec) = vae();
    let d = device(1 << 24);
    let h = enable_offload_with_env(&c, dyn_device(&d), &options(Preset::Auto), &no_env()).unwrap();
    h.forward(reference::input(&spec, 2, 1).unwrap()).unwrap();
    h.end_phase("decode").unwrap();
    let snap = h.metrics_snapshot();
    assert_eq!(snap.route, "diffusers_group_offload");
    assert_eq!(snap.preset.as_deref(), Some("one_shot_fast"));
    assert_eq!(snap.decided_by, "preset default (one_shot_fast)");
    assert_eq!(snap.counters.forwards, 1);
    assert!(snap.counters.h2d_bytes >= c.param_bytes());
    assert_eq!(snap.phases.len(), 1);
    assert!(snap.phases[0].allocator_peak_bytes > 0);
    assert_eq!(
        snap.phases[0].allocator_end_bytes, 0,
        "leaf no-stream keeps nothing after a phase"
    );
    let json = snap.to_json().unwrap();
    assert!(json.contains("\"route\": \"diffusers_group_offload\""));
    let text = snap.format_profile();
    assert!(text.contains("phase decode"), "{text}");
}
