//! 2-D convolution of the CUDA backend (NCHW, groups 1), in three ways:
//!
//! - **1×1, stride 1, no padding**: the image already is the GEMM operand; all images go
//!   through one strided-batched cuBLAS GEMM.
//! - **f16/bf16, any other kernel**: an implicit GEMM on tensor cores (`kernels/conv.cu`) —
//!   the im2col matrix is gathered tile by tile into shared memory, never stored. The
//!   weights are first repacked tap-major with channels padded to 32
//!   (`ddo_conv_pack_weights`, a small scratch), so each K step is one kernel tap and 32
//!   channels; any kernel size, stride and padding; the bias is added in the epilogue (one
//!   rounding). With channels a multiple of 8 (the VAE's convolutions) the input is first
//!   copied channels-last (`ddo_nchw_to_nhwc_b16`, a scratch the size of the input) and
//!   `ddo_conv_nhwc_igemm_*` streams both operands with cp.async through three stages;
//!   otherwise `ddo_conv_igemm_*` gathers from NCHW through registers.
//! - **f32** (and sizes past the kernel's 32-bit indexing): im2col into a bounded scratch
//!   buffer, then one cuBLAS GEMM per chunk (plain f32 math).
//!
//! Per image, `out [o, oh·ow] = W [o, c·kh·kw] · cols [c·kh·kw, oh·ow]`, which in cuBLAS's
//! column-major terms is `outᵀ = colsᵀ · Wᵀ` with every operand read untransposed. The
//! im2col scratch holds as many whole images as fit in [`SCRATCH_BYTES`] (one
//! strided-batched GEMM per chunk), or, when one image does not fit, a band of output rows
//! of one image (the GEMM then writes that band of every output channel: `ldc = oh·ow`).
//! The scratch is allocated on the compute stream and marked used there, so its free (and
//! reuse by the next op) is ordered after the GEMMs. On the cuBLAS paths a bias seeds the
//! output first and the GEMMs add with `beta = 1` (one rounding too).
//!
//! Inputs of different dtypes are cast to f32 first (exact) and the result cast back to
//! `x`'s dtype.

use ddo_core::{Conv2dParams, DType, Device, Ops, Result, Tensor};

use super::gemm::{Gemm, SOURCE, SOURCE_NAME, fill_bias, gemm, launch_cfg, zero};
use super::kernels::{self, Arg, Dims6};
use super::{Out, input, optional_vector};
use crate::device::CudaDevice;
use cudarc::driver::LaunchConfig;

/// Dynamic shared memory of `ddo_conv_nhwc_igemm_*`: 3 stages of two 128 × 40 half tiles.
const NHWC_SMEM_BYTES: u32 = 3 * 2 * 128 * 40 * 2;

/// Largest im2col scratch of one convolution, in bytes.
const SCRATCH_BYTES: usize = 256 << 20;

/// Device bytes [`conv2d`] allocates besides its output for an input of `elems` elements
/// per channel (batch × height × width, stride 1, "same" padding), `c` channels, `o`
/// filters of `k × k`, in `dtype`: the path choice of [`conv2d`] — nothing for a 1×1
/// convolution (the input is the GEMM operand); on the implicit GEMM (f16/bf16) the
/// repacked weights, plus the channels-last copy of the input when `c` is a multiple of
/// 8; otherwise (f32) the im2col scratch, at most [`SCRATCH_BYTES`].
pub(crate) fn scratch_bytes(elems: usize, c: usize, o: usize, k: usize, dtype: DType) -> u64 {
    let (elems, c, o, k) = (elems as u64, c as u64, o as u64, k as u64);
    if k <= 1 {
        return 0;
    }
    match dtype {
        DType::F16 | DType::BF16 => {
            let packed = o * k * k * c.next_multiple_of(32) * 2;
            let channels_last = if c % 8 == 0 { elems * c * 2 } else { 0 };
            packed + channels_last
        }
        _ => (elems * c * k * k * dtype.size_in_bytes() as u64).min(SCRATCH_BYTES as u64),
    }
}

