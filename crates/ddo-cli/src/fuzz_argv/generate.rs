//! Fuzz bytes to an argv ([`argv_from_bytes`]), and back ([`encode`], how the committed
//! seeds are written).

use super::bounds::bounded;
use super::vocab::{
    ALL_KINDS, COMMAND_WORDS, COMPONENTS, COUNTS, Kind, PATHS, ROUTE_IDS, ROUTE_KEYS, ROUTE_WORDS,
    SIZES, VERSIONS, dictionary, kind_of, specs,
};

/// The most argv elements (after the command) one input makes.
pub const MAX_TOKENS: usize = 24;

/// The fuzz bytes, read front to back; past the end every byte is 0.
struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn done(&self) -> bool {
        self.pos >= self.data.len()
    }

    fn byte(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos = (self.pos + 1).min(self.data.len());
        b
    }

    fn pick<'s>(&mut self, items: &[&'s str]) -> &'s str {
        items[self.byte() as usize % items.len()]
    }

    /// A length byte, then that many bytes as lossy UTF-8, kept inside the working
    /// directory ([`contained`]).
    fn raw(&mut self) -> String {
        let len = self.byte() as usize;
        let end = (self.pos + len).min(self.data.len());
        let s = String::from_utf8_lossy(&self.data[self.pos..end]).into_owned();
        self.pos = end;
        contained(&s)
    }
}

/// `s` without `/`, `\` and leading `~`, and `..` alone renamed: as a path it names an
/// entry of the working directory (or the directory itself), nothing above it.
pub fn contained(s: &str) -> String {
    let t: String = s.chars().filter(|c| *c != '/' && *c != '\\').collect();
    let t = t.trim_start_matches('~');
    if t == ".." {
        "dotdot".to_string()
    } else {
        t.to_string()
    }
}

/// A long value: thousands of ASCII, accented, emoji or digit characters.
fn long(n: u8) -> String {
    match n % 4 {
        0 => "x".repeat(10_000),
        1 => "\u{e9}".repeat(3_000),
        2 => "\u{1f980}".repeat(1_000),
        _ => "9".repeat(5_000),
    }
}

/// Whether the random weights of full-size config `name` (`flux-dev`, `qwen-image`; at 2
/// bytes a parameter) are more than this host has available, so `ddo` refuses to build them
/// before allocating.
fn full_size_is_refused(name: &str) -> bool {
    let params = if let Some(c) = ddo_nn::pipeline::FluxPipelineConfig::named(name) {
        c.text_encoder.param_count() + c.text_encoder_2.param_count() + c.transformer.param_count()
    } else if let Some(c) = ddo_nn::pipeline::QwenImagePipelineConfig::named(name) {
        c.text_encoder.param_count() + c.transformer.param_count()
    } else {
        return true;
    };
    ddo_core::host_memory::mem_available().is_some_and(|free| params.saturating_mul(2) > free)
}

/// A value for an option of `kind`: from its dictionary, or (one time in 16) raw bytes, or
/// (one in 64) a long string.
fn value(kind: Kind, r: &mut Reader<'_>) -> String {
    let sel = r.byte();
    match sel {
        0xF0..=0xFB => r.raw(),
        0xFC..=0xFF => long(sel),
        _ if kind == Kind::Route && sel % 4 == 3 => route_value(r),
        _ => {
            let dict = dictionary(kind);
            let v = dict[sel as usize % dict.len()];
            if v == "flux-dev" && !full_size_is_refused(v) {
                "tiny".to_string()
            } else if v == "qwen-image" && !full_size_is_refused(v) {
                "qwen-tiny".to_string()
            } else {
                v.to_string()
            }
        }
    }
}

/// A route spec composed from parts: `[COMPONENT=]ROUTE[:key=value,...]`.
fn route_value(r: &mut Reader<'_>) -> String {
    let shape = r.byte();
    let mut s = String::new();
    if shape & 1 == 0 {
        s += r.pick(COMPONENTS);
        s.push('=');
    }
    s += r.pick(ROUTE_IDS);
    let options = (shape >> 1) % 4;
    for i in 0..options {
        s.push(if i == 0 { ':' } else { ',' });
        let key = r.pick(ROUTE_KEYS);
        s += key;
        s.push('=');
        let v = match key {
            "budget" | "pinned_limit" | "unit_bytes" | "page_cache_limit" => r.pick(SIZES),
            "num_blocks_per_group" | "ring_slots" => r.pick(COUNTS),
            _ => r.pick(ROUTE_WORDS),
        };
        s += v;
    }
    s
}

