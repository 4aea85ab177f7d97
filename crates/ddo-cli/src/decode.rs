//! `ddo decode`: decodes saved latents (tensor `latents`, NCHW, as `AutoencoderKL.decode`
//! takes them: already divided by the scaling factor and shifted) with a VAE folder, under
//! the same preset/route options as `ddo run`, into a PNG or a safetensors file (`sample`,
//! f32 NCHW in about [-1, 1]).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use ddo_metrics::format_bytes;
use ddo_nn::pipeline::{PipelineKind, plan_decode_on};
use ddo_nn::vae::AutoencoderKL;
use ddo_routes::enable_resolved_offload;
use serde_json::json;

use crate::cli::DecodeArgs;
use crate::error::{CliError, CliResult};
use crate::io::{HostTensor, OutputKind, encode_png, encode_safetensors, output_kind, read_tensor};
use crate::outputs::{Inputs, Outputs, image_paths};
use crate::setup::{DeviceChoice, DeviceNeeds, Routing, check_budget, open_device};

/// The VAE folder: `dir` itself, or `dir/vae` for a pipeline folder.
fn vae_dir(dir: &Path) -> PathBuf {
    if !ddo_nn::weights::is_present(&dir.join("config.json"))
        && ddo_nn::weights::is_present(&dir.join("vae").join("config.json"))
    {
        dir.join("vae")
    } else {
        dir.to_path_buf()
    }
}

/// Refuses a VAE folder whose `config.json` names a class other than `AutoencoderKL` (its
/// `_class_name`, or a Transformers model's `architectures`), before anything is parsed as
/// an AutoencoderKL: what it found, and the folder to give instead. A config naming no
/// class is left to the loader.
fn check_vae_class(weights: &Path, dir: &Path) -> CliResult<()> {
    let file = dir.join("config.json");
    if !ddo_nn::weights::is_present(&file) {
        return Ok(());
    }
    let class = ddo_nn::pipeline::config_class(&file)
        .map_err(|e| CliError::from(e).context(&format!("--weights {}", weights.display())))?;
    let Some(class) = class.filter(|c| c != ddo_nn::vae::CLASS_NAME) else {
        return Ok(());
    };
    let (what, instead) = match PipelineKind::component_of_class(&class) {
        Some((PipelineKind::QwenImage, "vae")) => (
            "QwenImagePipeline's VAE, which ddo decode does not take".to_string(),
            "Qwen-Image latents are decoded by `ddo run --weights QWEN_PIPELINE_DIR` (a \
             QwenImagePipeline folder); ddo decode takes an AutoencoderKL folder (FLUX.1's or \
             SD's vae/)"
                .to_string(),
        ),
        Some((PipelineKind::Flux, component)) => (
            format!("FluxPipeline's {component}, not a VAE"),
            "give the pipeline's vae/ folder (an AutoencoderKL), or the pipeline folder itself"
                .to_string(),
        ),
        Some((kind, component)) => (
            format!("{}'s {component}, not a VAE", kind.class_name()),
            format!(
                "{} latents are decoded by `ddo run` of the pipeline folder; ddo decode takes \
                 an AutoencoderKL folder (FLUX.1's or SD's vae/)",
                kind.class_name()
            ),
        ),
        None => (
            "not a VAE ddo decode takes".to_string(),
            "ddo decode takes an AutoencoderKL folder (FLUX.1's or SD's vae/, or the pipeline \
             folder holding it)"
                .to_string(),
        ),
    };
    Err(CliError::usage(
        format!(
            "--weights {}: {} names {class}, {what}",
            weights.display(),
            file.display()
        ),
        instead,
    ))
}

