//! The `none` route: the component runs resident. Its weights are copied to the device
//! once at attach and stay there until detach; the per-leaf hooks do nothing. With
//! [`Component::set_adapter_fusion`] its LoRA adapters are folded into the device copies at
//! attach (`--lora-fuse`), the host weights untouched.
//!
//! A route crate: it sits above `ddo-core` (it talks only to the `Device` trait, never to a
//! GPU library) and is registered in the static route table of `ddo-routes`.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use ddo_core::residency::{FreeMode, ResidencyTable, UploadRegistrations};
use ddo_core::{
    AttachedRoute, Component, CoreError, DType, Device, DeviceId, Footprint, FootprintContext,
    HostMemoryKind, Leaf, OptionTable, Refusal, Result, Route, RouteId, RouteSpec,
};
use ddo_metrics::RouteMetrics;
use parking_lot::Mutex;

/// The options of `none`: none.
pub static OPTIONS: OptionTable = OptionTable {
    options: &[],
    refused: &[],
    others_hint: "route none keeps every weight resident and takes no options; \
                  use diffusers_group_offload or native_vmm to tune offloading",
};

/// Params whose copies are queued before their file pages are released during the
/// upload at attach (a few hundred MiB of a large model's pages at a time).
const UPLOAD_CHUNK_PARAMS: usize = 16;

/// The resident route (`none`).
#[derive(Debug, Clone, Copy, Default)]
pub struct ResidentRoute;

impl Route for ResidentRoute {
    fn id(&self) -> RouteId {
        RouteId::RESIDENT
    }

    fn keeps_weights_resident(&self, _spec: &RouteSpec) -> bool {
        true
    }

    /// Every weight on the device; over the budget preflight refuses.
    fn estimate(
        &self,
        _spec: &RouteSpec,
        weight_bytes: u64,
        _largest_leaf_bytes: u64,
        budget_bytes: u64,
    ) -> ddo_core::HeaderEstimate {
        ddo_core::HeaderEstimate {
            resident_bytes: weight_bytes,
            streamed_bytes_per_forward: 0,
            peak_weight_bytes: weight_bytes,
            note: if weight_bytes > budget_bytes {
                format!(
                    "does not fit the {} budget: preflight refuses",
                    ddo_metrics::format_bytes(budget_bytes)
                )
            } else {
                String::new()
            },
        }
    }

    /// `none` takes no options.
    fn option_table(&self) -> &'static OptionTable {
        &OPTIONS
    }

    fn preflight(
        &self,
        component: &Component,
        device: &dyn Device,
        _spec: &RouteSpec,
    ) -> Result<()> {
        let refuse = |refusal| CoreError::Refused {
            route: RouteId::RESIDENT.as_str(),
            component: component.name().to_string(),
            refusal,
        };
        let info = device.memory_info();
        let available = info
            .driver_free
            .unwrap_or_else(|| info.capacity.saturating_sub(info.allocated));
        let needed = component.param_bytes();
        if needed > available {
            return Err(refuse(Refusal::DoesNotFit { needed, available }));
        }
        Ok(())
    }

    /// Every weight on the device for the attachment's life; nothing streamed or pinned.
    fn footprint(
        &self,
        component: &Component,
        _spec: &RouteSpec,
        _context: &FootprintContext,
    ) -> Result<Footprint> {
        Ok(Footprint::resident(component.param_bytes()))
    }

    fn attach(
        &self,
        component: &Arc<Component>,
        device: Arc<dyn Device>,
        spec: &RouteSpec,
        metrics: Arc<RouteMetrics>,
    ) -> Result<Arc<dyn AttachedRoute>> {
        let stream = device.compute_stream();
        let mut table = ResidencyTable::new();
        let params = component.params();
        // Checkpoint-mapped weights are page-locked where they are for this one upload.
        let uploads = UploadRegistrations::register(&*device, &params)?;
        // A one-time read (issue 35): the file pages of weights copied from pageable
        // mappings leave the process as soon as their copies are queued, so the upload holds
        // one chunk's pages at a time instead of the component's (advice only: a copy that
        // has yet to read them faults them back in; the bytes stay readable).
        let upload = |table: &mut ResidencyTable| -> Result<()> {
            for chunk in params.chunks(UPLOAD_CHUNK_PARAMS) {
                table.acquire(&*device, chunk, &|p| uploads.source(p), &stream, &metrics)?;
                for p in chunk {
                    if uploads.source(p)?.kind() != HostMemoryKind::Pinned {
                        p.host().release_pages();
                    }
                }
            }
            device.synchronize_stream(&stream)
        };
        if let Err(e) = upload(&mut table) {
            table.release_all(&*device, FreeMode::Immediate, &stream);
            return Err(e);
        }
        uploads.release(&*device);
        // The page-locked ones' pages, now that their copies are done.
        for p in &params {
            p.host().release_pages();
        }
        let leaves_with_params = component
            .leaves()
            .iter()
            .filter(|l| !l.params().is_empty())
            .count() as u64;
        metrics.set_leaf_plan(0, leaves_with_params);
        metrics.set_resident_weight_bytes(table.resident_bytes());
        // `--lora-fuse`: the adapters folded into the resident weights, once.
        let folded = if component.fuses_adapters() {
            match fold_adapters(component, &*device, &stream) {
                Ok(f) => f,
                Err(e) => {
                    table.release_all(&*device, FreeMode::Immediate, &stream);
                    return Err(e);
                }
            }
        } else {
            HashSet::new()
        };
        Ok(Arc::new(AttachedResident {
            describe: spec.describe(),
            device,
            metrics,
            table: Mutex::new(table),
            folded,
        }))
    }
}

