//! The 16-bit linears of the CUDA backend on cuBLASLt, with the bias — and for
//! [`Ops::linear_gelu_tanh`](ddo_core::Ops::linear_gelu_tanh) the GELU — applied in the
//! GEMM's epilogue: `CUBLASLT_EPILOGUE_BIAS` (no pass seeding the output with the bias, no
//! `beta = 1` read of it), `CUBLASLT_EPILOGUE_GELU_BIAS`, or `_GELU` without a bias. The
//! product accumulates in f32 (`CUBLAS_COMPUTE_32F`), the bias and the activation are
//! applied to the f32 sum, and the result is rounded once into the output dtype.
//!
//! # Which GELU
//!
//! cuBLASLt's GELU epilogue is the **tanh approximation**,
//! `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))` — the one [`UnaryOp::GeluTanh`](ddo_core::UnaryOp::GeluTanh)
//! (`gelu-approximate`) computes, never the exact erf form. NVIDIA's cuBLAS reference names
//! it only as "`x := GELU(x)`"; NVIDIA's nvmath-python checks the epilogue against the tanh
//! form (`tests/nvmath_tests/linalg/advanced/matmul/test_epilog.py`: its `gelu` reference,
//! and the "derivative of (tanh-approximated) gelu" it checks `GELU_AUX` with), and
//! PyTorch's `addmm` with `use_gelu` applies `gelu(approximate="tanh")` where it cannot use
//! the epilogue (`aten/src/ATen/native/cuda/Blas.cpp`). The epilogue may evaluate `tanh`
//! with a fast approximation, so its values can differ from DDO's kernel by a few units of
//! the last place of a 16-bit result.
//!
//! # State
//!
//! One cuBLASLt handle per device, kept beside the device's cuBLAS handle in `gemm/state.rs`'s
//! table (same lock, same 32 MiB workspace: both run on the compute stream, so their uses
//! of it are ordered). Each shape — `(m, n, k, dtype, epilogue)`, the operands' alignments
//! and the workspace size — gets its plan once: the matmul descriptor, the three matrix
//! layouts and the algorithm `cublasLtMatmulAlgoGetHeuristic` picks (or the reason none
//! was found, so a refused shape is not asked again).
//!
//! # Layouts
//!
//! Row-major operands are read as column-major transposes, as in `gemm/`:
//! `out [rows, out] = x [rows, in] · wᵀ` is `D [out, rows] = Aᵀ · B` with `A = w` stored
//! `in × out` (leading dimension `in`, `TRANSA = T`), `B = x` stored `in × rows` (leading
//! dimension `in`, `TRANSB = N`) and `D` `out × rows` (leading dimension `out`). The bias
//! has one element per row of `D` (an output feature) and is broadcast over its columns (the
//! tokens), as `CUBLASLT_EPILOGUE_BIAS` defines it.
//!
//! # Failures
//!
//! Anything cuBLASLt does not do — the library missing, a handle not created, no
//! algorithm for a shape, a refused call — comes back as `Err(reason)` before anything was
//! queued, and the caller runs the cuBLAS path instead; the reason is kept for
//! [`CudaDevice::cublaslt_refusal`](crate::CudaDevice::cublaslt_refusal).
//!
//! The unsafe calls here (descriptor creation and attributes, the heuristic query, the
//! matmul) are the crate's cuBLASLt calls; each carries its `// SAFETY:` contract.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::OnceLock;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use ddo_core::DType;
use parking_lot::Mutex;

/// What the epilogue applies to the f32 product before it is rounded into the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Epilogue {
    /// Nothing.
    Plain,
    /// `+ bias` (per output feature).
    Bias,
    /// `gelu_tanh(·)`.
    Gelu,
    /// `gelu_tanh(· + bias)`.
    GeluBias,
}

impl Epilogue {
    /// The epilogue of a linear with (or without) a bias, followed (or not) by GELU.
    pub(crate) fn new(bias: bool, gelu: bool) -> Self {
        match (bias, gelu) {
            (false, false) => Epilogue::Plain,
            (true, false) => Epilogue::Bias,
            (false, true) => Epilogue::Gelu,
            (true, true) => Epilogue::GeluBias,
        }
    }

    fn has_bias(self) -> bool {
        matches!(self, Epilogue::Bias | Epilogue::GeluBias)
    }

