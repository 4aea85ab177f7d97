//! Bad `config.json` values for the VAE and the Flux transformer: negative, zero, absurd,
//! wrongly typed and contradictory fields are typed `LoadError`s naming the field or the
//! file, with a hint — never a panic, and never an allocation sized by the bad value. Numbers
//! that make the schedule or the latent scaling degenerate (issue 34: a VAE `scaling_factor`
//! of 1e-45, a `shift_factor` of 3e38, a scheduler `shift` of 1e-38, a `max_shift` of 1e30)
//! are refused from the file, naming the file, the field and the accepted range; Diffusers'
//! own values still load.

use std::path::Path;

use std::path::PathBuf;

use ddo_nn::LoadError;
use ddo_nn::flux::FluxTransformerConfig;
use ddo_nn::qwen_vae::QwenVaeConfig;
use ddo_nn::scheduler::{FlowMatchEulerConfig, FlowMatchEulerScheduler, flux_sigmas};
use ddo_nn::vae::AutoencoderKLConfig;

/// A scratch folder (removed on drop), made exclusively under a random name.
fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("ddo-nn-bad-configs-")
        .tempdir()
        .expect("scratch folder")
}

fn fixture_path(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(rel)
}

/// The JSON object of fixture file `rel` (under `fixtures/`).
fn fixture_object(rel: &str) -> serde_json::Map<String, serde_json::Value> {
    let text = std::fs::read_to_string(fixture_path(rel)).expect("fixture");
    serde_json::from_str(&text).expect("json")
}

/// `base` with `field` set to `value`, written to `dir/name`.
fn write_with(
    dir: &tempfile::TempDir,
    name: &str,
    base: &serde_json::Map<String, serde_json::Value>,
    field: &str,
    value: serde_json::Value,
) -> PathBuf {
    let path = dir.path().join(name);
    std::fs::write(&path, with(base, field, value)).unwrap();
    path
}

/// A refusal read from `file`: an `InvalidConfig` naming the file and `field`, whose message
/// gives the accepted range (`says`).
#[track_caller]
fn refused_from(e: LoadError, file: &Path, field: &str, says: &str) {
    let text = e.to_string();
    match &e {
        LoadError::InvalidConfig { field: f, .. } => {
            assert_eq!(f, &format!("{}: {field}", file.display()), "{text}");
        }
        other => panic!("expected InvalidConfig for {field}, got {other:?}"),
    }
    assert!(text.contains(says), "{field}: {text}");
}

fn fixture_json(name: &str) -> serde_json::Map<String, serde_json::Value> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
        .join("config.json");
    let text = std::fs::read_to_string(path).expect("config.json");
    serde_json::from_str(&text).expect("json")
}

fn with(
    base: &serde_json::Map<String, serde_json::Value>,
    field: &str,
    value: serde_json::Value,
) -> String {
    let mut m = base.clone();
    m.insert(field.into(), value);
    serde_json::Value::Object(m).to_string()
}

/// Checks the error is a config error that names `field` (for a wrongly typed value, the
/// file and the position) and says what would be valid.
fn check(e: LoadError, field: &str, what: &str) {
    let text = e.to_string();
    match &e {
        LoadError::InvalidConfig { field: f, hint, .. } => {
            assert_eq!(f, field, "{what}: {text}");
            assert!(!hint.is_empty(), "{what}: {text}");
        }
        LoadError::Config { file, message } => {
            assert!(file.ends_with("config.json"), "{what}: {text}");
            // serde reports a wrongly typed value by position, not by field name.
            assert!(
                message.contains(field) || message.contains("line 1 column"),
                "{what}: {text}"
            );
            assert!(message.contains("expected"), "{what}: {text}");
        }
        other => panic!("{what}: expected a config error, got {other:?}"),
    }
}

