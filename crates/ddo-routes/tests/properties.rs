//! Properties over random component trees, budgets and route options: a forward under any
//! route is bit-identical to resident execution, device and pinned memory return to their
//! starting level after removal, and the peak stays within what the route promises.

mod common;

use common::*;
use ddo_core::Device;
use ddo_core::reference::{self, LeafSpec, ReferenceSpec};
use ddo_core::{
    Budget, Component, DType, LeafKind, OffloadType, RouteId, RouteOptions, RouteSpec, RouteTarget,
};
use ddo_route_leaf_group::GroupOffloadConfig;
use ddo_routes::enable_dynamic_offload;
use proptest::prelude::*;

fn leaf_spec() -> impl Strategy<Value = LeafSpec> {
    prop_oneof![
        (1usize..12).prop_map(|out| LeafSpec {
            kind: LeafKind::Linear,
            out_features: Some(out),
        }),
        (1usize..12).prop_map(|out| LeafSpec {
            kind: LeafKind::Conv2d,
            out_features: Some(out),
        }),
        Just(LeafSpec {
            kind: LeafKind::Norm,
            out_features: None,
        }),
        Just(LeafSpec {
            kind: LeafKind::Embedding,
            out_features: None,
        }),
    ]
}

fn reference_spec() -> impl Strategy<Value = ReferenceSpec> {
    (
        1usize..10,
        prop::collection::vec(leaf_spec(), 0..3),
        prop::collection::vec(prop::collection::vec(leaf_spec(), 1..3), 0..4),
        prop::collection::vec(leaf_spec(), 0..3),
        prop_oneof![Just(DType::F32), Just(DType::F16), Just(DType::BF16)],
        any::<u64>(),
    )
        .prop_map(|(width, stem, blocks, head, dtype, seed)| ReferenceSpec {
            name: "transformer".into(),
            class_name: "Random".into(),
            dtype,
            in_features: width,
            stem,
            blocks,
            head,
            tie_head_to_stem: false,
            seed,
        })
        .prop_filter("at least one leaf", |s| {
            !(s.stem.is_empty() && s.blocks.is_empty() && s.head.is_empty())
        })
}

/// Transfer units for the streaming engine: the default (16 MiB: one unit for these
/// components) or a few hundred bytes, so a forward refills the ring's slots.
fn unit_bytes() -> impl Strategy<Value = Option<u64>> {
    prop::option::of(prop::sample::select(vec![256u64, 512, 1024]))
}

/// Route specs to try, each with whether it needs the native allocator.
fn route_spec() -> impl Strategy<Value = RouteSpec> {
    prop_oneof![
        Just(RouteSpec::resident()),
        (any::<bool>(), any::<bool>(), any::<bool>(), unit_bytes()).prop_map(
            |(stream, record, low, units)| {
                RouteSpec::new(
                    RouteTarget::Route(RouteId::DIFFUSERS_GROUP_OFFLOAD),
                    RouteOptions {
                        offload_type: Some(OffloadType::LeafLevel),
                        use_stream: Some(stream),
                        record_stream: Some(stream && record),
                        low_cpu_mem_usage: Some(low),
                        unit_bytes: units.filter(|_| stream),
                        ..RouteOptions::default()
                    },
                )
                .unwrap()
            }
        ),
        (any::<bool>(), 1usize..3, unit_bytes()).prop_map(|(stream, n, units)| {
            RouteSpec::new(
                RouteTarget::Route(RouteId::DIFFUSERS_GROUP_OFFLOAD),
                RouteOptions {
                    offload_type: Some(OffloadType::BlockLevel),
                    num_blocks_per_group: Some(if stream { 1 } else { n }),
                    use_stream: Some(stream),
                    unit_bytes: units.filter(|_| stream),
                    ..RouteOptions::default()
                },
            )
            .unwrap()
        }),
        any::<bool>().prop_map(|pinned| {
            RouteSpec::new(
                RouteTarget::Route(RouteId::LINEAR_CONVOLUTION),
                RouteOptions {
                    pinned: Some(pinned),
                    ..RouteOptions::default()
                },
            )
            .unwrap()
        }),
        (0u64..4096, unit_bytes()).prop_map(|(extra, units)| {
            RouteSpec::new(
                RouteTarget::Route(RouteId::NATIVE_VMM),
                RouteOptions {
                    // Resolved against the component below: largest leaf + `extra`.
                    budget: Some(Budget::Bytes(extra + 1)),
                    unit_bytes: units,
                    ..RouteOptions::default()
                },
            )
            .unwrap()
        }),
    ]
}

