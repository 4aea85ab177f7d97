//! The pipeline memory planner: one plan for the whole pipeline from a VRAM budget, the
//! phases (which components each runs, and its activation estimate) and each route's
//! [`Footprint`].
//!
//! Phases never hold each other's memory (a component is attached when its phase starts
//! and released at the boundary, [`PipelineOffload::begin_phase`](crate::PipelineOffload)),
//! so each phase is planned on its own against the whole budget. Within a phase the
//! components run one after another but stay attached together, so the phase's peak is
//!
//! ```text
//! activation + Σ resident bytes + max transient bytes (ring, largest group)
//! ```
//!
//! Components whose route was chosen by the caller (explicit route, component policy,
//! environment) or by a preset that plans nothing ([`preset_is_planned`]) are *fixed*:
//! their footprint is counted as it is. The others are *planned*, smallest first: each stays
//! fully resident (`none`) while that fits beside the fixed ones and the rings of the
//! components still to stream; the rest keep the preset's streamed route, and the largest
//! of them gets a `budget` of what is left, so its most costly leaves stay resident
//! (`resident + ring ≤ budget`, the streaming engine's own planner). A phase that cannot
//! fit even with nothing resident is refused with [`CoreError::BudgetTooSmall`], naming
//! the smallest budget that works. A plan never exceeds its budget: every phase's peak is
//! checked before the plan is returned (`tests/plan.rs` proves it on the host backend with
//! memory counted exactly).
//!
//! **Early uploads.** A planned streamed component keeps part of its weights resident; left
//! alone, its first forward uploads them, and that one-time upload is link time inside its
//! phase. Where the phase before has room for that part beside its own peak, the plan
//! uploads it during that phase instead ([`ComponentPlan::upload_during`]; the pipeline's
//! background attach queues it, [`PipelineOffload::prepare`](crate::PipelineOffload::prepare)),
//! and the phase before counts it in its peak ([`PhasePlan::early_upload_bytes`]). When the
//! phase before has no room but runs each of its components once ([`PhaseDemand::runs_once`]:
//! prompt encoding), it is planned again with that part taken off its budget: streaming a
//! component that runs one forward moves the same bytes over the link as uploading it, so
//! this costs that phase nothing and takes the upload out of the next.

use std::sync::Arc;

use ddo_core::resolve::{Environment, preset_is_planned, resolve};
use ddo_core::{
    Budget, Component, ComponentKind, CoreError, DecidedBy, Footprint, FootprintContext,
    HostBudget, Resolution, Result, RouteOptions, RouteSpec, RouteTarget, Settings,
};
use ddo_metrics::format_bytes;
use serde::Serialize;

use crate::pipeline::Pipeline;

pub mod host;

/// What a budget taken from the device's free memory leaves free: 1 GiB, for what other
/// processes and the CUDA context take after the figure is read, and the caching of other
/// components.
pub const DEFAULT_FREE_MARGIN: u64 = 1 << 30;

/// One phase as the planner sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PhaseDemand {
    /// The phase's name (`prompt_encoding`, `denoise`, `decode`).
    pub phase: String,
    /// The components it runs, by name.
    pub components: Vec<String>,
    /// Device bytes its activations and workspaces take at the requested size.
    pub activation_bytes: u64,
    /// Whether each of its components runs one forward (prompt encoding): streaming one then
    /// costs no more link bytes than uploading it, so the planner may stream them to make
    /// room for the next phase's resident weights (see the module docs).
    pub runs_once: bool,
}

/// What the planner is asked.
#[derive(Debug, Clone)]
pub struct PlanRequest {
    /// Device bytes DDO may use.
    pub budget_bytes: u64,
    /// Where the budget came from, in words (`--vram-budget`, `free memory less 1 GiB`).
    pub budget_source: String,
    /// The phases, in order.
    pub phases: Vec<PhaseDemand>,
    /// The device's pinned room, streams and allocator (free bytes are taken from the
    /// budget).
    pub context: FootprintContext,
    /// The host budget each phase's pinned and working memory stays within ([`host`]);
    /// `None` plans the device only (pinned memory is then bounded by the pinned room).
    pub host_budget: Option<HostBudget>,
}

