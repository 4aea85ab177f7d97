//! One `#[derive(Args)]` struct per subcommand: its options in `ddo help COMMAND`'s order,
//! each doc comment the option's line of help, each `value_name` its placeholder. `Vec`
//! fields repeat; every other option may be given once ([`super::command`] makes a
//! repeated flag harmless and lets every value start with `-`). Values that parse into DDO
//! types go through [`Checked`] and DDO's own parsers, so their errors keep DDO's messages.

// The doc comments below are the options' --help text, printed as written: shapes such as
// `[N,C,h,w]` and names such as `DDO_<COMPONENT>_ROUTE` are not rustdoc links or HTML.
#![allow(rustdoc::broken_intra_doc_links, rustdoc::invalid_html_tags)]

use std::path::{Path, PathBuf};

use clap::Args;
use ddo_core::{DType, Preset};
use ddo_nn::pipeline::TiledDecode;

use super::values::{self, Checked};
use crate::setup::DeviceChoice;

const RUN_NOTES: &str =
    "Prompts are tokenized with the pipeline folder's tokenizer files (tokenizer/: tokenizer.json
or vocab.json + merges.txt; tokenizer_2/: tokenizer.json). With --config, or a folder without
them, DDO's documented stand-in tokenizer is used (ddo_nn::tokenizer), whose ids differ from the
real tokenizers'. To reproduce another implementation exactly, pass --prompt-embeds and
--init-latents.";

const BENCH_NOTES: &str = "Without --route or --preset every route is a candidate. Each candidate gets a fresh attachment,
its inputs made once and held on the device, warm-up forwards, then timed forwards.";

/// `--lora-allow-unmatched`'s help, one text for `run`, `resolve` and `bench` (`serve` keeps
/// LoRA files of its folder and says so in its own words).
pub const LORA_ALLOW_UNMATCHED: &str = "apply a LoRA's modules that match the model and name \
     the rest, instead of refusing a file that partly matches";

/// The options that load a pipeline, shared by `ddo run` and `ddo serve`: the model, the
/// single files, the routes, the device and the budgets, the dtype.
#[derive(Debug, Clone, Default, Args)]
pub struct LoadArgs {
    /// random weights at a named config
    #[arg(long, value_name = "tiny|flux-dev|qwen-tiny|qwen-image")]
    pub config: Option<String>,
    /// a Diffusers pipeline folder (FluxPipeline or QwenImagePipeline, by its model_index.json)
    #[arg(long, value_name = "DIR", value_parser = Checked(values::path))]
    pub weights: Option<PathBuf>,
    /// a single-file transformer in the original Flux layout (flux1-dev.safetensors, ComfyUI's
    /// fp8 files) in place of the folder's or the config's
    #[arg(long, value_name = "FILE", value_parser = Checked(values::path))]
    pub transformer: Option<PathBuf>,
    /// a single-file CLIP text encoder in the Transformers layout (clip_l.safetensors) in place
    /// of the folder's or the config's
    #[arg(long, value_name = "FILE", value_parser = Checked(values::path))]
    pub text_encoder: Option<PathBuf>,
    /// a single-file T5 encoder in the Transformers layout (t5xxl_fp8_e4m3fn.safetensors) in
    /// place of the folder's or the config's
    #[arg(long, value_name = "FILE", value_parser = Checked(values::path))]
    pub text_encoder_2: Option<PathBuf>,
    /// a single-file VAE in the original LDM layout (ae.safetensors) in place of the folder's
    /// or the config's
    #[arg(long, value_name = "FILE", value_parser = Checked(values::path))]
    pub vae: Option<PathBuf>,
    /// auto, one_shot_fast, low_ram_safe, vmm_fast, warm_process, wsl_compat, nvme_baseline, off
    #[arg(long, value_name = "NAME", value_parser = Checked(values::preset))]
    pub preset: Option<Preset>,
    /// an explicit route for one component (repeatable; wins over the preset)
    #[arg(long, value_name = "COMPONENT=ROUTE[:k=v,...]")]
    pub route: Vec<String>,
    /// device memory DDO may use, e.g. 12GiB (cpu: the host device's capacity, default 8GiB)
    #[arg(long, value_name = "SIZE", value_parser = Checked(values::vram_budget))]
    pub vram_budget: Option<u64>,
    /// host memory DDO may make this machine hold: pinned memory plus its working memory, e.g. 24GiB (default: MemAvailable less an eighth, at least 4 GiB)
    #[arg(long, value_name = "SIZE", value_parser = Checked(values::host_budget))]
    pub host_budget: Option<u64>,
    /// execution device (default cpu)
    #[arg(long, value_name = "cpu|cuda:N", value_parser = Checked(values::device))]
    pub device: Option<DeviceChoice>,
    /// weight dtype (default f32 for tiny, bf16 for flux-dev, the files' for --weights); fp8
    /// (fp8_e4m3, or fp8_e5m2) stores the transformer's linear weights as fp8 with a
    /// per-tensor scale, computes in bf16, and loads the rest as bf16
    #[arg(long, value_name = "f32|bf16|f16|fp8", value_parser = Checked(values::dtype))]
    pub dtype: Option<DType>,
    /// what the linears compute in: bf16 (default), or fp8 (weights stored as E4M3, converted
    /// at load if need be; each activation scaled per tensor into E4M3 at run time)
    #[arg(long, value_name = "bf16|fp8", value_parser = Checked(values::compute))]
    pub compute: Option<values::Compute>,
    /// text tokens for a text prompt (Flux's T5: default 32 for tiny, 512 at most; Qwen-Image:
    /// default 512, 1024 at most)
    #[arg(long, value_name = "N", value_parser = Checked(values::max_sequence_length))]
    pub max_sequence_length: Option<usize>,
    /// do not read DDO_PRESET / DDO_<COMPONENT>_ROUTE
    #[arg(long)]
    pub no_env: bool,
    /// load a checkpoint whose config leaves some of its tensors unused (refused otherwise)
    #[arg(long)]
    pub allow_unused_weights: bool,
}

