//! The one module of ddo-cuda that holds `unsafe`: one thin checked function per CUDA
//! driver call that cudarc's safe API does not cover (raw device allocations, copies from
//! and to DDO's own host bytes, page-locking DDO's own host memory and, read-only,
//! checkpoint mappings) plus the library probe.
//!
//! These functions validate nothing beyond what their signatures guarantee; they are
//! crate-private and each states the contract its callers keep (the layer above —
//! [`allocator`](crate::allocator) and [`device`](crate::device) — owns every pointer and
//! keeps host and device memory alive until the copies that use it have completed).
//! Contexts, streams and events are cudarc's safe types.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, DriverError, result, sys};

use crate::error::{CudaError, DriverResultExt, Result};

/// Whether the driver library (`libcuda.so`) can be loaded. Must be `true` before any other
/// function of this module runs: cudarc panics on a missing library. The probe, the device
/// count and the primary context are `ddo-vmm`'s (written once, below this crate).
pub(crate) fn library_present() -> bool {
    ddo_vmm::library_present()
}

/// `cuInit`, then `cuDeviceGetCount`. `CUDA_ERROR_NO_DEVICE` from either is a count of 0.
pub(crate) fn device_count() -> Result<usize> {
    ddo_vmm::device_count().map_err(CudaError::from_shared_glue)
}

/// The compute capability `(major, minor)` of device `ordinal`: `cuInit`, then
/// `cuDeviceGet` and two `cuDeviceGetAttribute`s; no context is made.
pub(crate) fn compute_capability(ordinal: usize) -> Result<(i32, i32)> {
    let count = device_count()?;
    let no_device = CudaError::NoDevice { ordinal, count };
    if ordinal >= count {
        return Err(no_device);
    }
    let dev = result::device::get(c_int::try_from(ordinal).map_err(|_| no_device)?)
        .call("cuDeviceGet")?;
    let attribute = |a| {
        // SAFETY: `dev` was returned by `cuDeviceGet` (after `cuInit`), which is all
        // `cuDeviceGetAttribute` needs; the attribute is a valid enum value.
        unsafe { result::device::get_attribute(dev, a) }.call("cuDeviceGetAttribute")
    };
    Ok((
        attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    ))
}

/// The primary context of device `ordinal` (retained; released when the last `Arc` drops).
pub(crate) fn primary_context(ordinal: usize) -> Result<Arc<CudaContext>> {
    ddo_vmm::primary_context(ordinal).map_err(CudaError::from_shared_glue)
}

/// `cuMemAlloc`: `bytes` of device memory in `ctx`. The raw error is kept so the caller can
/// tell out-of-memory from other failures.
pub(crate) fn mem_alloc(ctx: &CudaContext, bytes: usize) -> std::result::Result<u64, DriverError> {
    ctx.bind_to_thread()?;
    // SAFETY: cuMemAlloc writes one pointer into cudarc's out-parameter; the memory it
    // returns is uninitialised, and DDO never reads device memory it has not written.
    crate::host_waits::timed("cuMemAlloc", || unsafe { result::malloc_sync(bytes) })
}

/// `cuMemFree`.
///
/// Contract: `ptr` came from [`mem_alloc`] in `ctx`, is freed once, and no queued work uses
/// it any more (the caching allocator frees only segments with no live block and no pending
/// free event).
pub(crate) fn mem_free(ctx: &CudaContext, ptr: u64) -> Result<()> {
    ctx.bind_to_thread().call("cuCtxSetCurrent")?;
    // SAFETY: by this function's contract `ptr` is a live allocation of this context that
    // nothing uses any more, freed exactly once.
    crate::host_waits::timed("cuMemFree", || unsafe { result::memory_free(ptr) }).call("cuMemFree")
}

/// `cuMemGetInfo`: (free, total) bytes of the device of `ctx`, according to the driver.
pub(crate) fn mem_get_info(ctx: &CudaContext) -> Result<(u64, u64)> {
    let (free, total) = ctx.mem_get_info().call("cuMemGetInfo")?;
    Ok((free as u64, total as u64))
}

/// `cuMemcpyHtoDAsync`: queues a copy of `src` to device address `dst` on `stream`.
///
/// Contract: `dst..dst + src.len()` lies in a live device allocation; the memory behind
/// `src` stays allocated (and is not written) until the copy has completed on `stream`
/// (the device keeps a handle to it in the stream's pending list, or synchronises the
/// stream before `src`'s borrow ends).
pub(crate) fn memcpy_htod_async(dst: u64, src: &[u8], stream: &CudaStream) -> Result<()> {
    stream.context().bind_to_thread().call("cuCtxSetCurrent")?;
    // SAFETY: `src` is a valid host range for `src.len()` bytes now, and by this function's
    // contract it stays valid until the copy completes and `dst` is a live device range of
    // that length; the stream belongs to the bound context.
    crate::host_waits::timed("cuMemcpyHtoDAsync", || unsafe {
        sys::cuMemcpyHtoDAsync_v2(
            dst,
            src.as_ptr().cast::<c_void>(),
            src.len(),
            stream.cu_stream(),
        )
    })
    .result()
    .call("cuMemcpyHtoDAsync")
}