/// The plan of one component.
#[derive(Debug, Clone)]
pub struct ComponentPlan {
    /// The component's name.
    pub component: String,
    /// The phase it runs in.
    pub phase: String,
    /// The route it attaches with (the planner's choice when `planned`).
    pub resolution: Resolution,
    /// Whether the planner chose the route (else it was fixed by the caller or the preset).
    pub planned: bool,
    /// What the route will hold.
    pub footprint: Footprint,
    /// Why, in one line.
    pub reason: String,
    /// The phase during which the weights its route keeps resident are uploaded, when that
    /// is the phase before its own (early upload, see the module docs); `None`: its first
    /// forward uploads them.
    pub upload_during: Option<String>,
    /// The phase during which it may be attached in the background
    /// ([`PipelineOffload::prepare`](crate::PipelineOffload::prepare), which the pipeline
    /// calls for the phase after prompt encoding): the phase before its own when its route
    /// takes no device memory at attach; its pinned memory is counted in that phase too.
    /// `None`: attached when its phase begins (the host plan may take it back, [`host`]).
    pub prepare_during: Option<String>,
}

/// The plan of one phase.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PhasePlan {
    /// The phase.
    pub phase: String,
    /// Its components.
    pub components: Vec<String>,
    /// Activation estimate, bytes.
    pub activation_bytes: u64,
    /// Weight bytes kept on the device through the phase.
    pub resident_bytes: u64,
    /// The largest transient weight bytes (ring or group) of one component.
    pub transient_bytes: u64,
    /// Weight bytes streamed per forward, over the phase's components.
    pub streamed_bytes_per_forward: u64,
    /// Pinned host bytes the phase's routes hold (with those of a component uploaded early).
    pub pinned_host_bytes: u64,
    /// Resident weights of the next phase's components uploaded during this phase.
    pub early_upload_bytes: u64,
    /// `activation + resident + transient + early uploads`: at most the budget.
    pub peak_bytes: u64,
    /// Staged weight bytes whose pages the phase keeps in the page cache between forwards
    /// ([`Footprint::cached_staged_bytes`](ddo_core::Footprint::cached_staged_bytes)).
    pub page_cache_bytes: u64,
    /// Weight bytes read from the disk again every forward (the staged bytes past each
    /// route's `page_cache_limit`).
    pub disk_bytes_per_forward: u64,
    /// Host memory the phase makes the machine hold: the process's working memory
    /// ([`HOST_WORKING_BYTES`](ddo_core::host_budget::HOST_WORKING_BYTES)) plus the pinned
    /// bytes of its routes and of the components attached in the background meanwhile,
    /// plus the staged pages it keeps cached; at most the host budget when one was planned
    /// for.
    pub host_bytes: u64,
}

/// One memory plan for a pipeline.
#[derive(Debug, Clone)]
pub struct PipelinePlan {
    /// The budget planned for, bytes.
    pub budget_bytes: u64,
    /// Where it came from.
    pub budget_source: String,
    /// Every component, in the order of the phases.
    pub components: Vec<ComponentPlan>,
    /// Every phase.
    pub phases: Vec<PhasePlan>,
    /// The host budget planned for, if any.
    pub host_budget: Option<HostBudget>,
}

impl PipelinePlan {
    /// The plan with `timeline=true` on every component whose route streams through the
    /// streaming engine (`ddo run --timeline`): each such route's metrics then keep its
    /// first and last forward's timeline. Only the routes' recording changes: the routes,
    /// footprints and phases stay as planned (a timeline records events, it holds no
    /// weights). Components whose route takes no `timeline` option (resident, grouped
    /// without a stream, eager offload) are left as they are.
    pub fn with_timelines(mut self) -> Result<Self> {
        use ddo_core::RouteCatalog;
        for c in &mut self.components {
            let spec = c.resolution.spec;
            let Some(id) = spec.route_id() else {
                continue;
            };
            let takes = crate::Catalog
                .options_of(id)
                .is_some_and(|names| names.contains(&"timeline"));
            let streams = crate::effective_options(&spec)
                .iter()
                .all(|o| o.name != "use_stream" || o.value == ddo_core::OptionValue::Flag(true));
            if takes && streams && c.footprint.streamed_bytes_per_forward > 0 {
                c.resolution.spec = RouteSpec::new(
                    spec.target(),
                    RouteOptions {
                        timeline: Some(true),
                        ..*spec.options()
                    },
                )?;
            }
        }
        Ok(self)
    }

