//! Counters, per-phase peaks and profile snapshots for DDO.
//!
//! This is the bottom crate of the workspace: it depends on no other DDO crate. Routes
//! (in `ddo-routes`) record into a shared [`RouteMetrics`] while they run; the offload
//! handle turns those live counters plus the device's memory figures into a plain-data
//! [`MetricsSnapshot`], which prints as a human-readable profile
//! ([`MetricsSnapshot::format_profile`]) or as JSON ([`MetricsSnapshot::to_json`]).
//! Every memory figure says where it came from: exact allocator accounting, or a sampled
//! driver figure.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

pub mod timeline;
pub use timeline::{CopyGap, HostWait, IdleCause, Timeline, TimelineSummary, UnitTiming};

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

/// What a streaming engine with lossless-coded units (`compress=lossless`) holds, for
/// [`RouteMetrics::set_coded`]: the coded size and exponent entropy of the component's
/// streamed weights, where the coded units came from, and the host pages released.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CodedFigures {
    /// Bytes of the coded units (what crosses the link per forward).
    pub coded_bytes: u64,
    /// Bytes of the raw units they code.
    pub raw_bytes: u64,
    /// Shannon entropy of the units' bf16 exponents, thousandths of a bit per word.
    pub exponent_entropy_millibits: u64,
    /// `used` (read from the cache beside the checkpoint), `built` (coded, cache written)
    /// or `unavailable` (coded with no cache).
    pub cache: String,
    /// Why the cache was not used, when it was not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_note: Option<String>,
    /// The cache file's path, where the weights are mapped from checkpoint files (used or
    /// not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_path: Option<String>,
    /// Nanoseconds spent getting the coded units (coding, or reading the cache; the
    /// content hash of the raw units included).
    pub coding_ns: u64,
    /// Bytes of the streamed params' file pages released from the process (the coded
    /// units are their one host copy).
    pub host_bytes_released: u64,
}

impl CodedFigures {
    /// Coded bytes over raw bytes (1 when there are none).
    pub fn ratio(&self) -> f64 {
        if self.raw_bytes == 0 {
            1.0
        } else {
            self.coded_bytes as f64 / self.raw_bytes as f64
        }
    }

    /// One line for a profile: `coded: ` and [`CodedFigures::summary`].
    pub fn format_line(&self) -> String {
        format!("coded: {}", self.summary())
    }

    /// The figures in words: sizes, entropy, the cache's state, path and note, the time
    /// and the pages released (a report that names the component puts `coded: NAME`
    /// before it).
    pub fn summary(&self) -> String {
        let at = self
            .cache_path
            .as_ref()
            .map(|p| format!(" at {p}"))
            .unwrap_or_default();
        let note = self
            .cache_note
            .as_ref()
            .map(|n| format!(" ({n})"))
            .unwrap_or_default();
        // Units read coded from their files were not coded here: no entropy measured.
        let entropy = if self.exponent_entropy_millibits > 0 {
            format!(
                ", exponent entropy {:.3} bits",
                self.exponent_entropy_millibits as f64 / 1000.0
            )
        } else {
            String::new()
        };
        format!(
            "{} of {} ({:.3}){entropy}, cache {}{at}{note}, {:.2} s to get them, {} of host pages released",
            format_bytes(self.coded_bytes),
            format_bytes(self.raw_bytes),
            self.ratio(),
            self.cache,
            self.coding_ns as f64 / 1e9,
            format_bytes(self.host_bytes_released)
        )
    }
}

/// Where a streaming engine's copies read from, for [`RouteMetrics::set_streaming_host`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamingHost {
    /// Ranges of checkpoint mappings page-locked in place (0: a pinned home or staging
    /// buffers).
    pub registrations: u64,
    /// Bytes those ranges page-lock.
    pub registered_bytes: u64,
    /// Nanoseconds taken to set the host side up (home copy, registrations).
    pub setup_ns: u64,
    /// Of a pinned home's build: nanoseconds spent allocating and page-locking its chunks,
    /// summed over the threads that did it in parallel.
    pub home_pin_ns: u64,
    /// Of a pinned home's build: nanoseconds spent copying the weights in, summed over
    /// threads.
    pub home_fill_ns: u64,
    /// Whether registered mappings were asked for (`pinned_source=register`) but the
    /// engine staged otherwise.
    pub register_fell_back: bool,
}

