//! Every route's contract tests (`route_contract/`: attach, forwards byte-identical to
//! resident, removal restores, bad options refused) on the host backend: a host device with
//! the caching allocator, or reporting the native one for `native_vmm`. The same bodies run
//! on CUDA in `ddo-cuda/tests/gpu_route_contracts.rs`.

#[macro_use]
mod route_contract;

use std::sync::Arc;

use ddo_core::{AllocatorKind, Device};
use ddo_host::{HostDevice, HostDeviceConfig};

fn host(native: bool) -> Option<Arc<dyn Device>> {
    let d = HostDevice::new(HostDeviceConfig {
        capacity: 1 << 30,
        allocator: if native {
            AllocatorKind::NativeVmm
        } else {
            AllocatorKind::Caching
        },
        ..HostDeviceConfig::default()
    })
    .expect("host device");
    Some(d)
}

route_contract_tests!(host, super::host);
