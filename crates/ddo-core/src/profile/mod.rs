//! Per-op profiles: the device time of every [`Ops`](crate::ops::Ops) call a backend runs
//! between [`Device::begin_op_profile`] and [`Device::end_op_profile`], summed by op class
//! (`linear`, `attention`, `binary.Mul`, ...), with the floating-point work of the GEMM-like
//! ops and the bytes every op reads and writes, so the next compute gap is visible without
//! guessing (`ddo bench --profile`).
//!
//! A backend hands out a [`ProfiledOps`] from [`Device::ops`]: its own ops, each run through
//! an [`OpProfiler`], with the op classes, input bytes and flop counts written here once for
//! every backend. When no profile is active that costs one atomic load per op; when one is,
//! the op is bracketed by two timed events on the compute stream
//! ([`Device::record_timed_event`]), resolved when the profile ends. Bracketing serialises nothing that was not serial already: ops are queued in
//! order on one stream. Copies of a streaming route run on other streams and are not ops,
//! so a profile of a streamed forward shows compute only, waits on copies included in the
//! op that waited.

use std::collections::BTreeMap;
use std::fmt::{self, Debug};
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use serde::Serialize;

use crate::device::{Device, Event};
use crate::{DType, Result, Tensor};

/// One op class of a [`OpProfile`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OpClassTime {
    /// The class: the [`Ops`](crate::ops::Ops) method, with the variant for `unary`, `binary`
    /// and `reduce` (`binary.Mul`).
    pub op: String,
    /// Calls.
    pub calls: u64,
    /// Device nanoseconds, summed over the calls.
    pub ns: u64,
    /// Floating-point operations (a multiply-add counts two) of the GEMM-like ops
    /// (`linear`, `matmul`, `conv2d`, `attention`); 0 for the others.
    pub flops: u64,
    /// Bytes of the inputs and outputs, summed over the calls (each tensor counted once per
    /// call, as if read or written once).
    pub bytes: u64,
    /// Device nanoseconds the compute stream spent between the previous op's end and each
    /// call's start, summed: work outside the ops (a route's waits for its copies, its own
    /// kernels) or nothing queued yet.
    pub idle_before_ns: u64,
}

/// One op call of a [`OpProfile`], in the order the forward ran them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OpCall {
    /// The class.
    pub op: String,
    /// Device nanoseconds from its start to its end event.
    pub ns: u64,
    /// Device nanoseconds from the previous call's end to its start.
    pub idle_before_ns: u64,
}

/// The shape of one linear call: `x [rows, k] · w [n, k]ᵀ`, the input in `dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct GemmShape {
    /// Rows of the input (tokens, batch included).
    pub rows: usize,
    /// Input features.
    pub k: usize,
    /// Output features.
    pub n: usize,
    /// The input's dtype (what the GEMM computes in).
    pub dtype: DType,
}

impl GemmShape {
    /// `2 · rows · k · n`.
    pub fn flops(&self) -> u64 {
        2u64.saturating_mul(self.rows as u64)
            .saturating_mul(self.k as u64)
            .saturating_mul(self.n as u64)
    }

    /// The shape of `linear(x, w)` (`None` for a weight that is not 2-D).
    pub fn of(x: &Tensor, w: &Tensor) -> Option<Self> {
        let [n, k] = *w.shape() else { return None };
        let rows = x.numel().checked_div(k)?;
        Some(Self {
            rows,
            k,
            n,
            dtype: x.dtype(),
        })
    }
}

/// The linear calls of one class at one shape, in a [`OpProfile`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LinearShapeTime {
    /// The class (`linear`, `linear_fp8`, `linear_fp8_gelu_tanh`, ...).
    pub op: String,
    /// The shape (a `linear_concat`'s rows and summed width).
    pub shape: GemmShape,
    /// Calls.
    pub calls: u64,
    /// Device nanoseconds, summed over the calls.
    pub ns: u64,
}

impl LinearShapeTime {
    /// `class rowsxkxn`, as the profile table names it.
    pub fn label(&self) -> String {
        format!(
            "{} {}x{}x{}",
            self.op, self.shape.rows, self.shape.k, self.shape.n
        )
    }
}

