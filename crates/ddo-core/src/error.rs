//! The crate's one error enum, [`CoreError`], and the reasons a route or an operation can
//! refuse ([`Refusal`], [`DetachRefusal`]). Every variant says what to do about it.

use std::path::PathBuf;

use thiserror::Error;

/// `bytes` in the syntax `--vram-budget` and route options read: whole GiB or MiB,
/// rounded up to a MiB.
pub fn budget_arg(bytes: u64) -> String {
    let mib = bytes.div_ceil(1 << 20);
    if mib.is_multiple_of(1024) {
        format!("{}GiB", mib / 1024)
    } else {
        format!("{mib}MiB")
    }
}

/// The most a `--vram-budget` can name and still be read back (the parser refuses a size
/// past 2^64 bytes); a need past it is no budget at all.
pub const LARGEST_BUDGET: u64 = 1 << 60;

/// A [`CoreError::BudgetTooSmall`]'s hint: the budget that works when one can be given,
/// then `others` (what else helps), or that no budget holds the work.
pub fn budget_advice(needed: u64, others: &str) -> String {
    match (needed <= LARGEST_BUDGET, others.is_empty()) {
        (true, true) => format!("give --vram-budget {} or more", budget_arg(needed)),
        (true, false) => format!(
            "give --vram-budget {} or more, or {others}",
            budget_arg(needed)
        ),
        (false, true) => "no budget holds this work; ask for less".to_string(),
        (false, false) => format!("no budget holds this work: {others}"),
    }
}

/// Result alias for the core crate.
pub type Result<T, E = CoreError> = std::result::Result<T, E>;

