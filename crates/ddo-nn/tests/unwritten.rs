//! Pipelines whose weights are never written (`FluxPipeline::unwritten_with`,
//! `QwenImagePipeline::unwritten`: what `ddo resolve --config` plans): the random pipeline's
//! params — names, shapes, dtypes, bytes, fp8 storage and its scales — with no memory
//! behind them, so FLUX.1-dev plans on a machine that could not hold its weights (issue
//! 34: `resolve --config flux-dev` was refused for lack of host memory).

use std::sync::Arc;

use ddo_core::{Component, DType};
use ddo_nn::pipeline::{
    FluxPipeline, FluxPipelineConfig, Loaded, QwenImagePipeline, QwenImagePipelineConfig,
};

/// Every param of `components` as a planner sees it: component, name, shape, dtype, bytes,
/// whether it has an fp8 scale.
type Seen = (String, String, Vec<usize>, DType, usize, bool);

fn seen(components: &[Arc<Component>]) -> Vec<Seen> {
    components
        .iter()
        .flat_map(|c| {
            c.params().into_iter().map(|p| {
                (
                    c.name().to_string(),
                    p.name().to_string(),
                    p.shape().to_vec(),
                    p.dtype(),
                    p.nbytes(),
                    p.scale().is_some(),
                )
            })
        })
        .collect()
}

#[test]
fn an_unwritten_pipeline_has_the_random_pipeline_s_params() {
    for dtype in [DType::F32, DType::BF16, DType::F8E4M3] {
        let config = FluxPipelineConfig::tiny();
        let random = FluxPipeline::random(&config, 0, dtype).unwrap();
        let unwritten = FluxPipeline::unwritten_with(&config, dtype, Loaded::default()).unwrap();
        let (a, b) = (seen(&random.components()), seen(&unwritten.components()));
        assert!(!a.is_empty());
        assert_eq!(a, b, "flux tiny, {dtype}");
        if dtype.is_fp8() {
            assert!(b.iter().any(|p| p.3 == dtype && p.5), "fp8 storage made");
        }
        // Never written: every byte is zero.
        for c in unwritten.components() {
            for p in c.params() {
                assert!(p.host().with_bytes(|b| b.iter().all(|&x| x == 0)));
            }
        }
        let config = QwenImagePipelineConfig::tiny();
        let random = QwenImagePipeline::random(&config, 0, dtype).unwrap();
        let unwritten = QwenImagePipeline::unwritten(&config, dtype).unwrap();
        let (a, b) = (seen(&random.components()), seen(&unwritten.components()));
        assert!(!a.is_empty());
        assert_eq!(a, b, "qwen tiny, {dtype}");
    }
}

/// This process's resident memory.
fn rss() -> u64 {
    ddo_core::host_memory::process_status_bytes("VmRSS").expect("/proc/self/status")
}

fn bytes_of(components: &[Arc<Component>], name: &str) -> u64 {
    components
        .iter()
        .find(|c| c.name() == name)
        .map(|c| c.param_bytes())
        .unwrap()
}

#[test]
fn flux_dev_unwritten_costs_address_space_not_memory() {
    let config = FluxPipelineConfig::flux_dev();
    let before = rss();
    let bf16 = FluxPipeline::unwritten_with(&config, DType::BF16, Loaded::default()).unwrap();
    let components = bf16.components();
    // FLUX.1-dev's transformer: 11,901,408,320 params, two bytes each.
    assert_eq!(bytes_of(&components, "transformer"), 23_802_816_640);
    let all: u64 = components.iter().map(|c| c.param_bytes()).sum();
    assert!(all > 33_000_000_000, "{all}");
    let fp8 = FluxPipeline::unwritten_with(&config, DType::F8E4M3, Loaded::default()).unwrap();
    let grown = rss().saturating_sub(before);
    assert!(
        grown < 512 << 20,
        "{all} B of weights made {grown} B resident"
    );
    // fp8 storage: one byte per cast weight; the modulations, norms and proj_out stay bf16
    // (Diffusers' layerwise-casting rule), about two thirds of bf16's bytes.
    let (t16, t8) = (
        bytes_of(&components, "transformer"),
        bytes_of(&fp8.components(), "transformer"),
    );
    assert!(t8 * 10 < t16 * 7 && t8 * 2 > t16, "{t8} of {t16}");
}

/// Whether every param of `c` is all zero bytes.
fn all_zero(c: &Component) -> bool {
    c.params()
        .iter()
        .all(|p| p.host().with_bytes(|b| b.iter().all(|&x| x == 0)))
}

/// The bytes of every param of `c`, in order.
fn values(c: &Component) -> Vec<Vec<u8>> {
    c.params()
        .iter()
        .map(|p| p.host().with_bytes(|b| b.to_vec()))
        .collect()
}

/// `random_parts` (what `ddo bench --component C` builds): the named component has
/// `random`'s values byte for byte, the others `random`'s params with no values (so a bench
/// of FLUX.1-dev's transformer no longer holds T5-XXL's 9.5 GB).
#[test]
fn random_parts_writes_only_the_named_component_with_random_s_values() {
    let config = FluxPipelineConfig::tiny();
    let random = FluxPipeline::random(&config, 0, DType::F32).unwrap();
    for only in ["transformer", "text_encoder_2", "vae"] {
        let parts =
            FluxPipeline::random_parts(&config, 0, DType::F32, Loaded::default(), |c| c == only)
                .unwrap();
        assert_eq!(seen(&random.components()), seen(&parts.components()));
        for (r, p) in random.components().iter().zip(parts.components()) {
            assert_eq!(r.name(), p.name());
            if p.name() == only {
                assert_eq!(values(r), values(&p), "{only}");
                assert!(!all_zero(&p), "{only} has values");
            } else {
                assert!(all_zero(&p), "{} unwritten when benching {only}", p.name());
                assert!(!all_zero(r), "{} random", r.name());
            }
        }
    }
    let config = QwenImagePipelineConfig::tiny();
    let random = QwenImagePipeline::random(&config, 0, DType::F32).unwrap();
    let parts =
        QwenImagePipeline::random_parts(&config, 0, DType::F32, |c| c == "transformer").unwrap();
    assert_eq!(seen(&random.components()), seen(&parts.components()));
    for (r, p) in random.components().iter().zip(parts.components()) {
        if p.name() == "transformer" {
            assert_eq!(values(r), values(&p));
        } else {
            assert!(all_zero(&p), "{}", p.name());
        }
    }
}
