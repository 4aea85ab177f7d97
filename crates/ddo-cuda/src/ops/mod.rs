//! The CUDA backend's compute plane: [`Ops`] for [`CudaDevice`].
//!
//! Semantics are the host backend's (`ddo_host::ops`, the reference): the same shape
//! checks and typed errors, compute in f32, results rounded once into the output dtype.
//! Every op checks that its inputs are device tensors of this device ([`input`]), checks
//! shapes, allocates its output on the compute stream ([`Out::new`], `alloc_on`), queues
//! its kernels on the compute stream (so it runs after the work queued there before it,
//! like the host's fence) and marks every allocation the kernels touch with
//! `note_use(compute)` ([`Out::finish`]), so a buffer dropped while a kernel still reads or
//! writes it is freed only after that kernel.
//!
//! Files: [`kernels`] (the sources, prelude, per-device module cache, warm-up, launch
//! helper), [`kernel_cache`] (compiled images in memory and on disk), [`nvrtc`] (the NVRTC
//! calls), `elementwise` (unary, binary with broadcasting, affine, cast, rope), `norm`
//! (group/layer/RMS norm, softmax, reduce, the non-finite count), `layout`
//! (upload/download, concat, narrow, permute, upsample, embedding), the
//! GEMM/convolution/attention files (`gemm`, `conv`, `attention`), `gguf` (GGUF blocks
//! dequantized for [`Ops::dequantize`], one kernel per block type), `fp8` (`--compute fp8`'s
//! quantization kernels and cuBLASLt E4M3 GEMM, [`Ops::linear_fp8`]), and `codec` (the GPU
//! decoder of ddo-codec's units, public as `ddo_cuda::codec`; not an [`Ops`] op).

pub(crate) use ddo_core::shape::{
    broadcast_shape, broadcast_strides, coalesce, contiguous_strides,
};
use ddo_core::tensor::{byte_len, numel};
use ddo_core::{
    BinaryOp, CoreError, DType, Device, DeviceBuffer, Ops, ReduceOp, Result, Tensor, TensorStorage,
    UnaryOp,
};

use crate::device::{CudaAllocation, CudaDevice};

pub(crate) mod attention;
pub mod codec;
pub(crate) mod conv;
pub(crate) mod cublaslt;
pub(crate) mod cudnn_attention;
pub(crate) mod elementwise;
pub(crate) mod fp8;
pub(crate) mod gemm;
pub(crate) mod gguf;
pub(crate) mod kernel_cache;
pub(crate) mod kernels;
pub(crate) mod layout;
pub(crate) mod norm;
pub(crate) mod nvrtc;
pub(crate) mod warm_up;

/// A shape error of `op`.
pub(crate) fn shape_err(op: &str, message: impl Into<String>) -> CoreError {
    CoreError::Shape {
        what: op.to_string(),
        message: message.into(),
    }
}

/// Refuses quantized storage, as the host backend does.
pub(crate) fn float_dtype(op: &str, dtype: DType) -> Result<i32> {
    kernels::dtype_code(dtype).ok_or_else(|| {
        if dtype.is_fp8() {
            shape_err(
                op,
                format!(
                    "{dtype} tensors are computed on by the CUDA backend only as linear weights \
                     and biases (decoded into the input's dtype) and through cast; give \
                     --dtype bf16 to convert them at load"
                ),
            )
        } else {
            shape_err(
                op,
                "quantized storage has no element values to compute on; dequantize it first",
            )
        }
    })
}

/// An input operand: a float tensor in this device's memory.
pub(crate) struct In<'a> {
    /// Device address of the tensor's first element.
    pub ptr: u64,
    /// Bytes.
    pub len: usize,
    /// Element type.
    pub dtype: DType,
    /// Its kernel-side code (`DTYPE_*`).
    pub code: i32,
    /// Shape.
    #[allow(dead_code)] // for the ops that need more than the element count
    pub shape: &'a [usize],
    /// Elements.
    pub numel: usize,
    alloc: &'a CudaAllocation,
}

/// Checks that `t` is a float tensor of `dev` and returns its address, size, dtype, shape.
pub(crate) fn input<'a>(dev: &CudaDevice, op: &str, t: &'a Tensor) -> Result<In<'a>> {
    let code = float_dtype(op, t.dtype())?;
    Ok(In {
        code,
        ..stored_input(dev, t)?
    })
}

