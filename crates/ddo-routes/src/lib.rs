//! DDO's route registry and its public entry points.
//!
//! This crate sits above `ddo-core` and the four route crates (`ddo-route-resident`,
//! `ddo-route-leaf-group`, `ddo-route-linear-convolution`, `ddo-route-native-vmm`), and
//! below applications and the `ddo` command. It holds:
//!
//! - the route table ([`ROUTES`]: one descriptor per route DDO links, and any route an
//!   application adds with [`register`]), looked up by [`route`], named through
//!   [`Catalog`] and [`parse_spec`];
//! - [`enable_offload`] (named component, preset defaults, the seed's VAE table),
//!   [`enable_resolved_offload`] (a resolution made once, carried as it is),
//!   [`enable_pipeline_offload`] (every component of a [`Pipeline`] by policy), and the
//!   low-level [`enable_dynamic_offload`] (exactly the config given, no defaults);
//! - [`OffloadHandle`]: `metrics_snapshot()`, the managed error boundary
//!   `cleanup_on_error`, `detach_auxiliary_cpu_sources`, phase boundaries, and
//!   [`remove_dynamic_offload`].
//!
//! Ownership follows the seed. DDO-managed routes (`none`, `linear_convolution`,
//! `native_vmm`) are removed by `remove_dynamic_offload` or by dropping their handle.
//! Diffusers-style group offload hooks are owned by the handle and the component: they end
//! when both are dropped, and `remove_dynamic_offload` refuses them. `cleanup_on_error`
//! and a pipeline's `release` are DDO's managed boundaries and release every route.

mod handle;
mod pipeline;
pub mod plan;

use std::sync::Arc;

use parking_lot::RwLock;

use ddo_core::resolve::{Environment, ProcessEnvironment, resolve};
use ddo_core::{
    Component, CoreError, DType, DecidedBy, Device, Resolution, Result, Route, RouteCatalog,
    RouteId, RouteSpec, RouteTarget, Settings,
};
use ddo_metrics::RouteMetrics;

pub use handle::OffloadHandle;
pub use pipeline::{Pipeline, PipelineOffload};
pub use plan::{
    ComponentPlan, PhaseDemand, PhasePlan, PipelinePlan, PlanRequest, footprint, plan_pipeline,
    plan_resolved, resolve_pipeline,
};

/// One entry of the route table.
#[derive(Clone, Copy)]
pub struct RouteDescriptor {
    /// The route's id.
    pub id: RouteId,
    /// One line on what it does.
    pub summary: &'static str,
    /// The implementation.
    pub route: &'static dyn Route,
}

impl std::fmt::Debug for RouteDescriptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RouteDescriptor({})", self.id)
    }
}

/// Every route DDO implements, once.
pub static ROUTES: &[RouteDescriptor] = &[
    RouteDescriptor {
        id: RouteId::RESIDENT,
        summary: "resident: weights copied to the device once and kept",
        route: &ddo_route_resident::ResidentRoute,
    },
    RouteDescriptor {
        id: RouteId::DIFFUSERS_GROUP_OFFLOAD,
        summary: "Diffusers-style leaf/block group offload, with or without a copy stream",
        route: &ddo_route_leaf_group::GroupOffloadRoute,
    },
    RouteDescriptor {
        id: RouteId::LINEAR_CONVOLUTION,
        summary: "eager CPU offload of each leaf, optional pinned weights, zero residency",
        route: &ddo_route_linear_convolution::LinearConvolutionRoute,
    },
    RouteDescriptor {
        id: RouteId::NATIVE_VMM,
        summary: "weights in the native VMM pool with a budget; the rest streamed",
        route: &ddo_route_native_vmm::NativeVmmRoute,
    },
];

/// Routes added at run time ([`register`]), after [`ROUTES`].
static REGISTERED: RwLock<Vec<RouteDescriptor>> = RwLock::new(Vec::new());

/// Every route the registry knows: [`ROUTES`], then the ones [`register`]ed, in that
/// order.
pub fn descriptors() -> Vec<RouteDescriptor> {
    let registered = REGISTERED.read();
    ROUTES.iter().chain(registered.iter()).copied().collect()
}

