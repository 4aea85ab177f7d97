//! The timed events of one traced streaming forward (route option `timeline=true`,
//! [`Trace`]) and the [`ddo_metrics::Timeline`] made from them.

use std::time::Instant;

use crate::device::{Device, Event};
use crate::error::Result;
use crate::streaming::layout::StagingLayout;

/// The timed events of one traced forward, per unit.
#[derive(Debug)]
pub(super) struct Trace {
    pub(super) start: Event,
    /// Host time at `begin_forward`'s entry, and until the start event was recorded.
    pub(super) host_entry: Instant,
    pub(super) host_begin: std::time::Duration,
    pub(super) copy_start: Vec<Option<Event>>,
    pub(super) copy_end: Vec<Option<Event>>,
    pub(super) compute_start: Vec<Option<Event>>,
    pub(super) compute_end: Vec<Option<Event>>,
    /// Host time, since `host_entry`, when the program reached each unit's first leaf.
    pub(super) host_enter: Vec<Option<std::time::Duration>>,
}

impl Trace {
    pub(super) fn new(start: Event, host_entry: Instant, units: usize) -> Self {
        let none = || (0..units).map(|_| None).collect::<Vec<_>>();
        Self {
            start,
            host_begin: host_entry.elapsed(),
            host_entry,
            copy_start: none(),
            copy_end: none(),
            compute_start: none(),
            compute_end: none(),
            host_enter: vec![None; units],
        }
    }

    /// The forward's timeline from its events (`end`: the event after the forward), per
    /// unit of `layout` with its blocker; `None` where the device keeps no event times.
    pub(super) fn timeline(
        &self,
        device: &dyn Device,
        layout: &StagingLayout,
        blockers: &[Option<usize>],
        end: &Event,
    ) -> Result<Option<ddo_metrics::Timeline>> {
        let at = |e: &Option<Event>| -> Result<Option<i64>> {
            match e {
                Some(e) => device.event_elapsed_ns(&self.start, e),
                None => Ok(None),
            }
        };
        let Some(forward_ns) = device.event_elapsed_ns(&self.start, end)? else {
            return Ok(None);
        };
        let mut units = Vec::with_capacity(layout.units().len());
        for (u, unit) in layout.units().iter().enumerate() {
            units.push(ddo_metrics::UnitTiming {
                unit: u,
                label: unit
                    .entries
                    .first()
                    .map_or_else(String::new, |e| e.param.name().to_string()),
                bytes: unit.bytes,
                blocker: blockers[u],
                copy_start_ns: at(&self.copy_start[u])?.unwrap_or(0),
                copy_end_ns: at(&self.copy_end[u])?.unwrap_or(0),
                compute_start_ns: at(&self.compute_start[u])?.unwrap_or(0),
                compute_end_ns: at(&self.compute_end[u])?.unwrap_or(0),
                host_enter_ns: self.host_enter[u]
                    .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)),
            });
        }
        Ok(Some(ddo_metrics::Timeline {
            units,
            forward_ns,
            host_begin_ns: 0,
            host_forward_ns: 0,
            host_waits: device.host_waits_since(self.host_entry),
        }))
    }
}
