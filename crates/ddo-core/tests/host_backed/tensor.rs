//! Tensors to and from a host device: values and fp8 scales kept.

use ddo_core::{DType, Device, Tensor};
use ddo_host::HostDevice;

#[test]
fn only_fp8_tensors_take_a_finite_positive_scale_and_keep_it() {
    let t = Tensor::from_f32(vec![2, 2], DType::F8E4M3, &[1.0, -2.0, 0.5, 4.0]).unwrap();
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        assert!(t.clone().with_scale(Some(bad)).is_err(), "{bad}");
    }
    let bf = Tensor::from_f32(vec![2], DType::BF16, &[1.0, 2.0]).unwrap();
    assert!(bf.with_scale(Some(0.5)).is_err());
    let s = t.with_scale(Some(0.25)).unwrap();
    assert_eq!(s.host_f32().unwrap(), vec![0.25, -0.5, 0.125, 1.0]);
    assert_eq!(s.reshape(&[4]).unwrap().scale(), Some(0.25));
    let d = HostDevice::with_capacity(1 << 20).unwrap();
    let on = s.to_device(&*d, &d.compute_stream()).unwrap();
    assert_eq!(on.scale(), Some(0.25));
    assert_eq!(
        on.to_f32_vec(&*d, &d.compute_stream()).unwrap(),
        vec![0.25, -0.5, 0.125, 1.0]
    );
}

#[test]
fn device_round_trip_preserves_values() {
    let d = HostDevice::with_capacity(1 << 20).unwrap();
    let s = d.compute_stream();
    let t = Tensor::from_f32(vec![2, 2], DType::BF16, &[1.0, -2.0, 0.5, 4.0]).unwrap();
    let on = t.to_device(&*d, &s).unwrap();
    assert!(on.is_on_device());
    assert_eq!(on.to_f32_vec(&*d, &s).unwrap(), vec![1.0, -2.0, 0.5, 4.0]);
    drop(on);
    assert_eq!(d.memory_info().allocated, 0);
}
