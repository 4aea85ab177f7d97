//! `ddo inspect FILE` on a LoRA file (issue 36): its format, the family it fits, its ranks
//! and scales, and the modules it adapts per component ([`ddo_nn::lora::LoraFile`]). A file
//! whose keys look like a LoRA but that DDO cannot apply is the loader's typed error.

use std::path::Path;

use ddo_core::Checkpoint;
use ddo_nn::lora::LoraFile;
use serde_json::json;

use crate::error::CliResult;

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
