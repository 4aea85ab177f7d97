//! Peak-memory estimates of a decode, untiled or tiled: a dry run of the decoder's op
//! sequence with its tensor lifetimes, and a closed-form bound for huge tile grids.

use ddo_core::{DType, Device};

#[cfg(doc)]
use super::AutoencoderKL;
use super::{AutoencoderKLConfig, TilingConfig};

/// Live-byte bookkeeping of a simulated forward; `device` answers what each convolution
/// allocates besides its output ([`Device::conv2d_scratch_bytes`]; none without one). The
/// Qwen-Image VAE's estimates (`crate::qwen_vae`) run on it too.
pub(crate) struct PeakSim<'a> {
    elem: u64,
    dtype: DType,
    live: u64,
    /// The most bytes live at once so far.
    pub(crate) peak: u64,
    device: Option<&'a dyn Device>,
}

impl<'a> PeakSim<'a> {
    pub(crate) fn new(dtype: DType, device: Option<&'a dyn Device>) -> Self {
        Self {
            elem: dtype.size_in_bytes() as u64,
            dtype,
            live: 0,
            peak: 0,
            device,
        }
    }

    /// A `k × k` convolution from `cin` to `cout` channels over `hw` elements per channel:
    /// its output, then the backend's scratch on top while it runs; frees `input`.
    pub(crate) fn conv(&mut self, input: u64, cin: usize, cout: usize, k: usize, hw: usize) -> u64 {
        let out = self.alloc(cout * hw);
        let scratch = self
            .device
            .map_or(0, |d| d.conv2d_scratch_bytes(hw, cin, cout, k, self.dtype));
        self.peak = self.peak.max(self.live + scratch);
        self.free(input);
        out
    }

    /// The dtype activations are stored in.
    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }

    /// `elems` elements of the dtype; returns their bytes.
    pub(crate) fn alloc(&mut self, elems: usize) -> u64 {
        let bytes = elems as u64 * self.elem;
        self.live += bytes;
        self.peak = self.peak.max(self.live);
        bytes
    }
    /// Frees `bytes`.
    pub(crate) fn free(&mut self, bytes: u64) {
        self.live -= bytes;
    }
    /// `elems` f32 elements; returns their bytes.
    pub(crate) fn alloc_f32(&mut self, elems: usize) -> u64 {
        let bytes = elems as u64 * 4;
        self.live += bytes;
        self.peak = self.peak.max(self.live);
        bytes
    }

    /// `blend` of a decoded tile of `len` along the blended axis and `cross` across it,
    /// `planes = batch × channels`, over `e` lines; returns the blended tile's bytes.
    pub(crate) fn blend(
        &mut self,
        dec: u64,
        planes: usize,
        e: usize,
        len: usize,
        cross: usize,
    ) -> u64 {
        if e == 0 {
            return dec;
        }
        let weights = self.alloc_f32(2 * e);
        let a_tail = self.alloc(planes * e * cross);
        let from_a = self.step(a_tail, planes * e * cross);
        let b_head = self.alloc(planes * e * cross);
        let from_b = self.step(b_head, planes * e * cross);
        let head = self.alloc(planes * e * cross);
        self.free(from_a + from_b);
        let out = if e == len {
            self.free(dec);
            head
        } else {
            let rest = self.alloc(planes * (len - e) * cross);
            self.free(dec);
            let joined = self.alloc(planes * len * cross);
            self.free(head + rest);
            joined
        };
        self.free(weights);
        out
    }

    /// An op that reads `input` (freed afterwards) and writes `out` elements.
    pub(crate) fn step(&mut self, input: u64, out: usize) -> u64 {
        let b = self.alloc(out);
        self.free(input);
        b
    }

    /// `group_norm_silu` counts as the host's composition (group norm's output, then the
    /// SiLU's); a fused backend (CUDA) never holds the first, so its live bytes there are
    /// lower. For the Flux VAE in bf16 on CUDA the peak is at a convolution (input, output
    /// and its channels-last scratch), which the fusion does not change.
    fn resnet(&mut self, x: u64, cin: usize, cout: usize, hw: usize) -> u64 {
        let mut h = self.alloc(cin * hw); // norm1
        h = self.step(h, cin * hw); // silu
        h = self.conv(h, cin, cout, 3, hw); // conv1
        h = self.step(h, cout * hw); // norm2
        h = self.step(h, cout * hw); // silu
        h = self.conv(h, cout, cout, 3, hw); // conv2
        let residual = if cin != cout {
            self.conv(x, cin, cout, 1, hw)
        } else {
            x
        };
        let out = self.alloc(cout * hw);
        self.free(residual);
        self.free(h);
        out
    }

    fn attention(&mut self, x: u64, c: usize, hw: usize) -> u64 {
        let normed = self.alloc(c * hw);
        let tokens = self.step(normed, c * hw); // permute
        let qkv = self.alloc(3 * c * hw);
        self.free(tokens);
        let attended = self.step(qkv, c * hw);
        let projected = self.step(attended, c * hw);
        let back = self.step(projected, c * hw); // permute
        let out = self.alloc(c * hw);
        self.free(back);
        self.free(x);
        out
    }

    /// The decoder on a `[b, latent, h, w]` tile that stays live; returns the output bytes.
    fn decoder(&mut self, config: &AutoencoderKLConfig, b: usize, h: usize, w: usize) -> u64 {
        let widths: Vec<usize> = config.block_out_channels.iter().rev().copied().collect();
        let top = widths[0];
        let lc = config.latent_channels;
        let mut hw = b * h * w;
        let mut x = if config.use_post_quant_conv {
            let z = self.alloc(lc * hw);
            self.conv(z, lc, top, 3, hw)
        } else {
            // conv_in reads the latents, live for the whole decode.
            let out = self.alloc(top * hw);
            let scratch = self
                .device
                .map_or(0, |d| d.conv2d_scratch_bytes(hw, lc, top, 3, self.dtype));
            self.peak = self.peak.max(self.live + scratch);
            out
        };
        x = self.resnet(x, top, top, hw);
        if config.mid_block_add_attention {
            x = self.attention(x, top, hw);
        }
        x = self.resnet(x, top, top, hw);
        let mut prev = top;
        for (i, &out) in widths.iter().enumerate() {
            for k in 0..=config.layers_per_block {
                let cin = if k == 0 { prev } else { out };
                x = self.resnet(x, cin, out, hw);
            }
            if i + 1 < widths.len() {
                hw *= 4;
                let up = self.step(x, out * hw);
                x = self.conv(up, out, out, 3, hw);
            }
            prev = out;
        }
        let last = widths[widths.len() - 1];
        x = self.step(x, last * hw); // conv_norm_out
        x = self.step(x, last * hw); // silu
        self.conv(x, last, config.out_channels, 3, hw)
    }
}

