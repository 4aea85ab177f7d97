//! Putting LoRA modules on a component: each module's `A` and `B` (the latter times its
//! scale and strength) uploaded to the device in the adapted weight's compute dtype (bf16
//! for fp8 weights) and set as the linear leaf's adapters ([`ddo_core::adapter`]), several
//! files' adapters of one leaf side by side. The leaf's own params are never read or
//! written.

use std::collections::HashMap;
use std::sync::Arc;

use ddo_core::adapter::{Adapter, AdapterSet};
use ddo_core::{Component, DType, Device, LeafKind, Tensor};

use super::{LoraFile, LoraModule};
use crate::error::{LoadError, LoadResult};

/// The dtype an adapter computes in beside a weight of `dtype`: its own for f32, f16 and
/// bf16; bf16 for 8-bit weights (computed in bf16).
fn compute_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 => dtype,
        _ => DType::BF16,
    }
}

/// The leaf a LoRA module adapts: its path as named, or with CLIP's `text_model.` prefix
/// dropped or added (transformers 4 saved CLIP under it, 5 does not; LoRA files name it).
fn find_leaf<'a>(component: &'a Component, module: &str) -> Option<(usize, &'a ddo_core::Leaf)> {
    let leaves = component.leaves();
    let at = |path: &str| leaves.iter().position(|l| l.path() == path);
    let i = at(module)
        .or_else(|| module.strip_prefix("text_model.").and_then(at))
        .or_else(|| at(&format!("text_model.{module}")))?;
    Some((i, &leaves[i]))
}

/// [`LoadError::Lora`] for module `m` of `file`.
fn bad(file: &LoraFile, m: &LoraModule, problem: String) -> LoadError {
    LoadError::Lora {
        file: file.path.clone(),
        problem: format!("module `{}` of the {}: {problem}", m.module, m.component),
    }
}

/// The linear leaf of `component` module `m` adapts and its weight, or why it fits none.
fn fit(
    component: &Component,
    file: &LoraFile,
    m: &LoraModule,
) -> LoadResult<(usize, Arc<ddo_core::Param>)> {
    let (id, leaf) = find_leaf(component, &m.module).ok_or_else(|| {
        bad(
            file,
            m,
            format!(
                "the {} has no such layer; the LoRA was made for another model",
                component.class_name()
            ),
        )
    })?;
    if leaf.kind() != LeafKind::Linear {
        return Err(bad(file, m, "the layer is not a linear".into()));
    }
    let weight = leaf
        .params()
        .iter()
        .find(|(n, _)| n == "weight")
        .map(|(_, p)| Arc::clone(p))
        .ok_or_else(|| bad(file, m, "the layer has no weight".into()))?;
    if weight.logical_shape() != [m.out_features(), m.in_features()] {
        return Err(bad(
            file,
            m,
            format!(
                "it adapts {} → {}, the layer's weight is {:?}",
                m.in_features(),
                m.out_features(),
                weight.logical_shape()
            ),
        ));
    }
    Ok((id, weight))
}

/// Alignment of each factor in the device buffer the factors of one call share.
const FACTOR_ALIGN: usize = 256;

/// One factor to put on the device: the matrix, what its values are multiplied by, the
/// dtype it is stored in there, and its offset in the shared buffer.
struct Factor<'a> {
    t: &'a super::LoraTensor,
    times: f32,
    dtype: DType,
    offset: usize,
}

impl Factor<'_> {
    fn bytes(&self) -> usize {
        self.t.rows * self.t.cols * self.dtype.size_in_bytes()
    }

    /// Writes the factor's values, times `times`, encoded as `dtype`, into `out` (exactly
    /// [`Factor::bytes`] long): the stored bytes as they are where nothing changes them.
    fn encode_into(&self, out: &mut [u8]) -> LoadResult<()> {
        if self.times == 1.0 && self.t.dtype == self.dtype {
            out.copy_from_slice(&self.t.bytes);
            return Ok(());
        }
        let mut values = self.t.to_f32()?;
        if self.times != 1.0 {
            values.iter_mut().for_each(|v| *v *= self.times);
        }
        out.copy_from_slice(&self.dtype.encode_f32(&values)?);
        Ok(())
    }
}

