//! `AutoencoderKL` decoder: conformance with Diffusers' fixtures (untiled SD and Flux
//! layouts, Flux tiled), bit-identical output under every route, typed errors for configs,
//! checkpoints and a missing execution device, the real Flux VAE at random weights, and
//! the activation-peak estimate against the host backend's exact accounting.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ddo_core::{AllocatorKind, CoreError, DType, Device, Ops, RouteSpec, Tensor};
use ddo_host::{HostDevice, HostDeviceConfig};
use ddo_nn::vae::{
    AutoencoderKL, AutoencoderKLConfig, TilingConfig, estimate_decode_peak_bytes,
    estimate_tiled_decode_peak_bytes,
};
use ddo_nn::{CheckpointWeights, LoadError, RandomWeights, read_f32_tensor};
use ddo_routes::enable_dynamic_offload;

const TOLERANCE: f64 = 1e-5;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

fn device() -> Arc<HostDevice> {
    HostDevice::with_capacity(1 << 30).expect("host device")
}

fn native_device() -> Arc<HostDevice> {
    HostDevice::new(HostDeviceConfig {
        capacity: 1 << 30,
        allocator: AllocatorKind::NativeVmm,
        ..HostDeviceConfig::default()
    })
    .expect("host device")
}

/// The fixture's VAE, loaded through `CheckpointWeights` (the real loading code).
fn load(name: &str) -> AutoencoderKL {
    let dir = fixture(name);
    let config = AutoencoderKLConfig::from_file(&dir.join("config.json")).expect("config");
    let mut weights = CheckpointWeights::open_dir(&dir, None).expect("weights");
    AutoencoderKL::build(&mut weights, config).expect("build")
}

fn tensor(fixture_name: &str, file: &str, name: &str) -> (Tensor, Vec<f32>) {
    let (shape, values) =
        read_f32_tensor(&fixture(fixture_name).join(file), name).expect("fixture tensor");
    (
        Tensor::from_f32(shape, DType::F32, &values).expect("tensor"),
        values,
    )
}

fn tiling(name: &str) -> TilingConfig {
    let text = std::fs::read_to_string(fixture(name).join("tiling.json")).expect("tiling.json");
    let json: serde_json::Value = serde_json::from_str(&text).expect("json");
    serde_json::from_value(json["attributes_set"].clone()).expect("tiling attributes")
}

fn values(d: &HostDevice, t: &Tensor) -> Vec<f32> {
    d.to_f32_vec(t).expect("download")
}

fn bytes(d: &HostDevice, t: &Tensor) -> Vec<u8> {
    t.to_host_bytes(d, &d.compute_stream()).expect("download")
}

fn rel_l2(actual: &[f32], expected: &[f32]) -> f64 {
    assert_eq!(actual.len(), expected.len());
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (a, e) in actual.iter().zip(expected) {
        num += (f64::from(*a) - f64::from(*e)).powi(2);
        den += f64::from(*e).powi(2);
    }
    (num / den).sqrt()
}

/// Decodes with the weights placed on the device outside any route.
fn decode_resident(
    vae: &AutoencoderKL,
    latents: &Tensor,
    tiling: Option<TilingConfig>,
) -> (Arc<HostDevice>, Tensor) {
    let d = device();
    vae.component()
        .to_device(&*d, &d.compute_stream())
        .expect("to_device");
    let out = vae.decode(Some(&*d), latents, tiling).expect("decode");
    (d, out)
}

#[test]
fn sd_decode_matches_diffusers() {
    let vae = load("vae_sd");
    let (latents, _) = tensor("vae_sd", "inputs.safetensors", "latents");
    let (_, expected) = tensor("vae_sd", "outputs.safetensors", "sample");
    let (d, out) = decode_resident(&vae, &latents, None);
    assert_eq!(out.shape(), &[1, 3, 16, 16]);
    let err = rel_l2(&values(&d, &out), &expected);
    println!("vae_sd sample: rel L2 {err:.3e}");
    assert!(err <= TOLERANCE, "vae_sd rel L2 {err:e}");
}

