//! The `ddo` binary: hands the command line to [`ddo_cli::main_with_args`] and exits with
//! its status.

fn main() {
    // Arguments that are not UTF-8 are refused in one line, not a panic in `env::args`.
    let mut argv = Vec::new();
    for (i, a) in std::env::args_os().skip(1).enumerate() {
        match a.into_string() {
            Ok(s) => argv.push(s),
            Err(raw) => {
                eprintln!(
                    "ddo: error: argument {} ({}) is not valid UTF-8; hint: give paths and prompts in UTF-8",
                    i + 1,
                    raw.to_string_lossy()
                );
                std::process::exit(2);
            }
        }
    }
    // An interrupt waits until the outputs are all in place or none was written. `ddo
    // serve` handles SIGTERM and SIGINT itself: it finishes the running job first.
    if argv.first().map(String::as_str) != Some("serve")
        && let Err(e) = ddo_cli::interrupt::install()
    {
        eprintln!(
            "ddo: warning: cannot handle interrupts ({e}); an interrupt may leave a partial set of outputs"
        );
    }
    // A weight file truncated while mapped ends the run with one line naming it (SIGBUS).
    if let Err(e) = ddo_core::file_guard::install_truncation_handler() {
        eprintln!(
            "ddo: warning: cannot catch a weight file truncated during the run ({e}); that would end the run with SIGBUS"
        );
    }
    std::process::exit(ddo_cli::main_with_args(argv));
}
