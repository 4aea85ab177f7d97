//! The streaming engine: DESIGN.md's execution model for routes that stream weights
//! (`diffusers_group_offload` with a stream, and `native_vmm`'s streamed part).
//!
//! A route hands the engine its *segments* (params that must be on the device together: a
//! leaf, or a Diffusers block group) and the order the first forward started them in (a
//! [`Schedule`]). The engine then:
//!
//! 1. **plans residency** under an optional budget ([`plan::plan_residency_with`]): the
//!    segments that cost most to stream per byte of budget stay resident, so that
//!    `resident + ring ≤ budget` holds exactly;
//! 2. **packs the streamed params** in schedule order into transfer units of about
//!    [`StreamingConfig::unit_bytes`] ([`StagingLayout`]; each param 256-byte aligned), one
//!    copy per unit;
//! 3. **stages them in pinned memory**, bounded by [`StreamingConfig::pinned_limit`]:
//!    - *pinned home* (when every unit fits under the limit): one pinned buffer holding the
//!      units in schedule order **replaces** the params' host bytes
//!      ([`Param::replace_host`](crate::Param::replace_host)), so the checkpoint mapping or
//!      owned copy is dropped as soon as nobody else holds it. That keeps one host copy of
//!      the weights and copies run at pinned speed straight from it; the cost is pinned
//!      memory equal to the streamed bytes. Diffusers with streams instead keeps a second,
//!      pinned copy of the whole model next to the first.
//!    - *staging ring* (otherwise, or with `pinned=false` / `low_cpu_mem_usage=true`): two
//!      pinned buffers (each at most a slot, at most half the limit) filled by host copies
//!      from the params' own bytes just before their device copy, the host waiting only for
//!      the copy that last read the buffer. No copy ever runs from pageable memory.
//!
//!    - *registered mappings* (the default, [`PinnedSource::Register`], route option
//!      `pinned_source=register`, used when some streamed param is checkpoint-mapped;
//!      owned weights take the pinned home): the checkpoint mappings the streamed params point into
//!      are page-locked where they are ([`Device::register_host`](crate::Device::register_host):
//!      `cuMemHostRegister` with the read-only flag on CUDA), in ranges rounded out to
//!      [`REGISTER_ALIGN`](crate::host_memory::REGISTER_ALIGN) blocks and merged per file; no copy
//!      of the weights is made at attach and the params keep pointing into the mapping.
//!      Each unit (ordered by file offset, [`UnitOrder::Source`]) is copied in one copy per
//!      run of params adjacent both in the file and in the unit. Streamed params whose bytes
//!      are not mapped get a pinned home of their own. Registered bytes plus that home
//!      count against the limit; when they do not fit, or the device cannot register the
//!      memory, the engine stages as above (pinned home if it fits, else the staging ring;
//!      [`StreamingFigures::register_fallback`] says why). Teardown unregisters.
//!      Which is faster is for the GPU bench to measure: the home costs a copy of the
//!      weights at attach and pinned memory beside the page cache; registering costs
//!      page-locking the mapping (the file's pages are read in then) and smaller copies
//!      where tensors are not adjacent;
//! 4. **streams through a ring** of [`StreamingConfig::ring_slots`] device slots, each the
//!    size of the largest unit, allocated once per forward as one buffer: unit `u` lands
//!    in slot `u mod k`; compute waits on the unit's copy event; the copy of unit `u + k`
//!    waits on the use event compute records after unit `u`'s last leaf. No allocation, no
//!    host synchronisation and no per-param work sit on the per-leaf path.
//!
//! Defaults, and why: units of [`DEFAULT_UNIT_BYTES`] (16 MiB: DESIGN.md measured 1 MiB
//! copies 15% below the link; at 16 MiB a copy lasts ~0.3 ms at 53 GB/s, so the per-copy
//! cost is under 3%; Flux's large linears are units of their own anyway); a ring of
//! [`DEFAULT_RING_SLOTS`] (2: one slot in use while the next fills; a streamed Flux step is
//! link-bound by ~3×, so one unit of lookahead keeps the copy stream busy and the peak at
//! Diffusers' two-leaf level; a route may default to more under a budget or for 8-bit
//! weights, as the group offload does); a pinned limit that
//! follows the machine ([`default_pinned_limit`]: the host's available memory less a reserve
//! of an eighth of it, at least 4 GiB, so the Qwen-Image transformer's 38 GiB live in a
//! pinned home on a 128 GiB host beside its other 14 GiB of weights;
//! [`DEFAULT_PINNED_LIMIT`] where that cannot be read), and [`WSL_COMPAT_PINNED_LIMIT`]
//! (256 MiB) under `wsl_compat`.

