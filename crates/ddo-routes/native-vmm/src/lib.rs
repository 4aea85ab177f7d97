//! The `native_vmm` route: the `vmm_fast` preset's transformer route. Under a VRAM budget
//! it keeps resident the leaves whose weights would cost most to stream, and streams the
//! rest through ddo-core's [`StreamingEngine`]: packed in schedule order into transfer
//! units, staged in pinned memory (by default a pinned home that becomes the weights' one
//! host copy; with `pinned_source=register` the checkpoint mapping page-locked in place;
//! with `pinned=false` a bounded pinned staging ring), and copied on a copy stream into a
//! ring of device bytes ahead of compute. Leaf by leaf (when the ring does not fit beside
//! the resident set) the streamed weights are page-locked in a pinned home whatever
//! `pinned_source` says: registering applies to the engine.
//!
//! This crate is one of the route crates above `ddo-core`: it talks to the [`Device`]
//! trait only, moves params through [`ResidencyTable`] and the engine, and is registered
//! in the static route table of `ddo-routes`, which calls [`Route::preflight`], then
//! [`Route::attach`], then installs the returned hooks. The route requires the native VMM
//! allocator ([`AllocatorKind::NativeVmm`]) on the device, installed as the first step of a
//! fresh process; it never installs it. Its allocations (resident weights, the ring) go
//! through [`Device::alloc`], which that allocator serves from the VMM pool.
//!
//! Forwards: the first one learns the order the streamed leaves run in (each onloaded on
//! the compute stream just before it runs and freed after: the peak is the resident set
//! plus one leaf); from the second on, the engine streams them. A forward that leaves the
//! learned order hands the ring back and finishes leaf by leaf; the order is then learned
//! again (counted in the metrics).
//!
//! The residency planner is [`plan_residency_with`] with the engine's [`SlotModel`]
//! (`ring_slots` slots of the largest streamed leaf or transfer unit), so resident weights
//! plus the ring never exceed the budget: an explicit `budget` option, or what the device
//! has free minus [`DEFAULT_FREE_MARGIN`]. A component named `vae` needs an explicit
//! budget: native VMM for a VAE is an explicit source/capacity opt-in, never decided by
//! class.

mod plan;

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use ddo_core::residency::{EagerLeafStreamer, FreeMode, ResidencyTable};
use ddo_core::streaming::layout::align_up;
use ddo_core::streaming::{
    PinnedHome, Schedule, ScheduleOutcome, StagingMode, StreamingConfig, StreamingEngine,
    StreamingFigures,
};
use ddo_core::{
    AllocatorKind, AttachedRoute, Budget, Component, CoreError, Device, DeviceId, Footprint,
    FootprintContext, HostSlice, Leaf, OptionDecl, OptionKind, OptionTable, Param, ParamId,
    Refusal, Result, Route, RouteId, RouteSpec, Stream,
};
use ddo_metrics::RouteMetrics;
use parking_lot::Mutex;

pub use plan::{ResidencyPlan, SlotModel, plan_residency, plan_residency_with};

/// Margin left free when no budget is given: the budget is what the device has free when
/// the route attaches, minus this. It leaves room for activations, workspaces (cuBLAS,
/// attention) and the caching of other components on a GPU of the sizes DDO targets.
pub const DEFAULT_FREE_MARGIN: u64 = 1 << 30;

/// The budget used when the spec gives none.
pub const DEFAULT_BUDGET: Budget = Budget::FreeMinus(DEFAULT_FREE_MARGIN);

/// The hint given for an option `native_vmm` does not take.
pub const OPTION_HINT: &str = "native_vmm takes budget, pinned and the streaming engine's pinned_limit, \
     unit_bytes, ring_slots, pinned_source, timeline, copy_ahead and page_cache_limit; use diffusers_group_offload for grouped offload options";

