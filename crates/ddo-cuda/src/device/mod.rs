//! [`CudaDevice`]: ddo-core's [`Device`] on one NVIDIA GPU — allocations from the caching
//! allocator, pinned host memory, streams, events, asynchronous copies, exact accounting.
//!
//! Semantics follow the host backend (`ddo_host::HostDevice`):
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
//! This module is safe code: every driver call goes through `crate::driver` or cudarc's
//! safe API.
//!
//! The module is split by purpose: `config.rs` (settings, defaults, the driver probes),
//! `streams.rs` (streams, events, the event pool, pending copies), `memory.rs` (shared
//! state, allocations, the caching and native allocators' use), `ledger.rs` (the
//! process-wide ledger of each ordinal: one native allocator per ordinal, installed before
//! anything is allocated on it, whatever the number of devices), `copies.rs` (the copy
//! bodies, upload staging) and `registration.rs` (pinned host memory and checkpoint
//! registrations under the pinned ledger); this file holds [`CudaDevice`] and its
//! `impl Device`.

mod config;
mod copies;
mod ledger;
mod memory;
mod registration;
mod streams;

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use cudarc::driver::CudaContext;
use ddo_core::host_memory::PinnedLedger;
use ddo_core::{
    AllocatorKind, CoreError, DType, Device, DeviceBuffer, DeviceId, DeviceKind, DeviceSlice,
    Event, HostBuffer, HostSlice, MemoryInfo, Stream,
};
use ddo_metrics::{IdleCacheRelease, NativePoolFigures};
use parking_lot::{Mutex, RwLock};

use crate::allocator::{AllocatorStats, CachingAllocator, SegmentSnapshot, StreamKey};
use crate::driver;
use crate::error::{CudaError, DriverResultExt, Result};

pub use config::{
    CudaDeviceConfig, DEFAULT_UPLOAD_STAGING_BYTES, SCRATCH_BYTES, device_count, library_present,
};
pub use memory::CudaAllocation;
pub use streams::{CudaEventHandle, CudaStreamHandle};