/// Folds each linear leaf's adapters into its resident weight on the device:
/// `W ← W + Σ B A` (the scale is in B), written over the resident copy on `stream`. Leaves
/// whose weight is not f32, f16 or bf16 (8-bit weights) keep their adapters unfolded.
/// Returns the paths of the leaves folded.
fn fold_adapters(
    component: &Component,
    device: &dyn Device,
    stream: &ddo_core::Stream,
) -> Result<HashSet<String>> {
    let ops = ddo_core::ops_of(device)?;
    let mut folded = HashSet::new();
    for (i, leaf) in component.leaves().iter().enumerate() {
        let Some(adapters) = component.adapters_of(ddo_core::LeafId(i)) else {
            continue;
        };
        let Some(weight) = leaf
            .params()
            .iter()
            .find(|(n, _)| n == "weight")
            .map(|(_, p)| Arc::clone(p))
        else {
            continue;
        };
        if !matches!(weight.dtype(), DType::F32 | DType::F16 | DType::BF16) {
            continue;
        }
        let (Some(w), Some(dst)) = (weight.device_tensor(), weight.device()) else {
            continue;
        };
        let mut acc = w;
        for a in adapters.iter() {
            let mut delta = ops.matmul(&a.up, &a.down)?;
            if a.scale != 1.0 {
                delta = ops.affine(&delta, a.scale, 0.0)?;
            }
            acc = ops.binary(&acc, &delta, ddo_core::BinaryOp::Add)?;
        }
        let ddo_core::TensorStorage::Device(src) = acc.storage() else {
            return Err(CoreError::Backend {
                device: device.id().to_string(),
                message: "folding a LoRA: the sum is not on the device".into(),
            });
        };
        device.copy_d2d(src, &dst, stream)?;
        folded.insert(leaf.path().to_string());
    }
    device.synchronize_stream(stream)?;
    Ok(folded)
}

/// Hooks of a component attached resident.
pub struct AttachedResident {
    describe: String,
    device: Arc<dyn Device>,
    metrics: Arc<RouteMetrics>,
    table: Mutex<ResidencyTable>,
    /// Leaves whose adapters were folded into the resident weights (`--lora-fuse`).
    folded: HashSet<String>,
}

impl fmt::Debug for AttachedResident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AttachedResident({:?})", self.table.lock())
    }
}

impl AttachedRoute for AttachedResident {
    fn route(&self) -> RouteId {
        RouteId::RESIDENT
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }

    fn device_id(&self) -> DeviceId {
        self.device.id()
    }

    fn metrics(&self) -> &Arc<RouteMetrics> {
        &self.metrics
    }

    fn before_leaf(&self, _leaf: &Leaf) -> Result<()> {
        Ok(())
    }

    fn folds_adapters_of(&self, leaf: &Leaf) -> bool {
        self.folded.contains(leaf.path())
    }

    fn folds_adapters(&self) -> bool {
        !self.folded.is_empty()
    }

    fn after_leaf(&self, _leaf: &Leaf) -> Result<()> {
        Ok(())
    }

    fn end_phase(&self) -> Result<()> {
        // Resident weights stay by design; there are no transient buffers.
        self.device.synchronize()
    }

    fn detach(&self) -> Result<()> {
        let sync = self.device.synchronize();
        let stream = self.device.compute_stream();
        self.table
            .lock()
            .release_all(&*self.device, FreeMode::Immediate, &stream);
        self.metrics.set_resident_weight_bytes(0);
        self.metrics.set_leaf_plan(0, 0);
        sync
    }
}

impl Drop for AttachedResident {
    fn drop(&mut self) {
        let _ = self.detach();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ddo_core::DType;
    use ddo_core::reference::{self, ReferenceSpec};
    use ddo_host::HostDevice;

    #[test]
    fn resident_weights_are_copied_once_and_released_on_detach() {
        let spec = ReferenceSpec::small("transformer", 3, 8, DType::F16);
        let c = reference::build(&spec).unwrap();
        let d = HostDevice::with_capacity(1 << 20).unwrap();
        let dev: Arc<dyn Device> = d.clone();
        let m = Arc::new(RouteMetrics::new());
        ResidentRoute
            .preflight(&c, &*dev, &RouteSpec::resident())
            .unwrap();
        let hooks = ResidentRoute
            .attach(&c, dev.clone(), &RouteSpec::resident(), m.clone())
            .unwrap();
        c.install_hooks(hooks.clone()).unwrap();
        assert_eq!(d.memory_info().allocated, c.param_bytes());
        let copies = m.counters().h2d_copies;
        for _ in 0..3 {
            c.forward(&*dev, reference::input(&spec, 2, 3).unwrap())
                .unwrap();
        }
        assert_eq!(m.counters().h2d_copies, copies, "weights moved again");
        assert!(c.remove_hooks(&hooks));
        hooks.detach().unwrap();
        assert_eq!(d.memory_info().allocated, 0);
        assert!(c.params().iter().all(|p| p.device().is_none()));
    }

    #[test]
    fn preflight_refuses_weights_that_do_not_fit() {
        let spec = ReferenceSpec::small("vae", 2, 16, DType::F32);
        let c = reference::build(&spec).unwrap();
        let small = HostDevice::with_capacity(64).unwrap();
        let err = ResidentRoute
            .preflight(&c, &*small, &RouteSpec::resident())
            .unwrap_err();
        assert!(
            matches!(
                err,
                CoreError::Refused {
                    refusal: Refusal::DoesNotFit { .. },
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(small.memory_info().allocated, 0);
    }
}
