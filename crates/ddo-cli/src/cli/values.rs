//! The value parsers of the `ddo` options: [`Checked`] hands clap's value of one option to a
//! DDO parsing function with the option's and the command's names ([`OptionValue`]), so a value
//! that does not parse is refused with DDO's own one-line message and hint (the existing
//! parsers of sizes, dtypes, devices, presets; whole numbers with what would be valid).

use std::ffi::OsStr;
use std::path::PathBuf;

use clap::builder::TypedValueParser;
use clap::error::{ContextKind, ContextValue, ErrorKind};
use ddo_core::{DType, Preset, config::parse_size};
use ddo_nn::pipeline::TiledDecode;

use crate::error::{CliError, CliResult};
use crate::run::{MAX_SEQUENCE_LENGTH, parse_dtype};
use crate::setup::DeviceChoice;

/// One option's value as a value parser sees it.
#[derive(Debug, Clone, Copy)]
pub struct OptionValue<'a> {
    /// The subcommand (`run`).
    pub command: &'a str,
    /// The option's long name, without `--` (`steps`).
    pub option: &'a str,
    /// The value as given.
    pub text: &'a str,
}

impl OptionValue<'_> {
    /// The usage error for a value that is not `what` (`a positive whole number`).
    pub fn invalid(&self, what: &str) -> CliError {
        CliError::usage(
            format!(
                "invalid value `{}` for --{} of `ddo {}`",
                self.text, self.option, self.command
            ),
            format!("give {what}"),
        )
    }
}

/// A clap value parser that calls a DDO parsing function; its error becomes a clap
/// [`ErrorKind::ValueValidation`] error carrying the [`CliError`]'s one line (as
/// [`ContextKind::Custom`]), which [`super::parse`] reports as it is.
pub struct Checked<T>(pub fn(&OptionValue<'_>) -> CliResult<T>);

impl<T> Clone for Checked<T> {
    fn clone(&self) -> Self {
        Self(self.0)
    }
}

impl<T: Clone + Send + Sync + 'static> TypedValueParser for Checked<T> {
    type Value = T;

    fn parse_ref(
        &self,
        cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &OsStr,
    ) -> Result<T, clap::Error> {
        let option = arg.and_then(clap::Arg::get_long).unwrap_or_default();
        let lossy = value.to_string_lossy();
        let given = OptionValue {
            command: cmd.get_name(),
            option,
            text: &lossy,
        };
        let parsed = match value.to_str() {
            Some(_) => (self.0)(&given),
            None => Err(given.invalid("a value in UTF-8")),
        };
        parsed.map_err(|e| {
            let mut error = clap::Error::new(ErrorKind::ValueValidation).with_cmd(cmd);
            error.insert(ContextKind::Custom, ContextValue::String(e.message));
            error
        })
    }
}

/// A path, as given (empty included: the command says what is wrong with it).
pub fn path(g: &OptionValue<'_>) -> CliResult<PathBuf> {
    Ok(PathBuf::from(g.text))
}

/// A whole number, 0 included.
pub fn whole(g: &OptionValue<'_>) -> CliResult<usize> {
    g.text.parse().map_err(|_| g.invalid("a whole number"))
}

/// A seed: a whole number of 64 bits.
pub fn seed(g: &OptionValue<'_>) -> CliResult<u64> {
    g.text.parse().map_err(|_| g.invalid("a whole number"))
}

/// A positive whole number (steps, sides, images, forwards).
pub fn positive(g: &OptionValue<'_>) -> CliResult<usize> {
    match g.text.parse::<usize>() {
        Ok(0) => Err(CliError::usage(
            format!("--{} 0 is not allowed", g.option),
            "give a positive whole number",
        )),
        Ok(n) => Ok(n),
        Err(_) => Err(g.invalid("a positive whole number")),
    }
}

/// `--max-sequence-length`: positive, at most QwenImagePipeline's limit (1024); a Flux run
/// further refuses more than [`MAX_SEQUENCE_LENGTH`] (FluxPipeline's T5 limit).
pub fn max_sequence_length(g: &OptionValue<'_>) -> CliResult<usize> {
    let limit = ddo_nn::qwen_text::MAX_SEQUENCE_LENGTH_LIMIT;
    match positive(g)? {
        n if n > limit => Err(CliError::usage(
            format!("--max-sequence-length {n}: cannot be greater than {limit}"),
            format!(
                "give at most {MAX_SEQUENCE_LENGTH} for a FluxPipeline (T5's limit), {limit} for a QwenImagePipeline"
            ),
        )),
        n => Ok(n),
    }
}

/// `--guidance`: a finite number whose embedding (x 1000, as FluxPipeline embeds it like the
/// timestep) stays finite in f32, where past its range every pixel would be NaN.
pub fn guidance(g: &OptionValue<'_>) -> CliResult<f32> {
    let guidance: f32 = g
        .text
        .parse()
        .map_err(|_| g.invalid("a number, e.g. 3.5"))?;
    if !guidance.is_finite() {
        return Err(CliError::usage("--guidance must be finite", "e.g. 3.5"));
    }
    if !(guidance * 1000.0).is_finite() {
        return Err(CliError::usage(
            format!(
                "--guidance {guidance}: too large: the guidance embedding (x 1000) overflows f32"
            ),
            "give a guidance scale such as 3.5 (FLUX.1-dev is distilled around 3.5)",
        ));
    }
    Ok(guidance)
}

/// `--true-cfg-scale`: a finite number (QwenImagePipeline's `true_cfg_scale`; true CFG runs
/// when it is above 1 and a negative prompt is given).
pub fn true_cfg_scale(g: &OptionValue<'_>) -> CliResult<f32> {
    let scale: f32 = g
        .text
        .parse()
        .map_err(|_| g.invalid("a number, e.g. 4.0"))?;
    if !scale.is_finite() {
        return Err(CliError::usage(
            "--true-cfg-scale must be finite",
            "e.g. 4.0 (QwenImagePipeline's default)",
        ));
    }
    Ok(scale)
}

/// A `--lora FILE[:STRENGTH]` value: the file and the strength its scale is multiplied by
/// (1 when none is given).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraArg {
    /// The LoRA file.
    pub path: PathBuf,
    /// Its strength.
    pub strength: f32,
}

