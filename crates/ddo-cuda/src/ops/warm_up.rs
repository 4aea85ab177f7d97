//! [`Device::prepare_linears`] on CUDA: each named linear runs once on zeros before the
//! phases. cuBLASLt loads an algorithm's kernel at its first call, and that load holds the
//! host until the device has drained its queue: inside a streamed forward the device then
//! waits for the program (a FLUX.1-dev first forward under a 12 GiB plan lost about 60 ms to
//! twelve such calls, one of them 88 ms long). Here the loads happen while nothing is queued,
//! and the plans are built for the same shapes (a plan is keyed by the operands' alignments,
//! which the allocator's 256-byte blocks give both here and in the forward).

use ddo_core::linear_calls::distinct;
use ddo_core::{
    CoreError, DType, Device, LinearCall, LinearKind, Ops, Result, Tensor, TensorStorage,
};

use crate::device::CudaDevice;

/// The largest operand (`x`, `w` or the bias) of `call`, bytes: the operands share one
/// buffer of zeros (inputs only read it).
fn operand_bytes(call: &LinearCall) -> usize {
    let elements = call
        .input_elements()
        .max(call.n.saturating_mul(call.k))
        .max(call.n);
    elements.saturating_mul(call.dtype.size_in_bytes())
}

/// Runs each distinct call of `calls` (16-bit or f32, operands and product within
/// `max_bytes`) once, then waits for the device and gives the memory back; how many ran.
/// A call the device has no room for is skipped (its kernel then loads in the forward).
pub(crate) fn prepare_linears(
    dev: &CudaDevice,
    calls: &[LinearCall],
    max_bytes: u64,
) -> Result<usize> {
    let calls: Vec<LinearCall> = distinct(calls)
        .into_iter()
        .filter(|c| {
            matches!(c.dtype, DType::BF16 | DType::F16 | DType::F32)
                && c.rows > 0
                && c.bytes() <= max_bytes
        })
        .collect();
    let Some(largest) = calls.iter().map(operand_bytes).max() else {
        return Ok(0);
    };
    // A warm-up is an optimisation: where the device has no room for it, nothing runs.
    let (zeros, ptr) = match super::scratch(dev, largest) {
        Ok(s) => s,
        Err(CoreError::OutOfMemory { .. }) => return Ok(0),
        Err(e) => return Err(e),
    };
    super::gemm::zero(dev, ptr, largest)?;
    let mut ran = 0;
    for call in &calls {
        let view = |shape: Vec<usize>| -> Result<Tensor> {
            let len = shape.iter().product::<usize>() * call.dtype.size_in_bytes();
            Tensor::new(
                shape,
                call.dtype,
                TensorStorage::Device(zeros.slice(0, len)?),
            )
        };
        let w = view(vec![call.n, call.k])?;
        let bias = if call.bias {
            Some(view(vec![call.n])?)
        } else {
            None
        };
        let out = match &call.kind {
            LinearKind::Plain => {
                Ops::linear(dev, &view(vec![call.rows, call.k])?, &w, bias.as_ref())
            }
            LinearKind::GeluTanh => {
                Ops::linear_gelu_tanh(dev, &view(vec![call.rows, call.k])?, &w, bias.as_ref())
            }
            LinearKind::Concat(widths) => {
                let xs = widths
                    .iter()
                    .map(|&width| view(vec![call.rows, width]))
                    .collect::<Result<Vec<_>>>()?;
                let refs: Vec<&Tensor> = xs.iter().collect();
                Ops::linear_concat(dev, &refs, &w, bias.as_ref())
            }
        };
        match out {
            Ok(out) => drop(out),
            // No room for this call's product: the larger calls are left to the forward.
            Err(CoreError::OutOfMemory { .. }) => continue,
            Err(e) => return Err(e),
        }
        ran += 1;
    }
    drop(zeros);
    Device::empty_cache(dev)?;
    Ok(ran)
}
