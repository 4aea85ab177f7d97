//! The plain-data figures a [`crate::MetricsSnapshot`] carries: per-phase peaks, the
//! streaming engine's host side and coded units, the native pool, detach summaries and the
//! device's memory.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::{format_bytes, opt_bytes};

/// What a streaming engine with lossless-coded units (`compress=lossless`) holds, for
/// [`RouteMetrics::set_coded`](crate::RouteMetrics::set_coded): the coded size and exponent entropy of the component's
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

/// Where a streaming engine's copies read from, for [`RouteMetrics::set_streaming_host`](crate::RouteMetrics::set_streaming_host).
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
