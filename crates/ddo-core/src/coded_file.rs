//! Writing coded safetensors files (`ddo convert --compress lossless`): every 2-D 16-bit
//! float tensor of a checkpoint stored as one unit of `ddo-codec`'s format, named in the
//! header's `__metadata__` under [`CODED_METADATA_KEY`], so a cold start reads about two
//! thirds of the bytes and coded streaming copies the units as they are. The reader is
//! [`Checkpoint`] (the same validator as every safetensors file); this module only writes.
//!
//! **Bounded memory.** Tensors are coded in batches of at most [`BATCH_BYTES`] raw bytes on
//! every core and written as they are done, behind a header region reserved at its largest
//! possible size (every number at 20 digits, every candidate both coded and raw), which
//! the final header fills, padded with spaces as the format allows. Each tensor's source
//! pages leave the process once it is written.
//!
//! **What is coded.** A tensor of dtype BF16 or F16 with two dimensions and at least
//! [`MIN_CODED_BYTES`] bytes, when its unit is smaller than its bytes. Everything else
//! (biases, norms, convolutions, f32 and integer tensors) is copied as it is, and the
//! source's own `__metadata__` entries are kept.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Seek, SeekFrom, Write};
use std::path::Path;

use crate::checkpoint::{CODED_METADATA_KEY, Checkpoint};
use crate::error::{CoreError, Result};

/// Raw bytes of tensors coded at once (one batch on every core).
pub const BATCH_BYTES: usize = 1 << 30;

/// Smallest tensor coded (one 2,048-word half chunk; a unit takes the smallest tables that
/// code it, and a tensor that does not shrink is stored as it is).
pub const MIN_CODED_BYTES: usize = 4 << 10;

/// What [`write_coded_safetensors`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CodedFileStats {
    /// Tensors in the file.
    pub tensors: usize,
    /// Tensors stored coded.
    pub coded: usize,
    /// Bytes of the source file.
    pub source_bytes: u64,
    /// Bytes of the file written.
    pub written_bytes: u64,
}

impl CodedFileStats {
    /// Adds another file's figures.
    pub fn add(&mut self, other: CodedFileStats) {
        self.tensors += other.tensors;
        self.coded += other.coded;
        self.source_bytes += other.source_bytes;
        self.written_bytes += other.written_bytes;
    }
}

/// One tensor of the source, as stored.
struct Entry<'a> {
    name: &'a str,
    dtype: &'a str,
    shape: &'a [usize],
    bytes: &'a [u8],
}

impl Entry<'_> {
    fn is_candidate(&self) -> bool {
        matches!(self.dtype, "BF16" | "F16")
            && self.shape.len() == 2
            && self.bytes.len() >= MIN_CODED_BYTES
    }
}

/// How one tensor was written: coded (its unit's length) or as it is.
enum Written {
    Coded(usize),
    Raw,
}

