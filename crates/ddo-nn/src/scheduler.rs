//! Diffusers' `FlowMatchEulerDiscreteScheduler` as FluxPipeline drives it: the
//! resolution-dependent shift ([`calculate_shift`], `use_dynamic_shifting` with `mu`), the
//! schedule ([`FlowMatchEulerScheduler::set_sigmas`], [`FlowMatchEulerScheduler::set_timesteps`])
//! and the Euler step ([`FlowMatchEulerScheduler::step`]).
//!
//! Matches diffusers 0.42.1 (`schedulers/scheduling_flow_match_euler_discrete.py`,
//! `pipelines/flux/pipeline_flux.py`) value for value, including where the arithmetic is done:
//!
//! - FluxPipeline passes `sigmas = np.linspace(1.0, 1/n, n)` ([`flux_sigmas`], float64) and
//!   `mu = calculate_shift(image_seq_len, 256, 4096, 0.5, 1.15)` (Python float64).
//!   `set_timesteps` casts the sigmas to float32 and shifts them there: under NumPy 2 a Python
//!   float next to a float32 array is "weak", so `exp(mu) / (exp(mu) + (1/σ − 1)^1)` runs in
//!   float32 with `exp(mu)` rounded to float32. The fixed shift (`shift·σ / (1 + (shift−1)·σ)`)
//!   is float32 too on that path.
//! - Without given sigmas (`set_timesteps(n)`), the sigmas come from a float64
//!   `np.linspace(σ_max·1000, σ_min·1000, n) / 1000` and the shift runs in float64; the result
//!   is rounded to float32 once.
//! - `timesteps = sigmas · 1000` in float32; a final sigma of 0 is appended.
//! - The step is `prev = sample + (σ_next − σ) · model_output` in float32, cast back to the
//!   model output's dtype.
//!
//! Karras/exponential/beta sigmas, stochastic sampling and inverted sigmas are not
//! implemented: a config that asks for them is refused with a typed error, never ignored.
//!
//! Numbers that make the schedule degenerate are refused too (issue 34: `shift` 1e-38 or
//! `max_shift` 1e30 gave NaN sigmas, an all-black image): at load, `shift` must lie in
//! [`SHIFT_RANGE`], `base_shift` and `max_shift` in [`DYNAMIC_SHIFT_RANGE`], the sequence
//! lengths be at most [`MAX_SEQ_LEN`], `shift_terminal` in [0, 1); when a schedule is set,
//! `exp(mu)` must be finite and every sigma finite, in [0, 1] and non-increasing
//! ([`FlowMatchEulerScheduler::set_sigmas`], [`FlowMatchEulerScheduler::set_timesteps`]).

use std::path::Path;

use ddo_core::{BinaryOp, CoreError, DType, Ops, Result, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::{LoadError, LoadResult};

/// The accepted fixed `shift` (Diffusers' schedulers use 1 to 7: Flux 3, SD3 3, Qwen-Image
/// 1): a shift near 0 collapses every sigma to 0, a huge one every sigma to 1.
pub const SHIFT_RANGE: (f64, f64) = (1e-3, 1e3);

/// The accepted `base_shift` and `max_shift` (Flux 0.5 and 1.15, Qwen-Image 0.5 and 0.9):
/// `mu` interpolates between them and the schedule uses `exp(mu)`, which f32 holds up to
/// `mu` = 88, so shifts of a few units already mean sigmas pinned at 0 or 1.
pub const DYNAMIC_SHIFT_RANGE: (f64, f64) = (-20.0, 20.0);

/// The largest `base_image_seq_len` / `max_image_seq_len` accepted (Flux 256 and 4096,
/// Qwen-Image 256 and 8192): 2^20 packed tokens is a 16384x16384 image.
pub const MAX_SEQ_LEN: usize = 1 << 20;

/// How far a sigma may stray above 1, or above the sigma before it, by f32 rounding
/// (`shift·σ / (1 + (shift−1)·σ)` at σ = 1 is 1 within an ulp or two).
const SIGMA_SLACK: f32 = 1e-5;

/// How the dynamic (resolution-dependent) shift is applied (`time_shift_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TimeShiftType {
    /// `e^μ / (e^μ + (1/t − 1)^σ)` (Flux).
    #[default]
    Exponential,
    /// `μ / (μ + (1/t − 1)^σ)`.
    Linear,
}

