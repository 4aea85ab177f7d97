//! LoRA adapter files (issue 36): the formats users have, read into one form DDO applies at
//! run time — for each adapted linear of a model (a Diffusers module name, a leaf of DDO's
//! component tree), its down-projection `A [rank, in]`, its up-projection `B [out, rank]`
//! and its scale, so that `y = W x + scale · strength · B (A x)`. The base weights are never
//! read or changed here.
//!
//! Formats ([`LoraFormat`]), detected from the keys as Diffusers' `lora_state_dict` does:
//!
//! - **Diffusers / PEFT** (and AI-toolkit, which writes the same):
//!   `transformer.<module>.lora_A.weight` / `lora_B.weight`, optional `<module>.alpha`;
//!   `text_encoder.` (CLIP) and `text_encoder_2.` (T5) prefixes; a PEFT adapter name
//!   (`lora_A.default.weight`) is dropped.
//! - **kohya / sd-scripts** (and ComfyUI's saves of it): `lora_unet_double_blocks_0_img_attn_qkv
//!   .lora_down.weight` / `.lora_up.weight` / `.alpha`, `diffusion_model.<original name>`,
//!   `lora_te1_` (CLIP) and `lora_te2_` (T5) text-encoder keys; Qwen-Image's
//!   `lora_unet_transformer_blocks_0_attn_to_q`.
//! - **The original (BFL) layout** with `lora_A` / `lora_B`:
//!   `diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight`.
//! - **XLabs**: `double_blocks.0.processor.qkv_lora1.down.weight`.
//!
//! Fused modules of the original layout map as Diffusers converts them ([`names`]): the
//! down-projection is shared by the parts and the up-projection's rows split (q, k, v in
//! thirds; a single block's `linear1` in three parts of the hidden size and the MLP rest;
//! the final modulation's halves swapped).
//!
//! The scale is `alpha / rank` where the file gives an alpha, else 1 (Diffusers folds the
//! same factor into kohya weights; the product is the same). Where DDO differs from
//! Diffusers 0.40 on purpose: kohya weights on the embedders and the final layer are
//! applied (Diffusers drops them for want of a prefix), the original layout with
//! `lora_A`/`lora_B` loads (Diffusers loads nothing), T5 keys load (Diffusers drops them),
//! and an alpha beside Qwen-Image `lora_A`/`lora_B` weights is kept. BFL Control and
//! fal Kontext LoRAs, "mixture" files, DoRA and LoRA biases are refused with a typed error
//! naming what the file holds.

pub mod apply;
pub mod names;

pub use apply::{apply_loras, set_pipeline_loras};

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

use ddo_core::{Checkpoint, DType};

use crate::error::{LoadError, LoadResult};
use names::Split;

/// A LoRA file's layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraFormat {
    /// Diffusers / PEFT (`lora_A` / `lora_B` under the component's prefix); AI-toolkit too.
    Diffusers,
    /// kohya / sd-scripts (`lora_unet_…lora_down` / `lora_up` / `alpha`), ComfyUI's saves.
    Kohya,
    /// The original (BFL) Flux layout with `lora_A` / `lora_B`.
    Original,
    /// XLabs (`double_blocks.N.processor.qkv_lora1.down`).
    XLabs,
}

impl LoraFormat {
    /// The name `ddo inspect` prints.
    pub fn as_str(self) -> &'static str {
        match self {
            LoraFormat::Diffusers => "diffusers/peft",
            LoraFormat::Kohya => "kohya/sd-scripts",
            LoraFormat::Original => "original (bfl/comfyui)",
            LoraFormat::XLabs => "xlabs",
        }
    }
}

impl fmt::Display for LoraFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One matrix of a LoRA module, as stored (row-major, little-endian).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraTensor {
    /// Element type (f32, f16 or bf16).
    pub dtype: DType,
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// `rows × cols` elements.
    pub bytes: Vec<u8>,
}

impl LoraTensor {
    /// The values as f32.
    pub fn to_f32(&self) -> LoadResult<Vec<f32>> {
        self.dtype.decode_f32(&self.bytes).map_err(LoadError::Core)
    }

    /// Rows `start..start + len`.
    fn rows_of(&self, start: usize, len: usize) -> Self {
        let row = self.cols * self.dtype.size_in_bytes();
        Self {
            dtype: self.dtype,
            rows: len,
            cols: self.cols,
            bytes: self.bytes[start * row..(start + len) * row].to_vec(),
        }
    }

