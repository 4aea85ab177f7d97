//! The sandbox's entries: what each is made of ([`Entry`], from the repository's
//! `fixtures/`), how it is made, and the cheap print ([`Print`]) that tells whether it
//! changed.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// What a sandbox entry is made of.
#[derive(Debug, Clone)]
pub(super) enum Entry {
    Dir,
    File(Vec<u8>),
    /// A copy of a file of the repository's `fixtures/` (read again to restore it).
    Copy(PathBuf),
    Link(PathBuf),
    Fifo,
}

/// What identifies an entry's state: its type, and for files size, mtime, inode and a
/// digest of every byte, so a write that keeps the size and the time (or sets the time
/// back) is seen after the execution that made it, not only by the periodic full compare.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Print {
    kind: u8,
    len: u64,
    modified: Option<SystemTime>,
    inode: u64,
    digest: u64,
}

/// A fast digest of a file's bytes (8 bytes at a time, multiply-xor-rotate); not
/// cryptographic, only a change detector. 0 when the file cannot be read.
fn digest(path: &Path) -> u64 {
    let Ok(bytes) = fs::read(path) else { return 0 };
    let mut h: u64 = 0x9e37_79b9_7f4a_7c15 ^ bytes.len() as u64;
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        let v = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
        h = (h ^ v).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(29);
    }
    for &b in chunks.remainder() {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

pub(super) fn print(path: &Path) -> Option<Print> {
    let m = fs::symlink_metadata(path).ok()?;
    let t = m.file_type();
    let kind = if t.is_dir() {
        1
    } else if t.is_symlink() {
        2
    } else if t.is_file() {
        0
    } else {
        3
    };
    #[cfg(unix)]
    let inode = std::os::unix::fs::MetadataExt::ino(&m);
    #[cfg(not(unix))]
    let inode = 0;
    // A folder's size and time change when a file comes and goes inside (the output
    // probe): what is inside is checked entry by entry instead.
    let (len, modified) = if kind == 1 {
        (0, None)
    } else {
        (m.len(), m.modified().ok())
    };
    // Regular files only: a FIFO would block, a link is followed by its target's entry.
    let digest = if kind == 0 { digest(path) } else { 0 };
    Some(Print {
        kind,
        len,
        modified,
        inode,
        digest,
    })
}

/// The repository's `fixtures/` folder.
pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

/// A safetensors file of f32 tensors `(name, shape, values)`.
fn safetensors(tensors: &[(&str, &[usize], &[f32])]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, shape, values) in tensors {
        let start = data.len();
        for v in *values {
            data.extend_from_slice(&v.to_le_bytes());
        }
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let header = serde_json::Value::Object(header).to_string();
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(&data);
    bytes
}

/// Deterministic values in about [-1, 1].
fn wave(n: usize) -> Vec<f32> {
    (0..n).map(|i| ((i as f32) * 0.7).sin()).collect()
}

/// The sandbox's entries, relative to its root: `pipe/` (the `flux_pipeline` fixture's model
/// folders), `vae/` (a copy of its VAE: 4 latent channels, 186 KB; `vae_flux`'s decoder is 15
/// times its size and would cost most of a decode's time), latents and embeddings that fit
/// them at 16x16 pixels, latents with 16 channels, broken safetensors, a FIFO, folders named
/// like files, links.
pub(super) fn entries(fixtures: &Path) -> io::Result<Vec<(PathBuf, Entry)>> {
    let mut out: Vec<(PathBuf, Entry)> = Vec::new();
    let copy_tree = |from: &Path, to: &str, out: &mut Vec<(PathBuf, Entry)>| {
        fn walk(from: &Path, to: &Path, out: &mut Vec<(PathBuf, Entry)>) -> io::Result<()> {
            out.push((to.to_path_buf(), Entry::Dir));
            let mut names: Vec<_> = fs::read_dir(from)?.collect::<io::Result<Vec<_>>>()?;
            names.sort_by_key(|e| e.file_name());
            for e in names {
                let (src, dst) = (e.path(), to.join(e.file_name()));
                if e.file_type()?.is_dir() {
                    walk(&src, &dst, out)?;
                } else {
                    out.push((dst, Entry::Copy(src)));
                }
            }
            Ok(())
        }
        walk(from, Path::new(to), out)
    };
    let pipe = fixtures.join("flux_pipeline");
    copy_tree(&pipe.join("vae"), "vae", &mut out)?;
    out.push(("pipe".into(), Entry::Dir));
    out.push((
        "pipe/model_index.json".into(),
        Entry::Copy(pipe.join("model_index.json")),
    ));
    for d in [
        "scheduler",
        "text_encoder",
        "text_encoder_2",
        "tokenizer",
        "tokenizer_2",
        "transformer",
        "vae",
    ] {
        copy_tree(&pipe.join(d), &format!("pipe/{d}"), &mut out)?;
    }
    let lat = safetensors(&[("latents", &[1, 4, 8, 8], &wave(256))]);
    out.push((
        "trunc.safetensors".into(),
        Entry::File(lat[..lat.len() / 2].to_vec()),
    ));
    out.push(("lat.safetensors".into(), Entry::File(lat)));
    out.push((
        "lat16.safetensors".into(),
        Entry::Copy(fixtures.join("vae_flux/inputs.safetensors")),
    ));
    out.push((
        "noise.safetensors".into(),
        Entry::File(safetensors(&[("noise", &[1, 4, 8, 8], &wave(256))])),
    ));
    out.push((
        "packed.safetensors".into(),
        Entry::File(safetensors(&[("latents", &[1, 16, 16], &wave(256))])),
    ));
    out.push((
        "emb.safetensors".into(),
        Entry::Copy(pipe.join("inputs.safetensors")),
    ));
    // Single-file components (--transformer, --vae): inputs an output must never replace.
    out.push((
        "tr.safetensors".into(),
        Entry::Copy(
            fixtures.join("flux_transformer_original/flux_pipeline-transformer.safetensors"),
        ),
    ));
    out.push((
        "ae.safetensors".into(),
        Entry::Copy(fixtures.join("vae_flux_original/flux_pipeline-vae.safetensors")),
    ));
    out.push(("empty.safetensors".into(), Entry::File(Vec::new())));
    let mut garbage = u64::MAX.to_le_bytes().to_vec();
    garbage.extend_from_slice(b"{\"latents\":");
    out.push(("garbage.safetensors".into(), Entry::File(garbage)));
    let mut nan = wave(256);
    nan[7] = f32::NAN;
    out.push((
        "nan.safetensors".into(),
        Entry::File(safetensors(&[("latents", &[1, 4, 8, 8], &nan)])),
    ));
    out.push(("dir".into(), Entry::Dir));
    out.push(("dir.safetensors".into(), Entry::Dir));
    if cfg!(unix) {
        out.push(("fifo.safetensors".into(), Entry::Fifo));
        out.push(("fifo.png".into(), Entry::Fifo));
        out.push((
            "link.safetensors".into(),
            Entry::Link("lat.safetensors".into()),
        ));
        out.push((
            "dangling.safetensors".into(),
            Entry::Link("missing-target.safetensors".into()),
        ));
    }
    Ok(out)
}

/// Makes `entry` at `path` (replacing whatever is there).
pub(super) fn make(path: &Path, entry: &Entry) -> io::Result<()> {
    if let Ok(m) = fs::symlink_metadata(path) {
        if m.is_dir() {
            if matches!(entry, Entry::Dir) {
                return Ok(());
            }
            fs::remove_dir_all(path)?;
        } else {
            fs::remove_file(path)?;
        }
    }
    match entry {
        Entry::Dir => fs::create_dir(path),
        Entry::File(bytes) => fs::write(path, bytes),
        Entry::Copy(from) => fs::copy(from, path).map(|_| ()),
        Entry::Link(target) => {
            #[cfg(unix)]
            {
                std::os::unix::fs::symlink(target, path)
            }
            #[cfg(not(unix))]
            {
                let _ = target;
                Ok(())
            }
        }
        Entry::Fifo => {
            let ok = std::process::Command::new("mkfifo")
                .arg(path)
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                Ok(())
            } else {
                Err(io::Error::other(format!(
                    "mkfifo {} failed (is coreutils' mkfifo on PATH?)",
                    path.display()
                )))
            }
        }
    }
}

/// Every entry under `dir` (not following links), relative to `root`.
pub(super) fn scan(root: &Path, dir: &Path, out: &mut BTreeMap<PathBuf, Print>) {
    let Ok(rd) = fs::read_dir(dir) else { return };
    for e in rd.flatten() {
        let path = e.path();
        let Some(p) = print(&path) else { continue };
        let is_dir = p.kind == 1;
        if let Ok(rel) = path.strip_prefix(root) {
            out.insert(rel.to_path_buf(), p);
        }
        if is_dir {
            scan(root, &path, out);
        }
    }
}
