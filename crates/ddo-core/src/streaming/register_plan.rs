//! [`RegisterPlan`]: what registering a streamed component's checkpoint mappings in place
//! takes (`pinned_source=register`), worked out before any memory is touched: the ranges to
//! page-lock, each unit's copies as runs of params adjacent in the file and the unit, and
//! the pinned home of the params that are not mapped. The engine ([`super::engine`])
//! builds its registered host side from it.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use crate::host_memory::{CheckpointMap, register_span};
use crate::param::Param;
use crate::streaming::layout::{StagingLayout, align_up};

/// Where a run of a unit is copied from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RunSource {
    /// Byte `offset` of registered range `source`.
    Registered { source: usize, offset: u64 },
    /// Byte `offset` of the pinned home.
    Home { offset: u64 },
}

/// One host→device copy of part of a unit: `len` bytes to byte `dst` of the unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct CopyRun {
    pub(super) source: RunSource,
    pub(super) dst: u64,
    pub(super) len: u64,
}

/// What registering the streamed params' mappings takes (pure; touches no memory): the
/// ranges to register (rounded out to [`REGISTER_ALIGN`](crate::host_memory::REGISTER_ALIGN)
/// blocks and merged per mapping, so no two share a page), each unit's copies, and the
/// pinned home of the params that are not mapped.
#[derive(Debug)]
pub(super) struct RegisterPlan {
    pub(super) spans: Vec<(Arc<CheckpointMap>, Range<usize>)>,
    /// Spans that hold only resident params: registered for their first upload, released
    /// after it.
    pub(super) resident_only: Vec<usize>,
    pub(super) runs: Vec<Vec<CopyRun>>,
    pub(super) home: Vec<(Arc<Param>, u64)>,
    pub(super) home_bytes: u64,
    /// Bytes of the spans the streamed copies read (kept registered).
    pub(super) registered_bytes: u64,
    /// Bytes of the `resident_only` spans.
    pub(super) resident_registered_bytes: u64,
    /// The first unit copied through staging buffers rather than from registered ranges
    /// (`runs.len()`: none). Units before it are registered; their runs are planned.
    pub(super) staged_from: usize,
    /// Bytes of the staged units.
    pub(super) staged_bytes: u64,
}

impl RegisterPlan {
    /// The plan for `layout`'s streamed params; `resident` params that are mapped get their
    /// ranges registered too, so their one upload runs from page-locked memory: those that
    /// share a block with a streamed range widen it (and stay registered with it), the others
    /// get ranges of their own that go after the upload.
    pub(super) fn new(layout: &StagingLayout, resident: &[Arc<Param>]) -> Self {
        Self::registering(layout, resident, layout.units().len())
    }

