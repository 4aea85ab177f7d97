//! [`Pipeline`] (named components) and [`PipelineOffload`] (their handles, phase
//! boundaries and per-phase peaks). A `PipelineOffload` made from a memory plan
//! ([`enable_planned_pipeline_offload`](crate::enable_planned_pipeline_offload)) attaches
//! each component when its phase starts ([`PipelineOffload::begin_phase`]), so phases never
//! hold each other's device memory. A component whose route takes device memory only from
//! its first forward on (a streamed group offload: its attach builds the pinned home) can be
//! attached on a background thread while the phase before it runs
//! ([`PipelineOffload::prepare`]), so that host-side setup costs no wall time. Where the
//! plan leaves room for it in that phase ([`ComponentPlan::upload_during`]), the background
//! attach also queues the upload of the weights the route keeps resident, so the link
//! carries them while the phase before runs rather than in the component's first forward;
//! [`PipelineOffload::finish_early_uploads`] ends that phase with them on the device.
//!
//! [`ComponentPlan::upload_during`]: crate::ComponentPlan::upload_during

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use ddo_core::{Component, CoreError, Device, Resolution, Result};
use ddo_metrics::PhasePeak;

use crate::handle::{OffloadHandle, record_phase};

/// The components of a diffusion pipeline, by name.
#[derive(Debug, Clone)]
pub struct Pipeline {
    components: Vec<Arc<Component>>,
}

impl Pipeline {
    /// A pipeline of `components`; names must be unique.
    pub fn new(components: Vec<Arc<Component>>) -> Result<Self> {
        let mut names = HashSet::new();
        for c in &components {
            if !names.insert(c.name().to_string()) {
                return Err(CoreError::InvalidOption {
                    option: "pipeline components".into(),
                    value: c.name().to_string(),
                    hint: "component names must be unique within a pipeline".into(),
                });
            }
        }
        Ok(Self { components })
    }

    /// The components in order.
    pub fn components(&self) -> &[Arc<Component>] {
        &self.components
    }

    /// A component by name.
    pub fn get(&self, name: &str) -> Option<&Arc<Component>> {
        self.components.iter().find(|c| c.name() == name)
    }
}

/// A pipeline with its routes attached.
#[derive(Debug)]
pub struct PipelineOffload {
    device: Arc<dyn Device>,
    handles: BTreeMap<String, OffloadHandle>,
    /// Components whose phase has not started: attached by [`PipelineOffload::begin_phase`].
    pending: BTreeMap<String, Pending>,
    /// Components being attached on a background thread ([`PipelineOffload::prepare`]).
    preparing: BTreeMap<String, Preparing>,
    /// Seconds each component's phase waited for its attach (pinning, uploads of resident
    /// weights; for a prepared component only what was left when its phase began).
    setup_seconds: BTreeMap<String, f64>,
    /// Seconds a prepared component's background attach took.
    prepared_seconds: BTreeMap<String, f64>,
    phases: Vec<PhasePeak>,
    /// Give a released component's host memory back at once (unpin its released
    /// registrations, drop its mapped pages from the process): the plan's host budget holds
    /// no two phases' pinned memory together ([`PipelinePlan::gives_host_back`](crate::PipelinePlan::gives_host_back)).
    give_host_back: bool,
    /// Bytes of each released component's file pages dropped from the process.
    host_bytes_released: BTreeMap<String, u64>,
}

/// A component waiting for its phase.
#[derive(Debug)]
struct Pending {
    component: Arc<Component>,
    resolution: Resolution,
    /// The plan has room for its resident weights in the phase before its own: a
    /// background attach uploads them too.
    upload_early: bool,
    /// The plan attaches it in the background during the phase before
    /// ([`ComponentPlan::prepare_during`](crate::ComponentPlan::prepare_during)).
    prepare: bool,
}

