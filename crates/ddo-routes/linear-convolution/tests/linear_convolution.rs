//! `linear_convolution` on the host backend: outputs bit-identical to resident execution,
//! zero residency between leaves, a peak of one leaf plus activations, nothing left after
//! detach, one test per preflight refusal, and out-of-memory as a typed error.

use ddo_core::route::checked_preflight;
use std::sync::Arc;

use ddo_core::reference::{self, LeafSpec, ReferenceSpec};
use ddo_core::{
    AllocatorKind, AttachedRoute, Component, CoreError, DType, Device, HostBuffer, LeafKind,
    Module, Param, ParamKind, Refusal, Route, RouteId, RouteSpec,
};
use ddo_host::{HostDevice, HostDeviceConfig};
use ddo_metrics::RouteMetrics;
use ddo_route_linear_convolution::{
    BUDGET_HINT, GROUP_OFFLOAD_HINT, LinearConvolutionAttachment, LinearConvolutionRoute,
};
use proptest::prelude::*;

fn device(capacity: u64) -> Arc<HostDevice> {
    HostDevice::with_capacity(capacity).unwrap()
}

fn spec_text(text: &str) -> RouteSpec {
    RouteSpec::parse(text, &ddo_core::RouteId::BUILT_IN).unwrap()
}

/// Runs the registry's checks ([`checked_preflight`]), attaches and installs the hooks.
fn attach(
    c: &Arc<Component>,
    d: &Arc<HostDevice>,
    spec: &RouteSpec,
) -> ddo_core::Result<Arc<LinearConvolutionAttachment>> {
    checked_preflight(&LinearConvolutionRoute, c, &**d, spec)?;
    let hooks = LinearConvolutionRoute.attach_hooks(
        c,
        Arc::clone(d) as Arc<dyn Device>,
        spec,
        Arc::new(RouteMetrics::new()),
    )?;
    c.install_hooks(Arc::clone(&hooks) as Arc<dyn AttachedRoute>)?;
    Ok(hooks)
}

/// Outputs of `forwards` forwards with every weight resident, on a fresh device.
fn resident_outputs(spec: &ReferenceSpec, batch: usize, forwards: u64) -> Vec<Vec<u8>> {
    let c = reference::build(spec).unwrap();
    let d = device(1 << 30);
    let s = d.compute_stream();
    c.to_device(&*d, &s).unwrap();
    let out = (0..forwards)
        .map(|i| {
            let y = c
                .forward(&*d, reference::input(spec, batch, 100 + i).unwrap())
                .unwrap();
            y.to_host_bytes(&*d, &s).unwrap()
        })
        .collect();
    c.to_host().unwrap();
    assert_eq!(d.memory_info().allocated, 0);
    out
}

/// Largest activation of a forward of `batch` rows, in bytes (activations are f32).
fn max_activation(spec: &ReferenceSpec, batch: usize) -> u64 {
    let widths = spec
        .stem
        .iter()
        .chain(spec.blocks.iter().flatten())
        .chain(&spec.head)
        .filter_map(|l| l.out_features);
    (widths.chain([spec.in_features]).max().unwrap() * batch * 4) as u64
}

fn checksums(c: &Component) -> Vec<u64> {
    c.params().iter().map(|p| p.host_checksum()).collect()
}

fn assert_host_only(c: &Component) {
    for p in c.params() {
        assert!(p.device().is_none(), "{} still has a device copy", p.name());
    }
}

fn arb_leaf() -> impl Strategy<Value = LeafSpec> {
    prop_oneof![
        (1usize..12).prop_map(LeafSpec::linear),
        Just(LeafSpec::norm())
    ]
}

