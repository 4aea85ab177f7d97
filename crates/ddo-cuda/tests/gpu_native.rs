//! The native VMM allocator on a real GPU: install (and its refusal after a caching
//! allocation), a Flux-shaped transformer under `native_vmm` equal to resident, the idle
//! cache released at a phase boundary with the driver's free figure rising by the reported
//! amount, the refusal while work is in flight, and (with `DDO_BENCH=1`) the benchmark of
//! mapped-over-live peaks against the caching allocator on the same workload. Without a
//! GPU each test prints "skipped: no CUDA device" and passes.

mod common;

use std::sync::Arc;
use std::time::Instant;

use common::{open_gpu, rnd, synthetic_flux_inputs};
use ddo_core::device::{download, upload};
use ddo_core::{CoreError, DType, Device, RouteSpec, Tensor};
use ddo_cuda::{CudaDevice, CudaError};
use ddo_metrics::NativePoolFigures;
use ddo_nn::RandomWeights;
use ddo_nn::flux::{FluxTransformer, FluxTransformerConfig};
use ddo_nn::vae::{AutoencoderKL, AutoencoderKLConfig};
use ddo_routes::{enable_dynamic_offload, release_native_vmm_idle_cache, remove_dynamic_offload};

fn output_bytes(d: &CudaDevice, t: &Tensor) -> Vec<u8> {
    let ddo_core::TensorStorage::Device(slice) = t.storage() else {
        panic!("output on the host")
    };
    download(d, slice, &d.compute_stream()).unwrap()
}

#[test]
fn install_serves_allocations_from_the_pool() {
    let Some(d) = open_gpu(true) else { return };
    assert_eq!(d.allocator(), ddo_core::AllocatorKind::NativeVmm);
    let bytes: Vec<u8> = (0..(3 << 20)).map(|i| (i % 251) as u8).collect();
    let buf = upload(&*d, &bytes, &d.compute_stream()).unwrap();
    let back = download(&*d, &buf.slice_all(), &d.compute_stream()).unwrap();
    assert_eq!(back, bytes);
    let f = d.native_pool_figures().expect("pool figures");
    assert_eq!(f.live_bytes, 3 << 20);
    assert!(
        f.mapped_bytes >= 3 << 20 && f.mapped_bytes < (3 << 20) + (4 << 20),
        "{f:?}"
    );
    assert_eq!(d.memory_info().allocated, 3 << 20);
    // The caching allocator served nothing.
    assert_eq!(d.allocator_stats().allocated, 0);
    let again = d.install_native_vmm().unwrap_err();
    assert!(
        matches!(again, CudaError::NativeAlreadyInstalled { .. }),
        "{again}"
    );
}

#[test]
fn install_is_refused_after_a_caching_allocation() {
    let Some(d) = open_gpu(false) else { return };
    let buf = d.alloc(1).unwrap();
    let err = d.install_native_vmm().unwrap_err();
    println!("refusal: {err}");
    assert!(
        matches!(err, CudaError::NativeInstallTooLate { allocations: 1, .. }),
        "{err}"
    );
    // Still the caching allocator, still working.
    assert_eq!(d.allocator(), ddo_core::AllocatorKind::Caching);
    drop(buf);
    let _more = d.alloc(1 << 20).unwrap();
    let err = release_native_vmm_idle_cache(&*d).unwrap_err();
    assert!(
        matches!(err, CoreError::NativeAllocatorNotInstalled { .. }),
        "{err}"
    );
}

