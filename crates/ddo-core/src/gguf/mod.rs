//! The GGUF file reader: the counterpart of the safetensors reader ([`crate::checkpoint`])
//! for llama.cpp's GGUF files, whose quantized weights (Q4_K, Q8_0, ...) routes stream to
//! the device as stored and dequantize there.
//!
//! [`GgufFile::open`] maps a file read-only as a [`CheckpointMap`] and validates all of it
//! before anything is handed out: the header (magic, version 2 or 3, little-endian), every
//! metadata value ([`GgufValue`], arrays nested at most [`MAX_ARRAY_DEPTH`] deep), every
//! tensor's info ([`GgufTensorInfo`]: name, dims, [`GgmlType`], offset) and where its bytes
//! lie (aligned, whole blocks, inside the file, not overlapping another's).
//! [`GgufFile::validate_bytes`] runs the same validator on bytes without a file, for the
//! fuzz target and tests. Every failure is a [`CoreError::Gguf`] naming the file and the
//! field at fault, and nothing is allocated in proportion to a size the file claims before
//! that size is checked against the bytes that remain.
//!
//! Layout (all little-endian): magic `GGUF`, version `u32`, tensor count `u64`, metadata
//! count `u64`; each metadata entry a key string, a value type `u32` and a value; each
//! tensor info a name string, `n_dims` `u32`, `n_dims` dims `u64` (ggml order: `dims[0]`
//! varies fastest), a type `u32` and an offset `u64` relative to the data section, which
//! starts at the end of the infos rounded up to `general.alignment` (default 32). A string
//! is a `u64` byte length and UTF-8 bytes; an array an element type `u32`, a count `u64`
//! and the elements.
//!
//! The block formats and their host dequantization are [`quant`].

mod convert;
pub mod quant;
mod value;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

pub use convert::dequantized_checkpoint;
pub use quant::{GgmlType, UnsupportedGgmlType, dequantize, dequantize_into};
pub use value::{GgufArray, GgufValue, GgufValueType};

use crate::error::{CoreError, Result};
use crate::host_memory::CheckpointMap;

/// The first four bytes of every GGUF file.
pub const MAGIC: [u8; 4] = *b"GGUF";

/// The alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: usize = 32;

/// How deep metadata arrays may nest (an array of arrays is depth 2).
pub const MAX_ARRAY_DEPTH: usize = 8;

/// The most dimensions a tensor may have (`GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;

/// One tensor's info, checked against the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTensorInfo {
    /// Name (unique in the file).
    pub name: String,
    /// Row-major shape: the file's ggml dims reversed, so the last entry varies fastest and
    /// is a whole number of blocks.
    pub shape: Vec<usize>,
    /// How the elements are stored.
    pub ggml_type: GgmlType,
    /// Absolute byte offset of the first block in the file (a multiple of the alignment
    /// from the data section's start).
    pub offset: usize,
    /// Bytes of stored blocks.
    pub nbytes: usize,
}

impl GgufTensorInfo {
    /// The number of elements.
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// The dims in ggml order, as the file stores them (`dims[0]` varies fastest).
    pub fn dims(&self) -> Vec<usize> {
        self.shape.iter().rev().copied().collect()
    }
}

/// What the validator reads from a file's bytes.
#[derive(Debug)]
struct Header {
    version: u32,
    metadata: Vec<(String, GgufValue)>,
    keys: BTreeMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    names: BTreeMap<String, usize>,
    alignment: usize,
    data_start: usize,
}

/// An opened, validated, memory-mapped GGUF file. [`GgufFile::raw`] hands out a tensor's
/// stored blocks straight from the mapping.
#[derive(Debug)]
pub struct GgufFile {
    map: Arc<CheckpointMap>,
    header: Header,
}

impl GgufFile {
    /// Opens and validates `path` (the checks are listed in the [module docs](self)). Errors
    /// name the file and the field at fault.
    pub fn open(path: &Path) -> Result<Self> {
        Self::from_map(CheckpointMap::open(path)?)
    }

    /// Validates a mapping (a file's, or bytes made in memory) as [`GgufFile::open`] does.
    pub fn from_map(map: Arc<CheckpointMap>) -> Result<Self> {
        let header = parse(map.bytes(), map.path())?;
        Ok(Self { map, header })
    }

