//! `native_vmm` on the host backend with the native allocator reported: outputs
//! bit-identical to resident execution under any budget, resident bytes and peak within
//! the budget, nothing left after detach, one test per preflight refusal, out-of-memory
//! during attach as a typed error, and the planner's properties.

use ddo_core::route::checked_preflight;
use std::sync::Arc;

use ddo_core::reference::{self, LeafSpec, ReferenceSpec};
use ddo_core::streaming::StagingKind;
use ddo_core::{
    AllocatorKind, AttachedRoute, Budget, Component, CoreError, DType, Device, Refusal, Route,
    RouteId, RouteSpec,
};
use ddo_host::{HostDevice, HostDeviceConfig};
use ddo_metrics::RouteMetrics;
use ddo_route_native_vmm::{
    DEFAULT_FREE_MARGIN, NativeVmmAttachment, NativeVmmRoute, OPTION_HINT, ResidencyPlan,
    StreamMode, budget_bytes, plan_residency,
};
use proptest::prelude::*;

fn native_device(capacity: u64) -> Arc<HostDevice> {
    HostDevice::new(HostDeviceConfig {
        capacity,
        allocator: AllocatorKind::NativeVmm,
        ..HostDeviceConfig::default()
    })
    .unwrap()
}

fn spec_text(text: &str) -> RouteSpec {
    RouteSpec::parse(text, &ddo_core::RouteId::BUILT_IN).unwrap()
}

fn budget_spec(bytes: u64, pinned: bool) -> RouteSpec {
    spec_text(&format!("native_vmm:budget={bytes},pinned={pinned}"))
}

