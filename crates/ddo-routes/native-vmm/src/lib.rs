//! The `native_vmm` route: the `vmm_fast` preset's transformer route. Under a VRAM budget
//! it keeps resident the leaves whose weights would cost most to stream, and streams the
//! rest one leaf at a time (onloaded before the leaf, freed after it, from pinned copies
//! when `pinned=true`), so the bytes copied per forward are as few as the budget allows.
//!
//! This crate is one of the route crates above `ddo-core`: it talks to the [`Device`]
//! trait only, moves params through [`ResidencyTable`] and [`PinnedCopies`], and is
//! registered in the static route table of `ddo-routes`, which calls
//! [`Route::preflight`], then [`Route::attach`], then installs the returned hooks. The
//! route requires the native VMM allocator ([`AllocatorKind::NativeVmm`]) on the device,
//! installed as the first step of a fresh process; it never installs it. Allocations go
//! through [`Device::alloc`], which that allocator serves; the VMM pool of `ddo-vmm`
//! (reserve, map, unmap, release idle) will sit behind the same calls.
//!
//! The residency planner is the pure function [`plan_residency`]; the budget is
//! [`budget_bytes`]: an explicit `budget` option, or what the device has free minus
//! [`DEFAULT_FREE_MARGIN`]. A component named `vae` needs an explicit budget: native VMM
//! for a VAE is an explicit source/capacity opt-in, never decided by class.

mod plan;

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use ddo_core::residency::{EagerLeafStreamer, FreeMode, PinnedCopies, ResidencyTable};
use ddo_core::{
    AllocatorKind, AttachedRoute, Budget, Component, CoreError, Device, DeviceId, HostSlice, Leaf,
    Param, Refusal, Result, Route, RouteId, RouteSpec,
};
use ddo_metrics::RouteMetrics;
use parking_lot::Mutex;

pub use plan::{ResidencyPlan, plan_residency};

/// Margin left free when no budget is given: the budget is what the device has free when
/// the route attaches, minus this. It leaves room for activations, workspaces (cuBLAS,
/// attention) and the caching of other components on a GPU of the sizes DDO targets.
pub const DEFAULT_FREE_MARGIN: u64 = 1 << 30;

/// The budget used when the spec gives none.
pub const DEFAULT_BUDGET: Budget = Budget::FreeMinus(DEFAULT_FREE_MARGIN);

/// The hint given for an option `native_vmm` does not take.
pub const OPTION_HINT: &str = "native_vmm takes only budget and pinned; use diffusers_group_offload for \
     grouped or streamed offload options";

/// Whether streamed weights are pinned when the spec does not say.
pub const PINNED_BY_DEFAULT: bool = false;

/// The `native_vmm` route (registered as [`RouteId::NativeVmm`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct NativeVmmRoute;

/// The route's settings, resolved from a [`RouteSpec`] that passed preflight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NativeVmmConfig {
    /// The budget as given, or [`DEFAULT_BUDGET`].
    pub budget: Budget,
    /// Whether the budget was given explicitly.
    pub explicit_budget: bool,
    /// Keep pinned host copies of the streamed leaves' weights (default false).
    pub pinned: bool,
}

impl NativeVmmConfig {
    /// The settings `spec` asks for, with the route's defaults where it is silent.
    pub fn from_spec(spec: &RouteSpec) -> Self {
        let o = spec.options();
        Self {
            budget: o.budget.unwrap_or(DEFAULT_BUDGET),
            explicit_budget: o.budget.is_some(),
            pinned: o.pinned.unwrap_or(PINNED_BY_DEFAULT),
        }
    }
}

/// What the device has free now: the driver's figure where there is a driver, else
/// capacity minus the allocator's exact accounting.
pub fn free_bytes(device: &dyn Device) -> u64 {
    let info = device.memory_info();
    info.driver_free
        .unwrap_or_else(|| info.capacity.saturating_sub(info.allocated))
}

/// The budget in bytes `spec` gives on `device` now.
pub fn budget_bytes(device: &dyn Device, spec: &RouteSpec) -> u64 {
    NativeVmmConfig::from_spec(spec)
        .budget
        .bytes_given_free(free_bytes(device))
}

/// The leaves the planner sees: those with params, as `(path, weight bytes)`.
fn weighted_leaves(component: &Component) -> Vec<(String, u64)> {
    component
        .leaves()
        .iter()
        .filter(|l| !l.params().is_empty())
        .map(|l| (l.path().to_string(), l.param_bytes()))
        .collect()
}