prop_compose! {
    fn arb_spec()(
        width in 2usize..10,
        stem_out in 1usize..12,
        blocks in prop::collection::vec(prop::collection::vec(arb_leaf(), 1..3), 0..4),
        dtype in prop_oneof![Just(DType::F32), Just(DType::F16), Just(DType::BF16)],
        tie in any::<bool>(),
        seed in any::<u64>(),
    ) -> ReferenceSpec {
        ReferenceSpec {
            name: "vae".into(),
            class_name: "ReferenceModel".into(),
            dtype,
            in_features: width,
            // A tied head needs a stem that maps in_features to itself.
            stem: vec![LeafSpec::linear(if tie { width } else { stem_out })],
            blocks,
            head: vec![LeafSpec::norm(), LeafSpec::linear(width)],
            tie_head_to_stem: tie,
            seed,
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 20, ..ProptestConfig::default() })]

    #[test]
    fn outputs_match_resident_with_zero_residency_and_nothing_left_after_detach(
        spec in arb_spec(),
        batch in 1usize..4,
        pinned in any::<bool>(),
    ) {
        let forwards = 3;
        let expected = resident_outputs(&spec, batch, forwards);
        let c = reference::build(&spec).unwrap();
        let before = checksums(&c);
        let d = device(1 << 24);
        let s = d.compute_stream();
        let route_spec = if pinned {
            RouteSpec::route(RouteId::LINEAR_CONVOLUTION)
        } else {
            spec_text("linear_convolution:pinned=false")
        };
        let hooks = attach(&c, &d, &route_spec).unwrap();
        // Attach puts nothing on the device; pinned, the params' one host copy becomes a
        // pinned home (each param, tied ones once, at a multiple of 256 bytes): no second
        // copy of any weight.
        prop_assert_eq!(d.memory_info().allocated, 0);
        let pinned_bytes = if pinned { home_bytes(&c) } else { 0 };
        prop_assert!(c.params().iter().all(|p| (p.host().kind() == ddo_core::HostMemoryKind::Pinned) == pinned));
        prop_assert_eq!(d.memory_info().pinned_host, pinned_bytes);
        prop_assert_eq!(hooks.pinned_bytes(), pinned_bytes);
        let counters = hooks.metrics().counters();
        prop_assert_eq!(counters.leaves_streamed, c.leaves().len() as u64);
        prop_assert_eq!(counters.leaves_resident, 0);
        prop_assert_eq!(counters.resident_weight_bytes, 0);
        prop_assert_eq!(counters.pinned_host_bytes, pinned_bytes);

        let largest = c.largest_leaf().unwrap().param_bytes();
        let bound = largest + 2 * max_activation(&spec, batch);
        for (i, want) in expected.iter().enumerate() {
            d.reset_peak();
            let y = c
                .forward(&*d, reference::input(&spec, batch, 100 + i as u64).unwrap())
                .unwrap();
            // Zero residency: between forwards the caller's output is all there is.
            prop_assert_eq!(d.memory_info().allocated, y.nbytes() as u64);
            prop_assert_eq!(hooks.device_weight_bytes(), 0);
            let peak = d.memory_info().peak_allocated;
            prop_assert!(peak <= bound, "peak {} > largest leaf {} + activations", peak, largest);
            prop_assert_eq!(&y.to_host_bytes(&*d, &s).unwrap(), want);
        }
        // Every leaf's weights crossed the link once per forward (tied weights per leaf).
        let per_forward: u64 = c.leaves().iter().map(|l| l.param_bytes()).sum();
        prop_assert_eq!(hooks.metrics().counters().h2d_bytes, per_forward * forwards);

        hooks.detach().unwrap();
        hooks.detach().unwrap();
        let m = d.memory_info();
        prop_assert_eq!((m.allocated, m.pinned_host), (0, 0));
        prop_assert_eq!(hooks.metrics().counters().pinned_host_bytes, 0);
        assert_host_only(&c);
        prop_assert_eq!(checksums(&c), before);
    }
}

/// The footprint states the pinned home the route makes by default (each param at a multiple
/// of 256 bytes: the weights' one host copy, no second cache) and, with `pinned=false`,
/// nothing pinned, which is the caller's choice and not pageable staging forced by a pinned
/// limit (so no "would avoid it" note); attach holds what the footprint says.
#[test]
fn the_footprint_states_the_one_pinned_home_and_pinned_false_is_no_pageable_staging() {
    use ddo_core::FootprintContext;
    let spec = ReferenceSpec::small("vae", 2, 8, DType::BF16);
    for (text, pinned) in [
        ("linear_convolution", true),
        ("linear_convolution:pinned=false", false),
    ] {
        let c = reference::build(&spec).unwrap();
        let d = device(1 << 20);
        let rs = spec_text(text);
        let f = LinearConvolutionRoute
            .footprint(&c, &rs, &FootprintContext::of(&*d))
            .unwrap();
        let home: u64 = c
            .params()
            .iter()
            .map(|p| (p.nbytes() as u64).next_multiple_of(256))
            .sum();
        assert_eq!(f.pinned_host_bytes, if pinned { home } else { 0 }, "{text}");
        assert!(!f.pageable_staging, "{text}");
        assert_eq!(f.pinned_limit_to_avoid_pageable, 0, "{text}");
        let hooks = LinearConvolutionRoute
            .attach_hooks(
                &c,
                Arc::clone(&d) as Arc<dyn Device>,
                &rs,
                Arc::new(RouteMetrics::new()),
            )
            .unwrap();
        assert_eq!(hooks.pinned_bytes(), f.pinned_host_bytes, "{text}");
        assert_eq!(d.memory_info().pinned_host, f.pinned_host_bytes, "{text}");
        hooks.detach().unwrap();
        assert_eq!(d.memory_info().pinned_host, 0, "{text}");
    }
}

