//! `ddo resolve`: what a preset (and any `--route`, and the environment) gives each
//! component — the route, its options, and where every value came from — without loading
//! anything. `--json` prints one object per component, a stable shape:
//! `{"component", "preset", "resolved_preset", "route", "options": {...}, "source": {...}}`.
//!
//! With a model (`--config` or `--weights`) it prints the pipeline's memory plan instead:
//! the budget (`--vram-budget`, else what the device gives), each phase's peak at
//! `--height × --width` (rounded as `run` rounds it), and each component's planned route
//! with its footprint and the reason; `--json` is then `{"memory_plan": {...},
//! "components": [...]}`, the components in the shape above. A named config is planned
//! from its shapes, its weights never written, so `--config flux-dev` needs no memory for
//! them.
//!
//! Either way it refuses what `ddo run` would: without a model, every route option
//! refused from the spec alone and every budget that leaves nothing on run's default
//! device; with one, the `--route`s checked against its components, the plan, and every
//! route's preflight.

use std::io::Write;

use ddo_core::{ComponentKind, DType, DecidedBy};

use ddo_nn::pipeline::{
    FluxPipeline, FluxPipelineConfig, Loaded, QwenImagePipeline, QwenImagePipelineConfig,
    TEXT_ENCODER, TEXT_ENCODER_2, TRANSFORMER, VAE,
};

use crate::cli::ResolveArgs;
use crate::error::{CliError, CliResult};
use crate::family::{AnyPipeline, Family};
use crate::progress::ProgressBar;
use crate::run::{
    ComponentFiles, MAX_SEQUENCE_LENGTH, Source, build_pipeline, plan_budget, plan_memory,
    planned_explanations, source_from_args,
};
use crate::setup::{DeviceChoice, DeviceNeeds, Routing, host_budget, open_device};
use crate::size::ImageSize;

/// The components of a Flux pipeline, in phase order.
pub const COMPONENTS: [&str; 4] = [TEXT_ENCODER, TEXT_ENCODER_2, TRANSFORMER, VAE];

