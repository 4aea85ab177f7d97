//! Single files the loaders refuse instead of resolving: a ComfyUI scaled fp8 file (the
//! `scaled_fp8` marker) missing one weight's `scale_weight`, which would run at scale 1,
//! and one tensor under two of a layout's prefixes (Flux's `model.diffusion_model.` and
//! none, the LDM VAE's `first_stage_model.`, `vae.` and none, CLIP's `text_model.` and
//! none, and, in a folder, Qwen2.5-VL's `model.`, `model.language_model.` and none), which a
//! loader would otherwise resolve by its prefix order. Each is a typed `LoadError` naming
//! the file and the tensor(s). The files are the fixtures (`fixtures/flux_transformer_original`,
//! `fixtures/vae_flux_original`, `fixtures/clip_text`, `fixtures/qwen_text_encoder`;
//! `tools/write_flux_original.py` documents the layout) rewritten.

use std::path::{Path, PathBuf};

use ddo_core::DType;
use ddo_nn::clip::{ClipTextConfig, ClipTextModel};
use ddo_nn::flux::{FluxTransformer, FluxTransformerConfig};
use ddo_nn::qwen_text::QwenTextEncoder;
use ddo_nn::vae::{AutoencoderKL, AutoencoderKLConfig};
use ddo_nn::{LoadError, UnusedWeights};
use safetensors::Dtype;

/// A scratch folder (removed on drop), made exclusively under a random name.
fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("ddo-nn-single-")
        .tempdir()
        .expect("scratch folder")
}

fn fixture(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(path)
}

/// One tensor of a file: name, dtype, shape, bytes.
type Entry = (String, Dtype, Vec<usize>, Vec<u8>);

/// Every tensor of the safetensors file at `path`.
fn tensors(path: &Path) -> Vec<Entry> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, v)| (name, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect()
}

