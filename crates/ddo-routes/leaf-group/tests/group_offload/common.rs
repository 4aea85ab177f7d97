//! Helpers shared by the tests: specs, devices, resident baselines, the activation
//! allowance of a reference program, and attaching with the hooks installed.

use std::sync::Arc;

use ddo_core::reference::{self, ReferenceSpec};
use ddo_core::route::checked_preflight;
use ddo_core::{
    AttachedRoute, Component, Device, OffloadType, Route, RouteId, RouteOptions, RouteSpec,
    RouteTarget, Tensor,
};
use ddo_host::{HostDevice, HostDeviceConfig};
use ddo_metrics::RouteMetrics;
use ddo_route_leaf_group::{AttachedGroupOffload, GroupOffloadRoute};

/// Where host bytes come from, as options.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostChoice {
    /// `pinned` and `low_cpu_mem_usage` not given: Diffusers' defaults.
    Default,
    /// `pinned=true`.
    Pinned,
    /// `low_cpu_mem_usage=true`.
    LowCpu,
    /// `pinned=false`: copies from the params' own bytes.
    Unpinned,
}

/// A route configuration of a test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Case {
    pub offload_type: OffloadType,
    pub blocks_per_group: usize,
    pub use_stream: bool,
    pub record_stream: bool,
    pub host: HostChoice,
}

impl Case {
    pub fn spec(&self) -> RouteSpec {
        let mut o = RouteOptions {
            offload_type: Some(self.offload_type),
            use_stream: Some(self.use_stream),
            ..RouteOptions::default()
        };
        if self.offload_type == OffloadType::BlockLevel {
            o.num_blocks_per_group = Some(self.blocks_per_group);
        }
        if self.use_stream {
            o.record_stream = Some(self.record_stream);
        }
        match self.host {
            HostChoice::Default => {}
            HostChoice::Pinned => o.pinned = Some(true),
            HostChoice::LowCpu => o.low_cpu_mem_usage = Some(true),
            HostChoice::Unpinned => o.pinned = Some(false),
        }
        RouteSpec::new(RouteTarget::Route(RouteId::DIFFUSERS_GROUP_OFFLOAD), o)
            .unwrap_or_else(|e| panic!("{self:?}: {e}"))
    }
}

/// Every configuration of the matrix: leaf/block level, stream or not, record_stream,
/// and each host source.
pub fn all_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for (offload_type, blocks_per_group) in [
        (OffloadType::LeafLevel, 1),
        (OffloadType::BlockLevel, 1),
        (OffloadType::BlockLevel, 2),
    ] {
        for (use_stream, record_stream) in [(false, false), (true, false), (true, true)] {
            if use_stream && blocks_per_group != 1 {
                continue;
            }
            for host in [
                HostChoice::Default,
                HostChoice::Pinned,
                HostChoice::LowCpu,
                HostChoice::Unpinned,
            ] {
                cases.push(Case {
                    offload_type,
                    blocks_per_group,
                    use_stream,
                    record_stream,
                    host,
                });
            }
        }
    }
    cases
}

/// A device whose copies crawl, so a compute that does not wait for its copy reads zeros.
pub fn slow_device(capacity: u64, bytes_per_sec: f64) -> Arc<HostDevice> {
    HostDevice::new(HostDeviceConfig {
        capacity,
        link_bytes_per_sec: Some(bytes_per_sec),
        ..HostDeviceConfig::default()
    })
    .unwrap()
}

/// The output bytes of `inputs` run with every weight resident, leaving the component
/// host-only again.
pub fn resident_outputs(c: &Component, device: &dyn Device, inputs: &[Tensor]) -> Vec<Vec<u8>> {
    let s = device.compute_stream();
    c.to_device(device, &s).unwrap();
    let out = inputs
        .iter()
        .map(|x| {
            c.forward(device, x.clone())
                .unwrap()
                .to_host_bytes(device, &s)
                .unwrap()
        })
        .collect();
    c.to_host().unwrap();
    out
}

/// [`resident_outputs`] on a fresh device without a simulated link (outputs do not depend
/// on the device).
pub fn baseline(c: &Component, inputs: &[Tensor]) -> Vec<Vec<u8>> {
    let device = HostDevice::with_capacity(1 << 24).unwrap();
    resident_outputs(c, &*device, inputs)
}

