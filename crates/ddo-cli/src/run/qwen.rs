//! What `ddo run` does differently for a `QwenImagePipeline`: its prompt embeddings file
//! (`prompt_embeds` with `prompt_embeds_mask`, and the negative prompt's), true CFG
//! (`--negative-prompt`, `--true-cfg-scale`), and the options that are Flux's alone.

use std::path::Path;

use ddo_core::DType;
use ddo_nn::pipeline::{QwenImagePipeline, QwenPromptInput};
use ddo_nn::qwen_text::QwenPromptEmbeds;

use crate::cli::RunArgs;
use crate::error::{CliError, CliResult};
use crate::io::{HostTensor, read_optional_tensor, read_tensor};

/// Which single component files a Qwen-Image run takes.
pub(super) const SINGLE_FILES_HINT: &str = "a QwenImagePipeline takes two single files beside --weights DIR, --transformer FILE and --text-encoder FILE (safetensors or GGUF, a Qwen2.5-VL GGUF in llama.cpp's names too); its VAE loads from the folder";

/// QwenImagePipeline's `true_cfg_scale` default.
pub const DEFAULT_TRUE_CFG_SCALE: f32 = 4.0;

/// Refuses the options a Qwen-Image run does not take, each with what to use instead.
pub(super) fn refuse_flux_options(args: &RunArgs) -> CliResult<()> {
    let flux_only = [
        (
            "--guidance",
            args.guidance.is_some(),
            "Qwen-Image has no guidance embedding: its guidance is true CFG (--true-cfg-scale with --negative-prompt)",
        ),
        (
            "--text-encoder-2",
            args.load.text_encoder_2.is_some(),
            "QwenImagePipeline has one text encoder (text_encoder/); T5 is Flux's",
        ),
        ("--vae", args.load.vae.is_some(), SINGLE_FILES_HINT),
        (
            "--save-latents",
            args.save_latents.is_some(),
            "ddo decode takes Flux's AutoencoderKL latents; write --out OUT.safetensors for the packed latents and the image",
        ),
    ];
    for (option, given, hint) in flux_only {
        if given {
            return Err(CliError::usage(
                format!("{option} is not an option of a QwenImagePipeline run"),
                hint,
            ));
        }
    }
    Ok(())
}

/// Refuses true CFG's options on a Flux run.
pub(super) fn refuse_qwen_options(args: &RunArgs) -> CliResult<()> {
    for (option, given) in [
        ("--negative-prompt", args.negative_prompt.is_some()),
        ("--true-cfg-scale", args.true_cfg_scale.is_some()),
    ] {
        if given {
            return Err(CliError::usage(
                format!("{option} is not an option of a FluxPipeline run"),
                "FLUX.1-dev is guidance-distilled: give --guidance SCALE; true CFG is QwenImagePipeline's (--config qwen-image or a Qwen-Image folder)",
            ));
        }
    }
    Ok(())
}

/// Embeddings read from `--prompt-embeds` for a Qwen-Image run.
#[derive(Debug, Clone)]
pub(crate) struct QwenEmbedsFile {
    /// The prompts'.
    pub positive: QwenPromptEmbeds,
    /// The negative prompts', when the file has them.
    pub negative: Option<QwenPromptEmbeds>,
}

impl QwenEmbedsFile {
    /// Prompts in the file.
    pub fn batch(&self) -> usize {
        self.positive
            .prompt_embeds
            .shape()
            .first()
            .copied()
            .unwrap_or(0)
    }
}

