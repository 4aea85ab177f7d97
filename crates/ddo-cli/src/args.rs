//! A small, strict command-line parser: each subcommand declares its options; an unknown
//! option, a missing value, a repeated single option or a value that does not parse is a
//! usage error naming the option and what would be valid.

use std::collections::BTreeMap;
use std::str::FromStr;

use crate::error::{CliError, CliResult};

/// One option a subcommand accepts.
#[derive(Debug, Clone, Copy)]
pub struct OptSpec {
    /// Long name, without `--`.
    pub name: &'static str,
    /// `Some(placeholder)` when it takes a value.
    pub value: Option<&'static str>,
    /// Whether it may be given more than once.
    pub repeatable: bool,
    /// One line of help.
    pub help: &'static str,
}

/// An option that takes a value.
pub const fn opt(name: &'static str, value: &'static str, help: &'static str) -> OptSpec {
    OptSpec {
        name,
        value: Some(value),
        repeatable: false,
        help,
    }
}

/// An option that takes a value and may repeat.
pub const fn many(name: &'static str, value: &'static str, help: &'static str) -> OptSpec {
    OptSpec {
        name,
        value: Some(value),
        repeatable: true,
        help,
    }
}

/// A flag.
pub const fn flag(name: &'static str, help: &'static str) -> OptSpec {
    OptSpec {
        name,
        value: None,
        repeatable: false,
        help,
    }
}

/// Parsed arguments of one subcommand.
#[derive(Debug, Default)]
pub struct Parsed {
    command: String,
    values: BTreeMap<&'static str, Vec<String>>,
    flags: Vec<&'static str>,
    /// Arguments that are not options.
    pub positionals: Vec<String>,
}

impl Parsed {
    /// The value of `name` (the last one given).
    pub fn get(&self, name: &str) -> Option<&str> {
        self.values
            .get(name)
            .and_then(|v| v.last())
            .map(String::as_str)
    }

    /// Every value of a repeatable option, in order.
    pub fn all(&self, name: &str) -> &[String] {
        self.values.get(name).map_or(&[], Vec::as_slice)
    }

    /// Whether flag `name` was given.
    pub fn flag(&self, name: &str) -> bool {
        self.flags.contains(&name)
    }

    /// `name` parsed as a `T`, with `what` naming the valid form in the error.
    pub fn parse<T: FromStr>(&self, name: &str, what: &str) -> CliResult<Option<T>> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v.parse().map(Some).map_err(|_| {
                CliError::usage(
                    format!("invalid value `{v}` for --{name} of `ddo {}`", self.command),
                    format!("give {what}"),
                )
            }),
        }
    }
}

/// Parses `args` (after the subcommand) against `specs`.
pub fn parse(command: &str, specs: &[OptSpec], args: &[String]) -> CliResult<Parsed> {
    let mut parsed = Parsed {
        command: command.to_string(),
        ..Parsed::default()
    };
    let valid = || {
        specs
            .iter()
            .map(|s| format!("--{}", s.name))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        i += 1;
        let Some(body) = arg.strip_prefix("--") else {
            parsed.positionals.push(arg.clone());
            continue;
        };
        let (name, inline) = match body.split_once('=') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (body, None),
        };
        let Some(spec) = specs.iter().find(|s| s.name == name) else {
            return Err(CliError::usage(
                format!("unknown option `--{name}` for `ddo {command}`"),
                format!("valid options: {}; see `ddo help {command}`", valid()),
            ));
        };
        match spec.value {
            None => {
                if inline.is_some() {
                    return Err(CliError::usage(
                        format!("--{name} takes no value"),
                        format!("write --{name} alone"),
                    ));
                }
                if !parsed.flags.contains(&spec.name) {
                    parsed.flags.push(spec.name);
                }
            }
            Some(placeholder) => {
                let value = match inline {
                    Some(v) => v,
                    None => {
                        let Some(v) = args.get(i) else {
                            return Err(CliError::usage(
                                format!("--{name} needs a value"),
                                format!("write --{name} {placeholder}"),
                            ));
                        };
                        i += 1;
                        v.clone()
                    }
                };
                let entry = parsed.values.entry(spec.name).or_default();
                if !spec.repeatable && !entry.is_empty() {
                    return Err(CliError::usage(
                        format!("--{name} given twice"),
                        format!("give --{name} once"),
                    ));
                }
                entry.push(value);
            }
        }
    }
    Ok(parsed)
}

/// Help text for a subcommand's options.
pub fn options_help(specs: &[OptSpec]) -> String {
    let rows: Vec<(String, &str)> = specs
        .iter()
        .map(|s| {
            let left = match s.value {
                Some(v) => format!("--{} {v}", s.name),
                None => format!("--{}", s.name),
            };
            (left, s.help)
        })
        .collect();
    let width = rows.iter().map(|(l, _)| l.len()).max().unwrap_or(0);
    rows.iter()
        .map(|(l, h)| format!("  {l:<width$}  {h}\n"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPECS: &[OptSpec] = &[
        opt("steps", "N", "steps"),
        many("route", "C=R", "routes"),
        flag("json", "json"),
    ];

    fn args(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn parses_values_flags_and_repeats() {
        let p = parse(
            "run",
            SPECS,
            &args(&[
                "--steps",
                "3",
                "--route=vae=none",
                "--route",
                "a=b",
                "--json",
                "x",
            ]),
        )
        .unwrap();
        assert_eq!(p.parse::<usize>("steps", "n").unwrap(), Some(3));
        assert_eq!(p.all("route"), ["vae=none", "a=b"]);
        assert!(p.flag("json"));
        assert_eq!(p.positionals, ["x"]);
    }

    #[test]
    fn bad_usage_is_a_usage_error() {
        for bad in [
            &["--nope"][..],
            &["--steps"],
            &["--steps", "1", "--steps", "2"],
            &["--json=1"],
        ] {
            let e = parse("run", SPECS, &args(bad)).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{bad:?}: {e}");
            assert!(e.message.contains("hint:"), "{e}");
        }
        let p = parse("run", SPECS, &args(&["--steps", "x"])).unwrap();
        assert!(p.parse::<usize>("steps", "a whole number").is_err());
    }
}
