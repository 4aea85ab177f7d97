//! Kernel infrastructure of the CUDA compute plane: CUDA C sources compiled with NVRTC
//! ahead of use, in parallel, into a process-wide image cache backed by a disk cache; each
//! device's loaded modules and functions cached by name; one launch helper.
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
//!   ([`CudaDevice::kernel`]): the first time this device needs `source_name`, takes the
//!   compiled image of `PRELUDE + source` for the device's compute capability from the
//!   image cache (below), loads it into the device's context (`cuModuleLoadData`), and
//!   returns the function `function` (cached by name). `source_name` identifies the source:
//!   one name, one text; every source the ops use is listed once in [`SOURCES`]. Every
//!   kernel must be `extern "C" __global__` so its name is not mangled. A compile failure
//!   is a [`CoreError::Backend`] carrying NVRTC's log; a missing libnvrtc is a `Backend`
//!   error saying where it is looked for (never a panic).
//! - [`prepare_kernels`]`(ordinal)` (public): starts compiling every source of [`SOURCES`]
//!   for device `ordinal`'s architecture, one thread per source, and returns at once; the
//!   ops then find the images ready, or wait for the one in flight.
//! - [`kernel_cache_dir`], [`kernel_cache_stats`], [`forget_kernel_images`] (public): the
//!   disk cache's directory, where images came from, and a way to drop the memory cache.
//! - [`compute_stream`]`(dev) -> Result<Arc<CudaStream>, CoreError>`: the device's compute
//!   stream, where every op is queued; [`same_stream`]: whether a per-device table's entry
//!   (keyed by a weak handle to that stream) is the device's.
//! - [`launch`]`(dev, &f, cfg, &[Arg])`: launches `f` on the compute stream with the
//!   arguments in order ([`launch_on`] takes another stream of the device) ([`Arg::Ptr`] for a raw device address as `u64`, [`Arg::I64`],
//!   [`Arg::I32`], [`Arg::F32`], [`Arg::Dims`]); driver errors become `CoreError`. Callers
//!   may equally use cudarc's `stream.launch_builder(&f)` directly, pushing `&u64` device
//!   addresses (each `unsafe` launch then needs its own `// SAFETY:` comment).
//! - [`grid_1d`]`(n, block)`: a launch configuration for a grid-stride loop over `n` items
//!   (grid capped, so kernels must loop).
//! - `compile_ptx(source, arch)` (tests only): NVRTC to PTX, no device;
//!   [`nvrtc_present`]`()` says whether libnvrtc loads.
//!
//! Memory discipline (see `ops/mod.rs`): outputs are allocated with `alloc_on(bytes,
//! compute)`, and every allocation a kernel touches is marked with `note_use(compute)` so
//! its free is ordered after the kernel.
//!
//! # Compiling and caching
//!
//! NVRTC (through `ops/nvrtc.rs`, the crate's only NVRTC calls) compiles `PRELUDE + source`
//! to a **cubin** for the device's real architecture (`--gpu-architecture=sm_XY` from its
//! compute capability, `-default-device`, `--std=c++17`; precise division and square root,
//! no flush-to-zero), which loads without the driver's JIT. When the cubin fails for a
//! reason other than the source (an NVRTC without `nvrtcGetCUBIN`, an architecture it does
//! not know), it falls back to PTX for `compute_XY`, as before.
//!
//! Images live in one process-wide cache ([`ImageCache`] in `ops/kernel_cache.rs`), keyed
//! by (architecture, source name); a compilation in flight (started by [`prepare_kernels`]
//! or by another device) is waited for, never repeated. Lookup order: memory, then the
//! disk cache, then NVRTC (whose image is then written to disk). The disk cache's
//! directory is `DDO_KERNEL_CACHE` (`off`, `0` or empty: no disk cache), else
//! `$XDG_CACHE_HOME/ddo/kernels`, else `$HOME/.cache/ddo/kernels`; a file is named by a
//! 128-bit hash of the prelude, source, architecture, image kind, options and NVRTC
//! version, and holds a checked header (magic, format version, kind, key, length,
//! checksum) before the image. Corrupt files are ignored and replaced; writes are atomic
//! (temporary file + rename) and best effort: an IO error only means compiling.
//!
//! The per-device cache is keyed by the device's compute stream (held weakly): entries of
//! dropped devices are removed — and their modules unloaded — at the next `kernel` call of
//! any device. Its lock is not held while an image is compiled, waited for or loaded.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock, Weak};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, DeviceRepr, DriverError, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use ddo_core::{CoreError, DType, Device};
use parking_lot::Mutex;

