//! The argument vocabulary: the dictionaries of values per kind of option, the command
//! words, which options each command has ([`specs`], from the command's own declarations)
//! and what an argv gives each of them as the command parses it ([`Given`]).

use clap::parser::ValueSource;

use crate::cli::{OptionSpec, options};

/// The sandbox entries path options name (relative to the working directory). The first
/// ones exist in the sandbox ([`Sandbox::create`]); the others are names to write or that
/// do not exist.
///
/// [`Sandbox::create`]: super::Sandbox::create
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
    // Single-file components (--transformer, --vae, ...).
    "tr.safetensors",
    "ae.safetensors",
];

pub(super) const SIZES: &[&str] = &[
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

pub(super) const COUNTS: &[&str] = &[
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
///
/// [`route_value`]: super::generate::route_value
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
    "transformer=diffusers_group_offload:use_stream=true,copy_ahead=true",
    "transformer=diffusers_group_offload:copy_ahead=true",
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

pub(super) const COMPONENTS: &[&str] = &[
    "transformer",
    "vae",
    "text_encoder",
    "text_encoder_2",
    "unet",
    "",
    "VAE",
    "text_encoder_3",
];

pub(super) const ROUTE_IDS: &[&str] = &[
    "none",
    "diffusers_group_offload",
    "linear_convolution",
    "native_vmm",
    "leaf_level",
    "",
];

pub(super) const ROUTE_KEYS: &[&str] = &[
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
    "compress",
    "page_cache_limit",
    "copy_ahead",
    "nope",
    "",
];

pub(super) const ROUTE_WORDS: &[&str] = &[
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

const CONFIGS: &[&str] = &[
    "tiny",
    "",
    "TINY",
    "tiny ",
    "small",
    "flux-dev",
    "qwen-tiny",
    "qwen-image",
];

/// Values of `--device`; those naming CUDA are turned into `cpu` by [`bounded`].
///
/// [`bounded`]: super::bounded
const DEVICES: &[&str] = &[
    "cpu", "host", "cuda:0", "cuda:99", "cuda:", "cuda:-1", "cuda:x", "gpu", "CPU", "cpu:0", "",
    "mps",
];

const DTYPES: &[&str] = &[
    "f32", "bf16", "f16", "F32", "fp16", "float32", "i64", "", "q4", "fp8", "fp8_e5m2",
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
pub(super) const VERSIONS: &[&str] = &["version", "--version", "-V", "--help", "-h"];

pub(super) const COMMAND_WORDS: &[&str] = &[
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
pub(super) enum Kind {
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
pub(super) fn kind_of(spec: &OptionSpec) -> Kind {
    match spec.name.as_str() {
        "vram-budget" | "host-budget" => Kind::Size,
        "seed" => Kind::Seed,
        "guidance" | "true-cfg-scale" => Kind::Float,
        "preset" => Kind::Preset,
        "route" => Kind::Route,
        "component" => Kind::Component,
        "config" => Kind::Config,
        "device" => Kind::Device,
        "dtype" => Kind::Dtype,
        "tiled-decode" => Kind::Tiled,
        "prompt" | "negative-prompt" => Kind::Prompt,
        _ => {
            let p = spec.value.as_deref().unwrap_or("");
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

pub(super) fn dictionary(kind: Kind) -> &'static [&'static str] {
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

pub(super) const ALL_KINDS: [Kind; 13] = [
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
pub(super) fn specs(command: &str) -> &'static [OptionSpec] {
    match options(command) {
        [] => options("run"),
        specs => specs,
    }
}

/// The values an argv gives each option of its command, as the command parses it (clap's
/// matches, the values as given), and its positional arguments (`inspect`'s PATH).
#[derive(Debug, Default)]
pub(super) struct Given {
    values: Vec<(&'static str, Vec<String>)>,
    /// The arguments that are not options.
    pub positionals: Vec<String>,
}

impl Given {
    /// What `argv` gives, or `None` when the command refuses it before running (a usage
    /// error) or only prints text (help, version).
    pub(super) fn of(argv: &[String]) -> Option<Self> {
        let command = argv.first()?;
        let matches = crate::cli::matches(argv).ok()?;
        let (name, sub) = matches.subcommand()?;
        if name != command {
            return None;
        }
        let raw = |id: &str| -> Vec<String> {
            sub.try_get_raw(id)
                .ok()
                .flatten()
                .map(|v| v.map(|s| s.to_string_lossy().into_owned()).collect())
                .unwrap_or_default()
        };
        let mut given = Self::default();
        for spec in options(name) {
            if spec.value.is_some() && sub.value_source(&spec.id) == Some(ValueSource::CommandLine)
            {
                given.values.push((spec.name.as_str(), raw(&spec.id)));
            }
        }
        if name == "inspect" {
            given.positionals = raw("paths");
        }
        Some(given)
    }

    /// The value of option `name` (the last one given).
    pub(super) fn get(&self, name: &str) -> Option<&str> {
        self.all(name).last().map(String::as_str)
    }

    /// Every value of option `name`, in order.
    pub(super) fn all(&self, name: &str) -> &[String] {
        self.values
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(&[], |(_, v)| v.as_slice())
    }
}