/// `t`'s bytes on `dev` whatever its dtype (code -1: not a float kernels compute in), for
/// the ops that read stored bytes themselves (the fp8 upcast).
pub(crate) fn stored_input<'a>(dev: &CudaDevice, t: &'a Tensor) -> Result<In<'a>> {
    let slice = match t.storage() {
        TensorStorage::Device(s) => s,
        TensorStorage::Host(_) => {
            return Err(CoreError::WrongDevice {
                what: "tensor",
                expected: dev.id().to_string(),
                found: "host memory".into(),
            });
        }
    };
    let alloc = dev.allocation(slice.buffer())?;
    Ok(In {
        ptr: alloc.device_ptr() + slice.offset() as u64,
        len: slice.len(),
        dtype: t.dtype(),
        code: -1,
        shape: t.shape(),
        numel: t.numel(),
        alloc,
    })
}

/// Checks an optional per-feature vector operand (`[len]`), as the host backend does.
pub(crate) fn optional_vector<'a>(
    dev: &CudaDevice,
    op: &str,
    what: &str,
    t: Option<&'a Tensor>,
    len: usize,
) -> Result<Option<In<'a>>> {
    let Some(t) = t else { return Ok(None) };
    if t.shape() != [len] {
        return Err(shape_err(
            op,
            format!("{what} has shape {:?}, expected [{len}]", t.shape()),
        ));
    }
    Ok(Some(input(dev, op, t)?))
}

/// The address of an optional operand (0 when absent) and its dtype code.
pub(crate) fn opt_ptr(t: Option<&In<'_>>) -> (u64, i32) {
    t.map_or((0, kernels::DTYPE_F32), |t| (t.ptr, t.code))
}

/// An op's output, allocated on the compute stream before its kernels are queued.
pub(crate) struct Out {
    /// The allocation.
    pub buffer: DeviceBuffer,
    /// Device address of its first byte.
    pub ptr: u64,
    /// Shape.
    pub shape: Vec<usize>,
    /// Element type.
    pub dtype: DType,
    /// Its kernel-side code.
    pub code: i32,
    /// Elements.
    pub numel: usize,
}

impl Out {
    /// Allocates the output of `op` (`alloc_on` the compute stream); a result too large for
    /// the device is a typed out-of-memory error.
    pub(crate) fn new(dev: &CudaDevice, op: &str, shape: Vec<usize>, dtype: DType) -> Result<Out> {
        let code = float_dtype(op, dtype)?;
        let bytes = byte_len(&shape, dtype)?;
        let buffer = dev.alloc_on(bytes, &dev.compute_stream())?;
        let ptr = dev.allocation(&buffer)?.device_ptr();
        let numel = numel(&shape).unwrap_or(usize::MAX);
        Ok(Out {
            buffer,
            ptr,
            shape,
            dtype,
            code,
            numel,
        })
    }

