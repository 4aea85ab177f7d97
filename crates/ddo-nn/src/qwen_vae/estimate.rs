//! Peak-memory estimates of a single-frame decode, untiled or tiled: a dry run of the op
//! sequence [`QwenVae::decode`] runs, with its tensor lifetimes, on the Flux VAE's
//! bookkeeping (`vae::PeakSim`), and a closed-form bound for huge tile grids.

use ddo_core::{DType, Device};

#[cfg(doc)]
use super::QwenVae;
use super::{QwenVaeConfig, QwenVaeTiling};
use crate::vae::PeakSim;

impl PeakSim<'_> {
    /// A unary op consuming an exclusively held input (`Ops::unary_owned`): the input goes
    /// before the output is made, so the two are never live together.
    fn owned(&mut self, input: u64, out: usize) -> u64 {
        self.free(input);
        self.alloc(out)
    }

    /// `channel_rms_norm` of a live `[.., c, ..]` input of `hw` positions (batch included):
    /// the f32 squares (a cast, then squared in place, for 16-bit inputs), their sum, its
    /// square root, the eps scalar, the clamped norm, then `x / norm`, `· scale`, `· gamma`
    /// in the input's dtype, each freeing the one before. Returns the output's bytes.
    fn qwen_rms(&mut self, c: usize, hw: usize, dtype: DType) -> u64 {
        let mut squares = self.alloc_f32(c * hw);
        if dtype != DType::F32 {
            self.free(squares);
            squares = self.alloc_f32(c * hw);
        }
        let sum = self.alloc_f32(hw);
        self.free(squares);
        self.free(sum);
        let norm = self.alloc_f32(hw);
        let eps = self.alloc_f32(1);
        let denom = self.alloc_f32(hw);
        self.free(norm + eps);
        let normalized = self.alloc(c * hw);
        self.free(denom);
        let scaled = self.step(normalized, c * hw);
        self.step(scaled, c * hw)
    }

    /// A residual block on `x` (live until the residual addition or the shortcut).
    fn qwen_resnet(&mut self, x: u64, cin: usize, cout: usize, hw: usize, dtype: DType) -> u64 {
        let h = self.qwen_rms(cin, hw, dtype);
        let h = self.owned(h, cin * hw);
        let h = self.conv(h, cin, cout, 3, hw);
        let n = self.qwen_rms(cout, hw, dtype);
        self.free(h);
        let h = self.owned(n, cout * hw);
        let h = self.conv(h, cout, cout, 3, hw);
        let shortcut = if cin != cout {
            self.conv(x, cin, cout, 1, hw)
        } else {
            x
        };
        let out = self.alloc(cout * hw);
        self.free(shortcut + h);
        out
    }

    /// The attention block on `x` (live until the residual addition).
    fn qwen_attention(&mut self, x: u64, c: usize, hw: usize, dtype: DType) -> u64 {
        let normed = self.qwen_rms(c, hw, dtype);
        let tokens = self.step(normed, c * hw); // permute
        let qkv = self.step(tokens, 3 * c * hw); // to_qkv
        let thirds = self.alloc(3 * c * hw); // three narrows
        self.free(qkv);
        let attended = self.step(thirds, c * hw);
        let projected = self.step(attended, c * hw);
        let back = self.step(projected, c * hw); // permute
        let out = self.alloc(c * hw);
        self.free(back + x);
        out
    }

    /// `post_quant_conv` and the decoder on a live `[b, z, h, w]` tile, unclamped; returns
    /// the output's bytes.
    fn qwen_decoder(&mut self, config: &QwenVaeConfig, b: usize, h: usize, w: usize) -> u64 {
        let dtype = self.dtype();
        let z = config.z_dim;
        let top = config.top_width();
        let mut hw = b * h * w;
        let pqc = self.conv(0, z, z, 1, hw); // the tile stays live
        let mut x = self.conv(pqc, z, top, 3, hw);
        x = self.qwen_resnet(x, top, top, hw, dtype);
        x = self.qwen_attention(x, top, hw, dtype);
        x = self.qwen_resnet(x, top, top, hw, dtype);
        for spec in config.up_blocks() {
            for k in 0..spec.resnets {
                let cin = if k == 0 { spec.in_dim } else { spec.out_dim };
                x = self.qwen_resnet(x, cin, spec.out_dim, hw, dtype);
            }
            if spec.upsampler.is_some() {
                hw *= 4;
                let up = self.step(x, spec.out_dim * hw);
                x = self.conv(up, spec.out_dim, spec.out_dim / 2, 3, hw);
            }
        }
        let last = config.last_width();
        let normed = self.qwen_rms(last, hw, dtype);
        self.free(x);
        let x = self.owned(normed, last * hw);
        self.conv(x, last, config.input_channels, 3, hw)
    }
}

