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
//! runs the reference ([`ddo_core::fp8_compute::linear_fp8_reference`]) instead. So does a
//! device where the path, run once on a small product, disagreed with the reference (the
//! reason is `CudaDevice::cublaslt_refusal`).
//!
//! A NaN or an infinity in the activation is not read back here (that would stop the stream
//! at every linear): its scale becomes NaN, so is the product, and the denoising step's
//! finite check stops the run before anything is written.

use ddo_core::fp8_compute::{linear_fp8_reference, takes_weight};
use ddo_core::rng::signed_values;
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

/// Whether `dev` runs fp8 linears on its tensor cores: compute capability 8.9 or later,
/// cuBLASLt on, and this path agreed with the reference on a small product the first time it
/// was asked on this device ([`self_check`]).
pub(crate) fn tensor_cores(dev: &CudaDevice) -> bool {
    with_reason(dev, |why| why.is_none())
}

/// Why fp8 linears run the reference on `dev` (`None`: they run on its tensor cores).
pub(crate) fn reference_reason(dev: &CudaDevice) -> Option<String> {
    with_reason(dev, |why| why.map(str::to_string))
}

/// `f` of why fp8 linears run the reference on `dev` (`None`: its tensor cores run them).
/// Asked at every fp8 linear: the capability query and the check run once per device, and
/// the answer is kept with its reason (read in place, not copied).
fn with_reason<R>(dev: &CudaDevice, f: impl FnOnce(Option<&str>) -> R) -> R {
    static CHECKED: std::sync::Mutex<Vec<(usize, Option<String>)>> =
        std::sync::Mutex::new(Vec::new());
    if !dev.cublaslt_enabled() {
        return f(Some("cuBLASLt is off or missing on this device"));
    }
    let ordinal = dev.config().ordinal;
    let mut checked = CHECKED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((_, why)) = checked.iter().find(|(o, _)| *o == ordinal) {
        return f(why.as_deref());
    }
    let why = match dev.context().compute_capability() {
        Ok(cc) if cc >= (8, 9) => self_check(dev).err().map(|why| {
            let why = format!("its check of cuBLASLt's E4M3 GEMM failed: {why}");
            super::cublaslt::refuse(format!(
                "fp8 linears run DDO's reference implementation: {why}"
            ));
            why
        }),
        Ok((major, minor)) => Some(format!(
            "compute capability {major}.{minor} has no fp8 tensor cores (8.9 and up have)"
        )),
        Err(e) => Some(format!("its compute capability could not be read: {e}")),
    };
    let out = f(why.as_deref());
    checked.push((ordinal, why));
    out
}

/// Runs this path once on a 48 x 64 x 32 product with a bias against
/// [`ddo_core::fp8_compute::linear_reference`] of the same operands: relative L2 at most
/// 1e-2 (the codes are the same; the sums and the bf16 rounding differ), else why not.
fn self_check(dev: &CudaDevice) -> std::result::Result<(), String> {
    let (rows, k, n) = (48, 64, 32);
    let spread = |seed, n, span: f32| -> Vec<f32> {
        signed_values(seed, n)
            .into_iter()
            .map(|v| v * span)
            .collect()
    };
    let (xv, wv, bv) = (
        spread(1, rows * k, 3.0),
        spread(2, n * k, 200.0),
        spread(3, n, 1.0),
    );
    let scale = 0.0078125;
    let on = |shape: &[usize], dtype: DType, v: &[f32]| -> Result<Tensor> {
        Tensor::from_f32(shape.to_vec(), dtype, v)?.to_device(dev, &dev.compute_stream())
    };
    let run = || -> Result<Option<Vec<f32>>> {
        let x = on(&[rows, k], DType::BF16, &xv)?;
        let w = on(&[n, k], DType::F8E4M3, &wv)?.with_scale(Some(scale))?;
        let b = on(&[n], DType::BF16, &bv)?;
        native(dev, &x, &w, Some(&b), false)?
            .map(|y| ddo_core::Ops::to_f32_vec(dev, &y))
            .transpose()
    };
    let got = run().map_err(|e| e.to_string())?.ok_or_else(|| {
        format!(
            "cuBLASLt refused it: {}",
            super::cublaslt::last_refusal().unwrap_or_default()
        )
    })?;
    // The reference from the operands as stored (bf16 input and bias, E4M3 codes).
    let stored = |dtype: DType, v: &[f32]| {
        Tensor::from_f32(vec![v.len()], dtype, v)
            .and_then(|t| t.host_f32())
            .map_err(|e| e.to_string())
    };
    let want = ddo_core::fp8_compute::linear_reference(
        &stored(DType::BF16, &xv)?,
        k,
        &stored(DType::F8E4M3, &wv)?,
        scale,
        Some(&stored(DType::BF16, &bv)?),
    )
    .ok_or("the reference found a non-finite value")?;
    let num: f64 = got
        .iter()
        .zip(&want)
        .map(|(a, b)| ((a - b) as f64).powi(2))
        .sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    let rel = (num / den).sqrt();
    if rel <= 1e-2 {
        Ok(())
    } else {
        Err(format!(
            "cuBLASLt's E4M3 GEMM gave a relative L2 of {rel:.3e} against it on a check"
        ))
    }
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
    if tensor_cores(dev)
        && let Some(y) = native(dev, x, w, bias, false)?
    {
        return Ok(y);
    }
    linear_fp8_reference(dev, x, w, bias)
}

