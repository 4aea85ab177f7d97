//! `detach_auxiliary_cpu_sources`: copies a component's small, checkpoint-backed host
//! tensors into owned memory, within an explicit byte bound, so the checkpoint mapping can
//! be dropped.
//!
//! It follows the seed's contract: it copies only registered, source-backed groups (one
//! group per leaf) that fit in the bound; it preserves values, dtype, identity (the same
//! `Arc<Param>`), exact registered aliases (one param under two names stays one param)
//! and source descriptors; and it refuses — changing nothing — on training mode, a
//! component not declared exclusively owned, execution already started, references to a
//! mapping or buffer it did not register, overlapping sources that are not one registered
//! alias, and layouts it cannot copy faithfully. Resident memory and the mapping are
//! measured separately (`RssAnon`, `RssFile`, and the commit charge where the OS reports
//! one); `commit_recovery_proven` is set only when a measured commit drop backs it, never on
//! a drop of `RssFile`.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Weak};

use ddo_metrics::{DetachSummary, SkippedGroup};

use crate::component::{Component, Mode};
use crate::error::{CoreError, DetachRefusal, Result};
use crate::host_memory::{CheckpointMap, HostBuffer};
use crate::param::Param;

/// `RssAnon` and `RssFile` of this process, in bytes, from `/proc/self/status` (Linux).
pub fn rss_anon_file() -> (Option<u64>, Option<u64>) {
    use crate::host_memory::process_status_bytes;
    (
        process_status_bytes("RssAnon"),
        process_status_bytes("RssFile"),
    )
}

/// The process's commit charge (bytes), where the OS reports one per process: `None` on
/// Linux, which charges no commit for a read-only file mapping (a checkpoint's) and reports
/// no per-process commit figure, and on every other OS DDO runs on today.
pub fn process_commit_bytes() -> Option<u64> {
    None
}

/// The seed's conservative rule: proven only when mappings were released and a measured
/// commit charge dropped; a drop in `RssFile` (resident pages of the file) is not commit.
fn commit_recovery_proven(s: &DetachSummary) -> bool {
    s.mappings_released > 0
        && matches!((s.commit_before, s.commit_after), (Some(b), Some(a)) if a < b)
}

/// A param's byte range in a mapping: range, param name, mapping.
type MappedRange<'a> = (std::ops::Range<usize>, &'a str, &'a Arc<CheckpointMap>);

struct Candidate {
    group: String,
    params: Vec<Arc<Param>>,
    bytes: u64,
}

