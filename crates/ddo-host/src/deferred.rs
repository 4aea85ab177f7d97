//! [`DeferredComputeDevice`] (test support, feature `test-support`): a host device whose
//! compute runs as late as the host program lets it, so that a copy which does not wait
//! for the compute reading its destination lands first and the compute reads the wrong
//! bytes — the hazard a GPU shows and the plain host backend hides, since its ops run on
//! the calling thread before the host moves on.
//!
//! Each [`Ops`] call runs twice: at once on the calling thread, only to hand back an
//! output of the right shape (its values are provisional), and again as a job queued on
//! this device's compute stream, whose result replaces the output's bytes. The jobs are
//! held back until the host *waits* for something (a synchronisation, an event query, a
//! copy from or to pageable memory, [`Ops::to_f32_vec`]); before letting them go, the
//! device lets every other stream run as far as it can without them: up to its first
//! `wait_event` on work still held back (directly or through other streams' events), or
//! to its end. So every copy that was queued without waiting for the compute that reads
//! its destination has landed before that compute runs, whatever the threads' timing —
//! a missing wait gives wrong output deterministically — while work ordered by events
//! runs in its order, and gives the same bytes as on [`HostDevice`].
//!
//! Everything else is the wrapped [`HostDevice`]'s: memory, accounting, copies, events
//! (each replayed output is also allocated once more while its job runs). Not for
//! programs: it is compiled for this crate's tests and behind the `test-support` feature,
//! which other crates enable as a dev-dependency; the `ddo` command links neither.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use ddo_core::device::{
    AllocatorKind, Device, DeviceBuffer, DeviceId, DeviceSlice, Event, MemoryInfo, Stream,
};
use ddo_core::dtype::DType;
use ddo_core::error::{CoreError, Result};
use ddo_core::host_memory::{HostBuffer, HostMemoryKind, HostSlice};
use ddo_core::ops::{BinaryOp, Conv2dParams, Ops, ReduceOp, UnaryOp};
use ddo_core::tensor::{Tensor, TensorStorage};
use ddo_metrics::{IdleCacheRelease, NativePoolFigures};

use crate::copy_engine::{HostEvent, HostStream};
use crate::device::HostDevice;

/// The compute jobs let go so far, out of those queued (tickets count from 1).
#[derive(Default)]
struct Gate {
    state: Mutex<(u64, u64)>,
    cv: Condvar,
}

impl Gate {
    /// A ticket for the next compute job.
    fn ticket(&self) -> u64 {
        let mut s = self.state.lock();
        s.0 += 1;
        s.0
    }

    /// (queued, released).
    fn figures(&self) -> (u64, u64) {
        *self.state.lock()
    }

    /// Blocks until `ticket` is let go.
    fn wait(&self, ticket: u64) {
        let mut s = self.state.lock();
        while s.1 < ticket {
            self.cv.wait(&mut s);
        }
    }

    /// Lets every ticket up to `upto` go.
    fn release(&self, upto: u64) {
        let mut s = self.state.lock();
        s.1 = s.1.max(upto);
        self.cv.notify_all();
    }
}

/// What the device queued on a stream, in order (copies are not logged: they wait for
/// nothing).
enum Entry {
    /// A compute job (the compute stream only): passes once its ticket is let go.
    Job(u64),
    /// An event recorded here.
    Record,
    /// A wait on `event`; `before` was recorded just before it (streams other than compute).
    Wait { event: Event, before: Option<Event> },
}

struct Log {
    key: usize,
    stream: Stream,
    /// `(sequence number, entry)`, oldest first.
    entries: VecDeque<(u64, Entry)>,
}

#[derive(Default)]
struct Tracker {
    seq: u64,
    logs: Vec<Log>,
    /// Events recorded through this device and not known complete: their stream and
    /// sequence number (the event is kept, so its address is not reused meanwhile).
    events: HashMap<usize, (usize, u64, Event)>,
}

