//! The host side of the memory plan (issue 35): every phase's pinned memory plus the
//! process's working memory within a [`HostBudget`].
//!
//! A phase makes the machine hold (the transient pages of a one-time read, an upload or the
//! read-ahead window, aside):
//!
//! ```text
//! host = HOST_WORKING_BYTES + Σ pinned bytes of its routes
//!                           + Σ staged bytes of its routes whose pages stay cached
//!                           + Σ pinned bytes of the next phase's components attached meanwhile
//! ```
//!
//! where a streamed route's pinned bytes are its registered ranges or pinned home (with the
//! resident part's ranges, registered for their one upload, when they fit beside it) or its
//! two staging buffers ([`ddo_core::Footprint::pinned_host_bytes`]). When a phase's host bytes pass
//! the budget the planner gives memory back in the order that costs least time:
//!
//! 1. the next phase's background attach (and with it the early upload of its resident
//!    part) is left to that phase's own start: a few hundred milliseconds of link time
//!    moved, no step slower;
//! 2. the phase's planned streamed routes, the one pinning the most first, get a
//!    `pinned_limit` of what the others leave: the streamed part stays page-locked and the
//!    resident part is uploaded from pageable memory; where the streamed part does not fit
//!    either, `pinned=false`, two staging buffers filled from the mapping for every
//!    forward;
//! 3. the staged bytes whose pages do not fit beside the pinned ones get a
//!    `page_cache_limit` of what is left: the pages past it go back after each copy and
//!    are read from the disk again for every forward (the disk tier,
//!    [`ddo_core::streaming::staged_read`]), so that the process never makes the machine
//!    hold them all.
//!
//! A phase that still does not fit, each planned route at its least (staging buffers) and the
//! fixed ones counted as given, is refused with [`CoreError::HostBudgetTooSmall`] naming that
//! least: planning with it fits (`tests/plan_host.rs`).

use ddo_core::host_budget::HOST_WORKING_BYTES;
use ddo_core::{CoreError, FootprintContext, HostBudget, Result, RouteOptions, RouteSpec};
use ddo_metrics::format_bytes;

use super::{ComponentPlan, PhasePlan, footprint};
use crate::Pipeline;

/// One phase of a plan being made: the phase and its components.
pub(super) type Planned = (PhasePlan, Vec<ComponentPlan>);

/// Sets every phase's pinned and host bytes from its components and the next phase's
/// components attached in the background during it.
pub(super) fn count_host(phases: &mut [Planned]) {
    for k in 0..phases.len() {
        let pinned: u64 = phases[k]
            .1
            .iter()
            .map(|c| c.footprint.pinned_host_bytes)
            .sum();
        let cached: u64 = phases[k]
            .1
            .iter()
            .map(|c| c.footprint.cached_staged_bytes())
            .sum();
        let phases_disk: u64 = phases[k]
            .1
            .iter()
            .map(|c| c.footprint.disk_bytes_per_forward)
            .sum();
        let prepared: u64 = phases.get(k + 1).map_or(0, |(_, next)| {
            next.iter()
                .filter(|c| c.prepare_during.as_deref() == Some(phases[k].0.phase.as_str()))
                .map(|c| c.footprint.pinned_host_bytes)
                .sum()
        });
        let phase = &mut phases[k].0;
        phase.pinned_host_bytes = pinned + prepared;
        phase.page_cache_bytes = cached;
        phase.disk_bytes_per_forward = phases_disk;
        phase.host_bytes = HOST_WORKING_BYTES + pinned + cached + prepared;
    }
}

