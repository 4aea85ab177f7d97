//! Where a model's params come from: [`CheckpointWeights`] (Diffusers-format safetensors,
//! single file or sharded with its index, memory-mapped, so params stay checkpoint-backed
//! unless a dtype conversion makes an owned copy) and [`RandomWeights`] (seeded, any config,
//! for benchmarks and tests).

use std::collections::{BTreeMap, HashMap};
use std::path::{Component as PathComponent, Path, PathBuf};
use std::sync::Arc;

use ddo_core::reference::SplitMix64;
use ddo_core::{Checkpoint, CoreError, DType, HostBuffer, Param, ParamKind, UniqueMap};

use crate::error::{LoadError, LoadResult};

/// A supplier of params by name.
pub trait WeightSource {
    /// The param `name` with `shape`, stored in the source's dtype.
    fn param(&mut self, name: &str, shape: &[usize], kind: ParamKind) -> LoadResult<Arc<Param>>;

    /// Whether the source has a param named `name`.
    fn contains(&self, name: &str) -> bool;

    /// The first of `names` the source has (for checkpoints written under older names).
    fn param_any(
        &mut self,
        names: &[&str],
        shape: &[usize],
        kind: ParamKind,
    ) -> LoadResult<Arc<Param>> {
        let name = names
            .iter()
            .find(|n| self.contains(n))
            .or(names.first())
            .copied()
            .unwrap_or_default();
        self.param(name, shape, kind)
    }
}

/// Seeded random weights at any shape: 2-D and larger weights uniform in ±1/√fan_in,
/// 1-D `weight`s near 1, biases and other 1-D params near 0.
#[derive(Debug, Clone)]
pub struct RandomWeights {
    rng: SplitMix64,
    dtype: DType,
    made: u64,
}

impl RandomWeights {
    /// A source seeded with `seed`, storing params as `dtype`.
    pub fn new(seed: u64, dtype: DType) -> Self {
        Self {
            rng: SplitMix64::new(seed),
            dtype,
            made: 0,
        }
    }

    /// Bytes of params made so far.
    pub fn bytes_made(&self) -> u64 {
        self.made
    }
}

impl WeightSource for RandomWeights {
    fn param(&mut self, name: &str, shape: &[usize], kind: ParamKind) -> LoadResult<Arc<Param>> {
        let n: usize = shape.iter().product();
        let fan_in: usize = shape.iter().skip(1).product::<usize>().max(1);
        let scale = 1.0 / (fan_in as f32).sqrt();
        let one_d_weight = shape.len() == 1 && name.ends_with("weight");
        let values: Vec<f32> = (0..n)
            .map(|_| {
                let u = self.rng.next_signed();
                if shape.len() >= 2 {
                    u * scale
                } else if one_d_weight {
                    1.0 + 0.1 * u
                } else {
                    0.1 * u
                }
            })
            .collect();
        let p = Param::from_f32(name, kind, self.dtype, shape.to_vec(), &values)?;
        self.made += p.nbytes() as u64;
        Ok(p)
    }

    fn contains(&self, _name: &str) -> bool {
        true
    }
}

/// Weights from safetensors files, memory-mapped.
#[derive(Debug)]
pub struct CheckpointWeights {
    files: Vec<Checkpoint>,
    location: HashMap<String, usize>,
    target: Option<DType>,
    origin: PathBuf,
}

/// File names a Diffusers or Transformers model folder keeps its weights under.
pub const WEIGHT_FILES: [&str; 2] = ["diffusion_pytorch_model.safetensors", "model.safetensors"];

/// Index file names of sharded checkpoints.
pub const INDEX_FILES: [&str; 2] = [
    "diffusion_pytorch_model.safetensors.index.json",
    "model.safetensors.index.json",
];

fn open_checkpoint(path: &Path) -> LoadResult<Checkpoint> {
    Checkpoint::open(path).map_err(|e| match e {
        CoreError::Io { path, source } => LoadError::Io { path, source },
        CoreError::Checkpoint { path, message } => LoadError::CorruptFile {
            file: path,
            message,
        },
        other => LoadError::Core(other),
    })
}

impl CheckpointWeights {
    /// Opens one safetensors file. `target` converts every param to that dtype on load
    /// (an owned copy); `None` keeps the file's dtype and the params checkpoint-backed.
    pub fn open_file(path: &Path, target: Option<DType>) -> LoadResult<Self> {
        let ckpt = open_checkpoint(path)?;
        let location = ckpt
            .names()
            .chain(ckpt.unsupported().map(|(n, _)| n))
            .map(|n| (n.to_string(), 0))
            .collect();
        Ok(Self {
            files: vec![ckpt],
            location,
            target,
            origin: path.to_path_buf(),
        })
    }

