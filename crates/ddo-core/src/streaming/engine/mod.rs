//! [`StreamingEngine`]: runs a fixed schedule of segments with budgeted residency,
//! coalesced pinned staging and a prefetch ring of device slots (DESIGN.md, "The execution
//! model").
//!
//! The ring is one device buffer of `slots × slot` bytes (`slot`: the largest unit), used
//! as a circular byte buffer: units are placed one after another in schedule order and
//! wrap to the start when the next one does not fit before the end. A forward's placement
//! is known before it starts (from the ring's start in a new ring; rolled on from the last
//! forward's end in a kept one, `Placement::next`), so each unit knows the last earlier
//! unit whose bytes it overwrites (its *blocker*): its copy waits for that unit's use event only
//! (use events are recorded in order on the compute stream, so every earlier user of those
//! bytes is done too). The copy stream thus runs as many bytes ahead as the ring holds —
//! through compute-heavy stretches with no weights (attention), small units fill the ring
//! instead of one unit per slot.
//!
//! Per forward: [`StreamingEngine::begin_forward`] allocates the ring (the only allocation
//! of the forward), points every streamed param at its place and queues every unit that
//! has no blocker. [`StreamingEngine::enter`] makes compute wait for the unit's copy event
//! when a unit's first position starts; [`StreamingEngine::leave`] records a use event on
//! compute when its last position ends and queues every unit whose blocker that was, the
//! copy stream waiting on the event first. Neither allocates, blocks the host (with
//! pinned-home staging) or touches a param outside the rare
//! [`Fixup`](super::layout::Fixup)s.
//! [`StreamingEngine::end_forward`] hands the ring back in stream order and leaves the
//! streamed params host-only again.
//!
//! Host side ([`StagingKind`]): a pinned home (one copy per unit), bounded staging buffers,
//! or — with [`PinnedSource::Register`] — the checkpoint mappings themselves, registered in
//! place: each unit is then copied in *runs*, one copy per maximal sequence of its params
//! that lie one after another both in the file and in the unit (the layout orders each
//! unit by file offset, [`UnitOrder::Source`], so a module's tensors coalesce), and the
//! params whose bytes are not mapped come from a pinned home of their own.
//!
//! Lossless-coded units (`compress=lossless`, [`StagingKind::Coded`]): at build the units
//! are coded into one pinned home, or read into it from the cache beside the checkpoint
//! ([`coded`]). Per unit the copy stream copies the coded bytes into one of
//! [`CODED_SLOTS`] coded slots (after the decode that last read that slot), and a decode
//! stream of its own waits for the copy and for the unit's blocker, decodes into the unit's
//! place in the ring and records the event compute waits for: the link runs ahead through
//! the coded slots while the decodes run on the SMs. The decoder's status is checked once
//! per forward ([`Device::check_lossless`]), so a corrupt unit fails the forward with a
//! typed error.
//!
//! `forward.rs` holds the per-forward side (`begin_forward` to `end_forward` and the copies);
//! this file the engine's build, its accessors and its teardown.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use ddo_metrics::RouteMetrics;

use crate::config::{Compression, PinnedSource};
use crate::device::{Device, DeviceBuffer, Event, Stream};
use crate::error::{CoreError, Result};
use crate::host_memory::{HostBuffer, HostSlice};
use crate::param::{Param, ParamId};
use crate::residency::{FreeMode, ResidencyTable};
use crate::streaming::CODED_SLOTS;
use crate::streaming::coded;
use crate::streaming::figures::{StagingKind, StreamingFigures, nanos};
use crate::streaming::home::PinnedHome;
use crate::streaming::layout::{PARAM_ALIGN, StagingLayout, UnitOrder, align_up};
use crate::streaming::placement::Placement;
use crate::streaming::plan::plan_residency_with;
use crate::streaming::register_plan::{CopyRun, RegisterPlan, RunSource};
use crate::streaming::staged_read::StagedReader;
use crate::streaming::trace::Trace;
use crate::streaming::{StagingMode, StreamingConfig, ring_does_not_fit};

mod forward;

