//! [`Tensor`]: a shape, an element type, and bytes on the host or on a device.

use crate::device::{Device, DeviceSlice, Stream, download};
use std::sync::Arc;

use crate::dtype::DType;
use crate::error::{CoreError, Result};
use crate::gguf::GgmlType;
use crate::host_memory::{HostBuffer, HostSlice};

/// Where a tensor's bytes are.
#[derive(Clone, Debug)]
pub enum TensorStorage {
    /// Host memory.
    Host(HostSlice),
    /// Device memory.
    Device(DeviceSlice),
}

/// A dense, contiguous, row-major tensor.
///
/// An 8-bit float tensor may carry a per-tensor dequantization `scale` (a scaled fp8
/// weight): its values are `decode(byte) * scale`. Only the ops that dequantize read such a
/// tensor ([`crate::Ops::cast`] and the linears); every other op refuses it.
///
/// A [`DType::Quantized`] tensor of shape `[bytes]` may carry a [`QuantLayout`]: its bytes
/// are GGUF blocks of a tensor of the layout's shape (a weight streamed as stored); only
/// [`crate::Ops::dequantize`] reads it.
#[derive(Clone, Debug)]
pub struct Tensor {
    shape: Vec<usize>,
    dtype: DType,
    storage: TensorStorage,
    scale: Option<f32>,
    quant: Option<Arc<QuantLayout>>,
}

/// What the bytes of a [`DType::Quantized`] tensor hold: GGUF blocks of type `ty` making a
/// row-major tensor of `shape`, each row (last dim) whole blocks, rows one after another.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuantLayout {
    /// The block type.
    pub ty: GgmlType,
    /// The dequantized tensor's shape.
    pub shape: Vec<usize>,
}

impl QuantLayout {
    /// A layout of `ty` blocks for `shape`, or a shape error naming `what` when a row is not
    /// whole blocks or the size overflows.
    pub fn new(what: &str, ty: GgmlType, shape: Vec<usize>) -> Result<Self> {
        let layout = Self { ty, shape };
        let row = layout.shape.last().copied().unwrap_or(1);
        if !row.is_multiple_of(ty.block_elements()) || layout.try_bytes().is_none() {
            return Err(CoreError::Shape {
                what: what.to_string(),
                message: format!(
                    "{:?} of {} blocks: rows of {row} are not whole blocks of {} or the size overflows",
                    layout.shape,
                    ty.name(),
                    ty.block_elements()
                ),
            });
        }
        Ok(layout)
    }

    fn try_bytes(&self) -> Option<usize> {
        numel(&self.shape).and_then(|n| self.ty.bytes_for(n))
    }

    /// Elements of the dequantized tensor.
    pub fn elements(&self) -> usize {
        numel(&self.shape).unwrap_or(usize::MAX)
    }

    /// Bytes of the blocks.
    pub fn bytes(&self) -> usize {
        self.try_bytes().unwrap_or(usize::MAX)
    }

    /// Bytes of one row (the last dim).
    pub fn row_bytes(&self) -> usize {
        let row = self.shape.last().copied().unwrap_or(1);
        row / self.ty.block_elements() * self.ty.block_bytes()
    }

    /// The same blocks with `rows` rows along dim 0 (a fused tensor's part).
    pub fn with_rows(&self, rows: usize) -> Self {
        let mut shape = self.shape.clone();
        if let Some(first) = shape.first_mut() {
            *first = rows;
        }
        Self { ty: self.ty, shape }
    }
}

/// Number of elements of `shape`, or `None` on overflow.
pub fn numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// Bytes of a dense tensor of `shape` and `dtype`, or a typed error on overflow.
pub fn byte_len(shape: &[usize], dtype: DType) -> Result<usize> {
    numel(shape)
        .and_then(|n| n.checked_mul(dtype.size_in_bytes()))
        .ok_or_else(|| CoreError::Shape {
            what: "tensor size".into(),
            message: format!("shape {shape:?} of {dtype} overflows the address space"),
        })
}

