//! The memory and transfer plane: the [`Device`] trait, and the backend-neutral handles it
//! hands out ([`DeviceBuffer`], [`Stream`], [`Event`]).
//!
//! Routes talk to this trait only, so the same route runs on the host backend in CI and on
//! CUDA unchanged. Backends put their own state behind the handles and get it back with
//! `downcast_ref`; a handle from another backend is a typed error, never undefined
//! behaviour.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use crate::DType;
use crate::error::{CoreError, Result};
use crate::host_memory::{HostBuffer, HostSlice};
use crate::ops::Ops;
use ddo_metrics::{IdleCacheRelease, NativePoolFigures};

/// Which backend a device belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum DeviceKind {
    /// The host backend: "device" memory is host memory with a capacity.
    Host,
    /// An NVIDIA GPU.
    Cuda,
}

/// A device's identity, written `host:N` or `cuda:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct DeviceId {
    /// Backend.
    pub kind: DeviceKind,
    /// Ordinal within the backend.
    pub ordinal: u32,
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            DeviceKind::Host => write!(f, "host:{}", self.ordinal),
            DeviceKind::Cuda => write!(f, "cuda:{}", self.ordinal),
        }
    }
}

/// Which allocator serves a device's allocations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum AllocatorKind {
    /// A caching allocator (PyTorch-style bins and reuse); the default.
    Caching,
    /// DDO's native allocator on CUDA virtual memory, installed as a bootstrap step.
    NativeVmm,
}

impl AllocatorKind {
    /// Short name.
    pub const fn as_str(self) -> &'static str {
        match self {
            AllocatorKind::Caching => "caching",
            AllocatorKind::NativeVmm => "native_vmm",
        }
    }
}

/// Counts and host time of a backend's first calls of each shape, cumulative since the
/// process started ([`Device::setup_calls`]); [`SetupCalls::since`] gives one stretch's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SetupCalls {
    /// Library plans built on the calling thread (a GEMM's algorithm chosen by the
    /// library's heuristic, say).
    pub plans_built: u64,
    /// Host ns those builds took.
    pub plan_build_ns: u64,
    /// Host ns calls waited for plans being built in the background.
    pub plan_wait_ns: u64,
    /// Kernel modules loaded into the device's context (compiled first where no cache
    /// held them).
    pub kernel_loads: u64,
    /// Host ns those loads took.
    pub kernel_load_ns: u64,
    /// Device memory segments the backend's allocator took from the driver (its cache
    /// held no fit).
    #[serde(default)]
    pub device_allocs: u64,
    /// Host ns those driver allocations took.
    #[serde(default)]
    pub device_alloc_ns: u64,
}

impl SetupCalls {
    /// What was added since `earlier` (each count and time; 0 where `earlier` is larger).
    pub fn since(&self, earlier: &SetupCalls) -> SetupCalls {
        SetupCalls {
            plans_built: self.plans_built.saturating_sub(earlier.plans_built),
            plan_build_ns: self.plan_build_ns.saturating_sub(earlier.plan_build_ns),
            plan_wait_ns: self.plan_wait_ns.saturating_sub(earlier.plan_wait_ns),
            kernel_loads: self.kernel_loads.saturating_sub(earlier.kernel_loads),
            kernel_load_ns: self.kernel_load_ns.saturating_sub(earlier.kernel_load_ns),
            device_allocs: self.device_allocs.saturating_sub(earlier.device_allocs),
            device_alloc_ns: self.device_alloc_ns.saturating_sub(earlier.device_alloc_ns),
        }
    }

    /// The host seconds in all: plans built and waited for, kernels loaded, device memory
    /// taken from the driver.
    pub fn seconds(&self) -> f64 {
        (self.plan_build_ns + self.plan_wait_ns + self.kernel_load_ns + self.device_alloc_ns) as f64
            / 1e9
    }
}