/// A per-op profile: the classes, the most time first.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct OpProfile {
    /// The op classes, by descending time.
    pub classes: Vec<OpClassTime>,
    /// The linear call with the most flops (the shape `ddo bench` measures the device's GEMM
    /// rate at, for its compute floor).
    pub largest_linear: Option<GemmShape>,
    /// The linear classes' calls by shape, the most time first: which shapes run below the
    /// class's rate.
    pub linears: Vec<LinearShapeTime>,
    /// Every call in order (two forwards' profiles compared call by call show where one
    /// loses time).
    pub calls: Vec<OpCall>,
    /// What the backend says of how the ops ran, once each (on CUDA: why attention ran on
    /// DDO's kernels where cuDNN was missing or refused a shape).
    pub notes: Vec<String>,
}

impl OpProfile {
    /// Device nanoseconds of all the ops.
    pub fn total_ns(&self) -> u64 {
        self.classes.iter().map(|c| c.ns).sum()
    }

    /// Calls of all the ops.
    pub fn total_calls(&self) -> u64 {
        self.classes.iter().map(|c| c.calls).sum()
    }

    /// Device nanoseconds the compute stream spent between ops.
    pub fn total_idle_ns(&self) -> u64 {
        self.classes.iter().map(|c| c.idle_before_ns).sum()
    }

    /// The profile as a text table: class, calls, time, share of the total, and the rate
    /// (TFLOP/s for the GEMM-like ops, GB/s of tensor bytes for the others).
    pub fn format_text(&self) -> String {
        let total = self.total_ns().max(1);
        let w = self
            .classes
            .iter()
            .map(|c| c.op.len())
            .chain(self.linears.iter().map(|l| l.label().len()))
            .max()
            .unwrap_or(2)
            .max(8);
        let mut s = format!(
            "{:<w$} {:>7} {:>11} {:>7} {:>14} {:>12}\n",
            "op class", "calls", "time", "share", "rate", "idle before"
        );
        for c in &self.classes {
            let secs = c.ns as f64 / 1e9;
            let rate = if secs <= 0.0 {
                "-".to_string()
            } else if c.flops > 0 {
                format!("{:.1} TFLOP/s", c.flops as f64 / secs / 1e12)
            } else {
                format!("{:.0} GB/s", c.bytes as f64 / secs / 1e9)
            };
            s += &format!(
                "{:<w$} {:>7} {:>8.3} ms {:>6.1}% {:>14} {:>9.3} ms\n",
                c.op,
                c.calls,
                c.ns as f64 / 1e6,
                100.0 * c.ns as f64 / total as f64,
                rate,
                c.idle_before_ns as f64 / 1e6
            );
        }
        s += &format!(
            "{:<w$} {:>7} {:>8.3} ms {:>7} {:>14} {:>9.3} ms\n",
            "total",
            self.total_calls(),
            self.total_ns() as f64 / 1e6,
            "",
            "",
            self.total_idle_ns() as f64 / 1e6
        );
        if !self.linears.is_empty() {
            s += &format!(
                "{:<w$} {:>7} {:>11} {:>7} {:>14}\n",
                "linear rowsxkxn", "calls", "time", "share", "rate"
            );
        }
        for l in &self.linears {
            let secs = l.ns as f64 / 1e9;
            let rate = if secs > 0.0 {
                format!(
                    "{:.1} TFLOP/s",
                    l.shape.flops() as f64 * l.calls as f64 / secs / 1e12
                )
            } else {
                "-".to_string()
            };
            s += &format!(
                "{:<w$} {:>7} {:>8.3} ms {:>6.1}% {rate:>14}\n",
                l.label(),
                l.calls,
                l.ns as f64 / 1e6,
                100.0 * l.ns as f64 / total as f64,
            );
        }
        for note in &self.notes {
            s += &format!("note: {note}\n");
        }
        s
    }
}

