//! What [`CheckpointWeights`] refuses on a read beyond a tensor's own header: one tensor
//! under two of its layout's name prefixes (a single file's `model.diffusion_model.` and
//! none, an LDM VAE's `first_stage_model.`, `vae.` and none, ...: DDO does not pick one),
//! and an 8-bit float tensor without its per-tensor scale in a checkpoint that declares
//! ComfyUI's scaled fp8 (read at scale 1, its values would be off by the missing factor).

use super::{CheckpointWeights, SCALE_NAMES, SCALED_FP8_MARKER};
use crate::error::{LoadError, LoadResult};

impl CheckpointWeights {
    /// Declares the name prefixes the checkpoint's layout may put a tensor under, the
    /// empty one included where bare names are allowed (`["model.diffusion_model.", ""]`):
    /// from now on a tensor read under one of them whose name under another is in the
    /// checkpoint too is refused ([`LoadError::DuplicateTensor`], naming both) instead of
    /// one of them winning. A name takes the longest prefix it has, so nested prefixes
    /// (`model.` and `model.language_model.`) work.
    pub fn set_layout_prefixes(&mut self, prefixes: &[&str]) {
        self.layout_prefixes = prefixes.iter().map(|p| p.to_string()).collect();
    }

    /// [`LoadError::DuplicateTensor`] when `tensor` is in the checkpoint under another of
    /// the layout's prefixes too.
    pub(super) fn refuse_alias(&self, tensor: &str) -> LoadResult<()> {
        let Some(own) = self
            .layout_prefixes
            .iter()
            .filter(|p| tensor.starts_with(p.as_str()))
            .max_by_key(|p| p.len())
        else {
            return Ok(());
        };
        let rest = &tensor[own.len()..];
        for other in self.layout_prefixes.iter().filter(|p| *p != own) {
            let alias = format!("{other}{rest}");
            if alias == tensor || !self.location.contains_key(&alias) {
                continue;
            }
            let file = self.location.get(tensor).map_or_else(
                || self.origin.clone(),
                |&id| self.files[id].path().to_path_buf(),
            );
            return Err(LoadError::DuplicateTensor {
                file,
                first: tensor.to_string(),
                second: alias,
                prefixes: self
                    .layout_prefixes
                    .iter()
                    .map(|p| {
                        if p.is_empty() {
                            "none".into()
                        } else {
                            format!("`{p}`")
                        }
                    })
                    .collect::<Vec<_>>()
                    .join(", "),
            });
        }
        Ok(())
    }

    /// [`LoadError::MissingScale`] when the checkpoint declares scaled fp8 (its
    /// [`SCALED_FP8_MARKER`], bare or under a prefix): `tensor`, in file `id`, is an 8-bit
    /// float without a scale.
    pub(super) fn refuse_unscaled_fp8(&self, tensor: &str, id: usize) -> LoadResult<()> {
        let suffix = format!(".{SCALED_FP8_MARKER}");
        let Some(marker) = self
            .location
            .keys()
            .filter(|k| *k == SCALED_FP8_MARKER || k.ends_with(&suffix))
            .min()
        else {
            return Ok(());
        };
        let expected = match tensor.strip_suffix(".weight") {
            Some(layer) => SCALE_NAMES
                .iter()
                .map(|s| format!("`{layer}.{s}`"))
                .collect::<Vec<_>>()
                .join(" or "),
            None => {
                "a scaled fp8 checkpoint stores 8-bit floats only as `<layer>.weight` with a scale"
                    .into()
            }
        };
        Err(LoadError::MissingScale {
            tensor: tensor.to_string(),
            file: self.files[id].path().to_path_buf(),
            marker: marker.clone(),
            expected,
        })
    }
}