/// A copy of a route's counters at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouteCounters {
    /// Bytes copied host→device.
    pub h2d_bytes: u64,
    /// Number of host→device copies.
    pub h2d_copies: u64,
    /// Bytes copied device→host.
    pub d2h_bytes: u64,
    /// Number of device→host copies.
    pub d2h_copies: u64,
    /// Nanoseconds the host spent blocked waiting for copies.
    pub copy_wait_ns: u64,
    /// Whole forwards run.
    pub forwards: u64,
    /// Leaf executions run.
    pub leaf_calls: u64,
    /// Weight bytes the route keeps resident on the device.
    pub resident_weight_bytes: u64,
    /// Pinned host bytes the route holds now.
    pub pinned_host_bytes: u64,
    /// Most pinned host bytes the route held at once.
    pub peak_pinned_host_bytes: u64,
    /// Leaves whose weights move per forward.
    pub leaves_streamed: u64,
    /// Leaves whose weights stay on the device.
    pub leaves_resident: u64,
    /// Times the learned leaf order changed and was learned again.
    pub schedule_relearned: u64,
    /// Bytes the streaming engine copies to the device per forward (0 without the engine).
    #[serde(default)]
    pub streamed_bytes_per_forward: u64,
    /// Of the bytes staged per forward, those read from the disk again every forward (past
    /// the engine's `page_cache_limit`; 0 when every staged page stays cached).
    #[serde(default)]
    pub disk_bytes_per_forward: u64,
    /// Transfer units per forward (one copy each).
    #[serde(default)]
    pub transfer_units: u64,
    /// Device ring slots of the streaming engine.
    #[serde(default)]
    pub ring_slots: u64,
    /// Bytes of one ring slot (the largest transfer unit).
    #[serde(default)]
    pub ring_slot_bytes: u64,
    /// Pinned staging buffers (0: copies run from one pinned home of the weights, or from
    /// registered checkpoint mappings).
    #[serde(default)]
    pub staging_buffers: u64,
    /// Checkpoint mapping ranges the streaming engine page-locked in place
    /// (`pinned_source=register`; 0: it copies from a pinned home or staging buffers).
    #[serde(default)]
    pub host_registrations: u64,
    /// Bytes of those ranges (part of `pinned_host_bytes`).
    #[serde(default)]
    pub registered_host_bytes: u64,
    /// Nanoseconds the streaming engine took to set its host side up when it was last
    /// built (copying the weights into a pinned home, or registering the mappings).
    #[serde(default)]
    pub staging_setup_ns: u64,
    /// Of a pinned home's build: ns allocating and page-locking its chunks, summed over
    /// the threads that did it in parallel.
    #[serde(default)]
    pub home_pin_ns: u64,
    /// Of a pinned home's build: ns copying the weights in, summed over threads.
    #[serde(default)]
    pub home_fill_ns: u64,
    /// Engine builds that were asked to register the mappings but staged otherwise (the
    /// device could not, or the bytes did not fit under the pinned limit).
    #[serde(default)]
    pub register_fallbacks: u64,
    /// Host ns allocating resident sets and queueing their uploads (a streaming engine's
    /// first forward).
    #[serde(default)]
    pub resident_upload_ns: u64,
    /// Ns from then until those uploads finished, where measured (`timeline=true`).
    #[serde(default)]
    pub resident_upload_sync_ns: u64,
}

/// Peak device memory of one finished phase.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PhasePeak {
    /// Phase name (`prompt_encoding`, `denoise`, `decode`, or a caller's name).
    pub phase: String,
    /// Peak of the allocator's exact accounting during the phase (bytes).
    pub allocator_peak_bytes: u64,
    /// Allocator bytes still allocated when the phase ended, after cleanup.
    pub allocator_end_bytes: u64,
    /// Peak of the driver's used-memory figure, sampled at phase end (bytes), when the
    /// backend has a driver to ask.
    pub driver_used_sampled_bytes: Option<u64>,
    /// The native VMM pool's figures for the phase (peaks since the previous boundary),
    /// when the device's allocator is the native one.
    #[serde(default)]
    pub native_pool: Option<NativePoolFigures>,
}

