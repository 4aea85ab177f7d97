//! The decode of [`QwenImagePipeline`]: the plan ([`plan_qwen_decode_on`], the rules of
//! [`TiledDecode`] with the Qwen VAE's estimates and Diffusers' default tiles, 256 pixels
//! every 192) and the decode itself (unpack, un-normalise, `vae.decode` of the one frame,
//! retried tiled once after an out-of-memory in auto mode).

use ddo_core::{CoreError, DType, Device, Result, Tensor, ops_of};

use super::QwenImagePipeline;
use crate::flux::unpack_latents;
use crate::pipeline::decode_plan::decode_does_not_fit;
use crate::pipeline::{DecodePlan, TiledDecode};
use crate::qwen_vae::{
    QwenVaeConfig, QwenVaeTiling, estimate_decode_peak_bytes_on,
    estimate_tiled_decode_peak_bytes_on,
};

/// The only tiles auto mode uses: Diffusers' defaults, when they are valid and split the
/// latents (never smaller: small tiles ruin the image).
fn fallback(config: &QwenVaeConfig, h: usize, w: usize) -> Option<QwenVaeTiling> {
    let t = QwenVaeTiling::default();
    let r = config.spatial_compression_ratio();
    (t.validate(r).is_ok() && t.needs_tiling(h, w, r)).then_some(t)
}

/// Plans the Qwen VAE decode of latents `[b, z, h, w]` stored as `dtype` under `mode`, as
/// [`plan_decode_on`](crate::pipeline::plan_decode_on) plans Flux's: `available` is what
/// the budget leaves free for the decode's activations (auto mode) and `budget` the budget
/// it came from, which a refusal names. The tiles are Diffusers' defaults
/// ([`QwenVaeTiling::default`]), in [`DecodePlan::qwen_tiling`].
pub fn plan_qwen_decode_on(
    device: Option<&dyn Device>,
    config: &QwenVaeConfig,
    latent_shape: &[usize],
    dtype: DType,
    mode: TiledDecode,
    available: Option<u64>,
    budget: Option<u64>,
) -> Result<DecodePlan> {
    let untiled = estimate_decode_peak_bytes_on(device, config, latent_shape, dtype);
    let default = QwenVaeTiling::default();
    let r = config.spatial_compression_ratio();
    let (h, w) = match latent_shape {
        [_, _, h, w] => (*h, *w),
        _ => (0, 0),
    };
    let tile = default.latent_tile(r).0;
    let mut plan = DecodePlan {
        mode,
        tiled: false,
        tiling: None,
        qwen_tiling: None,
        estimate_untiled_bytes: untiled,
        estimate_tiled_bytes: None,
        available_bytes: available,
        retried_after_oom: false,
        reason: String::new(),
    };
    let tiled_estimate = |t: &QwenVaeTiling| {
        estimate_tiled_decode_peak_bytes_on(device, config, latent_shape, dtype, t)
    };
    let human = ddo_metrics::format_bytes;
    match mode {
        TiledDecode::Off => plan.reason = "untiled (--tiled-decode off)".into(),
        TiledDecode::On => match fallback(config, h, w) {
            Some(t) => {
                plan.tiled = true;
                plan.qwen_tiling = Some(t);
                plan.estimate_tiled_bytes = Some(tiled_estimate(&t));
                plan.reason = format!("tiled (--tiled-decode on): {tile}-latent tiles");
            }
            None => {
                plan.reason = format!(
                    "untiled: --tiled-decode on, but the {h}x{w} latents fit in one {tile}-latent tile"
                );
            }
        },
        TiledDecode::Auto => match available {
            None => plan.reason = "untiled (auto: no budget to compare with)".into(),
            Some(free) if untiled <= free => {
                plan.reason = format!(
                    "untiled (auto): estimated activation peak {} fits in {} left by the budget",
                    human(untiled),
                    human(free)
                );
            }
            Some(free) => {
                let tiles = fallback(config, h, w).map(|t| (t, tiled_estimate(&t)));
                match tiles {
                    Some((t, e)) if e <= free => {
                        plan.tiled = true;
                        plan.qwen_tiling = Some(t);
                        plan.estimate_tiled_bytes = Some(e);
                        plan.reason = format!(
                            "tiled (auto): untiled estimate {} exceeds {} left by the budget; \
                             Diffusers' default {tile}-latent tiles, estimate {}",
                            human(untiled),
                            human(free),
                            human(e),
                        );
                    }
                    _ => {
                        let tiled = match tiles {
                            Some((_, e)) => {
                                format!(
                                    ", with Diffusers' default {tile}-latent tiles {}",
                                    human(e)
                                )
                            }
                            None => format!(
                                " (the {h}x{w} latents fit in one default {tile}-latent tile)"
                            ),
                        };
                        let needed = tiles.map_or(untiled, |(_, e)| e.min(untiled));
                        return Err(decode_does_not_fit(untiled, &tiled, needed, free, budget));
                    }
                }
            }
        },
    }
    Ok(plan)
}

