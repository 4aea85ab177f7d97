//! A [`CudaDevice`]'s settings ([`CudaDeviceConfig`] and its defaults: upload staging,
//! scratch, the pinned limit) and the probes that run before any device exists
//! ([`library_present`], [`device_count`]).

use crate::driver;
use crate::error::{CudaError, Result};

#[cfg(doc)]
use super::CudaDevice;
#[cfg(doc)]
use ddo_core::{Device, MemoryInfo};

/// Settings of a [`CudaDevice`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaDeviceConfig {
    /// Device ordinal (`cuda:N`), as the driver numbers devices visible to this process.
    pub ordinal: usize,
    /// Limit on pinned host bytes handed out by [`Device::alloc_pinned`]; `None`: half of
    /// the host's physical memory (16 GiB where that cannot be read).
    pub pinned_limit: Option<u64>,
    /// Install the native VMM allocator at creation, before anything is allocated
    /// ([`CudaDevice::install_native_vmm`] does it later, as long as nothing has been).
    pub native_vmm: bool,
    /// Most pinned bytes kept for staging pageable host→device uploads (model inputs,
    /// rotary tables, small host-built tensors); uploads larger than half of it, and every
    /// upload when it is 0, are copied straight from pageable memory and waited for. The
    /// buffers count in the pinned ledger ([`MemoryInfo::pinned_host`], under
    /// `pinned_limit`), are made only when that has room, give way to
    /// [`Device::alloc_pinned`] and are returned by [`Device::empty_cache`].
    pub upload_staging_bytes: u64,
}

/// Default [`CudaDeviceConfig::upload_staging_bytes`]: room for a Flux step's inputs and
/// rotary tables (about 10 MB at 4608 + 512 tokens).
pub const DEFAULT_UPLOAD_STAGING_BYTES: u64 = 32 << 20;

/// Device bytes a CUDA device reports as scratch ([`Device::scratch_bytes`]) for memory
/// planners: 256 MiB for cuBLAS/cuBLASLt workspaces, the attention and convolution
/// kernels' scratch and the caching allocator's rounding.
pub const SCRATCH_BYTES: u64 = 256 << 20;

impl CudaDeviceConfig {
    /// Defaults for device `ordinal`.
    pub fn new(ordinal: usize) -> Self {
        Self {
            ordinal,
            pinned_limit: None,
            native_vmm: false,
            upload_staging_bytes: DEFAULT_UPLOAD_STAGING_BYTES,
        }
    }
}

/// Whether the CUDA driver library can be loaded (no driver call is made).
pub fn library_present() -> bool {
    driver::library_present()
}

/// How many CUDA devices the driver reports; [`CudaError::NoLibrary`] without a driver.
pub fn device_count() -> Result<usize> {
    if !driver::library_present() {
        return Err(no_driver_library());
    }
    driver::device_count()
}

fn no_driver_library() -> CudaError {
    CudaError::NoLibrary {
        which: "libcuda",
        hint: "cudarc loads libcuda.so (also .so.1 and versioned names) at run time through the dynamic \
               loader, which searches LD_LIBRARY_PATH, the ld.so cache and the system library directories; \
               install the NVIDIA driver or add the directory holding libcuda.so to LD_LIBRARY_PATH \
               (e.g. /usr/local/nvidia/lib64), or run on the host backend"
            .into(),
    }
}

pub(super) fn default_pinned_limit() -> u64 {
    ddo_core::host_memory::mem_total().map_or(16 << 30, |b| b / 2)
}
