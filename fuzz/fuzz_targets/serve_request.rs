//! Fuzz target: request bodies of `ddo serve` (issue 38). The first byte picks the endpoint
//! (DDO's own body or OpenAI's images body), the rest is the body, through
//! `ddo_cli::serve::api::fuzz_one`: the one parser every endpoint uses, then the checks a
//! session runs before anything heavy. A refusal must be a usage error (HTTP 400); a panic
//! is a crash. The seeds replay on stable in `crates/ddo-cli/tests/serve.rs`.

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(problem) = ddo_cli::serve::api::fuzz_one(data) {
        panic!("{problem}");
    }
});