#[test]
fn bad_vae_configs_are_typed_errors() {
    use serde_json::json;
    let base = fixture_json("vae_sd");
    let origin = Path::new("/models/vae/config.json");
    let cases = [
        ("latent_channels", json!(-4)),
        ("latent_channels", json!(0)),
        ("latent_channels", json!("four")),
        ("block_out_channels", json!([32, -64])),
        ("block_out_channels", json!([0, 64])),
        ("layers_per_block", json!(1e30)),
        ("norm_num_groups", json!(7)),
        ("norm_num_groups", json!(0)),
        ("act_fn", json!("swish2")),
        ("out_channels", json!(-3)),
        ("up_block_types", json!(["UpDecoderBlock2D"])),
    ];
    for (field, value) in cases {
        let what = format!("{field}={value}");
        let text = with(&base, field, value);
        let e = match AutoencoderKLConfig::from_json(&text, origin) {
            Ok(c) => c.validate().map(|_| c).expect_err(&what),
            Err(e) => e,
        };
        // A group count that does not divide the widths is reported on the widths.
        let named = if field == "norm_num_groups" && text.contains("\"norm_num_groups\":7") {
            "block_out_channels"
        } else {
            field
        };
        check(e, named, &what);
    }
}

#[test]
fn bad_flux_configs_are_typed_errors() {
    use serde_json::json;
    let base = fixture_json("flux_transformer");
    let origin = Path::new("/models/transformer/config.json");
    let cases = [
        ("num_attention_heads", json!(0)),
        ("num_attention_heads", json!(-2)),
        ("attention_head_dim", json!(0)),
        ("axes_dims_rope", json!([4, 4, 4])),
        ("num_layers", json!("many")),
        ("in_channels", json!(0)),
        ("patch_size", json!(2)),
        ("joint_attention_dim", json!(0)),
    ];
    for (field, value) in cases {
        let what = format!("{field}={value}");
        let text = with(&base, field, value);
        let e = match FluxTransformerConfig::parse(&text, origin) {
            Ok(c) => c.validate().map(|_| c).expect_err(&what),
            Err(e) => e,
        };
        check(e, field, &what);
    }
}

/// The VAE numbers are refused from `config.json`, naming the file, the field and
/// the range; FLUX.1-dev's VAE values (0.3611, 0.1159) and SD's (0.18215, null) still load.
#[test]
fn degenerate_vae_scaling_is_refused_and_diffusers_values_load() {
    use serde_json::json;
    let dir = scratch();
    let base = fixture_object("vae_flux/config.json");
    for (field, value, says) in [
        ("scaling_factor", json!(1e-45), "[1e-6, 1e6]"),
        ("scaling_factor", json!(0.0), "[1e-6, 1e6]"),
        ("scaling_factor", json!(-0.3611), "[1e-6, 1e6]"),
        ("scaling_factor", json!(1e30), "[1e-6, 1e6]"),
        ("shift_factor", json!(3e38), "[-1e4, 1e4]"),
        ("shift_factor", json!(-1e5), "[-1e4, 1e4]"),
    ] {
        let file = write_with(&dir, "config.json", &base, field, value);
        let e = AutoencoderKLConfig::from_file(&file).expect_err(field);
        refused_from(e, &file, field, says);
    }
    let flux = AutoencoderKLConfig::from_file(&fixture_path("vae_flux/config.json")).unwrap();
    assert_eq!(
        (flux.scaling_factor, flux.shift_factor),
        (0.3611, Some(0.1159))
    );
    let sd = AutoencoderKLConfig::from_file(&fixture_path("vae_sd/config.json")).unwrap();
    assert_eq!((sd.scaling_factor, sd.shift_factor), (0.18215, None));
}

/// The Qwen-Image VAE's latent statistics: a standard deviation of 1e-45 (whose f32
/// reciprocal is Inf) or a mean of 3e38 is refused from the file; the fixture's and
/// Qwen-Image's own values load.
#[test]
fn degenerate_qwen_vae_statistics_are_refused() {
    use serde_json::json;
    let dir = scratch();
    let base = fixture_object("qwen_vae/config.json");
    let z = base["z_dim"].as_u64().unwrap() as usize;
    let mut std = vec![json!(1.5); z];
    std[1] = json!(1e-45);
    let file = write_with(&dir, "config.json", &base, "latents_std", json!(std));
    let e = QwenVaeConfig::from_file(&file).expect_err("std");
    refused_from(e, &file, "latents_std", "[1e-6, 1e6]");
    let mut mean = vec![json!(0.0); z];
    mean[0] = json!(3e38);
    let file = write_with(&dir, "config.json", &base, "latents_mean", json!(mean));
    let e = QwenVaeConfig::from_file(&file).expect_err("mean");
    refused_from(e, &file, "latents_mean", "[-1e4, 1e4]");
    QwenVaeConfig::from_file(&fixture_path("qwen_vae/config.json")).unwrap();
    QwenVaeConfig::from_file(&fixture_path("qwen_pipeline/vae/config.json")).unwrap();
    QwenVaeConfig::qwen_image().validate().unwrap();
}

