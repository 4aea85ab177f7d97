//! The resolver: settings + component name + explicit route + environment → the route a
//! component runs under, or a typed refusal. Pure: it reads the environment only through
//! the [`Environment`] it is given, and only when `use_environment` is true.
//!
//! # Default routes per preset
//!
//! The VAE column is the seed's table, normative. The transformer and text-encoder columns
//! are DDO's choices; a component with any other name follows the transformer column.
//!
//! | preset | vae | transformer | text encoders |
//! | --- | --- | --- | --- |
//! | auto → one_shot_fast | group leaf, no stream | planned: none if it fits, else group leaf, stream, budget | same as transformer |
//! | low_ram_safe | group leaf, no stream | group leaf, stream, low_cpu_mem_usage | group leaf, no stream |
//! | vmm_fast | group leaf, no stream | native_vmm (budget: free − 1 GiB) | group leaf, stream |
//! | warm_process | none (resident) | none (resident) | none (resident) |
//! | wsl_compat | none (resident) | group leaf, no stream, not pinned | group leaf, no stream |
//! | nvme_baseline | none (resident) | group leaf, no stream | group leaf, no stream |
//! | off | unmanaged | unmanaged | unmanaged |
//!
//! "planned" rows are sized by the pipeline memory planner when a VRAM budget and the
//! phases are known (`ddo_routes::plan_pipeline`, [`preset_is_planned`]); resolved alone,
//! without a plan, they are "group leaf, stream". "group leaf" is `diffusers_group_offload`
//! with `offload_type=leaf_level`; every VAE
//! group row uses `low_cpu_mem_usage=false`. Why these: a one-shot run streams the
//! transformer at Diffusers' best measured setting (leaf level with a stream, 1.19× the
//! link floor, 0.58 GiB peak on the reference H200); low_ram_safe avoids the second,
//! pinned host copy; vmm_fast puts the denoiser in the native pool (the allocator is a
//! separate bootstrap step, never installed by resolving a preset); warm_process keeps
//! everything resident for a long-lived process; wsl_compat avoids pinned memory, which
//! WSL rations (its rows stream nothing; [`preset_pinned_limit`] is the 256 MiB a streamed
//! row of its own would get; an explicit route, a policy or an environment route is left as
//! given, as the seed asks of explicit configs); nvme_baseline is
//! the synchronous baseline.
//!
//! # Precedence
//!
//! An explicit route wins; then a `component_policies` entry for the component's name;
//! then (with `use_environment`) `DDO_<COMPONENT>_ROUTE`; then the preset's default, where
//! the preset is `DDO_PRESET` (with `use_environment`) or the settings' preset. The VAE
//! defaults apply to the component named `vae` only; the class of a component is never
//! consulted.

use std::collections::BTreeMap;
use std::fmt;

use crate::config::{
    Budget, ComponentKind, OffloadType, Preset, RouteCatalog, RouteId, RouteOptions, RouteSpec,
    RouteTarget, Settings,
};
use crate::error::{CoreError, Result};

/// Where environment variables come from.
pub trait Environment {
    /// The variable's value, `None` if unset; a value the source cannot give as text (not
    /// UTF-8) is [`CoreError::InvalidEnvironment`] naming the variable, never "unset".
    fn var(&self, name: &str) -> Result<Option<String>>;
}

/// The process environment.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessEnvironment;

impl Environment for ProcessEnvironment {
    fn var(&self, name: &str) -> Result<Option<String>> {
        process_var(name)
    }
}

/// The process's variable `name`: `None` if unset, [`CoreError::InvalidEnvironment`]
/// naming it if its value is not UTF-8 (`std::env::var`'s `NotUnicode`: set, so never
/// read as unset).
pub fn process_var(name: &str) -> Result<Option<String>> {
    match std::env::var(name) {
        Ok(v) => Ok(Some(v)),
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(raw)) => Err(CoreError::InvalidEnvironment {
            var: name.to_string(),
            value: raw.to_string_lossy().into_owned(),
            message: "the value is not valid UTF-8".into(),
        }),
    }
}

