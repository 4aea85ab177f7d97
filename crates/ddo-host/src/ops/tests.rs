//! Tests of the host ops as one plane: the device's ops handle, dtypes, bad input across
//! families, fp8, output accounting, stream ordering and exclusive buffers.

use super::*;
use crate::device::HostDeviceConfig;
use crate::ops::test_support::*;
use ddo_core::device::ops_of;
use ddo_core::rng::SplitMix64;

#[test]
fn host_device_exposes_its_ops() {
    let d = dev();
    let ops = ops_of(&*d).unwrap();
    let t = ops.tensor_from_f32(&[2], DType::F32, &[1.0, 2.0]).unwrap();
    assert!(t.is_on_device());
    assert_eq!(ops.to_f32_vec(&t).unwrap(), vec![1.0, 2.0]);
}

#[test]
fn bf16_inputs_stay_within_bf16_tolerance() {
    let d = dev();
    let mut rng = SplitMix64::new(2);
    let (inp, out) = (32, 16);
    let x = random(&mut rng, 4 * inp);
    let w = random(&mut rng, out * inp);
    let (xt, wt) = (
        put(&d, &[4, inp], DType::BF16, &x),
        put(&d, &[out, inp], DType::BF16, &w),
    );
    // The reference sees the bf16-rounded inputs; the output is rounded once.
    let (xr, wr) = (get(&d, &xt), get(&d, &wt));
    let y = d.linear(&xt, &wt, None).unwrap();
    assert_eq!(y.dtype(), DType::BF16);
    assert_close(
        "bf16 linear",
        &get(&d, &y),
        &ref_linear(&xr, &wr, None, inp, out),
        BF16_TOL,
    );
    let s = d.binary(&xt, &xt, BinaryOp::Mul).unwrap();
    let want: Vec<f64> = xr.iter().map(|&v| f64::from(v) * f64::from(v)).collect();
    assert_close("bf16 mul", &get(&d, &s), &want, BF16_TOL);
    let g = d.unary(&xt, UnaryOp::GeluErf).unwrap();
    let want: Vec<f64> = xr.iter().map(|&v| ref_gelu_erf(f64::from(v))).collect();
    assert_close("bf16 gelu", &get(&d, &g), &want, BF16_TOL);
}

#[test]
fn affine_softmax_reduce_and_upsample() {
    let d = dev();
    let mut rng = SplitMix64::new(8);
    let x: Vec<f32> = random(&mut rng, 2 * 3 * 4)
        .iter()
        .map(|v| v * 8.0)
        .collect();
    let xt = put(&d, &[2, 3, 4], DType::F32, &x);

    let y = d.affine(&xt, 1.5, -0.25).unwrap();
    let want: Vec<f64> = x.iter().map(|&v| f64::from(v) * 1.5 - 0.25).collect();
    assert_close("affine", &get(&d, &y), &want, F32_TOL);

    let y = d.softmax(&xt).unwrap();
    let mut want = Vec::new();
    for row in x.chunks(4) {
        let e: Vec<f64> = row.iter().map(|&v| f64::from(v).exp()).collect();
        let s: f64 = e.iter().sum();
        want.extend(e.iter().map(|v| v / s));
    }
    assert_close("softmax", &get(&d, &y), &want, F32_TOL);

    let shape = [2, 3, 4];
    for dim in 0..3 {
        for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
            let y = d.reduce(&xt, dim, op).unwrap();
            let mut osh = shape;
            osh[dim] = 1;
            assert_eq!(y.shape(), &osh);
            let want: Vec<f64> = (0..osh.iter().product())
                .map(|i| {
                    let mut idx = unravel(i, &osh);
                    let vals: Vec<f64> = (0..shape[dim])
                        .map(|j| {
                            idx[dim] = j;
                            f64::from(x[ravel_broadcast(&idx, &shape)])
                        })
                        .collect();
                    match op {
                        ReduceOp::Sum => vals.iter().sum(),
                        ReduceOp::Mean => vals.iter().sum::<f64>() / vals.len() as f64,
                        ReduceOp::Max => vals.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                    }
                })
                .collect();
            assert_close(
                &format!("reduce {op:?} dim {dim}"),
                &get(&d, &y),
                &want,
                F32_TOL,
            );
        }
    }

    let x = random(&mut rng, 2 * 2 * 3 * 5);
    let y = d
        .upsample_nearest2x(&put(&d, &[2, 2, 3, 5], DType::F32, &x))
        .unwrap();
    assert_eq!(y.shape(), &[2, 2, 6, 10]);
    let got = get(&d, &y);
    for (i, &g) in got.iter().enumerate() {
        let [n, c, yy, xx] = unravel(i, &[2, 2, 6, 10])[..] else {
            unreachable!()
        };
        assert_eq!(g, x[((n * 2 + c) * 3 + yy / 2) * 5 + xx / 2]);
    }
}

