//! Helpers shared by the registry's contract tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ddo_core::reference::{self, ReferenceSpec};
use ddo_core::{AllocatorKind, Component, Device, Tensor};
use ddo_host::{HostDevice, HostDeviceConfig};

/// A host device with `capacity` bytes and the caching allocator.
pub fn device(capacity: u64) -> Arc<HostDevice> {
    HostDevice::with_capacity(capacity).expect("host device")
}

/// A host device that reports the native VMM allocator.
pub fn native_device(capacity: u64) -> Arc<HostDevice> {
    HostDevice::new(HostDeviceConfig {
        capacity,
        allocator: AllocatorKind::NativeVmm,
        ..HostDeviceConfig::default()
    })
    .expect("host device")
}

/// As a trait object.
pub fn dyn_device(d: &Arc<HostDevice>) -> Arc<dyn Device> {
    d.clone()
}

/// The output of `component` run resident (weights placed by `to_device`), as bytes.
pub fn baseline(component: &Component, spec: &ReferenceSpec, batch: usize, seed: u64) -> Vec<u8> {
    let d = device(1 << 30);
    let s = d.compute_stream();
    component.to_device(&*d, &s).expect("to_device");
    let out = component
        .forward(&*d, reference::input(spec, batch, seed).expect("input"))
        .expect("resident forward");
    let bytes = out.to_host_bytes(&*d, &s).expect("download");
    component.to_host().expect("to_host");
    bytes
}

/// Output bytes of a tensor.
pub fn bytes_of(device: &dyn Device, t: &Tensor) -> Vec<u8> {
    t.to_host_bytes(device, &device.compute_stream())
        .expect("download")
}

/// Checksums of every param's host bytes.
pub fn checksums(component: &Component) -> Vec<u64> {
    component
        .params()
        .iter()
        .map(|p| p.host_checksum())
        .collect()
}

/// A fresh temporary directory, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "ddo-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A pipeline of the reference components `specs` builds.
pub fn pipeline_of(specs: &[ReferenceSpec]) -> ddo_routes::Pipeline {
    let components: Vec<Arc<Component>> =
        specs.iter().map(|s| reference::build(s).unwrap()).collect();
    ddo_routes::Pipeline::new(components).unwrap()
}

/// Flux's three phases over components named as Flux's (`text_encoder`, `transformer`,
/// `vae`), each with `activation` bytes; prompt encoding runs its component once.
pub fn demands(activation: u64) -> Vec<ddo_routes::PhaseDemand> {
    [
        ("prompt_encoding", "text_encoder"),
        ("denoise", "transformer"),
        ("decode", "vae"),
    ]
    .into_iter()
    .map(|(phase, c)| ddo_routes::PhaseDemand {
        phase: phase.into(),
        components: vec![c.into()],
        activation_bytes: activation,
        runs_once: phase == "prompt_encoding",
    })
    .collect()
}
