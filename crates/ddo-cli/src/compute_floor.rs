//! `ddo bench`'s compute floor (issue 39): the model's flops per forward (counted by the op
//! profiler over one forward) over the rate of the device's own GEMM at the model's largest
//! linear shape, measured in the same process. A resident step then reads as "x compute
//! floor", as a streamed one reads as "x link floor".

use std::time::Instant;

use ddo_core::rng::signed_values;
use ddo_core::{DType, Device, GemmShape, Tensor, ops_of};
use serde::Serialize;

use crate::error::{CliError, CliResult};

/// Calls per timed round, and rounds (the best is kept).
const CALLS: usize = 10;
const ROUNDS: usize = 3;

/// Seconds of back-to-back calls for the sustained rate, taken over the window's second
/// half. A forward runs its GEMMs back to back too: on a power-limited GPU the clock falls
/// within such a window (one H100 at 700 W: 739 TFLOP/s in the first burst, 574-707 later at
/// 1245 MHz), so the burst rate that sets the floor is out of a forward's reach.
const SUSTAIN_SECONDS: f64 = 1.0;

/// The compute floor of one bench.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ComputeFloor {
    /// Floating-point operations of one forward (linears, matmuls, convolutions, attention;
    /// a multiply-add counts two).
    pub flops_per_forward: u64,
    /// The linear shape the rate was measured at (the forward's largest linear).
    pub gemm: GemmShape,
    /// The best rate over the rounds, flop/s.
    pub flops_per_sec: f64,
    /// What ran at that rate: `linear` (the device's own), or the GEMM library's fastest
    /// algorithm where the backend searches them (`Ops::best_gemm_seconds`).
    pub gemm_source: &'static str,
    /// `flops_per_forward / flops_per_sec`.
    pub seconds: f64,
    /// The rate of the device's own `linear` at `gemm` run back to back for about
    /// `SUSTAIN_SECONDS`, over that window's second half, flop/s.
    pub sustained_flops_per_sec: f64,
    /// `flops_per_forward / sustained_flops_per_sec`: the floor at the sustained rate.
    pub sustained_seconds: f64,
    /// The rate of the device's own `linear` at `gemm` (the algorithm a forward's linears
    /// get), flop/s: below `flops_per_sec` where the library's search found a faster one.
    pub linear_flops_per_sec: f64,
    /// Under `--compute fp8`: the rate of the device's `linear_fp8` at `gemm` (a bf16 input,
    /// an E4M3 weight: the input's amax and codes and the fp8 GEMM, what a forward's first
    /// fp8 linear of an activation costs), flop/s; `None` otherwise.
    pub fp8_linear_flops_per_sec: Option<f64>,
    /// Under `--compute fp8`: the same linear again on the same input, whose codes the
    /// backend may keep (`Ops::end_forward` not called between): the fp8 GEMM's own rate
    /// where it keeps them, flop/s; `None` otherwise.
    pub fp8_gemm_flops_per_sec: Option<f64>,
    /// Under `--compute fp8`, why that rate could not be measured (the floor stands
    /// without it).
    pub fp8_linear_error: Option<String>,
}

/// The timed linears' input `x [rows, k]` in the GEMM's dtype, seeded values on the device.
fn activation(ops: &dyn ddo_core::Ops, gemm: GemmShape) -> CliResult<Tensor> {
    Ok(ops.tensor_from_f32(
        &[gemm.rows, gemm.k],
        gemm.dtype,
        &signed_values(1, gemm.rows * gemm.k),
    )?)
}

