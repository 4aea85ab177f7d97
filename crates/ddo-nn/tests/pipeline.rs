//! The Flux pipeline against Diffusers' `FluxPipeline` (`fixtures/flux_pipeline`, see
//! `fixtures/MANIFEST.md`): the scheduler's sigmas and timesteps for several resolutions,
//! the latents after a 4-step loop and the decoded image from the same weights, embeddings
//! and noise, run through `run_phases` on resident and offloaded routes; the phase
//! boundaries (three phases, nothing left on the device after each cleanup); prompts from
//! text; the automatic tiled-decode choice; and a run stopped by NaN latents.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ddo_core::{DType, Device, Preset, RouteSpec, Settings, Tensor};
use ddo_host::HostDevice;
use ddo_nn::pipeline::{
    FluxPipeline, FluxPipelineConfig, InitLatents, PipelineRequest, PipelineRun, PromptEmbeds,
    PromptInput, TiledDecode,
};
use ddo_nn::read_f32_tensor;
use ddo_nn::scheduler::{FlowMatchEulerConfig, FlowMatchEulerScheduler, calculate_shift};
use ddo_routes::enable_pipeline_offload_with_env;
use serde_json::Value;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/flux_pipeline")
}

fn fixture(file: &str, name: &str) -> (Vec<usize>, Vec<f32>) {
    read_f32_tensor(&dir().join(file), name).expect("fixture tensor")
}

fn host(file: &str, name: &str) -> Tensor {
    let (shape, values) = fixture(file, name);
    Tensor::from_f32(shape, DType::F32, &values).expect("host tensor")
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number") as f32)
        .collect()
}

#[test]
fn scheduler_matches_diffusers_for_several_resolutions() {
    let text = std::fs::read_to_string(dir().join("schedules.json")).unwrap();
    let json: Value = serde_json::from_str(&text).unwrap();
    let config =
        FlowMatchEulerConfig::from_file(&dir().join("scheduler/scheduler_config.json")).unwrap();
    assert_eq!(config, FlowMatchEulerConfig::flux());
    let cases = json["flux"].as_array().unwrap();
    assert!(cases.len() >= 5);
    for case in cases {
        let seq = case["image_seq_len"].as_u64().unwrap() as usize;
        let n = case["num_inference_steps"].as_u64().unwrap() as usize;
        let mu = config.mu(seq);
        assert_eq!(mu, case["mu"].as_f64().unwrap(), "mu for {seq} tokens");
        assert_eq!(mu, calculate_shift(seq, 256, 4096, 0.5, 1.15));
        let mut s = FlowMatchEulerScheduler::new(config.clone()).unwrap();
        s.set_flux_schedule(n, seq).unwrap();
        let (t_ref, s_ref) = (f32s(&case["timesteps"]), f32s(&case["sigmas"]));
        let (dt, ds) = (max_abs(s.timesteps(), &t_ref), max_abs(s.sigmas(), &s_ref));
        eprintln!("schedule {seq} tokens x {n} steps: max |dt| {dt:e}, max |dsigma| {ds:e}");
        assert_eq!(
            s.timesteps(),
            &t_ref[..],
            "timesteps, {seq} tokens, {n} steps"
        );
        assert_eq!(s.sigmas(), &s_ref[..], "sigmas, {seq} tokens, {n} steps");
    }
    let fixed = &json["fixed_shift"];
    let mut s = FlowMatchEulerScheduler::new(FlowMatchEulerConfig {
        shift: 3.0,
        ..FlowMatchEulerConfig::default()
    })
    .unwrap();
    s.set_timesteps(28, None).unwrap();
    let (t_ref, s_ref) = (f32s(&fixed["timesteps"]), f32s(&fixed["sigmas"]));
    eprintln!(
        "fixed shift: max |dt| {:e}, max |dsigma| {:e}",
        max_abs(s.timesteps(), &t_ref),
        max_abs(s.sigmas(), &s_ref)
    );
    assert_eq!(s.timesteps(), &t_ref[..]);
    assert_eq!(s.sigmas(), &s_ref[..]);
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
        for name in ["text_encoder", "text_encoder_2", "transformer", "vae"] {
            s.component_policies.insert(name.into(), spec);
        }
    }
    s
}