    /// The plan of component `name`.
    pub fn component(&self, name: &str) -> Option<&ComponentPlan> {
        self.components.iter().find(|c| c.component == name)
    }

    /// Whether a released component's host memory goes back at once (its registrations
    /// unpinned, its mapped pages dropped from the process) rather than staying pinned for
    /// reuse: when a host budget was planned for and it cannot hold every phase's pinned
    /// memory at once.
    pub fn gives_host_back(&self) -> bool {
        self.host_budget.is_some_and(|h| {
            let all: u64 = self.phases.iter().map(|p| p.pinned_host_bytes).sum();
            all > h.pinned_room()
        })
    }

    /// The plan as text: one line for the budget, one per phase, one per component.
    pub fn format_text(&self) -> String {
        let mut out = format!(
            "memory plan: budget {} ({})\n",
            format_bytes(self.budget_bytes),
            self.budget_source
        );
        if let Some(h) = &self.host_budget {
            out.push_str(&format!(
                "  host budget {} ({}): pinned memory and {} of working memory per phase\n",
                format_bytes(h.bytes),
                h.source,
                format_bytes(ddo_core::host_budget::HOST_WORKING_BYTES)
            ));
        }
        for p in &self.phases {
            let early = if p.early_upload_bytes > 0 {
                format!(" + early uploads {}", format_bytes(p.early_upload_bytes))
            } else {
                String::new()
            };
            let mut tiers = String::new();
            if p.page_cache_bytes > 0 {
                tiers.push_str(&format!(
                    ", page cache {}",
                    format_bytes(p.page_cache_bytes)
                ));
            }
            if p.disk_bytes_per_forward > 0 {
                tiers.push_str(&format!(
                    ", disk {}/forward",
                    format_bytes(p.disk_bytes_per_forward)
                ));
            }
            out.push_str(&format!(
                "  {:<16} peak {:>10} = activations {} + resident {} + transient {}{early}; streamed {}/forward, pinned {}{tiers}, host {}\n",
                p.phase,
                format_bytes(p.peak_bytes),
                format_bytes(p.activation_bytes),
                format_bytes(p.resident_bytes),
                format_bytes(p.transient_bytes),
                format_bytes(p.streamed_bytes_per_forward),
                format_bytes(p.pinned_host_bytes),
                format_bytes(p.host_bytes),
            ));
            for c in self.components.iter().filter(|c| c.phase == p.phase) {
                let early = c.upload_during.as_ref().map_or_else(String::new, |during| {
                    format!(
                        "; its {} resident part is uploaded during {during}",
                        format_bytes(c.footprint.resident_bytes)
                    )
                });
                out.push_str(&format!(
                    "    {}: {} ({}) - {}{early}\n",
                    c.component,
                    c.resolution.spec.describe(),
                    c.footprint.summary,
                    c.reason
                ));
            }
        }
        out
    }

    /// The plan as JSON.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "budget_bytes": self.budget_bytes,
            "budget_source": self.budget_source,
            "host_budget_bytes": self.host_budget.map(|h| h.bytes),
            "host_budget_source": self.host_budget.map(|h| h.source.to_string()),
            "phases": self.phases,
            "components": self.components.iter().map(|c| serde_json::json!({
                "component": c.component,
                "phase": c.phase,
                "route": c.resolution.spec.describe(),
                "decided_by": c.resolution.decided_by.to_string(),
                "planned": c.planned,
                "footprint": c.footprint,
                "reason": c.reason,
                "upload_during": c.upload_during,
                "prepare_during": c.prepare_during,
            })).collect::<Vec<_>>(),
        })
    }
}

