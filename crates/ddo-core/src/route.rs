//! The route contract: [`Route`] (preflight, then attach) and [`AttachedRoute`] (the hooks
//! an attached route runs around each forward, each leaf, at phase end and on detach), and
//! the forward driver ([`ForwardContext`]) that model programs run their leaves through.

use std::fmt;
use std::sync::Arc;

use ddo_metrics::RouteMetrics;

use crate::component::{Component, Leaf, LeafId};
use crate::config::{Budget, RouteId, RouteSpec};
use crate::device::{Device, DeviceId};
use crate::dtype::DType;
use crate::error::{CoreError, Refusal, Result};
use crate::footprint::{Footprint, FootprintContext};
use crate::tensor::Tensor;

/// A component's forward computation, written against [`ForwardContext`]: every leaf runs
/// through [`ForwardContext::run_leaf`], so whatever route is attached sees it.
pub trait ComponentProgram: Send + Sync {
    /// Runs the component on `input`.
    fn forward(&self, ctx: &mut ForwardContext<'_>, input: Tensor) -> Result<Tensor>;
}

/// The hooks of a route attached to one component.
///
/// Implementations keep their own state behind interior mutability; the component calls
/// the hooks from one forward at a time.
pub trait AttachedRoute: Send + Sync + fmt::Debug {
    /// Which route this is.
    fn route(&self) -> RouteId;

    /// The route's name (`none`, `diffusers_group_offload`, ...).
    fn route_name(&self) -> &'static str {
        self.route().as_str()
    }

    /// The route's options in words, for profiles.
    fn describe(&self) -> String;

    /// The device the route executes on.
    fn device_id(&self) -> DeviceId;

    /// The route's live counters.
    fn metrics(&self) -> &Arc<RouteMetrics>;

    /// Whether DDO's `remove_dynamic_offload` owns these hooks. Diffusers-style group
    /// offload hooks are owned by the handle and the component instead: they end when
    /// both are dropped.
    fn removable(&self) -> bool {
        true
    }

    /// Called before the component's program starts.
    fn before_forward(&self) -> Result<()> {
        Ok(())
    }

    /// Whether the route folded `leaf`'s adapters into the weights it holds
    /// ([`Component::set_adapter_fusion`](crate::Component::set_adapter_fusion)): the leaf
    /// then runs without adding them again. None by default.
    fn folds_adapters_of(&self, _leaf: &Leaf) -> bool {
        false
    }

    /// Whether the route folded any adapter into its weights: the adapters cannot change
    /// while it is attached.
    fn folds_adapters(&self) -> bool {
        false
    }

    /// Called before `leaf` runs: its params must be on the device (and ordered before the
    /// compute stream's next work) when this returns.
    fn before_leaf(&self, leaf: &Leaf) -> Result<()>;

    /// Called after `leaf` ran.
    fn after_leaf(&self, leaf: &Leaf) -> Result<()>;

    /// Called after the component's program finished.
    fn after_forward(&self) -> Result<()> {
        Ok(())
    }

    /// Uploads now, on the route's copy stream, the weights it keeps resident across
    /// forwards but would otherwise upload during its first forward, and returns the bytes
    /// queued (0 for a route that has none: the default). The pipeline calls it while the
    /// phase before the component's runs, where the memory plan leaves room for them
    /// ([`PipelineOffload::prepare`]); the first forward then waits for the copies instead
    /// of making them.
    ///
    /// [`PipelineOffload::prepare`]: https://docs.rs/ddo-routes
    fn upload_resident(&self) -> Result<u64> {
        Ok(0)
    }

    /// Phase boundary: synchronise, and drop transient buffers (prefetched groups, staging),
    /// keeping what the route keeps resident by design.
    fn end_phase(&self) -> Result<()>;

    /// Releases everything the route holds on the device and in pinned memory, and leaves
    /// every param host-only. Idempotent; also run when the route is dropped.
    fn detach(&self) -> Result<()>;
}

/// A route option's effective value, as `ddo resolve` and `ddo inspect` print it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OptionValue {
    /// A yes/no option.
    Flag(bool),
    /// A count (slots, blocks).
    Count(u64),
    /// Anything else, in words (sizes as `16 MiB`, budgets as `free - 2 GiB`, names).
    Text(String),
}

