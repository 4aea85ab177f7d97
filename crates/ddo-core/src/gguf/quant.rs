//! GGML's tensor types as GGUF files store them ([`GgmlType`]: ids, block sizes, names) and
//! their host dequantization to f32 ([`dequantize`], [`dequantize_into`]).
//!
//! The dequantization is the reference the GPU kernels are checked against: it matches
//! gguf-py's numpy reference (`gguf.quants.dequantize`) bit for bit, so every product is
//! computed in f32 in the order numpy evaluates it (f16 scales widened to f32 first, the
//! block's sub-scale `d * sc` rounded before it multiplies the quant, `d*sc*q - dmin*m` as
//! two rounded products and one rounded difference, never fused).
//!
//! Block layouts (offsets in bytes within one block; `f16` fields little-endian):
//!
//! | type | elements | bytes | layout |
//! | --- | --- | --- | --- |
//! | Q4_0 | 32 | 18 | `d` f16, 16 B of nibbles (low nibbles are elements 0..16, high 16..32); `d * (q - 8)` |
//! | Q4_1 | 32 | 20 | `d`, `m` f16, 16 B of nibbles; `d * q + m` |
//! | Q5_0 | 32 | 22 | `d` f16, `qh` u32 (bit j: element j's fifth bit), 16 B of nibbles; `d * (q - 16)` |
//! | Q5_1 | 32 | 24 | `d`, `m` f16, `qh` u32, 16 B of nibbles; `d * q + m` |
//! | Q8_0 | 32 | 34 | `d` f16, 32 i8; `q * d` |
//! | Q2_K | 256 | 84 | 16 B scales (low nibble scale, high nibble min), 64 B of 2-bit quants, `d`, `dmin` f16 |
//! | Q3_K | 256 | 110 | 32 B high-bit mask, 64 B of 2-bit quants, 12 B of 6-bit scales, `d` f16 |
//! | Q4_K | 256 | 144 | `d`, `dmin` f16, 12 B of 6-bit scales and mins, 128 B of nibbles |
//! | Q5_K | 256 | 176 | `d`, `dmin` f16, 12 B of scales and mins, 32 B of fifth bits, 128 B of nibbles |
//! | Q6_K | 256 | 210 | 128 B low nibbles, 64 B of 2-bit high parts, 16 i8 scales, `d` f16 |

use std::fmt;

use half::f16;

use crate::error::{CoreError, Result};

/// A GGML tensor type DDO reads from GGUF files. The discriminant is GGML's type id
/// (`enum ggml_type` in `ggml.h`, `GGMLQuantizationType` in gguf-py).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    /// 32-bit float.
    F32 = 0,
    /// IEEE half.
    F16 = 1,
    /// 4-bit quants with one f16 scale per 32 elements.
    Q4_0 = 2,
    /// 4-bit quants with an f16 scale and minimum per 32 elements.
    Q4_1 = 3,
    /// 5-bit quants with one f16 scale per 32 elements.
    Q5_0 = 6,
    /// 5-bit quants with an f16 scale and minimum per 32 elements.
    Q5_1 = 7,
    /// 8-bit quants with one f16 scale per 32 elements.
    Q8_0 = 8,
    /// K-quant: 2-bit quants, 4-bit scales and minimums per 16, two f16 super-scales per 256.
    Q2_K = 10,
    /// K-quant: 3-bit quants, 6-bit scales per 16, one f16 super-scale per 256.
    Q3_K = 11,
    /// K-quant: 4-bit quants, 6-bit scales and minimums per 32, two f16 super-scales per 256.
    Q4_K = 12,
    /// K-quant: 5-bit quants, 6-bit scales and minimums per 32, two f16 super-scales per 256.
    Q5_K = 13,
    /// K-quant: 6-bit quants, 8-bit scales per 16, one f16 super-scale per 256.
    Q6_K = 14,
    /// bfloat16.
    BF16 = 30,
}

