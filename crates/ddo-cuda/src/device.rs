//! [`CudaDevice`]: ddo-core's [`Device`] on one NVIDIA GPU — allocations from the caching
//! allocator, pinned host memory, streams, events, asynchronous copies, exact accounting.
//!
//! Semantics follow the host backend ([`ddo_core::HostDevice`]):
//! - copies run in order on the stream they are queued on; from and to pinned host memory
//!   they are asynchronous, from and to pageable or checkpoint-mapped memory they return
//!   only once done, except a host→device copy from pageable memory of at most half
//!   [`CudaDeviceConfig::upload_staging_bytes`]: its bytes are copied into one of the
//!   device's pinned upload buffers and it returns at once, queued like a pinned copy (no
//!   wait for the stream, no wait behind copies already queued on the link);
//! - the memory a queued copy reads or writes lives until the copy has completed: each
//!   stream keeps handles to both sides in a pending list, tagged with an event recorded
//!   after the copy, and drops them once that event has completed (checked on every call
//!   and at every synchronisation); a staged upload keeps its pinned buffer there, and the
//!   destination's free is ordered behind the copy instead ([`CudaAllocation::note_use`]);
//! - frees are stream-ordered: [`Device::release_after`] records an event on its stream
//!   (as does the last drop for streams named by [`CudaAllocation::note_use`], where work
//!   that holds no handle was queued); the block goes back to the caching allocator with
//!   those events, which hands it out again at once for the same stream
//!   ([`CudaDevice::alloc_on`]) and to anyone else ([`Device::alloc`]) once the events
//!   have completed. A buffer dropped with no such events is idle at once.
//!
//! This module is safe code: every driver call goes through [`crate::driver`] or cudarc's
//! safe API.

use std::any::Any;
use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use ddo_core::device::{DeviceAllocation, EventHandle, StreamHandle};
use ddo_core::host_memory::{AlignedBytes, PinnedLedger, register_target};
use ddo_core::{
    AllocatorKind, CoreError, DType, Device, DeviceBuffer, DeviceId, DeviceKind, DeviceSlice,
    Event, HostBuffer, HostMemoryKind, HostSlice, MemoryInfo, Stream,
};
use ddo_metrics::{IdleCacheRelease, NativePoolFigures};
use ddo_vmm::{
    CudaPhysicalMemory, PoolAllocation, PoolStats, QuiescenceGate, VmmPool, VmmPoolConfig,
};
use parking_lot::{Mutex, RwLock};

use crate::allocator::{
    AllocatorStats, Block, CachingAllocator, FreeEvent, RawAllocError, RawMemory, SegmentSnapshot,
    StreamKey,
};
use crate::driver;
use crate::error::{CudaError, DriverResultExt, Result};
use crate::vmm_allocator::NativeAllocator;

/// The compute stream's key in the allocator.
const COMPUTE: StreamKey = StreamKey(0);

/// Most idle events kept for reuse.
const EVENT_POOL_MAX: usize = 1024;

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

/// Smallest pinned upload buffer (smaller uploads share its size class).
const UPLOAD_STAGING_MIN: usize = 64 << 10;

/// Threads that fill one upload chunk from pageable memory.
const UPLOAD_COPY_THREADS: usize = 8;

/// `dst.copy_from_slice(src)` on up to [`UPLOAD_COPY_THREADS`] threads (one below 1 MiB).
fn parallel_copy(dst: &mut [u8], src: &[u8]) {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, UPLOAD_COPY_THREADS);
    if threads == 1 || src.len() < (1 << 20) {
        dst.copy_from_slice(src);
        return;
    }
    let part = src.len().div_ceil(threads);
    std::thread::scope(|scope| {
        for (d, s) in dst.chunks_mut(part).zip(src.chunks(part)) {
            scope.spawn(move || d.copy_from_slice(s));
        }
    });
}

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

fn default_pinned_limit() -> u64 {
    ddo_core::host_memory::mem_total().map_or(16 << 30, |b| b / 2)
}

/// Raw device memory from the driver: `cuMemAlloc` / `cuMemFree` in one context.
struct DriverMemory {
    ctx: Arc<CudaContext>,
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

/// Idle CUDA events kept for reuse, so a free or a copy costs an event record, not an
/// event creation.
struct EventPool {
    ctx: Arc<CudaContext>,
    idle: Mutex<Vec<CudaEvent>>,
}

impl EventPool {
    /// An event recorded at the current end of `stream`.
    fn record(self: &Arc<Self>, stream: &CudaStream) -> Result<PooledEvent> {
        let event = match self.idle.lock().pop() {
            Some(e) => e,
            None => self.ctx.new_event(None).call("cuEventCreate")?,
        };
        event.record(stream).call("cuEventRecord")?;
        Ok(PooledEvent {
            event: Some(event),
            pool: Arc::clone(self),
        })
    }
}

/// An event from the [`EventPool`], returned to it on drop.
struct PooledEvent {
    event: Option<CudaEvent>,
    pool: Arc<EventPool>,
}

impl PooledEvent {
    fn event(&self) -> &CudaEvent {
        self.event.as_ref().expect("present until drop")
    }
}

impl Drop for PooledEvent {
    fn drop(&mut self) {
        if let Some(e) = self.event.take() {
            let mut idle = self.pool.idle.lock();
            if idle.len() < EVENT_POOL_MAX {
                idle.push(e);
            }
        }
    }
}

impl FreeEvent for PooledEvent {
    fn is_complete(&self) -> Result<bool> {
        self.event().try_is_complete().call("cuEventQuery")
    }