/// The device's rate (flop/s) for `linear` at `gemm`, and what ran at it: `x [rows, k]` and
/// `w [n, k]` in the GEMM's dtype, a few calls to warm up, then the best of `ROUNDS`
/// rounds of `CALLS` calls, each round timed from a synchronized device to a synchronized
/// device; or the backend's search of its GEMM library's algorithms, where it has one and
/// it is faster.
pub fn gemm_rate(device: &dyn Device, gemm: GemmShape) -> CliResult<GemmRates> {
    let ops = ops_of(device)?;
    let x = activation(ops, gemm)?;
    let w = ops.tensor_from_f32(
        &[gemm.n, gemm.k],
        gemm.dtype,
        &signed_values(2, gemm.n * gemm.k),
    )?;
    let linear = best_seconds_per_call(device, || ops.linear(&x, &w, None))?;
    let sustained = sustained_seconds_per_call(device, || ops.linear(&x, &w, None))?;
    let mut per_call = (linear, "linear");
    drop((x, w));
    if let Some(s) = ops.best_gemm_seconds(&gemm, CALLS)?
        && s > 0.0
        && s < per_call.0
    {
        per_call = (s, "the GEMM library's fastest algorithm");
    }
    let flops = gemm.flops() as f64;
    Ok(GemmRates {
        best: flops / per_call.0,
        source: per_call.1,
        linear: flops / linear,
        sustained: flops / sustained,
    })
}

/// What [`gemm_rate`] measures, flop/s.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GemmRates {
    /// The best burst rate: the device's own `linear`, or its GEMM library's fastest
    /// algorithm where that is faster.
    pub best: f64,
    /// What ran at `best`.
    pub source: &'static str,
    /// The device's own `linear`, best burst.
    pub linear: f64,
    /// The device's own `linear` sustained (`SUSTAIN_SECONDS` back to back).
    pub sustained: f64,
}

/// Seconds per call of `call` on `device` run back to back for about [`SUSTAIN_SECONDS`]
/// (at least two rounds of [`CALLS`]): the mean over the later half of the rounds, each
/// timed from a synchronized device to a synchronized device.
fn sustained_seconds_per_call(
    device: &dyn Device,
    call: impl Fn() -> ddo_core::Result<Tensor>,
) -> CliResult<f64> {
    let start = Instant::now();
    let mut rounds = Vec::new();
    while rounds.len() < 2
        || (start.elapsed().as_secs_f64() < SUSTAIN_SECONDS && rounds.len() < 100_000)
    {
        device.synchronize()?;
        let t0 = Instant::now();
        for _ in 0..CALLS {
            drop(call()?);
        }
        device.synchronize()?;
        rounds.push(t0.elapsed().as_secs_f64());
    }
    let later = &rounds[rounds.len() / 2..];
    let seconds = later.iter().sum::<f64>() / (later.len() * CALLS) as f64;
    if seconds > 0.0 {
        Ok(seconds)
    } else {
        Err(CliError::runtime(
            "the sustained GEMM rate could not be timed (no time passed)",
            "run ddo bench with a larger --height/--width",
        ))
    }
}

/// Seconds per call of `call` on `device`: a few calls to warm up, then the best of
/// [`ROUNDS`] rounds of [`CALLS`] calls, each round timed from a synchronized device to a
/// synchronized device.
fn best_seconds_per_call(
    device: &dyn Device,
    call: impl Fn() -> ddo_core::Result<Tensor>,
) -> CliResult<f64> {
    let run = |calls: usize| -> CliResult<f64> {
        device.synchronize()?;
        let t0 = Instant::now();
        for _ in 0..calls {
            drop(call()?);
        }
        device.synchronize()?;
        Ok(t0.elapsed().as_secs_f64())
    };
    run(2)?;
    let mut best = f64::MAX;
    for _ in 0..ROUNDS {
        best = best.min(run(CALLS)?);
    }
    if best <= 0.0 || best == f64::MAX {
        return Err(CliError::runtime(
            "the GEMM rate could not be timed (no time passed)",
            "run ddo bench with a larger --height/--width",
        ));
    }
    Ok(best / CALLS as f64)
}

