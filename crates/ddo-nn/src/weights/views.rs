//! How [`CheckpointWeights`] reads a param from a checkpoint tensor: [`ViewKind`] and
//! [`View`] (a param name mapped onto a tensor of another layout, or read as a part of one),
//! and the read itself (shape checks, scales, dtype conversion).

use std::collections::HashMap;
use std::sync::Arc;

use ddo_core::host_memory::AlignedBytes;
use ddo_core::{DType, HostBuffer, Param, ParamKind, QuantLayout};

use super::{CheckpointWeights, WeightSource};
use crate::error::{LoadError, LoadResult};

/// How a param a model asks for is read from a checkpoint tensor: the whole tensor, a
/// range of its leading rows (a fused `qkv` split into `to_q`, `to_k`, `to_v`: a zero-copy
/// slice of the mapping), the tensor with its two halves along the first dim swapped
/// (an owned copy: the original Flux layout's final modulation is `shift, scale`, Diffusers'
/// `scale, shift`), its bytes under a squeezed shape, or one temporal slice of a 3-D
/// convolution's weight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ViewKind {
    /// The tensor as it is.
    Whole,
    /// Rows `start..start + len` along dim 0.
    Rows {
        /// First row.
        start: usize,
        /// Rows.
        len: usize,
    },
    /// The halves along dim 0 swapped.
    SwapHalves,
    /// The tensor's bytes under the model's shape, which drops trailing dims of 1 (an LDM
    /// VAE's attention projections are 1x1 convolutions, Diffusers' are linears).
    Squeeze,
    /// The last slice along dim 2 of a 3-D convolution weight `[out, in, frames, kh, kw]`,
    /// as the 2-D weight `[out, in, kh, kw]` ([`WeightSource::last_time_slice`]). With
    /// `frames` = 1 that is the tensor's own bytes (a view of the mapping, no copy); with more
    /// frames the slice is not contiguous (each `(out, in)` pair keeps its last `kh · kw` of
    /// `frames · kh · kw` elements), so it is an owned copy of `1 / frames` of the tensor's
    /// bytes, frozen like a conversion's, and the mapping's pages of the tensor are read
    /// once, at load.
    LastTimeSlice {
        /// The kernel's temporal extent the checkpoint tensor must have.
        frames: usize,
    },
}

/// A param name mapped onto a checkpoint tensor ([`CheckpointWeights::with_views`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct View {
    /// The checkpoint tensor.
    pub tensor: String,
    /// How the param is read from it.
    pub kind: ViewKind,
}

impl CheckpointWeights {
    /// The same checkpoint read through `views`: a model's param names (Diffusers') mapped
    /// onto the checkpoint's tensors (another layout's). Names outside `views` are missing;
    /// a checkpoint tensor counts as used when a view of it is read.
    pub fn with_views(mut self, views: HashMap<String, View>) -> Self {
        self.views = Some(views);
        self
    }

    /// The checkpoint tensor and view for param `name`.
    fn view_of(&self, name: &str) -> Option<View> {
        match &self.views {
            Some(v) => v.get(name).cloned(),
            None => Some(View {
                tensor: name.to_string(),
                kind: ViewKind::Whole,
            }),
        }
    }
}

impl WeightSource for CheckpointWeights {
    fn param(&mut self, name: &str, shape: &[usize], kind: ParamKind) -> LoadResult<Arc<Param>> {
        let view = self.view_of(name).ok_or_else(|| self.missing(name))?;
        self.param_through(name, shape, kind, view)
    }

    fn last_time_slice(
        &mut self,
        name: &str,
        shape: &[usize],
        frames: usize,
        kind: ParamKind,
    ) -> LoadResult<Arc<Param>> {
        let mut view = self.view_of(name).ok_or_else(|| self.missing(name))?;
        view.kind = ViewKind::LastTimeSlice { frames };
        self.param_through(name, shape, kind, view)
    }

