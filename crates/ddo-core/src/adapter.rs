//! Low-rank adapters applied at run time (issue 36, LoRA): a linear leaf's output becomes
//! `W x + b + Σ scale · B (A x)` with `A [rank, in]` and `B [out, rank]` on the device, and
//! the leaf's own params (streamed, fp8, coded or resident, whatever the route) untouched.
//!
//! A [`Component`](crate::Component) holds its adapters per leaf
//! ([`Component::set_adapters`](crate::Component::set_adapters)); the leaf's weights carry
//! them into the op ([`LeafWeights::adapters`](crate::LeafWeights::adapters)), and the
//! layers add them with [`add_adapters`] (on every backend, through the [`Ops`] plane: the
//! down-projection as a small GEMM, the up-projection added into the base output by
//! [`Ops::linear_accumulate`], which CUDA runs as one GEMM with `beta = 1`).

use std::collections::HashMap;
use std::sync::Arc;

use crate::component::LeafId;
use crate::error::{CoreError, Result};
use crate::ops::{BinaryOp, Ops};
use crate::tensor::Tensor;

/// One adapter of a linear leaf: `ΔW = scale · B A`.
#[derive(Debug, Clone)]
pub struct Adapter {
    /// `A [rank, in]`, on the device.
    pub down: Tensor,
    /// `B [out, rank]`, on the device.
    pub up: Tensor,
    /// `alpha / rank × strength`.
    pub scale: f32,
    /// Whether other leaves' adapters hold this very `down` (one fused module split over
    /// several linears that read the same input, as a kohya `qkv` or `linear1`): their
    /// down-projection of one input is then computed once per forward ([`DownCache`]).
    pub shared_down: bool,
}

impl Adapter {
    /// Checks the shapes against a linear of `in_features → out_features`.
    pub fn check(&self, leaf: &str, in_features: usize, out_features: usize) -> Result<()> {
        let (d, u) = (self.down.shape(), self.up.shape());
        let fits = d.len() == 2
            && u.len() == 2
            && d[1] == in_features
            && u[0] == out_features
            && d[0] == u[1]
            && d[0] > 0;
        if fits && self.scale.is_finite() {
            return Ok(());
        }
        Err(CoreError::Shape {
            what: format!("adapter of `{leaf}`"),
            message: format!(
                "A {d:?} and B {u:?} (scale {}) do not adapt a linear of {in_features} → {out_features}; \
                 the LoRA was made for another model",
                self.scale
            ),
        })
    }

    /// Device bytes of its two matrices.
    pub fn nbytes(&self) -> u64 {
        (self.down.nbytes() + self.up.nbytes()) as u64
    }
}

/// A component's adapters by leaf.
pub type AdapterSet = HashMap<LeafId, Arc<[Adapter]>>;

/// The last shared down-projection of a forward: the input, the `A` and `A x`. A fused
/// module split over several linears (to_q, to_k and to_v of one kohya `qkv`) gives each the
/// same `A` ([`Adapter::shared_down`]), and they read the same input one after another, so
/// the first computes `A x` and the others take it from here. The entry holds its input
/// (so those bytes are not freed and reused while it stands) and is dropped at the first
/// lookup that misses it, and with the forward ([`crate::ForwardContext`] owns the cache).
#[derive(Debug, Default)]
pub struct DownCache {
    entry: parking_lot::Mutex<Option<(Tensor, Tensor, Tensor)>>,
}

impl DownCache {
    /// `A x` of `a` for input `x`, computed once for adapters that share their `A`.
    fn down(&self, ops: &dyn Ops, x: &Tensor, a: &Adapter) -> Result<Tensor> {
        let mut entry = self.entry.lock();
        if let Some((cx, ca, t)) = entry.as_ref()
            && cx.same_view(x)
            && ca.same_view(&a.down)
        {
            return Ok(t.clone());
        }
        *entry = None;
        let t = ops.linear(x, &a.down, None)?;
        if a.shared_down {
            *entry = Some((x.clone(), a.down.clone(), t.clone()));
        }
        Ok(t)
    }
}

/// One adapter's down-projection `A x` (`xs` concatenated on the last dimension where the
/// linear takes several, as [`Ops::linear_concat`] does), through `cache` where one input.
fn down(ops: &dyn Ops, xs: &[&Tensor], a: &Adapter, cache: Option<&DownCache>) -> Result<Tensor> {
    match (xs, cache) {
        ([x], Some(cache)) => cache.down(ops, x, a),
        ([x], None) => ops.linear(x, &a.down, None),
        _ => ops.linear_concat(xs, &a.down, None),
    }
}

/// `acc + scale · B t`: the up-projection added into `acc` (CUDA: one GEMM with
/// `beta = 1`), or a new tensor where there is nothing to add to yet.
fn add_up(ops: &dyn Ops, t: &Tensor, a: &Adapter, acc: Option<Tensor>) -> Result<Tensor> {
    match acc {
        Some(acc) if a.scale == 1.0 => ops.linear_accumulate(t, &a.up, None, acc, false),
        acc => {
            let mut u = ops.linear(t, &a.up, None)?;
            if a.scale != 1.0 {
                u = ops.affine(&u, a.scale, 0.0)?;
            }
            match acc {
                Some(acc) => ops.binary(&acc, &u, BinaryOp::Add),
                None => Ok(u),
            }
        }
    }
}

/// `Σ scale · B (A x)` of `adapters` for a linear whose input is `xs` (shared
/// down-projections through `cache`), or `None` where there are none: what the leaf's base linear then adds its product into
/// ([`Ops::linear_accumulate`]), so that the large output is written once and the base
/// GEMM's epilogue (bias, GELU) applies to the sum.
pub fn adapter_sum(
    ops: &dyn Ops,
    xs: &[&Tensor],
    adapters: &[Adapter],
    cache: Option<&DownCache>,
) -> Result<Option<Tensor>> {
    let mut sum = None;
    for a in adapters {
        let t = down(ops, xs, a, cache)?;
        sum = Some(add_up(ops, &t, a, sum)?);
    }
    Ok(sum)
}

/// `y + Σ scale · B (A x)` for a linear whose output `y` is already computed (input `xs`,
/// as for [`adapter_sum`]): each up-projection added into `y`.
pub fn add_adapters(
    ops: &dyn Ops,
    xs: &[&Tensor],
    mut y: Tensor,
    adapters: &[Adapter],
    cache: Option<&DownCache>,
) -> Result<Tensor> {
    for a in adapters {
        let t = down(ops, xs, a, cache)?;
        y = add_up(ops, &t, a, Some(y))?;
    }
    Ok(y)
}
