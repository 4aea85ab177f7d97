//! What every command sets up the same way: the routing choices (`--preset`, `--route`,
//! the `DDO_*` environment) and where each resolved value came from, the execution device
//! (`--device cpu|cuda:N`) and its budget (`--vram-budget`), and the budget check against
//! the largest leaf.
//!
//! Precedence, as the resolver applies it: an explicit `--route COMPONENT=ROUTE` wins; then
//! `DDO_<COMPONENT>_ROUTE`; then the preset's table, where the preset is `--preset`, else
//! `DDO_PRESET`, else `auto`. A `--preset` on the command line hides `DDO_PRESET` (a flag
//! given now wins over the environment); `--no-env` hides every `DDO_*` variable.

use std::collections::BTreeMap;
use std::sync::Arc;

use ddo_core::resolve::{Environment, resolve};
use ddo_core::{
    AllocatorKind, Component, Device, HostBudget, Preset, Resolution, RouteSpec, Settings,
};
use ddo_host::{HostDevice, HostDeviceConfig};
use ddo_metrics::format_bytes;
use serde::Serialize;

use crate::error::{CliError, CliResult};

/// The host "device" capacity when `--device cpu` has no `--vram-budget`.
pub const DEFAULT_HOST_CAPACITY: u64 = 8 << 30;

/// The routing choices of one command line.
#[derive(Debug, Clone)]
pub struct Routing {
    /// `--preset`, if given.
    pub preset_flag: Option<Preset>,
    /// `--route COMPONENT=ROUTE`, by component.
    pub routes: BTreeMap<String, RouteSpec>,
    /// Whether `DDO_*` variables are read (not with `--no-env`).
    pub use_environment: bool,
}

/// The process environment as the command sees it: `DDO_PRESET` hidden when `--preset`
/// was given.
#[derive(Debug, Clone, Copy)]
pub struct CliEnvironment {
    hide_preset: bool,
}

impl Environment for CliEnvironment {
    fn var(&self, name: &str) -> ddo_core::Result<Option<String>> {
        if self.hide_preset && name == "DDO_PRESET" {
            return Ok(None);
        }
        ddo_core::resolve::process_var(name)
    }
}

/// Where one resolved value came from.
#[derive(Debug, Clone, Serialize)]
pub struct Sources {
    /// The preset: `--preset`, `environment (DDO_PRESET)` or `default (auto)`.
    pub preset: String,
    /// The route: the resolution's [`ddo_core::DecidedBy`] label (`explicit route`,
    /// `environment (DDO_X_ROUTE)`, `preset default (one_shot_fast)`, `memory plan
    /// (one_shot_fast)`, ...), the same the metrics' `decided_by` says.
    pub route: String,
    /// Each option: the same label when the route's decider gave it, `route default` when
    /// nobody did.
    pub options: BTreeMap<String, String>,
}

/// One component's resolution, explained (`ddo resolve`'s JSON shape).
#[derive(Debug, Clone, Serialize)]
pub struct Explanation {
    /// Component name.
    pub component: String,
    /// The preset in force, as given (`auto`, ...).
    pub preset: String,
    /// The preset it resolves to (`auto` → `one_shot_fast`).
    pub resolved_preset: String,
    /// The route (`none`, `diffusers_group_offload`, ..., or `unmanaged`).
    pub route: String,
    /// Every option of the route with its effective value.
    pub options: BTreeMap<String, serde_json::Value>,
    /// Where each value came from.
    pub source: Sources,
    /// The resolution explained, as the resolver (or the memory plan) made it: what the
    /// route's handle carries.
    #[serde(skip)]
    pub resolution: Resolution,
}

