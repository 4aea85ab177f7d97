//! [`QwenVaeConfig`]: Diffusers' `AutoencoderKLQwenImage` `config.json`, its validation, the
//! decoder's widths it implies, and the latent un-normalisation `QwenImagePipeline` applies
//! before decoding.

use std::path::Path;

use ddo_core::{BinaryOp, Ops, Result, Tensor};
use serde::{Deserialize, Serialize};

use super::CLASS_NAME;
use crate::error::{LoadError, LoadResult};

/// The accepted magnitude of each `latents_std` (Qwen-Image's are 1.1 to 3.3): the
/// pipeline divides the latents by `1 / std` computed in f32 (issue 34).
pub const LATENTS_STD_RANGE: (f64, f64) = (1e-6, 1e6);

/// The largest `latents_mean` magnitude accepted (Qwen-Image's are within 1.6): it is added
/// to every latent before the decode.
pub const MAX_LATENTS_MEAN: f64 = 1e4;

/// Qwen-Image's `latents_mean` (Diffusers' default), one per latent channel.
pub const QWEN_IMAGE_LATENTS_MEAN: [f64; 16] = [
    -0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715, 0.5517,
    -0.3632, -0.1922, -0.9497, 0.2503, -0.2921,
];

/// Qwen-Image's `latents_std` (Diffusers' default), one per latent channel.
pub const QWEN_IMAGE_LATENTS_STD: [f64; 16] = [
    2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652, 1.5579,
    1.6382, 1.1253, 2.8251, 1.9160,
];

/// The fields of `AutoencoderKLQwenImage`'s config (Diffusers 0.42.1 `register_to_config`);
/// missing fields take Diffusers' defaults, which are Qwen-Image's
/// ([`QwenVaeConfig::qwen_image`]). Unknown fields (`_diffusers_version`, ...) are ignored as
/// Diffusers ignores them, except those that would make another network than the one DDO
/// runs: a `_class_name` other than `AutoencoderKLQwenImage`, and the switches of Diffusers'
/// `AutoencoderKLWan` variants (`is_residual`, `patch_size`, `decoder_base_dim`), which
/// [`QwenVaeConfig::from_json`] refuses by name.
///
/// `attn_scales` changes the encoder only (Diffusers' decoder never reads it) and `dropout`
/// is the identity at inference: both are accepted as they are.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct QwenVaeConfig {
    /// Base width; the decoder's widths are `base_dim · dim_mult[i]`.
    pub base_dim: usize,
    /// Latent channels.
    pub z_dim: usize,
    /// Width multipliers per resolution level (encoder order; the decoder runs them reversed).
    pub dim_mult: Vec<usize>,
    /// Residual blocks per encoder level; each decoder up block has one more.
    pub num_res_blocks: usize,
    /// Scales at which the encoder adds attention blocks (the decoder has none).
    pub attn_scales: Vec<f64>,
    /// Whether each encoder downsampling also halves time; reversed, whether each decoder
    /// upsampler is `upsample3d` (its `time_conv` never runs on one frame) or `upsample2d`.
    /// One entry per level but the last.
    pub temperal_downsample: Vec<bool>,
    /// Dropout rate (identity at inference).
    pub dropout: f64,
    /// Image channels (the decoder's output).
    pub input_channels: usize,
    /// Per-channel mean of the latents (`z_dim` values).
    pub latents_mean: Vec<f64>,
    /// Per-channel standard deviation of the latents (`z_dim` values).
    pub latents_std: Vec<f64>,
}

impl Default for QwenVaeConfig {
    /// Diffusers' constructor defaults (Qwen-Image's VAE).
    fn default() -> Self {
        Self {
            base_dim: 96,
            z_dim: 16,
            dim_mult: vec![1, 2, 4, 4],
            num_res_blocks: 2,
            attn_scales: Vec::new(),
            temperal_downsample: vec![false, true, true],
            dropout: 0.0,
            input_channels: 3,
            latents_mean: QWEN_IMAGE_LATENTS_MEAN.to_vec(),
            latents_std: QWEN_IMAGE_LATENTS_STD.to_vec(),
        }
    }
}

/// How a decoder up block ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upsampler {
    /// Diffusers' `upsample2d`: nearest 2× and a 3×3 convolution halving the channels.
    Spatial,
    /// Diffusers' `upsample3d`: the same, plus a `time_conv` that doubles the frames of every
    /// chunk but the first; one frame is the first chunk, so it never runs (and is not loaded).
    SpatioTemporal,
}

