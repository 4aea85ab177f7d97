//! What a route will hold, stated before it attaches: [`Footprint`] (device bytes kept
//! resident, bytes streamed per forward, transient device bytes during a forward, pinned
//! host bytes, whether the native allocator is needed) for a component, a spec and the
//! memory a [`FootprintContext`] says is there. Each route answers for itself
//! ([`Route::footprint`](crate::Route::footprint)); the pipeline memory planner in
//! `ddo-routes` and the `ddo` command ask the registry instead of restating route
//! knowledge.
//!
//! Figures are upper bounds of what the route allocates for weights; activations and
//! workspaces are the model's and are counted by the planner separately.

use serde::Serialize;

use crate::device::{AllocatorKind, Device, MemoryInfo};

/// The memory a footprint is computed against: what the device has free for the route when
/// it attaches (which a `budget=free-…` option is taken from) and how much pinned host
/// memory it may still take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FootprintContext {
    /// Device bytes free for the component (the driver's figure, or capacity less what is
    /// allocated; the planner passes what its phase leaves).
    pub free_device_bytes: u64,
    /// Pinned host bytes the device can still hand out ([`MemoryInfo::pinned_room`]).
    pub pinned_room: u64,
    /// Whether the device runs copy streams.
    pub supports_streams: bool,
    /// The device's allocator.
    pub allocator: AllocatorKind,
}

impl FootprintContext {
    /// The context of `device` now.
    pub fn of(device: &dyn Device) -> Self {
        let info: MemoryInfo = device.memory_info();
        Self {
            free_device_bytes: info.free_bytes(),
            pinned_room: info.pinned_room(),
            supports_streams: device.supports_streams(),
            allocator: device.allocator(),
        }
    }

    /// This context with `free` device bytes.
    pub fn with_free(self, free: u64) -> Self {
        Self {
            free_device_bytes: free,
            ..self
        }
    }
}

/// What a route holds for one component under one spec.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Footprint {
    /// The component's weight bytes.
    pub weight_bytes: u64,
    /// Weight bytes kept on the device for the attachment's life.
    pub resident_bytes: u64,
    /// Weight bytes copied host→device per forward (after the first, learning, forward
    /// for routes that learn a schedule).
    pub streamed_bytes_per_forward: u64,
    /// Device bytes the route takes during a forward on top of `resident_bytes` and gives
    /// back after it: the streaming ring, or the largest group on the device at once.
    pub transient_device_bytes: u64,
    /// Pinned host bytes held for the attachment's life (a pinned home, pinned copies,
    /// staging buffers, registered ranges).
    pub pinned_host_bytes: u64,
    /// Whether the route needs the native VMM allocator installed.
    pub needs_native_allocator: bool,
    /// Whether attaching puts weights on the device (a resident route uploads them then).
    /// A route that takes device memory only from its first forward on can be attached
    /// while another phase runs ([`PipelineOffload::prepare`] in `ddo-routes`).
    ///
    /// [`PipelineOffload::prepare`]: https://docs.rs/ddo-routes
    pub attaches_on_device: bool,
    /// Whether host copies run from pageable memory because pinned memory was not
    /// available (`pinned_limit` too small): the copies then go at pageable speed.
    pub pageable_staging: bool,
    /// The pinned limit that would let the streamed weights live in a pinned home, when
    /// `pageable_staging` is set (0 otherwise).
    pub pinned_limit_to_avoid_pageable: u64,
    /// Weight bytes copied per forward from pageable memory (the page cache or the disk),
    /// not from pinned memory: what a forward makes the kernel keep in (or read into) the
    /// page cache.
    pub staged_bytes_per_forward: u64,
    /// Of those, the bytes read from the disk again every forward: the staged bytes past
    /// the streaming engine's `page_cache_limit`, whose pages go back after each copy.
    pub disk_bytes_per_forward: u64,
    /// One line on how the route holds the weights.
    pub summary: String,
}

impl Footprint {
    /// Staged bytes whose pages stay in memory between forwards (in the page cache):
    /// `staged_bytes_per_forward` less what is read from the disk again.
    pub fn cached_staged_bytes(&self) -> u64 {
        self.staged_bytes_per_forward
            .saturating_sub(self.disk_bytes_per_forward)
    }

    /// Most weight bytes on the device during a forward: resident plus transient.
    pub fn peak_device_bytes(&self) -> u64 {
        self.resident_bytes
            .saturating_add(self.transient_device_bytes)
    }

    /// A fully resident footprint of `weight_bytes`.
    pub fn resident(weight_bytes: u64) -> Self {
        Self {
            weight_bytes,
            resident_bytes: weight_bytes,
            attaches_on_device: true,
            summary: format!(
                "resident: {} on the device",
                ddo_metrics::format_bytes(weight_bytes)
            ),
            ..Self::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_is_resident_plus_transient() {
        let f = Footprint {
            resident_bytes: 10,
            transient_device_bytes: 5,
            ..Footprint::default()
        };
        assert_eq!(f.peak_device_bytes(), 15);
        let r = Footprint::resident(7);
        assert_eq!(
            (r.peak_device_bytes(), r.streamed_bytes_per_forward),
            (7, 0)
        );
        assert!(r.attaches_on_device && !f.attaches_on_device);
    }
}