impl Tensor {
    /// A tensor over existing storage; the storage must hold exactly the tensor's bytes.
    pub fn new(shape: Vec<usize>, dtype: DType, storage: TensorStorage) -> Result<Self> {
        let expected = byte_len(&shape, dtype)?;
        let actual = match &storage {
            TensorStorage::Host(h) => h.len(),
            TensorStorage::Device(d) => d.len(),
        };
        if expected != actual {
            return Err(CoreError::SizeMismatch {
                what: format!("tensor of shape {shape:?} and dtype {dtype}"),
                expected,
                actual,
            });
        }
        Ok(Self {
            shape,
            dtype,
            storage,
            scale: None,
            quant: None,
        })
    }

    /// The same tensor holding GGUF blocks of `quant` (or none): only a [`DType::Quantized`]
    /// tensor of shape `[quant.bytes()]` takes one.
    pub fn with_quant(mut self, quant: Option<Arc<QuantLayout>>) -> Result<Self> {
        if let Some(q) = &quant
            && (self.dtype != DType::Quantized || self.shape != [q.bytes()])
        {
            return Err(CoreError::Shape {
                what: "quantized tensor".into(),
                message: format!(
                    "{:?} of {} does not hold {} blocks of shape {:?} ({} B)",
                    self.shape,
                    self.dtype,
                    q.ty.name(),
                    q.shape,
                    q.bytes()
                ),
            });
        }
        self.quant = quant;
        Ok(self)
    }

    /// The GGUF block layout of a quantized weight's bytes.
    pub fn quant(&self) -> Option<&Arc<QuantLayout>> {
        self.quant.as_ref()
    }

    /// The same tensor with the per-tensor dequantization `scale` (its values become
    /// `decode(byte) * scale`); only an 8-bit float takes one, and only a finite positive
    /// one.
    pub fn with_scale(mut self, scale: Option<f32>) -> Result<Self> {
        check_scale("tensor", self.dtype, scale)?;
        self.scale = scale;
        Ok(self)
    }

    /// The per-tensor dequantization scale of a scaled fp8 tensor.
    pub fn scale(&self) -> Option<f32> {
        self.scale
    }

    /// A host tensor holding `values` encoded as `dtype`.
    pub fn from_f32(shape: Vec<usize>, dtype: DType, values: &[f32]) -> Result<Self> {
        let expected = numel(&shape).unwrap_or(usize::MAX);
        if values.len() != expected {
            return Err(CoreError::SizeMismatch {
                what: format!("values for shape {shape:?}"),
                expected,
                actual: values.len(),
            });
        }
        let bytes = dtype.encode_f32(values)?;
        Self::new(
            shape,
            dtype,
            TensorStorage::Host(HostBuffer::pageable_from(&bytes).slice_all()),
        )
    }

