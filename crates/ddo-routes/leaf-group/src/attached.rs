//! The hooks attached to one component ([`AttachedGroupOffload`]): how
//! [`GroupOffloadRoute::attach_group_offload`] builds them, their state, the onloads and
//! frees around each leaf, and the streaming engine they run once the schedule is learned.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use ddo_core::residency::{FreeMode, ResidencyTable, pin_copy};
use ddo_core::streaming::plan::plan_residency_with;
use ddo_core::streaming::{
    PinnedHome, Schedule, ScheduleOutcome, StreamingConfig, StreamingEngine, StreamingFigures,
    ring_does_not_fit,
};
use ddo_core::{
    AttachedRoute, Budget, Component, CoreError, Device, DeviceId, HostSlice, Leaf, OffloadType,
    Param, ParamId, Result, RouteId, RouteSpec, Stream,
};
use ddo_metrics::RouteMetrics;
use parking_lot::{Mutex, MutexGuard};

use crate::config::GroupOffloadConfig;
use crate::{GroupOffloadRoute, GroupPlan, ROUTE_NAME, streaming_config, streaming_config_for};

/// The engine's refusal of the bytes a `free-M` budget left, restated as the budget given
/// (the margin and what it leaves): the user never wrote those bytes.
fn budget_as_given(e: CoreError, given: Option<Budget>, free: u64) -> CoreError {
    match (e, given) {
        (CoreError::InvalidOption { option, hint, .. }, Some(b @ Budget::FreeMinus(_)))
            if option == "budget" =>
        {
            CoreError::InvalidOption {
                option,
                value: b.given_text(),
                hint: match b.leaves_given_free(free) {
                    Some(leaves) => format!("it {leaves}; {hint}"),
                    None => hint,
                },
            }
        }
        (e, _) => e,
    }
}

impl GroupOffloadRoute {
    /// [`Route::attach`](ddo_core::Route::attach), returning the concrete hooks (for callers that want to inspect
    /// the group plan or the learned schedule). Does not install them in the component.
    pub fn attach_group_offload(
        &self,
        component: &Arc<Component>,
        device: Arc<dyn Device>,
        spec: &RouteSpec,
        metrics: Arc<RouteMetrics>,
    ) -> Result<Arc<AttachedGroupOffload>> {
        let config = GroupOffloadConfig::from_spec(spec);
        let plan = GroupPlan::new(component, &config);
        let params = component.params();
        // A stream-mode budget must hold the streaming engine's ring beside whatever it
        // keeps resident: refuse now rather than after the learning forward.
        if let (true, Some(given)) = (config.use_stream, spec.options().budget) {
            let streaming = streaming_config_for(spec, component);
            let free = device.memory_info().free_bytes();
            let weighted = plan.engine_segments();
            let model = streaming.slot_model();
            let ring_plan = plan_residency_with(&weighted, given.bytes_given_free(free), model);
            if !ring_plan.fits() {
                return Err(ring_does_not_fit(
                    given,
                    free,
                    ring_plan.slot_bytes,
                    model.slots,
                ));
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
            streaming: streaming_config_for(spec, component),
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
        let given = self.spec.options().budget;
        let free = self.device.memory_info().free_bytes();
        config.budget = given.map(|b| b.bytes_given_free(free));
        let engine = StreamingEngine::new(
            Arc::clone(&self.device),
            copy,
            &segments,
            order,
            &config,
            Arc::clone(&self.metrics),
        )
        .map_err(|e| budget_as_given(e, given, free))?;
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
        RouteId::DIFFUSERS_GROUP_OFFLOAD
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

    /// The streaming engine's resident part (stream mode under a budget), queued on the
    /// copy stream ([`StreamingEngine::upload_resident`]).
    fn upload_resident(&self) -> Result<u64> {
        let mut st = self.live()?;
        match st.engine.as_mut() {
            Some(engine) => engine.upload_resident(),
            None => Ok(0),
        }
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
