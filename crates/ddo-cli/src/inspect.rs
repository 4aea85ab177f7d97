//! `ddo inspect PATH`: reads safetensors headers only (never the weights): for a file, a
//! component folder or a Diffusers pipeline folder (sharded indexes included), each
//! component's tensors, parameter count and bytes by dtype, its largest leaf, and what each
//! preset would keep resident and stream per forward under a `--vram-budget`.
//!
//! `--check-values` also reads every tensor's values ([`check_values`], issue 34) through the
//! checkpoint reader's memory mapping, each large tensor on every core
//! ([`ddo_core::values::scan`]), its pages released once scanned: NaN and ±Inf (fp8 NaN and
//! Inf bytes included) and finite values above [`HUGE_VALUE`] (`sqrt(f32::MAX)`, 1.8e19,
//! which overflows once squared), and fp8 scale tensors that are not finite and positive or
//! that push their weight above that bound. Any such tensor makes the command exit 1 naming
//! the first (components, files and tensor names in order) and its file.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use ddo_core::values::{HUGE_VALUE, fp8_scale_problem, scan};
use ddo_core::{Checkpoint, DType, HeaderEstimate, Preset};
use ddo_metrics::format_bytes;
use ddo_nn::pipeline::PipelineKind;
use serde::Serialize;

use crate::cli::InspectArgs;
use crate::error::{CliError, CliResult};
use crate::setup::{DEFAULT_HOST_CAPACITY, Routing};

/// Largest header `inspect` reads (safetensors headers are JSON of a few MB at most).
const MAX_HEADER: u64 = 100 << 20;

/// Per-dtype totals.
#[derive(Debug, Clone, Default, Serialize)]
pub struct DtypeTotals {
    /// Tensors.
    pub tensors: u64,
    /// Elements.
    pub params: u64,
    /// Bytes.
    pub bytes: u64,
}

/// One component, from its headers.
#[derive(Debug, Clone, Serialize)]
pub struct ComponentSummary {
    /// Name: a pipeline's sub-folder; a single model's component by its class (`vae`,
    /// `transformer`, `text_encoder`, `text_encoder_2`), else the folder's or the file's.
    pub component: String,
    /// `_class_name` or `architectures[0]` of config.json, when there is one.
    pub class: Option<String>,
    /// Weight files read.
    pub files: Vec<String>,
    /// The same files as paths (for `--check-values`).
    #[serde(skip)]
    pub paths: Vec<PathBuf>,
    /// Tensors.
    pub tensors: u64,
    /// Elements.
    pub params: u64,
    /// Bytes.
    pub bytes: u64,
    /// Totals by dtype (`F32`, `BF16`, ...).
    pub by_dtype: BTreeMap<String, DtypeTotals>,
    /// Leaves (tensors grouped by module: the name without its last segment).
    pub leaves: u64,
    /// The largest leaf: module name and bytes.
    pub largest_leaf: Option<(String, u64)>,
    /// Its 8-bit float tensors, when it has any.
    pub fp8: Option<Fp8Summary>,
}

/// A component's fp8 tensors (issue 18): what streams as stored and which carry a scale.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Fp8Summary {
    /// Tensors stored as `F8_E4M3` or `F8_E5M2`.
    pub tensors: u64,
    /// Their bytes (one an element: what a streamed route copies for them).
    pub bytes: u64,
    /// fp8 weights with a per-tensor scale beside them (`<layer>.scale_weight` or
    /// `<layer>.weight_scale`).
    pub scaled: u64,
    /// The scale tensors' names found (`scale_weight`, `weight_scale`).
    pub scale_names: Vec<String>,
    /// The routes that refuse these weights, as the registry's routes say
    /// (`ddo_routes::routes_refusing_weight_dtype`).
    pub refused_by: Vec<String>,
}

