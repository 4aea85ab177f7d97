//! CLIPTextModel: conformance with Transformers' fixture, the pooling rule, `text_model.`
//! prefixed checkpoints, routes, config errors, and the CLIP-L parameter count.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ddo_core::{CoreError, DType, Device, Param, ParamKind, RouteSpec, Tensor};
use ddo_host::HostDevice;
use ddo_nn::clip::{ClipOutput, ClipTextConfig, ClipTextModel};
use ddo_nn::{CheckpointWeights, LoadError, LoadResult, WeightSource, read_f32_tensor};
use ddo_routes::enable_dynamic_offload;

const HIDDEN: usize = 32;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/clip_text")
}

fn input_ids() -> Vec<u32> {
    let (_, ids) = read_f32_tensor(&fixture().join("inputs.safetensors"), "input_ids_f32")
        .expect("fixture inputs");
    ids.iter().map(|&v| v as u32).collect()
}

fn fixture_config() -> ClipTextConfig {
    ClipTextConfig::from_file(&fixture().join("config.json")).expect("fixture config")
}

fn device() -> Arc<HostDevice> {
    HostDevice::with_capacity(1 << 30).expect("host device")
}

fn values(device: &dyn Device, t: &Tensor) -> Vec<f32> {
    t.to_f32_vec(device, &device.compute_stream())
        .expect("download")
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The fixture's weights with `config`.
fn load_with(dir: &Path, config: &ClipTextConfig) -> ClipTextModel {
    let mut w = CheckpointWeights::open_dir(dir, None).expect("weights");
    ClipTextModel::build(&mut w, config).expect("build CLIP")
}

/// (last_hidden_state, pooler_output) values of `model` on `ids` with `spec` attached.
fn run_with(model: &ClipTextModel, spec: RouteSpec, ids: &[u32]) -> (Vec<f32>, Vec<f32>) {
    let d = device();
    let handle = enable_dynamic_offload(model.component(), d.clone(), spec).expect("attach");
    let ClipOutput {
        last_hidden_state,
        pooler_output,
    } = model.forward(&*d, ids).expect("forward");
    assert_eq!(last_hidden_state.shape(), &[1, ids.len(), HIDDEN]);
    assert_eq!(pooler_output.shape(), &[1, HIDDEN]);
    let out = (values(&*d, &last_hidden_state), values(&*d, &pooler_output));
    drop((last_hidden_state, pooler_output, handle));
    out
}

fn row(hidden: &[f32], index: usize) -> &[f32] {
    &hidden[index * HIDDEN..(index + 1) * HIDDEN]
}

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "ddo-nn-clip-{tag}-{}-{}",
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

#[test]
fn outputs_match_transformers() {
    let model = ClipTextModel::from_dir(&fixture(), None).expect("load fixture");
    assert_eq!(model.component().name(), "text_encoder");
    assert_eq!(model.component().class_name(), "CLIPTextModel");
    assert!(!model.has_legacy_prefix());
    let ids = input_ids();
    let (hidden, pooled) = run_with(&model, RouteSpec::resident(), &ids);
    let outputs = fixture().join("outputs.safetensors");
    let (_, want_hidden) = read_f32_tensor(&outputs, "last_hidden_state").expect("fixture");
    let (_, want_pooled) = read_f32_tensor(&outputs, "pooler_output").expect("fixture");
    let e_hidden = rel_l2(&hidden, &want_hidden);
    let e_pooled = rel_l2(&pooled, &want_pooled);
    eprintln!(
        "CLIP relative L2 error: last_hidden_state {e_hidden:.3e}, pooler_output {e_pooled:.3e}"
    );
    assert!(e_hidden <= 1e-5, "last_hidden_state: {e_hidden:e}");
    assert!(e_pooled <= 1e-5, "pooler_output: {e_pooled:e}");
    // Both rules pick position 5 here (the first eos, which is also the highest id).
    assert_eq!(model.config().pooled_index(&ids), 5);
    assert_eq!(pooled, row(&hidden, 5));
}

#[test]
fn layer_outputs_match_transformers() {
    // Layer by layer: a model cut to the first n layers ends in final_layer_norm, so its
    // output is final_layer_norm(encoder.layers.{n-1}); compare the first layer's output
    // through the norm with Transformers' intermediates, recomputing the norm on the host.
    let inter = fixture().join("intermediates.safetensors");
    let (_, layer0) = read_f32_tensor(&inter, "encoder.layers.0").expect("layer 0");
    let weights = fixture().join("model.safetensors");
    let (_, w) = read_f32_tensor(&weights, "final_layer_norm.weight").expect("norm weight");
    let (_, b) = read_f32_tensor(&weights, "final_layer_norm.bias").expect("norm bias");
    let config = fixture_config();
    let want: Vec<f32> = layer0
        .chunks(HIDDEN)
        .flat_map(|x| {
            let n = x.len() as f64;
            let mean = x.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
            let var = x
                .iter()
                .map(|&v| (f64::from(v) - mean).powi(2))
                .sum::<f64>()
                / n;
            let inv = 1.0 / (var + config.layer_norm_eps).sqrt();
            x.iter()
                .enumerate()
                .map(|(i, &v)| {
                    ((f64::from(v) - mean) * inv * f64::from(w[i]) + f64::from(b[i])) as f32
                })
                .collect::<Vec<_>>()
        })
        .collect();
    let mut cut = config.clone();
    cut.num_hidden_layers = 1;
    let model = load_with(&fixture(), &cut);
    let (hidden, _) = run_with(&model, RouteSpec::resident(), &input_ids());
    let err = rel_l2(&hidden, &want);
    assert!(err <= 1e-5, "layer 0 through final_layer_norm: {err:e}");
}

#[test]
fn pooling_rule_follows_eos_token_id() {
    // Legacy configs (eos_token_id == 2): the highest id's first position.
    let mut legacy = fixture_config();
    legacy.eos_token_id = 2;
    // ids where the highest id (99 at 4) is not the first `2` (at 3) nor the first 40 (at 1).
    let ids = [13u32, 40, 7, 2, 99, 40, 2, 99];
    assert_eq!(legacy.pooled_index(&ids), 4);
    let mut eos40 = fixture_config();
    eos40.eos_token_id = 40;
    assert_eq!(eos40.pooled_index(&ids), 1);
    assert_eq!(fixture_config().pooled_index(&ids), 4);
    // No eos: position 0 (argmax of all zeros), as Transformers.
    assert_eq!(eos40.pooled_index(&[5, 6, 7]), 0);
    // Ties in the legacy rule: the first one.
    assert_eq!(legacy.pooled_index(&[5, 9, 9, 1]), 1);

    // On the fixture model the pooled output is exactly the chosen row.
    for (config, want) in [(legacy, 4usize), (eos40, 1)] {
        let model = load_with(&fixture(), &config);
        let (hidden, pooled) = run_with(&model, RouteSpec::resident(), &ids);
        assert_eq!(
            bits(&pooled),
            bits(row(&hidden, want)),
            "eos {}",
            config.eos_token_id
        );
        let other = if want == 4 { 3 } else { 4 };
        assert_ne!(bits(&pooled), bits(row(&hidden, other)));
    }
}

#[test]
fn text_model_prefixed_checkpoint_loads() {
    let dir = TempDir::new("prefixed");
    std::fs::copy(fixture().join("config.json"), dir.0.join("config.json")).expect("config");
    let bytes = std::fs::read(fixture().join("model.safetensors")).expect("weights");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse weights");
    let prefixed: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| (format!("text_model.{name}"), view))
        .collect();
    safetensors::serialize_to_file(prefixed, None, &dir.0.join("model.safetensors"))
        .expect("write weights");

    let model = ClipTextModel::from_dir(&dir.0, None).expect("load prefixed");
    assert!(model.has_legacy_prefix());
    assert!(
        model
            .component()
            .leaves()
            .iter()
            .all(|l| l.path().starts_with("text_model."))
    );
    let plain = ClipTextModel::from_dir(&fixture(), None).expect("load plain");
    let ids = input_ids();
    let (h1, p1) = run_with(&model, RouteSpec::resident(), &ids);
    let (h0, p0) = run_with(&plain, RouteSpec::resident(), &ids);
    assert_eq!(bits(&h1), bits(&h0));
    assert_eq!(bits(&p1), bits(&p0));
}

