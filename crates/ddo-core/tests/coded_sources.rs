//! The streaming engine over weights coded in their files (`ddo convert --compress
//! lossless`, issue 35) on the host backend: whatever the mix of coded matrices and plain
//! params (biases, matrices that did not shrink), the unit size, the budget and the pinned
//! limit, every schedule position reads exactly its params' decoded bytes. With room for
//! the coded home, the coded params' units are copied as they are (the link carries fewer
//! bytes than the weights); without it, `compress=lossless` asked for is refused with a
//! typed error, and the default over coded files (`lossless_if_home_fits`) stages the units
//! uncoded instead, within the pinned limit.

mod engine_common;

use engine_common::{expected, forward};
use std::sync::Arc;

use ddo_core::streaming::{StagingKind, StagingMode, StreamingConfig, StreamingEngine};
use ddo_core::{Checkpoint, CoreError, Device, DeviceBuffer, Param, ParamKind};
use ddo_host::{HostDevice, HostDeviceConfig};
use ddo_metrics::RouteMetrics;
use proptest::prelude::*;

/// One param of a segment: its rows and columns of bf16 words, and whether its words
/// compress (N(0, 0.02)-like) or are random bits (stored as they are by the converter).
#[derive(Debug, Clone)]
struct Spec {
    rows: usize,
    cols: usize,
    compressible: bool,
}

/// bf16 words: N(0, 0.02)-like (few exponents) or uniformly random bits.
fn words(n: usize, seed: u64, compressible: bool) -> Vec<u8> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .flat_map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let w = if compressible {
                let u = (s >> 11) as f64 / (1u64 << 53) as f64;
                let v = ((u - 0.5) * 0.04) as f32;
                (v.to_bits() >> 16) as u16
            } else {
                // Finite: the exponent below all ones.
                ((s >> 20) as u16) & 0x7f7f
            };
            w.to_le_bytes()
        })
        .collect()
}

/// The segments' params as one safetensors file of bf16 tensors, converted by
/// `ddo_core::coded_file` into `dir`, and read back as checkpoint params.
fn coded_segments(dir: &std::path::Path, specs: &[Vec<Spec>]) -> Vec<Vec<Arc<Param>>> {
    let mut header = String::from("{");
    let mut data = Vec::new();
    for (s, seg) in specs.iter().enumerate() {
        for (i, p) in seg.iter().enumerate() {
            let start = data.len();
            data.extend(words(
                p.rows * p.cols,
                (s * 31 + i) as u64 + 1,
                p.compressible,
            ));
            if header.len() > 1 {
                header.push(',');
            }
            let shape = if p.rows == 1 {
                format!("[{}]", p.cols)
            } else {
                format!("[{},{}]", p.rows, p.cols)
            };
            header.push_str(&format!(
                "\"s{s}.p{i}\":{{\"dtype\":\"BF16\",\"shape\":{shape},\"data_offsets\":[{start},{}]}}",
                data.len()
            ));
        }
    }
    header.push('}');
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&data);
    let raw = dir.join("raw.safetensors");
    std::fs::write(&raw, bytes).unwrap();
    let coded = dir.join("coded.safetensors");
    let mut file = std::fs::File::create_new(&coded).unwrap();
    ddo_core::coded_file::write_coded_safetensors(&raw, &mut file, &coded).unwrap();
    drop(file);
    let ckpt = Checkpoint::open(&coded).unwrap();
    specs
        .iter()
        .enumerate()
        .map(|(s, seg)| {
            (0..seg.len())
                .map(|i| {
                    let name = format!("s{s}.p{i}");
                    Param::from_checkpoint(&ckpt, &name, &name, ParamKind::Parameter).unwrap()
                })
                .collect()
        })
        .collect()
}

