//! Configuration: route ids, presets, component kinds, route options and their validation
//! ([`RouteSpec`]), budgets, and the [`Settings`] a pipeline is offloaded with.
//!
//! Parsing is strict: an unknown name or a contradictory combination is a typed error with
//! a hint, never a silent default.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use crate::error::{CoreError, Result};

/// A route's id: its name, as route specs, errors and profiles spell it. Open: a route
/// crate names its own ([`RouteId::new`]) and the registry (`ddo_routes`) lists it beside
/// the routes DDO builds in, whose ids are the constants here (presets name them). Names
/// are looked up through a [`RouteCatalog`], the registry's being the one that knows every
/// route.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RouteId(&'static str);

impl RouteId {
    /// `none`: resident; weights moved to the device once and kept.
    pub const RESIDENT: RouteId = RouteId("none");
    /// `diffusers_group_offload`: leaf- or block-level groups, with or without a copy stream.
    pub const DIFFUSERS_GROUP_OFFLOAD: RouteId = RouteId("diffusers_group_offload");
    /// `linear_convolution`: eager CPU offload of each leaf, optional pinned weights.
    pub const LINEAR_CONVOLUTION: RouteId = RouteId("linear_convolution");
    /// `native_vmm`: weights in a pool on CUDA virtual memory, with a budget.
    pub const NATIVE_VMM: RouteId = RouteId("native_vmm");

    /// The routes DDO builds in (the ones presets name); the registry lists these and any
    /// other route it links.
    pub const BUILT_IN: [RouteId; 4] = [
        RouteId::RESIDENT,
        RouteId::DIFFUSERS_GROUP_OFFLOAD,
        RouteId::LINEAR_CONVOLUTION,
        RouteId::NATIVE_VMM,
    ];

    /// The id of a route named `name` (lowercase letters, digits and `_`, as specs write
    /// it; the registry refuses a name that is not, or that another route has).
    pub const fn new(name: &'static str) -> Self {
        RouteId(name)
    }

    /// The route's name.
    pub const fn as_str(self) -> &'static str {
        self.0
    }

    /// Whether `name` may name a route: non-empty, lowercase ASCII letters, digits and `_`.
    pub fn is_valid_name(name: &str) -> bool {
        !name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
    }
}

impl fmt::Display for RouteId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where route names are looked up when specs are parsed: the registry's catalog
/// (`ddo_routes::catalog()`) knows every route linked; an array or `Vec` of ids
/// (such as [`RouteId::BUILT_IN`]) is a catalog of just those.
pub trait RouteCatalog {
    /// Every route's id, in the registry's order.
    fn ids(&self) -> Vec<RouteId>;

    /// The names of the options route `id` takes (its option table), where the catalog
    /// knows them: the hint for an option a spec misspells names them. None by default.
    fn options_of(&self, id: RouteId) -> Option<Vec<&'static str>> {
        let _ = id;
        None
    }

    /// The route named `name`, or the typed error listing the names there are.
    fn find(&self, name: &str) -> Result<RouteId> {
        let ids = self.ids();
        ids.iter()
            .copied()
            .find(|r| r.as_str() == name)
            .ok_or_else(|| CoreError::UnknownRoute {
                name: name.to_string(),
                valid: ids
                    .iter()
                    .map(|r| r.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            })
    }
}

impl<const N: usize> RouteCatalog for [RouteId; N] {
    fn ids(&self) -> Vec<RouteId> {
        self.to_vec()
    }
}

impl RouteCatalog for Vec<RouteId> {
    fn ids(&self) -> Vec<RouteId> {
        self.clone()
    }
}

/// A named bundle of route choices per component.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Preset {
    /// Resolves to `one_shot_fast`.
    #[default]
    Auto,
    /// One generation, as fast as possible within memory.
    OneShotFast,
    /// Least host RAM.
    LowRamSafe,
    /// The native VMM route for the transformer (needs the native allocator bootstrap).
    VmmFast,
    /// A long-lived process that keeps weights warm.
    WarmProcess,
    /// WSL: pinned memory is scarce.
    WslCompat,
    /// The historical staged-host baseline.
    NvmeBaseline,
    /// DDO leaves components unmanaged.
    Off,
}