/// Encodes `factors` into one host buffer (on up to 8 threads), copies it to `device` in one
/// transfer and returns the device buffer.
fn upload(
    factors: &[Factor<'_>],
    total: usize,
    device: &dyn Device,
    stream: &ddo_core::Stream,
) -> LoadResult<ddo_core::DeviceBuffer> {
    let mut host = ddo_core::host_memory::AlignedBytes::zeroed(total.max(1));
    let parts: Vec<(&Factor<'_>, usize, usize)> =
        factors.iter().map(|f| (f, f.offset, f.bytes())).collect();
    ddo_core::host_memory::fill_in_parallel(host.as_mut_slice(), &parts, |f, window| {
        f.encode_into(window)
    })?;
    let host = ddo_core::HostBuffer::owned(host, None);
    let dst = device.alloc(total.max(1))?;
    device.copy_h2d(&host.slice(0, total.max(1))?, &dst.slice_all(), stream)?;
    Ok(dst)
}

/// Sets `component`'s adapters to the modules of `loras` (each with its strength) that
/// adapt it, uploaded to `device`; returns their device bytes. With no module for it, its
/// adapters are cleared. A module naming no linear leaf of the component, or whose shapes
/// do not fit the leaf's weight, is [`LoadError::Lora`] naming the file and the module;
/// nothing is changed then. The factors are encoded on several threads into one host
/// buffer and reach the device in one copy, each a view of one device buffer.
pub fn apply_loras(
    component: &Component,
    loras: &[(&LoraFile, f32)],
    device: &dyn Device,
) -> LoadResult<u64> {
    let stream = device.compute_stream();
    // Every module fitted first; its two factors placed in the shared buffer. A module
    // whose `A` is the previous module's (a fused module's split: kohya's qkv, linear1)
    // shares its factor, so its down-projection is computed once ([`Adapter::shared_down`]).
    let mut fitted = Vec::new();
    let mut factors: Vec<Factor<'_>> = Vec::new();
    let mut total = 0usize;
    fn place<'a>(factors: &mut Vec<Factor<'a>>, total: &mut usize, f: Factor<'a>) -> usize {
        let f = Factor {
            offset: *total,
            ..f
        };
        *total += f.bytes().div_ceil(FACTOR_ALIGN) * FACTOR_ALIGN;
        factors.push(f);
        factors.len() - 1
    }
    for (file, strength) in loras {
        let mut last_down: Option<usize> = None;
        for m in file
            .modules
            .iter()
            .filter(|m| m.component == component.name())
        {
            let (id, weight) = fit(component, file, m)?;
            let dtype = compute_dtype(weight.dtype());
            let same = last_down.filter(|&i| {
                let f = &factors[i];
                f.dtype == dtype && *f.t == m.down
            });
            let down = match same {
                Some(i) => i,
                None => place(
                    &mut factors,
                    &mut total,
                    Factor {
                        t: &m.down,
                        times: 1.0,
                        dtype,
                        offset: 0,
                    },
                ),
            };
            last_down = Some(down);
            // The scale and the strength go into B (in f32, before it is encoded), as
            // Diffusers folds a kohya alpha into the weights: one elementwise pass fewer per
            // adapter and forward.
            let up = place(
                &mut factors,
                &mut total,
                Factor {
                    t: &m.up,
                    times: m.scale * strength,
                    dtype,
                    offset: 0,
                },
            );
            fitted.push((file, m, id, down, up));
        }
    }
    let mut users = vec![0usize; factors.len()];
    fitted.iter().for_each(|f| users[f.3] += 1);
    let mut by_leaf: HashMap<ddo_core::LeafId, Vec<Adapter>> = HashMap::new();
    // Every fitted module has two factors: with none, nothing is uploaded.
    if !factors.is_empty() {
        let buffer = upload(&factors, total, device, &stream)?;
        let view = |f: &Factor<'_>| -> LoadResult<Tensor> {
            Ok(Tensor::new(
                vec![f.t.rows, f.t.cols],
                f.dtype,
                ddo_core::TensorStorage::Device(buffer.slice(f.offset, f.bytes())?),
            )?)
        };
        for (file, m, id, down, up) in fitted {
            let adapter = Adapter {
                down: view(&factors[down])?,
                up: view(&factors[up])?,
                scale: 1.0,
                shared_down: users[down] > 1,
            };
            adapter
                .check(&m.module, m.in_features(), m.out_features())
                .map_err(|e| bad(file, m, e.to_string()))?;
            by_leaf
                .entry(ddo_core::LeafId(id))
                .or_default()
                .push(adapter);
        }
    }
    let set: AdapterSet = by_leaf
        .into_iter()
        .map(|(id, a)| (id, Arc::from(a)))
        .collect();
    component.set_adapters(set)?;
    device.synchronize_stream(&stream)?;
    Ok(component.adapter_bytes())
}

