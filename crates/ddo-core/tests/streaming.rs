//! The streaming engine on the host backend: every schedule position reads exactly its
//! params' bytes (compute waits for each unit's copy, and no slot is refilled before the
//! compute that reads it has run), budgets and pinned limits hold exactly, and the device
//! peak is resident weights plus the ring.
//!
//! The "kernels" here are device-to-device copies queued on the compute stream behind a
//! slow pinned copy, so compute runs well behind the host: a refill that did not wait for
//! compute's use event would land before the kernel read the slot, and a kernel that did
//! not wait for its unit's copy would read the slot before the copy landed. Either shows
//! as wrong bytes.

mod engine_common;

use engine_common::{expected, forward};
use std::collections::HashSet;
use std::sync::Arc;

use ddo_core::streaming::{
    PinnedSource, StagingKind, StagingMode, StreamingConfig, StreamingEngine,
};
use ddo_core::{CoreError, DType, Device, DeviceBuffer, Param, ParamKind};
use ddo_host::{HostDevice, HostDeviceConfig};
use ddo_metrics::RouteMetrics;
use proptest::prelude::*;

/// A device whose copies take time (bytes / `link` seconds).
fn device(capacity: u64, pinned_limit: u64, link: f64) -> Arc<HostDevice> {
    HostDevice::new(HostDeviceConfig {
        capacity,
        pinned_limit,
        link_bytes_per_sec: Some(link),
        ..HostDeviceConfig::default()
    })
    .unwrap()
}

/// Segments of params with `sizes[s][i]` f32 elements, values unique per param.
fn segments(sizes: &[Vec<usize>]) -> Vec<Vec<Arc<Param>>> {
    let mut next = 1.0f32;
    sizes
        .iter()
        .enumerate()
        .map(|(s, params)| {
            params
                .iter()
                .enumerate()
                .map(|(i, &n)| {
                    let values: Vec<f32> = (0..n).map(|k| next + k as f32 / 1024.0).collect();
                    next += 1.0;
                    Param::from_f32(
                        format!("s{s}.p{i}"),
                        ParamKind::Parameter,
                        DType::F32,
                        vec![n],
                        &values,
                    )
                    .unwrap()
                })
                .collect()
        })
        .collect()
}

#[derive(Debug, Clone)]
struct Case {
    sizes: Vec<Vec<usize>>,
    schedule: Vec<usize>,
    unit_bytes: u64,
    slots: usize,
    staging: StagingMode,
    pinned_limit: u64,
    budget_fraction: Option<f64>,
    /// With owned params, `Register` stages everything in the engine's home for the
    /// params that are not mapped (`tests/register.rs` covers mapped ones).
    pinned_source: PinnedSource,
    /// `copy_ahead`: forwards from the second keep the ring and copy the next one's first
    /// units ahead.
    copy_ahead: bool,
}