impl Preset {
    /// Every preset, once.
    pub const ALL: [Preset; 8] = [
        Preset::Auto,
        Preset::OneShotFast,
        Preset::LowRamSafe,
        Preset::VmmFast,
        Preset::WarmProcess,
        Preset::WslCompat,
        Preset::NvmeBaseline,
        Preset::Off,
    ];

    /// The preset's name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Preset::Auto => "auto",
            Preset::OneShotFast => "one_shot_fast",
            Preset::LowRamSafe => "low_ram_safe",
            Preset::VmmFast => "vmm_fast",
            Preset::WarmProcess => "warm_process",
            Preset::WslCompat => "wsl_compat",
            Preset::NvmeBaseline => "nvme_baseline",
            Preset::Off => "off",
        }
    }

    /// `auto` resolves to `one_shot_fast`; every other preset is itself.
    pub const fn resolved(self) -> Preset {
        match self {
            Preset::Auto => Preset::OneShotFast,
            p => p,
        }
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Preset {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self> {
        Preset::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| CoreError::UnknownPreset {
                name: s.to_string(),
                valid: Preset::ALL.map(Preset::as_str).join(", "),
            })
    }
}

/// Which policy row a component follows, decided by its name only (never by class).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ComponentKind {
    /// The component named `vae`.
    Vae,
    /// The component named `transformer` (or `unet`): the denoiser.
    Transformer,
    /// A component named `text_encoder`, `text_encoder_2`, ...
    TextEncoder,
    /// Any other name.
    Other(String),
}

impl ComponentKind {
    /// The kind for a component name.
    pub fn from_name(name: &str) -> Self {
        match name {
            "vae" => ComponentKind::Vae,
            "transformer" | "unet" => ComponentKind::Transformer,
            n if n == "text_encoder"
                || n.strip_prefix("text_encoder_").is_some_and(|rest| {
                    !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit())
                }) =>
            {
                ComponentKind::TextEncoder
            }
            other => ComponentKind::Other(other.to_string()),
        }
    }
}

/// Diffusers' `offload_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OffloadType {
    /// Each leaf module is a group.
    LeafLevel,
    /// Groups of consecutive blocks of the root's block lists.
    BlockLevel,
}

impl OffloadType {
    /// Diffusers' spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            OffloadType::LeafLevel => "leaf_level",
            OffloadType::BlockLevel => "block_level",
        }
    }
}

impl FromStr for OffloadType {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "leaf_level" => Ok(OffloadType::LeafLevel),
            "block_level" => Ok(OffloadType::BlockLevel),
            _ => Err(CoreError::InvalidOption {
                option: "offload_type".into(),
                value: s.into(),
                hint: "use leaf_level or block_level".into(),
            }),
        }
    }
}

/// Where the streaming engine copies streamed weights from (route option `pinned_source`).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum PinnedSource {
    /// `home`: one pinned buffer laid out in transfer units replaces the params' host
    /// bytes (a copy of the weights at attach); one copy per unit.
    Home,
    /// `register` (the default): checkpoint-mapped params stay where they are and their
    /// mapping is
    /// page-locked in place (read-only, no copy); the engine copies from it into the ring,
    /// one copy per run of params adjacent both in the file and in the unit. Params whose
    /// bytes are not mapped (owned copies, random weights) go to a pinned home of their
    /// own, so for them it is `home`. Where the device cannot register memory, or the
    /// registered bytes do not fit under the pinned limit, the engine stages as `home`
    /// does. The default since page-locking a mapping in place took 0.21 s where copying
    /// the same 5.92 GiB into a home took 5.04 s (H200 host), at the same step time.
    #[default]
    Register,
}

impl PinnedSource {
    /// Every choice, once.
    pub const ALL: [PinnedSource; 2] = [PinnedSource::Home, PinnedSource::Register];

    /// The option's spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            PinnedSource::Home => "home",
            PinnedSource::Register => "register",
        }
    }
}

impl fmt::Display for PinnedSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PinnedSource {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self> {
        PinnedSource::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| CoreError::InvalidOption {
                option: "pinned_source".into(),
                value: s.into(),
                hint:
                    "use register (page-lock the checkpoint mapping in place, the default) or home \
                       (a pinned copy of the streamed weights)"
                        .into(),
            })
    }
}

