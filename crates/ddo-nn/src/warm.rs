//! Running a pipeline's linear shapes once before its first phase, on a backend whose first
//! call of a shape costs host time that later calls do not
//! ([`Device::loads_kernels_lazily`]).
//!
//! On CUDA, cuBLASLt loads each GEMM kernel at its first launch. Measured on an H200 in the
//! first forward of the FLUX.1-dev transformer: 3 to 18 ms for most new shapes, 143-185 ms
//! for the single blocks' modulation (`3072 → 9216`, one row) and 152-163 ms for the final
//! `proj_out` (`3072 → 64`), against 0.2-0.4 ms for building the plan itself. Held there,
//! the host stops queueing copies and the link runs dry behind it; at the last leaf the
//! next step waits. [`warm_linears`] runs each shape once on scratch operands (contents
//! unspecified, results dropped) so those loads happen before the phases instead; the
//! plans and kernels a phase then uses are the same ones, so outputs do not change.
//!
//! The shapes are the models' own ([`FluxPipeline::linear_shapes`]): every linear of the
//! text encoders and the transformer at the run's sequence lengths and batch, each once.

use std::collections::HashSet;
use std::time::Instant;

use ddo_core::{DType, Device, Result, Tensor, TensorStorage};

use crate::clip::ClipTextConfig;
use crate::flux::{FluxTransformerConfig, MLP_RATIO, TIMESTEP_CHANNELS};
use crate::pipeline::FluxPipeline;
use crate::t5::T5Config;

/// One linear call: `rows` rows of `in_features` through a `[out_features, in_features]`
/// weight in `dtype`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LinearShape {
    /// Rows of the input (every leading dimension multiplied).
    pub rows: usize,
    /// Input width.
    pub in_features: usize,
    /// Output width.
    pub out_features: usize,
    /// The operands' dtype.
    pub dtype: DType,
    /// Whether the linear adds a bias.
    pub bias: bool,
    /// How it is called.
    pub call: LinearCall,
}

/// Which op runs a [`LinearShape`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum LinearCall {
    /// `Ops::linear`.
    Plain,
    /// `Ops::linear_gelu_tanh` (the projection and its GELU in one call).
    GeluTanh,
    /// `Ops::linear_concat` over inputs of these widths (they sum to `in_features`).
    Concat(Vec<usize>),
}

impl LinearShape {
    fn new(rows: usize, in_features: usize, out_features: usize, dtype: DType) -> Self {
        Self {
            rows,
            in_features,
            out_features,
            dtype,
            bias: true,
            call: LinearCall::Plain,
        }
    }

    fn no_bias(mut self) -> Self {
        self.bias = false;
        self
    }

    fn gelu(mut self) -> Self {
        self.call = LinearCall::GeluTanh;
        self
    }

    /// Device bytes of the call's operands: input, weight, bias and output.
    pub fn operand_bytes(&self) -> u64 {
        let e = self.dtype.size_in_bytes() as u64;
        let (r, i, o) = (
            self.rows as u64,
            self.in_features as u64,
            self.out_features as u64,
        );
        let elems = (r.saturating_mul(i))
            .saturating_add(o.saturating_mul(i))
            .saturating_add(u64::from(self.bias) * o)
            .saturating_add(r.saturating_mul(o));
        e.saturating_mul(elems)
    }
}

/// What [`warm_linears`] did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WarmReport {
    /// Shapes run.
    pub warmed: usize,
    /// Shapes left out because their operands would not fit under the limit.
    pub skipped: usize,
    /// Wall time, the final synchronisation included.
    pub seconds: f64,
}

/// A device tensor of `shape` whose contents are unspecified.
fn scratch(device: &dyn Device, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let bytes = ddo_core::tensor::byte_len(shape, dtype)?;
    let buffer = device.alloc(bytes)?;
    Tensor::new(
        shape.to_vec(),
        dtype,
        TensorStorage::Device(buffer.slice_all()),
    )
}

