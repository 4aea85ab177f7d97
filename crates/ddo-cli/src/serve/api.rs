//! The request bodies `ddo serve` takes — DDO's own (`POST /v1/generate`, `POST /v1/jobs`)
//! and OpenAI's images shape (`POST /v1/images/generations`) — parsed strictly (an unknown
//! field is refused, naming the fields that exist) and checked by `ddo run`'s own value
//! parsers, so a request gets the CLI's message. A LoRA is named by its file name in the
//! server's `--lora-dir`, never by a path.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::cli::{LoraArg, OptionValue, values};
use crate::error::{CliError, CliResult};
use crate::session::Request;

/// The fields of [`OpenAiBody`] DDO takes, as the error for an unknown one names them.
pub const OPENAI_FIELDS: &str =
    "prompt, n, size, response_format (b64_json), model, quality, style, user";

/// The fields of [`GenerateBody`], as the error for an unknown one names them.
pub const GENERATE_FIELDS: &str = "prompt, negative_prompt, height, width, steps, guidance, true_cfg_scale, seed, num_images, loras";

/// `POST /v1/generate`'s body: `ddo run`'s options by their names in snake case.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerateBody {
    /// `--prompt`.
    pub prompt: Option<String>,
    /// `--negative-prompt` (Qwen-Image).
    pub negative_prompt: Option<String>,
    /// `--height`.
    pub height: Option<u64>,
    /// `--width`.
    pub width: Option<u64>,
    /// `--steps`.
    pub steps: Option<u64>,
    /// `--guidance` (Flux).
    pub guidance: Option<f64>,
    /// `--true-cfg-scale` (Qwen-Image).
    pub true_cfg_scale: Option<f64>,
    /// `--seed`; a fresh one is drawn (and returned) without it.
    pub seed: Option<u64>,
    /// `--num-images`.
    pub num_images: Option<u64>,
    /// LoRAs from the server's `--lora-dir`, by name, with their strengths.
    pub loras: Option<Vec<LoraRef>>,
}

/// A LoRA a request names.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraRef {
    /// The file's name in `--lora-dir` (`style.safetensors`, or `style`).
    pub name: String,
    /// Its strength (1.0 without it).
    pub strength: Option<f64>,
}

/// `POST /v1/images/generations`'s body (OpenAI's images API): the fields DDO reads, and
/// those clients send that change nothing here (`model`, `quality`, `style`, `user`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenAiBody {
    /// The prompt (required).
    pub prompt: String,
    /// Images (1).
    pub n: Option<u64>,
    /// `WIDTHxHEIGHT` (`1024x1024`).
    pub size: Option<String>,
    /// `b64_json` (the only one: DDO serves no files).
    pub response_format: Option<String>,
    /// Ignored: the server runs the model it loaded.
    pub model: Option<String>,
    /// Ignored.
    pub quality: Option<String>,
    /// Ignored.
    pub style: Option<String>,
    /// Ignored.
    pub user: Option<String>,
}

/// A checked request: the session's [`Request`] and the LoRA files it names.
#[derive(Debug, Clone)]
pub struct Parsed {
    /// What the session runs.
    pub request: Request,
    /// The LoRAs, as files of `--lora-dir`.
    pub loras: Vec<LoraArg>,
}

/// A number of a request checked as `ddo run` checks `--{option}`.
fn checked<T>(
    option: &str,
    value: impl ToString,
    parse: fn(&OptionValue<'_>) -> CliResult<T>,
) -> CliResult<T> {
    let text = value.to_string();
    parse(&OptionValue {
        command: "serve",
        option,
        text: &text,
    })
}

/// The JSON error of a body serde refused, with the fields that exist.
pub fn body_error(e: &serde_json::Error, fields: &str) -> CliError {
    CliError::usage(
        format!("the request body is not a valid request: {e}"),
        format!("send a JSON object with the fields {fields}"),
    )
}

/// A draw of a fresh seed (a request without one): the standard library's per-process
/// random hash keys mixed with the time, never the same twice in a process.
pub fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static COUNT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    // Seeds stay below 2^53, exact in every JSON client's numbers.
    h.finish() >> 11
}

