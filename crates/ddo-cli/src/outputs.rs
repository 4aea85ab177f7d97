//! The files a command writes, checked before any work and written whole: an output never
//! names an input (the same file, a file inside an input folder, or a link to either), two
//! outputs never name the same file, an output's directory must exist and take a new file,
//! and the bytes go to a temporary file beside the target that is renamed into place only
//! when every output of the command was written — so a failed write (disk full, a file size
//! limit) leaves every previous file as it was and no partial one.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{CliError, CliResult};

/// One planned output: the option that named it, the path as given and where it resolves.
#[derive(Debug, Clone)]
struct Planned {
    option: &'static str,
    path: PathBuf,
    resolved: PathBuf,
}

/// The checked outputs of one command ([`Outputs::plan`]), written by [`Outputs::commit`].
#[derive(Debug, Clone, Default)]
pub struct Outputs {
    planned: Vec<Planned>,
}

/// Where `path` points once every link on the way is followed: the file itself when it
/// exists, else its canonical directory joined with its name.
fn resolve(option: &str, path: &Path) -> CliResult<PathBuf> {
    if let Ok(p) = fs::canonicalize(path) {
        return Ok(p);
    }
    let name = path.file_name().ok_or_else(|| {
        CliError::usage(
            format!("{option} {}: not a file name", path.display()),
            "name a file, e.g. out/image.png",
        )
    })?;
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
    Ok(dir.join(name))
}