/// One op recorded by an active profile, resolved at its end.
struct Pending {
    op: String,
    /// A linear's shape.
    shape: Option<GemmShape>,
    flops: u64,
    bytes: u64,
    start: Event,
    end: Event,
}

/// The recorder a backend runs its ops through (see the module docs).
#[derive(Default)]
pub struct OpProfiler {
    active: AtomicBool,
    pending: Mutex<Vec<Pending>>,
    largest_linear: Mutex<Option<GemmShape>>,
}

impl Debug for OpProfiler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpProfiler")
            .field("active", &self.is_active())
            .field("pending", &self.pending.lock().len())
            .finish()
    }
}

/// The flop count of an op, from its inputs and output (0 for ops that are not GEMM-like).
pub type FlopCount<'a> = &'a dyn Fn(&Tensor) -> u64;

impl OpProfiler {
    /// A recorder with no profile active.
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts a profile, dropping what an unfinished one had recorded.
    pub fn begin(&self) {
        self.pending.lock().clear();
        *self.largest_linear.lock() = None;
        self.active.store(true, Ordering::SeqCst);
    }

    /// Notes a linear call of `x` and `w` while a profile is active: the profile keeps the
    /// one with the most flops. Its shape, while a profile is active.
    pub fn note_linear(&self, x: &Tensor, w: &Tensor) -> Option<GemmShape> {
        if !self.is_active() {
            return None;
        }
        let shape = GemmShape::of(x, w)?;
        let mut largest = self.largest_linear.lock();
        if largest.is_none_or(|l| shape.flops() > l.flops()) {
            *largest = Some(shape);
        }
        Some(shape)
    }

    /// Whether a profile is active.
    pub fn is_active(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }

    /// Runs `f`, an op of class `op` (`variant` appended after a dot) reading `in_bytes()`
    /// ([`tensor_bytes`] of its inputs), on `device`'s compute stream; while a profile is
    /// active it is timed by two events and its bytes (inputs and output) and
    /// `flops(output)` are recorded, and a linear's `shape` (timed by shape too). With no
    /// profile active neither count is computed.
    #[allow(clippy::too_many_arguments)]
    pub fn run<T: OpOutput>(
        &self,
        device: &dyn Device,
        op: &str,
        variant: Option<&dyn Debug>,
        shape: Option<GemmShape>,
        in_bytes: impl FnOnce() -> u64,
        flops: FlopCount<'_>,
        f: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        if !self.is_active() {
            return f();
        }
        let in_bytes = in_bytes();
        let stream = device.compute_stream();
        let start = device.record_timed_event(&stream)?;
        let out = f()?;
        let end = device.record_timed_event(&stream)?;
        let bytes = in_bytes.saturating_add(out.written_bytes());
        let op = match variant {
            Some(v) => format!("{op}.{v:?}"),
            None => op.to_string(),
        };
        self.pending.lock().push(Pending {
            op,
            shape,
            flops: flops(out.first()),
            bytes,
            start,
            end,
        });
        Ok(out)
    }

