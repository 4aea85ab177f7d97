//! Systematic fault injection over whole forwards of the real fixture models (the SD VAE
//! decoder and the Flux transformer, loaded from `fixtures/`), for every route
//! configuration: a [`FaultInjectingDevice`] fails the N-th allocation (device, pinned or an
//! op's output), the N-th copy or the N-th event wait, or panics at the N-th op (inside a
//! leaf's forward), for every N from attach to the end of the forward. After each fault:
//! - a failed attach is a typed error and leaves nothing (no bytes, no hooks);
//! - inside `cleanup_on_error` the error comes back typed (`OutOfMemory`, `Injected`, or
//!   `Panicked` for a panic), device bytes return to the starting level (0), pinned host
//!   bytes are freed, no hooks remain, and host weights are unchanged (checksums);
//! - a fault a route absorbs (none do today) must still give the resident output;
//! - the same component then runs correctly (bit-identical) on another route.
//!
//! The number of fault points per route is printed (`--nocapture`) and checked to be more
//! than a handful, so a wrapper that stopped counting would fail the test.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use ddo_core::{
    AllocatorKind, Component, CoreError, DType, Device, FaultAction, FaultCounts,
    FaultInjectingDevice, FaultKind, RouteSpec, Tensor,
};
use ddo_host::{HostDevice, HostDeviceConfig};
use ddo_nn::flux::{FluxInputs, FluxTransformer};
use ddo_nn::read_f32_tensor;
use ddo_nn::vae::AutoencoderKL;
use ddo_routes::{OffloadHandle, enable_dynamic_offload};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

fn host_tensor(dir: &str, file: &str, name: &str) -> Tensor {
    let (shape, values) = read_f32_tensor(&fixture(dir).join(file), name).expect("fixture");
    Tensor::from_f32(shape, DType::F32, &values).expect("tensor")
}

/// One model under test: its component and a forward on a given device.
trait Model {
    fn name(&self) -> &'static str;
    fn component(&self) -> &Arc<Component>;
    fn forward(&self, device: &dyn Device) -> ddo_core::Result<Tensor>;
    /// A native_vmm budget between its largest leaf and its total weights.
    fn budget(&self) -> &'static str;
}

struct Vae {
    model: AutoencoderKL,
    latents: Tensor,
}

impl Model for Vae {
    fn name(&self) -> &'static str {
        "vae_sd"
    }
    fn component(&self) -> &Arc<Component> {
        self.model.component()
    }
    fn forward(&self, device: &dyn Device) -> ddo_core::Result<Tensor> {
        self.model.decode(Some(device), &self.latents, None)
    }
    fn budget(&self) -> &'static str {
        "1MiB"
    }
}

struct Flux {
    model: FluxTransformer,
    inputs: FluxInputs,
}

impl Model for Flux {
    fn name(&self) -> &'static str {
        "flux_transformer"
    }
    fn component(&self) -> &Arc<Component> {
        self.model.component()
    }
    fn forward(&self, device: &dyn Device) -> ddo_core::Result<Tensor> {
        self.model.forward(device, &self.inputs)
    }
    fn budget(&self) -> &'static str {
        "64KiB"
    }
}

fn vae() -> Vae {
    Vae {
        model: AutoencoderKL::load(&fixture("vae_sd"), None).expect("load vae_sd"),
        latents: host_tensor("vae_sd", "inputs.safetensors", "latents"),
    }
}

fn flux() -> Flux {
    let dir = "flux_transformer";
    let file = "inputs.safetensors";
    let vec = |name: &str| read_f32_tensor(&fixture(dir).join(file), name).unwrap().1;
    let ids =
        |name: &str| -> Vec<[f32; 3]> { vec(name).chunks(3).map(|c| [c[0], c[1], c[2]]).collect() };
    Flux {
        model: FluxTransformer::load(&fixture(dir), None).expect("load flux_transformer"),
        inputs: FluxInputs {
            hidden_states: host_tensor(dir, file, "hidden_states"),
            encoder_hidden_states: host_tensor(dir, file, "encoder_hidden_states"),
            pooled_projections: host_tensor(dir, file, "pooled_projections"),
            timestep: vec("timestep"),
            guidance: Some(vec("guidance")),
            img_ids: ids("img_ids"),
            txt_ids: ids("txt_ids"),
        },
    }
}

