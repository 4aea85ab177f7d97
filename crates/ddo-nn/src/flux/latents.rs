//! FluxPipeline's latent packing helpers: 2×2 patches to tokens and back
//! ([`pack_latents`], [`unpack_latents`], [`latent_size`]) and the image tokens' position
//! ids ([`latent_image_ids`]).

use ddo_core::{Ops, Result, Tensor};

use super::shape_err;

/// FluxPipeline's `_pack_latents`: `[b, c, h, w]` → `[b, (h/2)·(w/2), c·4]`, token =
/// `(row, col)` of a 2×2 patch in row-major order, channel = `c·4 + dy·2 + dx`. `latents` must
/// be on `ops`' device; `h` and `w` must be even.
pub fn pack_latents(ops: &dyn Ops, latents: &Tensor) -> Result<Tensor> {
    let &[b, c, h, w] = latents.shape() else {
        return Err(shape_err(
            "pack_latents",
            format!(
                "latents have shape {:?}, expected [b, c, h, w]",
                latents.shape()
            ),
        ));
    };
    if !h.is_multiple_of(2) || !w.is_multiple_of(2) {
        return Err(shape_err(
            "pack_latents",
            format!("latent height {h} and width {w} must be even (2x2 patches)"),
        ));
    }
    let x = latents.reshape(&[b, c, h / 2, 2, w / 2, 2])?;
    let x = ops.permute(&x, &[0, 2, 4, 1, 3, 5])?;
    x.reshape(&[b, (h / 2) * (w / 2), c * 4])
}

/// The latent grid FluxPipeline unpacks to for an image of `height × width` pixels:
/// `2·(height / (vae_scale_factor·2))` by the same for width.
pub fn latent_size(height: usize, width: usize, vae_scale_factor: usize) -> (usize, usize) {
    let f = vae_scale_factor.max(1) * 2;
    (2 * (height / f), 2 * (width / f))
}

/// FluxPipeline's `_unpack_latents(latents, height, width, vae_scale_factor)`:
/// `[b, tokens, c·4]` → `[b, c, h, w]` with `(h, w) = latent_size(height, width,
/// vae_scale_factor)` (`height`, `width` in pixels). `latents` must be on `ops`' device.
pub fn unpack_latents(
    ops: &dyn Ops,
    latents: &Tensor,
    height: usize,
    width: usize,
    vae_scale_factor: usize,
) -> Result<Tensor> {
    let &[b, tokens, channels] = latents.shape() else {
        return Err(shape_err(
            "unpack_latents",
            format!(
                "latents have shape {:?}, expected [b, tokens, channels]",
                latents.shape()
            ),
        ));
    };
    let (h, w) = latent_size(height, width, vae_scale_factor);
    if !channels.is_multiple_of(4) || tokens != (h / 2) * (w / 2) {
        return Err(shape_err(
            "unpack_latents",
            format!(
                "latents {:?} do not fit a {h}x{w} latent grid ({} tokens of 4·c channels) for a \
                 {height}x{width} image with vae_scale_factor {vae_scale_factor}",
                latents.shape(),
                (h / 2) * (w / 2)
            ),
        ));
    }
    let x = latents.reshape(&[b, h / 2, w / 2, channels / 4, 2, 2])?;
    let x = ops.permute(&x, &[0, 3, 1, 4, 2, 5])?;
    x.reshape(&[b, channels / 4, h, w])
}

/// FluxPipeline's `_prepare_latent_image_ids(batch, height, width)`: `(0, row, col)` for a
/// `height × width` token grid (`height`, `width` = latent size / 2), row-major.
pub fn latent_image_ids(height: usize, width: usize) -> Vec<[f32; 3]> {
    (0..height)
        .flat_map(|r| (0..width).map(move |c| [0.0, r as f32, c as f32]))
        .collect()
}
