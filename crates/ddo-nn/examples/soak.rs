//! The soak on the host backend: `cargo run --release -p ddo-nn --example soak -- [--cycles N]
//! [--tolerance-bytes B]` (what `cargo xtask soak` runs). Runs N cycles (default 1000) of
//! attach → forward → phase boundary → remove over every route, prints the memory figures
//! after the first and the last cycle, and exits non-zero when a figure grew by more than
//! the tolerance (default 1 MiB) or a cycle failed.

use std::process::ExitCode;
use std::sync::Arc;

use ddo_core::{AllocatorKind, DType, Device};
use ddo_host::{HostDevice, HostDeviceConfig};
use ddo_nn::soak::{run_soak, soak_routes};

fn device(allocator: AllocatorKind) -> Result<Arc<dyn Device>, String> {
    HostDevice::new(HostDeviceConfig {
        capacity: 1 << 30,
        allocator,
        ..HostDeviceConfig::default()
    })
    .map(|d| d as Arc<dyn Device>)
    .map_err(|e| e.to_string())
}

fn run() -> Result<bool, String> {
    let mut cycles = 1000usize;
    let mut tolerance = 1u64 << 20;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let value = args.next();
        let number = |what: &str| -> Result<u64, String> {
            value
                .as_deref()
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("{what} takes a whole number"))
        };
        match a.as_str() {
            "--cycles" => cycles = number("--cycles")? as usize,
            "--tolerance-bytes" => tolerance = number("--tolerance-bytes")?,
            other => {
                return Err(format!(
                    "unknown option `{other}`; usage: soak [--cycles N] [--tolerance-bytes B]"
                ));
            }
        }
    }
    let caching = device(AllocatorKind::Caching)?;
    let native = device(AllocatorKind::NativeVmm)?;
    let step = (cycles / 10).max(1);
    let report = run_soak(
        &caching,
        Some(&native),
        &soak_routes(),
        cycles,
        DType::F32,
        |n| {
            if n % step == 0 {
                eprintln!("soak: cycle {n}/{cycles}");
            }
        },
    )
    .map_err(|e| e.to_string())?;
    println!("{}", report.format());
    let ok = report.within(tolerance);
    println!(
        "soak: {} (tolerance {tolerance} B)",
        if ok { "ok" } else { "MEMORY GREW" }
    );
    Ok(ok)
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("soak: {e}");
            ExitCode::from(2)
        }
    }
}
