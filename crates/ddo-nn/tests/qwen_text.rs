//! Qwen-Image's text encoder (Qwen2.5-VL's language model) against the `qwen_text_encoder`
//! fixture (`fixtures/MANIFEST.md`): f32 conformance of every layer and the last hidden
//! state, the rotary tables, the tokenizer's ids from both tokenizer layouts, Diffusers'
//! `encode_prompt` embeddings and masks, bit-identical output on every route, the weight
//! layouts (vision tower and `lm_head` skipped, legacy and 5.x names, shards), typed config,
//! tokenizer and input errors, and the parameter count at Qwen2.5-VL 7B's widths.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ddo_core::{
    AllocatorKind, CoreError, DType, Device, HostBuffer, Param, ParamKind, Placement, RouteSpec,
    Tensor, ops_of,
};
use ddo_host::{HostDevice, HostDeviceConfig};
use ddo_nn::qwen_text::{
    PROMPT_TEMPLATE_START_IDX, QwenPromptEncoder, QwenTextEncoder, QwenTextEncoderConfig,
    QwenTextInputs, QwenTokenizer, SKIPPED_PREFIXES, rope_tables,
};
use ddo_nn::{
    CheckpointWeights, LoadError, LoadResult, UnusedWeights, WeightSource, read_f32_tensor,
};
use ddo_routes::enable_dynamic_offload;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen_text_encoder")
}

fn fixture(file: &str, name: &str) -> (Vec<usize>, Vec<f32>) {
    read_f32_tensor(&fixture_dir().join(file), name).expect("fixture tensor")
}