/// `--lora FILE[:STRENGTH]`: a strength is the text after the last `:` when it is a
/// number (a finite one: `0.8`, `-0.5`), else the whole text is the file.
pub fn lora(g: &OptionValue<'_>) -> CliResult<LoraArg> {
    let (path, strength) = match g.text.rsplit_once(':') {
        Some((path, s)) if !path.is_empty() => match s.parse::<f32>() {
            Ok(v) if v.is_finite() => (path, v),
            Ok(_) => {
                return Err(g.invalid(
                    "FILE or FILE:STRENGTH with a finite strength, e.g. style.safetensors:0.8",
                ));
            }
            Err(_) => (g.text, 1.0),
        },
        _ => (g.text, 1.0),
    };
    if path.is_empty() {
        return Err(g.invalid("a LoRA file, e.g. --lora style.safetensors:0.8"));
    }
    Ok(LoraArg {
        path: PathBuf::from(path),
        strength,
    })
}

/// `--vram-budget`: a positive size (`12GiB`, `512MiB`, bytes).
pub fn vram_budget(g: &OptionValue<'_>) -> CliResult<u64> {
    match parse_size("vram-budget", g.text) {
        Ok(0) => Err(CliError::usage(
            "--vram-budget 0 leaves nothing to run on",
            "give a positive size, e.g. 12GiB",
        )),
        Ok(n) => Ok(n),
        Err(e) => Err(CliError::usage(
            e.to_string(),
            "e.g. --vram-budget 12GiB or --vram-budget 512MiB",
        )),
    }
}

/// `--host-budget SIZE`: a positive size.
pub fn host_budget(g: &OptionValue<'_>) -> CliResult<u64> {
    match parse_size("host-budget", g.text) {
        Ok(0) => Err(CliError::usage(
            "--host-budget 0 leaves nothing to run with",
            "give a positive size, e.g. 24GiB, or leave it out for MemAvailable less a reserve",
        )),
        Ok(n) => Ok(n),
        Err(e) => Err(CliError::usage(
            e.to_string(),
            "e.g. --host-budget 24GiB or --host-budget 16384MiB",
        )),
    }
}

/// `--device cpu|cuda:N`.
pub fn device(g: &OptionValue<'_>) -> CliResult<DeviceChoice> {
    DeviceChoice::parse(g.text)
}

/// `--dtype`: a weight dtype name ([`parse_dtype`]).
pub fn dtype(g: &OptionValue<'_>) -> CliResult<DType> {
    parse_dtype(g.text)
}

