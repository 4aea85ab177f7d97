//! The one module of ddo-vmm that holds `unsafe`: one thin checked function per CUDA driver
//! call of virtual memory management (cudarc wraps none of them), plus the library probe.
//!
//! These functions validate nothing beyond what their signatures guarantee; they are
//! crate-private and each states the contract its callers keep. [`VmmPool`](crate::VmmPool)
//! keeps those contracts through [`CudaPhysicalMemory`](crate::CudaPhysicalMemory): it maps
//! only unmapped granularity-aligned pages of its own reservation, unmaps whole mappings,
//! releases only unmapped chunks, frees its range only when nothing in it is mapped.
//! Every function binds its context to the calling thread first.

use std::mem::MaybeUninit;
use std::sync::Arc;

use cudarc::driver::{CudaContext, DriverError, result, sys};

use crate::error::{DriverResultExt, Result, VmmError};

/// Whether the driver library (`libcuda.so`) can be loaded. Must be `true` before any other
/// function of this module runs: cudarc panics on a missing library.
pub(crate) fn library_present() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on libcuda's candidate names and drops
    // what it opened; it makes no driver call and touches no state of ours.
    unsafe { sys::is_culib_present() }
}

/// `cuInit`, then `cuDeviceGetCount`. `CUDA_ERROR_NO_DEVICE` from either is a count of 0.
pub(crate) fn device_count() -> Result<usize> {
    let no_device = |e: &DriverError| e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE;
    match result::init() {
        Ok(()) => {}
        Err(e) if no_device(&e) => return Ok(0),
        Err(e) => return Err(VmmError::driver("cuInit", e)),
    }
    match result::device::get_count() {
        Ok(n) => Ok(usize::try_from(n).unwrap_or(0)),
        Err(e) if no_device(&e) => Ok(0),
        Err(e) => Err(VmmError::driver("cuDeviceGetCount", e)),
    }
}

/// The primary context of device `ordinal` (retained; released when the last `Arc` drops).
pub(crate) fn primary_context(ordinal: usize) -> Result<Arc<CudaContext>> {
    CudaContext::new(ordinal).call("cuDevicePrimaryCtxRetain")
}

/// `cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)`.
pub(crate) fn vmm_supported(ctx: &CudaContext) -> Result<bool> {
    let v = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)
        .call("cuDeviceGetAttribute")?;
    Ok(v != 0)
}

/// The allocation properties of every chunk: pinned device memory on the context's device,
/// no exportable handle, no compression.
fn chunk_properties(ctx: &CudaContext) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes: sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE,
        location: device_location(ctx),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

fn device_location(ctx: &CudaContext) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ctx.cu_device(),
    }
}