impl LoadArgs {
    /// Every path loading reads, by option.
    pub fn paths_read(&self) -> Vec<(&'static str, &Path)> {
        given(&[
            ("--weights", &self.weights),
            ("--transformer", &self.transformer),
            ("--text-encoder", &self.text_encoder),
            ("--text-encoder-2", &self.text_encoder_2),
            ("--vae", &self.vae),
        ])
    }
}

/// `ddo run`'s options.
#[derive(Debug, Clone, Default, Args)]
#[command(
    override_usage = "ddo run (--config tiny|flux-dev|qwen-tiny|qwen-image | --weights DIR) [options]",
    after_help = RUN_NOTES
)]
pub struct RunArgs {
    /// the model, its routes, the device and the budgets
    #[command(flatten)]
    pub load: LoadArgs,
    /// denoising steps (default 4 for tiny and qwen-tiny, 28 for Flux, 50 for Qwen-Image)
    #[arg(long, value_name = "N", value_parser = Checked(values::positive))]
    pub steps: Option<usize>,
    /// image height (default 128 for tiny, 1024 otherwise)
    #[arg(long, value_name = "PX", value_parser = Checked(values::positive))]
    pub height: Option<usize>,
    /// image width (default 128 for tiny, 1024 otherwise)
    #[arg(long, value_name = "PX", value_parser = Checked(values::positive))]
    pub width: Option<usize>,
    /// seed of the initial noise (default 0)
    #[arg(long, value_name = "N", value_parser = Checked(values::seed))]
    pub seed: Option<u64>,
    /// images per prompt (Diffusers' num_images_per_prompt, default 1): --out a.png writes
    /// a-0.png, a-1.png, ...
    #[arg(long, value_name = "N", value_parser = Checked(values::positive))]
    pub num_images: Option<usize>,
    /// guidance scale (default 3.5; Flux)
    #[arg(long, value_name = "SCALE", value_parser = Checked(values::guidance))]
    pub guidance: Option<f32>,
    /// the prompt (stand-in tokenizer; see `ddo help run`)
    #[arg(long, value_name = "TEXT")]
    pub prompt: Option<String>,
    /// the negative prompt of true CFG (Qwen-Image; e.g. " "; without it true CFG is off)
    #[arg(long, value_name = "TEXT")]
    pub negative_prompt: Option<String>,
    /// true CFG scale (Qwen-Image; default 4.0; true CFG runs when > 1 with a negative prompt)
    #[arg(long, value_name = "SCALE", value_parser = Checked(values::true_cfg_scale))]
    pub true_cfg_scale: Option<f32>,
    /// tiled VAE decode (default auto: tiled when the estimate does not fit)
    #[arg(long, value_name = "on|off|auto", value_parser = Checked(values::tiled_decode))]
    pub tiled_decode: Option<TiledDecode>,
    /// initial noise (`latents` or `noise`: [N,C,h,w] or packed [N,T,4C], one row per image)
    #[arg(long, value_name = "FILE.safetensors", value_parser = Checked(values::path))]
    pub init_latents: Option<PathBuf>,
    /// prompt embeddings (`prompt_embeds` [B,L,D], `pooled_prompt_embeds` [B,P]; B prompts)
    #[arg(long, value_name = "FILE.safetensors", value_parser = Checked(values::path))]
    pub prompt_embeds: Option<PathBuf>,
    /// a LoRA applied at run time (Diffusers/PEFT, kohya, ComfyUI, original or XLabs
    /// layout), its scale times STRENGTH (default 1); repeatable
    #[arg(long, value_name = "FILE[:STRENGTH]", value_parser = Checked(values::lora))]
    pub lora: Vec<values::LoraArg>,
    /// `--lora-allow-unmatched` (`LORA_ALLOW_UNMATCHED`)
    #[arg(long, help = LORA_ALLOW_UNMATCHED)]
    pub lora_allow_unmatched: bool,
    /// fold the LoRAs into the weights of components that run resident (route `none`), at
    /// attach: no cost per step; streamed components add them as usual
    #[arg(long)]
    pub lora_fuse: bool,
    /// where the image goes (default ddo-out.png)
    #[arg(long, value_name = "OUT.png|OUT.safetensors", value_parser = Checked(values::path))]
    pub out: Option<PathBuf>,
    /// also write the decoder's input latents (`latents`, NCHW), for `ddo decode`
    #[arg(long, value_name = "FILE.safetensors", value_parser = Checked(values::path))]
    pub save_latents: Option<PathBuf>,
    /// after each phase, return the native VMM pool's idle memory to the driver (native
    /// allocator only)
    #[arg(long)]
    pub release_native_idle: bool,
    /// record each streamed route's first and last forward (`timeline=true` on every route
    /// the streaming engine drives, planned or given): when each unit's copy ran, when
    /// compute used it and when the host reached it, in `--json`'s route metrics
    #[arg(long)]
    pub timeline: bool,
    /// print the profile as JSON
    #[arg(long)]
    pub json: bool,
}

