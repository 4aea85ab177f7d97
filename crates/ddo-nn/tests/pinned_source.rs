//! `pinned_source=register` on a real Diffusers checkpoint: the Flux transformer fixture
//! (`fixtures/flux_transformer`, loaded checkpoint-backed through `CheckpointWeights`)
//! streamed by `diffusers_group_offload` (leaf and block level, with a stream) and
//! `native_vmm` from its registered mapping is bit-identical to resident execution over
//! several forwards, registers at most the file, keeps every param pointing into it, and
//! holds no pinned memory after release; with the mapping registered, copies coalesce
//! over tensors adjacent in the file (fewer copies than streamed tensors).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ddo_core::{AllocatorKind, CoreError, DType, Device, RouteSpec, Tensor};
use ddo_host::{HostDevice, HostDeviceConfig};
use ddo_nn::flux::{FluxInputs, FluxTransformer};
use ddo_nn::read_f32_tensor;
use ddo_routes::enable_dynamic_offload;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/flux_transformer")
}

fn host_tensor(name: &str) -> Tensor {
    let (shape, values) =
        read_f32_tensor(&fixture_dir().join("inputs.safetensors"), name).expect("input");
    Tensor::from_f32(shape, DType::F32, &values).expect("host tensor")
}

fn ids(name: &str) -> Vec<[f32; 3]> {
    let (_, v) = read_f32_tensor(&fixture_dir().join("inputs.safetensors"), name).unwrap();
    v.chunks(3).map(|c| [c[0], c[1], c[2]]).collect()
}

fn inputs() -> FluxInputs {
    let scalar = |name: &str| {
        read_f32_tensor(&fixture_dir().join("inputs.safetensors"), name)
            .unwrap()
            .1
    };
    FluxInputs {
        hidden_states: host_tensor("hidden_states"),
        encoder_hidden_states: host_tensor("encoder_hidden_states"),
        pooled_projections: host_tensor("pooled_projections"),
        timestep: scalar("timestep"),
        guidance: Some(scalar("guidance")),
        img_ids: ids("img_ids"),
        txt_ids: ids("txt_ids"),
    }
}

fn device(native: bool) -> Arc<HostDevice> {
    HostDevice::new(HostDeviceConfig {
        capacity: 1 << 30,
        allocator: if native {
            AllocatorKind::NativeVmm
        } else {
            AllocatorKind::Caching
        },
        ..HostDeviceConfig::default()
    })
    .unwrap()
}

fn bytes(d: &dyn Device, t: &Tensor) -> Vec<u8> {
    t.to_host_bytes(d, &d.compute_stream()).unwrap()
}

fn resident() -> Vec<u8> {
    let model = FluxTransformer::load(&fixture_dir(), None).unwrap();
    let d = device(false);
    model
        .component()
        .to_device(&*d, &d.compute_stream())
        .unwrap();
    let out = model.forward(&*d, &inputs()).unwrap();
    bytes(&*d, &out)
}

