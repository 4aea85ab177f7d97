//! GGUF dequantization on the GPU (issue 37): a GGUF tensor's stored blocks (llama.cpp's
//! Q4_0 ... Q6_K, or plain F32/F16/BF16), uploaded as they are, into a new f32, f16 or bf16
//! tensor (kernels in `kernels/gguf.cu`; not an [`Ops`](ddo_core::Ops) op).
//!
//! Into f32 the values are bit for bit those of the host reference
//! [`ddo_core::gguf::dequantize`] (itself bit-exact against gguf-py); into f16 or bf16 they
//! are those f32 values rounded once (to nearest even). The block kernels run one thread per
//! 8 consecutive output elements, 256 threads a block, grid-stride with 64-bit indices, and
//! store 16 bytes at a time; see the source's header.

use ddo_core::gguf::GgmlType;
use ddo_core::tensor::numel;
use ddo_core::{DType, Result, Tensor};

use super::kernels::{self, Arg, grid_1d, launch};
use super::{Out, shape_err};
use crate::device::CudaDevice;

/// Name of this file's kernel source.
pub(crate) const SOURCE_NAME: &str = "gguf.cu";
/// The kernel source.
pub(crate) const SOURCE: &str = include_str!("../../kernels/gguf.cu");

/// Threads per block (the kernels' `__launch_bounds__`).
const BLOCK: u32 = 256;

/// The kernel of a block-quantized type (`None` for the plain float types).
fn block_kernel(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::Q4_0 => "ddo_gguf_q4_0",
        GgmlType::Q4_1 => "ddo_gguf_q4_1",
        GgmlType::Q5_0 => "ddo_gguf_q5_0",
        GgmlType::Q5_1 => "ddo_gguf_q5_1",
        GgmlType::Q8_0 => "ddo_gguf_q8_0",
        GgmlType::Q2_K => "ddo_gguf_q2_k",
        GgmlType::Q3_K => "ddo_gguf_q3_k",
        GgmlType::Q4_K => "ddo_gguf_q4_k",
        GgmlType::Q5_K => "ddo_gguf_q5_k",
        GgmlType::Q6_K => "ddo_gguf_q6_k",
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => return None,
    })
}

/// The dtype a plain GGUF type's elements are (`None` for the block-quantized types).
fn plain_dtype(ty: GgmlType) -> Option<DType> {
    match ty {
        GgmlType::F32 => Some(DType::F32),
        GgmlType::F16 => Some(DType::F16),
        GgmlType::BF16 => Some(DType::BF16),
        _ => None,
    }
}

/// The largest power of two (at most 16) dividing the device address `ptr`.
fn alignment(ptr: u64) -> i32 {
    1 << ptr.trailing_zeros().min(4)
}

