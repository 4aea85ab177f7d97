//! Qwen-Image's text encoder from one file (issue 37): the Qwen2.5-VL GGUF of the fixture
//! (`fixtures/gguf/qwen_text_encoder-mixed.gguf`, llama.cpp's names, architecture `qwen2vl`,
//! Q8_0 / Q5_0 / Q4_1 and F32) against gguf-py's dequantization of it
//! (`.dequantized.safetensors`, Transformers' names, read as a single safetensors file):
//! dequantized at load into f32 the two give the same bytes; kept as blocks (computed in
//! bf16) the output is as near the reference as bf16 compute over it; every route gives the resident bytes;
//! a GGUF of another architecture and a file missing a layer are typed errors naming the file.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ddo_core::{DType, Device, RouteSpec, Tensor, ops_of};
use ddo_host::HostDevice;
use ddo_nn::qwen_text::{QwenTextEncoder, QwenTextEncoderConfig, QwenTextInputs};
use ddo_nn::{LoadError, UnusedWeights, read_f32_tensor};
use ddo_routes::enable_dynamic_offload;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

fn gguf() -> PathBuf {
    fixtures().join("gguf/qwen_text_encoder-mixed.gguf")
}

fn config() -> QwenTextEncoderConfig {
    QwenTextEncoderConfig::from_file(&fixtures().join("qwen_text_encoder/text_encoder/config.json"))
        .unwrap()
}

/// The fixture's tokenizer call: two templated prompts, the first padded.
fn inputs() -> QwenTextInputs {
    let file = fixtures().join("qwen_text_encoder/inputs.safetensors");
    let (shape, ids) = read_f32_tensor(&file, "input_ids_f32").unwrap();
    let (_, mask) = read_f32_tensor(&file, "attention_mask_f32").unwrap();
    QwenTextInputs::new(
        ids.iter().map(|&v| v as u32).collect(),
        Some(mask.iter().map(|&v| v as u32).collect()),
        shape[0],
    )
}

fn load(path: &Path, dtype: Option<DType>) -> QwenTextEncoder {
    QwenTextEncoder::load_file(path, &config(), dtype, UnusedWeights::Refuse)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The last hidden state of `model` on a fresh host device, resident, as f32 values and bytes.
fn run(model: &QwenTextEncoder) -> (Vec<f32>, Vec<u8>) {
    let d = HostDevice::with_capacity(1 << 30).unwrap();
    model
        .component()
        .to_device(&*d, &d.compute_stream())
        .unwrap();
    let out = model.forward(&*d, &inputs()).unwrap();
    let r = (values(&*d, &out), bytes(&*d, &out));
    model.component().to_host().unwrap();
    r
}

fn values(d: &dyn Device, t: &Tensor) -> Vec<f32> {
    ops_of(d).unwrap().to_f32_vec(t).unwrap()
}

fn bytes(d: &dyn Device, t: &Tensor) -> Vec<u8> {
    t.to_host_bytes(d, &d.compute_stream()).unwrap()
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

#[test]
fn the_gguf_loads_as_its_dequantization_and_every_route_agrees() {
    let reference = fixtures().join("gguf/qwen_text_encoder-mixed.dequantized.safetensors");
    // The single safetensors file in Transformers' names (`lm_head` skipped).
    let (want, want_bytes) = run(&load(&reference, Some(DType::F32)));
    // Dequantized at load into f32: the same values, so the same bytes.
    let (_, at_load) = run(&load(&gguf(), Some(DType::F32)));
    assert!(
        at_load == want_bytes,
        "the f32 GGUF load differs from gguf-py's values"
    );
    // Kept as blocks: each linear dequantizes its weight where it runs.
    let blocks = load(&gguf(), None);
    assert!(
        blocks
            .component()
            .params()
            .iter()
            .any(|p| p.dtype() == DType::Quantized),
        "no param kept its blocks"
    );
    let (got, resident) = run(&blocks);
    let original =
        QwenTextEncoder::load(&fixtures().join("qwen_text_encoder/text_encoder"), None).unwrap();
    let (plain, _) = run(&original);
    // Quantized weights compute in bf16: the blocks' output is as far from the f32
    // reference as bf16 compute over the dequantized weights is, and far nearer than the
    // original weights.
    let (bf16, _) = run(&load(&gguf(), Some(DType::BF16)));
    let (apart, bf16_error, moved) = (
        rel_l2(&got, &want),
        rel_l2(&bf16, &want),
        rel_l2(&want, &plain),
    );
    eprintln!("blocks {apart:e}, bf16 at load {bf16_error:e}, original weights {moved:e}");
    assert!(moved > 1e-3, "the quantization moved {moved:e}");
    assert!(
        apart <= 2.0 * bf16_error && apart < moved / 5.0,
        "blocks {apart:e} from the dequantization (bf16 at load {bf16_error:e}, moved {moved:e})"
    );
    // Every route streams the blocks as stored: the resident bytes.
    for spec in [
        "diffusers_group_offload:offload_type=leaf_level,use_stream=true",
        "diffusers_group_offload:offload_type=block_level,num_blocks_per_group=1,use_stream=true",
        "diffusers_group_offload:offload_type=leaf_level",
    ] {
        let model = load(&gguf(), None);
        let d = HostDevice::with_capacity(1 << 30).unwrap();
        let route: RouteSpec = ddo_routes::parse_spec(spec).unwrap();
        let handle = enable_dynamic_offload(model.component(), d.clone() as Arc<dyn Device>, route)
            .unwrap_or_else(|e| panic!("{spec}: {e}"));
        let out = model.forward(&*d, &inputs()).unwrap();
        assert!(
            bytes(&*d, &out) == resident,
            "{spec}: other bytes than resident"
        );
        drop(handle);
    }
}

#[test]
fn a_gguf_of_another_model_or_missing_a_layer_is_refused_naming_the_file() {
    // T5's GGUF (architecture t5encoder): refused by its architecture.
    let t5 = fixtures().join("gguf/flux_pipeline-t5-mixed.gguf");
    let e = QwenTextEncoder::load_file(&t5, &config(), None, UnusedWeights::Refuse).unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, LoadError::CorruptFile { .. }), "{e:?}");
    assert!(
        text.contains("t5encoder")
            && text.contains("qwen2vl")
            && text.contains("flux_pipeline-t5-mixed.gguf"),
        "{text}"
    );
    // A config with one layer more than the file holds: the missing tensor is named.
    let mut deeper = config();
    deeper.num_hidden_layers += 1;
    let e = QwenTextEncoder::load_file(&gguf(), &deeper, None, UnusedWeights::Refuse).unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("blk.2.") || text.contains("layers.2."),
        "{text}"
    );
}