/// How the streaming engine stores and sends streamed weights (route option `compress`).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum Compression {
    /// `none` (the default): the weights' bytes as they are.
    #[default]
    None,
    /// `lossless`: each transfer unit entropy-coded once at attach (`ddo_codec`: the
    /// exponents of 16-bit words Huffman-coded, sign and mantissa raw), held so in a pinned
    /// home, copied so over the link and decoded on the device into the ring; the decoded
    /// bytes are the weights' bytes exactly.
    Lossless,
}

impl Compression {
    /// Every choice, once.
    pub const ALL: [Compression; 2] = [Compression::None, Compression::Lossless];

    /// The option's spelling.
    pub const fn as_str(self) -> &'static str {
        match self {
            Compression::None => "none",
            Compression::Lossless => "lossless",
        }
    }
}

impl fmt::Display for Compression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Compression {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self> {
        Compression::ALL
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or_else(|| CoreError::InvalidOption {
                option: "compress".into(),
                value: s.into(),
                hint: "use lossless (entropy-coded streamed weights, decoded on the device bit for bit) or none"
                    .into(),
            })
    }
}

/// A VRAM budget for a route's resident weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Budget {
    /// At most this many bytes.
    Bytes(u64),
    /// What the device has free when the route attaches, minus this margin.
    FreeMinus(u64),
}

impl Budget {
    /// The budget in bytes on a device with `free` bytes free.
    pub fn bytes_given_free(self, free: u64) -> u64 {
        match self {
            Budget::Bytes(b) => b,
            Budget::FreeMinus(margin) => free.saturating_sub(margin),
        }
    }
}

/// `n` bytes as [`parse_size`] reads them, in the largest binary unit that divides them
/// exactly (`1GiB`, `1536MiB`, `2560`): a plan line shows `budget=free-9GiB`, as given,
/// not `free-9663676416`, and the text parses back to the same bytes.
pub fn exact_size(n: u64) -> String {
    for (unit, shift) in [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if n != 0 && n.is_multiple_of(1u64 << shift) {
            return format!("{}{unit}", n >> shift);
        }
    }
    n.to_string()
}

impl fmt::Display for Budget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Budget::Bytes(b) => write!(f, "{}", exact_size(*b)),
            Budget::FreeMinus(m) => write!(f, "free-{}", exact_size(*m)),
        }
    }
}

impl FromStr for Budget {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        if let Some(margin) = s.strip_prefix("free-") {
            return Ok(Budget::FreeMinus(parse_size("budget", margin)?));
        }
        if s == "free" {
            return Ok(Budget::FreeMinus(0));
        }
        let bytes = parse_size("budget", s)?;
        if bytes == 0 {
            return Err(CoreError::InvalidOption {
                option: "budget".into(),
                value: s.into(),
                hint: "a budget must be positive; for no resident weights use linear_convolution"
                    .into(),
            });
        }
        Ok(Budget::Bytes(bytes))
    }
}

/// Parses a byte size: a whole number with an optional unit (`B`, `KiB`, `MiB`, `GiB`,
/// `TiB`, or decimal `KB`, `MB`, `GB`, `TB`).
pub fn parse_size(option: &str, text: &str) -> Result<u64> {
    let invalid = || CoreError::InvalidOption {
        option: option.to_string(),
        value: text.to_string(),
        hint:
            "give a non-negative whole number of bytes with an optional unit, e.g. 512MiB or 8GiB"
                .into(),
    };
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    if digits.is_empty() {
        return Err(invalid());
    }
    let n: u64 = digits.parse().map_err(|_| invalid())?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        _ => return Err(invalid()),
    };
    n.checked_mul(mult).ok_or_else(invalid)
}

fn parse_bool(option: &str, text: &str) -> Result<bool> {
    match text {
        "true" | "True" | "1" | "yes" | "on" => Ok(true),
        "false" | "False" | "0" | "no" | "off" => Ok(false),
        _ => Err(CoreError::InvalidOption {
            option: option.to_string(),
            value: text.to_string(),
            hint: "use true or false".into(),
        }),
    }
}

