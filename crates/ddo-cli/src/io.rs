//! Files the command reads and writes: images as PNG (Diffusers' post-processing:
//! `(x / 2 + 0.5)` clamped to [0, 1], × 255, rounded), tensors as safetensors (f32), and
//! latents in the layouts `ddo run` and `ddo decode` exchange.

use std::path::Path;

use ddo_core::{DType, Tensor};
use safetensors::tensor::TensorView;

use crate::error::{CliError, CliResult};

/// An f32 tensor on the host: shape and values.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Shape.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub values: Vec<f32>,
}

impl HostTensor {
    /// From a host [`Tensor`] (any float dtype).
    pub fn from_tensor(t: &Tensor) -> CliResult<Self> {
        Ok(Self {
            shape: t.shape().to_vec(),
            values: t.host_f32()?,
        })
    }

    /// As a host [`Tensor`] of f32.
    pub fn to_tensor(&self) -> CliResult<Tensor> {
        Ok(Tensor::from_f32(
            self.shape.clone(),
            DType::F32,
            &self.values,
        )?)
    }

    /// The rows of the leading (batch) dimension, each with a leading 1: `[b, ...]` gives
    /// `b` tensors `[1, ...]`. A tensor without dimensions is one row of itself.
    pub fn rows(&self) -> Vec<HostTensor> {
        let Some((&b, rest)) = self.shape.split_first() else {
            return vec![self.clone()];
        };
        let row: usize = rest.iter().product();
        let shape: Vec<usize> = std::iter::once(1).chain(rest.iter().copied()).collect();
        (0..b)
            .map(|i| HostTensor {
                shape: shape.clone(),
                values: self.values[i * row..(i + 1) * row].to_vec(),
            })
            .collect()
    }
}

/// Why `path` cannot be read as a file, in words — `no such file`, `is a directory, not a
/// file`, `is a FIFO, not a file`, `is a device, not a file`, `cannot be read: ...` — or
/// `None` when it is a readable regular file. Looks and opens without blocking
/// (`ddo_core::host_memory::open_regular`).
pub fn not_a_readable_file(path: &Path) -> Option<String> {
    use ddo_core::host_memory::NotRegular;
    match ddo_core::host_memory::open_regular(path) {
        Ok(_) => None,
        Err(NotRegular::Is(what)) => Some(format!("is {what}, not a file")),
        Err(NotRegular::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {
            Some("no such file".to_string())
        }
        Err(NotRegular::Io(e)) => Some(format!("cannot be read: {e}")),
    }
}

/// Reads tensor `name` (or the first of `names` present) of a safetensors file as f32;
/// a tensor with a NaN or an infinity is refused.
pub fn read_tensor(path: &Path, names: &[&str], option: &str) -> CliResult<HostTensor> {
    if let Some(what) = not_a_readable_file(path) {
        return Err(CliError::runtime(
            format!("{option} {}: {what}", path.display()),
            "give the path of a .safetensors file",
        ));
    }
    let mut last = None;
    for name in names {
        match ddo_nn::read_f32_tensor(path, name) {
            Ok((shape, values)) => {
                // One NaN or infinity would make every pixel NaN downstream.
                let bad = values.iter().filter(|v| !v.is_finite()).count();
                if bad > 0 {
                    return Err(CliError::usage(
                        format!(
                            "{option} {}: {bad} of the {} values of `{name}` are NaN or infinite",
                            path.display(),
                            values.len()
                        ),
                        "give finite values (the image would be all NaN)",
                    ));
                }
                return Ok(HostTensor { shape, values });
            }
            Err(ddo_nn::LoadError::MissingTensor { .. }) => continue,
            Err(e) => {
                last = Some(CliError::from(e).context(option));
                break;
            }
        }
    }
    Err(last.unwrap_or_else(|| {
        CliError::runtime(
            format!(
                "{option} {}: no tensor named {}",
                path.display(),
                names.join(" or ")
            ),
            format!("save the tensor under the name `{}`", names[0]),
        )
    }))
}

/// Tensor `name` of a safetensors file as f32 when the file has it (`None` when it does
/// not); any other failure, or a NaN or an infinity, is an error as for [`read_tensor`].
pub fn read_optional_tensor(
    path: &Path,
    name: &str,
    option: &str,
) -> CliResult<Option<HostTensor>> {
    match ddo_nn::read_f32_tensor(path, name) {
        Err(ddo_nn::LoadError::MissingTensor { .. }) => Ok(None),
        Err(e) => Err(CliError::from(e).context(option)),
        Ok(_) => read_tensor(path, &[name], option).map(Some),
    }
}

/// f32 tensors as the bytes of a safetensors file (written through
/// [`Outputs`](crate::outputs::Outputs)).
pub fn encode_safetensors(tensors: &[(&str, &HostTensor)]) -> CliResult<Vec<u8>> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, t)| t.values.iter().flat_map(|v| v.to_le_bytes()).collect())
        .collect();
    let mut views = Vec::new();
    for ((name, t), b) in tensors.iter().zip(&bytes) {
        let view = TensorView::new(safetensors::Dtype::F32, t.shape.clone(), b)
            .map_err(|e| CliError::runtime(format!("cannot encode tensor `{name}`: {e}"), ""))?;
        views.push((name.to_string(), view));
    }
    safetensors::tensor::serialize(views, None)
        .map_err(|e| CliError::runtime(format!("cannot encode safetensors: {e}"), ""))
}

