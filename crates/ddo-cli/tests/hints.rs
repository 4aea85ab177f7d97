//! Error hints name options that exist (the seed's rule, issue 17 point 7): every `--name`
//! inside a string literal of the crates' library and binary sources (`src/`; tests and
//! examples have their own flags) is an option of some `ddo` command (as its clap
//! declaration lists them: `ddo_cli::cli::options`), and a literal that names a command
//! (`ddo run ... --name`) names one of that command's options. A few flags that are not `ddo`'s (NVRTC's, the test files' own deliberate
//! unknowns) are listed by name.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use ddo_cli::cli::{COMMANDS, OptionSpec, options};
use ddo_cli::family::Family;
use ddo_cli::run::parse_dtype;
use ddo_cli::setup::DeviceChoice;
use ddo_core::{Preset, RouteOptions};
use ddo_nn::pipeline::TiledDecode;

/// Flags in string literals that are not `ddo` options: NVRTC's compile options and the
/// hostile values of the argument fuzzer.
const NOT_DDO: &[&str] = &[
    "x",
    "gpu-architecture",
    "std",
    "prec-sqrt",
    "prec-div",
    "ftz",
    "opt",
    "nope",
    "no-such-option",
];

/// Whether `path` is a library or binary source (under a crate's `src/`).
fn is_source(path: &Path) -> bool {
    path.components().any(|c| c.as_os_str() == "src")
}

fn commands() -> Vec<(&'static str, &'static [OptionSpec])> {
    COMMANDS.iter().map(|c| (*c, options(c))).collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if p.is_dir() && name != "target" && !name.starts_with('.') {
            rust_files(&p, out);
        } else if name.ends_with(".rs") {
            out.push(p);
        }
    }
}

/// The string literals of `text` as the program sees their words: plain and byte literals
/// (a `\` line continuation joins its lines, other escapes stay as written) and raw
/// literals, over the whole text, so a hint written over several lines is read whole.
/// Comments, char literals (`'"'`) and lifetimes are not literals.
fn literals(text: &str) -> Vec<String> {
    let b: Vec<char> = text.chars().collect();
    let at = |i: usize| b.get(i).copied();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let after_ident = i > 0 && (b[i - 1].is_alphanumeric() || b[i - 1] == '_');
        match b[i] {
            '/' if at(i + 1) == Some('/') => {
                while i < b.len() && b[i] != '\n' {
                    i += 1;
                }
            }
            '/' if at(i + 1) == Some('*') => {
                i += 2;
                while i < b.len() && !(b[i] == '*' && at(i + 1) == Some('/')) {
                    i += 1;
                }
                i += 2;
            }
            'r' if !after_ident && matches!(at(i + 1), Some('"' | '#')) => {
                let mut j = i + 1;
                while at(j) == Some('#') {
                    j += 1;
                }
                let hashes = j - i - 1;
                if at(j) != Some('"') {
                    i = j;
                    continue;
                }
                let start = j + 1;
                let mut k = start;
                while k < b.len() && !(b[k] == '"' && (1..=hashes).all(|h| at(k + h) == Some('#')))
                {
                    k += 1;
                }
                out.push(b[start..k.min(b.len())].iter().collect());
                i = k + 1 + hashes;
            }
            '\'' => {
                // A char literal ('x', '\n', '\''), else a lifetime's quote.
                i += if at(i + 1) == Some('\\') {
                    let mut j = i + 3;
                    while j < b.len() && b[j] != '\'' {
                        j += 1;
                    }
                    j + 1 - i
                } else if at(i + 2) == Some('\'') {
                    3
                } else {
                    1
                };
            }
            '"' => {
                let mut lit = String::new();
                let mut j = i + 1;
                while j < b.len() && b[j] != '"' {
                    if b[j] == '\\' {
                        if at(j + 1) == Some('\n') {
                            j += 2;
                            while j < b.len() && b[j].is_whitespace() {
                                j += 1;
                            }
                            continue;
                        }
                        lit.push('\\');
                        lit.extend(at(j + 1));
                        j += 2;
                        continue;
                    }
                    lit.push(b[j]);
                    j += 1;
                }
                out.push(lit);
                i = j + 1;
            }
            _ => i += 1,
        }
    }
    out
}

/// The `--name` flags of `literal`.
fn flags(literal: &str) -> Vec<String> {
    let mut out = Vec::new();
    let b = literal.as_bytes();
    let mut i = 0;
    while i + 2 < b.len() {
        let starts = b[i] == b'-'
            && b[i + 1] == b'-'
            && b[i + 2].is_ascii_lowercase()
            && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'-'));
        if starts {
            let mut j = i + 2;
            while j < b.len()
                && (b[j].is_ascii_lowercase() || b[j].is_ascii_digit() || b[j] == b'-')
            {
                j += 1;
            }
            out.push(literal[i + 2..j].trim_end_matches('-').to_string());
            i = j;
        } else {
            i += 1;
        }
    }
    out
}

