//! Adding a route is one crate and one row of the route table: this test route (a crate's
//! worth of code, defined here) is registered at run time ([`ddo_routes::register`]) and
//! from then on is named by the option parser, checked from its own option table, resolved
//! from the environment, attached, listed by `ddo resolve --routes`, explained by `ddo
//! resolve --route`, estimated by `ddo inspect --route` and named by `ddo inspect` among
//! the routes that refuse an fp8 checkpoint — with nothing in ddo-cli, ddo-core or the
//! registry written for it.

use std::sync::Arc;

use ddo_core::reference::{self, ReferenceSpec};
use ddo_core::resolve::resolve;
use ddo_core::{
    AttachedRoute, Component, CoreError, DType, DecidedBy, Device, Footprint, FootprintContext,
    HeaderEstimate, MapEnvironment, OptionDecl, OptionKind, OptionTable, Refusal, Result, Route,
    RouteId, RouteSpec, Settings,
};
use ddo_host::HostDevice;
use ddo_metrics::RouteMetrics;
use ddo_route_resident::ResidentRoute;
use ddo_routes::{RouteDescriptor, check_route_options, parse_spec, register};

const ID: RouteId = RouteId::new("test_added_route");

static OPTIONS: OptionTable = OptionTable {
    options: &[
        OptionDecl::new(
            "pinned",
            OptionKind::Flag,
            "false",
            "the test route's own flag",
        ),
        OptionDecl::new(
            "budget",
            OptionKind::Budget,
            "none",
            "a budget the test route takes only beside pinned=true",
        )
        .requires(
            "pinned",
            "true",
            "test_added_route: a budget needs pinned=true",
        ),
    ],
    refused: &[],
    others_hint: "test_added_route takes pinned and budget only",
};

/// A route of its own: it keeps every weight resident, as `none` does (its attach is
/// `none`'s), and says so in its own words.
struct AddedRoute;

impl Route for AddedRoute {
    fn id(&self) -> RouteId {
        ID
    }

    fn option_table(&self) -> &'static OptionTable {
        &OPTIONS
    }

    fn keeps_weights_resident(&self, _spec: &RouteSpec) -> bool {
        true
    }

    /// It refuses fp8 weights, in its own words only: `ddo inspect` names it beside
    /// linear_convolution for an fp8 checkpoint.
    fn takes_weight_dtype(&self, dtype: DType) -> bool {
        !dtype.is_fp8()
    }

    fn estimate(
        &self,
        _spec: &RouteSpec,
        weight_bytes: u64,
        _largest_leaf_bytes: u64,
        _budget_bytes: u64,
    ) -> HeaderEstimate {
        HeaderEstimate {
            resident_bytes: weight_bytes,
            streamed_bytes_per_forward: 0,
            peak_weight_bytes: weight_bytes,
            note: "the added route's own estimate".into(),
        }
    }

    fn preflight(&self, component: &Component, device: &dyn Device, _: &RouteSpec) -> Result<()> {
        ResidentRoute.preflight(component, device, &RouteSpec::resident())
    }

    fn footprint(
        &self,
        component: &Component,
        _spec: &RouteSpec,
        _context: &FootprintContext,
    ) -> Result<Footprint> {
        Ok(Footprint::resident(component.param_bytes()))
    }

    fn attach(
        &self,
        component: &Arc<Component>,
        device: Arc<dyn Device>,
        _spec: &RouteSpec,
        metrics: Arc<RouteMetrics>,
    ) -> Result<Arc<dyn AttachedRoute>> {
        ResidentRoute.attach(component, device, &RouteSpec::resident(), metrics)
    }
}

static ADDED: AddedRoute = AddedRoute;

fn descriptor() -> RouteDescriptor {
    RouteDescriptor {
        id: ID,
        summary: "a route added by a test, one crate's worth of code",
        route: &ADDED,
    }
}

/// Registers the route once per process (the tests of this file may share one).
fn registered() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| register(descriptor()).expect("the added route registers"));
}

fn cli(args: &[&str]) -> ddo_cli::CliResult<String> {
    let argv: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let mut out = Vec::new();
    ddo_cli::execute(&argv, &mut out)?;
    Ok(String::from_utf8(out).unwrap())
}

#[test]
fn an_unregistered_name_is_no_route_and_a_bad_registration_changes_nothing() {
    let e = parse_spec("not_registered_anywhere").unwrap_err();
    assert!(matches!(e, CoreError::UnknownRoute { .. }), "{e}");
    registered();
    // Twice, under a taken name, a bad name, or an id that is not its route's: refused.
    for d in [
        descriptor(),
        RouteDescriptor {
            id: RouteId::RESIDENT,
            ..descriptor()
        },
        RouteDescriptor {
            id: RouteId::new("Bad-Name"),
            ..descriptor()
        },
    ] {
        let e = register(d).unwrap_err();
        assert!(matches!(e, CoreError::InvalidOption { .. }), "{e}");
    }
    let count = ddo_routes::descriptors()
        .iter()
        .filter(|d| d.id == ID)
        .count();
    assert_eq!(count, 1);
}