    /// Validates a copy of `bytes` as a GGUF file that `label` names in errors (and
    /// [`GgufFile::path`]); for tests and for files made in memory.
    pub fn from_bytes(bytes: &[u8], label: &Path) -> Result<Self> {
        parse(bytes, label)?;
        let mut copy = memmap2::MmapMut::map_anon(bytes.len()).map_err(|source| CoreError::Io {
            path: label.to_path_buf(),
            source,
        })?;
        copy.copy_from_slice(bytes);
        Self::from_map(CheckpointMap::in_memory(label, copy))
    }

    /// Validates the bytes of a GGUF file as [`GgufFile::open`] does, without a file
    /// (`path` only names it in errors); returns the number of tensors. For fuzzing and
    /// for checking bytes before they are written.
    pub fn validate_bytes(bytes: &[u8], path: &Path) -> Result<usize> {
        Ok(parse(bytes, path)?.tensors.len())
    }

    /// The file (or the label of bytes made in memory).
    pub fn path(&self) -> &Path {
        self.map.path()
    }

    /// The mapping.
    pub fn map(&self) -> &Arc<CheckpointMap> {
        &self.map
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.header.version
    }

    /// The alignment of tensor data (`general.alignment`, or [`DEFAULT_ALIGNMENT`]).
    pub fn alignment(&self) -> usize {
        self.header.alignment
    }

    /// Where the data section starts in the file.
    pub fn data_start(&self) -> usize {
        self.header.data_start
    }

    /// Every metadata entry, in file order (keys are unique).
    pub fn metadata(&self) -> &[(String, GgufValue)] {
        &self.header.metadata
    }

    /// The value of a metadata key.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        let &i = self.header.keys.get(key)?;
        Some(&self.header.metadata[i].1)
    }

    /// The value of `key` converted by `f`; a value of another type is a
    /// [`CoreError::Gguf`] naming the key and `expected`.
    fn typed<'a, T>(
        &'a self,
        key: &str,
        expected: &str,
        f: impl FnOnce(&'a GgufValue) -> Option<T>,
    ) -> Result<Option<T>> {
        let Some(value) = self.get(key) else {
            return Ok(None);
        };
        f(value).map(Some).ok_or_else(|| CoreError::Gguf {
            path: self.path().to_path_buf(),
            field: key.to_string(),
            problem: format!(
                "is a {} value where {expected} was expected",
                value.value_type().name()
            ),
        })
    }

    /// A string value; `None` when the key is absent, an error when it is not a string.
    pub fn get_str(&self, key: &str) -> Result<Option<&str>> {
        self.typed(key, "a string", GgufValue::as_str)
    }

    /// An integer value that fits a `u32`; `None` when absent.
    pub fn get_u32(&self, key: &str) -> Result<Option<u32>> {
        self.typed(key, "an integer that fits a u32", |v| {
            v.as_u64().and_then(|v| u32::try_from(v).ok())
        })
    }

    /// An integer value that fits a `u64`; `None` when absent.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>> {
        self.typed(key, "a non-negative integer", GgufValue::as_u64)
    }

    /// An integer value that fits an `i64`; `None` when absent.
    pub fn get_i64(&self, key: &str) -> Result<Option<i64>> {
        self.typed(key, "an integer that fits an i64", GgufValue::as_i64)
    }

    /// A float value (`float32` widened, or `float64`); `None` when absent.
    pub fn get_f64(&self, key: &str) -> Result<Option<f64>> {
        self.typed(key, "a float", GgufValue::as_f64)
    }

    /// A boolean value; `None` when absent.
    pub fn get_bool(&self, key: &str) -> Result<Option<bool>> {
        self.typed(key, "a bool", GgufValue::as_bool)
    }

    /// An array value; `None` when absent.
    pub fn get_array(&self, key: &str) -> Result<Option<&GgufArray>> {
        self.typed(key, "an array", GgufValue::as_array)
    }

    /// `general.architecture` (checked to be a string when the file was opened).
    pub fn architecture(&self) -> Option<&str> {
        self.get(ARCHITECTURE_KEY).and_then(GgufValue::as_str)
    }

    /// Every tensor, in file order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.header.tensors
    }

    /// A tensor's info; [`CoreError::MissingTensor`] when the file has none of that name.
    pub fn tensor(&self, name: &str) -> Result<&GgufTensorInfo> {
        self.header
            .names
            .get(name)
            .map(|&i| &self.header.tensors[i])
            .ok_or_else(|| CoreError::MissingTensor {
                path: self.path().to_path_buf(),
                name: name.to_string(),
            })
    }

    /// A tensor's stored blocks, from the mapping.
    pub fn raw(&self, name: &str) -> Result<&[u8]> {
        let t = self.tensor(name)?;
        // Checked against the mapping's length when the file was opened.
        Ok(&self.map.bytes()[t.offset..t.offset + t.nbytes])
    }

    /// A tensor's values as f32, in row-major order ([`quant::dequantize`]).
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>> {
        let t = self.tensor(name)?;
        dequantize(t.ggml_type, self.raw(name)?, t.elements())
    }
}