/// Predicted peak of the decoder's activations on the execution device, in bytes, for an
/// untiled decode of one frame of latents `[b, z, h, w]` with weights of `dtype`.
///
/// A dry run of exactly the op sequence [`QwenVae::decode`] runs, with the same tensor
/// lifetimes (each op allocates its output; an intermediate is freed as soon as the op that
/// consumes it has produced its output; a residual block's input stays live until its
/// residual addition, the attention block's until its own; the RMS norm's f32 squares and
/// scalars are counted). It includes the latents (counted in `dtype`, on the device for the
/// whole decode), the clamp and the decoded image, and excludes the weights (add
/// `component.param_bytes()`, or what the route keeps on the device) and backend scratch
/// that is not a tensor. On the host backend it is the exact peak, so an upper bound of it;
/// the peak falls at the last up blocks, where the full resolution is live at the widest
/// channel count there. A shape that is not 4-D gives 0.
pub fn estimate_decode_peak_bytes(
    config: &QwenVaeConfig,
    latent_shape: &[usize],
    dtype: DType,
) -> u64 {
    estimate_decode_peak_bytes_on(None, config, latent_shape, dtype)
}

/// [`estimate_decode_peak_bytes`] on `device`: each convolution's scratch
/// ([`Device::conv2d_scratch_bytes`]) counts on top of the tensors live while it runs.
/// `None`, or the host backend: the tensors alone.
pub fn estimate_decode_peak_bytes_on(
    device: Option<&dyn Device>,
    config: &QwenVaeConfig,
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
    let x = sim.qwen_decoder(config, b, h, w);
    // clamp: the two scalars, the max, the min.
    let scalars = sim.alloc_f32(2);
    let r = config.spatial_compression_ratio();
    let pixels = b * config.input_channels * h * r * w * r;
    let floor = sim.alloc(pixels);
    sim.alloc(pixels);
    sim.free(floor + scalars + x);
    sim.peak
}

/// Whether a decode of `latent_shape` is beyond any device: the widest channel count at the
/// full output resolution above 2^40 elements. The estimates then say `u64::MAX` (which no
/// budget holds) instead of overflowing their element counts.
fn beyond_any_device(config: &QwenVaeConfig, latent_shape: &[usize]) -> bool {
    let widest = config
        .decoder_widths()
        .into_iter()
        .chain([config.z_dim, config.input_channels])
        .max()
        .unwrap_or(1);
    let r = config.spatial_compression_ratio();
    latent_shape
        .iter()
        .copied()
        .chain([widest, r, r])
        .try_fold(1usize, usize::checked_mul)
        .is_none_or(|n| n as u64 > 1 << 40)
}

/// Tiles above which [`estimate_tiled_decode_peak_bytes_on`] gives a closed-form bound
/// ([`tiled_decode_bound`]) instead of a dry run of every tile (as the Flux VAE's does).
const MAX_SIMULATED_TILES: usize = 1 << 16;