/// Runs the registry's checks ([`checked_preflight`]), attaches and installs the hooks.
fn attach(
    c: &Arc<Component>,
    d: &Arc<HostDevice>,
    spec: &RouteSpec,
) -> ddo_core::Result<Arc<NativeVmmAttachment>> {
    checked_preflight(&NativeVmmRoute, c, &**d, spec)?;
    let hooks = NativeVmmRoute.attach_hooks(
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
    let d = HostDevice::with_capacity(1 << 30).unwrap();
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
        blocks in prop::collection::vec(prop::collection::vec(arb_leaf(), 1..3), 0..5),
        dtype in prop_oneof![Just(DType::F32), Just(DType::F16), Just(DType::BF16)],
        tie in any::<bool>(),
        seed in any::<u64>(),
    ) -> ReferenceSpec {
        ReferenceSpec {
            name: "transformer".into(),
            class_name: "ReferenceModel".into(),
            dtype,
            in_features: width,
            stem: vec![LeafSpec::linear(if tie { width } else { stem_out })],
            blocks,
            head: vec![LeafSpec::norm(), LeafSpec::linear(width)],
            tie_head_to_stem: tie,
            seed,
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn outputs_match_resident_within_the_budget_and_nothing_is_left_after_detach(
        spec in arb_spec(),
        batch in 1usize..4,
        pinned in any::<bool>(),
        // Where the budget falls between the largest leaf and a little over everything.
        fraction in 0.0f64..1.2,
    ) {
        let forwards = 3;
        let expected = resident_outputs(&spec, batch, forwards);
        let c = reference::build(&spec).unwrap();
        let before = checksums(&c);
        let largest = c.largest_leaf().unwrap().param_bytes();
        let total: u64 = c.leaves().iter().map(|l| l.param_bytes()).sum();
        let budget = largest + ((total - largest) as f64 * fraction) as u64;
        let acts = 2 * max_activation(&spec, batch);
        let d = native_device(budget + acts + 4096);
        let s = d.compute_stream();
        let hooks = attach(&c, &d, &budget_spec(budget, pinned)).unwrap();

        let plan = hooks.plan().clone();
        prop_assert!(plan.fits());
        prop_assert_eq!(plan.budget_bytes, budget);
        prop_assert_eq!(plan.resident.len() + plan.streamed.len(), c.leaves().len());
        if total <= budget {
            prop_assert!(plan.streamed.is_empty());
        }
        // Resident weights are on the device now, within the budget (tied weights once).
        let resident = hooks.device_weight_bytes();
        prop_assert!(resident <= plan.resident_bytes && resident <= budget);
        prop_assert_eq!(d.memory_info().allocated, resident);
        let counters = hooks.metrics().counters();
        prop_assert_eq!(counters.resident_weight_bytes, resident);
        prop_assert_eq!(counters.leaves_resident, plan.resident.len() as u64);
        prop_assert_eq!(counters.leaves_streamed, plan.streamed.len() as u64);
        prop_assert_eq!(counters.pinned_host_bytes, d.memory_info().pinned_host);
        if !pinned || plan.streamed.is_empty() {
            prop_assert_eq!(d.memory_info().pinned_host, 0);
        }

        for (i, want) in expected.iter().enumerate() {
            d.reset_peak();
            let y = c
                .forward(&*d, reference::input(&spec, batch, 100 + i as u64).unwrap())
                .unwrap();
            // Between forwards: the resident set and the caller's output.
            prop_assert_eq!(d.memory_info().allocated, resident + y.nbytes() as u64);
            let peak = d.memory_info().peak_allocated;
            prop_assert!(peak <= budget + acts, "peak {} > budget {} + activations {}", peak, budget, acts);
            prop_assert_eq!(&y.to_host_bytes(&*d, &s).unwrap(), want);
        }
        hooks.end_phase().unwrap();
        prop_assert_eq!(d.memory_info().allocated, resident);

        hooks.detach().unwrap();
        hooks.detach().unwrap();
        let m = d.memory_info();
        prop_assert_eq!((m.allocated, m.pinned_host), (0, 0));
        prop_assert_eq!(hooks.metrics().counters().resident_weight_bytes, 0);
        assert_host_only(&c);
        prop_assert_eq!(checksums(&c), before);
    }
}

/// The plan's resident bytes after a change, and whether it fits.
fn fits_with(bytes: &[u64], keep: &[bool], budget: u64) -> Option<u64> {
    let resident: u64 = bytes
        .iter()
        .zip(keep)
        .filter(|(_, k)| **k)
        .map(|(b, _)| b)
        .sum();
    let slot = bytes
        .iter()
        .zip(keep)
        .filter(|(_, k)| !**k)
        .map(|(b, _)| *b)
        .max()
        .unwrap_or(0);
    (resident + slot <= budget).then_some(resident)
}

fn keep_of(plan: &ResidencyPlan, n: usize) -> Vec<bool> {
    (0..n).map(|i| plan.is_resident(&format!("l{i}"))).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn plans_fit_and_no_single_move_or_swap_improves_them(
        bytes in prop::collection::vec(0u64..100, 0..12),
        budget in 0u64..600,
    ) {
        let leaves: Vec<(String, u64)> =
            bytes.iter().enumerate().map(|(i, b)| (format!("l{i}"), *b)).collect();
        let plan = plan_residency(&leaves, budget);
        let n = bytes.len();
        // A partition of the leaves, in input order, with consistent totals.
        let keep = keep_of(&plan, n);
        let in_order: Vec<String> = (0..n).filter(|&i| keep[i]).map(|i| format!("l{i}")).collect();
        prop_assert_eq!(&plan.resident, &in_order);
        prop_assert_eq!(plan.resident.len() + plan.streamed.len(), n);
        prop_assert_eq!(plan.resident_bytes + plan.streamed_bytes, bytes.iter().sum::<u64>());
        let total: u64 = bytes.iter().sum();
        let largest = bytes.iter().copied().max().unwrap_or(0);
        if total <= budget {
            prop_assert!(plan.streamed.is_empty());
            prop_assert_eq!(plan.slot_bytes, 0);
        }
        if largest > budget {
            prop_assert!(plan.resident.is_empty() && !plan.fits());
            return Ok(());
        }
        prop_assert!(plan.fits());
        prop_assert_eq!(fits_with(&bytes, &keep, budget), Some(plan.resident_bytes));
        // No streamed leaf can be made resident, alone or in exchange for a smaller one.
        for t in (0..n).filter(|&t| !keep[t] && bytes[t] > 0) {
            let mut moved = keep.clone();
            moved[t] = true;
            prop_assert!(fits_with(&bytes, &moved, budget).is_none(), "moving l{} improves {:?}", t, plan);
            for r in (0..n).filter(|&r| keep[r] && bytes[r] < bytes[t]) {
                let mut swapped = moved.clone();
                swapped[r] = false;
                prop_assert!(
                    fits_with(&bytes, &swapped, budget).is_none(),
                    "swapping l{} for l{} improves {:?}", t, r, plan
                );
            }
        }
    }

    #[test]
    fn plans_are_close_to_the_optimum_on_small_inputs(
        bytes in prop::collection::vec(1u64..64, 1..9),
        extra in 0u64..200,
    ) {
        let largest = *bytes.iter().max().unwrap();
        let budget = largest + extra;
        let leaves: Vec<(String, u64)> =
            bytes.iter().enumerate().map(|(i, b)| (format!("l{i}"), *b)).collect();
        let plan = plan_residency(&leaves, budget);
        let n = bytes.len();
        let best = (0u32..1 << n)
            .filter_map(|mask| {
                let keep: Vec<bool> = (0..n).map(|i| mask >> i & 1 == 1).collect();
                fits_with(&bytes, &keep, budget)
            })
            .max()
            .unwrap();
        // A heuristic: never worse than the optimum minus one leaf's bytes.
        prop_assert!(plan.resident_bytes <= best);
        prop_assert!(plan.resident_bytes + largest >= best, "{} vs optimum {}", plan.resident_bytes, best);
    }
}

#[test]
fn a_budget_that_holds_everything_streams_nothing() {
    let spec = ReferenceSpec::small("transformer", 3, 8, DType::BF16);
    let expected = resident_outputs(&spec, 2, 2);
    let c = reference::build(&spec).unwrap();
    let d = native_device(1 << 20);
    let s = d.compute_stream();
    let hooks = attach(&c, &d, &budget_spec(c.param_bytes() * 2, true)).unwrap();
    assert!(hooks.plan().streamed.is_empty());
    assert_eq!(hooks.plan().slot_bytes, 0);
    assert_eq!(d.memory_info().allocated, c.param_bytes());
    // Nothing streamed: nothing pinned, and no copies after attach.
    assert_eq!(d.memory_info().pinned_host, 0);
    let copies = hooks.metrics().counters().h2d_copies;
    assert_eq!(copies, c.params().len() as u64);
    for (i, want) in expected.iter().enumerate() {
        let y = c
            .forward(&*d, reference::input(&spec, 2, 100 + i as u64).unwrap())
            .unwrap();
        assert_eq!(&y.to_host_bytes(&*d, &s).unwrap(), want);
    }
    assert_eq!(hooks.metrics().counters().h2d_copies, copies);
    hooks.detach().unwrap();
    assert_eq!(d.memory_info().allocated, 0);
}

#[test]
fn a_tight_budget_streams_and_pins_only_the_streamed_weights() {
    let spec = ReferenceSpec::small("transformer", 4, 8, DType::F32);
    let c = reference::build(&spec).unwrap();
    let largest = c.largest_leaf().unwrap().param_bytes();
    let d = native_device(1 << 20);
    let hooks = attach(&c, &d, &budget_spec(largest * 3, true)).unwrap();
    let plan = hooks.plan().clone();
    assert!(
        !plan.streamed.is_empty() && !plan.resident.is_empty(),
        "{plan:?}"
    );
    assert!(plan.device_bytes() <= largest * 3);
    let streamed: u64 = plan
        .streamed
        .iter()
        .map(|p| c.leaf_by_path(p).unwrap().param_bytes())
        .sum();
    assert_eq!(plan.streamed_bytes, streamed);
    // Leaf by leaf, the streamed weights' one host copy is page-locked (each param aligned).
    let padded: u64 = plan
        .streamed
        .iter()
        .flat_map(|p| {
            c.leaf_by_path(p)
                .unwrap()
                .params()
                .iter()
                .map(|(_, p)| Arc::clone(p))
        })
        .map(|p| (p.nbytes() as u64).next_multiple_of(256))
        .sum();
    assert_eq!(d.memory_info().pinned_host, padded);
    assert_eq!(hooks.pinned_bytes(), padded);
    let before = hooks.metrics().counters().h2d_bytes;
    drop(
        c.forward(&*d, reference::input(&spec, 1, 1).unwrap())
            .unwrap(),
    );
    assert_eq!(hooks.metrics().counters().h2d_bytes - before, streamed);
    let text = hooks.describe();
    assert!(
        text.contains("pinned=true") && text.contains("streamed"),
        "{text}"
    );
    hooks.detach().unwrap();
    let m = d.memory_info();
    assert_eq!((m.allocated, m.pinned_host), (0, 0));
}

#[test]
fn without_a_budget_it_fits_what_is_free_minus_the_margin() {
    let spec = ReferenceSpec::small("transformer", 2, 8, DType::F16);
    let c = reference::build(&spec).unwrap();
    let spare = c.param_bytes() / 2;
    let d = native_device(DEFAULT_FREE_MARGIN + spare);
    let rs = RouteSpec::route(RouteId::NATIVE_VMM);
    assert_eq!(budget_bytes(&*d, &rs), spare);
    let hooks = attach(&c, &d, &rs).unwrap();
    assert_eq!(hooks.plan().budget_bytes, spare);
    assert_eq!(
        hooks.config().budget,
        Budget::FreeMinus(DEFAULT_FREE_MARGIN)
    );
    assert!(hooks.config().pinned, "page-locked by default");
    assert!(hooks.device_weight_bytes() <= spare);
    drop(
        c.forward(&*d, reference::input(&spec, 1, 1).unwrap())
            .unwrap(),
    );
    hooks.detach().unwrap();
    assert_eq!(d.memory_info().allocated, 0);
}

#[test]
fn attach_through_the_route_trait_is_removable_and_drop_detaches() {
    let spec = ReferenceSpec::small("transformer", 2, 8, DType::F32);
    let c = reference::build(&spec).unwrap();
    let d = native_device(1 << 20);
    let route: &dyn Route = &NativeVmmRoute;
    assert_eq!(route.id(), RouteId::NATIVE_VMM);
    let rs = budget_spec(c.param_bytes() / 2, false);
    route.preflight(&c, &*d, &rs).unwrap();
    let metrics = Arc::new(RouteMetrics::new());
    let hooks = route
        .attach(
            &c,
            Arc::clone(&d) as Arc<dyn Device>,
            &rs,
            Arc::clone(&metrics),
        )
        .unwrap();
    assert_eq!(hooks.route_name(), "native_vmm");
    assert!(hooks.removable());
    assert!(metrics.counters().resident_weight_bytes > 0);
    c.install_hooks(Arc::clone(&hooks)).unwrap();
    drop(
        c.forward(&*d, reference::input(&spec, 1, 1).unwrap())
            .unwrap(),
    );
    assert!(c.remove_hooks(&hooks));
    drop(hooks);
    assert_eq!(d.memory_info().allocated, 0);
    assert_host_only(&c);
}

#[test]
fn a_forward_after_detach_is_refused() {
    let spec = ReferenceSpec::small("transformer", 1, 4, DType::F32);
    let c = reference::build(&spec).unwrap();
    let d = native_device(1 << 20);
    let hooks = attach(&c, &d, &budget_spec(c.param_bytes(), false)).unwrap();
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
            route: "native_vmm",
            refusal,
            ..
        } => refusal,
        other => panic!("expected a native_vmm refusal, got {other}"),
    }
}

