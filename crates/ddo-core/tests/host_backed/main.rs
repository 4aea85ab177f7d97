//! ddo-core's contracts run on a device: the tests of core modules (tensors, residency,
//! detach, the pinned home, profiles, the fault injector, the reference components) that
//! need a real backend, on the host backend (`ddo-host`, which depends on ddo-core, so
//! these live here rather than beside the code).

mod adapter;
mod detach;
mod fault;
mod finite;
mod fp8_compute;
mod home;
mod profile;
mod reference;
mod residency;
mod tensor;
