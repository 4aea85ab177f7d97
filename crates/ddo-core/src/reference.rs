//! Reference components: small, seeded component trees whose leaves do a real (if simple)
//! computation with their weights, on any [`Device`]. Routes are tested and demonstrated
//! on them until the real models of `ddo-nn` run through the same [`ForwardContext`].
//!
//! Each leaf reads its weights back from the execution device (so a route that forgot to
//! onload, or to order the copy before compute, gives a wrong answer or a typed error),
//! computes in f32 on the host in a fixed order (so outputs are bit-identical whatever the
//! route), and writes its output activation to a new device buffer (so activations count
//! in the device's peak, as they do on a GPU).
//!
//! [`build_on_ops`] makes the same tree whose leaves compute with the device's
//! [`Ops`](crate::Ops) instead: nothing is read back to the host during a forward, so a
//! route's copies are ordered against compute only by its events, as a model's are, and a
//! copy that does not wait for the compute still reading its destination gives wrong
//! output on a device whose compute runs behind the host (a GPU, or ddo-host's
//! `DeferredComputeDevice`).

use std::path::Path;
use std::sync::Arc;

use crate::checkpoint::Checkpoint;
use crate::component::{Component, LeafId, LeafKind, Module};
use crate::device::{Device, Stream, download, upload};
use crate::dtype::DType;
use crate::error::{CoreError, Result};
use crate::ops::{BinaryOp, UnaryOp};
use crate::param::{Param, ParamKind};
use crate::rng::SplitMix64;
use crate::route::{ComponentProgram, ForwardContext};
use crate::tensor::{Tensor, TensorStorage};

/// One leaf of a reference component.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeafSpec {
    /// Kind reported to routes.
    pub kind: LeafKind,
    /// `Some(out)`: an affine map to `out` features (weight `[out, in]`, bias `[out]`);
    /// `None`: a per-feature scale and shift (weight and bias `[features]`).
    pub out_features: Option<usize>,
}

impl LeafSpec {
    /// A linear leaf to `out` features.
    pub fn linear(out: usize) -> Self {
        Self {
            kind: LeafKind::Linear,
            out_features: Some(out),
        }
    }

    /// A norm-like per-feature leaf.
    pub fn norm() -> Self {
        Self {
            kind: LeafKind::Norm,
            out_features: None,
        }
    }
}

/// The shape of a reference component.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReferenceSpec {
    /// Component name (`vae`, `transformer`, ...).
    pub name: String,
    /// Class name (informational).
    pub class_name: String,
    /// Weight dtype.
    pub dtype: DType,
    /// Input features.
    pub in_features: usize,
    /// Leaves before the blocks (unmatched).
    pub stem: Vec<LeafSpec>,
    /// Blocks of the root block list `blocks`, each a list of leaves.
    pub blocks: Vec<Vec<LeafSpec>>,
    /// Leaves after the blocks (unmatched).
    pub head: Vec<LeafSpec>,
    /// Adds a head leaf `tied_proj` whose weight is the first stem leaf's weight (one
    /// param, two names). Needs a first stem leaf that maps `in_features` to itself.
    pub tie_head_to_stem: bool,
    /// Seed of the weights.
    pub seed: u64,
}

