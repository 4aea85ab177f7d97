//! [`Param`]: one weight or buffer of a component, with a stable id, its host source and
//! its current device residency. A tied weight is one `Arc<Param>` registered under two
//! names (an exact alias); routes and detach treat it as one storage.

use std::fmt;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::RwLock;

use crate::checkpoint::Checkpoint;
use crate::device::DeviceSlice;
use crate::dtype::DType;
use crate::error::{CoreError, Result};
use crate::host_memory::{HostBuffer, HostMemoryKind, HostSlice};
use crate::tensor::{Tensor, TensorStorage, byte_len};

/// Stable identity of a param for the life of the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ParamId(u64);

impl ParamId {
    fn next() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        ParamId(NEXT.fetch_add(1, Ordering::Relaxed))
    }

    /// The raw id.
    pub fn get(self) -> u64 {
        self.0
    }
}

/// Whether a param is a trained weight or a buffer (running statistics, tables).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParamKind {
    /// A weight.
    Parameter,
    /// A buffer.
    Buffer,
}

/// Where a param's bytes came from. Kept unchanged when the host bytes are detached from
/// the checkpoint into owned memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceDescriptor {
    /// Checkpoint file.
    pub file: PathBuf,
    /// Tensor name in the file.
    pub tensor: String,
    /// Absolute byte range in the file.
    pub range: Range<usize>,
}

struct ParamState {
    host: HostSlice,
    device: Option<DeviceSlice>,
}

/// One weight or buffer.
pub struct Param {
    id: ParamId,
    name: String,
    kind: ParamKind,
    dtype: DType,
    shape: Vec<usize>,
    source: Option<SourceDescriptor>,
    /// The per-tensor dequantization scale of a scaled fp8 weight (values are
    /// `decode(byte) * scale`); carried by every tensor made from the param.
    scale: Option<f32>,
    /// The GGUF block layout of a quantized weight stored as its blocks
    /// ([`crate::tensor::QuantLayout`]); carried by every tensor made from the param.
    quant: Option<Arc<crate::tensor::QuantLayout>>,
    state: RwLock<ParamState>,
}

impl Param {
    /// A param over host bytes (which must hold exactly `shape` of `dtype`).
    pub fn new(
        name: impl Into<String>,
        kind: ParamKind,
        dtype: DType,
        shape: Vec<usize>,
        host: HostSlice,
    ) -> Result<Arc<Self>> {
        let name = name.into();
        let expected = byte_len(&shape, dtype)?;
        if host.len() != expected {
            return Err(CoreError::SizeMismatch {
                what: format!("param `{name}` of shape {shape:?} and dtype {dtype}"),
                expected,
                actual: host.len(),
            });
        }
        let source = host.mapped_range().map(|(map, range)| SourceDescriptor {
            file: map.path().to_path_buf(),
            tensor: name.clone(),
            range,
        });
        Ok(Arc::new(Self {
            id: ParamId::next(),
            name,
            kind,
            dtype,
            shape,
            source,
            scale: None,
            quant: None,
            state: RwLock::new(ParamState { host, device: None }),
        }))
    }

    /// A param whose host bytes are `values` encoded as `dtype`, in pageable memory.
    pub fn from_f32(
        name: impl Into<String>,
        kind: ParamKind,
        dtype: DType,
        shape: Vec<usize>,
        values: &[f32],
    ) -> Result<Arc<Self>> {
        let bytes = dtype.encode_f32(values)?;
        Self::new(
            name,
            kind,
            dtype,
            shape,
            HostBuffer::pageable_from(&bytes).slice_all(),
        )
    }

    /// A checkpoint-backed param over tensor `tensor` of `checkpoint`, registered as `name`.
    pub fn from_checkpoint(
        checkpoint: &Checkpoint,
        tensor: &str,
        name: impl Into<String>,
        kind: ParamKind,
    ) -> Result<Arc<Self>> {
        let info = checkpoint.tensor(tensor)?.clone();
        let host = checkpoint.host_buffer(tensor)?.slice_all();
        let mut param = Self::new(name, kind, info.dtype, info.shape, host)?;
        if let Some(p) = Arc::get_mut(&mut param) {
            p.source = Some(SourceDescriptor {
                file: checkpoint.path().to_path_buf(),
                tensor: tensor.to_string(),
                range: info.offset..info.offset + info.len,
            });
            p.quant = info.quant;
        }
        Ok(param)
    }

    /// The param with a per-tensor dequantization `scale` (a scaled fp8 weight, e.g. a
    /// checkpoint's `<layer>.scale_weight`); only an 8-bit float takes one, finite and
    /// positive. Call it on a param no one else holds yet (as a loader does).
    pub fn with_scale(mut param: Arc<Self>, scale: f32) -> Result<Arc<Self>> {
        crate::tensor::check_scale(&param.name, param.dtype, Some(scale))?;
        match Arc::get_mut(&mut param) {
            Some(p) => {
                p.scale = Some(scale);
                Ok(param)
            }
            None => Err(CoreError::Shape {
                what: format!("param `{}` scale", param.name),
                message: "the param is already shared; give the scale when it is made".into(),
            }),
        }
    }

    /// The per-tensor dequantization scale of a scaled fp8 weight.
    pub fn scale(&self) -> Option<f32> {
        self.scale
    }

