//! The Qwen-Image pipeline against Diffusers' `QwenImagePipeline` (`fixtures/qwen_pipeline`,
//! see `fixtures/MANIFEST.md`): the schedule, the packed latents after a 3-step true-CFG loop
//! and the decoded image from the same weights, embeddings and noise, run through
//! `run_phases` on resident and offloaded routes; the phase boundaries (three phases, the
//! transformer released before the decode); one transformer pass per step without true CFG;
//! prompts from text (the stand-in ids, and the fixture tokenizer with the fixture text
//! encoder); the memory planner's demands; and typed errors for bad requests and folders.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ddo_core::{CoreError, DType, Device, Preset, RouteSpec, Settings, Tensor};
use ddo_host::HostDevice;
use ddo_nn::pipeline::{
    InitLatents, PipelineKind, PipelineRun, QwenImagePipeline, QwenImagePipelineConfig,
    QwenImageRequest, QwenPromptInput, TiledDecode, stand_in_ids,
};
use ddo_nn::qwen_text::QwenPromptEmbeds;
use ddo_nn::scheduler::FlowMatchEulerConfig;
use ddo_nn::{LoadError, UnusedWeights, read_f32_tensor};
use ddo_routes::enable_pipeline_offload_with_env;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

fn dir() -> PathBuf {
    fixtures().join("qwen_pipeline")
}

fn fixture(file: &str, name: &str) -> (Vec<usize>, Vec<f32>) {
    read_f32_tensor(&dir().join(file), name).expect("fixture tensor")
}

