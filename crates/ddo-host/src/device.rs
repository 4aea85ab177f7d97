//! The host backend's device, [`HostDevice`]: a [`Device`] whose "device memory" is host
//! memory with a capacity, so out-of-memory is real; exact current/peak accounting; pinned
//! host memory and registrations; and copies queued on the asynchronous copy engine
//! ([`crate::copy_engine`], one worker thread per stream), so copy/compute overlap and
//! missing waits behave as they would on a GPU.
//!
//! Compute on this backend runs on the calling thread after the compute stream has drained
//! (see [`HostDevice::host_compute_fence`]); copies on other streams keep running
//! meanwhile. An optional simulated link bandwidth makes copies take time, so that a
//! missing `wait_event` reads stale bytes in tests instead of winning a race by luck.

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};

use ddo_core::device::{
    AllocatorKind, Device, DeviceAllocation, DeviceBuffer, DeviceId, DeviceKind, DeviceSlice,
    Event, LOSSLESS_BAD_CHECKSUM, LOSSLESS_BAD_CODE, LOSSLESS_BAD_STREAM, MemoryInfo, Stream,
    lossless_status,
};
use ddo_core::error::{CoreError, Result};
use ddo_core::host_memory::{
    AlignedBytes, HostBuffer, HostMemoryKind, HostSlice, PinnedLedger, PinnedRegistration,
    register_target,
};
use ddo_core::ops::Ops;
use ddo_core::released_host::{ReleasedHost, pinned_bytes_of};
use ddo_metrics::{IdleCacheRelease, NativePoolFigures};

use crate::copy_engine::{HostEvent, HostStream, Job};

/// Settings of a [`HostDevice`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HostDeviceConfig {
    /// Ordinal (`host:N`).
    pub ordinal: u32,
    /// Device memory capacity in bytes.
    pub capacity: u64,
    /// Pinned host memory limit in bytes.
    pub pinned_limit: u64,
    /// The allocator this device reports. Chosen at construction, before anything is
    /// allocated: the host counterpart of installing the native allocator in a fresh process.
    pub allocator: AllocatorKind,
    /// Simulated link bandwidth for copies (bytes per second); `None` copies at memory speed.
    pub link_bytes_per_sec: Option<f64>,
}

impl Default for HostDeviceConfig {
    fn default() -> Self {
        Self {
            ordinal: 0,
            capacity: 1 << 30,
            pinned_limit: 1 << 30,
            allocator: AllocatorKind::Caching,
            link_bytes_per_sec: None,
        }
    }
}

struct Ledger {
    id: DeviceId,
    // Unique per `HostDevice` instance: two devices may share an ordinal in tests.
    instance: u64,
    capacity: u64,
    allocated: AtomicU64,
    peak: AtomicU64,
}

impl Ledger {
    fn reserve(&self, bytes: u64) -> Result<()> {
        let mut current = self.allocated.load(Ordering::Acquire);
        loop {
            let next = current.saturating_add(bytes);
            if next > self.capacity {
                return Err(CoreError::OutOfMemory {
                    device: self.id.to_string(),
                    requested: bytes,
                    allocated: current,
                    capacity: self.capacity,
                });
            }
            match self.allocated.compare_exchange_weak(
                current,
                next,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    self.peak.fetch_max(next, Ordering::AcqRel);
                    return Ok(());
                }
                Err(actual) => current = actual,
            }
        }
    }

    fn release(&self, bytes: u64) {
        self.allocated.fetch_sub(bytes, Ordering::AcqRel);
    }
}

/// Bytes of the host decoder's status scratch ([`Device::lossless_scratch_bytes`]).
const HOST_LOSSLESS_SCRATCH: usize = 16;

/// One allocation of the host backend.
pub struct HostAllocation {
    bytes: RwLock<AlignedBytes>,
    len: usize,
    ledger: Arc<Ledger>,
}

impl HostAllocation {
    /// Runs `f` over the allocation's bytes. Compute reads device memory through this,
    /// after [`HostDevice::host_compute_fence`].
    pub fn with_bytes<R>(&self, f: impl FnOnce(&[u8]) -> R) -> R {
        f(self.bytes.read().as_slice())
    }

    /// Runs `f` over the allocation's bytes mutably. Host compute writes a fresh output
    /// through this, before any queued work can refer to it.
    pub(crate) fn with_bytes_mut<R>(&self, f: impl FnOnce(&mut [u8]) -> R) -> R {
        f(self.bytes.write().as_mut_slice())
    }
}

impl Drop for HostAllocation {
    fn drop(&mut self) {
        self.ledger.release(self.len as u64);
    }
}