/// Route options as a caller gives them: `None` means "not given" (the route's default
/// applies). Which options a route accepts is checked by its preflight.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct RouteOptions {
    /// Diffusers' `offload_type`.
    pub offload_type: Option<OffloadType>,
    /// Diffusers' `num_blocks_per_group` (block level only).
    pub num_blocks_per_group: Option<usize>,
    /// Prefetch the next group on a copy stream.
    pub use_stream: Option<bool>,
    /// Free device copies in stream order instead of synchronising (needs `use_stream`).
    pub record_stream: Option<bool>,
    /// Pin host weights on the fly instead of keeping pinned copies.
    pub low_cpu_mem_usage: Option<bool>,
    /// Keep host weights in pinned memory.
    pub pinned: Option<bool>,
    /// VRAM budget for resident weights.
    pub budget: Option<Budget>,
    /// Most pinned host bytes the streaming engine may hold (bytes); see
    /// [`crate::streaming::DEFAULT_PINNED_LIMIT`].
    pub pinned_limit: Option<u64>,
    /// Target size of one streaming transfer unit (bytes); see
    /// [`crate::streaming::DEFAULT_UNIT_BYTES`].
    pub unit_bytes: Option<u64>,
    /// Device ring slots of the streaming engine; see
    /// [`crate::streaming::DEFAULT_RING_SLOTS`].
    pub ring_slots: Option<usize>,
    /// Where the streaming engine copies from: a pinned home (default) or the checkpoint
    /// mapping registered in place ([`PinnedSource`]).
    pub pinned_source: Option<PinnedSource>,
    /// Record each streamed forward's timeline (timed device events per transfer unit,
    /// `ddo_metrics::Timeline`); a diagnostic that synchronises at the end of each forward.
    pub timeline: Option<bool>,
    /// How the streaming engine stores and sends streamed weights ([`Compression`]).
    pub compress: Option<Compression>,
    /// Bytes of staged units whose file pages may stay in memory between forwards; the
    /// pages of the units past it are given back once copied and read again from the disk
    /// for the next forward (the disk tier, [`crate::streaming::staged_read`]).
    pub page_cache_limit: Option<u64>,
    /// Keep the streaming ring between a phase's forwards and copy the next forward's first
    /// units into it while this one's last units run
    /// ([`StreamingEngine::end_forward`](crate::streaming::StreamingEngine::end_forward)).
    pub copy_ahead: Option<bool>,
}

impl RouteOptions {
    /// Every option name route specs know, in the order specs describe them: the
    /// vocabulary each route's [`OptionTable`](crate::OptionTable) takes its names from.
    pub const NAMES: [&'static str; 15] = [
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
    ];

    /// Names of the options that were given.
    pub fn given(&self) -> Vec<&'static str> {
        Self::NAMES
            .into_iter()
            .filter(|n| self.value_text(n).is_some())
            .collect()
    }

    /// The value of option `name` as a spec writes it (`true`, `block_level`, `16777216`,
    /// `free-1GiB`), if it was given.
    pub fn value_text(&self, name: &str) -> Option<String> {
        fn text<T: ToString>(v: Option<T>) -> Option<String> {
            v.map(|v| v.to_string())
        }
        match name {
            "offload_type" => self.offload_type.map(|t| t.as_str().to_string()),
            "num_blocks_per_group" => text(self.num_blocks_per_group),
            "use_stream" => text(self.use_stream),
            "record_stream" => text(self.record_stream),
            "low_cpu_mem_usage" => text(self.low_cpu_mem_usage),
            "pinned" => text(self.pinned),
            "budget" => text(self.budget),
            "pinned_limit" => text(self.pinned_limit),
            "unit_bytes" => text(self.unit_bytes),
            "ring_slots" => text(self.ring_slots),
            "pinned_source" => text(self.pinned_source),
            "timeline" => text(self.timeline),
            "compress" => text(self.compress),
            "page_cache_limit" => text(self.page_cache_limit),
            "copy_ahead" => text(self.copy_ahead),
            _ => None,
        }
    }

    /// Sets one option from its text form (`use_stream=true`).
    pub fn set(&mut self, key: &str, value: &str) -> Result<()> {
        match key {
            "offload_type" => self.offload_type = Some(value.parse()?),
            "num_blocks_per_group" => {
                let n: usize = value.parse().map_err(|_| CoreError::InvalidOption {
                    option: key.into(),
                    value: value.into(),
                    hint: "give a positive whole number".into(),
                })?;
                self.num_blocks_per_group = Some(n);
            }
            "use_stream" => self.use_stream = Some(parse_bool(key, value)?),
            "record_stream" => self.record_stream = Some(parse_bool(key, value)?),
            "low_cpu_mem_usage" => self.low_cpu_mem_usage = Some(parse_bool(key, value)?),
            "pinned" => self.pinned = Some(parse_bool(key, value)?),
            "budget" => self.budget = Some(value.parse()?),
            "pinned_limit" => self.pinned_limit = Some(parse_size(key, value)?),
            "unit_bytes" => self.unit_bytes = Some(parse_size(key, value)?),
            "ring_slots" => {
                let n: usize = value.parse().map_err(|_| CoreError::InvalidOption {
                    option: key.into(),
                    value: value.into(),
                    hint: "give a whole number of slots, at least 2".into(),
                })?;
                self.ring_slots = Some(n);
            }
            "pinned_source" => self.pinned_source = Some(value.parse()?),
            "timeline" => self.timeline = Some(parse_bool(key, value)?),
            "compress" => self.compress = Some(value.parse()?),
            "page_cache_limit" => self.page_cache_limit = Some(parse_size(key, value)?),
            "copy_ahead" => self.copy_ahead = Some(parse_bool(key, value)?),
            _ => {
                return Err(CoreError::InvalidOption {
                    option: key.into(),
                    value: value.into(),
                    hint: format!("known options: {}", Self::NAMES.join(", ")),
                });
            }
        }
        Ok(())
    }
}