/// Every route configuration the issue names: (label, spec, needs the native allocator).
fn routes(budget: &str) -> Vec<(String, RouteSpec, bool)> {
    let parse =
        |s: &str| -> RouteSpec { ddo_routes::parse_spec(s).unwrap_or_else(|e| panic!("{s}: {e}")) };
    let g = "diffusers_group_offload";
    vec![
        ("none".into(), RouteSpec::resident(), false),
        // Before any route that gives the params a pinned home (whose teardown leaves
        // owned copies): registering needs params that still point into the checkpoint.
        (
            "leaf+stream+pinned_source=register".into(),
            parse(&format!("{g}:use_stream=true,pinned_source=register")),
            false,
        ),
        (
            format!("native_vmm:budget={budget},pinned_source=register"),
            parse(&format!(
                "native_vmm:budget={budget},unit_bytes=16KiB,pinned_source=register"
            )),
            true,
        ),
        ("leaf".into(), RouteSpec::leaf_group(false, false), false),
        (
            "leaf+stream".into(),
            RouteSpec::leaf_group(true, false),
            false,
        ),
        (
            "leaf+stream+record_stream".into(),
            parse(&format!("{g}:use_stream=true,record_stream=true")),
            false,
        ),
        (
            "leaf+stream+low_cpu_mem_usage".into(),
            RouteSpec::leaf_group(true, true),
            false,
        ),
        (
            "leaf+stream+pinned=false".into(),
            parse(&format!("{g}:use_stream=true,pinned=false")),
            false,
        ),
        (
            "block".into(),
            parse(&format!(
                "{g}:offload_type=block_level,num_blocks_per_group=1"
            )),
            false,
        ),
        (
            "block+stream".into(),
            parse(&format!(
                "{g}:offload_type=block_level,num_blocks_per_group=1,use_stream=true"
            )),
            false,
        ),
        (
            "linear_convolution".into(),
            parse("linear_convolution"),
            false,
        ),
        (
            "linear_convolution+pinned=false".into(),
            parse("linear_convolution:pinned=false"),
            false,
        ),
        (
            format!("native_vmm:budget={budget}"),
            parse(&format!("native_vmm:budget={budget}")),
            true,
        ),
    ]
}

