//! The `diffusers_group_offload` route: Diffusers-style group offloading of one component,
//! at leaf or block level, with or without a copy stream that prefetches the next group.
//!
//! This is a route crate: it sits above `ddo-core` (and `ddo-metrics`) and talks only to the
//! [`Device`] trait, so it runs unchanged on the host backend in CI and on CUDA. The route
//! registry in `ddo-routes` lists [`GroupOffloadRoute`] under
//! [`RouteId::DiffusersGroupOffload`], runs its preflight, calls [`Route::attach`] and
//! installs the returned hooks in the component; nothing in this crate installs hooks.
//!
//! What it does, following Diffusers' documented behaviour:
//!
//! - **Groups** ([`GroupPlan`]). `leaf_level`: every leaf that owns params is a group.
//!   `block_level`: consecutive runs of `num_blocks_per_group` blocks of each root-level
//!   block list form a group, and every other leaf falls into one "unmatched" group that
//!   is onloaded for the whole forward (Diffusers onloads the top-level leftovers at the
//!   root's forward, without a stream).
//! - **Without a stream** a group is copied on the compute stream when its first leaf
//!   starts and freed after use (leaf level: after the leaf; block level: when a leaf of
//!   another group starts, or at the end of the forward). At most one group is on the
//!   device at a time (block level: plus the unmatched group).
//! - **With a stream** the first forward learns the order in which groups start (the
//!   [`Schedule`]) while onloading each group on the copy stream and ordering compute
//!   behind it with an event. From then on the groups run on ddo-core's
//!   [`StreamingEngine`]: their params, packed in schedule order into transfer units
//!   (`unit_bytes`, default 16 MiB) in pinned staging bounded by `pinned_limit`, stream
//!   through a ring of `ring_slots` device slots (default 2) allocated once per forward,
//!   compute waiting on each unit's copy event and each slot's refill waiting on compute's
//!   use event — no allocation, host synchronisation or per-param work per leaf. With a
//!   `budget` (stream mode only, a DDO extension), the engine keeps the groups that cost
//!   most to stream resident within `resident + ring ≤ budget`. A group that starts out of
//!   schedule hands the engine's device memory back and falls back to a direct onload for
//!   the rest of the forward; the schedule (and the engine) are learned again
//!   ([`RouteMetrics::record_schedule_relearned`]).
//! - **Freeing.** Outside the engine, `record_stream=false` synchronises the compute stream
//!   and frees at once (as Diffusers does with `current_stream().synchronize()`);
//!   `record_stream=true` frees in stream order behind the compute stream, without a host
//!   synchronisation. The engine's ring goes back in stream order at the end of a forward.
//! - **Host sources.** Without a stream nothing is pinned by default (Diffusers pins only
//!   for a stream); `pinned=true` keeps pinned copies of every weight,
//!   made at attach and counted against the device's pinned limit; otherwise weights are
//!   copied from their own host bytes (pageable copies block the host, as on CUDA). With a
//!   stream there is one host copy: the engine's pinned home replaces the params' host
//!   bytes when the streamed bytes fit under `pinned_limit` (default
//!   [`DEFAULT_PINNED_LIMIT`](ddo_core::streaming::DEFAULT_PINNED_LIMIT)), else (and with
//!   `pinned=false` or `low_cpu_mem_usage=true`) two bounded pinned staging buffers are
//!   filled from the params' own bytes. With `pinned_source=register` (stream mode only)
//!   the engine page-locks the checkpoint mappings the params point into instead of
//!   copying them into a home (see [`ddo_core::streaming`]). The learning forward copies
//!   from the params' own bytes (`low_cpu_mem_usage=true`: pinned on the fly).
//!
//! The route keeps nothing resident by design: between phases
//! ([`AttachedRoute::end_phase`]) nothing of the component stays on the device, and
//! [`AttachedRoute::detach`] leaves every param host-only. Its hooks are not removable by
//! `remove_dynamic_offload` ([`AttachedRoute::removable`] is `false`): as in Diffusers,
//! they live as long as the handle and the component hold them.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use ddo_core::residency::{FreeMode, ResidencyTable, pin_copy};
use ddo_core::streaming::layout::align_up;
use ddo_core::streaming::plan::plan_residency_with;
use ddo_core::streaming::{
    PinnedHome, Schedule, ScheduleOutcome, StagingMode, StreamingConfig, StreamingEngine,
    StreamingFigures, ring_does_not_fit,
};
use ddo_core::{
    AttachedRoute, Component, CoreError, Device, DeviceId, Footprint, FootprintContext,
    GroupOffloadConfig, HostSlice, Leaf, LeafId, OffloadType, Param, ParamId, Placement, Refusal,
    Result, Route, RouteId, RouteSpec, Stream,
};
use ddo_metrics::RouteMetrics;
use parking_lot::{Mutex, MutexGuard};

/// Ring slots of the streaming engine when a `budget` keeps part of the model resident and
/// `ring_slots` is not given: 3 (2 without a budget, the engine's default). While resident
/// leaves compute, the link runs only as far ahead as the ring reaches; on one H200
/// (FLUX.1-dev transformer, `budget=10GiB`) two slots left the copy engine waiting for ring
/// room 12.1 ms a step (262.9 ms a step), three 1.4 ms (253.0 ms), four 0.6 ms (253.6 ms,
/// more bytes streamed), six 258.3 ms.
pub const BUDGETED_RING_SLOTS: usize = 3;

