//! The Qwen-Image transformer against Diffusers' `QwenImageTransformer2DModel` fixture
//! (`fixtures/qwen_image_transformer`, see `fixtures/MANIFEST.md`), loaded through
//! `CheckpointWeights`: conformance of the output (with the text padding mask, without it,
//! and with two images a sample), of every block's streams and of the host-computed tables,
//! bit-identical output on every route, typed config and input errors, and the param count
//! at Qwen-Image's widths.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ddo_core::{
    AllocatorKind, CoreError, DType, Device, HostBuffer, Param, ParamKind, Placement, RouteSpec,
    Tensor, ops_of,
};
use ddo_host::{HostDevice, HostDeviceConfig};
use ddo_nn::qwen_image::{
    QwenImageInputs, QwenImageTransformer, QwenImageTransformerConfig, ROPE_THETA,
    TIMESTEP_CHANNELS, TIMESTEP_SCALE, image_positions, rope_tables, text_positions,
    timestep_embedding,
};
use ddo_nn::{CheckpointWeights, LoadError, LoadResult, WeightSource, read_f32_tensor};
use ddo_routes::enable_dynamic_offload;

mod common;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen_image_transformer")
}

fn fixture(file: &str, name: &str) -> (Vec<usize>, Vec<f32>) {
    read_f32_tensor(&fixture_dir().join(file), name).expect("fixture tensor")
}

fn host_tensor(file: &str, name: &str) -> Tensor {
    let (shape, values) = fixture(file, name);
    Tensor::from_f32(shape, DType::F32, &values).expect("host tensor")
}

fn img_shapes(name: &str) -> Vec<[usize; 3]> {
    let (shape, v) = fixture("inputs.safetensors", name);
    assert_eq!(shape[1], 3);
    v.chunks(3)
        .map(|c| [c[0] as usize, c[1] as usize, c[2] as usize])
        .collect()
}

/// The fixture's `sample` call: two samples, the second prompt padded.
fn inputs() -> QwenImageInputs {
    let file = "inputs.safetensors";
    let (_, mask) = fixture(file, "encoder_hidden_states_mask_f32");
    QwenImageInputs {
        hidden_states: host_tensor(file, "hidden_states"),
        encoder_hidden_states: host_tensor(file, "encoder_hidden_states"),
        encoder_hidden_states_mask: Some(mask.iter().map(|&m| m != 0.0).collect()),
        timestep: fixture(file, "timestep").1,
        img_shapes: img_shapes("img_shapes_f32"),
    }
}

fn load() -> QwenImageTransformer {
    QwenImageTransformer::load(&fixture_dir(), None).expect("load fixture")
}

