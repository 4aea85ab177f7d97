//! LoRA files in every format DDO reads (issue 36), written here with the `safetensors`
//! crate in each format's key layout: each maps to the same Diffusers modules with the
//! same matrices and scale, fused modules split as Diffusers splits them (so each part's
//! `B A` is exactly its rows of the fused `up · down`), and files DDO does not apply are
//! typed errors naming what they hold.

mod common;

use std::path::{Path, PathBuf};

use common::{Tensors, write_safetensors};
use ddo_nn::LoadError;
use ddo_nn::lora::{LoraFamily, LoraFile, LoraFormat, LoraModule};
use tempfile::TempDir;

/// `[rows, cols]` values with a distinct pattern per seed.
fn values(rows: usize, cols: usize, seed: f32) -> Vec<f32> {
    (0..rows * cols)
        .map(|i| ((i as f32 * 0.37 + seed).sin() * 4.0).round() / 8.0)
        .collect()
}

/// Writes `tensors` as `dir/file` (f32, or bf16 with `bf16`) and returns its path.
fn write(
    dir: &Path,
    file: &str,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    bf16: bool,
) -> PathBuf {
    let path = dir.join(file);
    write_safetensors(&path, tensors, bf16);
    path
}

const IN: usize = 12;
const RANK: usize = 4;

/// The fused modules of one Flux LoRA, named by `name(original module)`, with down/up
/// suffixes and an alpha key where `alpha` is given.
fn flux_lora(
    name: &dyn Fn(&str) -> String,
    (down, up): (&str, &str),
    alpha: Option<(&str, f32)>,
) -> Tensors {
    let mut t = Vec::new();
    for (k, (module, out)) in [
        ("double_blocks.0.img_attn.qkv", 3 * IN),
        ("double_blocks.0.txt_mlp.2", IN),
        ("single_blocks.1.linear1", 3 * IN + 4 * IN),
        ("final_layer.adaLN_modulation.1", 2 * IN),
    ]
    .into_iter()
    .enumerate()
    {
        let n = name(module);
        t.push((
            format!("{n}{down}"),
            vec![RANK, IN],
            values(RANK, IN, k as f32),
        ));
        t.push((
            format!("{n}{up}"),
            vec![out, RANK],
            values(out, RANK, 10.0 + k as f32),
        ));
        if let Some((suffix, a)) = alpha {
            t.push((format!("{n}{suffix}"), vec![], vec![a]));
        }
    }
    t
}

/// `B A` of a module, `[out, in]`.
fn delta(m: &LoraModule) -> Vec<f32> {
    let (a, b) = (m.down.to_f32().unwrap(), m.up.to_f32().unwrap());
    let (out, r, inp) = (m.out_features(), m.rank(), m.in_features());
    let mut d = vec![0.0f32; out * inp];
    for o in 0..out {
        for i in 0..inp {
            d[o * inp + i] = (0..r).map(|k| b[o * r + k] * a[k * inp + i]).sum();
        }
    }
    d
}

fn module<'a>(f: &'a LoraFile, name: &str) -> &'a LoraModule {
    f.modules
        .iter()
        .find(|m| m.module == name)
        .unwrap_or_else(|| {
            panic!(
                "no {name} in {:?}",
                f.modules.iter().map(|m| &m.module).collect::<Vec<_>>()
            )
        })
}