/// `cuMemGetAllocationGranularity` (minimum) for chunks of [`chunk_properties`].
pub(crate) fn granularity(ctx: &CudaContext) -> Result<u64> {
    ctx.bind_to_thread().call("cuCtxSetCurrent")?;
    let prop = chunk_properties(ctx);
    let mut out = MaybeUninit::<usize>::uninit();
    // SAFETY: `out` is a valid place for one `usize` and `prop` a fully initialised property
    // struct that lives across the call; the driver reads `prop` and writes `out` only.
    unsafe {
        sys::cuMemGetAllocationGranularity(
            out.as_mut_ptr(),
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    }
    .result()
    .call("cuMemGetAllocationGranularity")?;
    // SAFETY: the call succeeded, so the driver wrote the granularity into `out`.
    Ok(unsafe { out.assume_init() } as u64)
}

/// `cuMemAddressReserve`: `bytes` of virtual address space aligned to `alignment`, anywhere.
pub(crate) fn address_reserve(ctx: &CudaContext, bytes: u64, alignment: u64) -> Result<u64> {
    ctx.bind_to_thread().call("cuCtxSetCurrent")?;
    let mut out = MaybeUninit::<sys::CUdeviceptr>::uninit();
    // SAFETY: `out` is a valid place for one device pointer; with a zero address hint and no
    // flags the driver only picks a free range and writes its start into `out`.
    unsafe { sys::cuMemAddressReserve(out.as_mut_ptr(), bytes as usize, alignment as usize, 0, 0) }
        .result()
        .call("cuMemAddressReserve")?;
    // SAFETY: the call succeeded, so the driver wrote the range's start into `out`.
    Ok(unsafe { out.assume_init() })
}

/// `cuMemAddressFree`.
///
/// Contract: `va..va + bytes` is exactly a range from [`address_reserve`], freed once, with
/// nothing mapped in it.
pub(crate) fn address_free(ctx: &CudaContext, va: u64, bytes: u64) -> Result<()> {
    ctx.bind_to_thread().call("cuCtxSetCurrent")?;
    // SAFETY: by this function's contract the range is one reservation of ours with no
    // mapping left; freeing it invalidates no pointer anyone still uses.
    unsafe { sys::cuMemAddressFree(va, bytes as usize) }
        .result()
        .call("cuMemAddressFree")
}

/// `cuMemCreate`: a physical chunk of `bytes` (a multiple of the granularity) on the
/// context's device; its raw handle. Out-of-memory comes back as the driver's code.
pub(crate) fn mem_create(ctx: &CudaContext, bytes: u64) -> Result<u64> {
    ctx.bind_to_thread().call("cuCtxSetCurrent")?;
    let prop = chunk_properties(ctx);
    let mut out = MaybeUninit::<sys::CUmemGenericAllocationHandle>::uninit();
    // SAFETY: `out` is a valid place for one handle and `prop` a fully initialised property
    // struct that lives across the call; the driver reads `prop` and writes `out` only.
    unsafe { sys::cuMemCreate(out.as_mut_ptr(), bytes as usize, &prop, 0) }
        .result()
        .call("cuMemCreate")?;
    // SAFETY: the call succeeded, so the driver wrote the new handle into `out`.
    Ok(unsafe { out.assume_init() })
}

/// `cuMemRelease`.
///
/// Contract: `handle` came from [`mem_create`], is released once, and is no longer mapped
/// (its memory goes back to the driver now).
pub(crate) fn mem_release(ctx: &CudaContext, handle: u64) -> Result<()> {
    ctx.bind_to_thread().call("cuCtxSetCurrent")?;
    // SAFETY: by this function's contract the handle is ours, live, unmapped and released
    // exactly once; no address refers to its memory any more.
    unsafe { sys::cuMemRelease(handle) }
        .result()
        .call("cuMemRelease")
}

/// `cuMemMap`: maps all `bytes` of chunk `handle` (offset 0) at `va`.
///
/// Contract: `va..va + bytes` lies in a reservation of ours, is granularity-aligned and
/// unmapped; `bytes` is the chunk's size.
pub(crate) fn mem_map(ctx: &CudaContext, va: u64, bytes: u64, handle: u64) -> Result<()> {
    ctx.bind_to_thread().call("cuCtxSetCurrent")?;
    // SAFETY: by this function's contract the target range is reserved by us and unmapped,
    // so mapping there replaces nothing anyone uses; the handle is a live chunk of `bytes`.
    unsafe { sys::cuMemMap(va, bytes as usize, 0, handle, 0) }
        .result()
        .call("cuMemMap")
}

/// `cuMemUnmap`.
///
/// Contract: `va..va + bytes` is one whole mapping made by [`mem_map`], and no queued or
/// running device work touches it any more.
pub(crate) fn mem_unmap(ctx: &CudaContext, va: u64, bytes: u64) -> Result<()> {
    ctx.bind_to_thread().call("cuCtxSetCurrent")?;
    // SAFETY: by this function's contract the range is a whole mapping of ours that no
    // device work uses any more; after this, the addresses fault until mapped again.
    unsafe { sys::cuMemUnmap(va, bytes as usize) }
        .result()
        .call("cuMemUnmap")
}

/// `cuMemSetAccess`: read-write access for the context's device to `va..va + bytes`.
///
/// Contract: the range is covered by whole mappings made by [`mem_map`].
pub(crate) fn mem_set_access(ctx: &CudaContext, va: u64, bytes: u64) -> Result<()> {
    ctx.bind_to_thread().call("cuCtxSetCurrent")?;
    let desc = sys::CUmemAccessDesc {
        location: device_location(ctx),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: `desc` is one fully initialised access descriptor that lives across the call
    // (count 1); by this function's contract the range is mapped by us.
    unsafe { sys::cuMemSetAccess(va, bytes as usize, &desc, 1) }
        .result()
        .call("cuMemSetAccess")
}

/// `cuMemGetInfo`: (free, total) bytes of the device of `ctx`, according to the driver.
pub(crate) fn mem_get_info(ctx: &CudaContext) -> Result<(u64, u64)> {
    let (free, total) = ctx.mem_get_info().call("cuMemGetInfo")?;
    Ok((free as u64, total as u64))
}