/// One decoder up block: `resnets` residual blocks from `in_dim` to `out_dim` channels, then
/// the upsampler (if any) to `out_dim / 2` channels at twice the resolution.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UpBlockSpec {
    /// Input channels.
    pub in_dim: usize,
    /// Channels of the residual blocks.
    pub out_dim: usize,
    /// Residual blocks (`num_res_blocks + 1`).
    pub resnets: usize,
    /// The upsampler; `None` for the last block.
    pub upsampler: Option<Upsampler>,
}

/// Fields of Diffusers' `AutoencoderKLWan` variants (Wan 2.2's VAE) that change the network:
/// present in a config, they mean a model DDO does not run.
const WAN_SWITCHES: [(&str, &str); 3] = [
    (
        "is_residual",
        "Wan 2.2's residual VAE (AutoencoderKLWan with is_residual) is not Qwen-Image's; DDO \
         runs AutoencoderKLQwenImage only",
    ),
    (
        "patch_size",
        "a patchified VAE (AutoencoderKLWan with patch_size) is not Qwen-Image's; DDO runs \
         AutoencoderKLQwenImage only",
    ),
    (
        "decoder_base_dim",
        "a decoder wider than its encoder (AutoencoderKLWan's decoder_base_dim) is not \
         Qwen-Image's VAE; DDO runs AutoencoderKLQwenImage only",
    ),
];

impl QwenVaeConfig {
    /// Qwen-Image's VAE (`Qwen/Qwen-Image`'s `vae/config.json`, Diffusers' defaults):
    /// base width 96, multipliers `[1, 2, 4, 4]` (decoder widths 384, 384, 384, 192, 96),
    /// two residual blocks a level (three an up block), 16 latent channels, temporal
    /// downsampling `[false, true, true]`, 8× spatial compression.
    pub fn qwen_image() -> Self {
        Self::default()
    }

    /// A tiny Qwen-Image VAE for tests and CI (`qwen-tiny`, the `qwen_vae` fixture's config,
    /// whose 4 latent channels are the `qwen-tiny` transformer's): base width 8, multipliers
    /// `[1, 2, 2]` (decoder widths 16, 16, 16, 8), one residual block a level, temporal
    /// downsampling `[false, true]` (an `upsample3d` and an `upsample2d` up block), 4×
    /// spatial compression, made-up latent statistics.
    pub fn tiny() -> Self {
        Self {
            base_dim: 8,
            z_dim: 4,
            dim_mult: vec![1, 2, 2],
            num_res_blocks: 1,
            temperal_downsample: vec![false, true],
            latents_mean: vec![0.25, -0.5, 0.125, -0.0625],
            latents_std: vec![1.5, 0.75, 2.5, 1.25],
            ..Self::default()
        }
    }

    /// The config of a named model: `qwen-image` or `qwen-tiny`.
    pub fn named(name: &str) -> Option<Self> {
        match name {
            "qwen-image" | "qwen_image" => Some(Self::qwen_image()),
            "qwen-tiny" | "qwen_tiny" => Some(Self::tiny()),
            _ => None,
        }
    }