/// A tensor `--check-values` found bad values in.
#[derive(Debug, Clone, Serialize)]
pub struct BadTensor {
    /// Its component.
    pub component: String,
    /// Its file.
    pub file: String,
    /// Its name.
    pub tensor: String,
    /// Its dtype (`F32`, `F8_E4M3`, ...).
    pub dtype: String,
    /// Its elements.
    pub elements: u64,
    /// NaN or ±Inf elements.
    pub non_finite: u64,
    /// Finite elements above [`HUGE_VALUE`] (or, for an fp8 scale, values that overflow
    /// their weight).
    pub huge: u64,
    /// Index of the first bad element (row-major, from 0).
    pub first_bad_element: u64,
    /// Its value (`NaN`, `inf`, `3e38`).
    pub first_bad_value: String,
    /// What is wrong, in words.
    pub problem: String,
}

/// What `--check-values` found.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ValuesReport {
    /// Tensors read.
    pub tensors_checked: u64,
    /// Elements read.
    pub elements_checked: u64,
    /// The magnitude above which a finite value counts as bad ([`HUGE_VALUE`]).
    pub huge_above: f32,
    /// Whether every value is finite and within the bound (no bad tensor).
    pub all_finite: bool,
    /// The bad tensors, in the order read (components, files, names); the first is the
    /// one the error names.
    pub bad: Vec<BadTensor>,
}

/// A value as the report prints it.
fn value_text(v: f32) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "inf" } else { "-inf" }.into()
    } else {
        format!("{v:e}")
    }
}

/// Whether `name` is an fp8 weight's per-tensor scale (`<layer>.scale_weight`,
/// `<layer>.weight_scale`); returns the layer.
fn scale_layer(name: &str) -> Option<&str> {
    ddo_nn::weights::SCALE_NAMES.iter().find_map(|s| {
        name.strip_suffix(&format!(".{s}"))
            .map(|l| &name[..l.len()])
    })
}

/// Most elements a tensor read as an fp8 scale may have (one per tensor; a few per channel
/// in some files): a larger one is scanned as any other tensor.
const MAX_SCALE_ELEMENTS: usize = 4096;

/// The values of one tensor of `ckpt`: a [`BadTensor`] when any is bad.
fn check_tensor(
    ckpt: &Checkpoint,
    name: &str,
    component: &str,
) -> CliResult<(u64, Option<BadTensor>)> {
    let t = ckpt.tensor(name).map_err(CliError::from)?;
    // A coded tensor (`ddo convert --compress lossless`) is checked as the values it
    // decodes to; one that does not decode is the error.
    let decoded = match &t.coded {
        Some(_) => Some(
            ckpt.host_buffer(name)
                .and_then(|b| b.slice_all().try_with_bytes(<[u8]>::to_vec))
                .map_err(CliError::from)?,
        ),
        None => None,
    };
    let bytes = decoded
        .as_deref()
        .unwrap_or(&ckpt.map().bytes()[t.offset..t.offset + t.len]);
    let size = t.dtype.size_in_bytes();
    let elements = (bytes.len() / size) as u64;
    let bad = |non_finite: u64, huge: u64, first: u64, problem: String| {
        let at = first as usize * size;
        let value = t
            .dtype
            .decode_f32(&bytes[at..at + size])
            .ok()
            .and_then(|v| v.first().copied())
            .map_or_else(|| "?".to_string(), value_text);
        BadTensor {
            component: component.to_string(),
            file: ckpt.path().display().to_string(),
            tensor: name.to_string(),
            dtype: format!("{:?}", t.dtype.to_safetensors()),
            elements,
            non_finite,
            huge,
            first_bad_element: first,
            first_bad_value: value,
            problem,
        }
    };
    if let Some(layer) = scale_layer(name)
        && matches!(t.dtype, DType::F32 | DType::F16 | DType::BF16)
        && (elements as usize) <= MAX_SCALE_ELEMENTS
    {
        let weight = ckpt
            .tensor(&format!("{layer}.weight"))
            .map_or(DType::F8E4M3, |w| w.dtype);
        let values = t.dtype.decode_f32(bytes).map_err(CliError::from)?;
        let problems: Vec<(usize, String)> = values
            .iter()
            .enumerate()
            .filter_map(|(i, &v)| fp8_scale_problem(v, weight).map(|p| (i, p)))
            .collect();
        let found = problems.first().map(|(first, problem)| {
            let non_finite = values.iter().filter(|v| !v.is_finite()).count() as u64;
            bad(
                non_finite,
                problems.len() as u64 - non_finite,
                *first as u64,
                format!("the fp8 scale of `{layer}.weight`: {problem}"),
            )
        });
        return Ok((elements, found));
    }
    let found = scan(t.dtype, bytes, HUGE_VALUE);
    ckpt.map().release_pages(t.offset..t.offset + t.len);
    let report = found.first_bad.map(|first| {
        let mut what = Vec::new();
        if found.non_finite > 0 {
            what.push(format!("{} NaN/Inf value(s)", found.non_finite));
        }
        if found.huge > 0 {
            what.push(format!("{} value(s) above {HUGE_VALUE:.1e}", found.huge));
        }
        bad(
            found.non_finite,
            found.huge,
            first,
            format!("{} of {elements}", what.join(" and ")),
        )
    });
    Ok((elements, report))
}

