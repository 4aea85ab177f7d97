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

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Once;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::SystemTime;

use crate::args::{self, OptSpec};
use crate::setup::DeviceChoice;

/// The most argv elements (after the command) one input makes.
pub const MAX_TOKENS: usize = 24;

/// The largest `--height`/`--width` a computing command (`run`, `bench`) keeps as given;
/// larger ones are lowered to it unless the image is past [`HUGE_AREA`].
pub const SMALL_SIDE: u128 = 16;

/// Pixels from which an image is kept as given (with a budget of at most
/// [`LARGE_SIZE_BUDGET`]): 2^40, whose transformer activations alone are hundreds of GiB.
pub const HUGE_AREA: u128 = 1 << 40;

/// The most `--vram-budget` an image past [`SMALL_SIDE`] runs under (12 GiB): the memory
/// plan must refuse it, where a larger budget would let it allocate.
pub const LARGE_SIZE_BUDGET: u64 = 12 << 30;

/// Values of loop counts (`--steps`, `--num-images`) from which a count is kept as given: no
/// host schedules or runs 2^40 of anything, so it must be refused.
pub const HUGE_COUNT: u128 = 1 << 40;

/// The sandbox entries path options name (relative to the working directory). The first
/// ones exist in the sandbox ([`Sandbox::create`]); the others are names to write or that
/// do not exist.
pub const PATHS: &[&str] = &[
    "vae",
    "vae/",
    "pipe",
    "pipe/",
    "pipe/vae",
    "pipe/transformer",
    "lat.safetensors",
    "lat16.safetensors",
    "noise.safetensors",
    "packed.safetensors",
    "emb.safetensors",
    "trunc.safetensors",
    "empty.safetensors",
    "garbage.safetensors",
    "nan.safetensors",
    "fifo.safetensors",
    "dir.safetensors",
    "link.safetensors",
    "dangling.safetensors",
    "pipe/vae/diffusion_pytorch_model.safetensors",
    "pipe/model_index.json",
    "vae/config.json",
    "dir",
    "dir/",
    "fifo.png",
    ".",
    "",
    // Names to write, or that are missing.
    "missing.safetensors",
    "nope/x.png",
    "out.png",
    "out.PNG",
    "out.safetensors",
    "out2.png",
    "lat_out.safetensors",
    "out.json",
    "plot",
    "out.txt",
    "out",
    "ddo-out.png",
    "pipe/vae/x.png",
    "vae/x.safetensors",
    "dir/x.png",
    "./out.png",
    "dir/../out.png",
];

const SIZES: &[&str] = &[
    "0",
    "1",
    "1KiB",
    "64KiB",
    "1MiB",
    "64MiB",
    "512MiB",
    "8GiB",
    "12GiB",
    "1TiB",
    "1e30GiB",
    "-1",
    "-1GiB",
    "4294967297",
    "4611686018427387904",
    "18446744073709551615",
    "18446744073709551616",
    "16777216TiB",
    "NaN",
    "inf",
    "",
    " 12GiB",
    "12 GiB",
    "12gib",
    "12GB",
    "12kB",
    "free",
    "free-1GiB",
    "12GiB\u{0}",
    "\u{661}\u{662}GiB",
    "12GiBx",
    "0x10",
    "1.5GiB",
];

const COUNTS: &[&str] = &[
    "0",
    "1",
    "2",
    "3",
    "4",
    "5",
    "8",
    "15",
    "16",
    "17",
    "32",
    "512",
    "513",
    "-1",
    "+1",
    "01",
    "1.5",
    "1e3",
    "",
    "x",
    " 1",
    "1 ",
    "4294967297",
    "1099511627776",
    "4611686018427387904",
    "18446744073709551615",
    "18446744073709551616",
    "NaN",
    "\u{663}",
];

const FLOATS: &[&str] = &[
    "3.5",
    "0",
    "-0",
    "-1",
    "1",
    "1e30",
    "3.4e35",
    "1e38",
    "1e-45",
    "NaN",
    "inf",
    "-inf",
    "",
    "x",
    "1,5",
    "0x10",
    "3.5f",
    "340282350000000000000000000000000000000",
    "1e999",
];

const PRESETS: &[&str] = &[
    "auto",
    "one_shot_fast",
    "low_ram_safe",
    "vmm_fast",
    "warm_process",
    "wsl_compat",
    "nvme_baseline",
    "off",
    "AUTO",
    "",
    "fast",
    " auto",
    "auto\u{0}",
];

/// Whole route specs, good and bad (`COMPONENT=ROUTE[:k=v,...]`, and bare routes for
/// `bench`); [`route_value`] also composes specs from the parts below.
const ROUTES: &[&str] = &[
    "transformer=leaf_level:budget=1KiB",
    "transformer=native_vmm:budget=10GiB",
    "transformer=native_vmm:budget=1KiB",
    "transformer=native_vmm:budget=0",
    "transformer=native_vmm:budget=free-1GiB",
    "transformer=native_vmm:budget=1KiB,budget=2KiB",
    "transformer=native_vmm:use_stream",
    "transformer=native_vmm:,,,",
    "transformer=native_vmm:nope=1",
    "transformer=diffusers_group_offload:use_stream=true,budget=1KiB",
    "transformer=diffusers_group_offload:use_stream=true,unit_bytes=1,ring_slots=2",
    "transformer=diffusers_group_offload:use_stream=true,ring_slots=0",
    "transformer=diffusers_group_offload:use_stream=true,ring_slots=18446744073709551615",
    "transformer=diffusers_group_offload:use_stream=true,pinned_limit=0",
    "transformer=diffusers_group_offload:use_stream=true,pinned_source=register,timeline=true",
    "transformer=diffusers_group_offload:use_stream=true,pinned_source=home",
    "text_encoder=diffusers_group_offload:offload_type=leaf_level",
    "text_encoder_2=diffusers_group_offload:offload_type=block_level,num_blocks_per_group=1,use_stream=true",
    "text_encoder_2=diffusers_group_offload:offload_type=block_level,num_blocks_per_group=0",
    "vae=linear_convolution",
    "vae=linear_convolution:timeline=maybe",
    "vae=none",
    "vae=none:budget=1KiB",
    "vae=diffusers_group_offload:record_stream=true",
    "vae=diffusers_group_offload:low_cpu_mem_usage=true,pinned=false",
    "transformer=none",
    ":budget=",
    "vae=",
    "=none",
    "vae",
    "unet=none",
    " vae = none ",
    "none",
    "linear_convolution",
    "native_vmm:budget=1KiB",
    "diffusers_group_offload:use_stream=true,timeline=true",
    "diffusers_group_offload:offload_type=leaf_level,use_stream=false",
];