/// One of a route's options with the value it runs with, and whether the spec gave it
/// (`false`: the route's default).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EffectiveOption {
    /// The option's name, as route specs spell it.
    pub name: &'static str,
    /// Its effective value.
    pub value: OptionValue,
    /// Whether the spec gave it.
    pub given: bool,
}

impl EffectiveOption {
    /// An option with its value and whether it was given.
    pub fn new(name: &'static str, value: OptionValue, given: bool) -> Self {
        Self { name, value, given }
    }
}

/// The type of a route option's value, as route specs write it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptionKind {
    /// `true` or `false`.
    Flag,
    /// A whole number (slots, blocks).
    Count,
    /// A size in bytes (`16MiB`, `2GB`, `4096`).
    Size,
    /// A device budget: a size, or `free-<size>`.
    Budget,
    /// One of these names.
    Choice(&'static [&'static str]),
}

impl OptionKind {
    /// The values it takes, in words (`true|false`, `<size>`, `leaf_level|block_level`).
    pub fn describe(self) -> String {
        match self {
            OptionKind::Flag => "true|false".into(),
            OptionKind::Count => "<n>".into(),
            OptionKind::Size => "<size>".into(),
            OptionKind::Budget => "<size>|free-<size>".into(),
            OptionKind::Choice(names) => names.join("|"),
        }
    }
}

/// An option that applies only beside another option's value (`ring_slots` needs
/// `use_stream=true`): given without it, the registry refuses it with `hint`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionRequirement {
    /// The option it needs.
    pub option: &'static str,
    /// The value that option must have (given, or its default in the same table).
    pub value: &'static str,
    /// What to do when it does not.
    pub hint: &'static str,
}

/// One option a route takes: data the registry parses and refuses by, and `ddo resolve`
/// and `ddo inspect` print.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionDecl {
    /// Its name, as route specs spell it (one of [`RouteOptions::NAMES`](crate::RouteOptions::NAMES)).
    pub name: &'static str,
    /// Its type.
    pub kind: OptionKind,
    /// Its default, in words.
    pub default: &'static str,
    /// What it does, in one line.
    pub doc: &'static str,
    /// The option value it needs beside it, if any.
    pub requires: Option<OptionRequirement>,
}

impl OptionDecl {
    /// An option with no requirement.
    pub const fn new(
        name: &'static str,
        kind: OptionKind,
        default: &'static str,
        doc: &'static str,
    ) -> Self {
        Self {
            name,
            kind,
            default,
            doc,
            requires: None,
        }
    }

    /// The same option, applying only where `option` has `value`.
    pub const fn requires(
        self,
        option: &'static str,
        value: &'static str,
        hint: &'static str,
    ) -> Self {
        Self {
            requires: Some(OptionRequirement {
                option,
                value,
                hint,
            }),
            ..self
        }
    }
}

/// An option a route refuses by name, with what to do instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RefusedOption {
    /// The option.
    pub name: &'static str,
    /// What to do instead.
    pub hint: &'static str,
}

/// Options that only travel with another (`num_blocks_per_group` with `offload_type`,
/// `record_stream` with `use_stream`): checked first, so a refusal names the one the caller
/// added last rather than the one it needs.
const DEPENDENT_OPTIONS: [&str; 2] = ["num_blocks_per_group", "record_stream"];

/// A route's options as data, declared beside its [`Route`] impl: the options it takes
/// (name, type, default, doc, requirement), the ones it refuses with a hint of their own,
/// and the hint for any other option of the vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionTable {
    /// The options the route takes, in the order `ddo resolve` prints them.
    pub options: &'static [OptionDecl],
    /// Options it refuses with their own hint.
    pub refused: &'static [RefusedOption],
    /// The hint for every other option it does not take.
    pub others_hint: &'static str,
}

