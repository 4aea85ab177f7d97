//! Linear layers and matrix products of the CUDA backend, on cuBLAS and cuBLASLt — and the
//! GEMM helper the convolution and the chunked attention path use.
//!
//! # cuBLAS state
//!
//! The table of cuBLAS handles and workspaces is `state.rs`'s (one handle per device, a
//! 32 MiB workspace each, cuBLASLt plans beside them).
//!
//! # Numerics
//!
//! Row-major operands are passed to column-major cuBLAS as their transposes (no copies):
//! `C = A·B` row-major is `Cᵀ = Bᵀ·Aᵀ` column-major. f16/bf16 products run on tensor cores
//! with f32 accumulation (`CUBLAS_COMPUTE_32F`); f32 products use
//! `CUBLAS_COMPUTE_32F_PEDANTIC` (plain f32 math: no TF32, no reduced-precision emulation),
//! so they match the host reference to f32 rounding. A 16-bit linear whose operands (and
//! bias) share one dtype runs on cuBLASLt with the bias — and for `linear_gelu_tanh` the
//! GELU — in the GEMM's epilogue (`cublaslt.rs`); where cuBLASLt is off, missing or refuses
//! the shape, and for f32, a bias seeds the output (`ddo_fill_bias` of `kernels/conv.cu`)
//! and cuBLAS adds the product with `beta = 1`. Either way the result is rounded once into
//! the output dtype. Operands of different dtypes are cast to f32 first (exact),
//! multiplied in f32, and the result cast to the first input's dtype.
//!
//! Matmul broadcasting: with a shared right-hand matrix, `a`'s batch folds into the rows of
//! one GEMM; otherwise batch dims are coalesced and the innermost becomes one strided-batched
//! GEMM (stride 0 where an operand broadcasts), looped over the outer ones.

use cudarc::cublas::sys as cublas;
use cudarc::driver::LaunchConfig;
use ddo_core::{DType, Device, Ops, Result, Tensor};

use super::cublaslt::{self, Epilogue, LtLinear, LtState};
use super::kernels::{self, Arg};
use super::{Out, broadcast_strides, coalesce, input, optional_vector, shape_err};
use crate::device::CudaDevice;

mod state;

use state::{WORKSPACE_BYTES, backend, blas_err, with_blas, with_entry};
pub(crate) use state::{destroy_dead_handles, forget_lt_plans, lt_plans, try_destroy_dead_handles};

/// Name of the kernel source of the GEMM helpers and the convolution (bias fill, im2col).
pub(crate) const SOURCE_NAME: &str = "conv.cu";
/// The kernel source (`kernels/conv.cu`).
pub(crate) const SOURCE: &str = include_str!("../../../kernels/conv.cu");

/// The cuBLAS data type of a float dtype.
fn data_type(dtype: DType) -> cublas::cudaDataType {
    match dtype {
        DType::F16 => cublas::cudaDataType::CUDA_R_16F,
        DType::BF16 => cublas::cudaDataType::CUDA_R_16BF,
        _ => cublas::cudaDataType::CUDA_R_32F,
    }
}

/// One (strided-batched) GEMM in cuBLAS's column-major terms:
/// `C[i] = alpha · op(A[i]) · op(B[i]) + beta · C[i]` for `i < batch`, `op(A)` `m × k`,
/// `op(B)` `k × n`, `C` `m × n` with leading dimension `ldc`; addresses are device
/// addresses, leading dimensions and strides in elements.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Gemm {
    /// `op(A) = Aᵀ`.
    pub trans_a: bool,
    /// `op(B) = Bᵀ`.
    pub trans_b: bool,
    /// Rows of `op(A)` and `C`.
    pub m: usize,
    /// Columns of `op(B)` and `C`.
    pub n: usize,
    /// Columns of `op(A)`, rows of `op(B)`.
    pub k: usize,
    /// `A`.
    pub a: u64,
    /// Leading dimension of `A`.
    pub lda: usize,
    /// Elements between consecutive `A[i]` (0: shared).
    pub stride_a: usize,
    /// `B`.
    pub b: u64,
    /// Leading dimension of `B`.
    pub ldb: usize,
    /// Elements between consecutive `B[i]` (0: shared).
    pub stride_b: usize,
    /// `C`.
    pub c: u64,
    /// Leading dimension of `C`.
    pub ldc: usize,
    /// Elements between consecutive `C[i]`.
    pub stride_c: usize,
    /// Number of products.
    pub batch: usize,
    /// Dtype of `A` and `B`.
    pub ab: DType,
    /// Dtype of `C`.
    pub c_dtype: DType,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of `C`'s previous contents (0: overwritten).
    pub beta: f32,
}