#[derive(Debug)]
struct Ring {
    buffer: DeviceBuffer,
    /// Per unit: the event after its copy, until compute enters it.
    ready: Vec<Option<Event>>,
    /// Per unit: the event after compute's last use, once recorded.
    used: Vec<Option<Event>>,
    /// The next unit to queue on the copy stream.
    next_issue: usize,
    /// Units whose first position compute has entered.
    entered: usize,
    /// Timed events of this forward (`timeline=true`).
    trace: Option<Trace>,
    /// Per coded slot: the event after the decode that last read it (coded units).
    coded_used: Vec<Option<Event>>,
    /// Per leading unit of the next forward (the ring's first pass): the event after its
    /// copy made ahead, during this forward's last units, into the ring kept for it (empty
    /// when this forward copies nothing ahead).
    next_ready: Vec<Option<Event>>,
    /// The next forward's placement in this ring, rolled on from this one's end, and for
    /// each of its leading units that may be copied ahead the unit of this forward whose
    /// use it waits for ([`Placement::ahead_blockers`]); set once every unit of this
    /// forward is queued.
    next: Option<(Placement, Vec<usize>)>,
    /// In a kept ring, the event after the last forward's last use of it: the first copy
    /// into bytes no earlier unit of this forward used, beyond those copied ahead, waits
    /// for it.
    prior_use: Option<Event>,
    /// The next forward's leading units copied ahead so far (`units`: the next to copy).
    ahead: AheadCopies,
}

/// Units copied ahead for a next forward: how many (the leading ones), their bytes and
/// their copies.
#[derive(Debug, Clone, Copy, Default)]
struct AheadCopies {
    units: usize,
    bytes: u64,
    copies: u64,
}

impl AheadCopies {
    fn add(&mut self, other: AheadCopies) {
        self.units += other.units;
        self.bytes += other.bytes;
        self.copies += other.copies;
    }
}

/// The ring kept from one forward to the next (see [`StreamingEngine::end_forward`]).
#[derive(Debug)]
struct KeptRing {
    buffer: DeviceBuffer,
    /// Per leading unit copied ahead: the event after its copy.
    ready: Vec<Option<Event>>,
    /// The leading units copied ahead into it.
    ahead: AheadCopies,
    /// The event after the forward's last use of the ring, on compute: a copy into bytes
    /// the next forward has not used yet, beyond those copied ahead, waits for it.
    last_use: Event,
    /// The next forward's placement in it (rolled on from the last forward's end).
    placement: Arc<Placement>,
}

#[derive(Debug)]
enum Host {
    Home {
        home: PinnedHome,
        unit_offsets: Vec<u64>,
    },
    Staged {
        buffers: Vec<HostBuffer>,
        last_copy: Vec<Option<Event>>,
        next: usize,
        reader: Box<StagedReader>,
    },
    /// Lossless-coded units in one pinned buffer.
    Coded {
        home: HostBuffer,
        /// Per unit: where its coded bytes start in `home`, and its header.
        units: Vec<coded::CodedUnit>,
    },
    Registered {
        /// Registered views of the mappings (dropping them unregisters).
        sources: Vec<HostBuffer>,
        /// The sources that hold only resident params, until their first upload is queued
        /// (then they become plain mapped views: unregistered once those copies are done).
        resident_only: Vec<usize>,
        /// The pinned home of the streamed params that are not mapped.
        home: Option<PinnedHome>,
        /// Per unit, its copies (none for a staged unit).
        runs: Vec<Vec<CopyRun>>,
        /// The units past the pinned room, copied through staging buffers.
        staged: Option<StagedUnits>,
    },
}

impl Host {
    /// The reader of the staged units, where some are staged.
    fn staged_reader(&self) -> Option<&StagedReader> {
        match self {
            Host::Staged { reader, .. }
            | Host::Registered {
                staged: Some(StagedUnits { reader, .. }),
                ..
            } => Some(reader),
            _ => None,
        }
    }

    /// [`Host::staged_reader`], mutably.
    fn staged_reader_mut(&mut self) -> Option<&mut StagedReader> {
        match self {
            Host::Staged { reader, .. }
            | Host::Registered {
                staged: Some(StagedUnits { reader, .. }),
                ..
            } => Some(reader),
            _ => None,
        }
    }
}

/// The units of a registered host side that did not fit under the pinned limit: from unit
/// `from` on, each is copied through two pinned staging buffers filled from the params' own
/// bytes, as [`Host::Staged`] copies every unit.
#[derive(Debug)]
struct StagedUnits {
    from: usize,
    buffers: Vec<HostBuffer>,
    last_copy: Vec<Option<Event>>,
    next: usize,
    reader: Box<StagedReader>,
}

/// Host staging built from a [`RegisterPlan`].
struct Registered {
    host: Host,
    staging: StagingKind,
    pinned_bytes: u64,
    resident_registered_bytes: u64,
    released: u64,
    copies: u64,
    copied_bytes: u64,
}

