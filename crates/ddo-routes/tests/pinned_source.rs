//! `pinned_source=register` through the registry, on checkpoint-backed reference
//! components: both streamed routes (`diffusers_group_offload` with a stream and
//! `native_vmm`) register the checkpoint mapping instead of copying it into a pinned home,
//! stay bit-identical to resident execution over several forwards, keep the params
//! pointing into the file, hold exactly the registered bytes (plus a home for params that
//! are not mapped) while attached and nothing after release, respect `pinned_limit`
//! (falling back to the home's staging), and refuse the option where it has no meaning.

mod common;

use std::sync::Arc;

use common::*;
use ddo_core::reference::{self, LeafSpec, ReferenceSpec};
use ddo_core::{
    Budget, Checkpoint, Component, CoreError, DType, Device, HostMemoryKind, LeafKind, Param,
    Refusal, RouteId, RouteOptions, RouteSpec, RouteTarget,
};
use ddo_host::HostDevice;
use ddo_routes::{OffloadHandle, enable_dynamic_offload};
use proptest::prelude::*;

/// A reference component whose params point into a checkpoint written for it, except
/// those `owned` names, which are pageable copies.
struct Mapped {
    _dir: TempDir,
    spec: ReferenceSpec,
    component: Arc<Component>,
}

fn mapped(spec: ReferenceSpec, owned: impl Fn(&str) -> bool) -> Mapped {
    let dir = TempDir::new("pinned-source");
    let path = dir.0.join("diffusion_pytorch_model.safetensors");
    reference::write_checkpoint(&reference::build(&spec).unwrap(), &path).unwrap();
    let ckpt = Checkpoint::open(&path).unwrap();
    let component = reference::build_with(&spec, &mut |name, kind, dtype, shape, values| {
        if owned(name) {
            Param::from_f32(name, kind, dtype, shape, values)
        } else {
            Param::from_checkpoint(&ckpt, name, name, kind)
        }
    })
    .unwrap();
    drop(ckpt);
    Mapped {
        _dir: dir,
        spec,
        component,
    }
}

/// A spec with a few hundred bytes to a few KiB per leaf.
fn spec(blocks: usize, width: usize, dtype: DType) -> ReferenceSpec {
    ReferenceSpec::small("transformer", blocks, width, dtype)
}

fn leaf_stream(extra: &str) -> RouteSpec {
    ddo_routes::parse_spec(format!("diffusers_group_offload:offload_type=leaf_level,use_stream=true,pinned_source=register{extra}"))
        .unwrap()
}

fn block_stream() -> RouteSpec {
    ddo_routes::parse_spec("diffusers_group_offload:offload_type=block_level,num_blocks_per_group=1,use_stream=true,pinned_source=register")
        .unwrap()
}

fn native(budget: u64, extra: &str) -> RouteSpec {
    ddo_routes::parse_spec(format!(
        "native_vmm:budget={budget},pinned_source=register{extra}"
    ))
    .unwrap()
}

/// Releases the route whatever it is (group offload is not removable): DDO's managed
/// boundary, entered with an error.
/// The device's memory once what it kept pinned after `release_host` is unpinned: first
/// checks everything still pinned is that kept memory (the CUDA device's rule, which the
/// host backend follows).
fn after_release(d: &dyn Device) -> ddo_core::MemoryInfo {
    let m = d.memory_info();
    assert_eq!(
        m.pinned_host, m.pinned_cached,
        "pinned beyond what release_host kept"
    );
    d.unpin_released();
    d.memory_info()
}

fn release(h: &mut OffloadHandle) {
    let _ = h.cleanup_on_error(|_| Err::<(), _>(CoreError::Injected("release".into())));
}

fn host_state(c: &Component) -> Vec<(u64, bool)> {
    c.params()
        .iter()
        .map(|p| (p.host_checksum(), p.is_checkpoint_backed()))
        .collect()
}

/// Attaches `route`, runs `forwards` forwards (each bit-identical to resident) and returns
/// the handle and the device.
fn run(m: &Mapped, route: RouteSpec, forwards: usize) -> (OffloadHandle, Arc<HostDevice>) {
    let expected = baseline(&reference::build(&m.spec).unwrap(), &m.spec, 2, 9);
    let d = if route.route_id() == Some(RouteId::NATIVE_VMM) {
        native_device(1 << 26)
    } else {
        device(1 << 26)
    };
    let h = enable_dynamic_offload(&m.component, dyn_device(&d), route).unwrap();
    for i in 0..forwards {
        let out = h.forward(reference::input(&m.spec, 2, 9).unwrap()).unwrap();
        assert_eq!(
            bytes_of(&*d, &out),
            expected,
            "{} forward {i}",
            route.describe()
        );
    }
    (h, d)
}