/// Predicted peak of the decoder's activations on the execution device, in bytes, for an
/// untiled decode of latents `[b, c, h, w]` stored as `dtype`.
///
/// How it is computed: a dry run of exactly the op sequence [`AutoencoderKL::decode`]
/// runs, with the same tensor lifetimes (each op allocates its output, and an
/// intermediate is freed as soon as the op that consumes it has produced its output;
/// a resnet's input stays live until the residual addition, the attention's input until
/// its residual addition). The peak of the live bytes over the run is returned. It
/// includes the latents (on the device for the whole decode) and the decoded image;
/// it excludes the weights (add `component.param_bytes()`, or what the route keeps on the
/// device) and backend scratch that is not a tensor (im2col or attention workspaces, which
/// the host backend keeps in host memory). Reshapes are views and cost nothing. The peak
/// usually falls in the last upsampler or the first resnet after it, where a tensor of
/// the full output resolution at a wide channel count is live with its input.
/// A shape that is not 4-D gives 0.
pub fn estimate_decode_peak_bytes(
    config: &AutoencoderKLConfig,
    latent_shape: &[usize],
    dtype: DType,
) -> u64 {
    estimate_decode_peak_bytes_on(None, config, latent_shape, dtype)
}

/// [`estimate_decode_peak_bytes`] on `device`: each convolution's scratch
/// ([`Device::conv2d_scratch_bytes`]: on CUDA the channels-last copy of a bf16 input, as
/// large as the input) counts on top of the tensors live while it runs. `None`, or the host
/// backend: the tensors alone, which is that backend's exact peak.
pub fn estimate_decode_peak_bytes_on(
    device: Option<&dyn Device>,
    config: &AutoencoderKLConfig,
    latent_shape: &[usize],
    dtype: DType,
) -> u64 {
    let [b, c, h, w] = *latent_shape else {
        return 0;
    };
    if beyond_any_device(config, latent_shape) {
        return u64::MAX;
    }
    let mut sim = PeakSim::new(dtype, device);
    sim.alloc(b * c * h * w); // the latents
    sim.decoder(config, b, h, w);
    sim.peak
}

/// Whether a decode of `latent_shape` is beyond any device: the widest channel count at the
/// full output resolution above 2^40 elements (2 TiB in bf16). The estimates then say
/// `u64::MAX` (which no budget holds) instead of overflowing their element counts or
/// walking billions of tiles.
fn beyond_any_device(config: &AutoencoderKLConfig, latent_shape: &[usize]) -> bool {
    let widest = config
        .block_out_channels
        .iter()
        .copied()
        .chain([config.latent_channels, config.out_channels])
        .max()
        .unwrap_or(1);
    let upscale = 1usize << (2 * config.block_out_channels.len().saturating_sub(1)).min(62);
    latent_shape
        .iter()
        .copied()
        .chain([widest, upscale])
        .try_fold(1usize, usize::checked_mul)
        .is_none_or(|n| n as u64 > 1 << 40)
}