/// The native VMM allocator's exact figures at one moment (all bytes).
///
/// `reserved` is virtual address space (costs no memory); `mapped` is the physical memory
/// the pool holds from the driver (its "reserved" in PyTorch's sense); `live` is what live
/// allocations asked for. Peaks run since the last phase boundary.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NativePoolFigures {
    /// Virtual address space reserved (fixed at install).
    pub reserved_va_bytes: u64,
    /// Address range held by live allocations and by frees still waiting for their streams.
    pub va_in_use_bytes: u64,
    /// Peak of `va_in_use_bytes`.
    pub peak_va_in_use_bytes: u64,
    /// Physical memory mapped into the range.
    pub mapped_bytes: u64,
    /// Peak of `mapped_bytes`.
    pub peak_mapped_bytes: u64,
    /// Bytes asked for by live allocations.
    pub live_bytes: u64,
    /// Peak of `live_bytes`.
    pub peak_live_bytes: u64,
    /// Chunks mapped since install.
    pub chunks_mapped: u64,
    /// Chunks released to the driver since install.
    pub chunks_released: u64,
    /// Bytes released to the driver since install.
    pub bytes_released: u64,
    /// Of `bytes_released`, bytes whose release the driver's free-memory figure confirmed.
    pub bytes_proven_returned: u64,
}

impl NativePoolFigures {
    /// Mapped-bytes peak over live-bytes peak (1.0 for an empty pool): how much physical
    /// memory the pool held per byte in use at its worst.
    pub fn mapped_over_live_peak(&self) -> f64 {
        if self.peak_live_bytes == 0 {
            1.0
        } else {
            self.peak_mapped_bytes as f64 / self.peak_live_bytes as f64
        }
    }

    /// One line for profiles.
    pub fn format_line(&self) -> String {
        format!(
            "native pool: live {} (peak {}), mapped {} (peak {}, {:.3}x live peak), va in use {} of {}; \
             chunks mapped {}, released {} ({}, {} proven by the driver)",
            format_bytes(self.live_bytes),
            format_bytes(self.peak_live_bytes),
            format_bytes(self.mapped_bytes),
            format_bytes(self.peak_mapped_bytes),
            self.mapped_over_live_peak(),
            format_bytes(self.va_in_use_bytes),
            format_bytes(self.reserved_va_bytes),
            self.chunks_mapped,
            self.chunks_released,
            format_bytes(self.bytes_released),
            format_bytes(self.bytes_proven_returned),
        )
    }
}

/// What one release of the native pool's idle cache returned.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdleCacheRelease {
    /// Physical chunks unmapped and released.
    pub chunks: u64,
    /// Their bytes.
    pub bytes: u64,
    /// Driver free bytes sampled just before, where there is a driver.
    pub driver_free_before: Option<u64>,
    /// Driver free bytes sampled just after, where there is a driver.
    pub driver_free_after: Option<u64>,
    /// Whether the driver's free figure rose by at least `bytes` (false without a driver).
    pub proven: bool,
    /// Why the device was known to be quiescent.
    pub basis: String,
}

/// Why a group was not copied by `detach_auxiliary_cpu_sources`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkippedGroup {
    /// The group (module path).
    pub group: String,
    /// Bytes the group would have copied.
    pub bytes: u64,
    /// Why it was skipped.
    pub reason: String,
}

/// What `detach_auxiliary_cpu_sources` did, with resident memory and the checkpoint
/// mapping measured separately.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DetachSummary {
    /// Whether the operation was enabled (a disabled call changes nothing).
    pub enabled: bool,
    /// The explicit copy bound the caller gave (bytes).
    pub max_copy_bytes: u64,
    /// Bytes copied from checkpoint mappings into owned memory.
    pub bytes_copied: u64,
    /// Groups copied.
    pub groups_copied: u64,
    /// Tensors whose host source changed (registered aliases count once).
    pub tensors_copied: u64,
    /// Groups left as they were, and why.
    pub groups_skipped: Vec<SkippedGroup>,
    /// Checkpoint mappings whose last reference was dropped by this operation.
    pub mappings_released: u64,
    /// Total size of the released mappings (bytes).
    pub mapping_bytes_released: u64,
    /// `RssAnon` before, from `/proc/self/status` (bytes), where available.
    pub rss_anon_before: Option<u64>,
    /// `RssAnon` after (bytes), where available.
    pub rss_anon_after: Option<u64>,
    /// `RssFile` before (bytes), where available.
    pub rss_file_before: Option<u64>,
    /// `RssFile` after (bytes), where available.
    pub rss_file_after: Option<u64>,
    /// The process's commit charge before (bytes): Windows' private commit, which releasing
    /// a checkpoint's ownership can lower without a similar drop in resident memory. `None`
    /// where the OS has no per-process figure for it (Linux charges no commit for a
    /// read-only file mapping and reports none per process).
    #[serde(default)]
    pub commit_before: Option<u64>,
    /// The commit charge after (bytes), where measured.
    #[serde(default)]
    pub commit_after: Option<u64>,
    /// True only when a measured drop of the commit charge (`commit_before` →
    /// `commit_after`) backs the claim that releasing the mappings returned commit; a drop
    /// of `RssFile` is resident memory, not commit, and proves nothing here. Conservative:
    /// false whenever the commit was not measured.
    pub commit_recovery_proven: bool,
}

