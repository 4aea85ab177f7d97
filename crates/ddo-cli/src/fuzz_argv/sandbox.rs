//! The [`Sandbox`] each argv runs in, and the checks after each execution: panics, the
//! error's shape, and which files were read, written or changed (see the parent module's
//! documentation).

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Once;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::entries::{Entry, Print, entries, fixtures_dir, make, print, scan};
use super::vocab::{Given, Kind, kind_of, specs};

/// Counts every panic of the process (caught ones too), then calls the hook installed
/// before (libFuzzer's aborts the process).
static PANICS: AtomicUsize = AtomicUsize::new(0);

fn count_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            previous(info);
        }));
    });
}

/// Where a path the command was given leads, as `Outputs` resolves it: the file itself
/// once links are followed, else its folder's canonical path joined with its name.
fn resolved(path: &Path) -> Option<PathBuf> {
    if let Ok(p) = fs::canonicalize(path) {
        return Some(p);
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    Some(fs::canonicalize(parent).ok()?.join(path.file_name()?))
}

/// The files an argv reads and those it may write, resolved: each output as the group of
/// paths that name it (as given, and resolved).
#[derive(Debug, Default)]
struct Named {
    inputs: Vec<PathBuf>,
    outputs: Vec<Vec<PathBuf>>,
}

impl Named {
    /// What `argv` names, by the same parser the command uses: path options named `out*`,
    /// `save-*` or `plot` (`PREFIX.svg` and `PREFIX.png`) are outputs (`run` writes
    /// `ddo-out.png` without `--out`), other path options and `inspect`'s PATH are inputs.
    /// Nothing when the argv does not parse.
    fn of(argv: &[String], root: &Path) -> Self {
        let mut named = Self::default();
        let Some(command) = argv.first() else {
            return named;
        };
        if !COMMANDS_WITH_FILES.contains(&command.as_str()) {
            return named;
        }
        let specs = specs(command);
        let Some(parsed) = Given::of(argv) else {
            return named;
        };
        let paths = |p: &str| {
            let path = Path::new(p);
            let mut v = vec![root.join(path)];
            v.extend(resolved(path));
            v
        };
        for spec in specs.iter().filter(|s| kind_of(s) == Kind::Path) {
            for v in parsed.all(&spec.name) {
                let n = spec.name.as_str();
                if n == "plot" {
                    named.outputs.push(paths(&format!("{v}.svg")));
                    named.outputs.push(paths(&format!("{v}.png")));
                } else if n.starts_with("out") || n.starts_with("save-") {
                    named.outputs.push(paths(v));
                } else {
                    named.inputs.extend(paths(v));
                }
            }
        }
        if command == "run" && parsed.get("out").is_none() {
            named.outputs.push(paths("ddo-out.png"));
        }
        if command == "inspect" {
            for p in &parsed.positionals {
                named.inputs.extend(paths(p));
            }
        }
        named
    }

    fn is_input(&self, path: &Path) -> bool {
        self.inputs.iter().any(|i| path == i || path.starts_with(i))
    }

    /// Whether `path` is a named output, or `STEM-N.EXT` beside one (`run`'s images).
    fn is_output(&self, path: &Path) -> bool {
        self.outputs.iter().flatten().any(|o| names(o, path))
    }

    /// A named output of which nothing exists (checked after a success).
    fn missing_output(&self, found: &BTreeMap<PathBuf, Print>, root: &Path) -> Option<PathBuf> {
        self.outputs
            .iter()
            .find(|group| {
                !group
                    .iter()
                    .any(|o| o.exists() || found.keys().any(|rel| names(o, &root.join(rel))))
            })
            .and_then(|group| group.first().cloned())
    }
}

/// Whether `path` is the output `o`, or `STEM-N.EXT` beside it (`run`'s images).
fn names(o: &Path, path: &Path) -> bool {
    if path == o {
        return true;
    }
    let (Some(name), Some(stem)) = (path.file_name(), o.file_stem()) else {
        return false;
    };
    let ext = o
        .extension()
        .map_or(String::new(), |e| format!(".{}", e.to_string_lossy()));
    path.parent() == o.parent()
        && name
            .to_string_lossy()
            .strip_prefix(&format!("{}-", stem.to_string_lossy()))
            .and_then(|rest| rest.strip_suffix(&ext))
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// The commands that read or write files.
const COMMANDS_WITH_FILES: [&str; 5] = ["run", "decode", "resolve", "inspect", "bench"];

/// `Ok` without `problems`, else one line naming the argv, its outcome and every problem.
fn report(
    argv: &[String],
    result: &crate::CliResult<()>,
    problems: Vec<String>,
) -> Result<(), String> {
    if problems.is_empty() {
        return Ok(());
    }
    Err(format!(
        "ddo {argv:?} ({}): {}",
        match result {
            Ok(()) => "succeeded".to_string(),
            Err(e) => format!("failed: {e}"),
        },
        problems.join("; ")
    ))
}

/// A folder of inputs the command runs in (the working directory while it runs), checked
/// after every execution and put back as it was.
#[derive(Debug)]
pub struct Sandbox {
    root: PathBuf,
    entries: Vec<(PathBuf, Entry, Print)>,
    executions: u64,
}

impl Sandbox {
    /// Makes the sandbox at `root` (removing what was there) and installs a panic hook that
    /// counts panics before calling the previous one. Refused while a `DDO_*` variable is set
    /// (the command would read it).
    pub fn create(root: &Path) -> io::Result<Self> {
        let set: Vec<String> = std::env::vars_os()
            .filter_map(|(k, _)| k.into_string().ok())
            .filter(|k| k.starts_with("DDO_"))
            .collect();
        if !set.is_empty() {
            return Err(io::Error::other(format!(
                "unset {} first: the fuzzed command would read them",
                set.join(", ")
            )));
        }
        if root.exists() {
            fs::remove_dir_all(root)?;
        }
        fs::create_dir_all(root)?;
        let root = fs::canonicalize(root)?;
        let mut made = Vec::new();
        for (rel, entry) in entries(&fixtures_dir())? {
            let path = root.join(&rel);
            make(&path, &entry)?;
            let p = print(&path).ok_or_else(|| io::Error::other(format!("{rel:?} missing")))?;
            made.push((rel, entry, p));
        }
        count_panics();
        Ok(Self {
            root,
            entries: made,
            executions: 0,
        })
    }

    /// A sandbox under the temporary directory, named by the process id; those of
    /// processes that have exited are removed first (Linux: by `/proc`).
    pub fn create_in_temp() -> io::Result<Self> {
        let tmp = std::env::temp_dir();
        if Path::new("/proc/self").exists()
            && let Ok(rd) = fs::read_dir(&tmp)
        {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if let Some(pid) = name.strip_prefix("ddo-fuzz-cli-")
                    && pid.bytes().all(|b| b.is_ascii_digit())
                    && !Path::new("/proc").join(pid).exists()
                {
                    let _ = fs::remove_dir_all(e.path());
                }
            }
        }
        Self::create(&tmp.join(format!("ddo-fuzz-cli-{}", std::process::id())))
    }

    /// The sandbox's folder.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Runs `argv` through [`crate::execute`] and checks what it did (see the module
    /// documentation), then removes its outputs and restores what it overwrote. `Err` lists
    /// every broken invariant, a panic first (under libFuzzer the panic hook aborts before).
    pub fn run(&mut self, argv: &[String]) -> Result<(), String> {
        // The command runs in the sandbox; the process's own working directory (libFuzzer's
        // relative paths) is back once it returns.
        let home = std::env::current_dir().map_err(|e| format!("no working directory: {e}"))?;
        std::env::set_current_dir(&self.root)
            .map_err(|e| format!("cannot enter {}: {e}", self.root.display()))?;
        let named = Named::of(argv, &self.root);
        let panics = PANICS.load(Ordering::SeqCst);
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            crate::execute(argv, &mut io::sink())
        }));
        std::env::set_current_dir(&home)
            .map_err(|e| format!("cannot go back to {}: {e}", home.display()))?;
        let mut problems = Vec::new();
        let result = match outcome {
            Ok(r) => r,
            Err(panic) => {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                problems.push(format!("panicked: {message}"));
                Err(crate::CliError::runtime("(panicked)", ""))
            }
        };
        if PANICS.load(Ordering::SeqCst) != panics && problems.is_empty() {
            problems.push("panicked (the panic was caught inside the command)".to_string());
        }
        match &result {
            Err(e) => {
                if e.message.trim().is_empty() || e.message.contains(['\n', '\r']) {
                    problems.push(format!("the error is not one line: {:?}", e.message));
                }
            }
            Ok(()) => {
                let known = ["run", "decode", "resolve", "inspect", "bench", "help"]
                    .iter()
                    .chain(&["--help", "-h", "version", "--version", "-V"])
                    .any(|c| argv.first().is_some_and(|a| a == c));
                if !known {
                    problems.push("succeeded without a known command".into());
                }
            }
        }
        let failed = result.is_err();
        self.executions += 1;
        // `help`, the version, an unknown command or none print or fail in `lib.rs` without
        // touching a file: the sandbox is not scanned for them.
        if !COMMANDS_WITH_FILES.contains(&argv.first().map_or("", String::as_str)) {
            return report(argv, &result, problems);
        }
        let mut found = BTreeMap::new();
        scan(&self.root, &self.root, &mut found);
        let mut restore = Vec::new();
        for (i, (rel, _, before)) in self.entries.iter().enumerate() {
            let now = found.remove(rel);
            if now.as_ref() == Some(before) {
                continue;
            }
            let path = self.root.join(rel);
            let how = if now.is_none() { "removed" } else { "changed" };
            if named.is_input(&path) {
                problems.push(format!("{how} {}, which it read", rel.display()));
            } else if failed {
                problems.push(format!(
                    "{how} {} and failed (a partial output)",
                    rel.display()
                ));
            } else if !named.is_output(&path) {
                problems.push(format!("{how} {}, which no option named", rel.display()));
            }
            restore.push(i);
        }
        for rel in found.keys() {
            let path = self.root.join(rel);
            let name = rel.to_string_lossy();
            if name.contains(".ddo-") && name.ends_with(".tmp") {
                problems.push(format!("left the temporary file {name}"));
            } else if failed {
                problems.push(format!("wrote {name} and failed (a partial output)"));
            } else if !named.is_output(&path) {
                problems.push(format!("wrote {name}, which no option named"));
            }
        }
        if let (false, Some(p)) = (failed, named.missing_output(&found, &self.root)) {
            problems.push(format!("succeeded without writing {}", p.display()));
        }
        // Back to the sandbox as made: new entries go (deepest first), changed ones are
        // made again.
        for rel in found.keys().rev() {
            let path = self.root.join(rel);
            let _ = match fs::symlink_metadata(&path) {
                Ok(m) if m.is_dir() => fs::remove_dir_all(&path),
                _ => fs::remove_file(&path),
            };
        }
        for i in restore {
            let (rel, entry, _) = &self.entries[i];
            let path = self.root.join(rel);
            if let Err(e) = make(&path, entry) {
                problems.push(format!("cannot restore {}: {e}", rel.display()));
            }
            if let Some(p) = print(&path) {
                self.entries[i].2 = p;
            }
        }
        if self.executions.is_multiple_of(16_384)
            && let Err(e) = self.verify_contents()
        {
            problems.push(e);
        }
        report(argv, &result, problems)
    }

    /// Compares the bytes of every sandbox file with what it was made from.
    pub fn verify_contents(&self) -> Result<(), String> {
        for (rel, entry, _) in &self.entries {
            let path = self.root.join(rel);
            let expected = match entry {
                Entry::File(b) => b.clone(),
                Entry::Copy(from) => {
                    fs::read(from).map_err(|e| format!("{}: {e}", from.display()))?
                }
                _ => continue,
            };
            if fs::read(&path).ok().as_deref() != Some(expected.as_slice()) {
                return Err(format!("the bytes of {} changed", rel.display()));
            }
        }
        Ok(())
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.root);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outputs_and_their_numbered_images_are_named() {
        let o = Path::new("/s/out.png");
        assert!(names(o, o));
        assert!(names(o, Path::new("/s/out-0.png")));
        assert!(names(o, Path::new("/s/out-12.png")));
        assert!(!names(o, Path::new("/s/out-.png")));
        assert!(!names(o, Path::new("/s/out-1.safetensors")));
        assert!(!names(o, Path::new("/t/out-1.png")));
        assert!(!names(o, Path::new("/s/lat.safetensors")));
    }
}