pub mod coded;
pub mod engine;
pub mod figures;
pub mod home;
pub mod layout;
mod placement;
pub mod plan;
mod register_plan;
pub mod schedule;
pub mod staged_read;
mod trace;

pub use crate::config::{Compression, PinnedSource};
pub use coded::coded_cache_path;
pub use engine::StreamingEngine;
pub use figures::{CodedCache, StagingKind, StreamingFigures};
pub use home::PinnedHome;
pub use layout::{PARAM_ALIGN, StagingLayout, TransferUnit, UnitEntry, UnitOrder};
pub use plan::{ResidencyPlan, SlotModel, plan_residency, plan_residency_with};
pub use schedule::{Schedule, ScheduleOutcome};

use crate::config::RouteOptions;
use crate::route::{OptionDecl, OptionKind};

/// Default transfer unit target: 16 MiB.
pub const DEFAULT_UNIT_BYTES: u64 = 16 << 20;

/// Default number of ring slots.
pub const DEFAULT_RING_SLOTS: usize = 2;

/// The pinned limit where the host's available memory cannot be read: 16 GiB
/// ([`HOST_BUDGET_UNKNOWN`](crate::host_budget::HOST_BUDGET_UNKNOWN)).
pub const DEFAULT_PINNED_LIMIT: u64 = crate::host_budget::HOST_BUDGET_UNKNOWN;

/// The engine's default pinned limit: the default host budget
/// ([`HostBudget::default_now`](crate::host_budget::HostBudget::default_now): the host's
/// available memory now less an eighth of it, at least 4 GiB, at least
/// [`WSL_COMPAT_PINNED_LIMIT`], or [`DEFAULT_PINNED_LIMIT`] where `/proc/meminfo` cannot be
/// read). A pinned home replaces the weights' host copy chunk by chunk (the copy it
/// replaces goes as each chunk is filled), so once built it costs no host memory beyond the
/// weights, and while it is built only the chunks in flight are held twice. Half of the
/// available memory, the rule before, left the 38 GiB streamed part of the Qwen-Image
/// transformer out of a pinned home on a 128 GiB H200 host (70 GB available after its 55 GB
/// of random weights were made): it staged through pageable memory at 9.96x the link floor.
/// The device's own pinned limit (the run's host budget) still applies on top of it.
pub fn default_pinned_limit() -> u64 {
    pinned_limit_for_available(crate::host_memory::mem_available())
}

/// [`default_pinned_limit`] for a given available-memory reading.
pub fn pinned_limit_for_available(available: Option<u64>) -> u64 {
    crate::host_budget::HostBudget::for_available(available).bytes
}

/// The pinned limit the `wsl_compat` preset sets: 256 MiB (WSL rations pinned memory).
pub const WSL_COMPAT_PINNED_LIMIT: u64 = 256 << 20;

/// Which host staging the engine uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StagingMode {
    /// A pinned home when the streamed bytes fit under the pinned limit, else a staging ring.
    #[default]
    Auto,
    /// Always a pinned home (an error when it does not fit).
    PinnedHome,
    /// Always a staging ring.
    Ring,
}

