//! The `ddo` command line, declared with clap's derive: [`Cli`] (the program), [`Command`]
//! (one variant per subcommand) and one `Args` struct per subcommand ([`RunArgs`],
//! [`DecodeArgs`], [`ResolveArgs`], [`InspectArgs`], [`BenchArgs`]).
//!
//! [`parse`] is the only way in: it runs clap on [`command`] (the derived command with the
//! settings every option shares) and turns each clap error into a one-line [`CliError`] of
//! kind usage (exit status 2) that names the option and what would be valid
//! (`errors`); `--help`, `-h`, `help [COMMAND]`, `--version` and `version`
//! come back as text to print. [`options`] lists each subcommand's options from the same
//! declarations: the hint test (`tests/hints.rs`) and the argument fuzzer
//! ([`crate::fuzz_argv`]) read it, so there is one source of truth for the vocabulary.

mod commands;
mod errors;
pub mod values;

use std::cell::RefCell;
use std::sync::OnceLock;

use clap::{ArgAction, CommandFactory, FromArgMatches, Parser, Subcommand};

pub use commands::{
    BenchArgs, ConvertArgs, DecodeArgs, InspectArgs, LoadArgs, OUTPUT_OPTIONS, ResolveArgs,
    RunArgs, ServeArgs,
};
pub use values::{Checked, LoraArg, OptionValue};

use crate::error::{CliError, CliResult};

/// The subcommands that run something, in `ddo help`'s order.
pub const COMMANDS: [&str; 7] = [
    "run", "decode", "resolve", "inspect", "bench", "convert", "serve",
];

const AFTER_HELP: &str = "`ddo help <command>` lists a command's options. First run: ddo run --config tiny --out /tmp/ddo-tiny.png";

/// The `ddo` program.
#[derive(Debug, Parser)]
#[command(
    name = "ddo",
    version,
    about = "ddo — dynamic offloading for diffusion pipelines",
    override_usage = "ddo <command> [options]",
    after_help = AFTER_HELP,
    disable_help_subcommand = true,
    subcommand_required = true
)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands; each doc comment is the command's line in `ddo help`.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// run the Flux pipeline in phases and print each phase's route, time and peak
    Run(RunArgs),
    /// decode saved latents with a VAE folder into a PNG or safetensors
    Decode(DecodeArgs),
    /// explain what a preset (and --route, and DDO_* variables) gives each component
    Resolve(ResolveArgs),
    /// read safetensors headers: components, params, bytes by dtype, preset plans
    Inspect(InspectArgs),
    /// time one component under several routes or presets, with ratios to the link floor
    Bench(BenchArgs),
    /// write a pipeline folder again with its matrices coded losslessly (about 0.65x the bytes)
    Convert(ConvertArgs),
    /// keep the pipeline loaded and make images for HTTP requests (API and web page)
    Serve(ServeArgs),
    /// print this list, or `ddo help COMMAND`: that command's options
    Help {
        /// the command whose options to list (words after it are ignored)
        #[arg(value_name = "COMMAND", num_args = 0.., allow_hyphen_values = true)]
        words: Vec<String>,
    },
    /// print the version
    #[command(hide = true)]
    Version {
        /// ignored
        #[arg(num_args = 0.., allow_hyphen_values = true)]
        words: Vec<String>,
    },
}

/// What a command line asks for.
#[derive(Debug)]
pub enum Invocation {
    /// Help or the version: text to print on stdout (exit status 0).
    Print(String),
    /// A subcommand to run (boxed: its options are most of its size).
    Run(Box<Command>),
}

/// The derived command with what every option shares: a value may start with `-`
/// (`--prompt --json` is a prompt, `--steps -1` a number the parser refuses), a flag given
/// twice is the flag given once, and help lines are not wrapped. An option that takes one
/// value refuses a second (clap's `ArgAction::Set`).
pub fn command() -> clap::Command {
    Cli::command().term_width(0).mut_subcommands(|sub| {
        sub.term_width(0).mut_args(|arg| {
            if arg.get_long().is_none() {
                arg
            } else if arg.get_action().takes_values() {
                arg.allow_hyphen_values(true)
            } else if matches!(arg.get_action(), ArgAction::SetTrue) {
                let id = arg.get_id().clone();
                arg.overrides_with(id)
            } else {
                arg
            }
        })
    })
}

