//! The phase driver both pipelines share: [`run_guarded`] (on an error or a panic every
//! component is released before the error returns) and [`PhaseDriver`] (each phase begins
//! with its components attached and unmanaged ones on the device, the prompt-encoding phase
//! prepares the next phase's component in the background and finishes its early uploads, and
//! each phase ends with the seed's cleanup, [`PhaseDriver::end`]). [`FluxPipeline::run_phases`]
//! runs prompt encoding, denoise and decode on them;
//! [`QwenImagePipeline::run_phases`](super::QwenImagePipeline::run_phases) runs its own three
//! phases on the same code.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Instant;

use ddo_core::{AllocatorKind, CoreError, Device, Result, RouteTarget};
use ddo_routes::PipelineOffload;

use super::{
    FluxPipeline, PHASES, PhaseReport, PipelineRequest, PipelineRun, Progress, PromptEmbeds,
    PromptInput, TEXT_ENCODER, TEXT_ENCODER_2, TRANSFORMER, VAE, invalid, plan_decode_on, to_host,
};

/// Runs `f` on `offload`; on an error (or a panic, turned into [`CoreError::Panicked`] with
/// `context`) every component of `offload` is released before the error returns: hooks
/// removed, device and pinned memory freed, unmanaged weights moved back to the host.
pub(crate) fn run_guarded<T>(
    offload: &mut PipelineOffload,
    context: &str,
    f: impl FnOnce(&mut PipelineOffload) -> Result<T>,
) -> Result<T> {
    let outcome = catch_unwind(AssertUnwindSafe(|| f(offload)));
    let result = match outcome {
        Ok(r) => r,
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "non-string panic payload".into());
            Err(CoreError::Panicked {
                context: context.into(),
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

/// The phases of one run on the routes of a [`PipelineOffload`]: what begins and ends each
/// phase, and the reports of the phases so far.
pub(crate) struct PhaseDriver<'a> {
    offload: &'a mut PipelineOffload,
    device: Arc<dyn Device>,
    release_idle: bool,
    phases: Vec<PhaseReport>,
    /// The device's first-call counters as the current phase began.
    setup_before: ddo_core::SetupCalls,
}

impl<'a> PhaseDriver<'a> {
    /// A driver on `offload`; `release_native_idle_cache` (the request's) needs the native
    /// allocator on the device and is refused before anything runs otherwise.
    pub(crate) fn new(
        offload: &'a mut PipelineOffload,
        release_native_idle_cache: bool,
    ) -> Result<Self> {
        let device: Arc<dyn Device> = Arc::clone(offload.device());
        if release_native_idle_cache && device.allocator() != AllocatorKind::NativeVmm {
            return Err(CoreError::NativeAllocatorNotInstalled {
                device: device.id().to_string(),
            });
        }
        Ok(Self {
            offload,
            release_idle: release_native_idle_cache,
            phases: Vec::new(),
            setup_before: device.setup_calls(),
            device,
        })
    }

    /// The execution device.
    pub(crate) fn device(&self) -> Arc<dyn Device> {
        Arc::clone(&self.device)
    }

    /// The offload (routes, handles).
    pub(crate) fn offload(&self) -> &PipelineOffload {
        self.offload
    }

    /// Begins a phase of `names`: attaches what the plan attaches per phase and moves
    /// unmanaged components' weights to the device. Returns the phase's start time.
    pub(crate) fn begin(&mut self, names: &[&str]) -> Result<Instant> {
        let t0 = Instant::now();
        self.setup_before = self.device.setup_calls();
        self.offload.begin_phase(names)?;
        onload_unmanaged(self.offload, &*self.device, names)?;
        Ok(t0)
    }

    /// Runs a prompt-encoding phase body `f` of `names` (begun with [`PhaseDriver::begin`]
    /// by the caller): the `next` phase's components' host side (their pinned home) is built
    /// while `f` runs, where their route puts nothing on the device at attach — not while the
    /// encoders attach: T5-XXL's upload and the home's copy share the host's memory bandwidth
    /// (H200 host: prompt encoding 1.56 s with the home built during the attach, 1.12 s after
    /// it; denoise waited 0.41 s more). Where the plan uploads the next component's resident
    /// part during this phase, the phase ends with it on the device (its boundary
    /// synchronises).
    pub(crate) fn encode_with_next<T>(
        &mut self,
        next: &[&str],
        f: impl FnOnce(&dyn Device) -> Result<T>,
    ) -> Result<T> {
        self.offload.prepare(next);
        let out = f(&*self.device)?;
        self.offload.finish_early_uploads();
        Ok(out)
    }

    /// Ends phase `phase`: reports `ran`, releases `release` and records the peak
    /// ([`end_phase`]).
    pub(crate) fn end(
        &mut self,
        phase: &str,
        ran: &[&str],
        release: &[&str],
        t0: Instant,
        note: Option<String>,
    ) -> Result<()> {
        let mut report = end_phase(
            self.offload,
            &*self.device,
            phase,
            ran,
            release,
            t0,
            note,
            self.release_idle,
        )?;
        let now = self.device.setup_calls();
        report.setup_calls = now.since(&self.setup_before);
        // A phase that begins without `begin` (prompt embeddings given) counts from here.
        self.setup_before = now;
        self.phases.push(report);
        Ok(())
    }

    /// The reports of the phases ended so far, in order.
    pub(crate) fn into_phases(self) -> Vec<PhaseReport> {
        self.phases
    }
}

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
        let _cancel = super::cancel::scope(request.cancel.clone());
        run_guarded(offload, "FluxPipeline::run_phases", |offload| {
            self.run_phases_inner(offload, request, progress)
        })
    }

    fn run_phases_inner(
        &self,
        offload: &mut PipelineOffload,
        request: &PipelineRequest,
        progress: Progress<'_>,
    ) -> Result<PipelineRun> {
        self.latent_grid(request.height, request.width)?;
        let mut driver = PhaseDriver::new(offload, request.release_native_idle_cache)?;
        let device = driver.device();
        let dev = &*device;
        if request.num_images == 0 {
            return Err(invalid(
                "num_images",
                "0",
                "give 1 or more images per prompt",
            ));
        }

        // Phase 1: prompt encoding.
        let text = [TEXT_ENCODER, TEXT_ENCODER_2];
        let (embeds, note, t0) = match &request.prompt {
            PromptInput::Embeddings(e) => {
                self.check_embeds(e)?;
                (
                    e.clone(),
                    Some("skipped: prompt embeddings given".to_string()),
                    Instant::now(),
                )
            }
            prompt => {
                let (clip_ids, t5_ids) = match prompt {
                    PromptInput::Tokens { clip, t5 } => (clip.clone(), t5.clone()),
                    PromptInput::Text(p) => self.stand_in_tokens(p)?,
                    PromptInput::Embeddings(_) => (Vec::new(), Vec::new()),
                };
                let t0 = driver.begin(&text)?;
                let e = driver.encode_with_next(&[TRANSFORMER], |dev| {
                    self.encode_prompt(dev, &clip_ids, &t5_ids)
                })?;
                progress("prompt_encoding", 1, 1);
                // Keep what denoise needs on the host; drop the device copies.
                let host = PromptEmbeds {
                    prompt_embeds: to_host(dev, &e.prompt_embeds)?,
                    pooled_prompt_embeds: to_host(dev, &e.pooled_prompt_embeds)?,
                };
                (host, None, t0)
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
        driver.end(PHASES[0], ran, &text, t0, note)?;

        // Phase 2: denoise.
        let t0 = driver.begin(&[TRANSFORMER])?;
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
        driver.end(PHASES[1], &[TRANSFORMER], &[TRANSFORMER], t0, None)?;

        // Phase 3: decode.
        let t0 = driver.begin(&[VAE])?;
        let (h, w) = self.latent_grid(request.height, request.width)?;
        let latent_shape = [images, self.vae.config().latent_channels, h, w];
        let available = decode_headroom(
            driver.offload(),
            dev,
            self.vae.component(),
            VAE,
            request.vram_budget,
        )?;
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
        driver.end(PHASES[2], &[VAE], &[VAE], t0, note)?;

        Ok(PipelineRun {
            phases: driver.into_phases(),
            latents: latents_host,
            image: image_host,
            timesteps,
            decode: plan,
        })
    }
}

/// What the budget leaves free for a decode's activations: the budget (or the device's
/// capacity) minus what is allocated now minus the VAE weights (`component`, named `name` in
/// `offload`) its route will hold on the device (all of them for `none`/unmanaged, the
/// largest leaf otherwise).
pub(crate) fn decode_headroom(
    offload: &PipelineOffload,
    device: &dyn Device,
    component: &ddo_core::Component,
    name: &str,
    budget: Option<u64>,
) -> Result<Option<u64>> {
    let info = device.memory_info();
    let limit = match (budget, info.capacity) {
        (Some(b), 0) => b,
        (Some(b), c) => b.min(c),
        (None, 0) => return Ok(None),
        (None, c) => c,
    };
    let weights = if ddo_routes::keeps_weights_resident(offload.handle(name)?.spec()) {
        if component.params().iter().all(|p| p.device().is_some()) {
            0 // already counted in `allocated`
        } else {
            component.param_bytes()
        }
    } else {
        component.largest_leaf().map_or(0, |l| l.param_bytes())
    };
    Ok(Some(
        limit.saturating_sub(info.allocated).saturating_sub(weights),
    ))
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
        setup_calls: ddo_core::SetupCalls::default(),
    })
}