impl GenerateBody {
    /// The body checked: each value by `ddo run`'s parser, the LoRAs found in `loras`
    /// (the names of `--lora-dir`'s files).
    pub fn parse(&self, loras: &LoraDir) -> CliResult<Parsed> {
        let mut r = Request {
            prompt: self.prompt.clone(),
            negative_prompt: self.negative_prompt.clone(),
            ..Request::default()
        };
        if let Some(h) = self.height {
            r.height = Some(checked("height", h, values::positive)?);
        }
        if let Some(w) = self.width {
            r.width = Some(checked("width", w, values::positive)?);
        }
        if let Some(s) = self.steps {
            r.steps = Some(checked("steps", s, values::positive)?);
        }
        if let Some(g) = self.guidance {
            r.guidance = Some(checked("guidance", g, values::guidance)?);
        }
        if let Some(g) = self.true_cfg_scale {
            r.true_cfg_scale = Some(checked("true-cfg-scale", g, values::true_cfg_scale)?);
        }
        if let Some(n) = self.num_images {
            r.num_images = Some(checked("num-images", n, values::positive)?);
        }
        r.seed = Some(self.seed.unwrap_or_else(fresh_seed));
        let loras = self
            .loras
            .iter()
            .flatten()
            .map(|l| loras.find(&l.name, l.strength))
            .collect::<CliResult<Vec<_>>>()?;
        Ok(Parsed { request: r, loras })
    }
}

impl OpenAiBody {
    /// The body as DDO's own request (`size` `WIDTHxHEIGHT`, `n` images).
    pub fn to_generate(&self) -> CliResult<GenerateBody> {
        if let Some(f) = &self.response_format
            && f != "b64_json"
        {
            return Err(CliError::usage(
                format!("response_format `{f}` is not served"),
                "use response_format b64_json (the images come back in the response)",
            ));
        }
        let (width, height) = match &self.size {
            None => (None, None),
            Some(s) => {
                let bad = || {
                    CliError::usage(
                        format!("size `{s}` is not WIDTHxHEIGHT"),
                        "give e.g. 1024x1024",
                    )
                };
                let (w, h) = s.split_once('x').ok_or_else(bad)?;
                (
                    Some(w.parse::<u64>().map_err(|_| bad())?),
                    Some(h.parse::<u64>().map_err(|_| bad())?),
                )
            }
        };
        Ok(GenerateBody {
            prompt: Some(self.prompt.clone()),
            width,
            height,
            num_images: self.n,
            ..GenerateBody::default()
        })
    }
}

/// The endpoints that take a request body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/generate` and `POST /v1/jobs`: DDO's own body.
    Generate,
    /// `POST /v1/images/generations`: OpenAI's images body.
    Images,
}

/// `body` of a request to `endpoint`, parsed and checked (LoRAs from `loras`): the one
/// parser every endpoint and the `serve_request` fuzz target go through.
pub fn parse_body(endpoint: Endpoint, body: &[u8], loras: &LoraDir) -> CliResult<Parsed> {
    let generate = match endpoint {
        Endpoint::Generate => {
            serde_json::from_slice(body).map_err(|e| body_error(&e, GENERATE_FIELDS))?
        }
        Endpoint::Images => serde_json::from_slice::<OpenAiBody>(body)
            .map_err(|e| body_error(&e, OPENAI_FIELDS))?
            .to_generate()?,
    };
    GenerateBody::parse(&generate, loras)
}

/// One fuzz input (`fuzz/fuzz_targets/serve_request.rs`, its seeds replayed by
/// `tests/serve.rs`): the first byte picks the endpoint, the rest is the body. The body is
/// parsed, then checked as a session checks it for each family; a refusal must be a usage
/// error (HTTP 400). `Err` says what went wrong otherwise; a panic is a crash.
pub fn fuzz_one(data: &[u8]) -> Result<(), String> {
    let (endpoint, body) = match data.split_first() {
        Some((b, rest)) if b % 2 == 1 => (Endpoint::Images, rest),
        Some((_, rest)) => (Endpoint::Generate, rest),
        None => (Endpoint::Generate, data),
    };
    let usage = |e: CliError| {
        if e.kind == crate::error::ErrorKind::Usage {
            Ok(())
        } else {
            Err(format!("a bad body is not a usage error: {e}"))
        }
    };
    let parsed = match parse_body(endpoint, body, &LoraDir::default()) {
        Ok(p) => p,
        Err(e) => return usage(e),
    };
    for family in [
        crate::family::Family::Flux,
        crate::family::Family::QwenImage,
    ] {
        for tiny in [true, false] {
            if let Err(e) = parsed.request.check(family, tiny) {
                usage(e)?;
            }
        }
    }
    Ok(())
}

/// The LoRA files requests may name: the `.safetensors` files of `--lora-dir`, read when
/// the server starts.
#[derive(Debug, Clone, Default)]
pub struct LoraDir {
    files: BTreeMap<String, PathBuf>,
}