#[test]
fn flux_fixture_streams_from_its_registered_mapping_bit_identically() {
    let expected = resident();
    let file_len = std::fs::metadata(fixture_dir().join("diffusion_pytorch_model.safetensors"))
        .unwrap()
        .len();
    let routes = [
        "diffusers_group_offload:offload_type=leaf_level,use_stream=true",
        "diffusers_group_offload:offload_type=block_level,num_blocks_per_group=1,use_stream=true",
        "native_vmm:budget=96KiB,unit_bytes=8KiB",
    ];
    for route in routes {
        let mut per_source = Vec::new();
        for source in ["home", "register"] {
            let spec: RouteSpec =
                ddo_routes::parse_spec(format!("{route},pinned_source={source}")).unwrap();
            let native = route.starts_with("native_vmm:");
            // A fresh load per run: the home replaces the params' host bytes.
            let model = FluxTransformer::load(&fixture_dir(), None).unwrap();
            let total_params = model.component().params().len() as u64;
            assert!(
                model
                    .component()
                    .params()
                    .iter()
                    .all(|p| p.is_checkpoint_backed())
            );
            let d = device(native);
            let dyn_d: Arc<dyn Device> = d.clone();
            let mut h = enable_dynamic_offload(model.component(), dyn_d, spec).unwrap();
            let input = inputs();
            for pass in 0..3 {
                let out = model.forward(&*d, &input).unwrap();
                assert!(
                    bytes(&*d, &out) == expected,
                    "{route} {source}: forward {pass} differs from resident execution"
                );
            }
            let c = h.metrics().counters();
            assert!(c.transfer_units > 0, "{route} {source}: {c:?}");
            assert_eq!(d.memory_info().pinned_host, c.pinned_host_bytes);
            if source == "register" {
                assert!(c.host_registrations >= 1, "{route}: {c:?}");
                assert_eq!(c.register_fallbacks, 0);
                // All params are mapped: the registration is all that is pinned, and it
                // is at most the file (rounded to whole blocks).
                assert_eq!(c.pinned_host_bytes, c.registered_host_bytes);
                assert!(c.registered_host_bytes <= file_len, "{route}: {c:?}");
                assert!(
                    model
                        .component()
                        .params()
                        .iter()
                        .all(|p| p.is_checkpoint_backed()),
                    "{route}: a param left its mapping"
                );
            }
            println!(
                "{route} pinned_source={source}: pinned {} B (registered {} B in {} ranges), \
                 {} B in {} h2d copies over 3 forwards, set up in {:.3} ms; {} params",
                c.pinned_host_bytes,
                c.registered_host_bytes,
                c.host_registrations,
                c.h2d_bytes,
                c.h2d_copies,
                c.staging_setup_ns as f64 / 1e6,
                total_params,
            );
            per_source.push(c);
            let _ = h.cleanup_on_error(|_| Err::<(), _>(CoreError::Injected("release".into())));
            // The registrations handed back stay pinned for reuse until the device unpins
            // them (`Device::release_host`).
            let m = d.memory_info();
            assert_eq!(m.pinned_host, m.pinned_cached, "{route} {source}");
            d.unpin_released();
            let m = d.memory_info();
            assert_eq!((m.allocated, m.pinned_host), (0, 0), "{route} {source}");
        }
        // The registered mapping streams the same bytes per forward, up to the unit
        // padding the runs skip.
        let (home, register) = (&per_source[0], &per_source[1]);
        assert!(register.h2d_bytes <= home.h2d_bytes, "{route}");
    }
}

#[test]
fn tensors_adjacent_in_the_file_coalesce_into_fewer_copies() {
    // Leaf level with 1 MiB units: the whole fixture streams in few units; registered,
    // each unit is copied in runs of tensors adjacent in the file.
    let model = FluxTransformer::load(&fixture_dir(), None).unwrap();
    let streamed = model.component().params().len() as u64;
    let d = device(false);
    let dyn_d: Arc<dyn Device> = d.clone();
    let spec: RouteSpec =
        ddo_routes::parse_spec("diffusers_group_offload:offload_type=leaf_level,use_stream=true,unit_bytes=1MiB,pinned_source=register")
            .unwrap();
    let h = enable_dynamic_offload(model.component(), dyn_d, spec).unwrap();
    let input = inputs();
    model.forward(&*d, &input).unwrap();
    let learned = h.metrics().counters();
    model.forward(&*d, &input).unwrap();
    let c = h.metrics().counters();
    let copies = c.h2d_copies - learned.h2d_copies;
    println!(
        "{streamed} params streamed in {} units with {copies} copies per forward",
        c.transfer_units
    );
    assert!(c.host_registrations >= 1);
    assert!(copies >= c.transfer_units);
    assert!(
        copies < streamed,
        "{copies} copies for {streamed} params: nothing coalesced"
    );
}