/// The first forward's upload of the resident params: batch `i` holds the params that
/// `resident_at[i].0` is the first position to use. Batches go on the copy stream in
/// schedule order, each in front of the first unit whose position follows it, so the link
/// carries resident and streamed bytes in the order compute needs them and compute starts
/// with the first batch instead of after the last.
#[derive(Debug)]
struct FirstUpload {
    /// The next batch to queue.
    next_queue: usize,
    /// The next batch compute has not waited for.
    next_wait: usize,
    /// Per batch: the event after its copies, until compute waits for it.
    ready: Vec<Option<Event>>,
    /// Host time spent queueing the batches.
    queued: std::time::Duration,
    /// The queued params whose file pages the system kept when asked (page-locked for
    /// their copy): asked again when the upload is done.
    pages_kept: Vec<Arc<Param>>,
}

/// The streaming engine of one component (see the [module docs](self)).
#[derive(Debug)]
pub struct StreamingEngine {
    device: Arc<dyn Device>,
    compute: Stream,
    copy: Stream,
    metrics: Arc<RouteMetrics>,
    layout: StagingLayout,
    slots: usize,
    /// The running (or last) forward's placement of its units in the ring.
    placement: Arc<Placement>,
    /// The placement from the ring's start: a forward in a ring of its own uses it
    /// (shared, so taking it back is no copy).
    base_placement: Arc<Placement>,
    /// Each unit's bytes in the ring.
    unit_sizes: Vec<u64>,
    resident_params: Vec<Arc<Param>>,
    /// The resident params by the schedule position that first uses them (ascending
    /// positions): the first forward of a phase uploads them in this order.
    resident_at: Vec<(usize, Vec<Arc<Param>>)>,
    resident: ResidencyTable,
    /// The resident params' upload while the first forward of a phase runs.
    upload: Option<FirstUpload>,
    host: Option<Host>,
    ring: Option<Ring>,
    /// Whether a forward is running (between begin and end or abort).
    active: bool,
    /// Record a timeline of each forward.
    timeline: bool,
    /// The stream coded units decode on (coded units only).
    decode: Option<Stream>,
    figures: StreamingFigures,
    /// The ring kept from the last forward, with the next forward's leading units copied
    /// into it ahead (until the phase ends or a forward is aborted).
    kept: Option<KeptRing>,
    /// Forwards ended since the phase began (or the last abort).
    completed: usize,
    /// Whether the running forward copies the next forward's leading units ahead and keeps
    /// the ring for it.
    ahead: bool,
    /// The most leading units a forward from a phase's second on copies ahead for the next
    /// (0: none; [`StreamingConfig::copy_ahead`] off, or see [`StreamingEngine::ahead_limit`]);
    /// each forward copies up to the next placement's leading units.
    ahead_limit: usize,
    /// Units copied ahead for a next forward, over the engine's life.
    copied_ahead: u64,
    /// What was copied ahead for a next forward that did not come (the phase ended or a
    /// forward was aborted), over the engine's life.
    ahead_unused: AheadCopies,
}

/// Where a resident param's bytes are copied from. With registered mappings, a param
/// that lies wholly in a registered range is read through the registered view; one that
/// lies only partly in one (its neighbour in the file streams, and registrations are
/// rounded out to [`REGISTER_ALIGN`](crate::host_memory::REGISTER_ALIGN) blocks) is read from a
/// pageable copy of its bytes, since a copy from partly page-locked memory is refused
/// (CUDA: `CUDA_ERROR_INVALID_VALUE`). Otherwise its own host bytes.
fn resident_source(host: Option<&Host>, p: &Param) -> Result<HostSlice> {
    let src = p.host();
    let (Some(Host::Registered { sources, .. }), Some((map, range))) = (host, src.mapped_range())
    else {
        return Ok(src);
    };
    for view in sources {
        let Some((m, offset, len)) = view.registered_base().and_then(HostBuffer::mapping) else {
            continue;
        };
        if !Arc::ptr_eq(m, map) || offset >= range.end || range.start >= offset + len {
            continue;
        }
        if offset <= range.start && range.end <= offset + len {
            return view.slice(range.start - offset, range.len());
        }
        return Ok(src.with_bytes(HostBuffer::pageable_from).slice_all());
    }
    Ok(src)
}

/// Where the decoder's status lies in the ring buffer (coded units): the last aligned
/// block of [`crate::streaming::coded_ring_bytes`].
fn scratch_offset(figures: &StreamingFigures) -> u64 {
    figures.ring_bytes().saturating_sub(PARAM_ALIGN)
}

/// Bytes of one segment for the planner: its params, each aligned.
fn segment_bytes(params: &[Arc<Param>]) -> u64 {
    params.iter().map(|p| align_up(p.nbytes() as u64)).sum()
}

