//! `ddo resolve`: what a preset (and any `--route`, and the environment) gives each
//! component — the route, its options, and where every value came from — without loading
//! anything. `--json` prints one object per component, a stable shape:
//! `{"component", "preset", "resolved_preset", "route", "options": {...}, "source": {...}}`.
//!
//! With a model (`--config` or `--weights`) it prints the pipeline's memory plan instead:
//! the budget (`--vram-budget`, else what the device gives), each phase's peak at
//! `--height × --width`, and each component's planned route with its footprint and the
//! reason; `--json` is then `{"memory_plan": {...}, "components": [...]}`, the components
//! in the shape above.

use std::io::Write;

use ddo_nn::pipeline::{TEXT_ENCODER, TEXT_ENCODER_2, TRANSFORMER, VAE};

use crate::args::{OptSpec, Parsed, flag, many, opt, parse};
use crate::error::{CliError, CliResult};
use crate::progress::ProgressBar;
use crate::run::{
    Source, build_pipeline, parse_dtype, plan_budget, plan_memory, planned_explanations, positive,
    source_from_args,
};
use crate::setup::{DeviceChoice, DeviceNeeds, Explanation, Routing, open_device, vram_budget};

/// `ddo resolve`'s options.
pub const OPTIONS: &[OptSpec] = &[
    opt(
        "preset",
        "NAME",
        "the preset to explain (default auto, or DDO_PRESET)",
    ),
    many(
        "route",
        "COMPONENT=ROUTE[:k=v,...]",
        "an explicit route (repeatable)",
    ),
    opt("component", "NAME", "explain one component only"),
    opt(
        "config",
        "tiny|flux-dev",
        "plan memory for random weights at a named config",
    ),
    opt(
        "weights",
        "DIR",
        "plan memory for a Diffusers pipeline folder",
    ),
    opt(
        "transformer",
        "FILE",
        "a single-file transformer in the original Flux layout, in place of the folder's or the config's (as for run)",
    ),
    opt(
        "text-encoder",
        "FILE",
        "a single-file CLIP text encoder in the Transformers layout, in place of the folder's or the config's (as for run)",
    ),
    opt(
        "text-encoder-2",
        "FILE",
        "a single-file T5 encoder in the Transformers layout, in place of the folder's or the config's (as for run)",
    ),
    opt(
        "vae",
        "FILE",
        "a single-file VAE in the original LDM layout, in place of the folder's or the config's (as for run)",
    ),
    opt(
        "vram-budget",
        "SIZE",
        "the budget to plan for (with --config/--weights; default: what the device gives)",
    ),
    opt(
        "device",
        "cpu|cuda:N",
        "the device to plan for (default cpu)",
    ),
    opt(
        "height",
        "PX",
        "image height to plan for (default 128 for tiny, 1024 otherwise)",
    ),
    opt(
        "width",
        "PX",
        "image width to plan for (default 128 for tiny, 1024 otherwise)",
    ),
    opt(
        "max-sequence-length",
        "N",
        "T5 tokens to plan for (default 32 for tiny, 512 otherwise)",
    ),
    opt(
        "num-images",
        "N",
        "images to plan for (as `ddo run --num-images`, default 1)",
    ),
    opt(
        "tiled-decode",
        "on|off|auto",
        "the decode to plan for (as `ddo run`, default auto)",
    ),
    opt("dtype", "f32|bf16|f16|fp8", "weight dtype (as `ddo run`)"),
    flag("json", "one JSON object per component, in an array"),
    flag(
        "allow-unused-weights",
        "load a checkpoint whose config leaves some of its tensors unused (refused otherwise)",
    ),
    flag("no-env", "do not read DDO_PRESET / DDO_<COMPONENT>_ROUTE"),
];

/// The components of a Flux pipeline, in phase order.
pub const COMPONENTS: [&str; 4] = [TEXT_ENCODER, TEXT_ENCODER_2, TRANSFORMER, VAE];