/// Writes `src` (a safetensors file, validated as [`Checkpoint::open`] validates any) into
/// `out`, a new, empty file the caller created exclusively (named `out_path` in errors),
/// with its 2-D 16-bit tensors coded (see the [module docs](self)). A source that holds
/// coded tensors already is refused. The caller owns the file's name: on an error it
/// removes the file, and on success it moves it into place.
pub fn write_coded_safetensors(
    src: &Path,
    out: &mut File,
    out_path: &Path,
) -> Result<CodedFileStats> {
    let checkpoint = Checkpoint::open(src)?;
    if checkpoint.has_coded() {
        return Err(CoreError::Checkpoint {
            path: src.to_path_buf(),
            message: "holds coded tensors already (ddo convert's output): use it as it is".into(),
        });
    }
    let io = |source: std::io::Error| CoreError::Io {
        path: out_path.to_path_buf(),
        source,
    };
    let base = checkpoint.map().bytes().as_ptr() as usize;
    let mut names: Vec<&str> = checkpoint.names().collect();
    names.extend(checkpoint.unsupported().map(|(n, _)| n));
    let mut entries: Vec<Entry<'_>> = names
        .iter()
        .filter_map(|&name| {
            let raw = checkpoint.raw(name)?;
            Some(Entry {
                name,
                dtype: raw.dtype,
                shape: raw.shape,
                bytes: raw.bytes,
            })
        })
        .collect();
    entries.sort_by_key(|e| e.bytes.as_ptr() as usize - base);
    let metadata = source_metadata(checkpoint.map().bytes(), src)?;
    // The header region at its largest: every number 20 digits, every candidate counted in
    // both forms, and the coded list naming every candidate.
    let widest = entries.iter().map(|e| {
        let as_is = header_entry(e.name, e.dtype, e.shape, [u64::MAX; 2]);
        let coded = header_entry(e.name, "U8", &[usize::MAX], [u64::MAX; 2]);
        as_is
            .len()
            .max(if e.is_candidate() { coded.len() } else { 0 })
            + 1
    });
    let candidates: Vec<&Entry<'_>> = entries.iter().filter(|e| e.is_candidate()).collect();
    let reserved =
        (widest.sum::<usize>() + metadata_json(&metadata, &coded_list(&candidates)).len() + 64)
            .next_multiple_of(8);
    out.set_len(0).map_err(io)?;
    out.seek(SeekFrom::Start(8 + reserved as u64)).map_err(io)?;
    let mut written: Vec<(Written, u64, u64)> = Vec::with_capacity(entries.len());
    let mut offset = 0u64;
    let mut i = 0;
    while i < entries.len() {
        // One batch: the candidates up to BATCH_BYTES, coded on every core.
        let mut j = i;
        let mut batch_bytes = 0usize;
        while j < entries.len() && (j == i || batch_bytes + entries[j].bytes.len() <= BATCH_BYTES) {
            if entries[j].is_candidate() {
                batch_bytes += entries[j].bytes.len();
            }
            j += 1;
        }
        let batch: Vec<&[u8]> = entries[i..j]
            .iter()
            .filter(|e| e.is_candidate())
            .map(|e| e.bytes)
            .collect();
        let mut coded = ddo_codec::encode_units_parallel(&batch)
            .map_err(|e| CoreError::Checkpoint {
                path: src.to_path_buf(),
                message: format!("a tensor could not be coded: {e}"),
            })?
            .into_iter();
        for e in &entries[i..j] {
            let unit = if e.is_candidate() { coded.next() } else { None };
            let (bytes, how): (&[u8], Written) = match &unit {
                Some(u) if u.len() < e.bytes.len() => (u.bytes(), Written::Coded(u.len())),
                _ => (e.bytes, Written::Raw),
            };
            out.write_all(bytes).map_err(io)?;
            let len = bytes.len() as u64;
            written.push((how, offset, offset + len));
            offset += len;
            // Read once: the source's pages leave the process (advice only), so a
            // conversion need not keep a whole shard's pages mapped (job 5 of stop 44
            // measured 10.5 GB of max RSS converting the FLUX.1-dev folder before this).
            let at = e.bytes.as_ptr() as usize - base;
            checkpoint.map().release_pages(at..at + e.bytes.len());
        }
        i = j;
    }
    // The header: the source's entries with their new offsets, then the coded list.
    let mut coded_names = Vec::new();
    let mut header = String::from("{");
    for (e, (how, start, end)) in entries.iter().zip(&written) {
        let text = match how {
            Written::Coded(len) => {
                coded_names.push(e);
                header_entry(e.name, "U8", &[*len], [*start, *end])
            }
            Written::Raw => header_entry(e.name, e.dtype, e.shape, [*start, *end]),
        };
        header.push_str(&text);
        header.push(',');
    }
    header.push_str(&metadata_json(&metadata, &coded_list(&coded_names)));
    header.push('}');
    if header.len() > reserved {
        return Err(CoreError::Checkpoint {
            path: out_path.to_path_buf(),
            message: format!(
                "the header came to {} B, over the {reserved} B reserved for it (a DDO defect)",
                header.len()
            ),
        });
    }
    header.push_str(&" ".repeat(reserved - header.len()));
    out.seek(SeekFrom::Start(0)).map_err(io)?;
    out.write_all(&(reserved as u64).to_le_bytes())
        .map_err(io)?;
    out.write_all(header.as_bytes()).map_err(io)?;
    out.sync_all().map_err(io)?;
    Ok(CodedFileStats {
        tensors: entries.len(),
        coded: coded_names.len(),
        source_bytes: checkpoint.map().len() as u64,
        written_bytes: 8 + reserved as u64 + offset,
    })
}