/// The streaming engine's settings for `spec`: its options, with [`BUDGETED_RING_SLOTS`]
/// under a budget (what `ddo resolve` shows asks this).
pub fn streaming_config(spec: &RouteSpec) -> StreamingConfig {
    let o = spec.options();
    let mut config = StreamingConfig::from_options(o);
    if o.budget.is_some() && o.ring_slots.is_none() {
        config.ring_slots = BUDGETED_RING_SLOTS;
    }
    config
}

/// The route's name, as errors and profiles spell it.
pub const ROUTE_NAME: &str = "diffusers_group_offload";

const BUDGET_HINT: &str = "diffusers_group_offload keeps budgeted residency only with a stream: \
     set use_stream=true, or use native_vmm with a budget, or none";

const STREAM_ONLY_HINT: &str = "unit_bytes, ring_slots, pinned_source and timeline tune the streaming engine: set use_stream=true, or drop them";

/// Label of the block-level group that holds every leaf outside the root's block lists.
pub const UNMATCHED_LABEL: &str = "unmatched";

/// The `diffusers_group_offload` route (Diffusers-style leaf- or block-level group
/// offloading). Stateless: everything an attachment needs lives in the
/// [`AttachedGroupOffload`] it returns.
#[derive(Debug, Clone, Copy, Default)]
pub struct GroupOffloadRoute;

impl GroupOffloadRoute {
    /// [`Route::attach`], returning the concrete hooks (for callers that want to inspect
    /// the group plan or the learned schedule). Does not install them in the component.
    pub fn attach_group_offload(
        &self,
        component: &Arc<Component>,
        device: Arc<dyn Device>,
        spec: &RouteSpec,
        metrics: Arc<RouteMetrics>,
    ) -> Result<Arc<AttachedGroupOffload>> {
        self.preflight(component, &*device, spec)?;
        if let Some(existing) = component.attached() {
            return Err(CoreError::AlreadyAttached {
                component: component.name().to_string(),
                route: existing.route_name(),
            });
        }
        let config = spec.group_offload_config();
        let plan = GroupPlan::new(component, &config);
        let params = component.params();
        // A stream-mode budget must hold the streaming engine's ring beside whatever it
        // keeps resident: refuse now rather than after the learning forward.
        if let (true, Some(budget)) = (config.use_stream, spec.options().budget) {
            let streaming = streaming_config(spec);
            let budget = budget.bytes_given_free(device.memory_info().free_bytes());
            let weighted = plan.engine_segments();
            let model = streaming.slot_model();
            let ring_plan = plan_residency_with(&weighted, budget, model);
            if !ring_plan.fits() {
                return Err(ring_does_not_fit(budget, ring_plan.slot_bytes, model.slots));
            }
        }
        // With a stream the engine owns pinning (one host copy, bounded staging); pinned
        // copies of the whole model at attach are the no-stream mode's.
        let source = if config.pinned && !config.use_stream {
            HostSource::Pinned
        } else if config.use_stream && config.low_cpu_mem_usage {
            HostSource::PinOnTheFly
        } else {
            HostSource::Own
        };
        // Fallible steps first; on error everything made so far is dropped on return.
        // Without a stream, `pinned` makes one pinned buffer the weights' host bytes (one
        // host copy, copies at pinned speed); when it does not fit under the pinned limit
        // the weights stay where they are, unless `pinned=true` was asked for explicitly.
        let pinned = if source == HostSource::Pinned {
            let limit = streaming_config(spec).pinned_limit;
            PinnedHome::sequential(
                &*device,
                &params,
                limit,
                spec.options().pinned == Some(true),
            )?
        } else {
            None
        };
        let source = if source == HostSource::Pinned && pinned.is_none() {
            HostSource::Own
        } else {
            source
        };
        let copy_stream = if config.use_stream {
            Some(device.create_stream()?)
        } else {
            None
        };
        // Diffusers offloads every group when it applies the hooks: start host-only.
        // Clearing a device copy cannot fail (there is no length to check).
        for p in &params {
            let _ = p.set_device(None);
        }
        let pinned_bytes = pinned.as_ref().map_or(0, PinnedHome::bytes);
        metrics.set_leaf_plan(plan.streamed_leaves(), 0);
        metrics.set_resident_weight_bytes(0);
        metrics.set_pinned_host_bytes(pinned_bytes);
        // With a stream the groups are expected to start in the component's leaf order
        // (the models build their trees in execution order): the engine is built now, so
        // the first forward streams too. A forward that runs another order learns it.
        let schedule = if config.use_stream {
            Schedule::predicted(plan.predicted_order())
        } else {
            Schedule::new()
        };
        let attached = Arc::new(AttachedGroupOffload {
            component: component.name().to_string(),
            spec: *spec,
            config,
            streaming: streaming_config(spec),
            compute: device.compute_stream(),
            device,
            metrics,
            plan,
            params,
            source,
            state: Mutex::new(State {
                detached: false,
                table: ResidencyTable::new(),
                pinned,
                copy_stream,
                current: None,
                position: None,
                unmatched_onloaded: false,
                schedule,
                engine: None,
            }),
        });
        if attached.config.use_stream {
            let mut st = attached.state.lock();
            // On error the attachment is dropped, and its detach gives everything back.
            attached.build_engine(&mut st)?;
        }
        Ok(attached)
    }
}

impl Route for GroupOffloadRoute {
    fn id(&self) -> RouteId {
        RouteId::DiffusersGroupOffload
    }