/// Issue 17 point 5: the native allocator is installed once per process per ordinal,
/// whatever the number of `CudaDevice` values. While one device's pool serves `cuda:0`, a
/// second device of it neither installs a second pool, nor opens, nor — opened before the
/// install — allocates from its caching allocator beside the pool; once every device is gone
/// the ordinal is fresh again.
#[test]
fn a_second_device_of_the_ordinal_installs_no_second_allocator() {
    let Some(first) = open_gpu(false) else { return };
    // Opened before the install, nothing allocated yet.
    let early = CudaDevice::new(0).unwrap();
    first.install_native_vmm().unwrap();
    assert_eq!(first.allocator(), ddo_core::AllocatorKind::NativeVmm);
    let again = early.install_native_vmm().unwrap_err();
    println!("second install: {again}");
    assert!(
        matches!(again, CudaError::NativeInstalledOnAnotherDevice { .. }),
        "{again}"
    );
    let beside = early.alloc(1 << 20).unwrap_err();
    println!("caching allocation beside the pool: {beside}");
    assert!(beside.to_string().contains("share that device"), "{beside}");
    assert_eq!(early.allocator_stats().allocated, 0);
    for native_vmm in [false, true] {
        let config = ddo_cuda::CudaDeviceConfig {
            native_vmm,
            ..ddo_cuda::CudaDeviceConfig::new(0)
        };
        let err = CudaDevice::with_config(config).unwrap_err();
        assert!(
            matches!(err, CudaError::NativeInstalledOnAnotherDevice { .. }),
            "native_vmm {native_vmm}: {err}"
        );
    }
    // The one pool serves the device that installed it.
    let buf = first.alloc(3 << 20).unwrap();
    assert_eq!(first.native_pool_figures().unwrap().live_bytes, 3 << 20);
    drop(buf);
    // A GEMM: the device's cuBLAS workspace (from its pool) outlives it in the process
    // table, which must not keep the ordinal taken once the device is gone.
    let a = ddo_core::Ops::tensor_from_f32(&*first, &[8, 8], DType::F32, &rnd(64, 2)).unwrap();
    drop(ddo_core::Ops::matmul(&*first, &a, &a).unwrap());
    drop(a);
    first.synchronize().unwrap();
    drop((first, early));
    let fresh = open_gpu(true).expect("the ordinal is fresh once every device is gone");
    assert_eq!(fresh.allocator(), ddo_core::AllocatorKind::NativeVmm);
}

/// Issue 17 point 5: an install after another device of the ordinal allocated is refused
/// with the typed error that says what to do, counting that device's allocations; the
/// refused device keeps the caching allocator, and once the device that allocated is gone
/// (its cuBLAS workspace included) the install goes through.
#[test]
fn install_is_refused_after_another_device_of_the_ordinal_allocated() {
    let Some(first) = open_gpu(false) else { return };
    let held = first.alloc(1 << 20).unwrap();
    // A GEMM: the device's cuBLAS handle and workspace outlive it in the process table.
    let a = ddo_core::Ops::tensor_from_f32(&*first, &[8, 8], DType::F32, &rnd(64, 1)).unwrap();
    drop(ddo_core::Ops::matmul(&*first, &a, &a).unwrap());
    drop(a);
    first.synchronize().unwrap();
    let second = CudaDevice::new(0).unwrap();
    let err = second.install_native_vmm().unwrap_err();
    println!("refusal: {err}");
    assert!(
        matches!(err, CudaError::NativeInstallTooLate { allocations, .. } if allocations >= 2),
        "{err}"
    );
    assert!(
        err.to_string().contains("CudaDeviceConfig::native_vmm"),
        "{err}"
    );
    assert_eq!(second.allocator(), ddo_core::AllocatorKind::Caching);
    drop(held);
    drop((first, second));
    let fresh = open_gpu(true).expect("installed once the allocating device is gone");
    assert_eq!(fresh.allocator(), ddo_core::AllocatorKind::NativeVmm);
    let buf = fresh.alloc(1 << 20).unwrap();
    assert_eq!(fresh.native_pool_figures().unwrap().live_bytes, 1 << 20);
    drop(buf);
}

#[test]
fn release_is_refused_with_work_in_flight_and_releases_nothing() {
    let Some(d) = open_gpu(true) else { return };
    let len = 1usize << 30;
    let a = d.alloc(len).unwrap();
    let b = d.alloc(len).unwrap();
    // An idle 512 MiB that a release could return.
    drop(d.alloc(512 << 20).unwrap());
    d.synchronize().unwrap();
    let compute = d.compute_stream();
    for _ in 0..40 {
        d.copy_d2d(&a.slice_all(), &b.slice_all(), &compute)
            .unwrap();
    }
    let before = d.native_pool_figures().unwrap();
    let err = release_native_vmm_idle_cache(&*d).unwrap_err();
    println!("refusal while 40 x 1 GiB copies are queued: {err}");
    assert!(matches!(err, CoreError::NotQuiescent { .. }), "{err}");
    let after = d.native_pool_figures().unwrap();
    assert_eq!(after.mapped_bytes, before.mapped_bytes);
    assert_eq!(after.chunks_released, before.chunks_released);
    d.synchronize().unwrap();
    let report = release_native_vmm_idle_cache(&*d).unwrap();
    println!("after synchronize: {report:?}");
    assert_eq!(report.bytes, 512 << 20);
    assert!(report.proven, "{report:?}");
}