/// The options of `native_vmm`: the budget, pinned staging and the streaming engine's
/// options (everything else, [`OPTION_HINT`]).
pub static OPTIONS: OptionTable = OptionTable {
    options: &[
        OptionDecl::new(
            "budget",
            OptionKind::Budget,
            "free-1GiB",
            "weights kept in the native pool; the rest streamed (a VAE needs it given)",
        ),
        OptionDecl::new(
            "pinned",
            OptionKind::Flag,
            "true",
            "stage streamed weights in a pinned home that replaces their host bytes",
        ),
        ddo_core::streaming::PINNED_LIMIT_OPTION,
        ddo_core::streaming::UNIT_BYTES_OPTION,
        ddo_core::streaming::RING_SLOTS_OPTION,
        ddo_core::streaming::PINNED_SOURCE_OPTION,
        ddo_core::streaming::TIMELINE_OPTION,
        ddo_core::streaming::COPY_AHEAD_OPTION,
        ddo_core::streaming::PAGE_CACHE_LIMIT_OPTION,
    ],
    refused: &[],
    others_hint: OPTION_HINT,
};

/// Whether streamed weights are page-locked when the spec does not say: yes, in a pinned
/// home that replaces their host bytes (one host copy), when it fits under `pinned_limit`.
pub const PINNED_BY_DEFAULT: bool = true;

/// The `native_vmm` route (registered as [`RouteId::NATIVE_VMM`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct NativeVmmRoute;

/// The route's settings, resolved from a [`RouteSpec`] that passed preflight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NativeVmmConfig {
    /// The budget as given, or [`DEFAULT_BUDGET`].
    pub budget: Budget,
    /// Whether the budget was given explicitly.
    pub explicit_budget: bool,
    /// Stage streamed weights in a pinned home that replaces their host bytes (one host
    /// copy, pinned speed; the default); false: a bounded pinned staging ring filled from
    /// the weights' own bytes (engine), or pageable copies (leaf by leaf).
    pub pinned: bool,
    /// The streaming engine's settings (`budget` is set at attach).
    pub streaming: StreamingConfig,
}

impl NativeVmmConfig {
    /// The settings `spec` asks for, with the route's defaults where it is silent.
    pub fn from_spec(spec: &RouteSpec) -> Self {
        let o = spec.options();
        let pinned = o.pinned.unwrap_or(PINNED_BY_DEFAULT);
        let mut streaming = StreamingConfig::from_options(o);
        streaming.staging = if pinned {
            StagingMode::Auto
        } else {
            StagingMode::Ring
        };
        Self {
            budget: o.budget.unwrap_or(DEFAULT_BUDGET),
            explicit_budget: o.budget.is_some(),
            pinned,
            streaming,
        }
    }

    /// How the planner counts the ring: the engine's slots, each the largest streamed leaf
    /// or transfer unit.
    pub fn slot_model(&self) -> SlotModel {
        self.streaming.slot_model()
    }
}

/// What the device has free now: the driver's figure where there is a driver, else
/// capacity minus the allocator's exact accounting.
pub fn free_bytes(device: &dyn Device) -> u64 {
    device.memory_info().free_bytes()
}

/// The budget in bytes `spec` gives on `device` now.
pub fn budget_bytes(device: &dyn Device, spec: &RouteSpec) -> u64 {
    NativeVmmConfig::from_spec(spec)
        .budget
        .bytes_given_free(free_bytes(device))
}

/// The leaves the planner sees: those with params, as `(path, weight bytes)`; with
/// `aligned`, each param counted at the streaming engine's alignment.
fn weighted_leaves(component: &Component, aligned: bool) -> Vec<(String, u64)> {
    component
        .leaves()
        .iter()
        .filter(|l| !l.params().is_empty())
        .map(|l| {
            let mut seen = HashSet::new();
            let bytes = l
                .params()
                .iter()
                .filter(|(_, p)| seen.insert(p.id()))
                .map(|(_, p)| {
                    let n = p.nbytes() as u64;
                    if aligned { align_up(n) } else { n }
                })
                .sum();
            (l.path().to_string(), bytes)
        })
        .collect()
}

/// How the streamed leaves of a plan move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamMode {
    /// Nothing streams.
    Nothing,
    /// Through the streaming engine's ring (resident + ring within the budget).
    Engine,
    /// One leaf at a time on the compute stream (the budget leaves no room for the ring,
    /// or the device has no copy stream).
    LeafByLeaf,
}

