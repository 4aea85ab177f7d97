//! A streamed forward's timeline: when each transfer unit's copy ran on the copy stream
//! and when compute used it, from device events (the streaming engine records them with
//! the route option `timeline=true`), and where the copy engine sat idle and why.
//!
//! A streamed step cannot beat its link floor; the timeline says what the time above it
//! went to: copies slower than the link (the busy rate), the copy engine waiting for ring
//! room (compute still using the bytes the next unit overwrites), or waiting for the host
//! to queue the next copy.

use serde::{Deserialize, Serialize};

/// One transfer unit in one forward, in nanoseconds from the forward's start (the event
/// recorded on the compute stream at `begin_forward`; copies queued before compute reaches
/// it can start earlier, so times can be negative).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitTiming {
    /// Unit index (schedule order).
    pub unit: usize,
    /// A name for it: the first param it carries.
    pub label: String,
    /// Bytes copied.
    pub bytes: u64,
    /// The unit whose use the copy waited for (the bytes it overwrites), if any.
    pub blocker: Option<usize>,
    /// The copy started (after its wait for the blocker).
    pub copy_start_ns: i64,
    /// The copy finished.
    pub copy_end_ns: i64,
    /// Compute reached the unit's first leaf (after waiting for the copy).
    pub compute_start_ns: i64,
    /// Compute finished the unit's last leaf (its use event).
    pub compute_end_ns: i64,
    /// Host wall time, ns from `begin_forward`'s entry, when the program reached the unit's
    /// first leaf (what follows is queued from then on): beside `compute_start_ns` plus the
    /// timeline's `host_begin_ns`, it says whether the device waited for the host there.
    #[serde(default)]
    pub host_enter_ns: i64,
}

/// A host call into the device's driver or libraries that took long (the CUDA backend
/// keeps those of at least half a millisecond): while it ran, the program queued nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostWait {
    /// The call (`cuStreamSynchronize`, `cuLaunchKernel`, `cublasLtMatmul`, ...).
    pub call: String,
    /// When it started, ns from the start asked about (a timeline's: `begin_forward`'s
    /// entry, as [`UnitTiming::host_enter_ns`]).
    pub at_ns: u64,
    /// How long it took, ns.
    pub ns: u64,
}

/// One forward's units.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timeline {
    /// Every streamed unit, in schedule order.
    pub units: Vec<UnitTiming>,
    /// The forward's end (compute's last event), ns from its start.
    pub forward_ns: i64,
    /// Host wall time, ns, from `begin_forward`'s entry to the start event (resident
    /// uploads, the ring's allocation).
    #[serde(default)]
    pub host_begin_ns: i64,
    /// Host wall time, ns, from `begin_forward`'s entry until the end event was recorded
    /// (the host's view of the forward, without waiting for the device to finish).
    #[serde(default)]
    pub host_forward_ns: i64,
    /// The long host calls into the device's driver or libraries while the host queued
    /// the forward ([`HostWait`]; none where the backend keeps none).
    #[serde(default)]
    pub host_waits: Vec<HostWait>,
}

impl UnitTiming {
    fn ms(ns: i64) -> f64 {
        ns as f64 / 1e6
    }
    fn copy_start_ms(&self) -> f64 {
        Self::ms(self.copy_start_ns)
    }
    fn copy_end_ms(&self) -> f64 {
        Self::ms(self.copy_end_ns)
    }
    fn compute_start_ms(&self) -> f64 {
        Self::ms(self.compute_start_ns)
    }
    fn compute_end_ms(&self) -> f64 {
        Self::ms(self.compute_end_ns)
    }
}

/// Where one idle stretch of the copy engine went.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum IdleCause {
    /// The next unit's copy waited for compute to finish with the bytes it overwrites.
    RingFull,
    /// The next copy was queued late by the host (nothing held it on the device).
    HostLate,
}

/// A gap on the copy stream before a unit's copy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CopyGap {
    /// The unit whose copy ended the gap.
    pub unit: usize,
    /// Its label.
    pub label: String,
    /// Gap length, ms.
    pub ms: f64,
    /// Why.
    pub cause: IdleCause,
}

