//! Two components offloaded on one device, used from two threads at once: the fixture VAE
//! and the fixture Flux transformer, each under a route with its own copy stream (and
//! other route pairs), on one host device whose simulated link makes copies slow enough to
//! overlap compute. Every concurrent output must equal the sequential run's, bit for bit,
//! over many rounds with varied timing (a stress test of interleavings: a seeded jitter
//! before each forward shifts where the two threads' copies, waits and compute interleave).
//!
//! Which handles cross threads, and why (checked at compile time below):
//! - `HostDevice` / `Arc<dyn Device>`: `Send + Sync` — the trait requires it; streams are
//!   worker threads, the ledgers are atomics and locks, so any thread may queue work.
//! - `Component` (`Arc<Component>`): `Send + Sync` — params' residency sits behind locks and
//!   one forward at a time runs per component (its forward lock); two components run in
//!   parallel.
//! - `OffloadHandle`: `Send + Sync` — it holds `Arc`s of the above and the route's hooks,
//!   which are `Send + Sync` (`AttachedRoute` requires it); `cleanup_on_error` takes
//!   `&mut self`, so the managed boundary has one owner at a time.
//! - `Tensor`: `Send + Sync` — shared handles to immutable-after-write buffers.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use ddo_core::{Component, DType, Device, RouteSpec, Tensor};
use ddo_host::{HostDevice, HostDeviceConfig};
use ddo_nn::flux::{FluxInputs, FluxTransformer};
use ddo_nn::read_f32_tensor;
use ddo_nn::vae::AutoencoderKL;
use ddo_routes::{OffloadHandle, enable_dynamic_offload};

const fn assert_send_sync<T: Send + Sync + ?Sized>() {}
const _: () = {
    assert_send_sync::<HostDevice>();
    assert_send_sync::<dyn Device>();
    assert_send_sync::<Component>();
    assert_send_sync::<OffloadHandle>();
    assert_send_sync::<Tensor>();
};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

fn host_tensor(dir: &str, name: &str) -> Tensor {
    let (shape, values) =
        read_f32_tensor(&fixture(dir).join("inputs.safetensors"), name).expect("fixture");
    Tensor::from_f32(shape, DType::F32, &values).expect("tensor")
}

fn flux_inputs() -> FluxInputs {
    let dir = "flux_transformer";
    let v = |name: &str| {
        read_f32_tensor(&fixture(dir).join("inputs.safetensors"), name)
            .unwrap()
            .1
    };
    let ids = |name: &str| v(name).chunks(3).map(|c| [c[0], c[1], c[2]]).collect();
    FluxInputs {
        hidden_states: host_tensor(dir, "hidden_states"),
        encoder_hidden_states: host_tensor(dir, "encoder_hidden_states"),
        pooled_projections: host_tensor(dir, "pooled_projections"),
        timestep: v("timestep"),
        guidance: Some(v("guidance")),
        img_ids: ids("img_ids"),
        txt_ids: ids("txt_ids"),
    }
}

fn device() -> Arc<HostDevice> {
    HostDevice::new(HostDeviceConfig {
        capacity: 1 << 30,
        // ~1 ms per 64 KiB: copies take long enough to overlap the other thread's compute.
        link_bytes_per_sec: Some(64e6),
        ..HostDeviceConfig::default()
    })
    .expect("host device")
}

fn bytes(d: &dyn Device, t: &Tensor) -> Vec<u8> {
    t.to_host_bytes(d, &d.compute_stream()).expect("download")
}

fn spec(s: &str) -> RouteSpec {
    ddo_routes::parse_spec(s).unwrap_or_else(|e| panic!("{s}: {e}"))
}

/// A seeded jitter of 0..400 µs.
fn jitter(state: &mut u64) -> Duration {
    *state = state
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    Duration::from_micros((*state >> 33) % 400)
}

