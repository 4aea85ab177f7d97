//! Low-rank adapters applied at run time (issue 36, LoRA): a linear leaf's output becomes
//! `W x + b + Σ scale · B (A x)` with `A [rank, in]` and `B [out, rank]` on the device, and
//! the leaf's own params (streamed, fp8, coded or resident, whatever the route) untouched.
//!
//! A [`Component`](crate::Component) holds its adapters per leaf
//! ([`Component::set_adapters`](crate::Component::set_adapters)); the leaf's weights carry
//! them into the op ([`LeafWeights::adapters`](crate::LeafWeights::adapters)), and the
//! layers add them with [`add_adapters`] (on every backend: two small GEMMs and an add per
//! adapter, through the [`Ops`] plane).

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

/// `y + Σ scale · B (A x)` for a linear whose input is `x` (`xs` concatenated on the last
/// dimension where the linear takes several, as [`Ops::linear_concat`] does).
pub fn add_adapters(
    ops: &dyn Ops,
    xs: &[&Tensor],
    mut y: Tensor,
    adapters: &[Adapter],
) -> Result<Tensor> {
    for a in adapters {
        let t = match xs {
            [x] => ops.linear(x, &a.down, None)?,
            _ => ops.linear_concat(xs, &a.down, None)?,
        };
        let u = ops.linear(&t, &a.up, None)?;
        let u = if a.scale == 1.0 {
            u
        } else {
            ops.affine(&u, a.scale, 0.0)?
        };
        y = ops.binary(&y, &u, BinaryOp::Add)?;
    }
    Ok(y)
}
