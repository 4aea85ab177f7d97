//! The image size a pipeline makes of the one asked for. Diffusers rounds `height` and
//! `width` down to whole 2x2 patches of the VAE's latents (and warns); the commands that
//! take `--height`/`--width` (`run`, `bench`, `resolve`) round as it does and say so with
//! [`ImageSize::note`].

use crate::error::CliResult;
use crate::family::AnyPipeline;

/// A size as the pipeline makes it, and why it differs from the one asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageSize {
    /// Height in pixels, a multiple of twice the VAE's scale factor.
    pub height: usize,
    /// Width in pixels, likewise.
    pub width: usize,
    /// Set when the size was rounded: what was asked for, what it became, and why.
    pub note: Option<String>,
}

impl ImageSize {
    /// `height × width` rounded down as `pipe` rounds it (its latent grid times the VAE's
    /// scale factor); a size with no whole patch is refused by the pipeline's own check.
    pub fn of(pipe: &AnyPipeline, height: usize, width: usize) -> CliResult<Self> {
        let (latent_h, latent_w) = pipe.latent_grid(height, width)?;
        let factor = pipe.vae_scale_factor();
        let (h, w) = (latent_h * factor, latent_w * factor);
        let note = ((h, w) != (height, width)).then(|| {
            format!(
                "{width}x{height} rounded down to {w}x{h}: height and width must be multiples of {} (whole 2x2 patches of the {factor}x VAE's latents), as Diffusers resizes them",
                2 * factor
            )
        });
        Ok(Self {
            height: h,
            width: w,
            note,
        })
    }
}