impl ReferenceSpec {
    /// A small spec: a stem, `blocks` blocks of linear + norm, and a head.
    pub fn small(name: &str, blocks: usize, width: usize, dtype: DType) -> Self {
        Self {
            name: name.to_string(),
            class_name: "ReferenceModel".to_string(),
            dtype,
            in_features: width,
            stem: vec![LeafSpec::linear(width)],
            blocks: (0..blocks)
                .map(|_| vec![LeafSpec::linear(width), LeafSpec::norm()])
                .collect(),
            head: vec![LeafSpec::norm(), LeafSpec::linear(width)],
            tie_head_to_stem: false,
            seed: 7,
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Op {
    Affine { inp: usize, out: usize },
    Scale { features: usize },
}

/// The program of a reference component: its leaves in order.
#[derive(Debug)]
pub struct ReferenceProgram {
    ops: Vec<(LeafId, Op)>,
    in_features: usize,
    /// Compute with the device's `Ops` ([`build_on_ops`]) instead of on the host.
    on_ops: bool,
}

/// How a reference component gets each param: `(name, kind, dtype, shape, values)`.
pub type ParamSource<'a> =
    dyn FnMut(&str, ParamKind, DType, Vec<usize>, &[f32]) -> Result<Arc<Param>> + 'a;

/// Builds a reference component with pageable host weights.
pub fn build(spec: &ReferenceSpec) -> Result<Arc<Component>> {
    build_with(spec, &mut |name, kind, dtype, shape, values| {
        Param::from_f32(name, kind, dtype, shape, values)
    })
}

/// Builds `spec` with pageable host weights (as [`build`]) whose leaves compute with the
/// device's [`Ops`](crate::Ops): an affine leaf is `tanh(linear(x, weight, bias))`, a
/// per-feature leaf `x * weight + bias`, in the weights' dtype (the input is cast to it),
/// all queued on the compute stream with nothing read back until the caller reads the
/// output. Its outputs are those of the device's ops, not [`build`]'s.
pub fn build_on_ops(spec: &ReferenceSpec) -> Result<Arc<Component>> {
    build_program(
        spec,
        &mut |name, kind, dtype, shape, values| Param::from_f32(name, kind, dtype, shape, values),
        true,
    )
}

/// Builds a reference component whose params come from `source` (e.g. a checkpoint).
pub fn build_with(spec: &ReferenceSpec, source: &mut ParamSource<'_>) -> Result<Arc<Component>> {
    build_program(spec, source, false)
}

fn build_program(
    spec: &ReferenceSpec,
    source: &mut ParamSource<'_>,
    on_ops: bool,
) -> Result<Arc<Component>> {
    if spec.in_features == 0 {
        return Err(CoreError::InvalidOption {
            option: "in_features".into(),
            value: "0".into(),
            hint: "a reference component needs at least one input feature".into(),
        });
    }
    let mut rng = SplitMix64::new(spec.seed);
    let mut features = spec.in_features;
    let mut ops: Vec<Op> = Vec::new();
    let mut first_weight: Option<Arc<Param>> = None;

    let mut make_leaf = |path: &str,
                         name: &str,
                         leaf: &LeafSpec,
                         features: &mut usize,
                         ops: &mut Vec<Op>,
                         source: &mut ParamSource<'_>|
     -> Result<Module> {
        let (op, wshape, bshape) = match leaf.out_features {
            Some(0) => {
                return Err(CoreError::InvalidOption {
                    option: format!("{path}.out_features"),
                    value: "0".into(),
                    hint: "leaves need at least one output feature".into(),
                });
            }
            Some(out) => (
                Op::Affine {
                    inp: *features,
                    out,
                },
                vec![out, *features],
                vec![out],
            ),
            None => (
                Op::Scale {
                    features: *features,
                },
                vec![*features],
                vec![*features],
            ),
        };
        let fan_in = wshape.last().copied().unwrap_or(1) as f32;
        let wvals: Vec<f32> = (0..wshape.iter().product::<usize>())
            .map(|_| match op {
                Op::Affine { .. } => rng.next_signed() / fan_in.sqrt(),
                Op::Scale { .. } => 1.0 + 0.25 * rng.next_signed(),
            })
            .collect();
        let bvals: Vec<f32> = (0..bshape[0]).map(|_| 0.1 * rng.next_signed()).collect();
        let w = source(
            &format!("{path}.weight"),
            ParamKind::Parameter,
            spec.dtype,
            wshape,
            &wvals,
        )?;
        let b = source(
            &format!("{path}.bias"),
            ParamKind::Parameter,
            spec.dtype,
            bshape,
            &bvals,
        )?;
        if first_weight.is_none() {
            first_weight = Some(Arc::clone(&w));
        }
        if let Op::Affine { out, .. } = op {
            *features = out;
        }
        ops.push(op);
        Ok(Module::leaf(
            name,
            leaf.kind,
            vec![("weight".to_string(), w), ("bias".to_string(), b)],
        ))
    };

    let mut children = Vec::new();
    for (i, leaf) in spec.stem.iter().enumerate() {
        let name = format!("stem_{i}");
        children.push(make_leaf(
            &name,
            &name,
            leaf,
            &mut features,
            &mut ops,
            source,
        )?);
    }
    if !spec.blocks.is_empty() {
        let mut blocks = Vec::new();
        for (b, block) in spec.blocks.iter().enumerate() {
            let mut leaves = Vec::new();
            for (i, leaf) in block.iter().enumerate() {
                let name = format!("layer_{i}");
                let path = format!("blocks.{b}.{name}");
                leaves.push(make_leaf(
                    &path,
                    &name,
                    leaf,
                    &mut features,
                    &mut ops,
                    source,
                )?);
            }
            blocks.push(Module::container(b.to_string(), leaves));
        }
        children.push(Module::block_list("blocks", blocks));
    }
    for (i, leaf) in spec.head.iter().enumerate() {
        let name = format!("head_{i}");
        children.push(make_leaf(
            &name,
            &name,
            leaf,
            &mut features,
            &mut ops,
            source,
        )?);
    }
    if spec.tie_head_to_stem {
        let tied = first_weight
            .filter(|w| w.shape() == [features, features] && w.shape()[1] == spec.in_features)
            .ok_or_else(|| CoreError::InvalidOption {
                option: "tie_head_to_stem".into(),
                value: "true".into(),
                hint: "the first stem leaf must map in_features to itself, and so must the network"
                    .into(),
            })?;
        let bias = source(
            "tied_proj.bias",
            ParamKind::Parameter,
            spec.dtype,
            vec![features],
            &vec![0.0; features],
        )?;
        children.push(Module::leaf(
            "tied_proj",
            LeafKind::Linear,
            vec![("weight".to_string(), tied), ("bias".to_string(), bias)],
        ));
        ops.push(Op::Affine {
            inp: features,
            out: features,
        });
    }
    let program = ReferenceProgram {
        ops: ops
            .into_iter()
            .enumerate()
            .map(|(i, op)| (LeafId(i), op))
            .collect(),
        in_features: spec.in_features,
        on_ops,
    };
    Component::new(
        spec.name.clone(),
        spec.class_name.clone(),
        Module::container("", children),
        Arc::new(program),
    )
}

/// Writes every param of `component` (tied weights once, under their canonical name) to a
/// safetensors file at `path`.
pub fn write_checkpoint(component: &Component, path: &Path) -> Result<()> {
    let params = component.params();
    let bytes: Vec<(String, Vec<u8>, DType, Vec<usize>)> = params
        .iter()
        .map(|p| {
            (
                p.name().to_string(),
                p.host().to_vec(),
                p.dtype(),
                p.shape().to_vec(),
            )
        })
        .collect();
    let mut views = Vec::new();
    for (name, data, dtype, shape) in &bytes {
        let st = dtype.to_safetensors();
        let view = safetensors::tensor::TensorView::new(st, shape.clone(), data).map_err(|e| {
            CoreError::Checkpoint {
                path: path.to_path_buf(),
                message: format!("cannot serialise `{name}`: {e}"),
            }
        })?;
        views.push((name.clone(), view));
    }
    safetensors::serialize_to_file(views, None, path).map_err(|e| CoreError::Checkpoint {
        path: path.to_path_buf(),
        message: format!("cannot write: {e}"),
    })
}

/// Builds `spec` with checkpoint-backed params from `checkpoint` (written by
/// [`write_checkpoint`] for the same spec).
pub fn build_from_checkpoint(
    spec: &ReferenceSpec,
    checkpoint: &Checkpoint,
) -> Result<Arc<Component>> {
    build_with(spec, &mut |name, kind, _dtype, _shape, _values| {
        Param::from_checkpoint(checkpoint, name, name, kind)
    })
}

/// A seeded input of `batch` rows for `spec`.
pub fn input(spec: &ReferenceSpec, batch: usize, seed: u64) -> Result<Tensor> {
    let mut rng = SplitMix64::new(seed);
    let values: Vec<f32> = (0..batch * spec.in_features)
        .map(|_| rng.next_signed())
        .collect();
    Tensor::from_f32(vec![batch, spec.in_features], DType::F32, &values)
}

fn read_f32(device: &dyn Device, t: &Tensor, stream: &Stream) -> Result<Vec<f32>> {
    match t.storage() {
        TensorStorage::Device(d) => t.dtype().decode_f32(&download(device, d, stream)?),
        TensorStorage::Host(_) => t.host_f32(),
    }
}

fn softsign(x: f32) -> f32 {
    x / (1.0 + x.abs())
}

/// A program whose forward returns its input unchanged: for components built only to be
/// attached, planned or detached, whose forward is not under test.
#[derive(Debug, Clone, Copy, Default)]
pub struct IdentityProgram;

impl ComponentProgram for IdentityProgram {
    fn forward(&self, _ctx: &mut ForwardContext<'_>, input: Tensor) -> Result<Tensor> {
        Ok(input)
    }
}

impl ComponentProgram for ReferenceProgram {
    fn forward(&self, ctx: &mut ForwardContext<'_>, input: Tensor) -> Result<Tensor> {
        let device = ctx.device();
        let stream = device.compute_stream();
        if input.shape().len() != 2 || input.shape()[1] != self.in_features {
            return Err(CoreError::Shape {
                what: "reference forward".into(),
                message: format!(
                    "input shape {:?}, expected [batch, {}]",
                    input.shape(),
                    self.in_features
                ),
            });
        }
        let batch = input.shape()[0];
        let mut x = input.to_device(device, &stream)?;
        if self.on_ops {
            return self.forward_on_ops(ctx, x);
        }
        for (leaf, op) in &self.ops {
            let next = ctx.run_leaf(*leaf, |w| {
                let xs = read_f32(device, &x, &stream)?;
                let weight = read_f32(device, w.get("weight")?, &stream)?;
                let bias = read_f32(device, w.get("bias")?, &stream)?;
                let (out_features, ys) = match *op {
                    Op::Affine { inp, out } => {
                        let mut ys = vec![0.0f32; batch * out];
                        for r in 0..batch {
                            for o in 0..out {
                                let mut acc = bias[o];
                                for i in 0..inp {
                                    acc += weight[o * inp + i] * xs[r * inp + i];
                                }
                                ys[r * out + o] = softsign(acc);
                            }
                        }
                        (out, ys)
                    }
                    Op::Scale { features } => {
                        let ys = xs
                            .iter()
                            .enumerate()
                            .map(|(k, v)| v * weight[k % features] + bias[k % features])
                            .collect();
                        (features, ys)
                    }
                };
                let bytes = DType::F32.encode_f32(&ys)?;
                let buf = upload(device, &bytes, &stream)?;
                Tensor::new(
                    vec![batch, out_features],
                    DType::F32,
                    TensorStorage::Device(buf.slice_all()),
                )
            })?;
            x = next;
        }
        Ok(x)
    }
}

impl ReferenceProgram {
    /// [`build_on_ops`]'s forward: every leaf on the device's ops.
    fn forward_on_ops(&self, ctx: &mut ForwardContext<'_>, mut x: Tensor) -> Result<Tensor> {
        let ops = crate::device::ops_of(ctx.device())?;
        for (leaf, op) in &self.ops {
            x = ctx.run_leaf(*leaf, |w| {
                let (weight, bias) = (w.get("weight")?, w.get("bias")?);
                let x = if x.dtype() == weight.dtype() {
                    x.clone()
                } else {
                    ops.cast(&x, weight.dtype())?
                };
                match *op {
                    Op::Affine { .. } => {
                        let y = ops.linear(&x, weight, Some(bias))?;
                        ops.unary_owned(y, UnaryOp::Tanh)
                    }
                    Op::Scale { .. } => {
                        let y = ops.binary(&x, weight, BinaryOp::Mul)?;
                        ops.binary(&y, bias, BinaryOp::Add)
                    }
                }
            })?;
        }
        Ok(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tied_weights_are_one_param_under_two_names() {
        let mut spec = ReferenceSpec::small("transformer", 1, 4, DType::F32);
        spec.tie_head_to_stem = true;
        let c = build(&spec).unwrap();
        let aliases = c.aliases();
        assert_eq!(aliases.len(), 1);
        let names = aliases.values().next().unwrap();
        assert_eq!(
            names,
            &vec!["stem_0.weight".to_string(), "tied_proj.weight".to_string()]
        );
        assert_eq!(c.params().len(), c.named_params().len() - 1);
    }

    #[test]
    fn checkpoint_round_trip_builds_the_same_weights() {
        let spec = ReferenceSpec::small("vae", 2, 6, DType::F16);
        let c = build(&spec).unwrap();
        let dir = std::env::temp_dir().join(format!("ddo-ref-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("diffusion_pytorch_model.safetensors");
        write_checkpoint(&c, &path).unwrap();
        let ckpt = Checkpoint::open(&path).unwrap();
        let mapped = build_from_checkpoint(&spec, &ckpt).unwrap();
        for (a, b) in c.params().iter().zip(mapped.params()) {
            assert_eq!(a.name(), b.name());
            assert_eq!(a.host_checksum(), b.host_checksum());
            assert!(b.is_checkpoint_backed());
            assert_eq!(b.source().unwrap().tensor, b.name());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
