//! Scaled dot-product attention of the CUDA backend: `softmax(q kᵀ · scale + mask) v` with
//! `q [b, h, lq, d]`, `k [b, h, lk, d]`, `v [b, h, lk, dv]` and an optional additive mask
//! broadcastable to `[b, h, lq, lk]` (read through its strides, 0 where it broadcasts, in its
//! own dtype). Shape checks and results follow the host reference
//! (`ddo_host::ops`), including NaN for a query whose keys are all masked out.
//!
//! Three paths (`kernels/attention.cu` has the kernels), chosen by dtype and head size:
//!
//! - **fused, tensor cores** (`ddo_attn_mma_*_d64`, `ddo_attn_mmaq_*_d128`): q, k, v of one
//!   16-bit dtype, `d == dv` in {64, 128}, 16-byte aligned — FlashAttention-2 style: 128
//!   queries per block, K/V tiles through two stages of shared memory (cp.async, the next
//!   tile loading while one is computed, one barrier per tile), online softmax in f32
//!   registers, `mma.sync` m16n8k16 with f32 accumulators. Never stores a score. d = 64
//!   (CLIP/T5): 8 warps of 16 queries, Q in registers, 64-key tiles; d = 128 (Flux): 4 warps
//!   of 32 queries, Q in shared memory, 32-key tiles (1.00 ms a call against 1.07 for the
//!   d = 64 layout at FLUX.1-dev's 4608 tokens on an H200).
//! - **chunked, cuBLAS** (same dtype for q, k, v, otherwise any size — taken when
//!   `max(d, dv) > 128`, e.g. the VAE's single-head attention with d = 512): per chunk of
//!   (b, h) pairs and queries, `S = scale · Q Kᵀ` by a strided-batched GEMM into an f32
//!   scratch, a row softmax kernel (mask added) writing `P` in the compute dtype, and
//!   `O = P V` by a second GEMM straight into the output. The scratch is bounded
//!   ([`SCRATCH_BYTES`]), so only `chunk × lk` scores exist at once, never `lq × lk` of a
//!   long sequence.
//! - **fused, CUDA cores** (`ddo_attn_scalar_*`): everything else (f32 with small heads,
//!   mixed dtypes, unusual head sizes, misaligned operands): online softmax per query with
//!   32-key tiles in shared memory, f32 math, any `d` (chunked through shared memory) and
//!   any `dv` (one launch per 512 output columns).
//!
//! Grids put query tiles on `x` and (b, h) pairs on `y`, launched in slices of 65,535
//! pairs (the limit of a grid's `y`).
//!
//! Later optimisations: Hopper `wgmma` with TMA loads and a deeper K/V pipeline for the
//! fused path (it uses Ampere-style `mma.sync`), and a fused tensor-core kernel for
//! d = 512.

use ddo_core::{DType, Device, Result, Tensor};

use super::cudnn_attention::{Key, Pointers};
use super::gemm::{Gemm, gemm, launch_cfg};
use super::kernels::{self, Arg, Dims6};
use super::{Out, input};
use crate::device::CudaDevice;

/// Name of this file's kernel source.
pub(crate) const SOURCE_NAME: &str = "attention.cu";
/// The kernel source (`kernels/attention.cu`).
pub(crate) const SOURCE: &str = include_str!("../../kernels/attention.cu");

/// Largest f32 score scratch of the chunked path, in bytes (the probabilities take at most
/// as much again).
const SCRATCH_BYTES: usize = 256 << 20;

/// Most (b, h) pairs in one grid's `y` dimension.
const MAX_GRID_Y: usize = 65_535;

/// Queries per block of the fused tensor-core kernel (8 warps of 16).
const MMA_BQ: usize = 128;
/// Queries per block of the CUDA-core kernel.
const SCALAR_BQ: usize = 16;
/// Output columns of one CUDA-core launch.
const SCALAR_DV: usize = 512;

/// Which implementation runs an attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Path {
    /// `ddo_attn_mma_*`.
    FusedTensorCore,
    /// GEMM + softmax + GEMM in bounded chunks.
    Chunked,
    /// `ddo_attn_scalar_*`.
    FusedScalar,
}