impl Tracker {
    fn log_mut(&mut self, stream: &Stream) -> Result<&mut Log> {
        let key = stream_key(stream)?;
        let i = match self.logs.iter().position(|l| l.key == key) {
            Some(i) => i,
            None => {
                self.logs.push(Log {
                    key,
                    stream: stream.clone(),
                    entries: VecDeque::new(),
                });
                self.logs.len() - 1
            }
        };
        Ok(&mut self.logs[i])
    }

    fn push(&mut self, stream: &Stream, entry: Entry) -> Result<u64> {
        self.seq += 1;
        let seq = self.seq;
        self.log_mut(stream)?.entries.push_back((seq, entry));
        Ok(seq)
    }
}

fn stream_key(stream: &Stream) -> Result<usize> {
    stream
        .downcast_ref::<HostStream>()
        .map(|s| s as *const HostStream as usize)
        .ok_or_else(|| CoreError::WrongDevice {
            what: "stream",
            expected: "a host stream".into(),
            found: stream.device().to_string(),
        })
}

fn event_key(event: &Event) -> Option<usize> {
    event
        .downcast_ref::<HostEvent>()
        .map(|e| e as *const HostEvent as usize)
}

fn device_slice(t: &Tensor) -> Option<DeviceSlice> {
    match t.storage() {
        TensorStorage::Device(s) => Some(s.clone()),
        TensorStorage::Host(_) => None,
    }
}

/// A [`HostDevice`] whose compute runs as late as the host allows (see the module docs).
pub struct DeferredComputeDevice {
    inner: Arc<HostDevice>,
    /// This device's compute stream: a stream of the inner device that the inner ops'
    /// own fence (on the inner compute stream) never waits for.
    compute: Stream,
    compute_key: usize,
    gate: Arc<Gate>,
    tracker: Mutex<Tracker>,
    /// One catch-up at a time.
    catching_up: Mutex<()>,
}

impl fmt::Debug for DeferredComputeDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (queued, released) = self.gate.figures();
        write!(
            f,
            "DeferredComputeDevice({:?}, {released} of {queued} compute jobs let go)",
            self.inner
        )
    }
}

impl DeferredComputeDevice {
    /// Wraps `inner` (use it only through the wrapper from now on).
    pub fn new(inner: Arc<HostDevice>) -> Result<Arc<Self>> {
        let compute = inner.create_stream()?;
        let compute_key = stream_key(&compute)?;
        let mut tracker = Tracker::default();
        tracker.log_mut(&compute)?;
        Ok(Arc::new(Self {
            inner,
            compute,
            compute_key,
            gate: Arc::default(),
            tracker: Mutex::new(tracker),
            catching_up: Mutex::new(()),
        }))
    }

    /// The wrapped device.
    pub fn inner(&self) -> &Arc<HostDevice> {
        &self.inner
    }

    /// Whether every entry of `event`'s stream before it can pass once the compute jobs up
    /// to `released` are let go.
    fn ready(
        &self,
        t: &Tracker,
        event: &Event,
        released: u64,
        memo: &mut HashMap<usize, bool>,
    ) -> bool {
        let Some(key) = event_key(event) else {
            return true;
        };
        if let Some(&r) = memo.get(&key) {
            return r;
        }
        let r = self.inner.event_complete(event).unwrap_or(true)
            || match t.events.get(&key) {
                None => true,
                Some(&(stream, seq, _)) => {
                    t.logs.iter().find(|l| l.key == stream).is_none_or(|l| {
                        l.entries
                            .iter()
                            .take_while(|(s, _)| *s < seq)
                            .all(|(_, e)| self.passes(t, e, released, memo))
                    })
                }
            };
        memo.insert(key, r);
        r
    }

    fn passes(
        &self,
        t: &Tracker,
        entry: &Entry,
        released: u64,
        memo: &mut HashMap<usize, bool>,
    ) -> bool {
        match entry {
            Entry::Job(ticket) => *ticket <= released,
            Entry::Record => true,
            Entry::Wait { event, .. } => self.ready(t, event, released, memo),
        }
    }