/// `Ops::linear_fp8_gelu_tanh` on `dev`: the GELU in cuBLASLt's epilogue where the fp8 GEMM
/// takes it, else the fp8 GEMM (or the reference) and the element-wise GELU.
pub(crate) fn linear_fp8_gelu_tanh(
    dev: &CudaDevice,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    if tensor_cores(dev)
        && let Some(y) = native(dev, x, w, bias, true)?
    {
        return Ok(y);
    }
    let y = linear_fp8(dev, x, w, bias)?;
    super::elementwise::unary_owned(dev, y, ddo_core::UnaryOp::GeluTanh)
}

/// The tensor-core path, `gelu_tanh` of the product where `gelu` (cuBLASLt's GELU epilogue is
/// the tanh approximation: `cublaslt.rs`); `None` (nothing queued that matters) where it does
/// not take the operands or cuBLASLt refused.
fn native(
    dev: &CudaDevice,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    gelu: bool,
) -> Result<Option<Tensor>> {
    const OP: &str = "linear_fp8";
    let (xs, ws) = (x.shape(), w.shape());
    let fits = takes_weight(w)
        && matches!(x.dtype(), DType::BF16 | DType::F16)
        && xs.last() == ws.get(1)
        && bias.is_none_or(|b| b.dtype() == x.dtype() && b.shape() == [ws[0]]);
    if !fits {
        return Ok(None);
    }
    let (out_f, in_f) = (ws[0], ws[1]);
    let rows = x.numel() / in_f.max(1);
    // cuBLASLt's fp8 GEMMs want leading dimensions (k for both operands, m for the output)
    // that are multiples of 16.
    if rows == 0 || out_f == 0 || in_f == 0 || in_f % 16 != 0 || out_f % 16 != 0 {
        return Ok(None);
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
        epilogue: Epilogue::new(bi.is_some(), gelu),
        accumulate: false,
        fp8_b_scale: state.ptr + 8,
        alpha: w.scale().unwrap_or(1.0),
        algo: 0,
    };
    let ran = super::gemm::lt_linear(dev, &g)?;
    let mut inputs = vec![&xi, &wi];
    if let Some(b) = &bi {
        inputs.push(b);
    }
    codes.release(dev)?;
    state.release(dev)?;
    let y = out.finish(dev, &inputs)?;
    // Refused (the reason is kept for `cublaslt_refusal`): the output was never written.
    Ok(ran.then_some(y))
}

#[cfg(test)]
mod tests {
    use float8::F8E4M3;

    /// `float_to_e4m3` of `kernels/fp8_compute.cu`, statement for statement (`__float2uint_rn`
    /// rounds half to even): held here to the `float8` crate, which the host reference rounds
    /// with, so that the kernel's codes are the reference's.
    fn kernel_float_to_e4m3(v: f32) -> u8 {
        let sign = (v.to_bits() >> 24) & 0x80;
        let a = v.abs();
        if a.is_nan() {
            return (sign | 0x7f) as u8;
        }
        if a < 0.015625 {
            return (sign | (a * 512.0).round_ties_even() as u32) as u8;
        }
        let mut bits = a.to_bits();
        bits = bits.wrapping_add(0x7ffff + ((bits >> 20) & 1));
        let e = (bits >> 23).wrapping_sub(120);
        let code = (e << 3) | ((bits >> 20) & 7);
        (sign | code.min(0x7e)) as u8
    }

    /// The kernel's clamp (its two comparisons leave a NaN as it is, as `f32::clamp`
    /// does), then its rounding.
    fn kernel_quantize(v: f32, scale: f32) -> u8 {
        kernel_float_to_e4m3((v * scale).clamp(-448.0, 448.0))
    }

    #[test]
    fn the_kernels_rounding_is_the_references_on_every_binade_and_tie() {
        let reference = |v: f32| F8E4M3::from_f32(v.clamp(-448.0, 448.0)).to_bits();
        // Every E4M3 value, the midpoints between neighbours (ties), and a step either side.
        let mut values = Vec::new();
        for code in 0u8..=0x7e {
            let x = F8E4M3::from_bits(code).to_f32();
            let next = F8E4M3::from_bits(code + 1).to_f32();
            let mid = (x + next) / 2.0;
            for v in [
                x,
                mid,
                f32::from_bits(mid.to_bits() - 1),
                f32::from_bits(mid.to_bits() + 1),
            ] {
                values.push(v);
                values.push(-v);
            }
        }
        // A spread of f32s over E4M3's range and beyond it (saturated).
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..200_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let e = (state % 40) as i32 - 20;
            let m = 1.0 + (state >> 40) as f32 / (1u64 << 24) as f32;
            let sign = if state & 1 == 0 { 1.0 } else { -1.0 };
            values.push(sign * m * 2f32.powi(e));
        }
        values.extend([
            0.0,
            -0.0,
            448.0,
            449.0,
            1e30,
            -1e30,
            2f32.powi(-10),
            2f32.powi(-9),
        ]);
        for v in values {
            if v.abs() <= 448.0 || !v.is_finite() {
                assert_eq!(kernel_float_to_e4m3(v), reference(v), "{v:e}");
            }
            assert_eq!(kernel_quantize(v, 1.0), reference(v), "{v:e}");
        }
        // NaN stays NaN through the clamp (the kernel's NaN scale).
        assert_eq!(kernel_quantize(1.0, f32::NAN) & 0x7f, 0x7f);
        // The reference's own quantization (scale applied) agrees with the kernel's.
        for v in [0.3f32, -1.7, 3.1e-3, 250.0] {
            let scale = 448.0 / 3.0f32;
            assert_eq!(
                F8E4M3::from_bits(kernel_quantize(v, scale)).to_f32(),
                ddo_core::fp8_compute::quantize(v, scale)
            );
        }
    }
}