/// The metadata key naming the model architecture.
pub const ARCHITECTURE_KEY: &str = "general.architecture";

/// The metadata key giving the data alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";

/// The fewest bytes a metadata entry takes: an empty key's length, a type, a one-byte value.
const MIN_KV_BYTES: usize = 8 + 4 + 1;

/// The fewest bytes a tensor info takes: an empty name's length, `n_dims`, one dim, a type,
/// an offset.
const MIN_TENSOR_INFO_BYTES: usize = 8 + 4 + 8 + 4 + 8;

/// A cursor over a file's bytes whose every read is checked against the end.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn error(&self, field: impl Into<String>, problem: impl Into<String>) -> CoreError {
        CoreError::Gguf {
            path: self.path.to_path_buf(),
            field: field.into(),
            problem: problem.into(),
        }
    }

    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    /// The next `n` bytes; past the end is an error naming `field`.
    fn take(&mut self, n: usize, field: &dyn Fn() -> String) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(self.error(
                field(),
                format!(
                    "needs {n} B at offset {} but the file ends at {} B; the file is truncated",
                    self.pos,
                    self.bytes.len()
                ),
            ));
        }
        let out = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, field: &dyn Fn() -> String) -> Result<[u8; N]> {
        let b = self.take(N, field)?;
        Ok(b.try_into().expect("take returns N bytes"))
    }

    fn u32(&mut self, field: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }

    fn u64(&mut self, field: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }

    /// A count of things of at least `min_bytes` each, checked against what remains
    /// before anything is allocated for them.
    fn count(&mut self, min_bytes: usize, what: &str, field: &dyn Fn() -> String) -> Result<usize> {
        let count = self.u64(field)?;
        let fits = usize::try_from(count)
            .ok()
            .and_then(|c| c.checked_mul(min_bytes))
            .is_some_and(|need| need <= self.remaining());
        if !fits {
            return Err(self.error(
                field(),
                format!(
                    "claims {count} {what} of at least {min_bytes} B each, more than the {} B left \
                     in the file; the file is truncated or corrupt",
                    self.remaining()
                ),
            ));
        }
        Ok(count as usize)
    }

    /// A length-prefixed UTF-8 string; the length is checked before the copy.
    fn string(&mut self, field: &dyn Fn() -> String) -> Result<String> {
        let len = self.count(1, "bytes of string", field)?;
        let bytes = self.take(len, field)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(self.error(field(), format!("is not UTF-8: {e}"))),
        }
    }

    fn value_type(&mut self, field: &dyn Fn() -> String) -> Result<GgufValueType> {
        let id = self.u32(field)?;
        GgufValueType::from_id(id).ok_or_else(|| {
            self.error(
                field(),
                format!("has value type {id}, which GGUF does not define (0..=12)"),
            )
        })
    }

    /// One value of type `ty`; arrays at `depth` (1 for a top-level array).
    fn value(
        &mut self,
        ty: GgufValueType,
        depth: usize,
        field: &dyn Fn() -> String,
    ) -> Result<GgufValue> {
        Ok(match ty {
            GgufValueType::U8 => GgufValue::U8(u8::from_le_bytes(self.array(field)?)),
            GgufValueType::I8 => GgufValue::I8(i8::from_le_bytes(self.array(field)?)),
            GgufValueType::U16 => GgufValue::U16(u16::from_le_bytes(self.array(field)?)),
            GgufValueType::I16 => GgufValue::I16(i16::from_le_bytes(self.array(field)?)),
            GgufValueType::U32 => GgufValue::U32(self.u32(field)?),
            GgufValueType::I32 => GgufValue::I32(i32::from_le_bytes(self.array(field)?)),
            GgufValueType::F32 => GgufValue::F32(f32::from_le_bytes(self.array(field)?)),
            GgufValueType::Bool => GgufValue::Bool(self.bool(field)?),
            GgufValueType::String => GgufValue::String(self.string(field)?),
            GgufValueType::Array => GgufValue::Array(self.array_value(depth, field)?),
            GgufValueType::U64 => GgufValue::U64(self.u64(field)?),
            GgufValueType::I64 => GgufValue::I64(i64::from_le_bytes(self.array(field)?)),
            GgufValueType::F64 => GgufValue::F64(f64::from_le_bytes(self.array(field)?)),
        })
    }

    fn bool(&mut self, field: &dyn Fn() -> String) -> Result<bool> {
        match self.array::<1>(field)?[0] {
            0 => Ok(false),
            1 => Ok(true),
            other => Err(self.error(
                field(),
                format!("is a bool stored as {other}; GGUF allows only 0 and 1"),
            )),
        }
    }

    /// An array's element type, count and elements, at nesting `depth`.
    fn array_value(&mut self, depth: usize, field: &dyn Fn() -> String) -> Result<GgufArray> {
        if depth > MAX_ARRAY_DEPTH {
            return Err(self.error(
                field(),
                format!("nests arrays more than {MAX_ARRAY_DEPTH} deep"),
            ));
        }
        let ty = self.value_type(field)?;
        let n = self.count(ty.min_bytes(), "array elements", field)?;
        macro_rules! elements {
            ($variant:ident, $read:expr) => {{
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push($read);
                }
                GgufArray::$variant(v)
            }};
        }
        Ok(match ty {
            GgufValueType::U8 => elements!(U8, u8::from_le_bytes(self.array(field)?)),
            GgufValueType::I8 => elements!(I8, i8::from_le_bytes(self.array(field)?)),
            GgufValueType::U16 => elements!(U16, u16::from_le_bytes(self.array(field)?)),
            GgufValueType::I16 => elements!(I16, i16::from_le_bytes(self.array(field)?)),
            GgufValueType::U32 => elements!(U32, self.u32(field)?),
            GgufValueType::I32 => elements!(I32, i32::from_le_bytes(self.array(field)?)),
            GgufValueType::F32 => elements!(F32, f32::from_le_bytes(self.array(field)?)),
            GgufValueType::Bool => elements!(Bool, self.bool(field)?),
            GgufValueType::String => elements!(String, self.string(field)?),
            GgufValueType::Array => elements!(Array, self.array_value(depth + 1, field)?),
            GgufValueType::U64 => elements!(U64, self.u64(field)?),
            GgufValueType::I64 => elements!(I64, i64::from_le_bytes(self.array(field)?)),
            GgufValueType::F64 => elements!(F64, f64::from_le_bytes(self.array(field)?)),
        })
    }
}

