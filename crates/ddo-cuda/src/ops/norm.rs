//! Row-wise ops on the GPU: layer, RMS and group normalisation, the fused layer norm +
//! AdaLN modulation, softmax over the last dim, reductions over one dim, the count of
//! non-finite elements (kernels in `kernels/norm.cu`).

use cudarc::driver::LaunchConfig;
use ddo_core::{
    AttentionInput, DType, Device, DeviceBuffer, DeviceSlice, HostSlice, ReduceOp, Result, Tensor,
};

use super::kernels::{self, Arg, grid_1d, launch};
use super::{Out, input, opt_ptr, optional_vector, scratch, shape_err};
use crate::device::CudaDevice;

/// Name of this file's kernel source.
pub(crate) const SOURCE_NAME: &str = "norm.cu";
/// The kernel source.
pub(crate) const SOURCE: &str = include_str!("../../kernels/norm.cu");

/// Elements per block of the scalar group-norm statistics pass (`ddo_group_stats`).
const GROUP_CHUNK: usize = 8192;
/// Most blocks of a row-per-block launch (kernels loop over the rest).
const MAX_ROW_BLOCKS: usize = 1 << 20;

fn product(dims: &[usize]) -> usize {
    dims.iter().product()
}

/// Longest row the warp-per-row norm kernel takes (`32 * NORM_WARP_MAX` in the source).
const WARP_ROW_MAX: usize = 512;

/// How a vector norm kernel (`*_vec_warp` / `*_vec_block`: 16-bit rows in registers, 8
/// elements a thread) lays out rows of `lanes` 8-element vectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum VecRows {
    /// `lanes` threads a row, `32 / lanes` rows a warp (`lanes` divides 32).
    Warp,
    /// One block of `lanes` threads a row (`lanes` a multiple of 32, at most 1024).
    Block,
}

impl VecRows {
    /// The layout for rows of `lanes` vectors, `None` where neither takes them.
    fn for_lanes(lanes: usize) -> Option<Self> {
        if lanes > 0 && lanes <= 32 && 32 % lanes == 0 {
            Some(Self::Warp)
        } else if lanes > 0 && lanes.is_multiple_of(32) && lanes <= 1024 {
            Some(Self::Block)
        } else {
            None
        }
    }

