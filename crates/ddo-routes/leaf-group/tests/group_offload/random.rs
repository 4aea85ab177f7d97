//! Random reference components under random configurations: outputs bit-identical to
//! resident execution, and device and pinned memory back to where they started.

use ddo_core::reference::{LeafSpec, ReferenceSpec, build};
use ddo_core::{DType, Device, OffloadType};
use proptest::prelude::*;

use crate::common::*;

fn leaf() -> impl Strategy<Value = LeafSpec> {
    prop_oneof![
        (1usize..=16).prop_map(LeafSpec::linear),
        Just(LeafSpec::norm()),
    ]
}

fn dtype() -> impl Strategy<Value = DType> {
    prop_oneof![Just(DType::F32), Just(DType::F16), Just(DType::BF16)]
}

pub fn reference_spec() -> impl Strategy<Value = ReferenceSpec> {
    (
        1usize..=16,
        dtype(),
        prop::collection::vec(leaf(), 0..3),
        prop::collection::vec(prop::collection::vec(leaf(), 0..4), 0..5),
        prop::collection::vec(leaf(), 0..3),
        any::<bool>(),
        any::<u64>(),
    )
        .prop_map(|(width, dtype, mut stem, blocks, mut head, tie, seed)| {
            if tie {
                // The tied head needs a first stem leaf mapping width to width, and a
                // network that ends at width.
                stem.insert(0, LeafSpec::linear(width));
                head.push(LeafSpec::linear(width));
            }
            ReferenceSpec {
                name: "transformer".into(),
                class_name: "Random".into(),
                dtype,
                in_features: width,
                stem,
                blocks,
                head,
                tie_head_to_stem: tie,
                seed,
            }
        })
}

fn case() -> impl Strategy<Value = Case> {
    (
        any::<bool>(),
        1usize..=3,
        any::<bool>(),
        any::<bool>(),
        prop_oneof![
            Just(HostChoice::Default),
            Just(HostChoice::Pinned),
            Just(HostChoice::LowCpu),
            Just(HostChoice::Unpinned),
        ],
    )
        .prop_map(|(block, n, use_stream, record_stream, host)| Case {
            offload_type: if block {
                OffloadType::BlockLevel
            } else {
                OffloadType::LeafLevel
            },
            blocks_per_group: if use_stream { 1 } else { n },
            use_stream,
            record_stream: use_stream && record_stream,
            host,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn random_components_match_resident_execution(
        spec in reference_spec(),
        case in case(),
        batch in 1usize..=3,
    ) {
        let c = build(&spec).unwrap();
        let device = slow_device(1 << 20, 8e6);
        let xs = inputs(&spec, batch, 3);
        let expected = baseline(&c, &xs);
        let (hooks, metrics) = attach(&c, &device, &case.spec());
        for (x, want) in xs.iter().zip(&expected) {
            prop_assert_eq!(&run(&c, &*device, x), want);
            prop_assert_eq!(device.memory_info().allocated, 0);
        }
        prop_assert_eq!(metrics.counters().schedule_relearned, 0);
        detach_and_check_released(&c, &device, hooks, 0);
    }
}