impl OptionTable {
    /// The declaration of `name`, if the route takes it.
    pub fn get(&self, name: &str) -> Option<&'static OptionDecl> {
        self.options.iter().find(|d| d.name == name)
    }

    /// The names of the options the route takes.
    pub fn names(&self) -> Vec<&'static str> {
        self.options.iter().map(|d| d.name).collect()
    }

    /// Refuses, from the table alone, each option `spec` gives that the route does not
    /// take (with the table's hint for it) or gives without the value it requires beside
    /// it. The registry runs it once before every attach and for `ddo resolve`.
    pub fn check(&self, spec: &RouteSpec) -> std::result::Result<(), Refusal> {
        let o = spec.options();
        let given = o.given();
        let (dependent, rest): (Vec<&'static str>, Vec<&'static str>) = given
            .into_iter()
            .partition(|name| DEPENDENT_OPTIONS.contains(name));
        for name in dependent.into_iter().chain(rest) {
            let Some(decl) = self.get(name) else {
                return Err(Refusal::UnsupportedOption {
                    option: name,
                    hint: self.refusal_hint(name),
                });
            };
            if let Some(req) = decl.requires {
                let value = o
                    .value_text(req.option)
                    .or_else(|| self.get(req.option).map(|d| d.default.to_string()));
                if value.as_deref() != Some(req.value) {
                    return Err(Refusal::UnsupportedOption {
                        option: name,
                        hint: req.hint,
                    });
                }
            }
        }
        Ok(())
    }

    /// Why the route refuses `name`, when it does not take it.
    pub fn refusal_hint(&self, name: &str) -> &'static str {
        self.refused
            .iter()
            .find(|r| r.name == name)
            .map_or(self.others_hint, |r| r.hint)
    }
}

/// How messages name a budget (issue 34): as given, and for a margin what it leaves,
/// never the bytes it came to as if the user had written them.
impl Budget {
    /// The budget as given, for the value a message names: the bytes (`1048576`), or the
    /// margin (`free-9.00 GiB`, `free`), never the bytes a margin leaves, which the user did
    /// not write.
    pub fn given_text(self) -> String {
        match self {
            Budget::Bytes(b) => b.to_string(),
            Budget::FreeMinus(0) => "free".into(),
            Budget::FreeMinus(m) => format!("free-{}", ddo_metrics::format_bytes(m)),
        }
    }

    /// For a margin, what it leaves on a device with `free` bytes free: `leaves 0 B on this
    /// device (8.00 GiB free)`; `None` for bytes.
    pub fn leaves_given_free(self, free: u64) -> Option<String> {
        let human = ddo_metrics::format_bytes;
        match self {
            Budget::Bytes(_) => None,
            Budget::FreeMinus(_) => Some(format!(
                "leaves {} on this device ({} free)",
                human(self.bytes_given_free(free)),
                human(free)
            )),
        }
    }

    /// The budget as given and, for a margin, what it leaves on a device with `free` bytes
    /// free: `1048576 B`, `free-9.00 GiB leaves 0 B on this device (8.00 GiB free)`.
    pub fn explain_given_free(self, free: u64) -> String {
        match (self, self.leaves_given_free(free)) {
            (_, Some(leaves)) => format!("{} {leaves}", self.given_text()),
            (Budget::Bytes(b), None) | (Budget::FreeMinus(b), None) => format!("{b} B"),
        }
    }
}

/// A budget in words: `16 GiB`, or `free - 2 GiB` for the device's free memory less a
/// margin.
pub fn describe_budget(b: crate::config::Budget) -> String {
    use ddo_metrics::format_bytes;
    match b {
        crate::config::Budget::Bytes(n) => format_bytes(n),
        crate::config::Budget::FreeMinus(m) => format!("free - {}", format_bytes(m)),
    }
}

/// What a route would hold of a component known only by its checkpoint headers (`ddo
/// inspect`): an estimate, not a [`Footprint`] (no component is built).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderEstimate {
    /// Weight bytes kept on the device.
    pub resident_bytes: u64,
    /// Weight bytes copied to the device per forward.
    pub streamed_bytes_per_forward: u64,
    /// Most weight bytes on the device at once.
    pub peak_weight_bytes: u64,
    /// What the route does, or why it would refuse, in words.
    pub note: String,
}

/// A route implementation: checks, then attaches.
pub trait Route: Send + Sync {
    /// Which route this is.
    fn id(&self) -> RouteId;

    /// The route's options as data ([`OptionTable`]): the registry refuses, from it alone,
    /// any option the route does not take and any option given without the value it
    /// requires, before [`Route::check_options`] and [`Route::preflight`] run.
    fn option_table(&self) -> &'static OptionTable;

    /// The options this route runs `spec` with: each option it takes, with the value given
    /// or its own default, so `ddo resolve` and `ddo inspect` print what the route says
    /// instead of restating its defaults. None by default (a route with no options).
    fn effective_options(&self, spec: &RouteSpec) -> Vec<EffectiveOption> {
        let _ = spec;
        Vec::new()
    }

