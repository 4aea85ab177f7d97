//! [`ddo_core::Ops::linear_fp8`] on the CUDA backend (`--compute fp8`, issue 39): on a
//! device with fp8 tensor cores (compute capability 8.9 and up), the activation's amax and
//! E4M3 codes by two kernels (`kernels/fp8_compute.cu`, the codes the host reference's bit
//! for bit), then cuBLASLt's E4M3 GEMM (`cublaslt.rs`: the weight's scale as the A scale
//! read on the device or as `alpha`, the activation's `1 / scale` as the B scale read on the
//! device, the bias in the epilogue, the
//! output in the input's dtype). The products are exact; cuBLASLt sums them in its own order
//! (with fast accumulation, as TorchAO's inference recipe asks), so the result is close to the
//! reference's, not equal.
//!
//! Anything that path does not take — an older device, cuBLASLt missing or refusing the
//! shape, dimensions that are not multiples of 16, an f32 input, a bias of another dtype —
//! runs the reference ([`ddo_core::fp8_compute::linear_fp8_reference`]) instead.
//!
//! Before the first fp8 linear on a device, a one-time check runs a 256 x 512 x 384 product
//! with a bias in each of a few forms ([`FORMS`]: both scales read on the device as PyTorch's
//! `_scaled_mm` reads them or the weight's as `alpha`, fast or exact accumulation, C in place
//! or apart, the bias in the epilogue or added after) and keeps the first that cuBLASLt runs and
//! that agrees with the reference: one H100 with CUDA 13.0's cuBLASLt refused the first
//! form (`CUBLAS_STATUS_NOT_SUPPORTED` from `cublasLtMatmul`, 2026-12-07). Where every form
//! fails, every fp8 linear runs the reference, and `Ops::fp8_reference_reason` lists each
//! form's failure.
//!
//! A NaN or an infinity in the activation is not read back here (that would stop the stream
//! at every linear): its scale becomes NaN, so is the product, and the denoising step's
//! finite check stops the run before anything is written.

use ddo_core::fp8_compute::{linear_fp8_reference, takes_weight};
use ddo_core::rng::signed_values;
use ddo_core::{DType, Device, DeviceBuffer, Result, Tensor, TensorStorage, WeakDeviceBuffer};

use super::cublaslt::{Epilogue, Fp8Form, Fp8Operands, LtLinear};
use super::kernels::{Arg, grid_1d, launch};
use super::{Out, input, optional_vector, stored_input};
use crate::device::CudaDevice;

/// Kernel source name (`kernels::SOURCES`).
pub(crate) const SOURCE_NAME: &str = "fp8_compute.cu";
/// The amax and quantization kernels.
pub(crate) const SOURCE: &str = include_str!("../../kernels/fp8_compute.cu");

const BLOCK: u32 = 256;

/// Most blocks of the amax and quantize kernels: each thread strides over the elements 8 at a
/// time, and the amax kernel's blocks each add one atomic (a grid of one block per 256
/// elements, 55,000 for a 4608 x 3072 activation, queued that many on one address).
const MAX_BLOCKS: u64 = 1024;

/// The launch of the amax and quantize kernels over `n` elements.
fn grid(n: i64) -> cudarc::driver::LaunchConfig {
    let per_block = u64::from(BLOCK) * 8;
    grid_1d(
        (n.max(1) as u64).div_ceil(per_block).min(MAX_BLOCKS) * u64::from(BLOCK),
        BLOCK,
    )
}

/// Bytes of the kernels' state, and where in it the B scale (the activation's `1 / scale`)
/// and the A scale (the weight's) sit: 16-byte boundaries, which cuBLASLt 13.1's E4M3 matmul
/// needs of its scale pointers (at 8 and 12 bytes in it answered `CUBLAS_STATUS_NOT_SUPPORTED`
/// in every form, on one H100, 2026-12-07, while PyTorch's `_scaled_mm` ran).
const STATE_BYTES: usize = 64;
const B_SCALE_AT: u64 = 16;
const A_SCALE_AT: u64 = 32;

/// How this path puts an fp8 linear to cuBLASLt: the GEMM's form, and whether the bias
/// (and a GELU after it) is applied after the GEMM instead of in its epilogue. The first of
/// [`FORMS`] that the one-time check finds running and agreeing with the reference is used
/// for every fp8 linear on that device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Path {
    gemm: Fp8Form,
    bias_apart: bool,
}

