//! The `SIGBUS` guard of weight files truncated under a run (issue 35,
//! `ddo_core::file_guard`), end to end in a child process: the test binary runs again with
//! this one test, which then plays the run.

/// The handler end to end, in a child process (the test binary again, this test only):
/// a mapped weight file truncated under the run, then read past its new end, ends the
/// child with status 1 and one line naming the file, not a `SIGBUS` death.
#[test]
fn reading_a_truncated_weight_file_exits_naming_it() {
    const CHILD: &str = "DDO_FILE_GUARD_CHILD";
    if let Some(path) = std::env::var_os(CHILD) {
        let path = std::path::PathBuf::from(path);
        ddo_core::file_guard::install_truncation_handler().unwrap();
        let map = ddo_core::CheckpointMap::open(&path).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(0)
            .unwrap();
        // Past the new end: the kernel raises SIGBUS here.
        let byte = std::hint::black_box(map.bytes()[1 << 20]);
        panic!("read {byte} from a truncated mapping without a fault");
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.safetensors");
    std::fs::write(&path, vec![7u8; 4 << 20]).unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "reading_a_truncated_weight_file_exits_naming_it",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD, &path)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("the weight file {} was truncated", path.display())),
        "{stderr}"
    );
    assert!(stderr.contains("nothing was written"), "{stderr}");
}
