//! Building blocks every route uses to move params: a [`ResidencyTable`] that makes params
//! resident on a device (allocate, copy, install) with reference counts, so a tied weight
//! shared by two groups is copied once and freed after its last user, undoing everything it
//! did when an operation fails halfway; [`pin_copy`], a pinned copy of a param's bytes, counted
//! against the device's pinned limit; and [`EagerLeafStreamer`], the leaf-by-leaf copies of
//! `linear_convolution` and `native_vmm`.
//! [`UploadRegistrations`] page-locks checkpoint-mapped params where they are for one
//! upload, so it runs at pinned speed instead of faulting the mapping in page by page.

use std::collections::HashMap;
use std::sync::Arc;

use ddo_metrics::RouteMetrics;

use crate::component::LeafId;
use crate::device::{Device, DeviceBuffer, Stream};
use crate::error::Result;
use crate::host_memory::{HostBuffer, HostSlice, merge_spans, register_span};
use crate::param::{Param, ParamId};

struct Entry {
    param: Arc<Param>,
    buffer: DeviceBuffer,
    refs: usize,
}

/// How freed device copies are given back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FreeMode {
    /// Drop now: the caller has made sure no queued work still reads the memory.
    Immediate,
    /// Stream-ordered: freed once the compute stream reaches this point (`record_stream`).
    AfterComputeStream,
}

/// Params made resident on one device, with reference counts.
#[derive(Default)]
pub struct ResidencyTable {
    entries: HashMap<ParamId, Entry>,
    resident_bytes: u64,
}

impl ResidencyTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes of device copies held.
    pub fn resident_bytes(&self) -> u64 {
        self.resident_bytes
    }

    /// Number of params held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether `id` is held.
    pub fn contains(&self, id: ParamId) -> bool {
        self.entries.contains_key(&id)
    }

    /// Makes `params` resident: a param already held gains a reference; any other is
    /// allocated, copied from `source(param)` on `stream`, and installed as the param's
    /// device copy. On error every param this call added is released again and the error
    /// returned.
    pub fn acquire(
        &mut self,
        device: &dyn Device,
        params: &[Arc<Param>],
        source: &dyn Fn(&Param) -> Result<HostSlice>,
        stream: &Stream,
        metrics: &RouteMetrics,
    ) -> Result<()> {
        let mut added: Vec<Arc<Param>> = Vec::new();
        let mut bumped: Vec<ParamId> = Vec::new();
        for p in params {
            if let Some(e) = self.entries.get_mut(&p.id()) {
                e.refs += 1;
                bumped.push(p.id());
                continue;
            }
            let placed = (|| -> Result<DeviceBuffer> {
                let src = source(p)?;
                let buffer = device.alloc(src.len())?;
                device.copy_h2d(&src, &buffer.slice_all(), stream)?;
                metrics.record_h2d(src.len() as u64);
                p.set_device(Some(buffer.slice_all()))?;
                Ok(buffer)
            })();
            match placed {
                Ok(buffer) => {
                    self.resident_bytes += buffer.len() as u64;
                    self.entries.insert(
                        p.id(),
                        Entry {
                            param: Arc::clone(p),
                            buffer,
                            refs: 1,
                        },
                    );
                    added.push(Arc::clone(p));
                }
                Err(e) => {
                    for id in bumped {
                        if let Some(entry) = self.entries.get_mut(&id) {
                            entry.refs -= 1;
                        }
                    }
                    self.release(device, &added, FreeMode::Immediate, stream);
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Drops one reference to each of `params`; a param whose last reference goes is
    /// uninstalled and its device copy freed as `mode` says. Params not held are ignored.
    pub fn release(
        &mut self,
        device: &dyn Device,
        params: &[Arc<Param>],
        mode: FreeMode,
        stream: &Stream,
    ) {
        for p in params {
            let last = match self.entries.get_mut(&p.id()) {
                Some(e) => {
                    e.refs -= 1;
                    e.refs == 0
                }
                None => false,
            };
            if last && let Some(e) = self.entries.remove(&p.id()) {
                self.free(device, e, mode, stream);
            }
        }
    }

    /// Releases everything, whatever the reference counts.
    pub fn release_all(&mut self, device: &dyn Device, mode: FreeMode, stream: &Stream) {
        let entries: Vec<Entry> = self.entries.drain().map(|(_, e)| e).collect();
        for e in entries {
            self.free(device, e, mode, stream);
        }
        self.resident_bytes = 0;
    }

    fn free(&mut self, device: &dyn Device, e: Entry, mode: FreeMode, stream: &Stream) {
        self.resident_bytes = self.resident_bytes.saturating_sub(e.buffer.len() as u64);
        // Uninstalling cannot fail: clearing a device copy has no length to check.
        let _ = e.param.set_device(None);
        match mode {
            FreeMode::Immediate => drop(e.buffer),
            FreeMode::AfterComputeStream => {
                // A backend that cannot queue the free leaves the buffer to be dropped now;
                // the caller synchronised or recorded work that owns another handle.
                let _ = device.release_after(e.buffer, stream);
            }
        }
    }
}

impl std::fmt::Debug for ResidencyTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ResidencyTable({} params, {} B)",
            self.entries.len(),
            self.resident_bytes
        )
    }
}

