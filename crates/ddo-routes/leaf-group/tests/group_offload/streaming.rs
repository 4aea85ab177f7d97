//! Stream mode on the streaming engine, tuned through the route options (`unit_bytes`,
//! `ring_slots`, `pinned_limit`, `budget`, `copy_ahead`): random components stay bit-identical to
//! resident execution, the budget and the pinned limit hold exactly, the device peak is
//! resident weights plus the ring (plus activations and the unmatched group), and the
//! plan shows in the metrics.

use ddo_core::reference::{ReferenceSpec, build};
use ddo_core::route::checked_preflight;
use ddo_core::streaming::StagingKind;
use ddo_core::{Budget, DType, Device, OffloadType, RouteId, RouteOptions, RouteSpec, RouteTarget};
use ddo_host::{HostDevice, HostDeviceConfig};
use proptest::prelude::*;

use crate::common::*;

#[derive(Debug, Clone, Copy)]
struct Tuning {
    block: bool,
    unit_bytes: u64,
    ring_slots: usize,
    pinned_limit: Option<u64>,
    low_cpu: bool,
    budget_fraction: Option<f64>,
    copy_ahead: bool,
}

fn spec_for(t: &Tuning, budget: Option<u64>) -> RouteSpec {
    RouteSpec::new(
        RouteTarget::Route(RouteId::DIFFUSERS_GROUP_OFFLOAD),
        RouteOptions {
            offload_type: Some(if t.block {
                OffloadType::BlockLevel
            } else {
                OffloadType::LeafLevel
            }),
            num_blocks_per_group: t.block.then_some(1),
            use_stream: Some(true),
            low_cpu_mem_usage: t.low_cpu.then_some(true),
            unit_bytes: Some(t.unit_bytes),
            ring_slots: Some(t.ring_slots),
            pinned_limit: t.pinned_limit,
            budget: budget.map(Budget::Bytes),
            copy_ahead: t.copy_ahead.then_some(true),
            ..RouteOptions::default()
        },
    )
    .unwrap()
}

fn tuning() -> impl Strategy<Value = Tuning> {
    (
        any::<bool>(),
        prop::sample::select(vec![64u64, 300, 1024, 1 << 20]),
        2usize..=4,
        prop::option::of(prop::sample::select(vec![512u64, 2048, 1 << 20])),
        any::<bool>(),
        prop::option::of(0.1f64..0.9),
        any::<bool>(),
    )
        .prop_map(
            |(
                block,
                unit_bytes,
                ring_slots,
                pinned_limit,
                low_cpu,
                budget_fraction,
                copy_ahead,
            )| {
                Tuning {
                    block,
                    unit_bytes,
                    ring_slots,
                    pinned_limit,
                    low_cpu,
                    budget_fraction,
                    copy_ahead,
                }
            },
        )
}