/// A backend's device allocation. Memory goes back to the allocator when the last
/// [`DeviceBuffer`] handle (and every queued operation that uses it) is dropped.
pub trait DeviceAllocation: Any + Send + Sync + fmt::Debug {
    /// Size in bytes.
    fn len(&self) -> usize;
    /// Whether the allocation is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The device it lives on.
    fn device(&self) -> DeviceId;
    /// The backend's concrete type.
    fn as_any(&self) -> &dyn Any;
}

/// A shared handle to device memory.
#[derive(Clone, Debug)]
pub struct DeviceBuffer {
    inner: Arc<dyn DeviceAllocation>,
}

impl DeviceBuffer {
    /// Wraps a backend allocation.
    pub fn new(inner: Arc<dyn DeviceAllocation>) -> Self {
        Self { inner }
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.inner.len()
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.inner.is_empty()
    }

    /// The device it lives on.
    pub fn device(&self) -> DeviceId {
        self.inner.device()
    }

    /// The backend's concrete allocation, if it is a `T`.
    pub fn downcast_ref<T: 'static>(&self) -> Option<&T> {
        self.inner.as_any().downcast_ref::<T>()
    }

    /// Whether two handles share one allocation.
    pub fn same_buffer(&self, other: &DeviceBuffer) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// A handle that does not keep the allocation: [`WeakDeviceBuffer::is`] says whether a
    /// buffer is this one, alive. While it exists this buffer is never exclusive, so no op
    /// writes over its bytes in place.
    pub fn downgrade(&self) -> WeakDeviceBuffer {
        WeakDeviceBuffer {
            inner: Arc::downgrade(&self.inner),
        }
    }

    /// Whether this handle is the allocation's only one (no clone, no view, no weak
    /// reference): whoever owns it may then reuse its bytes for a new value.
    pub fn is_exclusive(&mut self) -> bool {
        Arc::get_mut(&mut self.inner).is_some()
    }

    /// A view of the whole buffer.
    pub fn slice_all(&self) -> DeviceSlice {
        DeviceSlice {
            buffer: self.clone(),
            offset: 0,
            len: self.len(),
        }
    }

    /// A view of `offset..offset + len`.
    pub fn slice(&self, offset: usize, len: usize) -> Result<DeviceSlice> {
        if offset.checked_add(len).is_none_or(|end| end > self.len()) {
            return Err(CoreError::OutOfRange {
                what: "device slice",
                offset,
                len,
                buffer_len: self.len(),
            });
        }
        Ok(DeviceSlice {
            buffer: self.clone(),
            offset,
            len,
        })
    }
}

/// A [`DeviceBuffer`] that does not keep its allocation ([`DeviceBuffer::downgrade`]): what a
/// backend keeps to know a buffer again (an activation whose derived values it still holds)
/// without holding its memory.
#[derive(Clone, Debug)]
pub struct WeakDeviceBuffer {
    inner: std::sync::Weak<dyn DeviceAllocation>,
}

impl WeakDeviceBuffer {
    /// Whether `buffer` is the allocation this was made from, still alive. (The weak handle
    /// keeps the allocation's record, so no new buffer can take its address while it lives.)
    pub fn is(&self, buffer: &DeviceBuffer) -> bool {
        self.inner.strong_count() > 0
            && std::ptr::addr_eq(self.inner.as_ptr(), Arc::as_ptr(&buffer.inner))
    }

    /// Whether the allocation is still alive (some [`DeviceBuffer`] holds it).
    pub fn is_alive(&self) -> bool {
        self.inner.strong_count() > 0
    }
}

/// A byte range of a [`DeviceBuffer`].
#[derive(Clone, Debug)]
pub struct DeviceSlice {
    buffer: DeviceBuffer,
    offset: usize,
    len: usize,
}

impl DeviceSlice {
    /// The buffer.
    pub fn buffer(&self) -> &DeviceBuffer {
        &self.buffer
    }