    /// `warp` or `block`, the kernel of this layout.
    fn pick(self, warp: &'static str, block: &'static str) -> &'static str {
        match self {
            Self::Warp => warp,
            Self::Block => block,
        }
    }

    /// The launch of `rows` rows of `lanes` vectors.
    fn config(self, rows: usize, lanes: usize) -> LaunchConfig {
        match self {
            Self::Warp => grid_1d((rows.div_ceil(32 / lanes) * 32) as u64, 256),
            Self::Block => LaunchConfig {
                grid_dim: (rows.clamp(1, MAX_ROW_BLOCKS) as u32, 1, 1),
                block_dim: (lanes as u32, 1, 1),
                shared_mem_bytes: 0,
            },
        }
    }
}

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
        let (name, cfg) = if let Some(v) = VecRows::for_lanes(lanes).filter(|_| vec) {
            (
                v.pick("ddo_row_norm_vec_warp", "ddo_row_norm_vec_block"),
                v.config(rows, lanes),
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

/// [`ddo_core::Ops::attention_input`]: one kernel (`ddo_attention_input_vec`) for 16-bit `x`
/// with a head dim of 8 to 256 elements (a power of two of 16-byte chunks), f32 tables, and
/// a `dst` of `x`'s dtype that nothing else holds (written in place; a new one otherwise);
/// other operands take [`ddo_core::ops::attention_input_composed`].
pub(crate) fn attention_input(
    dev: &CudaDevice,
    part: &AttentionInput<'_>,
    mut dst: Option<Tensor>,
) -> Result<Tensor> {
    const OP: &str = "attention_input";
    let g = part.geometry(OP, dst.as_ref())?;
    let dtype = part.x.dtype();
    let lanes = g.d / 8;
    let tables_f32 = part
        .rope
        .is_none_or(|(c, s)| c.dtype() == DType::F32 && s.dtype() == DType::F32);
    let fits = matches!(dtype, DType::F16 | DType::BF16)
        && g.d.is_multiple_of(8)
        && (1..=32).contains(&lanes)
        && lanes.is_power_of_two()
        && tables_f32
        && dst.as_mut().is_none_or(|t| t.has_exclusive_device_buffer());
    if !fits {
        return ddo_core::ops::attention_input_composed(dev, part, dst);
    }
    let xi = input(dev, OP, part.x)?;
    let wi = optional_vector(dev, OP, "norm weight", part.norm.map(|(w, _)| w), g.d)?;
    let (ci, si) = match part.rope {
        Some((c, s)) => (Some(input(dev, OP, c)?), Some(input(dev, OP, s)?)),
        None => (None, None),
    };
    let out = match &dst {
        Some(_) => None,
        None => Some(Out::new(dev, OP, g.out_shape(), dtype)?),
    };
    let di = dst.as_ref().map(|t| input(dev, OP, t)).transpose()?;
    let y = out
        .as_ref()
        .map_or_else(|| di.as_ref().map_or(0, |d| d.ptr), |o| o.ptr);
    if xi.ptr % 16 != 0 || y % 16 != 0 {
        drop(out);
        return ddo_core::ops::attention_input_composed(dev, part, dst);
    }
    let rows = g.b * g.l * g.heads;
    if rows > 0 {
        let (wp, wc) = opt_ptr(wi.as_ref());
        let f = dev.kernel(SOURCE_NAME, SOURCE, "ddo_attention_input_vec")?;
        launch(
            dev,
            &f,
            grid_1d((rows.div_ceil(32 / lanes) * 32) as u64, 256),
            &[
                Arg::Ptr(xi.ptr),
                Arg::Ptr(wp),
                Arg::I32(wc),
                Arg::Ptr(ci.as_ref().map_or(0, |c| c.ptr)),
                Arg::Ptr(si.as_ref().map_or(0, |s| s.ptr)),
                Arg::Ptr(y),
                Arg::I32(xi.code),
                Arg::I64(rows as i64),
                Arg::I64(g.l as i64),
                Arg::I64(g.heads as i64),
                Arg::I64(g.d as i64),
                Arg::I64(g.start as i64),
                Arg::I64(g.total as i64),
                Arg::F32(part.norm.map_or(0.0, |(_, eps)| eps)),
                Arg::I32(i32::from(part.norm.is_some())),
            ],
        )?;
    }
    let mut used = vec![&xi];
    used.extend(wi.as_ref());
    used.extend(ci.as_ref());
    used.extend(si.as_ref());
    match out {
        Some(out) => out.finish(dev, &used),
        None => {
            used.extend(di.as_ref());
            super::mark_used(dev, &used)?;
            dst.ok_or_else(|| shape_err(OP, "no output"))
        }
    }
}

/// [`ddo_core::Ops::group_norm`]; see [`group_norm_act`].
pub(crate) fn group_norm(
    dev: &CudaDevice,
    x: &Tensor,
    groups: usize,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f32,
) -> Result<Tensor> {
    group_norm_act(dev, x, groups, weight, bias, eps, false)
}

/// [`ddo_core::Ops::group_norm_silu`]: [`group_norm_act`] with SiLU fused into the apply
/// pass (no intermediate tensor; one rounding into the output dtype). Its errors are group
/// norm's, named `group_norm` as the host backend's composition names them.
pub(crate) fn group_norm_silu(
    dev: &CudaDevice,
    x: &Tensor,
    groups: usize,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f32,
) -> Result<Tensor> {
    group_norm_act(dev, x, groups, weight, bias, eps, true)
}

/// Threads per block of the group-norm statistics kernels.
const GROUP_STATS_BLOCK: usize = 256;
/// 16-byte vectors a thread of `ddo_group_stats_vec_*` holds (`GN_STATS_VPT` in the source).
const GROUP_STATS_VPT: usize = 8;
/// Fewest statistics blocks the vectorised chunking aims for when the groups are long enough
/// (about eight per SM of a 132-SM H200, so one batch of 32 groups fills the device).
const GROUP_STATS_TARGET_BLOCKS: usize = 1024;
/// 16-byte vectors per thread and tile of `ddo_group_apply_vec_*` (`GN_APPLY_VPT`).
const GROUP_APPLY_VPT: usize = 4;
/// Elements per thread and tile the scalar apply aims for.
const GROUP_APPLY_SCALAR_PER_THREAD: usize = 4;
/// Most block rows of a launch (`gridDim.y`); kernels loop over the rest.
const MAX_GRID_Y: usize = 65535;
/// Most blocks along x of the group-norm launches; kernels loop over the rest.
const MAX_GRID_X: usize = 1 << 16;

/// Elements of one 16-byte vector of the kernels' dtype `code`.
fn vector_lanes(code: i32) -> usize {
    if code == kernels::DTYPE_F32 { 4 } else { 8 }
}

/// Whether runs of `run` elements of dtype `code`, starting at each of `ptrs`, split into
/// whole, aligned 16-byte vectors (every run starts 16-byte aligned).
fn vectorizable(code: i32, run: usize, ptrs: &[u64]) -> bool {
    run.is_multiple_of(vector_lanes(code)) && ptrs.iter().all(|p| p.is_multiple_of(16))
}

/// Vectors per chunk of the vectorised statistics for `all_groups` groups of `len_vec`
/// vectors: the most a block holds (`GROUP_STATS_BLOCK * GROUP_STATS_VPT`), halved while
/// the launch would have fewer than [`GROUP_STATS_TARGET_BLOCKS`] blocks, down to one vector
/// a thread.
fn stats_chunk_vectors(all_groups: usize, len_vec: usize) -> usize {
    let mut chunk = GROUP_STATS_BLOCK * GROUP_STATS_VPT;
    while chunk > GROUP_STATS_BLOCK
        && all_groups.saturating_mul(len_vec.div_ceil(chunk)) < GROUP_STATS_TARGET_BLOCKS
    {
        chunk /= 2;
    }
    chunk
}

/// One block row per channel plane of `planes` planes of `items` items (vectors or
/// elements), `per_thread` items a thread per tile: threads a power of two from 32 to 256
/// (fewer for short planes), as many tiles along x as cover a plane.
fn plane_config(planes: usize, items: usize, per_thread: usize) -> LaunchConfig {
    let threads = items
        .div_ceil(per_thread)
        .next_power_of_two()
        .clamp(32, 256);
    let tiles = items.div_ceil(threads * per_thread).clamp(1, MAX_GRID_X);
    LaunchConfig {
        grid_dim: (tiles as u32, planes.clamp(1, MAX_GRID_Y) as u32, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The vectorised statistics kernel for x of dtype `code`.
fn stats_vec_kernel(code: i32) -> &'static str {
    match code {
        kernels::DTYPE_F32 => "ddo_group_stats_vec_f32",
        kernels::DTYPE_F16 => "ddo_group_stats_vec_f16",
        _ => "ddo_group_stats_vec_bf16",
    }
}

/// The vectorised apply kernel for x and y of dtype `code`, with SiLU or without.
fn apply_vec_kernel(code: i32, silu: bool) -> &'static str {
    match (code, silu) {
        (kernels::DTYPE_F32, false) => "ddo_group_apply_vec_f32",
        (kernels::DTYPE_F16, false) => "ddo_group_apply_vec_f16",
        (_, false) => "ddo_group_apply_vec_bf16",
        (kernels::DTYPE_F32, true) => "ddo_group_silu_vec_f32",
        (kernels::DTYPE_F16, true) => "ddo_group_silu_vec_f16",
        (_, true) => "ddo_group_silu_vec_bf16",
    }
}

/// Group normalisation, then SiLU when `silu`, in three launches (`kernels/norm.cu`):
///
/// 1. statistics per chunk of each group (count, mean, M2): `ddo_group_stats_vec_*` when the
///    group length is a whole number of 16-byte vectors and `x` is 16-byte aligned (each
///    thread holds up to 8 vectors in registers; chunks of up to 2,048 vectors, halved until
///    the grid has about [`GROUP_STATS_TARGET_BLOCKS`] blocks), else `ddo_group_stats`
///    (chunks of [`GROUP_CHUNK`] elements read twice); grid (chunks, groups);
/// 2. `ddo_group_merge`: a warp per group merges the chunks (Chan, f64) into mean and
///    `1 / sqrt(var + eps)`;
/// 3. apply, a block row per channel plane (`n * c` of them): `ddo_group_apply_vec_*` /
///    `ddo_group_silu_vec_*` when a plane is a whole number of vectors and `x` and the output
///    are 16-byte aligned (one read and one write of 16 bytes per 4 or 8 elements), else the
///    scalar `ddo_group_apply`.
fn group_norm_act(
    dev: &CudaDevice,
    x: &Tensor,
    groups: usize,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f32,
    silu: bool,
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
        let cg = c / groups;
        let len = cg * spatial;
        let stats_rows = all_groups.min(MAX_GRID_Y) as u32;
        let (_stats_buf, stats) = scratch(dev, all_groups * 2 * 4)?;
        // Pass 1: per-chunk partials.
        let (chunks, _part_buf, part) = if vectorizable(xi.code, len, &[xi.ptr]) {
            let lanes = vector_lanes(xi.code);
            let len_vec = len / lanes;
            let chunk_vec = stats_chunk_vectors(all_groups, len_vec);
            debug_assert!(chunk_vec <= GROUP_STATS_BLOCK * GROUP_STATS_VPT);
            let chunks = len_vec.div_ceil(chunk_vec);
            let (part_buf, part) = scratch(dev, all_groups * chunks * 3 * 4)?;
            let f = dev.kernel(SOURCE_NAME, SOURCE, stats_vec_kernel(xi.code))?;
            let cfg = LaunchConfig {
                grid_dim: (chunks.min(MAX_GRID_X) as u32, stats_rows, 1),
                block_dim: (GROUP_STATS_BLOCK as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            launch(
                dev,
                &f,
                cfg,
                &[
                    Arg::Ptr(xi.ptr),
                    Arg::Ptr(part),
                    Arg::I64(all_groups as i64),
                    Arg::I64(len_vec as i64),
                    Arg::I64(chunk_vec as i64),
                    Arg::I64(chunks as i64),
                ],
            )?;
            (chunks, part_buf, part)
        } else {
            let chunks = len.div_ceil(GROUP_CHUNK);
            let (part_buf, part) = scratch(dev, all_groups * chunks * 3 * 4)?;
            let f = dev.kernel(SOURCE_NAME, SOURCE, "ddo_group_stats")?;
            let cfg = LaunchConfig {
                grid_dim: (chunks.min(MAX_GRID_X) as u32, stats_rows, 1),
                block_dim: (GROUP_STATS_BLOCK as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            launch(
                dev,
                &f,
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
            (chunks, part_buf, part)
        };
        // Pass 2: a warp per group.
        let merge = dev.kernel(SOURCE_NAME, SOURCE, "ddo_group_merge")?;
        launch(
            dev,
            &merge,
            grid_1d(all_groups as u64 * 32, 128),
            &[
                Arg::Ptr(part),
                Arg::Ptr(stats),
                Arg::I64(all_groups as i64),
                Arg::I64(chunks as i64),
                Arg::F32(eps),
            ],
        )?;
        // Pass 3: a block row per channel plane.
        let planes = n * c;
        let (wp, wc) = opt_ptr(wi.as_ref());
        let (bp, bc) = opt_ptr(bi.as_ref());
        if xi.code == out.code && vectorizable(xi.code, spatial, &[xi.ptr, out.ptr]) {
            let plane_vec = spatial / vector_lanes(xi.code);
            let f = dev.kernel(SOURCE_NAME, SOURCE, apply_vec_kernel(xi.code, silu))?;
            launch(
                dev,
                &f,
                plane_config(planes, plane_vec, GROUP_APPLY_VPT),
                &[
                    Arg::Ptr(xi.ptr),
                    Arg::Ptr(stats),
                    Arg::Ptr(wp),
                    Arg::I32(wc),
                    Arg::Ptr(bp),
                    Arg::I32(bc),
                    Arg::Ptr(out.ptr),
                    Arg::I64(planes as i64),
                    Arg::I64(plane_vec as i64),
                    Arg::I64(c as i64),
                    Arg::I64(cg as i64),
                ],
            )?;
        } else {
            let f = dev.kernel(SOURCE_NAME, SOURCE, "ddo_group_apply")?;
            launch(
                dev,
                &f,
                plane_config(planes, spatial, GROUP_APPLY_SCALAR_PER_THREAD),
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
                    Arg::I64(planes as i64),
                    Arg::I64(spatial as i64),
                    Arg::I64(c as i64),
                    Arg::I64(cg as i64),
                    Arg::I32(i32::from(silu)),
                ],
            )?;
        }
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

/// Threads per block of the non-finite count's first pass.
const COUNT_BLOCK: u32 = 256;
/// Most blocks of the non-finite count's first pass (each writes one partial count; the
/// second pass, one block, sums them).
const COUNT_MAX_BLOCKS: u64 = 1024;

/// [`ddo_core::Ops::count_non_finite`]: two kernels on the compute stream
/// (`ddo_count_non_finite`, a grid-stride bit test per element with one partial count per
/// block, then `ddo_sum_counts`, one block) into a scratch of `8 · (blocks + 1)` bytes,
/// then an 8-byte read of the total, which waits for the compute stream (the one
/// synchronisation; nothing else is waited for).
pub(crate) fn count_non_finite(dev: &CudaDevice, x: &Tensor) -> Result<u64> {
    let Some((_buffer, head)) = queue_count(dev, x)? else {
        return Ok(0);
    };
    let bytes = ddo_core::device::download(dev, &head, &dev.compute_stream())?;
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[..8]);
    Ok(u64::from_le_bytes(word))
}

/// [`ddo_core::Ops::queue_count_non_finite`]: [`count_non_finite`]'s two kernels, then an
/// asynchronous copy of the 8-byte total into `dst` (pinned memory: nothing waits), on the
/// compute stream; the scratch goes back behind the copy. An empty `x` writes 0 at once.
pub(crate) fn queue_count_non_finite(dev: &CudaDevice, x: &Tensor, dst: &HostSlice) -> Result<()> {
    let dst = dst
        .buffer()
        .slice(dst.offset(), ddo_core::finite::COUNT_BYTES)?;
    match queue_count(dev, x)? {
        None => ddo_core::finite::write_count(&dst, 0),
        Some((buffer, head)) => {
            let compute = dev.compute_stream();
            dev.copy_d2h(&head, &dst, &compute)?;
            dev.release_after(buffer, &compute)
        }
    }
}

/// Queues the count's kernels; returns the scratch and its 8-byte total, `None` for an
/// empty tensor.
fn queue_count(dev: &CudaDevice, x: &Tensor) -> Result<Option<(DeviceBuffer, DeviceSlice)>> {
    const OP: &str = "count_non_finite";
    let xi = input(dev, OP, x)?;
    let n = xi.numel as u64;
    if n == 0 {
        return Ok(None);
    }
    let blocks = n
        .div_ceil(u64::from(COUNT_BLOCK) * 4)
        .clamp(1, COUNT_MAX_BLOCKS);
    let (buffer, ptr) = scratch(dev, 8 * (blocks as usize + 1))?;
    let total = ptr + 8 * blocks;
    let count = dev.kernel(SOURCE_NAME, SOURCE, "ddo_count_non_finite")?;
    launch(
        dev,
        &count,
        LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (COUNT_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        },
        &[
            Arg::Ptr(xi.ptr),
            Arg::I32(xi.code),
            Arg::I64(n as i64),
            Arg::Ptr(ptr),
        ],
    )?;
    let sum = dev.kernel(SOURCE_NAME, SOURCE, "ddo_sum_counts")?;
    launch(
        dev,
        &sum,
        LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (COUNT_MAX_BLOCKS as u32, 1, 1),
            shared_mem_bytes: 0,
        },
        &[Arg::Ptr(ptr), Arg::I64(blocks as i64), Arg::Ptr(total)],
    )?;
    super::mark_used(dev, &[&xi])?;
    let head = buffer.slice(8 * blocks as usize, 8)?;
    Ok(Some((buffer, head)))
}

/// [`ddo_core::Ops::layer_norm_modulate`]: `layer_norm(x) * (1 + scale) + shift` in one
/// kernel (`ddo_ln_modulate*`: f32 math, the row of 16-bit `x` in registers, one rounding
/// at the store) when `scale` and `shift` each hold one row per group of `x`'s rows
/// ([`ddo_core::shape::row_broadcast_group`]: `[b, 1, d]`, `[1, d]`, `[d]`, ...); any other
/// layout takes the composition of plain ops, as on the host.
pub(crate) fn layer_norm_modulate(
    dev: &CudaDevice,
    x: &Tensor,
    eps: f32,
    scale: &Tensor,
    shift: &Tensor,
) -> Result<Tensor> {
    const OP: &str = "layer_norm_modulate";
    let group = |v: &Tensor| ddo_core::shape::row_broadcast_group(x.shape(), v.shape());
    let (Some(gs), Some(gh)) = (group(scale), group(shift)) else {
        return ddo_core::ops::layer_norm_modulate_composed(dev, x, eps, scale, shift);
    };
    let d = last_dim(OP, x)?;
    let xi = input(dev, OP, x)?;
    let si = input(dev, OP, scale)?;
    let hi = input(dev, OP, shift)?;
    let out = Out::new(dev, OP, x.shape().to_vec(), x.dtype())?;
    if out.numel > 0 {
        let rows = out.numel / d;
        let half = |c: i32| matches!(c, kernels::DTYPE_F16 | kernels::DTYPE_BF16);
        let vec =
            half(xi.code) && half(out.code) && d % 8 == 0 && xi.ptr % 16 == 0 && out.ptr % 16 == 0;
        let lanes = d / 8;
        let (name, cfg) = if let Some(v) = VecRows::for_lanes(lanes).filter(|_| vec) {
            (
                v.pick("ddo_ln_modulate_vec_warp", "ddo_ln_modulate_vec_block"),
                v.config(rows, lanes),
            )
        } else {
            ("ddo_ln_modulate", rows_config(rows, d))
        };
        let f = dev.kernel(SOURCE_NAME, SOURCE, name)?;
        launch(
            dev,
            &f,
            cfg,
            &[
                Arg::Ptr(xi.ptr),
                Arg::I32(xi.code),
                Arg::Ptr(si.ptr),
                Arg::I32(si.code),
                Arg::Ptr(hi.ptr),
                Arg::I32(hi.code),
                Arg::Ptr(out.ptr),
                Arg::I32(out.code),
                Arg::I64(rows as i64),
                Arg::I64(d as i64),
                Arg::F32(eps),
                Arg::I64(gs.max(1) as i64),
                Arg::I64(gh.max(1) as i64),
            ],
        )?;
    }
    out.finish(dev, &[&xi, &si, &hi])
}

/// [`ddo_core::Ops::gated_add_layer_norm_modulate`]: `r = x + gate * y` and
/// `layer_norm_modulate(r)` in one kernel (`ddo_gated_ln_modulate_vec_*`: each as its own
/// kernel computes it, the norm on `r` as stored, so the same bytes; `r` is not read back)
/// when `x`, `y` and the outputs are of one 16-bit dtype, whole aligned vectors of 8, `gate`,
/// `scale` and `shift` each one row per group of rows, and the row takes a vector norm
/// kernel; anything else is the two ops.
pub(crate) fn gated_add_layer_norm_modulate(
    dev: &CudaDevice,
    x: &Tensor,
    gate: &Tensor,
    y: &Tensor,
    eps: f32,
    scale: &Tensor,
    shift: &Tensor,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "gated_add_layer_norm_modulate";
    let two_ops = || -> Result<(Tensor, Tensor)> {
        let r = super::elementwise::gated_add(dev, x, gate, y)?;
        let n = layer_norm_modulate(dev, &r, eps, scale, shift)?;
        Ok((r, n))
    };
    let group = |v: &Tensor| ddo_core::shape::row_broadcast_group(x.shape(), v.shape());
    let (Some(gg), Some(gs), Some(gh)) = (group(gate), group(scale), group(shift)) else {
        return two_ops();
    };
    let d = x.shape().last().copied().unwrap_or(0);
    let lanes = d / 8;
    let numel = x.numel();
    let half = matches!(x.dtype(), DType::F16 | DType::BF16);
    // The kernels read the row operands as f32 or 16-bit floats.
    let rowwise = [gate, scale, shift]
        .iter()
        .all(|t| matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16));
    let takes = numel > 0
        && d.is_multiple_of(8)
        && half
        && rowwise
        && y.shape() == x.shape()
        && y.dtype() == x.dtype();
    let Some(layout) = VecRows::for_lanes(lanes).filter(|_| takes) else {
        return two_ops();
    };
    let xi = input(dev, OP, x)?;
    let yi = input(dev, OP, y)?;
    if !(xi.ptr.is_multiple_of(16) && yi.ptr.is_multiple_of(16)) {
        return two_ops();
    }
    let gi = input(dev, OP, gate)?;
    let si = input(dev, OP, scale)?;
    let hi = input(dev, OP, shift)?;
    let r = Out::new(dev, OP, x.shape().to_vec(), x.dtype())?;
    let o = Out::new(dev, OP, x.shape().to_vec(), x.dtype())?;
    // Fresh allocations start on the allocator's 256-byte blocks.
    if !(r.ptr.is_multiple_of(16) && o.ptr.is_multiple_of(16)) {
        drop((r, o));
        return two_ops();
    }
    let rows = numel / d;
    let name = layout.pick(
        "ddo_gated_ln_modulate_vec_warp",
        "ddo_gated_ln_modulate_vec_block",
    );
    let cfg = layout.config(rows, lanes);
    let f = dev.kernel(SOURCE_NAME, SOURCE, name)?;
    launch(
        dev,
        &f,
        cfg,
        &[
            Arg::Ptr(xi.ptr),
            Arg::Ptr(gi.ptr),
            Arg::I32(gi.code),
            Arg::Ptr(yi.ptr),
            Arg::Ptr(r.ptr),
            Arg::Ptr(si.ptr),
            Arg::I32(si.code),
            Arg::Ptr(hi.ptr),
            Arg::I32(hi.code),
            Arg::Ptr(o.ptr),
            Arg::I32(o.code),
            Arg::I64(rows as i64),
            Arg::I64(d as i64),
            Arg::F32(eps),
            Arg::I64(gg.max(1) as i64),
            Arg::I64(gs.max(1) as i64),
            Arg::I64(gh.max(1) as i64),
        ],
    )?;
    let inputs = [&xi, &gi, &yi, &si, &hi];
    let r = r.finish(dev, &inputs)?;
    let o = o.finish(dev, &inputs)?;
    Ok((r, o))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows of 1 to 32 vectors that divide a warp share one; multiples of 32 up to 1024 take
    /// a block each; nothing else takes a vector kernel. The launches cover every row.
    #[test]
    fn vector_rows_take_a_warp_or_a_block() {
        for lanes in [1, 2, 4, 8, 16, 32] {
            assert_eq!(VecRows::for_lanes(lanes), Some(VecRows::Warp), "{lanes}");
            let cfg = VecRows::Warp.config(1000, lanes);
            let threads = u64::from(cfg.grid_dim.0) * u64::from(cfg.block_dim.0);
            assert!(threads >= 1000 * lanes as u64, "{lanes}: {threads} threads");
        }
        for lanes in [64, 96, 384, 1024] {
            assert_eq!(VecRows::for_lanes(lanes), Some(VecRows::Block), "{lanes}");
            let cfg = VecRows::Block.config(5000, lanes);
            assert_eq!((cfg.grid_dim.0, cfg.block_dim.0), (5000, lanes as u32));
        }
        for lanes in [0, 3, 24, 48, 1056] {
            assert_eq!(VecRows::for_lanes(lanes), None, "{lanes}");
        }
        assert_eq!(VecRows::Block.pick("w", "b"), "b");
        assert_eq!(VecRows::Warp.pick("w", "b"), "w");
    }

    /// The group-norm launches of the Flux VAE decoder (batch 1, 32 groups, bf16) fill an
    /// H200 (132 SMs) on both passes; short groups and tiny or countless planes stay inside
    /// the grid limits.
    #[test]
    fn group_norm_launches_fill_the_device_within_grid_limits() {
        let bf16 = kernels::DTYPE_BF16;
        for (c, spatial) in [
            (512usize, 128 * 128),
            (512, 256 * 256),
            (512, 512 * 512),
            (256, 512 * 512),
            (256, 1024 * 1024),
            (128, 1024 * 1024),
        ] {
            let len_vec = c / 32 * spatial / vector_lanes(bf16);
            let chunk = stats_chunk_vectors(32, len_vec);
            assert!(
                (GROUP_STATS_BLOCK..=GROUP_STATS_BLOCK * GROUP_STATS_VPT).contains(&chunk),
                "{chunk}"
            );
            let blocks = 32 * len_vec.div_ceil(chunk);
            assert!(
                blocks >= GROUP_STATS_TARGET_BLOCKS,
                "{c}x{spatial}: {blocks}"
            );
            assert!(len_vec.div_ceil(chunk) <= MAX_GRID_X);
            let cfg = plane_config(c, spatial / vector_lanes(bf16), GROUP_APPLY_VPT);
            assert_eq!(cfg.block_dim, (256, 1, 1));
            let tiles = cfg.grid_dim.0 as usize;
            assert_eq!(cfg.grid_dim.1 as usize, c);
            assert!(tiles * c >= 1024, "{c}x{spatial}: {tiles} tiles a plane");
            assert_eq!(tiles * 256 * GROUP_APPLY_VPT, spatial / 8, "whole tiles");
        }
        // Short groups: the smallest chunk, one of it.
        assert_eq!(stats_chunk_vectors(32, 1), GROUP_STATS_BLOCK);
        assert_eq!(stats_chunk_vectors(1, 0), GROUP_STATS_BLOCK);
        // Countless one-element planes: 32-thread blocks, at most 65,535 rows (kernels loop).
        let cfg = plane_config(1 << 20, 1, GROUP_APPLY_SCALAR_PER_THREAD);
        assert_eq!((cfg.grid_dim, cfg.block_dim), ((1, 65535, 1), (32, 1, 1)));
        // One huge plane: at most 65,536 tiles along x (kernels loop).
        let cfg = plane_config(1, 1 << 40, GROUP_APPLY_VPT);
        assert_eq!(
            (cfg.grid_dim, cfg.block_dim),
            ((1 << 16, 1, 1), (256, 1, 1))
        );
        // A short plane: a power-of-two block of at least a warp.
        assert_eq!(plane_config(3, 63, 4).block_dim, (32, 1, 1));
        assert_eq!(plane_config(3, 300, 4).block_dim, (128, 1, 1));
    }

    #[test]
    fn the_vector_paths_need_whole_aligned_vectors() {
        use kernels::{DTYPE_BF16, DTYPE_F16, DTYPE_F32};
        assert!(vectorizable(DTYPE_BF16, 16, &[0, 256]));
        assert!(vectorizable(DTYPE_F16, 8, &[16]));
        assert!(
            !vectorizable(DTYPE_BF16, 12, &[0]),
            "12 is no whole number of 8 lanes"
        );
        assert!(vectorizable(DTYPE_F32, 12, &[0]), "but of 4 f32 lanes");
        assert!(!vectorizable(DTYPE_BF16, 16, &[0, 2]), "misaligned output");
        assert!(!vectorizable(DTYPE_F32, 4, &[4]), "misaligned input");
        assert_eq!(stats_vec_kernel(DTYPE_F16), "ddo_group_stats_vec_f16");
        assert_eq!(
            apply_vec_kernel(DTYPE_BF16, true),
            "ddo_group_silu_vec_bf16"
        );
        assert_eq!(
            apply_vec_kernel(DTYPE_F32, false),
            "ddo_group_apply_vec_f32"
        );
        // Every kernel name the ops launch is in the source.
        for code in [DTYPE_F32, DTYPE_F16, DTYPE_BF16] {
            for name in [
                stats_vec_kernel(code),
                apply_vec_kernel(code, false),
                apply_vec_kernel(code, true),
            ] {
                assert!(SOURCE.contains(&format!(" {name}(")), "{name}");
            }
        }
        for name in ["ddo_group_stats", "ddo_group_merge", "ddo_group_apply"] {
            assert!(SOURCE.contains(&format!(" {name}(")), "{name}");
        }
    }
}