fn default_train_timesteps() -> usize {
    1000
}
fn default_one() -> f64 {
    1.0
}
fn default_base_shift() -> Option<f64> {
    Some(0.5)
}
fn default_max_shift() -> Option<f64> {
    Some(1.15)
}
fn default_base_seq() -> usize {
    256
}
fn default_max_seq() -> usize {
    4096
}

/// The fields of `scheduler/scheduler_config.json` (Diffusers' constructor defaults where a
/// field is missing; unknown fields are ignored).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FlowMatchEulerConfig {
    /// Training timesteps (1000).
    #[serde(default = "default_train_timesteps")]
    pub num_train_timesteps: usize,
    /// Fixed shift, used when `use_dynamic_shifting` is false.
    #[serde(default = "default_one")]
    pub shift: f64,
    /// Resolution-dependent shift from `mu` (Flux: true).
    #[serde(default)]
    pub use_dynamic_shifting: bool,
    /// Shift at `base_image_seq_len` tokens.
    #[serde(default = "default_base_shift")]
    pub base_shift: Option<f64>,
    /// Shift at `max_image_seq_len` tokens.
    #[serde(default = "default_max_shift")]
    pub max_shift: Option<f64>,
    /// Sequence length of `base_shift`.
    #[serde(default = "default_base_seq")]
    pub base_image_seq_len: usize,
    /// Sequence length of `max_shift`.
    #[serde(default = "default_max_seq")]
    pub max_image_seq_len: usize,
    /// Shift formula.
    #[serde(default)]
    pub time_shift_type: TimeShiftType,
    /// Stretch the schedule so it ends at this sigma.
    #[serde(default)]
    pub shift_terminal: Option<f64>,
    /// Not supported (refused when true).
    #[serde(default)]
    pub invert_sigmas: bool,
    /// Not supported (refused when true).
    #[serde(default)]
    pub use_karras_sigmas: bool,
    /// Not supported (refused when true).
    #[serde(default)]
    pub use_exponential_sigmas: bool,
    /// Not supported (refused when true).
    #[serde(default)]
    pub use_beta_sigmas: bool,
    /// Not supported (refused when true).
    #[serde(default)]
    pub stochastic_sampling: bool,
}

impl Default for FlowMatchEulerConfig {
    /// Diffusers' constructor defaults (fixed shift 1, no dynamic shifting).
    fn default() -> Self {
        Self {
            num_train_timesteps: 1000,
            shift: 1.0,
            use_dynamic_shifting: false,
            base_shift: Some(0.5),
            max_shift: Some(1.15),
            base_image_seq_len: 256,
            max_image_seq_len: 4096,
            time_shift_type: TimeShiftType::Exponential,
            shift_terminal: None,
            invert_sigmas: false,
            use_karras_sigmas: false,
            use_exponential_sigmas: false,
            use_beta_sigmas: false,
            stochastic_sampling: false,
        }
    }
}

impl FlowMatchEulerConfig {
    /// FLUX.1-dev's `scheduler_config.json`: shift 3, dynamic shifting between 0.5 at 256
    /// tokens and 1.15 at 4096 tokens.
    pub fn flux() -> Self {
        Self {
            shift: 3.0,
            use_dynamic_shifting: true,
            ..Self::default()
        }
    }

    /// Qwen-Image's `scheduler/scheduler_config.json` (the `Qwen/Qwen-Image` repository's
    /// file, which Diffusers' `QwenImagePipeline` loads; its constructor and
    /// `calculate_shift` defaults differ): shift 1, dynamic shifting between 0.5 at 256 tokens
    /// and 0.9 at 8192 tokens, exponential, stretched to end at `shift_terminal` 0.02.
    pub fn qwen_image() -> Self {
        Self {
            shift: 1.0,
            use_dynamic_shifting: true,
            base_shift: Some(0.5),
            max_shift: Some(0.9),
            base_image_seq_len: 256,
            max_image_seq_len: 8192,
            shift_terminal: Some(0.02),
            ..Self::default()
        }
    }

    /// Reads and validates a Diffusers `scheduler_config.json`; a refused field is named
    /// with the file (`<path>: shift`).
    pub fn from_file(path: &Path) -> LoadResult<Self> {
        let text = crate::weights::read_text_file(path)?;
        let config: Self = serde_json::from_str(&text).map_err(|e| LoadError::Config {
            file: path.to_path_buf(),
            message: format!(
                "{e}; expected a FlowMatchEulerDiscreteScheduler scheduler_config.json"
            ),
        })?;
        config.validate().map_err(|e| e.in_config_file(path))?;
        Ok(config)
    }