/// `--compute bf16|fp8`: what the linears compute in (issue 39).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Compute {
    /// Every linear in the activations' dtype (bf16 for fp8 weights, upcast per GEMM).
    #[default]
    Bf16,
    /// Linears with E4M3 weights in fp8: the activation quantized per tensor at run time
    /// ([`ddo_core::Ops::linear_fp8`]).
    Fp8,
}

impl Compute {
    /// The weights' dtype `--dtype` `given` becomes: fp8 compute stores the linears as E4M3
    /// (converted at load where the files hold another dtype; weights stored as E4M3 load
    /// as they are), and refuses E5M2, which fp8 GEMMs take for gradients only.
    pub fn weights_dtype(self, given: Option<DType>) -> CliResult<Option<DType>> {
        match (self, given) {
            (Compute::Bf16, d) => Ok(d),
            (Compute::Fp8, Some(DType::F8E5M2)) => Err(CliError::usage(
                "--compute fp8 takes E4M3 weights, not --dtype fp8_e5m2",
                "give --dtype fp8_e4m3, or no dtype option",
            )),
            (Compute::Fp8, _) => Ok(Some(DType::F8E4M3)),
        }
    }

    /// The name on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Compute::Bf16 => "bf16",
            Compute::Fp8 => "fp8",
        }
    }
}

/// `--compute bf16|fp8`.
pub fn compute(g: &OptionValue<'_>) -> CliResult<Compute> {
    match g.text {
        "bf16" => Ok(Compute::Bf16),
        "fp8" => Ok(Compute::Fp8),
        other => Err(CliError::usage(
            format!("invalid --compute `{other}`"),
            "use --compute bf16 (the default) or --compute fp8 (E4M3 linears, activations \
             scaled per tensor)",
        )),
    }
}

/// `ddo convert --compress lossless` (the one coding it writes).
pub fn compress(g: &OptionValue<'_>) -> CliResult<ddo_core::Compression> {
    match g.text {
        "lossless" => Ok(ddo_core::Compression::Lossless),
        other => Err(CliError::usage(
            format!("invalid --compress `{other}` for ddo convert"),
            "use --compress lossless (bf16 and f16 matrices entropy-coded, decoded bit for bit)",
        )),
    }
}

/// `--tiled-decode on|off|auto`.
pub fn tiled_decode(g: &OptionValue<'_>) -> CliResult<TiledDecode> {
    g.text.parse().map_err(|_| {
        CliError::usage(
            format!("invalid --tiled-decode `{}`", g.text),
            "use on, off or auto",
        )
    })
}

/// `--preset NAME`: one of [`Preset::ALL`] (the error lists them).
pub fn preset(g: &OptionValue<'_>) -> CliResult<Preset> {
    g.text
        .parse::<Preset>()
        .map_err(|e| CliError::usage(e.to_string(), "pick one of the presets listed"))
}

/// `--listen ADDR:PORT`: an IP address and a port (`127.0.0.1:8910`, `[::1]:0`).
pub fn listen(g: &OptionValue<'_>) -> CliResult<std::net::SocketAddr> {
    g.text
        .parse()
        .map_err(|_| g.invalid("an IP address and a port, e.g. 127.0.0.1:8910"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn given(text: &str) -> OptionValue<'_> {
        OptionValue {
            command: "run",
            option: "steps",
            text,
        }
    }

    #[test]
    fn numbers_are_refused_naming_the_option_and_what_is_valid() {
        assert_eq!(positive(&given("+3")).unwrap(), 3);
        let e = positive(&given("x")).unwrap_err();
        assert_eq!(
            e.message,
            "invalid value `x` for --steps of `ddo run`; hint: give a positive whole number"
        );
        let e = positive(&given("0")).unwrap_err();
        assert_eq!(
            e.message,
            "--steps 0 is not allowed; hint: give a positive whole number"
        );
        assert_eq!(e.exit_code(), 2);
        assert!(guidance(&given("1e38")).is_err());
        assert!(guidance(&given("NaN")).is_err());
        assert!(max_sequence_length(&given("1025")).is_err());
        // Past T5's 512, a Flux run refuses it, a Qwen-Image run takes it.
        assert_eq!(max_sequence_length(&given("513")).unwrap(), 513);
        assert_eq!(vram_budget(&given("1KiB")).unwrap(), 1024);
        assert!(vram_budget(&given("0")).is_err());
    }
}
