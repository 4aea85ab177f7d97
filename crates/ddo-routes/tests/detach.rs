//! `detach_auxiliary_cpu_sources` through the handle: what it copies, what it preserves,
//! and each refusal (which changes nothing).

mod common;

use std::sync::Arc;

use common::*;
use ddo_core::reference::{self, ReferenceSpec};
use ddo_core::{
    Checkpoint, Component, CoreError, DType, DetachRefusal, LeafKind, Module, Param, ParamKind,
    RouteSpec,
};
use ddo_routes::{OffloadHandle, enable_dynamic_offload};

struct Fixture {
    _dir: TempDir,
    spec: ReferenceSpec,
    component: Arc<Component>,
    path: std::path::PathBuf,
}

/// A checkpoint-backed reference component (tied weights included), with the `Checkpoint`
/// itself already dropped so only the params hold the mapping.
fn fixture(tie: bool) -> Fixture {
    let dir = TempDir::new("detach");
    let mut spec = ReferenceSpec::small("transformer", 3, 8, DType::BF16);
    spec.tie_head_to_stem = tie;
    let path = dir.0.join("diffusion_pytorch_model.safetensors");
    reference::write_checkpoint(&reference::build(&spec).unwrap(), &path).unwrap();
    let ckpt = Checkpoint::open(&path).unwrap();
    let component = reference::build_from_checkpoint(&spec, &ckpt).unwrap();
    drop(ckpt);
    component.set_exclusively_owned(true);
    Fixture {
        _dir: dir,
        spec,
        component,
        path,
    }
}

fn attach(f: &Fixture) -> (OffloadHandle, Arc<ddo_host::HostDevice>) {
    let d = native_device(1 << 24);
    let h = enable_dynamic_offload(
        &f.component,
        dyn_device(&d),
        ddo_routes::parse_spec("native_vmm:budget=1MiB").unwrap(),
    )
    .unwrap();
    (h, d)
}

fn host_state(c: &Component) -> Vec<(u64, bool)> {
    c.params()
        .iter()
        .map(|p| (p.host_checksum(), p.is_checkpoint_backed()))
        .collect()
}

#[test]
fn copies_every_group_within_the_bound_and_releases_the_mapping() {
    let f = fixture(true);
    let (h, d) = attach(&f);
    let before_ids: Vec<_> = f.component.params().iter().map(|p| p.id()).collect();
    let before_sums = checksums(&f.component);
    let before_sources: Vec<_> = f
        .component
        .params()
        .iter()
        .map(|p| p.source().cloned())
        .collect();
    let aliases_before = f.component.aliases();
    let map = Arc::downgrade(
        f.component.params()[0]
            .host()
            .mapped_range()
            .map(|(m, _)| m.clone())
            .as_ref()
            .unwrap(),
    );

    let report = h
        .detach_auxiliary_cpu_sources(true, 16 * 1024 * 1024)
        .unwrap();
    assert!(report.enabled);
    assert_eq!(report.bytes_copied, f.component.param_bytes());
    assert!(report.groups_skipped.is_empty());
    // Tied weights are one tensor, copied once.
    assert_eq!(report.tensors_copied as usize, f.component.params().len());
    assert_eq!(report.mappings_released, 1);
    assert!(map.upgrade().is_none(), "the mapping is still alive");
    assert!(report.rss_anon_before.is_some() && report.rss_file_after.is_some());

    // Values, dtype, identity, aliases and source descriptors are preserved.
    let params = f.component.params();
    assert_eq!(
        params.iter().map(|p| p.id()).collect::<Vec<_>>(),
        before_ids
    );
    assert_eq!(checksums(&f.component), before_sums);
    assert_eq!(
        params
            .iter()
            .map(|p| p.source().cloned())
            .collect::<Vec<_>>(),
        before_sources
    );
    assert!(
        params
            .iter()
            .all(|p| !p.is_checkpoint_backed() && p.dtype() == DType::BF16)
    );
    assert_eq!(f.component.aliases(), aliases_before);
    // The mapping was released, which proves nothing about the commit charge: only a
    // measured drop does (the seed's rule; Linux measures none, so nothing is proven here).
    let measured_drop = matches!(
        (report.commit_before, report.commit_after),
        (Some(before), Some(after)) if after < before
    );
    assert_eq!(
        report.commit_recovery_proven, measured_drop,
        "a released mapping alone decided commit recovery: {report:?}"
    );
    let text = report.format_profile();
    assert!(
        text.contains(&format!("commit_recovery_proven: {measured_drop}")),
        "{text}"
    );
    assert_eq!(h.metrics_snapshot().detach_reports, vec![report]);

    // And the component still computes the same thing.
    let out = h.forward(reference::input(&f.spec, 2, 4).unwrap()).unwrap();
    assert_eq!(
        bytes_of(&*d, &out),
        baseline(&reference::build(&f.spec).unwrap(), &f.spec, 2, 4)
    );
}