fn fixture_request(tiled: TiledDecode) -> PipelineRequest {
    PipelineRequest {
        prompt: PromptInput::Embeddings(PromptEmbeds {
            prompt_embeds: host("inputs.safetensors", "prompt_embeds"),
            pooled_prompt_embeds: host("inputs.safetensors", "pooled_prompt_embeds"),
        }),
        steps: 4,
        guidance: 3.5,
        height: 32,
        width: 24,
        init: InitLatents::Given(host("inputs.safetensors", "noise")),
        num_images: 1,
        tiled_decode: tiled,
        vram_budget: None,
        release_native_idle_cache: false,
        cancel: None,
    }
}

fn run(
    pipe: &FluxPipeline,
    device: Arc<dyn Device>,
    settings: &Settings,
    request: &PipelineRequest,
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

#[test]
fn latents_and_image_match_diffusers_flux_pipeline() {
    let pipe = FluxPipeline::load(&dir(), None).unwrap();
    assert_eq!(pipe.vae_scale_factor(), 2);
    let request = fixture_request(TiledDecode::Off);
    let run = run(
        &pipe,
        device(),
        &settings(Preset::Auto, Some("none")),
        &request,
    );

    let (t_shape, t_ref) = fixture("outputs.safetensors", "timesteps");
    assert_eq!(t_shape, [4]);
    assert_eq!(run.timesteps, t_ref);

    let (shape, reference) = fixture("outputs.safetensors", "latents");
    assert_eq!(run.latents.shape(), &shape[..]);
    let latents = run.latents.host_f32().unwrap();
    let err_latents = max_abs(&latents, &reference);

    let (shape, reference) = fixture("outputs.safetensors", "image");
    assert_eq!(run.image.shape(), &shape[..]);
    let image = run.image.host_f32().unwrap();
    let err_image = max_abs(&image, &reference);
    eprintln!(
        "flux_pipeline (4 steps, 32x24): max |diff| latents {err_latents:.3e}, image {err_image:.3e}"
    );
    assert!(err_latents <= 1e-4, "latents max |diff| {err_latents:e}");
    assert!(err_image <= 1e-4, "image max |diff| {err_image:e}");
    assert!(!run.decode.tiled);

    // Three phases; every cleanup leaves the device empty.
    let names: Vec<&str> = run.phases.iter().map(|p| p.phase.as_str()).collect();
    assert_eq!(names, ["prompt_encoding", "denoise", "decode"]);
    assert!(
        run.phases[0]
            .note
            .as_deref()
            .unwrap()
            .contains("embeddings given")
    );
    // Route `none` puts every component's weights on the device when it attaches; each
    // cleanup releases the finished component, and after the decode nothing is left.
    let ends: Vec<u64> = run
        .phases
        .iter()
        .map(|p| p.peak.allocator_end_bytes)
        .collect();
    let vae_bytes = pipe.vae.component().param_bytes();
    assert_eq!(ends, [ends[0], vae_bytes, 0], "{:?}", run.phases);
    assert!(ends[0] > vae_bytes);
    assert!(run.phases[1].peak.allocator_peak_bytes > 0);
    assert!(run.phases[2].peak.allocator_peak_bytes > 0);
    assert_eq!(run.phases[1].components, ["transformer: none"]);
}

#[test]
fn offloaded_routes_give_the_resident_result_bit_for_bit() {
    let pipe = FluxPipeline::load(&dir(), None).unwrap();
    let request = fixture_request(TiledDecode::Off);
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
        for p in &other.phases {
            assert_eq!(p.peak.allocator_end_bytes, 0, "{label}: {p:?}");
        }
        // Streaming routes keep less on the device than resident weights.
        if label != "off (unmanaged)" {
            assert!(
                other.phases[1].peak.allocator_peak_bytes
                    < resident.phases[1].peak.allocator_peak_bytes,
                "{label}"
            );
        }
    }
}

#[test]
fn text_prompts_run_through_the_text_encoders() {
    let pipe = FluxPipeline::random(&FluxPipelineConfig::tiny(), 3, DType::F32).unwrap();
    let mut request = fixture_request(TiledDecode::Auto);
    request.prompt = PromptInput::Text("a photo of a cat".into());
    request.init = InitLatents::Seed(42);
    request.steps = 2;
    let a = run(&pipe, device(), &settings(Preset::Auto, None), &request);
    assert!(a.phases[0].note.is_none());
    assert_eq!(a.phases[0].components.len(), 2);
    assert!(a.phases[0].peak.allocator_peak_bytes > 0);
    let b = run(&pipe, device(), &settings(Preset::Auto, None), &request);
    assert_eq!(a.image.host_f32().unwrap(), b.image.host_f32().unwrap());
    request.prompt = PromptInput::Text("a photo of a dog".into());
    let c = run(&pipe, device(), &settings(Preset::Auto, None), &request);
    assert_ne!(a.image.host_f32().unwrap(), c.image.host_f32().unwrap());
    assert!(a.image.host_f32().unwrap().iter().all(|v| v.is_finite()));
}

