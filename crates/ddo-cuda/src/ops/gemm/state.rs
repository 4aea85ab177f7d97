//! The cuBLAS state of the CUDA backend's GEMMs.
//!
//! One cuBLAS handle per device, created on the first GEMM, bound to the device's compute
//! stream, kept in a process-wide table keyed (weakly) by that stream like the kernel
//! cache of [`kernels`](super::super::kernels): an entry whose device is gone is destroyed at the
//! next GEMM of any device. Each handle gets a 32 MiB workspace allocated from the device's
//! caching allocator on the compute stream (so it shows in the device's accounting);
//! [`CudaDevice::release_blas_workspaces`] gives it back (phase cleanup may call it; the
//! next GEMM allocates a new one). Calls on a handle are serialised by the table's lock
//! (queuing a GEMM takes microseconds; the work itself runs on the stream). The same entry
//! holds the device's cuBLASLt handle and plans (`cublaslt.rs`), which use the same
//! workspace.

use std::sync::{Arc, OnceLock, Weak};

use cudarc::cublas::result::CublasError;
use cudarc::cublas::sys as cublas;
use cudarc::driver::{CudaContext, CudaStream};
use ddo_core::{CoreError, Device, DeviceBuffer, Result};
use parking_lot::Mutex;

use super::super::cublaslt::LtState;
use super::super::kernels;
use crate::device::CudaDevice;

/// Bytes of each handle's cuBLAS workspace (NVIDIA's recommendation for Hopper).
pub(super) const WORKSPACE_BYTES: usize = 32 << 20;

/// A raw cuBLAS handle.
struct Handle(cublas::cublasHandle_t);

// SAFETY: a cuBLAS handle may be used from any thread as long as calls on it do not run
// concurrently; every use goes through the `BLAS` table's mutex.
unsafe impl Send for Handle {}

/// The cuBLAS state of one device.
pub(super) struct BlasEntry {
    /// The device's compute stream (its identity; dead once the device is dropped).
    compute: Weak<CudaStream>,
    /// The context the handle lives in (kept until the handle is destroyed).
    ctx: Arc<CudaContext>,
    handle: Handle,
    /// The workspace set on the handle, if any (the cuBLASLt calls use it too).
    pub(super) workspace: Option<DeviceBuffer>,
    /// The device's cuBLASLt state: `None` until the first 16-bit linear asks for it, then
    /// the handle with its plans, or why it could not be created (not tried again).
    pub(super) lt: Option<std::result::Result<LtState, String>>,
}

impl BlasEntry {
    /// Destroys the handles (errors have nowhere to go: the device is gone).
    fn destroy(self) {
        if self.ctx.bind_to_thread().is_ok() {
            if let Some(Ok(lt)) = self.lt {
                lt.destroy();
            }
            // SAFETY: the handle was created by `cublasCreate` in `ctx`, is destroyed once
            // (the entry is consumed), and nothing else refers to it any more.
            let _ = unsafe { cudarc::cublas::result::destroy_handle(self.handle.0) };
        }
        drop(self.workspace);
    }
}

static BLAS: Mutex<Vec<BlasEntry>> = Mutex::new(Vec::new());

/// Destroys the cuBLAS state of devices that are gone (their compute stream dropped): the
/// handles, and the workspaces, which hold the device's shared state (and so its place in
/// its ordinal's ledger) until then. Runs before every GEMM, device creation and native
/// install.
pub(crate) fn destroy_dead_handles() {
    destroy_dead(&mut BLAS.lock());
}

/// [`destroy_dead_handles`] unless the table is locked (an allocation inside a GEMM's set-up
/// holds it): for paths that may run under the lock.
pub(crate) fn try_destroy_dead_handles() {
    if let Some(mut table) = BLAS.try_lock() {
        destroy_dead(&mut table);
    }
}

fn destroy_dead(table: &mut parking_lot::MutexGuard<'_, Vec<BlasEntry>>) {
    let (live, dead): (Vec<BlasEntry>, Vec<BlasEntry>) = std::mem::take(&mut **table)
        .into_iter()
        .partition(|e| e.compute.strong_count() > 0);
    **table = live;
    parking_lot::MutexGuard::unlocked(table, || {
        for e in dead {
            e.destroy();
        }
    });
}

pub(super) fn backend(dev: &CudaDevice, message: String) -> CoreError {
    CoreError::Backend {
        device: dev.id().to_string(),
        message,
    }
}

pub(super) fn blas_err(dev: &CudaDevice, call: &str, e: CublasError) -> CoreError {
    backend(dev, format!("cuBLAS call {call} failed with {:?}", e.0))
}

fn cublas_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: `is_culib_present` only tries `dlopen` on libcublas's candidate names and drops
    // what it opened; it calls nothing in the library.
    *PRESENT.get_or_init(|| unsafe { cublas::is_culib_present() })
}

/// Runs `f` with `dev`'s cuBLAS handle (created if needed, with a workspace set), the
/// device's context bound to this thread and the table locked.
pub(super) fn with_blas<R>(
    dev: &CudaDevice,
    f: impl FnOnce(cublas::cublasHandle_t) -> Result<R>,
) -> Result<R> {
    with_entry(dev, |entry| f(entry.handle.0))
}

