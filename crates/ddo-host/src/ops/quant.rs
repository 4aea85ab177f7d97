//! [`Ops::dequantize`](ddo_core::Ops::dequantize) on the host: a quantized weight's GGUF
//! blocks dequantized by the reference ([`ddo_core::gguf::dequantize`], bit-exact against
//! gguf-py) and rounded once into the output dtype.

use ddo_core::dtype::DType;
use ddo_core::error::Result;
use ddo_core::tensor::Tensor;

use super::shape_err;
use crate::device::HostDevice;

/// `x`'s blocks as a tensor of its layout's shape in `dtype`.
pub(super) fn dequantize(dev: &HostDevice, x: &Tensor, dtype: DType) -> Result<Tensor> {
    const OP: &str = "dequantize";
    let Some(q) = x.quant().cloned() else {
        return Err(shape_err(
            OP,
            format!(
                "{:?} of {} holds no GGUF blocks (only a quantized weight dequantizes)",
                x.shape(),
                x.dtype()
            ),
        ));
    };
    let xi = dev.raw_input(x)?;
    let output = dev.new_output(OP, q.shape.clone(), dtype)?;
    dev.fence()?;
    let values = xi.bytes(|b| ddo_core::gguf::dequantize(q.ty, b, q.elements()))?;
    output.write_f32(&values)
}