const COMPONENTS: &[&str] = &[
    "transformer",
    "vae",
    "text_encoder",
    "text_encoder_2",
    "unet",
    "",
    "VAE",
    "text_encoder_3",
];

const ROUTE_IDS: &[&str] = &[
    "none",
    "diffusers_group_offload",
    "linear_convolution",
    "native_vmm",
    "leaf_level",
    "",
];

const ROUTE_KEYS: &[&str] = &[
    "offload_type",
    "num_blocks_per_group",
    "use_stream",
    "record_stream",
    "low_cpu_mem_usage",
    "pinned",
    "budget",
    "pinned_limit",
    "unit_bytes",
    "ring_slots",
    "pinned_source",
    "timeline",
    "nope",
    "",
];

const ROUTE_WORDS: &[&str] = &[
    "true",
    "false",
    "leaf_level",
    "block_level",
    "register",
    "home",
    "free",
    "free-1GiB",
    "maybe",
];

const CONFIGS: &[&str] = &["tiny", "", "TINY", "tiny ", "small", "flux-dev"];

/// Values of `--device`; those naming CUDA are turned into `cpu` by [`bounded`].
const DEVICES: &[&str] = &[
    "cpu", "host", "cuda:0", "cuda:99", "cuda:", "cuda:-1", "cuda:x", "gpu", "CPU", "cpu:0", "",
    "mps",
];

const DTYPES: &[&str] = &[
    "f32", "bf16", "f16", "F32", "fp16", "float32", "i64", "", "q4",
];

const TILED: &[&str] = &["on", "off", "auto", "ON", "true", "1", ""];

const PROMPTS: &[&str] = &[
    "a lighthouse on a rocky coast at dawn",
    "",
    " ",
    "\u{65e5}\u{672c}\u{8a9e}\u{306e}\u{30d7}\u{30ed}\u{30f3}\u{30d7}\u{30c8}",
    "\u{0}",
    "a\nb",
    "--json",
    "--out",
    "<|endoftext|></s><pad>",
];

/// Spellings of `version` and `help` as the command.
const VERSIONS: &[&str] = &["version", "--version", "-V", "--help", "-h"];

const COMMAND_WORDS: &[&str] = &[
    "run",
    "decode",
    "resolve",
    "inspect",
    "bench",
    "help",
    "version",
    "RUN",
    "runn",
    "",
    "-",
    "--",
    "help\u{0}",
];

/// What kind of value an option takes, for the dictionary its values come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Path,
    Size,
    Count,
    Seed,
    Float,
    Preset,
    Route,
    Component,
    Config,
    Device,
    Dtype,
    Tiled,
    Prompt,
}

/// The kind of `spec`'s value: by name, else by placeholder (`FILE`, `DIR`... are paths,
/// `N`/`PX` counts), else a count.
fn kind_of(spec: &OptSpec) -> Kind {
    match spec.name {
        "vram-budget" => Kind::Size,
        "seed" => Kind::Seed,
        "guidance" => Kind::Float,
        "preset" => Kind::Preset,
        "route" => Kind::Route,
        "component" => Kind::Component,
        "config" => Kind::Config,
        "device" => Kind::Device,
        "dtype" => Kind::Dtype,
        "tiled-decode" => Kind::Tiled,
        "prompt" => Kind::Prompt,
        _ => {
            let p = spec.value.unwrap_or("");
            if ["FILE", "DIR", "PATH", "PREFIX", "OUT"]
                .iter()
                .any(|w| p.contains(w))
            {
                Kind::Path
            } else {
                Kind::Count
            }
        }
    }
}

fn dictionary(kind: Kind) -> &'static [&'static str] {
    match kind {
        Kind::Path => PATHS,
        Kind::Size => SIZES,
        Kind::Count | Kind::Seed => COUNTS,
        Kind::Float => FLOATS,
        Kind::Preset => PRESETS,
        Kind::Route => ROUTES,
        Kind::Component => COMPONENTS,
        Kind::Config => CONFIGS,
        Kind::Device => DEVICES,
        Kind::Dtype => DTYPES,
        Kind::Tiled => TILED,
        Kind::Prompt => PROMPTS,
    }
}

const ALL_KINDS: [Kind; 13] = [
    Kind::Path,
    Kind::Size,
    Kind::Count,
    Kind::Seed,
    Kind::Float,
    Kind::Preset,
    Kind::Route,
    Kind::Component,
    Kind::Config,
    Kind::Device,
    Kind::Dtype,
    Kind::Tiled,
    Kind::Prompt,
];

/// The options of `command` (`run`'s for commands that have none: their names are still
/// worth trying).
fn specs(command: &str) -> &'static [OptSpec] {
    match command {
        "decode" => crate::decode::OPTIONS,
        "resolve" => crate::resolve::OPTIONS,
        "inspect" => crate::inspect::OPTIONS,
        "bench" => crate::bench::OPTIONS,
        _ => crate::run::OPTIONS,
    }
}

/// The fuzz bytes, read front to back; past the end every byte is 0.
struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn done(&self) -> bool {
        self.pos >= self.data.len()
    }

    fn byte(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos = (self.pos + 1).min(self.data.len());
        b
    }

    fn pick<'s>(&mut self, items: &[&'s str]) -> &'s str {
        items[self.byte() as usize % items.len()]
    }

    /// A length byte, then that many bytes as lossy UTF-8, kept inside the working
    /// directory ([`contained`]).
    fn raw(&mut self) -> String {
        let len = self.byte() as usize;
        let end = (self.pos + len).min(self.data.len());
        let s = String::from_utf8_lossy(&self.data[self.pos..end]).into_owned();
        self.pos = end;
        contained(&s)
    }
}

/// `s` without `/`, `\` and leading `~`, and `..` alone renamed: as a path it names an
/// entry of the working directory (or the directory itself), nothing above it.
pub fn contained(s: &str) -> String {
    let t: String = s.chars().filter(|c| *c != '/' && *c != '\\').collect();
    let t = t.trim_start_matches('~');
    if t == ".." {
        "dotdot".to_string()
    } else {
        t.to_string()
    }
}

/// A long value: thousands of ASCII, accented, emoji or digit characters.
fn long(n: u8) -> String {
    match n % 4 {
        0 => "x".repeat(10_000),
        1 => "\u{e9}".repeat(3_000),
        2 => "\u{1f980}".repeat(1_000),
        _ => "9".repeat(5_000),
    }
}