    /// [`Route::effective_options`] for `spec` attached to `component`, where a default
    /// depends on the component's weights (the leaf-group route's `compress` over coded
    /// files, its ring over 8-bit weights). The default: the spec's alone.
    fn effective_options_for(
        &self,
        spec: &RouteSpec,
        component: &crate::Component,
    ) -> Vec<EffectiveOption> {
        let _ = component;
        self.effective_options(spec)
    }

    /// The device budget this route runs `spec` under: the one given, or the route's
    /// default (`None`: no budget, everything resident or everything streamed).
    fn effective_budget(&self, spec: &RouteSpec) -> Option<crate::config::Budget> {
        spec.options().budget
    }

    /// Whether the route keeps every weight on the device for the whole attachment under
    /// `spec` (so a phase's room for activations is what is left beside all of them).
    fn keeps_weights_resident(&self, spec: &RouteSpec) -> bool {
        let _ = spec;
        false
    }

    /// `ddo inspect`'s estimate for a component of `weight_bytes` whose largest leaf holds
    /// `largest_leaf_bytes`, under a device budget of `budget_bytes`.
    fn estimate(
        &self,
        spec: &RouteSpec,
        weight_bytes: u64,
        largest_leaf_bytes: u64,
        budget_bytes: u64,
    ) -> HeaderEstimate;

    /// Whether the route streams weights through its streaming engine under `spec` (its
    /// `timeline` and engine options then apply).
    fn streams(&self, spec: &RouteSpec) -> bool {
        let _ = spec;
        false
    }

    /// Whether the route runs weights stored as `dtype`: its preflight refuses a component
    /// holding one it does not ([`Refusal::Quantized`]), and `ddo inspect` asks it from the
    /// headers alone, through the registry. Every dtype by default.
    fn takes_weight_dtype(&self, dtype: DType) -> bool {
        let _ = dtype;
        true
    }

    /// Whether the route needs the native VMM allocator installed on the device under
    /// `spec` (known from the spec alone, before any component: a device is opened with or
    /// without it). [`Footprint::needs_native_allocator`](crate::Footprint::needs_native_allocator) agrees.
    fn needs_native_allocator(&self, spec: &RouteSpec) -> bool {
        let _ = spec;
        false
    }

    /// The rules on `spec` and the component's name that [`Route::option_table`] cannot
    /// say (native_vmm: a VAE needs an explicit budget); the registry runs it after the
    /// table, for `ddo resolve` without a model and before every preflight. None by
    /// default.
    fn check_options(&self, component: &str, spec: &RouteSpec) -> std::result::Result<(), Refusal> {
        let _ = (component, spec);
        Ok(())
    }

    /// Checks that the route can run `component` on `device` with `spec` (a spec of this
    /// route whose options the registry has checked, for a component with nothing
    /// attached), touching nothing: what depends on the device and the weights. A refusal
    /// says what to change.
    fn preflight(&self, component: &Component, device: &dyn Device, spec: &RouteSpec)
    -> Result<()>;

    /// What the route would hold for `component` under `spec` (a spec its preflight
    /// accepts) with the memory `context` describes: resident, streamed and transient
    /// device bytes, pinned host bytes, and whether it needs the native allocator. Pure:
    /// touches nothing, so planners can ask before anything is attached. It must agree
    /// with what [`Route::attach`] then does (each route's tests check it).
    fn footprint(
        &self,
        component: &Component,
        spec: &RouteSpec,
        context: &FootprintContext,
    ) -> Result<Footprint>;

    /// Attaches to `component`, after the registry's checks and [`Route::preflight`]
    /// passed (attach does not repeat them). On error nothing is left allocated or
    /// changed.
    fn attach(
        &self,
        component: &Arc<Component>,
        device: Arc<dyn Device>,
        spec: &RouteSpec,
        metrics: Arc<RouteMetrics>,
    ) -> Result<Arc<dyn AttachedRoute>>;
}

/// What `route` refuses of `spec` for a component named `component` from the spec alone:
/// first its [`OptionTable`] ([`OptionTable::check`]), then its own
/// [`Route::check_options`]. The registry's `check_route_options` and [`checked_preflight`]
/// both run it, so `ddo resolve` without a model and every attach refuse alike.
pub fn check_spec(route: &dyn Route, component: &str, spec: &RouteSpec) -> Result<()> {
    if spec.route_id() != Some(route.id()) {
        return Err(CoreError::InvalidOption {
            option: "route".into(),
            value: spec.target().to_string(),
            hint: format!(
                "this spec is not for {}; pass it to the route it names",
                route.id()
            ),
        });
    }
    route
        .option_table()
        .check(spec)
        .and_then(|()| route.check_options(component, spec))
        .map_err(|refusal| CoreError::Refused {
            route: route.id().as_str(),
            component: component.to_string(),
            refusal,
        })
}

