//! Registering checkpoint mappings in place on a real GPU (`cuMemHostRegister` with the
//! read-only flag), and the streaming engine's two pinned sources measured against each
//! other: a memory-mapped safetensors file registered read-only copies to the device
//! intact and counts against the pinned ledger until its view drops; a Flux-shaped
//! transformer saved as a Diffusers folder and loaded checkpoint-backed streams under
//! `diffusers_group_offload` leaf level with a stream bit-identically with
//! `pinned_source=home` and `pinned_source=register`, printing for each the attach time,
//! the learning forward (which builds the engine's host side), the host-side setup time,
//! the median streamed step and the pinned bytes. `DDO_BENCH=1` uses DESIGN.md's
//! Flux-shaped transformer (5 double + 10 single blocks at FLUX.1-dev widths, bf16,
//! 4608 tokens) instead of a 1 + 1 block one. Without a GPU each test prints "skipped: no
//! CUDA device" and passes.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use common::{open_gpu, synthetic_flux_inputs};
use ddo_core::device::download;
use ddo_core::host_memory::{REGISTER_ALIGN, register_span};
use ddo_core::{
    Checkpoint, CoreError, DType, Device, HostBuffer, HostMemoryKind, RouteSpec, Tensor,
};
use ddo_cuda::CudaDevice;
use ddo_nn::flux::{FluxTransformer, FluxTransformerConfig};
use ddo_routes::enable_dynamic_offload;