/// An option name gone wrong: misspelled, wrongly dashed, or raw.
fn misspelled(name: &str, r: &mut Reader<'_>) -> String {
    match r.byte() % 9 {
        0 => format!("--{}", &name[..name.len().saturating_sub(1)]),
        1 => format!("--{name}x"),
        2 => format!("--{}", name.to_uppercase()),
        3 => format!("-{name}"),
        4 => format!("---{name}"),
        5 => format!("--{name} "),
        6 => format!("--{}", name.replace('-', "_")),
        7 => format!("--{name}="),
        _ => format!("--{}", r.raw()),
    }
}

/// Turns fuzz bytes into an argv for [`crate::execute`] (see the module documentation),
/// already [`bounded`].
pub fn argv_from_bytes(data: &[u8]) -> Vec<String> {
    let mut r = Reader { data, pos: 0 };
    let command: Option<String> = match r.byte() % 16 {
        0 | 1 | 10 => Some("run".into()),
        2 | 11 => Some("decode".into()),
        3 | 12 => Some("resolve".into()),
        4 | 13 => Some("inspect".into()),
        5 | 14 => Some("bench".into()),
        6 => Some("help".into()),
        7 => Some(r.pick(VERSIONS).into()),
        8 => Some(if r.byte().is_multiple_of(2) {
            r.pick(COMMAND_WORDS).into()
        } else {
            r.raw()
        }),
        9 => None,
        _ => Some(r.pick(&["run", "resolve"]).into()),
    };
    let Some(command) = command else {
        return Vec::new();
    };
    let specs = specs(&command);
    let mut argv = vec![command.clone()];
    while !r.done() && argv.len() <= MAX_TOKENS {
        let tag = r.byte();
        match tag % 10 {
            0..=4 => {
                let spec = &specs[r.byte() as usize % specs.len()];
                let inline = tag & 0x80 != 0;
                match spec.value {
                    None if inline && tag & 0x40 != 0 => {
                        argv.push(format!("--{}={}", spec.name, r.pick(COUNTS)));
                    }
                    None => argv.push(format!("--{}", spec.name)),
                    Some(_) => {
                        let v = value(kind_of(spec), &mut r);
                        if inline {
                            argv.push(format!("--{}={v}", spec.name));
                        } else {
                            argv.push(format!("--{}", spec.name));
                            argv.push(v);
                        }
                    }
                }
            }
            5 => {
                let spec = &specs[r.byte() as usize % specs.len()];
                argv.push(misspelled(&spec.name, &mut r));
            }
            6 => {
                let kind = ALL_KINDS[r.byte() as usize % ALL_KINDS.len()];
                argv.push(value(kind, &mut r));
            }
            7 => argv.push(r.raw()),
            8 => argv.push(
                r.pick(&["--", "-", "--=", "--=x", "", "-h", "--help"])
                    .into(),
            ),
            _ => {
                let p = r.pick(if command == "help" {
                    COMMAND_WORDS
                } else {
                    PATHS
                });
                argv.push(p.into());
            }
        }
    }
    bounded(argv)
}