/// Everything that can go wrong in DDO's core, its host backend, and the routes built on it.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum CoreError {
    /// The device could not satisfy an allocation.
    #[error(
        "out of device memory on {device}: requested {requested} B with {allocated} B of {capacity} B allocated; \
         choose an offloading route or a smaller budget, or free memory first"
    )]
    OutOfMemory {
        /// Device that refused.
        device: String,
        /// Bytes asked for.
        requested: u64,
        /// Bytes allocated at the time.
        allocated: u64,
        /// Device capacity.
        capacity: u64,
    },
    /// The host could not give memory DDO asked for (the allocator or the kernel refused:
    /// the process's address-space limit, or no memory left).
    #[error(
        "out of host memory: {requested} B for {what} could not be allocated; free memory, raise the \
         process's memory limit (ulimit -v), or ask for less work (a smaller --height/--width, \
         fewer --num-images, a smaller --vram-budget on the host device)"
    )]
    HostOutOfMemory {
        /// Bytes asked for.
        requested: u64,
        /// What they were for.
        what: String,
    },
    /// A VRAM budget below what any plan of a pipeline phase needs.
    #[error(
        "a VRAM budget of {} is too small for the {phase} phase, which needs at least {} ({detail}); \
         {}",
        ddo_metrics::format_bytes(*.budget), budget_arg(*.needed), budget_advice(*.needed, advice)
    )]
    BudgetTooSmall {
        /// The phase.
        phase: String,
        /// The component that needs the most device memory in that phase.
        component: String,
        /// The budget, bytes.
        budget: u64,
        /// The smallest budget that works, bytes (a whole number of MiB).
        needed: u64,
        /// What the needed bytes are made of.
        detail: String,
        /// What else to do besides a larger budget (less work, another route), as far as
        /// each can help; may be empty.
        advice: String,
    },
    /// A host budget (`--host-budget`, or the default: `MemAvailable` less a reserve) below
    /// what any plan of a pipeline phase needs: the phase's least pinned memory (staging
    /// buffers, the pinned homes of routes given explicitly) plus the process's working
    /// memory. `needed` was found by planning with it.
    #[error(
        "a host budget of {} ({from}) is too small for the {phase} phase, which needs at least {} \
         ({detail}); give --host-budget {} or more, or free host memory, or use routes that pin \
         less (e.g. --route {component}=diffusers_group_offload:use_stream=true,pinned=false)",
        ddo_metrics::format_bytes(*.budget), budget_arg(*.needed), budget_arg(*.needed)
    )]
    HostBudgetTooSmall {
        /// The phase.
        phase: String,
        /// The component that pins the most in that phase.
        component: String,
        /// The budget, bytes.
        budget: u64,
        /// Where the budget came from (`--host-budget`, `MemAvailable 31 GiB less ...`).
        from: String,
        /// The smallest budget that works, bytes (a whole number of MiB).
        needed: u64,
        /// What the needed bytes are made of.
        detail: String,
    },
    /// A VAE decode under `--tiled-decode auto` (the default) that fits what the budget
    /// leaves it neither untiled nor in Diffusers' default tiles (auto never tiles smaller:
    /// small tiles ruin the image). Issue 34: this was an invalid value `auto` of
    /// `tiled-decode`, which the user had not given.
    #[error(
        "--tiled-decode auto (the default) found no decode that fits in the {} the budget leaves \
         free: {needs}; {hint}",
        ddo_metrics::format_bytes(*.free)
    )]
    DecodeDoesNotFit {
        /// Device bytes the budget leaves the decode.
        free: u64,
        /// What the decode needs, in words (untiled, and in the default tiles).
        needs: String,
        /// What to do: the smallest `--vram-budget` that would do, `--tiled-decode off`, a
        /// smaller `--height`/`--width`.
        hint: String,
    },
    /// Pinned host memory would exceed the device's pinned limit.
    #[error(
        "pinned host memory limit reached: requested {requested} B with {pinned} B of {limit} B pinned; \
         raise `pinned_limit`, use `low_cpu_mem_usage=true`, or choose a route without pinned weights"
    )]
    PinnedLimit {
        /// Bytes asked for.
        requested: u64,
        /// Bytes pinned at the time.
        pinned: u64,
        /// The limit.
        limit: u64,
    },
    /// The lossless-coded units (`compress=lossless`) would exceed the pinned limit: they
    /// live in a pinned home of their own, so staging without pinned copies
    /// (`low_cpu_mem_usage`, `pinned=false`) is no way out for them.
    #[error(
        "pinned host memory limit reached: the lossless-coded units need {requested} B with {pinned} B of \
         {limit} B pinned; raise `pinned_limit`, give the route a `budget` so that fewer units stream, \
         or stream them uncoded (compress=none)"
    )]
    CodedPinnedLimit {
        /// Bytes asked for.
        requested: u64,
        /// Bytes pinned at the time.
        pinned: u64,
        /// The limit.
        limit: u64,
    },
    /// The device cannot page-lock this host memory where it is.
    #[error(
        "{device} cannot register host memory in place: {reason}; stage the weights in a pinned home \
         instead (pinned_source=home, the default) or use pinned=false"
    )]
    HostRegisterUnsupported {
        /// Device asked.
        device: String,
        /// Why not (the backend has no such call, the memory is not a checkpoint mapping, or
        /// the driver refused it as unsupported).
        reason: String,
    },
    /// A lossless-coded transfer unit (route option `compress=lossless`) did not decode to
    /// the bytes it was coded from: the forward's output is not returned.
    #[error(
        "{device}: a lossless-coded weight unit failed to decode ({detail}); the forward's output was \
         dropped, never used; detach and attach the component again, or stream it with compress=none"
    )]
    LosslessDecode {
        /// Device that decoded it.
        device: String,
        /// What was wrong (a bad code, a stream not consumed exactly, a checksum mismatch).
        detail: String,
    },
    /// A copy or view reaches outside a buffer.
    #[error(
        "{what}: range {offset}..{offset}+{len} lies outside a buffer of {buffer_len} B; this is a bug in the caller"
    )]
    OutOfRange {
        /// What was being done.
        what: &'static str,
        /// Start of the range.
        offset: usize,
        /// Length of the range.
        len: usize,
        /// Length of the buffer.
        buffer_len: usize,
    },
    /// Two sizes that must agree do not.
    #[error("{what}: expected {expected} B, got {actual} B")]
    SizeMismatch {
        /// What was being done.
        what: String,
        /// Expected size.
        expected: usize,
        /// Actual size.
        actual: usize,
    },
    /// A buffer, stream or event from another device (or another backend) was passed.
    #[error(
        "{what} belongs to {found}, not to {expected}; pass handles created by the same device"
    )]
    WrongDevice {
        /// What was passed.
        what: &'static str,
        /// Device the call was made on.
        expected: String,
        /// Device the handle belongs to.
        found: String,
    },
    /// The backend failed in a way the caller cannot fix by changing arguments.
    #[error("device backend failure on {device}: {message}")]
    Backend {
        /// Device.
        device: String,
        /// What failed.
        message: String,
    },
    /// A file could not be read.
    #[error("cannot read {path}: {source}; check that the file exists and is readable")]
    Io {
        /// File.
        path: PathBuf,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// A weight file changed (replaced, removed, truncated, rewritten) while a run read it
    /// ([`crate::file_guard`]).
    #[error(
        "the weight file {path} was {change} while DDO read it; nothing was written; leave weight \
         files unchanged while ddo runs, and run again"
    )]
    CheckpointChanged {
        /// File.
        path: PathBuf,
        /// What changed, in words.
        change: String,
    },
    /// A checkpoint file is malformed.
    #[error("checkpoint {path} is not a valid safetensors file: {message}")]
    Checkpoint {
        /// File.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A GGUF file is malformed, or stores what DDO does not read ([`crate::gguf`]).
    #[error(
        "GGUF file {path} cannot be read: {field} {problem}; download the file again, or convert \
         the model again with a current llama.cpp (convert_hf_to_gguf.py, llama-quantize) to a \
         supported type"
    )]
    Gguf {
        /// File.
        path: PathBuf,
        /// The field at fault: `version`, ``metadata `<key>` ``, ``tensor `<name>`.dims[0]``, ...
        field: String,
        /// What is wrong with it.
        problem: String,
    },
    /// A checkpoint does not hold a tensor that was asked for.
    #[error(
        "checkpoint {path} has no tensor named `{name}`; check the model config against the file"
    )]
    MissingTensor {
        /// File.
        path: PathBuf,
        /// Tensor name.
        name: String,
    },
    /// Tensor shapes or dtypes do not fit an operation.
    #[error("{what}: {message}")]
    Shape {
        /// Operation.
        what: String,
        /// What does not fit.
        message: String,
    },
    /// A preset name is not one DDO knows.
    #[error("unknown preset `{name}`; valid presets: {valid}")]
    UnknownPreset {
        /// The name given.
        name: String,
        /// The valid names.
        valid: String,
    },
    /// A route name is not one DDO knows.
    #[error("unknown route `{name}`; valid routes: {valid}")]
    UnknownRoute {
        /// The name given.
        name: String,
        /// The valid names.
        valid: String,
    },
    /// An option has a value DDO cannot use.
    #[error("invalid value `{value}` for `{option}`: {hint}")]
    InvalidOption {
        /// The option.
        option: String,
        /// The value given.
        value: String,
        /// What would be valid.
        hint: String,
    },
    /// Options that cannot hold together.
    #[error("contradictory options: {message}; {hint}")]
    ContradictoryOptions {
        /// Which options clash.
        message: String,
        /// What to do.
        hint: String,
    },
    /// An environment variable read under `use_environment=true` is invalid.
    #[error(
        "environment variable {var}=`{value}` is invalid: {message}; fix or unset it, or do not read the environment (`ddo run|decode|resolve ... --no-env`, Settings::use_environment = false)"
    )]
    InvalidEnvironment {
        /// Variable.
        var: String,
        /// Its value.
        value: String,
        /// The underlying problem.
        message: String,
    },
    /// A route's preflight refused the component, before anything was touched.
    #[error("route `{route}` refused component `{component}`: {refusal}")]
    Refused {
        /// Route that refused.
        route: &'static str,
        /// Component.
        component: String,
        /// Why, and what to do instead.
        refusal: Refusal,
    },
    /// The component already has a route attached.
    #[error(
        "component `{component}` already has route `{route}` attached; remove it (or drop its handle and the \
         component references for diffusers_group_offload) before attaching another"
    )]
    AlreadyAttached {
        /// Component.
        component: String,
        /// Route attached now.
        route: &'static str,
    },
    /// A leaf ran while one of its weights was not on the execution device.
    #[error(
        "leaf `{leaf}` ran while `{param}` was not on the execution device; the attached route failed to onload \
         it (a bug in the route), or the component has no route and its weights live on the host"
    )]
    NotResident {
        /// Leaf path.
        leaf: String,
        /// Param name.
        param: String,
    },
    /// Code inside a managed boundary panicked.
    #[error(
        "panic inside `{context}`: {message}; the route was cleaned up and host weights are intact"
    )]
    Panicked {
        /// Where.
        context: String,
        /// The panic message.
        message: String,
    },
    /// `detach_auxiliary_cpu_sources` refused; nothing was changed.
    #[error("detach_auxiliary_cpu_sources refused for `{component}`: {refusal}")]
    DetachRefused {
        /// Component.
        component: String,
        /// Why.
        refusal: DetachRefusal,
    },
    /// `remove_dynamic_offload` was asked to remove hooks DDO does not own.
    #[error(
        "route `{route}` on `{component}` is owned by its handle and the component, not by remove_dynamic_offload; \
         drop the handle and every reference to the component (or use cleanup_on_error) to release it"
    )]
    NotOwned {
        /// Route.
        route: &'static str,
        /// Component.
        component: String,
    },
    /// The handle's route was already detached (by cleanup or removal).
    #[error(
        "route on `{component}` was already detached; attach a route again with enable_offload"
    )]
    Detached {
        /// Component.
        component: String,
    },
    /// A named component does not exist in a pipeline.
    #[error("pipeline has no component named `{name}`; components: {known}")]
    UnknownComponent {
        /// Name asked for.
        name: String,
        /// Names present.
        known: String,
    },
    /// The native VMM allocator is not this device's allocator.
    #[error(
        "{device} does not run the native VMM allocator, so it has no native idle cache to release; \
         install it as the first step of the process (`CudaDevice::install_native_vmm`, \
         `ddo run --preset vmm_fast` or `--route COMPONENT=native_vmm`), or call empty_cache() for the caching allocator"
    )]
    NativeAllocatorNotInstalled {
        /// The device.
        device: String,
    },
    /// Work is still queued on the device, so nothing may be unmapped now.
    #[error(
        "{device} is not quiescent ({pending}); the native idle cache is released only at a \
         quiescent boundary: synchronize the device (a phase boundary does) and call again. Nothing was released"
    )]
    NotQuiescent {
        /// The device.
        device: String,
        /// What is still pending.
        pending: String,
    },
    /// A pipeline's latents, prompt embeddings or decoded image hold NaN or Inf values: a
    /// weight or a config value is NaN, Inf or overflows. The run stops there, before
    /// anything is returned (issue 34: such a run used to end as an all-black image).
    #[error(
        "{count} NaN/Inf value(s) in {what} after {}: the run stopped. A weight or a config value is \
         NaN/Inf or overflows: run `ddo inspect --check-values PATH` on the pipeline folder (or each \
         checkpoint file) to find the tensor, and check the configs' numbers (scheduler shift, VAE \
         scaling_factor and shift_factor)",
        non_finite_at(phase, *step)
    )]
    NonFinite {
        /// The phase (`prompt encoding`, `denoise`, `decode`).
        phase: String,
        /// The step, from 1, and the steps of the phase, when the phase has steps.
        step: Option<(usize, usize)>,
        /// What was checked (`the latents`, `the decoded image`, ...).
        what: String,
        /// Non-finite elements found.
        count: u64,
    },
    /// `--compute fp8` met a linear whose input holds a NaN or an Inf: its amax has no fp8
    /// scale, so the layer cannot run in fp8 and the run stops there (never an image of
    /// NaNs).
    #[error(
        "the input of `{layer}` holds a NaN or an Inf, so it has no fp8 scale and the run \
         stopped under --compute fp8; hint: nothing was written. `ddo run ...` with --compute \
         bf16 shows whether the bf16 run stays finite, and `ddo inspect --check-values PATH` on \
         the checkpoint finds a NaN or Inf weight"
    )]
    NonFiniteActivation {
        /// The layer (`component.leaf.path`), or empty where the op alone knew it.
        layer: String,
    },
    /// The run was cancelled by its caller (a server's client went away) at a step
    /// boundary; everything it held was released.
    #[error(
        "the run was cancelled at {phase} step {step}; hint: nothing was written, and the device holds nothing of it: send the request again"
    )]
    Cancelled {
        /// The phase (`denoise`).
        phase: String,
        /// The last step that ran, from 1.
        step: usize,
    },
    /// A fault injected on purpose by a test wrapper.
    #[error("injected fault: {0}")]
    Injected(String),
}

