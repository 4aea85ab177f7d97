//! Each route's contract tests, written once and run on every backend: the test bodies
//! below take a device opener, and [`route_contract_tests!`] writes one `#[test]` per route
//! and contract for one backend (candle's `test_device!` is the model: one invocation per
//! backend over the same bodies). `tests/route_contracts.rs` invokes it for the host
//! backend; `ddo-cuda/tests/gpu_route_contracts.rs` includes this file (`#[path]`) and
//! invokes it for CUDA, so the GPU bundle runs the same bodies on a GPU.
//!
//! The contracts, for every route configuration ([`case`]); the `*_units` cases stream the
//! component in many small transfer units (`unit_bytes=1KiB`: 4 or more units through a
//! ring of 2 slots, so every slot is refilled within a forward) and run the reference
//! component whose leaves compute with the device's ops (`reference::build_on_ops`), so a
//! unit copied into the wrong slot, or a refill that does not wait for the compute still
//! reading its slot, changes the output on a device whose compute runs behind the host:
//! - `attaches`: an explicit route attaches as given (the component reports it, the handle
//!   holds the spec unchanged) and is never replaced: a second attach is refused;
//! - `forward_matches_resident`: forwards are byte-identical to resident execution on the
//!   same device, the first (which learns a schedule) and the later ones;
//! - `detach_restores`: removing the route leaves no hooks, no device residency and no
//!   device or pinned bytes beyond what the device held before, the host weights unchanged,
//!   and the component attachable again;
//! - `bad_options_refused`: options the route does not take, malformed values and the wrong
//!   allocator are refused with a typed error naming the option or what to do, changing
//!   nothing.
//!
//! A backend's opener returns `None` when it has no device (the CUDA one without a GPU,
//! after printing why); the test then passes without running, unless `DDO_REQUIRE_GPU=1`
//! makes the opener fail it.
#![allow(dead_code)]

use std::sync::Arc;

use ddo_core::reference::{self, ReferenceSpec};
use ddo_core::{Component, CoreError, DType, Device, RouteSpec};
use ddo_routes::{OffloadHandle, enable_dynamic_offload, remove_dynamic_offload};

/// Opens a device of the backend: with the native VMM allocator when `native`; `None`
/// without a device.
pub type Open = fn(bool) -> Option<Arc<dyn Device>>;

/// One route configuration under contract.
#[derive(Debug, Clone, Copy)]
pub struct Case {
    /// The route and its options.
    pub spec: &'static str,
    /// Whether it runs on a device with the native allocator.
    pub native: bool,
    /// Specs the route refuses, each with a word its refusal names.
    pub bad: &'static [(&'static str, &'static str)],
    /// The component computes with the device's ops (`reference::build_on_ops`) instead of
    /// reading its weights back to the host.
    pub on_ops: bool,
    /// Transfer units the streaming engine must use per forward (0: not checked).
    pub min_units: u64,
}