#[test]
fn attach_through_the_route_trait_pins_by_default_and_is_removable() {
    let spec = ReferenceSpec::small("vae", 2, 8, DType::BF16);
    let c = reference::build(&spec).unwrap();
    let d = device(1 << 20);
    let metrics = Arc::new(RouteMetrics::new());
    let route: &dyn Route = &LinearConvolutionRoute;
    assert_eq!(route.id(), RouteId::LINEAR_CONVOLUTION);
    let rs = RouteSpec::route(RouteId::LINEAR_CONVOLUTION);
    route.preflight(&c, &*d, &rs).unwrap();
    let hooks = route
        .attach(
            &c,
            Arc::clone(&d) as Arc<dyn Device>,
            &rs,
            Arc::clone(&metrics),
        )
        .unwrap();
    assert_eq!(hooks.route(), RouteId::LINEAR_CONVOLUTION);
    assert_eq!(hooks.route_name(), "linear_convolution");
    assert!(hooks.removable());
    assert_eq!(hooks.device_id(), d.id());
    assert!(
        hooks.describe().contains("pinned=true"),
        "{}",
        hooks.describe()
    );
    assert_eq!(metrics.counters().pinned_host_bytes, home_bytes(&c));
    c.install_hooks(Arc::clone(&hooks)).unwrap();
    let y = c
        .forward(&*d, reference::input(&spec, 2, 1).unwrap())
        .unwrap();
    drop(y);
    hooks.end_phase().unwrap();
    assert_eq!(d.memory_info().allocated, 0);
    assert_eq!(metrics.counters().forwards, 1);
    assert_eq!(metrics.counters().leaf_calls, c.leaves().len() as u64);
    assert!(c.remove_hooks(&hooks));
    hooks.detach().unwrap();
    assert_eq!(d.memory_info().pinned_host, 0);
    // Unpinned in place: the params read the same values from pageable bytes.
    assert!(
        c.params()
            .iter()
            .all(|p| p.host().kind() != ddo_core::HostMemoryKind::Pinned)
    );
}

/// The pinned home of `c`'s params: each once, at a multiple of 256 bytes.
fn home_bytes(c: &ddo_core::Component) -> u64 {
    c.params()
        .iter()
        .map(|p| (p.nbytes() as u64).next_multiple_of(256))
        .sum()
}

#[test]
fn dropping_the_attachment_detaches() {
    let spec = ReferenceSpec::small("vae", 2, 8, DType::F16);
    let c = reference::build(&spec).unwrap();
    let d = device(1 << 20);
    let hooks = attach(&c, &d, &RouteSpec::route(RouteId::LINEAR_CONVOLUTION)).unwrap();
    let y = c
        .forward(&*d, reference::input(&spec, 1, 1).unwrap())
        .unwrap();
    drop(y);
    assert!(d.memory_info().pinned_host > 0);
    let installed = c.attached().unwrap();
    assert!(c.remove_hooks(&installed));
    drop(installed);
    drop(hooks);
    let m = d.memory_info();
    assert_eq!((m.allocated, m.pinned_host), (0, 0));
    assert_host_only(&c);
}

