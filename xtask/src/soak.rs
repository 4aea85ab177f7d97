//! `cargo xtask soak [--cycles N] [--tolerance-bytes B]`: the soak on the host backend —
//! N cycles (default 1000) of attach → forward → phase boundary → remove over every route
//! configuration (`ddo_nn::soak`), in release, through `ddo-nn`'s `soak` example. Prints the
//! device, pinned and host (resident set) figures after the first and the last cycle and
//! fails when one grew by more than the tolerance (default 1 MiB). The GPU variant is
//! `crates/ddo-cuda/tests/gpu_soak.rs` (`DDO_SOAK_CYCLES`).

use crate::{cargo, run};

/// The task: forwards `args` to the example.
pub fn soak(args: &[String]) -> Result<(), String> {
    let mut cmd = cargo();
    cmd.args([
        "run",
        "--release",
        "-p",
        "ddo-nn",
        "--example",
        "soak",
        "--",
    ])
    .args(args);
    run(&mut cmd)
}
