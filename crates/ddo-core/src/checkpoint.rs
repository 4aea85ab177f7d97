//! The safetensors checkpoint reader: [`Checkpoint`] opens a file as a read-only
//! [`CheckpointMap`] and validates its header (length, JSON with unique names
//! ([`UniqueMap`]), each tensor's dtype, shape, byte count and offsets) before any tensor is
//! handed out as a checkpoint-mapped [`HostBuffer`]; [`CheckpointTensor`] is one header
//! entry. The mapping and the host buffers themselves live in [`crate::host_memory`].

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use crate::dtype::DType;
use crate::error::{CoreError, Result};
use crate::host_memory::{CheckpointMap, HostBuffer};

/// One tensor's entry in a checkpoint header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointTensor {
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<usize>,
    /// Absolute byte offset in the file.
    pub offset: usize,
    /// Byte length.
    pub len: usize,
    /// A GGUF file's quantized tensor: its block layout (`dtype` is then
    /// [`DType::Quantized`] and `shape` `[len]`); `None` for every safetensors tensor.
    pub quant: Option<Arc<crate::tensor::QuantLayout>>,
    /// A coded tensor of a `ddo convert --compress lossless` file ([`CODED_METADATA_KEY`]):
    /// `offset` and `len` are its coded unit's bytes, `dtype` and `shape` what it decodes
    /// to, and this its validated unit header. `None` for a tensor stored as it is.
    pub coded: Option<Arc<ddo_codec::UnitHeader>>,
}

/// The `__metadata__` key of a safetensors file that holds coded tensors (`ddo convert
/// --compress lossless`): a JSON object, as a string, naming each coded tensor with the
/// dtype and shape it decodes to, `{"name": {"dtype": "BF16", "shape": [3072, 3072]}}`.
/// Each such tensor is stored as `U8` bytes `[len]`: one unit of `ddo-codec`'s format (its
/// header, tables and the decoded words' checksum). Other tools see the bytes; DDO reads
/// the tensor as the weights it decodes to.
pub const CODED_METADATA_KEY: &str = "ddo.coded";

/// An opened, memory-mapped safetensors checkpoint. Tensors handed out by
/// [`Checkpoint::host_buffer`] point into the mapping (they are checkpoint-backed); the
/// mapping is unmapped when the last of them, and this value, are dropped.
#[derive(Debug)]
pub struct Checkpoint {
    map: Arc<CheckpointMap>,
    tensors: BTreeMap<String, CheckpointTensor>,
    unsupported: BTreeMap<String, Unsupported>,
}

/// A tensor of a dtype DDO does not load as weights: its header dtype name, shape and
/// bytes (absolute offset and length), for [`Checkpoint::raw`].
#[derive(Debug, Clone)]
struct Unsupported {
    dtype: String,
    shape: Vec<usize>,
    offset: usize,
    len: usize,
}

/// One tensor's bytes as stored, whatever its dtype ([`Checkpoint::raw`]).
#[derive(Debug, Clone, Copy)]
pub struct RawTensor<'a> {
    /// The header's dtype name (`I64`, `BOOL`, `F32`, ...); tensors DDO loads give their
    /// [`DType`]'s name.
    pub dtype: &'a str,
    /// Shape.
    pub shape: &'a [usize],
    /// The little-endian bytes, checked against the shape and the data.
    pub bytes: &'a [u8],
}

/// A JSON object read with its keys in file order, refusing a key that appears twice (a
/// plain map would keep the last silently: a checkpoint header or a sharded index with a
/// duplicate tensor name is ambiguous, so DDO refuses it).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UniqueMap(pub Vec<(String, serde_json::Value)>);

impl<'de> serde::Deserialize<'de> for UniqueMap {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = UniqueMap;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object with unique keys")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<UniqueMap, A::Error> {
                let mut seen = std::collections::BTreeSet::new();
                let mut entries = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    if !seen.insert(key.clone()) {
                        return Err(serde::de::Error::custom(format!("duplicate name `{key}`")));
                    }
                    entries.push((key, map.next_value()?));
                }
                Ok(UniqueMap(entries))
            }
        }
        deserializer.deserialize_map(Visitor)
    }
}

/// Largest safetensors header DDO reads (100 MiB, as the format's reference reader allows).
pub const MAX_HEADER_BYTES: u64 = 100 * 1024 * 1024;

