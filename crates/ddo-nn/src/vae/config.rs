//! [`AutoencoderKLConfig`]: the fields of Diffusers' `AutoencoderKL` config the decoder
//! uses, their defaults, validation and the latent unscaling pipelines apply.

use std::path::Path;

use ddo_core::{BinaryOp, DType, Ops, Result, Tensor};
use serde::{Deserialize, Deserializer, Serialize};

use super::UP_DECODER_BLOCK;
use crate::error::{LoadError, LoadResult};

/// The accepted `scaling_factor` (Diffusers' VAEs use 0.13 to 1.53: SD 0.18215, FLUX.1
/// 0.3611, SD3 1.5305): the latents are divided by it in the latents' dtype, so it and its
/// reciprocal must stay far from f32's and bf16's limits (issue 34: 1e-45 gave Inf latents).
pub const SCALING_FACTOR_RANGE: (f64, f64) = (1e-6, 1e6);

/// The largest `shift_factor` magnitude accepted (FLUX.1 0.1159, SD3 0.0609): it is added to
/// latents of magnitude about 1-10 (issue 34: 3e38 gave Inf latents).
pub const MAX_SHIFT_FACTOR: f64 = 1e4;

fn default_in_channels() -> usize {
    3
}
fn default_act_fn() -> String {
    "silu".into()
}
fn default_true() -> bool {
    true
}
fn default_scaling_factor() -> f64 {
    0.18215
}
fn default_sample_size() -> usize {
    32
}

/// What a config of another class than `AutoencoderKL` is, for the refusal's hint.
fn other_class_hint(class: Option<&str>) -> String {
    use crate::pipeline::PipelineKind;
    let what = match class.and_then(PipelineKind::component_of_class) {
        Some((kind, "vae")) => format!(
            "it is {}'s VAE, a different network, loaded with that pipeline",
            kind.class_name()
        ),
        Some((kind, component)) => format!(
            "it is {}'s {component}, not a VAE; the VAE is the pipeline's vae/ folder",
            kind.class_name()
        ),
        None => "another class is another network".to_string(),
    };
    format!(
        "DDO's AutoencoderKL decoder takes Diffusers' {} (FLUX.1's and SD's VAE): {what}",
        super::CLASS_NAME
    )
}

/// `sample_size` is an int or, in some configs, `[height, width]`; Diffusers uses the
/// first entry for tiling.
fn sample_size<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<usize, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum SampleSize {
        One(usize),
        Many(Vec<usize>),
    }
    match SampleSize::deserialize(d)? {
        SampleSize::One(n) => Ok(n),
        SampleSize::Many(v) => v
            .first()
            .copied()
            .ok_or_else(|| serde::de::Error::custom("sample_size is an empty list")),
    }
}

/// The fields of Diffusers' `AutoencoderKL` config the decoder uses. Other fields of
/// `config.json` (`down_block_types`, `latents_mean`, `_class_name`, ...) are ignored.
///
/// Required: `out_channels`, `latent_channels`, `block_out_channels`, `layers_per_block`,
/// `norm_num_groups` (they fix the shapes of the weights). The others default as in
/// Diffusers, except `up_block_types`, which defaults to one `UpDecoderBlock2D` per entry
/// of `block_out_channels`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AutoencoderKLConfig {
    /// Image channels the encoder takes (unused by the decoder).
    #[serde(default = "default_in_channels")]
    pub in_channels: usize,
    /// Image channels the decoder produces.
    pub out_channels: usize,
    /// Latent channels.
    pub latent_channels: usize,
    /// Channels per resolution level, encoder order (the decoder runs them reversed).
    pub block_out_channels: Vec<usize>,
    /// Resnets per encoder block; decoder up blocks have one more.
    pub layers_per_block: usize,
    /// Groups of every GroupNorm.
    pub norm_num_groups: usize,
    /// Activation; only `silu` (or its alias `swish`) is supported.
    #[serde(default = "default_act_fn")]
    pub act_fn: String,
    /// Up-block types; only `UpDecoderBlock2D`.
    #[serde(default)]
    pub up_block_types: Vec<String>,
    /// Whether the model has `quant_conv` (encoder side; not built).
    #[serde(default = "default_true")]
    pub use_quant_conv: bool,
    /// Whether the model has `post_quant_conv` (run before the decoder).
    #[serde(default = "default_true")]
    pub use_post_quant_conv: bool,
    /// Whether the mid block has its attention.
    #[serde(default = "default_true")]
    pub mid_block_add_attention: bool,
    /// Latent scaling factor (pipelines divide by it before decoding).
    #[serde(default = "default_scaling_factor")]
    pub scaling_factor: f64,
    /// Latent shift (Flux, SD3: added after the division).
    #[serde(default)]
    pub shift_factor: Option<f64>,
    /// Image size the VAE was trained at; the default tile size of tiled decoding.
    #[serde(default = "default_sample_size", deserialize_with = "sample_size")]
    pub sample_size: usize,
    /// Whether pipelines run the VAE in f32 (informational).
    #[serde(default = "default_true")]
    pub force_upcast: bool,
}

