//! DDO's host backend: the CPU implementation of `ddo-core`'s [`Device`](ddo_core::Device)
//! and [`Ops`](ddo_core::Ops) contracts, beside `ddo-cuda` (the CUDA implementation of the
//! same traits), as wgpu's backends sit beside each other.
//!
//! `ddo-host` sits just above `ddo-core` (and the leaf crates `ddo-metrics` and
//! `ddo-codec`): it depends on nothing else of DDO, and no route crate, the registry or the
//! models depend on it except in their tests. The `ddo` command and the examples link it to
//! run on a machine without a GPU; every crate's tests run the same routes on it that a GPU
//! runs. It holds:
//!
//! - [`HostDevice`] ([`device`]): "device memory" that is host memory with a capacity, so
//!   out-of-memory is real; exact current/peak accounting; pinned host memory under a
//!   limit; host registrations of checkpoint mappings; an optional simulated link
//!   bandwidth;
//! - the copy engine ([`copy_engine`]): one worker thread per stream, events, stream-ordered
//!   frees, so copy/compute overlap and a missing `wait_event` behave as they would on a
//!   GPU;
//! - the host compute plane ([`ops`]): every [`Ops`](ddo_core::Ops) op in f32 on the
//!   calling thread after the compute stream drains (matrixmultiply GEMM, im2col
//!   convolution, blocked online-softmax attention), behind `ddo-core`'s one set of shape
//!   rules (`ddo_core::shape`);
//! - test support, behind the `test-support` feature (which only other crates' tests
//!   enable): `deferred::DeferredComputeDevice`, a host device whose compute runs as
//!   late as the host allows, so a missing `wait_event` before a copy gives wrong output.
//!
//! Architecture invariant: this crate never depends on cudarc or any GPU library, and holds
//! `unsafe` in one place only (the sgemm call in `ops/gemm.rs`).

pub mod copy_engine;
#[cfg(any(test, feature = "test-support"))]
pub mod deferred;
pub mod device;
pub mod ops;

#[cfg(any(test, feature = "test-support"))]
pub use deferred::DeferredComputeDevice;
pub use device::{HostAllocation, HostDevice, HostDeviceConfig};