/// `--check-values`: every tensor of every file of `comps`, in order.
pub fn check_values(comps: &[ComponentSummary]) -> CliResult<ValuesReport> {
    let mut report = ValuesReport {
        huge_above: HUGE_VALUE,
        ..ValuesReport::default()
    };
    for c in comps {
        for path in &c.paths {
            let ckpt = Checkpoint::open(path).map_err(CliError::from)?;
            let names: Vec<String> = ckpt.names().map(str::to_string).collect();
            for name in names {
                let (elements, bad) = check_tensor(&ckpt, &name, &c.component)?;
                report.tensors_checked += 1;
                report.elements_checked += elements;
                report.bad.extend(bad);
            }
        }
    }
    report.all_finite = report.bad.is_empty();
    Ok(report)
}

/// The report's line of text: `values: N tensors checked, all finite`, or how many are bad
/// and the first.
fn values_line(r: &ValuesReport) -> String {
    match r.bad.first() {
        None => format!(
            "values: {} tensors checked, all finite (none above {:.1e})\n",
            r.tensors_checked, r.huge_above
        ),
        Some(b) => format!(
            "values: {} tensors checked, {} with NaN/Inf or values above {:.1e}; first: `{}` in {}: {} (element {} is {})\n",
            r.tensors_checked,
            r.bad.len(),
            r.huge_above,
            b.tensor,
            b.file,
            b.problem,
            b.first_bad_element,
            b.first_bad_value
        ),
    }
}

/// The error for a report with bad tensors: the first, its file, and what to do.
fn values_error(r: &ValuesReport) -> Option<CliError> {
    let b = r.bad.first()?;
    let more = match r.bad.len() {
        1 => String::new(),
        n => format!(
            "; {} more tensor(s) hold bad values (ddo inspect --check-values --json lists them)",
            n - 1
        ),
    };
    Some(CliError::runtime(
        format!(
            "tensor `{}` ({}) in {} holds bad values: {}; element {} is {}{more}",
            b.tensor, b.component, b.file, b.problem, b.first_bad_element, b.first_bad_value
        ),
        format!(
            "a run on these weights gives NaN latents (an all-black image before issue 34): \
             re-download or re-convert {} (or fix the tensor), then run ddo inspect --check-values again",
            b.file
        ),
    ))
}

/// What one preset does with one component under the budget.
#[derive(Debug, Clone, Serialize)]
pub struct PresetPlan {
    /// Component.
    pub component: String,
    /// Route (`unmanaged` for preset off).
    pub route: String,
    /// Weight bytes kept on the device between forwards.
    pub resident_bytes: u64,
    /// Weight bytes copied to the device per forward.
    pub streamed_bytes_per_forward: u64,
    /// Weight bytes on the device at once during a forward (estimate).
    pub peak_weight_bytes: u64,
    /// A remark (does not fit, allocator needed, ...; for a refused route, why).
    pub note: String,
    /// Whether the route refuses these weights (their dtype), as `ddo run`'s preflight would.
    pub refused: bool,
}