/// Runs `input` through the component and returns its output bytes.
pub fn run(c: &Component, device: &dyn Device, input: &Tensor) -> Vec<u8> {
    let s = device.compute_stream();
    c.forward(device, input.clone())
        .unwrap()
        .to_host_bytes(device, &s)
        .unwrap()
}

/// What the registry does before every attach ([`checked_preflight`]), then attach.
pub fn checked_attach(
    c: &Arc<Component>,
    device: Arc<dyn Device>,
    spec: &RouteSpec,
    metrics: Arc<RouteMetrics>,
) -> ddo_core::Result<Arc<dyn AttachedRoute>> {
    checked_preflight(&GroupOffloadRoute, c, &*device, spec)?;
    GroupOffloadRoute.attach(c, device, spec, metrics)
}

/// Runs the registry's checks, attaches the route and installs its hooks in the component.
pub fn attach(
    c: &Arc<Component>,
    device: &Arc<HostDevice>,
    spec: &RouteSpec,
) -> (Arc<AttachedGroupOffload>, Arc<RouteMetrics>) {
    let metrics = Arc::new(RouteMetrics::new());
    let dev: Arc<dyn Device> = device.clone();
    checked_preflight(&GroupOffloadRoute, c, &*dev, spec).unwrap();
    let hooks = GroupOffloadRoute
        .attach_group_offload(c, dev, spec, Arc::clone(&metrics))
        .unwrap();
    c.install_hooks(hooks.clone()).unwrap();
    (hooks, metrics)
}

/// Detaches, removes the hooks, and checks that nothing of the component stays on the
/// device or pinned.
pub fn detach_and_check_released(
    c: &Arc<Component>,
    device: &HostDevice,
    hooks: Arc<AttachedGroupOffload>,
    start_allocated: u64,
) {
    use ddo_core::AttachedRoute;
    hooks.detach().unwrap();
    hooks.detach().unwrap(); // idempotent
    let installed: Arc<dyn AttachedRoute> = hooks;
    assert!(c.remove_hooks(&installed));
    let m = device.memory_info();
    assert_eq!(m.allocated, start_allocated, "device memory after detach");
    assert_eq!(m.pinned_host, 0, "pinned memory after detach");
    for p in c.params() {
        assert!(p.device().is_none(), "{} still on the device", p.name());
    }
}

/// Features in and out of every leaf of a reference spec, in program order.
pub fn leaf_widths(spec: &ReferenceSpec) -> Vec<(usize, usize)> {
    let mut features = spec.in_features;
    let mut out = Vec::new();
    let leaves = spec
        .stem
        .iter()
        .chain(spec.blocks.iter().flatten())
        .chain(spec.head.iter());
    for leaf in leaves {
        let next = leaf.out_features.unwrap_or(features);
        out.push((features, next));
        features = next;
    }
    if spec.tie_head_to_stem {
        out.push((features, features));
    }
    out
}

/// Device bytes of activations a reference program holds at once: the input and the
/// output of the widest leaf, in f32.
pub fn activation_allowance(spec: &ReferenceSpec, batch: usize) -> u64 {
    let widest = leaf_widths(spec)
        .into_iter()
        .map(|(i, o)| i + o)
        .max()
        .unwrap_or(spec.in_features);
    (widest * batch * 4) as u64
}

/// Seeded inputs.
pub fn inputs(spec: &ReferenceSpec, batch: usize, n: usize) -> Vec<Tensor> {
    (0..n)
        .map(|i| reference::input(spec, batch, 100 + i as u64).unwrap())
        .collect()
}

/// A program that runs chosen leaves in an order set per call, and returns the sum of each
/// leaf's `weight`. It reads device memory the way a kernel does: behind the compute
/// stream's queued work (its event waits included), with no transfer of its own, so a
/// weight whose copy compute was not ordered behind reads as zeros. It can fail inside a
/// chosen leaf.
pub struct OrderedProgram {
    pub device: Arc<HostDevice>,
    pub order: parking_lot::Mutex<Vec<usize>>,
    pub fail_at: parking_lot::Mutex<Option<usize>>,
    /// Device bytes allocated while each leaf of the last forward ran (behind the compute
    /// stream, so stream-ordered frees queued before the leaf have happened).
    pub allocated_in_leaf: parking_lot::Mutex<Vec<u64>>,
}

