//! Every route's contract tests (`route_contract/`: attach, forwards byte-identical to
//! resident, removal restores, bad options refused) on the host backend: a host device with
//! the caching allocator, or reporting the native one for `native_vmm`; and again on the
//! same device behind ddo-host's `DeferredComputeDevice`, whose compute runs as late as the
//! host allows, so that a copy which does not wait for the compute reading its ring slot
//! lands first and changes the output (the plain host device runs each op before the host
//! moves on, so it cannot show that). The same bodies run on CUDA in
//! `ddo-cuda/tests/gpu_route_contracts.rs`.

#[macro_use]
mod route_contract;

use std::sync::Arc;

use ddo_core::{AllocatorKind, Device};
use ddo_host::{DeferredComputeDevice, HostDevice, HostDeviceConfig};

fn host_device(native: bool) -> Arc<HostDevice> {
    HostDevice::new(HostDeviceConfig {
        capacity: 1 << 30,
        allocator: if native {
            AllocatorKind::NativeVmm
        } else {
            AllocatorKind::Caching
        },
        ..HostDeviceConfig::default()
    })
    .expect("host device")
}

fn host(native: bool) -> Option<Arc<dyn Device>> {
    Some(host_device(native))
}

fn host_deferred(native: bool) -> Option<Arc<dyn Device>> {
    Some(DeferredComputeDevice::new(host_device(native)).expect("deferred compute device"))
}

route_contract_tests!(host, super::host);
route_contract_tests!(host_deferred, super::host_deferred);