fn check(spec: &ReferenceSpec, t: Tuning, batch: usize) -> Result<(), TestCaseError> {
    let c = build(spec).unwrap();
    let device = HostDevice::new(HostDeviceConfig {
        capacity: 1 << 22,
        link_bytes_per_sec: Some(8e6),
        ..HostDeviceConfig::default()
    })
    .unwrap();
    let xs = inputs(spec, batch, 3);
    let expected = baseline(&c, &xs);
    let activations = activation_allowance(spec, batch);
    // A budget of a fraction of the weights plus room for a ring of the largest groups
    // (leaves, or whole blocks at block level), with room for each param's alignment.
    let plan = ddo_route_leaf_group::GroupPlan::new(
        &c,
        &ddo_route_leaf_group::GroupOffloadConfig::from_spec(&spec_for(&t, None)),
    );
    // The ring the engine's planner counts with everything streamed: slots of the largest
    // group or coalesced unit, every param 256-byte aligned (SlotModel::room).
    let aligned = |bytes: usize| (bytes as u64).next_multiple_of(256);
    let largest = plan
        .groups()
        .iter()
        .map(|g| g.params().iter().map(|p| aligned(p.nbytes())).sum::<u64>())
        .max()
        .unwrap_or(0);
    let streamed: u64 = plan
        .groups()
        .iter()
        .flat_map(|g| g.params().iter().map(|p| aligned(p.nbytes())))
        .sum();
    let slot = largest.max(t.unit_bytes.next_multiple_of(256).min(streamed));
    let budget = t
        .budget_fraction
        .map(|f| ((c.param_bytes() as f64 * f) as u64 + t.ring_slots as u64 * slot).max(256));
    let (hooks, metrics) = attach(&c, &device, &spec_for(&t, budget));
    for (i, (x, want)) in xs.iter().zip(&expected).enumerate() {
        let before = device.memory_info().allocated;
        device.reset_peak();
        prop_assert_eq!(&run(&c, &*device, x), want, "forward {}", i);
        let Some(f) = hooks.streaming_figures() else {
            // A component without params has nothing to stream.
            prop_assert_eq!(c.param_bytes(), 0);
            continue;
        };
        if i == 0 {
            continue; // the learning forward; the engine exists from here on
        }
        let peak = device.memory_info().peak_allocated - before;
        let unmatched = hooks.plan().unmatched_bytes();
        prop_assert!(
            peak <= unmatched + f.device_weight_bytes() + activations,
            "forward {i}: peak {peak} above {unmatched} + {} + {activations}",
            f.device_weight_bytes()
        );
        // Each forward takes the ring, or uses the one the forward before kept.
        prop_assert!(
            peak >= f.ring_bytes() || (t.copy_ahead && before >= f.resident_bytes + f.ring_bytes())
        );
        if let Some(b) = budget {
            prop_assert_eq!(f.budget_bytes, Some(b));
            prop_assert!(f.device_weight_bytes() <= b, "{f:?}");
        } else {
            prop_assert_eq!(f.resident_bytes, 0);
        }
        // Resident weights stay between forwards; the ring does not, except with
        // `copy_ahead` from the engine's second forward on (the route's second where the
        // schedule was predicted from the tree, its third where the first forward learned
        // it), and then always where a pinned home holds the streamed weights.
        let allocated = device.memory_info().allocated;
        let kept = t.copy_ahead && i >= 1;
        if kept && i == 2 && f.staging == StagingKind::PinnedHome {
            prop_assert_eq!(
                allocated,
                f.resident_bytes + f.ring_bytes(),
                "forward {}",
                i
            );
        } else if kept {
            prop_assert!(
                allocated == f.resident_bytes || allocated == f.resident_bytes + f.ring_bytes(),
                "forward {i}: {allocated}"
            );
        } else {
            prop_assert_eq!(allocated, f.resident_bytes);
        }
        let limit = t.pinned_limit.unwrap_or(u64::MAX);
        prop_assert!(device.memory_info().pinned_host <= limit);
        prop_assert_eq!(device.memory_info().pinned_host, f.pinned_bytes);
        if t.low_cpu {
            prop_assert!(matches!(f.staging, StagingKind::Ring { .. }), "{f:?}");
        }
        let counters = metrics.counters();
        prop_assert_eq!(counters.resident_weight_bytes, f.resident_bytes);
        prop_assert_eq!(counters.streamed_bytes_per_forward, f.streamed_bytes);
        prop_assert_eq!(counters.transfer_units, f.units as u64);
        prop_assert_eq!(counters.ring_slots, f.ring_slots as u64);
        prop_assert_eq!(
            counters.leaves_streamed + counters.leaves_resident,
            c.leaves().iter().filter(|l| !l.params().is_empty()).count() as u64
        );
    }
    prop_assert_eq!(metrics.counters().schedule_relearned, 0);
    detach_and_check_released(&c, &device, hooks, 0);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn tuned_stream_mode_matches_resident_and_keeps_its_budget_and_pinned_limit(
        spec in crate::random::reference_spec(),
        t in tuning(),
        batch in 1usize..=2,
    ) {
        check(&spec, t, batch)?;
    }
}

