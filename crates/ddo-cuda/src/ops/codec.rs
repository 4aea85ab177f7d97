//! The GPU decoder of ddo-codec's encoded bf16 units (`kernels/codec.cu`), public as
//! `ddo_cuda::codec`: [`decode_unit`] queues the decode of one unit already in device
//! memory into a device output on a stream the caller picks (the copy stream, so it
//! overlaps the next unit's copy and the compute stream's work).
//!
//! The header is parsed on the host: the caller holds each unit's validated
//! [`UnitHeader`] (from [`ddo_codec::EncodedUnit::header`] or [`UnitHeader::parse`] of the
//! host bytes it copies), and the launch passes the section offsets as kernel arguments, so
//! the device reads no header and nothing is allocated per launch. The only device memory
//! besides input and output is [`SCRATCH_BYTES`] of scratch per stream (a status word and
//! the checksum accumulator), allocated once by the caller and zeroed with
//! [`clear_scratch`]; decodes queued on one stream may share it, decodes on different
//! streams need one each.
//!
//! Verification: with `verify`, the kernel computes the unit's checksum as it writes (each
//! lane hashes the `u64`s it stores) and the last block compares it with the header's;
//! a mismatch, an invalid code or a chunk stream not consumed exactly sets a bit of the
//! status ([`read_status`]). The decode never reads or writes outside the unit's sections
//! and the output's decoded length, whatever the bytes. Reading the status synchronises, so
//! a streaming caller checks it once per forward (or verifies units on the host when it
//! builds them, [`ddo_codec::decode_unit`]), not per unit.

use cudarc::driver::LaunchConfig;
use ddo_codec::{CHUNK_WORDS, Mode, UnitHeader};
use ddo_core::{Device, DeviceSlice, Result, Stream};

use super::kernels::{Arg, launch_on};
use crate::device::{CudaAllocation, CudaDevice};
use crate::error::CudaError;

/// Name of this file's kernel source.
pub(crate) const SOURCE_NAME: &str = "codec.cu";
/// The kernel source.
pub(crate) const SOURCE: &str = include_str!("../../kernels/codec.cu");

/// Bytes of device scratch one stream's decodes need (8-byte aligned).
pub const SCRATCH_BYTES: usize = 16;

/// Warps per block of the decode kernel (`CODEC_WARPS`): one chunk each.
const WARPS: u64 = 4;
/// Most blocks of one launch (the kernel loops over further chunks).
const MAX_BLOCKS: u64 = 1 << 16;

/// `CODEC_BAD_CODE` in the kernel.
const BAD_CODE: u32 = 1;
/// `CODEC_BAD_STREAM` in the kernel.
const BAD_STREAM: u32 = 2;
/// `CODEC_BAD_CHECKSUM` in the kernel.
const BAD_CHECKSUM: u32 = 4;

/// What the decodes since the scratch was last cleared found wrong (sticky).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DecodeStatus {
    bits: u32,
}

impl DecodeStatus {
    /// No decode found anything wrong.
    pub fn is_ok(&self) -> bool {
        self.bits == 0
    }

    /// A lookup met bits no code starts with.
    pub fn bad_code(&self) -> bool {
        self.bits & BAD_CODE != 0
    }

    /// A chunk's stream was not consumed exactly, or left non-zero padding bits.
    pub fn bad_stream(&self) -> bool {
        self.bits & BAD_STREAM != 0
    }

    /// A verified decode's words did not match the unit's checksum.
    pub fn bad_checksum(&self) -> bool {
        self.bits & BAD_CHECKSUM != 0
    }

    /// The raw status bits (`1` bad code, `2` bad stream, `4` bad checksum).
    pub fn bits(&self) -> u32 {
        self.bits
    }
}

/// The allocation and device address of `slice`, checked to be `dev`'s and aligned to
/// `align` bytes.
fn address<'a>(
    dev: &CudaDevice,
    slice: &'a DeviceSlice,
    what: &str,
    align: u64,
) -> Result<(&'a CudaAllocation, u64)> {
    let alloc = dev.allocation(slice.buffer())?;
    let ptr = alloc.device_ptr() + slice.offset() as u64;
    if !ptr.is_multiple_of(align) {
        return Err(refuse(
            dev,
            format!("the {what} at {ptr:#x} is not {align}-byte aligned"),
        ));
    }
    Ok((alloc, ptr))
}

fn refuse(dev: &CudaDevice, reason: String) -> ddo_core::CoreError {
    CudaError::CodecLaunch {
        device: dev.id().to_string(),
        reason,
    }
    .into_core(&dev.id().to_string())
}

