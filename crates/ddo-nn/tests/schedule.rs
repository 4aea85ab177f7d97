//! The models build their component trees in execution order: a streamed route predicts
//! the order its groups start from the leaf order, and for the models a preset streams
//! (the Flux and Qwen-Image transformers, the text encoders, Qwen-Image's included) that
//! prediction holds, so the first forward already streams on the engine (one copy per
//! transfer unit, no relearn) and gives the resident output. The VAE decoder's mid block
//! runs its attention between its two resnets, which the tree lists first (Diffusers'
//! `resnets` list): a streamed VAE (an explicit choice; the presets never stream it) learns
//! its order on the first forward, and gives the resident output all the same.

use std::sync::Arc;

use ddo_core::{Component, DType, Device, RouteSpec, Tensor};
use ddo_host::HostDevice;
use ddo_nn::flux::FluxInputs;
use ddo_nn::pipeline::{FluxPipeline, FluxPipelineConfig};
use ddo_nn::qwen_image::{QwenImageInputs, QwenImageTransformer, QwenImageTransformerConfig};
use ddo_nn::qwen_text::{QwenTextEncoder, QwenTextEncoderConfig, QwenTextInputs};
use ddo_routes::enable_dynamic_offload;

fn streamed() -> RouteSpec {
    ddo_routes::parse_spec("diffusers_group_offload:use_stream=true,unit_bytes=4KiB").unwrap()
}

/// Runs `forward` resident and then under the streamed route, and checks whether the
/// first streamed forward followed the predicted schedule.
fn check(
    name: &str,
    component: &Arc<Component>,
    predicted: bool,
    forward: &dyn Fn(&dyn Device) -> Tensor,
) {
    let device = HostDevice::with_capacity(1 << 30).unwrap();
    let dev: Arc<dyn Device> = device.clone();
    let bytes = |t: &Tensor| t.to_host_bytes(&*dev, &dev.compute_stream()).unwrap();
    let resident = {
        let _h =
            enable_dynamic_offload(component, Arc::clone(&dev), RouteSpec::resident()).unwrap();
        bytes(&forward(&*dev))
    };
    let h = enable_dynamic_offload(component, Arc::clone(&dev), streamed()).unwrap();
    let out = bytes(&forward(&*dev));
    assert_eq!(out, resident, "{name}: streamed output");
    let c = h.metrics_snapshot().counters;
    assert!(c.transfer_units > 1, "{name}: an engine with several units");
    assert_eq!(
        c.h2d_copies == c.transfer_units,
        predicted,
        "{name}: the first forward streamed one copy per unit iff the predicted schedule held \
         ({} copies, {} units)",
        c.h2d_copies,
        c.transfer_units
    );
    assert_eq!(c.schedule_relearned, 0, "{name}");
    // The second forward streams on the (learned or predicted) schedule.
    assert_eq!(bytes(&forward(&*dev)), resident, "{name}: second forward");
    let c2 = h.metrics_snapshot().counters;
    assert_eq!(c2.h2d_copies - c.h2d_copies, c2.transfer_units, "{name}");
    assert_eq!(c2.schedule_relearned, 0, "{name}");
}

#[test]
fn every_flux_pipeline_model_runs_its_leaves_in_tree_order() {
    let config = FluxPipelineConfig::tiny();
    let pipe = FluxPipeline::random(&config, 0, DType::F32).unwrap();
    let (clip_ids, t5_ids) = pipe.stand_in_tokens("a lighthouse").unwrap();
    let clip = pipe.clip.as_ref().unwrap();
    check("text_encoder", clip.component(), true, &|d| {
        clip.forward(d, &clip_ids).unwrap().pooler_output
    });
    let t5 = pipe.t5.as_ref().unwrap();
    check("text_encoder_2", t5.component(), true, &|d| {
        t5.forward(d, &t5_ids).unwrap()
    });
    let inputs = FluxInputs::synthetic(pipe.transformer.config(), 4, 8).unwrap();
    check("transformer", pipe.transformer.component(), true, &|d| {
        pipe.transformer.forward(d, &inputs).unwrap()
    });
    let (h, w) = pipe.latent_grid(64, 64).unwrap();
    let c = pipe.vae.config().latent_channels;
    let latents = Tensor::from_f32(
        vec![1, c, h, w],
        DType::F32,
        &(0..c * h * w)
            .map(|i| (i % 7) as f32 / 7.0 - 0.5)
            .collect::<Vec<_>>(),
    )
    .unwrap();
    check("vae", pipe.vae.component(), false, &|d| {
        pipe.vae.decode(Some(d), &latents, None).unwrap()
    });
}

#[test]
fn the_qwen_image_transformer_runs_its_leaves_in_tree_order() {
    let model =
        QwenImageTransformer::random(QwenImageTransformerConfig::tiny(), 0, DType::F32).unwrap();
    let mut inputs = QwenImageInputs::synthetic(model.config(), 4, 3, 6).unwrap();
    // A padded prompt: the mask takes no leaf, and changes no order.
    inputs.encoder_hidden_states_mask = Some(vec![true, true, true, true, false, false]);
    check("qwen_image transformer", model.component(), true, &|d| {
        model.forward(d, &inputs).unwrap()
    });
}

#[test]
fn the_qwen_text_encoder_runs_its_leaves_in_tree_order() {
    let model = QwenTextEncoder::random(&QwenTextEncoderConfig::tiny(), 0, DType::F32).unwrap();
    // Two prompts, the second padded: the causal + padding mask takes no leaf, and changes
    // no order.
    let inputs = QwenTextInputs::new(
        vec![3, 9, 27, 81, 243, 5, 15, 45, 0, 0],
        Some(vec![1, 1, 1, 1, 1, 1, 1, 1, 0, 0]),
        2,
    );
    check("qwen text_encoder", model.component(), true, &|d| {
        model.forward(d, &inputs).unwrap()
    });
}