    fn wait(&self) -> Result<()> {
        self.event().synchronize().call("cuEventSynchronize")
    }
}

/// State shared by the device and everything it hands out (allocations, streams, pinned
/// registrations), so each can be dropped in any order.
struct Shared {
    id: DeviceId,
    instance: u64,
    ctx: Arc<CudaContext>,
    allocator: CachingAllocator<DriverMemory, PooledEvent>,
    /// The native VMM allocator, once installed; read-locked around every caching
    /// allocation so an install cannot slip in between the check and the allocation.
    native: RwLock<Option<Arc<NativeAllocator<CudaPhysicalMemory, PooledEvent>>>>,
    /// Allocations the caching allocator has served (the install refusal's count).
    caching_allocations: AtomicU64,
    events: Arc<EventPool>,
    total: u64,
    deferred: Mutex<Vec<String>>,
}

impl Shared {
    /// Records an error from a place that cannot return one (a `Drop`); the next
    /// synchronisation reports it.
    fn defer(&self, what: &str, err: &CudaError) {
        self.deferred.lock().push(format!("{what}: {err}"));
    }

    fn take_deferred(&self) -> ddo_core::Result<()> {
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

    fn core(&self, e: CudaError) -> CoreError {
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
        // The native pool (if any) tears down when its last handle drops, here.
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
    ptr: u64,
    len: usize,
    shared: Arc<Shared>,
    uses: Mutex<Vec<(StreamKey, PooledEvent)>>,
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

/// What a queued copy keeps alive until it has completed.
#[allow(dead_code)] // held only for their drop
enum Held {
    Host(HostSlice),
    Device(DeviceSlice),
}

struct PendingCopy {
    done: PooledEvent,
    _held: (Held, Option<Held>),
}

/// A stream of a [`CudaDevice`].
pub struct CudaStreamHandle {
    shared: Arc<Shared>,
    key: StreamKey,
    stream: Arc<CudaStream>,
    pending: Mutex<VecDeque<PendingCopy>>,
}

impl CudaStreamHandle {
    /// The cudarc stream (for kernels and library calls).
    pub fn cuda_stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The allocator's key for this stream.
    pub fn key(&self) -> StreamKey {
        self.key
    }

    /// Copies queued on this stream whose memory is still held.
    pub fn pending_copies(&self) -> usize {
        self.pending.lock().len()
    }

    /// Drops what completed copies held (in order: a stream completes in order).
    fn poll(&self) -> Result<()> {
        let mut pending = self.pending.lock();
        while let Some(front) = pending.front() {
            if front.done.is_complete()? {
                pending.pop_front();
            } else {
                break;
            }
        }
        Ok(())
    }

    /// Waits for the oldest copy still tracked on this stream and lets go of what it held;
    /// `false` when none is tracked. On a failed wait the copy stays tracked.
    fn retire_oldest(&self) -> Result<bool> {
        let Some(oldest) = self.pending.lock().pop_front() else {
            return Ok(false);
        };
        if let Err(e) = oldest.done.wait() {
            self.pending.lock().push_front(oldest);
            return Err(e);
        }
        Ok(true)
    }

    /// After the stream was synchronised: every queued copy has completed.
    fn retire_all(&self) {
        let done: Vec<PendingCopy> = self.pending.lock().drain(..).collect();
        drop(done);
    }

    /// Keeps `held` (one side of the copy, or both) alive until the copy just queued on
    /// this stream has completed. When the completion event cannot be recorded, waits for
    /// the stream instead.
    fn track(&self, held: (Held, Option<Held>)) -> Result<()> {
        match self.shared.events.record(&self.stream) {
            Ok(done) => {
                self.pending
                    .lock()
                    .push_back(PendingCopy { done, _held: held });
                Ok(())
            }
            Err(e) => {
                self.stream.synchronize().call("cuStreamSynchronize")?;
                drop(held);
                Err(e)
            }
        }
    }
}

impl Drop for CudaStreamHandle {
    fn drop(&mut self) {
        // Memory held for queued copies must outlive them.
        if !self.pending.get_mut().is_empty() {
            if let Err(e) = self.stream.synchronize().call("cuStreamSynchronize") {
                self.shared.defer("synchronising a dropped stream", &e);
            }
            self.pending.get_mut().clear();
        }
    }
}

impl fmt::Debug for CudaStreamHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaStream({} #{})", self.shared.id, self.key.0)
    }
}

impl StreamHandle for CudaStreamHandle {
    fn device(&self) -> DeviceId {
        self.shared.id
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// An event of a [`CudaDevice`].
pub struct CudaEventHandle {
    id: DeviceId,
    instance: u64,
    event: CudaEvent,
}

impl CudaEventHandle {
    /// The cudarc event.
    pub fn cuda_event(&self) -> &CudaEvent {
        &self.event
    }
}

impl fmt::Debug for CudaEventHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaEvent({})", self.id)
    }
}

impl EventHandle for CudaEventHandle {
    fn device(&self) -> DeviceId {
        self.id
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The page-locking of one pinned host buffer, or of a registered range of a checkpoint
/// mapping; unregisters on drop (errors are recorded on the device, never raised).
struct HostRegistration {
    addr: usize,
    ctx: Arc<CudaContext>,
    shared: Weak<Shared>,
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if let Err(e) = driver::host_unregister(&self.ctx, self.addr)
            && let Some(shared) = self.shared.upgrade()
        {
            shared.defer("unregistering pinned host memory", &e);
        }
    }
}

/// One NVIDIA GPU as a DDO [`Device`].
pub struct CudaDevice {
    shared: Arc<Shared>,
    compute: Stream,
    streams: Mutex<Vec<Weak<CudaStreamHandle>>>,
    next_stream: AtomicU64,
    pinned: Arc<PinnedLedger>,
    /// Pinned buffers pageable uploads are staged through; one is free for reuse when this
    /// list holds its only handle (the copy that read it last has completed and retired).
    upload_staging: Mutex<Vec<HostBuffer>>,
    config: CudaDeviceConfig,
    /// The ops [`Device::ops`] hands out: this device's, each through a per-op profiler.
    profiled: ddo_core::ProfiledOps,
    /// Whether attention may run on cuDNN (`ops/cudnn_attention.rs`).
    cudnn_attention: std::sync::atomic::AtomicBool,
    /// Attention calls cuDNN ran.
    cudnn_attention_runs: AtomicU64,
}

impl CudaDevice {
    /// Whether attention may run on cuDNN's fused flash attention where libcudnn loads and
    /// accepts the shape (on by default); off, every call runs DDO's NVRTC kernels.
    pub fn set_cudnn_attention(&self, on: bool) {
        self.cudnn_attention.store(on, Ordering::Relaxed);
    }

    /// Attention calls that cuDNN ran on this device so far.
    pub fn cudnn_attention_runs(&self) -> u64 {
        self.cudnn_attention_runs.load(Ordering::Relaxed)
    }

    /// Why the last attention call that could have run on cuDNN (in this process) ran on
    /// DDO's kernels instead: libcudnn missing, the handle not created, or the shape refused
    /// (the failed call and its status); `None` when none was.
    pub fn cudnn_attention_refusal(&self) -> Option<String> {
        crate::ops::cudnn_attention::last_refusal()
    }

    /// Waits (at most `timeout`) until no cuDNN attention plan of this device is being
    /// built: a shape's first call starts its build on a thread of its own and runs on the
    /// NVRTC kernels until it is ready. Whether none is pending now.
    pub fn wait_cudnn_attention_plans(
        &self,
        timeout: std::time::Duration,
    ) -> ddo_core::Result<bool> {
        crate::ops::cudnn_attention::wait_for_plans(self, timeout)
    }

    pub(crate) fn cudnn_attention_enabled(&self) -> bool {
        self.cudnn_attention.load(Ordering::Relaxed)
    }

    pub(crate) fn note_cudnn_attention(&self) {
        self.cudnn_attention_runs.fetch_add(1, Ordering::Relaxed);
    }

    /// Device `ordinal` with default settings. Checks that the driver library loads and
    /// that the device exists before any other driver call.
    pub fn new(ordinal: usize) -> Result<Arc<Self>> {
        Self::with_config(CudaDeviceConfig::new(ordinal))
    }

    /// A device with `config`.
    pub fn with_config(config: CudaDeviceConfig) -> Result<Arc<Self>> {
        let count = device_count()?;
        let ordinal = config.ordinal;
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let id = DeviceId {
            kind: DeviceKind::Cuda,
            ordinal: u32::try_from(ordinal).map_err(|_| CudaError::NoDevice { ordinal, count })?,
        };
        let ctx = driver::primary_context(ordinal)?;
        let compute = ctx.new_stream().call("cuStreamCreate")?;
        let (_, total) = driver::mem_get_info(&ctx)?;
        static NEXT_INSTANCE: AtomicU64 = AtomicU64::new(1);
        let shared = Arc::new(Shared {
            id,
            instance: NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed),
            allocator: CachingAllocator::new(
                DriverMemory {
                    ctx: Arc::clone(&ctx),
                },
                id.to_string(),
            ),
            native: RwLock::new(None),
            caching_allocations: AtomicU64::new(0),
            events: Arc::new(EventPool {
                ctx: Arc::clone(&ctx),
                idle: Mutex::new(Vec::new()),
            }),
            ctx,
            total,
            deferred: Mutex::new(Vec::new()),
        });
        let compute = Arc::new(CudaStreamHandle {
            shared: Arc::clone(&shared),
            key: COMPUTE,
            stream: compute,
            pending: Mutex::new(VecDeque::new()),
        });
        let device = Arc::new_cyclic(|me: &std::sync::Weak<Self>| Self {
            streams: Mutex::new(vec![Arc::downgrade(&compute)]),
            compute: Stream::new(compute),
            next_stream: AtomicU64::new(1),
            pinned: PinnedLedger::new(config.pinned_limit.unwrap_or_else(default_pinned_limit)),
            upload_staging: Mutex::new(Vec::new()),
            shared,
            config,
            profiled: ddo_core::ProfiledOps::new(me.clone()),
            cudnn_attention: std::sync::atomic::AtomicBool::new(true),
            cudnn_attention_runs: AtomicU64::new(0),
        });
        if config.native_vmm {
            device.install_native_vmm()?;
        }
        Ok(device)
    }

    /// Installs DDO's native VMM allocator ([`ddo_vmm::VmmPool`] over the device's whole
    /// memory as virtual address space) as this device's allocator: every later
    /// [`Device::alloc`] and compute output comes from the pool, and
    /// [`Device::release_native_idle_cache`] returns its idle chunks. A bootstrap step:
    /// refused with [`CudaError::NativeInstallTooLate`] once the caching allocator has
    /// served any allocation on this device (the counterpart of the fresh-process rule), and
    /// with [`CudaError::NativeAlreadyInstalled`] the second time. The device must support
    /// virtual memory management ([`ddo_vmm::VmmError::Unsupported`] otherwise).
    pub fn install_native_vmm(&self) -> Result<()> {
        let mut native = self.shared.native.write();
        if native.is_some() {
            return Err(CudaError::NativeAlreadyInstalled {
                device: self.id().to_string(),
            });
        }
        let allocations = self.shared.caching_allocations.load(Ordering::Acquire);
        if allocations > 0 {
            return Err(CudaError::NativeInstallTooLate {
                device: self.id().to_string(),
                allocations,
            });
        }
        let phys = CudaPhysicalMemory::from_context(Arc::clone(&self.shared.ctx))?;
        let pool = VmmPool::new(phys, VmmPoolConfig::new(self.id().to_string()))?;
        *native = Some(Arc::new(NativeAllocator::new(pool)));
        Ok(())
    }

    /// The native pool's exact figures, when it is installed.
    pub fn native_pool_stats(&self) -> Option<PoolStats> {
        self.shared.native.read().as_ref().map(|n| n.pool().stats())
    }

    /// Whether every stream of this device has finished its queued work (`cuStreamQuery`
    /// on each); the busy ones are described otherwise.
    fn quiescence(&self) -> ddo_core::Result<QuiescenceGate> {
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

    /// The settings.
    pub fn config(&self) -> &CudaDeviceConfig {
        &self.config
    }

    /// Pinned bytes held for staging pageable uploads (part of
    /// [`MemoryInfo::pinned_host`]; see [`CudaDeviceConfig::upload_staging_bytes`]).
    pub fn upload_staging_bytes(&self) -> u64 {
        self.upload_staging
            .lock()
            .iter()
            .map(|b| b.len() as u64)
            .sum()
    }

    /// A pinned upload buffer of at least `len` bytes that no queued copy reads, or `None`
    /// when `len` is too large to stage or no buffer can be had (the caller then copies
    /// from pageable memory). Completed copies must have been retired (`poll`) first.
    fn upload_staging_buffer(&self, len: usize) -> Option<HostBuffer> {
        let cap = self.config.upload_staging_bytes;
        if len == 0 || len as u64 > cap / 2 {
            return None;
        }
        let class = len.next_power_of_two().max(UPLOAD_STAGING_MIN);
        let mut pool = self.upload_staging.lock();
        let mut best: Option<usize> = None;
        for i in 0..pool.len() {
            let fits = pool[i].len() >= len && pool[i].is_exclusive();
            if fits && best.is_none_or(|b| pool[i].len() < pool[b].len()) {
                best = Some(i);
            }
        }
        if let Some(i) = best {
            return Some(pool[i].clone());
        }
        // Room for a new buffer: free ones that are too small go first.
        let mut held: u64 = pool.iter().map(|b| b.len() as u64).sum();
        if held + class as u64 > cap {
            pool.retain_mut(|b| {
                if held + class as u64 > cap && b.is_exclusive() {
                    held -= b.len() as u64;
                    false
                } else {
                    true
                }
            });
            if held + class as u64 > cap {
                return None;
            }
        }
        drop(pool);
        // At the pinned limit (or refused by the driver): not staged. (`alloc_pinned` takes
        // the pool's lock when it needs room, so it is not held here.)
        let buffer = self.alloc_pinned(class).ok()?;
        self.upload_staging.lock().push(buffer.clone());
        Some(buffer)
    }

    /// An event recorded on `stream` with `flags` (cudarc's default: no timing).
    fn record_with(
        &self,
        stream: &Stream,
        flags: Option<cudarc::driver::sys::CUevent_flags>,
    ) -> ddo_core::Result<Event> {
        let s = self.stream_handle(stream)?;
        let event = s
            .stream
            .record_event(flags)
            .call("cuEventRecord")
            .map_err(|e| self.core(e))?;
        Ok(Event::new(Arc::new(CudaEventHandle {
            id: self.id(),
            instance: self.shared.instance,
            event,
        })))
    }

    /// Bytes of one chunk of a large pageable upload: half the upload buffers' room.
    fn upload_chunk(&self) -> usize {
        (self.config.upload_staging_bytes / 2) as usize
    }

    /// A pageable upload larger than one upload buffer, chunk by chunk through the upload
    /// buffers: each chunk is copied into a free buffer on up to [`UPLOAD_COPY_THREADS`]
    /// threads and its device copy queued, so the host fills the next chunk while the link
    /// carries the last (a plain pageable copy runs at the driver's pageable rate, about
    /// 7 GB/s on the H200's host). When no buffer is free the oldest queued copies are
    /// waited for, one at a time (the whole stream only when that frees none). The source
    /// can change as soon as this returns.
    fn upload_in_chunks(
        &self,
        src: &HostSlice,
        to: u64,
        alloc: &CudaAllocation,
        s: &CudaStreamHandle,
    ) -> ddo_core::Result<()> {
        let chunk = self.upload_chunk().max(1);
        let mut at = 0usize;
        while at < src.len() {
            let n = chunk.min(src.len() - at);
            // No free buffer: wait for the oldest queued copies, one at a time, so the
            // host fills this chunk while the link still carries the newer ones.
            let mut free = self.upload_staging_buffer(n);
            while free.is_none() && s.retire_oldest().map_err(|e| self.core(e))? {
                free = self.upload_staging_buffer(n);
            }
            let staging = match free {
                Some(b) => b,
                None => {
                    s.stream
                        .synchronize()
                        .call("cuStreamSynchronize")
                        .map_err(|e| self.core(e))?;
                    s.retire_all();
                    match self.upload_staging_buffer(n) {
                        Some(b) => b,
                        None => {
                            // The room went to pinned memory asked for meanwhile: the rest
                            // goes the driver's pageable way.
                            src.with_bytes(|bytes| {
                                driver::memcpy_htod_async(to + at as u64, &bytes[at..], &s.stream)?;
                                s.stream.synchronize().call("cuStreamSynchronize")
                            })
                            .map_err(|e| self.core(e))?;
                            s.retire_all();
                            return Ok(());
                        }
                    }
                }
            };
            let view = staging.slice(0, n)?;
            view.with_bytes_mut(|dst| {
                src.with_bytes(|from| parallel_copy(dst, &from[at..at + n]));
            })?;
            view.with_bytes(|bytes| driver::memcpy_htod_async(to + at as u64, bytes, &s.stream))
                .map_err(|e| self.core(e))?;
            alloc.note_use(s);
            s.track((Held::Host(view), None))
                .map_err(|e| self.core(e))?;
            self.poll()?;
            at += n;
        }
        Ok(())
    }

    /// The pinned bytes now, after dropping the idle upload buffers when `bytes` more would
    /// pass the limit (the buffers are a cache: they give way to pinned memory asked for).
    fn pinned_making_room(&self, bytes: u64) -> u64 {
        let pinned = self.pinned.pinned();
        if pinned.saturating_add(bytes) > self.pinned.limit() && self.release_upload_staging() > 0 {
            return self.pinned.pinned();
        }
        pinned
    }

    /// Drops the pinned upload buffers no queued copy reads; returns their bytes.
    fn release_upload_staging(&self) -> u64 {
        let mut released = 0;
        self.upload_staging.lock().retain_mut(|b| {
            if b.is_exclusive() {
                released += b.len() as u64;
                false
            } else {
                true
            }
        });
        released
    }

    /// The cudarc context (for kernels and library calls).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.shared.ctx
    }

    /// Allocates `bytes` for work on `stream`: blocks freed on `stream` are reused at once
    /// (stream order makes that safe); use the buffer on another stream only after an event
    /// orders it behind `stream`. [`Device::alloc`] is the variant for any stream.
    pub fn alloc_on(&self, bytes: usize, stream: &Stream) -> ddo_core::Result<DeviceBuffer> {
        let key = self.stream_handle(stream)?.key;
        self.allocate(bytes, Some(key))
    }

    /// The allocation behind a buffer of this device.
    pub fn allocation<'a>(&self, buffer: &'a DeviceBuffer) -> ddo_core::Result<&'a CudaAllocation> {
        buffer
            .downcast_ref::<CudaAllocation>()
            .filter(|a| a.shared.instance == self.shared.instance)
            .ok_or_else(|| CoreError::WrongDevice {
                what: "device buffer",
                expected: self.id().to_string(),
                found: buffer.device().to_string(),
            })
    }