fn int(dev: &CudaDevice, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        backend(
            dev,
            format!("GEMM {what} = {v} exceeds cuBLAS's 32-bit limit"),
        )
    })
}

/// Queues `g` on `dev`'s compute stream.
///
/// Contract (kept by the callers): every address is a live allocation of `dev` holding the
/// elements the GEMM touches with these dimensions, leading dimensions and strides, each
/// marked with `note_use(compute)` before it can be dropped.
pub(crate) fn gemm(dev: &CudaDevice, g: &Gemm) -> Result<()> {
    if g.m == 0 || g.n == 0 || g.batch == 0 {
        return Ok(());
    }
    let (m, n, k) = (
        int(dev, "m", g.m)?,
        int(dev, "n", g.n)?,
        int(dev, "k", g.k)?,
    );
    let (lda, ldb, ldc) = (
        int(dev, "lda", g.lda.max(1))?,
        int(dev, "ldb", g.ldb.max(1))?,
        int(dev, "ldc", g.ldc.max(1))?,
    );
    let batch = int(dev, "batch", g.batch)?;
    let stride = |s: usize| i64::try_from(s).unwrap_or(i64::MAX);
    let op = |t: bool| {
        if t {
            cublas::cublasOperation_t::CUBLAS_OP_T
        } else {
            cublas::cublasOperation_t::CUBLAS_OP_N
        }
    };
    let compute = if g.ab == DType::F32 {
        cublas::cublasComputeType_t::CUBLAS_COMPUTE_32F_PEDANTIC
    } else {
        cublas::cublasComputeType_t::CUBLAS_COMPUTE_32F
    };
    let (alpha, beta) = (g.alpha, g.beta);
    let (ab, ct) = (data_type(g.ab), data_type(g.c_dtype));
    with_blas(dev, |handle| {
        let status = if g.batch == 1 {
            // SAFETY: by this function's contract the three matrices are live device ranges
            // of this context of the sizes the dimensions and leading dimensions describe;
            // alpha and beta are host f32 values (the handle's default host pointer mode,
            // f32 scalars for CUBLAS_COMPUTE_32F*) read before the call returns.
            unsafe {
                cublas::cublasGemmEx(
                    handle,
                    op(g.trans_a),
                    op(g.trans_b),
                    m,
                    n,
                    k,
                    (&alpha as *const f32).cast(),
                    g.a as *const std::ffi::c_void,
                    ab,
                    lda,
                    g.b as *const std::ffi::c_void,
                    ab,
                    ldb,
                    (&beta as *const f32).cast(),
                    g.c as *mut std::ffi::c_void,
                    ct,
                    ldc,
                    compute,
                    cublas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
        } else {
            // SAFETY: as above, for `batch` matrices of each operand at the given strides.
            unsafe {
                cublas::cublasGemmStridedBatchedEx(
                    handle,
                    op(g.trans_a),
                    op(g.trans_b),
                    m,
                    n,
                    k,
                    (&alpha as *const f32).cast(),
                    g.a as *const std::ffi::c_void,
                    ab,
                    lda,
                    stride(g.stride_a),
                    g.b as *const std::ffi::c_void,
                    ab,
                    ldb,
                    stride(g.stride_b),
                    (&beta as *const f32).cast(),
                    g.c as *mut std::ffi::c_void,
                    ct,
                    ldc,
                    stride(g.stride_c),
                    batch,
                    compute,
                    cublas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
        };
        status
            .result()
            .map_err(|e| blas_err(dev, "cublasGemmEx", e))
    })
}

/// Seeds the output `[rows, cols]` at `out` (dtype code `out_code`) with a bias:
/// `out[r][c] = bias[c]` (`per_row == false`, linear) or `bias[r % channels]` (`per_row`,
/// convolution: rows are images × channels).
#[allow(clippy::too_many_arguments)]
pub(crate) fn fill_bias(
    dev: &CudaDevice,
    out: u64,
    out_code: i32,
    bias: &super::In<'_>,
    rows: usize,
    cols: usize,
    channels: usize,
    per_row: bool,
) -> Result<()> {
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let f = dev.kernel(SOURCE_NAME, SOURCE, "ddo_fill_bias")?;
    // About 1024 blocks in all (a few per SM), each thread writing many elements.
    let gx = cols.div_ceil(256).clamp(1, 1024);
    let gy = (1024 / gx).clamp(1, rows.min(65_535));
    let grid = (gx as u32, gy as u32, 1);
    kernels::launch(
        dev,
        &f,
        launch_cfg(grid, 256, 0),
        &[
            Arg::Ptr(out),
            Arg::I32(out_code),
            Arg::Ptr(bias.ptr),
            Arg::I32(bias.code),
            Arg::I64(rows as i64),
            Arg::I64(cols as i64),
            Arg::I64(channels.max(1) as i64),
            Arg::I32(i32::from(per_row)),
        ],
    )
}

/// Zeroes `bytes` at `ptr` on the compute stream.
pub(crate) fn zero(dev: &CudaDevice, ptr: u64, bytes: usize) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    let stream = kernels::compute_stream(dev)?;
    stream.context().bind_to_thread().map_err(|e| {
        crate::error::CudaError::driver("cuCtxSetCurrent", e).into_core(&dev.id().to_string())
    })?;
    // SAFETY: `ptr..ptr + bytes` is a live allocation of this context (the caller's output,
    // marked with `note_use(compute)` before it can be dropped); the memset is queued on the
    // compute stream, which belongs to the bound context.
    unsafe { cudarc::driver::result::memset_d8_async(ptr, 0, bytes, stream.cu_stream()) }.map_err(
        |e| crate::error::CudaError::driver("cuMemsetD8Async", e).into_core(&dev.id().to_string()),
    )
}

/// A 1-D launch with the grid given in blocks (for kernels that grid-stride).
pub(crate) fn launch_cfg(grid: (u32, u32, u32), block: u32, smem: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem,
    }
}

fn product(dims: &[usize]) -> usize {
    dims.iter().product()
}

/// Casts `t` to f32 (a new tensor; exact for every float dtype).
fn to_f32(dev: &CudaDevice, t: &Tensor) -> Result<Tensor> {
    Ops::cast(dev, t, DType::F32)
}

/// The rows of a linear's output: `m` rows of `out_f` elements of `dtype`.
struct Rows {
    m: usize,
    out_f: usize,
    dtype: DType,
}

impl Rows {
    /// `out [m, out_f] = x [m, k] · W[:, window]ᵀ + beta · out`, where the window's rows
    /// start at `w` with a stride of `lda` elements and `x` is contiguous: in column-major
    /// terms `Cᵀ [out, m] = W [out, k] · Xᵀ [k, m]`, in chunks of rows that fit cuBLAS's
    /// 32-bit sizes.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        dev: &CudaDevice,
        w: u64,
        lda: usize,
        k: usize,
        x: u64,
        out: u64,
        beta: f32,
    ) -> Result<()> {
        let esize = self.dtype.size_in_bytes();
        let rows_max = (i32::MAX as usize / self.out_f.max(lda)).max(1);
        let mut r0 = 0;
        while r0 < self.m {
            let rows = rows_max.min(self.m - r0);
            gemm(
                dev,
                &Gemm {
                    trans_a: true,
                    trans_b: false,
                    m: self.out_f,
                    n: rows,
                    k,
                    a: w,
                    lda,
                    stride_a: 0,
                    b: x + (r0 * k * esize) as u64,
                    ldb: k,
                    stride_b: 0,
                    c: out + (r0 * self.out_f * esize) as u64,
                    ldc: self.out_f,
                    stride_c: 0,
                    batch: 1,
                    ab: self.dtype,
                    c_dtype: self.dtype,
                    alpha: 1.0,
                    beta,
                },
            )?;
            r0 += rows;
        }
        Ok(())
    }
}

/// Queues `g` on cuBLASLt (`cublaslt.rs`) on the compute stream, with the device's
/// workspace: `Ok(false)` — nothing queued, the reason kept for
/// [`CudaDevice::cublaslt_refusal`] — when cuBLASLt is switched off, missing, or does not
/// take the shape.
///
/// Contract (kept by the callers): `g`'s addresses are live allocations of `dev` holding
/// the elements its dimensions describe, each marked with `note_use(compute)` before it can
/// be dropped.
pub(super) fn lt_linear(dev: &CudaDevice, g: &LtLinear) -> Result<bool> {
    if !dev.cublaslt_enabled() {
        return Ok(false);
    }
    let stream = kernels::compute_stream(dev)?;
    let outcome = with_entry(dev, |entry| {
        let (ws, ws_bytes) = match &entry.workspace {
            Some(b) => (dev.allocation(b)?.device_ptr(), WORKSPACE_BYTES),
            None => (0, 0),
        };
        // The context is bound (`with_entry`): the handle may be created here.
        match entry.lt.get_or_insert_with(LtState::create) {
            Ok(state) => Ok(state.run(
                g,
                ws,
                ws_bytes,
                stream.cu_stream() as cudarc::cublaslt::sys::cudaStream_t,
            )),
            Err(why) => Ok(Err(why.clone())),
        }
    })?;
    match outcome {
        Ok(()) => {
            dev.note_cublaslt();
            Ok(true)
        }
        Err(why) => {
            cublaslt::refuse(why);
            Ok(false)
        }
    }
}

/// Algorithms of cuBLASLt's heuristic tried by [`best_linear_seconds`].
const SEARCHED_ALGORITHMS: u8 = 8;

/// The fastest of the first [`SEARCHED_ALGORITHMS`] algorithms cuBLASLt's heuristic offers
/// for `linear` at `shape` (16-bit operands; `ddo bench`'s compute floor): each warmed up
/// once, then `calls` calls timed by events on the compute stream; seconds per call and the
/// algorithm's rank. `None` where cuBLASLt is off, missing or refuses the shape, or for f32.
pub(crate) fn best_linear_seconds(
    dev: &CudaDevice,
    shape: &ddo_core::GemmShape,
    calls: usize,
) -> Result<Option<(f64, u8)>> {
    if !dev.cublaslt_enabled() || !matches!(shape.dtype, DType::F16 | DType::BF16) {
        return Ok(None);
    }
    let (rows, k, n) = (shape.rows, shape.k, shape.n);
    let xv = ddo_core::rng::signed_values(1, rows * k);
    let wv = ddo_core::rng::signed_values(2, n * k);
    let x = Ops::tensor_from_f32(dev, &[rows, k], shape.dtype, &xv)?;
    let w = Ops::tensor_from_f32(dev, &[n, k], shape.dtype, &wv)?;
    let (xi, wi) = (input(dev, "linear", &x)?, input(dev, "linear", &w)?);
    let out = Out::new(dev, "linear", vec![rows, n], shape.dtype)?;
    let stream = dev.compute_stream();
    let mut best: Option<(f64, u8)> = None;
    for algo in 0..SEARCHED_ALGORITHMS {
        let g = LtLinear {
            m: n,
            n: rows,
            k,
            w: wi.ptr,
            x: xi.ptr,
            out: out.ptr,
            bias: 0,
            dtype: shape.dtype,
            epilogue: Epilogue::Plain,
            accumulate: false,
            fp8: None,
            alpha: 1.0,
            algo,
        };
        if !lt_linear(dev, &g)? {
            break; // no algorithm of this rank (or a refusal): the search ends
        }
        let start = Device::record_timed_event(dev, &stream)?;
        let mut ran = true;
        for _ in 0..calls {
            ran &= lt_linear(dev, &g)?;
        }
        let end = Device::record_timed_event(dev, &stream)?;
        Device::synchronize_event(dev, &end)?;
        let Some(ns) = Device::event_elapsed_ns(dev, &start, &end)? else {
            break;
        };
        let seconds = ns.max(1) as f64 / 1e9 / calls.max(1) as f64;
        if ran && best.is_none_or(|(b, _)| seconds < b) {
            best = Some((seconds, algo));
        }
    }
    drop(out.finish(dev, &[&xi, &wi])?);
    Ok(best)
}

/// For a linear whose weight or bias is stored as an 8-bit float, both decoded exactly into
/// new tensors of `x`'s dtype (freed in stream order after the GEMM); `None` otherwise.
#[allow(clippy::type_complexity)] // the pair a linear takes
fn fp8_operands(
    dev: &CudaDevice,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Option<(Tensor, Option<Tensor>)>> {
    let b_fp8 = bias.is_some_and(|b| b.dtype().is_fp8());
    if !w.dtype().is_fp8() && !b_fp8 {
        return Ok(None);
    }
    let to = |t: &Tensor| -> Result<Tensor> {
        if t.dtype().is_fp8() {
            super::elementwise::fp8_upcast(dev, t, x.dtype())
        } else {
            Ok(t.clone())
        }
    };
    let w = to(w)?;
    let bias = bias.map(to).transpose()?;
    Ok(Some((w, bias)))
}

/// `Ops::linear` on `dev`: `x [..., in] · wᵀ (+ bias)` with `w [out, in]`.
pub(crate) fn linear(
    dev: &CudaDevice,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    linear_impl(dev, x, w, bias, false).map(|(y, _)| y)
}

/// `Ops::linear_gelu_tanh` on `dev`: `gelu_tanh(x [..., in] · wᵀ (+ bias))`, the GELU in
/// cuBLASLt's epilogue where it takes the linear (its GELU is the tanh approximation: see
/// `cublaslt.rs`), else [`linear`] followed by the in-place element-wise GELU.
pub(crate) fn linear_gelu_tanh(
    dev: &CudaDevice,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    let (y, fused) = linear_impl(dev, x, w, bias, true)?;
    if fused {
        Ok(y)
    } else {
        super::elementwise::unary_owned(dev, y, ddo_core::UnaryOp::GeluTanh)
    }
}

/// The linear, with the GELU applied in cuBLASLt's epilogue when `gelu` and cuBLASLt ran
/// it: returns the output and whether the GELU was applied.
fn linear_impl(
    dev: &CudaDevice,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    gelu: bool,
) -> Result<(Tensor, bool)> {
    const OP: &str = "linear";
    if let Some((w, bias)) = fp8_operands(dev, x, w, bias)? {
        // fp8 storage (issue 18): the weight (and bias) decoded into scratch of the input's
        // dtype, then the same GEMM as a 16-bit weight.
        return linear_impl(dev, x, &w, bias.as_ref(), gelu);
    }
    let (xs, ws) = (x.shape(), w.shape());
    if xs.is_empty() || ws.len() != 2 || xs[xs.len() - 1] != ws[1] {
        return Err(shape_err(
            OP,
            format!("x {xs:?} and w {ws:?}: expected x [..., in] and w [out, in]"),
        ));
    }
    let (out_f, in_f) = (ws[0], ws[1]);
    let xi = input(dev, OP, x)?;
    let wi = input(dev, OP, w)?;
    let bi = optional_vector(dev, OP, "bias", bias, out_f)?;
    if xi.dtype != wi.dtype {
        let y = linear(dev, &to_f32(dev, x)?, &to_f32(dev, w)?, bias)?;
        return if x.dtype() == DType::F32 {
            Ok((y, false))
        } else {
            Ok((Ops::cast(dev, &y, x.dtype())?, false))
        };
    }
    let m = product(&xs[..xs.len() - 1]);
    let mut shape = xs.to_vec();
    shape[xs.len() - 1] = out_f;
    let out = Out::new(dev, OP, shape, x.dtype())?;
    let mut inputs = vec![&xi, &wi];
    if let Some(b) = &bi {
        inputs.push(b);
    }
    // 16-bit operands of one dtype (the bias too): cuBLASLt, the bias (and the GELU) in the
    // epilogue. f32 stays on cuBLAS's pedantic path (exact against the host).
    let lt_dtype = matches!(x.dtype(), DType::F16 | DType::BF16)
        && bi.as_ref().is_none_or(|b| b.dtype == x.dtype());
    if lt_dtype && m > 0 && out_f > 0 && in_f > 0 {
        let g = LtLinear {
            m: out_f,
            n: m,
            k: in_f,
            w: wi.ptr,
            x: xi.ptr,
            out: out.ptr,
            bias: bi.as_ref().map_or(0, |b| b.ptr),
            dtype: x.dtype(),
            epilogue: Epilogue::new(bi.is_some(), gelu),
            accumulate: false,
            fp8: None,
            alpha: 1.0,
            algo: 0,
        };
        if lt_linear(dev, &g)? {
            return Ok((out.finish(dev, &inputs)?, gelu));
        }
    }
    let total = m * out_f;
    let beta = match &bi {
        Some(b) => {
            fill_bias(dev, out.ptr, out.code, b, m, out_f, out_f, false)?;
            1.0
        }
        None => 0.0,
    };
    if in_f == 0 {
        if bi.is_none() {
            zero(dev, out.ptr, total * out.dtype.size_in_bytes())?;
        }
    } else {
        let rows = Rows {
            m,
            out_f,
            dtype: x.dtype(),
        };
        rows.gemm(dev, wi.ptr, in_f, in_f, xi.ptr, out.ptr, beta)?;
    }
    Ok((out.finish(dev, &inputs)?, false))
}

/// `Ops::linear_accumulate` on `dev`: `epilogue(acc + x [..., in] · wᵀ + bias)` written
/// over `acc`'s own bytes and rounded once, where `acc` is exclusively held and `x`, `w`,
/// `acc` (and the bias) share one dtype: a 16-bit one on cuBLASLt with `beta = 1`, the bias
/// and the GELU in the epilogue; f32 (or a shape cuBLASLt refuses) without a bias as one
/// cuBLAS GEMM with `beta = 1`, then the in-place GELU. Otherwise — a shared `acc`, mixed
/// dtypes, a bias off cuBLASLt — the default's composition ([`linear`], the element-wise
/// add, the GELU). 8-bit float weights are decoded first, as [`linear`] decodes them.
pub(crate) fn linear_accumulate(
    dev: &CudaDevice,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    mut acc: Tensor,
    gelu: bool,
) -> Result<Tensor> {
    const OP: &str = "linear_accumulate";
    if let Some((w, bias)) = fp8_operands(dev, x, w, bias)? {
        return linear_accumulate(dev, x, &w, bias.as_ref(), acc, gelu);
    }
    let (xs, ws) = (x.shape(), w.shape());
    if xs.is_empty() || ws.len() != 2 || xs[xs.len() - 1] != ws[1] {
        return Err(shape_err(
            OP,
            format!("x {xs:?} and w {ws:?}: expected x [..., in] and w [out, in]"),
        ));
    }
    let (out_f, in_f) = (ws[0], ws[1]);
    let mut want = xs.to_vec();
    want[xs.len() - 1] = out_f;
    let dtype = x.dtype();
    let one_dtype = w.dtype() == dtype && acc.dtype() == dtype;
    let bias_fits = bias.is_none_or(|b| b.dtype() == dtype);
    let m = product(&xs[..xs.len() - 1]);
    let composed = |acc: Tensor| -> Result<Tensor> {
        // Broadcasts (and refuses) as `binary` does.
        let y = linear(dev, x, w, bias)?;
        let y = super::elementwise::binary(dev, &acc, &y, ddo_core::BinaryOp::Add)?;
        if gelu {
            super::elementwise::unary_owned(dev, y, ddo_core::UnaryOp::GeluTanh)
        } else {
            Ok(y)
        }
    };
    if acc.shape() != want.as_slice()
        || !one_dtype
        || !bias_fits
        || m == 0
        || out_f == 0
        || in_f == 0
        || !acc.has_exclusive_device_buffer()
    {
        return composed(acc);
    }
    // 16-bit: cuBLASLt, the bias and the GELU in the epilogue.
    let on_lt = matches!(dtype, DType::F16 | DType::BF16) && {
        let xi = input(dev, OP, x)?;
        let wi = input(dev, OP, w)?;
        let ai = input(dev, OP, &acc)?;
        let bi = optional_vector(dev, OP, "bias", bias, out_f)?;
        let g = LtLinear {
            m: out_f,
            n: m,
            k: in_f,
            w: wi.ptr,
            x: xi.ptr,
            out: ai.ptr,
            bias: bi.as_ref().map_or(0, |b| b.ptr),
            dtype,
            epilogue: Epilogue::new(bi.is_some(), gelu),
            accumulate: true,
            fp8: None,
            alpha: 1.0,
            algo: 0,
        };
        let ran = lt_linear(dev, &g)?;
        if ran {
            let mut used = vec![&xi, &wi, &ai];
            if let Some(b) = &bi {
                used.push(b);
            }
            super::mark_used(dev, &used)?;
        }
        ran
    };
    if on_lt {
        return Ok(acc);
    }
    if bias.is_some() {
        return composed(acc);
    }
    {
        let xi = input(dev, OP, x)?;
        let wi = input(dev, OP, w)?;
        let ai = input(dev, OP, &acc)?;
        let rows = Rows { m, out_f, dtype };
        rows.gemm(dev, wi.ptr, in_f, in_f, xi.ptr, ai.ptr, 1.0)?;
        super::mark_used(dev, &[&xi, &wi, &ai])?;
    }
    if gelu {
        super::elementwise::unary_owned(dev, acc, ddo_core::UnaryOp::GeluTanh)
    } else {
        Ok(acc)
    }
}

/// `Ops::linear_concat` on `dev`: `linear(concat(xs, last dim), w, bias)` as one GEMM per
/// part against its column window of `w` (leading dimension `in`), each adding into the
/// output (seeded with the bias), so the concatenation never exists. The sum is rounded to
/// the output dtype after each part. Parts of another dtype than `w`, or a single part,
/// take [`ddo_core::ops::linear_concat_by_concat`] / [`linear`].
pub(crate) fn linear_concat(
    dev: &CudaDevice,
    xs: &[&Tensor],
    w: &Tensor,
    bias: Option<&Tensor>,
) -> Result<Tensor> {
    const OP: &str = "linear_concat";
    if let Some(first) = xs.first()
        && let Some((w, bias)) = fp8_operands(dev, first, w, bias)?
    {
        return linear_concat(dev, xs, &w, bias.as_ref());
    }
    let same_dtype = xs.iter().all(|t| t.dtype() == w.dtype());
    if xs.len() < 2 || !same_dtype {
        return ddo_core::ops::linear_concat_by_concat(dev, xs, w, bias);
    }
    let shapes: Vec<&[usize]> = xs.iter().map(|x| x.shape()).collect();
    let g = ddo_core::shape::linear_geometry(OP, &shapes, w.shape())?;
    let (out_f, in_f, m) = (g.out_features, g.in_features, g.rows);
    let inputs = xs
        .iter()
        .map(|x| input(dev, OP, x))
        .collect::<Result<Vec<_>>>()?;
    let wi = input(dev, OP, w)?;
    let bi = optional_vector(dev, OP, "bias", bias, out_f)?;
    let shape = g.out_shape.clone();
    let out = Out::new(dev, OP, shape, w.dtype())?;
    let esize = w.dtype().size_in_bytes();
    let mut seeded = match &bi {
        Some(b) => {
            fill_bias(dev, out.ptr, out.code, b, m, out_f, out_f, false)?;
            true
        }
        None => false,
    };
    let mut col = 0;
    for (xi, &width) in inputs.iter().zip(&g.widths) {
        if width == 0 {
            continue;
        }
        let rows = Rows {
            m,
            out_f,
            dtype: w.dtype(),
        };
        let beta = if seeded { 1.0 } else { 0.0 };
        rows.gemm(
            dev,
            wi.ptr + (col * esize) as u64,
            in_f,
            width,
            xi.ptr,
            out.ptr,
            beta,
        )?;
        seeded = true;
        col += width;
    }
    if !seeded {
        zero(dev, out.ptr, m * out_f * esize)?;
    }
    let mut used: Vec<&super::In<'_>> = inputs.iter().collect();
    used.push(&wi);
    if let Some(b) = &bi {
        used.push(b);
    }
    out.finish(dev, &used)
}

/// `Ops::matmul` on `dev`: `a [..., m, k] · b [..., k, n]`, batch dims broadcasting.
pub(crate) fn matmul(dev: &CudaDevice, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "matmul";
    let g = ddo_core::shape::matmul_geometry(OP, a.shape(), b.shape())?;
    let (ab, bb, batch) = (&g.a_batch[..], &g.b_batch[..], &g.batch[..]);
    let (m, k, n) = (g.m, g.k, g.n);
    let ai = input(dev, OP, a)?;
    let bi = input(dev, OP, b)?;
    if ai.dtype != bi.dtype {
        let y = matmul(dev, &to_f32(dev, a)?, &to_f32(dev, b)?)?;
        return if a.dtype() == DType::F32 {
            Ok(y)
        } else {
            Ops::cast(dev, &y, a.dtype())
        };
    }
    let shape = g.out_shape();
    let out = Out::new(dev, OP, shape, a.dtype())?;
    let nb = product(batch);
    let esize = a.dtype().size_in_bytes() as u64;
    if nb * m * n == 0 {
        return out.finish(dev, &[&ai, &bi]);
    }
    if k == 0 {
        zero(dev, out.ptr, nb * m * n * esize as usize)?;
        return out.finish(dev, &[&ai, &bi]);
    }
    // Column-major: Cᵀ [n, m] = Bᵀ [n, k] · Aᵀ [k, m], both read untransposed.
    let base = Gemm {
        trans_a: false,
        trans_b: false,
        m: n,
        n: m,
        k,
        a: bi.ptr,
        lda: n,
        stride_a: 0,
        b: ai.ptr,
        ldb: k,
        stride_b: 0,
        c: out.ptr,
        ldc: n,
        stride_c: 0,
        batch: 1,
        ab: a.dtype(),
        c_dtype: a.dtype(),
        alpha: 1.0,
        beta: 0.0,
    };
    if product(bb) == 1 {
        // One shared right-hand matrix: a's batch folds into the rows (chunked for cuBLAS's
        // 32-bit sizes).
        let rows = nb * m;
        let rows_max = (i32::MAX as usize / k.max(n)).max(1);
        let mut r0 = 0;
        while r0 < rows {
            let r = rows_max.min(rows - r0);
            gemm(
                dev,
                &Gemm {
                    n: r,
                    b: ai.ptr + (r0 * k) as u64 * esize,
                    c: out.ptr + (r0 * n) as u64 * esize,
                    ..base
                },
            )?;
            r0 += r;
        }
        return out.finish(dev, &[&ai, &bi]);
    }
    let sa: Vec<usize> = broadcast_strides(ab, batch)
        .iter()
        .map(|s| s * m * k)
        .collect();
    let sb: Vec<usize> = broadcast_strides(bb, batch)
        .iter()
        .map(|s| s * k * n)
        .collect();
    let sc: Vec<usize> = broadcast_strides(batch, batch)
        .iter()
        .map(|s| s * m * n)
        .collect();
    let (sizes, [sa, sb, sc]) = coalesce(batch, [&sa, &sb, &sc]);
    let r = sizes.len();
    let inner = sizes[r - 1];
    let outer: usize = product(&sizes[..r - 1]);
    for o in 0..outer {
        // Offsets of this outer index (row-major over sizes[..r - 1]).
        let (mut rem, mut oa, mut ob, mut oc) = (o, 0usize, 0usize, 0usize);
        for d in (0..r - 1).rev() {
            let i = rem % sizes[d];
            rem /= sizes[d];
            oa += i * sa[d];
            ob += i * sb[d];
            oc += i * sc[d];
        }
        gemm(
            dev,
            &Gemm {
                a: bi.ptr + ob as u64 * esize,
                stride_a: sb[r - 1],
                b: ai.ptr + oa as u64 * esize,
                stride_b: sa[r - 1],
                c: out.ptr + oc as u64 * esize,
                stride_c: sc[r - 1],
                batch: inner,
                ..base
            },
        )?;
    }
    out.finish(dev, &[&ai, &bi])
}
