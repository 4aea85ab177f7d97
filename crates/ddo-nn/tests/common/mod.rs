//! Helpers the tests share (LoRA files; a forward's output bytes and uploads).
#![allow(dead_code)]

use std::path::Path;

use safetensors::Dtype;
use safetensors::tensor::TensorView;

/// Tensors to write: name, shape, values.
pub type Tensors = Vec<(String, Vec<usize>, Vec<f32>)>;

/// Writes `tensors` at `path` as an f32 safetensors file, or bf16 with `bf16`.
pub fn write_safetensors(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)], bf16: bool) {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| {
            if bf16 {
                v.iter()
                    .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                    .collect()
            } else {
                v.iter().flat_map(|x| x.to_le_bytes()).collect()
            }
        })
        .collect();
    let dtype = if bf16 { Dtype::BF16 } else { Dtype::F32 };
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((n, s, _), b)| (n.clone(), TensorView::new(dtype, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// Relative L2 distance of `a` from `b` (`‖a − b‖ / ‖b‖`, in f64).
pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// Runs `run` (a forward on `f`) with `f`'s op table on; returns the output's bytes and how
/// many host tensors ops made meanwhile (`tensor_from_f32` calls: a forward's rotary tables
/// are two of them).
pub fn bytes_and_uploads(
    f: &ddo_core::FaultInjectingDevice,
    run: &dyn Fn() -> ddo_core::Tensor,
) -> (Vec<u8>, u64) {
    use ddo_core::Device;
    f.time_ops(true);
    let out = run()
        .to_host_bytes(f, &f.compute_stream())
        .expect("to host");
    let n = f
        .op_times()
        .iter()
        .find(|(op, _, _)| op == "tensor_from_f32")
        .map_or(0, |&(_, n, _)| n);
    f.time_ops(false);
    (out, n)
}

/// Checks that `named` (a model's `linear_calls` for a forward's sizes) holds exactly the
/// distinct linear calls `run` (that forward on `f`) makes, each shape, bias and epilogue.
pub fn assert_named_linears_are_made(
    f: &ddo_core::FaultInjectingDevice,
    run: &dyn Fn(),
    named: &[ddo_core::LinearCall],
) {
    f.record_linears();
    run();
    let made = ddo_core::linear_calls::distinct(&f.recorded_linears());
    assert!(!named.is_empty());
    let set =
        |v: &[ddo_core::LinearCall]| v.iter().cloned().collect::<std::collections::HashSet<_>>();
    assert_eq!(set(named), set(&made), "named {named:#?}\nmade {made:#?}");
    assert_eq!(named.len(), made.len());
}

/// How many times `run` (a forward on `f`) called each op, by name.
pub fn op_calls(
    f: &ddo_core::FaultInjectingDevice,
    run: &dyn Fn(),
) -> std::collections::BTreeMap<String, u64> {
    f.time_ops(true);
    run();
    let calls = f.op_times().into_iter().map(|(op, n, _)| (op, n)).collect();
    f.time_ops(false);
    calls
}

/// A fault-injecting wrapper of a 1 GiB host device, with `component`'s weights moved onto
/// it (the tests that count a forward's ops, linears and uploads).
pub fn fault_device_holding(
    component: &ddo_core::Component,
) -> std::sync::Arc<ddo_core::FaultInjectingDevice> {
    use ddo_core::Device;
    let host = ddo_host::HostDevice::with_capacity(1 << 30).expect("host device");
    let f = ddo_core::FaultInjectingDevice::new(host);
    component
        .to_device(&*f, &f.compute_stream())
        .expect("to_device");
    f
}
