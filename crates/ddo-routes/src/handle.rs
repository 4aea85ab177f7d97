//! [`OffloadHandle`]: what `enable_offload` returns.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use ddo_core::detach::detach_auxiliary_cpu_sources;
use ddo_core::{
    AttachedRoute, Component, CoreError, DecidedBy, Device, Preset, Result, RouteSpec, RouteTarget,
    Tensor,
};
use ddo_metrics::{DetachSummary, DeviceMemoryFigures, MetricsSnapshot, PhasePeak, RouteMetrics};

/// A component with a route attached (or deliberately left unmanaged).
///
/// Dropping the handle of a DDO-managed route (`none`, `linear_convolution`,
/// `native_vmm`) removes the route. Dropping the handle of a Diffusers-style group
/// offload leaves its hooks on the component: they end when the component is dropped too.
pub struct OffloadHandle {
    component: Arc<Component>,
    device: Arc<dyn Device>,
    hooks: Option<Arc<dyn AttachedRoute>>,
    spec: RouteSpec,
    decided_by: DecidedBy,
    preset: Option<Preset>,
    metrics: Arc<RouteMetrics>,
    detached: bool,
}

impl std::fmt::Debug for OffloadHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OffloadHandle")
            .field("component", &self.component.name())
            .field("route", &self.spec.describe())
            .field("detached", &self.detached)
            .finish()
    }
}

impl OffloadHandle {
    pub(crate) fn new(
        component: Arc<Component>,
        device: Arc<dyn Device>,
        hooks: Option<Arc<dyn AttachedRoute>>,
        spec: RouteSpec,
        decided_by: DecidedBy,
        preset: Option<Preset>,
        metrics: Arc<RouteMetrics>,
    ) -> Self {
        Self {
            component,
            device,
            hooks,
            spec,
            decided_by,
            preset,
            metrics,
            detached: false,
        }
    }

    /// The component.
    pub fn component(&self) -> &Arc<Component> {
        &self.component
    }

    /// The execution device.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    /// The route (or unmanaged) the component runs under.
    pub fn target(&self) -> RouteTarget {
        self.spec.target()
    }

    /// The route and its options.
    pub fn spec(&self) -> &RouteSpec {
        &self.spec
    }

    /// What decided the route.
    pub fn decided_by(&self) -> &DecidedBy {
        &self.decided_by
    }

    /// The resolved preset, when the route came through `enable_offload`.
    pub fn preset(&self) -> Option<Preset> {
        self.preset
    }

    /// Whether the route was detached (removed, released, or cleaned up after an error).
    pub fn is_detached(&self) -> bool {
        self.detached
    }

    /// The live counters.
    pub fn metrics(&self) -> &Arc<RouteMetrics> {
        &self.metrics
    }

    /// Runs the component's forward through its route.
    pub fn forward(&self, input: Tensor) -> Result<Tensor> {
        if self.detached {
            return Err(CoreError::Detached {
                component: self.component.name().to_string(),
            });
        }
        self.component.forward(&*self.device, input)
    }

    /// Everything the route reports, now.
    pub fn metrics_snapshot(&self) -> MetricsSnapshot {
        let info = self.device.memory_info();
        let route = if self.detached {
            format!("{} (detached)", self.spec.target())
        } else {
            self.spec.target().to_string()
        };
        MetricsSnapshot {
            component: self.component.name().to_string(),
            route,
            route_options: self.spec.describe(),
            preset: self.preset.map(|p| p.as_str().to_string()),
            decided_by: self.decided_by.to_string(),
            device: self.device.id().to_string(),
            allocator: self.device.allocator().as_str().to_string(),
            counters: self.metrics.counters(),
            memory: DeviceMemoryFigures {
                allocated_bytes: info.allocated,
                peak_allocated_bytes: info.peak_allocated,
                reserved_bytes: info.reserved,
                capacity_bytes: info.capacity,
                driver_free_bytes: info.driver_free,
                pinned_host_bytes: info.pinned_host,
                native_pool: self.device.native_pool_figures(),
            },
            phases: self.metrics.phases(),
            detach_reports: self.metrics.detach_reports(),
            resident_leaves: self.metrics.resident_leaves(),
            timeline: self.metrics.timeline(),
            first_timeline: self.metrics.first_timeline(),
            coded: self.metrics.coded(),
        }
    }

