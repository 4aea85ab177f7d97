//! Run-time LoRA adapters (`ddo_core::adapter`) on a host device wrapped in the fault
//! injector (which counts ops by name): the adapters' sum is the composition's values; a
//! shared down-projection (`Adapter::shared_down`, one `A` for q, k and v) is computed once
//! per input through a `DownCache`, and recomputed for another input or an `A` not shared.

use std::sync::Arc;

use ddo_core::adapter::{Adapter, DownCache, adapter_sum, add_adapters};
use ddo_core::{DType, FaultInjectingDevice, Ops, Tensor};
use ddo_host::HostDevice;

fn device() -> Arc<FaultInjectingDevice> {
    FaultInjectingDevice::new(HostDevice::with_capacity(1 << 20).unwrap())
}

fn t(ops: &dyn Ops, shape: &[usize], seed: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.37 + seed).sin()).collect();
    ops.tensor_from_f32(shape, DType::F32, &v).unwrap()
}

fn linears(f: &FaultInjectingDevice) -> u64 {
    f.op_times()
        .into_iter()
        .filter(|(n, ..)| n == "linear")
        .map(|(_, c, _)| c)
        .sum()
}

#[test]
fn a_shared_down_projection_is_computed_once_per_input() {
    let f = device();
    let ops: &dyn Ops = &*f;
    let x = t(ops, &[3, 8], 0.0);
    let down = t(ops, &[2, 8], 1.0);
    let adapters: Vec<Adapter> = (0..3)
        .map(|k| Adapter {
            down: down.clone(),
            up: t(ops, &[5, 2], 2.0 + k as f32),
            scale: 1.0,
            shared_down: true,
        })
        .collect();
    let values = |t: &Tensor| ops.to_f32_vec(t).unwrap();
    // Without a cache: each adapter's down and up projections, 6 linears.
    f.time_ops(true);
    let plain: Vec<Vec<f32>> = adapters
        .iter()
        .map(|a| {
            let s = adapter_sum(ops, &[&x], std::slice::from_ref(a), None).unwrap();
            values(&s.unwrap())
        })
        .collect();
    assert_eq!(linears(&f), 6);
    f.time_ops(false);
    // With one: the down-projection once, the three up-projections, the same values.
    let cache = DownCache::default();
    f.time_ops(true);
    for (a, want) in adapters.iter().zip(&plain) {
        let s = adapter_sum(ops, &[&x], std::slice::from_ref(a), Some(&cache)).unwrap();
        assert_eq!(&values(&s.unwrap()), want);
    }
    assert_eq!(linears(&f), 4);
    f.time_ops(false);
    // Another tensor of the same values is another input: computed again.
    let x2 = t(ops, &[3, 8], 0.0);
    f.time_ops(true);
    let s = adapter_sum(ops, &[&x2], &adapters[..1], Some(&cache)).unwrap();
    assert_eq!(values(&s.unwrap()), plain[0]);
    assert_eq!(linears(&f), 2);
    f.time_ops(false);
    // An `A` not marked shared is never kept: each call computes it.
    let own = Adapter {
        shared_down: false,
        ..adapters[0].clone()
    };
    let cache = DownCache::default();
    f.time_ops(true);
    for _ in 0..2 {
        let s = adapter_sum(ops, &[&x], std::slice::from_ref(&own), Some(&cache)).unwrap();
        assert_eq!(values(&s.unwrap()), plain[0]);
    }
    assert_eq!(linears(&f), 4);
    f.time_ops(false);
}

#[test]
fn adapters_add_to_an_output_as_their_sum_does() {
    let f = device();
    let ops: &dyn Ops = &*f;
    let x = t(ops, &[4, 6], 0.5);
    let w = t(ops, &[7, 6], 1.5);
    let adapters = [
        Adapter {
            down: t(ops, &[3, 6], 2.5),
            up: t(ops, &[7, 3], 3.5),
            scale: 1.0,
            shared_down: false,
        },
        Adapter {
            down: t(ops, &[2, 6], 4.5),
            up: t(ops, &[7, 2], 5.5),
            scale: 0.25,
            shared_down: false,
        },
    ];
    let values = |t: &Tensor| ops.to_f32_vec(t).unwrap();
    // y = W x + Σ scale B A x, computed by hand on the host.
    let (xv, wv) = (values(&x), values(&w));
    let matmul = |a: &[f32], b: &[f32], rows: usize, inner: usize, out: usize| -> Vec<f32> {
        (0..rows * out)
            .map(|i| {
                let (r, o) = (i / out, i % out);
                (0..inner)
                    .map(|k| a[r * inner + k] * b[o * inner + k])
                    .sum()
            })
            .collect()
    };
    let mut want = matmul(&xv, &wv, 4, 6, 7);
    for a in &adapters {
        let rank = a.down.shape()[0];
        let tv = matmul(&xv, &values(&a.down), 4, 6, rank);
        let uv = matmul(&tv, &values(&a.up), 4, rank, 7);
        want.iter_mut().zip(uv).for_each(|(y, u)| *y += a.scale * u);
    }
    let close = |got: &[f32]| {
        got.iter()
            .zip(&want)
            .all(|(g, w)| (g - w).abs() <= 1e-5 * (1.0 + w.abs()))
    };
    let y = ops.linear(&x, &w, None).unwrap();
    let added = add_adapters(ops, &[&x], y, &adapters, None).unwrap();
    assert!(close(&values(&added)), "{:?} vs {want:?}", values(&added));
    let sum = adapter_sum(ops, &[&x], &adapters, None).unwrap().unwrap();
    let summed = ops.linear_accumulate(&x, &w, None, sum, false).unwrap();
    assert!(close(&values(&summed)), "{:?} vs {want:?}", values(&summed));
    assert!(adapter_sum(ops, &[&x], &[], None).unwrap().is_none());
}
