//! The `linear_convolution` route: the seed's isolated eager configuration. Every leaf's
//! weights live on the host (pinned by default) and are copied to the execution device just
//! before the leaf runs and freed just after it, so nothing of the component stays on the
//! device between leaves (zero residency). There is no budget, no copy stream and no
//! persistent pinned cache: the pinned weights are the weights' one host copy (a
//! [`PinnedHome`] that replaces their host bytes at attach, within the device's pinned
//! limit), never a second copy, and detach unpins them in place. Bytes are copied as they
//! are: the leaf's own dense forward and dtype are preserved.
//!
//! This crate is one of the route crates above `ddo-core`: it talks to the
//! [`Device`] trait only (so it runs on the host backend in CI and on CUDA unchanged),
//! moves params through [`ResidencyTable`] and [`PinnedHome`], and is registered in the
//! static route table of `ddo-routes`, which calls [`Route::preflight`], then
//! [`Route::attach`], then installs the returned hooks on the component.
//!
//! Preflight refuses, touching nothing: a device with the native VMM allocator installed,
//! quantized params, and explicit options the route cannot honour (`budget`, and the
//! group-offload options `offload_type`, `num_blocks_per_group`, `use_stream`,
//! `record_stream`, `low_cpu_mem_usage`). `pinned=false` is accepted.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use ddo_core::residency::{EagerLeafStreamer, ResidencyTable};
use ddo_core::streaming::PinnedHome;
use ddo_core::{
    AllocatorKind, AttachedRoute, Component, CoreError, DType, Device, DeviceId, Footprint,
    FootprintContext, Leaf, OptionDecl, OptionKind, OptionTable, Param, Refusal, RefusedOption,
    Result, Route, RouteId, RouteSpec,
};
use ddo_metrics::RouteMetrics;
use parking_lot::Mutex;

/// The hint given when a `budget` is passed to `linear_convolution`.
pub const BUDGET_HINT: &str =
    "linear_convolution keeps zero residency and has no budget; use native_vmm with a budget";

/// The hint given when a group-offload option is passed to `linear_convolution`.
pub const GROUP_OFFLOAD_HINT: &str = "use diffusers_group_offload for grouped or streamed offload";

/// Whether weights are pinned when the spec does not say (this route enables them).
pub const PINNED_BY_DEFAULT: bool = true;

/// The options of `linear_convolution`: `pinned`; a budget and Diffusers' group-offload
/// and streaming options are refused.
pub static OPTIONS: OptionTable = OptionTable {
    options: &[OptionDecl::new(
        "pinned",
        OptionKind::Flag,
        "true",
        "page-lock the weights' one host copy (a pinned home replacing their host bytes)",
    )],
    refused: &[RefusedOption {
        name: "budget",
        hint: BUDGET_HINT,
    }],
    others_hint: GROUP_OFFLOAD_HINT,
};

/// The `linear_convolution` route (registered as [`RouteId::LINEAR_CONVOLUTION`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct LinearConvolutionRoute;

/// The route's settings, resolved from a [`RouteSpec`] that passed preflight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinearConvolutionConfig {
    /// Page-lock the weights' one host copy for the attachment's life (default true).
    pub pinned: bool,
}

impl LinearConvolutionConfig {
    /// The settings `spec` asks for, with the route's defaults where it is silent.
    pub fn from_spec(spec: &RouteSpec) -> Self {
        Self {
            pinned: spec.options().pinned.unwrap_or(PINNED_BY_DEFAULT),
        }
    }
}

fn refused(component: &Component, refusal: Refusal) -> CoreError {
    CoreError::Refused {
        route: RouteId::LINEAR_CONVOLUTION.as_str(),
        component: component.name().to_string(),
        refusal,
    }
}

/// Each leaf's params once (a param held twice by one leaf counts once), by leaf id.
fn leaf_params(component: &Component) -> Vec<Vec<Arc<Param>>> {
    component
        .leaves()
        .iter()
        .map(|leaf| {
            let mut seen = HashSet::new();
            leaf.params()
                .iter()
                .filter(|(_, p)| seen.insert(p.id()))
                .map(|(_, p)| Arc::clone(p))
                .collect()
        })
        .collect()
}

