//! The unquantized float tensors of a GGUF file that holds quantized ones (biases, norm
//! scales, city96's F32 `img_in`) load as bf16, the dtype such a model computes in, as
//! Diffusers' GGUF path casts them (`bias.to(compute_dtype)`, `torch_dtype` for the rest):
//! every linear then runs one dtype end to end (on CUDA, cuBLASLt with the bias and GELU in
//! its epilogue, where an f32 bias beside bf16 activations fell back to cuBLAS and a
//! separate GELU). With `--dtype`, everything converts to it as before.

use std::path::{Path, PathBuf};

use ddo_core::{Component, DType};
use ddo_nn::UnusedWeights;
use ddo_nn::flux::{FluxTransformer, FluxTransformerConfig};
use ddo_nn::qwen_text::{QwenTextEncoder, QwenTextEncoderConfig};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

/// The dtypes of `c`'s params, each once.
fn dtypes(c: &Component) -> Vec<DType> {
    let mut out: Vec<DType> = Vec::new();
    for p in c.params() {
        if !out.contains(&p.dtype()) {
            out.push(p.dtype());
        }
    }
    out
}

#[test]
fn a_quantized_gguf_s_float_tensors_load_as_bf16() {
    let flux = fixtures().join("gguf/flux_pipeline-transformer-mixed.gguf");
    let config =
        FluxTransformerConfig::from_file(&fixtures().join("flux_pipeline/transformer/config.json"))
            .unwrap();
    // The file holds F32 (and F16) tensors beside its blocks.
    let file = ddo_core::gguf::GgufFile::open(&flux).unwrap();
    assert!(file.tensors().iter().any(|t| {
        matches!(
            t.ggml_type,
            ddo_core::gguf::GgmlType::F32 | ddo_core::gguf::GgmlType::F16
        )
    }));
    let t =
        FluxTransformer::load_original(&flux, Some(config.clone()), None, UnusedWeights::Refuse)
            .unwrap();
    let seen = dtypes(t.component());
    assert!(seen.contains(&DType::Quantized), "{seen:?}");
    assert!(
        seen.iter()
            .all(|d| matches!(d, DType::Quantized | DType::BF16)),
        "{seen:?}"
    );
    // `--dtype f32` still converts every tensor (the blocks dequantized) to f32.
    let t = FluxTransformer::load_original(
        &flux,
        Some(config),
        Some(DType::F32),
        UnusedWeights::Refuse,
    )
    .unwrap();
    assert_eq!(dtypes(t.component()), vec![DType::F32]);

    let qwen = fixtures().join("gguf/qwen_text_encoder-mixed.gguf");
    let config = QwenTextEncoderConfig::from_file(
        &fixtures().join("qwen_text_encoder/text_encoder/config.json"),
    )
    .unwrap();
    let e = QwenTextEncoder::load_file(&qwen, &config, None, UnusedWeights::Refuse).unwrap();
    let seen = dtypes(e.component());
    assert!(
        seen.contains(&DType::Quantized)
            && seen
                .iter()
                .all(|d| matches!(d, DType::Quantized | DType::BF16)),
        "{seen:?}"
    );
}
