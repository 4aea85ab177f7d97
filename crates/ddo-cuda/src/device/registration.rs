//! Page-locked host memory of a [`CudaDevice`]: [`HostRegistration`] (one
//! `cuMemHostRegister`, undone on drop), pinned allocations and checkpoint-mapping
//! registrations counted under the device's pinned ledger, and making room in that ledger
//! by dropping idle upload buffers.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use cudarc::driver::CudaContext;
use ddo_core::host_memory::{AlignedBytes, register_target};
use ddo_core::released_host::pinned_bytes_of;
use ddo_core::{CoreError, Device, HostBuffer};

use super::CudaDevice;
use super::memory::Shared;
use crate::driver;
use crate::error::CudaError;

/// The page-locking of one pinned host buffer, or of a registered range of a checkpoint
/// mapping; unregisters on drop (errors are recorded on the device, never raised).
struct HostRegistration {
    addr: usize,
    ctx: Arc<CudaContext>,
    shared: Weak<Shared>,
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if let Err(e) = driver::host_unregister(&self.ctx, self.addr)
            && let Some(shared) = self.shared.upgrade()
        {
            shared.defer("unregistering pinned host memory", &e);
        }
    }
}

impl CudaDevice {
    /// The pinned bytes now, after dropping the idle upload buffers when `bytes` more would
    /// pass the limit (the buffers are a cache: they give way to pinned memory asked for).
    fn pinned_making_room(&self, bytes: u64) -> u64 {
        let pinned = self.pinned.pinned();
        if pinned.saturating_add(bytes) > self.pinned.limit()
            && (self.unpin_released_host() > 0 || self.release_upload_staging() > 0)
        {
            return self.pinned_making_room(bytes);
        }
        pinned
    }

    /// Pinned bytes of the host memory [`Device::release_host`] kept (part of
    /// [`MemoryInfo::pinned_cached`](ddo_core::MemoryInfo::pinned_cached): it gives way to
    /// pinned memory asked for).
    pub fn released_host_bytes(&self) -> u64 {
        self.released_host.pinned_bytes()
    }

    /// Drops the host memory [`Device::release_host`] kept (each registration unregisters
    /// as its last handle goes); returns the pinned bytes that were let go.
    pub(super) fn unpin_released_host(&self) -> u64 {
        let released = self.released_host.take_all();
        let bytes = pinned_bytes_of(&released);
        drop(released);
        bytes
    }

    /// The body of [`Device::alloc_pinned`].
    pub(super) fn alloc_pinned_impl(&self, bytes: usize) -> ddo_core::Result<HostBuffer> {
        let (pinned, limit) = (self.pinned_making_room(bytes as u64), self.pinned.limit());
        if pinned.saturating_add(bytes as u64) > limit {
            return Err(CoreError::PinnedLimit {
                requested: bytes as u64,
                pinned,
                limit,
            });
        }
        // Committed on several threads first: registering lazily zeroed memory would fault
        // (and zero) every page on the driver's one thread.
        let memory = AlignedBytes::zeroed_committed(bytes);
        if bytes == 0 {
            let registration = self.pinned.reserve(0, None)?;
            return Ok(HostBuffer::owned(memory, Some(registration)));
        }
        driver::host_register(&self.shared.ctx, memory.as_slice()).map_err(|e| self.core(e))?;
        let token = HostRegistration {
            addr: memory.as_slice().as_ptr() as usize,
            ctx: Arc::clone(&self.shared.ctx),
            shared: Arc::downgrade(&self.shared),
        };
        // On a refusal (another thread took the room meanwhile) the token drops here and
        // unregisters, before `memory` is freed.
        let registration = self.pinned.reserve(bytes as u64, Some(Box::new(token)))?;
        Ok(HostBuffer::owned(memory, Some(registration)))
    }

    /// The body of [`Device::register_host`].
    /// A range handed back by [`Device::release_host`] and kept pinned is reused as it is
    /// (a second attach of the same plan pins nothing again); a kept one that overlaps the
    /// range without being it is unregistered first (a page is registered once).
    pub(super) fn register_host_impl(&self, buffer: &HostBuffer) -> ddo_core::Result<HostBuffer> {
        if let Some(kept) = self.released_host.reuse(buffer) {
            return Ok(kept);
        }
        let (map, span) = register_target(&self.id().to_string(), buffer)?;
        drop(self.released_host.take_overlapping(&map, &span));
        let bytes = span.len() as u64;
        let (pinned, limit) = (self.pinned_making_room(bytes), self.pinned.limit());
        if pinned.saturating_add(bytes) > limit {
            return Err(CoreError::PinnedLimit {
                requested: bytes,
                pinned,
                limit,
            });
        }
        if span.is_empty() {
            let registration = self.pinned.reserve(0, None)?;
            return HostBuffer::registered(buffer.clone(), registration);
        }
        let range = &map.bytes()[span.clone()];
        driver::host_register_read_only(&self.shared.ctx, range).map_err(|e| {
            use cudarc::driver::sys::CUresult as R;
            match e.0 {
                R::CUDA_ERROR_NOT_SUPPORTED
                | R::CUDA_ERROR_NOT_PERMITTED
                | R::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED => {
                    CoreError::HostRegisterUnsupported {
                        device: self.id().to_string(),
                        reason: format!(
                            "cuMemHostRegister (read-only) of bytes {}..{} of {} answered {:?}",
                            span.start,
                            span.end,
                            map.path().display(),
                            e.0
                        ),
                    }
                }
                _ => self.core(CudaError::driver("cuMemHostRegister", e)),
            }
        })?;
        let token = HostRegistration {
            addr: range.as_ptr() as usize,
            ctx: Arc::clone(&self.shared.ctx),
            shared: Arc::downgrade(&self.shared),
        };
        // On a refusal the token drops here and unregisters; `map` is still held.
        let registration = self.pinned.reserve(bytes, Some(Box::new(token)))?;
        self.host_registrations.fetch_add(1, Ordering::Relaxed);
        HostBuffer::registered(buffer.clone(), registration)
    }
}
