//! Shared code of DDO's examples: a small component, a device, and one function per route
//! that attaches it, runs a few forwards, checks the output against resident execution,
//! and returns the route's metrics. The example binaries print what these return; the tests
//! below run them, so the examples cannot rot.

use std::sync::Arc;

use ddo_core::reference::{self, ReferenceSpec};
use ddo_core::{AllocatorKind, CoreError, DType, Device, Result, RouteSpec};
use ddo_host::{HostDevice, HostDeviceConfig};
use ddo_metrics::MetricsSnapshot;
use ddo_routes::{
    Pipeline, enable_dynamic_offload, enable_pipeline_offload, remove_dynamic_offload,
};

/// The demo component: a VAE-shaped reference model (bf16, 6 blocks of 256 features).
pub fn demo_spec(name: &str) -> ReferenceSpec {
    let mut spec = ReferenceSpec::small(name, 6, 256, DType::BF16);
    spec.class_name = "AutoencoderKL".into();
    spec
}

/// A host device of 64 MiB whose copies run at a simulated 20 GB/s, so streaming has a
/// cost to hide. `native` reports the native VMM allocator, as if installed at bootstrap.
pub fn demo_device(native: bool) -> Result<Arc<HostDevice>> {
    HostDevice::new(HostDeviceConfig {
        capacity: 64 << 20,
        pinned_limit: 256 << 20,
        allocator: if native {
            AllocatorKind::NativeVmm
        } else {
            AllocatorKind::Caching
        },
        link_bytes_per_sec: Some(20e9),
        ..HostDeviceConfig::default()
    })
}

fn resident_output(spec: &ReferenceSpec) -> Result<Vec<u8>> {
    let c = reference::build(spec)?;
    let d = demo_device(false)?;
    let s = d.compute_stream();
    c.to_device(&*d, &s)?;
    let out = c.forward(&*d, reference::input(spec, 4, 1)?)?;
    out.to_host_bytes(&*d, &s)
}

/// Attaches `route` to the demo component, runs three forwards, checks each output is
/// bit-identical to resident execution, removes the route, and returns the snapshot taken
/// before removal.
pub fn run_route(route: RouteSpec) -> Result<MetricsSnapshot> {
    let spec = demo_spec("vae");
    let expected = resident_output(&spec)?;
    let native = route.route_id() == Some(ddo_core::RouteId::NATIVE_VMM);
    let device = demo_device(native)?;
    let component = reference::build(&spec)?;
    let mut handle = enable_dynamic_offload(&component, device.clone(), route)?;
    for step in 0..3 {
        let out = handle.cleanup_on_error(|h| h.forward(reference::input(&spec, 4, 1)?))?;
        if out.to_host_bytes(&*device, &device.compute_stream())? != expected {
            return Err(CoreError::Shape {
                what: format!("{} step {step}", route.describe()),
                message: "output differs from resident execution".into(),
            });
        }
    }
    handle.end_phase("decode")?;
    let snapshot = handle.metrics_snapshot();
    match remove_dynamic_offload(&mut handle) {
        // Group offload hooks end with the handle and the component.
        Err(CoreError::NotOwned { .. }) => drop((handle, component)),
        other => other?,
    }
    device.synchronize()?;
    Ok(snapshot)
}

/// The routes `all_routes` shows, with a label each.
pub fn all_routes() -> Result<Vec<(&'static str, RouteSpec)>> {
    Ok(vec![
        ("resident", RouteSpec::resident()),
        (
            "leaf, no stream (the VAE default)",
            RouteSpec::leaf_group(false, false),
        ),
        ("leaf, stream", RouteSpec::leaf_group(true, false)),
        (
            "block level, stream",
            ddo_routes::parse_spec(
                "diffusers_group_offload:offload_type=block_level,num_blocks_per_group=1,use_stream=true",
            )?,
        ),
        (
            "linear_convolution",
            ddo_routes::parse_spec("linear_convolution")?,
        ),
        (
            "native_vmm, 1 MiB budget",
            ddo_routes::parse_spec("native_vmm:budget=1MiB")?,
        ),
    ])
}

/// A three-phase pipeline (text encoder → 4 denoise steps → decode) under `auto`, with the
/// phase boundary between phases; returns each phase's name and peak device bytes.
pub fn run_pipeline_phases() -> Result<Vec<(String, u64)>> {
    let specs = [
        ReferenceSpec::small("text_encoder", 4, 128, DType::BF16),
        ReferenceSpec::small("transformer", 8, 256, DType::BF16),
        demo_spec("vae"),
    ];
    let components = specs
        .iter()
        .map(reference::build)
        .collect::<Result<Vec<_>>>()?;
    let pipeline = Pipeline::new(components)?;
    let device = demo_device(false)?;
    let mut offload = enable_pipeline_offload(&pipeline, device, &ddo_core::Settings::default())?;
    for (spec, (phase, steps)) in
        specs
            .iter()
            .zip([("prompt_encoding", 1), ("denoise", 4), ("decode", 1)])
    {
        for step in 0..steps {
            offload
                .handle(&spec.name)?
                .forward(reference::input(spec, 2, step)?)?;
        }
        offload.phase_boundary(phase)?;
        offload.release(&spec.name)?;
    }
    Ok(offload
        .phases()
        .iter()
        .map(|p| (p.phase.clone(), p.allocator_peak_bytes))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every example the README names (`--example <a|b|...>`) is a file of this crate and
    /// declared in its manifest, and every example file is named there.
    #[test]
    fn the_readme_names_exactly_the_examples_that_exist() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let readme = std::fs::read_to_string(dir.join("../README.md")).unwrap();
        let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
        let listed: Vec<&str> = readme
            .lines()
            .find_map(|l| l.split("--example <").nth(1))
            .and_then(|rest| rest.split('>').next())
            .expect("README names the examples as --example <a|b|...>")
            .split('|')
            .collect();
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| {
                let name = e.unwrap().file_name().to_string_lossy().into_owned();
                name.strip_suffix(".rs").map(str::to_string)
            })
            .collect();
        files.sort();
        let mut names: Vec<String> = listed.iter().map(|s| s.to_string()).collect();
        names.sort();
        assert_eq!(names, files, "README's list and the example files");
        for name in &listed {
            assert!(
                manifest.contains(&format!("name = \"{name}\"")),
                "{name} is not declared in Cargo.toml"
            );
        }
    }

    #[test]
    fn every_route_example_runs_and_matches_resident() {
        for (label, route) in all_routes().unwrap() {
            let snap = run_route(route).unwrap_or_else(|e| panic!("{label}: {e}"));
            assert_eq!(snap.counters.forwards, 3, "{label}");
            assert_eq!(snap.phases.len(), 1, "{label}");
        }
    }

    #[test]
    fn pipeline_example_records_three_phases() {
        let phases = run_pipeline_phases().unwrap();
        let names: Vec<&str> = phases.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["prompt_encoding", "denoise", "decode"]);
        assert!(phases.iter().all(|(_, peak)| *peak > 0));
    }
}