impl LoraDir {
    /// The `.safetensors` files of `dir` (none without one).
    pub fn read(dir: Option<&Path>) -> CliResult<Self> {
        let Some(dir) = dir else {
            return Ok(Self::default());
        };
        let entries = std::fs::read_dir(dir).map_err(|e| {
            CliError::usage(
                format!("--lora-dir {}: {e}", dir.display()),
                "give a folder of LoRA .safetensors files",
            )
        })?;
        let mut files = BTreeMap::new();
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_file()
                && path.extension().is_some_and(|e| e == "safetensors")
                && let Some(name) = path.file_name().and_then(|n| n.to_str())
            {
                files.insert(name.to_string(), path);
            }
        }
        Ok(Self { files })
    }

    /// The names requests may give, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.files.keys().map(String::as_str).collect()
    }

    /// The file `name` names (`style.safetensors` or `style`) with `strength`; a path, or a
    /// name the folder lacks, is refused naming the ones it has.
    pub fn find(&self, name: &str, strength: Option<f64>) -> CliResult<LoraArg> {
        let listed = || {
            if self.files.is_empty() {
                "the server has no LoRAs: start it with --lora-dir DIR".to_string()
            } else {
                format!("name one of: {}", self.names().join(", "))
            }
        };
        if name.contains(['/', '\\']) || name.starts_with('.') || name.contains('\0') {
            return Err(CliError::usage(
                format!("LoRA `{name}`: a request names a LoRA, never a path"),
                listed(),
            ));
        }
        let path = self
            .files
            .get(name)
            .or_else(|| self.files.get(&format!("{name}.safetensors")))
            .ok_or_else(|| CliError::usage(format!("no LoRA named `{name}`"), listed()))?;
        let strength = match strength {
            None => 1.0,
            Some(s) if s.is_finite() && (s as f32).is_finite() => s as f32,
            Some(s) => {
                return Err(CliError::usage(
                    format!("LoRA `{name}`: strength {s} is not a finite number"),
                    "give e.g. 0.8",
                ));
            }
        };
        Ok(LoraArg {
            path: path.clone(),
            strength,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> CliResult<Parsed> {
        let body: GenerateBody =
            serde_json::from_str(json).map_err(|e| body_error(&e, GENERATE_FIELDS))?;
        body.parse(&LoraDir::default())
    }

    #[test]
    fn values_are_checked_by_the_cli_parsers_and_unknown_fields_refused() {
        let p = parse(r#"{"prompt":"a","height":64,"width":48,"steps":3,"seed":7}"#).unwrap();
        assert_eq!(p.request.height, Some(64));
        assert_eq!(p.request.seed, Some(7));
        let e = parse(r#"{"steps":0}"#).unwrap_err().to_string();
        assert!(e.contains("--steps 0 is not allowed"), "{e}");
        let e = parse(r#"{"stpes":4}"#).unwrap_err().to_string();
        assert!(
            e.contains("unknown field `stpes`") && e.contains("steps"),
            "{e}"
        );
        let e = parse(r#"{"guidance":1e39}"#).unwrap_err().to_string();
        assert!(e.contains("guidance"), "{e}");
        // A request without a seed gets a fresh one, another each time.
        let (a, b) = (parse("{}").unwrap(), parse("{}").unwrap());
        assert_ne!(a.request.seed, b.request.seed);
        assert!(a.request.seed.unwrap() < 1 << 53);
    }

    #[test]
    fn a_lora_is_a_name_in_the_folder_never_a_path() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("style.safetensors"), b"x").unwrap();
        std::fs::write(dir.path().join("notes.txt"), b"x").unwrap();
        let loras = LoraDir::read(Some(dir.path())).unwrap();
        assert_eq!(loras.names(), ["style.safetensors"]);
        let found = loras.find("style", Some(0.5)).unwrap();
        assert_eq!(found.path, dir.path().join("style.safetensors"));
        assert_eq!(found.strength, 0.5);
        for bad in [
            "../style.safetensors",
            "/etc/passwd",
            "a/b",
            ".hidden",
            "notes.txt",
        ] {
            let e = loras.find(bad, None).unwrap_err().to_string();
            assert!(e.contains("style.safetensors"), "{bad}: {e}");
        }
        let e = LoraDir::default().find("x", None).unwrap_err().to_string();
        assert!(e.contains("--lora-dir"), "{e}");
    }

    #[test]
    fn the_openai_shape_maps_size_and_n() {
        let body: OpenAiBody = serde_json::from_str(
            r#"{"prompt":"p","n":2,"size":"64x32","model":"dall-e-3","response_format":"b64_json"}"#,
        )
        .unwrap();
        let g = body.to_generate().unwrap();
        assert_eq!(
            (g.width, g.height, g.num_images),
            (Some(64), Some(32), Some(2))
        );
        let bad: OpenAiBody = serde_json::from_str(r#"{"prompt":"p","size":"big"}"#).unwrap();
        assert!(bad.to_generate().is_err());
        let url: OpenAiBody =
            serde_json::from_str(r#"{"prompt":"p","response_format":"url"}"#).unwrap();
        assert!(
            url.to_generate()
                .unwrap_err()
                .to_string()
                .contains("b64_json")
        );
    }
}
