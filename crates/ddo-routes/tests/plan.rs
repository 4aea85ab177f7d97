//! The pipeline memory planner (`plan_pipeline`) and per-phase attachment
//! (`enable_planned_pipeline_offload`): what fits stays resident, what does not streams
//! with a budget for what fits, explicit routes are never replaced, a budget too small is
//! refused with the smallest that works, each component is resolved once and keeps its
//! decided-by value from the plan to its handle's metrics, and — the proptest — a plan never
//! exceeds its budget when it runs on the host backend with memory counted exactly.

mod common;

use ddo_route_leaf_group::GroupOffloadConfig;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::Arc;

use common::*;
use ddo_core::reference::{self, LeafSpec, ReferenceSpec};
use ddo_core::{
    Budget, CoreError, DType, DecidedBy, Device, Environment, FootprintContext, MapEnvironment,
    Preset, RouteId, RouteSpec, Settings,
};
use ddo_routes::{
    PhaseDemand, Pipeline, PipelinePlan, PlanRequest, enable_planned_pipeline_offload,
    plan_pipeline, plan_resolved,
};
use proptest::prelude::*;

fn flux_like(transformer_blocks: usize) -> Vec<ReferenceSpec> {
    vec![
        ReferenceSpec::small("text_encoder", 2, 8, DType::F32),
        ReferenceSpec::small("transformer", transformer_blocks, 32, DType::F32),
        ReferenceSpec::small("vae", 2, 8, DType::F32),
    ]
}

fn plan(
    pipeline: &Pipeline,
    device: &Arc<ddo_host::HostDevice>,
    budget: u64,
    activation: u64,
    explicit: &[(String, RouteSpec)],
) -> ddo_core::Result<PipelinePlan> {
    plan_pipeline(
        pipeline,
        &Settings::default(),
        explicit,
        &MapEnvironment::default(),
        &PlanRequest {
            budget_bytes: budget,
            budget_source: "test".into(),
            phases: demands(activation),
            context: FootprintContext::of(&**device),
            host_budget: None,
        },
    )
}

#[test]
fn a_component_that_fits_stays_resident_and_one_that_does_not_keeps_a_part() {
    let specs = flux_like(8);
    let pipeline = pipeline_of(&specs);
    let weights = pipeline.get("transformer").unwrap().param_bytes();
    let d = device(1 << 30);

    let roomy = plan(&pipeline, &d, 1 << 30, 4096, &[]).unwrap();
    let t = roomy.component("transformer").unwrap();
    assert_eq!(t.resolution.spec.route_id(), Some(RouteId::RESIDENT));
    assert_eq!(
        t.resolution.decided_by,
        DecidedBy::MemoryPlan(Preset::OneShotFast)
    );
    assert_eq!(t.footprint.streamed_bytes_per_forward, 0);
    // The seed's VAE table is not planned: leaf level, no stream, under auto.
    let vae = roomy.component("vae").unwrap();
    assert!(!vae.planned);
    assert!(
        !GroupOffloadConfig::from_spec(&vae.resolution.spec).use_stream,
        "{}",
        vae.resolution.spec.describe()
    );

    let tight = plan(&pipeline, &d, weights / 2, 4096, &[]).unwrap();
    let t = tight.component("transformer").unwrap();
    assert_eq!(
        t.resolution.spec.route_id(),
        Some(RouteId::DIFFUSERS_GROUP_OFFLOAD)
    );
    assert!(matches!(
        t.resolution.spec.options().budget,
        Some(Budget::Bytes(_))
    ));
    assert!(t.footprint.resident_bytes > 0, "{:?}", t.footprint);
    assert!(t.footprint.streamed_bytes_per_forward > 0);
    let denoise = tight.phases.iter().find(|p| p.phase == "denoise").unwrap();
    assert!(denoise.peak_bytes <= weights / 2, "{denoise:?}");
}