/// The one validator behind [`GgufFile::open`], [`GgufFile::from_map`],
/// [`GgufFile::from_bytes`] and [`GgufFile::validate_bytes`].
fn parse(bytes: &[u8], path: &Path) -> Result<Header> {
    let mut c = Cursor {
        bytes,
        pos: 0,
        path,
    };
    let magic: [u8; 4] = c.array(&|| "magic".into())?;
    if magic != MAGIC {
        return Err(c.error(
            "magic",
            format!("is {magic:02x?}, not `GGUF`; this is not a GGUF file"),
        ));
    }
    let version = c.u32(&|| "version".into())?;
    match version {
        2 | 3 => {}
        1 => {
            return Err(c.error(
                "version",
                "is 1, which DDO does not read (2 or 3); convert the model again with a current llama.cpp",
            ));
        }
        v if (1..=3).contains(&v.swap_bytes()) => {
            return Err(c.error(
                "version",
                format!(
                    "reads as {} big-endian: the file is big-endian, which DDO does not read; \
                     convert it little-endian (gguf-py's gguf_convert_endian.py)",
                    v.swap_bytes()
                ),
            ));
        }
        v => {
            return Err(c.error(
                "version",
                format!("is {v}; DDO reads GGUF versions 2 and 3"),
            ));
        }
    }
    let tensor_count = c.count(MIN_TENSOR_INFO_BYTES, "tensors", &|| "tensor_count".into())?;
    let kv_count = c.count(MIN_KV_BYTES, "metadata entries", &|| {
        "metadata_kv_count".into()
    })?;

    let mut metadata = Vec::with_capacity(kv_count);
    let mut keys = BTreeMap::new();
    for i in 0..kv_count {
        let key = c.string(&|| format!("metadata[{i}].key"))?;
        let field = || format!("metadata `{key}`");
        let ty = c.value_type(&field)?;
        let value = c.value(ty, 1, &field)?;
        if keys.insert(key.clone(), i).is_some() {
            return Err(c.error(field(), "appears twice; the file is ambiguous"));
        }
        metadata.push((key, value));
    }
    let meta = |key: &str| keys.get(key).map(|&i| &metadata[i].1);
    if let Some(v) = meta(ARCHITECTURE_KEY)
        && v.as_str().is_none()
    {
        return Err(c.error(
            ARCHITECTURE_KEY,
            format!(
                "is a {} value; GGUF requires a string",
                v.value_type().name()
            ),
        ));
    }
    let alignment = match meta(ALIGNMENT_KEY) {
        None => DEFAULT_ALIGNMENT,
        Some(&GgufValue::U32(a)) if a.is_power_of_two() => a as usize,
        Some(GgufValue::U32(a)) => {
            return Err(c.error(
                ALIGNMENT_KEY,
                format!("is {a}; the alignment must be a nonzero power of two"),
            ));
        }
        Some(v) => {
            return Err(c.error(
                ALIGNMENT_KEY,
                format!(
                    "is a {} value; GGUF requires a uint32",
                    v.value_type().name()
                ),
            ));
        }
    };

    if tensor_count
        .checked_mul(MIN_TENSOR_INFO_BYTES)
        .is_none_or(|need| need > c.remaining())
    {
        return Err(c.error(
            "tensor_count",
            format!(
                "claims {tensor_count} tensors of at least {MIN_TENSOR_INFO_BYTES} B of info each, \
                 more than the {} B left after the metadata; the file is truncated or corrupt",
                c.remaining()
            ),
        ));
    }
    let mut infos = Vec::with_capacity(tensor_count);
    for i in 0..tensor_count {
        infos.push(tensor_info(&mut c, i)?);
    }

    let data_start = c.pos.checked_next_multiple_of(alignment).ok_or_else(|| {
        c.error(
            ALIGNMENT_KEY,
            format!("{alignment} puts the data section past the addressable range"),
        )
    })?;
    let mut tensors = Vec::with_capacity(tensor_count);
    let mut names = BTreeMap::new();
    let mut ranges = Vec::with_capacity(tensor_count);
    for (i, info) in infos.into_iter().enumerate() {
        let tensor = place(&c, info, alignment, data_start)?;
        if names.insert(tensor.name.clone(), i).is_some() {
            return Err(c.error(
                format!("tensors[{i}].name"),
                format!("`{}` appears twice; the file is ambiguous", tensor.name),
            ));
        }
        ranges.push((tensor.offset, tensor.offset + tensor.nbytes, i));
        tensors.push(tensor);
    }
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        let ((_, a_end, a), (b_start, _, b)) = (pair[0], pair[1]);
        if b_start < a_end {
            let (a, b) = (&tensors[a].name, &tensors[b].name);
            return Err(c.error(
                format!("tensor `{b}`.offset"),
                format!("its data overlaps tensor `{a}`'s; the file is corrupt"),
            ));
        }
    }
    Ok(Header {
        version,
        metadata,
        keys,
        tensors,
        names,
        alignment,
        data_start,
    })
}