    fn sys(self) -> sys::cublasLtEpilogue_t {
        match self {
            Epilogue::Plain => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
            Epilogue::Bias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
            Epilogue::Gelu => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU,
            Epilogue::GeluBias => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_BIAS,
        }
    }
}

/// Whether libcublasLt can be loaded (checked once).
pub(crate) fn lt_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: `is_culib_present` only tries `dlopen` on libcublasLt's candidate names and
    // drops what it opened; it calls nothing in the library.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// Why the last linear that could have run on cuBLASLt ran on cuBLAS instead.
static LAST_REFUSAL: Mutex<Option<String>> = Mutex::new(None);

/// Why the last linear that could have run on cuBLASLt (in this process) ran on cuBLAS.
pub(crate) fn last_refusal() -> Option<String> {
    LAST_REFUSAL.lock().clone()
}

/// Records why a linear did not run on cuBLASLt.
pub(crate) fn refuse(why: String) {
    *LAST_REFUSAL.lock() = Some(why);
}

/// The largest `m`, `n` or `k` sent to cuBLASLt (the bound PyTorch keeps for its cuBLASLt
/// path; larger products take cuBLAS, which chunks them).
const MAX_DIM: usize = 65_535 * 32;

/// Most plans kept per device (a model has a few dozen shapes; past this the cache is
/// cleared and refilled).
const MAX_PLANS: usize = 1024;

/// One linear in cuBLASLt's column-major terms (see the module docs):
/// `D [m, n] = epilogue(Aᵀ · B)`, `A = w` (`k × m`, leading dimension `k`), `B = x`
/// (`k × n`, leading dimension `k`), `D = out` (`m × n`, leading dimension `m`). Addresses
/// are device addresses of the compute stream's context.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LtLinear {
    /// Output features (rows of `D`, elements of the bias).
    pub m: usize,
    /// Rows of `x` (columns of `D`).
    pub n: usize,
    /// Input features.
    pub k: usize,
    /// The weight `[m, k]` row-major.
    pub w: u64,
    /// The input `[n, k]` row-major.
    pub x: u64,
    /// The output `[n, m]` row-major.
    pub out: u64,
    /// The bias `[m]` of `dtype` (0 when the epilogue has none).
    pub bias: u64,
    /// Dtype of `w`, `x`, `out` and the bias (f16 or bf16).
    pub dtype: DType,
    /// What the epilogue applies.
    pub epilogue: Epilogue,
    /// `D = epilogue(Aᵀ · B + D)`: `out`'s values are read and added before the epilogue
    /// (`beta = 1`, C is D), as a run-time LoRA's up-projection is added into its base
    /// linear ([`ddo_core::Ops::linear_accumulate`]).
    pub accumulate: bool,
    /// `None` for 16-bit operands. Else `w` and `x` are E4M3 codes (`--compute fp8`,
    /// `fp8.rs`) and `dtype` is the output's (and the bias's).
    pub fp8: Option<Fp8Operands>,
    /// `alpha` (1 for 16-bit operands; the weight's scale for fp8 ones).
    pub alpha: f32,
    /// Which of the heuristic's algorithms runs: 0 its first choice (every linear), higher
    /// ranks only for `ddo bench`'s search of the fastest (`gemm::best_linear_seconds`).
    pub algo: u8,
}

impl LtLinear {
    /// C's address: D's (in place), unless an fp8 form puts C apart.
    fn c(&self) -> u64 {
        match &self.fp8 {
            Some(f) if f.form.c_apart => f.c,
            _ => self.out,
        }
    }
}

/// How an fp8 GEMM is put to cuBLASLt. The forms differ in what cuBLASLt may refuse for E4M3
/// operands on a given library and device; `fp8.rs`'s one-time check picks the first form
/// that runs and agrees with the reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Fp8Form {
    /// `CUBLASLT_MATMUL_DESC_FAST_ACCUM` (TorchAO's inference recipe accumulates fast).
    pub fast_accum: bool,
    /// C is a buffer of its own instead of D (in place): `Fp8Operands::c`.
    pub c_apart: bool,
    /// Both scales are read on the device (`CUBLASLT_MATMUL_DESC_A_SCALE_POINTER` at
    /// `Fp8Operands::a_scale` beside the B scale, `alpha` 1), as PyTorch's `_scaled_mm` puts
    /// them; else the weight's scale is `alpha` and only the B scale is a pointer.
    pub device_scales: bool,
}

