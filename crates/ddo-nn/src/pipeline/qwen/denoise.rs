//! Prompt encoding and the denoising loop of [`QwenImagePipeline`]: the stand-in tokenizer
//! ([`stand_in_ids`]), `encode_prompt` for text ([`QwenImagePipeline::encode_prompt`]) and for
//! given embeddings ([`QwenImagePipeline::prepare_embeds`]), the initial latents, and the
//! loop with true CFG ([`QwenImagePipeline::denoise`]).

use ddo_core::finite::DeferredFiniteChecks;
use ddo_core::{
    BinaryOp, DType, Device, Ops, ReduceOp, Result, Tensor, UnaryOp, check_finite, ops_of,
};

use super::{QwenImagePipeline, core_error};
use crate::pipeline::fp8_blame::{StepInputs, name_fp8_layer};
use crate::pipeline::request::repeat_rows;
use crate::pipeline::{InitLatents, Progress, invalid, packed_initial_latents, round_to, to_host};
use crate::qwen_image::{QwenImageInputs, QwenRope};
use crate::qwen_text::{
    PROMPT_TEMPLATE_START_IDX, QwenPromptEmbeds, QwenTextEncoderConfig, QwenTextInputs,
    TOKENIZER_MAX_LENGTH, split_prompt_states, templated,
};
use crate::scheduler::FlowMatchEulerScheduler;

/// Stand-in tokens of the template before the prompt: the 34 dropped ones (the system part)
/// and `<|im_start|>user\n` (3), as many as Qwen's tokenizer makes of them.
pub const STAND_IN_PREFIX_TOKENS: usize = PROMPT_TEMPLATE_START_IDX + 3;
/// Stand-in tokens of the template after the prompt: `<|im_end|>\n<|im_start|>assistant\n`
/// (5 with Qwen's tokenizer).
pub const STAND_IN_SUFFIX_TOKENS: usize = 5;

/// Token ids for a text prompt when the pipeline has no tokenizer files (random weights at a
/// named config, or a folder without `tokenizer/` whose prompts come as text anyway): a
/// documented, deterministic stand-in, not Qwen's ids, with the template's token count.
///
/// The rule: `STAND_IN_PREFIX_TOKENS` template ids `0, 1, ..., 36`, then one id per piece of
/// the prompt (pieces as [`crate::tokenizer::pieces`] splits them: lower-cased letter/digit
/// runs and single other characters), `FNV-1a-64(piece) mod vocab_size`, then
/// [`STAND_IN_SUFFIX_TOKENS`] template ids `37, ..., 41` (every id taken `mod vocab_size`).
/// The pieces are cut so that the whole fits in `min(1024 + 34, max_position_embeddings)`
/// tokens (the tokenizer's `max_length` in `_get_qwen_prompt_embeds`), the suffix kept. No
/// padding: one prompt.
pub fn stand_in_ids(config: &QwenTextEncoderConfig, prompt: &str) -> Vec<u32> {
    let vocab = config.vocab_size.max(1) as u64;
    let template = STAND_IN_PREFIX_TOKENS + STAND_IN_SUFFIX_TOKENS;
    let limit = (TOKENIZER_MAX_LENGTH + PROMPT_TEMPLATE_START_IDX)
        .min(config.max_position_embeddings)
        .saturating_sub(template);
    let id = |k: u64| (k % vocab) as u32;
    let mut ids: Vec<u32> = (0..STAND_IN_PREFIX_TOKENS as u64).map(id).collect();
    ids.extend(
        crate::tokenizer::pieces(prompt)
            .iter()
            .take(limit)
            .map(|p| id(crate::tokenizer::fnv1a(p.as_bytes()))),
    );
    ids.extend((STAND_IN_PREFIX_TOKENS as u64..template as u64).map(id));
    ids
}

/// Host embeddings as the transformer takes them: `[b, L, D]` (f32) and the mask (`None`:
/// every token real).
#[derive(Debug, Clone)]
pub(super) struct HostEmbeds {
    pub(super) embeds: Tensor,
    pub(super) mask: Option<Vec<bool>>,
}

impl HostEmbeds {
    pub(super) fn batch(&self) -> usize {
        self.embeds.shape().first().copied().unwrap_or(0)
    }
}

