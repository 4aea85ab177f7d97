//! Attention on cuDNN's fused flash attention (cuDNN 9's backend graph API, loaded
//! dynamically like cuBLAS): the fast path of [`attention`](super::attention) for 16-bit
//! q, k, v of one dtype, `d == dv` a multiple of 8 up to 128, 16-byte aligned operands and
//! an additive mask (if any) of the same dtype that covers whole score rows.
//!
//! # The graph
//!
//! The operation graph is the one cuDNN's frontend builds for inference SDPA, written here
//! with the raw backend descriptors: `S = Q·Kᵀ` (a matmul with f32 compute, K read
//! transposed through its strides), `S · scale` (a by-value f32 scalar), `+ mask` (a
//! pointwise add of the mask tensor, broadcast over the dims it has size 1 in), the softmax
//! as `max` (a reduction to `[b, h, lq, 1]`), `sub`, `exp`, `sum` (a reduction) and `div`,
//! with the probabilities in the input dtype, then `O = P·V`; and the statistics
//! `max + log(sum)` the frontend always adds (virtual here), without which cuDNN 9.14's
//! attention engines do not recognise the graph. Every intermediate is virtual:
//! cuDNN's heuristics pick a fused engine that never stores a score.
//!
//! # State
//!
//! Plans are kept per device (a process-wide table keyed weakly by the device's compute
//! stream, as cuBLAS's handles are in `gemm/state.rs`) and per shape (b, h, lq, lk, d, dtype, mask
//! layout). Building one takes up to seconds (cuDNN compiles its fused kernel at runtime;
//! about 2 s for FLUX.1-dev's shape on an H200), on a thread of its own and a handle of its
//! own bound to the compute stream: [`prepare`] starts it early (the pipeline names its
//! shapes before its first phase), and a call whose plan is still being built waits for it,
//! so which implementation runs depends on the shape alone and a run is reproducible bit for
//! bit. A shape cuDNN refuses (no engine, or no plan that finalises) is remembered as
//! refused and runs on DDO's NVRTC kernels. Running a plan takes the table's lock (queuing
//! takes microseconds; the work runs on the stream).

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, OnceLock, Weak};

use cudarc::cudnn::sys as dnn;
use cudarc::driver::{CudaContext, CudaStream};
use ddo_core::{CoreError, DType, Device, Result};
use parking_lot::Mutex;

use super::kernels;
use crate::device::CudaDevice;

use dnn::cudnnBackendAttributeName_t as A;
use dnn::cudnnBackendAttributeType_t as T;
use dnn::cudnnBackendDescriptorType_t as K;

/// Largest head size sent to cuDNN (its fused engines cover up to 128 on every version 9).
pub(crate) const MAX_HEAD: usize = 128;

/// A failed cuDNN call: its name and status.
#[derive(Debug)]
struct DnnError {
    call: &'static str,
    status: dnn::cudnnStatus_t,
}

type DnnResult<T> = std::result::Result<T, DnnError>;

fn check(call: &'static str, status: dnn::cudnnStatus_t) -> DnnResult<()> {
    if status == dnn::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(DnnError { call, status })
    }
}

/// An owned backend descriptor, destroyed on drop.
struct Desc(dnn::cudnnBackendDescriptor_t);

// SAFETY: a backend descriptor is plain host memory owned by this value; every use goes
// through the `DNN` table's mutex, so it is never used from two threads at once.
unsafe impl Send for Desc {}

impl Desc {
    fn new(kind: K) -> DnnResult<Self> {
        let mut d: dnn::cudnnBackendDescriptor_t = std::ptr::null_mut();
        // SAFETY: `d` is a valid out-pointer; cuDNN writes a new descriptor into it.
        check("cudnnBackendCreateDescriptor", unsafe {
            dnn::cudnnBackendCreateDescriptor(kind, &mut d)
        })?;
        Ok(Self(d))
    }

    /// Sets attribute `name` to `values`, elements of cuDNN type `ty` (the Rust type `V` has
    /// that type's layout: i64 for INT64, bool for BOOLEAN, the enum for the enum types, a
    /// descriptor or pointer for BACKEND_DESCRIPTOR / VOID_PTR / HANDLE).
    fn set<V>(&self, name: A, ty: T, values: &[V]) -> DnnResult<()> {
        // SAFETY: `values` holds `values.len()` elements of the layout `ty` names (the
        // callers below pair each type with its Rust counterpart); cuDNN copies them.
        check("cudnnBackendSetAttribute", unsafe {
            dnn::cudnnBackendSetAttribute(
                self.0,
                name,
                ty,
                values.len() as i64,
                values.as_ptr().cast::<c_void>(),
            )
        })
    }