impl fmt::Debug for HostAllocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostAllocation({} B on {})", self.len, self.ledger.id)
    }
}

impl DeviceAllocation for HostAllocation {
    fn len(&self) -> usize {
        self.len
    }
    fn device(&self) -> DeviceId {
        self.ledger.id
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The address ranges of a device's live host registrations
/// ([`Device::register_host`]): a second registration overlapping one of them is refused
/// ([`CoreError::HostRegisterUnsupported`]), as CUDA refuses it
/// (`CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED`), and so is a copy from a checkpoint range
/// that is only partly page-locked, as CUDA refuses it (`CUDA_ERROR_INVALID_VALUE`).
#[derive(Debug, Default)]
struct Registrations(Mutex<Vec<std::ops::Range<usize>>>);

/// The backend token of one host registration: forgets its range on drop.
struct RegistrationToken {
    registry: Arc<Registrations>,
    range: std::ops::Range<usize>,
}

impl Drop for RegistrationToken {
    fn drop(&mut self) {
        let mut live = self.registry.0.lock();
        if let Some(i) = live.iter().position(|r| *r == self.range) {
            live.swap_remove(i);
        }
    }
}

/// The host backend's device.
pub struct HostDevice {
    /// The ops [`Device::ops`] hands out: this device's, each through a per-op profiler.
    profiled: ddo_core::ProfiledOps,
    config: HostDeviceConfig,
    ledger: Arc<Ledger>,
    pinned: Arc<PinnedLedger>,
    registrations: Arc<Registrations>,
    /// Registered checkpoint ranges handed back by [`Device::release_host`], kept pinned
    /// until [`Device::unpin_released`] and reused when the same range is registered again,
    /// as the CUDA device keeps them.
    released: ReleasedHost,
    /// [`Device::host_registrations`].
    registered: AtomicU64,
    compute: Stream,
    streams: Mutex<Vec<std::sync::Weak<HostStream>>>,
    next_stream: AtomicU64,
}

impl HostDevice {
    /// A device with `config`.
    pub fn new(config: HostDeviceConfig) -> Result<Arc<Self>> {
        let id = DeviceId {
            kind: DeviceKind::Host,
            ordinal: config.ordinal,
        };
        if config.capacity == 0 {
            return Err(CoreError::InvalidOption {
                option: "capacity".into(),
                value: "0".into(),
                hint: "a host device needs a positive capacity in bytes".into(),
            });
        }
        if config
            .link_bytes_per_sec
            .is_some_and(|b| b.is_nan() || b <= 0.0)
        {
            return Err(CoreError::InvalidOption {
                option: "link_bytes_per_sec".into(),
                value: format!("{:?}", config.link_bytes_per_sec),
                hint: "give a positive bandwidth, or None for memory speed".into(),
            });
        }
        static NEXT_INSTANCE: AtomicU64 = AtomicU64::new(1);
        let instance = NEXT_INSTANCE.fetch_add(1, Ordering::Relaxed);
        let compute = Arc::new(HostStream::spawn(id, instance, 0)?);
        let streams = Mutex::new(vec![Arc::downgrade(&compute)]);
        Ok(Arc::new_cyclic(|me: &std::sync::Weak<Self>| Self {
            profiled: ddo_core::ProfiledOps::new(me.clone()),
            ledger: Arc::new(Ledger {
                id,
                instance,
                capacity: config.capacity,
                allocated: AtomicU64::new(0),
                peak: AtomicU64::new(0),
            }),
            pinned: PinnedLedger::new(config.pinned_limit),
            registrations: Arc::default(),
            released: ReleasedHost::new(),
            registered: AtomicU64::new(0),
            compute: Stream::new(compute),
            streams,
            next_stream: AtomicU64::new(1),
            config,
        }))
    }

    /// Reserves `bytes` on the pinned ledger with `token`, first letting go of the released
    /// ranges kept pinned when `bytes` more would pass the limit (they are a cache: they give
    /// way to pinned memory asked for, as on the CUDA device).
    fn reserve_pinned(
        &self,
        bytes: u64,
        token: Option<Box<dyn Any + Send + Sync>>,
    ) -> Result<PinnedRegistration> {
        if self.pinned.pinned().saturating_add(bytes) > self.pinned.limit() {
            drop(self.released.take_all());
        }
        self.pinned.reserve(bytes, token)
    }

    /// A device with `capacity` bytes and default settings otherwise.
    pub fn with_capacity(capacity: u64) -> Result<Arc<Self>> {
        Self::new(HostDeviceConfig {
            capacity,
            ..HostDeviceConfig::default()
        })
    }

    /// The device's settings.
    pub fn config(&self) -> &HostDeviceConfig {
        &self.config
    }

    /// Starts [`MemoryInfo::pinned_peak`] again from what is pinned now.
    pub fn reset_pinned_peak(&self) {
        self.pinned.reset_peak();
    }

    /// Makes host-side compute safe to run "on" `stream`: blocks until all work queued on
    /// it so far (copies, event waits) has run. Host compute is launched synchronously, so
    /// this is the host counterpart of enqueuing a kernel behind that work.
    pub fn host_compute_fence(&self, stream: &Stream) -> Result<()> {
        self.host_stream(stream)?.synchronize()
    }

    /// The host allocation behind a device buffer of this device.
    pub fn allocation<'a>(&self, buffer: &'a DeviceBuffer) -> Result<&'a HostAllocation> {
        buffer
            .downcast_ref::<HostAllocation>()
            .filter(|a| Arc::ptr_eq(&a.ledger, &self.ledger))
            .ok_or_else(|| CoreError::WrongDevice {
                what: "device buffer",
                expected: self.id().to_string(),
                found: buffer.device().to_string(),
            })
    }