/// A fixed set of variables (for tests and embedding applications).
#[derive(Debug, Clone, Default)]
pub struct MapEnvironment(pub BTreeMap<String, String>);

impl MapEnvironment {
    /// An environment with the given pairs.
    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        Self(
            pairs
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }
}

impl Environment for MapEnvironment {
    fn var(&self, name: &str) -> Result<Option<String>> {
        Ok(self.0.get(name).cloned())
    }
}

/// What decided a component's route: the one label a component carries from the resolver
/// to the memory plan, the route's handle (`OffloadHandle::decided_by`), its metrics
/// (`MetricsSnapshot::decided_by`) and the command's tables and JSON, unchanged. Its
/// [`Display`](fmt::Display) is that label:
///
/// | value | label |
/// | --- | --- |
/// | [`ExplicitRoute`](DecidedBy::ExplicitRoute) | `explicit route` |
/// | [`ComponentPolicy`](DecidedBy::ComponentPolicy) | `component policy` |
/// | [`EnvironmentRoute`](DecidedBy::EnvironmentRoute) | `environment (DDO_VAE_ROUTE)` |
/// | [`PresetDefault`](DecidedBy::PresetDefault) | `preset default (one_shot_fast)` |
/// | [`MemoryPlan`](DecidedBy::MemoryPlan) | `memory plan (one_shot_fast)` |
/// | [`LowLevelConfig`](DecidedBy::LowLevelConfig) | `low-level config` |
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecidedBy {
    /// The route passed explicitly (`enable_offload`'s route, `ddo --route`).
    ExplicitRoute,
    /// The settings' `component_policies` entry for the component.
    ComponentPolicy,
    /// `DDO_<COMPONENT>_ROUTE` (named).
    EnvironmentRoute(String),
    /// The default of the preset (resolved: `auto` is `one_shot_fast`) for the
    /// component's kind.
    PresetDefault(Preset),
    /// The preset's default (resolved), sized by the pipeline memory planner
    /// (`ddo_routes::plan`): resident when the component fits its phase's budget, else the
    /// preset's streamed route with a `budget` for what fits ([`preset_is_planned`]).
    MemoryPlan(Preset),
    /// The low-level `enable_dynamic_offload` config, applied as given.
    LowLevelConfig,
}

impl DecidedBy {
    /// Whether the route is a preset's default as the table gives it (not yet sized by a
    /// memory plan).
    pub fn is_preset_default(&self) -> bool {
        matches!(self, DecidedBy::PresetDefault(_))
    }
}

impl fmt::Display for DecidedBy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecidedBy::ExplicitRoute => f.write_str("explicit route"),
            DecidedBy::ComponentPolicy => f.write_str("component policy"),
            DecidedBy::EnvironmentRoute(var) => write!(f, "environment ({var})"),
            DecidedBy::PresetDefault(preset) => write!(f, "preset default ({preset})"),
            DecidedBy::MemoryPlan(preset) => write!(f, "memory plan ({preset})"),
            DecidedBy::LowLevelConfig => f.write_str("low-level config"),
        }
    }
}

/// The resolver's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolution {
    /// The route and its options.
    pub spec: RouteSpec,
    /// The preset in force, resolved (`auto` → `one_shot_fast`).
    pub preset: Preset,
    /// Where the preset came from (`DDO_PRESET` or the settings).
    pub preset_from_environment: bool,
    /// What decided the route.
    pub decided_by: DecidedBy,
}

/// The environment variable that can override a component's route.
pub fn route_env_var(component: &str) -> String {
    let upper: String = component
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect();
    format!("DDO_{upper}_ROUTE")
}