#[test]
fn auto_decode_tiles_when_the_budget_leaves_too_little() {
    let pipe = FluxPipeline::random(&FluxPipelineConfig::tiny(), 5, DType::F32).unwrap();
    let mut request = fixture_request(TiledDecode::Auto);
    request.height = 64;
    request.width = 64;
    request.init = InitLatents::Seed(1);
    request.steps = 1;
    let roomy = run(&pipe, device(), &settings(Preset::Auto, None), &request);
    assert!(!roomy.decode.tiled, "{}", roomy.decode.reason);
    let untiled = roomy.decode.estimate_untiled_bytes;
    request.vram_budget = Some(untiled * 3 / 4);
    let tight = run(&pipe, device(), &settings(Preset::Auto, None), &request);
    assert!(tight.decode.tiled, "{}", tight.decode.reason);
    assert!(tight.phases[2].note.as_deref().unwrap().contains("tiled"));
    assert!(
        tight.phases[2].peak.allocator_peak_bytes < roomy.phases[2].peak.allocator_peak_bytes,
        "tiled {} vs untiled {}",
        tight.phases[2].peak.allocator_peak_bytes,
        roomy.phases[2].peak.allocator_peak_bytes
    );
}

#[test]
fn bad_requests_are_typed_errors_and_release_everything() {
    let pipe = FluxPipeline::load(&dir(), None).unwrap();
    let d = device();
    let pipeline = pipe.offload_pipeline().unwrap();
    let env = ddo_core::MapEnvironment::default();
    let mut offload =
        enable_pipeline_offload_with_env(&pipeline, d.clone(), &settings(Preset::Auto, None), &env)
            .unwrap();
    let mut request = fixture_request(TiledDecode::Off);
    request.height = 64; // the given noise is for 32x24
    let e = pipe
        .run_phases(&mut offload, &request, &mut |_, _, _| {})
        .unwrap_err();
    assert!(e.to_string().contains("[1, 4, 32, 12]"), "{e}");
    assert_eq!(d.memory_info().allocated, 0);
    for name in ["text_encoder", "transformer", "vae"] {
        assert!(offload.handle(name).unwrap().is_detached(), "{name}");
    }
}

/// Latents that turn NaN (here: a NaN in the given noise) stop the run at most one step
/// after the first denoise step with `CoreError::NonFinite` naming the phase and that step,
/// and every
/// component is released as after any error (issue 34: the run used to go on to an
/// all-black image).
#[test]
fn non_finite_latents_stop_the_run_at_their_step_and_release_everything() {
    let pipe = FluxPipeline::load(&dir(), None).unwrap();
    let d = device();
    let pipeline = pipe.offload_pipeline().unwrap();
    let env = ddo_core::MapEnvironment::default();
    let mut offload =
        enable_pipeline_offload_with_env(&pipeline, d.clone(), &settings(Preset::Auto, None), &env)
            .unwrap();
    let mut request = fixture_request(TiledDecode::Off);
    let (shape, mut noise) = fixture("inputs.safetensors", "noise");
    noise[5] = f32::NAN;
    request.init = InitLatents::Given(Tensor::from_f32(shape, DType::F32, &noise).unwrap());
    let mut progress = Vec::new();
    let e = pipe
        .run_phases(&mut offload, &request, &mut |phase, i, _| {
            progress.push((phase.to_string(), i))
        })
        .unwrap_err();
    match &e {
        ddo_core::CoreError::NonFinite {
            phase, step, what, ..
        } => {
            assert_eq!((phase.as_str(), *step), ("denoise", Some((1, 4))), "{e}");
            assert_eq!(what, "the latents");
        }
        other => panic!("expected NonFinite, got {other:?}"),
    }
    assert!(e.to_string().contains("denoise step 1 of 4"), "{e}");
    // The checks are deferred (ddo_core::finite: a step's count is read once the next is
    // queued): the bad step may be reported done, and at most one more step runs.
    let reported: Vec<usize> = progress
        .iter()
        .filter(|(p, _)| p == "denoise")
        .map(|(_, i)| *i)
        .collect();
    assert!(
        reported.len() <= 2 && reported.iter().all(|&i| i <= 2),
        "more than one step after the bad one reported done: {progress:?}"
    );
    assert_eq!(d.memory_info().allocated, 0);
    for name in ["text_encoder", "transformer", "vae"] {
        assert!(offload.handle(name).unwrap().is_detached(), "{name}");
    }
}

