//! The live counters a route updates while it runs ([`RouteMetrics`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use crate::{CodedFigures, DetachSummary, PhasePeak, RouteCounters, StreamingHost, Timeline};

/// Live counters of one attached route. Cheap to update from the per-leaf path (relaxed
/// atomics); shared between the route and its handle behind an `Arc`.
#[derive(Debug, Default)]
pub struct RouteMetrics {
    h2d_bytes: AtomicU64,
    h2d_copies: AtomicU64,
    d2h_bytes: AtomicU64,
    d2h_copies: AtomicU64,
    copy_wait_ns: AtomicU64,
    forwards: AtomicU64,
    leaf_calls: AtomicU64,
    resident_weight_bytes: AtomicU64,
    pinned_host_bytes: AtomicU64,
    peak_pinned_host_bytes: AtomicU64,
    leaves_streamed: AtomicU64,
    leaves_resident: AtomicU64,
    schedule_relearned: AtomicU64,
    streamed_bytes_per_forward: AtomicU64,
    disk_bytes_per_forward: AtomicU64,
    transfer_units: AtomicU64,
    ring_slots: AtomicU64,
    ring_slot_bytes: AtomicU64,
    staging_buffers: AtomicU64,
    host_registrations: AtomicU64,
    registered_host_bytes: AtomicU64,
    staging_setup_ns: AtomicU64,
    home_pin_ns: AtomicU64,
    home_fill_ns: AtomicU64,
    register_fallbacks: AtomicU64,
    resident_upload_ns: AtomicU64,
    resident_upload_sync_ns: AtomicU64,
    resident_leaves: Mutex<Vec<String>>,
    phases: Mutex<Vec<PhasePeak>>,
    detach_reports: Mutex<Vec<DetachSummary>>,
    timeline: Mutex<Option<Timeline>>,
    first_timeline: Mutex<Option<Timeline>>,
    coded: Mutex<Option<CodedFigures>>,
}

impl RouteMetrics {
    /// New, all-zero counters.
    pub fn new() -> Self {
        Self::default()
    }

    /// Keeps the last streamed forward's timeline (route option `timeline=true`), and the
    /// first one recorded (a phase's first forward, which makes the resident part resident
    /// and takes a new ring, differs from the steady ones).
    pub fn set_timeline(&self, timeline: Timeline) {
        self.first_timeline
            .lock()
            .get_or_insert_with(|| timeline.clone());
        *self.timeline.lock() = Some(timeline);
    }

    /// The first streamed forward's timeline, if one was recorded.
    pub fn first_timeline(&self) -> Option<Timeline> {
        self.first_timeline.lock().clone()
    }

    /// The last streamed forward's timeline, if one was recorded.
    pub fn timeline(&self) -> Option<Timeline> {
        self.timeline.lock().clone()
    }

    /// Records what lossless-coded streaming holds (`None`: the route streams raw).
    pub fn set_coded(&self, coded: Option<CodedFigures>) {
        *self.coded.lock() = coded;
    }

    /// What lossless-coded streaming holds, when the route streams coded units.
    pub fn coded(&self) -> Option<CodedFigures> {
        self.coded.lock().clone()
    }

    /// Records one host→device copy of `bytes`.
    pub fn record_h2d(&self, bytes: u64) {
        self.h2d_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.h2d_copies.fetch_add(1, Ordering::Relaxed);
    }

    /// Records one device→host copy of `bytes`.
    pub fn record_d2h(&self, bytes: u64) {
        self.d2h_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.d2h_copies.fetch_add(1, Ordering::Relaxed);
    }

    /// Adds time the host spent blocked waiting for copies to finish.
    pub fn record_copy_wait(&self, waited: Duration) {
        let ns = u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX);
        self.copy_wait_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Adds a resident set's upload: `queued`, the host time allocating it and queueing its
    /// copies; `synced`, the time from then until the copies finished (measured only where
    /// the caller synchronises to measure it; zero otherwise).
    pub fn record_resident_upload(&self, queued: Duration, synced: Duration) {
        let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.resident_upload_ns
            .fetch_add(ns(queued), Ordering::Relaxed);
        self.resident_upload_sync_ns
            .fetch_add(ns(synced), Ordering::Relaxed);
    }

    /// Records one whole forward of the component.
    pub fn record_forward(&self) {
        self.forwards.fetch_add(1, Ordering::Relaxed);
    }

    /// Records one leaf execution.
    pub fn record_leaf_call(&self) {
        self.leaf_calls.fetch_add(1, Ordering::Relaxed);
    }

    /// Number of forwards recorded so far.
    pub fn forwards(&self) -> u64 {
        self.forwards.load(Ordering::Relaxed)
    }

    /// Records that the learned leaf order changed and was learned again.
    pub fn record_schedule_relearned(&self) {
        self.schedule_relearned.fetch_add(1, Ordering::Relaxed);
    }

    /// Sets the bytes of weights kept resident on the device by the route.
    pub fn set_resident_weight_bytes(&self, bytes: u64) {
        self.resident_weight_bytes.store(bytes, Ordering::Relaxed);
    }

    /// Sets the pinned host bytes the route currently holds (and tracks their peak).
    pub fn set_pinned_host_bytes(&self, bytes: u64) {
        self.pinned_host_bytes.store(bytes, Ordering::Relaxed);
        self.peak_pinned_host_bytes
            .fetch_max(bytes, Ordering::Relaxed);
    }

