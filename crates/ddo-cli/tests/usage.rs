//! The command line's contract, for every subcommand (the clap layer, `ddo_cli::cli`): an
//! unknown option, a missing value, a repeated single option and a flag given a value are
//! usage errors — exit status 2 and one line on stderr that names the option and what would
//! be valid — while a repeated `--route` and a repeated flag are accepted, and `--help`,
//! `-h`, `help COMMAND` and `--help COMMAND` print the same list of options with status 0.

mod common;

use std::process::Output;

use common::{ddo, ok};
use ddo_cli::cli::{COMMANDS, options};

/// The one line of a usage error (exit status 2), checked for the shape every error has.
fn usage_line(args: &[&str]) -> String {
    let out: Output = ddo(args);
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(2), "ddo {args:?}: {stderr}");
    assert!(out.stdout.is_empty(), "ddo {args:?} printed on stdout");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "ddo {args:?}: not one line:\n{stderr}");
    assert!(lines[0].starts_with("ddo: error: "), "{}", lines[0]);
    assert!(lines[0].contains("; hint: "), "no hint: {}", lines[0]);
    lines[0].to_string()
}

#[test]
fn an_unknown_option_names_the_command_and_every_valid_option() {
    for c in COMMANDS {
        let line = usage_line(&[c, "--no-such-option"]);
        assert!(
            line.contains(&format!("unknown option `--no-such-option` for `ddo {c}`")),
            "{line}"
        );
        for o in options(c) {
            assert!(
                line.contains(&format!("--{},", o.name))
                    || line.contains(&format!("--{};", o.name)),
                "{c}: --{} not listed: {line}",
                o.name
            );
        }
        assert!(line.contains(&format!("see `ddo help {c}`")), "{line}");
    }
    // A near miss gets clap's suggestion too.
    let line = usage_line(&["run", "--stpes", "2"]);
    assert!(line.contains("did you mean `--steps`?"), "{line}");
}

#[test]
fn a_missing_value_names_the_placeholder() {
    for c in COMMANDS {
        // `--vram-budget` where the command has it (`ddo convert` has no device).
        let (option, placeholder) = if options(c).iter().any(|o| o.name == "vram-budget") {
            ("--vram-budget", "SIZE")
        } else {
            ("--compress", "lossless")
        };
        let line = usage_line(&[c, option]);
        assert!(
            line.ends_with(&format!(
                "{option} needs a value; hint: write {option} {placeholder}"
            )),
            "{line}"
        );
    }
}

#[test]
fn a_single_option_given_twice_is_refused_and_a_repeatable_one_is_not() {
    for (c, option, value) in [
        ("run", "--config", "tiny"),
        ("decode", "--weights", "vae"),
        ("resolve", "--component", "vae"),
        ("inspect", "--vram-budget", "1GiB"),
        ("bench", "--component", "vae"),
    ] {
        let line = usage_line(&[c, option, value, &format!("{option}={value}")]);
        assert!(
            line.ends_with(&format!("{option} given twice; hint: give {option} once")),
            "{line}"
        );
    }
    // `--route` repeats (two routes of one component are refused by the routing, not the
    // parser), and so do flags.
    let line = usage_line(&["resolve", "--route", "vae=none", "--route", "vae=none"]);
    assert!(line.contains("two --route options for `vae`"), "{line}");
    let text = ok(&ddo(&["resolve", "--json", "--json", "--component", "vae"]));
    assert!(text.contains("\"component\": \"vae\""), "{text}");
}

#[test]
fn a_flag_takes_no_value_and_an_argument_is_not_an_option() {
    for c in COMMANDS {
        let line = usage_line(&[c, "--json=1"]);
        assert!(
            line.ends_with("--json takes no value; hint: write --json alone"),
            "{line}"
        );
    }
    for c in ["run", "decode", "resolve", "bench"] {
        let line = usage_line(&[c, "stray"]);
        assert!(
            line.contains(&format!("unexpected argument `stray` for `ddo {c}`")),
            "{line}"
        );
    }
}

#[test]
fn values_are_refused_by_ddos_own_parsers() {
    let line = usage_line(&["resolve", "--height", "-3"]);
    assert!(
        line.ends_with(
            "invalid value `-3` for --height of `ddo resolve`; hint: give a positive whole number"
        ),
        "{line}"
    );
    let line = usage_line(&["bench", "--preset", "fast"]);
    assert!(line.contains("unknown preset `fast`"), "{line}");
    // A value may start with a dash: here the prompt is `--json`.
    let out = ddo(&["run", "--prompt", "--json"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no model given"), "{err}");
}

#[test]
fn every_spelling_of_help_lists_the_same_options() {
    for c in COMMANDS {
        let help = ok(&ddo(&["help", c]));
        for o in options(c) {
            assert!(help.contains(&format!("--{}", o.name)), "{c}: {help}");
            assert!(help.contains(&o.help), "{c}: {help}");
        }
        assert!(help.contains(&format!("Usage: ddo {c} ")), "{help}");
        for other in [[c, "--help"], [c, "-h"], ["--help", c], ["-h", c]] {
            assert_eq!(ok(&ddo(&other)), help, "ddo {other:?}");
        }
    }
    let top = ok(&ddo(&["--help"]));
    assert_eq!(ok(&ddo(&["help"])), top);
    for c in COMMANDS {
        assert!(top.contains(&format!("  {c} ")), "{top}");
    }
    let version = format!("ddo {}\n", env!("CARGO_PKG_VERSION"));
    for v in ["--version", "-V", "version"] {
        assert_eq!(ok(&ddo(&[v])), version);
    }
}

/// Issue 34: `ddo help help` is help's own usage, as `ddo help --help` prints it (it said
/// "unknown command `help`").
#[test]
fn help_on_help_prints_its_usage() {
    let own = ok(&ddo(&["help", "--help"]));
    assert!(own.contains("Usage: ddo help "), "{own}");
    for args in [
        &["help", "help"][..],
        &["--help", "help"],
        &["help", "help", "run"],
    ] {
        assert_eq!(ok(&ddo(args)), own, "ddo {args:?}");
    }
}

/// `-h` and `-V` count only as written: clap would read `-hx` as `-h` clustered with `-x`
/// and print help with exit 0 (the argument fuzzer found `ddo -helpuida`).
#[test]
fn help_and_version_are_not_clustered_with_other_letters() {
    for args in [
        &["-helpuida"][..],
        &["-hx"],
        &["-Vx"],
        &["run", "-hxyz"],
        &["run", "--config", "tiny", "-hV"],
        // The first help word decides: an exact one later does not make it help.
        &["-helpuida", "--guidance", "9", "--help"],
        &["run", "-hx", "-h"],
    ] {
        let line = usage_line(args);
        assert!(line.contains("unknown option `-"), "{args:?}: {line}");
        assert!(line.contains("--help"), "{args:?}: {line}");
    }
}