    /// Refuses what this port does not implement and values that cannot work: the options
    /// it does not implement, and numbers outside the documented ranges ([`SHIFT_RANGE`],
    /// [`DYNAMIC_SHIFT_RANGE`], [`MAX_SEQ_LEN`], `shift_terminal` in [0, 1)), each error
    /// naming the field and the range.
    pub fn validate(&self) -> LoadResult<()> {
        let invalid = |field: &str, value: String, hint: &str| {
            Err(LoadError::InvalidConfig {
                field: field.into(),
                value,
                hint: hint.into(),
            })
        };
        for (field, on) in [
            ("invert_sigmas", self.invert_sigmas),
            ("use_karras_sigmas", self.use_karras_sigmas),
            ("use_exponential_sigmas", self.use_exponential_sigmas),
            ("use_beta_sigmas", self.use_beta_sigmas),
            ("stochastic_sampling", self.stochastic_sampling),
        ] {
            if on {
                return invalid(
                    field,
                    "true".into(),
                    "DDO's FlowMatchEulerScheduler implements FluxPipeline's deterministic Euler schedule only; set it to false",
                );
            }
        }
        if self.num_train_timesteps == 0 {
            return invalid("num_train_timesteps", "0".into(), "must be positive");
        }
        let in_range = |v: f64, (lo, hi): (f64, f64)| v.is_finite() && (lo..=hi).contains(&v);
        if !in_range(self.shift, SHIFT_RANGE) {
            return invalid(
                "shift",
                self.shift.to_string(),
                &format!(
                    "must be a number in [{:e}, {:e}] (Flux: 3.0, Qwen-Image: 1.0); outside it the \
                     shifted sigmas collapse to 0 or 1 or become NaN",
                    SHIFT_RANGE.0, SHIFT_RANGE.1
                ),
            );
        }
        for (field, value, default) in [
            ("base_shift", self.base_shift, 0.5),
            ("max_shift", self.max_shift, 1.15),
        ] {
            let v = value.unwrap_or(default);
            if !in_range(v, DYNAMIC_SHIFT_RANGE) {
                return invalid(
                    field,
                    v.to_string(),
                    &format!(
                        "must be a number in [{}, {}] (Flux: base_shift 0.5, max_shift 1.15); the \
                         schedule uses exp(mu), mu interpolated between the two, which overflows or \
                         pins every sigma at 0 or 1 outside it",
                        DYNAMIC_SHIFT_RANGE.0, DYNAMIC_SHIFT_RANGE.1
                    ),
                );
            }
        }
        for (field, v) in [
            ("base_image_seq_len", self.base_image_seq_len),
            ("max_image_seq_len", self.max_image_seq_len),
        ] {
            if v > MAX_SEQ_LEN {
                return invalid(
                    field,
                    v.to_string(),
                    &format!(
                        "must be at most {MAX_SEQ_LEN} packed image tokens (Flux: base_image_seq_len \
                         256, max_image_seq_len 4096)"
                    ),
                );
            }
        }
        if self.max_image_seq_len == self.base_image_seq_len {
            return invalid(
                "max_image_seq_len",
                self.max_image_seq_len.to_string(),
                "must differ from base_image_seq_len (the shift is interpolated between them)",
            );
        }
        if let Some(t) = self.shift_terminal
            && !(t.is_finite() && (0.0..1.0).contains(&t))
        {
            return invalid(
                "shift_terminal",
                t.to_string(),
                "must be in [0, 1) (Qwen-Image: 0.02), or null",
            );
        }
        Ok(())
    }

    /// FluxPipeline's `mu` for `image_seq_len` packed tokens, from this config's
    /// `base_image_seq_len`, `max_image_seq_len`, `base_shift` and `max_shift` (Diffusers'
    /// defaults where the shifts are null).
    pub fn mu(&self, image_seq_len: usize) -> f64 {
        calculate_shift(
            image_seq_len,
            self.base_image_seq_len,
            self.max_image_seq_len,
            self.base_shift.unwrap_or(0.5),
            self.max_shift.unwrap_or(1.15),
        )
    }
}

