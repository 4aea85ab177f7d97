//! Fuzz target: argument vectors of the `ddo` command. The bytes become an argv
//! (`ddo_cli::fuzz_argv::argv_from_bytes`: a command, options of that command and misspelled
//! ones, values from dictionaries or raw bytes) that runs through `ddo_cli::execute` — not
//! `main_with_args`, which catches panics — inside a sandbox folder made once per process,
//! the working directory while the command runs (`Sandbox`: copies of the VAE and pipeline
//! fixtures, latents, broken safetensors, a FIFO, links). Every path the argv names is inside it, the device is
//! always the host backend, and the work is kept small. A panic anywhere (libFuzzer's hook
//! aborts, caught panics included), a hang (`-timeout`), an input changed, a file left by a
//! failed command or a temporary file left behind is a crash; the seeds replay on stable in
//! `crates/ddo-cli/tests/cli_args_seeds.rs`.

#![no_main]

use std::sync::Mutex;

use ddo_cli::fuzz_argv::{Sandbox, argv_from_bytes};
use libfuzzer_sys::fuzz_target;

static SANDBOX: Mutex<Option<Sandbox>> = Mutex::new(None);

fuzz_target!(|data: &[u8]| {
    let argv = argv_from_bytes(data);
    let mut sandbox = SANDBOX.lock().unwrap_or_else(|e| e.into_inner());
    let sandbox = sandbox.get_or_insert_with(|| {
        Sandbox::create_in_temp().unwrap_or_else(|e| panic!("cannot make the sandbox: {e}"))
    });
    if let Err(problem) = sandbox.run(&argv) {
        panic!("{problem}");
    }
});