/// Whether `flux-dev`'s random weights (at 2 bytes a parameter) are more than this host has
/// available, so `ddo` refuses to build them before allocating.
fn flux_dev_is_refused() -> bool {
    let Some(c) = ddo_nn::pipeline::FluxPipelineConfig::named("flux-dev") else {
        return true;
    };
    let params =
        c.text_encoder.param_count() + c.text_encoder_2.param_count() + c.transformer.param_count();
    ddo_core::host_memory::mem_available().is_some_and(|free| params.saturating_mul(2) > free)
}

/// A value for an option of `kind`: from its dictionary, or (one time in 16) raw bytes, or
/// (one in 64) a long string.
fn value(kind: Kind, r: &mut Reader<'_>) -> String {
    let sel = r.byte();
    match sel {
        0xF0..=0xFB => r.raw(),
        0xFC..=0xFF => long(sel),
        _ if kind == Kind::Route && sel % 4 == 3 => route_value(r),
        _ => {
            let dict = dictionary(kind);
            let v = dict[sel as usize % dict.len()];
            if v == "flux-dev" && !flux_dev_is_refused() {
                "tiny".to_string()
            } else {
                v.to_string()
            }
        }
    }
}

/// A route spec composed from parts: `[COMPONENT=]ROUTE[:key=value,...]`.
fn route_value(r: &mut Reader<'_>) -> String {
    let shape = r.byte();
    let mut s = String::new();
    if shape & 1 == 0 {
        s += r.pick(COMPONENTS);
        s.push('=');
    }
    s += r.pick(ROUTE_IDS);
    let options = (shape >> 1) % 4;
    for i in 0..options {
        s.push(if i == 0 { ':' } else { ',' });
        let key = r.pick(ROUTE_KEYS);
        s += key;
        s.push('=');
        let v = match key {
            "budget" | "pinned_limit" | "unit_bytes" => r.pick(SIZES),
            "num_blocks_per_group" | "ring_slots" => r.pick(COUNTS),
            _ => r.pick(ROUTE_WORDS),
        };
        s += v;
    }
    s
}

/// An option name gone wrong: misspelled, wrongly dashed, or raw.
fn misspelled(name: &str, r: &mut Reader<'_>) -> String {
    match r.byte() % 9 {
        0 => format!("--{}", &name[..name.len().saturating_sub(1)]),
        1 => format!("--{name}x"),
        2 => format!("--{}", name.to_uppercase()),
        3 => format!("-{name}"),
        4 => format!("---{name}"),
        5 => format!("--{name} "),
        6 => format!("--{}", name.replace('-', "_")),
        7 => format!("--{name}="),
        _ => format!("--{}", r.raw()),
    }
}

/// Turns fuzz bytes into an argv for [`crate::execute`] (see the module documentation),
/// already [`bounded`].
pub fn argv_from_bytes(data: &[u8]) -> Vec<String> {
    let mut r = Reader { data, pos: 0 };
    let command: Option<String> = match r.byte() % 16 {
        0 | 1 | 10 => Some("run".into()),
        2 | 11 => Some("decode".into()),
        3 | 12 => Some("resolve".into()),
        4 | 13 => Some("inspect".into()),
        5 | 14 => Some("bench".into()),
        6 => Some("help".into()),
        7 => Some(r.pick(VERSIONS).into()),
        8 => Some(if r.byte().is_multiple_of(2) {
            r.pick(COMMAND_WORDS).into()
        } else {
            r.raw()
        }),
        9 => None,
        _ => Some(r.pick(&["run", "resolve"]).into()),
    };
    let Some(command) = command else {
        return Vec::new();
    };
    let specs = specs(&command);
    let mut argv = vec![command.clone()];
    while !r.done() && argv.len() <= MAX_TOKENS {
        let tag = r.byte();
        match tag % 10 {
            0..=4 => {
                let spec = &specs[r.byte() as usize % specs.len()];
                let inline = tag & 0x80 != 0;
                match spec.value {
                    None if inline && tag & 0x40 != 0 => {
                        argv.push(format!("--{}={}", spec.name, r.pick(COUNTS)));
                    }
                    None => argv.push(format!("--{}", spec.name)),
                    Some(_) => {
                        let v = value(kind_of(spec), &mut r);
                        if inline {
                            argv.push(format!("--{}={v}", spec.name));
                        } else {
                            argv.push(format!("--{}", spec.name));
                            argv.push(v);
                        }
                    }
                }
            }
            5 => {
                let spec = &specs[r.byte() as usize % specs.len()];
                argv.push(misspelled(spec.name, &mut r));
            }
            6 => {
                let kind = ALL_KINDS[r.byte() as usize % ALL_KINDS.len()];
                argv.push(value(kind, &mut r));
            }
            7 => argv.push(r.raw()),
            8 => argv.push(
                r.pick(&["--", "-", "--=", "--=x", "", "-h", "--help"])
                    .into(),
            ),
            _ => {
                let p = r.pick(if command == "help" {
                    COMMAND_WORDS
                } else {
                    PATHS
                });
                argv.push(p.into());
            }
        }
    }
    bounded(argv)
}