    fn contains(&self, name: &str) -> bool {
        self.view_of(name)
            .is_some_and(|v| self.location.contains_key(&v.tensor))
    }
}

/// `src`, a contiguous `[outer, frames, inner]` array of `elem`-byte values, at its last
/// frame (`[outer, inner]`), written to `out`.
fn last_frame(src: &[u8], out: &mut [u8], frames: usize, inner: usize, elem: usize) {
    let keep = inner * elem;
    for (dst, block) in out
        .chunks_exact_mut(keep)
        .zip(src.chunks_exact(frames * keep))
    {
        dst.copy_from_slice(&block[block.len() - keep..]);
    }
}

impl CheckpointWeights {
    fn missing(&self, name: &str) -> LoadError {
        LoadError::MissingTensor {
            name: name.to_string(),
            file: self.origin.clone(),
        }
    }

    /// Param `name` of `shape`, read from the checkpoint through `view`.
    fn param_through(
        &mut self,
        name: &str,
        shape: &[usize],
        kind: ParamKind,
        view: View,
    ) -> LoadResult<Arc<Param>> {
        let tensor = view.tensor.as_str();
        self.used.insert(tensor.to_string());
        let Some(&id) = self.location.get(tensor) else {
            return Err(LoadError::MissingTensor {
                name: tensor.to_string(),
                file: self.origin.clone(),
            });
        };
        let ckpt = &self.files[id];
        let file = ckpt.path().to_path_buf();
        if let Some((_, dtype)) = ckpt.unsupported().find(|(n, _)| *n == tensor) {
            return Err(LoadError::UnsupportedDtype {
                name: tensor.to_string(),
                file,
                dtype: dtype.to_string(),
            });
        }
        let info = ckpt.tensor(tensor)?.clone();
        if let Some(q) = info.quant.clone() {
            return self.quantized_param(name, shape, kind, &view, id, &info, q);
        }
        // The shape the view must find in the checkpoint.
        let fits = match view.kind {
            ViewKind::Whole => info.shape == shape,
            ViewKind::SwapHalves => {
                info.shape == shape && shape.first().is_some_and(|d| d % 2 == 0)
            }
            ViewKind::Squeeze => {
                info.shape.len() >= shape.len()
                    && info.shape[..shape.len()] == *shape
                    && info.shape[shape.len()..].iter().all(|&d| d == 1)
            }
            ViewKind::Rows { start, len } => {
                info.shape.len() == shape.len()
                    && shape.first() == Some(&len)
                    && info.shape.first().is_some_and(|&rows| start + len <= rows)
                    && info.shape[1..] == shape[1..]
            }
            ViewKind::LastTimeSlice { frames } => {
                shape.len() == 4
                    && frames > 0
                    && info.shape.len() == 5
                    && info.shape[..2] == shape[..2]
                    && info.shape[2] == frames
                    && info.shape[3..] == shape[2..]
            }
        };
        if !fits {
            let expected = match view.kind {
                ViewKind::Rows { start, len } => {
                    let mut e = shape.to_vec();
                    if let Some(first) = e.first_mut() {
                        *first = (start + len).max(*first);
                    }
                    e
                }
                ViewKind::LastTimeSlice { frames } if shape.len() >= 2 => {
                    let mut e = shape.to_vec();
                    e.insert(2, frames);
                    e
                }
                _ => shape.to_vec(),
            };
            return Err(LoadError::ShapeMismatch {
                name: tensor.to_string(),
                file,
                expected,
                found: info.shape,
            });
        }
        if info.dtype.is_quantized() {
            return Err(LoadError::UnsupportedDtype {
                name: tensor.to_string(),
                file,
                dtype: "u8/i8 (quantized)".into(),
            });
        }
        self.refuse_alias(tensor)?;
        // A fused tensor's scale is every part's.
        let scale = self.scale_of(tensor, info.dtype)?;
        if scale.is_none() && info.dtype.is_fp8() {
            self.refuse_unscaled_fp8(tensor, id)?;
        }
        let ckpt = &self.files[id];
        let whole = ckpt.host_buffer(tensor)?;
        // The tensor's bytes as the model reads them (a coded tensor's decoded length, not
        // its unit's in the file).
        let tensor_bytes = whole.len();
        let row_bytes = tensor_bytes / info.shape.first().copied().unwrap_or(1).max(1);
        let host = match view.kind {
            ViewKind::Whole | ViewKind::Squeeze => whole.slice_all(),
            ViewKind::Rows { start, len } => whole.slice(start * row_bytes, len * row_bytes)?,
            ViewKind::SwapHalves => swapped_halves(&whole, tensor_bytes, &file, tensor),
            ViewKind::LastTimeSlice { frames: 1 } => whole.slice_all(),
            ViewKind::LastTimeSlice { frames } => {
                let elem = info.dtype.size_in_bytes();
                let mut bytes = AlignedBytes::zeroed(tensor_bytes / frames);
                whole.with_bytes(|b| {
                    last_frame(b, bytes.as_mut_slice(), frames, shape[2] * shape[3], elem);
                });
                let label = format!("({}, last of {frames} frames) {tensor}", file.display());
                HostBuffer::frozen(bytes, &label).slice_all()
            }
        };
        let p = match self.target.or(self.gguf_floats) {
            Some(t) if t != info.dtype => {
                let mut values = host.with_bytes(|b| info.dtype.decode_f32(b))?;
                // A scaled fp8 weight converts as its dequantized values.
                ddo_core::tensor::apply_scale(&mut values, scale);
                let label = format!("({} converted to {t}) {tensor}", file.display());
                return converted(name, shape, kind, t, &values, &label);
            }
            _ if view.kind == ViewKind::Whole => Param::from_checkpoint(ckpt, tensor, name, kind)?,
            _ => Param::new(name, kind, info.dtype, shape.to_vec(), host)?,
        };
        Ok(match scale {
            Some(s) => Param::with_scale(p, s)?,
            None => p,
        })
    }
}

