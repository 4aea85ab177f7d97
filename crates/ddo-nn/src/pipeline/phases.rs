//! The phase driver: [`FluxPipeline::run_phases`] runs prompt encoding, denoise and
//! decode on the routes of a [`PipelineOffload`], with the seed's cleanup at each phase
//! boundary (`end_phase`).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Instant;

use ddo_core::{AllocatorKind, CoreError, Device, Result, RouteId, RouteTarget};
use ddo_routes::PipelineOffload;

use super::{
    FluxPipeline, PHASES, PhaseReport, PipelineRequest, PipelineRun, Progress, PromptEmbeds,
    PromptInput, TEXT_ENCODER, TEXT_ENCODER_2, TRANSFORMER, VAE, invalid, plan_decode_on, to_host,
};

impl FluxPipeline {
    /// Runs the pipeline in phases on the routes of `offload` (made from
    /// [`FluxPipeline::offload_pipeline`]), with the seed's cleanup between phases. On an
    /// error (or a panic) every component is released before the error returns.
    pub fn run_phases(
        &self,
        offload: &mut PipelineOffload,
        request: &PipelineRequest,
        progress: Progress<'_>,
    ) -> Result<PipelineRun> {
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            self.run_phases_inner(offload, request, progress)
        }));
        let result = match outcome {
            Ok(r) => r,
            Err(panic) => {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "non-string panic payload".into());
                Err(CoreError::Panicked {
                    context: "FluxPipeline::run_phases".into(),
                    message,
                })
            }
        };
        if result.is_err() {
            let names: Vec<String> = offload.names().map(str::to_string).collect();
            for name in names {
                if let Ok(h) = offload.handle(&name)
                    && h.target() == RouteTarget::Unmanaged
                {
                    let _ = h.component().to_host();
                }
                let _ = offload.release(&name);
            }
        }
        result
    }

    fn run_phases_inner(
        &self,
        offload: &mut PipelineOffload,
        request: &PipelineRequest,
        progress: Progress<'_>,
    ) -> Result<PipelineRun> {
        let device: Arc<dyn Device> = Arc::clone(offload.device());
        let dev = &*device;
        self.latent_grid(request.height, request.width)?;
        if request.release_native_idle_cache && dev.allocator() != AllocatorKind::NativeVmm {
            return Err(CoreError::NativeAllocatorNotInstalled {
                device: dev.id().to_string(),
            });
        }
        let release_idle = request.release_native_idle_cache;
        if request.num_images == 0 {
            return Err(invalid(
                "num_images",
                "0",
                "give 1 or more images per prompt",
            ));
        }
        let mut phases = Vec::new();

        // Phase 1: prompt encoding.
        let t0 = Instant::now();
        let text = [TEXT_ENCODER, TEXT_ENCODER_2];
        let (embeds, note) = match &request.prompt {
            PromptInput::Embeddings(e) => {
                self.check_embeds(e)?;
                (
                    e.clone(),
                    Some("skipped: prompt embeddings given".to_string()),
                )
            }
            prompt => {
                let (clip_ids, t5_ids) = match prompt {
                    PromptInput::Tokens { clip, t5 } => (clip.clone(), t5.clone()),
                    PromptInput::Text(p) => self.stand_in_tokens(p)?,
                    PromptInput::Embeddings(_) => (Vec::new(), Vec::new()),
                };
                offload.begin_phase(&text)?;
                onload_unmanaged(offload, dev, &text)?;
                // The transformer's host side (its pinned home) is built while the text
                // encoders run, where its route puts nothing on the device at attach. Not
                // while they attach: T5-XXL's upload and the home's copy share the host's
                // memory bandwidth (H200 host: prompt encoding 1.56 s with the home built
                // during the attach, 1.12 s after it; denoise waited 0.41 s more).
                offload.prepare(&[TRANSFORMER]);
                let e = self.encode_prompt(dev, &clip_ids, &t5_ids)?;
                // Where the plan uploads the transformer's resident part during this phase,
                // the phase ends with it on the device (its boundary synchronises).
                offload.finish_early_uploads();
                progress("prompt_encoding", 1, 1);
                // Keep what denoise needs on the host; drop the device copies.
                let host = PromptEmbeds {
                    prompt_embeds: to_host(dev, &e.prompt_embeds)?,
                    pooled_prompt_embeds: to_host(dev, &e.pooled_prompt_embeds)?,
                };
                (host, None)
            }
        };
        // num_images_per_prompt: each prompt's embeddings once per image.
        let embeds = if request.num_images == 1 {
            embeds
        } else {
            embeds.repeat_each(request.num_images)?
        };
        let images = embeds.batch();
        let ran = if note.is_none() { &text[..] } else { &[][..] };
        phases.push(end_phase(
            offload,
            dev,
            PHASES[0],
            ran,
            &text,
            t0,
            note,
            release_idle,
        )?);

        // Phase 2: denoise.
        let t0 = Instant::now();
        offload.begin_phase(&[TRANSFORMER])?;
        onload_unmanaged(offload, dev, &[TRANSFORMER])?;
        let latents =
            self.initial_latents(dev, &request.init, request.height, request.width, images)?;
        let (latents, timesteps) = self.denoise(
            dev,
            &embeds,
            latents,
            request.steps,
            request.guidance,
            request.height,
            request.width,
            progress,
        )?;
        // The seed: detach the transformer and drop the phase's state before the VAE.
        let latents_host = to_host(dev, &latents)?;
        drop(latents);
        drop(embeds);
        phases.push(end_phase(
            offload,
            dev,
            PHASES[1],
            &[TRANSFORMER],
            &[TRANSFORMER],
            t0,
            None,
            release_idle,
        )?);

        // Phase 3: decode.
        let t0 = Instant::now();
        offload.begin_phase(&[VAE])?;
        onload_unmanaged(offload, dev, &[VAE])?;
        let (h, w) = self.latent_grid(request.height, request.width)?;
        let latent_shape = [images, self.vae.config().latent_channels, h, w];
        let available = self.decode_headroom(offload, dev, request.vram_budget)?;
        let mut plan = plan_decode_on(
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
        phases.push(end_phase(
            offload,
            dev,
            PHASES[2],
            &[VAE],
            &[VAE],
            t0,
            note,
            release_idle,
        )?);

        Ok(PipelineRun {
            phases,
            latents: latents_host,
            image: image_host,
            timesteps,
            decode: plan,
        })
    }

    /// What the budget leaves free for the decode's activations: the budget (or the
    /// device's capacity) minus what is allocated now minus the VAE weights its route will
    /// hold on the device (all of them for `none`/unmanaged, the largest leaf otherwise).
    fn decode_headroom(
        &self,
        offload: &PipelineOffload,
        device: &dyn Device,
        budget: Option<u64>,
    ) -> Result<Option<u64>> {
        let info = device.memory_info();
        let limit = match (budget, info.capacity) {
            (Some(b), 0) => b,
            (Some(b), c) => b.min(c),
            (None, 0) => return Ok(None),
            (None, c) => c,
        };
        let component = self.vae.component();
        let weights = match offload.handle(VAE)?.target() {
            RouteTarget::Unmanaged | RouteTarget::Route(RouteId::Resident) => {
                if component.params().iter().all(|p| p.device().is_some()) {
                    0 // already counted in `allocated`
                } else {
                    component.param_bytes()
                }
            }
            RouteTarget::Route(_) => component.largest_leaf().map_or(0, |l| l.param_bytes()),
        };
        Ok(Some(
            limit.saturating_sub(info.allocated).saturating_sub(weights),
        ))
    }
}