/// Parses `argv` (without the program name): the subcommand to run, or the text to print;
/// every mistake is a one-line usage error (`errors`).
pub fn parse(argv: &[String]) -> CliResult<Invocation> {
    if argv.is_empty() {
        return Err(CliError::usage(
            "no command given",
            "try `ddo run --config tiny --out /tmp/ddo-tiny.png`, or `ddo help`",
        ));
    }
    match matches(argv) {
        Ok(m) => match Cli::from_arg_matches(&m) {
            Ok(cli) => Ok(match cli.command {
                Command::Help { words } => Invocation::Print(help(words.first())?),
                Command::Version { .. } => Invocation::Print(version()),
                other => Invocation::Run(Box::new(other)),
            }),
            Err(e) => Err(errors::usage_error(&e, argv)),
        },
        Err(e)
            if matches!(
                e.kind(),
                clap::error::ErrorKind::DisplayHelp | clap::error::ErrorKind::DisplayVersion
            ) =>
        {
            // clap reads `-hx` as `-h` clustered with `-x`: DDO takes `-h`, `--help`, `-V` and
            // `--version` only as they are written. clap stops at the first such word, so
            // that one must be exact (`-hx --help` is refused, as `-hx` is).
            let exact = ["-h", "--help", "-V", "--version"];
            let first = argv.iter().find(|a| {
                a.starts_with("-h") || a.starts_with("-V") || exact.contains(&a.as_str())
            });
            if !first.is_some_and(|a| exact.contains(&a.as_str())) {
                let word = first.map_or("-h", String::as_str);
                return Err(CliError::usage(
                    format!("unknown option `{word}`"),
                    "write -h or --help (or -V, --version) alone, or see `ddo help`",
                ));
            }
            Ok(Invocation::Print(e.render().to_string()))
        }
        Err(e) => Err(errors::usage_error(&e, argv)),
    }
}

/// clap's matches of `argv` (without the program name) against [`command`]; `--help` or
/// `-h` as the first word is `help` (`ddo --help run` lists run's options).
pub fn matches(argv: &[String]) -> Result<clap::ArgMatches, clap::Error> {
    let first = match argv.first().map(String::as_str) {
        Some("--help" | "-h") => Some("help"),
        other => other,
    };
    let words = std::iter::once("ddo")
        .chain(first)
        .chain(argv.iter().skip(1).map(String::as_str));
    BUILT.with_borrow_mut(|cmd| cmd.try_get_matches_from_mut(words))
}

thread_local! {
    /// [`command`], built once per thread (its subcommands too): parsing with it builds
    /// nothing again, a tenth of the time of a fresh command (the argument fuzzer parses
    /// each argv several times).
    static BUILT: RefCell<clap::Command> = RefCell::new({
        let mut cmd = command();
        cmd.build();
        cmd
    });
}

/// `ddo --version`.
fn version() -> String {
    format!("ddo {}\n", env!("CARGO_PKG_VERSION"))
}

/// `ddo help` (no `name`) or `ddo help NAME`: a command's options, or for `help` itself its
/// own usage (as `ddo help --help` prints it); an unknown NAME is a usage error.
pub fn help(name: Option<&String>) -> CliResult<String> {
    BUILT.with_borrow_mut(|cmd| match name {
        None => Ok(cmd.render_help().to_string()),
        Some(n) => match cmd.find_subcommand_mut(n) {
            Some(sub) if COMMANDS.contains(&n.as_str()) || n == "help" => {
                Ok(sub.render_help().to_string())
            }
            _ => Err(unknown_command(n)),
        },
    })
}

/// The usage error for a word that is not a command.
pub fn unknown_command(name: &str) -> CliError {
    CliError::usage(
        format!("unknown command `{name}`"),
        format!("commands: {}; see `ddo help`", COMMANDS.join(", ")),
    )
}

/// One option of a subcommand, as its declaration gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptionSpec {
    /// clap's id of the argument (the field's name: `vram_budget`).
    pub id: String,
    /// The long name, without `--` (`vram-budget`).
    pub name: String,
    /// The placeholder when it takes a value (`SIZE`), `None` for a flag.
    pub value: Option<String>,
    /// Whether it may be given more than once.
    pub repeatable: bool,
    /// Its line of help.
    pub help: String,
}