    /// Opens a sharded checkpoint from its index (`weight_map`: tensor → shard file in the
    /// same folder). Shard names must be plain file names inside the folder.
    pub fn open_index(index: &Path, target: Option<DType>) -> LoadResult<Self> {
        let bad = |message: String| LoadError::BadIndex {
            file: index.to_path_buf(),
            message,
        };
        let text = std::fs::read_to_string(index).map_err(|source| LoadError::Io {
            path: index.to_path_buf(),
            source,
        })?;
        // Other fields (`metadata`) are ignored; a tensor named twice is refused.
        #[derive(serde::Deserialize)]
        struct IndexFile {
            weight_map: Option<UniqueMap>,
        }
        let json: IndexFile = serde_json::from_str(&text).map_err(|e| {
            if e.classify() == serde_json::error::Category::Data {
                bad(format!(
                    "`weight_map` is not an object of tensor name -> shard file with unique names: {e}"
                ))
            } else {
                bad(format!("not JSON: {e}"))
            }
        })?;
        let map = json
            .weight_map
            .ok_or_else(|| bad("no `weight_map` object".into()))?;
        let dir = index.parent().unwrap_or(Path::new("."));
        let mut shard_ids: BTreeMap<String, usize> = BTreeMap::new();
        let mut files = Vec::new();
        let mut location = HashMap::new();
        for (tensor, shard) in &map.0 {
            let shard = shard
                .as_str()
                .ok_or_else(|| bad(format!("shard of `{tensor}` is not a string")))?;
            let plain = Path::new(shard)
                .components()
                .all(|c| matches!(c, PathComponent::Normal(_)));
            if !plain || shard.is_empty() {
                return Err(bad(format!(
                    "shard `{shard}` of `{tensor}` is not a file name inside {}",
                    dir.display()
                )));
            }
            let id = match shard_ids.get(shard) {
                Some(id) => *id,
                None => {
                    let path = dir.join(shard);
                    if !path.is_file() {
                        return Err(bad(format!(
                            "shard `{shard}` (for `{tensor}`) does not exist"
                        )));
                    }
                    files.push(open_checkpoint(&path)?);
                    shard_ids.insert(shard.to_string(), files.len() - 1);
                    files.len() - 1
                }
            };
            let holds = files[id].tensor(tensor).is_ok()
                || files[id].unsupported().any(|(n, _)| n == tensor);
            if !holds {
                return Err(bad(format!(
                    "`{tensor}` is mapped to `{shard}`, which does not hold it"
                )));
            }
            location.insert(tensor.clone(), id);
        }
        Ok(Self {
            files,
            location,
            target,
            origin: index.to_path_buf(),
        })
    }

    /// Opens a model folder: a sharded index if there is one, else a single weight file.
    pub fn open_dir(dir: &Path, target: Option<DType>) -> LoadResult<Self> {
        for index in INDEX_FILES {
            let p = dir.join(index);
            if p.is_file() {
                return Self::open_index(&p, target);
            }
        }
        for file in WEIGHT_FILES {
            let p = dir.join(file);
            if p.is_file() {
                return Self::open_file(&p, target);
            }
        }
        Err(LoadError::NoWeights {
            dir: dir.to_path_buf(),
            expected: WEIGHT_FILES
                .iter()
                .chain(INDEX_FILES.iter())
                .copied()
                .collect::<Vec<_>>()
                .join(", "),
        })
    }

    /// Tensor names, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.location.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    /// Drops the open checkpoints' own references to their mappings: afterwards only the
    /// params handed out keep a mapping alive.
    pub fn close(self) {}
}

impl WeightSource for CheckpointWeights {
    fn param(&mut self, name: &str, shape: &[usize], kind: ParamKind) -> LoadResult<Arc<Param>> {
        let Some(&id) = self.location.get(name) else {
            return Err(LoadError::MissingTensor {
                name: name.to_string(),
                file: self.origin.clone(),
            });
        };
        let ckpt = &self.files[id];
        let file = ckpt.path().to_path_buf();
        if let Some((_, dtype)) = ckpt.unsupported().find(|(n, _)| *n == name) {
            return Err(LoadError::UnsupportedDtype {
                name: name.to_string(),
                file,
                dtype: dtype.to_string(),
            });
        }
        let info = ckpt.tensor(name)?.clone();
        if info.shape != shape {
            return Err(LoadError::ShapeMismatch {
                name: name.to_string(),
                file,
                expected: shape.to_vec(),
                found: info.shape,
            });
        }
        if info.dtype.is_quantized() {
            return Err(LoadError::UnsupportedDtype {
                name: name.to_string(),
                file,
                dtype: "u8/i8 (quantized)".into(),
            });
        }
        match self.target {
            Some(t) if t != info.dtype => {
                let host = ckpt.host_buffer(name)?;
                let values = host.with_bytes(|b| info.dtype.decode_f32(b))?;
                let bytes = t.encode_f32(&values)?;
                Ok(Param::new(
                    name,
                    kind,
                    t,
                    shape.to_vec(),
                    HostBuffer::pageable_from(&bytes).slice_all(),
                )?)
            }
            _ => Ok(Param::from_checkpoint(ckpt, name, name, kind)?),
        }
    }

    fn contains(&self, name: &str) -> bool {
        self.location.contains_key(name)
    }
}

/// Reads tensor `name` of the safetensors file at `path` as f32 values with its shape
/// (f32, f16 or bf16 in the file): for latents, embeddings and reference outputs.
pub fn read_f32_tensor(path: &Path, name: &str) -> LoadResult<(Vec<usize>, Vec<f32>)> {
    let ckpt = open_checkpoint(path)?;
    let info = ckpt.tensor(name).map_err(|_| LoadError::MissingTensor {
        name: name.to_string(),
        file: path.to_path_buf(),
    })?;
    if info.dtype.is_quantized() {
        return Err(LoadError::UnsupportedDtype {
            name: name.to_string(),
            file: path.to_path_buf(),
            dtype: "u8/i8".into(),
        });
    }
    let values = ckpt
        .host_buffer(name)?
        .with_bytes(|b| info.dtype.decode_f32(b))?;
    Ok((info.shape.clone(), values))
}
