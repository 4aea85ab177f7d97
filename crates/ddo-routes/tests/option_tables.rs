//! The routes' option tables are the data the registry parses and refuses by: each table
//! names options of the shared vocabulary, agrees with what its route reports
//! (`effective_options`) and defaults to, and the registry refuses exactly what a table
//! does not take, with the table's own hint, before anything is touched.

use std::collections::BTreeSet;
use std::sync::Arc;

use ddo_core::reference::{self, ReferenceSpec};
use ddo_core::{
    AllocatorKind, CoreError, DType, Device, OptionDecl, OptionKind, OptionValue, Refusal,
    RouteOptions, RouteSpec,
};
use ddo_host::{HostDevice, HostDeviceConfig};
use ddo_routes::{ROUTES, check_route_options, effective_options, enable_dynamic_offload};

/// Options that only travel with a companion (RouteSpec::new refuses them alone).
fn companion(name: &str) -> Option<&'static str> {
    match name {
        "num_blocks_per_group" => Some("offload_type=block_level"),
        "record_stream" => Some("use_stream=true"),
        _ => None,
    }
}

fn sample(decl: &OptionDecl) -> String {
    match decl.kind {
        OptionKind::Flag => "true".into(),
        // num_blocks_per_group must be 1 with a stream; ring_slots at least 2.
        OptionKind::Count if decl.name == "ring_slots" => "3".into(),
        OptionKind::Count => "1".into(),
        OptionKind::Size => "1MiB".into(),
        OptionKind::Budget => "1GiB".into(),
        OptionKind::Choice(names) => names[0].into(),
    }
}

/// `route:name=value` with the option's requirement and companion added.
fn spec_giving(route: &str, decl: &OptionDecl) -> RouteSpec {
    let mut pairs = vec![format!("{}={}", decl.name, sample(decl))];
    if let Some(req) = decl.requires {
        pairs.insert(0, format!("{}={}", req.option, req.value));
    }
    if let Some(c) = companion(decl.name)
        && !pairs
            .iter()
            .any(|p| p.starts_with(c.split('=').next().unwrap()))
    {
        pairs.insert(0, c.to_string());
    }
    ddo_routes::parse_spec(format!("{route}:{}", pairs.join(",")))
        .unwrap_or_else(|e| panic!("{route} {}: {e}", decl.name))
}

#[test]
fn every_table_names_options_of_the_vocabulary_once() {
    for d in ROUTES {
        let table = d.route.option_table();
        let names = table.names();
        let unique: BTreeSet<_> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "{}: an option twice", d.id);
        for decl in table.options {
            assert!(
                RouteOptions::NAMES.contains(&decl.name),
                "{}: {} is no option",
                d.id,
                decl.name
            );
            assert!(
                !decl.doc.is_empty() && !decl.default.is_empty(),
                "{}",
                decl.name
            );
            if let Some(req) = decl.requires {
                assert!(
                    table.get(req.option).is_some(),
                    "{}: {} requires {}, which the route does not take",
                    d.id,
                    decl.name,
                    req.option
                );
            }
        }
        for r in table.refused {
            assert!(RouteOptions::NAMES.contains(&r.name), "{}", r.name);
            assert!(
                table.get(r.name).is_none(),
                "{} both taken and refused",
                r.name
            );
        }
        assert!(!table.others_hint.is_empty());
    }
}

#[test]
fn the_registry_takes_every_option_a_table_declares() {
    for d in ROUTES {
        for decl in d.route.option_table().options {
            let spec = spec_giving(d.id.as_str(), decl);
            check_route_options("transformer", &spec)
                .unwrap_or_else(|e| panic!("{} takes {}: {e}", d.id, decl.name));
        }
    }
}

#[test]
fn the_registry_refuses_every_option_a_table_does_not_take_with_its_hint() {
    for d in ROUTES {
        let table = d.route.option_table();
        for name in RouteOptions::NAMES {
            if table.get(name).is_some() {
                continue;
            }
            // Any route's declaration gives a valid value for it.
            let decl = ROUTES
                .iter()
                .find_map(|r| r.route.option_table().get(name))
                .unwrap_or_else(|| panic!("no route takes {name}"));
            let spec = spec_giving(
                d.id.as_str(),
                &OptionDecl {
                    requires: None,
                    ..*decl
                },
            );
            match check_route_options("transformer", &spec) {
                Err(CoreError::Refused {
                    route,
                    refusal: Refusal::UnsupportedOption { option, hint },
                    ..
                }) => {
                    assert_eq!(route, d.id.as_str());
                    assert_eq!(option, name, "{}: {spec:?}", d.id);
                    assert_eq!(hint, table.refusal_hint(name));
                }
                other => panic!("{} {name}: {other:?}", d.id),
            }
        }
    }
}