#[test]
fn explicit_routes_are_counted_never_replaced() {
    let specs = flux_like(4);
    let pipeline = pipeline_of(&specs);
    let d = device(1 << 30);
    let explicit = vec![(
        "transformer".to_string(),
        ddo_routes::parse_spec("diffusers_group_offload:use_stream=true").unwrap(),
    )];
    let p = plan(&pipeline, &d, 1 << 30, 0, &explicit).unwrap();
    let t = p.component("transformer").unwrap();
    assert!(!t.planned);
    assert_eq!(t.resolution.decided_by, DecidedBy::ExplicitRoute);
    assert_eq!(t.resolution.spec, explicit[0].1);
}

/// An environment that counts the reads of each variable.
struct CountingEnv<'a> {
    inner: MapEnvironment,
    reads: &'a RefCell<BTreeMap<String, usize>>,
}

impl Environment for CountingEnv<'_> {
    fn var(&self, name: &str) -> ddo_core::Result<Option<String>> {
        *self.reads.borrow_mut().entry(name.to_string()).or_default() += 1;
        self.inner.var(name)
    }
}

/// A component is resolved once: planning, preflighting and attaching every phase read
/// each component's variables once (the explicit route's never), and each handle carries
/// the plan's decided-by value unchanged to its metrics. A plan made from resolutions
/// resolves nothing and refuses a component it was given none for.
#[test]
fn each_component_is_resolved_once_and_keeps_its_decided_by_to_the_metrics() {
    let specs = flux_like(4);
    let pipeline = pipeline_of(&specs);
    let d = device(1 << 30);
    let reads = RefCell::new(BTreeMap::new());
    let env = CountingEnv {
        inner: MapEnvironment::from_pairs([("DDO_TEXT_ENCODER_ROUTE", "none")]),
        reads: &reads,
    };
    let settings = Settings {
        use_environment: true,
        ..Settings::default()
    };
    let explicit = vec![(
        "transformer".to_string(),
        ddo_routes::parse_spec("diffusers_group_offload:use_stream=true").unwrap(),
    )];
    let request = PlanRequest {
        budget_bytes: 1 << 30,
        budget_source: "test".into(),
        phases: demands(0),
        context: FootprintContext::of(&*d),
        host_budget: None,
    };
    let p = plan_pipeline(&pipeline, &settings, &explicit, &env, &request).unwrap();
    let mut offload = enable_planned_pipeline_offload(&pipeline, dyn_device(&d), &p).unwrap();
    for name in ["text_encoder", "transformer", "vae"] {
        offload.begin_phase(&[name]).unwrap();
    }
    let expected: BTreeMap<String, usize> = [
        ("DDO_PRESET", 3),
        ("DDO_TEXT_ENCODER_ROUTE", 1),
        ("DDO_VAE_ROUTE", 1),
    ]
    .into_iter()
    .map(|(k, n)| (k.to_string(), n))
    .collect();
    assert_eq!(*reads.borrow(), expected);
    for (name, decided_by) in [
        (
            "text_encoder",
            DecidedBy::EnvironmentRoute("DDO_TEXT_ENCODER_ROUTE".into()),
        ),
        ("transformer", DecidedBy::ExplicitRoute),
        ("vae", DecidedBy::PresetDefault(Preset::OneShotFast)),
    ] {
        let planned = &p.component(name).unwrap().resolution;
        let h = offload.handle(name).unwrap();
        assert_eq!(planned.decided_by, decided_by, "{name}");
        assert_eq!(h.decided_by(), &decided_by, "{name}");
        assert_eq!(h.metrics_snapshot().decided_by, decided_by.to_string());
    }
    drop(offload);

    // From resolutions: the same plan, nothing read; one missing is refused.
    let resolutions: Vec<(String, ddo_core::Resolution)> = ["text_encoder", "transformer", "vae"]
        .into_iter()
        .map(|n| (n.to_string(), p.component(n).unwrap().resolution.clone()))
        .collect();
    reads.borrow_mut().clear();
    let again = plan_resolved(&pipeline, &resolutions, &request).unwrap();
    for (name, r) in &resolutions {
        assert_eq!(&again.component(name).unwrap().resolution, r, "{name}");
    }
    assert!(reads.borrow().is_empty());
    let e = plan_resolved(&pipeline, &resolutions[..2], &request).unwrap_err();
    assert!(
        matches!(&e, CoreError::InvalidOption { value, .. } if value == "vae"),
        "{e}"
    );
}

