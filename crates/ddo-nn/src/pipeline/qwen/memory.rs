//! What each phase of the Qwen-Image pipeline asks of the device besides weights, for the
//! memory planner ([`QwenImagePipeline::phase_demands`], the meaning of
//! [`FluxPipeline::phase_demands`](crate::pipeline::FluxPipeline::phase_demands)), and the
//! attention shapes a run uses ([`QwenImagePipeline::prepare_attention`]).
//!
//! The transformer and text-encoder figures are upper bounds written from the models' op
//! sequences, counting every intermediate as f32 (the widest the ops produce) and the
//! widest point of a block with its inputs still live; the decode uses the Qwen VAE's
//! dry-run estimates ([`crate::qwen_vae::estimate_decode_peak_bytes_on`]). Each phase adds
//! the device's scratch ([`Device::scratch_bytes`]).

use ddo_core::{DType, Device, Result};
use ddo_routes::PhaseDemand;

use super::{QWEN_TEXT_ENCODER, QWEN_TRANSFORMER, QWEN_VAE, QwenImagePipeline};
use crate::memory::weight_decode_scratch_bytes;
use crate::pipeline::{PHASES, TiledDecode};
use crate::qwen_image::QwenImageTransformerConfig;
use crate::qwen_text::{PROMPT_TEMPLATE_START_IDX, QwenTextEncoderConfig};
use crate::qwen_vae::{
    QwenVaeTiling, estimate_decode_peak_bytes_on, estimate_tiled_decode_peak_bytes_on,
};

/// Bytes of one intermediate element: intermediates are counted as f32.
const ELEM: u64 = 4;

fn saturating_elems(counts: &[u64]) -> u64 {
    counts
        .iter()
        .fold(0u64, |a, c| a.saturating_add(*c))
        .saturating_mul(ELEM)
}

/// Activation bound of one Qwen-Image transformer pass over `image_tokens + text_tokens`
/// tokens of one sample (multiply by the batch): the widest point of a dual-stream block —
/// per token the residual, its norm and modulated input, q/k/v, their RMS-normed and rotated
/// copies, the attention output and its projection (`12·D`), the feed-forward's `4·D` hidden
/// state before and after its GELU and its output (`9·D`), and a few `D`-wide temporaries
/// (`5·D`): `26·D` per token — plus the rotary tables (`2·head_dim` per token), the two
/// streams' modulation vectors (`2 × 6·D`), the additive text mask, and, with true CFG, the
/// prediction of the first pass and the combination's temporaries (`4 × proj_out` per image
/// token) while the second runs.
pub fn estimate_qwen_image_activation_bytes(
    config: &QwenImageTransformerConfig,
    image_tokens: usize,
    text_tokens: usize,
) -> u64 {
    let d = (config.num_attention_heads as u64).saturating_mul(config.attention_head_dim as u64);
    let tokens = (image_tokens as u64).saturating_add(text_tokens as u64);
    let tables = tokens
        .saturating_mul(2 * config.attention_head_dim as u64)
        .saturating_add(d.saturating_mul(12))
        .saturating_add(tokens);
    let cfg = (image_tokens as u64).saturating_mul(4 * config.proj_out_channels() as u64);
    saturating_elems(&[tokens.saturating_mul(d.saturating_mul(26)), tables, cfg])
}

/// Activation bound of one Qwen2.5-VL language-model forward over `seq` tokens: the gated
/// MLP (gate, up, their product: `3 · intermediate`), q and the repeated k/v with their
/// rotated copies (`6 · heads · head_dim`), a handful of hidden-wide tensors (`8 ·
/// hidden`), and the causal mask and one score block (`(heads + 1) · seq²`).
pub fn estimate_qwen_text_activation_bytes(config: &QwenTextEncoderConfig, seq: usize) -> u64 {
    let s = seq as u64;
    let inner = (config.num_attention_heads as u64).saturating_mul(config.head_dim() as u64);
    let per_token = (3 * config.intermediate_size as u64)
        .saturating_add(8 * config.hidden_size as u64)
        .saturating_add(inner.saturating_mul(6));
    let scores = (config.num_attention_heads as u64 + 1).saturating_mul(s.saturating_mul(s));
    saturating_elems(&[s.saturating_mul(per_token), scores])
}

