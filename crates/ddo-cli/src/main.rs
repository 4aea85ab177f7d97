//! The `ddo` binary: hands the command line to [`ddo_cli::main_with_args`] and exits with
//! its status.

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    std::process::exit(ddo_cli::main_with_args(argv));
}