    /// The param holding GGUF blocks of `quant` (a [`DType::Quantized`] param of shape
    /// `[quant.bytes()]`). Call it on a param no one else holds yet (as a loader does).
    pub fn with_quant(
        mut param: Arc<Self>,
        quant: Arc<crate::tensor::QuantLayout>,
    ) -> Result<Arc<Self>> {
        if param.dtype != DType::Quantized || param.shape != [quant.bytes()] {
            return Err(CoreError::Shape {
                what: format!("param `{}`", param.name),
                message: format!(
                    "{:?} of {} does not hold {} blocks of shape {:?}",
                    param.shape,
                    param.dtype,
                    quant.ty.name(),
                    quant.shape
                ),
            });
        }
        match Arc::get_mut(&mut param) {
            Some(p) => {
                p.quant = Some(quant);
                Ok(param)
            }
            None => Err(CoreError::Shape {
                what: format!("param `{}` layout", param.name),
                message: "the param is already shared; give the layout when it is made".into(),
            }),
        }
    }

    /// The GGUF block layout of a quantized weight.
    pub fn quant(&self) -> Option<&Arc<crate::tensor::QuantLayout>> {
        self.quant.as_ref()
    }

    /// The shape the model sees: the dequantized shape of a quantized weight, else
    /// [`Param::shape`].
    pub fn logical_shape(&self) -> &[usize] {
        self.quant.as_ref().map_or(&self.shape, |q| &q.shape)
    }

    /// Stable id.
    pub fn id(&self) -> ParamId {
        self.id
    }

    /// Canonical name (the first name it was registered under).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Weight or buffer.
    pub fn kind(&self) -> ParamKind {
        self.kind
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Bytes of storage.
    pub fn nbytes(&self) -> usize {
        self.state.read().host.len()
    }

    /// Where the bytes came from, for a checkpoint-loaded param.
    pub fn source(&self) -> Option<&SourceDescriptor> {
        self.source.as_ref()
    }

    /// The host copy of the bytes.
    pub fn host(&self) -> HostSlice {
        self.state.read().host.clone()
    }

    /// Whether the host bytes still point into a checkpoint mapping.
    pub fn is_checkpoint_backed(&self) -> bool {
        self.state.read().host.kind() == HostMemoryKind::CheckpointMapped
    }

    /// The device copy, when the param is resident on a device.
    pub fn device(&self) -> Option<DeviceSlice> {
        self.state.read().device.clone()
    }

    /// Sets (or clears) the device copy; returns the previous one. Routes call this.
    pub fn set_device(&self, device: Option<DeviceSlice>) -> Result<Option<DeviceSlice>> {
        if let Some(d) = &device
            && d.len() != self.nbytes()
        {
            return Err(CoreError::SizeMismatch {
                what: format!("device copy of `{}`", self.name),
                expected: self.nbytes(),
                actual: d.len(),
            });
        }
        Ok(std::mem::replace(&mut self.state.write().device, device))
    }

    /// Replaces the host bytes with an equally long slice; returns the previous one.
    /// Identity, dtype, shape and source descriptor are unchanged.
    pub fn replace_host(&self, host: HostSlice) -> Result<HostSlice> {
        let mut st = self.state.write();
        if host.len() != st.host.len() {
            return Err(CoreError::SizeMismatch {
                what: format!("new host bytes of `{}`", self.name),
                expected: st.host.len(),
                actual: host.len(),
            });
        }
        Ok(std::mem::replace(&mut st.host, host))
    }

    /// The param as a host tensor (shares the bytes).
    pub fn host_tensor(&self) -> Result<Tensor> {
        Tensor::new(
            self.shape.clone(),
            self.dtype,
            TensorStorage::Host(self.host()),
        )?
        .with_scale(self.scale)?
        .with_quant(self.quant.clone())
    }

    /// The param as a device tensor, when resident.
    pub fn device_tensor(&self) -> Option<Tensor> {
        self.device().and_then(|d| {
            Tensor::new(self.shape.clone(), self.dtype, TensorStorage::Device(d))
                .and_then(|t| t.with_scale(self.scale))
                .and_then(|t| t.with_quant(self.quant.clone()))
                .ok()
        })
    }

    /// FNV-1a checksum of the host bytes, for tests that prove weights were not changed.
    pub fn host_checksum(&self) -> u64 {
        self.host().with_bytes(fnv1a)
    }
}

/// FNV-1a 64-bit hash of `bytes`.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

impl fmt::Debug for Param {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Param({}, {:?} {} {:?}, host {:?}, resident {})",
            self.name,
            self.kind,
            self.dtype,
            self.shape,
            self.state.read().host.kind(),
            self.state.read().device.is_some()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_and_bytes_must_match_the_shape() {
        let a =
            Param::from_f32("a", ParamKind::Parameter, DType::F32, vec![2], &[1.0, 2.0]).unwrap();
        let b = Param::from_f32("b", ParamKind::Buffer, DType::F16, vec![1], &[1.0]).unwrap();
        assert_ne!(a.id(), b.id());
        assert_eq!(b.nbytes(), 2);
        let short = HostBuffer::pageable_zeroed(3).slice_all();
        assert!(Param::new("c", ParamKind::Parameter, DType::F32, vec![1], short).is_err());
    }

    #[test]
    fn replace_host_keeps_identity_and_refuses_other_lengths() {
        let p =
            Param::from_f32("w", ParamKind::Parameter, DType::F32, vec![2], &[1.0, 2.0]).unwrap();
        let before = p.host_checksum();
        let copy = HostBuffer::pageable_from(&p.host().to_vec()).slice_all();
        p.replace_host(copy).unwrap();
        assert_eq!(p.host_checksum(), before);
        assert!(
            p.replace_host(HostBuffer::pageable_zeroed(4).slice_all())
                .is_err()
        );
    }
}