    /// Marks the output and `inputs` as used by the kernels queued on the compute stream
    /// (their frees wait for them) and returns the output tensor.
    pub(crate) fn finish(self, dev: &CudaDevice, inputs: &[&In<'_>]) -> Result<Tensor> {
        let compute = dev.compute_stream();
        let s = dev.stream_handle(&compute)?;
        for i in inputs {
            i.alloc.note_use(s);
        }
        dev.allocation(&self.buffer)?.note_use(s);
        Tensor::new(
            self.shape,
            self.dtype,
            TensorStorage::Device(self.buffer.slice_all()),
        )
    }
}

/// Marks `inputs` as used by the kernels queued on the compute stream so far (their frees
/// wait for them): for ops that write into an operand instead of a new [`Out`].
pub(crate) fn mark_used(dev: &CudaDevice, inputs: &[&In<'_>]) -> Result<()> {
    let compute = dev.compute_stream();
    let s = dev.stream_handle(&compute)?;
    for i in inputs {
        i.alloc.note_use(s);
    }
    Ok(())
}

/// Most dims a strided kernel takes per launch ([`for_each_block`] splits the rest).
pub(crate) const MAX_DIMS: usize = 6;

/// Splits a walk over `shape` (row-major, operands with `strides`) into blocks of its last
/// [`MAX_DIMS`] dims: calls `f(offsets, first, inner_shape, inner_strides)` per block, with
/// each operand's element offset of the block and the block's first row-major index.
pub(crate) fn for_each_block<const K: usize>(
    shape: &[usize],
    strides: [&[usize]; K],
    mut f: impl FnMut([usize; K], usize, &[usize], [&[usize]; K]) -> Result<()>,
) -> Result<()> {
    let r = shape.len();
    let split = r.saturating_sub(MAX_DIMS);
    let (outer, inner) = shape.split_at(split);
    let inner_strides: [&[usize]; K] = std::array::from_fn(|o| &strides[o][split..]);
    let block: usize = inner.iter().product();
    if outer.contains(&0) || block == 0 {
        return Ok(());
    }
    let mut idx = vec![0usize; split];
    let mut first = 0usize;
    loop {
        let offsets: [usize; K] =
            std::array::from_fn(|o| idx.iter().zip(strides[o]).map(|(i, s)| i * s).sum());
        f(offsets, first, inner, inner_strides)?;
        first += block;
        let mut d = split;
        loop {
            if d == 0 {
                return Ok(());
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < outer[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// Whether a strided launch over `shape` may index in 32 bits: fewer than 2^31 items and
/// every operand's largest offset (with `strides`) below 2^31.
pub(crate) fn fits_u32(shape: &[usize], strides: &[&[usize]]) -> bool {
    const LIMIT: usize = 1 << 31;
    let n: usize = shape.iter().product();
    n < LIMIT
        && strides.iter().all(|st| {
            shape
                .iter()
                .zip(st.iter())
                .map(|(&d, &s)| d.saturating_sub(1).saturating_mul(s))
                .fold(0usize, usize::saturating_add)
                < LIMIT
        })
}

/// Scratch memory for an op's kernels on the compute stream: `bytes` bytes and their
/// address. It is marked used on the compute stream at once, so dropping it after queueing
/// the kernels frees it only once they are done.
pub(crate) fn scratch(dev: &CudaDevice, bytes: usize) -> Result<(DeviceBuffer, u64)> {
    let compute = dev.compute_stream();
    let buffer = dev.alloc_on(bytes, &compute)?;
    let alloc = dev.allocation(&buffer)?;
    alloc.note_use(dev.stream_handle(&compute)?);
    let ptr = alloc.device_ptr();
    Ok((buffer, ptr))
}

impl Ops for CudaDevice {
    fn tensor_from_f32(&self, shape: &[usize], dtype: DType, values: &[f32]) -> Result<Tensor> {
        layout::tensor_from_f32(self, shape, dtype, values)
    }

    fn to_f32_vec(&self, x: &Tensor) -> Result<Vec<f32>> {
        layout::to_f32_vec(self, x)
    }

    fn linear(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        gemm::linear(self, x, w, bias)
    }

    fn linear_fp8(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        fp8::linear_fp8(self, x, w, bias)
    }

    fn linear_fp8_gelu_tanh(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        fp8::linear_fp8_gelu_tanh(self, x, w, bias)
    }

    fn fp8_tensor_cores(&self) -> bool {
        fp8::tensor_cores(self)
    }

    fn linear_fp8_concat(
        &self,
        xs: &[&Tensor],
        w: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        fp8::linear_fp8_concat(self, xs, w, bias)
    }

    fn end_forward(&self) -> Result<()> {
        fp8::forget_codes(self)
    }

    fn fp8_reference_reason(&self) -> String {
        fp8::reference_reason(self).unwrap_or_else(|| {
            format!(
                "fp8 tensor cores run them ({})",
                fp8::path_description(self).unwrap_or_default()
            )
        })
    }

    fn best_gemm_seconds(&self, shape: &ddo_core::GemmShape, calls: usize) -> Result<Option<f64>> {
        Ok(gemm::best_linear_seconds(self, shape, calls)?.map(|(seconds, _)| seconds))
    }

    fn matmul(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        gemm::matmul(self, a, b)
    }

    fn conv2d(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        params: ddo_core::Conv2dParams,
    ) -> Result<Tensor> {
        conv::conv2d(self, x, w, bias, params)
    }

    fn group_norm(
        &self,
        x: &Tensor,
        groups: usize,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor> {
        norm::group_norm(self, x, groups, weight, bias, eps)
    }

    /// Fused: the SiLU is applied in group norm's apply pass (`norm::group_norm_silu`).
    fn group_norm_silu(
        &self,
        x: &Tensor,
        groups: usize,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor> {
        norm::group_norm_silu(self, x, groups, weight, bias, eps)
    }

    fn layer_norm(
        &self,
        x: &Tensor,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor> {
        norm::layer_norm(self, x, weight, bias, eps)
    }

    fn rms_norm(&self, x: &Tensor, weight: Option<&Tensor>, eps: f32) -> Result<Tensor> {
        norm::rms_norm(self, x, weight, eps)
    }

    fn unary(&self, x: &Tensor, op: UnaryOp) -> Result<Tensor> {
        elementwise::unary(self, x, op)
    }

    fn unary_owned(&self, x: Tensor, op: UnaryOp) -> Result<Tensor> {
        elementwise::unary_owned(self, x, op)
    }

    fn linear_concat(&self, xs: &[&Tensor], w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        gemm::linear_concat(self, xs, w, bias)
    }

    fn binary(&self, a: &Tensor, b: &Tensor, op: BinaryOp) -> Result<Tensor> {
        elementwise::binary(self, a, b, op)
    }

    fn affine(&self, x: &Tensor, mul: f32, add: f32) -> Result<Tensor> {
        elementwise::affine(self, x, mul, add)
    }

    fn softmax(&self, x: &Tensor) -> Result<Tensor> {
        norm::softmax(self, x)
    }

    fn reduce(&self, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        norm::reduce(self, x, dim, op)
    }

    fn count_non_finite(&self, x: &Tensor) -> Result<u64> {
        norm::count_non_finite(self, x)
    }

    fn queue_count_non_finite(&self, x: &Tensor, dst: &ddo_core::HostSlice) -> Result<()> {
        norm::queue_count_non_finite(self, x, dst)
    }

    fn upsample_nearest2x(&self, x: &Tensor) -> Result<Tensor> {
        layout::upsample_nearest2x(self, x)
    }

    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        scale: f32,
    ) -> Result<Tensor> {
        attention::attention(self, q, k, v, mask, scale)
    }

    fn attention_tokens(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        scale: f32,
    ) -> Result<Tensor> {
        attention::attention_tokens(self, q, k, v, mask, scale)
    }

    fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        elementwise::rope(self, x, cos, sin)
    }

    fn concat(&self, xs: &[&Tensor], dim: usize) -> Result<Tensor> {
        layout::concat(self, xs, dim)
    }

    fn narrow(&self, x: &Tensor, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        layout::narrow(self, x, dim, start, len)
    }

    fn permute(&self, x: &Tensor, dims: &[usize]) -> Result<Tensor> {
        layout::permute(self, x, dims)
    }

    fn cast(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        elementwise::cast(self, x, dtype)
    }

    fn embedding(&self, table: &Tensor, ids: &[u32]) -> Result<Tensor> {
        layout::embedding(self, table, ids)
    }

    /// One kernel over the blocks (`gguf::dequantize_gguf`), bit-exact against the host.
    fn dequantize(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        let Some(q) = x.quant() else {
            return Err(shape_err(
                "dequantize",
                format!(
                    "{:?} of {} holds no GGUF blocks (only a quantized weight dequantizes)",
                    x.shape(),
                    x.dtype()
                ),
            ));
        };
        gguf::dequantize_gguf(self, x, q.ty, &q.shape, dtype)
    }

    /// One GEMM with `beta = 1` into `acc` where it can (`gemm::linear_accumulate`).
    fn linear_accumulate(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        acc: Tensor,
        gelu_tanh: bool,
    ) -> Result<Tensor> {
        gemm::linear_accumulate(self, x, w, bias, acc, gelu_tanh)
    }

    fn linear_gelu_tanh(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        gemm::linear_gelu_tanh(self, x, w, bias)
    }

    fn layer_norm_modulate(
        &self,
        x: &Tensor,
        eps: f32,
        scale: &Tensor,
        shift: &Tensor,
    ) -> Result<Tensor> {
        norm::layer_norm_modulate(self, x, eps, scale, shift)
    }

    fn gated_add(&self, x: &Tensor, gate: &Tensor, y: &Tensor) -> Result<Tensor> {
        elementwise::gated_add(self, x, gate, y)
    }

    fn gated_add_layer_norm_modulate(
        &self,
        x: &Tensor,
        gate: &Tensor,
        y: &Tensor,
        eps: f32,
        scale: &Tensor,
        shift: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        norm::gated_add_layer_norm_modulate(self, x, gate, y, eps, scale, shift)
    }

    fn attention_input(
        &self,
        part: &ddo_core::AttentionInput<'_>,
        dst: Option<Tensor>,
    ) -> Result<Tensor> {
        norm::attention_input(self, part, dst)
    }
}

/// `Device::forget_shape_plans` on `dev` (the device idle): its cuBLASLt and cuDNN plans go.
pub(crate) fn forget_shape_plans(dev: &CudaDevice) -> Result<()> {
    gemm::forget_lt_plans(dev)?;
    cudnn_attention::forget_plans(dev)?;
    Ok(())
}

impl CudaDevice {
    /// The per-shape plans this device holds now: cuBLASLt GEMM plans and cuDNN attention
    /// plans (what `Device::forget_shape_plans` drops).
    pub fn shape_plans(&self) -> Result<(usize, usize)> {
        Ok((gemm::lt_plans(self)?, cudnn_attention::plans(self)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Compiles every kernel source with NVRTC for compute_90 (the H200): catches compile
    /// errors without a GPU. Skips when libnvrtc does not load (as on CI); point
    /// LD_LIBRARY_PATH at a libnvrtc (e.g. the nvidia-cuda-nvrtc wheel's `nvidia/cu13/lib`)
    /// to run it.
    #[test]
    fn every_kernel_source_compiles_with_nvrtc() {
        if !kernels::nvrtc_present() {
            println!("skipped: libnvrtc not found (set LD_LIBRARY_PATH to a directory holding it)");
            return;
        }
        for (name, source) in kernels::SOURCES {
            let ptx = kernels::compile_ptx(source, "compute_90")
                .unwrap_or_else(|log| panic!("{name} does not compile: {log}"));
            let text = ptx.to_src();
            for func in source
                .split("extern \"C\" __global__ void ")
                .skip(1)
                .filter_map(|rest| {
                    // Skip a `__launch_bounds__(...)` before the name.
                    let rest = match rest.trim_start().strip_prefix("__launch_bounds__") {
                        Some(bounds) => bounds.split_once(')')?.1.trim_start(),
                        None => rest,
                    };
                    rest.split('(').next()
                })
                // Kernels stamped out by a macro (`NAME`) are checked by their own module's test.
                .filter(|name| {
                    !name.is_empty()
                        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                        && *name != "NAME"
                })
            {
                assert!(
                    text.contains(&format!(".entry {func}(")),
                    "{name}: entry {func} missing from the PTX"
                );
            }
        }
    }

    #[test]
    fn coalesce_merges_contiguous_dims_and_drops_ones() {
        let shape = [2, 1, 3, 4];
        let a = contiguous_strides(&shape);
        let (cs, [sa]) = coalesce(&shape, [&a]);
        assert_eq!((cs, sa), (vec![24], vec![1]));
        // b broadcast along dim 2: cannot merge across it.
        let b = [4, 0, 0, 1];
        let (cs, [sa, sb]) = coalesce(&shape, [&a, &b]);
        assert_eq!(cs, vec![2, 3, 4]);
        assert_eq!(sa, vec![12, 4, 1]);
        assert_eq!(sb, vec![4, 0, 1]);
        let (cs, [s]) = coalesce(&[1, 1], [&[0, 0]]);
        assert_eq!((cs, s), (vec![1], vec![0]));
    }

    #[test]
    fn blocks_cover_high_rank_walks_in_row_major_order() {
        // 8 dims, strides of a transposed layout: the blocks' offsets enumerate every
        // element exactly once, with `first` counting row-major.
        let shape = [2, 3, 2, 2, 1, 2, 3, 2];
        let contiguous = contiguous_strides(&shape);
        let reversed: Vec<usize> = contiguous.iter().rev().copied().collect();
        let mut seen = Vec::new();
        let mut firsts = Vec::new();
        for_each_block(&shape, [&reversed], |[o], first, bs, [bst]| {
            assert_eq!(bs.len(), MAX_DIMS);
            firsts.push(first);
            let n: usize = bs.iter().product();
            for i in 0..n {
                let (mut rest, mut off) = (i, o);
                for d in (0..bs.len()).rev() {
                    off += rest % bs[d] * bst[d];
                    rest /= bs[d];
                }
                seen.push(off);
            }
            Ok(())
        })
        .unwrap();
        let total: usize = shape.iter().product();
        assert_eq!(firsts, (0..6).map(|k| k * total / 6).collect::<Vec<_>>());
        seen.sort_unstable();
        assert_eq!(seen, (0..total).collect::<Vec<_>>());
    }
}