/// Runs `f` with `dev`'s entry of the table (its cuBLAS handle created if needed, with a
/// workspace set), the device's context bound to this thread and the table locked.
pub(super) fn with_entry<R>(
    dev: &CudaDevice,
    f: impl FnOnce(&mut BlasEntry) -> Result<R>,
) -> Result<R> {
    if !cublas_present() {
        return Err(backend(
            dev,
            "the CUDA library `libcublas` could not be loaded: cudarc loads libcublas.so (also \
             libcublas.so.13 and other versioned names) through the dynamic loader, which searches \
             LD_LIBRARY_PATH, the ld.so cache and the system library directories; install the CUDA \
             toolkit's cuBLAS and add its directory to LD_LIBRARY_PATH (e.g. \
             /usr/local/cuda/targets/x86_64-linux/lib), or run on the host backend"
                .into(),
        ));
    }
    let stream = kernels::compute_stream(dev)?;
    let ctx = dev.context();
    let driver = |call: &'static str, e| {
        crate::error::CudaError::driver(call, e).into_core(&dev.id().to_string())
    };
    destroy_dead_handles();
    let mut table = BLAS.lock();
    let at = match table
        .iter()
        .position(|e| kernels::same_stream(&e.compute, &stream))
    {
        Some(i) => i,
        None => {
            ctx.bind_to_thread()
                .map_err(|e| driver("cuCtxSetCurrent", e))?;
            let handle = cudarc::cublas::result::create_handle()
                .map_err(|e| blas_err(dev, "cublasCreate", e))?;
            let entry = BlasEntry {
                compute: Arc::downgrade(&stream),
                ctx: Arc::clone(ctx),
                handle: Handle(handle),
                workspace: None,
                lt: None,
            };
            // SAFETY: `handle` was just created in the bound context; the stream belongs to
            // that context and outlives every use of the handle on it (the entry is
            // destroyed only once the stream is gone, and then never used again).
            let set = unsafe {
                cudarc::cublas::result::set_stream(
                    handle,
                    stream.cu_stream() as cublas::cudaStream_t,
                )
            };
            if let Err(e) = set {
                entry.destroy();
                return Err(blas_err(dev, "cublasSetStream", e));
            }
            table.push(entry);
            table.len() - 1
        }
    };
    let entry = &mut table[at];
    ctx.bind_to_thread()
        .map_err(|e| driver("cuCtxSetCurrent", e))?;
    if entry.workspace.is_none() {
        // Without room for a workspace cuBLAS still runs (with algorithms that need none).
        if let Ok(buffer) = dev.alloc_on(WORKSPACE_BYTES, &dev.compute_stream()) {
            let ptr = dev.allocation(&buffer)?.device_ptr();
            // SAFETY: `ptr` addresses `WORKSPACE_BYTES` of device memory of this context,
            // aligned to the allocator's block alignment (>= 256 B); the entry keeps the
            // buffer alive while it is set, and releasing it orders its free after the
            // work queued on the compute stream (`release_after`).
            unsafe {
                cublas::cublasSetWorkspace_v2(
                    entry.handle.0,
                    ptr as *mut std::ffi::c_void,
                    WORKSPACE_BYTES,
                )
            }
            .result()
            .map_err(|e| blas_err(dev, "cublasSetWorkspace", e))?;
            entry.workspace = Some(buffer);
        }
    }
    f(entry)
}

/// `f` of `dev`'s entry in the handle table, under its lock; `None` where the device has
/// run no GEMM yet (nothing is created).
fn existing_entry<R>(
    dev: &CudaDevice,
    f: impl FnOnce(&mut BlasEntry) -> Result<R>,
) -> Result<Option<R>> {
    let stream = kernels::compute_stream(dev)?;
    let mut table = BLAS.lock();
    table
        .iter_mut()
        .find(|e| kernels::same_stream(&e.compute, &stream))
        .map(f)
        .transpose()
}

/// Drops `dev`'s cuBLASLt plans (`Device::forget_shape_plans`); the count dropped.
pub(crate) fn forget_lt_plans(dev: &CudaDevice) -> Result<usize> {
    Ok(existing_entry(dev, |entry| {
        let _ = entry.ctx.bind_to_thread();
        Ok(match entry.lt.as_mut() {
            Some(Ok(lt)) => lt.forget_plans(),
            _ => 0,
        })
    })?
    .unwrap_or(0))
}

/// `dev`'s cuBLASLt plans held now.
pub(crate) fn lt_plans(dev: &CudaDevice) -> Result<usize> {
    Ok(existing_entry(dev, |entry| {
        Ok(entry
            .lt
            .as_ref()
            .map_or(0, |lt| lt.as_ref().map_or(0, LtState::plans)))
    })?
    .unwrap_or(0))
}

impl CudaDevice {
    /// Gives back this device's cuBLAS workspace (32 MiB, allocated on the first GEMM):
    /// returns the bytes released (0 when there was none). The free is ordered after the
    /// GEMMs already queued; the next GEMM allocates a new workspace. For phase cleanup.
    pub fn release_blas_workspaces(&self) -> Result<u64> {
        Ok(existing_entry(self, |entry| self.release_workspace(entry))?.unwrap_or(0))
    }

    /// [`CudaDevice::release_blas_workspaces`] of this device's `entry`.
    fn release_workspace(&self, entry: &mut BlasEntry) -> Result<u64> {
        let Some(buffer) = entry.workspace.take() else {
            return Ok(0);
        };
        self.context().bind_to_thread().map_err(|e| {
            crate::error::CudaError::driver("cuCtxSetCurrent", e).into_core(&self.id().to_string())
        })?;
        // SAFETY: unsets the workspace of a live handle of this context (size 0: cuBLAS then
        // uses algorithms that need none); the table's lock serialises it with GEMMs.
        unsafe { cublas::cublasSetWorkspace_v2(entry.handle.0, std::ptr::null_mut(), 0) }
            .result()
            .map_err(|e| blas_err(self, "cublasSetWorkspace", e))?;
        let bytes = buffer.len() as u64;
        self.release_after(buffer, &self.compute_stream())?;
        Ok(bytes)
    }
}