/// The plan [`NativeVmmRoute`] would make for `component` on `device` with `spec` now, and
/// how its streamed leaves would move. Touches nothing.
///
/// In order: everything resident when the budget holds it; else resident leaves plus the
/// streaming engine's ring within the budget ([`NativeVmmConfig::slot_model`]); else, when
/// the ring does not fit beside any useful resident set, one streamed leaf at a time
/// ([`SlotModel::ONE_LEAF`]).
pub fn plan_with_mode(
    component: &Component,
    device: &dyn Device,
    spec: &RouteSpec,
) -> (ResidencyPlan, StreamMode) {
    plan_in(component, spec, &FootprintContext::of(device))
}

/// [`plan_with_mode`] against the memory `context` describes.
fn plan_in(
    component: &Component,
    spec: &RouteSpec,
    context: &FootprintContext,
) -> (ResidencyPlan, StreamMode) {
    let budget = NativeVmmConfig::from_spec(spec)
        .budget
        .bytes_given_free(context.free_device_bytes);
    let one_leaf = plan_residency(&weighted_leaves(component, false), budget);
    if one_leaf.streamed.is_empty() {
        return (one_leaf, StreamMode::Nothing);
    }
    if context.supports_streams {
        let ring = plan_residency_with(
            &weighted_leaves(component, true),
            budget,
            NativeVmmConfig::from_spec(spec).slot_model(),
        );
        if ring.fits() {
            return (ring, StreamMode::Engine);
        }
    }
    (one_leaf, StreamMode::LeafByLeaf)
}

/// The plan [`NativeVmmRoute`] would make for `component` on `device` with `spec` now
/// ([`plan_with_mode`] without the mode). Touches nothing.
pub fn plan_for(component: &Component, device: &dyn Device, spec: &RouteSpec) -> ResidencyPlan {
    plan_with_mode(component, device, spec).0
}

fn refused(component: &Component, refusal: Refusal) -> CoreError {
    CoreError::Refused {
        route: RouteId::NATIVE_VMM.as_str(),
        component: component.name().to_string(),
        refusal,
    }
}

/// A leaf's params once, whether the plan keeps it resident, and its segment in the
/// streaming engine when it streams.
struct LeafPlan {
    params: Vec<Arc<Param>>,
    resident: bool,
    segment: Option<usize>,
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
        let config = NativeVmmConfig::from_spec(spec);
        let (plan, mode) = plan_with_mode(component, &*device, spec);
        let resident: HashSet<&str> = plan.resident.iter().map(String::as_str).collect();
        let mut leaves: Vec<LeafPlan> = component
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
                    segment: None,
                }
            })
            .collect();

        // The engine's segments: each streamed leaf's params, less those a resident leaf
        // already holds (a tied weight never moves again).
        let resident_ids: HashSet<ParamId> = leaves
            .iter()
            .filter(|l| l.resident)
            .flat_map(|l| l.params.iter().map(|p| p.id()))
            .collect();
        let mut segments: Vec<Vec<Arc<Param>>> = Vec::new();
        let mut segment_paths: Vec<String> = Vec::new();
        for (l, leaf) in leaves
            .iter_mut()
            .zip(component.leaves())
            .filter(|(l, _)| !l.resident && !l.params.is_empty())
        {
            segment_paths.push(leaf.path().to_string());
            l.segment = Some(segments.len());
            segments.push(
                l.params
                    .iter()
                    .filter(|p| !resident_ids.contains(&p.id()))
                    .cloned()
                    .collect(),
            );
        }
        let copy = if mode == StreamMode::Engine {
            Some(device.create_stream()?)
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

        // Leaf by leaf with `pinned`: the streamed weights' one host copy is page-locked in
        // a pinned home (the engine stages its own). When it does not fit under the pinned
        // limit the weights stay where they are, unless `pinned=true` was asked for.
        let home = if mode == StreamMode::LeafByLeaf && config.pinned {
            let streamed: Vec<Arc<Param>> = segments.iter().flatten().cloned().collect();
            let built = PinnedHome::sequential(
                &*device,
                &streamed,
                config.streaming.pinned_limit,
                spec.options().pinned == Some(true),
            );
            match built {
                Ok(h) => h,
                Err(e) => {
                    table.release_all(&*device, FreeMode::Immediate, &stream);
                    return Err(e);
                }
            }
        } else {
            None
        };

        metrics.set_leaf_plan(plan.streamed.len() as u64, plan.resident.len() as u64);
        metrics.set_resident_leaves(plan.resident.clone());
        metrics.set_resident_weight_bytes(table.resident_bytes());
        metrics.set_pinned_host_bytes(home.as_ref().map_or(0, PinnedHome::bytes));
        Ok(Arc::new(NativeVmmAttachment {
            component: component.name().to_string(),
            device,
            metrics,
            config,
            plan,
            leaves,
            segments,
            segment_paths,
            params: component.params(),
            compute: stream,
            copy,
            state: Mutex::new(State {
                eager: EagerLeafStreamer::new(table),
                home,
                schedule: Schedule::new(),
                engine: None,
                position: None,
            }),
        }))
    }
}

