//! The host side of the memory plan (issue 35, `ddo_routes::plan::host`): every phase's
//! pinned and working memory within the host budget, on the host backend with pinned memory
//! counted exactly by the device's ledger (held to the budget, as `ddo` holds a device's);
//! the tiers it falls back to (registered with the resident part, streamed part only,
//! staged) give bit-identical outputs; a budget no plan fits is refused naming the least,
//! and planning with that least fits.

mod common;

use std::sync::Arc;

use common::*;
use ddo_core::host_budget::HOST_WORKING_BYTES;
use ddo_core::reference::{self, ReferenceSpec};
use ddo_core::{
    CoreError, DType, Device, FootprintContext, HostBudget, MapEnvironment, Preset, Settings,
};
use ddo_host::{HostDevice, HostDeviceConfig};
use ddo_routes::{
    Pipeline, PipelinePlan, PlanRequest, enable_planned_pipeline_offload, plan_pipeline,
};
use proptest::prelude::*;

const NAMES: [&str; 3] = ["text_encoder", "transformer", "vae"];
const PHASES: [&str; 3] = ["prompt_encoding", "denoise", "decode"];

fn specs(blocks: usize, width: usize, seed: u64) -> Vec<ReferenceSpec> {
    let mut t = ReferenceSpec::small("transformer", blocks, width, DType::F32);
    t.seed = seed;
    vec![
        ReferenceSpec::small("text_encoder", 4, 16, DType::F32),
        t,
        ReferenceSpec::small("vae", 2, 8, DType::F32),
    ]
}

/// A host device whose pinned memory is held to `host`'s room for it, as `ddo` opens one.
fn device_within(capacity: u64, host: &HostBudget) -> Arc<HostDevice> {
    HostDevice::new(HostDeviceConfig {
        capacity,
        pinned_limit: host.pinned_room(),
        ..HostDeviceConfig::default()
    })
    .unwrap()
}

fn plan_with(
    pipeline: &Pipeline,
    device: &Arc<HostDevice>,
    budget: u64,
    host: HostBudget,
) -> ddo_core::Result<PipelinePlan> {
    plan_pipeline(
        pipeline,
        &Settings {
            preset: Preset::Auto,
            ..Settings::default()
        },
        &[],
        &MapEnvironment::default(),
        &PlanRequest {
            budget_bytes: budget,
            budget_source: "test".into(),
            phases: demands(4096),
            context: FootprintContext::of(&**device),
            host_budget: Some(host),
        },
    )
}

