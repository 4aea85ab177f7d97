//! Unit tests of [`super`]: inputs by any name, names that are not files, exclusive random
//! temporary files, all-or-none commits and the removal of stale temporary files.

use super::*;

struct Dir(PathBuf);

impl Dir {
    fn new(tag: &str) -> Self {
        let d = std::env::temp_dir().join(format!("ddo-outputs-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        Self(fs::canonicalize(&d).unwrap())
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

fn refused(outputs: &[(&'static str, &Path)], inputs: &Inputs) -> String {
    Outputs::plan(outputs, inputs).unwrap_err().to_string()
}

#[test]
fn an_empty_input_path_is_the_current_folder() {
    let cwd = std::env::current_dir().unwrap();
    let inside = cwd.join("Cargo.toml");
    let err = refused(
        &[("--out", &inside)],
        &Inputs::of(&[("--weights", Path::new(""))]),
    );
    assert!(err.contains("writing it would destroy an input"), "{err}");
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
    let inputs = Inputs::of(&[
        ("--weights", weights.as_path()),
        ("--latents", latents.as_path()),
    ]);
    // The checkpoint inside the folder, the latents file, a path that walks back to it.
    let back = weights.join("..").join("l.safetensors");
    for out in [ckpt.as_path(), latents.as_path(), back.as_path()] {
        let err = refused(&[("--out", out)], &inputs);
        assert!(err.contains("destroy an input"), "{err}");
    }
    let img = d.0.join("img.safetensors");
    let err = refused(&[("--out", &img), ("--save-latents", &img)], &inputs);
    assert!(err.contains("name the same file"), "{err}");
    let err = refused(&[("--out", &d.0.join("nope").join("x.png"))], &inputs);
    assert!(err.contains("cannot be used"), "{err}");
    let err = refused(&[("--out", &weights)], &Inputs::default());
    assert!(err.contains("not a regular file"), "{err}");
    assert_eq!(fs::read(&ckpt).unwrap(), b"weights");
    assert_eq!(fs::read(&latents).unwrap(), b"latents");
    assert!(!img.exists());
}

/// Issue 34, item 1: the single-file options are inputs like the folder, by any name.
#[test]
fn single_file_inputs_are_refused_as_outputs_by_any_name() {
    let d = Dir::new("single");
    let sub = d.0.join("s");
    fs::create_dir(&sub).unwrap();
    let tr = sub.join("tr.safetensors");
    fs::write(&tr, b"transformer").unwrap();
    let vae = d.0.join("ae.safetensors");
    fs::write(&vae, b"vae").unwrap();
    let inputs = Inputs::of(&[("--transformer", tr.as_path()), ("--vae", vae.as_path())]);
    let dotted = sub.join("..").join("s").join("tr.safetensors");
    for (option, out) in [
        ("--out", tr.as_path()),
        ("--out", dotted.as_path()),
        ("--save-latents", vae.as_path()),
        ("--out-json", tr.as_path()),
    ] {
        let err = refused(&[(option, out)], &inputs);
        assert!(err.contains("destroy an input"), "{option} {out:?}: {err}");
        assert!(
            err.contains("--transformer") || err.contains("--vae"),
            "{err}"
        );
    }
    #[cfg(unix)]
    {
        // A hard link to an input and an input given through a link.
        let hard = d.0.join("hard.safetensors");
        fs::hard_link(&tr, &hard).unwrap();
        let err = refused(&[("--out", &hard)], &inputs);
        assert!(err.contains("same file"), "{err}");
        let link = d.0.join("link.safetensors");
        std::os::unix::fs::symlink(&vae, &link).unwrap();
        let through = Inputs::of(&[("--vae", link.as_path())]);
        let err = refused(&[("--out", &vae)], &through);
        assert!(err.contains("destroy an input"), "{err}");
    }
    assert_eq!(fs::read(&tr).unwrap(), b"transformer");
    assert_eq!(fs::read(&vae).unwrap(), b"vae");
}

/// A Hugging Face snapshot: the folder's files are links to blobs outside it, which are
/// inputs as much as the links.
#[cfg(unix)]
#[test]
fn files_that_links_inside_an_input_folder_lead_to_are_inputs() {
    let d = Dir::new("snapshot");
    let blobs = d.0.join("blobs");
    fs::create_dir(&blobs).unwrap();
    let blob = blobs.join("0123abcd");
    fs::write(&blob, b"weights").unwrap();
    let linked_dir = d.0.join("elsewhere");
    fs::create_dir(&linked_dir).unwrap();
    let snap = d.0.join("snapshots").join("main");
    fs::create_dir_all(snap.join("vae")).unwrap();
    std::os::unix::fs::symlink(&blob, snap.join("vae").join("model.safetensors")).unwrap();
    std::os::unix::fs::symlink(&linked_dir, snap.join("tokenizer")).unwrap();
    let inputs = Inputs::of(&[("--weights", snap.as_path())]);
    let err = refused(&[("--out", &blob)], &inputs);
    assert!(
        err.contains("same file") && err.contains("--weights"),
        "{err}"
    );
    let err = refused(&[("--out", &linked_dir.join("new.png"))], &inputs);
    assert!(err.contains("inside the folder"), "{err}");
    Outputs::plan(&[("--out", &blobs.join("other.png"))], &inputs).unwrap();
    assert_eq!(fs::read(&blob).unwrap(), b"weights");
}

/// The odd outputs of issue 34: names that are folders, devices, links.
#[test]
fn outputs_that_do_not_name_a_regular_file_are_refused() {
    let d = Dir::new("odd");
    let none = Inputs::default();
    let with_slash = PathBuf::from(format!("{}/x.png/", d.0.display()));
    let err = refused(&[("--out", &with_slash)], &none);
    assert!(err.contains("separator"), "{err}");
    let err = refused(&[("--out", Path::new(""))], &none);
    assert!(err.contains("empty path"), "{err}");
    let err = refused(&[("--out", &d.0.join(".."))], &none);
    assert!(err.contains("names a folder"), "{err}");
    assert_eq!(
        image_paths(&with_slash, 3),
        std::slice::from_ref(&with_slash),
        "a folder name is not numbered into files"
    );
    #[cfg(target_os = "linux")]
    {
        let err = refused(&[("--plot", Path::new("/dev/null.svg"))], &none);
        assert!(err.contains("devices"), "{err}");
        let err = refused(&[("--out", Path::new("/dev/null"))], &none);
        assert!(err.contains("devices"), "{err}");
        // A link at the output, wherever it leads, is never written through.
        let victim = d.0.join("stdout-file.txt");
        fs::write(&victim, b"redirected output").unwrap();
        let link = d.0.join("o.png");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let err = refused(&[("--out", &link)], &none);
        assert!(err.contains("symbolic link"), "{err}");
        let stdout_link = d.0.join("o2.png");
        std::os::unix::fs::symlink("/dev/stdout", &stdout_link).unwrap();
        let err = refused(&[("--out", &stdout_link)], &none);
        assert!(err.contains("symbolic link"), "{err}");
        assert_eq!(fs::read(&victim).unwrap(), b"redirected output");
    }
    assert_eq!(
        files_in(&d.0)
            .iter()
            .filter(|n| n.ends_with(".tmp"))
            .count(),
        0
    );
}

/// Issue 34, item 2: a link planted at the temporary name of earlier versions (and any
/// other name in the folder) never has its target truncated.
#[cfg(unix)]
#[test]
fn temporary_files_never_follow_a_planted_link() {
    let d = Dir::new("planted");
    let victim = d.0.join("v.txt");
    fs::write(&victim, b"precious").unwrap();
    let out = d.0.join("o.png");
    let old_name = d.0.join(format!(".o.png.ddo-{}.tmp", std::process::id()));
    std::os::unix::fs::symlink(&victim, &old_name).unwrap();
    let plan = Outputs::plan(&[("--out", &out)], &Inputs::default()).unwrap();
    plan.commit(&[("--out", b"image".to_vec())]).unwrap();
    assert_eq!(fs::read(&out).unwrap(), b"image");
    assert_eq!(fs::read(&victim).unwrap(), b"precious");
    assert!(
        fs::symlink_metadata(&old_name)
            .unwrap()
            .file_type()
            .is_symlink()
    );
    // Two temporary files for one target never share a name.
    let a = temporary(&out).unwrap();
    let b = temporary(&out).unwrap();
    assert_ne!(a.path(), b.path());
    let name = a.path().file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with(&format!(".o.png.ddo-{}-", std::process::id())) && name.ends_with(".tmp"),
        "{name}"
    );
}

#[test]
fn outputs_are_written_whole_or_not_at_all() {
    let d = Dir::new("commit");
    let other = Dir::new("commit-other");
    let out = d.0.join("img.png");
    let lat = other.0.join("lat.safetensors");
    fs::write(&out, b"previous image").unwrap();
    let plan = Outputs::plan(
        &[("--out", &out), ("--save-latents", &lat)],
        &Inputs::default(),
    )
    .unwrap();
    assert_eq!(files_in(&d.0), ["img.png"], "the probe leaves nothing");
    plan.commit(&[
        ("--out", b"new image".to_vec()),
        ("--save-latents", b"lat".to_vec()),
    ])
    .unwrap();
    assert_eq!(fs::read(&out).unwrap(), b"new image");
    assert_eq!(fs::read(&lat).unwrap(), b"lat");
    // A failed write of the second output (its folder went away): the first is not put in
    // place either, and no temporary file is left.
    let plan = Outputs::plan(
        &[("--out", &out), ("--save-latents", &lat)],
        &Inputs::default(),
    )
    .unwrap();
    fs::remove_dir_all(&other.0).unwrap();
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
    assert_eq!(files_in(&d.0), ["img.png"], "no temporary file is left");
}

/// Temporary files of a process killed before it cleaned up go with the next command that
/// writes the same target; those of live processes, other targets and links stay.
#[cfg(target_os = "linux")]
#[test]
fn stale_temporary_files_of_dead_processes_are_removed() {
    let d = Dir::new("stale");
    let out = d.0.join("o.png");
    // No process has a pid this large (pid_max is at most 2^22).
    let dead = d.0.join(".o.png.ddo-99999999-AbCdEf12.tmp");
    let dead_old = d.0.join(".o.png.ddo-99999998.tmp");
    let live =
        d.0.join(format!(".o.png.ddo-{}-zz.tmp", std::process::id()));
    let init = d.0.join(".o.png.ddo-1-x.tmp");
    let other_target = d.0.join(".p.png.ddo-99999999-x.tmp");
    let linked = d.0.join(".o.png.ddo-99999997-l.tmp");
    for p in [&dead, &dead_old, &live, &init, &other_target] {
        fs::write(p, b"partial").unwrap();
    }
    std::os::unix::fs::symlink(&out, &linked).unwrap();
    Outputs::plan(&[("--out", &out)], &Inputs::default()).unwrap();
    assert!(!dead.exists() && !dead_old.exists());
    for p in [&live, &init, &other_target] {
        assert!(p.exists(), "{p:?} was removed");
    }
    assert!(fs::symlink_metadata(&linked).is_ok(), "a link is not ours");
}