fn run_case(case: &Case) -> Result<(), TestCaseError> {
    let segs = segments(&case.sizes);
    // Room beside the engine's limit for the lag buffer.
    let d = device(1 << 26, case.pinned_limit + (1 << 16), 2e8);
    let aligned = |p: &Arc<Param>| (p.nbytes() as u64).div_ceil(256) * 256;
    let total: u64 = segs.iter().flatten().map(aligned).sum();
    let largest: u64 = segs
        .iter()
        .map(|s| s.iter().map(aligned).sum::<u64>())
        .max()
        .unwrap_or(0);
    // Always feasible: everything streamed fits in the ring part of the budget.
    let ring_room = case.slots as u64
        * largest.max(case.unit_bytes.div_ceil(256).min(total.div_ceil(256)) * 256);
    let before_checksums: Vec<u64> = segs.iter().flatten().map(|p| p.host_checksum()).collect();
    let config = StreamingConfig {
        unit_bytes: case.unit_bytes,
        ring_slots: case.slots,
        pinned_limit: case.pinned_limit,
        staging: case.staging,
        budget: case
            .budget_fraction
            .map(|f| (total as f64 * f) as u64 + ring_room),
        pinned_source: case.pinned_source,
        timeline: false,
        compress: ddo_core::Compression::None,
        page_cache_limit: None,
        lossless_if_home_fits: false,
        copy_ahead: case.copy_ahead,
    };
    let metrics = Arc::new(RouteMetrics::new());
    let copy = d.create_stream().unwrap();
    let dev: Arc<dyn Device> = d.clone();
    let mut engine =
        match StreamingEngine::new(dev, copy, &segs, &case.schedule, &config, metrics.clone()) {
            Ok(e) => e,
            // A pinned home that does not fit is refused with nothing changed.
            Err(CoreError::PinnedLimit { .. }) => {
                prop_assert_eq!(d.memory_info().pinned_host, 0);
                prop_assert!(
                    segs.iter()
                        .flatten()
                        .all(|p| !p.host().buffer().is_pinned())
                );
                return Ok(());
            }
            Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
        };
    let f = engine.figures().clone();
    // Pinned bytes: exactly what the engine says, never above the limit.
    prop_assert_eq!(d.memory_info().pinned_host, f.pinned_bytes);
    prop_assert!(f.pinned_bytes <= case.pinned_limit);
    if let Some(budget) = config.budget {
        prop_assert!(f.device_weight_bytes() <= budget, "{f:?} over {budget}");
    }
    let resident: HashSet<_> = engine.resident_params().iter().map(|p| p.id()).collect();
    if f.staging == StagingKind::PinnedHome {
        // One host copy: the home replaced the streamed params' pageable bytes, which
        // were released; the params now read from pinned memory.
        let mut seen = HashSet::new();
        let streamed: u64 = segs
            .iter()
            .flatten()
            .filter(|p| !resident.contains(&p.id()) && seen.insert(p.id()))
            .map(|p| p.nbytes() as u64)
            .sum();
        prop_assert_eq!(f.host_bytes_released, streamed);
        for p in segs.iter().flatten() {
            prop_assert_eq!(p.host().buffer().is_pinned(), !resident.contains(&p.id()));
        }
    }
    let want = expected(&segs, &case.schedule);
    let outputs: Vec<DeviceBuffer> = want.iter().map(|w| d.alloc(w.len()).unwrap()).collect();
    let lag_host = d.alloc_pinned(1 << 16).unwrap();
    let lag = (lag_host, d.alloc(1 << 16).unwrap());
    let pinned_with_lag = d.memory_info().pinned_host;
    for i in 0..3 {
        let before = d.memory_info().allocated;
        let kept_before = engine.keeps_ring();
        d.reset_peak();
        let got = forward(&d, &mut engine, &segs, &case.schedule, &outputs, Some(&lag))
            .map_err(|e| TestCaseError::fail(format!("{e}")))?;
        prop_assert_eq!(&got, &want, "forward {}", i);
        let kept_after = engine.keeps_ring();
        // From the second forward on, a ring copied from pinned memory is kept for the
        // next forward (its leading units copied into it ahead).
        if f.staging == StagingKind::PinnedHome {
            prop_assert_eq!(kept_after, case.copy_ahead && i >= 1, "forward {}", i);
        }
        prop_assert!(!kept_after || (case.copy_ahead && i >= 1));
        let peak = d.memory_info().peak_allocated - before;
        // The first forward makes the resident params resident; every forward takes the
        // ring, or the one the forward before kept. Nothing else is allocated on the way.
        let resident_now = if i == 0 { f.resident_bytes } else { 0 };
        let ring_taken = if kept_before { 0 } else { f.ring_bytes() };
        prop_assert_eq!(peak, resident_now + ring_taken, "forward {}: {:?}", i, f);
        let ring_held = if kept_after && !kept_before {
            f.ring_bytes()
        } else {
            0
        };
        prop_assert_eq!(d.memory_info().allocated, before + resident_now + ring_held);
        prop_assert!(d.memory_info().pinned_host <= pinned_with_lag);
        // Streamed params are host-only between forwards; resident ones stay.
        for p in segs.iter().flatten() {
            prop_assert_eq!(
                p.device().is_some(),
                resident.contains(&p.id()),
                "{}",
                p.name()
            );
        }
    }
    // Every forward copied its streamed bytes once: those copied ahead for a fourth
    // forward are the rest.
    let c = metrics.counters();
    let (ahead_bytes, ahead_copies) = engine.copied_ahead_unconsumed();
    prop_assert_eq!(
        c.h2d_bytes,
        f.resident_bytes + 3 * f.streamed_bytes + ahead_bytes
    );
    if f.staging == StagingKind::PinnedHome {
        prop_assert_eq!(
            c.h2d_copies,
            resident.len() as u64 + 3 * f.units as u64 + ahead_copies
        );
        prop_assert_eq!(engine.units_copied_ahead() > 0, case.copy_ahead);
    }
    engine.teardown().unwrap();
    drop(engine);
    drop(outputs);
    drop(lag);
    prop_assert_eq!(d.memory_info().allocated, 0);
    prop_assert_eq!(d.memory_info().pinned_host, 0);
    let after: Vec<u64> = segs.iter().flatten().map(|p| p.host_checksum()).collect();
    prop_assert_eq!(before_checksums, after, "host bytes changed");
    prop_assert!(segs.iter().flatten().all(|p| p.device().is_none()));
    Ok(())
}

