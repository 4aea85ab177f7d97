//! The transformer's program ([`QwenImageProgram`]): its layers, built in execution order,
//! and Diffusers' `QwenImageTransformer2DModel.forward`.

use std::sync::{Arc, Mutex, PoisonError};

use ddo_core::{
    ComponentProgram, DType, Device, ForwardContext, Ops, Result, Tensor, UnaryOp, ops_of,
};
use half::{bf16, f16};

use super::blocks::DualStreamBlock;
use super::{
    QwenImageInputs, QwenImageTransformerConfig, ROPE_TABLE_POSITIONS, ROPE_THETA,
    TIMESTEP_CHANNELS, TIMESTEP_SCALE, attention_mask, image_positions, rope_tables, shape_err,
    text_positions, timestep_embedding,
};
use crate::builder::ModelBuilder;
use crate::error::LoadResult;
use crate::flux::blocks::{DeviceRope, NORM_EPS, Rope, SiluMlp, Stream, chunks, modulate};

/// Qwen-Image's rotary tables on a device, for one forward's image shapes and text length
/// ([`QwenImageProgram::make_rope`], [`super::QwenImageTransformer::forward_with_rope`]; true
/// CFG's two prompts make one each).
pub type QwenRope = DeviceRope<(Vec<[usize; 3]>, usize)>;
use crate::layers::{Linear, RmsNorm};

/// Rounds `v` to `dtype` and back (what a PyTorch tensor of that dtype stores).
fn round_to(dtype: DType, v: f32) -> f32 {
    match dtype {
        DType::F16 => f16::from_f32(v).to_f32(),
        DType::BF16 => bf16::from_f32(v).to_f32(),
        _ => v,
    }
}

/// What a forward hands its named intermediates to
/// ([`super::QwenImageTransformer::forward_with_taps`]).
pub type Tap<'a> = &'a mut dyn FnMut(&str, &Tensor) -> Result<()>;

/// The transformer's layers and forward: the component's program.
#[derive(Debug, Clone)]
pub struct QwenImageProgram {
    config: QwenImageTransformerConfig,
    img_in: Linear,
    txt_norm: RmsNorm,
    txt_in: Linear,
    timestep_embedder: SiluMlp,
    blocks: Vec<DualStreamBlock>,
    norm_out: Linear,
    proj_out: Linear,
    /// The rotary tables of the last image shapes and text length seen (host values): they
    /// do not change from step to step of a denoising loop.
    rope_cache: Arc<Mutex<Option<RopeCache>>>,
}

/// Host rotary tables for one (image shapes, text length).
#[derive(Debug)]
struct RopeCache {
    img_shapes: Vec<[usize; 3]>,
    txt: usize,
    cos: Arc<Vec<f32>>,
    sin: Arc<Vec<f32>>,
}

impl QwenImageProgram {
    pub(super) fn build(
        b: &mut ModelBuilder<'_>,
        c: &QwenImageTransformerConfig,
    ) -> LoadResult<Self> {
        let d = c.inner_dim();
        // Leaves in execution order (streamed routes predict their schedule from it):
        // Diffusers' forward runs img_in, txt_norm, txt_in, then the timestep embedder.
        let img_in = Linear::build(b, "img_in", c.in_channels, d, true)?;
        let txt_norm = RmsNorm::build(b, "txt_norm", c.joint_attention_dim, NORM_EPS)?;
        let txt_in = Linear::build(b, "txt_in", c.joint_attention_dim, d, true)?;
        let timestep_embedder = b.scope("time_text_embed", |b| {
            SiluMlp::build(b, "timestep_embedder", TIMESTEP_CHANNELS, d)
        })?;
        b.enter_blocks("transformer_blocks");
        let blocks = (0..c.num_layers)
            .map(|i| b.scope(i.to_string(), |b| DualStreamBlock::build(b, c)))
            .collect::<LoadResult<Vec<_>>>();
        b.exit();
        let blocks = blocks?;
        let norm_out = b.scope("norm_out", |b| Linear::build(b, "linear", d, 2 * d, true))?;
        let proj_out = Linear::build(b, "proj_out", d, c.proj_out_channels(), true)?;
        Ok(Self {
            config: c.clone(),
            img_in,
            txt_norm,
            txt_in,
            timestep_embedder,
            blocks,
            norm_out,
            proj_out,
            rope_cache: Arc::default(),
        })
    }