/// Fits every phase within `budget` (see the module docs), or refuses naming the least
/// budget that plans.
pub(super) fn plan_host(
    pipeline: &Pipeline,
    budget: &HostBudget,
    context: &FootprintContext,
    phases: &mut [Planned],
) -> Result<()> {
    // 1. Background attaches that do not fit beside the phase they would run in.
    for k in 0..phases.len().saturating_sub(1) {
        if phases[k].0.host_bytes > budget.bytes {
            attach_in_own_phase(phases, k);
            count_host(phases);
        }
    }
    // 2. The phase's planned streamed routes pin less. Every phase is planned, so that a
    // refusal names what the whole plan needs: the largest of the phases' least needs.
    let mut refusal: Option<CoreError> = None;
    for k in 0..phases.len() {
        if phases[k].0.host_bytes <= budget.bytes {
            continue;
        }
        let least = pin_less(pipeline, budget, context, &mut phases[k])?;
        count_host(phases);
        if phases[k].0.host_bytes <= budget.bytes {
            continue;
        }
        let (phase, components) = &phases[k];
        let largest = components
            .iter()
            .max_by_key(|c| c.footprint.pinned_host_bytes)
            .map_or_else(String::new, |c| c.component.clone());
        let needed = HOST_WORKING_BYTES
            .saturating_add(least)
            .div_ceil(1 << 20)
            .saturating_mul(1 << 20);
        if refusal.as_ref().is_none_or(
            |r| matches!(r, CoreError::HostBudgetTooSmall { needed: n, .. } if needed > *n),
        ) {
            refusal = Some(CoreError::HostBudgetTooSmall {
                phase: phase.phase.clone(),
                component: largest,
                budget: budget.bytes,
                from: budget.source.to_string(),
                needed,
                detail: format!(
                    "working memory {} + the least pinned and cached memory of its routes {}",
                    format_bytes(HOST_WORKING_BYTES),
                    format_bytes(least)
                ),
            });
        }
    }
    refusal.map_or(Ok(()), Err)
}

/// Phase `k + 1`'s components attached in the background during phase `k` attach when their
/// own phase begins instead, and their early upload (counted in phase `k`'s device peak)
/// moves to their first forward.
fn attach_in_own_phase(phases: &mut [Planned], k: usize) {
    let phase = phases[k].0.phase.clone();
    let mut moved = 0u64;
    for c in &mut phases[k + 1].1 {
        if c.prepare_during.as_deref() != Some(phase.as_str()) {
            continue;
        }
        c.prepare_during = None;
        if c.upload_during.take().is_some() {
            moved += c.footprint.resident_bytes;
        }
        c.reason.push_str(&format!(
            "; attached when its phase begins: the host budget has no room for it during {phase}"
        ));
    }
    let p = &mut phases[k].0;
    p.early_upload_bytes = p.early_upload_bytes.saturating_sub(moved);
    p.peak_bytes = p.peak_bytes.saturating_sub(moved);
}