impl Routing {
    /// The choices of `--preset`, `--route COMPONENT=ROUTE[:k=v,...]` (each checked against
    /// `components`) and `--no-env`.
    pub fn new(
        preset_flag: Option<Preset>,
        route_flags: &[String],
        no_env: bool,
        components: &[String],
    ) -> CliResult<Self> {
        let mut routes = BTreeMap::new();
        for r in route_flags {
            let Some((component, route)) = r.split_once('=') else {
                return Err(CliError::usage(
                    format!("--route `{r}` has no component"),
                    "write --route COMPONENT=ROUTE[:key=value,...], e.g. --route vae=linear_convolution",
                ));
            };
            let component = component.trim();
            if !components.iter().any(|c| c == component) {
                return Err(CliError::usage(
                    format!("unknown component `{component}` in --route {r}"),
                    format!("components: {}", components.join(", ")),
                ));
            }
            let spec: RouteSpec =
                ddo_routes::parse_spec(route).map_err(|e: ddo_core::CoreError| {
                    CliError::usage(
                        format!("--route {r}: {e}"),
                        "write ROUTE or ROUTE:key=value,... with a route listed above",
                    )
                })?;
            if routes.insert(component.to_string(), spec).is_some() {
                return Err(CliError::usage(
                    format!("two --route options for `{component}`"),
                    "give one route per component",
                ));
            }
        }
        Ok(Self {
            preset_flag,
            routes,
            use_environment: !no_env,
        })
    }

    /// The environment the resolver reads.
    pub fn environment(&self) -> CliEnvironment {
        CliEnvironment {
            hide_preset: self.preset_flag.is_some(),
        }
    }

    /// The `--route`s, by component.
    pub fn explicit_routes(&self) -> Vec<(String, RouteSpec)> {
        self.routes.iter().map(|(c, s)| (c.clone(), *s)).collect()
    }

    /// Settings for the resolver: the preset, the environment switch, and no policies (the
    /// `--route`s go to the resolver as explicit routes).
    pub fn plan_settings(&self) -> Settings {
        Settings {
            preset: self.preset_flag.unwrap_or_default(),
            component_policies: BTreeMap::new(),
            use_environment: self.use_environment,
        }
    }

    /// Resolves `component` (its `--route` explicit, then the environment, then the preset
    /// table). A command resolves each component once and carries the answer on: to the
    /// memory plan (`ddo_routes::plan_resolved`), the route's handle
    /// (`ddo_routes::enable_resolved_offload`) and its explanation.
    pub fn resolve(&self, component: &str) -> CliResult<Resolution> {
        let explicit = self.routes.get(component);
        Ok(resolve(
            &self.plan_settings(),
            component,
            explicit,
            &self.environment(),
            &ddo_routes::Catalog,
        )?)
    }

    /// [`Routing::resolve`] for each of `names`, in order.
    pub fn resolve_all(&self, names: &[String]) -> CliResult<Vec<(String, Resolution)>> {
        names
            .iter()
            .map(|n| Ok((n.clone(), self.resolve(n)?)))
            .collect()
    }

    /// Resolves `component` and says where each value came from.
    pub fn explain(&self, component: &str) -> CliResult<Explanation> {
        let r = self.resolve(component)?;
        Ok(self.explain_resolution(component, r, None))
    }

    /// [`Routing::explain`] for the route the memory plan chose for a component, with the
    /// defaults its weights give the route where the component is at hand
    /// (`ddo_routes::effective_options_for`: `compress=lossless` over coded files, say).
    pub fn explain_planned(
        &self,
        plan: &ddo_routes::ComponentPlan,
        component: Option<&ddo_core::Component>,
    ) -> Explanation {
        self.explain_resolution(&plan.component, plan.resolution.clone(), component)
    }

    /// `r` explained: the route, its options, and where each came from — the route and the
    /// options it gave from `r.decided_by`, as it is; with `weights` (the component), the
    /// defaults its weights give.
    pub fn explain_resolution(
        &self,
        component: &str,
        r: Resolution,
        weights: Option<&ddo_core::Component>,
    ) -> Explanation {
        let env = self.environment();
        let settings = self.plan_settings();
        let preset_source = if self.preset_flag.is_some() {
            "--preset".to_string()
        } else if r.preset_from_environment {
            "environment (DDO_PRESET)".to_string()
        } else {
            "default (auto)".to_string()
        };
        let given_preset = if r.preset_from_environment {
            // Read (and found valid) by the resolution this explains.
            env.var("DDO_PRESET")
                .ok()
                .flatten()
                .map_or_else(|| r.preset.to_string(), |v| v.trim().to_string())
        } else {
            settings.preset.to_string()
        };
        let decided_by = r.decided_by.to_string();
        let (options, option_sources) = effective_options(&r.spec, &decided_by, weights);
        Explanation {
            component: component.to_string(),
            preset: given_preset,
            resolved_preset: r.preset.to_string(),
            route: r.spec.target().to_string(),
            options,
            source: Sources {
                preset: preset_source,
                route: decided_by,
                options: option_sources,
            },
            resolution: r,
        }
    }
}