/// The fp8 side of an [`LtLinear`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fp8Operands {
    /// Device address of the f32 B scale (the activation's `1 / scale`).
    pub b_scale: u64,
    /// With `form.device_scales`, the device address of the f32 A scale (the weight's
    /// scale); unused otherwise.
    pub a_scale: u64,
    /// The form ([`Fp8Form`]).
    pub form: Fp8Form,
    /// With `form.c_apart`, the device address of a C of D's size and dtype (not read:
    /// `beta` is 0); unused otherwise.
    pub c: u64,
}

/// The largest power of two (at most 256) dividing `ptr`: the alignment the algorithm may
/// assume (cuBLASLt assumes 256 bytes unless told less).
fn alignment(ptr: u64) -> u32 {
    if ptr == 0 {
        256
    } else {
        1u32 << ptr.trailing_zeros().min(8)
    }
}

/// What a plan depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    m: usize,
    n: usize,
    k: usize,
    dtype: DType,
    epilogue: Epilogue,
    /// Whether C (D) is read (`beta = 1`).
    accumulate: bool,
    /// E4M3 operands, and how they are put.
    fp8: Option<Fp8Form>,
    /// The heuristic's rank of the algorithm.
    algo: u8,
    /// Alignments of `w`, `x`, `out`, the bias and C.
    align: [u32; 5],
    workspace: usize,
}

/// A shape's descriptors and algorithm (null descriptors are not destroyed).
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
}

// SAFETY: the descriptors are host-side cuBLASLt objects owned by this plan alone; they are
// used only under the `gemm/state.rs` table's lock, never from two threads at once.
unsafe impl Send for Plan {}

impl Drop for Plan {
    fn drop(&mut self) {
        for layout in [self.a, self.b, self.d] {
            if !layout.is_null() {
                // SAFETY: `layout` was created by `cublasLtMatrixLayoutCreate` for this plan
                // and is destroyed once, here.
                let _ = unsafe { lt::destroy_matrix_layout(layout) };
            }
        }
        if !self.desc.is_null() {
            // SAFETY: `desc` was created by `cublasLtMatmulDescCreate` for this plan and is
            // destroyed once, here.
            let _ = unsafe { lt::destroy_matmul_desc(self.desc) };
        }
    }
}

/// A matmul preference descriptor, destroyed when dropped.
struct Preference(sys::cublasLtMatmulPreference_t);

impl Drop for Preference {
    fn drop(&mut self) {
        // SAFETY: created by `cublasLtMatmulPreferenceCreate`, destroyed once, here.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}

fn status(call: &str) -> impl Fn(lt::CublasError) -> String + '_ {
    move |e| format!("{call} failed with {:?}", e.0)
}

fn data_type(dtype: DType) -> sys::cudaDataType {
    match dtype {
        DType::F16 => sys::cudaDataType::CUDA_R_16F,
        _ => sys::cudaDataType::CUDA_R_16BF,
    }
}

/// Sets one attribute of a matmul descriptor to `value` (its declared C type is `T`'s).
fn set_desc<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> Result<(), String> {
    // SAFETY: `desc` is a live matmul descriptor; `value` points at `size_of::<T>()`
    // readable bytes, which cuBLASLt copies before returning; every caller passes the C
    // type the attribute is declared with (int32 for TRANSA/B, uint32 for EPILOGUE, a
    // pointer for BIAS_POINTER).
    unsafe {
        lt::set_matmul_desc_attribute(
            desc,
            attr,
            (value as *const T).cast::<c_void>(),
            std::mem::size_of::<T>(),
        )
    }
    .map_err(status("cublasLtMatmulDescSetAttribute"))
}

/// Sets one attribute of a preference descriptor to `value` (its declared C type is `T`'s).
fn set_pref<T>(
    pref: &Preference,
    attr: sys::cublasLtMatmulPreferenceAttributes_t,
    value: &T,
) -> Result<(), String> {
    // SAFETY: `pref.0` is a live preference descriptor; `value` points at `size_of::<T>()`
    // readable bytes, copied before the call returns; callers pass uint64 for the workspace
    // size and uint32 for the alignments, the attributes' declared types.
    unsafe {
        lt::set_matmul_pref_attribute(
            pref.0,
            attr,
            (value as *const T).cast::<c_void>(),
            std::mem::size_of::<T>(),
        )
    }
    .map_err(status("cublasLtMatmulPreferenceSetAttribute"))
}

/// The cuBLASLt state of one device: its handle and its plans.
pub(crate) struct LtState {
    handle: sys::cublasLtHandle_t,
    plans: HashMap<Key, Result<Plan, String>>,
}

// SAFETY: a cuBLASLt handle may be used from any thread as long as calls on it do not run
// concurrently; the state is only used under the `gemm/state.rs` table's lock.
unsafe impl Send for LtState {}

impl LtState {
    /// Drops every plan (the device idle: `Device::forget_shape_plans`); how many.
    pub(crate) fn forget_plans(&mut self) -> usize {
        let n = self.plans.len();
        self.plans.clear();
        n
    }