    fn host_stream<'a>(&self, stream: &'a Stream) -> Result<&'a HostStream> {
        stream
            .downcast_ref::<HostStream>()
            .filter(|s| s.instance == self.ledger.instance)
            .ok_or_else(|| CoreError::WrongDevice {
                what: "stream",
                expected: self.id().to_string(),
                found: stream.device().to_string(),
            })
    }

    fn host_event<'a>(&self, event: &'a Event) -> Result<&'a HostEvent> {
        event
            .downcast_ref::<HostEvent>()
            .filter(|e| e.instance == self.ledger.instance)
            .ok_or_else(|| CoreError::WrongDevice {
                what: "event",
                expected: self.id().to_string(),
                found: event.device().to_string(),
            })
    }

    fn link_delay(&self, bytes: usize) -> Option<Duration> {
        self.config
            .link_bytes_per_sec
            .map(|bw| Duration::from_secs_f64(bytes as f64 / bw))
    }

    /// Queues a copy job; blocks until it ran when the host side is not pinned.
    fn submit_copy(&self, stream: &HostStream, host_pinned: bool, job: Job) -> Result<()> {
        let ticket = stream.submit(job)?;
        if host_pinned {
            Ok(())
        } else {
            stream.wait_for(ticket)
        }
    }
}

impl fmt::Debug for HostDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "HostDevice({}, {} of {} B allocated)",
            self.id(),
            self.ledger.allocated.load(Ordering::Relaxed),
            self.config.capacity
        )
    }
}