/// One prompt set's embeddings: `{prefix}prompt_embeds` `[B, L, D]` and, when present,
/// `{prefix}prompt_embeds_mask` `[B, L]` (nonzero on kept tokens; every token kept when it
/// is absent, as `encode_prompt` returns then).
fn read_embeds(path: &Path, prefix: &str) -> CliResult<Option<QwenPromptEmbeds>> {
    let name = format!("{prefix}prompt_embeds");
    let mask_name = format!("{prefix}prompt_embeds_mask");
    let seq = if prefix.is_empty() {
        read_tensor(path, &[&name], "--prompt-embeds")?
    } else {
        match read_optional_tensor(path, &name, "--prompt-embeds")? {
            Some(t) => t,
            None => return Ok(None),
        }
    };
    let (b, l) = match seq.shape.as_slice() {
        [b, l, d] if *b > 0 && *l > 0 && *d > 0 => (*b, *l),
        other => {
            return Err(CliError::usage(
                format!(
                    "--prompt-embeds {}: `{name}` has shape {other:?}",
                    path.display()
                ),
                "give [prompts, tokens, hidden] (QwenImagePipeline's prompt_embeds)",
            ));
        }
    };
    // Diffusers' masks are int64; int32, bool, uint8 and floats are taken too, 0/1 only.
    let mask: Option<Vec<bool>> = match ddo_nn::read_mask_tensor(path, &mask_name)
        .map_err(|e| CliError::from(e).context("--prompt-embeds"))?
    {
        None => None,
        Some((shape, values)) if shape == [b, l] => Some(values),
        Some((shape, _)) => {
            return Err(CliError::usage(
                format!(
                    "--prompt-embeds {}: `{mask_name}` has shape {shape:?}, `{name}` {:?}",
                    path.display(),
                    seq.shape
                ),
                format!("give a [{b}, {l}] mask, 1 on the tokens kept"),
            ));
        }
    };
    let lengths = match &mask {
        Some(m) => m
            .chunks(l)
            .map(|row| row.iter().filter(|&&k| k).count())
            .collect(),
        None => vec![l; b],
    };
    if lengths.contains(&0) {
        return Err(CliError::usage(
            format!(
                "--prompt-embeds {}: a row of `{mask_name}` keeps no token",
                path.display()
            ),
            "every prompt needs at least one kept token",
        ));
    }
    let mask = mask.filter(|m| m.iter().any(|&k| !k));
    Ok(Some(QwenPromptEmbeds {
        prompt_embeds: HostTensor::to_tensor(&seq)?,
        prompt_embeds_mask: mask,
        lengths,
    }))
}

/// Reads `--prompt-embeds` for a Qwen-Image run: the prompts' embeddings and, when the file
/// has them, the negative prompts' (`negative_prompt_embeds`, `negative_prompt_embeds_mask`),
/// one row per prompt.
pub(crate) fn read_embeds_file(path: &Path) -> CliResult<QwenEmbedsFile> {
    // Tensors a Qwen-Image run would not read are refused, not ignored: Flux's pooled
    // embeddings (a Flux file given to a Qwen run), and a negative mask without its
    // negative embeddings.
    for flux in ["pooled_prompt_embeds", "negative_pooled_prompt_embeds"] {
        if read_optional_tensor(path, flux, "--prompt-embeds")?.is_some() {
            return Err(CliError::usage(
                format!(
                    "--prompt-embeds {}: `{flux}` is FluxPipeline's (CLIP's pooled output), which a QwenImagePipeline run does not use",
                    path.display()
                ),
                "give the embeddings QwenImagePipeline.encode_prompt returns (prompt_embeds, prompt_embeds_mask), or run a Flux pipeline",
            ));
        }
    }
    let positive = read_embeds(path, "")?.ok_or_else(|| {
        CliError::usage(
            format!("--prompt-embeds {}: no prompt_embeds", path.display()),
            "save the tensor under the name `prompt_embeds`",
        )
    })?;
    let negative = read_embeds(path, "negative_")?;
    if negative.is_none()
        && ddo_nn::read_mask_tensor(path, "negative_prompt_embeds_mask")
            .map_err(|e| CliError::from(e).context("--prompt-embeds"))?
            .is_some()
    {
        return Err(CliError::usage(
            format!(
                "--prompt-embeds {}: `negative_prompt_embeds_mask` without `negative_prompt_embeds`",
                path.display()
            ),
            "save negative_prompt_embeds beside its mask (true CFG), or leave the mask out",
        ));
    }
    if let Some(n) = &negative {
        let (pb, nb) = (
            positive.prompt_embeds.shape()[0],
            n.prompt_embeds.shape()[0],
        );
        if pb != nb {
            return Err(CliError::usage(
                format!(
                    "--prompt-embeds {}: {pb} prompt(s) but {nb} negative prompt(s)",
                    path.display()
                ),
                "give one negative_prompt_embeds row per prompt_embeds row",
            ));
        }
    }
    Ok(QwenEmbedsFile { positive, negative })
}