    /// Whether this view is the only handle to its buffer and covers all of it: the bytes
    /// are then its owner's alone (see [`DeviceBuffer::is_exclusive`]).
    pub fn is_exclusive(&mut self) -> bool {
        self.offset == 0 && self.len == self.buffer.len() && self.buffer.is_exclusive()
    }

    /// Offset into the buffer.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the slice is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A backend's stream state.
pub trait StreamHandle: Any + Send + Sync + fmt::Debug {
    /// The device the stream belongs to.
    fn device(&self) -> DeviceId;
    /// The backend's concrete type.
    fn as_any(&self) -> &dyn Any;
}

/// An ordered queue of device work. Work on one stream runs in order; work on two streams
/// is ordered only through events.
#[derive(Clone, Debug)]
pub struct Stream {
    inner: Arc<dyn StreamHandle>,
}

impl Stream {
    /// Wraps a backend stream.
    pub fn new(inner: Arc<dyn StreamHandle>) -> Self {
        Self { inner }
    }

    /// The device.
    pub fn device(&self) -> DeviceId {
        self.inner.device()
    }

    /// The backend's concrete stream, if it is a `T`.
    pub fn downcast_ref<T: 'static>(&self) -> Option<&T> {
        self.inner.as_any().downcast_ref::<T>()
    }

    /// Whether two handles are one stream.
    pub fn same_stream(&self, other: &Stream) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

/// A backend's event state.
pub trait EventHandle: Any + Send + Sync + fmt::Debug {
    /// The device the event belongs to.
    fn device(&self) -> DeviceId;
    /// The backend's concrete type.
    fn as_any(&self) -> &dyn Any;
}

/// A point in a stream's work, recorded once; other streams and the host can wait for it.
#[derive(Clone, Debug)]
pub struct Event {
    inner: Arc<dyn EventHandle>,
}

impl Event {
    /// Wraps a backend event.
    pub fn new(inner: Arc<dyn EventHandle>) -> Self {
        Self { inner }
    }

    /// The device.
    pub fn device(&self) -> DeviceId {
        self.inner.device()
    }

    /// The backend's concrete event, if it is a `T`.
    pub fn downcast_ref<T: 'static>(&self) -> Option<&T> {
        self.inner.as_any().downcast_ref::<T>()
    }
}

/// Memory figures of a device, each labelled by its source.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryInfo {
    /// Bytes in live allocations (exact allocator accounting).
    pub allocated: u64,
    /// Peak of `allocated` since the last [`Device::reset_peak`].
    pub peak_allocated: u64,
    /// Bytes the allocator holds, live or cached (exact).
    pub reserved: u64,
    /// Device capacity.
    pub capacity: u64,
    /// Free bytes according to the driver (sampled), where there is a driver.
    pub driver_free: Option<u64>,
    /// Total bytes according to the driver, where there is a driver.
    pub driver_total: Option<u64>,
    /// Pinned host bytes handed out by this device.
    pub pinned_host: u64,
    /// Of `pinned_host`, bytes the device keeps as a cache (ddo-cuda's upload buffers, and
    /// host memory handed back through [`Device::release_host`]) and gives back when
    /// [`Device::alloc_pinned`] or [`Device::register_host`] needs their room.
    pub pinned_cached: u64,
    /// Limit on pinned host bytes.
    pub pinned_limit: u64,
    /// Most pinned host bytes held at once since the device was made, or since the host
    /// backend's `reset_pinned_peak` (registrations and its cache included; exact, from its
    /// pinned ledger).
    pub pinned_peak: u64,
}

impl MemoryInfo {
    /// What the device has free: the driver's figure where there is a driver, else capacity
    /// minus the allocator's exact accounting.
    pub fn free_bytes(&self) -> u64 {
        self.driver_free
            .unwrap_or_else(|| self.capacity.saturating_sub(self.allocated))
    }

