//! The `DDO_*` variables as the commands read them (issue 34): a variable set to bytes that
//! are not UTF-8 is refused — exit status 2, one line naming the variable — never taken
//! for unset; one the command line hides (`--preset` hides `DDO_PRESET`, `--no-env` all of
//! them) is not read; the refusal's hint names `--no-env` as the option of a command.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::process::{Command, Output};

/// `ddo args` with the caller's `DDO_*` variables removed and `var` set to `value`'s
/// bytes.
fn ddo_with_raw(args: &[&str], var: &str, value: &[u8]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ddo"));
    cmd.args(args);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("DDO_") {
            cmd.env_remove(k);
        }
    }
    cmd.env(var, OsString::from_vec(value.to_vec()));
    cmd.output().expect("run ddo")
}

/// Latin-1 "café": not UTF-8.
const NOT_UTF8: &[u8] = b"caf\xe9";

#[test]
fn a_ddo_variable_that_is_not_utf8_is_refused_naming_it() {
    for (var, args) in [
        ("DDO_PRESET", &["resolve"][..]),
        ("DDO_PRESET", &["resolve", "--config", "tiny"]),
        ("DDO_VAE_ROUTE", &["resolve", "--component", "vae"]),
        ("DDO_TRANSFORMER_ROUTE", &["resolve", "--config", "tiny"]),
    ] {
        let o = ddo_with_raw(args, var, NOT_UTF8);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{var} for ddo {args:?}: {err}");
        assert!(
            o.stdout.is_empty(),
            "{var} for ddo {args:?} printed a result"
        );
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.contains(&format!("environment variable {var}=")) && err.contains("UTF-8"),
            "{var} for ddo {args:?}: {err}"
        );
        // The way out is an option of the command that reads the environment.
        assert!(err.contains("resolve ... --no-env"), "{err}");
        assert!(!err.contains("`ddo --no-env`"), "{err}");
    }
}

#[test]
fn a_variable_the_command_line_hides_is_not_read() {
    for (var, args) in [
        ("DDO_PRESET", &["resolve", "--no-env"][..]),
        ("DDO_PRESET", &["resolve", "--preset", "low_ram_safe"]),
        ("DDO_VAE_ROUTE", &["resolve", "--route", "vae=none"]),
    ] {
        let o = ddo_with_raw(args, var, NOT_UTF8);
        assert_eq!(
            o.status.code(),
            Some(0),
            "{var} for ddo {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}