/// `empty_cache` returns the caching allocator's idle segments only: with the native pool
/// installed it returns nothing and leaves the pool's idle pages mapped (it never reports
/// them as given back); those go back through `release_native_vmm_idle_cache` alone (the
/// seed, issue 17 point 6).
#[test]
fn empty_cache_does_not_report_the_native_pool_as_returned() {
    let Some(d) = open_gpu(true) else { return };
    let buf = upload(&*d, &vec![7u8; 8 << 20], &d.compute_stream()).unwrap();
    drop(buf);
    d.synchronize().unwrap();
    let before = d.native_pool_figures().expect("pool figures");
    assert_eq!(before.live_bytes, 0, "{before:?}");
    assert!(
        before.mapped_bytes >= 8 << 20,
        "idle pages stay mapped: {before:?}"
    );
    let returned = d.empty_cache().unwrap();
    let after = d.native_pool_figures().unwrap();
    assert_eq!(returned, 0, "empty_cache reported {returned} B returned");
    assert_eq!(after.mapped_bytes, before.mapped_bytes, "{after:?}");
    let released = release_native_vmm_idle_cache(&*d).unwrap();
    println!("empty_cache: {returned} B; then the idle release: {released:?}");
    assert!(released.bytes >= 8 << 20, "{released:?}");
    let left = d.native_pool_figures().unwrap().mapped_bytes;
    assert!(
        left + released.bytes <= before.mapped_bytes,
        "{left} B still mapped"
    );
}

/// Issue 17 point 6, on the GPU: the seed's VAE row for `vmm_fast` on a device whose native
/// allocator was installed at bootstrap is leaf, no stream, pins nothing, runs from the
/// native pool (the caching allocator serves nothing), decodes byte for byte what resident
/// execution on the same device decodes, and leaves no live bytes in the pool once the
/// output and the cuBLAS workspace are given back.
#[test]
fn vmm_fast_vae_on_a_native_device_is_leaf_no_stream_from_the_pool() {
    let Some(d) = open_gpu(true) else { return };
    let mut w = RandomWeights::new(3, DType::BF16);
    let vae = AutoencoderKL::build(&mut w, AutoencoderKLConfig::flux()).unwrap();
    let latents = Tensor::from_f32(vec![1, 16, 32, 32], DType::F32, &rnd(16 * 32 * 32, 9)).unwrap();
    let expected = {
        let _h = enable_dynamic_offload(vae.component(), d.clone(), RouteSpec::resident()).unwrap();
        let out = vae.decode(Some(&*d), &latents, None).unwrap();
        output_bytes(&d, &out)
    };
    let options = ddo_routes::OffloadOptions {
        settings: ddo_core::Settings {
            preset: ddo_core::Preset::VmmFast,
            ..ddo_core::Settings::default()
        },
        ..ddo_routes::OffloadOptions::default()
    };
    // What the device keeps pinned of its own (its upload staging, from the resident run
    // above) is not the route's: the route adds nothing.
    d.synchronize().unwrap();
    let pinned_before = d.memory_info().pinned_host;
    let h = ddo_routes::enable_offload_with_env(
        vae.component(),
        d.clone(),
        &options,
        &ddo_core::MapEnvironment::default(),
    )
    .unwrap();
    assert_eq!(
        h.spec().route_id(),
        Some(ddo_core::RouteId::DIFFUSERS_GROUP_OFFLOAD)
    );
    let o = h.spec().options();
    assert_eq!(o.offload_type, Some(ddo_core::OffloadType::LeafLevel));
    assert_eq!(
        (o.use_stream, o.low_cpu_mem_usage),
        (Some(false), Some(false)),
        "{:?}",
        h.spec()
    );
    assert_eq!(
        d.memory_info().pinned_host,
        pinned_before,
        "the route pins nothing"
    );
    d.synchronize().unwrap();
    d.reset_peak();
    let out = vae.decode(Some(&*d), &latents, None).unwrap();
    assert_eq!(
        d.memory_info().pinned_host,
        pinned_before,
        "a decode pins nothing of the weights"
    );
    assert!(
        output_bytes(&d, &out) == expected,
        "vmm_fast's VAE differs from resident on the native device"
    );
    let pool = d.native_pool_figures().expect("pool figures");
    assert!(
        pool.peak_live_bytes > 0,
        "the pool served the decode: {pool:?}"
    );
    let caching = d.allocator_stats();
    assert_eq!(
        (caching.allocated, caching.peak_allocated),
        (0, 0),
        "the caching allocator served nothing"
    );
    drop(out);
    d.release_blas_workspaces().unwrap();
    d.synchronize().unwrap();
    let pool = d.native_pool_figures().unwrap();
    assert_eq!(
        pool.live_bytes, 0,
        "nothing of the VAE stays live: {pool:?}"
    );
    assert_eq!(d.allocator(), ddo_core::AllocatorKind::NativeVmm);
    drop(h);
}