/// What a component is routed to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RouteTarget {
    /// DDO attaches nothing and moves nothing (preset `off`).
    Unmanaged,
    /// One of DDO's routes.
    Route(RouteId),
}

impl fmt::Display for RouteTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RouteTarget::Unmanaged => f.write_str("unmanaged"),
            RouteTarget::Route(r) => f.write_str(r.as_str()),
        }
    }
}

/// A validated route choice: a target plus options that do not contradict each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RouteSpec {
    target: RouteTarget,
    options: RouteOptions,
}

impl RouteSpec {
    /// Validates `options` for `target`: contradictory combinations are typed errors.
    /// Options the target's route does not accept are refused later, by its preflight.
    pub fn new(target: RouteTarget, options: RouteOptions) -> Result<Self> {
        let clash = |message: &str, hint: &str| CoreError::ContradictoryOptions {
            message: message.to_string(),
            hint: hint.to_string(),
        };
        let o = &options;
        if target == RouteTarget::Unmanaged && !o.given().is_empty() {
            return Err(clash(
                "an unmanaged component takes no route options",
                "pick a route, or drop the options",
            ));
        }
        if o.record_stream == Some(true) && o.use_stream != Some(true) {
            return Err(clash(
                "record_stream=true without use_stream=true",
                "record_stream only applies to copies on a stream: set use_stream=true or drop record_stream",
            ));
        }
        if let Some(n) = o.num_blocks_per_group {
            if n == 0 {
                return Err(CoreError::InvalidOption {
                    option: "num_blocks_per_group".into(),
                    value: "0".into(),
                    hint: "give at least 1".into(),
                });
            }
            if o.offload_type != Some(OffloadType::BlockLevel) {
                return Err(clash(
                    "num_blocks_per_group with leaf_level offload",
                    "num_blocks_per_group applies to offload_type=block_level only: set offload_type=block_level, or drop num_blocks_per_group",
                ));
            }
            if o.use_stream == Some(true) && n != 1 {
                return Err(clash(
                    "use_stream=true with num_blocks_per_group > 1",
                    "streamed block-level offload prefetches one block at a time: set num_blocks_per_group=1 \
                     (Diffusers would silently change it; DDO does not replace explicit options)",
                ));
            }
        } else if o.offload_type == Some(OffloadType::BlockLevel) {
            return Err(clash(
                "offload_type=block_level without num_blocks_per_group",
                "give num_blocks_per_group (e.g. 1), or use offload_type=leaf_level",
            ));
        }
        if o.pinned == Some(true) && o.low_cpu_mem_usage == Some(true) {
            return Err(clash(
                "pinned=true with low_cpu_mem_usage=true",
                "low_cpu_mem_usage pins on the fly instead of keeping pinned copies: choose one",
            ));
        }
        if o.pinned_source == Some(PinnedSource::Register)
            && (o.pinned == Some(false) || o.low_cpu_mem_usage == Some(true))
        {
            return Err(clash(
                "pinned_source=register without pinned staging (pinned=false or low_cpu_mem_usage=true)",
                "registering the checkpoint mapping page-locks it: drop pinned=false / low_cpu_mem_usage=true, \
                 or drop pinned_source",
            ));
        }
        if o.compress == Some(Compression::Lossless) {
            if o.pinned == Some(false) || o.low_cpu_mem_usage == Some(true) {
                return Err(clash(
                    "compress=lossless without pinned staging (pinned=false or low_cpu_mem_usage=true)",
                    "the coded units live in a pinned home: drop pinned=false / low_cpu_mem_usage=true, \
                     or drop compress",
                ));
            }
            if o.pinned_source == Some(PinnedSource::Register) {
                return Err(clash(
                    "compress=lossless with pinned_source=register",
                    "a registered mapping holds the weights as they are, coded units need a pinned home of \
                     their own: drop pinned_source, or drop compress",
                ));
            }
        }
        if o.ring_slots.is_some_and(|k| k < 2) {
            return Err(CoreError::InvalidOption {
                option: "ring_slots".into(),
                value: format!("{}", o.ring_slots.unwrap_or(0)),
                hint: "the streaming ring needs at least 2 slots (one in use, one filling)".into(),
            });
        }
        if o.unit_bytes == Some(0) {
            return Err(CoreError::InvalidOption {
                option: "unit_bytes".into(),
                value: "0".into(),
                hint: "give a transfer unit size such as 16MiB".into(),
            });
        }
        if o.budget == Some(Budget::Bytes(0)) {
            return Err(CoreError::InvalidOption {
                option: "budget".into(),
                value: "0".into(),
                hint: "a budget must be positive".into(),
            });
        }
        Ok(Self { target, options })
    }

