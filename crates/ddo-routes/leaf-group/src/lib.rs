//! The `diffusers_group_offload` route: Diffusers-style group offloading of one component,
//! at leaf or block level, with or without a copy stream that prefetches the next group.
//!
//! This is a route crate: it sits above `ddo-core` (and `ddo-metrics`) and talks only to the
//! [`Device`] trait, so it runs unchanged on the host backend in CI and on CUDA. The route
//! registry in `ddo-routes` lists [`GroupOffloadRoute`] under
//! [`RouteId::DIFFUSERS_GROUP_OFFLOAD`], runs its preflight, calls [`Route::attach`] and
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
//!   through a ring of `ring_slots` device slots (default 2; 3 under a budget, 4 for 8-bit
//!   weights; below 6 bits, `copy_ahead` through the bytes of nine 16-bit slots,
//!   [`streaming_config_for`]) allocated once per forward (or kept between forwards with
//!   `copy_ahead`),
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
//!
//! [`Schedule`]: ddo_core::streaming::Schedule
//! [`StreamingEngine`]: ddo_core::streaming::StreamingEngine

mod attached;
mod config;
mod plan;

use std::sync::Arc;

use ddo_core::streaming::plan::plan_residency_with;
use ddo_core::streaming::{StagingMode, StreamingConfig};
use ddo_core::{
    AttachedRoute, Budget, Component, CoreError, Device, Footprint, FootprintContext, OptionDecl,
    OptionKind, OptionTable, Refusal, Result, Route, RouteId, RouteSpec,
};
use ddo_metrics::RouteMetrics;

pub use attached::AttachedGroupOffload;
pub use config::GroupOffloadConfig;
pub use plan::{Group, GroupPlan};

/// Ring slots of the streaming engine when a `budget` keeps part of the model resident and
/// `ring_slots` is not given: 3 (2 without a budget, the engine's default). While resident
/// leaves compute, the link runs only as far ahead as the ring reaches; on one H200
/// (FLUX.1-dev transformer, `budget=10GiB`) two slots left the copy engine waiting for ring
/// room 12.1 ms a step (262.9 ms a step), three 1.4 ms (253.0 ms), four 0.6 ms (253.6 ms,
/// more bytes streamed), six 258.3 ms.
pub const BUDGETED_RING_SLOTS: usize = 3;

/// Ring slots of the streaming engine for a component whose largest leaf holds its weights
/// mostly in 8 bits (fp8, GGUF Q8_0), when neither `budget` nor `ring_slots` is given: 4,
/// twice the engine's default ([`ring_slots_for_bits`] of 8). A slot is the size of the
/// largest leaf, so an fp8 ring of four holds the bytes a 16-bit ring of two does, and covers
/// as much copy time: the lookahead that keeps the link busy is measured in bytes, and an
/// fp8 step is closer to compute-bound (its bytes halve, its compute does not), so compute
/// hiccups reach the copy engine sooner. One H200, FLUX.1-dev transformer at zero budget,
/// one job (ratio to the link floor, 2 / 3 / 4 slots): an all-fp8 file 1.055 / 1.025 /
/// 1.014; `--dtype fp8` 1.021 / 1.006 / 1.006; bf16 1.011 / 1.006 / 1.007.
pub const EIGHT_BIT_RING_SLOTS: usize = 4;

/// The most ring slots [`ring_slots_for_bits`] gives (2- and 3-bit GGUF blocks): past it,
/// the slots' bytes would be more lookahead than a forward's first leaves need.
pub const MAX_NARROW_RING_SLOTS: usize = 8;

/// Below this many bits per weight in the largest leaf (4- and 5-bit GGUF blocks, 2- and
/// 3-bit ones), a stream with neither `budget`, `ring_slots` nor `copy_ahead` given copies
/// the next forward's first units ahead, through a ring of [`ahead_ring_slots_for_bits`]
/// ([`streaming_config_for`]). Such a model is link-bound where its blocks are wide and
/// compute-bound where they are narrow, so its step is bound by compute overall, and the link
/// idles through the narrow blocks unless the next forward's wide ones are copied then. One
/// H100, a Q4_K FLUX.1-dev transformer (4.5 bits) at zero budget, one job: resident 138.3 ms;
/// seven slots without `copy_ahead` 154.4 ms, forty 160.9 ms; with `copy_ahead`, 16 / 24 /
/// 32 / 40 / 56 slots 148.4 / 144.1 / 142.4 / 142.7 / 142.8 ms. A Q8_0 one (8.5 bits) is
/// link-bound throughout: 232.9 ms by default (1.02x its link floor), 235.6-236.8 ms with
/// `copy_ahead` at 24-48 slots; so is bf16 (435.6 against 438.9 ms).
pub const AHEAD_BELOW_BITS: f64 = 6.0;