impl Checkpoint {
    /// Opens and validates `path`: the header length against the file, the header JSON,
    /// each tensor's dtype, shape, byte count and offsets (inside the data, not
    /// overlapping). Errors name the file and, where one is at fault, the tensor. Nothing
    /// is allocated in proportion to what the header claims. A tensor of a dtype DDO does
    /// not load (f64, integers, ...) is listed but refused when asked for.
    pub fn open(path: &Path) -> Result<Self> {
        let map = CheckpointMap::open(path)?;
        let (tensors, unsupported) = Self::parse(map.bytes(), path, &|range| map.prefetch(range))?;
        Ok(Self {
            map,
            tensors,
            unsupported,
        })
    }

    /// A checkpoint over a mapping already made ([`CheckpointMap::in_memory`]: safetensors
    /// bytes built in memory, as a GGUF file dequantized at load), validated as
    /// [`Checkpoint::open`] validates a file; errors name the mapping's label.
    pub fn from_map(map: Arc<CheckpointMap>) -> Result<Self> {
        let (tensors, unsupported) =
            Self::parse(map.bytes(), map.path(), &|range| map.prefetch(range))?;
        Ok(Self {
            map,
            tensors,
            unsupported,
        })
    }

    /// A GGUF file's tensors as a checkpoint over its own mapping (no copy, no
    /// dequantization): F32, F16 and BF16 tensors as those dtypes, quantized ones as
    /// [`DType::Quantized`] bytes `[len]` carrying their block layout
    /// ([`CheckpointTensor::quant`]), which params and tensors made from them keep, so
    /// routes move the blocks as stored and [`crate::Ops::dequantize`] expands them where
    /// they are used.
    pub fn from_gguf(file: &crate::gguf::GgufFile) -> Result<Self> {
        use crate::gguf::GgmlType;
        let mut tensors = BTreeMap::new();
        for t in file.tensors() {
            let (dtype, shape, quant) = match t.ggml_type {
                GgmlType::F32 => (DType::F32, t.shape.clone(), None),
                GgmlType::F16 => (DType::F16, t.shape.clone(), None),
                GgmlType::BF16 => (DType::BF16, t.shape.clone(), None),
                ty => {
                    let q = crate::tensor::QuantLayout::new(&t.name, ty, t.shape.clone())?;
                    (DType::Quantized, vec![t.nbytes], Some(Arc::new(q)))
                }
            };
            tensors.insert(
                t.name.clone(),
                CheckpointTensor {
                    dtype,
                    shape,
                    offset: t.offset,
                    len: t.nbytes,
                    quant,
                    coded: None,
                },
            );
        }
        Ok(Self {
            map: Arc::clone(file.map()),
            tensors,
            unsupported: BTreeMap::new(),
        })
    }

    /// Validates the bytes of a safetensors file as [`Checkpoint::open`] does, without a
    /// file (`path` only names it in errors); returns the number of tensors listed. For
    /// fuzzing and for checking bytes before they are written.
    pub fn validate_bytes(bytes: &[u8], path: &Path) -> Result<usize> {
        let (tensors, unsupported) = Self::parse(bytes, path, &|_| ())?;
        Ok(tensors.len() + unsupported.len())
    }