    /// The same bytes viewed with another shape of the same element count (no copy).
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        if numel(shape) != Some(self.numel()) {
            return Err(CoreError::Shape {
                what: "reshape".into(),
                message: format!("cannot view {:?} as {shape:?}", self.shape),
            });
        }
        Ok(Self {
            shape: shape.to_vec(),
            dtype: self.dtype,
            storage: self.storage.clone(),
            scale: self.scale,
            // Blocks reshaped are bytes without a layout.
            quant: None,
        })
    }

    /// Shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Storage.
    pub fn storage(&self) -> &TensorStorage {
        &self.storage
    }

    /// Whether `other` is this very view: the same bytes of the same buffer (device or
    /// host), shape, dtype and scale. Two views that are the same can stand for each other in
    /// a computation; equal values in other bytes are not the same view.
    pub fn same_view(&self, other: &Tensor) -> bool {
        let storage = match (&self.storage, &other.storage) {
            (TensorStorage::Device(a), TensorStorage::Device(b)) => {
                a.buffer().same_buffer(b.buffer()) && a.offset() == b.offset() && a.len() == b.len()
            }
            (TensorStorage::Host(a), TensorStorage::Host(b)) => {
                a.buffer().same_buffer(b.buffer()) && a.offset() == b.offset() && a.len() == b.len()
            }
            _ => false,
        };
        storage
            && self.shape == other.shape
            && self.dtype == other.dtype
            && self.scale.map(f32::to_bits) == other.scale.map(f32::to_bits)
            && self.quant == other.quant
    }

    /// Whether this tensor alone holds its device memory (a whole buffer, no other handle):
    /// an op consuming it may then write its result over those bytes.
    pub fn has_exclusive_device_buffer(&mut self) -> bool {
        match &mut self.storage {
            TensorStorage::Device(slice) => slice.is_exclusive(),
            TensorStorage::Host(_) => false,
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        numel(&self.shape).unwrap_or(usize::MAX)
    }

    /// Bytes of storage.
    pub fn nbytes(&self) -> usize {
        match &self.storage {
            TensorStorage::Host(h) => h.len(),
            TensorStorage::Device(d) => d.len(),
        }
    }

    /// Whether the bytes are on a device.
    pub fn is_on_device(&self) -> bool {
        matches!(self.storage, TensorStorage::Device(_))
    }

    /// The same tensor on `device` (a copy on `stream`; a device tensor is returned as is).
    pub fn to_device(&self, device: &dyn Device, stream: &Stream) -> Result<Tensor> {
        match &self.storage {
            TensorStorage::Device(_) => Ok(self.clone()),
            TensorStorage::Host(h) => {
                let dst = device.alloc(h.len())?;
                device.copy_h2d(h, &dst.slice_all(), stream)?;
                Self::new(
                    self.shape.clone(),
                    self.dtype,
                    TensorStorage::Device(dst.slice_all()),
                )?
                .with_scale(self.scale)?
                .with_quant(self.quant.clone())
            }
        }
    }

    /// The tensor's bytes on the host, waiting for `stream` when they are on a device.
    pub fn to_host_bytes(&self, device: &dyn Device, stream: &Stream) -> Result<Vec<u8>> {
        match &self.storage {
            TensorStorage::Host(h) => Ok(h.to_vec()),
            TensorStorage::Device(d) => download(device, d, stream),
        }
    }

    /// The tensor's values as f32 (a scaled tensor's scale applied), waiting for `stream`
    /// when they are on a device.
    pub fn to_f32_vec(&self, device: &dyn Device, stream: &Stream) -> Result<Vec<f32>> {
        let mut values = self
            .dtype
            .decode_f32(&self.to_host_bytes(device, stream)?)?;
        apply_scale(&mut values, self.scale);
        Ok(values)
    }

    /// The tensor's values as f32 (a scaled tensor's scale applied), for a host tensor.
    pub fn host_f32(&self) -> Result<Vec<f32>> {
        match &self.storage {
            TensorStorage::Host(h) => {
                let mut values = h.with_bytes(|b| self.dtype.decode_f32(b))?;
                apply_scale(&mut values, self.scale);
                Ok(values)
            }
            TensorStorage::Device(_) => Err(CoreError::Shape {
                what: "host_f32".into(),
                message: "the tensor is on a device; use to_f32_vec with its device".into(),
            }),
        }
    }
}

/// Multiplies decoded values by a per-tensor dequantization scale, in f32 (what both
/// backends' dequantizing ops compute before rounding to their output dtype).
pub fn apply_scale(values: &mut [f32], scale: Option<f32>) {
    if let Some(s) = scale {
        for v in values {
            *v *= s;
        }
    }
}

/// Checks a per-tensor dequantization scale for `what` of `dtype`: only 8-bit floats take
/// one, and it must be finite and positive.
pub fn check_scale(what: &str, dtype: DType, scale: Option<f32>) -> Result<()> {
    let Some(s) = scale else {
        return Ok(());
    };
    if !dtype.is_fp8() {
        return Err(CoreError::Shape {
            what: format!("{what} scale"),
            message: format!("a per-tensor scale belongs to an 8-bit float; {what} is {dtype}"),
        });
    }
    if !s.is_finite() || s <= 0.0 {
        return Err(CoreError::Shape {
            what: format!("{what} scale"),
            message: format!("scale {s} is not a finite positive number"),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_must_match_shape_and_dtype() {
        let h = HostBuffer::pageable_zeroed(12).slice_all();
        assert!(Tensor::new(vec![3], DType::F32, TensorStorage::Host(h.clone())).is_ok());
        assert!(matches!(
            Tensor::new(vec![4], DType::F32, TensorStorage::Host(h)),
            Err(CoreError::SizeMismatch { .. })
        ));
        assert!(byte_len(&[usize::MAX, 2], DType::F32).is_err());
    }
}