/// The forms tried, fastest first: the first is PyTorch's `_scaled_mm` recipe (both scales
/// read on the device, fast accumulation, C in place, the bias in the epilogue); each of the
/// next differs from it in one thing cuBLASLt may refuse for E4M3 operands, the last in all
/// four.
const FORMS: [Path; 6] = [
    form(true, true, false, false),
    form(false, true, false, false),
    form(true, true, true, false),
    form(true, false, false, false),
    form(true, true, false, true),
    form(false, false, true, true),
];

/// A [`Path`] from its four choices.
const fn form(device_scales: bool, fast_accum: bool, c_apart: bool, bias_apart: bool) -> Path {
    Path {
        gemm: Fp8Form {
            fast_accum,
            c_apart,
            device_scales,
        },
        bias_apart,
    }
}

impl Path {
    /// How the run's note and the refusal name it.
    fn describe(&self) -> String {
        format!(
            "{}, {} accumulation, C {}, bias {}",
            if self.gemm.device_scales {
                "both scales on the device"
            } else {
                "the weight's scale as alpha"
            },
            if self.gemm.fast_accum {
                "fast"
            } else {
                "exact"
            },
            if self.gemm.c_apart {
                "apart"
            } else {
                "in place"
            },
            if self.bias_apart {
                "after the GEMM"
            } else {
                "in the epilogue"
            },
        )
    }
}

/// Whether `dev` runs fp8 linears on its tensor cores: compute capability 8.9 or later,
/// cuBLASLt on, and one of [`FORMS`] agreed with the reference on a product the first time
/// it was asked on this device ([`self_check`]).
pub(crate) fn tensor_cores(dev: &CudaDevice) -> bool {
    with_path(dev, |p| p.is_ok())
}

/// Why fp8 linears run the reference on `dev` (`None`: they run on its tensor cores).
pub(crate) fn reference_reason(dev: &CudaDevice) -> Option<String> {
    with_path(dev, |p| p.err().map(str::to_string))
}

/// The form fp8 linears take on `dev`'s tensor cores, if any (the GPU tests print it).
pub(crate) fn path_description(dev: &CudaDevice) -> Option<String> {
    with_path(dev, |p| p.ok().map(Path::describe))
}

/// `f` of how fp8 linears run on `dev`: the form its tensor cores take, or why the reference
/// runs. Asked at every fp8 linear: the capability query and the check run once per device,
/// and the answer is kept (read in place, not copied).
fn with_path<R>(dev: &CudaDevice, f: impl FnOnce(Result<&Path, &str>) -> R) -> R {
    static CHECKED: std::sync::Mutex<Vec<(usize, Result<Path, String>)>> =
        std::sync::Mutex::new(Vec::new());
    if !dev.cublaslt_enabled() {
        return f(Err("cuBLASLt is off or missing on this device"));
    }
    let ordinal = dev.config().ordinal;
    let mut checked = CHECKED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((_, path)) = checked.iter().find(|(o, _)| *o == ordinal) {
        return f(path.as_ref().map_err(String::as_str));
    }
    let path = match dev.context().compute_capability() {
        Ok(cc) if cc >= (8, 9) => {
            let mut failed = Vec::new();
            let mut chosen = None;
            for form in FORMS {
                match self_check(dev, form) {
                    Ok(()) => {
                        chosen = Some(form);
                        break;
                    }
                    Err(why) => failed.push(format!("{}: {why}", form.describe())),
                }
            }
            chosen.ok_or_else(|| {
                let why = format!(
                    "its check of cuBLASLt's E4M3 GEMM failed in every form ({})",
                    failed.join("; ")
                );
                super::cublaslt::refuse(format!(
                    "fp8 linears run DDO's reference implementation: {why}"
                ));
                why
            })
        }
        Ok((major, minor)) => Err(format!(
            "compute capability {major}.{minor} has no fp8 tensor cores (8.9 and up have)"
        )),
        Err(e) => Err(format!("its compute capability could not be read: {e}")),
    };
    let out = f(path.as_ref().map_err(String::as_str));
    checked.push((ordinal, path));
    out
}

