//! Fuzz target: any bytes as a safetensors file, through `Checkpoint::validate_bytes` (the
//! parser `Checkpoint::open` runs on the mapping). It must return Ok or a
//! `CoreError::Checkpoint` naming the file — never panic, never read outside the input, and
//! never allocate in proportion to what the header claims (`cargo xtask fuzz` runs it with
//! libFuzzer's `-malloc_limit_mb`).

#![no_main]

use std::path::Path;

use ddo_core::{Checkpoint, CoreError};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = Path::new("fuzz.safetensors");
    match Checkpoint::validate_bytes(data, path) {
        Ok(_) => {}
        Err(CoreError::Checkpoint { path: p, .. }) => assert_eq!(p, path),
        Err(other) => panic!("untyped checkpoint error: {other:?}"),
    }
});
