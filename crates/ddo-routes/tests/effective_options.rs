//! Routes describe their own options (issue 17): `ddo_routes::effective_options` lists, for
//! each route, the options it runs a spec with, marks exactly the ones the spec gave, never
//! names one twice or one the option parser does not know, and `effective_budget` is the
//! route's own default where the spec gives none.

use ddo_core::{Budget, OptionValue, RouteSpec};

/// Option names route specs accept (`RouteOptions` parses them).
fn known(name: &str) -> bool {
    // A known option with a bad value is a value error; an unknown one lists the known ones.
    let text = format!("diffusers_group_offload:{name}=?");
    match ddo_routes::parse_spec(text) {
        Ok(_) => true,
        Err(e) => !e.to_string().contains("known options:"),
    }
}

#[test]
fn each_route_lists_its_options_once_and_marks_the_given_ones() {
    assert!(
        !known("ring_slot"),
        "the check tells a misspelt option from a known one"
    );
    assert!(known("ring_slots"));
    for (text, given) in [
        ("none", &[][..]),
        ("diffusers_group_offload", &[][..]),
        (
            "diffusers_group_offload:offload_type=block_level,num_blocks_per_group=2",
            &["offload_type", "num_blocks_per_group"][..],
        ),
        (
            "diffusers_group_offload:use_stream=true,compress=lossless,budget=4GiB",
            &["use_stream", "compress", "budget"][..],
        ),
        ("linear_convolution:pinned=false", &["pinned"][..]),
        ("native_vmm", &[][..]),
        (
            "native_vmm:budget=10GiB,ring_slots=3",
            &["budget", "ring_slots"][..],
        ),
    ] {
        let spec: RouteSpec = ddo_routes::parse_spec(text).unwrap();
        let options = ddo_routes::effective_options(&spec);
        let names: Vec<&str> = options.iter().map(|e| e.name).collect();
        let mut unique = names.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), names.len(), "{text}: {names:?}");
        for e in &options {
            assert!(known(e.name), "{text}: {} is no option", e.name);
            assert_eq!(e.given, given.contains(&e.name), "{text}: {e:?}");
        }
        for g in given {
            assert!(names.contains(g), "{text}: {g} not listed in {names:?}");
        }
        if text == "none" {
            assert!(options.is_empty());
        }
    }
}

#[test]
fn values_are_the_routes_defaults_where_the_spec_is_silent() {
    let value = |text: &str, name: &str| {
        let spec: RouteSpec = ddo_routes::parse_spec(text).unwrap();
        ddo_routes::effective_options(&spec)
            .into_iter()
            .find(|e| e.name == name)
            .map(|e| e.value)
    };
    let stream = "diffusers_group_offload:use_stream=true";
    assert_eq!(value(stream, "use_stream"), Some(OptionValue::Flag(true)));
    assert_eq!(
        value(stream, "compress"),
        Some(OptionValue::Text("none".into()))
    );
    assert_eq!(
        value(&format!("{stream},compress=lossless"), "compress"),
        Some(OptionValue::Text("lossless".into()))
    );
    assert_eq!(value(stream, "ring_slots"), Some(OptionValue::Count(2)));
    // Without a stream the engine's options are not the route's.
    assert_eq!(value("diffusers_group_offload", "ring_slots"), None);
    assert_eq!(
        value("linear_convolution", "pinned"),
        Some(OptionValue::Flag(
            ddo_route_linear_convolution::PINNED_BY_DEFAULT
        ))
    );
    let vmm: RouteSpec = ddo_routes::parse_spec("native_vmm").unwrap();
    assert_eq!(
        ddo_routes::effective_budget(&vmm),
        Some(ddo_route_native_vmm::DEFAULT_BUDGET)
    );
    let given: RouteSpec = ddo_routes::parse_spec("native_vmm:budget=10GiB").unwrap();
    assert_eq!(
        ddo_routes::effective_budget(&given),
        Some(Budget::Bytes(10 << 30))
    );
    let none: RouteSpec = ddo_routes::parse_spec("none").unwrap();
    assert_eq!(ddo_routes::effective_budget(&none), None);
}

#[test]
fn the_registry_says_which_routes_stream_and_which_need_the_native_allocator() {
    for (text, streams, native) in [
        ("none", false, false),
        ("diffusers_group_offload", false, false),
        ("diffusers_group_offload:use_stream=true", true, false),
        (
            "diffusers_group_offload:offload_type=block_level,num_blocks_per_group=1,use_stream=true",
            true,
            false,
        ),
        ("linear_convolution", false, false),
        ("native_vmm", true, true),
    ] {
        let spec: RouteSpec = ddo_routes::parse_spec(text).unwrap();
        assert_eq!(ddo_routes::streams(&spec), streams, "{text}");
        assert_eq!(ddo_routes::needs_native_allocator(&spec), native, "{text}");
    }
}