/// The options of subcommand `name` (one of [`COMMANDS`]) in declaration order, `--help`
/// left out; empty for any other name.
pub fn options(name: &str) -> &'static [OptionSpec] {
    static TABLE: OnceLock<Vec<(String, Vec<OptionSpec>)>> = OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let cmd = command();
        cmd.get_subcommands()
            .filter(|s| COMMANDS.contains(&s.get_name()))
            .map(|s| {
                let specs = s
                    .get_arguments()
                    .filter_map(|a| {
                        let name = a.get_long()?;
                        let takes = a.get_action().takes_values();
                        Some(OptionSpec {
                            id: a.get_id().to_string(),
                            name: name.to_string(),
                            value: takes
                                .then(|| a.get_value_names().and_then(|v| v.first()))
                                .flatten()
                                .map(ToString::to_string),
                            repeatable: matches!(a.get_action(), ArgAction::Append),
                            help: a.get_help().map_or(String::new(), ToString::to_string),
                        })
                    })
                    .filter(|s| s.name != "help")
                    .collect();
                (s.get_name().to_string(), specs)
            })
            .collect()
    });
    table
        .iter()
        .find(|(n, _)| n == name)
        .map_or(&[], |(_, specs)| specs.as_slice())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_is_well_formed() {
        command().debug_assert();
    }

    #[test]
    fn every_command_has_options_and_every_value_a_placeholder() {
        for c in COMMANDS {
            let specs = options(c);
            assert!(!specs.is_empty(), "{c}");
            for s in specs {
                assert!(!s.help.is_empty(), "{c} --{}", s.name);
                if s.repeatable {
                    assert!(s.value.is_some(), "{c} --{}", s.name);
                }
            }
            assert!(specs.iter().any(|s| s.name == "json"), "{c}");
        }
        assert!(options("help").is_empty());
        let run = options("run");
        assert_eq!(run.first().map(|s| s.name.as_str()), Some("config"));
        assert!(run.iter().any(|s| s.name == "route" && s.repeatable));
        assert!(
            run.iter()
                .any(|s| s.name == "text-encoder-2" && s.value.as_deref() == Some("FILE"))
        );
    }

    /// The paths a command reads, as its `paths_read` lists them for the output check.
    fn read_by(argv: &[String]) -> Vec<(String, std::path::PathBuf)> {
        let Ok(Invocation::Run(command)) = parse(argv) else {
            panic!("{argv:?} does not parse");
        };
        let list = match &*command {
            Command::Run(a) => a.paths_read(),
            Command::Decode(a) => a.paths_read(),
            Command::Resolve(a) => a.paths_read(),
            Command::Inspect(a) => a.paths_read(),
            Command::Bench(a) => a.paths_read(),
            Command::Convert(a) => a.paths_read(),
            Command::Serve(a) => a.paths_read(),
            _ => Vec::new(),
        };
        list.into_iter()
            .map(|(o, p)| (o.to_string(), p.to_path_buf()))
            .collect()
    }

    /// Issue 34, item 1: every option that takes a path is an output or is in the command's
    /// one list of inputs, so a new file option cannot be forgotten by the output check.
    #[test]
    fn every_path_option_is_read_or_written() {
        let pathlike = |v: &str| {
            v.split(|c: char| !c.is_ascii_alphanumeric())
                .any(|w| ["FILE", "DIR", "PATH", "PREFIX", "OUT"].contains(&w))
        };
        for c in COMMANDS {
            for s in options(c) {
                let Some(v) = &s.value else { continue };
                if !pathlike(v) || OUTPUT_OPTIONS.contains(&s.name.as_str()) {
                    continue;
                }
                let path = format!("/nonexistent/{c}-{}", s.name);
                let argv = vec![c.to_string(), format!("--{}", s.name), path.clone()];
                let read = read_by(&argv);
                assert!(
                    read.iter()
                        .any(|(o, p)| *o == format!("--{}", s.name)
                            && p.to_str() == Some(path.as_str())),
                    "ddo {c} --{} {v}: not in {c}'s paths_read ({read:?})",
                    s.name
                );
            }
        }
        let read = read_by(&["inspect".into(), "a.safetensors".into()]);
        assert_eq!(read, [("PATH".to_string(), "a.safetensors".into())]);
    }
}
