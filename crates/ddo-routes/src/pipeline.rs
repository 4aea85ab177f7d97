//! [`Pipeline`] (named components) and [`PipelineOffload`] (their handles, phase
//! boundaries and per-phase peaks).

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use ddo_core::{Component, CoreError, Device, Result};
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
            phases: Vec::new(),
        }
    }

    /// The handle of component `name`.
    pub fn handle(&self, name: &str) -> Result<&OffloadHandle> {
        self.handles.get(name).ok_or_else(|| self.unknown(name))
    }

    /// The handle of component `name`, mutably (for `cleanup_on_error`).
    pub fn handle_mut(&mut self, name: &str) -> Result<&mut OffloadHandle> {
        let unknown = self.unknown(name);
        self.handles.get_mut(name).ok_or(unknown)
    }

    /// Component names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.handles.keys().map(String::as_str)
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
    pub fn release(&mut self, name: &str) -> Result<()> {
        let h = self.handle_mut(name)?;
        h.release();
        Ok(())
    }

    /// Phases recorded so far.
    pub fn phases(&self) -> &[PhasePeak] {
        &self.phases
    }

    fn unknown(&self, name: &str) -> CoreError {
        CoreError::UnknownComponent {
            name: name.to_string(),
            known: self.handles.keys().cloned().collect::<Vec<_>>().join(", "),
        }
    }
}
