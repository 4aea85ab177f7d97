//! The transformer's program ([`FluxProgram`]): its layers, built in execution order,
//! and Diffusers' `FluxTransformer2DModel.forward`.

use std::sync::Arc;

use ddo_core::{
    BinaryOp, ComponentProgram, DType, Device, ForwardContext, Ops, Result, Tensor, UnaryOp, ops_of,
};
use half::{bf16, f16};

use super::blocks::{
    DeviceRope, DoubleBlock, Rope, SiluMlp, SingleBlock, Stream, chunks, modulate,
};
use super::{
    FluxInputs, FluxTransformerConfig, ROPE_THETA, TIMESTEP_CHANNELS, rope_tables, shape_err,
    timestep_embedding,
};
use crate::builder::ModelBuilder;
use crate::error::LoadResult;
use crate::layers::Linear;

/// Rounds `v` to `dtype` and back (what a PyTorch tensor of that dtype stores).
fn round_to(dtype: DType, v: f32) -> f32 {
    match dtype {
        DType::F16 => f16::from_f32(v).to_f32(),
        DType::BF16 => bf16::from_f32(v).to_f32(),
        _ => v,
    }
}

/// The transformer's layers and forward: the component's program.
#[derive(Debug, Clone)]
pub struct FluxProgram {
    pub(super) config: FluxTransformerConfig,
    timestep_embedder: SiluMlp,
    guidance_embedder: Option<SiluMlp>,
    text_embedder: SiluMlp,
    context_embedder: Linear,
    x_embedder: Linear,
    double_blocks: Vec<DoubleBlock>,
    single_blocks: Vec<SingleBlock>,
    norm_out: Linear,
    proj_out: Linear,
    /// The rotary tables of the last ids seen (host values): the ids of a denoising loop do
    /// not change from step to step, and the tables cost ~1 ms of host trigonometry.
    rope_cache: Arc<std::sync::Mutex<Option<RopeCache>>>,
}

/// Host rotary tables for one set of position ids.
#[derive(Debug)]
struct RopeCache {
    ids: Vec<[f32; 3]>,
    cos: Arc<Vec<f32>>,
    sin: Arc<Vec<f32>>,
}

/// Flux's rotary tables on a device, for one forward's joined position ids
/// ([`FluxProgram::make_rope`], [`super::FluxTransformer::forward_with_rope`]).
pub type FluxRope = DeviceRope<Vec<[f32; 3]>>;

/// A forward's position ids: the text's, then the image's (the joined sequence's order).
pub(super) fn joined_ids(txt_ids: &[[f32; 3]], img_ids: &[[f32; 3]]) -> Vec<[f32; 3]> {
    txt_ids.iter().chain(img_ids).copied().collect()
}

impl FluxProgram {
    /// The rotary tables of `ids` (cached for the last ids).
    pub(super) fn rope_tables_cached(&self, ids: &[[f32; 3]]) -> (Arc<Vec<f32>>, Arc<Vec<f32>>) {
        // A poisoned lock only means another forward panicked mid-update: recompute.
        let mut cache = self
            .rope_cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(c) = cache.as_ref()
            && c.ids == ids
        {
            return (Arc::clone(&c.cos), Arc::clone(&c.sin));
        }
        let (cos, sin) = rope_tables(ids, &self.config.axes_dims_rope, ROPE_THETA);
        let (cos, sin) = (Arc::new(cos), Arc::new(sin));
        *cache = Some(RopeCache {
            ids: ids.to_vec(),
            cos: Arc::clone(&cos),
            sin: Arc::clone(&sin),
        });
        (cos, sin)
    }

    /// The rotary tables of `ids` on the device (`[ids, head_dim]` f32 each).
    fn upload_rope(&self, ops: &dyn Ops, ids: &[[f32; 3]]) -> Result<Rope> {
        let (cos, sin) = self.rope_tables_cached(ids);
        let width = self.config.attention_head_dim;
        Ok(Rope {
            cos: ops.tensor_from_f32(&[ids.len(), width], DType::F32, &cos)?,
            sin: ops.tensor_from_f32(&[ids.len(), width], DType::F32, &sin)?,
        })
    }

    /// The rotary tables of the forwards over `inputs`' ids, made on `device` once
    /// ([`FluxRope`]).
    pub fn make_rope(&self, device: &dyn Device, inputs: &FluxInputs) -> Result<FluxRope> {
        let ids = joined_ids(&inputs.txt_ids, &inputs.img_ids);
        let tables = self.upload_rope(ops_of(device)?, &ids)?;
        Ok(DeviceRope::new(ids, tables))
    }

