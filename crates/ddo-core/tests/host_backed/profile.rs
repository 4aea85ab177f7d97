//! The per-op profiles (`ddo_core::profile`) of the ops a host device hands out.

use ddo_core::{CoreError, DType, Device, Tensor};

/// On the host backend every op through `Device::ops` is counted by class with its
/// exact flops and bytes; ops outside a profile are not; ending twice gives nothing.
#[test]
fn the_host_backend_profiles_the_ops_it_hands_out() {
    use ddo_core::UnaryOp;
    use ddo_core::device::ops_of;
    use ddo_host::{HostDevice, HostDeviceConfig};
    let dev = HostDevice::new(HostDeviceConfig::default()).unwrap();
    let ops = ops_of(&*dev).unwrap();
    let x = ops
        .tensor_from_f32(&[3, 4], DType::F32, &[0.5; 12])
        .unwrap();
    let w = ops
        .tensor_from_f32(&[5, 4], DType::F32, &[0.25; 20])
        .unwrap();
    ops.linear(&x, &w, None).unwrap(); // before the profile: not counted
    assert!(dev.begin_op_profile());
    let y = ops.linear(&x, &w, None).unwrap();
    let y = ops.unary(&y, UnaryOp::Silu).unwrap();
    ops.unary_owned(y, UnaryOp::Silu).unwrap();
    let p = dev
        .end_op_profile()
        .unwrap()
        .expect("the host keeps timestamps");
    let by = |name: &str| p.classes.iter().find(|c| c.op == name).cloned();
    let lin = by("linear").expect("linear");
    assert_eq!((lin.calls, lin.flops), (1, 2 * 3 * 5 * 4));
    assert_eq!(lin.bytes, (12 + 20 + 15) * 4);
    let silu = by("unary.Silu").expect("unary.Silu");
    assert_eq!((silu.calls, silu.flops, silu.bytes), (2, 0, 2 * 2 * 15 * 4));
    assert_eq!(p.classes.len(), 2, "{:?}", p.classes);
    assert_eq!(
        p.largest_linear,
        Some(ddo_core::GemmShape {
            rows: 3,
            k: 4,
            n: 5,
            dtype: DType::F32
        })
    );
    assert!(
        dev.end_op_profile().unwrap().is_none(),
        "no profile is active"
    );
    // The largest linear of a profile is the one with the most flops, whichever ran first
    // (a 3-D input counts its rows over the leading dims); a new profile forgets it.
    let big = ops
        .tensor_from_f32(&[2, 6, 4], DType::F32, &[0.5; 48])
        .unwrap();
    assert!(dev.begin_op_profile());
    ops.linear(&big, &w, None).unwrap();
    ops.linear(&x, &w, None).unwrap();
    // A linear_concat of two parts, 1 and 3 wide, is one linear of 3 rows and k = 4.
    let a = ops.tensor_from_f32(&[3, 1], DType::F32, &[0.5; 3]).unwrap();
    let b = ops.tensor_from_f32(&[3, 3], DType::F32, &[0.5; 9]).unwrap();
    ops.linear_concat(&[&a, &b], &w, None).unwrap();
    let p = dev.end_op_profile().unwrap().unwrap();
    assert_eq!(
        p.largest_linear.map(|g| (g.rows, g.k, g.n)),
        Some((12, 4, 5))
    );
    // The linears by shape: 12x4x5 once, 3x4x5 twice (the plain one and the concat),
    // their times summing to the class's.
    let shapes: Vec<_> = p
        .linears
        .iter()
        .map(|l| (l.op.as_str(), l.shape.rows, l.shape.k, l.shape.n, l.calls))
        .collect();
    assert_eq!(shapes.len(), 2, "{shapes:?}");
    assert!(shapes.contains(&("linear", 12, 4, 5, 1)), "{shapes:?}");
    assert!(shapes.contains(&("linear", 3, 4, 5, 2)), "{shapes:?}");
    assert_eq!(
        p.linears.iter().map(|l| l.ns).sum::<u64>(),
        p.classes.iter().find(|c| c.op == "linear").unwrap().ns
    );
    assert!(
        p.format_text().contains("linear 3x4x5"),
        "{}",
        p.format_text()
    );
    // Every call in order, its time and the stream's idle time before it summing to its
    // class's; the first call has none before it.
    let order: Vec<&str> = p.calls.iter().map(|c| c.op.as_str()).collect();
    assert_eq!(order, ["linear", "linear", "linear"]);
    assert_eq!(p.calls[0].idle_before_ns, 0);
    let lin = p.classes.iter().find(|c| c.op == "linear").unwrap();
    assert_eq!(p.calls.iter().map(|c| c.ns).sum::<u64>(), lin.ns);
    assert_eq!(
        p.calls.iter().map(|c| c.idle_before_ns).sum::<u64>(),
        lin.idle_before_ns
    );
    assert_eq!(p.total_idle_ns(), lin.idle_before_ns);
    assert!(dev.begin_op_profile());
    ops.unary(&x, UnaryOp::Silu).unwrap();
    assert_eq!(dev.end_op_profile().unwrap().unwrap().largest_linear, None);
}