/// The streaming engine's pinned limit a preset implies: 256 MiB
/// ([`WSL_COMPAT_PINNED_LIMIT`](crate::streaming::WSL_COMPAT_PINNED_LIMIT)) under
/// `wsl_compat`, else the engine's default, which follows the machine
/// ([`default_pinned_limit`](crate::streaming::default_pinned_limit)). A route's explicit
/// `pinned_limit` option wins over it.
pub fn preset_pinned_limit(preset: Preset) -> u64 {
    match preset.resolved() {
        Preset::WslCompat => crate::streaming::WSL_COMPAT_PINNED_LIMIT,
        _ => crate::streaming::default_pinned_limit(),
    }
}

/// `spec`, a preset's own default, with the preset's pinned limit filled in where it
/// streams and gives none (only `wsl_compat` sets one below the engine's default). Never
/// applied to an explicit route, a component policy or an environment route: the seed's
/// "explicit configs are not silently replaced by a preset default".
fn with_preset_pinned_limit(spec: RouteSpec, preset: Preset) -> RouteSpec {
    let o = spec.options();
    if preset.resolved() != Preset::WslCompat
        || o.pinned_limit.is_some()
        || o.use_stream != Some(true)
    {
        return spec;
    }
    RouteSpec::new(
        spec.target(),
        RouteOptions {
            pinned_limit: Some(preset_pinned_limit(preset)),
            ..*o
        },
    )
    .unwrap_or(spec)
}

/// The preset default for a component kind. This function is the table in the module
/// documentation.
pub fn preset_default(preset: Preset, kind: &ComponentKind) -> RouteSpec {
    let leaf = |use_stream: bool, low_cpu_mem_usage: bool| {
        RouteSpec::leaf_group(use_stream, low_cpu_mem_usage)
    };
    match (preset.resolved(), kind) {
        (Preset::Off, _) => RouteSpec::unmanaged(),
        // The seed's VAE table.
        (
            Preset::Auto | Preset::OneShotFast | Preset::LowRamSafe | Preset::VmmFast,
            ComponentKind::Vae,
        ) => leaf(false, false),
        (Preset::WarmProcess | Preset::WslCompat | Preset::NvmeBaseline, ComponentKind::Vae) => {
            RouteSpec::resident()
        }
        // DDO's transformer and text-encoder rows.
        (Preset::WarmProcess, _) => RouteSpec::resident(),
        (Preset::Auto | Preset::OneShotFast, _) => leaf(true, false),
        (Preset::LowRamSafe, ComponentKind::TextEncoder) => leaf(false, false),
        (Preset::LowRamSafe, _) => leaf(true, true),
        (Preset::VmmFast, ComponentKind::TextEncoder) => leaf(true, false),
        (Preset::VmmFast, _) => RouteSpec::new(
            RouteTarget::Route(RouteId::NATIVE_VMM),
            RouteOptions {
                budget: Some(Budget::FreeMinus(1 << 30)),
                ..RouteOptions::default()
            },
        )
        .unwrap_or_else(|_| RouteSpec::route(RouteId::NATIVE_VMM)),
        (Preset::WslCompat, ComponentKind::TextEncoder) => leaf(false, false),
        (Preset::WslCompat, _) => RouteSpec::new(
            RouteTarget::Route(RouteId::DIFFUSERS_GROUP_OFFLOAD),
            RouteOptions {
                offload_type: Some(OffloadType::LeafLevel),
                use_stream: Some(false),
                pinned: Some(false),
                ..RouteOptions::default()
            },
        )
        .unwrap_or_else(|_| leaf(false, false)),
        (Preset::NvmeBaseline, _) => leaf(false, false),
    }
}