#[test]
fn flux_decode_matches_diffusers() {
    let vae = load("vae_flux");
    assert!(vae.config().shift_factor.is_some() && !vae.config().use_post_quant_conv);
    let (latents, _) = tensor("vae_flux", "inputs.safetensors", "latents");
    let (_, expected) = tensor("vae_flux", "outputs.safetensors", "sample");
    let (d, out) = decode_resident(&vae, &latents, None);
    assert_eq!(out.shape(), &[1, 3, 16, 16]);
    let err = rel_l2(&values(&d, &out), &expected);
    println!("vae_flux sample: rel L2 {err:.3e}");
    assert!(err <= TOLERANCE, "vae_flux rel L2 {err:e}");
}

#[test]
fn flux_tiled_decode_matches_diffusers() {
    let vae = load("vae_flux");
    let t = tiling("vae_flux");
    // tiling.json's derived values.
    assert_eq!(
        (t.overlap_size(), t.blend_extent(), t.row_limit()),
        (6, 4, 12)
    );
    assert_eq!(t.tile_starts(12), vec![0, 6]);
    let (latents, _) = tensor("vae_flux", "inputs.safetensors", "latents_tiled");
    let (_, expected) = tensor("vae_flux", "outputs.safetensors", "sample_tiled");
    let (d, out) = decode_resident(&vae, &latents, Some(t));
    assert_eq!(out.shape(), &[1, 3, 24, 24]);
    let err = rel_l2(&values(&d, &out), &expected);
    println!("vae_flux sample_tiled: rel L2 {err:.3e}");
    assert!(err <= TOLERANCE, "vae_flux tiled rel L2 {err:e}");

    // The same latents untiled, and tiling that does not trigger, match the untiled reference.
    let (_, untiled_ref) = tensor(
        "vae_flux",
        "outputs.safetensors",
        "sample_tiled_reference_untiled",
    );
    let untiled = vae.decode(Some(&*d), &latents, None).expect("decode");
    let err = rel_l2(&values(&d, &untiled), &untiled_ref);
    println!("vae_flux sample_tiled_reference_untiled: rel L2 {err:.3e}");
    assert!(err <= TOLERANCE);
    let defaults = TilingConfig::from_config(vae.config());
    assert_eq!(
        (defaults.tile_latent_min_size, defaults.tile_sample_min_size),
        (16, 32)
    );
    let not_tiled = vae
        .decode(Some(&*d), &latents, Some(defaults))
        .expect("decode");
    assert_eq!(bytes(&d, &not_tiled), bytes(&d, &untiled));
}

#[test]
fn bf16_weights_decode_f32_latents_close_to_the_reference() {
    let vae = AutoencoderKL::load(&fixture("vae_flux"), Some(DType::BF16)).expect("load bf16");
    assert_eq!(vae.dtype(), DType::BF16);
    let (latents, _) = tensor("vae_flux", "inputs.safetensors", "latents_tiled");
    let (_, expected) = tensor("vae_flux", "outputs.safetensors", "sample_tiled");
    let (d, out) = decode_resident(&vae, &latents, Some(tiling("vae_flux")));
    assert_eq!(out.dtype(), DType::BF16);
    let err = rel_l2(&values(&d, &out), &expected);
    println!("vae_flux sample_tiled in bf16: rel L2 {err:.3e}");
    assert!(err < 3e-2, "bf16 rel L2 {err:e}");
}

#[test]
fn component_forward_decodes_untiled() {
    let vae = load("vae_sd");
    let (latents, _) = tensor("vae_sd", "inputs.safetensors", "latents");
    let (d, out) = decode_resident(&vae, &latents, None);
    let forward = vae.component().forward(&*d, latents).expect("forward");
    assert_eq!(bytes(&d, &forward), bytes(&d, &out));
    assert_eq!(vae.component().name(), "vae");
    assert_eq!(vae.component().class_name(), "AutoencoderKL");
}