#[test]
fn the_option_parser_and_the_table_checks_know_the_added_route() {
    registered();
    let spec = parse_spec("test_added_route:pinned=true,budget=1GiB").unwrap();
    assert_eq!(spec.route_id(), Some(ID));
    check_route_options("transformer", &spec).unwrap();
    let refused = |text: &str| match check_route_options("transformer", &parse_spec(text).unwrap())
    {
        Err(CoreError::Refused {
            route,
            refusal: Refusal::UnsupportedOption { option, hint },
            ..
        }) => (route, option, hint),
        other => panic!("{text}: {other:?}"),
    };
    assert_eq!(
        refused("test_added_route:budget=1GiB"),
        (
            "test_added_route",
            "budget",
            "test_added_route: a budget needs pinned=true"
        )
    );
    assert_eq!(
        refused("test_added_route:use_stream=true").2,
        "test_added_route takes pinned and budget only"
    );
    // The environment names it too.
    let env = MapEnvironment::from_pairs([("DDO_TRANSFORMER_ROUTE", "test_added_route")]);
    let settings = Settings {
        use_environment: true,
        ..Settings::default()
    };
    let r = resolve(&settings, "transformer", None, &env, &ddo_routes::Catalog).unwrap();
    assert_eq!(r.spec.route_id(), Some(ID));
    assert!(matches!(r.decided_by, DecidedBy::EnvironmentRoute(_)));
    assert!(ddo_routes::keeps_weights_resident(&r.spec));
}

#[test]
fn the_added_route_attaches_and_runs_like_any_other() {
    registered();
    let spec = ReferenceSpec::small("transformer", 2, 8, DType::F32);
    let c = reference::build(&spec).unwrap();
    let d = HostDevice::with_capacity(1 << 20).unwrap();
    let x = reference::input(&spec, 2, 1).unwrap();
    let want = {
        let h = ddo_routes::enable_dynamic_offload(&c, d.clone(), RouteSpec::resident()).unwrap();
        let y = c.forward(&*d, x.clone()).unwrap();
        drop(h);
        y.to_host_bytes(&*d, &d.compute_stream()).unwrap()
    };
    let mut h =
        ddo_routes::enable_dynamic_offload(&c, d.clone(), parse_spec("test_added_route").unwrap())
            .unwrap();
    assert_eq!(h.spec().route_id(), Some(ID));
    let y = c.forward(&*d, x).unwrap();
    assert_eq!(y.to_host_bytes(&*d, &d.compute_stream()).unwrap(), want);
    drop(y);
    ddo_routes::remove_dynamic_offload(&mut h).unwrap();
    assert_eq!(d.memory_info().allocated, 0);
}

#[test]
fn ddo_resolve_and_inspect_show_the_added_route_in_its_own_words() {
    registered();
    let list = cli(&["resolve", "--routes"]).unwrap();
    assert!(
        list.contains("test_added_route: a route added by a test"),
        "{list}"
    );
    assert!(
        list.contains("budget=<size>|free-<size>  default none; with pinned=true"),
        "{list}"
    );
    assert!(list.contains("the test route's own flag"), "{list}");
    let explained = cli(&[
        "resolve",
        "--no-env",
        "--route",
        "transformer=test_added_route:pinned=true",
        "--component",
        "transformer",
    ])
    .unwrap();
    assert!(
        explained.contains("transformer: test_added_route"),
        "{explained}"
    );
    let e = cli(&[
        "resolve",
        "--no-env",
        "--route",
        "transformer=test_added_route:budget=1GiB",
    ])
    .unwrap_err();
    assert!(e.to_string().contains("a budget needs pinned=true"), "{e}");

    // A one-tensor checkpoint for `inspect`.
    let dir = std::env::temp_dir().join(format!("ddo-added-route-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("transformer.safetensors");
    let header = br#"{"w":{"dtype":"F32","shape":[4,4],"data_offsets":[0,64]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[0u8; 64]);
    std::fs::write(&file, bytes).unwrap();
    let path = file.to_string_lossy().to_string();
    let inspected = cli(&["inspect", &path, "--route", "transformer=test_added_route"]);
    // And a one-tensor fp8 checkpoint: the routes that refuse it, the added one among them.
    let fp8 = dir.join("fp8.safetensors");
    let header = br#"{"w.weight":{"dtype":"F8_E4M3","shape":[4,4],"data_offsets":[0,16]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(&[0x38u8; 16]);
    std::fs::write(&fp8, bytes).unwrap();
    let fp8_inspected = cli(&["inspect", &fp8.to_string_lossy()]);
    std::fs::remove_dir_all(&dir).unwrap();
    let inspected = inspected.unwrap();
    assert!(
        inspected.contains("test_added_route (the added route's own estimate)"),
        "{inspected}"
    );
    let fp8_inspected = fp8_inspected.unwrap();
    assert!(
        fp8_inspected.contains("(refused by linear_convolution, test_added_route)"),
        "{fp8_inspected}"
    );
}
