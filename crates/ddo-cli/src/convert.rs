//! `ddo convert --compress lossless IN OUT`: a pipeline folder (or one safetensors file)
//! written again with its matrices coded ([`ddo_core::coded_file`]), so `--weights OUT`
//! reads about two thirds of the bytes on a cold start and streams the coded units as they
//! are. Every other file (configs, tokenizers, the shard index) is copied byte for byte.
//!
//! **Safe by construction.** `OUT` must not exist and must not lie inside `IN`. Everything
//! is written under a new, private directory (or file) of a random name beside `OUT`,
//! created exclusively, then renamed to `OUT` without replacing anything that appeared
//! there meanwhile (`renameat2(RENAME_NOREPLACE)`, or a hard link for a file). A failure
//! removes what was written, and so does an interrupt (SIGINT, SIGTERM, SIGHUP:
//! [`crate::interrupt::remove_on_interrupt`]; one during the rename waits for it); the input
//! is only read. Symbolic links in `IN` are read
//! through for files (a Hugging Face snapshot links its files into a blob store) and not
//! followed for folders.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use ddo_core::coded_file::{CodedFileStats, write_coded_safetensors};

use crate::cli::ConvertArgs;
use crate::error::{CliError, CliResult};

/// Runs `ddo convert`.
pub fn convert(args: &ConvertArgs, out: &mut dyn Write) -> CliResult<()> {
    let started = Instant::now();
    let (input, output) = (&args.input, &args.output);
    let meta = std::fs::metadata(input).map_err(|e| {
        CliError::usage(
            format!("cannot read {}: {e}", input.display()),
            "give a pipeline folder or a .safetensors file as IN",
        )
    })?;
    check_output(input, output)?;
    let parent = match output.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let mut stats = CodedFileStats::default();
    let mut lines = Vec::new();
    if meta.is_dir() {
        let temp = tempfile::Builder::new()
            .prefix(".ddo-convert-")
            .tempdir_in(&parent)
            .map_err(|e| cannot_write(&parent, &e))?;
        let _in_progress = crate::interrupt::remove_on_interrupt(temp.path());
        copy_tree(input, temp.path(), Path::new(""), &mut stats, &mut lines)?;
        // An interrupt waits for the rename: OUT is whole or absent, never half-removed.
        let _phase = crate::outputs::output_phase();
        rename_noreplace(temp.path(), output)?;
        // The directory is OUT now; nothing is left to remove.
        let _ = temp.keep();
    } else if meta.is_file() {
        let mut temp = tempfile::Builder::new()
            .prefix(".ddo-convert-")
            .suffix(".safetensors")
            .tempfile_in(&parent)
            .map_err(|e| cannot_write(&parent, &e))?;
        let _in_progress = crate::interrupt::remove_on_interrupt(temp.path());
        let file_stats = convert_file(input, temp.as_file_mut(), output)?;
        lines.push(file_line(Path::new(""), input, &file_stats));
        stats.add(file_stats);
        let _phase = crate::outputs::output_phase();
        temp.persist_noclobber(output).map_err(|e| {
            CliError::runtime(
                format!("cannot create {}: {}", output.display(), e.error),
                "OUT must be a new path: pick another or remove what is there",
            )
        })?;
    } else {
        return Err(CliError::usage(
            format!("{} is neither a folder nor a regular file", input.display()),
            "give a pipeline folder or a .safetensors file as IN",
        ));
    }
    let ratio = stats.written_bytes as f64 / stats.source_bytes.max(1) as f64;
    if args.json {
        let json = serde_json::json!({
            "input": input.display().to_string(),
            "output": output.display().to_string(),
            "tensors": stats.tensors,
            "coded_tensors": stats.coded,
            "source_bytes": stats.source_bytes,
            "written_bytes": stats.written_bytes,
            "ratio": ratio,
            "seconds": started.elapsed().as_secs_f64(),
        });
        return out
            .write_all(format!("{json:#}\n").as_bytes())
            .map_err(|e| CliError::runtime(format!("cannot write: {e}"), ""));
    }
    let mut text = lines.join("");
    text.push_str(&format!(
        "wrote {}: {} of {} tensors coded, {} of safetensors -> {} ({ratio:.3}), {:.1} s\n",
        output.display(),
        stats.coded,
        stats.tensors,
        ddo_metrics::format_bytes(stats.source_bytes),
        ddo_metrics::format_bytes(stats.written_bytes),
        started.elapsed().as_secs_f64()
    ));
    out.write_all(text.as_bytes())
        .map_err(|e| CliError::runtime(format!("cannot write: {e}"), ""))
}