/// The shape facts that pick a [`Path`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Plan {
    /// dtypes of q, k, v.
    pub dtypes: [DType; 3],
    /// Head size of q and k.
    pub d: usize,
    /// Head size of v.
    pub dv: usize,
    /// Keys.
    pub lk: usize,
    /// Whether q, k, v start on 16-byte boundaries.
    pub aligned: bool,
}

/// The path for `plan` (see the module docs).
pub(crate) fn choose(plan: &Plan) -> Path {
    let [qt, kt, vt] = plan.dtypes;
    let same = qt == kt && kt == vt;
    let half = matches!(qt, DType::F16 | DType::BF16);
    if plan.lk == 0 {
        // Every query row is empty: the CUDA-core kernel writes the reference's NaN.
        Path::FusedScalar
    } else if same && half && plan.d == plan.dv && matches!(plan.d, 64 | 128) && plan.aligned {
        Path::FusedTensorCore
    } else if same && plan.d.max(plan.dv) > 128 {
        Path::Chunked
    } else {
        Path::FusedScalar
    }
}

/// `Ops::attention` on `dev`.
pub(crate) fn attention(
    dev: &CudaDevice,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f32,
) -> Result<Tensor> {
    const OP: &str = "attention";
    let ddo_core::shape::AttentionGeometry {
        b,
        h,
        lq,
        lk,
        d,
        dv,
        mask_strides,
    } = ddo_core::shape::attention_geometry(
        OP,
        q.shape(),
        k.shape(),
        v.shape(),
        mask.map(Tensor::shape),
    )?;
    let key = cudnn_key(
        dev,
        [q, k, v],
        [b, h, lq, lk, d, dv],
        mask.map(|m| (m.dtype(), four(&mask_strides))),
        scale,
        false,
    );
    let mstr = mask_strides
        .map(|s| Dims6::from_slice(&s))
        .unwrap_or_default();
    let qi = input(dev, OP, q)?;
    let ki = input(dev, OP, k)?;
    let vi = input(dev, OP, v)?;
    let mi = mask.map(|m| input(dev, OP, m)).transpose()?;
    let out = Out::new(dev, OP, vec![b, h, lq, dv], q.dtype())?;
    // Its free waits for whatever is queued on it, even if a later step fails.
    dev.allocation(&out.buffer)?
        .note_use(dev.stream_handle(&dev.compute_stream())?);
    let mut inputs = vec![&qi, &ki, &vi];
    if let Some(m) = &mi {
        inputs.push(m);
    }
    let heads = b * h;
    if heads * lq * dv == 0 {
        return out.finish(dev, &inputs);
    }
    let (mask_ptr, mask_code) = super::opt_ptr(mi.as_ref());
    if let Some(key) = &key {
        let ptrs = Pointers {
            q: qi.ptr,
            k: ki.ptr,
            v: vi.ptr,
            out: out.ptr,
            mask: mask_ptr,
        };
        if run_cudnn(dev, key, &ptrs, scale)? {
            return out.finish(dev, &inputs);
        }
    }
    let plan = Plan {
        dtypes: [qi.dtype, ki.dtype, vi.dtype],
        d,
        dv,
        lk,
        aligned: [qi.ptr, ki.ptr, vi.ptr].iter().all(|p| p % 16 == 0),
    };
    let ops = Operands {
        q: qi.ptr,
        k: ki.ptr,
        v: vi.ptr,
        out: out.ptr,
        mask: mask_ptr,
        mstr,
        codes: [qi.code, ki.code, vi.code, out.code, mask_code],
    };
    let shape = Shape {
        h,
        heads,
        lq,
        lk,
        d,
        dv,
    };
    match choose(&plan) {
        Path::FusedTensorCore => fused_mma(dev, &ops, &shape, q.dtype(), scale)?,
        Path::Chunked => chunked(dev, &ops, &shape, q.dtype(), scale)?,
        Path::FusedScalar => fused_scalar(dev, &ops, &shape, scale)?,
    }
    out.finish(dev, &inputs)
}