/// `--compute fp8` with a NaN in the noise (issue 39): the run stops naming the first fp8
/// linear that reads it (`x_embedder`), on both paths. Where the fp8 linear reads its input
/// (the host reference) it stops there; where it passes the NaN on as a GPU's fp8 GEMM does
/// (`FaultInjectingDevice::pass_fp8_non_finite`), the step's finite check stops the run and
/// the step runs again from its input with the checks at the call on. Either way nothing is
/// left on the device and the checks are off again.
#[test]
fn a_nan_under_fp8_compute_names_its_layer_where_the_gemm_reads_it_and_where_it_does_not() {
    let pipe = FluxPipeline::load(&dir(), Some(DType::F8E4M3)).unwrap();
    let transformer = pipe.transformer.component().clone();
    transformer.set_fp8_compute(true);
    let pipeline = pipe.offload_pipeline().unwrap();
    let env = ddo_core::MapEnvironment::default();
    for passes_nan in [false, true] {
        let d = device();
        let f = ddo_core::FaultInjectingDevice::new(d.clone());
        f.pass_fp8_non_finite(passes_nan);
        let mut offload = enable_pipeline_offload_with_env(
            &pipeline,
            f.clone(),
            &settings(Preset::Auto, None),
            &env,
        )
        .unwrap();
        let mut request = fixture_request(TiledDecode::Off);
        let (shape, mut noise) = fixture("inputs.safetensors", "noise");
        noise[5] = f32::NAN;
        request.init = InitLatents::Given(Tensor::from_f32(shape, DType::F32, &noise).unwrap());
        let before = f.counts().ops;
        let e = pipe
            .run_phases(&mut offload, &request, &mut |_, _, _| {})
            .unwrap_err();
        match &e {
            ddo_core::CoreError::NonFiniteActivation { layer } => {
                assert_eq!(layer, "transformer.x_embedder", "passes NaN: {passes_nan}")
            }
            other => panic!("passes NaN {passes_nan}: expected NonFiniteActivation, got {other:?}"),
        }
        assert!(e.to_string().contains("--compute bf16"), "{e}");
        assert!(!transformer.fp8_checks(), "the checks stayed on");
        // Passing the NaN on, the run went past the bad linear (a step and more).
        let ops = f.counts().ops - before;
        eprintln!("passes NaN {passes_nan}: {ops} ops before the error");
        assert_eq!(d.memory_info().allocated, 0, "passes NaN {passes_nan}");
        for name in ["text_encoder", "transformer", "vae"] {
            assert!(offload.handle(name).unwrap().is_detached(), "{name}");
        }
    }
    transformer.set_fp8_compute(false);
}

#[test]
fn an_untiled_decode_out_of_memory_is_retried_tiled_once() {
    use ddo_nn::pipeline::{DecodePlan, plan_decode};
    use ddo_nn::vae::{TilingConfig, estimate_decode_peak_bytes, estimate_tiled_decode_peak_bytes};

    let pipe = FluxPipeline::random(&FluxPipelineConfig::tiny(), 9, DType::F32).unwrap();
    let (height, width) = (128, 128);
    let (h, w) = pipe.latent_grid(height, width).unwrap();
    let shape = [1, 4, h, w];
    let config = pipe.vae.config();
    let untiled = estimate_decode_peak_bytes(config, &shape, DType::F32);
    // The retry's tiles: Diffusers' 16-latent default splits a 64x64 grid.
    let tiles = TilingConfig::from_config(config);
    let tiled = estimate_tiled_decode_peak_bytes(config, &shape, DType::F32, &tiles);
    assert!(tiled < untiled / 2, "{tiled} vs {untiled}");
    // Room for the resident weights and a tiled decode, not for an untiled one.
    let weights = pipe.vae.component().param_bytes();
    let (d, mut handle) = resident_vae(&pipe, weights + (tiled + untiled) / 2);
    let packed = packed_noise(h, w);

    // Off: the out-of-memory error comes back as it is.
    let mut off: DecodePlan =
        plan_decode(config, &shape, DType::F32, TiledDecode::Off, None, None).unwrap();
    let e = pipe
        .decode_planned(&*d, &packed, height, width, &mut off)
        .unwrap_err();
    assert!(matches!(e, ddo_core::CoreError::OutOfMemory { .. }), "{e}");

    // Auto without a budget to compare with plans untiled; the failure is retried tiled.
    let mut auto = plan_decode(config, &shape, DType::F32, TiledDecode::Auto, None, None).unwrap();
    assert!(!auto.tiled);
    let image = pipe
        .decode_planned(&*d, &packed, height, width, &mut auto)
        .unwrap();
    assert_eq!(image.shape(), [1, 3, height, width]);
    assert!(auto.tiled && auto.retried_after_oom, "{auto:?}");
    assert_eq!(
        auto.tiling,
        Some(tiles),
        "the retry uses Diffusers' default tiles"
    );
    assert!(auto.reason.contains("retried"), "{}", auto.reason);
    drop(image);
    let peak = handle.end_phase("decode").unwrap();
    assert!(peak.allocator_peak_bytes <= d.memory_info().capacity);
    ddo_routes::remove_dynamic_offload(&mut handle).unwrap();
    assert_eq!(d.memory_info().allocated, 0);
}

