//! Faults inside the managed error boundary: out-of-memory in the middle of a forward and a
//! panic inside a leaf leave no device or pinned bytes, host weights intact, and the
//! component runnable on another route.

mod common;

use std::sync::Arc;

use common::*;
use ddo_core::reference::{self, ReferenceSpec};
use ddo_core::{
    Component, ComponentProgram, CoreError, DType, Device, ForwardContext, LeafId, LeafKind,
    Module, Param, ParamKind, Result, RouteSpec, Tensor,
};
use ddo_routes::enable_dynamic_offload;

fn routes() -> Vec<(&'static str, RouteSpec, bool)> {
    // (label, spec, needs the native allocator)
    vec![
        ("none", RouteSpec::resident(), false),
        ("leaf", RouteSpec::leaf_group(false, false), false),
        ("leaf+stream", RouteSpec::leaf_group(true, false), false),
        (
            "leaf+stream+record",
            ddo_routes::parse_spec("diffusers_group_offload:use_stream=true,record_stream=true").unwrap(),
            false,
        ),
        ("leaf+stream+low_cpu", RouteSpec::leaf_group(true, true), false),
        (
            "block+stream",
            ddo_routes::parse_spec("diffusers_group_offload:offload_type=block_level,num_blocks_per_group=1,use_stream=true")
                .unwrap(),
            false,
        ),
        (
            "block2",
            ddo_routes::parse_spec("diffusers_group_offload:offload_type=block_level,num_blocks_per_group=2").unwrap(),
            false,
        ),
        ("linear_convolution", ddo_routes::parse_spec("linear_convolution").unwrap(), false),
        ("native_vmm", ddo_routes::parse_spec("native_vmm:budget=1MiB").unwrap(), true),
    ]
}

#[test]
fn out_of_memory_mid_forward_is_cleaned_up_and_the_component_runs_elsewhere() {
    let spec = ReferenceSpec::small("transformer", 4, 16, DType::BF16);
    let expected = baseline(&reference::build(&spec).unwrap(), &spec, 3, 9);
    for (label, route, native) in routes() {
        let capacity = 1 << 22;
        let d = if native {
            native_device(capacity)
        } else {
            device(capacity)
        };
        let c = reference::build(&spec).unwrap();
        let sums = checksums(&c);
        let mut h = enable_dynamic_offload(&c, dyn_device(&d), route)
            .unwrap_or_else(|e| panic!("{label}: {e}"));
        let attached = d.memory_info().allocated;
        // Leave room for less than one leaf's weights plus activations, so the forward runs
        // out of memory part-way.
        let hog = d.alloc((capacity - attached - 200) as usize).unwrap();
        let err = h
            .cleanup_on_error(|h| h.forward(reference::input(&spec, 3, 9)?))
            .expect_err(label);
        assert!(
            matches!(err, CoreError::OutOfMemory { .. }),
            "{label}: {err}"
        );
        drop(hog);
        d.synchronize().unwrap();
        let m = d.memory_info();
        assert_eq!(m.allocated, 0, "{label}: device bytes left after cleanup");
        assert_eq!(m.pinned_host, 0, "{label}: pinned bytes left after cleanup");
        assert!(c.attached().is_none(), "{label}: hooks left after cleanup");
        assert!(h.is_detached());
        assert_eq!(checksums(&c), sums, "{label}: host weights changed");

        // The same component runs correctly on another route afterwards.
        let other = if native {
            RouteSpec::leaf_group(false, false)
        } else {
            ddo_routes::parse_spec("linear_convolution").unwrap()
        };
        let h2 = enable_dynamic_offload(&c, dyn_device(&d), other).unwrap();
        let out = h2.forward(reference::input(&spec, 3, 9).unwrap()).unwrap();
        assert_eq!(
            bytes_of(&*d, &out),
            expected,
            "{label}: wrong output after recovery"
        );
    }
}

#[test]
fn an_out_of_memory_attach_leaves_nothing_behind() {
    let spec = ReferenceSpec::small("transformer", 4, 32, DType::F32);
    let c = reference::build(&spec).unwrap();
    let d = device(c.param_bytes() + 64);
    let hog = d.alloc(256).unwrap();
    let err = enable_dynamic_offload(&c, dyn_device(&d), RouteSpec::resident()).unwrap_err();
    assert!(
        matches!(
            err,
            CoreError::Refused { .. } | CoreError::OutOfMemory { .. }
        ),
        "{err}"
    );
    drop(hog);
    assert_eq!(d.memory_info().allocated, 0);
    assert!(c.attached().is_none());
    assert!(c.params().iter().all(|p| p.device().is_none()));
}

struct PanicsAtSecondLeaf;

impl ComponentProgram for PanicsAtSecondLeaf {
    fn forward(&self, ctx: &mut ForwardContext<'_>, input: Tensor) -> Result<Tensor> {
        let x = ctx.run_leaf(LeafId(0), |w| {
            // Touch the weights so the route really onloaded them.
            Ok(w.get("weight")?.nbytes())
        })?;
        ctx.run_leaf(LeafId(1), |_| -> Result<usize> {
            panic!("leaf exploded after {x} bytes")
        })?;
        Ok(input)
    }
}

fn panicking_component() -> Arc<Component> {
    let leaf = |name: &str| {
        let w = Param::from_f32(
            format!("{name}.weight"),
            ParamKind::Parameter,
            DType::F32,
            vec![64],
            &[0.5; 64],
        )
        .unwrap();
        Module::leaf(name, LeafKind::Linear, vec![("weight".to_string(), w)])
    };
    Component::new(
        "transformer",
        "Panicky",
        Module::container("", vec![leaf("a"), leaf("b")]),
        Arc::new(PanicsAtSecondLeaf),
    )
    .unwrap()
}

#[test]
fn a_panic_inside_a_leaf_is_contained_by_cleanup_on_error() {
    for (label, route, native) in routes() {
        let d = if native {
            native_device(1 << 20)
        } else {
            device(1 << 20)
        };
        let c = panicking_component();
        let sums = checksums(&c);
        let mut h = enable_dynamic_offload(&c, dyn_device(&d), route).unwrap();
        let input = Tensor::from_f32(vec![1], DType::F32, &[1.0]).unwrap();
        let err = h.cleanup_on_error(|h| h.forward(input)).unwrap_err();
        match &err {
            CoreError::Panicked { message, .. } => {
                assert!(message.contains("leaf exploded"), "{label}: {message}")
            }
            other => panic!("{label}: expected a panic report, got {other}"),
        }
        d.synchronize().unwrap();
        assert_eq!(d.memory_info().allocated, 0, "{label}");
        assert_eq!(d.memory_info().pinned_host, 0, "{label}");
        assert!(c.attached().is_none(), "{label}");
        assert_eq!(checksums(&c), sums, "{label}");
        // Reattaching works.
        enable_dynamic_offload(&c, dyn_device(&d), RouteSpec::resident()).unwrap();
    }
}

#[test]
fn success_inside_cleanup_on_error_changes_nothing() {
    let spec = ReferenceSpec::small("vae", 2, 8, DType::F16);
    let c = reference::build(&spec).unwrap();
    let d = device(1 << 22);
    let mut h =
        enable_dynamic_offload(&c, dyn_device(&d), RouteSpec::leaf_group(true, false)).unwrap();
    let out = h
        .cleanup_on_error(|h| h.forward(reference::input(&spec, 1, 2)?))
        .unwrap();
    assert!(!h.is_detached());
    assert!(c.attached().is_some());
    assert_eq!(
        bytes_of(&*d, &out),
        baseline(&reference::build(&spec).unwrap(), &spec, 1, 2)
    );
}