/// `Ops::conv2d` on `dev`.
pub(crate) fn conv2d(
    dev: &CudaDevice,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    params: Conv2dParams,
) -> Result<Tensor> {
    const OP: &str = "conv2d";
    let Conv2dParams {
        stride: (sh, sw),
        padding: (ph, pw),
    } = params;
    let ddo_core::shape::Conv2dGeometry {
        n,
        c,
        h,
        w: wd,
        o,
        kh,
        kw,
        oh,
        ow,
    } = ddo_core::shape::conv2d_geometry(OP, x.shape(), w.shape(), params)?;
    let xi = input(dev, OP, x)?;
    let wi = input(dev, OP, w)?;
    let bi = optional_vector(dev, OP, "bias", bias, o)?;
    if xi.dtype != wi.dtype {
        let y = conv2d(
            dev,
            &Ops::cast(dev, x, DType::F32)?,
            &Ops::cast(dev, w, DType::F32)?,
            bias,
            params,
        )?;
        return if x.dtype() == DType::F32 {
            Ok(y)
        } else {
            Ops::cast(dev, &y, x.dtype())
        };
    }
    let out = Out::new(dev, OP, vec![n, o, oh, ow], x.dtype())?;
    let plane = oh * ow;
    let total = n * o * plane;
    let dtype = x.dtype();
    let esize = dtype.size_in_bytes();
    let mut inputs = vec![&xi, &wi];
    if let Some(b) = &bi {
        inputs.push(b);
    }
    if total == 0 {
        return out.finish(dev, &inputs);
    }
    let kdim = c * kh * kw;
    if kdim == 0 {
        if let Some(b) = &bi {
            fill_bias(dev, out.ptr, out.code, b, n * o, plane, o, true)?;
        } else {
            zero(dev, out.ptr, total * esize)?;
        }
        return out.finish(dev, &inputs);
    }
    let direct = kh == 1 && kw == 1 && sh == 1 && sw == 1 && ph == 0 && pw == 0;
    let implicit = !direct
        && matches!(dtype, DType::F16 | DType::BF16)
        && c.checked_mul(h * wd).is_some_and(|v| v < i32::MAX as usize)
        && plane < i32::MAX as usize
        && o.div_ceil(128) <= 65_535;
    if implicit {
        implicit_gemm(
            dev,
            &xi,
            &wi,
            bi.as_ref(),
            &out,
            [n, c, h, wd, o, oh, ow, kh, kw],
            params,
        )?;
        return out.finish(dev, &inputs);
    }
    let beta = match &bi {
        Some(b) => {
            fill_bias(dev, out.ptr, out.code, b, n * o, plane, o, true)?;
            1.0
        }
        None => 0.0,
    };
    // outᵀ [plane, o] (ld plane) = colsᵀ [ncol, kdim] (ld ncol) · Wᵀ [kdim, o] (ld kdim).
    let base = Gemm {
        trans_a: false,
        trans_b: false,
        m: plane,
        n: o,
        k: kdim,
        a: xi.ptr,
        lda: plane,
        stride_a: c * h * wd,
        b: wi.ptr,
        ldb: kdim,
        stride_b: 0,
        c: out.ptr,
        ldc: plane,
        stride_c: o * plane,
        batch: n,
        ab: dtype,
        c_dtype: dtype,
        alpha: 1.0,
        beta,
    };
    if direct {
        gemm(dev, &base)?;
        return out.finish(dev, &inputs);
    }

    // im2col in chunks: whole images when one fits, else bands of output rows.
    let image_cols = kdim * plane * esize;
    let (images_per_chunk, rows_per_chunk) = if image_cols <= SCRATCH_BYTES {
        ((SCRATCH_BYTES / image_cols).clamp(1, n), oh)
    } else {
        let rows = (SCRATCH_BYTES / (kdim * ow * esize).max(1)).clamp(1, oh);
        // im2col indexes one band's columns in 32 bits.
        (1, rows.min((i32::MAX as usize / ow).max(1)))
    };
    let scratch_len = images_per_chunk * kdim * rows_per_chunk * ow * esize;
    let compute = dev.compute_stream();
    let scratch = dev.alloc_on(scratch_len, &compute)?;
    let cols = dev.allocation(&scratch)?.device_ptr();
    let f = dev.kernel(
        SOURCE_NAME,
        SOURCE,
        if esize == 2 {
            "ddo_im2col_b16"
        } else {
            "ddo_im2col_b32"
        },
    )?;
    let geo = Dims6::from_slice(&[c, h, wd, kh, kw, ow]);
    let result = (|| -> Result<()> {
        for img0 in (0..n).step_by(images_per_chunk) {
            let images = images_per_chunk.min(n - img0);
            for r0 in (0..oh).step_by(rows_per_chunk) {
                let rows = rows_per_chunk.min(oh - r0);
                let ncol = rows * ow;
                let grid_x = ncol.div_ceil(256).clamp(1, 1 << 16) as u32;
                let grid_y = kdim.clamp(1, 65_535) as u32;
                let grid_z = images.clamp(1, 65_535) as u32;
                kernels::launch(
                    dev,
                    &f,
                    launch_cfg((grid_x, grid_y, grid_z), 256, 0),
                    &[
                        Arg::Ptr(xi.ptr + (img0 * c * h * wd * esize) as u64),
                        Arg::Ptr(cols),
                        Arg::Dims(geo),
                        Arg::Dims(Dims6::from_slice(&[sh, sw, ph, pw, r0, rows])),
                        Arg::I32(images as i32),
                    ],
                )?;
                gemm(
                    dev,
                    &Gemm {
                        m: ncol,
                        a: cols,
                        lda: ncol,
                        stride_a: kdim * ncol,
                        c: out.ptr + ((img0 * o * plane + r0 * ow) * esize) as u64,
                        batch: images,
                        ..base
                    },
                )?;
            }
        }
        Ok(())
    })();
    // The scratch's free (and its reuse) waits for the work queued above.
    dev.allocation(&scratch)?
        .note_use(dev.stream_handle(&compute)?);
    drop(scratch);
    result?;
    out.finish(dev, &inputs)
}