impl CheckpointWeights {
    /// Param `name` of `shape` from a GGUF file's quantized tensor (`info`, blocks of `q`):
    /// the blocks as stored ([`DType::Quantized`] bytes carrying their layout), the whole
    /// tensor or its rows `start..start + len` (a fused `qkv`'s part: rows are whole blocks,
    /// so a slice of the mapping) or its halves swapped (a copy); a conversion `target`
    /// dequantizes them on the host instead. Convolution views are refused.
    #[allow(clippy::too_many_arguments)] // the reader's state beside one tensor's
    fn quantized_param(
        &mut self,
        name: &str,
        shape: &[usize],
        kind: ParamKind,
        view: &View,
        id: usize,
        info: &ddo_core::checkpoint::CheckpointTensor,
        q: Arc<QuantLayout>,
    ) -> LoadResult<Arc<Param>> {
        let tensor = view.tensor.as_str();
        let file = self.files[id].path().to_path_buf();
        let rows = q.shape.first().copied().unwrap_or(1);
        let fits = match view.kind {
            ViewKind::Whole => q.shape == shape,
            ViewKind::SwapHalves => q.shape == shape && rows % 2 == 0,
            ViewKind::Rows { start, len } => {
                q.shape.len() == shape.len()
                    && shape.first() == Some(&len)
                    && start + len <= rows
                    && q.shape[1..] == shape[1..]
            }
            ViewKind::Squeeze | ViewKind::LastTimeSlice { .. } => {
                return Err(LoadError::UnsupportedDtype {
                    name: tensor.to_string(),
                    file,
                    dtype: format!("{} blocks (a convolution's weight)", q.ty.name()),
                });
            }
        };
        if !fits {
            return Err(LoadError::ShapeMismatch {
                name: tensor.to_string(),
                file,
                expected: shape.to_vec(),
                found: q.shape.clone(),
            });
        }
        self.refuse_alias(tensor)?;
        let ckpt = &self.files[id];
        let whole = ckpt.host_buffer(tensor)?;
        // Bytes of one index along dim 0 (whole rows of blocks).
        let slab = info.len / rows.max(1);
        let (host, part) = match view.kind {
            ViewKind::Rows { start, len } => (
                whole.slice(start * slab, len * slab)?,
                Arc::new(q.with_rows(len)),
            ),
            ViewKind::SwapHalves => (
                swapped_halves(&whole, info.len, &file, tensor),
                Arc::clone(&q),
            ),
            _ => (whole.slice_all(), Arc::clone(&q)),
        };
        if let Some(t) = self.target {
            // Converted: the blocks dequantized (the reference), then encoded as `t`.
            let values =
                host.with_bytes(|b| ddo_core::gguf::dequantize(part.ty, b, part.elements()))?;
            let label = format!("({} converted to {t}) {tensor}", file.display());
            return converted(name, shape, kind, t, &values, &label);
        }
        if view.kind == ViewKind::Whole {
            return Ok(Param::from_checkpoint(ckpt, tensor, name, kind)?);
        }
        let p = Param::new(name, kind, DType::Quantized, vec![host.len()], host)?;
        Ok(Param::with_quant(p, part)?)
    }
}