    pub(super) fn build(b: &mut ModelBuilder<'_>, c: &FluxTransformerConfig) -> LoadResult<Self> {
        let d = c.inner_dim();
        // Leaves in execution order (streamed routes predict their schedule from it).
        let x_embedder = Linear::build(b, "x_embedder", c.in_channels, d, true)?;
        let (timestep_embedder, guidance_embedder, text_embedder) =
            b.scope("time_text_embed", |b| {
                let t = SiluMlp::build(b, "timestep_embedder", TIMESTEP_CHANNELS, d)?;
                let g = if c.guidance_embeds {
                    Some(SiluMlp::build(
                        b,
                        "guidance_embedder",
                        TIMESTEP_CHANNELS,
                        d,
                    )?)
                } else {
                    None
                };
                let p = SiluMlp::build(b, "text_embedder", c.pooled_projection_dim, d)?;
                Ok((t, g, p))
            })?;
        let context_embedder =
            Linear::build(b, "context_embedder", c.joint_attention_dim, d, true)?;
        b.enter_blocks("transformer_blocks");
        let double_blocks = (0..c.num_layers)
            .map(|i| b.scope(i.to_string(), |b| DoubleBlock::build(b, c)))
            .collect::<LoadResult<Vec<_>>>();
        b.exit();
        let double_blocks = double_blocks?;
        b.enter_blocks("single_transformer_blocks");
        let single_blocks = (0..c.num_single_layers)
            .map(|i| b.scope(i.to_string(), |b| SingleBlock::build(b, c)))
            .collect::<LoadResult<Vec<_>>>();
        b.exit();
        let single_blocks = single_blocks?;
        let norm_out = b.scope("norm_out", |b| Linear::build(b, "linear", d, 2 * d, true))?;
        let out = c.patch_size * c.patch_size * c.out_channels();
        let proj_out = Linear::build(b, "proj_out", d, out, true)?;
        Ok(Self {
            config: c.clone(),
            timestep_embedder,
            guidance_embedder,
            text_embedder,
            context_embedder,
            x_embedder,
            double_blocks,
            single_blocks,
            norm_out,
            proj_out,
            rope_cache: Arc::default(),
        })
    }

    /// The config the program was built from.
    pub fn config(&self) -> &FluxTransformerConfig {
        &self.config
    }

    /// The linear calls [`FluxProgram::run`] makes for `batch` images of `li` latent and
    /// `lt` text tokens in `dtype` (each shape once; `tests/flux.rs` holds it to the calls a
    /// forward makes).
    pub(super) fn linear_calls(
        &self,
        batch: usize,
        li: usize,
        lt: usize,
        dtype: DType,
    ) -> Vec<ddo_core::LinearCall> {
        use ddo_core::{LinearCall, LinearKind};
        let c = &self.config;
        let d = c.inner_dim();
        let (img, txt, joint) = (
            batch.saturating_mul(li),
            batch.saturating_mul(lt),
            batch.saturating_mul(li.saturating_add(lt)),
        );
        let plain = |rows, k, n| LinearCall::new(LinearKind::Plain, rows, k, n, true, dtype);
        let gelu = |rows, k, n| LinearCall::new(LinearKind::GeluTanh, rows, k, n, true, dtype);
        let mut calls = vec![
            plain(img, c.in_channels, d),
            plain(batch, TIMESTEP_CHANNELS, d),
            plain(batch, d, d),
            plain(batch, c.pooled_projection_dim, d),
            plain(txt, c.joint_attention_dim, d),
        ];
        if !self.double_blocks.is_empty() {
            calls.extend([
                plain(batch, d, 6 * d),
                plain(img, d, d),
                plain(txt, d, d),
                gelu(img, d, 4 * d),
                plain(img, 4 * d, d),
                gelu(txt, d, 4 * d),
                plain(txt, 4 * d, d),
            ]);
        }
        if !self.single_blocks.is_empty() {
            calls.extend([
                plain(batch, d, 3 * d),
                plain(joint, d, d),
                gelu(joint, d, 4 * d),
                LinearCall::new(
                    LinearKind::Concat(vec![d, 4 * d]),
                    joint,
                    5 * d,
                    d,
                    true,
                    dtype,
                ),
            ]);
        }
        calls.push(plain(batch, d, 2 * d));
        calls.push(plain(
            img,
            d,
            c.patch_size * c.patch_size * c.out_channels(),
        ));
        ddo_core::linear_calls::distinct(&calls)
    }

