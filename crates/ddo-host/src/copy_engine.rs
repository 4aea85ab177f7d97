//! The host backend's copy engine: streams and events.
//!
//! A [`HostStream`] is a worker thread that runs the jobs queued on it in order (copies,
//! event markers, waits on other streams' events, stream-ordered frees); a [`HostEvent`]
//! completes when its stream's worker reaches it, and records the instant it did, so
//! events time work as CUDA's do. A job's error is sticky: the stream reports it to every
//! later wait, and every event recorded after it carries it. Copies on one stream overlap
//! compute and copies on others, so a missing `wait_event` reads stale bytes in tests as
//! it would on a GPU.

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::{Sender, unbounded};
use ddo_core::DeviceId;
use ddo_core::device::{EventHandle, StreamHandle};
use ddo_core::error::{CoreError, Result};
use parking_lot::{Condvar, Mutex};

#[derive(Default)]
struct EventState {
    done: bool,
    error: Option<String>,
    /// When the stream reached the event.
    at: Option<Instant>,
}

/// An event of the host backend.
pub struct HostEvent {
    device: DeviceId,
    /// The device instance that made it (two devices of one id are told apart).
    pub(crate) instance: u64,
    state: Mutex<EventState>,
    cv: Condvar,
}

impl HostEvent {
    /// A new event of device `device` (instance `instance`), not yet reached.
    pub(crate) fn new(device: DeviceId, instance: u64) -> Self {
        Self {
            device,
            instance,
            state: Mutex::new(EventState::default()),
            cv: Condvar::new(),
        }
    }

    fn complete(&self, error: Option<String>) {
        let mut st = self.state.lock();
        st.done = true;
        st.error = error;
        st.at = Some(Instant::now());
        self.cv.notify_all();
    }

    /// Blocks until the event's stream reaches it; the stream's error then, if any.
    pub(crate) fn wait(&self) -> Option<String> {
        let mut st = self.state.lock();
        while !st.done {
            self.cv.wait(&mut st);
        }
        st.error.clone()
    }

    /// Whether the event's stream has reached it.
    pub(crate) fn is_done(&self) -> bool {
        self.state.lock().done
    }

    /// The instant the event's stream reached it (none yet).
    pub(crate) fn reached_at(&self) -> Option<Instant> {
        self.state.lock().at
    }
}

impl fmt::Debug for HostEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostEvent(done={})", self.state.lock().done)
    }
}

impl EventHandle for HostEvent {
    fn device(&self) -> DeviceId {
        self.device
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// A unit of queued work: its error, if any, becomes the stream's sticky error.
pub(crate) type Job = Box<dyn FnOnce() -> std::result::Result<(), String> + Send>;

struct Progress {
    submitted: u64,
    completed: u64,
    error: Option<String>,
}

struct StreamShared {
    progress: Mutex<Progress>,
    cv: Condvar,
}

/// A stream of the host backend: a worker thread that runs queued work in order.
pub struct HostStream {
    device: DeviceId,
    /// The device instance that made it (two devices of one id are told apart).
    pub(crate) instance: u64,
    ordinal: u64,
    sender: Sender<Job>,
    shared: Arc<StreamShared>,
}

impl HostStream {
    /// Starts the worker thread of stream `ordinal` of device `device`.
    pub(crate) fn spawn(device: DeviceId, instance: u64, ordinal: u64) -> Result<Self> {
        let (sender, receiver) = unbounded::<Job>();
        let shared = Arc::new(StreamShared {
            progress: Mutex::new(Progress {
                submitted: 0,
                completed: 0,
                error: None,
            }),
            cv: Condvar::new(),
        });
        let worker = Arc::clone(&shared);
        std::thread::Builder::new()
            .name(format!("ddo-{device}-stream-{ordinal}"))
            .spawn(move || {
                for job in receiver {
                    let outcome = job();
                    let mut p = worker.progress.lock();
                    p.completed += 1;
                    if let Err(e) = outcome {
                        p.error.get_or_insert(e);
                    }
                    worker.cv.notify_all();
                }
            })
            .map_err(|e| CoreError::Backend {
                device: device.to_string(),
                message: format!("cannot start a stream worker thread: {e}"),
            })?;
        Ok(Self {
            device,
            instance,
            ordinal,
            sender,
            shared,
        })
    }

    /// Queues `job`; returns its ticket.
    pub(crate) fn submit(&self, job: Job) -> Result<u64> {
        let ticket = {
            let mut p = self.shared.progress.lock();
            p.submitted += 1;
            p.submitted
        };
        self.sender.send(job).map_err(|_| CoreError::Backend {
            device: self.device.to_string(),
            message: format!("stream {} worker has stopped", self.ordinal),
        })?;
        Ok(ticket)
    }

    /// Queues `event`'s marker: the event completes when the worker reaches it, carrying
    /// the stream's sticky error if one was raised before.
    pub(crate) fn record(&self, event: Arc<HostEvent>) -> Result<()> {
        let shared = Arc::clone(&self.shared);
        self.submit(Box::new(move || {
            let error = shared.progress.lock().error.clone();
            event.complete(error);
            Ok(())
        }))?;
        Ok(())
    }

    /// Blocks until the job with `ticket` (and everything before it) has run; reports the
    /// stream's sticky error, if any.
    pub(crate) fn wait_for(&self, ticket: u64) -> Result<()> {
        let mut p = self.shared.progress.lock();
        while p.completed < ticket {
            self.shared.cv.wait(&mut p);
        }
        match &p.error {
            Some(e) => Err(CoreError::Backend {
                device: self.device.to_string(),
                message: format!("stream {}: {e}", self.ordinal),
            }),
            None => Ok(()),
        }
    }

    /// Blocks until everything queued so far has run.
    pub(crate) fn synchronize(&self) -> Result<()> {
        let ticket = self.shared.progress.lock().submitted;
        self.wait_for(ticket)
    }

    /// "stream N has K job(s) queued" while work is queued or running; none when idle.
    pub(crate) fn pending(&self) -> Option<String> {
        let p = self.shared.progress.lock();
        (p.completed < p.submitted).then(|| {
            format!(
                "stream {} has {} job(s) queued",
                self.ordinal,
                p.submitted - p.completed
            )
        })
    }
}

impl fmt::Debug for HostStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostStream({} #{})", self.device, self.ordinal)
    }
}

impl StreamHandle for HostStream {
    fn device(&self) -> DeviceId {
        self.device
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