    fn set_desc(&self, name: A, d: &Desc) -> DnnResult<()> {
        self.set(name, T::CUDNN_TYPE_BACKEND_DESCRIPTOR, &[d.0])
    }

    fn finalize(&self) -> DnnResult<()> {
        // SAFETY: the descriptor is live and owned by `self`.
        check("cudnnBackendFinalize", unsafe {
            dnn::cudnnBackendFinalize(self.0)
        })
    }
}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by `cudnnBackendCreateDescriptor`, destroyed once, here.
        let _ = unsafe { dnn::cudnnBackendDestroyDescriptor(self.0) };
    }
}

/// A raw cuDNN handle, destroyed on drop.
struct Handle(dnn::cudnnHandle_t);

// SAFETY: a cuDNN handle may be used from any thread as long as calls on it do not run
// concurrently: it is built on by one builder thread, then used only under the `DNN`
// table's mutex.
unsafe impl Send for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: created by `cudnnCreate`, destroyed once, here, after the plans built on it
        // (a `Plan` drops its descriptors before its handle).
        let _ = unsafe { dnn::cudnnDestroy(self.0) };
    }
}

/// A finalised execution plan and the descriptors it was built from (kept alive with it).
struct Built {
    plan: Desc,
    workspace: usize,
    _parts: Vec<Desc>,
}

/// A plan ready to run: built on its own handle, which is bound to the device's compute
/// stream and runs it. (Fields drop in order: the descriptors before the handle.)
struct Plan {
    built: Built,
    handle: Handle,
}

/// Where a shape's plan stands.
enum State {
    /// A builder thread is making it; calls run on DDO's kernels meanwhile.
    Pending,
    /// Ready to run.
    Ready(Plan),
    /// cuDNN refused the shape (no engine, or no plan finalised).
    Refused,
}

/// The shape facts a plan is built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    /// Whether q, k, v are bf16 (else f16).
    pub bf16: bool,
    pub b: usize,
    pub h: usize,
    pub lq: usize,
    pub lk: usize,
    pub d: usize,
    /// The mask's dims and element strides (`[b|1, h|1, lq, lk]`), when there is one.
    pub mask: Option<([i64; 4], [i64; 4])>,
    /// Whether the output is written in token order (`[b, lq, h, d]` in memory, for
    /// `Ops::attention_tokens`) instead of `[b, h, lq, d]`.
    pub tokens: bool,
}

/// The cuDNN state of one device.
struct DnnEntry {
    compute: Weak<CudaStream>,
    ctx: Arc<CudaContext>,
    /// Plans by shape.
    plans: HashMap<Key, State>,
}

impl DnnEntry {
    fn destroy(self) {
        // cuDNN releases a handle's resources in the handle's context.
        let _ = self.ctx.bind_to_thread();
        drop(self.plans);
    }
}

static DNN: Mutex<Vec<DnnEntry>> = Mutex::new(Vec::new());

/// Why the last call that could have run on cuDNN did not (for tests and diagnostics).
static LAST_REFUSAL: Mutex<Option<String>> = Mutex::new(None);

/// Why the last attention call that could have run on cuDNN ran on DDO's kernels instead:
/// the library missing, the handle not created, or the shape refused (the failed call and
/// its status). `None` when none was refused.
pub(crate) fn last_refusal() -> Option<String> {
    LAST_REFUSAL.lock().clone()
}

fn refuse(why: String) -> Result<bool> {
    *LAST_REFUSAL.lock() = Some(why);
    Ok(false)
}

/// Whether libcudnn can be loaded (checked once).
pub(crate) fn cudnn_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: `is_culib_present` only tries `dlopen` on libcudnn's candidate names and drops
    // what it opened; it calls nothing in the library.
    *PRESENT.get_or_init(|| unsafe { dnn::is_culib_present() })
}

/// UIDs of the graph's tensors.
mod uid {
    pub const Q: i64 = 1;
    pub const K: i64 = 2;
    pub const V: i64 = 3;
    pub const O: i64 = 4;
    pub const SCALE: i64 = 5;
    pub const MASK: i64 = 6;
    pub const S: i64 = 10;
}

/// Device addresses of one call.
pub(crate) struct Pointers {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub out: u64,
    pub mask: u64,
}