#[test]
fn a_forward_after_detach_is_refused_and_allocates_nothing() {
    let spec = ReferenceSpec::small("vae", 1, 4, DType::F32);
    let c = reference::build(&spec).unwrap();
    let d = device(1 << 20);
    let hooks = attach(&c, &d, &RouteSpec::route(RouteId::LINEAR_CONVOLUTION)).unwrap();
    hooks.detach().unwrap();
    let err = c
        .forward(&*d, reference::input(&spec, 1, 1).unwrap())
        .unwrap_err();
    assert!(matches!(err, CoreError::Detached { .. }), "{err}");
    assert_eq!(d.memory_info().allocated, 0);
}

fn refusal(err: CoreError) -> Refusal {
    match err {
        CoreError::Refused {
            route: "linear_convolution",
            refusal,
            ..
        } => refusal,
        other => panic!("expected a linear_convolution refusal, got {other}"),
    }
}

/// The registry's checks and attach both refuse with the same refusal, and nothing is allocated,
/// pinned or moved.
fn refused(c: &Arc<Component>, d: &Arc<HostDevice>, spec: &RouteSpec) -> Refusal {
    let before = checksums(c);
    let from_preflight =
        refusal(checked_preflight(&LinearConvolutionRoute, c, &**d, spec).unwrap_err());
    let from_attach = refusal(attach(c, d, spec).unwrap_err());
    assert_eq!(from_preflight, from_attach);
    let m = d.memory_info();
    assert_eq!((m.allocated, m.pinned_host), (0, 0));
    assert!(c.attached().is_none());
    assert_host_only(c);
    assert_eq!(checksums(c), before);
    from_attach
}

#[test]
fn refuses_the_installed_native_allocator() {
    let spec = ReferenceSpec::small("vae", 1, 4, DType::F32);
    let c = reference::build(&spec).unwrap();
    let d = HostDevice::new(HostDeviceConfig {
        allocator: AllocatorKind::NativeVmm,
        ..HostDeviceConfig::default()
    })
    .unwrap();
    let r = refused(&c, &d, &RouteSpec::route(RouteId::LINEAR_CONVOLUTION));
    assert_eq!(r, Refusal::NativeAllocatorInstalled);
}

use ddo_core::reference::IdentityProgram as Identity;

#[test]
fn refuses_quantized_params() {
    let dense = Param::from_f32(
        "proj.weight",
        ParamKind::Parameter,
        DType::F16,
        vec![2],
        &[1.0, 2.0],
    )
    .unwrap();
    let q = Param::new(
        "quant.weight",
        ParamKind::Parameter,
        DType::Quantized,
        vec![8],
        HostBuffer::pageable_from(&[3u8; 8]).slice_all(),
    )
    .unwrap();
    let root = Module::container(
        "",
        vec![
            Module::leaf("proj", LeafKind::Linear, vec![("weight".into(), dense)]),
            Module::leaf("quant", LeafKind::Linear, vec![("weight".into(), q)]),
        ],
    );
    let c = Component::new("vae", "Quantized", root, Arc::new(Identity)).unwrap();
    let d = device(1 << 20);
    let r = refused(&c, &d, &RouteSpec::route(RouteId::LINEAR_CONVOLUTION));
    assert_eq!(
        r,
        Refusal::Quantized {
            param: "quant.weight".into()
        }
    );
}

/// fp8 weights are quantized modules to this route as the seed words it (its eager
/// forward computes in the stored dtype): refused with the routes that take them.
#[test]
fn refuses_fp8_params() {
    for dtype in [DType::F8E4M3, DType::F8E5M2] {
        let w = Param::new(
            "proj.weight",
            ParamKind::Parameter,
            dtype,
            vec![8],
            HostBuffer::pageable_from(&[0x38u8; 8]).slice_all(),
        )
        .unwrap();
        let root = Module::container(
            "",
            vec![Module::leaf(
                "proj",
                LeafKind::Linear,
                vec![("weight".into(), w)],
            )],
        );
        let c = Component::new("transformer", "Fp8", root, Arc::new(Identity)).unwrap();
        let d = device(1 << 20);
        let r = refused(&c, &d, &RouteSpec::route(RouteId::LINEAR_CONVOLUTION));
        assert_eq!(
            r,
            Refusal::Quantized {
                param: "proj.weight".into()
            },
            "{dtype}"
        );
        assert!(r.to_string().contains("diffusers_group_offload"), "{r}");
        // What `ddo inspect` is told from the headers is what the preflight refuses.
        assert!(!LinearConvolutionRoute.takes_weight_dtype(dtype), "{dtype}");
    }
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        assert!(LinearConvolutionRoute.takes_weight_dtype(dtype), "{dtype}");
    }
}