#[test]
fn a_budget_too_small_names_the_smallest_that_works() {
    let specs = flux_like(4);
    let pipeline = pipeline_of(&specs);
    let d = device(1 << 30);
    let activation = 1 << 20;
    let err = plan(&pipeline, &d, activation + 16, activation, &[]).unwrap_err();
    let CoreError::BudgetTooSmall { needed, phase, .. } = &err else {
        panic!("{err}");
    };
    assert!(err.to_string().contains("--vram-budget"), "{err}");
    assert!(!phase.is_empty());
    let ok = plan(&pipeline, &d, *needed, activation, &[]).unwrap();
    for p in &ok.phases {
        assert!(p.peak_bytes <= *needed, "{p:?}");
    }
}

/// Issue 34, item 10: when a later phase needs more than the first, the refusal names the
/// later phase's need (the whole plan's least), not the first phase's, and that budget plans.
#[test]
fn a_refusal_names_the_budget_of_the_whole_plan_not_the_first_phase() {
    let specs = flux_like(4);
    let pipeline = pipeline_of(&specs);
    let d = device(1 << 30);
    let mut phases = demands(0);
    phases[1].activation_bytes = 8 << 20;
    let request = |budget: u64| PlanRequest {
        budget_bytes: budget,
        budget_source: "test".into(),
        phases: phases.clone(),
        context: FootprintContext::of(&*d),
        host_budget: None,
    };
    let settings = Settings::default();
    let env = MapEnvironment::default();
    let err = plan_pipeline(&pipeline, &settings, &[], &env, &request(4096)).unwrap_err();
    let CoreError::BudgetTooSmall { needed, phase, .. } = &err else {
        panic!("{err}");
    };
    assert_eq!(phase, "denoise", "{err}");
    assert!(*needed > 8 << 20, "{err}");
    plan_pipeline(&pipeline, &settings, &[], &env, &request(*needed)).unwrap();
    // Nothing resident at that budget's refusal: no route advice names an empty component,
    // and a size hint only where activations take room.
    let text = err.to_string();
    assert!(!text.contains("--route ="), "{text}");
}

/// A need no `--vram-budget` can name is not offered as one.
#[test]
fn a_need_past_any_budget_names_no_budget() {
    let specs = flux_like(4);
    let pipeline = pipeline_of(&specs);
    let d = device(1 << 30);
    let err = plan(&pipeline, &d, 1 << 20, u64::MAX / 2, &[]).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, CoreError::BudgetTooSmall { .. }), "{text}");
    assert!(!text.contains("give --vram-budget"), "{text}");
    assert!(text.contains("no budget holds this work"), "{text}");
}

#[test]
fn planned_components_attach_when_their_phase_begins_and_release_at_its_end() {
    let specs = flux_like(4);
    let pipeline = pipeline_of(&specs);
    let d = device(1 << 30);
    let p = plan(&pipeline, &d, 1 << 30, 0, &[]).unwrap();
    let mut offload = enable_planned_pipeline_offload(&pipeline, dyn_device(&d), &p).unwrap();
    assert_eq!(d.memory_info().allocated, 0, "nothing attached up front");
    assert!(offload.handle("transformer").is_err());
    for ((name, phase), spec) in ["text_encoder", "transformer", "vae"]
        .into_iter()
        .zip(["prompt_encoding", "denoise", "decode"])
        .zip(&specs)
    {
        let set_up = offload.begin_phase(&[name]).unwrap();
        assert_eq!(set_up.len(), 1);
        for other in ["text_encoder", "transformer", "vae"] {
            let attached = pipeline.get(other).unwrap().attached().is_some();
            assert_eq!(attached, other == name, "{other} during {phase}");
        }
        let out = offload
            .handle(name)
            .unwrap()
            .forward(reference::input(spec, 2, 0).unwrap())
            .unwrap();
        assert_eq!(
            bytes_of(&*d, &out),
            baseline(&reference::build(spec).unwrap(), spec, 2, 0)
        );
        drop(out);
        offload.release(name).unwrap();
        offload.phase_boundary(phase).unwrap();
        assert_eq!(d.memory_info().allocated, 0, "after {phase}");
        assert_eq!(d.memory_info().pinned_host, 0, "after {phase}");
    }
}

