//! Element types of tensors and parameters, and conversions between their byte forms.
//!
//! The two 8-bit floats are those of safetensors' `F8_E4M3` and `F8_E5M2` (PyTorch's
//! `float8_e4m3fn` and `float8_e5m2`, the storage of ComfyUI's and Diffusers' fp8
//! checkpoints). Their conversions are the `float8` crate's, a port of CUDA's
//! `__nv_cvt_double_to_fp8` with `__NV_SATFINITE`: decoding is exact, encoding rounds to
//! nearest even and saturates at the largest finite value (±448 and ±57344), NaN stays NaN,
//! so a CUDA kernel converting with the same intrinsic gives the same bytes.

use std::fmt;

use float8::{F8E4M3, F8E5M2};
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
    /// 8-bit float, 4 exponent bits (bias 7) and 3 mantissa bits, no infinities
    /// (`float8_e4m3fn`; largest finite 448).
    F8E4M3,
    /// 8-bit float, 5 exponent bits (bias 15) and 2 mantissa bits, IEEE-style infinities
    /// (`float8_e5m2`; largest finite 57344).
    F8E5M2,
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
            DType::F8E4M3 | DType::F8E5M2 | DType::Quantized => 1,
        }
    }

    /// Whether this is a quantized storage marker.
    pub const fn is_quantized(self) -> bool {
        matches!(self, DType::Quantized)
    }

    /// Whether this is one of the 8-bit floats (stored as such; computed on after an upcast).
    pub const fn is_fp8(self) -> bool {
        matches!(self, DType::F8E4M3 | DType::F8E5M2)
    }

    /// The dtype a model computes in when its weights are stored as this one: bf16 for the
    /// 8-bit floats (stored as fp8, upcast for compute, as Diffusers' layerwise casting's
    /// `compute_dtype=torch.bfloat16`), the dtype itself otherwise.
    pub const fn compute(self) -> DType {
        match self {
            // Quantized weights (GGUF blocks) compute in bf16, as Diffusers' GGUF path does.
            DType::F8E4M3 | DType::F8E5M2 | DType::Quantized => DType::BF16,
            other => other,
        }
    }

    /// The largest finite value of an 8-bit float (448 for e4m3, 57344 for e5m2).
    pub const fn fp8_max(self) -> Option<f32> {
        match self {
            DType::F8E4M3 => Some(448.0),
            DType::F8E5M2 => Some(57344.0),
            _ => None,
        }
    }

    /// [`DType::fp8_max`], or a typed error for quantizing `what` into a dtype that is not
    /// an 8-bit float.
    fn fp8_max_for(self, what: &str) -> Result<f32> {
        self.fp8_max().ok_or_else(|| CoreError::Shape {
            what: format!("quantizing {what}"),
            message: format!("{self} is not an 8-bit float"),
        })
    }

    /// Quantizes `values` into this 8-bit float with one per-tensor scale, as ComfyUI's
    /// scaled fp8 checkpoints store weights: `scale = amax / fp8_max` (1 for an all-zero
    /// tensor), codes `encode(v / scale)` rounded to nearest even, so `decode(code) * scale`
    /// approximates `v` over the whole range of the format. A non-finite value is refused
    /// (it has no scale that keeps the rest).
    pub fn quantize_scaled(self, what: &str, values: &[f32]) -> Result<(Vec<u8>, f32)> {
        let mut out = vec![0u8; values.len()];
        let scale = self.quantize_scaled_into(
            what,
            values.len(),
            |at, buf| buf.copy_from_slice(&values[at..at + buf.len()]),
            &mut out,
        )?;
        Ok((out, scale))
    }

    /// [`DType::quantize_scaled`] of the float tensor `bytes` of dtype `src` (f32, f16,
    /// bf16), written into `out` (one byte an element): decoded chunk by chunk, never as a
    /// whole f32 copy, on all cores for a large tensor.
    pub fn quantize_scaled_bytes(
        self,
        what: &str,
        src: DType,
        bytes: &[u8],
        out: &mut [u8],
    ) -> Result<f32> {
        if !matches!(src, DType::F32 | DType::F16 | DType::BF16) {
            return Err(CoreError::Shape {
                what: format!("quantizing {what}"),
                message: format!("the source is {src}; quantize from f32, f16 or bf16"),
            });
        }
        let size = src.size_in_bytes();
        if bytes.len() != out.len() * size {
            return Err(CoreError::SizeMismatch {
                what: format!("quantizing {what}"),
                expected: out.len() * size,
                actual: bytes.len(),
            });
        }
        if size == 2 {
            return self.quantize_scaled_16(what, src, bytes, out);
        }
        self.quantize_scaled_into(
            what,
            out.len(),
            |at, buf| {
                let b = &bytes[at * size..(at + buf.len()) * size];
                match src {
                    DType::F32 => {
                        for (v, c) in buf.iter_mut().zip(b.chunks_exact(4)) {
                            *v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                        }
                    }
                    DType::F16 => {
                        for (v, c) in buf.iter_mut().zip(b.chunks_exact(2)) {
                            *v = f16::from_le_bytes([c[0], c[1]]).to_f32();
                        }
                    }
                    _ => {
                        for (v, c) in buf.iter_mut().zip(b.chunks_exact(2)) {
                            *v = bf16::from_le_bytes([c[0], c[1]]).to_f32();
                        }
                    }
                }
            },
            out,
        )
    }

    /// [`DType::quantize_scaled_bytes`] from a 16-bit float (f16, bf16), the same values
    /// faster: the largest magnitude is the largest of the words' magnitude bits (they order
    /// as the values do), and each code is a lookup in a table of all 65536 words' codes for
    /// this tensor's scale, made with the same division and rounding as the f32 path.
    fn quantize_scaled_16(
        self,
        what: &str,
        src: DType,
        bytes: &[u8],
        out: &mut [u8],
    ) -> Result<f32> {
        const CHUNK: usize = 1 << 18;
        let max = self.fp8_max_for(what)?;
        let exp_mask: u16 = if src == DType::F16 { 0x7c00 } else { 0x7f80 };
        let decode = |w: u16| -> f32 {
            if src == DType::F16 {
                f16::from_bits(w).to_f32()
            } else {
                bf16::from_bits(w).to_f32()
            }
        };
        let n = out.len();
        let threads = if n > 4 * CHUNK {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
        } else {
            1
        };
        let word = |i: usize| u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]);
        let chunks = n.div_ceil(CHUNK);
        let next = std::sync::atomic::AtomicUsize::new(0);
        // Pass 1: the largest magnitude's bits; u16::MAX when a value is not finite.
        let scan = || {
            let mut top = 0u16;
            loop {
                let c = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if c >= chunks || top == u16::MAX {
                    return top;
                }
                for i in c * CHUNK..((c + 1) * CHUNK).min(n) {
                    let mag = word(i) & 0x7fff;
                    top = if mag & exp_mask == exp_mask {
                        u16::MAX
                    } else {
                        top.max(mag)
                    };
                    if top == u16::MAX {
                        break;
                    }
                }
            }
        };
        let top = on_threads(threads, scan).into_iter().max().unwrap_or(0);
        if top == u16::MAX {
            return Err(CoreError::Shape {
                what: format!("quantizing {what}"),
                message: "a value is not finite; fp8 with a scale needs finite weights".into(),
            });
        }
        let amax = decode(top);
        let scale = if amax > 0.0 { amax / max } else { 1.0 };
        let e4m3 = self == DType::F8E4M3;
        let table: Vec<u8> = (0..=u16::MAX)
            .map(|w| {
                let v = decode(w) / scale;
                if e4m3 {
                    F8E4M3::from_f32(v).to_bits()
                } else {
                    F8E5M2::from_f32(v).to_bits()
                }
            })
            .collect();
        // Pass 2: the codes.
        let work = std::sync::Mutex::new(out.chunks_mut(CHUNK).enumerate());
        let encode = || loop {
            let item = work
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .next();
            let Some((c, dst)) = item else { return };
            let src = &bytes[2 * c * CHUNK..2 * (c * CHUNK + dst.len())];
            for (d, w) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = table[usize::from(u16::from_le_bytes([w[0], w[1]]))];
            }
        };
        on_threads(threads, encode);
        Ok(scale)
    }

    /// The scaled quantization of `n` values that `read(at, buf)` gives chunk by chunk
    /// (`buf.len()` values from index `at`), into `out`; large inputs on all cores, in
    /// fixed chunks, so the result does not depend on the thread count.
    fn quantize_scaled_into(
        self,
        what: &str,
        n: usize,
        read: impl Fn(usize, &mut [f32]) + Sync,
        out: &mut [u8],
    ) -> Result<f32> {
        const CHUNK: usize = 1 << 16;
        let max = self.fp8_max_for(what)?;
        let threads = if n > 16 * CHUNK {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
        } else {
            1
        };
        // Pass 1: the largest magnitude (NaN when any value is not finite).
        let chunks = n.div_ceil(CHUNK);
        let next = std::sync::atomic::AtomicUsize::new(0);
        let scan = || {
            let mut buf = vec![0f32; CHUNK.min(n)];
            let mut amax = 0f32;
            loop {
                let c = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if c >= chunks {
                    return amax;
                }
                let at = c * CHUNK;
                let buf = &mut buf[..CHUNK.min(n - at)];
                read(at, buf);
                for &v in buf.iter() {
                    amax = if v.is_finite() && !amax.is_nan() {
                        amax.max(v.abs())
                    } else {
                        f32::NAN
                    };
                }
            }
        };
        let amax = on_threads(threads, scan).into_iter().fold(0f32, |a, m| {
            if a.is_nan() || m.is_nan() {
                f32::NAN
            } else {
                a.max(m)
            }
        });
        if amax.is_nan() {
            return Err(CoreError::Shape {
                what: format!("quantizing {what}"),
                message: "a value is not finite; fp8 with a scale needs finite weights".into(),
            });
        }
        let scale = if amax > 0.0 { amax / max } else { 1.0 };
        // Pass 2: the codes. Divided, not multiplied by a reciprocal: a subnormal amax's
        // reciprocal overflows.
        let e4m3 = self == DType::F8E4M3;
        let work = std::sync::Mutex::new(out.chunks_mut(CHUNK).enumerate());
        let encode = || {
            let mut buf = vec![0f32; CHUNK.min(n)];
            loop {
                let item = work
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .next();
                let Some((c, dst)) = item else { return };
                let buf = &mut buf[..dst.len()];
                read(c * CHUNK, buf);
                for (d, &v) in dst.iter_mut().zip(buf.iter()) {
                    *d = if e4m3 {
                        F8E4M3::from_f32(v / scale).to_bits()
                    } else {
                        F8E5M2::from_f32(v / scale).to_bits()
                    };
                }
            }
        };
        on_threads(threads, encode);
        Ok(scale)
    }

    /// Short name (`f32`, `f16`, `bf16`, `f8_e4m3`, `f8_e5m2`, `quantized`).
    pub const fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F8E4M3 => "f8_e4m3",
            DType::F8E5M2 => "f8_e5m2",
            DType::Quantized => "quantized",
        }
    }

    /// The dtype a safetensors header names, if DDO supports it.
    pub fn from_safetensors(dtype: safetensors::Dtype) -> Option<DType> {
        match dtype {
            safetensors::Dtype::F32 => Some(DType::F32),
            safetensors::Dtype::F16 => Some(DType::F16),
            safetensors::Dtype::BF16 => Some(DType::BF16),
            safetensors::Dtype::F8_E4M3 => Some(DType::F8E4M3),
            safetensors::Dtype::F8_E5M2 => Some(DType::F8E5M2),
            safetensors::Dtype::U8 | safetensors::Dtype::I8 => Some(DType::Quantized),
            _ => None,
        }
    }

    /// The dtype a safetensors header's `dtype` string names (`"BF16"`, `"F8_E4M3"`, ...),
    /// if DDO supports it (as [`DType::from_safetensors`]).
    pub fn from_header_name(name: &str) -> Option<DType> {
        match name {
            "F32" => Some(DType::F32),
            "F16" => Some(DType::F16),
            "BF16" => Some(DType::BF16),
            "F8_E4M3" => Some(DType::F8E4M3),
            "F8_E5M2" => Some(DType::F8E5M2),
            "U8" | "I8" => Some(DType::Quantized),
            _ => None,
        }
    }

    /// The safetensors dtype this is stored as (quantized storage as `U8`).
    pub fn to_safetensors(self) -> safetensors::Dtype {
        match self {
            DType::F32 => safetensors::Dtype::F32,
            DType::F16 => safetensors::Dtype::F16,
            DType::BF16 => safetensors::Dtype::BF16,
            DType::F8E4M3 => safetensors::Dtype::F8_E4M3,
            DType::F8E5M2 => safetensors::Dtype::F8_E5M2,
            DType::Quantized => safetensors::Dtype::U8,
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
        // The host backend decodes every input of every op here: a failed allocation is a
        // typed error, not an abort.
        let mut out =
            crate::host_memory::try_with_capacity::<f32>(bytes.len() / size, "decoded values")?;
        match self {
            DType::F32 => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            ),
            DType::F16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()),
            ),
            DType::BF16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()),
            ),
            DType::F8E4M3 => out.extend(bytes.iter().map(|&b| F8E4M3::from_bits(b).to_f32())),
            DType::F8E5M2 => out.extend(bytes.iter().map(|&b| F8E5M2::from_bits(b).to_f32())),
            DType::Quantized => {
                return Err(CoreError::Shape {
                    what: "decode".into(),
                    message:
                        "quantized storage has no element values to decode; dequantize it first"
                            .into(),
                });
            }
        }
        Ok(out)
    }

    /// Encodes f32 values as little-endian bytes of this dtype (round to nearest even; the
    /// 8-bit floats saturate at their largest finite value, see the module docs).
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
            DType::F8E4M3 => values
                .iter()
                .map(|&v| F8E4M3::from_f32(v).to_bits())
                .collect(),
            DType::F8E5M2 => values
                .iter()
                .map(|&v| F8E5M2::from_f32(v).to_bits())
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