/// The route's options with their effective values: those given (by `given_by`) and the
/// route's defaults for the rest (for `component`'s weights where it is given).
fn effective_options(
    spec: &RouteSpec,
    given_by: &str,
    component: Option<&ddo_core::Component>,
) -> (
    BTreeMap<String, serde_json::Value>,
    BTreeMap<String, String>,
) {
    use serde_json::Value;
    let mut values = BTreeMap::new();
    let mut sources = BTreeMap::new();
    let mut put = |name: &str, value: Value, given: bool| {
        values.insert(name.to_string(), value);
        sources.insert(
            name.to_string(),
            if given {
                given_by.to_string()
            } else {
                "route default".to_string()
            },
        );
    };
    let effective = match component {
        Some(c) => ddo_routes::effective_options_for(spec, c),
        None => ddo_routes::effective_options(spec),
    };
    for e in effective {
        let value = match e.value {
            ddo_core::OptionValue::Flag(b) => Value::from(b),
            ddo_core::OptionValue::Count(n) => Value::from(n),
            ddo_core::OptionValue::Text(t) => Value::from(t),
        };
        put(e.name, value, e.given);
    }
    (values, sources)
}

/// `--device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The host backend.
    Cpu,
    /// CUDA device N.
    Cuda(usize),
}

impl DeviceChoice {
    /// Starts compiling the CUDA kernels for this device on background threads
    /// ([`ddo_cuda::prepare_kernels`]), so they are ready (or read from the kernel cache)
    /// by the first GPU forward; call it before the weights load. Nothing for the host
    /// backend; a device that cannot be reached is reported when it is opened, not here.
    pub fn prepare_kernels(self) {
        if let DeviceChoice::Cuda(n) = self {
            let _ = ddo_cuda::prepare_kernels(n);
        }
    }

    /// Parses `cpu`, `cuda` or `cuda:N`.
    pub fn parse(text: &str) -> CliResult<Self> {
        let bad = || {
            CliError::usage(
                format!("unknown device `{text}`"),
                "use --device cpu (the host backend) or --device cuda:N (N = 0, 1, ...)",
            )
        };
        match text {
            "cpu" | "host" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            t => t
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(bad),
        }
    }
}

/// Half the host's physical memory (16 GiB where it cannot be read): the host backend's
/// pinned limit.
fn pinned_limit() -> u64 {
    ddo_core::host_memory::mem_total().map_or(16 << 30, |b| b / 2)
}