#[test]
fn a_streamed_component_is_prepared_in_the_background_and_a_resident_one_is_not() {
    let specs = flux_like(8);
    let pipeline = pipeline_of(&specs);
    let weights = pipeline.get("transformer").unwrap().param_bytes();
    let d = device(1 << 30);
    // The transformer streams with a budgeted part; the text encoder stays resident. With
    // prompt encoding planned as a phase of many forwards there is no early upload.
    let mut p = plan(&pipeline, &d, weights / 2, 4096, &[]).unwrap();
    for c in &mut p.components {
        c.upload_during = None;
    }
    assert!(
        !p.component("transformer")
            .unwrap()
            .footprint
            .attaches_on_device
    );
    assert!(
        p.component("text_encoder")
            .unwrap()
            .footprint
            .attaches_on_device
    );
    let mut offload = enable_planned_pipeline_offload(&pipeline, dyn_device(&d), &p).unwrap();
    offload.begin_phase(&["text_encoder"]).unwrap();
    let resident_before = d.memory_info().allocated;
    let started = offload.prepare(&["transformer", "text_encoder", "vae", "nope"]);
    // The VAE's leaf-level route (no stream) also attaches host-side only.
    assert_eq!(
        started,
        ["transformer", "vae"],
        "text_encoder is attached already"
    );
    assert!(
        offload.finish_early_uploads().is_empty(),
        "nothing to upload early"
    );
    // A background attach takes pinned host memory, never device memory.
    let out = offload
        .handle("text_encoder")
        .unwrap()
        .forward(reference::input(&specs[0], 2, 0).unwrap())
        .unwrap();
    drop(out);
    offload.release("text_encoder").unwrap();
    offload.phase_boundary("prompt_encoding").unwrap();
    assert!(d.memory_info().allocated <= resident_before);
    let set_up = offload.begin_phase(&["transformer"]).unwrap();
    assert_eq!(set_up.len(), 1);
    assert!(offload.prepared_seconds("transformer").is_some());
    assert!(
        d.memory_info().pinned_host > 0,
        "the home was built in the background"
    );
    let out = offload
        .handle("transformer")
        .unwrap()
        .forward(reference::input(&specs[1], 2, 0).unwrap())
        .unwrap();
    assert_eq!(
        bytes_of(&*d, &out),
        baseline(&reference::build(&specs[1]).unwrap(), &specs[1], 2, 0),
        "a prepared component computes what a resident one does"
    );
    drop(out);
    offload.release("transformer").unwrap();
    offload.release("vae").unwrap();
    offload.phase_boundary("denoise").unwrap();
    assert_eq!(d.memory_info().pinned_host, 0);

    // Released, or dropped, while its background attach may still run: nothing stays.
    let mut offload = enable_planned_pipeline_offload(&pipeline, dyn_device(&d), &p).unwrap();
    assert_eq!(offload.prepare(&["transformer"]).len(), 1);
    offload.release("transformer").unwrap();
    assert!(pipeline.get("transformer").unwrap().attached().is_none());
    assert_eq!(d.memory_info().pinned_host, 0);
    let mut offload = enable_planned_pipeline_offload(&pipeline, dyn_device(&d), &p).unwrap();
    assert_eq!(offload.prepare(&["transformer"]).len(), 1);
    drop(offload);
    assert!(pipeline.get("transformer").unwrap().attached().is_none());
    assert_eq!(d.memory_info().pinned_host, 0);
}