/// The footprint of `spec` for `component` (resident/unmanaged targets count as resident).
pub fn footprint(
    component: &Component,
    spec: &RouteSpec,
    context: &FootprintContext,
) -> Result<Footprint> {
    match spec.target() {
        RouteTarget::Unmanaged => Ok(Footprint::resident(component.param_bytes())),
        RouteTarget::Route(id) => crate::route(id)?.footprint(component, spec, context),
    }
}

#[derive(Clone)]
struct Candidate<'a> {
    component: &'a Arc<Component>,
    resolution: Resolution,
}

/// Plans `pipeline` under `settings` (presets, policies; explicit routes in `explicit`,
/// by component name) for `request`. Pure: reads the environment only through `env` (and
/// only with `settings.use_environment`), and attaches nothing. [`resolve_pipeline`] then
/// [`plan_resolved`]: each component is resolved once.
pub fn plan_pipeline(
    pipeline: &Pipeline,
    settings: &Settings,
    explicit: &[(String, RouteSpec)],
    env: &dyn Environment,
    request: &PlanRequest,
) -> Result<PipelinePlan> {
    let names: Vec<&str> = request
        .phases
        .iter()
        .flat_map(|d| d.components.iter().map(String::as_str))
        .filter(|n| pipeline.get(n).is_some())
        .collect();
    let resolutions = resolve_pipeline(&names, settings, explicit, env)?;
    plan_resolved(pipeline, &resolutions, request)
}

/// Resolves each of `names` once (explicit routes in `explicit`, by component name), in
/// order: what [`plan_resolved`] takes. Pure, as [`resolve`].
pub fn resolve_pipeline(
    names: &[&str],
    settings: &Settings,
    explicit: &[(String, RouteSpec)],
    env: &dyn Environment,
) -> Result<Vec<(String, Resolution)>> {
    names
        .iter()
        .map(|name| {
            let given = explicit.iter().find(|(n, _)| n == name).map(|(_, s)| s);
            Ok((
                name.to_string(),
                resolve(settings, name, given, env, &crate::Catalog)?,
            ))
        })
        .collect()
}

/// Plans `pipeline` for `request` from resolutions already made (`resolutions`, by
/// component name: [`resolve_pipeline`], or the caller's own), resolving nothing: a fixed
/// component's plan carries its resolution unchanged, a planned one (a preset default the
/// planner sizes, [`preset_is_planned`]) its resolution with the planner's spec and
/// [`DecidedBy::MemoryPlan`] of the same preset. A component that a phase runs and
/// `resolutions` lacks is refused.
pub fn plan_resolved(
    pipeline: &Pipeline,
    resolutions: &[(String, Resolution)],
    request: &PlanRequest,
) -> Result<PipelinePlan> {
    let budget = request.budget_bytes;
    let mut seen = Vec::new();
    // Each phase's candidates: fixed (counted as given) and planned.
    let mut candidates = Vec::new();
    for demand in &request.phases {
        let mut fixed = Vec::new();
        let mut planned = Vec::new();
        for name in &demand.components {
            let Some(component) = pipeline.get(name) else {
                continue;
            };
            if seen.contains(name) {
                return Err(CoreError::InvalidOption {
                    option: "phases".into(),
                    value: name.clone(),
                    hint: "a component runs in one phase; list it once".into(),
                });
            }
            seen.push(name.clone());
            let Some((_, resolution)) = resolutions.iter().find(|(n, _)| n == name) else {
                return Err(CoreError::InvalidOption {
                    option: "resolutions".into(),
                    value: name.clone(),
                    hint: "resolve every component the phases run (resolve_pipeline)".into(),
                });
            };
            // A budget that leaves nothing of what is free is refused before any
            // footprint, as the attach would refuse it.
            crate::check_route_budget(name, &resolution.spec, request.context.free_device_bytes)?;
            let candidate = Candidate {
                component,
                resolution: resolution.clone(),
            };
            if candidate.resolution.decided_by.is_preset_default()
                && preset_is_planned(candidate.resolution.preset, &ComponentKind::from_name(name))
            {
                planned.push(candidate);
            } else {
                fixed.push(candidate);
            }
        }
        candidates.push((fixed, planned));
    }
    let mut planned_phases = Vec::new();
    // Every phase is planned, so that a refusal names the budget the whole plan needs: the
    // largest of the phases' least needs (each phase is planned on its own against the
    // budget), not the first phase's.
    let mut refusal: Option<CoreError> = None;
    for (demand, (fixed, planned)) in request.phases.iter().zip(&candidates) {
        match plan_phase(
            demand,
            budget,
            request.context,
            fixed.clone(),
            planned.clone(),
        ) {
            Ok(p) => planned_phases.push(p),
            Err(e @ CoreError::BudgetTooSmall { .. }) => {
                let need = |e: &CoreError| match e {
                    CoreError::BudgetTooSmall { needed, .. } => *needed,
                    _ => 0,
                };
                if refusal.as_ref().is_none_or(|r| need(&e) > need(r)) {
                    refusal = Some(e);
                }
            }
            Err(e) => return Err(e),
        }
    }
    if let Some(e) = refusal {
        return Err(e);
    }
    for k in 1..planned_phases.len() {
        plan_early_upload(request, &candidates, &mut planned_phases, k);
        let before = planned_phases[k - 1].0.phase.clone();
        for c in &mut planned_phases[k].1 {
            if !c.footprint.attaches_on_device {
                c.prepare_during = Some(before.clone());
            }
        }
    }
    host::count_host(&mut planned_phases);
    if let Some(h) = request.host_budget {
        host::plan_host(pipeline, &h, &request.context, &mut planned_phases)?;
    }
    let mut components = Vec::new();
    let mut phases = Vec::new();
    for (phase, mut plans) in planned_phases {
        phases.push(phase);
        components.append(&mut plans);
    }
    Ok(PipelinePlan {
        budget_bytes: budget,
        budget_source: request.budget_source.clone(),
        components,
        phases,
        host_budget: request.host_budget,
    })
}

