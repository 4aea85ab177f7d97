//! GGUF files: the reader (`ddo_core::gguf::GgufFile`) and the host dequantization against
//! gguf-py. The fixture `fixtures/gguf/types.gguf` (written by gguf-py, one tensor per
//! supported type, metadata of every value type) must read back as gguf-py wrote it and
//! dequantize bit for bit to `fixtures/gguf/dequantized.safetensors` (gguf-py's
//! `gguf.quants.dequantize`). Malformed files are built here in memory from a small valid
//! one with one field corrupted; each is a typed `CoreError::Gguf` naming the file and that
//! field. The sizes the bombs claim (2^40 strings, 2^58 array elements, `u64::MAX` tensors)
//! are ones no allocation could serve: a reader that allocated before checking them would
//! abort these tests, not pass them. (No allocation-counting global allocator here, unlike
//! `tests/safetensors.rs`: `cargo xtask tidy` confines `unsafe` to that file.) Property
//! tests mutate valid files at random: the reader returns Ok or a typed error, never panics.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ddo_core::gguf::{
    ALIGNMENT_KEY, GgmlType, GgufArray, GgufFile, GgufValue, GgufValueType, MAX_ARRAY_DEPTH,
};
use ddo_core::{Checkpoint, CoreError};
use half::f16;
use proptest::prelude::*;

const PATH: &str = "/models/bad.gguf";

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/gguf")
        .join(name)
}

fn check(bytes: &[u8]) -> Result<usize, CoreError> {
    GgufFile::validate_bytes(bytes, Path::new(PATH))
}

/// The field and problem of a `Gguf` error for `PATH`; anything else fails the test.
fn gguf_error(result: Result<usize, CoreError>) -> (String, String) {
    match result {
        Err(CoreError::Gguf {
            path,
            field,
            problem,
        }) => {
            assert_eq!(path, PathBuf::from(PATH));
            (field, problem)
        }
        other => panic!("expected a Gguf error, got {other:?}"),
    }
}

/// Asserts `bytes` are refused with an error naming `field` whose problem contains `needle`.
#[track_caller]
fn refused(bytes: &[u8], field: &str, needle: &str) {
    let (got_field, problem) = gguf_error(check(bytes));
    assert_eq!(got_field, field, "problem: {problem}");
    assert!(problem.contains(needle), "`{problem}` lacks `{needle}`");
}

// --- A minimal GGUF writer whose every field can be corrupted. ---

/// One tensor info as it will be written.
#[derive(Debug, Clone)]
struct Info {
    name: Vec<u8>,
    dims: Vec<u64>,
    type_id: u32,
    offset: u64,
}

/// A GGUF file as fields; `bytes()` writes it.
#[derive(Debug, Clone)]
struct Gguf {
    magic: [u8; 4],
    version: u32,
    /// Written instead of the real counts when set.
    tensor_count: Option<u64>,
    kv_count: Option<u64>,
    /// Key bytes, then the value type id and the value's bytes.
    kvs: Vec<(Vec<u8>, u32, Vec<u8>)>,
    infos: Vec<Info>,
    /// The alignment the writer pads the data section to.
    alignment: usize,
    /// Bytes of data written after the padding.
    data_len: usize,
}

