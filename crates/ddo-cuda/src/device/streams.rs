//! Streams and events of a [`CudaDevice`]: [`CudaStreamHandle`] with its list of pending
//! copies (what a queued copy keeps alive until it completes), [`CudaEventHandle`], and the
//! pool of idle CUDA events that frees and copies record ([`EventPool`], [`PooledEvent`]).

use std::any::Any;
use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Weak};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use ddo_core::device::{EventHandle, StreamHandle};
use ddo_core::{CoreError, Device, DeviceId, DeviceSlice, Event, HostSlice, Stream};
use parking_lot::Mutex;

use super::CudaDevice;
use super::memory::Shared;
use crate::allocator::{FreeEvent, StreamKey};
use crate::error::{DriverResultExt, Result};

/// The compute stream's key in the allocator.
pub(super) const COMPUTE: StreamKey = StreamKey(0);

/// Most idle events kept for reuse.
const EVENT_POOL_MAX: usize = 1024;

/// Idle CUDA events kept for reuse, so a free or a copy costs an event record, not an
/// event creation.
pub(super) struct EventPool {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) idle: Mutex<Vec<CudaEvent>>,
}

impl EventPool {
    /// An event recorded at the current end of `stream`.
    pub(super) fn record(self: &Arc<Self>, stream: &CudaStream) -> Result<PooledEvent> {
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
pub(super) struct PooledEvent {
    event: Option<CudaEvent>,
    pool: Arc<EventPool>,
}

impl PooledEvent {
    pub(super) fn event(&self) -> &CudaEvent {
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
        crate::host_waits::timed("cuEventSynchronize (a freed block)", || {
            self.event().synchronize()
        })
        .call("cuEventSynchronize")
    }
}

/// What a queued copy keeps alive until it has completed.
#[allow(dead_code)] // held only for their drop
pub(super) enum Held {
    Host(HostSlice),
    Device(DeviceSlice),
}

pub(super) struct PendingCopy {
    done: PooledEvent,
    _held: (Held, Option<Held>),
}

/// A stream of a [`CudaDevice`].
pub struct CudaStreamHandle {
    pub(super) shared: Arc<Shared>,
    pub(super) key: StreamKey,
    pub(super) stream: Arc<CudaStream>,
    pub(super) pending: Mutex<VecDeque<PendingCopy>>,
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
    pub(super) fn poll(&self) -> Result<()> {
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
    pub(super) fn retire_oldest(&self) -> Result<bool> {
        let Some(oldest) = self.pending.lock().pop_front() else {
            return Ok(false);
        };
        if let Err(e) = crate::host_waits::timed("cuEventSynchronize (an upload buffer)", || {
            oldest.done.wait()
        }) {
            self.pending.lock().push_front(oldest);
            return Err(e);
        }
        Ok(true)
    }

    /// After the stream was synchronised: every queued copy has completed.
    pub(super) fn retire_all(&self) {
        let done: Vec<PendingCopy> = self.pending.lock().drain(..).collect();
        drop(done);
    }

    /// Keeps `held` (one side of the copy, or both) alive until the copy just queued on
    /// this stream has completed. When the completion event cannot be recorded, waits for
    /// the stream instead.
    pub(super) fn track(&self, held: (Held, Option<Held>)) -> Result<()> {
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
    pub(super) id: DeviceId,
    pub(super) instance: u64,
    pub(super) slot: EventSlot,
}

/// Where a [`CudaEventHandle`]'s event comes from: an untimed one is the device's
/// [`EventPool`]'s (no `cuEventCreate`/`cuEventDestroy` per record: a streamed forward records
/// hundreds), a timed one its own.
pub(super) enum EventSlot {
    Pooled(PooledEvent),
    Own(CudaEvent),
}

impl CudaEventHandle {
    /// The cudarc event.
    pub fn cuda_event(&self) -> &CudaEvent {
        match &self.slot {
            EventSlot::Pooled(e) => e.event(),
            EventSlot::Own(e) => e,
        }
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

impl CudaDevice {
    /// An event recorded on `stream` with `flags`: `None` (no timing) takes one from the
    /// device's [`EventPool`] (it goes back when the last handle drops; a wait queued on it
    /// before then keeps the record it saw), timing flags create one.
    pub(super) fn record_with(
        &self,
        stream: &Stream,
        flags: Option<cudarc::driver::sys::CUevent_flags>,
    ) -> ddo_core::Result<Event> {
        let s = self.stream_handle(stream)?;
        let slot = match flags {
            None => EventSlot::Pooled(
                self.shared
                    .events
                    .record(&s.stream)
                    .map_err(|e| self.core(e))?,
            ),
            Some(_) => EventSlot::Own(
                s.stream
                    .record_event(flags)
                    .call("cuEventRecord")
                    .map_err(|e| self.core(e))?,
            ),
        };
        Ok(Event::new(Arc::new(CudaEventHandle {
            id: self.id(),
            instance: self.shared.instance,
            slot,
        })))
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

    pub(super) fn event_handle<'a>(
        &self,
        event: &'a Event,
    ) -> ddo_core::Result<&'a CudaEventHandle> {
        event
            .downcast_ref::<CudaEventHandle>()
            .filter(|e| e.instance == self.shared.instance)
            .ok_or_else(|| CoreError::WrongDevice {
                what: "event",
                expected: self.id().to_string(),
                found: event.device().to_string(),
            })
    }

    /// Copies queued on any stream whose memory is still held.
    pub fn pending_copies(&self) -> usize {
        self.live_streams().iter().map(|s| s.pending_copies()).sum()
    }

    pub(super) fn live_streams(&self) -> Vec<Arc<CudaStreamHandle>> {
        let mut streams = self.streams.lock();
        streams.retain(|w| w.strong_count() > 0);
        streams.iter().filter_map(Weak::upgrade).collect()
    }

    /// Releases what completed copies held, on every stream.
    pub(super) fn poll(&self) -> ddo_core::Result<()> {
        for s in self.live_streams() {
            s.poll().map_err(|e| self.core(e))?;
        }
        Ok(())
    }
}
