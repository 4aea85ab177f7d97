//! Diffusers' `AutoencoderKL`, decoder side, on the `Ops` plane with its weights as leaves
//! of a [`Component`] named `vae`, so every route moves them unchanged.
//!
//! Matches diffusers 0.42 (`models/autoencoders/autoencoder_kl.py`, `autoencoders/vae.py`
//! `Decoder`, `models/resnet.py` `ResnetBlock2D`/`Upsample2D`, `unet_2d_blocks.py`
//! `UNetMidBlock2D`/`UpDecoderBlock2D`, `attention_processor.py` `Attention` with
//! `AttnProcessor2_0`):
//!
//! - `post_quant_conv` (1×1) when `use_post_quant_conv`, then `decoder.conv_in` (3×3) to
//!   `block_out_channels[-1]`;
//! - `decoder.mid_block`: `resnets.0`, `attentions.0` (when `mid_block_add_attention`),
//!   `resnets.1`. The attention is a single head of width `block_out_channels[-1]`:
//!   `group_norm` (`norm_num_groups` groups, eps 1e-6), `to_q`/`to_k`/`to_v` over the
//!   `h·w` positions, SDPA with scale `1/√C`, `to_out.0`, plus the residual;
//!   `rescale_output_factor` is 1;
//! - `decoder.up_blocks.i` over the reversed `block_out_channels`: `layers_per_block + 1`
//!   `ResnetBlock2D`s each (a 1×1 `conv_shortcut` where the channel count changes), then,
//!   for all but the last block, `upsamplers.0`: nearest ×2 and a 3×3 `conv`;
//! - `decoder.conv_norm_out` (GroupNorm, eps 1e-6), SiLU, `decoder.conv_out`.
//!
//! Every `ResnetBlock2D` is `norm1 → SiLU → conv1 → norm2 → SiLU → conv2`, plus the input
//! (through `conv_shortcut` when present); eps 1e-6, no time embedding, output scale 1.
//! Each GroupNorm followed by SiLU (`norm1`, `norm2`, `conv_norm_out`) runs as one op,
//! [`Ops::group_norm_silu`] (fused on CUDA; on the host backend the composition, bit for bit).
//! Dropout is the identity. The encoder and `quant_conv` are not built: their tensors in a
//! checkpoint are simply not loaded.
//!
//! [`AutoencoderKL::decode`] takes latents raw, as `AutoencoderKL.decode` does; pipelines
//! first apply [`AutoencoderKLConfig::unscale_latents`]. Tiled decoding
//! ([`TilingConfig`]) reproduces `AutoencoderKL.tiled_decode`, blending and cropping
//! included. [`estimate_decode_peak_bytes`] predicts the activation peak of a decode, to
//! choose between tiled and untiled decoding.

#[cfg(doc)]
use ddo_core::{Component, Ops};

mod blocks;
mod config;
mod decoder;
mod estimate;
pub mod original;
mod tiling;

pub use config::AutoencoderKLConfig;
pub use decoder::{AutoencoderKL, DecoderProgram};
pub(crate) use estimate::PeakSim;
pub use estimate::{
    estimate_decode_peak_bytes, estimate_decode_peak_bytes_on, estimate_tiled_decode_peak_bytes,
    estimate_tiled_decode_peak_bytes_on,
};
pub use tiling::TilingConfig;
pub(crate) use tiling::{blend, concat};

/// The component name of the VAE in Diffusers pipelines.
pub const COMPONENT_NAME: &str = "vae";
/// The Diffusers class this module ports.
pub const CLASS_NAME: &str = "AutoencoderKL";
/// The only up-block type the decoder supports.
pub const UP_DECODER_BLOCK: &str = "UpDecoderBlock2D";
/// Epsilon of every GroupNorm of the decoder (`resnet_eps`, the attention's norm and
/// `conv_norm_out`).
pub const NORM_EPS: f32 = 1e-6;