/// Runs `ddo resolve` with `argv` (after `resolve`).
pub fn resolve(argv: &[String], out: &mut dyn Write) -> CliResult<()> {
    let args = parse("resolve", OPTIONS, argv)?;
    if let Some(p) = args.positionals.first() {
        return Err(CliError::usage(
            format!("unexpected argument `{p}` for `ddo resolve`"),
            "options start with --; see `ddo help resolve`",
        ));
    }
    let known: Vec<String> = COMPONENTS.iter().map(|s| s.to_string()).collect();
    let routing = Routing::from_args(&args, &known)?;
    if args.get("config").is_some() || args.get("weights").is_some() {
        return resolve_plan(&args, &routing, out);
    }
    for o in [
        "vram-budget",
        "device",
        "height",
        "width",
        "max-sequence-length",
        "num-images",
        "tiled-decode",
        "dtype",
    ] {
        if args.get(o).is_some() {
            return Err(CliError::usage(
                format!("--{o} plans memory, which needs a model"),
                "add --config tiny|flux-dev or --weights DIR",
            ));
        }
    }
    let selected: Vec<&str> = match args.get("component") {
        Some(c) if COMPONENTS.contains(&c) => vec![c],
        Some(c) => {
            return Err(CliError::usage(
                format!("unknown component `{c}`"),
                format!("components: {}", COMPONENTS.join(", ")),
            ));
        }
        None => COMPONENTS.to_vec(),
    };
    let explanations = selected
        .iter()
        .map(|c| routing.explain(c))
        .collect::<CliResult<Vec<_>>>()?;
    // What the route refuses from the options alone, `ddo run` refuses too: say so here.
    for e in &explanations {
        ddo_routes::check_route_options(&e.component, &e.spec)?;
    }
    let text = if args.flag("json") {
        serde_json::to_string_pretty(&explanations).unwrap_or_default() + "\n"
    } else {
        let mut s = String::new();
        if let Some(e) = explanations.first() {
            let arrow = if e.preset == e.resolved_preset {
                String::new()
            } else {
                format!(" -> {}", e.resolved_preset)
            };
            s += &format!("preset {}{arrow} (from {})\n", e.preset, e.source.preset);
        }
        for e in &explanations {
            s += &format!("\n{}: {}\n", e.component, e.route);
            s += &format!("  route from {}\n", e.source.route);
            for (k, v) in &e.options {
                let from = e.source.options.get(k).map_or("", String::as_str);
                s += &format!("  {k} = {v}  ({from})\n");
            }
        }
        s
    };
    out.write_all(text.as_bytes())
        .map_err(|e| CliError::runtime(format!("cannot write: {e}"), ""))
}

/// `ddo resolve --config|--weights ...`: the memory plan.
fn resolve_plan(args: &Parsed, routing: &Routing, out: &mut dyn Write) -> CliResult<()> {
    let source = source_from_args(args)?;
    let tiny = matches!(&source, Source::Config(n) if n == "tiny");
    let dtype = args.get("dtype").map(parse_dtype).transpose()?;
    let default_side = if tiny { 128 } else { 1024 };
    let height = positive(args, "height")?.unwrap_or(default_side);
    let width = positive(args, "width")?.unwrap_or(default_side);
    let max_seq = crate::run::max_sequence_length(args)?;
    let images = positive(args, "num-images")?.unwrap_or(1);
    let tiled = crate::run::tiled_decode(args)?;
    let budget = vram_budget(args)?;
    let device_choice = DeviceChoice::parse(args.get("device").unwrap_or("cpu"))?;
    let mut bar = ProgressBar::new();
    let (pipe, _) = build_pipeline(
        &source,
        &crate::run::component_files(args)?,
        dtype,
        max_seq,
        crate::run::unused_weights(args),
        &mut bar,
    )?;
    let names = pipe.component_names();
    let resolved = names
        .iter()
        .map(|n| routing.explain(n))
        .collect::<CliResult<Vec<Explanation>>>()?;
    let device = open_device(device_choice, budget, DeviceNeeds::of(&resolved))?;
    let pipeline = pipe.offload_pipeline()?;
    let plan = plan_memory(
        &pipe,
        &pipeline,
        routing,
        &*device,
        plan_budget(&*device, budget),
        (height, width, images),
        tiled,
    )?;
    let explanations = planned_explanations(routing, &names, &plan)?;
    // Every route's preflight, as `ddo run` runs it before the first phase (touching
    // nothing: the routes attach only when a phase begins, which never happens here).
    drop(
        ddo_routes::enable_planned_pipeline_offload(&pipeline, device.clone(), &plan)
            .map_err(|e| CliError::from(e).context("attaching routes"))?,
    );
    let text = if args.flag("json") {
        let v = serde_json::json!({
            "memory_plan": plan.to_json(),
            "components": explanations,
        });
        serde_json::to_string_pretty(&v).unwrap_or_default() + "\n"
    } else {
        format!("{height}x{width} px\n{}", plan.format_text())
    };
    out.write_all(text.as_bytes())
        .map_err(|e| CliError::runtime(format!("cannot write: {e}"), ""))
}
