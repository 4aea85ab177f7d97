//! The `diffusers_group_offload` route, leaf level: without a stream (the VAE default) and
//! with a copy stream that prefetches the next leaf.
//!
//! `cargo run -p ddo-examples --example group_offload`

fn main() -> ddo_core::Result<()> {
    for use_stream in [false, true] {
        let route = ddo_core::RouteSpec::leaf_group(use_stream, false);
        println!("== {}", route.describe());
        println!("{}", ddo_examples::run_route(route)?.format_profile());
    }
    Ok(())
}
