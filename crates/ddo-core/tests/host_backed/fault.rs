//! The fault-injecting device (`ddo_core::fault`) wrapped around a host device: counting,
//! firing exactly the armed point, op timing, fused ops forwarded as one op.

use std::sync::Arc;

use ddo_core::{
    CoreError, DType, Device, FaultAction, FaultCounts, FaultInjectingDevice, FaultKind,
    HostBuffer, Ops, Tensor, UnaryOp,
};
use ddo_host::HostDevice;

fn wrapped() -> (Arc<HostDevice>, Arc<FaultInjectingDevice>) {
    let d = HostDevice::with_capacity(1 << 20).unwrap();
    let f = FaultInjectingDevice::new(d.clone());
    (d, f)
}

#[test]
fn op_timing_counts_each_op_by_name_only_while_on() {
    let (_d, f) = wrapped();
    let x = f.tensor_from_f32(&[2, 2], DType::F32, &[1.0; 4]).unwrap();
    assert!(f.op_times().is_empty(), "off by default");
    f.time_ops(true);
    let _ = f.tensor_from_f32(&[2, 2], DType::F32, &[2.0; 4]).unwrap();
    let _ = f.tensor_from_f32(&[2, 2], DType::F32, &[3.0; 4]).unwrap();
    let table = f.op_times();
    assert_eq!(table.len(), 1, "{table:?}");
    assert_eq!((table[0].0.as_str(), table[0].1), ("tensor_from_f32", 2));
    assert!(table[0].2 >= 0.0);
    f.time_ops(false);
    assert!(f.op_times().is_empty());
    drop(x);
}

#[test]
fn counts_every_kind_and_fails_exactly_the_armed_point_once() {
    let (d, f) = wrapped();
    let s = f.compute_stream();
    f.arm(FaultKind::Alloc, 2, FaultAction::Error);
    let a = f.alloc(16).unwrap();
    let err = f.alloc(32).unwrap_err();
    assert!(
        matches!(err, CoreError::OutOfMemory { requested: 32, .. }),
        "{err}"
    );
    assert_eq!(
        d.memory_info().allocated,
        16,
        "a failed alloc allocates nothing"
    );
    let b = f.alloc(8).unwrap();
    assert_eq!(f.fired(), 1);
    let src = HostBuffer::pageable_from(&[1; 8]);
    f.copy_h2d(&src.slice_all(), &b.slice_all(), &s).unwrap();
    f.copy_d2d(&b.slice_all(), &a.slice(0, 8).unwrap(), &s)
        .unwrap();
    let e = f.record_event(&s).unwrap();
    f.wait_event(&s, &e).unwrap();
    f.synchronize_event(&e).unwrap();
    assert_eq!(
        f.counts(),
        FaultCounts {
            allocs: 3,
            copies: 2,
            event_waits: 2,
            ops: 0
        }
    );
    f.arm(FaultKind::Copy, 1, FaultAction::Error);
    let err = f
        .copy_h2d(&src.slice_all(), &b.slice_all(), &s)
        .unwrap_err();
    assert!(
        matches!(&err, CoreError::Injected(m) if m.contains("copy #3")),
        "{err}"
    );
    f.arm(FaultKind::EventWait, 1, FaultAction::Error);
    assert!(matches!(f.wait_event(&s, &e), Err(CoreError::Injected(_))));
    assert_eq!(f.fired(), 3);
    assert_eq!(f.id(), d.id());
}

#[test]
fn op_outputs_count_as_allocations_and_a_failed_op_leaves_nothing() {
    let (d, f) = wrapped();
    let ops = f.ops().unwrap();
    let x = ops.tensor_from_f32(&[4], DType::F32, &[1.0; 4]).unwrap();
    let before = d.memory_info().allocated;
    f.arm(FaultKind::Alloc, 1, FaultAction::Error);
    let err = ops.unary(&x, UnaryOp::Relu).unwrap_err();
    assert!(
        matches!(err, CoreError::OutOfMemory { requested: 16, .. }),
        "{err}"
    );
    assert_eq!(d.memory_info().allocated, before);
    assert_eq!(f.counts().allocs, 2);
    assert_eq!(ops.to_f32_vec(&x).unwrap(), vec![1.0; 4]);
    assert_eq!(
        f.counts().allocs,
        2,
        "to_f32_vec allocates no device memory"
    );
}