/// `ddo serve`'s options: `ddo run`'s loading options ([`LoadArgs`]), where to listen, the
/// token, the queue and the LoRA folder.
#[derive(Debug, Clone, Default, Args)]
#[command(
    override_usage = "ddo serve (--config tiny|flux-dev|qwen-tiny|qwen-image | --weights DIR) [--listen 127.0.0.1:8910] [--token SECRET] [options]"
)]
pub struct ServeArgs {
    /// the model, its routes, the device and the budgets
    #[command(flatten)]
    pub load: LoadArgs,
    /// the address to listen on; any but a loopback address needs --token
    #[arg(long, value_name = "ADDR:PORT", value_parser = Checked(values::listen))]
    pub listen: Option<std::net::SocketAddr>,
    /// a bearer token every API request must carry (Authorization: Bearer TOKEN)
    #[arg(long, value_name = "SECRET")]
    pub token: Option<String>,
    /// requests that may wait behind the running one (default 16); past it, 429
    #[arg(long, value_name = "N", value_parser = Checked(values::positive))]
    pub queue: Option<usize>,
    /// the folder whose .safetensors LoRAs requests name (by file name, without the folder)
    #[arg(long, value_name = "DIR", value_parser = Checked(values::path))]
    pub lora_dir: Option<PathBuf>,
    /// keep LoRA files that only partly match the pipeline (the modules left out are named)
    #[arg(long)]
    pub lora_allow_unmatched: bool,
    /// say where it listens as one JSON line (address, model, device)
    #[arg(long)]
    pub json: bool,
}

impl ServeArgs {
    /// Every path `ddo serve` reads (it writes none).
    pub fn paths_read(&self) -> Vec<(&'static str, &Path)> {
        let mut paths = self.load.paths_read();
        paths.extend(given(&[("--lora-dir", &self.lora_dir)]));
        paths
    }
}

