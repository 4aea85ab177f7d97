//! Qwen-Image's VAE decoder (`AutoencoderKLQwenImage` on one frame) against Diffusers'
//! fixture (`fixtures/qwen_vae`, see `fixtures/MANIFEST.md`), loaded through
//! `CheckpointWeights`: conformance of the decode (batch 1 and 2), of every block, of the
//! pipeline's un-normalisation and of the tiled decode; bit-identical output on every route,
//! the seed's VAE default included; the tree in execution order; typed config, checkpoint
//! and input errors (NaN/Inf decodes refused before the clamp); the causal convolutions'
//! temporal slices; the param count at Qwen-Image's widths; and the activation-peak
//! estimates against the host backend's exact accounting.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ddo_core::{AllocatorKind, CoreError, DType, Device, RouteSpec, Tensor, ops_of};
use ddo_host::{HostDevice, HostDeviceConfig};
use ddo_nn::qwen_vae::{
    QwenVae, QwenVaeConfig, QwenVaeTiling, Upsampler, estimate_decode_peak_bytes,
    estimate_tiled_decode_peak_bytes,
};
use ddo_nn::{CheckpointWeights, LoadError, UnusedWeights, read_f32_tensor};
use ddo_routes::enable_dynamic_offload;

const TOLERANCE: f64 = 1e-5;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen_vae")
}

fn fixture(file: &str, name: &str) -> (Vec<usize>, Vec<f32>) {
    read_f32_tensor(&fixture_dir().join(file), name).expect("fixture tensor")
}

fn host_tensor(file: &str, name: &str) -> Tensor {
    let (shape, values) = fixture(file, name);
    Tensor::from_f32(shape, DType::F32, &values).expect("host tensor")
}