    /// A budget and the streaming engine's options need `use_stream=true`.
    fn check_options(
        &self,
        _component: &str,
        spec: &RouteSpec,
    ) -> std::result::Result<(), Refusal> {
        let o = spec.options();
        let streamed = spec.group_offload_config().use_stream;
        if o.budget.is_some() && !streamed {
            return Err(Refusal::UnsupportedOption {
                option: "budget",
                hint: BUDGET_HINT,
            });
        }
        for (given, option) in [
            (o.unit_bytes.is_some(), "unit_bytes"),
            (o.ring_slots.is_some(), "ring_slots"),
            (o.pinned_source.is_some(), "pinned_source"),
            (o.timeline.is_some(), "timeline"),
        ] {
            if given && !streamed {
                return Err(Refusal::UnsupportedOption {
                    option,
                    hint: STREAM_ONLY_HINT,
                });
            }
        }
        Ok(())
    }

    fn preflight(
        &self,
        component: &Component,
        device: &dyn Device,
        spec: &RouteSpec,
    ) -> Result<()> {
        if spec.route_id() != Some(RouteId::DiffusersGroupOffload) {
            return Err(CoreError::InvalidOption {
                option: "route".into(),
                value: spec.target().to_string(),
                hint: format!("the {ROUTE_NAME} route attaches {ROUTE_NAME} specs only"),
            });
        }
        let refuse = |refusal| CoreError::Refused {
            route: ROUTE_NAME,
            component: component.name().to_string(),
            refusal,
        };
        self.check_options(component.name(), spec).map_err(refuse)?;
        if spec.group_offload_config().use_stream && !device.supports_streams() {
            return Err(refuse(Refusal::NoStreams));
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
        let hooks: Arc<dyn AttachedRoute> =
            self.attach_group_offload(component, device, spec, metrics)?;
        Ok(hooks)
    }

    /// Without a stream: nothing resident, every group copied per forward, one group on
    /// the device at a time (block level: plus the unmatched group), the weights' one host
    /// copy pinned when `pinned` and it fits under the pinned limit. With a stream: the
    /// engine's residency plan under `budget` (resident + ring within it), the rest
    /// streamed; pinned host bytes are the pinned home of the streamed bytes when they fit
    /// under the limit, else two staging buffers (then copies go through pageable reads,
    /// and the footprint names the limit that would avoid it). The learning forward holds
    /// two groups at most and nothing resident yet: the transient bytes cover what it holds
    /// beyond the resident set.
    fn footprint(
        &self,
        component: &Component,
        spec: &RouteSpec,
        context: &FootprintContext,
    ) -> Result<Footprint> {
        let config = spec.group_offload_config();
        let plan = GroupPlan::new(component, &config);
        let weight_bytes = component.param_bytes();
        let unmatched = plan.unmatched_bytes();
        let streaming = streaming_config(spec);
        let limit = streaming.pinned_limit.min(context.pinned_room);
        let human = ddo_metrics::format_bytes;
        if !config.use_stream {
            let pinned = config.pinned && weight_bytes <= limit;
            return Ok(Footprint {
                weight_bytes,
                resident_bytes: 0,
                streamed_bytes_per_forward: weight_bytes,
                transient_device_bytes: plan.largest_group_bytes() + unmatched,
                pinned_host_bytes: if pinned { weight_bytes } else { 0 },
                needs_native_allocator: false,
                attaches_on_device: false,
                pageable_staging: !pinned,
                pinned_limit_to_avoid_pageable: if pinned { 0 } else { weight_bytes },
                summary: format!(
                    "{} groups copied per forward, one at a time, from {} host memory",
                    plan.groups.len(),
                    if pinned { "pinned" } else { "pageable" }
                ),
            });
        }
        let segments = plan.engine_segments();
        let model = streaming.slot_model();
        let budget = spec
            .options()
            .budget
            .map(|b| b.bytes_given_free(context.free_device_bytes));
        let total: u64 = segments.iter().map(|(_, b)| b).sum();
        let (resident, streamed, ring) = match budget {
            Some(b) => {
                let p = plan_residency_with(&segments, b, model);
                (p.resident_bytes, p.streamed_bytes, p.slot_bytes)
            }
            None => {
                let largest = segments.iter().map(|(_, b)| *b).max().unwrap_or(0);
                (0, total, model.room(largest, total))
            }
        };
        let learning = plan.largest_groups_bytes(2);
        // A home of the streamed bytes when they fit, else two staging buffers of a slot.
        let staging_buffers = 2 * (ring / model.slots.max(1)).min(limit / 2);
        let (pinned, pageable) = if streaming.staging == StagingMode::Ring {
            (staging_buffers, false)
        } else if streamed <= limit {
            (streamed, false)
        } else {
            (staging_buffers, true)
        };
        Ok(Footprint {
            weight_bytes,
            resident_bytes: resident,
            streamed_bytes_per_forward: streamed + unmatched,
            // The learning forward holds no resident set yet: at most two groups.
            transient_device_bytes: ring.max(learning.saturating_sub(resident)) + unmatched,
            pinned_host_bytes: pinned,
            needs_native_allocator: false,
            attaches_on_device: false,
            pageable_staging: pageable,
            pinned_limit_to_avoid_pageable: if pageable { streamed } else { 0 },
            summary: format!(
                "{} resident, {} streamed per forward through a {} ring{}",
                human(resident),
                human(streamed + unmatched),
                human(ring),
                if pageable {
                    format!(
                        "; staged from pageable memory: pinned_limit {} < {} streamed",
                        human(limit),
                        human(streamed)
                    )
                } else {
                    String::new()
                }
            ),
        })
    }
}

/// One offload group: params that move to the device together.
#[derive(Debug, Clone)]
pub struct Group {
    label: String,
    leaves: Vec<LeafId>,
    params: Vec<Arc<Param>>,
    bytes: u64,
}

impl Group {
    /// A readable name: the leaf path (leaf level), `list[first..=last]` (block level), or
    /// [`UNMATCHED_LABEL`].
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The leaves (with params) in the group, in component order.
    pub fn leaves(&self) -> &[LeafId] {
        &self.leaves
    }