fn inner(native: bool) -> Arc<HostDevice> {
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

fn checksums(c: &Component) -> Vec<u64> {
    c.params().iter().map(|p| p.host_checksum()).collect()
}

fn bytes(d: &dyn Device, t: &Tensor) -> Vec<u8> {
    t.to_host_bytes(d, &d.compute_stream()).expect("download")
}

/// Output of `model` under `spec` on a fresh device, the route removed afterwards.
fn run_clean(model: &dyn Model, spec: RouteSpec, native: bool) -> Vec<u8> {
    let d = inner(native);
    let h = enable_dynamic_offload(model.component(), d.clone(), spec).expect("attach");
    let out = bytes(&*d, &model.forward(&*d).expect("forward"));
    release(h);
    assert!(
        model.component().attached().is_none(),
        "{}: hooks left after the handle and forward ended",
        model.name()
    );
    out
}

/// The fault points an attach plus one forward passes under `spec`.
fn count_points(model: &dyn Model, spec: RouteSpec, native: bool) -> FaultCounts {
    let d = inner(native);
    let f = FaultInjectingDevice::new(d.clone());
    let h = enable_dynamic_offload(model.component(), f.clone(), spec).expect("attach");
    forwards_and_phase(model, &h).expect("clean run");
    release(h);
    f.counts()
}

/// What each fault run does after attaching: two forwards (the second runs on what the
/// route learned from the first: prefetch schedules) and a phase boundary; the output of
/// the second forward, as bytes.
fn forwards_and_phase(model: &dyn Model, h: &OffloadHandle) -> ddo_core::Result<Vec<u8>> {
    let d = &**h.device();
    let s = d.compute_stream();
    let first = model.forward(d)?.to_host_bytes(d, &s)?;
    let second = model.forward(d)?.to_host_bytes(d, &s)?;
    assert_eq!(first, second, "{}: two forwards differ", model.name());
    h.end_phase("fault sweep")?;
    Ok(second)
}

/// Releases whatever route `h` holds through DDO's managed boundary (group offload hooks are
/// not removable otherwise while the component lives).
fn release(mut h: OffloadHandle) {
    let released: ddo_core::Result<()> =
        h.cleanup_on_error(|_| Err(CoreError::Injected("release".into())));
    assert!(released.is_err() && h.is_detached());
}

fn assert_nothing_left(d: &HostDevice, c: &Component, sums: &[u64], what: &str) {
    d.synchronize().expect("synchronize");
    let m = d.memory_info();
    assert_eq!(m.allocated, 0, "{what}: device bytes left");
    // Registered ranges handed back stay pinned for reuse until the device unpins them
    // (`Device::release_host`, the CUDA device's rule): nothing else may stay pinned.
    assert_eq!(
        m.pinned_host, m.pinned_cached,
        "{what}: pinned host bytes left"
    );
    d.unpin_released();
    assert_eq!(
        d.memory_info().pinned_host,
        0,
        "{what}: kept pinned bytes not let go"
    );
    assert!(c.attached().is_none(), "{what}: hooks left");
    assert!(
        c.params().iter().all(|p| p.device().is_none()),
        "{what}: a param still points at device memory"
    );
    assert_eq!(checksums(c), sums, "{what}: host weights changed");
}

fn expected_error(err: &CoreError, action: FaultAction, kind: FaultKind) -> bool {
    match (action, kind, err) {
        (FaultAction::Panic, _, CoreError::Panicked { message, .. }) => {
            message.starts_with("injected panic")
        }
        (FaultAction::Error, FaultKind::Alloc, CoreError::OutOfMemory { device, .. }) => {
            device.ends_with("(injected)")
        }
        (FaultAction::Error, _, CoreError::Injected(_)) => true,
        _ => false,
    }
}

/// Runs one armed fault: attach and a forward inside `cleanup_on_error`; checks the
/// outcome. Returns whether the fault fired.
fn one_fault(
    model: &dyn Model,
    spec: RouteSpec,
    native: bool,
    (kind, at, action): (FaultKind, u64, FaultAction),
    expected: &[u8],
    what: &str,
    recover: bool,
) -> bool {
    let c = model.component();
    let sums = checksums(c);
    let d = inner(native);
    let f = FaultInjectingDevice::failing(d.clone(), kind, at, action);
    let attached = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        enable_dynamic_offload(c, f.clone(), spec)
    }));
    let mut handle: OffloadHandle = match attached {
        Ok(Ok(h)) => h,
        Ok(Err(e)) => {
            assert!(
                expected_error(&e, action, kind),
                "{what}: attach failed with an unexpected error: {e:?}"
            );
            assert_eq!(f.fired(), 1, "{what}: attach failed without the fault: {e}");
            assert_nothing_left(&d, c, &sums, &format!("{what} (failed attach)"));
            return true;
        }
        Err(_) => {
            // A panic during attach (only with FaultAction::Panic at an attach-time point).
            assert_eq!(action, FaultAction::Panic, "{what}: attach panicked");
            assert_nothing_left(&d, c, &sums, &format!("{what} (panicked attach)"));
            return true;
        }
    };
    let result = handle.cleanup_on_error(|h| forwards_and_phase(model, h));
    let fired = f.fired() == 1;
    match result {
        Ok(out) => {
            assert_eq!(
                out, expected,
                "{what}: output differs after an absorbed fault"
            );
            drop(handle);
            assert_nothing_left(&d, c, &sums, &format!("{what} (removed after success)"));
        }
        Err(e) => {
            assert!(
                fired,
                "{what}: forward failed without the fault firing: {e}"
            );
            assert!(
                expected_error(&e, action, kind),
                "{what}: error is not the injected fault, typed: {e:?}"
            );
            assert!(handle.is_detached(), "{what}: handle not detached");
            assert_nothing_left(&d, c, &sums, what);
            drop(handle);
        }
    }
    if !recover {
        return fired;
    }
    // The same component runs correctly on another route.
    let other = if spec.target() == RouteSpec::resident().target() {
        RouteSpec::leaf_group(false, false)
    } else {
        RouteSpec::resident()
    };
    assert_eq!(
        run_clean(model, other, false),
        expected,
        "{what}: wrong output on {} afterwards",
        other.describe()
    );
    fired
}