impl QwenImagePipeline {
    /// Tokens the text encoder sees for a prompt of `max_sequence_length` kept tokens: the
    /// template's dropped system part on top.
    fn encoder_tokens(&self) -> usize {
        self.max_sequence_length + PROMPT_TEMPLATE_START_IDX
    }

    /// The three phases of `images` images at `height × width` for the memory planner:
    /// prompt encoding (the text encoder over `max_sequence_length` tokens and the template's
    /// dropped ones, once per prompt; the negative prompt runs after the prompt, not beside
    /// it), denoise (the transformer over the packed image tokens and `max_sequence_length`
    /// text tokens of every image; true CFG's two passes run one after the other, so one
    /// pass's activations and the first pass's prediction) and decode (the Qwen VAE over all
    /// the images, as [`plan_qwen_decode_on`](super::plan_qwen_decode_on) will decide under
    /// `tiled`: untiled when its estimate fits the `budget` beside the VAE's weights or
    /// `tiled` is off, else Diffusers' default tiles), each with the device's scratch.
    pub fn phase_demands(
        &self,
        height: usize,
        width: usize,
        images: usize,
        tiled: TiledDecode,
        budget: u64,
        device: &dyn Device,
    ) -> Result<Vec<PhaseDemand>> {
        let scratch = device.scratch_bytes();
        let (h, w) = self.latent_grid(height, width)?;
        let image_tokens = (h / 2).saturating_mul(w / 2);
        let text = self.text_encoder.as_ref().map_or(0, |t| {
            estimate_qwen_text_activation_bytes(t.config(), self.encoder_tokens())
        });
        let transformer = estimate_qwen_image_activation_bytes(
            self.transformer.config(),
            image_tokens,
            self.max_sequence_length,
        )
        .saturating_mul(images.max(1) as u64)
        .saturating_add(weight_decode_scratch_bytes(self.transformer.component()));
        let vae = self.vae.config();
        let latent_shape = [images.max(1), vae.z_dim, h, w];
        let dtype: DType = self.vae.dtype();
        let untiled = estimate_decode_peak_bytes_on(Some(device), vae, &latent_shape, dtype);
        let tiling = QwenVaeTiling::default();
        let weights = self.vae.component().param_bytes();
        let fits = untiled.saturating_add(weights).saturating_add(scratch) <= budget;
        let r = vae.spatial_compression_ratio();
        let tiles = tiling.needs_tiling(h, w, r)
            && match tiled {
                TiledDecode::Off => false,
                TiledDecode::On => true,
                TiledDecode::Auto => !fits,
            };
        let decode = if tiles {
            estimate_tiled_decode_peak_bytes_on(Some(device), vae, &latent_shape, dtype, &tiling)
        } else {
            untiled
        };
        let text_components = if self.text_encoder.is_some() {
            vec![QWEN_TEXT_ENCODER.to_string()]
        } else {
            Vec::new()
        };
        Ok(vec![
            PhaseDemand {
                phase: PHASES[0].to_string(),
                components: text_components,
                activation_bytes: text.saturating_add(scratch),
                runs_once: true,
            },
            PhaseDemand {
                phase: PHASES[1].to_string(),
                components: vec![QWEN_TRANSFORMER.to_string()],
                activation_bytes: transformer.saturating_add(scratch),
                runs_once: false,
            },
            PhaseDemand {
                phase: PHASES[2].to_string(),
                components: vec![QWEN_VAE.to_string()],
                activation_bytes: decode.saturating_add(scratch),
                runs_once: false,
            },
        ])
    }