/// The ring, in the bytes of 16-bit slots, that a forward copying the next one's first units
/// ahead keeps ([`ahead_ring_slots_for_bits`]): nine 16-bit slots' bytes, about 1.2 GB for
/// FLUX.1-dev, are what its 4-bit double blocks fall behind the link in a forward (the
/// measurements at [`AHEAD_BELOW_BITS`]: the step stops improving past 32 4.5-bit slots).
pub const AHEAD_RING_16_BIT_SLOTS: f64 = 9.0;

/// The ring slots for a largest leaf stored at `bits` bits per weight when the next forward's
/// first units are copied ahead by default ([`AHEAD_BELOW_BITS`]): those that hold the bytes
/// of [`AHEAD_RING_16_BIT_SLOTS`] 16-bit slots (`9 × 16 / bits`, rounded; at least
/// [`ring_slots_for_bits`]): 32 for Q4_K (4.5 bits), 26 for Q5_K (5.5).
pub fn ahead_ring_slots_for_bits(bits: f64) -> usize {
    if bits.is_nan() || bits <= 0.0 {
        return ring_slots_for_bits(bits);
    }
    ((AHEAD_RING_16_BIT_SLOTS * 16.0 / bits).round() as usize).max(ring_slots_for_bits(bits))
}

/// The default ring slots for a largest leaf stored at `bits` bits per weight, when neither
/// a budget nor `ring_slots` is given: the slots that hold the bytes of a 16-bit ring of two
/// (`32 / bits`, rounded, within 2..=[`MAX_NARROW_RING_SLOTS`]). 16-bit weights keep the
/// engine's two, 8-bit ones (fp8, Q8_0 at 8.5 bits) get [`EIGHT_BIT_RING_SLOTS`], 4-bit GGUF
/// blocks (Q4_K at 4.5 bits) seven.
pub fn ring_slots_for_bits(bits: f64) -> usize {
    if bits.is_nan() || bits <= 0.0 {
        return 2;
    }
    ((32.0 / bits).round() as usize).clamp(2, MAX_NARROW_RING_SLOTS)
}

/// The streaming engine's settings for `spec`: its options, with [`BUDGETED_RING_SLOTS`]
/// under a budget (what `ddo resolve` shows asks this; [`streaming_config_for`] adds what
/// depends on the weights).
pub fn streaming_config(spec: &RouteSpec) -> StreamingConfig {
    let o = spec.options();
    let mut config = StreamingConfig::from_options(o);
    if o.budget.is_some() && o.ring_slots.is_none() {
        config.ring_slots = BUDGETED_RING_SLOTS;
    }
    config
}

/// The streaming engine's settings for `spec` on `component`: [`streaming_config`], with
/// [`ring_slots_for_bits`] of its largest leaf's bits per weight when neither a budget nor
/// `ring_slots` is given (four slots for 8-bit weights), or, below [`AHEAD_BELOW_BITS`]
/// and with `copy_ahead` not given either, `copy_ahead=true` through
/// [`ahead_ring_slots_for_bits`] (32 slots for 4-bit GGUF blocks), and `compress=lossless`
/// when `compress` is not given,
/// the engine keeps a pinned home and the weights are coded in their files (`ddo convert
/// --compress lossless`): their coded units stream as they are, about two thirds of the
/// bytes, where `compress=none` would decode them on the host at attach and stream them
/// whole. Attach and the footprint both ask this, so they agree.
pub fn streaming_config_for(spec: &RouteSpec, component: &Component) -> StreamingConfig {
    let o = spec.options();
    let mut config = streaming_config(spec);
    if o.budget.is_none()
        && o.ring_slots.is_none()
        && let Some(bits) = largest_leaf_bits(component)
    {
        if o.copy_ahead.is_none() && bits < AHEAD_BELOW_BITS {
            config.copy_ahead = true;
            config.ring_slots = config.ring_slots.max(ahead_ring_slots_for_bits(bits));
        } else {
            config.ring_slots = config.ring_slots.max(ring_slots_for_bits(bits));
        }
    }
    if o.compress.is_none()
        && config.staging != StagingMode::Ring
        && component
            .params()
            .iter()
            .any(|p| p.host().coded_source().is_some())
    {
        config.compress = ddo_core::Compression::Lossless;
        config.lossless_if_home_fits = true;
    }
    config
}

