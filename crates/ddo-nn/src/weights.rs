//! Where a model's params come from: [`CheckpointWeights`] (Diffusers-format safetensors,
//! single file or sharded with its index, memory-mapped, so params stay checkpoint-backed
//! unless a dtype conversion makes an owned copy) and [`RandomWeights`] (seeded, any config,
//! for benchmarks and tests).

use std::collections::{BTreeMap, HashMap};
use std::num::NonZeroUsize;
use std::path::{Component as PathComponent, Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use ddo_core::host_memory::AlignedBytes;
use ddo_core::rng::SplitMix64;
use ddo_core::tensor::byte_len;
use ddo_core::{Checkpoint, CoreError, DType, HostBuffer, Param, ParamKind, UniqueMap};
use half::{bf16, f16};

use crate::error::{LoadError, LoadResult};

mod guards;
mod views;

pub use views::{View, ViewKind};

/// A supplier of params by name.
pub trait WeightSource {
    /// The param `name` with `shape`, stored in the source's dtype.
    fn param(&mut self, name: &str, shape: &[usize], kind: ParamKind) -> LoadResult<Arc<Param>>;

    /// Whether the source has a param named `name`.
    fn contains(&self, name: &str) -> bool;

    /// Whether the params' bytes hold the source's values: false for
    /// [`RandomWeights::unwritten`], whose params are planning shapes, so a wrapper such as
    /// [`crate::fp8::Fp8Storage`] reads none of them and writes none of its own.
    fn writes_values(&self) -> bool {
        true
    }

    /// The param `name` of `shape` `[out, in, kh, kw]`, taken from a causal 3-D convolution's
    /// weight `[out, in, frames, kh, kw]` at its last temporal slice: what such a convolution
    /// computes on one frame whose causal padding is zeros (Qwen-Image's VAE). A checkpoint
    /// reads it through [`ViewKind::LastTimeSlice`]; the default asks [`WeightSource::param`]
    /// for the 2-D weight itself (sources that make params at any shape, such as
    /// [`RandomWeights`]).
    fn last_time_slice(
        &mut self,
        name: &str,
        shape: &[usize],
        frames: usize,
        kind: ParamKind,
    ) -> LoadResult<Arc<Param>> {
        let _ = frames;
        self.param(name, shape, kind)
    }

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
/// 1-D `weight`s near 1 (uniform in 1 ± 0.1), biases and other 1-D params near 0 (uniform
/// in ±0.1).
///
/// Each param draws one 64-bit seed from the source's SplitMix64 and is filled in chunks of
/// [`RANDOM_CHUNK_ELEMS`] elements, each from its own SplitMix64 seeded from (param seed,
/// chunk index), written straight into the dtype's bytes (f32, or f16/bf16 rounded to
/// nearest even as [`DType::encode_f32`] rounds). Params larger than a chunk are filled on
/// all available cores; the values depend only on the seed, the dtype and the sequence of
/// params asked for, never on the number of threads.
///
/// [`RandomWeights::unwritten`] makes the same params without values, for planning.
#[derive(Debug, Clone)]
pub struct RandomWeights {
    rng: SplitMix64,
    dtype: DType,
    made: u64,
    /// False for [`RandomWeights::unwritten`].
    values: bool,
}

/// Elements per independently seeded chunk of a [`RandomWeights`] param (1 Mi).
pub const RANDOM_CHUNK_ELEMS: usize = 1 << 20;

impl RandomWeights {
    /// A source seeded with `seed`, storing params as `dtype`.
    pub fn new(seed: u64, dtype: DType) -> Self {
        Self {
            rng: SplitMix64::new(seed),
            dtype,
            made: 0,
            values: true,
        }
    }

    /// A source of params as `dtype` whose bytes are never written: each param has its
    /// shape, dtype and size, over zero pages no one touches (a large one is a mapping of
    /// its own, [`AlignedBytes::zeroed`]), so a model of any size costs address space, not
    /// memory. For planning (what routes and the memory plan read: shapes and bytes); a
    /// model built from it computes on zeros.
    pub fn unwritten(dtype: DType) -> Self {
        Self {
            values: false,
            ..Self::new(0, dtype)
        }
    }

    /// Bytes of params made so far.
    pub fn bytes_made(&self) -> u64 {
        self.made
    }

    /// The param `name` of `shape`, filled by up to `threads` threads.
    fn make(
        &mut self,
        name: &str,
        shape: &[usize],
        kind: ParamKind,
        threads: Option<usize>,
    ) -> LoadResult<Arc<Param>> {
        let encoding = Encoding::of(self.dtype)?;
        let len = byte_len(shape, self.dtype)?;
        if !self.values {
            // Never written: the pages stay the kernel's zero pages until someone writes.
            let bytes = AlignedBytes::try_zeroed(len)?;
            let p = Param::new(
                name,
                kind,
                self.dtype,
                shape.to_vec(),
                HostBuffer::frozen(bytes, &format!("(unwritten random weights) {name}"))
                    .slice_all(),
            )?;
            self.made += p.nbytes() as u64;
            return Ok(p);
        }
        let seed = self.rng.next_u64();
        let spread = Spread::of(name, shape);
        let mut bytes = AlignedBytes::zeroed(len);
        let threads = match threads {
            Some(t) => t,
            None if len > RANDOM_CHUNK_ELEMS * self.dtype.size_in_bytes() => {
                std::thread::available_parallelism().map_or(1, NonZeroUsize::get)
            }
            None => 1,
        };
        fill_random(bytes.as_mut_slice(), encoding, spread, seed, threads);
        let p = Param::new(
            name,
            kind,
            self.dtype,
            shape.to_vec(),
            // Frozen: large params are read in place and page-locked in place for copies
            // like a checkpoint's (no pinned home to build), never written.
            HostBuffer::frozen(bytes, &format!("(random weights) {name}")).slice_all(),
        )?;
        self.made += p.nbytes() as u64;
        Ok(p)
    }
}

impl WeightSource for RandomWeights {
    fn param(&mut self, name: &str, shape: &[usize], kind: ParamKind) -> LoadResult<Arc<Param>> {
        self.make(name, shape, kind, None)
    }

    fn contains(&self, _name: &str) -> bool {
        true
    }

    fn writes_values(&self) -> bool {
        self.values
    }
}

/// Where a random param's values lie.
#[derive(Debug, Clone, Copy)]
enum Spread {
    /// Uniform in ±scale (2-D and larger: scale = 1/√fan_in).
    Weight(f32),
    /// Uniform in 1 ± 0.1 (1-D `weight`s: norm scales).
    NearOne,
    /// Uniform in ±0.1 (biases and other 1-D params).
    NearZero,
}

impl Spread {
    fn of(name: &str, shape: &[usize]) -> Self {
        if shape.len() >= 2 {
            let fan_in: usize = shape.iter().skip(1).product::<usize>().max(1);
            Spread::Weight(1.0 / (fan_in as f32).sqrt())
        } else if name.ends_with("weight") {
            Spread::NearOne
        } else {
            Spread::NearZero
        }
    }

    /// The value for `u` uniform in [-1, 1).
    fn value(self, u: f32) -> f32 {
        match self {
            Spread::Weight(scale) => u * scale,
            Spread::NearOne => 1.0 + 0.1 * u,
            Spread::NearZero => 0.1 * u,
        }
    }
}

/// The element encodings random params can be written in.
#[derive(Debug, Clone, Copy)]
enum Encoding {
    F32,
    F16,
    BF16,
}

impl Encoding {
    fn of(dtype: DType) -> Result<Self, CoreError> {
        match dtype {
            DType::F32 => Ok(Encoding::F32),
            DType::F16 => Ok(Encoding::F16),
            DType::BF16 => Ok(Encoding::BF16),
            other => Err(CoreError::Shape {
                what: "random weights".into(),
                message: format!("cannot make random float values as {other} storage"),
            }),
        }
    }
}

/// The generator of chunk `chunk` of the param seeded with `seed`: one SplitMix64 step over
/// the pair, so neighbouring chunks (and params) start far apart in the sequence.
fn chunk_rng(seed: u64, chunk: usize) -> SplitMix64 {
    let mut mix = SplitMix64::new(seed ^ (chunk as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93));
    SplitMix64::new(mix.next_u64())
}

/// Fills `bytes` with random values of `spread`, chunk by chunk, on up to `threads`
/// threads (the calling thread among them). The result does not depend on `threads`.
fn fill_random(bytes: &mut [u8], encoding: Encoding, spread: Spread, seed: u64, threads: usize) {
    let elem = match encoding {
        Encoding::F32 => 4,
        Encoding::F16 | Encoding::BF16 => 2,
    };
    let chunk_bytes = RANDOM_CHUNK_ELEMS * elem;
    let workers = threads.min(bytes.len().div_ceil(chunk_bytes));
    let chunks = bytes.chunks_mut(chunk_bytes).enumerate();
    if workers <= 1 {
        for (i, chunk) in chunks {
            fill_chunk(chunk, encoding, spread, chunk_rng(seed, i));
        }
        return;
    }
    let work = Mutex::new(chunks);
    let next = || work.lock().unwrap_or_else(PoisonError::into_inner).next();
    let run = || {
        while let Some((i, chunk)) = next() {
            fill_chunk(chunk, encoding, spread, chunk_rng(seed, i));
        }
    };
    std::thread::scope(|s| {
        for _ in 1..workers {
            s.spawn(run);
        }
        run();
    });
}

fn fill_chunk(out: &mut [u8], encoding: Encoding, spread: Spread, mut rng: SplitMix64) {
    let next = move || spread.value(rng.next_signed());
    // The same conversions as `DType::encode_f32` (round to nearest even).
    match encoding {
        Encoding::F32 => encode_each(out, next, f32::to_le_bytes),
        Encoding::F16 => encode_each(out, next, |v| f16::from_f32(v).to_le_bytes()),
        Encoding::BF16 => encode_each(out, next, |v| bf16::from_f32(v).to_le_bytes()),
    }
}

fn encode_each<const N: usize>(
    out: &mut [u8],
    mut next: impl FnMut() -> f32,
    encode: impl Fn(f32) -> [u8; N],
) {
    let (elements, rest) = out.as_chunks_mut::<N>();
    debug_assert!(rest.is_empty(), "a chunk holds whole elements");
    for e in elements {
        *e = encode(next());
    }
}

/// The most bytes a JSON or text file DDO reads (configs, indexes, tokenizer files) may
/// have: 64 MiB (a T5 `tokenizer.json` is about 2.4 MB).
pub const MAX_TEXT_FILE_BYTES: u64 = 64 << 20;

/// Whether anything is at `path`, a link (even a dangling one) included: the test for an
/// optional file (`model_index.json`, `scheduler/scheduler_config.json`, a component's
/// `config.json`). Something there is then read with [`read_text_file`], which refuses what
/// is not a regular file, so a directory or a FIFO in its place is an error naming it, never
/// taken as absent.
pub fn is_present(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok()
}

/// Reads a config, index or tokenizer file as text: only a regular file (a link is followed
/// to one; a FIFO, a device such as `/dev/zero` or a directory is refused, so nothing hangs
/// or reads without end) of at most [`MAX_TEXT_FILE_BYTES`].
pub fn read_text_file(path: &Path) -> LoadResult<String> {
    use std::io::Read;
    let io = |source: std::io::Error| LoadError::Io {
        path: path.to_path_buf(),
        source,
    };
    let invalid = |message: String| {
        io(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            message,
        ))
    };
    let file = ddo_core::host_memory::open_regular(path).map_err(|e| match e {
        ddo_core::host_memory::NotRegular::Io(source) => io(source),
        ddo_core::host_memory::NotRegular::Is(what) => {
            invalid(format!("is {what}, not a regular file"))
        }
    })?;
    let meta = file.metadata().map_err(io)?;
    if meta.len() > MAX_TEXT_FILE_BYTES {
        return Err(invalid(format!(
            "{} B, over the {MAX_TEXT_FILE_BYTES} B a config or tokenizer file may have",
            meta.len()
        )));
    }
    let mut text = String::new();
    file.take(MAX_TEXT_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(io)?;
    if text.len() as u64 > MAX_TEXT_FILE_BYTES {
        return Err(invalid(format!(
            "grew past the {MAX_TEXT_FILE_BYTES} B a config or tokenizer file may have while read"
        )));
    }
    Ok(text)
}

/// What a loader does with checkpoint tensors its config leaves unused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UnusedWeights {
    /// Refuse the checkpoint ([`LoadError::UnusedWeights`]): a config that disagrees with its
    /// weights would change the output without a word.
    #[default]
    Refuse,
    /// Load without them (`--allow-unused-weights`).
    Allow,
}

/// Weights from safetensors files, memory-mapped.
#[derive(Debug)]
pub struct CheckpointWeights {
    files: Vec<Checkpoint>,
    location: HashMap<String, usize>,
    target: Option<DType>,
    /// The dtype the unquantized float tensors of a GGUF file holding quantized ones are
    /// loaded as (bf16, what such a model computes in: Diffusers' GGUF linears cast the
    /// bias to their `compute_dtype`, and `torch_dtype` the other small tensors), where no
    /// `target` converts everything.
    gguf_floats: Option<DType>,
    origin: PathBuf,
    /// Tensors a model asked for.
    used: std::collections::HashSet<String>,
    /// Param names mapped onto the checkpoint's tensors, for a checkpoint in another
    /// layout ([`CheckpointWeights::with_views`]); `None`: names are the tensors'.
    views: Option<HashMap<String, View>>,
    /// The name prefixes the checkpoint's layout may put a tensor under
    /// ([`CheckpointWeights::set_layout_prefixes`]); a read tensor also present under
    /// another is refused.
    layout_prefixes: Vec<String>,
}

/// File names a Diffusers or Transformers model folder keeps its weights under.
pub const WEIGHT_FILES: [&str; 2] = ["diffusion_pytorch_model.safetensors", "model.safetensors"];

/// Index file names of sharded checkpoints.
pub const INDEX_FILES: [&str; 2] = [
    "diffusion_pytorch_model.safetensors.index.json",
    "model.safetensors.index.json",
];

/// Whether any param of `component` holds quantized blocks (a GGUF file's): such a model
/// computes in bf16, whatever its small tensors are stored as (Diffusers' GGUF
/// `compute_dtype`; city96's and QuantStack's files keep `img_in` in F32 or F16 beside
/// K-quants). The rule every model's compute dtype follows.
pub(crate) fn holds_quantized(component: &ddo_core::Component) -> bool {
    component
        .leaves()
        .iter()
        .flat_map(|l| l.params())
        .any(|(_, p)| p.quant().is_some())
}

/// Whether `path` names a GGUF file (by its `.gguf` extension, any case).
pub fn is_gguf(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// A GGUF file as a checkpoint: over its own mapping, quantized tensors kept as blocks
/// (`dequantize_into` none), or dequantized into that dtype as a safetensors checkpoint in
/// memory; its errors as [`open_checkpoint`]'s, a bad field as [`LoadError::CorruptFile`]
/// naming it.
fn open_gguf(path: &Path, dequantize_into: Option<DType>) -> LoadResult<Checkpoint> {
    ddo_core::gguf::GgufFile::open(path)
        .and_then(|f| match dequantize_into {
            None => Checkpoint::from_gguf(&f),
            Some(dtype) => ddo_core::gguf::dequantized_checkpoint(&f, dtype),
        })
        .map_err(gguf_error)
}

/// The `general.architecture` of the GGUF file `path` (`None` where it has none), its errors
/// as `open_gguf`'s.
pub fn gguf_architecture(path: &Path) -> LoadResult<Option<String>> {
    ddo_core::gguf::GgufFile::open(path)
        .map(|f| f.architecture().map(str::to_string))
        .map_err(gguf_error)
}

/// A GGUF reader's error as a load error: a bad field is [`LoadError::CorruptFile`] naming it.
fn gguf_error(e: CoreError) -> LoadError {
    match e {
        CoreError::Io { path, source } => LoadError::Io { path, source },
        CoreError::Gguf {
            path,
            field,
            problem,
        } => LoadError::CorruptFile {
            file: path,
            message: format!("{field} {problem}"),
        },
        other => LoadError::Core(other),
    }
}

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
    ///
    /// A `.gguf` file (llama.cpp's format: city96's Flux files hold the original layout's
    /// names) is read over its own mapping with no `target` ([`Checkpoint::from_gguf`]): its
    /// quantized tensors become params holding their blocks as stored, which routes move as
    /// bytes and the linears dequantize where they run. With a `target` it is dequantized at
    /// load into a safetensors checkpoint in memory
    /// ([`ddo_core::gguf::dequantized_checkpoint`]): into `target` where that is f32, f16 or
    /// bf16, else bf16, which an 8-bit `target` then converts as it converts any 16-bit file.
    pub fn open_file(path: &Path, target: Option<DType>) -> LoadResult<Self> {
        let mut gguf_floats = None;
        let (ckpt, target) = if is_gguf(path) {
            match target {
                None => {
                    let ckpt = open_gguf(path, None)?;
                    if ckpt
                        .names()
                        .any(|n| ckpt.tensor(n).is_ok_and(|t| t.quant.is_some()))
                    {
                        gguf_floats = Some(DType::BF16);
                    }
                    (ckpt, None)
                }
                Some(t) => {
                    let into = match t {
                        DType::F32 | DType::F16 | DType::BF16 => t,
                        _ => DType::BF16,
                    };
                    (open_gguf(path, Some(into))?, (t != into).then_some(t))
                }
            }
        } else {
            (open_checkpoint(path)?, target)
        };
        let location = ckpt
            .names()
            .chain(ckpt.unsupported().map(|(n, _)| n))
            .map(|n| (n.to_string(), 0))
            .collect();
        Ok(Self {
            files: vec![ckpt],
            location,
            target,
            gguf_floats,
            origin: path.to_path_buf(),
            used: Default::default(),
            views: None,
            layout_prefixes: Vec::new(),
        })
    }

    /// A model built by `build` from the checkpoint of model folder `dir` (see
    /// [`CheckpointWeights::open_dir`]), then [`CheckpointWeights::check_unused`] with
    /// `ignored` and `unused`: what every component loader does.
    pub fn build_in<T>(
        dir: &Path,
        dtype: Option<DType>,
        ignored: &[&str],
        unused: UnusedWeights,
        build: impl FnOnce(&mut Self) -> LoadResult<T>,
    ) -> LoadResult<T> {
        let mut weights = Self::open_dir(dir, dtype)?;
        let model = build(&mut weights)?;
        weights.check_unused(ignored, unused)?;
        Ok(model)
    }

    /// [`LoadError::UnusedWeights`] when the checkpoint holds tensors no model asked for
    /// (outside `ignored` prefixes) and `unused` is [`UnusedWeights::Refuse`].
    pub fn check_unused(&self, ignored: &[&str], unused: UnusedWeights) -> LoadResult<()> {
        let names = self.unused(ignored);
        if names.is_empty() || unused == UnusedWeights::Allow {
            return Ok(());
        }
        Err(LoadError::UnusedWeights {
            file: self.origin.clone(),
            count: names.len(),
            examples: names
                .iter()
                .take(3)
                .map(|n| format!("`{n}`"))
                .collect::<Vec<_>>()
                .join(", "),
        })
    }

    /// The checkpoint, when it is one file (not a sharded index).
    pub fn single_file(&self) -> Option<&Checkpoint> {
        match self.files.as_slice() {
            [one] => Some(one),
            _ => None,
        }
    }

    /// Tensors of the checkpoint no model asked for, except those under `ignored` name
    /// prefixes (parts a loader does not use by design, such as a VAE's encoder), sorted.
    pub fn unused(&self, ignored: &[&str]) -> Vec<String> {
        let mut names: Vec<String> = self
            .location
            .keys()
            .filter(|n| !self.used.contains(*n) && !ignored.iter().any(|p| n.starts_with(p)))
            .cloned()
            .collect();
        names.sort();
        names
    }

    /// Opens a sharded checkpoint from its index (`weight_map`: tensor → shard file in the
    /// same folder). Shard names must be plain file names inside the folder.
    pub fn open_index(index: &Path, target: Option<DType>) -> LoadResult<Self> {
        let bad = |message: String| LoadError::BadIndex {
            file: index.to_path_buf(),
            message,
        };
        let text = crate::weights::read_text_file(index)?;
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
            gguf_floats: None,
            origin: index.to_path_buf(),
            used: Default::default(),
            views: None,
            layout_prefixes: Vec::new(),
        })
    }

    /// Opens a model folder: a sharded index if there is one, else a single weight file. An
    /// entry of one of those names that is not a regular file (a FIFO, a folder, a link to
    /// nothing) is opened anyway, so the refusal says what it is instead of "no weights".
    pub fn open_dir(dir: &Path, target: Option<DType>) -> LoadResult<Self> {
        let present = |p: &Path| std::fs::symlink_metadata(p).is_ok();
        for index in INDEX_FILES {
            let p = dir.join(index);
            if present(&p) {
                return Self::open_index(&p, target);
            }
        }
        for file in WEIGHT_FILES {
            let p = dir.join(file);
            if present(&p) {
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

/// The names a checkpoint stores a weight's per-tensor fp8 scale under, for a weight
/// `<layer>.weight`: ComfyUI's scaled fp8 checkpoints write `<layer>.scale_weight`, and
/// ComfyUI's newer quantized checkpoints, NVIDIA ModelOpt and compressed-tensors exports write
/// `<layer>.weight_scale`. Values are `decode(byte) * scale` in both.
pub const SCALE_NAMES: [&str; 2] = ["scale_weight", "weight_scale"];

/// ComfyUI's marker tensor of a scaled fp8 checkpoint (an empty tensor, nothing to load):
/// every 8-bit float weight of such a checkpoint has a per-tensor scale ([`SCALE_NAMES`]),
/// and one that has none is refused ([`LoadError::MissingScale`]).
pub const SCALED_FP8_MARKER: &str = "scaled_fp8";

/// The activation scale ComfyUI stores beside a scaled fp8 weight (`<layer>.scale_input`),
/// for fp8 matrix products. DDO computes in the input's dtype, so it reads no input scale;
/// the tensor counts as used.
pub const INPUT_SCALE_NAME: &str = "scale_input";

impl CheckpointWeights {
    /// The per-tensor scale of weight `name` of `dtype` when the checkpoint has one
    /// ([`SCALE_NAMES`]); marks the scale (and [`INPUT_SCALE_NAME`]) used. A scale that is
    /// not one finite positive number, so large that the weight's values overflow
    /// ([`ddo_core::values::fp8_scale_problem`]: 1e38 is), or beside a weight that is not
    /// fp8, is a [`LoadError::BadScale`].
    fn scale_of(&mut self, name: &str, dtype: DType) -> LoadResult<Option<f32>> {
        let Some(layer) = name.strip_suffix(".weight") else {
            return Ok(None);
        };
        let found: Vec<String> = SCALE_NAMES
            .iter()
            .map(|s| format!("{layer}.{s}"))
            .filter(|s| self.location.contains_key(s))
            .collect();
        let Some(scale_name) = found.first().cloned() else {
            return Ok(None);
        };
        self.refuse_alias(&scale_name)?;
        let id = self.location[&scale_name];
        let file = self.files[id].path().to_path_buf();
        let bad = |message: String| LoadError::BadScale {
            tensor: name.to_string(),
            scale: scale_name.clone(),
            file: file.clone(),
            message,
        };
        if found.len() > 1 {
            return Err(bad(format!(
                "the checkpoint also has `{}`; keep one scale per weight",
                found[1]
            )));
        }
        if !dtype.is_fp8() {
            return Err(bad(format!("the weight is {dtype}, not an 8-bit float")));
        }
        let ckpt = &self.files[id];
        if let Some((_, d)) = ckpt.unsupported().find(|(n, _)| *n == scale_name) {
            return Err(bad(format!("its dtype {d} is not f32, f16 or bf16")));
        }
        let info = ckpt.tensor(&scale_name)?.clone();
        if !matches!(info.dtype, DType::F32 | DType::F16 | DType::BF16) {
            return Err(bad(format!(
                "its dtype {} is not f32, f16 or bf16",
                info.dtype
            )));
        }
        if info.shape.iter().product::<usize>() != 1 {
            return Err(bad(format!(
                "shape {:?}: a per-tensor scale has one element (per-channel scales are not read)",
                info.shape
            )));
        }
        let value = ckpt
            .host_buffer(&scale_name)?
            .with_bytes(|b| info.dtype.decode_f32(b))?
            .first()
            .copied()
            .unwrap_or(f32::NAN);
        if let Some(problem) = ddo_core::values::fp8_scale_problem(value, dtype) {
            return Err(bad(problem));
        }
        self.used.insert(scale_name);
        let input = format!("{layer}.{INPUT_SCALE_NAME}");
        if self.location.contains_key(&input) {
            self.used.insert(input);
        }
        Ok(Some(value))
    }
}

/// Reads tensor `name` of the safetensors file at `path` as f32 values with its shape
/// (f32, f16 or bf16 in the file): for latents, embeddings and reference outputs.
pub fn read_f32_tensor(path: &Path, name: &str) -> LoadResult<(Vec<usize>, Vec<f32>)> {
    let ckpt = open_checkpoint(path)?;
    if let Some((_, dtype)) = ckpt.unsupported().find(|(n, _)| *n == name) {
        return Err(LoadError::UnsupportedDtype {
            name: name.to_string(),
            file: path.to_path_buf(),
            dtype: dtype.to_string(),
        });
    }
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

/// Reads attention mask `name` of a safetensors file as booleans (`None` when the file has
/// no such tensor): masks come as Diffusers saves them — int64 (`QwenImagePipeline.
/// encode_prompt`'s `prompt_embeds_mask`), int32, bool, uint8 — or as floats; every value
/// must be 0 or 1 (anything else is [`LoadError::BadMask`], naming the first).
pub fn read_mask_tensor(path: &Path, name: &str) -> LoadResult<Option<(Vec<usize>, Vec<bool>)>> {
    let ckpt = open_checkpoint(path)?;
    let Some(raw) = ckpt.raw(name) else {
        return Ok(None);
    };
    let bad = |why: String| LoadError::BadMask {
        name: name.to_string(),
        file: path.to_path_buf(),
        why,
    };
    let values: Vec<f64> = match raw.dtype {
        "I64" => raw
            .bytes
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as f64)
            .collect(),
        "I32" => raw
            .bytes
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap_or([0; 4])) as f64)
            .collect(),
        "BOOL" | "U8" | "I8" => raw.bytes.iter().map(|&b| b as f64).collect(),
        "F32" | "F16" | "BF16" => {
            let dtype = DType::from_header_name(raw.dtype).unwrap_or(DType::F32);
            dtype
                .decode_f32(raw.bytes)?
                .into_iter()
                .map(f64::from)
                .collect()
        }
        other => return Err(bad(format!("its dtype is {other}"))),
    };
    if let Some((i, v)) = values
        .iter()
        .enumerate()
        .find(|(_, v)| **v != 0.0 && **v != 1.0)
    {
        return Err(bad(format!("value {i} is {v}")));
    }
    Ok(Some((
        raw.shape.to_vec(),
        values.iter().map(|&v| v == 1.0).collect(),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

    fn values(p: &Param) -> Vec<f32> {
        p.host().with_bytes(|b| p.dtype().decode_f32(b)).unwrap()
    }

    fn bytes(p: &Param) -> Vec<u8> {
        p.host().to_vec()
    }

    /// 3.5 chunks: several chunks and a ragged tail.
    const BIG: [usize; 2] = [7 * RANDOM_CHUNK_ELEMS / 1024, 512];

    #[test]
    fn values_do_not_depend_on_the_thread_count() {
        for dtype in FLOATS {
            let mut one = RandomWeights::new(11, dtype);
            let mut four = RandomWeights::new(11, dtype);
            let mut default = RandomWeights::new(11, dtype);
            for (name, shape) in [
                ("a.weight", &BIG[..]),
                ("b.weight", &[3 * RANDOM_CHUNK_ELEMS + 5][..]),
                ("c.bias", &[RANDOM_CHUNK_ELEMS][..]),
                ("d.weight", &[8, 3, 3, 3][..]),
            ] {
                let kind = ParamKind::Parameter;
                let a = one.make(name, shape, kind, Some(1)).unwrap();
                let b = four.make(name, shape, kind, Some(4)).unwrap();
                let c = default.param(name, shape, kind).unwrap();
                assert_eq!(bytes(&a), bytes(&b), "{dtype} {name}: 1 vs 4 threads");
                assert_eq!(bytes(&a), bytes(&c), "{dtype} {name}: 1 vs available");
                assert_eq!(a.shape(), shape);
                assert_eq!(a.dtype(), dtype);
            }
            assert_eq!(one.bytes_made(), four.bytes_made());
        }
    }

    #[test]
    fn chunks_are_seeded_apart() {
        let mut w = RandomWeights::new(3, DType::F32);
        let v = values(&w.param("x", &BIG, ParamKind::Parameter).unwrap());
        let chunk = |i: usize| &v[i * RANDOM_CHUNK_ELEMS..(i + 1) * RANDOM_CHUNK_ELEMS];
        assert_ne!(chunk(0), chunk(1));
        assert_ne!(chunk(1), chunk(2));
        assert_ne!(v[..16], v[RANDOM_CHUNK_ELEMS + 1..RANDOM_CHUNK_ELEMS + 17]);
    }

    #[test]
    fn values_follow_the_documented_distribution_in_every_float_dtype() {
        for dtype in FLOATS {
            let mut w = RandomWeights::new(5, dtype);
            // (name, shape, centre, half width)
            let fan_in = 512.0f32;
            for (name, shape, centre, width) in [
                ("proj.weight", &BIG[..], 0.0f32, 1.0 / fan_in.sqrt()),
                ("conv.weight", &[4, 8, 3, 3][..], 0.0, 1.0 / 72.0f32.sqrt()),
                ("norm.weight", &[3 * RANDOM_CHUNK_ELEMS / 2][..], 1.0, 0.1),
                ("proj.bias", &[4096][..], 0.0, 0.1),
                ("pos_embed", &[4096][..], 0.0, 0.1),
            ] {
                let v = values(&w.param(name, shape, ParamKind::Parameter).unwrap());
                assert_eq!(v.len(), shape.iter().product::<usize>());
                // Rounding to a half-width dtype may move a value by half an ulp.
                let slack = (centre.abs() + width) / 256.0;
                let (lo, hi) = v
                    .iter()
                    .fold((f32::MAX, f32::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
                assert!(
                    lo >= centre - width - slack && hi <= centre + width + slack,
                    "{dtype} {name}: [{lo}, {hi}] outside {centre} ± {width}"
                );
                // Spread over the whole interval, centred.
                assert!(lo < centre - 0.9 * width && hi > centre + 0.9 * width);
                // The mean within four standard errors (a uniform's sd is width/√3).
                let n = v.len() as f64;
                let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
                assert!(
                    (mean - f64::from(centre)).abs() < 4.0 * f64::from(width) / (3.0 * n).sqrt(),
                    "{dtype} {name}: mean {mean}"
                );
            }
        }
    }

    #[test]
    fn half_widths_round_the_f32_values_as_dtype_encoding_does() {
        let shape = [RANDOM_CHUNK_ELEMS + 100, 2];
        let f32s = values(
            &RandomWeights::new(9, DType::F32)
                .param("w", &shape, ParamKind::Parameter)
                .unwrap(),
        );
        for dtype in [DType::F16, DType::BF16] {
            let p = RandomWeights::new(9, dtype)
                .param("w", &shape, ParamKind::Parameter)
                .unwrap();
            assert_eq!(bytes(&p), dtype.encode_f32(&f32s).unwrap(), "{dtype}");
            assert_eq!(p.nbytes(), f32s.len() * 2);
        }
    }

    #[test]
    fn one_seed_gives_one_sequence_of_params() {
        let shapes: [&[usize]; 4] = [&[64, 32], &BIG, &[32], &[0, 4]];
        let build = |seed: u64| {
            let mut w = RandomWeights::new(seed, DType::BF16);
            let params: Vec<Vec<u8>> = shapes
                .iter()
                .map(|s| bytes(&w.param("x.weight", s, ParamKind::Parameter).unwrap()))
                .collect();
            (params, w.bytes_made())
        };
        let (a, made) = build(1);
        assert_eq!((a.clone(), made), build(1));
        assert_eq!(made, 2 * (64 * 32 + BIG[0] * BIG[1] + 32) as u64);
        assert_ne!(a, build(2).0);
        assert!(a[3].is_empty());
        // Each param draws its own seed: the same shape again gives other values.
        let mut w = RandomWeights::new(1, DType::BF16);
        let first = bytes(
            &w.param("x.weight", &[64, 32], ParamKind::Parameter)
                .unwrap(),
        );
        let again = bytes(
            &w.param("x.weight", &[64, 32], ParamKind::Parameter)
                .unwrap(),
        );
        assert_eq!(first, a[0]);
        assert_ne!(first, again);
    }

    #[test]
    fn quantized_random_weights_are_refused() {
        let mut w = RandomWeights::new(1, DType::Quantized);
        let e = w.param("w", &[4, 4], ParamKind::Parameter).unwrap_err();
        assert!(matches!(e, LoadError::Core(CoreError::Shape { .. })), "{e}");
        assert_eq!(w.bytes_made(), 0);
    }
}
