//! The reference components (`ddo_core::reference`) run on a host device: refusing host
//! weights, deterministic, and catching a route that forgets to wait for its copy stream.

use std::sync::Arc;

use ddo_core::reference::{ReferenceSpec, build, input};
use ddo_core::{CoreError, DType, Device, Param, Result};
use ddo_host::HostDevice;

#[test]
fn an_unrouted_component_with_host_weights_refuses_to_run() {
    let spec = ReferenceSpec::small("transformer", 2, 8, DType::F32);
    let c = build(&spec).unwrap();
    let d = HostDevice::with_capacity(1 << 20).unwrap();
    let err = c.forward(&*d, input(&spec, 2, 1).unwrap()).unwrap_err();
    assert!(matches!(err, CoreError::NotResident { .. }), "{err}");
}

#[test]
fn to_device_runs_and_is_deterministic() {
    let spec = ReferenceSpec::small("vae", 3, 8, DType::BF16);
    let c = build(&spec).unwrap();
    let d = HostDevice::with_capacity(1 << 20).unwrap();
    c.to_device(&*d, &d.compute_stream()).unwrap();
    let s = d.compute_stream();
    let a = c.forward(&*d, input(&spec, 2, 1).unwrap()).unwrap();
    let b = c.forward(&*d, input(&spec, 2, 1).unwrap()).unwrap();
    assert_eq!(
        a.to_host_bytes(&*d, &s).unwrap(),
        b.to_host_bytes(&*d, &s).unwrap()
    );
    let values = a.to_f32_vec(&*d, &s).unwrap();
    assert!(values.iter().all(|v| v.is_finite()) && values.iter().any(|v| *v != 0.0));
    drop((a, b));
    c.to_host().unwrap();
    assert_eq!(d.memory_info().allocated, 0);
}

/// A route that copies each leaf's weights on a copy stream and (when `wait` is false)
/// forgets to order compute after the copy.
#[derive(Debug)]
struct CopyStreamRoute {
    device: Arc<HostDevice>,
    copy: ddo_core::device::Stream,
    wait: bool,
    metrics: Arc<ddo_metrics::RouteMetrics>,
    table: parking_lot::Mutex<ddo_core::residency::ResidencyTable>,
}

impl ddo_core::route::AttachedRoute for CopyStreamRoute {
    fn route(&self) -> ddo_core::config::RouteId {
        ddo_core::config::RouteId::DIFFUSERS_GROUP_OFFLOAD
    }
    fn describe(&self) -> String {
        "test".into()
    }
    fn device_id(&self) -> ddo_core::device::DeviceId {
        self.device.id()
    }
    fn metrics(&self) -> &Arc<ddo_metrics::RouteMetrics> {
        &self.metrics
    }
    fn before_leaf(&self, leaf: &ddo_core::component::Leaf) -> Result<()> {
        let params: Vec<_> = leaf.params().iter().map(|(_, p)| p.clone()).collect();
        // Pinned sources, so the copies are asynchronous.
        let pinned =
            |p: &Param| Ok(ddo_core::residency::pin_copy(&*self.device, &p.host())?.slice_all());
        self.table
            .lock()
            .acquire(&*self.device, &params, &pinned, &self.copy, &self.metrics)?;
        if self.wait {
            let done = self.device.record_event(&self.copy)?;
            self.device
                .wait_event(&self.device.compute_stream(), &done)?;
        }
        Ok(())
    }
    fn after_leaf(&self, leaf: &ddo_core::component::Leaf) -> Result<()> {
        let params: Vec<_> = leaf.params().iter().map(|(_, p)| p.clone()).collect();
        self.device.synchronize()?;
        self.table.lock().release(
            &*self.device,
            &params,
            ddo_core::residency::FreeMode::Immediate,
            &self.device.compute_stream(),
        );
        Ok(())
    }
    fn end_phase(&self) -> Result<()> {
        Ok(())
    }
    fn detach(&self) -> Result<()> {
        Ok(())
    }
}

#[test]
fn reference_leaves_catch_a_missing_event_wait() {
    let spec = ReferenceSpec::small("transformer", 2, 8, DType::F32);
    let expected = {
        let c = build(&spec).unwrap();
        let d = HostDevice::with_capacity(1 << 20).unwrap();
        c.to_device(&*d, &d.compute_stream()).unwrap();
        let out = c.forward(&*d, input(&spec, 1, 1).unwrap()).unwrap();
        out.to_host_bytes(&*d, &d.compute_stream()).unwrap()
    };
    for wait in [true, false] {
        let d = HostDevice::new(ddo_host::HostDeviceConfig {
            link_bytes_per_sec: Some(100_000.0),
            ..Default::default()
        })
        .unwrap();
        let c = build(&spec).unwrap();
        let route = Arc::new(CopyStreamRoute {
            copy: d.create_stream().unwrap(),
            device: d.clone(),
            wait,
            metrics: Default::default(),
            table: Default::default(),
        });
        c.install_hooks(route).unwrap();
        let out = c.forward(&*d, input(&spec, 1, 1).unwrap()).unwrap();
        let got = out.to_host_bytes(&*d, &d.compute_stream()).unwrap();
        assert_eq!(got == expected, wait, "wait={wait}");
    }
}