use super::kernel_cache::{
    Arch, Compiler, DiskCache, Image, ImageCache, ImageKind, KernelCacheStats, cache_dir_from,
};
use super::nvrtc::{self, Failure, NVRTC_HINT, Output};
use super::{attention, codec, elementwise, fp8, gemm, gguf, layout, norm};
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

/// Every kernel source the ops use, as `(source_name, text)`: the names are the
/// `source_name`s the ops pass to [`CudaDevice::kernel`], the texts their modules' `SOURCE`
/// consts. [`prepare_kernels`] compiles all of them.
pub(crate) const SOURCES: [(&str, &str); 8] = [
    (elementwise::SOURCE_NAME, elementwise::SOURCE),
    (norm::SOURCE_NAME, norm::SOURCE),
    (layout::SOURCE_NAME, layout::SOURCE),
    (gemm::SOURCE_NAME, gemm::SOURCE),
    (attention::SOURCE_NAME, attention::SOURCE),
    (codec::SOURCE_NAME, codec::SOURCE),
    (gguf::SOURCE_NAME, gguf::SOURCE),
    (fp8::SOURCE_NAME, fp8::SOURCE),
];

/// NVRTC options besides the architecture: flush-to-zero off, precise square root and
/// division, device code by default, C++17.
const OPTIONS: [&str; 5] = [
    "--ftz=false",
    "--prec-sqrt=true",
    "--prec-div=true",
    "-default-device",
    "--std=c++17",
];

/// [`OPTIONS`] with `--gpu-architecture={target}` (`sm_90` for a cubin, `compute_90` for PTX).
fn options(target: &str) -> Vec<String> {
    std::iter::once(format!("--gpu-architecture={target}"))
        .chain(OPTIONS.iter().map(|o| o.to_string()))
        .collect()
}

/// The identity of NVRTC `version` compiling with [`OPTIONS`] after [`PRELUDE`]: the part
/// of the disk key besides source, architecture and image kind.
fn nvrtc_identity((major, minor): (i32, i32)) -> String {
    format!(
        "nvrtc {major}.{minor}\noptions {}\nprelude {PRELUDE}",
        OPTIONS.join(" ")
    )
}

/// Whether libnvrtc can be loaded (no compilation is made).
pub(crate) fn nvrtc_present() -> bool {
    nvrtc::present()
}

/// The message for a failed NVRTC compilation.
fn describe(failure: Failure) -> String {
    match failure {
        Failure::NoLibrary => {
            format!("the CUDA library `libnvrtc` could not be loaded: {NVRTC_HINT}")
        }
        Failure::Source(log) => format!("NVRTC_ERROR_COMPILATION: {log}"),
        Failure::Other(message) => message,
    }
}

/// Compiles `PRELUDE + source` to PTX for `arch` (e.g. `compute_90`); the error is NVRTC's
/// log (or the missing library). Needs libnvrtc, no device; for tests.
#[cfg(test)]
pub(crate) fn compile_ptx(source: &str, arch: &str) -> Result<Ptx, String> {
    let text = format!("{PRELUDE}\n{source}");
    let ptx = nvrtc::compile(&text, "kernel.cu", &options(arch), Output::Ptx).map_err(describe)?;
    Ok(Ptx::from_src(String::from_utf8_lossy(&ptx).into_owned()))
}

/// The image of `PRELUDE + source` for `arch`: a cubin for `sm_XY`, or PTX for
/// `compute_XY` when the cubin fails for a reason other than the source (an older NVRTC,
/// say). A source error is reported at once, with NVRTC's log.
fn compile_image(name: &str, source: &str, arch: Arch) -> Result<Image, String> {
    let text = format!("{PRELUDE}\n{source}");
    let why_not_cubin = match nvrtc::compile(&text, name, &options(&arch.sm()), Output::Cubin) {
        Ok(cubin) => return Ok(Image::new(ImageKind::Cubin, cubin)),
        Err(Failure::Other(why)) => why,
        Err(other) => return Err(describe(other)),
    };
    match nvrtc::compile(&text, name, &options(&arch.compute()), Output::Ptx) {
        Ok(ptx) => Ok(Image::new(ImageKind::Ptx, ptx)),
        Err(e) => Err(format!(
            "{} (a cubin for {} failed first: {why_not_cubin})",
            describe(e),
            arch.sm()
        )),
    }
}