#[derive(Debug, Clone)]
struct Case {
    specs: Vec<Vec<Spec>>,
    schedule: Vec<usize>,
    unit_bytes: u64,
    pinned_limit: u64,
    budget_fraction: Option<f64>,
    /// The default over coded files (gives way when the home does not fit), or asked for.
    by_default: bool,
    /// Staged units past this many bytes are read from the disk each forward (`pread`, the
    /// disk tier; coded ones decoded from what was read).
    page_cache_limit: Option<u64>,
}

/// How a case ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// The coded units streamed from the coded home.
    Coded,
    /// Streamed uncoded (staged or from a home).
    Uncoded,
    /// Everything resident under the budget.
    Resident,
    /// `compress=lossless` asked for and refused (`CodedPinnedLimit`).
    Refused,
}

fn run_case(case: &Case) -> Result<Outcome, TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let segs = coded_segments(dir.path(), &case.specs);
    let coded_params = segs
        .iter()
        .flatten()
        .filter(|p| p.host().coded_source().is_some())
        .count();
    let d = HostDevice::new(HostDeviceConfig {
        capacity: 1 << 28,
        pinned_limit: case.pinned_limit,
        ..HostDeviceConfig::default()
    })
    .unwrap();
    let aligned = |p: &Arc<Param>| (p.nbytes() as u64).div_ceil(256) * 256;
    let total: u64 = segs.iter().flatten().map(aligned).sum();
    let largest: u64 = segs
        .iter()
        .map(|s| s.iter().map(aligned).sum::<u64>())
        .max()
        .unwrap_or(0);
    let slot = largest.max(case.unit_bytes.div_ceil(256).min(total.div_ceil(256)) * 256);
    let ring_room = 3 * slot + ddo_core::streaming::coded_ring_bytes(slot) + (1 << 12);
    let config = StreamingConfig {
        unit_bytes: case.unit_bytes,
        ring_slots: 3,
        pinned_limit: case.pinned_limit,
        staging: StagingMode::Auto,
        budget: case
            .budget_fraction
            .map(|f| (total as f64 * f) as u64 + ring_room),
        compress: ddo_core::Compression::Lossless,
        lossless_if_home_fits: case.by_default,
        copy_ahead: true,
        page_cache_limit: case.page_cache_limit,
        ..StreamingConfig::default()
    };
    let metrics = Arc::new(RouteMetrics::new());
    let copy = d.create_stream().unwrap();
    let dev: Arc<dyn Device> = d.clone();
    let mut engine =
        match StreamingEngine::new(dev, copy, &segs, &case.schedule, &config, metrics.clone()) {
            Ok(e) => e,
            // Asked for and over the pinned room: the typed refusal, nothing pinned.
            Err(CoreError::CodedPinnedLimit { .. }) if !case.by_default => {
                prop_assert_eq!(d.memory_info().pinned_host, 0);
                return Ok(Outcome::Refused);
            }
            Err(e) => return Err(TestCaseError::fail(format!("{e}"))),
        };
    let f = engine.figures().clone();
    prop_assert!(f.pinned_bytes <= case.pinned_limit, "{f:?}");
    let coded = matches!(f.staging, StagingKind::Coded { .. });
    if let StagingKind::Coded { coded_bytes, .. } = f.staging {
        // The units as they are in the file: never more than the weights plus a header
        // a run; fewer where any param was coded and streams.
        prop_assert!(
            coded_bytes <= f.streamed_bytes + 256 * f.units as u64,
            "{f:?}"
        );
    } else if f.units > 0 {
        // Only the default gives way, and only where the coded home does not fit.
        prop_assert!(case.by_default, "asked for lossless, got {:?}", f.staging);
    }
    let want = expected(&segs, &case.schedule);
    // The params read back through their coded buffers are the words written.
    for (s, seg) in case.specs.iter().enumerate() {
        for (i, p) in seg.iter().enumerate() {
            prop_assert!(
                segs[s][i].host().to_vec()
                    == words(p.rows * p.cols, (s * 31 + i) as u64 + 1, p.compressible),
                "s{}.p{} reads back other words",
                s,
                i
            );
        }
    }
    let outputs: Vec<DeviceBuffer> = want.iter().map(|w| d.alloc(w.len()).unwrap()).collect();
    for i in 0..2 {
        let got = forward(&d, &mut engine, &segs, &case.schedule, &outputs, None)
            .map_err(|e| TestCaseError::fail(format!("{e}")))?;
        prop_assert!(
            got == want,
            "forward {}: a position read other bytes ({} coded params, coded home: {})",
            i,
            coded_params,
            coded
        );
    }
    engine.teardown().unwrap();
    drop(engine);
    drop(outputs);
    prop_assert_eq!(d.memory_info().allocated, 0);
    prop_assert_eq!(d.memory_info().pinned_host, 0);
    Ok(match (coded, f.units) {
        (true, _) => Outcome::Coded,
        (false, 0) => Outcome::Resident,
        (false, _) => Outcome::Uncoded,
    })
}

