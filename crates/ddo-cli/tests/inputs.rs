//! What `ddo` says of inputs that cannot be used (issue 34, low items): a folder, a FIFO or
//! a device given as a file is named for what it is (never "no such file", never read or
//! waited on); `--max-sequence-length` with `--prompt-embeds` and an `--init-latents` file
//! whose `latents` and `noise` differ are refused rather than half-used.

mod common;

use std::path::Path;

use common::{ddo, fixture, scratch};

/// `ddo ARGS` under coreutils' `timeout`, so that a command waiting on a FIFO fails the
/// test instead of hanging it.
fn ddo_timed(args: &[&str]) -> std::process::Output {
    let mut cmd = std::process::Command::new("timeout");
    cmd.arg("60").arg(env!("CARGO_BIN_EXE_ddo")).args(args);
    for (k, _) in std::env::vars() {
        if k.starts_with("DDO_") {
            cmd.env_remove(k);
        }
    }
    cmd.output().unwrap()
}

fn mkfifo(path: &Path) {
    let ok = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "mkfifo {path:?}");
}

#[cfg(unix)]
#[test]
fn folders_fifos_and_devices_given_as_files_are_named_for_what_they_are() {
    let s = scratch("not-files");
    let fifo = s.join("fifo.safetensors");
    mkfifo(&fifo);
    let dir = s.join("dir.safetensors");
    std::fs::create_dir(&dir).unwrap();
    let out = s.join("o.png");
    let (out, weights) = (out.to_str().unwrap(), fixture("flux_pipeline"));
    let vae = fixture("vae_flux");
    for (path, what) in [
        (fifo.to_str().unwrap(), "a FIFO"),
        (dir.to_str().unwrap(), "a directory"),
        ("/dev/zero", "a device"),
    ] {
        for args in [
            vec!["decode", "--weights", &vae, "--latents", path, "--out", out],
            vec![
                "run",
                "--weights",
                &weights,
                "--prompt-embeds",
                path,
                "--out",
                out,
            ],
            vec![
                "run",
                "--weights",
                &weights,
                "--init-latents",
                path,
                "--out",
                out,
            ],
            vec![
                "run",
                "--weights",
                &weights,
                "--transformer",
                path,
                "--out",
                out,
            ],
        ] {
            let o = ddo_timed(&args);
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(
                matches!(o.status.code(), Some(1 | 2)),
                "{args:?}: {:?} {err}",
                o.status
            );
            assert!(
                err.contains(what) && !err.contains("no such file"),
                "{args:?}: {err}"
            );
        }
    }
    // A shard of a pipeline folder that is a FIFO.
    let copy = s.join("pipe");
    copy_dir(Path::new(&weights), &copy);
    let shard = copy.join("transformer/diffusion_pytorch_model.safetensors");
    std::fs::remove_file(&shard).unwrap();
    mkfifo(&shard);
    let o = ddo_timed(&["run", "--weights", copy.to_str().unwrap(), "--out", out]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("a FIFO"), "{:?} {err}", o.status);
    let _ = std::fs::remove_dir_all(&s);
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), dst).unwrap();
        }
    }
}

#[test]
fn options_that_would_be_ignored_are_refused() {
    let s = scratch("ignored-options");
    let inputs = fixture("flux_pipeline/inputs.safetensors");
    let weights = fixture("flux_pipeline");
    let out = s.join("o.png");
    let out_s = out.display().to_string();
    let run = |more: &[&str]| {
        let mut args = vec![
            "run",
            "--weights",
            &weights,
            "--height",
            "32",
            "--width",
            "24",
            "--steps",
            "1",
            "--out",
            &out_s,
            "--prompt-embeds",
            &inputs,
        ];
        args.extend_from_slice(more);
        ddo(&args)
    };
    let o = run(&["--max-sequence-length", "8"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--max-sequence-length with --prompt-embeds"),
        "{err}"
    );
    // `latents` and `noise` that are not the same noise.
    let (_, noise) = ddo_nn::read_f32_tensor(Path::new(&inputs), "noise").unwrap();
    let (_, latents) = ddo_nn::read_f32_tensor(Path::new(&inputs), "latents").unwrap();
    let both = s.join("both.safetensors");
    let bytes = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let mut shifted = latents.clone();
    shifted[0] += 1.0;
    let (nb, lb) = (bytes(&noise), bytes(&shifted));
    let views = vec![
        (
            "noise",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1, 4, 16, 12], &nb)
                .unwrap(),
        ),
        (
            "latents",
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1, 48, 16], &lb)
                .unwrap(),
        ),
    ];
    safetensors::serialize_to_file(views, None, &both).unwrap();
    let o = run(&["--init-latents", both.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("which differ"), "{err}");
    assert!(!out.exists());
    // The fixture's pair is one noise, packed and not: taken.
    let o = run(&["--init-latents", &inputs]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let _ = std::fs::remove_dir_all(&s);
}