impl AutoencoderKLConfig {
    /// The SD 1.x / 2.x VAE (`stabilityai/sd-vae-ft-mse` layout): widths
    /// `[128, 256, 512, 512]`, 2 layers per block, 4 latent channels, 32 groups,
    /// `quant_conv` and `post_quant_conv`, scaling 0.18215, sample size 512.
    pub fn sd() -> Self {
        Self {
            in_channels: 3,
            out_channels: 3,
            latent_channels: 4,
            block_out_channels: vec![128, 256, 512, 512],
            layers_per_block: 2,
            norm_num_groups: 32,
            act_fn: "silu".into(),
            up_block_types: vec![UP_DECODER_BLOCK.into(); 4],
            use_quant_conv: true,
            use_post_quant_conv: true,
            mid_block_add_attention: true,
            scaling_factor: 0.18215,
            shift_factor: None,
            sample_size: 512,
            force_upcast: true,
        }
    }

    /// The Flux.1 VAE: SD's widths with 16 latent channels, no `quant_conv` /
    /// `post_quant_conv`, scaling 0.3611, shift 0.1159, sample size 1024.
    pub fn flux() -> Self {
        Self {
            latent_channels: 16,
            use_quant_conv: false,
            use_post_quant_conv: false,
            scaling_factor: 0.3611,
            shift_factor: Some(0.1159),
            sample_size: 1024,
            ..Self::sd()
        }
    }

    /// Reads and validates a Diffusers `config.json`; a refused field is named with the
    /// file (`<path>: scaling_factor`).
    pub fn from_file(path: &Path) -> LoadResult<Self> {
        let text = crate::weights::read_text_file(path)?;
        Self::from_json(&text, path).map_err(|e| e.in_config_file(path))
    }

    /// Parses and validates config JSON; `origin` names the file in errors. A `_class_name`
    /// other than `AutoencoderKL` (a UNet, a transformer, Qwen-Image's VAE) is refused
    /// before any field is read: its numbers are another network's.
    pub fn from_json(text: &str, origin: &Path) -> LoadResult<Self> {
        if let Ok(serde_json::Value::Object(raw)) = serde_json::from_str(text)
            && let Some(class) = raw.get("_class_name")
            && class.as_str() != Some(super::CLASS_NAME)
        {
            return Err(LoadError::InvalidConfig {
                field: "_class_name".into(),
                value: class.to_string(),
                hint: other_class_hint(class.as_str()),
            });
        }
        let mut config: Self = serde_json::from_str(text).map_err(|e| LoadError::Config {
            file: origin.to_path_buf(),
            message: format!("{e}; expected a Diffusers AutoencoderKL config.json"),
        })?;
        if config.up_block_types.is_empty() {
            config.up_block_types = vec![UP_DECODER_BLOCK.into(); config.block_out_channels.len()];
        }
        config.validate()?;
        Ok(config)
    }