    /// Lets every other stream run as far as it can without the held-back compute, then
    /// lets the compute queued so far go.
    fn catch_up(&self) {
        let _one = self.catching_up.lock();
        let (markers, upto) = {
            let t = self.tracker.lock();
            let (queued, released) = self.gate.figures();
            let mut memo = HashMap::new();
            let mut markers = Vec::new();
            for log in t.logs.iter().filter(|l| l.key != self.compute_key) {
                let blocked = log
                    .entries
                    .iter()
                    .find(|(_, e)| !self.passes(&t, e, released, &mut memo));
                match blocked {
                    Some((
                        _,
                        Entry::Wait {
                            before: Some(m), ..
                        },
                    )) => markers.push(m.clone()),
                    // Only compute holds jobs, and its waits are not waited for here.
                    Some(_) => {}
                    None => {
                        if let Ok(m) = self.inner.record_event(&log.stream) {
                            markers.push(m);
                        }
                    }
                }
            }
            (markers, queued)
        };
        for m in &markers {
            // A failed stream reports its error to the caller's own wait.
            let _ = self.inner.synchronize_event(m);
        }
        self.gate.release(upto);
        self.prune();
    }

    /// Drops log entries that pass whatever comes, and events known complete.
    fn prune(&self) {
        let (_, released) = self.gate.figures();
        let mut t = self.tracker.lock();
        for log in &mut t.logs {
            while let Some((_, e)) = log.entries.front() {
                let done = match e {
                    Entry::Record => true,
                    Entry::Job(ticket) => *ticket <= released,
                    Entry::Wait { event, .. } => self.inner.event_complete(event).unwrap_or(true),
                };
                if !done {
                    break;
                }
                log.entries.pop_front();
            }
        }
        t.events
            .retain(|_, (_, _, e)| !self.inner.event_complete(e).unwrap_or(true));
    }

    fn host_stream(&self) -> Result<&HostStream> {
        self.compute
            .downcast_ref::<HostStream>()
            .ok_or_else(|| CoreError::Backend {
                device: self.inner.id().to_string(),
                message: "deferred compute stream is not a host stream".into(),
            })
    }

    /// Runs `f` now for the output, and again on the compute stream once let go, writing
    /// the second result over the first.
    fn op<F>(&self, f: F) -> Result<Tensor>
    where
        F: Fn(&dyn Ops) -> Result<Tensor> + Send + 'static,
    {
        let out = f(&*self.inner as &dyn Ops)?;
        let Some(target) = device_slice(&out) else {
            return Ok(out);
        };
        let inner = Arc::clone(&self.inner);
        let gate = Arc::clone(&self.gate);
        let mut t = self.tracker.lock();
        let ticket = self.gate.ticket();
        self.host_stream()?.submit(Box::new(move || {
            gate.wait(ticket);
            let again = f(&*inner as &dyn Ops).map_err(|e| e.to_string())?;
            let src = device_slice(&again).ok_or("a replayed op returned a host tensor")?;
            if src.len() != target.len() {
                return Err(format!(
                    "a replayed op wrote {} B into an output of {} B",
                    src.len(),
                    target.len()
                ));
            }
            let bytes = inner
                .allocation(src.buffer())
                .map_err(|e| e.to_string())?
                .with_bytes(|b| b[src.offset()..src.offset() + src.len()].to_vec());
            inner
                .allocation(target.buffer())
                .map_err(|e| e.to_string())?
                .with_bytes_mut(|b| {
                    b[target.offset()..target.offset() + target.len()].copy_from_slice(&bytes)
                });
            Ok(())
        }))?;
        t.push(&self.compute, Entry::Job(ticket))?;
        Ok(out)
    }