/// What `route` refuses of `spec` on a device with `free` bytes free, whatever the
/// component: a budget of the free bytes less a margin ([`Route::effective_budget`], given
/// or the route's default) that leaves nothing ([`Refusal::NoBudgetLeft`]). The planner
/// runs it with the footprint context's free bytes, a budgeted route's
/// [`Route::preflight`] with the device's (after what it refuses first, such as a missing
/// allocator), and `ddo resolve` without a model with the default device's, so all three
/// refuse alike.
pub fn check_budget_left(
    route: &dyn Route,
    component: &str,
    spec: &RouteSpec,
    free: u64,
) -> Result<()> {
    match route.effective_budget(spec) {
        Some(b @ crate::config::Budget::FreeMinus(margin)) if b.bytes_given_free(free) == 0 => {
            Err(CoreError::Refused {
                route: route.id().as_str(),
                component: component.to_string(),
                refusal: Refusal::NoBudgetLeft { margin, free },
            })
        }
        _ => Ok(()),
    }
}

/// Every check before `route` attaches to `component` on `device` with `spec`, in one
/// place (the registry runs it once per attach; routes do not repeat it): nothing attached
/// yet, no weight already on a device, the spec ([`check_spec`]), then the route's own
/// [`Route::preflight`] (what depends on the device and the weights). Touches nothing.
pub fn checked_preflight(
    route: &dyn Route,
    component: &Component,
    device: &dyn Device,
    spec: &RouteSpec,
) -> Result<()> {
    if let Some(existing) = component.attached() {
        return Err(CoreError::AlreadyAttached {
            component: component.name().to_string(),
            route: existing.route_name(),
        });
    }
    if let Some(p) = component.params().iter().find(|p| p.device().is_some()) {
        return Err(CoreError::Refused {
            route: route.id().as_str(),
            component: component.name().to_string(),
            refusal: Refusal::WeightsAlreadyOnDevice {
                param: p.name().to_string(),
            },
        });
    }
    check_spec(route, component.name(), spec)?;
    route.preflight(component, device, spec)
}

/// The device tensors of one leaf's params, valid while the leaf runs.
pub struct LeafWeights<'a> {
    leaf: &'a Leaf,
    tensors: Vec<Tensor>,
    adapters: Option<Arc<[crate::adapter::Adapter]>>,
    down_cache: &'a crate::adapter::DownCache,
}

impl LeafWeights<'_> {
    /// The leaf's low-rank adapters ([`Component::set_adapters`]), empty without any.
    ///
    /// [`Component::set_adapters`]: crate::Component::set_adapters
    pub fn adapters(&self) -> &[crate::adapter::Adapter] {
        self.adapters.as_deref().unwrap_or(&[])
    }

    /// The forward's cache of shared down-projections ([`crate::adapter::DownCache`]).
    pub fn down_cache(&self) -> &crate::adapter::DownCache {
        self.down_cache
    }

    /// The device tensor of the param with local name `name`.
    pub fn get(&self, name: &str) -> Result<&Tensor> {
        self.leaf
            .params()
            .iter()
            .position(|(n, _)| n == name)
            .map(|i| &self.tensors[i])
            .ok_or_else(|| CoreError::Shape {
                what: format!("leaf `{}`", self.leaf.path()),
                message: format!("has no param named `{name}`"),
            })
    }

    /// The device tensors in the leaf's param order.
    pub fn tensors(&self) -> &[Tensor] {
        &self.tensors
    }

    /// The leaf.
    pub fn leaf(&self) -> &Leaf {
        self.leaf
    }
}

/// What a program sees while it runs: the device, and the way to run leaves.
pub struct ForwardContext<'a> {
    component: &'a Component,
    device: &'a dyn Device,
    hooks: Option<&'a dyn AttachedRoute>,
    /// Shared LoRA down-projections of this forward.
    down_cache: crate::adapter::DownCache,
}

impl<'a> ForwardContext<'a> {
    pub(crate) fn new(
        component: &'a Component,
        device: &'a dyn Device,
        hooks: Option<&'a dyn AttachedRoute>,
    ) -> Self {
        Self {
            component,
            device,
            hooks,
            down_cache: Default::default(),
        }
    }