#[test]
fn an_untiled_decode_out_of_memory_is_not_retried_below_the_default_tile() {
    use ddo_nn::pipeline::plan_decode;
    use ddo_nn::vae::{TilingConfig, estimate_decode_peak_bytes};

    let pipe = FluxPipeline::random(&FluxPipelineConfig::tiny(), 9, DType::F32).unwrap();
    let (height, width) = (32, 32);
    let (h, w) = pipe.latent_grid(height, width).unwrap();
    let shape = [1, 4, h, w];
    let config = pipe.vae.config();
    // The 16x16 latents fit in one of Diffusers' 16-latent default tiles.
    assert!(!TilingConfig::from_config(config).needs_tiling(h, w));
    let untiled = estimate_decode_peak_bytes(config, &shape, DType::F32);
    let weights = pipe.vae.component().param_bytes();
    let (d, mut handle) = resident_vae(&pipe, weights + untiled / 2);
    let packed = packed_noise(h, w);
    let mut auto = plan_decode(config, &shape, DType::F32, TiledDecode::Auto, None, None).unwrap();
    let e = pipe
        .decode_planned(&*d, &packed, height, width, &mut auto)
        .unwrap_err();
    // No retry with tiles smaller than the default: the out-of-memory error as it is.
    assert!(matches!(e, ddo_core::CoreError::OutOfMemory { .. }), "{e}");
    assert!(!auto.tiled && !auto.retried_after_oom, "{auto:?}");
    assert_eq!(auto.tiling, None);
    assert_eq!(d.memory_info().allocated, weights);
    ddo_routes::remove_dynamic_offload(&mut handle).unwrap();
    assert_eq!(d.memory_info().allocated, 0);
}

