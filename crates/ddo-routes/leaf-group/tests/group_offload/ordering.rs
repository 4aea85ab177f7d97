//! Compute is ordered behind every copy it reads: on a crawling link, with a program that
//! reads device memory like a kernel (no transfer of its own to hide a missing wait),
//! every configuration gives the right weights on the learning forward, on prefetched
//! forwards, and on a forward that leaves the schedule.

use ddo_core::Device;

use crate::common::*;

#[test]
fn compute_waits_for_every_copy_on_a_crawling_link() {
    let orders: [&[usize]; 5] = [
        &[0, 1, 2, 3, 4],
        &[0, 1, 2, 3, 4],
        &[0, 1, 2, 3, 4],
        &[0, 3, 1, 4, 2],
        &[0, 3, 1, 4, 2],
    ];
    for case in all_cases() {
        // 64 B take 1 ms: many times a leaf's compute, so the copy stream runs behind.
        let device = slow_device(1 << 20, 64e3);
        let (c, program) = ordered_component(4, &device);
        let (hooks, _metrics) = attach(&c, &device, &case.spec());
        for order in orders {
            *program.order.lock() = order.to_vec();
            let got = run_sums(&c, &*device).unwrap();
            assert_eq!(got, expected_sums(&c, order), "{case:?} {order:?}");
        }
        assert_eq!(device.memory_info().allocated, 0);
        detach_and_check_released(&c, &device, hooks, 0);
    }
}