struct TensorInfo {
    name: String,
    dtype: String,
    params: u64,
    bytes: u64,
}

fn read_header(path: &Path) -> CliResult<Vec<TensorInfo>> {
    // The same checks `run` and `decode` make (truncation, overlaps, duplicate names,
    // overflowing shapes, non-regular files) before anything is summarised.
    let ckpt = ddo_core::Checkpoint::open(path).map_err(CliError::from)?;
    let bad = |message: String| {
        CliError::runtime(
            format!("{}: {message}", path.display()),
            "check that it is a safetensors file (re-download or re-export it)",
        )
    };
    let mut f = File::open(path).map_err(|e| {
        CliError::runtime(
            format!("cannot read {}: {e}", path.display()),
            "check the path and permissions",
        )
    })?;
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let mut n = [0u8; 8];
    f.read_exact(&mut n)
        .map_err(|_| bad("shorter than a safetensors header".into()))?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER || n + 8 > len {
        return Err(bad(format!(
            "header length {n} does not fit the file ({len} B)"
        )));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header)
        .map_err(|e| bad(format!("cannot read the header: {e}")))?;
    let json: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&header).map_err(|e| bad(format!("header is not JSON: {e}")))?;
    let mut out = Vec::new();
    for (name, v) in json {
        if name == "__metadata__" {
            continue;
        }
        let dtype = v["dtype"].as_str().unwrap_or("?").to_string();
        let params = v["shape"]
            .as_array()
            .map(|s| s.iter().filter_map(|d| d.as_u64()).product())
            .unwrap_or(0);
        let bytes = match v["data_offsets"].as_array().map(Vec::as_slice) {
            Some([a, b]) => b
                .as_u64()
                .unwrap_or(0)
                .saturating_sub(a.as_u64().unwrap_or(0)),
            _ => return Err(bad(format!("tensor `{name}` has no data_offsets"))),
        };
        // A coded tensor (`ddo convert --compress lossless`) counts as the weights it
        // decodes to: what a route places on the device.
        let coded = ckpt.tensor(&name).ok().filter(|t| t.coded.is_some());
        let (dtype, params, bytes) = match coded {
            Some(t) => (
                format!("{:?}", t.dtype.to_safetensors()),
                t.shape.iter().map(|&d| d as u64).product(),
                t.coded.as_ref().map_or(bytes, |h| h.decoded_len()),
            ),
            None => (dtype, params, bytes),
        };
        out.push(TensorInfo {
            name,
            dtype,
            params,
            bytes,
        });
    }
    Ok(out)
}

/// The weight files of a component folder: an index's shards, or the `.safetensors` files.
fn weight_files(dir: &Path) -> CliResult<Vec<PathBuf>> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| {
            CliError::runtime(
                format!("cannot read {}: {e}", dir.display()),
                "check the path and permissions",
            )
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    entries.sort();
    if let Some(index) = entries
        .iter()
        .find(|p| p.to_string_lossy().ends_with(".safetensors.index.json"))
    {
        return index_shards(index);
    }
    let all: Vec<PathBuf> = entries
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    // Diffusers / Transformers weight names (single or shards) when present; other
    // safetensors files beside them (inputs, outputs, ...) are not weights.
    let named: Vec<PathBuf> = all
        .iter()
        .filter(|p| {
            p.file_name().is_some_and(|n| {
                let n = n.to_string_lossy();
                n.starts_with("diffusion_pytorch_model") || n.starts_with("model")
            })
        })
        .cloned()
        .collect();
    Ok(if named.is_empty() { all } else { named })
}