    /// Pinned bytes [`Device::alloc_pinned`] can still hand out: the limit less what is
    /// pinned, counting the device's cached pinned bytes as room (they give way).
    pub fn pinned_room(&self) -> u64 {
        self.pinned_limit
            .saturating_sub(self.pinned_host.saturating_sub(self.pinned_cached))
    }
}

/// The memory and transfer plane of one execution device.
///
/// Copies are asynchronous with respect to the host when their host side is pinned;
/// from pageable or mapped memory they return only when done (as CUDA does), except that a
/// backend may stage a pageable host→device copy in pinned memory of its own and queue it
/// like a pinned one (ddo-cuda's upload buffers): the source is read before the call
/// returns either way. Work on a stream runs in order; [`Device::wait_event`] orders work
/// across streams.
pub trait Device: Send + Sync + fmt::Debug {
    /// The device's identity.
    fn id(&self) -> DeviceId;

    /// Which allocator serves allocations.
    fn allocator(&self) -> AllocatorKind;

    /// Device bytes one [`Ops::conv2d`] of an input of `elems`
    /// elements per channel (batch × height × width) with `channels` input channels,
    /// `filters` output channels and a `kernel × kernel` window allocates besides its output
    /// while it runs (a layout copy of its input, repacked weights, im2col chunks), for
    /// memory estimates. The host backend convolves without any: 0.
    fn conv2d_scratch_bytes(
        &self,
        elems: usize,
        channels: usize,
        filters: usize,
        kernel: usize,
        dtype: crate::DType,
    ) -> u64 {
        let _ = (elems, channels, filters, kernel, dtype);
        0
    }

    /// Device bytes the backend uses outside tensors while models run (library
    /// workspaces, kernel scratch), which memory planners keep free beside activations.
    /// The host backend keeps its scratch in host memory: 0.
    fn scratch_bytes(&self) -> u64 {
        0
    }

    /// Allocates `bytes` of device memory (contents unspecified). Fails with
    /// [`CoreError::OutOfMemory`] when the device cannot satisfy it.
    fn alloc(&self, bytes: usize) -> Result<DeviceBuffer>;

    /// Frees `buffer` once `stream` reaches this point (stream-ordered free): work already
    /// queued on `stream` may still read it. Other handles to the buffer keep it alive.
    fn release_after(&self, buffer: DeviceBuffer, stream: &Stream) -> Result<()>;

    /// Allocates `bytes` of pinned host memory, counted against the pinned limit.
    fn alloc_pinned(&self, bytes: usize) -> Result<HostBuffer>;

    /// Page-locks the bytes of `buffer`, a checkpoint-mapped buffer, where they are (no
    /// copy; read-only, as the mapping is) and returns a registered view of the same bytes
    /// ([`HostBuffer::registered`], of kind [`Pinned`](crate::HostMemoryKind::Pinned)):
    /// copies from it run asynchronously at pinned speed. The locked range is `buffer`'s
    /// rounded out to [`REGISTER_ALIGN`](crate::host_memory::REGISTER_ALIGN) blocks of the mapping
    /// ([`register_span`](crate::host_memory::register_span)); its bytes count against the pinned
    /// limit exactly like [`Device::alloc_pinned`]'s ([`CoreError::PinnedLimit`] over it),
    /// until the view's last handle drops and the backend unregisters it.
    ///
    /// [`CoreError::HostRegisterUnsupported`] (whose hint names the pinned home instead):
    /// the default, for backends that cannot do this; every backend for memory that is not
    /// a checkpoint mapping, and for a range overlapping a live registration (a page is
    /// registered once); the driver's "not supported" or "not permitted" answers.
    fn register_host(&self, buffer: &HostBuffer) -> Result<HostBuffer> {
        let _ = buffer;
        Err(CoreError::HostRegisterUnsupported {
            device: self.id().to_string(),
            reason: "this backend cannot page-lock existing host memory".into(),
        })
    }