/// The route configuration a test module is named after.
pub fn case(name: &str) -> Case {
    let (spec, native, bad): (&str, bool, &[(&str, &str)]) = match name {
        "none" => (
            "none",
            false,
            &[("none:budget=1MiB", "budget"), ("none:nope=1", "nope")],
        ),
        "leaf" => (
            "diffusers_group_offload:offload_type=leaf_level,use_stream=false",
            false,
            &[
                (
                    "diffusers_group_offload:offload_type=leaf_level,use_stream=false,budget=1MiB",
                    "budget",
                ),
                (
                    "diffusers_group_offload:offload_type=leaf_level,use_stream=false,unit_bytes=1MiB",
                    "unit_bytes",
                ),
            ],
        ),
        "leaf_stream" => (
            "diffusers_group_offload:offload_type=leaf_level,use_stream=true",
            false,
            &[
                (
                    "diffusers_group_offload:offload_type=leaf_level,use_stream=maybe",
                    "use_stream",
                ),
                (
                    "diffusers_group_offload:offload_type=leaf_level,use_stream=true,budget=lots",
                    "budget",
                ),
            ],
        ),
        "block" => (
            "diffusers_group_offload:offload_type=block_level,num_blocks_per_group=1",
            false,
            &[(
                "diffusers_group_offload:offload_type=block_level,num_blocks_per_group=1,ring_slots=3",
                "ring_slots",
            )],
        ),
        "block_stream" => (
            "diffusers_group_offload:offload_type=block_level,num_blocks_per_group=1,use_stream=true",
            false,
            &[(
                "diffusers_group_offload:offload_type=sideways,use_stream=true",
                "offload_type",
            )],
        ),
        "linear_convolution" => (
            "linear_convolution",
            false,
            &[
                ("linear_convolution:budget=1MiB", "budget"),
                ("linear_convolution:use_stream=true", "use_stream"),
            ],
        ),
        "native_vmm" => (
            // Some leaves resident, the others streamed (the largest is 1,088 B).
            "native_vmm:budget=3KiB",
            true,
            &[
                ("native_vmm:budget=3KiB,use_stream=true", "use_stream"),
                ("native_vmm:budget=1KiB", "budget"),
                ("native_vmm:budget=plenty", "budget"),
            ],
        ),
        "leaf_stream_units" | "block_stream_units" | "native_vmm_units" => {
            let (spec, native, bad): (&str, bool, &[(&str, &str)]) = match name {
                "leaf_stream_units" => (
                    "diffusers_group_offload:offload_type=leaf_level,use_stream=true,unit_bytes=1KiB",
                    false,
                    &[(
                        "diffusers_group_offload:offload_type=leaf_level,use_stream=true,unit_bytes=0",
                        "unit_bytes",
                    )],
                ),
                "block_stream_units" => (
                    "diffusers_group_offload:offload_type=block_level,num_blocks_per_group=1,use_stream=true,unit_bytes=1KiB",
                    false,
                    &[(
                        "diffusers_group_offload:offload_type=block_level,num_blocks_per_group=1,use_stream=true,unit_bytes=1KiB,ring_slots=1",
                        "ring_slots",
                    )],
                ),
                _ => (
                    // A ring of two slots of the largest unit (1,280 B) and no room for
                    // any resident leaf: everything streams.
                    "native_vmm:budget=2560,unit_bytes=1KiB",
                    true,
                    &[("native_vmm:budget=2560,unit_bytes=0", "unit_bytes")],
                ),
            };
            return Case {
                spec,
                native,
                bad,
                on_ops: true,
                min_units: 4,
            };
        }
        other => panic!("no route case `{other}`"),
    };
    Case {
        spec,
        native,
        bad,
        on_ops: false,
        min_units: 0,
    }
}

fn spec(case: &Case) -> RouteSpec {
    ddo_routes::parse_spec(case.spec).unwrap_or_else(|e| panic!("{}: {e}", case.spec))
}

/// The reference component every contract runs on (three blocks, f32), computing on the
/// host or, for the `*_units` cases, with the device's ops (six blocks: as many units at
/// block level).
fn component(case: &Case) -> (Arc<Component>, ReferenceSpec) {
    let blocks = if case.on_ops { 6 } else { 3 };
    let spec = ReferenceSpec::small("transformer", blocks, 16, DType::F32);
    let c = if case.on_ops {
        reference::build_on_ops(&spec)
    } else {
        reference::build(&spec)
    }
    .unwrap();
    (c, spec)
}

fn bytes_of(d: &dyn Device, t: &ddo_core::Tensor) -> Vec<u8> {
    t.to_host_bytes(d, &d.compute_stream()).unwrap()
}

/// Each param's host checksum.
fn host_state(c: &Component) -> Vec<u64> {
    c.params().iter().map(|p| p.host_checksum()).collect()
}

/// Resident execution's output on `d` (the route `none`, removed afterwards).
fn resident(c: &Arc<Component>, rs: &ReferenceSpec, d: &Arc<dyn Device>, seed: u64) -> Vec<u8> {
    let mut h = enable_dynamic_offload(c, Arc::clone(d), RouteSpec::resident()).unwrap();
    let out = h.forward(reference::input(rs, 2, seed).unwrap()).unwrap();
    let bytes = bytes_of(&**d, &out);
    drop(out);
    remove_dynamic_offload(&mut h).unwrap();
    bytes
}