/// `cuMemcpyDtoHAsync`: queues a copy from device address `src` into `dst` on `stream`.
///
/// Contract: `src..src + dst.len()` lies in a live device allocation; the memory behind
/// `dst` stays allocated (and is neither read nor written by the host) until the copy has
/// completed on `stream`.
pub(crate) fn memcpy_dtoh_async(dst: &mut [u8], src: u64, stream: &CudaStream) -> Result<()> {
    stream.context().bind_to_thread().call("cuCtxSetCurrent")?;
    // SAFETY: `dst` is a valid, exclusively borrowed host range for `dst.len()` bytes now;
    // by this function's contract it stays allocated and untouched until the copy completes,
    // and `src` is a live device range of that length.
    crate::host_waits::timed("cuMemcpyDtoHAsync", || unsafe {
        sys::cuMemcpyDtoHAsync_v2(
            dst.as_mut_ptr().cast::<c_void>(),
            src,
            dst.len(),
            stream.cu_stream(),
        )
    })
    .result()
    .call("cuMemcpyDtoHAsync")
}

/// `cuMemcpyDtoDAsync`: queues a copy of `len` bytes from `src` to `dst` on `stream`.
///
/// Contract: both ranges lie in live device allocations that stay allocated until the copy
/// has completed.
pub(crate) fn memcpy_dtod_async(dst: u64, src: u64, len: usize, stream: &CudaStream) -> Result<()> {
    stream.context().bind_to_thread().call("cuCtxSetCurrent")?;
    // SAFETY: by this function's contract both device ranges are live for `len` bytes
    // until the copy completes; the stream belongs to the bound context.
    crate::host_waits::timed("cuMemcpyDtoDAsync", || unsafe {
        result::memcpy_dtod_async(dst, src, len, stream.cu_stream())
    })
    .call("cuMemcpyDtoDAsync")
}

/// `cuMemHostRegister` with `CU_MEMHOSTREGISTER_PORTABLE`: page-locks `bytes` for every
/// context, so copies from and to them run asynchronously at full link speed.
///
/// Contract: `bytes` is owned, heap memory that stays allocated until [`host_unregister`]
/// has been called on its first byte.
pub(crate) fn host_register(ctx: &CudaContext, bytes: &[u8]) -> Result<()> {
    ctx.bind_to_thread().call("cuCtxSetCurrent")?;
    // SAFETY: `bytes` is a valid host range; registration page-locks it without reading or
    // writing it, and by this function's contract it outlives the registration.
    crate::host_waits::timed("cuMemHostRegister", || unsafe {
        sys::cuMemHostRegister_v2(
            bytes.as_ptr().cast_mut().cast::<c_void>(),
            bytes.len(),
            sys::CU_MEMHOSTREGISTER_PORTABLE,
        )
    })
    .result()
    .call("cuMemHostRegister")
}

/// `cuMemHostRegister` with `CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_READ_ONLY`:
/// page-locks `bytes`, part of a read-only memory mapping of a checkpoint file, in place
/// (the driver faults the pages in; the device only reads them). The raw error is kept so
/// the caller can tell "not supported" from other failures.
///
/// Contract: `bytes` lies in a live read-only file mapping that stays mapped until
/// [`host_unregister`] has been called on its first byte, and starts on a page boundary
/// of that mapping; no live registration overlaps its pages.
pub(crate) fn host_register_read_only(
    ctx: &CudaContext,
    bytes: &[u8],
) -> std::result::Result<(), DriverError> {
    ctx.bind_to_thread()?;
    // SAFETY: `bytes` is a valid, mapped host range; with the read-only flag the driver
    // page-locks it and maps it for device reads without writing it, and by this
    // function's contract the mapping outlives the registration.
    crate::host_waits::timed("cuMemHostRegister (read-only)", || unsafe {
        sys::cuMemHostRegister_v2(
            bytes.as_ptr().cast_mut().cast::<c_void>(),
            bytes.len(),
            sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_READ_ONLY,
        )
    })
    .result()
}

/// `cuMemHostUnregister` of the range registered at `addr`.
///
/// Contract: `addr` is the first byte of a range registered by [`host_register`] or
/// [`host_register_read_only`] and not yet unregistered, and no queued copy uses it any
/// more.
pub(crate) fn host_unregister(ctx: &CudaContext, addr: usize) -> Result<()> {
    ctx.bind_to_thread().call("cuCtxSetCurrent")?;
    // SAFETY: by this function's contract `addr` starts a registered range nothing uses;
    // unregistering only unpins the pages, the memory itself stays with its owner.
    crate::host_waits::timed("cuMemHostUnregister", || unsafe {
        sys::cuMemHostUnregister(addr as *mut c_void)
    })
    .result()
    .call("cuMemHostUnregister")
}

/// `cuStreamQuery`: whether every operation queued on `stream` has completed (`false` for
/// `CUDA_ERROR_NOT_READY`). Never blocks.
pub(crate) fn stream_idle(stream: &CudaStream) -> Result<bool> {
    stream.context().bind_to_thread().call("cuCtxSetCurrent")?;
    // SAFETY: `stream.cu_stream()` is a live stream of the bound context (cudarc keeps it
    // alive as long as `stream` is borrowed); cuStreamQuery only reads its state.
    let status = unsafe { sys::cuStreamQuery(stream.cu_stream()) };
    match status {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        other => Err(CudaError::driver("cuStreamQuery", DriverError(other))),
    }
}
