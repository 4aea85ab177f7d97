//! The stream schedule: learned on the first forward, followed afterwards, and learned
//! again (and counted) whenever the component runs its leaves in another order.

use ddo_core::{Device, OffloadType};
use ddo_route_leaf_group::GroupPlan;

use crate::common::*;

/// The group starts the route sees for `order`: the unmatched group never starts (it is
/// onloaded for the whole forward); block level keeps a group across consecutive leaves.
fn starts(plan: &GroupPlan, offload_type: OffloadType, order: &[usize]) -> Vec<usize> {
    let mut out: Vec<usize> = Vec::new();
    let mut current = None;
    for &leaf in order {
        let Some(g) = plan.group_of(ddo_core::LeafId(leaf)) else {
            continue;
        };
        if Some(g) == plan.unmatched() {
            current = None;
            continue;
        }
        if offload_type == OffloadType::BlockLevel && current == Some(g) {
            continue;
        }
        out.push(g);
        current = Some(g);
    }
    out
}

#[test]
fn a_changed_leaf_order_is_relearned_counted_and_still_correct() {
    let orders: [&[usize]; 10] = [
        &[0, 1, 2, 3, 4],
        &[0, 1, 2, 3, 4],
        &[0, 1, 2, 3, 4],
        &[0, 4, 3, 2, 1],
        &[0, 4, 3, 2, 1],
        &[0, 1, 2, 3, 4],
        &[0, 1, 2],
        &[0, 1, 2],
        &[0, 1, 1, 2, 3, 4],
        &[2, 0, 1, 1, 3, 4, 0],
    ];
    for case in all_cases() {
        if !case.use_stream {
            continue;
        }
        let device = slow_device(1 << 20, 2e6);
        let (c, program) = ordered_component(4, &device);
        let (hooks, metrics) = attach(&c, &device, &case.spec());
        let mut schedule: Option<Vec<usize>> = None;
        let mut relearned = 0;
        for order in orders {
            *program.order.lock() = order.to_vec();
            let got = run_sums(&c, &*device).unwrap();
            assert_eq!(got, expected_sums(&c, order), "{case:?} {order:?}");
            let now = starts(hooks.plan(), case.offload_type, order);
            if schedule.as_ref().is_some_and(|s| *s != now) {
                relearned += 1;
            }
            schedule = Some(now);
            assert_eq!(hooks.schedule(), schedule, "{case:?} {order:?}");
            assert_eq!(
                metrics.counters().schedule_relearned,
                relearned,
                "{case:?} {order:?}"
            );
            assert_eq!(device.memory_info().allocated, 0, "{case:?} {order:?}");
        }
        assert!(relearned >= 4, "{case:?}: {relearned}");
        detach_and_check_released(&c, &device, hooks, 0);
    }
}

#[test]
fn without_a_stream_there_is_no_schedule_and_any_order_works() {
    for case in all_cases() {
        if case.use_stream {
            continue;
        }
        let device = slow_device(1 << 20, 2e6);
        let (c, program) = ordered_component(3, &device);
        let (hooks, metrics) = attach(&c, &device, &case.spec());
        for order in [&[0usize, 1, 2, 3][..], &[3, 2, 1, 0], &[1, 1, 0, 2]] {
            *program.order.lock() = order.to_vec();
            assert_eq!(run_sums(&c, &*device).unwrap(), expected_sums(&c, order));
        }
        assert_eq!(hooks.schedule(), None);
        assert_eq!(metrics.counters().schedule_relearned, 0);
        detach_and_check_released(&c, &device, hooks, 0);
    }
}