    /// A spec for `route` with no options.
    pub fn route(route: RouteId) -> Self {
        Self {
            target: RouteTarget::Route(route),
            options: RouteOptions::default(),
        }
    }

    /// Resident (`none`).
    pub fn resident() -> Self {
        Self::route(RouteId::RESIDENT)
    }

    /// Unmanaged.
    pub fn unmanaged() -> Self {
        Self {
            target: RouteTarget::Unmanaged,
            options: RouteOptions::default(),
        }
    }

    /// Diffusers-style leaf-level group offload.
    pub fn leaf_group(use_stream: bool, low_cpu_mem_usage: bool) -> Self {
        Self {
            target: RouteTarget::Route(RouteId::DIFFUSERS_GROUP_OFFLOAD),
            options: RouteOptions {
                offload_type: Some(OffloadType::LeafLevel),
                use_stream: Some(use_stream),
                low_cpu_mem_usage: Some(low_cpu_mem_usage),
                ..RouteOptions::default()
            },
        }
    }

    /// The target.
    pub fn target(&self) -> RouteTarget {
        self.target
    }

    /// The route, unless unmanaged.
    pub fn route_id(&self) -> Option<RouteId> {
        match self.target {
            RouteTarget::Route(r) => Some(r),
            RouteTarget::Unmanaged => None,
        }
    }

    /// The options as given.
    pub fn options(&self) -> &RouteOptions {
        &self.options
    }

    /// The spec in words (`diffusers_group_offload leaf_level use_stream=false`).
    pub fn describe(&self) -> String {
        let mut s = self.target.to_string();
        let o = &self.options;
        if let Some(t) = o.offload_type {
            s.push_str(&format!(" offload_type={}", t.as_str()));
        }
        if let Some(n) = o.num_blocks_per_group {
            s.push_str(&format!(" num_blocks_per_group={n}"));
        }
        for (name, v) in [
            ("use_stream", o.use_stream),
            ("record_stream", o.record_stream),
            ("low_cpu_mem_usage", o.low_cpu_mem_usage),
            ("pinned", o.pinned),
        ] {
            if let Some(v) = v {
                s.push_str(&format!(" {name}={v}"));
            }
        }
        if let Some(b) = o.budget {
            s.push_str(&format!(" budget={b}"));
        }
        for (name, v) in [
            ("pinned_limit", o.pinned_limit),
            ("unit_bytes", o.unit_bytes),
            ("page_cache_limit", o.page_cache_limit),
        ] {
            if let Some(v) = v {
                s.push_str(&format!(" {name}={v}"));
            }
        }
        if let Some(k) = o.ring_slots {
            s.push_str(&format!(" ring_slots={k}"));
        }
        if let Some(p) = o.pinned_source {
            s.push_str(&format!(" pinned_source={p}"));
        }
        if let Some(t) = o.timeline {
            s.push_str(&format!(" timeline={t}"));
        }
        if let Some(c) = o.compress {
            s.push_str(&format!(" compress={c}"));
        }
        if let Some(a) = o.copy_ahead {
            s.push_str(&format!(" copy_ahead={a}"));
        }
        s
    }
}