/// Words of prose that follow a flag in a sentence ("--route or --preset"), not its value.
const PROSE: &[&str] = &["or", "and", "every", "options"];

/// Keys that stand for any route option in a usage line (`ROUTE[:key=value,...]`).
const PLACEHOLDER_KEYS: &[&str] = &["key", "k"];

/// The value written after each `--name ` or `--name=` in `literal`, up to a space, a quote
/// or a closing parenthesis, without the sentence's trailing punctuation.
fn flag_values(literal: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for flag in flags(literal) {
        for (at, _) in literal.match_indices(&format!("--{flag}")) {
            let rest = &literal[at + 2 + flag.len()..];
            let Some(rest) = rest.strip_prefix([' ', '=']) else {
                continue;
            };
            let end = rest
                .find(|c: char| c.is_whitespace() || "`\"')".contains(c))
                .unwrap_or(rest.len());
            let value = rest[..end].trim_end_matches(['.', ',', ':', ';', ']']);
            out.push((flag.clone(), value.to_string()));
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Whether `v` stands for a value (`NAME`, `cuda:{n}`, `ROUTE[`, `...`) instead of being one.
fn placeholder(v: &str) -> bool {
    v.is_empty()
        || v.contains(['{', '[', '<'])
        || v.contains("...")
        || v.chars().any(|c| c.is_ascii_uppercase())
}

/// Why `value`, written after `--flag`, is not a value the flag takes: the flags whose
/// values hints spell out (presets, dtypes, devices, tiled-decode modes, configs, route
/// specs) are checked with DDO's own parsers; placeholders and prose are not values.
fn bad_value(flag: &str, value: &str) -> Option<String> {
    if PROSE.contains(&value) {
        return None;
    }
    let each = |ok: &dyn Fn(&str) -> bool| {
        value
            .split('|')
            .filter(|v| !placeholder(v))
            .find(|v| !ok(v))
            .map(|v| format!("--{flag} {v}: not a value --{flag} takes"))
    };
    match flag {
        "preset" => each(&|v| v.parse::<Preset>().is_ok()),
        "dtype" => each(&|v| parse_dtype(v).is_ok()),
        "device" => each(&|v| DeviceChoice::parse(v).is_ok()),
        "tiled-decode" => each(&|v| v.parse::<TiledDecode>().is_ok()),
        "config" => each(&|v| Family::config_names().contains(&v)),
        "route" => bad_route(value),
        _ => None,
    }
}

/// Why a `--route` value (`COMPONENT=ROUTE[:key=value,...]`, or `ROUTE[:...]` for bench)
/// names a route, an option or an option value that does not exist; its placeholder parts
/// are skipped and its concrete parts parsed as `RouteSpec` and `RouteOptions` parse them.
fn bad_route(value: &str) -> Option<String> {
    let word = |w: &str| {
        !w.is_empty()
            && w.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    };
    let spec = match (value.find('='), value.find(':')) {
        (Some(eq), colon) if colon.is_none_or(|c| eq < c) => &value[eq + 1..],
        _ => value,
    };
    let (route, options) = spec.split_once(':').unwrap_or((spec, ""));
    if word(route) && ddo_routes::parse_spec(route).is_err() {
        return Some(format!("--route {value}: there is no route `{route}`"));
    }
    for item in options.split(',') {
        let Some((key, v)) = item.split_once('=') else {
            continue;
        };
        if !word(key) || PLACEHOLDER_KEYS.contains(&key) {
            continue;
        }
        let known = ["true", "leaf_level", "2", "1GiB", "register", "lossless"]
            .iter()
            .any(|sample| RouteOptions::default().set(key, sample).is_ok());
        if !known {
            return Some(format!("--route {value}: there is no route option `{key}`"));
        }
        let concrete = !v.contains(['{', '[']) && !v.contains("...") && v != v.to_uppercase();
        if concrete && RouteOptions::default().set(key, v).is_err() {
            return Some(format!("--route {value}: `{key}` does not take `{v}`"));
        }
    }
    None
}

/// What is wrong with the flags and values `literal` names: a flag that is no command's
/// option, a flag the one command it names does not have, a value its flag does not take.
fn problems(literal: &str, cmds: &[(&str, &[OptionSpec])], all: &BTreeSet<&str>) -> Vec<String> {
    let mut bad = Vec::new();
    for flag in flags(literal) {
        if NOT_DDO.contains(&flag.as_str()) {
            continue;
        }
        if !all.contains(flag.as_str()) {
            bad.push(format!("--{flag} is no option of `ddo`"));
            continue;
        }
        // `ddo` itself takes only --help and --version; the rest are its commands' options.
        if literal.contains(&format!("ddo --{flag}"))
            && !["help", "version"].contains(&flag.as_str())
        {
            bad.push(format!(
                "`ddo --{flag}`: --{flag} is an option of a command (`ddo CMD --{flag}`)"
            ));
        }
        // A literal that names exactly one command holds that command's options.
        let named: Vec<_> = cmds
            .iter()
            .filter(|(cmd, _)| literal.contains(&format!("ddo {cmd} ")))
            .collect();
        if let [(cmd, opts)] = named.as_slice()
            && !opts.iter().any(|o| o.name == flag)
            && !["help", "version"].contains(&flag.as_str())
        {
            bad.push(format!("`ddo {cmd}` has no --{flag}"));
        }
    }
    for (flag, value) in flag_values(literal) {
        bad.extend(bad_value(&flag, &value));
    }
    bad
}

/// Every option names in `ddo`'s commands, and `help` and `version`.
fn all_options(cmds: &[(&'static str, &'static [OptionSpec])]) -> BTreeSet<&'static str> {
    let mut all: BTreeSet<&str> = ["help", "version"].into_iter().collect();
    for (_, opts) in cmds {
        all.extend(opts.iter().map(|o| o.name.as_str()));
    }
    all
}

/// Every flag in a literal is some command's option, a literal naming `ddo CMD` names that
/// command's options, and the values it writes after them are values they take (the
/// checker's own rules are tested below on known text).
#[test]
fn hints_name_options_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files = Vec::new();
    rust_files(&root.join("crates"), &mut files);
    assert!(files.len() > 50, "the sources were found: {}", files.len());
    let cmds = commands();
    let all = all_options(&cmds);
    let mut bad = Vec::new();
    let (mut seen, mut values) = (0, 0);
    for f in files.iter().filter(|f| is_source(f)) {
        let text = std::fs::read_to_string(f).unwrap();
        for lit in literals(&text) {
            seen += flags(&lit).len();
            values += flag_values(&lit).len();
            for problem in problems(&lit, &cmds, &all) {
                bad.push(format!("{}: {problem}: {lit:?}", f.display()));
            }
        }
    }
    assert!(seen > 100, "flags were found in literals: {seen}");
    assert!(values > 50, "values were found after flags: {values}");
    assert!(
        bad.is_empty(),
        "hints naming options or values that do not exist:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_checker_finds_flags_in_literals_only() {
    let text = "let a = \"give --vram-budget 8GiB or --x-y\"; // \"--comment\"\n// \"--skip\"\nb(\"a\\\"--esc\");";
    let lits = literals(text);
    assert_eq!(lits.len(), 2, "{lits:?}");
    assert_eq!(flags(&lits[0]), ["vram-budget", "x-y"]);
    assert_eq!(flags(&lits[1]), ["esc"]);
    assert!(flags("a-b--c").is_empty(), "not a flag inside a word");
    // A hint over several lines is one literal, read whole; raw literals are read too; a
    // char literal or a lifetime opens none, and block comments are skipped.
    let text = "fn f<'a>(q: char) { let q = '\"'; /* \"--no\" */ g(\"first \\\n        --route vae=none\", r#\"--dtype bf16\"#); }";
    let lits = literals(text);
    assert_eq!(lits, ["first --route vae=none", "--dtype bf16"], "{lits:?}");
    assert_eq!(
        flag_values(&lits[0]),
        [("route".to_string(), "vae=none".to_string())]
    );
}

/// The checker refuses a flag no command has (the hint that named `ddo run --allocator
/// native_vmm`), one the named command lacks, and values their flags do not take, and
/// passes placeholders and prose.
#[test]
fn the_checker_refuses_flags_and_values_that_do_not_exist() {
    let cmds = commands();
    let all = all_options(&cmds);
    let bad = |lit: &str| problems(lit, &cmds, &all);
    for lit in [
        "install it first: ddo run --allocator native_vmm",
        "use `ddo inspect --preset vmm_fast`",
        "give --preset fastest",
        "give --dtype fp4",
        "use --device gpu",
        "use --tiled-decode sometimes",
        "or --config flux-schnell",
        "use --route vae=turbo",
        "use --route vae=diffusers_group_offload:use_stram=true",
        "use --route transformer=native_vmm:budget=lots",
        "--route {}=...:pinned_limt={} would avoid it",
        "or do not read the environment (`ddo --no-env`)",
    ] {
        assert_eq!(bad(lit).len(), 1, "{lit}: {:?}", bad(lit));
    }
    for lit in [
        "install it first (`ddo run --preset vmm_fast` or `--route COMPONENT=native_vmm`)",
        "e.g. --route {component}=diffusers_group_offload:use_stream=true",
        "write --route COMPONENT=ROUTE[:key=value,...], e.g. --route vae=linear_convolution.",
        "--route {}=...:pinned_limit={} would avoid it",
        "--config tiny|flux-dev|qwen-tiny|qwen-image",
        "use --device cpu (the host backend) or --device cuda:N",
        "--device cuda:{n}: no such device",
        "use --tiled-decode off to decode untiled, --dtype bf16, --preset NAME",
        "without --route or --preset every route is a candidate",
        "ddo bench --config tiny [--route ROUTE]...",
        "or do not read the environment (`ddo run|decode|resolve ... --no-env`)",
        "see `ddo --help`",
    ] {
        assert!(bad(lit).is_empty(), "{lit}: {:?}", bad(lit));
    }
}
