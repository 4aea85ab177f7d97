//! `ddo inspect FILE.gguf` (issue 37): a GGUF file's version, architecture, tensors by type
//! (count, elements, stored bytes) and what DDO loads it as, after the one validator every
//! GGUF reader runs ([`ddo_core::gguf::GgufFile::open`]): a malformed file is refused here
//! as `ddo run` refuses it.

use std::collections::BTreeMap;
use std::path::Path;

use ddo_core::gguf::GgufFile;
use ddo_metrics::format_bytes;
use serde_json::json;

use crate::error::{CliError, CliResult};

/// The original Flux layout's marker tensor (as `ddo_nn::flux::original` looks for it).
const FLUX_MARKER: &str = "double_blocks.0.img_attn.norm.key_norm.scale";

/// How every quantized GGUF DDO loads is run, said after what it loads as.
const AS_BLOCKS: &str = "its quantized tensors stay blocks and are dequantized where they run; \
                         `--dtype bf16` (or f32, f16) dequantizes it at load instead";

/// What DDO loads `file` as.
fn loads_as(file: &GgufFile) -> String {
    let flux = file
        .tensors()
        .iter()
        .any(|t| t.name == FLUX_MARKER || t.name == format!("model.diffusion_model.{FLUX_MARKER}"));
    let t5 = file
        .tensors()
        .iter()
        .any(|t| t.name == "enc.blk.0.attn_q.weight")
        && file.tensors().iter().any(|t| t.name == "token_embd.weight");
    let qwen_text = file
        .architecture()
        .is_some_and(|a| ddo_nn::qwen_text::GGUF_ARCHITECTURES.contains(&a))
        && file
            .tensors()
            .iter()
            .any(|t| t.name == "blk.0.attn_q.weight");
    if qwen_text {
        return format!(
            "Qwen-Image's text encoder (a Qwen2.5-VL language model in llama.cpp's names): \
             `--text-encoder FILE` beside `--weights QWEN_FOLDER` on run, bench and resolve; \
             {AS_BLOCKS}"
        );
    }
    let marker = ddo_nn::qwen_image::QWEN_FILE_MARKER;
    let qwen_image = file.tensors().iter().any(|t| {
        t.name == marker || t.name == format!("{}{marker}", ddo_nn::qwen_image::QWEN_FILE_PREFIX)
    });
    if qwen_image {
        return format!(
            "a Qwen-Image transformer: `--transformer FILE` beside `--weights QWEN_FOLDER` on \
             run, bench and resolve; {AS_BLOCKS}"
        );
    }
    if t5 {
        return format!(
            "a T5 encoder in llama.cpp's names: `--text-encoder-2 FILE` on run, bench and \
             resolve; {AS_BLOCKS}"
        );
    }
    if flux {
        "a Flux transformer in the original layout: `--transformer FILE` on run, bench and \
         resolve; its quantized tensors stay blocks on the host and the device and each linear \
         dequantizes its weight where it runs (every route takes it); `--dtype bf16` (or f32, \
         f16) dequantizes it at load instead"
            .to_string()
    } else {
        format!(
            "nothing yet: DDO loads GGUF Flux transformers in the original layout, T5 encoders, \
             Qwen-Image transformers and Qwen2.5-VL text encoders (this file's architecture is \
             {})",
            file.architecture().unwrap_or("not named")
        )
    }
}

/// The report for `path` when it is a GGUF file (`None`: not one).
pub fn inspect_gguf(path: &Path, as_json: bool) -> CliResult<Option<String>> {
    if !ddo_nn::weights::is_gguf(path) {
        return Ok(None);
    }
    let file = GgufFile::open(path).map_err(CliError::from)?;
    // Per type: tensors, elements, stored bytes.
    let mut by_type: BTreeMap<&'static str, (usize, u64, u64)> = BTreeMap::new();
    for t in file.tensors() {
        let e = by_type.entry(t.ggml_type.name()).or_default();
        e.0 += 1;
        e.1 += t.elements() as u64;
        e.2 += t.nbytes as u64;
    }
    let total: u64 = by_type.values().map(|v| v.2).sum();
    let elements: u64 = by_type.values().map(|v| v.1).sum();
    let loads = loads_as(&file);
    if as_json {
        let v = json!({
            "path": path.display().to_string(),
            "gguf": {
                "version": file.version(),
                "architecture": file.architecture(),
                "tensors": file.tensors().len(),
                "elements": elements,
                "bytes": total,
                "types": by_type.iter().map(|(ty, (n, e, b))| json!({
                    "type": ty, "tensors": n, "elements": e, "bytes": b,
                })).collect::<Vec<_>>(),
                "loads_as": loads,
            },
        });
        return Ok(Some(
            serde_json::to_string_pretty(&v).unwrap_or_default() + "\n",
        ));
    }
    let mut s = format!(
        "{}: GGUF v{}, architecture {}, {} tensors, {} elements, {} stored ({:.2} bits a weight)\n",
        path.display(),
        file.version(),
        file.architecture().unwrap_or("not named"),
        file.tensors().len(),
        elements,
        format_bytes(total),
        if elements > 0 {
            total as f64 * 8.0 / elements as f64
        } else {
            0.0
        }
    );
    for (ty, (n, e, b)) in &by_type {
        s += &format!(
            "  {ty:<5} {n:>5} tensors, {e:>14} elements, {:>12}\n",
            format_bytes(*b)
        );
    }
    s += &format!("  loads as: {loads}\n");
    Ok(Some(s))
}
