//! The main job for now: one small VAE-shaped component on the host backend under every
//! route, each output checked against resident execution, each route's profile printed.
//!
//! `cargo run --release -p ddo-examples --example all_routes`

fn main() -> ddo_core::Result<()> {
    for (label, route) in ddo_examples::all_routes()? {
        println!("== {label}: {}", route.describe());
        let snapshot = ddo_examples::run_route(route)?;
        println!("{}", snapshot.format_profile());
    }
    Ok(())
}
