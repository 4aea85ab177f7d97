//! LoRA applied at run time (issue 36) on the Diffusers Flux transformer fixture: the
//! output with a kohya LoRA's adapters (fused qkv and `linear1` split, the final
//! modulation's halves swapped, an MLP input before its GELU, the single block's
//! concatenated `proj_out`) equals the output of the same model whose weights had
//! `strength · alpha/rank · B A` merged in, and every route gives the resident output bit for
//! bit; clearing the adapters gives the plain output back bit for bit, and a
//! LoRA for another model is refused with nothing changed.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::write_safetensors;
use ddo_core::{DType, Device, RouteSpec, Tensor, ops_of};
use ddo_host::HostDevice;
use ddo_nn::flux::{FluxInputs, FluxTransformer};
use ddo_nn::lora::{LoraFile, apply_loras};
use ddo_nn::{LoadError, read_f32_tensor};
use ddo_routes::enable_dynamic_offload;
use safetensors::Dtype;
use tempfile::TempDir;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/flux_transformer")
}

fn tensor(file: &str, name: &str) -> (Vec<usize>, Vec<f32>) {
    read_f32_tensor(&fixture_dir().join(file), name).unwrap()
}

fn inputs() -> FluxInputs {
    let f = "inputs.safetensors";
    let t = |n: &str| {
        let (s, v) = tensor(f, n);
        Tensor::from_f32(s, DType::F32, &v).unwrap()
    };
    let ids = |n: &str| {
        tensor(f, n)
            .1
            .chunks(3)
            .map(|c| [c[0], c[1], c[2]])
            .collect()
    };
    FluxInputs {
        hidden_states: t("hidden_states"),
        encoder_hidden_states: t("encoder_hidden_states"),
        pooled_projections: t("pooled_projections"),
        timestep: tensor(f, "timestep").1,
        guidance: Some(tensor(f, "guidance").1),
        img_ids: ids("img_ids"),
        txt_ids: ids("txt_ids"),
    }
}

fn write(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    write_safetensors(path, tensors, false);
}

/// A kohya LoRA on the tiny transformer (hidden 32, MLP 128): `(module, out, in)`.
fn kohya(path: &Path, modules: &[(&str, usize, usize)]) {
    let rank = 4;
    let mut t = Vec::new();
    for (k, (m, out, inp)) in modules.iter().enumerate() {
        let v = |n: usize, seed: f32| -> Vec<f32> {
            (0..n)
                .map(|i| ((i as f32 * 0.61 + seed).sin()) * 0.3)
                .collect()
        };
        t.push((
            format!("lora_unet_{m}.lora_down.weight"),
            vec![rank, *inp],
            v(rank * inp, k as f32),
        ));
        t.push((
            format!("lora_unet_{m}.lora_up.weight"),
            vec![*out, rank],
            v(out * rank, 7.0 + k as f32),
        ));
        t.push((format!("lora_unet_{m}.alpha"), vec![], vec![2.0]));
    }
    write(path, &t);
}

const MODULES: [(&str, usize, usize); 5] = [
    ("double_blocks_0_img_attn_qkv", 96, 32),
    ("double_blocks_0_txt_mlp_0", 128, 32),
    ("single_blocks_0_linear1", 224, 32),
    ("single_blocks_0_linear2", 32, 160),
    ("final_layer_adaLN_modulation_1", 64, 32),
];