/// `ddo convert`'s options.
#[derive(Debug, Clone, Args)]
#[command(override_usage = "ddo convert --compress lossless IN OUT [--json]")]
pub struct ConvertArgs {
    /// how to store the matrices: lossless (bf16/f16 2-D weights entropy-coded; `--weights OUT` decodes them bit for bit)
    #[arg(long, value_name = "lossless", required = true, value_parser = Checked(values::compress))]
    pub compress: ddo_core::Compression,
    /// a pipeline folder or a .safetensors file, only read
    #[arg(value_name = "IN", value_parser = Checked(values::path))]
    pub input: PathBuf,
    /// a new path beside IN (never replaced: it must not exist)
    #[arg(value_name = "OUT", value_parser = Checked(values::path))]
    pub output: PathBuf,
    /// print the figures as JSON
    #[arg(long)]
    pub json: bool,
}

impl ConvertArgs {
    /// Every path `ddo convert` reads (see [`RunArgs::paths_read`]).
    pub fn paths_read(&self) -> Vec<(&'static str, &Path)> {
        vec![("IN", self.input.as_path())]
    }
}

/// `ddo decode`'s options.
#[derive(Debug, Clone, Default, Args)]
#[command(
    override_usage = "ddo decode --weights VAE_DIR --latents FILE.safetensors --out OUT.png|OUT.safetensors"
)]
pub struct DecodeArgs {
    /// the VAE folder (config.json + safetensors), or a pipeline folder with vae/
    #[arg(long, value_name = "VAE_DIR", value_parser = Checked(values::path))]
    pub weights: Option<PathBuf>,
    /// tensor `latents` [B, C, h, w] (B images), unscaled as AutoencoderKL.decode takes it
    #[arg(long, value_name = "FILE.safetensors", value_parser = Checked(values::path))]
    pub latents: Option<PathBuf>,
    /// the image (B > 1: OUT-0.png, OUT-1.png, ...), or the decoded tensor `sample` (f32 NCHW)
    #[arg(long, value_name = "OUT.png|OUT.safetensors", value_parser = Checked(values::path))]
    pub out: Option<PathBuf>,
    /// preset (the VAE column of the seed's table)
    #[arg(long, value_name = "NAME", value_parser = Checked(values::preset))]
    pub preset: Option<Preset>,
    /// an explicit route for the VAE
    #[arg(long, value_name = "vae=ROUTE[:k=v,...]")]
    pub route: Vec<String>,
    /// device memory DDO may use
    #[arg(long, value_name = "SIZE", value_parser = Checked(values::vram_budget))]
    pub vram_budget: Option<u64>,
    /// execution device (default cpu)
    #[arg(long, value_name = "cpu|cuda:N", value_parser = Checked(values::device))]
    pub device: Option<DeviceChoice>,
    /// tiled decode (default auto)
    #[arg(long, value_name = "on|off|auto", value_parser = Checked(values::tiled_decode))]
    pub tiled_decode: Option<TiledDecode>,
    /// convert the weights on load (default: as stored)
    #[arg(long, value_name = "f32|bf16|f16", value_parser = Checked(values::dtype))]
    pub dtype: Option<DType>,
    /// print the profile as JSON
    #[arg(long)]
    pub json: bool,
    /// do not read DDO_PRESET / DDO_VAE_ROUTE
    #[arg(long)]
    pub no_env: bool,
    /// load a checkpoint whose config leaves some of its tensors unused (refused otherwise)
    #[arg(long)]
    pub allow_unused_weights: bool,
}