/// Runs `f` on `threads` threads (the calling thread among them) and gives each result.
fn on_threads<T: Send>(threads: usize, f: impl Fn() -> T + Sync) -> Vec<T> {
    if threads <= 1 {
        return vec![f()];
    }
    let f = &f;
    std::thread::scope(|s| {
        let others: Vec<_> = (1..threads).map(|_| s.spawn(f)).collect();
        let mut results = vec![f()];
        for h in others {
            results.push(h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
        }
        results
    })
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
    fn per_tensor_scaled_quantization_spans_the_format_and_refuses_non_finite_values() {
        let values: Vec<f32> = (0..200).map(|i| (i as f32 - 100.0) * 3.1e-4).collect();
        for dtype in [DType::F8E4M3, DType::F8E5M2] {
            let max = dtype.fp8_max().unwrap();
            let (codes, scale) = dtype.quantize_scaled("w", &values).unwrap();
            assert_eq!(codes.len(), values.len());
            let amax = values.iter().fold(0f32, |a, v| a.max(v.abs()));
            assert_eq!(scale, amax / max, "{dtype}");
            let back = dtype.decode_f32(&codes).unwrap();
            // The largest magnitude lands on the largest finite code.
            assert_eq!(
                back.iter().fold(0f32, |a, v| a.max(v.abs())),
                max,
                "{dtype}"
            );
            // Relative error of a normal value: half an ulp of 3 (or 2) mantissa bits.
            let rel = if dtype == DType::F8E4M3 {
                1.0 / 16.0
            } else {
                1.0 / 8.0
            };
            for (v, q) in values.iter().zip(&back) {
                let err = (v - q * scale).abs();
                assert!(
                    err <= rel * v.abs() + 1e-9 + scale * 2f32.powi(-9),
                    "{dtype}: {v} -> {}",
                    q * scale
                );
            }
            // All zeros: scale 1, codes 0.
            let (zeros, one) = dtype.quantize_scaled("z", &[0.0; 4]).unwrap();
            assert_eq!((zeros, one), (vec![0; 4], 1.0));
            for bad in [f32::NAN, f32::INFINITY] {
                let err = dtype
                    .quantize_scaled("layer.weight", &[1.0, bad])
                    .unwrap_err();
                assert!(err.to_string().contains("layer.weight"), "{err}");
            }
        }
        assert!(DType::BF16.quantize_scaled("w", &[1.0]).is_err());
        assert_eq!(DType::F8E4M3.compute(), DType::BF16);
        assert_eq!(DType::F16.compute(), DType::F16);
    }

    /// From f32, f16 or bf16 bytes, the chunked quantizer (threaded past 16 chunks) gives
    /// the codes and scale of quantizing the decoded values.
    #[test]
    fn quantizing_source_bytes_equals_quantizing_their_values_on_any_thread_count() {
        let n = 17 * (1 << 16) + 123;
        let values: Vec<f32> = (0..n)
            .map(|i| ((i as u64).wrapping_mul(2654435761) % 20001) as f32 * 1e-6 - 0.01)
            .collect();
        for src in [DType::F32, DType::F16, DType::BF16] {
            let bytes = src.encode_f32(&values).unwrap();
            let decoded = src.decode_f32(&bytes).unwrap();
            for fmt in [DType::F8E4M3, DType::F8E5M2] {
                // A one-thread reference written from the definition.
                let amax = decoded.iter().fold(0f32, |a, v| a.max(v.abs()));
                let want_scale = amax / fmt.fp8_max().unwrap();
                let scaled: Vec<f32> = decoded.iter().map(|v| v / want_scale).collect();
                let want = fmt.encode_f32(&scaled).unwrap();
                assert_eq!(
                    fmt.quantize_scaled("w", &decoded).unwrap(),
                    (want.clone(), want_scale)
                );
                let mut out = vec![0u8; n];
                let scale = fmt
                    .quantize_scaled_bytes("w", src, &bytes, &mut out)
                    .unwrap();
                assert_eq!(scale, want_scale, "{src} -> {fmt}");
                assert!(out == want, "{src} -> {fmt}");
            }
        }
        let mut short = vec![0u8; 3];
        assert!(
            DType::F8E4M3
                .quantize_scaled_bytes("w", DType::BF16, &[0; 4], &mut short)
                .is_err()
        );
        let nan = DType::BF16.encode_f32(&[1.0, f32::NAN]).unwrap();
        assert!(
            DType::F8E4M3
                .quantize_scaled_bytes("w", DType::BF16, &nan, &mut [0u8; 2])
                .is_err()
        );
    }

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

    /// The value of 8-bit float `code` written from the formats' definitions, independently
    /// of the conversion under test: `(exponent bits, mantissa bits, bias, has infinities)`.
    fn reference_fp8(code: u8, e_bits: u32, m_bits: u32, bias: i32, ieee: bool) -> f32 {
        let sign = if code & 0x80 != 0 { -1.0f64 } else { 1.0 };
        let e = ((code >> m_bits) as u32 & ((1 << e_bits) - 1)) as i32;
        let m = (code as u32 & ((1 << m_bits) - 1)) as f64;
        let top = (1 << e_bits) - 1;
        if ieee && e == top {
            return if m == 0.0 {
                (sign * f64::INFINITY) as f32
            } else {
                f32::NAN
            };
        }
        if !ieee && e == top && m as u32 == (1 << m_bits) - 1 {
            return f32::NAN; // e4m3fn: only S.1111.111 is NaN; no infinities
        }
        let frac = m / f64::from(1u32 << m_bits);
        let v = if e == 0 {
            frac * 2f64.powi(1 - bias)
        } else {
            (1.0 + frac) * 2f64.powi(e - bias)
        };
        (sign * v) as f32
    }

    const FORMATS: [(DType, u32, u32, i32, bool, f32); 2] = [
        (DType::F8E4M3, 4, 3, 7, false, 448.0),
        (DType::F8E5M2, 5, 2, 15, true, 57344.0),
    ];

    #[test]
    fn every_fp8_code_decodes_to_its_defined_value_and_encodes_back() {
        for (dtype, e, m, bias, ieee, _) in FORMATS {
            let codes: Vec<u8> = (0..=255).collect();
            let values = dtype.decode_f32(&codes).unwrap();
            for (&code, &v) in codes.iter().zip(&values) {
                let want = reference_fp8(code, e, m, bias, ieee);
                if want.is_nan() {
                    assert!(v.is_nan(), "{dtype} {code:#04x}: {v}, want NaN");
                    assert!(
                        dtype.decode_f32(&dtype.encode_f32(&[v]).unwrap()).unwrap()[0].is_nan()
                    );
                    continue;
                }
                assert_eq!(v.to_bits(), want.to_bits(), "{dtype} {code:#04x}");
                if v.is_finite() {
                    assert_eq!(
                        dtype.encode_f32(&[v]).unwrap(),
                        [code],
                        "{dtype} {code:#04x}"
                    );
                }
            }
        }
    }

    #[test]
    fn fp8_encoding_rounds_to_nearest_even_and_saturates() {
        for (dtype, .., max) in FORMATS {
            // Every finite positive value, ascending.
            let mut grid: Vec<f32> = dtype
                .decode_f32(&(0..=127u8).collect::<Vec<_>>())
                .unwrap()
                .into_iter()
                .filter(|v| v.is_finite())
                .collect();
            grid.sort_by(f32::total_cmp);
            assert_eq!(*grid.last().unwrap(), max, "{dtype}");
            for (i, pair) in grid.windows(2).enumerate() {
                let (lo, hi) = (pair[0], pair[1]);
                let mid = (lo + hi) / 2.0; // exact in f32: both have few mantissa bits
                let even = if i % 2 == 0 { lo } else { hi }; // codes alternate even/odd
                let got = dtype
                    .decode_f32(&dtype.encode_f32(&[mid]).unwrap())
                    .unwrap()[0];
                assert_eq!(got, even, "{dtype}: midpoint of {lo} and {hi}");
                let below = dtype
                    .decode_f32(&dtype.encode_f32(&[mid - (mid - lo) / 4.0]).unwrap())
                    .unwrap()[0];
                assert_eq!(
                    below, lo,
                    "{dtype}: just below the midpoint of {lo} and {hi}"
                );
                let neg = dtype
                    .decode_f32(&dtype.encode_f32(&[-(mid + (hi - mid) / 4.0)]).unwrap())
                    .unwrap()[0];
                assert_eq!(neg, -hi, "{dtype}: just above the midpoint, negated");
            }
            for big in [max * 1.01, max * 4.0, 1e30, f32::INFINITY] {
                let back = dtype
                    .decode_f32(&dtype.encode_f32(&[big, -big]).unwrap())
                    .unwrap();
                assert_eq!(back, [max, -max], "{dtype}: {big} saturates");
            }
            let nan = dtype
                .decode_f32(&dtype.encode_f32(&[f32::NAN]).unwrap())
                .unwrap()[0];
            assert!(nan.is_nan(), "{dtype}: NaN stays NaN");
        }
    }

    #[test]
    fn fp8_dtypes_map_to_and_from_safetensors() {
        for dtype in [
            DType::F32,
            DType::F16,
            DType::BF16,
            DType::F8E4M3,
            DType::F8E5M2,
        ] {
            assert_eq!(DType::from_safetensors(dtype.to_safetensors()), Some(dtype));
            // The header's name of it, as the safetensors crate writes it.
            let name = format!("{:?}", dtype.to_safetensors());
            assert_eq!(DType::from_header_name(&name), Some(dtype), "{name}");
        }
        assert_eq!(DType::F8E4M3.size_in_bytes(), 1);
        assert!(DType::F8E5M2.is_fp8() && !DType::F8E5M2.is_quantized());
        assert!(!DType::BF16.is_fp8());
        assert_eq!(DType::F8E4M3.to_string(), "f8_e4m3");
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