    /// Ends the active profile: waits for its ops and sums their times by class. `None`
    /// when no profile was active or the device keeps no timestamps.
    pub fn finish(&self, device: &dyn Device) -> Result<Option<OpProfile>> {
        if !self.active.swap(false, Ordering::SeqCst) {
            return Ok(None);
        }
        let pending = std::mem::take(&mut *self.pending.lock());
        let mut by_class: BTreeMap<String, OpClassTime> = BTreeMap::new();
        let mut by_shape: BTreeMap<(String, usize, usize, usize), LinearShapeTime> =
            BTreeMap::new();
        let mut calls = Vec::with_capacity(pending.len());
        let mut previous_end: Option<Event> = None;
        for p in pending {
            let Some(ns) = device.event_elapsed_ns(&p.start, &p.end)? else {
                return Ok(None);
            };
            let ns_u = ns.max(0) as u64;
            let idle = match &previous_end {
                Some(e) => device.event_elapsed_ns(e, &p.start)?.unwrap_or(0).max(0) as u64,
                None => 0,
            };
            calls.push(OpCall {
                op: p.op.clone(),
                ns: ns_u,
                idle_before_ns: idle,
            });
            if let Some(shape) = p.shape {
                let l = by_shape
                    .entry((p.op.clone(), shape.rows, shape.k, shape.n))
                    .or_insert_with(|| LinearShapeTime {
                        op: p.op.clone(),
                        shape,
                        calls: 0,
                        ns: 0,
                    });
                l.calls += 1;
                l.ns = l.ns.saturating_add(ns_u);
            }
            let c = by_class.entry(p.op.clone()).or_insert_with(|| OpClassTime {
                op: p.op,
                calls: 0,
                ns: 0,
                flops: 0,
                bytes: 0,
                idle_before_ns: 0,
            });
            c.calls += 1;
            c.ns = c.ns.saturating_add(ns_u);
            c.idle_before_ns = c.idle_before_ns.saturating_add(idle);
            c.flops = c.flops.saturating_add(p.flops);
            c.bytes = c.bytes.saturating_add(p.bytes);
            previous_end = Some(p.end);
        }
        let mut classes: Vec<OpClassTime> = by_class.into_values().collect();
        classes.sort_by(|a, b| b.ns.cmp(&a.ns).then_with(|| a.op.cmp(&b.op)));
        let mut linears: Vec<LinearShapeTime> = by_shape.into_values().collect();
        linears.sort_by(|a, b| b.ns.cmp(&a.ns).then_with(|| a.op.cmp(&b.op)));
        Ok(Some(OpProfile {
            classes,
            largest_linear: self.largest_linear.lock().take(),
            linears,
            calls,
            notes: Vec::new(),
        }))
    }
}

/// Bytes of `tensors` (an op's inputs, for [`OpProfiler::run`]).
pub fn tensor_bytes(tensors: &[&Tensor]) -> u64 {
    tensors.iter().map(|t| t.nbytes() as u64).sum()
}

/// What a profiled op returns: one tensor, or a fused op's two.
pub trait OpOutput {
    /// Bytes the op wrote.
    fn written_bytes(&self) -> u64;
    /// The output its flops are counted from.
    fn first(&self) -> &Tensor;
}

impl OpOutput for Tensor {
    fn written_bytes(&self) -> u64 {
        self.nbytes() as u64
    }
    fn first(&self) -> &Tensor {
        self
    }
}

impl OpOutput for (Tensor, Tensor) {
    fn written_bytes(&self) -> u64 {
        (self.0.nbytes() + self.1.nbytes()) as u64
    }
    fn first(&self) -> &Tensor {
        &self.0
    }
}

/// No flops: the op is not GEMM-like.
pub fn no_flops(_: &Tensor) -> u64 {
    0
}

/// Flops of `linear(x, w)`: `2 · rows · n · k` for `x [.., k]` and `w [n, k]` (over all the
/// `xs` of a `linear_concat`).
pub fn linear_flops(xs: &[&Tensor], w: &Tensor) -> u64 {
    let (n, k) = match w.shape() {
        [n, k] => (*n as u64, *k as u64),
        _ => return 0,
    };
    let rows: u64 = xs
        .iter()
        .map(|x| (x.numel() as u64).checked_div(k).unwrap_or(0))
        .sum();
    2u64.saturating_mul(rows)
        .saturating_mul(n)
        .saturating_mul(k)
}

/// Flops of `matmul(a, b) = out`: `2 · numel(out) · k`, `k` the last dimension of `a`.
pub fn matmul_flops(a: &Tensor, out: &Tensor) -> u64 {
    let k = a.shape().last().copied().unwrap_or(0) as u64;
    2u64.saturating_mul(out.numel() as u64).saturating_mul(k)
}

/// Flops of a convolution with weight `w [cout, cin/groups, kh, kw]` producing `out`:
/// `2 · numel(out) · cin/groups · kh · kw`.
pub fn conv2d_flops(w: &Tensor, out: &Tensor) -> u64 {
    let per_output: u64 = w.shape().iter().skip(1).map(|&d| d as u64).product();
    2u64.saturating_mul(out.numel() as u64)
        .saturating_mul(per_output)
}