    /// Checks `inputs` against the config; returns `(batch, img_tokens, txt_tokens)`.
    fn check_inputs(&self, inputs: &FluxInputs) -> Result<(usize, usize, usize)> {
        let c = &self.config;
        const WHAT: &str = "FluxTransformer inputs";
        let (b, li) = match inputs.hidden_states.shape() {
            &[b, li, ch] if ch == c.in_channels => (b, li),
            s => {
                return Err(shape_err(
                    WHAT,
                    format!(
                        "hidden_states {s:?}, expected [batch, img_tokens, {}]",
                        c.in_channels
                    ),
                ));
            }
        };
        let lt = match inputs.encoder_hidden_states.shape() {
            &[bb, lt, ch] if bb == b && ch == c.joint_attention_dim => lt,
            s => {
                return Err(shape_err(
                    WHAT,
                    format!(
                        "encoder_hidden_states {s:?}, expected [{b}, txt_tokens, {}]",
                        c.joint_attention_dim
                    ),
                ));
            }
        };
        if inputs.pooled_projections.shape() != [b, c.pooled_projection_dim] {
            return Err(shape_err(
                WHAT,
                format!(
                    "pooled_projections {:?}, expected [{b}, {}]",
                    inputs.pooled_projections.shape(),
                    c.pooled_projection_dim
                ),
            ));
        }
        let per_batch = |name: &str, n: usize| {
            if n == b || n == 1 {
                Ok(())
            } else {
                Err(shape_err(
                    WHAT,
                    format!(
                        "{name} has {n} values; give one per batch element ({b}) or one for all"
                    ),
                ))
            }
        };
        per_batch("timestep", inputs.timestep.len())?;
        match (&inputs.guidance, c.guidance_embeds) {
            (Some(g), true) => per_batch("guidance", g.len())?,
            (None, false) => {}
            (None, true) => {
                return Err(shape_err(
                    WHAT,
                    "this model has a guidance embedder (guidance_embeds=true): pass guidance (e.g. 3.5)",
                ));
            }
            (Some(_), false) => {
                return Err(shape_err(
                    WHAT,
                    "this model has no guidance embedder (guidance_embeds=false): pass guidance: None",
                ));
            }
        }
        if inputs.img_ids.len() != li || inputs.txt_ids.len() != lt {
            return Err(shape_err(
                WHAT,
                format!(
                    "{} img_ids and {} txt_ids for {li} image and {lt} text tokens; give one id per token",
                    inputs.img_ids.len(),
                    inputs.txt_ids.len()
                ),
            ));
        }
        Ok((b, li, lt))
    }

    /// The model's compute dtype: that of `x_embedder`'s weight (Diffusers' hidden dtype),
    /// bf16 when it is stored as fp8 ([`DType::compute`]); bf16 for a GGUF transformer with
    /// quantized weights, whatever its small tensors are stored as (Diffusers' GGUF
    /// `compute_dtype`; city96's files keep `img_in` in F32 or F16 beside K-quants).
    fn dtype(&self, ctx: &ForwardContext<'_>) -> Result<DType> {
        self.compute_dtype(ctx.component())
    }

    /// [`FluxProgram::dtype`] of the program's `component`.
    pub(super) fn compute_dtype(&self, component: &ddo_core::Component) -> Result<DType> {
        if crate::weights::holds_quantized(component) {
            return Ok(DType::BF16);
        }
        let leaf = component.leaf(self.x_embedder.leaf())?;
        leaf.params()
            .first()
            .map(|(_, p)| p.dtype().compute())
            .ok_or_else(|| shape_err("x_embedder", "has no weight"))
    }

    /// `time_proj` + embedder for per-batch `values` (already ×1000 and rounded).
    fn embed_scalar(
        &self,
        ctx: &mut ForwardContext<'_>,
        ops: &dyn Ops,
        mlp: &SiluMlp,
        values: &[f32],
        batch: usize,
        dtype: DType,
    ) -> Result<Tensor> {
        let values: Vec<f32> = if values.len() == 1 {
            vec![values[0]; batch]
        } else {
            values.to_vec()
        };
        let proj = timestep_embedding(&values, TIMESTEP_CHANNELS);
        let proj = ops.tensor_from_f32(&[batch, TIMESTEP_CHANNELS], dtype, &proj)?;
        mlp.forward(ctx, ops, &proj)
    }

    /// Diffusers' `FluxTransformer2DModel.forward` on `inputs`.
    pub fn run(&self, ctx: &mut ForwardContext<'_>, inputs: &FluxInputs) -> Result<Tensor> {
        self.run_with_rope(ctx, inputs, None)
    }