/// A tensor info as read, before its data is placed.
struct RawInfo {
    name: String,
    dims: Vec<u64>,
    type_id: u32,
    offset: u64,
}

/// Reads tensor info `i`: name, dims (at most [`MAX_DIMS`]), type id, offset.
fn tensor_info(c: &mut Cursor<'_>, i: usize) -> Result<RawInfo> {
    let name = c.string(&|| format!("tensors[{i}].name"))?;
    let field = |what: &str| format!("tensor `{name}`.{what}");
    let n_dims = c.u32(&|| field("n_dims"))?;
    if n_dims as usize > MAX_DIMS {
        return Err(c.error(
            field("n_dims"),
            format!("is {n_dims}; GGUF tensors have at most {MAX_DIMS} dimensions"),
        ));
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for j in 0..n_dims {
        dims.push(c.u64(&|| field(&format!("dims[{j}]")))?);
    }
    let type_id = c.u32(&|| field("type"))?;
    let offset = c.u64(&|| field("offset"))?;
    Ok(RawInfo {
        name,
        dims,
        type_id,
        offset,
    })
}

/// Checks a tensor's dims, type and data against the file and places it.
fn place(
    c: &Cursor<'_>,
    info: RawInfo,
    alignment: usize,
    data_start: usize,
) -> Result<GgufTensorInfo> {
    let RawInfo {
        name,
        dims,
        type_id,
        offset,
    } = info;
    let field = |what: &str| format!("tensor `{name}`.{what}");
    let ggml_type =
        GgmlType::from_id(type_id).map_err(|e| c.error(field("type"), e.to_string()))?;
    let mut elements: usize = 1;
    for (j, &d) in dims.iter().enumerate() {
        if d == 0 {
            return Err(c.error(
                field(&format!("dims[{j}]")),
                "is 0; DDO reads no empty tensors",
            ));
        }
        elements = usize::try_from(d)
            .ok()
            .and_then(|d| elements.checked_mul(d))
            .ok_or_else(|| {
                c.error(
                    field("dims"),
                    format!("{dims:?} multiply past the addressable range"),
                )
            })?;
    }
    let row = dims.first().copied().unwrap_or(1);
    let block = ggml_type.block_elements() as u64;
    if !row.is_multiple_of(block) {
        return Err(c.error(
            field("dims[0]"),
            format!("is {row}, not a whole number of {ggml_type}'s {block}-element blocks"),
        ));
    }
    let nbytes = ggml_type.bytes_for(elements).ok_or_else(|| {
        c.error(
            field("dims"),
            format!("{dims:?} of {ggml_type} take more bytes than are addressable"),
        )
    })?;
    if !offset.is_multiple_of(alignment as u64) {
        return Err(c.error(
            field("offset"),
            format!("is {offset}, not a multiple of the alignment {alignment}"),
        ));
    }
    let start = usize::try_from(offset)
        .ok()
        .and_then(|o| data_start.checked_add(o));
    let end = start.and_then(|s| s.checked_add(nbytes));
    match (start, end) {
        (Some(start), Some(end)) if end <= c.bytes.len() => Ok(GgufTensorInfo {
            name,
            shape: dims.iter().rev().map(|&d| d as usize).collect(),
            ggml_type,
            offset: start,
            nbytes,
        }),
        _ => Err(c.error(
            field("offset"),
            format!(
                "{offset} puts its {nbytes} B at {data_start} + {offset} in the data section, past \
                 the end of the file at {} B; the file is truncated or corrupt",
                c.bytes.len()
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cursor(bytes: &[u8]) -> Cursor<'_> {
        Cursor {
            bytes,
            pos: 0,
            path: Path::new("t.gguf"),
        }
    }

    fn field_of(e: CoreError) -> String {
        match e {
            CoreError::Gguf { field, .. } => field,
            other => panic!("not a GGUF error: {other:?}"),
        }
    }

    #[test]
    fn value_type_ids_round_trip() {
        for id in 0..=12 {
            assert_eq!(GgufValueType::from_id(id).map(|t| t as u32), Some(id));
        }
        assert_eq!(GgufValueType::from_id(13), None);
    }

    #[test]
    fn counts_are_checked_against_the_remaining_bytes_before_use() {
        let mut bytes = 3u64.to_le_bytes().to_vec();
        bytes.extend([0; 11]);
        // Three things of 4 B need 12 B; 11 remain.
        let e = cursor(&bytes)
            .count(4, "things", &|| "n".into())
            .unwrap_err();
        assert_eq!(field_of(e), "n");
        assert_eq!(
            cursor(&bytes).count(3, "things", &|| "n".into()).unwrap(),
            3
        );
        let huge = u64::MAX.to_le_bytes();
        assert!(cursor(&huge).count(1, "things", &|| "n".into()).is_err());
    }

    #[test]
    fn bools_are_zero_or_one() {
        assert!(!cursor(&[0]).bool(&|| "b".into()).unwrap());
        assert!(cursor(&[1]).bool(&|| "b".into()).unwrap());
        assert_eq!(
            field_of(cursor(&[2]).bool(&|| "b".into()).unwrap_err()),
            "b"
        );
    }

    #[test]
    fn integer_accessors_widen_without_loss_only() {
        assert_eq!(GgufValue::U8(7).as_u64(), Some(7));
        assert_eq!(GgufValue::I32(-1).as_u64(), None);
        assert_eq!(GgufValue::I32(-1).as_i64(), Some(-1));
        assert_eq!(GgufValue::U64(u64::MAX).as_i64(), None);
        assert_eq!(GgufValue::F32(1.5).as_u64(), None);
        assert_eq!(GgufValue::F32(1.5).as_f64(), Some(1.5));
    }

    #[test]
    fn arrays_report_their_element_type_and_length() {
        let a = GgufArray::Array(vec![GgufArray::I32(vec![1, 2]), GgufArray::String(vec![])]);
        assert_eq!(a.element_type(), GgufValueType::Array);
        assert_eq!(a.len(), 2);
        assert!(GgufArray::F64(vec![]).is_empty());
    }
}
