//! `ddo resolve`: what a preset (and any `--route`, and the environment) gives each
//! component — the route, its options, and where every value came from — without loading
//! anything. `--json` prints one object per component, a stable shape:
//! `{"component", "preset", "resolved_preset", "route", "options": {...}, "source": {...}}`.

use std::io::Write;

use ddo_nn::pipeline::{TEXT_ENCODER, TEXT_ENCODER_2, TRANSFORMER, VAE};

use crate::args::{OptSpec, flag, many, opt, parse};
use crate::error::{CliError, CliResult};
use crate::setup::Routing;

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
    flag("json", "one JSON object per component, in an array"),
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
