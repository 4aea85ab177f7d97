//! Fuzzing the command line: fuzz bytes become an argument vector ([`argv_from_bytes`]) that
//! a [`Sandbox`] runs through [`crate::execute`] and then checks. The cargo-fuzz target
//! `fuzz/fuzz_targets/cli_args.rs` (`cargo xtask fuzz --target cli_args`) and the stable test
//! `tests/cli_args_seeds.rs`, which replays the committed seeds `fuzz/corpus/cli_args/`, share
//! this module, so a seed means the same argv and the same checks in both.
//!
//! The argv: a command (`run`, `decode`, `resolve`, `inspect`, `bench`, `help`, version
//! spellings, a misspelled or raw command, or none), then option names drawn from that
//! command's `OPTIONS` (and misspelled or unknown ones), each value taken from a dictionary
//! of interesting values for its kind of option (sizes, counts, numbers, presets, route
//! specs, devices, dtypes, prompts, paths) or from raw fuzz bytes (lossy UTF-8).
//!
//! The host stays out of reach:
//! - every path value is a fixed name relative to the sandbox, the working directory while
//!   the command runs ([`PATHS`]); raw strings lose `/`, `\` and leading `~`, and `..` alone is
//!   renamed, so they name entries of the working directory only;
//! - a device value that would open CUDA (`cuda`, `cuda:N`) becomes `cpu`, wherever it is;
//! - `DDO_*` variables must be unset ([`Sandbox::create`] refuses otherwise; `cargo xtask
//!   fuzz` removes them) and `--no-env` is one of the options drawn.
//!
//! Work stays small, so a million executions take minutes: `run` and `bench` get
//! `--height 16 --width 16` (and `--steps 1 --max-sequence-length 8`, `--repeats 1 --warmup
//! 0`) unless the argv gives its own, and a count of work or an image side the argv gives is
//! kept only when it is small or one the command must refuse before any work (see
//! [`bounded`]); a side past the small range runs under at most [`LARGE_SIZE_BUDGET`] of
//! `--vram-budget`, so that the memory plan has to refuse it. `bench --weights` times the
//! VAE or CLIP, not the components that run on the folder's 512 text tokens. `flux-dev`
//! (24 GB of random weights) is drawn only where the host's available memory refuses it.
//!
//! The checks after each execution ([`Sandbox::run`]): no panic, caught or not; an error is
//! one non-empty line; no file the command read changed; a file was written or changed only
//! when the command succeeded and an output option named it, and a named output exists after
//! a success; no temporary file of [`crate::outputs`] remains. Outputs are removed and
//! overwritten sandbox files restored after each execution, so every execution sees the same
//! sandbox.

mod bounds;
mod entries;
mod generate;
mod sandbox;
mod vocab;

pub use bounds::{HUGE_AREA, HUGE_COUNT, LARGE_SIZE_BUDGET, SMALL_SIDE, bounded};
pub use entries::fixtures_dir;
pub use generate::{MAX_TOKENS, argv_from_bytes, contained, encode};
pub use sandbox::Sandbox;
pub use vocab::PATHS;