/// Runs each distinct shape of `shapes` once on scratch operands, leaving out those whose
/// operands need more than `limit` bytes, then waits for the device and returns its cached
/// memory, so the phases start from the state they would have started from without it.
/// Does nothing on a backend that does not load kernels lazily.
pub fn warm_linears(
    device: &dyn Device,
    shapes: &[LinearShape],
    limit: Option<u64>,
) -> Result<WarmReport> {
    let started = Instant::now();
    let mut report = WarmReport::default();
    if !device.loads_kernels_lazily() {
        return Ok(report);
    }
    let ops = device.ops().ok_or_else(|| ddo_core::CoreError::Backend {
        device: device.id().to_string(),
        message: "the device has no compute ops to warm".into(),
    })?;
    let mut seen = HashSet::new();
    for s in shapes {
        if !seen.insert(s) {
            continue;
        }
        if limit.is_some_and(|l| s.operand_bytes() > l) {
            report.skipped += 1;
            continue;
        }
        let w = scratch(device, &[s.out_features, s.in_features], s.dtype)?;
        let b = match s.bias {
            true => Some(scratch(device, &[s.out_features], s.dtype)?),
            false => None,
        };
        let _out = match &s.call {
            LinearCall::Plain => {
                let x = scratch(device, &[s.rows, s.in_features], s.dtype)?;
                ops.linear(&x, &w, b.as_ref())?
            }
            LinearCall::GeluTanh => {
                let x = scratch(device, &[s.rows, s.in_features], s.dtype)?;
                ops.linear_gelu_tanh(&x, &w, b.as_ref())?
            }
            LinearCall::Concat(widths) => {
                let xs = widths
                    .iter()
                    .map(|&n| scratch(device, &[s.rows, n], s.dtype))
                    .collect::<Result<Vec<_>>>()?;
                let refs: Vec<&Tensor> = xs.iter().collect();
                ops.linear_concat(&refs, &w, b.as_ref())?
            }
        };
        report.warmed += 1;
    }
    device.synchronize()?;
    device.empty_cache()?;
    report.seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

/// Every linear of the Flux transformer for `batch` images of `image_tokens` image and
/// `text_tokens` text tokens each.
pub fn flux_linear_shapes(
    c: &FluxTransformerConfig,
    batch: usize,
    image_tokens: usize,
    text_tokens: usize,
    dtype: DType,
) -> Vec<LinearShape> {
    let d = c.inner_dim();
    let mlp = d * MLP_RATIO;
    // Saturating: a size no device holds gives shapes no limit admits (the memory plan
    // refuses the size itself).
    let (img, txt) = (
        batch.saturating_mul(image_tokens),
        batch.saturating_mul(text_tokens),
    );
    let joint = img.saturating_add(txt);
    let out = c.patch_size * c.patch_size * c.out_channels();
    let l = |rows, i, o| LinearShape::new(rows, i, o, dtype);
    let mut v = vec![
        l(img, c.in_channels, d),
        l(txt, c.joint_attention_dim, d),
        l(batch, TIMESTEP_CHANNELS, d),
        l(batch, d, d),
        l(batch, c.pooled_projection_dim, d),
        l(batch, d, 2 * d),
        l(img, d, out),
    ];
    if c.num_layers > 0 {
        v.extend([
            l(batch, d, 6 * d),
            l(img, d, d),
            l(txt, d, d),
            l(img, d, mlp).gelu(),
            l(img, mlp, d),
            l(txt, d, mlp).gelu(),
            l(txt, mlp, d),
        ]);
    }
    if c.num_single_layers > 0 {
        let mut proj_out = l(joint, d + mlp, d);
        proj_out.call = LinearCall::Concat(vec![d, mlp]);
        v.extend([
            l(batch, d, 3 * d),
            l(joint, d, d),
            l(joint, d, mlp).gelu(),
            proj_out,
        ]);
    }
    v
}

/// Every linear of the T5 encoder over `rows` tokens (no biases).
pub fn t5_linear_shapes(c: &T5Config, rows: usize, dtype: DType) -> Vec<LinearShape> {
    let (d, inner, ff) = (c.d_model, c.inner_dim(), c.d_ff);
    let l = |i, o| LinearShape::new(rows, i, o, dtype).no_bias();
    vec![l(d, inner), l(inner, d), l(d, ff), l(ff, d)]
}

/// Every linear of the CLIP text encoder over `rows` tokens.
pub fn clip_linear_shapes(c: &ClipTextConfig, rows: usize, dtype: DType) -> Vec<LinearShape> {
    let (d, ff) = (c.hidden_size, c.intermediate_size);
    let l = |i, o| LinearShape::new(rows, i, o, dtype);
    vec![l(d, d), l(d, ff), l(ff, d)]
}

impl FluxPipeline {
    /// The linear shapes a run of `images` images at `height × width` calls: the text
    /// encoders' (one prompt, as [`FluxPipeline::prepare_attention`] counts them) and the
    /// transformer's.
    pub fn linear_shapes(
        &self,
        height: usize,
        width: usize,
        images: usize,
    ) -> Result<Vec<LinearShape>> {
        let mut v = Vec::new();
        if let Some(clip) = &self.clip {
            let c = clip.config();
            let dtype = crate::memory::weights_dtype(clip.component());
            v.extend(clip_linear_shapes(c, c.max_position_embeddings, dtype));
        }
        if let Some(t5) = &self.t5 {
            let dtype = crate::memory::weights_dtype(t5.component());
            v.extend(t5_linear_shapes(
                t5.config(),
                self.max_sequence_length,
                dtype,
            ));
        }
        let (h, w) = self.latent_grid(height, width)?;
        v.extend(flux_linear_shapes(
            self.transformer.config(),
            images.max(1),
            (h / 2).saturating_mul(w / 2),
            self.max_sequence_length,
            self.transformer_dtype(),
        ));
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::FluxPipelineConfig;
    use ddo_core::fault::FaultInjectingDevice;
    use ddo_core::{Component, HostDevice, HostDeviceConfig, LeafKind};

    /// Every linear leaf of `component` has its `[out, in]` weight (and its bias or none)
    /// among `shapes`: the shape tables follow the models.
    fn covered(component: &Component, shapes: &[LinearShape]) {
        for leaf in component.leaves() {
            if leaf.kind() != LeafKind::Linear {
                continue;
            }
            let get = |n: &str| leaf.params().iter().find(|(k, _)| k == n).map(|(_, p)| p);
            let w = get("weight").expect("a linear has a weight");
            let (o, i) = (w.shape()[0], w.shape()[1]);
            let bias = get("bias").is_some();
            assert!(
                shapes
                    .iter()
                    .any(|s| s.out_features == o && s.in_features == i && s.bias == bias),
                "{}: [{o}, {i}] bias {bias} is in no shape",
                leaf.path()
            );
        }
    }

    #[test]
    fn the_shapes_cover_every_linear_of_the_tiny_pipeline() {
        let pipe = FluxPipeline::random(&FluxPipelineConfig::tiny(), 3, DType::F32).unwrap();
        let shapes = pipe.linear_shapes(64, 64, 1).unwrap();
        for c in pipe.components() {
            if c.name() != crate::pipeline::VAE {
                covered(&c, &shapes);
            }
        }
        // Rows follow the size and the batch: the image embedder sees every image token.
        let c = pipe.transformer.config().in_channels;
        for (side, images) in [(64, 1), (128, 2)] {
            let (h, w) = pipe.latent_grid(side, side).unwrap();
            let img = images * (h / 2) * (w / 2);
            let shapes = pipe.linear_shapes(side, side, images).unwrap();
            assert!(shapes.iter().any(|s| s.rows == img && s.in_features == c));
        }
    }

    #[test]
    fn the_host_backend_warms_nothing() {
        let pipe = FluxPipeline::random(&FluxPipelineConfig::tiny(), 3, DType::F32).unwrap();
        let device = HostDevice::new(HostDeviceConfig::default()).unwrap();
        let shapes = pipe.linear_shapes(64, 64, 1).unwrap();
        let report = warm_linears(&*device, &shapes, None).unwrap();
        assert_eq!((report.warmed, report.skipped), (0, 0));
    }

    /// A device that says it loads kernels lazily: the warm-up runs every distinct shape
    /// once, leaves out those over the limit and gives back the memory it used.
    #[test]
    fn a_lazy_backend_runs_each_shape_once_within_the_limit() {
        let pipe = FluxPipeline::random(&FluxPipelineConfig::tiny(), 3, DType::F32).unwrap();
        let device =
            FaultInjectingDevice::new(HostDevice::new(HostDeviceConfig::default()).unwrap());
        device.report_lazy_kernels(true);
        let mut shapes = pipe.linear_shapes(64, 64, 1).unwrap();
        let distinct = shapes.iter().collect::<HashSet<_>>().len();
        shapes.extend(shapes.clone());
        let report = warm_linears(&*device, &shapes, None).unwrap();
        assert_eq!((report.warmed, report.skipped), (distinct, 0));
        let largest = shapes.iter().map(LinearShape::operand_bytes).max().unwrap();
        let report = warm_linears(&*device, &shapes, Some(largest - 1)).unwrap();
        assert!(report.skipped >= 1);
        assert_eq!(report.warmed + report.skipped, distinct);
        assert_eq!(device.memory_info().allocated, 0);
    }
}