/// The state of a route that copies a leaf's weights to the device just before the leaf
/// runs and frees them just after (`linear_convolution`, and `native_vmm`'s streamed
/// leaves): the params on the device, copied from their own host bytes (which a route may
/// have made a pinned home), and the leaves onloaded now — at most the one running, plus any left behind by a leaf whose
/// computation failed (its `after_leaf` never ran).
#[derive(Debug)]
pub struct EagerLeafStreamer {
    table: ResidencyTable,
    onloaded: Vec<(LeafId, Vec<Arc<Param>>)>,
    detached: bool,
}

impl EagerLeafStreamer {
    /// A streamer over `table` (which may already hold resident params).
    pub fn new(table: ResidencyTable) -> Self {
        Self {
            table,
            onloaded: Vec::new(),
            detached: false,
        }
    }

    /// The params on the device.
    pub fn table(&self) -> &ResidencyTable {
        &self.table
    }

    /// Whether [`EagerLeafStreamer::detach`] ran.
    pub fn is_detached(&self) -> bool {
        self.detached
    }

    /// Whether `leaf` is onloaded now.
    pub fn is_onloaded(&self, leaf: LeafId) -> bool {
        self.onloaded.iter().any(|(id, _)| *id == leaf)
    }

    /// Copies `params` of `leaf` on the compute stream (so the leaf's compute is ordered
    /// after them) and installs them.
    pub fn onload(
        &mut self,
        device: &dyn Device,
        leaf: LeafId,
        params: &[Arc<Param>],
        metrics: &RouteMetrics,
    ) -> Result<()> {
        self.onload_from(device, leaf, params, metrics, &|p: &Param| Ok(p.host()))
    }

    /// [`EagerLeafStreamer::onload`], reading the params' bytes where `source` says (e.g. a
    /// streaming engine's
    /// [`host_source`](crate::streaming::StreamingEngine::host_source)).
    pub fn onload_from(
        &mut self,
        device: &dyn Device,
        leaf: LeafId,
        params: &[Arc<Param>],
        metrics: &RouteMetrics,
        source: &dyn Fn(&Param) -> Result<HostSlice>,
    ) -> Result<()> {
        let stream = device.compute_stream();
        self.table
            .acquire(device, params, source, &stream, metrics)?;
        self.onloaded.push((leaf, params.to_vec()));
        Ok(())
    }

    /// Frees every onloaded leaf once the compute stream has finished with it (in stream
    /// order when the synchronisation fails, whose error is returned). Params the table
    /// holds for other reasons (resident leaves) keep their references.
    pub fn offload_all(&mut self, device: &dyn Device) -> Result<()> {
        if self.onloaded.is_empty() {
            return Ok(());
        }
        let stream = device.compute_stream();
        let synced = device.synchronize_stream(&stream);
        let mode = if synced.is_ok() {
            FreeMode::Immediate
        } else {
            FreeMode::AfterComputeStream
        };
        for (_, params) in std::mem::take(&mut self.onloaded) {
            self.table.release(device, &params, mode, &stream);
        }
        synced
    }

    /// Releases every device copy and leaves each of `params`
    /// host-only. Idempotent; the device's synchronisation error, if any, is returned after
    /// everything was released (in stream order).
    pub fn detach(&mut self, device: &dyn Device, params: &[Arc<Param>]) -> Result<()> {
        if self.detached {
            return Ok(());
        }
        let synced = device.synchronize();
        let mode = if synced.is_ok() {
            FreeMode::Immediate
        } else {
            FreeMode::AfterComputeStream
        };
        self.table
            .release_all(device, mode, &device.compute_stream());
        self.onloaded.clear();
        for p in params {
            // Clearing a device copy cannot fail.
            let _ = p.set_device(None);
        }
        self.detached = true;
        synced
    }
}

