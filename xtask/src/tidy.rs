//! Architecture invariants and code habits, checked over the workspace's files. Each check
//! returns the problems it found; `#[test]`s below run them, so `cargo test` enforces them,
//! and `cargo xtask tidy` prints them.
//!
//! Invariants (also listed in ARCHITECTURE.md):
//! - ddo-metrics and ddo-codec depend on no other DDO crate.
//! - ddo-core depends only on the leaf crates ddo-metrics and ddo-codec.
//! - The host backend, ddo-host, depends only on ddo-core and those leaf crates; only the
//!   programs (ddo-cli, ddo-examples) link it, every library takes it as a dev-dependency.
//! - Only ddo-cuda and ddo-vmm may depend on cudarc; ddo-core never does.
//! - Route crates depend on ddo-core and ddo-metrics, never on each other, on the registry,
//!   or on a backend.
//! - `unsafe` appears only in ddo-core's host memory module (one mmap), ddo-host's host ops
//!   (one sgemm call), in ddo-cuda / ddo-vmm, and in the allocation-watching global allocator of
//!   `ddo-core/tests/safetensors.rs` (test-only), and every `unsafe` block is preceded by a `// SAFETY:` comment.
//! - Every Rust source file opens with a `//!` comment saying what it is for.
//! - No `#[ignore]`, `#[should_panic]`, `todo!()` or `unimplemented!()`.
//! - Every GPU test (the test files of ddo-cuda and ddo-vmm, which `cargo xtask test-gpu`
//!   and the bundle run) asserts something: its body, or a function of its file or of the
//!   folder's `common/` it calls, holds an assertion.

use std::fs;
use std::path::{Path, PathBuf};

/// Every check; an empty list means the workspace is tidy.
pub fn check_all(root: &Path) -> Vec<String> {
    let mut problems = Vec::new();
    problems.extend(check_dependencies(root));
    problems.extend(check_sources(root));
    problems.extend(check_architecture_doc(root));
    problems.extend(check_gpu_tests_assert(root));
    problems
}

/// The test folders whose tests the GPU tasks run.
const GPU_TEST_DIRS: [&str; 2] = ["crates/ddo-cuda/tests", "crates/ddo-vmm/tests"];

/// What counts as asserting: a macro or call that fails the test when its check does not hold.
const ASSERTIONS: [&str; 5] = [
    "assert",
    "panic!(",
    "unwrap_err(",
    "expect_err(",
    "unreachable!(",
];

/// Helpers of `common/` whose only failure is a missing device or input under
/// `DDO_REQUIRE_GPU=1`: calling them asserts nothing about the code under test.
const NOT_ASSERTIONS: [&str; 3] = ["open_gpu", "missing", "gpu_required"];

/// `text` with comments, string literals and char literals blanked (so braces and words in
/// them are not read as code); lengths kept.
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                out.push(b' ');
                i += 1;
            }
        } else if b[i] == b'r'
            && matches!(b.get(i + 1), Some(b'#') | Some(b'"'))
            && !b[..i]
                .last()
                .is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_')
        {
            let hashes = b[i + 1..].iter().take_while(|c| **c == b'#').count();
            if b.get(i + 1 + hashes) != Some(&b'"') {
                out.push(b[i]);
                i += 1;
                continue;
            }
            let close: Vec<u8> = std::iter::once(b'"')
                .chain(std::iter::repeat_n(b'#', hashes))
                .collect();
            let start = i + 2 + hashes;
            let end = b[start..]
                .windows(close.len())
                .position(|w| w == close.as_slice())
                .map_or(b.len(), |p| start + p + close.len());
            out.extend(std::iter::repeat_n(b' ', end - i));
            i = end;
        } else if b[i] == b'"' {
            out.push(b' ');
            i += 1;
            while i < b.len() && b[i] != b'"' {
                let step = if b[i] == b'\\' { 2 } else { 1 };
                for _ in 0..step.min(b.len() - i) {
                    out.push(if b[i] == b'\n' { b'\n' } else { b' ' });
                    i += 1;
                }
            }
            out.push(b' ');
            i += 1;
        } else if b[i] == b'\'' && b.get(i + 2) == Some(&b'\'') {
            out.extend_from_slice(b"   ");
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out.truncate(b.len());
    String::from_utf8_lossy(&out).into_owned()
}

