//! fp8 storage chosen at load (`--dtype fp8_e4m3`): [`Fp8Storage`] wraps any
//! [`WeightSource`] and stores the weights of the layers Diffusers' layerwise casting casts
//! as an 8-bit float with a per-tensor scale, leaving the rest as the source gives them.
//!
//! Which layers: Diffusers' `enable_layerwise_casting` casts the `Linear`, `Conv` and
//! `Embedding` modules whose dotted name matches none of its skip patterns, by default
//! `DEFAULT_SKIP_MODULES_PATTERN` (`pos_embed`, `patch_embed`, `norm`, `^proj_in$`,
//! `^proj_out$`) plus the model's `_skip_layerwise_casting_patterns` (Flux's transformer:
//! `pos_embed`, `norm`), searched as regular expressions in the module name. So in Flux
//! the attention, feed-forward, embedder and single-block projections are cast, and the
//! adaLN modulations (`norm1.linear`, `norm.linear`, `norm_out.linear`), the norms and the
//! final `proj_out` stay as stored.
//!
//! Two differences from Diffusers, both for accuracy: Diffusers casts weight and bias
//! straight to fp8 (`module.to(float8_e4m3fn)`, no scale), where DDO stores each weight with
//! a per-tensor scale (`amax / 448`, as ComfyUI's scaled fp8 checkpoints do: small weights
//! stay out of fp8's subnormals) and keeps biases in the source dtype (they are a few
//! kilobytes per layer). Compute is in bf16 ([`DType::compute`]) either way.

use std::sync::Arc;

use ddo_core::host_memory::AlignedBytes;
use ddo_core::{DType, HostBuffer, Param, ParamKind};

use crate::error::{LoadError, LoadResult};
use crate::weights::WeightSource;

/// Diffusers' `DEFAULT_SKIP_MODULES_PATTERN` with `FluxTransformer2DModel`'s
/// `_skip_layerwise_casting_patterns` (a pattern `^name$` matches the whole module name,
/// any other a part of it, as `re.search` does for these).
pub const FLUX_SKIP_PATTERNS: [&str; 5] = [
    "pos_embed",
    "patch_embed",
    "norm",
    "^proj_in$",
    "^proj_out$",
];

/// Diffusers' `DEFAULT_SKIP_MODULES_PATTERN` with `QwenImageTransformer2DModel`'s
/// `_skip_layerwise_casting_patterns` (`pos_embed`, `norm`: Flux's list). So in Qwen-Image
/// the attention, feed-forward, modulation (`img_mod.1`, `txt_mod.1`), timestep embedder and
/// input projections (`img_in`, `txt_in`) are cast, and `txt_norm`, the q/k norms,
/// `norm_out.linear` and the final `proj_out` stay as stored.
pub const QWEN_IMAGE_SKIP_PATTERNS: [&str; 5] = FLUX_SKIP_PATTERNS;

/// The modules of a T5 encoder (`T5EncoderModel`) kept as stored under `--dtype fp8`: the
/// token embedding (`shared`, `encoder.embed_tokens`) and the relative attention bias, both
/// embedding tables, which DDO computes in 16 or 32 bits only (Diffusers'
/// `apply_layerwise_casting` would cast them: `Embedding` is among its layers), and the norms.
/// Every linear of the attention and the gated feed-forward is cast.
pub const T5_SKIP_PATTERNS: [&str; 4] =
    ["shared", "embed_tokens", "relative_attention_bias", "norm"];

/// The modules of Qwen-Image's text encoder (Qwen2.5-VL's language model) kept as stored
/// under `--dtype fp8`: the token embedding (`embed_tokens`, which DDO computes in 16 or 32
/// bits only) and the RMS norms (`input_layernorm`, `post_attention_layernorm`, `norm`).
/// Every attention and MLP linear is cast.
pub const QWEN_TEXT_SKIP_PATTERNS: [&str; 2] = ["embed_tokens", "norm"];

