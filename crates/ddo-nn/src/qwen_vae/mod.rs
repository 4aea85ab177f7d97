//! Diffusers' `AutoencoderKLQwenImage` (Qwen-Image's VAE, fine-tuned from the Wan video
//! VAE), decoder side, for single images: one latent frame, on the `Ops` plane with its
//! weights as leaves of a [`Component`] named `vae`, so every route moves them unchanged.
//!
//! Matches diffusers 0.42.1 (`models/autoencoders/autoencoder_kl_qwenimage.py`) on one
//! frame, which is what `QwenImagePipeline` decodes (`latents` `[b, z, 1, h, w]`, the frame
//! `[:, :, 0]` of the output kept):
//!
//! - `post_quant_conv` (a 1×1×1 causal convolution), then `decoder.conv_in` (3×3×3) to
//!   `base_dim · dim_mult[-1]`;
//! - `decoder.mid_block`: `resnets.0`, `attentions.0` (RMS norm, the 1×1 `to_qkv`, one SDPA
//!   head over the `h·w` positions with scale `1/√C`, the 1×1 `proj`, the residual),
//!   `resnets.1`;
//! - `decoder.up_blocks.i` (see [`QwenVaeConfig::up_blocks`]): `num_res_blocks + 1`
//!   residual blocks (`norm1`, SiLU, `conv1`, `norm2`, SiLU, `conv2`, plus the input through
//!   a 1×1×1 `conv_shortcut` where the width changes), then, for all but the last block,
//!   the upsampler's `resample`: nearest 2× and a 3×3 `nn.Conv2d` to half the width;
//! - `decoder.norm_out`, SiLU, `decoder.conv_out`; `_decode` then clamps to [-1, 1].
//!
//! **One frame.** Diffusers' `_decode` runs the decoder once per latent frame with a feature
//! cache (`clear_cache()`: every entry `None`); with one frame there is only the first call.
//! A `QwenImageCausalConv3d` with kernel `k` pads `2 · (k / 2)` frames in front of its input
//! — zeros, since its cache entry is `None` — so on one frame only the kernel's last temporal
//! slice meets data: the convolution is the 2-D one with `weight[:, :, -1]`, run here with
//! [`Ops::conv2d`](ddo_core::Ops::conv2d). `upsample3d` finds its cache entry `None`, marks
//! it `"Rep"` and skips its `time_conv`, so the frame is never doubled and `time_conv` is
//! not built (its tensors are not read). Dropout is the identity.
//!
//! **The weights' temporal slices.** A causal convolution's leaf holds the 2-D weight
//! `[out, in, k, k]`, so routes move (and the device holds) only the bytes one frame uses.
//! The loader reads it through [`ViewKind::LastTimeSlice`](crate::weights::ViewKind): for
//! the 1×1×1 convolutions that is the checkpoint's own bytes (a view of the mapping), but
//! for the 3×3×3 ones the slice is not contiguous in `[out, in, 3, 3, 3]` (each `(out, in)`
//! pair keeps its last 9 of 27 values), and no op reads a strided weight, so it is an owned
//! copy made at load: a third of those tensors' bytes in host memory (anonymous, frozen like
//! a conversion's), the other two thirds read once from the mapping's pages and never
//! again. For Qwen-Image's VAE that is 23,116,320 of the decoder's 25,291,955 loaded
//! elements (44.1 MiB in bf16 of 48.2 MiB; Diffusers' decoder holds 73,295,603 elements,
//! 139.8 MiB in bf16, of which `time_conv` is 1,771,008).
//!
//! **RMS norm.** `QwenImageRMS_norm` is `F.normalize(x, dim=1) · √C · gamma` with
//! `gamma [C, 1, 1(, 1)]` and no bias, composed from existing ops
//! (`blocks::channel_rms_norm`: squares and sum in f32, sqrt, clamp at `1e-12`, divide,
//! scale, gamma), so no backend needs a kernel of its own.
//!
//! **Un-normalising latents** is not the VAE's job in Diffusers: `QwenImagePipeline`
//! computes `latents / (1 / latents_std) + latents_mean` before `vae.decode`. It lives here
//! as a separate step the pipeline calls, [`QwenVaeConfig::denormalize_latents`] (and
//! [`QwenVae::denormalize_latents`] on a device); [`QwenVae::decode`] takes latents as
//! `AutoencoderKLQwenImage.decode` does.
//!
//! **Tiled decoding** ([`QwenVaeTiling`]) reproduces `tiled_decode`: tiles of
//! `tile_sample_min / r` latents every `tile_sample_stride / r` (Diffusers' defaults 256 and
//! 192 pixels), blended over the difference, cropped to the stride, the whole cropped to the
//! image size, and — as in Diffusers, whose `tiled_decode` returns before `_decode`'s clamp —
//! not clamped. [`estimate_decode_peak_bytes`] and [`estimate_tiled_decode_peak_bytes`]
//! predict the activation peak of either, for the memory planner.

#[cfg(doc)]
use ddo_core::Component;

mod blocks;
mod config;
mod decoder;
mod estimate;
mod tiling;

pub use config::{
    QWEN_IMAGE_LATENTS_MEAN, QWEN_IMAGE_LATENTS_STD, QwenVaeConfig, UpBlockSpec, Upsampler,
};
pub use decoder::{QwenVae, QwenVaeProgram, Tap};
pub use estimate::{
    estimate_decode_peak_bytes, estimate_decode_peak_bytes_on, estimate_tiled_decode_peak_bytes,
    estimate_tiled_decode_peak_bytes_on,
};
pub use tiling::QwenVaeTiling;

/// The component name of the VAE in Diffusers pipelines.
pub const COMPONENT_NAME: &str = "vae";
/// The Diffusers class this module ports.
pub const CLASS_NAME: &str = "AutoencoderKLQwenImage";
/// The `eps` of `F.normalize` in `QwenImageRMS_norm`: the L2 norm is clamped below at it.
pub const NORMALIZE_EPS: f32 = 1e-12;