fn small_flux() -> FluxTransformer {
    let mut cfg = FluxTransformerConfig::flux_dev();
    cfg.num_layers = 2;
    cfg.num_single_layers = 2;
    FluxTransformer::random(cfg, 7, DType::BF16).unwrap()
}

#[test]
fn flux_transformer_under_native_vmm_equals_resident_and_releases_at_the_boundary() {
    // One device, one allocator: the resident baseline runs from the native pool too (the
    // seed compares routes within the same process allocator, and a caching device of the
    // same GPU may not allocate beside the native allocator).
    let Some(d) = open_gpu(true) else { return };
    let inputs = synthetic_flux_inputs(32, 128);
    let model = small_flux();
    let weights: u64 = model.component().param_bytes();
    let expected = {
        let _h =
            enable_dynamic_offload(model.component(), d.clone(), RouteSpec::resident()).unwrap();
        let out = model.forward(&*d, &inputs).unwrap();
        output_bytes(&d, &out)
    };
    for budget in [weights + (64 << 20), weights / 2, weights / 8] {
        let spec: RouteSpec =
            ddo_routes::parse_spec(format!("native_vmm:budget={budget}")).unwrap();
        let mut h = enable_dynamic_offload(model.component(), d.clone(), spec).unwrap();
        // The first forward learns the schedule; the next ones stream through the engine.
        for round in 0..3 {
            d.synchronize().unwrap();
            let t = Instant::now();
            let out = model.forward(&*d, &inputs).unwrap();
            d.synchronize().unwrap();
            let ms = t.elapsed().as_secs_f64() * 1e3;
            let got = output_bytes(&d, &out);
            drop(out);
            let c = h.metrics_snapshot().counters;
            println!(
                "budget {budget} B of {weights} B weights, forward {round} ({ms:.1} ms): streamed {} / resident {} leaves, \
                 h2d {} B in {} copies; {} units, {} slots x {} B",
                c.leaves_streamed,
                c.leaves_resident,
                c.h2d_bytes,
                c.h2d_copies,
                c.transfer_units,
                c.ring_slots,
                c.ring_slot_bytes,
            );
            assert!(
                got == expected,
                "native_vmm (budget {budget}, forward {round}) differs from resident"
            );
        }
        // Phase boundary: remove the route, synchronise, then release the idle cache.
        remove_dynamic_offload(&mut h).unwrap();
        d.synchronize().unwrap();
        d.release_blas_workspaces().unwrap();
        d.synchronize().unwrap();
        let before: NativePoolFigures = d.native_pool_figures().unwrap();
        assert_eq!(before.live_bytes, 0, "{before:?}");
        let report = release_native_vmm_idle_cache(&*d).unwrap();
        let rise = report.driver_free_after.unwrap() - report.driver_free_before.unwrap();
        println!(
            "release: {} chunks, {} B; driver free rose {} B; proven {}",
            report.chunks, report.bytes, rise, report.proven
        );
        assert_eq!(report.bytes, before.mapped_bytes);
        assert!(report.proven && rise >= report.bytes, "{report:?}");
        assert_eq!(d.native_pool_figures().unwrap().mapped_bytes, 0);
    }
    // A copy stream writing into bytes the compute stream freed moments ago: group offload
    // with a stream under the native allocator (its fences order the copies) equals resident.
    let spec: RouteSpec =
        ddo_routes::parse_spec("diffusers_group_offload:offload_type=leaf_level,use_stream=true")
            .unwrap();
    let _h = enable_dynamic_offload(model.component(), d.clone(), spec).unwrap();
    for round in 0..2 {
        let out = model.forward(&*d, &inputs).unwrap();
        assert!(
            output_bytes(&d, &out) == expected,
            "group offload with a stream under the native allocator differs (round {round})"
        );
    }
    let f = d.native_pool_figures().unwrap();
    println!(
        "group offload, stream, native allocator: {}",
        f.format_line()
    );
}