/// The registry's checks and attach both refuse with the same refusal, and nothing is allocated,
/// pinned or moved.
fn refused(c: &Arc<Component>, d: &Arc<HostDevice>, spec: &RouteSpec) -> Refusal {
    let before = checksums(c);
    let allocated = d.memory_info().allocated;
    let from_preflight = refusal(checked_preflight(&NativeVmmRoute, c, &**d, spec).unwrap_err());
    let from_attach = refusal(attach(c, d, spec).unwrap_err());
    assert_eq!(from_preflight, from_attach);
    let m = d.memory_info();
    assert_eq!((m.allocated, m.pinned_host), (allocated, 0));
    assert!(c.attached().is_none());
    assert_host_only(c);
    assert_eq!(checksums(c), before);
    from_attach
}

#[test]
fn refuses_a_device_without_the_native_allocator() {
    let spec = ReferenceSpec::small("transformer", 1, 4, DType::F32);
    let c = reference::build(&spec).unwrap();
    let d = HostDevice::with_capacity(1 << 20).unwrap();
    let r = refused(&c, &d, &budget_spec(1 << 16, false));
    assert_eq!(r, Refusal::NativeAllocatorRequired);
}

#[test]
fn refuses_a_vae_without_an_explicit_budget() {
    let spec = ReferenceSpec::small("vae", 1, 4, DType::F32);
    let c = reference::build(&spec).unwrap();
    let d = native_device(DEFAULT_FREE_MARGIN + (1 << 20));
    let r = refused(&c, &d, &RouteSpec::route(RouteId::NATIVE_VMM));
    assert_eq!(r, Refusal::VaeNeedsExplicitCapacity);
    // An explicit capacity is the opt-in; the class name plays no part.
    let hooks = attach(&c, &d, &budget_spec(1 << 16, false)).unwrap();
    hooks.detach().unwrap();
    let mut other = spec.clone();
    other.name = "decoder".into();
    other.class_name = "AutoencoderKL".into();
    let c2 = reference::build(&other).unwrap();
    attach(&c2, &d, &RouteSpec::route(RouteId::NATIVE_VMM))
        .unwrap()
        .detach()
        .unwrap();
    assert_eq!(d.memory_info().allocated, 0);
}