#[test]
fn a_budget_keeps_weights_resident_across_forwards_and_streams_fewer_bytes() {
    let spec = ReferenceSpec::small("transformer", 6, 16, DType::F32);
    let c = build(&spec).unwrap();
    let device = slow_device(1 << 22, 8e6);
    let xs = inputs(&spec, 1, 3);
    let expected = baseline(&c, &xs);
    let t = Tuning {
        block: false,
        unit_bytes: 1024,
        ring_slots: 2,
        pinned_limit: None,
        low_cpu: false,
        budget_fraction: None,
        copy_ahead: false,
    };
    let (hooks, metrics) = attach(&c, &device, &spec_for(&t, None));
    for (x, want) in xs.iter().zip(&expected) {
        assert_eq!(&run(&c, &*device, x), want);
    }
    let all = hooks.streaming_figures().unwrap();
    detach_and_check_released(&c, &device, hooks, 0);
    assert_eq!(all.resident_bytes, 0);
    assert_eq!(metrics.counters().leaves_resident, 0);
    // Half the weights plus the ring: about half stays resident, the rest streams.
    let budget = c.param_bytes() / 2 + all.ring_bytes();
    let (hooks, metrics) = attach(&c, &device, &spec_for(&t, Some(budget)));
    for (x, want) in xs.iter().zip(&expected) {
        assert_eq!(&run(&c, &*device, x), want);
    }
    let half = hooks.streaming_figures().unwrap();
    assert!(
        half.resident_bytes > 0 && half.device_weight_bytes() <= budget,
        "{half:?}"
    );
    assert!(half.streamed_bytes < all.streamed_bytes);
    assert!(metrics.counters().leaves_resident > 0);
    // The plan in the metrics names the resident groups.
    let names = metrics.resident_leaves();
    assert_eq!(names.len(), half.resident_segments);
    assert!(
        names
            .iter()
            .all(|n| hooks.plan().groups().iter().any(|g| g.label() == n))
    );
    assert_eq!(device.memory_info().allocated, half.resident_bytes);
    // The phase boundary drops the resident weights too; the next forward brings them back.
    ddo_core::AttachedRoute::end_phase(&*hooks).unwrap();
    assert_eq!(device.memory_info().allocated, 0);
    assert_eq!(run(&c, &*device, &xs[0]), expected[0]);
    detach_and_check_released(&c, &device, hooks, 0);
}

#[test]
fn ring_options_without_a_stream_are_refused() {
    use ddo_core::{CoreError, Refusal};
    use ddo_route_leaf_group::GroupOffloadRoute;
    let spec = ReferenceSpec::small("transformer", 2, 4, DType::F32);
    let c = build(&spec).unwrap();
    let device = HostDevice::with_capacity(1 << 20).unwrap();
    for o in [
        RouteOptions {
            unit_bytes: Some(1 << 20),
            ..RouteOptions::default()
        },
        RouteOptions {
            ring_slots: Some(3),
            ..RouteOptions::default()
        },
    ] {
        let o = RouteOptions {
            offload_type: Some(OffloadType::LeafLevel),
            use_stream: Some(false),
            ..o
        };
        let spec = RouteSpec::new(RouteTarget::Route(RouteId::DIFFUSERS_GROUP_OFFLOAD), o).unwrap();
        let err = checked_preflight(&GroupOffloadRoute, &c, &*device, &spec).unwrap_err();
        assert!(
            matches!(
                &err,
                CoreError::Refused {
                    refusal: Refusal::UnsupportedOption { hint, .. },
                    ..
                } if hint.contains("use_stream=true")
            ),
            "{err}"
        );
    }
    // Ring slots below 2 are refused when the spec is made.
    assert!(
        ddo_core::RouteSpec::parse(
            "diffusers_group_offload:use_stream=true,ring_slots=1",
            &ddo_core::RouteId::BUILT_IN
        )
        .is_err()
    );
    let parsed: RouteSpec =
        ddo_core::RouteSpec::parse("diffusers_group_offload:offload_type=leaf_level,use_stream=true,unit_bytes=8MiB,ring_slots=3,pinned_limit=256MiB", &ddo_core::RouteId::BUILT_IN)
            .unwrap();
    assert_eq!(parsed.options().unit_bytes, Some(8 << 20));
    assert_eq!(parsed.options().ring_slots, Some(3));
    assert_eq!(parsed.options().pinned_limit, Some(256 << 20));
    assert!(parsed.describe().contains("ring_slots=3"));
}

