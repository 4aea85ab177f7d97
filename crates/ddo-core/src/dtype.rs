//! Element types of tensors and parameters, and conversions between their byte forms.

use std::fmt;

use half::{bf16, f16};

use crate::error::{CoreError, Result};

/// Element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 16-bit IEEE float.
    F16,
    /// bfloat16.
    BF16,
    /// Quantized storage (one byte per stored element, layout owned by the quantizer).
    /// DDO moves it as bytes where a route allows, and never computes on it.
    Quantized,
}

impl DType {
    /// Bytes per stored element.
    pub const fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Quantized => 1,
        }
    }

    /// Whether this is a quantized storage marker.
    pub const fn is_quantized(self) -> bool {
        matches!(self, DType::Quantized)
    }

    /// Short name (`f32`, `f16`, `bf16`, `quantized`).
    pub const fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::Quantized => "quantized",
        }
    }

    /// The dtype a safetensors header names, if DDO supports it.
    pub fn from_safetensors(dtype: safetensors::Dtype) -> Option<DType> {
        match dtype {
            safetensors::Dtype::F32 => Some(DType::F32),
            safetensors::Dtype::F16 => Some(DType::F16),
            safetensors::Dtype::BF16 => Some(DType::BF16),
            safetensors::Dtype::U8 | safetensors::Dtype::I8 => Some(DType::Quantized),
            _ => None,
        }
    }

    /// Decodes little-endian `bytes` of this dtype into f32 values.
    pub fn decode_f32(self, bytes: &[u8]) -> Result<Vec<f32>> {
        let size = self.size_in_bytes();
        if !bytes.len().is_multiple_of(size) {
            return Err(CoreError::SizeMismatch {
                what: format!("decoding {} bytes", self.as_str()),
                expected: bytes.len() / size * size,
                actual: bytes.len(),
            });
        }
        Ok(match self {
            DType::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            DType::F16 => bytes
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::BF16 => bytes
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            DType::Quantized => {
                return Err(CoreError::Shape {
                    what: "decode".into(),
                    message:
                        "quantized storage has no element values to decode; dequantize it first"
                            .into(),
                });
            }
        })
    }

    /// Encodes f32 values as little-endian bytes of this dtype (round to nearest even).
    pub fn encode_f32(self, values: &[f32]) -> Result<Vec<u8>> {
        Ok(match self {
            DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            DType::F16 => values
                .iter()
                .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                .collect(),
            DType::BF16 => values
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
            DType::Quantized => {
                return Err(CoreError::Shape {
                    what: "encode".into(),
                    message: "cannot encode float values as quantized storage".into(),
                });
            }
        })
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_each_float_dtype() {
        let values = [0.0f32, 1.0, -2.5, 65504.0, 1.0e-3];
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let bytes = dtype.encode_f32(&values).unwrap();
            assert_eq!(bytes.len(), values.len() * dtype.size_in_bytes());
            let back = dtype.decode_f32(&bytes).unwrap();
            for (a, b) in values.iter().zip(&back) {
                let tol = if dtype == DType::F32 {
                    0.0
                } else {
                    a.abs() * 1e-2 + 1e-3
                };
                assert!((a - b).abs() <= tol, "{dtype}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn ragged_bytes_and_quantized_values_are_typed_errors() {
        assert!(matches!(
            DType::F32.decode_f32(&[0u8; 6]),
            Err(CoreError::SizeMismatch { .. })
        ));
        assert!(DType::Quantized.decode_f32(&[1, 2]).is_err());
        assert!(DType::Quantized.encode_f32(&[1.0]).is_err());
    }
}