#[test]
fn auto_decode_refuses_a_budget_too_small_for_the_default_tiles_and_names_one_that_works() {
    use ddo_nn::vae::{TilingConfig, estimate_tiled_decode_peak_bytes};

    let pipe = FluxPipeline::random(&FluxPipelineConfig::tiny(), 5, DType::F32).unwrap();
    let mut request = fixture_request(TiledDecode::Auto);
    request.height = 64;
    request.width = 64;
    request.init = InitLatents::Seed(1);
    request.steps = 1;
    let roomy = run(&pipe, device(), &settings(Preset::Auto, None), &request);
    assert!(!roomy.decode.tiled, "{}", roomy.decode.reason);
    // What the decode phase holds besides its activations (the 1 GiB device's capacity
    // is the budget here), and the estimate with Diffusers' default tiles.
    let held = (1u64 << 30) - roomy.decode.available_bytes.unwrap();
    let (h, w) = pipe.latent_grid(64, 64).unwrap();
    let default = TilingConfig::from_config(pipe.vae.config());
    assert!(default.needs_tiling(h, w));
    let tiled =
        estimate_tiled_decode_peak_bytes(pipe.vae.config(), &[1, 4, h, w], DType::F32, &default);

    // Room for smaller tiles only: refused before the decode, everything released.
    request.vram_budget = Some(held + tiled / 2);
    let d = device();
    let pipeline = pipe.offload_pipeline().unwrap();
    let env = ddo_core::MapEnvironment::default();
    let mut offload =
        enable_pipeline_offload_with_env(&pipeline, d.clone(), &settings(Preset::Auto, None), &env)
            .unwrap();
    let e = pipe
        .run_phases(&mut offload, &request, &mut |_, _, _| {})
        .unwrap_err();
    let ddo_core::CoreError::DecodeDoesNotFit { hint, .. } = &e else {
        panic!("{e}");
    };
    assert!(hint.contains("--tiled-decode off"), "{hint}");
    assert!(hint.contains("--height/--width"), "{hint}");
    assert_eq!(d.memory_info().allocated, 0);
    for name in ["text_encoder", "transformer", "vae"] {
        assert!(offload.handle(name).unwrap().is_detached(), "{name}");
    }
    // The budget it names: the budget plus the shortfall, rounded up to a MiB.
    let rest = &hint[hint.find("--vram-budget ").expect("a budget") + 14..];
    let mib: u64 = rest[..rest.find("MiB").unwrap()].parse().unwrap();
    assert_eq!(mib, (held + tiled).div_ceil(1 << 20));

    // With that budget the decode runs (the MiB rounding leaves this tiny VAE room to
    // decode untiled); with just enough for the default tiles it runs on them.
    request.vram_budget = Some(mib << 20);
    let named = run(&pipe, device(), &settings(Preset::Auto, None), &request);
    assert!(
        named
            .image
            .host_f32()
            .unwrap()
            .iter()
            .all(|v| v.is_finite())
    );
    request.vram_budget = Some(held + tiled);
    let tight = run(&pipe, device(), &settings(Preset::Auto, None), &request);
    assert!(tight.decode.tiled, "{}", tight.decode.reason);
    assert_eq!(tight.decode.tiling, Some(default));
    assert_eq!(tight.decode.estimate_tiled_bytes, Some(tiled));
    assert_eq!(tight.decode.available_bytes, Some(tiled));
}

fn ids(name: &str) -> Vec<u32> {
    fixture("outputs.safetensors", name)
        .1
        .iter()
        .map(|&v| v as u32)
        .collect()
}

#[test]
fn prompt_encoding_and_a_run_from_tokens_match_diffusers() {
    let pipe = FluxPipeline::load(&dir(), None).unwrap();
    let (clip_ids, t5_ids) = (ids("text_clip_input_ids_f32"), ids("text_t5_input_ids_f32"));
    assert_eq!((clip_ids.len(), t5_ids.len()), (16, 24));
    let d = device();
    let s = d.compute_stream();
    for c in pipe.components() {
        c.to_device(&*d, &s).unwrap();
    }
    let e = pipe.encode_prompt(&*d, &clip_ids, &t5_ids).unwrap();
    let ops = ddo_core::ops_of(&*d).unwrap();
    for (got, name) in [
        (&e.prompt_embeds, "text_prompt_embeds"),
        (&e.pooled_prompt_embeds, "text_pooled_prompt_embeds"),
    ] {
        let (shape, reference) = fixture("outputs.safetensors", name);
        assert_eq!(got.shape(), &shape[..], "{name}");
        let err = max_abs(&ops.to_f32_vec(got).unwrap(), &reference);
        eprintln!("{name}: max |diff| {err:.3e}");
        assert!(err <= 1e-4, "{name}: {err:e}");
    }
    for c in pipe.components() {
        c.to_host().unwrap();
    }

    let mut request = fixture_request(TiledDecode::Off);
    request.prompt = PromptInput::Tokens {
        clip: clip_ids,
        t5: t5_ids,
    };
    let run = run(&pipe, device(), &settings(Preset::Auto, None), &request);
    let (_, reference) = fixture("outputs.safetensors", "text_latents");
    let err = max_abs(&run.latents.host_f32().unwrap(), &reference);
    eprintln!("text_latents: max |diff| {err:.3e}");
    assert!(err <= 1e-4, "text latents: {err:e}");
    assert!(run.phases[0].note.is_none());
}

/// `pipe`'s VAE resident on a fresh host device of `capacity` bytes.
fn resident_vae(
    pipe: &FluxPipeline,
    capacity: u64,
) -> (Arc<HostDevice>, ddo_routes::OffloadHandle) {
    let d = HostDevice::with_capacity(capacity).unwrap();
    let handle = ddo_routes::enable_offload(
        pipe.vae.component(),
        d.clone(),
        &ddo_routes::OffloadOptions {
            route: Some(ddo_routes::parse_spec("none").unwrap()),
            ..ddo_routes::OffloadOptions::default()
        },
    )
    .unwrap();
    (d, handle)
}