fn check_len(what: &str, expected: usize, actual: usize) -> Result<()> {
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

impl Device for HostDevice {
    fn id(&self) -> DeviceId {
        self.ledger.id
    }

    fn allocator(&self) -> AllocatorKind {
        self.config.allocator
    }

    fn alloc(&self, bytes: usize) -> Result<DeviceBuffer> {
        self.ledger.reserve(bytes as u64)?;
        Ok(DeviceBuffer::new(Arc::new(HostAllocation {
            bytes: RwLock::new(AlignedBytes::try_zeroed(bytes).inspect_err(|_| {
                self.ledger.release(bytes as u64);
            })?),
            len: bytes,
            ledger: Arc::clone(&self.ledger),
        })))
    }

    fn release_after(&self, buffer: DeviceBuffer, stream: &Stream) -> Result<()> {
        self.allocation(&buffer)?;
        let s = self.host_stream(stream)?;
        s.submit(Box::new(move || {
            drop(buffer);
            Ok(())
        }))?;
        Ok(())
    }

    fn alloc_pinned(&self, bytes: usize) -> Result<HostBuffer> {
        let registration = self.reserve_pinned(bytes as u64, None)?;
        Ok(HostBuffer::owned(
            AlignedBytes::zeroed(bytes),
            Some(registration),
        ))
    }

    /// Page-locking is simulated: the registered range is counted against the pinned limit
    /// and refused when it overlaps a live registration of this device; copies from the
    /// view are pinned copies (asynchronous, at the simulated link speed). A range handed
    /// back by [`Device::release_host`] is reused as it is; a kept one overlapping the range
    /// is let go first (the CUDA device's rule).
    fn register_host(&self, buffer: &HostBuffer) -> Result<HostBuffer> {
        if let Some(kept) = self.released.reuse(buffer) {
            return Ok(kept);
        }
        let (map, span) = register_target(&self.id().to_string(), buffer)?;
        drop(self.released.take_overlapping(&map, &span));
        let base = map.bytes().as_ptr() as usize;
        let range = base + span.start..base + span.end;
        let token = {
            let mut live = self.registrations.0.lock();
            if !range.is_empty()
                && let Some(other) = live
                    .iter()
                    .find(|r| r.start < range.end && range.start < r.end)
            {
                return Err(CoreError::HostRegisterUnsupported {
                    device: self.id().to_string(),
                    reason: format!(
                        "bytes {}..{} of {} overlap a live registration ({} B in common), and a page \
                         is registered once",
                        span.start,
                        span.end,
                        map.path().display(),
                        other.end.min(range.end) - other.start.max(range.start)
                    ),
                });
            }
            live.push(range.clone());
            RegistrationToken {
                registry: Arc::clone(&self.registrations),
                range,
            }
        };
        // Over the limit the token drops here and forgets the range.
        let registration = self.reserve_pinned(span.len() as u64, Some(Box::new(token)))?;
        self.registered.fetch_add(1, Ordering::Relaxed);
        HostBuffer::registered(buffer.clone(), registration)
    }

    /// Keeps a registered checkpoint range pinned until [`Device::unpin_released`] (a later
    /// registration of the same range reuses it); drops anything else now.
    fn release_host(&self, buffer: HostBuffer) {
        if buffer.registered_base().is_some() {
            self.released.keep(buffer);
        }
    }

    fn unpin_released(&self) -> u64 {
        let released = self.released.take_all();
        pinned_bytes_of(&released)
    }

    fn host_registrations(&self) -> u64 {
        self.registered.load(Ordering::Relaxed)
    }

    fn compute_stream(&self) -> Stream {
        self.compute.clone()
    }

    fn create_stream(&self) -> Result<Stream> {
        let ordinal = self.next_stream.fetch_add(1, Ordering::Relaxed);
        let stream = Arc::new(HostStream::spawn(self.id(), self.ledger.instance, ordinal)?);
        let mut streams = self.streams.lock();
        streams.retain(|w| w.strong_count() > 0);
        streams.push(Arc::downgrade(&stream));
        Ok(Stream::new(stream))
    }

    fn copy_h2d(&self, src: &HostSlice, dst: &DeviceSlice, stream: &Stream) -> Result<()> {
        check_len("host->device copy", dst.len(), src.len())?;
        self.allocation(dst.buffer())?;
        if let Some((map, range)) = src.mapped_range()
            && !range.is_empty()
        {
            let base = map.bytes().as_ptr() as usize;
            let (lo, hi) = (base + range.start, base + range.end);
            let live = self.registrations.0.lock();
            let overlaps = live.iter().any(|r| r.start < hi && lo < r.end);
            if overlaps && !live.iter().any(|r| r.start <= lo && hi <= r.end) {
                return Err(CoreError::Backend {
                    device: self.id().to_string(),
                    message: format!(
                        "host->device copy from bytes {}..{} of {}, which are only partly \
                         page-locked (CUDA refuses such a copy with CUDA_ERROR_INVALID_VALUE); \
                         copy from the registered view, or from a pageable copy of the bytes",
                        range.start,
                        range.end,
                        map.path().display()
                    ),
                });
            }
        }
        let s = self.host_stream(stream)?;
        let pinned = src.kind() == HostMemoryKind::Pinned;
        // A coded checkpoint tensor is decoded now, so a unit that does not decode is this
        // call's typed error (its bytes never change, so reading them early reads the same).
        let decoded = match src.buffer().coded_source() {
            Some(_) => Some(src.try_with_bytes(<[u8]>::to_vec)?),
            None => None,
        };
        let (src, dst) = (src.clone(), dst.clone());
        let delay = self.link_delay(src.len());
        self.submit_copy(
            s,
            pinned,
            Box::new(move || {
                // Read at the start, land at the end of the link time (see copy_d2h).
                let snapshot = decoded.unwrap_or_else(|| src.to_vec());
                if let Some(d) = delay {
                    std::thread::sleep(d);
                }
                let alloc = dst
                    .buffer()
                    .downcast_ref::<HostAllocation>()
                    .ok_or("destination is not a host allocation")?;
                let range = dst.offset()..dst.offset() + dst.len();
                alloc.bytes.write().as_mut_slice()[range].copy_from_slice(&snapshot);
                Ok(())
            }),
        )
    }

    fn copy_d2h(&self, src: &DeviceSlice, dst: &HostSlice, stream: &Stream) -> Result<()> {
        check_len("device->host copy", src.len(), dst.len())?;
        self.allocation(src.buffer())?;
        if dst.kind() == HostMemoryKind::CheckpointMapped {
            return Err(CoreError::Backend {
                device: self.id().to_string(),
                message: "device->host copy into a read-only checkpoint mapping".into(),
            });
        }
        let s = self.host_stream(stream)?;
        let pinned = dst.kind() == HostMemoryKind::Pinned;
        let (src, dst) = (src.clone(), dst.clone());
        let delay = self.link_delay(src.len());
        self.submit_copy(
            s,
            pinned,
            Box::new(move || {
                // The source is read when the copy starts and the destination written when
                // the link time has passed, so a read that is not ordered after a pending
                // write sees the old bytes, as it would on a GPU.
                let alloc = src
                    .buffer()
                    .downcast_ref::<HostAllocation>()
                    .ok_or("source is not a host allocation")?;
                let range = src.offset()..src.offset() + src.len();
                let snapshot = alloc.with_bytes(|b| b[range].to_vec());
                if let Some(d) = delay {
                    std::thread::sleep(d);
                }
                dst.with_bytes_mut(|d| d.copy_from_slice(&snapshot))
                    .map_err(|e| e.to_string())
            }),
        )
    }

    fn copy_d2d(&self, src: &DeviceSlice, dst: &DeviceSlice, stream: &Stream) -> Result<()> {
        check_len("device->device copy", dst.len(), src.len())?;
        self.allocation(src.buffer())?;
        self.allocation(dst.buffer())?;
        let s = self.host_stream(stream)?;
        let (src, dst) = (src.clone(), dst.clone());
        s.submit(Box::new(move || {
            let read = |slice: &DeviceSlice| -> std::result::Result<Vec<u8>, String> {
                let a = slice
                    .buffer()
                    .downcast_ref::<HostAllocation>()
                    .ok_or("not a host allocation")?;
                Ok(a.with_bytes(|b| b[slice.offset()..slice.offset() + slice.len()].to_vec()))
            };
            let bytes = read(&src)?;
            let alloc = dst
                .buffer()
                .downcast_ref::<HostAllocation>()
                .ok_or("not a host allocation")?;
            alloc.bytes.write().as_mut_slice()[dst.offset()..dst.offset() + dst.len()]
                .copy_from_slice(&bytes);
            Ok(())
        }))?;
        Ok(())
    }

    /// The status word the host decoder leaves for [`Device::check_lossless`], as CUDA's
    /// kernel does: 16 bytes, the status in bytes 12..16.
    fn lossless_scratch_bytes(&self) -> usize {
        HOST_LOSSLESS_SCRATCH
    }

    /// Decodes on the stream's worker with `ddo_codec`'s host decoder (the format's checks
    /// and checksum); a unit it refuses sets the scratch's status, as the GPU kernel does.
    fn decode_lossless(
        &self,
        header: &ddo_codec::UnitHeader,
        src: &DeviceSlice,
        dst: &DeviceSlice,
        scratch: &DeviceSlice,
        stream: &Stream,
    ) -> Result<()> {
        check_len(
            "lossless decode output",
            dst.len(),
            header.decoded_len() as usize,
        )?;
        if (src.len() as u64) < header.encoded_len() || scratch.len() < HOST_LOSSLESS_SCRATCH {
            return Err(CoreError::OutOfRange {
                what: "lossless decode input or scratch",
                offset: 0,
                len: header.encoded_len() as usize,
                buffer_len: src.len(),
            });
        }
        for slice in [src, dst, scratch] {
            self.allocation(slice.buffer())?;
        }
        let s = self.host_stream(stream)?;
        let (src, dst, scratch) = (src.clone(), dst.clone(), scratch.clone());
        let encoded_len = header.encoded_len() as usize;
        s.submit(Box::new(move || {
            fn alloc(slice: &DeviceSlice) -> std::result::Result<&HostAllocation, String> {
                slice
                    .buffer()
                    .downcast_ref::<HostAllocation>()
                    .ok_or_else(|| "not a host allocation".to_string())
            }
            // Copied out first: the coded slot and the output may share one allocation (the
            // engine's ring), whose lock the decode takes for writing.
            let coded =
                alloc(&src)?.with_bytes(|b| b[src.offset()..src.offset() + encoded_len].to_vec());
            let outcome = {
                let mut bytes = alloc(&dst)?.bytes.write();
                ddo_codec::decode_unit(
                    &coded,
                    &mut bytes.as_mut_slice()[dst.offset()..dst.offset() + dst.len()],
                )
            };
            if let Err(e) = outcome {
                let bit: u32 = match e {
                    ddo_codec::CodecError::ChecksumMismatch { .. } => LOSSLESS_BAD_CHECKSUM,
                    ddo_codec::CodecError::CorruptStream { .. } => LOSSLESS_BAD_STREAM,
                    _ => LOSSLESS_BAD_CODE,
                };
                let mut bytes = alloc(&scratch)?.bytes.write();
                let at = scratch.offset() + 12;
                let word = &mut bytes.as_mut_slice()[at..at + 4];
                let old = u32::from_le_bytes([word[0], word[1], word[2], word[3]]);
                word.copy_from_slice(&(old | bit).to_le_bytes());
            }
            Ok(())
        }))?;
        Ok(())
    }

    fn check_lossless(&self, scratch: &DeviceSlice, stream: &Stream) -> Result<()> {
        self.synchronize_stream(stream)?;
        let alloc = self.allocation(scratch.buffer())?;
        let bits = {
            let mut bytes = alloc.bytes.write();
            let at = scratch.offset() + 12;
            let word = &mut bytes.as_mut_slice()[at..at + 4];
            let bits = u32::from_le_bytes([word[0], word[1], word[2], word[3]]);
            word.copy_from_slice(&[0; 4]);
            bits
        };
        lossless_status(&self.id().to_string(), bits)
    }

    fn record_event(&self, stream: &Stream) -> Result<Event> {
        let s = self.host_stream(stream)?;
        let event = Arc::new(HostEvent::new(self.id(), self.ledger.instance));
        s.record(Arc::clone(&event))?;
        Ok(Event::new(event))
    }

    fn wait_event(&self, stream: &Stream, event: &Event) -> Result<()> {
        let s = self.host_stream(stream)?;
        self.host_event(event)?;
        let event = event.clone();
        s.submit(Box::new(move || {
            let e = event
                .downcast_ref::<HostEvent>()
                .ok_or("not a host event")?;
            match e.wait() {
                Some(err) => Err(format!("waited on a failed stream: {err}")),
                None => Ok(()),
            }
        }))?;
        Ok(())
    }

    fn event_complete(&self, event: &Event) -> Result<bool> {
        Ok(self.host_event(event)?.is_done())
    }

    /// Every host event is timed: the instant its stream's worker reached it.
    fn event_elapsed_ns(&self, start: &Event, end: &Event) -> Result<Option<i64>> {
        self.synchronize_event(start)?;
        self.synchronize_event(end)?;
        let at = |e: &Event| -> Result<Option<std::time::Instant>> {
            Ok(self.host_event(e)?.reached_at())
        };
        Ok(match (at(start)?, at(end)?) {
            (Some(a), Some(b)) if b >= a => Some(b.duration_since(a).as_nanos() as i64),
            (Some(a), Some(b)) => Some(-(a.duration_since(b).as_nanos() as i64)),
            _ => None,
        })
    }

    fn synchronize_event(&self, event: &Event) -> Result<()> {
        match self.host_event(event)?.wait() {
            Some(e) => Err(CoreError::Backend {
                device: self.id().to_string(),
                message: e,
            }),
            None => Ok(()),
        }
    }

    fn synchronize_stream(&self, stream: &Stream) -> Result<()> {
        self.host_stream(stream)?.synchronize()
    }

    fn synchronize(&self) -> Result<()> {
        let live: Vec<Arc<HostStream>> = self
            .streams
            .lock()
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .collect();
        for s in live {
            s.synchronize()?;
        }
        Ok(())
    }

    fn memory_info(&self) -> MemoryInfo {
        let allocated = self.ledger.allocated.load(Ordering::Acquire);
        MemoryInfo {
            allocated,
            peak_allocated: self.ledger.peak.load(Ordering::Acquire),
            reserved: allocated,
            capacity: self.config.capacity,
            driver_free: None,
            driver_total: None,
            pinned_host: self.pinned.pinned(),
            pinned_cached: self.released.pinned_bytes(),
            pinned_limit: self.pinned.limit(),
            pinned_peak: self.pinned.peak(),
        }
    }

    fn reset_peak(&self) {
        let now = self.ledger.allocated.load(Ordering::Acquire);
        self.ledger.peak.store(now, Ordering::Release);
    }

    fn empty_cache(&self) -> Result<u64> {
        // The host backend's allocator frees eagerly: there is no idle cache to return.
        Ok(0)
    }

    fn native_pool_figures(&self) -> Option<NativePoolFigures> {
        if self.config.allocator != AllocatorKind::NativeVmm {
            return None;
        }
        // The host backend maps exactly what is live and frees eagerly.
        let live = self.ledger.allocated.load(Ordering::Acquire);
        let peak = self.ledger.peak.load(Ordering::Acquire);
        Some(NativePoolFigures {
            reserved_va_bytes: self.config.capacity,
            va_in_use_bytes: live,
            peak_va_in_use_bytes: peak,
            mapped_bytes: live,
            peak_mapped_bytes: peak,
            live_bytes: live,
            peak_live_bytes: peak,
            ..NativePoolFigures::default()
        })
    }

    fn release_native_idle_cache(&self) -> Result<IdleCacheRelease> {
        if self.config.allocator != AllocatorKind::NativeVmm {
            return Err(CoreError::NativeAllocatorNotInstalled {
                device: self.id().to_string(),
            });
        }
        let busy: Vec<String> = self
            .streams
            .lock()
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .filter_map(|s| s.pending())
            .collect();
        if !busy.is_empty() {
            return Err(CoreError::NotQuiescent {
                device: self.id().to_string(),
                pending: busy.join(", "),
            });
        }
        Ok(IdleCacheRelease {
            basis: "every stream idle; the host backend frees eagerly and holds no idle cache"
                .into(),
            ..IdleCacheRelease::default()
        })
    }

    /// This device's ops, each through its per-op profiler ([`ddo_core::ProfiledOps`]).
    fn ops(&self) -> Option<&dyn Ops> {
        Some(&self.profiled)
    }

    /// Every op is bracketed by two timestamped events on the compute stream until the
    /// profile ends (host ops run on the calling thread, so their times are wall times).
    fn begin_op_profile(&self) -> bool {
        self.profiled.profiler().begin();
        true
    }

    fn end_op_profile(&self) -> Result<Option<ddo_core::profile::OpProfile>> {
        self.profiled.profiler().finish(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ddo_core::device::download;

    fn device(capacity: u64) -> Arc<HostDevice> {
        HostDevice::with_capacity(capacity).unwrap()
    }

    /// The host decoder reports a corrupt unit through the scratch, as CUDA's kernel does:
    /// a typed error at the next check, the status then cleared; a good unit decodes to its
    /// exact bytes.
    #[test]
    fn lossless_decode_is_exact_and_a_corrupt_unit_is_a_typed_error_at_the_check() {
        let d = device(1 << 24);
        let s = d.compute_stream();
        let words: Vec<u8> = (0..8192u32)
            .flat_map(|i| {
                half::bf16::from_f32(((i * 7919 % 1000) as f32 - 500.0) * 1e-4).to_le_bytes()
            })
            .collect();
        let unit = ddo_codec::encode_unit(&words).unwrap();
        assert!(
            unit.len() < words.len(),
            "{} of {}",
            unit.len(),
            words.len()
        );
        let upload = |bytes: &[u8]| {
            let b = d.alloc(bytes.len()).unwrap();
            d.copy_h2d(
                &HostBuffer::pageable_from(bytes).slice_all(),
                &b.slice_all(),
                &s,
            )
            .unwrap();
            b
        };
        let scratch = upload(&[0u8; HOST_LOSSLESS_SCRATCH]);
        let out = d.alloc(words.len()).unwrap();
        let good = upload(unit.bytes());
        d.decode_lossless(
            unit.header(),
            &good.slice_all(),
            &out.slice_all(),
            &scratch.slice_all(),
            &s,
        )
        .unwrap();
        d.check_lossless(&scratch.slice_all(), &s).unwrap();
        assert_eq!(
            ddo_core::device::download(&*d, &out.slice_all(), &s).unwrap(),
            words
        );
        let mut bad = unit.bytes().to_vec();
        let last = bad.len() - 1;
        bad[last] ^= 0x5a;
        let bad = upload(&bad);
        d.decode_lossless(
            unit.header(),
            &bad.slice_all(),
            &out.slice_all(),
            &scratch.slice_all(),
            &s,
        )
        .unwrap();
        let e = d.check_lossless(&scratch.slice_all(), &s).unwrap_err();
        assert!(matches!(e, CoreError::LosslessDecode { .. }), "{e}");
        assert!(e.to_string().contains("compress=none"), "{e}");
        // Cleared: the good unit checks clean again.
        d.decode_lossless(
            unit.header(),
            &good.slice_all(),
            &out.slice_all(),
            &scratch.slice_all(),
            &s,
        )
        .unwrap();
        d.check_lossless(&scratch.slice_all(), &s).unwrap();
    }

    /// Issue 34, item 7: memory the host cannot give is a typed error with the ledger put
    /// back, not an abort of the process.
    #[test]
    fn an_allocation_the_host_cannot_give_is_a_typed_error() {
        let d = device(u64::MAX);
        let huge = usize::MAX / 2;
        assert!(
            matches!(d.alloc(huge), Err(CoreError::HostOutOfMemory { .. })),
            "an allocation past the address space"
        );
        assert_eq!(d.memory_info().allocated, 0, "the ledger is put back");
        let small = d.alloc(4096).unwrap();
        assert_eq!(d.memory_info().allocated, 4096);
        drop(small);
        let err = ddo_core::host_memory::try_vec(usize::MAX / 4, 0.0f32, "a test").unwrap_err();
        assert!(err.to_string().contains("out of host memory"), "{err}");
        assert!(err.to_string().contains("a test"), "{err}");
    }

    #[test]
    fn allocation_is_bounded_by_capacity_and_accounted_exactly() {
        let d = device(1000);
        let a = d.alloc(600).unwrap();
        assert!(matches!(
            d.alloc(500),
            Err(CoreError::OutOfMemory {
                requested: 500,
                allocated: 600,
                ..
            })
        ));
        let b = d.alloc(400).unwrap();
        assert_eq!(d.memory_info().allocated, 1000);
        drop(a);
        drop(b);
        let m = d.memory_info();
        assert_eq!((m.allocated, m.peak_allocated), (0, 1000));
        d.reset_peak();
        assert_eq!(d.memory_info().peak_allocated, 0);
    }

    #[test]
    fn copies_round_trip_through_device_memory() {
        let d = device(1 << 20);
        let s = d.compute_stream();
        let pinned = d.alloc_pinned(8).unwrap();
        pinned
            .with_bytes_mut(|b| b.copy_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]))
            .unwrap();
        let buf = d.alloc(8).unwrap();
        d.copy_h2d(&pinned.slice_all(), &buf.slice_all(), &s)
            .unwrap();
        let back = download(&*d, &buf.slice(2, 4).unwrap(), &s).unwrap();
        assert_eq!(back, vec![3, 4, 5, 6]);
        assert_eq!(d.memory_info().pinned_host, 8);
        drop(pinned);
        assert_eq!(d.memory_info().pinned_host, 0);
    }

    #[test]
    fn pinned_copy_on_a_slow_link_is_asynchronous_until_an_event_orders_it() {
        let d = HostDevice::new(HostDeviceConfig {
            link_bytes_per_sec: Some(1_000.0), // 64 B take 64 ms
            ..HostDeviceConfig::default()
        })
        .unwrap();
        let copy = d.create_stream().unwrap();
        let compute = d.compute_stream();
        let src = d.alloc_pinned(64).unwrap();
        src.with_bytes_mut(|b| b.fill(7)).unwrap();
        let dst = d.alloc(64).unwrap();
        d.copy_h2d(&src.slice_all(), &dst.slice_all(), &copy)
            .unwrap();
        let done = d.record_event(&copy).unwrap();
        // Without a wait the compute stream does not see the copy yet.
        d.host_compute_fence(&compute).unwrap();
        let early = d.allocation(&dst).unwrap().with_bytes(|b| b[0]);
        assert_eq!(early, 0, "copy finished before 64 ms elapsed");
        assert!(!d.event_complete(&done).unwrap());
        // With the wait, compute sees the bytes.
        d.wait_event(&compute, &done).unwrap();
        d.host_compute_fence(&compute).unwrap();
        assert!(d.event_complete(&done).unwrap());
        assert_eq!(d.allocation(&dst).unwrap().with_bytes(|b| b[63]), 7);
    }

    #[test]
    fn release_after_frees_when_the_stream_gets_there() {
        let d = device(100);
        let s = d.create_stream().unwrap();
        let b = d.alloc(100).unwrap();
        d.release_after(b, &s).unwrap();
        d.synchronize_stream(&s).unwrap();
        assert_eq!(d.memory_info().allocated, 0);
    }

    #[test]
    fn handles_from_another_device_are_refused() {
        let a = device(100);
        let b = device(100);
        let buf = b.alloc(4).unwrap();
        let src = HostBuffer::pageable_from(&[0; 4]);
        let err = a
            .copy_h2d(&src.slice_all(), &buf.slice_all(), &a.compute_stream())
            .unwrap_err();
        assert!(matches!(err, CoreError::WrongDevice { .. }), "{err}");
        let err = a
            .copy_h2d(
                &src.slice_all(),
                &a.alloc(4).unwrap().slice_all(),
                &b.compute_stream(),
            )
            .unwrap_err();
        assert!(matches!(err, CoreError::WrongDevice { .. }), "{err}");
    }

    #[test]
    fn size_mismatch_and_mapped_destination_are_typed_errors() {
        let d = device(100);
        let s = d.compute_stream();
        let buf = d.alloc(4).unwrap();
        let src = HostBuffer::pageable_from(&[0; 3]);
        assert!(matches!(
            d.copy_h2d(&src.slice_all(), &buf.slice_all(), &s),
            Err(CoreError::SizeMismatch { .. })
        ));
        assert!(HostDevice::with_capacity(0).is_err());
    }
}