/// NVRTC as the image cache's compiler.
struct Nvrtc;

impl Compiler for Nvrtc {
    fn identity(&self) -> Result<String, String> {
        static IDENTITY: OnceLock<Result<String, String>> = OnceLock::new();
        IDENTITY
            .get_or_init(|| nvrtc::version().map(nvrtc_identity).map_err(describe))
            .clone()
    }

    fn compile(&self, name: &str, source: &str, arch: Arch) -> Result<Image, String> {
        compile_image(name, source, arch)
    }
}

/// The process's image cache, its disk directory read from the environment once.
fn images() -> &'static Arc<ImageCache<Nvrtc>> {
    static IMAGES: OnceLock<Arc<ImageCache<Nvrtc>>> = OnceLock::new();
    IMAGES.get_or_init(|| {
        let disk = cache_dir_from(|name| std::env::var_os(name)).map(DiskCache::new);
        Arc::new(ImageCache::new(Nvrtc, disk))
    })
}

/// Starts compiling every kernel source of the CUDA ops for device `ordinal`'s
/// architecture in the background, one thread per source, and returns at once.
///
/// The images land in the process's kernel-image cache (and in the disk cache, see
/// [`kernel_cache_dir`]), where the ops' first use of a source on any device of that
/// architecture finds them, waiting for a compilation still in flight instead of starting
/// another; sources found in the disk cache are read, not compiled. Call it as early as
/// possible (before loading weights, say) so the compiles overlap other work. Calling it
/// again, or for another device of the same architecture, starts nothing new.
///
/// Without `libcuda` or `libnvrtc` it does nothing and returns `Ok(())`. It makes no CUDA
/// context; it asks the driver for the device's compute capability only, so an error is a
/// driver error or a missing device ([`CudaError::NoDevice`], as a
/// [`CoreError::Backend`]); callers may ignore it, as opening the device reports the same.
/// A compilation that fails in the background is not reported here: the op that needs the
/// source reports it (a [`CoreError::Backend`] carrying NVRTC's log).
pub fn prepare_kernels(ordinal: usize) -> Result<(), CoreError> {
    if !crate::driver::library_present() || !nvrtc_present() {
        return Ok(());
    }
    let (major, minor) = crate::driver::compute_capability(ordinal)
        .map_err(|e| e.into_core(&format!("cuda:{ordinal}")))?;
    images().prefetch(Arch { major, minor }, &SOURCES);
    Ok(())
}

/// The directory where this process caches compiled kernel images across processes, or
/// `None` when the disk cache is off.
///
/// Read once per process from the environment: `DDO_KERNEL_CACHE` when set (`off`, `0` or
/// empty turn the disk cache off), else `$XDG_CACHE_HOME/ddo/kernels`, else
/// `$HOME/.cache/ddo/kernels`. One file per source, architecture and compiler version
/// (see `ops/kernel_cache.rs` for the format); the directory may be deleted at any time.
/// Any failure to read or write it only means compiling again, never an error.
pub fn kernel_cache_dir() -> Option<PathBuf> {
    images().disk().map(|d| d.dir().to_path_buf())
}

/// Where this process's kernel images came from so far (memory, disk, compiled).
pub fn kernel_cache_stats() -> KernelCacheStats {
    images().stats()
}

/// Forgets the compiled kernel images this process holds in memory (devices keep the
/// modules they loaded already): the next device that needs a source reads the disk cache
/// or compiles it. For tests and measurements of a cold start.
pub fn forget_kernel_images() {
    images().forget();
}