/// `Ops::attention_tokens` on `dev`: the output in token order, `[b, lq, h·dv]`. cuDNN
/// writes it directly through the output's strides where it takes the call; otherwise
/// [`ddo_core::ops::attention_tokens_composed`] runs (this backend's attention, then its
/// permute).
pub(crate) fn attention_tokens(
    dev: &CudaDevice,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f32,
) -> Result<Tensor> {
    const OP: &str = "attention_tokens";
    let g = ddo_core::shape::attention_geometry(
        OP,
        q.shape(),
        k.shape(),
        v.shape(),
        mask.map(Tensor::shape),
    )?;
    // Only a call cuDNN takes (its checks first, before anything is allocated) writes the
    // token order directly; the rest run the composition.
    let key = cudnn_key(
        dev,
        [q, k, v],
        [g.b, g.h, g.lq, g.lk, g.d, g.dv],
        mask.map(|m| (m.dtype(), four(&g.mask_strides))),
        scale,
        true,
    );
    if let Some(key) = key.filter(|_| g.b * g.h * g.lq * g.dv > 0) {
        let qi = input(dev, OP, q)?;
        let ki = input(dev, OP, k)?;
        let vi = input(dev, OP, v)?;
        let mi = mask.map(|m| input(dev, OP, m)).transpose()?;
        let out = Out::new(dev, OP, vec![g.b, g.lq, g.h * g.dv], q.dtype())?;
        dev.allocation(&out.buffer)?
            .note_use(dev.stream_handle(&dev.compute_stream())?);
        let ptrs = Pointers {
            q: qi.ptr,
            k: ki.ptr,
            v: vi.ptr,
            out: out.ptr,
            mask: mi.as_ref().map_or(0, |m| m.ptr),
        };
        if run_cudnn(dev, &key, &ptrs, scale)? {
            let mut inputs = vec![&qi, &ki, &vi];
            inputs.extend(&mi);
            return out.finish(dev, &inputs);
        }
    }
    ddo_core::ops::attention_tokens_composed(dev, q, k, v, mask, scale)
}

/// A mask's element strides for (b, h, query, key) when it has four (`None`: cuDNN is not
/// asked).
fn four(strides: &Option<Vec<usize>>) -> Option<[usize; 4]> {
    strides.as_ref().and_then(|s| s.as_slice().try_into().ok())
}

/// The cuDNN plan key of a call cuDNN takes: cuDNN on, 16-bit q, k, v of one dtype,
/// `d == dv`, a positive finite scale (cuDNN's engines gave NaN for a negative one on an
/// H200 with cuDNN 9.14), a 4-D mask layout it reads (`mask`: its dtype and strides);
/// `tokens` writes the output in token order. The addresses' alignment is
/// [`run_cudnn`]'s check.
fn cudnn_key(
    dev: &CudaDevice,
    [q, k, v]: [&Tensor; 3],
    [b, h, lq, lk, d, dv]: [usize; 6],
    mask: Option<(DType, Option<[usize; 4]>)>,
    scale: f32,
    tokens: bool,
) -> Option<Key> {
    let mask = match mask {
        None => None,
        Some((dtype, Some(strides))) => Some((dtype, strides)),
        Some((_, None)) => return None,
    };
    let takes = dev.cudnn_attention_enabled()
        && scale.is_finite()
        && scale > 0.0
        && d == dv
        && [k.dtype(), v.dtype()] == [q.dtype(); 2];
    takes
        .then(|| super::cudnn_attention::key(q.dtype(), [b, h, lq, lk, d], mask, tokens))
        .flatten()
}

/// Runs the call of `key` on cuDNN where every address of `ptrs` is 16-byte aligned:
/// whether it ran (a refused plan does not).
fn run_cudnn(dev: &CudaDevice, key: &Key, ptrs: &Pointers, scale: f32) -> Result<bool> {
    let aligned = [ptrs.q, ptrs.k, ptrs.v, ptrs.out, ptrs.mask]
        .iter()
        .all(|p| p % 16 == 0);
    if !aligned {
        return Ok(false);
    }
    super::cudnn_attention::run(dev, key, ptrs, scale)
}