/// Runs the plan phase by phase (the next phase's component prepared in the background, as
/// the pipeline does), checking each phase's pinned peak against the plan and every output
/// against the resident baseline; returns the transformer's spec as the plan gave it.
fn run_plan(
    pipeline: &Pipeline,
    specs: &[ReferenceSpec],
    d: &Arc<HostDevice>,
    plan: &PipelinePlan,
) -> Result<(), TestCaseError> {
    let mut offload = enable_planned_pipeline_offload(pipeline, dyn_device(d), plan).unwrap();
    for (k, ((name, phase), spec)) in NAMES.into_iter().zip(PHASES).zip(specs).enumerate() {
        d.reset_pinned_peak();
        offload.begin_phase(&[name]).unwrap();
        if let Some(next) = NAMES.get(k + 1) {
            offload.prepare(&[next]);
        }
        for step in 0..2 {
            let out = offload
                .handle(name)
                .unwrap()
                .forward(reference::input(spec, 2, step).unwrap())
                .unwrap();
            prop_assert_eq!(
                bytes_of(&**d, &out),
                baseline(&reference::build(spec).unwrap(), spec, 2, step),
                "{} step {}",
                name,
                step
            );
        }
        offload.finish_early_uploads();
        d.synchronize().unwrap();
        let planned = plan.phases.iter().find(|p| p.phase == phase).unwrap();
        prop_assert!(
            d.memory_info().pinned_peak <= planned.pinned_host_bytes,
            "{}: {} B pinned, the plan said {} B\n{}",
            phase,
            d.memory_info().pinned_peak,
            planned.pinned_host_bytes,
            plan.format_text()
        );
        offload.release(name).unwrap();
        offload.phase_boundary(phase).unwrap();
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// Over pipelines, device budgets and host budgets: a plan keeps every phase's host
    /// bytes within the host budget and, run with pinned memory counted exactly, pins no
    /// more than it planned in any phase, with outputs bit for bit the resident ones; a
    /// refusal names a budget above the one given that plans.
    #[test]
    fn every_phase_stays_within_the_host_budget(
        blocks in 2usize..8,
        width in prop::sample::select(vec![16usize, 32, 48]),
        device_share in 10u64..100,
        host_share in 0u64..250,
        seed in 0u64..1000,
    ) {
        let specs = specs(blocks, width, seed);
        let pipeline = pipeline_of(&specs);
        let weights: u64 = pipeline.components().iter().map(|c| c.param_bytes()).sum();
        let transformer = pipeline.get("transformer").unwrap().param_bytes();
        let budget = (transformer * device_share / 100).max(64 << 10) + 8192;
        let host = HostBudget::given(HOST_WORKING_BYTES + weights * host_share / 100);
        let d = device_within(1 << 30, &host);
        let plan = match plan_with(&pipeline, &d, budget, host) {
            Ok(p) => p,
            Err(CoreError::HostBudgetTooSmall { needed, .. }) => {
                prop_assert!(needed > host.bytes);
                let again = plan_with(&pipeline, &d, budget, HostBudget::given(needed));
                prop_assert!(again.is_ok(), "the named host budget {} did not plan: {:?}", needed, again.err());
                return Ok(());
            }
            // A device budget too small for the phase: the device planner's matter.
            Err(CoreError::BudgetTooSmall { .. }) => return Ok(()),
            Err(e) => return Err(TestCaseError::fail(e.to_string())),
        };
        for p in &plan.phases {
            prop_assert!(p.host_bytes <= host.bytes, "{:?} above {}", p, host.bytes);
            prop_assert_eq!(
                p.host_bytes,
                HOST_WORKING_BYTES + p.pinned_host_bytes + p.page_cache_bytes
            );
        }
        run_plan(&pipeline, &specs, &d, &plan)?;
    }
}

/// The transformer's tier at four host budgets: everything page-locked (streamed and the
/// resident part for its upload), the streamed part only (`pinned_limit`), the first units
/// page-locked and the rest staged (`pinned_limit` under the streamed bytes), and staged
/// through two buffers (`pinned=false`), the staged pages past what the budget leaves read
/// from the disk each forward (`page_cache_limit`); and a background attach left to its own phase when
/// the prompt phase cannot hold it. Outputs are the same bytes in every tier.
#[test]
fn the_plan_falls_back_tier_by_tier_and_the_outputs_stay_the_same() {
    let specs = specs(6, 48, 7);
    let pipeline = pipeline_of(&specs);
    let transformer = pipeline.get("transformer").unwrap().param_bytes();
    let budget = transformer / 2;
    let roomy = HostBudget::given(1 << 40);
    let d = device_within(1 << 30, &roomy);
    let full = plan_with(&pipeline, &d, budget, roomy).unwrap();
    let t = full.component("transformer").unwrap();
    let (resident, streamed) = (
        t.footprint.resident_bytes,
        t.footprint.streamed_bytes_per_forward,
    );
    assert!(resident > 0 && streamed > 0, "{}", full.format_text());
    assert_eq!(t.footprint.pinned_host_bytes, resident + streamed);
    assert_eq!(t.prepare_during.as_deref(), Some("prompt_encoding"));
    assert!(!full.gives_host_back());

    // The streamed part alone fits: pinned_limit, resident uploaded from pageable memory;
    // the background attach would put both phases' pinned memory together: left out.
    let limited_budget = HostBudget::given(HOST_WORKING_BYTES + streamed + resident / 2);
    let limited = plan_with(&pipeline, &d, budget, limited_budget).unwrap();
    let t = limited.component("transformer").unwrap();
    assert_eq!(
        t.footprint.pinned_host_bytes,
        streamed,
        "{}",
        limited.format_text()
    );
    assert!(
        t.resolution.spec.describe().contains("pinned_limit="),
        "{}",
        t.resolution.spec.describe()
    );
    assert!(t.reason.contains("host: pinned_limit"), "{}", t.reason);

    // Not even the streamed part: the first units page-locked, the rest staged.
    let partial_budget = HostBudget::given(HOST_WORKING_BYTES + streamed / 2);
    let partial = plan_with(&pipeline, &d, budget, partial_budget).unwrap();
    let t = partial.component("transformer").unwrap();
    assert!(
        t.resolution.spec.describe().contains("pinned_limit="),
        "{}",
        partial.format_text()
    );
    assert!(t.reason.contains("the rest staged"), "{}", t.reason);
    assert!(t.footprint.pinned_host_bytes <= streamed / 2);

    // Room for the two staging buffers only: staged. The least budget that plans, searched
    // down from the partial tier's, pins the transformer through its staging buffers alone.
    let mut room = streamed / 2;
    let mut last = None;
    while let Ok(p) = plan_with(
        &pipeline,
        &d,
        budget,
        HostBudget::given(HOST_WORKING_BYTES + room),
    ) {
        last = Some((p, room));
        room -= 256;
    }
    let (staged, room) = last.expect("a budget that plans");
    let staged_budget = HostBudget::given(HOST_WORKING_BYTES + room);
    let t = staged.component("transformer").unwrap();
    assert!(
        t.resolution.spec.describe().contains("pinned=false"),
        "{}",
        staged.format_text()
    );
    assert!(t.footprint.pinned_host_bytes < streamed / 2);

    // Below the streamed bytes, the staged pages do not fit beside the pinned ones either:
    // a page cache limit of what is left, the rest read from the disk each forward (and
    // counted apart from the host bytes). With the streamed part pinned nothing is.
    for plan in [&partial, &staged] {
        let t = plan.component("transformer").unwrap();
        let text = plan.format_text();
        assert!(t.footprint.disk_bytes_per_forward > 0, "{text}");
        assert!(
            t.resolution.spec.describe().contains("page_cache_limit="),
            "{text}"
        );
        assert!(
            t.reason.contains("read from the disk each forward"),
            "{}",
            t.reason
        );
        let denoise = plan.phases.iter().find(|p| p.phase == "denoise").unwrap();
        assert_eq!(
            denoise.disk_bytes_per_forward,
            t.footprint.disk_bytes_per_forward
        );
        assert!(text.contains("/forward, host"), "{text}");
    }
    for plan in [&full, &limited] {
        let t = plan.component("transformer").unwrap();
        assert_eq!(t.footprint.disk_bytes_per_forward, 0);
        assert_eq!(t.footprint.staged_bytes_per_forward, 0);
    }

    for (plan, host) in [
        (&full, roomy),
        (&limited, limited_budget),
        (&partial, partial_budget),
        (&staged, staged_budget),
    ] {
        let d = device_within(1 << 30, &host);
        run_plan(&pipeline, &specs, &d, plan).unwrap();
    }
}

/// A host budget below the working memory plus the least pinned memory is refused naming
/// that least, as a whole number of MiB that plans; the text says what to give.
#[test]
fn a_host_budget_no_plan_fits_names_the_least_that_does() {
    let specs = specs(4, 32, 3);
    let pipeline = pipeline_of(&specs);
    let transformer = pipeline.get("transformer").unwrap().param_bytes();
    let small = HostBudget::given(HOST_WORKING_BYTES / 2);
    let d = device_within(1 << 30, &HostBudget::given(1 << 40));
    let e = plan_with(&pipeline, &d, transformer / 2, small).unwrap_err();
    let CoreError::HostBudgetTooSmall { needed, .. } = &e else {
        panic!("{e}");
    };
    assert!(*needed >= HOST_WORKING_BYTES && needed % (1 << 20) == 0);
    let text = e.to_string();
    assert!(text.contains("--host-budget 2"), "{text}");
    assert!(plan_with(&pipeline, &d, transformer / 2, HostBudget::given(*needed)).is_ok());
}