#[test]
fn detach_leaves_device_residency_and_cache_capacities_alone() {
    // The seed: detaching CPU sources "does not change GPU residency or cache capacities".
    // A native_vmm attachment holds resident leaves and a pool; both stay as they were.
    let f = fixture(false);
    let (h, d) = attach(&f);
    let residency =
        |c: &Component| -> Vec<bool> { c.params().iter().map(|p| p.device().is_some()).collect() };
    let device_before = residency(&f.component);
    assert!(
        device_before.iter().all(|r| *r),
        "the fixture keeps every leaf resident"
    );
    let (m, pool) = (
        ddo_core::Device::memory_info(&*d),
        ddo_core::Device::native_pool_figures(&*d),
    );
    let report = h
        .detach_auxiliary_cpu_sources(true, 16 * 1024 * 1024)
        .unwrap();
    assert!(report.bytes_copied > 0, "{report:?}");
    assert_eq!(residency(&f.component), device_before);
    let after = ddo_core::Device::memory_info(&*d);
    assert_eq!(
        (
            after.allocated,
            after.reserved,
            after.capacity,
            after.pinned_host
        ),
        (m.allocated, m.reserved, m.capacity, m.pinned_host)
    );
    assert_eq!(ddo_core::Device::native_pool_figures(&*d), pool);
}

#[test]
fn groups_beyond_the_bound_are_skipped_with_a_reason_and_the_mapping_kept() {
    let f = fixture(false);
    let (h, _d) = attach(&f);
    let largest = f
        .component
        .leaves()
        .iter()
        .map(|l| l.param_bytes())
        .max()
        .unwrap();
    let report = h.detach_auxiliary_cpu_sources(true, largest).unwrap();
    assert!(report.bytes_copied <= largest);
    assert!(!report.groups_skipped.is_empty());
    assert!(
        report
            .groups_skipped
            .iter()
            .all(|g| g.reason.contains("bound"))
    );
    assert_eq!(report.mappings_released, 0);
    assert!(
        !report.commit_recovery_proven,
        "nothing released, nothing proven"
    );
    assert!(
        f.component
            .params()
            .iter()
            .any(|p| p.is_checkpoint_backed())
    );
}

#[test]
fn disabled_changes_nothing() {
    let f = fixture(false);
    let (h, _d) = attach(&f);
    let before = host_state(&f.component);
    let report = h.detach_auxiliary_cpu_sources(false, u64::MAX).unwrap();
    assert!(!report.enabled);
    assert_eq!(report.bytes_copied, 0);
    assert_eq!(host_state(&f.component), before);
}

fn assert_refused(h: &OffloadHandle, c: &Component, want: impl Fn(&DetachRefusal) -> bool) {
    let before = host_state(c);
    let err = h.detach_auxiliary_cpu_sources(true, u64::MAX).unwrap_err();
    match &err {
        CoreError::DetachRefused { refusal, .. } => assert!(want(refusal), "{err}"),
        other => panic!("expected a refusal, got {other}"),
    }
    assert_eq!(host_state(c), before, "a refusal changed the sources");
}

#[test]
fn refuses_training_mode() {
    let f = fixture(false);
    let (h, _d) = attach(&f);
    f.component.train();
    assert_refused(&h, &f.component, |r| *r == DetachRefusal::TrainingMode);
}

#[test]
fn refuses_without_exclusive_ownership() {
    let f = fixture(false);
    let (h, _d) = attach(&f);
    f.component.set_exclusively_owned(false);
    assert_refused(&h, &f.component, |r| *r == DetachRefusal::NotExclusive);
}

#[test]
fn refuses_after_execution_started() {
    let f = fixture(false);
    let (h, _d) = attach(&f);
    h.forward(reference::input(&f.spec, 1, 1).unwrap()).unwrap();
    assert_refused(&h, &f.component, |r| {
        matches!(r, DetachRefusal::ExecutionStarted { forwards: 1 })
    });
}