#[test]
fn bad_shapes_wrong_devices_and_ids_are_typed_errors() {
    let d = dev();
    let t = |shape: &[usize]| put(&d, shape, DType::F32, &vec![0.5; shape.iter().product()]);
    let is_shape = |r: Result<Tensor>| matches!(r, Err(CoreError::Shape { .. }));
    assert!(is_shape(d.linear(&t(&[2, 3]), &t(&[4, 5]), None)));
    assert!(is_shape(d.linear(&t(&[2, 3]), &t(&[4, 3]), Some(&t(&[3])))));
    assert!(is_shape(d.matmul(&t(&[2, 3]), &t(&[4, 5]))));
    assert!(is_shape(d.matmul(&t(&[2, 2, 3]), &t(&[3, 3, 5]))));
    assert!(is_shape(d.matmul(&t(&[3]), &t(&[3, 5]))));
    assert!(is_shape(d.conv2d(
        &t(&[1, 2, 4, 4]),
        &t(&[3, 4, 3, 3]),
        None,
        Conv2dParams::new(1, 1)
    )));
    assert!(is_shape(d.conv2d(
        &t(&[1, 2, 2, 2]),
        &t(&[3, 2, 5, 5]),
        None,
        Conv2dParams::new(1, 0)
    )));
    assert!(is_shape(d.conv2d(
        &t(&[1, 2, 4, 4]),
        &t(&[3, 2, 3, 3]),
        None,
        Conv2dParams::new(0, 1)
    )));
    assert!(is_shape(d.group_norm(&t(&[1, 6, 2]), 4, None, None, 1e-5)));
    assert!(is_shape(d.layer_norm(
        &t(&[2, 3]),
        Some(&t(&[2])),
        None,
        1e-5
    )));
    assert!(is_shape(d.rms_norm(&t(&[]), None, 1e-5)));
    assert!(is_shape(d.binary(&t(&[2, 3]), &t(&[4]), BinaryOp::Add)));
    assert!(is_shape(d.reduce(&t(&[2, 3]), 2, ReduceOp::Sum)));
    assert!(is_shape(d.upsample_nearest2x(&t(&[2, 3]))));
    let (q, k) = (t(&[1, 2, 3, 4]), t(&[1, 2, 5, 4]));
    assert!(is_shape(d.attention(&q, &t(&[1, 2, 5, 3]), &k, None, 1.0)));
    assert!(is_shape(d.attention(&q, &k, &t(&[1, 2, 4, 4]), None, 1.0)));
    assert!(is_shape(d.attention(&q, &k, &k, Some(&t(&[3, 4])), 1.0)));
    assert!(is_shape(d.attention(
        &q,
        &k,
        &k,
        Some(&t(&[2, 2, 3, 5])),
        1.0
    )));
    assert!(is_shape(d.rope(
        &t(&[1, 1, 2, 3]),
        &t(&[2, 3]),
        &t(&[2, 3])
    )));
    assert!(is_shape(d.rope(
        &t(&[1, 1, 2, 4]),
        &t(&[3, 4]),
        &t(&[3, 4])
    )));
    assert!(is_shape(d.concat(&[&t(&[2, 3]), &t(&[3, 3])], 1)));
    assert!(is_shape(d.concat(&[], 0)));
    assert!(is_shape(d.narrow(&t(&[2, 3]), 1, 2, 2)));
    assert!(is_shape(d.narrow(&t(&[2, 3]), 1, usize::MAX, 2)));
    assert!(is_shape(d.permute(&t(&[2, 3]), &[0, 0])));
    assert!(is_shape(d.permute(&t(&[2, 3]), &[0, 1, 2])));
    assert!(is_shape(d.tensor_from_f32(&[2, 2], DType::F32, &[1.0; 3])));
    assert!(is_shape(d.cast(&t(&[2]), DType::Quantized)));
    // Absurd padding: an overflow is a shape error, a huge output a typed out-of-memory
    // (before any host scratch of that size is made).
    let (x, w) = (t(&[1, 2, 4, 4]), t(&[3, 2, 3, 3]));
    assert!(is_shape(d.conv2d(
        &x,
        &w,
        None,
        Conv2dParams::new(1, usize::MAX / 2)
    )));
    let err = d
        .conv2d(&x, &w, None, Conv2dParams::new(1, 1 << 20))
        .unwrap_err();
    assert!(matches!(err, CoreError::OutOfMemory { .. }), "{err}");
    // An id out of range.
    let err = d.embedding(&t(&[4, 2]), &[1, 4]).unwrap_err();
    assert!(
        matches!(&err, CoreError::Shape { message, .. } if message.contains("id 4")),
        "{err}"
    );

    // A tensor of another device, and a host tensor.
    let other = dev();
    let foreign = other
        .tensor_from_f32(&[2], DType::F32, &[1.0, 2.0])
        .unwrap();
    let err = d.unary(&foreign, UnaryOp::Relu).unwrap_err();
    assert!(matches!(err, CoreError::WrongDevice { .. }), "{err}");
    let err = d.binary(&t(&[2]), &foreign, BinaryOp::Add).unwrap_err();
    assert!(matches!(err, CoreError::WrongDevice { .. }), "{err}");
    let host = Tensor::from_f32(vec![2], DType::F32, &[1.0, 2.0]).unwrap();
    let err = d.affine(&host, 1.0, 0.0).unwrap_err();
    assert!(matches!(err, CoreError::WrongDevice { .. }), "{err}");
    assert!(d.to_f32_vec(&host).is_err());
}