#[test]
fn the_resident_part_of_a_streamed_component_is_uploaded_during_the_phase_before() {
    let specs = flux_like(8);
    let pipeline = pipeline_of(&specs);
    let weights = pipeline.get("transformer").unwrap().param_bytes();
    let d = device(1 << 30);
    let p = plan(&pipeline, &d, weights / 2, 4096, &[]).unwrap();
    let t = p.component("transformer").unwrap();
    assert_eq!(t.upload_during.as_deref(), Some("prompt_encoding"));
    let early = t.footprint.resident_bytes;
    assert!(early > 0);
    let prompt = &p.phases[0];
    assert_eq!(prompt.early_upload_bytes, early);
    assert!(prompt.peak_bytes <= weights / 2, "{prompt:?}");
    assert!(p.format_text().contains("uploaded during prompt_encoding"));
    assert_eq!(
        p.to_json()["components"][1]["upload_during"],
        "prompt_encoding"
    );

    let mut offload = enable_planned_pipeline_offload(&pipeline, dyn_device(&d), &p).unwrap();
    d.reset_peak();
    offload.begin_phase(&["text_encoder"]).unwrap();
    let before = d.memory_info().allocated;
    assert_eq!(offload.prepare(&["transformer"]), ["transformer"]);
    drop(
        offload
            .handle("text_encoder")
            .unwrap()
            .forward(reference::input(&specs[0], 2, 0).unwrap())
            .unwrap(),
    );
    assert_eq!(offload.finish_early_uploads(), ["transformer"]);
    d.synchronize().unwrap();
    // The resident part is on the device before the transformer's phase (the plan counts
    // each param aligned, so at most that).
    let uploaded = d.memory_info().allocated - before;
    assert!(
        uploaded > 0 && uploaded <= early,
        "{uploaded} B against {early}"
    );
    assert!(d.memory_info().peak_allocated <= prompt.peak_bytes);
    offload.release("text_encoder").unwrap();
    // The phase boundary leaves a component whose phase has not begun alone.
    offload.phase_boundary("prompt_encoding").unwrap();
    assert_eq!(d.memory_info().allocated, uploaded);
    offload.begin_phase(&["transformer"]).unwrap();
    let h2d = |o: &ddo_routes::PipelineOffload| {
        o.handle("transformer")
            .unwrap()
            .metrics()
            .counters()
            .h2d_bytes
    };
    let copies_before = h2d(&offload);
    assert_eq!(copies_before, uploaded, "the early upload was counted");
    for step in 0..2 {
        let out = offload
            .handle("transformer")
            .unwrap()
            .forward(reference::input(&specs[1], 2, step).unwrap())
            .unwrap();
        assert_eq!(
            bytes_of(&*d, &out),
            baseline(&reference::build(&specs[1]).unwrap(), &specs[1], 2, step),
            "forward {step} after the early upload"
        );
    }
    let streamed = t.footprint.streamed_bytes_per_forward;
    assert_eq!(
        h2d(&offload) - copies_before,
        2 * streamed,
        "the forwards copied only their streamed bytes, not the resident part again"
    );
    offload.release("transformer").unwrap();
    offload.phase_boundary("denoise").unwrap();
    assert_eq!(d.memory_info().allocated, 0);
    assert_eq!(d.memory_info().pinned_host, 0);

    // A component released before its phase, after its early upload, gives it all back.
    let mut offload = enable_planned_pipeline_offload(&pipeline, dyn_device(&d), &p).unwrap();
    offload.prepare(&["transformer"]);
    assert_eq!(offload.finish_early_uploads(), ["transformer"]);
    offload.release("transformer").unwrap();
    assert_eq!(d.memory_info().allocated, 0);
    assert_eq!(d.memory_info().pinned_host, 0);
}

