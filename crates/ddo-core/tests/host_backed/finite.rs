//! Deferred non-finite checks on a device: each step's count is read one step late, names
//! its own step, and the last is read by `finish`; their pinned buffers go back.

use ddo_core::finite::DeferredFiniteChecks;
use ddo_core::{CoreError, DType, Device, Tensor};
use ddo_host::HostDevice;

fn on(d: &HostDevice, values: &[f32]) -> Tensor {
    Tensor::from_f32(vec![values.len()], DType::BF16, values)
        .unwrap()
        .to_device(d, &d.compute_stream())
        .unwrap()
}

fn step_of(e: CoreError) -> (Option<(usize, usize)>, u64) {
    match e {
        CoreError::NonFinite { step, count, .. } => (step, count),
        other => panic!("not a NonFinite: {other}"),
    }
}

#[test]
fn a_bad_step_is_named_when_the_next_is_queued_or_at_finish() {
    let d = HostDevice::with_capacity(1 << 20).unwrap();
    let clean = on(&d, &[1.0, 2.0, 3.0]);
    let bad = on(&d, &[1.0, f32::NAN, f32::INFINITY]);

    // Step 2 of 4 is bad: queuing step 2 does not fail, queuing step 3 names step 2.
    let mut checks = DeferredFiniteChecks::new(&*d);
    checks
        .queue(&clean, "denoise", Some((1, 4)), "the latents")
        .unwrap();
    checks
        .queue(&bad, "denoise", Some((2, 4)), "the latents")
        .unwrap();
    let e = checks
        .queue(&clean, "denoise", Some((3, 4)), "the latents")
        .unwrap_err();
    assert_eq!(step_of(e), (Some((2, 4)), 2));
    drop(checks);

    // The last step is bad: only `finish` sees it.
    let mut checks = DeferredFiniteChecks::new(&*d);
    checks
        .queue(&clean, "denoise", Some((1, 2)), "the latents")
        .unwrap();
    checks
        .queue(&bad, "denoise", Some((2, 2)), "the latents")
        .unwrap();
    assert_eq!(step_of(checks.finish().unwrap_err()), (Some((2, 2)), 2));
    drop(checks);

    // Clean steps pass, and two pinned counts serve any number of steps.
    let mut checks = DeferredFiniteChecks::new(&*d);
    for i in 1..=5 {
        checks
            .queue(&clean, "denoise", Some((i, 5)), "the latents")
            .unwrap();
        assert!(d.memory_info().pinned_host <= 2 * 4096, "step {i}");
    }
    checks.finish().unwrap();
    drop(checks);
    drop((clean, bad));
    assert_eq!(d.memory_info().pinned_host, 0);
    assert_eq!(d.memory_info().allocated, 0);
}
