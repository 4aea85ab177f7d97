//! T5EncoderModel: conformance with Transformers' fixture, weight-name fallbacks, routes,
//! config errors, and the T5-XXL parameter count.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ddo_core::{CoreError, DType, Device, LeafKind, Param, ParamKind, RouteSpec, Tensor};
use ddo_host::HostDevice;
use ddo_nn::t5::{T5Config, T5Encoder, relative_position_bucket};
use ddo_nn::{CheckpointWeights, LoadError, LoadResult, WeightSource, read_f32_tensor};
use ddo_routes::enable_dynamic_offload;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/t5_encoder")
}

fn input_ids() -> Vec<u32> {
    let (_, ids) = read_f32_tensor(&fixture().join("inputs.safetensors"), "input_ids_f32")
        .expect("fixture inputs");
    ids.iter().map(|&v| v as u32).collect()
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

fn load(dir: &Path) -> T5Encoder {
    T5Encoder::from_dir(dir, None).expect("load T5 fixture")
}

/// Runs `model` on `ids` with `spec` attached; the output's values.
fn run_with(model: &T5Encoder, spec: RouteSpec, ids: &[u32]) -> Vec<f32> {
    let d = device();
    let handle = enable_dynamic_offload(model.component(), d.clone(), spec).expect("attach");
    let out = model.forward(&*d, ids).expect("forward");
    let v = values(&*d, &out);
    drop(out);
    drop(handle);
    v
}

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "ddo-nn-t5-{tag}-{}-{}",
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

/// Copies the fixture's config and weights into a temp dir, renaming tensors by `rename`
/// (None drops a tensor).
fn rewritten_fixture(tag: &str, rename: impl Fn(&str) -> Option<String>) -> TempDir {
    let dir = TempDir::new(tag);
    std::fs::copy(fixture().join("config.json"), dir.0.join("config.json")).expect("config");
    let bytes = std::fs::read(fixture().join("model.safetensors")).expect("weights");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("parse weights");
    let renamed: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .filter_map(|(name, view)| rename(&name).map(|n| (n, view)))
        .collect();
    safetensors::serialize_to_file(renamed, None, &dir.0.join("model.safetensors"))
        .expect("write weights");
    dir
}

#[test]
fn last_hidden_state_matches_transformers() {
    let model = load(&fixture());
    assert_eq!(model.component().name(), "text_encoder_2");
    assert_eq!(model.component().class_name(), "T5EncoderModel");
    let ids = input_ids();
    let got = run_with(&model, RouteSpec::resident(), &ids);
    let (shape, want) =
        read_f32_tensor(&fixture().join("outputs.safetensors"), "last_hidden_state")
            .expect("fixture output");
    assert_eq!(shape, vec![1, ids.len(), 32]);
    let err = rel_l2(&got, &want);
    eprintln!("T5 last_hidden_state relative L2 error: {err:.3e}");
    assert!(err <= 1e-5, "relative L2 error {err:e} > 1e-5");
}

#[test]
fn position_bias_matches_transformers() {
    // Block 0's relative position bias [1, heads, L, L] (the second output of
    // `encoder.block.0` in the intermediates), rebuilt from the bucket function and the
    // checkpoint's table.
    let inter = fixture().join("intermediates.safetensors");
    let (_, bias) = read_f32_tensor(&inter, "encoder.block.0.1").expect("position bias");
    // The position bias [1, heads, L, L] from the bucket function and the fixture's table.
    let (_, table) = read_f32_tensor(
        &fixture().join("model.safetensors"),
        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
    )
    .expect("bias table");
    let config = T5Config::from_file(&fixture().join("config.json")).expect("config");
    let len = input_ids().len();
    let heads = config.num_heads;
    let mut mine = vec![0.0f32; heads * len * len];
    for h in 0..heads {
        for q in 0..len {
            for k in 0..len {
                let bucket = relative_position_bucket(
                    k as i64 - q as i64,
                    true,
                    config.relative_attention_num_buckets,
                    config.relative_attention_max_distance,
                );
                mine[(h * len + q) * len + k] = table[bucket * heads + h];
            }
        }
    }
    assert_eq!(
        mine, bias,
        "relative position bias differs from Transformers'"
    );
}

#[test]
fn relative_position_buckets_match_transformers() {
    // (first relative position, bucket) of every bucket over -300..=300 for the encoder with
    // 32 buckets and max distance 128, from Transformers' `_relative_position_bucket`.
    let transitions: [(i64, usize); 31] = [
        (-300, 15),
        (-90, 14),
        (-63, 13),
        (-45, 12),
        (-31, 11),
        (-22, 10),
        (-15, 9),
        (-11, 8),
        (-7, 7),
        (-6, 6),
        (-5, 5),
        (-4, 4),
        (-3, 3),
        (-2, 2),
        (-1, 1),
        (0, 0),
        (1, 17),
        (2, 18),
        (3, 19),
        (4, 20),
        (5, 21),
        (6, 22),
        (7, 23),
        (8, 24),
        (12, 25),
        (16, 26),
        (23, 27),
        (32, 28),
        (46, 29),
        (64, 30),
        (91, 31),
    ];
    let mut expected = Vec::new();
    let mut current = transitions[0].1;
    let mut next = 0;
    for rp in -300i64..=300 {
        if next < transitions.len() && transitions[next].0 == rp {
            current = transitions[next].1;
            next += 1;
        }
        expected.push(current);
    }
    let got: Vec<usize> = (-300i64..=300)
        .map(|rp| relative_position_bucket(rp, true, 32, 128))
        .collect();
    assert_eq!(got, expected);
    // Far positions share the last bucket of their direction.
    assert_eq!(relative_position_bucket(100_000, true, 32, 128), 31);
    assert_eq!(relative_position_bucket(-100_000, true, 32, 128), 15);
}

#[test]
fn program_forward_takes_ids_as_f32() {
    let model = load(&fixture());
    let ids = input_ids();
    let d = device();
    let _handle = enable_dynamic_offload(model.component(), d.clone(), RouteSpec::resident())
        .expect("attach");
    let typed = values(&*d, &model.forward(&*d, &ids).expect("forward"));
    let as_f32: Vec<f32> = ids.iter().map(|&i| i as f32).collect();
    let input = Tensor::from_f32(vec![1, ids.len()], DType::F32, &as_f32).expect("input");
    let out = model
        .component()
        .forward(&*d, input)
        .expect("program forward");
    assert_eq!(out.shape(), &[1, ids.len(), 32]);
    assert_eq!(values(&*d, &out), typed);
}

#[test]
fn embed_tokens_name_loads_like_shared() {
    let dir = rewritten_fixture("embed", |n| {
        Some(if n == "shared.weight" {
            "encoder.embed_tokens.weight".to_string()
        } else {
            n.to_string()
        })
    });
    let ids = input_ids();
    let want = run_with(&load(&fixture()), RouteSpec::resident(), &ids);
    let got = run_with(&load(&dir.0), RouteSpec::resident(), &ids);
    assert_eq!(got, want);

    // With neither name, the error names the preferred one.
    let none = rewritten_fixture("noembed", |n| (n != "shared.weight").then(|| n.to_string()));
    match T5Encoder::from_dir(&none.0, None) {
        Err(LoadError::MissingTensor { name, .. }) => assert_eq!(name, "shared.weight"),
        other => panic!("expected MissingTensor, got {other:?}"),
    }
}

#[test]
fn routes_give_bit_identical_outputs() {
    // Diffusers-style group offload stays with the component until it is dropped: a fresh
    // model per route.
    let ids = input_ids();
    let resident = run_with(&load(&fixture()), RouteSpec::resident(), &ids);
    for spec in [
        RouteSpec::leaf_group(false, false),
        RouteSpec::leaf_group(true, false),
        ddo_routes::parse_spec("linear_convolution").unwrap(),
    ] {
        let got = run_with(&load(&fixture()), spec, &ids);
        assert_eq!(got.len(), resident.len());
        let same = got
            .iter()
            .zip(&resident)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{} differs from resident", spec.describe());
    }
}

#[test]
fn attention_mask_hides_padding() {
    // Relative position bias depends on distance only, so with the padding masked the
    // first n rows equal the output of the first n tokens alone.
    let model = load(&fixture());
    let ids = input_ids();
    let n = ids.iter().position(|&i| i == 1).expect("eos") + 1;
    let mask: Vec<u32> = (0..ids.len()).map(|i| u32::from(i < n)).collect();
    let d = device();
    let _handle = enable_dynamic_offload(model.component(), d.clone(), RouteSpec::resident())
        .expect("attach");
    let masked = values(
        &*d,
        &model
            .forward_with_mask(&*d, &ids, Some(&mask))
            .expect("masked forward"),
    );
    let prefix = values(&*d, &model.forward(&*d, &ids[..n]).expect("prefix forward"));
    let err = rel_l2(&masked[..n * 32], &prefix);
    assert!(
        err <= 1e-6,
        "masked rows differ from the prefix run: {err:e}"
    );
    let unmasked = values(&*d, &model.forward(&*d, &ids).expect("forward"));
    assert!(
        rel_l2(&unmasked[..n * 32], &prefix) > 1e-4,
        "padding should matter unmasked"
    );

    // Bad masks and ids are typed errors.
    assert!(matches!(
        model.forward_with_mask(&*d, &ids, Some(&mask[..3])),
        Err(CoreError::Shape { .. })
    ));
    assert!(matches!(
        model.forward_with_mask(&*d, &ids, Some(&vec![2; ids.len()])),
        Err(CoreError::InvalidOption { .. })
    ));
    assert!(matches!(
        model.forward(&*d, &[3, 100]),
        Err(CoreError::InvalidOption { .. })
    ));
    assert!(matches!(
        model.forward(&*d, &[]),
        Err(CoreError::InvalidOption { .. })
    ));
}

#[test]
fn config_parses_and_errors_are_typed() {
    let c = T5Config::from_file(&fixture().join("config.json")).expect("fixture config");
    assert_eq!(
        (
            c.vocab_size,
            c.d_model,
            c.d_kv,
            c.d_ff,
            c.num_layers,
            c.num_heads
        ),
        (100, 32, 8, 64, 2, 4)
    );
    assert_eq!(c.feed_forward_proj, "gated-gelu");
    assert!(c.is_gated_act());
    assert_eq!(c.dense_act_fn(), "gelu_new");
    assert_eq!(c.layer_norm_epsilon, 1e-6);

    let origin = Path::new("inline.json");
    // Defaults are Transformers' (original T5: relu, not gated).
    let d = T5Config::from_json_str("{\"unknown_field\": [1, 2]}", origin).expect("defaults");
    assert_eq!(
        (d.d_model, d.num_layers, d.feed_forward_proj.as_str()),
        (512, 6, "relu")
    );
    assert!(!d.is_gated_act());
    let silu = T5Config::from_json_str("{\"feed_forward_proj\": \"gated-silu\"}", origin)
        .expect("gated-silu");
    assert_eq!(silu.dense_act_fn(), "silu");

    assert!(matches!(
        T5Config::from_json_str("{not json", origin),
        Err(LoadError::Config { .. })
    ));
    assert!(matches!(
        T5Config::from_json_str("{\"d_model\": -4}", origin),
        Err(LoadError::Config { .. })
    ));
    for (json, field) in [
        (
            "{\"feed_forward_proj\": \"gated-mish\"}",
            "feed_forward_proj",
        ),
        (
            "{\"feed_forward_proj\": \"gated-gelu-new\"}",
            "feed_forward_proj",
        ),
        (
            "{\"feed_forward_proj\": \"ungated-gelu\"}",
            "feed_forward_proj",
        ),
        ("{\"num_heads\": 0}", "num_heads"),
        ("{\"d_kv\": 0}", "d_kv"),
        (
            "{\"relative_attention_num_buckets\": 2}",
            "relative_attention_num_buckets",
        ),
        (
            "{\"relative_attention_max_distance\": 8}",
            "relative_attention_max_distance",
        ),
        ("{\"layer_norm_epsilon\": -1.0}", "layer_norm_epsilon"),
    ] {
        match T5Config::from_json_str(json, origin) {
            Err(LoadError::InvalidConfig { field: f, .. }) => assert_eq!(f, field, "{json}"),
            other => panic!("{json}: expected InvalidConfig, got {other:?}"),
        }
    }
    assert!(matches!(
        T5Config::from_file(Path::new("/nonexistent/config.json")),
        Err(LoadError::Io { .. })
    ));
    // A config that does not match the checkpoint: typed shape error naming the tensor.
    let mut wide = c.clone();
    wide.d_ff = 128;
    let mut w = CheckpointWeights::open_dir(&fixture(), None).expect("weights");
    match T5Encoder::build(&mut w, &wide) {
        Err(LoadError::ShapeMismatch { name, .. }) => {
            assert_eq!(name, "encoder.block.0.layer.1.DenseReluDense.wi_0.weight")
        }
        other => panic!("expected ShapeMismatch, got {other:?}"),
    }
}

/// Zero-filled params of the requested shape and dtype: builds full-width models without
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

fn numel(p: &Param) -> u64 {
    p.shape().iter().product::<usize>() as u64
}

#[test]
fn t5_xxl_param_count_matches_transformers() {
    // `T5EncoderModel(T5Config(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240,
    // num_layers=24, num_heads=64, feed_forward_proj="gated-gelu"))` built on the meta
    // device with transformers 5.24.0 has 4,762,310,656 parameters (219 tensors; the
    // 1-layer variant: 324,548,608).
    const TRANSFORMERS_XXL: u64 = 4_762_310_656;
    const TRANSFORMERS_XXL_1_LAYER: u64 = 324_548_608;
    let full = T5Config::t5_xxl();
    assert_eq!(full.param_count(), TRANSFORMERS_XXL);

    let mut one = full.clone();
    one.num_layers = 1;
    let model = T5Encoder::build(&mut ZeroWeights(DType::BF16), &one).expect("1-layer XXL");
    let c = model.component();
    let params = c.params();
    let total: u64 = params.iter().map(|p| numel(p)).sum();
    assert_eq!(total, TRANSFORMERS_XXL_1_LAYER);
    assert_eq!(c.param_bytes(), 2 * TRANSFORMERS_XXL_1_LAYER);
    assert!(params.iter().all(|p| p.dtype() == DType::BF16));

    // Blocks 1..23 are block 0 without the relative attention bias.
    let block: u64 = c
        .leaves()
        .iter()
        .filter(|l| l.path().starts_with("encoder.block.0."))
        .filter(|l| !l.path().ends_with("relative_attention_bias"))
        .flat_map(|l| l.params().iter().map(|(_, p)| numel(p)))
        .sum();
    assert_eq!(block, 192_946_176);
    assert_eq!(total + 23 * block, TRANSFORMERS_XXL);

    // Transformers' module paths, one tied embedding leaf.
    let paths: Vec<&str> = c.leaves().iter().map(|l| l.path()).collect();
    assert_eq!(paths.first(), Some(&"shared"));
    assert!(paths.contains(&"encoder.block.0.layer.0.SelfAttention.relative_attention_bias"));
    assert!(paths.contains(&"encoder.block.0.layer.1.DenseReluDense.wi_1"));
    assert_eq!(paths.last(), Some(&"encoder.final_layer_norm"));
    assert_eq!(c.leaves()[0].kind(), LeafKind::Embedding);
}

#[test]
fn random_weights_build_and_run() {
    // A small random T5 (non-gated relu, the original T5 layout) builds and runs in bf16.
    let config = T5Config {
        vocab_size: 64,
        d_model: 16,
        d_kv: 4,
        d_ff: 24,
        num_layers: 2,
        num_heads: 3,
        feed_forward_proj: "relu".into(),
        ..T5Config::t5_xxl()
    };
    let mut w = ddo_nn::RandomWeights::new(7, DType::BF16);
    let model = T5Encoder::build(&mut w, &config).expect("random T5");
    assert!(
        model
            .component()
            .leaf_by_path("encoder.block.1.layer.1.DenseReluDense.wi")
            .is_some()
    );
    let d = device();
    let _h = enable_dynamic_offload(model.component(), d.clone(), RouteSpec::resident())
        .expect("attach");
    let out = model.forward(&*d, &[5, 9, 1, 0]).expect("forward");
    assert_eq!(out.shape(), &[1, 4, 16]);
    assert_eq!(out.dtype(), DType::BF16);
    assert!(values(&*d, &out).iter().all(|v| v.is_finite()));
}

/// Every param 1.0 except the relative attention bias (0.0).
struct OnesWeights(DType);

impl WeightSource for OnesWeights {
    fn param(&mut self, name: &str, shape: &[usize], kind: ParamKind) -> LoadResult<Arc<Param>> {
        let n: usize = shape.iter().product();
        let v = if name.ends_with("relative_attention_bias.weight") {
            0.0
        } else {
            1.0
        };
        Ok(Param::from_f32(
            name,
            kind,
            self.0,
            shape.to_vec(),
            &vec![v; n],
        )?)
    }

    fn contains(&self, _name: &str) -> bool {
        true
    }
}

#[test]
fn f16_overflow_is_clamped_like_transformers() {
    // With every weight 1 and d_model = inner = 32, d_ff = 64: attention adds 32 * 32 and
    // the feed-forward 64 * gelu(32) * 32 = 65536 > f16 max, so the residual becomes inf;
    // T5Block clamps it to ±(65504 - 1000) and the final norm gives ones again.
    let config = T5Config {
        vocab_size: 8,
        d_model: 32,
        d_kv: 8,
        d_ff: 64,
        num_layers: 2,
        num_heads: 4,
        ..T5Config::t5_xxl()
    };
    for dtype in [DType::F16, DType::F32] {
        let model = T5Encoder::build(&mut OnesWeights(dtype), &config).expect("build");
        let d = device();
        let _h = enable_dynamic_offload(model.component(), d.clone(), RouteSpec::resident())
            .expect("attach");
        let out = values(&*d, &model.forward(&*d, &[1, 2, 3]).expect("forward"));
        assert!(
            out.iter().all(|v| (v - 1.0).abs() < 1e-2),
            "{dtype}: {:?}",
            &out[..4]
        );
    }
}

#[test]
fn half_precision_runs_close_to_f32() {
    let ids = input_ids();
    let want = run_with(&load(&fixture()), RouteSpec::resident(), &ids);
    for dtype in [DType::F16, DType::BF16] {
        let model = T5Encoder::from_dir(&fixture(), Some(dtype)).expect("load converted");
        let got = run_with(&model, RouteSpec::resident(), &ids);
        let err = rel_l2(&got, &want);
        assert!(err < 3e-2, "{dtype}: relative L2 error {err:e}");
    }
}

/// `--dtype fp8` on T5 (issue 18): the attention and feed-forward linears stored as scaled
/// fp8, the embeddings and norms as stored; compute in bf16 stays close to transformers' f32
/// output, and the streamed route gives the resident bytes.
#[test]
fn fp8_storage_casts_the_linears_and_keeps_the_embeddings() {
    let load8 = || T5Encoder::from_dir(&fixture(), Some(DType::F8E4M3)).expect("load fp8");
    let model = load8();
    for leaf in model.component().leaves() {
        for (name, p) in leaf.params() {
            let path = format!("{}.{name}", leaf.path());
            let linear = p.shape().len() == 2
                && !path.contains("shared")
                && !path.contains("embed_tokens")
                && !path.contains("relative_attention_bias");
            assert_eq!(p.dtype().is_fp8(), linear, "{path}");
        }
    }
    let ids = input_ids();
    let resident = run_with(&model, RouteSpec::resident(), &ids);
    let (_, want) = read_f32_tensor(&fixture().join("outputs.safetensors"), "last_hidden_state")
        .expect("fixture output");
    let err = rel_l2(&resident, &want);
    eprintln!("T5 in fp8 (bf16 compute): relative L2 {err:.3e} against transformers f32");
    assert!(err < 0.06, "{err:e}");
    let streamed = run_with(&load8(), RouteSpec::leaf_group(true, false), &ids);
    assert!(
        streamed
            .iter()
            .zip(&resident)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "streamed differs from resident"
    );
}