/// `count_non_finite` counts NaN and ±Inf in every dtype, fp8 bytes included, after the
/// work queued before it, through the device's (profiled) ops handle too; quantized
/// storage and host tensors are typed errors.
#[test]
fn count_non_finite_counts_nan_and_inf_of_every_dtype() {
    let d = dev();
    let values = [0.5, f32::NAN, -1.0, f32::INFINITY, f32::NEG_INFINITY, 7.0];
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let t = put(&d, &[2, 3], dtype, &values);
        assert_eq!(d.count_non_finite(&t).unwrap(), 3, "{dtype}");
        let clean = put(&d, &[2, 3], dtype, &[0.0, 1.0, -2.0, 1e4, -1e-4, 3.0]);
        assert_eq!(d.count_non_finite(&clean).unwrap(), 0, "{dtype}");
    }
    // f32 values beyond f16's range become Inf there; bf16 keeps them finite.
    let big = [1e5f32, -7e4, 3e38];
    assert_eq!(
        d.count_non_finite(&put(&d, &[3], DType::F16, &big))
            .unwrap(),
        3
    );
    assert_eq!(
        d.count_non_finite(&put(&d, &[3], DType::BF16, &big))
            .unwrap(),
        0
    );
    let ops = ops_of(&*d).unwrap();
    let t = put(&d, &[6], DType::BF16, &values);
    assert_eq!(ops.count_non_finite(&t).unwrap(), 3);
    // fp8: e4m3's NaN byte (0x7f), e5m2's Inf byte (0x7c) written as stored.
    let x = put(&d, &[4], DType::F32, &[1.0, 2.0, 3.0, 4.0]);
    for (dtype, byte) in [(DType::F8E4M3, 0x7fu8), (DType::F8E5M2, 0x7c)] {
        let q = d.cast(&x, dtype).unwrap();
        assert_eq!(d.count_non_finite(&q).unwrap(), 0, "{dtype}");
        let TensorStorage::Device(slice) = q.storage() else {
            panic!("a device tensor")
        };
        d.allocation(slice.buffer())
            .unwrap()
            .with_bytes_mut(|b| b[slice.offset() + 2] = byte);
        assert_eq!(d.count_non_finite(&q).unwrap(), 1, "{dtype}");
    }
    let host = Tensor::from_f32(vec![2], DType::F32, &[1.0, f32::NAN]).unwrap();
    assert!(d.count_non_finite(&host).is_err());
}