/// FluxPipeline's `calculate_shift`: the shift `mu` grows linearly with the number of image
/// tokens, from `base_shift` at `base_seq_len` to `max_shift` at `max_seq_len` (float64, as
/// Python computes it).
pub fn calculate_shift(
    image_seq_len: usize,
    base_seq_len: usize,
    max_seq_len: usize,
    base_shift: f64,
    max_shift: f64,
) -> f64 {
    let m = (max_shift - base_shift) / (max_seq_len as f64 - base_seq_len as f64);
    let b = base_shift - m * base_seq_len as f64;
    image_seq_len as f64 * m + b
}

/// NumPy's `np.linspace(start, stop, num)` (float64, endpoint included): `i·step + start`
/// with `step = (stop − start)/(num − 1)`, the last value set to `stop` exactly.
pub fn linspace(start: f64, stop: f64, num: usize) -> Vec<f64> {
    if num == 0 {
        return Vec::new();
    }
    if num == 1 {
        return vec![start];
    }
    let step = (stop - start) / (num - 1) as f64;
    let mut v: Vec<f64> = (0..num).map(|i| i as f64 * step + start).collect();
    v[num - 1] = stop;
    v
}

/// The sigmas FluxPipeline passes to the scheduler: `np.linspace(1.0, 1/n, n)`.
pub fn flux_sigmas(num_inference_steps: usize) -> Vec<f64> {
    linspace(1.0, 1.0 / num_inference_steps as f64, num_inference_steps)
}

/// The flow-matching Euler scheduler with a schedule set.
#[derive(Debug, Clone, PartialEq)]
pub struct FlowMatchEulerScheduler {
    config: FlowMatchEulerConfig,
    /// `sigmas.len() == timesteps.len() + 1` once a schedule is set.
    sigmas: Vec<f32>,
    timesteps: Vec<f32>,
}

/// Host bytes the schedule of one step takes at its peak (the sigmas in f64 and f32, the
/// shifted sigmas, the timesteps, and their copies in the pipeline's report), rounded up.
pub const SCHEDULE_BYTES_PER_STEP: u64 = 64;

/// Refuses a step count whose schedule the host cannot hold: its vectors take about
/// [`SCHEDULE_BYTES_PER_STEP`] per step, and an allocation that fails aborts the process.
pub fn check_schedule_memory(steps: usize) -> Result<()> {
    let need = (steps as u64).saturating_mul(SCHEDULE_BYTES_PER_STEP);
    match ddo_core::host_memory::mem_available() {
        Some(free) if need > free => Err(steps_error(
            steps,
            format!(
                "{steps} steps need about {need} B of host memory for the schedule; {free} B are available: give fewer steps (at most {})",
                free / SCHEDULE_BYTES_PER_STEP
            ),
        )),
        _ => Ok(()),
    }
}

/// A step count the schedule cannot take: the steps given, and why (issue 34: the value was
/// reported as an empty `scheduler` value).
fn steps_error(steps: usize, why: impl Into<String>) -> CoreError {
    invalid("steps", steps.to_string(), why)
}

/// An argument or config value the schedule cannot take, as given.
fn invalid(option: &str, value: impl Into<String>, hint: impl Into<String>) -> CoreError {
    CoreError::InvalidOption {
        option: option.into(),
        value: value.into(),
        hint: hint.into(),
    }
}

impl FlowMatchEulerScheduler {
    /// A scheduler with `config` (validated) and no schedule yet.
    pub fn new(config: FlowMatchEulerConfig) -> LoadResult<Self> {
        config.validate()?;
        Ok(Self {
            config,
            sigmas: Vec::new(),
            timesteps: Vec::new(),
        })
    }

    /// The config.
    pub fn config(&self) -> &FlowMatchEulerConfig {
        &self.config
    }

    /// The schedule's sigmas, the final 0 included (`steps + 1` values).
    pub fn sigmas(&self) -> &[f32] {
        &self.sigmas
    }

    /// The schedule's timesteps (`sigma · num_train_timesteps`, one per step).
    pub fn timesteps(&self) -> &[f32] {
        &self.timesteps
    }

    /// Number of steps in the schedule.
    pub fn num_steps(&self) -> usize {
        self.timesteps.len()
    }

    /// The schedule FluxPipeline sets for `steps` steps and `image_seq_len` packed image
    /// tokens: [`flux_sigmas`] and `mu` from [`FlowMatchEulerConfig::mu`].
    pub fn set_flux_schedule(&mut self, steps: usize, image_seq_len: usize) -> Result<()> {
        check_schedule_memory(steps)?;
        let mu = self.config.mu(image_seq_len);
        self.set_sigmas(&flux_sigmas(steps), Some(mu))
    }