impl LinearConvolutionRoute {
    /// [`Route::attach`], returning the concrete attachment (whose hooks are not installed).
    pub fn attach_hooks(
        &self,
        component: &Arc<Component>,
        device: Arc<dyn Device>,
        spec: &RouteSpec,
        metrics: Arc<RouteMetrics>,
    ) -> Result<Arc<LinearConvolutionAttachment>> {
        let config = LinearConvolutionConfig::from_spec(spec);
        let params = component.params();
        // The only allocation of attach: the weights' host bytes replaced by one pinned home
        // (no second copy), bounded by the device's pinned limit — over it, a typed
        // `PinnedLimit` and nothing pinned (`pinned=false` runs from the weights' own bytes).
        let home = if config.pinned {
            PinnedHome::sequential(&*device, &params, u64::MAX, true)?
        } else {
            None
        };
        let leaves = leaf_params(component);
        let streamed = leaves.iter().filter(|p| !p.is_empty()).count() as u64;
        metrics.set_leaf_plan(streamed, 0);
        metrics.set_resident_weight_bytes(0);
        metrics.set_pinned_host_bytes(home.as_ref().map_or(0, PinnedHome::bytes));
        Ok(Arc::new(LinearConvolutionAttachment {
            component: component.name().to_string(),
            device,
            metrics,
            config,
            leaves,
            params,
            state: Mutex::new(EagerLeafStreamer::new(ResidencyTable::new())),
            home: Mutex::new(home),
        }))
    }
}

impl Route for LinearConvolutionRoute {
    fn id(&self) -> RouteId {
        RouteId::LINEAR_CONVOLUTION
    }

    /// Whether the weights get a pinned home.
    fn effective_options(&self, spec: &RouteSpec) -> Vec<ddo_core::EffectiveOption> {
        let o = spec.options();
        vec![ddo_core::EffectiveOption::new(
            "pinned",
            ddo_core::OptionValue::Flag(o.pinned.unwrap_or(PINNED_BY_DEFAULT)),
            o.pinned.is_some(),
        )]
    }

    /// Zero residency: one leaf's weights at a time.
    fn estimate(
        &self,
        _spec: &RouteSpec,
        weight_bytes: u64,
        largest_leaf_bytes: u64,
        _budget_bytes: u64,
    ) -> ddo_core::HeaderEstimate {
        ddo_core::HeaderEstimate {
            resident_bytes: 0,
            streamed_bytes_per_forward: weight_bytes,
            peak_weight_bytes: largest_leaf_bytes,
            note: "zero residency".into(),
        }
    }

    /// `pinned` only.
    fn option_table(&self) -> &'static OptionTable {
        &OPTIONS
    }

    /// Quantized and fp8 weights are refused: the seed contract does not support this route
    /// with quantized modules.
    fn takes_weight_dtype(&self, dtype: DType) -> bool {
        !(dtype.is_quantized() || dtype.is_fp8())
    }

    fn preflight(
        &self,
        component: &Component,
        device: &dyn Device,
        _spec: &RouteSpec,
    ) -> Result<()> {
        if device.allocator() == AllocatorKind::NativeVmm {
            return Err(refused(component, Refusal::NativeAllocatorInstalled));
        }
        if let Some((name, _)) = component
            .named_params()
            .into_iter()
            .find(|(_, p)| !self.takes_weight_dtype(p.dtype()))
        {
            return Err(refused(component, Refusal::Quantized { param: name }));
        }
        Ok(())
    }

    fn attach(
        &self,
        component: &Arc<Component>,
        device: Arc<dyn Device>,
        spec: &RouteSpec,
        metrics: Arc<RouteMetrics>,
    ) -> Result<Arc<dyn AttachedRoute>> {
        let hooks: Arc<dyn AttachedRoute> = self.attach_hooks(component, device, spec, metrics)?;
        Ok(hooks)
    }

    /// Zero residency: every leaf copied before it runs and freed after (one leaf on the
    /// device at a time), from the weights' one host copy, pinned in place unless
    /// `pinned=false` (each param at a multiple of 256 bytes of the home).
    fn footprint(
        &self,
        component: &Component,
        spec: &RouteSpec,
        _context: &FootprintContext,
    ) -> Result<Footprint> {
        let weight_bytes = component.param_bytes();
        let pinned = LinearConvolutionConfig::from_spec(spec).pinned;
        let home_bytes: u64 = component
            .params()
            .iter()
            .map(|p| ddo_core::streaming::layout::align_up(p.nbytes() as u64))
            .sum();
        Ok(Footprint {
            weight_bytes,
            resident_bytes: 0,
            streamed_bytes_per_forward: weight_bytes,
            transient_device_bytes: component.largest_leaf().map_or(0, |l| l.param_bytes()),
            pinned_host_bytes: if pinned { home_bytes } else { 0 },
            needs_native_allocator: false,
            attaches_on_device: false,
            // `pinned=false` is pageable by choice, not staging a pinned limit forced; over
            // the device's pinned limit the route refuses to attach instead.
            pageable_staging: false,
            pinned_limit_to_avoid_pageable: 0,
            staged_bytes_per_forward: if pinned { 0 } else { weight_bytes },
            disk_bytes_per_forward: 0,
            summary: format!(
                "zero residency: each leaf copied before it runs from {} host memory",
                if pinned { "pinned" } else { "pageable" }
            ),
        })
    }
}