impl DetachSummary {
    /// Human-readable report.
    pub fn format_profile(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "detach_auxiliary_cpu_sources");
        if !self.enabled {
            let _ = writeln!(s, "  disabled: nothing copied, nothing released");
            return s;
        }
        let _ = writeln!(
            s,
            "  copied {} in {} group(s), {} tensor(s) (bound {})",
            format_bytes(self.bytes_copied),
            self.groups_copied,
            self.tensors_copied,
            format_bytes(self.max_copy_bytes)
        );
        for g in &self.groups_skipped {
            let _ = writeln!(
                s,
                "  skipped {} ({}): {}",
                g.group,
                format_bytes(g.bytes),
                g.reason
            );
        }
        let _ = writeln!(
            s,
            "  checkpoint mappings released: {} ({})",
            self.mappings_released,
            format_bytes(self.mapping_bytes_released)
        );
        let _ = writeln!(
            s,
            "  RssAnon {} -> {}, RssFile {} -> {}",
            opt_bytes(self.rss_anon_before),
            opt_bytes(self.rss_anon_after),
            opt_bytes(self.rss_file_before),
            opt_bytes(self.rss_file_after)
        );
        let commit = match (self.commit_before, self.commit_after) {
            (Some(b), Some(a)) => format!("{} -> {}", format_bytes(b), format_bytes(a)),
            _ => "not measured on this OS".to_string(),
        };
        let _ = writeln!(s, "  commit {commit}");
        let _ = writeln!(
            s,
            "  commit_recovery_proven: {}",
            self.commit_recovery_proven
        );
        s
    }
}

/// Device memory figures, each labelled by its source.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceMemoryFigures {
    /// Bytes allocated now (exact allocator accounting).
    pub allocated_bytes: u64,
    /// Peak bytes allocated since the last reset (exact allocator accounting).
    pub peak_allocated_bytes: u64,
    /// Bytes the allocator holds from the driver, in use or cached (exact).
    pub reserved_bytes: u64,
    /// The device's capacity (bytes).
    pub capacity_bytes: u64,
    /// Free bytes as the driver reports them (sampled), when there is a driver.
    pub driver_free_bytes: Option<u64>,
    /// Pinned host bytes the device has handed out (exact).
    pub pinned_host_bytes: u64,
    /// The native VMM pool's figures, when it is the device's allocator.
    #[serde(default)]
    pub native_pool: Option<NativePoolFigures>,
}

/// Everything a route reports, at one moment: `metrics_snapshot()`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetricsSnapshot {
    /// Component name.
    pub component: String,
    /// Route that runs it (`none`, `diffusers_group_offload`, ...).
    pub route: String,
    /// Route options in words.
    pub route_options: String,
    /// Resolved preset, when the route came through a preset.
    pub preset: Option<String>,
    /// What decided the route (explicit, component policy, environment, preset default).
    pub decided_by: String,
    /// Device the component executes on.
    pub device: String,
    /// Allocator installed on that device (`caching` or `native_vmm`).
    pub allocator: String,
    /// The route's counters.
    pub counters: RouteCounters,
    /// Device memory now.
    pub memory: DeviceMemoryFigures,
    /// Finished phases, in order.
    pub phases: Vec<PhasePeak>,
    /// Detach reports, in order.
    pub detach_reports: Vec<DetachSummary>,
    /// The leaves (or groups) a budget keeps resident; the others stream.
    #[serde(default)]
    pub resident_leaves: Vec<String>,
    /// The last streamed forward's timeline (route option `timeline=true`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeline: Option<Timeline>,
    /// The first streamed forward's timeline (route option `timeline=true`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_timeline: Option<Timeline>,
    /// What lossless-coded streaming holds (`compress=lossless`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coded: Option<CodedFigures>,
}

