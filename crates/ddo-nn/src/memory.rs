//! What each phase of the Flux pipeline asks of the device besides weights: activation
//! estimates for the transformer, the text encoders and the VAE decode at the requested
//! size, and the [`PhaseDemand`]s the pipeline memory planner (`ddo_routes::plan`) plans
//! from ([`FluxPipeline::phase_demands`]).
//!
//! The transformer and text-encoder figures are upper bounds written from the models' op
//! sequences, counting every intermediate as f32 (the widest the ops produce) and the
//! widest point of a block with its inputs still live; `tests` check them against the
//! exact peak of a run on the host backend. The decode uses the VAE's dry-run estimates
//! ([`crate::vae::estimate_decode_peak_bytes`]). Each phase adds the device's scratch
//! ([`Device::scratch_bytes`]: cuBLAS and attention
//! workspaces on CUDA, nothing on the host backend).

use ddo_core::{DType, Device, Result};
use ddo_routes::PhaseDemand;

use crate::clip::ClipTextConfig;
use crate::flux::FluxTransformerConfig;
use crate::pipeline::{
    FluxPipeline, PHASES, TEXT_ENCODER, TEXT_ENCODER_2, TRANSFORMER, TiledDecode, VAE,
};
use crate::t5::T5Config;
use crate::vae::{
    TilingConfig, estimate_decode_peak_bytes_on, estimate_tiled_decode_peak_bytes_on,
};

/// Bytes of one intermediate element: intermediates are counted as f32.
const ELEM: u64 = 4;

/// Activation bound of one Flux transformer forward over `image_tokens + text_tokens`
/// tokens: the widest point of a single-stream block (the fused projection `3·D + M` wide,
/// its MLP activation `M`, the concatenation `D + M` and a handful of `D`-wide tensors: the
/// residual, the norm, the modulated input, q/k/v after RoPE, the attention output), where
/// `D` is the inner width and `M = 4·D`, plus the double-stream blocks' modulation vectors,
/// which are smaller.
pub fn estimate_flux_activation_bytes(
    config: &FluxTransformerConfig,
    image_tokens: usize,
    text_tokens: usize,
) -> u64 {
    let d = (config.num_attention_heads as u64).saturating_mul(config.attention_head_dim as u64);
    let tokens = (image_tokens as u64).saturating_add(text_tokens as u64);
    // (3·D + M) + M + (D + M) + 10·D with M = 4·D: 26·D per token.
    let per_token = d.saturating_mul(26);
    // RoPE tables (cos, sin per token and head width) and the modulation vectors.
    let tables = tokens
        .saturating_mul(2 * config.attention_head_dim as u64)
        .saturating_add(d.saturating_mul(24));
    saturating_elems(&[tokens.saturating_mul(per_token), tables])
}

/// Activation bound of one T5 encoder forward over `seq` tokens: the gated feed-forward
/// (two `d_ff`-wide projections and their product), a handful of `d_model`-wide tensors, q/k/v
/// and the attention output (`heads × d_kv` each), plus the relative position bias
/// `[heads, seq, seq]` and one score block of the same size.
pub fn estimate_t5_activation_bytes(config: &T5Config, seq: usize) -> u64 {
    let s = seq as u64;
    let inner = (config.num_heads as u64).saturating_mul(config.d_kv as u64);
    let per_token = (3 * config.d_ff as u64)
        .saturating_add(8 * config.d_model as u64)
        .saturating_add(inner.saturating_mul(4));
    let bias = (2 * config.num_heads as u64).saturating_mul(s.saturating_mul(s));
    saturating_elems(&[s.saturating_mul(per_token), bias])
}

/// Activation bound of one CLIP text forward over `seq` tokens: the MLP (`intermediate`
/// wide, before and after the activation), a handful of `hidden`-wide tensors, and the
/// causal mask and one score block (`heads × seq × seq`).
pub fn estimate_clip_activation_bytes(config: &ClipTextConfig, seq: usize) -> u64 {
    let s = seq as u64;
    let per_token =
        (2 * config.intermediate_size as u64).saturating_add(10 * config.hidden_size as u64);
    let scores = (config.num_attention_heads as u64 + 1).saturating_mul(s.saturating_mul(s));
    saturating_elems(&[s.saturating_mul(per_token), scores])
}

