//! Bad checkpoints through the loader (`CheckpointWeights`): duplicate names in a shard's
//! header or in a sharded index, shard names that escape the folder or name missing files.
//! Each is a typed `LoadError` naming the file and the tensor. (Header and layout cases
//! are property-tested on `Checkpoint` in `ddo-core/tests/safetensors.rs`; the loader's
//! other cases are in `loading.rs`.)

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use ddo_nn::{CheckpointWeights, LoadError};

struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        static N: AtomicU64 = AtomicU64::new(0);
        let p = std::env::temp_dir().join(format!(
            "ddo-nn-bad-{}-{}",
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

fn write_raw(path: &Path, header: &str, data: &[u8]) {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).unwrap();
}

fn err(result: Result<CheckpointWeights, LoadError>) -> LoadError {
    match result {
        Ok(w) => panic!("expected an error, got {:?}", w.names()),
        Err(e) => e,
    }
}

#[test]
fn a_duplicate_tensor_in_a_header_is_refused_naming_file_and_tensor() {
    let dir = TempDir::new();
    let file = dir.0.join("model.safetensors");
    write_raw(
        &file,
        r#"{"a.weight":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a.weight":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
        &[0; 8],
    );
    let e = err(CheckpointWeights::open_dir(&dir.0, None));
    assert!(matches!(e, LoadError::CorruptFile { .. }), "{e}");
    let text = e.to_string();
    assert!(
        text.contains("model.safetensors") && text.contains("duplicate name `a.weight`"),
        "{text}"
    );
}

#[test]
fn bad_sharded_indexes_name_the_index_and_the_tensor() {
    let dir = TempDir::new();
    write_raw(
        &dir.0.join("shard-1.safetensors"),
        r#"{"a.weight":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
        &[0; 4],
    );
    let index = dir.0.join("diffusion_pytorch_model.safetensors.index.json");
    let cases = [
        (
            r#"{"weight_map":{"a.weight":"shard-1.safetensors","a.weight":"shard-1.safetensors"}}"#,
            "duplicate name `a.weight`",
        ),
        (
            r#"{"weight_map":{"a.weight":"sub/../../shard-1.safetensors"}}"#,
            "`a.weight` is not a file name inside",
        ),
        (
            r#"{"weight_map":{"a.weight":"..\\..\\etc\\passwd"}}"#,
            "does not exist",
        ),
        (
            r#"{"weight_map":{"a.weight":""}}"#,
            "not a file name inside",
        ),
        (
            r#"{"weight_map":{"a.weight":"gone.safetensors"}}"#,
            "`gone.safetensors` (for `a.weight`) does not exist",
        ),
        (
            r#"{"weight_map":["a.weight"]}"#,
            "`weight_map` is not an object",
        ),
    ];
    for (text, needle) in cases {
        std::fs::write(&index, text).unwrap();
        let e = err(CheckpointWeights::open_dir(&dir.0, None));
        assert!(matches!(e, LoadError::BadIndex { .. }), "{text}: {e}");
        let shown = e.to_string();
        assert!(shown.contains(needle), "{text}: {shown}");
        assert!(shown.contains("index.json"), "{text}: {shown}");
    }
}

#[test]
fn a_corrupt_shard_is_named_by_its_own_path() {
    let dir = TempDir::new();
    std::fs::write(dir.0.join("shard-1.safetensors"), u64::MAX.to_le_bytes()).unwrap();
    std::fs::write(
        dir.0.join("model.safetensors.index.json"),
        r#"{"weight_map":{"a.weight":"shard-1.safetensors"}}"#,
    )
    .unwrap();
    let e = err(CheckpointWeights::open_dir(&dir.0, None));
    match &e {
        LoadError::CorruptFile { file, message } => {
            assert!(file.ends_with("shard-1.safetensors"), "{e}");
            assert!(message.contains("header length"), "{e}");
        }
        other => panic!("expected CorruptFile, got {other}"),
    }
}