    fn record(&self, stream: &Stream, timed: bool) -> Result<Event> {
        let mut t = self.tracker.lock();
        let event = if timed {
            self.inner.record_timed_event(stream)?
        } else {
            self.inner.record_event(stream)?
        };
        let seq = t.push(stream, Entry::Record)?;
        if let Some(k) = event_key(&event) {
            let s = stream_key(stream)?;
            t.events.insert(k, (s, seq, event.clone()));
        }
        Ok(event)
    }
}

impl Drop for DeferredComputeDevice {
    fn drop(&mut self) {
        // Jobs still held run, so their streams drain and their buffers go.
        self.gate.release(u64::MAX);
    }
}

impl Device for DeferredComputeDevice {
    fn id(&self) -> DeviceId {
        self.inner.id()
    }

    fn allocator(&self) -> AllocatorKind {
        self.inner.allocator()
    }

    fn conv2d_scratch_bytes(
        &self,
        elems: usize,
        channels: usize,
        filters: usize,
        kernel: usize,
        dtype: DType,
    ) -> u64 {
        self.inner
            .conv2d_scratch_bytes(elems, channels, filters, kernel, dtype)
    }

    fn scratch_bytes(&self) -> u64 {
        self.inner.scratch_bytes()
    }

    fn alloc(&self, bytes: usize) -> Result<DeviceBuffer> {
        self.inner.alloc(bytes)
    }

    fn release_after(&self, buffer: DeviceBuffer, stream: &Stream) -> Result<()> {
        self.inner.release_after(buffer, stream)
    }

    fn alloc_pinned(&self, bytes: usize) -> Result<HostBuffer> {
        self.inner.alloc_pinned(bytes)
    }

    fn register_host(&self, buffer: &HostBuffer) -> Result<HostBuffer> {
        self.inner.register_host(buffer)
    }

    fn release_host(&self, buffer: HostBuffer) {
        self.inner.release_host(buffer)
    }

    fn unpin_released(&self) -> u64 {
        self.inner.unpin_released()
    }

    fn host_registrations(&self) -> u64 {
        self.inner.host_registrations()
    }

    fn setup_calls(&self) -> ddo_core::SetupCalls {
        self.inner.setup_calls()
    }

    fn host_waits_since(&self, since: std::time::Instant) -> Vec<ddo_metrics::HostWait> {
        self.inner.host_waits_since(since)
    }

    fn compute_stream(&self) -> Stream {
        self.compute.clone()
    }

    fn create_stream(&self) -> Result<Stream> {
        let stream = self.inner.create_stream()?;
        self.tracker.lock().log_mut(&stream)?;
        Ok(stream)
    }

    fn supports_streams(&self) -> bool {
        self.inner.supports_streams()
    }

    fn copy_h2d(&self, src: &HostSlice, dst: &DeviceSlice, stream: &Stream) -> Result<()> {
        if src.kind() != HostMemoryKind::Pinned {
            // The host waits for a pageable copy.
            self.catch_up();
        }
        self.inner.copy_h2d(src, dst, stream)
    }

    fn copy_d2h(&self, src: &DeviceSlice, dst: &HostSlice, stream: &Stream) -> Result<()> {
        if dst.kind() != HostMemoryKind::Pinned {
            self.catch_up();
        }
        self.inner.copy_d2h(src, dst, stream)
    }

    fn copy_d2d(&self, src: &DeviceSlice, dst: &DeviceSlice, stream: &Stream) -> Result<()> {
        self.inner.copy_d2d(src, dst, stream)
    }

    fn lossless_scratch_bytes(&self) -> usize {
        self.inner.lossless_scratch_bytes()
    }

    fn decode_lossless(
        &self,
        header: &ddo_codec::UnitHeader,
        src: &DeviceSlice,
        dst: &DeviceSlice,
        scratch: &DeviceSlice,
        stream: &Stream,
    ) -> Result<()> {
        self.inner
            .decode_lossless(header, src, dst, scratch, stream)
    }

