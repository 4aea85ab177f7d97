//! Systematic fault injection: [`FaultInjectingDevice`], a [`Device`] (and [`Ops`]) wrapper
//! that counts every allocation, copy and event wait going through it and makes the N-th one
//! of a kind fail — with a typed error, or with a panic.
//!
//! Tests sweep N over every fault point of a whole forward (first a clean run counts them,
//! see [`FaultCounts`]) and check DDO's managed error boundary after each failure.
//!
//! What is counted, per [`FaultKind`]:
//! - [`FaultKind::Alloc`]: [`Device::alloc`], [`Device::alloc_pinned`],
//!   [`Device::register_host`] (pinning in place counts as a pinned allocation), and **op-internal
//!   allocations**: every [`Ops`] call that returns a tensor allocates exactly one device
//!   output on the host backend (its only device allocation that outlives the call: the
//!   default [`Ops::group_norm_silu`], a composition, also makes an intermediate and frees it
//!   before returning, not counted), so each such op call counts as one allocation. The inner op runs first (ops have no side effect but their output) and
//!   its output is then dropped, so the error names the exact bytes the op asked for.
//!   [`Ops::to_f32_vec`] allocates nothing on the device and is not counted. A backend whose
//!   ops make workspace allocations of their own (cuBLAS) has those counted only as part of
//!   the op; so has an op whose backend composes it of others (the host's
//!   [`Ops::linear_gelu_tanh`], [`Ops::layer_norm_modulate`], [`Ops::gated_add`]): one op
//!   point and one allocation, its output.
//! - [`FaultKind::Copy`]: [`Device::copy_h2d`], [`Device::copy_d2h`], [`Device::copy_d2d`].
//!   Copies ops make internally are not counted.
//! - [`FaultKind::EventWait`]: [`Device::wait_event`] and [`Device::synchronize_event`].
//! - [`FaultKind::Op`]: every [`Ops`] call but [`Ops::to_f32_vec`], before it runs. Models
//!   call ops inside their leaves' forwards, so a panic armed here is a panic inside a
//!   leaf's forward (or in the model code between leaves).
//!
//! An injected allocation failure is [`CoreError::OutOfMemory`] (what a real device says, so
//! routes' out-of-memory handling runs); an injected copy or wait failure is
//! [`CoreError::Injected`], as is an injected op failure. A failed call does nothing: the inner device is not called (or,
//! for an op, its output is released before the error returns).
//!
//! Every handle the wrapper hands out is the inner device's own, so the wrapper and the
//! inner device can be mixed freely; the wrapper reports the inner device's id.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::device::{
    AllocatorKind, Device, DeviceBuffer, DeviceId, DeviceSlice, Event, MemoryInfo, Stream,
};
use crate::dtype::DType;
use crate::error::{CoreError, Result};
use crate::host_memory::{HostBuffer, HostSlice};
use crate::ops::{BinaryOp, Conv2dParams, Ops, ReduceOp, UnaryOp};
use crate::tensor::Tensor;

/// A kind of fault point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultKind {
    /// Device allocations, pinned host allocations and op outputs.
    Alloc,
    /// Host↔device and device↔device copies.
    Copy,
    /// `wait_event` and `synchronize_event`.
    EventWait,
    /// Calls into the compute plane ([`Ops`]).
    Op,
}

impl FaultKind {
    /// Every kind, once.
    pub const ALL: [FaultKind; 4] = [
        FaultKind::Alloc,
        FaultKind::Copy,
        FaultKind::EventWait,
        FaultKind::Op,
    ];

    /// Short name.
    pub const fn as_str(self) -> &'static str {
        match self {
            FaultKind::Alloc => "alloc",
            FaultKind::Copy => "copy",
            FaultKind::EventWait => "event_wait",
            FaultKind::Op => "op",
        }
    }

    const fn index(self) -> usize {
        match self {
            FaultKind::Alloc => 0,
            FaultKind::Copy => 1,
            FaultKind::EventWait => 2,
            FaultKind::Op => 3,
        }
    }
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What an armed fault does when its point is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultAction {
    /// Returns a typed error (see the module docs for which).
    Error,
    /// Panics with a message starting `injected panic`.
    Panic,
}

/// How many fault points of each kind have been passed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultCounts {
    /// Allocations (device, pinned, op outputs).
    pub allocs: u64,
    /// Copies.
    pub copies: u64,
    /// Event waits.
    pub event_waits: u64,
    /// Op calls.
    pub ops: u64,
}

