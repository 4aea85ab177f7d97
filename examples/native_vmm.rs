//! The `native_vmm` route with a 1 MiB budget, on a device whose native allocator was
//! installed at bootstrap: as many leaves as fit stay resident, the rest stream.
//!
//! `cargo run -p ddo-examples --example native_vmm`

fn main() -> ddo_core::Result<()> {
    let snapshot = ddo_examples::run_route(ddo_routes::parse_spec("native_vmm:budget=1MiB")?)?;
    println!("{}", snapshot.format_profile());
    Ok(())
}
