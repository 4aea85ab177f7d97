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

/// Relative L2 distance of `a` from `b` (`‖a − b‖ / ‖b‖`, in f64).
pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}
