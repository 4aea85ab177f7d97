//! Scans of stored values for what makes a run's output worthless (issue 34): NaN and ±Inf
//! in any float dtype — an 8-bit float's NaN bytes (e4m3: `0x7f`, `0xff`) and Inf/NaN bytes
//! (e5m2: exponent all ones) included — and, for checkpoints, finite magnitudes above
//! [`HUGE_VALUE`], which overflow once squared.
//!
//! [`count_non_finite`] is the host backend's [`Ops::count_non_finite`](crate::Ops) (bit
//! tests on the stored bytes, no decode); [`scan`] is `ddo inspect --check-values`'s, over a
//! checkpoint's mapped bytes in chunks on every core, never a copy of the tensor.

use float8::{F8E4M3, F8E5M2};
use half::bf16;

use crate::dtype::DType;

/// The largest magnitude a checkpoint value may have: `sqrt(f32::MAX)` ≈ 1.84e19. Any
/// larger value overflows to Inf once squared (the normalisations' statistics, attention
/// scores), in f32 as in bf16, whose range is f32's. No trained weight comes near it; a
/// value beyond it (3e38, 1e30) is a corrupt or badly converted checkpoint.
pub const HUGE_VALUE: f32 = 1.844_674_3e19;

/// What is wrong with `scale`, the per-tensor scale of an fp8 weight of dtype `weight`
/// (`<layer>.scale_weight` / `<layer>.weight_scale`; its values are `decode(byte) * scale`):
/// not finite, not above 0, or so large that the weight's largest value (`fp8_max * scale`:
/// 448 for e4m3, 57344 for e5m2; 448 for a weight that is not fp8) is above [`HUGE_VALUE`].
/// `None` for a usable scale.
pub fn fp8_scale_problem(scale: f32, weight: DType) -> Option<String> {
    if !scale.is_finite() || scale <= 0.0 {
        return Some(format!("its value {scale} is not a finite positive number"));
    }
    let max = weight.fp8_max().unwrap_or(448.0);
    let largest = f64::from(max) * f64::from(scale);
    (largest > f64::from(HUGE_VALUE)).then(|| {
        format!(
            "its value {scale:e} makes the weight's largest value {max} x {scale:e} = {largest:e}, \
             above {HUGE_VALUE:.1e} (sqrt of f32's largest: it overflows once squared)"
        )
    })
}

/// What [`scan`] found in one tensor.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ValueScan {
    /// Elements scanned.
    pub elements: u64,
    /// NaN or ±Inf elements.
    pub non_finite: u64,
    /// Finite elements above the scan's magnitude bound.
    pub huge: u64,
    /// Index of the first element that is either (row-major, from 0).
    pub first_bad: Option<u64>,
}

impl ValueScan {
    /// Elements that are non-finite or too large.
    pub fn bad(&self) -> u64 {
        self.non_finite + self.huge
    }

    /// This scan followed by `next`, a scan of the elements after this one's.
    fn then(self, next: ValueScan) -> ValueScan {
        ValueScan {
            elements: self.elements + next.elements,
            non_finite: self.non_finite + next.non_finite,
            huge: self.huge + next.huge,
            first_bad: self.first_bad.or(next.first_bad.map(|i| i + self.elements)),
        }
    }
}

/// What one stored element is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Class {
    Finite(f32),
    NonFinite,
}

/// Element `bytes` (one element of `dtype`, little-endian) as [`Class`]; `None` for dtypes
/// without values (quantized storage).
fn classify(dtype: DType, bytes: &[u8]) -> Option<Class> {
    let value = match dtype {
        DType::F32 => f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]),
        DType::F16 => half::f16::from_le_bytes([bytes[0], bytes[1]]).to_f32(),
        DType::BF16 => bf16::from_le_bytes([bytes[0], bytes[1]]).to_f32(),
        DType::F8E4M3 | DType::F8E5M2 if fp8_non_finite(dtype, bytes[0]) => {
            return Some(Class::NonFinite);
        }
        DType::F8E4M3 => F8E4M3::from_bits(bytes[0]).to_f32(),
        DType::F8E5M2 => F8E5M2::from_bits(bytes[0]).to_f32(),
        _ => return None,
    };
    Some(if value.is_finite() {
        Class::Finite(value)
    } else {
        Class::NonFinite
    })
}