#[test]
fn refuses_a_budget() {
    let spec = ReferenceSpec::small("vae", 1, 4, DType::F32);
    let c = reference::build(&spec).unwrap();
    let d = device(1 << 20);
    let r = refused(&c, &d, &spec_text("linear_convolution:budget=1MiB"));
    assert_eq!(
        r,
        Refusal::UnsupportedOption {
            option: "budget",
            hint: BUDGET_HINT
        }
    );
    assert!(BUDGET_HINT.contains("native_vmm"));
}

#[test]
fn refuses_group_offload_options() {
    let spec = ReferenceSpec::small("vae", 1, 4, DType::F32);
    let c = reference::build(&spec).unwrap();
    let d = device(1 << 20);
    for (text, option) in [
        ("linear_convolution:offload_type=leaf_level", "offload_type"),
        (
            "linear_convolution:offload_type=block_level,num_blocks_per_group=1",
            "num_blocks_per_group",
        ),
        ("linear_convolution:use_stream=false", "use_stream"),
        (
            "linear_convolution:use_stream=true,record_stream=true",
            "record_stream",
        ),
        (
            "linear_convolution:low_cpu_mem_usage=true",
            "low_cpu_mem_usage",
        ),
    ] {
        let r = refused(&c, &d, &spec_text(text));
        assert_eq!(
            r,
            Refusal::UnsupportedOption {
                option,
                hint: GROUP_OFFLOAD_HINT
            },
            "{text}"
        );
    }
    // `pinned` is the one option the route takes.
    attach(&c, &d, &spec_text("linear_convolution:pinned=true"))
        .unwrap()
        .detach()
        .unwrap();
}

#[test]
fn out_of_memory_in_a_forward_is_typed_and_leaves_nothing_behind() {
    // A small first leaf that fits, then a head leaf (64x4 f32 weight: 1 KiB) that does not.
    let spec = ReferenceSpec {
        name: "vae".into(),
        class_name: "ReferenceModel".into(),
        dtype: DType::F32,
        in_features: 4,
        stem: vec![LeafSpec::linear(4)],
        blocks: vec![vec![LeafSpec::norm()]],
        head: vec![LeafSpec::linear(64)],
        tie_head_to_stem: false,
        seed: 3,
    };
    let c = reference::build(&spec).unwrap();
    let before = checksums(&c);
    let d = device(700);
    let hooks = attach(&c, &d, &RouteSpec::route(RouteId::LINEAR_CONVOLUTION)).unwrap();
    for _ in 0..2 {
        let err = c
            .forward(&*d, reference::input(&spec, 2, 1).unwrap())
            .unwrap_err();
        assert!(matches!(err, CoreError::OutOfMemory { .. }), "{err}");
        // The earlier leaves were freed; the failed one rolled back.
        assert_eq!(d.memory_info().allocated, 0);
        assert_eq!(hooks.device_weight_bytes(), 0);
    }
    assert!(hooks.metrics().counters().h2d_copies > 0);
    hooks.detach().unwrap();
    let m = d.memory_info();
    assert_eq!((m.allocated, m.pinned_host), (0, 0));
    assert_host_only(&c);
    assert_eq!(checksums(&c), before);
}

#[test]
fn the_pinned_limit_fails_attach_and_pins_nothing() {
    let spec = ReferenceSpec::small("vae", 2, 8, DType::F32);
    let c = reference::build(&spec).unwrap();
    let d = HostDevice::new(HostDeviceConfig {
        pinned_limit: c.param_bytes() / 2,
        ..HostDeviceConfig::default()
    })
    .unwrap();
    let err = attach(&c, &d, &RouteSpec::route(RouteId::LINEAR_CONVOLUTION)).unwrap_err();
    assert!(matches!(err, CoreError::PinnedLimit { .. }), "{err}");
    assert_eq!(d.memory_info().pinned_host, 0);
    // Without pinned weights the same device runs it.
    let hooks = attach(&c, &d, &spec_text("linear_convolution:pinned=false")).unwrap();
    drop(
        c.forward(&*d, reference::input(&spec, 1, 1).unwrap())
            .unwrap(),
    );
    hooks.detach().unwrap();
    assert_eq!(d.memory_info().allocated, 0);
}