    /// Names the attention shapes a run of `images` images at `height × width` will use to
    /// `device` ([`Device::prepare_attention`]), as Flux's pipeline does: the text encoder's
    /// (its causal + padding mask, at `max_sequence_length` and the template's tokens) and the
    /// transformer's joint attention over text and image tokens (with its text padding mask,
    /// `[b, 1, 1, tokens]`, and without), so a backend that builds something per shape starts
    /// before the first phase. Results do not depend on it.
    pub fn prepare_attention(
        &self,
        device: &dyn Device,
        height: usize,
        width: usize,
        images: usize,
    ) -> Result<()> {
        if let Some(t) = &self.text_encoder {
            let c = t.config();
            let len = self.encoder_tokens();
            let q = [1, c.num_attention_heads, len, c.head_dim()];
            let dtype = weights_dtype(t.component());
            device.prepare_attention(&q, &q, &q, Some((&[1, 1, len, len], dtype)), dtype);
        }
        let c = self.transformer.config();
        // A size no device holds is refused by the memory plan, not here: no hint for it.
        let Some(tokens) = self
            .image_tokens(height, width)?
            .and_then(|t| t.checked_add(self.max_sequence_length))
        else {
            return Ok(());
        };
        let b = images.max(1);
        let q = [b, c.num_attention_heads, tokens, c.attention_head_dim];
        let dtype = self.transformer_dtype();
        device.prepare_attention(&q, &q, &q, None, dtype);
        device.prepare_attention(&q, &q, &q, Some((&[b, 1, 1, tokens], dtype)), dtype);
        Ok(())
    }

    /// The transformer's image tokens at `height × width` (2x2 patches of the latent grid);
    /// `None` for a size no device holds, which the memory plan refuses (nothing is
    /// prepared for it).
    fn image_tokens(&self, height: usize, width: usize) -> Result<Option<usize>> {
        let (h, w) = self.latent_grid(height, width)?;
        Ok((h / 2).checked_mul(w / 2))
    }

    /// Prepares the denoise phase's first forward for a run of `images` images at
    /// `height × width`, before the first phase, as Flux's pipeline does
    /// ([`FluxPipeline::prepare_first_forward`](crate::pipeline::FluxPipeline::prepare_first_forward)):
    /// runs the transformer's linears once on `device` ([`Device::prepare_linears`], each
    /// call's operands and product within `max_bytes`). The text stream's calls are named at
    /// `max_sequence_length` tokens: a prompt's own length is known only once it is encoded,
    /// so its text-row calls may still load a kernel in the first forward; the image-row and
    /// modulation calls are the forward's own. Returns how many linear calls ran. Results do
    /// not depend on it.
    pub fn prepare_first_forward(
        &self,
        device: &dyn Device,
        height: usize,
        width: usize,
        images: usize,
        max_bytes: u64,
    ) -> Result<usize> {
        let Some(tokens) = self.image_tokens(height, width)? else {
            return Ok(0);
        };
        let calls = self
            .transformer
            .linear_calls(images.max(1), tokens, self.max_sequence_length);
        device.prepare_linears(&calls, max_bytes)
    }
}

/// The dtype of the first weight of `component` (the models' activations take it).
fn weights_dtype(component: &ddo_core::Component) -> DType {
    component
        .leaves()
        .iter()
        .find_map(|l| l.params().first().map(|(_, p)| p.dtype().compute()))
        .unwrap_or(DType::F32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::QwenImagePipelineConfig;

    #[test]
    fn full_size_estimates_are_in_a_plausible_range() {
        // Qwen-Image at 1024x1024: 4096 image + 512 text tokens, width 3072.
        let c = QwenImagePipelineConfig::qwen_image();
        let t = estimate_qwen_image_activation_bytes(&c.transformer, 4096, 512);
        assert!(t > 1 << 30 && t < 4 << 30, "{t}");
        let e = estimate_qwen_text_activation_bytes(&c.text_encoder, 546);
        assert!(e > 64 << 20 && e < 1 << 30, "{e}");
    }
}