    /// The group's params, each once (a tied weight inside one group counts once).
    pub fn params(&self) -> &[Arc<Param>] {
        &self.params
    }

    /// Bytes of the group's params.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// How a component's leaves fall into offload groups for one [`GroupOffloadConfig`].
///
/// Leaves without params belong to no group: they need nothing on the device.
#[derive(Debug, Clone)]
pub struct GroupPlan {
    groups: Vec<Group>,
    leaf_group: Vec<Option<usize>>,
    leaf_paths: Vec<String>,
    unmatched: Option<usize>,
}

impl GroupPlan {
    /// Groups `component`'s leaves as `config` says (`offload_type`, `num_blocks_per_group`).
    pub fn new(component: &Component, config: &GroupOffloadConfig) -> Self {
        let leaves = component.leaves();
        let mut plan = Self {
            groups: Vec::new(),
            leaf_group: vec![None; leaves.len()],
            leaf_paths: leaves.iter().map(|l| l.path().to_string()).collect(),
            unmatched: None,
        };
        let per_group = config.num_blocks_per_group.max(1);
        let mut block_groups: HashMap<(String, usize), usize> = HashMap::new();
        let mut block_last: HashMap<usize, (String, usize, usize)> = HashMap::new();
        let mut seen: Vec<HashSet<ParamId>> = Vec::new();
        for leaf in leaves {
            if leaf.params().is_empty() {
                continue;
            }
            let g = match config.offload_type {
                OffloadType::LeafLevel => plan.push_group(leaf.path().to_string(), &mut seen),
                OffloadType::BlockLevel => match leaf.placement() {
                    Placement::Block { list, index } => {
                        let chunk = index / per_group;
                        let key = (list.clone(), chunk);
                        let g = match block_groups.get(&key) {
                            Some(&g) => g,
                            None => {
                                let g = plan.push_group(String::new(), &mut seen);
                                block_groups.insert(key, g);
                                g
                            }
                        };
                        let first = chunk * per_group;
                        let entry = block_last
                            .entry(g)
                            .or_insert_with(|| (list.clone(), first, *index));
                        entry.2 = entry.2.max(*index);
                        g
                    }
                    Placement::Unmatched => match plan.unmatched {
                        Some(g) => g,
                        None => {
                            let g = plan.push_group(UNMATCHED_LABEL.to_string(), &mut seen);
                            plan.unmatched = Some(g);
                            g
                        }
                    },
                },
            };
            plan.leaf_group[leaf.id().0] = Some(g);
            let group = &mut plan.groups[g];
            group.leaves.push(leaf.id());
            for (_, p) in leaf.params() {
                if seen[g].insert(p.id()) {
                    group.bytes += p.nbytes() as u64;
                    group.params.push(Arc::clone(p));
                }
            }
        }
        for (g, (list, first, last)) in block_last {
            plan.groups[g].label = format!("{list}[{first}..={last}]");
        }
        plan
    }

    fn push_group(&mut self, label: String, seen: &mut Vec<HashSet<ParamId>>) -> usize {
        self.groups.push(Group {
            label,
            leaves: Vec::new(),
            params: Vec::new(),
            bytes: 0,
        });
        seen.push(HashSet::new());
        self.groups.len() - 1
    }

    /// The groups, in the order their first leaf appears in the component.
    pub fn groups(&self) -> &[Group] {
        &self.groups
    }

    /// Number of groups.
    pub fn len(&self) -> usize {
        self.groups.len()
    }

    /// Whether there are no groups (a component without params).
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// The group of `leaf`, if it has params.
    pub fn group_of(&self, leaf: LeafId) -> Option<usize> {
        self.leaf_group.get(leaf.0).copied().flatten()
    }

    /// The block-level group of leaves outside the block lists, if there is one.
    pub fn unmatched(&self) -> Option<usize> {
        self.unmatched
    }

    /// Bytes of the largest group other than the unmatched one.
    pub fn largest_group_bytes(&self) -> u64 {
        self.streamed_group_bytes().max().unwrap_or(0)
    }

    /// Sum of the `k` largest groups other than the unmatched one.
    pub fn largest_groups_bytes(&self, k: usize) -> u64 {
        let mut sizes: Vec<u64> = self.streamed_group_bytes().collect();
        sizes.sort_unstable_by(|a, b| b.cmp(a));
        sizes.into_iter().take(k).sum()
    }

    /// Bytes of the unmatched group (0 when there is none).
    pub fn unmatched_bytes(&self) -> u64 {
        self.unmatched.map_or(0, |g| self.groups[g].bytes)
    }

    /// Leaves whose weights move to the device per forward (every leaf with params).
    pub fn streamed_leaves(&self) -> u64 {
        self.leaf_group.iter().filter(|g| g.is_some()).count() as u64
    }

    /// The order streamed groups are expected to start in: every group with params other
    /// than the unmatched one, by its first leaf in the component's leaf order.
    pub fn predicted_order(&self) -> Vec<usize> {
        let mut order = Vec::new();
        for g in self.leaf_group.iter().flatten() {
            if Some(*g) != self.unmatched && !order.contains(g) {
                order.push(*g);
            }
        }
        order
    }

    /// The groups the streaming engine streams or keeps resident, as the residency planner
    /// sees them: `(label, bytes)` with each param at the engine's alignment, the unmatched
    /// group left out (it is onloaded for the whole forward).
    pub fn engine_segments(&self) -> Vec<(String, u64)> {
        self.groups
            .iter()
            .enumerate()
            .filter(|(i, g)| !g.params.is_empty() && Some(*i) != self.unmatched)
            .map(|(_, g)| {
                let bytes = g.params.iter().map(|p| align_up(p.nbytes() as u64)).sum();
                (g.label.clone(), bytes)
            })
            .collect()
    }

