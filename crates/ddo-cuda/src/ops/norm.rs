//! Row-wise ops on the GPU: layer, RMS and group normalisation, softmax over the last dim,
//! reductions over one dim (kernels in `kernels/norm.cu`).

use cudarc::driver::LaunchConfig;
use ddo_core::{ReduceOp, Result, Tensor};

use super::kernels::{self, Arg, grid_1d, launch};
use super::{Out, input, opt_ptr, optional_vector, scratch, shape_err};
use crate::device::CudaDevice;

/// Name of this file's kernel source.
pub(crate) const SOURCE_NAME: &str = "norm.cu";
/// The kernel source.
pub(crate) const SOURCE: &str = include_str!("../../kernels/norm.cu");

/// Elements per block of the group-norm statistics pass.
const GROUP_CHUNK: usize = 8192;
/// Most blocks of a row-per-block launch (kernels loop over the rest).
const MAX_ROW_BLOCKS: usize = 1 << 20;

fn product(dims: &[usize]) -> usize {
    dims.iter().product()
}

/// Longest row the warp-per-row norm kernel takes (`32 * NORM_WARP_MAX` in the source).
const WARP_ROW_MAX: usize = 512;

/// One block per row of `d` elements (threads: a power of two from 32 to 1024, about four
/// elements each).
fn rows_config(rows: usize, d: usize) -> LaunchConfig {
    let threads = d.div_ceil(4).next_power_of_two().clamp(32, 1024) as u32;
    LaunchConfig {
        grid_dim: (rows.clamp(1, MAX_ROW_BLOCKS) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The last dim of `x`, or the host backend's error for a scalar.
fn last_dim(op: &str, x: &Tensor) -> Result<usize> {
    x.shape()
        .last()
        .copied()
        .ok_or_else(|| shape_err(op, "x is a scalar; expected x [..., d]"))
}

/// Layer norm (`rms == false`) or RMS norm over the last dim.
fn row_norm(
    dev: &CudaDevice,
    op: &str,
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f32,
    rms: bool,
) -> Result<Tensor> {
    let d = last_dim(op, x)?;
    let xi = input(dev, op, x)?;
    let wi = optional_vector(dev, op, "weight", weight, d)?;
    let bi = optional_vector(dev, op, "bias", bias, d)?;
    let out = Out::new(dev, op, x.shape().to_vec(), x.dtype())?;
    if out.numel > 0 {
        let rows = out.numel / d;
        let (wp, wc) = opt_ptr(wi.as_ref());
        let (bp, bc) = opt_ptr(bi.as_ref());
        // 16-bit rows of whole 16-byte chunks: vectorised, the row held in registers (8
        // elements a thread; d / 8 lanes per row when that divides a warp, else a block of
        // d / 8 threads). Other short rows: a warp per row. Long rows: a block per row.
        let half = |c: i32| matches!(c, kernels::DTYPE_F16 | kernels::DTYPE_BF16);
        let vec =
            half(xi.code) && half(out.code) && d % 8 == 0 && xi.ptr % 16 == 0 && out.ptr % 16 == 0;
        let lanes = d / 8;
        let (name, cfg) = if vec && lanes <= 32 && 32 % lanes.max(1) == 0 {
            (
                "ddo_row_norm_vec_warp",
                grid_1d((rows.div_ceil(32 / lanes) * 32) as u64, 256),
            )
        } else if vec && lanes % 32 == 0 && lanes <= 1024 {
            (
                "ddo_row_norm_vec_block",
                LaunchConfig {
                    grid_dim: (rows.clamp(1, MAX_ROW_BLOCKS) as u32, 1, 1),
                    block_dim: (lanes as u32, 1, 1),
                    shared_mem_bytes: 0,
                },
            )
        } else if d <= WARP_ROW_MAX {
            ("ddo_row_norm_warp", grid_1d(rows as u64 * 32, 256))
        } else {
            ("ddo_row_norm", rows_config(rows, d))
        };
        let f = dev.kernel(SOURCE_NAME, SOURCE, name)?;
        launch(
            dev,
            &f,
            cfg,
            &[
                Arg::Ptr(xi.ptr),
                Arg::I32(xi.code),
                Arg::Ptr(wp),
                Arg::I32(wc),
                Arg::Ptr(bp),
                Arg::I32(bc),
                Arg::Ptr(out.ptr),
                Arg::I32(out.code),
                Arg::I64(rows as i64),
                Arg::I64(d as i64),
                Arg::F32(eps),
                Arg::I32(i32::from(rms)),
            ],
        )?;
    }
    let mut used = vec![&xi];
    used.extend(wi.as_ref());
    used.extend(bi.as_ref());
    out.finish(dev, &used)
}

/// [`ddo_core::Ops::layer_norm`].
pub(crate) fn layer_norm(
    dev: &CudaDevice,
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f32,
) -> Result<Tensor> {
    row_norm(dev, "layer_norm", x, weight, bias, eps, false)
}

/// [`ddo_core::Ops::rms_norm`].
pub(crate) fn rms_norm(
    dev: &CudaDevice,
    x: &Tensor,
    weight: Option<&Tensor>,
    eps: f32,
) -> Result<Tensor> {
    row_norm(dev, "rms_norm", x, weight, None, eps, true)
}

/// [`ddo_core::Ops::group_norm`]: chunked statistics (mean and M2 per chunk), merged per
/// group, then an element-wise apply over the whole tensor.
pub(crate) fn group_norm(
    dev: &CudaDevice,
    x: &Tensor,
    groups: usize,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f32,
) -> Result<Tensor> {
    const OP: &str = "group_norm";
    let xs = x.shape();
    if xs.len() < 2 || groups == 0 || !xs[1].is_multiple_of(groups) {
        return Err(shape_err(
            OP,
            format!(
                "x {xs:?} with {groups} groups: expected x [n, c, ...] with c divisible by \
                 groups"
            ),
        ));
    }
    let (n, c) = (xs[0], xs[1]);
    let spatial = product(&xs[2..]);
    let xi = input(dev, OP, x)?;
    let wi = optional_vector(dev, OP, "weight", weight, c)?;
    let bi = optional_vector(dev, OP, "bias", bias, c)?;
    let out = Out::new(dev, OP, xs.to_vec(), x.dtype())?;
    if out.numel > 0 {
        let all_groups = n * groups;
        let len = c / groups * spatial;
        let chunks = len.div_ceil(GROUP_CHUNK);
        let (_part_buf, part) = scratch(dev, all_groups * chunks * 3 * 4)?;
        let (_stats_buf, stats) = scratch(dev, all_groups * 2 * 4)?;
        let stats_fn = dev.kernel(SOURCE_NAME, SOURCE, "ddo_group_stats")?;
        let cfg = LaunchConfig {
            grid_dim: (chunks.min(1 << 16) as u32, all_groups.min(65535) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        launch(
            dev,
            &stats_fn,
            cfg,
            &[
                Arg::Ptr(xi.ptr),
                Arg::I32(xi.code),
                Arg::Ptr(part),
                Arg::I64(all_groups as i64),
                Arg::I64(len as i64),
                Arg::I64(GROUP_CHUNK as i64),
                Arg::I64(chunks as i64),
            ],
        )?;
        let merge = dev.kernel(SOURCE_NAME, SOURCE, "ddo_group_merge")?;
        launch(
            dev,
            &merge,
            grid_1d(all_groups as u64, 128),
            &[
                Arg::Ptr(part),
                Arg::Ptr(stats),
                Arg::I64(all_groups as i64),
                Arg::I64(chunks as i64),
                Arg::F32(eps),
            ],
        )?;
        let (wp, wc) = opt_ptr(wi.as_ref());
        let (bp, bc) = opt_ptr(bi.as_ref());
        let apply = dev.kernel(SOURCE_NAME, SOURCE, "ddo_group_apply")?;
        launch(
            dev,
            &apply,
            grid_1d(out.numel as u64, 256),
            &[
                Arg::Ptr(xi.ptr),
                Arg::I32(xi.code),
                Arg::Ptr(stats),
                Arg::Ptr(wp),
                Arg::I32(wc),
                Arg::Ptr(bp),
                Arg::I32(bc),
                Arg::Ptr(out.ptr),
                Arg::I32(out.code),
                Arg::I64(out.numel as i64),
                Arg::I64(len as i64),
                Arg::I64(spatial as i64),
                Arg::I64(c as i64),
            ],
        )?;
    }
    let mut used = vec![&xi];
    used.extend(wi.as_ref());
    used.extend(bi.as_ref());
    out.finish(dev, &used)
}

/// [`ddo_core::Ops::softmax`].
pub(crate) fn softmax(dev: &CudaDevice, x: &Tensor) -> Result<Tensor> {
    const OP: &str = "softmax";
    let d = last_dim(OP, x)?;
    let xi = input(dev, OP, x)?;
    let out = Out::new(dev, OP, x.shape().to_vec(), x.dtype())?;
    if out.numel > 0 {
        let rows = out.numel / d;
        let f = dev.kernel(SOURCE_NAME, SOURCE, "ddo_softmax")?;
        launch(
            dev,
            &f,
            rows_config(rows, d),
            &[
                Arg::Ptr(xi.ptr),
                Arg::I32(xi.code),
                Arg::Ptr(out.ptr),
                Arg::I32(out.code),
                Arg::I64(rows as i64),
                Arg::I64(d as i64),
            ],
        )?;
    }
    out.finish(dev, &[&xi])
}

/// [`ddo_core::Ops::reduce`].
pub(crate) fn reduce(dev: &CudaDevice, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
    const OP: &str = "reduce";
    let xs = x.shape();
    if dim >= xs.len() {
        return Err(shape_err(
            OP,
            format!("dim {dim} out of range for shape {xs:?}"),
        ));
    }
    let (outer, len, inner) = (product(&xs[..dim]), xs[dim], product(&xs[dim + 1..]));
    if len == 0 && op == ReduceOp::Max {
        return Err(shape_err(
            OP,
            format!("max over the empty dim {dim} of shape {xs:?}"),
        ));
    }
    let xi = input(dev, OP, x)?;
    let mut shape = xs.to_vec();
    shape[dim] = 1;
    let out = Out::new(dev, OP, shape, x.dtype())?;
    if out.numel > 0 {
        let code = match op {
            ReduceOp::Sum => 0,
            ReduceOp::Mean => 1,
            ReduceOp::Max => 2,
        };
        if inner == 1 {
            let f = dev.kernel(SOURCE_NAME, SOURCE, "ddo_reduce_rows")?;
            launch(
                dev,
                &f,
                rows_config(outer, len),
                &[
                    Arg::Ptr(xi.ptr),
                    Arg::I32(xi.code),
                    Arg::Ptr(out.ptr),
                    Arg::I32(out.code),
                    Arg::I64(outer as i64),
                    Arg::I64(len as i64),
                    Arg::I32(code),
                ],
            )?;
        } else {
            let f = dev.kernel(SOURCE_NAME, SOURCE, "ddo_reduce_cols")?;
            launch(
                dev,
                &f,
                grid_1d(out.numel as u64, 256),
                &[
                    Arg::Ptr(xi.ptr),
                    Arg::I32(xi.code),
                    Arg::Ptr(out.ptr),
                    Arg::I32(out.code),
                    Arg::I64(outer as i64),
                    Arg::I64(len as i64),
                    Arg::I64(inner as i64),
                    Arg::I32(code),
                ],
            )?;
        }
    }
    out.finish(dev, &[&xi])
}
