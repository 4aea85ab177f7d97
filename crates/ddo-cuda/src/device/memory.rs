//! Device memory of a [`CudaDevice`]: the state its allocations share ([`Shared`]), raw
//! driver memory under the caching allocator ([`DriverMemory`]), [`CudaAllocation`] and its
//! stream-ordered free, allocation from the caching allocator or the native VMM pool (as
//! the ordinal's [`OrdinalLedger`] allows), and the native pool's install, quiescence check
//! and out-of-memory figures.

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::{CudaContext, CudaStream};
use ddo_core::device::DeviceAllocation;
use ddo_core::{CoreError, Device, DeviceBuffer, DeviceId};
use ddo_vmm::{
    CudaPhysicalMemory, PoolAllocation, PoolStats, QuiescenceGate, VmmPool, VmmPoolConfig,
};
use parking_lot::{Mutex, RwLock};

use super::CudaDevice;
use super::ledger::{OrdinalLedger, Serve};
use super::streams::{COMPUTE, CudaStreamHandle, EventPool, PooledEvent};
use crate::allocator::{Block, CachingAllocator, RawAllocError, RawMemory, StreamKey};
use crate::driver;
use crate::error::{CudaError, DriverResultExt, Result};
use crate::vmm_allocator::NativeAllocator;

/// Raw device memory from the driver: `cuMemAlloc` / `cuMemFree` in one context.
pub(super) struct DriverMemory {
    pub(super) ctx: Arc<CudaContext>,
}

impl RawMemory for DriverMemory {
    fn alloc(&self, bytes: u64) -> std::result::Result<u64, RawAllocError> {
        let bytes = usize::try_from(bytes).map_err(|_| RawAllocError::OutOfMemory)?;
        driver::mem_alloc(&self.ctx, bytes).map_err(|e| {
            if crate::error::is_oom(&e) {
                RawAllocError::OutOfMemory
            } else {
                RawAllocError::Failed(CudaError::driver("cuMemAlloc", e))
            }
        })
    }

    fn free(&self, ptr: u64) -> Result<()> {
        driver::mem_free(&self.ctx, ptr)
    }

    fn free_bytes(&self) -> Option<u64> {
        driver::mem_get_info(&self.ctx).ok().map(|(free, _)| free)
    }
}

/// State shared by the device and everything it hands out (allocations, streams, pinned
/// registrations), so each can be dropped in any order.
pub(super) struct Shared {
    pub(super) id: DeviceId,
    pub(super) instance: u64,
    pub(super) ctx: Arc<CudaContext>,
    pub(super) allocator: CachingAllocator<DriverMemory, PooledEvent>,
    /// The native VMM allocator, once this device installed it (set under the ledger's
    /// write lock, which every allocation read-locks, so an install cannot slip in between
    /// the check and an allocation).
    pub(super) native: RwLock<Option<Arc<NativeAllocator<CudaPhysicalMemory, PooledEvent>>>>,
    /// The process-wide ledger of this device's ordinal, shared by every device of it.
    pub(super) ledger: Arc<OrdinalLedger>,
    /// Allocations this device's caching allocator has served (the ledger counts them
    /// until this state drops).
    pub(super) caching_allocations: AtomicU64,
    pub(super) events: Arc<EventPool>,
    pub(super) total: u64,
    pub(super) deferred: Mutex<Vec<String>>,
}

impl Shared {
    /// Records an error from a place that cannot return one (a `Drop`); the next
    /// synchronisation reports it.
    pub(super) fn defer(&self, what: &str, err: &CudaError) {
        self.deferred.lock().push(format!("{what}: {err}"));
    }

    pub(super) fn take_deferred(&self) -> ddo_core::Result<()> {
        let errors = std::mem::take(&mut *self.deferred.lock());
        if errors.is_empty() {
            Ok(())
        } else {
            Err(CoreError::Backend {
                device: self.id.to_string(),
                message: format!("earlier failure(s) during release: {}", errors.join("; ")),
            })
        }
    }

