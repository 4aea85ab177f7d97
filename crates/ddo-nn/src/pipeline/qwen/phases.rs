//! [`QwenImagePipeline::run_phases`]: prompt encoding, denoise (true CFG) and decode on the
//! routes of a [`PipelineOffload`], on the phase driver Flux's pipeline uses
//! ([`crate::pipeline::phases`]): the same error cleanup, phase beginnings and the seed's
//! cleanup at every boundary (the transformer released before the VAE loads).

use std::time::Instant;

use ddo_core::Result;
use ddo_routes::PipelineOffload;

use super::denoise::HostEmbeds;
use super::{
    QWEN_TEXT_ENCODER, QWEN_TRANSFORMER, QWEN_VAE, QwenImagePipeline, QwenImageRequest,
    QwenPromptInput, plan_qwen_decode_on,
};
use crate::pipeline::phases::{PhaseDriver, decode_headroom, run_guarded};
use crate::pipeline::{PHASES, PipelineRun, Progress, invalid, to_host};

impl QwenImagePipeline {
    /// Runs the pipeline in phases on the routes of `offload` (made from
    /// [`QwenImagePipeline::offload_pipeline`]), with the seed's cleanup between phases:
    /// `prompt_encoding` (the text encoder, for the prompt and — with true CFG — the negative
    /// prompt, one after the other; skipped when both come as embeddings), `denoise` (the
    /// transformer, two passes per step with true CFG; its note says how many ran) and
    /// `decode` (the VAE). Returns the packed final latents (`[n, tokens, 4·C]`, f32) and the
    /// decoded images `[n, 3, H, W]` (f32, in [-1, 1] untiled: `vae.decode`'s output before
    /// the image processor, as [`FluxPipeline::run_phases`](crate::pipeline::FluxPipeline::run_phases)
    /// returns them), on the host. On an error (or a panic) every component is released
    /// before the error returns.
    pub fn run_phases(
        &self,
        offload: &mut PipelineOffload,
        request: &QwenImageRequest,
        progress: Progress<'_>,
    ) -> Result<PipelineRun> {
        let _cancel = crate::pipeline::cancel::scope(request.cancel.clone());
        run_guarded(offload, "QwenImagePipeline::run_phases", |offload| {
            self.run_phases_inner(offload, request, progress)
        })
    }

    fn run_phases_inner(
        &self,
        offload: &mut PipelineOffload,
        request: &QwenImageRequest,
        progress: Progress<'_>,
    ) -> Result<PipelineRun> {
        let (h, w) = self.latent_grid(request.height, request.width)?;
        let mut driver = PhaseDriver::new(offload, request.release_native_idle_cache)?;
        let device = driver.device();
        let dev = &*device;
        let n = request.num_images;
        if n == 0 {
            return Err(invalid(
                "num_images",
                "0",
                "give 1 or more images per prompt",
            ));
        }
        let cfg = request.does_true_cfg();
        let negative = if cfg {
            request.negative_prompt.as_ref()
        } else {
            None
        };

        // Phase 1: prompt encoding (the text encoder only where a prompt is text).
        let text = [QWEN_TEXT_ENCODER];
        let prompts: Vec<&QwenPromptInput> =
            std::iter::once(&request.prompt).chain(negative).collect();
        let encodes = prompts
            .iter()
            .any(|p| matches!(p, QwenPromptInput::Text(_)));
        let prepare = |dev: &dyn ddo_core::Device, p: &QwenPromptInput| -> Result<HostEmbeds> {
            match p {
                QwenPromptInput::Embeddings(e) => self.prepare_embeds(dev, e, n),
                QwenPromptInput::Text(t) => {
                    let e = self.encode_prompt(dev, t)?;
                    // Keep what denoise needs on the host; the device copies go here.
                    self.prepare_embeds(dev, &e, n)
                }
            }
        };
        let (embeds, t0, note) = if encodes {
            if self.text_encoder.is_none() {
                return Err(invalid(
                    "prompt",
                    "text",
                    "this pipeline has no text_encoder: pass prompt embeddings instead (or load \
                     a folder with text_encoder/ and tokenizer/)",
                ));
            }
            let t0 = driver.begin(&text)?;
            let embeds = driver.encode_with_next(&[QWEN_TRANSFORMER], |dev| {
                prompts
                    .iter()
                    .map(|p| prepare(dev, p))
                    .collect::<Result<Vec<_>>>()
            })?;
            progress("prompt_encoding", 1, 1);
            (embeds, t0, None)
        } else {
            let t0 = Instant::now();
            let embeds = prompts
                .iter()
                .map(|p| prepare(dev, p))
                .collect::<Result<Vec<_>>>()?;
            (
                embeds,
                t0,
                Some("skipped: prompt embeddings given".to_string()),
            )
        };
        let mut embeds = embeds.into_iter();
        let (Some(positive), negative) = (embeds.next(), embeds.next()) else {
            return Err(invalid("prompt", "", "give a prompt"));
        };
        let images = positive.batch();
        let ran = if encodes { &text[..] } else { &[][..] };
        driver.end(PHASES[0], ran, &text, t0, note)?;

        // Phase 2: denoise.
        let t0 = driver.begin(&[QWEN_TRANSFORMER])?;
        let latents =
            self.initial_latents(dev, &request.init, request.height, request.width, images)?;
        let scale = request.true_cfg_scale;
        let (latents, timesteps, passes) = self.denoise(
            dev,
            &positive,
            negative.as_ref().map(|e| (e, scale)),
            latents,
            request.steps,
            request.height,
            request.width,
            progress,
        )?;
        // The seed: detach the transformer and drop the phase's state before the VAE.
        let latents_host = to_host(dev, &latents)?;
        drop(latents);
        drop(positive);
        drop(negative);
        let note = if cfg {
            format!(
                "true CFG (true_cfg_scale {scale}): 2 transformer passes per step, {passes} in all"
            )
        } else {
            format!("no true CFG: 1 transformer pass per step, {passes} in all")
        };
        driver.end(
            PHASES[1],
            &[QWEN_TRANSFORMER],
            &[QWEN_TRANSFORMER],
            t0,
            Some(note),
        )?;

        // Phase 3: decode.
        let t0 = driver.begin(&[QWEN_VAE])?;
        let latent_shape = [images, self.vae.config().z_dim, h, w];
        let available = decode_headroom(
            driver.offload(),
            dev,
            self.vae.component(),
            QWEN_VAE,
            request.vram_budget,
        )?;
        let mut plan = plan_qwen_decode_on(
            Some(dev),
            self.vae.config(),
            &latent_shape,
            self.vae.dtype(),
            request.tiled_decode,
            available,
            request.vram_budget,
        )?;
        let image =
            self.decode_planned(dev, &latents_host, request.height, request.width, &mut plan)?;
        progress("decode", 1, 1);
        let image_host = to_host(dev, &image)?;
        drop(image);
        let note = Some(plan.reason.clone());
        driver.end(PHASES[2], &[QWEN_VAE], &[QWEN_VAE], t0, note)?;

        Ok(PipelineRun {
            phases: driver.into_phases(),
            latents: latents_host,
            image: image_host,
            timesteps,
            decode: plan,
        })
    }
}
