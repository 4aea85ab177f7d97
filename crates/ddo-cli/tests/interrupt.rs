//! An interrupt never splits a command's outputs (issue 34): SIGINT between two renames and
//! SIGTERM before the first end the process only once every output is in place, and the
//! temporary files of a process killed outright (SIGKILL) go with the next command that
//! writes the same targets. Each case runs in a child process (this test binary again,
//! told its role by `INTERRUPT_TEST_CHILD`) with the binary's interrupt handler installed.
#![cfg(unix)]

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use ddo_cli::outputs::{Inputs, Outputs};
use signal_hook::consts::{SIGINT, SIGKILL, SIGTERM};

const ROLE: &str = "INTERRUPT_TEST_CHILD";

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ddo-interrupt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn targets(dir: &Path) -> (PathBuf, PathBuf) {
    (dir.join("o.png"), dir.join("l.safetensors"))
}

/// The child: installs the handler, then commits two outputs and raises `signal` at itself
/// before rename `at`.
fn child(dir: &Path, signal: i32, at: usize) {
    ddo_cli::interrupt::install().unwrap();
    let (out, lat) = targets(dir);
    let plan = Outputs::plan(
        &[("--out", &out), ("--save-latents", &lat)],
        &Inputs::default(),
    )
    .unwrap();
    plan.commit_with(
        &[
            ("--out", b"new image".to_vec()),
            ("--save-latents", b"new latents".to_vec()),
        ],
        |i| {
            if i == at {
                signal_hook::low_level::raise(signal).unwrap();
                // Time for the handler's thread to run, were it not kept out.
                std::thread::sleep(Duration::from_millis(300));
            }
        },
    )
    .unwrap();
    // The handler ends the process once the renames are done.
    std::thread::sleep(Duration::from_secs(10));
    std::process::exit(0);
}

/// Runs test `name` of this binary as a child with `role`, returns its status.
fn spawn(name: &str, dir: &Path, role: &str) -> std::process::ExitStatus {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(ROLE, format!("{role}:{}", dir.display()))
        .status()
        .unwrap()
}

fn role() -> Option<(String, PathBuf)> {
    let v = std::env::var(ROLE).ok()?;
    let (role, dir) = v.split_once(':')?;
    Some((role.to_string(), PathBuf::from(dir)))
}

fn temporaries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".tmp"))
        .collect()
}

#[test]
fn sigint_between_two_renames_waits_for_both() {
    if let Some((r, dir)) = role() {
        if r == "sigint" {
            child(&dir, SIGINT, 1);
        }
        return;
    }
    let dir = scratch("sigint");
    let (out, lat) = targets(&dir);
    std::fs::write(&out, b"old image").unwrap();
    let status = spawn("sigint_between_two_renames_waits_for_both", &dir, "sigint");
    assert_eq!(status.signal(), Some(SIGINT), "{status:?}");
    assert_eq!(std::fs::read(&out).unwrap(), b"new image");
    assert_eq!(std::fs::read(&lat).unwrap(), b"new latents");
    assert!(temporaries(&dir).is_empty(), "{:?}", temporaries(&dir));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sigterm_before_the_renames_leaves_every_output_in_place() {
    if let Some((r, dir)) = role() {
        if r == "sigterm" {
            child(&dir, SIGTERM, 0);
        }
        return;
    }
    let dir = scratch("sigterm");
    let (out, lat) = targets(&dir);
    let status = spawn(
        "sigterm_before_the_renames_leaves_every_output_in_place",
        &dir,
        "sigterm",
    );
    assert_eq!(status.signal(), Some(SIGTERM), "{status:?}");
    assert_eq!(std::fs::read(&out).unwrap(), b"new image");
    assert_eq!(std::fs::read(&lat).unwrap(), b"new latents");
    assert!(temporaries(&dir).is_empty(), "{:?}", temporaries(&dir));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn temporaries_of_a_killed_process_go_with_the_next_command() {
    if let Some((r, dir)) = role() {
        if r == "sigkill" {
            child(&dir, SIGKILL, 0);
        }
        return;
    }
    let dir = scratch("sigkill");
    let (out, lat) = targets(&dir);
    let status = spawn(
        "temporaries_of_a_killed_process_go_with_the_next_command",
        &dir,
        "sigkill",
    );
    assert_eq!(status.signal(), Some(SIGKILL), "{status:?}");
    assert!(!out.exists() && !lat.exists(), "none is in place");
    assert_eq!(temporaries(&dir).len(), 2, "{:?}", temporaries(&dir));
    Outputs::plan(
        &[("--out", &out), ("--save-latents", &lat)],
        &Inputs::default(),
    )
    .unwrap();
    assert!(temporaries(&dir).is_empty(), "{:?}", temporaries(&dir));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `ddo convert`'s private output under a temporary name goes with an interrupt; one whose
/// registration ended (renamed into place) is left alone.
#[test]
fn an_interrupt_removes_what_is_still_being_written() {
    if let Some((r, dir)) = role() {
        if r == "in-progress" {
            ddo_cli::interrupt::install().unwrap();
            let busy = dir.join(".ddo-convert-busy");
            std::fs::create_dir(&busy).unwrap();
            std::fs::write(busy.join("w.safetensors"), b"half").unwrap();
            let done = dir.join("done");
            std::fs::create_dir(&done).unwrap();
            let _busy = ddo_cli::interrupt::remove_on_interrupt(&busy);
            drop(ddo_cli::interrupt::remove_on_interrupt(&done));
            signal_hook::low_level::raise(SIGINT).unwrap();
            std::thread::sleep(Duration::from_secs(10));
            std::process::exit(0);
        }
        return;
    }
    let dir = scratch("in-progress");
    let status = spawn(
        "an_interrupt_removes_what_is_still_being_written",
        &dir,
        "in-progress",
    );
    assert_eq!(status.signal(), Some(SIGINT), "{status:?}");
    assert!(!dir.join(".ddo-convert-busy").exists());
    assert!(dir.join("done").is_dir());
    let _ = std::fs::remove_dir_all(&dir);
}