/// The L2 norm of `x` over its last dimension, kept as size 1 (`torch.norm(x, dim=-1,
/// keepdim=True)`): squares and sum in f32, the root, back in `x`'s dtype.
fn norm_last(ops: &dyn Ops, x: &Tensor) -> Result<Tensor> {
    let last = x.shape().len().saturating_sub(1);
    let x32 = if x.dtype() == DType::F32 {
        x.clone()
    } else {
        ops.cast(x, DType::F32)?
    };
    let sq = ops.unary(&x32, UnaryOp::Square)?;
    drop(x32);
    let sum = ops.reduce(&sq, last, ReduceOp::Sum)?;
    drop(sq);
    let n = ops.unary(&sum, UnaryOp::Sqrt)?;
    if x.dtype() == DType::F32 {
        Ok(n)
    } else {
        ops.cast(&n, x.dtype())
    }
}

/// `QwenImagePipeline`'s true CFG combination: `comb = neg + scale·(pos − neg)`, then
/// `comb · (‖pos‖ / ‖comb‖)` with the norms over the last dimension, each op in the
/// predictions' dtype.
pub fn true_cfg_combine(ops: &dyn Ops, pos: &Tensor, neg: &Tensor, scale: f32) -> Result<Tensor> {
    let diff = ops.binary(pos, neg, BinaryOp::Sub)?;
    let scaled = ops.affine(&diff, scale, 0.0)?;
    drop(diff);
    let comb = ops.binary(neg, &scaled, BinaryOp::Add)?;
    drop(scaled);
    let cond_norm = norm_last(ops, pos)?;
    let noise_norm = norm_last(ops, &comb)?;
    let ratio = ops.binary(&cond_norm, &noise_norm, BinaryOp::Div)?;
    ops.binary(&comb, &ratio, BinaryOp::Mul)
}

impl QwenImagePipeline {
    /// `encode_prompt(prompt, max_sequence_length=self.max_sequence_length)` for one text
    /// prompt on `device`, through the text encoder's route: the template, the folder's
    /// tokenizer (or [`stand_in_ids`]), the encoder's last hidden state, the template's
    /// system tokens dropped, the cut to `max_sequence_length`. Embeddings holding a NaN or
    /// an Inf are [`ddo_core::CoreError::NonFinite`] (one count).
    pub fn encode_prompt(&self, device: &dyn Device, prompt: &str) -> Result<QwenPromptEmbeds> {
        let encoder = self.text_encoder()?;
        let inputs = match &self.tokenizer {
            Some(t) => t.encode_batch(
                &[templated(prompt)],
                TOKENIZER_MAX_LENGTH + PROMPT_TEMPLATE_START_IDX,
            )?,
            None => QwenTextInputs::single(stand_in_ids(encoder.config(), prompt)),
        };
        let hidden = encoder.forward(device, &inputs)?;
        let embeds = split_prompt_states(device, &inputs, &hidden, self.max_sequence_length)?;
        check_finite(
            ops_of(device)?,
            &embeds.prompt_embeds,
            "prompt encoding",
            None,
            "the prompt embeddings (text_encoder)",
        )
        .map_err(|e| name_fp8_layer(encoder.component(), e, || encoder.forward(device, &inputs)))?;
        Ok(embeds)
    }

    /// Checks embeddings against the transformer's text width: `prompt_embeds [b, L,
    /// joint_attention_dim]` with `b, L > 0`, and a mask of `b · L` flags when given.
    pub fn check_embeds(&self, e: &QwenPromptEmbeds) -> Result<()> {
        let d = self.transformer.config().joint_attention_dim;
        let shape = e.prompt_embeds.shape();
        let ok_shape = matches!(shape, [b, l, dd] if *b > 0 && *l > 0 && *dd == d);
        let ok_mask = match (&e.prompt_embeds_mask, shape) {
            (None, _) => true,
            (Some(m), [b, l, _]) => m.len() == b * l,
            _ => false,
        };
        if ok_shape && ok_mask {
            return Ok(());
        }
        Err(invalid(
            "prompt embeddings",
            format!(
                "prompt_embeds {shape:?}, prompt_embeds_mask of {} flags",
                e.prompt_embeds_mask.as_ref().map_or(0, Vec::len)
            ),
            format!(
                "expected prompt_embeds [b, L, {d}] (the transformer's joint_attention_dim) and \
                 a mask of b x L flags (or none), one row per prompt"
            ),
        ))
    }