impl QwenImagePipeline {
    /// QwenImagePipeline's decode on `device`: `_unpack_latents`, the latents in the VAE's
    /// dtype, `latents / (1 / latents_std) + latents_mean`, `vae.decode(...)[:, :, 0]` (tiled
    /// with `tiling` when the latents exceed a tile), through the VAE's route. Returns the
    /// images `[b, 3, H, W]` on `device`, one per row of `packed`; untiled ones clamped to
    /// [-1, 1], as `_decode` clamps.
    pub fn decode(
        &self,
        device: &dyn Device,
        packed: &Tensor,
        height: usize,
        width: usize,
        tiling: Option<QwenVaeTiling>,
    ) -> Result<Tensor> {
        let ops = ops_of(device)?;
        let lat = packed.to_device(device, &device.compute_stream())?;
        let unpacked = unpack_latents(ops, &lat, height, width, self.vae_scale_factor())?;
        drop(lat);
        let unpacked = if unpacked.dtype() == self.vae.dtype() {
            unpacked
        } else {
            ops.cast(&unpacked, self.vae.dtype())?
        };
        let latents = self.vae.denormalize_latents(device, &unpacked)?;
        drop(unpacked);
        self.vae.decode(device, &latents, tiling)
    }

    /// [`QwenImagePipeline::decode`] as `plan` says; in auto mode, an untiled decode that
    /// runs out of device memory is retried once with Diffusers' default tiles when they
    /// split the latents, and `plan` records it.
    pub fn decode_planned(
        &self,
        device: &dyn Device,
        packed: &Tensor,
        height: usize,
        width: usize,
        plan: &mut DecodePlan,
    ) -> Result<Tensor> {
        match self.decode(device, packed, height, width, plan.qwen_tiling) {
            Err(e @ CoreError::OutOfMemory { .. })
                if !plan.tiled && plan.mode == TiledDecode::Auto =>
            {
                let (h, w) = self.latent_grid(height, width)?;
                let config = self.vae.config();
                let Some(t) = fallback(config, h, w) else {
                    return Err(e);
                };
                device.synchronize()?;
                let b = packed.shape().first().copied().unwrap_or(1);
                let latent_shape = [b, config.z_dim, h, w];
                plan.tiled = true;
                plan.qwen_tiling = Some(t);
                plan.retried_after_oom = true;
                plan.estimate_tiled_bytes = Some(estimate_tiled_decode_peak_bytes_on(
                    Some(device),
                    config,
                    &latent_shape,
                    self.vae.dtype(),
                    &t,
                ));
                plan.reason = format!(
                    "tiled (auto): the untiled decode ran out of device memory; retried once \
                     with {}-latent tiles",
                    t.latent_tile(config.spatial_compression_ratio()).0
                );
                self.decode(device, packed, height, width, Some(t))
            }
            other => other,
        }
    }
}