    /// Lets go of `buffer`, a handle to pinned or registered host memory that no queued
    /// copy will read again. A backend whose unpinning stalls the device may keep it
    /// pinned, counted in its pinned figures, until [`Device::unpin_released`] (or until
    /// pinned memory is asked for that needs the room): the CUDA driver's
    /// `cuMemHostUnregister` waits for the device's queued work, so unregistering 500 ranges
    /// in a phase boundary or between a forward's kernels costs 0.1–0.3 s of an H200's time.
    /// The default drops it here.
    fn release_host(&self, buffer: HostBuffer) {
        drop(buffer);
    }

    /// Unpins what [`Device::release_host`] kept; returns the bytes. Call it where the
    /// device has nothing queued (after a pipeline's last phase, beside its output); also
    /// done by [`Device::settle`]. The default has nothing to unpin.
    fn unpin_released(&self) -> u64 {
        0
    }

    /// The host calls into this device's driver or libraries that took long, started at or
    /// after `since`, each timed from it ([`ddo_metrics::HostWait`]): what held a program
    /// that the device waited for. None where the backend keeps none (the host backend).
    fn host_waits_since(&self, since: std::time::Instant) -> Vec<ddo_metrics::HostWait> {
        let _ = since;
        Vec::new()
    }

    /// The host time this device's first calls of each shape took so far (library plans,
    /// kernel modules): what a phase's first forward pays beyond a steady one. Zeros where
    /// the backend builds nothing per shape (the host backend).
    fn setup_calls(&self) -> SetupCalls {
        SetupCalls::default()
    }

    /// Host ranges this device has page-locked so far: [`Device::register_host`] calls that
    /// pinned pages (a range reused from those [`Device::release_host`] kept is not one).
    /// How a long-lived process shows a request pinned nothing again; 0 where the backend
    /// cannot register.
    fn host_registrations(&self) -> u64 {
        0
    }

    /// The stream compute runs on.
    fn compute_stream(&self) -> Stream;

    /// A new stream (for copies that overlap compute).
    fn create_stream(&self) -> Result<Stream>;

    /// Whether [`Device::create_stream`] gives streams that run concurrently.
    fn supports_streams(&self) -> bool {
        true
    }

    /// Copies `src` into `dst` on `stream`.
    fn copy_h2d(&self, src: &HostSlice, dst: &DeviceSlice, stream: &Stream) -> Result<()>;

    /// Copies `src` into `dst` (owned host memory) on `stream`.
    fn copy_d2h(&self, src: &DeviceSlice, dst: &HostSlice, stream: &Stream) -> Result<()>;

    /// Copies between two device ranges on `stream`.
    fn copy_d2d(&self, src: &DeviceSlice, dst: &DeviceSlice, stream: &Stream) -> Result<()>;

    /// Device bytes of scratch a stream's lossless decodes share
    /// ([`Device::decode_lossless`]); 0 where the backend needs none.
    fn lossless_scratch_bytes(&self) -> usize {
        0
    }

    /// Queues on `stream` the decode of one unit coded by `ddo_codec` (its validated
    /// `header`, the coded bytes in `src`) into `dst`, which then holds the unit's words
    /// exactly. `scratch` ([`Device::lossless_scratch_bytes`], cleared by
    /// [`Device::check_lossless`] before first use) collects what the decodes find wrong; a
    /// corrupt unit is reported by the next [`Device::check_lossless`] on `stream`. A
    /// backend without a decoder refuses (the default).
    fn decode_lossless(
        &self,
        header: &ddo_codec::UnitHeader,
        src: &DeviceSlice,
        dst: &DeviceSlice,
        scratch: &DeviceSlice,
        stream: &Stream,
    ) -> Result<()> {
        let _ = (header, src, dst, scratch, stream);
        Err(CoreError::Backend {
            device: self.id().to_string(),
            message: "this backend has no lossless decoder; stream with compress=none".into(),
        })
    }