    /// What `encode_prompt` does to embeddings before the loop, on the host: checked, cut to
    /// `max_sequence_length` (the mask too), each prompt's row repeated `num_images` times in
    /// a row (`num_images_per_prompt`; Diffusers repeats the mask the same way only for one
    /// prompt), and the mask dropped when every kept token is real.
    pub(super) fn prepare_embeds(
        &self,
        device: &dyn Device,
        e: &QwenPromptEmbeds,
        num_images: usize,
    ) -> Result<HostEmbeds> {
        self.check_embeds(e)?;
        let host = to_host(device, &e.prompt_embeds)?;
        let [b, l, d] = *host.shape() else {
            return Err(invalid("prompt embeddings", "", "expected [b, L, D]"));
        };
        let keep = l.min(self.max_sequence_length);
        let (embeds, mask) = if keep == l {
            (host, e.prompt_embeds_mask.clone())
        } else {
            let values = host.host_f32()?;
            let mut cut = Vec::with_capacity(b * keep * d);
            for row in values.chunks_exact(l * d) {
                cut.extend_from_slice(&row[..keep * d]);
            }
            let mask = e.prompt_embeds_mask.as_ref().map(|m| {
                m.chunks_exact(l)
                    .flat_map(|r| r[..keep].iter().copied())
                    .collect::<Vec<bool>>()
            });
            (Tensor::from_f32(vec![b, keep, d], DType::F32, &cut)?, mask)
        };
        let (embeds, mask) = if num_images == 1 {
            (embeds, mask)
        } else {
            let mask = mask.map(|m| {
                m.chunks_exact(keep)
                    .flat_map(|r| std::iter::repeat_n(r, num_images).flatten().copied())
                    .collect::<Vec<bool>>()
            });
            (repeat_rows(&embeds, num_images)?, mask)
        };
        let mask = mask.filter(|m| !m.iter().all(|&f| f));
        Ok(HostEmbeds { embeds, mask })
    }

    /// The packed initial latents of `images` images on `device`, in the transformer's
    /// dtype (`prepare_latents`): seeded noise (one draw of `images · C · h · w` values, as
    /// `randn_tensor` draws them), or given noise `[images, C, h, w]`, `[images, 1, C, h, w]`
    /// (Diffusers' frame axis) or packed `[images, tokens, 4·C]`.
    pub fn initial_latents(
        &self,
        device: &dyn Device,
        init: &InitLatents,
        height: usize,
        width: usize,
        images: usize,
    ) -> Result<Tensor> {
        let grid = self.latent_grid(height, width)?;
        let c = self.transformer.config().in_channels / 4;
        let init = match init {
            InitLatents::Given(t) => match *t.shape() {
                [n, 1, cc, h, w] => InitLatents::Given(t.reshape(&[n, cc, h, w])?),
                _ => init.clone(),
            },
            InitLatents::Seed(_) => init.clone(),
        };
        packed_initial_latents(
            device,
            &init,
            (height, width),
            images,
            grid,
            c,
            self.transformer_dtype(),
        )
    }