/// Bytes that [`argv_from_bytes`] turns into `argv` (then [`bounded`]): how the committed
/// seeds are written. An option of the command with a dictionary value is encoded as one,
/// other values and positionals as raw bytes (`contained` strings of at most 255 bytes) or
/// [`PATHS`] entries; `None` when an element cannot be encoded.
pub fn encode(argv: &[&str]) -> Option<Vec<u8>> {
    let Some((command, rest)) = argv.split_first() else {
        return Some(vec![9]);
    };
    let raw = |s: &str| -> Option<Vec<u8>> {
        (s.len() <= 255 && contained(s) == s).then(|| {
            let mut v = vec![s.len() as u8];
            v.extend_from_slice(s.as_bytes());
            v
        })
    };
    let mut out = match *command {
        "run" => vec![0],
        "decode" => vec![2],
        "resolve" => vec![3],
        "inspect" => vec![4],
        "bench" => vec![5],
        "help" => vec![6],
        c => match VERSIONS.iter().position(|v| *v == c) {
            Some(i) => vec![7, i as u8],
            None => [vec![8, 1], raw(c)?].concat(),
        },
    };
    let specs = specs(command);
    // A value of `kind`: its dictionary index (a selector byte that does not compose a
    // route), else raw bytes.
    let value_bytes = |kind: Kind, v: &str| -> Option<Vec<u8>> {
        let dict = dictionary(kind);
        if let Some(i) = dict.iter().position(|d| *d == v) {
            let sel = (0..0xF0u32)
                .find(|s| *s as usize % dict.len() == i && !(kind == Kind::Route && s % 4 == 3))?;
            return Some(vec![sel as u8]);
        }
        Some([vec![0xF0], raw(v)?].concat())
    };
    let mut i = 0;
    while i < rest.len() {
        let a = rest[i];
        let option = a.strip_prefix("--").and_then(|body| {
            let (name, inline) = match body.split_once('=') {
                Some((n, v)) => (n, Some(v)),
                None => (body, None),
            };
            let si = specs.iter().position(|s| s.name == name)?;
            Some((si, specs[si], inline))
        });
        match option {
            Some((si, spec, None)) if spec.value.is_none() => {
                out.extend([0, si as u8]);
                i += 1;
                continue;
            }
            Some((si, spec, Some(v))) if spec.value.is_some() => {
                out.extend([0x82, si as u8]);
                out.extend(value_bytes(kind_of(&spec), v)?);
                i += 1;
                continue;
            }
            Some((si, spec, None)) if i + 1 < rest.len() => {
                out.extend([0, si as u8]);
                out.extend(value_bytes(kind_of(&spec), rest[i + 1])?);
                i += 2;
                continue;
            }
            _ => {}
        }
        let listed = if *command == "help" {
            COMMAND_WORDS
        } else {
            PATHS
        };
        match listed.iter().position(|p| *p == a) {
            Some(p) => out.extend([9, p as u8]),
            None => out.extend([vec![7], raw(a)?].concat()),
        }
        i += 1;
    }
    Some(out)
}

/// A count as `usize::from_str` would read it (`+` allowed), if it is one.
fn count(v: &str) -> Option<u128> {
    v.parse::<u128>().ok()
}

/// The values of option `name` in `argv` (after `--name` and in `--name=value`), as mutable
/// strings. Conservative: a `--name` that is really another option's value counts too.
fn values_of<'a>(argv: &'a mut [String], name: &str) -> Vec<&'a mut String> {
    let flag = format!("--{name}");
    let prefix = format!("--{name}=");
    let mut follows = vec![false; argv.len()];
    for i in 1..argv.len() {
        follows[i] = argv[i - 1] == flag;
    }
    let mut out = Vec::new();
    for (i, a) in argv.iter_mut().enumerate() {
        if follows[i] || a.starts_with(&prefix) {
            out.push(a);
        }
    }
    out
}

/// The value in `s`: after the `=` of `--name=value`, else all of it.
fn value_part(s: &str) -> &str {
    match s.strip_prefix("--").and_then(|b| b.split_once('=')) {
        Some((_, v)) => v,
        None => s,
    }
}

/// Rewrites `s` (a whole value, or `--name=value`) with `f` applied to the value part.
fn rewrite(s: &mut String, f: impl Fn(&str) -> Option<String>) {
    let (head, v) = match s.strip_prefix("--").and_then(|b| b.split_once('=')) {
        Some((n, v)) => (format!("--{n}="), v.to_string()),
        None => (String::new(), s.clone()),
    };
    if let Some(new) = f(&v) {
        *s = head + &new;
    }
}

/// The options whose values count work (`(name, limit, refused)`): a value above `limit` and
/// below `refused` is lowered to `limit`; from `refused` on the command must refuse it
/// (`--max-sequence-length` above 512, loop counts no host runs, `ddo bench`'s
/// `MAX_FORWARDS`).
const WORK_COUNTS: [(&str, u128, u128); 5] = [
    ("steps", 2, HUGE_COUNT),
    ("repeats", 2, crate::bench::MAX_FORWARDS as u128 + 1),
    ("warmup", 1, crate::bench::MAX_FORWARDS as u128 + 1),
    ("num-images", 2, HUGE_COUNT),
    (
        "max-sequence-length",
        32,
        crate::run::MAX_SEQUENCE_LENGTH as u128 + 1,
    ),
];

/// The components `ddo bench` runs on the text length, 512 tokens for a pipeline folder.
const LONG_TEXT_COMPONENTS: [&str; 2] = ["transformer", "text_encoder_2"];

/// Keeps an argv cheap and off the GPU (see the module documentation):
/// - every value or `--x=value` naming a CUDA device becomes `cpu`;
/// - for `run` and `bench`: a count of work ([`WORK_COUNTS`]) above its small limit and below
///   the values the command refuses is lowered to the limit; `--height`/`--width` above [`SMALL_SIDE`] are
///   lowered to it unless the image reaches [`HUGE_AREA`] pixels, and then every
///   `--vram-budget` above [`LARGE_SIZE_BUDGET`] is lowered to it; the sizes and counts the
///   argv does not give are added small;
/// - `bench --weights` times the VAE or CLIP ([`LONG_TEXT_COMPONENTS`] become `vae`).
pub fn bounded(mut argv: Vec<String>) -> Vec<String> {
    for a in argv.iter_mut() {
        rewrite(a, |v| {
            // Only a value starting `cuda` parses as a CUDA device; the others are not
            // parsed (the error message `parse` builds is costly for long values).
            (v.starts_with("cuda") && matches!(DeviceChoice::parse(v), Ok(DeviceChoice::Cuda(_))))
                .then(|| "cpu".into())
        });
    }
    let command = argv.first().cloned().unwrap_or_default();
    if command != "run" && command != "bench" {
        return argv;
    }
    for (name, limit, refused) in WORK_COUNTS {
        for v in values_of(&mut argv, name) {
            rewrite(v, |v| {
                count(v)
                    .filter(|n| *n > limit && *n < refused)
                    .map(|_| limit.to_string())
            });
        }
    }
    let side = |argv: &mut Vec<String>, name: &str| -> u128 {
        values_of(argv, name)
            .iter()
            .filter_map(|v| count(value_part(v)))
            .max()
            .unwrap_or(SMALL_SIDE)
    };
    let (h, w) = (side(&mut argv, "height"), side(&mut argv, "width"));
    if h.max(w) > SMALL_SIDE {
        if h.saturating_mul(w) >= HUGE_AREA {
            for v in values_of(&mut argv, "vram-budget") {
                rewrite(v, |v| {
                    ddo_core::config::parse_size("vram-budget", v)
                        .ok()
                        .filter(|b| *b > LARGE_SIZE_BUDGET)
                        .map(|_| "12GiB".into())
                });
            }
        } else {
            for name in ["height", "width"] {
                for v in values_of(&mut argv, name) {
                    rewrite(v, |v| {
                        count(v)
                            .filter(|n| *n > SMALL_SIDE)
                            .map(|_| SMALL_SIDE.to_string())
                    });
                }
            }
        }
    }
    // `ddo bench` of a pipeline folder's transformer or T5 works on 512 text tokens (a
    // folder's `max_sequence_length`, which bench cannot lower): its VAE and CLIP are timed.
    let folder = !values_of(&mut argv, "weights").is_empty();
    if command == "bench" && folder {
        for v in values_of(&mut argv, "component") {
            rewrite(v, |v| {
                LONG_TEXT_COMPONENTS.contains(&v).then(|| "vae".into())
            });
        }
    }
    // What the argv leaves at a default is added small, when the parse is known to hold.
    if let Ok(parsed) = args::parse(&command, specs(&command), &argv[1..]) {
        let defaults: &[(&str, &str)] = if command == "run" {
            &[
                ("steps", "1"),
                ("height", "16"),
                ("width", "16"),
                ("max-sequence-length", "8"),
            ]
        } else {
            &[
                ("repeats", "1"),
                ("warmup", "0"),
                ("height", "16"),
                ("width", "16"),
            ]
        };
        for (name, v) in defaults {
            if parsed.get(name).is_none() && specs(&command).iter().any(|s| s.name == *name) {
                argv.push(format!("--{name}={v}"));
            }
        }
        if command == "bench"
            && parsed.get("weights").is_some()
            && parsed.get("component").is_none()
        {
            argv.push("--component=vae".into());
        }
    }
    if within_bounds(&argv) {
        argv
    } else {
        vec!["help".into()]
    }
}