/// Where [`CoreError::NonFinite`] was found: `denoise step 3 of 28`, or the phase alone.
fn non_finite_at(phase: &str, step: Option<(usize, usize)>) -> String {
    match step {
        Some((i, n)) => format!("{phase} step {i} of {n}"),
        None => phase.to_string(),
    }
}

/// Why a route's preflight refused. Each says what to do instead.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum Refusal {
    /// `linear_convolution` cannot run under the installed native VMM allocator.
    #[error(
        "the native VMM allocator is installed on this device; run linear_convolution in a separate process \
         with the caching allocator, or use diffusers_group_offload leaf_level"
    )]
    NativeAllocatorInstalled,
    /// The route needs the native VMM allocator, which is not installed.
    #[error(
        "the native VMM allocator is not installed on this device; install it as the first step of a fresh \
         process (before any allocation), or choose diffusers_group_offload"
    )]
    NativeAllocatorRequired,
    /// The component holds quantized storage the route cannot move.
    #[error(
        "`{param}` has quantized or fp8 storage, which this route does not support; use diffusers_group_offload or none"
    )]
    Quantized {
        /// First quantized (or fp8) param.
        param: String,
    },
    /// An explicit option the route cannot honour.
    #[error("option `{option}` cannot be honoured by this route: {hint}")]
    UnsupportedOption {
        /// The option.
        option: &'static str,
        /// What to do.
        hint: &'static str,
    },
    /// The component is in training mode.
    #[error("the component is in training mode; call eval() first (DDO routes are for inference)")]
    TrainingMode,
    /// A native VMM VAE needs an explicit source/capacity opt-in.
    #[error(
        "native_vmm for a VAE is an explicit opt-in: give a capacity budget, or use the VAE default \
         (diffusers_group_offload leaf_level, no stream)"
    )]
    VaeNeedsExplicitCapacity,
    /// The weights do not fit on the device.
    #[error(
        "the weights need {needed} B but the device can give {available} B; choose an offloading route \
         (diffusers_group_offload or native_vmm with a budget)"
    )]
    DoesNotFit {
        /// Bytes needed.
        needed: u64,
        /// Bytes available.
        available: u64,
    },
    /// A budget is smaller than the largest leaf the route must hold at once.
    #[error("{given}: below the largest leaf `{leaf}` ({leaf_bytes} B); raise the budget")]
    BudgetBelowLargestLeaf {
        /// Budget, bytes.
        budget: u64,
        /// The budget as the spec gives it, in words (`budget=1048576 B`; for a margin,
        /// what it leaves: `budget=free-9.00 GiB leaves 0 B on this device (8.00 GiB
        /// free)`), never the computed bytes alone.
        given: String,
        /// Largest leaf.
        leaf: String,
        /// Its bytes.
        leaf_bytes: u64,
    },
    /// A budget of what the device has free less a margin (`budget=free-SIZE`, or a
    /// route's default of that form) leaves nothing: the margin is not below what is free.
    #[error(
        "budget free-{} leaves 0 B: the device has {} free; give a smaller margin (budget=free-SIZE) or a size (budget=SIZE)",
        ddo_metrics::format_bytes(*margin),
        ddo_metrics::format_bytes(*free)
    )]
    NoBudgetLeft {
        /// The margin.
        margin: u64,
        /// What the device has free.
        free: u64,
    },
    /// Some of the component's weights are already on a device, outside any route.
    #[error(
        "`{param}` is already on a device outside any route; call Component::to_host() before attaching a route"
    )]
    WeightsAlreadyOnDevice {
        /// First resident param.
        param: String,
    },
    /// The device has no streams to overlap copies with.
    #[error("this device cannot run a copy stream; pass use_stream=false")]
    NoStreams,
}

