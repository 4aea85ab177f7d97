//! Tiled decoding: [`QwenVaeTiling`] and the tile loop of `AutoencoderKLQwenImage.tiled_decode`
//! on one frame, with its blending, cropping and final crop.

use ddo_core::{CoreError, ForwardContext, Ops, Result, Tensor};
use serde::{Deserialize, Serialize};

use super::blocks::dims4;
use super::decoder::QwenVaeProgram;
use crate::layers::ops;
use crate::vae::{blend, concat};

/// Tiled decoding as `AutoencoderKLQwenImage.enable_tiling(...)` sets it up, in pixels; the
/// latent sizes are these divided (rounding down) by the spatial compression ratio `r`, as
/// Diffusers divides them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QwenVaeTiling {
    /// Decoded tile height (Diffusers' default 256); a latent taller than
    /// `tile_sample_min_height / r` is tiled.
    pub tile_sample_min_height: usize,
    /// Decoded tile width (default 256).
    pub tile_sample_min_width: usize,
    /// Pixels between the starts of vertically neighbouring tiles (default 192).
    pub tile_sample_stride_height: usize,
    /// Pixels between the starts of horizontally neighbouring tiles (default 192).
    pub tile_sample_stride_width: usize,
}

impl Default for QwenVaeTiling {
    /// Diffusers' defaults: 256-pixel tiles every 192 pixels (64 blended).
    fn default() -> Self {
        Self {
            tile_sample_min_height: 256,
            tile_sample_min_width: 256,
            tile_sample_stride_height: 192,
            tile_sample_stride_width: 192,
        }
    }
}

impl QwenVaeTiling {
    /// Latent tile size `(height, width)`: `tile_sample_min_* // r`.
    pub fn latent_tile(&self, ratio: usize) -> (usize, usize) {
        let r = ratio.max(1);
        (
            self.tile_sample_min_height / r,
            self.tile_sample_min_width / r,
        )
    }

    /// Latent stride between tile starts `(height, width)`: `tile_sample_stride_* // r`.
    pub fn latent_stride(&self, ratio: usize) -> (usize, usize) {
        let r = ratio.max(1);
        (
            self.tile_sample_stride_height / r,
            self.tile_sample_stride_width / r,
        )
    }

    /// Pixels blended across a seam `(vertical, horizontal)`: `tile_sample_min_* -
    /// tile_sample_stride_*`.
    pub fn blend_extent(&self) -> (usize, usize) {
        (
            self.tile_sample_min_height
                .saturating_sub(self.tile_sample_stride_height),
            self.tile_sample_min_width
                .saturating_sub(self.tile_sample_stride_width),
        )
    }

    /// Whether Diffusers would tile latents of `h × w` (`_decode`: a side larger than the
    /// latent tile).
    pub fn needs_tiling(&self, h: usize, w: usize, ratio: usize) -> bool {
        let (th, tw) = self.latent_tile(ratio);
        h > th || w > tw
    }

    /// Refuses values for which Diffusers' loop would not make progress (a latent stride of
    /// 0: `range` refuses a step of 0) or would leave gaps (a stride longer than the tile).
    pub fn validate(&self, ratio: usize) -> Result<()> {
        let (th, tw) = self.latent_tile(ratio);
        let (sh, sw) = self.latent_stride(ratio);
        let bad = |value: String, hint: &str| CoreError::InvalidOption {
            option: "Qwen-Image VAE tiling".into(),
            value,
            hint: hint.into(),
        };
        let value = format!(
            "tiles {}x{} px every {}x{} px",
            self.tile_sample_min_height,
            self.tile_sample_min_width,
            self.tile_sample_stride_height,
            self.tile_sample_stride_width
        );
        if th == 0 || tw == 0 || sh == 0 || sw == 0 {
            return Err(bad(
                value,
                &format!(
                    "tile sizes and strides must be at least the spatial compression ratio ({ratio} px)"
                ),
            ));
        }
        if self.tile_sample_stride_height > self.tile_sample_min_height
            || self.tile_sample_stride_width > self.tile_sample_min_width
        {
            return Err(bad(
                value,
                "a stride longer than the tile leaves gaps between tiles",
            ));
        }
        Ok(())
    }