/// The host backend computes on 8-bit float tensors by decoding them (exactly) to f32:
/// a cast round trip gives the dtype's own encoding, and a linear over an fp8 weight
/// equals the linear over that weight's decoded values.
#[test]
fn fp8_tensors_cast_exactly_and_compute_as_their_decoded_values() {
    let d = dev();
    let mut rng = SplitMix64::new(31);
    let values: Vec<f32> = random(&mut rng, 48).iter().map(|v| v * 300.0).collect();
    let x = put(&d, &[4, 12], DType::F32, &values);
    for dtype in [DType::F8E4M3, DType::F8E5M2] {
        let q = d.cast(&x, dtype).unwrap();
        assert_eq!((q.dtype(), q.nbytes()), (dtype, 48));
        let want = dtype
            .decode_f32(&dtype.encode_f32(&values).unwrap())
            .unwrap();
        assert_eq!(get(&d, &d.cast(&q, DType::F32).unwrap()), want, "{dtype}");
        let back = d.cast(&d.cast(&q, DType::BF16).unwrap(), dtype).unwrap();
        assert_eq!(get(&d, &back), want, "{dtype}: through bf16 and back");
        // A linear [3, 12] · [4, 12]^T with the fp8 tensor as the weight.
        let input = put(&d, &[3, 12], DType::F32, &random(&mut rng, 36));
        let decoded = put(&d, &[4, 12], DType::F32, &want);
        assert_eq!(
            get(&d, &d.linear(&input, &q, None).unwrap()),
            get(&d, &d.linear(&input, &decoded, None).unwrap()),
            "{dtype}"
        );
    }
}

/// A scaled fp8 weight (ComfyUI's scaled fp8, or `--dtype fp8_e4m3`) computes as its
/// dequantized values `decode(byte) * scale`, rounded to the input's dtype, as CUDA's
/// upcast into scratch stores them; casts dequantize; every other op refuses it.
#[test]
fn scaled_fp8_weights_compute_as_their_dequantized_values() {
    let d = dev();
    let mut rng = SplitMix64::new(32);
    let values: Vec<f32> = random(&mut rng, 48).iter().map(|v| v * 0.02).collect();
    for dtype in [DType::F8E4M3, DType::F8E5M2] {
        let (codes, scale) = dtype.quantize_scaled("w", &values).unwrap();
        let raw = put(&d, &[48], dtype, &dtype.decode_f32(&codes).unwrap());
        let q = raw
            .reshape(&[4, 12])
            .unwrap()
            .with_scale(Some(scale))
            .unwrap();
        assert_eq!(q.scale(), Some(scale));
        let dequant: Vec<f32> = dtype
            .decode_f32(&codes)
            .unwrap()
            .iter()
            .map(|v| v * scale)
            .collect();
        assert_eq!(
            get(&d, &d.cast(&q, DType::F32).unwrap()),
            dequant,
            "{dtype}"
        );
        for compute in [DType::F32, DType::BF16] {
            let rounded = compute
                .decode_f32(&compute.encode_f32(&dequant).unwrap())
                .unwrap();
            let x = d
                .cast(
                    &put(&d, &[3, 12], DType::F32, &random(&mut rng, 36)),
                    compute,
                )
                .unwrap();
            let plain = put(&d, &[4, 12], compute, &rounded);
            let bias_codes = dtype
                .quantize_scaled("b", &[0.5, -0.25, 0.125, 1.0])
                .unwrap();
            let b = put(&d, &[4], dtype, &dtype.decode_f32(&bias_codes.0).unwrap())
                .with_scale(Some(bias_codes.1))
                .unwrap();
            let b_plain = put(
                &d,
                &[4],
                compute,
                &get(&d, &d.cast(&b, DType::F32).unwrap()),
            );
            assert_eq!(
                get(&d, &d.linear(&x, &q, Some(&b)).unwrap()),
                get(&d, &d.linear(&x, &plain, Some(&b_plain)).unwrap()),
                "{dtype} into {compute}"
            );
        }
        // Scaling is not an unscaled fp8 value: an op that reads stored values refuses.
        let err = d.unary(&q, UnaryOp::Silu).unwrap_err();
        assert!(err.to_string().contains("scaled fp8"), "{err}");
        // A same-dtype cast keeps the bytes and the scale.
        assert_eq!(d.cast(&q, dtype).unwrap().scale(), Some(scale));
    }
}