    /// `set_timesteps(sigmas=sigmas, mu=mu)`: the given sigmas, cast to float32, shifted in
    /// float32 arithmetic. `mu` is required exactly when `use_dynamic_shifting` is on.
    pub fn set_sigmas(&mut self, sigmas: &[f64], mu: Option<f64>) -> Result<()> {
        if sigmas.is_empty() {
            return Err(steps_error(0, "give at least one step"));
        }
        let s: Vec<f32> = sigmas.iter().map(|&x| x as f32).collect();
        let shifted: Vec<f32> = if self.config.use_dynamic_shifting {
            let mu = self.require_mu(mu)?;
            match self.config.time_shift_type {
                TimeShiftType::Exponential => {
                    let e = mu.exp() as f32;
                    if !e.is_finite() {
                        return Err(self.degenerate(format!(
                            "exp(mu) = exp({mu}) overflows f32 (mu from base_shift {:?}, max_shift \
                             {:?}, base_image_seq_len {} and max_image_seq_len {})",
                            self.config.base_shift,
                            self.config.max_shift,
                            self.config.base_image_seq_len,
                            self.config.max_image_seq_len
                        )));
                    }
                    s.iter().map(|&t| e / (e + (1.0f32 / t - 1.0))).collect()
                }
                TimeShiftType::Linear => {
                    let m = mu as f32;
                    s.iter().map(|&t| m / (m + (1.0f32 / t - 1.0))).collect()
                }
            }
        } else {
            let shift = self.config.shift as f32;
            let shift_minus_one = (self.config.shift - 1.0) as f32;
            s.iter()
                .map(|&t| shift * t / (1.0 + shift_minus_one * t))
                .collect()
        };
        let shifted = match self.config.shift_terminal {
            Some(terminal) => {
                // The stretch divides by `1 − σ_last`: a schedule ending at σ = 1 (one step
                // of `linspace(1, 1/n, n)`) gives 0/0, NaN timesteps in Diffusers too.
                if shifted.last().is_some_and(|&t| 1.0 - t == 0.0) {
                    let n = sigmas.len();
                    return Err(steps_error(
                        n,
                        format!(
                            "a {n}-step schedule ends at sigma 1, which the scheduler \
                             config's shift_terminal ({terminal}; Qwen-Image's config has one) \
                             cannot stretch: it divides by 1 - last sigma = 0 (Diffusers gives \
                             NaN timesteps); give 2 or more steps"
                        ),
                    ));
                }
                stretch_to_terminal_f32(&shifted, terminal)
            }
            None => shifted,
        };
        self.finish(shifted)
    }

    /// `set_timesteps(num_inference_steps, mu=mu)` without given sigmas (the path of
    /// pipelines other than FluxPipeline): float64 `linspace(σ_max·N, σ_min·N, n) / N`,
    /// shifted in float64, rounded to float32 once.
    pub fn set_timesteps(&mut self, steps: usize, mu: Option<f64>) -> Result<()> {
        if steps == 0 {
            return Err(steps_error(0, "give at least one step"));
        }
        check_schedule_memory(steps)?;
        let n_train = self.config.num_train_timesteps;
        let (sigma_max, sigma_min) = self.train_sigma_range();
        let sigmas: Vec<f64> = linspace(
            sigma_max * n_train as f64,
            sigma_min * n_train as f64,
            steps,
        )
        .into_iter()
        .map(|t| t / n_train as f64)
        .collect();
        let shifted: Vec<f64> = if self.config.use_dynamic_shifting {
            let mu = self.require_mu(mu)?;
            match self.config.time_shift_type {
                TimeShiftType::Exponential => sigmas
                    .iter()
                    .map(|&t| mu.exp() / (mu.exp() + (1.0 / t - 1.0)))
                    .collect(),
                TimeShiftType::Linear => sigmas
                    .iter()
                    .map(|&t| mu / (mu + (1.0 / t - 1.0)))
                    .collect(),
            }
        } else {
            let shift = self.config.shift;
            sigmas
                .iter()
                .map(|&t| shift * t / (1.0 + (shift - 1.0) * t))
                .collect()
        };
        let shifted = match self.config.shift_terminal {
            Some(terminal) => {
                let one_minus: Vec<f64> = shifted.iter().map(|&t| 1.0 - t).collect();
                let scale = one_minus[one_minus.len() - 1] / (1.0 - terminal);
                one_minus.iter().map(|&z| 1.0 - z / scale).collect()
            }
            None => shifted,
        };
        self.finish(shifted.into_iter().map(|x| x as f32).collect())
    }