    /// Checks what the decoder needs: positive channel counts, widths divisible by the
    /// group count, `silu`, one `UpDecoderBlock2D` per width, a usable scaling factor.
    pub fn validate(&self) -> LoadResult<()> {
        let invalid = |field: &str, value: String, hint: &str| LoadError::InvalidConfig {
            field: field.into(),
            value,
            hint: hint.into(),
        };
        for (field, v) in [
            ("in_channels", self.in_channels),
            ("out_channels", self.out_channels),
            ("latent_channels", self.latent_channels),
            ("norm_num_groups", self.norm_num_groups),
            ("sample_size", self.sample_size),
        ] {
            if v == 0 {
                return Err(invalid(field, "0".into(), "must be positive"));
            }
        }
        if self.block_out_channels.is_empty() {
            return Err(invalid(
                "block_out_channels",
                "[]".into(),
                "give at least one width, e.g. [128, 256, 512, 512]",
            ));
        }
        if let Some(c) = self
            .block_out_channels
            .iter()
            .find(|&&c| c == 0 || !c.is_multiple_of(self.norm_num_groups))
        {
            return Err(invalid(
                "block_out_channels",
                format!("{:?}", self.block_out_channels),
                &format!(
                    "every width must be positive and divisible by norm_num_groups = {} (found {c})",
                    self.norm_num_groups
                ),
            ));
        }
        if !matches!(self.act_fn.as_str(), "silu" | "swish") {
            return Err(invalid(
                "act_fn",
                self.act_fn.clone(),
                "DDO's AutoencoderKL supports `silu` only",
            ));
        }
        if let Some(t) = self.up_block_types.iter().find(|t| *t != UP_DECODER_BLOCK) {
            return Err(invalid(
                "up_block_types",
                t.clone(),
                "DDO's AutoencoderKL supports `UpDecoderBlock2D` only",
            ));
        }
        if self.up_block_types.len() != self.block_out_channels.len() {
            return Err(invalid(
                "up_block_types",
                format!("{:?}", self.up_block_types),
                &format!(
                    "give one up block per entry of block_out_channels ({})",
                    self.block_out_channels.len()
                ),
            ));
        }
        let (lo, hi) = SCALING_FACTOR_RANGE;
        if !(self.scaling_factor.is_finite() && (lo..=hi).contains(&self.scaling_factor)) {
            return Err(invalid(
                "scaling_factor",
                self.scaling_factor.to_string(),
                &format!(
                    "must be a number in [{lo:e}, {hi:e}] (FLUX.1: 0.3611, SD: 0.18215); the \
                     latents are divided by it before the decode, so a tiny or huge one makes \
                     them overflow or vanish"
                ),
            ));
        }
        if let Some(s) = self.shift_factor
            && !(s.is_finite() && s.abs() <= MAX_SHIFT_FACTOR)
        {
            return Err(invalid(
                "shift_factor",
                s.to_string(),
                &format!(
                    "must be a number in [-{MAX_SHIFT_FACTOR:e}, {MAX_SHIFT_FACTOR:e}] (FLUX.1: \
                     0.1159), or null; it is added to every latent before the decode"
                ),
            ));
        }
        Ok(())
    }

    /// Pixels per latent along each axis: `2^(len(block_out_channels) - 1)`.
    pub fn upsample_factor(&self) -> usize {
        1usize << self.block_out_channels.len().saturating_sub(1)
    }

    /// The decoded image's shape for latents of `latent_shape` (`[b, c, h, w]`).
    pub fn output_shape(&self, latent_shape: &[usize]) -> Vec<usize> {
        let f = self.upsample_factor();
        match latent_shape {
            [b, _, h, w] => vec![*b, self.out_channels, h * f, w * f],
            _ => Vec::new(),
        }
    }

    /// What pipelines do before `decode`: `latents / scaling_factor (+ shift_factor)`,
    /// computed as PyTorch does it (a division by the f32 scaling factor, then an
    /// addition), in the dtype of `latents`, on the device of `ops`.
    pub fn unscale_latents(&self, ops: &dyn Ops, latents: &Tensor) -> Result<Tensor> {
        let s = ops.tensor_from_f32(&[1], DType::F32, &[self.scaling_factor as f32])?;
        let scaled = ops.binary(latents, &s, BinaryOp::Div)?;
        match self.shift_factor {
            Some(shift) => ops.affine(&scaled, 1.0, shift as f32),
            None => Ok(scaled),
        }
    }
}