fn index_shards(index: &Path) -> CliResult<Vec<PathBuf>> {
    // The loader's checks first: shards are plain file names inside the folder, exist,
    // and hold the tensors mapped to them.
    ddo_nn::CheckpointWeights::open_index(index, None).map_err(CliError::from)?;
    let text = ddo_nn::read_text_file(index)
        .map_err(|e| CliError::runtime(format!("cannot read {}: {e}", index.display()), ""))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
        CliError::runtime(
            format!("{} is not JSON: {e}", index.display()),
            "re-download or re-export the sharded index",
        )
    })?;
    let Some(map) = json["weight_map"].as_object() else {
        return Err(CliError::runtime(
            format!("{} has no weight_map", index.display()),
            "re-download or re-export the sharded index",
        ));
    };
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut shards: Vec<PathBuf> = map
        .values()
        .filter_map(|v| v.as_str())
        .map(|f| dir.join(f))
        .collect();
    shards.sort();
    shards.dedup();
    Ok(shards)
}

fn class_of(dir: &Path) -> Option<String> {
    let file = dir.join("config.json");
    if !ddo_nn::weights::is_present(&file) {
        return None;
    }
    ddo_nn::pipeline::config_class(&file).ok().flatten()
}

/// A single model's component name: the component its class is in DDO's pipelines
/// (`AutoencoderKL` → `vae`, `FluxTransformer2DModel` → `transformer`, `T5EncoderModel` →
/// `text_encoder_2`; [`PipelineKind::component_of_class`]), so that its preset rows and
/// `--route` name are those `ddo resolve --component` and `ddo run` use; else `fallback`
/// (the folder's or the file's name).
fn component_name(class: Option<&str>, fallback: String) -> String {
    class
        .and_then(PipelineKind::component_of_class)
        .map_or(fallback, |(_, component)| component.to_string())
}

fn summarize(
    component: String,
    class: Option<String>,
    files: &[PathBuf],
) -> CliResult<ComponentSummary> {
    let mut s = ComponentSummary {
        component,
        class,
        files: files.iter().map(|f| f.display().to_string()).collect(),
        paths: files.to_vec(),
        tensors: 0,
        params: 0,
        bytes: 0,
        by_dtype: BTreeMap::new(),
        leaves: 0,
        largest_leaf: None,
        fp8: None,
    };
    let mut leaves: BTreeMap<String, u64> = BTreeMap::new();
    let mut fp8_weights: std::collections::BTreeSet<String> = Default::default();
    let mut scales: BTreeMap<String, String> = BTreeMap::new();
    let mut fp8 = Fp8Summary::default();
    // The fp8 dtypes seen, for asking the registry once each which routes refuse them.
    let mut fp8_dtypes: Vec<DType> = Vec::new();
    for f in files {
        for t in read_header(f)? {
            if let Some(dtype) = DType::from_header_name(&t.dtype).filter(|d| d.is_fp8()) {
                if !fp8_dtypes.contains(&dtype) {
                    fp8_dtypes.push(dtype);
                }
                fp8.tensors += 1;
                fp8.bytes += t.bytes;
                if let Some(layer) = t.name.strip_suffix(".weight") {
                    fp8_weights.insert(layer.to_string());
                }
            }
            for kind in ddo_nn::weights::SCALE_NAMES {
                if let Some(layer) = t.name.strip_suffix(&format!(".{kind}")) {
                    scales.insert(layer.to_string(), kind.to_string());
                }
            }
            s.tensors += 1;
            s.params += t.params;
            s.bytes += t.bytes;
            let d = s.by_dtype.entry(t.dtype.clone()).or_default();
            d.tensors += 1;
            d.params += t.params;
            d.bytes += t.bytes;
            let module = t.name.rsplit_once('.').map_or(t.name.as_str(), |(m, _)| m);
            *leaves.entry(module.to_string()).or_default() += t.bytes;
        }
    }
    s.leaves = leaves.len() as u64;
    s.largest_leaf = leaves.into_iter().max_by_key(|(_, b)| *b);
    if fp8.tensors > 0 {
        let mut names: Vec<String> = Vec::new();
        for (layer, kind) in &scales {
            if fp8_weights.contains(layer) {
                fp8.scaled += 1;
                if !names.contains(kind) {
                    names.push(kind.clone());
                }
            }
        }
        fp8.scale_names = names;
        for dtype in fp8_dtypes {
            for id in ddo_routes::routes_refusing_weight_dtype(dtype) {
                if !fp8.refused_by.iter().any(|r| r == id.as_str()) {
                    fp8.refused_by.push(id.as_str().to_string());
                }
            }
        }
        s.fp8 = Some(fp8);
    }
    Ok(s)
}