/// Seeded packed latents `[1, (h/2)·(w/2), 16]` for an `h × w` latent grid.
fn packed_noise(h: usize, w: usize) -> Tensor {
    Tensor::from_f32(
        vec![1, (h / 2) * (w / 2), 16],
        DType::F32,
        &ddo_nn::pipeline::gaussian_noise(3, (h / 2) * (w / 2) * 16),
    )
    .unwrap()
}

/// `fixtures/flux_pipeline/batch2.safetensors` (see `batch2.md` there).
fn batch2(name: &str) -> (Vec<usize>, Vec<f32>) {
    fixture("batch2.safetensors", name)
}

/// Diffusers' `postprocess(output_type="pt")` of a decoded image: `(x / 2 + 0.5)` in [0, 1].
fn to_pt(image: &[f32]) -> Vec<f32> {
    image
        .iter()
        .map(|x| (x / 2.0 + 0.5).clamp(0.0, 1.0))
        .collect()
}

#[test]
fn a_batch_of_two_prompts_matches_diffusers_and_mixes_nothing_between_images() {
    let pipe = FluxPipeline::load(&dir(), None).unwrap();
    let tensor = |name: &str| {
        let (shape, values) = batch2(name);
        Tensor::from_f32(shape, DType::F32, &values).unwrap()
    };
    let mut request = fixture_request(TiledDecode::Off);
    request.prompt = PromptInput::Embeddings(PromptEmbeds {
        prompt_embeds: tensor("prompt_embeds"),
        pooled_prompt_embeds: tensor("pooled_prompt_embeds"),
    });
    request.init = InitLatents::Given(tensor("noise"));
    let batch = run(&pipe, device(), &settings(Preset::Auto, None), &request);
    let (shape, reference) = batch2("embeds_latents");
    assert_eq!(batch.latents.shape(), &shape[..]);
    let latents = batch.latents.host_f32().unwrap();
    let err_latents = max_abs(&latents, &reference);
    let (shape, reference) = batch2("embeds_image_pt");
    assert_eq!(batch.image.shape(), &shape[..]);
    let image = batch.image.host_f32().unwrap();
    let err_image = max_abs(&to_pt(&image), &reference);
    eprintln!(
        "batch 2 from embeddings: max |diff| latents {err_latents:.3e}, image {err_image:.3e}"
    );
    assert!(err_latents <= 1e-4, "latents {err_latents:e}");
    assert!(err_image <= 1e-4, "image {err_image:e}");

    // Each image alone, from its own prompt and noise, is its row of the batch.
    let rows = |t: &Tensor| {
        let v = t.host_f32().unwrap();
        let n = v.len() / t.shape()[0];
        v.chunks(n).map(<[f32]>::to_vec).collect::<Vec<_>>()
    };
    let (image_rows, latent_rows) = (rows(&batch.image), rows(&batch.latents));
    for i in 0..2 {
        let row = |name: &str| {
            let (shape, values) = batch2(name);
            let n = values.len() / shape[0];
            let mut one = shape.clone();
            one[0] = 1;
            Tensor::from_f32(one, DType::F32, &values[i * n..(i + 1) * n]).unwrap()
        };
        let mut single = fixture_request(TiledDecode::Off);
        single.prompt = PromptInput::Embeddings(PromptEmbeds {
            prompt_embeds: row("prompt_embeds"),
            pooled_prompt_embeds: row("pooled_prompt_embeds"),
        });
        single.init = InitLatents::Given(row("noise"));
        let alone = run(&pipe, device(), &settings(Preset::Auto, None), &single);
        let dl = max_abs(&alone.latents.host_f32().unwrap(), &latent_rows[i]);
        let di = max_abs(&alone.image.host_f32().unwrap(), &image_rows[i]);
        eprintln!("image {i} alone vs its batch row: latents {dl:.3e}, image {di:.3e}");
        assert!(dl <= 1e-5 && di <= 1e-5, "image {i}: {dl:e} {di:e}");
    }
}