impl Route for NativeVmmRoute {
    fn id(&self) -> RouteId {
        RouteId::NATIVE_VMM
    }

    /// The budget, pinned staging, the pinned limit and the streaming engine's options.
    fn effective_options(&self, spec: &RouteSpec) -> Vec<ddo_core::EffectiveOption> {
        use ddo_core::{EffectiveOption as E, OptionValue as V};
        let o = spec.options();
        let c = NativeVmmConfig::from_spec(spec);
        let mut v = vec![
            E::new(
                "budget",
                V::Text(ddo_core::describe_budget(c.budget)),
                c.explicit_budget,
            ),
            E::new("pinned", V::Flag(c.pinned), o.pinned.is_some()),
            E::new(
                "pinned_limit",
                V::Text(ddo_metrics::format_bytes(c.streaming.pinned_limit)),
                o.pinned_limit.is_some(),
            ),
        ];
        // The engine's options this route takes (not `compress`: coded streaming is
        // leaf-group's, and this route refuses it).
        v.extend(
            ddo_core::streaming::effective_options(o, &c.streaming)
                .into_iter()
                .filter(|e| OPTIONS.get(e.name).is_some()),
        );
        v
    }

    /// Always: what the budget does not hold streams through the engine.
    fn streams(&self, _spec: &RouteSpec) -> bool {
        true
    }

    /// Always: the route's weights live in the native pool.
    fn needs_native_allocator(&self, _spec: &RouteSpec) -> bool {
        true
    }

    /// What the budget holds stays in the pool; the rest streams through a ring of two
    /// leaves.
    fn estimate(
        &self,
        spec: &RouteSpec,
        weight_bytes: u64,
        largest_leaf_bytes: u64,
        budget_bytes: u64,
    ) -> ddo_core::HeaderEstimate {
        let room = match NativeVmmConfig::from_spec(spec).budget {
            Budget::Bytes(n) => n.min(budget_bytes),
            Budget::FreeMinus(m) => budget_bytes.saturating_sub(m),
        };
        let resident = weight_bytes.min(room);
        let streamed = weight_bytes - resident;
        ddo_core::HeaderEstimate {
            resident_bytes: resident,
            streamed_bytes_per_forward: streamed,
            peak_weight_bytes: resident
                + if streamed > 0 {
                    2 * largest_leaf_bytes
                } else {
                    0
                },
            note: "needs the native allocator installed at start-up".into(),
        }
    }

    /// The budget given, or [`DEFAULT_BUDGET`].
    fn effective_budget(&self, spec: &RouteSpec) -> Option<Budget> {
        Some(NativeVmmConfig::from_spec(spec).budget)
    }