/// The early upload into phase `k - 1` of phase `k`'s planned components whose streamed
/// route keeps a resident part and attaches host-only (see the module docs): counted in
/// phase `k - 1` as it stands when that fits the budget (and the pinned room, since both
/// phases' routes then hold their host memory at once), else in phase `k - 1` planned again
/// with that part off its budget when it runs its components once; otherwise left to the
/// first forward.
fn plan_early_upload(
    request: &PlanRequest,
    candidates: &[(Vec<Candidate<'_>>, Vec<Candidate<'_>>)],
    phases: &mut [(PhasePlan, Vec<ComponentPlan>)],
    k: usize,
) {
    let budget = request.budget_bytes;
    let early: Vec<usize> = phases[k]
        .1
        .iter()
        .enumerate()
        .filter(|(_, c)| {
            c.planned
                && c.footprint.resident_bytes > 0
                && c.footprint.streamed_bytes_per_forward > 0
                && !c.footprint.attaches_on_device
        })
        .map(|(i, _)| i)
        .collect();
    let bytes: u64 = early
        .iter()
        .map(|&i| phases[k].1[i].footprint.resident_bytes)
        .sum();
    let pinned: u64 = early
        .iter()
        .map(|&i| phases[k].1[i].footprint.pinned_host_bytes)
        .sum();
    if bytes == 0 {
        return;
    }
    let fits = |phase: &PhasePlan| {
        phase.peak_bytes.saturating_add(bytes) <= budget
            && phase.pinned_host_bytes.saturating_add(pinned) <= request.context.pinned_room
    };
    if !fits(&phases[k - 1].0) {
        let demand = &request.phases[k - 1];
        if !demand.runs_once {
            return;
        }
        let (fixed, planned) = &candidates[k - 1];
        let Ok(replanned) = plan_phase(
            demand,
            budget.saturating_sub(bytes),
            request.context,
            fixed.clone(),
            planned.clone(),
        ) else {
            return;
        };
        if !fits(&replanned.0) {
            return;
        }
        phases[k - 1] = replanned;
    }
    let before = phases[k - 1].0.phase.clone();
    let prev = &mut phases[k - 1].0;
    prev.early_upload_bytes = bytes;
    prev.peak_bytes += bytes;
    // Its pinned bytes are counted with the phase's background attaches (`host::count_host`).
    for i in early {
        phases[k].1[i].upload_during = Some(before.clone());
    }
}