/// Opens the execution device. On the host backend the budget is the device's capacity
/// (default [`DEFAULT_HOST_CAPACITY`]). The native allocator is installed when a route
/// needs it: on CUDA as the device's first step, on the host backend by choosing it at
/// construction (the counterpart of installing it first thing in a fresh process). Where
/// pinned memory is scarce, a CUDA device stages no pageable uploads in pinned buffers.
pub fn open_device(
    choice: DeviceChoice,
    budget: Option<u64>,
    needs: DeviceNeeds,
) -> CliResult<Arc<dyn Device>> {
    let native_allocator = needs.native_allocator;
    match choice {
        DeviceChoice::Cpu => {
            let device = HostDevice::new(HostDeviceConfig {
                // The default never claims more than the machine holds.
                capacity: budget.unwrap_or_else(|| {
                    host_device_limit()
                        .map_or(DEFAULT_HOST_CAPACITY, |l| DEFAULT_HOST_CAPACITY.min(l))
                }),
                pinned_limit: needs
                    .pinned_limit
                    .map_or_else(pinned_limit, |l| l.min(pinned_limit())),
                allocator: if native_allocator {
                    AllocatorKind::NativeVmm
                } else {
                    AllocatorKind::Caching
                },
                ..HostDeviceConfig::default()
            })?;
            Ok(device)
        }
        DeviceChoice::Cuda(n) => {
            // The native allocator is installed first thing, before anything is allocated
            // (the fresh-process rule).
            let config = ddo_cuda::CudaDeviceConfig {
                native_vmm: native_allocator,
                pinned_limit: needs.pinned_limit,
                upload_staging_bytes: if needs.scarce_pinned {
                    0
                } else {
                    ddo_cuda::DEFAULT_UPLOAD_STAGING_BYTES
                },
                ..ddo_cuda::CudaDeviceConfig::new(n)
            };
            let device = ddo_cuda::CudaDevice::with_config(config)
                .map_err(|e| CliError::from(e).context(&format!("--device cuda:{n}")))?;
            if ddo_core::ops_of(&*device).is_err() {
                return Err(CliError::runtime(
                    format!(
                        "--device cuda:{n}: this build's CUDA backend has no GPU compute ops yet"
                    ),
                    "run with --device cpu",
                ));
            }
            Ok(device)
        }
    }
}

/// Refuses a budget below the largest leaf of `components` (no route can run a leaf whose
/// weights do not fit), naming the leaf and the size to give.
pub fn check_budget(budget: u64, components: &[Arc<Component>]) -> CliResult<()> {
    let largest = components
        .iter()
        .filter_map(|c| c.largest_leaf().map(|l| (c.name(), l)))
        .max_by_key(|(_, l)| l.param_bytes());
    if let Some((component, leaf)) = largest
        && leaf.param_bytes() > budget
    {
        return Err(CliError::usage(
            format!(
                "--vram-budget {} is smaller than the largest leaf, `{component}.{}` ({}): no route can run it",
                format_bytes(budget),
                leaf.path(),
                format_bytes(leaf.param_bytes())
            ),
            format!(
                "give --vram-budget {} or more (activations need room too)",
                ddo_core::error::budget_arg(leaf.param_bytes())
            ),
        ));
    }
    Ok(())
}

/// The most device memory the host backend can be given on this machine: its physical
/// memory (`MemTotal`), and no more than the process's address-space limit (`ulimit -v`);
/// `None` where neither can be read.
pub fn host_device_limit() -> Option<u64> {
    match (
        ddo_core::host_memory::mem_total(),
        ddo_core::host_memory::address_space_limit(),
    ) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Refuses a `--vram-budget` for the host device (`--device cpu`) that this machine
/// cannot hold: its "device" memory is host memory, so a budget past the machine's memory
/// or the process's address-space limit would be planned against and then fail (or abort)
/// mid-run.
pub fn check_host_budget(choice: DeviceChoice, budget: Option<u64>) -> CliResult<()> {
    let (DeviceChoice::Cpu, Some(budget), Some(limit)) = (choice, budget, host_device_limit())
    else {
        return Ok(());
    };
    if budget <= limit {
        return Ok(());
    }
    Err(CliError::usage(
        format!(
            "--vram-budget {} on --device cpu: the host device's memory is this machine's, which holds at most {} (physical memory, or the process's address-space limit)",
            format_bytes(budget),
            format_bytes(limit)
        ),
        format!(
            "give --vram-budget {}MiB or less, or run on a GPU with --device cuda:N",
            limit >> 20
        ),
    ))
}

/// Whether any of `resolutions` needs the native VMM allocator (asks the registry).
pub fn needs_native_allocator<'a>(resolutions: impl IntoIterator<Item = &'a Resolution>) -> bool {
    resolutions
        .into_iter()
        .any(|r| ddo_routes::needs_native_allocator(&r.spec))
}