fn device() -> Arc<HostDevice> {
    HostDevice::with_capacity(1 << 30).expect("host device")
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn bytes(device: &dyn Device, t: &Tensor) -> Vec<u8> {
    t.to_host_bytes(device, &device.compute_stream())
        .expect("download")
}

/// `inputs` run on the fixture with its weights placed on a host device (no route): the
/// output's shape, bytes and values.
fn resident(inputs: &QwenImageInputs) -> (Vec<usize>, Vec<u8>, Vec<f32>) {
    let model = load();
    let d = device();
    model
        .component()
        .to_device(&*d, &d.compute_stream())
        .expect("to_device");
    let out = model.forward(&*d, inputs).expect("forward");
    let values = ops_of(&*d).unwrap().to_f32_vec(&out).unwrap();
    (out.shape().to_vec(), bytes(&*d, &out), values)
}

fn check_output(label: &str, inputs: &QwenImageInputs, reference: &str) -> f64 {
    let (shape, _, out) = resident(inputs);
    let (ref_shape, want) = fixture("outputs.safetensors", reference);
    assert_eq!(shape, ref_shape, "{label}");
    let err = rel_l2(&out, &want);
    eprintln!(
        "qwen_image_transformer {label}: relative L2 error {err:.3e}, max abs diff {:.3e}",
        max_abs(&out, &want)
    );
    assert!(err <= 1e-5, "{label}: relative L2 error {err:e} > 1e-5");
    err
}

#[test]
fn output_matches_diffusers_with_the_text_padding_mask() {
    check_output("sample (padding mask)", &inputs(), "sample");
}

#[test]
fn output_matches_diffusers_without_a_mask_and_with_two_images() {
    let mut unmasked = inputs();
    unmasked.encoder_hidden_states_mask = None;
    check_output("sample_unmasked", &unmasked, "sample_unmasked");
    // An all-true mask is no mask.
    let mut all_true = inputs();
    all_true.encoder_hidden_states_mask = Some(vec![true; 2 * 7]);
    assert_eq!(resident(&all_true).1, resident(&unmasked).1);
    // The padding mask changes the output (the fixture's second prompt is padded).
    let (_, masked) = fixture("outputs.safetensors", "sample");
    let (_, plain) = fixture("outputs.safetensors", "sample_unmasked");
    assert!(rel_l2(&plain, &masked) > 1e-3, "the mask matters here");

    let mut two = inputs();
    two.hidden_states = host_tensor("inputs.safetensors", "hidden_states_two_images");
    two.img_shapes = img_shapes("img_shapes_two_images_f32");
    check_output("sample_two_images", &two, "sample_two_images");
}

#[test]
fn every_block_and_embedding_matches_diffusers() {
    let model = load();
    let d = device();
    model
        .component()
        .to_device(&*d, &d.compute_stream())
        .unwrap();
    let ops = ops_of(&*d).unwrap();
    let mut taps: BTreeMap<String, (Vec<usize>, Vec<f32>)> = BTreeMap::new();
    model
        .forward_with_taps(&*d, &inputs(), &mut |name, t| {
            taps.insert(name.to_string(), (t.shape().to_vec(), ops.to_f32_vec(t)?));
            Ok(())
        })
        .unwrap();
    let mut expected = vec![
        "img_in",
        "txt_norm",
        "txt_in",
        "time_text_embed",
        "norm_out",
    ]
    .into_iter()
    .map(String::from)
    .collect::<BTreeSet<_>>();
    for i in 0..model.config().num_layers {
        expected.insert(format!("transformer_blocks.{i}.0"));
        expected.insert(format!("transformer_blocks.{i}.1"));
    }
    assert_eq!(taps.keys().cloned().collect::<BTreeSet<_>>(), expected);
    let inter = "intermediates.safetensors";
    let mut worst = 0.0f64;
    for (name, (shape, ours)) in &taps {
        let (ref_shape, want) = fixture(inter, name);
        assert_eq!(shape, &ref_shape, "{name}");
        let err = rel_l2(ours, &want);
        eprintln!(
            "  {name}: relative L2 {err:.3e}, max abs diff {:.3e}",
            max_abs(ours, &want)
        );
        assert!(err <= 1e-5, "{name}: relative L2 error {err:e} > 1e-5");
        worst = worst.max(err);
    }
    eprintln!("qwen_image_transformer intermediates: worst relative L2 {worst:.3e}");
}

#[test]
fn host_tables_match_diffusers() {
    let inter = "intermediates.safetensors";
    let input = inputs();
    let (shape, want) = fixture(inter, "time_text_embed.time_proj");
    assert_eq!(shape, [2, TIMESTEP_CHANNELS]);
    let ours = timestep_embedding(&input.timestep, TIMESTEP_CHANNELS, TIMESTEP_SCALE);
    let diff = max_abs(&ours, &want);
    eprintln!("time_proj: max abs diff {diff:.3e}");
    assert!(diff < 1e-4, "time_proj: max abs diff {diff:e}");
    assert!(rel_l2(&ours, &want) < 1e-6);

    // pos_embed.0 (image) and .1 (text) are complex [tokens, pairs] as (re, im); ours repeat
    // each pair's value over its two channels.
    let axes = QwenImageTransformerConfig::tiny().axes_dims_rope;
    for (name, positions) in [
        ("pos_embed.0", image_positions(&input.img_shapes)),
        ("pos_embed.1", text_positions(&input.img_shapes, 7)),
    ] {
        let (shape, want) = fixture(inter, name);
        assert_eq!(shape, [positions.len(), 8, 2], "{name}");
        let (cos, sin) = rope_tables(&positions, &axes, ROPE_THETA);
        let re: Vec<f32> = want.iter().step_by(2).copied().collect();
        let im: Vec<f32> = want.iter().skip(1).step_by(2).copied().collect();
        let cos_pairs: Vec<f32> = cos.iter().step_by(2).copied().collect();
        let sin_pairs: Vec<f32> = sin.iter().step_by(2).copied().collect();
        let diff = max_abs(&cos_pairs, &re).max(max_abs(&sin_pairs, &im));
        eprintln!("{name}: max abs diff {diff:.3e}");
        assert!(diff <= 2e-7, "{name}: max abs diff {diff:e}");
        assert!(cos.chunks(2).all(|p| p[0] == p[1]));
    }
}

#[test]
fn every_route_is_bit_identical_to_resident_execution() {
    let input = inputs();
    let (_, resident, _) = resident(&input);
    let specs: Vec<(&str, RouteSpec, bool)> = vec![
        ("resident", RouteSpec::resident(), false),
        ("leaf_group(no stream)", RouteSpec::leaf_group(false, false), false),
        ("leaf_group(stream)", RouteSpec::leaf_group(true, false), false),
        (
            "block_level(stream)",
            ddo_routes::parse_spec("diffusers_group_offload:offload_type=block_level,num_blocks_per_group=1,use_stream=true")
                .unwrap(),
            false,
        ),
        ("linear_convolution", ddo_routes::parse_spec("linear_convolution").unwrap(), false),
        ("native_vmm", ddo_routes::parse_spec("native_vmm:budget=64KiB").unwrap(), true),
    ];
    for (label, spec, native) in specs {
        let model = load();
        let total = model.component().param_bytes();
        let largest = model.component().largest_leaf().unwrap().param_bytes();
        if native {
            assert!(
                largest < 64 * 1024 && 64 * 1024 < total,
                "budget between largest leaf and total"
            );
        }
        let d = HostDevice::new(HostDeviceConfig {
            capacity: 1 << 30,
            allocator: if native {
                AllocatorKind::NativeVmm
            } else {
                AllocatorKind::Caching
            },
            ..HostDeviceConfig::default()
        })
        .unwrap();
        let dyn_d: Arc<dyn Device> = d.clone();
        let handle = enable_dynamic_offload(model.component(), dyn_d, spec)
            .unwrap_or_else(|e| panic!("{label}: attach: {e}"));
        for pass in 0..2 {
            let out = model
                .forward(&*d, &input)
                .unwrap_or_else(|e| panic!("{label}: forward {pass}: {e}"));
            assert!(
                bytes(&*d, &out) == resident,
                "{label}: forward {pass} differs from resident execution"
            );
        }
        let snap = handle.metrics_snapshot();
        assert_eq!(
            snap.counters.forwards, 2,
            "{label}: the route saw both forwards"
        );
        assert_eq!(
            snap.counters.leaf_calls,
            2 * model.component().leaves().len() as u64,
            "{label}: every leaf ran through the route"
        );
        drop(handle);
    }
}

/// A folder of its own under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let p = std::env::temp_dir().join(format!(
            "ddo-nn-qwen-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn a_sharded_folder_loads_as_the_single_file() {
    // The fixture's tensors split over two shards (the blocks, and the rest) with the
    // index Diffusers writes for a sharded save.
    let single = std::fs::read(fixture_dir().join("diffusion_pytorch_model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&single).unwrap();
    let dir = TempDir::new();
    let shard_of = |name: &str| {
        if name.starts_with("transformer_blocks.") {
            "diffusion_pytorch_model-00002-of-00002.safetensors"
        } else {
            "diffusion_pytorch_model-00001-of-00002.safetensors"
        }
    };
    let mut weight_map = serde_json::Map::new();
    for shard in [
        "diffusion_pytorch_model-00001-of-00002.safetensors",
        "diffusion_pytorch_model-00002-of-00002.safetensors",
    ] {
        let tensors: Vec<(String, safetensors::tensor::TensorView<'_>)> = file
            .tensors()
            .into_iter()
            .filter(|(name, _)| shard_of(name) == shard)
            .collect();
        for (name, _) in &tensors {
            weight_map.insert(name.clone(), shard.into());
        }
        let out = safetensors::serialize(tensors, None).unwrap();
        std::fs::write(dir.0.join(shard), out).unwrap();
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    std::fs::write(
        dir.0.join("diffusion_pytorch_model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    std::fs::copy(fixture_dir().join("config.json"), dir.0.join("config.json")).unwrap();

    let sharded = QwenImageTransformer::load(&dir.0, None).unwrap();
    let d = device();
    sharded
        .component()
        .to_device(&*d, &d.compute_stream())
        .unwrap();
    let out = sharded.forward(&*d, &inputs()).unwrap();
    assert_eq!(bytes(&*d, &out), resident(&inputs()).1);
}

#[test]
fn tree_uses_diffusers_names_and_a_block_list() {
    let model = load();
    let c = model.component();
    assert_eq!(c.name(), "transformer");
    assert_eq!(c.class_name(), "QwenImageTransformer2DModel");
    let ours: BTreeSet<String> = c.named_params().into_iter().map(|(n, _)| n).collect();
    let weights = CheckpointWeights::open_dir(&fixture_dir(), None).unwrap();
    let theirs: BTreeSet<String> = weights.names().into_iter().map(String::from).collect();
    assert_eq!(
        ours, theirs,
        "every checkpoint tensor is a param, under its Diffusers name"
    );
    for leaf in c.leaves() {
        let p = leaf.path();
        let expected = p
            .strip_prefix("transformer_blocks.")
            .and_then(|rest| rest.split('.').next()?.parse().ok())
            .map_or(Placement::Unmatched, |index| Placement::Block {
                list: "transformer_blocks".to_string(),
                index,
            });
        assert_eq!(leaf.placement(), &expected, "{p}");
    }
    let root: Vec<&str> = c.root().children().iter().map(|m| m.name()).collect();
    assert_eq!(
        root,
        [
            "img_in",
            "txt_norm",
            "txt_in",
            "time_text_embed",
            "transformer_blocks",
            "norm_out",
            "proj_out"
        ],
        "top-level modules in the order the forward runs them"
    );
}

#[test]
fn inputs_that_do_not_fit_are_typed_errors() {
    let model = load();
    let d = device();
    model
        .component()
        .to_device(&*d, &d.compute_stream())
        .unwrap();
    let err = model
        .component()
        .forward(&*d, host_tensor("inputs.safetensors", "hidden_states"))
        .unwrap_err();
    match err {
        CoreError::Shape { message, .. } => {
            assert!(message.contains("QwenImageInputs"), "{message}")
        }
        other => panic!("expected a Shape error, got {other}"),
    }
    let shape_error = |inputs: QwenImageInputs, needle: &str| match model.forward(&*d, &inputs) {
        Err(CoreError::Shape { message, .. }) => {
            assert!(message.contains(needle), "{needle}: {message}")
        }
        other => panic!("{needle}: expected a Shape error, got {other:?}"),
    };
    let mut bad = inputs();
    bad.img_shapes = vec![[1, 4, 4]];
    shape_error(bad, "img_shapes");
    let mut bad = inputs();
    bad.encoder_hidden_states_mask = Some(vec![true; 7]);
    shape_error(bad, "encoder_hidden_states_mask");
    let mut bad = inputs();
    bad.timestep = vec![0.5; 3];
    shape_error(bad, "timestep");
    let mut bad = inputs();
    bad.encoder_hidden_states = host_tensor("inputs.safetensors", "hidden_states");
    shape_error(bad, "encoder_hidden_states");
    // Positions past Diffusers' 4096-entry tables: a strip of 2 x 8194 patches (columns
    // down to -4097), or a prompt of 4096 tokens after a 2 x 2 image (text from 1 to 4096).
    shape_error(
        QwenImageInputs::synthetic(model.config(), 2, 8194, 1).unwrap(),
        "rotary positions",
    );
    shape_error(
        QwenImageInputs::synthetic(model.config(), 2, 2, 4096).unwrap(),
        "rotary positions",
    );
    // Just inside: m = 1, 4095 text tokens reach position 4095.
    let ok = QwenImageInputs::synthetic(model.config(), 2, 2, 4095).unwrap();
    assert!(model.forward(&*d, &ok).is_ok());
}

#[test]
fn config_reads_diffusers_json_and_refuses_what_ddo_cannot_run() {
    let c = QwenImageTransformerConfig::from_file(&fixture_dir().join("config.json")).unwrap();
    assert_eq!(
        c,
        QwenImageTransformerConfig::tiny(),
        "the fixture is qwen-tiny"
    );
    assert_eq!(
        QwenImageTransformerConfig::named("qwen-tiny"),
        Some(c.clone())
    );
    assert_eq!((c.inner_dim(), c.proj_out_channels()), (32, 16));

    let origin = Path::new("config.json");
    // Qwen/Qwen-Image's transformer/config.json as published, with the
    // `pooled_projection_dim` Diffusers ignores: the named `qwen-image` config.
    let published = r#"{"_class_name": "QwenImageTransformer2DModel",
        "_diffusers_version": "0.34.0.dev0", "attention_head_dim": 128,
        "axes_dims_rope": [16, 56, 56], "guidance_embeds": false, "in_channels": 64,
        "joint_attention_dim": 3584, "num_attention_heads": 24, "num_layers": 60,
        "out_channels": 16, "patch_size": 2, "pooled_projection_dim": 768}"#;
    let qwen = QwenImageTransformerConfig::parse(published, origin).unwrap();
    assert_eq!(qwen, QwenImageTransformerConfig::qwen_image());
    assert_eq!(
        QwenImageTransformerConfig::named("qwen-image"),
        Some(qwen.clone())
    );
    assert_eq!(
        QwenImageTransformerConfig::parse("{}", origin).unwrap(),
        qwen
    );
    assert_eq!(QwenImageTransformerConfig::named("flux-dev"), None);
    for name in QwenImageTransformerConfig::NAMES {
        assert!(QwenImageTransformerConfig::named(name).is_some(), "{name}");
    }
    // `out_channels: null` means in_channels.
    let null_out = QwenImageTransformerConfig::parse(r#"{"out_channels": null}"#, origin).unwrap();
    assert_eq!(null_out.proj_out_channels(), 4 * 64);

    let field_of = |text: &str| match QwenImageTransformerConfig::parse(text, origin) {
        Err(LoadError::InvalidConfig { field, hint, .. }) => {
            assert!(!hint.is_empty());
            field
        }
        other => panic!("expected InvalidConfig for {text}, got {other:?}"),
    };
    // The variants' switches DDO does not implement are refused by name.
    for field in [
        "zero_cond_t",
        "use_additional_t_cond",
        "use_layer3d_rope",
        "guidance_embeds",
    ] {
        assert_eq!(field_of(&format!(r#"{{"{field}": true}}"#)), field);
    }
    assert_eq!(
        field_of(r#"{"num_attention_heads": 0}"#),
        "num_attention_heads"
    );
    assert_eq!(field_of(r#"{"patch_size": 0}"#), "patch_size");
    assert_eq!(field_of(r#"{"out_channels": 0}"#), "out_channels");
    assert_eq!(
        field_of(r#"{"axes_dims_rope": [16, 56, 58]}"#),
        "axes_dims_rope"
    );
    assert_eq!(
        field_of(r#"{"axes_dims_rope": [64, 64]}"#),
        "axes_dims_rope"
    );
    assert_eq!(
        field_of(r#"{"axes_dims_rope": [15, 57, 56]}"#),
        "axes_dims_rope"
    );
    assert_eq!(
        field_of(r#"{"attention_head_dim": 15, "axes_dims_rope": [5, 5, 5]}"#),
        "attention_head_dim"
    );
    // Malformed JSON and wrong types: LoadError::Config naming the file.
    for text in [
        "{not json",
        r#"{"num_layers": "many"}"#,
        r#"{"zero_cond_t": 1}"#,
    ] {
        assert!(
            matches!(
                QwenImageTransformerConfig::parse(text, origin),
                Err(LoadError::Config { .. })
            ),
            "{text}"
        );
    }
    assert!(matches!(
        QwenImageTransformerConfig::from_file(&fixture_dir().join("missing.json")),
        Err(LoadError::Io { .. })
    ));
}

/// Qwen-Image's param count, 20,430,401,088, was obtained with the fixture venv's
/// diffusers 0.42.1 (`.venv-fixtures/bin/python`): `with torch.device("meta"): m =
/// QwenImageTransformer2DModel()` (its defaults are Qwen-Image's config) then
/// `sum(p.numel() for p in m.parameters())`. The same script gives 339,831,296 params per
/// block and 380,354,624 for the one-block variant.
const QWEN_IMAGE_PARAMS: u64 = 20_430_401_088;

/// bf16 params that all view one shared zeroed buffer: builds a model at full widths in
/// well under a second (the structure and shapes are what is under test, not values).
struct ZeroWeights {
    zeros: HostBuffer,
}

impl WeightSource for ZeroWeights {
    fn param(&mut self, name: &str, shape: &[usize], kind: ParamKind) -> LoadResult<Arc<Param>> {
        let len = shape.iter().product::<usize>() * 2;
        if self.zeros.len() < len {
            self.zeros = HostBuffer::pageable_zeroed(len);
        }
        let host = self.zeros.slice(0, len)?;
        Ok(Param::new(name, kind, DType::BF16, shape.to_vec(), host)?)
    }

    fn contains(&self, _name: &str) -> bool {
        true
    }
}

#[test]
fn qwen_image_widths_build_in_bf16_and_count_params() {
    let full = QwenImageTransformerConfig::qwen_image();
    assert_eq!(full.param_count(), QWEN_IMAGE_PARAMS);
    let one = QwenImageTransformerConfig {
        num_layers: 1,
        ..full.clone()
    };
    let mut zeros = ZeroWeights {
        zeros: HostBuffer::pageable_zeroed(0),
    };
    let model = QwenImageTransformer::build(&mut zeros, one.clone()).unwrap();
    let (mut block, mut shared) = (0u64, 0u64);
    for leaf in model.component().leaves() {
        let n: u64 = leaf
            .params()
            .iter()
            .map(|(_, p)| p.shape().iter().product::<usize>() as u64)
            .sum();
        match leaf.placement() {
            Placement::Block { index: 0, .. } => block += n,
            Placement::Unmatched => shared += n,
            other => panic!("unexpected placement {other:?}"),
        }
    }
    assert_eq!(block + shared, 380_354_624);
    assert_eq!(block + shared, one.param_count());
    assert_eq!((block, shared), (full.block_params(), full.shared_params()));
    assert_eq!(block, 339_831_296);
    assert_eq!(shared + 60 * block, QWEN_IMAGE_PARAMS);
}

/// Random weights at Qwen-Image's head width and RoPE axes (fewer heads and a narrower text
/// width): bf16 runs, stays close to the same weights in f32, and is seeded.
#[test]
fn random_bf16_model_runs_close_to_f32() {
    let config = QwenImageTransformerConfig {
        num_layers: 1,
        num_attention_heads: 2,
        joint_attention_dim: 64,
        ..QwenImageTransformerConfig::qwen_image()
    };
    let inputs = QwenImageInputs::synthetic(&config, 4, 3, 5).unwrap();
    let run = |dtype: DType| {
        let model = QwenImageTransformer::random(config.clone(), 11, dtype).unwrap();
        let d = device();
        model
            .component()
            .to_device(&*d, &d.compute_stream())
            .unwrap();
        let out = model.forward(&*d, &inputs).unwrap();
        assert_eq!(out.shape(), [1, 12, 64]);
        assert_eq!(out.dtype(), dtype);
        ops_of(&*d).unwrap().to_f32_vec(&out).unwrap()
    };
    let f32_out = run(DType::F32);
    let bf16_out = run(DType::BF16);
    let err = rel_l2(&bf16_out, &f32_out);
    eprintln!("random qwen-image widths: bf16 vs f32 relative L2 {err:.3e}");
    assert!(err < 0.05, "bf16 vs f32 relative L2 {err}");
    assert_eq!(run(DType::F32), f32_out, "seeded");
}

/// The rotary tables made once on the device (`make_rope`, as the denoising loop makes
/// them for each prompt) give each forward over those positions the bytes its own tables
/// give, and the forward makes none (two uploads fewer); made for another text length they
/// are not used, and the forward makes its own.
#[test]
fn a_forward_with_tables_made_once_equals_one_that_makes_them() {
    let model = load();
    let f = common::fault_device_holding(model.component());
    let input = inputs();
    let (own, own_made) =
        common::bytes_and_uploads(&f, &|| model.forward(&*f, &input).expect("forward"));
    assert!(own_made >= 2, "{own_made}");
    let rope = model.make_rope(&*f, &input).expect("make_rope");
    for _ in 0..2 {
        let (with, n) = common::bytes_and_uploads(&f, &|| {
            model
                .forward_with_rope(&*f, &input, &rope)
                .expect("forward")
        });
        assert_eq!(with, own);
        assert_eq!(n, own_made - 2);
    }
    // Tables for one text token fewer are not the inputs': not used.
    let mut other = inputs();
    let s = other.encoder_hidden_states.shape().to_vec();
    let values = other.encoder_hidden_states.host_f32().expect("values");
    let (rows, dim) = (s[1], s[2]);
    let shorter: Vec<f32> = values
        .chunks(rows * dim)
        .flat_map(|b| b[..(rows - 1) * dim].to_vec())
        .collect();
    other.encoder_hidden_states =
        Tensor::from_f32(vec![s[0], rows - 1, dim], DType::F32, &shorter).expect("tensor");
    other.encoder_hidden_states_mask = other.encoder_hidden_states_mask.map(|m| {
        m.chunks(rows)
            .flat_map(|b| b[..rows - 1].to_vec())
            .collect()
    });
    let fewer = model.make_rope(&*f, &other).expect("make_rope");
    let (with, n) = common::bytes_and_uploads(&f, &|| {
        model
            .forward_with_rope(&*f, &input, &fewer)
            .expect("forward")
    });
    assert_eq!(with, own);
    assert_eq!(n, own_made);
}

/// The linear calls the transformer names for a run's sizes (the CUDA backend loads their
/// kernels before the phase, as for Flux) are exactly those a forward makes, each shape,
/// bias and epilogue.
#[test]
fn the_named_linear_calls_are_those_a_forward_makes() {
    let model = load();
    let f = common::fault_device_holding(model.component());
    let input = inputs();
    let (b, li) = (
        input.hidden_states.shape()[0],
        input.hidden_states.shape()[1],
    );
    let lt = input.encoder_hidden_states.shape()[1];
    let named = model.linear_calls(b, li, lt);
    common::assert_named_linears_are_made(
        &f,
        &|| drop(model.forward(&*f, &input).expect("forward")),
        &named,
    );
    // Twice the samples: every row count follows the batch.
    let two = model.linear_calls(2 * b, li, lt);
    assert!(two.iter().all(|c| c.rows % 2 == 0), "{two:?}");
    // Another text length changes only the text stream's calls.
    let longer = model.linear_calls(b, li, lt + 1);
    assert!(longer.iter().any(|c| c.rows == b * (lt + 1)), "{longer:?}");
    assert_eq!(
        longer.iter().filter(|c| c.rows == b * li).count(),
        named.iter().filter(|c| c.rows == b * li).count()
    );
    // `--compute fp8` runs other kernels: nothing is named.
    model.component().set_fp8_compute(true);
    assert!(model.linear_calls(b, li, lt).is_empty());
    model.component().set_fp8_compute(false);
}

/// Each gated residual is applied by the norm that reads it, in one op
/// (`gated_add_layer_norm_modulate`): within a block, and from one block to the next; the
/// image stream is resolved by a plain gated add after the last block (the text's last is
/// not needed). A forward handing its blocks' outputs to a tap applies them at once, with
/// the same output bytes.
#[test]
fn gated_residuals_are_applied_by_the_next_norm() {
    // The fixture's widths, with blocks enough to hand a residual from block to block.
    let mut config = load().config().clone();
    config.num_layers = 3;
    let layers = config.num_layers;
    let model = QwenImageTransformer::random(config, 7, DType::F32).expect("random model");
    let f = common::fault_device_holding(model.component());
    let input = inputs();
    let calls = common::op_calls(&f, &|| drop(model.forward(&*f, &input).expect("forward")));
    let n = |op: &str| calls.get(op).copied().unwrap_or(0) as usize;
    assert_eq!(
        n("gated_add_layer_norm_modulate"),
        2 * layers + 2 * (layers - 1),
        "{calls:?}"
    );
    assert_eq!(n("gated_add"), 1, "{calls:?}");
    assert_eq!(n("layer_norm_modulate"), 2 + 1, "{calls:?}");
    // With a tap: every block's streams resolved, the same output.
    let plain = bytes(&*f, &model.forward(&*f, &input).expect("forward"));
    let mut seen = 0;
    let tapped = model
        .forward_with_taps(&*f, &input, &mut |_, _| {
            seen += 1;
            Ok(())
        })
        .expect("forward");
    assert_eq!(bytes(&*f, &tapped), plain);
    assert!(seen >= 2 * layers, "{seen}");
}