    fn streamed_group_bytes(&self) -> impl Iterator<Item = u64> + '_ {
        self.groups
            .iter()
            .enumerate()
            .filter(|(g, _)| Some(*g) != self.unmatched)
            .map(|(_, group)| group.bytes)
    }
}

/// Where the bytes of an onload come from (without a stream, and on the stream mode's
/// learning forward).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HostSource {
    /// The pinned home made at attach (no stream, `pinned`): the params' own host bytes,
    /// page-locked.
    Pinned,
    /// A pinned staging copy made per onload, kept alive by the queued copy.
    PinOnTheFly,
    /// The param's own host bytes (pageable or mapped: the copy blocks the host; pinned
    /// once the streaming engine made its pinned home the params' host bytes).
    Own,
}

#[derive(Debug)]
struct State {
    detached: bool,
    /// Device copies of groups onloaded outside the engine (no stream, the learning
    /// forward, a forward that left the schedule, the unmatched group).
    table: ResidencyTable,
    pinned: Option<PinnedHome>,
    copy_stream: Option<Stream>,
    /// The group compute is using now (not the unmatched one).
    current: Option<usize>,
    /// The engine position of `current`, when the engine runs it.
    position: Option<usize>,
    /// Whether the block-level unmatched group is onloaded.
    unmatched_onloaded: bool,
    /// The learned order of group starts (stream mode).
    schedule: Schedule,
    /// The streaming engine, built from the schedule after the learning forward.
    engine: Option<StreamingEngine>,
}

impl State {
    fn holds_anything(&self) -> bool {
        self.current.is_some()
            || self.unmatched_onloaded
            || !self.table.is_empty()
            || self
                .engine
                .as_ref()
                .is_some_and(StreamingEngine::in_forward)
    }
}

/// The hooks of `diffusers_group_offload` attached to one component.
///
/// All state sits behind one mutex; every hook leaves it consistent when it fails, so a
/// later [`AttachedRoute::detach`] (or drop) still frees everything.
pub struct AttachedGroupOffload {
    component: String,
    spec: RouteSpec,
    config: GroupOffloadConfig,
    streaming: StreamingConfig,
    device: Arc<dyn Device>,
    compute: Stream,
    metrics: Arc<RouteMetrics>,
    plan: GroupPlan,
    /// Every param of the component once, to leave them host-only on detach.
    params: Vec<Arc<Param>>,
    source: HostSource,
    state: Mutex<State>,
}

impl AttachedGroupOffload {
    /// The group plan.
    pub fn plan(&self) -> &GroupPlan {
        &self.plan
    }

    /// The effective settings (Diffusers' defaults applied).
    pub fn config(&self) -> GroupOffloadConfig {
        self.config
    }

    /// The streaming engine's settings (stream mode).
    pub fn streaming_config(&self) -> StreamingConfig {
        self.streaming
    }

    /// The learned order of group starts (stream mode, after the first forward), as
    /// indices into [`GroupPlan::groups`].
    pub fn schedule(&self) -> Option<Vec<usize>> {
        self.state.lock().schedule.order().map(<[usize]>::to_vec)
    }

    /// The streaming engine's figures (stream mode, once the schedule is learned).
    pub fn streaming_figures(&self) -> Option<StreamingFigures> {
        self.state
            .lock()
            .engine
            .as_ref()
            .map(|e| e.figures().clone())
    }

    /// Whether [`AttachedRoute::detach`] has run.
    pub fn is_detached(&self) -> bool {
        self.state.lock().detached
    }

    /// Pinned host bytes held in pinned copies or by the streaming engine (0 after
    /// detach).
    pub fn pinned_bytes(&self) -> u64 {
        let st = self.state.lock();
        st.pinned.as_ref().map_or(0, PinnedHome::bytes)
            + st.engine.as_ref().map_or(0, |e| e.figures().pinned_bytes)
    }