    /// Plans held.
    pub(crate) fn plans(&self) -> usize {
        self.plans.len()
    }

    /// Creates the handle (the device's context must be bound to this thread).
    pub(crate) fn create() -> Result<Self, String> {
        if !lt_present() {
            return Err(
                "the CUDA library `libcublasLt` could not be loaded (it is found like \
                        libcublas: LD_LIBRARY_PATH, the ld.so cache, the system directories)"
                    .into(),
            );
        }
        let handle = lt::create_handle().map_err(status("cublasLtCreate"))?;
        Ok(Self {
            handle,
            plans: HashMap::new(),
        })
    }

    /// Destroys the plans, then the handle (the device's context bound, if it still can
    /// be; errors have nowhere to go).
    pub(crate) fn destroy(mut self) {
        self.plans.clear();
        // SAFETY: the handle was created by `cublasLtCreate`, is destroyed once (`self` is
        // consumed) and nothing refers to it any more.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }

    /// Queues `g` on `stream` with `workspace_bytes` of workspace at `workspace` (0 bytes:
    /// none). `Err` (nothing queued) when cuBLASLt does not take it.
    ///
    /// Contract (kept by the callers, `gemm/` and `fp8.rs`): every address of `g` (the fp8
    /// B scale's and an fp8 C apart too) is a live allocation of
    /// the stream's context holding the elements the dimensions describe, marked used on the
    /// stream before it can be freed; the workspace stays allocated until the work queued on
    /// the stream before its release is done; the context is bound to this thread.
    pub(crate) fn run(
        &mut self,
        g: &LtLinear,
        workspace: u64,
        workspace_bytes: usize,
        stream: sys::cudaStream_t,
    ) -> Result<(), String> {
        if !matches!(g.dtype, DType::F16 | DType::BF16) {
            return Err(format!("{:?} linears stay on cuBLAS", g.dtype));
        }
        if g.m == 0 || g.n == 0 || g.k == 0 || [g.m, g.n, g.k].iter().any(|&v| v >= MAX_DIM) {
            return Err(format!(
                "m {} n {} k {}: outside cuBLASLt's range here",
                g.m, g.n, g.k
            ));
        }
        if g.epilogue.has_bias() && !g.bias.is_multiple_of(16) {
            return Err("the bias is not 16-byte aligned".into());
        }
        let fp8 = g.fp8.map(|f| f.form);
        if fp8.is_some() && (!g.k.is_multiple_of(16) || !g.m.is_multiple_of(16) || g.accumulate) {
            return Err(format!(
                "fp8 GEMM m {} k {}: leading dimensions must be multiples of 16, no accumulate",
                g.m, g.k
            ));
        }
        let key = Key {
            m: g.m,
            n: g.n,
            k: g.k,
            dtype: g.dtype,
            epilogue: g.epilogue,
            accumulate: g.accumulate,
            fp8,
            algo: g.algo,
            align: [
                alignment(g.w),
                alignment(g.x),
                alignment(g.out),
                alignment(g.bias),
                alignment(g.c()),
            ],
            workspace: workspace_bytes,
        };
        if !self.plans.contains_key(&key) && self.plans.len() >= MAX_PLANS {
            self.plans.clear();
        }
        let handle = self.handle;
        let plan = self
            .plans
            .entry(key)
            .or_insert_with(|| {
                let t = std::time::Instant::now();
                let p = plan(handle, &key, g);
                crate::setup_calls::plan_built(t.elapsed());
                p
            })
            .as_ref()
            .map_err(Clone::clone)?;
        set_pointers(plan.desc, g)?;
        let c = g.c();
        let (alpha, beta) = (g.alpha, if g.accumulate { 1.0f32 } else { 0.0 });
        let ws = if workspace_bytes == 0 {
            std::ptr::null_mut()
        } else {
            workspace as *mut c_void
        };
        // SAFETY: the plan's descriptors are live and describe `g` (its key holds every
        // dimension, the dtype, the epilogue and the alignments the algorithm was chosen
        // for, and the bias pointer was just set); by this function's contract the operand
        // addresses are live device memory of the bound context of those sizes, the
        // workspace holds `workspace_bytes` (at least what the algorithm asked for, checked
        // when the plan was made) and `stream` belongs to the context; alpha and beta are
        // host f32 scalars (scale type CUDA_R_32F, host pointer mode) read before the call
        // returns. C is D (same layout, in place as cuBLASLt allows) or, for an fp8 form that
        // puts it apart, a live buffer of D's size and layout (beta 0: never read); C is read
        // only with beta 1, when `out` holds the values to add.
        crate::host_waits::timed("cublasLtMatmul", || unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                g.w as *const c_void,
                plan.a,
                g.x as *const c_void,
                plan.b,
                c as *const c_void,
                plan.d,
                g.out as *mut c_void,
                plan.d,
                &plan.algo,
                ws,
                workspace_bytes,
                stream,
            )
        })
        .map_err(status("cublasLtMatmul"))
    }
}