/// [`estimate_decode_peak_bytes`] for a tiled decode with `tiling` (untiled when the
/// latents fit in one tile, as [`AutoencoderKL::decode`] decides). A dry run of the tiled
/// loop with the same lifetimes: the latents, the blended tiles of the row above and of
/// the current row, the crops and finished rows so far, one tile's decode on top, the
/// blends (f32 weights included), the crops and the concatenations.
pub fn estimate_tiled_decode_peak_bytes(
    config: &AutoencoderKLConfig,
    latent_shape: &[usize],
    dtype: DType,
    tiling: &TilingConfig,
) -> u64 {
    estimate_tiled_decode_peak_bytes_on(None, config, latent_shape, dtype, tiling)
}

/// Tiles above which [`estimate_tiled_decode_peak_bytes_on`] gives a closed-form bound
/// ([`tiled_decode_bound`]) instead of a dry run of every tile: a decode of more tiles is
/// days of work on any device, and walking millions of tiles would make a plan that refuses
/// it take minutes and gigabytes.
const MAX_SIMULATED_TILES: usize = 1 << 16;

/// Rows and columns of Diffusers' tile loop over latents of `h × w`.
fn tile_grid(tiling: &TilingConfig, h: usize, w: usize) -> (usize, usize) {
    let stride = tiling.overlap_size().max(1);
    (h.div_ceil(stride), w.div_ceil(stride))
}

/// An upper bound of the tiled decode's peak that does not walk the tiles: the latents,
/// one full tile's decode (its input band and the device's convolution scratch included,
/// as the dry run counts them), the blends' and crop's transients of one tile, two rows of
/// blended tiles, the current row's crops and their concatenation, and the finished image
/// twice (its rows, then their concatenation). Each term is at least what the dry run has
/// live for it, so the bound is never below the dry run's peak (tested).
fn tiled_decode_bound(
    device: Option<&dyn Device>,
    config: &AutoencoderKLConfig,
    latent_shape: &[usize],
    dtype: DType,
    tiling: &TilingConfig,
) -> u64 {
    let [b, c, h, w] = *latent_shape else {
        return 0;
    };
    let elem = dtype.size_in_bytes() as u64;
    let bytes = |dims: &[usize]| {
        dims.iter()
            .fold(elem, |acc, &d| acc.saturating_mul(d as u64))
    };
    let f = config.upsample_factor();
    let oc = config.out_channels;
    let size = tiling.tile_latent_min_size;
    let (th, tw) = (size.min(h), size.min(w));
    let mut one = PeakSim::new(dtype, device);
    let band = one.alloc(b * c * th * w);
    let tile = one.step(band, b * c * th * tw);
    one.decoder(config, b, th, tw);
    one.free(tile);
    let (rows, cols) = tile_grid(tiling, h, w);
    let limit = tiling.row_limit();
    let tile_out = bytes(&[b, oc, th * f, tw * f]);
    let blend_weights = 2 * 4 * 2 * tiling.blend_extent() as u64;
    let image = bytes(&[
        b,
        oc,
        rows.saturating_mul(limit),
        cols.saturating_mul(limit),
    ]);
    [
        bytes(&[b, c, h, w]),
        one.peak,
        tile_out.saturating_mul(7),
        blend_weights,
        tile_out.saturating_mul(cols as u64).saturating_mul(4),
        image.saturating_mul(2),
    ]
    .into_iter()
    .fold(0u64, u64::saturating_add)
}