/// Runs this path once in `form` on a 256 x 512 x 384 product with a bias (a size every
/// GEMM kernel tiles) against [`ddo_core::fp8_compute::linear_reference`] of the same
/// operands: relative L2 at most 1e-2 (the codes are the same; the sums and the bf16
/// rounding differ), else why not.
fn self_check(dev: &CudaDevice, form: Path) -> std::result::Result<(), String> {
    let (rows, k, n) = (256, 512, 384);
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
        native(dev, &[&x], &w, Some(&b), false, form)?
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

/// An activation's E4M3 codes and the state holding their scale (`kernels/fp8_compute.cu`),
/// kept after the fp8 linear that made them for the next ones that read the same activation
/// (Flux's q, k and v projections, and a single block's MLP input, read one normed input), so
/// it is read and quantized once. It knows the activation by a weak handle to its buffer, so
/// it neither keeps the activation's memory nor lets an op write over it in place while it
/// stands; it goes when another activation is quantized, and at the end of the forward
/// ([`forget_codes`]).
pub(crate) struct Codes {
    /// The activation's buffer; `None` for a host activation (never matched again: dropped
    /// after its one GEMM, `native`).
    of: Option<WeakDeviceBuffer>,
    offset: usize,
    len: usize,
    dtype: DType,
    numel: usize,
    codes: Scratch,
    state: Scratch,
}

impl Codes {
    /// Quantizes `parts` side by side on the last dim (their device inputs `xis`; `width`
    /// the sum of their widths): the state zeroed, the amax of every part into it, then
    /// each part's codes at its columns, and their scale. Only a single part is known again
    /// ([`Codes::reads`]).
    fn of(
        dev: &CudaDevice,
        parts: &[&Tensor],
        xis: &[super::In<'_>],
        width: usize,
    ) -> Result<Self> {
        // The kernels' state: the scales on 16-byte boundaries.
        let state = Scratch::new(dev, STATE_BYTES)?;
        let numel: usize = parts.iter().map(|p| p.numel()).sum();
        let codes = Scratch::new(dev, numel)?;
        super::gemm::zero(dev, state.ptr, STATE_BYTES)?;
        let amax = dev.kernel(SOURCE_NAME, SOURCE, "ddo_fp8_amax")?;
        let quantize = dev.kernel(SOURCE_NAME, SOURCE, "ddo_fp8_quantize")?;
        for xi in xis {
            let n = xi.numel as i64;
            let args = [
                Arg::Ptr(xi.ptr),
                Arg::I32(xi.code),
                Arg::I64(n),
                Arg::Ptr(state.ptr),
            ];
            launch(dev, &amax, grid(n), &args)?;
        }
        // Every amax is in before the first code is written.
        let mut at = 0usize;
        for (p, xi) in parts.iter().zip(xis) {
            let n = xi.numel as i64;
            let cols = p.shape().last().copied().unwrap_or(0);
            let args = [
                Arg::Ptr(xi.ptr),
                Arg::I32(xi.code),
                Arg::I64(n),
                Arg::Ptr(state.ptr),
                Arg::Ptr(codes.ptr),
                Arg::I64(cols as i64),
                Arg::I64(width as i64),
                Arg::I64(at as i64),
            ];
            launch(dev, &quantize, grid(n), &args)?;
            at += cols;
        }
        // The device inputs were read by the kernels just queued.
        super::mark_used(dev, &xis.iter().collect::<Vec<_>>())?;
        let (of, offset, len) = match (parts, parts.first().map(|p| p.storage())) {
            ([_], Some(TensorStorage::Device(s))) => {
                (Some(s.buffer().downgrade()), s.offset(), s.len())
            }
            _ => (None, 0, 0),
        };
        let x = parts.first().copied();
        Ok(Self {
            of,
            offset,
            len,
            dtype: x.map_or(DType::BF16, |x| x.dtype()),
            numel,
            codes,
            state,
        })
    }

    /// Whether these are `x`'s codes: the same live buffer, bytes, dtype and element count.
    fn reads(&self, x: &Tensor) -> bool {
        match x.storage() {
            TensorStorage::Device(s) => {
                self.of.as_ref().is_some_and(|w| w.is(s.buffer()))
                    && s.offset() == self.offset
                    && s.len() == self.len
                    && x.dtype() == self.dtype
                    && x.numel() == self.numel
            }
            TensorStorage::Host(_) => false,
        }
    }

    /// Lets both buffers go after the work queued so far on the compute stream.
    fn release(self, dev: &CudaDevice) -> Result<()> {
        self.codes.release(dev)?;
        self.state.release(dev)
    }
}

/// [`ddo_core::Ops::end_forward`] on `dev`: the kept codes go.
pub(crate) fn forget_codes(dev: &CudaDevice) -> Result<()> {
    match dev.fp8_codes.lock().take() {
        Some(c) => c.release(dev),
        None => Ok(()),
    }
}

/// `Ops::linear_fp8` on `dev` (module docs).
pub(crate) fn linear_fp8(
    dev: &CudaDevice,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    if let Some(form) = with_path(dev, |p| p.ok().copied())
        && let Some(y) = native(dev, &[x], w, bias, false, form)?
    {
        return Ok(y);
    }
    linear_fp8_reference(dev, x, w, bias)
}

/// `Ops::linear_fp8_concat` on `dev`: the parts' codes written side by side (no
/// concatenation of the activation) where the tensor-core path takes them, else the
/// concatenation and one fp8 linear (`fp8_compute::linear_fp8_of_concat`).
pub(crate) fn linear_fp8_concat(
    dev: &CudaDevice,
    xs: &[&Tensor],
    w: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    if let Some(form) = with_path(dev, |p| p.ok().copied())
        && let Some(y) = native(dev, xs, w, bias, false, form)?
    {
        return Ok(y);
    }
    ddo_core::fp8_compute::linear_fp8_of_concat(dev, xs, w, bias)
}

/// `Ops::linear_fp8_gelu_tanh` on `dev`: the GELU in cuBLASLt's epilogue where the fp8 GEMM
/// takes it, else the fp8 GEMM (or the reference) and the element-wise GELU.
pub(crate) fn linear_fp8_gelu_tanh(
    dev: &CudaDevice,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    if let Some(form) = with_path(dev, |p| p.ok().copied())
        && let Some(y) = native(dev, &[x], w, bias, true, form)?
    {
        return Ok(y);
    }
    let y = linear_fp8(dev, x, w, bias)?;
    super::elementwise::unary_owned(dev, y, ddo_core::UnaryOp::GeluTanh)
}

/// The tensor-core path in `form`, `gelu_tanh` of the product where `gelu` (cuBLASLt's GELU
/// epilogue is the tanh approximation: `cublaslt.rs`); `None` (nothing queued that matters)
/// where it does not take the operands or cuBLASLt refused. A form with the bias apart adds
/// the bias (then the GELU) after the GEMM.
fn native(
    dev: &CudaDevice,
    parts: &[&Tensor],
    w: &Tensor,
    bias: Option<&Tensor>,
    gelu: bool,
    form: Path,
) -> Result<Option<Tensor>> {
    const OP: &str = "linear_fp8";
    let Some(&x) = parts.first() else {
        return Ok(None);
    };
    let ws = w.shape();
    let (Some(&out_f), Some(&in_f)) = (ws.first(), ws.get(1)) else {
        return Ok(None);
    };
    // Parts side by side on the last dim: one dtype, the same rows, widths summing to the
    // weight's (the kernel writes each part's codes at its columns; 8 at a time where the
    // widths are multiples of 8).
    let lead = &x.shape()[..x.shape().len().saturating_sub(1)];
    let widths: Vec<usize> = parts
        .iter()
        .map(|p| p.shape().last().copied().unwrap_or(0))
        .collect();
    let fits = takes_weight(w)
        && matches!(x.dtype(), DType::BF16 | DType::F16)
        && parts.iter().all(|p| {
            p.dtype() == x.dtype()
                && !p.shape().is_empty()
                && &p.shape()[..p.shape().len() - 1] == lead
        })
        && widths.iter().sum::<usize>() == in_f
        && bias.is_none_or(|b| b.dtype() == x.dtype() && b.shape() == [out_f]);
    if !fits {
        return Ok(None);
    }
    let rows = x.numel() / widths[0].max(1);
    // cuBLASLt's fp8 GEMMs want leading dimensions (k for both operands, m for the output)
    // that are multiples of 16.
    if rows == 0 || out_f == 0 || in_f == 0 || in_f % 16 != 0 || out_f % 16 != 0 {
        return Ok(None);
    }
    let xis = parts
        .iter()
        .map(|p| input(dev, OP, p))
        .collect::<Result<Vec<_>>>()?;
    let wi = stored_input(dev, w)?;
    let bi = optional_vector(dev, OP, "bias", bias, out_f)?;
    let w_scale = w.scale().unwrap_or(1.0);
    // Held from the weight's scale written into the state to the GEMM queued after it: one
    // caller's scale at a time.
    let mut kept = dev.fp8_codes.lock();
    let made: &Codes = match (&mut *kept, parts) {
        (Some(c), [x]) if c.reads(x) => c,
        (slot, _) => {
            if let Some(old) = slot.take() {
                old.release(dev)?;
            }
            slot.insert(Codes::of(dev, parts, &xis, in_f)?)
        }
    };
    let (codes_ptr, state_ptr) = (made.codes.ptr, made.state.ptr);
    // The weight's scale where the GEMM reads it (the codes' scale stays with them).
    let f = dev.kernel(SOURCE_NAME, SOURCE, "ddo_fp8_weight_scale")?;
    launch(
        dev,
        &f,
        grid_1d(1, 1),
        &[Arg::Ptr(state_ptr), Arg::F32(w_scale)],
    )?;
    let mut shape = lead.to_vec();
    shape.push(out_f);
    let out = Out::new(dev, OP, shape, x.dtype())?;
    let c = if form.gemm.c_apart {
        Some(Scratch::new(dev, rows * out_f * x.dtype().size_in_bytes())?)
    } else {
        None
    };
    // The epilogue's bias (and the GELU after it) unless the form applies them after.
    let fused_bias = bi.is_some() && !form.bias_apart;
    let g = LtLinear {
        m: out_f,
        n: rows,
        k: in_f,
        w: wi.ptr,
        x: codes_ptr,
        out: out.ptr,
        bias: if fused_bias {
            bi.as_ref().map_or(0, |b| b.ptr)
        } else {
            0
        },
        dtype: x.dtype(),
        epilogue: Epilogue::new(fused_bias, gelu && (fused_bias || bi.is_none())),
        accumulate: false,
        fp8: Some(Fp8Operands {
            b_scale: state_ptr + B_SCALE_AT,
            a_scale: state_ptr + A_SCALE_AT,
            form: form.gemm,
            c: c.as_ref().map_or(0, |c| c.ptr),
        }),
        alpha: if form.gemm.device_scales {
            1.0
        } else {
            w_scale
        },
        algo: 0,
    };
    let ran = super::gemm::lt_linear(dev, &g)?;
    let mut inputs: Vec<_> = xis.iter().collect();
    inputs.push(&wi);
    if let Some(b) = &bi {
        inputs.push(b);
    }
    // Codes that cannot be known again (several parts, or a host activation) go now.
    if kept.as_ref().is_some_and(|c| c.of.is_none())
        && let Some(made) = kept.take()
    {
        made.release(dev)?;
    }
    drop(kept);
    if let Some(c) = c {
        c.release(dev)?;
    }
    let y = out.finish(dev, &inputs)?;
    // Refused (the reason is kept for `cublaslt_refusal`): the output was never written.
    if !ran {
        return Ok(None);
    }
    match bias {
        Some(b) if !fused_bias => {
            let y = super::elementwise::binary(dev, &y, b, ddo_core::BinaryOp::Add)?;
            Ok(Some(if gelu {
                super::elementwise::unary_owned(dev, y, ddo_core::UnaryOp::GeluTanh)?
            } else {
                y
            }))
        }
        _ => Ok(Some(y)),
    }
}

#[cfg(test)]
mod tests {
    use float8::F8E4M3;

    use super::{A_SCALE_AT, B_SCALE_AT, FORMS, Path, SOURCE, STATE_BYTES};

    /// The scales the GEMM reads sit where the quantize kernel writes them, on the 16-byte
    /// boundaries cuBLASLt 13.1 needs, inside the state the kernels are given.
    #[test]
    fn the_scales_are_where_the_kernel_writes_them_on_16_byte_boundaries() {
        for (at, value) in [(B_SCALE_AT, "1.0f / scale"), (A_SCALE_AT, "w_scale")] {
            assert!(
                at.is_multiple_of(16) && at + 4 <= STATE_BYTES as u64,
                "{at}"
            );
            let write = format!("state[{}] = __float_as_uint({value});", at / 4);
            assert!(
                SOURCE.contains(&write),
                "the kernel does not write `{write}`"
            );
        }
        assert_ne!(A_SCALE_AT, B_SCALE_AT);
        // The amax and the non-finite flag (words 0 and 1) are not under either scale.
        assert!(A_SCALE_AT.min(B_SCALE_AT) >= 8);
    }

    #[test]
    fn the_forms_are_distinct_fastest_first_and_each_changes_one_thing_or_all() {
        let first = FORMS[0];
        assert!(
            first.gemm.device_scales
                && first.gemm.fast_accum
                && !first.gemm.c_apart
                && !first.bias_apart
        );
        let changes = |p: &Path| {
            [
                p.gemm.device_scales != first.gemm.device_scales,
                p.gemm.fast_accum != first.gemm.fast_accum,
                p.gemm.c_apart != first.gemm.c_apart,
                p.bias_apart != first.bias_apart,
            ]
            .iter()
            .filter(|c| **c)
            .count()
        };
        for (i, a) in FORMS.iter().enumerate() {
            assert!(FORMS[..i].iter().all(|b| b != a), "{} twice", a.describe());
            if i > 0 && i + 1 < FORMS.len() {
                assert_eq!(changes(a), 1, "{}", a.describe());
            }
        }
        assert_eq!(changes(&FORMS[FORMS.len() - 1]), 4);
        assert_eq!(
            first.describe(),
            "both scales on the device, fast accumulation, C in place, bias in the epilogue"
        );
    }

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
