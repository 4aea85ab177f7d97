//! The files a command reads and writes, checked before any work and written whole.
//!
//! [`Inputs`] is the one list of every path a command reads (each subcommand's
//! `paths_read`: weights folders, single-file components, embeddings, latents, and whatever
//! a later option reads), resolved through links and `..`, with the identity (device and
//! inode) of every file it names — a folder's files included, links inside it followed, as
//! the loaders follow them. [`Outputs::plan`] checks every output against it and the others:
//! - an output is never an input: not the same path, not inside an input folder, not the
//!   same file by another name (a link, a hard link, a Hugging Face cache's blob);
//! - two outputs never name the same file;
//! - an output names a file: a path ending in `/`, an existing folder, FIFO or device, a
//!   symbolic link (DDO never writes through one) and anything in `/dev`, `/proc` or `/sys`
//!   are refused;
//! - its directory exists and takes a new file now, not after the work (probed with a
//!   temporary file of its own).
//!
//! [`Outputs::commit`] writes the bytes to temporary files created exclusively
//! (`O_CREAT | O_EXCL`, so never through a link planted at the name) under random names
//! beside each target (`.NAME.ddo-PID-RANDOM.tmp`), synced, and renames them into place only
//! when every output of the command was written: a failed write (disk full, a file size
//! limit) leaves every previous file as it was and no partial one. The renames run under
//! [`OUTPUT_PHASE`], which the interrupt handler (`crate::interrupt`) takes before it lets
//! SIGINT, SIGTERM or SIGHUP end the process, so an interrupt leaves all of the outputs or
//! none. Temporary files left by a process that was killed outright (SIGKILL, power loss)
//! are removed by the next command that writes the same target: only regular files of this
//! user, named after that target, whose process no longer exists.

use std::fs;
use std::io::Write;
use std::path::{Component, Path, PathBuf};

use std::sync::{Mutex, MutexGuard};

use crate::error::{CliError, CliResult};

/// Held while outputs are probed, written and renamed into place; the interrupt handler
/// takes it before ending the process, so an interrupt never splits a command's outputs.
pub static OUTPUT_PHASE: Mutex<()> = Mutex::new(());

/// Takes [`OUTPUT_PHASE`] (a panic while it was held leaves nothing to protect).
pub fn output_phase() -> MutexGuard<'static, ()> {
    OUTPUT_PHASE.lock().unwrap_or_else(|e| e.into_inner())
}

/// How deep [`Inputs`] looks into an input folder (a pipeline folder's files sit one or
/// two levels down; a Hugging Face snapshot's links lead to blobs).
const MAX_INPUT_DEPTH: usize = 4;

/// The most entries [`Inputs`] records below one input folder (a pipeline folder holds
/// tens); past it the folder is still refused as a whole, its links outside no longer.
const MAX_INPUT_ENTRIES: usize = 100_000;

/// The most bytes of a target's name a temporary name repeats (a name of 255 bytes plus
/// the suffix would be too long for the file system).
const TEMP_NAME_PREFIX_BYTES: usize = 96;

/// A file's identity: device and inode.
#[cfg(unix)]
fn identity(meta: &fs::Metadata) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    Some((meta.dev(), meta.ino()))
}

#[cfg(not(unix))]
fn identity(_meta: &fs::Metadata) -> Option<(u64, u64)> {
    None
}

/// One file or folder a command reads.
#[derive(Debug, Clone)]
struct ReadPath {
    option: &'static str,
    given: PathBuf,
    canonical: PathBuf,
}

