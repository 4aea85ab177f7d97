//! The `ddo` command, as a library the binary (`src/main.rs`) and the integration tests
//! call.
//!
//! `ddo-cli` sits at the top of DDO's layers: it depends on every other crate — `ddo-nn`
//! for the models and the Flux pipeline (its phase driver lives there, so applications get
//! it without the command), `ddo-routes` for the route table and `enable_pipeline_offload`,
//! `ddo-core` for presets, the resolver and the host backend, `ddo-cuda` for `--device
//! cuda:N` — and nothing depends on it. It adds only what a command line needs: argument
//! parsing ([`cli`](mod@cli): clap's derive) with one-line errors that carry a hint, device
//! and budget set-up, the explanation of where each resolved value came from, file formats
//! (PNG, safetensors), tokenizer files (the `tokenizers` crate), a progress bar
//! (`indicatif`), and the human and JSON forms of the profile.
//!
//! Subcommands:
//! - [`run`](mod@run): the Flux pipeline in phases under a preset and per-component routes;
//! - [`decode`](mod@decode): saved latents through a VAE folder;
//! - [`resolve`](mod@resolve): what a preset gives each component, and why;
//! - [`inspect`](mod@inspect): safetensors headers, and what each preset keeps resident;
//! - [`bench`](mod@bench): one component under several routes or presets, against the link floor
//!   (and, with `--plot`, a time vs peak memory chart from [`plot`](mod@plot));
//! - [`convert`](mod@convert): a pipeline folder written again with its matrices coded
//!   losslessly (`--compress lossless`);
//! - [`serve`](mod@serve): a [`session::Session`] kept warm behind an HTTP API and a web page.
//!
//! Every failure comes back as a [`CliError`] — one line, with a hint, and an exit status
//! (2 for bad usage, 1 for a failure while running) — never as a panic.

pub mod bench;
pub mod cli;
pub mod compute_floor;
pub mod convert;
pub mod decode;
pub mod error;
pub mod family;
pub mod fuzz_argv;
pub mod gguf;
pub mod inspect;
pub mod interrupt;
pub mod io;
pub mod lora;
pub mod outputs;
pub mod plot;
pub mod progress;
pub mod resolve;
pub mod run;
pub mod serve;
pub mod session;
pub mod setup;
pub mod size;
pub mod tokenize;

use std::io::Write;

pub use cli::COMMANDS;
pub use error::{CliError, CliResult, ErrorKind};

/// Runs the command line `argv` (without the program name), writing normal output (help
/// included) to `out`. Returns the error to report, if any.
pub fn execute(argv: &[String], out: &mut dyn Write) -> CliResult<()> {
    match cli::parse(argv)? {
        cli::Invocation::Print(text) => out
            .write_all(text.as_bytes())
            .map_err(|e| CliError::runtime(format!("cannot write: {e}"), "")),
        cli::Invocation::Run(command) => match *command {
            cli::Command::Run(args) => run::run(&args, out),
            cli::Command::Decode(args) => decode::decode(&args, out),
            cli::Command::Resolve(args) => resolve::resolve(&args, out),
            cli::Command::Inspect(args) => inspect::inspect(&args, out),
            cli::Command::Bench(args) => bench::bench(&args, out),
            cli::Command::Convert(args) => convert::convert(&args, out),
            cli::Command::Serve(args) => serve::serve(&args, out),
            // `cli::parse` answers these itself.
            cli::Command::Help { .. } | cli::Command::Version { .. } => Ok(()),
        },
    }
}

/// How long [`main_with_args`] waits for ddo-cuda's background work before the process
/// exits (a cuDNN plan takes seconds; a compile of every kernel source about ten).
pub const BACKGROUND_WORK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

/// The binary's entry point: runs `argv`, prints an error as one line on stderr, and
/// returns the exit status. A panic anywhere below is caught and reported as one line too.
pub fn main_with_args(argv: Vec<String>) -> i32 {
    std::panic::set_hook(Box::new(|_| {}));
    let outcome = std::panic::catch_unwind(|| {
        let stdout = std::io::stdout();
        let mut lock = stdout.lock();
        execute(&argv, &mut lock)
    });
    // The process must not exit while a kernel compile or a cuDNN plan build runs in the
    // background (an error can come back long before they end): exit would tear their
    // libraries down beside them (SIGSEGV). Nothing waits when CUDA was never used.
    if !ddo_cuda::join_background_work(BACKGROUND_WORK_TIMEOUT) {
        eprintln!(
            "ddo: warning: background GPU work (kernel compiles, cuDNN plans) still runs after {} s; exiting anyway",
            BACKGROUND_WORK_TIMEOUT.as_secs()
        );
    }
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