/// Sets every component of `pipeline` to the adapters `loras` give it (clearing those of a
/// component they do not adapt) and returns the factors' device bytes and the modules left
/// out: what a warm process calls between requests to change LoRAs, the base weights and
/// their routes left as they are. A file with modules for a component the pipeline lacks,
/// a LoRA of the other family, or a module that fits none of the layers is
/// [`LoadError::Lora`] before any component is changed — unless `allow_unmatched`, where a
/// module that fits no layer is left out and named in the list returned.
pub fn set_pipeline_loras(
    pipeline: &ddo_routes::Pipeline,
    loras: &[(&LoraFile, f32)],
    device: &dyn Device,
    allow_unmatched: bool,
) -> LoadResult<(u64, Vec<String>)> {
    // A LoRA of the other family is named as such, before any layer is looked for.
    let family = pipeline
        .get("transformer")
        .map(|t| t.class_name().to_string());
    for (f, _) in loras {
        let mismatch = match (f.family(), family.as_deref()) {
            (Some(super::LoraFamily::QwenImage), Some(c)) if c.starts_with("Flux") => {
                Some(("Qwen-Image", "Flux"))
            }
            (Some(super::LoraFamily::Flux), Some(c)) if c.starts_with("QwenImage") => {
                Some(("Flux", "Qwen-Image"))
            }
            _ => None,
        };
        if let Some((lora, model)) = mismatch {
            return Err(LoadError::Lora {
                file: f.path.clone(),
                problem: format!("it is a {lora} LoRA and this is a {model} pipeline"),
            });
        }
    }
    // Every module checked before any component is changed: one that fits no layer of a
    // later component must not leave the earlier ones adapted.
    let mut kept: Vec<(LoraFile, f32)> = Vec::with_capacity(loras.len());
    let mut left_out = Vec::new();
    for (f, strength) in loras {
        let mut modules = Vec::with_capacity(f.modules.len());
        for m in &f.modules {
            let fits = match pipeline.get(m.component) {
                Some(component) => fit(component, f, m).map(|_| ()),
                None => Err(LoadError::Lora {
                    file: f.path.clone(),
                    problem: format!(
                        "it adapts the {}, which this pipeline does not have",
                        m.component
                    ),
                }),
            };
            match fits {
                Ok(()) => modules.push(m.clone()),
                Err(_) if allow_unmatched => left_out.push(format!(
                    "{}: {}.{}",
                    f.path.display(),
                    m.component,
                    m.module
                )),
                Err(e) => return Err(e),
            }
        }
        let file = LoraFile {
            path: f.path.clone(),
            format: f.format,
            modules,
            unmatched: f.unmatched.clone(),
        };
        kept.push((file, *strength));
    }
    let refs: Vec<(&LoraFile, f32)> = kept.iter().map(|(f, s)| (f, *s)).collect();
    let mut bytes = 0;
    for component in pipeline.components() {
        bytes += apply_loras(component, &refs, device)?;
    }
    Ok((bytes, left_out))
}