/// The plan [`NativeVmmRoute`] would make for `component` on `device` with `spec` now.
/// Touches nothing.
pub fn plan_for(component: &Component, device: &dyn Device, spec: &RouteSpec) -> ResidencyPlan {
    plan_residency(&weighted_leaves(component), budget_bytes(device, spec))
}

fn refused(component: &Component, refusal: Refusal) -> CoreError {
    CoreError::Refused {
        route: RouteId::NativeVmm.as_str(),
        component: component.name().to_string(),
        refusal,
    }
}

/// A leaf's params once, and whether the plan keeps it resident.
struct LeafPlan {
    params: Vec<Arc<Param>>,
    resident: bool,
}

impl NativeVmmRoute {
    /// [`Route::attach`], returning the concrete attachment (whose hooks are not installed).
    pub fn attach_hooks(
        &self,
        component: &Arc<Component>,
        device: Arc<dyn Device>,
        spec: &RouteSpec,
        metrics: Arc<RouteMetrics>,
    ) -> Result<Arc<NativeVmmAttachment>> {
        self.preflight(component, &*device, spec)?;
        let config = NativeVmmConfig::from_spec(spec);
        let plan = plan_for(component, &*device, spec);
        let resident: HashSet<&str> = plan.resident.iter().map(String::as_str).collect();
        let leaves: Vec<LeafPlan> = component
            .leaves()
            .iter()
            .map(|leaf| {
                let mut seen = HashSet::new();
                LeafPlan {
                    params: leaf
                        .params()
                        .iter()
                        .filter(|(_, p)| seen.insert(p.id()))
                        .map(|(_, p)| Arc::clone(p))
                        .collect(),
                    resident: resident.contains(leaf.path()),
                }
            })
            .collect();

        // Pinned copies of what is streamed (a tied weight also held by a resident leaf
        // never moves again, so it is not pinned).
        let resident_ids: HashSet<_> = leaves
            .iter()
            .filter(|l| l.resident)
            .flat_map(|l| l.params.iter().map(|p| p.id()))
            .collect();
        let pinned = if config.pinned {
            let mut seen = HashSet::new();
            let streamed: Vec<Arc<Param>> = leaves
                .iter()
                .filter(|l| !l.resident)
                .flat_map(|l| l.params.iter())
                .filter(|p| !resident_ids.contains(&p.id()) && seen.insert(p.id()))
                .cloned()
                .collect();
            Some(PinnedCopies::pin(&*device, &streamed)?)
        } else {
            None
        };

        // Resident leaves go to the device now, on the compute stream.
        let mut table = ResidencyTable::new();
        let stream = device.compute_stream();
        let host = |p: &Param| -> Result<HostSlice> { Ok(p.host()) };
        let onloaded = leaves
            .iter()
            .filter(|l| l.resident && !l.params.is_empty())
            .try_for_each(|l| table.acquire(&*device, &l.params, &host, &stream, &metrics))
            .and_then(|()| device.synchronize_stream(&stream));
        if let Err(e) = onloaded {
            let mode = match device.synchronize_stream(&stream) {
                Ok(()) => FreeMode::Immediate,
                Err(_) => FreeMode::AfterComputeStream,
            };
            table.release_all(&*device, mode, &stream);
            return Err(e);
        }

        metrics.set_leaf_plan(plan.streamed.len() as u64, plan.resident.len() as u64);
        metrics.set_resident_weight_bytes(table.resident_bytes());
        metrics.set_pinned_host_bytes(pinned.as_ref().map_or(0, PinnedCopies::bytes));
        Ok(Arc::new(NativeVmmAttachment {
            component: component.name().to_string(),
            device,
            metrics,
            config,
            plan,
            leaves,
            params: component.params(),
            state: Mutex::new(EagerLeafStreamer::new(table, pinned)),
        }))
    }
}

impl Route for NativeVmmRoute {
    fn id(&self) -> RouteId {
        RouteId::NativeVmm
    }

