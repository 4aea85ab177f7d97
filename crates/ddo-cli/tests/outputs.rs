//! Issue 34's reproductions of lost inputs, run through the binary: an output never
//! replaces a single-file input (`--transformer`, `--text-encoder`, `--text-encoder-2`,
//! `--vae`), and a link planted at the temporary name of earlier versions never has its
//! target truncated.

mod common;

use std::path::Path;

use common::{ddo, fixture, scratch};

fn refused_keeping(args: &[&str], kept: &Path) {
    let before = std::fs::read(kept).unwrap();
    let out = ddo(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
    assert!(stderr.contains("destroy an input"), "{stderr}");
    assert_eq!(std::fs::read(kept).unwrap(), before, "{args:?} changed it");
}

#[test]
fn outputs_never_replace_single_file_inputs() {
    let s = scratch("single-file-inputs");
    let tr = s.join("tr.safetensors");
    std::fs::copy(
        fixture("flux_transformer_original/flux_pipeline-transformer.safetensors"),
        &tr,
    )
    .unwrap();
    let vae = s.join("ae.safetensors");
    std::fs::copy(
        fixture("vae_flux_original/flux_pipeline-vae.safetensors"),
        &vae,
    )
    .unwrap();
    let t5 = s.join("t5.safetensors");
    std::fs::write(&t5, b"not read: refused first").unwrap();
    let clip = s.join("clip.safetensors");
    std::fs::write(&clip, b"not read: refused first").unwrap();
    let weights = fixture("flux_pipeline");
    let (tr_s, vae_s, t5_s, clip_s) = (
        tr.to_str().unwrap(),
        vae.to_str().unwrap(),
        t5.to_str().unwrap(),
        clip.to_str().unwrap(),
    );
    let base = [
        "run",
        "--weights",
        &weights,
        "--height",
        "32",
        "--width",
        "24",
        "--steps",
        "2",
    ];
    let with = |more: &[&str]| -> Vec<String> {
        base.iter()
            .chain(more)
            .map(|s| s.to_string())
            .collect::<Vec<_>>()
    };
    let cases: Vec<(Vec<String>, &Path)> = vec![
        (with(&["--transformer", tr_s, "--out", tr_s]), &tr),
        (
            with(&[
                "--vae",
                vae_s,
                "--out",
                &format!("{}/o.png", s.display()),
                "--save-latents",
                vae_s,
            ]),
            &vae,
        ),
        (
            with(&["--text-encoder-2", t5_s, "--save-latents", t5_s]),
            &t5,
        ),
        (with(&["--text-encoder", clip_s, "--out", clip_s]), &clip),
    ];
    for (args, kept) in &cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        refused_keeping(&args, kept);
    }
    // Through `..` and a link.
    let dotted = format!(
        "{}/../{}/tr.safetensors",
        s.display(),
        s.file_name().unwrap().to_str().unwrap()
    );
    let args = with(&["--transformer", tr_s, "--out", &dotted]);
    refused_keeping(&args.iter().map(String::as_str).collect::<Vec<_>>(), &tr);
    #[cfg(unix)]
    {
        let link = s.join("tr-link.safetensors");
        std::os::unix::fs::symlink(&tr, &link).unwrap();
        let args = with(&["--transformer", link.to_str().unwrap(), "--out", tr_s]);
        refused_keeping(&args.iter().map(String::as_str).collect::<Vec<_>>(), &tr);
    }
    // bench --out-json over --transformer.
    refused_keeping(
        &[
            "bench",
            "--weights",
            &weights,
            "--transformer",
            tr_s,
            "--out-json",
            tr_s,
        ],
        &tr,
    );
    let _ = std::fs::remove_dir_all(&s);
}

/// `ln -s v.txt s/.o.png.ddo-$$.tmp; exec ddo run --config tiny --steps 1 --out s/o.png`.
#[cfg(unix)]
#[test]
fn a_link_at_the_old_temporary_name_is_never_followed() {
    let s = scratch("planted-link");
    std::fs::write(s.join("v.txt"), b"precious").unwrap();
    let script = format!(
        "ln -s v.txt .o.png.ddo-$$.tmp && exec '{}' run --config tiny --steps 1 --height 16 --width 16 --out o.png",
        env!("CARGO_BIN_EXE_ddo")
    );
    let out = std::process::Command::new("sh")
        .args(["-c", &script])
        .current_dir(&s)
        .env_remove("DDO_PRESET")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(std::fs::read(s.join("v.txt")).unwrap(), b"precious");
    assert!(s.join("o.png").is_file());
    let _ = std::fs::remove_dir_all(&s);
}

/// Issue 34, item 7: under an address-space limit, a host-device budget the process cannot
/// hold is refused before any work, and work past what the host can allocate ends in a
/// typed error; never an abort (134) or a panic.
#[cfg(target_os = "linux")]
#[test]
fn host_memory_limits_give_typed_errors_not_aborts() {
    let s = scratch("host-oom");
    let bin = env!("CARGO_BIN_EXE_ddo");
    for (args, words) in [
        (
            "run --config qwen-tiny --vram-budget 1TiB --height 16384 --width 16384 --steps 1",
            "holds at most",
        ),
        (
            "run --config tiny --vram-budget 1TiB --height 16384 --width 16384 --steps 1",
            "holds at most",
        ),
        (
            "run --config tiny --vram-budget 7GiB --height 16384 --width 16384 --steps 1",
            "too small",
        ),
    ] {
        let script = format!("ulimit -v 8000000 && exec '{bin}' {args} --out o.png");
        let out = std::process::Command::new("sh")
            .args(["-c", &script])
            .current_dir(&s)
            .env_remove("DDO_PRESET")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            matches!(out.status.code(), Some(1 | 2)),
            "{args}: {:?}: {err}",
            out.status
        );
        assert!(err.contains(words), "{args}: {err}");
        assert!(!s.join("o.png").exists());
    }
    let _ = std::fs::remove_dir_all(&s);
}