    fn live(&self) -> Result<MutexGuard<'_, State>> {
        let st = self.state.lock();
        if st.detached {
            return Err(CoreError::Detached {
                component: self.component.clone(),
            });
        }
        Ok(st)
    }

    fn group_for(&self, leaf: &Leaf) -> Result<Option<usize>> {
        let id = leaf.id().0;
        match (self.plan.leaf_group.get(id), self.plan.leaf_paths.get(id)) {
            (Some(g), Some(path)) if path == leaf.path() => Ok(*g),
            _ => Err(CoreError::Shape {
                what: format!("{ROUTE_NAME} hooks of `{}`", self.component),
                message: format!("leaf `{}` is not a leaf of this component", leaf.path()),
            }),
        }
    }

    /// Makes group `g` resident with copies queued on `stream` (one more hold of each of
    /// its params). On error nothing is added.
    fn acquire(&self, st: &mut State, g: usize, stream: &Stream) -> Result<()> {
        let device = &*self.device;
        let kind = self.source;
        // With an engine, where its registered mappings allow.
        let engine = st.engine.as_ref();
        let host = |p: &Param| -> Result<HostSlice> {
            engine.map_or_else(|| Ok(p.host()), |e| e.host_source(p))
        };
        let source = |p: &Param| -> Result<HostSlice> {
            match kind {
                HostSource::Pinned | HostSource::Own => host(p),
                HostSource::PinOnTheFly => Ok(pin_copy(device, &host(p)?)?.slice_all()),
            }
        };
        let started = Instant::now();
        let placed = st.table.acquire(
            device,
            &self.plan.groups[g].params,
            &source,
            stream,
            &self.metrics,
        );
        if kind == HostSource::Own {
            // Copies from pageable or mapped memory return only when done.
            self.metrics.record_copy_wait(started.elapsed());
        }
        placed
    }

    /// Drops one hold of each of group `g`'s params.
    fn release(&self, st: &mut State, g: usize, mode: FreeMode) {
        st.table.release(
            &*self.device,
            &self.plan.groups[g].params,
            mode,
            &self.compute,
        );
    }

    /// Frees a group compute has used: stream-ordered with `record_stream`, otherwise after
    /// synchronising the compute stream.
    fn release_after_use(&self, st: &mut State, g: usize) -> Result<()> {
        if self.config.record_stream {
            self.release(st, g, FreeMode::AfterComputeStream);
            return Ok(());
        }
        match self.device.synchronize_stream(&self.compute) {
            Ok(()) => {
                self.release(st, g, FreeMode::Immediate);
                Ok(())
            }
            Err(e) => {
                // Compute may still be reading: free in stream order instead.
                self.release(st, g, FreeMode::AfterComputeStream);
                Err(e)
            }
        }
    }

    /// The group in use is done: the engine moves on (use event, next unit queued), or
    /// the group is freed.
    fn offload_current(&self, st: &mut State) -> Result<()> {
        let Some(g) = st.current.take() else {
            return Ok(());
        };
        match st.position.take() {
            Some(pos) => match st.engine.as_mut() {
                Some(engine) => engine.leave(pos),
                None => Ok(()),
            },
            None => self.release_after_use(st, g),
        }
    }

    /// Synchronises the device and drops every onloaded group and the engine's ring.
    fn drop_transient(&self, st: &mut State) -> Result<()> {
        let engine = st.engine.as_mut().map_or(Ok(()), StreamingEngine::abort);
        let synced = self.device.synchronize();
        st.table
            .release_all(&*self.device, FreeMode::Immediate, &self.compute);
        st.current = None;
        st.position = None;
        st.unmatched_onloaded = false;
        st.schedule.abandon_forward();
        engine.and(synced)
    }

    /// Onloads `g` for immediate use outside the engine: on the compute stream without a
    /// copy stream; on the copy stream with compute ordered behind it by an event otherwise.
    fn onload_now(&self, st: &mut State, g: usize) -> Result<()> {
        let Some(copy) = st.copy_stream.clone() else {
            return self.acquire(st, g, &self.compute);
        };
        self.acquire(st, g, &copy)?;
        let ordered = self
            .device
            .record_event(&copy)
            .and_then(|event| self.device.wait_event(&self.compute, &event));
        if let Err(e) = ordered {
            let _ = self.device.synchronize_stream(&copy);
            self.release(st, g, FreeMode::Immediate);
            return Err(e);
        }
        Ok(())
    }

    /// Starts group `g` (not the unmatched one) in stream mode: on the engine while the
    /// forward follows the schedule; otherwise (learning, or after leaving the schedule,
    /// which hands the engine's device memory back first) by a direct onload.
    fn start_streamed(&self, st: &mut State, g: usize) -> Result<()> {
        let on_engine = st.engine.as_ref().is_some_and(StreamingEngine::in_forward);
        match st.schedule.start(g) {
            Some(pos) if on_engine => {
                if let Some(engine) = st.engine.as_mut() {
                    engine.enter(pos)?;
                }
                st.position = Some(pos);
            }
            _ => {
                if on_engine && let Some(engine) = st.engine.as_mut() {
                    // Left the schedule: the engine's params go back to host-only before
                    // the direct path installs its own copies.
                    engine.release_device()?;
                }
                self.onload_now(st, g)?;
            }
        }
        st.current = Some(g);
        Ok(())
    }

    /// Builds the streaming engine for the learned schedule (replacing an older one).
    fn build_engine(&self, st: &mut State) -> Result<()> {
        if let Some(mut old) = st.engine.take() {
            old.teardown()?;
        }
        let (Some(order), Some(copy)) = (st.schedule.order(), st.copy_stream.clone()) else {
            return Ok(());
        };
        let segments: Vec<Vec<Arc<Param>>> =
            self.plan.groups.iter().map(|g| g.params.clone()).collect();
        let mut config = self.streaming;
        config.budget = self
            .spec
            .options()
            .budget
            .map(|b| b.bytes_given_free(self.device.memory_info().free_bytes()));
        let engine = StreamingEngine::new(
            Arc::clone(&self.device),
            copy,
            &segments,
            order,
            &config,
            Arc::clone(&self.metrics),
        )?;
        let f = engine.figures();
        let resident: HashSet<ParamId> = engine.resident_params().iter().map(|p| p.id()).collect();
        let resident_groups: Vec<_> = self
            .plan
            .groups
            .iter()
            .filter(|g| !g.params.is_empty() && g.params.iter().all(|p| resident.contains(&p.id())))
            .collect();
        let resident_leaves = resident_groups
            .iter()
            .map(|g| g.leaves.len() as u64)
            .sum::<u64>();
        self.metrics.set_leaf_plan(
            self.plan.streamed_leaves().saturating_sub(resident_leaves),
            resident_leaves,
        );
        self.metrics
            .set_resident_leaves(resident_groups.iter().map(|g| g.label.clone()).collect());
        self.metrics.set_resident_weight_bytes(f.resident_bytes);
        f.publish(&self.metrics);
        st.engine = Some(engine);
        Ok(())
    }
}

impl AttachedRoute for AttachedGroupOffload {
    fn route(&self) -> RouteId {
        RouteId::DiffusersGroupOffload
    }