/// `ddo resolve`'s options.
#[derive(Debug, Clone, Default, Args)]
#[command(
    override_usage = "ddo resolve [--preset NAME] [--route COMPONENT=ROUTE]... [--component NAME] [--json]"
)]
pub struct ResolveArgs {
    /// the preset to explain (default auto, or DDO_PRESET)
    #[arg(long, value_name = "NAME", value_parser = Checked(values::preset))]
    pub preset: Option<Preset>,
    /// an explicit route (repeatable)
    #[arg(long, value_name = "COMPONENT=ROUTE[:k=v,...]")]
    pub route: Vec<String>,
    /// explain one component only
    #[arg(long, value_name = "NAME")]
    pub component: Option<String>,
    /// plan memory for random weights at a named config
    #[arg(long, value_name = "tiny|flux-dev|qwen-tiny|qwen-image")]
    pub config: Option<String>,
    /// plan memory for a Diffusers pipeline folder
    #[arg(long, value_name = "DIR", value_parser = Checked(values::path))]
    pub weights: Option<PathBuf>,
    /// a single-file transformer in the original Flux layout, in place of the folder's or the
    /// config's (as for run)
    #[arg(long, value_name = "FILE", value_parser = Checked(values::path))]
    pub transformer: Option<PathBuf>,
    /// a single-file CLIP text encoder in the Transformers layout, in place of the folder's or
    /// the config's (as for run)
    #[arg(long, value_name = "FILE", value_parser = Checked(values::path))]
    pub text_encoder: Option<PathBuf>,
    /// a single-file T5 encoder in the Transformers layout, in place of the folder's or the
    /// config's (as for run)
    #[arg(long, value_name = "FILE", value_parser = Checked(values::path))]
    pub text_encoder_2: Option<PathBuf>,
    /// a single-file VAE in the original LDM layout, in place of the folder's or the config's
    /// (as for run)
    #[arg(long, value_name = "FILE", value_parser = Checked(values::path))]
    pub vae: Option<PathBuf>,
    /// a LoRA the plan makes room for (checked against the pipeline's layers as `ddo run`
    /// checks it); repeatable
    #[arg(long, value_name = "FILE[:STRENGTH]", value_parser = Checked(values::lora))]
    pub lora: Vec<values::LoraArg>,
    /// `--lora-allow-unmatched` (`LORA_ALLOW_UNMATCHED`)
    #[arg(long, help = LORA_ALLOW_UNMATCHED)]
    pub lora_allow_unmatched: bool,
    /// the budget to plan for (with --config/--weights; default: what the device gives)
    #[arg(long, value_name = "SIZE", value_parser = Checked(values::vram_budget))]
    pub vram_budget: Option<u64>,
    /// host memory DDO may make this machine hold: pinned memory plus its working memory, e.g. 24GiB (default: MemAvailable less an eighth, at least 4 GiB)
    #[arg(long, value_name = "SIZE", value_parser = Checked(values::host_budget))]
    pub host_budget: Option<u64>,
    /// the device to plan for (default cpu)
    #[arg(long, value_name = "cpu|cuda:N", value_parser = Checked(values::device))]
    pub device: Option<DeviceChoice>,
    /// image height to plan for (default 128 for tiny, 1024 otherwise)
    #[arg(long, value_name = "PX", value_parser = Checked(values::positive))]
    pub height: Option<usize>,
    /// image width to plan for (default 128 for tiny, 1024 otherwise)
    #[arg(long, value_name = "PX", value_parser = Checked(values::positive))]
    pub width: Option<usize>,
    /// T5 tokens to plan for (default 32 for tiny, 512 otherwise)
    #[arg(long, value_name = "N", value_parser = Checked(values::max_sequence_length))]
    pub max_sequence_length: Option<usize>,
    /// images to plan for (as `ddo run --num-images`, default 1)
    #[arg(long, value_name = "N", value_parser = Checked(values::positive))]
    pub num_images: Option<usize>,
    /// the decode to plan for (as `ddo run`, default auto)
    #[arg(long, value_name = "on|off|auto", value_parser = Checked(values::tiled_decode))]
    pub tiled_decode: Option<TiledDecode>,
    /// weight dtype (as `ddo run`)
    #[arg(long, value_name = "f32|bf16|f16|fp8", value_parser = Checked(values::dtype))]
    pub dtype: Option<DType>,
    /// what the linears compute in: bf16 (default), or fp8 (weights stored as E4M3, converted
    /// at load if need be; each activation scaled per tensor into E4M3 at run time)
    #[arg(long, value_name = "bf16|fp8", value_parser = Checked(values::compute))]
    pub compute: Option<values::Compute>,
    /// one JSON object per component, in an array
    #[arg(long)]
    pub json: bool,
    /// list every route and the options it takes (type, default, what each does), then stop
    #[arg(long)]
    pub routes: bool,
    /// load a checkpoint whose config leaves some of its tensors unused (refused otherwise)
    #[arg(long)]
    pub allow_unused_weights: bool,
    /// do not read DDO_PRESET / DDO_<COMPONENT>_ROUTE
    #[arg(long)]
    pub no_env: bool,
}