    pub(super) fn core(&self, e: CudaError) -> CoreError {
        match e {
            CudaError::OutOfMemory {
                device,
                requested,
                allocated,
                reserved,
                free,
                total: 0,
            } => CudaError::OutOfMemory {
                device,
                requested,
                allocated,
                reserved,
                free,
                total: self.total,
            }
            .into_core(&self.id.to_string()),
            other => other.into_core(&self.id.to_string()),
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Nothing is allocated any more (every allocation holds this); return the cache.
        // Errors have nowhere to go at teardown: the context is released next.
        let _ = self.ctx.synchronize();
        let _ = self.allocator.wait_and_empty_cache();
        // The native pool (if any) tears down with its last handle, this one: before the
        // ordinal is free for another install.
        drop(self.native.get_mut().take());
        // Nothing of this device is left on the ordinal: it leaves the ledger.
        self.ledger.device_gone(
            self.instance,
            self.caching_allocations.load(Ordering::Acquire),
        );
    }
}

/// What backs a [`CudaAllocation`].
enum Backing {
    /// A block of the caching allocator.
    Caching(Block),
    /// A range of the native VMM pool.
    Native(
        Arc<NativeAllocator<CudaPhysicalMemory, PooledEvent>>,
        PoolAllocation,
    ),
}

/// One allocation of a [`CudaDevice`]: a block of the caching allocator.
///
/// When the last handle drops, the block goes back to the allocator with the events of
/// every [`Device::release_after`] and of every stream named by
/// [`CudaAllocation::note_use`]; with none, it is idle at once (queued copies hold a handle
/// until they complete, as the `Device` contract asks of queued work).
pub struct CudaAllocation {
    block: Option<Backing>,
    pub(super) ptr: u64,
    len: usize,
    pub(super) shared: Arc<Shared>,
    pub(super) uses: Mutex<Vec<(StreamKey, PooledEvent)>>,
    unheld: Mutex<Vec<(StreamKey, Arc<CudaStream>)>>,
    /// Compute-stream events another stream must wait for before touching these bytes
    /// (native allocator: the bytes' previous users; see [`crate::vmm_allocator`]).
    fences: Vec<Arc<PooledEvent>>,
    /// Streams already ordered behind `fences`.
    fenced_streams: Mutex<Vec<StreamKey>>,
}

impl CudaAllocation {
    /// Device address of the first byte (for kernels and library calls; valid while this
    /// allocation lives).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Records that work which holds no handle to this allocation (a kernel launched with
    /// [`CudaAllocation::device_ptr`]) was queued on `stream`: the free at the last drop is
    /// then ordered after the work queued on `stream` by that time.
    pub fn note_use(&self, stream: &CudaStreamHandle) {
        let mut unheld = self.unheld.lock();
        if !unheld.iter().any(|(k, _)| *k == stream.key) {
            unheld.push((stream.key, Arc::clone(&stream.stream)));
        }
    }
}

impl Drop for CudaAllocation {
    fn drop(&mut self) {
        let Some(block) = self.block.take() else {
            return;
        };
        let mut marks = std::mem::take(&mut *self.uses.lock());
        for (key, stream) in std::mem::take(&mut *self.unheld.lock()) {
            match self.shared.events.record(&stream) {
                Ok(e) => marks.push((key, e)),
                Err(err) => {
                    self.shared.defer("recording a free on a stream", &err);
                    if let Err(err) = stream.synchronize().call("cuStreamSynchronize") {
                        // Idleness cannot be proven: keep the block out of circulation.
                        self.shared.defer("synchronising to free a block", &err);
                        return;
                    }
                }
            }
        }
        match block {
            Backing::Caching(block) => self.shared.allocator.free(block, marks),
            Backing::Native(native, range) => native.free(range, self.len as u64, marks),
        }
    }
}

impl fmt::Debug for CudaAllocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CudaAllocation({} B at {:#x} on {})",
            self.len, self.ptr, self.shared.id
        )
    }
}