/// What a timeline adds up to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimelineSummary {
    /// The forward, ms.
    pub forward_ms: f64,
    /// Bytes copied.
    pub bytes: u64,
    /// Time the copy stream spent copying, ms.
    pub copy_busy_ms: f64,
    /// Bytes per second while copying.
    pub busy_bytes_per_second: f64,
    /// Copy-stream idle time between the first copy and the last, by cause, ms.
    pub idle_ring_full_ms: f64,
    /// See [`IdleCause::HostLate`].
    pub idle_host_late_ms: f64,
    /// From the last copy's end to the forward's end, ms (compute after the link is done).
    pub tail_ms: f64,
    /// From the forward's start to the first copy's start, ms.
    pub head_ms: f64,
    /// Time compute waited for copies (unit start after the previous unit's end), ms.
    pub compute_waited_ms: f64,
    /// See [`Timeline::host_begin_ns`], ms.
    #[serde(default)]
    pub host_begin_ms: f64,
    /// See [`Timeline::host_forward_ns`], ms.
    #[serde(default)]
    pub host_forward_ms: f64,
    /// The longest gaps.
    pub largest_gaps: Vec<CopyGap>,
}

/// A gap this much shorter than a millisecond fraction is noise between back-to-back
/// copies (event resolution is about half a microsecond).
const GAP_EPSILON_MS: f64 = 0.002;

impl Timeline {
    /// Adds the timeline up (`top` largest gaps kept).
    pub fn summary(&self, top: usize) -> TimelineSummary {
        let mut s = TimelineSummary {
            forward_ms: self.forward_ns as f64 / 1e6,
            bytes: self.units.iter().map(|u| u.bytes).sum(),
            copy_busy_ms: self
                .units
                .iter()
                .map(|u| (u.copy_end_ms() - u.copy_start_ms()).max(0.0))
                .sum(),
            busy_bytes_per_second: 0.0,
            idle_ring_full_ms: 0.0,
            idle_host_late_ms: 0.0,
            tail_ms: 0.0,
            head_ms: 0.0,
            compute_waited_ms: 0.0,
            host_begin_ms: self.host_begin_ns as f64 / 1e6,
            host_forward_ms: self.host_forward_ns as f64 / 1e6,
            largest_gaps: Vec::new(),
        };
        if s.copy_busy_ms > 0.0 {
            s.busy_bytes_per_second = s.bytes as f64 / (s.copy_busy_ms / 1e3);
        }
        let mut gaps = Vec::new();
        let mut last_end: Option<f64> = None;
        for u in &self.units {
            if let Some(end) = last_end {
                let gap = u.copy_start_ms() - end;
                if gap > GAP_EPSILON_MS {
                    // The copy waited for its blocker when it started right as compute
                    // finished with the blocker's bytes.
                    let held = u.blocker.and_then(|b| self.units.get(b)).is_some_and(|b| {
                        b.compute_end_ms() >= u.copy_start_ms() - GAP_EPSILON_MS * 50.0
                    });
                    let cause = if held {
                        IdleCause::RingFull
                    } else {
                        IdleCause::HostLate
                    };
                    match cause {
                        IdleCause::RingFull => s.idle_ring_full_ms += gap,
                        IdleCause::HostLate => s.idle_host_late_ms += gap,
                    }
                    gaps.push(CopyGap {
                        unit: u.unit,
                        label: u.label.clone(),
                        ms: gap,
                        cause,
                    });
                }
            } else {
                s.head_ms = u.copy_start_ms().max(0.0);
            }
            last_end = Some(last_end.map_or(u.copy_end_ms(), |e: f64| e.max(u.copy_end_ms())));
        }
        if let Some(end) = last_end {
            s.tail_ms = ((self.forward_ns as f64 / 1e6) - end).max(0.0);
        }
        let mut prev_end: Option<f64> = None;
        for u in &self.units {
            if let Some(p) = prev_end {
                let waited = u.compute_start_ms() - p;
                if waited > GAP_EPSILON_MS
                    && u.copy_end_ms() >= u.compute_start_ms() - GAP_EPSILON_MS * 50.0
                {
                    s.compute_waited_ms += waited;
                }
            }
            prev_end = Some(u.compute_end_ms());
        }
        gaps.sort_by(|a, b| b.ms.total_cmp(&a.ms));
        gaps.truncate(top);
        s.largest_gaps = gaps;
        s
    }
}