fn latents(name: &str) -> Tensor {
    host_tensor("inputs.safetensors", name)
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

fn load() -> QwenVae {
    QwenVae::load(&fixture_dir(), None).expect("load the fixture")
}

/// The tiling of the fixture's `sample_tiled` call (`tiling.json`).
fn fixture_tiling() -> QwenVaeTiling {
    let text = std::fs::read_to_string(fixture_dir().join("tiling.json")).expect("tiling.json");
    let json: serde_json::Value = serde_json::from_str(&text).expect("json");
    serde_json::from_value(json["enable_tiling"].clone()).expect("tiling arguments")
}

fn bytes(d: &dyn Device, t: &Tensor) -> Vec<u8> {
    t.to_host_bytes(d, &d.compute_stream()).expect("download")
}

fn values(d: &dyn Device, t: &Tensor) -> Vec<f32> {
    t.to_f32_vec(d, &d.compute_stream()).expect("download")
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

/// `vae` with its weights placed on a fresh host device outside any route.
fn resident(vae: &QwenVae) -> Arc<HostDevice> {
    let d = device();
    vae.component()
        .to_device(&*d, &d.compute_stream())
        .expect("to_device");
    d
}

fn check(name: &str, out: &[f32], reference: &str) -> f64 {
    let (_, want) = fixture("outputs.safetensors", reference);
    let err = rel_l2(out, &want);
    eprintln!("qwen_vae {name}: relative L2 {err:.3e}");
    assert!(
        err <= TOLERANCE,
        "{name}: relative L2 {err:e} > {TOLERANCE:e}"
    );
    err
}

#[test]
fn decode_matches_diffusers_at_batch_1_and_2() {
    let vae = load();
    let d = resident(&vae);
    for (input, reference, shape) in [
        ("latents", "sample", [1, 3, 24, 20]),
        ("latents_batch2", "sample_batch2", [2, 3, 24, 20]),
    ] {
        let out = vae.decode(&*d, &latents(input), None).expect("decode");
        assert_eq!(out.shape(), shape);
        let v = values(&*d, &out);
        check(reference, &v, reference);
        // `_decode` clamps: the fixture's conv_out makes part of the image leave [-1, 1].
        assert!(v.iter().all(|x| x.abs() <= 1.0));
        assert!(
            v.iter().any(|x| x.abs() == 1.0),
            "{reference}: the clamp bites"
        );
    }
    // A batch decodes row by row: each row alone gives the batch's row, bit for bit.
    let both = vae.decode(&*d, &latents("latents_batch2"), None).unwrap();
    let both = bytes(&*d, &both);
    let (shape, v) = fixture("inputs.safetensors", "latents_batch2");
    let row = v.len() / 2;
    let mut rows = Vec::new();
    for r in 0..2 {
        let one = Tensor::from_f32(
            vec![1, shape[1], shape[2], shape[3]],
            DType::F32,
            &v[r * row..(r + 1) * row],
        )
        .unwrap();
        rows.extend(bytes(&*d, &vae.decode(&*d, &one, None).unwrap()));
    }
    assert_eq!(rows, both, "batch rows decode as single images");
}

#[test]
fn every_block_matches_diffusers() {
    let vae = load();
    let d = resident(&vae);
    let ops = ops_of(&*d).unwrap();
    let mut taps: BTreeMap<String, (Vec<usize>, Vec<f32>)> = BTreeMap::new();
    let out = vae
        .decode_with_taps(&*d, &latents("latents"), &mut |name, t| {
            let previous = taps.insert(name.to_string(), (t.shape().to_vec(), ops.to_f32_vec(t)?));
            assert!(previous.is_none(), "{name} tapped twice");
            Ok(())
        })
        .unwrap();
    let plain = vae.decode(&*d, &latents("latents"), None).unwrap();
    assert_eq!(bytes(&*d, &out), bytes(&*d, &plain), "taps change nothing");
    let inter = "intermediates.safetensors";
    let reference: BTreeSet<String> =
        CheckpointWeights::open_file(&fixture_dir().join(inter), None)
            .unwrap()
            .names()
            .into_iter()
            .map(String::from)
            .collect();
    assert_eq!(taps.keys().cloned().collect::<BTreeSet<_>>(), reference);
    let mut worst = 0.0f64;
    for (name, (shape, ours)) in &taps {
        let (mut ref_shape, want) = fixture(inter, name);
        // Diffusers' tensors are 5-D with one frame.
        assert_eq!(ref_shape.remove(2), 1, "{name}");
        assert_eq!(shape, &ref_shape, "{name}");
        let err = rel_l2(ours, &want);
        eprintln!("  {name}: relative L2 {err:.3e}");
        assert!(err <= TOLERANCE, "{name}: relative L2 {err:e}");
        worst = worst.max(err);
    }
    eprintln!("qwen_vae intermediates: worst relative L2 {worst:.3e}");
}

#[test]
fn the_pipelines_denormalization_and_decode_match_diffusers() {
    let vae = load();
    let d = resident(&vae);
    let denormalized = vae
        .denormalize_latents(&*d, &latents("pipeline_latents"))
        .unwrap();
    let (_, want) = fixture("outputs.safetensors", "pipeline_denormalized");
    assert_eq!(
        values(&*d, &denormalized),
        want,
        "bit for bit, as PyTorch computes it"
    );
    let image = vae.decode(&*d, &denormalized, None).unwrap();
    check("pipeline_image", &values(&*d, &image), "pipeline_image");
}

#[test]
fn tiled_decode_matches_diffusers() {
    let vae = load();
    let d = resident(&vae);
    let t = fixture_tiling();
    assert_eq!(t.latent_tile(4), (4, 4));
    assert_eq!(t.latent_stride(4), (3, 3));
    assert_eq!(t.blend_extent(), (4, 4));
    let input = latents("latents_tiled");
    assert_eq!(input.shape(), [1, 4, 7, 9]);
    assert_eq!(t.grid(7, 9, 4), (3, 3));
    let tiled = vae.decode(&*d, &input, Some(t)).expect("tiled decode");
    assert_eq!(tiled.shape(), [1, 3, 28, 36]);
    let v = values(&*d, &tiled);
    check("sample_tiled", &v, "sample_tiled");
    // `tiled_decode` does not clamp (Diffusers returns before `_decode`'s clamp).
    assert!(v.iter().any(|x| x.abs() > 1.0));

    let untiled = vae.decode(&*d, &input, None).unwrap();
    check(
        "sample_tiled_reference_untiled",
        &values(&*d, &untiled),
        "sample_tiled_reference_untiled",
    );
    // Diffusers' default tiles (256 px: 64 latents at 4x) leave these latents untiled.
    let defaults = QwenVaeTiling::default();
    assert_eq!(defaults.latent_tile(8), (32, 32));
    assert_eq!(defaults.latent_stride(8), (24, 24));
    assert_eq!(defaults.blend_extent(), (64, 64));
    let not_tiled = vae.decode(&*d, &input, Some(defaults)).unwrap();
    assert_eq!(bytes(&*d, &not_tiled), bytes(&*d, &untiled));
    // Tilings Diffusers' loop cannot run are refused.
    for bad in [
        QwenVaeTiling {
            tile_sample_stride_height: 2,
            ..t
        },
        QwenVaeTiling {
            tile_sample_stride_width: 20,
            ..t
        },
    ] {
        match vae.decode(&*d, &input, Some(bad)) {
            Err(CoreError::InvalidOption { option, .. }) => {
                assert!(option.contains("tiling"), "{option}")
            }
            other => panic!("expected InvalidOption, got {other:?}"),
        }
    }
}

#[test]
fn bf16_weights_decode_close_to_the_reference() {
    let vae = QwenVae::load(&fixture_dir(), Some(DType::BF16)).expect("load bf16");
    assert_eq!(vae.dtype(), DType::BF16);
    let d = resident(&vae);
    for (input, reference, tiling) in [
        ("latents_batch2", "sample_batch2", None),
        ("latents_tiled", "sample_tiled", Some(fixture_tiling())),
    ] {
        let out = vae.decode(&*d, &latents(input), tiling).unwrap();
        assert_eq!(out.dtype(), DType::BF16);
        let (_, want) = fixture("outputs.safetensors", reference);
        let err = rel_l2(&values(&*d, &out), &want);
        eprintln!("qwen_vae {reference} in bf16: relative L2 {err:.3e}");
        assert!(err < 3e-2, "{reference} in bf16: relative L2 {err:e}");
    }
}

#[test]
fn component_forward_decodes_untiled() {
    let vae = load();
    let d = resident(&vae);
    let input = latents("latents");
    let decoded = vae.decode(&*d, &input, None).unwrap();
    let forward = vae.component().forward(&*d, input).unwrap();
    assert_eq!(bytes(&*d, &forward), bytes(&*d, &decoded));
    assert_eq!(vae.component().name(), "vae");
    assert_eq!(vae.component().class_name(), "AutoencoderKLQwenImage");
}

#[test]
fn every_route_decodes_bit_identically_to_resident() {
    let specs: Vec<(&str, RouteSpec, bool)> = vec![
        ("resident", RouteSpec::resident(), false),
        // The seed's VAE default: leaf-level groups, no stream.
        (
            "leaf_group (the seed's VAE default)",
            RouteSpec::leaf_group(false, false),
            false,
        ),
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
            .unwrap(),
            false,
        ),
        (
            "linear_convolution",
            ddo_routes::parse_spec("linear_convolution").unwrap(),
            false,
        ),
        (
            "linear_convolution+pinned",
            ddo_routes::parse_spec("linear_convolution:pinned=true").unwrap(),
            false,
        ),
        (
            "native_vmm",
            ddo_routes::parse_spec("native_vmm:budget=64KiB").unwrap(),
            true,
        ),
    ];
    let t = fixture_tiling();
    let cases = [
        ("latents_batch2", None, 1u64),
        ("latents_tiled", Some(t), 9u64),
    ];
    let base: Vec<Vec<u8>> = {
        let vae = load();
        let d = resident(&vae);
        cases
            .iter()
            .map(|(input, tiling, _)| {
                bytes(&*d, &vae.decode(&*d, &latents(input), *tiling).unwrap())
            })
            .collect()
    };
    for (name, spec, native) in specs {
        let vae = load();
        let d = if native { native_device() } else { device() };
        let handle =
            enable_dynamic_offload(vae.component(), Arc::clone(&d) as Arc<dyn Device>, spec)
                .unwrap_or_else(|e| panic!("{name}: attach: {e}"));
        for ((input, tiling, _), want) in cases.iter().zip(&base) {
            // Twice: the second decode runs on what the first one learned (schedules).
            for round in 0..2 {
                let out = vae
                    .decode(&*d, &latents(input), *tiling)
                    .unwrap_or_else(|e| panic!("{name} {input}: decode: {e}"));
                assert_eq!(
                    &bytes(&*d, &out),
                    want,
                    "{name} on {input} (round {round}) differs from resident execution"
                );
            }
        }
        let counters = handle.metrics().counters();
        assert_eq!(counters.forwards, 4, "{name}");
        let leaves = vae.component().leaves().len() as u64;
        let runs: u64 = cases.iter().map(|(_, _, tiles)| 2 * tiles).sum();
        assert_eq!(
            counters.leaf_calls,
            runs * leaves,
            "{name}: the route saw every leaf of every decode"
        );
    }
}

/// The tree is built in execution order (`resnets.0`, `attentions.0`, `resnets.1` in the mid
/// block; each residual block's shortcut after its `conv2`): a streamed route's schedule
/// predicted from the leaf order holds, so the first decode already streams one copy per
/// transfer unit, with the resident output. (From a pinned home: with the default
/// `pinned_source=register` a unit holding both owned temporal slices and mapped tensors is
/// copied in one run per source, so copies outnumber units on every forward.)
#[test]
fn the_tree_runs_in_execution_order() {
    let vae = load();
    let paths: Vec<String> = vae
        .component()
        .leaves()
        .iter()
        .map(|l| l.path().to_string())
        .collect();
    let at = |p: &str| {
        paths
            .iter()
            .position(|x| x == p)
            .unwrap_or_else(|| panic!("{p}"))
    };
    assert_eq!(at("post_quant_conv"), 0);
    assert_eq!(at("decoder.conv_in"), 1);
    assert!(
        at("decoder.mid_block.resnets.0.conv2") < at("decoder.mid_block.attentions.0.norm")
            && at("decoder.mid_block.attentions.0.proj") < at("decoder.mid_block.resnets.1.norm1")
    );
    assert!(
        at("decoder.up_blocks.1.resnets.0.conv2")
            < at("decoder.up_blocks.1.resnets.0.conv_shortcut")
    );
    assert_eq!(at("decoder.conv_out"), paths.len() - 1);

    let input = latents("latents_batch2");
    let forward = |d: &dyn Device| vae.decode(d, &input, None).unwrap();
    let d = device();
    let dev: Arc<dyn Device> = d.clone();
    let resident = {
        let _h = enable_dynamic_offload(vae.component(), Arc::clone(&dev), RouteSpec::resident())
            .unwrap();
        bytes(&*dev, &forward(&*dev))
    };
    let streamed: RouteSpec = ddo_routes::parse_spec(
        "diffusers_group_offload:use_stream=true,unit_bytes=4KiB,pinned_source=home",
    )
    .unwrap();
    let h = enable_dynamic_offload(vae.component(), Arc::clone(&dev), streamed).unwrap();
    assert_eq!(bytes(&*dev, &forward(&*dev)), resident);
    let c = h.metrics_snapshot().counters;
    assert!(c.transfer_units > 1, "an engine with several units");
    assert_eq!(
        c.h2d_copies, c.transfer_units,
        "the first decode streamed one copy per unit: the predicted schedule held"
    );
    assert_eq!(c.schedule_relearned, 0);
    assert_eq!(bytes(&*dev, &forward(&*dev)), resident);
    let c2 = h.metrics_snapshot().counters;
    assert_eq!(c2.h2d_copies - c.h2d_copies, c2.transfer_units);
    assert_eq!(c2.schedule_relearned, 0);
}

#[test]
fn bad_latents_are_shape_errors() {
    let vae = load();
    let d = resident(&vae);
    for shape in [
        vec![1, 16, 4, 4],
        vec![1, 4, 0, 4],
        vec![4, 4, 4],
        vec![1, 4, 1, 4, 4],
    ] {
        let n: usize = shape.iter().product();
        let t = Tensor::from_f32(shape.clone(), DType::F32, &vec![0.0; n]).unwrap();
        for tiling in [None, Some(fixture_tiling())] {
            assert!(
                matches!(vae.decode(&*d, &t, tiling), Err(CoreError::Shape { .. })),
                "{shape:?} {tiling:?}"
            );
        }
    }
}

/// Latents holding a NaN or an Inf decode to `CoreError::NonFinite` naming the decode, both
/// untiled — checked before the clamp, which would turn NaN into -1 and Inf into 1 — and
/// tiled (issue 34).
#[test]
fn non_finite_decodes_are_refused_before_the_clamp() {
    let vae = load();
    let d = resident(&vae);
    let (shape, clean) = fixture("inputs.safetensors", "latents_tiled");
    for bad in [f32::NAN, f32::INFINITY] {
        let mut v = clean.clone();
        v[3] = bad;
        let t = Tensor::from_f32(shape.clone(), DType::F32, &v).unwrap();
        for tiling in [None, Some(fixture_tiling())] {
            match vae.decode(&*d, &t, tiling) {
                Err(CoreError::NonFinite {
                    phase, step, what, ..
                }) => {
                    assert_eq!((phase.as_str(), step), ("decode", None));
                    assert_eq!(what, "the decoded image");
                }
                other => panic!("{bad} {tiling:?}: expected NonFinite, got {other:?}"),
            }
        }
    }
    let t = Tensor::from_f32(shape, DType::F32, &clean).unwrap();
    vae.decode(&*d, &t, None).unwrap();
}

/// A fresh temporary directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "ddo-qwen-vae-{tag}-{}-{}",
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
    let text = std::fs::read_to_string(fixture_dir().join("config.json")).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    edit(json.as_object_mut().unwrap());
    let dir = TempDir::new("config");
    std::fs::write(dir.0.join("config.json"), json.to_string()).unwrap();
    dir
}