    /// The two halves of the rows swapped.
    fn halves_swapped(&self) -> Self {
        let half = self.rows / 2;
        let row = self.cols * self.dtype.size_in_bytes();
        let mut bytes = self.bytes[half * row..].to_vec();
        bytes.extend_from_slice(&self.bytes[..half * row]);
        Self {
            bytes,
            ..self.clone()
        }
    }
}

/// One adapted linear: `ΔW = scale · B A`.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraModule {
    /// The component it adapts: `transformer`, `text_encoder` (CLIP) or `text_encoder_2`
    /// (T5).
    pub component: &'static str,
    /// The adapted module, as the component's leaves are named
    /// (`transformer_blocks.0.attn.to_q`).
    pub module: String,
    /// The down-projection `A [rank, in]`.
    pub down: LoraTensor,
    /// The up-projection `B [out, rank]`.
    pub up: LoraTensor,
    /// `alpha / rank`, or 1 without an alpha.
    pub scale: f32,
}

impl LoraModule {
    /// The rank.
    pub fn rank(&self) -> usize {
        self.down.rows
    }

    /// Input features of the adapted linear.
    pub fn in_features(&self) -> usize {
        self.down.cols
    }

    /// Output features of the adapted linear.
    pub fn out_features(&self) -> usize {
        self.up.rows
    }

    /// Bytes of its two matrices.
    pub fn bytes(&self) -> u64 {
        (self.down.bytes.len() + self.up.bytes.len()) as u64
    }
}

/// The model family a LoRA's modules fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraFamily {
    /// FLUX.1 (double and single blocks).
    Flux,
    /// Qwen-Image.
    QwenImage,
    /// Only module names both transformers have (attention projections).
    FluxOrQwenImage,
}

impl LoraFamily {
    /// The name `ddo inspect` prints.
    pub fn as_str(self) -> &'static str {
        match self {
            LoraFamily::Flux => "flux",
            LoraFamily::QwenImage => "qwen-image",
            LoraFamily::FluxOrQwenImage => "flux or qwen-image",
        }
    }
}

/// A LoRA file read into [`LoraModule`]s (see the [module docs](self)).
#[derive(Debug, Clone)]
pub struct LoraFile {
    /// The file.
    pub path: PathBuf,
    /// Its layout.
    pub format: LoraFormat,
    /// The adapted modules, sorted by component and module name.
    pub modules: Vec<LoraModule>,
    /// Source modules that match no layer of the models DDO runs, kept out of `modules`
    /// ([`LoraFile::open_allowing_unmatched`]; [`LoraFile::open`] refuses a file with any).
    pub unmatched: Vec<String>,
}

/// One source module of a file: its down and up keys and its alpha key, if any.
#[derive(Debug, Default)]
struct Pair {
    down: Option<String>,
    up: Option<String>,
    alpha: Option<String>,
}