/// The 8-bit RGB pixels of image `[1, 3, H, W]` (values about [-1, 1]) as Diffusers'
/// `VaeImageProcessor.postprocess` + `numpy_to_pil` make them.
pub fn image_to_rgb8(image: &HostTensor) -> CliResult<(u32, u32, Vec<u8>)> {
    let &[1, c, h, w] = image.shape.as_slice() else {
        return Err(CliError::runtime(
            format!("the decoded image has shape {:?}", image.shape),
            "expected [1, 3, H, W]",
        ));
    };
    if c != 3 && c != 1 {
        return Err(CliError::runtime(
            format!("the decoded image has {c} channels"),
            "PNG output needs 1 or 3 channels; write .safetensors instead",
        ));
    }
    let mut rgb = Vec::with_capacity(h * w * 3);
    for y in 0..h {
        for x in 0..w {
            for ch in 0..3 {
                let plane = if c == 1 { 0 } else { ch };
                let v = image.values[(plane * h + y) * w + x];
                let v = (v / 2.0 + 0.5).clamp(0.0, 1.0);
                rgb.push((v * 255.0).round() as u8);
            }
        }
    }
    Ok((w as u32, h as u32, rgb))
}

/// Image `[1, 3, H, W]` as the bytes of an 8-bit RGB PNG (written through
/// [`Outputs`](crate::outputs::Outputs)).
pub fn encode_png(image: &HostTensor) -> CliResult<Vec<u8>> {
    let (w, h, rgb) = image_to_rgb8(image)?;
    let mut out = Vec::new();
    {
        let mut encoder = png::Encoder::new(&mut out, w, h);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder
            .write_header()
            .map_err(|e| CliError::runtime(format!("PNG encoding failed: {e}"), ""))?;
        writer
            .write_image_data(&rgb)
            .map_err(|e| CliError::runtime(format!("PNG encoding failed: {e}"), ""))?;
    }
    Ok(out)
}

/// How an output path is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputKind {
    /// `.png`.
    Png,
    /// `.safetensors`.
    Safetensors,
}

/// The output kind of `path`, from its extension (either case); `option` names the option
/// that gave it in the refusal.
pub fn output_kind(option: &str, path: &Path) -> CliResult<OutputKind> {
    match path.extension().and_then(|e| e.to_str()) {
        Some(e) if e.eq_ignore_ascii_case("png") => Ok(OutputKind::Png),
        Some(e) if e.eq_ignore_ascii_case("safetensors") => Ok(OutputKind::Safetensors),
        _ => Err(CliError::usage(
            format!("{option} {}: unknown output type", path.display()),
            "end the name in .png (an image) or .safetensors (the decoded tensor `sample`, f32 NCHW)",
        )),
    }
}

/// FluxPipeline's `_unpack_latents` on the host: `[b, (h/2)(w/2), 4c]` → `[b, c, h, w]`.
pub fn unpack_host(packed: &HostTensor, h: usize, w: usize) -> CliResult<HostTensor> {
    let &[b, tokens, c4] = packed.shape.as_slice() else {
        return Err(CliError::runtime(
            format!("packed latents have shape {:?}", packed.shape),
            "expected [batch, tokens, 4 x channels]",
        ));
    };
    if tokens == 0 || tokens != (h / 2) * (w / 2) || c4 == 0 || c4 % 4 != 0 {
        return Err(CliError::runtime(
            format!(
                "packed latents {:?} do not fit a {h}x{w} grid",
                packed.shape
            ),
            "",
        ));
    }
    let c = c4 / 4;
    let mut out = vec![0.0f32; b * c * h * w];
    for (src, dst) in packed
        .values
        .chunks_exact(tokens * c4)
        .zip(out.chunks_exact_mut(c * h * w))
    {
        for r in 0..h / 2 {
            for col in 0..w / 2 {
                let token = r * (w / 2) + col;
                for ch in 0..c {
                    for dy in 0..2 {
                        for dx in 0..2 {
                            let v = src[token * c4 + ch * 4 + dy * 2 + dx];
                            dst[(ch * h + 2 * r + dy) * w + 2 * col + dx] = v;
                        }
                    }
                }
            }
        }
    }
    Ok(HostTensor {
        shape: vec![b, c, h, w],
        values: out,
    })
}
