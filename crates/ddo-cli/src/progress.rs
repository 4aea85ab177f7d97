//! A progress bar on stderr, drawn only when stderr is a terminal and the work has taken
//! more than a second (so pipes, logs and tests see nothing of it).

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// Progress of the current phase.
#[derive(Debug)]
pub struct ProgressBar {
    enabled: bool,
    start: Instant,
    drawn: bool,
}

impl Default for ProgressBar {
    fn default() -> Self {
        Self::new()
    }
}

impl ProgressBar {
    /// A bar that draws when stderr is a terminal.
    pub fn new() -> Self {
        Self {
            enabled: std::io::stderr().is_terminal(),
            start: Instant::now(),
            drawn: false,
        }
    }

    /// Reports `done` of `total` in `phase`.
    pub fn update(&mut self, phase: &str, done: usize, total: usize) {
        if !self.enabled || self.start.elapsed() < Duration::from_secs(1) {
            return;
        }
        let width = 30;
        let filled = (done * width)
            .checked_div(total)
            .unwrap_or(width)
            .min(width);
        let mut err = std::io::stderr().lock();
        let _ = write!(
            err,
            "\r{phase:<16} [{}{}] {done}/{total}  {:.1} s",
            "#".repeat(filled),
            " ".repeat(width - filled),
            self.start.elapsed().as_secs_f64()
        );
        let _ = err.flush();
        self.drawn = true;
    }

    /// Shows a status line (long set-up steps such as building random weights).
    pub fn status(&mut self, text: &str) {
        if !self.enabled {
            return;
        }
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r{text:<60}");
        let _ = err.flush();
        self.drawn = true;
    }

    /// Clears the line.
    pub fn finish(&mut self) {
        if self.drawn {
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r{:<80}\r", "");
            let _ = err.flush();
            self.drawn = false;
        }
    }
}

impl Drop for ProgressBar {
    fn drop(&mut self) {
        self.finish();
    }
}