/// The bits per weight `component`'s largest leaf is stored at: its bytes over the elements
/// its params hold (a GGUF weight counts its dequantized shape's elements), or `None` for a
/// component without leaves or weights.
fn largest_leaf_bits(component: &Component) -> Option<f64> {
    let leaf = component.largest_leaf()?;
    let (mut bytes, mut elements) = (0u64, 0u64);
    for (_, p) in leaf.params() {
        bytes += p.nbytes() as u64;
        elements += p.logical_shape().iter().product::<usize>() as u64;
    }
    (elements > 0).then(|| 8.0 * bytes as f64 / elements as f64)
}

/// The route's effective options for `spec` running with `streaming` (a budget changes the
/// ring's default; coded files and 8-bit weights change `compress` and the ring:
/// [`streaming_config_for`]).
fn options_with(spec: &RouteSpec, streaming: &StreamingConfig) -> Vec<ddo_core::EffectiveOption> {
    use ddo_core::{EffectiveOption as E, OptionValue as V};
    let o = spec.options();
    let c = GroupOffloadConfig::from_spec(spec);
    let mut v = vec![E::new(
        "offload_type",
        V::Text(c.offload_type.as_str().into()),
        o.offload_type.is_some(),
    )];
    if c.offload_type == ddo_core::OffloadType::BlockLevel {
        v.push(E::new(
            "num_blocks_per_group",
            V::Count(c.num_blocks_per_group as u64),
            o.num_blocks_per_group.is_some(),
        ));
    }
    v.extend([
        E::new("use_stream", V::Flag(c.use_stream), o.use_stream.is_some()),
        E::new(
            "record_stream",
            V::Flag(c.record_stream),
            o.record_stream.is_some(),
        ),
        E::new(
            "low_cpu_mem_usage",
            V::Flag(c.low_cpu_mem_usage),
            o.low_cpu_mem_usage.is_some(),
        ),
        E::new("pinned", V::Flag(c.pinned), o.pinned.is_some()),
    ]);
    v.push(E::new(
        "pinned_limit",
        V::Text(ddo_metrics::format_bytes(streaming.pinned_limit)),
        o.pinned_limit.is_some(),
    ));
    if c.use_stream {
        v.extend(ddo_core::streaming::effective_options(o, streaming));
        if let Some(b) = o.budget {
            v.push(E::new(
                "budget",
                V::Text(ddo_core::describe_budget(b)),
                true,
            ));
        }
    }
    v
}

/// The route's name, as errors and profiles spell it.
pub const ROUTE_NAME: &str = "diffusers_group_offload";

const BUDGET_HINT: &str = "diffusers_group_offload keeps budgeted residency only with a stream: \
     set use_stream=true, or use native_vmm with a budget, or none";

const STREAM_ONLY_HINT: &str = "unit_bytes, ring_slots, pinned_source, timeline, copy_ahead and compress tune the streaming engine: set use_stream=true, or drop them";