fn case_strategy() -> impl Strategy<Value = Case> {
    let sizes = prop::collection::vec(prop::collection::vec(1usize..200, 1..4), 2..9);
    (
        sizes,
        prop::collection::vec(0usize..100, 2..14),
        prop::sample::select(vec![64u64, 256, 1000, 4096, 1 << 20]),
        2usize..5,
        prop::sample::select(vec![
            StagingMode::Auto,
            StagingMode::PinnedHome,
            StagingMode::Ring,
        ]),
        prop::sample::select(vec![1024u64, 4096, 1 << 20]),
        prop::option::of(0.2f64..1.2),
        prop::sample::select(vec![PinnedSource::Home, PinnedSource::Register]),
        any::<bool>(),
    )
        .prop_map(
            |(
                sizes,
                picks,
                unit_bytes,
                slots,
                staging,
                pinned_limit,
                budget,
                pinned_source,
                copy_ahead,
            )| {
                let n = sizes.len();
                // Every segment once in a shuffled order, then some repeats.
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
                    schedule,
                    unit_bytes,
                    slots,
                    staging,
                    pinned_limit,
                    budget_fraction: budget,
                    pinned_source,
                    copy_ahead,
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn every_position_reads_its_own_bytes_and_budgets_and_limits_hold(case in case_strategy()) {
        run_case(&case)?;
    }
}

#[test]
fn a_tight_ring_on_a_crawling_link_still_reads_every_unit_in_order() {
    // Many small units through 2 slots: every slot is refilled many times per forward.
    let sizes: Vec<Vec<usize>> = (0..12).map(|i| vec![16 + i, 3]).collect();
    for staging in [StagingMode::PinnedHome, StagingMode::Ring] {
        for copy_ahead in [false, true] {
            run_case(&Case {
                sizes: sizes.clone(),
                schedule: (0..12).collect(),
                unit_bytes: 64,
                slots: 2,
                staging,
                pinned_limit: 1 << 20,
                budget_fraction: None,
                pinned_source: PinnedSource::Home,
                copy_ahead,
            })
            .unwrap();
        }
    }
}

#[test]
fn a_pinned_limit_below_the_streamed_bytes_stages_through_bounded_buffers() {
    let segs = segments(&[vec![300], vec![200, 10], vec![256]]);
    let d = device(1 << 24, 1 << 20, 2e8);
    let limit = 1024; // two staging buffers of 512 B: units are split into several copies
    let config = StreamingConfig {
        unit_bytes: 64,
        ring_slots: 2,
        pinned_limit: limit,
        staging: StagingMode::Auto,
        budget: None,
        pinned_source: PinnedSource::Home,
        timeline: false,
        compress: ddo_core::Compression::None,
        page_cache_limit: None,
        lossless_if_home_fits: false,
        copy_ahead: false,
    };
    let dev: Arc<dyn Device> = d.clone();
    let engine = StreamingEngine::new(
        dev,
        d.create_stream().unwrap(),
        &segs,
        &[0, 1, 2],
        &config,
        Arc::new(RouteMetrics::new()),
    )
    .unwrap();
    let f = engine.figures();
    assert_eq!(
        f.staging,
        StagingKind::Ring {
            buffers: 2,
            buffer_bytes: 512
        }
    );
    assert_eq!(d.memory_info().pinned_host, 1024);
    assert!(
        segs.iter()
            .flatten()
            .all(|p| !p.host().buffer().is_pinned())
    );
    // Forcing a pinned home over the limit is a typed error that changes nothing.
    let err = StreamingEngine::new(
        d.clone(),
        d.create_stream().unwrap(),
        &segs,
        &[0, 1, 2],
        &StreamingConfig {
            staging: StagingMode::PinnedHome,
            ..config
        },
        Arc::new(RouteMetrics::new()),
    )
    .unwrap_err();
    assert!(matches!(err, CoreError::PinnedLimit { .. }), "{err}");
    assert_eq!(d.memory_info().pinned_host, 1024);
}

#[test]
fn a_budget_keeps_the_costliest_segments_resident_and_the_ring_fits_beside_them() {
    // Segments of 4000, 400, 400, 400 B (f32 x 1000 / 100): with 2 slots of up to 512 B
    // units, a budget of 4000 + 1024 keeps the big one resident and streams the rest.
    let segs = segments(&[vec![1000], vec![100], vec![100], vec![100]]);
    let d = device(1 << 24, 1 << 20, 2e8);
    let budget = 4096 + 2 * 512;
    let dev: Arc<dyn Device> = d.clone();
    let mut engine = StreamingEngine::new(
        dev,
        d.create_stream().unwrap(),
        &segs,
        &[0, 1, 2, 3],
        &StreamingConfig {
            unit_bytes: 512,
            ring_slots: 2,
            budget: Some(budget),
            ..StreamingConfig::default()
        },
        Arc::new(RouteMetrics::new()),
    )
    .unwrap();
    let f = engine.figures().clone();
    assert_eq!(f.resident_segments, 1);
    assert_eq!(f.resident_bytes, 4000);
    assert_eq!((f.units, f.slot_bytes), (3, 512));
    assert!(f.device_weight_bytes() <= budget);
    assert_eq!(engine.resident_params()[0].name(), "s0.p0");
    // A budget below the ring is refused with a hint.
    let err = StreamingEngine::new(
        d.clone(),
        d.create_stream().unwrap(),
        &segs,
        &[0, 1, 2, 3],
        &StreamingConfig {
            unit_bytes: 512,
            ring_slots: 2,
            budget: Some(4000),
            ..StreamingConfig::default()
        },
        Arc::new(RouteMetrics::new()),
    )
    .unwrap_err();
    assert!(
        matches!(&err, CoreError::InvalidOption { option, hint, .. } if option == "budget" && hint.contains("ring")),
        "{err}"
    );
    engine.teardown().unwrap();
}

#[test]
fn the_first_weight_copies_are_queued_when_the_forward_begins() {
    // Between begin_forward and the first leaf the program prepares and uploads its inputs;
    // the link carries the first units meanwhile. The ring's worth queued at the start is
    // all the first leaf finds, and the forward then reads every unit once.
    let segs = segments(&[vec![300], vec![200, 10], vec![256]]);
    let d = device(1 << 24, 1 << 20, 2e8);
    let config = StreamingConfig {
        unit_bytes: 64,
        ring_slots: 2,
        pinned_limit: 1 << 20,
        staging: StagingMode::PinnedHome,
        budget: None,
        pinned_source: PinnedSource::Home,
        timeline: false,
        compress: ddo_core::Compression::None,
        page_cache_limit: None,
        lossless_if_home_fits: false,
        copy_ahead: false,
    };
    let metrics = Arc::new(RouteMetrics::new());
    let dev: Arc<dyn Device> = d.clone();
    let mut engine = StreamingEngine::new(
        dev,
        d.create_stream().unwrap(),
        &segs,
        &[0, 1, 2],
        &config,
        Arc::clone(&metrics),
    )
    .unwrap();
    let copies = || metrics.counters().h2d_copies;
    let before = copies();
    engine.begin_forward().unwrap();
    let queued = copies() - before;
    assert!(queued >= 1, "begin_forward queued no weight copy");
    assert!(
        (queued as usize) < engine.layout().units().len(),
        "the ring of two slots cannot hold every unit"
    );
    engine.enter(0).unwrap();
    assert_eq!(
        copies() - before,
        queued,
        "the first leaf queued more before any use"
    );
    engine.abort().unwrap();
    d.synchronize().unwrap();
    // A whole forward still reads every unit's bytes, once per unit.
    let outputs: Vec<DeviceBuffer> = [0usize, 1, 2]
        .iter()
        .map(|&s| {
            let n = segs[s].iter().map(|p| p.nbytes()).sum::<usize>();
            d.alloc(n).unwrap()
        })
        .collect();
    let lag = (d.alloc_pinned(1 << 10).unwrap(), d.alloc(1 << 10).unwrap());
    let before = copies();
    let got = forward(&d, &mut engine, &segs, &[0, 1, 2], &outputs, Some(&lag)).unwrap();
    assert_eq!(got, expected(&segs, &[0, 1, 2]));
    let per_forward = copies() - before;
    assert_eq!(per_forward as usize, engine.layout().units().len());
}

#[test]
fn the_first_forward_uploads_resident_params_between_the_units_in_schedule_order() {
    // Even segments are big (resident under the budget), odd ones stream. The first
    // forward queues each resident segment on the copy stream right behind the unit before
    // it, so the link carries bytes in the order compute needs them: after `begin_forward`
    // (units 0 and 1 fill the ring of two) the residents up to the next unit are on the
    // device and the last one is not; the rest arrive as the ring moves on, and compute
    // reads every position's own bytes.
    let segs = segments(&[
        vec![1000],
        vec![100],
        vec![1000],
        vec![100],
        vec![1000],
        vec![100],
        vec![1000],
        vec![100],
    ]);
    let schedule = [0, 1, 2, 3, 4, 5, 6, 7];
    let d = device(1 << 24, 1 << 20, 2e7);
    let dev: Arc<dyn Device> = d.clone();
    let mut engine = StreamingEngine::new(
        dev,
        d.create_stream().unwrap(),
        &segs,
        &schedule,
        &StreamingConfig {
            unit_bytes: 512,
            ring_slots: 2,
            budget: Some(4 * 4096 + 2 * 512),
            staging: StagingMode::PinnedHome,
            pinned_source: PinnedSource::Home,
            ..StreamingConfig::default()
        },
        Arc::new(RouteMetrics::new()),
    )
    .unwrap();
    assert_eq!(engine.figures().resident_segments, 4);
    let on_device = |s: usize| segs[s][0].device().is_some();
    engine.begin_forward().unwrap();
    // The ring holds the units of segments 1 and 3; residents 0, 2 and 4 (up to the next
    // unit, which waits for a slot) are queued; 6 waits for the unit before it.
    assert!(
        (0..5).step_by(2).all(on_device),
        "the residents up to the next unit"
    );
    assert!(
        !on_device(6),
        "a resident segment was queued before the unit before it"
    );
    engine.abort().unwrap();
    d.synchronize().unwrap();
    // An aborted first upload starts over: the next forward reads every position's bytes.
    assert!(
        !on_device(0),
        "an aborted first upload left resident params behind"
    );
    let outputs: Vec<DeviceBuffer> = schedule
        .iter()
        .map(|&s| d.alloc(segs[s].iter().map(|p| p.nbytes()).sum()).unwrap())
        .collect();
    let lag = (d.alloc_pinned(1 << 12).unwrap(), d.alloc(1 << 12).unwrap());
    let got = forward(&d, &mut engine, &segs, &schedule, &outputs, Some(&lag)).unwrap();
    assert_eq!(got, expected(&segs, &schedule));
    assert!(
        (0..8).step_by(2).all(on_device),
        "resident after the forward"
    );
    // The second forward uploads nothing resident again and still reads the same bytes.
    let got = forward(&d, &mut engine, &segs, &schedule, &outputs, Some(&lag)).unwrap();
    assert_eq!(got, expected(&segs, &schedule));
    drop((outputs, lag));
    engine.teardown().unwrap();
    assert_eq!(d.memory_info().allocated, 0);
}