fn string(s: &[u8]) -> Vec<u8> {
    let mut b = (s.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(s);
    b
}

/// An array value: element type, count, elements.
fn array(element_type: u32, count: u64, elements: &[u8]) -> Vec<u8> {
    let mut b = element_type.to_le_bytes().to_vec();
    b.extend(count.to_le_bytes());
    b.extend_from_slice(elements);
    b
}

const STRING: u32 = 8;
const ARRAY: u32 = 9;
const U32: u32 = 4;

impl Gguf {
    /// Two tensors (`a`: F32 [2, 4]; `b`: Q8_0 [2, 32], at offset 32) and three metadata
    /// entries (architecture, a u32, an array of strings); data zero, so every f16 scale
    /// is finite.
    fn valid() -> Self {
        Gguf {
            magic: *b"GGUF",
            version: 3,
            tensor_count: None,
            kv_count: None,
            kvs: vec![
                (b"general.architecture".to_vec(), STRING, string(b"flux")),
                (b"test.n".to_vec(), U32, 7u32.to_le_bytes().to_vec()),
                (
                    b"test.names".to_vec(),
                    ARRAY,
                    array(STRING, 2, &[string(b"x"), string(b"yz")].concat()),
                ),
            ],
            infos: vec![
                Info {
                    name: b"a".to_vec(),
                    dims: vec![4, 2],
                    type_id: 0,
                    offset: 0,
                },
                Info {
                    name: b"b".to_vec(),
                    dims: vec![32, 2],
                    type_id: 8,
                    offset: 32,
                },
            ],
            alignment: 32,
            data_len: 32 + 68,
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let mut b = self.magic.to_vec();
        b.extend(self.version.to_le_bytes());
        b.extend(
            self.tensor_count
                .unwrap_or(self.infos.len() as u64)
                .to_le_bytes(),
        );
        b.extend(self.kv_count.unwrap_or(self.kvs.len() as u64).to_le_bytes());
        for (key, ty, value) in &self.kvs {
            b.extend(string(key));
            b.extend(ty.to_le_bytes());
            b.extend_from_slice(value);
        }
        for info in &self.infos {
            b.extend(string(&info.name));
            b.extend((info.dims.len() as u32).to_le_bytes());
            for d in &info.dims {
                b.extend(d.to_le_bytes());
            }
            b.extend(info.type_id.to_le_bytes());
            b.extend(info.offset.to_le_bytes());
        }
        b.resize(b.len().next_multiple_of(self.alignment), 0);
        b.resize(b.len() + self.data_len, 0);
        b
    }

    /// The offset of the data section in `bytes()`.
    fn data_start(&self) -> usize {
        let mut without_data = self.clone();
        without_data.data_len = 0;
        without_data.bytes().len()
    }
}

fn open(bytes: &[u8]) -> GgufFile {
    GgufFile::from_bytes(bytes, Path::new(PATH)).unwrap()
}

// --- Diffusers' GGUF dequantization (`tools/gen_gguf_diffusers.py`). ---

/// Diffusers 0.42.1's `dequantize_gguf_tensor` (what its GGUF models run) on every tensor of
/// the three GGUF fixtures: it returns f16 values (its default dtype, whatever the model's
/// compute dtype), so DDO's f32 values (gguf-py's) rounded once to f16 are Diffusers' bit for
/// bit for the float types, Q4_0, Q5_0 and Q8_0 (whose value is one f32 product), and within
/// f16 arithmetic of them for the types with an offset or packed sub-scales (Q4_1, Q5_1, the
/// K-quants: Diffusers computes `d * q + m` in f16).
#[test]
fn diffusers_dequantization_is_ddos_rounded_to_f16() {
    use ddo_core::DType;
    let reference = Checkpoint::open(&fixture("diffusers_dequantized.safetensors")).unwrap();
    let mut exact = 0;
    let mut close = 0;
    for stem in [
        "types",
        "flux_pipeline-transformer-mixed",
        "flux_pipeline-t5-mixed",
    ] {
        let file = GgufFile::open(&fixture(&format!("{stem}.gguf"))).unwrap();
        for info in file.tensors() {
            let key = format!("{stem}/{}", info.name);
            let expected = reference.raw(&key).unwrap_or_else(|| panic!("{key}"));
            assert_eq!(expected.shape, info.shape.as_slice(), "{key}");
            let theirs: Vec<f32> = expected
                .bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let ours = file.dequantize(&info.name).unwrap();
            let single_product = matches!(
                info.ggml_type,
                GgmlType::F32
                    | GgmlType::F16
                    | GgmlType::BF16
                    | GgmlType::Q4_0
                    | GgmlType::Q5_0
                    | GgmlType::Q8_0
            );
            let float = matches!(
                info.ggml_type,
                GgmlType::F32 | GgmlType::F16 | GgmlType::BF16
            );
            if float {
                // Stored floats are passed through as they are.
                assert!(
                    ours.iter()
                        .zip(&theirs)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{key}"
                );
                exact += 1;
            } else if single_product {
                let rounded = DType::F16
                    .decode_f32(&DType::F16.encode_f32(&ours).unwrap())
                    .unwrap();
                assert!(
                    rounded
                        .iter()
                        .zip(&theirs)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{key} ({}): DDO's values rounded to f16 are not Diffusers'",
                    info.ggml_type
                );
                exact += 1;
            } else {
                let scale = ours.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
                let worst = ours
                    .iter()
                    .zip(&theirs)
                    .map(|(a, b)| (a - b).abs() / scale)
                    .fold(0f32, f32::max);
                assert!(
                    worst <= 2e-3,
                    "{key} ({}): {worst:e} of its largest value",
                    info.ggml_type
                );
                close += 1;
            }
        }
    }
    assert_eq!((exact, close), (67, 20));
}

// --- The fixture: gguf-py's file and its dequantization. ---

#[test]
fn every_type_dequantizes_bit_exactly_as_gguf_py_does() {
    let file = GgufFile::open(&fixture("types.gguf")).unwrap();
    let reference = Checkpoint::open(&fixture("dequantized.safetensors")).unwrap();
    let mut seen = Vec::new();
    for info in file.tensors() {
        let expected = reference.raw(&info.name).unwrap();
        assert_eq!(expected.dtype, "F32");
        assert_eq!(expected.shape, info.shape.as_slice(), "{}", info.name);
        let got = file.dequantize(&info.name).unwrap();
        assert_eq!(got.len() * 4, expected.bytes.len());
        for (i, (g, e)) in got.iter().zip(expected.bytes.chunks_exact(4)).enumerate() {
            let e = u32::from_le_bytes(e.try_into().unwrap());
            assert_eq!(
                g.to_bits(),
                e,
                "{} ({}) element {i}: {g} against gguf-py's {}",
                info.name,
                info.ggml_type,
                f32::from_bits(e)
            );
        }
        seen.push(info.ggml_type);
    }
    seen.sort();
    seen.dedup();
    assert_eq!(
        seen,
        GgmlType::ALL.to_vec(),
        "every supported type is covered"
    );
}

#[test]
fn the_fixture_metadata_reads_back_as_gguf_py_wrote_it() {
    let file = GgufFile::open(&fixture("types.gguf")).unwrap();
    assert_eq!(file.version(), 3);
    assert_eq!(file.alignment(), 32);
    assert_eq!(file.architecture(), Some("ddo-test"));
    assert_eq!(file.path(), fixture("types.gguf"));
    let get = |k: &str| file.get(&format!("ddo.test.{k}")).unwrap().clone();
    assert_eq!(get("u8"), GgufValue::U8(200));
    assert_eq!(get("i8"), GgufValue::I8(-100));
    assert_eq!(get("u16"), GgufValue::U16(60000));
    assert_eq!(get("i16"), GgufValue::I16(-30000));
    assert_eq!(get("u32"), GgufValue::U32(4_000_000_000));
    assert_eq!(get("i32"), GgufValue::I32(-2_000_000_000));
    assert_eq!(get("f32"), GgufValue::F32(1.5));
    assert_eq!(get("bool"), GgufValue::Bool(true));
    assert_eq!(get("string"), GgufValue::String("grüße, GGUF".into()));
    assert_eq!(get("u64"), GgufValue::U64(18_000_000_000_000_000_000));
    assert_eq!(get("i64"), GgufValue::I64(-9_000_000_000_000_000_000));
    assert_eq!(get("f64"), GgufValue::F64(2.25));
    assert_eq!(
        get("strings"),
        GgufValue::Array(GgufArray::String(vec!["a".into(), "bc".into(), "".into()]))
    );
    assert_eq!(
        get("nested"),
        GgufValue::Array(GgufArray::Array(vec![
            GgufArray::I32(vec![1, 2, 3]),
            GgufArray::I32(vec![-4, 5]),
        ]))
    );
    // File order: the architecture first (GGUFWriter adds it), then ours as written.
    let keys: Vec<&str> = file.metadata().iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys[..3],
        ["general.architecture", "ddo.test.u8", "ddo.test.i8"]
    );
    assert_eq!(keys.len(), 15);

    assert_eq!(file.get_u32("ddo.test.u32").unwrap(), Some(4_000_000_000));
    assert_eq!(file.get_u64("ddo.test.u8").unwrap(), Some(200));
    assert_eq!(
        file.get_i64("ddo.test.i64").unwrap(),
        Some(-9_000_000_000_000_000_000)
    );
    assert_eq!(file.get_f64("ddo.test.f32").unwrap(), Some(1.5));
    assert_eq!(file.get_bool("ddo.test.bool").unwrap(), Some(true));
    assert_eq!(
        file.get_str("ddo.test.string").unwrap(),
        Some("grüße, GGUF")
    );
    assert_eq!(
        file.get_array("ddo.test.strings").unwrap().unwrap().len(),
        3
    );
    assert_eq!(file.get_str("ddo.test.absent").unwrap(), None);
    // A value of another type is an error naming the key, not a silent None.
    match file.get_u32("ddo.test.u64") {
        Err(CoreError::Gguf { field, problem, .. }) => {
            assert_eq!(field, "ddo.test.u64");
            assert!(problem.contains("uint64"), "{problem}");
        }
        other => panic!("{other:?}"),
    }
    assert!(file.get_str("ddo.test.u8").is_err());
    assert!(file.get_u64("ddo.test.i8").is_err(), "negative");
}

#[test]
fn shapes_are_row_major_and_tensors_lie_where_gguf_py_put_them() {
    let file = GgufFile::open(&fixture("types.gguf")).unwrap();
    let t = file.tensor("f32_3d").unwrap();
    assert_eq!(t.shape, [2, 3, 4]);
    assert_eq!(t.dims(), [4, 3, 2]);
    assert_eq!(t.elements(), 24);
    let q = file.tensor("q4_k").unwrap();
    assert_eq!(
        (q.shape.as_slice(), q.ggml_type, q.nbytes),
        ([2, 256].as_slice(), GgmlType::Q4_K, 288)
    );
    for t in file.tensors() {
        assert_eq!((t.offset - file.data_start()) % 32, 0, "{}", t.name);
        assert_eq!(file.raw(&t.name).unwrap().len(), t.nbytes);
    }
    // gguf-py's reader put `f32` at 1216 and `f32_3d` at 8704 (tools/gen_gguf_fixtures.py).
    assert_eq!(file.tensor("f32").unwrap().offset, 1216);
    assert_eq!(file.tensor("f32_3d").unwrap().offset, 8704);
    assert!(matches!(
        file.tensor("absent"),
        Err(CoreError::MissingTensor { .. })
    ));
    assert_eq!(
        GgufFile::validate_bytes(
            &std::fs::read(fixture("types.gguf")).unwrap(),
            Path::new(PATH)
        )
        .unwrap(),
        14
    );
}

// --- Files built here. ---

#[test]
fn a_built_file_reads_back() {
    let g = Gguf::valid();
    let bytes = g.bytes();
    assert_eq!(check(&bytes).unwrap(), 2);
    let file = open(&bytes);
    assert_eq!(file.architecture(), Some("flux"));
    assert_eq!(file.get_u32("test.n").unwrap(), Some(7));
    assert_eq!(file.data_start(), g.data_start());
    let b = file.tensor("b").unwrap();
    assert_eq!(
        (b.shape.as_slice(), b.offset, b.nbytes),
        ([2, 32].as_slice(), g.data_start() + 32, 68)
    );
    assert_eq!(file.raw("b").unwrap(), &bytes[b.offset..b.offset + 68]);
    assert_eq!(file.dequantize("b").unwrap(), vec![0.0; 64]);
}

#[test]
fn version_2_and_a_custom_alignment_and_a_scalar_are_read() {
    let mut g = Gguf::valid();
    g.version = 2;
    g.alignment = 64;
    g.kvs.push((
        ALIGNMENT_KEY.as_bytes().to_vec(),
        U32,
        64u32.to_le_bytes().to_vec(),
    ));
    g.infos[1].offset = 64;
    g.infos.push(Info {
        name: b"scalar".to_vec(),
        dims: vec![],
        type_id: 0,
        offset: 192,
    });
    g.data_len = 196;
    let file = open(&g.bytes());
    assert_eq!((file.version(), file.alignment()), (2, 64));
    assert_eq!(file.data_start() % 64, 0);
    let s = file.tensor("scalar").unwrap();
    assert_eq!((s.shape.len(), s.elements(), s.nbytes), (0, 1, 4));
}

#[test]
fn nested_arrays_up_to_the_depth_limit_are_read() {
    fn nested(depth: usize) -> Vec<u8> {
        let mut v = array(U32, 1, &5u32.to_le_bytes());
        for _ in 1..depth {
            v = array(ARRAY, 1, &v);
        }
        v
    }
    let mut g = Gguf::valid();
    g.kvs
        .push((b"deep".to_vec(), ARRAY, nested(MAX_ARRAY_DEPTH)));
    let file = open(&g.bytes());
    let mut v = file.get_array("deep").unwrap().unwrap();
    for _ in 1..MAX_ARRAY_DEPTH {
        match v {
            GgufArray::Array(inner) => v = &inner[0],
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(v, &GgufArray::U32(vec![5]));

    g.kvs.last_mut().unwrap().2 = nested(MAX_ARRAY_DEPTH + 1);
    refused(
        &g.bytes(),
        "metadata `deep`",
        "nests arrays more than 8 deep",
    );
}

#[test]
fn truncation_anywhere_is_a_typed_error() {
    let g = Gguf::valid();
    let bytes = g.bytes();
    for keep in 0..bytes.len() {
        let (field, problem) = gguf_error(check(&bytes[..keep]));
        assert!(
            problem.contains("truncated") || problem.contains("not a GGUF file"),
            "{keep}: {field} {problem}"
        );
        if keep < 4 {
            assert_eq!(field, "magic");
        } else if keep < 8 {
            assert_eq!(field, "version");
        }
    }
    // Cut inside the data: the tensor whose bytes are missing is named.
    refused(
        &bytes[..bytes.len() - 1],
        "tensor `b`.offset",
        "past the end of the file",
    );
}

#[test]
fn bad_magic_and_versions_are_refused() {
    let mut g = Gguf::valid();
    g.magic = *b"GGML";
    refused(&g.bytes(), "magic", "not a GGUF file");
    let mut g = Gguf::valid();
    g.version = 1;
    refused(&g.bytes(), "version", "is 1");
    g.version = 3u32.swap_bytes();
    refused(&g.bytes(), "version", "big-endian");
    g.version = 4;
    refused(&g.bytes(), "version", "versions 2 and 3");
}

#[test]
fn counts_that_cannot_fit_in_the_file_are_refused() {
    let mut g = Gguf::valid();
    g.tensor_count = Some(u64::MAX);
    refused(&g.bytes(), "tensor_count", "claims");
    // Fits the bytes after the counts, not those after the metadata.
    let mut g = Gguf::valid();
    let after_counts = g.bytes().len() - 24;
    g.tensor_count = Some((after_counts / 32) as u64);
    refused(&g.bytes(), "tensor_count", "after the metadata");
    let mut g = Gguf::valid();
    g.kv_count = Some(1 << 40);
    refused(&g.bytes(), "metadata_kv_count", "claims");
}

#[test]
fn string_and_array_lengths_past_the_file_are_refused() {
    let mut g = Gguf::valid();
    g.kvs[1].0 = vec![];
    let mut bytes = g.bytes();
    // The empty key's length sits after the header (24 B) and the first entry (its key's
    // length and 20 bytes, a type, the value's length and 4 bytes); claim 2^62 bytes.
    let first = 24 + 8 + 20 + 4 + 8 + 4;
    bytes[first..first + 8].copy_from_slice(&(1u64 << 62).to_le_bytes());
    refused(&bytes, "metadata[1].key", "bytes of string");

    let mut g = Gguf::valid();
    g.kvs[0].2 = (u64::MAX - 3).to_le_bytes().to_vec();
    refused(
        &g.bytes(),
        "metadata `general.architecture`",
        "bytes of string",
    );

    let mut g = Gguf::valid();
    g.kvs[2].2 = array(10, 1 << 58, &[]);
    refused(&g.bytes(), "metadata `test.names`", "array elements");
    // Strings are at least their 8-byte length: 2^40 of them cannot fit.
    g.kvs[2].2 = array(STRING, 1 << 40, &[]);
    refused(&g.bytes(), "metadata `test.names`", "array elements");

    let mut g = Gguf::valid();
    g.infos[0].name = vec![b'a'; 3];
    let mut bytes = g.bytes();
    let at = bytes.windows(3).position(|w| w == b"aaa").unwrap() - 8;
    bytes[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes());
    refused(&bytes, "tensors[0].name", "bytes of string");
}

#[test]
fn malformed_metadata_values_are_refused() {
    let mut g = Gguf::valid();
    g.kvs[1].1 = 13;
    refused(&g.bytes(), "metadata `test.n`", "value type 13");
    let mut g = Gguf::valid();
    g.kvs[1] = (b"test.b".to_vec(), 7, vec![2]);
    refused(&g.bytes(), "metadata `test.b`", "only 0 and 1");
    let mut g = Gguf::valid();
    g.kvs[2].2 = array(14, 0, &[]);
    refused(&g.bytes(), "metadata `test.names`", "value type 14");
    let mut g = Gguf::valid();
    g.kvs[0].1 = U32;
    g.kvs[0].2 = 1u32.to_le_bytes().to_vec();
    refused(&g.bytes(), "general.architecture", "requires a string");
}

#[test]
fn duplicate_metadata_keys_are_refused() {
    let mut g = Gguf::valid();
    g.kvs.push(g.kvs[1].clone());
    refused(&g.bytes(), "metadata `test.n`", "appears twice");
}

#[test]
fn non_utf8_strings_are_refused() {
    let mut g = Gguf::valid();
    g.kvs[1].0 = b"test.\xff".to_vec();
    refused(&g.bytes(), "metadata[1].key", "not UTF-8");
    let mut g = Gguf::valid();
    g.kvs[0].2 = string(b"\xc3(");
    refused(&g.bytes(), "metadata `general.architecture`", "not UTF-8");
    let mut g = Gguf::valid();
    g.kvs[2].2 = array(STRING, 1, &string(b"\x80"));
    refused(&g.bytes(), "metadata `test.names`", "not UTF-8");
    let mut g = Gguf::valid();
    g.infos[1].name = b"b\xfe".to_vec();
    refused(&g.bytes(), "tensors[1].name", "not UTF-8");
}

#[test]
fn bad_alignments_are_refused() {
    for (ty, value, needle) in [
        (U32, 48u32.to_le_bytes().to_vec(), "power of two"),
        (U32, 0u32.to_le_bytes().to_vec(), "power of two"),
        (10, 32u64.to_le_bytes().to_vec(), "requires a uint32"),
    ] {
        let mut g = Gguf::valid();
        g.kvs.push((ALIGNMENT_KEY.as_bytes().to_vec(), ty, value));
        refused(&g.bytes(), ALIGNMENT_KEY, needle);
    }
}

#[test]
fn too_many_dims_zero_dims_and_overflowing_shapes_are_refused() {
    let mut g = Gguf::valid();
    g.infos[0].dims = vec![1, 1, 1, 1, 8];
    refused(&g.bytes(), "tensor `a`.n_dims", "at most 4");
    let mut g = Gguf::valid();
    g.infos[0].dims = vec![8, 0];
    refused(&g.bytes(), "tensor `a`.dims[1]", "is 0");
    let mut g = Gguf::valid();
    g.infos[0].dims = vec![1 << 32, 1 << 32];
    refused(&g.bytes(), "tensor `a`.dims", "addressable");
    // The elements fit a usize, their bytes do not.
    let mut g = Gguf::valid();
    g.infos[0].dims = vec![1 << 62];
    refused(
        &g.bytes(),
        "tensor `a`.dims",
        "more bytes than are addressable",
    );
}

#[test]
fn unknown_and_unsupported_types_are_named() {
    let mut g = Gguf::valid();
    g.infos[1].type_id = 16;
    refused(
        &g.bytes(),
        "tensor `b`.type",
        "type 16 (IQ2_XXS) is not supported; supported: F32, F16, Q4_0",
    );
    g.infos[1].type_id = 99;
    refused(&g.bytes(), "tensor `b`.type", "type 99 is not a GGML type");
    g.infos[1].type_id = 15;
    refused(&g.bytes(), "tensor `b`.type", "(Q8_K)");
}

#[test]
fn rows_that_are_not_whole_blocks_are_refused() {
    let mut g = Gguf::valid();
    // 64 elements, two blocks' worth, but rows of 16.
    g.infos[1].dims = vec![16, 4];
    refused(&g.bytes(), "tensor `b`.dims[0]", "32-element blocks");
}

#[test]
fn misaligned_and_out_of_file_offsets_are_refused() {
    let mut g = Gguf::valid();
    g.infos[1].offset = 36;
    refused(
        &g.bytes(),
        "tensor `b`.offset",
        "not a multiple of the alignment 32",
    );
    let mut g = Gguf::valid();
    g.infos[1].offset = 64;
    refused(&g.bytes(), "tensor `b`.offset", "past the end of the file");
    // Data start + offset overflows.
    let mut g = Gguf::valid();
    g.infos[1].offset = u64::MAX - 31;
    refused(&g.bytes(), "tensor `b`.offset", "past the end of the file");
}

#[test]
fn overlapping_tensors_are_refused() {
    let mut g = Gguf::valid();
    g.infos[0].dims = vec![16, 2]; // 128 B from 0: over `b` at 32
    g.data_len = 128 + 68;
    refused(&g.bytes(), "tensor `b`.offset", "overlaps tensor `a`");
}

#[test]
fn duplicate_tensor_names_are_refused() {
    let mut g = Gguf::valid();
    g.infos[1].name = b"a".to_vec();
    refused(&g.bytes(), "tensors[1].name", "`a` appears twice");
}

#[test]
fn errors_name_the_file_the_field_and_what_to_do() {
    let mut g = Gguf::valid();
    g.infos[0].dims = vec![1, 1, 1, 1, 8];
    let shown = check(&g.bytes()).unwrap_err().to_string();
    assert!(shown.contains(PATH), "{shown}");
    assert!(shown.contains("tensor `a`.n_dims is 5"), "{shown}");
    assert!(shown.contains("convert the model again"), "{shown}");
}

#[test]
fn dequantize_refuses_sizes_that_do_not_match() {
    assert!(matches!(
        ddo_core::gguf::dequantize(GgmlType::Q4_K, &[0; 144], 255),
        Err(CoreError::Shape { .. })
    ));
    assert!(matches!(
        ddo_core::gguf::dequantize(GgmlType::Q4_K, &[0; 145], 256),
        Err(CoreError::SizeMismatch { .. })
    ));
    let bf16 = [0x80, 0x3f, 0x00, 0xc0]; // 1.0, -2.0
    assert_eq!(
        ddo_core::gguf::dequantize(GgmlType::BF16, &bf16, 2).unwrap(),
        [1.0, -2.0]
    );
    let half = f16::from_f32(-0.25).to_bits().to_le_bytes();
    assert_eq!(
        ddo_core::gguf::dequantize(GgmlType::F16, &half, 1).unwrap(),
        [-0.25]
    );
    assert_eq!(GgufValueType::from_id(9), Some(GgufValueType::Array));
}

// --- Arbitrary corruption. ---

fn mutated(
    base: &[u8],
    edits: &[(prop::sample::Index, u8)],
    cut: Option<prop::sample::Index>,
) -> Vec<u8> {
    let mut bytes = base.to_vec();
    for (at, b) in edits {
        let i = at.index(bytes.len());
        bytes[i] = *b;
    }
    if let Some(cut) = cut {
        bytes.truncate(cut.index(bytes.len() + 1));
    }
    bytes
}

/// Validation returns Ok or a `Gguf` error naming the file (a panic fails the case).
fn assert_ok_or_typed(bytes: &[u8]) -> Result<(), TestCaseError> {
    let result = check(bytes);
    if result.is_err() {
        gguf_error(result);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn mutations_of_a_built_file_never_panic(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in prop::option::of(any::<prop::sample::Index>()),
    ) {
        assert_ok_or_typed(&mutated(&Gguf::valid().bytes(), &edits, cut))?;
    }

    #[test]
    fn mutations_of_the_fixture_never_panic(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in prop::option::of(any::<prop::sample::Index>()),
    ) {
        let base = std::fs::read(fixture("types.gguf")).unwrap();
        // Edits land in the header (metadata and infos), where the parser reads.
        let header = 1216;
        let mut bytes = mutated(&base[..header], &edits, None);
        bytes.extend_from_slice(&base[header..]);
        if let Some(cut) = cut {
            bytes.truncate(cut.index(bytes.len() + 1));
        }
        assert_ok_or_typed(&bytes)?;
    }

    #[test]
    fn arbitrary_bytes_after_a_valid_start_never_panic(
        tail in prop::collection::vec(any::<u8>(), 0..256),
    ) {
        let mut bytes = b"GGUF\x03\x00\x00\x00".to_vec();
        bytes.extend(tail);
        assert_ok_or_typed(&bytes)?;
    }
}

/// A GGUF file as a checkpoint over its own mapping (`Checkpoint::from_gguf`): float tensors
/// as their dtypes, quantized ones as `Quantized` bytes carrying their block layout, which a
/// param made from them keeps and the host's `Ops::dequantize` expands exactly as the
/// reference does; a layout that does not fit its bytes, and a tensor with none, are refused.
#[test]
fn quantized_tensors_stay_blocks_and_dequantize_where_they_are_used() {
    use ddo_core::{DType, Device, Ops, Param, ParamKind, QuantLayout, Tensor};
    let file = GgufFile::open(&fixture("types.gguf")).unwrap();
    let ckpt = Checkpoint::from_gguf(&file).unwrap();
    let f32_info = ckpt.tensor("f32").unwrap();
    assert_eq!(
        (f32_info.dtype, f32_info.shape.clone()),
        (DType::F32, vec![2, 256])
    );
    assert!(f32_info.quant.is_none());
    let q = ckpt.tensor("q4_k").unwrap();
    let layout = q.quant.clone().expect("a block layout");
    assert_eq!(q.dtype, DType::Quantized);
    assert_eq!(q.shape, [2 * 144]);
    assert_eq!(
        (layout.ty, layout.shape.clone()),
        (GgmlType::Q4_K, vec![2, 256])
    );
    assert_eq!(layout.row_bytes(), 144);
    // The bytes are the file's own (no copy).
    let raw = file.raw("q4_k").unwrap();
    assert_eq!(ckpt.raw("q4_k").unwrap().bytes, raw);
    let param = Param::from_checkpoint(&ckpt, "q4_k", "w", ParamKind::Parameter).unwrap();
    assert_eq!(param.logical_shape(), [2, 256]);
    assert_eq!(param.quant(), Some(&layout));
    let device = ddo_host::HostDevice::with_capacity(1 << 20).unwrap();
    let stream = device.compute_stream();
    let on_device = param
        .host_tensor()
        .unwrap()
        .to_device(&*device, &stream)
        .unwrap();
    assert_eq!(on_device.quant(), Some(&layout));
    let want = ddo_core::gguf::dequantize(GgmlType::Q4_K, raw, 512).unwrap();
    let got = device.dequantize(&on_device, DType::F32).unwrap();
    assert_eq!(got.shape(), [2, 256]);
    let got = device.to_f32_vec(&got).unwrap();
    assert!(
        got.iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits())
    );
    let bf = device.dequantize(&on_device, DType::BF16).unwrap();
    assert_eq!(
        bf.to_host_bytes(&*device, &stream).unwrap(),
        DType::BF16.encode_f32(&want).unwrap()
    );
    // Refusals: a layout of other bytes, rows that are not whole blocks, no layout at all.
    let too_big = Arc::new(QuantLayout::new("w", GgmlType::Q4_K, vec![4, 256]).unwrap());
    assert!(on_device.clone().with_quant(Some(too_big)).is_err());
    assert!(QuantLayout::new("w", GgmlType::Q4_K, vec![2, 128]).is_err());
    let plain = device.tensor_from_f32(&[4], DType::F32, &[1.0; 4]).unwrap();
    assert!(device.dequantize(&plain, DType::F32).is_err());
    let bytes = Tensor::from_f32(vec![4], DType::F32, &[0.0; 4]).unwrap();
    assert!(bytes.with_quant(None).is_ok());
}