/// Writes `entries` as a safetensors file at `path`.
fn write(path: &Path, entries: &[Entry]) {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = entries
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// A copy of `entries`' tensor `from` named `to`.
fn copy_named(entries: &[Entry], from: &str, to: &str) -> Entry {
    let (_, d, s, b) = entries
        .iter()
        .find(|e| e.0 == from)
        .unwrap_or_else(|| panic!("no `{from}`"))
        .clone();
    (to.to_string(), d, s, b)
}

fn flux_config() -> FluxTransformerConfig {
    FluxTransformerConfig::from_file(&fixture("flux_transformer_original/config.json")).unwrap()
}

fn flux(path: &Path, dtype: Option<DType>, unused: UnusedWeights) -> Result<(), LoadError> {
    FluxTransformer::load_original(path, Some(flux_config()), dtype, unused).map(|_| ())
}

const SCALED: &str = "flux_transformer_original/flux1-tiny-fp8-scaled.safetensors";
const P: &str = "model.diffusion_model.";

/// A scaled fp8 file whose fp8 weight lacks its `scale_weight` is refused, as stored and
/// converted, naming the file and the weight — for a plain and a fused (`qkv`, read as three
/// views) weight. The same fp8 weights without the `scaled_fp8` marker are an unscaled fp8
/// checkpoint (layerwise casting's) and load.
#[test]
fn a_scaled_fp8_file_missing_a_scale_is_refused_naming_the_weight() {
    let dir = scratch();
    let all = tensors(&fixture(SCALED));
    assert!(all.iter().any(|e| e.0 == "scaled_fp8"));
    for layer in [
        "double_blocks.0.img_attn.proj",
        "double_blocks.0.img_attn.qkv",
    ] {
        let weight = format!("{P}{layer}.weight");
        assert!(all.iter().any(|e| e.0 == weight && e.1 == Dtype::F8_E4M3));
        let scale = format!("{P}{layer}.scale_weight");
        let file = dir.path().join("missing-scale.safetensors");
        let kept: Vec<Entry> = all.iter().filter(|e| e.0 != scale).cloned().collect();
        write(&file, &kept);
        for dtype in [None, Some(DType::BF16)] {
            let err = flux(&file, dtype, UnusedWeights::Refuse).unwrap_err();
            match &err {
                LoadError::MissingScale {
                    tensor,
                    file: f,
                    marker,
                    expected,
                } => {
                    assert_eq!(tensor, &weight, "{dtype:?}");
                    assert_eq!(f, &file);
                    assert_eq!(marker, "scaled_fp8");
                    assert!(expected.contains(&scale), "{expected}");
                }
                other => panic!("{layer} {dtype:?}: expected MissingScale, got {other}"),
            }
            let text = err.to_string();
            assert!(
                text.contains("missing-scale.safetensors") && text.contains("re-download"),
                "{text}"
            );
        }
        // Without the marker nothing declares the scales: fp8 as stored, as layerwise
        // casting writes it.
        let unmarked: Vec<Entry> = kept
            .iter()
            .filter(|e| e.0 != "scaled_fp8")
            .cloned()
            .collect();
        let plain = dir.path().join("unscaled.safetensors");
        write(&plain, &unmarked);
        flux(&plain, None, UnusedWeights::Refuse).expect("an fp8 file without the marker");
    }
}

/// A Flux tensor both under `model.diffusion_model.` and bare is refused naming both keys,
/// whichever the loader reads — a weight, a scale, and, in a bare file, a prefixed copy —
/// even with unused tensors allowed (where one copy would otherwise be dropped unseen).
#[test]
fn a_flux_tensor_under_the_prefix_and_bare_is_refused_naming_both() {
    let dir = scratch();
    let scaled = tensors(&fixture(SCALED));
    let bare = tensors(&fixture("flux_transformer_original/flux1-tiny.safetensors"));
    let cases = [
        (&scaled, "img_in.weight", true),
        (&scaled, "double_blocks.0.img_attn.qkv.scale_weight", true),
        (&scaled, "final_layer.adaLN_modulation.1.bias", true),
        (&bare, "double_blocks.0.img_attn.qkv.weight", false),
    ];
    for (entries, name, prefixed) in cases {
        let (read, copy) = if prefixed {
            (format!("{P}{name}"), name.to_string())
        } else {
            (name.to_string(), format!("{P}{name}"))
        };
        let mut with_copy = entries.clone();
        with_copy.push(copy_named(entries, &read, &copy));
        let file = dir.path().join("both.safetensors");
        write(&file, &with_copy);
        for unused in [UnusedWeights::Refuse, UnusedWeights::Allow] {
            match flux(&file, None, unused).unwrap_err() {
                LoadError::DuplicateTensor {
                    file: f,
                    first,
                    second,
                    ..
                } => {
                    assert_eq!(f, file);
                    assert_eq!((first.as_str(), second.as_str()), (&*read, &*copy));
                }
                other => panic!("{name} {unused:?}: expected DuplicateTensor, got {other}"),
            }
        }
    }
}

/// An LDM VAE tensor under two of `first_stage_model.`, `vae.` and no prefix is refused
/// naming both, with unused tensors allowed or not; under one prefix alone the file loads.
#[test]
fn an_ldm_vae_tensor_under_two_prefixes_is_refused_naming_both() {
    let dir = scratch();
    let config = AutoencoderKLConfig::from_file(&fixture("vae_flux/config.json")).unwrap();
    let bare = tensors(&fixture("vae_flux_original/ae-tiny.safetensors"));
    let under = |prefix: &str| -> Vec<Entry> {
        bare.iter()
            .map(|(n, d, s, b)| (format!("{prefix}{n}"), *d, s.clone(), b.clone()))
            .collect()
    };
    let load = |file: &Path, unused| {
        AutoencoderKL::load_original(file, config.clone(), None, unused).map(|_| ())
    };
    let file = dir.path().join("ae.safetensors");
    write(&file, &under("first_stage_model."));
    load(&file, UnusedWeights::Refuse).expect("one prefix");
    for (read, copy) in [
        ("first_stage_model.", ""),
        ("first_stage_model.", "vae."),
        ("vae.", ""),
    ] {
        let mut entries = under(read);
        let name = "decoder.conv_in.weight";
        entries.push(copy_named(
            &entries,
            &format!("{read}{name}"),
            &format!("{copy}{name}"),
        ));
        write(&file, &entries);
        for unused in [UnusedWeights::Refuse, UnusedWeights::Allow] {
            match load(&file, unused).unwrap_err() {
                LoadError::DuplicateTensor { first, second, .. } => {
                    assert_eq!(
                        (first, second),
                        (format!("{read}{name}"), format!("{copy}{name}"))
                    );
                }
                other => panic!("{read} + {copy}: expected DuplicateTensor, got {other}"),
            }
        }
    }
}

/// A CLIP tensor both bare and under `text_model.` is refused naming both, even with unused
/// tensors allowed (the loader reads the bare names when it has both).
#[test]
fn a_clip_tensor_under_text_model_and_bare_is_refused_naming_both() {
    let dir = scratch();
    let config = ClipTextConfig::from_file(&fixture("clip_text/config.json")).unwrap();
    let mut entries = tensors(&fixture("clip_text/model.safetensors"));
    entries.push(copy_named(
        &entries,
        "final_layer_norm.weight",
        "text_model.final_layer_norm.weight",
    ));
    let file = dir.path().join("clip_l.safetensors");
    write(&file, &entries);
    match ClipTextModel::load_file(&file, &config, None, UnusedWeights::Allow).unwrap_err() {
        LoadError::DuplicateTensor { first, second, .. } => assert_eq!(
            (first.as_str(), second.as_str()),
            (
                "final_layer_norm.weight",
                "text_model.final_layer_norm.weight"
            )
        ),
        other => panic!("expected DuplicateTensor, got {other}"),
    }
}

/// A Qwen2.5-VL language-model tensor under two of its layouts (`model.` and transformers
/// 5.x's `model.language_model.`) in a text encoder folder is refused naming both, even with
/// unused tensors allowed.
#[test]
fn a_qwen_text_tensor_under_two_layouts_is_refused_naming_both() {
    let dir = scratch();
    let fixture_dir = fixture("qwen_text_encoder/text_encoder");
    std::fs::copy(
        fixture_dir.join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let mut entries = tensors(&fixture_dir.join("model.safetensors"));
    entries.push(copy_named(
        &entries,
        "model.norm.weight",
        "model.language_model.norm.weight",
    ));
    write(&dir.path().join("model.safetensors"), &entries);
    match QwenTextEncoder::load_checked(dir.path(), None, UnusedWeights::Allow).unwrap_err() {
        LoadError::DuplicateTensor { first, second, .. } => assert_eq!(
            (first.as_str(), second.as_str()),
            ("model.norm.weight", "model.language_model.norm.weight")
        ),
        other => panic!("expected DuplicateTensor, got {other}"),
    }
}