/// Queues the decode of the unit whose validated header is `header` and whose bytes are
/// the first `header.encoded_len()` bytes of `src` into the first `header.decoded_len()`
/// bytes of `dst`, on `stream` (one of `dev`'s). `src` must be 16-byte aligned, `dst` and
/// `scratch` ([`SCRATCH_BYTES`], zeroed once by [`clear_scratch`]) 8-byte aligned. With
/// `verify` the kernel also checks the decoded words against the unit's checksum (see the
/// module docs); the result is in [`read_status`]. Nothing is allocated; the three
/// allocations are kept alive until the decode has run.
///
/// `header` must be the one of the bytes in `src` (a header of other bytes decodes garbage
/// and, when verifying, reports it; it never reaches outside the buffers, whose lengths are
/// checked here against the header).
pub fn decode_unit(
    dev: &CudaDevice,
    header: &UnitHeader,
    src: &DeviceSlice,
    dst: &DeviceSlice,
    scratch: &DeviceSlice,
    stream: &Stream,
    verify: bool,
) -> Result<()> {
    let handle = dev.stream_handle(stream)?;
    let (src_alloc, src_ptr) = address(dev, src, "encoded unit", 16)?;
    let (dst_alloc, dst_ptr) = address(dev, dst, "output", 8)?;
    let (scratch_alloc, scratch_ptr) = address(dev, scratch, "scratch", 8)?;
    if (src.len() as u64) < header.encoded_len() {
        return Err(refuse(
            dev,
            format!(
                "the encoded unit is {} bytes but its slice holds {}",
                header.encoded_len(),
                src.len()
            ),
        ));
    }
    if (dst.len() as u64) < header.decoded_len() {
        return Err(refuse(
            dev,
            format!(
                "the unit decodes to {} bytes but the output holds {}",
                header.decoded_len(),
                dst.len()
            ),
        ));
    }
    if scratch.len() < SCRATCH_BYTES {
        return Err(refuse(
            dev,
            format!(
                "the scratch is {} bytes, a decode needs {SCRATCH_BYTES}",
                scratch.len()
            ),
        ));
    }
    let words = header.word_count();
    if words == 0 {
        return Ok(());
    }
    let f = dev.kernel(SOURCE_NAME, SOURCE, "ddo_codec_decode")?;
    let chunks = words.div_ceil(CHUNK_WORDS as u64);
    let cfg = LaunchConfig {
        grid_dim: (chunks.div_ceil(WARPS).min(MAX_BLOCKS) as u32, 1, 1),
        block_dim: (32 * WARPS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let raw = header.mode() == Mode::Raw;
    let args = [
        Arg::Ptr(src_ptr),
        Arg::Ptr(dst_ptr),
        Arg::Ptr(words),
        Arg::Ptr(header.decode_table_offset()),
        Arg::I32(i32::from(header.max_code_len())),
        Arg::Ptr(header.chunk_table_offset()),
        Arg::Ptr(header.mantissa_offset()),
        Arg::Ptr(header.stream_offset()),
        Arg::I32(i32::from(raw)),
        Arg::Ptr(scratch_ptr),
        Arg::I32(i32::from(verify)),
        Arg::Ptr(header.checksum()),
    ];
    launch_on(dev, handle.cuda_stream(), &f, cfg, &args)?;
    for a in [src_alloc, dst_alloc, scratch_alloc] {
        a.note_use(handle);
    }
    Ok(())
}

/// Queues the zeroing of `scratch` ([`SCRATCH_BYTES`], 8-byte aligned) on `stream`: once
/// after allocating it, and to clear a status that was read.
pub fn clear_scratch(dev: &CudaDevice, scratch: &DeviceSlice, stream: &Stream) -> Result<()> {
    let handle = dev.stream_handle(stream)?;
    let (alloc, ptr) = address(dev, scratch, "scratch", 8)?;
    if scratch.len() < SCRATCH_BYTES {
        return Err(refuse(
            dev,
            format!(
                "the scratch is {} bytes, a decode needs {SCRATCH_BYTES}",
                scratch.len()
            ),
        ));
    }
    let f = dev.kernel(SOURCE_NAME, SOURCE, "ddo_codec_scratch_clear")?;
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (32, 1, 1),
        shared_mem_bytes: 0,
    };
    launch_on(dev, handle.cuda_stream(), &f, cfg, &[Arg::Ptr(ptr)])?;
    alloc.note_use(handle);
    Ok(())
}

/// The status of the decodes queued on `stream` with `scratch` so far: waits for `stream`
/// and reads the scratch back (a synchronisation; check once per batch of units).
pub fn read_status(
    dev: &CudaDevice,
    scratch: &DeviceSlice,
    stream: &Stream,
) -> Result<DecodeStatus> {
    if scratch.len() < SCRATCH_BYTES {
        return Err(refuse(
            dev,
            format!(
                "the scratch is {} bytes, a decode needs {SCRATCH_BYTES}",
                scratch.len()
            ),
        ));
    }
    let head = scratch.buffer().slice(scratch.offset(), SCRATCH_BYTES)?;
    let bytes = ddo_core::device::download(dev, &head, stream)?;
    let mut status = [0u8; 4];
    status.copy_from_slice(&bytes[12..16]);
    Ok(DecodeStatus {
        bits: u32::from_le_bytes(status),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel's constants match the format's.
    #[test]
    fn the_kernel_agrees_with_the_format() {
        let has = |s: &str| SOURCE.contains(s);
        assert!(has(&format!("#define CODEC_CHUNK {CHUNK_WORDS}")));
        assert!(has(&format!(
            "#define CODEC_MAX_STREAM {}",
            ddo_codec::MAX_CHUNK_STREAM_WORDS
        )));
        assert!(has(&format!("#define CODEC_WARPS {WARPS}")));
        assert!(has(&format!("__launch_bounds__({})", 32 * WARPS)));
        assert!(has(&format!("u16 lut[{}]", 1 << ddo_codec::MAX_CODE_LEN)));
        for (name, bit) in [
            ("CODEC_BAD_CODE", BAD_CODE),
            ("CODEC_BAD_STREAM", BAD_STREAM),
            ("CODEC_BAD_CHECKSUM", BAD_CHECKSUM),
        ] {
            assert!(has(&format!("#define {name} {bit}u")), "{name}");
        }
        assert_eq!(ddo_codec::LANES, 32);
        assert_eq!(ddo_codec::GROUP, 4);
    }

    #[test]
    fn status_bits_read_back() {
        let s = DecodeStatus { bits: 0 };
        assert!(s.is_ok());
        let s = DecodeStatus { bits: 5 };
        assert!(!s.is_ok() && s.bad_code() && !s.bad_stream() && s.bad_checksum());
        assert_eq!(s.bits(), 5);
    }
}