impl TimelineSummary {
    /// The summary in a few lines, against a link `floor_ms` when one is known.
    pub fn format_text(&self, floor_ms: Option<f64>) -> String {
        let mut out = format!(
            "timeline: forward {:.1} ms{}; copies busy {:.1} ms ({:.1} GB/s while copying, {} in all)\n",
            self.forward_ms,
            floor_ms.map_or(String::new(), |f| format!(
                " = {:.3}x the {:.1} ms floor",
                self.forward_ms / f,
                f
            )),
            self.copy_busy_ms,
            self.busy_bytes_per_second / 1e9,
            crate::format_bytes(self.bytes),
        );
        out.push_str(&format!(
            "  copy engine idle: {:.1} ms before the first copy, {:.1} ms waiting for ring room, \
             {:.1} ms waiting for the host, {:.1} ms after the last copy; compute waited {:.1} ms for copies\n",
            self.head_ms,
            self.idle_ring_full_ms,
            self.idle_host_late_ms,
            self.tail_ms,
            self.compute_waited_ms
        ));
        out.push_str(&format!(
            "  host: {:.1} ms in begin_forward before the start event, {:.1} ms from begin_forward to the end event\n",
            self.host_begin_ms, self.host_forward_ms
        ));
        for g in &self.largest_gaps {
            out.push_str(&format!(
                "  gap {:.3} ms before unit {} ({}): {}\n",
                g.ms,
                g.unit,
                g.label,
                match g.cause {
                    IdleCause::RingFull => "ring full",
                    IdleCause::HostLate => "host late",
                }
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(i: usize, blocker: Option<usize>, copy: (f64, f64), compute: (f64, f64)) -> UnitTiming {
        let ns = |ms: f64| (ms * 1e6) as i64;
        UnitTiming {
            unit: i,
            label: format!("u{i}"),
            bytes: 1000,
            blocker,
            copy_start_ns: ns(copy.0),
            copy_end_ns: ns(copy.1),
            compute_start_ns: ns(compute.0),
            compute_end_ns: ns(compute.1),
            host_enter_ns: 0,
        }
    }

    #[test]
    fn gaps_are_attributed_to_the_ring_or_the_host() {
        let t = Timeline {
            units: vec![
                unit(0, None, (0.0, 1.0), (1.0, 3.0)),
                // Starts when unit 0's use ended: the ring held it.
                unit(1, Some(0), (3.0, 4.0), (4.0, 4.5)),
                // Nothing held it: the host queued it late.
                unit(2, None, (6.0, 7.0), (7.0, 8.0)),
            ],
            forward_ns: 9_000_000,
            host_begin_ns: 1_000_000,
            host_forward_ns: 10_000_000,
            host_waits: Vec::new(),
        };
        let s = t.summary(5);
        assert_eq!(s.bytes, 3000);
        assert!((s.copy_busy_ms - 3.0).abs() < 1e-9);
        assert!((s.idle_ring_full_ms - 2.0).abs() < 1e-9, "{s:?}");
        assert!((s.idle_host_late_ms - 2.0).abs() < 1e-9, "{s:?}");
        assert!((s.tail_ms - 2.0).abs() < 1e-9);
        assert_eq!(s.largest_gaps.len(), 2);
        assert!((s.busy_bytes_per_second - 1e6).abs() < 1e-3);
        let text = s.format_text(Some(4.5));
        assert!(text.contains("2.000x"), "{text}");
        assert!((s.host_forward_ms - 10.0).abs() < 1e-9);
        assert!(
            text.contains("1.0 ms in begin_forward") && text.contains("10.0 ms from begin_forward"),
            "{text}"
        );
    }
}