    /// `sigma_max`, `sigma_min` of the training schedule as the constructor leaves them
    /// (float32 values): `linspace(1, N, N)[::-1] / N`, fixed-shifted unless dynamic.
    fn train_sigma_range(&self) -> (f64, f64) {
        let n = self.config.num_train_timesteps as f32;
        let ends = [1.0f32, 1.0 / n];
        let [max, min] = if self.config.use_dynamic_shifting {
            ends
        } else {
            let shift = self.config.shift as f32;
            let sm1 = (self.config.shift - 1.0) as f32;
            ends.map(|s| shift * s / (1.0 + sm1 * s))
        };
        (max as f64, min as f64)
    }

    fn require_mu(&self, mu: Option<f64>) -> Result<f64> {
        match mu {
            Some(m) if m.is_finite() => Ok(m),
            Some(m) => Err(invalid(
                "mu",
                m.to_string(),
                "mu must be finite (FluxPipeline: calculate_shift(image_seq_len, ...))",
            )),
            None => Err(invalid(
                "mu",
                "none",
                "use_dynamic_shifting is on: pass mu (FluxPipeline: calculate_shift(image_seq_len, ...))",
            )),
        }
    }

    /// Sets the schedule to `sigmas` (a final 0 appended), or refuses sigmas that are not
    /// finite, not in [0, 1] or not non-increasing (each within [`SIGMA_SLACK`] of f32
    /// rounding): what a degenerate config makes of them, changing nothing.
    fn finish(&mut self, sigmas: Vec<f32>) -> Result<()> {
        if let Some((i, &s)) = sigmas
            .iter()
            .enumerate()
            .find(|&(_, &s)| !(s.is_finite() && (0.0..=1.0 + SIGMA_SLACK).contains(&s)))
        {
            return Err(self.degenerate(format!("sigma {i} of {} is {s}", sigmas.len())));
        }
        if let Some(i) = (1..sigmas.len()).find(|&i| sigmas[i] > sigmas[i - 1] + SIGMA_SLACK) {
            return Err(self.degenerate(format!(
                "sigma {i} ({}) is above sigma {} ({}): the schedule must not increase",
                sigmas[i],
                i - 1,
                sigmas[i - 1]
            )));
        }
        let n = self.config.num_train_timesteps as f32;
        self.timesteps = sigmas.iter().map(|&s| s * n).collect();
        self.sigmas = sigmas;
        self.sigmas.push(0.0);
        Ok(())
    }

    /// A schedule the config's numbers make degenerate: `what` went wrong, with the fields
    /// that decide it.
    fn degenerate(&self, what: String) -> CoreError {
        let c = &self.config;
        invalid(
            "scheduler_config.json",
            format!(
                "shift {}, use_dynamic_shifting {}, base_shift {:?}, max_shift {:?}, \
                 shift_terminal {:?}",
                c.shift, c.use_dynamic_shifting, c.base_shift, c.max_shift, c.shift_terminal
            ),
            format!(
                "{what}: these numbers make the schedule degenerate; fix \
                 scheduler/scheduler_config.json (Flux: shift 3.0, base_shift 0.5, max_shift 1.15)"
            ),
        )
    }

    /// The Euler step of step `index`: `sample + (σ[index+1] − σ[index]) · model_output`,
    /// computed in float32 on `ops`' device and returned in `model_output`'s dtype.
    pub fn step(
        &self,
        ops: &dyn Ops,
        model_output: &Tensor,
        sample: &Tensor,
        index: usize,
    ) -> Result<Tensor> {
        if index + 1 >= self.sigmas.len() {
            return Err(invalid(
                "step index",
                index.to_string(),
                format!(
                    "past the schedule's {n} steps (indices 0..{n}; set a schedule first)",
                    n = self.num_steps()
                ),
            ));
        }
        let dt = self.sigmas[index + 1] - self.sigmas[index];
        let to_f32 = |t: &Tensor| -> Result<Tensor> {
            if t.dtype() == DType::F32 {
                Ok(t.clone())
            } else {
                ops.cast(t, DType::F32)
            }
        };
        let sample32 = to_f32(sample)?;
        let out32 = to_f32(model_output)?;
        let delta = ops.affine(&out32, dt, 0.0)?;
        let prev = ops.binary(&sample32, &delta, BinaryOp::Add)?;
        if model_output.dtype() == DType::F32 {
            Ok(prev)
        } else {
            ops.cast(&prev, model_output.dtype())
        }
    }
}