/// The name of every GGML type id that exists, supported or not (`ggml.h`; `None` for ids
/// never assigned or since removed).
pub fn ggml_type_name(id: u32) -> Option<&'static str> {
    Some(match id {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        6 => "Q5_0",
        7 => "Q5_1",
        8 => "Q8_0",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        20 => "IQ4_NL",
        21 => "IQ3_S",
        22 => "IQ2_S",
        23 => "IQ4_XS",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        30 => "BF16",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        40 => "NVFP4",
        41 => "Q1_0",
        _ => return None,
    })
}

/// A GGML type id that is not a [`GgmlType`]: unknown, or a type DDO does not dequantize
/// (Q8_K, the IQ and TQ families, MXFP4, integers, f64). Its `Display` names the id, its
/// GGML name where it has one, and the supported types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnsupportedGgmlType {
    /// The type id as stored.
    pub id: u32,
}

impl fmt::Display for UnsupportedGgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match ggml_type_name(self.id) {
            Some(name) => write!(f, "type {} ({name}) is not supported", self.id)?,
            None => write!(f, "type {} is not a GGML type", self.id)?,
        }
        f.write_str("; supported: ")?;
        for (i, ty) in GgmlType::ALL.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            f.write_str(ty.name())?;
        }
        Ok(())
    }
}

impl std::error::Error for UnsupportedGgmlType {}

impl GgmlType {
    /// Every supported type, in id order.
    pub const ALL: [GgmlType; 13] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::BF16,
    ];

    /// The type of a stored id; any other id is an [`UnsupportedGgmlType`] naming it.
    pub fn from_id(id: u32) -> std::result::Result<Self, UnsupportedGgmlType> {
        Self::ALL
            .iter()
            .copied()
            .find(|t| t.id() == id)
            .ok_or(UnsupportedGgmlType { id })
    }

    /// GGML's type id.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// The name as llama.cpp spells it (`Q4_K`, `BF16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q2_K => "Q2_K",
            GgmlType::Q3_K => "Q3_K",
            GgmlType::Q4_K => "Q4_K",
            GgmlType::Q5_K => "Q5_K",
            GgmlType::Q6_K => "Q6_K",
            GgmlType::BF16 => "BF16",
        }
    }

    /// Elements per block: 1 for the float types, 32 for the legacy quants, 256 for the
    /// K-quants. A tensor's rows (its ggml `dims[0]`) are whole blocks.
    pub fn block_elements(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => {
                32
            }
            GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => {
                256
            }
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q8_0 => 34,
            GgmlType::Q2_K => 84,
            GgmlType::Q3_K => 110,
            GgmlType::Q4_K => 144,
            GgmlType::Q5_K => 176,
            GgmlType::Q6_K => 210,
        }
    }

    /// Whether this is a block-quantized type (not F32, F16 or BF16).
    pub fn is_quantized(self) -> bool {
        self.block_elements() > 1
    }

    /// The bytes `elements` elements take: `None` when `elements` is not a whole number of
    /// blocks or the size overflows.
    pub fn bytes_for(self, elements: usize) -> Option<usize> {
        if !elements.is_multiple_of(self.block_elements()) {
            return None;
        }
        (elements / self.block_elements()).checked_mul(self.block_bytes())
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Tensors of at least this many elements are dequantized on several threads.
const PARALLEL_ELEMENTS: usize = 1 << 20;

/// `elements` values of type `ty` stored in `bytes` (whole blocks, exactly as many as the
/// elements need), as f32; bit-exact against gguf-py's `gguf.quants.dequantize`. Large
/// tensors are split over the machine's cores. A count that is not a whole number of blocks
/// is [`CoreError::Shape`]; bytes of the wrong length are [`CoreError::SizeMismatch`].
pub fn dequantize(ty: GgmlType, bytes: &[u8], elements: usize) -> Result<Vec<f32>> {
    check_sizes(ty, bytes, elements)?;
    let mut out = vec![0.0f32; elements];
    dequantize_into(ty, bytes, &mut out)?;
    Ok(out)
}

/// [`dequantize`] into `out`, whose length is the element count.
pub fn dequantize_into(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    check_sizes(ty, bytes, out.len())?;
    let threads = if out.len() >= PARALLEL_ELEMENTS {
        std::thread::available_parallelism().map_or(1, usize::from)
    } else {
        1
    };
    let blocks = out.len() / ty.block_elements();
    if threads <= 1 || blocks < 2 {
        dequantize_blocks(ty, bytes, out);
        return Ok(());
    }
    let per_thread = blocks.div_ceil(threads);
    std::thread::scope(|scope| {
        for (src, dst) in bytes
            .chunks(per_thread * ty.block_bytes())
            .zip(out.chunks_mut(per_thread * ty.block_elements()))
        {
            scope.spawn(move || dequantize_blocks(ty, src, dst));
        }
    });
    Ok(())
}

fn check_sizes(ty: GgmlType, bytes: &[u8], elements: usize) -> Result<()> {
    let expected = ty.bytes_for(elements).ok_or_else(|| CoreError::Shape {
        what: format!("dequantize {ty}"),
        message: format!(
            "{elements} elements are not a whole number of {}-element blocks",
            ty.block_elements()
        ),
    })?;
    if bytes.len() != expected {
        return Err(CoreError::SizeMismatch {
            what: format!("dequantize {elements} elements of {ty}"),
            expected,
            actual: bytes.len(),
        });
    }
    Ok(())
}

/// Dequantizes whole blocks; the lengths are checked by the caller.
fn dequantize_blocks(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    match ty {
        GgmlType::F32 => {
            for (b, o) in bytes.chunks_exact(4).zip(out) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (b, o) in bytes.chunks_exact(2).zip(out) {
                *o = f16_at(b, 0);
            }
        }
        GgmlType::BF16 => {
            for (b, o) in bytes.chunks_exact(2).zip(out) {
                *o = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
            }
        }
        _ => {
            let block = match ty {
                GgmlType::Q4_0 => q4_0,
                GgmlType::Q4_1 => q4_1,
                GgmlType::Q5_0 => q5_0,
                GgmlType::Q5_1 => q5_1,
                GgmlType::Q8_0 => q8_0,
                GgmlType::Q2_K => q2_k,
                GgmlType::Q3_K => q3_k,
                GgmlType::Q4_K => q4_k,
                GgmlType::Q5_K => q5_k,
                GgmlType::Q6_K => q6_k,
                GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => unreachable!("handled above"),
            };
            for (b, o) in bytes
                .chunks_exact(ty.block_bytes())
                .zip(out.chunks_exact_mut(ty.block_elements()))
            {
                block(b, o);
            }
        }
    }
}

/// The little-endian f16 at `at`, widened to f32 (exactly, as numpy's `astype`).
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Element `j` (0..32) of a legacy block's 16 bytes of nibbles: low nibbles first.
fn nibble(qs: &[u8], j: usize) -> u8 {
    (qs[j % 16] >> (4 * (j / 16))) & 0x0F
}

/// The fifth bit of element `j` of a Q5_0/Q5_1 block.
fn fifth_bit(qh: u32, j: usize) -> u8 {
    ((qh >> j) & 1) as u8
}

fn q4_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, o) in out.iter_mut().enumerate() {
        let q = nibble(&b[2..18], j) as i8 - 8;
        *o = d * f32::from(q);
    }
}

