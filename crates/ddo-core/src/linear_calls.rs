//! The linears a program will run, named before it runs them ([`LinearCall`],
//! [`Device::prepare_linears`](crate::Device::prepare_linears)).
//!
//! A GEMM library may load the kernel of a shape the first time that shape runs (cuBLASLt
//! does, on CUDA), and that load can hold the host until the device has drained its queue:
//! in a streamed forward the device then waits for the program at every new shape. A model
//! lists its linears for a run's sizes ([`LinearCall`]), and the backend runs each once
//! before the first phase, so the phases' first forwards find their kernels loaded. Results
//! never depend on it: the same calls run the same way either way.

use std::collections::HashSet;

use crate::dtype::DType;
use crate::tensor::Tensor;

/// Which linear op a call is.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum LinearKind {
    /// [`Ops::linear`](crate::Ops::linear).
    Plain,
    /// [`Ops::linear_gelu_tanh`](crate::Ops::linear_gelu_tanh).
    GeluTanh,
    /// [`Ops::linear_concat`](crate::Ops::linear_concat) over inputs of these widths (their
    /// sum is `k`).
    Concat(Vec<usize>),
}

/// One linear call's shape: `x [rows, k] · w [n, k]ᵀ (+ bias [n])`, in `dtype` (the
/// activations' and the product's).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LinearCall {
    /// The op.
    pub kind: LinearKind,
    /// Rows of `x` (every dimension but the last, multiplied).
    pub rows: usize,
    /// Input features.
    pub k: usize,
    /// Output features.
    pub n: usize,
    /// Whether a bias is added.
    pub bias: bool,
    /// The activations' dtype.
    pub dtype: DType,
}

impl LinearCall {
    /// A call of `kind` with `rows × k → n`.
    pub fn new(
        kind: LinearKind,
        rows: usize,
        k: usize,
        n: usize,
        bias: bool,
        dtype: DType,
    ) -> Self {
        Self {
            kind,
            rows,
            k,
            n,
            bias,
            dtype,
        }
    }

    /// The call `kind` makes with inputs `xs` (one but for [`LinearKind::Concat`]), weight
    /// `w [n, k]` and `bias`: what a recording backend notes.
    pub fn of(kind: LinearKind, xs: &[&Tensor], w: &Tensor, bias: Option<&Tensor>) -> Self {
        let first = xs.first();
        let rows = first.map_or(0, |x| {
            x.shape()[..x.shape().len().saturating_sub(1)]
                .iter()
                .product()
        });
        let kind = match kind {
            LinearKind::Concat(_) => LinearKind::Concat(
                xs.iter()
                    .map(|x| x.shape().last().copied().unwrap_or(0))
                    .collect(),
            ),
            other => other,
        };
        Self {
            kind,
            rows,
            k: w.shape().get(1).copied().unwrap_or(0),
            n: w.shape().first().copied().unwrap_or(0),
            bias: bias.is_some(),
            dtype: first.map_or(w.dtype(), |x| x.dtype()),
        }
    }

    /// Elements of `x` (all of the concatenated inputs for [`LinearKind::Concat`]).
    pub fn input_elements(&self) -> usize {
        self.rows.saturating_mul(self.k)
    }

    /// Bytes the call's operands and product take in `dtype`: `x`, `w`, the bias and the
    /// output.
    pub fn bytes(&self) -> u64 {
        let elements = self
            .input_elements()
            .saturating_add(self.n.saturating_mul(self.k))
            .saturating_add(if self.bias { self.n } else { 0 })
            .saturating_add(self.rows.saturating_mul(self.n));
        (elements as u64).saturating_mul(self.dtype.size_in_bytes() as u64)
    }
}

/// `calls` without repeats, each where it first came.
pub fn distinct(calls: &[LinearCall]) -> Vec<LinearCall> {
    let mut seen = HashSet::new();
    calls.iter().filter(|c| seen.insert(*c)).cloned().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Tensor;

    #[test]
    fn a_call_reads_its_shape_from_the_operands() {
        let x = Tensor::from_f32(vec![2, 3, 4], DType::F32, &[0.0; 24]).unwrap();
        let w = Tensor::from_f32(vec![5, 4], DType::F32, &[0.0; 20]).unwrap();
        let b = Tensor::from_f32(vec![5], DType::F32, &[0.0; 5]).unwrap();
        let c = LinearCall::of(LinearKind::Plain, &[&x], &w, Some(&b));
        assert_eq!(
            c,
            LinearCall::new(LinearKind::Plain, 6, 4, 5, true, DType::F32)
        );
        // x 24 + w 20 + bias 5 + out 30 elements of 4 bytes.
        assert_eq!(c.bytes(), (24 + 20 + 5 + 30) * 4);
        let x2 = Tensor::from_f32(vec![6, 1], DType::F32, &[0.0; 6]).unwrap();
        let w2 = Tensor::from_f32(vec![5, 5], DType::F32, &[0.0; 25]).unwrap();
        let x1 = Tensor::from_f32(vec![6, 4], DType::F32, &[0.0; 24]).unwrap();
        let cat = LinearCall::of(LinearKind::Concat(Vec::new()), &[&x1, &x2], &w2, None);
        assert_eq!(cat.kind, LinearKind::Concat(vec![4, 1]));
        assert_eq!((cat.rows, cat.k, cat.n, cat.bias), (6, 5, 5, false));
    }

    #[test]
    fn repeats_go_and_first_comes_first() {
        let a = LinearCall::new(LinearKind::Plain, 8, 4, 4, true, DType::BF16);
        let b = LinearCall::new(LinearKind::GeluTanh, 8, 4, 16, true, DType::BF16);
        let d = distinct(&[b.clone(), a.clone(), b.clone(), a.clone()]);
        assert_eq!(d, vec![b, a]);
    }
}