    /// Waits for `stream`, then reports a unit that the lossless decodes queued on it with
    /// `scratch` since the last check found corrupt ([`CoreError::LosslessDecode`]), and
    /// clears `scratch` for the next ones.
    fn check_lossless(&self, scratch: &DeviceSlice, stream: &Stream) -> Result<()> {
        let _ = scratch;
        self.synchronize_stream(stream)
    }

    /// Records an event at the current end of `stream`.
    fn record_event(&self, stream: &Stream) -> Result<Event>;

    /// Records an event that carries a timestamp, for timelines
    /// ([`Device::event_elapsed_ns`]); a backend without timestamps records a plain event.
    fn record_timed_event(&self, stream: &Stream) -> Result<Event> {
        self.record_event(stream)
    }

    /// Nanoseconds from `start` to `end` (negative when `end` came first), both recorded by
    /// [`Device::record_timed_event`]; waits for both to complete. `None` where the backend
    /// keeps no timestamps.
    fn event_elapsed_ns(&self, start: &Event, end: &Event) -> Result<Option<i64>> {
        let _ = (start, end);
        Ok(None)
    }

    /// Makes later work on `stream` wait until `event` has completed.
    fn wait_event(&self, stream: &Stream, event: &Event) -> Result<()>;

    /// Whether `event` has completed (never blocks).
    fn event_complete(&self, event: &Event) -> Result<bool>;

    /// Blocks the host until `event` has completed.
    fn synchronize_event(&self, event: &Event) -> Result<()>;

    /// Blocks the host until all work queued on `stream` so far has completed.
    fn synchronize_stream(&self, stream: &Stream) -> Result<()>;

    /// Blocks the host until all work on every stream of the device has completed.
    fn synchronize(&self) -> Result<()>;

    /// Memory figures now.
    fn memory_info(&self) -> MemoryInfo;

    /// Starts a new peak measurement at the current allocation level.
    fn reset_peak(&self);

    /// Returns idle cached blocks to the driver; the bytes returned. Never touches the
    /// native VMM pool.
    fn empty_cache(&self) -> Result<u64>;

    /// The device's compute plane, when it has one (a transfer-only wrapper may not).
    fn ops(&self) -> Option<&dyn Ops> {
        None
    }

    /// Drops what the backend keeps per operand shape (the CUDA backend: its cuBLASLt GEMM
    /// plans and its cuDNN attention plans), once the work queued so far is done; the next
    /// op of each shape plans again. A long-lived process (`ddo serve`) calls it when a
    /// request's size differs from the last, so what it holds follows the shape it runs, not
    /// every shape it ever ran. The default holds nothing per shape.
    fn forget_shape_plans(&self) -> Result<()> {
        Ok(())
    }

    /// A hint that attention over `q [b, h, lq, d]`, `k [b, h, lk, d]`, `v [b, h, lk, dv]`
    /// (in `dtype`), with an additive mask of the given shape (broadcastable to
    /// `[b, h, lq, lk]`) and dtype if any, will run soon as [`Ops::attention_tokens`] (the
    /// models' call, output in token order): the backend may prepare for it in
    /// the background (the CUDA backend builds its cuDNN plan). Results never depend on it;
    /// an invalid shape is ignored here and refused by the op.
    fn prepare_attention(
        &self,
        q: &[usize],
        k: &[usize],
        v: &[usize],
        mask: Option<(&[usize], DType)>,
        dtype: DType,
    ) {
        let _ = (q, k, v, mask, dtype);
    }

    /// Runs each of `calls` once (with operands of zeros, results dropped) before a program
    /// runs them, leaving out those whose operands and product would pass `max_bytes`, and
    /// returns how many ran: a backend that loads a kernel at the first call of a shape
    /// (the CUDA backend's cuBLASLt) does it here instead of inside a phase's first
    /// forward, where the load holds the host until the device has drained
    /// ([`crate::linear_calls`]). The memory it takes is given back before it returns.
    /// Results never depend on it. The default runs nothing (the host backend loads no
    /// kernels).
    fn prepare_linears(&self, calls: &[crate::LinearCall], max_bytes: u64) -> Result<usize> {
        let _ = (calls, max_bytes);
        Ok(0)
    }