/// Settings of a [`StreamingEngine`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamingConfig {
    /// Transfer unit target in bytes.
    pub unit_bytes: u64,
    /// Device ring slots (at least 2).
    pub ring_slots: usize,
    /// Most pinned host bytes the engine may hold.
    pub pinned_limit: u64,
    /// Host staging choice.
    pub staging: StagingMode,
    /// VRAM budget in bytes for resident weights plus the ring (`None`: stream everything).
    pub budget: Option<u64>,
    /// Where copies read the streamed weights from: a pinned home (default) or the
    /// checkpoint mappings registered in place. Ignored with [`StagingMode::Ring`].
    pub pinned_source: PinnedSource,
    /// Record a timeline of each forward ([`StreamingEngine`] publishes it to the route's
    /// metrics).
    pub timeline: bool,
    /// Stream the units lossless-coded ([`Compression::Lossless`]): a pinned home of coded
    /// units, decoded on the device into the ring ([`coded_ring_bytes`] more device memory).
    pub compress: Compression,
    /// Bytes of staged units whose file pages stay in memory between forwards (`None`:
    /// all); the rest are given back once copied ([`staged_read`]).
    pub page_cache_limit: Option<u64>,
    /// `compress=lossless` was not asked for but chosen because the weights are coded in
    /// their files (`ddo convert --compress lossless`): where their coded home does not fit
    /// the pinned room, the units stream uncoded instead (staged, the coded params decoded
    /// on the host as they are staged) rather than the attach failing.
    pub lossless_if_home_fits: bool,
    /// From a phase's second forward on, keep the ring for the next forward and copy its
    /// first units into it while this forward's last units run
    /// ([`StreamingEngine::end_forward`]); off, each forward takes a ring and hands it back.
    pub copy_ahead: bool,
}

/// Bytes a run of params coded at attach may take beyond its own (a unit's 96-byte header
/// and the 16-byte alignment of what follows, rounded up): what the engine's coded home
/// ([`coded`]'s `home_bound`) and the planners' bounds of it add per run.
pub const CODED_PIECE_SLACK: u64 = 128;

/// Coded slots of a lossless-coded ring: a unit's coded bytes land in one while the unit
/// before decodes out of the other.
pub const CODED_SLOTS: u64 = 2;

/// Device bytes a lossless-coded ring takes beside its decoded slots of `slot_bytes`:
/// [`CODED_SLOTS`] coded slots, each the coded bound of a slot
/// ([`ddo_codec::max_encoded_len`]), and one aligned block for the decoder's status.
pub fn coded_ring_bytes(slot_bytes: u64) -> u64 {
    CODED_SLOTS * coded_slot_bytes(slot_bytes) + PARAM_ALIGN
}

/// Device bytes of one coded slot beside decoded slots of `slot_bytes`: the coded bound of
/// a slot ([`ddo_codec::max_encoded_len`]), aligned.
pub fn coded_slot_bytes(slot_bytes: u64) -> u64 {
    let coded = ddo_codec::max_encoded_len(slot_bytes as usize).unwrap_or(slot_bytes);
    layout::align_up(coded)
}

impl Default for StreamingConfig {
    fn default() -> Self {
        Self {
            unit_bytes: DEFAULT_UNIT_BYTES,
            ring_slots: DEFAULT_RING_SLOTS,
            pinned_limit: default_pinned_limit(),
            staging: StagingMode::Auto,
            budget: None,
            pinned_source: PinnedSource::Register,
            timeline: false,
            compress: Compression::None,
            page_cache_limit: None,
            lossless_if_home_fits: false,
            copy_ahead: false,
        }
    }
}

impl StreamingConfig {
    /// How the residency planner counts the ring these settings give: `ring_slots` (at
    /// least 2) slots of the largest streamed segment or coalesced transfer unit, and with
    /// `compress=lossless` the coded slots beside them.
    pub fn slot_model(&self) -> SlotModel {
        SlotModel {
            slots: self.ring_slots.max(2) as u64,
            unit_floor: layout::align_up(self.unit_bytes),
            coded: self.compress == Compression::Lossless,
        }
    }