/// [`estimate_tiled_decode_peak_bytes`] on `device`, its convolutions' scratch counted as
/// [`estimate_decode_peak_bytes_on`] counts it.
pub fn estimate_tiled_decode_peak_bytes_on(
    device: Option<&dyn Device>,
    config: &AutoencoderKLConfig,
    latent_shape: &[usize],
    dtype: DType,
    tiling: &TilingConfig,
) -> u64 {
    let [b, c, h, w] = *latent_shape else {
        return 0;
    };
    if !tiling.needs_tiling(h, w) || tiling.validate().is_err() {
        return estimate_decode_peak_bytes_on(device, config, latent_shape, dtype);
    }
    if beyond_any_device(config, latent_shape) {
        return u64::MAX;
    }
    let (rows, cols) = tile_grid(tiling, h, w);
    if rows.saturating_mul(cols) > MAX_SIMULATED_TILES {
        return tiled_decode_bound(device, config, latent_shape, dtype, tiling);
    }
    let f = config.upsample_factor();
    let oc = config.out_channels;
    let (size, extent, limit) = (
        tiling.tile_latent_min_size,
        tiling.blend_extent(),
        tiling.row_limit(),
    );
    let mut sim = PeakSim::new(dtype, device);
    sim.alloc(b * c * h * w);
    // (bytes, height, width) of the blended, uncropped tiles of the row above.
    let mut above: Vec<(u64, usize, usize)> = Vec::new();
    let mut rows: Vec<u64> = Vec::new();
    let (mut out_h, mut out_w) = (0usize, 0usize);
    for i in tiling.tile_starts(h) {
        let th = size.min(h - i);
        let mut current: Vec<(u64, usize, usize)> = Vec::new();
        let mut crops: Vec<u64> = Vec::new();
        let mut row_w = 0usize;
        for (col, j) in tiling.tile_starts(w).into_iter().enumerate() {
            let tw = size.min(w - j);
            let band = sim.alloc(b * c * th * w);
            let tile = sim.step(band, b * c * th * tw);
            let mut dec = sim.decoder(config, b, th, tw);
            sim.free(tile);
            let (ph, pw) = (th * f, tw * f);
            if let Some(&(_, ah, _)) = above.get(col) {
                dec = sim.blend(dec, b * oc, extent.min(ah).min(ph), ph, pw);
            }
            if let Some(&(_, _, lw)) = current.last() {
                dec = sim.blend(dec, b * oc, extent.min(lw).min(pw), pw, ph);
            }
            let (ch, cw) = (limit.min(ph), limit.min(pw));
            let rows_only = sim.alloc(b * oc * ch * pw);
            crops.push(sim.step(rows_only, b * oc * ch * cw));
            current.push((dec, ph, pw));
            row_w += cw;
        }
        for (bytes, _, _) in above.drain(..) {
            sim.free(bytes);
        }
        above = current;
        let row_h = limit.min(th * f);
        let row = if crops.len() == 1 {
            crops[0]
        } else {
            let r = sim.alloc(b * oc * row_h * row_w);
            sim.free(crops.iter().sum());
            r
        };
        rows.push(row);
        out_h += row_h;
        out_w = row_w;
    }
    for (bytes, _, _) in above.drain(..) {
        sim.free(bytes);
    }
    if rows.len() > 1 {
        sim.alloc(b * oc * out_h * out_w);
    }
    sim.peak
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vae::UP_DECODER_BLOCK;

    /// The closed-form bound is never below the dry run, for the Flux VAE and a small
    /// two-level one, over grids from two tiles to a few hundred, edge tiles included; and a
    /// decode of 178 million tiles gets a bound (finite, at least its image) without a walk.
    #[test]
    fn the_tiled_bound_holds_the_dry_run_and_needs_no_walk() {
        let small = AutoencoderKLConfig {
            block_out_channels: vec![8, 16],
            norm_num_groups: 4,
            up_block_types: vec![UP_DECODER_BLOCK.into(); 2],
            sample_size: 32,
            layers_per_block: 1,
            latent_channels: 4,
            ..AutoencoderKLConfig::flux()
        };
        for config in [AutoencoderKLConfig::flux(), small.clone()] {
            let tiling = TilingConfig::from_config(&config);
            let size = tiling.tile_latent_min_size;
            for (h, w) in [
                (size + 1, size),
                (2 * size + 3, 5 * size - 1),
                (7 * size, 3),
                (4, 20 * size + 5),
            ] {
                let shape = [2, config.latent_channels, h, w];
                for dtype in [DType::F32, DType::BF16] {
                    let exact = estimate_tiled_decode_peak_bytes(&config, &shape, dtype, &tiling);
                    let bound = tiled_decode_bound(None, &config, &shape, dtype, &tiling);
                    assert!(
                        exact <= bound && bound < 64 * exact,
                        "{shape:?} {dtype:?}: dry run {exact}, bound {bound}"
                    );
                }
            }
        }
        // The fixture pipeline's VAE at 2^30 latent rows: 89 million tiles.
        let tiling = TilingConfig::from_config(&small);
        let huge = [1, small.latent_channels, 1 << 30, 2];
        let (rows, cols) = tile_grid(&tiling, huge[2], huge[3]);
        assert!(rows * cols > MAX_SIMULATED_TILES);
        let est = estimate_tiled_decode_peak_bytes(&small, &huge, DType::F32, &tiling);
        let f = small.upsample_factor();
        let image = (huge[2] * f * 2 * f * small.out_channels) as u64 * 4;
        assert!(est >= image && est < u64::MAX, "{est}");
    }
}