/// Whether an 8-bit float byte is NaN or Inf: e4m3 (`float8_e4m3fn`) has no Inf and its NaN
/// is `S.1111.111`; e5m2 is IEEE-style, exponent `11111` being Inf (mantissa 0) or NaN.
fn fp8_non_finite(dtype: DType, b: u8) -> bool {
    match dtype {
        DType::F8E4M3 => b & 0x7f == 0x7f,
        DType::F8E5M2 => b & 0x7c == 0x7c,
        _ => false,
    }
}

/// The number of NaN and ±Inf elements in `bytes`, elements of `dtype` (little-endian), by
/// bit tests on the stored bits (exponent all ones; an fp8's NaN and Inf bytes). Quantized
/// storage has no values: 0. A trailing partial element is not counted.
pub fn count_non_finite(dtype: DType, bytes: &[u8]) -> u64 {
    fn count<const N: usize>(bytes: &[u8], bad: impl Fn([u8; N]) -> bool) -> u64 {
        bytes
            .chunks_exact(N)
            .filter(|e| <[u8; N]>::try_from(*e).is_ok_and(&bad))
            .count() as u64
    }
    match dtype {
        DType::F32 => count(bytes, |e: [u8; 4]| {
            u32::from_le_bytes(e) & 0x7f80_0000 == 0x7f80_0000
        }),
        DType::F16 => count(bytes, |e: [u8; 2]| u16::from_le_bytes(e) & 0x7c00 == 0x7c00),
        DType::BF16 => count(bytes, |e: [u8; 2]| u16::from_le_bytes(e) & 0x7f80 == 0x7f80),
        DType::F8E4M3 | DType::F8E5M2 => count(bytes, |[b]: [u8; 1]| fp8_non_finite(dtype, b)),
        _ => 0,
    }
}

/// Bytes below which [`scan`] runs on the calling thread only.
const PARALLEL_FROM: usize = 8 << 20;

