//! [`StagingKind`] and [`StreamingFigures`]: what a [`StreamingEngine`](super::StreamingEngine)
//! planned and holds (residency, ring, host staging, registered ranges, setup times), as the
//! routes publish it in their metrics and `ddo bench` and `ddo inspect` print it.

use ddo_metrics::RouteMetrics;

/// How the engine holds the host side of the streamed bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum StagingKind {
    /// One pinned buffer with every unit in schedule order; it replaced the params' host
    /// bytes, so it is the one host copy. Copies run straight from it.
    PinnedHome,
    /// `buffers` pinned buffers of `buffer_bytes` each, filled by host copies from the
    /// params' own bytes (checkpoint mapping or owned memory) ahead of the copy stream.
    Ring {
        /// Number of staging buffers.
        buffers: usize,
        /// Bytes of each.
        buffer_bytes: u64,
    },
    /// [`PinnedSource::Register`](crate::config::PinnedSource::Register): the checkpoint mappings the streamed params point into,
    /// page-locked in place in `registrations` ranges of `registered_bytes` in all (no
    /// copy of them), plus a pinned home of `home_bytes` for the streamed params whose
    /// bytes are not mapped. Copies run straight from both, one per run of params.
    Registered {
        /// Registered ranges (merged per mapping).
        registrations: usize,
        /// Bytes they page-lock.
        registered_bytes: u64,
        /// Bytes of the pinned home of the params that are not mapped (0: none).
        home_bytes: u64,
        /// Bytes of the units past the pinned limit, copied through two staging buffers
        /// from the params' own bytes as [`StagingKind::Ring`] copies every unit (0: every
        /// unit registered).
        staged_bytes: u64,
    },
    /// `compress=lossless`: one pinned buffer of the units lossless-coded (`coded_bytes`,
    /// from `raw_bytes` of units), copied as they are and decoded on the device. It is the
    /// streamed weights' one host copy: params mapped from a file keep pointing into the
    /// mapping but their pages are released from the process
    /// ([`StreamingFigures::host_bytes_released`]); params made in memory keep their bytes.
    Coded {
        /// Bytes of the coded units (what crosses the link per forward).
        coded_bytes: u64,
        /// Bytes of the units they code.
        raw_bytes: u64,
        /// Shannon entropy of the units' exponents, thousandths of a bit per 16-bit word.
        exponent_entropy_millibits: u64,
        /// Whether the coded units came from the cache file beside the checkpoint
        /// (`<checkpoint>.ddo-coded`), were coded and written to it, or were coded with no
        /// cache; [`StreamingFigures::coded_cache_note`] says why when it was not used.
        cache: CodedCache,
        /// Nanoseconds spent getting the coded units: coding them, or reading and checking
        /// the cache (the content hash of the raw units included either way).
        coding_ns: u64,
    },
}

/// What became of the coded-unit cache at attach ([`StagingKind::Coded`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum CodedCache {
    /// A valid cache was read: nothing was coded.
    Used,
    /// There was no valid cache (none, stale or corrupt): the units were coded and the
    /// cache written.
    Built,
    /// No cache: the streamed params are not all mapped from checkpoint files (random or
    /// converted weights), the cache path is one of those files, something that is not a
    /// DDO cache is at the path (left as it is: a user's file, a read-only file, a
    /// directory, a FIFO, a symbolic link), or the cache could not be read or written (a
    /// read-only directory); the units were coded as without one.
    Unavailable,
    /// No cache needed: the streamed weights are coded in their checkpoint files (`ddo
    /// convert --compress lossless`) and copied as they are; only the params between them
    /// (biases, norms) were coded at attach.
    Sources,
}

impl StagingKind {
    /// Pinned staging buffers the host copies through (0 when copies run straight from
    /// a pinned home or a registered mapping), as the metrics count them.
    pub fn staging_buffers(&self) -> u64 {
        match self {
            StagingKind::Ring { buffers, .. } => *buffers as u64,
            StagingKind::Registered { staged_bytes, .. } if *staged_bytes > 0 => 2,
            StagingKind::PinnedHome
            | StagingKind::Registered { .. }
            | StagingKind::Coded { .. } => 0,
        }
    }

    /// Ranges of checkpoint mappings page-locked in place, and their bytes (0 unless
    /// [`StagingKind::Registered`]).
    pub fn registered(&self) -> (u64, u64) {
        match self {
            StagingKind::Registered {
                registrations,
                registered_bytes,
                ..
            } => (*registrations as u64, *registered_bytes),
            StagingKind::PinnedHome | StagingKind::Ring { .. } | StagingKind::Coded { .. } => {
                (0, 0)
            }
        }
    }
}

