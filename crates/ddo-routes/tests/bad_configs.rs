//! Bad configs and options: unknown and contradictory route options, presets and
//! environment values, sizes that are negative, zero or overflow, budgets below the largest
//! leaf, and device settings. Each is a typed error whose text carries a hint (what to do),
//! raised before anything is allocated.

mod common;

use common::*;
use ddo_core::reference::{self, ReferenceSpec};
use ddo_core::resolve::resolve;
use ddo_core::{CoreError, DType, Device, MapEnvironment, Preset, Refusal, RouteSpec, Settings};
use ddo_host::{HostDevice, HostDeviceConfig};
use ddo_routes::{OffloadOptions, enable_dynamic_offload, enable_offload_with_env};

/// The error's text, after checking it carries a hint: a `;` or `:` followed by advice.
fn hinted(e: &CoreError) -> String {
    let text = e.to_string();
    assert!(
        [
            "give", "set ", "use ", "choose", "raise", "drop", "valid", "known", "pick", "fix",
            "pass"
        ]
        .iter()
        .any(|w| text.contains(w)),
        "no hint in: {text}"
    );
    text
}

#[test]
fn bad_route_options_are_typed_errors_with_hints() {
    let g = "diffusers_group_offload";
    let cases: Vec<(String, &str)> = vec![
        ("nonsense".into(), "unknown route"),
        (format!("{g}:colour=blue"), "known options"),
        (format!("{g}:use_stream=maybe"), "use_stream"),
        (format!("{g}:use_stream"), "use_stream"),
        (format!("{g}:offload_type=half_level"), "half_level"),
        (
            format!("{g}:offload_type=block_level,num_blocks_per_group=0"),
            "at least 1",
        ),
        (
            format!("{g}:offload_type=block_level,num_blocks_per_group=-1"),
            "positive whole number",
        ),
        (
            format!("{g}:offload_type=block_level,num_blocks_per_group=99999999999999999999999"),
            "positive whole number",
        ),
        (
            format!("{g}:record_stream=true"),
            "record_stream=true without",
        ),
        (
            format!("{g}:offload_type=block_level"),
            "without num_blocks_per_group",
        ),
        (format!("{g}:num_blocks_per_group=2"), "leaf_level"),
        (
            format!("{g}:offload_type=block_level,num_blocks_per_group=2,use_stream=true"),
            "num_blocks_per_group > 1",
        ),
        (
            format!("{g}:pinned=true,low_cpu_mem_usage=true"),
            "choose one",
        ),
        ("native_vmm:budget=0".into(), "positive"),
        ("native_vmm:budget=0GiB".into(), "positive"),
        ("native_vmm:budget=-5GiB".into(), "non-negative"),
        ("native_vmm:budget=lots".into(), "non-negative"),
        ("native_vmm:budget=5XB".into(), "unit"),
        ("native_vmm:budget=99999999999TiB".into(), "budget"),
    ];
    for (text, needle) in cases {
        let e = ddo_routes::parse_spec(&text).expect_err(&format!("`{text}` parsed"));
        assert!(
            matches!(
                e,
                CoreError::InvalidOption { .. }
                    | CoreError::ContradictoryOptions { .. }
                    | CoreError::UnknownRoute { .. }
            ),
            "{text}: {e:?}"
        );
        let shown = hinted(&e);
        assert!(shown.contains(needle), "{text}: {shown}");
    }
}

#[test]
fn unknown_presets_and_bad_environment_values_are_typed_errors() {
    let e = "fastest".parse::<Preset>().unwrap_err();
    assert!(matches!(e, CoreError::UnknownPreset { .. }), "{e}");
    hinted(&e);

    let settings = |use_environment| Settings {
        use_environment,
        ..Settings::default()
    };
    for (var, value) in [
        ("DDO_PRESET", "warp_speed"),
        ("DDO_VAE_ROUTE", "teleport"),
        (
            "DDO_VAE_ROUTE",
            "diffusers_group_offload:record_stream=true",
        ),
    ] {
        let env = MapEnvironment::from_pairs([(var, value)]);
        let e = resolve(&settings(true), "vae", None, &env, &ddo_routes::Catalog).unwrap_err();
        assert!(
            matches!(e, CoreError::InvalidEnvironment { .. }),
            "{var}={value}: {e:?}"
        );
        let shown = hinted(&e);
        assert!(shown.contains(var), "{shown}");
        // With use_environment=false the same environment is never read.
        resolve(&settings(false), "vae", None, &env, &ddo_routes::Catalog)
            .expect("environment ignored");
    }
}

#[test]
fn a_budget_below_the_largest_leaf_is_refused_before_anything_is_allocated() {
    let spec = ReferenceSpec::small("transformer", 4, 64, DType::F32);
    let c = reference::build(&spec).unwrap();
    let largest = c.largest_leaf().unwrap().param_bytes();
    let d = native_device(1 << 24);
    let route: RouteSpec =
        ddo_routes::parse_spec(format!("native_vmm:budget={}", largest - 1)).unwrap();
    let e = enable_dynamic_offload(&c, dyn_device(&d), route).unwrap_err();
    match &e {
        CoreError::Refused {
            refusal:
                Refusal::BudgetBelowLargestLeaf {
                    budget, leaf_bytes, ..
                },
            ..
        } => assert_eq!((*budget, *leaf_bytes), (largest - 1, largest)),
        other => panic!("expected BudgetBelowLargestLeaf, got {other:?}"),
    }
    hinted(&e);
    assert_eq!(d.memory_info().allocated, 0);
    assert!(c.attached().is_none());
    // Exactly the largest leaf is enough.
    let route: RouteSpec = ddo_routes::parse_spec(format!("native_vmm:budget={largest}")).unwrap();
    enable_dynamic_offload(&c, dyn_device(&d), route).expect("budget = largest leaf");
}

