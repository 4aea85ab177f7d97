//! Integration tests of the `diffusers_group_offload` route on the host backend: outputs
//! bit-identical to resident execution, peak-memory promises, schedule re-learning,
//! failures mid-forward, preflight refusals and teardown.

mod common;
mod errors;
mod lifecycle;
mod matrix;
mod ordering;
mod peak;
mod random;
mod schedule;
mod streaming;