    /// The config the program was built from.
    pub fn config(&self) -> &QwenImageTransformerConfig {
        &self.config
    }

    /// Checks `inputs` against the config; returns `(batch, img_tokens, txt_tokens)`.
    fn check_inputs(&self, inputs: &QwenImageInputs) -> Result<(usize, usize, usize)> {
        let c = &self.config;
        const WHAT: &str = "QwenImageTransformer inputs";
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
        let n = inputs.timestep.len();
        if n != b && n != 1 {
            return Err(shape_err(
                WHAT,
                format!("timestep has {n} values; give one per batch element ({b}) or one for all"),
            ));
        }
        if let Some(mask) = &inputs.encoder_hidden_states_mask
            && mask.len() != b * lt
        {
            return Err(shape_err(
                WHAT,
                format!(
                    "encoder_hidden_states_mask has {} flags; give one per text token of every \
                     sample ({b} x {lt}), true for a real token",
                    mask.len()
                ),
            ));
        }
        let mut tokens = 0usize;
        let mut reach = 0usize;
        for (k, &[frames, rows, cols]) in inputs.img_shapes.iter().enumerate() {
            tokens = frames
                .checked_mul(rows)
                .and_then(|t| t.checked_mul(cols))
                .and_then(|t| t.checked_add(tokens))
                .ok_or_else(|| shape_err(WHAT, "img_shapes: the token count overflows"))?;
            // Frames reach k + frames, rows and columns (n - n / 2) below 0 and n / 2 above.
            reach = reach
                .max(k.saturating_add(frames))
                .max(rows - rows / 2)
                .max(cols - cols / 2)
                .max(rows / 2)
                .max(cols / 2);
        }
        if tokens != li {
            return Err(shape_err(
                WHAT,
                format!(
                    "img_shapes {:?} hold {tokens} image tokens but hidden_states has {li}; \
                     give (frames, rows, cols) of 2x2 patches of every image of a sample",
                    inputs.img_shapes
                ),
            ));
        }
        // Text positions run from m = max(rows / 2, cols / 2) over the images to m + lt - 1.
        let m = inputs
            .img_shapes
            .iter()
            .map(|&[_, r, c]| (r / 2).max(c / 2))
            .max()
            .unwrap_or(0);
        let limit = ROPE_TABLE_POSITIONS as usize;
        if reach > limit || m.saturating_add(lt) > limit {
            return Err(shape_err(
                WHAT,
                format!(
                    "img_shapes {:?} with {lt} text tokens need rotary positions beyond the \
                     {limit} on each side of 0 Qwen-Image has tables for; use a smaller image \
                     or a shorter prompt",
                    inputs.img_shapes
                ),
            ));
        }
        Ok((b, li, lt))
    }

    /// The rotary tables of `lt` text and `li` image tokens over `img_shapes`, on the
    /// device (`[lt + li, head_dim]` f32 each).
    fn upload_rope(
        &self,
        ops: &dyn Ops,
        img_shapes: &[[usize; 3]],
        lt: usize,
        li: usize,
    ) -> Result<Rope> {
        let (cos, sin) = self.rope_tables_cached(img_shapes, lt);
        let width = self.config.attention_head_dim;
        Ok(Rope {
            cos: ops.tensor_from_f32(&[lt + li, width], DType::F32, &cos)?,
            sin: ops.tensor_from_f32(&[lt + li, width], DType::F32, &sin)?,
        })
    }

    /// The rotary tables of the forwards over `inputs`' image shapes and text length, made
    /// on `device` once ([`QwenRope`]).
    pub fn make_rope(&self, device: &dyn Device, inputs: &QwenImageInputs) -> Result<QwenRope> {
        let (_, li, lt) = self.check_inputs(inputs)?;
        let tables = self.upload_rope(ops_of(device)?, &inputs.img_shapes, lt, li)?;
        Ok(DeviceRope::new((inputs.img_shapes.clone(), lt), tables))
    }