impl DeviceAllocation for CudaAllocation {
    fn len(&self) -> usize {
        self.len
    }
    fn device(&self) -> DeviceId {
        self.shared.id
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl CudaDevice {
    /// Installs DDO's native VMM allocator ([`ddo_vmm::VmmPool`] over the device's whole
    /// memory as virtual address space) as this device's allocator: every later
    /// [`Device::alloc`] and compute output comes from the pool, and
    /// [`Device::release_native_idle_cache`] returns its idle chunks. A bootstrap step,
    /// once per device ordinal in this process whatever the number of `CudaDevice` values
    /// (the ordinal's ledger, `device/ledger.rs`): refused with
    /// [`CudaError::NativeInstallTooLate`] once the caching allocator of any live device of
    /// the ordinal has served an allocation (the counterpart of the fresh-process rule),
    /// with [`CudaError::NativeAlreadyInstalled`] the second time, and with
    /// [`CudaError::NativeInstalledOnAnotherDevice`] when another device of the ordinal
    /// installed it (which then serves the ordinal alone: no other device of it opens or
    /// allocates). The device must support virtual memory management
    /// ([`ddo_vmm::VmmError::Unsupported`] otherwise).
    pub fn install_native_vmm(&self) -> Result<()> {
        // A dropped device's cuBLAS workspace keeps its state (and its caching allocations
        // in the ledger) alive until its handle is destroyed: destroy those first.
        crate::ops::gemm::destroy_dead_handles();
        self.shared.ledger.install(self.shared.instance, || {
            let phys = CudaPhysicalMemory::from_context(Arc::clone(&self.shared.ctx))?;
            let pool = VmmPool::new(phys, VmmPoolConfig::new(self.id().to_string()))?;
            *self.shared.native.write() = Some(Arc::new(NativeAllocator::new(pool)));
            Ok(())
        })
    }

    /// The native pool's exact figures, when it is installed.
    pub fn native_pool_stats(&self) -> Option<PoolStats> {
        self.shared.native.read().as_ref().map(|n| n.pool().stats())
    }

    /// Whether every stream of this device has finished its queued work (`cuStreamQuery`
    /// on each); the busy ones are described otherwise.
    pub(super) fn quiescence(&self) -> ddo_core::Result<QuiescenceGate> {
        let mut busy = Vec::new();
        for s in self.live_streams() {
            if !driver::stream_idle(&s.stream).map_err(|e| self.core(e))? {
                busy.push(format!("stream #{} has queued work", s.key.0));
            }
        }
        Ok(if busy.is_empty() {
            QuiescenceGate::quiescent("every stream idle (cuStreamQuery)")
        } else {
            QuiescenceGate::busy(busy.join(", "))
        })
    }

    /// The out-of-memory error of the native pool, with the device's figures.
    fn native_oom(
        &self,
        bytes: usize,
        native: &NativeAllocator<CudaPhysicalMemory, PooledEvent>,
        e: ddo_vmm::VmmError,
    ) -> CoreError {
        if !e.is_out_of_memory() {
            return self.core(CudaError::Vmm(e));
        }
        let f = native.figures();
        self.core(CudaError::OutOfMemory {
            device: self.id().to_string(),
            requested: bytes as u64,
            allocated: f.live_bytes,
            reserved: f.mapped_bytes,
            free: driver::mem_get_info(&self.shared.ctx)
                .map(|(free, _)| free)
                .unwrap_or(0),
            total: self.shared.total,
        })
    }

    pub(super) fn allocate(
        &self,
        bytes: usize,
        stream: Option<StreamKey>,
    ) -> ddo_core::Result<DeviceBuffer> {
        self.poll()?;
        // Held across the allocation: no install on the ordinal slips in meanwhile. Refused
        // beside another device's native allocator, unless that device is gone and only its
        // cuBLAS workspace kept it in the ledger (destroyed, then asked again).
        let (ledger, serve) = match self.shared.ledger.serve(self.shared.instance) {
            Ok(granted) => granted,
            Err(_) => {
                crate::ops::gemm::try_destroy_dead_handles();
                self.shared
                    .ledger
                    .serve(self.shared.instance)
                    .map_err(|e| self.core(e))?
            }
        };
        let native = self.shared.native.read();
        let mut fences = Vec::new();
        let (ptr, backing) = match (serve, native.as_ref()) {
            (Serve::Native, Some(native)) => {
                let native = Arc::clone(native);
                let ctx = Arc::clone(&self.shared.ctx);
                let grant = native
                    .allocate(bytes as u64, stream, move || {
                        ctx.synchronize()
                            .map_err(|e| format!("cuCtxSynchronize failed: {e:?}"))
                    })
                    .map_err(|e| self.native_oom(bytes, &native, e))?;
                fences = grant.fences;
                (grant.range.va(), Backing::Native(native, grant.range))
            }
            _ => {
                self.shared
                    .caching_allocations
                    .fetch_add(1, Ordering::AcqRel);
                let block = self
                    .shared
                    .allocator
                    .allocate(bytes as u64, stream)
                    .map_err(|e| self.core(e))?;
                (block.ptr(), Backing::Caching(block))
            }
        };
        drop(native);
        drop(ledger);
        Ok(DeviceBuffer::new(Arc::new(CudaAllocation {
            ptr,
            block: Some(backing),
            len: bytes,
            shared: Arc::clone(&self.shared),
            uses: Mutex::new(Vec::new()),
            unheld: Mutex::new(Vec::new()),
            fences,
            fenced_streams: Mutex::new(Vec::new()),
        })))
    }

    /// Orders work about to be queued on `s` that touches `alloc` behind the compute-stream
    /// work that last used its bytes before they were freed and handed out again (the
    /// native allocator's fences): one `cuStreamWaitEvent` per fence, once per stream. The
    /// compute stream is ordered by itself.
    pub(super) fn order_use(
        &self,
        alloc: &CudaAllocation,
        s: &CudaStreamHandle,
    ) -> ddo_core::Result<()> {
        if alloc.fences.is_empty() || s.key == COMPUTE {
            return Ok(());
        }
        let mut done = alloc.fenced_streams.lock();
        if done.contains(&s.key) {
            return Ok(());
        }
        for fence in &alloc.fences {
            s.stream
                .wait(fence.event())
                .call("cuStreamWaitEvent")
                .map_err(|e| self.core(e))?;
        }
        done.push(s.key);
        Ok(())
    }
}