fn invalid_field(
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) -> (String, String) {
    let dir = config_with(edit);
    let file = dir.0.join("config.json");
    match QwenVaeConfig::from_file(&file) {
        Err(LoadError::InvalidConfig { field, value, hint }) => {
            assert!(!hint.is_empty());
            // Read from a file, the field is named with it.
            let prefix = format!("{}: ", file.display());
            let field = field.strip_prefix(&prefix).unwrap_or_else(|| {
                panic!(
                    "the field `{field}` does not name the file {}",
                    file.display()
                )
            });
            (field.to_string(), value)
        }
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

#[test]
fn config_errors_are_typed() {
    use serde_json::json;
    // The fixture's config is the named tiny one; Diffusers' defaults are Qwen-Image's.
    let fixture_config = QwenVaeConfig::from_file(&fixture_dir().join("config.json")).unwrap();
    assert_eq!(fixture_config, QwenVaeConfig::tiny());
    assert_eq!(
        QwenVaeConfig::named("qwen-tiny"),
        Some(QwenVaeConfig::tiny())
    );
    assert_eq!(
        QwenVaeConfig::named("qwen-image"),
        Some(QwenVaeConfig::qwen_image())
    );
    assert_eq!(QwenVaeConfig::named("flux"), None);
    for name in QwenVaeConfig::NAMES {
        QwenVaeConfig::named(name).unwrap().validate().unwrap();
    }
    let defaults = QwenVaeConfig::from_json("{}", Path::new("{}")).unwrap();
    assert_eq!(defaults, QwenVaeConfig::qwen_image());
    assert_eq!(defaults.spatial_compression_ratio(), 8);
    assert_eq!(defaults.decoder_widths(), [384, 384, 384, 192, 96]);
    let ups: Vec<_> = defaults
        .up_blocks()
        .iter()
        .map(|b| (b.in_dim, b.out_dim, b.resnets, b.upsampler))
        .collect();
    assert_eq!(
        ups,
        [
            (384, 384, 3, Some(Upsampler::SpatioTemporal)),
            (192, 384, 3, Some(Upsampler::SpatioTemporal)),
            (192, 192, 3, Some(Upsampler::Spatial)),
            (96, 96, 3, None),
        ]
    );
    assert_eq!(defaults.output_shape(&[2, 16, 128, 96]), [2, 3, 1024, 768]);

    // Unknown fields are ignored; the encoder-only and inference-inert ones are accepted.
    let dir = config_with(|m| {
        m.insert("some_future_field".into(), 7.into());
        m.insert("attn_scales".into(), json!([0.5]));
        m.insert("dropout".into(), json!(0.1));
        m.insert("is_residual".into(), json!(false));
        m.insert("patch_size".into(), json!(null));
    });
    let c = QwenVaeConfig::from_file(&dir.0.join("config.json")).unwrap();
    assert_eq!((c.attn_scales.clone(), c.dropout), (vec![0.5], 0.1));

    // Refused by name: another class, the Wan variants' switches.
    assert_eq!(
        invalid_field(|m| {
            m.insert("_class_name".into(), "AutoencoderKLWan".into());
        }),
        ("_class_name".into(), "\"AutoencoderKLWan\"".into())
    );
    for (field, value) in [
        ("is_residual", json!(true)),
        ("patch_size", json!(2)),
        ("decoder_base_dim", json!(256)),
    ] {
        let v = value.clone();
        assert_eq!(
            invalid_field(|m| {
                m.insert(field.into(), v);
            }),
            (field.to_string(), value.to_string())
        );
    }
    // Values that contradict each other.
    for (field, value) in [
        ("temperal_downsample", json!([true])),
        ("temperal_downsample", json!([true, false, true])),
        ("dim_mult", json!([])),
        ("dim_mult", json!([1, 0, 2])),
        ("z_dim", json!(0)),
        ("base_dim", json!(0)),
        ("input_channels", json!(0)),
        ("latents_mean", json!([0.0, 1.0])),
        ("latents_std", json!([1.0, 0.0, 1.0, 1.0])),
        ("dropout", json!(1.5)),
    ] {
        let v = value.clone();
        let (got, _) = invalid_field(|m| {
            m.insert(field.into(), v);
        });
        assert_eq!(got, field, "{field} = {value}");
    }
    // A width every upsampler halves must stay positive.
    let (got, _) = invalid_field(|m| {
        m.insert("base_dim".into(), json!(1));
        m.insert("dim_mult".into(), json!([1, 1, 1]));
    });
    assert_eq!(got, "base_dim");
    // Wrong types and files.
    let dir = config_with(|m| {
        m.insert("z_dim".into(), "four".into());
    });
    let path = dir.0.join("config.json");
    match QwenVaeConfig::from_file(&path) {
        Err(LoadError::Config { file, message }) => {
            assert_eq!(file, path);
            assert!(message.contains("AutoencoderKLQwenImage"), "{message}");
        }
        other => panic!("expected Config, got {other:?}"),
    }
    assert!(matches!(
        QwenVaeConfig::from_file(&dir.0.join("missing.json")),
        Err(LoadError::Io { .. })
    ));
}

/// The fixture's weights as name → (shape, f32 values).
fn fixture_weights() -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let raw = std::fs::read(fixture_dir().join("diffusion_pytorch_model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&raw).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| {
            let values = v
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (n, (v.shape().to_vec(), values))
        })
        .collect()
}

/// The fixture's folder with its weights after `edit`.
fn checkpoint_with(edit: impl FnOnce(&mut BTreeMap<String, (Vec<usize>, Vec<f32>)>)) -> TempDir {
    let mut tensors = fixture_weights();
    edit(&mut tensors);
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .into_iter()
        .map(|(n, (s, v))| (n, s, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    let out = TempDir::new("ckpt");
    std::fs::write(
        out.0.join("diffusion_pytorch_model.safetensors"),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
    std::fs::copy(fixture_dir().join("config.json"), out.0.join("config.json")).unwrap();
    out
}

#[test]
fn checkpoint_errors_name_the_tensor_and_file() {
    let missing = "decoder.mid_block.attentions.0.to_qkv.weight";
    let dir = checkpoint_with(|t| {
        t.remove(missing);
    });
    match QwenVae::load(&dir.0, None) {
        Err(LoadError::MissingTensor { name, file }) => {
            assert_eq!(name, missing);
            assert_eq!(file, dir.0.join("diffusion_pytorch_model.safetensors"));
        }
        other => panic!("expected MissingTensor, got {other:?}"),
    }
    // A causal convolution's weight must be the 5-D one; the error gives its shape.
    let conv = "decoder.up_blocks.1.resnets.0.conv1.weight";
    let dir = checkpoint_with(|t| {
        let entry = t.get_mut(conv).unwrap();
        assert_eq!(entry.0, vec![16, 8, 3, 3, 3]);
        entry.0 = vec![16, 8, 9, 3];
    });
    match QwenVae::load(&dir.0, None) {
        Err(LoadError::ShapeMismatch {
            name,
            expected,
            found,
            ..
        }) => {
            assert_eq!(name, conv);
            assert_eq!((expected, found), (vec![16, 8, 3, 3, 3], vec![16, 8, 9, 3]));
        }
        other => panic!("expected ShapeMismatch, got {other:?}"),
    }
    // The encoder, quant_conv and the time_convs are never needed...
    let dir = checkpoint_with(|t| {
        t.retain(|n, _| {
            !n.starts_with("encoder.") && !n.starts_with("quant_conv.") && !n.contains("time_conv")
        })
    });
    QwenVae::load(&dir.0, Some(DType::BF16)).expect("a decoder-only checkpoint loads");
    // ...but a time_conv where the config has an upsample2d block means the config and the
    // weights disagree.
    let dir = checkpoint_with(|t| {
        let tc = t["decoder.up_blocks.0.upsamplers.0.time_conv.weight"].clone();
        t.insert(
            "decoder.up_blocks.1.upsamplers.0.time_conv.weight".into(),
            tc,
        );
    });
    assert!(matches!(
        QwenVae::load(&dir.0, None),
        Err(LoadError::UnusedWeights { count: 1, .. })
    ));
    QwenVae::load_checked(&dir.0, None, UnusedWeights::Allow).expect("allowed");
}

/// Every decoder param has its Diffusers name; a 1x1x1 causal convolution's weight is the
/// checkpoint's bytes in place, a 3x3x3 one's the kernel's last temporal slice, owned.
#[test]
fn params_are_diffusers_tensors_and_their_last_temporal_slices() {
    let vae = load();
    let checkpoint = fixture_weights();
    let built: BTreeMap<String, Arc<ddo_core::Param>> =
        vae.component().named_params().into_iter().collect();
    let decoder: BTreeSet<String> = checkpoint
        .keys()
        .filter(|n| {
            (n.starts_with("decoder.") || n.starts_with("post_quant_conv."))
                && !n.contains("time_conv")
        })
        .cloned()
        .collect();
    assert_eq!(built.keys().cloned().collect::<BTreeSet<_>>(), decoder);
    let (mut sliced, mut owned_bytes) = (0, 0);
    for (name, p) in &built {
        let (shape, want) = &checkpoint[name];
        let got = p.host().with_bytes(|b| DType::F32.decode_f32(b)).unwrap();
        if shape.len() == 5 {
            let frames = shape[2];
            assert_eq!(
                p.shape(),
                [shape[0], shape[1], shape[3], shape[4]],
                "{name}"
            );
            let inner = shape[3] * shape[4];
            let last: Vec<f32> = want
                .chunks_exact(frames * inner)
                .flat_map(|block| block[(frames - 1) * inner..].to_vec())
                .collect();
            assert_eq!(got, last, "{name}: the last temporal slice");
            assert_eq!(p.is_checkpoint_backed(), frames == 1, "{name}");
            if frames > 1 {
                sliced += 1;
                owned_bytes += p.nbytes();
            }
        } else {
            assert_eq!(p.shape(), shape.as_slice(), "{name}");
            assert_eq!(&got, want, "{name}");
            assert!(p.is_checkpoint_backed(), "{name}");
        }
    }
    // 1 + 4 + 12 + 1 = 18 3x3x3 convolutions (conv_in, the mid block's, the up blocks'
    // resnets', conv_out); their slices are a third of those tensors.
    assert_eq!(sliced, 18);
    eprintln!(
        "qwen_vae fixture: {} params, {} B of owned temporal slices",
        built.len(),
        owned_bytes
    );
}

#[test]
fn random_qwen_image_vae_has_the_diffusers_param_count() {
    let vae = QwenVae::random(QwenVaeConfig::qwen_image(), 7, DType::BF16).expect("build");
    // Obtained with the fixtures' venv (diffusers 0.42.1): AutoencoderKLQwenImage() built on
    // the meta device; its decoder and post_quant_conv hold 73,295,603 elements in 108
    // tensors, of which the 4 of the two upsample3d time_convs hold 1,771,008 and the 3x3x3
    // causal convolutions' weights 69,348,960. DDO keeps one temporal slice of each of those
    // (a third) and no time_conv: 73,295,603 - 1,771,008 - 2 / 3 * 69,348,960 = 25,291,955.
    assert_eq!(vae.num_params(), 25_291_955);
    assert_eq!(vae.component().named_params().len(), 104);
    assert_eq!(vae.component().param_bytes(), 2 * 25_291_955);
    // The causal 3x3x3 convolutions' slices (the upsamplers' `resample.1` are 2-D already).
    let sliced: usize = vae
        .component()
        .named_params()
        .iter()
        .filter(|(n, p)| !n.contains("resample") && p.shape().len() == 4 && p.shape()[2] == 3)
        .map(|(_, p)| p.shape().iter().product::<usize>())
        .sum();
    assert_eq!(sliced, 69_348_960 / 3);
    assert_eq!(vae.config().spatial_compression_ratio(), 8);
}

#[test]
fn peak_estimate_matches_the_host_accounting() {
    let t = fixture_tiling();
    for (dtype, vae) in [
        (DType::F32, load()),
        (
            DType::BF16,
            QwenVae::load(&fixture_dir(), Some(DType::BF16)).unwrap(),
        ),
    ] {
        let d = resident(&vae);
        for (input, tiling) in [
            ("latents", None),
            ("latents_batch2", None),
            ("latents_tiled", Some(t)),
        ] {
            // Latents in the weights' dtype: the estimate counts them so.
            let (shape, v) = fixture("inputs.safetensors", input);
            let latents = Tensor::from_f32(shape.clone(), dtype, &v).unwrap();
            let weights = d.memory_info().allocated;
            d.reset_peak();
            let out = vae.decode(&*d, &latents, tiling).unwrap();
            let measured = d.memory_info().peak_allocated - weights;
            let estimate = match tiling {
                Some(t) => estimate_tiled_decode_peak_bytes(vae.config(), &shape, dtype, &t),
                None => estimate_decode_peak_bytes(vae.config(), &shape, dtype),
            };
            eprintln!("qwen_vae {input} {dtype}: measured {measured} B, estimate {estimate} B");
            assert_eq!(estimate, measured, "{input} {dtype}");
            drop(out);
        }
    }
    // Qwen-Image's VAE on a 1024x1024 image in bf16, untiled and with Diffusers' tiles.
    let config = QwenVaeConfig::qwen_image();
    let untiled = estimate_decode_peak_bytes(&config, &[1, 16, 128, 128], DType::BF16);
    let tiled = estimate_tiled_decode_peak_bytes(
        &config,
        &[1, 16, 128, 128],
        DType::BF16,
        &QwenVaeTiling::default(),
    );
    eprintln!("qwen-image VAE at 1024x1024, bf16: untiled {untiled} B, tiled {tiled} B");
    // 772.5 MiB untiled, at a residual block of the last up block: its 96-channel input and
    // conv1's output at full resolution (192 MiB each) with norm2's f32 squares (384 MiB)
    // and their sum beside them; 57.6 MiB in Diffusers' 256-px tiles.
    assert_eq!(untiled, 810_024_960);
    assert_eq!(tiled, 60_391_424);
    assert!(tiled < untiled / 2, "tiled {tiled} untiled {untiled}");
}