#[test]
fn two_components_on_two_streams_from_two_threads_match_the_sequential_run() {
    let vae = AutoencoderKL::load(&fixture("vae_sd"), None).expect("vae");
    let flux = FluxTransformer::load(&fixture("flux_transformer"), None).expect("flux");
    let latents = host_tensor("vae_sd", "latents");
    let inputs = flux_inputs();
    let pairs = [
        (
            "diffusers_group_offload:use_stream=true",
            "diffusers_group_offload:offload_type=block_level,num_blocks_per_group=1,use_stream=true",
        ),
        (
            "diffusers_group_offload:use_stream=true,record_stream=true",
            "diffusers_group_offload:use_stream=true,low_cpu_mem_usage=true",
        ),
        (
            "linear_convolution",
            "diffusers_group_offload:use_stream=true",
        ),
        ("none", "linear_convolution"),
    ];
    let rounds = 6;
    for (vae_route, flux_route) in pairs {
        let d = device();
        let dyn_d: Arc<dyn Device> = d.clone();
        // The sequential run.
        let hv = enable_dynamic_offload(vae.component(), dyn_d.clone(), spec(vae_route))
            .expect("attach vae");
        let hf = enable_dynamic_offload(flux.component(), dyn_d.clone(), spec(flux_route))
            .expect("attach flux");
        let want_vae = bytes(&*d, &vae.decode(Some(&*d), &latents, None).unwrap());
        let want_flux = bytes(&*d, &flux.forward(&*d, &inputs).unwrap());
        // Both threads at once, many rounds, each forward after a seeded jitter.
        let barrier = Barrier::new(2);
        std::thread::scope(|s| {
            let vae_thread = s.spawn(|| {
                let mut seed = 1;
                for round in 0..rounds {
                    barrier.wait();
                    std::thread::sleep(jitter(&mut seed));
                    let out = vae.decode(Some(hv.device().as_ref()), &latents, None);
                    let got = bytes(&*d, &out.expect("vae decode"));
                    assert!(got == want_vae, "{vae_route}: vae round {round} differs");
                }
            });
            let flux_thread = s.spawn(|| {
                let mut seed = 2;
                for round in 0..rounds {
                    barrier.wait();
                    std::thread::sleep(jitter(&mut seed));
                    let out = flux.forward(hf.device().as_ref(), &inputs);
                    let got = bytes(&*d, &out.expect("flux forward"));
                    assert!(got == want_flux, "{flux_route}: flux round {round} differs");
                }
            });
            vae_thread.join().expect("vae thread");
            flux_thread.join().expect("flux thread");
        });
        assert_eq!(hv.metrics().counters().forwards, 1 + rounds);
        assert_eq!(hf.metrics().counters().forwards, 1 + rounds);
        // Release both (group offload hooks through the managed boundary).
        for mut h in [hv, hf] {
            let _ = h.cleanup_on_error(|_| -> ddo_core::Result<()> {
                Err(ddo_core::CoreError::Injected("release".into()))
            });
        }
        d.synchronize().unwrap();
        assert_eq!(d.memory_info().allocated, 0, "{vae_route} + {flux_route}");
        // What release_host kept pinned for reuse goes when the device unpins it.
        let m = d.memory_info();
        assert_eq!(m.pinned_host, m.pinned_cached, "{vae_route} + {flux_route}");
        d.unpin_released();
        assert_eq!(d.memory_info().pinned_host, 0, "{vae_route} + {flux_route}");
    }
}

#[test]
fn handles_move_to_other_threads() {
    let flux = FluxTransformer::load(&fixture("flux_transformer"), None).expect("flux");
    let inputs = flux_inputs();
    let d = device();
    let h = enable_dynamic_offload(flux.component(), d.clone(), RouteSpec::resident()).unwrap();
    let want = bytes(&*d, &flux.forward(&*d, &inputs).unwrap());
    // The handle moves to another thread, runs there, and comes back.
    let (h, got) = std::thread::spawn(move || {
        let out = flux.forward(h.device().as_ref(), &inputs).unwrap();
        let got = out.to_host_bytes(h.device().as_ref(), &h.device().compute_stream());
        (h, got.unwrap())
    })
    .join()
    .unwrap();
    assert_eq!(got, want);
    drop(h);
    assert_eq!(d.memory_info().allocated, 0);
}