#[test]
fn routes_give_bit_identical_outputs() {
    // Diffusers-style group offload stays with the component until it is dropped: a fresh
    // model per route.
    let load = || ClipTextModel::from_dir(&fixture(), None).expect("load fixture");
    let ids = input_ids();
    let (h0, p0) = run_with(&load(), RouteSpec::resident(), &ids);
    for spec in [
        RouteSpec::leaf_group(false, false),
        RouteSpec::leaf_group(true, false),
        ddo_routes::parse_spec("linear_convolution").unwrap(),
    ] {
        let (h, p) = run_with(&load(), spec, &ids);
        assert_eq!(bits(&h), bits(&h0), "{}", spec.describe());
        assert_eq!(bits(&p), bits(&p0), "{}", spec.describe());
    }
}

#[test]
fn program_forward_returns_last_hidden_state() {
    let model = ClipTextModel::from_dir(&fixture(), None).expect("load fixture");
    let ids = input_ids();
    let d = device();
    let _h = enable_dynamic_offload(model.component(), d.clone(), RouteSpec::resident())
        .expect("attach");
    let typed = model.forward(&*d, &ids).expect("forward");
    let as_f32: Vec<f32> = ids.iter().map(|&i| i as f32).collect();
    let input = Tensor::from_f32(vec![1, ids.len()], DType::F32, &as_f32).expect("input");
    let out = model
        .component()
        .forward(&*d, input)
        .expect("program forward");
    assert_eq!(
        bits(&values(&*d, &out)),
        bits(&values(&*d, &typed.last_hidden_state))
    );

    // Inputs the model cannot take are typed errors.
    let too_long = vec![5u32; 17];
    assert!(matches!(
        model.forward(&*d, &too_long),
        Err(CoreError::InvalidOption { .. })
    ));
    assert!(matches!(
        model.forward(&*d, &[1, 100]),
        Err(CoreError::InvalidOption { .. })
    ));
    let bad = Tensor::from_f32(vec![1, 2], DType::F32, &[1.0, 2.5]).expect("input");
    assert!(matches!(
        model.component().forward(&*d, bad),
        Err(CoreError::InvalidOption { .. })
    ));
    let batch2 = Tensor::from_f32(vec![2, 1], DType::F32, &[1.0, 2.0]).expect("input");
    assert!(matches!(
        model.component().forward(&*d, batch2),
        Err(CoreError::Shape { .. })
    ));
}