/// The routes that refuse weights of a dtype, as each route says (`ddo inspect`'s fp8
/// line): linear_convolution, for quantized and fp8 weights (the seed: not supported with
/// quantized modules); every route takes the dense float dtypes.
#[test]
fn the_registry_says_which_routes_refuse_which_weight_dtypes() {
    use ddo_core::{DType, RouteId};
    for dtype in [DType::F8E4M3, DType::F8E5M2, DType::Quantized] {
        assert_eq!(
            ddo_routes::routes_refusing_weight_dtype(dtype),
            [RouteId::LINEAR_CONVOLUTION],
            "{dtype}"
        );
    }
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        assert!(
            ddo_routes::routes_refusing_weight_dtype(dtype).is_empty(),
            "{dtype}"
        );
    }
}

#[test]
fn the_registry_estimates_from_headers_and_says_which_routes_keep_every_weight() {
    let gib = 1u64 << 30;
    let (weights, leaf, budget) = (10 * gib, gib / 4, 4 * gib);
    let est = |text: &str| {
        let spec: RouteSpec = ddo_routes::parse_spec(text).unwrap();
        ddo_routes::estimate(&spec, weights, leaf, budget)
    };
    assert_eq!(
        ddo_routes::estimate(&RouteSpec::unmanaged(), weights, leaf, budget),
        None,
        "unmanaged: the caller places the weights"
    );
    assert!(ddo_routes::keeps_weights_resident(&RouteSpec::unmanaged()));
    let resident = est("none").unwrap();
    assert_eq!(
        (resident.resident_bytes, resident.peak_weight_bytes),
        (weights, weights)
    );
    assert!(resident.note.contains("preflight refuses"), "{resident:?}");
    let leaf_only = est("diffusers_group_offload").unwrap();
    assert_eq!(
        (
            leaf_only.streamed_bytes_per_forward,
            leaf_only.peak_weight_bytes
        ),
        (weights, leaf)
    );
    let streamed = est("diffusers_group_offload:use_stream=true").unwrap();
    assert_eq!(streamed.peak_weight_bytes, 2 * leaf);
    assert_eq!(est("linear_convolution").unwrap().peak_weight_bytes, leaf);
    let vmm = est("native_vmm:budget=3GiB").unwrap();
    assert_eq!(
        (vmm.resident_bytes, vmm.streamed_bytes_per_forward),
        (3 * gib, 7 * gib)
    );
    assert_eq!(vmm.peak_weight_bytes, 3 * gib + 2 * leaf);
    // diffusers_group_offload's `budget` (with a stream) keeps what it holds beside the
    // engine's ring resident (issue 34: it was ignored); a budget above the device's is
    // capped by it, `free-M` is the device budget less M.
    let budgeted = est("diffusers_group_offload:use_stream=true,budget=3GiB").unwrap();
    assert!(
        budgeted.resident_bytes > 0 && budgeted.resident_bytes < 3 * gib,
        "{budgeted:?}"
    );
    assert_eq!(
        budgeted.resident_bytes + budgeted.streamed_bytes_per_forward,
        weights
    );
    assert!(budgeted.peak_weight_bytes <= 3 * gib, "{budgeted:?}");
    let capped = est("diffusers_group_offload:use_stream=true,budget=100GiB").unwrap();
    let margin = est("diffusers_group_offload:use_stream=true,budget=free").unwrap();
    assert_eq!(capped, margin, "both are the 4 GiB device budget");
    assert!(capped.resident_bytes > budgeted.resident_bytes);
    let small = ddo_routes::estimate(
        &ddo_routes::parse_spec("diffusers_group_offload:use_stream=true,budget=1GiB").unwrap(),
        gib / 2,
        leaf,
        budget,
    )
    .unwrap();
    assert_eq!(
        (small.resident_bytes, small.streamed_bytes_per_forward),
        (gib / 2, 0)
    );
    for (text, keeps) in [
        ("none", true),
        ("diffusers_group_offload", false),
        ("linear_convolution", false),
        ("native_vmm", false),
    ] {
        let spec: RouteSpec = ddo_routes::parse_spec(text).unwrap();
        assert_eq!(ddo_routes::keeps_weights_resident(&spec), keeps, "{text}");
    }
}