#[test]
fn refuses_unknown_retained_ownership_of_the_mapping() {
    // An open Checkpoint holds the mapping without DDO having registered it.
    let f = fixture(false);
    let ckpt = Checkpoint::open(&f.path).unwrap();
    let c = reference::build_from_checkpoint(&f.spec, &ckpt).unwrap();
    c.set_exclusively_owned(true);
    let d = device(1 << 20);
    let h = enable_dynamic_offload(&c, dyn_device(&d), pageable_leaf()).unwrap();
    assert_refused(&h, &c, |r| {
        matches!(r, DetachRefusal::UnknownOwnership { .. })
    });
    drop(ckpt);
    h.detach_auxiliary_cpu_sources(true, u64::MAX).unwrap();
}

#[test]
fn refuses_an_escaped_tensor_reference() {
    let f = fixture(false);
    let (h, _d) = attach(&f);
    let escaped = f.component.params()[0].host();
    assert_refused(&h, &f.component, |r| {
        matches!(r, DetachRefusal::UnknownOwnership { .. })
    });
    drop(escaped);
    let report = h.detach_auxiliary_cpu_sources(true, u64::MAX).unwrap();
    assert_eq!(report.mappings_released, 1);
}

fn two_leaf_component(a: Arc<Param>, b: Arc<Param>) -> Arc<Component> {
    let c = Component::new(
        "transformer",
        "Handmade",
        Module::container(
            "",
            vec![
                Module::leaf("a", LeafKind::Linear, vec![("weight".into(), a)]),
                Module::leaf("b", LeafKind::Linear, vec![("weight".into(), b)]),
            ],
        ),
        Arc::new(NoProgram),
    )
    .unwrap();
    c.set_exclusively_owned(true);
    c
}

struct NoProgram;
impl ddo_core::ComponentProgram for NoProgram {
    fn forward(
        &self,
        _: &mut ddo_core::ForwardContext<'_>,
        input: ddo_core::Tensor,
    ) -> ddo_core::Result<ddo_core::Tensor> {
        Ok(input)
    }
}

#[test]
fn refuses_overlapping_sources_that_are_not_one_registered_alias() {
    let f = fixture(false);
    let ckpt = Checkpoint::open(&f.path).unwrap();
    let name = ckpt.names().next().unwrap().to_string();
    // Two params over the same bytes: an alias DDO was not told about.
    let a = Param::from_checkpoint(&ckpt, &name, "a.weight", ParamKind::Parameter).unwrap();
    let b = Param::from_checkpoint(&ckpt, &name, "b.weight", ParamKind::Parameter).unwrap();
    drop(ckpt);
    let c = two_leaf_component(a, b);
    let d = device(1 << 20);
    let h = enable_dynamic_offload(&c, dyn_device(&d), pageable_leaf()).unwrap();
    assert_refused(&h, &c, |r| {
        matches!(r, DetachRefusal::OverlappingSources { .. })
    });
}

/// A param over part of a mapped tensor (a view, or a partial alias of another param over
/// the same tensor) is refused, changing nothing: copying it would not be the tensor the
/// checkpoint holds, and dropping the mapping would take the other param's bytes with it
/// (the seed, issue 17 point 6).
#[test]
fn refuses_views_and_partial_aliases_of_mapped_tensors() {
    let f = fixture(false);
    let ckpt = Checkpoint::open(&f.path).unwrap();
    let name = ckpt
        .names()
        .find(|n| {
            let t = ckpt.tensor(n).unwrap();
            t.dtype == DType::BF16 && t.len >= 8
        })
        .unwrap()
        .to_string();
    let info = ckpt.tensor(&name).unwrap().clone();
    let buffer = ckpt.host_buffer(&name).unwrap();
    let half = info.len / 2 / 2 * 2;
    // A view: the first half of the tensor, alone.
    let view = Param::new(
        "a.weight",
        ParamKind::Parameter,
        DType::BF16,
        vec![half / 2],
        buffer.slice(0, half).unwrap(),
    )
    .unwrap();
    let other = Param::from_f32(
        "b.weight",
        ParamKind::Parameter,
        DType::F32,
        vec![2],
        &[1.0, 2.0],
    )
    .unwrap();
    // A partial alias: the whole tensor under one name, its second half under another.
    let whole = Param::from_checkpoint(&ckpt, &name, "c.weight", ParamKind::Parameter).unwrap();
    let tail = Param::new(
        "d.weight",
        ParamKind::Parameter,
        DType::BF16,
        vec![(info.len - half) / 2],
        buffer.slice(half, info.len - half).unwrap(),
    )
    .unwrap();
    drop((ckpt, buffer));
    for (a, b) in [(view, other), (whole, tail)] {
        let c = two_leaf_component(a, b);
        let d = device(1 << 20);
        let h = enable_dynamic_offload(&c, dyn_device(&d), pageable_leaf()).unwrap();
        assert_refused(
            &h,
            &c,
            |r| matches!(r, DetachRefusal::UnsupportedLayout { why, .. } if why.contains("view")),
        );
    }
}