    /// The rotary tables over `[text, image]` (cached for the last shapes).
    fn rope_tables_cached(
        &self,
        img_shapes: &[[usize; 3]],
        txt: usize,
    ) -> (Arc<Vec<f32>>, Arc<Vec<f32>>) {
        // A poisoned lock only means another forward panicked mid-update: recompute.
        let mut cache = self
            .rope_cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(c) = cache.as_ref()
            && c.img_shapes == img_shapes
            && c.txt == txt
        {
            return (Arc::clone(&c.cos), Arc::clone(&c.sin));
        }
        let positions: Vec<[i64; 3]> = text_positions(img_shapes, txt)
            .into_iter()
            .chain(image_positions(img_shapes))
            .collect();
        let (cos, sin) = rope_tables(&positions, &self.config.axes_dims_rope, ROPE_THETA);
        let (cos, sin) = (Arc::new(cos), Arc::new(sin));
        *cache = Some(RopeCache {
            img_shapes: img_shapes.to_vec(),
            txt,
            cos: Arc::clone(&cos),
            sin: Arc::clone(&sin),
        });
        (cos, sin)
    }

    /// The model's compute dtype: that of `img_in`'s weight (Diffusers' hidden dtype), bf16
    /// when it is stored as fp8 ([`DType::compute`]); bf16 for a GGUF transformer with
    /// quantized weights ([`crate::weights::holds_quantized`]).
    fn dtype(&self, ctx: &ForwardContext<'_>) -> Result<DType> {
        self.compute_dtype(ctx.component())
    }

    /// [`QwenImageProgram::dtype`] of the program's `component`.
    pub(super) fn compute_dtype(&self, component: &ddo_core::Component) -> Result<DType> {
        if crate::weights::holds_quantized(component) {
            return Ok(DType::BF16);
        }
        let leaf = component.leaf(self.img_in.leaf())?;
        leaf.params()
            .first()
            .map(|(_, p)| p.dtype().compute())
            .ok_or_else(|| shape_err("img_in", "has no weight"))
    }

