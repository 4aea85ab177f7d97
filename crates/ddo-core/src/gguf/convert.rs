//! A GGUF file dequantized at load into a safetensors [`Checkpoint`] made in memory, so that
//! every loader that reads safetensors (the original Flux layout's views and splits, the
//! dtype conversions, the unused-tensor checks) reads a GGUF file unchanged: each tensor
//! dequantized with the host reference ([`super::dequantize_into`]) and rounded once into
//! the target dtype, under its GGUF name and row-major shape, in file order, in one
//! anonymous mapping frozen read-only ([`CheckpointMap::in_memory`], labelled with the GGUF
//! file's path, so errors name it).
//!
//! The mapping holds the dequantized bytes (a Q8_0 FLUX.1-dev transformer: 12.7 GB of file,
//! 23.8 GB of bf16): streaming the blocks as stored is a later part of issue 37.

use super::{GgufFile, GgufTensorInfo};
use crate::checkpoint::Checkpoint;
use crate::dtype::DType;
use crate::error::{CoreError, Result};
use crate::host_memory::CheckpointMap;

/// The safetensors name of a dtype a GGUF tensor may be dequantized into.
fn safetensors_dtype(dtype: DType) -> Option<&'static str> {
    match dtype {
        DType::F32 => Some("F32"),
        DType::F16 => Some("F16"),
        DType::BF16 => Some("BF16"),
        _ => None,
    }
}

/// Every tensor of `file` dequantized into `dtype` (f32, f16 or bf16) as a safetensors
/// checkpoint in memory; tensors are filled on up to 8 threads.
pub fn dequantized_checkpoint(file: &GgufFile, dtype: DType) -> Result<Checkpoint> {
    let bad = |field: String, problem: String| CoreError::Gguf {
        path: file.path().to_path_buf(),
        field,
        problem,
    };
    let Some(st_dtype) = safetensors_dtype(dtype) else {
        return Err(bad(
            "the dtype to load into".into(),
            format!("is {dtype}; a GGUF file loads as f32, f16 or bf16"),
        ));
    };
    // The header: each tensor's place in the packed data, in file order.
    let esize = dtype.size_in_bytes();
    let mut header = serde_json::Map::new();
    let mut places: Vec<(&GgufTensorInfo, usize, usize)> = Vec::new();
    let mut at = 0usize;
    for t in file.tensors() {
        let len = t
            .elements()
            .checked_mul(esize)
            .ok_or_else(|| bad(format!("tensor `{}`", t.name), "overflows".into()))?;
        header.insert(
            t.name.clone(),
            serde_json::json!({
                "dtype": st_dtype,
                "shape": t.shape,
                "data_offsets": [at, at + len],
            }),
        );
        places.push((t, at, len));
        at += len;
    }
    let mut json = serde_json::Value::Object(header).to_string().into_bytes();
    // The data starts 8-byte aligned (spaces pad the JSON, as safetensors writers do).
    while !(8 + json.len()).is_multiple_of(8) {
        json.push(b' ');
    }
    let data_start = 8 + json.len();
    let total = data_start + at;
    let mut map = memmap2::MmapMut::map_anon(total.max(1)).map_err(|e| CoreError::Io {
        path: file.path().to_path_buf(),
        source: e,
    })?;
    map[..8].copy_from_slice(&(json.len() as u64).to_le_bytes());
    map[8..data_start].copy_from_slice(&json);
    crate::host_memory::fill_in_parallel(
        &mut map[data_start..total],
        &places,
        |t: &&GgufTensorInfo, window| -> Result<()> {
            let raw = file.raw(&t.name)?;
            let mut values = vec![0f32; t.elements()];
            super::dequantize_into(t.ggml_type, raw, &mut values)?;
            if dtype == DType::F32 {
                for (out, v) in window.chunks_exact_mut(4).zip(&values) {
                    out.copy_from_slice(&v.to_le_bytes());
                }
            } else {
                window.copy_from_slice(&dtype.encode_f32(&values)?);
            }
            Ok(())
        },
    )?;
    Checkpoint::from_map(CheckpointMap::in_memory(file.path(), map))
}
