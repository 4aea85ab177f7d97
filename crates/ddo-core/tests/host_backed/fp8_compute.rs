//! `Ops::linear_fp8` (`--compute fp8`) on the host backend, its profiled ops and the
//! deferred device: the reference's numbers rounded once into the input's dtype, the same
//! bytes on each, a non-finite input refused, bad operands refused.

use ddo_core::fp8_compute::linear_reference;
use ddo_core::{CoreError, DType, Device, Tensor, ops_of};
use ddo_host::{DeferredComputeDevice, HostDevice};

fn on(d: &dyn Device, shape: &[usize], dtype: DType, values: &[f32]) -> Tensor {
    Tensor::from_f32(shape.to_vec(), dtype, values)
        .unwrap()
        .to_device(d, &d.compute_stream())
        .unwrap()
}

/// Values spread over several binades, signs mixed: `i` through a cheap hash.
fn values(n: usize, seed: u32, span: f32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let h = (i as u32 ^ seed).wrapping_mul(2_654_435_761) >> 8;
            let u = h as f32 / (1u32 << 24) as f32; // [0, 1)
            (u - 0.5) * span * (1.0 + (i % 7) as f32)
        })
        .collect()
}

#[test]
fn linear_fp8_is_the_reference_rounded_once_on_every_host_path() {
    let host = HostDevice::with_capacity(64 << 20).unwrap();
    let deferred = DeferredComputeDevice::new(host.clone()).unwrap();
    let (rows, k, n) = (2 * 5, 48, 24);
    let xv = values(rows * k, 7, 3.0);
    let wv = values(n * k, 11, 100.0);
    let bv = values(n, 13, 1.0);
    let codes_of = |v: &[f32]| Tensor::from_f32(vec![v.len()], DType::F8E4M3, v).unwrap();
    let codes: Vec<f32> = codes_of(&wv).host_f32().unwrap();
    let scale = 0.015625;
    let mut outs = Vec::new();
    for d in [&*host as &dyn Device, &*deferred as &dyn Device] {
        let ops = ops_of(d).unwrap();
        let x = on(d, &[2, 5, k], DType::BF16, &xv);
        let w = on(d, &[n, k], DType::F8E4M3, &wv)
            .with_scale(Some(scale))
            .unwrap();
        let b = on(d, &[n], DType::BF16, &bv);
        let y = ops.linear_fp8(&x, &w, Some(&b)).unwrap();
        assert_eq!(y.shape(), [2, 5, n]);
        assert_eq!(y.dtype(), DType::BF16);
        outs.push(ops.to_f32_vec(&y).unwrap());
        assert!(!ops.fp8_tensor_cores());
    }
    // The reference from the operands as the device holds them (bf16 input and bias).
    let xb = Tensor::from_f32(vec![rows * k], DType::BF16, &xv)
        .unwrap()
        .host_f32()
        .unwrap();
    let bb = Tensor::from_f32(vec![n], DType::BF16, &bv)
        .unwrap()
        .host_f32()
        .unwrap();
    let want = linear_reference(&xb, k, &codes, scale, Some(&bb)).unwrap();
    let want = Tensor::from_f32(vec![want.len()], DType::BF16, &want)
        .unwrap()
        .host_f32()
        .unwrap();
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&outs[0]), bits(&want));
    assert_eq!(bits(&outs[1]), bits(&want));
    // With the GELU: exactly the product, then the element-wise GELU, on both devices.
    for d in [&*host as &dyn Device, &*deferred as &dyn Device] {
        let ops = ops_of(d).unwrap();
        let x = on(d, &[2, 5, k], DType::BF16, &xv);
        let w = on(d, &[n, k], DType::F8E4M3, &wv)
            .with_scale(Some(scale))
            .unwrap();
        let fused = ops.linear_fp8_gelu_tanh(&x, &w, None).unwrap();
        let composed = ops
            .unary_owned(
                ops.linear_fp8(&x, &w, None).unwrap(),
                ddo_core::UnaryOp::GeluTanh,
            )
            .unwrap();
        assert_eq!(
            bits(&ops.to_f32_vec(&fused).unwrap()),
            bits(&ops.to_f32_vec(&composed).unwrap())
        );
    }
    // Not the bf16 product of the upcast weight: the activation was quantized.
    let ops = ops_of(&*host).unwrap();
    let x = on(&*host, &[rows, k], DType::BF16, &xv);
    let w = on(&*host, &[n, k], DType::F8E4M3, &wv)
        .with_scale(Some(scale))
        .unwrap();
    let plain = ops.to_f32_vec(&ops.linear(&x, &w, None).unwrap()).unwrap();
    let fp8 = ops
        .to_f32_vec(&ops.linear_fp8(&x, &w, None).unwrap())
        .unwrap();
    assert_ne!(bits(&plain), bits(&fp8));
    let rel = (plain
        .iter()
        .zip(&fp8)
        .map(|(a, b)| (a - b) * (a - b))
        .sum::<f32>()
        / plain.iter().map(|a| a * a).sum::<f32>())
    .sqrt();
    assert!(rel < 0.1, "fp8 against bf16 compute: relative L2 {rel}");
}

#[test]
fn a_non_finite_input_or_a_bad_operand_is_refused() {
    let host = HostDevice::with_capacity(16 << 20).unwrap();
    let ops = ops_of(&*host).unwrap();
    let w = on(&*host, &[4, 8], DType::F8E4M3, &values(32, 3, 4.0));
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut xv = values(16, 5, 2.0);
        xv[9] = bad;
        let x = on(&*host, &[2, 8], DType::BF16, &xv);
        match ops.linear_fp8(&x, &w, None) {
            Err(CoreError::NonFiniteActivation { .. }) => {}
            other => panic!("{bad}: {other:?}"),
        }
    }
    let x = on(&*host, &[2, 8], DType::BF16, &values(16, 5, 2.0));
    // A bf16 weight, an E5M2 one, a mismatched width, a bias of the wrong length.
    let bf16 = on(&*host, &[4, 8], DType::BF16, &values(32, 3, 4.0));
    let e5m2 = on(&*host, &[4, 8], DType::F8E5M2, &values(32, 3, 4.0));
    let narrow = on(&*host, &[4, 6], DType::F8E4M3, &values(24, 3, 4.0));
    let bias = on(&*host, &[3], DType::BF16, &[0.0; 3]);
    for (what, r) in [
        ("bf16", ops.linear_fp8(&x, &bf16, None)),
        ("e5m2", ops.linear_fp8(&x, &e5m2, None)),
        ("width", ops.linear_fp8(&x, &narrow, None)),
        ("bias", ops.linear_fp8(&x, &w, Some(&bias))),
    ] {
        assert!(matches!(r, Err(CoreError::Shape { .. })), "{what}: {r:?}");
    }
}