/// Whether `argv`, as the command parses it, keeps the bounds [`bounded`] sets: no CUDA
/// device, and for `run`/`bench` small counts of work and images (or ones it refuses).
fn within_bounds(argv: &[String]) -> bool {
    let Some(command) = argv.first() else {
        return true;
    };
    let Ok(parsed) = args::parse(command, specs(command), &argv[1..]) else {
        return true;
    };
    if parsed
        .get("device")
        .is_some_and(|d| matches!(DeviceChoice::parse(d), Ok(DeviceChoice::Cuda(_))))
    {
        return false;
    }
    if command != "run" && command != "bench" {
        return true;
    }
    if command == "bench"
        && parsed.get("weights").is_some()
        && parsed
            .get("component")
            .is_none_or(|c| LONG_TEXT_COMPONENTS.contains(&c))
    {
        return false;
    }
    let number = |name: &str| parsed.get(name).and_then(|v| v.parse::<usize>().ok());
    for (name, limit, refused) in WORK_COUNTS {
        if number(name).is_some_and(|n| n as u128 > limit && (n as u128) < refused) {
            return false;
        }
    }
    let (h, w) = (number("height"), number("width"));
    let (Some(h), Some(w)) = (h, w) else {
        // A side that does not parse is refused before any work.
        return true;
    };
    let (h, w) = (h as u128, w as u128);
    if h.max(w) <= SMALL_SIDE {
        return true;
    }
    let budget = parsed
        .get("vram-budget")
        .and_then(|b| ddo_core::config::parse_size("vram-budget", b).ok());
    h.saturating_mul(w) >= HUGE_AREA && budget.is_none_or(|b| b <= LARGE_SIZE_BUDGET)
}

/// Counts every panic of the process (caught ones too), then calls the hook installed
/// before (libFuzzer's aborts the process).
static PANICS: AtomicUsize = AtomicUsize::new(0);

fn count_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            previous(info);
        }));
    });
}

/// What a sandbox entry is made of.
#[derive(Debug, Clone)]
enum Entry {
    Dir,
    File(Vec<u8>),
    /// A copy of a file of the repository's `fixtures/` (read again to restore it).
    Copy(PathBuf),
    Link(PathBuf),
    Fifo,
}

/// What identifies an entry's state cheaply: its type, and for files size, mtime and inode.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Print {
    kind: u8,
    len: u64,
    modified: Option<SystemTime>,
    inode: u64,
}

fn print(path: &Path) -> Option<Print> {
    let m = fs::symlink_metadata(path).ok()?;
    let t = m.file_type();
    let kind = if t.is_dir() {
        1
    } else if t.is_symlink() {
        2
    } else if t.is_file() {
        0
    } else {
        3
    };
    #[cfg(unix)]
    let inode = std::os::unix::fs::MetadataExt::ino(&m);
    #[cfg(not(unix))]
    let inode = 0;
    // A folder's size and time change when a file comes and goes inside (the output
    // probe): what is inside is checked entry by entry instead.
    let (len, modified) = if kind == 1 {
        (0, None)
    } else {
        (m.len(), m.modified().ok())
    };
    Some(Print {
        kind,
        len,
        modified,
        inode,
    })
}

/// The repository's `fixtures/` folder.
pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

/// A safetensors file of f32 tensors `(name, shape, values)`.
fn safetensors(tensors: &[(&str, &[usize], &[f32])]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, shape, values) in tensors {
        let start = data.len();
        for v in *values {
            data.extend_from_slice(&v.to_le_bytes());
        }
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let header = serde_json::Value::Object(header).to_string();
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&data);
    bytes
}

/// Deterministic values in about [-1, 1].
fn wave(n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i as f32) * 0.7).sin()).collect()
}