    /// Waits, at most `timeout`, for what the backend prepares in the background (the CUDA
    /// backend's cuDNN attention plans), and unpins what [`Device::release_host`] kept, so
    /// what follows runs in the steady state and the pinned figures are final; whether
    /// nothing is pending now. Benchmarks call it after their warm-up.
    fn settle(&self, timeout: std::time::Duration) -> Result<bool> {
        let _ = timeout;
        Ok(true)
    }

    /// Starts a per-op profile of this device's [`Ops`] ([`crate::profile`]); `false`
    /// where the backend keeps none.
    fn begin_op_profile(&self) -> bool {
        false
    }

    /// Ends the profile [`Device::begin_op_profile`] started: waits for its ops and returns
    /// their device time by op class. `None` when none was started or the backend keeps none.
    fn end_op_profile(&self) -> Result<Option<crate::profile::OpProfile>> {
        Ok(None)
    }

    /// The native VMM pool's exact figures (peaks since the last [`Device::reset_peak`]),
    /// when the native allocator serves this device; `None` otherwise.
    fn native_pool_figures(&self) -> Option<NativePoolFigures> {
        None
    }

    /// Unmaps and returns to the driver every physical chunk of the native VMM pool that
    /// holds no live allocation, and reports the bytes, checked against the driver's free
    /// figure. Only at a quiescent boundary: with work queued on any stream it is refused
    /// with [`CoreError::NotQuiescent`] and releases nothing. Without the native allocator,
    /// [`CoreError::NativeAllocatorNotInstalled`]. Never called by routes on their own.
    fn release_native_idle_cache(&self) -> Result<IdleCacheRelease> {
        Err(CoreError::NativeAllocatorNotInstalled {
            device: self.id().to_string(),
        })
    }
}

/// The compute plane of `device`, or a typed error naming the device.
pub fn ops_of(device: &dyn Device) -> Result<&dyn Ops> {
    device.ops().ok_or_else(|| CoreError::Backend {
        device: device.id().to_string(),
        message: "this device has no compute plane (Ops); run models on a backend device".into(),
    })
}

/// Copies `bytes` (pageable, so the copy is complete when this returns) to a new device
/// buffer on `stream`.
pub fn upload(device: &dyn Device, bytes: &[u8], stream: &Stream) -> Result<DeviceBuffer> {
    let dst = device.alloc(bytes.len())?;
    let src = HostBuffer::pageable_from(bytes);
    device.copy_h2d(&src.slice_all(), &dst.slice_all(), stream)?;
    Ok(dst)
}

/// Copies a device range back to a new vector, waiting for `stream` to finish it.
pub fn download(device: &dyn Device, src: &DeviceSlice, stream: &Stream) -> Result<Vec<u8>> {
    let dst = HostBuffer::pageable_zeroed(src.len());
    device.copy_d2h(src, &dst.slice_all(), stream)?;
    device.synchronize_stream(stream)?;
    Ok(dst.with_bytes(<[u8]>::to_vec))
}

/// Status bit of a lossless decode that met an invalid code or a malformed unit.
pub const LOSSLESS_BAD_CODE: u32 = 1;
/// Status bit of a lossless decode whose chunk stream was not consumed exactly.
pub const LOSSLESS_BAD_STREAM: u32 = 2;
/// Status bit of a lossless decode whose output's checksum is not the unit's.
pub const LOSSLESS_BAD_CHECKSUM: u32 = 4;