    fn check_lossless(&self, scratch: &DeviceSlice, stream: &Stream) -> Result<()> {
        self.catch_up();
        self.inner.check_lossless(scratch, stream)
    }

    fn record_event(&self, stream: &Stream) -> Result<Event> {
        self.record(stream, false)
    }

    fn record_timed_event(&self, stream: &Stream) -> Result<Event> {
        self.record(stream, true)
    }

    fn event_elapsed_ns(&self, start: &Event, end: &Event) -> Result<Option<i64>> {
        self.catch_up();
        self.inner.event_elapsed_ns(start, end)
    }

    fn wait_event(&self, stream: &Stream, event: &Event) -> Result<()> {
        let mut t = self.tracker.lock();
        let before = if stream_key(stream)? == self.compute_key {
            None
        } else {
            Some(self.inner.record_event(stream)?)
        };
        self.inner.wait_event(stream, event)?;
        t.push(
            stream,
            Entry::Wait {
                event: event.clone(),
                before,
            },
        )?;
        Ok(())
    }

    fn event_complete(&self, event: &Event) -> Result<bool> {
        self.catch_up();
        self.inner.event_complete(event)
    }

    fn synchronize_event(&self, event: &Event) -> Result<()> {
        self.catch_up();
        self.inner.synchronize_event(event)
    }

    fn synchronize_stream(&self, stream: &Stream) -> Result<()> {
        self.catch_up();
        self.inner.synchronize_stream(stream)
    }

    fn synchronize(&self) -> Result<()> {
        self.catch_up();
        self.inner.synchronize()
    }

    fn memory_info(&self) -> MemoryInfo {
        self.inner.memory_info()
    }

    fn reset_peak(&self) {
        self.inner.reset_peak()
    }

    fn empty_cache(&self) -> Result<u64> {
        self.inner.empty_cache()
    }

    fn ops(&self) -> Option<&dyn Ops> {
        Some(self)
    }

    fn forget_shape_plans(&self) -> Result<()> {
        self.inner.forget_shape_plans()
    }

    fn prepare_attention(
        &self,
        q: &[usize],
        k: &[usize],
        v: &[usize],
        mask: Option<(&[usize], DType)>,
        dtype: DType,
    ) {
        self.inner.prepare_attention(q, k, v, mask, dtype)
    }

    fn settle(&self, timeout: std::time::Duration) -> Result<bool> {
        self.catch_up();
        self.inner.settle(timeout)
    }

    fn native_pool_figures(&self) -> Option<NativePoolFigures> {
        self.inner.native_pool_figures()
    }

    fn release_native_idle_cache(&self) -> Result<IdleCacheRelease> {
        self.catch_up();
        self.inner.release_native_idle_cache()
    }
}

/// Owned copies of listed tensor arguments, for a job.
fn owned_all(xs: &[&Tensor]) -> Vec<Tensor> {
    xs.iter().map(|&x| x.clone()).collect()
}

impl Ops for DeferredComputeDevice {
    /// Values from the host: final at once, nothing to replay.
    fn tensor_from_f32(&self, shape: &[usize], dtype: DType, values: &[f32]) -> Result<Tensor> {
        self.inner.tensor_from_f32(shape, dtype, values)
    }

    /// The host waits for the compute that made `x`.
    fn to_f32_vec(&self, x: &Tensor) -> Result<Vec<f32>> {
        self.catch_up();
        self.inner.synchronize_stream(&self.compute)?;
        self.inner.to_f32_vec(x)
    }

    fn linear(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let (x, w, b) = (x.clone(), w.clone(), bias.cloned());
        self.op(move |o| o.linear(&x, &w, b.as_ref()))
    }

    fn linear_concat(&self, xs: &[&Tensor], w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let (xs, w, b) = (owned_all(xs), w.clone(), bias.cloned());
        self.op(move |o| o.linear_concat(&xs.iter().collect::<Vec<_>>(), &w, b.as_ref()))
    }

