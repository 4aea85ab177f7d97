//! Where `ddo run`'s models come from: a named config with random weights, a Diffusers
//! folder, and single files that replace one component.

use std::path::{Path, PathBuf};

use ddo_core::DType;
use ddo_metrics::format_bytes;
use ddo_nn::pipeline::{
    FluxPipeline, FluxPipelineConfig, QwenImagePipeline, QwenImagePipelineConfig,
};

use super::{MAX_SEQUENCE_LENGTH, Source};
use crate::error::{CliError, CliResult};
use crate::family::{AnyPipeline, Family};
use crate::progress::ProgressBar;

/// Refuses random weights of `params` parameters in `dtype` that would not fit in the host's
/// available memory (building them would get the process killed instead of failing cleanly).
fn check_random_fits(params: u64, dtype: DType, tiny: &str) -> CliResult<()> {
    // fp8 storage builds each transformer weight in bf16 before storing it as fp8, and
    // keeps the modulations and the other components in bf16: counted at bf16, an upper
    // bound.
    let needed = params * dtype.compute().size_in_bytes() as u64;
    let available = ddo_core::host_memory::mem_available();
    match available {
        Some(free) if needed > free => Err(CliError::runtime(
            format!(
                "the random {dtype} weights of this config need up to {} of host memory while they are made{}; {} is available",
                format_bytes(needed),
                if dtype.is_fp8() {
                    " (each fp8 weight is made in bf16, then stored)"
                } else {
                    ""
                },
                format_bytes(free)
            ),
            format!("run it on a machine with more memory, or use --config {tiny}"),
        )),
        _ => Ok(()),
    }
}

/// [`check_random_fits`] for a Flux config; components given as files are mapped, not made.
fn check_host_memory(
    config: &FluxPipelineConfig,
    dtype: DType,
    files: &ComponentFiles,
) -> CliResult<()> {
    let random = |file: &Option<PathBuf>, count: u64| if file.is_some() { 0 } else { count };
    let params = random(&files.text_encoder, config.text_encoder.param_count())
        + random(&files.text_encoder_2, config.text_encoder_2.param_count())
        + random(&files.transformer, config.transformer.param_count());
    check_random_fits(params, dtype, "tiny")
}

/// The components given as single files (`--transformer FILE`, `--text-encoder-2 FILE`),
/// which take the place of the folder's or the config's.
#[derive(Debug, Clone, Default)]
pub(crate) struct ComponentFiles {
    /// A CLIP text encoder in the Transformers layout.
    pub text_encoder: Option<PathBuf>,
    /// A transformer in the original Flux layout.
    pub transformer: Option<PathBuf>,
    /// A T5 encoder in the Transformers layout.
    pub text_encoder_2: Option<PathBuf>,
    /// A VAE in the original (LDM) layout.
    pub vae: Option<PathBuf>,
}

impl ComponentFiles {
    /// The files given to `--text-encoder`, `--transformer`, `--text-encoder-2` and `--vae`,
    /// each checked to be a file.
    pub(crate) fn checked(self) -> CliResult<Self> {
        let file = |option: &str, f: Option<PathBuf>, what: &str| -> CliResult<Option<PathBuf>> {
            match f {
                Some(path) => match crate::io::not_a_readable_file(&path) {
                    Some(why) => Err(CliError::usage(
                        format!("--{option} {}: {why}", path.display()),
                        format!(
                            "give one .safetensors file ({what}); a Diffusers folder goes in --weights"
                        ),
                    )),
                    None => Ok(Some(path)),
                },
                None => Ok(None),
            }
        };
        Ok(Self {
            text_encoder: file(
                "text-encoder",
                self.text_encoder,
                "a CLIP text encoder in the Transformers layout, e.g. clip_l.safetensors",
            )?,
            transformer: file(
                "transformer",
                self.transformer,
                "the original Flux layout, e.g. flux1-dev.safetensors or a ComfyUI fp8 file",
            )?,
            text_encoder_2: file(
                "text-encoder-2",
                self.text_encoder_2,
                "a T5 encoder in the Transformers layout, e.g. t5xxl_fp8_e4m3fn.safetensors",
            )?,
            vae: file(
                "vae",
                self.vae,
                "a VAE in the original LDM layout, e.g. Black Forest Labs' ae.safetensors",
            )?,
        })
    }
}

/// The component given as file `path` to `--option`, loaded by `load`; its errors name
/// the option and the file.
fn from_file<T>(
    option: &str,
    path: &Path,
    bar: &mut ProgressBar,
    load: impl FnOnce(&Path) -> ddo_nn::LoadResult<T>,
) -> CliResult<T> {
    bar.status(&format!("opening {}...", path.display()));
    load(path).map_err(|e| CliError::from(e).context(&format!("--{option} {}", path.display())))
}