/// The components under `path`.
pub fn components(path: &Path) -> CliResult<Vec<ComponentSummary>> {
    let name_of = |p: &Path| {
        p.file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_else(|| p.display().to_string())
    };
    if path.is_file() {
        let text = path.to_string_lossy();
        let files = if text.ends_with(".index.json") {
            index_shards(path)?
        } else {
            vec![path.to_path_buf()]
        };
        let parent = path.parent().unwrap_or(Path::new("."));
        let stem = path
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        let generic = stem.starts_with("diffusion_pytorch_model") || stem.starts_with("model.");
        let class = class_of(parent);
        let name = if generic && parent.file_name().is_some() {
            component_name(class.as_deref(), name_of(parent))
        } else {
            stem.trim_end_matches(".safetensors").to_string()
        };
        return Ok(vec![summarize(name, class, &files)?]);
    }
    if !path.is_dir() {
        return Err(CliError::runtime(
            format!("{}: no such file or folder", path.display()),
            "give a .safetensors file, a model folder or a Diffusers pipeline folder",
        ));
    }
    // A model folder (config.json beside the weights) is one component; a pipeline folder
    // (model_index.json, or sub-folders with weights) is one component per sub-folder.
    let pipeline = ddo_nn::weights::is_present(&path.join("model_index.json"));
    let single = |own: &[PathBuf]| {
        let class = class_of(path);
        summarize(component_name(class.as_deref(), name_of(path)), class, own)
    };
    if !pipeline && path.join("config.json").is_file() {
        let own = weight_files(path)?;
        if !own.is_empty() {
            return Ok(vec![single(&own)?]);
        }
    }
    let mut subdirs: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(|e| CliError::runtime(format!("cannot read {}: {e}", path.display()), ""))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    subdirs.sort();
    let mut out = Vec::new();
    for d in subdirs {
        let files = weight_files(&d)?;
        if !files.is_empty() {
            out.push(summarize(name_of(&d), class_of(&d), &files)?);
        }
    }
    if out.is_empty() && !pipeline {
        let own = weight_files(path)?;
        if !own.is_empty() {
            return Ok(vec![single(&own)?]);
        }
    }
    if out.is_empty() {
        return Err(CliError::runtime(
            format!("{}: no safetensors weights found", path.display()),
            "give a .safetensors file, a model folder (config.json + weights) or a pipeline folder",
        ));
    }
    Ok(out)
}

/// What `preset` does with `c` under `budget`: the route the resolver gives `c` under the
/// preset (the row `ddo resolve --component NAME --preset P --no-env` prints), estimated
/// from the headers.
pub fn preset_plan(preset: Preset, c: &ComponentSummary, budget: u64) -> CliResult<PresetPlan> {
    let routing = Routing::new(Some(preset), &[], true, std::slice::from_ref(&c.component))?;
    Ok(route_plan(&routing.resolve(&c.component)?.spec, c, budget))
}