/// Scans `bytes`, elements of `dtype`: NaN and ±Inf, and finite values whose magnitude is
/// above `huge_above` (give [`HUGE_VALUE`] for weights, `f32::INFINITY` to count
/// non-finite values only), with the first such element's index. Large tensors are split
/// into one contiguous part per core, scanned in place. Quantized storage has no values:
/// nothing found.
pub fn scan(dtype: DType, bytes: &[u8], huge_above: f32) -> ValueScan {
    let size = dtype.size_in_bytes();
    let elements = bytes.len() / size;
    let threads = if bytes.len() < PARALLEL_FROM {
        1
    } else {
        std::thread::available_parallelism()
            .map_or(1, std::num::NonZeroUsize::get)
            .min(64)
    };
    if threads <= 1 {
        return scan_part(dtype, &bytes[..elements * size], huge_above);
    }
    let per = elements.div_ceil(threads) * size;
    let parts: Vec<ValueScan> = std::thread::scope(|s| {
        let handles: Vec<_> = bytes[..elements * size]
            .chunks(per)
            .map(|part| s.spawn(move || scan_part(dtype, part, huge_above)))
            .collect();
        handles
            .into_iter()
            // A part's panic (none is expected: every index is within its part) goes on in
            // the caller: a part counted as clean would hide its values.
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    parts
        .into_iter()
        .fold(ValueScan::default(), ValueScan::then)
}

/// [`scan`] of whole elements, on this thread.
fn scan_part(dtype: DType, bytes: &[u8], huge_above: f32) -> ValueScan {
    let size = dtype.size_in_bytes();
    let mut out = ValueScan {
        elements: (bytes.len() / size) as u64,
        ..ValueScan::default()
    };
    for (i, e) in bytes.chunks_exact(size).enumerate() {
        let bad = match classify(dtype, e) {
            None => return ValueScan::default(),
            Some(Class::NonFinite) => {
                out.non_finite += 1;
                true
            }
            Some(Class::Finite(v)) if v.abs() > huge_above => {
                out.huge += 1;
                true
            }
            Some(Class::Finite(_)) => false,
        };
        if bad && out.first_bad.is_none() {
            out.first_bad = Some(i as u64);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        DType::F32.encode_f32(v).unwrap()
    }

    #[test]
    fn counts_nan_and_inf_in_every_float_dtype() {
        let values = [
            1.0,
            f32::NAN,
            -2.5,
            f32::INFINITY,
            0.0,
            f32::NEG_INFINITY,
            3e38,
        ];
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let bytes = dtype.encode_f32(&values).unwrap();
            // f16 cannot hold 3e38: it rounds to Inf there.
            let expected = if dtype == DType::F16 { 4 } else { 3 };
            assert_eq!(count_non_finite(dtype, &bytes), expected, "{dtype}");
            let s = scan(dtype, &bytes, HUGE_VALUE);
            assert_eq!(s.non_finite, expected, "{dtype}");
            assert_eq!(s.first_bad, Some(1), "{dtype}");
            assert_eq!(s.elements, values.len() as u64);
        }
        assert_eq!(count_non_finite(DType::F32, &f32_bytes(&[1.0, -1.0])), 0);
        assert_eq!(count_non_finite(DType::Quantized, &[0x7f, 0xff]), 0);
    }

    #[test]
    fn fp8_nan_and_inf_bytes_are_found() {
        // e4m3: 0x7f and 0xff are NaN, 0x7e (448) is finite.
        assert_eq!(
            count_non_finite(DType::F8E4M3, &[0x7f, 0xff, 0x7e, 0x00]),
            2
        );
        let s = scan(DType::F8E4M3, &[0x00, 0x7e, 0xff], HUGE_VALUE);
        assert_eq!((s.non_finite, s.huge, s.first_bad), (1, 0, Some(2)));
        // e5m2: 0x7c is +Inf, 0xfc -Inf, 0x7d NaN, 0x7b (57344) finite.
        assert_eq!(
            count_non_finite(DType::F8E5M2, &[0x7c, 0xfc, 0x7d, 0x7b]),
            3
        );
        let s = scan(DType::F8E5M2, &[0x7b, 0x7c], HUGE_VALUE);
        assert_eq!((s.non_finite, s.first_bad), (1, Some(1)));
    }

    #[test]
    fn huge_finite_values_are_flagged_against_the_bound() {
        let bytes = f32_bytes(&[1.0, 1e19, 3e38, -1e30, 2e19]);
        let s = scan(DType::F32, &bytes, HUGE_VALUE);
        assert_eq!((s.non_finite, s.huge, s.first_bad), (0, 3, Some(2)));
        let s = scan(DType::F32, &bytes, f32::INFINITY);
        assert_eq!((s.bad(), s.first_bad), (0, None));
        // bf16 keeps f32's range: 3e38 stays finite and is flagged as huge.
        let s = scan(
            DType::BF16,
            &DType::BF16.encode_f32(&[3e38]).unwrap(),
            HUGE_VALUE,
        );
        assert_eq!((s.non_finite, s.huge), (0, 1));
    }

    #[test]
    fn fp8_scales_must_be_finite_positive_and_keep_the_weight_in_range() {
        for ok in [1.0f32, 0.02, 1e-30, 4e16] {
            assert_eq!(fp8_scale_problem(ok, DType::F8E4M3), None, "{ok}");
        }
        for bad in [0.0f32, -1.0, f32::NAN, f32::INFINITY, 1e38, 1e17] {
            let p = fp8_scale_problem(bad, DType::F8E4M3);
            assert!(p.is_some(), "{bad}");
        }
        // e5m2 reaches 57344, so a smaller scale already overflows.
        assert!(fp8_scale_problem(1e15, DType::F8E5M2).is_some());
        assert!(fp8_scale_problem(1e15, DType::F8E4M3).is_none());
    }

    #[test]
    fn a_parallel_scan_finds_the_first_bad_element_of_the_whole() {
        let n = (PARALLEL_FROM / 4) * 3 + 5;
        let mut v = vec![0.5f32; n];
        v[n - 3] = f32::NAN;
        v[n / 2 + 7] = 1e25;
        v[n - 1] = f32::INFINITY;
        let bytes = f32_bytes(&v);
        let s = scan(DType::F32, &bytes, HUGE_VALUE);
        assert_eq!(s.elements, n as u64);
        assert_eq!((s.non_finite, s.huge), (2, 1));
        assert_eq!(s.first_bad, Some((n / 2 + 7) as u64));
        assert_eq!(count_non_finite(DType::F32, &bytes), 2);
    }
}