/// The sandbox's entries, relative to its root: `pipe/` (the `flux_pipeline` fixture's model
/// folders), `vae/` (a copy of its VAE: 4 latent channels, 186 KB; `vae_flux`'s decoder is 15
/// times its size and would cost most of a decode's time), latents and embeddings that fit
/// them at 16x16 pixels, latents with 16 channels, broken safetensors, a FIFO, folders named
/// like files, links.
fn entries(fixtures: &Path) -> io::Result<Vec<(PathBuf, Entry)>> {
    let mut out: Vec<(PathBuf, Entry)> = Vec::new();
    let copy_tree = |from: &Path, to: &str, out: &mut Vec<(PathBuf, Entry)>| {
        fn walk(from: &Path, to: &Path, out: &mut Vec<(PathBuf, Entry)>) -> io::Result<()> {
            out.push((to.to_path_buf(), Entry::Dir));
            let mut names: Vec<_> = fs::read_dir(from)?.collect::<io::Result<Vec<_>>>()?;
            names.sort_by_key(|e| e.file_name());
            for e in names {
                let (src, dst) = (e.path(), to.join(e.file_name()));
                if e.file_type()?.is_dir() {
                    walk(&src, &dst, out)?;
                } else {
                    out.push((dst, Entry::Copy(src)));
                }
            }
            Ok(())
        }
        walk(from, Path::new(to), out)
    };
    let pipe = fixtures.join("flux_pipeline");
    copy_tree(&pipe.join("vae"), "vae", &mut out)?;
    out.push(("pipe".into(), Entry::Dir));
    out.push((
        "pipe/model_index.json".into(),
        Entry::Copy(pipe.join("model_index.json")),
    ));
    for d in [
        "scheduler",
        "text_encoder",
        "text_encoder_2",
        "tokenizer",
        "tokenizer_2",
        "transformer",
        "vae",
    ] {
        copy_tree(&pipe.join(d), &format!("pipe/{d}"), &mut out)?;
    }
    let lat = safetensors(&[("latents", &[1, 4, 8, 8], &wave(256))]);
    out.push((
        "trunc.safetensors".into(),
        Entry::File(lat[..lat.len() / 2].to_vec()),
    ));
    out.push(("lat.safetensors".into(), Entry::File(lat)));
    out.push((
        "lat16.safetensors".into(),
        Entry::Copy(fixtures.join("vae_flux/inputs.safetensors")),
    ));
    out.push((
        "noise.safetensors".into(),
        Entry::File(safetensors(&[("noise", &[1, 4, 8, 8], &wave(256))])),
    ));
    out.push((
        "packed.safetensors".into(),
        Entry::File(safetensors(&[("latents", &[1, 16, 16], &wave(256))])),
    ));
    out.push((
        "emb.safetensors".into(),
        Entry::Copy(pipe.join("inputs.safetensors")),
    ));
    out.push(("empty.safetensors".into(), Entry::File(Vec::new())));
    let mut garbage = u64::MAX.to_le_bytes().to_vec();
    garbage.extend_from_slice(b"{\"latents\":");
    out.push(("garbage.safetensors".into(), Entry::File(garbage)));
    let mut nan = wave(256);
    nan[7] = f32::NAN;
    out.push((
        "nan.safetensors".into(),
        Entry::File(safetensors(&[("latents", &[1, 4, 8, 8], &nan)])),
    ));
    out.push(("dir".into(), Entry::Dir));
    out.push(("dir.safetensors".into(), Entry::Dir));
    if cfg!(unix) {
        out.push(("fifo.safetensors".into(), Entry::Fifo));
        out.push(("fifo.png".into(), Entry::Fifo));
        out.push((
            "link.safetensors".into(),
            Entry::Link("lat.safetensors".into()),
        ));
        out.push((
            "dangling.safetensors".into(),
            Entry::Link("missing-target.safetensors".into()),
        ));
    }
    Ok(out)
}

/// Makes `entry` at `path` (replacing whatever is there).
fn make(path: &Path, entry: &Entry) -> io::Result<()> {
    if let Ok(m) = fs::symlink_metadata(path) {
        if m.is_dir() {
            if matches!(entry, Entry::Dir) {
                return Ok(());
            }
            fs::remove_dir_all(path)?;
        } else {
            fs::remove_file(path)?;
        }
    }
    match entry {
        Entry::Dir => fs::create_dir(path),
        Entry::File(bytes) => fs::write(path, bytes),
        Entry::Copy(from) => fs::copy(from, path).map(|_| ()),
        Entry::Link(target) => {
            #[cfg(unix)]
            {
                std::os::unix::fs::symlink(target, path)
            }
            #[cfg(not(unix))]
            {
                let _ = target;
                Ok(())
            }
        }
        Entry::Fifo => {
            let ok = std::process::Command::new("mkfifo")
                .arg(path)
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                Ok(())
            } else {
                Err(io::Error::other(format!(
                    "mkfifo {} failed (is coreutils' mkfifo on PATH?)",
                    path.display()
                )))
            }
        }
    }
}

/// Every entry under `dir` (not following links), relative to `root`.
fn scan(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, Print>) {
    let Ok(rd) = fs::read_dir(dir) else { return };
    for e in rd.flatten() {
        let path = e.path();
        let Some(p) = print(&path) else { continue };
        let is_dir = p.kind == 1;
        if let Ok(rel) = path.strip_prefix(root) {
            out.insert(rel.to_path_buf(), p);
        }
        if is_dir {
            scan(root, &path, out);
        }
    }
}

