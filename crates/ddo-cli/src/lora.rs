//! LoRA files in the CLI (issue 36): `ddo inspect FILE` on one (its format, the family it
//! fits, its ranks and scales, and the modules it adapts per component,
//! [`ddo_nn::lora::LoraFile`]; a file whose keys look like a LoRA but that DDO cannot apply
//! is the loader's typed error), and `ddo run --lora FILE[:STRENGTH]`
//! ([`apply_run_loras`]).

use std::path::Path;

use ddo_core::Checkpoint;
use ddo_nn::lora::LoraFile;
use serde_json::json;

use crate::cli::LoraArg;
use crate::error::{CliError, CliResult};

/// Reads every `--lora` file with its strength (`--lora-allow-unmatched`: keeping files
/// that only partly match, [`LoraFile::open_allowing_unmatched`]).
pub fn read_loras(loras: &[LoraArg], allow_unmatched: bool) -> CliResult<Vec<(LoraFile, f32)>> {
    loras
        .iter()
        .map(|l| {
            let f = if allow_unmatched {
                LoraFile::open_allowing_unmatched(&l.path)?
            } else {
                LoraFile::open(&l.path)?
            };
            Ok((f, l.strength))
        })
        .collect()
}

/// Reads every `--lora` file and puts its modules on the pipeline's components (each
/// file's strength on its scales; [`ddo_nn::lora::set_pipeline_loras`]); returns the
/// factors' device bytes, and says per file what it adapts (on `out`, unless `json`). A file
/// with modules for a component the pipeline lacks, or that fits none of its layers, is an
/// error before anything runs.
pub fn apply_run_loras(
    (loras, allow_unmatched, fuse): (&[LoraArg], bool, bool),
    pipeline: &ddo_routes::Pipeline,
    device: &dyn ddo_core::Device,
    out: &mut dyn std::io::Write,
    json: bool,
) -> CliResult<u64> {
    if loras.is_empty() {
        return Ok(0);
    }
    let files = read_loras(loras, allow_unmatched)?;
    let refs: Vec<(&LoraFile, f32)> = files.iter().map(|(f, s)| (f, *s)).collect();
    let (bytes, left_out) =
        ddo_nn::lora::set_pipeline_loras(pipeline, &refs, device, allow_unmatched)?;
    // `--lora-fuse`: a resident route folds them into its weights when it attaches.
    for c in pipeline.components() {
        c.set_adapter_fusion(fuse);
    }
    // `--lora-allow-unmatched`: every module left out is named (on stderr with --json).
    let unmatched: Vec<String> = files
        .iter()
        .flat_map(|(f, _)| {
            f.unmatched
                .iter()
                .map(move |m| format!("{}: {m}", f.path.display()))
        })
        .chain(left_out)
        .collect();
    if !unmatched.is_empty() {
        let text = format!(
            "lora: {} module(s) not applied (--lora-allow-unmatched): {}\n",
            unmatched.len(),
            unmatched.join(", ")
        );
        if json {
            eprint!("{text}");
        } else {
            out.write_all(text.as_bytes())
                .map_err(|e| CliError::runtime(format!("cannot write: {e}"), ""))?;
        }
    }
    if !json {
        for (f, strength) in &files {
            let line = format!(
                "lora: {} ({}, {} modules, strength {strength})\n",
                f.path.display(),
                f.format,
                f.modules.len()
            );
            out.write_all(line.as_bytes())
                .map_err(|e| CliError::runtime(format!("cannot write: {e}"), ""))?;
        }
    }
    Ok(bytes)
}

/// The report for `path` when it is a LoRA file (`None`: not one, inspect it as weights).
pub fn inspect_lora(path: &Path, as_json: bool) -> CliResult<Option<String>> {
    if !path.is_file() {
        return Ok(None);
    }
    let Ok(ckpt) = Checkpoint::open(path) else {
        return Ok(None);
    };
    if !LoraFile::looks_like_lora(&ckpt) {
        return Ok(None);
    }
    drop(ckpt);
    let lora = LoraFile::open(path)?;
    if !as_json {
        return Ok(Some(lora.format_text()));
    }
    let v = json!({
        "path": path.display().to_string(),
        "lora": {
            "format": lora.format.as_str(),
            "family": lora.family().map(|f| f.as_str()),
            "ranks": lora.ranks(),
            "modules": lora.modules.iter().map(|m| json!({
                "component": m.component,
                "module": m.module,
                "rank": m.rank(),
                "in_features": m.in_features(),
                "out_features": m.out_features(),
                "scale": m.scale,
                "dtype": m.down.dtype.as_str(),
            })).collect::<Vec<_>>(),
        },
    });
    Ok(Some(
        serde_json::to_string_pretty(&v).unwrap_or_default() + "\n",
    ))
}

/// The memory plan's budget and its source once `lora_bytes` of LoRA factors sit on the
/// device for the whole run (unchanged without any).
pub fn budget_less_loras(budget: u64, source: String, lora_bytes: u64) -> (u64, String) {
    if lora_bytes == 0 {
        return (budget, source);
    }
    (
        budget.saturating_sub(lora_bytes),
        format!(
            "{source}, less {} of LoRA factors",
            ddo_metrics::format_bytes(lora_bytes)
        ),
    )
}