impl RouteSpec {
    /// Parses `route` or `route:key=value,key=value` (e.g.
    /// `diffusers_group_offload:offload_type=leaf_level,use_stream=false`), the route's
    /// name looked up in `routes` (the registry's catalog, `ddo_routes::parse_spec`).
    pub fn parse(s: &str, routes: &dyn RouteCatalog) -> Result<Self> {
        let (name, rest) = match s.split_once(':') {
            Some((n, r)) => (n.trim(), Some(r)),
            None => (s.trim(), None),
        };
        let route = routes.find(name)?;
        let mut options = RouteOptions::default();
        for pair in rest
            .into_iter()
            .flat_map(|r| r.split(','))
            .filter(|p| !p.trim().is_empty())
        {
            let (k, v) = pair
                .split_once('=')
                .ok_or_else(|| CoreError::InvalidOption {
                    option: pair.trim().into(),
                    value: String::new(),
                    hint: "write options as key=value, separated by commas".into(),
                })?;
            let key = k.trim();
            if options.given().contains(&key) {
                return Err(CoreError::ContradictoryOptions {
                    message: format!("`{key}` given twice"),
                    hint: "give each option once".into(),
                });
            }
            if !RouteOptions::NAMES.contains(&key) {
                let takes = match routes.options_of(route).as_deref() {
                    Some([]) => format!("{route} takes no options; "),
                    Some(names) => format!("{route} takes {}; ", names.join(", ")),
                    None => String::new(),
                };
                return Err(CoreError::InvalidOption {
                    option: key.into(),
                    value: v.trim().into(),
                    hint: format!("{takes}known options: {}", RouteOptions::NAMES.join(", ")),
                });
            }
            options.set(key, v.trim())?;
        }
        RouteSpec::new(RouteTarget::Route(route), options)
    }
}