/// Every format of the same Flux LoRA reads into the same modules, matrices and scales.
#[test]
fn every_flux_format_reads_into_the_same_modules() {
    let dir = TempDir::new().unwrap();
    let kohya = |m: &str| format!("lora_unet_{}", m.replace('.', "_"));
    let files = [
        (
            LoraFormat::Kohya,
            write(
                dir.path(),
                "kohya.safetensors",
                &flux_lora(
                    &kohya,
                    (".lora_down.weight", ".lora_up.weight"),
                    Some((".alpha", 2.0)),
                ),
                true,
            ),
        ),
        (
            LoraFormat::Kohya,
            write(
                dir.path(),
                "comfy.safetensors",
                &flux_lora(
                    &|m| format!("diffusion_model.{m}"),
                    (".lora_down.weight", ".lora_up.weight"),
                    Some((".alpha", 2.0)),
                ),
                true,
            ),
        ),
        (
            LoraFormat::Original,
            write(
                dir.path(),
                "original.safetensors",
                &flux_lora(
                    &|m| format!("diffusion_model.{m}"),
                    (".lora_A.weight", ".lora_B.weight"),
                    Some((".alpha", 2.0)),
                ),
                true,
            ),
        ),
    ];
    let read: Vec<LoraFile> = files
        .iter()
        .map(|(format, path)| {
            let f = LoraFile::open(path).unwrap();
            assert_eq!(f.format, *format, "{}", path.display());
            assert_eq!(f.family(), Some(LoraFamily::Flux));
            f
        })
        .collect();
    for f in &read[1..] {
        assert_eq!(f.modules, read[0].modules, "{}", f.path.display());
    }
    let f = &read[0];
    // qkv (3) + txt_mlp.2 + linear1 (4) + norm_out = 9 modules, all rank 4, alpha 2 / 4.
    assert_eq!(f.modules.len(), 9);
    assert!(f.modules.iter().all(|m| m.rank() == RANK && m.scale == 0.5));
    assert_eq!(f.ranks().get(&RANK), Some(&9));
    // The split: each part's B A is its rows of the fused up · down.
    let fused = |k: usize, out: usize| -> Vec<f32> {
        let (a, b) = (
            values(RANK, IN, k as f32),
            values(out, RANK, 10.0 + k as f32),
        );
        let bf = |v: Vec<f32>| -> Vec<f32> {
            v.into_iter()
                .map(|x| half::bf16::from_f32(x).to_f32())
                .collect()
        };
        let (a, b) = (bf(a), bf(b));
        let mut d = vec![0.0f32; out * IN];
        for o in 0..out {
            for i in 0..IN {
                d[o * IN + i] = (0..RANK).map(|r| b[o * RANK + r] * a[r * IN + i]).sum();
            }
        }
        d
    };
    let qkv = fused(0, 3 * IN);
    for (j, part) in ["to_q", "to_k", "to_v"].iter().enumerate() {
        let m = module(f, &format!("transformer_blocks.0.attn.{part}"));
        assert_eq!(m.out_features(), IN);
        assert_eq!(delta(m), qkv[j * IN * IN..(j + 1) * IN * IN], "{part}");
    }
    let linear1 = fused(2, 7 * IN);
    let mlp = module(f, "single_transformer_blocks.1.proj_mlp");
    assert_eq!(mlp.out_features(), 4 * IN);
    assert_eq!(delta(mlp), linear1[3 * IN * IN..]);
    assert_eq!(
        delta(module(f, "single_transformer_blocks.1.attn.to_k")),
        linear1[IN * IN..2 * IN * IN]
    );
    // norm_out.linear: Diffusers' `scale, shift` order, the original's halves swapped.
    let norm = fused(3, 2 * IN);
    let d = delta(module(f, "norm_out.linear"));
    assert_eq!(d[..IN * IN], norm[IN * IN..]);
    assert_eq!(d[IN * IN..], norm[..IN * IN]);
    assert_eq!(
        delta(module(f, "transformer_blocks.0.ff_context.net.2")),
        fused(1, IN)
    );
    let text = f.format_text();
    assert!(
        text.contains("kohya/sd-scripts format, fits flux"),
        "{text}"
    );
    assert!(text.contains("rank: 4 (9 modules)"), "{text}");
    assert!(text.contains("transformer_blocks.*.attn.to_q"), "{text}");
}