/// The components of `files`, each with its config: `folder`'s `<component>/config.json`
/// when there is one, else `configs`' (the named config, or FLUX.1's for a folder without
/// one; the shapes are checked on load). A transformer file in a folder without a config
/// reads its config from its shapes. `dtype` converts as `--dtype` asks; an 8-bit float
/// stores the transformer's and T5's layers as fp8, CLIP and the VAE in bf16.
fn load_files(
    files: &ComponentFiles,
    configs: &FluxPipelineConfig,
    folder: Option<&Path>,
    dtype: Option<DType>,
    unused: ddo_nn::UnusedWeights,
    bar: &mut ProgressBar,
) -> CliResult<ddo_nn::pipeline::Loaded> {
    use ddo_nn::{clip, flux, t5, vae};
    // `Some(config)` from the folder's config.json, `None` without a folder or a file.
    fn in_folder<T>(
        folder: Option<&Path>,
        component: &str,
        read: fn(&Path) -> ddo_nn::LoadResult<T>,
    ) -> CliResult<Option<T>> {
        let Some(dir) = folder else { return Ok(None) };
        let file = dir.join(component).join("config.json");
        if !file.is_file() {
            return Ok(None);
        }
        read(&file)
            .map(Some)
            .map_err(|e| CliError::from(e).context(&format!("--weights {}", dir.display())))
    }
    let text_encoder = match files.text_encoder.as_deref() {
        Some(f) => {
            let c = in_folder(folder, "text_encoder", clip::ClipTextConfig::from_file)?
                .unwrap_or_else(|| configs.text_encoder.clone());
            Some(from_file("text-encoder", f, bar, |p| {
                clip::ClipTextModel::load_file(p, &c, dtype, unused)
            })?)
        }
        None => None,
    };
    let transformer = match files.transformer.as_deref() {
        Some(f) => {
            let c = match folder {
                Some(_) => in_folder(
                    folder,
                    "transformer",
                    flux::FluxTransformerConfig::from_file,
                )?,
                None => Some(configs.transformer.clone()),
            };
            Some(from_file("transformer", f, bar, |p| {
                flux::FluxTransformer::load_original(p, c, dtype, unused)
            })?)
        }
        None => None,
    };
    let text_encoder_2 = match files.text_encoder_2.as_deref() {
        Some(f) => {
            let c = in_folder(folder, "text_encoder_2", t5::T5Config::from_file)?
                .unwrap_or_else(|| configs.text_encoder_2.clone());
            Some(from_file("text-encoder-2", f, bar, |p| {
                t5::T5Encoder::load_file(p, &c, dtype, unused)
            })?)
        }
        None => None,
    };
    let vae = match files.vae.as_deref() {
        Some(f) => {
            let c = in_folder(folder, "vae", vae::AutoencoderKLConfig::from_file)?
                .unwrap_or_else(|| configs.vae.clone());
            // fp8 is not a VAE's storage.
            Some(from_file("vae", f, bar, |p| {
                vae::AutoencoderKL::load_original(p, c, dtype.map(DType::compute), unused)
            })?)
        }
        None => None,
    };
    Ok(ddo_nn::pipeline::Loaded {
        text_encoder,
        transformer,
        text_encoder_2,
        vae,
    })
}

/// Loads or builds the pipeline of `source`'s family; the components of `files` replace
/// the folder's or the config's (Flux only). With `only`, a named config's random weights
/// get values in that component alone (a bench of one component): the others have their
/// shapes and no memory behind them.
pub(crate) fn build_pipeline(
    source: &Source,
    files: &ComponentFiles,
    dtype: Option<DType>,
    max_seq: Option<usize>,
    unused: ddo_nn::UnusedWeights,
    only: Option<&str>,
    bar: &mut ProgressBar,
) -> CliResult<(AnyPipeline, String)> {
    match source.family()? {
        Family::Flux => {
            if let Some(n) = max_seq.filter(|&n| n > MAX_SEQUENCE_LENGTH) {
                return Err(CliError::usage(
                    format!(
                        "--max-sequence-length {n}: cannot be greater than {MAX_SEQUENCE_LENGTH} for a FluxPipeline"
                    ),
                    format!("give at most {MAX_SEQUENCE_LENGTH} (FluxPipeline's limit for T5)"),
                ));
            }
            build_flux(source, files, dtype, max_seq, unused, only, bar)
                .map(|(p, label)| (AnyPipeline::Flux(Box::new(p)), label))
        }
        Family::QwenImage => build_qwen(source, files, dtype, max_seq, unused, only, bar)
            .map(|(p, label)| (AnyPipeline::QwenImage(Box::new(p)), label)),
    }
}