#[test]
fn every_route_decodes_bit_identically_to_resident() {
    let specs: Vec<(&str, RouteSpec, bool)> = vec![
        ("resident", RouteSpec::resident(), false),
        ("leaf_group", RouteSpec::leaf_group(false, false), false),
        (
            "leaf_group+stream",
            RouteSpec::leaf_group(true, false),
            false,
        ),
        (
            "block_level",
            ddo_routes::parse_spec(
                "diffusers_group_offload:offload_type=block_level,num_blocks_per_group=1",
            )
            .expect("spec"),
            false,
        ),
        (
            "linear_convolution",
            ddo_routes::parse_spec("linear_convolution").expect("spec"),
            false,
        ),
        (
            "native_vmm",
            ddo_routes::parse_spec("native_vmm:budget=1MiB").expect("spec"),
            true,
        ),
    ];
    let (sd_latents, _) = tensor("vae_sd", "inputs.safetensors", "latents");
    let (flux_latents, _) = tensor("vae_flux", "inputs.safetensors", "latents_tiled");
    let t = tiling("vae_flux");
    let (d0, base_sd) = decode_resident(&load("vae_sd"), &sd_latents, None);
    let base_sd = bytes(&d0, &base_sd);
    let (d0, base_flux) = decode_resident(&load("vae_flux"), &flux_latents, Some(t));
    let base_flux = bytes(&d0, &base_flux);

    for (name, spec, native) in specs {
        for (fixture_name, latents, tiling, base) in [
            ("vae_sd", &sd_latents, None, &base_sd),
            ("vae_flux", &flux_latents, Some(t), &base_flux),
        ] {
            let vae = load(fixture_name);
            let d = if native { native_device() } else { device() };
            let handle =
                enable_dynamic_offload(vae.component(), Arc::clone(&d) as Arc<dyn Device>, spec)
                    .unwrap_or_else(|e| panic!("{name}: attach: {e}"));
            // Twice: the second forward runs on what the first one learned (schedules).
            for round in 0..2 {
                let out = vae
                    .decode(Some(&*d), latents, tiling)
                    .unwrap_or_else(|e| panic!("{name} {fixture_name}: decode: {e}"));
                assert_eq!(
                    &bytes(&d, &out),
                    base,
                    "{name} on {fixture_name} (round {round}) differs from resident execution"
                );
            }
            let counters = handle.metrics().counters();
            assert_eq!(counters.forwards, 2, "{name}");
            let leaves = vae.component().leaves().len() as u64;
            let runs_per_decode = if tiling.is_some() { 4 } else { 1 };
            assert_eq!(
                counters.leaf_calls,
                2 * runs_per_decode * leaves,
                "{name}: the route saw every leaf of every decode"
            );
        }
    }
}

#[test]
fn decode_without_a_device_is_a_typed_error() {
    let vae = load("vae_sd");
    let (latents, _) = tensor("vae_sd", "inputs.safetensors", "latents");
    match vae.decode(None, &latents, None) {
        Err(CoreError::InvalidOption { hint, .. }) => {
            assert!(hint.contains("pass the execution device"), "{hint}");
        }
        other => panic!("expected InvalidOption, got {other:?}"),
    }
    // With a route attached, the hint names the route's device.
    let d = device();
    let _handle = enable_dynamic_offload(
        vae.component(),
        Arc::clone(&d) as Arc<dyn Device>,
        RouteSpec::resident(),
    )
    .expect("attach");
    match vae.decode(None, &latents, None) {
        Err(CoreError::InvalidOption { hint, .. }) => assert!(hint.contains("host:0"), "{hint}"),
        other => panic!("expected InvalidOption, got {other:?}"),
    }
    // A remembered execution device makes `None` usable.
    vae.set_execution_device(Some(Arc::clone(&d) as Arc<dyn Device>));
    let out = vae.decode(None, &latents, None).expect("decode");
    assert_eq!(out.shape(), &[1, 3, 16, 16]);
}

#[test]
fn bad_latents_are_shape_errors() {
    let vae = load("vae_sd");
    let d = device();
    vae.component()
        .to_device(&*d, &d.compute_stream())
        .expect("to_device");
    let wrong_channels = Tensor::from_f32(vec![1, 16, 4, 4], DType::F32, &[0.0; 256]).unwrap();
    assert!(matches!(
        vae.decode(Some(&*d), &wrong_channels, None),
        Err(CoreError::Shape { .. })
    ));
    let three_d = Tensor::from_f32(vec![4, 4, 4], DType::F32, &[0.0; 64]).unwrap();
    assert!(matches!(
        vae.decode(Some(&*d), &three_d, Some(tiling("vae_flux"))),
        Err(CoreError::Shape { .. })
    ));
}

/// A fresh temporary directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "ddo-vae-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        Self(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn config_with(edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) -> TempDir {
    let text = std::fs::read_to_string(fixture("vae_sd").join("config.json")).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    edit(json.as_object_mut().unwrap());
    let dir = TempDir::new("config");
    std::fs::write(dir.0.join("config.json"), json.to_string()).unwrap();
    dir
}