#[test]
fn refuses_options_other_than_budget_and_pinned() {
    let spec = ReferenceSpec::small("transformer", 1, 4, DType::F32);
    let c = reference::build(&spec).unwrap();
    let d = native_device(1 << 20);
    for (text, option) in [
        ("native_vmm:offload_type=leaf_level", "offload_type"),
        ("native_vmm:use_stream=true", "use_stream"),
        ("native_vmm:low_cpu_mem_usage=false", "low_cpu_mem_usage"),
        (
            // One rule for every route: the option that travels with another is named.
            "native_vmm:budget=64KiB,offload_type=block_level,num_blocks_per_group=1",
            "num_blocks_per_group",
        ),
    ] {
        let r = refused(&c, &d, &spec_text(text));
        assert_eq!(
            r,
            Refusal::UnsupportedOption {
                option,
                hint: OPTION_HINT
            },
            "{text}"
        );
    }
}

#[test]
fn refuses_a_budget_below_the_largest_leaf() {
    let spec = ReferenceSpec::small("transformer", 2, 8, DType::F32);
    let c = reference::build(&spec).unwrap();
    let largest = c.largest_leaf().unwrap();
    let (path, bytes) = (largest.path().to_string(), largest.param_bytes());
    let d = native_device(1 << 20);
    let r = refused(&c, &d, &budget_spec(bytes - 1, false));
    assert_eq!(
        r,
        Refusal::BudgetBelowLargestLeaf {
            budget: bytes - 1,
            given: format!("budget={} B", bytes - 1),
            leaf: path.clone(),
            leaf_bytes: bytes,
        }
    );
    // Without a budget, what is free minus the margin is the budget; the refusal names the
    // default margin and what it leaves, not the bytes alone (issue 34).
    let small = native_device(DEFAULT_FREE_MARGIN + bytes / 2);
    let r = refused(&c, &small, &RouteSpec::route(RouteId::NATIVE_VMM));
    let free = DEFAULT_FREE_MARGIN + bytes / 2;
    assert_eq!(
        r,
        Refusal::BudgetBelowLargestLeaf {
            budget: bytes / 2,
            given: format!(
                "the default budget, free-1.00 GiB leaves {} on this device ({} free)",
                ddo_metrics::format_bytes(bytes / 2),
                ddo_metrics::format_bytes(free)
            ),
            leaf: path,
            leaf_bytes: bytes,
        }
    );
    assert!(
        r.to_string()
            .starts_with("the default budget, free-1.00 GiB leaves"),
        "{r}"
    );
}