/// A component of 8-bit weights gets a ring of four slots by default (the bytes of a 16-bit
/// ring of two), in its footprint and in the engine it attaches; 16-bit weights keep two; a
/// `ring_slots` given, or a budget, is kept as it is.
#[test]
fn eight_bit_weights_get_a_deeper_default_ring_in_footprint_and_attach() {
    use ddo_core::{FootprintContext, Route};
    use ddo_route_leaf_group::{EIGHT_BIT_RING_SLOTS, GroupOffloadRoute};
    let stream = |o: RouteOptions| {
        RouteSpec::new(
            RouteTarget::Route(RouteId::DIFFUSERS_GROUP_OFFLOAD),
            RouteOptions {
                offload_type: Some(OffloadType::LeafLevel),
                use_stream: Some(true),
                // One leaf a unit, so the ring is not capped by a count of units.
                unit_bytes: Some(1),
                ..o
            },
        )
        .unwrap()
    };
    let cases = [
        (DType::F8E4M3, RouteOptions::default(), EIGHT_BIT_RING_SLOTS),
        (DType::BF16, RouteOptions::default(), 2),
        (
            DType::F8E4M3,
            RouteOptions {
                ring_slots: Some(2),
                ..RouteOptions::default()
            },
            2,
        ),
        (
            DType::F8E4M3,
            RouteOptions {
                // Replaced below by half the weights: some resident, some streamed.
                budget: Some(Budget::Bytes(0)),
                ..RouteOptions::default()
            },
            ddo_route_leaf_group::BUDGETED_RING_SLOTS,
        ),
    ];
    for (dtype, mut options, slots) in cases {
        let spec = ReferenceSpec::small("transformer", 8, 32, dtype);
        let c = build(&spec).unwrap();
        if options.budget.is_some() {
            options.budget = Some(Budget::Bytes(c.param_bytes() / 2));
        }
        let route = stream(options);
        let device = HostDevice::with_capacity(1 << 30).unwrap();
        let f = GroupOffloadRoute
            .footprint(&c, &route, &FootprintContext::of(&*device))
            .unwrap();
        let (hooks, _) = attach(&c, &device, &route);
        let figures = hooks.streaming_figures().unwrap();
        assert_eq!(figures.ring_slots, slots, "{dtype:?} {}", route.describe());
        assert_eq!(
            f.transient_device_bytes,
            figures.ring_bytes(),
            "footprint and attach agree: {dtype:?} {}",
            route.describe()
        );
        detach_and_check_released(&c, &device, hooks, 0);
    }
}

/// `compress=lossless`: the units stream coded and decode on the device into the ring;
/// every forward is bit-identical to resident, the link carries the coded bytes (fewer than
/// the raw ones for bf16 weights), footprint and attach agree on the ring, and detach gives
/// everything back.
#[test]
fn lossless_coded_units_stream_bit_identical_and_fewer_bytes() {
    use ddo_core::streaming::{StagingKind, coded_ring_bytes};
    use ddo_core::{Compression, FootprintContext, Route};
    use ddo_route_leaf_group::GroupOffloadRoute;
    for (dtype, unit_bytes) in [
        (DType::BF16, None),
        (DType::BF16, Some(1)),
        (DType::F32, Some(4096)),
    ] {
        let spec = ReferenceSpec::small("transformer", 6, 48, dtype);
        let c = build(&spec).unwrap();
        let route = RouteSpec::new(
            RouteTarget::Route(RouteId::DIFFUSERS_GROUP_OFFLOAD),
            RouteOptions {
                offload_type: Some(OffloadType::LeafLevel),
                use_stream: Some(true),
                unit_bytes,
                compress: Some(Compression::Lossless),
                ..RouteOptions::default()
            },
        )
        .unwrap();
        let xs = inputs(&spec, 2, 3);
        let expected = baseline(&c, &xs);
        let device = HostDevice::with_capacity(1 << 26).unwrap();
        let f = GroupOffloadRoute
            .footprint(&c, &route, &FootprintContext::of(&*device))
            .unwrap();
        let (hooks, metrics) = attach(&c, &device, &route);
        let figures = hooks.streaming_figures().unwrap();
        let StagingKind::Coded {
            coded_bytes,
            raw_bytes,
            ..
        } = figures.staging
        else {
            panic!("not coded: {figures:?}");
        };
        assert_eq!(figures.streamed_bytes, coded_bytes);
        assert!(figures.pinned_bytes >= coded_bytes);
        // The metrics report the coded size per component.
        let reported = metrics.coded().expect("coded figures in the metrics");
        assert_eq!(
            (reported.coded_bytes, reported.raw_bytes),
            (coded_bytes, raw_bytes)
        );
        assert_eq!(reported.cache, "unavailable", "weights made in memory");
        if dtype == DType::BF16 && unit_bytes.is_none() {
            assert!(
                coded_bytes < raw_bytes,
                "{dtype:?}: {coded_bytes} coded of {raw_bytes}"
            );
        }
        assert_eq!(
            figures.ring_bytes(),
            figures.decoded_ring_bytes() + coded_ring_bytes(figures.slot_bytes)
        );
        assert!(
            f.transient_device_bytes >= figures.ring_bytes(),
            "footprint {} below the ring {}",
            f.transient_device_bytes,
            figures.ring_bytes()
        );
        for (x, want) in xs.iter().zip(&expected) {
            let before = metrics.counters().h2d_bytes;
            assert_eq!(&run(&c, &*device, x), want, "{dtype:?} {unit_bytes:?}");
            assert_eq!(
                metrics.counters().h2d_bytes - before,
                coded_bytes,
                "a forward copies the coded bytes"
            );
        }
        detach_and_check_released(&c, &device, hooks, 0);
    }
}