impl MetricsSnapshot {
    /// JSON form of the snapshot.
    pub fn to_json(&self) -> Result<String, serde_json::Error> {
        serde_json::to_string_pretty(self)
    }

    /// Human-readable profile.
    pub fn format_profile(&self) -> String {
        let c = &self.counters;
        let m = &self.memory;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "[{}] route {} ({}) on {} [{} allocator]",
            self.component, self.route, self.route_options, self.device, self.allocator
        );
        let _ = writeln!(
            s,
            "  decided by {}{}",
            self.decided_by,
            self.preset
                .as_ref()
                .map(|p| format!(", preset {p}"))
                .unwrap_or_default()
        );
        let _ = writeln!(
            s,
            "  forwards {}, leaf calls {}, leaves streamed {} / resident {}",
            c.forwards, c.leaf_calls, c.leaves_streamed, c.leaves_resident
        );
        let _ = writeln!(
            s,
            "  host->device {} in {} copies, device->host {} in {} copies, waited {:.3} ms on copies",
            format_bytes(c.h2d_bytes),
            c.h2d_copies,
            format_bytes(c.d2h_bytes),
            c.d2h_copies,
            c.copy_wait_ns as f64 / 1e6
        );
        let _ = writeln!(
            s,
            "  resident weights {}, pinned host {} (peak {})",
            format_bytes(c.resident_weight_bytes),
            format_bytes(c.pinned_host_bytes),
            format_bytes(c.peak_pinned_host_bytes)
        );
        let _ = writeln!(
            s,
            "  device memory (allocator, exact): now {}, peak {}, reserved {} of {}{}",
            format_bytes(m.allocated_bytes),
            format_bytes(m.peak_allocated_bytes),
            format_bytes(m.reserved_bytes),
            format_bytes(m.capacity_bytes),
            m.driver_free_bytes
                .map(|f| format!("; driver free (sampled) {}", format_bytes(f)))
                .unwrap_or_default()
        );
        if let Some(pool) = &m.native_pool {
            let _ = writeln!(s, "  {}", pool.format_line());
        }
        for p in &self.phases {
            let _ = writeln!(
                s,
                "  phase {}: peak {} (allocator, exact), {} left after cleanup{}",
                p.phase,
                format_bytes(p.allocator_peak_bytes),
                format_bytes(p.allocator_end_bytes),
                p.driver_used_sampled_bytes
                    .map(|d| format!(", driver used {} (sampled)", format_bytes(d)))
                    .unwrap_or_default()
            );
        }
        for p in &self.phases {
            if let Some(pool) = &p.native_pool {
                let _ = writeln!(s, "    phase {}: {}", p.phase, pool.format_line());
            }
        }
        if c.disk_bytes_per_forward > 0 {
            let _ = writeln!(
                s,
                "  disk tier: {} of the staged weights read from the disk each forward (past page_cache_limit)",
                format_bytes(c.disk_bytes_per_forward)
            );
        }
        if c.transfer_units > 0 {
            let _ = writeln!(
                s,
                "  streaming: {} per forward in {} units, ring {} x {}, {}",
                format_bytes(c.streamed_bytes_per_forward),
                c.transfer_units,
                c.ring_slots,
                format_bytes(c.ring_slot_bytes),
                if c.host_registrations > 0 {
                    let home = c.pinned_host_bytes.saturating_sub(c.registered_host_bytes);
                    format!(
                        "copies from {} checkpoint range(s) page-locked in place ({}){}",
                        c.host_registrations,
                        format_bytes(c.registered_host_bytes),
                        if home > 0 {
                            format!(" and a pinned home of {}", format_bytes(home))
                        } else {
                            String::new()
                        }
                    )
                } else if c.staging_buffers == 0 {
                    "copies from one pinned home".to_string()
                } else {
                    format!("{} pinned staging buffers", c.staging_buffers)
                }
            );
            if c.staging_setup_ns > 0 || c.register_fallbacks > 0 {
                let _ = writeln!(
                    s,
                    "  streaming host side set up in {:.3} ms{}",
                    c.staging_setup_ns as f64 / 1e6,
                    if c.register_fallbacks > 0 {
                        format!(
                            "; pinned_source=register fell back {} time(s)",
                            c.register_fallbacks
                        )
                    } else {
                        String::new()
                    }
                );
            }
        }
        if let Some(coded) = &self.coded {
            let _ = writeln!(s, "  {}", coded.format_line());
        }
        if !self.resident_leaves.is_empty() {
            const SHOWN: usize = 8;
            let more = self.resident_leaves.len().saturating_sub(SHOWN);
            let _ = writeln!(
                s,
                "  resident: {}{}",
                self.resident_leaves[..self.resident_leaves.len().min(SHOWN)].join(", "),
                if more > 0 {
                    format!(" (+{more} more)")
                } else {
                    String::new()
                }
            );
        }
        if c.schedule_relearned > 0 {
            let _ = writeln!(s, "  schedule re-learned {} time(s)", c.schedule_relearned);
        }
        for d in &self.detach_reports {
            for line in d.format_profile().lines() {
                let _ = writeln!(s, "  {line}");
            }
        }
        s
    }
}