#[test]
fn config_errors_are_typed() {
    let dir = config_with(|m| {
        m.remove("block_out_channels");
    });
    let path = dir.0.join("config.json");
    match AutoencoderKLConfig::from_file(&path) {
        Err(LoadError::Config { file, message }) => {
            assert_eq!(file, path);
            assert!(message.contains("block_out_channels"), "{message}");
        }
        other => panic!("expected Config, got {other:?}"),
    }

    let dir = config_with(|m| {
        m.insert("act_fn".into(), "gelu".into());
    });
    // Read from a file, a refused field is named with it (`<file>: act_fn`).
    let named =
        |dir: &TempDir, field: &str| format!("{}: {field}", dir.0.join("config.json").display());
    match AutoencoderKLConfig::from_file(&dir.0.join("config.json")) {
        Err(LoadError::InvalidConfig { field, value, .. }) => {
            assert_eq!((field, value.as_str()), (named(&dir, "act_fn"), "gelu"));
        }
        other => panic!("expected InvalidConfig, got {other:?}"),
    }

    let dir = config_with(|m| {
        m.insert("block_out_channels".into(), serde_json::json!([]));
    });
    assert!(matches!(
        AutoencoderKLConfig::from_file(&dir.0.join("config.json")),
        Err(LoadError::InvalidConfig { field, .. }) if field == named(&dir, "block_out_channels")
    ));

    let dir = config_with(|m| {
        m.insert("latent_channels".into(), 0.into());
    });
    assert!(matches!(
        AutoencoderKLConfig::from_file(&dir.0.join("config.json")),
        Err(LoadError::InvalidConfig { field, .. }) if field == named(&dir, "latent_channels")
    ));

    let dir = config_with(|m| {
        m.insert(
            "up_block_types".into(),
            serde_json::json!(["UpDecoderBlock2D", "AttnUpDecoderBlock2D"]),
        );
    });
    assert!(matches!(
        AutoencoderKLConfig::from_file(&dir.0.join("config.json")),
        Err(LoadError::InvalidConfig { field, .. }) if field == named(&dir, "up_block_types")
    ));

    // Unknown fields are ignored; Diffusers' defaults fill optional ones.
    let dir = config_with(|m| {
        m.insert("some_future_field".into(), 7.into());
        m.remove("use_post_quant_conv");
        m.remove("shift_factor");
        m.remove("up_block_types");
    });
    let c = AutoencoderKLConfig::from_file(&dir.0.join("config.json")).expect("config");
    assert!(c.use_post_quant_conv && c.shift_factor.is_none());
    assert_eq!(c.up_block_types, vec!["UpDecoderBlock2D"; 2]);

    assert!(matches!(
        AutoencoderKLConfig::from_file(&dir.0.join("missing.json")),
        Err(LoadError::Io { .. })
    ));
    for preset in [AutoencoderKLConfig::sd(), AutoencoderKLConfig::flux()] {
        preset.validate().expect("preset");
    }
}

/// Issue 34: a config of another class (a UNet with the VAE's numbers, Qwen-Image's VAE, a
/// transformer) is refused by its `_class_name`, before any field is read; a config
/// without one is read as before.
#[test]
fn a_config_of_another_class_is_refused_by_its_class_name() {
    for (class, says) in [
        ("UNet2DConditionModel", "another class is another network"),
        ("AutoencoderKLQwenImage", "QwenImagePipeline's VAE"),
        (
            "FluxTransformer2DModel",
            "FluxPipeline's transformer, not a VAE",
        ),
    ] {
        let dir = config_with(|m| {
            m.insert("_class_name".into(), class.into());
        });
        match AutoencoderKLConfig::from_file(&dir.0.join("config.json")) {
            Err(LoadError::InvalidConfig { field, value, hint }) => {
                assert!(field.ends_with("config.json: _class_name"), "{field}");
                assert_eq!(value, format!("\"{class}\""));
                assert!(hint.contains(says), "{class}: {hint}");
                assert!(hint.contains("AutoencoderKL"), "{hint}");
            }
            other => panic!("{class}: expected InvalidConfig, got {other:?}"),
        }
    }
    let dir = config_with(|m| {
        m.remove("_class_name");
    });
    AutoencoderKLConfig::from_file(&dir.0.join("config.json")).expect("no class: read as before");
}

