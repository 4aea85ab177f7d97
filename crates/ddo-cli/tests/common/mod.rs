//! Helpers the `ddo` binary's integration tests share: the repository and its fixtures, a
//! scratch folder per test, running the binary without the caller's `DDO_*` variables, and
//! reading what it wrote.
#![allow(dead_code)]

pub mod server;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn fixture(rel: &str) -> String {
    repo().join("fixtures").join(rel).display().to_string()
}

/// A test's scratch folder: created exclusively under a random name in the temporary
/// directory (`tempfile`), and removed with what it holds when dropped. It reads as the
/// folder's path.
pub struct Scratch(tempfile::TempDir);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        self.0.path()
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        self.0.path()
    }
}

/// A fresh scratch folder for one test ([`Scratch`]: gone when the test drops it).
pub fn scratch(name: &str) -> Scratch {
    Scratch(
        tempfile::Builder::new()
            .prefix(&format!("ddo-cli-{name}-"))
            .tempdir()
            .unwrap(),
    )
}

/// `ddo bench` of the tiny config's transformer at 32x32, `repeats` timed forwards and no
/// warm-up, then `extra`.
pub fn tiny_bench<'a>(repeats: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "bench",
        "--config",
        "tiny",
        "--height",
        "32",
        "--width",
        "32",
        "--repeats",
        repeats,
        "--warmup",
        "0",
    ];
    args.extend_from_slice(extra);
    args
}

pub fn ddo_with_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ddo"));
    cmd.args(args);
    for (k, _) in std::env::vars() {
        if k.starts_with("DDO_") {
            cmd.env_remove(k);
        }
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run ddo")
}

pub fn ddo(args: &[&str]) -> Output {
    ddo_with_env(args, &[])
}

pub fn ok(out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "exit {:?}\nstdout: {stdout}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

pub fn json(out: &Output) -> Value {
    serde_json::from_str(&ok(out)).expect("stdout is JSON")
}

pub fn tensor(path: &Path, name: &str) -> (Vec<usize>, Vec<f32>) {
    ddo_nn::read_f32_tensor(path, name).expect("tensor")
}

pub fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Writes `tensors` (name, shape, values) as an f32 safetensors file at `path`.
pub fn write_f32_safetensors(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((n, s, _), b)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                .expect("a tensor view");
            (n.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).expect("write safetensors");
}

/// Relative L2 distance of `a` from `b` (`‖a − b‖ / ‖b‖`, in f64).
pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| (*x as f64 - *y as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}