    /// The linear calls [`QwenImageProgram::run`] makes for `batch` samples of `li` image
    /// and `lt` text tokens in `dtype` (each shape once; `tests/qwen_image.rs` holds it to
    /// the calls a forward makes).
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
        let (img, txt) = (batch.saturating_mul(li), batch.saturating_mul(lt));
        let plain = |rows, k, n| LinearCall::new(LinearKind::Plain, rows, k, n, true, dtype);
        let gelu = |rows, k, n| LinearCall::new(LinearKind::GeluTanh, rows, k, n, true, dtype);
        let mut calls = vec![
            plain(img, c.in_channels, d),
            plain(txt, c.joint_attention_dim, d),
            plain(batch, TIMESTEP_CHANNELS, d),
            plain(batch, d, d),
        ];
        if !self.blocks.is_empty() {
            // Per block: img_mod and txt_mod, the six projections and two outputs of the
            // joint attention, then each stream's feed-forward.
            for rows in [img, txt] {
                calls.extend([
                    plain(rows, d, d),
                    gelu(rows, d, 4 * d),
                    plain(rows, 4 * d, d),
                ]);
            }
            calls.push(plain(batch, d, 6 * d));
        }
        calls.push(plain(batch, d, 2 * d));
        calls.push(plain(img, d, c.proj_out_channels()));
        ddo_core::linear_calls::distinct(&calls)
    }

    /// Diffusers' `QwenImageTransformer2DModel.forward` on `inputs`, handing `tap` the
    /// intermediates named as [`super::QwenImageTransformer::forward_with_taps`] says.
    pub fn run(
        &self,
        ctx: &mut ForwardContext<'_>,
        inputs: &QwenImageInputs,
        tap: Tap<'_>,
    ) -> Result<Tensor> {
        self.run_with_rope(ctx, inputs, None, Some(tap))
    }

    /// [`QwenImageProgram::run`] with rotary tables already on the device (`made`, used
    /// where they were made for the inputs' image shapes and text length; the forward makes
    /// its own otherwise), and the intermediates handed to `tap` where one is given. Without
    /// one, each block's last gated adds are left to the next block's first norms (one op
    /// each: `Stream`); a tap sees every block's outputs, so they are applied at once.
    /// Both give the same bytes.
    pub fn run_with_rope(
        &self,
        ctx: &mut ForwardContext<'_>,
        inputs: &QwenImageInputs,
        made: Option<&QwenRope>,
        mut tap: Option<Tap<'_>>,
    ) -> Result<Tensor> {
        let tapping = tap.is_some();
        let mut tap = |name: &str, t: &Tensor| -> Result<()> {
            match tap.as_mut() {
                Some(f) => f(name, t),
                None => Ok(()),
            }
        };
        let (batch, li, lt) = self.check_inputs(inputs)?;
        let device = ctx.device();
        let ops = ops_of(device)?;
        let stream = device.compute_stream();
        let dtype = self.dtype(ctx)?;
        // The forward's inputs, rotary tables and mask are uploaded here, before the first
        // leaf, while a streamed route's first weight copies already run.
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
        let key = (inputs.img_shapes.clone(), lt);
        let rope = match DeviceRope::tables_for(made, &key) {
            Some(r) => r,
            None => self.upload_rope(ops, &inputs.img_shapes, lt, li)?,
        };
        // Only a mask that hides some key changes the attention: an all-true mask is the
        // unmasked attention, and takes its path.
        let mask = match &inputs.encoder_hidden_states_mask {
            Some(m) if m.iter().any(|keep| !keep) => {
                let values = attention_mask(m, batch, lt, li);
                Some(ops.tensor_from_f32(&[batch, 1, 1, lt + li], dtype, &values)?)
            }
            _ => None,
        };

        let img = self.img_in.forward(ctx, &hidden_states)?;
        drop(hidden_states);
        tap("img_in", &img)?;
        let txt = self.txt_norm.forward(ctx, &encoder_hidden_states)?;
        drop(encoder_hidden_states);
        tap("txt_norm", &txt)?;
        let txt = self.txt_in.forward(ctx, &txt)?;
        tap("txt_in", &txt)?;

        // `timestep.to(dtype)`, then the projection in f32 (`1000 * (t * f)`), then `.to(dtype)`.
        let steps: Vec<f32> = if inputs.timestep.len() == 1 {
            vec![inputs.timestep[0]; batch]
        } else {
            inputs.timestep.clone()
        };
        let steps: Vec<f32> = steps.iter().map(|&t| round_to(dtype, t)).collect();
        let proj = timestep_embedding(&steps, TIMESTEP_CHANNELS, TIMESTEP_SCALE);
        let proj = ops.tensor_from_f32(&[batch, TIMESTEP_CHANNELS], dtype, &proj)?;
        let temb = self.timestep_embedder.forward(ctx, ops, &proj)?;
        drop(proj);
        tap("time_text_embed", &temb)?;

        // Every modulation starts from silu(temb) (`img_mod`/`txt_mod`'s `SiLU`, and
        // `norm_out`'s): computed once.
        let temb_act = ops.unary(&temb, UnaryOp::Silu)?;
        drop(temb);
        let (mut txt, mut img) = (Stream::Ready(txt), Stream::Ready(img));
        for (i, block) in self.blocks.iter().enumerate() {
            (txt, img) = block.forward(ctx, ops, img, txt, &temb_act, &rope, mask.as_ref())?;
            if tapping {
                let (t, m) = (txt.resolve(ops)?, img.resolve(ops)?);
                tap(&format!("transformer_blocks.{i}.0"), &t)?;
                tap(&format!("transformer_blocks.{i}.1"), &m)?;
                (txt, img) = (Stream::Ready(t), Stream::Ready(m));
            }
        }
        let img = img.resolve(ops)?;
        drop((txt, rope, mask));

        // AdaLayerNormContinuous: chunk order is (scale, shift).
        let emb = self.norm_out.forward(ctx, &temb_act)?;
        let m = chunks(ops, &emb, 2)?;
        let x = modulate(ops, &img, &m[0], &m[1])?;
        drop(img);
        tap("norm_out", &x)?;
        self.proj_out.forward(ctx, &x)
    }
}

impl ComponentProgram for QwenImageProgram {
    /// The transformer takes several inputs: this single-tensor entry point refuses.
    fn forward(&self, _ctx: &mut ForwardContext<'_>, input: Tensor) -> Result<Tensor> {
        Err(shape_err(
            "QwenImageTransformer2DModel forward",
            format!(
                "the Qwen-Image transformer takes several inputs, not one tensor ({:?}); call \
                 QwenImageTransformer::forward with QwenImageInputs",
                input.shape()
            ),
        ))
    }
}