/// Bytes of the elements `counts` add up to, saturating: an absurd size gives a bound no
/// budget holds (the planner then refuses it with a typed error), never an overflow.
fn saturating_elems(counts: &[u64]) -> u64 {
    counts
        .iter()
        .fold(0u64, |a, c| a.saturating_add(*c))
        .saturating_mul(ELEM)
}

impl FluxPipeline {
    /// The three phases of `images` images at `height × width` for the memory planner:
    /// prompt encoding (CLIP and T5 at `max_sequence_length`, once per prompt), denoise (the
    /// transformer over the packed image tokens and the text tokens of every image) and
    /// decode (the VAE over all the images, as `plan_decode` will decide under `tiled`:
    /// untiled when its estimate fits the `budget` beside the VAE's weights or `tiled` is
    /// off, else Diffusers' default tiles, its convolutions' scratch on `device` counted),
    /// each with the device's scratch ([`Device::scratch_bytes`]).
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
        let text_tokens = self.max_sequence_length;
        let clip = self.clip.as_ref().map_or(0, |c| {
            estimate_clip_activation_bytes(c.config(), c.config().max_position_embeddings)
        });
        let t5 = self
            .t5
            .as_ref()
            .map_or(0, |t| estimate_t5_activation_bytes(t.config(), text_tokens));
        let transformer =
            estimate_flux_activation_bytes(self.transformer.config(), image_tokens, text_tokens)
                .saturating_mul(images.max(1) as u64)
                .saturating_add(weight_decode_scratch_bytes(self.transformer.component()));
        let vae = self.vae.config();
        let latent_shape = [images.max(1), vae.latent_channels, h, w];
        let dtype: DType = self.vae.dtype();
        let untiled = estimate_decode_peak_bytes_on(Some(device), vae, &latent_shape, dtype);
        let tiling = TilingConfig::from_config(vae);
        let weights = self.vae.component().param_bytes();
        let fits = untiled.saturating_add(weights).saturating_add(scratch) <= budget;
        let tiles = tiling.needs_tiling(h, w)
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
        let mut text = Vec::new();
        if self.clip.is_some() {
            text.push(TEXT_ENCODER.to_string());
        }
        if self.t5.is_some() {
            text.push(TEXT_ENCODER_2.to_string());
        }
        Ok(vec![
            PhaseDemand {
                phase: PHASES[0].to_string(),
                components: text,
                activation_bytes: clip.max(t5).saturating_add(scratch),
                runs_once: true,
            },
            PhaseDemand {
                phase: PHASES[1].to_string(),
                components: vec![TRANSFORMER.to_string()],
                activation_bytes: transformer.saturating_add(scratch),
                runs_once: false,
            },
            PhaseDemand {
                phase: PHASES[2].to_string(),
                components: vec![VAE.to_string()],
                activation_bytes: decode.saturating_add(scratch),
                runs_once: false,
            },
        ])
    }
}

/// The dtype of the first weight of `component` (the models' activations take it).
/// The device scratch a linear over fp8 weights or GGUF blocks takes besides its
/// activations: its weight (and bias) decoded or dequantized into the compute dtype for the
/// GEMM, at most one leaf at a time; 0 when nothing is stored as fp8 or blocks.
pub fn weight_decode_scratch_bytes(component: &ddo_core::Component) -> u64 {
    component
        .leaves()
        .iter()
        .map(|l| {
            l.params()
                .iter()
                .filter(|(_, p)| p.dtype().is_fp8() || p.quant().is_some())
                .map(|(_, p)| {
                    let n: u64 = p.logical_shape().iter().map(|&d| d as u64).product();
                    n.saturating_mul(p.dtype().compute().size_in_bytes() as u64)
                })
                .fold(0u64, u64::saturating_add)
        })
        .max()
        .unwrap_or(0)
}

fn weights_dtype(component: &ddo_core::Component) -> DType {
    component
        .leaves()
        .iter()
        .find_map(|l| l.params().first().map(|(_, p)| p.dtype()))
        .unwrap_or(DType::F32)
}

