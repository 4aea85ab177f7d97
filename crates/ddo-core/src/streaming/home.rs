//! [`PinnedHome`]: one pinned host buffer that becomes the params' host bytes, so the
//! weights keep one host copy and every host→device copy runs at pinned speed.
//!
//! Building it copies each param's bytes into the buffer and then points the param's host
//! source at its place ([`Param::replace_host`]); the old source (a checkpoint mapping or
//! an owned copy) goes as soon as nobody else holds it. [`PinnedHome::restore`] gives each
//! param an owned pageable copy back before the pinned buffer goes, so a param never has
//! two copies for long and never none. The streaming engine lays its home out in transfer
//! units; the no-stream group offload lays the params one after another.

use std::collections::HashSet;
use std::sync::Arc;

use crate::device::Device;
use crate::error::{CoreError, Result};
use crate::host::HostBuffer;
use crate::param::{Param, ParamId};
use crate::streaming::layout::align_up;

/// Threads that copy the weights into a home: memory bandwidth, not cores, bounds a copy,
/// and a handful of threads reach it.
pub const COPY_THREADS: usize = 8;

/// Bytes copied into a home before its params take it as their host bytes (and their old
/// sources are freed): 256 MiB.
pub const BATCH_BYTES: u64 = 256 << 20;

/// Copies each `(param, offset)` of `items` (sorted by offset, not overlapping) into
/// `dst` at its offset, on up to [`COPY_THREADS`] threads balanced by bytes.
fn copy_disjoint(dst: &mut [u8], items: &[(&Arc<Param>, u64)]) {
    let mut pieces: Vec<(&mut [u8], &Arc<Param>)> = Vec::with_capacity(items.len());
    let mut rest = dst;
    let mut cursor = 0usize;
    for (p, at) in items {
        let at = *at as usize;
        let (_, tail) = rest.split_at_mut(at - cursor);
        let (piece, tail) = tail.split_at_mut(p.nbytes());
        pieces.push((piece, p));
        rest = tail;
        cursor = at + p.nbytes();
    }
    let total: usize = pieces.iter().map(|(d, _)| d.len()).sum();
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, COPY_THREADS);
    if threads == 1 || total < (8 << 20) {
        for (d, p) in pieces {
            p.host().with_bytes(|b| d.copy_from_slice(b));
        }
        return;
    }
    // Hand out consecutive pieces of about total / threads bytes each.
    let share = total.div_ceil(threads);
    let mut groups: Vec<Vec<(&mut [u8], &Arc<Param>)>> = Vec::new();
    let mut current = Vec::new();
    let mut bytes = 0usize;
    for piece in pieces {
        bytes += piece.0.len();
        current.push(piece);
        if bytes >= share {
            groups.push(std::mem::take(&mut current));
            bytes = 0;
        }
    }
    if !current.is_empty() {
        groups.push(current);
    }
    std::thread::scope(|s| {
        for group in groups {
            s.spawn(move || {
                for (d, p) in group {
                    p.host().with_bytes(|b| d.copy_from_slice(b));
                }
            });
        }
    });
}

/// One pinned buffer holding the params' bytes, which replaced their host sources.
#[derive(Debug)]
pub struct PinnedHome {
    buffer: HostBuffer,
    /// `(param, offset)` of every param whose host bytes the home replaced.
    replaced: Vec<(Arc<Param>, u64)>,
    released: u64,
}

impl PinnedHome {
    /// Allocates `bytes` of pinned memory, writes each `(param, offset)` placement (a param
    /// may be placed more than once; its first place becomes its host bytes) and replaces
    /// the params' host sources. The copy runs on up to [`COPY_THREADS`] threads, in batches
    /// of about [`BATCH_BYTES`]; each batch's params take the home as their host bytes as
    /// soon as it is copied, so a source the params alone held is freed batch by batch and
    /// the host holds the weights about once, not twice, while the home is built. On error
    /// nothing changed (params already moved get their previous bytes back, as owned
    /// copies where their source was owned).
    pub fn build<'a>(
        device: &dyn Device,
        placements: impl IntoIterator<Item = (&'a Arc<Param>, u64)>,
        bytes: u64,
    ) -> Result<Self> {
        let buffer = device.alloc_pinned(bytes as usize)?;
        let mut placements: Vec<(&Arc<Param>, u64)> = placements.into_iter().collect();
        placements.sort_by_key(|(_, at)| *at);
        let overlapping = placements
            .windows(2)
            .any(|w| w[0].1 + w[0].0.nbytes() as u64 > w[1].1);
        let mut placed: HashSet<ParamId> = HashSet::new();
        let mut home = Self {
            buffer,
            replaced: Vec::new(),
            released: 0,
        };
        let mut start = 0;
        while start < placements.len() {
            let mut end = start;
            let mut batch_bytes = 0u64;
            while end < placements.len() && (end == start || batch_bytes < BATCH_BYTES) {
                batch_bytes += placements[end].0.nbytes() as u64;
                end += 1;
            }
            let batch = &placements[start..end];
            let copied = home.buffer.with_bytes_mut(|dst| {
                if overlapping {
                    for (p, at) in batch {
                        let at = *at as usize;
                        p.host()
                            .with_bytes(|b| dst[at..at + b.len()].copy_from_slice(b));
                    }
                } else {
                    copy_disjoint(dst, batch);
                }
            });
            if let Err(e) = copied.and_then(|()| home.adopt(batch, &mut placed)) {
                // Give the params moved so far their bytes back before the home goes.
                let _ = home.restore();
                return Err(e);
            }
            start = end;
        }
        Ok(home)
    }