    /// DDO's managed error boundary. Runs `f`; when it returns an error or panics, the
    /// route is released (device and pinned memory freed, hooks removed, weights left on
    /// the host, intact) and the error comes back typed — a panic as
    /// [`CoreError::Panicked`]. The component can then be attached to any route again.
    pub fn cleanup_on_error<T>(
        &mut self,
        f: impl FnOnce(&OffloadHandle) -> Result<T>,
    ) -> Result<T> {
        let outcome = catch_unwind(AssertUnwindSafe(|| f(self)));
        match outcome {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => {
                self.release();
                Err(e)
            }
            Err(panic) => {
                self.release();
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "non-string panic payload".to_string());
                Err(CoreError::Panicked {
                    context: format!("cleanup_on_error on `{}`", self.component.name()),
                    message,
                })
            }
        }
    }

    /// Copies the component's small checkpoint-backed host tensors into owned memory within
    /// `max_copy_bytes`, so the checkpoint mapping can be dropped; see
    /// [`ddo_core::detach`]. Must run before the first forward. The report is also kept in
    /// the metrics.
    pub fn detach_auxiliary_cpu_sources(
        &self,
        enabled: bool,
        max_copy_bytes: u64,
    ) -> Result<DetachSummary> {
        if self.detached {
            return Err(CoreError::Detached {
                component: self.component.name().to_string(),
            });
        }
        let report = detach_auxiliary_cpu_sources(
            &self.component,
            self.metrics.forwards(),
            enabled,
            max_copy_bytes,
        )?;
        self.metrics.push_detach(report.clone());
        Ok(report)
    }

    /// Ends a phase for this component alone: the route drops its transient buffers, the
    /// device is synchronised, and the device's peak since the last boundary is recorded
    /// (and reset). In a pipeline, use [`crate::PipelineOffload::phase_boundary`], which
    /// records one figure for the device.
    pub fn end_phase(&self, phase: &str) -> Result<PhasePeak> {
        self.end_route_phase()?;
        let peak = record_phase(&*self.device, phase)?;
        self.metrics.push_phase(peak.clone());
        Ok(peak)
    }

    /// Queues the route's resident upload now ([`ddo_core::AttachedRoute::upload_resident`]); 0 bytes
    /// for an unmanaged or detached component.
    pub(crate) fn upload_resident(&self) -> Result<u64> {
        match (&self.hooks, self.detached) {
            (Some(h), false) => h.upload_resident(),
            _ => Ok(0),
        }
    }

    pub(crate) fn end_route_phase(&self) -> Result<()> {
        match (&self.hooks, self.detached) {
            (Some(h), false) => h.end_phase(),
            _ => Ok(()),
        }
    }

    pub(crate) fn push_phase(&self, peak: PhasePeak) {
        self.metrics.push_phase(peak);
    }

    /// `remove_dynamic_offload`: see [`crate::remove_dynamic_offload`].
    pub(crate) fn remove(&mut self) -> Result<()> {
        let Some(hooks) = self.hooks.clone() else {
            return Ok(());
        };
        if self.detached {
            return Ok(());
        }
        if !hooks.removable() {
            return Err(CoreError::NotOwned {
                route: hooks.route_name(),
                component: self.component.name().to_string(),
            });
        }
        self.component.remove_hooks(&hooks);
        self.detached = true;
        self.hooks = None;
        hooks.detach()
    }

    /// Releases the route whatever it is (DDO's managed boundary): hooks removed, device
    /// and pinned memory freed, weights host-only. Never panics; errors from the route's
    /// own teardown are dropped because the memory is released regardless.
    pub(crate) fn release(&mut self) {
        if let Some(hooks) = self.hooks.take() {
            self.component.remove_hooks(&hooks);
            let _ = hooks.detach();
        }
        let _ = self.device.synchronize();
        self.detached = true;
    }
}

/// Synchronises `device`, reads its peak since the last reset, and resets it.
pub(crate) fn record_phase(device: &dyn Device, phase: &str) -> Result<PhasePeak> {
    device.synchronize()?;
    let info = device.memory_info();
    let native_pool = device.native_pool_figures();
    let driver_used = match (info.driver_total, info.driver_free) {
        (Some(total), Some(free)) => Some(total.saturating_sub(free)),
        _ => None,
    };
    device.reset_peak();
    Ok(PhasePeak {
        phase: phase.to_string(),
        allocator_peak_bytes: info.peak_allocated,
        allocator_end_bytes: info.allocated,
        driver_used_sampled_bytes: driver_used,
        native_pool,
    })
}

impl Drop for OffloadHandle {
    fn drop(&mut self) {
        match &self.hooks {
            Some(h) if !self.detached && h.removable() => self.release(),
            // Group offload hooks stay with the component; unmanaged has nothing to drop.
            _ => {}
        }
    }
}