impl OrderedProgram {
    fn read_weight(&self, w: &ddo_core::LeafWeights<'_>) -> ddo_core::Result<Vec<f32>> {
        let t = w.get("weight")?;
        let ddo_core::TensorStorage::Device(slice) = t.storage() else {
            return Err(ddo_core::CoreError::Injected(
                "weight is not on the device".into(),
            ));
        };
        self.device
            .host_compute_fence(&self.device.compute_stream())?;
        let range = slice.offset()..slice.offset() + slice.len();
        let bytes = self
            .device
            .allocation(slice.buffer())?
            .with_bytes(|b| b[range].to_vec());
        t.dtype().decode_f32(&bytes)
    }
}

impl ddo_core::ComponentProgram for OrderedProgram {
    fn forward(
        &self,
        ctx: &mut ddo_core::ForwardContext<'_>,
        _input: Tensor,
    ) -> ddo_core::Result<Tensor> {
        let order = self.order.lock().clone();
        let fail_at = *self.fail_at.lock();
        let mut sums = Vec::with_capacity(order.len());
        self.allocated_in_leaf.lock().clear();
        for (k, &leaf) in order.iter().enumerate() {
            let sum = ctx.run_leaf(ddo_core::LeafId(leaf), |w| {
                if fail_at == Some(k) {
                    return Err(ddo_core::CoreError::Injected(format!("leaf call {k}")));
                }
                let sum = self.read_weight(w)?.iter().sum::<f32>();
                let allocated = self.device.memory_info().allocated;
                self.allocated_in_leaf.lock().push(allocated);
                Ok(sum)
            })?;
            sums.push(sum);
        }
        Tensor::from_f32(vec![sums.len()], ddo_core::DType::F32, &sums)
    }
}

/// A component for [`OrderedProgram`]: leaf 0 `embed` at the root (block level: the
/// unmatched group), then `blocks` blocks of one linear leaf each. Leaf `i` has a weight
/// of `16 * (i + 1)` f32 values. The program runs on `device`. Returns the component and
/// its program.
pub fn ordered_component(
    blocks: usize,
    device: &Arc<HostDevice>,
) -> (Arc<Component>, Arc<OrderedProgram>) {
    use ddo_core::{DType, LeafKind, Module, Param, ParamKind};
    let weight = |i: usize| {
        let n = 16 * (i + 1);
        let values: Vec<f32> = (0..n).map(|k| (i + 1) as f32 + k as f32 / 64.0).collect();
        let w = Param::from_f32(
            format!("w{i}"),
            ParamKind::Parameter,
            DType::F32,
            vec![n],
            &values,
        )
        .unwrap();
        vec![("weight".to_string(), w)]
    };
    let root = Module::container(
        "",
        vec![
            Module::leaf("embed", LeafKind::Embedding, weight(0)),
            Module::block_list(
                "blocks",
                (0..blocks)
                    .map(|b| {
                        Module::container(
                            b.to_string(),
                            vec![Module::leaf("lin", LeafKind::Linear, weight(b + 1))],
                        )
                    })
                    .collect(),
            ),
        ],
    );
    let program = Arc::new(OrderedProgram {
        device: Arc::clone(device),
        order: parking_lot::Mutex::new((0..=blocks).collect()),
        fail_at: parking_lot::Mutex::new(None),
        allocated_in_leaf: parking_lot::Mutex::new(Vec::new()),
    });
    let c = Component::new("transformer", "Ordered", root, program.clone()).unwrap();
    (c, program)
}

/// What [`OrderedProgram`] should return for `order`, from the host weights.
pub fn expected_sums(c: &Component, order: &[usize]) -> Vec<f32> {
    order
        .iter()
        .map(|&i| {
            let (_, w) = &c.leaves()[i].params()[0];
            w.host_tensor()
                .unwrap()
                .host_f32()
                .unwrap()
                .iter()
                .sum::<f32>()
        })
        .collect()
}

/// The output of one forward of an [`OrderedProgram`] component, as f32.
pub fn run_sums(c: &Component, device: &dyn Device) -> ddo_core::Result<Vec<f32>> {
    let x = Tensor::from_f32(vec![1], ddo_core::DType::F32, &[0.0])?;
    let s = device.compute_stream();
    let out = c.forward(device, x)?.to_f32_vec(device, &s)?;
    // The output is a host tensor: wait for stream-ordered frees the way a download would.
    device.synchronize_stream(&s)?;
    Ok(out)
}