fn tensor(
    uid: i64,
    dtype: dnn::cudnnDataType_t,
    dims: [i64; 4],
    strides: [i64; 4],
    is_virtual: bool,
    by_value: bool,
) -> DnnResult<Desc> {
    let t = Desc::new(K::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
    t.set(
        A::CUDNN_ATTR_TENSOR_DATA_TYPE,
        T::CUDNN_TYPE_DATA_TYPE,
        &[dtype],
    )?;
    t.set(A::CUDNN_ATTR_TENSOR_DIMENSIONS, T::CUDNN_TYPE_INT64, &dims)?;
    t.set(A::CUDNN_ATTR_TENSOR_STRIDES, T::CUDNN_TYPE_INT64, &strides)?;
    t.set(A::CUDNN_ATTR_TENSOR_UNIQUE_ID, T::CUDNN_TYPE_INT64, &[uid])?;
    t.set(
        A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT,
        T::CUDNN_TYPE_INT64,
        &[16i64],
    )?;
    if is_virtual {
        t.set(
            A::CUDNN_ATTR_TENSOR_IS_VIRTUAL,
            T::CUDNN_TYPE_BOOLEAN,
            &[true],
        )?;
    }
    if by_value {
        t.set(
            A::CUDNN_ATTR_TENSOR_IS_BY_VALUE,
            T::CUDNN_TYPE_BOOLEAN,
            &[true],
        )?;
    }
    t.finalize()?;
    Ok(t)
}

/// Dense row-major strides of `dims`.
fn dense(dims: [i64; 4]) -> [i64; 4] {
    [dims[1] * dims[2] * dims[3], dims[2] * dims[3], dims[3], 1]
}

/// Builds the plan for `key` on `handle` (see the module docs for the graph).
fn build(handle: dnn::cudnnHandle_t, key: &Key) -> DnnResult<Built> {
    use dnn::cudnnDataType_t::{CUDNN_DATA_BFLOAT16, CUDNN_DATA_FLOAT, CUDNN_DATA_HALF};
    use dnn::cudnnPointwiseMode_t as P;
    use dnn::cudnnReduceTensorOp_t as R;
    let io = if key.bf16 {
        CUDNN_DATA_BFLOAT16
    } else {
        CUDNN_DATA_HALF
    };
    let f32t = CUDNN_DATA_FLOAT;
    let (b, h, lq, lk, d) = (
        key.b as i64,
        key.h as i64,
        key.lq as i64,
        key.lk as i64,
        key.d as i64,
    );
    let mut parts: Vec<Desc> = Vec::new();
    let mut next_uid = uid::S;
    let mut virt = |dtype, dims: [i64; 4]| -> DnnResult<Desc> {
        next_uid += 1;
        tensor(next_uid, dtype, dims, dense(dims), true, false)
    };
    let q = tensor(
        uid::Q,
        io,
        [b, h, lq, d],
        dense([b, h, lq, d]),
        false,
        false,
    )?;
    // Kᵀ: K [b, h, lk, d] read as [b, h, d, lk].
    let kt = tensor(
        uid::K,
        io,
        [b, h, d, lk],
        [h * lk * d, lk * d, 1, d],
        false,
        false,
    )?;
    let v = tensor(
        uid::V,
        io,
        [b, h, lk, d],
        dense([b, h, lk, d]),
        false,
        false,
    )?;
    // O [b, h, lq, d], stored dense or in token order ([b, lq, h, d] in memory).
    let o_strides = if key.tokens {
        [lq * h * d, d, h * d, 1]
    } else {
        dense([b, h, lq, d])
    };
    let o = tensor(uid::O, io, [b, h, lq, d], o_strides, false, false)?;
    let scale = tensor(uid::SCALE, f32t, [1; 4], [1; 4], false, true)?;
    let scores = [b, h, lq, lk];
    let rows = [b, h, lq, 1];
    let s = virt(f32t, scores)?;
    let s_scaled = virt(f32t, scores)?;
    let mut ops: Vec<Desc> = Vec::new();

    let matmul = |a: &Desc, bm: &Desc, c: &Desc, parts: &mut Vec<Desc>| -> DnnResult<Desc> {
        let desc = Desc::new(K::CUDNN_BACKEND_MATMUL_DESCRIPTOR)?;
        desc.set(
            A::CUDNN_ATTR_MATMUL_COMP_TYPE,
            T::CUDNN_TYPE_DATA_TYPE,
            &[f32t],
        )?;
        desc.finalize()?;
        let op = Desc::new(K::CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR)?;
        op.set_desc(A::CUDNN_ATTR_OPERATION_MATMUL_ADESC, a)?;
        op.set_desc(A::CUDNN_ATTR_OPERATION_MATMUL_BDESC, bm)?;
        op.set_desc(A::CUDNN_ATTR_OPERATION_MATMUL_CDESC, c)?;
        op.set_desc(A::CUDNN_ATTR_OPERATION_MATMUL_DESC, &desc)?;
        op.finalize()?;
        parts.push(desc);
        Ok(op)
    };
    let pointwise = |mode: P,
                     x: &Desc,
                     bt: Option<&Desc>,
                     y: &Desc,
                     parts: &mut Vec<Desc>|
     -> DnnResult<Desc> {
        let desc = Desc::new(K::CUDNN_BACKEND_POINTWISE_DESCRIPTOR)?;
        desc.set(
            A::CUDNN_ATTR_POINTWISE_MODE,
            T::CUDNN_TYPE_POINTWISE_MODE,
            &[mode],
        )?;
        desc.set(
            A::CUDNN_ATTR_POINTWISE_MATH_PREC,
            T::CUDNN_TYPE_DATA_TYPE,
            &[f32t],
        )?;
        desc.finalize()?;
        let op = Desc::new(K::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR)?;
        op.set_desc(A::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, &desc)?;
        op.set_desc(A::CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x)?;
        if let Some(bt) = bt {
            op.set_desc(A::CUDNN_ATTR_OPERATION_POINTWISE_BDESC, bt)?;
        }
        op.set_desc(A::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y)?;
        op.finalize()?;
        parts.push(desc);
        Ok(op)
    };
    let reduction = |mode: R, x: &Desc, y: &Desc, parts: &mut Vec<Desc>| -> DnnResult<Desc> {
        let desc = Desc::new(K::CUDNN_BACKEND_REDUCTION_DESCRIPTOR)?;
        desc.set(
            A::CUDNN_ATTR_REDUCTION_OPERATOR,
            T::CUDNN_TYPE_REDUCTION_OPERATOR_TYPE,
            &[mode],
        )?;
        desc.set(
            A::CUDNN_ATTR_REDUCTION_COMP_TYPE,
            T::CUDNN_TYPE_DATA_TYPE,
            &[f32t],
        )?;
        desc.finalize()?;
        let op = Desc::new(K::CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR)?;
        op.set_desc(A::CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x)?;
        op.set_desc(A::CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y)?;
        op.set_desc(A::CUDNN_ATTR_OPERATION_REDUCTION_DESC, &desc)?;
        op.finalize()?;
        parts.push(desc);
        Ok(op)
    };

    ops.push(matmul(&q, &kt, &s, &mut parts)?);
    ops.push(pointwise(
        P::CUDNN_POINTWISE_MUL,
        &s,
        Some(&scale),
        &s_scaled,
        &mut parts,
    )?);
    let mut logits = s_scaled;
    if let Some((dims, strides)) = key.mask {
        let mask = tensor(uid::MASK, io, dims, strides, false, false)?;
        let biased = virt(f32t, scores)?;
        ops.push(pointwise(
            P::CUDNN_POINTWISE_ADD,
            &logits,
            Some(&mask),
            &biased,
            &mut parts,
        )?);
        parts.push(mask);
        parts.push(std::mem::replace(&mut logits, biased));
    }
    let max = virt(f32t, rows)?;
    ops.push(reduction(
        R::CUDNN_REDUCE_TENSOR_MAX,
        &logits,
        &max,
        &mut parts,
    )?);
    let shifted = virt(f32t, scores)?;
    ops.push(pointwise(
        P::CUDNN_POINTWISE_SUB,
        &logits,
        Some(&max),
        &shifted,
        &mut parts,
    )?);
    let exp = virt(f32t, scores)?;
    ops.push(pointwise(
        P::CUDNN_POINTWISE_EXP,
        &shifted,
        None,
        &exp,
        &mut parts,
    )?);
    let sum = virt(f32t, rows)?;
    ops.push(reduction(
        R::CUDNN_REDUCE_TENSOR_ADD,
        &exp,
        &sum,
        &mut parts,
    )?);
    // The softmax statistics `max + log(sum)` (virtual: not an output): cuDNN's attention
    // engines recognise the graph only with them, as the frontend always builds it.
    let log_sum = virt(f32t, rows)?;
    ops.push(pointwise(
        P::CUDNN_POINTWISE_LOG,
        &sum,
        None,
        &log_sum,
        &mut parts,
    )?);
    let stats = virt(f32t, rows)?;
    ops.push(pointwise(
        P::CUDNN_POINTWISE_ADD,
        &max,
        Some(&log_sum),
        &stats,
        &mut parts,
    )?);
    parts.extend([log_sum, stats]);
    // The probabilities in the input dtype: bmm2 takes its A operand in the i/o type.
    let probs = virt(io, scores)?;
    ops.push(pointwise(
        P::CUDNN_POINTWISE_DIV,
        &exp,
        Some(&sum),
        &probs,
        &mut parts,
    )?);
    ops.push(matmul(&probs, &v, &o, &mut parts)?);
    parts.extend([q, kt, v, o, scale, s, logits, max, shifted, exp, sum, probs]);

    let graph = Desc::new(K::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
    let raw: Vec<dnn::cudnnBackendDescriptor_t> = ops.iter().map(|o| o.0).collect();
    graph.set(
        A::CUDNN_ATTR_OPERATIONGRAPH_OPS,
        T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
        &raw,
    )?;
    graph.set(
        A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE,
        T::CUDNN_TYPE_HANDLE,
        &[handle],
    )?;
    graph.finalize()?;
    parts.extend(ops);

    let heur = Desc::new(K::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
    heur.set_desc(A::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &graph)?;
    heur.set(
        A::CUDNN_ATTR_ENGINEHEUR_MODE,
        T::CUDNN_TYPE_HEUR_MODE,
        &[dnn::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A],
    )?;
    heur.finalize()?;
    let mut count = 0i64;
    // SAFETY: a count query (no elements requested): cuDNN writes the count only.
    check("cudnnBackendGetAttribute", unsafe {
        dnn::cudnnBackendGetAttribute(
            heur.0,
            A::CUDNN_ATTR_ENGINEHEUR_RESULTS,
            T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
            0,
            &mut count,
            std::ptr::null_mut(),
        )
    })?;
    let configs: Vec<Desc> = (0..count.clamp(0, 16))
        .map(|_| Desc::new(K::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR))
        .collect::<DnnResult<_>>()?;
    let mut raw: Vec<dnn::cudnnBackendDescriptor_t> = configs.iter().map(|c| c.0).collect();
    let mut got = 0i64;
    // SAFETY: `raw` holds `raw.len()` engine-config descriptors created above, which cuDNN
    // fills in; it writes at most that many and their count into `got`.
    check("cudnnBackendGetAttribute", unsafe {
        dnn::cudnnBackendGetAttribute(
            heur.0,
            A::CUDNN_ATTR_ENGINEHEUR_RESULTS,
            T::CUDNN_TYPE_BACKEND_DESCRIPTOR,
            raw.len() as i64,
            &mut got,
            raw.as_mut_ptr().cast::<c_void>(),
        )
    })?;
    let mut last = DnnError {
        call: "cudnnBackendGetAttribute(ENGINEHEUR_RESULTS): no engine",
        status: dnn::cudnnStatus_t::CUDNN_STATUS_NOT_SUPPORTED,
    };
    for cfg in configs.into_iter().take(got.max(0) as usize) {
        let attempt = (|| -> DnnResult<Built> {
            let plan = Desc::new(K::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
            plan.set(
                A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE,
                T::CUDNN_TYPE_HANDLE,
                &[handle],
            )?;
            plan.set_desc(A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, &cfg)?;
            plan.finalize()?;
            let mut ws = 0i64;
            let mut n = 0i64;
            // SAFETY: one INT64 element requested into `ws`.
            check("cudnnBackendGetAttribute", unsafe {
                dnn::cudnnBackendGetAttribute(
                    plan.0,
                    A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                    T::CUDNN_TYPE_INT64,
                    1,
                    &mut n,
                    (&mut ws as *mut i64).cast::<c_void>(),
                )
            })?;
            Ok(Built {
                plan,
                workspace: ws.max(0) as usize,
                _parts: Vec::new(),
            })
        })();
        match attempt {
            Ok(mut plan) => {
                parts.extend([graph, heur, cfg]);
                plan._parts = parts;
                return Ok(plan);
            }
            Err(e) => last = e,
        }
    }
    Err(last)
}

fn backend(dev: &CudaDevice, message: String) -> CoreError {
    CoreError::Backend {
        device: dev.id().to_string(),
        message,
    }
}

/// Builds the plan for `key` on a new handle bound to `stream` (in `ctx`), on this thread.
fn build_on_new_handle(
    ctx: &CudaContext,
    stream: &CudaStream,
    key: &Key,
) -> std::result::Result<Plan, String> {
    ctx.bind_to_thread()
        .map_err(|e| format!("cuCtxSetCurrent failed with {e:?}"))?;
    let mut h: dnn::cudnnHandle_t = std::ptr::null_mut();
    // SAFETY: `h` is a valid out-pointer; the device's context is bound.
    check("cudnnCreate", unsafe { dnn::cudnnCreate(&mut h) })
        .map_err(|e| format!("{} failed with {:?}", e.call, e.status))?;
    let handle = Handle(h);
    // SAFETY: the handle was just created in the bound context; the stream belongs to that
    // context and outlives every use of the handle on it (the plan, which owns the handle,
    // is dropped with the device's entry, once the stream is gone, or right here).
    check("cudnnSetStream", unsafe {
        dnn::cudnnSetStream(h, stream.cu_stream() as dnn::cudaStream_t)
    })
    .map_err(|e| format!("{} failed with {:?}", e.call, e.status))?;
    let built =
        build(h, key).map_err(|e| format!("{key:?}: {} failed with {:?}", e.call, e.status))?;
    Ok(Plan { built, handle })
}

/// The device's entry in `table` (made if it has none); dead devices' entries destroyed.
fn entry_of<'t>(
    table: &'t mut Vec<DnnEntry>,
    stream: &Arc<CudaStream>,
    ctx: &Arc<CudaContext>,
) -> &'t mut DnnEntry {
    let (live, dead): (Vec<DnnEntry>, Vec<DnnEntry>) = std::mem::take(table)
        .into_iter()
        .partition(|e| e.compute.strong_count() > 0);
    *table = live;
    for e in dead {
        e.destroy();
    }
    let at = match table
        .iter()
        .position(|e| std::ptr::eq(e.compute.as_ptr(), Arc::as_ptr(stream)))
    {
        Some(i) => i,
        None => {
            table.push(DnnEntry {
                compute: Arc::downgrade(stream),
                ctx: Arc::clone(ctx),
                plans: HashMap::new(),
            });
            table.len() - 1
        }
    };
    &mut table[at]
}

/// Builds `key`'s plan on a thread of its own (up to seconds: cuDNN compiles its fused
/// kernel at runtime) and records it, or the refusal, in the table.
fn spawn_build(stream: Arc<CudaStream>, ctx: Arc<CudaContext>, key: Key) {
    let spawned = crate::background::spawn("ddo-cudnn-plan".into(), move || {
        let outcome = build_on_new_handle(&ctx, &stream, &key);
        let mut table = DNN.lock();
        let state = match outcome {
            Ok(plan) => State::Ready(plan),
            Err(why) => {
                *LAST_REFUSAL.lock() = Some(why);
                State::Refused
            }
        };
        let entry = entry_of(&mut table, &stream, &ctx);
        entry.plans.insert(key, state);
    });
    if spawned.is_err() {
        let mut table = DNN.lock();
        *LAST_REFUSAL.lock() = Some("no thread for building a cuDNN plan".into());
        if let Some(e) = table
            .iter_mut()
            .find(|e| e.compute.strong_count() > 0 && e.plans.contains_key(&key))
        {
            e.plans.insert(key, State::Refused);
        }
    }
}

/// `f` of `dev`'s entry in the cuDNN table, under its lock; `None` where the device has no
/// entry yet (nothing is created).
fn existing_entry<R>(dev: &CudaDevice, f: impl FnOnce(&mut DnnEntry) -> R) -> Result<Option<R>> {
    let stream = kernels::compute_stream(dev)?;
    Ok(DNN
        .lock()
        .iter_mut()
        .find(|e| kernels::same_stream(&e.compute, &stream))
        .map(f))
}

/// Drops `dev`'s cuDNN plans that are built or refused (`Device::forget_shape_plans`; one
/// being built in the background stays, and is kept when done); how many.
pub(crate) fn forget_plans(dev: &CudaDevice) -> Result<usize> {
    Ok(existing_entry(dev, |entry| {
        // cuDNN releases a plan's resources in its handle's context.
        let _ = entry.ctx.bind_to_thread();
        let before = entry.plans.len();
        entry.plans.retain(|_, s| matches!(s, State::Pending));
        before - entry.plans.len()
    })?
    .unwrap_or(0))
}

/// `dev`'s cuDNN plans held now (built, refused or being built).
pub(crate) fn plans(dev: &CudaDevice) -> Result<usize> {
    Ok(existing_entry(dev, |entry| entry.plans.len())?.unwrap_or(0))
}

/// Waits until no plan of `dev` is being built (for tests and benchmarks that want the
/// steady state): at most `timeout`; whether none is pending now.
pub(crate) fn wait_for_plans(dev: &CudaDevice, timeout: std::time::Duration) -> Result<bool> {
    let stream = kernels::compute_stream(dev)?;
    let started = std::time::Instant::now();
    loop {
        let pending = DNN.lock().iter().any(|e| {
            kernels::same_stream(&e.compute, &stream)
                && e.plans.values().any(|s| matches!(s, State::Pending))
        });
        if !pending {
            return Ok(true);
        }
        if started.elapsed() >= timeout {
            return Ok(false);
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

/// Starts building `key`'s plan in the background unless it is built, being built or
/// refused ([`CudaDevice::prepare_attention`]: the pipeline names its shapes before its
/// first phase, so the build overlaps loading and prompt encoding).
pub(crate) fn prepare(dev: &CudaDevice, key: &Key) -> Result<()> {
    if !cudnn_present() {
        return Ok(());
    }
    let stream = kernels::compute_stream(dev)?;
    let ctx = dev.context();
    let mut table = DNN.lock();
    let entry = entry_of(&mut table, &stream, ctx);
    if !entry.plans.contains_key(key) {
        entry.plans.insert(*key, State::Pending);
        drop(table);
        spawn_build(stream, Arc::clone(ctx), *key);
    }
    Ok(())
}

/// Runs attention for `key` on cuDNN with `scale`; `Ok(false)` when cuDNN is absent or
/// refuses the shape (the caller runs its own kernels then). A shape's plan is built once
/// (on a thread of its own, [`spawn_build`]) and this call waits for it when it is not
/// ready: which implementation runs depends on the shape only, never on timing, so a run
/// is reproducible bit for bit.
pub(crate) fn run(dev: &CudaDevice, key: &Key, ptrs: &Pointers, scale: f32) -> Result<bool> {
    if !cudnn_present() {
        return refuse("libcudnn could not be loaded".into());
    }
    let stream = kernels::compute_stream(dev)?;
    let ctx = dev.context();
    let driver = |call: &'static str, e| {
        crate::error::CudaError::driver(call, e).into_core(&dev.id().to_string())
    };
    prepare(dev, key)?;
    let mut waited: Option<std::time::Instant> = None;
    let ready = loop {
        let mut table = DNN.lock();
        let entry = entry_of(&mut table, &stream, ctx);
        match entry.plans.get(key) {
            Some(State::Ready(_)) => break Some(table),
            Some(State::Refused) | None => break None,
            Some(State::Pending) => {
                drop(table);
                waited.get_or_insert_with(std::time::Instant::now);
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
    };
    if let Some(t) = waited {
        crate::setup_calls::plan_waited(t.elapsed());
    }
    let Some(mut table) = ready else {
        return Ok(false);
    };
    let entry = entry_of(&mut table, &stream, ctx);
    let Some(State::Ready(plan)) = entry.plans.get(key) else {
        return Ok(false);
    };
    ctx.bind_to_thread()
        .map_err(|e| driver("cuCtxSetCurrent", e))?;
    let handle = plan.handle.0;
    let plan = &plan.built;
    let workspace = if plan.workspace > 0 {
        Some(super::scratch(dev, plan.workspace)?)
    } else {
        None
    };
    let mut uids = vec![uid::Q, uid::K, uid::V, uid::O, uid::SCALE];
    let scale_value = scale;
    let mut data: Vec<*mut c_void> = vec![
        ptrs.q as *mut c_void,
        ptrs.k as *mut c_void,
        ptrs.v as *mut c_void,
        ptrs.out as *mut c_void,
        (&scale_value as *const f32).cast_mut().cast::<c_void>(),
    ];
    if key.mask.is_some() {
        uids.push(uid::MASK);
        data.push(ptrs.mask as *mut c_void);
    }
    let ws_ptr = workspace
        .as_ref()
        .map_or(std::ptr::null_mut(), |(_, p)| *p as *mut c_void);
    let pack = (|| -> DnnResult<Desc> {
        let pack = Desc::new(K::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
        pack.set(
            A::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS,
            T::CUDNN_TYPE_INT64,
            &uids,
        )?;
        pack.set(
            A::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
            T::CUDNN_TYPE_VOID_PTR,
            &data,
        )?;
        pack.set(
            A::CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
            T::CUDNN_TYPE_VOID_PTR,
            &[ws_ptr],
        )?;
        pack.finalize()?;
        Ok(pack)
    })()
    .map_err(|e| {
        backend(
            dev,
            format!("cuDNN attention: {} failed with {:?}", e.call, e.status),
        )
    })?;
    // SAFETY: the plan was built on this handle; the variant pack names device buffers of
    // this context that the caller keeps alive until the work queued on the compute stream
    // (the handle's stream) has run (their allocations are marked used on it), the by-value
    // scale lives on this stack frame (cuDNN reads it while queuing), and the workspace
    // buffer is freed only after the stream's queued work.
    let status = crate::host_waits::timed("cudnnBackendExecute", || unsafe {
        dnn::cudnnBackendExecute(handle, plan.plan.0, pack.0)
    });
    check("cudnnBackendExecute", status).map_err(|e| {
        backend(
            dev,
            format!("cuDNN attention: {} failed with {:?}", e.call, e.status),
        )
    })?;
    drop(workspace);
    dev.note_cudnn_attention();
    Ok(true)
}

/// The plan key of a call, or `None` when cuDNN is not asked (head size, dtype, mask
/// layout): `mask` is the mask's dtype and element strides for (b, h, query, key), 0 where
/// it broadcasts; `tokens`, whether the output is written in token order.
pub(crate) fn key(
    dtype: DType,
    [b, h, lq, lk, d]: [usize; 5],
    mask: Option<(DType, [usize; 4])>,
    tokens: bool,
) -> Option<Key> {
    let bf16 = match dtype {
        DType::BF16 => true,
        DType::F16 => false,
        _ => return None,
    };
    if d == 0 || d % 8 != 0 || d > MAX_HEAD || lq == 0 || lk == 0 {
        return None;
    }
    let mask = match mask {
        None => None,
        Some((mdt, [sb, sh, sq, sk])) => {
            // The mask must cover whole rows of scores in the inputs' dtype.
            if mdt != dtype || sk != 1 || sq == 0 {
                return None;
            }
            let dh = if sh == 0 { 1 } else { h };
            let db = if sb == 0 { 1 } else { b };
            let rows = (lq * lk) as i64;
            let sh = if sh == 0 { rows } else { sh as i64 };
            let sb = if sb == 0 { sh * dh as i64 } else { sb as i64 };
            Some((
                [db as i64, dh as i64, lq as i64, lk as i64],
                [sb, sh, sq as i64, 1],
            ))
        }
    };
    Some(Key {
        bf16,
        b,
        h,
        lq,
        lk,
        d,
        mask,
        tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_cover_what_cudnn_is_asked_and_nothing_else() {
        let k = key(DType::BF16, [1, 24, 4608, 4608, 128], None, false).unwrap();
        assert!(k.bf16 && k.mask.is_none() && !k.tokens);
        // The token-order output is a plan of its own.
        let tokens = key(DType::BF16, [1, 24, 4608, 4608, 128], None, true).unwrap();
        assert!(tokens.tokens);
        assert_ne!(k, tokens);
        assert!(
            key(DType::F32, [1, 2, 8, 8, 64], None, false).is_none(),
            "f32 stays on NVRTC"
        );
        assert!(
            key(DType::BF16, [1, 2, 8, 8, 512], None, false).is_none(),
            "d > 128"
        );
        assert!(
            key(DType::BF16, [1, 2, 8, 8, 40], None, false).is_some(),
            "any d % 8 == 0"
        );
        assert!(key(DType::BF16, [1, 2, 8, 8, 36], None, false).is_none());
        // T5's position bias [1, h, s, s] broadcast over the batch.
        let t5 = key(
            DType::BF16,
            [2, 64, 512, 512, 64],
            Some((DType::BF16, [0, 512 * 512, 512, 1])),
            false,
        )
        .unwrap();
        assert_eq!(
            t5.mask,
            Some(([1, 64, 512, 512], [64 * 512 * 512, 512 * 512, 512, 1]))
        );
        // A padding mask broadcast over queries, or one of another dtype: NVRTC.
        assert!(
            key(
                DType::BF16,
                [1, 2, 8, 8, 64],
                Some((DType::BF16, [8, 0, 0, 1])),
                false
            )
            .is_none()
        );
        assert!(
            key(
                DType::BF16,
                [1, 2, 8, 8, 64],
                Some((DType::F32, [0, 0, 8, 1])),
                false
            )
            .is_none()
        );
    }
}