fn host(file: &str, name: &str) -> Tensor {
    let (shape, values) = fixture(file, name);
    Tensor::from_f32(shape, DType::F32, &values).expect("host tensor")
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

fn device() -> Arc<HostDevice> {
    HostDevice::with_capacity(1 << 30).expect("host device")
}

fn settings(preset: Preset, route: Option<&str>) -> Settings {
    let mut s = Settings {
        preset,
        ..Settings::default()
    };
    if let Some(r) = route {
        let spec: RouteSpec = ddo_routes::parse_spec(r).unwrap();
        for name in ["text_encoder", "transformer", "vae"] {
            s.component_policies.insert(name.into(), spec);
        }
    }
    s
}

fn embeds(name: &str) -> QwenPromptInput {
    let e = host("inputs.safetensors", name);
    let (_, mask) = fixture("inputs.safetensors", &format!("{name}_mask"));
    let mask: Vec<bool> = mask.iter().map(|&m| m != 0.0).collect();
    let lengths = vec![mask.iter().filter(|&&m| m).count()];
    QwenPromptInput::Embeddings(QwenPromptEmbeds {
        prompt_embeds: e,
        prompt_embeds_mask: Some(mask),
        lengths,
    })
}

fn fixture_request() -> QwenImageRequest {
    QwenImageRequest {
        prompt: embeds("prompt_embeds"),
        negative_prompt: Some(embeds("negative_prompt_embeds")),
        true_cfg_scale: 4.0,
        steps: 3,
        height: 32,
        width: 48,
        init: InitLatents::Given(host("inputs.safetensors", "latents")),
        num_images: 1,
        tiled_decode: TiledDecode::Off,
        vram_budget: None,
        release_native_idle_cache: false,
        cancel: None,
    }
}

fn run(
    pipe: &QwenImagePipeline,
    device: Arc<dyn Device>,
    settings: &Settings,
    request: &QwenImageRequest,
) -> PipelineRun {
    let pipeline = pipe.offload_pipeline().unwrap();
    let env = ddo_core::MapEnvironment::default();
    let mut offload = enable_pipeline_offload_with_env(&pipeline, device, settings, &env).unwrap();
    let mut steps = 0;
    let run = pipe
        .run_phases(&mut offload, request, &mut |phase, _, _| {
            if phase == "denoise" {
                steps += 1;
            }
        })
        .unwrap();
    assert_eq!(steps, request.steps);
    run
}

fn load() -> QwenImagePipeline {
    QwenImagePipeline::load_checked(&dir(), None, UnusedWeights::Refuse).unwrap()
}

#[test]
fn latents_and_image_match_diffusers_qwen_image_pipeline() {
    assert_eq!(
        PipelineKind::detect(&dir()).unwrap(),
        PipelineKind::QwenImage
    );
    let pipe = load();
    assert_eq!(pipe.vae_scale_factor(), 4);
    assert!(pipe.text_encoder.is_none() && pipe.tokenizer.is_none());
    assert_eq!(pipe.scheduler, FlowMatchEulerConfig::qwen_image());
    assert_eq!(pipe.component_names(), ["transformer", "vae"]);
    let request = fixture_request();
    let run = run(
        &pipe,
        device(),
        &settings(Preset::Auto, Some("none")),
        &request,
    );

    let (_, t_ref) = fixture("outputs.safetensors", "timesteps");
    let dt = run
        .timesteps
        .iter()
        .zip(&t_ref)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    eprintln!(
        "qwen_pipeline timesteps {:?} (max |diff| {dt:e})",
        run.timesteps
    );
    assert_eq!(run.timesteps, t_ref, "timesteps");

    let (shape, reference) = fixture("outputs.safetensors", "latents");
    assert_eq!(run.latents.shape(), &shape[..]);
    let err_latents = rel_l2(&run.latents.host_f32().unwrap(), &reference);
    let (shape, reference) = fixture("outputs.safetensors", "image");
    assert_eq!(run.image.shape(), &shape[..]);
    let err_image = rel_l2(&run.image.host_f32().unwrap(), &reference);
    eprintln!(
        "qwen_pipeline (3 steps, true CFG 4, 32x48): relative L2 latents {err_latents:.3e}, \
         image {err_image:.3e}"
    );
    assert!(err_latents <= 1e-5, "latents relative L2 {err_latents:e}");
    assert!(err_image <= 1e-5, "image relative L2 {err_image:e}");
    assert!(!run.decode.tiled);

    // Three phases; the transformer is released before the decode, and after it nothing
    // is left on the device.
    let names: Vec<&str> = run.phases.iter().map(|p| p.phase.as_str()).collect();
    assert_eq!(names, ["prompt_encoding", "denoise", "decode"]);
    let note = |i: usize| run.phases[i].note.clone().unwrap_or_default();
    assert!(note(0).contains("embeddings given"), "{}", note(0));
    assert!(
        note(1).contains("2 transformer passes per step, 6 in all"),
        "{}",
        note(1)
    );
    let ends: Vec<u64> = run
        .phases
        .iter()
        .map(|p| p.peak.allocator_end_bytes)
        .collect();
    let transformer = pipe.transformer.component().param_bytes();
    let vae = pipe.vae.component().param_bytes();
    assert_eq!(ends, [transformer + vae, vae, 0], "{:?}", run.phases);
    assert_eq!(run.phases[1].components, ["transformer: none"]);
    assert_eq!(run.phases[2].components, ["vae: none"]);
    assert!(run.phases[2].peak.allocator_peak_bytes >= vae);

    // The memory planner's demands bound what the phases took beside their weights.
    let d = device();
    let demands = pipe
        .phase_demands(32, 48, 1, TiledDecode::Off, 1 << 30, &*d)
        .unwrap();
    let phases: Vec<&str> = demands.iter().map(|p| p.phase.as_str()).collect();
    assert_eq!(phases, names);
    assert_eq!(demands[1].components, ["transformer"]);
    let denoise_peak = run.phases[1].peak.allocator_peak_bytes - transformer - vae;
    assert!(
        demands[1].activation_bytes >= denoise_peak,
        "denoise estimate {} < measured {denoise_peak}",
        demands[1].activation_bytes
    );
    let decode_peak = run.phases[2].peak.allocator_peak_bytes - vae;
    assert!(
        demands[2].activation_bytes >= decode_peak,
        "decode estimate {} < measured {decode_peak}",
        demands[2].activation_bytes
    );
    pipe.prepare_attention(&*d, 32, 48, 1).unwrap();
}

#[test]
fn without_true_cfg_each_step_runs_one_pass() {
    let pipe = load();
    let mut request = fixture_request();
    request.true_cfg_scale = 1.0; // a negative prompt, but no true CFG (Diffusers: scale <= 1)
    assert!(!request.does_true_cfg());
    let one = run(&pipe, device(), &settings(Preset::Auto, None), &request);
    let note = one.phases[1].note.clone().unwrap_or_default();
    assert!(
        note.contains("1 transformer pass per step, 3 in all"),
        "{note}"
    );
    let (_, reference) = fixture("outputs.safetensors", "latents_no_cfg");
    let err = rel_l2(&one.latents.host_f32().unwrap(), &reference);
    let (_, reference) = fixture("outputs.safetensors", "image_no_cfg");
    let err_image = rel_l2(&one.image.host_f32().unwrap(), &reference);
    eprintln!(
        "qwen_pipeline without true CFG: relative L2 latents {err:.3e}, image {err_image:.3e}"
    );
    assert!(err <= 1e-5 && err_image <= 1e-5, "{err:e} {err_image:e}");
    // No negative prompt at scale 4: the same single pass.
    request.true_cfg_scale = 4.0;
    request.negative_prompt = None;
    let none = run(&pipe, device(), &settings(Preset::Auto, None), &request);
    assert_eq!(
        none.latents.host_f32().unwrap(),
        one.latents.host_f32().unwrap()
    );
    assert!(none.phases[1].note.as_deref().unwrap().contains("3 in all"));
}

#[test]
fn offloaded_routes_give_the_resident_result_bit_for_bit() {
    let pipe = load();
    let request = fixture_request();
    let resident = run(
        &pipe,
        device(),
        &settings(Preset::Auto, Some("none")),
        &request,
    );
    for (label, s) in [
        ("auto preset", settings(Preset::Auto, None)),
        ("low_ram_safe", settings(Preset::LowRamSafe, None)),
        (
            "linear_convolution",
            settings(Preset::Auto, Some("linear_convolution")),
        ),
        ("off (unmanaged)", settings(Preset::Off, None)),
    ] {
        let other = run(&pipe, device(), &s, &request);
        assert_eq!(
            other.latents.host_f32().unwrap(),
            resident.latents.host_f32().unwrap(),
            "{label}"
        );
        assert_eq!(
            other.image.host_f32().unwrap(),
            resident.image.host_f32().unwrap(),
            "{label}"
        );
        // Every component is released at the end of its phase.
        assert_eq!(other.phases[1].peak.allocator_end_bytes, 0, "{label}");
        assert_eq!(other.phases[2].peak.allocator_end_bytes, 0, "{label}");
        assert_eq!(other.phases.len(), 3, "{label}");
    }
}

#[test]
fn text_prompts_run_through_the_text_encoder_with_the_stand_in_ids() {
    let config = QwenImagePipelineConfig::tiny();
    let pipe = QwenImagePipeline::random(&config, 3, DType::F32).unwrap();
    assert_eq!(
        pipe.component_names(),
        ["text_encoder", "transformer", "vae"]
    );
    let ids = stand_in_ids(&config.text_encoder, "A cat, 3D!");
    assert_eq!(ids.len(), 37 + 5 + 5);
    assert_eq!(ids[..37], (0..37).collect::<Vec<u32>>()[..]);
    let mut request = fixture_request();
    request.prompt = QwenPromptInput::Text("a photo of a cat".into());
    request.negative_prompt = Some(QwenPromptInput::Text(" ".into()));
    request.init = InitLatents::Seed(42);
    request.steps = 2;
    let a = run(&pipe, device(), &settings(Preset::Auto, None), &request);
    assert!(a.phases[0].note.is_none());
    assert_eq!(a.phases[0].components.len(), 1);
    assert!(a.phases[0].peak.allocator_peak_bytes > 0);
    assert_eq!(a.phases[0].peak.allocator_end_bytes, 0);
    let b = run(&pipe, device(), &settings(Preset::Auto, None), &request);
    assert_eq!(a.image.host_f32().unwrap(), b.image.host_f32().unwrap());
    request.prompt = QwenPromptInput::Text("a photo of a dog".into());
    let c = run(&pipe, device(), &settings(Preset::Auto, None), &request);
    assert_ne!(a.image.host_f32().unwrap(), c.image.host_f32().unwrap());
    assert!(a.image.host_f32().unwrap().iter().all(|v| v.is_finite()));
    // Two images per prompt: each its own noise, the first that of one image.
    request.num_images = 2;
    let two = run(&pipe, device(), &settings(Preset::Auto, None), &request);
    assert_eq!(two.image.shape(), [2, 3, 32, 48]);
    let first = &two.image.host_f32().unwrap()[..3 * 32 * 48];
    assert_eq!(first, &c.image.host_f32().unwrap()[..]);
}

#[test]
fn auto_decode_tiles_when_the_budget_leaves_too_little() {
    let pipe = QwenImagePipeline::random(&QwenImagePipelineConfig::tiny(), 5, DType::F32).unwrap();
    let mut request = fixture_request();
    request.prompt = QwenPromptInput::Text("a lighthouse".into());
    request.negative_prompt = None;
    request.height = 384;
    request.width = 384;
    request.init = InitLatents::Seed(1);
    request.steps = 2;
    request.tiled_decode = TiledDecode::Auto;
    let roomy = run(&pipe, device(), &settings(Preset::Auto, None), &request);
    assert!(!roomy.decode.tiled, "{}", roomy.decode.reason);
    // The text encoder's demand bounds its phase beside its weights.
    let d = device();
    let demands = pipe
        .phase_demands(384, 384, 1, TiledDecode::Auto, 1 << 30, &*d)
        .unwrap();
    assert_eq!(demands[0].components, ["text_encoder"]);
    let text_weights = pipe
        .text_encoder
        .as_ref()
        .unwrap()
        .component()
        .param_bytes();
    let measured = roomy.phases[0].peak.allocator_peak_bytes;
    assert!(
        demands[0].activation_bytes + text_weights >= measured,
        "text encoder estimate {} + weights {text_weights} < measured {measured}",
        demands[0].activation_bytes
    );
    let untiled = roomy.decode.estimate_untiled_bytes;
    request.vram_budget = Some(untiled * 3 / 4);
    let tight = run(&pipe, device(), &settings(Preset::Auto, None), &request);
    assert!(tight.decode.tiled, "{}", tight.decode.reason);
    assert!(tight.decode.qwen_tiling.is_some());
    assert!(tight.phases[2].note.as_deref().unwrap().contains("tiled"));
    assert!(
        tight.phases[2].peak.allocator_peak_bytes < roomy.phases[2].peak.allocator_peak_bytes,
        "tiled {} vs untiled {}",
        tight.phases[2].peak.allocator_peak_bytes,
        roomy.phases[2].peak.allocator_peak_bytes
    );
    // The same denoise; the tiled image close to the untiled one.
    assert_eq!(
        tight.latents.host_f32().unwrap(),
        roomy.latents.host_f32().unwrap()
    );
    let err = rel_l2(
        &tight.image.host_f32().unwrap(),
        &roomy.image.host_f32().unwrap(),
    );
    eprintln!("qwen tiled vs untiled decode at 384x384: relative L2 {err:.3e}");
    assert!(err < 0.05, "{err}");
    // A budget that holds neither is refused naming one that would do.
    request.vram_budget = Some(1 << 10);
    let pipeline = pipe.offload_pipeline().unwrap();
    let env = ddo_core::MapEnvironment::default();
    let mut offload =
        enable_pipeline_offload_with_env(&pipeline, d, &settings(Preset::Auto, None), &env)
            .unwrap();
    let e = pipe
        .run_phases(&mut offload, &request, &mut |_, _, _| {})
        .unwrap_err();
    assert!(
        matches!(&e, CoreError::DecodeDoesNotFit { hint, .. } if hint.contains("--vram-budget")),
        "{e}"
    );
}

#[test]
fn a_folder_with_the_fixture_text_encoder_encodes_prompts_as_diffusers() {
    let tmp = TempDir::new();
    copy_tree(&dir(), &tmp.0);
    let text = fixtures().join("qwen_text_encoder");
    copy_tree(&text.join("text_encoder"), &tmp.0.join("text_encoder"));
    copy_tree(&text.join("tokenizer"), &tmp.0.join("tokenizer"));
    let pipe = QwenImagePipeline::load_checked(&tmp.0, None, UnusedWeights::Refuse).unwrap();
    assert!(pipe.tokenizer.is_some());
    let d = device();
    let encoder = pipe.text_encoder.as_ref().unwrap().component();
    encoder.to_device(&*d, &d.compute_stream()).unwrap();
    let e = pipe.encode_prompt(&*d, "A red fox in the snow").unwrap();
    let (shape, want) =
        read_f32_tensor(&text.join("outputs.safetensors"), "prompt_embeds_first").unwrap();
    assert_eq!(e.prompt_embeds.shape(), &shape[..]);
    let ours = e
        .prompt_embeds
        .to_f32_vec(&*d, &d.compute_stream())
        .unwrap();
    let err = rel_l2(&ours, &want);
    eprintln!("qwen_pipeline encode_prompt via the folder: relative L2 {err:.3e}");
    assert!(err <= 1e-5, "{err:e}");
    drop(e);
    encoder.to_host().unwrap();
    // And a whole run from text.
    let mut request = fixture_request();
    request.prompt = QwenPromptInput::Text("A red fox in the snow".into());
    request.negative_prompt = Some(QwenPromptInput::Text(" ".into()));
    let r = run(&pipe, d, &settings(Preset::Auto, None), &request);
    assert_eq!(r.phases[0].components.len(), 1, "{:?}", r.phases[0]);
    assert!(r.latents.host_f32().unwrap().iter().all(|v| v.is_finite()));
}

#[test]
fn bad_requests_are_typed_errors_and_release_everything() {
    let pipe = load();
    let d = device();
    let pipeline = pipe.offload_pipeline().unwrap();
    let env = ddo_core::MapEnvironment::default();
    let mut offload =
        enable_pipeline_offload_with_env(&pipeline, d.clone(), &settings(Preset::Auto, None), &env)
            .unwrap();
    let check_released = |offload: &ddo_routes::PipelineOffload| {
        assert_eq!(d.memory_info().allocated, 0);
        for name in ["transformer", "vae"] {
            assert!(offload.handle(name).unwrap().is_detached(), "{name}");
        }
    };

    // Embeddings of the wrong width.
    let mut request = fixture_request();
    request.prompt = QwenPromptInput::Embeddings(QwenPromptEmbeds {
        prompt_embeds: Tensor::from_f32(vec![1, 4, 16], DType::F32, &[0.0; 64]).unwrap(),
        prompt_embeds_mask: None,
        lengths: vec![4],
    });
    let e = pipe
        .run_phases(&mut offload, &request, &mut |_, _, _| {})
        .unwrap_err();
    assert!(
        matches!(&e, CoreError::InvalidOption { option, hint, .. }
            if option == "prompt embeddings" && hint.contains("[b, L, 32]")),
        "{e}"
    );
    check_released(&offload);

    // A negative prompt of another width.
    let mut request = fixture_request();
    request.negative_prompt = Some(QwenPromptInput::Embeddings(QwenPromptEmbeds {
        prompt_embeds: Tensor::from_f32(vec![1, 2, 8], DType::F32, &[0.0; 16]).unwrap(),
        prompt_embeds_mask: None,
        lengths: vec![2],
    }));
    let e = pipe
        .run_phases(&mut offload, &request, &mut |_, _, _| {})
        .unwrap_err();
    assert!(e.to_string().contains("prompt embeddings"), "{e}");
    check_released(&offload);

    // An image too small for one 2x2 patch of latents.
    let mut request = fixture_request();
    request.height = 4;
    let e = pipe
        .run_phases(&mut offload, &request, &mut |_, _, _| {})
        .unwrap_err();
    assert!(
        matches!(&e, CoreError::InvalidOption { option, hint, .. }
            if option == "height/width" && hint.contains("8x8")),
        "{e}"
    );
    check_released(&offload);

    // Noise for another size.
    let mut request = fixture_request();
    request.width = 64;
    let e = pipe
        .run_phases(&mut offload, &request, &mut |_, _, _| {})
        .unwrap_err();
    assert!(e.to_string().contains("[1, 32, 16]"), "{e}");
    check_released(&offload);

    // One step: Qwen-Image's shift_terminal stretch would divide 0 by 0.
    let mut request = fixture_request();
    request.steps = 1;
    let e = pipe
        .run_phases(&mut offload, &request, &mut |_, _, _| {})
        .unwrap_err();
    assert!(
        matches!(&e, CoreError::InvalidOption { option, value, hint }
            if option == "steps" && value == "1" && hint.contains("shift_terminal") && hint.contains("2 or more steps")),
        "{e}"
    );
    check_released(&offload);

    // Text without a text encoder.
    let mut request = fixture_request();
    request.prompt = QwenPromptInput::Text("a cat".into());
    let e = pipe
        .run_phases(&mut offload, &request, &mut |_, _, _| {})
        .unwrap_err();
    assert!(e.to_string().contains("no text_encoder"), "{e}");
    check_released(&offload);
}

#[test]
fn a_text_encoder_without_a_tokenizer_is_refused_naming_the_folder() {
    let tmp = TempDir::new();
    copy_tree(&dir(), &tmp.0);
    copy_tree(
        &fixtures().join("qwen_text_encoder/text_encoder"),
        &tmp.0.join("text_encoder"),
    );
    match QwenImagePipeline::load_checked(&tmp.0, None, UnusedWeights::Refuse) {
        Err(LoadError::NoTokenizer { dir, .. }) => assert_eq!(dir, tmp.0.join("tokenizer")),
        other => panic!("expected NoTokenizer, got {other:?}"),
    }
}

#[test]
fn detect_reads_model_index_and_refuses_unknown_and_mixed_folders() {
    assert_eq!(
        PipelineKind::detect(&fixtures().join("flux_pipeline")).unwrap(),
        PipelineKind::Flux
    );
    // No model_index.json: Flux, as before.
    assert_eq!(
        PipelineKind::detect(&fixtures().join("qwen_vae")).unwrap(),
        PipelineKind::Flux
    );
    let field_of = |e: LoadError| match e {
        LoadError::PipelineClass {
            file,
            field,
            value,
            hint,
        } => (file, field, value, hint),
        other => panic!("expected PipelineClass, got {other}"),
    };

    // An unknown class.
    let tmp = TempDir::new();
    let index = tmp.0.join("model_index.json");
    std::fs::write(&index, r#"{"_class_name": "StableDiffusion3Pipeline"}"#).unwrap();
    let (file, field, value, hint) = field_of(PipelineKind::detect(&tmp.0).unwrap_err());
    assert_eq!((file, field.as_str()), (index.clone(), "_class_name"));
    assert_eq!(value, "StableDiffusion3Pipeline");
    assert!(hint.contains("FluxPipeline, QwenImagePipeline"), "{hint}");
    std::fs::write(&index, r#"{"_diffusers_version": "0.42.1"}"#).unwrap();
    let (_, field, value, _) = field_of(PipelineKind::detect(&tmp.0).unwrap_err());
    assert_eq!((field.as_str(), value.as_str()), ("_class_name", "missing"));

    // model_index.json says Qwen-Image; it lists a Flux transformer.
    std::fs::write(
        &index,
        r#"{"_class_name": "QwenImagePipeline", "transformer": ["diffusers", "FluxTransformer2DModel"]}"#,
    )
    .unwrap();
    let (file, field, value, _) = field_of(PipelineKind::detect(&tmp.0).unwrap_err());
    assert_eq!((file, field.as_str()), (index.clone(), "transformer"));
    assert_eq!(value, "FluxTransformer2DModel");

    // model_index.json says Qwen-Image; the VAE's config is the Flux VAE's.
    std::fs::write(&index, r#"{"_class_name": "QwenImagePipeline"}"#).unwrap();
    std::fs::create_dir_all(tmp.0.join("vae")).unwrap();
    let vae = tmp.0.join("vae/config.json");
    std::fs::write(&vae, r#"{"_class_name": "AutoencoderKL"}"#).unwrap();
    let (file, field, value, hint) = field_of(PipelineKind::detect(&tmp.0).unwrap_err());
    assert_eq!((file, field.as_str()), (vae.clone(), "_class_name"));
    assert_eq!(value, "AutoencoderKL");
    assert!(hint.contains("mixes pipelines"), "{hint}");
    assert!(hint.contains("AutoencoderKLQwenImage"), "{hint}");

    // A Flux folder with Qwen-Image's text encoder (Transformers' `architectures`).
    std::fs::write(&index, r#"{"_class_name": "FluxPipeline"}"#).unwrap();
    std::fs::remove_file(&vae).unwrap();
    std::fs::create_dir_all(tmp.0.join("text_encoder")).unwrap();
    let te = tmp.0.join("text_encoder/config.json");
    std::fs::write(
        &te,
        r#"{"architectures": ["Qwen2_5_VLForConditionalGeneration"]}"#,
    )
    .unwrap();
    let (file, field, _, _) = field_of(PipelineKind::detect(&tmp.0).unwrap_err());
    assert_eq!((file, field.as_str()), (te.clone(), "architectures"));

    // Without model_index.json the same folder is told the file is missing (issue 34), and
    // a model_index.json that is a directory is refused, not taken as absent.
    std::fs::remove_file(&index).unwrap();
    match PipelineKind::detect(&tmp.0).unwrap_err() {
        LoadError::NoModelIndex {
            file,
            class,
            pipeline,
            ..
        } => assert_eq!(
            (file, class.as_str(), pipeline),
            (
                te,
                "Qwen2_5_VLForConditionalGeneration",
                "QwenImagePipeline"
            )
        ),
        other => panic!("expected NoModelIndex, got {other}"),
    }
    std::fs::create_dir(&index).unwrap();
    match PipelineKind::detect(&tmp.0).unwrap_err() {
        LoadError::Io { path, source } => {
            assert_eq!(path, index);
            assert!(source.to_string().contains("a directory"), "{source}");
        }
        other => panic!("expected Io, got {other}"),
    }
    std::fs::remove_dir(&index).unwrap();

    // Loading a Flux folder as Qwen-Image is refused naming model_index.json.
    match QwenImagePipeline::load_checked(
        &fixtures().join("flux_pipeline"),
        None,
        UnusedWeights::Refuse,
    ) {
        Err(LoadError::InvalidConfig { field, .. }) => {
            assert!(field.contains("model_index.json"), "{field}")
        }
        other => panic!("expected InvalidConfig, got {other:?}"),
    }
}

/// Copies the files of `from` (recursively) into `to`.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// A folder of its own under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let p = std::env::temp_dir().join(format!(
            "ddo-nn-qwen-pipeline-{}-{}",
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