/// Issue 34: a budget of what is free less a margin that leaves nothing is refused as such,
/// whatever the weights, by the attach (each budgeted route's preflight) and by the planner,
/// before anything is allocated.
#[test]
fn a_free_margin_that_leaves_nothing_is_refused_before_anything_is_allocated() {
    let spec = ReferenceSpec::small("transformer", 4, 64, DType::F32);
    let c = reference::build(&spec).unwrap();
    let capacity = 1u64 << 24;
    let margin = capacity + (1 << 20);
    for (route, d) in [
        (
            format!("native_vmm:budget=free-{margin}"),
            native_device(capacity),
        ),
        (
            format!("diffusers_group_offload:use_stream=true,budget=free-{margin}"),
            device(capacity),
        ),
    ] {
        let spec: RouteSpec = ddo_routes::parse_spec(&route).unwrap();
        let e = enable_dynamic_offload(&c, dyn_device(&d), spec).unwrap_err();
        match &e {
            CoreError::Refused {
                refusal: Refusal::NoBudgetLeft { margin: m, free },
                ..
            } => assert_eq!((*m, *free), (margin, capacity), "{route}"),
            other => panic!("{route}: expected NoBudgetLeft, got {other:?}"),
        }
        hinted(&e);
        assert_eq!(d.memory_info().allocated, 0, "{route}");
        assert!(c.attached().is_none(), "{route}");
        // The registry's check without a component, as `ddo resolve` runs it.
        let again = ddo_routes::check_route_budget("transformer", &spec, capacity).unwrap_err();
        assert_eq!(again.to_string(), e.to_string(), "{route}");
        ddo_routes::check_route_budget("transformer", &spec, margin + 1).expect("1 B left");
    }
}

#[test]
fn an_explicit_route_that_cannot_run_is_refused_not_replaced() {
    let spec = ReferenceSpec::small("vae", 2, 16, DType::F32);
    let c = reference::build(&spec).unwrap();
    let d = device(1 << 24);
    let env = MapEnvironment::default();
    // native_vmm without the native allocator; linear_convolution under it.
    let options = OffloadOptions {
        route: Some(ddo_routes::parse_spec("native_vmm:budget=1MiB").unwrap()),
        ..OffloadOptions::default()
    };
    let e = enable_offload_with_env(&c, dyn_device(&d), &options, &env).unwrap_err();
    assert!(
        matches!(
            &e,
            CoreError::Refused {
                refusal: Refusal::NativeAllocatorRequired,
                ..
            }
        ),
        "{e:?}"
    );
    hinted(&e);
    let n = native_device(1 << 24);
    let options = OffloadOptions {
        route: Some(ddo_routes::parse_spec("linear_convolution").unwrap()),
        ..OffloadOptions::default()
    };
    let e = enable_offload_with_env(&c, dyn_device(&n), &options, &env).unwrap_err();
    assert!(
        matches!(
            &e,
            CoreError::Refused {
                refusal: Refusal::NativeAllocatorInstalled,
                ..
            }
        ),
        "{e:?}"
    );
    hinted(&e);
    assert!(c.attached().is_none());
    assert_eq!(d.memory_info().allocated + n.memory_info().allocated, 0);
}

#[test]
fn zero_or_negative_device_settings_are_typed_errors() {
    for config in [
        HostDeviceConfig {
            capacity: 0,
            ..HostDeviceConfig::default()
        },
        HostDeviceConfig {
            link_bytes_per_sec: Some(-1.0),
            ..HostDeviceConfig::default()
        },
        HostDeviceConfig {
            link_bytes_per_sec: Some(0.0),
            ..HostDeviceConfig::default()
        },
        HostDeviceConfig {
            link_bytes_per_sec: Some(f64::NAN),
            ..HostDeviceConfig::default()
        },
    ] {
        let e = HostDevice::new(config).unwrap_err();
        assert!(matches!(e, CoreError::InvalidOption { .. }), "{e:?}");
        hinted(&e);
    }
}

/// `compress` needs the stream and a pinned home of its own (a budget is fine: the planner
/// counts the coded ring); the routes without a streaming engine of that kind refuse it,
/// and an unknown codec is named.
#[test]
fn compress_is_refused_where_it_cannot_run() {
    for text in [
        "diffusers_group_offload:compress=lossless",
        "diffusers_group_offload:use_stream=true,compress=lossless,pinned_source=register",
        "diffusers_group_offload:use_stream=true,compress=lossless,pinned=false",
        "diffusers_group_offload:use_stream=true,compress=zstd",
        "native_vmm:compress=lossless",
        "linear_convolution:compress=lossless",
        "none:compress=lossless",
    ] {
        let refused = ddo_routes::parse_spec(text)
            .and_then(|spec| ddo_routes::check_route_options("transformer", &spec));
        let e = refused.expect_err(text);
        let said = hinted(&e);
        assert!(said.contains("compress"), "{text}: {said}");
    }
    let ok: RouteSpec =
        ddo_routes::parse_spec("diffusers_group_offload:use_stream=true,compress=lossless")
            .unwrap();
    ddo_routes::check_route_options("transformer", &ok).unwrap();
    let budgeted: RouteSpec = ddo_routes::parse_spec(
        "diffusers_group_offload:use_stream=true,compress=lossless,budget=1GiB",
    )
    .unwrap();
    ddo_routes::check_route_options("transformer", &budgeted).unwrap();
    assert_eq!(
        ok.describe(),
        "diffusers_group_offload use_stream=true compress=lossless"
    );
}