    fn matmul(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let (a, b) = (a.clone(), b.clone());
        self.op(move |o| o.matmul(&a, &b))
    }

    fn conv2d(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        params: Conv2dParams,
    ) -> Result<Tensor> {
        let (x, w, b) = (x.clone(), w.clone(), bias.cloned());
        self.op(move |o| o.conv2d(&x, &w, b.as_ref(), params))
    }

    fn group_norm(
        &self,
        x: &Tensor,
        groups: usize,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor> {
        let (x, w, b) = (x.clone(), weight.cloned(), bias.cloned());
        self.op(move |o| o.group_norm(&x, groups, w.as_ref(), b.as_ref(), eps))
    }

    fn layer_norm(
        &self,
        x: &Tensor,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor> {
        let (x, w, b) = (x.clone(), weight.cloned(), bias.cloned());
        self.op(move |o| o.layer_norm(&x, w.as_ref(), b.as_ref(), eps))
    }

    fn rms_norm(&self, x: &Tensor, weight: Option<&Tensor>, eps: f32) -> Result<Tensor> {
        let (x, w) = (x.clone(), weight.cloned());
        self.op(move |o| o.rms_norm(&x, w.as_ref(), eps))
    }

    fn unary(&self, x: &Tensor, op: UnaryOp) -> Result<Tensor> {
        let x = x.clone();
        self.op(move |o| o.unary(&x, op))
    }

    /// As [`Ops::unary`]: the job needs `x` after the call returns.
    fn unary_owned(&self, x: Tensor, op: UnaryOp) -> Result<Tensor> {
        self.unary(&x, op)
    }

    fn binary(&self, a: &Tensor, b: &Tensor, op: BinaryOp) -> Result<Tensor> {
        let (a, b) = (a.clone(), b.clone());
        self.op(move |o| o.binary(&a, &b, op))
    }

    fn affine(&self, x: &Tensor, mul: f32, add: f32) -> Result<Tensor> {
        let x = x.clone();
        self.op(move |o| o.affine(&x, mul, add))
    }

    fn softmax(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.clone();
        self.op(move |o| o.softmax(&x))
    }

    fn reduce(&self, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        let x = x.clone();
        self.op(move |o| o.reduce(&x, dim, op))
    }

    fn upsample_nearest2x(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.clone();
        self.op(move |o| o.upsample_nearest2x(&x))
    }

    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        scale: f32,
    ) -> Result<Tensor> {
        let (q, k, v, m) = (q.clone(), k.clone(), v.clone(), mask.cloned());
        self.op(move |o| o.attention(&q, &k, &v, m.as_ref(), scale))
    }

    fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let (x, c, s) = (x.clone(), cos.clone(), sin.clone());
        self.op(move |o| o.rope(&x, &c, &s))
    }

    fn concat(&self, xs: &[&Tensor], dim: usize) -> Result<Tensor> {
        let xs = owned_all(xs);
        self.op(move |o| o.concat(&xs.iter().collect::<Vec<_>>(), dim))
    }

    fn narrow(&self, x: &Tensor, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        let x = x.clone();
        self.op(move |o| o.narrow(&x, dim, start, len))
    }

    fn permute(&self, x: &Tensor, dims: &[usize]) -> Result<Tensor> {
        let (x, dims) = (x.clone(), dims.to_vec());
        self.op(move |o| o.permute(&x, &dims))
    }

    fn dequantize(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        let x = x.clone();
        self.op(move |o| o.dequantize(&x, dtype))
    }

    fn linear_fp8(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        let (x, w, b) = (x.clone(), w.clone(), bias.cloned());
        self.op(move |o| o.linear_fp8(&x, &w, b.as_ref()))
    }

    fn linear_fp8_concat(
        &self,
        xs: &[&Tensor],
        w: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (xs, w, b) = (
            xs.iter().map(|x| (*x).clone()).collect::<Vec<_>>(),
            w.clone(),
            bias.cloned(),
        );
        self.op(move |o| o.linear_fp8_concat(&xs.iter().collect::<Vec<_>>(), &w, b.as_ref()))
    }

