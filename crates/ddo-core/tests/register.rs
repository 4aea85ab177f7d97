//! Registering checkpoint mappings in place (`Device::register_host`) on the host backend,
//! and the streaming engine's `pinned_source=register` staging built on it: every schedule
//! position reads exactly its params' bytes, the pinned bytes are the registered ranges
//! plus the home of the params that are not mapped (and 0 after teardown), mapped params
//! keep pointing into the file, copies coalesce over params adjacent in the file and in
//! the unit, the pinned limit is respected (falling back to the home or the staging ring
//! the way the home mode does), and a device that refuses the registration falls back to
//! a pinned home.

mod engine_common;

use engine_common::{expected, forward};
use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ddo_core::device::download;
use ddo_core::host_memory::{REGISTER_ALIGN, register_span};
use ddo_core::streaming::{
    PinnedSource, StagingKind, StagingMode, StreamingConfig, StreamingEngine,
};
use ddo_core::{
    Checkpoint, CoreError, DType, Device, DeviceBuffer, HostBuffer, HostMemoryKind, Param,
    ParamKind,
};
use ddo_host::{HostDevice, HostDeviceConfig};
use ddo_metrics::RouteMetrics;
use proptest::prelude::*;

/// A fresh temporary directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "ddo-register-{}-{}",
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

/// A device whose copies take time (bytes / `link` seconds).
fn device(pinned_limit: u64, link: f64) -> Arc<HostDevice> {
    HostDevice::new(HostDeviceConfig {
        capacity: 1 << 26,
        pinned_limit,
        link_bytes_per_sec: Some(link),
        ..HostDeviceConfig::default()
    })
    .unwrap()
}