fn spec() -> impl Strategy<Value = Spec> {
    (
        prop::sample::select(vec![1usize, 4, 16, 64]),
        prop::sample::select(vec![8usize, 64, 512, 1024]),
        prop::bool::weighted(0.8),
    )
        .prop_map(|(rows, cols, compressible)| Spec {
            rows,
            cols,
            compressible,
        })
}

fn case_strategy() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(prop::collection::vec(spec(), 1..4), 2..7),
        prop::collection::vec(0usize..100, 2..10),
        prop::sample::select(vec![1024u64, 16 << 10, 1 << 20]),
        prop::sample::select(vec![4096u64, 64 << 10, 8 << 20]),
        prop::option::of(0.2f64..1.2),
        any::<bool>(),
        prop::option::of(prop::sample::select(vec![0u64, 32 << 10])),
    )
        .prop_map(
            |(
                specs,
                picks,
                unit_bytes,
                pinned_limit,
                budget_fraction,
                by_default,
                page_cache_limit,
            )| {
                let n = specs.len();
                let mut schedule: Vec<usize> = (0..n).collect();
                for (i, p) in picks.iter().enumerate() {
                    if i < n {
                        schedule.swap(i, p % n);
                    } else {
                        schedule.push(p % n);
                    }
                }
                Case {
                    specs,
                    schedule,
                    unit_bytes,
                    pinned_limit,
                    budget_fraction,
                    by_default,
                    page_cache_limit,
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn every_position_reads_its_decoded_bytes_coded_or_staged(case in case_strategy()) {
        run_case(&case)?;
    }
}

/// Both sides of the pinned limit, deterministically: a home that fits streams coded; one
/// that does not is refused when asked for and staged when it was the default.
#[test]
fn the_default_gives_way_to_staging_and_an_explicit_lossless_is_refused() {
    let specs: Vec<Vec<Spec>> = (0..4)
        .map(|_| {
            vec![
                Spec {
                    rows: 64,
                    cols: 512,
                    compressible: true,
                },
                Spec {
                    rows: 1,
                    cols: 64,
                    compressible: true,
                },
            ]
        })
        .collect();
    // The last: staged and read from the disk every forward (the disk tier's `pread`).
    for (pinned_limit, by_default, page_cache_limit, want) in [
        (8 << 20, false, None, Outcome::Coded),
        (8 << 20, true, None, Outcome::Coded),
        (4096, false, None, Outcome::Refused),
        (4096, true, None, Outcome::Uncoded),
        (4096, true, Some(0), Outcome::Uncoded),
    ] {
        let got = run_case(&Case {
            specs: specs.clone(),
            schedule: vec![0, 1, 2, 3, 1],
            unit_bytes: 16 << 10,
            pinned_limit,
            budget_fraction: None,
            by_default,
            page_cache_limit,
        })
        .unwrap_or_else(|e| panic!("limit {pinned_limit}, default {by_default}: {e}"));
        assert_eq!(got, want, "limit {pinned_limit}, default {by_default}");
    }
}
