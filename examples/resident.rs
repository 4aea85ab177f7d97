//! The `none` route: weights copied to the device once and kept.
//!
//! `cargo run -p ddo-examples --example resident`

fn main() -> ddo_core::Result<()> {
    let snapshot = ddo_examples::run_route(ddo_core::RouteSpec::resident())?;
    println!("{}", snapshot.format_profile());
    Ok(())
}
