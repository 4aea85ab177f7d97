//! GPU tests of `Ops::attention_input` (issue 39's fused q/k norm, join, move to heads and
//! rotary embedding): the CUDA kernel gives the bytes of the composition it replaces
//! (`attention_input_composed`: `rms_norm`, `permute`, `rope`, the rows placed, each on the
//! GPU), for a joint attention's two streams written into one output and for a single
//! stream, with and without a norm or tables; operands the kernel does not take (f32) run
//! the composition; a bad shape is a typed error. Without a driver or a device each test
//! prints "skipped: no CUDA device" and passes (unless `DDO_REQUIRE_GPU=1`), like
//! `tests/gpu.rs`.

use ddo_core::device::ops_of;
use ddo_core::ops::attention_input_composed;
use ddo_core::rng::SplitMix64;
use ddo_core::{AttentionInput, CoreError, DType, Device, Tensor};
use ddo_host::HostDevice;

mod common;

fn values(n: usize, span: f32, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix64::new(seed);
    (0..n).map(|_| rng.next_signed() * span).collect()
}

/// The operands of a joint attention's q on `dev`: a context part [b, lt, h·d] and an
/// image part [b, li, h·d] of `dtype`, their norm weights [d], f32 tables [lt + li, d].
struct Operands {
    ctx: Tensor,
    img: Tensor,
    w_ctx: Tensor,
    w_img: Tensor,
    cos: Tensor,
    sin: Tensor,
}

fn operands(
    dev: &dyn Device,
    dtype: DType,
    (b, lt, li, h, d): (usize, usize, usize, usize, usize),
) -> Operands {
    let on = |shape: &[usize], dtype: DType, v: &[f32]| {
        Tensor::from_f32(shape.to_vec(), dtype, v)
            .unwrap()
            .to_device(dev, &dev.compute_stream())
            .unwrap()
    };
    let total = lt + li;
    Operands {
        ctx: on(&[b, lt, h * d], dtype, &values(b * lt * h * d, 4.0, 1)),
        img: on(&[b, li, h * d], dtype, &values(b * li * h * d, 4.0, 2)),
        w_ctx: on(&[d], dtype, &values(d, 1.5, 3)),
        w_img: on(&[d], dtype, &values(d, 1.5, 4)),
        cos: on(&[total, d], DType::F32, &values(total * d, 1.0, 5)),
        sin: on(&[total, d], DType::F32, &values(total * d, 1.0, 6)),
    }
}

/// Both streams into one output, through `f` (the op or its composition): the context
/// first, then the image, each normed (where `norm`) and rotated (where `rope`).
fn joint(
    o: &Operands,
    heads: usize,
    norm: bool,
    rope: bool,
    f: &dyn Fn(&AttentionInput<'_>, Option<Tensor>) -> ddo_core::Result<Tensor>,
) -> ddo_core::Result<Tensor> {
    let (lt, li) = (o.ctx.shape()[1], o.img.shape()[1]);
    let part = |x, w, start| AttentionInput {
        x,
        heads,
        norm: norm.then_some((w, 1e-6)),
        rope: rope.then_some((&o.cos, &o.sin)),
        start,
        total: lt + li,
    };
    let y = f(&part(&o.ctx, &o.w_ctx, 0), None)?;
    f(&part(&o.img, &o.w_img, lt), Some(y))
}

#[test]
fn the_fused_kernel_gives_the_bytes_of_the_composition() {
    let Some(gpu) = common::open_gpu(false) else {
        return;
    };
    let g: &dyn Device = &*gpu;
    let ops = ops_of(g).unwrap();
    for dtype in [DType::BF16, DType::F16] {
        // Flux's head dim (128) and a short one (32: 4 lanes a row), odd lengths.
        for (dims, heads) in [((2, 7, 37, 3, 128), 3), ((1, 5, 11, 2, 32), 2)] {
            let o = operands(g, dtype, dims);
            for (norm, rope) in [(true, true), (false, false), (true, false), (false, true)] {
                let fused =
                    joint(&o, heads, norm, rope, &|p, d| ops.attention_input(p, d)).unwrap();
                let composed = joint(&o, heads, norm, rope, &|p, d| {
                    attention_input_composed(ops, p, d)
                })
                .unwrap();
                assert_eq!(fused.shape(), [dims.0, heads, dims.1 + dims.2, dims.4]);
                assert_eq!(fused.dtype(), dtype);
                assert_eq!(
                    ops.to_f32_vec(&fused).unwrap(),
                    ops.to_f32_vec(&composed).unwrap(),
                    "{dtype:?} {dims:?} norm {norm} rope {rope}"
                );
            }
        }
    }
    // A single stream (the whole sequence in one part): the same.
    let o = operands(g, DType::BF16, (1, 0, 64, 4, 128));
    let single = |f: &dyn Fn(&AttentionInput<'_>, Option<Tensor>) -> ddo_core::Result<Tensor>| {
        let p = AttentionInput {
            x: &o.img,
            heads: 4,
            norm: Some((&o.w_img, 1e-6)),
            rope: Some((&o.cos, &o.sin)),
            start: 0,
            total: 64,
        };
        ops.to_f32_vec(&f(&p, None).unwrap()).unwrap()
    };
    assert_eq!(
        single(&|p, d| ops.attention_input(p, d)),
        single(&|p, d| attention_input_composed(ops, p, d))
    );
}

#[test]
fn other_operands_run_the_composition_and_bad_shapes_are_refused() {
    let Some(gpu) = common::open_gpu(false) else {
        return;
    };
    let host = HostDevice::with_capacity(1 << 28).unwrap();
    let (g, h): (&dyn Device, &dyn Device) = (&*gpu, &*host);
    let dims = (2, 3, 9, 2, 16);
    // f32: the composition on the GPU, close to the host's (sums in another order).
    let (og, oh) = (operands(g, DType::F32, dims), operands(h, DType::F32, dims));
    let (gops, hops) = (ops_of(g).unwrap(), ops_of(h).unwrap());
    let a = gops
        .to_f32_vec(&joint(&og, 2, true, true, &|p, d| gops.attention_input(p, d)).unwrap())
        .unwrap();
    let b = hops
        .to_f32_vec(&joint(&oh, 2, true, true, &|p, d| hops.attention_input(p, d)).unwrap())
        .unwrap();
    let worst = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    assert!(worst < 1e-4, "{worst}");
    // A norm weight of the wrong size, rows past the end: typed shape errors.
    let bad_w = AttentionInput {
        x: &og.img,
        heads: 2,
        norm: Some((&og.cos, 1e-6)),
        rope: None,
        start: 0,
        total: 9,
    };
    assert!(matches!(
        gops.attention_input(&bad_w, None),
        Err(CoreError::Shape { .. })
    ));
    let past = AttentionInput {
        norm: None,
        start: 5,
        ..bad_w
    };
    assert!(matches!(
        gops.attention_input(&past, None),
        Err(CoreError::Shape { .. })
    ));
}