fn median_ms(mut f: impl FnMut(), d: &CudaDevice) -> f64 {
    for _ in 0..2 {
        f();
    }
    d.synchronize().unwrap();
    let mut times = Vec::new();
    for _ in 0..7 {
        let t = Instant::now();
        f();
        d.synchronize().unwrap();
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

/// One workload's figures on one allocator.
struct Row {
    workload: &'static str,
    allocator: &'static str,
    median_ms: f64,
    peak_live: u64,
    peak_reserved: u64,
}

/// Peak live and peak reserved (mapped, for the pool) since the last reset.
fn peaks(d: &CudaDevice) -> (u64, u64) {
    match d.native_pool_figures() {
        Some(f) => (f.peak_live_bytes, f.peak_mapped_bytes),
        None => {
            let s = d.allocator_stats();
            (s.peak_allocated, s.peak_reserved)
        }
    }
}

fn run_workloads(d: &Arc<CudaDevice>, allocator: &'static str, rows: &mut Vec<Row>) {
    {
        let mut w = RandomWeights::new(1, DType::BF16);
        let vae = AutoencoderKL::build(&mut w, AutoencoderKLConfig::flux()).unwrap();
        let _h = enable_dynamic_offload(vae.component(), d.clone(), RouteSpec::resident()).unwrap();
        let latents =
            Tensor::from_f32(vec![1, 16, 128, 128], DType::F32, &rnd(16 * 128 * 128, 5)).unwrap();
        d.synchronize().unwrap();
        d.reset_peak();
        let ms = median_ms(
            || {
                vae.decode(Some(&**d), &latents, None).unwrap();
            },
            d,
        );
        let (peak_live, peak_reserved) = peaks(d);
        rows.push(Row {
            workload: "vae_decode_1024_bf16",
            allocator,
            median_ms: ms,
            peak_live,
            peak_reserved,
        });
    }
    {
        let mut cfg = FluxTransformerConfig::flux_dev();
        cfg.num_layers = 5;
        cfg.num_single_layers = 10;
        let model = FluxTransformer::random(cfg, 2, DType::BF16).unwrap();
        let _h =
            enable_dynamic_offload(model.component(), d.clone(), RouteSpec::resident()).unwrap();
        let inputs = synthetic_flux_inputs(72, 512);
        d.synchronize().unwrap();
        d.reset_peak();
        let ms = median_ms(
            || {
                model.forward(&**d, &inputs).unwrap();
            },
            d,
        );
        let (peak_live, peak_reserved) = peaks(d);
        rows.push(Row {
            workload: "flux_5x10_4608_bf16_step",
            allocator,
            median_ms: ms,
            peak_live,
            peak_reserved,
        });
    }
}

#[test]
fn benchmark_reserved_over_live_against_the_caching_allocator() {
    if std::env::var_os("DDO_BENCH").is_none_or(|v| v != "1") {
        println!("skipped: set DDO_BENCH=1 to run the allocator benchmark");
        return;
    }
    let mut rows = Vec::new();
    {
        let Some(d) = open_gpu(false) else { return };
        run_workloads(&d, "caching", &mut rows);
    }
    {
        let Some(d) = open_gpu(true) else { return };
        run_workloads(&d, "native_vmm", &mut rows);
        let f = d.native_pool_figures().unwrap();
        println!("{}", f.format_line());
    }
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    println!(
        "| workload | allocator | median ms | peak live GiB | peak reserved GiB | reserved / live |"
    );
    println!("| --- | --- | --- | --- | --- | --- |");
    let mut json = Vec::new();
    for r in &rows {
        let ratio = r.peak_reserved as f64 / r.peak_live.max(1) as f64;
        println!(
            "| {} | {} | {:.1} | {:.3} | {:.3} | {:.3} |",
            r.workload,
            r.allocator,
            r.median_ms,
            gib(r.peak_live),
            gib(r.peak_reserved),
            ratio
        );
        json.push(serde_json::json!({
            "workload": r.workload, "allocator": r.allocator, "median_ms": r.median_ms,
            "peak_live_bytes": r.peak_live, "peak_reserved_bytes": r.peak_reserved, "ratio": ratio,
        }));
        assert!(r.peak_live > 0);
    }
    if let Some(out) = std::env::var_os("DDO_BENCH_OUT") {
        let path = std::path::PathBuf::from(out).join("native_vmm_bench.json");
        std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap()).unwrap();
        println!("wrote {}", path.display());
    }
}