/// `linear_convolution` attached to one component: the hooks that onload each leaf before
/// it runs and free it after.
pub struct LinearConvolutionAttachment {
    component: String,
    device: Arc<dyn Device>,
    metrics: Arc<RouteMetrics>,
    config: LinearConvolutionConfig,
    /// Each leaf's params once, by leaf id.
    leaves: Vec<Vec<Arc<Param>>>,
    /// Every param of the component once.
    params: Vec<Arc<Param>>,
    state: Mutex<EagerLeafStreamer>,
    /// The weights' pinned host copy, until detach unpins it in place.
    home: Mutex<Option<PinnedHome>>,
}

impl fmt::Debug for LinearConvolutionAttachment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.state.lock();
        f.debug_struct("LinearConvolutionAttachment")
            .field("component", &self.component)
            .field("device", &self.device.id())
            .field("pinned", &self.config.pinned)
            .field("on_device", st.table())
            .field("detached", &st.is_detached())
            .finish()
    }
}

impl LinearConvolutionAttachment {
    /// The settings in force.
    pub fn config(&self) -> LinearConvolutionConfig {
        self.config
    }

    /// Pinned host bytes held (0 without pinned weights, or after detach).
    pub fn pinned_bytes(&self) -> u64 {
        self.home.lock().as_ref().map_or(0, PinnedHome::bytes)
    }

    /// Device bytes of weights held now (0 between leaves).
    pub fn device_weight_bytes(&self) -> u64 {
        self.state.lock().table().resident_bytes()
    }

    fn params_of(&self, leaf: &Leaf) -> Result<&[Arc<Param>]> {
        self.leaves
            .get(leaf.id().0)
            .map(Vec::as_slice)
            .ok_or_else(|| CoreError::Shape {
                what: format!("linear_convolution on `{}`", self.component),
                message: format!("leaf `{}` is not a leaf of this component", leaf.path()),
            })
    }
}

impl AttachedRoute for LinearConvolutionAttachment {
    fn route(&self) -> RouteId {
        RouteId::LINEAR_CONVOLUTION
    }

    fn describe(&self) -> String {
        format!(
            "linear_convolution pinned={} zero residency, {} leaves streamed per forward",
            self.config.pinned,
            self.leaves.iter().filter(|p| !p.is_empty()).count()
        )
    }

    fn device_id(&self) -> DeviceId {
        self.device.id()
    }

    fn metrics(&self) -> &Arc<RouteMetrics> {
        &self.metrics
    }

    fn before_forward(&self) -> Result<()> {
        let mut st = self.state.lock();
        if st.is_detached() {
            return Err(CoreError::Detached {
                component: self.component.clone(),
            });
        }
        // Leaves left behind by a forward that failed halfway.
        st.offload_all(&*self.device)
    }

    fn before_leaf(&self, leaf: &Leaf) -> Result<()> {
        let params = self.params_of(leaf)?;
        let mut st = self.state.lock();
        if st.is_detached() {
            return Err(CoreError::Detached {
                component: self.component.clone(),
            });
        }
        // Leaves run one at a time, so anything still here was left by a failed leaf.
        st.offload_all(&*self.device)?;
        if params.is_empty() {
            return Ok(());
        }
        st.onload(&*self.device, leaf.id(), params, &self.metrics)
    }

    fn after_leaf(&self, leaf: &Leaf) -> Result<()> {
        let mut st = self.state.lock();
        if !st.is_onloaded(leaf.id()) {
            return Ok(());
        }
        // Zero residency: the leaf's weights leave the device before the next leaf starts.
        st.offload_all(&*self.device)
    }

    fn end_phase(&self) -> Result<()> {
        let mut st = self.state.lock();
        let released = st.offload_all(&*self.device);
        let synced = self.device.synchronize();
        released.and(synced)
    }

    fn detach(&self) -> Result<()> {
        let synced = self.state.lock().detach(&*self.device, &self.params);
        // After a synchronisation no queued copy reads the home: unpin it in place. Without
        // one the home stays pinned under the params until they go.
        let restored = match &synced {
            Ok(()) => self.home.lock().take().map_or(Ok(()), PinnedHome::restore),
            Err(_) => Ok(()),
        };
        let synced = synced.and(restored);
        self.metrics.set_pinned_host_bytes(0);
        self.metrics.set_resident_weight_bytes(0);
        synced
    }
}

impl Drop for LinearConvolutionAttachment {
    fn drop(&mut self) {
        // Errors have nowhere to go from Drop; `detach` has freed everything regardless.
        let _ = self.detach();
    }
}