/// How a pipeline is offloaded: a preset, per-component policies, and whether the
/// environment may override defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Settings {
    /// The preset whose defaults apply where nothing more specific is given.
    pub preset: Preset,
    /// Routes for named components (`"vae" -> linear_convolution`); each affects only the
    /// component it names.
    pub component_policies: BTreeMap<String, RouteSpec>,
    /// Whether `DDO_PRESET` and `DDO_<COMPONENT>_ROUTE` are read. With `false` the
    /// environment is never read.
    pub use_environment: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(text: &str) -> Result<RouteSpec> {
        RouteSpec::parse(text, &RouteId::BUILT_IN)
    }

    #[test]
    fn budgets_print_in_exact_units_and_parse_back_to_the_same_bytes() {
        for (budget, text) in [
            (Budget::FreeMinus(9 << 30), "free-9GiB"),
            (Budget::FreeMinus(0), "free-0"),
            (Budget::FreeMinus(1536 << 20), "free-1536MiB"),
            (Budget::Bytes(2560), "2560"),
            (Budget::Bytes(3 << 10), "3KiB"),
            (Budget::Bytes(1 << 40), "1TiB"),
            (Budget::Bytes((1 << 30) + 1), "1073741825"),
            (Budget::Bytes(u64::MAX), "18446744073709551615"),
        ] {
            assert_eq!(budget.to_string(), text);
            assert_eq!(text.parse::<Budget>().unwrap(), budget, "{text}");
        }
    }

    #[test]
    fn names_round_trip_and_unknown_names_list_the_valid_ones() {
        let built_in = &RouteId::BUILT_IN;
        for r in RouteId::BUILT_IN {
            assert_eq!(built_in.find(r.as_str()).unwrap(), r);
            assert!(RouteId::is_valid_name(r.as_str()), "{r}");
        }
        for bad in ["", "Native", "a-b", "x y", "é"] {
            assert!(!RouteId::is_valid_name(bad), "{bad}");
        }
        for p in Preset::ALL {
            assert_eq!(p.as_str().parse::<Preset>().unwrap(), p);
        }
        let e = "fastest".parse::<Preset>().unwrap_err();
        assert!(e.to_string().contains("one_shot_fast"), "{e}");
        let e = built_in.find("group").unwrap_err();
        assert!(e.to_string().contains("diffusers_group_offload"), "{e}");
    }

    #[test]
    fn component_kind_comes_from_the_name_only() {
        assert_eq!(ComponentKind::from_name("vae"), ComponentKind::Vae);
        assert_eq!(
            ComponentKind::from_name("transformer"),
            ComponentKind::Transformer
        );
        assert_eq!(
            ComponentKind::from_name("text_encoder_2"),
            ComponentKind::TextEncoder
        );
        assert_eq!(
            ComponentKind::from_name("text_encoder_x"),
            ComponentKind::Other("text_encoder_x".into())
        );
        assert_eq!(
            ComponentKind::from_name("VAE"),
            ComponentKind::Other("VAE".into())
        );
    }

    #[test]
    fn sizes_and_budgets_parse_strictly() {
        assert_eq!(parse_size("b", "512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("b", "2GB").unwrap(), 2_000_000_000);
        assert_eq!(parse_size("b", "17").unwrap(), 17);
        for bad in [
            "-1GiB",
            "",
            "GiB",
            "1.5GiB",
            "3 parsecs",
            "99999999999999999999TiB",
        ] {
            assert!(parse_size("b", bad).is_err(), "{bad}");
        }
        assert_eq!(
            "free-1GiB".parse::<Budget>().unwrap(),
            Budget::FreeMinus(1 << 30)
        );
        assert!("0".parse::<Budget>().is_err());
        assert_eq!(Budget::FreeMinus(10).bytes_given_free(4), 0);
    }

    #[test]
    fn contradictory_options_are_typed_errors() {
        let bad = [
            "diffusers_group_offload:record_stream=true",
            "diffusers_group_offload:use_stream=false,record_stream=true",
            "diffusers_group_offload:offload_type=leaf_level,num_blocks_per_group=2",
            "diffusers_group_offload:num_blocks_per_group=2",
            "diffusers_group_offload:offload_type=block_level",
            "diffusers_group_offload:offload_type=block_level,num_blocks_per_group=2,use_stream=true",
            "diffusers_group_offload:pinned=true,low_cpu_mem_usage=true",
            "diffusers_group_offload:use_stream=true,use_stream=false",
            "diffusers_group_offload:use_stream=true,pinned=false,pinned_source=register",
            "native_vmm:low_cpu_mem_usage=true,pinned_source=register",
        ];
        for text in bad {
            let e = spec(text).unwrap_err();
            assert!(
                matches!(e, CoreError::ContradictoryOptions { .. }),
                "{text}: {e}"
            );
        }
        let invalid = [
            "diffusers_group_offload:offload_type=block_level,num_blocks_per_group=0",
            "diffusers_group_offload:use_stream=maybe",
            "diffusers_group_offload:speed=11",
            "native_vmm:budget=-3GiB",
            "native_vmm:budget",
            "native_vmm:pinned_source=mapped",
        ];
        for text in invalid {
            let e = spec(text).unwrap_err();
            assert!(matches!(e, CoreError::InvalidOption { .. }), "{text}: {e}");
        }
        assert!(
            RouteSpec::new(
                RouteTarget::Unmanaged,
                RouteOptions {
                    pinned: Some(true),
                    ..RouteOptions::default()
                }
            )
            .is_err()
        );
    }

    #[test]
    fn valid_specs_parse() {
        let registered = spec("native_vmm:pinned_source=register").unwrap();
        assert_eq!(
            registered.options().pinned_source,
            Some(PinnedSource::Register)
        );
        assert_eq!(registered.describe(), "native_vmm pinned_source=register");
        assert_eq!(
            spec("native_vmm:budget=8GiB").unwrap().options().budget,
            Some(Budget::Bytes(8 << 30))
        );
    }
}