    #[allow(clippy::type_complexity)]
    /// `prefetch` is asked for the head of each coded tensor (its unit's header and tables,
    /// which the header check reads) before any is read: on a cold disk the reads then run
    /// together instead of one seek per tensor (about 4 s for FLUX.1-dev's 1,000 tensors).
    fn parse(
        bytes: &[u8],
        path: &Path,
        prefetch: &dyn Fn(std::ops::Range<usize>),
    ) -> Result<(
        BTreeMap<String, CheckpointTensor>,
        BTreeMap<String, Unsupported>,
    )> {
        let bad = |message: String| CoreError::Checkpoint {
            path: path.to_path_buf(),
            message,
        };
        let header_len = bytes
            .get(..8)
            .map(|b| u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
            .ok_or_else(|| {
                bad(format!(
                    "file is {} B, shorter than the 8-byte header length",
                    bytes.len()
                ))
            })?;
        let available = (bytes.len() - 8) as u64;
        if header_len > available.min(MAX_HEADER_BYTES) {
            return Err(bad(format!(
                "header length {header_len} B exceeds the file ({available} B after the length) or the \
                 {MAX_HEADER_BYTES} B limit; the file is truncated or not safetensors"
            )));
        }
        let header_end = 8 + header_len as usize;
        let header = std::str::from_utf8(&bytes[8..header_end])
            .map_err(|e| bad(format!("header is not UTF-8: {e}")))?;
        let json: UniqueMap = serde_json::from_str(header)
            .map_err(|e| bad(format!("header is not a JSON object: {e}")))?;
        let data_len = bytes.len() - header_end;
        let mut coded = coded_entries(&json).map_err(&bad)?;
        let mut tensors = BTreeMap::new();
        let mut unsupported = BTreeMap::new();
        let mut ranges: Vec<(usize, usize, &str)> = Vec::new();
        // The pages the coded tensors' header checks read, asked for together: first each
        // unit's head, then (from the head's fixed fields, which the check itself validates)
        // the pages of its two padding gaps, after the sign+mantissa bytes and at the end.
        let mut units = Vec::new();
        for (name, entry) in &json.0 {
            let (Some((_, shape)), Some(offsets)) =
                (coded.get(name.as_str()), sizes(entry.get("data_offsets")))
            else {
                continue;
            };
            let [start, end] = offsets[..] else { continue };
            let words = shape.iter().fold(1usize, |a, &d| a.saturating_mul(d));
            let head = coded_head_bytes(words);
            let (at, end) = (
                header_end.saturating_add(start),
                header_end.saturating_add(end).min(bytes.len()),
            );
            prefetch(at..at.saturating_add(head).min(end));
            units.push((at, end));
        }
        for &(at, end) in &units {
            let field = |o: usize| -> usize {
                bytes
                    .get(at + o..at + o + 8)
                    .and_then(|b| b.try_into().ok())
                    .map_or(0, |b| u64::from_le_bytes(b) as usize)
            };
            let (words, mantissa, stream, stream_words) =
                (field(8), field(72), field(80), field(88));
            let gap = at.saturating_add(mantissa).saturating_add(words);
            prefetch(gap.saturating_sub(1).min(end)..gap.saturating_add(4096).min(end));
            let tail = at
                .saturating_add(stream)
                .saturating_add(stream_words.saturating_mul(2));
            prefetch(tail.saturating_sub(1).min(end)..end);
        }
        for (name, entry) in &json.0 {
            if name == "__metadata__" {
                continue;
            }
            let dtype_name = entry
                .get("dtype")
                .and_then(|d| d.as_str())
                .ok_or_else(|| bad(format!("tensor `{name}` has no string `dtype`")))?;
            let shape = sizes(entry.get("shape"))
                .ok_or_else(|| bad(format!("tensor `{name}`: `shape` is not a list of sizes")))?;
            let offsets = sizes(entry.get("data_offsets"))
                .filter(|v| v.len() == 2)
                .ok_or_else(|| {
                    bad(format!(
                        "tensor `{name}`: `data_offsets` is not [start, end]"
                    ))
                })?;
            let (start, end) = (offsets[0], offsets[1]);
            if start > end || end > data_len {
                return Err(bad(format!(
                    "tensor `{name}`: data offsets {start}..{end} fall outside the {data_len} B of data; \
                     the file is truncated or corrupt"
                )));
            }
            let element_size = match dtype_name {
                "F32" | "I32" | "U32" => 4,
                "F16" | "BF16" | "I16" | "U16" => 2,
                "U8" | "I8" | "BOOL" | "F8_E4M3" | "F8_E5M2" => 1,
                "F64" | "I64" | "U64" => 8,
                other => {
                    return Err(bad(format!("tensor `{name}` has unknown dtype `{other}`")));
                }
            };
            let needed = shape
                .iter()
                .try_fold(element_size, |acc: usize, &d| acc.checked_mul(d))
                .ok_or_else(|| bad(format!("tensor `{name}`: shape {shape:?} overflows")))?;
            if needed != end - start {
                return Err(bad(format!(
                    "tensor `{name}`: shape {shape:?} of {dtype_name} needs {needed} B but its offsets span {} B",
                    end - start
                )));
            }
            ranges.push((start, end, name));
            if let Some((dtype, shape)) = coded.remove(name.as_str()) {
                let unit = &bytes[header_end + start..header_end + end];
                let header = coded_header(name, dtype_name, dtype, &shape, unit).map_err(&bad)?;
                tensors.insert(
                    name.clone(),
                    CheckpointTensor {
                        dtype,
                        shape,
                        offset: header_end + start,
                        len: end - start,
                        quant: None,
                        coded: Some(Arc::new(header)),
                    },
                );
                continue;
            }
            let dtype = DType::from_header_name(dtype_name);
            match dtype {
                Some(dtype) => {
                    tensors.insert(
                        name.clone(),
                        CheckpointTensor {
                            dtype,
                            shape,
                            offset: header_end + start,
                            len: end - start,
                            quant: None,
                            coded: None,
                        },
                    );
                }
                None => {
                    unsupported.insert(
                        name.clone(),
                        Unsupported {
                            dtype: dtype_name.to_string(),
                            shape,
                            offset: header_end + start,
                            len: end - start,
                        },
                    );
                }
            }
        }
        if let Some(name) = coded.keys().next() {
            return Err(bad(format!(
                "`__metadata__` `{CODED_METADATA_KEY}` names `{name}`, which the file does not hold; \
                 convert the folder again with ddo convert --compress lossless"
            )));
        }
        ranges.sort_unstable();
        for pair in ranges.windows(2) {
            let ((_, a_end, a), (b_start, _, b)) = (pair[0], pair[1]);
            if b_start < a_end {
                return Err(bad(format!("tensors `{a}` and `{b}` overlap in the data")));
            }
        }
        Ok((tensors, unsupported))
    }

    /// The mapped file.
    pub fn path(&self) -> &Path {
        self.map.path()
    }

    /// The mapping.
    pub fn map(&self) -> &Arc<CheckpointMap> {
        &self.map
    }

    /// Tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// A tensor's header entry. A tensor of a dtype DDO does not load is a typed error
    /// naming it and its dtype.
    pub fn tensor(&self, name: &str) -> Result<&CheckpointTensor> {
        if let Some(Unsupported { dtype, .. }) = self.unsupported.get(name) {
            return Err(CoreError::Checkpoint {
                path: self.path().to_path_buf(),
                message: format!(
                    "tensor `{name}` has dtype {dtype}, which DDO does not load (f32, f16, bf16, u8/i8 quantized)"
                ),
            });
        }
        self.tensors
            .get(name)
            .ok_or_else(|| CoreError::MissingTensor {
                path: self.path().to_path_buf(),
                name: name.to_string(),
            })
    }

    /// Tensors present but of a dtype DDO does not load, with that dtype.
    pub fn unsupported(&self) -> impl Iterator<Item = (&str, &str)> {
        self.unsupported
            .iter()
            .map(|(n, u)| (n.as_str(), u.dtype.as_str()))
    }

    /// A tensor's bytes as stored with its dtype name and shape, whatever its dtype (masks
    /// of integers or booleans, say, which are data, not weights); `None` when the file has
    /// no tensor of that name, or when it is coded (it has no bytes of its dtype in the file:
    /// read it through [`Checkpoint::host_buffer`]).
    pub fn raw(&self, name: &str) -> Option<RawTensor<'_>> {
        let bytes = self.map.bytes();
        if let Some(u) = self.unsupported.get(name) {
            return Some(RawTensor {
                dtype: &u.dtype,
                shape: &u.shape,
                bytes: bytes.get(u.offset..u.offset + u.len)?,
            });
        }
        let t = self.tensors.get(name).filter(|t| t.coded.is_none())?;
        Some(RawTensor {
            dtype: match t.dtype {
                DType::F32 => "F32",
                DType::F16 => "F16",
                DType::BF16 => "BF16",
                DType::F8E4M3 => "F8_E4M3",
                DType::F8E5M2 => "F8_E5M2",
                DType::Quantized => "U8",
            },
            shape: &t.shape,
            bytes: bytes.get(t.offset..t.offset + t.len)?,
        })
    }

