//! Tiled decoding: [`TilingConfig`] and the tile loop of Diffusers' `tiled_decode`, with
//! the blending and cropping of the seams.

use ddo_core::{BinaryOp, CoreError, DType, ForwardContext, Ops, Result, Tensor};
use serde::{Deserialize, Serialize};

use super::AutoencoderKLConfig;
use super::blocks::dims4;
use super::decoder::DecoderProgram;
use crate::layers::ops;

/// Tiled decoding, as Diffusers' `AutoencoderKL.tiled_decode` with the model's
/// `tile_latent_min_size`, `tile_sample_min_size` and `tile_overlap_factor` attributes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TilingConfig {
    /// Latent tile size (Diffusers: `int(sample_size / 2^(len(block_out_channels) - 1))`).
    pub tile_latent_min_size: usize,
    /// Decoded tile size (Diffusers: `sample_size`).
    pub tile_sample_min_size: usize,
    /// Overlap between neighbouring tiles, as a fraction (Diffusers: 0.25).
    pub tile_overlap_factor: f64,
}

impl TilingConfig {
    /// Diffusers' defaults for `config`.
    pub fn from_config(config: &AutoencoderKLConfig) -> Self {
        let levels = config.block_out_channels.len().saturating_sub(1) as i32;
        Self {
            // `int(sample_size / (2 ** levels))`: a float division, truncated.
            tile_latent_min_size: (config.sample_size as f64 / 2f64.powi(levels)) as usize,
            tile_sample_min_size: config.sample_size,
            tile_overlap_factor: 0.25,
        }
    }

    /// Latent stride between tile starts: `int(tile_latent_min_size * (1 - overlap))`.
    pub fn overlap_size(&self) -> usize {
        (self.tile_latent_min_size as f64 * (1.0 - self.tile_overlap_factor)) as usize
    }

    /// Pixels blended across a seam: `int(tile_sample_min_size * overlap)`.
    pub fn blend_extent(&self) -> usize {
        (self.tile_sample_min_size as f64 * self.tile_overlap_factor) as usize
    }

    /// Pixels kept of each tile along each axis: `tile_sample_min_size - blend_extent`.
    pub fn row_limit(&self) -> usize {
        self.tile_sample_min_size
            .saturating_sub(self.blend_extent())
    }

    /// Whether Diffusers would tile latents of `h × w` (`_decode`: either side larger
    /// than `tile_latent_min_size`).
    pub fn needs_tiling(&self, h: usize, w: usize) -> bool {
        h > self.tile_latent_min_size || w > self.tile_latent_min_size
    }

    /// Refuses values for which Diffusers' loop would not make progress or crop nothing.
    pub fn validate(&self) -> Result<()> {
        let bad = |option: &str, value: String, hint: &str| CoreError::InvalidOption {
            option: option.into(),
            value,
            hint: hint.into(),
        };
        if self.tile_latent_min_size == 0 || self.tile_sample_min_size == 0 {
            return Err(bad(
                "tile size",
                format!(
                    "{}/{}",
                    self.tile_latent_min_size, self.tile_sample_min_size
                ),
                "tile_latent_min_size and tile_sample_min_size must be positive",
            ));
        }
        if !(0.0..1.0).contains(&self.tile_overlap_factor) {
            return Err(bad(
                "tile_overlap_factor",
                self.tile_overlap_factor.to_string(),
                "must lie in [0, 1)",
            ));
        }
        if self.overlap_size() == 0 || self.row_limit() == 0 {
            return Err(bad(
                "tile_overlap_factor",
                self.tile_overlap_factor.to_string(),
                "leaves no stride between tiles or nothing of a tile; lower it or use larger tiles",
            ));
        }
        Ok(())
    }

    /// Latent offsets of tile starts along an axis of `len`: `range(0, len, overlap_size)`.
    pub fn tile_starts(&self, len: usize) -> Vec<usize> {
        (0..len).step_by(self.overlap_size().max(1)).collect()
    }
}