#[test]
fn out_of_memory_during_attach_is_typed_and_leaves_nothing_behind() {
    let spec = ReferenceSpec::small("transformer", 4, 8, DType::F32);
    let c = reference::build(&spec).unwrap();
    let before = checksums(&c);
    let total = c.param_bytes();
    let d = native_device(total + 64);
    // Something else holds most of the device: the budget asked for no longer fits.
    let other = d.alloc((total / 2) as usize).unwrap();
    let err = attach(&c, &d, &budget_spec(total, true)).unwrap_err();
    assert!(matches!(err, CoreError::OutOfMemory { .. }), "{err}");
    let m = d.memory_info();
    assert_eq!((m.allocated, m.pinned_host), (other.len() as u64, 0));
    assert!(c.attached().is_none());
    assert_host_only(&c);
    assert_eq!(checksums(&c), before);
    // Once the memory is back, the same budget attaches.
    drop(other);
    let hooks = attach(&c, &d, &budget_spec(total, true)).unwrap();
    assert_eq!(d.memory_info().allocated, total);
    hooks.detach().unwrap();
    assert_eq!(d.memory_info().allocated, 0);
}

#[test]
fn out_of_memory_in_a_streamed_leaf_is_typed_and_recoverable() {
    let spec = ReferenceSpec::small("transformer", 4, 8, DType::F32);
    let c = reference::build(&spec).unwrap();
    let before = checksums(&c);
    let largest = c.largest_leaf().unwrap().param_bytes();
    let d = native_device(1 << 20);
    let hooks = attach(&c, &d, &budget_spec(largest * 3, false)).unwrap();
    assert!(!hooks.plan().streamed.is_empty());
    let resident = hooks.device_weight_bytes();
    // Take everything the device has left, so no streamed leaf can be onloaded.
    let info = d.memory_info();
    let hog = d
        .alloc((info.capacity - info.allocated - 64) as usize)
        .unwrap();
    let err = c
        .forward(&*d, reference::input(&spec, 1, 1).unwrap())
        .unwrap_err();
    assert!(matches!(err, CoreError::OutOfMemory { .. }), "{err}");
    assert_eq!(d.memory_info().allocated, resident + hog.len() as u64);
    drop(hog);
    // The route still works afterwards.
    drop(
        c.forward(&*d, reference::input(&spec, 1, 1).unwrap())
            .unwrap(),
    );
    assert_eq!(d.memory_info().allocated, resident);
    hooks.detach().unwrap();
    assert_eq!(d.memory_info().allocated, 0);
    assert_host_only(&c);
    assert_eq!(checksums(&c), before);
}