#[test]
fn refuses_unsupported_layouts() {
    let dir = TempDir::new("detach-q");
    let path = dir.0.join("q.safetensors");
    write_u8_checkpoint(&path, &[7u8; 16]);
    let ckpt = Checkpoint::open(&path).unwrap();
    let q = Param::from_checkpoint(&ckpt, "q", "a.weight", ParamKind::Parameter).unwrap();
    assert_eq!(q.dtype(), DType::Quantized);
    let other = Param::from_f32(
        "b.weight",
        ParamKind::Parameter,
        DType::F32,
        vec![2],
        &[1.0, 2.0],
    )
    .unwrap();
    drop(ckpt);
    let c = two_leaf_component(q, other);
    let d = device(1 << 20);
    let h = enable_dynamic_offload(&c, dyn_device(&d), pageable_leaf()).unwrap();
    assert_refused(&h, &c, |r| {
        matches!(r, DetachRefusal::UnsupportedLayout { .. })
    });
}

/// `bench_peer`'s streamed transformer runs, on the host backend: an exclusively owned,
/// checkpoint-backed component under leaf offload with a stream, detached after attach and
/// before its first forward. Under the default `pinned_source=register` the route holds
/// the mapping (page-locked in place) as the weights' one host copy, so the detach is
/// refused and changes nothing; under `pinned_source=home` the pinned home replaced the
/// mapped bytes at attach, so it succeeds with nothing left to copy.
#[test]
fn a_streamed_route_on_the_registered_mapping_refuses_detach_and_a_pinned_home_leaves_nothing_to_copy()
 {
    let f = fixture(false);
    let d = device(1 << 24);
    let h = enable_dynamic_offload(
        &f.component,
        dyn_device(&d),
        ddo_routes::parse_spec("diffusers_group_offload:offload_type=leaf_level,use_stream=true")
            .unwrap(),
    )
    .unwrap();
    assert_refused(&h, &f.component, |r| {
        matches!(r, DetachRefusal::UnknownOwnership { .. })
    });
    // The refusal says why and what to use instead, with options that exist.
    let why = h
        .detach_auxiliary_cpu_sources(true, 256 << 20)
        .unwrap_err()
        .to_string();
    assert!(
        why.contains("pinned_source=register") && why.contains("pinned_source=home"),
        "{why}"
    );
    drop(h);

    let f = fixture(false);
    let d = device(1 << 24);
    let h = enable_dynamic_offload(
        &f.component,
        dyn_device(&d),
        ddo_routes::parse_spec(
            "diffusers_group_offload:offload_type=leaf_level,use_stream=true,pinned_source=home",
        )
        .unwrap(),
    )
    .unwrap();
    assert!(
        f.component
            .params()
            .iter()
            .all(|p| !p.is_checkpoint_backed()),
        "the home holds every streamed weight"
    );
    let report = h.detach_auxiliary_cpu_sources(true, 256 << 20).unwrap();
    assert_eq!((report.bytes_copied, report.groups_copied), (0, 0));
    assert!(!report.commit_recovery_proven);
}

/// Leaf offload without a stream, with the weights left where they are (no pinned home,
/// which would itself replace the checkpoint-backed sources).
fn pageable_leaf() -> RouteSpec {
    ddo_routes::parse_spec(
        "diffusers_group_offload:offload_type=leaf_level,use_stream=false,pinned=false",
    )
    .unwrap()
}

fn write_u8_checkpoint(path: &std::path::Path, data: &[u8]) {
    // A minimal safetensors file written by hand: 8-byte header length, JSON, data.
    let header = format!(
        "{{\"q\":{{\"dtype\":\"U8\",\"shape\":[{}],\"data_offsets\":[0,{}]}}}}",
        data.len(),
        data.len()
    );
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).unwrap();
}
