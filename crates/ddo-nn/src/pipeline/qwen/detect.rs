//! [`PipelineKind`]: which pipeline a Diffusers folder holds, from its `model_index.json`,
//! and a check that its components belong to that pipeline's family; the component a model
//! class is in DDO's pipelines ([`PipelineKind::component_of_class`]) and the class a
//! `config.json` names ([`config_class`]).

use std::path::Path;

use serde_json::Value;

use crate::error::{LoadError, LoadResult};

/// The file naming a Diffusers pipeline folder's class and components.
pub(super) const MODEL_INDEX: &str = "model_index.json";

/// The pipelines DDO runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PipelineKind {
    /// Diffusers' `FluxPipeline` ([`FluxPipeline`](crate::pipeline::FluxPipeline)).
    Flux,
    /// Diffusers' `QwenImagePipeline` ([`QwenImagePipeline`](super::QwenImagePipeline)).
    QwenImage,
}

/// The component classes of each family: (component folder, the config's class field, the
/// classes). A component whose class is the other family's makes a folder mixed.
const FLUX_CLASSES: [(&str, &str); 4] = [
    ("transformer", "FluxTransformer2DModel"),
    ("vae", "AutoencoderKL"),
    ("text_encoder", "CLIPTextModel"),
    ("text_encoder_2", "T5EncoderModel"),
];
const QWEN_CLASSES: [(&str, &str); 3] = [
    ("transformer", "QwenImageTransformer2DModel"),
    ("vae", "AutoencoderKLQwenImage"),
    ("text_encoder", "Qwen2_5_VLForConditionalGeneration"),
];

impl PipelineKind {
    /// Every kind, in the order DDO names them.
    pub const ALL: [PipelineKind; 2] = [PipelineKind::Flux, PipelineKind::QwenImage];