/// A pinned copy of `src` (a CPU copy into newly pinned memory).
pub fn pin_copy(device: &dyn Device, src: &HostSlice) -> Result<HostBuffer> {
    let pinned = device.alloc_pinned(src.len())?;
    src.with_bytes(|bytes| pinned.with_bytes_mut(|dst| dst.copy_from_slice(bytes)))?;
    Ok(pinned)
}

/// The checkpoint mappings of some params page-locked in place for one upload: each
/// mapping's block-rounded ranges ([`register_span`]) merged, so every mapped param lies
/// wholly in one registration. A copy from a registered view runs at pinned speed; from the
/// plain mapping it faults the file's pages in one by one (on the H200's host VM a 10.9 GB
/// upload from a warm page cache ran at about 3 GB/s that way). Dropping it unregisters
/// (copies queued from a view hold it until they complete).
#[derive(Debug, Default)]
pub struct UploadRegistrations {
    views: Vec<HostBuffer>,
}

impl UploadRegistrations {
    /// Registers the mapped ranges of `params` on `device` when they fit in the pinned room
    /// it has left; where they do not, or the device cannot register them
    /// ([`CoreError::HostRegisterUnsupported`], [`CoreError::PinnedLimit`]), nothing is
    /// registered and [`UploadRegistrations::source`] gives every param its own bytes (the
    /// upload then runs as it would have). Any other device failure is returned, with
    /// nothing left registered.
    ///
    /// [`CoreError::HostRegisterUnsupported`]: crate::CoreError::HostRegisterUnsupported
    /// [`CoreError::PinnedLimit`]: crate::CoreError::PinnedLimit
    pub fn register(device: &dyn Device, params: &[Arc<Param>]) -> Result<Self> {
        let mut maps: Vec<(
            Arc<crate::host_memory::CheckpointMap>,
            Vec<std::ops::Range<usize>>,
        )> = Vec::new();
        for p in params {
            let host = p.host();
            let Some((map, range)) = host.mapped_range() else {
                continue;
            };
            let r = register_span(map.len(), range.start, range.len());
            match maps.iter_mut().find(|(m, _)| Arc::ptr_eq(m, map)) {
                Some((_, ranges)) => ranges.push(r),
                None => maps.push((Arc::clone(map), vec![r])),
            }
        }
        let mut spans = Vec::new();
        for (map, ranges) in maps {
            spans.extend(
                merge_spans(ranges)
                    .into_iter()
                    .map(|r| (Arc::clone(&map), r)),
            );
        }
        let bytes: u64 = spans.iter().map(|(_, r)| r.len() as u64).sum();
        if spans.is_empty() || bytes > device.memory_info().pinned_room() {
            return Ok(Self::default());
        }
        let mut views = Vec::with_capacity(spans.len());
        for (map, range) in spans {
            let registered = HostBuffer::mapped(map, range.start, range.len())
                .and_then(|view| device.register_host(&view));
            match registered {
                Ok(v) => views.push(v),
                // Refused (unsupported, over the limit meanwhile): the plain path for all.
                Err(
                    crate::CoreError::HostRegisterUnsupported { .. }
                    | crate::CoreError::PinnedLimit { .. },
                ) => return Ok(Self::default()),
                Err(e) => return Err(e),
            }
        }
        Ok(Self { views })
    }

    /// Where to upload `p` from: its range of a registered view, else its own bytes.
    pub fn source(&self, p: &Param) -> Result<HostSlice> {
        let src = p.host();
        let Some((map, range)) = src.mapped_range() else {
            return Ok(src);
        };
        for view in &self.views {
            let Some((m, offset, len)) = view.registered_base().and_then(HostBuffer::mapping)
            else {
                continue;
            };
            if Arc::ptr_eq(m, map) && offset <= range.start && range.end <= offset + len {
                return view.slice(range.start - offset, range.len());
            }
        }
        Ok(src)
    }

    /// Bytes page-locked.
    pub fn bytes(&self) -> u64 {
        self.views.iter().map(|v| v.len() as u64).sum()
    }

    /// Hands the registrations back to `device` once the upload no longer needs them
    /// ([`Device::release_host`]: a backend whose unregistering stalls queued work unpins
    /// them when the device is idle).
    pub fn release(self, device: &dyn Device) {
        for view in self.views {
            device.release_host(view);
        }
    }
}