/// [`Device::prepare_attention`](ddo_core::Device::prepare_attention) on `dev`: the cuDNN
/// plan of an eligible shape starts building, output in token order (the same eligibility
/// as a call: 16-bit, d == dv, the mask's layout; alignment is a call's matter).
pub(crate) fn prepare(
    dev: &CudaDevice,
    q: &[usize],
    k: &[usize],
    v: &[usize],
    mask: Option<(&[usize], DType)>,
    dtype: DType,
) {
    let Ok(g) = ddo_core::shape::attention_geometry("attention", q, k, v, mask.map(|(m, _)| m))
    else {
        return;
    };
    let mask4 = four(&g.mask_strides);
    if g.d != g.dv {
        return;
    }
    // The models call `attention_tokens` (the output in token order), so that is the plan
    // made ready.
    if let Some(key) = super::cudnn_attention::key(
        dtype,
        [g.b, g.h, g.lq, g.lk, g.d],
        mask.zip(mask4).map(|((_, mdt), s)| (mdt, s)),
        true,
    ) {
        let _ = super::cudnn_attention::prepare(dev, &key);
    }
}

/// Device addresses and dtype codes of one call.
struct Operands {
    q: u64,
    k: u64,
    v: u64,
    out: u64,
    mask: u64,
    mstr: Dims6,
    /// q, k, v, out, mask.
    codes: [i32; 5],
}

/// Sizes of one call.
struct Shape {
    /// Heads per batch entry.
    h: usize,
    /// b · h.
    heads: usize,
    lq: usize,
    lk: usize,
    d: usize,
    dv: usize,
}

/// Slices of at most [`MAX_GRID_Y`] (b, h) pairs: (first, count).
fn head_slices(heads: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..heads)
        .step_by(MAX_GRID_Y)
        .map(move |h0| (h0, MAX_GRID_Y.min(heads - h0)))
}