impl FaultCounts {
    /// The count of `kind`.
    pub fn get(&self, kind: FaultKind) -> u64 {
        match kind {
            FaultKind::Alloc => self.allocs,
            FaultKind::Copy => self.copies,
            FaultKind::EventWait => self.event_waits,
            FaultKind::Op => self.ops,
        }
    }

    /// All kinds together.
    pub fn total(&self) -> u64 {
        self.allocs + self.copies + self.event_waits + self.ops
    }

    /// The points passed between `earlier` and `self`.
    pub fn since(&self, earlier: &FaultCounts) -> FaultCounts {
        FaultCounts {
            allocs: self.allocs - earlier.allocs,
            copies: self.copies - earlier.copies,
            event_waits: self.event_waits - earlier.event_waits,
            ops: self.ops - earlier.ops,
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Armed {
    kind: FaultKind,
    at: u64,
    action: FaultAction,
}

/// A [`Device`] that forwards to an inner device, counting fault points and failing the
/// one it is armed for. See the module docs for what counts.
pub struct FaultInjectingDevice {
    inner: Arc<dyn Device>,
    counts: [AtomicU64; 4],
    armed: Mutex<Option<Armed>>,
    fired: AtomicU64,
    /// Per op name: calls and nanoseconds, when timing is on.
    op_times: Mutex<Option<std::collections::BTreeMap<String, (u64, u64)>>>,
    /// Whether the fp8 linears pass a non-finite input through
    /// ([`FaultInjectingDevice::pass_fp8_non_finite`]).
    pass_fp8_non_finite: std::sync::atomic::AtomicBool,
    /// The linear calls made since [`FaultInjectingDevice::record_linears`], while on.
    linears: Mutex<Option<Vec<crate::LinearCall>>>,
}

impl fmt::Debug for FaultInjectingDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "FaultInjectingDevice({:?}, {:?}, armed {:?})",
            self.inner,
            self.counts(),
            *self.armed.lock()
        )
    }
}