/// The fixture folder with `strength · scale · B A` added to each adapted weight.
fn merged(dir: &Path, lora: &LoraFile, strength: f32) -> PathBuf {
    let out = dir.join("merged");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::copy(fixture_dir().join("config.json"), out.join("config.json")).unwrap();
    let src = fixture_dir().join("diffusion_pytorch_model.safetensors");
    let bytes = std::fs::read(&src).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut deltas: HashMap<String, Vec<f32>> = HashMap::new();
    for m in &lora.modules {
        let (a, b) = (m.down.to_f32().unwrap(), m.up.to_f32().unwrap());
        let (o, r, i) = (m.out_features(), m.rank(), m.in_features());
        let mut d = vec![0.0f32; o * i];
        for row in 0..o {
            for col in 0..i {
                let dot: f32 = (0..r).map(|k| b[row * r + k] * a[k * i + col]).sum();
                d[row * i + col] = strength * m.scale * dot;
            }
        }
        deltas.insert(format!("{}.weight", m.module), d);
    }
    let mut tensors = Vec::new();
    for (name, view) in st.tensors() {
        assert_eq!(view.dtype(), Dtype::F32);
        let mut v: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        if let Some(d) = deltas.remove(&name) {
            v.iter_mut().zip(d).for_each(|(w, d)| *w += d);
        }
        tensors.push((name, view.shape().to_vec(), v));
    }
    assert!(deltas.is_empty(), "not in the fixture: {:?}", deltas.keys());
    write(&out.join("diffusion_pytorch_model.safetensors"), &tensors);
    out
}