fn plan_phase(
    demand: &PhaseDemand,
    budget: u64,
    context: FootprintContext,
    fixed: Vec<Candidate<'_>>,
    mut planned: Vec<Candidate<'_>>,
) -> Result<(PhasePlan, Vec<ComponentPlan>)> {
    let activation = demand.activation_bytes;
    let room = budget.saturating_sub(activation);
    let ctx = context.with_free(room);
    let mut plans: Vec<ComponentPlan> = Vec::new();
    let (mut fixed_resident, mut fixed_transient) = (0u64, 0u64);
    let mut largest_need = (String::new(), 0u64);
    for c in fixed {
        let f = footprint(c.component, &c.resolution.spec, &ctx)?;
        fixed_resident += f.resident_bytes;
        fixed_transient = fixed_transient.max(f.transient_device_bytes);
        if f.peak_device_bytes() > largest_need.1 {
            largest_need = (c.component.name().to_string(), f.peak_device_bytes());
        }
        let reason = format!("{}: counted as given", c.resolution.decided_by);
        plans.push(ComponentPlan {
            component: c.component.name().to_string(),
            phase: demand.phase.clone(),
            resolution: c.resolution,
            planned: false,
            footprint: f,
            reason,
            upload_during: None,
            prepare_during: None,
        });
    }
    // Planned: smallest first; each one's zero-budget stream footprint is its least need.
    planned.sort_by_key(|c| c.component.param_bytes());
    for c in &mut planned {
        c.resolution.spec = with_planned_units(&c.resolution.spec, c.component.param_bytes())?;
    }
    let streamed_least: Vec<Footprint> = planned
        .iter()
        .map(|c| footprint(c.component, &c.resolution.spec, &ctx))
        .collect::<Result<_>>()?;
    for (c, f) in planned.iter().zip(&streamed_least) {
        if f.transient_device_bytes > largest_need.1 {
            largest_need = (c.component.name().to_string(), f.transient_device_bytes);
        }
    }
    // The most that can stay resident: the first `j` planned resident, the rest streamed.
    let fits = |j: usize| {
        let resident: u64 = planned[..j].iter().map(|c| c.component.param_bytes()).sum();
        let transient = streamed_least[j..]
            .iter()
            .map(|f| f.transient_device_bytes)
            .max()
            .unwrap_or(0)
            .max(fixed_transient);
        activation
            .saturating_add(fixed_resident)
            .saturating_add(resident)
            .saturating_add(transient)
            <= budget
    };
    let Some(keep) = (0..=planned.len()).rev().find(|&j| fits(j)) else {
        let least_transient = streamed_least
            .iter()
            .map(|f| f.transient_device_bytes)
            .max()
            .unwrap_or(0)
            .max(fixed_transient);
        let needed = activation
            .saturating_add(fixed_resident)
            .saturating_add(least_transient);
        return Err(too_small(
            demand,
            budget,
            needed,
            &largest_need.0,
            activation,
            fixed_resident,
            least_transient,
        ));
    };
    let resident_planned: u64 = planned[..keep]
        .iter()
        .map(|c| c.component.param_bytes())
        .sum();
    let streamed_count = planned.len() - keep;
    for (i, (c, least)) in planned.into_iter().zip(streamed_least).enumerate() {
        let name = c.component.name().to_string();
        let weight = c.component.param_bytes();
        let (spec, f, reason) = if i < keep {
            let spec = RouteSpec::resident();
            let f = footprint(c.component, &spec, &ctx)?;
            (
                spec,
                f,
                format!(
                    "fits: {} of weights resident beside {} of activations",
                    format_bytes(weight),
                    format_bytes(activation)
                ),
            )
        } else if i + 1 == keep + streamed_count {
            // The largest streamed one gets what is left as its budget, beside the
            // largest transient of the components planned before it and the fixed ones.
            let others = plans
                .iter()
                .map(|p| p.footprint.transient_device_bytes)
                .max()
                .unwrap_or(0);
            let left = budget
                .saturating_sub(activation)
                .saturating_sub(fixed_resident)
                .saturating_sub(resident_planned)
                .saturating_sub(others);
            budgeted(c.component, &c.resolution.spec, &ctx, left, least, weight)?
        } else {
            let reason = format!(
                "does not fit beside the rest: streamed with no resident weights ({} ring)",
                format_bytes(least.transient_device_bytes)
            );
            (c.resolution.spec, least, reason)
        };
        let resolution = Resolution {
            spec,
            decided_by: DecidedBy::MemoryPlan(c.resolution.preset),
            ..c.resolution
        };
        plans.push(ComponentPlan {
            component: name,
            phase: demand.phase.clone(),
            resolution,
            planned: true,
            footprint: f,
            reason,
            upload_during: None,
            prepare_during: None,
        });
    }
    let resident: u64 = plans.iter().map(|p| p.footprint.resident_bytes).sum();
    let transient = plans
        .iter()
        .map(|p| p.footprint.transient_device_bytes)
        .max()
        .unwrap_or(0);
    let peak = activation
        .saturating_add(resident)
        .saturating_add(transient);
    if peak > budget {
        // The plan's own check: never hand out a plan above its budget.
        return Err(too_small(
            demand,
            budget,
            peak,
            &largest_need.0,
            activation,
            resident,
            transient,
        ));
    }
    let phase = PhasePlan {
        phase: demand.phase.clone(),
        components: plans.iter().map(|p| p.component.clone()).collect(),
        activation_bytes: activation,
        resident_bytes: resident,
        transient_bytes: transient,
        streamed_bytes_per_forward: plans
            .iter()
            .map(|p| p.footprint.streamed_bytes_per_forward)
            .sum(),
        pinned_host_bytes: plans.iter().map(|p| p.footprint.pinned_host_bytes).sum(),
        early_upload_bytes: 0,
        peak_bytes: peak,
        page_cache_bytes: 0,
        disk_bytes_per_forward: 0,
        host_bytes: 0,
    };
    Ok((phase, plans))
}

