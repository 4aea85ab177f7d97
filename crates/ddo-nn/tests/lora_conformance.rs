//! LoRA against Diffusers (issue 36): the LoRA files of `fixtures/flux_lora` (written with
//! Diffusers 0.42.1 and PEFT by `tools/gen_lora_fixtures.py`, see `fixtures/MANIFEST.md`)
//! on the committed Flux and Qwen-Image pipelines, each at strengths 0.5 and 1.0, two files
//! at once and one fused, give Diffusers' `load_lora_weights` latents to a relative L2 of
//! 1e-5 in f32 — on the resident route and on a streamed one, which agree bit for bit.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::rel_l2;
use ddo_core::{DType, Device, Preset, RouteSpec, Settings, Tensor};
use ddo_host::HostDevice;
use ddo_nn::lora::{LoraFile, set_pipeline_loras};
use ddo_nn::pipeline::{
    FluxPipeline, InitLatents, PipelineRequest, PipelineRun, PromptEmbeds, PromptInput,
    QwenImagePipeline, QwenImageRequest, QwenPromptInput, TiledDecode,
};
use ddo_nn::qwen_text::QwenPromptEmbeds;
use ddo_nn::{UnusedWeights, read_f32_tensor};
use ddo_routes::{Pipeline, enable_pipeline_offload_with_env};

/// The routes each case runs on: resident, and leaf-level streaming with a copy stream.
const ROUTES: [&str; 2] = ["none", "diffusers_group_offload:use_stream=true"];

/// Issue 36's tolerance against Diffusers in f32.
const TOLERANCE: f64 = 1e-5;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

fn values(folder: &str, file: &str, name: &str) -> (Vec<usize>, Vec<f32>) {
    read_f32_tensor(&fixtures().join(folder).join(file), name).expect("fixture tensor")
}

fn host(folder: &str, file: &str, name: &str) -> Tensor {
    let (shape, v) = values(folder, file, name);
    Tensor::from_f32(shape, DType::F32, &v).expect("host tensor")
}

fn settings(route: &str) -> Settings {
    let mut s = Settings {
        preset: Preset::Auto,
        ..Settings::default()
    };
    let spec: RouteSpec = ddo_routes::parse_spec(route).unwrap();
    for name in ["text_encoder", "text_encoder_2", "transformer", "vae"] {
        s.component_policies.insert(name.into(), spec);
    }
    s
}

/// One case: the LoRA files (under `fixtures/flux_lora`) with their strengths, whether they
/// are folded into the resident weights, and the reference's name.
struct Case {
    files: &'static [(&'static str, f32)],
    fused: bool,
    reference: &'static str,
}

/// Runs every case of one pipeline: `run(pipeline, device, route)` runs it once.
fn check_cases(
    family: &str,
    pipeline: &Pipeline,
    outputs: &str,
    cases: &[Case],
    run: &dyn Fn(Arc<dyn Device>, &str) -> PipelineRun,
) {
    let (_, plain_ref) = values("flux_lora", outputs, &format!("{family}plain_latents"));
    for case in cases {
        let files: Vec<(LoraFile, f32)> = case
            .files
            .iter()
            .map(|(f, s)| {
                let path = fixtures().join("flux_lora").join(f);
                (LoraFile::open(&path).expect("LoRA fixture"), *s)
            })
            .collect();
        let refs: Vec<(&LoraFile, f32)> = files.iter().map(|(f, s)| (f, *s)).collect();
        let (_, reference) = values("flux_lora", outputs, case.reference);
        let routes: &[&str] = if case.fused { &ROUTES[..1] } else { &ROUTES };
        let mut first: Option<Vec<f32>> = None;
        for route in routes {
            let device: Arc<dyn Device> = HostDevice::with_capacity(1 << 30).unwrap();
            let (bytes, left_out) = set_pipeline_loras(pipeline, &refs, &*device, false).unwrap();
            assert!(bytes > 0 && left_out.is_empty(), "{}", case.reference);
            let transformer = pipeline.get("transformer").unwrap();
            transformer.set_adapter_fusion(case.fused);
            let got = run(Arc::clone(&device), route).latents.host_f32().unwrap();
            transformer.set_adapter_fusion(false);
            set_pipeline_loras(pipeline, &[], &*device, false).unwrap();
            let err = rel_l2(&got, &reference);
            let moved = rel_l2(&reference, &plain_ref);
            eprintln!(
                "{} on {route}: relative L2 {err:.3e} to Diffusers (the LoRA moved the latents {moved:.3e})",
                case.reference
            );
            assert!(
                err <= TOLERANCE,
                "{} on {route}: relative L2 {err:e}",
                case.reference
            );
            // The reference is one the LoRA changed: a test that could fail.
            assert!(moved > 100.0 * TOLERANCE, "{}", case.reference);
            match &first {
                None => first = Some(got),
                Some(f) => assert_eq!(f, &got, "{}: routes disagree", case.reference),
            }
        }
    }
    // Cleared, the plain latents.
    let device: Arc<dyn Device> = HostDevice::with_capacity(1 << 30).unwrap();
    let got = run(device, ROUTES[0]).latents.host_f32().unwrap();
    let err = rel_l2(&got, &plain_ref);
    assert!(err <= TOLERANCE, "{family}plain: relative L2 {err:e}");
}