/// Every path a command reads, resolved (see the module documentation).
#[derive(Debug, Clone, Default)]
pub struct Inputs {
    /// The paths as the options gave them, and folders reached through links inside them.
    paths: Vec<ReadPath>,
    /// (device, inode) of every file named or found below a named folder, with its option.
    files: Vec<((u64, u64), &'static str, PathBuf)>,
}

impl Inputs {
    /// The inputs `(option, path)` of a command. A path that does not exist (yet) reads
    /// nothing and is left out: the command fails when it reads it, before any output is
    /// written. An empty path is the current folder to the loaders that read it.
    pub fn of(inputs: &[(&'static str, &Path)]) -> Self {
        let mut set = Self::default();
        for (option, path) in inputs {
            let path = if path.as_os_str().is_empty() {
                Path::new(".")
            } else {
                path
            };
            let Ok(canonical) = fs::canonicalize(path) else {
                continue;
            };
            let Ok(meta) = fs::metadata(&canonical) else {
                continue;
            };
            if meta.is_dir() {
                let mut budget = MAX_INPUT_ENTRIES;
                set.walk(option, &canonical, 0, &mut budget);
            } else if let Some(id) = identity(&meta) {
                set.files.push((id, option, canonical.clone()));
            }
            set.paths.push(ReadPath {
                option,
                given: path.to_path_buf(),
                canonical,
            });
        }
        set
    }

    /// Records the files below `dir` (links followed) and the folders outside it that links
    /// lead to.
    fn walk(&mut self, option: &'static str, dir: &Path, depth: usize, budget: &mut usize) {
        let Ok(rd) = fs::read_dir(dir) else { return };
        for entry in rd.flatten() {
            if *budget == 0 {
                return;
            }
            *budget -= 1;
            let path = entry.path();
            let Ok(meta) = fs::metadata(&path) else {
                continue;
            };
            if meta.is_dir() {
                if depth + 1 >= MAX_INPUT_DEPTH {
                    continue;
                }
                let linked = entry.file_type().is_ok_and(|t| t.is_symlink());
                if linked && let Ok(target) = fs::canonicalize(&path) {
                    if self.paths.iter().any(|p| p.canonical == target) {
                        continue;
                    }
                    self.paths.push(ReadPath {
                        option,
                        given: path.clone(),
                        canonical: target.clone(),
                    });
                    self.walk(option, &target, depth + 1, budget);
                } else {
                    self.walk(option, &path, depth + 1, budget);
                }
            } else if let Some(id) = identity(&meta) {
                let shown = fs::canonicalize(&path).unwrap_or(path);
                self.files.push((id, option, shown));
            }
        }
    }

    /// Why writing `target` (a file's final path, its folder canonical) would destroy an
    /// input, if it would: the option and the input it names.
    fn clash(&self, target: &Path) -> Option<String> {
        for p in &self.paths {
            if target == p.canonical {
                return Some(format!(
                    "is the file given to {} ({})",
                    p.option,
                    p.given.display()
                ));
            }
            if target.starts_with(&p.canonical) {
                return Some(format!(
                    "is inside the folder given to {} ({})",
                    p.option,
                    p.given.display()
                ));
            }
        }
        let meta = fs::metadata(target).ok()?;
        let id = identity(&meta)?;
        self.files
            .iter()
            .find(|(i, _, _)| *i == id)
            .map(|(_, option, path)| {
                format!(
                    "is the same file as {} read through {option}",
                    path.display()
                )
            })
    }
}

/// One planned output: the option that named it, the path as given and where it lands.
#[derive(Debug, Clone)]
struct Planned {
    option: &'static str,
    path: PathBuf,
    target: PathBuf,
}

/// The checked outputs of one command ([`Outputs::plan`]), written by [`Outputs::commit`].
#[derive(Debug, Clone, Default)]
pub struct Outputs {
    planned: Vec<Planned>,
}

fn not_a_file(option: &str, path: &Path, why: &str) -> CliError {
    CliError::usage(
        format!("{option} {}: {why}", path.display()),
        "name a file, e.g. out/image.png",
    )
}

/// Where output `path` lands: its folder, canonical, joined with its name (the last
/// component itself is never followed). Refuses what does not name a file.
fn target_of(option: &str, path: &Path) -> CliResult<PathBuf> {
    let text = path.as_os_str().as_encoded_bytes();
    if text.is_empty() {
        return Err(not_a_file(option, path, "an empty path"));
    }
    if text.ends_with(b"/") || (cfg!(windows) && text.ends_with(b"\\")) {
        return Err(not_a_file(
            option,
            path,
            "ends in a separator, so names a folder",
        ));
    }
    let name = match path.components().next_back() {
        Some(Component::Normal(n)) => n,
        _ => return Err(not_a_file(option, path, "names a folder, not a file")),
    };
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let dir = fs::canonicalize(parent).map_err(|e| {
        CliError::usage(
            format!(
                "{option} {}: the directory {} cannot be used: {e}",
                path.display(),
                parent.display()
            ),
            "create the directory first, or name a file in an existing one",
        )
    })?;
    if !dir.is_dir() {
        return Err(CliError::usage(
            format!(
                "{option} {}: {} is not a directory",
                path.display(),
                parent.display()
            ),
            "name a file in an existing directory",
        ));
    }
    for special in ["/dev", "/proc", "/sys"] {
        if cfg!(unix) && dir.starts_with(special) {
            return Err(CliError::usage(
                format!(
                    "{option} {}: lands in {}, a folder of devices and kernel files",
                    path.display(),
                    dir.display()
                ),
                "name a regular file in a folder of your own, e.g. out/image.png",
            ));
        }
    }
    Ok(dir.join(name))
}

/// The start of every temporary name for `target`: `.NAME.ddo-` (`NAME` cut to
/// [`TEMP_NAME_PREFIX_BYTES`] on a character boundary).
fn temp_stem(target: &Path) -> String {
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut cut = name.len().min(TEMP_NAME_PREFIX_BYTES);
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    format!(".{}.ddo-", &name[..cut])
}

/// A new temporary file beside `target`, created exclusively under a random name
/// (`.NAME.ddo-PID-RANDOM.tmp`); removed when dropped unless persisted.
fn temporary(target: &Path) -> std::io::Result<tempfile::NamedTempFile> {
    let dir = target.parent().unwrap_or(Path::new("."));
    tempfile::Builder::new()
        .prefix(&format!("{}{}-", temp_stem(target), std::process::id()))
        .suffix(".tmp")
        .rand_bytes(8)
        .tempfile_in(dir)
}

/// Removes the temporary files of `target` left by processes that no longer run (killed
/// before they could clean up): regular files of this user named `.NAME.ddo-PID-*.tmp` (or
/// `.NAME.ddo-PID.tmp`, the names of earlier versions) whose PID has no `/proc` entry.
/// Linux only (elsewhere nothing tells whether a process runs). Returns how many went.
fn remove_stale_temporaries(target: &Path) -> usize {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::MetadataExt;
        let (Some(dir), Ok(me)) = (target.parent(), fs::metadata("/proc/self")) else {
            return 0;
        };
        let stem = temp_stem(target);
        let Ok(rd) = fs::read_dir(dir) else { return 0 };
        let mut removed = 0;
        for entry in rd.flatten() {
            let name = entry.file_name();
            let Some(rest) = name
                .to_str()
                .and_then(|n| n.strip_prefix(&stem))
                .and_then(|n| n.strip_suffix(".tmp"))
            else {
                continue;
            };
            let pid = rest.split('-').next().unwrap_or("");
            if pid.is_empty()
                || !pid.bytes().all(|b| b.is_ascii_digit())
                || pid == std::process::id().to_string()
                || Path::new("/proc").join(pid).exists()
            {
                continue;
            }
            let Ok(meta) = fs::symlink_metadata(entry.path()) else {
                continue;
            };
            if meta.is_file() && meta.uid() == me.uid() && fs::remove_file(entry.path()).is_ok() {
                removed += 1;
            }
        }
        removed
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = target;
        0
    }
}

impl Outputs {
    /// Checks `outputs` (`(option, path)`) against each other and against `inputs` (every
    /// path the command reads), and that each can be written (see the module
    /// documentation). Nothing is written but a probe, removed at once, and stale temporary
    /// files of the targets are removed.
    pub fn plan(outputs: &[(&'static str, &Path)], inputs: &Inputs) -> CliResult<Self> {
        let mut planned: Vec<Planned> = Vec::with_capacity(outputs.len());
        for (option, path) in outputs {
            let target = target_of(option, path)?;
            if let Some(how) = inputs.clash(&target) {
                return Err(CliError::usage(
                    format!(
                        "{option} {} {how}: writing it would destroy an input",
                        path.display(),
                    ),
                    format!("give {option} a path outside every input"),
                ));
            }
            if let Ok(meta) = fs::symlink_metadata(&target) {
                if meta.file_type().is_symlink() {
                    let to = fs::read_link(&target)
                        .map(|t| t.display().to_string())
                        .unwrap_or_else(|_| "?".into());
                    return Err(CliError::usage(
                        format!(
                            "{option} {}: is a symbolic link (to {to}); DDO never writes through a link",
                            path.display()
                        ),
                        "name the file itself, or remove the link first",
                    ));
                }
                if !meta.is_file() {
                    return Err(CliError::usage(
                        format!(
                            "{option} {}: exists and is not a regular file",
                            path.display()
                        ),
                        "name a new file or a regular file to replace",
                    ));
                }
            }
            if let Some(other) = planned.iter().find(|p| p.target == target) {
                return Err(CliError::usage(
                    format!(
                        "{option} {} and {} {} name the same file",
                        path.display(),
                        other.option,
                        other.path.display()
                    ),
                    "give each output its own file",
                ));
            }
            planned.push(Planned {
                option,
                path: path.to_path_buf(),
                target,
            });
        }
        let _phase = output_phase();
        for p in &planned {
            remove_stale_temporaries(&p.target);
            // The directory must take a new file now, not after the work is done.
            temporary(&p.target)
                .and_then(|probe| probe.close())
                .map_err(|e| {
                    CliError::runtime(
                        format!("{} {}: cannot write there: {e}", p.option, p.path.display()),
                        "check that the directory exists and is writable",
                    )
                })?;
        }
        Ok(Self { planned })
    }

    /// The files each output option lands in, in the order planned.
    pub fn targets(&self) -> Vec<(&'static str, &Path)> {
        self.planned
            .iter()
            .map(|p| (p.option, p.target.as_path()))
            .collect()
    }

    /// Writes `data` (`(option, bytes)`, one for each planned output that is written; the
    /// others are left alone) to temporary files beside the targets, then renames them into
    /// place. An option planned several times (`--out` for each image) takes its data in the
    /// order it was planned. A failure before the renames removes the temporary files and
    /// leaves every target as it was.
    pub fn commit(&self, data: &[(&'static str, Vec<u8>)]) -> CliResult<()> {
        self.commit_with(data, |_| {})
    }

    /// [`commit`](Self::commit), calling `before_rename(i)` before the `i`-th rename (with
    /// [`OUTPUT_PHASE`] held): the interrupt tests (`tests/interrupt.rs`) signal there.
    pub fn commit_with(
        &self,
        data: &[(&'static str, Vec<u8>)],
        mut before_rename: impl FnMut(usize),
    ) -> CliResult<()> {
        let _phase = output_phase();
        // Dropping a `NamedTempFile` removes it: an early return cleans up.
        let mut written: Vec<(tempfile::NamedTempFile, &Planned)> = Vec::new();
        let mut used = vec![false; self.planned.len()];
        for (option, bytes) in data {
            let next = self
                .planned
                .iter()
                .enumerate()
                .find(|(i, p)| p.option == *option && !used[*i]);
            let Some((index, p)) = next else {
                return Err(CliError::runtime(
                    format!("internal: {option} was not planned as an output"),
                    "this is a bug in ddo, please report it with the command line",
                ));
            };
            let result = temporary(&p.target).and_then(|mut f| {
                f.as_file_mut().write_all(bytes)?;
                f.as_file().sync_all()?;
                Ok(f)
            });
            match result {
                Ok(f) => written.push((f, p)),
                Err(e) => {
                    return Err(CliError::runtime(
                        format!("cannot write {} {}: {e}", p.option, p.path.display()),
                        "nothing was written; free space or name another file",
                    ));
                }
            }
            used[index] = true;
        }
        // A failed rename returns with the rest still in `written`'s iterator: dropped, so
        // removed.
        for (i, (tmp, p)) in written.into_iter().enumerate() {
            before_rename(i);
            if let Err(e) = tmp.persist(&p.target) {
                // `e.file` and the rest are dropped, which removes them.
                return Err(CliError::runtime(
                    format!(
                        "cannot put {} {} in place: {}",
                        p.option,
                        p.path.display(),
                        e.error
                    ),
                    "check the directory's permissions",
                ));
            }
        }
        // The renames are durable once their folders are synced (best effort: not every
        // file system lets a folder be opened for that).
        let mut dirs: Vec<&Path> = self
            .planned
            .iter()
            .filter_map(|p| p.target.parent())
            .collect();
        dirs.dedup();
        for d in dirs {
            if let Ok(f) = fs::File::open(d) {
                let _ = f.sync_all();
            }
        }
        Ok(())
    }
}

/// The files `count` images go to when `out` names them: `out` itself for one image or a
/// `.safetensors` file (which holds the whole batch), else `STEM-0.EXT`, `STEM-1.EXT`, ...
/// beside `out`, one per image, numbered as Diffusers' `images` list is.
pub fn image_paths(out: &Path, count: usize) -> Vec<PathBuf> {
    let batch_file = out
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("safetensors"));
    // A name ending in a separator stays as given, for `Outputs::plan` to refuse.
    let folder = out.as_os_str().as_encoded_bytes().ends_with(b"/");
    if count <= 1 || batch_file || folder {
        return vec![out.to_path_buf()];
    }
    let stem = out
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let ext = out
        .extension()
        .map(|e| format!(".{}", e.to_string_lossy()))
        .unwrap_or_default();
    (0..count)
        .map(|i| out.with_file_name(format!("{stem}-{i}{ext}")))
        .collect()
}

#[cfg(test)]
mod tests;