#[test]
fn config_parses_and_errors_are_typed() {
    let c = fixture_config();
    assert_eq!(
        (
            c.vocab_size,
            c.hidden_size,
            c.intermediate_size,
            c.num_hidden_layers
        ),
        (100, 32, 64, 2)
    );
    assert_eq!((c.num_attention_heads, c.max_position_embeddings), (4, 16));
    assert_eq!((c.eos_token_id, c.bos_token_id), (99, 98));
    assert_eq!(c.hidden_act, "quick_gelu");
    assert_eq!(c.projection_dim, Some(512));
    assert_eq!(c.layer_norm_eps, 1e-5);

    let origin = Path::new("inline.json");
    // Transformers' defaults; unknown fields ignored; a CLIPConfig's text_config is used.
    let d = ClipTextConfig::from_json_str("{\"model_type\": \"clip_text_model\"}", origin)
        .expect("defaults");
    assert_eq!(
        (d.hidden_size, d.eos_token_id, d.vocab_size),
        (512, 49407, 49408)
    );
    let nested = ClipTextConfig::from_json_str(
        "{\"text_config\": {\"hidden_size\": 64, \"num_attention_heads\": 4}, \"vision_config\": {}}",
        origin,
    )
    .expect("nested");
    assert_eq!(nested.hidden_size, 64);
    let gelu = ClipTextConfig::from_json_str("{\"hidden_act\": \"gelu\"}", origin).expect("gelu");
    assert_eq!(gelu.activation().expect("act"), ddo_core::UnaryOp::GeluErf);

    assert!(matches!(
        ClipTextConfig::from_json_str("[1, 2", origin),
        Err(LoadError::Config { .. })
    ));
    assert!(matches!(
        ClipTextConfig::from_json_str("{\"eos_token_id\": \"eos\"}", origin),
        Err(LoadError::Config { .. })
    ));
    for (json, field) in [
        ("{\"hidden_act\": \"mish\"}", "hidden_act"),
        (
            "{\"hidden_size\": 30, \"num_attention_heads\": 4}",
            "num_attention_heads",
        ),
        ("{\"num_attention_heads\": 0}", "num_attention_heads"),
        (
            "{\"max_position_embeddings\": 0}",
            "max_position_embeddings",
        ),
        ("{\"layer_norm_eps\": -1e-5}", "layer_norm_eps"),
    ] {
        match ClipTextConfig::from_json_str(json, origin) {
            Err(LoadError::InvalidConfig { field: f, .. }) => assert_eq!(f, field, "{json}"),
            other => panic!("{json}: expected InvalidConfig, got {other:?}"),
        }
    }
    assert!(matches!(
        ClipTextConfig::from_file(Path::new("/nonexistent/config.json")),
        Err(LoadError::Io { .. })
    ));
    // Config and checkpoint that do not belong together: typed, naming the tensor.
    let mut wide = c.clone();
    wide.intermediate_size = 128;
    let mut w = CheckpointWeights::open_dir(&fixture(), None).expect("weights");
    match ClipTextModel::build(&mut w, &wide) {
        Err(LoadError::ShapeMismatch { name, .. }) => {
            assert_eq!(name, "encoder.layers.0.mlp.fc1.weight")
        }
        other => panic!("expected ShapeMismatch, got {other:?}"),
    }
}