#[test]
fn the_pinned_limit_fails_attach_and_leaves_nothing_behind() {
    let spec = ReferenceSpec::small("transformer", 4, 8, DType::F32);
    let c = reference::build(&spec).unwrap();
    let largest = c.largest_leaf().unwrap().param_bytes();
    let d = HostDevice::new(HostDeviceConfig {
        capacity: 1 << 20,
        pinned_limit: largest / 2,
        allocator: AllocatorKind::NativeVmm,
        ..HostDeviceConfig::default()
    })
    .unwrap();
    let err = attach(&c, &d, &budget_spec(largest * 3, true)).unwrap_err();
    assert!(matches!(err, CoreError::PinnedLimit { .. }), "{err}");
    let m = d.memory_info();
    assert_eq!((m.allocated, m.pinned_host), (0, 0));
    assert_host_only(&c);
    // Unpinned streaming needs no pinned memory.
    let hooks = attach(&c, &d, &budget_spec(largest * 3, false)).unwrap();
    drop(
        c.forward(&*d, reference::input(&spec, 1, 1).unwrap())
            .unwrap(),
    );
    hooks.detach().unwrap();
    assert_eq!(d.memory_info().allocated, 0);
}

/// A spec whose `unit_bytes` is small enough for a ring of a few slots within `budget`.
fn engine_spec(budget: u64, pinned: bool, unit_bytes: u64, ring_slots: usize) -> RouteSpec {
    spec_text(&format!(
        "native_vmm:budget={budget},pinned={pinned},unit_bytes={unit_bytes},ring_slots={ring_slots}"
    ))
}