/// Sets `g`'s addresses on `desc`: the bias (where the epilogue has one) and, for E4M3
/// operands, the B scale and (where the form reads it on the device) the A scale. They change
/// from call to call, so they are set before each (and when the plan is made, for the
/// heuristic).
fn set_pointers(desc: sys::cublasLtMatmulDesc_t, g: &LtLinear) -> Result<(), String> {
    use sys::cublasLtMatmulDescAttributes_t as D;
    let pointer = |addr: u64| addr as *const c_void;
    if g.epilogue.has_bias() {
        set_desc(desc, D::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &pointer(g.bias))?;
    }
    if let Some(f) = &g.fp8 {
        set_desc(
            desc,
            D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
            &pointer(f.b_scale),
        )?;
        if f.form.device_scales {
            set_desc(
                desc,
                D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                &pointer(f.a_scale),
            )?;
        }
    }
    Ok(())
}

/// Builds the plan of `key` (for the operands of `g`): descriptors, layouts, and the
/// heuristic's algorithm, or why there is none.
fn plan(handle: sys::cublasLtHandle_t, key: &Key, g: &LtLinear) -> Result<Plan, String> {
    let ty = data_type(key.dtype);
    let desc = lt::create_matmul_desc(
        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        sys::cudaDataType::CUDA_R_32F,
    )
    .map_err(status("cublasLtMatmulDescCreate"))?;
    let mut plan = Plan {
        desc,
        a: std::ptr::null_mut(),
        b: std::ptr::null_mut(),
        d: std::ptr::null_mut(),
        // SAFETY: `cublasLtMatmulAlgo_t` is plain data (`[u64; 8]`); all zeros is a valid
        // value, overwritten by the heuristic's choice before use.
        algo: unsafe { std::mem::zeroed() },
    };
    use sys::cublasLtMatmulDescAttributes_t as D;
    // cublasOperation_t as int32: CUBLAS_OP_N = 0, CUBLAS_OP_T = 1.
    let (op_n, op_t) = (
        cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N as i32,
        cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T as i32,
    );
    set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &op_t)?;
    set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSB, &op_n)?;
    let epilogue: sys::cublasLtEpilogue_t = key.epilogue.sys();
    set_desc(desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
    if let Some(form) = key.fp8 {
        // TorchAO's inference recipe accumulates fast (`use_fast_accum`) where the form
        // does; the bias has the output's dtype, said explicitly (fp8 GEMMs default it
        // otherwise for fp8 outputs); the scales' addresses are set before every call.
        if form.fast_accum {
            let fast: i8 = 1;
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast)?;
        }
        let bias_type = ty;
        set_desc(desc, D::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type)?;
    }
    // The bias has the output's dtype (cuBLASLt's default for 16-bit outputs). Its address and
    // the scales' are set here for the heuristic, and again before every call.
    set_pointers(desc, g)?;
    let layout = |rows: usize, cols: usize, ld: usize| {
        lt::create_matrix_layout(ty, rows as u64, cols as u64, ld as i64)
            .map_err(status("cublasLtMatrixLayoutCreate"))
    };
    let operands = if key.fp8.is_some() {
        sys::cudaDataType::CUDA_R_8F_E4M3
    } else {
        ty
    };
    let operand_layout = |rows: usize, cols: usize, ld: usize| {
        lt::create_matrix_layout(operands, rows as u64, cols as u64, ld as i64)
            .map_err(status("cublasLtMatrixLayoutCreate"))
    };
    plan.a = operand_layout(key.k, key.m, key.k)?;
    plan.b = operand_layout(key.k, key.n, key.k)?;
    plan.d = layout(key.m, key.n, key.m)?;
    let pref =
        Preference(lt::create_matmul_pref().map_err(status("cublasLtMatmulPreferenceCreate"))?);
    use sys::cublasLtMatmulPreferenceAttributes_t as P;
    set_pref(
        &pref,
        P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
        &(key.workspace as u64),
    )?;
    let [aw, ax, aout, _, ac] = key.align;
    set_pref(&pref, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aw)?;
    set_pref(&pref, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ax)?;
    set_pref(&pref, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac)?;
    set_pref(&pref, P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &aout)?;
    let wanted = usize::from(key.algo) + 1;
    let zeroed: sys::cublasLtMatmulHeuristicResult_t =
        // SAFETY: `cublasLtMatmulHeuristicResult_t` is plain data (an algorithm's words, sizes,
        // a status and waves count); all zeros is a valid value, overwritten by the heuristic
        // for the results it returns.
        unsafe { std::mem::zeroed() };
    let mut results = vec![zeroed; wanted];
    let mut returned: std::ffi::c_int = 0;
    // SAFETY: the handle, the descriptor, the three layouts (C is D) and the preference are
    // live objects created above; the heuristic only reads them and writes at most `wanted`
    // results into `results` (that many elements) and their count into `returned`.
    unsafe {
        sys::cublasLtMatmulAlgoGetHeuristic(
            handle,
            desc,
            plan.a,
            plan.b,
            plan.d,
            plan.d,
            pref.0,
            wanted as std::ffi::c_int,
            results.as_mut_ptr(),
            &mut returned,
        )
    }
    .result()
    .map_err(|e| {
        format!(
            "cublasLtMatmulAlgoGetHeuristic found no algorithm for m {} n {} k {} {:?} {:?} \
             (status {:?})",
            key.m, key.n, key.k, key.dtype, key.epilogue, e.0
        )
    })?;
    let found = results
        .get(usize::from(key.algo))
        .filter(|_| returned > i32::from(key.algo))
        .copied()
        .ok_or_else(|| {
            format!(
                "cublasLtMatmulAlgoGetHeuristic offers {returned} algorithm(s) for m {} n {} \
                 k {}, not rank {}",
                key.m, key.n, key.k, key.algo
            )
        })?;
    found.state.result().map_err(|e| {
        format!(
            "the heuristic's algorithm {} is unusable (status {:?})",
            key.algo, e.0
        )
    })?;
    if found.workspaceSize > key.workspace {
        return Err(format!(
            "the algorithm for m {} n {} k {} needs {} B of workspace, {} B are set",
            key.m, key.n, key.k, found.workspaceSize, key.workspace
        ));
    }
    plan.algo = found.algo;
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignments_are_powers_of_two_up_to_256() {
        assert_eq!(alignment(0x1000), 256);
        assert_eq!(alignment(0x1010), 16);
        assert_eq!(alignment(0x1002), 2);
        assert_eq!(alignment(0x1180), 128);
        assert_eq!(alignment(0), 256);
    }

    #[test]
    fn epilogues_follow_bias_and_gelu() {
        assert_eq!(Epilogue::new(false, false), Epilogue::Plain);
        assert_eq!(Epilogue::new(true, false), Epilogue::Bias);
        assert_eq!(Epilogue::new(false, true), Epilogue::Gelu);
        assert_eq!(Epilogue::new(true, true), Epilogue::GeluBias);
        assert!(Epilogue::GeluBias.has_bias() && !Epilogue::Gelu.has_bias());
        assert_eq!(
            Epilogue::GeluBias.sys(),
            sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_GELU_BIAS
        );
    }
}