impl DecoderProgram {
    /// Diffusers' `tiled_decode`: tiles of `tile_latent_min_size` latents every
    /// `overlap_size`, each decoded on its own; then, row-major, each decoded tile is
    /// blended in place with the (already blended) tile above, then with the one to its
    /// left, cropped to `row_limit`, and the crops are concatenated. Rows are decoded and
    /// blended one at a time (a row needs only the row above), which gives the same
    /// values as decoding every tile first.
    pub(super) fn decode_tiled(
        &self,
        ctx: &mut ForwardContext<'_>,
        latents: &Tensor,
        tiling: &TilingConfig,
    ) -> Result<Tensor> {
        tiling.validate()?;
        let z = self.prepare(ctx, latents)?;
        let (_, _, h, w) = dims4(&z, "latents")?;
        let o = ops(ctx)?;
        let (size, extent, limit) = (
            tiling.tile_latent_min_size,
            tiling.blend_extent(),
            tiling.row_limit(),
        );
        let mut above: Vec<Tensor> = Vec::new();
        let mut rows: Vec<Tensor> = Vec::new();
        for i in tiling.tile_starts(h) {
            let mut current: Vec<Tensor> = Vec::new();
            let mut crops: Vec<Tensor> = Vec::new();
            for (col, j) in tiling.tile_starts(w).into_iter().enumerate() {
                let tile = {
                    let band = o.narrow(&z, 2, i, size.min(h - i))?;
                    o.narrow(&band, 3, j, size.min(w - j))?
                };
                let mut decoded = self.decode_tile(ctx, &tile)?;
                drop(tile);
                if let Some(a) = above.get(col) {
                    decoded = blend(o, a, decoded, extent, 2)?;
                }
                if let Some(left) = current.last() {
                    decoded = blend(o, left, decoded, extent, 3)?;
                }
                crops.push(crop(o, &decoded, limit)?);
                current.push(decoded);
            }
            above = current;
            rows.push(concat(o, crops, 3)?);
        }
        drop(above);
        concat(o, rows, 2)
    }
}

/// `blend_v` (`dim` 2) or `blend_h` (`dim` 3): the first `e = min(a, b, extent)` rows
/// (columns) of `b` become `a[-e + y] * (1 - y/e) + b[y] * (y/e)`. The weights are computed
/// in f64 and applied as f32 scalars, as PyTorch applies Python floats to a tensor (the
/// Qwen-Image VAE's `blend_v`/`blend_h` are the same).
pub(crate) fn blend(
    o: &dyn Ops,
    a: &Tensor,
    b: Tensor,
    extent: usize,
    dim: usize,
) -> Result<Tensor> {
    let (a_len, b_len) = (a.shape()[dim], b.shape()[dim]);
    let e = extent.min(a_len).min(b_len);
    if e == 0 {
        return Ok(b);
    }
    let mut shape = vec![1usize; 4];
    shape[dim] = e;
    let y_over_e: Vec<f64> = (0..e).map(|y| y as f64 / e as f64).collect();
    let wa: Vec<f32> = y_over_e.iter().map(|t| (1.0 - t) as f32).collect();
    let wb: Vec<f32> = y_over_e.iter().map(|&t| t as f32).collect();
    let wa = o.tensor_from_f32(&shape, DType::F32, &wa)?;
    let wb = o.tensor_from_f32(&shape, DType::F32, &wb)?;
    let head = {
        let a_tail = o.narrow(a, dim, a_len - e, e)?;
        let from_a = o.binary(&a_tail, &wa, BinaryOp::Mul)?;
        drop(a_tail);
        let b_head = o.narrow(&b, dim, 0, e)?;
        let from_b = o.binary(&b_head, &wb, BinaryOp::Mul)?;
        drop(b_head);
        o.binary(&from_a, &from_b, BinaryOp::Add)?
    };
    if e == b_len {
        return Ok(head);
    }
    let rest = o.narrow(&b, dim, e, b_len - e)?;
    drop(b);
    o.concat(&[&head, &rest], dim)
}

/// `tile[:, :, :limit, :limit]`.
fn crop(o: &dyn Ops, t: &Tensor, limit: usize) -> Result<Tensor> {
    let (_, _, h, w) = dims4(t, "tile")?;
    let rows = o.narrow(t, 2, 0, limit.min(h))?;
    o.narrow(&rows, 3, 0, limit.min(w))
}

/// The concatenation of `parts` along `dim` (the one part itself when there is one).
pub(crate) fn concat(o: &dyn Ops, mut parts: Vec<Tensor>, dim: usize) -> Result<Tensor> {
    if parts.len() == 1
        && let Some(only) = parts.pop()
    {
        return Ok(only);
    }
    let refs: Vec<&Tensor> = parts.iter().collect();
    o.concat(&refs, dim)
}