    /// The budget, pinned staging and the streaming engine's options.
    fn option_table(&self) -> &'static OptionTable {
        &OPTIONS
    }

    /// The VAE only with an explicit budget.
    fn check_options(&self, component: &str, spec: &RouteSpec) -> std::result::Result<(), Refusal> {
        let config = NativeVmmConfig::from_spec(spec);
        // By name only: the explicit opt-in is for the component named `vae`.
        if component == "vae" && !config.explicit_budget {
            return Err(Refusal::VaeNeedsExplicitCapacity);
        }
        Ok(())
    }

    fn preflight(
        &self,
        component: &Component,
        device: &dyn Device,
        spec: &RouteSpec,
    ) -> Result<()> {
        if device.allocator() != AllocatorKind::NativeVmm {
            return Err(refused(component, Refusal::NativeAllocatorRequired));
        }
        ddo_core::route::check_budget_left(self, component.name(), spec, free_bytes(device))?;
        if let Some(leaf) = component.largest_leaf() {
            let free = free_bytes(device);
            let config = NativeVmmConfig::from_spec(spec);
            let budget = config.budget.bytes_given_free(free);
            let leaf_bytes = leaf.param_bytes();
            if budget < leaf_bytes {
                let explained = config.budget.explain_given_free(free);
                return Err(refused(
                    component,
                    Refusal::BudgetBelowLargestLeaf {
                        budget,
                        given: if config.explicit_budget {
                            format!("budget={explained}")
                        } else {
                            format!("the default budget, {explained}")
                        },
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

    /// The plan [`plan_with_mode`] makes with the context's free bytes: resident leaves,
    /// the rest streamed through the engine's ring (or one leaf at a time), the streamed
    /// weights in a pinned home when `pinned` and they fit under the pinned limit.
    fn footprint(
        &self,
        component: &Component,
        spec: &RouteSpec,
        context: &FootprintContext,
    ) -> Result<Footprint> {
        let config = NativeVmmConfig::from_spec(spec);
        let (plan, mode) = plan_in(component, spec, context);
        let limit = config.streaming.pinned_limit.min(context.pinned_room);
        let streamed = plan.streamed_bytes;
        let home = config.pinned && streamed > 0 && streamed <= limit;
        let slot = plan.slot_bytes / config.slot_model().slots.max(1);
        // Otherwise the engine stages through two bounded pinned buffers.
        let pinned = if home {
            streamed
        } else if mode == StreamMode::Engine {
            2 * slot.min(limit / 2)
        } else {
            0
        };
        let pageable = streamed > 0 && !home;
        let human = ddo_metrics::format_bytes;
        Ok(Footprint {
            weight_bytes: component.param_bytes(),
            resident_bytes: plan.resident_bytes,
            streamed_bytes_per_forward: streamed,
            transient_device_bytes: plan.slot_bytes,
            pinned_host_bytes: pinned,
            needs_native_allocator: true,
            attaches_on_device: plan.resident_bytes > 0,
            pageable_staging: pageable && config.pinned,
            pinned_limit_to_avoid_pageable: if pageable && config.pinned {
                streamed
            } else {
                0
            },
            staged_bytes_per_forward: if pageable { streamed } else { 0 },
            disk_bytes_per_forward: if pageable && mode == StreamMode::Engine {
                config
                    .streaming
                    .page_cache_limit
                    .map_or(0, |l| streamed.saturating_sub(l))
            } else {
                0
            },
            summary: format!(
                "{} resident in the native pool, {} streamed per forward ({})",
                human(plan.resident_bytes),
                human(streamed),
                match mode {
                    StreamMode::Nothing => "nothing streams",
                    StreamMode::Engine => "through the engine's ring",
                    StreamMode::LeafByLeaf => "one leaf at a time",
                }
            ),
        })
    }
}

/// What changes forward to forward.
struct State {
    /// The resident set, and streamed leaves onloaded one at a time outside the engine
    /// (the learning forward, a forward that left the schedule, no copy stream).
    eager: EagerLeafStreamer,
    /// The order the streamed leaves (segments) start in.
    schedule: Schedule,
    /// The streaming engine, built after the learning forward.
    engine: Option<StreamingEngine>,
    /// The engine position of the leaf running now.
    position: Option<usize>,
    /// Leaf by leaf with `pinned`: the streamed weights' page-locked host copy.
    home: Option<PinnedHome>,
}

/// `native_vmm` attached to one component: resident leaves stay on the device, streamed
/// leaves go through the streaming engine (see the crate docs).
pub struct NativeVmmAttachment {
    component: String,
    device: Arc<dyn Device>,
    metrics: Arc<RouteMetrics>,
    config: NativeVmmConfig,
    plan: ResidencyPlan,
    /// By leaf id.
    leaves: Vec<LeafPlan>,
    /// The engine's segments (streamed leaves' params).
    segments: Vec<Vec<Arc<Param>>>,
    /// The leaf path of each segment.
    segment_paths: Vec<String>,
    /// Every param of the component once.
    params: Vec<Arc<Param>>,
    compute: Stream,
    copy: Option<Stream>,
    state: Mutex<State>,
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
            .field("on_device", st.eager.table())
            .field("engine", &st.engine.as_ref().map(StreamingEngine::figures))
            .field("detached", &st.eager.is_detached())
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

    /// Device bytes of resident weights held now (between forwards: the resident set).
    pub fn device_weight_bytes(&self) -> u64 {
        let st = self.state.lock();
        st.eager.table().resident_bytes()
            + st.engine.as_ref().map_or(0, |e| e.figures().resident_bytes)
    }

    /// Pinned host bytes held: the streaming engine's staging (once the schedule is
    /// learned), or the pinned home of leaf-by-leaf streaming; 0 after detach.
    pub fn pinned_bytes(&self) -> u64 {
        let st = self.state.lock();
        st.home.as_ref().map_or(0, PinnedHome::bytes)
            + st.engine.as_ref().map_or(0, |e| e.figures().pinned_bytes)
    }

    /// How the streamed leaves move.
    pub fn stream_mode(&self) -> StreamMode {
        if self.plan.streamed.is_empty() {
            StreamMode::Nothing
        } else if self.copy.is_some() {
            StreamMode::Engine
        } else {
            StreamMode::LeafByLeaf
        }
    }

    /// The streaming engine's figures, once the schedule is learned.
    pub fn streaming(&self) -> Option<StreamingFigures> {
        self.state
            .lock()
            .engine
            .as_ref()
            .map(|e| e.figures().clone())
    }

    /// The learned order of the streamed leaves (segment indices), once learned.
    pub fn schedule(&self) -> Option<Vec<usize>> {
        self.state.lock().schedule.order().map(<[usize]>::to_vec)
    }

    fn leaf_plan(&self, leaf: &Leaf) -> Result<&LeafPlan> {
        self.leaves
            .get(leaf.id().0)
            .ok_or_else(|| CoreError::Shape {
                what: format!("native_vmm on `{}`", self.component),
                message: format!("leaf `{}` is not a leaf of this component", leaf.path()),
            })
    }

    fn live(&self) -> Result<parking_lot::MutexGuard<'_, State>> {
        let st = self.state.lock();
        if st.eager.is_detached() {
            return Err(CoreError::Detached {
                component: self.component.clone(),
            });
        }
        Ok(st)
    }

    /// Builds the engine for the learned schedule (replacing an older one). Resident
    /// weights and the ring stay within the budget the attach plan was made for.
    fn build_engine(&self, st: &mut State) -> Result<()> {
        if let Some(mut old) = st.engine.take() {
            old.teardown()?;
        }
        let (Some(order), Some(copy)) = (st.schedule.order(), self.copy.clone()) else {
            return Ok(());
        };
        let mut config = self.config.streaming;
        config.budget = Some(
            self.plan
                .budget_bytes
                .saturating_sub(st.eager.table().resident_bytes()),
        );
        let engine = StreamingEngine::new(
            Arc::clone(&self.device),
            copy,
            &self.segments,
            order,
            &config,
            Arc::clone(&self.metrics),
        )?;
        let f = engine.figures();
        // Leaves the engine keeps resident besides the attach plan's (its budget was what
        // the plan left over).
        let engine_resident: HashSet<ParamId> =
            engine.resident_params().iter().map(|p| p.id()).collect();
        let mut resident_leaves = self.plan.resident.clone();
        let mut extra = 0u64;
        for (segment, path) in self.segments.iter().zip(&self.segment_paths) {
            if !segment.is_empty() && segment.iter().all(|p| engine_resident.contains(&p.id())) {
                resident_leaves.push(path.clone());
                extra += 1;
            }
        }
        self.metrics.set_leaf_plan(
            (self.plan.streamed.len() as u64).saturating_sub(extra),
            self.plan.resident.len() as u64 + extra,
        );
        self.metrics.set_resident_leaves(resident_leaves);
        f.publish(&self.metrics);
        self.metrics
            .set_resident_weight_bytes(st.eager.table().resident_bytes() + f.resident_bytes);
        st.engine = Some(engine);
        Ok(())
    }

    /// Leaves the engine for the rest of this forward: its device memory goes back and the
    /// remaining leaves run eagerly.
    fn leave_engine(&self, st: &mut State) -> Result<()> {
        st.position = None;
        match st.engine.as_mut() {
            Some(engine) if engine.in_forward() => engine.release_device(),
            _ => Ok(()),
        }
    }
}

impl AttachedRoute for NativeVmmAttachment {
    fn route(&self) -> RouteId {
        RouteId::NATIVE_VMM
    }

    fn describe(&self) -> String {
        format!(
            "native_vmm budget={} ({} B) pinned={}: {} leaves resident ({} B), {} streamed ({} B per forward, ring {} B)",
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
        let mut st = self.live()?;
        // Left behind by a forward that failed halfway.
        st.eager.offload_all(&*self.device)?;
        if st.engine.as_ref().is_some_and(StreamingEngine::in_forward) {
            self.leave_engine(&mut st)?;
        }
        st.position = None;
        st.schedule.begin_forward();
        if self.copy.is_some() && st.schedule.order().is_some() && st.engine.is_none() {
            self.build_engine(&mut st)?;
        }
        if let Some(engine) = st.engine.as_mut() {
            engine.begin_forward()?;
        }
        Ok(())
    }

    fn before_leaf(&self, leaf: &Leaf) -> Result<()> {
        let lp = self.leaf_plan(leaf)?;
        let mut st = self.live()?;
        // Leaves run one at a time: a streamed leaf still here was left by a failed one.
        st.eager.offload_all(&*self.device)?;
        let Some(segment) = lp.segment else {
            return Ok(());
        };
        let on_engine = st.engine.as_ref().is_some_and(StreamingEngine::in_forward);
        match st.schedule.start(segment) {
            Some(pos) if on_engine => {
                if let Some(engine) = st.engine.as_mut() {
                    engine.enter(pos)?;
                }
                st.position = Some(pos);
                Ok(())
            }
            _ => {
                if on_engine {
                    self.leave_engine(&mut st)?;
                }
                let st = &mut *st;
                match st.engine.as_ref() {
                    // Read where the engine's registered mappings allow.
                    Some(engine) => st.eager.onload_from(
                        &*self.device,
                        leaf.id(),
                        &lp.params,
                        &self.metrics,
                        &|p: &Param| engine.host_source(p),
                    ),
                    None => st
                        .eager
                        .onload(&*self.device, leaf.id(), &lp.params, &self.metrics),
                }
            }
        }
    }

    fn after_leaf(&self, leaf: &Leaf) -> Result<()> {
        let lp = self.leaf_plan(leaf)?;
        let mut st = self.live()?;
        if lp.segment.is_none() {
            return Ok(());
        }
        if let Some(pos) = st.position.take() {
            return match st.engine.as_mut() {
                Some(engine) => engine.leave(pos),
                None => Ok(()),
            };
        }
        if st.eager.is_onloaded(leaf.id()) {
            st.eager.offload_all(&*self.device)?;
        }
        Ok(())
    }

    fn after_forward(&self) -> Result<()> {
        let mut st = self.live()?;
        st.position = None;
        let eager = st.eager.offload_all(&*self.device);
        let ended = st
            .engine
            .as_mut()
            .map_or(Ok(()), StreamingEngine::end_forward);
        let streamed = match st.schedule.end_forward() {
            ScheduleOutcome::Followed => ended,
            ScheduleOutcome::Learned => ended.and_then(|()| self.build_engine(&mut st)),
            ScheduleOutcome::Relearned => {
                self.metrics.record_schedule_relearned();
                ended.and_then(|()| self.build_engine(&mut st))
            }
        };
        eager.and(streamed)
    }

    fn end_phase(&self) -> Result<()> {
        let mut st = self.state.lock();
        st.position = None;
        let released = st.eager.offload_all(&*self.device);
        let engine = st
            .engine
            .as_mut()
            .map_or(Ok(()), StreamingEngine::release_device);
        let synced = self.device.synchronize();
        released.and(engine).and(synced)
    }

    fn detach(&self) -> Result<()> {
        let mut st = self.state.lock();
        st.position = None;
        let engine = st.engine.take().map_or(Ok(()), |mut e| e.teardown());
        let synced = st.eager.detach(&*self.device, &self.params);
        // The home goes after every copy from it finished (detach synchronised).
        let home = st.home.take().map_or(Ok(()), PinnedHome::restore);
        drop(st);
        let _ = self.device.synchronize_stream(&self.compute);
        self.metrics.set_pinned_host_bytes(0);
        self.metrics.set_resident_weight_bytes(0);
        engine.and(synced).and(home)
    }
}

impl Drop for NativeVmmAttachment {
    fn drop(&mut self) {
        // Errors have nowhere to go from Drop; `detach` has freed everything regardless.
        let _ = self.detach();
    }
}