/// Device bytes in live allocations and pinned bytes in use (not the device's pinned
/// cache), with the device idle and handed-back registrations unpinned.
fn held(d: &dyn Device) -> (u64, u64) {
    d.synchronize().unwrap();
    d.unpin_released();
    let m = d.memory_info();
    (m.allocated, m.pinned_host.saturating_sub(m.pinned_cached))
}

fn attach(c: &Arc<Component>, d: &Arc<dyn Device>, case: &Case) -> OffloadHandle {
    enable_dynamic_offload(c, Arc::clone(d), spec(case))
        .unwrap_or_else(|e| panic!("{}: {e}", case.spec))
}

/// An explicit route attaches as given and is never replaced: a second attach is refused.
pub fn attaches(open: Open, case: &Case) {
    let Some(d) = open(case.native) else { return };
    let (c, _) = component(case);
    let want = spec(case);
    let h = attach(&c, &d, case);
    assert_eq!(h.spec(), &want, "{}: the spec was changed", case.spec);
    let attached = c.attached().expect("attached");
    assert_eq!(Some(attached.route()), want.route_id(), "{}", case.spec);
    let again = enable_dynamic_offload(&c, Arc::clone(&d), RouteSpec::resident()).unwrap_err();
    assert!(
        matches!(again, CoreError::AlreadyAttached { .. }),
        "{}: a second attach: {again}",
        case.spec
    );
    assert_eq!(
        c.attached().map(|a| a.route()),
        want.route_id(),
        "{}: replaced",
        case.spec
    );
}

/// Forwards are byte-identical to resident execution on the same device.
pub fn forward_matches_resident(open: Open, case: &Case) {
    let Some(d) = open(case.native) else { return };
    let (c, rs) = component(case);
    let expected: Vec<Vec<u8>> = (0..3).map(|seed| resident(&c, &rs, &d, seed)).collect();
    let h = attach(&c, &d, case);
    // The first forward learns what a streamed route streams; the later ones follow it.
    for (seed, want) in expected.iter().enumerate() {
        let out = h
            .forward(reference::input(&rs, 2, seed as u64).unwrap())
            .unwrap();
        assert!(
            bytes_of(&*d, &out) == *want,
            "{}: forward {seed} differs from resident",
            case.spec
        );
    }
    let counters = h.metrics_snapshot().counters;
    assert_eq!(counters.forwards, 3, "{}", case.spec);
    // The small-unit cases refill each slot of the ring within a forward.
    assert!(
        counters.transfer_units >= case.min_units
            && (case.min_units == 0 || counters.ring_slots == 2),
        "{}: {} units through {} slots",
        case.spec,
        counters.transfer_units,
        counters.ring_slots
    );
}

/// Removing the route restores the component and the device: `remove_dynamic_offload`,
/// or, for `diffusers_group_offload`, whose hooks the seed leaves owned by the handle and
/// the component (`NotOwned`), dropping both.
pub fn detach_restores(open: Open, case: &Case) {
    let Some(d) = open(case.native) else { return };
    let (c, rs) = component(case);
    // A resident run first: what a backend allocates once and keeps (CUDA's cuBLAS
    // workspace, pinned upload buffers) is then in the starting figures.
    let want = resident(&c, &rs, &d, 5);
    let start = held(&*d);
    let host = host_state(&c);
    let params = c.params();
    let mut h = attach(&c, &d, case);
    for _ in 0..2 {
        let out = h.forward(reference::input(&rs, 2, 5).unwrap()).unwrap();
        assert!(bytes_of(&*d, &out) == want, "{}", case.spec);
    }
    let c = match remove_dynamic_offload(&mut h) {
        Ok(()) => {
            drop(h);
            assert!(c.attached().is_none(), "{}: still attached", case.spec);
            c
        }
        Err(CoreError::NotOwned { .. }) => {
            assert!(
                case.spec.starts_with("diffusers_group_offload"),
                "{}: only group offload leaves release to its owners",
                case.spec
            );
            drop((h, c));
            component(case).0
        }
        Err(e) => panic!("{}: remove: {e}", case.spec),
    };
    assert!(
        params.iter().all(|p| p.device().is_none()),
        "{}: a param stayed on the device",
        case.spec
    );
    let host_now: Vec<u64> = params.iter().map(|p| p.host_checksum()).collect();
    assert_eq!(host_now, host, "{}: host weights changed", case.spec);
    drop(params);
    assert_eq!(
        held(&*d),
        start,
        "{}: device or pinned bytes left",
        case.spec
    );
    // Attachable again, with the same result.
    let h = attach(&c, &d, case);
    let out = h.forward(reference::input(&rs, 2, 5).unwrap()).unwrap();
    assert!(bytes_of(&*d, &out) == want, "{}: reattached", case.spec);
}