/// `ddo inspect`'s options.
#[derive(Debug, Clone, Default, Args)]
#[command(
    override_usage = "ddo inspect PATH [--vram-budget SIZE] [--route COMPONENT=ROUTE[:k=v,...]]... [--check-values] [--json]"
)]
pub struct InspectArgs {
    /// a .safetensors file, a model folder or a pipeline folder (one)
    #[arg(value_name = "PATH", value_parser = Checked(values::path))]
    pub paths: Vec<PathBuf>,
    /// the budget the preset table assumes (default 8GiB)
    #[arg(long, value_name = "SIZE", value_parser = Checked(values::vram_budget))]
    pub vram_budget: Option<u64>,
    /// also estimate this route for a component of PATH (repeatable)
    #[arg(long, value_name = "COMPONENT=ROUTE[:k=v,...]")]
    pub route: Vec<String>,
    /// also read every tensor's values: exit 1 naming the first tensor that holds a NaN, an
    /// Inf, a value above 1.8e19 or an fp8 scale that overflows its weight
    #[arg(long)]
    pub check_values: bool,
    /// print as JSON
    #[arg(long)]
    pub json: bool,
}

/// `ddo bench`'s options.
#[derive(Debug, Clone, Default, Args)]
#[command(
    override_usage = "ddo bench (--config tiny|flux-dev|qwen-tiny|qwen-image | --weights DIR) [--component NAME] [--route ROUTE]... [--preset NAME]... [options]",
    after_help = BENCH_NOTES
)]
pub struct BenchArgs {
    /// transformer (default), vae, text_encoder or text_encoder_2
    #[arg(long, value_name = "NAME")]
    pub component: Option<String>,
    /// random weights at a named config
    #[arg(long, value_name = "tiny|flux-dev|qwen-tiny|qwen-image")]
    pub config: Option<String>,
    /// a Diffusers pipeline folder
    #[arg(long, value_name = "DIR", value_parser = Checked(values::path))]
    pub weights: Option<PathBuf>,
    /// a single-file transformer in the original Flux layout, in place of the folder's or the
    /// config's (as for run)
    #[arg(long, value_name = "FILE", value_parser = Checked(values::path))]
    pub transformer: Option<PathBuf>,
    /// a single-file CLIP text encoder in the Transformers layout, in place of the folder's or
    /// the config's (as for run)
    #[arg(long, value_name = "FILE", value_parser = Checked(values::path))]
    pub text_encoder: Option<PathBuf>,
    /// a single-file T5 encoder in the Transformers layout, in place of the folder's or the
    /// config's (as for run)
    #[arg(long, value_name = "FILE", value_parser = Checked(values::path))]
    pub text_encoder_2: Option<PathBuf>,
    /// a single-file VAE in the original LDM layout, in place of the folder's or the config's
    /// (as for run)
    #[arg(long, value_name = "FILE", value_parser = Checked(values::path))]
    pub vae: Option<PathBuf>,
    /// a LoRA applied to the benched component in every candidate (as for run); repeatable
    #[arg(long, value_name = "FILE[:STRENGTH]", value_parser = Checked(values::lora))]
    pub lora: Vec<values::LoraArg>,
    /// `--lora-allow-unmatched` (`LORA_ALLOW_UNMATCHED`)
    #[arg(long, help = LORA_ALLOW_UNMATCHED)]
    pub lora_allow_unmatched: bool,
    /// fold the LoRAs into the weights of components that run resident (route `none`), at
    /// attach: no cost per step; streamed components add them as usual
    #[arg(long)]
    pub lora_fuse: bool,
    /// a candidate route (repeatable)
    #[arg(long, value_name = "ROUTE[:k=v,...]")]
    pub route: Vec<String>,
    /// a candidate preset (repeatable)
    #[arg(long, value_name = "NAME", value_parser = Checked(values::preset))]
    pub preset: Vec<Preset>,
    /// timed forwards per candidate (default 5)
    #[arg(long, value_name = "N", value_parser = Checked(values::positive))]
    pub repeats: Option<usize>,
    /// untimed forwards first (default 1)
    #[arg(long, value_name = "N", value_parser = Checked(values::whole))]
    pub warmup: Option<usize>,
    /// device memory DDO may use (cpu: each candidate's device capacity)
    #[arg(long, value_name = "SIZE", value_parser = Checked(values::vram_budget))]
    pub vram_budget: Option<u64>,
    /// host memory DDO may make this machine hold: pinned memory plus its working memory, e.g. 24GiB (default: MemAvailable less an eighth, at least 4 GiB)
    #[arg(long, value_name = "SIZE", value_parser = Checked(values::host_budget))]
    pub host_budget: Option<u64>,
    /// execution device (default cpu)
    #[arg(long, value_name = "cpu|cuda:N", value_parser = Checked(values::device))]
    pub device: Option<DeviceChoice>,
    /// image height of the workload (default 128 for tiny, 1024 otherwise)
    #[arg(long, value_name = "PX", value_parser = Checked(values::positive))]
    pub height: Option<usize>,
    /// image width of the workload (default 128 for tiny, 1024 otherwise)
    #[arg(long, value_name = "PX", value_parser = Checked(values::positive))]
    pub width: Option<usize>,
    /// weight dtype (as for run)
    #[arg(long, value_name = "f32|bf16|f16|fp8", value_parser = Checked(values::dtype))]
    pub dtype: Option<DType>,
    /// what the linears compute in: bf16 (default), or fp8 (weights stored as E4M3, converted
    /// at load if need be; each activation scaled per tensor into E4M3 at run time)
    #[arg(long, value_name = "bf16|fp8", value_parser = Checked(values::compute))]
    pub compute: Option<values::Compute>,
    /// also write the JSON there
    #[arg(long, value_name = "FILE.json", value_parser = Checked(values::path))]
    pub out_json: Option<PathBuf>,
    /// also draw time vs peak memory to PREFIX.svg and PREFIX.png
    #[arg(long, value_name = "PREFIX", value_parser = Checked(values::path))]
    pub plot: Option<PathBuf>,
    /// print JSON instead of the table
    #[arg(long)]
    pub json: bool,
    /// load a checkpoint whose config leaves some of its tensors unused (refused otherwise)
    #[arg(long)]
    pub allow_unused_weights: bool,
    /// trace streamed candidates (timeline=true) and print where the copy engine sat idle
    #[arg(long)]
    pub timeline: bool,
    /// after the timed forwards, one more with every op timed: device time per op class
    #[arg(long)]
    pub profile: bool,
}

