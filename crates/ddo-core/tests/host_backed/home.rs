//! `PinnedHome` on a host device: built in parallel batches and in chunks, every param held
//! once, sources freed; a chunk that cannot be pinned leaves every param as it was.

use std::sync::Arc;

use ddo_core::streaming::PinnedHome;
use ddo_core::streaming::layout::align_up;
use ddo_core::{CoreError, DType, Device, HostMemoryKind, Param, ParamKind};
use ddo_host::{HostDevice, HostDeviceConfig};

/// `n` f32 params of `elems` values each, named `{tag}{i}`, values unique per param.
fn f32_params(tag: &str, n: usize, elems: usize) -> Vec<Arc<Param>> {
    (0..n)
        .map(|i| {
            let values: Vec<f32> = (0..elems).map(|k| (i * 7 + k % 13) as f32).collect();
            Param::from_f32(
                format!("{tag}{i}"),
                ParamKind::Parameter,
                DType::F32,
                vec![elems],
                &values,
            )
            .unwrap()
        })
        .collect()
}

/// `params` placed one after another, each aligned, and the bytes they take.
fn one_after_another(params: &[Arc<Param>]) -> (Vec<(&Arc<Param>, u64)>, u64) {
    let mut at = 0u64;
    let placements = params
        .iter()
        .map(|p| {
            let here = at;
            at += align_up(p.nbytes() as u64);
            (p, here)
        })
        .collect();
    (placements, at)
}

#[test]
fn a_home_built_in_parallel_batches_holds_every_param_once_and_frees_the_sources() {
    let device = HostDevice::new(HostDeviceConfig {
        capacity: 1 << 20,
        pinned_limit: 1 << 30,
        ..HostDeviceConfig::default()
    })
    .unwrap();
    // 48 params of 1.5 MiB: several batches, several threads per batch.
    let params = f32_params("p", 48, 3 << 17);
    let sums: Vec<u64> = params.iter().map(|p| p.host_checksum()).collect();
    let total: u64 = params.iter().map(|p| p.nbytes() as u64).sum();
    let home = PinnedHome::sequential(&*device, &params, 1 << 30, true)
        .unwrap()
        .unwrap();
    assert_eq!(
        home.host_bytes_released(),
        total,
        "every owned source was freed"
    );
    for (p, sum) in params.iter().zip(&sums) {
        assert_eq!(p.host().kind(), HostMemoryKind::Pinned, "{}", p.name());
        assert_eq!(p.host_checksum(), *sum, "{}", p.name());
    }
    home.restore().unwrap();
    for (p, sum) in params.iter().zip(&sums) {
        assert_eq!(p.host().kind(), HostMemoryKind::Pageable);
        assert_eq!(p.host_checksum(), *sum);
    }
    assert_eq!(device.memory_info().pinned_host, 0);

    // In chunks of about 8 MiB, breaking only between params: the pinned peak grows
    // chunk by chunk while each chunk's sources are freed as it is adopted.
    let (placements, at) = one_after_another(&params);
    let breaks: Vec<u64> = placements.iter().map(|(_, a)| *a).collect();
    let home =
        PinnedHome::build_in_chunks(&*device, placements.clone(), at, &breaks, 8 << 20).unwrap();
    assert_eq!(home.chunks(), 48 / 6, "six 1.5 MiB params make a chunk");
    assert_eq!(home.bytes(), at);
    assert_eq!(device.memory_info().pinned_host, at);
    for ((p, off), sum) in placements.iter().zip(&sums) {
        assert_eq!(p.host_checksum(), *sum);
        assert_eq!(
            home.slice(*off, p.nbytes() as u64).unwrap().to_vec(),
            p.host().to_vec()
        );
    }
    // A unit may not cross a chunk: a slice over a boundary is refused.
    assert!(
        home.slice(placements[5].1, 2 * placements[5].0.nbytes() as u64)
            .is_err()
    );
    home.restore().unwrap();
    assert_eq!(device.memory_info().pinned_host, 0);
    // A placement that crosses a break it was given is refused, and nothing changed.
    let before: Vec<u64> = params.iter().map(|p| p.host_checksum()).collect();
    let err = PinnedHome::build_in_chunks(&*device, placements, at, &[(3 << 20) + 8], 1 << 20);
    assert!(err.is_err());
    assert_eq!(
        params.iter().map(|p| p.host_checksum()).collect::<Vec<_>>(),
        before
    );
    assert_eq!(device.memory_info().pinned_host, 0);
}

#[test]
fn a_chunk_that_cannot_be_pinned_leaves_every_param_as_it_was() {
    // Room for five of eight 2 MiB chunks: a later chunk fails while workers pin others.
    let device = HostDevice::new(HostDeviceConfig {
        capacity: 1 << 20,
        pinned_limit: 10 << 20,
        ..HostDeviceConfig::default()
    })
    .unwrap();
    let params = f32_params("q", 16, 1 << 18);
    let sums: Vec<u64> = params.iter().map(|p| p.host_checksum()).collect();
    let (placements, at) = one_after_another(&params);
    let breaks: Vec<u64> = placements.iter().map(|(_, a)| *a).collect();
    let err = PinnedHome::build_in_chunks(&*device, placements, at, &breaks, 2 << 20).unwrap_err();
    assert!(matches!(err, CoreError::PinnedLimit { .. }), "{err}");
    for (p, sum) in params.iter().zip(&sums) {
        assert_eq!(p.host().kind(), HostMemoryKind::Pageable, "{}", p.name());
        assert_eq!(p.host_checksum(), *sum, "{}", p.name());
    }
    assert_eq!(device.memory_info().pinned_host, 0, "nothing stays pinned");
}