/// The implicit-GEMM path: packs the weights tap-major with channels padded to 32 (a
/// scratch on the compute stream), then one `ddo_conv_igemm_*` launch per 65,535 images.
/// `dims`: n, c, h, w, o, oh, ow, kh, kw.
fn implicit_gemm(
    dev: &CudaDevice,
    xi: &super::In<'_>,
    wi: &super::In<'_>,
    bi: Option<&super::In<'_>>,
    out: &Out,
    dims: [usize; 9],
    params: Conv2dParams,
) -> Result<()> {
    let [n, c, h, wd, o, oh, ow, kh, kw] = dims;
    let (sh, sw) = params.stride;
    let (ph, pw) = params.padding;
    let taps = kh * kw;
    let cp = c.next_multiple_of(32);
    let compute = dev.compute_stream();
    let packed = dev.alloc_on(o * taps * cp * 2, &compute)?;
    let wp = dev.allocation(&packed)?.device_ptr();
    // The channels-last copy of the input, when made.
    let mut transposed: Option<ddo_core::DeviceBuffer> = None;
    let result = (|| -> Result<()> {
        let pack = dev.kernel(SOURCE_NAME, SOURCE, "ddo_conv_pack_weights")?;
        kernels::launch(
            dev,
            &pack,
            kernels::grid_1d((o * taps * cp) as u64, 256),
            &[
                Arg::Ptr(wi.ptr),
                Arg::Ptr(wp),
                Arg::Dims(Dims6::from_slice(&[o, c, taps, cp])),
            ],
        )?;
        let bf16 = xi.dtype == DType::BF16;
        // Channels-last copy of the input when chunks of 8 channels are whole.
        let nhwc = c % 8 == 0;
        let name = match (nhwc, bf16) {
            (true, true) => "ddo_conv_nhwc_igemm_bf16",
            (true, false) => "ddo_conv_nhwc_igemm_f16",
            (false, true) => "ddo_conv_igemm_bf16",
            (false, false) => "ddo_conv_igemm_f16",
        };
        let f = dev.kernel(SOURCE_NAME, SOURCE, name)?;
        let smem = if nhwc { NHWC_SMEM_BYTES } else { 0 };
        let mut x_ptr = xi.ptr;
        if nhwc {
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(|e| {
                crate::error::CudaError::driver("cuFuncSetAttribute", e)
                    .into_core(&dev.id().to_string())
            })?;
            let t = dev.alloc_on(n * c * h * wd * 2, &compute)?;
            x_ptr = dev.allocation(&t)?.device_ptr();
            let tr = dev.kernel(SOURCE_NAME, SOURCE, "ddo_nchw_to_nhwc_b16")?;
            kernels::launch(
                dev,
                &tr,
                LaunchConfig {
                    grid_dim: (
                        (h * wd).div_ceil(32) as u32,
                        c.div_ceil(32) as u32,
                        n.clamp(1, 65_535) as u32,
                    ),
                    block_dim: (32, 8, 1),
                    shared_mem_bytes: 0,
                },
                &[
                    Arg::Ptr(xi.ptr),
                    Arg::Ptr(x_ptr),
                    Arg::I64(c as i64),
                    Arg::I64((h * wd) as i64),
                    Arg::I64(n as i64),
                ],
            )?;
            transposed = Some(t);
        }
        let (bias_ptr, bias_code) = super::opt_ptr(bi);
        let g1 = Dims6::from_slice(&[c, h, wd, o, oh, ow]);
        let g3 = Dims6::from_slice(&[kh, kw, cp]);
        let plane = oh * ow;
        for img0 in (0..n).step_by(65_535) {
            let images = 65_535.min(n - img0);
            kernels::launch(
                dev,
                &f,
                launch_cfg(
                    (
                        plane.div_ceil(128) as u32,
                        o.div_ceil(128) as u32,
                        images as u32,
                    ),
                    256,
                    smem,
                ),
                &[
                    Arg::Ptr(x_ptr),
                    Arg::Ptr(wp),
                    Arg::Ptr(out.ptr),
                    Arg::Ptr(bias_ptr),
                    Arg::I32(bias_code),
                    Arg::Dims(g1),
                    Arg::Dims(Dims6::from_slice(&[sh, sw, ph, pw, img0])),
                    Arg::Dims(g3),
                ],
            )?;
        }
        Ok(())
    })();
    let handle = dev.stream_handle(&compute)?;
    dev.allocation(&packed)?.note_use(handle);
    if let Some(t) = &transposed {
        dev.allocation(t)?.note_use(handle);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_follows_the_path_conv2d_takes() {
        let hw = 1024 * 1024;
        // The Flux VAE's last resnets in bf16: the channels-last copy of the input (as large
        // as the input) and the repacked weights.
        assert_eq!(
            scratch_bytes(hw, 128, 128, 3, DType::BF16),
            hw as u64 * 128 * 2 + 128 * 9 * 128 * 2
        );
        // Channels not a multiple of 8: no channels-last copy, weights padded to 32.
        assert_eq!(scratch_bytes(hw, 3, 16, 3, DType::F16), 16 * 9 * 32 * 2);
        // 1x1: the input is the GEMM operand.
        assert_eq!(scratch_bytes(hw, 512, 256, 1, DType::BF16), 0);
        // f32: the im2col chunk, at most SCRATCH_BYTES.
        assert_eq!(scratch_bytes(64, 4, 4, 3, DType::F32), 64 * 4 * 9 * 4);
        assert_eq!(
            scratch_bytes(hw, 128, 128, 3, DType::F32),
            SCRATCH_BYTES as u64
        );
    }
}