#[test]
fn a_phase_run_once_is_planned_again_to_make_room_for_the_next_phases_upload() {
    // A text encoder a quarter of the transformer: resident on its own under half the
    // transformer's weights, but not beside the transformer's budgeted part.
    let specs = vec![
        ReferenceSpec::small("text_encoder", 11, 16, DType::F32),
        ReferenceSpec::small("transformer", 8, 32, DType::F32),
        ReferenceSpec::small("vae", 2, 8, DType::F32),
    ];
    let pipeline = pipeline_of(&specs);
    let weights = pipeline.get("transformer").unwrap().param_bytes();
    let d = device(1 << 30);
    let budget = weights / 2;
    let request = |runs_once: bool| PlanRequest {
        budget_bytes: budget,
        budget_source: "test".into(),
        phases: demands(4096)
            .into_iter()
            .map(|mut p| {
                p.runs_once = runs_once && p.phase == "prompt_encoding";
                p
            })
            .collect(),
        context: FootprintContext::of(&*d),
        host_budget: None,
    };
    let plan_with = |runs_once| {
        plan_pipeline(
            &pipeline,
            &Settings::default(),
            &[],
            &MapEnvironment::default(),
            &request(runs_once),
        )
        .unwrap()
    };
    let kept = plan_with(false);
    assert_eq!(
        kept.component("text_encoder")
            .unwrap()
            .resolution
            .spec
            .route_id(),
        Some(RouteId::RESIDENT)
    );
    assert_eq!(kept.component("transformer").unwrap().upload_during, None);
    assert_eq!(kept.phases[0].early_upload_bytes, 0);

    let moved = plan_with(true);
    let text = moved.component("text_encoder").unwrap();
    assert_eq!(
        text.resolution.spec.route_id(),
        Some(RouteId::DIFFUSERS_GROUP_OFFLOAD),
        "{}",
        text.resolution.spec.describe()
    );
    let t = moved.component("transformer").unwrap();
    assert_eq!(t.upload_during.as_deref(), Some("prompt_encoding"));
    assert_eq!(
        t.footprint,
        kept.component("transformer").unwrap().footprint,
        "the transformer's own plan is unchanged"
    );
    for p in &moved.phases {
        assert!(p.peak_bytes <= budget, "{p:?}");
    }
    assert_eq!(
        moved.phases[0].early_upload_bytes,
        t.footprint.resident_bytes
    );
}