/// `compress=lossless` under a budget: the planner keeps what the budget holds beside the
/// decoded and coded ring resident and streams the rest coded; forwards stay bit-identical,
/// the device holds no more weights than the budget, and a budget below the coded ring is a
/// typed error naming the budget.
#[test]
fn lossless_coded_units_stream_under_a_budget() {
    use ddo_core::{Compression, CoreError};
    use ddo_metrics::RouteMetrics;
    use std::sync::Arc;
    let spec = ReferenceSpec::small("transformer", 8, 64, DType::BF16);
    let c = build(&spec).unwrap();
    let total: u64 = c.params().iter().map(|p| p.nbytes() as u64).sum();
    let xs = inputs(&spec, 2, 3);
    let expected = baseline(&c, &xs);
    let coded = |budget: u64| {
        RouteSpec::new(
            RouteTarget::Route(RouteId::DIFFUSERS_GROUP_OFFLOAD),
            RouteOptions {
                offload_type: Some(OffloadType::LeafLevel),
                use_stream: Some(true),
                unit_bytes: Some(4096),
                compress: Some(Compression::Lossless),
                budget: Some(Budget::Bytes(budget)),
                ..RouteOptions::default()
            },
        )
        .unwrap()
    };
    let device = HostDevice::with_capacity(1 << 26).unwrap();
    let budget = total * 6 / 10;
    let (hooks, _) = attach(&c, &device, &coded(budget));
    for (x, want) in xs.iter().zip(&expected) {
        assert_eq!(&run(&c, &*device, x), want, "budget {budget}");
    }
    let figures = hooks.streaming_figures().unwrap();
    assert!(
        matches!(figures.staging, StagingKind::Coded { .. }),
        "{figures:?}"
    );
    assert!(figures.resident_segments > 0, "{figures:?}");
    assert!(figures.streamed_segments > 0, "{figures:?}");
    assert!(
        figures.device_weight_bytes() <= budget,
        "resident {} + ring {} over the budget {budget}",
        figures.resident_bytes,
        figures.ring_bytes()
    );
    detach_and_check_released(&c, &device, hooks, 0);

    // A budget that holds two decoded slots of a unit but not the coded ones beside them.
    let dev: Arc<dyn Device> = device.clone();
    let e = ddo_route_leaf_group::GroupOffloadRoute
        .attach_group_offload(&c, dev, &coded(2 * 4096), Arc::new(RouteMetrics::new()))
        .map(|_| ())
        .unwrap_err();
    assert!(
        matches!(&e, CoreError::InvalidOption { option, .. } if option == "budget"),
        "{e:?}"
    );
    assert_eq!(device.memory_info().allocated, 0);
    assert_eq!(device.memory_info().pinned_host, 0);
}