/// Writes the fixture's weights to a temp folder after `edit` (name → (shape, bytes)).
fn checkpoint_with(
    edit: impl FnOnce(&mut std::collections::BTreeMap<String, (Vec<usize>, Vec<u8>)>),
) -> TempDir {
    let dir = fixture("vae_sd");
    let raw = std::fs::read(dir.join("diffusion_pytorch_model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&raw).unwrap();
    let mut tensors: std::collections::BTreeMap<String, (Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.shape().to_vec(), v.data().to_vec())))
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (shape, data))| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data)
                    .unwrap(),
            )
        })
        .collect();
    let out = TempDir::new("ckpt");
    let bytes = safetensors::serialize(views, None).unwrap();
    std::fs::write(out.0.join("diffusion_pytorch_model.safetensors"), bytes).unwrap();
    std::fs::copy(dir.join("config.json"), out.0.join("config.json")).unwrap();
    out
}

#[test]
fn checkpoint_errors_name_the_tensor_and_file() {
    let missing = "decoder.mid_block.attentions.0.to_out.0.weight";
    let dir = checkpoint_with(|t| {
        t.remove(missing);
    });
    match AutoencoderKL::load(&dir.0, None) {
        Err(LoadError::MissingTensor { name, file }) => {
            assert_eq!(name, missing);
            assert_eq!(file, dir.0.join("diffusion_pytorch_model.safetensors"));
        }
        other => panic!("expected MissingTensor, got {other:?}"),
    }

    let reshaped = "decoder.up_blocks.1.resnets.0.conv_shortcut.weight";
    let dir = checkpoint_with(|t| {
        let entry = t.get_mut(reshaped).unwrap();
        assert_eq!(entry.0, vec![32, 64, 1, 1]);
        entry.0 = vec![64, 32, 1, 1];
    });
    match AutoencoderKL::load(&dir.0, None) {
        Err(LoadError::ShapeMismatch {
            name,
            file,
            expected,
            found,
        }) => {
            assert_eq!(name, reshaped);
            assert_eq!(file, dir.0.join("diffusion_pytorch_model.safetensors"));
            assert_eq!((expected, found), (vec![32, 64, 1, 1], vec![64, 32, 1, 1]));
        }
        other => panic!("expected ShapeMismatch, got {other:?}"),
    }

    // Encoder tensors are not needed: a checkpoint without them loads.
    let dir = checkpoint_with(|t| t.retain(|n, _| !n.starts_with("encoder.")));
    AutoencoderKL::load(&dir.0, Some(DType::BF16)).expect("decoder-only checkpoint");
}

#[test]
fn params_use_diffusers_names() {
    let vae = load("vae_sd");
    let built: BTreeSet<String> = vae
        .component()
        .named_params()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let weights = CheckpointWeights::open_dir(&fixture("vae_sd"), None).expect("weights");
    let decoder: BTreeSet<String> = weights
        .names()
        .into_iter()
        .filter(|n| n.starts_with("decoder.") || n.starts_with("post_quant_conv."))
        .map(str::to_string)
        .collect();
    assert_eq!(built, decoder);
    // Params stay checkpoint-backed when no dtype conversion is asked for.
    assert!(
        vae.component()
            .params()
            .iter()
            .all(|p| p.is_checkpoint_backed())
    );
}

#[test]
fn random_flux_vae_has_diffusers_param_count() {
    let mut weights = RandomWeights::new(7, DType::BF16);
    let vae = AutoencoderKL::build(&mut weights, AutoencoderKLConfig::flux()).expect("build");
    // Obtained with the fixtures' venv (diffusers 0.42.1):
    //   AutoencoderKL(block_out_channels=[128,256,512,512], layers_per_block=2,
    //       latent_channels=16, norm_num_groups=32, up/down block types x4,
    //       use_quant_conv=False, use_post_quant_conv=False) built on the meta device;
    //   sum(p.numel() for n, p in named_parameters() if n.startswith("decoder."))
    // gives 49_545_475 over 138 tensors.
    assert_eq!(vae.num_params(), 49_545_475);
    assert_eq!(vae.component().named_params().len(), 138);
    assert_eq!(vae.dtype(), DType::BF16);
    assert_eq!(vae.component().param_bytes(), 2 * 49_545_475);
    assert_eq!(weights.bytes_made(), 2 * 49_545_475);
    let t = TilingConfig::from_config(vae.config());
    assert_eq!(
        (t.tile_latent_min_size, t.tile_sample_min_size),
        (128, 1024)
    );
}

