//! [`Pipeline`] (named components) and [`PipelineOffload`] (their handles, phase
//! boundaries and per-phase peaks). A `PipelineOffload` made from a memory plan
//! ([`enable_planned_pipeline_offload`](crate::enable_planned_pipeline_offload)) attaches
//! each component when its phase starts ([`PipelineOffload::begin_phase`]), so phases never
//! hold each other's device or pinned memory.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
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
    pending: BTreeMap<String, (Arc<Component>, Resolution)>,
    /// Seconds each component's attach took (pinning, uploads of resident weights).
    setup_seconds: BTreeMap<String, f64>,
    phases: Vec<PhasePeak>,
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
            setup_seconds: BTreeMap::new(),
            phases: Vec::new(),
        }
    }

    /// A pipeline whose components attach when their phase starts.
    pub(crate) fn deferred(
        device: Arc<dyn Device>,
        pending: Vec<(Arc<Component>, Resolution)>,
    ) -> Self {
        let mut offload = Self::new(device, Vec::new());
        offload.pending = pending
            .into_iter()
            .map(|(c, r)| (c.name().to_string(), (c, r)))
            .collect();
        offload
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
            let Some((component, resolution)) = self.pending.remove(*name) else {
                continue;
            };
            let started = Instant::now();
            match crate::attach(
                &component,
                Arc::clone(&self.device),
                resolution.spec,
                resolution.decided_by.clone(),
                Some(resolution.preset),
            ) {
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

    /// Seconds the attach of component `name` took, once its phase has begun.
    pub fn setup_seconds(&self, name: &str) -> Option<f64> {
        self.setup_seconds.get(name).copied()
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
        let h = self.handle_mut(name)?;
        h.release();
        Ok(())
    }

    /// Phases recorded so far.
    pub fn phases(&self) -> &[PhasePeak] {
        &self.phases
    }

    fn unknown(&self, name: &str) -> CoreError {
        if self.pending.contains_key(name) {
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
                .cloned()
                .collect::<Vec<_>>()
                .join(", "),
        }
    }
}
