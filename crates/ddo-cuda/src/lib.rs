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
//! - the native allocator wiring ([`vmm_allocator`]): ddo-vmm's pool as the device allocator once
//!   [`CudaDevice::install_native_vmm`] has run (once per device ordinal in a process, whatever
//!   the number of `CudaDevice` values, and refused after any caching allocation on it), with
//!   stream-ordered frees, same-stream reuse and `release_native_idle_cache`;
//! - [`codec`]: the GPU decoder of ddo-codec's encoded bf16 units (one warp per chunk,
//!   queued on any stream of the device, optionally verifying the unit's checksum);
//! - [`CudaError`], converted into [`ddo_core::CoreError`] at the `Device` boundary.
//!
//! Builds need no GPU and no CUDA toolkit: cudarc loads `libcuda` at run time, and
//! [`CudaDevice::new`] checks that it loads (and that the device exists) before any driver
//! call, answering [`CudaError::NoLibrary`] or [`CudaError::NoDevice`] otherwise.
//! `unsafe` lives in the lowest modules: `driver` (one thin checked function per driver
//! call), the NVRTC calls in `ops/nvrtc.rs`, the kernel launch in `ops/kernels.rs`, and the
//! cuBLAS calls in `ops/gemm/`, the cuBLASLt calls in `ops/cublaslt.rs` and the cuDNN
//! calls in `ops/cudnn_attention.rs`; each block carries a `// SAFETY:` comment.
//!
//! Compute: `ops()` gives the GPU [`Ops`](ddo_core::Ops) — NVRTC-compiled kernels for the
//! element-wise, normalisation, layout and rotary ops (and the fused layer norm +
//! modulation and gated residual), cuBLASLt for 16-bit linears with the bias and GELU in
//! the GEMM's epilogue, cuBLAS for the other linears and batched matmul, a tensor-core implicit-GEMM convolution (im2col + cuBLAS for f32), and a fused
//! flash-style attention that never materialises the score matrix (a chunked path for head
//! sizes above 128).
//!
//! Kernels: each source is compiled to a cubin for the device's architecture once per
//! process (`ops/kernels.rs`) and cached on disk across processes ([`kernel_cache_dir`]:
//! `DDO_KERNEL_CACHE`, else `$XDG_CACHE_HOME/ddo/kernels`, else
//! `$HOME/.cache/ddo/kernels`). [`prepare_kernels`] starts those compilations in the
//! background, in parallel, so a program that calls it early (before loading weights)
//! finds them done at its first GPU forward.

pub mod allocator;
mod background;
pub mod device;
mod driver;
pub mod error;
mod host_waits;
mod ops;
mod setup_calls;
pub mod vmm_allocator;

pub use allocator::{AllocatorStats, CachingAllocator, StreamKey};
pub use background::{background_work_pending, join_background_work};
pub use device::{
    CudaAllocation, CudaDevice, CudaDeviceConfig, CudaEventHandle, CudaStreamHandle,
    DEFAULT_UPLOAD_STAGING_BYTES, device_count, library_present,
};
pub use error::{CudaError, Result};
pub use ops::codec;
pub use ops::kernel_cache::KernelCacheStats;
pub use ops::kernels::{
    forget_kernel_images, kernel_cache_dir, kernel_cache_stats, prepare_kernels,
};