/// A fresh directory under the system temp dir (or `DDO_TMP`), removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let base = std::env::var_os("DDO_TMP")
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let dir = base.join(format!(
            "ddo-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn bench() -> bool {
    std::env::var_os("DDO_BENCH").is_some_and(|v| v == "1")
}

fn output_bytes(d: &CudaDevice, t: &Tensor) -> Vec<u8> {
    let ddo_core::TensorStorage::Device(slice) = t.storage() else {
        panic!("output on the host")
    };
    download(d, slice, &d.compute_stream()).unwrap()
}

/// Writes `bytes` as one U8 tensor `blob` to a safetensors file (the format by hand: an
/// 8-byte header length, the JSON header padded to 8 bytes, the data).
fn write_blob(path: &Path, bytes: &[u8]) {
    let mut header = format!(
        r#"{{"blob":{{"dtype":"U8","shape":[{n}],"data_offsets":[0,{n}]}}}}"#,
        n = bytes.len()
    );
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut file = Vec::with_capacity(8 + header.len() + bytes.len());
    file.extend_from_slice(&(header.len() as u64).to_le_bytes());
    file.extend_from_slice(header.as_bytes());
    file.extend_from_slice(bytes);
    std::fs::write(path, file).unwrap();
}

#[test]
fn handed_back_registrations_stay_pinned_until_the_device_is_idle() {
    // 8 ranges of 4 MiB (every other 4 MiB of a 64 MiB tensor, so their rounded spans
    // never touch), registered, copied from, then handed back with `release_host` while
    // their copies may still run: they stay registered and counted (the driver's
    // unregistering would wait for the queued work) until `unpin_released`, which returns
    // their bytes; then the same ranges register again (a live one would be refused as
    // overlapping) and a registration that needs room unpins what was handed back first.
    if open_gpu(false).is_none() {
        return;
    }
    let mib = 1u64 << 20;
    let d = CudaDevice::with_config(ddo_cuda::CudaDeviceConfig {
        pinned_limit: Some(48 * mib),
        ..ddo_cuda::CudaDeviceConfig::new(0)
    })
    .unwrap();
    let dir = TempDir::new("release-host");
    let path = dir.0.join("blob.safetensors");
    let part = 4usize << 20;
    let len = 16 * part;
    let bytes: Vec<u8> = (0..len).map(|i| (i * 7 % 253) as u8).collect();
    write_blob(&path, &bytes);
    let ckpt = Checkpoint::open(&path).unwrap();
    let buffer = ckpt.host_buffer("blob").unwrap();
    let (map, offset, _) = buffer.mapping().map(|(m, o, l)| (m.clone(), o, l)).unwrap();
    let before = d.memory_info().pinned_host;
    let dst = d.alloc(len).unwrap();
    let copy = d.create_stream().unwrap();
    let parts: Vec<usize> = (0..16).step_by(2).collect();
    let register_all = || -> Vec<HostBuffer> {
        parts
            .iter()
            .map(|&i| {
                let view = HostBuffer::mapped(Arc::clone(&map), offset + i * part, part).unwrap();
                d.register_host(&view).unwrap()
            })
            .collect()
    };
    let views = register_all();
    let registered = d.memory_info().pinned_host - before;
    assert!(registered >= (8 * part) as u64, "{registered}");
    for (&i, v) in parts.iter().zip(&views) {
        d.copy_h2d(&v.slice_all(), &dst.slice(i * part, part).unwrap(), &copy)
            .unwrap();
    }
    for v in views {
        d.release_host(v);
    }
    d.synchronize().unwrap();
    assert_eq!(
        d.memory_info().pinned_host - before,
        registered,
        "handed-back ranges are counted until they are unpinned"
    );
    assert_eq!(d.unpin_released(), registered);
    assert_eq!(d.memory_info().pinned_host, before);
    assert_eq!(d.unpin_released(), 0, "nothing left to unpin");
    let got = download(&*d, &dst.slice_all(), &copy).unwrap();
    for &i in &parts {
        assert!(
            got[i * part..(i + 1) * part] == bytes[i * part..(i + 1) * part],
            "part {i}"
        );
    }
    // Unregistered for real: the same ranges register again; handed back once more, they
    // give way to pinned memory asked for beyond the limit's room.
    let again = register_all();
    for v in again {
        d.release_host(v);
    }
    assert_eq!(
        d.memory_info().pinned_room(),
        48 * mib,
        "handed-back bytes count as room"
    );
    let pinned = d.alloc_pinned(6 * part).unwrap();
    assert_eq!(
        d.unpin_released(),
        0,
        "the allocation did not unpin what was handed back"
    );
    assert_eq!(d.memory_info().pinned_host, before + (6 * part) as u64);
    drop(pinned);
    assert_eq!(d.memory_info().pinned_host, before);
}

#[test]
fn a_mapped_checkpoint_registers_read_only_and_copies_intact() {
    let Some(d) = open_gpu(false) else { return };
    let dir = TempDir::new("register");
    let path = dir.0.join("blob.safetensors");
    let len: usize = if bench() { 1 << 30 } else { 64 << 20 };
    let bytes: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
    write_blob(&path, &bytes);
    let ckpt = Checkpoint::open(&path).unwrap();
    let buffer = ckpt.host_buffer("blob").unwrap();
    let (map, offset, _) = buffer.mapping().map(|(m, o, l)| (m.clone(), o, l)).unwrap();
    let before = d.memory_info().pinned_host;
    let t = Instant::now();
    let view = d.register_host(&buffer).unwrap();
    let register_ms = t.elapsed().as_secs_f64() * 1e3;
    assert_eq!(view.kind(), HostMemoryKind::Pinned);
    let span = register_span(map.len(), offset, len);
    assert_eq!(span.start % REGISTER_ALIGN, 0);
    assert_eq!(
        d.memory_info().pinned_host - before,
        span.len() as u64,
        "the registered span counts against the pinned ledger"
    );
    // The same range again overlaps: refused as unsupported (the engine falls back).
    let err = d.register_host(&buffer).unwrap_err();
    assert!(
        matches!(err, CoreError::HostRegisterUnsupported { .. }),
        "{err}"
    );
    // Copies from the registered view are asynchronous pinned copies; the bytes land intact.
    let dst = d.alloc(len).unwrap();
    let copy = d.create_stream().unwrap();
    let time_copy = |src: &HostBuffer| {
        d.synchronize().unwrap();
        let t = Instant::now();
        d.copy_h2d(&src.slice_all(), &dst.slice_all(), &copy)
            .unwrap();
        d.synchronize_stream(&copy).unwrap();
        t.elapsed().as_secs_f64()
    };
    let registered_s = time_copy(&view);
    assert!(download(&*d, &dst.slice_all(), &copy).unwrap() == bytes);
    // Unregistered with the view's last handle (the copy's hold ended with the sync).
    drop(view);
    d.synchronize().unwrap();
    assert_eq!(d.memory_info().pinned_host, before);
    // For comparison: the same mapping unregistered (pageable), and pinned memory.
    let mapped_s = time_copy(&buffer);
    let pinned = d.alloc_pinned(len).unwrap();
    pinned
        .with_bytes_mut(|b| b.copy_from_slice(&bytes))
        .unwrap();
    let pinned_s = time_copy(&pinned);
    let gbs = |s: f64| len as f64 / s / 1e9;
    println!(
        "{} MiB: registering took {register_ms:.1} ms; host->device from the registered mapping {:.1} GB/s, \
         from the plain mapping {:.1} GB/s, from pinned memory {:.1} GB/s",
        len >> 20,
        gbs(registered_s),
        gbs(mapped_s),
        gbs(pinned_s)
    );
    drop(pinned);
    // Owned memory is not registered in place.
    let err = d
        .register_host(&HostBuffer::pageable_from(&[1, 2, 3]))
        .unwrap_err();
    assert!(
        matches!(err, CoreError::HostRegisterUnsupported { .. }),
        "{err}"
    );
}

/// Saves `model` as a Diffusers folder (`config.json` + `diffusion_pytorch_model.safetensors`).
fn save(model: &FluxTransformer, dir: &Path) {
    let c = model.config();
    let config = serde_json::json!({
        "_class_name": "FluxTransformer2DModel",
        "patch_size": c.patch_size,
        "in_channels": c.in_channels,
        "out_channels": c.out_channels,
        "num_layers": c.num_layers,
        "num_single_layers": c.num_single_layers,
        "attention_head_dim": c.attention_head_dim,
        "num_attention_heads": c.num_attention_heads,
        "joint_attention_dim": c.joint_attention_dim,
        "pooled_projection_dim": c.pooled_projection_dim,
        "guidance_embeds": c.guidance_embeds,
        "axes_dims_rope": c.axes_dims_rope,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    ddo_core::reference::write_checkpoint(
        model.component(),
        &dir.join("diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
}

#[test]
fn flux_streams_bit_identically_from_a_pinned_home_and_from_the_registered_mapping() {
    let Some(d) = open_gpu(false) else { return };
    let (doubles, singles, side, txt) = if bench() {
        (5, 10, 64, 512)
    } else {
        (1, 1, 16, 64)
    };
    let dir = TempDir::new("register-flux");
    {
        let mut cfg = FluxTransformerConfig::flux_dev();
        cfg.num_layers = doubles;
        cfg.num_single_layers = singles;
        let t = Instant::now();
        let model = FluxTransformer::random(cfg, 7, DType::BF16).unwrap();
        save(&model, &dir.0);
        println!(
            "flux {doubles} double + {singles} single blocks: {:.2} GiB of bf16 weights saved in {:.1} s",
            model.component().param_bytes() as f64 / (1u64 << 30) as f64,
            t.elapsed().as_secs_f64()
        );
    }
    let inputs = synthetic_flux_inputs(side, txt);
    // Resident reference, from the same file.
    let expected = {
        let model = FluxTransformer::load(&dir.0, None).unwrap();
        let _h =
            enable_dynamic_offload(model.component(), d.clone(), RouteSpec::resident()).unwrap();
        let out = model.forward(&*d, &inputs).unwrap();
        output_bytes(&d, &out)
    };
    d.synchronize().unwrap();
    d.empty_cache().unwrap();
    // The resident attach handed its upload registrations back: unpinned once idle.
    d.unpin_released();
    let pinned_before = d.memory_info().pinned_host;
    for source in ["home", "register"] {
        // A fresh, checkpoint-backed load per source: the home replaces the params' bytes.
        let model = FluxTransformer::load(&dir.0, None).unwrap();
        assert!(
            model
                .component()
                .params()
                .iter()
                .all(|p| p.is_checkpoint_backed())
        );
        let spec: RouteSpec = ddo_routes::parse_spec(format!(
            "diffusers_group_offload:offload_type=leaf_level,use_stream=true,pinned_source={source}"
        ))
        .unwrap();
        let t = Instant::now();
        let mut h = enable_dynamic_offload(model.component(), d.clone(), spec).unwrap();
        let attach_ms = t.elapsed().as_secs_f64() * 1e3;
        // The learning forward runs leaf by leaf and then builds the engine's host side
        // (the home copy, or the registrations): the attach-time cost of the choice.
        d.synchronize().unwrap();
        let t = Instant::now();
        let out = model.forward(&*d, &inputs).unwrap();
        d.synchronize().unwrap();
        let learn_ms = t.elapsed().as_secs_f64() * 1e3;
        assert!(
            output_bytes(&d, &out) == expected,
            "{source}: learning forward differs"
        );
        drop(out);
        let mut times = Vec::new();
        for step in 0..if bench() { 10 } else { 4 } {
            d.synchronize().unwrap();
            let t = Instant::now();
            let out = model.forward(&*d, &inputs).unwrap();
            d.synchronize().unwrap();
            times.push(t.elapsed().as_secs_f64() * 1e3);
            assert!(
                output_bytes(&d, &out) == expected,
                "{source}: streamed forward {step} differs from resident"
            );
        }
        times.sort_by(f64::total_cmp);
        let c = h.metrics().counters();
        let streamed_forwards = times.len() as u64;
        println!(
            "pinned_source={source}: attach {attach_ms:.1} ms, learning forward {learn_ms:.1} ms \
             (host side set up in {:.1} ms), median step {:.1} ms (min {:.1}, max {:.1}); \
             pinned {:.3} GiB (registered {:.3} GiB in {} ranges), streamed {:.3} GiB per step in {} units, \
             {} h2d copies in {} forwards",
            c.staging_setup_ns as f64 / 1e6,
            times[times.len() / 2],
            times[0],
            times[times.len() - 1],
            c.pinned_host_bytes as f64 / (1u64 << 30) as f64,
            c.registered_host_bytes as f64 / (1u64 << 30) as f64,
            c.host_registrations,
            c.streamed_bytes_per_forward as f64 / (1u64 << 30) as f64,
            c.transfer_units,
            c.h2d_copies,
            streamed_forwards + 1,
        );
        // Less the upload buffers the inputs were staged through (a device cache).
        assert_eq!(
            d.memory_info().pinned_host - d.upload_staging_bytes() - pinned_before,
            c.pinned_host_bytes
        );
        if source == "register" {
            assert!(c.host_registrations >= 1, "{c:?}");
            assert_eq!(c.register_fallbacks, 0, "{c:?}");
            assert_eq!(c.pinned_host_bytes, c.registered_host_bytes);
            assert!(
                model
                    .component()
                    .params()
                    .iter()
                    .all(|p| p.is_checkpoint_backed())
            );
        }
        let _ = h.cleanup_on_error(|_| Err::<(), _>(CoreError::Injected("release".into())));
        d.synchronize().unwrap();
        // The registrations handed back at the release stay pinned until the device is idle.
        d.unpin_released();
        assert_eq!(
            d.memory_info().pinned_host - d.upload_staging_bytes(),
            pinned_before,
            "{source}: pinned memory left after release"
        );
        drop(model);
    }
}
