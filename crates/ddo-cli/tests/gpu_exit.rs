//! `ddo ... --device cuda:0` exits with its own status after an error, never by a signal
//! (issue 34: every error exit on CUDA died by SIGSEGV, status 139, most likely because the
//! process exited while cuDNN plans or NVRTC compiles still ran in the background). Each
//! error path runs several times, since the crash was a race. Runs for real on a GPU
//! (`cargo xtask gpu-bundle` carries this binary and `ddo`, and `run-all.sh` names it in
//! `DDO_BIN`); without one it says "skipped: no CUDA device", and under `DDO_REQUIRE_GPU=1`
//! a machine without a usable device fails.

use std::path::PathBuf;
use std::process::Command;

/// The `ddo` binary: `DDO_BIN` (the bundle's), else the one cargo built beside this test.
fn ddo_bin() -> PathBuf {
    std::env::var_os("DDO_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_ddo")))
}

fn fixtures() -> PathBuf {
    std::env::var_os("DDO_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures"))
}

/// Whether a CUDA device can be opened here (the skip rule of the GPU tests).
fn gpu() -> bool {
    match ddo_cuda::CudaDevice::new(0) {
        Ok(_) => true,
        Err(e) => {
            if std::env::var_os("DDO_REQUIRE_GPU").is_some_and(|v| v == "1") {
                panic!("DDO_REQUIRE_GPU=1 but there is no usable CUDA device: {e}");
            }
            println!("skipped: no CUDA device ({e})");
            false
        }
    }
}

#[test]
fn error_exits_on_cuda_return_their_status_not_a_signal() {
    if !gpu() {
        return;
    }
    let flux = fixtures().join("flux_pipeline");
    let flux = flux.to_str().unwrap();
    let scratch = std::env::temp_dir().join(format!("ddo-gpu-exit-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    let out = scratch.join("o.png");
    let out = out.to_str().unwrap();
    let cases: Vec<(Vec<&str>, i32)> = vec![
        // A plan refusal after the attention plans started building.
        (
            vec![
                "run",
                "--weights",
                flux,
                "--device",
                "cuda:0",
                "--vram-budget",
                "40MiB",
                "--height",
                "256",
                "--width",
                "384",
                "--steps",
                "1",
                "--out",
                out,
            ],
            1,
        ),
        // A route option refused while the kernels compile in the background.
        (
            vec![
                "run",
                "--weights",
                flux,
                "--device",
                "cuda:0",
                "--route",
                "transformer=native_vmm:bogus=1",
                "--out",
                out,
            ],
            2,
        ),
        (
            vec![
                "run",
                "--config",
                "tiny",
                "--device",
                "cuda:0",
                "--route",
                "transformer=native_vmm:bogus=1",
                "--out",
                out,
            ],
            2,
        ),
        // A bad output found before any work.
        (
            vec![
                "run",
                "--weights",
                flux,
                "--device",
                "cuda:0",
                "--steps",
                "1",
                "--out",
                "/nonexistent-ddo-dir/o.png",
            ],
            2,
        ),
    ];
    let mut seen = Vec::new();
    for (args, want) in &cases {
        for attempt in 0..3 {
            let o = Command::new(ddo_bin())
                .args(args)
                .env_remove("DDO_PRESET")
                .output()
                .unwrap();
            let stderr = String::from_utf8_lossy(&o.stderr);
            seen.push(format!("{args:?} #{attempt}: {:?}", o.status));
            assert_eq!(
                o.status.code(),
                Some(*want),
                "ddo {args:?} (attempt {attempt}) ended with {:?} (a signal when None): {stderr}",
                o.status
            );
            assert!(stderr.starts_with("ddo: error:"), "{stderr}");
        }
    }
    assert!(
        !std::path::Path::new(out).exists(),
        "a failed run wrote its output"
    );
    println!("{}", seen.join("\n"));
    let _ = std::fs::remove_dir_all(&scratch);
}