    /// Diffusers' class name (`FluxPipeline`, `QwenImagePipeline`).
    pub fn class_name(self) -> &'static str {
        match self {
            Self::Flux => "FluxPipeline",
            Self::QwenImage => "QwenImagePipeline",
        }
    }

    /// The kind of a `model_index.json` `_class_name`.
    pub fn from_class_name(class: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.class_name() == class)
    }

    /// The pipeline and the component (its folder's name: `vae`, `transformer`,
    /// `text_encoder`, `text_encoder_2`) a model class is in DDO's pipelines
    /// (`AutoencoderKL` → Flux's `vae`, `T5EncoderModel` → Flux's `text_encoder_2`,
    /// `Qwen2_5_VLForConditionalGeneration` → Qwen-Image's `text_encoder`); `None` for a class
    /// no pipeline DDO runs has.
    pub fn component_of_class(class: &str) -> Option<(Self, &'static str)> {
        Self::ALL.into_iter().find_map(|k| {
            k.classes()
                .iter()
                .find(|(_, c)| *c == class)
                .map(|(component, _)| (k, *component))
        })
    }

    fn classes(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Self::Flux => &FLUX_CLASSES,
            Self::QwenImage => &QWEN_CLASSES,
        }
    }

    fn other(self) -> Self {
        match self {
            Self::Flux => Self::QwenImage,
            Self::QwenImage => Self::Flux,
        }
    }

    /// Reads `dir/model_index.json`'s `_class_name` (`FluxPipeline` or
    /// `QwenImagePipeline`); a folder without `model_index.json` is Flux (what DDO ran before
    /// it read the file). A `model_index.json` (or component `config.json`) that is there but
    /// is no regular file (a directory, a FIFO, a link to a device) is refused by
    /// [`read_text_file`](crate::weights::read_text_file), never taken as absent. An unknown
    /// class, or a `model_index.json` without one, is a [`LoadError::PipelineClass`] naming
    /// the file and the field and the classes DDO runs. A folder that mixes the families —
    /// `model_index.json` names one pipeline, but one of its components (there, or in the
    /// component's `config.json`: Diffusers' `_class_name`, Transformers' `architectures`) is
    /// a class of the other — is a [`LoadError::PipelineClass`] naming that file and field. A
    /// folder without `model_index.json` whose components are Qwen-Image's is
    /// [`LoadError::NoModelIndex`]: the file is missing, not the families mixed.
    pub fn detect(dir: &Path) -> LoadResult<PipelineKind> {
        let index = dir.join(MODEL_INDEX);
        let has_index = crate::weights::is_present(&index);
        let kind = if has_index {
            let json = read_json(&index)?;
            let runs = Self::ALL.map(Self::class_name).join(", ");
            let class = match json.get("_class_name") {
                Some(Value::String(s)) => s.clone(),
                other => {
                    return Err(LoadError::PipelineClass {
                        file: index,
                        field: "_class_name".into(),
                        value: other.map_or("missing".into(), Value::to_string),
                        hint: format!(
                            "expected the Diffusers pipeline class as a string; DDO runs {runs}"
                        ),
                    });
                }
            };
            let Some(kind) = Self::from_class_name(&class) else {
                return Err(LoadError::PipelineClass {
                    file: index,
                    field: "_class_name".into(),
                    value: class,
                    hint: format!(
                        "DDO runs {runs}; use a folder saved from one of them (or give a named \
                         --config)"
                    ),
                });
            };
            // The components model_index.json lists: ["library", "Class"].
            for (component, _) in kind.other().classes() {
                if let Some(class) = json
                    .get(*component)
                    .and_then(Value::as_array)
                    .and_then(|a| a.get(1))
                    .and_then(Value::as_str)
                {
                    kind.check_class(&index, component, class)?;
                }
            }
            kind
        } else {
            PipelineKind::Flux
        };
        // The components' own configs.
        for (component, _) in kind.other().classes() {
            let file = dir.join(component).join("config.json");
            if !crate::weights::is_present(&file) {
                continue;
            }
            let json = read_json(&file)?;
            let classes = json
                .get("_class_name")
                .and_then(Value::as_str)
                .map(|c| ("_class_name", c))
                .into_iter()
                .chain(
                    json.get("architectures")
                        .and_then(Value::as_array)
                        .into_iter()
                        .flatten()
                        .filter_map(Value::as_str)
                        .map(|c| ("architectures", c)),
                );
            for (field, class) in classes {
                if !has_index && kind.other().classes().iter().any(|(_, c)| *c == class) {
                    return Err(LoadError::NoModelIndex {
                        dir: dir.to_path_buf(),
                        file,
                        class: class.to_string(),
                        pipeline: kind.other().class_name(),
                    });
                }
                kind.check_class(&file, field, class)?;
            }
        }
        Ok(kind)
    }

    /// Refuses `class` (read from `field` of `file`) when it is a class of the other family.
    fn check_class(self, file: &Path, field: &str, class: &str) -> LoadResult<()> {
        let other = self.other();
        match other.classes().iter().find(|(_, c)| *c == class) {
            None => Ok(()),
            Some((component, _)) => {
                let own = self
                    .classes()
                    .iter()
                    .find(|(c, _)| c == component)
                    .map_or(String::new(), |(_, c)| format!(" (expected {c})"));
                Err(LoadError::PipelineClass {
                    file: file.to_path_buf(),
                    field: field.into(),
                    value: class.into(),
                    hint: format!(
                        "the folder mixes pipelines: it is a {} folder, but its {component} is \
                         {}'s{own}; use one pipeline's components throughout",
                        self.class_name(),
                        other.class_name()
                    ),
                })
            }
        }
    }
}

/// The class `file` (a `config.json`) names: Diffusers' `_class_name`, else Transformers'
/// `architectures[0]`; `None` when it names none. The file is read as every config is
/// ([`read_text_file`](crate::weights::read_text_file): a regular file, bounded), and must be
/// JSON.
pub fn config_class(file: &Path) -> LoadResult<Option<String>> {
    let json = read_json(file)?;
    Ok(json
        .get("_class_name")
        .and_then(Value::as_str)
        .or_else(|| {
            json.get("architectures")
                .and_then(Value::as_array)
                .and_then(|a| a.first())
                .and_then(Value::as_str)
        })
        .map(str::to_string))
}

fn read_json(path: &Path) -> LoadResult<Value> {
    let text = crate::weights::read_text_file(path)?;
    serde_json::from_str(&text).map_err(|e| LoadError::Config {
        file: path.to_path_buf(),
        message: format!("{e}; expected a JSON object as Diffusers writes it"),
    })
}