impl StreamingEngine {
    /// Builds the engine for `segments` (each a list of params that must be on the device
    /// together) started in the order `schedule` gives (indices into `segments`), copying
    /// on `copy`. With a budget, the residency planner picks the segments to keep resident
    /// so that `resident + slots × slot ≤ budget`; everything else streams. Host staging is
    /// prepared now (for a pinned home: the params' host bytes are replaced by it; with
    /// [`PinnedSource::Register`]: the mappings are registered, and only the params that
    /// are not mapped get a home); device memory is taken at the first
    /// [`StreamingEngine::begin_forward`].
    ///
    /// Errors: a budget too small for the ring ([`CoreError::Refused`]-style typed
    /// [`CoreError::InvalidOption`] with a hint), a pinned limit below one staging buffer,
    /// or below a required home ([`CoreError::PinnedLimit`]; below the lossless-coded units'
    /// home, [`CoreError::CodedPinnedLimit`]), or a device failure while
    /// registering (a registration the device refuses as unsupported falls back instead,
    /// [`StreamingFigures::register_fallback`]). On error nothing is changed and nothing
    /// stays pinned.
    pub fn new(
        device: Arc<dyn Device>,
        copy: Stream,
        segments: &[Vec<Arc<Param>>],
        schedule: &[usize],
        config: &StreamingConfig,
        metrics: Arc<RouteMetrics>,
    ) -> Result<Self> {
        let slots_wanted = config.ring_slots.max(2);
        // Residency: plan over the scheduled segments (each once).
        let mut order: Vec<usize> = Vec::new();
        let mut seen = HashSet::new();
        for &s in schedule {
            if s < segments.len() && seen.insert(s) {
                order.push(s);
            }
        }
        let mut resident_ids: HashSet<ParamId> = HashSet::new();
        let mut resident_params = Vec::new();
        let mut resident_segments = 0;
        if let Some(budget) = config.budget {
            let weighted: Vec<(String, u64)> = order
                .iter()
                .map(|&s| (s.to_string(), segment_bytes(&segments[s])))
                .collect();
            let model = config.slot_model();
            let plan = plan_residency_with(&weighted, budget, model);
            if !plan.fits() {
                return Err(ring_does_not_fit(
                    crate::Budget::Bytes(budget),
                    0,
                    plan.slot_bytes,
                    model.slots,
                ));
            }
            for path in &plan.resident {
                let s: usize = path.parse().unwrap_or(usize::MAX);
                if let Some(params) = segments.get(s) {
                    resident_segments += 1;
                    for p in params {
                        if resident_ids.insert(p.id()) {
                            resident_params.push(Arc::clone(p));
                        }
                    }
                }
            }
        }
        // Each resident param at the first position whose segment holds it.
        let mut resident_at: Vec<(usize, Vec<Arc<Param>>)> = Vec::new();
        let mut placed: HashSet<ParamId> = HashSet::new();
        for (pos, &s) in schedule.iter().enumerate() {
            let Some(params) = segments.get(s) else {
                continue;
            };
            let first: Vec<Arc<Param>> = params
                .iter()
                .filter(|p| resident_ids.contains(&p.id()) && placed.insert(p.id()))
                .cloned()
                .collect();
            if !first.is_empty() {
                resident_at.push((pos, first));
            }
        }
        // Registering copies straight from the file: order each unit by file offset so
        // that a module's tensors coalesce into one copy.
        // Registering applies to checkpoint mappings: with no streamed param mapped (owned
        // weights, random weights) the engine stages exactly as a pinned home does.
        let any_mapped = order.iter().any(|&s| {
            segments[s]
                .iter()
                .any(|p| !resident_ids.contains(&p.id()) && p.host().mapped_range().is_some())
        });
        let mut coded = config.compress == Compression::Lossless;
        let register = !coded
            && config.pinned_source == PinnedSource::Register
            && config.staging != StagingMode::Ring
            && any_mapped;
        let unit_order = if register {
            UnitOrder::Source
        } else {
            UnitOrder::Schedule
        };
        let layout = StagingLayout::with_order(
            segments,
            schedule,
            &resident_ids,
            config.unit_bytes,
            unit_order,
        );
        let units = layout.units().len();
        let slots = slots_wanted.min(units);
        let slot_bytes = layout.slot_bytes();
        if let Some(budget) = config.budget {
            let resident: u64 = resident_params.iter().map(|p| p.nbytes() as u64).sum();
            let coded_slots = if coded && slots > 0 {
                crate::streaming::coded_ring_bytes(slot_bytes)
            } else {
                0
            };
            let need = resident + slot_bytes * slots as u64 + coded_slots;
            if need > budget {
                return Err(CoreError::InvalidOption {
                    option: "budget".into(),
                    value: budget.to_string(),
                    hint: format!(
                        "resident weights and the ring need {need} B; raise the budget or lower unit_bytes"
                    ),
                });
            }
        }
        let info = device.memory_info();
        let pinned_room = config.pinned_limit.min(info.pinned_room());
        let home_bytes: u64 = layout.units().iter().map(|u| u.bytes).sum();
        // Lossless chosen by default over coded files gives way where its home does not
        // fit: the units stream uncoded (staged) and the coded params decode as staged.
        if coded && config.lossless_if_home_fits && coded::home_bound(&layout) > pinned_room {
            coded = false;
        }
        let setup = Instant::now();
        // Registered mappings first, when asked for and they fit; otherwise (or where the
        // device cannot register the memory) the engine stages as it does for a home.
        let mut register_fallback = None;
        let mut coded_cache_note = None;
        let mut coded_cache_path = None;
        let mut registered = None;
        // Two staging buffers of a slot each, or what the room allows.
        let staging_buffer_bytes =
            ((pinned_room / STAGING_BUFFERS as u64) / PARAM_ALIGN * PARAM_ALIGN).min(slot_bytes);
        if register && units > 0 {
            // Everything registered, the resident params' ranges too (for their one upload)
            // where that fits; else the streamed ranges; else, where a pinned home does not
            // fit either and none is required, as many units as fit beside two staging
            // buffers, the rest staged through them (better than staging every unit).
            let partial = config.staging == StagingMode::Auto && home_bytes > pinned_room;
            match RegisterPlan::within(
                &layout,
                &resident_params,
                pinned_room,
                partial.then_some(STAGING_BUFFERS as u64 * staging_buffer_bytes),
            ) {
                None => {
                    let all = RegisterPlan::new(&layout, &[]);
                    register_fallback = Some(format!(
                        "the registered ranges ({} B) and the pinned home of the params that are not mapped \
                         ({} B) need {} B, and not one unit's fits beside the staging buffers in the \
                         {pinned_room} B of pinned room left under the limit",
                        all.registered_bytes,
                        all.home_bytes,
                        all.pinned_bytes()
                    ));
                }
                Some(plan) => {
                    // Each staged unit is copied in chunks of a staging buffer.
                    let staged_copies = layout.units()[plan.staged_from..]
                        .iter()
                        .map(|u| u.bytes.div_ceil(staging_buffer_bytes.max(1)))
                        .sum();
                    match Self::build_registered(
                        &*device,
                        plan,
                        staging_buffer_bytes,
                        staged_copies,
                        (&layout, config.page_cache_limit),
                    ) {
                        Ok(built) => registered = Some(built),
                        Err(CoreError::HostRegisterUnsupported { reason, .. }) => {
                            register_fallback = Some(reason);
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
        }
        let use_home = match config.staging {
            StagingMode::PinnedHome => true,
            StagingMode::Ring => false,
            StagingMode::Auto => home_bytes <= pinned_room,
        };
        let copied_bytes = registered
            .as_ref()
            .map_or(0, |r: &Registered| r.copied_bytes);
        let resident_registered_bytes = registered
            .as_ref()
            .map_or(0, |r: &Registered| r.resident_registered_bytes);
        let (host, staging, pinned_bytes, released, copies) = if units == 0 {
            (
                None,
                StagingKind::Ring {
                    buffers: 0,
                    buffer_bytes: 0,
                },
                0,
                0,
                0,
            )
        } else if coded {
            let built = coded::build(&*device, &layout, pinned_room)?;
            let coded_bytes = built.coded_bytes;
            coded_cache_note = built.note;
            coded_cache_path = built.cache_path;
            (
                Some(Host::Coded {
                    home: built.home.home,
                    units: built.home.units,
                }),
                StagingKind::Coded {
                    coded_bytes,
                    raw_bytes: home_bytes,
                    exponent_entropy_millibits: built.entropy_millibits,
                    cache: built.cache,
                    coding_ns: built.coding_ns,
                },
                coded_bytes,
                built.released,
                units as u64,
            )
        } else if let Some(r) = registered {
            (
                Some(r.host),
                r.staging,
                r.pinned_bytes,
                r.released,
                r.copies,
            )
        } else if use_home {
            if home_bytes > pinned_room {
                return Err(CoreError::PinnedLimit {
                    requested: home_bytes,
                    pinned: info.pinned_host,
                    limit: pinned_room.saturating_add(info.pinned_host),
                });
            }
            let (host, released) = Self::build_home(&*device, &layout, home_bytes)?;
            (
                Some(host),
                StagingKind::PinnedHome,
                home_bytes,
                released,
                units as u64,
            )
        } else {
            const BUFFERS: usize = STAGING_BUFFERS;
            let buffer_bytes = staging_buffer_bytes;
            if buffer_bytes == 0 {
                return Err(CoreError::PinnedLimit {
                    requested: BUFFERS as u64 * PARAM_ALIGN,
                    pinned: info.pinned_host,
                    limit: pinned_room.saturating_add(info.pinned_host),
                });
            }
            let mut buffers = Vec::with_capacity(BUFFERS);
            for _ in 0..BUFFERS {
                buffers.push(device.alloc_pinned(buffer_bytes as usize)?);
            }
            let copies = layout
                .units()
                .iter()
                .map(|u| u.bytes.div_ceil(buffer_bytes))
                .sum();
            (
                Some(Host::Staged {
                    buffers,
                    last_copy: vec![None; BUFFERS],
                    next: 0,
                    reader: Box::new(StagedReader::new(
                        layout.units(),
                        0,
                        config.page_cache_limit,
                    )),
                }),
                StagingKind::Ring {
                    buffers: BUFFERS,
                    buffer_bytes,
                },
                buffer_bytes * BUFFERS as u64,
                0,
                copies,
            )
        };
        let staging_setup_ns = nanos(setup.elapsed());
        let home_times = match &host {
            Some(Host::Home { home, .. })
            | Some(Host::Registered {
                home: Some(home), ..
            }) => home.build_times(),
            _ => Default::default(),
        };
        let streamed_segments = order
            .iter()
            .filter(|&&s| segments[s].iter().any(|p| !resident_ids.contains(&p.id())))
            .count();
        let figures = StreamingFigures {
            resident_segments,
            streamed_segments,
            resident_bytes: resident_params.iter().map(|p| p.nbytes() as u64).sum(),
            streamed_bytes: match staging {
                StagingKind::Registered { .. } => copied_bytes,
                StagingKind::Coded { coded_bytes, .. } => coded_bytes,
                StagingKind::PinnedHome | StagingKind::Ring { .. } => layout.streamed_bytes(),
            },
            streamed_payload_bytes: layout.payload_bytes(),
            units,
            ring_slots: slots,
            slot_bytes,
            budget_bytes: config.budget,
            staging,
            pinned_bytes,
            host_bytes_released: released,
            copies_per_forward: copies,
            staging_setup_ns,
            home_times,
            resident_registered_bytes,
            register_fallback,
            coded_cache_note,
            coded_cache_path,
            disk_bytes_per_forward: host
                .as_ref()
                .and_then(Host::staged_reader)
                .map_or(0, StagedReader::evicted_per_forward),
        };
        let sizes: Vec<u64> = layout.units().iter().map(|u| u.bytes).collect();
        let placement = Arc::new(Placement::new(&sizes, slot_bytes * slots as u64));
        let base_placement = Arc::clone(&placement);
        let decode = if coded && units > 0 {
            Some(device.create_stream()?)
        } else {
            None
        };
        let mut engine = Self {
            compute: device.compute_stream(),
            decode,
            device,
            copy,
            metrics,
            layout,
            slots,
            placement,
            base_placement,
            unit_sizes: sizes,
            resident_params,
            resident_at,
            resident: ResidencyTable::new(),
            upload: None,
            host,
            ring: None,
            active: false,
            timeline: config.timeline,
            kept: None,
            completed: 0,
            ahead: false,
            ahead_limit: 0,
            copied_ahead: 0,
            ahead_unused: AheadCopies::default(),
            figures,
        };
        if config.copy_ahead {
            engine.ahead_limit = engine.ahead_limit();
        }
        Ok(engine)
    }

    /// Lays every unit out in one pinned buffer and makes it the params' host bytes.
    fn build_home(
        device: &dyn Device,
        layout: &StagingLayout,
        home_bytes: u64,
    ) -> Result<(Host, u64)> {
        let mut unit_offsets = Vec::with_capacity(layout.units().len());
        let mut placements = Vec::new();
        let mut at = 0u64;
        for unit in layout.units() {
            unit_offsets.push(at);
            for e in &unit.entries {
                placements.push((&e.param, at + e.offset));
            }
            at += unit.bytes;
        }
        // Chunks end between units: each unit's copy reads one pinned buffer.
        let home = PinnedHome::build_chunked(device, placements, home_bytes, &unit_offsets)?;
        let released = home.host_bytes_released();
        Ok((Host::Home { home, unit_offsets }, released))
    }

    /// Registers the plan's ranges of the checkpoint mappings in place and builds the
    /// pinned home of the params that are not mapped. On error everything made so far is
    /// dropped (registrations undone, no param changed).
    fn build_registered(
        device: &dyn Device,
        plan: RegisterPlan,
        staging_buffer_bytes: u64,
        staged_copies: u64,
        (layout, page_cache_limit): (&StagingLayout, Option<u64>),
    ) -> Result<Registered> {
        let mut sources = Vec::with_capacity(plan.spans.len());
        let mut registered_bytes = 0u64;
        for (i, (map, range)) in plan.spans.iter().enumerate() {
            let view = HostBuffer::mapped(Arc::clone(map), range.start, range.len())?;
            let registered = device.register_host(&view)?;
            if !plan.resident_only.contains(&i) {
                registered_bytes += registered.pinned_bytes().unwrap_or(range.len() as u64);
            }
            sources.push(registered);
        }
        // Registered runs copy their params' bytes; staged units copy whole units.
        let (copies, copied_bytes) = (
            plan.copies() + staged_copies,
            plan.copied_bytes() + plan.staged_bytes,
        );
        let (home, released) = if plan.home_bytes > 0 {
            let home = PinnedHome::build(
                device,
                plan.home.iter().map(|(p, at)| (p, *at)),
                plan.home_bytes,
            )?;
            let released = home.host_bytes_released();
            (Some(home), released)
        } else {
            (None, 0)
        };
        let staged_bytes = plan.staged_bytes;
        let staged = if plan.staged_from < plan.runs.len() {
            let mut buffers = Vec::with_capacity(STAGING_BUFFERS);
            for _ in 0..STAGING_BUFFERS {
                buffers.push(device.alloc_pinned(staging_buffer_bytes as usize)?);
            }
            Some(StagedUnits {
                from: plan.staged_from,
                buffers,
                last_copy: vec![None; STAGING_BUFFERS],
                next: 0,
                reader: Box::new(StagedReader::new(
                    layout.units(),
                    plan.staged_from,
                    page_cache_limit,
                )),
            })
        } else {
            None
        };
        let staging_pinned = staged
            .as_ref()
            .map_or(0, |s| s.buffers.len() as u64 * staging_buffer_bytes);
        let staging = StagingKind::Registered {
            registrations: sources.len() - plan.resident_only.len(),
            registered_bytes,
            home_bytes: plan.home_bytes,
            staged_bytes,
        };
        Ok(Registered {
            host: Host::Registered {
                sources,
                resident_only: plan.resident_only,
                home,
                runs: plan.runs,
                staged,
            },
            staging,
            pinned_bytes: registered_bytes + plan.home_bytes + staging_pinned,
            resident_registered_bytes: plan.resident_registered_bytes,
            released,
            copies,
            copied_bytes,
        })
    }

    /// Turns the registered ranges that only resident params needed into plain mapped views
    /// once their upload is queued, through [`Device::release_host`].
    fn release_resident_registrations(&mut self) -> Result<()> {
        let Some(Host::Registered {
            sources,
            resident_only,
            ..
        }) = self.host.as_mut()
        else {
            return Ok(());
        };
        for i in std::mem::take(resident_only) {
            let plain = match sources[i].registered_base().and_then(HostBuffer::mapping) {
                Some((map, offset, len)) => HostBuffer::mapped(Arc::clone(map), offset, len)?,
                None => continue,
            };
            // Unregistering waits for the device's queued work (on CUDA): the backend
            // keeps the view pinned until the device is idle (`Device::release_host`).
            self.device
                .release_host(std::mem::replace(&mut sources[i], plain));
        }
        Ok(())
    }

    /// The plan's figures.
    pub fn figures(&self) -> &StreamingFigures {
        &self.figures
    }

    /// Bytes of staged units whose pages were given back after their copies so far (past
    /// `page_cache_limit`, [`StreamingFigures::disk_bytes_per_forward`] per forward).
    pub fn pages_evicted(&self) -> u64 {
        self.host
            .as_ref()
            .and_then(Host::staged_reader)
            .map_or(0, StagedReader::evicted)
    }

    /// The layout.
    pub fn layout(&self) -> &StagingLayout {
        &self.layout
    }

    /// Params kept resident under the budget.
    pub fn resident_params(&self) -> &[Arc<Param>] {
        &self.resident_params
    }

    /// Where a copy of `p`'s bytes to the device must read them while this engine lives:
    /// outside the engine's own copies (resident params, leaves run off the schedule, params
    /// of no leaf), a param next to registered ones in the file may lie partly in a
    /// page-locked range, and a copy from partly page-locked memory is refused (CUDA:
    /// `CUDA_ERROR_INVALID_VALUE`). Such a param is read from a pageable copy of its
    /// bytes, one wholly inside a registered range through the registered view, any other
    /// from its own host bytes.
    pub fn host_source(&self, p: &Param) -> Result<HostSlice> {
        resident_source(self.host.as_ref(), p)
    }

    /// Whether a forward is running on the engine (between
    /// [`StreamingEngine::begin_forward`] and [`StreamingEngine::end_forward`] or
    /// [`StreamingEngine::abort`]).
    pub fn in_forward(&self) -> bool {
        self.active
    }

    /// Queues the whole upload of the resident params on the copy stream now, before any
    /// forward, and returns the bytes queued (0 when nothing is resident under the budget,
    /// the params are resident already, or a forward runs). The next forward waits for each
    /// batch before the first position that reads it, as it would for its own upload, so
    /// this moves the one-time upload out of the first forward: the pipeline planner does it
    /// while the phase before runs, where the link is idle. Takes the resident params'
    /// device memory at once; on an error nothing stays resident.
    pub fn upload_resident(&mut self) -> Result<u64> {
        if self.active || !self.resident.is_empty() || self.resident_params.is_empty() {
            return Ok(0);
        }
        self.upload = Some(FirstUpload {
            next_queue: 0,
            next_wait: 0,
            ready: (0..self.resident_at.len()).map(|_| None).collect(),
            queued: std::time::Duration::ZERO,
            pages_kept: Vec::new(),
        });
        if let Err(e) = self.queue_residents_before(usize::MAX) {
            // `abort` drops a partly queued upload and its residency.
            let _ = self.abort();
            return Err(e);
        }
        Ok(self.figures.resident_bytes)
    }

    /// Stops the running forward: waits for the copy and compute streams, drops the ring
    /// and leaves the streamed params host-only. Resident params stay.
    pub fn abort(&mut self) -> Result<()> {
        self.active = false;
        self.completed = 0;
        self.ahead = false;
        // A kept ring goes once the copies made ahead into it are done; those copies, and
        // any a running forward made, were for nothing.
        let kept = self.kept.take().map(|k| {
            self.ahead_unused.add(k.ahead);
            k.buffer
        });
        if let Some(ring) = &self.ring {
            self.ahead_unused.add(ring.ahead);
        }
        if self.upload_unfinished() {
            // Part of the first upload may be queued: the next forward uploads them all
            // again, from an empty residency.
            self.upload = None;
            let copy = self
                .device
                .synchronize_stream(&self.copy)
                .and(self.synchronize_decode());
            let compute = self.device.synchronize_stream(&self.compute);
            self.resident
                .release_all(&*self.device, FreeMode::Immediate, &self.compute);
            if let Some(ring) = self.ring.take() {
                self.clear_streamed_pointers();
                drop(ring);
            }
            drop(kept);
            return copy.and(compute);
        }
        self.upload = None;
        let ring = self.ring.take();
        if ring.is_none() && kept.is_none() {
            return Ok(());
        }
        let copy = self
            .device
            .synchronize_stream(&self.copy)
            .and(self.synchronize_decode());
        let compute = self.device.synchronize_stream(&self.compute);
        if ring.is_some() {
            self.clear_streamed_pointers();
        }
        drop(ring);
        drop(kept);
        copy.and(compute)
    }

    /// Whether the first upload of a phase has batches compute has not waited for.
    fn upload_unfinished(&self) -> bool {
        self.upload
            .as_ref()
            .is_some_and(|u| u.next_wait < self.resident_at.len())
    }

    /// Phase boundary: [`StreamingEngine::abort`] and drop the resident params' device
    /// copies too. Host staging stays for the next phase.
    pub fn release_device(&mut self) -> Result<()> {
        let aborted = self.abort();
        let synced = self.device.synchronize_stream(&self.compute);
        self.resident
            .release_all(&*self.device, FreeMode::Immediate, &self.compute);
        aborted.and(synced)
    }

    /// Releases everything: device memory, then host staging. A pinned home gives the
    /// params their bytes back in owned pageable memory (one copy again, never two at once
    /// per param); registered mappings are unregistered (the params still point into
    /// them). Idempotent.
    pub fn teardown(&mut self) -> Result<()> {
        let released = self.release_device();
        let staged = self.device.synchronize_stream(&self.copy);
        let restored = match self.host.take() {
            Some(Host::Home { home, .. }) => home.restore(),
            Some(Host::Registered { sources, home, .. }) => {
                // Registered views unregister once let go (copies still holding one have
                // completed: the copy stream was synchronised), where the backend's
                // unregistering does not stall queued work (`Device::release_host`).
                for view in sources {
                    self.device.release_host(view);
                }
                home.map_or(Ok(()), PinnedHome::restore)
            }
            Some(Host::Staged { .. }) | Some(Host::Coded { .. }) | None => Ok(()),
        };
        self.figures.pinned_bytes = 0;
        released.and(staged).and(restored)
    }
}

impl Drop for StreamingEngine {
    fn drop(&mut self) {
        // Errors are not reportable from drop; teardown still releases what it holds.
        let _ = self.teardown();
    }
}

/// Staging buffers a staged host side copies through.
const STAGING_BUFFERS: usize = 2;