/// The prompt and negative prompt of a Qwen-Image run, and how the profile names them.
pub(crate) struct QwenPrompts {
    /// The prompt.
    pub prompt: QwenPromptInput,
    /// The negative prompt, if any (true CFG needs one).
    pub negative: Option<QwenPromptInput>,
    /// The profile's words for the prompt.
    pub label: String,
}

/// The prompts of a run: the embeddings file's, or text through the folder's tokenizer (or
/// the stand-in, for random weights).
pub(super) fn prompts(
    pipe: &QwenImagePipeline,
    embeds: Option<QwenEmbedsFile>,
    prompt: Option<&str>,
    negative_prompt: Option<&str>,
    default_prompt: &str,
) -> CliResult<QwenPrompts> {
    if let Some(e) = embeds {
        if prompt.is_some() || negative_prompt.is_some() {
            return Err(CliError::usage(
                "--prompt-embeds with --prompt or --negative-prompt",
                "give both prompts as text (--prompt, --negative-prompt), or both as embeddings in the --prompt-embeds file (prompt_embeds, and negative_prompt_embeds for true CFG)",
            ));
        }
        // Each set checked under its own name against the transformer's text width.
        for (prefix, set) in [("", Some(&e.positive)), ("negative_", e.negative.as_ref())] {
            if let Some(set) = set {
                pipe.check_embeds(set).map_err(|err| {
                    CliError::usage(
                        format!(
                            "--prompt-embeds: `{prefix}prompt_embeds` {:?} does not fit this pipeline",
                            set.prompt_embeds.shape()
                        ),
                        err.to_string(),
                    )
                })?;
            }
        }
        let label = format!(
            "embeddings from --prompt-embeds{}",
            if e.negative.is_some() {
                " (with negative_prompt_embeds)"
            } else {
                ""
            }
        );
        return Ok(QwenPrompts {
            prompt: QwenPromptInput::Embeddings(e.positive),
            negative: e.negative.map(QwenPromptInput::Embeddings),
            label,
        });
    }
    if pipe.text_encoder.is_none() {
        return Err(CliError::usage(
            "this pipeline folder has no text_encoder/",
            "pass --prompt-embeds FILE.safetensors (prompt_embeds, prompt_embeds_mask; negative_prompt_embeds for true CFG)",
        ));
    }
    let text = prompt.unwrap_or(default_prompt).to_string();
    let tokenizer = if pipe.tokenizer.is_some() {
        "tokenizer files: tokenizer/"
    } else {
        "stand-in tokenizer: random weights have no tokenizer files"
    };
    let label = match negative_prompt {
        Some(n) => format!("{text:?}, negative {n:?} ({tokenizer})"),
        None => format!("{text:?} ({tokenizer})"),
    };
    Ok(QwenPrompts {
        prompt: QwenPromptInput::Text(text),
        negative: negative_prompt.map(|n| QwenPromptInput::Text(n.to_string())),
        label,
    })
}

/// The dtype of random weights at config `name`: f32 for the tiny config, bf16 otherwise.
pub(super) fn default_dtype(name: &str) -> DType {
    if name == "qwen-tiny" {
        DType::F32
    } else {
        DType::BF16
    }
}

/// Whether a run does true CFG, by Diffusers' rule (`true_cfg_scale > 1` and a negative
/// prompt), and the profile's words for it.
pub(super) fn true_cfg(scale: f32, negative: bool) -> (bool, String) {
    match (scale > 1.0, negative) {
        (true, true) => (
            true,
            format!("true CFG scale {scale} (two transformer passes per step)"),
        ),
        (true, false) => (
            false,
            format!(
                "true CFG off: scale {scale} but no negative prompt (Diffusers' rule; give --negative-prompt \" \")"
            ),
        ),
        (false, _) => (
            false,
            format!("true CFG off: scale {scale} (one transformer pass per step)"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn true_cfg_follows_diffusers_rule() {
        assert!(true_cfg(4.0, true).0);
        assert!(!true_cfg(4.0, false).0);
        assert!(!true_cfg(1.0, true).0);
        assert!(true_cfg(4.0, false).1.contains("--negative-prompt"));
    }
}
