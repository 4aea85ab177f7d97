//! Every route's contract tests on CUDA: the bodies of `ddo-routes/tests/route_contract/`
//! (attach, forwards byte-identical to resident, removal restores, bad options refused),
//! which `ddo-routes/tests/route_contracts.rs` runs on the host backend, here on `cuda:0` —
//! a device with the caching allocator, or one with the native allocator installed at
//! bootstrap for `native_vmm` (one at a time: one allocator per GPU in a process). In the
//! GPU bundle; without a GPU each test prints "skipped: no CUDA device" and passes.

mod common;
#[macro_use]
#[path = "../../ddo-routes/tests/route_contract/mod.rs"]
mod route_contract;

use std::sync::Arc;

use ddo_core::Device;

fn cuda(native: bool) -> Option<Arc<dyn Device>> {
    common::open_gpu(native).map(|d| d as Arc<dyn Device>)
}

route_contract_tests!(cuda, super::cuda);