    /// Sets how many leaves the route streams and how many it keeps resident.
    pub fn set_leaf_plan(&self, streamed: u64, resident: u64) {
        self.leaves_streamed.store(streamed, Ordering::Relaxed);
        self.leaves_resident.store(resident, Ordering::Relaxed);
    }

    /// Names the leaves (or groups) a budget keeps resident, in execution order.
    pub fn set_resident_leaves(&self, names: Vec<String>) {
        *self.resident_leaves.lock() = names;
    }

    /// The leaves (or groups) kept resident, as last set.
    pub fn resident_leaves(&self) -> Vec<String> {
        self.resident_leaves.lock().clone()
    }

    /// Sets the streaming engine's plan: bytes copied per forward, transfer units per
    /// forward, device ring slots and the bytes of each, and pinned staging buffers (0: the
    /// weights live in one pinned home and copies run straight from it).
    pub fn set_streaming_plan(
        &self,
        streamed_bytes_per_forward: u64,
        transfer_units: u64,
        ring_slots: u64,
        ring_slot_bytes: u64,
        staging_buffers: u64,
    ) {
        self.streamed_bytes_per_forward
            .store(streamed_bytes_per_forward, Ordering::Relaxed);
        self.transfer_units.store(transfer_units, Ordering::Relaxed);
        self.ring_slots.store(ring_slots, Ordering::Relaxed);
        self.ring_slot_bytes
            .store(ring_slot_bytes, Ordering::Relaxed);
        self.staging_buffers
            .store(staging_buffers, Ordering::Relaxed);
    }

    /// Sets the bytes the streaming engine reads from the disk per forward (the staged units
    /// past its page cache limit).
    pub fn set_disk_bytes_per_forward(&self, bytes: u64) {
        self.disk_bytes_per_forward.store(bytes, Ordering::Relaxed);
    }

    /// Sets where the streaming engine's copies read from (see [`StreamingHost`]); a build
    /// that fell back from registered mappings is counted.
    pub fn set_streaming_host(&self, host: StreamingHost) {
        self.host_registrations
            .store(host.registrations, Ordering::Relaxed);
        self.registered_host_bytes
            .store(host.registered_bytes, Ordering::Relaxed);
        self.staging_setup_ns
            .store(host.setup_ns, Ordering::Relaxed);
        self.home_pin_ns.store(host.home_pin_ns, Ordering::Relaxed);
        self.home_fill_ns
            .store(host.home_fill_ns, Ordering::Relaxed);
        if host.register_fell_back {
            self.register_fallbacks.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Appends a finished phase's peaks.
    pub fn push_phase(&self, phase: PhasePeak) {
        self.phases.lock().push(phase);
    }

    /// Appends a detach report.
    pub fn push_detach(&self, report: DetachSummary) {
        self.detach_reports.lock().push(report);
    }

    /// Copies the counters into a [`RouteCounters`] value.
    pub fn counters(&self) -> RouteCounters {
        RouteCounters {
            h2d_bytes: self.h2d_bytes.load(Ordering::Relaxed),
            h2d_copies: self.h2d_copies.load(Ordering::Relaxed),
            d2h_bytes: self.d2h_bytes.load(Ordering::Relaxed),
            d2h_copies: self.d2h_copies.load(Ordering::Relaxed),
            copy_wait_ns: self.copy_wait_ns.load(Ordering::Relaxed),
            forwards: self.forwards.load(Ordering::Relaxed),
            leaf_calls: self.leaf_calls.load(Ordering::Relaxed),
            resident_weight_bytes: self.resident_weight_bytes.load(Ordering::Relaxed),
            pinned_host_bytes: self.pinned_host_bytes.load(Ordering::Relaxed),
            peak_pinned_host_bytes: self.peak_pinned_host_bytes.load(Ordering::Relaxed),
            leaves_streamed: self.leaves_streamed.load(Ordering::Relaxed),
            leaves_resident: self.leaves_resident.load(Ordering::Relaxed),
            schedule_relearned: self.schedule_relearned.load(Ordering::Relaxed),
            streamed_bytes_per_forward: self.streamed_bytes_per_forward.load(Ordering::Relaxed),
            disk_bytes_per_forward: self.disk_bytes_per_forward.load(Ordering::Relaxed),
            transfer_units: self.transfer_units.load(Ordering::Relaxed),
            ring_slots: self.ring_slots.load(Ordering::Relaxed),
            ring_slot_bytes: self.ring_slot_bytes.load(Ordering::Relaxed),
            staging_buffers: self.staging_buffers.load(Ordering::Relaxed),
            host_registrations: self.host_registrations.load(Ordering::Relaxed),
            registered_host_bytes: self.registered_host_bytes.load(Ordering::Relaxed),
            staging_setup_ns: self.staging_setup_ns.load(Ordering::Relaxed),
            home_pin_ns: self.home_pin_ns.load(Ordering::Relaxed),
            home_fill_ns: self.home_fill_ns.load(Ordering::Relaxed),
            register_fallbacks: self.register_fallbacks.load(Ordering::Relaxed),
            resident_upload_ns: self.resident_upload_ns.load(Ordering::Relaxed),
            resident_upload_sync_ns: self.resident_upload_sync_ns.load(Ordering::Relaxed),
        }
    }

    /// The phases recorded so far.
    pub fn phases(&self) -> Vec<PhasePeak> {
        self.phases.lock().clone()
    }

    /// The detach reports recorded so far.
    pub fn detach_reports(&self) -> Vec<DetachSummary> {
        self.detach_reports.lock().clone()
    }
}