/// The transfer unit of a planned streamed component of 2 GiB or more. A copy pays a fixed
/// cost on the link, so small units copy slower: in a steady streamed FLUX.1-dev forward on
/// one H100 (route timeline, 16 MiB units), its 269 units of 18.9 MB (the attention
/// projections, one leaf a unit) ran at 54.3 GB/s against 55.1 GB/s for its 57-76 MB ones,
/// 1.4 ms of a 237 ms step. At 64 MiB three projections share a unit; the ring does not
/// grow while a streamed leaf is larger than a unit (FLUX.1-dev's feed-forwards, 75.5 MB).
pub const PLANNED_LARGE_UNIT_BYTES: u64 = 64 << 20;

/// Transfer units for a planned streamed route: 1/32 of the component's weights, at least
/// one aligned param slot and at most [`PLANNED_LARGE_UNIT_BYTES`], so a small component's
/// ring (two units) holds less than the component itself and a large one's copies are
/// large. A `unit_bytes` the spec gives is kept.
fn with_planned_units(spec: &RouteSpec, weight_bytes: u64) -> Result<RouteSpec> {
    use ddo_core::streaming::DEFAULT_UNIT_BYTES;
    if spec.options().unit_bytes.is_some() || spec.options().use_stream != Some(true) {
        return Ok(*spec);
    }
    let unit = planned_unit_bytes(weight_bytes);
    if unit == DEFAULT_UNIT_BYTES {
        return Ok(*spec);
    }
    RouteSpec::new(
        spec.target(),
        RouteOptions {
            unit_bytes: Some(unit),
            ..*spec.options()
        },
    )
}

/// [`with_planned_units`]' unit for a component of `weight_bytes`.
fn planned_unit_bytes(weight_bytes: u64) -> u64 {
    (weight_bytes / 32).clamp(ddo_core::streaming::PARAM_ALIGN, PLANNED_LARGE_UNIT_BYTES)
}