/// Runs `ddo resolve` with its parsed options.
pub fn resolve(args: &ResolveArgs, out: &mut dyn Write) -> CliResult<()> {
    if args.routes {
        return list_routes(args, out);
    }
    if args.config.is_some() || args.weights.is_some() {
        return resolve_plan(args, out);
    }
    let known: Vec<String> = COMPONENTS.iter().map(|s| s.to_string()).collect();
    let routing = Routing::new(args.preset, &args.route, args.no_env, &known)?;
    for (o, given) in [
        ("vram-budget", args.vram_budget.is_some()),
        ("host-budget", args.host_budget.is_some()),
        ("device", args.device.is_some()),
        ("height", args.height.is_some()),
        ("width", args.width.is_some()),
        ("max-sequence-length", args.max_sequence_length.is_some()),
        ("num-images", args.num_images.is_some()),
        ("tiled-decode", args.tiled_decode.is_some()),
        ("dtype", args.dtype.is_some()),
        ("compute", args.compute.is_some()),
        ("lora", !args.lora.is_empty()),
        ("lora-allow-unmatched", args.lora_allow_unmatched),
    ] {
        if given {
            return Err(CliError::usage(
                format!("--{o} plans memory, which needs a model"),
                "add --config tiny|flux-dev or --weights DIR",
            ));
        }
    }
    let selected: Vec<&str> = match args.component.as_deref() {
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
        ddo_routes::check_route_options(&e.component, &e.resolution.spec)?;
    }
    // And what it refuses on its default device (`--device cpu`, no `--vram-budget`)
    // whatever the model: a budget of the free bytes less a margin that leaves nothing.
    let device = open_device(
        DeviceChoice::Cpu,
        None,
        DeviceNeeds::of(explanations.iter().map(|e| &e.resolution)),
    )?;
    let free = device.memory_info().free_bytes();
    for e in &explanations {
        ddo_routes::check_route_budget(&e.component, &e.resolution.spec, free)?;
    }
    let text = if args.json {
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
            s += &format!(
                "  route from {}{}\n",
                e.source.route,
                preset_column(&e.resolution.decided_by, &e.component)
            );
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

/// `ddo resolve --routes`: every route the registry knows, each with what its option table
/// declares (the routes' own words; nothing here restates them). `--json`: an array of
/// `{"route", "summary", "options": [{"name", "values", "default", "doc", "requires"}]}`.
fn list_routes(args: &ResolveArgs, out: &mut dyn Write) -> CliResult<()> {
    for (o, given) in [
        ("route", !args.route.is_empty()),
        ("component", args.component.is_some()),
        ("preset", args.preset.is_some()),
        ("config", args.config.is_some()),
        ("weights", args.weights.is_some()),
    ] {
        if given {
            return Err(CliError::usage(
                format!("--routes lists the routes; --{o} explains a choice"),
                format!("drop --routes, or drop --{o}"),
            ));
        }
    }
    let routes = ddo_routes::descriptors();
    let text = if args.json {
        let v: Vec<serde_json::Value> = routes
            .iter()
            .map(|d| {
                let options: Vec<serde_json::Value> = d
                    .route
                    .option_table()
                    .options
                    .iter()
                    .map(|o| {
                        serde_json::json!({
                            "name": o.name,
                            "values": o.kind.describe(),
                            "default": o.default,
                            "doc": o.doc,
                            "requires": o.requires.map(|r| format!("{}={}", r.option, r.value)),
                        })
                    })
                    .collect();
                serde_json::json!({
                    "route": d.id.as_str(),
                    "summary": d.summary,
                    "options": options,
                })
            })
            .collect();
        serde_json::to_string_pretty(&v).unwrap_or_default() + "\n"
    } else {
        let mut s = String::new();
        for d in &routes {
            s += &format!("{}: {}\n", d.id, d.summary);
            let table = d.route.option_table();
            if table.options.is_empty() {
                s += "  (no options)\n";
            }
            for o in table.options {
                let needs = o.requires.map_or(String::new(), |r| {
                    format!("; with {}={}", r.option, r.value)
                });
                s += &format!(
                    "  {}={}  default {}{needs}\n      {}\n",
                    o.name,
                    o.kind.describe(),
                    o.default,
                    o.doc
                );
            }
            s += "\n";
        }
        s
    };
    out.write_all(text.as_bytes())
        .map_err(|e| CliError::runtime(format!("cannot write: {e}"), ""))
}

/// Which column of the preset table gave a preset default (the table in
/// `ddo_core::resolve`'s docs), as words after the label; nothing for other deciders.
fn preset_column(decided_by: &DecidedBy, component: &str) -> &'static str {
    if !decided_by.is_preset_default() {
        return "";
    }
    match ComponentKind::from_name(component) {
        ComponentKind::Vae => ": the vae column (the seed's VAE table)",
        ComponentKind::TextEncoder => ": the text-encoder column (DDO's default)",
        ComponentKind::Transformer => ": the transformer column (DDO's default)",
        ComponentKind::Other(_) => ": the transformer column (DDO's default for other names)",
    }
}

/// The pipeline `resolve` plans. A named config without component files is built at the
/// config's shapes with weights never written (`FluxPipeline::unwritten_with`,
/// `QwenImagePipeline::unwritten`): every param has its shape, dtype and bytes — under
/// `--dtype fp8` one byte per cast weight — and no host memory behind it, so
/// `--config flux-dev` plans on any machine. A folder, or a config with single files, is
/// loaded as `ddo run` loads it (files memory-mapped).
fn planned_pipeline(
    args: &ResolveArgs,
    source: &Source,
    bar: &mut ProgressBar,
) -> CliResult<AnyPipeline> {
    let files = ComponentFiles {
        text_encoder: args.text_encoder.clone(),
        transformer: args.transformer.clone(),
        text_encoder_2: args.text_encoder_2.clone(),
        vae: args.vae.clone(),
    }
    .checked()?;
    let no_files = [
        &files.text_encoder,
        &files.transformer,
        &files.text_encoder_2,
        &files.vae,
    ]
    .iter()
    .all(|f| f.is_none());
    let name = match source {
        Source::Config(name) if no_files => name,
        _ => {
            return Ok(build_pipeline(
                source,
                &files,
                args.compute.unwrap_or_default().weights_dtype(args.dtype)?,
                args.max_sequence_length,
                crate::run::unused_weights(args.allow_unused_weights),
                None,
                bar,
            )?
            .0);
        }
    };
    // `source_from_args` knows every config name; a name without a config is refused as
    // it refuses one.
    let unknown = || {
        CliError::usage(
            format!("unknown config `{name}`"),
            format!("use one of: {}", Family::config_names().join(", ")),
        )
    };
    // The random weights `ddo run` makes: f32 for the tiny configs, else bf16.
    let dtype = args.compute.unwrap_or_default().weights_dtype(args.dtype)?;
    let dtype = dtype.unwrap_or(if source.is_tiny() {
        DType::F32
    } else {
        DType::BF16
    });
    let max_seq = args.max_sequence_length;
    bar.status(&format!("building {name}'s shapes ({dtype})..."));
    let pipe = match source.family()? {
        Family::Flux => {
            let mut config = FluxPipelineConfig::named(name).ok_or_else(unknown)?;
            if let Some(n) = max_seq.filter(|&n| n > MAX_SEQUENCE_LENGTH) {
                return Err(CliError::usage(
                    format!(
                        "--max-sequence-length {n}: cannot be greater than {MAX_SEQUENCE_LENGTH} for a FluxPipeline"
                    ),
                    format!("give at most {MAX_SEQUENCE_LENGTH} (FluxPipeline's limit for T5)"),
                ));
            }
            if let Some(n) = max_seq {
                config.max_sequence_length = n;
            }
            AnyPipeline::Flux(Box::new(FluxPipeline::unwritten_with(
                &config,
                dtype,
                Loaded::default(),
            )?))
        }
        Family::QwenImage => {
            let config = QwenImagePipelineConfig::named(name).ok_or_else(unknown)?;
            let mut pipe = QwenImagePipeline::unwritten(&config, dtype)?;
            if let Some(n) = max_seq {
                pipe.max_sequence_length = n;
            }
            AnyPipeline::QwenImage(Box::new(pipe))
        }
    };
    bar.finish();
    Ok(pipe)
}

/// `ddo resolve --config|--weights ...`: the memory plan.
fn resolve_plan(args: &ResolveArgs, out: &mut dyn Write) -> CliResult<()> {
    let source = source_from_args(args.config.as_deref(), args.weights.as_deref())?;
    let tiny = source.is_tiny();
    let default_side = if tiny { 128 } else { 1024 };
    let images = args.num_images.unwrap_or(1);
    let tiled = args
        .tiled_decode
        .unwrap_or(ddo_nn::pipeline::TiledDecode::Auto);
    let budget = args.vram_budget;
    let device_choice = args.device.unwrap_or(DeviceChoice::Cpu);
    let mut bar = ProgressBar::new();
    let pipe = planned_pipeline(args, &source, &mut bar)?;
    let names = pipe.component_names();
    // The `--route`s are checked against this pipeline's components, as `ddo run` checks
    // them (a Qwen-Image pipeline has no `text_encoder_2`).
    let routing = Routing::new(args.preset, &args.route, args.no_env, &names)?;
    // The size rounded as `ddo run` rounds it.
    let size = ImageSize::of(
        &pipe,
        args.height.unwrap_or(default_side),
        args.width.unwrap_or(default_side),
    )?;
    let (height, width) = (size.height, size.width);
    // Each component resolved once, as `ddo run` does.
    let resolutions = routing.resolve_all(&names)?;
    let host = host_budget(args.host_budget);
    let device = open_device(
        device_choice,
        budget,
        DeviceNeeds::of(resolutions.iter().map(|(_, r)| r)).within(&host),
    )?;
    let pipeline = pipe.offload_pipeline()?;
    // `--lora`: checked against the pipeline's layers as `ddo run` checks them, and the
    // plan made with the budget less their factors.
    let lora_bytes = crate::lora::apply_run_loras(
        (&args.lora, args.lora_allow_unmatched, false),
        &pipeline,
        &*device,
        &mut *out,
        args.json,
    )?;
    let (planned_budget, budget_source) = plan_budget(&*device, budget);
    let plan = plan_memory(
        &pipe,
        &pipeline,
        &resolutions,
        &*device,
        (
            crate::lora::budget_less_loras(planned_budget, budget_source, lora_bytes),
            host,
        ),
        (height, width, images),
        tiled,
    )?;
    let explanations = planned_explanations(&routing, &names, &plan, &pipeline);
    // Every route's preflight, as `ddo run` runs it before the first phase (touching
    // nothing: the routes attach only when a phase begins, which never happens here).
    drop(
        ddo_routes::enable_planned_pipeline_offload(&pipeline, device.clone(), &plan)
            .map_err(|e| CliError::from(e).context("attaching routes"))?,
    );
    let text = if args.json {
        let v = serde_json::json!({
            "memory_plan": plan.to_json(),
            "components": explanations,
        });
        serde_json::to_string_pretty(&v).unwrap_or_default() + "\n"
    } else {
        let note = size
            .note
            .map_or(String::new(), |n| format!("  note: {n}\n"));
        format!("{width}x{height} px\n{note}{}", plan.format_text())
    };
    out.write_all(text.as_bytes())
        .map_err(|e| CliError::runtime(format!("cannot write: {e}"), ""))
}