/// Formats a byte count with a binary unit (`1.50 MiB`).
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

fn opt_bytes(v: Option<u64>) -> String {
    v.map(format_bytes).unwrap_or_else(|| "n/a".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A phase's first forward is kept beside the last: the first timeline recorded stays,
    /// the last one is replaced by each new one.
    #[test]
    fn the_first_and_the_last_timeline_are_kept() {
        let m = RouteMetrics::new();
        assert_eq!((m.first_timeline(), m.timeline()), (None, None));
        let forward = |ns| Timeline {
            forward_ns: ns,
            ..Timeline::default()
        };
        for ns in [5, 7, 9] {
            m.set_timeline(forward(ns));
        }
        assert_eq!(m.first_timeline().map(|t| t.forward_ns), Some(5));
        assert_eq!(m.timeline().map(|t| t.forward_ns), Some(9));
    }

    #[test]
    fn counters_accumulate_and_pinned_peak_is_kept() {
        let m = RouteMetrics::new();
        m.record_h2d(10);
        m.record_h2d(5);
        m.record_d2h(3);
        m.set_pinned_host_bytes(100);
        m.set_pinned_host_bytes(40);
        let c = m.counters();
        assert_eq!((c.h2d_bytes, c.h2d_copies), (15, 2));
        assert_eq!((c.d2h_bytes, c.d2h_copies), (3, 1));
        assert_eq!((c.pinned_host_bytes, c.peak_pinned_host_bytes), (40, 100));
    }

    #[test]
    fn the_streaming_plan_shows_in_counters_and_profile() {
        let m = RouteMetrics::new();
        m.set_streaming_plan(3 << 30, 40, 2, 90 << 20, 0);
        let c = m.counters();
        assert_eq!(
            (c.streamed_bytes_per_forward, c.transfer_units, c.ring_slots),
            (3 << 30, 40, 2)
        );
        let snap = MetricsSnapshot {
            component: "transformer".into(),
            route: "diffusers_group_offload".into(),
            route_options: String::new(),
            preset: None,
            decided_by: "explicit route".into(),
            device: "host:0".into(),
            allocator: "caching".into(),
            counters: c,
            memory: DeviceMemoryFigures::default(),
            phases: vec![],
            detach_reports: vec![],
            resident_leaves: vec![],
            timeline: None,
            first_timeline: None,
            coded: None,
        };
        let text = snap.format_profile();
        assert!(
            text.contains("streaming: 3.00 GiB per forward in 40 units, ring 2 x 90.00 MiB, copies from one pinned home"),
            "{text}"
        );
        let mut registered = snap.clone();
        registered.counters.host_registrations = 3;
        registered.counters.registered_host_bytes = 3 << 30;
        registered.counters.pinned_host_bytes = (3 << 30) + (1 << 20);
        registered.counters.staging_setup_ns = 2_500_000;
        let text = registered.format_profile();
        assert!(
            text.contains("copies from 3 checkpoint range(s) page-locked in place (3.00 GiB) and a pinned home of 1.00 MiB"),
            "{text}"
        );
        assert!(text.contains("host side set up in 2.500 ms"), "{text}");
        // Snapshots written before these fields existed still parse.
        let json = snap
            .to_json()
            .unwrap()
            .replace("\"transfer_units\": 40,", "");
        let back: MetricsSnapshot = serde_json::from_str(&json).unwrap();
        assert_eq!(back.counters.transfer_units, 0);
    }

    #[test]
    fn bytes_format_with_binary_units() {
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(1536), "1.50 KiB");
        assert_eq!(format_bytes(3 * 1024 * 1024 * 1024), "3.00 GiB");
    }

    #[test]
    fn coded_figures_show_in_the_snapshot_and_the_profile() {
        let m = RouteMetrics::new();
        assert_eq!(m.coded(), None);
        m.set_streaming_plan(3 << 30, 40, 2, 90 << 20, 0);
        let coded = CodedFigures {
            coded_bytes: 650,
            raw_bytes: 1000,
            exponent_entropy_millibits: 2545,
            cache: "used".into(),
            cache_note: None,
            cache_path: Some("/w/m.safetensors.ddo-coded".into()),
            coding_ns: 1_500_000_000,
            host_bytes_released: 4096,
        };
        m.set_coded(Some(coded.clone()));
        assert_eq!(m.coded().as_ref(), Some(&coded));
        assert!((coded.ratio() - 0.65).abs() < 1e-12);
        let snap = MetricsSnapshot {
            component: "transformer".into(),
            route: "diffusers_group_offload".into(),
            route_options: "use_stream=true compress=lossless".into(),
            preset: None,
            decided_by: "explicit route".into(),
            device: "host:0".into(),
            allocator: "caching".into(),
            counters: m.counters(),
            memory: DeviceMemoryFigures::default(),
            phases: vec![],
            detach_reports: vec![],
            resident_leaves: vec![],
            timeline: None,
            first_timeline: None,
            coded: m.coded(),
        };
        let back: MetricsSnapshot = serde_json::from_str(&snap.to_json().unwrap()).unwrap();
        assert_eq!(back.coded.as_ref(), Some(&coded));
        let text = snap.format_profile();
        assert!(text.contains("coded: 650 B of 1000 B (0.650)"), "{text}");
        assert!(
            text.contains("entropy 2.545 bits, cache used at /w/m.safetensors.ddo-coded, 1.50 s"),
            "{text}"
        );
        // A cache not used says why, on the same line.
        let unused = CodedFigures {
            cache: "unavailable".into(),
            cache_note: Some("coded without a cache: /w/x is a FIFO, not a DDO cache".into()),
            ..coded.clone()
        };
        assert!(
            unused.summary().contains(
                "cache unavailable at /w/m.safetensors.ddo-coded (coded without a cache: /w/x is a FIFO"
            ),
            "{}",
            unused.summary()
        );
        assert_eq!(unused.format_line(), format!("coded: {}", unused.summary()));
        m.set_coded(None);
        assert_eq!(m.coded(), None);
    }

    #[test]
    fn snapshot_round_trips_through_json_and_profile_names_phases() {
        let m = RouteMetrics::new();
        m.push_phase(PhasePeak {
            phase: "decode".into(),
            allocator_peak_bytes: 2048,
            allocator_end_bytes: 0,
            driver_used_sampled_bytes: None,
            native_pool: Some(NativePoolFigures {
                peak_live_bytes: 1000,
                peak_mapped_bytes: 1050,
                ..NativePoolFigures::default()
            }),
        });
        let snap = MetricsSnapshot {
            component: "vae".into(),
            route: "none".into(),
            route_options: "resident".into(),
            preset: Some("one_shot_fast".into()),
            decided_by: "explicit route".into(),
            device: "host:0".into(),
            allocator: "caching".into(),
            counters: m.counters(),
            memory: DeviceMemoryFigures::default(),
            phases: m.phases(),
            detach_reports: vec![],
            resident_leaves: (0..10).map(|i| format!("blocks.{i}.linear")).collect(),
            timeline: None,
            first_timeline: None,
            coded: None,
        };
        let json = snap.to_json().expect("serialises");
        let back: MetricsSnapshot = serde_json::from_str(&json).expect("parses");
        assert_eq!(back, snap);
        let text = snap.format_profile();
        assert!(text.contains("phase decode: peak 2.00 KiB"), "{text}");
        assert!(text.contains("1.050x live peak"), "{text}");
        assert!(
            text.contains("resident: blocks.0.linear, ") && text.contains("(+2 more)"),
            "{text}"
        );
        assert!(text.contains("preset one_shot_fast"), "{text}");
    }
}
