//! Loading Diffusers-format safetensors through `CheckpointWeights`: checkpoint-backed
//! params, dtype conversion on load, sharded indexes, and a typed error naming the tensor
//! and the file for every bad-file case.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use ddo_core::{DType, ParamKind};
use ddo_nn::{CheckpointWeights, LoadError, WeightSource, read_f32_tensor};

struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let p = std::env::temp_dir().join(format!(
            "ddo-nn-load-{}-{}",
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

/// Writes a safetensors file by hand: header JSON (given) + data bytes.
fn write_raw(path: &Path, header: &str, data: &[u8]) {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).unwrap();
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// A valid two-tensor f32 file: `a.weight` [2, 2] and `a.bias` [2].
fn good_file(path: &Path) {
    let header = r#"{"a.weight":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"a.bias":{"dtype":"F32","shape":[2],"data_offsets":[16,24]},"__metadata__":{"format":"pt"}}"#;
    write_raw(path, header, &f32_bytes(&[1.0, 2.0, 3.0, 4.0, 0.5, -0.5]));
}

fn expect_err(result: Result<impl std::fmt::Debug, LoadError>) -> LoadError {
    match result {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e,
    }
}

#[test]
fn same_dtype_params_stay_checkpoint_backed_and_conversion_makes_an_owned_copy() {
    let dir = TempDir::new();
    let file = dir.0.join("diffusion_pytorch_model.safetensors");
    good_file(&file);
    let mut w = CheckpointWeights::open_dir(&dir.0, None).unwrap();
    let p = w.param("a.weight", &[2, 2], ParamKind::Parameter).unwrap();
    assert!(p.is_checkpoint_backed());
    assert_eq!(p.dtype(), DType::F32);
    assert_eq!(p.source().unwrap().tensor, "a.weight");

    let mut w = CheckpointWeights::open_file(&file, Some(DType::BF16)).unwrap();
    let p = w.param("a.weight", &[2, 2], ParamKind::Parameter).unwrap();
    assert!(!p.is_checkpoint_backed());
    assert_eq!(p.dtype(), DType::BF16);
    assert_eq!(p.nbytes(), 8);
    let values = p.host().with_bytes(|b| DType::BF16.decode_f32(b)).unwrap();
    assert_eq!(values, vec![1.0, 2.0, 3.0, 4.0]);
}

#[test]
fn a_missing_tensor_names_the_tensor_and_the_file() {
    let dir = TempDir::new();
    let file = dir.0.join("model.safetensors");
    good_file(&file);
    let mut w = CheckpointWeights::open_file(&file, None).unwrap();
    let e = expect_err(w.param("b.weight", &[2], ParamKind::Parameter));
    assert!(
        matches!(&e, LoadError::MissingTensor { name, file: f } if name == "b.weight" && f == &file),
        "{e}"
    );
    assert!(e.to_string().contains("b.weight") && e.to_string().contains("model.safetensors"));
}

#[test]
fn a_shape_mismatch_names_the_tensor_file_and_both_shapes() {
    let dir = TempDir::new();
    let file = dir.0.join("model.safetensors");
    good_file(&file);
    let mut w = CheckpointWeights::open_file(&file, None).unwrap();
    let e = expect_err(w.param("a.weight", &[4, 1], ParamKind::Parameter));
    match &e {
        LoadError::ShapeMismatch {
            name,
            file: f,
            expected,
            found,
        } => {
            assert_eq!(
                (name.as_str(), f, expected.as_slice(), found.as_slice()),
                ("a.weight", &file, &[4, 1][..], &[2, 2][..])
            );
        }
        other => panic!("{other}"),
    }
}

#[test]
fn an_unsupported_dtype_names_the_tensor_and_is_refused_only_when_asked_for() {
    let dir = TempDir::new();
    let file = dir.0.join("model.safetensors");
    let header = r#"{"ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]},"x":{"dtype":"F32","shape":[1],"data_offsets":[16,20]}}"#;
    let mut data = vec![0u8; 16];
    data.extend_from_slice(&2.5f32.to_le_bytes());
    write_raw(&file, header, &data);
    let mut w = CheckpointWeights::open_file(&file, None).unwrap();
    assert!(w.param("x", &[1], ParamKind::Buffer).is_ok());
    let e = expect_err(w.param("ids", &[2], ParamKind::Buffer));
    assert!(
        e.to_string().contains("ids") && e.to_string().contains("I64"),
        "{e}"
    );
    assert_eq!(read_f32_tensor(&file, "x").unwrap(), (vec![1], vec![2.5]));
    assert!(read_f32_tensor(&file, "ids").is_err());
}

/// fp8 tensors (ComfyUI's and Diffusers' `F8_E4M3`, `F8_E5M2`) load as stored, one byte
/// per element, beside tensors of other dtypes in the same file; asked for another dtype
/// they are converted exactly (every fp8 value is a bf16 value).
#[test]
fn fp8_tensors_load_as_stored_or_convert_exactly() {
    let dir = TempDir::new();
    let file = dir.0.join("model.safetensors");
    let codes: Vec<u8> = vec![0x00, 0x38, 0xB8, 0x7E, 0x01, 0x44, 0x3C, 0xC0];
    let header = r#"{"w":{"dtype":"F8_E4M3","shape":[2,4],"data_offsets":[0,8]},"v":{"dtype":"F8_E5M2","shape":[8],"data_offsets":[8,16]},"b":{"dtype":"BF16","shape":[2],"data_offsets":[16,20]}}"#;
    let mut data = codes.clone();
    data.extend_from_slice(&codes);
    data.extend_from_slice(&[0x80, 0x3F, 0x00, 0x40]); // bf16 1.0, 2.0
    write_raw(&file, header, &data);
    let bytes = |p: &ddo_core::Param| p.host().with_bytes(|b| b.to_vec());
    let mut w = CheckpointWeights::open_file(&file, None).unwrap();
    let p = w.param("w", &[2, 4], ParamKind::Parameter).unwrap();
    assert_eq!((p.dtype(), bytes(&p)), (DType::F8E4M3, codes.clone()));
    let p = w.param("v", &[8], ParamKind::Parameter).unwrap();
    assert_eq!((p.dtype(), bytes(&p)), (DType::F8E5M2, codes.clone()));
    assert_eq!(
        w.param("b", &[2], ParamKind::Parameter).unwrap().dtype(),
        DType::BF16
    );
    let mut w = CheckpointWeights::open_file(&file, Some(DType::BF16)).unwrap();
    let p = w.param("w", &[2, 4], ParamKind::Parameter).unwrap();
    let values = DType::F8E4M3.decode_f32(&codes).unwrap();
    assert_eq!(values[1], 1.0);
    assert_eq!(values[3], 448.0);
    assert_eq!(p.dtype(), DType::BF16);
    assert_eq!(bytes(&p), DType::BF16.encode_f32(&values).unwrap());
    assert_eq!(
        p.host().with_bytes(|b| DType::BF16.decode_f32(b)).unwrap(),
        values,
        "exact"
    );
}

/// A scaled fp8 weight: `<layer>.scale_weight` (ComfyUI) or `<layer>.weight_scale`
/// (ModelOpt, compressed-tensors) is read as its one f32/f16/bf16 value and carried by the
/// param; conversion to another dtype dequantizes with it; both names count as used, as
/// does ComfyUI's `scale_input`.
#[test]
fn fp8_scale_tensors_are_read_applied_on_conversion_and_count_as_used() {
    let dir = TempDir::new();
    let codes: Vec<u8> = vec![0x38, 0xB8, 0x40, 0x30]; // e4m3: 1, -1, 2, 0.5
    for scale_name in ["scale_weight", "weight_scale"] {
        let file = dir.0.join(format!("{scale_name}.safetensors"));
        let header = format!(
            r#"{{"l.weight":{{"dtype":"F8_E4M3","shape":[2,2],"data_offsets":[0,4]}},"l.{scale_name}":{{"dtype":"F32","shape":[],"data_offsets":[4,8]}},"l.scale_input":{{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}}}"#
        );
        let mut data = codes.clone();
        data.extend_from_slice(&0.25f32.to_le_bytes());
        data.extend_from_slice(&1.0f32.to_le_bytes());
        write_raw(&file, &header, &data);
        let mut w = CheckpointWeights::open_file(&file, None).unwrap();
        let p = w.param("l.weight", &[2, 2], ParamKind::Parameter).unwrap();
        assert_eq!(
            (p.dtype(), p.scale()),
            (DType::F8E4M3, Some(0.25)),
            "{scale_name}"
        );
        assert_eq!(p.host().to_vec(), codes, "stored bytes as in the file");
        assert_eq!(
            p.host_tensor().unwrap().host_f32().unwrap(),
            vec![0.25, -0.25, 0.5, 0.125]
        );
        assert!(w.unused(&[]).is_empty(), "{:?}", w.unused(&[]));
        let mut w = CheckpointWeights::open_file(&file, Some(DType::BF16)).unwrap();
        let p = w.param("l.weight", &[2, 2], ParamKind::Parameter).unwrap();
        assert_eq!((p.dtype(), p.scale()), (DType::BF16, None));
        assert_eq!(
            p.host().with_bytes(|b| DType::BF16.decode_f32(b)).unwrap(),
            vec![0.25, -0.25, 0.5, 0.125],
            "converted as dequantized"
        );
    }
}

/// A scale that is zero, negative, NaN, infinite, so large the weight overflows (1e38),
/// not one element, not a float, doubled, or beside a weight that is not fp8 is a typed
/// error naming the weight, the scale and the file; nothing is loaded.
#[test]
fn bad_fp8_scales_are_typed_errors_naming_the_tensor() {
    let dir = TempDir::new();
    let f32_scale = |v: f32| {
        (
            r#""dtype":"F32","shape":[1]"#.to_string(),
            v.to_le_bytes().to_vec(),
        )
    };
    let cases: Vec<(&str, String, String, Vec<u8>, &str)> = vec![
        (
            "zero",
            "F8_E4M3".into(),
            f32_scale(0.0).0,
            f32_scale(0.0).1,
            "not a finite positive",
        ),
        (
            "negative",
            "F8_E4M3".into(),
            f32_scale(-1.0).0,
            f32_scale(-1.0).1,
            "not a finite positive",
        ),
        (
            "nan",
            "F8_E4M3".into(),
            f32_scale(f32::NAN).0,
            f32_scale(f32::NAN).1,
            "not a finite positive",
        ),
        (
            "inf",
            "F8_E4M3".into(),
            f32_scale(f32::INFINITY).0,
            f32_scale(f32::INFINITY).1,
            "not a finite positive",
        ),
        (
            "huge",
            "F8_E4M3".into(),
            f32_scale(1e38).0,
            f32_scale(1e38).1,
            "above",
        ),
        (
            "per-channel",
            "F8_E4M3".into(),
            r#""dtype":"F32","shape":[2]"#.into(),
            [1.0f32, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect(),
            "one element",
        ),
        (
            "fp8 scale",
            "F8_E4M3".into(),
            r#""dtype":"F8_E4M3","shape":[1]"#.into(),
            vec![0x38],
            "not f32",
        ),
        (
            "not fp8",
            "BF16".into(),
            f32_scale(0.5).0,
            f32_scale(0.5).1,
            "not an 8-bit float",
        ),
    ];
    for (label, wdtype, scale_meta, scale_bytes, says) in cases {
        let file = dir
            .0
            .join(format!("{}.safetensors", label.replace(' ', "_")));
        let wlen = if wdtype == "BF16" { 8 } else { 4 };
        let header = format!(
            r#"{{"l.weight":{{"dtype":"{wdtype}","shape":[2,2],"data_offsets":[0,{wlen}]}},"l.scale_weight":{{{scale_meta},"data_offsets":[{wlen},{}]}}}}"#,
            wlen + scale_bytes.len()
        );
        let mut data = vec![0x38u8; wlen];
        data.extend_from_slice(&scale_bytes);
        write_raw(&file, &header, &data);
        let mut w = CheckpointWeights::open_file(&file, None).unwrap();
        let e = expect_err(w.param("l.weight", &[2, 2], ParamKind::Parameter));
        let msg = e.to_string();
        assert!(
            matches!(&e, LoadError::BadScale { tensor, scale, .. } if tensor == "l.weight" && scale == "l.scale_weight"),
            "{label}: {e:?}"
        );
        assert!(
            msg.contains(says) && msg.contains(&file.display().to_string()),
            "{label}: {msg}"
        );
    }
    // Both names for one weight.
    let file = dir.0.join("both.safetensors");
    let header = r#"{"l.weight":{"dtype":"F8_E4M3","shape":[2,2],"data_offsets":[0,4]},"l.scale_weight":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},"l.weight_scale":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#;
    let mut data = vec![0x38u8; 4];
    data.extend_from_slice(&1.0f32.to_le_bytes());
    data.extend_from_slice(&1.0f32.to_le_bytes());
    write_raw(&file, header, &data);
    let mut w = CheckpointWeights::open_file(&file, None).unwrap();
    let e = expect_err(w.param("l.weight", &[2, 2], ParamKind::Parameter));
    assert!(e.to_string().contains("keep one scale"), "{e}");
}

#[test]
fn quantized_storage_is_refused_by_model_loading() {
    let dir = TempDir::new();
    let file = dir.0.join("model.safetensors");
    write_raw(
        &file,
        r#"{"q":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#,
        &[1, 2, 3, 4],
    );
    let mut w = CheckpointWeights::open_file(&file, None).unwrap();
    let e = expect_err(w.param("q", &[4], ParamKind::Parameter));
    assert!(
        matches!(&e, LoadError::UnsupportedDtype { name, .. } if name == "q"),
        "{e}"
    );
}

#[test]
fn truncated_and_corrupt_files_are_typed_errors_naming_file_and_tensor() {
    let dir = TempDir::new();
    let file = dir.0.join("model.safetensors");
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("shorter than the length", vec![1, 2, 3], "shorter"),
        (
            "absurd header length",
            {
                let mut b = u64::MAX.to_le_bytes().to_vec();
                b.extend_from_slice(b"{}");
                b
            },
            "header length",
        ),
        (
            "header not JSON",
            {
                let mut b = 5u64.to_le_bytes().to_vec();
                b.extend_from_slice(b"{nope");
                b
            },
            "JSON",
        ),
        (
            "header not UTF-8",
            {
                let mut b = 2u64.to_le_bytes().to_vec();
                b.extend_from_slice(&[0xff, 0xfe]);
                b
            },
            "UTF-8",
        ),
    ];
    for (label, bytes, needle) in cases {
        std::fs::write(&file, bytes).unwrap();
        let e = expect_err(CheckpointWeights::open_file(&file, None));
        assert!(matches!(e, LoadError::CorruptFile { .. }), "{label}: {e}");
        assert!(e.to_string().contains(needle), "{label}: {e}");
        assert!(e.to_string().contains("model.safetensors"), "{label}: {e}");
    }
    // Truncated data: the header promises more bytes than the file holds.
    let header = r#"{"a.weight":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}"#;
    write_raw(&file, header, &[0u8; 10]);
    let e = expect_err(CheckpointWeights::open_file(&file, None));
    assert!(
        e.to_string().contains("a.weight") && e.to_string().contains("truncated"),
        "{e}"
    );
    // Byte count that does not match the shape.
    let header = r#"{"a.weight":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#;
    write_raw(&file, header, &[0u8; 8]);
    let e = expect_err(CheckpointWeights::open_file(&file, None));
    assert!(
        e.to_string().contains("a.weight") && e.to_string().contains("needs 12 B"),
        "{e}"
    );
    // Overlapping tensors.
    let header = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
    write_raw(&file, header, &[0u8; 12]);
    let e = expect_err(CheckpointWeights::open_file(&file, None));
    assert!(e.to_string().contains("overlap"), "{e}");
    // A missing file.
    let e = expect_err(CheckpointWeights::open_file(
        &dir.0.join("absent.safetensors"),
        None,
    ));
    assert!(matches!(e, LoadError::Io { .. }), "{e}");
}

#[test]
fn sharded_checkpoints_load_through_their_index() {
    let dir = TempDir::new();
    write_raw(
        &dir.0.join("shard-1.safetensors"),
        r#"{"a.weight":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
        &f32_bytes(&[1.0, 2.0]),
    );
    write_raw(
        &dir.0.join("shard-2.safetensors"),
        r#"{"b.weight":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
        &f32_bytes(&[3.0]),
    );
    std::fs::write(
        dir.0.join("diffusion_pytorch_model.safetensors.index.json"),
        r#"{"metadata":{},"weight_map":{"a.weight":"shard-1.safetensors","b.weight":"shard-2.safetensors"}}"#,
    )
    .unwrap();
    let mut w = CheckpointWeights::open_dir(&dir.0, None).unwrap();
    assert_eq!(w.names(), vec!["a.weight", "b.weight"]);
    let b = w.param("b.weight", &[1], ParamKind::Parameter).unwrap();
    assert!(b.source().unwrap().file.ends_with("shard-2.safetensors"));
}

#[test]
fn bad_sharded_indexes_are_refused() {
    let dir = TempDir::new();
    write_raw(
        &dir.0.join("shard-1.safetensors"),
        r#"{"a.weight":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
        &f32_bytes(&[1.0, 2.0]),
    );
    let index = dir.0.join("model.safetensors.index.json");
    let cases = [
        (
            r#"{"weight_map":{"a.weight":"../shard-1.safetensors"}}"#,
            "not a file name inside",
        ),
        (
            r#"{"weight_map":{"a.weight":"/etc/passwd"}}"#,
            "not a file name inside",
        ),
        (
            r#"{"weight_map":{"a.weight":"missing.safetensors"}}"#,
            "does not exist",
        ),
        (
            r#"{"weight_map":{"z.weight":"shard-1.safetensors"}}"#,
            "does not hold it",
        ),
        (r#"{"weight_map":{"a.weight":7}}"#, "not a string"),
        (r#"{"metadata":{}}"#, "weight_map"),
        ("not json", "not JSON"),
    ];
    for (text, needle) in cases {
        std::fs::write(&index, text).unwrap();
        let e = expect_err(CheckpointWeights::open_dir(&dir.0, None));
        assert!(matches!(e, LoadError::BadIndex { .. }), "{text}: {e}");
        assert!(e.to_string().contains(needle), "{text}: {e}");
    }
}

#[test]
fn a_folder_without_weights_says_what_it_looked_for() {
    let dir = TempDir::new();
    let e = expect_err(CheckpointWeights::open_dir(&dir.0, None));
    assert!(matches!(e, LoadError::NoWeights { .. }), "{e}");
    assert!(
        e.to_string()
            .contains("diffusion_pytorch_model.safetensors"),
        "{e}"
    );
}

#[test]
fn tensors_no_model_asked_for_are_reported_unless_ignored_or_allowed() {
    use ddo_nn::UnusedWeights;
    let dir = TempDir::new();
    let path = dir.0.join("model.safetensors");
    good_file(&path);
    let mut w = CheckpointWeights::open_file(&path, None).unwrap();
    w.param("a.weight", &[2, 2], ParamKind::Parameter).unwrap();
    assert_eq!(w.unused(&[]), ["a.bias"]);
    assert!(w.unused(&["a.b"]).is_empty(), "an ignored prefix");
    match expect_err(w.check_unused(&[], UnusedWeights::Refuse).map(|_| ())) {
        LoadError::UnusedWeights {
            count, examples, ..
        } => {
            assert_eq!(count, 1);
            assert!(examples.contains("a.bias"), "{examples}");
        }
        other => panic!("{other:?}"),
    }
    w.check_unused(&[], UnusedWeights::Allow).unwrap();
    w.param("a.bias", &[2], ParamKind::Parameter).unwrap();
    w.check_unused(&[], UnusedWeights::Refuse).unwrap();
}
