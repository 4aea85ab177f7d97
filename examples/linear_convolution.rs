//! The `linear_convolution` route: eager CPU offload of every leaf with pinned weights and
//! zero residency.
//!
//! `cargo run -p ddo-examples --example linear_convolution`

fn main() -> ddo_core::Result<()> {
    let snapshot = ddo_examples::run_route(ddo_routes::parse_spec("linear_convolution")?)?;
    println!("{}", snapshot.format_profile());
    Ok(())
}