/// The rates (flop/s) of the device's `linear_fp8` at `gemm`: `x [rows, k]` in the GEMM's
/// dtype and `w [n, k]` E4M3 with a per-tensor scale, timed as [`gemm_rate`] times `linear`:
/// first with `Ops::end_forward` after each call (the input's codes made every time), then
/// without (codes a backend keeps for the same input are reused: the GEMM alone).
pub fn fp8_linear_rate(device: &dyn Device, gemm: GemmShape) -> CliResult<(f64, f64)> {
    let ops = ops_of(device)?;
    let x = activation(ops, gemm)?;
    // Weights spread over E4M3's range, at a scale that brings them back to about +-1,
    // encoded on the host and moved as a checkpoint's are (a backend may compute on E4M3
    // only as linear weights: no `tensor_from_f32` of them).
    let scale = 1.0 / 256.0;
    let w = Tensor::from_f32(
        vec![gemm.n, gemm.k],
        DType::F8E4M3,
        &signed_values(2, gemm.n * gemm.k)
            .into_iter()
            .map(|v| v * 256.0)
            .collect::<Vec<_>>(),
    )?
    .with_scale(Some(scale))?
    .to_device(device, &device.compute_stream())?;
    let full = best_seconds_per_call(device, || {
        let y = ops.linear_fp8(&x, &w, None);
        ops.end_forward()?;
        y
    })?;
    let kept = best_seconds_per_call(device, || ops.linear_fp8(&x, &w, None));
    ops.end_forward()?;
    let flops = gemm.flops() as f64;
    Ok((flops / full, flops / kept?))
}

/// The floor of `flops_per_forward` at the rate [`gemm_rate`] measures for `gemm` on
/// `device`; with `fp8`, [`fp8_linear_rate`] beside it.
pub fn measure(
    device: &dyn Device,
    flops_per_forward: u64,
    gemm: GemmShape,
    fp8: bool,
) -> CliResult<ComputeFloor> {
    let rates = gemm_rate(device, gemm)?;
    let (fp8_rates, fp8_linear_error) = match fp8.then(|| fp8_linear_rate(device, gemm)) {
        Some(Ok(r)) => (Some(r), None),
        Some(Err(e)) => (None, Some(e.message)),
        None => (None, None),
    };
    Ok(ComputeFloor {
        flops_per_forward,
        gemm,
        flops_per_sec: rates.best,
        gemm_source: rates.source,
        seconds: flops_per_forward as f64 / rates.best,
        sustained_flops_per_sec: rates.sustained,
        sustained_seconds: flops_per_forward as f64 / rates.sustained,
        linear_flops_per_sec: rates.linear,
        fp8_linear_flops_per_sec: fp8_rates.map(|r| r.0),
        fp8_gemm_flops_per_sec: fp8_rates.map(|r| r.1),
        fp8_linear_error,
    })
}