/// Runs `ddo decode` with its parsed options.
pub fn decode(args: &DecodeArgs, out: &mut dyn Write) -> CliResult<()> {
    let started = Instant::now();
    let need = |given: &Option<PathBuf>, name: &str, example: &str| {
        given.clone().ok_or_else(|| {
            CliError::usage(
                format!("ddo decode needs --{name}"),
                format!("add --{name} {example}"),
            )
        })
    };
    let weights = need(&args.weights, "weights", "VAE_DIR")?;
    let latents_path = need(&args.latents, "latents", "FILE.safetensors")?;
    let out_path = need(&args.out, "out", "OUT.png")?;
    let out_kind = output_kind("--out", &out_path)?;
    // The folder's class first: another model's config is never parsed as a VAE's.
    let dir = vae_dir(&weights);
    check_vae_class(&weights, &dir)?;
    // The latents say how many images there are, hence which files to plan.
    let latents = read_tensor(&latents_path, &["latents"], "--latents")?;
    let images = match latents.shape.as_slice() {
        [b, _, _, _] => *b,
        _ => 1,
    };
    if out_kind == OutputKind::Png && images > crate::run::MAX_IMAGES {
        return Err(CliError::usage(
            format!(
                "--latents {}: {images} images, more PNG files than {} in one command",
                latents_path.display(),
                crate::run::MAX_IMAGES
            ),
            "write them to one OUT.safetensors, or split the latents",
        ));
    }
    let image_files = image_paths(&out_path, images);
    let outputs = Outputs::plan(
        &image_files
            .iter()
            .map(|p| ("--out", p.as_path()))
            .collect::<Vec<_>>(),
        &Inputs::of(&args.paths_read()),
    )?;
    let dtype = args.dtype;
    if let Some(d) = dtype.filter(|d| d.is_fp8()) {
        return Err(CliError::usage(
            format!("--dtype {d}: the VAE is not stored as fp8"),
            "fp8 storage is for the transformer (`ddo run --dtype fp8`); decode with --dtype f32, bf16 or f16",
        ));
    }
    let tiled = args
        .tiled_decode
        .unwrap_or(ddo_nn::pipeline::TiledDecode::Auto);
    let device_choice = args.device.unwrap_or(DeviceChoice::Cpu);
    crate::setup::check_host_budget(device_choice, args.vram_budget)?;
    let budget = args.vram_budget;
    device_choice.prepare_kernels();
    let routing = Routing::new(args.preset, &args.route, args.no_env, &["vae".to_string()])?;
    let explanation = routing.explain("vae")?;

    let vae = AutoencoderKL::load_checked(
        &dir,
        dtype,
        crate::run::unused_weights(args.allow_unused_weights),
    )
    .map_err(|e| CliError::from(e).context(&format!("--weights {}", weights.display())))?;
    let c = vae.config().latent_channels;
    if !matches!(latents.shape.as_slice(), [b, cc, h, w] if *b > 0 && *cc == c && *h > 0 && *w > 0)
    {
        return Err(CliError::usage(
            format!(
                "--latents {}: shape {:?}",
                latents_path.display(),
                latents.shape
            ),
            format!("this VAE decodes latents [B, {c}, h, w] (NCHW, B images)"),
        ));
    }

    let device = open_device(
        device_choice,
        budget,
        DeviceNeeds::of([&explanation.resolution]),
    )?;
    let capacity = device.memory_info().capacity;
    let effective_budget = budget.or((capacity > 0).then_some(capacity));
    if let Some(b) = effective_budget {
        check_budget(b, std::slice::from_ref(vae.component()))?;
    }
    // The VAE was resolved once, above: its handle carries that resolution.
    let mut handle =
        enable_resolved_offload(vae.component(), device.clone(), &explanation.resolution)
            .map_err(|e| CliError::from(e).context("attaching the VAE's route"))?;
    let weights_on_device = if ddo_routes::keeps_weights_resident(handle.spec()) {
        if handle.target() == ddo_core::RouteTarget::Unmanaged {
            vae.component()
                .to_device(&*device, &device.compute_stream())?;
        }
        0
    } else {
        vae.component()
            .largest_leaf()
            .map_or(0, |l| l.param_bytes())
    };
    let available = effective_budget.map(|b| {
        b.saturating_sub(device.memory_info().allocated)
            .saturating_sub(weights_on_device)
    });
    let plan = plan_decode_on(
        Some(&*device),
        vae.config(),
        &latents.shape,
        vae.dtype(),
        tiled,
        available,
        effective_budget,
    )?;
    let t0 = Instant::now();
    let input = latents.to_tensor()?;
    let dev = device.clone();
    let decoded = handle.cleanup_on_error(|_| {
        let image = vae.decode(Some(&*dev), &input, plan.tiling)?;
        // NaN weights give a NaN image, which a PNG would write as black: refused instead,
        // as `ddo run` refuses it, before anything is written.
        ddo_core::check_finite(
            ddo_core::ops_of(&*dev)?,
            &image,
            "decode",
            None,
            "the decoded image",
        )?;
        let values = image.to_f32_vec(&*dev, &dev.compute_stream())?;
        Ok(HostTensor {
            shape: image.shape().to_vec(),
            values,
        })
    })?;
    let seconds = t0.elapsed().as_secs_f64();
    if handle.target() == ddo_core::RouteTarget::Unmanaged {
        vae.component().to_host()?;
    }
    let peak = handle.end_phase("decode")?;
    match out_kind {
        OutputKind::Png => outputs.commit(
            &decoded
                .rows()
                .iter()
                .map(|row| Ok(("--out", encode_png(row)?)))
                .collect::<CliResult<Vec<_>>>()?,
        )?,
        OutputKind::Safetensors => {
            outputs.commit(&[("--out", encode_safetensors(&[("sample", &decoded)])?)])?
        }
    }
    let snapshot = handle.metrics_snapshot();
    let text = if args.json {
        let v = json!({
            "command": "decode",
            "weights": dir.display().to_string(),
            "device": device.id().to_string(),
            "vram_budget_bytes": effective_budget,
            "latents_shape": latents.shape,
            "image_shape": decoded.shape,
            "component": explanation,
            "decode": plan,
            "seconds": seconds,
            "peak_bytes": peak.allocator_peak_bytes,
            "end_bytes": peak.allocator_end_bytes,
            "metrics": snapshot,
            "output": image_files.first().map(|p| p.display().to_string()),
            "outputs": image_files.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
            "total_seconds": started.elapsed().as_secs_f64(),
        });
        serde_json::to_string_pretty(&v).unwrap_or_default() + "\n"
    } else {
        format!(
            "ddo decode: {} on {}, budget {}\n  vae: {} (decided by {})\n  decode {:?} -> {:?}: {:.1} ms, peak {} (exact); {}\nwrote {}\n",
            dir.display(),
            device.id(),
            effective_budget.map_or("none".into(), format_bytes),
            snapshot.route_options,
            explanation.resolution.decided_by,
            latents.shape,
            decoded.shape,
            seconds * 1e3,
            format_bytes(peak.allocator_peak_bytes),
            plan.reason,
            image_files
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    out.write_all(text.as_bytes())
        .map_err(|e| CliError::runtime(format!("cannot write the profile: {e}"), ""))
}