/// [`CudaDevice::dequantize_gguf`]: checks the operands, allocates the output and queues one
/// kernel on the compute stream.
pub(crate) fn dequantize_gguf(
    dev: &CudaDevice,
    bytes: &Tensor,
    ty: GgmlType,
    shape: &[usize],
    dtype: DType,
) -> Result<Tensor> {
    const OP: &str = "dequantize_gguf";
    let xi = super::stored_input(dev, bytes)?;
    if xi.dtype != DType::Quantized && Some(xi.dtype) != plain_dtype(ty) {
        return Err(shape_err(
            OP,
            format!(
                "the {ty} blocks must be a quantized (byte) tensor{}; got {}",
                plain_dtype(ty).map_or(String::new(), |d| format!(" or a {d} tensor")),
                xi.dtype
            ),
        ));
    }
    let code = kernels::dtype_code(dtype).ok_or_else(|| {
        shape_err(
            OP,
            format!("the output dtype must be f32, f16 or bf16, not {dtype}"),
        )
    })?;
    let elements = numel(shape)
        .ok_or_else(|| shape_err(OP, format!("shape {shape:?} has too many elements")))?;
    let block = ty.block_elements();
    let row = shape.last().copied().unwrap_or(1);
    if !row.is_multiple_of(block) {
        return Err(shape_err(
            OP,
            format!(
                "the last dim of shape {shape:?} ({row}) is not a whole number of {ty}'s \
                 {block}-element blocks"
            ),
        ));
    }
    let expected = ty.bytes_for(elements).ok_or_else(|| {
        shape_err(
            OP,
            format!("shape {shape:?} takes more bytes of {ty} than an address can count"),
        )
    })?;
    if xi.len != expected {
        return Err(shape_err(
            OP,
            format!(
                "shape {shape:?} of {ty} takes {expected} bytes; the input holds {}",
                xi.len
            ),
        ));
    }
    let out = Out::new(dev, OP, shape.to_vec(), dtype)?;
    debug_assert_eq!(out.code, code);
    if elements == 0 {
        return out.finish(dev, &[&xi]);
    }
    let al = alignment(xi.ptr);
    match block_kernel(ty) {
        Some(name) => {
            // Whole blocks: the element count is a multiple of 32, so of 8.
            let n8 = (elements / 8) as u64;
            let f = dev.kernel(SOURCE_NAME, SOURCE, name)?;
            launch(
                dev,
                &f,
                grid_1d(n8, BLOCK),
                &[
                    Arg::Ptr(xi.ptr),
                    Arg::I32(al),
                    Arg::Ptr(out.ptr),
                    Arg::I32(code),
                    Arg::I64(n8 as i64),
                    Arg::I32(i32::from(out.ptr % 16 == 0)),
                ],
            )?;
        }
        None => {
            let src = plain_dtype(ty)
                .and_then(kernels::dtype_code)
                .ok_or_else(|| {
                    shape_err(OP, format!("{ty} is neither a block format nor a float"))
                })?;
            let f = dev.kernel(SOURCE_NAME, SOURCE, "ddo_gguf_float")?;
            launch(
                dev,
                &f,
                grid_1d(elements as u64, BLOCK),
                &[
                    Arg::Ptr(xi.ptr),
                    Arg::I32(src),
                    Arg::I32(al),
                    Arg::Ptr(out.ptr),
                    Arg::I32(code),
                    Arg::I64(elements as i64),
                ],
            )?;
        }
    }
    out.finish(dev, &[&xi])
}

impl CudaDevice {
    /// Dequantizes a GGUF tensor's stored data on this device into a new tensor of `shape`
    /// (row-major, as [`GgufTensorInfo::shape`](ddo_core::gguf::GgufTensorInfo)) and
    /// `dtype` (f32, f16 or bf16), queued on the compute stream.
    ///
    /// `bytes` is a device tensor of this device holding exactly the tensor's blocks of
    /// `ty` as the file stores them (`ty.bytes_for(elements)` bytes), at any byte offset
    /// in its buffer: a [`DType::Quantized`] byte tensor (e.g. shape `[nbytes]`) or, for the
    /// plain types F32, F16 and BF16, also a tensor of that dtype. Every type of
    /// [`GgmlType::ALL`] is supported. Into f32 the result is bit for bit
    /// [`ddo_core::gguf::dequantize`]'s (gguf-py's numpy reference) for finite scales; into
    /// f16 or bf16 it is that f32 value rounded to nearest even. (NaN inputs give NaN, their
    /// payload not necessarily the host's.)
    ///
    /// Errors: [`CoreError::Shape`](ddo_core::CoreError::Shape) naming `dequantize_gguf`
    /// when `bytes` has another dtype, `dtype` is not a float dtype, the last dim of `shape`
    /// is not a whole number of `ty`'s blocks, or the byte count does not match;
    /// [`CoreError::WrongDevice`](ddo_core::CoreError::WrongDevice) for a host tensor; the
    /// allocation's and the launch's errors.
    pub fn dequantize_gguf(
        &self,
        bytes: &Tensor,
        ty: GgmlType,
        shape: &[usize],
        dtype: DType,
    ) -> Result<Tensor> {
        dequantize_gguf(self, bytes, ty, shape, dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_has_one_kernel_in_the_source() {
        for ty in GgmlType::ALL {
            match block_kernel(ty) {
                Some(name) => {
                    assert!(plain_dtype(ty).is_none(), "{ty}");
                    assert!(
                        SOURCE.contains(&format!("{name}(const u8* x, int al,")),
                        "{name} missing from gguf.cu"
                    );
                }
                None => assert!(plain_dtype(ty).is_some(), "{ty}"),
            }
        }
        assert!(SOURCE.contains("ddo_gguf_float(const u8* x, int src, int al,"));
    }

    #[test]
    fn alignment_is_the_lowest_set_bit_up_to_16() {
        assert_eq!(alignment(0x1000), 16);
        assert_eq!(alignment(0x1001), 1);
        assert_eq!(alignment(0x1002), 2);
        assert_eq!(alignment(0x1024), 4);
        assert_eq!(alignment(0x1008), 8);
    }
}