#[test]
fn peak_estimate_matches_the_host_accounting() {
    for (name, latents_name, tiled) in [
        ("vae_sd", "latents", false),
        ("vae_flux", "latents", false),
        ("vae_flux", "latents_tiled", true),
    ] {
        let vae = load(name);
        let (latents, _) = tensor(name, "inputs.safetensors", latents_name);
        let d = device();
        vae.component()
            .to_device(&*d, &d.compute_stream())
            .expect("to_device");
        let weights = d.memory_info().allocated;
        d.reset_peak();
        let t = tiled.then(|| tiling(name));
        let out = vae.decode(Some(&*d), &latents, t).expect("decode");
        let measured = d.memory_info().peak_allocated - weights;
        let estimate = match t {
            Some(t) => {
                estimate_tiled_decode_peak_bytes(vae.config(), latents.shape(), DType::F32, &t)
            }
            None => estimate_decode_peak_bytes(vae.config(), latents.shape(), DType::F32),
        };
        println!("{name} {latents_name}: measured {measured} B, estimate {estimate} B");
        assert_eq!(estimate, measured, "{name} {latents_name}");
        drop(out);
    }
    // The real Flux VAE at 1024x1024 in bf16: 1.5 GiB of activations, at the first resnet
    // of the last block (its 256-channel 1024x1024 input, norm1 and SiLU outputs live).
    let big = estimate_decode_peak_bytes(
        &AutoencoderKLConfig::flux(),
        &[1, 16, 128, 128],
        DType::BF16,
    );
    assert_eq!(big, 1_611_137_024);
    let tiled = estimate_tiled_decode_peak_bytes(
        &AutoencoderKLConfig::flux(),
        &[1, 16, 256, 256],
        DType::BF16,
        &TilingConfig::from_config(&AutoencoderKLConfig::flux()),
    );
    let untiled = estimate_decode_peak_bytes(
        &AutoencoderKLConfig::flux(),
        &[1, 16, 256, 256],
        DType::BF16,
    );
    assert!(tiled < untiled / 2, "tiled {tiled} untiled {untiled}");
}

#[test]
fn unscale_latents_follows_the_pipelines() {
    let vae = load("vae_flux");
    let d = device();
    let values: Vec<f32> = (0..16).map(|i| i as f32 * 0.37 - 2.0).collect();
    let latents = Tensor::from_f32(vec![1, 16, 1, 1], DType::F32, &values).unwrap();
    let out = vae.unscale_latents(&*d, &latents).expect("unscale");
    let expected: Vec<f32> = values.iter().map(|v| v / 0.3611f32 + 0.1159f32).collect();
    assert_eq!(d.to_f32_vec(&out).unwrap(), expected);
}

/// A VAE as one file in the original LDM layout of `ae.safetensors`
/// (`fixtures/vae_flux_original`, made by the inverse of Diffusers' conversion and checked
/// with Diffusers' own): the decoder maps as `from_single_file` converts it (reversed up
/// blocks, `nin_shortcut`, the attention's 1x1 convolutions read as linears without a copy),
/// so the decode is the Diffusers folder's bit for bit; the encoder is left alone.
#[test]
fn ldm_layout_single_files_decode_as_the_folder() {
    let config = AutoencoderKLConfig::from_file(&fixture("vae_flux").join("config.json")).unwrap();
    let file = fixture("vae_flux_original").join("ae-tiny.safetensors");
    let single =
        AutoencoderKL::load_original(&file, config.clone(), None, ddo_nn::UnusedWeights::Refuse)
            .expect("load the single file");
    assert!(
        single
            .component()
            .params()
            .iter()
            .all(|p| p.is_checkpoint_backed()),
        "every param a view of the file"
    );
    let (latents, _) = tensor("vae_flux", "inputs.safetensors", "latents");
    let (d1, a) = decode_resident(&load("vae_flux"), &latents, None);
    let (d2, b) = decode_resident(&single, &latents, None);
    assert!(
        bytes(&d1, &a) == bytes(&d2, &b),
        "differs from the folder's decode"
    );
    // A file that is not in the LDM layout is a typed refusal.
    let err = AutoencoderKL::load_original(
        &fixture("vae_flux").join("diffusion_pytorch_model.safetensors"),
        config,
        None,
        ddo_nn::UnusedWeights::Refuse,
    )
    .unwrap_err();
    assert!(err.to_string().contains("LDM"), "{err}");
}