/// Every `fn NAME(...) { body }` of `code` (already [`code_only`]), with whether it is a
/// `#[test]`.
fn functions(code: &str) -> Vec<(String, String, bool)> {
    let mut out = Vec::new();
    let mut at = 0;
    while let Some(p) = code[at..].find("fn ") {
        let start = at + p;
        at = start + 3;
        if code[..start]
            .chars()
            .last()
            .is_some_and(|c| c.is_alphanumeric() || c == '_')
        {
            continue;
        }
        let name: String = code[at..]
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if name.is_empty() {
            continue;
        }
        // The body: the first `{` after the signature outside its parentheses and brackets
        // (a `;` there first means no body; `[T; 3]` is inside brackets).
        let mut nesting = 0i32;
        let Some(open) = code[at..]
            .char_indices()
            .find(|&(_, c)| {
                match c {
                    '(' | '[' => nesting += 1,
                    ')' | ']' => nesting -= 1,
                    _ => {}
                }
                nesting == 0 && (c == '{' || c == ';')
            })
            .map(|(o, _)| at + o)
        else {
            break;
        };
        if code.as_bytes()[open] == b';' {
            continue;
        }
        let mut depth = 0usize;
        let mut end = code.len();
        for (i, c) in code[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        // A test: `#[test]` among the attribute lines right above the `fn`.
        let line_start = code[..start].rfind('\n').map_or(0, |n| n + 1);
        let is_test = code[..line_start]
            .lines()
            .rev()
            .map(str::trim)
            .take_while(|l| l.starts_with("#[") || l.is_empty())
            .any(|l| l == "#[test]");
        out.push((name, code[open..end].to_string(), is_test));
        at = open + 1;
    }
    out
}

/// GPU tests that assert nothing: no assertion in the body, nor in any function of the file
/// or of `common/` that it calls, directly or through others.
pub fn check_gpu_tests_assert(root: &Path) -> Vec<String> {
    let mut problems = Vec::new();
    for dir in GPU_TEST_DIRS {
        let dir = root.join(dir);
        let mut shared = Vec::new();
        let mut common = Vec::new();
        rust_files(&dir.join("common"), &mut common);
        for f in &common {
            if let Ok(text) = fs::read_to_string(f) {
                shared.extend(functions(&code_only(&text)));
            }
        }
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        let mut files: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "rs"))
            .collect();
        files.sort();
        for f in files {
            let Ok(text) = fs::read_to_string(&f) else {
                continue;
            };
            let mut fns = functions(&code_only(&text));
            fns.extend(shared.iter().cloned());
            // Functions that assert, directly or through a function that does.
            let mut asserting: Vec<bool> = fns
                .iter()
                .map(|(name, body, _)| {
                    !NOT_ASSERTIONS.contains(&name.as_str())
                        && ASSERTIONS.iter().any(|a| body.contains(a))
                })
                .collect();
            loop {
                let mut changed = false;
                for i in 0..fns.len() {
                    if asserting[i] || NOT_ASSERTIONS.contains(&fns[i].0.as_str()) {
                        continue;
                    }
                    let calls = fns.iter().zip(&asserting).any(|((name, _, _), a)| {
                        *a && (fns[i].1.contains(&format!("{name}("))
                            || fns[i].1.contains(&format!("{name}::<")))
                    });
                    if calls {
                        asserting[i] = true;
                        changed = true;
                    }
                }
                if !changed {
                    break;
                }
            }
            let rel = f.strip_prefix(root).unwrap_or(&f).display().to_string();
            for ((name, _, is_test), a) in fns.iter().zip(&asserting) {
                if *is_test && !a {
                    problems.push(format!("{rel}: GPU test `{name}` asserts nothing"));
                }
            }
        }
    }
    problems
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        let name = e.file_name();
        if name == "target" || name.to_string_lossy().starts_with('.') {
            continue;
        }
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Crates of the workspace: (package name, directory).
fn crates(root: &Path) -> Vec<(String, PathBuf)> {
    let mut manifests = Vec::new();
    find_manifests(root, &mut manifests);
    manifests
        .into_iter()
        .filter_map(|m| {
            let text = fs::read_to_string(&m).ok()?;
            let name = text
                .lines()
                .skip_while(|l| l.trim() != "[package]")
                .find_map(|l| l.trim().strip_prefix("name = "))?
                .trim_matches('"')
                .to_string();
            Some((name, m.parent()?.to_path_buf()))
        })
        .collect()
}