fn prompts() -> Vec<String> {
    let text = std::fs::read_to_string(fixture_dir().join("prompts.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap().to_string())
        .collect()
}

/// The fixture's tokenizer call: two templated prompts, the first padded.
fn inputs() -> QwenTextInputs {
    let (shape, ids) = fixture("inputs.safetensors", "input_ids_f32");
    let (_, mask) = fixture("inputs.safetensors", "attention_mask_f32");
    QwenTextInputs::new(
        ids.iter().map(|&v| v as u32).collect(),
        Some(mask.iter().map(|&v| v as u32).collect()),
        shape[0],
    )
}

fn load() -> QwenTextEncoder {
    QwenTextEncoder::load(&fixture_dir().join("text_encoder"), None).expect("load fixture")
}

fn device() -> Arc<HostDevice> {
    HostDevice::with_capacity(1 << 30).expect("host device")
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
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

fn values(device: &dyn Device, t: &Tensor) -> Vec<f32> {
    ops_of(device).unwrap().to_f32_vec(t).unwrap()
}

/// `inputs` through `model` with its weights placed on a fresh host device (no route).
fn resident(model: &QwenTextEncoder, inputs: &QwenTextInputs) -> (Vec<usize>, Vec<u8>) {
    let d = device();
    model
        .component()
        .to_device(&*d, &d.compute_stream())
        .unwrap();
    let out = model.forward(&*d, inputs).unwrap();
    (out.shape().to_vec(), bytes(&*d, &out))
}

fn check(label: &str, ours: &[f32], want: &[f32]) -> f64 {
    let err = rel_l2(ours, want);
    eprintln!(
        "  {label}: relative L2 {err:.3e}, max abs diff {:.3e}",
        max_abs(ours, want)
    );
    assert!(err <= 1e-5, "{label}: relative L2 error {err:e} > 1e-5");
    err
}

#[test]
fn every_layer_and_the_last_hidden_state_match_transformers() {
    let model = load();
    assert_eq!(
        model.prefix(),
        "model",
        "the legacy names save_pretrained writes"
    );
    let d = device();
    model
        .component()
        .to_device(&*d, &d.compute_stream())
        .unwrap();
    let mut taps: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    let out = model
        .forward_with_taps(&*d, &inputs(), &mut |name, t| {
            taps.push((name.to_string(), t.shape().to_vec(), values(&*d, t)));
            Ok(())
        })
        .unwrap();
    let names: Vec<&str> = taps.iter().map(|(n, _, _)| n.as_str()).collect();
    assert_eq!(names, ["embed_tokens", "layers.0", "layers.1", "norm"]);
    let mut worst = 0.0f64;
    for (i, (name, shape, ours)) in taps.iter().enumerate() {
        let (ref_shape, want) = fixture(
            "intermediates.safetensors",
            &format!("model.language_model.{name}"),
        );
        assert_eq!(shape, &ref_shape, "{name}");
        worst = worst.max(check(name, ours, &want));
        // `hidden_states[i]`: the embeddings, each layer's output, the last one after the
        // final norm.
        let hs = if name == "norm" { i - 1 } else { i };
        if name != "layers.1" {
            let (_, want) = fixture("outputs.safetensors", &format!("hidden_states.{hs}"));
            check(&format!("hidden_states.{hs}"), ours, &want);
        }
    }
    let (shape, want) = fixture("outputs.safetensors", "last_hidden_state");
    assert_eq!(out.shape(), shape.as_slice());
    assert_eq!(out.shape(), [2, 79, 32]);
    let err = check("last_hidden_state", &values(&*d, &out), &want);
    eprintln!("qwen_text_encoder: last_hidden_state relative L2 {err:.3e}, worst tap {worst:.3e}");
}

#[test]
fn rotary_tables_match_transformers() {
    // `rotary_emb` gives [batch, seq, head_dim] in the rotate-half layout (pair j at
    // channels j and j + 4); ours are interleaved (channels 2j, 2j + 1) for the reordered heads.
    let config = QwenTextEncoderConfig::tiny();
    let hd = config.head_dim();
    for (k, name) in [
        "model.language_model.rotary_emb.0",
        "model.language_model.rotary_emb.1",
    ]
    .into_iter()
    .enumerate()
    {
        let (shape, want) = fixture("intermediates.safetensors", name);
        assert_eq!(shape, [2, 79, hd]);
        let (cos, sin) = rope_tables(79, hd, config.rope_theta);
        let ours = if k == 0 { &cos } else { &sin };
        let mut diff = 0.0f32;
        for b in 0..2 {
            for p in 0..79 {
                for j in 0..hd / 2 {
                    let row = &want[(b * 79 + p) * hd..(b * 79 + p + 1) * hd];
                    assert_eq!(row[j], row[j + hd / 2]);
                    diff = diff.max((ours[p * hd + 2 * j] - row[j]).abs());
                    assert_eq!(ours[p * hd + 2 * j], ours[p * hd + 2 * j + 1]);
                }
            }
        }
        eprintln!("{name}: max abs diff {diff:.3e}");
        assert!(diff <= 2e-7, "{name}: max abs diff {diff:e}");
    }
}

#[test]
fn both_tokenizer_layouts_give_the_pipeline_ids() {
    let want = inputs();
    let prompts = prompts();
    let refs: Vec<&str> = prompts.iter().map(String::as_str).collect();
    for folder in ["tokenizer", "tokenizer_json"] {
        let tokenizer = QwenTokenizer::from_dir(&fixture_dir().join(folder)).unwrap();
        assert_eq!(
            tokenizer.token_id("<|endoftext|>"),
            Some(tokenizer.pad_id())
        );
        let encoder = QwenPromptEncoder::new(load(), tokenizer);
        let got = encoder.tokenize(&refs).unwrap();
        assert_eq!(
            got, want,
            "{folder}: ids and mask as transformers' tokenizer gives them"
        );
    }
    let tokenizer = QwenTokenizer::from_dir(&fixture_dir().join("tokenizer")).unwrap();
    assert!(tokenizer.source().ends_with("vocab.json"));
    let json = QwenTokenizer::from_dir(&fixture_dir().join("tokenizer_json")).unwrap();
    assert!(json.source().ends_with("tokenizer.json"));
    // The template's system part is the 34 tokens the pipeline drops.
    let prefix = ddo_nn::qwen_text::PROMPT_TEMPLATE
        .split("{}")
        .next()
        .unwrap();
    assert_eq!(
        tokenizer.encode(prefix, 4096).unwrap().len(),
        PROMPT_TEMPLATE_START_IDX
    );
    // Truncation keeps the first tokens.
    let long = tokenizer.encode(&refs[1].repeat(3), 4096).unwrap();
    assert_eq!(
        tokenizer.encode(&refs[1].repeat(3), 10).unwrap(),
        long[..10]
    );
}

#[test]
fn encode_prompt_matches_diffusers() {
    let encoder = QwenPromptEncoder::load(&fixture_dir(), None).unwrap();
    let prompts = prompts();
    let refs: Vec<&str> = prompts.iter().map(String::as_str).collect();
    let d = device();
    encoder
        .encoder()
        .component()
        .to_device(&*d, &d.compute_stream())
        .unwrap();

    let out = encoder.encode_prompt(&*d, &refs, 1024).unwrap();
    let (shape, want) = fixture("outputs.safetensors", "prompt_embeds");
    assert_eq!(out.prompt_embeds.shape(), shape.as_slice());
    let ours = values(&*d, &out.prompt_embeds);
    check("prompt_embeds", &ours, &want);
    let (_, mask) = fixture("outputs.safetensors", "prompt_embeds_mask_f32");
    let want_mask: Vec<bool> = mask.iter().map(|&m| m != 0.0).collect();
    assert_eq!(out.prompt_embeds_mask.as_ref(), Some(&want_mask));
    assert_eq!(out.lengths, [11, 45]);
    // The padding is zeros, exactly.
    let hidden = shape[2];
    for (i, flag) in want_mask.iter().enumerate() {
        if !flag {
            assert!(ours[i * hidden..(i + 1) * hidden].iter().all(|&v| v == 0.0));
        }
    }

    // One prompt: its mask is all ones, which encode_prompt drops.
    let first = encoder.encode_prompt(&*d, &refs[..1], 1024).unwrap();
    let (shape, want) = fixture("outputs.safetensors", "prompt_embeds_first");
    assert_eq!(first.prompt_embeds.shape(), shape.as_slice());
    check(
        "prompt_embeds_first",
        &values(&*d, &first.prompt_embeds),
        &want,
    );
    assert_eq!(first.prompt_embeds_mask, None);

    // Cut to max_sequence_length = 8: both prompts fill it, so no mask.
    let short = encoder.encode_prompt(&*d, &refs, 8).unwrap();
    let (shape, want) = fixture("outputs.safetensors", "prompt_embeds_short");
    assert_eq!(short.prompt_embeds.shape(), shape.as_slice());
    check(
        "prompt_embeds_short",
        &values(&*d, &short.prompt_embeds),
        &want,
    );
    assert_eq!(
        (short.prompt_embeds_mask, short.lengths),
        (None, vec![8, 8])
    );

    // The tokenizer.json folder gives the same bytes.
    let json = QwenPromptEncoder::new(
        encoder.encoder().clone(),
        QwenTokenizer::from_dir(&fixture_dir().join("tokenizer_json")).unwrap(),
    );
    let again = json.encode_prompt(&*d, &refs, 1024).unwrap();
    assert_eq!(
        bytes(&*d, &again.prompt_embeds),
        bytes(&*d, &out.prompt_embeds)
    );

    for (prompts, msl) in [(&refs[..0], 1024), (&refs[..], 0), (&refs[..], 1025)] {
        assert!(
            matches!(
                encoder.encode_prompt(&*d, prompts, msl),
                Err(CoreError::InvalidOption { .. })
            ),
            "{} prompts, max_sequence_length {msl}",
            prompts.len()
        );
    }
}

#[test]
fn every_route_is_bit_identical_to_resident_execution() {
    let input = inputs();
    let (_, reference) = resident(&load(), &input);
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
        (
            "leaf_group(stream, 4 KiB units)",
            ddo_routes::parse_spec("diffusers_group_offload:use_stream=true,unit_bytes=4KiB")
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
                "budget between the largest leaf ({largest}) and the total ({total})"
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
                bytes(&*d, &out) == reference,
                "{label}: forward {pass} differs from resident execution"
            );
        }
        let snap = handle.metrics_snapshot();
        assert_eq!(snap.counters.forwards, 2, "{label}");
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
            "ddo-nn-qwen-text-{}-{}",
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

/// The fixture's text encoder rewritten into `dir`: every tensor renamed by `rename` (None
/// drops it) and put in the shard `shard` names, with an index when there are several.
fn rewritten(
    dir: &Path,
    rename: impl Fn(&str) -> Option<String>,
    shard: impl Fn(&str) -> &'static str,
) {
    let bytes = std::fs::read(fixture_dir().join("text_encoder/model.safetensors")).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut shards: std::collections::BTreeMap<
        &str,
        Vec<(String, safetensors::tensor::TensorView<'_>)>,
    > = Default::default();
    for (name, view) in file.tensors() {
        if let Some(new) = rename(&name) {
            shards.entry(shard(&new)).or_default().push((new, view));
        }
    }
    let mut weight_map = serde_json::Map::new();
    let several = shards.len() > 1;
    for (shard, tensors) in shards {
        for (name, _) in &tensors {
            weight_map.insert(name.clone(), shard.into());
        }
        std::fs::write(
            dir.join(shard),
            safetensors::serialize(tensors, None).unwrap(),
        )
        .unwrap();
    }
    if several {
        let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    }
    std::fs::copy(
        fixture_dir().join("text_encoder/config.json"),
        dir.join("config.json"),
    )
    .unwrap();
}

#[test]
fn the_vision_tower_and_lm_head_are_skipped_and_every_name_layout_loads() {
    let model = load();
    let c = model.component();
    assert_eq!(
        (c.name(), c.class_name()),
        ("text_encoder", "Qwen2_5_VLForConditionalGeneration")
    );
    let ours: BTreeSet<String> = c.named_params().into_iter().map(|(n, _)| n).collect();
    let weights = CheckpointWeights::open_dir(&fixture_dir().join("text_encoder"), None).unwrap();
    let all: Vec<&str> = weights.names();
    assert!(
        all.iter().any(|n| n.starts_with("visual.")),
        "the fixture has a vision tower"
    );
    assert!(all.contains(&"lm_head.weight"));
    let theirs: BTreeSet<String> = all
        .iter()
        .filter(|n| !SKIPPED_PREFIXES.iter().any(|p| n.starts_with(p)))
        .map(|n| n.to_string())
        .collect();
    assert_eq!(
        ours, theirs,
        "every language-model tensor is a param, under its name"
    );
    // The decoder layers are a block list below `model`, not at the root: Diffusers'
    // block-level grouping looks at the root's children only (here `model`), so no leaf
    // is placed in a block, as none of T5's is.
    for leaf in c.leaves() {
        assert_eq!(leaf.placement(), &Placement::Unmatched, "{}", leaf.path());
    }
    let leaves: Vec<String> = c.leaves().iter().map(|l| l.path().to_string()).collect();
    assert_eq!(
        leaves.first().map(String::as_str),
        Some("model.embed_tokens")
    );
    assert_eq!(
        leaves[1..10],
        [
            "model.layers.0.input_layernorm",
            "model.layers.0.self_attn.q_proj",
            "model.layers.0.self_attn.k_proj",
            "model.layers.0.self_attn.v_proj",
            "model.layers.0.self_attn.o_proj",
            "model.layers.0.post_attention_layernorm",
            "model.layers.0.mlp.gate_proj",
            "model.layers.0.mlp.up_proj",
            "model.layers.0.mlp.down_proj",
        ],
        "leaves in the order the forward runs them"
    );
    assert_eq!(leaves.last().map(String::as_str), Some("model.norm"));
    let reference = resident(&model, &inputs()).1;

    // transformers 5.x module names, the vision tower under `model.visual.`, in a shard of
    // its own (opened through the index, never read).
    let dir = TempDir::new();
    rewritten(
        &dir.0,
        |n| {
            Some(if let Some(rest) = n.strip_prefix("visual.") {
                format!("model.visual.{rest}")
            } else if let Some(rest) = n.strip_prefix("model.") {
                format!("model.language_model.{rest}")
            } else {
                n.to_string()
            })
        },
        |n| {
            if n.starts_with("model.visual.") {
                "model-00002-of-00002.safetensors"
            } else {
                "model-00001-of-00002.safetensors"
            }
        },
    );
    let modern = QwenTextEncoder::load(&dir.0, None).unwrap();
    assert_eq!(modern.prefix(), "model.language_model");
    assert_eq!(resident(&modern, &inputs()).1, reference);

    // A bare text model (no prefix, no vision tower, no head).
    let dir = TempDir::new();
    rewritten(
        &dir.0,
        |n| n.strip_prefix("model.").map(str::to_string),
        |_| "model.safetensors",
    );
    let bare = QwenTextEncoder::load(&dir.0, None).unwrap();
    assert_eq!(bare.prefix(), "");
    assert_eq!(resident(&bare, &inputs()).1, reference);

    // A tensor no layer uses (outside the skipped parts) is refused, unless allowed.
    let dir = TempDir::new();
    rewritten(
        &dir.0,
        |n| Some(n.replace("model.norm.weight", "model.extra_norm.weight")),
        |_| "model.safetensors",
    );
    assert!(matches!(
        QwenTextEncoder::load(&dir.0, None),
        Err(LoadError::MissingTensor { .. })
    ));
    let dir = TempDir::new();
    rewritten(
        &dir.0,
        |n| Some(n.replace("lm_head.weight", "model.lm_head_copy.weight")),
        |_| "model.safetensors",
    );
    match QwenTextEncoder::load(&dir.0, None) {
        Err(LoadError::UnusedWeights {
            count, examples, ..
        }) => {
            assert_eq!(count, 1);
            assert!(examples.contains("model.lm_head_copy.weight"), "{examples}");
        }
        other => panic!("expected UnusedWeights, got {other:?}"),
    }
    assert!(QwenTextEncoder::load_checked(&dir.0, None, UnusedWeights::Allow).is_ok());
}

#[test]
fn fp8_storage_casts_the_linears_only() {
    let fp8 =
        QwenTextEncoder::load(&fixture_dir().join("text_encoder"), Some(DType::F8E4M3)).unwrap();
    for (name, p) in fp8.component().named_params() {
        let linear = name.contains("_proj.weight");
        assert_eq!(
            p.dtype() == DType::F8E4M3,
            linear,
            "{name}: {:?}",
            p.dtype()
        );
    }
    let d = device();
    fp8.component().to_device(&*d, &d.compute_stream()).unwrap();
    let out = fp8.forward(&*d, &inputs()).unwrap();
    let (_, want) = fixture("outputs.safetensors", "last_hidden_state");
    let err = rel_l2(&values(&*d, &out), &want);
    eprintln!("fp8 storage: last_hidden_state relative L2 {err:.3e}");
    assert!(err < 0.1, "fp8 relative L2 {err}");
}

fn tokenizer_err(dir: &Path) -> LoadError {
    QwenTokenizer::from_dir(dir).expect_err("a typed error")
}

#[test]
fn a_missing_or_broken_tokenizer_is_a_typed_error_naming_the_path() {
    // A pipeline folder without `tokenizer/`.
    let dir = TempDir::new();
    std::fs::create_dir_all(dir.0.join("text_encoder")).unwrap();
    match QwenPromptEncoder::load(&dir.0, None) {
        Err(LoadError::NoTokenizer {
            dir: missing,
            expected,
        }) => {
            assert_eq!(missing, dir.0.join("tokenizer"));
            assert!(expected.contains("tokenizer.json"), "{expected}");
        }
        other => panic!("expected NoTokenizer, got {other:?}"),
    }
    let message = tokenizer_err(&dir.0.join("tokenizer")).to_string();
    assert!(
        message.contains(&dir.0.join("tokenizer").display().to_string()),
        "{message}"
    );

    // vocab.json without merges.txt is no tokenizer either.
    let tok = dir.0.join("tokenizer");
    std::fs::create_dir_all(&tok).unwrap();
    std::fs::copy(
        fixture_dir().join("tokenizer/vocab.json"),
        tok.join("vocab.json"),
    )
    .unwrap();
    assert!(matches!(tokenizer_err(&tok), LoadError::NoTokenizer { .. }));

    // A broken tokenizer.json names the file.
    std::fs::write(tok.join("tokenizer.json"), "{\"model\": 3}").unwrap();
    match tokenizer_err(&tok) {
        LoadError::Tokenizer { path, .. } => assert_eq!(path, tok.join("tokenizer.json")),
        other => panic!("expected Tokenizer, got {other:?}"),
    }
    std::fs::remove_file(tok.join("tokenizer.json")).unwrap();

    // merges.txt with a line that is not a pair.
    std::fs::write(tok.join("merges.txt"), "#version: 0.2\nĠ t\nlonely\n").unwrap();
    match tokenizer_err(&tok) {
        LoadError::Tokenizer { path, message } => {
            assert_eq!(path, tok.join("merges.txt"));
            assert!(message.contains("lonely"), "{message}");
        }
        other => panic!("expected Tokenizer, got {other:?}"),
    }
    // A tokenizer.json without the pad token the config names (from vocab.json +
    // merges.txt, transformers adds a missing special token instead), and a padding side
    // that is neither.
    let json_dir = dir.0.join("tokenizer_json");
    std::fs::create_dir_all(&json_dir).unwrap();
    std::fs::copy(
        fixture_dir().join("tokenizer_json/tokenizer.json"),
        json_dir.join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(
        json_dir.join("tokenizer_config.json"),
        r#"{"pad_token": "<pad>"}"#,
    )
    .unwrap();
    match tokenizer_err(&json_dir) {
        LoadError::Tokenizer { path, message } => {
            assert_eq!(path, json_dir.join("tokenizer.json"));
            assert!(message.contains("<pad>"), "{message}");
        }
        other => panic!("expected Tokenizer, got {other:?}"),
    }
    std::fs::copy(
        fixture_dir().join("tokenizer/merges.txt"),
        tok.join("merges.txt"),
    )
    .unwrap();
    std::fs::write(
        tok.join("tokenizer_config.json"),
        r#"{"pad_token": "!", "padding_side": "middle"}"#,
    )
    .unwrap();
    match tokenizer_err(&tok) {
        LoadError::Tokenizer { path, .. } => assert_eq!(path, tok.join("tokenizer_config.json")),
        other => panic!("expected Tokenizer, got {other:?}"),
    }
    std::fs::write(tok.join("tokenizer_config.json"), "{not json").unwrap();
    assert!(matches!(tokenizer_err(&tok), LoadError::Tokenizer { .. }));

    // Left padding, as a tokenizer_config may ask: the pad tokens go first.
    std::fs::copy(
        fixture_dir().join("tokenizer/tokenizer_config.json"),
        tok.join("tokenizer_config.json"),
    )
    .unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tok.join("tokenizer_config.json")).unwrap())
            .unwrap();
    config["padding_side"] = "left".into();
    std::fs::write(tok.join("tokenizer_config.json"), config.to_string()).unwrap();
    let left = QwenTokenizer::from_dir(&tok).unwrap();
    let batch = left
        .encode_batch(&["a".to_string(), "a red fox".to_string()], 64)
        .unwrap();
    assert_eq!(batch.seq_len(), 3);
    assert_eq!(batch.attention_mask, Some(vec![0, 0, 1, 1, 1, 1]));
    assert_eq!(batch.input_ids[..2], [left.pad_id(); 2]);
}

#[test]
fn config_reads_both_layouts_and_refuses_what_ddo_cannot_run() {
    let fixture =
        QwenTextEncoderConfig::from_file(&fixture_dir().join("text_encoder/config.json")).unwrap();
    assert_eq!(
        fixture,
        QwenTextEncoderConfig::tiny(),
        "the fixture is qwen-text-tiny"
    );
    assert_eq!(
        (fixture.head_dim(), fixture.kv_groups(), fixture.kv_dim()),
        (8, 2, 16)
    );
    for name in QwenTextEncoderConfig::NAMES {
        assert!(QwenTextEncoderConfig::named(name).is_some(), "{name}");
    }
    assert_eq!(QwenTextEncoderConfig::named("qwen-image"), None);

    let origin = Path::new("config.json");
    // Qwen2.5-VL 7B's text fields at the top level, with `rope_scaling` of type `mrope`
    // (the layout of configs written before transformers 5), and the vision config beside.
    let flat = r#"{"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "hidden_act": "silu", "hidden_size": 3584, "intermediate_size": 18944,
        "max_position_embeddings": 128000, "max_window_layers": 28, "num_attention_heads": 28,
        "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
        "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
        "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": false,
        "use_sliding_window": false, "vocab_size": 152064,
        "vision_config": {"depth": 32, "hidden_size": 1280, "out_hidden_size": 3584}}"#;
    let seven = QwenTextEncoderConfig::parse(flat, origin).unwrap();
    assert_eq!(seven, QwenTextEncoderConfig::qwen2_5_vl_7b());
    // The same under `text_config` with 5.x's `rope_parameters`; top-level fields are then
    // ignored, as transformers 5 ignores them.
    let nested = r#"{"hidden_size": 1, "text_config": {"hidden_act": "silu", "hidden_size": 3584,
        "intermediate_size": 18944, "max_position_embeddings": 128000, "num_attention_heads": 28,
        "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
        "rope_parameters": {"mrope_section": [16, 24, 24], "rope_theta": 1000000.0, "rope_type": "default"},
        "vocab_size": 152064}}"#;
    assert_eq!(QwenTextEncoderConfig::parse(nested, origin).unwrap(), seven);
    // Missing fields are Qwen2_5_VLTextConfig's defaults; `num_key_value_heads: null` is one
    // kv head per query head.
    let defaults = QwenTextEncoderConfig::parse("{}", origin).unwrap();
    assert_eq!(defaults, QwenTextEncoderConfig::default());
    assert_eq!(defaults.num_key_value_heads, 8);
    let null_kv = QwenTextEncoderConfig::parse(r#"{"num_key_value_heads": null}"#, origin).unwrap();
    assert_eq!(null_kv.num_key_value_heads, null_kv.num_attention_heads);

    let field_of = |text: &str| match QwenTextEncoderConfig::parse(text, origin) {
        Err(LoadError::InvalidConfig { field, hint, .. }) => {
            assert!(!hint.is_empty());
            field
        }
        other => panic!("expected InvalidConfig for {text}, got {other:?}"),
    };
    assert_eq!(
        field_of(r#"{"num_key_value_heads": 3}"#),
        "num_key_value_heads"
    );
    assert_eq!(
        field_of(r#"{"num_key_value_heads": 0}"#),
        "num_key_value_heads"
    );
    assert_eq!(field_of(r#"{"hidden_size": 100}"#), "num_attention_heads");
    assert_eq!(
        field_of(r#"{"hidden_size": 96, "num_attention_heads": 32, "num_key_value_heads": 8}"#),
        "num_attention_heads",
        "an odd head width"
    );
    assert_eq!(field_of(r#"{"vocab_size": 0}"#), "vocab_size");
    assert_eq!(
        field_of(r#"{"use_sliding_window": true}"#),
        "use_sliding_window"
    );
    assert_eq!(
        field_of(r#"{"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}"#),
        "rope_parameters.rope_type"
    );
    assert_eq!(
        field_of(r#"{"rope_scaling": {"type": "dynamic"}}"#),
        "rope_parameters.rope_type"
    );
    assert_eq!(
        field_of(r#"{"text_config": {"rope_parameters": {"mrope_section": [16, 24, 25]}}}"#),
        "rope_parameters.mrope_section"
    );
    assert_eq!(field_of(r#"{"rope_theta": -1.0}"#), "rope_theta");
    assert_eq!(field_of(r#"{"rms_norm_eps": -1.0}"#), "rms_norm_eps");
    assert_eq!(field_of(r#"{"hidden_act": "mish"}"#), "hidden_act");
    for text in [
        "{not json",
        r#"{"hidden_size": "wide"}"#,
        r#"{"num_key_value_heads": -2}"#,
    ] {
        assert!(
            matches!(
                QwenTextEncoderConfig::parse(text, origin),
                Err(LoadError::Config { .. })
            ),
            "{text}"
        );
    }
    assert!(matches!(
        QwenTextEncoderConfig::from_file(&fixture_dir().join("missing.json")),
        Err(LoadError::Io { .. })
    ));
}

#[test]
fn inputs_that_do_not_fit_are_typed_errors() {
    let model = load();
    let d = device();
    model
        .component()
        .to_device(&*d, &d.compute_stream())
        .unwrap();
    let run = |inputs: QwenTextInputs| model.forward(&*d, &inputs).unwrap_err();
    assert!(matches!(
        run(QwenTextInputs::single(vec![1, 416])),
        CoreError::InvalidOption { option, .. } if option == "input_ids"
    ));
    assert!(matches!(
        run(QwenTextInputs::single(vec![])),
        CoreError::Shape { .. }
    ));
    assert!(matches!(
        run(QwenTextInputs::new(vec![1, 2, 3], None, 2)),
        CoreError::Shape { .. }
    ));
    assert!(matches!(
        run(QwenTextInputs::new(vec![1, 2], Some(vec![1]), 1)),
        CoreError::Shape { what, .. } if what == "attention_mask"
    ));
    assert!(matches!(
        run(QwenTextInputs::new(vec![1, 2], Some(vec![1, 2]), 1)),
        CoreError::InvalidOption { option, .. } if option == "attention_mask"
    ));
    // The component's own entry point takes one row of ids as f32.
    let ids = Tensor::from_f32(vec![1, 3], DType::F32, &[5.0, 6.0, 7.0]).unwrap();
    let out = model.component().forward(&*d, ids).unwrap();
    let plain = model
        .forward(&*d, &QwenTextInputs::single(vec![5, 6, 7]))
        .unwrap();
    assert_eq!(bytes(&*d, &out), bytes(&*d, &plain));
    // A mask of ones is no mask.
    let ones = model
        .forward(
            &*d,
            &QwenTextInputs::new(vec![5, 6, 7], Some(vec![1, 1, 1]), 1),
        )
        .unwrap();
    assert_eq!(bytes(&*d, &ones), bytes(&*d, &plain));
    // Padding on the right leaves the real tokens' states as they are alone (causal).
    let padded = model
        .forward(
            &*d,
            &QwenTextInputs::new(vec![5, 6, 7, 0, 0], Some(vec![1, 1, 1, 0, 0]), 1),
        )
        .unwrap();
    let v = values(&*d, &padded);
    assert!(rel_l2(&v[..3 * 32], &values(&*d, &plain)) < 1e-6);
}

/// Qwen2.5-VL 7B's language model has 7,070,619,136 params and 233,057,792 per decoder
/// layer: the fixture venv's transformers 5.24 (`.venv-fixtures/bin/python`), `with
/// torch.device("meta"): m = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(vocab_size=152064,
/// hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
/// num_key_value_heads=4, ...))`, then `sum(p.numel() for p in m.parameters())` (and for
/// `m.layers[0]`). The vision tower and `lm_head` come on top in the checkpoint.
const QWEN2_5_VL_7B_TEXT_PARAMS: u64 = 7_070_619_136;

/// bf16 params that all view one shared zeroed buffer: a model at full widths builds at once.
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
fn qwen2_5_vl_7b_widths_build_in_bf16_and_count_params() {
    let full = QwenTextEncoderConfig::qwen2_5_vl_7b();
    assert_eq!(full.param_count(), QWEN2_5_VL_7B_TEXT_PARAMS);
    assert_eq!(full.layer_params(), 233_057_792);
    let one = QwenTextEncoderConfig {
        num_hidden_layers: 1,
        ..full.clone()
    };
    let mut zeros = ZeroWeights {
        zeros: HostBuffer::pageable_zeroed(0),
    };
    let model = QwenTextEncoder::build(&mut zeros, &one).unwrap();
    let counted: u64 = model
        .component()
        .leaves()
        .iter()
        .flat_map(|l| {
            l.params()
                .iter()
                .map(|(_, p)| p.shape().iter().product::<usize>() as u64)
                .collect::<Vec<_>>()
        })
        .sum();
    assert_eq!(counted, one.param_count());
    assert_eq!(
        counted + 27 * full.layer_params(),
        QWEN2_5_VL_7B_TEXT_PARAMS
    );
}

/// Random weights at Qwen2.5-VL's head width and grouping (fewer heads and layers): bf16
/// runs close to the same weights in f32, and is seeded.
#[test]
fn random_bf16_model_runs_close_to_f32() {
    let config = QwenTextEncoderConfig {
        vocab_size: 512,
        hidden_size: 256,
        intermediate_size: 512,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        mrope_section: Some(vec![16, 24, 24]),
        ..QwenTextEncoderConfig::qwen2_5_vl_7b()
    };
    let inputs = QwenTextInputs::new(
        (0..20).map(|i| (i * 37 % 512) as u32).collect(),
        Some((0..20).map(|i| u32::from(i < 10 || i % 10 < 7)).collect()),
        2,
    );
    let run = |dtype: DType| {
        let model = QwenTextEncoder::random(&config, 5, dtype).unwrap();
        let d = device();
        model
            .component()
            .to_device(&*d, &d.compute_stream())
            .unwrap();
        let out = model.forward(&*d, &inputs).unwrap();
        assert_eq!((out.shape(), out.dtype()), ([2, 10, 256].as_slice(), dtype));
        values(&*d, &out)
    };
    let f32_out = run(DType::F32);
    let bf16_out = run(DType::BF16);
    let err = rel_l2(&bf16_out, &f32_out);
    eprintln!("random qwen text widths: bf16 vs f32 relative L2 {err:.3e}");
    assert!(err < 0.05, "bf16 vs f32 relative L2 {err}");
    assert_eq!(run(DType::F32), f32_out, "seeded");
}