    fn preflight(
        &self,
        component: &Component,
        device: &dyn Device,
        spec: &RouteSpec,
    ) -> Result<()> {
        if let Some(other) = spec.route_id().filter(|r| *r != RouteId::NativeVmm) {
            return Err(CoreError::InvalidOption {
                option: "route".into(),
                value: other.as_str().into(),
                hint: "this spec names another route; pass it to that route".into(),
            });
        }
        if device.allocator() != AllocatorKind::NativeVmm {
            return Err(refused(component, Refusal::NativeAllocatorRequired));
        }
        if let Some(option) = spec
            .options()
            .given()
            .into_iter()
            .find(|o| !matches!(*o, "budget" | "pinned"))
        {
            return Err(refused(
                component,
                Refusal::UnsupportedOption {
                    option,
                    hint: OPTION_HINT,
                },
            ));
        }
        let config = NativeVmmConfig::from_spec(spec);
        // By name only: the explicit opt-in is for the component named `vae`.
        if component.name() == "vae" && !config.explicit_budget {
            return Err(refused(component, Refusal::VaeNeedsExplicitCapacity));
        }
        if let Some(leaf) = component.largest_leaf() {
            let budget = budget_bytes(device, spec);
            let leaf_bytes = leaf.param_bytes();
            if budget < leaf_bytes {
                return Err(refused(
                    component,
                    Refusal::BudgetBelowLargestLeaf {
                        budget,
                        leaf: leaf.path().to_string(),
                        leaf_bytes,
                    },
                ));
            }
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
}

/// `native_vmm` attached to one component: resident leaves stay on the device, streamed
/// leaves are onloaded before they run and freed after.
pub struct NativeVmmAttachment {
    component: String,
    device: Arc<dyn Device>,
    metrics: Arc<RouteMetrics>,
    config: NativeVmmConfig,
    plan: ResidencyPlan,
    /// By leaf id.
    leaves: Vec<LeafPlan>,
    /// Every param of the component once.
    params: Vec<Arc<Param>>,
    state: Mutex<EagerLeafStreamer>,
}

impl fmt::Debug for NativeVmmAttachment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.state.lock();
        f.debug_struct("NativeVmmAttachment")
            .field("component", &self.component)
            .field("device", &self.device.id())
            .field("config", &self.config)
            .field("resident_leaves", &self.plan.resident.len())
            .field("streamed_leaves", &self.plan.streamed.len())
            .field("on_device", st.table())
            .field("detached", &st.is_detached())
            .finish()
    }
}

impl NativeVmmAttachment {
    /// The plan made at attach.
    pub fn plan(&self) -> &ResidencyPlan {
        &self.plan
    }

    /// The settings in force.
    pub fn config(&self) -> NativeVmmConfig {
        self.config
    }

    /// Device bytes of weights held now (the resident set between leaves).
    pub fn device_weight_bytes(&self) -> u64 {
        self.state.lock().table().resident_bytes()
    }

    /// Pinned host bytes held (0 without pinned weights, or after detach).
    pub fn pinned_bytes(&self) -> u64 {
        self.state.lock().pinned_bytes()
    }

    fn leaf_plan(&self, leaf: &Leaf) -> Result<&LeafPlan> {
        self.leaves
            .get(leaf.id().0)
            .ok_or_else(|| CoreError::Shape {
                what: format!("native_vmm on `{}`", self.component),
                message: format!("leaf `{}` is not a leaf of this component", leaf.path()),
            })
    }

    fn detached_error(&self) -> CoreError {
        CoreError::Detached {
            component: self.component.clone(),
        }
    }
}

impl AttachedRoute for NativeVmmAttachment {
    fn route(&self) -> RouteId {
        RouteId::NativeVmm
    }

    fn describe(&self) -> String {
        format!(
            "native_vmm budget={} ({} B) pinned={}: {} leaves resident ({} B), {} streamed ({} B per forward, slot {} B)",
            self.config.budget,
            self.plan.budget_bytes,
            self.config.pinned,
            self.plan.resident.len(),
            self.plan.resident_bytes,
            self.plan.streamed.len(),
            self.plan.streamed_bytes,
            self.plan.slot_bytes,
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
            return Err(self.detached_error());
        }
        // Streamed leaves left behind by a forward that failed halfway.
        st.offload_all(&*self.device)
    }

    fn before_leaf(&self, leaf: &Leaf) -> Result<()> {
        let lp = self.leaf_plan(leaf)?;
        let mut st = self.state.lock();
        if st.is_detached() {
            return Err(self.detached_error());
        }
        // Leaves run one at a time: a streamed leaf still here was left by a failed one.
        st.offload_all(&*self.device)?;
        if lp.resident || lp.params.is_empty() {
            return Ok(());
        }
        st.onload(&*self.device, leaf.id(), &lp.params, &self.metrics)
    }

    fn after_leaf(&self, leaf: &Leaf) -> Result<()> {
        let mut st = self.state.lock();
        if !st.is_onloaded(leaf.id()) {
            return Ok(());
        }
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
        self.metrics.set_pinned_host_bytes(0);
        self.metrics.set_resident_weight_bytes(0);
        synced
    }
}

impl Drop for NativeVmmAttachment {
    fn drop(&mut self) {
        // Errors have nowhere to go from Drop; `detach` has freed everything regardless.
        let _ = self.detach();
    }
}