fn find_manifests(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        let name = e.file_name();
        if name == "target" || name.to_string_lossy().starts_with('.') {
            continue;
        }
        if p.is_dir() {
            find_manifests(&p, out);
        } else if name == "Cargo.toml" {
            out.push(p);
        }
    }
}

/// Names in the `[dependencies]` table of a manifest (not dev- or build-dependencies).
fn dependencies(manifest: &Path) -> Vec<String> {
    let Ok(text) = fs::read_to_string(manifest) else {
        return Vec::new();
    };
    let mut in_deps = false;
    let mut deps = Vec::new();
    for line in text.lines() {
        let l = line.trim();
        if l.starts_with('[') {
            in_deps = l == "[dependencies]";
            continue;
        }
        if in_deps && let Some((name, _)) = l.split_once(['=', '.']) {
            let name = name.trim();
            if !name.is_empty() && !name.starts_with('#') {
                deps.push(name.to_string());
            }
        }
    }
    deps
}

/// Layering rules between crates.
pub fn check_dependencies(root: &Path) -> Vec<String> {
    let mut problems = Vec::new();
    for (name, dir) in crates(root) {
        let deps = dependencies(&dir.join("Cargo.toml"));
        let ddo: Vec<&String> = deps.iter().filter(|d| d.starts_with("ddo-")).collect();
        let gpu_crate = name == "ddo-cuda" || name == "ddo-vmm";
        if !gpu_crate && deps.iter().any(|d| d == "cudarc") {
            problems.push(format!(
                "{name} depends on cudarc; only ddo-cuda and ddo-vmm may"
            ));
        }
        if (name == "ddo-metrics" || name == "ddo-codec") && !ddo.is_empty() {
            problems.push(format!(
                "{name} depends on {ddo:?}; it must depend on no DDO crate"
            ));
        }
        if name == "ddo-core" && ddo.iter().any(|d| *d != "ddo-metrics" && *d != "ddo-codec") {
            problems.push(format!(
                "ddo-core depends on {ddo:?}; it may depend on the leaf crates ddo-metrics and ddo-codec only"
            ));
        }
        if name == "ddo-host"
            && ddo
                .iter()
                .any(|d| !["ddo-core", "ddo-metrics", "ddo-codec"].contains(&d.as_str()))
        {
            problems.push(format!(
                "ddo-host depends on {ddo:?}; the host backend sits just above ddo-core and may depend on ddo-core, ddo-metrics and ddo-codec only"
            ));
        }
        // A backend is chosen by a program; libraries run on whatever device they are given.
        if !HOST_BACKEND_USERS.contains(&name.as_str()) && ddo.iter().any(|d| *d == "ddo-host") {
            problems.push(format!(
                "{name} depends on the host backend ddo-host; only the programs {HOST_BACKEND_USERS:?} link it, a library takes it as a dev-dependency for its tests"
            ));
        }
        // Only the registry links route crates: everything else asks it.
        if name != "ddo-routes" && !name.starts_with("ddo-route-") {
            for d in ddo.iter().filter(|d| d.starts_with("ddo-route-")) {
                problems.push(format!(
                    "{name} depends on the route crate {d}; only the registry (ddo-routes) links routes: ask it"
                ));
            }
        }
        if name.starts_with("ddo-route-") {
            for d in &ddo {
                if *d != "ddo-core" && *d != "ddo-metrics" {
                    problems.push(format!(
                        "route crate {name} depends on {d}; routes talk to ddo-core only"
                    ));
                }
            }
        }
    }
    problems
}

/// The crates that may link the host backend in `[dependencies]`: the programs.
const HOST_BACKEND_USERS: [&str; 2] = ["ddo-cli", "ddo-examples"];

fn may_hold_unsafe(path: &Path) -> bool {
    let p = path.to_string_lossy();
    p.contains("crates/ddo-cuda/")
        || p.contains("crates/ddo-vmm/")
        || p.contains("ddo-core/src/host_memory/")
        || p.ends_with("ddo-core/src/file_guard.rs")
        || p.ends_with("ddo-host/src/ops/gemm.rs")
        || p.ends_with("ddo-core/tests/safetensors.rs")
}