/// Keeps injected panics quiet (thousands of them); other panics print as usual.
fn quiet_injected_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let injected = info
                .payload()
                .downcast_ref::<String>()
                .is_some_and(|m| m.starts_with("injected panic"));
            if !injected {
                default(info);
            }
        }));
    });
}

/// Sweeps every fault point of `model` on every route; returns (route, points) per route.
fn sweep(model: &dyn Model) -> Vec<(String, u64)> {
    quiet_injected_panics();
    let expected = run_clean(model, RouteSpec::resident(), false);
    let mut report = Vec::new();
    for (label, spec, native) in routes(model.budget()) {
        let start = Instant::now();
        assert_eq!(
            run_clean(model, spec, native),
            expected,
            "{label}: clean run differs from resident"
        );
        let mut counts = count_points(model, spec, native);
        // A route whose pinned home replaced checkpoint-mapped weights leaves them owned (one
        // host copy); a resident attach registers only mapped weights, so the points are
        // counted again when a recovery run changed that.
        let backed = || {
            model
                .component()
                .params()
                .iter()
                .filter(|p| p.is_checkpoint_backed())
                .count()
        };
        let mut counted_backed = backed();
        let mut exercised = 0;
        let plans = FaultKind::ALL
            .iter()
            .filter(|k| **k != FaultKind::Op)
            .map(|k| (*k, FaultAction::Error))
            .chain([(FaultKind::Op, FaultAction::Panic)]);
        for (kind, action) in plans {
            let mut at = 0;
            while at < counts.get(kind) {
                at += 1;
                let what = format!("{} on {label}: {kind} #{at} ({action:?})", model.name());
                // Recovery on another route is checked after every 8th fault and the last one
                // of each kind (it costs a forward; the state it checks is asserted always).
                let recover = at % 8 == 1 || at == counts.get(kind);
                let fired = one_fault(
                    model,
                    spec,
                    native,
                    (kind, at, action),
                    &expected,
                    &what,
                    recover,
                );
                assert!(fired, "{what}: the fault point was not reached again");
                exercised += 1;
                if backed() != counted_backed {
                    counts = count_points(model, spec, native);
                    counted_backed = backed();
                }
            }
        }
        // The same component runs correctly on another route afterwards.
        let other = if native {
            RouteSpec::leaf_group(true, false)
        } else {
            ddo_routes::parse_spec("linear_convolution").unwrap()
        };
        let other_native = false;
        assert_eq!(
            run_clean(model, other, other_native),
            expected,
            "{label}: wrong output on another route after the sweep"
        );
        println!(
            "{}: {label}: {exercised} fault points ({} allocs, {} copies, {} event waits, {} op panics) in {:.1} s",
            model.name(),
            counts.allocs,
            counts.copies,
            counts.event_waits,
            counts.ops,
            start.elapsed().as_secs_f64()
        );
        assert!(counts.allocs > 10 && counts.ops > 10, "{label}: {counts:?}");
        report.push((label, exercised));
    }
    report
}

#[test]
fn every_fault_point_of_a_vae_decode_is_cleaned_up_on_every_route() {
    let report = sweep(&vae());
    let total: u64 = report.iter().map(|(_, n)| n).sum();
    println!("vae_sd: {total} fault points over {} routes", report.len());
}

#[test]
fn every_fault_point_of_a_flux_transformer_forward_is_cleaned_up_on_every_route() {
    let report = sweep(&flux());
    let total: u64 = report.iter().map(|(_, n)| n).sum();
    println!(
        "flux_transformer: {total} fault points over {} routes",
        report.len()
    );
}