/// `stretch_shift_to_terminal` in float32.
fn stretch_to_terminal_f32(t: &[f32], terminal: f64) -> Vec<f32> {
    let one_minus: Vec<f32> = t.iter().map(|&x| 1.0 - x).collect();
    let scale = one_minus[one_minus.len() - 1] / (1.0 - terminal) as f32;
    one_minus.iter().map(|&z| 1.0 - z / scale).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linspace_matches_numpy_shape_and_ends() {
        assert_eq!(linspace(1.0, 0.25, 4), vec![1.0, 0.75, 0.5, 0.25]);
        assert_eq!(linspace(1.0, 1.0, 1), vec![1.0]);
        assert!(linspace(0.0, 1.0, 0).is_empty());
        assert_eq!(*flux_sigmas(3).last().unwrap(), 1.0 / 3.0);
    }

    /// Issue 34: a refused schedule names what was given (`--steps 1`, the config's
    /// numbers, `mu`), never an empty `scheduler` value.
    #[test]
    fn refusals_name_the_value_given() {
        let named = |e: CoreError| match e {
            CoreError::InvalidOption {
                option,
                value,
                hint,
            } => (option, value, hint),
            other => panic!("expected InvalidOption, got {other}"),
        };
        let mut s = FlowMatchEulerScheduler::new(FlowMatchEulerConfig::qwen_image()).unwrap();
        let (option, value, hint) = named(s.set_flux_schedule(1, 64).unwrap_err());
        assert_eq!((option.as_str(), value.as_str()), ("steps", "1"));
        assert!(
            hint.contains("shift_terminal") && hint.contains("2 or more"),
            "{hint}"
        );
        s.set_flux_schedule(2, 64).expect("two steps");
        let (option, value, _) = named(s.set_timesteps(0, Some(0.5)).unwrap_err());
        assert_eq!((option.as_str(), value.as_str()), ("steps", "0"));
        let (option, value, _) = named(s.set_sigmas(&flux_sigmas(2), None).unwrap_err());
        assert_eq!((option.as_str(), value.as_str()), ("mu", "none"));
        let (option, value, _) = named(s.set_sigmas(&flux_sigmas(2), Some(f64::NAN)).unwrap_err());
        assert_eq!((option.as_str(), value.as_str()), ("mu", "NaN"));
        let linear = FlowMatchEulerConfig {
            time_shift_type: TimeShiftType::Linear,
            base_shift: Some(-0.5),
            max_shift: Some(-0.4),
            ..FlowMatchEulerConfig::flux()
        };
        let mut s = FlowMatchEulerScheduler::new(linear).unwrap();
        let (option, value, hint) = named(s.set_sigmas(&flux_sigmas(4), Some(-0.5)).unwrap_err());
        assert_eq!(option, "scheduler_config.json");
        assert!(
            value.contains("shift") && value.contains("base_shift Some(-0.5)"),
            "{value}"
        );
        assert!(hint.contains("degenerate"), "{hint}");
    }

    #[test]
    fn mu_interpolates_between_base_and_max() {
        let c = FlowMatchEulerConfig::flux();
        assert!((c.mu(256) - 0.5).abs() < 1e-12);
        assert!((c.mu(4096) - 1.15).abs() < 1e-12);
    }

    #[test]
    fn dynamic_shifting_needs_mu_and_unsupported_options_are_refused() {
        let mut s = FlowMatchEulerScheduler::new(FlowMatchEulerConfig::flux()).unwrap();
        assert!(s.set_sigmas(&flux_sigmas(4), None).is_err());
        s.set_flux_schedule(4, 48).unwrap();
        assert_eq!(s.timesteps().len(), 4);
        assert_eq!(s.sigmas().len(), 5);
        assert_eq!(s.sigmas()[0], 1.0);
        assert_eq!(*s.sigmas().last().unwrap(), 0.0);
        let bad = FlowMatchEulerConfig {
            use_karras_sigmas: true,
            ..FlowMatchEulerConfig::flux()
        };
        assert!(FlowMatchEulerScheduler::new(bad).is_err());
    }
}