/// A background attach: its thread gives the handle (or the error) and the seconds it took,
/// kept once joined until the component's phase begins.
#[derive(Debug)]
struct Preparing {
    thread: Option<JoinHandle<(Result<OffloadHandle>, f64)>>,
    joined: Option<(Result<OffloadHandle>, f64)>,
    upload_early: bool,
}

impl PipelineOffload {
    pub(crate) fn new(device: Arc<dyn Device>, handles: Vec<OffloadHandle>) -> Self {
        device.reset_peak();
        Self {
            device,
            handles: handles
                .into_iter()
                .map(|h| (h.component().name().to_string(), h))
                .collect(),
            pending: BTreeMap::new(),
            preparing: BTreeMap::new(),
            setup_seconds: BTreeMap::new(),
            prepared_seconds: BTreeMap::new(),
            phases: Vec::new(),
            give_host_back: false,
            host_bytes_released: BTreeMap::new(),
        }
    }

    /// A pipeline whose components attach when their phase starts.
    /// `pending` is `(component, resolution, whether its attach is host-only, whether a
    /// background attach uploads its resident weights, whether the plan attaches it in the
    /// background)`; `give_host_back` as [`PipelinePlan::gives_host_back`](crate::PipelinePlan::gives_host_back).
    pub(crate) fn deferred(
        device: Arc<dyn Device>,
        pending: Vec<(Arc<Component>, Resolution, bool, bool, bool)>,
        give_host_back: bool,
    ) -> Self {
        let mut offload = Self::new(device, Vec::new());
        offload.give_host_back = give_host_back;
        offload.pending = pending
            .into_iter()
            .map(
                |(component, resolution, host_only_attach, upload_early, prepare)| {
                    (
                        component.name().to_string(),
                        Pending {
                            component,
                            resolution,
                            upload_early: host_only_attach && upload_early,
                            prepare: host_only_attach && prepare,
                        },
                    )
                },
            )
            .collect();
        offload
    }

    /// Starts attaching, each on a background thread, the components of `names` that wait
    /// for their phase, whose route puts nothing on the device at attach and which the plan
    /// attaches in the background (the others, attached, or unknown names are skipped);
    /// returns the names started. Their phase's
    /// [`PipelineOffload::begin_phase`] waits for the attach and reports its error, if any.
    /// Call it while the phase before theirs runs: their host side (a pinned home, page-locked
    /// mappings) is then built meanwhile. A component the plan uploads early
    /// ([`ComponentPlan::upload_during`](crate::ComponentPlan::upload_during)) has its resident
    /// weights queued for upload as soon as it is attached: the device memory the plan
    /// counted for them in this phase is taken then.
    pub fn prepare(&mut self, names: &[&str]) -> Vec<String> {
        let mut started = Vec::new();
        for name in names {
            if !self.pending.get(*name).is_some_and(|p| p.prepare) {
                continue;
            }
            let Some(p) = self.pending.remove(*name) else {
                continue;
            };
            let device = Arc::clone(&self.device);
            let upload_early = p.upload_early;
            let spawned = std::thread::Builder::new()
                .name(format!("ddo-prepare-{name}"))
                .spawn({
                    let (component, resolution) = (Arc::clone(&p.component), p.resolution.clone());
                    move || {
                        let t = Instant::now();
                        let handle =
                            crate::enable_resolved_offload(&component, device, &resolution);
                        let handle = match handle {
                            Ok(mut h) if upload_early => match h.upload_resident() {
                                Ok(_) => Ok(h),
                                Err(e) => {
                                    h.release();
                                    Err(e)
                                }
                            },
                            other => other,
                        };
                        (handle, t.elapsed().as_secs_f64())
                    }
                });
            match spawned {
                Ok(thread) => {
                    self.preparing.insert(
                        name.to_string(),
                        Preparing {
                            thread: Some(thread),
                            joined: None,
                            upload_early,
                        },
                    );
                    started.push(name.to_string());
                }
                // No thread to be had: the component attaches when its phase begins.
                Err(_) => {
                    self.pending.insert(name.to_string(), p);
                }
            }
        }
        started
    }