/// Zero-filled params of the requested shape and dtype: builds full-size models without
/// spending time on random numbers.
struct ZeroWeights(DType);

impl WeightSource for ZeroWeights {
    fn param(&mut self, name: &str, shape: &[usize], kind: ParamKind) -> LoadResult<Arc<Param>> {
        let n: usize = shape.iter().product();
        let host = ddo_core::HostBuffer::pageable_zeroed(n * self.0.size_in_bytes());
        Ok(Param::new(
            name,
            kind,
            self.0,
            shape.to_vec(),
            host.slice_all(),
        )?)
    }

    fn contains(&self, _name: &str) -> bool {
        true
    }
}

#[test]
fn clip_l_param_count_matches_transformers() {
    // `CLIPTextModel(CLIPTextConfig(vocab_size=49408, hidden_size=768,
    // intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
    // max_position_embeddings=77))` built on the meta device with transformers 5.24.0 has
    // 123,060,480 parameters.
    const TRANSFORMERS_CLIP_L: u64 = 123_060_480;
    let config = ClipTextConfig::clip_l();
    assert_eq!(config.eos_token_id, 2);
    assert_eq!(config.param_count(), TRANSFORMERS_CLIP_L);
    let model = ClipTextModel::build(&mut ZeroWeights(DType::BF16), &config).expect("CLIP-L");
    let c = model.component();
    let total: u64 = c
        .params()
        .iter()
        .map(|p| p.shape().iter().product::<usize>() as u64)
        .sum();
    assert_eq!(total, TRANSFORMERS_CLIP_L);
    assert_eq!(c.param_bytes(), 2 * TRANSFORMERS_CLIP_L);
    assert!(c.params().iter().all(|p| p.dtype() == DType::BF16));
    assert_eq!(c.leaves().len(), 2 + 12 * 8 + 1);
    assert!(
        c.leaf_by_path("encoder.layers.11.self_attn.out_proj")
            .is_some()
    );
}

#[test]
fn random_weights_build_and_run_in_bf16() {
    // Seeded random weights have every name (plain and prefixed): the plain names win.
    let config = ClipTextConfig {
        vocab_size: 64,
        hidden_size: 24,
        intermediate_size: 40,
        num_hidden_layers: 2,
        num_attention_heads: 3,
        max_position_embeddings: 8,
        ..ClipTextConfig::clip_l()
    };
    let mut w = ddo_nn::RandomWeights::new(3, DType::BF16);
    let model = ClipTextModel::build(&mut w, &config).expect("random CLIP");
    assert!(!model.has_legacy_prefix());
    let d = device();
    let _h = enable_dynamic_offload(model.component(), d.clone(), RouteSpec::resident())
        .expect("attach");
    let out = model.forward(&*d, &[0, 17, 63, 2, 2]).expect("forward");
    assert_eq!(out.last_hidden_state.shape(), &[1, 5, 24]);
    assert_eq!(out.last_hidden_state.dtype(), DType::BF16);
    let hidden = values(&*d, &out.last_hidden_state);
    assert!(hidden.iter().all(|v| v.is_finite()));
    // Legacy rule: the highest id (63, position 2).
    assert_eq!(values(&*d, &out.pooler_output), hidden[2 * 24..3 * 24]);
}