/// Source habits: `//!` openers, `unsafe` confined and explained, no disabled tests or stubs.
pub fn check_sources(root: &Path) -> Vec<String> {
    let mut files = Vec::new();
    rust_files(root, &mut files);
    let mut problems = Vec::new();
    let me = Path::new(file!()).file_name().map(|f| f.to_os_string());
    for f in files {
        let Ok(text) = fs::read_to_string(&f) else {
            continue;
        };
        let rel = f.strip_prefix(root).unwrap_or(&f).display().to_string();
        if !text.trim_start().starts_with("//!") {
            problems.push(format!(
                "{rel}: does not open with a `//!` comment saying what it is for"
            ));
        }
        if f.file_name().map(|n| n.to_os_string()) == me {
            continue; // this file names the patterns it looks for
        }
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if code.contains("unsafe {") || code.contains("unsafe{") {
                if !may_hold_unsafe(&f) {
                    problems.push(format!(
                        "{rel}:{}: `unsafe` outside the lowest layer",
                        i + 1
                    ));
                }
                // The comment block right above the line (or the line itself) explains it.
                let explained = line.contains("SAFETY:")
                    || lines[..i]
                        .iter()
                        .rev()
                        .take_while(|l| l.trim_start().starts_with("//"))
                        .any(|l| l.contains("SAFETY:"));
                if !explained {
                    problems.push(format!(
                        "{rel}:{}: `unsafe` block without a `// SAFETY:` comment",
                        i + 1
                    ));
                }
            }
            for banned in ["#[ignore", "#[should_panic", "todo!(", "unimplemented!("] {
                if code.contains(banned) {
                    problems.push(format!("{rel}:{}: `{banned}` is not allowed", i + 1));
                }
            }
        }
    }
    problems
}