#[test]
fn a_background_attach_that_fails_reports_at_its_phase() {
    let specs = flux_like(8);
    let pipeline = pipeline_of(&specs);
    let weights = pipeline.get("transformer").unwrap().param_bytes();
    let d = device(1 << 30);
    let p = plan(&pipeline, &d, weights / 2, 4096, &[]).unwrap();
    let mut offload = enable_planned_pipeline_offload(&pipeline, dyn_device(&d), &p).unwrap();
    // Someone else attaches the transformer meanwhile: the background attach is refused.
    let other = ddo_routes::enable_offload(
        pipeline.get("transformer").unwrap(),
        dyn_device(&d),
        &ddo_routes::OffloadOptions {
            route: Some(ddo_routes::parse_spec("none").unwrap()),
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(offload.prepare(&["transformer"]).len(), 1);
    let err = offload.begin_phase(&["transformer"]).unwrap_err();
    assert!(matches!(err, CoreError::AlreadyAttached { .. }), "{err}");
    drop(other);
}

/// A random component: a stem, `blocks` blocks of linear + norm at random widths, a head.
fn component_spec(name: &str, widths: &[usize], seed: u64) -> ReferenceSpec {
    let width = widths[0];
    ReferenceSpec {
        name: name.into(),
        class_name: "Random".into(),
        dtype: DType::F32,
        in_features: width,
        stem: vec![LeafSpec::linear(width)],
        blocks: widths
            .iter()
            .skip(1)
            .map(|w| {
                vec![
                    LeafSpec::linear(*w),
                    LeafSpec::linear(width),
                    LeafSpec::norm(),
                ]
            })
            .collect(),
        head: vec![LeafSpec::norm(), LeafSpec::linear(width)],
        tie_head_to_stem: false,
        seed,
    }
}

/// Exact device peak of `forwards` forwards of `spec` under `route` on a roomy device,
/// less the weights the route holds: the activations a real run adds to the plan.
fn activation_peak(spec: &ReferenceSpec) -> u64 {
    let d = device(1 << 30);
    let c = reference::build(spec).unwrap();
    let h = ddo_routes::enable_dynamic_offload(&c, dyn_device(&d), RouteSpec::resident()).unwrap();
    d.reset_peak();
    let base = d.memory_info().allocated;
    drop(h.forward(reference::input(spec, 2, 0).unwrap()).unwrap());
    d.synchronize().unwrap();
    d.memory_info().peak_allocated - base
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// For random component trees, budgets and activation sizes: every phase's planned peak
    /// is within the budget, and running the plan on a host device whose capacity is the
    /// budget (activations held as a real allocation) stays within the plan, counted
    /// exactly; a refused plan names a budget that then plans.
    #[test]
    fn a_plan_never_exceeds_its_budget(
        text in prop::collection::vec(4usize..24, 2..4),
        transformer in prop::collection::vec(8usize..48, 2..8),
        budget_share in 1u64..120,
        extra_activation in 0u64..4096,
        seed in 0u64..1000,
    ) {
        let specs = vec![
            component_spec("text_encoder", &text, seed),
            component_spec("transformer", &transformer, seed + 1),
            ReferenceSpec::small("vae", 2, 8, DType::F32),
        ];
        let pipeline = pipeline_of(&specs);
        let weights: u64 = pipeline.components().iter().map(|c| c.param_bytes()).sum();
        let budget = (weights * budget_share / 100).max(1);
        let activations: Vec<u64> = specs.iter().map(|s| activation_peak(s) + extra_activation).collect();
        let phases: Vec<PhaseDemand> = [("prompt_encoding", "text_encoder"), ("denoise", "transformer"), ("decode", "vae")]
            .into_iter()
            .zip(&activations)
            .map(|((phase, c), a)| PhaseDemand { phase: phase.into(), components: vec![c.into()], activation_bytes: *a, runs_once: phase == "prompt_encoding" })
            .collect();
        let request = |budget: u64| PlanRequest {
            budget_bytes: budget,
            budget_source: "proptest".into(),
            phases: phases.clone(),
            context: FootprintContext::of(&*device(budget)),
            host_budget: None,
        };
        let env = MapEnvironment::default();
        let settings = Settings { preset: Preset::Auto, ..Settings::default() };
        let plan = match plan_pipeline(&pipeline, &settings, &[], &env, &request(budget)) {
            Ok(p) => p,
            Err(CoreError::BudgetTooSmall { needed, .. }) => {
                prop_assert!(needed > budget);
                let p = plan_pipeline(&pipeline, &settings, &[], &env, &request(needed));
                prop_assert!(p.is_ok(), "the named budget {} did not plan: {:?}", needed, p.err());
                return Ok(());
            }
            Err(e) => return Err(TestCaseError::fail(e.to_string())),
        };
        for p in &plan.phases {
            prop_assert!(p.peak_bytes <= budget, "{:?} above {}", p, budget);
        }
        let d = device(budget);
        let mut offload = enable_planned_pipeline_offload(&pipeline, dyn_device(&d), &plan).unwrap();
        let names = ["text_encoder", "transformer", "vae"];
        for (k, (((name, phase), spec), activation)) in names
            .into_iter()
            .zip(["prompt_encoding", "denoise", "decode"])
            .zip(&specs)
            .zip(&activations)
            .enumerate()
        {
            d.reset_peak();
            offload.begin_phase(&[name]).unwrap();
            // The next phase's component attaches in the background meanwhile, with its
            // early upload where the plan has one.
            if let Some(next) = names.get(k + 1) {
                offload.prepare(&[next]);
            }
            // The activations the demand announced beyond the forward's own.
            let held = (extra_activation > 0).then(|| d.alloc(extra_activation as usize).unwrap());
            let forwards = if phase == "denoise" { 3 } else { 2 };
            for step in 0..forwards {
                let out = offload.handle(name).unwrap().forward(reference::input(spec, 2, step).unwrap()).unwrap();
                prop_assert_eq!(bytes_of(&*d, &out), baseline(&reference::build(spec).unwrap(), spec, 2, step));
            }
            drop(held);
            offload.finish_early_uploads();
            d.synchronize().unwrap();
            let planned = plan.phases.iter().find(|p| p.phase == phase).unwrap();
            let measured = d.memory_info().peak_allocated;
            prop_assert!(
                measured <= planned.peak_bytes,
                "{}: measured {} above the planned {} (activation {})",
                phase, measured, planned.peak_bytes, activation
            );
            offload.release(name).unwrap();
            offload.phase_boundary(phase).unwrap();
        }
    }
}