/// `(bytes, values)` of a forward of `model` on `route` (`None`: placed by `to_device`).
fn run(
    model: &FluxTransformer,
    d: &Arc<HostDevice>,
    route: Option<RouteSpec>,
) -> (Vec<u8>, Vec<f32>) {
    let handle = match route {
        Some(spec) => Some(enable_dynamic_offload(model.component(), d.clone(), spec).unwrap()),
        None => {
            model
                .component()
                .to_device(&**d, &d.compute_stream())
                .unwrap();
            None
        }
    };
    let out = model.forward(&**d, &inputs()).unwrap();
    let values = ops_of(&**d).unwrap().to_f32_vec(&out).unwrap();
    let bytes = out.to_host_bytes(&**d, &d.compute_stream()).unwrap();
    drop(handle);
    (bytes, values)
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

#[test]
fn adapters_equal_merged_weights_on_every_route() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("lora.safetensors");
    kohya(&path, &MODULES);
    let lora = LoraFile::open(&path).unwrap();
    // qkv 3 + the MLP input 1 + linear1 4 + linear2 1 + norm_out 1.
    assert_eq!(lora.modules.len(), 10);
    let strength = 0.7;
    let d = HostDevice::with_capacity(1 << 30).unwrap();

    let plain = FluxTransformer::load(&fixture_dir(), None).unwrap();
    let (plain_bytes, plain_values) = run(&plain, &d, None);

    let model = FluxTransformer::load(&fixture_dir(), None).unwrap();
    let bytes = apply_loras(model.component(), &[(&lora, strength)], &*d).unwrap();
    assert!(bytes > 0 && bytes == model.component().adapter_bytes());
    let (adapted_bytes, adapted) = run(&model, &d, None);

    let merged_model = FluxTransformer::load(&merged(dir.path(), &lora, strength), None).unwrap();
    let (_, merged_values) = run(&merged_model, &d, None);
    let err = rel_l2(&adapted, &merged_values);
    let moved = rel_l2(&adapted, &plain_values);
    eprintln!("lora: rel L2 against merged weights {err:.3e}; against no LoRA {moved:.3e}");
    assert!(err <= 1e-5, "adapters vs merged: {err:e}");
    assert!(moved > 1e-3, "the LoRA changed nothing: {moved:e}");

    // The same adapters on every route, twice each (the streamed ones learn their schedule
    // on the first forward): bit for bit the resident output.
    for (label, spec, native) in [
        (
            "leaf, no stream",
            RouteSpec::leaf_group(false, false),
            false,
        ),
        ("leaf, stream", RouteSpec::leaf_group(true, false), false),
        (
            "block, stream",
            ddo_routes::parse_spec(
                "diffusers_group_offload:offload_type=block_level,num_blocks_per_group=1,use_stream=true",
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
            "native_vmm",
            ddo_routes::parse_spec("native_vmm:budget=64KiB").unwrap(),
            true,
        ),
    ] {
        let model = FluxTransformer::load(&fixture_dir(), None).unwrap();
        let dev = HostDevice::new(ddo_host::HostDeviceConfig {
            capacity: 1 << 30,
            allocator: if native {
                ddo_core::AllocatorKind::NativeVmm
            } else {
                ddo_core::AllocatorKind::Caching
            },
            ..ddo_host::HostDeviceConfig::default()
        })
        .unwrap();
        apply_loras(model.component(), &[(&lora, strength)], &*dev).unwrap();
        let handle = enable_dynamic_offload(model.component(), dev.clone(), spec).unwrap();
        for pass in 0..2 {
            let out = model.forward(&*dev, &inputs()).unwrap();
            let got = out.to_host_bytes(&*dev, &dev.compute_stream()).unwrap();
            assert!(
                got == adapted_bytes,
                "{label}: forward {pass} differs from resident with the LoRA"
            );
        }
        drop(handle);
    }

    // Cleared: the plain output, bit for bit.
    let cleared = FluxTransformer::load(&fixture_dir(), None).unwrap();
    apply_loras(cleared.component(), &[(&lora, strength)], &*d).unwrap();
    assert_eq!(apply_loras(cleared.component(), &[], &*d).unwrap(), 0);
    assert_eq!(run(&cleared, &d, None).0, plain_bytes);
}

#[test]
fn a_lora_for_another_model_is_refused_and_changes_nothing() {
    let dir = TempDir::new().unwrap();
    let d = HostDevice::with_capacity(1 << 30).unwrap();
    let model = FluxTransformer::load(&fixture_dir(), None).unwrap();
    let good = dir.path().join("good.safetensors");
    kohya(&good, &MODULES[..1]);
    let good = LoraFile::open(&good).unwrap();
    apply_loras(model.component(), &[(&good, 1.0)], &*d).unwrap();
    let before = model.component().adapter_bytes();
    // Block 5 does not exist in a one-block model; a wider layer does not fit.
    for (name, modules) in [
        ("deep", vec![("double_blocks_5_img_mlp_0", 128, 32)]),
        ("wide", vec![("double_blocks_0_img_mlp_0", 128, 3072)]),
    ] {
        let path = dir.path().join(format!("{name}.safetensors"));
        kohya(&path, &modules);
        let lora = LoraFile::open(&path).unwrap();
        let e = apply_loras(model.component(), &[(&lora, 1.0)], &*d).unwrap_err();
        assert!(matches!(e, LoadError::Lora { .. }), "{e:?}");
        let text = e.to_string();
        assert!(
            text.contains("transformer_blocks") && text.contains(name),
            "{text}"
        );
        assert_eq!(
            model.component().adapter_bytes(),
            before,
            "{name}: adapters changed"
        );
    }
}

/// `set_pipeline_loras`, what a warm process calls between requests: every component's
/// modules are checked before any is changed (a file that fits the transformer but not the
/// text encoder leaves both as they were), a good file adapts both, and an empty list
/// clears them.
#[test]
fn pipeline_loras_change_together_or_not_at_all() {
    let dir = TempDir::new().unwrap();
    let d = HostDevice::with_capacity(1 << 30).unwrap();
    let transformer = FluxTransformer::load(&fixture_dir(), None).unwrap();
    let clip_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/clip_text");
    let clip = ddo_nn::clip::ClipTextModel::from_dir(&clip_dir, None).unwrap();
    // The transformer first: without the check up front it would be adapted before the
    // text encoder's module fails.
    let pipeline = ddo_routes::Pipeline::new(vec![
        Arc::clone(transformer.component()),
        Arc::clone(clip.component()),
    ])
    .unwrap();
    let with_te = |path: &Path, layer: usize| {
        kohya(path, &[("double_blocks_0_img_mlp_0", 128, 32)]);
        // Add a CLIP module to the same file.
        let bytes = std::fs::read(path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut t: Vec<(String, Vec<usize>, Vec<f32>)> = st
            .tensors()
            .into_iter()
            .map(|(n, v)| {
                let f: Vec<f32> = v
                    .data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                (n, v.shape().to_vec(), f)
            })
            .collect();
        let m = format!("lora_te1_text_model_encoder_layers_{layer}_self_attn_q_proj");
        t.push((format!("{m}.lora_down.weight"), vec![4, 32], vec![0.1; 128]));
        t.push((format!("{m}.lora_up.weight"), vec![32, 4], vec![0.1; 128]));
        write(path, &t);
        LoraFile::open(path).unwrap()
    };
    let bad = with_te(&dir.path().join("bad.safetensors"), 9);
    let e = ddo_nn::lora::set_pipeline_loras(&pipeline, &[(&bad, 1.0)], &*d, false).unwrap_err();
    assert!(e.to_string().contains("layers.9"), "{e}");
    assert_eq!(transformer.component().adapter_bytes(), 0, "half applied");
    assert_eq!(clip.component().adapter_bytes(), 0);
    let good = with_te(&dir.path().join("good.safetensors"), 1);
    let (bytes, left_out) =
        ddo_nn::lora::set_pipeline_loras(&pipeline, &[(&good, 0.5)], &*d, false).unwrap();
    assert!(left_out.is_empty());
    let (t, c) = (
        transformer.component().adapter_bytes(),
        clip.component().adapter_bytes(),
    );
    assert!(t > 0 && c > 0 && bytes == t + c);
    assert_eq!(
        ddo_nn::lora::set_pipeline_loras(&pipeline, &[], &*d, false).unwrap(),
        (0, Vec::new())
    );
    assert_eq!(
        transformer.component().adapter_bytes() + clip.component().adapter_bytes(),
        0
    );
    // Allowed to leave unmatched modules out: the bad file's transformer module applies,
    // its CLIP module for a layer the model lacks is named and left out.
    let (bytes, left_out) =
        ddo_nn::lora::set_pipeline_loras(&pipeline, &[(&bad, 1.0)], &*d, true).unwrap();
    assert_eq!(bytes, transformer.component().adapter_bytes());
    assert!(bytes > 0 && clip.component().adapter_bytes() == 0);
    assert_eq!(left_out.len(), 1, "{left_out:?}");
    assert!(
        left_out[0].contains("text_encoder.text_model.encoder.layers.9.self_attn.q_proj"),
        "{left_out:?}"
    );
}

/// `--lora-fuse` on the resident route: the adapters folded into the resident weights give
/// the unfused output (to rounding), cannot change while that route is attached, and the
/// weights on the host are untouched: after a detach, an unfused attach gives the unfused
/// output bit for bit.
#[test]
fn a_resident_route_folds_the_adapters_and_the_host_weights_stay() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("lora.safetensors");
    kohya(&path, &MODULES);
    let lora = LoraFile::open(&path).unwrap();
    let d = HostDevice::with_capacity(1 << 30).unwrap();
    let plain = FluxTransformer::load(&fixture_dir(), None).unwrap();
    let (_, plain_values) = run(&plain, &d, Some(RouteSpec::resident()));

    let model = FluxTransformer::load(&fixture_dir(), None).unwrap();
    apply_loras(model.component(), &[(&lora, 0.7)], &*d).unwrap();
    let (unfused_bytes, unfused) = run(&model, &d, Some(RouteSpec::resident()));

    model.component().set_adapter_fusion(true);
    let handle =
        enable_dynamic_offload(model.component(), d.clone(), RouteSpec::resident()).unwrap();
    let attached = model.component().attached().unwrap();
    let folded = model
        .component()
        .leaves()
        .iter()
        .filter(|l| attached.folds_adapters_of(l))
        .count();
    assert_eq!(folded, 10, "every adapted linear folded");
    let out = model.forward(&*d, &inputs()).unwrap();
    let fused = ops_of(&*d).unwrap().to_f32_vec(&out).unwrap();
    let err = rel_l2(&fused, &unfused);
    assert!(err <= 1e-5, "fused vs unfused: {err:e}");
    assert!(
        rel_l2(&fused, &plain_values) > 1e-3,
        "folding lost the LoRA"
    );
    // The LoRA cannot change under the folded weights.
    let e = apply_loras(model.component(), &[], &*d).unwrap_err();
    assert!(e.to_string().contains("--lora-fuse"), "{e}");
    drop((handle, attached));

    // Detached: the host weights were never written; unfused again, bit for bit.
    model.component().set_adapter_fusion(false);
    let (again, _) = run(&model, &d, Some(RouteSpec::resident()));
    assert_eq!(again, unfused_bytes);
}