/// Why the route of `spec` refuses `c`'s weights, as its preflight would: a weight dtype of
/// the headers it does not take (`linear_convolution` on fp8 weights), as the registry says
/// ([`ddo_routes::routes_refusing_weight_dtype`]); `None` when it takes them all.
fn refusal(spec: &ddo_core::RouteSpec, c: &ComponentSummary) -> Option<String> {
    let id = spec.route_id()?;
    let (name, totals) = c.by_dtype.iter().find(|(name, _)| {
        DType::from_header_name(name)
            .is_some_and(|d| ddo_routes::routes_refusing_weight_dtype(d).contains(&id))
    })?;
    let dtype = DType::from_header_name(name)?;
    let takes: Vec<&str> = ddo_routes::descriptors()
        .iter()
        .filter(|d| d.route.takes_weight_dtype(dtype))
        .map(|d| d.id.as_str())
        .collect();
    Some(format!(
        "refused: {id} does not take {name} weights ({} tensors), its preflight refuses them; \
         routes that take them: {}",
        totals.tensors,
        takes.join(", ")
    ))
}

/// What the route of `spec` does with `c` under `budget`, as the route estimates it from
/// the headers ([`ddo_routes::estimate`]; a `budget` option of the spec is the route's to
/// honour), or that it refuses the weights' dtype (`refusal`).
pub fn route_plan(spec: &ddo_core::RouteSpec, c: &ComponentSummary, budget: u64) -> PresetPlan {
    let leaf = c.largest_leaf.as_ref().map_or(0, |(_, b)| *b);
    let e = ddo_routes::estimate(spec, c.bytes, leaf, budget).unwrap_or(HeaderEstimate {
        resident_bytes: c.bytes,
        streamed_bytes_per_forward: 0,
        peak_weight_bytes: c.bytes,
        note: "unmanaged: the caller places the weights".to_string(),
    });
    let refused = refusal(spec, c);
    PresetPlan {
        component: c.component.clone(),
        route: spec.describe(),
        resident_bytes: e.resident_bytes,
        streamed_bytes_per_forward: e.streamed_bytes_per_forward,
        peak_weight_bytes: e.peak_weight_bytes,
        note: refused.clone().unwrap_or(e.note),
        refused: refused.is_some(),
    }
}

/// One row of the estimates table: `label`, then the component, its resident and streamed
/// bytes, and the route with its note.
fn plan_row(label: &str, plan: &PresetPlan) -> String {
    let note = if plan.note.is_empty() {
        String::new()
    } else {
        format!(" ({})", plan.note)
    };
    format!(
        "{label:<14} {:<16} {:>11} {:>13}  {}{note}\n",
        plan.component,
        format_bytes(plan.resident_bytes),
        format_bytes(plan.streamed_bytes_per_forward),
        plan.route,
    )
}