/// One header entry, `"name":{"dtype":..,"shape":[..],"data_offsets":[a,b]}`.
fn header_entry(name: &str, dtype: &str, shape: &[usize], offsets: [u64; 2]) -> String {
    let entry = serde_json::json!({
        "dtype": dtype,
        "shape": shape,
        "data_offsets": offsets,
    });
    format!("{}:{entry}", serde_json::Value::from(name))
}

/// The coded list's JSON text: per coded tensor the dtype and shape it decodes to.
fn coded_list(entries: &[&Entry<'_>]) -> String {
    let map: serde_json::Map<String, serde_json::Value> = entries
        .iter()
        .map(|e| {
            (
                e.name.to_string(),
                serde_json::json!({ "dtype": e.dtype, "shape": e.shape }),
            )
        })
        .collect();
    serde_json::Value::Object(map).to_string()
}

/// `"__metadata__":{...}` with the source's entries and the coded list.
fn metadata_json(source: &BTreeMap<String, String>, coded: &str) -> String {
    let mut map: serde_json::Map<String, serde_json::Value> = source
        .iter()
        .map(|(k, v)| (k.clone(), serde_json::Value::from(v.as_str())))
        .collect();
    map.insert(CODED_METADATA_KEY.into(), serde_json::Value::from(coded));
    format!("\"__metadata__\":{}", serde_json::Value::Object(map))
}

/// The source header's `__metadata__` (string values; others are refused, as the format
/// allows only strings).
fn source_metadata(bytes: &[u8], src: &Path) -> Result<BTreeMap<String, String>> {
    let bad = |message: String| CoreError::Checkpoint {
        path: src.to_path_buf(),
        message,
    };
    // The checkpoint validated the length and the JSON already.
    let len = u64::from_le_bytes(bytes[..8].try_into().unwrap_or([0; 8])) as usize;
    let json: serde_json::Value = serde_json::from_slice(&bytes[8..8 + len])
        .map_err(|e| bad(format!("header is not a JSON object: {e}")))?;
    let Some(meta) = json.get("__metadata__") else {
        return Ok(BTreeMap::new());
    };
    let meta = meta
        .as_object()
        .ok_or_else(|| bad("`__metadata__` is not an object".into()))?;
    meta.iter()
        .map(|(k, v)| {
            v.as_str()
                .map(|s| (k.clone(), s.to_string()))
                .ok_or_else(|| bad(format!("`__metadata__` `{k}` is not a string")))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A safetensors file of `tensors` (name, dtype, shape, bytes) with `meta`.
    fn safetensors(tensors: &[(&str, &str, Vec<usize>, Vec<u8>)], meta: &str) -> Vec<u8> {
        let mut header = format!("{{\"__metadata__\":{meta}");
        let mut data = Vec::new();
        for (name, dtype, shape, bytes) in tensors {
            let start = data.len();
            data.extend_from_slice(bytes);
            header.push(',');
            header.push_str(&header_entry(
                name,
                dtype,
                shape,
                [start as u64, data.len() as u64],
            ));
        }
        header.push('}');
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(&data);
        out
    }

    fn normal_bf16(n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .flat_map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let u = (s >> 11) as f64 / (1u64 << 53) as f64;
                let v = ((u - 0.5) * 0.04) as f32;
                ((v.to_bits() >> 16) as u16).to_le_bytes()
            })
            .collect()
    }

    /// Matrices are coded, the rest kept; every tensor reads back as the source's bytes,
    /// the source's metadata is kept, and the file is smaller.
    #[test]
    fn matrices_are_coded_and_read_back_bit_for_bit() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("w.safetensors");
        let tensors = vec![
            (
                "a.weight",
                "BF16",
                vec![256, 512],
                normal_bf16(256 * 512, 1),
            ),
            ("a.bias", "BF16", vec![256], normal_bf16(256, 2)),
            ("b.weight", "F32", vec![64, 64], vec![7u8; 64 * 64 * 4]),
            ("c.weight", "BF16", vec![8, 8], normal_bf16(64, 3)),
            (
                "d.weight",
                "BF16",
                vec![4, 2, 128, 64],
                normal_bf16(65536, 4),
            ),
            ("e.ids", "I64", vec![4], vec![1u8; 32]),
            (
                "f.weight",
                "BF16",
                vec![128, 512],
                normal_bf16(128 * 512, 5),
            ),
        ];
        std::fs::write(&src, safetensors(&tensors, r#"{"format":"pt"}"#)).unwrap();
        let out_path = dir.path().join("out.safetensors");
        let mut out = File::create_new(&out_path).unwrap();
        let stats = write_coded_safetensors(&src, &mut out, &out_path).unwrap();
        drop(out);
        assert_eq!((stats.tensors, stats.coded), (7, 2), "{stats:?}");
        assert_eq!(
            stats.written_bytes,
            std::fs::metadata(&out_path).unwrap().len()
        );
        assert!(stats.written_bytes < stats.source_bytes, "{stats:?}");
        let back = Checkpoint::open(&out_path).unwrap();
        assert!(back.has_coded());
        for (name, dtype, shape, bytes) in &tensors {
            if *dtype == "I64" {
                assert_eq!(back.raw(name).unwrap().bytes, bytes.as_slice());
                continue;
            }
            let t = back.tensor(name).unwrap();
            assert_eq!(&t.shape, shape, "{name}");
            assert_eq!(
                t.dtype.as_str(),
                crate::DType::from_header_name(dtype).unwrap().as_str()
            );
            let coded = ["a.weight", "f.weight"].contains(name);
            assert_eq!(t.coded.is_some(), coded, "{name}");
            let host = back.host_buffer(name).unwrap();
            assert_eq!(host.len(), bytes.len());
            assert_eq!(
                host.slice_all().try_with_bytes(<[u8]>::to_vec).unwrap(),
                *bytes,
                "{name}"
            );
            assert_eq!(host.slice_all().to_vec(), *bytes, "{name}");
        }
        let meta = source_metadata(back.map().bytes(), &out_path).unwrap();
        assert_eq!(meta.get("format").map(String::as_str), Some("pt"));
        // A coded file is not converted again.
        let again = dir.path().join("again.safetensors");
        let mut f = File::create_new(&again).unwrap();
        let err = write_coded_safetensors(&out_path, &mut f, &again).unwrap_err();
        assert!(err.to_string().contains("coded tensors already"), "{err}");
    }

    /// A flipped byte in a coded unit: the header check refuses the file at open where it
    /// hits the unit's tables, and a flip in the words is the typed error where the
    /// tensor is read (never other weights); the infallible read gives NaN words.
    #[test]
    fn a_corrupt_coded_tensor_is_an_error_where_it_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("w.safetensors");
        let words = normal_bf16(256 * 512, 9);
        std::fs::write(
            &src,
            safetensors(&[("a.weight", "BF16", vec![256, 512], words.clone())], "{}"),
        )
        .unwrap();
        let out_path = dir.path().join("out.safetensors");
        let mut out = File::create_new(&out_path).unwrap();
        write_coded_safetensors(&src, &mut out, &out_path).unwrap();
        drop(out);
        let good = Checkpoint::open(&out_path).unwrap();
        let t = good.tensor("a.weight").unwrap().clone();
        let header = t.coded.clone().unwrap();
        drop(good);
        let mut bytes = std::fs::read(&out_path).unwrap();
        // A byte of the sign+mantissa section: only the checksum can tell.
        let at = t.offset + header.mantissa_offset() as usize + 1000;
        bytes[at] ^= 0x10;
        let bad_path = dir.path().join("bad.safetensors");
        std::fs::write(&bad_path, &bytes).unwrap();
        let bad = Checkpoint::open(&bad_path).unwrap();
        let host = bad.host_buffer("a.weight").unwrap().slice_all();
        let err = host.try_with_bytes(|_| ()).unwrap_err().to_string();
        assert!(
            err.contains("a.weight") && err.contains("bad.safetensors"),
            "{err}"
        );
        assert!(host.to_vec().chunks(2).all(|w| w == [0xff, 0xff]));
        // A byte of the unit's header: refused at open, naming the tensor.
        let mut bytes = std::fs::read(&out_path).unwrap();
        bytes[t.offset + 9] ^= 0x01;
        std::fs::write(&bad_path, &bytes).unwrap();
        let err = Checkpoint::open(&bad_path).unwrap_err().to_string();
        assert!(err.contains("a.weight"), "{err}");
    }
}