    /// A new checkpoint-backed host buffer over one tensor's bytes: for a coded tensor, a
    /// buffer that decodes them where they are read ([`HostBuffer::coded`]).
    pub fn host_buffer(&self, name: &str) -> Result<HostBuffer> {
        let t = self.tensor(name)?;
        match &t.coded {
            Some(header) => HostBuffer::coded(
                Arc::clone(&self.map),
                name,
                t.offset,
                t.len,
                Arc::clone(header),
            ),
            None => HostBuffer::mapped(Arc::clone(&self.map), t.offset, t.len),
        }
    }

    /// Whether any tensor is stored coded.
    pub fn has_coded(&self) -> bool {
        self.tensors.values().any(|t| t.coded.is_some())
    }
}

/// Bytes at the start of a coded unit of `words` words that its header check reads: the
/// fixed header, the code table, a decode table of up to 8 KiB and the chunk table, with a
/// page to spare.
fn coded_head_bytes(words: usize) -> usize {
    let chunks = words.div_ceil(ddo_codec::CHUNK_WORDS);
    ddo_codec::HEADER_BYTES + 512 + 8192 + 4 * (chunks + 1) + 4096
}

/// A header's list of sizes (a shape, data offsets), `None` where it is not one.
fn sizes(v: Option<&serde_json::Value>) -> Option<Vec<usize>> {
    v?.as_array()?
        .iter()
        .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
        .collect()
}