/// The files `count` images go to when `out` names them: `out` itself for one image or a
/// `.safetensors` file (which holds the whole batch), else `STEM-0.EXT`, `STEM-1.EXT`, ...
/// beside `out`, one per image, numbered as Diffusers' `images` list is.
pub fn image_paths(out: &Path, count: usize) -> Vec<PathBuf> {
    let batch_file = out
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("safetensors"));
    if count <= 1 || batch_file {
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

/// A temporary name beside `target` for this process.
fn temporary(target: &Path) -> PathBuf {
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    target.with_file_name(format!(".{name}.ddo-{}.tmp", std::process::id()))
}

impl Outputs {
    /// Checks `outputs` (`(option, path)`) against each other and against `inputs` (the
    /// files and folders the command reads), and that each can be written: the target, if it
    /// exists, is a regular file, and its directory takes a new file (probed by creating and
    /// removing a temporary one). Nothing else is touched.
    pub fn plan(
        outputs: &[(&'static str, &Path)],
        inputs: &[(&'static str, &Path)],
    ) -> CliResult<Self> {
        let inputs: Vec<(&str, PathBuf)> = inputs
            .iter()
            // An empty path is the current folder to the loaders that read it.
            .filter_map(|(o, p)| {
                let p = if p.as_os_str().is_empty() {
                    Path::new(".")
                } else {
                    p
                };
                fs::canonicalize(p).ok().map(|c| (*o, c))
            })
            .collect();
        let mut planned: Vec<Planned> = Vec::with_capacity(outputs.len());
        for (option, path) in outputs {
            let resolved = resolve(option, path)?;
            if let Ok(meta) = fs::metadata(&resolved)
                && !meta.is_file()
            {
                return Err(CliError::usage(
                    format!(
                        "{option} {}: exists and is not a regular file",
                        path.display()
                    ),
                    "name a new file or a regular file to replace",
                ));
            }
            for (input_option, input) in &inputs {
                if resolved == *input || resolved.starts_with(input) {
                    let how = if resolved == *input {
                        "is the file"
                    } else {
                        "is inside the folder"
                    };
                    return Err(CliError::usage(
                        format!(
                            "{option} {} {how} given to {input_option} ({}): writing it would destroy an input",
                            path.display(),
                            input.display()
                        ),
                        format!("give {option} a path outside every input"),
                    ));
                }
            }
            if let Some(other) = planned.iter().find(|p| p.resolved == resolved) {
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
            // The directory must take a new file now, not after the work is done.
            let probe = temporary(&resolved);
            fs::File::create(&probe)
                .and_then(|_| fs::remove_file(&probe))
                .map_err(|e| {
                    CliError::runtime(
                        format!("{option} {}: cannot write there: {e}", path.display()),
                        "check that the directory exists and is writable",
                    )
                })?;
            planned.push(Planned {
                option,
                path: path.to_path_buf(),
                resolved,
            });
        }
        Ok(Self { planned })
    }

    /// Writes `data` (`(option, bytes)`, one for each planned output that is written; the
    /// others are left alone) to temporary files beside the targets, then renames them into
    /// place. An option planned several times (`--out` for each image) takes its data in the
    /// order it was planned. A failure before the renames removes the temporary files and
    /// leaves every target as it was.
    pub fn commit(&self, data: &[(&'static str, Vec<u8>)]) -> CliResult<()> {
        let mut written: Vec<(PathBuf, &Planned)> = Vec::new();
        let cleanup = |written: &[(PathBuf, &Planned)]| {
            for (tmp, _) in written {
                let _ = fs::remove_file(tmp);
            }
        };
        let mut used = vec![false; self.planned.len()];
        for (option, bytes) in data {
            let next = self
                .planned
                .iter()
                .enumerate()
                .find(|(i, p)| p.option == *option && !used[*i]);
            let Some((index, p)) = next else {
                cleanup(&written);
                return Err(CliError::runtime(
                    format!("internal: {option} was not planned as an output"),
                    "",
                ));
            };
            let tmp = temporary(&p.resolved);
            let result = fs::File::create(&tmp).and_then(|mut f| {
                f.write_all(bytes)?;
                f.sync_all()
            });
            if let Err(e) = result {
                let _ = fs::remove_file(&tmp);
                cleanup(&written);
                return Err(CliError::runtime(
                    format!("cannot write {} {}: {e}", p.option, p.path.display()),
                    "nothing was written; free space or name another file",
                ));
            }
            used[index] = true;
            written.push((tmp, p));
        }
        for (i, (tmp, p)) in written.iter().enumerate() {
            if let Err(e) = fs::rename(tmp, &p.resolved) {
                cleanup(&written[i..]);
                return Err(CliError::runtime(
                    format!("cannot put {} {} in place: {e}", p.option, p.path.display()),
                    "check the directory's permissions",
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_input_path_is_the_current_folder() {
        let cwd = std::env::current_dir().unwrap();
        let inside = cwd.join("Cargo.toml");
        let err = Outputs::plan(&[("--out", &inside)], &[("--weights", Path::new(""))])
            .unwrap_err()
            .to_string();
        assert!(err.contains("writing it would destroy an input"), "{err}");
    }

    struct Dir(PathBuf);

    impl Dir {
        fn new(tag: &str) -> Self {
            let d = std::env::temp_dir().join(format!("ddo-outputs-{tag}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&d);
            fs::create_dir_all(&d).unwrap();
            Self(d)
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn files_in(d: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn an_output_that_names_an_input_or_another_output_is_refused_before_any_write() {
        let d = Dir::new("inputs");
        let weights = d.0.join("vae");
        fs::create_dir_all(&weights).unwrap();
        let ckpt = weights.join("diffusion_pytorch_model.safetensors");
        fs::write(&ckpt, b"weights").unwrap();
        let latents = d.0.join("l.safetensors");
        fs::write(&latents, b"latents").unwrap();
        let inputs = [
            ("--weights", weights.as_path()),
            ("--latents", latents.as_path()),
        ];
        // The checkpoint inside the folder, the latents file, a path that walks back to it.
        let back = weights.join("..").join("l.safetensors");
        for out in [ckpt.as_path(), latents.as_path(), back.as_path()] {
            let err = Outputs::plan(&[("--out", out)], &inputs).unwrap_err();
            assert!(err.to_string().contains("destroy an input"), "{err}");
        }
        #[cfg(unix)]
        {
            let link = d.0.join("link.safetensors");
            std::os::unix::fs::symlink(&latents, &link).unwrap();
            let err = Outputs::plan(&[("--out", &link)], &inputs).unwrap_err();
            assert!(err.to_string().contains("destroy an input"), "{err}");
        }
        let img = d.0.join("img.safetensors");
        let err = Outputs::plan(&[("--out", &img), ("--save-latents", &img)], &inputs).unwrap_err();
        assert!(err.to_string().contains("name the same file"), "{err}");
        let err =
            Outputs::plan(&[("--out", &d.0.join("nope").join("x.png"))], &inputs).unwrap_err();
        assert!(err.to_string().contains("cannot be used"), "{err}");
        let err = Outputs::plan(&[("--out", &weights)], &[]).unwrap_err();
        assert!(err.to_string().contains("not a regular file"), "{err}");
        assert_eq!(fs::read(&ckpt).unwrap(), b"weights");
        assert_eq!(fs::read(&latents).unwrap(), b"latents");
        assert!(!img.exists());
    }

    #[test]
    fn outputs_are_written_whole_or_not_at_all() {
        let d = Dir::new("commit");
        let out = d.0.join("img.png");
        let lat = d.0.join("lat.safetensors");
        fs::write(&out, b"previous image").unwrap();
        let plan = Outputs::plan(&[("--out", &out), ("--save-latents", &lat)], &[]).unwrap();
        assert_eq!(files_in(&d.0), ["img.png"], "the probe leaves nothing");
        plan.commit(&[
            ("--out", b"new image".to_vec()),
            ("--save-latents", b"lat".to_vec()),
        ])
        .unwrap();
        assert_eq!(fs::read(&out).unwrap(), b"new image");
        assert_eq!(fs::read(&lat).unwrap(), b"lat");
        assert_eq!(files_in(&d.0), ["img.png", "lat.safetensors"]);
        // A failed write of the second output: the first is not put in place either.
        let plan = Outputs::plan(&[("--out", &out), ("--save-latents", &lat)], &[]).unwrap();
        fs::remove_file(&lat).unwrap();
        fs::create_dir(temporary(&d.0.join("lat.safetensors"))).unwrap();
        let err = plan
            .commit(&[
                ("--out", b"newer".to_vec()),
                ("--save-latents", b"x".to_vec()),
            ])
            .unwrap_err();
        assert!(err.to_string().contains("nothing was written"), "{err}");
        assert_eq!(
            fs::read(&out).unwrap(),
            b"new image",
            "the previous file stands"
        );
        fs::remove_dir(temporary(&d.0.join("lat.safetensors"))).unwrap();
        assert_eq!(files_in(&d.0), ["img.png"], "no temporary file is left");
    }
}