/// `group_norm_silu` reaches the backend through `ProfiledOps` as one op of its own
/// class (not a group norm and a unary), with group norm's bytes; the host backend's
/// default gives exactly group norm then SiLU, in every dtype, with and without the
/// affine, and refuses what group norm refuses.
#[test]
fn group_norm_silu_is_one_profiled_op_and_the_host_composes_it_exactly() {
    use ddo_core::UnaryOp;
    use ddo_core::device::ops_of;
    use ddo_core::rng::SplitMix64;
    use ddo_host::{HostDevice, HostDeviceConfig};
    let dev = HostDevice::new(HostDeviceConfig::default()).unwrap();
    let ops = ops_of(&*dev).unwrap();
    let mut rng = SplitMix64::new(31);
    let mut random = |n: usize, scale: f32, offset: f32| -> Vec<f32> {
        (0..n).map(|_| rng.next_signed() * scale + offset).collect()
    };
    let shape = [2, 6, 5, 3];
    let xv = random(2 * 6 * 5 * 3, 3.0, 1.5);
    let (wv, bv) = (random(6, 1.0, 0.0), random(6, 1.0, 0.0));
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let x = ops.tensor_from_f32(&shape, dtype, &xv).unwrap();
        let w = ops.tensor_from_f32(&[6], DType::F32, &wv).unwrap();
        let b = ops.tensor_from_f32(&[6], dtype, &bv).unwrap();
        for affine in [false, true] {
            let (w, b) = (affine.then_some(&w), affine.then_some(&b));
            assert!(dev.begin_op_profile());
            let fused = ops.group_norm_silu(&x, 3, w, b, 1e-6).unwrap();
            let p = dev.end_op_profile().unwrap().expect("timestamps");
            assert_eq!(p.classes.len(), 1, "{:?}", p.classes);
            let c = &p.classes[0];
            assert_eq!((c.op.as_str(), c.calls, c.flops), ("group_norm_silu", 1, 0));
            let affine_bytes = w.map_or(0, |t| t.nbytes()) + b.map_or(0, |t| t.nbytes());
            assert_eq!(
                c.bytes,
                (2 * x.nbytes() + affine_bytes) as u64,
                "{dtype} affine={affine}"
            );
            let normed = ops.group_norm(&x, 3, w, b, 1e-6).unwrap();
            let composed = ops.unary(&normed, UnaryOp::Silu).unwrap();
            assert_eq!((fused.shape(), fused.dtype()), (&shape[..], dtype));
            let bits = |t: &Tensor| -> Vec<u32> {
                ops.to_f32_vec(t)
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            assert_eq!(bits(&fused), bits(&composed), "{dtype} affine={affine}");
        }
        for groups in [0, 4] {
            assert!(matches!(
                ops.group_norm_silu(&x, groups, None, None, 1e-6),
                Err(CoreError::Shape { .. })
            ));
        }
    }
}