    /// The denoising loop on `device`: `steps` Euler steps of the flow-matching scheduler
    /// (QwenImagePipeline's sigmas and shift for this resolution) from packed `latents`, each
    /// calling the transformer through its route once on `positive`, and, when `negative`
    /// is given (`(embeddings, true_cfg_scale)`), once more on the negative embeddings, the
    /// two combined by [`true_cfg_combine`]. Returns the packed latents on `device`, the
    /// schedule's timesteps and the transformer passes run. Latents holding a NaN or an Inf
    /// after a step stop the loop with [`ddo_core::CoreError::NonFinite`] naming the step
    /// (one count per step).
    #[allow(clippy::too_many_arguments)] // the loop's inputs, as Diffusers' __call__ takes them
    pub(super) fn denoise(
        &self,
        device: &dyn Device,
        positive: &HostEmbeds,
        negative: Option<(&HostEmbeds, f32)>,
        latents: Tensor,
        steps: usize,
        height: usize,
        width: usize,
        progress: Progress<'_>,
    ) -> Result<(Tensor, Vec<f32>, usize)> {
        if steps == 0 {
            return Err(invalid("steps", "0", "give at least one denoising step"));
        }
        let ops = ops_of(device)?;
        let stream = device.compute_stream();
        let (h, w) = self.latent_grid(height, width)?;
        let tokens = (h / 2) * (w / 2);
        let b = positive.batch();
        let channels = self.transformer.config().in_channels;
        if latents.shape() != [b, tokens, channels] {
            return Err(invalid(
                "latents",
                format!("{:?}", latents.shape()),
                format!(
                    "packed latents for {b} {height}x{width} image(s) (one per row of the prompt \
                     embeddings) are [{b}, {tokens}, {channels}]"
                ),
            ));
        }
        if let Some((neg, _)) = negative
            && neg.batch() != b
        {
            return Err(invalid(
                "negative prompt embeddings",
                format!("{:?}", neg.embeds.shape()),
                format!(
                    "true CFG runs the negative prompt beside the prompt: give {b} row(s), one \
                     per row of the prompt embeddings"
                ),
            ));
        }
        let mut scheduler =
            FlowMatchEulerScheduler::new(self.scheduler.clone()).map_err(core_error)?;
        scheduler.set_flux_schedule(steps, tokens)?;
        let img_shapes = vec![[1, h / 2, w / 2]];
        let pos_embeds = positive.embeds.to_device(device, &stream)?;
        let neg_embeds = match negative {
            Some((n, _)) => Some(n.embeds.to_device(device, &stream)?),
            None => None,
        };
        let mut latents = latents;
        let mut passes = 0usize;
        let timesteps = scheduler.timesteps().to_vec();
        // One step's transformer passes from `latents`: the prompt's, then the negative
        // prompt's under true CFG, combined.
        let inputs_of = |latents: &Tensor, embeds: &Tensor, mask: &Option<Vec<bool>>, i: usize| {
            let ld = latents.dtype();
            // `t.expand(b).to(latents.dtype)`, then `/ 1000` in that dtype.
            let timestep = round_to(ld, round_to(ld, timesteps[i]) / 1000.0);
            QwenImageInputs {
                hidden_states: latents.clone(),
                encoder_hidden_states: embeds.clone(),
                encoder_hidden_states_mask: mask.clone(),
                timestep: vec![timestep],
                img_shapes: img_shapes.clone(),
            }
        };
        // Every step's passes have the same positions (one text length a prompt): their
        // rotary tables go to the device once, and are freed with the loop.
        let pos_rope = self
            .transformer
            .make_rope(device, &inputs_of(&latents, &pos_embeds, &positive.mask, 0))?;
        let neg_rope = match (negative, &neg_embeds) {
            (Some((neg, _)), Some(neg_embeds)) => Some(
                self.transformer
                    .make_rope(device, &inputs_of(&latents, neg_embeds, &neg.mask, 0))?,
            ),
            _ => None,
        };
        let passes_of = |latents: &Tensor, i: usize, passes: &mut usize| -> Result<Tensor> {
            let call = |embeds: &Tensor, mask: &Option<Vec<bool>>, rope: &QwenRope| {
                let inputs = inputs_of(latents, embeds, mask, i);
                self.transformer.forward_with_rope(device, &inputs, rope)
            };
            let mut noise_pred = call(&pos_embeds, &positive.mask, &pos_rope)?;
            *passes += 1;
            if let (Some((neg, scale)), Some(neg_embeds), Some(neg_rope)) =
                (negative, &neg_embeds, &neg_rope)
            {
                let neg_pred = call(neg_embeds, &neg.mask, neg_rope)?;
                *passes += 1;
                noise_pred = true_cfg_combine(ops, &noise_pred, &neg_pred, scale)?;
            }
            Ok(noise_pred)
        };
        // Each step's check is read once the next step is queued (`DeferredFiniteChecks`);
        // under `--compute fp8` the step it names runs again to name the layer
        // (`fp8_blame`).
        let mut checks = DeferredFiniteChecks::new(device);
        let mut kept = StepInputs::new(self.transformer.component());
        let blame = |kept: &StepInputs<'_>, e| {
            kept.name(e, |latents, i| passes_of(latents, i, &mut 0).map(drop))
        };
        for i in 0..timesteps.len() {
            kept.keep(i, &latents);
            let noise_pred = passes_of(&latents, i, &mut passes)?;
            latents = scheduler.step(ops, &noise_pred, &latents, i)?;
            checks
                .queue(&latents, "denoise", Some((i + 1, steps)), "the latents")
                .map_err(|e| blame(&kept, e))?;
            progress("denoise", i + 1, steps);
            crate::pipeline::cancel::check("denoise", i + 1)?;
        }
        checks.finish().map_err(|e| blame(&kept, e))?;
        Ok((latents, timesteps, passes))
    }
}