/// A copy of `len` bytes of `whole` with its two halves swapped (the original Flux layout's
/// final modulation, `shift, scale` → `scale, shift`), frozen like a checkpoint's bytes.
fn swapped_halves(
    whole: &HostBuffer,
    len: usize,
    file: &std::path::Path,
    tensor: &str,
) -> ddo_core::HostSlice {
    let half = len / 2;
    let mut bytes = AlignedBytes::zeroed(len);
    whole.with_bytes(|b| {
        let out = bytes.as_mut_slice();
        out[..half].copy_from_slice(&b[half..]);
        out[half..].copy_from_slice(&b[..half]);
    });
    let label = format!("({}, halves swapped) {tensor}", file.display());
    HostBuffer::frozen(bytes, &label).slice_all()
}

/// Param `name` of `shape` holding `values` encoded as `t` (an 8-bit float as scaled fp8,
/// with its scale), frozen like a checkpoint's bytes (see `RandomWeights`) under `label`.
fn converted(
    name: &str,
    shape: &[usize],
    kind: ParamKind,
    t: DType,
    values: &[f32],
    label: &str,
) -> LoadResult<Arc<Param>> {
    let (bytes, scale) = if t.is_fp8() {
        let (codes, s) = t.quantize_scaled(name, values)?;
        (codes, Some(s))
    } else {
        (t.encode_f32(values)?, None)
    };
    let p = Param::new(
        name,
        kind,
        t,
        shape.to_vec(),
        HostBuffer::frozen(AlignedBytes::copy_from(&bytes), label).slice_all(),
    )?;
    Ok(match scale {
        Some(s) => Param::with_scale(p, s)?,
        None => p,
    })
}

#[cfg(test)]
mod tests {
    use super::last_frame;

    /// Each `(out, in)` block of `frames · inner` elements keeps its last `inner`, whatever the
    /// element size (bf16 checkpoints have 2-byte elements).
    #[test]
    fn the_last_frame_of_each_block_is_kept() {
        for elem in [1usize, 2, 4] {
            let (outer, frames, inner) = (3, 3, 4);
            let src: Vec<u8> = (0..outer * frames * inner * elem)
                .map(|i| i as u8)
                .collect();
            let mut out = vec![0u8; outer * inner * elem];
            last_frame(&src, &mut out, frames, inner, elem);
            let want: Vec<u8> = (0..outer)
                .flat_map(|o| {
                    let start = (o * frames + frames - 1) * inner * elem;
                    src[start..start + inner * elem].to_vec()
                })
                .collect();
            assert_eq!(out, want, "{elem}-byte elements");
        }
    }
}