/// Whether module `module` (a dotted name) matches `pattern` as `re.search` matches the
/// skip patterns: `^name$` the whole name, any other pattern a substring.
fn matches(pattern: &str, module: &str) -> bool {
    match pattern.strip_prefix('^').and_then(|p| p.strip_suffix('$')) {
        Some(whole) => module == whole,
        None => module.contains(pattern),
    }
}

/// A [`WeightSource`] that stores the cast layers' weights (`<module>.weight`, two or more
/// dims, module outside the skip patterns) as scaled fp8; everything else, and a weight
/// already stored as fp8, passes through as the inner source gives it.
pub struct Fp8Storage<'w> {
    inner: &'w mut dyn WeightSource,
    format: DType,
    skip: &'static [&'static str],
    converted: u64,
}

impl<'w> Fp8Storage<'w> {
    /// Wraps `inner`, storing cast weights as `format` (an 8-bit float) and skipping the
    /// modules matching `skip`.
    pub fn new(
        inner: &'w mut dyn WeightSource,
        format: DType,
        skip: &'static [&'static str],
    ) -> LoadResult<Self> {
        if !format.is_fp8() {
            return Err(LoadError::InvalidConfig {
                field: "fp8 storage".into(),
                value: format.to_string(),
                hint: "store weights as f8_e4m3 or f8_e5m2".into(),
            });
        }
        Ok(Self {
            inner,
            format,
            skip,
            converted: 0,
        })
    }

    /// Whether param `name` of `shape` is stored as fp8.
    pub fn casts(&self, name: &str, shape: &[usize], kind: ParamKind) -> bool {
        let Some(module) = name.strip_suffix(".weight") else {
            return false;
        };
        kind == ParamKind::Parameter
            && shape.len() >= 2
            && !self.skip.iter().any(|p| matches(p, module))
    }

    /// Weights converted to fp8 so far.
    pub fn converted(&self) -> u64 {
        self.converted
    }
}

/// What a checkpoint source converts to under a load's `dtype`: nothing for an 8-bit float
/// (the cast layers are stored as fp8 by [`stored_as`], the rest stays as stored), `dtype`
/// otherwise.
pub fn source_target(dtype: Option<DType>) -> Option<DType> {
    dtype.filter(|d| !d.is_fp8())
}

/// `build` over `weights`, through an [`Fp8Storage`] skipping `skip` when `dtype` is an 8-bit
/// float (the one place a loader decides fp8 storage).
pub fn stored_as<T>(
    weights: &mut dyn WeightSource,
    dtype: Option<DType>,
    skip: &'static [&'static str],
    build: impl FnOnce(&mut dyn WeightSource) -> LoadResult<T>,
) -> LoadResult<T> {
    match dtype.filter(|d| d.is_fp8()) {
        Some(f) => build(&mut Fp8Storage::new(weights, f, skip)?),
        None => build(weights),
    }
}

impl WeightSource for Fp8Storage<'_> {
    fn param(&mut self, name: &str, shape: &[usize], kind: ParamKind) -> LoadResult<Arc<Param>> {
        let p = self.inner.param(name, shape, kind)?;
        self.store(name, shape, kind, p)
    }

    fn last_time_slice(
        &mut self,
        name: &str,
        shape: &[usize],
        frames: usize,
        kind: ParamKind,
    ) -> LoadResult<Arc<Param>> {
        let p = self.inner.last_time_slice(name, shape, frames, kind)?;
        self.store(name, shape, kind, p)
    }

    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }

    fn writes_values(&self) -> bool {
        self.inner.writes_values()
    }
}

