//! Error hints name options that exist (the seed's rule, issue 17 point 7): every `--name`
//! inside a string literal of the crates' library and binary sources (`src/`; tests and
//! examples have their own flags) is an option of some `ddo` command (as its clap
//! declaration lists them: `ddo_cli::cli::options`), and a literal that names a command
//! (`ddo run ... --name`) names one of that command's options. A few flags that are not `ddo`'s (NVRTC's, the test files' own deliberate
//! unknowns) are listed by name.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use ddo_cli::cli::{COMMANDS, OptionSpec, options};

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

/// The string literals of `text` (plain `"..."` literals, escapes skipped; raw strings and
/// comments are not hints).
fn literals(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in text.lines() {
        let code = line.trim_start();
        if code.starts_with("//") {
            continue;
        }
        let mut chars = line.chars().peekable();
        let mut cur: Option<String> = None;
        while let Some(c) = chars.next() {
            match (&mut cur, c) {
                (None, '"') => cur = Some(String::new()),
                (Some(s), '\\') => {
                    if let Some(n) = chars.next() {
                        s.push('\\');
                        s.push(n);
                    }
                }
                (Some(_), '"') => out.push(cur.take().unwrap_or_default()),
                (Some(s), c) => s.push(c),
                (None, '/') if chars.peek() == Some(&'/') => break,
                (None, _) => {}
            }
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

/// Every flag in a literal is some command's option, and a literal naming `ddo CMD` names
/// that command's options (the checker's own rules are tested below on known text).
#[test]
fn hints_name_options_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files = Vec::new();
    rust_files(&root.join("crates"), &mut files);
    assert!(files.len() > 50, "the sources were found: {}", files.len());
    let cmds = commands();
    let mut all: BTreeSet<&str> = ["help", "version"].into_iter().collect();
    for (_, opts) in &cmds {
        all.extend(opts.iter().map(|o| o.name.as_str()));
    }
    let mut bad = Vec::new();
    let mut seen = 0;
    for f in files.iter().filter(|f| is_source(f)) {
        let text = std::fs::read_to_string(f).unwrap();
        for lit in literals(&text) {
            for flag in flags(&lit) {
                seen += 1;
                if NOT_DDO.contains(&flag.as_str()) {
                    continue;
                }
                if !all.contains(flag.as_str()) {
                    bad.push(format!("{}: --{flag} in {lit:?}", f.display()));
                    continue;
                }
                // A literal that names exactly one command holds that command's options.
                let named: Vec<_> = cmds
                    .iter()
                    .filter(|(cmd, _)| lit.contains(&format!("ddo {cmd} ")))
                    .collect();
                if let [(cmd, opts)] = named.as_slice()
                    && !opts.iter().any(|o| o.name == flag)
                    && !["help", "version"].contains(&flag.as_str())
                {
                    bad.push(format!(
                        "{}: `ddo {cmd}` has no --{flag}: {lit:?}",
                        f.display()
                    ));
                }
            }
        }
    }
    assert!(seen > 100, "flags were found in literals: {seen}");
    assert!(
        bad.is_empty(),
        "hints naming options that do not exist:\n{}",
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
}
