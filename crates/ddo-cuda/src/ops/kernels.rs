//! Kernel infrastructure of the CUDA compute plane: CUDA C sources compiled once per device
//! with NVRTC, their functions cached by name, and one launch helper.
//!
//! # API (crate-private)
//!
//! - [`PRELUDE`]: CUDA C text that [`CudaDevice::kernel`] puts in front of every source
//!   (do **not** paste it into a source yourself). It needs no header, NVRTC's or the
//!   system's, and defines:
//!   - dtype codes `DTYPE_F32` (0), `DTYPE_F16` (1), `DTYPE_BF16` (2) — the same numbers as
//!     [`dtype_code`];
//!   - types `i64`, `u64`, `u32`, `u16`;
//!   - `float load_as_float(const void* base, i64 index, int dtype)` and
//!     `void store_from_float(void* base, i64 index, int dtype, float value)`: element
//!     `index` of a buffer of `dtype`, converted to/from f32 (round to nearest even, as the
//!     host backend's `half` crate; NaN stays NaN);
//!   - the scalar conversions `f16_to_float`, `float_to_f16`, `bf16_to_float`,
//!     `float_to_bf16` (`u16` bit patterns);
//!   - `warp_sum`, `warp_max` (full-warp shuffles) and `block_sum`, `block_max`
//!     (`float block_sum(float v, float* scratch)`: every thread of the block must call it;
//!     `scratch` is `__shared__ float[32]`; every thread gets the result; it synchronises
//!     before returning so `scratch` may be reused by the next call; the empty sum is -0.0,
//!     as Rust's float `Sum`);
//!   - `struct Dims6 { i64 v[6]; }` — matches [`Dims6`] on the Rust side, passed by value.
//! - `dev.kernel(source_name, source, function) -> Result<CudaFunction, CoreError>`
//!   ([`CudaDevice::kernel`]): compiles `PRELUDE + source` the first time `source_name` is
//!   seen on this device (`--gpu-architecture=compute_XY` from the device's compute
//!   capability, `-default-device`, `--std=c++17`; precise division and square root, no
//!   flush-to-zero), loads the module into the device's context, and returns the function
//!   `function` (cached by name). `source_name` identifies the source: one name, one text.
//!   Every kernel must be `extern "C" __global__` so its name is not mangled. A compile
//!   failure is a [`CoreError::Backend`] carrying NVRTC's log; a missing libnvrtc is a
//!   `Backend` error saying where it is looked for (never a panic).
//! - [`compute_stream`]`(dev) -> Result<Arc<CudaStream>, CoreError>`: the device's compute
//!   stream, where every op is queued.
//! - [`launch`]`(dev, &f, cfg, &[Arg])`: launches `f` on the compute stream with the
//!   arguments in order ([`Arg::Ptr`] for a raw device address as `u64`, [`Arg::I64`],
//!   [`Arg::I32`], [`Arg::F32`], [`Arg::Dims`]); driver errors become `CoreError`. Callers
//!   may equally use cudarc's `stream.launch_builder(&f)` directly, pushing `&u64` device
//!   addresses (each `unsafe` launch then needs its own `// SAFETY:` comment).
//! - [`grid_1d`]`(n, block)`: a launch configuration for a grid-stride loop over `n` items
//!   (grid capped, so kernels must loop).
//! - [`compile_ptx`]`(source, arch)`: NVRTC only (no device), for tests;
//!   [`nvrtc_present`]`()` says whether libnvrtc loads.
//!
//! Memory discipline (see `ops/mod.rs`): outputs are allocated with `alloc_on(bytes,
//! compute)`, and every allocation a kernel touches is marked with `note_use(compute)` so
//! its free is ordered after the kernel.
//!
//! The cache is keyed by the device's compute stream (held weakly): entries of dropped
//! devices are removed — and their modules unloaded — at the next `kernel` call of any
//! device.

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use cudarc::driver::{
    CudaFunction, CudaModule, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::{CompileOptions, Ptx};
use ddo_core::{CoreError, DType, Device};
use parking_lot::Mutex;

use crate::device::CudaDevice;
use crate::error::CudaError;

/// Dtype code of f32 in kernels (`DTYPE_F32`).
pub(crate) const DTYPE_F32: i32 = 0;
/// Dtype code of f16 in kernels (`DTYPE_F16`).
pub(crate) const DTYPE_F16: i32 = 1;
/// Dtype code of bf16 in kernels (`DTYPE_BF16`).
pub(crate) const DTYPE_BF16: i32 = 2;

/// The kernel-side code of a float dtype (`None` for quantized storage).
pub(crate) fn dtype_code(dtype: DType) -> Option<i32> {
    match dtype {
        DType::F32 => Some(DTYPE_F32),
        DType::F16 => Some(DTYPE_F16),
        DType::BF16 => Some(DTYPE_BF16),
        _ => None,
    }
}

/// Prepended to every source by [`CudaDevice::kernel`]; see the module docs.
pub(crate) const PRELUDE: &str = r#"
#define DTYPE_F32 0
#define DTYPE_F16 1
#define DTYPE_BF16 2
typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;

struct Dims6 { i64 v[6]; };

__device__ __forceinline__ float f16_to_float(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ u16 float_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float bf16_to_float(u16 b) {
    return __uint_as_float(((u32)b) << 16);
}
__device__ __forceinline__ u16 float_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (u16)((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}
__device__ __forceinline__ float load_as_float(const void* base, i64 i, int dtype) {
    if (dtype == DTYPE_F32) return ((const float*)base)[i];
    if (dtype == DTYPE_F16) return f16_to_float(((const u16*)base)[i]);
    return bf16_to_float(((const u16*)base)[i]);
}
__device__ __forceinline__ void store_from_float(void* base, i64 i, int dtype, float v) {
    if (dtype == DTYPE_F32) { ((float*)base)[i] = v; return; }
    if (dtype == DTYPE_F16) { ((u16*)base)[i] = float_to_f16(v); return; }
    ((u16*)base)[i] = float_to_bf16(v);
}
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float r = lane < warps ? scratch[lane] : -0.0f;
    r = warp_sum(r);
    __syncthreads();
    return r;
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int warps = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float r = lane < warps ? scratch[lane] : -__int_as_float(0x7f800000);
    r = warp_max(r);
    __syncthreads();
    return r;
}
"#;

/// Six 64-bit integers passed by value (shapes, strides); `struct Dims6` in [`PRELUDE`].
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Dims6 {
    /// The values; unused trailing entries are 0.
    pub v: [i64; 6],
}

// SAFETY: `Dims6` is `#[repr(C)]` around `[i64; 6]`, the exact layout of the kernels'
// `struct Dims6 { long long v[6]; }`, and has no padding, pointers or invalid bit patterns.
unsafe impl DeviceRepr for Dims6 {}

impl Dims6 {
    /// The first `values.len()` entries (at most 6) from `values`; the rest 0.
    pub fn from_slice(values: &[usize]) -> Self {
        let mut v = [0i64; 6];
        for (d, &x) in v.iter_mut().zip(values) {
            *d = x as i64;
        }
        Self { v }
    }
}

/// One kernel argument, pushed by value.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Arg {
    /// A device address (`const T*` / `T*` in the kernel), as a 64-bit integer.
    Ptr(u64),
    /// `long long`.
    I64(i64),
    /// `int`.
    I32(i32),
    /// `unsigned int`.
    U32(u32),
    /// `float`.
    F32(f32),
    /// `struct Dims6` by value.
    Dims(Dims6),
}

/// The compiled modules and loaded functions of one device.
struct DeviceKernels {
    /// The device's compute stream (its identity; dead once the device is dropped).
    compute: Weak<CudaStream>,
    modules: HashMap<&'static str, Arc<CudaModule>>,
    functions: HashMap<(&'static str, String), CudaFunction>,
}

static CACHE: Mutex<Vec<DeviceKernels>> = Mutex::new(Vec::new());

/// Where libnvrtc is looked for, for error messages.
const NVRTC_HINT: &str = "cudarc loads libnvrtc.so (also libnvrtc.so.13 and other versioned names) at run time \
     through the dynamic loader, which searches LD_LIBRARY_PATH, the ld.so cache and the system library \
     directories; install the CUDA toolkit's NVRTC (or the nvidia-cuda-nvrtc wheel) and add the directory \
     holding libnvrtc.so to LD_LIBRARY_PATH (e.g. /usr/local/cuda/targets/x86_64-linux/lib), or run on the \
     host backend";

/// Whether libnvrtc can be loaded (no compilation is made).
pub(crate) fn nvrtc_present() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on libnvrtc's candidate names and drops
    // what it opened; it calls nothing in the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles `PRELUDE + source` to PTX for `arch` (e.g. `compute_90`); the error is NVRTC's
/// log (or the missing library). Needs libnvrtc, no device.
pub(crate) fn compile_ptx(source: &str, arch: &str) -> Result<Ptx, String> {
    if !nvrtc_present() {
        return Err(format!(
            "the CUDA library `libnvrtc` could not be loaded: {NVRTC_HINT}"
        ));
    }
    let text = format!("{PRELUDE}\n{source}");
    let opts = CompileOptions {
        prec_div: Some(true),
        prec_sqrt: Some(true),
        ftz: Some(false),
        options: vec![
            format!("--gpu-architecture={arch}"),
            "-default-device".into(),
            "--std=c++17".into(),
        ],
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(text, opts).map_err(|e| match e {
        cudarc::nvrtc::CompileError::CompileError { nvrtc, log, .. } => {
            format!("{nvrtc:?}: {}", log.to_string_lossy())
        }
        other => other.to_string(),
    })
}

fn backend(dev: &CudaDevice, message: String) -> CoreError {
    CoreError::Backend {
        device: dev.id().to_string(),
        message,
    }
}

fn driver_err(dev: &CudaDevice, call: &'static str, e: cudarc::driver::DriverError) -> CoreError {
    CudaError::driver(call, e).into_core(&dev.id().to_string())
}

/// The device's compute stream (cudarc's), where ops are queued.
pub(crate) fn compute_stream(dev: &CudaDevice) -> Result<Arc<CudaStream>, CoreError> {
    let s = dev.compute_stream();
    Ok(Arc::clone(dev.stream_handle(&s)?.cuda_stream()))
}

impl CudaDevice {
    /// The kernel `function` of the CUDA C source `source` (named `source_name`), compiled
    /// with [`PRELUDE`] in front the first time this device needs it; see the module docs.
    pub(crate) fn kernel(
        &self,
        source_name: &'static str,
        source: &'static str,
        function: &str,
    ) -> Result<CudaFunction, CoreError> {
        let stream = compute_stream(self)?;
        let mut cache = CACHE.lock();
        cache.retain(|e| e.compute.strong_count() > 0);
        let at = match cache
            .iter()
            .position(|e| std::ptr::eq(e.compute.as_ptr(), Arc::as_ptr(&stream)))
        {
            Some(i) => i,
            None => {
                cache.push(DeviceKernels {
                    compute: Arc::downgrade(&stream),
                    modules: HashMap::new(),
                    functions: HashMap::new(),
                });
                cache.len() - 1
            }
        };
        let entry = &mut cache[at];
        if let Some(f) = entry.functions.get(&(source_name, function.to_string())) {
            return Ok(f.clone());
        }
        let module = match entry.modules.get(source_name) {
            Some(m) => Arc::clone(m),
            None => {
                let ctx = self.context();
                let (major, minor) = ctx
                    .compute_capability()
                    .map_err(|e| driver_err(self, "cuDeviceGetAttribute", e))?;
                let arch = format!("compute_{major}{minor}");
                let ptx = compile_ptx(source, &arch).map_err(|log| {
                    backend(
                        self,
                        format!("NVRTC could not compile kernel source `{source_name}` for {arch}: {log}"),
                    )
                })?;
                let m = ctx
                    .load_module(ptx)
                    .map_err(|e| driver_err(self, "cuModuleLoadData", e))?;
                entry.modules.insert(source_name, Arc::clone(&m));
                m
            }
        };
        let f = module.load_function(function).map_err(|e| {
            backend(
                self,
                format!(
                    "kernel `{function}` not found in source `{source_name}` ({}); kernels must be \
                     `extern \"C\" __global__`",
                    CudaError::driver("cuModuleGetFunction", e)
                ),
            )
        })?;
        entry
            .functions
            .insert((source_name, function.to_string()), f.clone());
        Ok(f)
    }
}

/// Most blocks of a [`grid_1d`] launch (kernels loop over the rest).
const MAX_GRID: u64 = 1 << 16;

/// A launch configuration for a grid-stride loop over `n` items with `block` threads per
/// block (at least one block, at most 65,536).
pub(crate) fn grid_1d(n: u64, block: u32) -> LaunchConfig {
    let blocks = n.div_ceil(u64::from(block)).clamp(1, MAX_GRID) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launches `f` on `dev`'s compute stream with `args` in order.
///
/// Contract (kept by each op): `args` match the kernel's parameters in number, order and
/// type; every [`Arg::Ptr`] is the address of a live allocation of `dev` large enough for
/// what the kernel reads or writes with that configuration, and each such allocation is
/// marked with `note_use(compute)` (so it is not freed before the kernel completes).
pub(crate) fn launch(
    dev: &CudaDevice,
    f: &CudaFunction,
    cfg: LaunchConfig,
    args: &[Arg],
) -> Result<(), CoreError> {
    let stream = compute_stream(dev)?;
    let mut builder = stream.launch_builder(f);
    for a in args {
        match a {
            Arg::Ptr(p) => builder.arg(p),
            Arg::I64(v) => builder.arg(v),
            Arg::I32(v) => builder.arg(v),
            Arg::U32(v) => builder.arg(v),
            Arg::F32(v) => builder.arg(v),
            Arg::Dims(v) => builder.arg(v),
        };
    }
    // SAFETY: by this function's contract the arguments match the kernel's signature, and
    // every pointer is a live device range of `dev` covering what the kernel touches, kept
    // alive until the kernel completes (`note_use` orders the frees after it). The argument
    // values live in `args`, which outlives the launch call that copies them.
    unsafe { builder.launch(cfg) }
        .map(|_| ())
        .map_err(|e| driver_err(dev, "cuLaunchKernel", e))
}