/// Segments of f32 params: `sizes[s][i] = (elements, mapped)`. Mapped params are written to
/// one safetensors file, in `file_order` (a permutation of the mapped params, by index in
/// the order they appear in `sizes`), and opened checkpoint-backed; the others are owned
/// pageable memory. Values are unique per param.
fn segments(
    dir: &Path,
    sizes: &[Vec<(usize, bool)>],
    file_order: &[usize],
) -> (Vec<Vec<Arc<Param>>>, PathBuf) {
    let mut next = 1.0f32;
    let mut values: Vec<Vec<Vec<f32>>> = Vec::new();
    let mut mapped_names = Vec::new();
    for (s, params) in sizes.iter().enumerate() {
        let mut seg = Vec::new();
        for (i, &(n, mapped)) in params.iter().enumerate() {
            seg.push((0..n).map(|k| next + k as f32 / 1024.0).collect());
            next += 1.0;
            if mapped {
                mapped_names.push((s, i));
            }
        }
        values.push(seg);
    }
    // safetensors writes tensors sorted by name: a rank prefix sets the file order.
    let mut rank = vec![0; mapped_names.len()];
    for (r, &m) in file_order.iter().enumerate() {
        rank[m] = r;
    }
    let name_of: BTreeMap<(usize, usize), String> = mapped_names
        .iter()
        .enumerate()
        .map(|(m, &(s, i))| ((s, i), format!("t{:04}.s{s}.p{i}", rank[m])))
        .collect();
    let path = dir.join("diffusion_pytorch_model.safetensors");
    let bytes: Vec<(String, Vec<u8>, usize)> = name_of
        .iter()
        .map(|(&(s, i), name)| {
            let v = &values[s][i];
            (name.clone(), bytemuck_f32(v), v.len())
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
        .iter()
        .map(|(name, data, n)| {
            (
                name.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![*n], data)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
    let ckpt = Checkpoint::open(&path).unwrap();
    let segs = sizes
        .iter()
        .enumerate()
        .map(|(s, params)| {
            params
                .iter()
                .enumerate()
                .map(|(i, &(n, _))| match name_of.get(&(s, i)) {
                    Some(name) => {
                        Param::from_checkpoint(&ckpt, name, name.clone(), ParamKind::Parameter)
                            .unwrap()
                    }
                    None => Param::from_f32(
                        format!("owned.s{s}.p{i}"),
                        ParamKind::Parameter,
                        DType::F32,
                        vec![n],
                        &values[s][i],
                    )
                    .unwrap(),
                })
                .collect()
        })
        .collect();
    // Only the params hold the mapping now.
    drop(ckpt);
    (segs, path)
}

fn bytemuck_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The ranges a registration of the streamed mapped params must cover, computed
/// independently of the engine from the params' source descriptors: each param's range
/// of the file rounded out to blocks, merged. `(ranges, bytes)`.
fn expected_registered(params: &[&Arc<Param>]) -> (usize, u64) {
    let mut spans: Vec<std::ops::Range<usize>> = params
        .iter()
        .filter_map(|p| p.source())
        .filter(|s| !s.range.is_empty())
        .map(|s| {
            let file_len = std::fs::metadata(&s.file).unwrap().len() as usize;
            register_span(file_len, s.range.start, s.range.len())
        })
        .collect();
    spans.sort_by_key(|r| r.start);
    let mut merged: Vec<std::ops::Range<usize>> = Vec::new();
    for r in spans {
        match merged.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => merged.push(r),
        }
    }
    (
        merged.len(),
        merged.iter().map(|r| r.len() as u64).sum::<u64>(),
    )
}

/// Bytes of the home of the params that are not mapped: each unit's owned params, each
/// at its aligned size.
fn expected_home(engine: &StreamingEngine) -> u64 {
    engine
        .layout()
        .units()
        .iter()
        .flat_map(|u| &u.entries)
        .filter(|e| e.param.source().is_none() && e.len > 0)
        .map(|e| e.len.div_ceil(256) * 256)
        .sum()
}

#[derive(Debug, Clone)]
struct Case {
    sizes: Vec<Vec<(usize, bool)>>,
    file_order_seed: u64,
    schedule: Vec<usize>,
    unit_bytes: u64,
    slots: usize,
    staging: StagingMode,
    pinned_limit: u64,
    budget_fraction: Option<f64>,
    page_cache_limit: Option<u64>,
}

fn run_case(case: &Case) -> Result<(), TestCaseError> {
    let dir = TempDir::new();
    let mapped = case.sizes.iter().flatten().filter(|(_, m)| *m).count();
    // A seeded permutation of the mapped params.
    let mut file_order: Vec<usize> = (0..mapped).collect();
    let mut x = case.file_order_seed | 1;
    for i in (1..file_order.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        file_order.swap(i, (x % (i as u64 + 1)) as usize);
    }
    let (segs, _path) = segments(&dir.0, &case.sizes, &file_order);
    let d = device(case.pinned_limit + (1 << 16), 2e8);
    let aligned = |p: &Arc<Param>| (p.nbytes() as u64).div_ceil(256) * 256;
    let total: u64 = segs.iter().flatten().map(aligned).sum();
    let largest: u64 = segs
        .iter()
        .map(|s| s.iter().map(aligned).sum::<u64>())
        .max()
        .unwrap_or(0);
    let ring_room = case.slots as u64
        * largest.max(case.unit_bytes.div_ceil(256).min(total.div_ceil(256)) * 256);
    let before: Vec<(u64, bool)> = segs
        .iter()
        .flatten()
        .map(|p| (p.host_checksum(), p.is_checkpoint_backed()))
        .collect();
    let config = StreamingConfig {
        unit_bytes: case.unit_bytes,
        ring_slots: case.slots,
        pinned_limit: case.pinned_limit,
        staging: case.staging,
        budget: case
            .budget_fraction
            .map(|f| (total as f64 * f) as u64 + ring_room),
        pinned_source: PinnedSource::Register,
        timeline: false,
        compress: ddo_core::Compression::None,
        page_cache_limit: case.page_cache_limit,
        lossless_if_home_fits: false,
        copy_ahead: true,
    };
    let metrics = Arc::new(RouteMetrics::new());
    let dev: Arc<dyn Device> = d.clone();
    let mut engine = match StreamingEngine::new(
        dev,
        d.create_stream().unwrap(),
        &segs,
        &case.schedule,
        &config,
        metrics.clone(),
    ) {
        Ok(e) => e,
        // Neither the registration nor a home fits and a pinned home was required:
        // refused with nothing pinned and no param changed.
        Err(CoreError::PinnedLimit { .. }) => {
            prop_assert_eq!(case.staging, StagingMode::PinnedHome);
            prop_assert_eq!(d.memory_info().pinned_host, 0);
            let now: Vec<(u64, bool)> = segs
                .iter()
                .flatten()
                .map(|p| (p.host_checksum(), p.is_checkpoint_backed()))
                .collect();
            prop_assert_eq!(&now, &before);
            return Ok(());
        }
        Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
    };
    let f = engine.figures().clone();
    // Until the first forward, the resident params' own ranges are page-locked too.
    prop_assert_eq!(
        d.memory_info().pinned_host,
        f.pinned_bytes + f.resident_registered_bytes
    );
    prop_assert!(f.pinned_bytes + f.resident_registered_bytes <= case.pinned_limit);
    let resident: HashSet<_> = engine.resident_params().iter().map(|p| p.id()).collect();
    let mut seen = HashSet::new();
    let streamed: Vec<&Arc<Param>> = segs
        .iter()
        .flatten()
        .filter(|p| !resident.contains(&p.id()) && seen.insert(p.id()))
        .collect();
    let (ranges, registered) = expected_registered(&streamed);
    let home = expected_home(&engine);
    match f.staging {
        StagingKind::Registered {
            registered_bytes,
            home_bytes,
            staged_bytes,
            ..
        } if staged_bytes > 0 => {
            // Neither every range nor a home fits under Auto: the first units registered,
            // the rest staged through two buffers, all within the limit.
            prop_assert_eq!(case.staging, StagingMode::Auto);
            prop_assert!(registered + home > case.pinned_limit);
            prop_assert!(registered_bytes < registered);
            prop_assert!(
                f.pinned_bytes > registered_bytes + home_bytes,
                "staging buffers"
            );
            prop_assert!(staged_bytes < f.streamed_bytes);
            prop_assert_eq!(f.staging.staging_buffers(), 2);
        }
        StagingKind::Registered {
            registrations,
            registered_bytes,
            home_bytes,
            staged_bytes: _,
        } => {
            prop_assert!(case.staging != StagingMode::Ring);
            prop_assert!(f.register_fallback.is_none());
            // Resident params that share a block with a streamed range widen it; without
            // mapped resident params the registrations are exactly the streamed ones.
            let resident_mapped: Vec<&Arc<Param>> = engine
                .resident_params()
                .iter()
                .filter(|p| p.source().is_some())
                .collect();
            if resident_mapped.is_empty() {
                prop_assert_eq!((registrations, registered_bytes), (ranges, registered));
            } else {
                let all: Vec<&Arc<Param>> =
                    streamed.iter().copied().chain(resident_mapped).collect();
                let (_, widest) = expected_registered(&all);
                prop_assert!(
                    registered <= registered_bytes && registered_bytes <= widest,
                    "{} <= {} <= {}",
                    registered,
                    registered_bytes,
                    widest
                );
            }
            prop_assert_eq!(home_bytes, home);
            prop_assert_eq!(f.pinned_bytes, registered_bytes + home_bytes);
            // Mapped params still point into the file; the streamed owned ones live in
            // the home (one host copy), the others are untouched.
            for p in segs.iter().flatten() {
                let kind = p.host().kind();
                if p.source().is_some() {
                    prop_assert_eq!(kind, HostMemoryKind::CheckpointMapped);
                } else {
                    let owned_streamed = !resident.contains(&p.id());
                    prop_assert_eq!(kind == HostMemoryKind::Pinned, owned_streamed);
                }
            }
        }
        StagingKind::PinnedHome | StagingKind::Ring { .. } => {
            // Registering did not fit under the limit (or the ring was forced, or no
            // streamed param is mapped: then nothing is registered and nothing fell back).
            let any_mapped = streamed.iter().any(|p| p.source().is_some());
            if case.staging != StagingMode::Ring && f.units > 0 && any_mapped {
                let reason = f.register_fallback.clone().unwrap_or_default();
                prop_assert!(reason.contains("pinned room"), "{}", reason);
                prop_assert!(registered + home > case.pinned_limit);
                // Staging every unit only when a home fits (it is the better copy) or
                // not one unit's ranges fit beside the staging buffers.
            }
        }
        StagingKind::Coded { .. } => {
            prop_assert!(false, "coded units without compress: {:?}", f.staging);
        }
    }
    let want = expected(&segs, &case.schedule);
    let outputs: Vec<DeviceBuffer> = want.iter().map(|w| d.alloc(w.len()).unwrap()).collect();
    let lag = (d.alloc_pinned(1 << 16).unwrap(), d.alloc(1 << 16).unwrap());
    for i in 0..3 {
        let got = forward(&d, &mut engine, &segs, &case.schedule, &outputs, Some(&lag))
            .map_err(|e| TestCaseError::fail(format!("{e}")))?;
        prop_assert_eq!(&got, &want, "forward {}", i);
        d.synchronize()
            .map_err(|e| TestCaseError::fail(format!("{e}")))?;
        prop_assert_eq!(
            d.memory_info().pinned_host,
            f.pinned_bytes + (1 << 16),
            "after forward {}: only the streamed ranges (and the lag buffer) stay pinned",
            i
        );
    }
    // The disk tier: the staged units past the page cache limit gave their pages back
    // after each forward's copy (and still read exactly, above); nothing else did.
    prop_assert_eq!(engine.pages_evicted(), 3 * f.disk_bytes_per_forward);
    let staged_mapped: u64 = engine
        .layout()
        .units()
        .iter()
        .flat_map(|u| &u.entries)
        .filter(|e| e.param.source().is_some())
        .map(|e| e.len)
        .sum();
    match (case.page_cache_limit, f.staging) {
        (None, _) | (_, StagingKind::PinnedHome) => prop_assert_eq!(f.disk_bytes_per_forward, 0),
        (Some(0), StagingKind::Ring { .. }) => {
            prop_assert_eq!(f.disk_bytes_per_forward, staged_mapped)
        }
        (Some(_), StagingKind::Registered { staged_bytes, .. }) => {
            prop_assert!(f.disk_bytes_per_forward <= staged_bytes)
        }
        _ => prop_assert!(f.disk_bytes_per_forward <= staged_mapped),
    }
    let c = metrics.counters();
    let (ahead_bytes, ahead_copies) = engine.copied_ahead_unconsumed();
    prop_assert_eq!(
        c.h2d_bytes,
        f.resident_bytes + 3 * f.streamed_bytes + ahead_bytes
    );
    prop_assert_eq!(
        c.h2d_copies,
        resident.len() as u64 + 3 * f.copies_per_forward + ahead_copies
    );
    engine.teardown().unwrap();
    drop(engine);
    drop(outputs);
    drop(lag);
    prop_assert_eq!(d.memory_info().allocated, 0);
    prop_assert_eq!(after_release(&*d).pinned_host, 0);
    // Same bytes; params the home held are owned pageable copies now, mapped ones are
    // still mapped.
    let after: Vec<u64> = segs.iter().flatten().map(|p| p.host_checksum()).collect();
    let before_sums: Vec<u64> = before.iter().map(|b| b.0).collect();
    prop_assert_eq!(before_sums, after);
    for p in segs.iter().flatten() {
        if p.source().is_some() && matches!(f.staging, StagingKind::Registered { .. }) {
            prop_assert!(p.is_checkpoint_backed(), "{}", p.name());
        }
        prop_assert!(p.device().is_none());
    }
    Ok(())
}

fn case_strategy() -> impl Strategy<Value = Case> {
    // Sizes in f32 elements: small odd ones and multiples of 64 (256 B, which coalesce).
    let size = prop_oneof![1usize..200, (1usize..8).prop_map(|k| k * 64)];
    let sizes = prop::collection::vec(
        prop::collection::vec((size, prop::bool::weighted(0.8)), 1..4),
        2..9,
    );
    (
        sizes,
        any::<u64>(),
        prop::collection::vec(0usize..100, 2..14),
        prop::sample::select(vec![64u64, 256, 1000, 4096, 1 << 20]),
        2usize..5,
        prop::sample::select(vec![
            StagingMode::Auto,
            StagingMode::Auto,
            StagingMode::PinnedHome,
            StagingMode::Ring,
        ]),
        // Below one registration block, around it, and plenty.
        prop::sample::select(vec![4096u64, 48 << 10, 96 << 10, 1 << 20]),
        // Mostly everything streamed; sometimes a budget that keeps part resident.
        prop::option::weighted(0.3, 0.0f64..0.7),
        // Staged pages kept, none kept, or some.
        prop::option::of(prop::sample::select(vec![0u64, 512, 4096])),
    )
        .prop_map(
            |(
                sizes,
                file_order_seed,
                picks,
                unit_bytes,
                slots,
                staging,
                pinned_limit,
                budget,
                page_cache_limit,
            )| {
                let n = sizes.len();
                let mut schedule: Vec<usize> = (0..n).collect();
                for (i, p) in picks.iter().enumerate() {
                    if i < n {
                        schedule.swap(i, p % n);
                    } else {
                        schedule.push(p % n);
                    }
                }
                Case {
                    sizes,
                    file_order_seed,
                    schedule,
                    unit_bytes,
                    slots,
                    staging,
                    pinned_limit,
                    budget_fraction: budget,
                    page_cache_limit,
                }
            },
        )
}

/// The device's memory once what it kept pinned after `release_host` is unpinned: first
/// checks everything still pinned is that kept memory (the CUDA device's rule, which the
/// host backend follows).
fn after_release(d: &dyn Device) -> ddo_core::MemoryInfo {
    let m = d.memory_info();
    assert_eq!(
        m.pinned_host, m.pinned_cached,
        "pinned beyond what release_host kept"
    );
    d.unpin_released();
    d.memory_info()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn registered_staging_reads_every_position_exactly_and_keeps_its_limits(case in case_strategy()) {
        run_case(&case)?;
    }
}

#[test]
fn register_host_pins_a_mapping_in_place_and_refuses_what_it_cannot_pin() {
    let dir = TempDir::new();
    let (segs, path) = segments(
        &dir.0,
        &[vec![(40_000, true), (30_000, true), (10, true)]],
        &[0, 1, 2],
    );
    let map = Checkpoint::open(&path).unwrap().map().clone();
    let d = device(1 << 20, 1e9);
    // A range in the middle of the file locks whole blocks around it.
    let buffer = HostBuffer::mapped(Arc::clone(&map), 70_000, 100).unwrap();
    let view = d.register_host(&buffer).unwrap();
    assert_eq!(view.kind(), HostMemoryKind::Pinned);
    assert_eq!(view.len(), 100);
    assert_eq!(
        view.with_bytes(<[u8]>::to_vec),
        buffer.with_bytes(<[u8]>::to_vec)
    );
    let span = register_span(map.len(), 70_000, 100);
    assert_eq!(span, REGISTER_ALIGN..2 * REGISTER_ALIGN);
    assert_eq!(d.memory_info().pinned_host, REGISTER_ALIGN as u64);
    assert_eq!(view.pinned_bytes().unwrap(), REGISTER_ALIGN as u64);
    // Read-only, like the mapping.
    assert!(view.with_bytes_mut(|b| b[0] = 1).is_err());
    // A range sharing a block is refused (a page is registered once); a disjoint one is not.
    let overlapping = HostBuffer::mapped(Arc::clone(&map), REGISTER_ALIGN + 5, 10).unwrap();
    let err = d.register_host(&overlapping).unwrap_err();
    assert!(
        matches!(err, CoreError::HostRegisterUnsupported { .. }),
        "{err}"
    );
    let first = HostBuffer::mapped(Arc::clone(&map), 0, 10).unwrap();
    let first = d.register_host(&first).unwrap();
    assert_eq!(d.memory_info().pinned_host, 2 * REGISTER_ALIGN as u64);
    // Owned memory is not registered in place; nor is a registered view.
    for owned in [HostBuffer::pageable_from(&[1, 2, 3]), view.clone()] {
        let err = d.register_host(&owned).unwrap_err();
        assert!(
            matches!(err, CoreError::HostRegisterUnsupported { .. }),
            "{err}"
        );
    }
    // Over the pinned limit: the ledger's typed error, nothing registered.
    let small = device(REGISTER_ALIGN as u64 / 2, 1e9);
    let err = small.register_host(&buffer).unwrap_err();
    assert!(matches!(err, CoreError::PinnedLimit { .. }), "{err}");
    assert_eq!(small.memory_info().pinned_host, 0);
    // Copies from the view are pinned copies (asynchronous): they land after the link time.
    let slow = device(1 << 20, 1_000.0);
    let src = slow.register_host(&buffer).unwrap();
    let dst = slow.alloc(100).unwrap();
    let copy = slow.create_stream().unwrap();
    slow.copy_h2d(&src.slice_all(), &dst.slice_all(), &copy)
        .unwrap();
    let done = slow.record_event(&copy).unwrap();
    assert!(!slow.event_complete(&done).unwrap(), "the copy blocked");
    slow.synchronize_event(&done).unwrap();
    assert_eq!(
        download(&*slow, &dst.slice_all(), &copy).unwrap(),
        buffer.with_bytes(<[u8]>::to_vec)
    );
    // Unregistered with the last handle; the range can be registered again.
    drop((view, first));
    assert_eq!(d.memory_info().pinned_host, 0);
    let again = d.register_host(&overlapping).unwrap();
    drop(again);
    assert_eq!(d.memory_info().pinned_host, 0);
    drop(segs);
}

/// Builds a register-mode engine over `segs` (one unit) and returns its figures.
fn figures_of(segs: &[Vec<Arc<Param>>], unit_bytes: u64) -> ddo_core::streaming::StreamingFigures {
    let d = device(1 << 20, 1e9);
    let schedule: Vec<usize> = (0..segs.len()).collect();
    let mut engine = StreamingEngine::new(
        d.clone(),
        d.create_stream().unwrap(),
        segs,
        &schedule,
        &StreamingConfig {
            unit_bytes,
            pinned_source: PinnedSource::Register,
            ..StreamingConfig::default()
        },
        Arc::new(RouteMetrics::new()),
    )
    .unwrap();
    let f = engine.figures().clone();
    engine.teardown().unwrap();
    f
}

#[test]
fn params_adjacent_in_the_file_and_in_the_unit_are_copied_together() {
    let dir = TempDir::new();
    // A "bias" of 64 f32 (256 B) stored before its "weight" of 1024 f32, as safetensors
    // sorts them, and two more tensors after: one unit, one copy.
    let (segs, _) = segments(
        &dir.0,
        &[
            vec![(1024, true), (64, true)],
            vec![(128, true), (192, true)],
        ],
        &[1, 0, 2, 3],
    );
    let f = figures_of(&segs, 1 << 20);
    assert_eq!(f.units, 1);
    assert!(
        matches!(
            f.staging,
            StagingKind::Registered {
                registrations: 1,
                home_bytes: 0,
                ..
            }
        ),
        "{:?}",
        f.staging
    );
    assert_eq!(f.copies_per_forward, 1, "{f:?}");
    assert_eq!(f.streamed_bytes, (1024 + 64 + 128 + 192) * 4);

    // A 100-byte bias is padded to 256 B in the unit but not in the file: two copies.
    let dir = TempDir::new();
    let (segs, _) = segments(&dir.0, &[vec![(1024, true), (25, true)]], &[1, 0]);
    assert_eq!(figures_of(&segs, 1 << 20).copies_per_forward, 2);

    // Owned params go to a home of their own: one more copy for the owned run.
    let dir = TempDir::new();
    let (segs, _) = segments(
        &dir.0,
        &[
            vec![(1024, true), (64, false)],
            vec![(128, true), (30, false)],
        ],
        &[0, 1],
    );
    let f = figures_of(&segs, 1 << 20);
    let StagingKind::Registered {
        registrations,
        home_bytes,
        ..
    } = f.staging
    else {
        panic!("{:?}", f.staging)
    };
    assert_eq!(registrations, 1);
    // The two owned params, kept at their distance in the unit: 256 B + 120 B.
    assert_eq!(home_bytes, 512);
    assert_eq!(f.copies_per_forward, 2);
    assert!(segs[0][1].host().buffer().kind() == HostMemoryKind::Pageable);
}

#[test]
fn a_device_that_refuses_the_registration_gets_a_pinned_home() {
    let dir = TempDir::new();
    let (segs, _) = segments(&dir.0, &[vec![(1000, true)], vec![(500, true)]], &[0, 1]);
    let d = device(1 << 20, 1e9);
    // The whole mapping the params point into is registered already: the engine's
    // registration overlaps it.
    let map = Arc::clone(segs[0][0].host().mapped_range().unwrap().0);
    let whole = d
        .register_host(&HostBuffer::mapped(Arc::clone(&map), 0, map.len()).unwrap())
        .unwrap();
    let held = d.memory_info().pinned_host;
    let metrics = Arc::new(RouteMetrics::new());
    let mut engine = StreamingEngine::new(
        d.clone(),
        d.create_stream().unwrap(),
        &segs,
        &[0, 1],
        &StreamingConfig {
            pinned_source: PinnedSource::Register,
            ..StreamingConfig::default()
        },
        metrics.clone(),
    )
    .unwrap();
    let f = engine.figures().clone();
    assert_eq!(f.staging, StagingKind::PinnedHome);
    let reason = f.register_fallback.clone().expect("a fallback reason");
    assert!(reason.contains("overlap"), "{reason}");
    assert_eq!(d.memory_info().pinned_host, held + f.pinned_bytes);
    metrics.set_streaming_host(f.host_metrics());
    assert_eq!(metrics.counters().register_fallbacks, 1);
    engine.teardown().unwrap();
    assert_eq!(d.memory_info().pinned_host, held);
    drop(whole);
    assert_eq!(d.memory_info().pinned_host, 0);
}

#[test]
fn over_the_limit_registration_falls_back_like_the_home_does() {
    let dir = TempDir::new();
    // 4000 B, then 200 kB that are never streamed, then 2000 B: the registration covers a
    // block at each end of the file, far more than a home of the 6 kB streamed.
    let (segs, _) = segments(
        &dir.0,
        &[vec![(1000, true)], vec![(50_000, true)], vec![(500, true)]],
        &[0, 1, 2],
    );
    let build = |limit: u64, staging: StagingMode| {
        let d = device(1 << 20, 1e9);
        let r = StreamingEngine::new(
            d.clone(),
            d.create_stream().unwrap(),
            &segs,
            &[0, 2],
            &StreamingConfig {
                unit_bytes: 2048,
                pinned_limit: limit,
                staging,
                pinned_source: PinnedSource::Register,
                ..StreamingConfig::default()
            },
            Arc::new(RouteMetrics::new()),
        );
        (r, d)
    };
    // Two units of 4000 and 2000 B, aligned.
    let home: u64 = 4096 + 2048;
    // Neither fits and a home is required: the typed error, nothing pinned, the params
    // still mapped.
    let (r, d) = build(home - 1, StagingMode::PinnedHome);
    assert!(matches!(r, Err(CoreError::PinnedLimit { .. })));
    assert_eq!(d.memory_info().pinned_host, 0);
    assert!(segs.iter().flatten().all(|p| p.is_checkpoint_backed()));
    // Neither fits under Auto: the bounded staging ring.
    let (r, _d) = build(home - 1, StagingMode::Auto);
    assert!(matches!(
        r.unwrap().figures().staging,
        StagingKind::Ring { .. }
    ));
    let (r, _d) = build(1 << 20, StagingMode::Auto);
    let f = r.unwrap().figures().clone();
    let StagingKind::Registered {
        registrations,
        registered_bytes,
        home_bytes: 0,
        staged_bytes: 0,
    } = f.staging
    else {
        panic!("{:?}", f.staging)
    };
    assert_eq!(registrations, 2);
    assert!(
        registered_bytes > REGISTER_ALIGN as u64 && registered_bytes < 3 * REGISTER_ALIGN as u64
    );
    // Below the registered bytes but above the home: the home, saying why.
    let (r, _d) = build(registered_bytes - 1, StagingMode::Auto);
    let f = r.unwrap().figures().clone();
    assert_eq!(f.staging, StagingKind::PinnedHome);
    assert!(f.register_fallback.unwrap().contains("pinned room"));
}

#[test]
fn params_beside_registered_ranges_are_read_where_a_copy_is_allowed() {
    // In the file: a (160,000 B), b (streamed), c (64 B), d (streamed). The engine streams
    // b and d only; their registered spans, rounded out to 64 KiB blocks, reach into a and
    // cover c whole (the two spans merge over it).
    let dir = TempDir::new();
    let (segs, _) = segments(
        &dir.0,
        &[
            vec![(40_000, true)],
            vec![(40_000, true)],
            vec![(16, true)],
            vec![(40_000, true)],
        ],
        &[0, 1, 2, 3],
    );
    let d = device(1 << 24, 1e9);
    let streamed = vec![segs[1].clone(), segs[3].clone()];
    let mut engine = StreamingEngine::new(
        d.clone(),
        d.create_stream().unwrap(),
        &streamed,
        &[0, 1],
        &StreamingConfig {
            pinned_source: PinnedSource::Register,
            ..StreamingConfig::default()
        },
        Arc::new(RouteMetrics::new()),
    )
    .unwrap();
    assert!(matches!(
        engine.figures().staging,
        StagingKind::Registered { .. }
    ));
    let s = d.compute_stream();
    let (a, c) = (&segs[0][0], &segs[2][0]);
    for (p, kind) in [(a, HostMemoryKind::Pageable), (c, HostMemoryKind::Pinned)] {
        let dst = d.alloc(p.nbytes()).unwrap();
        if kind == HostMemoryKind::Pageable {
            // Straight from the partly page-locked mapping: refused, as CUDA refuses it.
            let err = d.copy_h2d(&p.host(), &dst.slice_all(), &s).unwrap_err();
            assert!(
                matches!(&err, CoreError::Backend { message, .. } if message.contains("partly page-locked")),
                "{err}"
            );
        }
        let src = engine.host_source(p).unwrap();
        assert_eq!(src.buffer().kind(), kind, "{}", p.name());
        d.copy_h2d(&src, &dst.slice_all(), &s).unwrap();
        assert_eq!(
            download(&*d, &dst.slice_all(), &s).unwrap(),
            p.host().to_vec(),
            "{}",
            p.name()
        );
    }
    // A streamed param reads its own bytes (the engine copies it through the view).
    assert!(engine.host_source(&segs[1][0]).is_ok());
    engine.teardown().unwrap();
    // Once unregistered (the device unpins what teardown handed back), the mapping is
    // plain again.
    after_release(&*d);
    assert_eq!(
        engine.host_source(a).unwrap().buffer().kind(),
        HostMemoryKind::CheckpointMapped
    );
    let dst = d.alloc(a.nbytes()).unwrap();
    d.copy_h2d(&a.host(), &dst.slice_all(), &s).unwrap();
    d.synchronize().unwrap();
}

#[test]
fn resident_params_are_uploaded_from_their_own_page_locked_ranges_once() {
    let dir = TempDir::new();
    // Eight segments of two 96 KiB params, all mapped: no two share a registration block.
    let sizes: Vec<Vec<(usize, bool)>> = (0..8).map(|_| vec![(24 << 10, true); 2]).collect();
    let file_order: Vec<usize> = (0..16).collect();
    let (segs, _path) = segments(&dir.0, &sizes, &file_order);
    let d = device(1 << 30, 2e9);
    let seg_bytes = 2 * (96 << 10) as u64;
    let config = StreamingConfig {
        unit_bytes: seg_bytes,
        ring_slots: 2,
        pinned_limit: 1 << 30,
        staging: StagingMode::Auto,
        // Half the segments resident beside a two-slot ring.
        budget: Some(4 * seg_bytes + 2 * seg_bytes),
        pinned_source: PinnedSource::Register,
        timeline: false,
        compress: ddo_core::Compression::None,
        page_cache_limit: None,
        lossless_if_home_fits: false,
        copy_ahead: true,
    };
    let schedule: Vec<usize> = (0..8).collect();
    let dev: Arc<dyn Device> = d.clone();
    let metrics = Arc::new(RouteMetrics::new());
    let mut engine = StreamingEngine::new(
        dev,
        d.create_stream().unwrap(),
        &segs,
        &schedule,
        &config,
        metrics.clone(),
    )
    .unwrap();
    let f = engine.figures().clone();
    assert!(f.resident_bytes > 0 && f.streamed_bytes > 0, "{f:?}");
    // Every param is in a registration: the resident ones beside streamed neighbours
    // widened the streamed ranges (contiguous tensors share blocks), any others have
    // ranges of their own until their upload.
    let StagingKind::Registered {
        registered_bytes, ..
    } = f.staging
    else {
        panic!("{f:?}");
    };
    assert!(
        registered_bytes + f.resident_registered_bytes >= f.resident_bytes + f.streamed_bytes,
        "{f:?}"
    );
    assert_eq!(
        d.memory_info().pinned_host,
        f.pinned_bytes + f.resident_registered_bytes
    );
    let want = expected(&segs, &schedule);
    let outputs: Vec<DeviceBuffer> = want.iter().map(|w| d.alloc(w.len()).unwrap()).collect();
    let lag = (d.alloc_pinned(1 << 16).unwrap(), d.alloc(1 << 16).unwrap());
    for _ in 0..2 {
        let got = forward(&d, &mut engine, &segs, &schedule, &outputs, Some(&lag)).unwrap();
        assert_eq!(got, want);
        d.synchronize().unwrap();
        assert_eq!(
            d.memory_info().pinned_host,
            f.pinned_bytes + (1 << 16),
            "only what streams stays registered after the upload"
        );
    }
    assert_eq!(
        metrics.counters().h2d_bytes,
        f.resident_bytes + 2 * f.streamed_bytes + engine.copied_ahead_unconsumed().0,
        "resident params crossed once"
    );
    // Issue 35: once uploaded, the resident params' file pages left the process: their
    // whole pages (a partial page at each end of a param stays).
    assert_eq!(
        f.host_bytes_released, 0,
        "nothing released before the upload"
    );
    let released = engine.figures().host_bytes_released;
    let resident_params = engine.resident_params().len() as u64;
    assert!(
        released <= f.resident_bytes && released >= f.resident_bytes - 2 * 4096 * resident_params,
        "released {released} of {}",
        f.resident_bytes
    );
    for p in segs.iter().flatten() {
        assert!(p.is_checkpoint_backed(), "{}", p.name());
    }
    engine.teardown().unwrap();
    drop((engine, outputs, lag));
    assert_eq!(after_release(&*d).pinned_host, 0);
}

#[test]
fn upload_registrations_page_lock_mapped_params_for_one_upload_or_nothing() {
    use ddo_core::residency::UploadRegistrations;
    let dir = TempDir::new();
    let sizes = vec![vec![
        (24 << 10, true),
        (300, false),
        (5000, true),
        (24 << 10, true),
    ]];
    let (segs, _path) = segments(&dir.0, &sizes, &[2, 0, 1]);
    let params = &segs[0];
    let d = device(1 << 30, 2e9);
    let uploads = UploadRegistrations::register(&*d, params).unwrap();
    assert!(uploads.bytes() > 0);
    assert_eq!(d.memory_info().pinned_host, uploads.bytes());
    for p in params {
        let src = uploads.source(p).unwrap();
        let expected = if p.is_checkpoint_backed() {
            HostMemoryKind::Pinned
        } else {
            HostMemoryKind::Pageable
        };
        assert_eq!(src.kind(), expected, "{}", p.name());
        assert_eq!(src.to_vec(), p.host().to_vec(), "{}", p.name());
    }
    drop(uploads);
    assert_eq!(d.memory_info().pinned_host, 0);
    // No room under the pinned limit: nothing registered, every param read where it is.
    let tight = device(4096, 2e9);
    let none = UploadRegistrations::register(&*tight, params).unwrap();
    assert_eq!((none.bytes(), tight.memory_info().pinned_host), (0, 0));
    for p in params {
        assert_ne!(uploads_kind(&none, p), HostMemoryKind::Pinned);
    }
}

fn uploads_kind(u: &ddo_core::residency::UploadRegistrations, p: &Param) -> HostMemoryKind {
    u.source(p).unwrap().kind()
}

#[test]
fn resident_only_ranges_are_handed_back_after_the_first_upload_in_schedule_order() {
    // Four big resident segments first in the file (their ranges registered for the first
    // upload only) and twelve small streamed ones after them, interleaved in the schedule:
    // the first forward uploads each resident segment between the streamed units, reads
    // every position's own bytes, and hands the resident-only ranges back to the device
    // (`Device::release_host`: the host backend unpins them at once); later forwards read
    // the same bytes, and teardown hands back the rest.
    let dir = TempDir::new();
    let mut sizes: Vec<Vec<(usize, bool)>> = (0..4).map(|_| vec![(48 << 10, true); 2]).collect();
    // Segment 4 is never scheduled: 512 KiB of file between the two kinds of range.
    sizes.push(vec![(128 << 10, true)]);
    sizes.extend((0..12).map(|_| vec![(4 << 10, true)]));
    let file_order: Vec<usize> = (0..21).collect();
    let (segs, _path) = segments(&dir.0, &sizes, &file_order);
    let d = device(1 << 30, 2e8);
    let big = 2 * (192 << 10) as u64;
    let small = (16 << 10) as u64;
    let config = StreamingConfig {
        unit_bytes: small,
        ring_slots: 2,
        pinned_limit: 1 << 30,
        staging: StagingMode::Auto,
        budget: Some(4 * big + 2 * small),
        pinned_source: PinnedSource::Register,
        timeline: false,
        compress: ddo_core::Compression::None,
        page_cache_limit: None,
        lossless_if_home_fits: false,
        copy_ahead: true,
    };
    // The big segments interleaved with the small ones in the schedule.
    let schedule: Vec<usize> = vec![0, 5, 6, 7, 1, 8, 9, 10, 2, 11, 12, 13, 3, 14, 15, 16];
    let dev: Arc<dyn Device> = d.clone();
    let mut engine = StreamingEngine::new(
        dev,
        d.create_stream().unwrap(),
        &segs,
        &schedule,
        &config,
        Arc::new(RouteMetrics::new()),
    )
    .unwrap();
    let f = engine.figures().clone();
    assert_eq!(f.resident_segments, 4, "{f:?}");
    assert!(f.resident_registered_bytes > 0, "{f:?}");
    let lag_bytes = 1 << 16;
    let want = expected(&segs, &schedule);
    let outputs: Vec<DeviceBuffer> = want.iter().map(|w| d.alloc(w.len()).unwrap()).collect();
    let lag = (
        d.alloc_pinned(lag_bytes).unwrap(),
        d.alloc(lag_bytes).unwrap(),
    );
    // Pinned and not kept for reuse after `release_host`.
    let pinned = || {
        let m = d.memory_info();
        m.pinned_host - m.pinned_cached
    };
    let got = forward(&d, &mut engine, &segs, &schedule, &outputs, Some(&lag)).unwrap();
    assert_eq!(got, want);
    assert_eq!(
        pinned(),
        f.pinned_bytes + lag_bytes as u64,
        "the resident-only ranges were not handed back after their upload"
    );
    let got = forward(&d, &mut engine, &segs, &schedule, &outputs, Some(&lag)).unwrap();
    assert_eq!(got, want);
    engine.teardown().unwrap();
    drop((engine, outputs, lag));
    assert_eq!(pinned(), 0);
}

/// Issue 35: a pinned limit under both every registered range and a pinned home registers
/// the first units (file order) and copies the rest through two staging buffers: all within
/// the limit, the outputs those of a full registration, every streamed byte copied each
/// forward, and at teardown nothing stays pinned.
#[test]
fn a_limit_under_the_home_registers_the_first_units_and_stages_the_rest() {
    let dir = TempDir::new();
    // Six params of 150,000 B in six units, one after another in the file.
    let sizes: Vec<Vec<(usize, bool)>> = (0..6).map(|_| vec![(37_500, true)]).collect();
    let schedule: Vec<usize> = (0..6).collect();
    let (segs, _) = segments(&dir.0, &sizes, &schedule);
    let limit = 600_000u64;
    let d = device(limit + (1 << 16), 1e9);
    let metrics = Arc::new(RouteMetrics::new());
    let mut engine = StreamingEngine::new(
        d.clone(),
        d.create_stream().unwrap(),
        &segs,
        &schedule,
        &StreamingConfig {
            unit_bytes: 150_016,
            pinned_limit: limit,
            pinned_source: PinnedSource::Register,
            copy_ahead: true,
            ..StreamingConfig::default()
        },
        metrics.clone(),
    )
    .unwrap();
    let f = engine.figures().clone();
    let StagingKind::Registered {
        registrations,
        registered_bytes,
        home_bytes: 0,
        staged_bytes,
    } = f.staging
    else {
        panic!("{:?}", f.staging)
    };
    assert_eq!(registrations, 1, "{f:?}");
    assert!((150_000..300_000).contains(&registered_bytes), "{f:?}");
    assert_eq!(staged_bytes, 5 * 150_016, "{f:?}");
    assert_eq!(f.staging.staging_buffers(), 2);
    assert!(f.pinned_bytes <= limit, "{f:?}");
    assert_eq!(d.memory_info().pinned_host, f.pinned_bytes);
    let want = expected(&segs, &schedule);
    let outputs: Vec<DeviceBuffer> = want.iter().map(|w| d.alloc(w.len()).unwrap()).collect();
    let lag = (d.alloc_pinned(1 << 16).unwrap(), d.alloc(1 << 16).unwrap());
    for i in 0..3 {
        let got = forward(&d, &mut engine, &segs, &schedule, &outputs, Some(&lag)).unwrap();
        assert_eq!(got, want, "forward {i}");
    }
    // The registered first unit is copied ahead for a fourth forward; the staged ones
    // never are.
    let (ahead_bytes, ahead_copies) = engine.copied_ahead_unconsumed();
    assert_eq!(ahead_bytes, 150_000);
    assert_eq!(
        metrics.counters().h2d_bytes,
        3 * f.streamed_bytes + ahead_bytes
    );
    assert_eq!(f.streamed_bytes, 150_000 + 5 * 150_016);
    assert_eq!(
        metrics.counters().h2d_copies,
        3 * f.copies_per_forward + ahead_copies
    );
    engine.teardown().unwrap();
    drop(lag);
    assert_eq!(after_release(&*d).pinned_host, 0);
    assert!(segs.iter().flatten().all(|p| p.is_checkpoint_backed()));
}