#[test]
fn num_images_repeats_the_prompt_as_diffusers_num_images_per_prompt() {
    let pipe = FluxPipeline::load(&dir(), None).unwrap();
    let (clip_ids, t5_ids) = (ids("text_clip_input_ids_f32"), ids("text_t5_input_ids_f32"));
    let (shape, noise) = batch2("noise");
    let mut request = fixture_request(TiledDecode::Off);
    request.prompt = PromptInput::Tokens {
        clip: clip_ids,
        t5: t5_ids,
    };
    request.num_images = 2;
    request.init = InitLatents::Given(Tensor::from_f32(shape, DType::F32, &noise).unwrap());
    let run2 = run(&pipe, device(), &settings(Preset::Auto, None), &request);
    let (shape, reference) = batch2("text_latents");
    assert_eq!(run2.latents.shape(), &shape[..]);
    let err_latents = max_abs(&run2.latents.host_f32().unwrap(), &reference);
    let (shape, reference) = batch2("text_image_pt");
    assert_eq!(run2.image.shape(), &shape[..]);
    let err_image = max_abs(&to_pt(&run2.image.host_f32().unwrap()), &reference);
    eprintln!(
        "num_images_per_prompt 2 from tokens: max |diff| latents {err_latents:.3e}, image {err_image:.3e}"
    );
    assert!(err_latents <= 1e-4, "latents {err_latents:e}");
    assert!(err_image <= 1e-4, "image {err_image:e}");

    // Seeded noise for two images begins with the one-image noise of the same seed.
    let mut seeded = fixture_request(TiledDecode::Off);
    seeded.init = InitLatents::Seed(9);
    let one = run(&pipe, device(), &settings(Preset::Auto, None), &seeded);
    seeded.num_images = 2;
    let two = run(&pipe, device(), &settings(Preset::Auto, None), &seeded);
    assert_eq!(two.image.shape()[0], 2);
    let (a, b) = (one.image.host_f32().unwrap(), two.image.host_f32().unwrap());
    assert!(max_abs(&a, &b[..a.len()]) <= 1e-5);
    assert!(
        max_abs(&a, &b[a.len()..]) > 1e-3,
        "the second image has its own noise"
    );

    // Noise for the wrong number of images is refused before the loop, and the routes are
    // released.
    let mut wrong = fixture_request(TiledDecode::Off);
    wrong.num_images = 3;
    let pipeline = pipe.offload_pipeline().unwrap();
    let d = device();
    let mut offload = enable_pipeline_offload_with_env(
        &pipeline,
        d.clone(),
        &settings(Preset::Auto, None),
        &ddo_core::MapEnvironment::default(),
    )
    .unwrap();
    let err = pipe
        .run_phases(&mut offload, &wrong, &mut |_, _, _| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("[3, 4, 16, 12]"), "{err}");
    assert_eq!(d.memory_info().allocated, 0);
    wrong.num_images = 0;
    assert!(
        pipe.run_phases(&mut offload, &wrong, &mut |_, _, _| {})
            .is_err()
    );
}

/// Issue 35: a component that ran needs no host copy: at its release the pages of its
/// checkpoint mappings leave the process (every whole page of the fixture's files), and the
/// run's outputs are those of a run that keeps them.
#[test]
fn released_components_drop_their_file_pages() {
    let pipe = FluxPipeline::load(&dir(), None).unwrap();
    let d = device();
    let pipeline = pipe.offload_pipeline().unwrap();
    let env = ddo_core::MapEnvironment::default();
    let mut offload =
        enable_pipeline_offload_with_env(&pipeline, d.clone(), &settings(Preset::Auto, None), &env)
            .unwrap();
    assert_eq!(offload.host_bytes_released("text_encoder"), None);
    let run = pipe
        .run_phases(
            &mut offload,
            &fixture_request(TiledDecode::Off),
            &mut |_, _, _| {},
        )
        .unwrap();
    for name in ["text_encoder", "transformer", "vae"] {
        let component = pipeline.get(name).unwrap();
        let mapped: u64 = component
            .params()
            .iter()
            .filter(|p| p.host().mapped_range().is_some())
            .map(|p| p.nbytes() as u64)
            .sum();
        let released = offload.host_bytes_released(name).unwrap();
        assert!(mapped > 0, "{name}: the fixture's weights are mapped");
        assert!(
            released > 0 && released <= mapped,
            "{name}: released {released} of {mapped}"
        );
    }
    // The pages come back from the file when read again: a second run gives the same image.
    let mut again =
        enable_pipeline_offload_with_env(&pipeline, d.clone(), &settings(Preset::Auto, None), &env)
            .unwrap();
    let second = pipe
        .run_phases(
            &mut again,
            &fixture_request(TiledDecode::Off),
            &mut |_, _, _| {},
        )
        .unwrap();
    let bytes = |t: &ddo_core::Tensor| t.to_host_bytes(&*d, &d.compute_stream()).unwrap();
    assert_eq!(bytes(&run.image), bytes(&second.image));
}