/// The loaded modules and functions of one device.
struct DeviceKernels {
    /// The device's compute stream (its identity; dead once the device is dropped).
    compute: Weak<CudaStream>,
    modules: HashMap<&'static str, Arc<CudaModule>>,
    functions: HashMap<(&'static str, String), CudaFunction>,
}

static CACHE: Mutex<Vec<DeviceKernels>> = Mutex::new(Vec::new());

/// The entry of the device whose compute stream is `stream` (made when missing), after
/// dropping the entries of dropped devices.
fn device_entry<'a>(
    cache: &'a mut Vec<DeviceKernels>,
    stream: &Arc<CudaStream>,
) -> &'a mut DeviceKernels {
    cache.retain(|e| e.compute.strong_count() > 0);
    let at = match cache
        .iter()
        .position(|e| std::ptr::eq(e.compute.as_ptr(), Arc::as_ptr(stream)))
    {
        Some(i) => i,
        None => {
            cache.push(DeviceKernels {
                compute: Arc::downgrade(stream),
                modules: HashMap::new(),
                functions: HashMap::new(),
            });
            cache.len() - 1
        }
    };
    &mut cache[at]
}

/// Loads `image` into `ctx` (`cuModuleLoadData` takes a cubin or NUL-terminated PTX).
fn load_image(ctx: &Arc<CudaContext>, image: &Image) -> Result<Arc<CudaModule>, DriverError> {
    let mut bytes = image.bytes.to_vec();
    if image.kind == ImageKind::Ptx {
        bytes.push(0);
    }
    ctx.load_module(Ptx::from_binary(bytes))
}

fn backend(dev: &CudaDevice, message: String) -> CoreError {
    CoreError::Backend {
        device: dev.id().to_string(),
        message,
    }
}

fn driver_err(dev: &CudaDevice, call: &'static str, e: DriverError) -> CoreError {
    CudaError::driver(call, e).into_core(&dev.id().to_string())
}

/// The device's compute stream (cudarc's), where ops are queued.
pub(crate) fn compute_stream(dev: &CudaDevice) -> Result<Arc<CudaStream>, CoreError> {
    let s = dev.compute_stream();
    Ok(Arc::clone(dev.stream_handle(&s)?.cuda_stream()))
}

/// Whether `entry` (a per-device table's weak handle to a device's compute stream) is
/// `stream`'s: how the cuBLAS and cuDNN tables find a device's entry.
pub(crate) fn same_stream(entry: &Weak<CudaStream>, stream: &Arc<CudaStream>) -> bool {
    std::ptr::eq(entry.as_ptr(), Arc::as_ptr(stream))
}