use config::default_pinned_limit;
use memory::{DriverMemory, Shared};
use streams::{COMPUTE, EventPool};

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
    /// Pinned and registered host memory let go through [`Device::release_host`], still
    /// page-locked (and counted) until [`Device::unpin_released`].
    released_host: ddo_core::released_host::ReleasedHost,
    /// [`Device::host_registrations`]: checkpoint ranges registered so far.
    host_registrations: AtomicU64,
    config: CudaDeviceConfig,
    /// The ops [`Device::ops`] hands out: this device's, each through a per-op profiler.
    profiled: ddo_core::ProfiledOps,
    /// Whether attention may run on cuDNN (`ops/cudnn_attention.rs`).
    cudnn_attention: std::sync::atomic::AtomicBool,
    /// Attention calls cuDNN ran.
    cudnn_attention_runs: AtomicU64,
    /// Whether 16-bit linears may run on cuBLASLt (`ops/cublaslt.rs`).
    cublaslt: std::sync::atomic::AtomicBool,
    /// Linears cuBLASLt ran.
    cublaslt_runs: AtomicU64,
    /// The E4M3 codes of the activation the last fp8 linear read, for the next ones that
    /// read it, until the forward ends (`ops/fp8.rs`).
    pub(crate) fp8_codes: Mutex<Option<crate::ops::fp8::Codes>>,
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

    /// Whether 16-bit linears (and `linear_gelu_tanh`) may run on cuBLASLt with the bias
    /// and the GELU in the GEMM's epilogue where libcublasLt loads and finds an algorithm
    /// (on by default); off, they run on cuBLAS with a bias-fill pass and a separate GELU.
    pub fn set_cublaslt(&self, on: bool) {
        self.cublaslt.store(on, Ordering::Relaxed);
    }

    /// Linears (including `linear_gelu_tanh`) that cuBLASLt ran on this device so far.
    pub fn cublaslt_runs(&self) -> u64 {
        self.cublaslt_runs.load(Ordering::Relaxed)
    }

    /// Why the last linear that could have run on cuBLASLt (in this process) ran on cuBLAS
    /// instead: libcublasLt missing, the handle not created, no algorithm for the shape, or
    /// a refused call (its status); `None` when none was.
    pub fn cublaslt_refusal(&self) -> Option<String> {
        crate::ops::cublaslt::last_refusal()
    }

    pub(crate) fn cublaslt_enabled(&self) -> bool {
        self.cublaslt.load(Ordering::Relaxed)
    }

    pub(crate) fn note_cublaslt(&self) {
        self.cublaslt_runs.fetch_add(1, Ordering::Relaxed);
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
        // Not beside another device's native allocator, which serves the ordinal alone (a
        // dropped device's cuBLAS workspace keeps it in the ledger until its handle is
        // destroyed: destroy those first).
        crate::ops::gemm::destroy_dead_handles();
        let ledger = ledger::ledger_of(ordinal);
        ledger.check_open()?;
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
            ledger,
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
            released_host: ddo_core::released_host::ReleasedHost::new(),
            host_registrations: AtomicU64::new(0),
            shared,
            config,
            profiled: ddo_core::ProfiledOps::new(me.clone()),
            cudnn_attention: std::sync::atomic::AtomicBool::new(true),
            cudnn_attention_runs: AtomicU64::new(0),
            cublaslt: std::sync::atomic::AtomicBool::new(true),
            cublaslt_runs: AtomicU64::new(0),
            fp8_codes: Mutex::new(None),
        });
        if config.native_vmm {
            device.install_native_vmm()?;
        }
        Ok(device)
    }

    /// The settings.
    pub fn config(&self) -> &CudaDeviceConfig {
        &self.config
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

    /// The caching allocator's exact figures.
    pub fn allocator_stats(&self) -> AllocatorStats {
        self.shared.allocator.stats()
    }

    /// The caching allocator's segments and blocks.
    pub fn allocator_snapshot(&self) -> Vec<SegmentSnapshot> {
        self.shared.allocator.snapshot()
    }

    fn core(&self, e: CudaError) -> CoreError {
        self.shared.core(e)
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
        self.alloc_pinned_impl(bytes)
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
        self.register_host_impl(buffer)
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
        self.copy_h2d_impl(src, dst, stream)
    }

    fn copy_d2h(
        &self,
        src: &DeviceSlice,
        dst: &HostSlice,
        stream: &Stream,
    ) -> ddo_core::Result<()> {
        self.copy_d2h_impl(src, dst, stream)
    }

    fn lossless_scratch_bytes(&self) -> usize {
        crate::ops::codec::SCRATCH_BYTES
    }

    /// The NVRTC decoder (`kernels/codec.cu`), verifying each unit's checksum as it writes.
    fn decode_lossless(
        &self,
        header: &ddo_codec::UnitHeader,
        src: &DeviceSlice,
        dst: &DeviceSlice,
        scratch: &DeviceSlice,
        stream: &Stream,
    ) -> ddo_core::Result<()> {
        crate::ops::codec::decode_unit(self, header, src, dst, scratch, stream, true)
    }

    fn check_lossless(&self, scratch: &DeviceSlice, stream: &Stream) -> ddo_core::Result<()> {
        let status = crate::ops::codec::read_status(self, scratch, stream)?;
        if status.is_ok() {
            return Ok(());
        }
        crate::ops::codec::clear_scratch(self, scratch, stream)?;
        ddo_core::device::lossless_status(&self.id().to_string(), status.bits())
    }

    fn copy_d2d(
        &self,
        src: &DeviceSlice,
        dst: &DeviceSlice,
        stream: &Stream,
    ) -> ddo_core::Result<()> {
        self.copy_d2d_impl(src, dst, stream)
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
            .cuda_event()
            .elapsed_ms(b.cuda_event())
            .call("cuEventElapsedTime")
            .map_err(|e| self.core(e))?;
        Ok(Some((f64::from(ms) * 1e6) as i64))
    }

    fn wait_event(&self, stream: &Stream, event: &Event) -> ddo_core::Result<()> {
        let s = self.stream_handle(stream)?;
        let e = self.event_handle(event)?;
        s.stream
            .wait(e.cuda_event())
            .call("cuStreamWaitEvent")
            .map_err(|e| self.core(e))
    }

    fn event_complete(&self, event: &Event) -> ddo_core::Result<bool> {
        let e = self.event_handle(event)?;
        let done = e
            .cuda_event()
            .try_is_complete()
            .call("cuEventQuery")
            .map_err(|e| self.core(e))?;
        self.poll()?;
        Ok(done)
    }

    fn synchronize_event(&self, event: &Event) -> ddo_core::Result<()> {
        let e = self.event_handle(event)?;
        crate::host_waits::timed("cuEventSynchronize", || e.cuda_event().synchronize())
            .call("cuEventSynchronize")
            .map_err(|e| self.core(e))?;
        self.poll()
    }

    fn synchronize_stream(&self, stream: &Stream) -> ddo_core::Result<()> {
        let s = self.stream_handle(stream)?;
        crate::host_waits::timed("cuStreamSynchronize", || s.stream.synchronize())
            .call("cuStreamSynchronize")
            .map_err(|e| self.core(e))?;
        s.retire_all();
        self.poll()?;
        self.shared.take_deferred()
    }

    fn synchronize(&self) -> ddo_core::Result<()> {
        crate::host_waits::timed("cuCtxSynchronize", || self.shared.ctx.synchronize())
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
            pinned_cached: self.upload_staging_bytes() + self.released_host_bytes(),
            pinned_limit: self.pinned.limit(),
            pinned_peak: self.pinned.peak(),
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
        self.unpin_released();
        self.wait_cudnn_attention_plans(timeout)
    }

    /// Keeps `buffer` (pinned) until [`Device::unpin_released`]: unregistering waits for
    /// the device's queued work (`device/registration.rs`).
    fn release_host(&self, buffer: HostBuffer) {
        self.released_host.keep(buffer);
    }

    fn unpin_released(&self) -> u64 {
        self.unpin_released_host()
    }

    fn setup_calls(&self) -> ddo_core::SetupCalls {
        crate::setup_calls::now()
    }

    fn host_waits_since(&self, since: std::time::Instant) -> Vec<ddo_metrics::HostWait> {
        crate::host_waits::since(since)
    }

    /// Each call once on zeros (`ops/warm_up.rs`): cuBLASLt loads its kernels
    /// and the plans are built while nothing is queued.
    fn prepare_linears(
        &self,
        calls: &[ddo_core::LinearCall],
        max_bytes: u64,
    ) -> ddo_core::Result<usize> {
        crate::ops::warm_up::prepare_linears(self, calls, max_bytes)
    }

    fn host_registrations(&self) -> u64 {
        self.host_registrations.load(Ordering::Relaxed)
    }

    /// Starts building the cuDNN plan of an eligible shape, output in token order, in the
    /// background (`ops/cudnn_attention.rs`).
    fn forget_shape_plans(&self) -> ddo_core::Result<()> {
        self.synchronize()?;
        crate::ops::forget_shape_plans(self)
    }

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

    /// The profile notes, once each, the last time in this process that attention ran on
    /// the NVRTC kernels because cuDNN was missing or refused a shape, and the last time a
    /// 16-bit linear ran on cuBLAS because cuBLASLt was missing or refused it.
    fn end_op_profile(&self) -> ddo_core::Result<Option<ddo_core::OpProfile>> {
        let mut profile = self.profiled.profiler().finish(self)?;
        if let (Some(p), Some(why)) = (profile.as_mut(), self.cudnn_attention_refusal()) {
            p.notes.push(format!(
                "attention ran on DDO's NVRTC kernels where cuDNN could not: {why}"
            ));
        }
        if let (Some(p), Some(why)) = (profile.as_mut(), self.cublaslt_refusal()) {
            p.notes.push(format!(
                "a 16-bit linear ran on cuBLAS where cuBLASLt could not: {why}"
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