    /// The settings route options give (`unit_bytes`, `ring_slots`, `pinned_limit`,
    /// `pinned_source`; `pinned=false` or `low_cpu_mem_usage=true` choose the staging
    /// ring). The budget is left to the route, which knows the device's free memory.
    pub fn from_options(o: &RouteOptions) -> Self {
        let d = Self::default();
        let ring_only = o.pinned == Some(false) || o.low_cpu_mem_usage == Some(true);
        Self {
            unit_bytes: o.unit_bytes.unwrap_or(d.unit_bytes).max(1),
            ring_slots: o.ring_slots.unwrap_or(d.ring_slots).max(2),
            pinned_limit: o.pinned_limit.unwrap_or(d.pinned_limit),
            staging: if ring_only {
                StagingMode::Ring
            } else {
                StagingMode::Auto
            },
            budget: None,
            pinned_source: o.pinned_source.unwrap_or_default(),
            timeline: o.timeline.unwrap_or(false),
            compress: o.compress.unwrap_or_default(),
            page_cache_limit: o.page_cache_limit,
            lossless_if_home_fits: false,
            copy_ahead: o.copy_ahead.unwrap_or(d.copy_ahead),
        }
    }
}

/// The streaming engine's options with their effective values (for a route's
/// [`Route::effective_options`](crate::Route::effective_options)): transfer unit, ring
/// slots, pinned source (`home`: a pinned copy of the weights; `register`: the checkpoint
/// mapping page-locked in place), compression and copying ahead.
pub fn effective_options(
    o: &RouteOptions,
    streaming: &StreamingConfig,
) -> Vec<crate::route::EffectiveOption> {
    use crate::route::{EffectiveOption, OptionValue};
    vec![
        EffectiveOption::new(
            "unit_bytes",
            OptionValue::Text(ddo_metrics::format_bytes(streaming.unit_bytes)),
            o.unit_bytes.is_some(),
        ),
        EffectiveOption::new(
            "ring_slots",
            OptionValue::Count(streaming.ring_slots as u64),
            o.ring_slots.is_some(),
        ),
        EffectiveOption::new(
            "pinned_source",
            OptionValue::Text(streaming.pinned_source.as_str().into()),
            o.pinned_source.is_some(),
        ),
        EffectiveOption::new(
            "compress",
            OptionValue::Text(streaming.compress.as_str().into()),
            o.compress.is_some(),
        ),
        EffectiveOption::new(
            "copy_ahead",
            OptionValue::Flag(streaming.copy_ahead),
            o.copy_ahead.is_some(),
        ),
    ]
}

/// `pinned_limit`, as route option tables declare it (leaf-group and native_vmm take it).
pub const PINNED_LIMIT_OPTION: OptionDecl = OptionDecl::new(
    "pinned_limit",
    OptionKind::Size,
    "available host memory less an eighth (at least 4 GiB left)",
    "most pinned host bytes the streaming engine may hold",
);

/// `page_cache_limit`, as route option tables declare it (the memory plan sets it from
/// the host budget, [`staged_read`]).
pub const PAGE_CACHE_LIMIT_OPTION: OptionDecl = OptionDecl::new(
    "page_cache_limit",
    OptionKind::Size,
    "no limit",
    "staged bytes whose file pages stay in memory between forwards; the rest are read from the disk each forward",
);

/// `unit_bytes`, as route option tables declare it.
pub const UNIT_BYTES_OPTION: OptionDecl = OptionDecl::new(
    "unit_bytes",
    OptionKind::Size,
    "16MiB",
    "target size of one streaming transfer unit",
);

/// `ring_slots`, as route option tables declare it (a route whose default differs says so
/// in its own declaration).
pub const RING_SLOTS_OPTION: OptionDecl = OptionDecl::new(
    "ring_slots",
    OptionKind::Count,
    "2",
    "device slots of the streaming ring, at least 2",
);

/// `pinned_source`, as route option tables declare it.
pub const PINNED_SOURCE_OPTION: OptionDecl = OptionDecl::new(
    "pinned_source",
    OptionKind::Choice(&["register", "home"]),
    "register",
    "copy from the checkpoint mapping page-locked in place, or from a pinned home",
);