fn q4_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for (j, o) in out.iter_mut().enumerate() {
        *o = d * f32::from(nibble(&b[4..20], j)) + m;
    }
}

fn q5_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    for (j, o) in out.iter_mut().enumerate() {
        let q = (nibble(&b[6..22], j) | (fifth_bit(qh, j) << 4)) as i8 - 16;
        *o = d * f32::from(q);
    }
}

fn q5_1(b: &[u8], out: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for (j, o) in out.iter_mut().enumerate() {
        let q = nibble(&b[8..24], j) | (fifth_bit(qh, j) << 4);
        *o = d * f32::from(q) + m;
    }
}

fn q8_0(b: &[u8], out: &mut [f32]) {
    let d = f16_at(b, 0);
    for (o, &x) in out.iter_mut().zip(&b[2..34]) {
        *o = f32::from(x as i8) * d;
    }
}

/// The 2-bit quant of element `e` (0..256) in a K-quant's 64 bytes of them: each half of
/// the block (128 elements) reads 32 bytes four times, shifting by 0, 2, 4, 6.
fn two_bits(qs: &[u8], e: usize) -> u8 {
    let (half, within) = (e / 128, e % 128);
    (qs[half * 32 + within % 32] >> (2 * (within / 32))) & 3
}

fn q2_k(b: &[u8], out: &mut [f32]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    for (g, group) in out.chunks_exact_mut(16).enumerate() {
        let dl = d * f32::from(scales[g] & 0x0F);
        let ml = dmin * f32::from(scales[g] >> 4);
        for (i, o) in group.iter_mut().enumerate() {
            *o = dl * f32::from(two_bits(qs, g * 16 + i)) - ml;
        }
    }
}