/// Adds a route the registry does not link (a route crate of an application's own, or a
/// test's): from then on it is named in specs, `DDO_<COMPONENT>_ROUTE` and `ddo resolve`,
/// its options are checked from its table, and it attaches like the routes in
/// [`ROUTES`]. Refused, leaving the registry as it was, when the descriptor's id is not its
/// route's, its name is not a valid route name or is taken, or its table names an option
/// route specs do not know.
pub fn register(descriptor: RouteDescriptor) -> Result<()> {
    let name = descriptor.id.as_str();
    let refuse = |hint: String| CoreError::InvalidOption {
        option: "route".into(),
        value: name.to_string(),
        hint,
    };
    if descriptor.route.id() != descriptor.id {
        return Err(refuse(format!(
            "the descriptor names {name} but its route is {}: give the route's own id",
            descriptor.route.id()
        )));
    }
    if !RouteId::is_valid_name(name) {
        return Err(refuse(
            "a route name is lowercase letters, digits and `_`".into(),
        ));
    }
    if let Some(o) = descriptor
        .route
        .option_table()
        .options
        .iter()
        .find(|o| !ddo_core::RouteOptions::NAMES.contains(&o.name))
    {
        return Err(refuse(format!(
            "its option table names `{}`, which route specs do not know; options: {}",
            o.name,
            ddo_core::RouteOptions::NAMES.join(", ")
        )));
    }
    let mut registered = REGISTERED.write();
    if ROUTES
        .iter()
        .chain(registered.iter())
        .any(|d| d.id == descriptor.id)
    {
        return Err(refuse(
            "a route of that name is already registered: give yours another name".into(),
        ));
    }
    registered.push(descriptor);
    Ok(())
}

/// The registry's descriptor of `id`, if it knows the route.
pub fn descriptor(id: RouteId) -> Option<RouteDescriptor> {
    descriptors().into_iter().find(|d| d.id == id)
}

/// The implementation of `id`; a route the registry does not know is a typed error, never
/// another route.
pub fn route(id: RouteId) -> Result<&'static dyn Route> {
    descriptor(id)
        .map(|d| d.route)
        .ok_or_else(|| CoreError::UnknownRoute {
            name: id.as_str().to_string(),
            valid: catalog_names(),
        })
}

