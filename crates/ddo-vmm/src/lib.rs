//! DDO's native allocator on CUDA virtual memory management: a pool over one reserved
//! virtual address range, backed by physical chunks of the device's allocation granularity
//! that are mapped on demand, so an allocation can grow in place without copying and freed
//! ranges are reused without fragmenting physical memory (the idea behind PyTorch's
//! expandable segments); idle chunks go back to the driver only at a quiescent boundary.
//!
//! `ddo-vmm` sits above `ddo-core` and the driver and below `ddo-cuda`'s device install
//! step: `CudaDevice` installs a [`VmmPool`] as its allocator (the `native_vmm` allocator
//! of [`AllocatorKind`](ddo_core::AllocatorKind)) and routes `Device::alloc` to it; routes
//! never see this crate. It holds three layers, as cudarc does:
//!
//! - a private `driver` module, the crate's only `unsafe`: one thin checked function per
//!   `cuMem*` call (cudarc wraps none of them), each with its contract and a `// SAFETY:`
//!   line, and the `is_culib_present` probe that runs before any driver call;
//! - the small [`PhysicalMemory`] trait (granularity, reserve / free a range, create /
//!   release a chunk, map / unmap, set access, the driver's memory figures), which
//!   validates nothing, with two implementations: [`CudaPhysicalMemory`] (the driver) and
//!   [`FakePhysicalMemory`] (in process, stricter than the driver, with failure injection
//!   and readable memory, so every rule of the pool is tested on CPU);
//! - [`VmmPool`], which owns all the bookkeeping: best-fit placement in the range, pages
//!   mapped on demand, [`VmmPool::grow`], [`VmmPool::release_idle`] behind a
//!   [`QuiescenceGate`] (the pool cannot see streams), exact accounting ([`PoolStats`]).
//!
//! Errors are one enum, [`VmmError`], converted into [`ddo_core::CoreError`] at the
//! `Device` boundary. Builds need no GPU and no CUDA toolkit (cudarc loads `libcuda` at run
//! time); without a driver, [`CudaPhysicalMemory::new`] is [`VmmError::NoLibrary`].

pub mod cuda;
mod driver;
pub mod error;
pub mod fake;
pub mod physical;
pub mod pool;
pub mod quiescence;

pub use cuda::{CudaPhysicalMemory, device_count, library_present, primary_context};
pub use error::{Result, VmmError};
pub use fake::{FakeOp, FakePhysicalMemory};
pub use physical::{ChunkHandle, PhysicalMemory, VaRange};
pub use pool::{
    ALIGNMENT, PoolAllocation, PoolStats, ReleaseReport, VmmPool, VmmPoolConfig, round_len,
};
pub use quiescence::QuiescenceGate;