/// `OUT` must be new and outside `IN` (so the conversion never reads what it writes).
fn check_output(input: &Path, output: &Path) -> CliResult<()> {
    if std::fs::symlink_metadata(output).is_ok() {
        return Err(CliError::usage(
            format!("{} exists", output.display()),
            "ddo convert writes a new OUT and never replaces anything: pick another path or remove it",
        ));
    }
    let parent = match output.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let parent = std::fs::canonicalize(parent).map_err(|e| {
        CliError::usage(
            format!("OUT's folder {}: {e}", parent.display()),
            "create the folder OUT goes in first",
        )
    })?;
    let input = std::fs::canonicalize(input)
        .map_err(|e| CliError::usage(format!("cannot read {}: {e}", input.display()), ""))?;
    if parent.starts_with(&input) {
        return Err(CliError::usage(
            format!("{} lies inside {}", output.display(), input.display()),
            "put OUT beside IN, not inside it",
        ));
    }
    Ok(())
}

fn cannot_write(path: &Path, e: &std::io::Error) -> CliError {
    CliError::runtime(
        format!("cannot write in {}: {e}", path.display()),
        "OUT's folder must be writable",
    )
}

/// Converts one safetensors file into `file` (new and empty).
fn convert_file(src: &Path, file: &mut std::fs::File, named: &Path) -> CliResult<CodedFileStats> {
    write_coded_safetensors(src, file, named).map_err(|e| {
        let hint = match &e {
            ddo_core::CoreError::Io { .. } => "OUT's folder must be writable, with room for about two thirds of IN",
            _ => "IN must hold whole, valid safetensors files: download or export the one named again",
        };
        CliError::runtime(format!("ddo convert: {e}"), hint)
    })
}

/// One line per converted file.
fn file_line(rel: &Path, src: &Path, s: &CodedFileStats) -> String {
    let name = if rel.as_os_str().is_empty() {
        src.display().to_string()
    } else {
        rel.display().to_string()
    };
    format!(
        "{name}: {} of {} tensors coded, {} -> {}\n",
        s.coded,
        s.tensors,
        ddo_metrics::format_bytes(s.source_bytes),
        ddo_metrics::format_bytes(s.written_bytes)
    )
}

/// Copies the tree `src` into `dst` (new, empty), converting each `.safetensors` file;
/// `rel` is the path below the top, for the lines. DDO's own coded-unit caches are skipped
/// (`*.ddo-coded`: a coded folder needs none).
fn copy_tree(
    src: &Path,
    dst: &Path,
    rel: &Path,
    stats: &mut CodedFileStats,
    lines: &mut Vec<String>,
) -> CliResult<()> {
    let read =
        |e: std::io::Error| CliError::runtime(format!("cannot read {}: {e}", src.display()), "");
    let mut entries: Vec<_> = std::fs::read_dir(src)
        .map_err(read)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(read)?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let name = entry.file_name();
        let from = entry.path();
        let to = dst.join(&name);
        let rel = rel.join(&name);
        let link = entry.file_type().map_err(read)?.is_symlink();
        let meta = std::fs::metadata(&from)
            .map_err(|e| CliError::runtime(format!("cannot read {}: {e}", from.display()), ""))?;
        if meta.is_dir() {
            if link {
                return Err(CliError::usage(
                    format!("{} is a link to a folder", from.display()),
                    "ddo convert follows links to files only: copy the folder in its place first",
                ));
            }
            std::fs::create_dir(&to).map_err(|e| cannot_write(dst, &e))?;
            copy_tree(&from, &to, &rel, stats, lines)?;
        } else if name.to_string_lossy().ends_with(".ddo-coded") {
            continue;
        } else if name.to_string_lossy().ends_with(".safetensors") {
            let mut file = std::fs::File::create_new(&to).map_err(|e| cannot_write(dst, &e))?;
            let s = convert_file(&from, &mut file, &to)?;
            lines.push(file_line(&rel, &from, &s));
            stats.add(s);
        } else if meta.is_file() {
            let mut reader = ddo_core::host_memory::open_regular(&from).map_err(|e| {
                let why = match e {
                    ddo_core::host_memory::NotRegular::Io(e) => e.to_string(),
                    ddo_core::host_memory::NotRegular::Is(what) => format!("it is {what}"),
                };
                CliError::runtime(format!("cannot read {}: {why}", from.display()), "")
            })?;
            let mut file = std::fs::File::create_new(&to).map_err(|e| cannot_write(dst, &e))?;
            std::io::copy(&mut reader, &mut file).map_err(|e| cannot_write(dst, &e))?;
        } else {
            return Err(CliError::usage(
                format!("{} is not a regular file or folder", from.display()),
                "remove it from IN or copy IN without it",
            ));
        }
    }
    Ok(())
}

/// Renames the finished folder `from` to `to`, never replacing what is at `to`.
fn rename_noreplace(from: &Path, to: &Path) -> CliResult<()> {
    ddo_core::host_memory::rename_noreplace(from, to).map_err(|e| {
        CliError::runtime(
            format!("cannot create {}: {e}", to.display()),
            "OUT must be a new path: pick another or remove what is there",
        )
    })
}