fn catalog_names() -> String {
    descriptors()
        .iter()
        .map(|d| d.id.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The registry as a [`RouteCatalog`]: every route it knows, by name.
#[derive(Debug, Clone, Copy, Default)]
pub struct Catalog;

impl RouteCatalog for Catalog {
    fn ids(&self) -> Vec<RouteId> {
        descriptors().iter().map(|d| d.id).collect()
    }

    /// From the route's own option table.
    fn options_of(&self, id: RouteId) -> Option<Vec<&'static str>> {
        descriptor(id).map(|d| d.route.option_table().names())
    }
}

/// Parses a route spec (`route` or `route:key=value,...`), the route named from the
/// registry ([`Catalog`]).
pub fn parse_spec(text: impl AsRef<str>) -> Result<RouteSpec> {
    RouteSpec::parse(text.as_ref(), &Catalog)
}

/// The options `spec`'s route runs with, each with its effective value and whether the
/// spec gave it, as the route describes them ([`Route::effective_options`]); none for
/// leaving a component unmanaged.
pub fn effective_options(spec: &RouteSpec) -> Vec<ddo_core::EffectiveOption> {
    spec.route_id()
        .and_then(|id| route(id).ok())
        .map_or_else(Vec::new, |r| r.effective_options(spec))
}

/// [`effective_options`] for `spec` attached to `component` ([`Route::effective_options_for`]:
/// defaults that follow the component's weights, as the attached route runs them).
pub fn effective_options_for(
    spec: &RouteSpec,
    component: &ddo_core::Component,
) -> Vec<ddo_core::EffectiveOption> {
    spec.route_id()
        .and_then(|id| route(id).ok())
        .map_or_else(Vec::new, |r| r.effective_options_for(spec, component))
}

/// The device budget `spec`'s route runs under, given or its default
/// ([`Route::effective_budget`]).
pub fn effective_budget(spec: &RouteSpec) -> Option<ddo_core::Budget> {
    spec.route_id()
        .and_then(|id| route(id).ok())
        .and_then(|r| r.effective_budget(spec))
}

/// Whether `spec`'s route streams weights through its streaming engine
/// ([`Route::streams`]).
pub fn streams(spec: &RouteSpec) -> bool {
    spec.route_id()
        .and_then(|id| route(id).ok())
        .is_some_and(|r| r.streams(spec))
}

/// Whether every weight stays on the device under `spec`: a resident route, or none (the
/// caller places the weights) ([`Route::keeps_weights_resident`]).
pub fn keeps_weights_resident(spec: &RouteSpec) -> bool {
    spec.route_id()
        .is_none_or(|id| route(id).is_ok_and(|r| r.keeps_weights_resident(spec)))
}

/// `ddo inspect`'s estimate of what `spec`'s route holds for a component known by its
/// headers ([`Route::estimate`]); `None` when the component is left unmanaged.
pub fn estimate(
    spec: &RouteSpec,
    weight_bytes: u64,
    largest_leaf_bytes: u64,
    budget_bytes: u64,
) -> Option<ddo_core::HeaderEstimate> {
    spec.route_id()
        .and_then(|id| route(id).ok())
        .map(|r| r.estimate(spec, weight_bytes, largest_leaf_bytes, budget_bytes))
}

/// The routes the registry knows that refuse weights stored as `dtype`
/// ([`Route::takes_weight_dtype`]), in the registry's order.
pub fn routes_refusing_weight_dtype(dtype: DType) -> Vec<RouteId> {
    descriptors()
        .into_iter()
        .filter(|d| !d.route.takes_weight_dtype(dtype))
        .map(|d| d.id)
        .collect()
}

/// Whether `spec`'s route needs the native VMM allocator on its device
/// ([`Route::needs_native_allocator`]).
pub fn needs_native_allocator(spec: &RouteSpec) -> bool {
    spec.route_id()
        .and_then(|id| route(id).ok())
        .is_some_and(|r| r.needs_native_allocator(spec))
}

/// Options of [`enable_offload`].
#[derive(Debug, Clone, Default)]
pub struct OffloadOptions {
    /// The component's name for routing (`vae`, `transformer`, ...); defaults to the
    /// component's own name. The VAE defaults apply to the name `vae` only.
    pub component_name: Option<String>,
    /// An explicit route: always wins, never replaced.
    pub route: Option<RouteSpec>,
    /// Preset, component policies and whether the environment may override defaults.
    pub settings: Settings,
}

/// Attaches the route the resolver picks for `component` (explicit route, component
/// policy, environment, or the preset's default for its name) and returns its handle.
/// Reads the process environment only when `settings.use_environment` is true.
pub fn enable_offload(
    component: &Arc<Component>,
    device: Arc<dyn Device>,
    options: &OffloadOptions,
) -> Result<OffloadHandle> {
    enable_offload_with_env(component, device, options, &ProcessEnvironment)
}

/// [`enable_offload`] with the environment given explicitly.
pub fn enable_offload_with_env(
    component: &Arc<Component>,
    device: Arc<dyn Device>,
    options: &OffloadOptions,
    env: &dyn Environment,
) -> Result<OffloadHandle> {
    let name = options
        .component_name
        .as_deref()
        .unwrap_or_else(|| component.name());
    let resolution = resolve(
        &options.settings,
        name,
        options.route.as_ref(),
        env,
        &Catalog,
    )?;
    enable_resolved_offload(component, device, &resolution)
}

/// Attaches `resolution` (the resolver's answer for `component`, made once by the caller)
/// as it is: its spec, its [`DecidedBy`] and its preset go to the handle unchanged, and
/// nothing is resolved again.
pub fn enable_resolved_offload(
    component: &Arc<Component>,
    device: Arc<dyn Device>,
    resolution: &Resolution,
) -> Result<OffloadHandle> {
    attach(
        component,
        device,
        resolution.spec,
        resolution.decided_by.clone(),
        Some(resolution.preset),
    )
}

/// Attaches exactly `spec` to `component`: no preset, no component defaults (the VAE
/// table does not apply here), no environment.
pub fn enable_dynamic_offload(
    component: &Arc<Component>,
    device: Arc<dyn Device>,
    spec: RouteSpec,
) -> Result<OffloadHandle> {
    attach(component, device, spec, DecidedBy::LowLevelConfig, None)
}

/// Removes what `handle` attached, and nothing else: releases its device and pinned
/// memory and leaves the component's weights host-only. Refused for Diffusers-style group
/// offload, whose hooks end when the handle and every reference to the component are
/// dropped. Removing an unmanaged or already removed handle does nothing.
pub fn remove_dynamic_offload(handle: &mut OffloadHandle) -> Result<()> {
    handle.remove()
}

/// Returns the native VMM pool's idle physical chunks on `device` to the driver: every
/// chunk that holds no live allocation is unmapped and released, and the report says how
/// many bytes came back and whether the driver's free-memory figure confirms it
/// (`proven`). Call it after a phase's cleanup (e.g. after [`PipelineOffload::phase_boundary`]
/// and releasing the finished component): it is refused with
/// [`CoreError::NotQuiescent`] while work is queued on any stream of the device, and with
/// [`CoreError::NativeAllocatorNotInstalled`] on a device whose allocator is the caching one
/// (whose idle cache `empty_cache()` returns). Routing never calls it by itself.
pub fn release_native_vmm_idle_cache(device: &dyn Device) -> Result<ddo_metrics::IdleCacheRelease> {
    device.release_native_idle_cache()
}

/// Applies `settings` to every component of `pipeline`. All or nothing: when one
/// component is refused, the ones already attached are released before the error returns.
pub fn enable_pipeline_offload(
    pipeline: &Pipeline,
    device: Arc<dyn Device>,
    settings: &Settings,
) -> Result<PipelineOffload> {
    enable_pipeline_offload_with_env(pipeline, device, settings, &ProcessEnvironment)
}

/// [`enable_pipeline_offload`] with the environment given explicitly.
pub fn enable_pipeline_offload_with_env(
    pipeline: &Pipeline,
    device: Arc<dyn Device>,
    settings: &Settings,
    env: &dyn Environment,
) -> Result<PipelineOffload> {
    let mut handles = Vec::new();
    for component in pipeline.components() {
        let options = OffloadOptions {
            component_name: None,
            route: None,
            settings: settings.clone(),
        };
        match enable_offload_with_env(component, Arc::clone(&device), &options, env) {
            Ok(h) => handles.push(h),
            Err(e) => {
                for mut h in handles {
                    h.release();
                }
                return Err(e);
            }
        }
    }
    Ok(PipelineOffload::new(device, handles))
}

/// What `spec`'s route refuses for a component named `component` from the spec alone,
/// without weights or a device: first what its [`OptionTable`](ddo_core::OptionTable)
/// refuses ([`OptionTable::check`](ddo_core::OptionTable::check)), then its own
/// [`Route::check_options`]. `ddo
/// resolve` refuses this without a model; [`preflight`] runs it before every attach.
/// Unmanaged specs pass.
pub fn check_route_options(component: &str, spec: &RouteSpec) -> Result<()> {
    match spec.target() {
        RouteTarget::Route(id) => ddo_core::route::check_spec(route(id)?, component, spec),
        RouteTarget::Unmanaged => Ok(()),
    }
}

/// What `spec`'s route refuses for `component` on a device with `free` bytes free, whatever
/// the weights: a budget of the free bytes less a margin that leaves nothing
/// ([`ddo_core::route::check_budget_left`], which the planner and [`preflight`] run too).
/// Unmanaged specs pass.
pub fn check_route_budget(component: &str, spec: &RouteSpec, free: u64) -> Result<()> {
    match spec.target() {
        RouteTarget::Route(id) => {
            ddo_core::route::check_budget_left(route(id)?, component, spec, free)
        }
        RouteTarget::Unmanaged => Ok(()),
    }
}

/// Every check before `spec`'s route attaches to `component` on `device`, run once here
/// for every route ([`ddo_core::route::checked_preflight`]): nothing attached yet, no
/// weight already on a device, the options ([`check_route_options`]), then the route's own
/// [`Route::preflight`] (what depends on the device and the weights). Touches nothing.
/// Unmanaged specs pass.
pub fn preflight(component: &Component, device: &dyn Device, spec: &RouteSpec) -> Result<()> {
    match spec.target() {
        RouteTarget::Route(id) => {
            ddo_core::route::checked_preflight(route(id)?, component, device, spec)
        }
        RouteTarget::Unmanaged => Ok(()),
    }
}

/// Prepares `pipeline` to run under `plan` ([`plan_pipeline`]): every component's route is
/// preflighted now (touching nothing), and each attaches when its phase begins
/// ([`PipelineOffload::begin_phase`]) and is released at the boundary, so phases never hold
/// each other's memory. A component the plan does not name is refused (plan every phase).
pub fn enable_planned_pipeline_offload(
    pipeline: &Pipeline,
    device: Arc<dyn Device>,
    plan: &PipelinePlan,
) -> Result<PipelineOffload> {
    let mut pending = Vec::new();
    for component in pipeline.components() {
        let Some(p) = plan.component(component.name()) else {
            return Err(CoreError::InvalidOption {
                option: "plan".into(),
                value: component.name().to_string(),
                hint: "the memory plan has no phase that runs this component; list it in a PhaseDemand"
                    .into(),
            });
        };
        preflight(component, &*device, &p.resolution.spec)?;
        pending.push((
            Arc::clone(component),
            p.resolution.clone(),
            !p.footprint.attaches_on_device,
            p.upload_during.is_some(),
            p.prepare_during.is_some(),
        ));
    }
    Ok(PipelineOffload::deferred(
        device,
        pending,
        plan.gives_host_back(),
    ))
}

pub(crate) fn attach(
    component: &Arc<Component>,
    device: Arc<dyn Device>,
    spec: RouteSpec,
    decided_by: DecidedBy,
    preset: Option<ddo_core::Preset>,
) -> Result<OffloadHandle> {
    let metrics = Arc::new(RouteMetrics::new());
    let id = match spec.target() {
        RouteTarget::Unmanaged => {
            return Ok(OffloadHandle::new(
                Arc::clone(component),
                device,
                None,
                spec,
                decided_by,
                preset,
                metrics,
            ));
        }
        RouteTarget::Route(id) => id,
    };
    preflight(component, &*device, &spec)?;
    let implementation = route(id)?;
    let hooks =
        implementation.attach(component, Arc::clone(&device), &spec, Arc::clone(&metrics))?;
    if let Err(e) = component.install_hooks(Arc::clone(&hooks)) {
        let _ = hooks.detach();
        return Err(e);
    }
    Ok(OffloadHandle::new(
        Arc::clone(component),
        device,
        Some(hooks),
        spec,
        decided_by,
        preset,
        metrics,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn every_route_id_appears_once_in_the_table() {
        let ids: Vec<RouteId> = ROUTES.iter().map(|d| d.id).collect();
        let unique: HashSet<RouteId> = ids.iter().copied().collect();
        assert_eq!(ids.len(), unique.len());
        // Every route presets name is in the table.
        for id in RouteId::BUILT_IN {
            assert!(unique.contains(&id), "{id} has no row");
        }
        for d in ROUTES {
            assert_eq!(
                d.route.id(),
                d.id,
                "descriptor {} points at another route",
                d.id
            );
            assert!(RouteId::is_valid_name(d.id.as_str()), "{}", d.id);
            assert_eq!(route(d.id).unwrap().id(), d.id);
            assert_eq!(Catalog.find(d.id.as_str()).unwrap(), d.id);
        }
        // A route the registry does not know is an error, never another route.
        let e = route(RouteId::new("not_a_route")).err().unwrap();
        assert!(matches!(e, CoreError::UnknownRoute { .. }), "{e}");
        assert!(e.to_string().contains("native_vmm"), "{e}");
    }
}