/// Whether the pipeline memory planner sizes `preset`'s default for a component of `kind`:
/// under `auto` / `one_shot_fast`, the transformer, the text encoders and any other
/// non-VAE component (the seed's VAE table is never planned). A planned component stays
/// fully resident (`none`) when it fits what its phase leaves of the VRAM budget, and
/// otherwise keeps the preset's route (leaf level with a stream) with a `budget` of what
/// fits, so the most costly leaves stay resident. The other presets keep their rows as
/// written: `low_ram_safe`, `wsl_compat` and `nvme_baseline` choose their host-memory
/// behaviour on purpose, `vmm_fast` sizes its own native pool, `warm_process` is resident.
pub fn preset_is_planned(preset: Preset, kind: &ComponentKind) -> bool {
    matches!(preset.resolved(), Preset::OneShotFast) && *kind != ComponentKind::Vae
}

/// Resolves the route of the component named `component`.
///
/// `explicit` is the route the caller passed for this component, if any. The environment
/// is read only when `settings.use_environment` is true; a route it names is looked up in
/// `routes` (the registry's catalog, so every route linked can be named there).
pub fn resolve(
    settings: &Settings,
    component: &str,
    explicit: Option<&RouteSpec>,
    env: &dyn Environment,
    routes: &dyn RouteCatalog,
) -> Result<Resolution> {
    let (preset, preset_from_environment) = if settings.use_environment {
        match env.var("DDO_PRESET")? {
            Some(v) => (
                v.trim()
                    .parse::<Preset>()
                    .map_err(|e| CoreError::InvalidEnvironment {
                        var: "DDO_PRESET".into(),
                        value: v.clone(),
                        message: e.to_string(),
                    })?,
                true,
            ),
            None => (settings.preset, false),
        }
    } else {
        (settings.preset, false)
    };
    let preset = preset.resolved();

    // The component's environment route is read only when nothing above it decides (an
    // explicit route or a policy wins, so a bad value it overrides cannot fail the run).
    let env_route = || -> Result<Option<(RouteSpec, String)>> {
        if !settings.use_environment {
            return Ok(None);
        }
        let var = route_env_var(component);
        match env.var(&var)? {
            Some(v) => Ok(Some((
                RouteSpec::parse(v.trim(), routes).map_err(|e| CoreError::InvalidEnvironment {
                    var: var.clone(),
                    value: v.clone(),
                    message: e.to_string(),
                })?,
                var,
            ))),
            None => Ok(None),
        }
    };

    let (spec, decided_by) = if let Some(spec) = explicit {
        (*spec, DecidedBy::ExplicitRoute)
    } else if let Some(spec) = settings.component_policies.get(component) {
        (*spec, DecidedBy::ComponentPolicy)
    } else if let Some((spec, var)) = env_route()? {
        (spec, DecidedBy::EnvironmentRoute(var))
    } else {
        (
            preset_default(preset, &ComponentKind::from_name(component)),
            DecidedBy::PresetDefault(preset),
        )
    };
    let spec = if decided_by.is_preset_default() {
        with_preset_pinned_limit(spec, preset)
    } else {
        spec
    };
    Ok(Resolution {
        spec,
        preset,
        preset_from_environment,
        decided_by,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const BUILT_IN: &[RouteId; 4] = &RouteId::BUILT_IN;

    /// `component` resolved under `s` with no explicit route and an empty environment.
    fn quiet(s: &Settings, component: &str) -> Resolution {
        resolve(s, component, None, &MapEnvironment::default(), BUILT_IN).unwrap()
    }
    use std::cell::Cell;

    /// An environment that counts every read.
    struct CountingEnv<'a> {
        inner: MapEnvironment,
        reads: &'a Cell<usize>,
    }

    impl Environment for CountingEnv<'_> {
        fn var(&self, name: &str) -> Result<Option<String>> {
            self.reads.set(self.reads.get() + 1);
            self.inner.var(name)
        }
    }

    fn settings(preset: Preset) -> Settings {
        Settings {
            preset,
            ..Settings::default()
        }
    }

    fn vae_leaf_no_stream() -> RouteSpec {
        RouteSpec::leaf_group(false, false)
    }

    // One test per row of the seed's VAE table.

    #[test]
    fn vae_auto_resolves_to_one_shot_fast_and_leaf_no_stream() {
        let r = quiet(&settings(Preset::Auto), "vae");
        assert_eq!(r.preset, Preset::OneShotFast);
        assert_eq!(r.spec, vae_leaf_no_stream());
        let o = r.spec.options();
        assert_eq!(o.offload_type, Some(OffloadType::LeafLevel));
        assert_eq!(
            (o.use_stream, o.low_cpu_mem_usage),
            (Some(false), Some(false))
        );
        assert_eq!(r.decided_by, DecidedBy::PresetDefault(Preset::OneShotFast));
    }

    #[test]
    fn vae_one_shot_fast_and_low_ram_safe_are_leaf_no_stream() {
        for p in [Preset::OneShotFast, Preset::LowRamSafe] {
            let r = quiet(&settings(p), "vae");
            assert_eq!(r.spec, vae_leaf_no_stream(), "{p}");
            assert_eq!(r.spec.options().low_cpu_mem_usage, Some(false));
        }
    }

    #[test]
    fn vae_vmm_fast_is_leaf_no_stream_and_installs_nothing() {
        let r = quiet(&settings(Preset::VmmFast), "vae");
        assert_eq!(r.spec, vae_leaf_no_stream());
        assert_ne!(r.spec.route_id(), Some(RouteId::NATIVE_VMM));
    }

    #[test]
    fn vae_warm_process_wsl_compat_nvme_baseline_are_resident() {
        for p in [Preset::WarmProcess, Preset::WslCompat, Preset::NvmeBaseline] {
            let r = quiet(&settings(p), "vae");
            assert_eq!(r.spec, RouteSpec::resident(), "{p}");
        }
    }

    #[test]
    fn vae_off_is_unmanaged() {
        let r = quiet(&settings(Preset::Off), "vae");
        assert_eq!(r.spec.target(), RouteTarget::Unmanaged);
    }

    #[test]
    fn every_preset_resolves_every_kind_to_a_valid_spec() {
        for p in Preset::ALL {
            for name in [
                "vae",
                "transformer",
                "text_encoder",
                "text_encoder_2",
                "controlnet",
            ] {
                let r = quiet(&settings(p), name);
                // Re-validating the default gives the same spec: defaults are never contradictory.
                assert_eq!(
                    RouteSpec::new(r.spec.target(), *r.spec.options()).unwrap(),
                    r.spec,
                    "{p} {name}"
                );
            }
        }
    }

    #[test]
    fn vmm_fast_transformer_needs_the_native_allocator_but_resolving_installs_nothing() {
        let r = quiet(&settings(Preset::VmmFast), "transformer");
        assert_eq!(r.spec.route_id(), Some(RouteId::NATIVE_VMM));
    }

    #[test]
    fn explicit_route_always_wins() {
        let explicit: RouteSpec = RouteSpec::parse("linear_convolution", BUILT_IN).unwrap();
        let mut s = settings(Preset::WarmProcess);
        s.component_policies
            .insert("vae".into(), RouteSpec::resident());
        s.use_environment = true;
        let env = MapEnvironment::from_pairs([("DDO_VAE_ROUTE", "none"), ("DDO_PRESET", "off")]);
        for p in Preset::ALL {
            s.preset = p;
            let r = resolve(&s, "vae", Some(&explicit), &env, BUILT_IN).unwrap();
            assert_eq!(r.spec, explicit, "{p}");
            assert_eq!(r.decided_by, DecidedBy::ExplicitRoute);
        }
    }

    #[test]
    fn a_vae_policy_does_not_change_the_transformer() {
        let mut s = settings(Preset::Auto);
        let before = quiet(&s, "transformer");
        s.component_policies.insert(
            "vae".into(),
            RouteSpec::parse("linear_convolution", BUILT_IN).unwrap(),
        );
        let vae = quiet(&s, "vae");
        assert_eq!(vae.spec.route_id(), Some(RouteId::LINEAR_CONVOLUTION));
        assert_eq!(vae.decided_by, DecidedBy::ComponentPolicy);
        let after = quiet(&s, "transformer");
        assert_eq!(before, after);
    }

    #[test]
    fn vae_defaults_follow_the_name_not_the_class() {
        // A VAE registered under another name gets that name's row, not the VAE row.
        let r = quiet(&settings(Preset::WarmProcess), "decoder");
        assert_eq!(r.spec, RouteSpec::resident());
        let r = quiet(&settings(Preset::OneShotFast), "decoder");
        assert_eq!(r.spec, RouteSpec::leaf_group(true, false));
    }

    #[test]
    fn use_environment_false_never_reads_the_environment() {
        let reads = Cell::new(0);
        let env = CountingEnv {
            inner: MapEnvironment::from_pairs([("DDO_PRESET", "off"), ("DDO_VAE_ROUTE", "none")]),
            reads: &reads,
        };
        let r = resolve(&settings(Preset::Auto), "vae", None, &env, BUILT_IN).unwrap();
        assert_eq!(reads.get(), 0);
        assert_eq!(r.spec, vae_leaf_no_stream());
        assert!(!r.preset_from_environment);
    }

    #[test]
    fn use_environment_true_lets_the_environment_override_defaults_only() {
        let mut s = settings(Preset::Auto);
        s.use_environment = true;
        let env = MapEnvironment::from_pairs([("DDO_PRESET", "warm_process")]);
        let r = resolve(&s, "vae", None, &env, BUILT_IN).unwrap();
        assert_eq!(
            (r.preset, r.spec),
            (Preset::WarmProcess, RouteSpec::resident())
        );
        assert!(r.preset_from_environment);

        let env = MapEnvironment::from_pairs([("DDO_TEXT_ENCODER_2_ROUTE", "linear_convolution")]);
        let r = resolve(&s, "text_encoder_2", None, &env, BUILT_IN).unwrap();
        assert_eq!(r.spec.route_id(), Some(RouteId::LINEAR_CONVOLUTION));
        assert_eq!(
            r.decided_by,
            DecidedBy::EnvironmentRoute("DDO_TEXT_ENCODER_2_ROUTE".into())
        );

        // A component policy is explicit config: the environment does not replace it.
        s.component_policies
            .insert("vae".into(), RouteSpec::resident());
        let env = MapEnvironment::from_pairs([("DDO_VAE_ROUTE", "linear_convolution")]);
        let r = resolve(&s, "vae", None, &env, BUILT_IN).unwrap();
        assert_eq!(r.spec, RouteSpec::resident());
    }

    #[test]
    fn bad_environment_values_are_typed_errors() {
        let mut s = settings(Preset::Auto);
        s.use_environment = true;
        for (var, value) in [
            ("DDO_PRESET", "ludicrous"),
            ("DDO_VAE_ROUTE", "teleport"),
            (
                "DDO_VAE_ROUTE",
                "diffusers_group_offload:record_stream=true",
            ),
        ] {
            let env = MapEnvironment::from_pairs([(var, value)]);
            let e = resolve(&s, "vae", None, &env, BUILT_IN).unwrap_err();
            assert!(
                matches!(e, CoreError::InvalidEnvironment { .. }),
                "{var}={value}: {e}"
            );
        }
        // A bad route variable that an explicit route or a policy overrides is never read.
        let env = MapEnvironment::from_pairs([("DDO_VAE_ROUTE", "teleport")]);
        let explicit = RouteSpec::resident();
        let r = resolve(&s, "vae", Some(&explicit), &env, BUILT_IN).unwrap();
        assert_eq!(r.decided_by, DecidedBy::ExplicitRoute);
        s.component_policies
            .insert("vae".into(), RouteSpec::resident());
        let r = resolve(&s, "vae", None, &env, BUILT_IN).unwrap();
        assert_eq!(r.decided_by, DecidedBy::ComponentPolicy);
    }

    #[test]
    fn each_decider_has_one_label_naming_what_decided() {
        // The label the resolver gives is the one every report prints: it names the
        // resolved preset, and no two deciders share one.
        let r = quiet(&settings(Preset::Auto), "vae");
        assert_eq!(r.decided_by.to_string(), "preset default (one_shot_fast)");
        let mut s = settings(Preset::Auto);
        s.use_environment = true;
        let env = MapEnvironment::from_pairs([("DDO_VAE_ROUTE", "none")]);
        let r = resolve(&s, "vae", None, &env, BUILT_IN).unwrap();
        assert_eq!(r.decided_by.to_string(), "environment (DDO_VAE_ROUTE)");
        let all = [
            DecidedBy::ExplicitRoute,
            DecidedBy::ComponentPolicy,
            DecidedBy::EnvironmentRoute("DDO_VAE_ROUTE".into()),
            DecidedBy::PresetDefault(Preset::OneShotFast),
            DecidedBy::PresetDefault(Preset::WarmProcess),
            DecidedBy::MemoryPlan(Preset::OneShotFast),
            DecidedBy::LowLevelConfig,
        ];
        let labels: std::collections::BTreeSet<String> =
            all.iter().map(ToString::to_string).collect();
        assert_eq!(labels.len(), all.len(), "{labels:?}");
        assert!(labels.iter().all(|l| !l.contains("  ")), "{labels:?}");
    }

    #[test]
    fn env_var_names_are_derived_from_component_names() {
        assert_eq!(route_env_var("vae"), "DDO_VAE_ROUTE");
        assert_eq!(route_env_var("text_encoder_2"), "DDO_TEXT_ENCODER_2_ROUTE");
        assert_eq!(route_env_var("my-unet"), "DDO_MY_UNET_ROUTE");
    }

    #[test]
    fn a_preset_never_adds_options_to_an_explicit_route() {
        // The seed: an explicit route wins and is not silently changed. Under wsl_compat an
        // explicit streamed route used to get pinned_limit=256MiB while reported as explicit.
        let explicit = RouteSpec::leaf_group(true, false);
        let mut settings = settings(Preset::WslCompat);
        let env = MapEnvironment::default();
        let r = resolve(&settings, "transformer", Some(&explicit), &env, BUILT_IN).unwrap();
        assert_eq!(r.decided_by, DecidedBy::ExplicitRoute);
        assert_eq!(r.spec, explicit);
        // Nor to a component policy or an environment route.
        settings
            .component_policies
            .insert("transformer".into(), explicit);
        let r = resolve(&settings, "transformer", None, &env, BUILT_IN).unwrap();
        assert_eq!(
            (r.decided_by, r.spec),
            (DecidedBy::ComponentPolicy, explicit)
        );
        settings.component_policies.clear();
        let env = MapEnvironment::from_pairs([(
            "DDO_TRANSFORMER_ROUTE",
            "diffusers_group_offload:use_stream=true",
        )]);
        settings.use_environment = true;
        let r = resolve(&settings, "transformer", None, &env, BUILT_IN).unwrap();
        assert_eq!(
            r.decided_by,
            DecidedBy::EnvironmentRoute("DDO_TRANSFORMER_ROUTE".into())
        );
        assert_eq!(r.spec.options().pinned_limit, None);
        // wsl_compat's own defaults stream nothing; its cap stays for the engine's callers.
        let r = quiet(&settings, "text_encoder");
        assert_eq!(r.spec.options().pinned_limit, None);
        assert_eq!(r.decided_by, DecidedBy::PresetDefault(Preset::WslCompat));
        assert!(preset_pinned_limit(Preset::WslCompat) <= 256 << 20);
    }
}