    /// Waits for the background attach of `name`, if one runs: its handle is kept (or its
    /// error returned) and the time it took recorded.
    fn finish_preparing(&mut self, name: &str) -> Option<Result<OffloadHandle>> {
        let mut preparing = self.preparing.remove(name)?;
        let (handle, seconds) = match preparing.joined.take() {
            Some(joined) => joined,
            None => join_attach(name, preparing.thread.take()?),
        };
        self.prepared_seconds.insert(name.to_string(), seconds);
        Some(handle)
    }

    /// Waits for the background attaches that upload resident weights early
    /// ([`PipelineOffload::prepare`]) and returns the components whose upload is queued, so
    /// the phase that runs meanwhile can end with those weights on the device (its boundary
    /// synchronises the device). Their handles wait for their own phase
    /// ([`PipelineOffload::begin_phase`]); an attach that failed reports its error there.
    pub fn finish_early_uploads(&mut self) -> Vec<String> {
        let mut done = Vec::new();
        for (name, p) in &mut self.preparing {
            if !p.upload_early {
                continue;
            }
            if let Some(thread) = p.thread.take() {
                p.joined = Some(join_attach(name, thread));
            }
            if matches!(p.joined, Some((Ok(_), _))) {
                done.push(name.clone());
            }
        }
        done
    }

    /// The device the pipeline runs on.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    /// Attaches the components of `names` that are still waiting for their phase (those
    /// already attached, or unknown, are skipped) and returns how long each attach took.
    /// On an error the components this call attached are released again.
    pub fn begin_phase(&mut self, names: &[&str]) -> Result<Vec<(String, f64)>> {
        let mut done = Vec::new();
        for name in names {
            let started = Instant::now();
            let attached = if let Some(prepared) = self.finish_preparing(name) {
                prepared
            } else if let Some(p) = self.pending.remove(*name) {
                crate::enable_resolved_offload(
                    &p.component,
                    Arc::clone(&self.device),
                    &p.resolution,
                )
            } else {
                continue;
            };
            match attached {
                Ok(h) => {
                    let seconds = started.elapsed().as_secs_f64();
                    self.setup_seconds.insert(name.to_string(), seconds);
                    self.handles.insert(name.to_string(), h);
                    done.push((name.to_string(), seconds));
                }
                Err(e) => {
                    for (n, _) in &done {
                        if let Some(h) = self.handles.get_mut(n) {
                            h.release();
                        }
                    }
                    return Err(e);
                }
            }
        }
        Ok(done)
    }

    /// Seconds the phase of component `name` waited for its attach, once the phase has
    /// begun (for a prepared component, what was left of its background attach).
    pub fn setup_seconds(&self, name: &str) -> Option<f64> {
        self.setup_seconds.get(name).copied()
    }

    /// Seconds the background attach of component `name` took
    /// ([`PipelineOffload::prepare`]), once its phase has begun.
    pub fn prepared_seconds(&self, name: &str) -> Option<f64> {
        self.prepared_seconds.get(name).copied()
    }

    /// The handle of component `name` (attached: eagerly, or once its phase has begun).
    pub fn handle(&self, name: &str) -> Result<&OffloadHandle> {
        self.handles.get(name).ok_or_else(|| self.unknown(name))
    }

    /// The handle of component `name`, mutably (for `cleanup_on_error`).
    pub fn handle_mut(&mut self, name: &str) -> Result<&mut OffloadHandle> {
        let unknown = self.unknown(name);
        self.handles.get_mut(name).ok_or(unknown)
    }