    /// The stream behind a handle of this device.
    pub fn stream_handle<'a>(&self, stream: &'a Stream) -> ddo_core::Result<&'a CudaStreamHandle> {
        stream
            .downcast_ref::<CudaStreamHandle>()
            .filter(|s| s.shared.instance == self.shared.instance)
            .ok_or_else(|| CoreError::WrongDevice {
                what: "stream",
                expected: self.id().to_string(),
                found: stream.device().to_string(),
            })
    }

    fn event_handle<'a>(&self, event: &'a Event) -> ddo_core::Result<&'a CudaEventHandle> {
        event
            .downcast_ref::<CudaEventHandle>()
            .filter(|e| e.instance == self.shared.instance)
            .ok_or_else(|| CoreError::WrongDevice {
                what: "event",
                expected: self.id().to_string(),
                found: event.device().to_string(),
            })
    }

    /// The caching allocator's exact figures.
    pub fn allocator_stats(&self) -> AllocatorStats {
        self.shared.allocator.stats()
    }

    /// The caching allocator's segments and blocks.
    pub fn allocator_snapshot(&self) -> Vec<SegmentSnapshot> {
        self.shared.allocator.snapshot()
    }

    /// Copies queued on any stream whose memory is still held.
    pub fn pending_copies(&self) -> usize {
        self.live_streams().iter().map(|s| s.pending_copies()).sum()
    }

    fn core(&self, e: CudaError) -> CoreError {
        self.shared.core(e)
    }

    fn allocate(&self, bytes: usize, stream: Option<StreamKey>) -> ddo_core::Result<DeviceBuffer> {
        self.poll()?;
        let native = self.shared.native.read();
        let mut fences = Vec::new();
        let (ptr, backing) = match native.as_ref() {
            Some(native) => {
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
            None => {
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
    fn order_use(&self, alloc: &CudaAllocation, s: &CudaStreamHandle) -> ddo_core::Result<()> {
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

    fn live_streams(&self) -> Vec<Arc<CudaStreamHandle>> {
        let mut streams = self.streams.lock();
        streams.retain(|w| w.strong_count() > 0);
        streams.iter().filter_map(Weak::upgrade).collect()
    }

    /// Releases what completed copies held, on every stream.
    fn poll(&self) -> ddo_core::Result<()> {
        for s in self.live_streams() {
            s.poll().map_err(|e| self.core(e))?;
        }
        Ok(())
    }

    fn check_len(what: &str, expected: usize, actual: usize) -> ddo_core::Result<()> {
        if expected == actual {
            Ok(())
        } else {
            Err(CoreError::SizeMismatch {
                what: what.to_string(),
                expected,
                actual,
            })
        }
    }
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.shared.allocator.stats();
        write!(
            f,
            "CudaDevice({}, {} B allocated, {} B reserved)",
            self.shared.id, s.allocated, s.reserved
        )
    }
}

impl Device for CudaDevice {
    fn id(&self) -> DeviceId {
        self.shared.id
    }

    /// This device's ops, each through its per-op profiler ([`ddo_core::ProfiledOps`]).
    fn ops(&self) -> Option<&dyn ddo_core::Ops> {
        Some(&self.profiled)
    }

    fn scratch_bytes(&self) -> u64 {
        SCRATCH_BYTES
    }

    fn conv2d_scratch_bytes(
        &self,
        elems: usize,
        channels: usize,
        filters: usize,
        kernel: usize,
        dtype: DType,
    ) -> u64 {
        crate::ops::conv::scratch_bytes(elems, channels, filters, kernel, dtype)
    }

    fn allocator(&self) -> AllocatorKind {
        if self.shared.native.read().is_some() {
            AllocatorKind::NativeVmm
        } else {
            AllocatorKind::Caching
        }
    }

    fn alloc(&self, bytes: usize) -> ddo_core::Result<DeviceBuffer> {
        self.allocate(bytes, None)
    }

    fn release_after(&self, buffer: DeviceBuffer, stream: &Stream) -> ddo_core::Result<()> {
        let alloc = self.allocation(&buffer)?;
        let s = self.stream_handle(stream)?;
        let mark = self
            .shared
            .events
            .record(&s.stream)
            .map_err(|e| self.core(e))?;
        alloc.uses.lock().push((s.key, mark));
        drop(buffer);
        Ok(())
    }

    fn alloc_pinned(&self, bytes: usize) -> ddo_core::Result<HostBuffer> {
        let (pinned, limit) = (self.pinned_making_room(bytes as u64), self.pinned.limit());
        if pinned.saturating_add(bytes as u64) > limit {
            return Err(CoreError::PinnedLimit {
                requested: bytes as u64,
                pinned,
                limit,
            });
        }
        // Committed on several threads first: registering lazily zeroed memory would fault
        // (and zero) every page on the driver's one thread.
        let memory = AlignedBytes::zeroed_committed(bytes);
        if bytes == 0 {
            let registration = self.pinned.reserve(0, None)?;
            return Ok(HostBuffer::owned(memory, Some(registration)));
        }
        driver::host_register(&self.shared.ctx, memory.as_slice()).map_err(|e| self.core(e))?;
        let token = HostRegistration {
            addr: memory.as_slice().as_ptr() as usize,
            ctx: Arc::clone(&self.shared.ctx),
            shared: Arc::downgrade(&self.shared),
        };
        // On a refusal (another thread took the room meanwhile) the token drops here and
        // unregisters, before `memory` is freed.
        let registration = self.pinned.reserve(bytes as u64, Some(Box::new(token)))?;
        Ok(HostBuffer::owned(memory, Some(registration)))
    }

    /// `cuMemHostRegister` with the read-only flag on the buffer's range of its checkpoint
    /// mapping, rounded out to [`REGISTER_ALIGN`](ddo_core::host_memory::REGISTER_ALIGN) blocks
    /// from the mapping's start (so the range starts on a page boundary; its end is the
    /// block's or the mapping's), counted under the device's pinned ledger. The driver's
    /// `CUDA_ERROR_NOT_SUPPORTED`, `CUDA_ERROR_NOT_PERMITTED` and
    /// `CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED` are
    /// [`CoreError::HostRegisterUnsupported`]. Unregistered when the view's last handle
    /// drops (copies queued from it hold a handle until they complete).
    fn register_host(&self, buffer: &HostBuffer) -> ddo_core::Result<HostBuffer> {
        let (map, span) = register_target(&self.id().to_string(), buffer)?;
        let bytes = span.len() as u64;
        let (pinned, limit) = (self.pinned_making_room(bytes), self.pinned.limit());
        if pinned.saturating_add(bytes) > limit {
            return Err(CoreError::PinnedLimit {
                requested: bytes,
                pinned,
                limit,
            });
        }
        if span.is_empty() {
            let registration = self.pinned.reserve(0, None)?;
            return HostBuffer::registered(buffer.clone(), registration);
        }
        let range = &map.bytes()[span.clone()];
        driver::host_register_read_only(&self.shared.ctx, range).map_err(|e| {
            use cudarc::driver::sys::CUresult as R;
            match e.0 {
                R::CUDA_ERROR_NOT_SUPPORTED
                | R::CUDA_ERROR_NOT_PERMITTED
                | R::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED => {
                    CoreError::HostRegisterUnsupported {
                        device: self.id().to_string(),
                        reason: format!(
                            "cuMemHostRegister (read-only) of bytes {}..{} of {} answered {:?}",
                            span.start,
                            span.end,
                            map.path().display(),
                            e.0
                        ),
                    }
                }
                _ => self.core(CudaError::driver("cuMemHostRegister", e)),
            }
        })?;
        let token = HostRegistration {
            addr: range.as_ptr() as usize,
            ctx: Arc::clone(&self.shared.ctx),
            shared: Arc::downgrade(&self.shared),
        };
        // On a refusal the token drops here and unregisters; `map` is still held.
        let registration = self.pinned.reserve(bytes, Some(Box::new(token)))?;
        HostBuffer::registered(buffer.clone(), registration)
    }

    fn compute_stream(&self) -> Stream {
        self.compute.clone()
    }

    fn create_stream(&self) -> ddo_core::Result<Stream> {
        let stream = self
            .shared
            .ctx
            .new_stream()
            .call("cuStreamCreate")
            .map_err(|e| self.core(e))?;
        let handle = Arc::new(CudaStreamHandle {
            shared: Arc::clone(&self.shared),
            key: StreamKey(self.next_stream.fetch_add(1, Ordering::Relaxed)),
            stream,
            pending: Mutex::new(VecDeque::new()),
        });
        self.streams.lock().push(Arc::downgrade(&handle));
        Ok(Stream::new(handle))
    }

    fn copy_h2d(
        &self,
        src: &HostSlice,
        dst: &DeviceSlice,
        stream: &Stream,
    ) -> ddo_core::Result<()> {
        Self::check_len("host->device copy", dst.len(), src.len())?;
        let alloc = self.allocation(dst.buffer())?;
        let s = self.stream_handle(stream)?;
        self.poll()?;
        if src.is_empty() {
            return Ok(());
        }
        self.order_use(alloc, s)?;
        let to = alloc.ptr + dst.offset() as u64;
        if src.kind() == HostMemoryKind::Pinned {
            src.with_bytes(|bytes| driver::memcpy_htod_async(to, bytes, &s.stream))
                .map_err(|e| self.core(e))?;
            s.track((Held::Host(src.clone()), Some(Held::Device(dst.clone()))))
                .map_err(|e| self.core(e))
        } else if let Some(staging) = (src.kind() == HostMemoryKind::Pageable)
            .then(|| self.upload_staging_buffer(src.len()))
            .flatten()
        {
            // Pageable: the bytes go into a pinned upload buffer now, and the copy from it
            // is queued like any pinned copy. A pageable copy would hold the host until it
            // is done, queued behind whatever the link already carries.
            let view = staging.slice(0, src.len())?;
            view.with_bytes_mut(|to| src.with_bytes(|from| to.copy_from_slice(from)))?;
            view.with_bytes(|bytes| driver::memcpy_htod_async(to, bytes, &s.stream))
                .map_err(|e| self.core(e))?;
            // The destination is not held: its free is ordered behind the copy instead, so
            // a tensor just uploaded is still its buffer's only holder (in-place ops).
            alloc.note_use(s);
            s.track((Held::Host(view), None)).map_err(|e| self.core(e))
        } else if src.kind() == HostMemoryKind::Pageable && self.upload_chunk() > 0 {
            self.upload_in_chunks(src, to, alloc, s)
        } else {
            // Pageable or mapped: the copy completes before the bytes' borrow ends.
            src.with_bytes(|bytes| {
                driver::memcpy_htod_async(to, bytes, &s.stream)?;
                s.stream.synchronize().call("cuStreamSynchronize")
            })
            .map_err(|e| self.core(e))?;
            s.retire_all();
            Ok(())
        }
    }

    fn copy_d2h(
        &self,
        src: &DeviceSlice,
        dst: &HostSlice,
        stream: &Stream,
    ) -> ddo_core::Result<()> {
        Self::check_len("device->host copy", src.len(), dst.len())?;
        let alloc = self.allocation(src.buffer())?;
        if dst.kind() == HostMemoryKind::CheckpointMapped {
            return Err(CoreError::Backend {
                device: self.id().to_string(),
                message: "device->host copy into a read-only checkpoint mapping".into(),
            });
        }
        let s = self.stream_handle(stream)?;
        self.poll()?;
        if dst.is_empty() {
            return Ok(());
        }
        self.order_use(alloc, s)?;
        let from = alloc.ptr + src.offset() as u64;
        if dst.kind() == HostMemoryKind::Pinned {
            dst.with_bytes_mut(|bytes| driver::memcpy_dtoh_async(bytes, from, &s.stream))?
                .map_err(|e| self.core(e))?;
            s.track((Held::Device(src.clone()), Some(Held::Host(dst.clone()))))
                .map_err(|e| self.core(e))
        } else {
            dst.with_bytes_mut(|bytes| {
                driver::memcpy_dtoh_async(bytes, from, &s.stream)?;
                s.stream.synchronize().call("cuStreamSynchronize")
            })?
            .map_err(|e| self.core(e))?;
            s.retire_all();
            Ok(())
        }
    }

    fn copy_d2d(
        &self,
        src: &DeviceSlice,
        dst: &DeviceSlice,
        stream: &Stream,
    ) -> ddo_core::Result<()> {
        Self::check_len("device->device copy", dst.len(), src.len())?;
        let src_alloc = self.allocation(src.buffer())?;
        let dst_alloc = self.allocation(dst.buffer())?;
        let from = src_alloc.ptr + src.offset() as u64;
        let to = dst_alloc.ptr + dst.offset() as u64;
        let s = self.stream_handle(stream)?;
        self.poll()?;
        if src.is_empty() {
            return Ok(());
        }
        self.order_use(src_alloc, s)?;
        self.order_use(dst_alloc, s)?;
        driver::memcpy_dtod_async(to, from, src.len(), &s.stream).map_err(|e| self.core(e))?;
        s.track((Held::Device(src.clone()), Some(Held::Device(dst.clone()))))
            .map_err(|e| self.core(e))
    }

    fn record_event(&self, stream: &Stream) -> ddo_core::Result<Event> {
        self.record_with(stream, None)
    }

    fn record_timed_event(&self, stream: &Stream) -> ddo_core::Result<Event> {
        self.record_with(
            stream,
            Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT),
        )
    }

    fn event_elapsed_ns(&self, start: &Event, end: &Event) -> ddo_core::Result<Option<i64>> {
        let a = self.event_handle(start)?;
        let b = self.event_handle(end)?;
        let ms = a
            .event
            .elapsed_ms(&b.event)
            .call("cuEventElapsedTime")
            .map_err(|e| self.core(e))?;
        Ok(Some((f64::from(ms) * 1e6) as i64))
    }

    fn wait_event(&self, stream: &Stream, event: &Event) -> ddo_core::Result<()> {
        let s = self.stream_handle(stream)?;
        let e = self.event_handle(event)?;
        s.stream
            .wait(&e.event)
            .call("cuStreamWaitEvent")
            .map_err(|e| self.core(e))
    }

    fn event_complete(&self, event: &Event) -> ddo_core::Result<bool> {
        let e = self.event_handle(event)?;
        let done = e
            .event
            .try_is_complete()
            .call("cuEventQuery")
            .map_err(|e| self.core(e))?;
        self.poll()?;
        Ok(done)
    }

    fn synchronize_event(&self, event: &Event) -> ddo_core::Result<()> {
        let e = self.event_handle(event)?;
        e.event
            .synchronize()
            .call("cuEventSynchronize")
            .map_err(|e| self.core(e))?;
        self.poll()
    }

    fn synchronize_stream(&self, stream: &Stream) -> ddo_core::Result<()> {
        let s = self.stream_handle(stream)?;
        s.stream
            .synchronize()
            .call("cuStreamSynchronize")
            .map_err(|e| self.core(e))?;
        s.retire_all();
        self.poll()?;
        self.shared.take_deferred()
    }

    fn synchronize(&self) -> ddo_core::Result<()> {
        self.shared
            .ctx
            .synchronize()
            .call("cuCtxSynchronize")
            .map_err(|e| self.core(e))?;
        for s in self.live_streams() {
            s.retire_all();
        }
        self.shared.take_deferred()
    }

    fn memory_info(&self) -> MemoryInfo {
        let s = self.shared.allocator.stats();
        let driver = driver::mem_get_info(&self.shared.ctx).ok();
        // Under the native allocator the caching one serves nothing: report the pool.
        let (allocated, peak_allocated, reserved) = match self.shared.native.read().as_ref() {
            Some(n) => {
                let f = n.figures();
                (f.live_bytes, f.peak_live_bytes, f.mapped_bytes)
            }
            None => (s.allocated, s.peak_allocated, s.reserved),
        };
        MemoryInfo {
            allocated,
            peak_allocated,
            reserved,
            capacity: self.shared.total,
            driver_free: driver.map(|(free, _)| free),
            driver_total: driver.map(|(_, total)| total),
            pinned_host: self.pinned.pinned(),
            pinned_cached: self.upload_staging_bytes(),
            pinned_limit: self.pinned.limit(),
        }
    }

    fn reset_peak(&self) {
        self.shared.allocator.reset_peak();
        if let Some(n) = self.shared.native.read().as_ref() {
            n.reset_peaks();
        }
    }

    fn native_pool_figures(&self) -> Option<NativePoolFigures> {
        self.shared.native.read().as_ref().map(|n| n.figures())
    }

    fn release_native_idle_cache(&self) -> ddo_core::Result<IdleCacheRelease> {
        let Some(native) = self.shared.native.read().clone() else {
            return Err(CoreError::NativeAllocatorNotInstalled {
                device: self.id().to_string(),
            });
        };
        let gate = self.quiescence()?;
        if !gate.is_quiescent() {
            return Err(CoreError::NotQuiescent {
                device: self.id().to_string(),
                pending: gate.basis().to_string(),
            });
        }
        // Idle streams: every copy and free event has completed.
        for s in self.live_streams() {
            s.retire_all();
        }
        native
            .release_idle(&gate)
            .map_err(|e| self.core(CudaError::Vmm(e)))
    }

    /// Every op is bracketed by two timed events on the compute stream until the profile
    /// ends.
    fn begin_op_profile(&self) -> bool {
        self.profiled.profiler().begin();
        true
    }

    /// Waits for the cuDNN attention plans being built ([`CudaDevice::wait_cudnn_attention_plans`]).
    fn settle(&self, timeout: std::time::Duration) -> ddo_core::Result<bool> {
        self.wait_cudnn_attention_plans(timeout)
    }

    /// Starts building the cuDNN plan of an eligible shape in the background
    /// (`ops/cudnn_attention.rs`).
    fn prepare_attention(
        &self,
        q: &[usize],
        k: &[usize],
        v: &[usize],
        mask: Option<(&[usize], DType)>,
        dtype: DType,
    ) {
        if self.cudnn_attention_enabled() {
            crate::ops::attention::prepare(self, q, k, v, mask, dtype);
        }
    }

    /// The profile notes, once, the last time in this process that attention ran on the
    /// NVRTC kernels because cuDNN was missing or refused a shape.
    fn end_op_profile(&self) -> ddo_core::Result<Option<ddo_core::OpProfile>> {
        let mut profile = self.profiled.profiler().finish(self)?;
        if let (Some(p), Some(why)) = (profile.as_mut(), self.cudnn_attention_refusal()) {
            p.notes.push(format!(
                "attention ran on DDO's NVRTC kernels where cuDNN could not: {why}"
            ));
        }
        Ok(profile)
    }

    /// Waits for the device, returns the caching allocator's idle segments to the driver
    /// (the bytes returned) and drops the pinned upload buffers.
    fn empty_cache(&self) -> ddo_core::Result<u64> {
        self.synchronize()?;
        self.release_upload_staging();
        self.shared
            .allocator
            .wait_and_empty_cache()
            .map_err(|e| self.core(e))
    }
}
