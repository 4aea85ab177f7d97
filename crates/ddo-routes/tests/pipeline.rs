//! `enable_pipeline_offload`: policies per named component, all-or-nothing attachment, and
//! phase boundaries with per-phase peaks.

mod common;

use std::sync::Arc;

use common::*;
use ddo_core::Device;
use ddo_core::reference::{self, ReferenceSpec};
use ddo_core::{Component, CoreError, DType, MapEnvironment, Preset, Refusal, RouteId, Settings};
use ddo_routes::{Pipeline, enable_pipeline_offload_with_env};

fn flux_like() -> (Pipeline, Vec<ReferenceSpec>) {
    let specs = vec![
        ReferenceSpec::small("text_encoder", 2, 8, DType::BF16),
        ReferenceSpec::small("transformer", 4, 16, DType::BF16),
        ReferenceSpec::small("vae", 2, 8, DType::F32),
    ];
    let components: Vec<Arc<Component>> =
        specs.iter().map(|s| reference::build(s).unwrap()).collect();
    (Pipeline::new(components).unwrap(), specs)
}

#[test]
fn phases_run_in_order_with_cleanup_and_per_phase_peaks() {
    let (pipeline, specs) = flux_like();
    let d = device(1 << 24);
    let mut p = enable_pipeline_offload_with_env(
        &pipeline,
        dyn_device(&d),
        &Settings::default(),
        &MapEnvironment::default(),
    )
    .unwrap();
    for ((name, phase), spec) in ["text_encoder", "transformer", "vae"]
        .into_iter()
        .zip(["prompt_encoding", "denoise", "decode"])
        .zip(&specs)
    {
        let steps = if phase == "denoise" { 3 } else { 1 };
        for step in 0..steps {
            let out = p
                .handle(name)
                .unwrap()
                .forward(reference::input(spec, 2, step).unwrap())
                .unwrap();
            assert_eq!(
                bytes_of(&*d, &out),
                baseline(&reference::build(spec).unwrap(), spec, 2, step),
                "{name} step {step}"
            );
        }
        let peak = p.phase_boundary(phase).unwrap();
        assert!(peak.allocator_peak_bytes > 0, "{phase}");
        p.release(name).unwrap();
        assert!(pipeline.get(name).unwrap().attached().is_none());
    }
    let phases: Vec<_> = p.phases().iter().map(|x| x.phase.as_str()).collect();
    assert_eq!(phases, ["prompt_encoding", "denoise", "decode"]);
    // The denoise phase streamed the largest component; the vae phase did not see it.
    assert!(p.phases()[1].allocator_peak_bytes > p.phases()[2].allocator_peak_bytes);
    assert_eq!(p.handle("vae").unwrap().metrics_snapshot().phases.len(), 3);
    let m = d.memory_info();
    assert_eq!((m.allocated, m.pinned_host), (0, 0));
}

#[test]
fn a_refused_component_leaves_no_other_component_attached() {
    let (pipeline, _) = flux_like();
    let d = device(1 << 24);
    let settings = Settings {
        preset: Preset::VmmFast,
        ..Settings::default()
    };
    let err = enable_pipeline_offload_with_env(
        &pipeline,
        dyn_device(&d),
        &settings,
        &MapEnvironment::default(),
    )
    .unwrap_err();
    assert!(
        matches!(err, CoreError::Refused { route, refusal: Refusal::NativeAllocatorRequired, .. } if route == RouteId::NATIVE_VMM.as_str()),
        "{err}"
    );
    for c in pipeline.components() {
        assert!(c.attached().is_none(), "{} left attached", c.name());
    }
    let m = d.memory_info();
    assert_eq!((m.allocated, m.pinned_host), (0, 0));
}

#[test]
fn unknown_components_and_duplicate_names_are_typed_errors() {
    let (pipeline, _) = flux_like();
    let d = device(1 << 24);
    let p = enable_pipeline_offload_with_env(
        &pipeline,
        dyn_device(&d),
        &Settings::default(),
        &MapEnvironment::default(),
    )
    .unwrap();
    let err = p.handle("unet").unwrap_err();
    assert!(
        err.to_string().contains("text_encoder, transformer, vae"),
        "{err}"
    );
    let a = reference::build(&ReferenceSpec::small("vae", 1, 4, DType::F32)).unwrap();
    let b = reference::build(&ReferenceSpec::small("vae", 1, 4, DType::F32)).unwrap();
    assert!(Pipeline::new(vec![a, b]).is_err());
}