/// Runs `ddo inspect` with its parsed options.
pub fn inspect(args: &InspectArgs, out: &mut dyn Write) -> CliResult<()> {
    let path = match args.paths.as_slice() {
        [p] => p.clone(),
        [] => {
            return Err(CliError::usage(
                "ddo inspect needs a PATH",
                "write ddo inspect PATH (a .safetensors file, a model folder or a pipeline folder)",
            ));
        }
        more => {
            return Err(CliError::usage(
                format!("ddo inspect takes one PATH, got {}", more.len()),
                "inspect one path at a time",
            ));
        }
    };
    // A GGUF file: its types, bytes and what loads it (issue 37).
    if let Some(text) = crate::gguf::inspect_gguf(&path, args.json)? {
        return out
            .write_all(text.as_bytes())
            .map_err(|e| CliError::runtime(format!("cannot write: {e}"), ""));
    }
    // A LoRA file: its format, family, ranks and modules (issue 36). `--check-values` and
    // `--route` read it as the weights file it also is.
    let as_lora = !args.check_values && args.route.is_empty();
    if let Some(text) = as_lora
        .then(|| crate::lora::inspect_lora(&path, args.json))
        .transpose()?
        .flatten()
    {
        return out
            .write_all(text.as_bytes())
            .map_err(|e| CliError::runtime(format!("cannot write: {e}"), ""));
    }
    let budget = args.vram_budget.unwrap_or(DEFAULT_HOST_CAPACITY);
    let comps = components(&path)?;
    let names: Vec<String> = comps.iter().map(|c| c.component.clone()).collect();
    // `--route COMPONENT=ROUTE`: parsed and checked as `ddo run` does, then estimated.
    let routing = Routing::new(None, &args.route, true, &names)?;
    let mut given = Vec::new();
    for (name, spec) in &routing.routes {
        ddo_routes::check_route_options(name, spec)?;
        if let Some(c) = comps.iter().find(|c| &c.component == name) {
            given.push(route_plan(spec, c, budget));
        }
    }
    let values = if args.check_values {
        Some(check_values(&comps)?)
    } else {
        None
    };
    let presets: Vec<(Preset, Vec<PresetPlan>)> = Preset::ALL
        .iter()
        .map(|&p| {
            let plans = comps.iter().map(|c| preset_plan(p, c, budget));
            Ok((p, plans.collect::<CliResult<Vec<_>>>()?))
        })
        .collect::<CliResult<_>>()?;
    let text = if args.json {
        let mut v = serde_json::json!({
            "path": path.display().to_string(),
            "components": comps,
            "vram_budget_bytes": budget,
            "routes": given,
            "presets": presets.iter().map(|(p, plans)| serde_json::json!({
                "preset": p.as_str(),
                "resolved_preset": p.resolved().as_str(),
                "components": plans,
            })).collect::<Vec<_>>(),
        });
        if let Some(r) = &values {
            v["values"] = serde_json::to_value(r).unwrap_or_default();
        }
        serde_json::to_string_pretty(&v).unwrap_or_default() + "\n"
    } else {
        let read = if values.is_some() {
            "headers and values"
        } else {
            "headers only"
        };
        let mut s = format!("{} ({read})\n\n", path.display());
        s += &format!(
            "{:<16} {:<26} {:>8} {:>14} {:>12}  {}\n",
            "component", "class", "tensors", "params", "bytes", "by dtype; largest leaf"
        );
        for c in &comps {
            let dtypes: Vec<String> = c
                .by_dtype
                .iter()
                .map(|(d, t)| format!("{d} {}", format_bytes(t.bytes)))
                .collect();
            let leaf = c.largest_leaf.as_ref().map_or(String::new(), |(n, b)| {
                format!("; {n} {}", format_bytes(*b))
            });
            s += &format!(
                "{:<16} {:<26} {:>8} {:>14} {:>12}  {}{leaf}\n",
                c.component,
                c.class.as_deref().unwrap_or("-"),
                c.tensors,
                c.params,
                format_bytes(c.bytes),
                dtypes.join(", ")
            );
        }
        for c in &comps {
            if let Some(f) = &c.fp8 {
                let scales = if f.scaled > 0 {
                    format!(
                        "{} weights with a per-tensor scale ({})",
                        f.scaled,
                        f.scale_names.join(", ")
                    )
                } else {
                    "no scales".to_string()
                };
                let refused = if f.refused_by.is_empty() {
                    "every route takes them".to_string()
                } else {
                    format!("refused by {}", f.refused_by.join(", "))
                };
                s += &format!(
                    "{}: {} fp8 tensors ({}), {scales}; they stream as stored and compute in bf16 ({refused})\n",
                    c.component,
                    f.tensors,
                    format_bytes(f.bytes)
                );
            }
        }
        if let Some(r) = &values {
            s += &values_line(r);
        }
        s += &format!(
            "\nper preset, with a {} budget (estimates from the headers):\n",
            format_bytes(budget)
        );
        s += &format!(
            "{:<14} {:<16} {:>11} {:>13}  {}\n",
            "preset", "component", "resident", "streamed/fwd", "route (note)"
        );
        for (p, plans) in &presets {
            for (i, plan) in plans.iter().enumerate() {
                s += &plan_row(if i == 0 { p.as_str() } else { "" }, plan);
            }
        }
        if !given.is_empty() {
            s += "\nper --route:\n";
            for plan in &given {
                s += &plan_row("", plan);
            }
        }
        s
    };
    out.write_all(text.as_bytes())
        .map_err(|e| CliError::runtime(format!("cannot write: {e}"), ""))?;
    match values.as_ref().and_then(values_error) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
