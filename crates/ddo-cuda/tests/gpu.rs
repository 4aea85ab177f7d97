//! GPU tests of the CUDA backend. Each asks [`gpu`] for device 0 first: without the driver
//! library or a device it prints "skipped: no CUDA device" and passes (unless
//! `DDO_REQUIRE_GPU=1`), so CPU-only CI runs them harmlessly; `cargo xtask test-gpu` (or the `gpu-bundle`'s `run-all.sh`) runs them
//! for real, one at a time (`--test-threads=1`), since they measure device memory.

use std::sync::Arc;
use std::time::Instant;

use ddo_core::device::{download, upload};
use ddo_core::reference::{self, ReferenceSpec};
use ddo_core::{CoreError, DType, Device, HostBuffer, RouteSpec};
use ddo_cuda::{CudaDevice, CudaError, device_count, library_present};
use ddo_host::HostDevice;
use ddo_routes::enable_dynamic_offload;

const MIB: usize = 1 << 20;

mod common;

/// Device 0, or `None` (after saying so) when there is no driver library or no device;
/// with `DDO_REQUIRE_GPU=1` a missing device fails the test instead.
fn gpu() -> Option<Arc<CudaDevice>> {
    common::open_gpu(false)
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ ((i >> 8) as u8))
        .collect()
}

/// The device holds nothing and no copy keeps memory alive.
fn assert_clean(d: &CudaDevice) {
    d.synchronize().unwrap();
    assert_eq!(d.pending_copies(), 0);
    assert_eq!(d.memory_info().allocated, 0, "{:?}", d.allocator_stats());
}