impl Fp8Storage<'_> {
    /// `p` as stored: quantized to the format when the layer is cast, else as it is.
    fn store(
        &mut self,
        name: &str,
        shape: &[usize],
        kind: ParamKind,
        p: Arc<Param>,
    ) -> LoadResult<Arc<Param>> {
        if !self.casts(name, shape, kind) || p.dtype().is_fp8() {
            return Ok(p);
        }
        let mut codes = AlignedBytes::try_zeroed(p.nbytes() / p.dtype().size_in_bytes())?;
        let scale = if self.inner.writes_values() {
            // Quantized straight from the source bytes into the param's own (on all cores).
            p.host().with_bytes(|b| {
                self.format
                    .quantize_scaled_bytes(name, p.dtype(), b, codes.as_mut_slice())
            })?
        } else {
            // A planning shape: its codes are as unwritten as the source's bytes.
            1.0
        };
        drop(p);
        // Frozen like a checkpoint's bytes: read and page-locked in place, never written.
        let label = format!("(stored as {}) {name}", self.format);
        let q = Param::new(
            name,
            kind,
            self.format,
            shape.to_vec(),
            HostBuffer::frozen(codes, &label).slice_all(),
        )?;
        self.converted += 1;
        Ok(Param::with_scale(q, scale)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::RandomWeights;

    #[test]
    fn skip_patterns_follow_diffusers_layerwise_casting_for_flux() {
        let mut inner = RandomWeights::new(1, DType::BF16);
        let s = Fp8Storage::new(&mut inner, DType::F8E4M3, &FLUX_SKIP_PATTERNS).unwrap();
        let w = ParamKind::Parameter;
        for cast in [
            "transformer_blocks.0.attn.to_q.weight",
            "transformer_blocks.3.ff.net.0.proj.weight",
            "single_transformer_blocks.7.proj_out.weight",
            "single_transformer_blocks.7.proj_mlp.weight",
            "x_embedder.weight",
            "context_embedder.weight",
            "time_text_embed.timestep_embedder.linear_1.weight",
        ] {
            assert!(s.casts(cast, &[8, 8], w), "{cast}");
        }
        for kept in [
            "transformer_blocks.0.norm1.linear.weight",
            "single_transformer_blocks.0.norm.linear.weight",
            "norm_out.linear.weight",
            "proj_out.weight",
            "transformer_blocks.0.attn.norm_q.weight",
        ] {
            assert!(!s.casts(kept, &[8, 8], w), "{kept}");
        }
        // Biases, 1-D weights and buffers stay as stored.
        assert!(!s.casts("transformer_blocks.0.attn.to_q.bias", &[8], w));
        assert!(!s.casts("x_embedder.weight", &[8], w));
        assert!(!s.casts("x_embedder.weight", &[8, 8], ParamKind::Buffer));
    }

    #[test]
    fn cast_weights_are_scaled_fp8_of_the_source_values_and_the_rest_passes_through() {
        let mut plain = RandomWeights::new(7, DType::BF16);
        let want = plain
            .param("blocks.0.attn.to_q.weight", &[16, 8], ParamKind::Parameter)
            .unwrap();
        let bias = plain
            .param("blocks.0.attn.to_q.bias", &[16], ParamKind::Parameter)
            .unwrap();
        let mut inner = RandomWeights::new(7, DType::BF16);
        let mut s = Fp8Storage::new(&mut inner, DType::F8E4M3, &FLUX_SKIP_PATTERNS).unwrap();
        let q = s
            .param("blocks.0.attn.to_q.weight", &[16, 8], ParamKind::Parameter)
            .unwrap();
        let b = s
            .param("blocks.0.attn.to_q.bias", &[16], ParamKind::Parameter)
            .unwrap();
        assert_eq!((q.dtype(), q.nbytes()), (DType::F8E4M3, 128));
        let source = want
            .host()
            .with_bytes(|b| DType::BF16.decode_f32(b))
            .unwrap();
        let (codes, scale) = DType::F8E4M3.quantize_scaled("w", &source).unwrap();
        assert_eq!(q.scale(), Some(scale));
        assert_eq!(q.host().to_vec(), codes);
        assert_eq!(s.converted(), 1);
        // The bias is the source's, untouched.
        assert_eq!(b.dtype(), DType::BF16);
        assert_eq!(b.host().to_vec(), bias.host().to_vec());
        assert!(Fp8Storage::new(&mut plain, DType::BF16, &FLUX_SKIP_PATTERNS).is_err());
    }
}