/// The options of `diffusers_group_offload`: Diffusers' (offload type, blocks per group,
/// stream, record_stream, low_cpu_mem_usage), the pinned home and its limit, and with
/// `use_stream=true` a budget and the streaming engine's options.
pub static OPTIONS: OptionTable = OptionTable {
    options: &[
        OptionDecl::new(
            "offload_type",
            OptionKind::Choice(&["leaf_level", "block_level"]),
            "leaf_level",
            "a group per leaf, or runs of num_blocks_per_group blocks (Diffusers' offload_type)",
        ),
        OptionDecl::new(
            "num_blocks_per_group",
            OptionKind::Count,
            "1",
            "blocks per group (block_level only)",
        ),
        OptionDecl::new(
            "use_stream",
            OptionKind::Flag,
            "false",
            "prefetch the next group on a copy stream (the streaming engine from the second forward)",
        ),
        OptionDecl::new(
            "record_stream",
            OptionKind::Flag,
            "false",
            "free device copies in stream order instead of synchronising (needs use_stream)",
        ),
        OptionDecl::new(
            "low_cpu_mem_usage",
            OptionKind::Flag,
            "false",
            "pin on the fly instead of keeping pinned copies",
        ),
        OptionDecl::new(
            "pinned",
            OptionKind::Flag,
            "false without a stream; with use_stream=true, true unless low_cpu_mem_usage",
            "page-lock the weights' one host copy",
        ),
        ddo_core::streaming::PINNED_LIMIT_OPTION,
        OptionDecl::new(
            "budget",
            OptionKind::Budget,
            "none",
            "keep the groups that cost most to stream resident within the budget",
        )
        .requires("use_stream", "true", BUDGET_HINT),
        ddo_core::streaming::UNIT_BYTES_OPTION.requires("use_stream", "true", STREAM_ONLY_HINT),
        OptionDecl {
            default: "2; 3 under a budget; 4 when the largest leaf is mostly 8-bit; the bytes of nine 16-bit slots when it is below 6 bits (32 for 4.5-bit GGUF blocks)",
            ..ddo_core::streaming::RING_SLOTS_OPTION
        }
        .requires("use_stream", "true", STREAM_ONLY_HINT),
        ddo_core::streaming::PINNED_SOURCE_OPTION.requires("use_stream", "true", STREAM_ONLY_HINT),
        ddo_core::streaming::TIMELINE_OPTION.requires("use_stream", "true", STREAM_ONLY_HINT),
        OptionDecl {
            default: "false; true when the largest leaf is below 6 bits a weight (4- and 5-bit GGUF blocks) and neither budget nor ring_slots is given",
            ..ddo_core::streaming::COPY_AHEAD_OPTION
        }
        .requires("use_stream", "true", STREAM_ONLY_HINT),
        ddo_core::streaming::COMPRESS_OPTION.requires("use_stream", "true", STREAM_ONLY_HINT),
        ddo_core::streaming::PAGE_CACHE_LIMIT_OPTION.requires(
            "use_stream",
            "true",
            STREAM_ONLY_HINT,
        ),
    ],
    refused: &[],
    others_hint: "diffusers_group_offload takes Diffusers' group offload options",
};

/// Label of the block-level group that holds every leaf outside the root's block lists.
pub const UNMATCHED_LABEL: &str = "unmatched";

/// The `diffusers_group_offload` route (Diffusers-style leaf- or block-level group
/// offloading). Stateless: everything an attachment needs lives in the
/// [`AttachedGroupOffload`] it returns.
#[derive(Debug, Clone, Copy, Default)]
pub struct GroupOffloadRoute;

impl Route for GroupOffloadRoute {
    fn id(&self) -> RouteId {
        RouteId::DIFFUSERS_GROUP_OFFLOAD
    }

    /// With `use_stream=true`.
    fn streams(&self, spec: &RouteSpec) -> bool {
        GroupOffloadConfig::from_spec(spec).use_stream
    }

    /// One leaf on the device, two with a stream (the next prefetched). With a stream and a
    /// `budget` (bytes, at most the device budget `budget_bytes`; or `free-M`: the device
    /// budget less M), what it holds stays resident: everything when it holds the weights,
    /// else what it holds beside the engine's ring of the largest leaf, the rest streamed.
    fn estimate(
        &self,
        spec: &RouteSpec,
        weight_bytes: u64,
        largest_leaf_bytes: u64,
        budget_bytes: u64,
    ) -> ddo_core::HeaderEstimate {
        let stream = GroupOffloadConfig::from_spec(spec).use_stream;
        if let (true, Some(budget)) = (stream, spec.options().budget) {
            let room = match budget {
                Budget::Bytes(n) => n.min(budget_bytes),
                Budget::FreeMinus(m) => budget_bytes.saturating_sub(m),
            };
            let human = ddo_metrics::format_bytes;
            if weight_bytes <= room {
                return ddo_core::HeaderEstimate {
                    resident_bytes: weight_bytes,
                    streamed_bytes_per_forward: 0,
                    peak_weight_bytes: weight_bytes,
                    note: format!(
                        "the {} budget holds every group: nothing streams",
                        human(room)
                    ),
                };
            }
            let model = streaming_config(spec).slot_model();
            let ring = model.room(largest_leaf_bytes, weight_bytes - room);
            let resident = room.saturating_sub(ring).min(weight_bytes);
            return ddo_core::HeaderEstimate {
                resident_bytes: resident,
                streamed_bytes_per_forward: weight_bytes - resident,
                peak_weight_bytes: resident + ring,
                note: if room < ring {
                    format!(
                        "the {} budget is below the engine's ring ({}): attach refuses",
                        human(room),
                        human(ring)
                    )
                } else {
                    format!(
                        "the {} budget keeps the costliest groups resident beside a ring of {}",
                        human(room),
                        human(ring)
                    )
                },
            };
        }
        ddo_core::HeaderEstimate {
            resident_bytes: 0,
            streamed_bytes_per_forward: weight_bytes,
            peak_weight_bytes: if stream { 2 } else { 1 } * largest_leaf_bytes,
            note: if stream {
                "one leaf on the device, the next prefetched"
            } else {
                "one leaf on the device at a time"
            }
            .into(),
        }
    }