    fn linear_fp8_gelu_tanh(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (x, w, b) = (x.clone(), w.clone(), bias.cloned());
        self.op(move |o| o.linear_fp8_gelu_tanh(&x, &w, b.as_ref()))
    }

    fn end_forward(&self) -> Result<()> {
        self.inner.ops().map_or(Ok(()), |o| o.end_forward())
    }

    fn fp8_tensor_cores(&self) -> bool {
        self.inner.ops().is_some_and(|o| o.fp8_tensor_cores())
    }

    fn fp8_reference_reason(&self) -> String {
        self.inner
            .ops()
            .map_or_else(|| "no compute plane".into(), |o| o.fp8_reference_reason())
    }

    fn cast(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        let x = x.clone();
        self.op(move |o| o.cast(&x, dtype))
    }

    fn embedding(&self, table: &Tensor, ids: &[u32]) -> Result<Tensor> {
        let (table, ids) = (table.clone(), ids.to_vec());
        self.op(move |o| o.embedding(&table, &ids))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostDeviceConfig;

    fn device() -> Arc<DeferredComputeDevice> {
        let inner = HostDevice::new(HostDeviceConfig {
            capacity: 1 << 24,
            ..HostDeviceConfig::default()
        })
        .unwrap();
        DeferredComputeDevice::new(inner).unwrap()
    }

    /// Compute reads a device buffer that a copy on another stream then overwrites: with
    /// the copy waiting for compute's event the op sees the old bytes, without the wait it
    /// sees the new ones — every time, though the host queued the copy after the op.
    #[test]
    fn a_copy_that_does_not_wait_for_compute_lands_before_it() {
        for wait in [true, false] {
            for _ in 0..20 {
                let d = device();
                let compute = d.compute_stream();
                let copy = d.create_stream().unwrap();
                let w = d.tensor_from_f32(&[4], DType::F32, &[1.0; 4]).unwrap();
                let slot = device_slice(&w).unwrap();
                let y = d.affine(&w, 2.0, 0.0).unwrap();
                let used = d.record_event(&compute).unwrap();
                if wait {
                    d.wait_event(&copy, &used).unwrap();
                }
                let refill = d.alloc_pinned(16).unwrap();
                refill
                    .with_bytes_mut(|b| {
                        b.copy_from_slice(&DType::F32.encode_f32(&[5.0; 4]).unwrap())
                    })
                    .unwrap();
                d.copy_h2d(&refill.slice_all(), &slot, &copy).unwrap();
                let got = d.to_f32_vec(&y).unwrap();
                let want = if wait { [2.0; 4] } else { [10.0; 4] };
                assert_eq!(got, want, "wait={wait}");
            }
        }
    }

    /// A chain of ops gives what the host device gives, and the output of each op is only
    /// final once the host waits.
    #[test]
    fn ops_in_stream_order_match_the_host_device() {
        let d = device();
        let host = HostDevice::with_capacity(1 << 24).unwrap();
        let run = |o: &dyn Ops| -> Vec<f32> {
            let x = o
                .tensor_from_f32(&[2, 3], DType::F32, &[0.5, -1.0, 2.0, 3.0, 0.25, -0.75])
                .unwrap();
            let w = o
                .tensor_from_f32(
                    &[4, 3],
                    DType::F32,
                    &[
                        0.1, 0.2, -0.3, 0.4, 0.5, 0.6, -0.7, 0.8, 0.9, 1.0, -1.1, 1.2,
                    ],
                )
                .unwrap();
            let y = o.linear(&x, &w, None).unwrap();
            let z = o.unary_owned(y, UnaryOp::Tanh).unwrap();
            let s = o.softmax(&z).unwrap();
            o.to_f32_vec(&s).unwrap()
        };
        assert_eq!(run(&*d), run(&*host));
    }
}