    fn describe(&self) -> String {
        self.spec.describe()
    }

    fn device_id(&self) -> DeviceId {
        self.device.id()
    }

    fn metrics(&self) -> &Arc<RouteMetrics> {
        &self.metrics
    }

    fn removable(&self) -> bool {
        false
    }

    fn before_forward(&self) -> Result<()> {
        let mut st = self.live()?;
        if st.holds_anything() {
            // A previous forward failed half-way: start clean.
            self.drop_transient(&mut st)?;
        }
        st.schedule.begin_forward();
        if let Some(u) = self.plan.unmatched {
            self.acquire(&mut st, u, &self.compute)?;
            st.unmatched_onloaded = true;
        }
        if st.copy_stream.is_some() && st.schedule.order().is_some() && st.engine.is_none() {
            self.build_engine(&mut st)?;
        }
        if let Some(engine) = st.engine.as_mut() {
            engine.begin_forward()?;
        }
        Ok(())
    }

    fn before_leaf(&self, leaf: &Leaf) -> Result<()> {
        let mut st = self.live()?;
        let Some(g) = self.group_for(leaf)? else {
            return Ok(());
        };
        if Some(g) == self.plan.unmatched {
            // A leaf of another group starts: the block group in use is done.
            self.offload_current(&mut st)?;
            if !st.unmatched_onloaded {
                self.acquire(&mut st, g, &self.compute)?;
                st.unmatched_onloaded = true;
            }
            return Ok(());
        }
        if st.current == Some(g) {
            return Ok(());
        }
        self.offload_current(&mut st)?;
        if st.copy_stream.is_some() {
            self.start_streamed(&mut st, g)
        } else {
            self.acquire(&mut st, g, &self.compute)?;
            st.current = Some(g);
            Ok(())
        }
    }

    fn after_leaf(&self, leaf: &Leaf) -> Result<()> {
        let mut st = self.live()?;
        let g = self.group_for(leaf)?;
        if self.config.offload_type == OffloadType::LeafLevel && g.is_some() && st.current == g {
            self.offload_current(&mut st)?;
        }
        Ok(())
    }

    fn after_forward(&self) -> Result<()> {
        let mut st = self.live()?;
        let current = self.offload_current(&mut st);
        let unmatched = match self.plan.unmatched {
            Some(u) if st.unmatched_onloaded => {
                st.unmatched_onloaded = false;
                self.release_after_use(&mut st, u)
            }
            _ => Ok(()),
        };
        let mut streamed = Ok(());
        if st.copy_stream.is_some() {
            // A forward that stopped early leaves queued units: the engine waits for them.
            let ended = st
                .engine
                .as_mut()
                .map_or(Ok(()), StreamingEngine::end_forward);
            streamed = match st.schedule.end_forward() {
                ScheduleOutcome::Followed => ended,
                ScheduleOutcome::Learned => ended.and_then(|()| self.build_engine(&mut st)),
                ScheduleOutcome::Relearned => {
                    self.metrics.record_schedule_relearned();
                    ended.and_then(|()| self.build_engine(&mut st))
                }
            };
        }
        current.and(unmatched).and(streamed)
    }

    fn end_phase(&self) -> Result<()> {
        let mut st = self.state.lock();
        if st.detached {
            return Ok(());
        }
        let transient = self.drop_transient(&mut st);
        let engine = st
            .engine
            .as_mut()
            .map_or(Ok(()), StreamingEngine::release_device);
        transient.and(engine)
    }

    fn detach(&self) -> Result<()> {
        let mut st = self.state.lock();
        if st.detached {
            return Ok(());
        }
        st.detached = true;
        let synced = self.drop_transient(&mut st);
        // The engine gives the params their host bytes back (in pageable memory when it
        // had made its pinned home their one copy).
        let engine = st.engine.take().map_or(Ok(()), |mut e| e.teardown());
        for p in &self.params {
            // Clearing a device copy cannot fail.
            let _ = p.set_device(None);
        }
        // Reverse order of attach: the pinned home (its params get pageable copies back),
        // then the copy stream. Every queued copy has finished (or holds its own handle to
        // the host bytes).
        let home = st.pinned.take().map_or(Ok(()), PinnedHome::restore);
        st.copy_stream = None;
        st.schedule.reset();
        self.metrics.set_pinned_host_bytes(0);
        synced.and(engine).and(home)
    }
}

impl Drop for AttachedGroupOffload {
    fn drop(&mut self) {
        // Errors are not reportable from drop; detach still frees everything it holds.
        let _ = self.detach();
    }
}

