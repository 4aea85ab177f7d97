//! [`ddo_core::Ops::linear_fp8`] on the CUDA backend (`--compute fp8`, issue 39): on a
//! device with fp8 tensor cores (compute capability 8.9 and up), the activation's amax and
//! E4M3 codes by two kernels (`kernels/fp8_compute.cu`, the codes the host reference's bit
//! for bit), then cuBLASLt's E4M3 GEMM (`cublaslt.rs`: the weight's scale as `alpha`, the
//! activation's `1 / scale` as the B scale read on the device, the bias in the epilogue, the
//! output in the input's dtype). The products are exact; cuBLASLt sums them in its own order
//! (with fast accumulation, as TorchAO's inference recipe asks), so the result is close to the
//! reference's, not equal.
//!
//! Anything that path does not take — an older device, cuBLASLt missing or refusing the
//! shape, dimensions that are not multiples of 16, an f32 input, a bias of another dtype —
//! runs the reference ([`ddo_core::fp8_compute::linear_fp8_reference`]) instead.
//!
//! A NaN or an infinity in the activation is not read back here (that would stop the stream
//! at every linear): its scale becomes NaN, so is the product, and the denoising step's
//! finite check stops the run before anything is written.

use ddo_core::fp8_compute::{linear_fp8_reference, takes_weight};
use ddo_core::{DType, Device, DeviceBuffer, Result, Tensor};

use super::cublaslt::{Epilogue, LtLinear};
use super::kernels::{Arg, grid_1d, launch};
use super::{Out, input, optional_vector, stored_input};
use crate::device::CudaDevice;

/// Kernel source name (`kernels::SOURCES`).
pub(crate) const SOURCE_NAME: &str = "fp8_compute.cu";
/// The amax and quantization kernels.
pub(crate) const SOURCE: &str = include_str!("../../kernels/fp8_compute.cu");

const BLOCK: u32 = 256;

/// Whether `dev` has fp8 tensor cores (compute capability 8.9 or later) and cuBLASLt is on.
pub(crate) fn tensor_cores(dev: &CudaDevice) -> bool {
    dev.cublaslt_enabled()
        && dev
            .context()
            .compute_capability()
            .is_ok_and(|cc| cc >= (8, 9))
}

/// A scratch allocation of the compute stream, freed in stream order after the work that
/// used it.
struct Scratch {
    buffer: DeviceBuffer,
    ptr: u64,
}

impl Scratch {
    fn new(dev: &CudaDevice, bytes: usize) -> Result<Self> {
        let buffer = dev.alloc_on(bytes.max(1), &dev.compute_stream())?;
        let ptr = dev.allocation(&buffer)?.device_ptr();
        Ok(Self { buffer, ptr })
    }

    /// Marks it used by the work queued so far on the compute stream, then lets it go.
    fn release(self, dev: &CudaDevice) -> Result<()> {
        let compute = dev.compute_stream();
        let s = dev.stream_handle(&compute)?;
        dev.allocation(&self.buffer)?.note_use(s);
        Ok(())
    }
}

/// `Ops::linear_fp8` on `dev` (module docs).
pub(crate) fn linear_fp8(
    dev: &CudaDevice,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    const OP: &str = "linear_fp8";
    let (xs, ws) = (x.shape(), w.shape());
    let fits = takes_weight(w)
        && matches!(x.dtype(), DType::BF16 | DType::F16)
        && xs.last() == ws.get(1)
        && bias.is_none_or(|b| b.dtype() == x.dtype() && b.shape() == [ws[0]]);
    if !fits || !tensor_cores(dev) {
        return linear_fp8_reference(dev, x, w, bias);
    }
    let (out_f, in_f) = (ws[0], ws[1]);
    let rows = x.numel() / in_f.max(1);
    // cuBLASLt's fp8 GEMMs want leading dimensions (k for both operands, m for the output)
    // that are multiples of 16.
    if rows == 0 || out_f == 0 || in_f == 0 || in_f % 16 != 0 || out_f % 16 != 0 {
        return linear_fp8_reference(dev, x, w, bias);
    }
    let xi = input(dev, OP, x)?;
    let wi = stored_input(dev, w)?;
    let bi = optional_vector(dev, OP, "bias", bias, out_f)?;
    let state = Scratch::new(dev, 16)?;
    let codes = Scratch::new(dev, x.numel())?;
    super::gemm::zero(dev, state.ptr, 16)?;
    let n = x.numel() as i64;
    for name in ["ddo_fp8_amax", "ddo_fp8_quantize"] {
        let f = dev.kernel(SOURCE_NAME, SOURCE, name)?;
        let mut args = vec![
            Arg::Ptr(xi.ptr),
            Arg::I32(xi.code),
            Arg::I64(n),
            Arg::Ptr(state.ptr),
        ];
        if name == "ddo_fp8_quantize" {
            args.push(Arg::Ptr(codes.ptr));
        }
        launch(dev, &f, grid_1d(n as u64, BLOCK), &args)?;
    }
    let mut shape = xs.to_vec();
    let last = shape.len() - 1;
    shape[last] = out_f;
    let out = Out::new(dev, OP, shape, x.dtype())?;
    let g = LtLinear {
        m: out_f,
        n: rows,
        k: in_f,
        w: wi.ptr,
        x: codes.ptr,
        out: out.ptr,
        bias: bi.as_ref().map_or(0, |b| b.ptr),
        dtype: x.dtype(),
        epilogue: Epilogue::new(bi.is_some(), false),
        accumulate: false,
        fp8_b_scale: state.ptr + 8,
        alpha: w.scale().unwrap_or(1.0),
    };
    let ran = super::gemm::lt_linear(dev, &g)?;
    let mut inputs = vec![&xi, &wi];
    if let Some(b) = &bi {
        inputs.push(b);
    }
    codes.release(dev)?;
    state.release(dev)?;
    if !ran {
        // cuBLASLt refused (the reason is kept for `cublaslt_refusal`): the output was never
        // written; the reference instead.
        drop(out.finish(dev, &inputs)?);
        return linear_fp8_reference(dev, x, w, bias);
    }
    out.finish(dev, &inputs)
}
