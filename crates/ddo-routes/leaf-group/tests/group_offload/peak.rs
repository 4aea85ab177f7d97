//! Peak device memory stays within each mode's promise: one group without a stream (plus,
//! with `record_stream`, one group whose stream-ordered free has not been reached yet);
//! with a stream, the same on the learning forward and then the streaming engine's ring;
//! block level plus the unmatched group, and the activations of the widest leaf.

use std::collections::HashSet;

use ddo_core::reference::{LeafSpec, ReferenceSpec, build};
use ddo_core::streaming::{DEFAULT_RING_SLOTS, DEFAULT_UNIT_BYTES, StagingLayout};
use ddo_core::{DType, Device, OffloadType};
use ddo_route_leaf_group::GroupPlan;

use crate::common::*;

/// Groups the direct path may hold at once, besides the unmatched group.
fn groups_held(case: &Case) -> usize {
    match case.record_stream {
        false => 1,
        // A freed group stays counted until the compute stream reaches its free.
        true => 2,
    }
}

/// Device bytes of the engine's ring for groups started in component order.
fn ring_bytes(plan: &GroupPlan) -> u64 {
    let segments: Vec<_> = plan.groups().iter().map(|g| g.params().to_vec()).collect();
    let order: Vec<usize> = (0..plan.len())
        .filter(|g| Some(*g) != plan.unmatched())
        .collect();
    let layout = StagingLayout::new(&segments, &order, &HashSet::new(), DEFAULT_UNIT_BYTES);
    layout.slot_bytes() * layout.units().len().min(DEFAULT_RING_SLOTS) as u64
}

fn promise(case: &Case, plan: &GroupPlan, activations: u64) -> u64 {
    let direct = plan.largest_groups_bytes(groups_held(case));
    let weights = if case.use_stream {
        direct.max(ring_bytes(plan))
    } else {
        direct
    };
    plan.unmatched_bytes() + weights + activations
}

fn uneven_spec() -> ReferenceSpec {
    ReferenceSpec {
        name: "transformer".into(),
        class_name: "Uneven".into(),
        dtype: DType::F32,
        in_features: 12,
        stem: vec![LeafSpec::linear(16)],
        blocks: (0..6)
            .map(|b| {
                vec![
                    LeafSpec::linear(8 + 2 * b),
                    LeafSpec::norm(),
                    LeafSpec::linear(16),
                ]
            })
            .collect(),
        head: vec![LeafSpec::norm(), LeafSpec::linear(4)],
        tie_head_to_stem: false,
        seed: 11,
    }
}

#[test]
fn peak_device_memory_stays_within_each_modes_promise() {
    let spec = uneven_spec();
    let batch = 3;
    let activations = activation_allowance(&spec, batch);
    for case in all_cases() {
        let c = build(&spec).unwrap();
        let device = slow_device(1 << 20, 4e6);
        let xs = inputs(&spec, batch, 3);
        let expected = baseline(&c, &xs);
        let (hooks, _metrics) = attach(&c, &device, &case.spec());
        let bound = promise(&case, hooks.plan(), activations);
        for (i, (x, want)) in xs.iter().zip(&expected).enumerate() {
            let before = device.memory_info().allocated;
            device.reset_peak();
            assert_eq!(&run(&c, &*device, x), want, "{case:?}");
            let peak = device.memory_info().peak_allocated - before;
            assert!(
                peak <= bound,
                "{case:?}, forward {i}: peak {peak} B above the promise {bound} B"
            );
            assert!(peak >= hooks.plan().largest_group_bytes(), "{case:?}");
            if let Some(f) = hooks.streaming_figures().filter(|_| i > 0) {
                // The ring is the whole streamed-weight footprint: exactly what was planned.
                assert_eq!(f.ring_bytes(), ring_bytes(hooks.plan()), "{case:?}");
                assert!(
                    peak >= hooks.plan().unmatched_bytes() + f.ring_bytes(),
                    "{case:?}"
                );
            }
        }
        if case.offload_type == OffloadType::LeafLevel && !case.use_stream {
            // The point of leaf-level offload: far below the resident weights.
            assert!(
                bound < c.param_bytes() / 4,
                "{bound} vs {}",
                c.param_bytes()
            );
        }
        detach_and_check_released(&c, &device, hooks, 0);
    }
}

#[test]
fn a_device_just_large_enough_for_the_promise_runs_every_mode() {
    let spec = uneven_spec();
    let batch = 2;
    let activations = activation_allowance(&spec, batch);
    for case in all_cases() {
        // record_stream's extra group is a timing allowance; size for the strict promise.
        if case.record_stream {
            continue;
        }
        let c = build(&spec).unwrap();
        let xs = inputs(&spec, batch, 3);
        let expected = baseline(&c, &xs);
        let plan = GroupPlan::new(
            &c,
            &ddo_route_leaf_group::GroupOffloadConfig::from_spec(&case.spec()),
        );
        let capacity = promise(&case, &plan, activations);
        let device = slow_device(capacity, 4e6);
        let (hooks, _metrics) = attach(&c, &device, &case.spec());
        for (x, want) in xs.iter().zip(&expected) {
            assert_eq!(&run(&c, &*device, x), want, "{case:?} in {capacity} B");
        }
        detach_and_check_released(&c, &device, hooks, 0);
    }
}

/// While each leaf runs, exactly the promised groups are on the device: its own group
/// (with a stream, once the schedule is predicted right or learned: the engine's ring
/// instead); at block
/// level, also the unmatched group. A block group leaves as soon as a leaf of another
/// group starts.
#[test]
fn while_a_leaf_runs_exactly_the_promised_groups_are_on_the_device() {
    let orders: [&[usize]; 2] = [&[0, 1, 2, 3, 4], &[1, 2, 0, 3, 4, 0]];
    for case in all_cases() {
        for order in orders {
            let device = slow_device(1 << 20, 2e6);
            let (c, program) = ordered_component(4, &device);
            *program.order.lock() = order.to_vec();
            let (hooks, _metrics) = attach(&c, &device, &case.spec());
            let plan = hooks.plan();
            let bytes = |g: Option<usize>| g.map_or(0, |g| plan.groups()[g].bytes());
            let group = |leaf: usize| plan.group_of(ddo_core::LeafId(leaf));
            for forward in 0..3 {
                run_sums(&c, &*device).unwrap();
                let seen = program.allocated_in_leaf.lock().clone();
                // The engine runs from the first forward when the program starts its
                // groups in the order predicted from the leaf order; else from the second.
                let predicted = hooks.schedule().as_deref() == Some(&plan.predicted_order()[..]);
                let engine = hooks
                    .streaming_figures()
                    .filter(|_| forward > 0 || predicted);
                let expected: Vec<u64> = (0..order.len())
                    .map(|k| {
                        let own = group(order[k]).filter(|g| Some(*g) != plan.unmatched());
                        match &engine {
                            Some(f) => plan.unmatched_bytes() + f.device_weight_bytes(),
                            None => plan.unmatched_bytes() + bytes(own),
                        }
                    })
                    .collect();
                assert_eq!(seen, expected, "{case:?} {order:?} forward {forward}");
            }
            detach_and_check_released(&c, &device, hooks, 0);
        }
    }
}