fn fused_mma(dev: &CudaDevice, o: &Operands, s: &Shape, dtype: DType, scale: f32) -> Result<()> {
    let name = match (dtype, s.d) {
        (DType::BF16, 64) => "ddo_attn_mma_bf16_d64",
        (DType::BF16, _) => "ddo_attn_mmaq_bf16_d128",
        (_, 64) => "ddo_attn_mma_f16_d64",
        _ => "ddo_attn_mmaq_f16_d128",
    };
    // d = 64: 8 warps of 16 queries, Q in registers, two stages of K and V tiles of 64
    // keys. d = 128: 4 warps of 32 queries, the Q tile in shared memory, K and V tiles of 32
    // keys (see kernels/attention.cu).
    let (rows, threads) = if s.d == 64 {
        (4 * 64, 256)
    } else {
        (MMA_BQ + 4 * 32, 128)
    };
    let f = dev.kernel(SOURCE_NAME, SOURCE, name)?;
    // Rows padded by 8 halves: above the 48 KiB a kernel gets without asking for d = 128.
    let smem = rows * (s.d + 8) * 2;
    f.set_attribute(
        cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
    .map_err(|e| {
        crate::error::CudaError::driver("cuFuncSetAttribute", e).into_core(&dev.id().to_string())
    })?;
    let tiles = s.lq.div_ceil(MMA_BQ) as u32;
    for (h0, count) in head_slices(s.heads) {
        kernels::launch(
            dev,
            &f,
            launch_cfg((tiles, count as u32, 1), threads, smem as u32),
            &[
                Arg::Ptr(o.q),
                Arg::Ptr(o.k),
                Arg::Ptr(o.v),
                Arg::Ptr(o.out),
                Arg::Ptr(o.mask),
                Arg::I32(o.codes[4]),
                Arg::Dims(o.mstr),
                Arg::Dims(Dims6::from_slice(&[s.lq, s.lk, s.h, h0])),
                Arg::F32(scale),
            ],
        )?;
    }
    Ok(())
}

fn fused_scalar(dev: &CudaDevice, o: &Operands, s: &Shape, scale: f32) -> Result<()> {
    let tiles = s.lq.div_ceil(SCALAR_BQ) as u32;
    let dtypes = Dims6 {
        v: [
            i64::from(o.codes[0]),
            i64::from(o.codes[1]),
            i64::from(o.codes[2]),
            i64::from(o.codes[3]),
            i64::from(o.codes[4]),
            0,
        ],
    };
    for dv0 in (0..s.dv).step_by(SCALAR_DV) {
        let dvn = SCALAR_DV.min(s.dv - dv0);
        let name = if dvn <= 128 {
            "ddo_attn_scalar_1"
        } else {
            "ddo_attn_scalar_4"
        };
        let f = dev.kernel(SOURCE_NAME, SOURCE, name)?;
        for (h0, count) in head_slices(s.heads) {
            kernels::launch(
                dev,
                &f,
                launch_cfg((tiles, count as u32, 1), 128, 0),
                &[
                    Arg::Ptr(o.q),
                    Arg::Ptr(o.k),
                    Arg::Ptr(o.v),
                    Arg::Ptr(o.out),
                    Arg::Ptr(o.mask),
                    Arg::Dims(dtypes),
                    Arg::Dims(o.mstr),
                    Arg::Dims(Dims6::from_slice(&[s.lq, s.lk, s.d, s.dv, s.h, h0])),
                    Arg::Dims(Dims6::from_slice(&[dv0, dvn])),
                    Arg::F32(scale),
                ],
            )?;
        }
    }
    Ok(())
}

fn chunked(dev: &CudaDevice, o: &Operands, s: &Shape, dtype: DType, scale: f32) -> Result<()> {
    let esize = dtype.size_in_bytes();
    // Chunk sizes: qc queries of hc heads, with hc · qc · lk f32 scores in the scratch.
    let row_bytes = s.lk.max(1) * 4;
    let qc = (SCRATCH_BYTES / row_bytes).clamp(1, s.lq);
    let hc = (SCRATCH_BYTES / (row_bytes * qc)).clamp(1, s.heads);
    let compute = dev.compute_stream();
    let scores = dev.alloc_on(hc * qc * row_bytes, &compute)?;
    let probs = dev.alloc_on(hc * qc * s.lk.max(1) * esize, &compute)?;
    let sp = dev.allocation(&scores)?.device_ptr();
    let pp = dev.allocation(&probs)?.device_ptr();
    let f = dev.kernel(SOURCE_NAME, SOURCE, "ddo_attn_softmax_rows")?;
    let result = (|| -> Result<()> {
        for h0 in (0..s.heads).step_by(hc) {
            let hn = hc.min(s.heads - h0);
            for q0 in (0..s.lq).step_by(qc) {
                let qn = qc.min(s.lq - q0);
                // Sᵀ [lk, qn] = K [lk, d] · Q_chunkᵀ [d, qn] (column-major), scaled.
                gemm(
                    dev,
                    &Gemm {
                        trans_a: true,
                        trans_b: false,
                        m: s.lk,
                        n: qn,
                        k: s.d,
                        a: o.k + (h0 * s.lk * s.d * esize) as u64,
                        lda: s.d,
                        stride_a: s.lk * s.d,
                        b: o.q + ((h0 * s.lq + q0) * s.d * esize) as u64,
                        ldb: s.d,
                        stride_b: s.lq * s.d,
                        c: sp,
                        ldc: s.lk,
                        stride_c: qn * s.lk,
                        batch: hn,
                        ab: dtype,
                        c_dtype: DType::F32,
                        alpha: scale,
                        beta: 0.0,
                    },
                )?;
                let rows = hn * qn;
                let grid = rows.clamp(1, 1 << 16) as u32;
                kernels::launch(
                    dev,
                    &f,
                    launch_cfg((grid, 1, 1), 256, 0),
                    &[
                        Arg::Ptr(sp),
                        Arg::Ptr(pp),
                        Arg::I32(o.codes[0]),
                        Arg::Ptr(o.mask),
                        Arg::I32(o.codes[4]),
                        Arg::Dims(o.mstr),
                        Arg::Dims(Dims6::from_slice(&[s.lk, qn, q0, s.h, h0, s.lq])),
                        Arg::I64(rows as i64),
                    ],
                )?;
                // O_chunkᵀ [dv, qn] = Vᵀ [dv, lk] · Pᵀ [lk, qn] (column-major).
                gemm(
                    dev,
                    &Gemm {
                        trans_a: false,
                        trans_b: false,
                        m: s.dv,
                        n: qn,
                        k: s.lk,
                        a: o.v + (h0 * s.lk * s.dv * esize) as u64,
                        lda: s.dv,
                        stride_a: s.lk * s.dv,
                        b: pp,
                        ldb: s.lk,
                        stride_b: qn * s.lk,
                        c: o.out + ((h0 * s.lq + q0) * s.dv * esize) as u64,
                        ldc: s.dv,
                        stride_c: s.lq * s.dv,
                        batch: hn,
                        ab: dtype,
                        c_dtype: dtype,
                        alpha: 1.0,
                        beta: 0.0,
                    },
                )?;
            }
        }
        Ok(())
    })();
    let handle = dev.stream_handle(&compute)?;
    dev.allocation(&scores)?.note_use(handle);
    dev.allocation(&probs)?.note_use(handle);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(dtypes: [DType; 3], d: usize, dv: usize) -> Plan {
        Plan {
            dtypes,
            d,
            dv,
            lk: 4096,
            aligned: true,
        }
    }

    #[test]
    fn paths_follow_dtype_and_head_size() {
        let bf = [DType::BF16; 3];
        assert_eq!(choose(&plan(bf, 128, 128)), Path::FusedTensorCore);
        assert_eq!(
            choose(&plan([DType::F16; 3], 64, 64)),
            Path::FusedTensorCore
        );
        assert_eq!(choose(&plan(bf, 512, 512)), Path::Chunked);
        assert_eq!(choose(&plan([DType::F32; 3], 512, 512)), Path::Chunked);
        assert_eq!(choose(&plan([DType::F32; 3], 128, 128)), Path::FusedScalar);
        assert_eq!(choose(&plan(bf, 40, 40)), Path::FusedScalar);
        assert_eq!(choose(&plan(bf, 128, 64)), Path::FusedScalar);
        assert_eq!(
            choose(&plan([DType::F32, DType::BF16, DType::BF16], 600, 600)),
            Path::FusedScalar
        );
        let mut p = plan(bf, 128, 128);
        p.aligned = false;
        assert_eq!(choose(&p), Path::FusedScalar);
        let mut p = plan(bf, 128, 128);
        p.lk = 0;
        assert_eq!(choose(&p), Path::FusedScalar);
    }

    /// The GEMM/convolution and attention sources compile with NVRTC for Hopper
    /// (compute_90) and define every kernel the ops launch. Needs libnvrtc, no GPU.
    #[test]
    fn heavy_kernel_sources_compile_with_nvrtc_for_compute_90() {
        if !kernels::nvrtc_present() {
            println!("skipped: libnvrtc not found (set LD_LIBRARY_PATH to its directory)");
            return;
        }
        let sources: [(&str, &str, &[&str]); 2] = [
            (
                SOURCE_NAME,
                SOURCE,
                &[
                    "ddo_attn_mma_bf16_d64",
                    "ddo_attn_mma_f16_d64",
                    "ddo_attn_mmaq_bf16_d128",
                    "ddo_attn_mmaq_f16_d128",
                    "ddo_attn_scalar_1",
                    "ddo_attn_scalar_4",
                    "ddo_attn_softmax_rows",
                ],
            ),
            (
                super::super::gemm::SOURCE_NAME,
                super::super::gemm::SOURCE,
                &[
                    "ddo_fill_bias",
                    "ddo_im2col_b16",
                    "ddo_im2col_b32",
                    "ddo_conv_pack_weights",
                    "ddo_conv_igemm_bf16",
                    "ddo_conv_igemm_f16",
                    "ddo_nchw_to_nhwc_b16",
                    "ddo_conv_nhwc_igemm_bf16",
                    "ddo_conv_nhwc_igemm_f16",
                ],
            ),
        ];
        for (name, source, functions) in sources {
            let ptx = kernels::compile_ptx(source, "compute_90")
                .unwrap_or_else(|log| panic!("{name} does not compile: {log}"));
            let text = ptx.to_src();
            for f in functions {
                assert!(
                    text.contains(&format!(".entry {f}(")),
                    "{name}: no kernel {f} in the PTX"
                );
            }
        }
    }
}