/// The coded tensors a header's `__metadata__` names ([`CODED_METADATA_KEY`]): name ->
/// (dtype, shape) they decode to. No key: none. Errors say what is wrong with the entry.
fn coded_entries(
    json: &UniqueMap,
) -> std::result::Result<BTreeMap<String, (DType, Vec<usize>)>, String> {
    let Some(meta) = json
        .0
        .iter()
        .find(|(k, _)| k == "__metadata__")
        .map(|(_, v)| v)
    else {
        return Ok(BTreeMap::new());
    };
    let Some(text) = meta.get(CODED_METADATA_KEY) else {
        return Ok(BTreeMap::new());
    };
    let bad = |why: String| {
        format!(
            "`__metadata__` `{CODED_METADATA_KEY}` {why}; convert the folder again with ddo convert --compress lossless"
        )
    };
    let text = text.as_str().ok_or_else(|| bad("is not a string".into()))?;
    let entries: UniqueMap =
        serde_json::from_str(text).map_err(|e| bad(format!("is not a JSON object: {e}")))?;
    let mut out = BTreeMap::new();
    for (name, entry) in entries.0 {
        let dtype = entry
            .get("dtype")
            .and_then(|d| d.as_str())
            .and_then(DType::from_header_name)
            .filter(|d| matches!(d, DType::BF16 | DType::F16))
            .ok_or_else(|| {
                bad(format!(
                    "gives `{name}` no 16-bit float `dtype` (BF16 or F16)"
                ))
            })?;
        let shape = sizes(entry.get("shape"))
            .ok_or_else(|| bad(format!("gives `{name}` no `shape` list")))?;
        out.insert(name, (dtype, shape));
    }
    Ok(out)
}

/// The validated unit header of the coded tensor `name` (stored as `stored` bytes `unit`):
/// stored as `U8`, a unit `ddo_codec` parses, decoding to the bytes of `shape` in `dtype`.
fn coded_header(
    name: &str,
    stored: &str,
    dtype: DType,
    shape: &[usize],
    unit: &[u8],
) -> std::result::Result<ddo_codec::UnitHeader, String> {
    if stored != "U8" {
        return Err(format!(
            "coded tensor `{name}` is stored as {stored}, not U8 bytes; convert the folder again"
        ));
    }
    let header = ddo_codec::UnitHeader::parse(unit).map_err(|e| {
        format!("coded tensor `{name}`: {e}; the file is corrupt: convert the folder again")
    })?;
    let want = shape
        .iter()
        .try_fold(dtype.size_in_bytes(), |a: usize, &d| a.checked_mul(d))
        .ok_or_else(|| format!("coded tensor `{name}`: shape {shape:?} overflows"))?;
    if header.decoded_len() != want as u64 || header.encoded_len() != unit.len() as u64 {
        return Err(format!(
            "coded tensor `{name}` decodes to {} B in {} B of unit, its shape {shape:?} of {} needs {want} B in {} B; \
             the file is corrupt: convert the folder again",
            header.decoded_len(),
            header.encoded_len(),
            dtype.as_str(),
            unit.len()
        ));
    }
    Ok(header)
}