prop_compose! {
    /// Components large enough that a ring of a few slots is smaller than the whole.
    fn arb_wide_spec()(
        width in 8usize..24,
        blocks in prop::collection::vec(
            prop::collection::vec(
                prop_oneof![(8usize..24).prop_map(LeafSpec::linear), Just(LeafSpec::norm())],
                1..3,
            ),
            3..7,
        ),
        dtype in prop_oneof![Just(DType::F32), Just(DType::BF16)],
        tie in any::<bool>(),
        seed in any::<u64>(),
    ) -> ReferenceSpec {
        ReferenceSpec {
            name: "transformer".into(),
            class_name: "ReferenceModel".into(),
            dtype,
            in_features: width,
            stem: vec![LeafSpec::linear(width)],
            blocks,
            head: vec![LeafSpec::norm(), LeafSpec::linear(width)],
            tie_head_to_stem: tie,
            seed,
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// With room for the ring, the streamed leaves go through the streaming engine from
    /// the second forward on: outputs stay bit-identical to resident, resident weights plus
    /// the ring stay within the budget, a pinned home (`pinned=true`) or a staging ring
    /// within the pinned limit stages the weights, and detach leaves nothing behind with
    /// the host weights unchanged.
    #[test]
    fn the_engine_streams_within_the_budget_and_matches_resident(
        spec in arb_wide_spec(),
        batch in 1usize..4,
        pinned in any::<bool>(),
        ring_slots in 2usize..4,
        unit in 64u64..1024,
        fraction in 0.0f64..0.5,
    ) {
        let forwards = 4;
        let expected = resident_outputs(&spec, batch, forwards);
        let c = reference::build(&spec).unwrap();
        let before = checksums(&c);
        let largest = c.largest_leaf().map_or(0, |l| l.param_bytes());
        let total = c.param_bytes();
        // Enough for the ring of the largest (aligned) leaf, plus a fraction of the rest.
        let ring = ring_slots as u64 * (largest + 256 * 8).max(unit.next_multiple_of(256));
        let budget = ring + (fraction * total.saturating_sub(ring) as f64) as u64;
        let d = native_device(1 << 30);
        let hooks = attach(&c, &d, &engine_spec(budget, pinned, unit, ring_slots)).unwrap();
        prop_assume!(hooks.stream_mode() == StreamMode::Engine);
        let plan = hooks.plan().clone();
        prop_assert!(plan.fits());
        let acts = 4 * max_activation(&spec, batch);
        let s = d.compute_stream();
        for (i, want) in expected.iter().enumerate() {
            d.reset_peak();
            let y = c
                .forward(&*d, reference::input(&spec, batch, 100 + i as u64).unwrap())
                .unwrap();
            let peak = d.memory_info().peak_allocated;
            prop_assert!(peak <= budget + acts, "forward {}: peak {} > budget {} + {}", i, peak, budget, acts);
            prop_assert_eq!(&y.to_host_bytes(&*d, &s).unwrap(), want);
        }
        let f = hooks.streaming().expect("the engine runs after the learning forward");
        prop_assert!(f.resident_bytes + f.ring_bytes() + hooks.device_weight_bytes() - f.resident_bytes <= budget, "{:?}", f);
        let info = d.memory_info();
        if f.units == 0 {
            // Everything fits resident beside the ring: nothing is staged.
            prop_assert_eq!(f.pinned_bytes, 0);
        } else if pinned {
            prop_assert!(matches!(f.staging, StagingKind::PinnedHome), "{:?}", f.staging);
        } else {
            prop_assert!(!matches!(f.staging, StagingKind::PinnedHome));
        }
        prop_assert_eq!(info.pinned_host, hooks.pinned_bytes());
        let counters = hooks.metrics().counters();
        prop_assert_eq!(counters.schedule_relearned, 0);
        let installed: Arc<dyn AttachedRoute> = hooks.clone();
        prop_assert!(c.remove_hooks(&installed));
        drop(installed);
        drop(hooks);
        let m = d.memory_info();
        prop_assert_eq!((m.allocated, m.pinned_host), (0, 0));
        assert_host_only(&c);
        prop_assert_eq!(checksums(&c), before);
    }
}

#[test]
fn the_engine_takes_over_after_the_learning_forward_and_streams_one_copy_per_unit() {
    let spec = ReferenceSpec {
        name: "transformer".into(),
        class_name: "ReferenceModel".into(),
        dtype: DType::F32,
        in_features: 64,
        stem: vec![LeafSpec::linear(64)],
        blocks: vec![vec![LeafSpec::linear(64), LeafSpec::norm()]; 6],
        head: vec![LeafSpec::norm(), LeafSpec::linear(64)],
        tie_head_to_stem: false,
        seed: 5,
    };
    let expected = resident_outputs(&spec, 2, 3);
    let c = reference::build(&spec).unwrap();
    let d = native_device(1 << 30);
    // Room for the ring and little else: most leaves stream.
    let unit = 4096;
    let largest = c.largest_leaf().unwrap().param_bytes();
    let hooks = attach(
        &c,
        &d,
        &engine_spec(2 * (largest + 1024) + 1024, true, unit, 2),
    )
    .unwrap();
    assert_eq!(hooks.stream_mode(), StreamMode::Engine);
    assert!(
        hooks.streaming().is_none(),
        "no engine before the schedule is learned"
    );
    let s = d.compute_stream();
    let mut copies = Vec::new();
    for (i, want) in expected.iter().enumerate() {
        let before = hooks.metrics().counters().h2d_copies;
        let y = c
            .forward(&*d, reference::input(&spec, 2, 100 + i as u64).unwrap())
            .unwrap();
        assert_eq!(&y.to_host_bytes(&*d, &s).unwrap(), want, "forward {i}");
        copies.push(hooks.metrics().counters().h2d_copies - before);
    }
    let f = hooks.streaming().expect("engine");
    assert!(matches!(f.staging, StagingKind::PinnedHome));
    assert_eq!(hooks.schedule().unwrap().len(), f.streamed_segments);
    // Learning forward: one copy per param; then one per transfer unit.
    assert!(
        copies[0] > f.units as u64,
        "{copies:?} vs {} units",
        f.units
    );
    assert_eq!(copies[1], f.units as u64);
    assert_eq!(copies[2], f.units as u64);
    assert_eq!(d.memory_info().pinned_host, f.pinned_bytes);
    assert!(hooks.describe().contains("streamed"));
    // The plan in the metrics: which leaves stay, as many as the counters say.
    let names = hooks.metrics().resident_leaves();
    let counters = hooks.metrics().counters();
    assert_eq!(names.len() as u64, counters.leaves_resident);
    assert_eq!(
        counters.leaves_resident + counters.leaves_streamed,
        c.leaves().iter().filter(|l| !l.params().is_empty()).count() as u64
    );
    for leaf in &hooks.plan().resident {
        assert!(names.contains(leaf), "{leaf} missing from {names:?}");
    }
}