    /// The names [`QwenVaeConfig::named`] knows.
    pub const NAMES: [&'static str; 2] = ["qwen-image", "qwen-tiny"];

    /// Reads and validates a Diffusers `config.json`; a refused field is named with the
    /// file (`<path>: latents_std`).
    pub fn from_file(path: &Path) -> LoadResult<Self> {
        let text = crate::weights::read_text_file(path)?;
        Self::from_json(&text, path).map_err(|e| e.in_config_file(path))
    }

    /// Parses and validates config JSON; `origin` names the file in errors.
    pub fn from_json(text: &str, origin: &Path) -> LoadResult<Self> {
        let bad_json = |e: serde_json::Error| LoadError::Config {
            file: origin.to_path_buf(),
            message: format!("{e}; expected a Diffusers AutoencoderKLQwenImage config.json"),
        };
        let raw: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(text).map_err(bad_json)?;
        if let Some(class) = raw.get("_class_name")
            && class.as_str() != Some(CLASS_NAME)
        {
            return Err(LoadError::InvalidConfig {
                field: "_class_name".into(),
                value: class.to_string(),
                hint: format!(
                    "DDO's Qwen-Image VAE is Diffusers' {CLASS_NAME}; another class (AutoencoderKL, \
                     AutoencoderKLWan, ...) is a different network"
                ),
            });
        }
        for (field, hint) in WAN_SWITCHES {
            match raw.get(field) {
                None | Some(serde_json::Value::Null) | Some(serde_json::Value::Bool(false)) => {}
                Some(value) => {
                    return Err(LoadError::InvalidConfig {
                        field: field.into(),
                        value: value.to_string(),
                        hint: hint.into(),
                    });
                }
            }
        }
        let config: Self =
            serde_json::from_value(serde_json::Value::Object(raw)).map_err(bad_json)?;
        config.validate()?;
        Ok(config)
    }

    /// Checks the values against each other; the error names the field and what would be
    /// valid.
    pub fn validate(&self) -> LoadResult<()> {
        let invalid = |field: &str, value: String, hint: &str| {
            Err(LoadError::InvalidConfig {
                field: field.into(),
                value,
                hint: hint.into(),
            })
        };
        for (field, v) in [
            ("base_dim", self.base_dim),
            ("z_dim", self.z_dim),
            ("input_channels", self.input_channels),
        ] {
            if v == 0 {
                return invalid(field, "0".into(), "must be positive");
            }
        }
        if self.dim_mult.is_empty() || self.dim_mult.contains(&0) {
            return invalid(
                "dim_mult",
                format!("{:?}", self.dim_mult),
                "give one positive multiplier per level, e.g. [1, 2, 4, 4]",
            );
        }
        if self.temperal_downsample.len() + 1 != self.dim_mult.len() {
            return invalid(
                "temperal_downsample",
                format!("{:?}", self.temperal_downsample),
                &format!(
                    "give one flag per level but the last: {} for dim_mult {:?} (Diffusers' \
                     spatial_compression_ratio is 2^len(temperal_downsample), its decoder \
                     upsamples len(dim_mult) - 1 times)",
                    self.dim_mult.len() - 1,
                    self.dim_mult
                ),
            );
        }
        if !(0.0..=1.0).contains(&self.dropout) {
            return invalid(
                "dropout",
                self.dropout.to_string(),
                "a probability in [0, 1] (PyTorch's Dropout refuses anything else)",
            );
        }
        if self.attn_scales.iter().any(|s| !s.is_finite()) {
            return invalid(
                "attn_scales",
                format!("{:?}", self.attn_scales),
                "finite scales (e.g. [] or [0.25])",
            );
        }
        for (field, values) in [
            ("latents_mean", &self.latents_mean),
            ("latents_std", &self.latents_std),
        ] {
            if values.len() != self.z_dim {
                return invalid(
                    field,
                    format!("{} values", values.len()),
                    &format!("give one value per latent channel (z_dim = {})", self.z_dim),
                );
            }
            if let Some(v) = values.iter().find(|v| !v.is_finite()) {
                return invalid(field, v.to_string(), "every value must be finite");
            }
        }
        if let Some(v) = self.latents_std.iter().find(|v| **v == 0.0) {
            return invalid(
                "latents_std",
                v.to_string(),
                "a standard deviation of 0 makes the pipeline's 1 / std infinite",
            );
        }
        let (lo, hi) = LATENTS_STD_RANGE;
        if let Some(v) = self
            .latents_std
            .iter()
            .find(|v| !(lo..=hi).contains(&v.abs()))
        {
            return invalid(
                "latents_std",
                v.to_string(),
                &format!(
                    "every standard deviation must have a magnitude in [{lo:e}, {hi:e}] \
                     (Qwen-Image: 1.1 to 3.3); the pipeline computes 1 / std in f32 and divides \
                     the latents by it"
                ),
            );
        }
        if let Some(v) = self
            .latents_mean
            .iter()
            .find(|v| v.abs() > MAX_LATENTS_MEAN)
        {
            return invalid(
                "latents_mean",
                v.to_string(),
                &format!(
                    "every mean must be in [-{MAX_LATENTS_MEAN:e}, {MAX_LATENTS_MEAN:e}] \
                     (Qwen-Image: -0.95 to 1.55); it is added to every latent before the decode"
                ),
            );
        }
        let widths = self.dim_mult.iter().try_fold(Vec::new(), |mut acc, &m| {
            acc.push(self.base_dim.checked_mul(m)?.checked_mul(2)?);
            Some(acc)
        });
        if widths.is_none() {
            return invalid(
                "base_dim",
                self.base_dim.to_string(),
                "base_dim * dim_mult overflows",
            );
        }
        if let Some(b) = self
            .up_blocks()
            .iter()
            .find(|b| b.in_dim == 0 || (b.upsampler.is_some() && b.out_dim < 2) || b.out_dim == 0)
        {
            return invalid(
                "base_dim",
                self.base_dim.to_string(),
                &format!(
                    "an up block of {} -> {} channels: every upsampler halves its width, \
                     which must stay positive",
                    b.in_dim, b.out_dim
                ),
            );
        }
        Ok(())
    }

    /// The decoder's widths, Diffusers' `dims`: `base_dim · [dim_mult[-1]] + reversed(dim_mult)`.
    pub fn decoder_widths(&self) -> Vec<usize> {
        let last = self.dim_mult.last().copied().unwrap_or(1);
        std::iter::once(last)
            .chain(self.dim_mult.iter().rev().copied())
            .map(|m| self.base_dim * m)
            .collect()
    }

    /// Channels of `conv_in`'s output, the mid block's and the first up block's input.
    pub fn top_width(&self) -> usize {
        self.base_dim * self.dim_mult.last().copied().unwrap_or(1)
    }

    /// The up blocks in execution order, as Diffusers' `QwenImageDecoder3d` builds them:
    /// block `i` goes from `dims[i]` (halved for `i > 0`: the upsampler before it halved
    /// it) to `dims[i + 1]`; all but the last end in an upsampler, `upsample3d` where the
    /// reversed `temperal_downsample` says so.
    pub fn up_blocks(&self) -> Vec<UpBlockSpec> {
        let dims = self.decoder_widths();
        let levels = self.dim_mult.len();
        (0..levels)
            .map(|i| UpBlockSpec {
                in_dim: if i > 0 { dims[i] / 2 } else { dims[i] },
                out_dim: dims[i + 1],
                resnets: self.num_res_blocks + 1,
                upsampler: (i + 1 < levels).then(|| {
                    let temporal = self
                        .temperal_downsample
                        .get(levels - 2 - i)
                        .copied()
                        .unwrap_or(false);
                    if temporal {
                        Upsampler::SpatioTemporal
                    } else {
                        Upsampler::Spatial
                    }
                }),
            })
            .collect()
    }

    /// Channels of the last up block, `norm_out` and `conv_out`'s input.
    pub fn last_width(&self) -> usize {
        self.base_dim * self.dim_mult.first().copied().unwrap_or(1)
    }

    /// Pixels per latent along each axis: Diffusers' `spatial_compression_ratio`,
    /// `2^len(temperal_downsample)` (the decoder's upsamplers, once validated).
    pub fn spatial_compression_ratio(&self) -> usize {
        1usize << self.temperal_downsample.len().min(usize::BITS as usize - 1)
    }

    /// The decoded image's shape for latents of `latent_shape` (`[b, z, h, w]`).
    pub fn output_shape(&self, latent_shape: &[usize]) -> Vec<usize> {
        let f = self.spatial_compression_ratio();
        match latent_shape {
            [b, _, h, w] => vec![*b, self.input_channels, h * f, w * f],
            _ => Vec::new(),
        }
    }

    /// What `QwenImagePipeline` does to the (unpacked) latents before `vae.decode`:
    /// `latents / (1 / latents_std) + latents_mean`, per channel, computed as PyTorch does
    /// it: the statistics as float32 (`torch.tensor` of the config's values), the reciprocal
    /// in float32, both then in the latents' dtype, a division and an addition each rounded
    /// to that dtype. `latents` is `[b, z_dim, h, w]`; the result stays on the device of
    /// `ops`, in the latents' dtype.
    pub fn denormalize_latents(&self, ops: &dyn Ops, latents: &Tensor) -> Result<Tensor> {
        let z = self.z_dim;
        let inv_std: Vec<f32> = self
            .latents_std
            .iter()
            .map(|&s| 1.0f32 / s as f32)
            .collect();
        let mean: Vec<f32> = self.latents_mean.iter().map(|&m| m as f32).collect();
        let inv_std = ops.tensor_from_f32(&[1, z, 1, 1], latents.dtype(), &inv_std)?;
        let mean = ops.tensor_from_f32(&[1, z, 1, 1], latents.dtype(), &mean)?;
        let scaled = ops.binary(latents, &inv_std, BinaryOp::Div)?;
        ops.binary(&scaled, &mean, BinaryOp::Add)
    }
}