/// Where a path the command was given leads, as `Outputs` resolves it: the file itself
/// once links are followed, else its folder's canonical path joined with its name.
fn resolved(path: &Path) -> Option<PathBuf> {
    if let Ok(p) = fs::canonicalize(path) {
        return Some(p);
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    Some(fs::canonicalize(parent).ok()?.join(path.file_name()?))
}

/// The files an argv reads and those it may write, resolved: each output as the group of
/// paths that name it (as given, and resolved).
#[derive(Debug, Default)]
struct Named {
    inputs: Vec<PathBuf>,
    outputs: Vec<Vec<PathBuf>>,
}

impl Named {
    /// What `argv` names, by the same parser the command uses: path options named `out*`,
    /// `save-*` or `plot` (`PREFIX.svg` and `PREFIX.png`) are outputs (`run` writes
    /// `ddo-out.png` without `--out`), other path options and `inspect`'s PATH are inputs.
    /// Nothing when the argv does not parse.
    fn of(argv: &[String], root: &Path) -> Self {
        let mut named = Self::default();
        let Some(command) = argv.first() else {
            return named;
        };
        if !COMMANDS_WITH_FILES.contains(&command.as_str()) {
            return named;
        }
        let specs = specs(command);
        let Ok(parsed) = args::parse(command, specs, &argv[1..]) else {
            return named;
        };
        let paths = |p: &str| {
            let path = Path::new(p);
            let mut v = vec![root.join(path)];
            v.extend(resolved(path));
            v
        };
        for spec in specs.iter().filter(|s| kind_of(s) == Kind::Path) {
            for v in parsed.all(spec.name) {
                let n = spec.name;
                if n == "plot" {
                    named.outputs.push(paths(&format!("{v}.svg")));
                    named.outputs.push(paths(&format!("{v}.png")));
                } else if n.starts_with("out") || n.starts_with("save-") {
                    named.outputs.push(paths(v));
                } else {
                    named.inputs.extend(paths(v));
                }
            }
        }
        if command == "run" && parsed.get("out").is_none() {
            named.outputs.push(paths("ddo-out.png"));
        }
        if command == "inspect" {
            for p in &parsed.positionals {
                named.inputs.extend(paths(p));
            }
        }
        named
    }

    fn is_input(&self, path: &Path) -> bool {
        self.inputs.iter().any(|i| path == i || path.starts_with(i))
    }

    /// Whether `path` is a named output, or `STEM-N.EXT` beside one (`run`'s images).
    fn is_output(&self, path: &Path) -> bool {
        self.outputs.iter().flatten().any(|o| names(o, path))
    }

    /// A named output of which nothing exists (checked after a success).
    fn missing_output(&self, found: &BTreeMap<PathBuf, Print>, root: &Path) -> Option<PathBuf> {
        self.outputs
            .iter()
            .find(|group| {
                !group
                    .iter()
                    .any(|o| o.exists() || found.keys().any(|rel| names(o, &root.join(rel))))
            })
            .and_then(|group| group.first().cloned())
    }
}

/// Whether `path` is the output `o`, or `STEM-N.EXT` beside it (`run`'s images).
fn names(o: &Path, path: &Path) -> bool {
    if path == o {
        return true;
    }
    let (Some(name), Some(stem)) = (path.file_name(), o.file_stem()) else {
        return false;
    };
    let ext = o
        .extension()
        .map_or(String::new(), |e| format!(".{}", e.to_string_lossy()));
    path.parent() == o.parent()
        && name
            .to_string_lossy()
            .strip_prefix(&format!("{}-", stem.to_string_lossy()))
            .and_then(|rest| rest.strip_suffix(&ext))
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// The commands that read or write files.
const COMMANDS_WITH_FILES: [&str; 5] = ["run", "decode", "resolve", "inspect", "bench"];

/// `Ok` without `problems`, else one line naming the argv, its outcome and every problem.
fn report(
    argv: &[String],
    result: &crate::CliResult<()>,
    problems: Vec<String>,
) -> Result<(), String> {
    if problems.is_empty() {
        return Ok(());
    }
    Err(format!(
        "ddo {argv:?} ({}): {}",
        match result {
            Ok(()) => "succeeded".to_string(),
            Err(e) => format!("failed: {e}"),
        },
        problems.join("; ")
    ))
}

/// A folder of inputs the command runs in (the working directory while it runs), checked
/// after every execution and put back as it was.
#[derive(Debug)]
pub struct Sandbox {
    root: PathBuf,
    entries: Vec<(PathBuf, Entry, Print)>,
    executions: u64,
}

impl Sandbox {
    /// Makes the sandbox at `root` (removing what was there) and installs a panic hook that
    /// counts panics before calling the previous one. Refused while a `DDO_*` variable is set
    /// (the command would read it).
    pub fn create(root: &Path) -> io::Result<Self> {
        let set: Vec<String> = std::env::vars_os()
            .filter_map(|(k, _)| k.into_string().ok())
            .filter(|k| k.starts_with("DDO_"))
            .collect();
        if !set.is_empty() {
            return Err(io::Error::other(format!(
                "unset {} first: the fuzzed command would read them",
                set.join(", ")
            )));
        }
        if root.exists() {
            fs::remove_dir_all(root)?;
        }
        fs::create_dir_all(root)?;
        let root = fs::canonicalize(root)?;
        let mut made = Vec::new();
        for (rel, entry) in entries(&fixtures_dir())? {
            let path = root.join(&rel);
            make(&path, &entry)?;
            let p = print(&path).ok_or_else(|| io::Error::other(format!("{rel:?} missing")))?;
            made.push((rel, entry, p));
        }
        count_panics();
        Ok(Self {
            root,
            entries: made,
            executions: 0,
        })
    }

    /// A sandbox under the temporary directory, named by the process id; those of
    /// processes that have exited are removed first (Linux: by `/proc`).
    pub fn create_in_temp() -> io::Result<Self> {
        let tmp = std::env::temp_dir();
        if Path::new("/proc/self").exists()
            && let Ok(rd) = fs::read_dir(&tmp)
        {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if let Some(pid) = name.strip_prefix("ddo-fuzz-cli-")
                    && pid.bytes().all(|b| b.is_ascii_digit())
                    && !Path::new("/proc").join(pid).exists()
                {
                    let _ = fs::remove_dir_all(e.path());
                }
            }
        }
        Self::create(&tmp.join(format!("ddo-fuzz-cli-{}", std::process::id())))
    }

    /// The sandbox's folder.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Runs `argv` through [`crate::execute`] and checks what it did (see the module
    /// documentation), then removes its outputs and restores what it overwrote. `Err` lists
    /// every broken invariant, a panic first (under libFuzzer the panic hook aborts before).
    pub fn run(&mut self, argv: &[String]) -> Result<(), String> {
        // The command runs in the sandbox; the process's own working directory (libFuzzer's
        // relative paths) is back once it returns.
        let home = std::env::current_dir().map_err(|e| format!("no working directory: {e}"))?;
        std::env::set_current_dir(&self.root)
            .map_err(|e| format!("cannot enter {}: {e}", self.root.display()))?;
        let named = Named::of(argv, &self.root);
        let panics = PANICS.load(Ordering::SeqCst);
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            crate::execute(argv, &mut io::sink())
        }));
        std::env::set_current_dir(&home)
            .map_err(|e| format!("cannot go back to {}: {e}", home.display()))?;
        let mut problems = Vec::new();
        let result = match outcome {
            Ok(r) => r,
            Err(panic) => {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                problems.push(format!("panicked: {message}"));
                Err(crate::CliError::runtime("(panicked)", ""))
            }
        };
        if PANICS.load(Ordering::SeqCst) != panics && problems.is_empty() {
            problems.push("panicked (the panic was caught inside the command)".to_string());
        }
        match &result {
            Err(e) => {
                if e.message.trim().is_empty() || e.message.contains(['\n', '\r']) {
                    problems.push(format!("the error is not one line: {:?}", e.message));
                }
            }
            Ok(()) => {
                let known = ["run", "decode", "resolve", "inspect", "bench", "help"]
                    .iter()
                    .chain(&["--help", "-h", "version", "--version", "-V"])
                    .any(|c| argv.first().is_some_and(|a| a == c));
                if !known {
                    problems.push("succeeded without a known command".into());
                }
            }
        }
        let failed = result.is_err();
        self.executions += 1;
        // `help`, the version, an unknown command or none print or fail in `lib.rs` without
        // touching a file: the sandbox is not scanned for them.
        if !COMMANDS_WITH_FILES.contains(&argv.first().map_or("", String::as_str)) {
            return report(argv, &result, problems);
        }
        let mut found = BTreeMap::new();
        scan(&self.root, &self.root, &mut found);
        let mut restore = Vec::new();
        for (i, (rel, _, before)) in self.entries.iter().enumerate() {
            let now = found.remove(rel);
            if now.as_ref() == Some(before) {
                continue;
            }
            let path = self.root.join(rel);
            let how = if now.is_none() { "removed" } else { "changed" };
            if named.is_input(&path) {
                problems.push(format!("{how} {}, which it read", rel.display()));
            } else if failed {
                problems.push(format!(
                    "{how} {} and failed (a partial output)",
                    rel.display()
                ));
            } else if !named.is_output(&path) {
                problems.push(format!("{how} {}, which no option named", rel.display()));
            }
            restore.push(i);
        }
        for rel in found.keys() {
            let path = self.root.join(rel);
            let name = rel.to_string_lossy();
            if name.contains(".ddo-") && name.ends_with(".tmp") {
                problems.push(format!("left the temporary file {name}"));
            } else if failed {
                problems.push(format!("wrote {name} and failed (a partial output)"));
            } else if !named.is_output(&path) {
                problems.push(format!("wrote {name}, which no option named"));
            }
        }
        if let (false, Some(p)) = (failed, named.missing_output(&found, &self.root)) {
            problems.push(format!("succeeded without writing {}", p.display()));
        }
        // Back to the sandbox as made: new entries go (deepest first), changed ones are
        // made again.
        for rel in found.keys().rev() {
            let path = self.root.join(rel);
            let _ = match fs::symlink_metadata(&path) {
                Ok(m) if m.is_dir() => fs::remove_dir_all(&path),
                _ => fs::remove_file(&path),
            };
        }
        for i in restore {
            let (rel, entry, _) = &self.entries[i];
            let path = self.root.join(rel);
            if let Err(e) = make(&path, entry) {
                problems.push(format!("cannot restore {}: {e}", rel.display()));
            }
            if let Some(p) = print(&path) {
                self.entries[i].2 = p;
            }
        }
        if self.executions.is_multiple_of(16_384)
            && let Err(e) = self.verify_contents()
        {
            problems.push(e);
        }
        report(argv, &result, problems)
    }

    /// Compares the bytes of every sandbox file with what it was made from.
    pub fn verify_contents(&self) -> Result<(), String> {
        for (rel, entry, _) in &self.entries {
            let path = self.root.join(rel);
            let expected = match entry {
                Entry::File(b) => b.clone(),
                Entry::Copy(from) => {
                    fs::read(from).map_err(|e| format!("{}: {e}", from.display()))?
                }
                _ => continue,
            };
            if fs::read(&path).ok().as_deref() != Some(expected.as_slice()) {
                return Err(format!("the bytes of {} changed", rel.display()));
            }
        }
        Ok(())
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.root);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dictionary_paths_stay_inside_the_working_directory() {
        for p in PATHS {
            assert!(!p.starts_with('/') && !p.starts_with('~'), "{p}");
            let depth = Path::new(p).components().try_fold(0i32, |d, c| {
                let d = match c {
                    std::path::Component::ParentDir => d - 1,
                    std::path::Component::Normal(_) => d + 1,
                    std::path::Component::CurDir => d,
                    _ => -100,
                };
                (d >= 0).then_some(d)
            });
            assert!(depth.is_some(), "{p} leaves the sandbox");
        }
        for bad in ["/etc/passwd", "..", "~/x", "a\\..\\..\\b", "../../x"] {
            let c = contained(bad);
            assert!(!c.contains('/') && !c.contains('\\') && c != ".." && !c.starts_with('~'));
        }
    }

    #[test]
    fn cuda_never_survives_and_work_stays_small() {
        let argv = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let b = bounded(argv(&[
            "run",
            "--device",
            "cuda:0",
            "--device=cuda",
            "cuda:3",
            "--steps",
            "1000",
            "--height=4096",
            "--width",
            "8",
        ]));
        assert!(!b.iter().any(|a| a.contains("cuda")), "{b:?}");
        assert!(b.contains(&"1".into()) || b.contains(&"2".into()), "{b:?}");
        assert!(b.contains(&"--height=16".to_string()), "{b:?}");
        let b = bounded(argv(&[
            "run",
            "--config",
            "tiny",
            "--height",
            "4294967296",
            "--width",
            "4294967296",
            "--vram-budget",
            "18446744073709551615",
        ]));
        assert!(b.contains(&"12GiB".to_string()), "{b:?}");
        assert!(b.contains(&"--steps=1".to_string()), "{b:?}");
        let b = bounded(argv(&["bench", "--config", "tiny"]));
        for o in ["--repeats=1", "--warmup=0", "--height=16", "--width=16"] {
            assert!(b.contains(&o.to_string()), "{b:?}");
        }
    }

    #[test]
    fn encoded_argvs_decode_to_themselves() {
        for argv in [
            &["run", "--config", "tiny", "--out", "out.png", "--json"][..],
            &[
                "run",
                "--prompt=a red fox",
                "--route",
                "vae=none",
                "--steps",
                "2",
            ],
            &["decode", "--weights", "vae", "--latents", "lat.safetensors"],
            &["inspect", "pipe/vae", "--vram-budget=12GiB"],
            &["bench", "--route", "none", "--plot", "plot", "stray"],
            &["help", "run"],
            &["-V"],
            &["runn", "--x"],
            &[],
        ] {
            let bytes = encode(argv).expect("encodable");
            let decoded = argv_from_bytes(&bytes);
            let want = bounded(argv.iter().map(|s| s.to_string()).collect());
            assert_eq!(decoded, want, "{argv:?}");
        }
        assert_eq!(encode(&["run", "--out", "/etc/x.png"]), None);
    }

    #[test]
    fn outputs_and_their_numbered_images_are_named() {
        let o = Path::new("/s/out.png");
        assert!(names(o, o));
        assert!(names(o, Path::new("/s/out-0.png")));
        assert!(names(o, Path::new("/s/out-12.png")));
        assert!(!names(o, Path::new("/s/out-.png")));
        assert!(!names(o, Path::new("/s/out-1.safetensors")));
        assert!(!names(o, Path::new("/t/out-1.png")));
        assert!(!names(o, Path::new("/s/lat.safetensors")));
    }

    #[test]
    fn every_input_makes_an_argv() {
        for seed in 0..2000u32 {
            let data: Vec<u8> = (0..64)
                .map(|i| (seed.wrapping_mul(2654435761).wrapping_add(i * 40503) >> 13) as u8)
                .collect();
            let argv = argv_from_bytes(&data);
            assert!(argv.len() <= MAX_TOKENS + 8);
            assert!(!argv.iter().any(|a| a.starts_with('/')), "{argv:?}");
        }
    }
}