/// The fused group norm + SiLU goes to the inner ops as one op (one op point, one
/// allocation point, timed under its own name), with the inner composition's values.
#[test]
fn group_norm_silu_is_forwarded_as_one_op() {
    let (_d, f) = wrapped();
    let ops = f.ops().unwrap();
    let values: Vec<f32> = (0..24).map(|i| (i as f32 * 0.37).sin() * 2.0).collect();
    let x = ops
        .tensor_from_f32(&[2, 4, 3], DType::F32, &values)
        .unwrap();
    let before = f.counts();
    f.time_ops(true);
    let y = ops.group_norm_silu(&x, 2, None, None, 1e-5).unwrap();
    let table = f.op_times();
    f.time_ops(false);
    assert_eq!(table.len(), 1, "{table:?}");
    assert_eq!((table[0].0.as_str(), table[0].1), ("group_norm_silu", 1));
    let after = f.counts();
    assert_eq!(
        (after.ops - before.ops, after.allocs - before.allocs),
        (1, 1)
    );
    let inner = f.inner_ops().unwrap();
    let normed = inner.group_norm(&x, 2, None, None, 1e-5).unwrap();
    let want = inner.unary(&normed, UnaryOp::Silu).unwrap();
    assert_eq!(ops.to_f32_vec(&y).unwrap(), ops.to_f32_vec(&want).unwrap());
    // An armed op point fails the fused op before it runs.
    f.arm(FaultKind::Op, 1, FaultAction::Error);
    assert!(matches!(
        ops.group_norm_silu(&x, 2, None, None, 1e-5),
        Err(CoreError::Injected(m)) if m.contains("group_norm_silu")
    ));
}

/// A fused op is one op point and one allocation point (the trait's default would pass
/// through the wrapper once per op it composes), named after itself, with the inner
/// backend's values.
#[test]
fn fused_ops_reach_the_inner_backend_as_one_op() {
    let (d, f) = wrapped();
    let ops = f.ops().unwrap();
    let vals = |n: usize| (0..n).map(|i| (i as f32 * 0.37).sin()).collect::<Vec<_>>();
    let x = ops.tensor_from_f32(&[3, 4], DType::F32, &vals(12)).unwrap();
    let w = ops.tensor_from_f32(&[5, 4], DType::F32, &vals(20)).unwrap();
    let s = ops.tensor_from_f32(&[4], DType::F32, &vals(4)).unwrap();
    f.time_ops(true);
    let before = f.counts();
    let got = ops.linear_gelu_tanh(&x, &w, None).unwrap();
    let c = f.counts().since(&before);
    assert_eq!((c.ops, c.allocs), (1, 1), "{c:?}");
    let before = f.counts();
    let m = ops.layer_norm_modulate(&x, 1e-6, &s, &s).unwrap();
    let g = ops.gated_add(&x, &s, &m).unwrap();
    let c = f.counts().since(&before);
    assert_eq!((c.ops, c.allocs), (2, 2), "{c:?}");
    let names: Vec<String> = f.op_times().into_iter().map(|(n, ..)| n).collect();
    assert_eq!(
        names,
        ["gated_add", "layer_norm_modulate", "linear_gelu_tanh"]
    );
    let v = |t: &Tensor| d.to_f32_vec(t).unwrap();
    assert_eq!(v(&got), v(&d.linear_gelu_tanh(&x, &w, None).unwrap()));
    assert_eq!(v(&m), v(&d.layer_norm_modulate(&x, 1e-6, &s, &s).unwrap()));
    assert_eq!(v(&g), v(&d.gated_add(&x, &s, &m).unwrap()));
    f.time_ops(false);
}

#[test]
fn a_panic_action_panics_and_zero_never_fires() {
    let (_d, f) = wrapped();
    f.arm(FaultKind::Alloc, 0, FaultAction::Panic);
    f.alloc(1).unwrap();
    f.arm(FaultKind::Alloc, 1, FaultAction::Panic);
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f.alloc(1)));
    let payload = caught.unwrap_err();
    let msg = payload.downcast_ref::<String>().unwrap();
    assert!(msg.starts_with("injected panic at alloc #2"), "{msg}");
    f.disarm();
    f.alloc(1).unwrap();
}

/// `Component::run` ends each forward on the backend (`Ops::end_forward`: what it kept for
/// the forward goes), after a forward that failed as after one that did not.
#[test]
fn each_forward_of_a_component_ends_on_the_backend_even_when_it_fails() {
    use ddo_core::reference::{self, ReferenceSpec};
    let d = HostDevice::with_capacity(64 << 20).unwrap();
    let f = FaultInjectingDevice::new(d.clone());
    let spec = ReferenceSpec::small("c", 2, 8, DType::F32);
    let c = reference::build_on_ops(&spec).unwrap();
    c.to_device(&*f, &f.compute_stream()).unwrap();
    let ends = |f: &FaultInjectingDevice| {
        f.op_times()
            .iter()
            .find(|(n, ..)| n == "end_forward")
            .map_or(0, |e| e.1)
    };
    f.time_ops(true);
    for _ in 0..2 {
        c.forward(&*f, reference::input(&spec, 1, 0).unwrap())
            .unwrap();
    }
    assert_eq!(ends(&f), 2);
    f.arm(FaultKind::Op, 1, FaultAction::Error);
    assert!(
        c.forward(&*f, reference::input(&spec, 1, 0).unwrap())
            .is_err()
    );
    assert_eq!(f.fired(), 1);
    assert_eq!(ends(&f), 3);
}