impl FaultInjectingDevice {
    /// Wraps `inner`, unarmed: it only counts.
    pub fn new(inner: Arc<dyn Device>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            counts: Default::default(),
            armed: Mutex::new(None),
            fired: AtomicU64::new(0),
            op_times: Mutex::new(None),
            pass_fp8_non_finite: std::sync::atomic::AtomicBool::new(false),
            linears: Mutex::new(None),
        })
    }

    /// Starts noting each 16-bit or f32 linear call ([`Ops::linear`],
    /// [`Ops::linear_gelu_tanh`], [`Ops::linear_concat`]) as a [`crate::LinearCall`];
    /// [`FaultInjectingDevice::recorded_linears`] takes what was noted.
    pub fn record_linears(&self) {
        *self.linears.lock() = Some(Vec::new());
    }

    /// The linear calls noted since [`FaultInjectingDevice::record_linears`], in order; the
    /// noting stops.
    pub fn recorded_linears(&self) -> Vec<crate::LinearCall> {
        self.linears.lock().take().unwrap_or_default()
    }

    fn note_linear(
        &self,
        kind: crate::LinearKind,
        xs: &[&Tensor],
        w: &Tensor,
        bias: Option<&Tensor>,
    ) {
        if let Some(calls) = self.linears.lock().as_mut() {
            calls.push(crate::LinearCall::of(kind, xs, w, bias));
        }
    }

    /// Makes [`Ops::linear_fp8`] and [`Ops::linear_fp8_gelu_tanh`] behave as a device's fp8
    /// GEMM does with a NaN or an Inf in its input: where the inner op stops with
    /// [`CoreError::NonFiniteActivation`] (the host reference reads every input), this
    /// returns the product's shape filled with NaN (the scale is NaN, and so is every
    /// product), leaving the finite checks after the step to find it. So the host backend
    /// runs the path a GPU takes to name the layer.
    pub fn pass_fp8_non_finite(&self, on: bool) {
        self.pass_fp8_non_finite.store(on, Ordering::Release);
    }

    /// `result` of an fp8 linear of `x` and `w`, its non-finite input passed through as NaN
    /// where [`FaultInjectingDevice::pass_fp8_non_finite`] asks.
    fn fp8_result(&self, result: Result<Tensor>, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        match result {
            Err(CoreError::NonFiniteActivation { .. })
                if self.pass_fp8_non_finite.load(Ordering::Acquire) =>
            {
                let mut shape = x.shape().to_vec();
                if let (Some(last), Some(&n)) = (shape.last_mut(), w.shape().first()) {
                    *last = n;
                }
                let values = vec![f32::NAN; shape.iter().product()];
                self.inner_ops()?
                    .tensor_from_f32(&shape, x.dtype(), &values)
            }
            other => other,
        }
    }

    /// Starts (or stops) timing every op: the device is synchronised before and after each
    /// op call, so each time is the op's own device time plus one synchronisation (a
    /// profiling aid; it serialises the host with the device). Starting clears the table.
    pub fn time_ops(&self, on: bool) {
        *self.op_times.lock() = on.then(Default::default);
    }

    /// The timing table: `(op, calls, total milliseconds)`, by op name.
    pub fn op_times(&self) -> Vec<(String, u64, f64)> {
        self.op_times
            .lock()
            .as_ref()
            .map(|t| {
                t.iter()
                    .map(|(k, &(n, ns))| (k.clone(), n, ns as f64 / 1e6))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Wraps `inner` and arms it: the `at`-th point of `kind` (1-based, counted from now)
    /// fails with `action`.
    pub fn failing(
        inner: Arc<dyn Device>,
        kind: FaultKind,
        at: u64,
        action: FaultAction,
    ) -> Arc<Self> {
        let d = Self::new(inner);
        d.arm(kind, at, action);
        d
    }

    /// The wrapped device.
    pub fn inner(&self) -> &Arc<dyn Device> {
        &self.inner
    }

    /// Arms the `at`-th point of `kind` counted from now (1-based; 0 never fires). One
    /// fault at a time: arming again replaces the previous one. A fault fires once.
    pub fn arm(&self, kind: FaultKind, at: u64, action: FaultAction) {
        let at = if at == 0 {
            0
        } else {
            self.counts[kind.index()].load(Ordering::Acquire) + at
        };
        *self.armed.lock() = Some(Armed { kind, at, action });
    }

    /// Disarms without firing.
    pub fn disarm(&self) {
        *self.armed.lock() = None;
    }

    /// Fault points passed so far, by kind.
    pub fn counts(&self) -> FaultCounts {
        FaultCounts {
            allocs: self.counts[0].load(Ordering::Acquire),
            copies: self.counts[1].load(Ordering::Acquire),
            event_waits: self.counts[2].load(Ordering::Acquire),
            ops: self.counts[3].load(Ordering::Acquire),
        }
    }

    /// How many faults have fired.
    pub fn fired(&self) -> u64 {
        self.fired.load(Ordering::Acquire)
    }

    /// Passes one point of `kind`; `Err` (or a panic) when it is the armed one.
    fn point(&self, kind: FaultKind, what: impl FnOnce() -> String) -> Result<()> {
        let n = self.counts[kind.index()].fetch_add(1, Ordering::AcqRel) + 1;
        let hit = {
            let mut armed = self.armed.lock();
            match *armed {
                Some(a) if a.kind == kind && a.at == n => armed.take(),
                _ => None,
            }
        };
        let Some(a) = hit else { return Ok(()) };
        self.fired.fetch_add(1, Ordering::AcqRel);
        let message = format!("{kind} #{n} on {}: {}", self.inner.id(), what());
        match a.action {
            FaultAction::Panic => panic!("injected panic at {message}"),
            FaultAction::Error => Err(CoreError::Injected(message)),
        }
    }

    /// An allocation point of `bytes`: out of memory when armed.
    fn alloc_point(&self, bytes: u64, what: &str) -> Result<()> {
        self.point(FaultKind::Alloc, || format!("{what} of {bytes} B"))
            .map_err(|e| match e {
                CoreError::Injected(_) => {
                    let info = self.inner.memory_info();
                    CoreError::OutOfMemory {
                        device: format!("{} (injected)", self.inner.id()),
                        requested: bytes,
                        allocated: info.allocated,
                        capacity: info.capacity,
                    }
                }
                other => other,
            })
    }

    /// The wrapped device's ops, bypassing this wrapper: nothing counted, nothing armed fires.
    pub fn inner_ops(&self) -> Result<&dyn Ops> {
        crate::device::ops_of(&*self.inner)
    }

    /// Passes an op point, runs an op that allocates one output, then passes its
    /// allocation point.
    fn op<T: crate::profile::OpOutput>(
        &self,
        name: &str,
        f: impl FnOnce(&dyn Ops) -> Result<T>,
    ) -> Result<T> {
        self.point(FaultKind::Op, || name.to_string())?;
        let timing = self.op_times.lock().is_some();
        let started = if timing {
            self.inner.synchronize()?;
            Some(std::time::Instant::now())
        } else {
            None
        };
        let out = f(self.inner_ops()?)?;
        if let Some(t0) = started {
            self.inner.synchronize()?;
            let ns = t0.elapsed().as_nanos() as u64;
            if let Some(table) = self.op_times.lock().as_mut() {
                let e = table.entry(name.to_string()).or_insert((0, 0));
                e.0 += 1;
                e.1 += ns;
            }
        }
        self.alloc_point(out.written_bytes(), name)?;
        Ok(out)
    }
}

impl Device for FaultInjectingDevice {
    fn id(&self) -> DeviceId {
        self.inner.id()
    }

    fn allocator(&self) -> AllocatorKind {
        self.inner.allocator()
    }

    fn scratch_bytes(&self) -> u64 {
        self.inner.scratch_bytes()
    }

    fn conv2d_scratch_bytes(
        &self,
        elems: usize,
        channels: usize,
        filters: usize,
        kernel: usize,
        dtype: crate::DType,
    ) -> u64 {
        self.inner
            .conv2d_scratch_bytes(elems, channels, filters, kernel, dtype)
    }

    fn alloc(&self, bytes: usize) -> Result<DeviceBuffer> {
        self.alloc_point(bytes as u64, "alloc")?;
        self.inner.alloc(bytes)
    }

    fn release_after(&self, buffer: DeviceBuffer, stream: &Stream) -> Result<()> {
        self.inner.release_after(buffer, stream)
    }

    fn alloc_pinned(&self, bytes: usize) -> Result<HostBuffer> {
        self.alloc_point(bytes as u64, "alloc_pinned")?;
        self.inner.alloc_pinned(bytes)
    }

    fn register_host(&self, buffer: &HostBuffer) -> Result<HostBuffer> {
        self.alloc_point(buffer.len() as u64, "register_host")?;
        self.inner.register_host(buffer)
    }

    fn release_host(&self, buffer: HostBuffer) {
        self.inner.release_host(buffer);
    }

    fn unpin_released(&self) -> u64 {
        self.inner.unpin_released()
    }

    fn host_registrations(&self) -> u64 {
        self.inner.host_registrations()
    }

    fn setup_calls(&self) -> crate::SetupCalls {
        self.inner.setup_calls()
    }

    fn host_waits_since(&self, since: std::time::Instant) -> Vec<ddo_metrics::HostWait> {
        self.inner.host_waits_since(since)
    }

    fn prepare_linears(&self, calls: &[crate::LinearCall], max_bytes: u64) -> Result<usize> {
        self.inner.prepare_linears(calls, max_bytes)
    }

    fn compute_stream(&self) -> Stream {
        self.inner.compute_stream()
    }

    fn create_stream(&self) -> Result<Stream> {
        self.inner.create_stream()
    }

    fn supports_streams(&self) -> bool {
        self.inner.supports_streams()
    }

    fn copy_h2d(&self, src: &HostSlice, dst: &DeviceSlice, stream: &Stream) -> Result<()> {
        self.point(FaultKind::Copy, || format!("copy_h2d of {} B", src.len()))?;
        self.inner.copy_h2d(src, dst, stream)
    }

    fn copy_d2h(&self, src: &DeviceSlice, dst: &HostSlice, stream: &Stream) -> Result<()> {
        self.point(FaultKind::Copy, || format!("copy_d2h of {} B", src.len()))?;
        self.inner.copy_d2h(src, dst, stream)
    }

    fn copy_d2d(&self, src: &DeviceSlice, dst: &DeviceSlice, stream: &Stream) -> Result<()> {
        self.point(FaultKind::Copy, || format!("copy_d2d of {} B", src.len()))?;
        self.inner.copy_d2d(src, dst, stream)
    }

    fn record_event(&self, stream: &Stream) -> Result<Event> {
        self.inner.record_event(stream)
    }

    fn record_timed_event(&self, stream: &Stream) -> Result<Event> {
        self.inner.record_timed_event(stream)
    }

    fn event_elapsed_ns(&self, start: &Event, end: &Event) -> Result<Option<i64>> {
        self.inner.event_elapsed_ns(start, end)
    }

    fn wait_event(&self, stream: &Stream, event: &Event) -> Result<()> {
        self.point(FaultKind::EventWait, || "wait_event".into())?;
        self.inner.wait_event(stream, event)
    }

    fn event_complete(&self, event: &Event) -> Result<bool> {
        self.inner.event_complete(event)
    }

    fn synchronize_event(&self, event: &Event) -> Result<()> {
        self.point(FaultKind::EventWait, || "synchronize_event".into())?;
        self.inner.synchronize_event(event)
    }

    fn synchronize_stream(&self, stream: &Stream) -> Result<()> {
        self.inner.synchronize_stream(stream)
    }

    fn synchronize(&self) -> Result<()> {
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

    fn begin_op_profile(&self) -> bool {
        self.inner.begin_op_profile()
    }

    fn settle(&self, timeout: std::time::Duration) -> Result<bool> {
        self.inner.settle(timeout)
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

    fn end_op_profile(&self) -> Result<Option<crate::profile::OpProfile>> {
        self.inner.end_op_profile()
    }

    fn ops(&self) -> Option<&dyn Ops> {
        self.inner.ops().map(|_| self as &dyn Ops)
    }
}

impl Ops for FaultInjectingDevice {
    fn tensor_from_f32(&self, shape: &[usize], dtype: DType, values: &[f32]) -> Result<Tensor> {
        self.op("tensor_from_f32", |o| {
            o.tensor_from_f32(shape, dtype, values)
        })
    }

    fn to_f32_vec(&self, x: &Tensor) -> Result<Vec<f32>> {
        self.inner_ops()?.to_f32_vec(x)
    }

    fn count_non_finite(&self, x: &Tensor) -> Result<u64> {
        self.inner_ops()?.count_non_finite(x)
    }

    fn linear(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        self.note_linear(crate::LinearKind::Plain, &[x], w, bias);
        self.op("linear", |o| o.linear(x, w, bias))
    }

    fn matmul(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        self.op("matmul", |o| o.matmul(a, b))
    }

    fn conv2d(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        params: Conv2dParams,
    ) -> Result<Tensor> {
        self.op("conv2d", |o| o.conv2d(x, w, bias, params))
    }

    fn group_norm(
        &self,
        x: &Tensor,
        groups: usize,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor> {
        self.op("group_norm", |o| o.group_norm(x, groups, weight, bias, eps))
    }

    fn group_norm_silu(
        &self,
        x: &Tensor,
        groups: usize,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor> {
        self.op("group_norm_silu", |o| {
            o.group_norm_silu(x, groups, weight, bias, eps)
        })
    }

    fn layer_norm(
        &self,
        x: &Tensor,
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f32,
    ) -> Result<Tensor> {
        self.op("layer_norm", |o| o.layer_norm(x, weight, bias, eps))
    }

    fn rms_norm(&self, x: &Tensor, weight: Option<&Tensor>, eps: f32) -> Result<Tensor> {
        self.op("rms_norm", |o| o.rms_norm(x, weight, eps))
    }

    fn unary(&self, x: &Tensor, op: UnaryOp) -> Result<Tensor> {
        self.op("unary", |o| o.unary(x, op))
    }

    fn unary_owned(&self, x: Tensor, op: UnaryOp) -> Result<Tensor> {
        self.op("unary_owned", move |o| o.unary_owned(x, op))
    }

    fn linear_concat(&self, xs: &[&Tensor], w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        self.note_linear(crate::LinearKind::Concat(Vec::new()), xs, w, bias);
        self.op("linear_concat", |o| o.linear_concat(xs, w, bias))
    }

    fn binary(&self, a: &Tensor, b: &Tensor, op: BinaryOp) -> Result<Tensor> {
        self.op("binary", |o| o.binary(a, b, op))
    }

    fn affine(&self, x: &Tensor, mul: f32, add: f32) -> Result<Tensor> {
        self.op("affine", |o| o.affine(x, mul, add))
    }

    fn softmax(&self, x: &Tensor) -> Result<Tensor> {
        self.op("softmax", |o| o.softmax(x))
    }

    fn reduce(&self, x: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        self.op("reduce", |o| o.reduce(x, dim, op))
    }

    fn upsample_nearest2x(&self, x: &Tensor) -> Result<Tensor> {
        self.op("upsample_nearest2x", |o| o.upsample_nearest2x(x))
    }

    fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        scale: f32,
    ) -> Result<Tensor> {
        self.op("attention", |o| o.attention(q, k, v, mask, scale))
    }

    fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        self.op("rope", |o| o.rope(x, cos, sin))
    }

    fn concat(&self, xs: &[&Tensor], dim: usize) -> Result<Tensor> {
        self.op("concat", |o| o.concat(xs, dim))
    }

    fn narrow(&self, x: &Tensor, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        self.op("narrow", |o| o.narrow(x, dim, start, len))
    }

    fn permute(&self, x: &Tensor, dims: &[usize]) -> Result<Tensor> {
        self.op("permute", |o| o.permute(x, dims))
    }

    fn cast(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        self.op("cast", |o| o.cast(x, dtype))
    }

    fn embedding(&self, table: &Tensor, ids: &[u32]) -> Result<Tensor> {
        self.op("embedding", |o| o.embedding(table, ids))
    }

    fn linear_accumulate(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        acc: Tensor,
        gelu_tanh: bool,
    ) -> Result<Tensor> {
        self.op("linear_accumulate", |o| {
            o.linear_accumulate(x, w, bias, acc, gelu_tanh)
        })
    }

    fn dequantize(&self, x: &Tensor, dtype: DType) -> Result<Tensor> {
        self.op("dequantize", |o| o.dequantize(x, dtype))
    }

    fn linear_gelu_tanh(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        self.note_linear(crate::LinearKind::GeluTanh, &[x], w, bias);
        self.op("linear_gelu_tanh", |o| o.linear_gelu_tanh(x, w, bias))
    }

    fn layer_norm_modulate(
        &self,
        x: &Tensor,
        eps: f32,
        scale: &Tensor,
        shift: &Tensor,
    ) -> Result<Tensor> {
        self.op("layer_norm_modulate", |o| {
            o.layer_norm_modulate(x, eps, scale, shift)
        })
    }

    fn gated_add(&self, x: &Tensor, gate: &Tensor, y: &Tensor) -> Result<Tensor> {
        self.op("gated_add", |o| o.gated_add(x, gate, y))
    }

    fn gated_add_layer_norm_modulate(
        &self,
        x: &Tensor,
        gate: &Tensor,
        y: &Tensor,
        eps: f32,
        scale: &Tensor,
        shift: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        self.op("gated_add_layer_norm_modulate", |o| {
            o.gated_add_layer_norm_modulate(x, gate, y, eps, scale, shift)
        })
    }

    fn attention_input(
        &self,
        part: &crate::ops::AttentionInput<'_>,
        dst: Option<Tensor>,
    ) -> Result<Tensor> {
        self.op("attention_input", |o| o.attention_input(part, dst))
    }

    fn attention_tokens(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
        scale: f32,
    ) -> Result<Tensor> {
        self.op("attention", |o| o.attention_tokens(q, k, v, mask, scale))
    }

    fn linear_fp8(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
        self.op("linear_fp8", |o| {
            self.fp8_result(o.linear_fp8(x, w, bias), x, w)
        })
    }

    fn linear_fp8_concat(
        &self,
        xs: &[&Tensor],
        w: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        self.op("linear_fp8", |o| {
            let r = o.linear_fp8_concat(xs, w, bias);
            match xs {
                [x, ..] => self.fp8_result(r, x, w),
                [] => r,
            }
        })
    }

    fn linear_fp8_gelu_tanh(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Tensor> {
        self.op("linear_fp8_gelu_tanh", |o| {
            self.fp8_result(o.linear_fp8_gelu_tanh(x, w, bias), x, w)
        })
    }

    /// Counted in the op table (as `end_forward`, no time) while timing is on, so tests can
    /// see that each forward ends.
    fn end_forward(&self) -> Result<()> {
        if let Some(table) = self.op_times.lock().as_mut() {
            table.entry("end_forward".to_string()).or_insert((0, 0)).0 += 1;
        }
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

    fn best_gemm_seconds(
        &self,
        shape: &crate::profile::GemmShape,
        calls: usize,
    ) -> Result<Option<f64>> {
        self.inner_ops()?.best_gemm_seconds(shape, calls)
    }
}
