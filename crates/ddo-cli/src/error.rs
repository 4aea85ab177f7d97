//! [`CliError`]: every failure of the `ddo` command as one line (what went wrong and what to
//! do), with the exit status it maps to: 2 for bad usage, 1 for a failure at run time.

use std::fmt;

use ddo_core::CoreError;
use ddo_cuda::CudaError;
use ddo_nn::LoadError;

/// Result alias of the command.
pub type CliResult<T> = Result<T, CliError>;

/// Bad usage (unknown option, value or name) or a failure while running.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ErrorKind {
    /// The command line is wrong: exit status 2.
    Usage,
    /// The command failed: exit status 1.
    Runtime,
    /// The request is well formed but does not fit the device or host budget (no memory
    /// plan fits it): exit status 1; `ddo serve` answers 422.
    DoesNotFit,
    /// The run was cancelled at a step boundary by its caller: exit status 1; `ddo serve`
    /// answers 499.
    Cancelled,
}

/// One error of the command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CliError {
    /// Usage or runtime.
    pub kind: ErrorKind,
    /// What went wrong, with the hint (one line).
    pub message: String,
}

impl CliError {
    /// A usage error: `message`, then `hint`.
    pub fn usage(message: impl Into<String>, hint: impl AsRef<str>) -> Self {
        Self {
            kind: ErrorKind::Usage,
            message: join(message.into(), hint.as_ref()),
        }
    }

    /// A runtime error: `message`, then `hint`.
    pub fn runtime(message: impl Into<String>, hint: impl AsRef<str>) -> Self {
        Self {
            kind: ErrorKind::Runtime,
            message: join(message.into(), hint.as_ref()),
        }
    }

    /// The process exit status.
    pub fn exit_code(&self) -> i32 {
        match self.kind {
            ErrorKind::Usage => 2,
            ErrorKind::Runtime | ErrorKind::DoesNotFit | ErrorKind::Cancelled => 1,
        }
    }

    /// Prefixes the message with where it happened (`loading weights: ...`), still one line
    /// (`what` may hold a path the user gave, newlines included).
    pub fn context(mut self, what: &str) -> Self {
        self.message = one_line(&format!("{what}: {}", self.message));
        self
    }
}

fn join(message: String, hint: &str) -> String {
    let line = if hint.is_empty() {
        message
    } else {
        format!("{message}; hint: {hint}")
    };
    one_line(&line)
}

/// Folds a message onto one line.
pub fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for CliError {}

impl From<CoreError> for CliError {
    fn from(e: CoreError) -> Self {
        let kind = match e {
            CoreError::UnknownPreset { .. }
            | CoreError::UnknownRoute { .. }
            | CoreError::UnknownComponent { .. }
            | CoreError::InvalidOption { .. }
            | CoreError::ContradictoryOptions { .. }
            | CoreError::InvalidEnvironment { .. }
            // A decode the budget does not hold under `--tiled-decode auto`: the options
            // (budget, size, tiling) are the command line's to change.
            | CoreError::DecodeDoesNotFit { .. }
            // An option the chosen route does not take is the command line's to change.
            | CoreError::Refused {
                refusal: ddo_core::Refusal::UnsupportedOption { .. },
                ..
            } => ErrorKind::Usage,
            CoreError::BudgetTooSmall { .. } | CoreError::HostBudgetTooSmall { .. } => {
                ErrorKind::DoesNotFit
            }
            CoreError::Cancelled { .. } => ErrorKind::Cancelled,
            _ => ErrorKind::Runtime,
        };
        Self {
            kind,
            message: one_line(&e.to_string()),
        }
    }
}

impl From<LoadError> for CliError {
    fn from(e: LoadError) -> Self {
        match e {
            LoadError::Core(c) => c.into(),
            other => Self {
                kind: ErrorKind::Runtime,
                message: one_line(&other.to_string()),
            },
        }
    }
}

impl From<CudaError> for CliError {
    fn from(e: CudaError) -> Self {
        Self {
            kind: ErrorKind::Runtime,
            message: one_line(&e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_is_one_line_context_included() {
        let e = CliError::runtime("cannot read\nx", "check\tit")
            .context("--weights a\nb\r\nc")
            .context("loading");
        assert_eq!(
            e.message,
            "loading: --weights a b c: cannot read x; hint: check it"
        );
        assert_eq!(e.exit_code(), 1);
    }
}
