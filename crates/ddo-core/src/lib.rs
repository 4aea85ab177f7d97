//! DDO's core contract: what every backend implements and every route and model builds on.
//!
//! `ddo-core` sits just above `ddo-metrics` and `ddo-codec` and below everything else: the
//! two backends (`ddo-host` and `ddo-cuda`, side by side), the route crates
//! (`ddo-routes/*`), the VMM pool (`ddo-vmm`) and the models (`ddo-nn`) all build on the
//! types defined here and never on each other's internals.
//! It holds:
//!
//! - the memory and transfer plane, [`Device`], and the compute plane, [`Ops`], with
//!   backend-neutral handles
//!   ([`DeviceBuffer`], [`Stream`], [`Event`]) and host memory of three kinds
//!   ([`HostBuffer`]: pageable, pinned, checkpoint-mapped);
//! - the safetensors checkpoint reader ([`Checkpoint`]; it reads coded tensors too, which
//!   [`coded_file`] writes for `ddo convert --compress lossless`) and the GGUF reader
//!   ([`gguf`]);
//! - [`Tensor`], [`DType`], [`Param`] (stable id, host source, device residency, aliases)
//!   and [`Component`] (a tree of modules whose leaves own the params);
//! - the route contract ([`Route`], [`AttachedRoute`]) and the forward driver
//!   ([`ForwardContext`]) that programs run their leaves through;
//! - configuration ([`Preset`], [`RouteSpec`], [`Settings`]) and the pure
//!   [`resolve`](resolve::resolve)r that encodes the seed's VAE table;
//! - `detach_auxiliary_cpu_sources` ([`detach`]);
//! - what a route will hold before it attaches ([`Footprint`]) and the host budget a run
//!   plans under ([`HostBudget`]);
//! - the pinned host memory a device keeps after `release_host` and reuses
//!   ([`released_host`]);
//! - per-op device-time [`profile`]s that both backends record;
//! - the [`streaming`] engine (schedule, residency planner, coalesced pinned staging,
//!   device prefetch ring) that streaming routes run on;
//! - one set of shape rules for every backend's ops ([`shape`]);
//! - the disk's read rate for the weights' files ([`disk`]);
//! - scans of stored values for NaN, Inf and overflowing magnitudes ([`values`]);
//! - test support behind the `test-support` feature: the fault-injecting device and
//!   seeded reference components, over any `Device`.
//!
//! The host backend (`HostDevice`, the CPU implementation of `Device` and `Ops`) is the
//! crate `ddo-host`; this crate's tests that need a device run on it from `tests/`.
//!
//! Architecture invariant: this crate never depends on cudarc or any GPU library.

pub mod adapter;
pub mod checkpoint;
pub mod coded_file;
pub mod component;
pub mod config;
pub mod detach;
pub mod device;
pub mod disk;
pub mod dtype;
pub mod error;
#[cfg(any(test, feature = "test-support"))]
pub mod fault;
pub mod file_guard;
pub mod finite;
pub mod footprint;
pub mod fp8_compute;
pub mod gguf;
pub mod host_budget;
pub mod host_memory;
pub mod linear_calls;
pub mod ops;
pub mod param;
pub mod profile;
#[cfg(any(test, feature = "test-support"))]
pub mod reference;
pub mod released_host;
pub mod residency;
pub mod resolve;
pub mod rng;
pub mod route;
pub mod shape;
pub mod streaming;
pub mod tensor;
pub mod values;

pub use checkpoint::{Checkpoint, UniqueMap};
pub use component::{Component, Leaf, LeafId, LeafKind, Mode, Module, ModuleKind, Placement};
pub use config::{
    Budget, ComponentKind, Compression, OffloadType, PinnedSource, Preset, RouteCatalog, RouteId,
    RouteOptions, RouteSpec, RouteTarget, Settings,
};
pub use device::{
    AllocatorKind, Device, DeviceBuffer, DeviceId, DeviceKind, DeviceSlice, Event, MemoryInfo,
    SetupCalls, Stream, WeakDeviceBuffer, ops_of,
};
pub use dtype::DType;
pub use error::{CoreError, DetachRefusal, Refusal, Result};
#[cfg(any(test, feature = "test-support"))]
pub use fault::{FaultAction, FaultCounts, FaultInjectingDevice, FaultKind};
pub use footprint::{Footprint, FootprintContext};
pub use host_budget::{HostBudget, HostBudgetSource};
pub use host_memory::{CheckpointMap, HostBuffer, HostMemoryKind, HostSlice};
pub use linear_calls::{LinearCall, LinearKind};
pub use ops::{AttentionInput, BinaryOp, Conv2dParams, Ops, ReduceOp, UnaryOp, check_finite};
pub use param::{Param, ParamId, ParamKind, SourceDescriptor};
pub use profile::{
    ComputeDevice, GemmShape, LinearShapeTime, OpCall, OpClassTime, OpProfile, OpProfiler,
    ProfiledOps,
};
pub use resolve::{DecidedBy, Environment, MapEnvironment, ProcessEnvironment, Resolution};
pub use route::{
    AttachedRoute, ComponentProgram, EffectiveOption, ForwardContext, HeaderEstimate, LeafWeights,
    OptionDecl, OptionKind, OptionRequirement, OptionTable, OptionValue, RefusedOption, Route,
    describe_budget,
};
pub use tensor::{QuantLayout, Tensor, TensorStorage};