    /// The execution device.
    pub fn device(&self) -> &'a dyn Device {
        self.device
    }

    /// The component being run.
    pub fn component(&self) -> &'a Component {
        self.component
    }

    /// Runs leaf `id`: the route's `before_leaf`, then `f` with the leaf's device weights,
    /// then `after_leaf`. When `f` fails, `after_leaf` is skipped and the error returned
    /// (the managed error boundary cleans up).
    pub fn run_leaf<T>(
        &mut self,
        id: LeafId,
        f: impl FnOnce(&LeafWeights<'_>) -> Result<T>,
    ) -> Result<T> {
        let leaf = self.component.leaf(id)?;
        if let Some(h) = self.hooks {
            h.metrics().record_leaf_call();
            h.before_leaf(leaf)?;
        }
        let out = {
            let mut tensors = Vec::with_capacity(leaf.params().len());
            for (name, p) in leaf.params() {
                let t = p.device_tensor().ok_or_else(|| CoreError::NotResident {
                    leaf: leaf.path().to_string(),
                    param: name.clone(),
                })?;
                tensors.push(t);
            }
            let folded = self.hooks.is_some_and(|h| h.folds_adapters_of(leaf));
            let weights = LeafWeights {
                leaf,
                tensors,
                adapters: if folded {
                    None
                } else {
                    self.component.adapters_of(id)
                },
                down_cache: &self.down_cache,
            };
            f(&weights)?
        };
        if let Some(h) = self.hooks {
            h.after_leaf(leaf)?;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static TABLE: OptionTable = OptionTable {
        options: &[
            OptionDecl::new("use_stream", OptionKind::Flag, "false", "stream"),
            OptionDecl::new("ring_slots", OptionKind::Count, "2", "slots").requires(
                "use_stream",
                "true",
                "set use_stream=true",
            ),
        ],
        refused: &[RefusedOption {
            name: "budget",
            hint: "no budget here",
        }],
        others_hint: "only use_stream and ring_slots",
    };

    fn check(text: &str) -> Result<(), Refusal> {
        TABLE.check(&RouteSpec::parse(text, &crate::RouteId::BUILT_IN).unwrap())
    }

    fn refused(text: &str) -> (&'static str, &'static str) {
        match check(text).unwrap_err() {
            Refusal::UnsupportedOption { option, hint } => (option, hint),
            other => panic!("{text}: {other}"),
        }
    }

    /// Messages name the budget as given, and what a margin leaves (issue 34).
    #[test]
    fn a_budget_is_named_as_given() {
        use crate::config::Budget;
        assert_eq!(Budget::FreeMinus(9 << 30).given_text(), "free-9.00 GiB");
        assert_eq!(Budget::FreeMinus(0).given_text(), "free");
        assert_eq!(Budget::Bytes(1 << 20).given_text(), "1048576");
        assert_eq!(
            Budget::FreeMinus(9 << 30).explain_given_free(8 << 30),
            "free-9.00 GiB leaves 0 B on this device (8.00 GiB free)"
        );
        assert_eq!(Budget::Bytes(5).explain_given_free(8 << 30), "5 B");
        assert_eq!(Budget::Bytes(5).leaves_given_free(8 << 30), None);
    }

    #[test]
    fn a_table_refuses_what_it_does_not_take_and_what_lacks_its_requirement() {
        assert!(check("diffusers_group_offload").is_ok());
        assert!(check("diffusers_group_offload:use_stream=true,ring_slots=3").is_ok());
        assert_eq!(
            refused("diffusers_group_offload:ring_slots=3"),
            ("ring_slots", "set use_stream=true")
        );
        assert_eq!(
            refused("diffusers_group_offload:use_stream=false,ring_slots=3"),
            ("ring_slots", "set use_stream=true")
        );
        assert_eq!(
            refused("diffusers_group_offload:budget=1GiB"),
            ("budget", "no budget here")
        );
        assert_eq!(
            refused("diffusers_group_offload:pinned=true"),
            ("pinned", "only use_stream and ring_slots")
        );
        // The option that travels with another is named, not the one it needs.
        assert_eq!(
            refused("diffusers_group_offload:offload_type=block_level,num_blocks_per_group=1").0,
            "num_blocks_per_group"
        );
    }
}
