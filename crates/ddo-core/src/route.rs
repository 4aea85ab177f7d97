//! The route contract: [`Route`] (preflight, then attach) and [`AttachedRoute`] (the hooks
//! an attached route runs around each forward, each leaf, at phase end and on detach), and
//! the forward driver ([`ForwardContext`]) that model programs run their leaves through.

use std::fmt;
use std::sync::Arc;

use ddo_metrics::RouteMetrics;

use crate::component::{Component, Leaf, LeafId};
use crate::config::{RouteId, RouteSpec};
use crate::device::{Device, DeviceId};
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
/// inspect`): an estimate, not a [`Footprint`](crate::Footprint) (no component is built).
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

    /// The options this route runs `spec` with: each option it takes, with the value given
    /// or its own default, so `ddo resolve` and `ddo inspect` print what the route says
    /// instead of restating its defaults. None by default (a route with no options).
    fn effective_options(&self, spec: &RouteSpec) -> Vec<EffectiveOption> {
        let _ = spec;
        Vec::new()
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

    /// Whether the route needs the native VMM allocator installed on the device under
    /// `spec` (known from the spec alone, before any component: a device is opened with or
    /// without it). [`Footprint::needs_native_allocator`](crate::Footprint::needs_native_allocator) agrees.
    fn needs_native_allocator(&self, spec: &RouteSpec) -> bool {
        let _ = spec;
        false
    }

    /// The part of [`Route::preflight`] that reads only `spec` and the component's name:
    /// the options this route cannot honour whatever the weights and the device. `ddo
    /// resolve` asks it without a model; `preflight` runs it too, so both refuse alike.
    fn check_options(&self, component: &str, spec: &RouteSpec) -> std::result::Result<(), Refusal>;

    /// Checks that the route can run `component` on `device` with `spec`, touching
    /// nothing; a refusal says what to change.
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

    /// Attaches to `component`. On error nothing is left allocated or changed.
    fn attach(
        &self,
        component: &Arc<Component>,
        device: Arc<dyn Device>,
        spec: &RouteSpec,
        metrics: Arc<RouteMetrics>,
    ) -> Result<Arc<dyn AttachedRoute>>;
}

/// The device tensors of one leaf's params, valid while the leaf runs.
pub struct LeafWeights<'a> {
    leaf: &'a Leaf,
    tensors: Vec<Tensor>,
}

impl LeafWeights<'_> {
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
            let weights = LeafWeights { leaf, tensors };
            f(&weights)?
        };
        if let Some(h) = self.hooks {
            h.after_leaf(leaf)?;
        }
        Ok(out)
    }
}