    /// [`FluxProgram::run`] with rotary tables already on the device (`made`, used where
    /// they were made for the inputs' ids; the forward makes its own otherwise).
    pub fn run_with_rope(
        &self,
        ctx: &mut ForwardContext<'_>,
        inputs: &FluxInputs,
        made: Option<&FluxRope>,
    ) -> Result<Tensor> {
        let (batch, _li, _lt) = self.check_inputs(inputs)?;
        let device = ctx.device();
        let ops = ops_of(device)?;
        let stream = device.compute_stream();
        let dtype = self.dtype(ctx)?;
        // The forward's inputs and rotary tables are uploaded here, before the first leaf,
        // while a streamed route's first weight copies already run (a backend may hold the
        // host for a pageable upload; ddo-cuda stages them in pinned buffers instead).
        let prepare = |t: &Tensor| -> Result<Tensor> {
            if !t.is_on_device() && t.dtype() == DType::F32 && dtype != DType::F32 {
                // Rounded on the host (to nearest even, as the device's cast): the same
                // values, half the bytes to upload.
                let narrow = Tensor::from_f32(t.shape().to_vec(), dtype, &t.host_f32()?)?;
                return narrow.to_device(device, &stream);
            }
            let t = t.to_device(device, &stream)?;
            if t.dtype() == dtype {
                Ok(t)
            } else {
                ops.cast(&t, dtype)
            }
        };
        let hidden_states = prepare(&inputs.hidden_states)?;
        let encoder_hidden_states = prepare(&inputs.encoder_hidden_states)?;
        let pooled = prepare(&inputs.pooled_projections)?;
        let ids = joined_ids(&inputs.txt_ids, &inputs.img_ids);
        let rope = match DeviceRope::tables_for(made, &ids) {
            Some(r) => r,
            None => self.upload_rope(ops, &ids)?,
        };

        let img = self.x_embedder.forward(ctx, &hidden_states)?;
        drop(hidden_states);

        // `timestep.to(dtype) * 1000` (and the same for guidance), rounded as the dtype does.
        let scale = |v: &[f32]| -> Vec<f32> {
            v.iter()
                .map(|&t| round_to(dtype, round_to(dtype, t) * 1000.0))
                .collect()
        };
        let mut temb = self.embed_scalar(
            ctx,
            ops,
            &self.timestep_embedder,
            &scale(&inputs.timestep),
            batch,
            dtype,
        )?;
        if let (Some(g), Some(mlp)) = (&inputs.guidance, &self.guidance_embedder) {
            let g = self.embed_scalar(ctx, ops, mlp, &scale(g), batch, dtype)?;
            temb = ops.binary(&temb, &g, BinaryOp::Add)?;
        }
        let pooled = self.text_embedder.forward(ctx, ops, &pooled)?;
        let temb = ops.binary(&temb, &pooled, BinaryOp::Add)?;
        drop(pooled);

        let txt = self.context_embedder.forward(ctx, &encoder_hidden_states)?;
        drop(encoder_hidden_states);

        // Every adaLN modulation starts from silu(temb); computed once.
        let temb_act = ops.unary(&temb, UnaryOp::Silu)?;
        // Between blocks a stream's last gated add waits for the next block's first norm,
        // which applies it in the same pass (`Stream`).
        let (mut txt, mut img) = (Stream::Ready(txt), Stream::Ready(img));
        for block in &self.double_blocks {
            (txt, img) = block.forward(ctx, ops, img, txt, &temb_act, &rope)?;
        }
        let (txt, img) = (txt.resolve(ops)?, img.resolve(ops)?);
        // The single blocks run on the joined stream [text, image].
        let lt = txt.shape()[1];
        let mut x = Stream::Ready(ops.concat(&[&txt, &img], 1)?);
        drop((txt, img));
        for block in &self.single_blocks {
            x = block.forward(ctx, ops, x, &temb_act, &rope)?;
        }
        let x = x.resolve(ops)?;
        let img = ops.narrow(&x, 1, lt, x.shape()[1] - lt)?;
        drop(x);

        // AdaLayerNormContinuous: chunk order is (scale, shift).
        let emb = self.norm_out.forward(ctx, &temb_act)?;
        let m = chunks(ops, &emb, 2)?;
        let x = modulate(ops, &img, &m[0], &m[1])?;
        self.proj_out.forward(ctx, &x)
    }
}

impl ComponentProgram for FluxProgram {
    /// The transformer takes several inputs: this single-tensor entry point refuses.
    fn forward(&self, _ctx: &mut ForwardContext<'_>, input: Tensor) -> Result<Tensor> {
        Err(shape_err(
            "FluxTransformer2DModel forward",
            format!(
                "the Flux transformer takes several inputs, not one tensor ({:?}); call \
                 FluxTransformer::forward with FluxInputs",
                input.shape()
            ),
        ))
    }
}