/// Where a source module goes: its component, its targets and how its up rows split.
type Target = (&'static str, Vec<String>, Split);

impl LoraFile {
    /// Whether `ckpt`'s keys look like a LoRA file of any format DDO reads (for `ddo
    /// inspect`, which then reads it with [`LoraFile::open`]).
    pub fn looks_like_lora(ckpt: &Checkpoint) -> bool {
        ckpt.names().any(|k| {
            k.contains(".lora_A.")
                || k.contains(".lora_B.")
                || k.contains(".lora_down.")
                || k.contains(".lora_up.")
                || (k.contains(".processor.") && k.contains("_lora"))
        })
    }

    /// Reads `path`: detects its format, maps every module to the modules DDO's models
    /// name, and checks shapes, ranks, dtypes and alphas. Errors are
    /// [`LoadError::Lora`] naming the file and what is wrong (or the format it holds that
    /// DDO does not read).
    pub fn open(path: &Path) -> LoadResult<Self> {
        Self::read(path, false)
    }

    /// [`LoraFile::open`], keeping a file some of whose modules match no layer of the models
    /// DDO runs: those are listed in [`LoraFile::unmatched`] (`--lora-allow-unmatched`).
    pub fn open_allowing_unmatched(path: &Path) -> LoadResult<Self> {
        Self::read(path, true)
    }

    fn read(path: &Path, allow_unmatched: bool) -> LoadResult<Self> {
        let ckpt = Checkpoint::open(path).map_err(LoadError::Core)?;
        let bad = |problem: String| LoadError::Lora {
            file: path.to_path_buf(),
            problem,
        };
        let keys: Vec<String> = ckpt.names().map(str::to_string).collect();
        if let Some((name, dtype)) = ckpt.unsupported().next() {
            return Err(bad(format!(
                "tensor `{name}` has dtype {dtype}; LoRA weights are f32, f16 or bf16"
            )));
        }
        let any = |f: &dyn Fn(&str) -> bool| keys.iter().any(|k| f(k));
        if any(&|k| k.contains("dora_scale") || k.contains("lora_magnitude_vector")) {
            return Err(bad(
                "it is a DoRA (magnitude vectors), which DDO does not apply".into(),
            ));
        }
        if any(&|k| k.contains("query_norm.scale")) {
            return Err(bad(
                "it is a BFL Flux Control LoRA (it replaces norm scales and widens img_in), which DDO does not apply"
                    .into(),
            ));
        }
        if any(&|k| k.starts_with("base_model.")) {
            return Err(bad(
                "it is a fal Kontext LoRA (`base_model.` keys), which DDO does not read".into(),
            ));
        }
        if any(&|k| k.starts_with("lora_transformer_")) {
            return Err(bad(
                "it is a \"mixture\" LoRA (`lora_transformer_` keys), which DDO does not read"
                    .into(),
            ));
        }
        if any(&|k| k.contains(".lora_B.bias") || k.contains(".lora_up.bias")) {
            return Err(bad(
                "its up-projections have biases, which DDO does not apply".into(),
            ));
        }
        let format = if any(&|k| k.contains(".lora_down.weight") || k.contains(".lora_up.weight")) {
            if any(&|k| k.starts_with("transformer.") || k.starts_with("text_encoder")) {
                LoraFormat::Diffusers
            } else {
                LoraFormat::Kohya
            }
        } else if any(&|k| k.contains(".processor.") && k.contains("_lora")) {
            LoraFormat::XLabs
        } else if any(&|k| k.contains(".lora_A.") || k.contains(".lora_B.")) {
            let original = |k: &str| {
                let k = k.strip_prefix("diffusion_model.").unwrap_or(k);
                [
                    "double_blocks.",
                    "single_blocks.",
                    "final_layer.",
                    "img_in.",
                    "txt_in.",
                ]
                .iter()
                .any(|p| k.starts_with(p))
            };
            if any(&|k| original(k)) {
                LoraFormat::Original
            } else {
                LoraFormat::Diffusers
            }
        } else {
            return Err(bad(
                "no LoRA keys: expected `lora_A`/`lora_B` (Diffusers, PEFT, AI-toolkit, original layout), \
                 `lora_down`/`lora_up` (kohya, ComfyUI) or XLabs `processor` keys"
                    .into(),
            ));
        };
        // Source modules by name: down, up and alpha keys.
        let mut pairs: BTreeMap<String, Pair> = BTreeMap::new();
        for k in &keys {
            let k_clean = k.replace(".default.", ".");
            let (module, role) = split_key(&k_clean, format)
                .ok_or_else(|| bad(format!("key `{k}` is not a {format} LoRA key")))?;
            let p = pairs.entry(module).or_default();
            let slot = match role {
                Role::Down => &mut p.down,
                Role::Up => &mut p.up,
                Role::Alpha => &mut p.alpha,
            };
            *slot = Some(k.clone());
        }
        let mut modules = Vec::new();
        let mut unknown = Vec::new();
        for (source, pair) in &pairs {
            let (Some(down_key), Some(up_key)) = (&pair.down, &pair.up) else {
                return Err(bad(format!(
                    "module `{source}` has {} but no {}",
                    if pair.down.is_some() {
                        "a down-projection"
                    } else if pair.up.is_some() {
                        "an up-projection"
                    } else {
                        "an alpha"
                    },
                    if pair.down.is_none() {
                        "down-projection (lora_A / lora_down)"
                    } else {
                        "up-projection (lora_B / lora_up)"
                    }
                )));
            };
            let Some((component, targets, split)) = target_of(source, format) else {
                unknown.push(source.clone());
                continue;
            };
            let down = matrix(&ckpt, down_key).map_err(&bad)?;
            let up = matrix(&ckpt, up_key).map_err(&bad)?;
            if down.rows != up.cols || down.rows == 0 {
                return Err(bad(format!(
                    "module `{source}`: the down-projection has rank {} and the up-projection {}",
                    down.rows, up.cols
                )));
            }
            let scale = match &pair.alpha {
                Some(a) => alpha(&ckpt, a).map_err(&bad)? / down.rows as f32,
                None => 1.0,
            };
            let parts: Vec<(usize, usize)> = match split {
                Split::Whole | Split::SwapHalves => vec![(0, up.rows)],
                Split::Thirds if up.rows % 3 == 0 => {
                    let n = up.rows / 3;
                    (0..3).map(|j| (j * n, n)).collect()
                }
                Split::QkvMlp if up.rows > 3 * down.cols => {
                    let h = down.cols;
                    vec![(0, h), (h, h), (2 * h, h), (3 * h, up.rows - 3 * h)]
                }
                _ => {
                    return Err(bad(format!(
                        "module `{source}`: its up-projection's {} rows do not split over {} (input width {})",
                        up.rows,
                        targets.join(", "),
                        down.cols
                    )));
                }
            };
            if split == Split::SwapHalves && up.rows % 2 != 0 {
                return Err(bad(format!(
                    "module `{source}`: {} rows do not split into shift and scale halves",
                    up.rows
                )));
            }
            for (target, (start, len)) in targets.into_iter().zip(parts) {
                let part = if split == Split::SwapHalves {
                    up.halves_swapped()
                } else {
                    up.rows_of(start, len)
                };
                modules.push(LoraModule {
                    component,
                    module: target,
                    down: down.clone(),
                    up: part,
                    scale,
                });
            }
        }
        // Allowed: a file with at least one module that matches keeps the others listed.
        if !unknown.is_empty() && (!allow_unmatched || modules.is_empty()) {
            return Err(bad(format!(
                "{} module(s) match no layer of Flux, Qwen-Image, CLIP or T5 (e.g. {}); \
                 it may be a LoRA for another model (--lora-allow-unmatched applies the rest)",
                unknown.len(),
                unknown
                    .iter()
                    .take(3)
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        if modules.is_empty() {
            return Err(bad("it holds no LoRA module".into()));
        }
        modules.sort_by(|a, b| (a.component, &a.module).cmp(&(b.component, &b.module)));
        if let Some(w) = modules
            .windows(2)
            .find(|w| (w[0].component, &w[0].module) == (w[1].component, &w[1].module))
        {
            return Err(bad(format!(
                "module `{}` is adapted twice (two keys name it)",
                w[0].module
            )));
        }
        Ok(Self {
            path: path.to_path_buf(),
            format,
            modules,
            unmatched: unknown,
        })
    }

    /// The family the transformer modules fit (`None`: no transformer module).
    pub fn family(&self) -> Option<LoraFamily> {
        let mut flux = false;
        let mut qwen = false;
        let mut any = false;
        for m in self.modules.iter().filter(|m| m.component == "transformer") {
            any = true;
            let n = m.module.as_str();
            flux |= n.starts_with("single_transformer_blocks.")
                || n.contains(".ff.net.")
                || n.contains(".ff_context.")
                || n.contains(".norm1")
                || n.starts_with("x_embedder")
                || n.starts_with("context_embedder")
                || n.starts_with("time_text_embed.text_embedder")
                || n.starts_with("time_text_embed.guidance_embedder");
            qwen |= n.contains(".img_mlp.")
                || n.contains(".txt_mlp.")
                || n.contains(".img_mod.")
                || n.contains(".txt_mod.")
                || n == "img_in"
                || n == "txt_in";
        }
        match (any, flux, qwen) {
            (false, ..) => None,
            (_, true, false) => Some(LoraFamily::Flux),
            (_, false, true) => Some(LoraFamily::QwenImage),
            _ => Some(LoraFamily::FluxOrQwenImage),
        }
    }

    /// Ranks and how many modules have each.
    pub fn ranks(&self) -> BTreeMap<usize, usize> {
        let mut r = BTreeMap::new();
        for m in &self.modules {
            *r.entry(m.rank()).or_insert(0) += 1;
        }
        r
    }

    /// What `ddo inspect FILE` prints for a LoRA: format, family, ranks, scales, the
    /// components and the kinds of module it adapts.
    pub fn format_text(&self) -> String {
        let mut s = format!(
            "{}: LoRA, {} format, fits {}\n",
            self.path.display(),
            self.format,
            self.family()
                .map_or("text encoders only", LoraFamily::as_str)
        );
        let ranks: Vec<String> = self
            .ranks()
            .iter()
            .map(|(r, n)| format!("{r} ({n} modules)"))
            .collect();
        s += &format!("  rank: {}\n", ranks.join(", "));
        if !self.unmatched.is_empty() {
            s += &format!("  unmatched (not applied): {}\n", self.unmatched.join(", "));
        }
        let scales: BTreeSet<String> = self
            .modules
            .iter()
            .map(|m| format!("{}", m.scale))
            .collect();
        s += &format!(
            "  scale (alpha / rank): {}\n",
            scales.into_iter().collect::<Vec<_>>().join(", ")
        );
        let mut by_component: BTreeMap<&str, (usize, u64, BTreeSet<String>)> = BTreeMap::new();
        for m in &self.modules {
            let e = by_component.entry(m.component).or_default();
            e.0 += 1;
            e.1 += m.bytes();
            e.2.insert(module_kind(&m.module));
        }
        for (c, (n, bytes, kinds)) in by_component {
            s += &format!(
                "  {c}: {n} modules, {}: {}\n",
                ddo_metrics::format_bytes(bytes),
                kinds.into_iter().collect::<Vec<_>>().join(", ")
            );
        }
        s
    }
}

/// A module name without its block index (`transformer_blocks.*.attn.to_q`).
fn module_kind(module: &str) -> String {
    module
        .split('.')
        .map(|p| if p.parse::<usize>().is_ok() { "*" } else { p })
        .collect::<Vec<_>>()
        .join(".")
}

/// What a key holds.
#[derive(Clone, Copy)]
enum Role {
    Down,
    Up,
    Alpha,
}

/// A key's source module name and role in `format`.
fn split_key(key: &str, format: LoraFormat) -> Option<(String, Role)> {
    let suffixes: &[(&str, Role)] = match format {
        LoraFormat::Diffusers | LoraFormat::Original => &[
            (".lora_A.weight", Role::Down),
            (".lora_B.weight", Role::Up),
            (".lora_down.weight", Role::Down),
            (".lora_up.weight", Role::Up),
            (".alpha", Role::Alpha),
        ],
        LoraFormat::Kohya => &[
            (".lora_down.weight", Role::Down),
            (".lora_up.weight", Role::Up),
            (".alpha", Role::Alpha),
        ],
        LoraFormat::XLabs => &[(".down.weight", Role::Down), (".up.weight", Role::Up)],
    };
    suffixes
        .iter()
        .find_map(|(suffix, role)| key.strip_suffix(suffix).map(|m| (m.to_string(), *role)))
}

/// Where source module `name` of `format` goes, or `None` for a name no model of DDO's has.
fn target_of(name: &str, format: LoraFormat) -> Option<Target> {
    let whole = |component, m: String| Some((component, vec![m], Split::Whole));
    let original = |dotted: &str| names::flux_original(dotted).map(|(t, s)| ("transformer", t, s));
    match format {
        LoraFormat::Diffusers => {
            for (prefix, component) in [
                ("transformer.", "transformer"),
                ("text_encoder_2.", "text_encoder_2"),
                ("text_encoder.", "text_encoder"),
            ] {
                if let Some(m) = name.strip_prefix(prefix) {
                    return whole(component, m.to_string());
                }
            }
            // Keys saved from the bare model carry no component prefix.
            whole("transformer", name.to_string())
        }
        LoraFormat::Original => original(name.strip_prefix("diffusion_model.").unwrap_or(name)),
        LoraFormat::XLabs => {
            let n = name.strip_prefix("diffusion_model.").unwrap_or(name);
            let (head, processor) = n.split_once(".processor.")?;
            let dotted = match processor {
                "qkv_lora1" => format!("{head}.img_attn.qkv"),
                "proj_lora1" => format!("{head}.img_attn.proj"),
                "qkv_lora2" => format!("{head}.txt_attn.qkv"),
                "proj_lora2" => format!("{head}.txt_attn.proj"),
                // A single block's q, k, v only: three equal parts, no MLP input.
                "qkv_lora" => {
                    let i = head.strip_prefix("single_blocks.")?;
                    let b = format!("single_transformer_blocks.{}", i.parse::<usize>().ok()?);
                    return Some((
                        "transformer",
                        vec![
                            format!("{b}.attn.to_q"),
                            format!("{b}.attn.to_k"),
                            format!("{b}.attn.to_v"),
                        ],
                        Split::Thirds,
                    ));
                }
                "proj_lora" => format!("{head}.linear2"),
                _ => return None,
            };
            original(&dotted)
        }
        LoraFormat::Kohya => {
            if let Some(n) = name.strip_prefix("diffusion_model.") {
                // ComfyUI: the original Flux names, or Qwen-Image's (Diffusers') names.
                return original(n).or_else(|| {
                    n.starts_with("transformer_blocks.")
                        .then(|| whole("transformer", n.to_string()))
                        .flatten()
                });
            }
            if let Some(n) = name.strip_prefix("text_encoders.clip_l.transformer.") {
                return whole("text_encoder", n.to_string());
            }
            if let Some(n) = name.strip_prefix("text_encoders.t5xxl.transformer.") {
                return whole("text_encoder_2", n.to_string());
            }
            if let Some(n) = name.strip_prefix("lora_unet_") {
                if let Some(dotted) = names::kohya_flux_to_original(n) {
                    return original(&dotted);
                }
                return names::kohya_qwen(n).and_then(|m| whole("transformer", m));
            }
            if let Some(n) = name
                .strip_prefix("lora_te1_")
                .or_else(|| name.strip_prefix("lora_te_"))
            {
                return names::kohya_clip(n).and_then(|m| whole("text_encoder", m));
            }
            if let Some(n) = name.strip_prefix("lora_te2_") {
                return names::kohya_t5(n).and_then(|m| whole("text_encoder_2", m));
            }
            None
        }
    }
}

/// Tensor `key` as a 2-D LoRA matrix (a 4-D `[out, in, 1, 1]` one is taken as 2-D).
fn matrix(ckpt: &Checkpoint, key: &str) -> Result<LoraTensor, String> {
    let t = ckpt.tensor(key).map_err(|e| e.to_string())?;
    if !matches!(t.dtype, DType::F32 | DType::F16 | DType::BF16) {
        return Err(format!(
            "tensor `{key}` is {}; LoRA weights are f32, f16 or bf16",
            t.dtype
        ));
    }
    let (rows, cols) = match t.shape.as_slice() {
        [r, c] => (*r, *c),
        [r, c, 1, 1] => (*r, *c),
        other => {
            return Err(format!(
                "tensor `{key}` has shape {other:?}; a LoRA matrix is 2-D"
            ));
        }
    };
    let raw = ckpt
        .raw(key)
        .ok_or_else(|| format!("tensor `{key}` cannot be read"))?;
    // Bit tests on the stored bits first; the values are decoded only to name a bad one.
    if ddo_core::values::count_non_finite(t.dtype, raw.bytes) > 0 {
        let values = t.dtype.decode_f32(raw.bytes).map_err(|e| e.to_string())?;
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            return Err(format!(
                "tensor `{key}` holds {} at element {i}; a LoRA's factors are finite",
                values[i]
            ));
        }
    }
    Ok(LoraTensor {
        dtype: t.dtype,
        rows,
        cols,
        bytes: raw.bytes.to_vec(),
    })
}

/// The alpha in tensor `key`: one finite, positive value.
fn alpha(ckpt: &Checkpoint, key: &str) -> Result<f32, String> {
    let t = ckpt.tensor(key).map_err(|e| e.to_string())?;
    let raw = ckpt
        .raw(key)
        .ok_or_else(|| format!("tensor `{key}` cannot be read"))?;
    let values = t.dtype.decode_f32(raw.bytes).map_err(|e| e.to_string())?;
    match values.as_slice() {
        [a] if a.is_finite() && *a > 0.0 => Ok(*a),
        _ => Err(format!(
            "alpha `{key}` is {values:?}; an alpha is one finite positive value"
        )),
    }
}
