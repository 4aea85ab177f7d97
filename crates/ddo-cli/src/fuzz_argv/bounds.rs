//! Keeping an argv cheap and off the GPU ([`bounded`]): CUDA devices become `cpu`, counts
//! of work and image sides stay small (or are ones the command must refuse), and the
//! sizes and counts an argv does not give are added small.

use super::vocab::{Given, specs};
use crate::setup::DeviceChoice;

/// The largest `--height`/`--width` a computing command (`run`, `bench`) keeps as given;
/// larger ones are lowered to it unless the image is past [`HUGE_AREA`].
pub const SMALL_SIDE: u128 = 16;

/// Pixels from which an image is kept as given (with a budget of at most
/// [`LARGE_SIZE_BUDGET`]): 2^40, whose transformer activations alone are hundreds of GiB.
pub const HUGE_AREA: u128 = 1 << 40;

/// The most `--vram-budget` an image past [`SMALL_SIDE`] runs under (12 GiB): the memory
/// plan must refuse it, where a larger budget would let it allocate.
pub const LARGE_SIZE_BUDGET: u64 = 12 << 30;

/// Values of loop counts (`--steps`, `--num-images`) from which a count is kept as given: no
/// host schedules or runs 2^40 of anything, so it must be refused.
pub const HUGE_COUNT: u128 = 1 << 40;

/// A count as `usize::from_str` would read it (`+` allowed), if it is one.
fn count(v: &str) -> Option<u128> {
    v.parse::<u128>().ok()
}

/// The values of option `name` in `argv` (after `--name` and in `--name=value`), as mutable
/// strings. Conservative: a `--name` that is really another option's value counts too.
fn values_of<'a>(argv: &'a mut [String], name: &str) -> Vec<&'a mut String> {
    let flag = format!("--{name}");
    let prefix = format!("--{name}=");
    let mut follows = vec![false; argv.len()];
    for i in 1..argv.len() {
        follows[i] = argv[i - 1] == flag;
    }
    let mut out = Vec::new();
    for (i, a) in argv.iter_mut().enumerate() {
        if follows[i] || a.starts_with(&prefix) {
            out.push(a);
        }
    }
    out
}

/// The value in `s`: after the `=` of `--name=value`, else all of it.
fn value_part(s: &str) -> &str {
    match s.strip_prefix("--").and_then(|b| b.split_once('=')) {
        Some((_, v)) => v,
        None => s,
    }
}

/// Rewrites `s` (a whole value, or `--name=value`) with `f` applied to the value part.
fn rewrite(s: &mut String, f: impl Fn(&str) -> Option<String>) {
    let (head, v) = match s.strip_prefix("--").and_then(|b| b.split_once('=')) {
        Some((n, v)) => (format!("--{n}="), v.to_string()),
        None => (String::new(), s.clone()),
    };
    if let Some(new) = f(&v) {
        *s = head + &new;
    }
}

/// The options whose values count work (`(name, limit, refused)`): a value above `limit` and
/// below `refused` is lowered to `limit`; from `refused` on the command must refuse it
/// (`--max-sequence-length` above 512, loop counts no host runs, `ddo bench`'s
/// `MAX_FORWARDS`).
const WORK_COUNTS: [(&str, u128, u128); 5] = [
    ("steps", 2, HUGE_COUNT),
    ("repeats", 2, crate::bench::MAX_FORWARDS as u128 + 1),
    ("warmup", 1, crate::bench::MAX_FORWARDS as u128 + 1),
    ("num-images", 2, HUGE_COUNT),
    (
        "max-sequence-length",
        32,
        crate::run::MAX_SEQUENCE_LENGTH as u128 + 1,
    ),
];

/// The components `ddo bench` runs on the text length, 512 tokens for a pipeline folder.
const LONG_TEXT_COMPONENTS: [&str; 2] = ["transformer", "text_encoder_2"];