/// Widest activation pair of the reference program: input + output of one leaf, f32.
fn activation_bound(spec: &ReferenceSpec, batch: usize) -> u64 {
    let mut features = spec.in_features;
    let mut worst = 0;
    let leaves = spec
        .stem
        .iter()
        .chain(spec.blocks.iter().flatten())
        .chain(spec.head.iter());
    for leaf in leaves {
        let out = leaf.out_features.unwrap_or(features);
        worst = worst.max(features + out);
        features = out;
    }
    (worst * batch * 4) as u64
}

/// Bytes of the largest group `spec` forms on `component` (its promise per group).
fn largest_group(component: &Component, route: &RouteSpec) -> (u64, u64) {
    let leaves = component.leaves();
    let largest_leaf = leaves.iter().map(|l| l.param_bytes()).max().unwrap_or(0);
    let c = GroupOffloadConfig::from_spec(route);
    if c.offload_type == OffloadType::LeafLevel {
        return (largest_leaf, 0);
    }
    let mut blocks: std::collections::BTreeMap<usize, u64> = Default::default();
    let mut unmatched = 0;
    for l in leaves {
        match l.placement() {
            ddo_core::Placement::Block { index, .. } => {
                *blocks.entry(index / c.num_blocks_per_group).or_default() += l.param_bytes()
            }
            ddo_core::Placement::Unmatched => unmatched += l.param_bytes(),
        }
    }
    (blocks.values().copied().max().unwrap_or(0), unmatched)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn any_route_matches_resident_and_returns_memory(
        spec in reference_spec(),
        route in route_spec(),
        batch in 1usize..4,
    ) {
        let expected = baseline(&reference::build(&spec).unwrap(), &spec, batch, 5);
        let c = reference::build(&spec).unwrap();
        let largest_leaf = c.leaves().iter().map(|l| l.param_bytes()).max().unwrap_or(0);
        let route = match (route.route_id(), route.options().budget) {
            (Some(RouteId::NATIVE_VMM), Some(Budget::Bytes(extra))) => RouteSpec::new(
                route.target(),
                RouteOptions { budget: Some(Budget::Bytes(largest_leaf + extra)), ..*route.options() },
            ).unwrap(),
            _ => route,
        };
        let native = route.route_id() == Some(RouteId::NATIVE_VMM);
        let d = if native { native_device(1 << 26) } else { device(1 << 26) };
        let h = enable_dynamic_offload(&c, dyn_device(&d), route).unwrap();
        let attached = d.memory_info().allocated;
        let acts = activation_bound(&spec, batch);
        for _ in 0..3 {
            d.reset_peak();
            let out = h.forward(reference::input(&spec, batch, 5).unwrap()).unwrap();
            prop_assert_eq!(bytes_of(&*d, &out), expected.clone(), "{}", route.describe());
            let peak = d.memory_info().peak_allocated;
            let weights_bound = match route.route_id() {
                Some(RouteId::RESIDENT) => c.param_bytes(),
                Some(RouteId::LINEAR_CONVOLUTION) => largest_leaf,
                Some(RouteId::NATIVE_VMM) => match route.options().budget {
                    Some(Budget::Bytes(b)) => b,
                    _ => unreachable!(),
                },
                Some(RouteId::DIFFUSERS_GROUP_OFFLOAD) => {
                    let (group, unmatched) = largest_group(&c, &route);
                    let cfg = GroupOffloadConfig::from_spec(&route);
                    // Direct onloads: the group in use; record_stream frees in stream
                    // order, so one more may still be queued for release. With a stream,
                    // later forwards hold the engine's ring (and its resident weights).
                    let groups = if cfg.record_stream { 2 } else { 1 };
                    let k = h.metrics().counters();
                    let engine = k.ring_slots * k.ring_slot_bytes + k.resident_weight_bytes;
                    (groups * group).max(engine) + unmatched
                }
                other => unreachable!("the strategy makes no {other:?} spec"),
            };
            prop_assert!(
                peak <= weights_bound + acts,
                "{}: peak {} > weights {} + activations {} (attached {})",
                route.describe(), peak, weights_bound, acts, attached
            );
        }
        drop(h);
        drop(c);
        d.synchronize().unwrap();
        let m = d.memory_info();
        prop_assert_eq!((m.allocated, m.pinned_host), (0, 0));
    }
}