/// Bytes that [`argv_from_bytes`] turns into `argv` (then [`bounded`]): how the committed
/// seeds are written. An option of the command with a dictionary value is encoded as one,
/// other values and positionals as raw bytes (`contained` strings of at most 255 bytes) or
/// [`PATHS`] entries; `None` when an element cannot be encoded.
pub fn encode(argv: &[&str]) -> Option<Vec<u8>> {
    let Some((command, rest)) = argv.split_first() else {
        return Some(vec![9]);
    };
    let raw = |s: &str| -> Option<Vec<u8>> {
        (s.len() <= 255 && contained(s) == s).then(|| {
            let mut v = vec![s.len() as u8];
            v.extend_from_slice(s.as_bytes());
            v
        })
    };
    let mut out = match *command {
        "run" => vec![0],
        "decode" => vec![2],
        "resolve" => vec![3],
        "inspect" => vec![4],
        "bench" => vec![5],
        "help" => vec![6],
        c => match VERSIONS.iter().position(|v| *v == c) {
            Some(i) => vec![7, i as u8],
            None => [vec![8, 1], raw(c)?].concat(),
        },
    };
    let specs = specs(command);
    // A value of `kind`: its dictionary index (a selector byte that does not compose a
    // route), else raw bytes.
    let value_bytes = |kind: Kind, v: &str| -> Option<Vec<u8>> {
        let dict = dictionary(kind);
        if let Some(i) = dict.iter().position(|d| *d == v) {
            let sel = (0..0xF0u32)
                .find(|s| *s as usize % dict.len() == i && !(kind == Kind::Route && s % 4 == 3))?;
            return Some(vec![sel as u8]);
        }
        Some([vec![0xF0], raw(v)?].concat())
    };
    let mut i = 0;
    while i < rest.len() {
        let a = rest[i];
        let option = a.strip_prefix("--").and_then(|body| {
            let (name, inline) = match body.split_once('=') {
                Some((n, v)) => (n, Some(v)),
                None => (body, None),
            };
            let si = specs.iter().position(|s| s.name == name)?;
            Some((si, &specs[si], inline))
        });
        match option {
            Some((si, spec, None)) if spec.value.is_none() => {
                out.extend([0, si as u8]);
                i += 1;
                continue;
            }
            Some((si, spec, Some(v))) if spec.value.is_some() => {
                out.extend([0x82, si as u8]);
                out.extend(value_bytes(kind_of(spec), v)?);
                i += 1;
                continue;
            }
            Some((si, spec, None)) if i + 1 < rest.len() => {
                out.extend([0, si as u8]);
                out.extend(value_bytes(kind_of(spec), rest[i + 1])?);
                i += 2;
                continue;
            }
            _ => {}
        }
        let listed = if *command == "help" {
            COMMAND_WORDS
        } else {
            PATHS
        };
        match listed.iter().position(|p| *p == a) {
            Some(p) => out.extend([9, p as u8]),
            None => out.extend([vec![7], raw(a)?].concat()),
        }
        i += 1;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn dictionary_paths_stay_inside_the_working_directory() {
        for p in PATHS {
            assert!(!p.starts_with('/') && !p.starts_with('~'), "{p}");
            let depth = Path::new(p).components().try_fold(0i32, |d, c| {
                let d = match c {
                    std::path::Component::ParentDir => d - 1,
                    std::path::Component::Normal(_) => d + 1,
                    std::path::Component::CurDir => d,
                    _ => -100,
                };
                (d >= 0).then_some(d)
            });
            assert!(depth.is_some(), "{p} leaves the sandbox");
        }
        for bad in ["/etc/passwd", "..", "~/x", "a\\..\\..\\b", "../../x"] {
            let c = contained(bad);
            assert!(!c.contains('/') && !c.contains('\\') && c != ".." && !c.starts_with('~'));
        }
    }

    #[test]
    fn encoded_argvs_decode_to_themselves() {
        for argv in [
            &["run", "--config", "tiny", "--out", "out.png", "--json"][..],
            &[
                "run",
                "--prompt=a red fox",
                "--route",
                "vae=none",
                "--steps",
                "2",
            ],
            &["decode", "--weights", "vae", "--latents", "lat.safetensors"],
            &["inspect", "pipe/vae", "--vram-budget=12GiB"],
            &["bench", "--route", "none", "--plot", "plot", "stray"],
            &["help", "run"],
            &["-V"],
            &["runn", "--x"],
            &[],
        ] {
            let bytes = encode(argv).expect("encodable");
            let decoded = argv_from_bytes(&bytes);
            let want = bounded(argv.iter().map(|s| s.to_string()).collect());
            assert_eq!(decoded, want, "{argv:?}");
        }
        assert_eq!(encode(&["run", "--out", "/etc/x.png"]), None);
    }

    #[test]
    fn every_input_makes_an_argv() {
        for seed in 0..2000u32 {
            let data: Vec<u8> = (0..64)
                .map(|i| (seed.wrapping_mul(2654435761).wrapping_add(i * 40503) >> 13) as u8)
                .collect();
            let argv = argv_from_bytes(&data);
            assert!(argv.len() <= MAX_TOKENS + 8);
            assert!(!argv.iter().any(|a| a.starts_with('/')), "{argv:?}");
        }
    }
}