#[test]
fn an_option_without_its_requirement_is_refused_with_the_requirement_hint() {
    for d in ROUTES {
        for decl in d.route.option_table().options {
            let Some(req) = decl.requires else { continue };
            let Some(other) = ["true", "false"].into_iter().find(|v| *v != req.value) else {
                continue;
            };
            let text = format!(
                "{}:{}={other},{}={}",
                d.id,
                req.option,
                decl.name,
                sample(decl)
            );
            let spec: RouteSpec = ddo_routes::parse_spec(&text).unwrap();
            match check_route_options("transformer", &spec) {
                Err(CoreError::Refused {
                    refusal: Refusal::UnsupportedOption { option, hint },
                    ..
                }) => {
                    assert_eq!((option, hint), (decl.name, req.hint), "{text}");
                }
                other => panic!("{text}: {other:?}"),
            }
        }
    }
}

/// What an effective value looks like written as a default.
fn written(value: &OptionValue) -> String {
    match value {
        OptionValue::Flag(b) => b.to_string(),
        OptionValue::Count(n) => n.to_string(),
        OptionValue::Text(t) => t.clone(),
    }
}

#[test]
fn what_a_route_reports_is_what_its_table_declares() {
    for d in ROUTES {
        let table = d.route.option_table();
        let spec = RouteSpec::route(d.id);
        for e in effective_options(&spec) {
            let decl = table
                .get(e.name)
                .unwrap_or_else(|| panic!("{} reports {}, not in its table", d.id, e.name));
            assert!(!e.given);
            let value = written(&e.value);
            let default = match decl.kind {
                // The engine's pinned limit depends on the host's memory: declared in words.
                OptionKind::Size if e.name == "pinned_limit" => continue,
                OptionKind::Size => ddo_metrics::format_bytes(
                    ddo_core::config::parse_size(e.name, decl.default).unwrap(),
                ),
                OptionKind::Budget => ddo_core::describe_budget(decl.default.parse().unwrap()),
                _ => decl.default.to_string(),
            };
            assert!(
                default.starts_with(&value),
                "{} {}: runs with {value}, declares {default}",
                d.id,
                e.name
            );
        }
        // With every declared option given, the route reports no option outside its table.
        let all: Vec<String> = table
            .options
            .iter()
            .filter(|o| o.kind != OptionKind::Count || o.name == "ring_slots")
            .filter(|o| !matches!(o.name, "pinned_source" | "compress" | "low_cpu_mem_usage"))
            .map(|o| format!("{}={}", o.name, sample(o)))
            .collect();
        let text = if all.is_empty() {
            d.id.as_str().to_string()
        } else {
            format!("{}:{}", d.id, all.join(","))
        };
        let spec: RouteSpec =
            ddo_routes::parse_spec(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
        check_route_options("transformer", &spec).unwrap_or_else(|e| panic!("{text}: {e}"));
        for e in effective_options(&spec) {
            assert!(table.get(e.name).is_some(), "{}: {}", d.id, e.name);
        }
    }
}

#[test]
fn attach_refuses_what_the_table_refuses_before_touching_anything() {
    let spec = ReferenceSpec::small("transformer", 2, 4, DType::F32);
    for d in ROUTES {
        let table = d.route.option_table();
        let Some(name) = RouteOptions::NAMES
            .into_iter()
            .find(|n| table.get(n).is_none() && companion(n).is_none())
        else {
            continue;
        };
        let decl = ROUTES
            .iter()
            .find_map(|r| r.route.option_table().get(name))
            .unwrap();
        let route_spec = spec_giving(
            d.id.as_str(),
            &OptionDecl {
                requires: None,
                ..*decl
            },
        );
        let c = reference::build(&spec).unwrap();
        let device = HostDevice::new(HostDeviceConfig {
            allocator: if ddo_routes::needs_native_allocator(&route_spec) {
                AllocatorKind::NativeVmm
            } else {
                AllocatorKind::Caching
            },
            ..HostDeviceConfig::default()
        })
        .unwrap();
        let expected = check_route_options("transformer", &route_spec).unwrap_err();
        let err =
            enable_dynamic_offload(&c, device.clone() as Arc<dyn Device>, route_spec).unwrap_err();
        assert_eq!(err.to_string(), expected.to_string(), "{}", d.id);
        let m = device.memory_info();
        assert_eq!((m.allocated, m.pinned_host), (0, 0), "{}", d.id);
        assert!(c.attached().is_none());
    }
}

#[test]
fn a_misspelt_option_is_answered_with_what_the_route_takes() {
    for (text, takes) in [
        (
            "linear_convolution:speed=1",
            "linear_convolution takes pinned; ",
        ),
        ("none:ring_slot=3", "none takes no options; "),
        (
            "native_vmm:budgte=1GiB",
            "native_vmm takes budget, pinned, pinned_limit, unit_bytes, ring_slots, pinned_source, timeline, copy_ahead, page_cache_limit; ",
        ),
    ] {
        match ddo_routes::parse_spec(text) {
            Err(CoreError::InvalidOption { hint, .. }) => {
                assert!(hint.starts_with(takes), "{text}: {hint}");
                assert!(hint.contains("known options: offload_type"), "{hint}");
            }
            other => panic!("{text}: {other:?}"),
        }
    }
}
