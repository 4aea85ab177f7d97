//! `ddo bench` refuses what it cannot do before any work, and writes its files whole or not
//! at all (cases the `cli_args` fuzz target found): `--out-json` or `--plot` naming a file of
//! the `--weights` folder, a FIFO or a missing folder; a failing `--plot` after a good
//! `--out-json`; more forwards than it can count; a workload whose activations exceed the
//! budget.

mod common;

use std::path::Path;

use common::{ddo, repo, scratch};

fn fails(args: &[&str], needle: &str) {
    let out = ddo(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
    assert!(
        stderr.contains(needle),
        "{args:?}: `{needle}` not in {stderr}"
    );
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
}

fn files_in(d: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

const SMALL: [&str; 8] = [
    "--height",
    "16",
    "--width",
    "16",
    "--repeats",
    "1",
    "--warmup",
    "0",
];

#[test]
fn bench_outputs_never_overwrite_the_weights_and_are_written_all_or_none() {
    let d = scratch("bench-outputs");
    // A copy of the pipeline fixture, so that a wrong write cannot touch the repository.
    let pipe = d.join("pipe");
    let src = repo().join("fixtures/flux_pipeline");
    for dir in [
        "scheduler",
        "text_encoder",
        "text_encoder_2",
        "tokenizer",
        "tokenizer_2",
        "transformer",
        "vae",
    ] {
        std::fs::create_dir_all(pipe.join(dir)).unwrap();
        for e in std::fs::read_dir(src.join(dir)).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), pipe.join(dir).join(e.file_name())).unwrap();
        }
    }
    let index = pipe.join("model_index.json");
    std::fs::copy(src.join("model_index.json"), &index).unwrap();
    let before = std::fs::read(&index).unwrap();
    let weights = pipe.to_str().unwrap();
    let base = |extra: &[&str]| {
        let mut v = vec![
            "bench",
            "--weights",
            weights,
            "--component",
            "vae",
            "--route",
            "none",
        ];
        v.extend_from_slice(&SMALL);
        v.extend_from_slice(extra);
        v.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let strs = |v: &[String]| v.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(" ");
    let run = |v: Vec<String>, needle: &str| {
        let v: Vec<&str> = v.iter().map(String::as_str).collect();
        fails(&v, needle);
    };
    let inside = pipe.join("vae").join("plot");
    run(
        base(&["--out-json", index.to_str().unwrap()]),
        "would destroy an input",
    );
    run(
        base(&["--plot", inside.to_str().unwrap()]),
        "would destroy an input",
    );
    assert_eq!(
        std::fs::read(&index).unwrap(),
        before,
        "{}",
        strs(&base(&[]))
    );
    assert!(!pipe.join("vae/plot.svg").exists());

    // `--out-json` is fine, `--plot` names a missing folder: neither is written.
    let out = d.join("out");
    std::fs::create_dir_all(&out).unwrap();
    let json = out.join("b.json");
    let missing = d.join("nope").join("p");
    run(
        base(&[
            "--out-json",
            json.to_str().unwrap(),
            "--plot",
            missing.to_str().unwrap(),
        ]),
        "cannot be used",
    );
    assert!(files_in(&out).is_empty(), "{:?}", files_in(&out));

    // Both good: both written, and nothing else beside them.
    let prefix = out.join("p");
    let ok = ddo(&base(&[
        "--out-json",
        json.to_str().unwrap(),
        "--plot",
        prefix.to_str().unwrap(),
    ])
    .iter()
    .map(String::as_str)
    .collect::<Vec<_>>());
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert_eq!(files_in(&out), ["b.json", "p.png", "p.svg"]);
    let png = std::fs::read(out.join("p.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    serde_json::from_slice::<serde_json::Value>(&std::fs::read(&json).unwrap()).unwrap();

    #[cfg(unix)]
    {
        let fifo = out.join("fifo.json");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .is_ok_and(|s| s.success());
        if made {
            // Opening a FIFO to write would wait for a reader forever.
            run(
                base(&["--out-json", fifo.to_str().unwrap()]),
                "not a regular file",
            );
        }
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn bench_refuses_counts_and_workloads_it_cannot_run() {
    fn tiny<'a>(extra: &[&'a str]) -> Vec<&'a str> {
        let mut v = vec!["bench", "--config", "tiny", "--component", "vae"];
        v.extend_from_slice(extra);
        v
    }
    // Its timing vector alone could not be allocated (it panicked on the capacity).
    fails(
        &tiny(&["--repeats", "4611686018427387904", "--warmup", "0"]),
        "--repeats 4611686018427387904: more than 1000000 forwards",
    );
    fails(
        &tiny(&["--repeats", "1", "--warmup", "18446744073709551615"]),
        "--warmup",
    );
    // Its inputs alone could not be allocated (the process aborted).
    for (h, w) in [("1048576", "1048576"), ("4294967296", "4294967296")] {
        fails(
            &tiny(&["--height", h, "--width", w, "--repeats", "1"]),
            "of activations",
        );
    }
    fails(
        &[
            "bench",
            "--config",
            "tiny",
            "--height",
            "65536",
            "--width",
            "65536",
            "--vram-budget",
            "12GiB",
        ],
        "of activations",
    );
}
