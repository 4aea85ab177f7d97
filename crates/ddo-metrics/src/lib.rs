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

use serde::{Deserialize, Serialize};

pub mod timeline;
pub use timeline::{CopyGap, HostWait, IdleCause, Timeline, TimelineSummary, UnitTiming};

mod figures;
mod live;
pub use figures::{
    CodedFigures, DetachSummary, DeviceMemoryFigures, IdleCacheRelease, NativePoolFigures,
    PhasePeak, RouteCounters, SkippedGroup, StreamingHost,
};
pub use live::RouteMetrics;

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

pub(crate) fn opt_bytes(v: Option<u64>) -> String {
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