#[test]
fn streamed_routes_register_the_mapping_and_match_resident() {
    for dtype in [DType::F32, DType::BF16] {
        let m = mapped(spec(6, 24, dtype), |_| false);
        let total = m.component.param_bytes();
        let before = host_state(&m.component);
        for route in [
            leaf_stream(""),
            block_stream(),
            native(total / 2, ",unit_bytes=1KiB"),
            leaf_stream(",unit_bytes=1KiB,ring_slots=3"),
        ] {
            let (mut h, d) = run(&m, route, 4);
            let c = h.metrics().counters();
            assert!(c.transfer_units > 0, "{}: {c:?}", route.describe());
            assert!(c.host_registrations >= 1, "{}: {c:?}", route.describe());
            assert_eq!(c.register_fallbacks, 0);
            // Every param is mapped: the pinned bytes are the registered ones, and the
            // params still read from the file.
            assert_eq!(c.pinned_host_bytes, c.registered_host_bytes);
            assert_eq!(d.memory_info().pinned_host, c.registered_host_bytes);
            assert!(
                m.component
                    .params()
                    .iter()
                    .all(|p| p.is_checkpoint_backed()),
                "{}",
                route.describe()
            );
            let profile = h.metrics_snapshot().format_profile();
            assert!(profile.contains("page-locked in place"), "{}", profile);
            release(&mut h);
            let mem = after_release(&*d);
            assert_eq!(
                (mem.allocated, mem.pinned_host),
                (0, 0),
                "{}",
                route.describe()
            );
            assert_eq!(host_state(&m.component), before, "{}", route.describe());
        }
    }
}

#[test]
fn resident_params_beside_registered_ones_are_not_copied_from_partly_locked_pages() {
    // Leaves of 160,000 B: registered spans (rounded out to 64 KiB blocks) of the streamed
    // leaves reach into the resident ones next to them in the file, and a copy from a
    // partly page-locked range is refused (by CUDA, and so by the host backend).
    let m = mapped(spec(6, 200, DType::F32), |_| false);
    let total = m.component.param_bytes();
    let largest = m
        .component
        .leaves()
        .iter()
        .map(|l| l.param_bytes())
        .max()
        .unwrap_or(0);
    // The ring (two slots of the largest leaf, in 64 KiB units) and about half of the rest
    // resident.
    let ring = 2 * largest.div_ceil(256) * 256;
    let budget = ring + total.saturating_sub(ring) / 2;
    for route in [
        leaf_stream(&format!(",budget={budget},unit_bytes=64KiB")),
        native(budget, ",unit_bytes=64KiB"),
    ] {
        let (mut h, d) = run(&m, route, 3);
        let c = h.metrics().counters();
        assert!(c.leaves_resident > 0 && c.leaves_streamed > 0, "{c:?}");
        assert!(c.host_registrations >= 1, "{}: {c:?}", route.describe());
        release(&mut h);
        let mem = after_release(&*d);
        assert_eq!(
            (mem.allocated, mem.pinned_host),
            (0, 0),
            "{}",
            route.describe()
        );
    }
}

#[test]
fn owned_params_fall_back_to_a_home_of_their_own() {
    // Biases are owned copies (as after a dtype conversion); weights stay mapped.
    let m = mapped(spec(5, 16, DType::F32), |name| name.ends_with(".bias"));
    let before = host_state(&m.component);
    for route in [
        leaf_stream(""),
        native(m.component.param_bytes() / 2, ",unit_bytes=1KiB"),
    ] {
        let (mut h, d) = run(&m, route, 3);
        let c = h.metrics().counters();
        assert!(c.host_registrations >= 1, "{c:?}");
        let home = c.pinned_host_bytes - c.registered_host_bytes;
        assert!(home > 0, "{c:?}");
        assert_eq!(d.memory_info().pinned_host, c.pinned_host_bytes);
        for (name, p) in m.component.named_params() {
            if name.ends_with(".bias") {
                // Streamed owned params live in the home (one host copy) while attached.
                if p.host().kind() != HostMemoryKind::Pinned {
                    assert_eq!(route.route_id(), Some(RouteId::NATIVE_VMM), "{name}");
                }
            } else {
                assert!(p.is_checkpoint_backed(), "{name}");
            }
        }
        release(&mut h);
        assert_eq!(after_release(&*d).pinned_host, 0);
        // The home gave the owned params pageable copies back: same bytes.
        assert_eq!(host_state(&m.component), before);
    }
}