/// ARCHITECTURE.md names every crate of the workspace.
pub fn check_architecture_doc(root: &Path) -> Vec<String> {
    let Ok(doc) = fs::read_to_string(root.join("ARCHITECTURE.md")) else {
        return vec!["ARCHITECTURE.md is missing".to_string()];
    };
    crates(root)
        .into_iter()
        .filter(|(name, _)| !doc.contains(name.as_str()))
        .map(|(name, _)| format!("ARCHITECTURE.md does not mention crate {name}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> PathBuf {
        crate::workspace_root()
    }

    #[test]
    fn layering_holds() {
        let problems = check_dependencies(&root());
        assert!(problems.is_empty(), "{problems:#?}");
        // The check itself sees the crates it is about.
        let names: Vec<String> = crates(&root()).into_iter().map(|(n, _)| n).collect();
        assert!(names.contains(&"ddo-core".to_string()), "{names:?}");
        assert!(names.contains(&"ddo-host".to_string()), "{names:?}");
    }

    #[test]
    fn ddo_core_never_depends_on_cudarc() {
        let deps = dependencies(&root().join("crates/ddo-core/Cargo.toml"));
        assert!(deps.contains(&"ddo-metrics".to_string()), "{deps:?}");
        assert!(!deps.contains(&"cudarc".to_string()));
    }

    #[test]
    fn sources_follow_the_habits() {
        let problems = check_sources(&root());
        assert!(problems.is_empty(), "{problems:#?}");
    }

    #[test]
    fn architecture_doc_names_every_crate() {
        let problems = check_architecture_doc(&root());
        assert!(problems.is_empty(), "{problems:#?}");
    }

    #[test]
    fn every_gpu_test_asserts_something() {
        let problems = check_gpu_tests_assert(&root());
        assert!(problems.is_empty(), "{problems:#?}");
    }

    #[test]
    fn the_assertion_check_sees_through_helpers_strings_and_comments() {
        let dir = std::env::temp_dir().join(format!("ddo-tidy-gpu-{}", std::process::id()));
        let tests = dir.join("crates/ddo-cuda/tests");
        fs::create_dir_all(tests.join("common")).unwrap();
        fs::write(
            tests.join("common/mod.rs"),
            "//! shared\npub fn shared_check(x: u32) { assert_eq!(x, 1); }\n\
             pub fn open_gpu(n: bool) -> Option<u32> { if n { panic!(\"no GPU\") } None }\n",
        )
        .unwrap();
        let file = [
            "//! gpu tests",
            "fn helper() { let s = \"} assert!(x)\"; checked(); }",
            "fn checked() { assert!(true); }",
            "fn arrays(a: [u8; 3]) -> [u8; 2] { assert!(a[0] == 1); [0; 2] }",
            "#[test]",
            "fn through_arrays() { arrays([1; 3]); }",
            "fn prints() { println!(\"{}\", 1); } // assert! in a comment",
            "#[test]",
            "fn through_a_helper() { helper(); }",
            "#[test]",
            "fn through_common() { common::shared_check(1); }",
            "#[test]",
            "fn only_prints() { prints(); let c = '{'; let r = r#\"assert!()\"#; }",
            "#[test]",
            "fn refuses() { f().unwrap_err(); }",
            "#[test]",
            "fn nested() {",
            "    fn inner() {}",
            "    inner();",
            "    assert!(true);",
            "}",
            "#[test]",
            "fn only_opens() { let d = open_gpu(false); }",
        ]
        .join("\n");
        fs::write(tests.join("gpu_x.rs"), file).unwrap();
        let problems = check_gpu_tests_assert(&dir);
        fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            problems,
            vec![
                "crates/ddo-cuda/tests/gpu_x.rs: GPU test `only_prints` asserts nothing"
                    .to_string(),
                "crates/ddo-cuda/tests/gpu_x.rs: GPU test `only_opens` asserts nothing".to_string(),
            ]
        );
    }

    #[test]
    fn the_checks_catch_what_they_look_for() {
        let dir = std::env::temp_dir().join(format!("ddo-tidy-{}", std::process::id()));
        let src = dir.join("crates/ddo-route-x/src");
        fs::create_dir_all(&src).unwrap();
        fs::write(
            dir.join("crates/ddo-route-x/Cargo.toml"),
            "[package]\nname = \"ddo-route-x\"\n\n[dependencies]\nddo-routes.workspace = true\ncudarc = \"0.19\"\n",
        )
        .unwrap();
        let bad = ["fn f() {", "    let x = unsafe { 1 };", "}"].join("\n");
        fs::write(src.join("lib.rs"), bad).unwrap();
        // A crate beside the registry that links a route crate itself.
        let cli = dir.join("crates/ddo-cli");
        fs::create_dir_all(cli.join("src")).unwrap();
        fs::write(
            cli.join("Cargo.toml"),
            "[package]\nname = \"ddo-cli\"\n\n[dependencies]\nddo-routes.workspace = true\nddo-route-x.workspace = true\n",
        )
        .unwrap();
        fs::write(cli.join("src/lib.rs"), "//! The command.\n").unwrap();
        // A library that links the host backend, and a host backend that climbs the layers.
        for (name, dep) in [("ddo-nn", "ddo-host"), ("ddo-host", "ddo-routes")] {
            let c = dir.join("crates").join(name);
            fs::create_dir_all(c.join("src")).unwrap();
            fs::write(
                c.join("Cargo.toml"),
                format!("[package]\nname = \"{name}\"\n\n[dependencies]\nddo-core.workspace = true\n{dep}.workspace = true\n\n[dev-dependencies]\nddo-host.workspace = true\n"),
            )
            .unwrap();
            fs::write(c.join("src/lib.rs"), "//! A crate.\n").unwrap();
        }
        let deps = check_dependencies(&dir);
        assert_eq!(deps.len(), 5, "{deps:#?}");
        assert!(
            deps.iter()
                .any(|d| d.contains("ddo-nn depends on the host backend ddo-host")),
            "{deps:#?}"
        );
        assert!(
            deps.iter()
                .any(|d| d.starts_with("ddo-host depends on") && d.contains("ddo-routes")),
            "{deps:#?}"
        );
        assert!(
            deps.iter()
                .any(|d| d.contains("ddo-cli depends on the route crate ddo-route-x")),
            "{deps:#?}"
        );
        let sources = check_sources(&dir);
        assert_eq!(sources.len(), 3, "{sources:#?}");
        assert_eq!(check_architecture_doc(&dir).len(), 1);
        fs::remove_dir_all(&dir).unwrap();
    }
}