    /// Diffusers' options (offload type, blocks per group, stream, record_stream,
    /// low_cpu_mem_usage, pinned), the pinned limit, and with a stream the engine's options
    /// and the budget.
    fn effective_options(&self, spec: &RouteSpec) -> Vec<ddo_core::EffectiveOption> {
        options_with(spec, &streaming_config(spec))
    }

    /// [`Route::effective_options`] with the defaults the attached route takes from
    /// `component`'s weights ([`streaming_config_for`]): `compress=lossless` over coded
    /// files, the ring of 8-bit weights.
    fn effective_options_for(
        &self,
        spec: &RouteSpec,
        component: &Component,
    ) -> Vec<ddo_core::EffectiveOption> {
        options_with(spec, &streaming_config_for(spec, component))
    }

    /// Diffusers' options; a budget and the streaming engine's need `use_stream=true`.
    fn option_table(&self) -> &'static OptionTable {
        &OPTIONS
    }

    fn preflight(
        &self,
        component: &Component,
        device: &dyn Device,
        spec: &RouteSpec,
    ) -> Result<()> {
        let refuse = |refusal| CoreError::Refused {
            route: ROUTE_NAME,
            component: component.name().to_string(),
            refusal,
        };
        if GroupOffloadConfig::from_spec(spec).use_stream && !device.supports_streams() {
            return Err(refuse(Refusal::NoStreams));
        }
        ddo_core::route::check_budget_left(
            self,
            component.name(),
            spec,
            device.memory_info().free_bytes(),
        )
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
    /// streamed; pinned host bytes are the registered ranges (or pinned home) of the
    /// streamed bytes when they fit under the limit — with the resident params' ranges,
    /// registered for their upload, when those fit too —, else two staging buffers (then copies go through pageable reads,
    /// and the footprint names the limit that would avoid it). The learning forward holds
    /// two groups at most and nothing resident yet: the transient bytes cover what it holds
    /// beyond the resident set.
    fn footprint(
        &self,
        component: &Component,
        spec: &RouteSpec,
        context: &FootprintContext,
    ) -> Result<Footprint> {
        let config = GroupOffloadConfig::from_spec(spec);
        let plan = GroupPlan::new(component, &config);
        let weight_bytes = component.param_bytes();
        let unmatched = plan.unmatched_bytes();
        let streaming = streaming_config_for(spec, component);
        let limit = streaming.pinned_limit.min(context.pinned_room);
        let human = ddo_metrics::format_bytes;
        if !config.use_stream {
            let pinned = config.pinned && weight_bytes <= limit;
            // Pageable by design unless `pinned=true` was asked (Diffusers pins nothing
            // without a stream, the seed's VAE leaf policy): only a pinned home the limit
            // refused is pageable staging, with the limit that would have held it.
            let refused = config.pinned && !pinned;
            return Ok(Footprint {
                weight_bytes,
                resident_bytes: 0,
                streamed_bytes_per_forward: weight_bytes,
                transient_device_bytes: plan.largest_group_bytes() + unmatched,
                pinned_host_bytes: if pinned { weight_bytes } else { 0 },
                needs_native_allocator: false,
                attaches_on_device: false,
                pageable_staging: refused,
                pinned_limit_to_avoid_pageable: if refused { weight_bytes } else { 0 },
                staged_bytes_per_forward: if pinned { 0 } else { weight_bytes },
                disk_bytes_per_forward: 0,
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
        let (resident, streamed, ring, streamed_labels) = match budget {
            Some(b) => {
                let p = plan_residency_with(&segments, b, model);
                (
                    p.resident_bytes,
                    p.streamed_bytes,
                    p.slot_bytes,
                    Some(p.streamed),
                )
            }
            None => {
                let largest = segments.iter().map(|(_, b)| *b).max().unwrap_or(0);
                (0, total, model.room(largest, total), None)
            }
        };
        // Coded units: the slot model counts their coded slots and the decoder's status in
        // the ring. Coded at attach, their bytes are known only once coded, so the home
        // counts the raw bytes (an upper bound: a unit never codes larger than its raw bytes
        // plus a header); read coded from their files, the home is at most the streamed
        // home is bounded from the files (`GroupPlan::coded_home_bytes`).
        let coded_home = plan.coded_home_bytes(streamed_labels.as_deref(), streaming.unit_bytes);
        // Lossless by default over coded files gives way where its home does not fit.
        let lossless = streaming.compress == ddo_core::Compression::Lossless
            && !(streaming.lossless_if_home_fits && coded_home.is_some_and(|h| h > limit));
        let home = match coded_home {
            Some(bytes) if lossless => bytes,
            _ => streamed,
        };
        let learning = plan.largest_groups_bytes(2);
        // A home of the streamed bytes when they fit, else two staging buffers of a slot.
        let staging_buffers = 2 * (ring / model.slots.max(1)).min(limit / 2);
        // Registering (the default source) page-locks the resident params' ranges too, for
        // their one upload, where streamed and resident fit under the limit together; they
        // stay pinned (the device's cache of released registrations) until the phase ends.
        let registers = streaming.pinned_source == ddo_core::PinnedSource::Register && !lossless;
        let (pinned, pageable) = if streaming.staging == StagingMode::Ring {
            (staging_buffers, false)
        } else if registers && streamed + resident <= limit {
            (streamed + resident, false)
        } else if home <= limit {
            (home, false)
        } else if registers && limit > staging_buffers {
            // The first units registered, as many as the limit holds beside the two
            // staging buffers the rest go through: at most the limit.
            (limit, true)
        } else {
            (staging_buffers, true)
        };
        // What goes through the staging buffers: every streamed byte, or what the
        // registered first units leave. Past `page_cache_limit` it is read from the disk.
        let staged =
            if streaming.staging == StagingMode::Ring || (pageable && pinned <= staging_buffers) {
                streamed
            } else if pageable {
                streamed.saturating_sub(pinned - staging_buffers)
            } else {
                0
            };
        let disk = streaming
            .page_cache_limit
            .map_or(0, |l| staged.saturating_sub(l));
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
            pinned_limit_to_avoid_pageable: if pageable { home } else { 0 },
            staged_bytes_per_forward: staged,
            disk_bytes_per_forward: disk,
            summary: format!(
                "{} resident, {} streamed per forward through a {} ring{}{}",
                human(resident),
                human(streamed + unmatched),
                human(ring),
                if disk > 0 {
                    format!(
                        "; {} read from the disk each forward (page_cache_limit {})",
                        human(disk),
                        human(staged - disk)
                    )
                } else {
                    String::new()
                },
                if pageable && pinned > staging_buffers {
                    format!(
                        "; the first units page-locked, the rest staged from pageable memory: pinned_limit {} < {} streamed",
                        human(limit),
                        human(streamed)
                    )
                } else if pageable {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The default ring holds the bytes of a 16-bit ring of two: 2 slots for 16 bits and
    /// wider, 4 for fp8 and Q8_0 (8.5 bits), 5 for Q6_K (6.5625), 7 for Q4_K (4.5), capped
    /// for 2- and 3-bit blocks; a leaf without weights keeps 2.
    #[test]
    fn ring_slots_follow_the_bits_per_weight() {
        let cases = [
            (32.0, 2),
            (16.0, 2),
            (10.7, 3),
            (8.5, EIGHT_BIT_RING_SLOTS),
            (8.0, EIGHT_BIT_RING_SLOTS),
            (6.5625, 5),
            (4.5, 7),
            (3.4375, MAX_NARROW_RING_SLOTS),
            (2.625, MAX_NARROW_RING_SLOTS),
            (0.0, 2),
            (f64::NAN, 2),
        ];
        for (bits, slots) in cases {
            assert_eq!(ring_slots_for_bits(bits), slots, "{bits} bits");
        }
    }

    /// A component of one linear leaf whose weight is `rows × 256` elements in GGUF `ty`
    /// blocks.
    fn quantized(ty: ddo_core::gguf::GgmlType, rows: usize) -> Arc<Component> {
        use ddo_core::reference::IdentityProgram;
        use ddo_core::{LeafKind, Module, Param, ParamKind};
        let layout = ddo_core::QuantLayout::new("w", ty, vec![rows, 256]).unwrap();
        let bytes = layout.bytes();
        let p = Param::new(
            "proj.weight",
            ParamKind::Parameter,
            ddo_core::DType::Quantized,
            vec![bytes],
            ddo_core::HostBuffer::pageable_from(&vec![0u8; bytes]).slice_all(),
        )
        .unwrap();
        let p = Param::with_quant(p, Arc::new(layout)).unwrap();
        let root = Module::container(
            "",
            vec![Module::leaf(
                "proj",
                LeafKind::Linear,
                vec![("weight".into(), p)],
            )],
        );
        Component::new("transformer", "Quantized", root, Arc::new(IdentityProgram)).unwrap()
    }

    /// 4-bit GGUF blocks stream with `copy_ahead` through 32 slots by default; 8-bit ones keep
    /// the ring of four and copy nothing ahead; `copy_ahead`, `ring_slots` or a budget given
    /// turn the default off.
    #[test]
    fn narrow_weights_copy_ahead_by_default() {
        use ddo_core::gguf::GgmlType;
        let spec = |extra: &str| {
            RouteSpec::parse(
                &format!("diffusers_group_offload:use_stream=true{extra}"),
                &ddo_core::RouteId::BUILT_IN,
            )
            .unwrap()
        };
        let q4 = quantized(GgmlType::Q4_K, 4);
        let q8 = quantized(GgmlType::Q8_0, 4);
        let c = streaming_config_for(&spec(""), &q4);
        assert!(c.copy_ahead);
        assert_eq!(c.ring_slots, 32);
        let c = streaming_config_for(&spec(""), &q8);
        assert!(!c.copy_ahead);
        assert_eq!(c.ring_slots, EIGHT_BIT_RING_SLOTS);
        let c = streaming_config_for(&spec(",copy_ahead=false"), &q4);
        assert!(!c.copy_ahead);
        assert_eq!(c.ring_slots, 7);
        let c = streaming_config_for(&spec(",ring_slots=3"), &q4);
        assert!(!c.copy_ahead);
        assert_eq!(c.ring_slots, 3);
        let c = streaming_config_for(&spec(",budget=1MiB"), &q4);
        assert!(!c.copy_ahead);
        assert_eq!(c.ring_slots, BUDGETED_RING_SLOTS);
        // The effective options say so.
        let ahead = options_with(&spec(""), &streaming_config_for(&spec(""), &q4));
        assert!(
            ahead
                .iter()
                .any(|o| o.name == "copy_ahead" && o.value == ddo_core::OptionValue::Flag(true)),
            "{ahead:?}"
        );
    }

    /// Copying ahead, the default ring holds the bytes of nine 16-bit slots: 32 for Q4_K
    /// (4.5 bits), 26 for Q5_K (5.5), 55 for Q2_K (2.625); never fewer than the ring without
    /// `copy_ahead`; a leaf without weights keeps 2.
    #[test]
    fn ahead_ring_slots_hold_nine_sixteen_bit_slots() {
        for (bits, slots) in [(4.5, 32), (5.5, 26), (2.625, 55), (0.0, 2), (f64::NAN, 2)] {
            assert_eq!(ahead_ring_slots_for_bits(bits), slots, "{bits} bits");
        }
        for bits in [1.0, 2.0, 3.4375, 4.5, 5.9, 8.5, 16.0, 32.0] {
            assert!(ahead_ring_slots_for_bits(bits) >= ring_slots_for_bits(bits));
        }
    }
}