fn q3_k(b: &[u8], out: &mut [f32]) {
    let (hmask, qs, scales) = (&b[0..32], &b[32..96], &b[96..108]);
    let d = f16_at(b, 108);
    for (g, group) in out.chunks_exact_mut(16).enumerate() {
        // Low four bits from bytes 0..8 (low nibbles for groups 0..8, high for 8..16); the
        // top two from bytes 8..12, shifted by 2 * (g / 4).
        let low = (scales[g % 8] >> (4 * (g / 8))) & 0x0F;
        let high = (scales[8 + g % 4] >> (2 * (g / 4))) & 0x03;
        let dl = d * f32::from((low | (high << 4)) as i8 - 32);
        for (i, o) in group.iter_mut().enumerate() {
            let e = g * 16 + i;
            // A set mask bit means no offset; a clear one subtracts 4.
            let h = ((hmask[e % 32] >> (e / 32)) & 1) ^ 1;
            let q = two_bits(qs, e) as i8 - (h << 2) as i8;
            *o = dl * f32::from(q);
        }
    }
}

/// Q4_K's and Q5_K's 6-bit scale and minimum of sub-block `j` (0..8) from their 12 bytes.
fn scale_min_k4(scales: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 0x3F, scales[j + 4] & 0x3F)
    } else {
        let m_d = scales[j + 4];
        (
            (m_d & 0x0F) | ((scales[j - 4] >> 2) & 0x30),
            (m_d >> 4) | ((scales[j] >> 2) & 0x30),
        )
    }
}

/// The low nibble of element `e` (0..256) in Q4_K's and Q5_K's 128 bytes of them: each
/// 64 elements read 32 bytes twice, low nibbles then high.
fn k_nibble(qs: &[u8], e: usize) -> u8 {
    let sub = e / 32;
    (qs[(sub / 2) * 32 + e % 32] >> (4 * (sub % 2))) & 0x0F
}

fn q4_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for (sub, group) in out.chunks_exact_mut(32).enumerate() {
        let (sc, m) = scale_min_k4(scales, sub);
        let (ds, dm) = (d * f32::from(sc), dmin * f32::from(m));
        for (i, o) in group.iter_mut().enumerate() {
            *o = ds * f32::from(k_nibble(qs, sub * 32 + i)) - dm;
        }
    }
}

fn q5_k(b: &[u8], out: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for (sub, group) in out.chunks_exact_mut(32).enumerate() {
        let (sc, m) = scale_min_k4(scales, sub);
        let (ds, dm) = (d * f32::from(sc), dmin * f32::from(m));
        for (i, o) in group.iter_mut().enumerate() {
            let high = (qh[i] >> sub) & 1;
            let q = k_nibble(qs, sub * 32 + i) | (high << 4);
            *o = ds * f32::from(q) - dm;
        }
    }
}