    /// The plan that fits `room` pinned bytes, trying in turn: everything registered with
    /// the resident params' ranges; the streamed params' ranges only; and, with
    /// `staging_bytes` given (`None`: no partial plan), the first units (in layout order)
    /// registered, as many as fit beside that many bytes of staging buffers, the rest
    /// staged. `None` when nothing fits.
    pub(super) fn within(
        layout: &StagingLayout,
        resident: &[Arc<Param>],
        room: u64,
        staging_bytes: Option<u64>,
    ) -> Option<Self> {
        let with_resident = Self::new(layout, resident);
        if with_resident.pinned_bytes() + with_resident.resident_registered_bytes <= room {
            return Some(with_resident);
        }
        let plain = Self::new(layout, &[]);
        if plain.pinned_bytes() <= room {
            return Some(plain);
        }
        let room = room.checked_sub(staging_bytes?)?;
        // The registered bytes grow with the units registered: the most that fit.
        let (mut lo, mut hi) = (0usize, layout.units().len());
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if Self::registering(layout, &[], mid).pinned_bytes() <= room {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        (lo > 0).then(|| Self::registering(layout, &[], lo))
    }

    /// Pinned bytes the plan holds for the streamed units: registered ranges and the home.
    pub(super) fn pinned_bytes(&self) -> u64 {
        self.registered_bytes + self.home_bytes
    }

    /// The plan with the first `registered_units` units registered and the rest staged.
    fn registering(
        layout: &StagingLayout,
        resident: &[Arc<Param>],
        registered_units: usize,
    ) -> Self {
        let registered_units = registered_units.min(layout.units().len());
        let units = &layout.units()[..registered_units];
        // Each mapping once, in the order the layout first uses it.
        let mut maps: Vec<(Arc<CheckpointMap>, Vec<Range<usize>>)> = Vec::new();
        let mut map_index: HashMap<usize, usize> = HashMap::new();
        for e in units.iter().flat_map(|u| &u.entries) {
            if let Some((map, range)) = e.param.host().mapped_range() {
                let m = *map_index
                    .entry(Arc::as_ptr(map) as usize)
                    .or_insert_with(|| {
                        maps.push((Arc::clone(map), Vec::new()));
                        maps.len() - 1
                    });
                maps[m]
                    .1
                    .push(register_span(map.len(), range.start, range.len()));
            }
        }
        // Overlapping or touching spans of one mapping are merged.
        let merge = crate::host_memory::merge_spans;
        // Resident params that share a block with a kept range join it (kept registered,
        // so they are read from it whole: a copy from partly page-locked memory is refused);
        // the others get ranges of their own, released after their upload. Joining can
        // widen a kept range onto another resident param, so this runs until nothing moves.
        let mut pending: Vec<(Arc<CheckpointMap>, Range<usize>)> = resident
            .iter()
            .filter_map(|p| {
                let host = p.host();
                let (map, range) = host.mapped_range()?;
                let r = register_span(map.len(), range.start, range.len());
                (!r.is_empty()).then(|| (Arc::clone(map), r))
            })
            .collect();
        let mut kept: Vec<Vec<Range<usize>>> = maps
            .iter()
            .map(|(_, ranges)| merge(ranges.clone()))
            .collect();
        loop {
            let before = pending.len();
            pending.retain(|(map, r)| {
                let Some(&m) = map_index.get(&(Arc::as_ptr(map) as usize)) else {
                    return true;
                };
                let clashes = kept[m].iter().any(|s| s.start < r.end && r.start < s.end);
                if clashes {
                    let mut ranges = std::mem::take(&mut kept[m]);
                    ranges.push(r.clone());
                    kept[m] = merge(ranges);
                }
                !clashes
            });
            if pending.len() == before {
                break;
            }
        }
        let mut spans: Vec<(Arc<CheckpointMap>, Range<usize>)> = Vec::new();
        let mut first_span = Vec::with_capacity(maps.len());
        for ((map, _), ranges) in maps.iter().zip(kept) {
            first_span.push(spans.len());
            spans.extend(ranges.into_iter().map(|r| (Arc::clone(map), r)));
        }
        first_span.push(spans.len());
        // The other resident params' ranges, merged among themselves, after every kept span.
        let streamed_spans = spans.len();
        let mut resident_maps: Vec<(Arc<CheckpointMap>, Vec<Range<usize>>)> = Vec::new();
        for (map, r) in pending {
            match resident_maps.iter_mut().find(|(m, _)| Arc::ptr_eq(m, &map)) {
                Some((_, ranges)) => ranges.push(r),
                None => resident_maps.push((map, vec![r])),
            }
        }
        for (map, ranges) in resident_maps {
            spans.extend(merge(ranges).into_iter().map(|r| (Arc::clone(&map), r)));
        }
        let resident_only: Vec<usize> = (streamed_spans..spans.len()).collect();
        let source_of = |map: &Arc<CheckpointMap>, at: usize| -> Option<(usize, u64)> {
            let m = *map_index.get(&(Arc::as_ptr(map) as usize))?;
            let (lo, hi) = (first_span[m], first_span[m + 1]);
            let i = lo + spans[lo..hi].partition_point(|(_, r)| r.end <= at);
            (i < hi && spans[i].1.contains(&at)).then(|| (i, (at - spans[i].1.start) as u64))
        };
        let mut runs = Vec::with_capacity(layout.units().len());
        let mut home = Vec::new();
        let mut home_at = 0u64;
        for unit in units {
            let mut unit_runs: Vec<CopyRun> = Vec::new();
            for e in unit.entries.iter().filter(|e| e.len > 0) {
                let mapped = e
                    .param
                    .host()
                    .mapped_range()
                    .and_then(|(map, range)| source_of(map, range.start));
                if let Some((source, offset)) = mapped {
                    // Extends the run before when the file and the unit put the same
                    // distance between them.
                    if let Some(run) = unit_runs.last_mut()
                        && let RunSource::Registered {
                            source: s,
                            offset: o,
                        } = run.source
                        && s == source
                        && offset >= o
                        && offset - o == e.offset - run.dst
                    {
                        run.len = e.offset + e.len - run.dst;
                    } else {
                        unit_runs.push(CopyRun {
                            source: RunSource::Registered { source, offset },
                            dst: e.offset,
                            len: e.len,
                        });
                    }
                } else if let Some(run) = unit_runs.last_mut()
                    && let RunSource::Home { offset } = run.source
                {
                    // The home keeps the unit's spacing inside a run.
                    home.push((Arc::clone(&e.param), offset + (e.offset - run.dst)));
                    run.len = e.offset + e.len - run.dst;
                    home_at = align_up(offset + run.len);
                } else {
                    home.push((Arc::clone(&e.param), home_at));
                    unit_runs.push(CopyRun {
                        source: RunSource::Home { offset: home_at },
                        dst: e.offset,
                        len: e.len,
                    });
                    home_at = align_up(home_at + e.len);
                }
            }
            runs.push(unit_runs);
        }
        // The staged units have no runs: the engine copies them through staging buffers.
        runs.resize_with(layout.units().len(), Vec::new);
        let span_bytes = |i: usize| spans[i].1.len() as u64;
        let resident_registered_bytes: u64 = resident_only.iter().map(|&i| span_bytes(i)).sum();
        let registered_bytes =
            (0..spans.len()).map(span_bytes).sum::<u64>() - resident_registered_bytes;
        Self {
            spans,
            resident_only,
            runs,
            home,
            home_bytes: home_at,
            registered_bytes,
            resident_registered_bytes,
            staged_from: registered_units,
            staged_bytes: layout.units()[registered_units..]
                .iter()
                .map(|u| u.bytes)
                .sum(),
        }
    }

    pub(super) fn copies(&self) -> u64 {
        self.runs.iter().map(|r| r.len() as u64).sum()
    }

    pub(super) fn copied_bytes(&self) -> u64 {
        self.runs.iter().flatten().map(|r| r.len).sum()
    }
}