#[test]
fn no_driver_is_a_typed_error_not_a_panic() {
    if library_present() {
        println!("skipped: a CUDA driver library is present (this test covers its absence)");
        return;
    }
    let err = CudaDevice::new(0).unwrap_err();
    assert!(
        matches!(
            err,
            CudaError::NoLibrary {
                which: "libcuda",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("LD_LIBRARY_PATH"), "{err}");
    assert!(matches!(device_count(), Err(CudaError::NoLibrary { .. })));
    let core: CoreError = err.into();
    assert!(matches!(core, CoreError::Backend { .. }), "{core}");
}

#[test]
fn an_unavailable_ordinal_is_no_device_naming_the_count() {
    let Some(_d) = gpu() else { return };
    let count = device_count().unwrap();
    let err = CudaDevice::new(count).unwrap_err();
    assert!(
        matches!(err, CudaError::NoDevice { ordinal, count: c } if ordinal == count && c == count),
        "{err}"
    );
    assert!(
        err.to_string().contains(&format!("{count} device")),
        "{err}"
    );
}

#[test]
fn pageable_and_pinned_copies_round_trip() {
    let Some(d) = gpu() else { return };
    assert_eq!(d.id().to_string(), "cuda:0");
    let s = d.compute_stream();
    for len in [1, 511, 4096, 3 * MIB + 17] {
        let bytes = pattern(len, len as u8);
        // Pageable: staged through a pinned upload buffer on the way up, synchronous down.
        let buf = upload(&*d, &bytes, &s).unwrap();
        assert_eq!(download(&*d, &buf.slice_all(), &s).unwrap(), bytes);
        // Pinned: asynchronous both ways.
        let src = d.alloc_pinned(len).unwrap();
        assert!(src.is_pinned());
        src.with_bytes_mut(|b| b.copy_from_slice(&bytes)).unwrap();
        let dev = d.alloc(len).unwrap();
        d.copy_h2d(&src.slice_all(), &dev.slice_all(), &s).unwrap();
        let back = d.alloc_pinned(len).unwrap();
        d.copy_d2h(&dev.slice_all(), &back.slice_all(), &s).unwrap();
        d.synchronize_stream(&s).unwrap();
        assert_eq!(back.with_bytes(<[u8]>::to_vec), bytes, "{len} B");
        // Device to device, at offsets.
        if len > 64 {
            let other = d.alloc(len).unwrap();
            d.copy_d2d(
                &dev.slice(32, len - 64).unwrap(),
                &other.slice(0, len - 64).unwrap(),
                &s,
            )
            .unwrap();
            let part = download(&*d, &other.slice(0, len - 64).unwrap(), &s).unwrap();
            assert_eq!(part, bytes[32..len - 32]);
        }
        assert_eq!(
            d.memory_info().pinned_host - d.upload_staging_bytes(),
            2 * len as u64
        );
    }
    assert!(d.upload_staging_bytes() >= 3 * MIB as u64);
    d.empty_cache().unwrap();
    assert_eq!(d.memory_info().pinned_host, 0);
    assert_clean(&d);
}

#[test]
fn pageable_uploads_are_staged_reused_and_give_way_to_pinned_allocations() {
    let config = ddo_cuda::CudaDeviceConfig {
        pinned_limit: Some(16 * MIB as u64),
        upload_staging_bytes: 8 * MIB as u64,
        ..ddo_cuda::CudaDeviceConfig::new(0)
    };
    let d = match CudaDevice::with_config(config) {
        Ok(d) => d,
        Err(_) if gpu().is_none() => return,
        Err(e) => panic!("{e}"),
    };
    let s = d.compute_stream();
    // The first upload makes a 4 MiB buffer (its size class); once its copy is done, the
    // next reuses it. A buffer a queued copy still reads is never handed out again, so
    // back-to-back uploads may need a second one, never more than the room allows.
    let (a, b) = (pattern(3 * MIB, 1), pattern(3 * MIB, 2));
    let da = upload(&*d, &a, &s).unwrap();
    assert_eq!(d.upload_staging_bytes(), 4 * MIB as u64);
    assert_eq!(d.memory_info().pinned_host, 4 * MIB as u64);
    d.synchronize().unwrap();
    let db = upload(&*d, &b, &s).unwrap();
    assert_eq!(
        d.upload_staging_bytes(),
        4 * MIB as u64,
        "reused, not grown"
    );
    let many: Vec<_> = (0..6)
        .map(|i| upload(&*d, &pattern(3 * MIB, i), &s).unwrap())
        .collect();
    assert!(d.upload_staging_bytes() <= 8 * MIB as u64);
    for (i, m) in many.iter().enumerate() {
        assert_eq!(
            download(&*d, &m.slice_all(), &s).unwrap(),
            pattern(3 * MIB, i as u8)
        );
    }
    drop(many);
    assert_eq!(download(&*d, &da.slice_all(), &s).unwrap(), a);
    assert_eq!(download(&*d, &db.slice_all(), &s).unwrap(), b);
    let staged = d.upload_staging_bytes();
    let m = d.memory_info();
    assert_eq!(m.pinned_cached, staged);
    assert_eq!(
        m.pinned_room(),
        16 * MIB as u64,
        "cached upload buffers count as room"
    );
    // The source can change as soon as the call returns: its bytes were staged.
    let mut c = pattern(MIB + 5, 3);
    let src = HostBuffer::pageable_from(&c);
    let dc = d.alloc(c.len()).unwrap();
    d.copy_h2d(&src.slice_all(), &dc.slice_all(), &s).unwrap();
    src.with_bytes_mut(|x| x.fill(0)).unwrap();
    assert_eq!(d.upload_staging_bytes(), staged, "reused, not grown");
    assert_eq!(download(&*d, &dc.slice_all(), &s).unwrap(), c);
    // Larger than half the staging room: copied chunk by chunk through the upload buffers
    // (never more than their room), and the source can change as soon as the call returns.
    c = pattern(13 * MIB + 7, 4);
    let src = HostBuffer::pageable_from(&c);
    let dl = d.alloc(c.len()).unwrap();
    d.copy_h2d(&src.slice_all(), &dl.slice_all(), &s).unwrap();
    src.with_bytes_mut(|x| x.fill(0)).unwrap();
    assert!(d.upload_staging_bytes() <= 8 * MIB as u64);
    assert_eq!(download(&*d, &dl.slice_all(), &s).unwrap(), c);
    // A pinned allocation that needs the staging's room gets it.
    d.synchronize().unwrap();
    let pinned = d.alloc_pinned(14 * MIB).unwrap();
    assert_eq!(d.upload_staging_bytes(), 0);
    assert_eq!(d.memory_info().pinned_host, 14 * MIB as u64);
    // With the ledger near full, uploads are not staged (and still correct).
    let dd = upload(&*d, &a, &s).unwrap();
    assert_eq!(download(&*d, &dd.slice_all(), &s).unwrap(), a);
    assert_eq!(d.upload_staging_bytes(), 0);
    drop(pinned);
    let _ = upload(&*d, &b, &s).unwrap();
    assert_eq!(d.upload_staging_bytes(), 4 * MIB as u64);
    d.empty_cache().unwrap();
    assert_eq!(d.upload_staging_bytes(), 0);
    assert_eq!(d.memory_info().pinned_host, 0);
    drop((da, db, dc, dl, dd));
    assert_clean(&d);
}

#[test]
fn many_small_pinned_buffers_share_pages() {
    let Some(d) = gpu() else { return };
    let s = d.compute_stream();
    let bufs: Vec<HostBuffer> = (0..64).map(|_| d.alloc_pinned(100).unwrap()).collect();
    let dev = d.alloc(100 * bufs.len()).unwrap();
    for (i, b) in bufs.iter().enumerate() {
        b.with_bytes_mut(|x| x.fill(i as u8)).unwrap();
        d.copy_h2d(&b.slice_all(), &dev.slice(i * 100, 100).unwrap(), &s)
            .unwrap();
    }
    let back = download(&*d, &dev.slice_all(), &s).unwrap();
    for (i, chunk) in back.chunks(100).enumerate() {
        assert!(chunk.iter().all(|&v| v == i as u8), "buffer {i}");
    }
    drop(bufs);
    assert_eq!(d.memory_info().pinned_host, 0);
}

#[test]
fn an_event_orders_a_side_stream_copy_before_a_compute_stream_read() {
    let Some(d) = gpu() else { return };
    let copy = d.create_stream().unwrap();
    let compute = d.compute_stream();
    let len = 256 * MIB;
    let src = d.alloc_pinned(len).unwrap();
    src.with_bytes_mut(|b| b.fill(0xA5)).unwrap();
    let dev = d.alloc(len).unwrap();
    // Zero it on compute first, so a read that is not ordered after the copy could see 0s.
    let zeros = HostBuffer::pageable_zeroed(len);
    d.copy_h2d(&zeros.slice_all(), &dev.slice_all(), &compute)
        .unwrap();
    d.copy_h2d(&src.slice_all(), &dev.slice_all(), &copy)
        .unwrap();
    let done = d.record_event(&copy).unwrap();
    d.wait_event(&compute, &done).unwrap();
    let out = d.alloc_pinned(len).unwrap();
    d.copy_d2h(&dev.slice_all(), &out.slice_all(), &compute)
        .unwrap();
    // The handles can go: the pending copies hold what they use.
    drop((src, dev));
    d.synchronize_stream(&compute).unwrap();
    assert!(d.event_complete(&done).unwrap());
    d.synchronize_event(&done).unwrap();
    assert!(out.with_bytes(|b| b.iter().all(|&v| v == 0xA5)));
    drop(out);
    assert_clean(&d);
}

#[test]
fn release_after_frees_when_the_stream_gets_there_and_the_stream_reuses_it_at_once() {
    let Some(d) = gpu() else { return };
    let copy = d.create_stream().unwrap();
    let len = 64 * MIB;
    let src = d.alloc_pinned(len).unwrap();
    let buf = d.alloc(len).unwrap();
    d.copy_h2d(&src.slice_all(), &buf.slice_all(), &copy)
        .unwrap();
    d.release_after(buf, &copy).unwrap();
    d.synchronize_stream(&copy).unwrap();
    assert_eq!(d.memory_info().allocated, 0);
    let reserved = d.memory_info().reserved;
    // The copy stream may take the block back at once; reserved does not grow.
    let again = d.alloc_on(len, &copy).unwrap();
    assert_eq!(d.memory_info().reserved, reserved);
    d.release_after(again, &copy).unwrap();
    drop(src);
    assert_clean(&d);
}

#[test]
fn a_noted_use_orders_the_free_after_that_stream() {
    let Some(d) = gpu() else { return };
    let s = d.create_stream().unwrap();
    let big = 512 * MIB;
    let src = d.alloc_pinned(big).unwrap();
    let dst = d.alloc(big).unwrap();
    let len = 30 * MIB;
    let b = d.alloc(len).unwrap();
    let ptr = d.allocation(&b).unwrap().device_ptr();
    // Milliseconds of work ahead on `s`; then a use of `b` that holds no handle.
    d.copy_h2d(&src.slice_all(), &dst.slice_all(), &s).unwrap();
    d.allocation(&b)
        .unwrap()
        .note_use(d.stream_handle(&s).unwrap());
    drop(b);
    let elsewhere = d.alloc(len).unwrap();
    if d.allocator_stats().pending_events > 0 {
        let got = d.allocation(&elsewhere).unwrap().device_ptr();
        assert_ne!(got, ptr, "reused before the noted stream got there");
    } else {
        println!("the copy finished before the check; ordering not observed");
    }
    let on_s = d.alloc_on(len, &s).unwrap();
    assert_eq!(
        d.allocation(&on_s).unwrap().device_ptr(),
        ptr,
        "the noted stream itself reuses it at once"
    );
    d.release_after(on_s, &s).unwrap();
    drop((elsewhere, src, dst));
    assert_clean(&d);
}

#[test]
fn a_freed_size_is_reused_without_growing_reserved() {
    let Some(d) = gpu() else { return };
    for len in [1000, 300 * 1024, 5 * MIB, 100 * MIB] {
        let a = d.alloc(len).unwrap();
        let (reserved, driver_allocs) =
            (d.memory_info().reserved, d.allocator_stats().driver_allocs);
        drop(a); // no queued work used it: idle at once
        let b = d.alloc(len).unwrap();
        assert_eq!(d.memory_info().reserved, reserved, "{len} B");
        assert_eq!(d.allocator_stats().driver_allocs, driver_allocs, "{len} B");
        drop(b);
    }
    let info = d.memory_info();
    assert!(info.peak_allocated >= 100 * MIB as u64);
    d.reset_peak();
    assert_eq!(d.memory_info().peak_allocated, 0);
    assert_clean(&d);
}

#[test]
fn empty_cache_returns_bytes_and_the_driver_sees_them() {
    let Some(d) = gpu() else { return };
    let len = 1 << 30;
    let a = d.alloc(len).unwrap();
    drop(a);
    d.synchronize().unwrap();
    let before = d.memory_info();
    assert_eq!(before.allocated, 0);
    assert!(before.reserved >= len as u64);
    let returned = d.empty_cache().unwrap();
    assert_eq!(returned, before.reserved);
    d.synchronize().unwrap();
    let after = d.memory_info();
    assert_eq!(after.reserved, 0);
    let (f0, f1) = (before.driver_free.unwrap(), after.driver_free.unwrap());
    println!("empty_cache returned {returned} B; driver free {f0} -> {f1} B");
    assert!(
        f1 >= f0 + returned - (64 << 20),
        "driver free rose by {} B only",
        f1.saturating_sub(f0)
    );
}

#[test]
fn out_of_memory_is_typed_and_leaks_nothing() {
    let Some(d) = gpu() else { return };
    let keep = d.alloc(MIB).unwrap();
    d.synchronize().unwrap();
    let before = d.memory_info();
    let too_much = before.driver_free.unwrap() + (1 << 30);
    let err = d.alloc(too_much as usize).unwrap_err();
    assert!(
        matches!(&err, CoreError::OutOfMemory { requested, capacity, .. }
            if *requested == too_much && *capacity == before.capacity),
        "{err}"
    );
    d.synchronize().unwrap();
    let after = d.memory_info();
    assert_eq!(after.allocated, before.allocated);
    assert!(after.reserved <= before.reserved);
    assert!(after.driver_free.unwrap() + (64 << 20) >= before.driver_free.unwrap());
    // The device still works.
    let buf = upload(&*d, &[1, 2, 3], &d.compute_stream()).unwrap();
    assert_eq!(
        download(&*d, &buf.slice_all(), &d.compute_stream()).unwrap(),
        vec![1, 2, 3]
    );
    drop((buf, keep));
    assert_clean(&d);
}

#[test]
fn handles_of_another_device_are_refused() {
    let Some(d) = gpu() else { return };
    let host = HostDevice::with_capacity(1 << 20).unwrap();
    let foreign = host.alloc(4).unwrap();
    let src = HostBuffer::pageable_from(&[0; 4]);
    let err = d
        .copy_h2d(&src.slice_all(), &foreign.slice_all(), &d.compute_stream())
        .unwrap_err();
    assert!(matches!(err, CoreError::WrongDevice { .. }), "{err}");
    let mine = d.alloc(4).unwrap();
    let err = d
        .copy_h2d(&src.slice_all(), &mine.slice_all(), &host.compute_stream())
        .unwrap_err();
    assert!(matches!(err, CoreError::WrongDevice { .. }), "{err}");
    let other = CudaDevice::new(0).unwrap();
    let err = other
        .release_after(mine, &other.compute_stream())
        .unwrap_err();
    assert!(matches!(err, CoreError::WrongDevice { .. }), "{err}");
}

#[test]
fn a_dropped_stream_waits_for_its_copies() {
    let Some(d) = gpu() else { return };
    let len = 128 * MIB;
    {
        let s = d.create_stream().unwrap();
        let src = d.alloc_pinned(len).unwrap();
        let dst = d.alloc(len).unwrap();
        d.copy_h2d(&src.slice_all(), &dst.slice_all(), &s).unwrap();
        // Everything goes at once; the stream's drop waits for the copy first.
    }
    assert_eq!(d.memory_info().pinned_host, 0);
    assert_clean(&d);
}

#[test]
fn pinned_host_to_device_bandwidth() {
    let Some(d) = gpu() else { return };
    let s = d.compute_stream();
    let len = 1usize << 30;
    let src = d.alloc_pinned(len).unwrap();
    let dst = d.alloc(len).unwrap();
    d.copy_h2d(&src.slice_all(), &dst.slice_all(), &s).unwrap(); // warm-up
    d.synchronize_stream(&s).unwrap();
    let reps = 5;
    let t = Instant::now();
    for _ in 0..reps {
        d.copy_h2d(&src.slice_all(), &dst.slice_all(), &s).unwrap();
    }
    d.synchronize_stream(&s).unwrap();
    let pinned = (reps * len) as f64 / t.elapsed().as_secs_f64() / 1e9;
    let pageable_src = HostBuffer::pageable_zeroed(256 * MIB);
    let part = dst.slice(0, 256 * MIB).unwrap();
    let t = Instant::now();
    d.copy_h2d(&pageable_src.slice_all(), &part, &s).unwrap();
    let pageable = (256 * MIB) as f64 / t.elapsed().as_secs_f64() / 1e9;
    println!("h2d bandwidth: pinned 1 GiB {pinned:.1} GB/s; pageable 256 MiB {pageable:.1} GB/s");
    assert!(
        pinned > 2.0,
        "pinned h2d at {pinned:.2} GB/s is implausibly slow"
    );
}

fn run_reference(device: Arc<dyn Device>, spec: &ReferenceSpec, route: RouteSpec) -> Vec<u8> {
    let component = reference::build(spec).unwrap();
    let handle = enable_dynamic_offload(&component, Arc::clone(&device), route).unwrap();
    let out = handle
        .forward(reference::input(spec, 3, 11).unwrap())
        .unwrap();
    let bytes = out
        .to_host_bytes(&*device, &device.compute_stream())
        .unwrap();
    drop((out, handle, component));
    bytes
}

#[test]
fn reference_component_matches_the_host_backend_under_resident_and_leaf_group() {
    let Some(d) = gpu() else { return };
    let spec = ReferenceSpec::small("transformer", 4, 48, DType::BF16);
    let host: Arc<dyn Device> = HostDevice::with_capacity(1 << 30).unwrap();
    let cuda: Arc<dyn Device> = d.clone();
    for route in [RouteSpec::resident(), RouteSpec::leaf_group(true, false)] {
        let expected = run_reference(Arc::clone(&host), &spec, route);
        let got = run_reference(Arc::clone(&cuda), &spec, route);
        assert_eq!(got, expected, "{route:?}");
    }
    // The inputs' upload buffers are a cache that `empty_cache` returns.
    d.empty_cache().unwrap();
    assert_eq!(d.memory_info().pinned_host, 0);
    assert_clean(&d);
}
