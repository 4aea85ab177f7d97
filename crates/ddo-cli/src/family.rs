//! The pipeline families `ddo` runs — Diffusers' `FluxPipeline` and `QwenImagePipeline` —
//! as one [`AnyPipeline`] that the commands ask for what every family has (its components
//! in phase order, the latent grid, the planner's phase demands, the attention shapes to
//! prepare), and [`Family`], which a config name or a folder's `model_index.json` picks.
//! What differs between the families (prompts, guidance, the request) stays in `run`.

use std::path::Path;
use std::sync::Arc;

use ddo_core::{Component, Device};
use ddo_nn::pipeline::{
    FluxPipeline, FluxPipelineConfig, PipelineKind, QwenImagePipeline, QwenImagePipelineConfig,
    TiledDecode,
};
use ddo_routes::{PhaseDemand, Pipeline};

use crate::error::{CliError, CliResult};

/// A pipeline family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `FluxPipeline` (CLIP + T5, the Flux transformer, the Flux VAE).
    Flux,
    /// `QwenImagePipeline` (Qwen2.5-VL's language model, the Qwen-Image transformer, the
    /// Qwen-Image VAE).
    QwenImage,
}

impl Family {
    /// The family of a named config (`--config NAME`), if DDO knows the name.
    pub fn of_config(name: &str) -> Option<Self> {
        if FluxPipelineConfig::named(name).is_some() {
            Some(Self::Flux)
        } else if QwenImagePipelineConfig::named(name).is_some() {
            Some(Self::QwenImage)
        } else {
            None
        }
    }

    /// The family of a Diffusers folder, from its `model_index.json` (Flux without one).
    pub fn of_folder(dir: &Path) -> CliResult<Self> {
        match PipelineKind::detect(dir)
            .map_err(|e| CliError::from(e).context(&format!("--weights {}", dir.display())))?
        {
            PipelineKind::Flux => Ok(Self::Flux),
            PipelineKind::QwenImage => Ok(Self::QwenImage),
        }
    }

    /// Every config name `--config` takes, Flux's first.
    pub fn config_names() -> Vec<&'static str> {
        FluxPipelineConfig::NAMES
            .iter()
            .chain(QwenImagePipelineConfig::NAMES.iter())
            .copied()
            .collect()
    }

    /// Diffusers' class name.
    pub fn class_name(self) -> &'static str {
        match self {
            Self::Flux => "FluxPipeline",
            Self::QwenImage => "QwenImagePipeline",
        }
    }

    /// Denoising steps when `--steps` is not given: Diffusers' defaults (28 in FLUX.1-dev's
    /// model card, `num_inference_steps=50` in QwenImagePipeline), 4 for the tiny configs.
    pub fn default_steps(self, tiny: bool) -> usize {
        match (tiny, self) {
            (true, _) => 4,
            (false, Self::Flux) => 28,
            (false, Self::QwenImage) => 50,
        }
    }
}

/// A pipeline of either family.
pub enum AnyPipeline {
    /// A Flux pipeline.
    Flux(Box<FluxPipeline>),
    /// A Qwen-Image pipeline.
    QwenImage(Box<QwenImagePipeline>),
}

impl std::fmt::Debug for AnyPipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AnyPipeline")
            .field("family", &self.family())
            .field("components", &self.component_names())
            .finish()
    }
}

impl AnyPipeline {
    /// Its family.
    pub fn family(&self) -> Family {
        match self {
            Self::Flux(_) => Family::Flux,
            Self::QwenImage(_) => Family::QwenImage,
        }
    }

    /// The components, in phase order.
    pub fn components(&self) -> Vec<Arc<Component>> {
        match self {
            Self::Flux(p) => p.components(),
            Self::QwenImage(p) => p.components(),
        }
    }

    /// The component names, in phase order.
    pub fn component_names(&self) -> Vec<String> {
        match self {
            Self::Flux(p) => p.component_names(),
            Self::QwenImage(p) => p.component_names(),
        }
    }

    /// The component `name`, if the pipeline has it.
    pub fn component(&self, name: &str) -> Option<Arc<Component>> {
        self.components().into_iter().find(|c| c.name() == name)
    }

    /// The components as a `ddo_routes::Pipeline`.
    pub fn offload_pipeline(&self) -> ddo_core::Result<Pipeline> {
        match self {
            Self::Flux(p) => p.offload_pipeline(),
            Self::QwenImage(p) => p.offload_pipeline(),
        }
    }

    /// Pixels per latent.
    pub fn vae_scale_factor(&self) -> usize {
        match self {
            Self::Flux(p) => p.vae_scale_factor(),
            Self::QwenImage(p) => p.vae_scale_factor(),
        }
    }

    /// The latent grid of a `height × width` image.
    pub fn latent_grid(&self, height: usize, width: usize) -> ddo_core::Result<(usize, usize)> {
        match self {
            Self::Flux(p) => p.latent_grid(height, width),
            Self::QwenImage(p) => p.latent_grid(height, width),
        }
    }

    /// The memory planner's phases (see `FluxPipeline::phase_demands`).
    pub fn phase_demands(
        &self,
        height: usize,
        width: usize,
        images: usize,
        tiled: TiledDecode,
        budget: u64,
        device: &dyn Device,
    ) -> ddo_core::Result<Vec<PhaseDemand>> {
        match self {
            Self::Flux(p) => p.phase_demands(height, width, images, tiled, budget, device),
            Self::QwenImage(p) => p.phase_demands(height, width, images, tiled, budget, device),
        }
    }

    /// Names the run's attention shapes to the device before the first phase.
    pub fn prepare_attention(
        &self,
        device: &dyn Device,
        height: usize,
        width: usize,
        images: usize,
    ) -> ddo_core::Result<()> {
        match self {
            Self::Flux(p) => p.prepare_attention(device, height, width, images),
            Self::QwenImage(p) => p.prepare_attention(device, height, width, images),
        }
    }

    /// Prepares the denoise phase's first forward before the first phase: the transformer's
    /// linears run once on the device (both families) and its rotary tables are made
    /// (Flux); how many linear calls ran.
    pub fn prepare_first_forward(
        &self,
        device: &dyn Device,
        (height, width, images): (usize, usize, usize),
        max_bytes: u64,
    ) -> ddo_core::Result<usize> {
        match self {
            Self::Flux(p) => p.prepare_first_forward(device, height, width, images, max_bytes),
            Self::QwenImage(p) => p.prepare_first_forward(device, height, width, images, max_bytes),
        }
    }

    /// The Flux pipeline, if it is one.
    pub fn as_flux(&self) -> Option<&FluxPipeline> {
        match self {
            Self::Flux(p) => Some(p),
            Self::QwenImage(_) => None,
        }
    }

    /// The Qwen-Image pipeline, if it is one.
    pub fn as_qwen(&self) -> Option<&QwenImagePipeline> {
        match self {
            Self::Flux(_) => None,
            Self::QwenImage(p) => Some(p),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_config_name_has_one_family() {
        let names = Family::config_names();
        assert!(names.contains(&"flux-dev") && names.contains(&"qwen-image"));
        for n in &names {
            let flux = FluxPipelineConfig::named(n).is_some();
            let qwen = QwenImagePipelineConfig::named(n).is_some();
            assert!(flux ^ qwen, "{n} must name exactly one family");
            let expected = if flux {
                Family::Flux
            } else {
                Family::QwenImage
            };
            assert_eq!(Family::of_config(n), Some(expected));
        }
        assert_eq!(Family::of_config("sdxl"), None);
    }
}
