//! SIGINT, SIGTERM and SIGHUP while `ddo` runs: the process ends as the signal asks, but
//! never between two of a command's outputs. A thread of its own receives the signal
//! ([`install`], `signal-hook`'s iterator: no code runs inside a signal handler), takes
//! [`crate::outputs::OUTPUT_PHASE`] — held while outputs are probed, written to their
//! temporary files and renamed into place, so an interrupt there waits until all are in
//! place or all were removed — and then ends the process by the signal's default action
//! (`signal_hook::low_level::emulate_default_handler`: the exit status a shell sees is the
//! signal's, 130 for SIGINT, and no exit handler runs beside the threads still working).
//! The binary installs it (`src/main.rs`); the library's callers (tests, the fuzzer) keep
//! their own signal handling.

use std::io::Write;

use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

/// Starts the thread that turns SIGINT, SIGTERM and SIGHUP into an end of the process
/// outside the output phase.
pub fn install() -> std::io::Result<()> {
    let mut signals = Signals::new([SIGINT, SIGTERM, SIGHUP])?;
    std::thread::Builder::new()
        .name("ddo-signals".into())
        .spawn(move || {
            if let Some(signal) = signals.forever().next() {
                let _phase = crate::outputs::output_phase();
                remove_registered();
                let name = match signal {
                    SIGINT => "SIGINT",
                    SIGTERM => "SIGTERM",
                    _ => "SIGHUP",
                };
                let _ = std::io::stdout().flush();
                let _ = writeln!(
                    std::io::stderr(),
                    "ddo: interrupted ({name}); outputs are all in place or none was written"
                );
                let _ = signal_hook::low_level::emulate_default_handler(signal);
                // The default action of these signals ends the process; should it not:
                std::process::exit(128 + signal);
            }
        })?;
    Ok(())
}

/// Paths a command is writing under temporary names (`ddo convert`'s private folder or
/// file beside OUT): an interrupt removes them before the process ends, so it leaves no
/// half-written output behind under any name.
static IN_PROGRESS: std::sync::Mutex<Vec<std::path::PathBuf>> = std::sync::Mutex::new(Vec::new());

/// Registers `path` (a folder or file the caller created, under a random name) for removal
/// should the process be interrupted; the registration ends with the guard (once the path
/// was renamed into place or removed).
pub fn remove_on_interrupt(path: &std::path::Path) -> InProgress {
    IN_PROGRESS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(path.to_path_buf());
    InProgress(path.to_path_buf())
}

/// A registration of [`remove_on_interrupt`]; dropping it ends the registration.
#[derive(Debug)]
pub struct InProgress(std::path::PathBuf);

impl Drop for InProgress {
    fn drop(&mut self) {
        IN_PROGRESS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|p| *p != self.0);
    }
}

/// Removes every registered path (a folder with what is in it, links not followed).
fn remove_registered() {
    let paths = std::mem::take(&mut *IN_PROGRESS.lock().unwrap_or_else(|e| e.into_inner()));
    for p in paths {
        let is_dir = std::fs::symlink_metadata(&p).is_ok_and(|m| m.is_dir());
        let _ = if is_dir {
            std::fs::remove_dir_all(&p)
        } else {
            std::fs::remove_file(&p)
        };
    }
}
