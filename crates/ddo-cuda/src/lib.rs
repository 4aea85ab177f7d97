//! DDO's CUDA backend: ddo-core's [`Device`](ddo_core::Device) on an NVIDIA GPU, through
//! cudarc.
//!
//! `ddo-cuda` sits above `ddo-core` beside the host backend: routes and models talk to the
//! `Device` trait and run here unchanged. Only this crate and `ddo-vmm` hold CUDA calls.
//! It holds:
//!
//! - [`CudaDevice`]: context, compute and copy streams, events, asynchronous copies that
//!   keep the memory they use alive until they complete, pinned host memory
//!   (DDO's own aligned bytes page-locked with `cuMemHostRegister`), memory figures;
//! - the [`allocator`]: a PyTorch-style caching allocator (size classes, best fit,
//!   splitting and merging, stream-ordered reuse, an out-of-memory retry, exact
//!   accounting) over a small raw-memory trait, with a fake so all of it is tested on CPU;
//! - [`CudaError`], converted into [`ddo_core::CoreError`] at the `Device` boundary.
//!
//! Builds need no GPU and no CUDA toolkit: cudarc loads `libcuda` at run time, and
//! [`CudaDevice::new`] checks that it loads (and that the device exists) before any driver
//! call, answering [`CudaError::NoLibrary`] or [`CudaError::NoDevice`] otherwise.
//! All `unsafe` lives in one private module (`driver`), one thin checked function per
//! driver call; everything above it is safe code.
//!
//! Compute ([`Ops`](ddo_core::Ops)) comes later: `ops()` is `None` for now.

pub mod allocator;
pub mod device;
mod driver;
pub mod error;
mod ops;

pub use allocator::{AllocatorStats, CachingAllocator, StreamKey};
pub use device::{
    CudaAllocation, CudaDevice, CudaDeviceConfig, CudaEventHandle, CudaStreamHandle, device_count,
    library_present,
};
pub use error::{CudaError, Result};