/// The fused ops reach the backend as one op each (the trait's defaults would show up
/// as `linear` + `unary.GeluTanh`, ...), each its own class with its flops and bytes,
/// and give the values of the composition they stand for.
#[test]
fn fused_ops_are_forwarded_as_classes_of_their_own() {
    use ddo_core::UnaryOp;
    use ddo_core::device::ops_of;
    use ddo_host::{HostDevice, HostDeviceConfig};
    let dev = HostDevice::new(HostDeviceConfig::default()).unwrap();
    let ops = ops_of(&*dev).unwrap();
    let vals = |n: usize| (0..n).map(|i| (i as f32 * 0.37).sin()).collect::<Vec<_>>();
    let x = ops
        .tensor_from_f32(&[3, 4], DType::BF16, &vals(12))
        .unwrap();
    let w = ops
        .tensor_from_f32(&[5, 4], DType::BF16, &vals(20))
        .unwrap();
    let b = ops.tensor_from_f32(&[5], DType::BF16, &vals(5)).unwrap();
    let composed = {
        let y = ops.linear(&x, &w, Some(&b)).unwrap();
        ops.unary_owned(y, UnaryOp::GeluTanh).unwrap()
    };
    // x [1, 3, 4] with a [1, 1, 4] modulation and gate.
    let x3 = x.reshape(&[1, 3, 4]).unwrap();
    let s = ops
        .tensor_from_f32(&[1, 1, 4], DType::BF16, &vals(4))
        .unwrap();
    let h = ops
        .tensor_from_f32(&[1, 1, 4], DType::BF16, &vals(4))
        .unwrap();
    let modulated = ddo_core::ops::layer_norm_modulate_composed(ops, &x3, 1e-6, &s, &h).unwrap();
    let gated = ddo_core::ops::gated_add_composed(ops, &x3, &s, &modulated).unwrap();
    assert!(dev.begin_op_profile());
    let fused = ops.linear_gelu_tanh(&x, &w, Some(&b)).unwrap();
    let fused_mod = ops.layer_norm_modulate(&x3, 1e-6, &s, &h).unwrap();
    let fused_gate = ops.gated_add(&x3, &s, &fused_mod).unwrap();
    let p = dev.end_op_profile().unwrap().expect("timestamps");
    assert_eq!(p.classes.len(), 3, "{:?}", p.classes);
    let by = |name: &str| p.classes.iter().find(|c| c.op == name).cloned();
    let c = by("linear_gelu_tanh").expect("linear_gelu_tanh");
    assert_eq!((c.calls, c.flops), (1, 2 * 3 * 5 * 4));
    assert_eq!(c.bytes, (12 + 20 + 5 + 15) * 2);
    let c = by("layer_norm_modulate").expect("layer_norm_modulate");
    assert_eq!((c.calls, c.flops, c.bytes), (1, 0, (12 + 4 + 4 + 12) * 2));
    let c = by("gated_add").expect("gated_add");
    assert_eq!((c.calls, c.flops, c.bytes), (1, 0, (12 + 4 + 12 + 12) * 2));
    let v = |t: &Tensor| ops.to_f32_vec(t).unwrap();
    assert_eq!(v(&fused), v(&composed));
    assert_eq!(v(&fused_mod), v(&modulated));
    assert_eq!(v(&fused_gate), v(&gated));
}

/// The fused gated residual and norm is one class: one call, its bytes the five operands
/// read and both outputs written; the two ops it stands for are not counted apart.
#[test]
fn a_fused_op_with_two_outputs_is_one_class() {
    use ddo_core::device::ops_of;
    use ddo_host::{HostDevice, HostDeviceConfig};
    let dev = HostDevice::new(HostDeviceConfig::default()).unwrap();
    let ops = ops_of(&*dev).unwrap();
    let x = ops
        .tensor_from_f32(&[2, 3, 8], DType::F32, &[0.5; 48])
        .unwrap();
    let y = ops
        .tensor_from_f32(&[2, 3, 8], DType::F32, &[0.25; 48])
        .unwrap();
    let row = ops
        .tensor_from_f32(&[2, 1, 8], DType::F32, &[0.1; 16])
        .unwrap();
    assert!(dev.begin_op_profile());
    let (r, n) = ops
        .gated_add_layer_norm_modulate(&x, &row, &y, 1e-6, &row, &row)
        .unwrap();
    let p = dev.end_op_profile().unwrap().expect("timestamps");
    assert_eq!((r.shape(), n.shape()), (&[2, 3, 8][..], &[2, 3, 8][..]));
    assert_eq!(p.classes.len(), 1, "{:?}", p.classes);
    let c = &p.classes[0];
    assert_eq!(c.op, "gated_add_layer_norm_modulate");
    assert_eq!((c.calls, c.flops), (1, 0));
    assert_eq!(c.bytes, (48 * 2 + 16 * 3 + 48 * 2) * 4);
}
