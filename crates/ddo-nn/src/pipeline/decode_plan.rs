//! Decode planning: whether the VAE decode runs tiled ([`TiledDecode`]), and the
//! [`DecodePlan`] chosen from the decode's estimated activation peak against the budget.

use ddo_core::{CoreError, DType, Device, Result};
use serde::Serialize;

use crate::qwen_vae::QwenVaeTiling;
use crate::vae::{
    AutoencoderKLConfig, TilingConfig, estimate_decode_peak_bytes_on,
    estimate_tiled_decode_peak_bytes_on,
};

/// Whether the VAE decode runs tiled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TiledDecode {
    /// Tiled, with Diffusers' default tiles (untiled when the latents fit in one tile).
    On,
    /// Untiled.
    Off,
    /// Untiled when the estimated activation peak fits in what the budget leaves free;
    /// otherwise tiled with Diffusers' default tiles ([`TilingConfig::from_config`]) when
    /// they split the latents and their estimate fits; otherwise refused with a typed error
    /// naming the smallest `--vram-budget` that would do. Never tiles smaller than the
    /// default: small tiles ruin the image. An out-of-memory in an untiled decode is retried
    /// once with the default tiles when they split the latents, and returned as it is
    /// otherwise.
    Auto,
}

impl std::str::FromStr for TiledDecode {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "on" => Ok(Self::On),
            "off" => Ok(Self::Off),
            "auto" => Ok(Self::Auto),
            _ => Err(CoreError::InvalidOption {
                option: "tiled-decode".into(),
                value: s.into(),
                hint: "use on, off or auto".into(),
            }),
        }
    }
}

/// What the decode does, and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DecodePlan {
    /// The mode asked for.
    pub mode: TiledDecode,
    /// Whether the decode runs tiled.
    pub tiled: bool,
    /// The tiles, when a Flux-layout VAE decodes tiled.
    pub tiling: Option<TilingConfig>,
    /// The tiles, when Qwen-Image's VAE decodes tiled
    /// ([`plan_qwen_decode_on`](super::plan_qwen_decode_on)).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub qwen_tiling: Option<QwenVaeTiling>,
    /// Estimated activation peak of an untiled decode, bytes.
    pub estimate_untiled_bytes: u64,
    /// Estimated activation peak with `tiling`, bytes.
    pub estimate_tiled_bytes: Option<u64>,
    /// What the budget leaves free for activations, bytes (auto mode).
    pub available_bytes: Option<u64>,
    /// Whether an untiled decode ran out of memory and was retried tiled.
    pub retried_after_oom: bool,
    /// One line on the choice.
    pub reason: String,
}

/// Plans the decode of latents `[b, c, h, w]` stored as `dtype` under `mode`; `available`
/// is what the budget leaves free for the decode's activations (auto mode) and `budget` the
/// budget it was computed from (`None`: the device's own memory), which a refusal names.
///
/// Under [`TiledDecode::Auto`] the decode is untiled when the untiled estimate fits in
/// `available`, else tiled with Diffusers' default tiles when they split the latents and
/// their estimate fits; otherwise it is refused with [`CoreError::DecodeDoesNotFit`],
/// whose hint names the smallest `--vram-budget` that would fit (the budget
/// plus the shortfall, rounded up to a MiB), `--tiled-decode off` and `--height`/`--width`.
/// Auto never picks tiles smaller than the default.
pub fn plan_decode(
    config: &AutoencoderKLConfig,
    latent_shape: &[usize],
    dtype: DType,
    mode: TiledDecode,
    available: Option<u64>,
    budget: Option<u64>,
) -> Result<DecodePlan> {
    plan_decode_on(None, config, latent_shape, dtype, mode, available, budget)
}