/// Keeps an argv cheap and off the GPU (see the module documentation):
/// - every value or `--x=value` naming a CUDA device becomes `cpu`;
/// - for `run` and `bench`: a count of work (`WORK_COUNTS`) above its small limit and below
///   the values the command refuses is lowered to the limit; `--height`/`--width` above [`SMALL_SIDE`] are
///   lowered to it unless the image reaches [`HUGE_AREA`] pixels, and then every
///   `--vram-budget` above [`LARGE_SIZE_BUDGET`] is lowered to it; the sizes and counts the
///   argv does not give are added small;
/// - `bench --weights` times the VAE or CLIP (`LONG_TEXT_COMPONENTS` become `vae`).
pub fn bounded(mut argv: Vec<String>) -> Vec<String> {
    for a in argv.iter_mut() {
        rewrite(a, |v| {
            // Only a value starting `cuda` parses as a CUDA device; the others are not
            // parsed (the error message `parse` builds is costly for long values).
            (v.starts_with("cuda") && matches!(DeviceChoice::parse(v), Ok(DeviceChoice::Cuda(_))))
                .then(|| "cpu".into())
        });
    }
    let command = argv.first().cloned().unwrap_or_default();
    if command != "run" && command != "bench" {
        return argv;
    }
    for (name, limit, refused) in WORK_COUNTS {
        for v in values_of(&mut argv, name) {
            rewrite(v, |v| {
                count(v)
                    .filter(|n| *n > limit && *n < refused)
                    .map(|_| limit.to_string())
            });
        }
    }
    let side = |argv: &mut Vec<String>, name: &str| -> u128 {
        values_of(argv, name)
            .iter()
            .filter_map(|v| count(value_part(v)))
            .max()
            .unwrap_or(SMALL_SIDE)
    };
    let (h, w) = (side(&mut argv, "height"), side(&mut argv, "width"));
    if h.max(w) > SMALL_SIDE {
        if h.saturating_mul(w) >= HUGE_AREA {
            for v in values_of(&mut argv, "vram-budget") {
                rewrite(v, |v| {
                    ddo_core::config::parse_size("vram-budget", v)
                        .ok()
                        .filter(|b| *b > LARGE_SIZE_BUDGET)
                        .map(|_| "12GiB".into())
                });
            }
        } else {
            for name in ["height", "width"] {
                for v in values_of(&mut argv, name) {
                    rewrite(v, |v| {
                        count(v)
                            .filter(|n| *n > SMALL_SIDE)
                            .map(|_| SMALL_SIDE.to_string())
                    });
                }
            }
        }
    }
    // `ddo bench` of a pipeline folder's transformer or T5 works on 512 text tokens (a
    // folder's `max_sequence_length`, which bench cannot lower): its VAE and CLIP are timed.
    let folder = !values_of(&mut argv, "weights").is_empty();
    if command == "bench" && folder {
        for v in values_of(&mut argv, "component") {
            rewrite(v, |v| {
                LONG_TEXT_COMPONENTS.contains(&v).then(|| "vae".into())
            });
        }
    }
    // What the argv leaves at a default is added small, when the parse is known to hold.
    if let Some(parsed) = Given::of(&argv) {
        let defaults: &[(&str, &str)] = if command == "run" {
            &[
                ("steps", "1"),
                ("height", "16"),
                ("width", "16"),
                ("max-sequence-length", "8"),
            ]
        } else {
            &[
                ("repeats", "1"),
                ("warmup", "0"),
                ("height", "16"),
                ("width", "16"),
            ]
        };
        for (name, v) in defaults {
            if parsed.get(name).is_none() && specs(&command).iter().any(|s| s.name == *name) {
                argv.push(format!("--{name}={v}"));
            }
        }
        if command == "bench"
            && parsed.get("weights").is_some()
            && parsed.get("component").is_none()
        {
            argv.push("--component=vae".into());
        }
    }
    if within_bounds(&argv) {
        argv
    } else {
        vec!["help".into()]
    }
}

/// Whether `argv`, as the command parses it, keeps the bounds [`bounded`] sets: no CUDA
/// device, and for `run`/`bench` small counts of work and images (or ones it refuses).
fn within_bounds(argv: &[String]) -> bool {
    let Some(command) = argv.first() else {
        return true;
    };
    let Some(parsed) = Given::of(argv) else {
        return true;
    };
    if parsed
        .get("device")
        .is_some_and(|d| matches!(DeviceChoice::parse(d), Ok(DeviceChoice::Cuda(_))))
    {
        return false;
    }
    if command != "run" && command != "bench" {
        return true;
    }
    if command == "bench"
        && parsed.get("weights").is_some()
        && parsed
            .get("component")
            .is_none_or(|c| LONG_TEXT_COMPONENTS.contains(&c))
    {
        return false;
    }
    let number = |name: &str| parsed.get(name).and_then(|v| v.parse::<usize>().ok());
    for (name, limit, refused) in WORK_COUNTS {
        if number(name).is_some_and(|n| n as u128 > limit && (n as u128) < refused) {
            return false;
        }
    }
    let (h, w) = (number("height"), number("width"));
    let (Some(h), Some(w)) = (h, w) else {
        // A side that does not parse is refused before any work.
        return true;
    };
    let (h, w) = (h as u128, w as u128);
    if h.max(w) <= SMALL_SIDE {
        return true;
    }
    let budget = parsed
        .get("vram-budget")
        .and_then(|b| ddo_core::config::parse_size("vram-budget", b).ok());
    h.saturating_mul(w) >= HUGE_AREA && budget.is_none_or(|b| b <= LARGE_SIZE_BUDGET)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_never_survives_and_work_stays_small() {
        let argv = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let b = bounded(argv(&[
            "run",
            "--device",
            "cuda:0",
            "--device=cuda",
            "cuda:3",
            "--steps",
            "1000",
            "--height=4096",
            "--width",
            "8",
        ]));
        assert!(!b.iter().any(|a| a.contains("cuda")), "{b:?}");
        assert!(b.contains(&"1".into()) || b.contains(&"2".into()), "{b:?}");
        assert!(b.contains(&"--height=16".to_string()), "{b:?}");
        let b = bounded(argv(&[
            "run",
            "--config",
            "tiny",
            "--height",
            "4294967296",
            "--width",
            "4294967296",
            "--vram-budget",
            "18446744073709551615",
        ]));
        assert!(b.contains(&"12GiB".to_string()), "{b:?}");
        assert!(b.contains(&"--steps=1".to_string()), "{b:?}");
        let b = bounded(argv(&["bench", "--config", "tiny"]));
        for o in ["--repeats=1", "--warmup=0", "--height=16", "--width=16"] {
            assert!(b.contains(&o.to_string()), "{b:?}");
        }
    }
}
