//! [`LoadError`]: the crate's one error enum, for everything that can go wrong turning files
//! (weights, configs, tokenizers) into models. Errors while running a model are `CoreError`s.

use std::path::PathBuf;

use ddo_core::CoreError;
use thiserror::Error;

/// Result alias for loading.
pub type LoadResult<T> = std::result::Result<T, LoadError>;

/// A model could not be built from its files or config.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum LoadError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}; check the path and permissions")]
    Io {
        /// File.
        path: PathBuf,
        /// OS error.
        #[source]
        source: std::io::Error,
    },
    /// A weight the model needs is not in the checkpoint.
    #[error(
        "tensor `{name}` is missing from {file}; the checkpoint does not match the model config"
    )]
    MissingTensor {
        /// Tensor name.
        name: String,
        /// Checkpoint file (or folder, when sharded).
        file: PathBuf,
    },
    /// Checkpoint tensors the config leaves unused: the config and the weights disagree
    /// (e.g. `layers_per_block` lower than the weights were trained with).
    #[error(
        "{count} tensor(s) in {file} are not used by its config (e.g. {examples}): the config and the weights disagree; \
         fix config.json, or pass --allow-unused-weights to run without them"
    )]
    UnusedWeights {
        /// Checkpoint file (or index).
        file: PathBuf,
        /// How many.
        count: usize,
        /// The first few names.
        examples: String,
    },
    /// A weight has another shape than the config implies.
    #[error(
        "tensor `{name}` in {file} has shape {found:?}, the config implies {expected:?}; \
         the checkpoint and config.json do not belong together"
    )]
    ShapeMismatch {
        /// Tensor name.
        name: String,
        /// Checkpoint file.
        file: PathBuf,
        /// Shape the model expects.
        expected: Vec<usize>,
        /// Shape in the file.
        found: Vec<usize>,
    },
    /// A weight has a dtype DDO cannot load.
    #[error(
        "tensor `{name}` in {file} has dtype {dtype}, which DDO does not load (f32, f16, bf16)"
    )]
    UnsupportedDtype {
        /// Tensor name.
        name: String,
        /// Checkpoint file.
        file: PathBuf,
        /// The dtype found.
        dtype: String,
    },
    /// An 8-bit float tensor in a layer DDO computes only in 16 or 32 bits (fp8 is read
    /// by linear layers alone: their weight and bias are upcast for the GEMM).
    #[error(
        "tensor `{name}` ({dtype}) belongs to a {kind} layer; DDO computes fp8 weights only in linear layers; give --dtype bf16 to convert the checkpoint on load"
    )]
    Fp8OutsideLinear {
        /// Tensor name.
        name: String,
        /// Its dtype.
        dtype: String,
        /// The layer kind (`norm`, `conv2d`, `embedding`, ...).
        kind: String,
    },
    /// An attention mask that is not 0/1 values of a dtype masks come in.
    #[error(
        "tensor `{name}` in {file} is not a mask: {why}; give 0/1 values as int64, int32, bool, \
         uint8 or a float dtype (Diffusers' prompt_embeds_mask)"
    )]
    BadMask {
        /// Tensor name.
        name: String,
        /// File.
        file: PathBuf,
        /// What is wrong (the dtype, or the first value that is neither 0 nor 1).
        why: String,
    },
    /// A checkpoint file is truncated or corrupt.
    #[error("{file} is not a valid safetensors file: {message}; re-download or re-export it")]
    CorruptFile {
        /// File.
        file: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A sharded checkpoint's index is invalid.
    #[error("sharded index {file} is invalid: {message}")]
    BadIndex {
        /// Index file.
        file: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A folder holds no weights.
    #[error("no safetensors weights in {dir}; expected {expected}")]
    NoWeights {
        /// Folder.
        dir: PathBuf,
        /// The file names looked for.
        expected: String,
    },
    /// A config file is invalid.
    #[error("config {file} is invalid: {message}")]
    Config {
        /// Config file.
        file: PathBuf,
        /// What is wrong, and what would be valid.
        message: String,
    },
    /// A config value is out of range or contradicts another.
    #[error("config field `{field}` = {value} is invalid: {hint}")]
    InvalidConfig {
        /// Field.
        field: String,
        /// Its value.
        value: String,
        /// What would be valid.
        hint: String,
    },
    /// An fp8 weight's scale tensor (`<layer>.scale_weight` or `<layer>.weight_scale`) is
    /// unusable: not one finite positive number, so large that the weight's values
    /// overflow, or beside a weight that is not fp8.
    #[error(
        "{file}: scale `{scale}` of `{tensor}`: {message}; fix or remove the scale tensor (a scaled fp8 weight takes one f32, f16 or bf16 value above 0 whose product with the format's largest value stays below 1.8e19; `ddo inspect --check-values` lists every bad value)"
    )]
    BadScale {
        /// The weight it scales.
        tensor: String,
        /// The scale tensor.
        scale: String,
        /// Checkpoint file.
        file: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A checkpoint that declares ComfyUI's scaled fp8 (its `scaled_fp8` marker) holds an
    /// 8-bit float tensor without a per-tensor scale: read at scale 1, its values would be
    /// off by the missing factor.
    #[error(
        "{file} declares scaled fp8 (`{marker}`), but its 8-bit float tensor `{tensor}` has no scale (expected {expected}); read at scale 1 its values would be wrong: re-download or re-export the checkpoint with every scale, or use the model's bf16 checkpoint"
    )]
    MissingScale {
        /// The fp8 tensor.
        tensor: String,
        /// Checkpoint file.
        file: PathBuf,
        /// The marker tensor found.
        marker: String,
        /// The scale tensor(s) looked for.
        expected: String,
    },
    /// One tensor under two of the name prefixes a checkpoint layout may put it under
    /// (`model.diffusion_model.X` and `X`): DDO does not pick one.
    #[error(
        "{file} holds both `{first}` and `{second}`: one tensor under two of the layout's prefixes ({prefixes}), and DDO does not pick one; keep one copy (re-export the checkpoint under one prefix)"
    )]
    DuplicateTensor {
        /// Checkpoint file.
        file: PathBuf,
        /// The name a model read.
        first: String,
        /// The same tensor under another prefix.
        second: String,
        /// The layout's prefixes.
        prefixes: String,
    },
    /// A tokenizer folder has none of the files DDO reads (a missing `tokenizer/`
    /// folder included).
    #[error(
        "no tokenizer in {dir}: expected {expected}; copy the model's tokenizer/ folder, or re-export it with transformers' save_pretrained"
    )]
    NoTokenizer {
        /// The folder looked in.
        dir: PathBuf,
        /// The files looked for.
        expected: String,
    },
    /// A tokenizer file is there but cannot be used.
    #[error(
        "cannot load the tokenizer {path}: {message}; re-export it with transformers' save_pretrained"
    )]
    Tokenizer {
        /// The file (or folder).
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A pipeline folder's class (or a component's) is one DDO does not run, or belongs to
    /// another pipeline family than the folder's `model_index.json` names.
    #[error("{file}: field `{field}` = {value}: {hint}")]
    PipelineClass {
        /// The file read (`model_index.json`, `transformer/config.json`, ...).
        file: PathBuf,
        /// The field (`_class_name`, `architectures`, a component of `model_index.json`).
        field: String,
        /// Its value.
        value: String,
        /// What DDO runs, and what to do.
        hint: String,
    },
    /// A folder without `model_index.json`, read as a `FluxPipeline` folder (what DDO ran
    /// before it read the file), whose component `file` names a class of another pipeline.
    #[error(
        "{dir} has no model_index.json, so it was read as a FluxPipeline folder, but {file} \
         names {class}, a {pipeline} component; a pipeline folder needs the model_index.json \
         Diffusers' save_pretrained writes beside its component folders (`_class_name`: \
         {pipeline} here, or FluxPipeline): copy it from where the folder came from, or \
         download the pipeline again"
    )]
    NoModelIndex {
        /// The folder.
        dir: PathBuf,
        /// The component config read (`transformer/config.json`, ...).
        file: PathBuf,
        /// The class it names.
        class: String,
        /// The pipeline that class belongs to (`QwenImagePipeline`).
        pipeline: &'static str,
    },
    /// A LoRA file DDO cannot read or apply: what is wrong, or the format it holds.
    #[error(
        "{file} is not a LoRA DDO applies: {problem}; DDO reads Diffusers/PEFT, AI-toolkit,          kohya/sd-scripts, ComfyUI, original-layout and XLabs LoRA files (`ddo inspect FILE`          names a file's format)"
    )]
    Lora {
        /// The file.
        file: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// The core refused something while building (allocation, a bad module tree).
    #[error(transparent)]
    Core(#[from] CoreError),
}

impl LoadError {
    /// This error as read from config file `file`: an [`LoadError::InvalidConfig`]'s field
    /// is named with the file (`<file>: shift`, as the pipeline loaders name fields of
    /// `model_index.json`); any other error is returned as it is.
    pub fn in_config_file(self, file: &std::path::Path) -> Self {
        match self {
            LoadError::InvalidConfig { field, value, hint } => LoadError::InvalidConfig {
                field: format!("{}: {field}", file.display()),
                value,
                hint,
            },
            other => other,
        }
    }
}
