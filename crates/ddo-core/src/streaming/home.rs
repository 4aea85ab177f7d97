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
    /// the params' host sources. On error nothing changed.
    pub fn build<'a>(
        device: &dyn Device,
        placements: impl IntoIterator<Item = (&'a Arc<Param>, u64)>,
        bytes: u64,
    ) -> Result<Self> {
        let buffer = device.alloc_pinned(bytes as usize)?;
        let mut first: Vec<(Arc<Param>, u64)> = Vec::new();
        let mut placed: HashSet<ParamId> = HashSet::new();
        let placements: Vec<(&Arc<Param>, u64)> = placements.into_iter().collect();
        buffer.with_bytes_mut(|home| {
            for (p, at) in &placements {
                let start = *at as usize;
                p.host()
                    .with_bytes(|b| home[start..start + b.len()].copy_from_slice(b));
                if placed.insert(p.id()) {
                    first.push((Arc::clone(p), *at));
                }
            }
        })?;
        // Replace the host bytes only once everything is copied.
        let mut released = 0u64;
        let mut replaced = Vec::with_capacity(first.len());
        for (p, offset) in first {
            let slice = buffer.slice(offset as usize, p.nbytes())?;
            let old = p.replace_host(slice)?;
            // The old bytes go with their last handle; this was it when only ours is left.
            if old.buffer().handle_count() == 1 {
                released += old.len() as u64;
            }
            drop(old);
            replaced.push((p, offset));
        }
        Ok(Self {
            buffer,
            replaced,
            released,
        })
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

    /// Gives every param an owned pageable copy of its bytes back, then drops the pinned
    /// buffer. The first failure is returned after every param was tried.
    pub fn restore(self) -> Result<()> {
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
