//! [`CudaPhysicalMemory`]: [`PhysicalMemory`] on the CUDA driver, one driver call per method
//! (through the crate's `driver` module). Safe code; it validates nothing.

use std::fmt;
use std::sync::Arc;

use cudarc::driver::CudaContext;

use crate::driver;
use crate::error::{Result, VmmError};
use crate::physical::{ChunkHandle, PhysicalMemory, VaRange};

/// Whether the CUDA driver library can be loaded (no driver call is made). The one
/// probe of the workspace: `ddo-cuda` asks it too.
pub fn library_present() -> bool {
    driver::library_present()
}

/// How many CUDA devices the driver reports (`cuInit`, then `cuDeviceGetCount`; no device
/// is 0); [`VmmError::NoLibrary`] without a driver. Shared with `ddo-cuda`.
pub fn device_count() -> Result<usize> {
    if !driver::library_present() {
        return Err(VmmError::NoLibrary);
    }
    driver::device_count()
}

/// Device `ordinal`'s primary context, retained until the last `Arc` drops (the driver
/// library must be present: [`library_present`]). Shared with `ddo-cuda`.
pub fn primary_context(ordinal: usize) -> Result<Arc<CudaContext>> {
    if !driver::library_present() {
        return Err(VmmError::NoLibrary);
    }
    driver::primary_context(ordinal)
}

/// The virtual-memory calls of one CUDA device, in one context.
///
/// What it needs: the driver library (checked with `is_culib_present` before any driver
/// call: [`VmmError::NoLibrary`] otherwise), a device that supports virtual memory
/// management ([`VmmError::Unsupported`] otherwise), and a context of that device — the
/// device's primary context from [`CudaPhysicalMemory::new`], or the caller's from
/// [`CudaPhysicalMemory::from_context`] (a `CudaDevice` passes its own, so pool memory and the
/// device's streams share one context). The context is kept alive (an `Arc`) and bound to
/// the calling thread before every call.
pub struct CudaPhysicalMemory {
    ctx: Arc<CudaContext>,
    granularity: u64,
}

impl CudaPhysicalMemory {
    /// Device `ordinal`'s primary context. Checks that the driver library loads, that the
    /// device exists and that it supports virtual memory management, in that order.
    pub fn new(ordinal: usize) -> Result<Self> {
        if !driver::library_present() {
            return Err(VmmError::NoLibrary);
        }
        let count = driver::device_count()?;
        if ordinal >= count {
            return Err(VmmError::NoDevice { ordinal, count });
        }
        Self::from_context(driver::primary_context(ordinal)?)
    }

    /// An existing context (e.g. `CudaDevice::context()`). Checks virtual memory management
    /// support and reads the allocation granularity.
    pub fn from_context(ctx: Arc<CudaContext>) -> Result<Self> {
        if !driver::library_present() {
            return Err(VmmError::NoLibrary);
        }
        if !driver::vmm_supported(&ctx)? {
            return Err(VmmError::Unsupported {
                ordinal: ctx.ordinal(),
            });
        }
        let granularity = driver::granularity(&ctx)?;
        if granularity == 0 {
            return Err(VmmError::InvalidConfig {
                reason: format!(
                    "the driver reports an allocation granularity of 0 on cuda:{}",
                    ctx.ordinal()
                ),
            });
        }
        Ok(Self { ctx, granularity })
    }

    /// The context every call runs in (for kernels, copies and synchronisation).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The device ordinal.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }
}

impl fmt::Debug for CudaPhysicalMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CudaPhysicalMemory(cuda:{}, granularity {} B)",
            self.ctx.ordinal(),
            self.granularity
        )
    }
}

impl PhysicalMemory for CudaPhysicalMemory {
    fn granularity(&self) -> u64 {
        self.granularity
    }

    fn reserve(&self, bytes: u64) -> Result<VaRange> {
        let base = driver::address_reserve(&self.ctx, bytes, self.granularity)?;
        Ok(VaRange { base, len: bytes })
    }

    fn free_range(&self, range: VaRange) -> Result<()> {
        driver::address_free(&self.ctx, range.base, range.len)
    }

    fn create(&self, bytes: u64) -> Result<ChunkHandle> {
        let raw = driver::mem_create(&self.ctx, bytes)?;
        Ok(ChunkHandle::from_raw(raw, bytes))
    }

    fn release(&self, chunk: ChunkHandle) -> Result<()> {
        driver::mem_release(&self.ctx, chunk.raw())
    }

    fn map(&self, va: u64, chunk: &ChunkHandle) -> Result<()> {
        driver::mem_map(&self.ctx, va, chunk.bytes(), chunk.raw())
    }

    fn unmap(&self, va: u64, bytes: u64) -> Result<()> {
        driver::mem_unmap(&self.ctx, va, bytes)
    }

    fn set_access(&self, va: u64, bytes: u64) -> Result<()> {
        driver::mem_set_access(&self.ctx, va, bytes)
    }

    fn mem_info(&self) -> Option<(u64, u64)> {
        driver::mem_get_info(&self.ctx).ok()
    }
}