impl fmt::Debug for AttachedGroupOffload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("AttachedGroupOffload");
        d.field("component", &self.component)
            .field("spec", &self.spec.describe())
            .field("device", &self.device.id())
            .field("groups", &self.plan.len());
        // Never block (or deadlock) on the state to print it.
        match self.state.try_lock() {
            Some(st) => d
                .field("detached", &st.detached)
                .field("current", &st.current)
                .field("schedule", &st.schedule.order())
                .field("engine", &st.engine.as_ref().map(StreamingEngine::figures))
                .field("resident", &st.table),
            None => d.field("state", &"<in use>"),
        };
        d.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ddo_core::reference::{LeafSpec, ReferenceSpec, build};
    use ddo_core::{DType, OffloadType, RouteOptions, RouteTarget};

    fn config(offload_type: OffloadType, n: Option<usize>) -> GroupOffloadConfig {
        RouteSpec::new(
            RouteTarget::Route(RouteId::DiffusersGroupOffload),
            RouteOptions {
                offload_type: Some(offload_type),
                num_blocks_per_group: n,
                ..RouteOptions::default()
            },
        )
        .unwrap()
        .group_offload_config()
    }

    #[test]
    fn leaf_level_makes_one_group_per_leaf_with_params() {
        let spec = ReferenceSpec::small("vae", 3, 4, DType::F32);
        let c = build(&spec).unwrap();
        let plan = GroupPlan::new(&c, &config(OffloadType::LeafLevel, None));
        assert_eq!(plan.len(), c.leaves().len());
        assert_eq!(plan.unmatched(), None);
        for (i, leaf) in c.leaves().iter().enumerate() {
            assert_eq!(plan.group_of(leaf.id()), Some(i));
            assert_eq!(plan.groups()[i].label(), leaf.path());
            assert_eq!(plan.groups()[i].bytes(), leaf.param_bytes());
        }
        assert_eq!(plan.streamed_leaves(), c.leaves().len() as u64);
    }

    #[test]
    fn block_level_chunks_blocks_and_collects_the_rest_in_one_unmatched_group() {
        let spec = ReferenceSpec::small("transformer", 5, 4, DType::F16);
        let c = build(&spec).unwrap();
        let plan = GroupPlan::new(&c, &config(OffloadType::BlockLevel, Some(2)));
        // Blocks 0-1, 2-3, 4, plus the unmatched stem and head.
        assert_eq!(plan.len(), 4);
        let labels: Vec<&str> = plan.groups().iter().map(Group::label).collect();
        assert_eq!(
            labels,
            vec![
                UNMATCHED_LABEL,
                "blocks[0..=1]",
                "blocks[2..=3]",
                "blocks[4..=4]"
            ]
        );
        let u = plan.unmatched().unwrap();
        let stem = c.leaf_by_path("stem_0").unwrap().id();
        let head = c.leaf_by_path("head_1").unwrap().id();
        assert_eq!(plan.group_of(stem), Some(u));
        assert_eq!(plan.group_of(head), Some(u));
        assert_eq!(plan.groups()[1].leaves().len(), 4);
        assert_eq!(plan.param_total(), c.param_bytes());
    }

    #[test]
    fn tied_weights_count_once_per_group() {
        let mut spec = ReferenceSpec::small("transformer", 1, 4, DType::F32);
        spec.tie_head_to_stem = true;
        let c = build(&spec).unwrap();
        let block = GroupPlan::new(&c, &config(OffloadType::BlockLevel, Some(1)));
        let u = block.unmatched().unwrap();
        let tied = c.leaf_by_path("tied_proj").unwrap();
        assert_eq!(block.group_of(tied.id()), Some(u));
        assert_eq!(block.param_total(), c.param_bytes());
        let leaf = GroupPlan::new(&c, &config(OffloadType::LeafLevel, None));
        // The tied weight is in two leaf groups: one hold each, one copy at a time.
        assert_eq!(leaf.param_total(), c.param_bytes() + 4 * 4 * 4);
    }

    #[test]
    fn a_block_list_shorter_than_a_group_is_one_group() {
        let spec = ReferenceSpec {
            stem: vec![LeafSpec::linear(3)],
            blocks: vec![vec![LeafSpec::norm()]],
            head: vec![],
            ..ReferenceSpec::small("x", 0, 3, DType::F32)
        };
        let c = build(&spec).unwrap();
        let plan = GroupPlan::new(&c, &config(OffloadType::BlockLevel, Some(3)));
        assert_eq!(plan.len(), 2);
        assert_eq!(plan.groups()[1].label(), "blocks[0..=0]");
        assert_eq!(plan.largest_group_bytes(), 2 * 3 * 4);
        assert_eq!(plan.largest_groups_bytes(5), 2 * 3 * 4);
        assert_eq!(plan.unmatched_bytes(), (3 * 3 + 3) * 4);
    }

    struct NoProgram;

    impl ddo_core::ComponentProgram for NoProgram {
        fn forward(
            &self,
            _ctx: &mut ddo_core::ForwardContext<'_>,
            input: ddo_core::Tensor,
        ) -> Result<ddo_core::Tensor> {
            Ok(input)
        }
    }

    #[test]
    fn leaves_without_params_belong_to_no_group() {
        use ddo_core::{LeafKind, Module, ParamKind};
        let w =
            Param::from_f32("w", ParamKind::Parameter, DType::F32, vec![2], &[1.0, 2.0]).unwrap();
        let root = Module::container(
            "",
            vec![
                Module::leaf("act", LeafKind::Other, vec![]),
                Module::block_list(
                    "blocks",
                    vec![Module::container(
                        "0",
                        vec![
                            Module::leaf("lin", LeafKind::Linear, vec![("weight".into(), w)]),
                            Module::leaf("act", LeafKind::Other, vec![]),
                        ],
                    )],
                ),
            ],
        );
        let c = Component::new("x", "X", root, Arc::new(NoProgram)).unwrap();
        for (offload_type, n) in [
            (OffloadType::LeafLevel, None),
            (OffloadType::BlockLevel, Some(1)),
        ] {
            let plan = GroupPlan::new(&c, &config(offload_type, n));
            assert_eq!(plan.len(), 1, "{offload_type:?}");
            assert_eq!(plan.unmatched(), None);
            assert_eq!(plan.group_of(LeafId(0)), None);
            assert_eq!(plan.group_of(LeafId(1)), Some(0));
            assert_eq!(plan.group_of(LeafId(2)), None);
            assert_eq!(plan.streamed_leaves(), 1);
        }
    }

    impl GroupPlan {
        fn param_total(&self) -> u64 {
            self.groups.iter().map(|g| g.bytes).sum()
        }
    }
}