impl FluxPipeline {
    /// Names the attention shapes a run of `images` images at `height × width` will use to
    /// `device` ([`Device::prepare_attention`]): CLIP's (causal mask), T5's (its relative
    /// position bias as the mask) and the transformer's joint attention over image and text
    /// tokens, so a backend that builds something per shape (the CUDA backend's cuDNN plans)
    /// starts before the first phase. Results do not depend on it.
    pub fn prepare_attention(
        &self,
        device: &dyn Device,
        height: usize,
        width: usize,
        images: usize,
    ) -> Result<()> {
        if let Some(clip) = &self.clip {
            let c = clip.config();
            let (heads, len) = (c.num_attention_heads, c.max_position_embeddings);
            let q = [1, heads, len, c.hidden_size / heads.max(1)];
            let dtype = weights_dtype(clip.component());
            device.prepare_attention(&q, &q, &q, Some((&[1, 1, len, len], dtype)), dtype);
        }
        if let Some(t5) = &self.t5 {
            let c = t5.config();
            let len = self.max_sequence_length;
            let q = [1, c.num_heads, len, c.d_kv];
            let dtype = weights_dtype(t5.component());
            let mask = [1, c.num_heads, len, len];
            device.prepare_attention(&q, &q, &q, Some((&mask, dtype)), dtype);
        }
        let c = self.transformer.config();
        let Some(tokens) = self
            .image_tokens(height, width)?
            .and_then(|t| t.checked_add(self.max_sequence_length))
        else {
            return Ok(());
        };
        let q = [
            images.max(1),
            c.num_attention_heads,
            tokens,
            c.attention_head_dim,
        ];
        let dtype = self.transformer_dtype();
        device.prepare_attention(&q, &q, &q, None, dtype);
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
    /// `height × width`, before the first phase: runs the transformer's linears once on
    /// `device` ([`Device::prepare_linears`], each call's operands and product within
    /// `max_bytes`: a backend that loads a GEMM kernel at its first call, cuBLASLt, does it
    /// here, not inside that forward) and makes its rotary tables
    /// ([`crate::flux::FluxTransformer::prepare_rope`]). Returns how many linear calls ran. Results do
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
        let (h, w) = self.latent_grid(height, width)?;
        let calls = self
            .transformer
            .linear_calls(images.max(1), tokens, self.max_sequence_length);
        self.transformer.prepare_rope(
            self.max_sequence_length,
            &crate::flux::latent_image_ids(h / 2, w / 2),
        );
        device.prepare_linears(&calls, max_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flux::FluxTransformer;
    use crate::pipeline::FluxPipelineConfig;

    #[test]
    fn fp8_weights_add_their_largest_leafs_upcast_scratch() {
        let cfg = FluxPipelineConfig::tiny();
        let bf16 = FluxTransformer::random(cfg.transformer.clone(), 1, DType::BF16).unwrap();
        assert_eq!(weight_decode_scratch_bytes(bf16.component()), 0);
        let fp8 = FluxTransformer::random(cfg.transformer.clone(), 1, DType::F8E4M3).unwrap();
        let largest = fp8
            .component()
            .leaves()
            .iter()
            .flat_map(|l| l.params().iter().map(|(_, p)| p))
            .filter(|p| p.dtype().is_fp8())
            .map(|p| 2 * p.nbytes() as u64)
            .max()
            .unwrap();
        // Each leaf here holds one fp8 weight (biases stay as made): its bf16 copy.
        assert_eq!(weight_decode_scratch_bytes(fp8.component()), largest);
    }

    #[test]
    fn full_size_estimates_are_in_the_range_the_gpu_shows() {
        // FLUX.1-dev at 1024x1024: 4096 image + 512 text tokens. The figures are bounds,
        // but a bound far above reality would make the planner stream what fits.
        let cfg = FluxPipelineConfig::flux_dev();
        let flux = estimate_flux_activation_bytes(&cfg.transformer, 4096, 512);
        assert!(flux > 512 << 20 && flux < 3 << 30, "{flux}");
        let t5 = estimate_t5_activation_bytes(&cfg.text_encoder_2, 512);
        assert!(t5 > 64 << 20 && t5 < 1 << 30, "{t5}");
        let clip = estimate_clip_activation_bytes(&cfg.text_encoder, 77);
        assert!(clip < 64 << 20, "{clip}");
    }
}