    /// Latent offsets of tile starts along an axis of `len` with latent `stride`:
    /// `range(0, len, stride)`.
    fn starts(len: usize, stride: usize) -> impl Iterator<Item = usize> {
        (0..len).step_by(stride.max(1))
    }

    /// Tile rows and columns over latents of `h × w`.
    pub fn grid(&self, h: usize, w: usize, ratio: usize) -> (usize, usize) {
        let (sh, sw) = self.latent_stride(ratio);
        (h.div_ceil(sh.max(1)), w.div_ceil(sw.max(1)))
    }
}

impl QwenVaeProgram {
    /// `tiled_decode` on one frame: latent tiles of `latent_tile` every `latent_stride`,
    /// each decoded on its own (`post_quant_conv` and the decoder, not clamped); then,
    /// row-major, each decoded tile is blended in place with the (already blended, uncropped)
    /// tile above, then with the one to its left, over `blend_extent` pixels, cropped to the
    /// stride in pixels, the crops concatenated along the width and the rows along the
    /// height, and the result cropped to the latents' size times `r`. Rows are decoded and
    /// blended one at a time (a row needs only the row above), which gives the values of
    /// decoding every tile first.
    pub(super) fn decode_tiled(
        &self,
        ctx: &mut ForwardContext<'_>,
        latents: &Tensor,
        tiling: &QwenVaeTiling,
    ) -> Result<Tensor> {
        let ratio = self.spatial_compression_ratio();
        tiling.validate(ratio)?;
        let z = self.prepare(ctx, latents)?;
        let (_, _, h, w) = dims4(&z, "latents")?;
        let o = ops(ctx)?;
        let (th, tw) = tiling.latent_tile(ratio);
        let (sh, sw) = tiling.latent_stride(ratio);
        let (bh, bw) = tiling.blend_extent();
        let (ch, cw) = (
            tiling.tile_sample_stride_height,
            tiling.tile_sample_stride_width,
        );
        let mut above: Vec<Tensor> = Vec::new();
        let mut rows: Vec<Tensor> = Vec::new();
        for i in QwenVaeTiling::starts(h, sh) {
            let mut current: Vec<Tensor> = Vec::new();
            let mut crops: Vec<Tensor> = Vec::new();
            for (col, j) in QwenVaeTiling::starts(w, sw).enumerate() {
                let tile = {
                    let band = o.narrow(&z, 2, i, th.min(h - i))?;
                    o.narrow(&band, 3, j, tw.min(w - j))?
                };
                let mut decoded = self.decode_tile(ctx, &tile, &mut |_, _| Ok(()))?;
                drop(tile);
                if let Some(a) = above.get(col) {
                    decoded = blend(o, a, decoded, bh, 2)?;
                }
                if let Some(left) = current.last() {
                    decoded = blend(o, left, decoded, bw, 3)?;
                }
                crops.push(crop(o, &decoded, ch, cw)?);
                current.push(decoded);
            }
            above = current;
            rows.push(concat(o, crops, 3)?);
        }
        drop(above);
        crop_image(o, concat(o, rows, 2)?, h * ratio, w * ratio)
    }
}

/// `tile[:, :, :rows, :cols]`, a new tensor (rows first, as a view would be taken).
fn crop(o: &dyn Ops, t: &Tensor, rows: usize, cols: usize) -> Result<Tensor> {
    let (_, _, h, w) = dims4(t, "tile")?;
    let top = o.narrow(t, 2, 0, rows.min(h))?;
    o.narrow(&top, 3, 0, cols.min(w))
}

/// `image[:, :, :rows, :cols]`, `image` itself where it is no larger.
fn crop_image(o: &dyn Ops, image: Tensor, rows: usize, cols: usize) -> Result<Tensor> {
    let (_, _, h, w) = dims4(&image, "image")?;
    let image = if rows < h {
        o.narrow(&image, 2, 0, rows)?
    } else {
        image
    };
    if cols < w {
        o.narrow(&image, 3, 0, cols)
    } else {
        Ok(image)
    }
}
