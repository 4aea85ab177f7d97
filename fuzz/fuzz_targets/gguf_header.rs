//! Fuzz target: any bytes as a GGUF file, through `GgufFile::validate_bytes` (the parser
//! `GgufFile::open` runs on the mapping). It must return Ok or a `CoreError::Gguf` naming
//! the file — never panic, never read outside the input, and never allocate in proportion
//! to what the header claims (`cargo xtask fuzz` runs it with libFuzzer's
//! `-malloc_limit_mb`).

#![no_main]

use std::path::Path;

use ddo_core::CoreError;
use ddo_core::gguf::GgufFile;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = Path::new("fuzz.gguf");
    match GgufFile::validate_bytes(data, path) {
        Ok(_) => {}
        Err(CoreError::Gguf { path: p, .. }) => assert_eq!(p, path),
        Err(other) => panic!("untyped GGUF error: {other:?}"),
    }
});