#[test]
fn flux_loras_match_diffusers() {
    let dir = fixtures().join("flux_pipeline");
    let pipe = FluxPipeline::load(&dir, None).unwrap();
    let request = PipelineRequest {
        prompt: PromptInput::Embeddings(PromptEmbeds {
            prompt_embeds: host("flux_pipeline", "inputs.safetensors", "prompt_embeds"),
            pooled_prompt_embeds: host(
                "flux_pipeline",
                "inputs.safetensors",
                "pooled_prompt_embeds",
            ),
        }),
        steps: 4,
        guidance: 3.5,
        height: 32,
        width: 24,
        init: InitLatents::Given(host("flux_pipeline", "inputs.safetensors", "noise")),
        num_images: 1,
        tiled_decode: TiledDecode::Off,
        vram_budget: None,
        release_native_idle_cache: false,
        cancel: None,
    };
    let pipeline = pipe.offload_pipeline().unwrap();
    let run = |device: Arc<dyn Device>, route: &str| {
        let env = ddo_core::MapEnvironment::default();
        let mut offload =
            enable_pipeline_offload_with_env(&pipeline, device, &settings(route), &env).unwrap();
        pipe.run_phases(&mut offload, &request, &mut |_, _, _| {})
            .unwrap()
    };
    let cases = [
        Case {
            files: &[("kohya.safetensors", 0.5)],
            fused: false,
            reference: "kohya_0.5_latents",
        },
        Case {
            files: &[("kohya.safetensors", 1.0)],
            fused: false,
            reference: "kohya_1.0_latents",
        },
        Case {
            files: &[("peft.safetensors", 0.5)],
            fused: false,
            reference: "peft_0.5_latents",
        },
        Case {
            files: &[("peft.safetensors", 1.0)],
            fused: false,
            reference: "peft_1.0_latents",
        },
        Case {
            files: &[("xlabs.safetensors", 0.5)],
            fused: false,
            reference: "xlabs_0.5_latents",
        },
        Case {
            files: &[("xlabs.safetensors", 1.0)],
            fused: false,
            reference: "xlabs_1.0_latents",
        },
        Case {
            files: &[("kohya.safetensors", 1.0), ("peft.safetensors", 1.0)],
            fused: false,
            reference: "kohya_peft_latents",
        },
        Case {
            files: &[("kohya.safetensors", 1.0)],
            fused: true,
            reference: "kohya_fused_latents",
        },
    ];
    check_cases("", &pipeline, "outputs.safetensors", &cases, &run);
}

fn qwen_embeds(name: &str) -> QwenPromptInput {
    let e = host("qwen_pipeline", "inputs.safetensors", name);
    let (_, mask) = values(
        "qwen_pipeline",
        "inputs.safetensors",
        &format!("{name}_mask"),
    );
    let mask: Vec<bool> = mask.iter().map(|&m| m != 0.0).collect();
    let lengths = vec![mask.iter().filter(|&&m| m).count()];
    QwenPromptInput::Embeddings(QwenPromptEmbeds {
        prompt_embeds: e,
        prompt_embeds_mask: Some(mask),
        lengths,
    })
}

#[test]
fn qwen_image_loras_match_diffusers() {
    let dir = fixtures().join("qwen_pipeline");
    let pipe = QwenImagePipeline::load_checked(&dir, None, UnusedWeights::Refuse).unwrap();
    let request = QwenImageRequest {
        prompt: qwen_embeds("prompt_embeds"),
        negative_prompt: Some(qwen_embeds("negative_prompt_embeds")),
        true_cfg_scale: 4.0,
        steps: 3,
        height: 32,
        width: 48,
        init: InitLatents::Given(host("qwen_pipeline", "inputs.safetensors", "latents")),
        num_images: 1,
        tiled_decode: TiledDecode::Off,
        vram_budget: None,
        release_native_idle_cache: false,
        cancel: None,
    };
    let pipeline = pipe.offload_pipeline().unwrap();
    let run = |device: Arc<dyn Device>, route: &str| {
        let env = ddo_core::MapEnvironment::default();
        let mut offload =
            enable_pipeline_offload_with_env(&pipeline, device, &settings(route), &env).unwrap();
        pipe.run_phases(&mut offload, &request, &mut |_, _, _| {})
            .unwrap()
    };
    let cases = [
        Case {
            files: &[("qwen_kohya.safetensors", 0.5)],
            fused: false,
            reference: "qwen_kohya_0.5_latents",
        },
        Case {
            files: &[("qwen_kohya.safetensors", 1.0)],
            fused: false,
            reference: "qwen_kohya_1.0_latents",
        },
        Case {
            files: &[("qwen_peft.safetensors", 0.5)],
            fused: false,
            reference: "qwen_peft_0.5_latents",
        },
        Case {
            files: &[("qwen_peft.safetensors", 1.0)],
            fused: false,
            reference: "qwen_peft_1.0_latents",
        },
        Case {
            files: &[("qwen_comfy.safetensors", 0.5)],
            fused: false,
            reference: "qwen_comfy_0.5_latents",
        },
        Case {
            files: &[("qwen_comfy.safetensors", 1.0)],
            fused: false,
            reference: "qwen_comfy_1.0_latents",
        },
        Case {
            files: &[
                ("qwen_kohya.safetensors", 1.0),
                ("qwen_peft.safetensors", 1.0),
            ],
            fused: false,
            reference: "qwen_kohya_qwen_peft_latents",
        },
        Case {
            files: &[("qwen_kohya.safetensors", 1.0)],
            fused: true,
            reference: "qwen_kohya_fused_latents",
        },
    ];
    check_cases("qwen_", &pipeline, "qwen_outputs.safetensors", &cases, &run);
}