impl ComputeFloor {
    /// One line for `ddo bench`'s header.
    pub fn format_line(&self) -> String {
        let g = &self.gemm;
        // TFLOP at model scale, GFLOP below it.
        let (unit, div) = if self.flops_per_sec >= 1e12 {
            ("T", 1e12)
        } else {
            ("G", 1e9)
        };
        // Where the search beat the device's own linear, what a forward's linears get there.
        let own = if self.linear_flops_per_sec < self.flops_per_sec {
            format!(
                "; DDO's linear {:.1} {unit}FLOP/s there",
                self.linear_flops_per_sec / div
            )
        } else {
            String::new()
        };
        let fp8 = match (
            self.fp8_linear_flops_per_sec,
            self.fp8_gemm_flops_per_sec,
            &self.fp8_linear_error,
        ) {
            (Some(r), g, _) => format!(
                "; fp8 linear (amax, codes, GEMM) {:.1} {unit}FLOP/s there{}",
                r / div,
                g.map_or_else(String::new, |g| format!(
                    ", its input's codes kept {:.1}",
                    g / div
                ))
            ),
            (None, _, Some(e)) => format!("; fp8 linear not timed: {e}"),
            (None, _, None) => String::new(),
        };
        format!(
            "compute floor: {:.3} {unit}FLOP per forward at {:.1} {unit}FLOP/s ({}, {}x{}x{} {}, \
             best of {ROUNDS} x {CALLS} calls in this process{own}{fp8}) = {:.2} ms; sustained \
             ({SUSTAIN_SECONDS} s of linear calls back to back) {:.1} {unit}FLOP/s = {:.2} ms",
            self.flops_per_forward as f64 / div,
            self.flops_per_sec / div,
            self.gemm_source,
            g.rows,
            g.k,
            g.n,
            g.dtype,
            self.seconds * 1e3,
            self.sustained_flops_per_sec / div,
            self.sustained_seconds * 1e3
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_rate_is_positive_and_the_floor_is_flops_over_it() {
        let device = ddo_host::HostDevice::with_capacity(64 << 20).unwrap();
        let gemm = GemmShape {
            rows: 64,
            k: 96,
            n: 80,
            dtype: DType::F32,
        };
        let floor = measure(&*device, 10 * gemm.flops(), gemm, false).unwrap();
        assert!(floor.flops_per_sec > 0.0 && floor.flops_per_sec.is_finite());
        let want = 10.0 * gemm.flops() as f64 / floor.flops_per_sec;
        assert!((floor.seconds - want).abs() <= want * 1e-12);
        // The sustained rate: positive, its floor flops over it, both in the line.
        let r = floor.sustained_flops_per_sec;
        assert!(r > 0.0 && r.is_finite(), "{r}");
        let want = 10.0 * gemm.flops() as f64 / r;
        assert!((floor.sustained_seconds - want).abs() <= want * 1e-12);
        assert!(
            floor.format_line().contains(&format!(
                "sustained (1 s of linear calls back to back) {:.1} GFLOP/s = {:.2} ms",
                r / 1e9,
                want * 1e3
            )),
            "{}",
            floor.format_line()
        );
        assert!(
            floor.format_line().contains("64x96x80 f32"),
            "{}",
            floor.format_line()
        );
        // The host backend searches no GEMM library: its own linear set the rate.
        assert_eq!(floor.gemm_source, "linear");
        assert_eq!(floor.linear_flops_per_sec, floor.flops_per_sec);
        assert!(!floor.format_line().contains("DDO's linear"));
        // Where a search beat the device's own linear, the line gives both rates.
        let searched = ComputeFloor {
            flops_per_sec: 800e12,
            linear_flops_per_sec: 700e12,
            gemm_source: "the GEMM library's fastest algorithm",
            ..floor
        };
        assert!(
            searched
                .format_line()
                .contains("at 800.0 TFLOP/s (the GEMM library's fastest algorithm")
                && searched
                    .format_line()
                    .contains("DDO's linear 700.0 TFLOP/s there"),
            "{}",
            searched.format_line()
        );
        // Nothing of the measurement is left on the device.
        assert_eq!(device.memory_info().allocated, 0);
    }

    #[test]
    fn under_fp8_the_line_gives_the_fp8_linears_rate_beside_the_floor() {
        let device = ddo_host::HostDevice::with_capacity(64 << 20).unwrap();
        let gemm = GemmShape {
            rows: 32,
            k: 64,
            n: 48,
            dtype: DType::BF16,
        };
        let floor = measure(&*device, 4 * gemm.flops(), gemm, true).unwrap();
        let r = floor.fp8_linear_flops_per_sec.unwrap();
        assert!(r > 0.0 && r.is_finite(), "{r}");
        let g = floor.fp8_gemm_flops_per_sec.unwrap();
        assert!(g > 0.0 && g.is_finite(), "{g}");
        assert!(
            floor.format_line().contains("its input's codes kept"),
            "{}",
            floor.format_line()
        );
        assert!(
            floor
                .format_line()
                .contains("fp8 linear (amax, codes, GEMM)"),
            "{}",
            floor.format_line()
        );
        // The floor itself stays the bf16 GEMM's.
        let want = 4.0 * gemm.flops() as f64 / floor.flops_per_sec;
        assert!((floor.seconds - want).abs() <= want * 1e-12);
        assert_eq!(device.memory_info().allocated, 0);
        let plain = measure(&*device, 4 * gemm.flops(), gemm, false).unwrap();
        assert_eq!(plain.fp8_linear_flops_per_sec, None);
        assert_eq!(plain.fp8_gemm_flops_per_sec, None);
        assert_eq!(floor.fp8_linear_error, None);
        assert!(!plain.format_line().contains("fp8 linear"));
    }
}