/// Moves the weights of unmanaged components (preset `off`) to the device for their phase,
/// as `pipe.to(device)` would: DDO attached nothing to them.
fn onload_unmanaged(offload: &PipelineOffload, device: &dyn Device, names: &[&str]) -> Result<()> {
    for name in names {
        let Ok(h) = offload.handle(name) else {
            continue;
        };
        if h.target() == RouteTarget::Unmanaged
            && h.component().params().iter().any(|p| p.device().is_none())
        {
            h.component().to_device(device, &device.compute_stream())?;
        }
    }
    Ok(())
}

/// The seed's phase boundary: release the components whose last phase this was (hooks
/// removed, device and pinned memory freed; unmanaged weights moved back to the host),
/// return idle cached memory, then record the phase's peak with `phase_boundary`.
#[allow(clippy::too_many_arguments)] // one call per phase; a struct would only rename them
fn end_phase(
    offload: &mut PipelineOffload,
    device: &dyn Device,
    phase: &str,
    ran: &[&str],
    release: &[&str],
    t0: Instant,
    note: Option<String>,
    release_idle: bool,
) -> Result<PhaseReport> {
    let mut components = Vec::new();
    let mut setup_seconds = Vec::new();
    let mut prepared_seconds = Vec::new();
    for name in ran {
        if let Ok(h) = offload.handle(name) {
            components.push(format!("{name}: {}", h.spec().describe()));
        }
        if let Some(s) = offload.setup_seconds(name) {
            setup_seconds.push((name.to_string(), s));
        }
        if let Some(s) = offload.prepared_seconds(name) {
            prepared_seconds.push((name.to_string(), s));
        }
    }
    let cleanup = Instant::now();
    for name in release {
        let Ok(h) = offload.handle(name) else {
            continue;
        };
        if h.target() == RouteTarget::Unmanaged {
            h.component().to_host()?;
        }
        offload.release(name)?;
    }
    device.synchronize()?;
    device.empty_cache()?;
    let idle_release = if release_idle {
        Some(ddo_routes::release_native_vmm_idle_cache(device)?)
    } else {
        None
    };
    let peak = offload.phase_boundary(phase)?;
    Ok(PhaseReport {
        phase: phase.to_string(),
        components,
        seconds: t0.elapsed().as_secs_f64(),
        peak,
        note,
        idle_release,
        setup_seconds,
        prepared_seconds,
        cleanup_seconds: cleanup.elapsed().as_secs_f64(),
    })
}