/// [`plan_decode`] for a decode on `device`, whose convolution scratch the estimates count
/// ([`estimate_decode_peak_bytes_on`]).
pub fn plan_decode_on(
    device: Option<&dyn Device>,
    config: &AutoencoderKLConfig,
    latent_shape: &[usize],
    dtype: DType,
    mode: TiledDecode,
    available: Option<u64>,
    budget: Option<u64>,
) -> Result<DecodePlan> {
    let untiled = estimate_decode_peak_bytes_on(device, config, latent_shape, dtype);
    let default_tiling = TilingConfig::from_config(config);
    let (h, w) = match latent_shape {
        [_, _, h, w] => (*h, *w),
        _ => (0, 0),
    };
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
    let human = ddo_metrics::format_bytes;
    match mode {
        TiledDecode::Off => plan.reason = "untiled (--tiled-decode off)".into(),
        TiledDecode::On => {
            if default_tiling.needs_tiling(h, w) {
                plan.tiled = true;
                plan.tiling = Some(default_tiling);
                plan.estimate_tiled_bytes = Some(estimate_tiled_decode_peak_bytes_on(
                    device,
                    config,
                    latent_shape,
                    dtype,
                    &default_tiling,
                ));
                plan.reason = format!(
                    "tiled (--tiled-decode on): {}-latent tiles",
                    default_tiling.tile_latent_min_size
                );
            } else {
                plan.reason = format!(
                    "untiled: --tiled-decode on, but the {h}x{w} latents fit in one {}-latent tile",
                    default_tiling.tile_latent_min_size
                );
            }
        }
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
                let tiles = fallback_tiling(&default_tiling, h, w).map(|t| {
                    (
                        t,
                        estimate_tiled_decode_peak_bytes_on(
                            device,
                            config,
                            latent_shape,
                            dtype,
                            &t,
                        ),
                    )
                });
                match tiles {
                    Some((t, e)) if e <= free => {
                        plan.tiled = true;
                        plan.tiling = Some(t);
                        plan.estimate_tiled_bytes = Some(e);
                        plan.reason = format!(
                            "tiled (auto): untiled estimate {} exceeds {} left by the budget; \
                             Diffusers' default {}-latent tiles, estimate {}",
                            human(untiled),
                            human(free),
                            t.tile_latent_min_size,
                            human(e),
                        );
                    }
                    _ => {
                        let tiled = match tiles {
                            Some((t, e)) => format!(
                                ", with Diffusers' default {}-latent tiles {}",
                                t.tile_latent_min_size,
                                human(e)
                            ),
                            None => format!(
                                " (the {h}x{w} latents fit in one default {}-latent tile)",
                                default_tiling.tile_latent_min_size
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

/// The refusal of an auto decode that fits neither untiled nor in Diffusers' default tiles:
/// what it needs, and the smallest budget that gives it `needed` bytes (`budget` plus the
/// shortfall, rounded up to a MiB).
pub(super) fn decode_does_not_fit(
    untiled: u64,
    tiled: &str,
    needed: u64,
    free: u64,
    budget: Option<u64>,
) -> CoreError {
    const MIB: u64 = 1 << 20;
    let human = ddo_metrics::format_bytes;
    let shortfall = needed.saturating_sub(free);
    let raise = match budget {
        Some(b) => {
            let mib = b.saturating_add(shortfall).div_ceil(MIB);
            format!(
                "give --vram-budget {mib}MiB ({}) or more",
                human(mib.saturating_mul(MIB))
            )
        }
        None => format!(
            "free {} more device memory (or give a --vram-budget on a larger device)",
            human(shortfall)
        ),
    };
    CoreError::DecodeDoesNotFit {
        free,
        needs: format!(
            "untiled it needs an estimated {}{tiled}, and auto never tiles smaller than \
             Diffusers' default (smaller tiles ruin the image)",
            human(untiled),
        ),
        hint: format!(
            "{raise}, use --tiled-decode off to decode untiled anyway, or make a smaller \
             image (ddo run's --height/--width; ddo decode's size is its latents')"
        ),
    }
}

/// The only tiles auto mode uses, in its plan and in the out-of-memory retry: Diffusers'
/// default tiles, when they are valid and split `h × w`. Never smaller (small tiles ruin the
/// image), so latents that fit in one default tile get none.
pub(super) fn fallback_tiling(default: &TilingConfig, h: usize, w: usize) -> Option<TilingConfig> {
    (default.validate().is_ok() && default.needs_tiling(h, w)).then_some(*default)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vae::{estimate_decode_peak_bytes, estimate_tiled_decode_peak_bytes};

    #[test]
    fn decode_plans() {
        let c = AutoencoderKLConfig::flux();
        let shape = [1, 16, 128, 128];
        let plan = |mode, available| plan_decode(&c, &shape, DType::BF16, mode, available, None);
        let off = plan(TiledDecode::Off, Some(1)).unwrap();
        assert!(!off.tiled);
        let on = plan(TiledDecode::On, None).unwrap();
        assert!(!on.tiled, "1024 px latents fit Diffusers' 128-latent tile");
        let big = plan(TiledDecode::Auto, Some(u64::MAX)).unwrap();
        assert!(!big.tiled);
        let unknown = plan(TiledDecode::Auto, None).unwrap();
        assert!(!unknown.tiled, "{}", unknown.reason);
        // `on` tiles whatever the budget once the default tile splits the latents.
        let on = plan_decode(
            &c,
            &[1, 16, 256, 256],
            DType::BF16,
            TiledDecode::On,
            Some(1),
            None,
        );
        assert_eq!(on.unwrap().tiling, Some(TilingConfig::from_config(&c)));
    }

    /// The smallest budget an auto refusal names, in MiB.
    fn named_budget_mib(e: &CoreError) -> u64 {
        let CoreError::DecodeDoesNotFit { hint, .. } = e else {
            panic!("not a decode that does not fit: {e}");
        };
        assert!(
            e.to_string()
                .starts_with("--tiled-decode auto (the default) found no decode that fits"),
            "{e}"
        );
        assert!(!e.to_string().contains("invalid value"), "{e}");
        for o in ["--tiled-decode off", "--height/--width"] {
            assert!(hint.contains(o), "{o} missing: {hint}");
        }
        let rest = &hint[hint.find("--vram-budget ").expect("a budget") + 14..];
        rest[..rest.find("MiB").unwrap()].parse().unwrap()
    }

    #[test]
    fn auto_decode_never_tiles_below_the_default_tile() {
        const MIB: u64 = 1 << 20;
        let c = AutoencoderKLConfig::flux();
        let default = TilingConfig::from_config(&c);
        // 2048 px: Diffusers' default 128-latent tiles split the 256x256 latents.
        let shape = [1, 16, 256, 256];
        let untiled = estimate_decode_peak_bytes(&c, &shape, DType::BF16);
        let tiled = estimate_tiled_decode_peak_bytes(&c, &shape, DType::BF16, &default);
        assert!(tiled < untiled, "{tiled} vs {untiled}");
        // The budget leaves `available` free after `held` bytes of weights and the like.
        let held = 300 * MIB + 12_345;
        let plan = |available: u64| {
            plan_decode(
                &c,
                &shape,
                DType::BF16,
                TiledDecode::Auto,
                Some(available),
                Some(available + held),
            )
        };

        // Untiled when it fits.
        let fits = plan(untiled).unwrap();
        assert!(!fits.tiled && fits.tiling.is_none(), "{}", fits.reason);

        // Only the default tiles fit: exactly them.
        for available in [untiled - 1, tiled] {
            let p = plan(available).unwrap();
            assert!(p.tiled, "{}", p.reason);
            assert_eq!(p.tiling, Some(default), "{}", p.reason);
            assert_eq!(p.estimate_tiled_bytes, Some(tiled));
            assert!(
                p.reason.contains("default 128-latent tiles"),
                "{}",
                p.reason
            );
        }

        // Neither fits: refused (smaller tiles would fit but are never used), naming the
        // smallest budget that works: the budget now plus the shortfall, rounded up to a MiB.
        let available = tiled / 4;
        let e = plan(available).unwrap_err();
        eprintln!("{e}");
        let mib = named_budget_mib(&e);
        assert_eq!(mib, (available + held + (tiled - available)).div_ceil(MIB));
        assert!(
            e.to_string()
                .contains(&ddo_metrics::format_bytes(mib * MIB)),
            "{e}"
        );
        // With that budget the plan succeeds, with the default tiles; a MiB less does not.
        let p = plan(mib * MIB - held).unwrap();
        assert_eq!(p.tiling, Some(default), "{}", p.reason);
        assert!(plan((mib - 1) * MIB - held).is_err());

        // Latents that fit in one default tile are never tiled: the refusal asks for the
        // untiled peak, and that budget decodes untiled.
        let small = [1, 16, 128, 128];
        let untiled = estimate_decode_peak_bytes(&c, &small, DType::BF16);
        let plan = |available: u64, budget| {
            plan_decode(
                &c,
                &small,
                DType::BF16,
                TiledDecode::Auto,
                Some(available),
                budget,
            )
        };
        let e = plan(600 * MIB, Some(600 * MIB + held)).unwrap_err();
        assert!(
            e.to_string().contains("fit in one default 128-latent tile"),
            "{e}"
        );
        let mib = named_budget_mib(&e);
        assert_eq!(mib, (untiled + held).div_ceil(MIB));
        let p = plan(mib * MIB - held, Some(mib * MIB)).unwrap();
        assert!(!p.tiled, "{}", p.reason);
        // Without a budget (the device's own memory) the refusal says how much more it needs.
        let e = plan(600 * MIB, None).unwrap_err();
        assert!(
            e.to_string()
                .contains(&ddo_metrics::format_bytes(untiled - 600 * MIB)),
            "{e}"
        );
    }

    #[test]
    fn the_out_of_memory_retry_never_tiles_below_the_default_tile() {
        let c = AutoencoderKLConfig::flux();
        let default = TilingConfig::from_config(&c);
        assert_eq!(default.tile_latent_min_size, 128);
        for (h, w) in [(256, 256), (129, 64), (64, 300)] {
            assert_eq!(fallback_tiling(&default, h, w), Some(default), "{h}x{w}");
        }
        // Latents within one default tile: no retry (previously: tiles half their side).
        for (h, w) in [(128, 128), (64, 96), (1, 1)] {
            assert_eq!(fallback_tiling(&default, h, w), None, "{h}x{w}");
        }
        let invalid = TilingConfig {
            tile_overlap_factor: 1.0,
            ..default
        };
        assert_eq!(fallback_tiling(&invalid, 256, 256), None);
    }
}