    /// Component names, attached or waiting for their phase.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        let mut all: Vec<&str> = self
            .handles
            .keys()
            .chain(self.pending.keys())
            .chain(self.preparing.keys())
            .map(String::as_str)
            .collect();
        all.sort_unstable();
        all.into_iter()
    }

    /// Ends `phase`: every route drops its transient buffers, the device is synchronised,
    /// and the device's peak during the phase is recorded (in every handle's metrics and
    /// here) and reset for the next phase.
    pub fn phase_boundary(&mut self, phase: &str) -> Result<PhasePeak> {
        for h in self.handles.values() {
            h.end_route_phase()?;
        }
        let peak = record_phase(&*self.device, phase)?;
        for h in self.handles.values() {
            h.push_phase(peak.clone());
        }
        self.phases.push(peak.clone());
        Ok(peak)
    }

    /// Releases component `name` after its last phase (whatever its route: this is DDO's
    /// managed boundary): hooks removed, device and pinned memory freed, weights host-only.
    /// The handle stays, detached, so its metrics can still be read.
    /// A component whose phase never began is just dropped from the waiting list.
    pub fn release(&mut self, name: &str) -> Result<()> {
        if self.pending.remove(name).is_some() {
            return Ok(());
        }
        if let Some(prepared) = self.finish_preparing(name) {
            // Attached in the background: keep the handle (detached) for its metrics.
            let mut h = prepared?;
            h.release();
            self.handles.insert(name.to_string(), h);
            return Ok(());
        }
        let h = self.handle_mut(name)?;
        h.release();
        let component = Arc::clone(h.component());
        let released = self.give_back_host(&component);
        self.host_bytes_released.insert(name.to_string(), released);
        Ok(())
    }

    /// Bytes of component `name`'s file pages dropped from the process at its release
    /// (`None` before it).
    pub fn host_bytes_released(&self, name: &str) -> Option<u64> {
        self.host_bytes_released.get(name).copied()
    }

    /// Gives `component`'s host memory back after its release: where the plan's host budget
    /// cannot hold two phases' pinned memory ([`PipelinePlan::gives_host_back`](crate::PipelinePlan::gives_host_back)),
    /// the registrations the device kept pinned for reuse are unpinned (the device is idle at
    /// a phase boundary, so unregistering waits for nothing); always, the pages of its
    /// checkpoint mappings leave the process (issue 35: a component that ran, T5 say, needs
    /// no host copy; [`CheckpointMap::release_pages`](ddo_core::CheckpointMap::release_pages):
    /// the bytes stay readable, from the page cache or the file). Returns the mapped bytes
    /// released.
    fn give_back_host(&self, component: &Component) -> u64 {
        if self.give_host_back {
            self.device.unpin_released();
        }
        component
            .params()
            .iter()
            .map(|p| p.host().release_pages())
            .sum()
    }

    /// Phases recorded so far.
    pub fn phases(&self) -> &[PhasePeak] {
        &self.phases
    }

    fn unknown(&self, name: &str) -> CoreError {
        if self.pending.contains_key(name) || self.preparing.contains_key(name) {
            return CoreError::InvalidOption {
                option: "component".into(),
                value: name.to_string(),
                hint: "not attached yet: it attaches when its phase begins (PipelineOffload::begin_phase)"
                    .into(),
            };
        }
        CoreError::UnknownComponent {
            name: name.to_string(),
            known: self
                .handles
                .keys()
                .chain(self.pending.keys())
                .chain(self.preparing.keys())
                .cloned()
                .collect::<Vec<_>>()
                .join(", "),
        }
    }
}

/// Joins a background attach: its handle (or error, a panic included) and its seconds.
fn join_attach(
    name: &str,
    thread: JoinHandle<(Result<OffloadHandle>, f64)>,
) -> (Result<OffloadHandle>, f64) {
    thread.join().unwrap_or_else(|panic| {
        let message = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "non-string panic payload".into());
        (
            Err(CoreError::Panicked {
                context: format!("attaching {name} in the background"),
                message,
            }),
            0.0,
        )
    })
}

impl Drop for PipelineOffload {
    /// A background attach still running is waited for and its component released, so no
    /// thread outlives the pipeline holding its pinned memory.
    fn drop(&mut self) {
        let names: Vec<String> = self.preparing.keys().cloned().collect();
        for name in names {
            if let Some(Ok(mut h)) = self.finish_preparing(&name) {
                h.release();
            }
        }
    }
}