#[test]
fn the_pinned_limit_makes_registration_fall_back_like_the_home_does() {
    let m = mapped(spec(6, 24, DType::F32), |_| false);
    // What registering takes here.
    let (mut h, _d) = run(&m, leaf_stream(""), 2);
    let registered = h.metrics().counters().registered_host_bytes;
    release(&mut h);
    assert!(registered > 0);
    // Below it: the engine stages as the home mode would (a home if it fits, else the
    // bounded ring), counts the fallback, and stays under the limit.
    for limit in [registered - 1, 1024] {
        let route = leaf_stream(&format!(",pinned_limit={limit}"));
        let (mut h, d) = run(&m, route, 3);
        let c = h.metrics().counters();
        assert_eq!(c.host_registrations, 0, "{c:?}");
        assert!(c.register_fallbacks >= 1, "{c:?}");
        assert!(d.memory_info().pinned_host <= limit);
        let profile = h.metrics_snapshot().format_profile();
        assert!(
            profile.contains("pinned_source=register fell back"),
            "{profile}"
        );
        release(&mut h);
        assert_eq!(after_release(&*d).pinned_host, 0);
    }
}

#[test]
fn pinned_source_is_refused_where_nothing_streams_through_the_engine() {
    let m = mapped(spec(2, 8, DType::F32), |_| false);
    let d = device(1 << 24);
    for (text, option) in [
        (
            "diffusers_group_offload:offload_type=leaf_level,use_stream=false,pinned_source=register",
            "pinned_source",
        ),
        ("linear_convolution:pinned_source=home", "pinned_source"),
        ("none:pinned_source=register", "pinned_source"),
    ] {
        let route: RouteSpec = ddo_routes::parse_spec(text).unwrap();
        let err = enable_dynamic_offload(&m.component, dyn_device(&d), route).unwrap_err();
        assert!(
            matches!(
                &err,
                CoreError::Refused { refusal: Refusal::UnsupportedOption { option: o, .. }, .. } if *o == option
            ),
            "{text}: {err}"
        );
    }
    // Registering without pinned staging contradicts itself.
    let err = ddo_routes::parse_spec("native_vmm:pinned=false,pinned_source=register").unwrap_err();
    assert!(
        matches!(err, CoreError::ContradictoryOptions { .. }),
        "{err}"
    );
}