/// [`estimate_decode_peak_bytes`] for a decode with `tiling` (untiled when the latents fit
/// in one tile, as [`QwenVae::decode`] decides): a dry run of the tiled loop with the same
/// lifetimes — the latents, the blended tiles of the row above and of the current row, the
/// crops and finished rows so far, one tile's decode on top, the blends (f32 weights
/// included), the crops, the concatenations and the final crop.
pub fn estimate_tiled_decode_peak_bytes(
    config: &QwenVaeConfig,
    latent_shape: &[usize],
    dtype: DType,
    tiling: &QwenVaeTiling,
) -> u64 {
    estimate_tiled_decode_peak_bytes_on(None, config, latent_shape, dtype, tiling)
}

/// An upper bound of the tiled decode's peak that does not walk the tiles: the latents, one
/// full tile's decode (its input band included), the blends' and crop's transients of one
/// tile, two rows of blended tiles, the current row's crops and their concatenation, and the
/// whole image twice (its rows and their concatenation, or that and its final crop). Each
/// term is at least what the dry run has live for it (tested).
fn tiled_decode_bound(
    device: Option<&dyn Device>,
    config: &QwenVaeConfig,
    latent_shape: &[usize],
    dtype: DType,
    tiling: &QwenVaeTiling,
) -> u64 {
    let [b, c, h, w] = *latent_shape else {
        return 0;
    };
    let r = config.spatial_compression_ratio();
    let elem = dtype.size_in_bytes() as u64;
    let bytes = |dims: &[usize]| {
        dims.iter()
            .fold(elem, |acc, &d| acc.saturating_mul(d as u64))
    };
    let oc = config.input_channels;
    let (lt_h, lt_w) = tiling.latent_tile(r);
    let (th, tw) = (lt_h.min(h), lt_w.min(w));
    let mut one = PeakSim::new(dtype, device);
    let band = one.alloc(b * c * th * w);
    let tile = one.step(band, b * c * th * tw);
    one.qwen_decoder(config, b, th, tw);
    one.free(tile);
    let (rows, cols) = tiling.grid(h, w, r);
    let (bh, bw) = tiling.blend_extent();
    let tile_out = bytes(&[b, oc, th * r, tw * r]);
    let blend_weights = 2 * 4 * 2 * bh.max(bw) as u64;
    let image = bytes(&[
        b,
        oc,
        rows.saturating_mul(tiling.tile_sample_stride_height),
        cols.saturating_mul(tiling.tile_sample_stride_width),
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
    config: &QwenVaeConfig,
    latent_shape: &[usize],
    dtype: DType,
    tiling: &QwenVaeTiling,
) -> u64 {
    let [b, c, h, w] = *latent_shape else {
        return 0;
    };
    let r = config.spatial_compression_ratio();
    if !tiling.needs_tiling(h, w, r) || tiling.validate(r).is_err() {
        return estimate_decode_peak_bytes_on(device, config, latent_shape, dtype);
    }
    if beyond_any_device(config, latent_shape) {
        return u64::MAX;
    }
    let (rows, cols) = tiling.grid(h, w, r);
    if rows.saturating_mul(cols) > MAX_SIMULATED_TILES {
        return tiled_decode_bound(device, config, latent_shape, dtype, tiling);
    }
    let oc = config.input_channels;
    let (lt_h, lt_w) = tiling.latent_tile(r);
    let (ls_h, ls_w) = tiling.latent_stride(r);
    let (bh, bw) = tiling.blend_extent();
    let (ch, cw) = (
        tiling.tile_sample_stride_height,
        tiling.tile_sample_stride_width,
    );
    let mut sim = PeakSim::new(dtype, device);
    sim.alloc(b * c * h * w);
    // (bytes, height, width) of the blended, uncropped tiles of the row above.
    let mut above: Vec<(u64, usize, usize)> = Vec::new();
    let mut finished: Vec<u64> = Vec::new();
    let (mut out_h, mut out_w) = (0usize, 0usize);
    for i in (0..h).step_by(ls_h) {
        let th = lt_h.min(h - i);
        let mut current: Vec<(u64, usize, usize)> = Vec::new();
        let mut crops: Vec<u64> = Vec::new();
        let (mut row_h, mut row_w) = (0usize, 0usize);
        for (col, j) in (0..w).step_by(ls_w).enumerate() {
            let tw = lt_w.min(w - j);
            let band = sim.alloc(b * c * th * w);
            let tile = sim.step(band, b * c * th * tw);
            let mut dec = sim.qwen_decoder(config, b, th, tw);
            sim.free(tile);
            let (ph, pw) = (th * r, tw * r);
            if let Some(&(_, ah, _)) = above.get(col) {
                dec = sim.blend(dec, b * oc, bh.min(ah).min(ph), ph, pw);
            }
            if let Some(&(_, _, lw)) = current.last() {
                dec = sim.blend(dec, b * oc, bw.min(lw).min(pw), pw, ph);
            }
            let (kh, kw) = (ch.min(ph), cw.min(pw));
            let top = sim.alloc(b * oc * kh * pw);
            crops.push(sim.step(top, b * oc * kh * kw));
            current.push((dec, ph, pw));
            row_h = kh;
            row_w += kw;
        }
        for (bytes, _, _) in above.drain(..) {
            sim.free(bytes);
        }
        above = current;
        let row = if crops.len() == 1 {
            crops[0]
        } else {
            let r = sim.alloc(b * oc * row_h * row_w);
            sim.free(crops.iter().sum());
            r
        };
        finished.push(row);
        out_h += row_h;
        out_w = row_w;
    }
    for (bytes, _, _) in above.drain(..) {
        sim.free(bytes);
    }
    let mut image = if finished.len() == 1 {
        finished[0]
    } else {
        let joined = sim.alloc(b * oc * out_h * out_w);
        sim.free(finished.iter().sum());
        joined
    };
    let (sample_h, sample_w) = (h * r, w * r);
    if sample_h < out_h {
        let cropped = sim.alloc(b * oc * sample_h * out_w);
        sim.free(image);
        image = cropped;
        out_h = sample_h;
    }
    if sample_w < out_w {
        sim.alloc(b * oc * out_h * sample_w);
        sim.free(image);
    }
    sim.peak
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The closed-form bound is never below the dry run, for Qwen-Image's VAE and the tiny
    /// one, over grids from two tiles to a few hundred, edge tiles included; and a decode of
    /// a hundred million tiles gets a bound (finite, at least its image) without a walk.
    #[test]
    fn the_tiled_bound_holds_the_dry_run_and_needs_no_walk() {
        let tiny_tiling = QwenVaeTiling {
            tile_sample_min_height: 16,
            tile_sample_min_width: 16,
            tile_sample_stride_height: 12,
            tile_sample_stride_width: 12,
        };
        for (config, tiling) in [
            (QwenVaeConfig::qwen_image(), QwenVaeTiling::default()),
            (QwenVaeConfig::tiny(), tiny_tiling),
            (QwenVaeConfig::tiny(), QwenVaeTiling::default()),
        ] {
            let r = config.spatial_compression_ratio();
            let (size, _) = tiling.latent_tile(r);
            for (h, w) in [
                (size + 1, size),
                (2 * size + 3, 5 * size - 1),
                (7 * size, 3),
                (4, 20 * size + 5),
            ] {
                let shape = [2, config.z_dim, h, w];
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
        let config = QwenVaeConfig::tiny();
        let huge = [1, config.z_dim, 1 << 28, 2];
        let (rows, cols) = tiny_tiling.grid(huge[2], huge[3], 4);
        assert!(rows * cols > MAX_SIMULATED_TILES);
        let est = estimate_tiled_decode_peak_bytes(&config, &huge, DType::F32, &tiny_tiling);
        let image = (huge[2] * 4 * 2 * 4 * config.input_channels) as u64 * 4;
        assert!(est >= image && est < u64::MAX, "{est}");
    }
}
