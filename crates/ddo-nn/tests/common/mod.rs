//! Helpers the LoRA tests share.
#![allow(dead_code)]

use std::path::Path;

use safetensors::Dtype;
use safetensors::tensor::TensorView;

/// Tensors to write: name, shape, values.
pub type Tensors = Vec<(String, Vec<usize>, Vec<f32>)>;

/// Writes `tensors` at `path` as an f32 safetensors file, or bf16 with `bf16`.
pub fn write_safetensors(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)], bf16: bool) {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| {
            if bf16 {
                v.iter()
                    .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
                    .collect()
            } else {
                v.iter().flat_map(|x| x.to_le_bytes()).collect()
            }
        })
        .collect();
    let dtype = if bf16 { Dtype::BF16 } else { Dtype::F32 };
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((n, s, _), b)| (n.clone(), TensorView::new(dtype, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}