/// Why `detach_auxiliary_cpu_sources` refused. Each leaves everything as it was.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum DetachRefusal {
    /// The component is in training mode.
    #[error("the component is in training mode; call eval() before detaching")]
    TrainingMode,
    /// The component is not marked exclusively owned.
    #[error(
        "the component is not exclusively owned; escaped tensor references could keep the mapping alive. \
         Mark it exclusively owned only if no other code holds its tensors"
    )]
    NotExclusive,
    /// The component has already run a forward under the route.
    #[error(
        "execution has already started ({forwards} forward(s)); detach before the first forward"
    )]
    ExecutionStarted {
        /// Forwards run so far.
        forwards: u64,
    },
    /// A checkpoint mapping is referenced by something DDO did not register: an open
    /// `Checkpoint`, an escaped tensor, or the attached route itself when it streams from
    /// the mapping page-locked in place (`pinned_source=register`, the streaming default).
    #[error(
        "checkpoint mapping {path} has {unknown} reference(s) DDO did not register: an open Checkpoint or an \
         escaped tensor (drop them first), or the attached route streaming from the mapping page-locked in \
         place (pinned_source=register: the mapping is then the weights' one host copy and there is nothing \
         to detach; pinned_source=home streams from a pinned home instead)"
    )]
    UnknownOwnership {
        /// Mapped file.
        path: String,
        /// References not accounted for.
        unknown: usize,
    },
    /// Two distinct tensors overlap in one source (a partial or unregistered alias).
    #[error(
        "`{first}` and `{second}` overlap in {path} without being one registered alias; \
         register them as an alias (one param, two names) or leave the sources attached"
    )]
    OverlappingSources {
        /// One tensor.
        first: String,
        /// The other.
        second: String,
        /// Mapped file.
        path: String,
    },
    /// A tensor's layout cannot be copied faithfully.
    #[error("`{param}` has an unsupported layout ({why}); leave its source attached")]
    UnsupportedLayout {
        /// Param.
        param: String,
        /// Why.
        why: String,
    },
}