/// The streamed route with a budget of `left` bytes (resident + ring within it), or with
/// no budget when `left` keeps nothing resident.
fn budgeted(
    component: &Component,
    spec: &RouteSpec,
    ctx: &FootprintContext,
    left: u64,
    least: Footprint,
    weight: u64,
) -> Result<(RouteSpec, Footprint, String)> {
    if left > 0 {
        let with_budget = RouteSpec::new(
            spec.target(),
            RouteOptions {
                budget: Some(Budget::Bytes(left)),
                ..*spec.options()
            },
        )?;
        let f = footprint(component, &with_budget, ctx)?;
        if f.resident_bytes > 0 && f.peak_device_bytes() <= left {
            let reason = format!(
                "{} of weights do not fit: {} resident under a budget of {}, {} streamed per forward",
                format_bytes(weight),
                format_bytes(f.resident_bytes),
                format_bytes(left),
                format_bytes(f.streamed_bytes_per_forward)
            );
            return Ok((with_budget, f, reason));
        }
    }
    let reason = format!(
        "{} of weights do not fit and the budget leaves no room beside the {} ring: all streamed",
        format_bytes(weight),
        format_bytes(least.transient_device_bytes)
    );
    Ok((*spec, least, reason))
}

fn too_small(
    demand: &PhaseDemand,
    budget: u64,
    needed: u64,
    component: &str,
    activation: u64,
    resident: u64,
    transient: u64,
) -> CoreError {
    // Round the figure up to a MiB so that giving it back as a budget works.
    let needed = needed.div_ceil(1 << 20).saturating_mul(1 << 20);
    let component = if component.is_empty() {
        demand.components.first().cloned().unwrap_or_default()
    } else {
        component.to_string()
    };
    CoreError::BudgetTooSmall {
        phase: demand.phase.clone(),
        advice: budget_advice(&component, activation, resident),
        component,
        budget,
        needed,
        detail: format!(
            "activations {} + resident weights {} + the largest ring or group {}",
            format_bytes(activation),
            format_bytes(resident),
            format_bytes(transient)
        ),
    }
}

fn budget_advice(component: &str, activation: u64, resident: u64) -> String {
    let mut ways = Vec::new();
    if activation > 0 {
        ways.push("ask for less: a smaller --height/--width or fewer --num-images".to_string());
    }
    if resident > 0 && !component.is_empty() {
        ways.push(format!(
            "use routes that hold less (e.g. --route {component}=diffusers_group_offload:use_stream=true)"
        ));
    }
    ways.join(", or ")
}

#[cfg(test)]
mod unit_tests {
    use super::*;

    /// Planned units: 1/32 of the weights between one aligned slot and 64 MiB (FLUX.1-dev's
    /// 23.8 GB transformer and 9.5 GB T5 take 64 MiB, a 1 GiB component 32 MiB, CLIP-L's
    /// 246 MB 7.7 MB); a given `unit_bytes`, and a route that does not stream, keep theirs.
    #[test]
    fn planned_units_follow_the_component_size_up_to_64_mib() {
        use ddo_core::streaming::PARAM_ALIGN;
        assert_eq!(planned_unit_bytes(23_800_000_000), 64 << 20);
        assert_eq!(planned_unit_bytes(9_500_000_000), 64 << 20);
        assert_eq!(planned_unit_bytes(2 << 30), 64 << 20);
        assert_eq!(planned_unit_bytes(1 << 30), 32 << 20);
        assert_eq!(planned_unit_bytes(246_144_000), 246_144_000 / 32);
        assert_eq!(planned_unit_bytes(1000), PARAM_ALIGN);
        let stream = crate::parse_spec("diffusers_group_offload:use_stream=true").unwrap();
        let planned = with_planned_units(&stream, 23_800_000_000).unwrap();
        assert_eq!(planned.options().unit_bytes, Some(64 << 20));
        let given =
            crate::parse_spec("diffusers_group_offload:use_stream=true,unit_bytes=8MiB").unwrap();
        assert_eq!(
            with_planned_units(&given, 23_800_000_000)
                .unwrap()
                .options()
                .unit_bytes,
            Some(8 << 20)
        );
        let plain = crate::parse_spec("diffusers_group_offload").unwrap();
        assert_eq!(
            with_planned_units(&plain, 23_800_000_000)
                .unwrap()
                .options()
                .unit_bytes,
            None
        );
    }
}