#[test]
fn outputs_are_accounted_and_freed() {
    let d = dev();
    let mut rng = SplitMix64::new(12);
    let x = put(&d, &[1, 2, 6, 6], DType::F32, &random(&mut rng, 72));
    let w = put(&d, &[3, 2, 3, 3], DType::F32, &random(&mut rng, 54));
    let before = d.memory_info().allocated;
    let y = d.conv2d(&x, &w, None, Conv2dParams::new(1, 1)).unwrap();
    assert_eq!(d.memory_info().allocated, before + y.nbytes() as u64);
    let outs = vec![
        d.upsample_nearest2x(&y).unwrap(),
        d.group_norm(&y, 3, None, None, 1e-6).unwrap(),
        d.unary(&y, UnaryOp::Silu).unwrap(),
        d.binary(&y, &x.reshape(&[2, 1, 6, 6]).unwrap(), BinaryOp::Add)
            .unwrap(),
        d.permute(&y, &[0, 2, 3, 1]).unwrap(),
        d.cast(&y, DType::BF16).unwrap(),
    ];
    assert!(d.memory_info().allocated > before);
    drop(outs);
    drop(y);
    assert_eq!(d.memory_info().allocated, before);
    // An op that fails for lack of memory leaves the accounting as it was.
    let tiny = HostDevice::with_capacity(64).unwrap();
    let t = tiny.tensor_from_f32(&[8], DType::F32, &[1.0; 8]).unwrap();
    let err = tiny
        .upsample_nearest2x(&t.reshape(&[1, 1, 2, 4]).unwrap())
        .unwrap_err();
    assert!(matches!(err, CoreError::OutOfMemory { .. }), "{err}");
    assert_eq!(tiny.memory_info().allocated, 32);
}

#[test]
fn ops_run_after_copies_ordered_on_the_compute_stream() {
    let d = HostDevice::new(HostDeviceConfig {
        link_bytes_per_sec: Some(2_000.0), // 64 B take 32 ms
        ..HostDeviceConfig::default()
    })
    .unwrap();
    let copy = d.create_stream().unwrap();
    let src = d.alloc_pinned(64).unwrap();
    let values: Vec<f32> = (0..16).map(|i| i as f32).collect();
    let bytes = DType::F32.encode_f32(&values).unwrap();
    src.with_bytes_mut(|b| b.copy_from_slice(&bytes)).unwrap();
    let dst = d.alloc(64).unwrap();
    d.copy_h2d(&src.slice_all(), &dst.slice_all(), &copy)
        .unwrap();
    let done = d.record_event(&copy).unwrap();
    d.wait_event(&d.compute_stream(), &done).unwrap();
    let t = Tensor::new(vec![16], DType::F32, TensorStorage::Device(dst.slice_all())).unwrap();
    let y = d.affine(&t, 2.0, 1.0).unwrap();
    let want: Vec<f32> = values.iter().map(|v| v * 2.0 + 1.0).collect();
    assert_eq!(get(&d, &y), want);
}

#[test]
fn exclusive_device_buffers_are_detected() {
    let d = dev();
    let mut x = put(&d, &[2, 4], DType::F32, &[1.0; 8]);
    assert!(x.has_exclusive_device_buffer(), "a fresh upload");
    let mut y = d.unary(&x, UnaryOp::Exp).unwrap();
    assert!(y.has_exclusive_device_buffer(), "a fresh op output");

    let mut c = y.clone();
    assert!(!y.has_exclusive_device_buffer(), "the original of a clone");
    assert!(!c.has_exclusive_device_buffer(), "a clone");
    drop(c);
    assert!(y.has_exclusive_device_buffer(), "after the clone is gone");

    let mut v = x.reshape(&[8]).unwrap();
    assert!(!x.has_exclusive_device_buffer(), "viewed by a reshape");
    assert!(!v.has_exclusive_device_buffer(), "a reshape view");
    drop(x);
    assert!(v.has_exclusive_device_buffer(), "the view alone");

    // A view of part of a buffer, even as its only handle.
    let buffer = d.alloc(64).unwrap();
    let mut part = Tensor::new(
        vec![4],
        DType::F32,
        TensorStorage::Device(buffer.slice(16, 16).unwrap()),
    )
    .unwrap();
    drop(buffer);
    assert!(!part.has_exclusive_device_buffer(), "part of a buffer");
    let buffer = d.alloc(16).unwrap();
    let mut whole = Tensor::new(
        vec![4],
        DType::F32,
        TensorStorage::Device(buffer.slice_all()),
    )
    .unwrap();
    assert!(
        !whole.has_exclusive_device_buffer(),
        "the buffer is still held"
    );
    drop(buffer);
    assert!(
        whole.has_exclusive_device_buffer(),
        "all of a buffer, alone"
    );

    let mut host = Tensor::from_f32(vec![2], DType::F32, &[1.0, 2.0]).unwrap();
    assert!(!host.has_exclusive_device_buffer(), "a host tensor");
}
