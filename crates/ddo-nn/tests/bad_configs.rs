//! Bad `config.json` values for the VAE and the Flux transformer: negative, zero, absurd,
//! wrongly typed and contradictory fields are typed `LoadError`s naming the field or the
//! file, with a hint — never a panic, and never an allocation sized by the bad value.

use std::path::Path;

use ddo_nn::LoadError;
use ddo_nn::flux::FluxTransformerConfig;
use ddo_nn::vae::AutoencoderKLConfig;

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
