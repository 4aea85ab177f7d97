//! The `ddo` command, as a library the binary (`src/main.rs`) and the integration tests
//! call.
//!
//! `ddo-cli` sits at the top of DDO's layers: it depends on every other crate — `ddo-nn`
//! for the models and the Flux pipeline (its phase driver lives there, so applications get
//! it without the command), `ddo-routes` for the route table and `enable_pipeline_offload`,
//! `ddo-core` for presets, the resolver and the host backend, `ddo-cuda` for `--device
//! cuda:N` — and nothing depends on it. It adds only what a command line needs: argument
//! parsing with one-line errors that carry a hint, device and budget set-up, the
//! explanation of where each resolved value came from, file formats (PNG, safetensors),
//! tokenizer files (the `tokenizers` crate), a progress bar, and the human and JSON forms
//! of the profile.
//!
//! Subcommands:
//! - [`run`](mod@run): the Flux pipeline in phases under a preset and per-component routes;
//! - [`decode`](mod@decode): saved latents through a VAE folder;
//! - [`resolve`](mod@resolve): what a preset gives each component, and why;
//! - [`inspect`](mod@inspect): safetensors headers, and what each preset keeps resident;
//! - [`bench`](mod@bench): one component under several routes or presets, against the link floor
//!   (and, with `--plot`, a time vs peak memory chart from [`plot`](mod@plot)).
//!
//! Every failure comes back as a [`CliError`] — one line, with a hint, and an exit status
//! (2 for bad usage, 1 for a failure while running) — never as a panic.

pub mod args;
pub mod bench;
pub mod decode;
pub mod error;
pub mod fuzz_argv;
pub mod inspect;
pub mod io;
pub mod outputs;
pub mod plot;
pub mod progress;
pub mod resolve;
pub mod run;
pub mod setup;
pub mod tokenize;

use std::io::Write;

pub use error::{CliError, CliResult, ErrorKind};

/// The subcommands and one line on each.
pub const COMMANDS: [(&str, &str); 5] = [
    (
        "run",
        "run the Flux pipeline in phases and print each phase's route, time and peak",
    ),
    (
        "decode",
        "decode saved latents with a VAE folder into a PNG or safetensors",
    ),
    (
        "resolve",
        "explain what a preset (and --route, and DDO_* variables) gives each component",
    ),
    (
        "inspect",
        "read safetensors headers: components, params, bytes by dtype, preset plans",
    ),
    (
        "bench",
        "time one component under several routes or presets, with ratios to the link floor",
    ),
];

fn usage() -> String {
    let mut s = String::from(
        "ddo — dynamic offloading for diffusion pipelines\n\nusage: ddo <command> [options]\n\ncommands:\n",
    );
    for (name, help) in COMMANDS {
        s += &format!("  {name:<8} {help}\n");
    }
    s += "\n`ddo help <command>` lists a command's options. First run: ddo run --config tiny --out /tmp/ddo-tiny.png\n";
    s
}

fn command_help(name: &str) -> Option<String> {
    let (specs, synopsis, notes) = match name {
        "run" => (
            run::OPTIONS,
            "ddo run (--config tiny|flux-dev | --weights DIR) [options]",
            "Prompts are tokenized with the pipeline folder's tokenizer files (tokenizer/: tokenizer.json\n\
             or vocab.json + merges.txt; tokenizer_2/: tokenizer.json). With --config, or a folder without\n\
             them, DDO's documented stand-in tokenizer is used (ddo_nn::tokenizer), whose ids differ from the\n\
             real tokenizers'. To reproduce another implementation exactly, pass --prompt-embeds and\n\
             --init-latents.\n",
        ),
        "decode" => (
            decode::OPTIONS,
            "ddo decode --weights VAE_DIR --latents FILE.safetensors --out OUT.png|OUT.safetensors",
            "",
        ),
        "resolve" => (
            resolve::OPTIONS,
            "ddo resolve [--preset NAME] [--route COMPONENT=ROUTE]... [--component NAME] [--json]",
            "",
        ),
        "inspect" => (
            inspect::OPTIONS,
            "ddo inspect PATH [--vram-budget SIZE] [--json]",
            "",
        ),
        "bench" => (
            bench::OPTIONS,
            "ddo bench (--config tiny|flux-dev | --weights DIR) [--component NAME] [--route ROUTE]... [--preset NAME]... [options]",
            "Without --route or --preset every route is a candidate. Each candidate gets a fresh attachment,\n\
             its inputs made once and held on the device, warm-up forwards, then timed forwards.\n",
        ),
        _ => return None,
    };
    Some(format!(
        "usage: {synopsis}\n\noptions:\n{}{}{notes}",
        args::options_help(specs),
        if notes.is_empty() { "" } else { "\n" }
    ))
}

/// Runs the command line `argv` (without the program name), writing normal output to
/// `out`. Returns the error to report, if any.
pub fn execute(argv: &[String], out: &mut dyn Write) -> CliResult<()> {
    let Some(command) = argv.first() else {
        return Err(CliError::usage(
            "no command given",
            "try `ddo run --config tiny --out /tmp/ddo-tiny.png`, or `ddo help`",
        ));
    };
    let rest = &argv[1..];
    let print = |out: &mut dyn Write, text: String| {
        out.write_all(text.as_bytes())
            .map_err(|e| CliError::runtime(format!("cannot write: {e}"), ""))
    };
    match command.as_str() {
        "run" => run::run(rest, out),
        "decode" => decode::decode(rest, out),
        "resolve" => resolve::resolve(rest, out),
        "inspect" => inspect::inspect(rest, out),
        "help" | "--help" | "-h" => match rest.first() {
            None => print(out, usage()),
            Some(c) => match command_help(c) {
                Some(h) => print(out, h),
                None => Err(unknown_command(c)),
            },
        },
        "--version" | "-V" | "version" => {
            print(out, format!("ddo {}\n", env!("CARGO_PKG_VERSION")))
        }
        "bench" => bench::bench(rest, out),
        other => Err(unknown_command(other)),
    }
}

fn unknown_command(name: &str) -> CliError {
    CliError::usage(
        format!("unknown command `{name}`"),
        format!(
            "commands: {}; see `ddo help`",
            COMMANDS.map(|(n, _)| n).join(", ")
        ),
    )
}

/// The binary's entry point: runs `argv`, prints an error as one line on stderr, and
/// returns the exit status. A panic anywhere below is caught and reported as one line too.
pub fn main_with_args(argv: Vec<String>) -> i32 {
    std::panic::set_hook(Box::new(|_| {}));
    let outcome = std::panic::catch_unwind(|| {
        let stdout = std::io::stdout();
        let mut lock = stdout.lock();
        execute(&argv, &mut lock)
    });
    match outcome {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => {
            eprintln!("ddo: error: {e}");
            e.exit_code()
        }
        Err(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown".into());
            eprintln!(
                "ddo: error: internal failure ({}); hint: this is a bug in ddo, please report it with the command line",
                error::one_line(&message)
            );
            101
        }
    }
}