/// Whether pinned memory is scarce for these resolutions (a component resolved under
/// `wsl_compat`): the device then keeps no pinned upload buffers, so the pinned bytes stay
/// within what the routes' `pinned_limit` allows.
pub fn pinned_is_scarce<'a>(resolutions: impl IntoIterator<Item = &'a Resolution>) -> bool {
    resolutions
        .into_iter()
        .any(|r| r.preset == Preset::WslCompat)
}

/// What the execution device must provide, from the routes resolved for it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceNeeds {
    /// Install the native allocator ([`needs_native_allocator`]).
    pub native_allocator: bool,
    /// Keep no pinned upload buffers on CUDA ([`pinned_is_scarce`]).
    pub scarce_pinned: bool,
    /// The most pinned host memory the device hands out: the run's host budget less its
    /// working memory ([`HostBudget::pinned_room`]); `None`: the backend's default.
    pub pinned_limit: Option<u64>,
}

impl DeviceNeeds {
    /// The needs of `resolutions`' routes.
    pub fn of<'a>(resolutions: impl IntoIterator<Item = &'a Resolution> + Clone) -> Self {
        Self {
            native_allocator: needs_native_allocator(resolutions.clone()),
            scarce_pinned: pinned_is_scarce(resolutions),
            pinned_limit: None,
        }
    }

    /// These needs with the device's pinned memory held within `host`'s room for it.
    pub fn within(self, host: &HostBudget) -> Self {
        Self {
            pinned_limit: Some(host.pinned_room()),
            ..self
        }
    }
}

/// The run's host budget: `--host-budget` when given, else the host's `MemAvailable` now
/// less a reserve ([`HostBudget::default_now`]).
pub fn host_budget(given: Option<u64>) -> HostBudget {
    given.map_or_else(HostBudget::default_now, HostBudget::given)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolution(preset: Preset, spec: &str) -> Resolution {
        let spec: RouteSpec = ddo_routes::parse_spec(spec).unwrap();
        Resolution {
            spec,
            preset,
            preset_from_environment: false,
            decided_by: ddo_core::DecidedBy::ExplicitRoute,
        }
    }

    #[test]
    fn the_device_needs_follow_the_resolved_routes_and_presets() {
        let fast = resolution(Preset::OneShotFast, "none");
        let native = resolution(Preset::VmmFast, "native_vmm:budget=1GiB");
        let wsl = resolution(
            Preset::WslCompat,
            "diffusers_group_offload:offload_type=leaf_level,use_stream=false",
        );
        assert_eq!(DeviceNeeds::of(&[]), DeviceNeeds::default());
        assert_eq!(
            DeviceNeeds::of(std::slice::from_ref(&fast)),
            DeviceNeeds::default()
        );
        assert_eq!(
            DeviceNeeds::of(&[fast.clone(), native]),
            DeviceNeeds {
                native_allocator: true,
                scarce_pinned: false,
                pinned_limit: None,
            }
        );
        // One component under wsl_compat makes pinned memory scarce for the whole device.
        assert_eq!(
            DeviceNeeds::of(&[fast, wsl]),
            DeviceNeeds {
                native_allocator: false,
                scarce_pinned: true,
                pinned_limit: None,
            }
        );
    }

    #[test]
    fn an_explanation_names_its_resolution_s_decider_for_the_route_and_what_it_gave() {
        let routing = Routing::new(
            None,
            &["vae=linear_convolution:pinned=false".to_string()],
            true,
            &["vae".to_string(), "transformer".to_string()],
        )
        .unwrap();
        let vae = routing.explain("vae").unwrap();
        assert_eq!(
            vae.resolution.decided_by,
            ddo_core::DecidedBy::ExplicitRoute
        );
        assert_eq!(vae.source.route, "explicit route");
        assert_eq!(vae.source.options["pinned"], "explicit route");
        let t = routing.explain("transformer").unwrap();
        assert_eq!(
            t.source.route,
            ddo_core::DecidedBy::PresetDefault(Preset::OneShotFast).to_string()
        );
        assert_eq!(t.source.options["use_stream"], t.source.route);
        assert_eq!(t.source.options["ring_slots"], "route default");
    }
}