fn leaf_spec() -> impl Strategy<Value = LeafSpec> {
    prop_oneof![
        (1usize..40).prop_map(|out| LeafSpec {
            kind: LeafKind::Linear,
            out_features: Some(out),
        }),
        Just(LeafSpec {
            kind: LeafKind::Norm,
            out_features: None,
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Any budget and pinned limit: bit-identical to resident, never over the limit, the
    /// pinned bytes exactly what the metrics say (registered plus the home of owned
    /// params), and nothing pinned after release.
    #[test]
    fn register_mode_holds_its_limits_over_budgets(
        width in 4usize..40,
        blocks in prop::collection::vec(prop::collection::vec(leaf_spec(), 1..3), 3..8),
        dtype in prop_oneof![Just(DType::F32), Just(DType::BF16)],
        owned_biases in any::<bool>(),
        native_route in any::<bool>(),
        budget_fraction in 0.0f64..0.8,
        limit in prop::option::of(prop::sample::select(vec![512u64, 4096, 16 << 10, 1 << 20])),
    ) {
        let spec = ReferenceSpec {
            name: "transformer".into(),
            class_name: "Random".into(),
            dtype,
            in_features: width,
            stem: vec![LeafSpec::linear(width)],
            blocks,
            head: vec![LeafSpec::norm()],
            tie_head_to_stem: false,
            seed: 3,
        };
        let m = mapped(spec, |name| owned_biases && name.ends_with(".bias"));
        let before = host_state(&m.component);
        let largest = m.component.leaves().iter().map(|l| l.param_bytes()).max().unwrap_or(0);
        let total = m.component.param_bytes();
        let mut options = RouteOptions {
            pinned_source: Some(ddo_core::PinnedSource::Register),
            pinned_limit: limit,
            ..RouteOptions::default()
        };
        let route = if native_route {
            // Room for the ring of two slots, plus part of the weights kept resident.
            let ring = 2 * largest.div_ceil(256).max(4) * 256;
            let resident = (total.saturating_sub(ring) as f64 * budget_fraction) as u64;
            options.budget = Some(Budget::Bytes(ring + resident));
            // Small units, so that the ring fits beside what stays resident.
            options.unit_bytes = Some(1024);
            RouteSpec::new(RouteTarget::Route(RouteId::NATIVE_VMM), options).unwrap()
        } else {
            options.offload_type = Some(ddo_core::OffloadType::LeafLevel);
            options.use_stream = Some(true);
            RouteSpec::new(RouteTarget::Route(RouteId::DIFFUSERS_GROUP_OFFLOAD), options).unwrap()
        };
        let (mut h, d) = run(&m, route, 3);
        let c = h.metrics().counters();
        prop_assert_eq!(d.memory_info().pinned_host, c.pinned_host_bytes);
        if let Some(limit) = limit {
            prop_assert!(c.pinned_host_bytes <= limit, "{:?}", c);
        }
        if c.host_registrations > 0 {
            prop_assert!(c.registered_host_bytes <= c.pinned_host_bytes);
            prop_assert_eq!(c.pinned_host_bytes > c.registered_host_bytes, owned_biases);
            for (name, p) in m.component.named_params() {
                prop_assert!(p.is_checkpoint_backed() || (owned_biases && name.ends_with(".bias")), "{}", name);
            }
        }
        release(&mut h);
        let mem = after_release(&*d);
        prop_assert_eq!((mem.allocated, mem.pinned_host), (0, 0));
        let after: Vec<u64> = host_state(&m.component).iter().map(|s| s.0).collect();
        let sums: Vec<u64> = before.iter().map(|s| s.0).collect();
        prop_assert_eq!(after, sums);
    }
}

/// This process's resident bytes of the mappings of `path` (`Rss` in /proc/self/smaps), or
/// `None` where smaps cannot be read.
fn mapped_rss(path: &std::path::Path) -> Option<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let name = path.to_string_lossy();
    let mut inside = false;
    let mut kib = 0u64;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            inside = line.ends_with(name.as_ref());
        } else if inside && let Some(v) = line.strip_prefix("Rss:") {
            kib += v.trim().trim_end_matches("kB").trim().parse::<u64>().ok()?;
        }
    }
    Some(kib << 10)
}

/// Issue 35: what a route reads once or past its page cache limit does not stay in the
/// process. A resident upload leaves none of the weights' file pages mapped, and a staged
/// stream with `page_cache_limit=0` gives each unit's pages back after its copy, while both
/// stay bit-identical to resident (the bytes read again from the page cache or the file).
#[test]
fn one_time_reads_and_the_disk_tier_leave_no_file_pages_in_the_process() {
    let m = mapped(spec(6, 256, DType::F32), |_| false);
    let params = m.component.params();
    let path = params[0].source().unwrap().file.clone();
    let Some(_) = mapped_rss(&path) else {
        return; // no /proc (not Linux)
    };
    // Whole pages only: each param may keep a partial page at each end.
    let slack = 2 * 4096 * params.len() as u64;
    let total = m.component.param_bytes();
    for route in [
        ddo_routes::parse_spec("none").unwrap(),
        ddo_routes::parse_spec(
            "diffusers_group_offload:use_stream=true,pinned=false,page_cache_limit=0,unit_bytes=64KiB",
        )
        .unwrap(),
        // The first units registered (their pages stay, page-locked), the rest staged.
        leaf_stream(",pinned_limit=600KiB,page_cache_limit=0,unit_bytes=64KiB"),
    ] {
        // Every page touched: the whole mapping is resident in the process.
        let sums = params.iter().fold(0u64, |a, p| a ^ p.host_checksum());
        assert!(sums != 0);
        let before = mapped_rss(&path).unwrap();
        assert!(before + slack >= total, "{before} of {total} B mapped before");
        let (mut h, _d) = run(&m, route, 3);
        let c = h.metrics().counters();
        let after = mapped_rss(&path).unwrap();
        assert!(
            after <= slack + c.registered_host_bytes,
            "{}: {after} B of the file still mapped after the forwards (slack {slack})",
            route.describe()
        );
        release(&mut h);
    }
}