/// The error for the status bits a backend's lossless decodes left
/// ([`Device::check_lossless`]); `Ok` for none. One reading for every backend.
pub fn lossless_status(device: &str, bits: u32) -> Result<()> {
    if bits == 0 {
        return Ok(());
    }
    let mut what = Vec::new();
    if bits & LOSSLESS_BAD_CODE != 0 {
        what.push("an invalid code or a malformed unit");
    }
    if bits & LOSSLESS_BAD_STREAM != 0 {
        what.push("a chunk stream not consumed exactly");
    }
    if bits & LOSSLESS_BAD_CHECKSUM != 0 {
        what.push("decoded words whose checksum is not the unit's");
    }
    if what.is_empty() {
        what.push("an unknown status");
    }
    Err(CoreError::LosslessDecode {
        device: device.to_string(),
        detail: format!("{} (status {bits:#x})", what.join(", ")),
    })
}

#[cfg(test)]
mod tests {
    use std::any::Any;
    use std::sync::Arc;

    use super::{DeviceAllocation, DeviceBuffer, DeviceId, DeviceKind, MemoryInfo, SetupCalls};

    /// A stretch's first calls are the cumulative figures' difference, each field apart, and
    /// never negative; the seconds add the four times.
    #[test]
    fn setup_calls_since_an_earlier_reading() {
        let earlier = SetupCalls {
            plans_built: 3,
            plan_build_ns: 1_000,
            plan_wait_ns: 0,
            kernel_loads: 2,
            kernel_load_ns: 500,
            device_allocs: 1,
            device_alloc_ns: 100,
        };
        let now = SetupCalls {
            plans_built: 10,
            plan_build_ns: 4_000,
            plan_wait_ns: 2_000_000_000,
            kernel_loads: 2,
            kernel_load_ns: 400,
            device_allocs: 4,
            device_alloc_ns: 1_100,
        };
        let d = now.since(&earlier);
        assert_eq!(
            d,
            SetupCalls {
                plans_built: 7,
                plan_build_ns: 3_000,
                plan_wait_ns: 2_000_000_000,
                kernel_loads: 0,
                kernel_load_ns: 0,
                device_allocs: 3,
                device_alloc_ns: 1_000,
            }
        );
        assert!((d.seconds() - 2.000_004).abs() < 1e-12);
        assert_eq!(earlier.since(&now).plans_built, 0);
    }

    #[derive(Debug)]
    struct Bytes(usize);

    impl DeviceAllocation for Bytes {
        fn len(&self) -> usize {
            self.0
        }
        fn device(&self) -> DeviceId {
            DeviceId {
                kind: DeviceKind::Host,
                ordinal: 0,
            }
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    #[test]
    fn a_weak_buffer_knows_its_buffer_while_it_lives_and_blocks_writes_in_place() {
        let mut a = DeviceBuffer::new(Arc::new(Bytes(64)));
        let b = DeviceBuffer::new(Arc::new(Bytes(64)));
        assert!(a.is_exclusive());
        let weak = a.downgrade();
        assert!(weak.is(&a) && weak.is_alive());
        assert!(!weak.is(&b));
        assert!(weak.is(&a.clone()));
        // While the weak handle stands, no op may reuse the bytes in place.
        assert!(!a.is_exclusive());
        drop(a);
        assert!(!weak.is_alive());
        // A buffer made after the first is gone is never taken for it.
        let c = DeviceBuffer::new(Arc::new(Bytes(64)));
        assert!(!weak.is(&c) && !weak.is(&b));
    }

    #[test]
    fn pinned_room_counts_cached_pinned_bytes_as_room() {
        let info = MemoryInfo {
            pinned_host: 700,
            pinned_cached: 200,
            pinned_limit: 1000,
            ..MemoryInfo::default()
        };
        assert_eq!(info.pinned_room(), 500);
        let full = MemoryInfo {
            pinned_cached: 0,
            ..info
        };
        assert_eq!(full.pinned_room(), 300);
        // Over the limit (a smaller limit set later): no room, not an underflow.
        let over = MemoryInfo {
            pinned_limit: 400,
            ..full
        };
        assert_eq!(over.pinned_room(), 0);
    }
}