fn q6_k(b: &[u8], out: &mut [f32]) {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for (g, group) in out.chunks_exact_mut(16).enumerate() {
        let ds = d * f32::from(scales[g] as i8);
        for (i, o) in group.iter_mut().enumerate() {
            let e = g * 16 + i;
            let (half, within) = (e / 128, e % 128);
            let low = (ql[half * 64 + within % 64] >> (4 * (within / 64))) & 0x0F;
            let high = (qh[half * 32 + within % 32] >> (2 * (within / 32))) & 0x03;
            let q = (low | (high << 4)) as i8 - 32;
            *o = ds * f32::from(q);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_supported_id_round_trips_and_appears_once() {
        let mut ids: Vec<u32> = GgmlType::ALL.iter().map(|t| t.id()).collect();
        for ty in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(ty.id()), Ok(ty));
            assert_eq!(ggml_type_name(ty.id()), Some(ty.name()));
        }
        ids.dedup();
        assert_eq!(ids.len(), GgmlType::ALL.len());
        assert!(ids.windows(2).all(|w| w[0] < w[1]), "ALL is in id order");
    }

    #[test]
    fn unsupported_ids_name_themselves_and_the_supported_types() {
        let known = GgmlType::from_id(16).unwrap_err().to_string();
        assert!(known.starts_with("type 16 (IQ2_XXS) is not supported; supported: F32, F16, Q4_0"));
        assert!(known.ends_with("Q6_K, BF16"), "{known}");
        let unknown = GgmlType::from_id(4).unwrap_err().to_string();
        assert!(
            unknown.starts_with("type 4 is not a GGML type"),
            "{unknown}"
        );
        assert!(GgmlType::from_id(15).is_err(), "Q8_K is not read");
    }

    #[test]
    fn bytes_for_needs_whole_blocks_and_checks_overflow() {
        assert_eq!(GgmlType::Q4_K.bytes_for(512), Some(288));
        assert_eq!(GgmlType::Q8_0.bytes_for(64), Some(68));
        assert_eq!(GgmlType::Q8_0.bytes_for(48), None);
        assert_eq!(GgmlType::F32.bytes_for(usize::MAX), None);
        assert_eq!(GgmlType::F16.bytes_for(3), Some(6));
    }

    #[test]
    fn nibbles_and_two_bit_quants_are_read_in_ggml_order() {
        let qs: Vec<u8> = (0..16).map(|i| (i as u8) | ((15 - i as u8) << 4)).collect();
        assert_eq!(nibble(&qs, 3), 3);
        assert_eq!(nibble(&qs, 16 + 3), 12);
        let mut two = vec![0u8; 64];
        two[33] = 0b1110_0100; // element 128 + 1 + 32 * k holds k
        assert_eq!(
            [1, 33, 65, 97].map(|e| two_bits(&two, 128 + e)),
            [0, 1, 2, 3]
        );
        assert_eq!(two_bits(&two, 1), 0);
    }

    #[test]
    fn k4_scales_unpack_six_bits_from_twelve_bytes() {
        let mut s = [0u8; 12];
        s[0] = 0b11_000101; // scale 0 = 5; top bits go to scale 4
        s[4] = 0b01_000111; // min 0 = 7; top bits go to min 4
        s[8] = 0x9A; // scale 4 low nibble 0xA, min 4 low nibble 0x9
        assert_eq!(scale_min_k4(&s, 0), (5, 7));
        assert_eq!(scale_min_k4(&s, 4), (0x30 | 0x0A, 0x10 | 0x09));
    }

    #[test]
    fn wrong_sizes_are_typed_errors() {
        assert!(matches!(
            dequantize(GgmlType::Q4_0, &[0; 18], 31),
            Err(CoreError::Shape { .. })
        ));
        assert!(matches!(
            dequantize(GgmlType::Q4_0, &[0; 17], 32),
            Err(CoreError::SizeMismatch {
                expected: 18,
                actual: 17,
                ..
            })
        ));
    }

    #[test]
    fn q8_0_is_the_scale_times_the_signed_byte() {
        let mut block = vec![0u8; 34];
        block[..2].copy_from_slice(&f16::from_f32(0.5).to_bits().to_le_bytes());
        block[2] = 0x81; // -127
        block[3] = 4;
        let out = dequantize(GgmlType::Q8_0, &block, 32).unwrap();
        assert_eq!(&out[..3], &[-63.5, 2.0, 0.0]);
    }

    #[test]
    fn threaded_and_single_threaded_dequantization_agree() {
        let elements = PARALLEL_ELEMENTS + 256;
        let bytes: Vec<u8> = (0..GgmlType::Q6_K.bytes_for(elements).unwrap())
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u8)
            .collect();
        let threaded = dequantize(GgmlType::Q6_K, &bytes, elements).unwrap();
        let mut single = vec![0.0; elements];
        dequantize_blocks(GgmlType::Q6_K, &bytes, &mut single);
        assert!(
            threaded
                .iter()
                .zip(&single)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
    }
}