/// The scheduler numbers (`shift` 1e-38, `max_shift` 1e30) and their kin are refused
/// from `scheduler_config.json`, naming the file, the field and the range; FLUX.1-dev's and
/// Qwen-Image's configs load and give finite, non-increasing schedules in [0, 1].
#[test]
fn degenerate_scheduler_numbers_are_refused_and_diffusers_values_load() {
    use serde_json::json;
    let dir = scratch();
    let base = fixture_object("flux_pipeline/scheduler/scheduler_config.json");
    for (field, value, says) in [
        ("shift", json!(1e-38), "[1e-3, 1e3]"),
        ("shift", json!(1e30), "[1e-3, 1e3]"),
        ("shift", json!(0.0), "[1e-3, 1e3]"),
        ("max_shift", json!(1e30), "[-20, 20]"),
        ("base_shift", json!(-1e30), "[-20, 20]"),
        ("max_image_seq_len", json!(1u64 << 40), "at most 1048576"),
        ("base_image_seq_len", json!(1u64 << 21), "at most 1048576"),
        ("shift_terminal", json!(-0.5), "[0, 1)"),
    ] {
        let file = write_with(&dir, "scheduler_config.json", &base, field, value);
        let e = FlowMatchEulerConfig::from_file(&file).expect_err(field);
        refused_from(e, &file, field, says);
    }
    let flux = FlowMatchEulerConfig::from_file(&fixture_path(
        "flux_pipeline/scheduler/scheduler_config.json",
    ))
    .unwrap();
    assert_eq!(flux, FlowMatchEulerConfig::flux());
    let qwen = FlowMatchEulerConfig::from_file(&fixture_path(
        "qwen_pipeline/scheduler/scheduler_config.json",
    ))
    .unwrap();
    assert_eq!(qwen, FlowMatchEulerConfig::qwen_image());
    for (config, tokens) in [(flux, 4096), (qwen, 8192)] {
        for steps in [1, 2, 28, 50] {
            let mut s = FlowMatchEulerScheduler::new(config.clone()).unwrap();
            if config.shift_terminal.is_some() && steps == 1 {
                continue; // refused on its own: 1 - last sigma is 0 (see scheduler.rs)
            }
            s.set_flux_schedule(steps, tokens).unwrap();
            let sig = s.sigmas();
            assert!(sig.iter().all(|v| v.is_finite() && (0.0..=1.0).contains(v)));
            assert!(sig.windows(2).all(|w| w[1] <= w[0]), "{sig:?}");
        }
    }
}

/// Numbers inside the load-time ranges that still make the schedule degenerate at a size
/// (an `exp(mu)` that overflows f32, linear shifting with a negative `mu`) are refused when
/// the schedule is set, changing nothing, with a message naming the config's fields.
#[test]
fn schedules_that_come_out_degenerate_are_refused_when_set() {
    // mu extrapolated far past max_image_seq_len: 20 at 256 tokens ... exp(mu) overflows.
    let steep = FlowMatchEulerConfig {
        base_shift: Some(-20.0),
        max_shift: Some(20.0),
        base_image_seq_len: 256,
        max_image_seq_len: 512,
        ..FlowMatchEulerConfig::flux()
    };
    let mut s = FlowMatchEulerScheduler::new(steep).unwrap();
    let e = s.set_flux_schedule(4, 1 << 20).unwrap_err().to_string();
    assert!(e.contains("exp(mu)") && e.contains("max_shift"), "{e}");
    assert!(s.sigmas().is_empty(), "nothing set");
    let linear = FlowMatchEulerConfig {
        time_shift_type: ddo_nn::scheduler::TimeShiftType::Linear,
        base_shift: Some(-0.5),
        max_shift: Some(-0.4),
        ..FlowMatchEulerConfig::flux()
    };
    let mut s = FlowMatchEulerScheduler::new(linear).unwrap();
    let e = s
        .set_sigmas(&flux_sigmas(4), Some(-0.5))
        .unwrap_err()
        .to_string();
    assert!(e.contains("sigma") && e.contains("degenerate"), "{e}");
}
