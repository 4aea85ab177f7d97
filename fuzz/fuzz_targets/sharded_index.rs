//! Fuzz target: any bytes as a sharded checkpoint's index
//! (`diffusion_pytorch_model.safetensors.index.json`) in a folder holding one valid shard,
//! through `CheckpointWeights::open_index`. It must return Ok or a typed `LoadError` —
//! never panic, and never open a file outside the folder (every shard it opened must be
//! the folder's own `shard.safetensors`).

#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use ddo_nn::{CheckpointWeights, LoadError, WeightSource};
use libfuzzer_sys::fuzz_target;

fn folder() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("ddo-fuzz-index-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let header = br#"{"a.weight":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header);
        bytes.extend_from_slice(&1.0f32.to_le_bytes());
        std::fs::write(dir.join("shard.safetensors"), bytes).expect("shard");
        dir
    })
}

fuzz_target!(|data: &[u8]| {
    let dir = folder();
    let index = dir.join("diffusion_pytorch_model.safetensors.index.json");
    std::fs::write(&index, data).expect("index");
    match CheckpointWeights::open_index(&index, None) {
        Ok(mut w) => {
            for name in w.names().iter().map(|n| n.to_string()).collect::<Vec<_>>() {
                let p = w
                    .param(&name, &[1], ddo_core::ParamKind::Parameter)
                    .expect("a listed tensor loads");
                let file = &p.source().expect("checkpoint-backed").file;
                assert_eq!(file, &dir.join("shard.safetensors"), "opened {file:?}");
            }
        }
        Err(
            LoadError::BadIndex { .. }
            | LoadError::Io { .. }
            | LoadError::CorruptFile { .. },
        ) => {}
        Err(other) => panic!("unexpected error kind: {other:?}"),
    }
});
