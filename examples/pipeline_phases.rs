//! A pipeline in phases (prompt encoding, denoise, decode) under the `auto` preset, with a
//! phase boundary between phases: each component is released after its last phase, and
//! each phase's peak is recorded.
//!
//! `cargo run -p ddo-examples --example pipeline_phases`

fn main() -> ddo_core::Result<()> {
    for (phase, peak) in ddo_examples::run_pipeline_phases()? {
        println!("{phase:>16}: peak {}", ddo_metrics::format_bytes(peak));
    }
    Ok(())
}