/// Loads or builds a Qwen-Image pipeline: random weights at a named config, or a
/// QwenImagePipeline folder, with its transformer or text encoder from a single file.
fn build_qwen(
    source: &Source,
    files: &ComponentFiles,
    dtype: Option<DType>,
    max_seq: Option<usize>,
    unused: ddo_nn::UnusedWeights,
    only: Option<&str>,
    bar: &mut ProgressBar,
) -> CliResult<(QwenImagePipeline, String)> {
    for (option, f) in [
        ("--text-encoder-2", &files.text_encoder_2),
        ("--vae", &files.vae),
    ] {
        if f.is_some() {
            return Err(CliError::usage(
                format!("{option} FILE with a QwenImagePipeline"),
                super::qwen::SINGLE_FILES_HINT,
            ));
        }
    }
    let (mut pipe, label) = match source {
        Source::Config(name) => {
            for (option, f, config) in [
                ("--transformer", &files.transformer, "transformer"),
                ("--text-encoder", &files.text_encoder, "text_encoder"),
            ] {
                if f.is_some() {
                    return Err(CliError::usage(
                        format!("{option} FILE with a named Qwen-Image config (random weights)"),
                        format!(
                            "give --weights QWEN_FOLDER (its {config}/config.json gives the shapes) with {option} FILE"
                        ),
                    ));
                }
            }
            let config =
                QwenImagePipelineConfig::named(name).ok_or_else(|| super::unknown_config(name))?;
            let dtype = dtype.unwrap_or(super::qwen::default_dtype(name));
            check_random_fits(
                config.text_encoder.param_count() + config.transformer.param_count(),
                dtype,
                "qwen-tiny",
            )?;
            bar.status(&format!("building {name} with random {dtype} weights..."));
            let pipe = QwenImagePipeline::random_parts(&config, 0, dtype, |c| {
                only.is_none_or(|o| o == c)
            })?;
            bar.finish();
            (pipe, format!("{name} (random weights, {dtype})"))
        }
        Source::Weights(dir) => {
            bar.status(&format!("opening {}...", dir.display()));
            let pipe = QwenImagePipeline::load_with_files(
                dir,
                files.transformer.as_deref(),
                files.text_encoder.as_deref(),
                dtype,
                unused,
            )
            .map_err(|e| {
                let mut what = format!("--weights {}", dir.display());
                for (option, f) in [
                    ("--transformer", &files.transformer),
                    ("--text-encoder", &files.text_encoder),
                ] {
                    if let Some(f) = f {
                        what.push_str(&format!(" {option} {}", f.display()));
                    }
                }
                CliError::from(e).context(&what)
            })?;
            bar.finish();
            let mut label = format!(
                "{} (QwenImagePipeline, {})",
                dir.display(),
                dtype.map_or("dtype as stored".to_string(), |d| d.to_string())
            );
            if let Some(f) = &files.transformer {
                label.push_str(&format!(", transformer from {}", f.display()));
            }
            if let Some(f) = &files.text_encoder {
                label.push_str(&format!(", text encoder from {}", f.display()));
            }
            (pipe, label)
        }
    };
    if let Some(n) = max_seq {
        pipe.max_sequence_length = n;
    }
    Ok((pipe, label))
}

/// Loads or builds a Flux pipeline; the components of `files` replace the folder's or the
/// config's.
fn build_flux(
    source: &Source,
    files: &ComponentFiles,
    dtype: Option<DType>,
    max_seq: Option<usize>,
    unused: ddo_nn::UnusedWeights,
    only: Option<&str>,
    bar: &mut ProgressBar,
) -> CliResult<(FluxPipeline, String)> {
    match source {
        Source::Config(name) => {
            let Some(mut config) = FluxPipelineConfig::named(name) else {
                return Err(super::unknown_config(name));
            };
            if let Some(n) = max_seq {
                config.max_sequence_length = n;
            }
            let asked = dtype;
            let dtype = dtype.unwrap_or(if name == "tiny" {
                DType::F32
            } else {
                DType::BF16
            });
            check_host_memory(&config, dtype, files)?;
            // The files as stored unless --dtype asks for a conversion.
            let loaded = load_files(files, &config, None, asked, unused, bar)?;
            bar.status(&format!("building {name} with random {dtype} weights..."));
            let pipe = FluxPipeline::random_parts(&config, 0, dtype, loaded, |c| {
                only.is_none_or(|o| o == c)
            })?;
            bar.finish();
            let mut label = format!("{name} (random weights, {dtype}");
            for (what, f) in [
                ("text_encoder", &files.text_encoder),
                ("transformer", &files.transformer),
                ("text_encoder_2", &files.text_encoder_2),
                ("vae", &files.vae),
            ] {
                if let Some(f) = f {
                    label += &format!("; {what} {}", f.display());
                }
            }
            label += ")";
            Ok((pipe, label))
        }
        Source::Weights(dir) => {
            let loaded = load_files(
                files,
                &FluxPipelineConfig::flux_dev(),
                Some(dir),
                dtype,
                unused,
                bar,
            )?;
            bar.status(&format!("opening {}...", dir.display()));
            let mut pipe = FluxPipeline::load_with(dir, dtype, unused, loaded)
                .map_err(|e| CliError::from(e).context(&format!("--weights {}", dir.display())))?;
            bar.finish();
            if let Some(n) = max_seq {
                pipe.max_sequence_length = n;
            }
            Ok((
                pipe,
                format!(
                    "{} ({})",
                    dir.display(),
                    dtype.map_or("dtype as stored".to_string(), |d| d.to_string())
                ),
            ))
        }
    }
}