/// Runs the operation on `component`; `forwards_started` is how many forwards the attached
/// route has begun (any is a refusal).
pub fn detach_auxiliary_cpu_sources(
    component: &Component,
    forwards_started: u64,
    enabled: bool,
    max_copy_bytes: u64,
) -> Result<DetachSummary> {
    let mut summary = DetachSummary {
        enabled,
        max_copy_bytes,
        bytes_copied: 0,
        groups_copied: 0,
        tensors_copied: 0,
        groups_skipped: Vec::new(),
        mappings_released: 0,
        mapping_bytes_released: 0,
        rss_anon_before: None,
        rss_anon_after: None,
        rss_file_before: None,
        rss_file_after: None,
        commit_before: None,
        commit_after: None,
        commit_recovery_proven: false,
    };
    if !enabled {
        return Ok(summary);
    }
    let refuse = |refusal| CoreError::DetachRefused {
        component: component.name().to_string(),
        refusal,
    };
    if component.mode() == Mode::Train {
        return Err(refuse(DetachRefusal::TrainingMode));
    }
    if !component.exclusively_owned() {
        return Err(refuse(DetachRefusal::NotExclusive));
    }
    if forwards_started > 0 {
        return Err(refuse(DetachRefusal::ExecutionStarted {
            forwards: forwards_started,
        }));
    }

    // Source-backed params grouped by the first leaf that registers them.
    let mut seen = HashSet::new();
    let mut candidates: Vec<Candidate> = Vec::new();
    let mut mapped: Vec<(Arc<Param>, HostBuffer)> = Vec::new();
    for leaf in component.leaves() {
        let mut group = Candidate {
            group: leaf.path().to_string(),
            params: Vec::new(),
            bytes: 0,
        };
        for (_, p) in leaf.params() {
            if !seen.insert(p.id()) {
                continue;
            }
            let host = p.host();
            if host.buffer().mapping().is_none() {
                continue;
            }
            if p.dtype().is_quantized() {
                return Err(refuse(DetachRefusal::UnsupportedLayout {
                    param: p.name().to_string(),
                    why: "quantized storage whose layout belongs to its quantizer".into(),
                }));
            }
            if host.offset() != 0 || host.len() != host.buffer().len() {
                return Err(refuse(DetachRefusal::UnsupportedLayout {
                    param: p.name().to_string(),
                    why: "a view into a larger mapped tensor".into(),
                }));
            }
            group.bytes += host.len() as u64;
            group.params.push(Arc::clone(p));
            mapped.push((Arc::clone(p), host.buffer().clone()));
        }
        if !group.params.is_empty() {
            candidates.push(group);
        }
    }

    // Overlap: two distinct params over intersecting bytes of one mapping.
    let mut by_map: BTreeMap<usize, Vec<MappedRange<'_>>> = BTreeMap::new();
    for (p, buf) in &mapped {
        if let Some((map, offset, len)) = buf.mapping() {
            by_map.entry(Arc::as_ptr(map) as usize).or_default().push((
                offset..offset + len,
                p.name(),
                map,
            ));
        }
    }
    for ranges in by_map.values_mut() {
        ranges.sort_by_key(|(r, _, _)| (r.start, r.end));
        for pair in ranges.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            if b.0.start < a.0.end || (a.0 == b.0 && !a.0.is_empty()) {
                return Err(refuse(DetachRefusal::OverlappingSources {
                    first: a.1.to_string(),
                    second: b.1.to_string(),
                    path: a.2.path().display().to_string(),
                }));
            }
        }
    }

    // Ownership: every handle to a mapped buffer and every reference to a mapping must be
    // one DDO registered. `mapped` holds one extra handle per buffer, and the param the other.
    let mut buffers_per_map: HashMap<usize, usize> = HashMap::new();
    for (_, buf) in &mapped {
        let extra = buf.handle_count().saturating_sub(2);
        if extra > 0 {
            let path = buf
                .mapping()
                .map(|(m, _, _)| m.path().display().to_string())
                .unwrap_or_default();
            return Err(refuse(DetachRefusal::UnknownOwnership {
                path,
                unknown: extra,
            }));
        }
        if let Some((map, _, _)) = buf.mapping() {
            *buffers_per_map
                .entry(Arc::as_ptr(map) as usize)
                .or_default() += 1;
        }
    }
    let mut maps: Vec<Weak<CheckpointMap>> = Vec::new();
    let mut map_sizes: Vec<u64> = Vec::new();
    for ranges in by_map.values() {
        let map = ranges[0].2;
        let registered = buffers_per_map
            .get(&(Arc::as_ptr(map) as usize))
            .copied()
            .unwrap_or(0);
        let unknown = Arc::strong_count(map).saturating_sub(registered);
        if unknown > 0 {
            return Err(refuse(DetachRefusal::UnknownOwnership {
                path: map.path().display().to_string(),
                unknown,
            }));
        }
        maps.push(Arc::downgrade(map));
        map_sizes.push(map.len() as u64);
    }
    drop(by_map);
    drop(mapped);

    // Plan within the bound, in leaf order; then copy.
    let mut plan = Vec::new();
    let mut left = max_copy_bytes;
    for c in candidates {
        if c.bytes <= left {
            left -= c.bytes;
            plan.push(c);
        } else {
            summary.groups_skipped.push(SkippedGroup {
                group: c.group,
                bytes: c.bytes,
                reason: format!("needs {} B, {} B of the bound left", c.bytes, left),
            });
        }
    }

    (summary.rss_anon_before, summary.rss_file_before) = rss_anon_file();
    summary.commit_before = process_commit_bytes();
    for group in &plan {
        for p in &group.params {
            let owned = p.host().with_bytes(HostBuffer::pageable_from);
            let old = p.replace_host(owned.slice_all())?;
            drop(old);
            summary.tensors_copied += 1;
        }
        summary.bytes_copied += group.bytes;
        summary.groups_copied += 1;
    }
    for (weak, size) in maps.iter().zip(map_sizes) {
        if weak.strong_count() == 0 {
            summary.mappings_released += 1;
            summary.mapping_bytes_released += size;
        }
    }
    (summary.rss_anon_after, summary.rss_file_after) = rss_anon_file();
    summary.commit_after = process_commit_bytes();
    summary.commit_recovery_proven = commit_recovery_proven(&summary);
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn released(rss: (u64, u64), commit: Option<(u64, u64)>) -> DetachSummary {
        DetachSummary {
            enabled: true,
            max_copy_bytes: 1 << 24,
            bytes_copied: 64,
            groups_copied: 1,
            tensors_copied: 1,
            groups_skipped: Vec::new(),
            mappings_released: 1,
            mapping_bytes_released: 1 << 20,
            rss_anon_before: Some(1 << 30),
            rss_anon_after: Some(1 << 30),
            rss_file_before: Some(rss.0),
            rss_file_after: Some(rss.1),
            commit_before: commit.map(|c| c.0),
            commit_after: commit.map(|c| c.1),
            commit_recovery_proven: false,
        }
    }

    #[test]
    fn only_a_measured_commit_drop_proves_commit_recovery() {
        // RssFile fell by the whole mapping, commit not measured: not proven (the seed:
        // resident memory and commit are measured separately).
        assert!(!commit_recovery_proven(&released((2 << 20, 1 << 20), None)));
        assert!(commit_recovery_proven(&released(
            (1 << 20, 1 << 20),
            Some((9, 8))
        )));
        assert!(!commit_recovery_proven(&released(
            (2 << 20, 1 << 20),
            Some((8, 8))
        )));
        let mut none_released = released((2 << 20, 1 << 20), Some((9, 8)));
        none_released.mappings_released = 0;
        assert!(!commit_recovery_proven(&none_released));
        let text = released((2 << 20, 1 << 20), None).format_profile();
        assert!(text.contains("commit not measured on this OS"), "{text}");
        assert!(text.contains("commit_recovery_proven: false"), "{text}");
    }
}