/// Flops of attention with `q [.., lq, d]`, `k [.., lk, d]` and output `[.., lq, dv]`: the
/// two GEMMs, `2 · numel(q) · lk + 2 · numel(out) · lk`.
pub fn attention_flops(q: &Tensor, k: &Tensor, out: &Tensor) -> u64 {
    let rank = k.shape().len();
    let lk = if rank >= 2 { k.shape()[rank - 2] } else { 0 } as u64;
    2u64.saturating_mul(lk)
        .saturating_mul((q.numel() as u64).saturating_add(out.numel() as u64))
}

mod ops;
pub use ops::{ComputeDevice, ProfiledOps};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    fn t(shape: &[usize]) -> Tensor {
        let n = shape.iter().product();
        Tensor::from_f32(shape.to_vec(), DType::F32, &vec![0.0; n]).unwrap()
    }

    #[test]
    fn flop_counts_follow_the_gemm_shapes() {
        assert_eq!(linear_flops(&[&t(&[2, 3, 4])], &t(&[5, 4])), 2 * 6 * 5 * 4);
        assert_eq!(
            linear_flops(&[&t(&[3, 4]), &t(&[1, 4])], &t(&[5, 4])),
            2 * 4 * 5 * 4
        );
        assert_eq!(matmul_flops(&t(&[2, 3, 7]), &t(&[2, 3, 5])), 2 * 30 * 7);
        assert_eq!(
            conv2d_flops(&t(&[8, 4, 3, 3]), &t(&[1, 8, 5, 5])),
            2 * 200 * 36
        );
        // q [1, 2, 3, 4], k [1, 2, 6, 4], out [1, 2, 3, 5]: 2·24·6 + 2·30·6.
        assert_eq!(
            attention_flops(&t(&[1, 2, 3, 4]), &t(&[1, 2, 6, 4]), &t(&[1, 2, 3, 5])),
            2 * 24 * 6 + 2 * 30 * 6
        );
    }

    #[test]
    fn the_table_orders_classes_by_time_and_sums_them() {
        let p = OpProfile {
            classes: vec![
                OpClassTime {
                    op: "attention".into(),
                    calls: 2,
                    ns: 3_000_000,
                    flops: 6_000_000_000,
                    bytes: 0,
                    idle_before_ns: 250_000,
                },
                OpClassTime {
                    op: "binary.Add".into(),
                    calls: 4,
                    ns: 1_000_000,
                    flops: 0,
                    bytes: 2_000_000_000,
                    idle_before_ns: 0,
                },
            ],
            largest_linear: None,
            linears: vec![LinearShapeTime {
                op: "linear_fp8".into(),
                shape: GemmShape {
                    rows: 4608,
                    k: 3072,
                    n: 3072,
                    dtype: DType::BF16,
                },
                calls: 3,
                ns: 500_000,
            }],
            calls: Vec::new(),
            notes: vec!["attention ran on DDO's kernels: cuDNN refused".into()],
        };
        assert_eq!(p.total_ns(), 4_000_000);
        let text = p.format_text();
        assert!(text.contains("2.0 TFLOP/s"), "{text}");
        assert!(text.contains("2000 GB/s"), "{text}");
        assert!(text.contains("75.0%"), "{text}");
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines[lines.len() - 4].contains("4.000 ms")
                && lines[lines.len() - 4].contains("0.250 ms"),
            "{text}"
        );
        assert!(lines[0].ends_with("idle before"), "{text}");
        // The shapes after the total: 3 x 2·4608·3072·3072 flops in 0.5 ms.
        assert!(
            lines[lines.len() - 2].starts_with("linear_fp8 4608x3072x3072")
                && lines[lines.len() - 2].contains("521.8 TFLOP/s")
                && lines[lines.len() - 2].contains("12.5%"),
            "{text}"
        );
        assert_eq!(
            lines[lines.len() - 1],
            "note: attention ran on DDO's kernels: cuDNN refused"
        );
    }
}