/// The engine's plan, as metrics and tests see it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StreamingFigures {
    /// Segments kept resident (all their params resident).
    pub resident_segments: usize,
    /// Segments with at least one streamed param.
    pub streamed_segments: usize,
    /// Weight bytes kept resident on the device.
    pub resident_bytes: u64,
    /// Bytes copied to the device per forward: whole units, alignment padding included,
    /// from a pinned home or a staging ring; the runs (padding between them skipped)
    /// from registered mappings.
    pub streamed_bytes: u64,
    /// Param bytes streamed per forward (without padding).
    pub streamed_payload_bytes: u64,
    /// Transfer units per forward.
    pub units: usize,
    /// Ring slots allocated per forward.
    pub ring_slots: usize,
    /// Bytes of one slot (the largest unit).
    pub slot_bytes: u64,
    /// Budget the residency plan was made for (`None`: nothing resident by choice).
    pub budget_bytes: Option<u64>,
    /// Host staging.
    pub staging: StagingKind,
    /// Pinned host bytes the engine holds.
    pub pinned_bytes: u64,
    /// Host bytes of the params' previous sources that the pinned home released (bytes
    /// this engine held the last handle to), or, with coded units, the streamed params'
    /// file pages released from the process; 0 for ring staging.
    pub host_bytes_released: u64,
    /// Host→device copies per forward (units for a pinned home, runs for registered
    /// mappings, staging-buffer chunks for a ring).
    #[serde(default)]
    pub copies_per_forward: u64,
    /// Time taken to set the host side up (pinned home copy, registrations), in ns.
    #[serde(default)]
    pub staging_setup_ns: u64,
    /// Where a pinned home's build time went (zero without a home).
    #[serde(default, skip)]
    pub home_times: crate::streaming::home::BuildTimes,
    /// Bytes of the mapped ranges page-locked only for the resident params' first upload
    /// (so it runs at pinned speed), released once that upload is queued; not in
    /// `pinned_bytes`.
    #[serde(default)]
    pub resident_registered_bytes: u64,
    /// Why [`PinnedSource::Register`](crate::config::PinnedSource::Register) was asked for but the engine staged otherwise (the
    /// device cannot register the memory, or it does not fit under the pinned limit).
    #[serde(default)]
    pub register_fallback: Option<String>,
    /// With [`StagingKind::Coded`], why the coded-unit cache was not used (absent, stale,
    /// corrupt — then rebuilt —, or unavailable); `None` on a cache hit and without coding.
    #[serde(default)]
    pub coded_cache_note: Option<String>,
    /// With [`StagingKind::Coded`], the coded-unit cache's path (`<checkpoint>.ddo-coded`)
    /// when the streamed params are mapped from checkpoint files, whether it was used or
    /// not; `None` otherwise.
    #[serde(default)]
    pub coded_cache_path: Option<std::path::PathBuf>,
    /// Bytes of staged units past `page_cache_limit` whose file pages are given back after
    /// each copy, so that every forward reads them from the disk again (the disk tier,
    /// [`staged_read`](crate::streaming::staged_read)); 0 when nothing is staged or all
    /// staged pages may stay cached.
    #[serde(default)]
    pub disk_bytes_per_forward: u64,
}

impl StreamingFigures {
    /// Where copies read from, as the route metrics record it
    /// ([`RouteMetrics::set_streaming_host`]).
    pub fn host_metrics(&self) -> ddo_metrics::StreamingHost {
        let (registrations, registered_bytes) = self.staging.registered();
        ddo_metrics::StreamingHost {
            registrations,
            registered_bytes,
            setup_ns: self.staging_setup_ns,
            home_pin_ns: nanos(self.home_times.pin),
            home_fill_ns: nanos(self.home_times.fill),
            register_fell_back: self.register_fallback.is_some(),
        }
    }

    /// Records the plan in a route's metrics: streamed bytes, units and ring
    /// ([`RouteMetrics::set_streaming_plan`]), where copies read from and the pinned bytes.
    /// The resident bytes and leaves are the route's to record (it may hold more).
    pub fn publish(&self, metrics: &RouteMetrics) {
        metrics.set_streaming_plan(
            self.streamed_bytes,
            self.units as u64,
            self.ring_slots as u64,
            self.slot_bytes,
            self.staging.staging_buffers(),
        );
        metrics.set_streaming_host(self.host_metrics());
        metrics.set_disk_bytes_per_forward(self.disk_bytes_per_forward);
        metrics.set_pinned_host_bytes(self.pinned_bytes);
        metrics.set_coded(self.coded_figures());
    }

    /// What coded streaming holds, as the route metrics record it (`None` unless the units
    /// are lossless-coded).
    pub fn coded_figures(&self) -> Option<ddo_metrics::CodedFigures> {
        let StagingKind::Coded {
            coded_bytes,
            raw_bytes,
            exponent_entropy_millibits,
            cache,
            coding_ns,
        } = self.staging
        else {
            return None;
        };
        Some(ddo_metrics::CodedFigures {
            coded_bytes,
            raw_bytes,
            exponent_entropy_millibits,
            cache: match cache {
                CodedCache::Used => "used",
                CodedCache::Built => "built",
                CodedCache::Unavailable => "unavailable",
                CodedCache::Sources => "not needed (coded files)",
            }
            .into(),
            cache_note: self.coded_cache_note.clone(),
            cache_path: self
                .coded_cache_path
                .as_ref()
                .map(|p| p.display().to_string()),
            coding_ns,
            host_bytes_released: self.host_bytes_released,
        })
    }

    /// Device bytes of the ring (with its coded slots, [`super::coded_ring_bytes`], when
    /// the units stream lossless-coded).
    pub fn ring_bytes(&self) -> u64 {
        let coded = match self.staging {
            StagingKind::Coded { .. } if self.ring_slots > 0 => {
                super::coded_ring_bytes(self.slot_bytes)
            }
            _ => 0,
        };
        self.slot_bytes * self.ring_slots as u64 + coded
    }

    /// Decoded slots' bytes: where the streamed params point during a forward.
    pub fn decoded_ring_bytes(&self) -> u64 {
        self.slot_bytes * self.ring_slots as u64
    }

    /// Most weight bytes on the device during a forward: resident plus the ring.
    pub fn device_weight_bytes(&self) -> u64 {
        self.resident_bytes + self.ring_bytes()
    }
}

/// `d` in whole nanoseconds (saturating).
pub(super) fn nanos(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}