    /// Points the params of `batch` placed here first at their place in the home.
    fn adopt(&mut self, batch: &[(&Arc<Param>, u64)], placed: &mut HashSet<ParamId>) -> Result<()> {
        for (p, offset) in batch {
            if !placed.insert(p.id()) {
                continue;
            }
            let slice = self.buffer.slice(*offset as usize, p.nbytes())?;
            let old = p.replace_host(slice)?;
            // The old bytes go with their last handle; this was it when only ours is left.
            if old.buffer().handle_count() == 1 {
                self.released += old.len() as u64;
            }
            drop(old);
            self.replaced.push((Arc::clone(p), *offset));
        }
        Ok(())
    }

    /// `params` (each once) one after another, each aligned, within `limit` bytes (and what
    /// the device's pinned ledger has left). When they do not fit: `Ok(None)` (the weights
    /// stay where they are), or with `required` a [`CoreError::PinnedLimit`]. No params:
    /// `Ok(None)`.
    pub fn sequential(
        device: &dyn Device,
        params: &[Arc<Param>],
        limit: u64,
        required: bool,
    ) -> Result<Option<Self>> {
        let mut seen = HashSet::new();
        let mut at = 0u64;
        let mut placements = Vec::new();
        for p in params.iter().filter(|p| seen.insert(p.id())) {
            placements.push((p, at));
            at += align_up(p.nbytes() as u64);
        }
        let info = device.memory_info();
        let room = limit.min(info.pinned_room());
        if at == 0 {
            return Ok(None);
        }
        if at > room {
            return if required {
                Err(CoreError::PinnedLimit {
                    requested: at,
                    pinned: info.pinned_host,
                    limit: limit.min(info.pinned_limit),
                })
            } else {
                Ok(None)
            };
        }
        Self::build(device, placements, at).map(Some)
    }

    /// The pinned buffer.
    pub fn buffer(&self) -> &HostBuffer {
        &self.buffer
    }

    /// Pinned bytes held.
    pub fn bytes(&self) -> u64 {
        self.buffer.len() as u64
    }

    /// Host bytes of the params' previous sources that went when the home replaced them.
    pub fn host_bytes_released(&self) -> u64 {
        self.released
    }

    /// Leaves every param with pageable host bytes: the home is unpinned in place (the
    /// params keep reading the same bytes, now pageable, with no copy and no second host
    /// copy of the weights) when the home's memory is owned; otherwise each param gets an
    /// owned pageable copy and the pinned buffer goes. The caller makes sure no queued copy
    /// reads the home. The first failure is returned after every param was tried.
    pub fn restore(self) -> Result<()> {
        if self.buffer.unpin() {
            return Ok(());
        }
        let mut result = Ok(());
        for (p, offset) in &self.replaced {
            let bytes = self.buffer.with_bytes(|b| {
                HostBuffer::pageable_from(&b[*offset as usize..*offset as usize + p.nbytes()])
            });
            if let Err(e) = p.replace_host(bytes.slice_all())
                && result.is_ok()
            {
                result = Err(e);
            }
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host_backend::{HostDevice, HostDeviceConfig};
    use crate::{DType, HostMemoryKind, ParamKind};

    #[test]
    fn a_home_built_in_parallel_batches_holds_every_param_once_and_frees_the_sources() {
        let device = HostDevice::new(HostDeviceConfig {
            capacity: 1 << 20,
            pinned_limit: 1 << 30,
            ..HostDeviceConfig::default()
        })
        .unwrap();
        // 48 params of 1.5 MiB: several batches, several threads per batch.
        let params: Vec<Arc<Param>> = (0..48)
            .map(|i| {
                let values: Vec<f32> = (0..(3 << 17)).map(|k| (i * 7 + k % 13) as f32).collect();
                Param::from_f32(
                    format!("p{i}"),
                    ParamKind::Parameter,
                    DType::F32,
                    vec![values.len()],
                    &values,
                )
                .unwrap()
            })
            .collect();
        let sums: Vec<u64> = params.iter().map(|p| p.host_checksum()).collect();
        let total: u64 = params.iter().map(|p| p.nbytes() as u64).sum();
        let home = PinnedHome::sequential(&*device, &params, 1 << 30, true)
            .unwrap()
            .unwrap();
        assert_eq!(
            home.host_bytes_released(),
            total,
            "every owned source was freed"
        );
        for (p, sum) in params.iter().zip(&sums) {
            assert_eq!(p.host().kind(), HostMemoryKind::Pinned, "{}", p.name());
            assert_eq!(p.host_checksum(), *sum, "{}", p.name());
        }
        home.restore().unwrap();
        for (p, sum) in params.iter().zip(&sums) {
            assert_eq!(p.host().kind(), HostMemoryKind::Pageable);
            assert_eq!(p.host_checksum(), *sum);
        }
        assert_eq!(device.memory_info().pinned_host, 0);
    }
}