/// Lowers the pinned memory of `phase`'s planned streamed routes, the one pinning the most
/// first, until the phase fits or each is at its least; returns the phase's least pinned
/// bytes (fixed routes as given, planned ones at their least).
fn pin_less(
    pipeline: &Pipeline,
    budget: &HostBudget,
    context: &FootprintContext,
    (_, components): &mut Planned,
) -> Result<u64> {
    let mut order: Vec<usize> = (0..components.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(components[i].footprint.pinned_host_bytes));
    let mut least_total = 0u64;
    // Least pinned bytes of each component, for the refusal.
    let mut leasts = vec![None; components.len()];
    for &i in &order {
        let c = &components[i];
        let Some(component) = pipeline.get(&c.component) else {
            continue;
        };
        let streamed_planned = c.planned
            && c.footprint.streamed_bytes_per_forward > 0
            && c.resolution.spec.options().use_stream == Some(true);
        if !streamed_planned {
            continue;
        }
        // Planned streamed routes carry a budget in bytes: the free figure plays no part.
        let ctx = *context;
        let staged = with_options(&c.resolution.spec, |o| {
            o.pinned = Some(false);
            o.pinned_limit = None;
        })?;
        let least = footprint(component, &staged, &ctx)?;
        leasts[i] = Some(least.pinned_host_bytes);
        let others: u64 = components
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != i)
            .map(|(_, o)| o.footprint.pinned_host_bytes + o.footprint.cached_staged_bytes())
            .sum();
        let room = budget
            .bytes
            .saturating_sub(HOST_WORKING_BYTES)
            .saturating_sub(others);
        let own = &components[i].footprint;
        if own.pinned_host_bytes + own.cached_staged_bytes() <= room {
            continue;
        }
        if own.pinned_host_bytes <= room && own.staged_bytes_per_forward > 0 {
            // Pinned as it is; the staged part past what is left goes to the disk tier.
            let (spec, f) = page_cache_within(component, &c.resolution.spec, &ctx, room)?;
            let c = &mut components[i];
            c.reason
                .push_str(&format!("; host: {}", disk_tier_note(&f)));
            c.resolution.spec = spec;
            c.footprint = f;
            continue;
        }
        // The streamed part page-locked, the resident part uploaded from pageable memory.
        let limited = with_options(&c.resolution.spec, |o| o.pinned_limit = Some(room))?;
        let f = footprint(component, &limited, &ctx)?;
        let (spec, f, how) = if f.pinned_host_bytes <= room
            && f.pinned_host_bytes > least.pinned_host_bytes
        {
            let part = if f.pageable_staging {
                "the first units page-locked, the rest staged"
            } else {
                "the streamed part page-locked"
            };
            (
                limited,
                f,
                format!(
                    "pinned_limit {} (what the host budget leaves): {part}",
                    format_bytes(room)
                ),
            )
        } else {
            let how = format!(
                "pinned=false: staged through two {} buffers, the host budget leaving {} pinned",
                format_bytes(least.pinned_host_bytes / 2),
                format_bytes(room)
            );
            (staged, least, how)
        };
        // The staged part's pages within what the pinned part leaves; past it, the disk.
        let (spec, f, how) = if f.pinned_host_bytes + f.cached_staged_bytes() > room {
            let (spec, f) = page_cache_within(component, &spec, &ctx, room)?;
            let how = format!("{how}; {}", disk_tier_note(&f));
            (spec, f, how)
        } else {
            (spec, f, how)
        };
        let c = &mut components[i];
        c.reason.push_str(&format!("; host: {how}"));
        c.resolution.spec = spec;
        c.footprint = f;
    }
    for (c, least) in components.iter().zip(leasts) {
        // A route the plan does not set keeps its staged pages cached as well.
        least_total +=
            least.unwrap_or(c.footprint.pinned_host_bytes + c.footprint.cached_staged_bytes());
    }
    Ok(least_total)
}

/// `spec` with a `page_cache_limit` of what `room` leaves beside its pinned bytes, and its
/// footprint: the staged pages past it are given back after each copy and read from the
/// disk for every forward.
fn page_cache_within(
    component: &ddo_core::Component,
    spec: &RouteSpec,
    context: &FootprintContext,
    room: u64,
) -> Result<(RouteSpec, ddo_core::Footprint)> {
    let pinned = footprint(component, spec, context)?.pinned_host_bytes;
    let keep = room.saturating_sub(pinned);
    let spec = with_options(spec, |o| o.page_cache_limit = Some(keep))?;
    let f = footprint(component, &spec, context)?;
    Ok((spec, f))
}

/// How a component's staged bytes split between the page cache and the disk.
fn disk_tier_note(f: &ddo_core::Footprint) -> String {
    format!(
        "page_cache_limit {}: {} of the {} staged per forward read from the disk each forward",
        format_bytes(f.cached_staged_bytes()),
        format_bytes(f.disk_bytes_per_forward),
        format_bytes(f.staged_bytes_per_forward)
    )
}

/// `spec` with `change` made to its options.
fn with_options(spec: &RouteSpec, change: impl FnOnce(&mut RouteOptions)) -> Result<RouteSpec> {
    let mut options = *spec.options();
    change(&mut options);
    RouteSpec::new(spec.target(), options)
}