/// Diffusers / PEFT keys (with an alpha, a PEFT adapter name, the CLIP prefix), XLabs and
/// kohya text-encoder keys, and Qwen-Image's kohya names.
#[test]
fn diffusers_xlabs_text_encoder_and_qwen_keys_map_to_their_modules() {
    let dir = TempDir::new().unwrap();
    let m = |name: &str, out: usize, seed: f32| {
        vec![
            (
                format!("{name}.lora_A.default.weight"),
                vec![RANK, IN],
                values(RANK, IN, seed),
            ),
            (
                format!("{name}.lora_B.default.weight"),
                vec![out, RANK],
                values(out, RANK, seed + 1.0),
            ),
        ]
    };
    let mut t = m("transformer.transformer_blocks.0.attn.to_q", IN, 0.0);
    t.extend(m(
        "transformer.single_transformer_blocks.0.proj_mlp",
        4 * IN,
        2.0,
    ));
    t.extend(m(
        "text_encoder.text_model.encoder.layers.0.self_attn.k_proj",
        IN,
        4.0,
    ));
    t.push((
        "transformer.transformer_blocks.0.attn.to_q.alpha".into(),
        vec![],
        vec![8.0],
    ));
    let f = LoraFile::open(&write(dir.path(), "peft.safetensors", &t, false)).unwrap();
    assert_eq!(f.format, LoraFormat::Diffusers);
    assert_eq!(f.family(), Some(LoraFamily::Flux));
    assert_eq!(module(&f, "transformer_blocks.0.attn.to_q").scale, 2.0);
    assert_eq!(
        module(&f, "single_transformer_blocks.0.proj_mlp").scale,
        1.0
    );
    let clip = module(&f, "text_model.encoder.layers.0.self_attn.k_proj");
    assert_eq!(clip.component, "text_encoder");
    assert_eq!(clip.up.to_f32().unwrap(), values(IN, RANK, 5.0));

    // XLabs: img and txt qkv, the single block's q/k/v (thirds, no MLP) and proj.
    let x = |name: &str, out: usize, seed: f32| {
        vec![
            (
                format!("{name}.down.weight"),
                vec![RANK, IN],
                values(RANK, IN, seed),
            ),
            (
                format!("{name}.up.weight"),
                vec![out, RANK],
                values(out, RANK, seed + 1.0),
            ),
        ]
    };
    let mut t = x("double_blocks.2.processor.qkv_lora2", 3 * IN, 0.0);
    t.extend(x("double_blocks.2.processor.proj_lora1", IN, 2.0));
    t.extend(x("single_blocks.0.processor.qkv_lora", 3 * IN, 4.0));
    t.extend(x("single_blocks.0.processor.proj_lora", IN, 6.0));
    let f = LoraFile::open(&write(dir.path(), "xlabs.safetensors", &t, false)).unwrap();
    assert_eq!(f.format, LoraFormat::XLabs);
    let names: Vec<&str> = f.modules.iter().map(|m| m.module.as_str()).collect();
    assert_eq!(
        names,
        [
            "single_transformer_blocks.0.attn.to_k",
            "single_transformer_blocks.0.attn.to_q",
            "single_transformer_blocks.0.attn.to_v",
            "single_transformer_blocks.0.proj_out",
            "transformer_blocks.2.attn.add_k_proj",
            "transformer_blocks.2.attn.add_q_proj",
            "transformer_blocks.2.attn.add_v_proj",
            "transformer_blocks.2.attn.to_out.0",
        ]
    );
    assert_eq!(
        module(&f, "transformer_blocks.2.attn.add_v_proj")
            .up
            .to_f32()
            .unwrap(),
        values(3 * IN, RANK, 1.0)[2 * IN * RANK..]
    );

    // kohya text encoders and Qwen-Image blocks.
    let k = |name: &str, out: usize, seed: f32| {
        vec![
            (
                format!("{name}.lora_down.weight"),
                vec![RANK, IN],
                values(RANK, IN, seed),
            ),
            (
                format!("{name}.lora_up.weight"),
                vec![out, RANK],
                values(out, RANK, seed + 1.0),
            ),
            (format!("{name}.alpha"), vec![], vec![1.0]),
        ]
    };
    let mut t = k(
        "lora_unet_transformer_blocks_0_img_mlp_net_0_proj",
        4 * IN,
        0.0,
    );
    t.extend(k("lora_unet_transformer_blocks_3_attn_add_q_proj", IN, 2.0));
    t.extend(k(
        "lora_te1_text_model_encoder_layers_1_mlp_fc1",
        4 * IN,
        4.0,
    ));
    t.extend(k(
        "lora_te2_encoder_block_5_layer_0_SelfAttention_o",
        IN,
        6.0,
    ));
    let f = LoraFile::open(&write(dir.path(), "qwen.safetensors", &t, true)).unwrap();
    assert_eq!(f.format, LoraFormat::Kohya);
    assert_eq!(f.family(), Some(LoraFamily::QwenImage));
    let comps: Vec<(&str, &str)> = f
        .modules
        .iter()
        .map(|m| (m.component, m.module.as_str()))
        .collect();
    assert_eq!(
        comps,
        [
            ("text_encoder", "text_model.encoder.layers.1.mlp.fc1"),
            ("text_encoder_2", "encoder.block.5.layer.0.SelfAttention.o"),
            ("transformer", "transformer_blocks.0.img_mlp.net.0.proj"),
            ("transformer", "transformer_blocks.3.attn.add_q_proj"),
        ]
    );
    assert!(f.modules.iter().all(|m| m.scale == 0.25));
}

