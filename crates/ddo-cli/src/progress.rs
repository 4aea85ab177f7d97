//! The progress display on stderr (`indicatif`): a bar of the current phase's steps and a
//! spinner for long set-up steps, drawn only when stderr is a terminal and (for the bar) the
//! work has taken more than a second, so pipes, logs and tests see nothing of it.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressDrawTarget, ProgressState, ProgressStyle};

/// How long work runs before its bar is drawn.
const QUIET: Duration = Duration::from_secs(1);

/// What is drawn now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shown {
    /// `phase [####    ] done/total  1.2 s`.
    Bar,
    /// A spinner and a line of text.
    Status,
}

/// Progress of the current phase.
#[derive(Debug)]
pub struct ProgressBar {
    enabled: bool,
    start: Instant,
    shown: Option<(Shown, indicatif::ProgressBar)>,
}

impl Default for ProgressBar {
    fn default() -> Self {
        Self::new()
    }
}

/// The seconds since the work began, as `1.2 s`.
fn seconds(state: &ProgressState, w: &mut dyn std::fmt::Write) {
    let _ = write!(w, "{:.1} s", state.elapsed().as_secs_f64());
}

impl ProgressBar {
    /// A display that draws when stderr is a terminal.
    pub fn new() -> Self {
        Self {
            enabled: std::io::stderr().is_terminal(),
            start: Instant::now(),
            shown: None,
        }
    }

    /// The indicatif bar showing `kind`, made (and the other one cleared) when needed.
    fn show(&mut self, kind: Shown) -> &indicatif::ProgressBar {
        if self.shown.as_ref().is_some_and(|(k, _)| *k != kind) {
            self.finish();
        }
        let start = self.start;
        let (_, bar) = self.shown.get_or_insert_with(|| {
            let (template, fallback) = match kind {
                Shown::Bar => (
                    "{msg:<16} [{bar:30}] {pos}/{len}  {seconds}",
                    ProgressStyle::default_bar(),
                ),
                Shown::Status => ("{spinner} {msg}", ProgressStyle::default_spinner()),
            };
            let style = ProgressStyle::with_template(template)
                .unwrap_or(fallback)
                .with_key("seconds", seconds)
                .progress_chars("## ");
            let bar = indicatif::ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr())
                .with_style(style)
                .with_elapsed(start.elapsed());
            if kind == Shown::Status {
                bar.enable_steady_tick(Duration::from_millis(120));
            }
            (kind, bar)
        });
        bar
    }

    /// Reports `done` of `total` in `phase`.
    pub fn update(&mut self, phase: &str, done: usize, total: usize) {
        if !self.enabled || self.start.elapsed() < QUIET {
            return;
        }
        let bar = self.show(Shown::Bar);
        bar.set_length(total as u64);
        bar.set_position(done as u64);
        if bar.message() != phase {
            bar.set_message(phase.to_string());
        }
    }

    /// Shows a status line (long set-up steps such as building random weights).
    pub fn status(&mut self, text: &str) {
        if !self.enabled {
            return;
        }
        self.show(Shown::Status).set_message(text.to_string());
    }

    /// Clears what is drawn.
    pub fn finish(&mut self) {
        if let Some((_, bar)) = self.shown.take() {
            bar.finish_and_clear();
        }
    }
}

impl Drop for ProgressBar {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Off a terminal (as under `cargo test`) nothing is made, let alone drawn.
    #[test]
    fn nothing_is_drawn_off_a_terminal() {
        let mut bar = ProgressBar {
            enabled: false,
            start: Instant::now() - 2 * QUIET,
            shown: None,
        };
        bar.status("building");
        bar.update("denoise", 1, 4);
        assert!(bar.shown.is_none());
    }

    /// On a terminal the bar follows the phase, and the status line replaces it.
    #[test]
    fn the_bar_follows_the_phase() {
        let mut bar = ProgressBar {
            enabled: true,
            start: Instant::now() - 2 * QUIET,
            shown: None,
        };
        bar.update("denoise", 1, 4);
        let Some((Shown::Bar, b)) = &bar.shown else {
            panic!("no bar: {:?}", bar.shown);
        };
        assert_eq!(
            (b.position(), b.length(), b.message()),
            (1, Some(4), "denoise".into())
        );
        bar.status("opening");
        assert!(matches!(&bar.shown, Some((Shown::Status, _))));
        bar.finish();
        assert!(bar.shown.is_none());
    }
}