impl CudaDevice {
    /// The kernel `function` of the CUDA C source `source` (named `source_name`), its
    /// module loaded the first time this device needs it from the process's image cache
    /// (compiled with [`PRELUDE`] in front when no cache has it); see the module docs.
    pub(crate) fn kernel(
        &self,
        source_name: &'static str,
        source: &'static str,
        function: &str,
    ) -> Result<CudaFunction, CoreError> {
        let stream = compute_stream(self)?;
        let key = (source_name, function.to_string());
        // The device lock is not held while an image is compiled, waited for or loaded.
        let loaded = {
            let mut cache = CACHE.lock();
            let entry = device_entry(&mut cache, &stream);
            if let Some(f) = entry.functions.get(&key) {
                return Ok(f.clone());
            }
            entry.modules.get(source_name).cloned()
        };
        let module = match loaded {
            Some(m) => m,
            None => {
                let started = std::time::Instant::now();
                let ctx = self.context();
                let (major, minor) = ctx
                    .compute_capability()
                    .map_err(|e| driver_err(self, "cuDeviceGetAttribute", e))?;
                let arch = Arch { major, minor };
                let image = images().get(arch, source_name, source).map_err(|log| {
                    backend(
                        self,
                        format!(
                            "NVRTC could not compile kernel source `{source_name}` for {}: {log}",
                            arch.sm()
                        ),
                    )
                })?;
                let m =
                    load_image(ctx, &image).map_err(|e| driver_err(self, "cuModuleLoadData", e))?;
                // Another thread may have loaded it meanwhile: keep the first.
                let mut cache = CACHE.lock();
                let entry = device_entry(&mut cache, &stream);
                let m = Arc::clone(entry.modules.entry(source_name).or_insert(m));
                crate::setup_calls::kernel_loaded(started.elapsed());
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
        let mut cache = CACHE.lock();
        device_entry(&mut cache, &stream)
            .functions
            .insert(key, f.clone());
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
    launch_on(dev, &compute_stream(dev)?, f, cfg, args)
}

/// [`launch`] on `stream` (one of `dev`'s streams) instead of the compute stream; the same
/// contract, with each pointer's allocation marked with `note_use` of that stream.
pub(crate) fn launch_on(
    dev: &CudaDevice,
    stream: &Arc<CudaStream>,
    f: &CudaFunction,
    cfg: LaunchConfig,
    args: &[Arg],
) -> Result<(), CoreError> {
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
    crate::host_waits::timed("cuLaunchKernel", || unsafe { builder.launch(cfg) })
        .map(|_| ())
        .map_err(|e| driver_err(dev, "cuLaunchKernel", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_source_is_in_the_table_once() {
        let names = [
            elementwise::SOURCE_NAME,
            norm::SOURCE_NAME,
            layout::SOURCE_NAME,
            gemm::SOURCE_NAME,
            attention::SOURCE_NAME,
            codec::SOURCE_NAME,
            gguf::SOURCE_NAME,
            fp8::SOURCE_NAME,
        ];
        for name in names {
            assert_eq!(
                SOURCES.iter().filter(|(n, _)| *n == name).count(),
                1,
                "{name} must appear once in SOURCES"
            );
        }
        let mut sorted: Vec<&str> = SOURCES.iter().map(|(n, _)| *n).collect();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), SOURCES.len(), "source names are unique");
        // The same text under each name as its module's const (no copy that could drift).
        assert!(SOURCES.contains(&(gemm::SOURCE_NAME, gemm::SOURCE)));
        assert!(SOURCES.contains(&(attention::SOURCE_NAME, attention::SOURCE)));
        // One entry per file of `kernels/`, so a new source cannot be left out.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels");
        let files = std::fs::read_dir(&dir)
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .path()
                    .extension()
                    .is_some_and(|x| x == "cu")
            })
            .count();
        assert_eq!(files, SOURCES.len(), "one SOURCES entry per kernels/*.cu");
    }

    #[test]
    fn options_and_identity_name_everything_that_decides_an_image() {
        let opts = options("sm_90");
        assert_eq!(opts[0], "--gpu-architecture=sm_90");
        for o in OPTIONS {
            assert!(opts.iter().any(|x| x == o), "{o}");
        }
        let id = nvrtc_identity((13, 0));
        for o in OPTIONS {
            assert!(id.contains(o), "{o} is part of the identity");
        }
        assert!(id.contains(PRELUDE));
        assert_ne!(id, nvrtc_identity((13, 1)));
        assert_ne!(id, nvrtc_identity((12, 0)));
    }

    /// Without libcuda or libnvrtc (as on CI) the warm-up does nothing and succeeds.
    #[test]
    fn prepare_kernels_without_the_libraries_is_a_no_op() {
        if crate::driver::library_present() && nvrtc_present() {
            println!("skipped: libcuda and libnvrtc load here (the GPU tests cover it)");
            return;
        }
        let before = kernel_cache_stats();
        prepare_kernels(0).unwrap();
        prepare_kernels(7).unwrap();
        assert_eq!(kernel_cache_stats(), before);
    }

    /// Every source compiles to a cubin for sm_90 (the H200). Needs libnvrtc, no GPU.
    #[test]
    fn every_source_compiles_to_a_cubin_for_sm_90() {
        if !nvrtc_present() {
            println!("skipped: libnvrtc not found (set LD_LIBRARY_PATH to its directory)");
            return;
        }
        let arch = Arch { major: 9, minor: 0 };
        let images: Vec<_> = SOURCES
            .iter()
            .map(|&(name, source)| {
                std::thread::spawn(move || (name, compile_image(name, source, arch)))
            })
            .collect();
        for t in images {
            let (name, image) = t.join().unwrap();
            let image = image.unwrap_or_else(|log| panic!("{name} does not compile: {log}"));
            assert_eq!(image.kind, ImageKind::Cubin, "{name}");
            assert_eq!(&image.bytes[..4], b"\x7fELF", "{name}");
        }
        // A source error is reported with NVRTC's log, not hidden by the PTX fallback.
        let err = compile_image("bad.cu", "this is not C", arch).unwrap_err();
        assert!(err.starts_with("NVRTC_ERROR_COMPILATION"), "{err}");
    }
}