/// Options the route does not take, malformed values and the wrong allocator are refused
/// with a typed error that names what is wrong, changing nothing.
pub fn bad_options_refused(open: Open, case: &Case) {
    let Some(d) = open(case.native) else { return };
    let (c, _) = component(case);
    let host = host_state(&c);
    let start = held(&*d);
    for (bad, word) in case.bad {
        let err = match ddo_routes::parse_spec(bad) {
            Err(e) => e,
            Ok(s) => enable_dynamic_offload(&c, Arc::clone(&d), s).unwrap_err(),
        };
        assert!(
            matches!(
                err,
                CoreError::Refused { .. }
                    | CoreError::InvalidOption { .. }
                    | CoreError::ContradictoryOptions { .. }
            ),
            "{bad}: {err:?}"
        );
        assert!(err.to_string().contains(word), "{bad}: {err}");
        assert!(c.attached().is_none(), "{bad}: attached anyway");
    }
    assert_eq!(host_state(&c), host, "{}: host weights changed", case.spec);
    assert_eq!(held(&*d), start, "{}: a refusal left bytes", case.spec);
    drop(d);
    // The wrong allocator: native_vmm needs the native pool, linear_convolution refuses it.
    if case.native || case.spec.starts_with("linear_convolution") {
        let Some(other) = open(!case.native) else {
            return;
        };
        let err = enable_dynamic_offload(&c, Arc::clone(&other), spec(case)).unwrap_err();
        assert!(
            matches!(err, CoreError::Refused { .. }),
            "{}: {err:?}",
            case.spec
        );
        assert!(c.attached().is_none());
        assert_eq!(held(&*other).0, 0, "{}: a refusal allocated", case.spec);
    }
}

/// One `#[test]` per route configuration and contract for one backend: `$backend` names the
/// module they go in, `$open` is an [`Open`] for it. The including crate declares this
/// module as `#[macro_use] mod route_contract;` at its root.
macro_rules! route_contract_tests {
    ($backend:ident, $open:expr) => {
        mod $backend {
            pub(super) fn open(native: bool) -> Option<std::sync::Arc<dyn ddo_core::Device>> {
                let open: crate::route_contract::Open = $open;
                open(native)
            }
            route_contract_tests!(@routes
                none, leaf, leaf_stream, block, block_stream, linear_convolution, native_vmm,
                leaf_stream_units, block_stream_units, native_vmm_units);
        }
    };
    (@routes $($case:ident),*) => {
        $(
            mod $case {
                fn case() -> crate::route_contract::Case {
                    crate::route_contract::case(stringify!($case))
                }
                #[test]
                fn attaches() {
                    crate::route_contract::attaches(super::open, &case());
                }
                #[test]
                fn forward_matches_resident() {
                    crate::route_contract::forward_matches_resident(super::open, &case());
                }
                #[test]
                fn detach_restores() {
                    crate::route_contract::detach_restores(super::open, &case());
                }
                #[test]
                fn bad_options_refused() {
                    crate::route_contract::bad_options_refused(super::open, &case());
                }
            }
        )*
    };
}