/// `timeline`, as route option tables declare it.
pub const TIMELINE_OPTION: OptionDecl = OptionDecl::new(
    "timeline",
    OptionKind::Flag,
    "false",
    "record each streamed forward's timeline (synchronises at the end of each forward)",
);

/// `copy_ahead`, as route option tables declare it.
pub const COPY_AHEAD_OPTION: OptionDecl = OptionDecl::new(
    "copy_ahead",
    OptionKind::Flag,
    "false",
    "keep the ring between a phase's forwards and copy the next forward's first units during this one's last (pinned sources; one ring held between forwards)",
);

/// `compress`, as route option tables declare it.
pub const COMPRESS_OPTION: OptionDecl = OptionDecl::new(
    "compress",
    OptionKind::Choice(&["none", "lossless"]),
    "none",
    "store and send streamed bf16 weights entropy-coded, decoded on the device bit for bit (the default over weights coded in their files by ddo convert)",
);

/// The typed error for a budget that cannot hold the streaming ring (`ring_bytes` for
/// `slots` slots) beside what stays resident: `given` as given (a `free-M` margin is named
/// as such, with what it leaves of the `free` bytes the device has free, never as the bytes
/// it came to).
pub fn ring_does_not_fit(
    given: crate::Budget,
    free: u64,
    ring_bytes: u64,
    slots: u64,
) -> crate::CoreError {
    let leaves = given
        .leaves_given_free(free)
        .map_or_else(String::new, |l| format!("it {l}; "));
    crate::CoreError::InvalidOption {
        option: "budget".into(),
        value: given.given_text(),
        hint: format!(
            "{leaves}the streaming ring needs {ring_bytes} B ({slots} slots of the largest segment or transfer unit) \
             on top of what stays resident; raise the budget, lower ring_slots or unit_bytes, or drop the budget"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_pinned_limit_leaves_a_reserve_and_takes_the_rest() {
        // The H200 host after Qwen-Image's random weights: its 40.86 GB streamed part fits.
        let available = 70_000_000_000u64;
        let limit = pinned_limit_for_available(Some(available));
        assert_eq!(limit, available - available / 8);
        assert!(limit >= 40_860_802_304, "{limit}");
        // A small host keeps at least crate::host_budget::HOST_RESERVE_MIN unpinned, and never goes below the
        // wsl_compat floor.
        assert_eq!(
            pinned_limit_for_available(Some(12 << 30)),
            (12 << 30) - crate::host_budget::HOST_RESERVE_MIN
        );
        assert_eq!(
            pinned_limit_for_available(Some(3 << 30)),
            WSL_COMPAT_PINNED_LIMIT
        );
        assert_eq!(pinned_limit_for_available(None), DEFAULT_PINNED_LIMIT);
    }

    #[test]
    fn the_option_declarations_state_the_engine_defaults() {
        use crate::config::{Compression, PinnedSource};
        assert_eq!(
            crate::config::parse_size("unit_bytes", UNIT_BYTES_OPTION.default).unwrap(),
            DEFAULT_UNIT_BYTES
        );
        assert_eq!(RING_SLOTS_OPTION.default, DEFAULT_RING_SLOTS.to_string());
        assert_eq!(
            PINNED_SOURCE_OPTION.default,
            PinnedSource::default().as_str()
        );
        assert_eq!(COMPRESS_OPTION.default, Compression::default().as_str());
        assert_eq!(StreamingConfig::default().page_cache_limit, None);
        assert_eq!(PAGE_CACHE_LIMIT_OPTION.default, "no limit");
        assert_eq!(
            TIMELINE_OPTION.default,
            StreamingConfig::default().timeline.to_string()
        );
        assert_eq!(
            COPY_AHEAD_OPTION.default,
            StreamingConfig::default().copy_ahead.to_string()
        );
        for d in [PINNED_SOURCE_OPTION, COMPRESS_OPTION] {
            let OptionKind::Choice(names) = d.kind else {
                panic!("{} is a choice", d.name)
            };
            assert!(names.contains(&d.default), "{}", d.name);
        }
    }
}