fn problem(path: &Path) -> String {
    match LoraFile::open(path) {
        Err(e @ LoadError::Lora { .. }) => {
            let text = e.to_string();
            assert!(text.contains(&path.display().to_string()), "{text}");
            assert!(text.contains("ddo inspect"), "{text}");
            text
        }
        other => panic!("{}: {other:?}", path.display()),
    }
}

/// What DDO does not read or apply is a typed error naming the file and what it holds.
#[test]
fn files_ddo_does_not_apply_are_named_errors() {
    let dir = TempDir::new().unwrap();
    let pair = |name: &str, rank_up: usize, out: usize| {
        vec![
            (
                format!("{name}.lora_down.weight"),
                vec![RANK, IN],
                values(RANK, IN, 0.0),
            ),
            (
                format!("{name}.lora_up.weight"),
                vec![out, rank_up],
                values(out, rank_up, 1.0),
            ),
        ]
    };
    let cases: Vec<(&str, Tensors, &str)> = vec![
        (
            "weights",
            vec![(
                "double_blocks.0.img_attn.qkv.weight".into(),
                vec![IN, IN],
                values(IN, IN, 0.0),
            )],
            "no LoRA keys",
        ),
        (
            "rank",
            pair("lora_unet_double_blocks_0_img_mlp_0", RANK + 1, IN),
            "rank 4",
        ),
        (
            "sdxl",
            pair("lora_unet_input_blocks_4_1_proj_in", RANK, IN),
            "match no layer",
        ),
        (
            "thirds",
            pair("lora_unet_double_blocks_0_img_attn_qkv", RANK, 3 * IN + 1),
            "do not split",
        ),
        (
            "half",
            {
                let mut t = pair("lora_unet_double_blocks_0_img_mlp_0", RANK, IN);
                t.remove(1);
                t
            },
            "no up-projection",
        ),
        (
            "alpha",
            {
                let mut t = pair("lora_unet_double_blocks_0_img_mlp_0", RANK, IN);
                t.push((
                    "lora_unet_double_blocks_0_img_mlp_0.alpha".into(),
                    vec![],
                    vec![-1.0],
                ));
                t
            },
            "finite positive",
        ),
        (
            "nan",
            {
                let mut t = pair("lora_unet_double_blocks_0_img_mlp_0", RANK, IN);
                t[1].2[5] = f32::NAN;
                t
            },
            "finite",
        ),
        (
            "dora",
            {
                let mut t = pair("lora_unet_double_blocks_0_img_mlp_0", RANK, IN);
                t.push((
                    "lora_unet_double_blocks_0_img_mlp_0.dora_scale".into(),
                    vec![1, IN],
                    values(1, IN, 0.0),
                ));
                t
            },
            "DoRA",
        ),
        (
            "control",
            {
                let mut t = pair("lora_unet_double_blocks_0_img_mlp_0", RANK, IN);
                t.push((
                    "double_blocks.0.img_attn.norm.query_norm.scale".into(),
                    vec![IN],
                    values(1, IN, 0.0),
                ));
                t
            },
            "Flux Control",
        ),
    ];
    for (name, tensors, needle) in cases {
        let path = write(dir.path(), &format!("{name}.safetensors"), &tensors, false);
        let text = problem(&path);
        assert!(text.contains(needle), "{name}: {text}");
    }
    // Not a safetensors file at all: the checkpoint reader's typed error.
    let junk = dir.path().join("junk.safetensors");
    std::fs::write(&junk, b"not a safetensors file").unwrap();
    assert!(LoraFile::open(&junk).is_err());
}