/// `(option, path)` for each option given.
fn given<'a>(options: &[(&'static str, &'a Option<PathBuf>)]) -> Vec<(&'static str, &'a Path)> {
    options
        .iter()
        .filter_map(|(o, p)| p.as_deref().map(|p| (*o, p)))
        .collect()
}

impl RunArgs {
    /// Every path `ddo run` reads, by option: the one list its outputs are checked against
    /// ([`crate::outputs::Inputs`]). An option that reads a file is added here.
    pub fn paths_read(&self) -> Vec<(&'static str, &Path)> {
        self.load
            .paths_read()
            .into_iter()
            .chain(given(&[
                ("--init-latents", &self.init_latents),
                ("--prompt-embeds", &self.prompt_embeds),
            ]))
            .chain(self.lora.iter().map(|l| ("--lora", l.path.as_path())))
            .collect()
    }
}

impl DecodeArgs {
    /// Every path `ddo decode` reads, by option (see [`RunArgs::paths_read`]).
    pub fn paths_read(&self) -> Vec<(&'static str, &Path)> {
        given(&[("--weights", &self.weights), ("--latents", &self.latents)])
    }
}

impl ResolveArgs {
    /// Every path `ddo resolve` reads, by option (see [`RunArgs::paths_read`]).
    pub fn paths_read(&self) -> Vec<(&'static str, &Path)> {
        given(&[
            ("--weights", &self.weights),
            ("--transformer", &self.transformer),
            ("--text-encoder", &self.text_encoder),
            ("--text-encoder-2", &self.text_encoder_2),
            ("--vae", &self.vae),
        ])
        .into_iter()
        .chain(self.lora.iter().map(|l| ("--lora", l.path.as_path())))
        .collect()
    }
}

impl InspectArgs {
    /// Every path `ddo inspect` reads (see [`RunArgs::paths_read`]).
    pub fn paths_read(&self) -> Vec<(&'static str, &Path)> {
        self.paths.iter().map(|p| ("PATH", p.as_path())).collect()
    }
}

impl BenchArgs {
    /// Every path `ddo bench` reads, by option (see [`RunArgs::paths_read`]).
    pub fn paths_read(&self) -> Vec<(&'static str, &Path)> {
        given(&[
            ("--weights", &self.weights),
            ("--transformer", &self.transformer),
            ("--text-encoder", &self.text_encoder),
            ("--text-encoder-2", &self.text_encoder_2),
            ("--vae", &self.vae),
        ])
        .into_iter()
        .chain(self.lora.iter().map(|l| ("--lora", l.path.as_path())))
        .collect()
    }
}

/// The options that name what a command writes; every other path option is read.
pub const OUTPUT_OPTIONS: [&str; 4] = ["out", "save-latents", "out-json", "plot"];
