//! clap's errors as `ddo`'s one-line usage errors (exit status 2), each naming the option and
//! what would be valid:
//!
//! | clap's [`ErrorKind`] | the line |
//! | --- | --- |
//! | `UnknownArgument`, a `--name` | ``unknown option `--name` for `ddo CMD`; hint: [did you mean `--x`?] valid options: ...; see `ddo help CMD` `` |
//! | `UnknownArgument`, anything else | ``unexpected argument `x` for `ddo CMD`; hint: options start with --; see `ddo help CMD` `` |
//! | `ArgumentConflict` (a single option repeated) | `--name given twice; hint: give --name once` |
//! | `InvalidValue` (no value), `NoEquals` | `--name needs a value; hint: write --name PLACEHOLDER` |
//! | `TooManyValues` (a flag with `=value`) | `--name takes no value; hint: write --name alone` |
//! | `ValueValidation` | the value parser's own line ([`super::Checked`]) |
//! | at the top level | ``unknown command `x`; hint: commands: run, ...; see `ddo help` `` |
//! | anything else | clap's message on one line, with `see `ddo help CMD`` |

use clap::error::{ContextKind, ContextValue, ErrorKind};

use super::{COMMANDS, options, unknown_command};
use crate::error::{CliError, one_line};

/// The one-line usage error for clap's `error` on `argv` (without the program name).
pub(super) fn usage_error(error: &clap::Error, argv: &[String]) -> CliError {
    let first = argv.first().map_or("", String::as_str);
    let Some(command) = COMMANDS.iter().copied().find(|c| *c == first) else {
        // Not a subcommand's: the first word is not a command.
        return unknown_command(first);
    };
    let see = format!("see `ddo help {command}`");
    let context = |kind: ContextKind| match error.get(kind) {
        Some(ContextValue::String(s)) => Some(s.as_str()),
        Some(ContextValue::Strings(v)) => v.first().map(String::as_str),
        _ => None,
    };
    // `--steps <N>` (clap's rendering of the argument) -> `--steps`.
    let option = context(ContextKind::InvalidArg)
        .and_then(|a| a.split([' ', '=']).next())
        .unwrap_or("");
    let spec = options(command)
        .iter()
        .find(|s| option.strip_prefix("--") == Some(s.name.as_str()));
    match error.kind() {
        ErrorKind::ValueValidation => match context(ContextKind::Custom) {
            Some(line) => CliError::usage(line, ""),
            None => fallback(error, &see),
        },
        ErrorKind::UnknownArgument if option.starts_with("--") => {
            let suggestion = context(ContextKind::SuggestedArg)
                .map_or(String::new(), |s| format!("did you mean `{s}`? "));
            let valid = options(command)
                .iter()
                .map(|s| format!("--{}", s.name))
                .collect::<Vec<_>>()
                .join(", ");
            CliError::usage(
                format!("unknown option `{option}` for `ddo {command}`"),
                format!("{suggestion}valid options: {valid}; {see}"),
            )
        }
        ErrorKind::UnknownArgument => CliError::usage(
            format!(
                "unexpected argument `{}` for `ddo {command}`",
                context(ContextKind::InvalidArg).unwrap_or("")
            ),
            format!("options start with --; {see}"),
        ),
        ErrorKind::ArgumentConflict if spec.is_some() => CliError::usage(
            format!("{option} given twice"),
            format!("give {option} once"),
        ),
        ErrorKind::InvalidValue | ErrorKind::NoEquals if spec.is_some() => {
            let placeholder = spec.and_then(|s| s.value.as_deref()).unwrap_or("VALUE");
            CliError::usage(
                format!("{option} needs a value"),
                format!("write {option} {placeholder}"),
            )
        }
        ErrorKind::TooManyValues if spec.is_some_and(|s| s.value.is_none()) => CliError::usage(
            format!("{option} takes no value"),
            format!("write {option} alone"),
        ),
        _ => fallback(error, &see),
    }
}

/// clap's own message, on one line, without its `error:` prefix and usage lines.
fn fallback(error: &clap::Error, see: &str) -> CliError {
    let text = error.render().to_string();
    let message = text
        .lines()
        .map(str::trim)
        .take_while(|l| !l.starts_with("Usage:"))
        .collect::<Vec<_>>()
        .join(" ");
    let message = one_line(message.trim_start_matches("error:"));
    CliError::usage(message, see)
}
