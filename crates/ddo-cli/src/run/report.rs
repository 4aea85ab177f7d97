//! `ddo run`'s profile: the report (human and JSON), the stage stopwatch, step times.

use std::path::PathBuf;
use std::time::Instant;

use ddo_metrics::format_bytes;
use ddo_nn::pipeline::PipelineRun;
use ddo_routes::PipelinePlan;
use serde_json::{Value, json};

use crate::setup::Explanation;

/// The guidance of a run, as its family has it.
pub(crate) enum Guidance {
    /// Flux's distilled guidance scale (the guidance embedding).
    Flux(f32),
    /// Qwen-Image's true CFG: its scale, whether it runs, and the profile's words for it.
    TrueCfg {
        /// `true_cfg_scale`.
        scale: f32,
        /// Whether two passes run per step.
        on: bool,
        /// Why it is on or off.
        words: String,
    },
}

pub(crate) struct Report<'a> {
    pub(crate) model: &'a str,
    pub(crate) device: String,
    pub(crate) budget: Option<u64>,
    pub(crate) height: usize,
    pub(crate) width: usize,
    /// Why the size differs from the one asked for.
    pub(crate) size_note: Option<&'a str>,
    pub(crate) steps: usize,
    pub(crate) guidance: Guidance,
    pub(crate) seed: u64,
    pub(crate) prompt: &'a str,
    pub(crate) explanations: &'a [Explanation],
    pub(crate) plan: &'a PipelinePlan,
    pub(crate) run: &'a PipelineRun,
    pub(crate) snapshots: &'a [Value],
    /// The files the images went to (one, or one per image).
    pub(crate) out: &'a [PathBuf],
    pub(crate) save_latents: Option<&'a PathBuf>,
    /// Wall time by stage (see [`Stopwatch`]).
    pub(crate) laps: &'a [(&'static str, f64)],
    /// Seconds of each denoising step but the first, which counts from the run's start
    /// (see [`step_seconds`]).
    pub(crate) step_seconds: &'a [f64],
    pub(crate) total: f64,
    /// What the run made the host hold.
    pub(crate) host: HostUse,
    /// The `--lora` files and the device bytes of their factors.
    pub(crate) loras: (&'a [crate::cli::LoraArg], u64),
}

/// What a run made the host hold, against its host budget (issue 35).
#[derive(Debug, Clone, Copy)]
pub(crate) struct HostUse {
    /// The budget the plan was made within.
    pub(crate) budget: ddo_core::HostBudget,
    /// Most pinned bytes at once (the device's pinned ledger, exact).
    pub(crate) peak_pinned: u64,
    /// The process's peak resident set (`VmHWM`), touched file pages included.
    pub(crate) peak_rss: Option<u64>,
    /// Bytes the process read from storage ([`process_read_bytes`]).
    ///
    /// [`process_read_bytes`]: ddo_core::host_memory::process_read_bytes
    pub(crate) read_bytes: Option<u64>,
}

impl HostUse {
    fn json(&self) -> Value {
        json!({
            "budget_bytes": self.budget.bytes,
            "budget_source": self.budget.source.to_string(),
            "peak_pinned_bytes": self.peak_pinned,
            "peak_rss_bytes": self.peak_rss,
            "read_bytes": self.read_bytes,
        })
    }

    fn line(&self) -> String {
        let rss = self.peak_rss.map_or_else(
            || "peak RSS unknown".to_string(),
            |r| {
                format!(
                    "peak RSS {} (file pages the kernel can take back included)",
                    format_bytes(r)
                )
            },
        );
        let read = self.read_bytes.map_or_else(String::new, |r| {
            format!("; read from storage {}", format_bytes(r))
        });
        format!(
            "host: budget {} ({}); peak pinned {}; {rss}{read}\n",
            format_bytes(self.budget.bytes),
            self.budget.source,
            format_bytes(self.peak_pinned)
        )
    }
}

/// The time between consecutive denoising steps' ends; the first counts from `began` and
/// so also holds prompt encoding and the denoise phase's setup.
pub(crate) fn step_seconds(began: Instant, ends: &[Instant]) -> Vec<f64> {
    std::iter::once(began)
        .chain(ends.iter().copied())
        .zip(ends)
        .map(|(a, b)| b.duration_since(a).as_secs_f64())
        .collect()
}

/// Wall time of `ddo run` by stage: each lap is the time since the previous one (the first
/// counts from the process's start of `run`, argument parsing and input files included).
pub(crate) struct Stopwatch {
    last: Instant,
    pub(crate) laps: Vec<(&'static str, f64)>,
}

impl Stopwatch {
    pub(crate) fn new(started: Instant) -> Self {
        Self {
            last: started,
            laps: Vec::new(),
        }
    }

    pub(crate) fn lap(&mut self, stage: &'static str) {
        let now = Instant::now();
        self.laps
            .push((stage, now.duration_since(self.last).as_secs_f64()));
        self.last = now;
    }

    /// Seconds before the pipeline's first phase began (every lap before `phases`).
    fn before_phases(laps: &[(&'static str, f64)]) -> f64 {
        laps.iter()
            .take_while(|(stage, _)| *stage != "phases")
            .map(|(_, s)| s)
            .sum()
    }
}

/// One `coded:` line per component whose route streams lossless-coded units (its metrics
/// snapshot's `coded`): the component, the coded and raw bytes, and the coded-unit cache's
/// state, path and, when it was not used, why.
fn coded_lines<'a>(components: impl IntoIterator<Item = (&'a str, &'a Value)>) -> String {
    components
        .into_iter()
        .filter_map(|(name, snapshot)| {
            let coded: ddo_metrics::CodedFigures =
                serde_json::from_value(snapshot.get("coded")?.clone()).ok()?;
            Some(format!("coded: {name} {}\n", coded.summary()))
        })
        .collect()
}

fn ms(seconds: f64) -> String {
    if seconds < 1.0 {
        format!("{:.1} ms", seconds * 1e3)
    } else {
        format!("{seconds:.2} s")
    }
}

impl Report<'_> {
    pub(crate) fn json(&self) -> Value {
        let first = self.explanations.first();
        json!({
            "command": "run",
            "model": self.model,
            "device": self.device,
            "vram_budget_bytes": self.budget,
            "height": self.height,
            "width": self.width,
            "size_note": self.size_note,
            "steps": self.steps,
            "guidance": match &self.guidance {
                Guidance::Flux(g) => json!(g),
                Guidance::TrueCfg { .. } => Value::Null,
            },
            "true_cfg": match &self.guidance {
                Guidance::Flux(_) => Value::Null,
                Guidance::TrueCfg { scale, on, words } => json!({"scale": scale, "on": on, "note": words}),
            },
            "seed": self.seed,
            "prompt": self.prompt,
            "memory_plan": self.plan.to_json(),
            "preset": first.map(|e| e.preset.clone()),
            "resolved_preset": first.map(|e| e.resolved_preset.clone()),
            "phases": self.run.phases.iter().map(|p| json!({
                "phase": p.phase,
                "components": p.components,
                "seconds": p.seconds,
                "peak_bytes": p.peak.allocator_peak_bytes,
                "end_bytes": p.peak.allocator_end_bytes,
                "driver_used_sampled_bytes": p.peak.driver_used_sampled_bytes,
                "native_pool": p.peak.native_pool,
                "idle_release": p.idle_release,
                "setup_seconds": p.setup_seconds.iter().map(|(c, s)| json!({"component": c, "seconds": s})).collect::<Vec<_>>(),
                "prepared_seconds": p.prepared_seconds.iter().map(|(c, s)| json!({"component": c, "seconds": s})).collect::<Vec<_>>(),
                "cleanup_seconds": p.cleanup_seconds,
                "setup_calls": p.setup_calls,
                "note": p.note,
            })).collect::<Vec<_>>(),
            "components": self.explanations.iter().zip(self.snapshots).map(|(e, s)| json!({
                "component": e.component,
                "route": e.route,
                "options": e.options,
                "source": e.source,
                "metrics": s,
            })).collect::<Vec<_>>(),
            "decode": self.run.decode,
            "timesteps": self.run.timesteps,
            "output": self.out.first().map(|p| p.display().to_string()),
            "outputs": self.out.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
            "images": self.run.image.shape().first(),
            "latents_output": self.save_latents.map(|p| p.display().to_string()),
            "stage_seconds": self.laps.iter().map(|(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>(),
            "seconds_before_first_phase": Stopwatch::before_phases(self.laps),
            "denoise_step_seconds": self.step_seconds,
            "total_seconds": self.total,
            "host": self.host.json(),
            "loras": self.loras.0.iter().map(|l| json!({
                "path": l.path.display().to_string(),
                "strength": l.strength,
            })).collect::<Vec<_>>(),
            "lora_device_bytes": self.loras.1,
        })
    }

    pub(crate) fn human(&self) -> String {
        let mut s = String::new();
        let first = self.explanations.first();
        let preset = first.map_or(String::new(), |e| {
            if e.preset == e.resolved_preset {
                e.preset.clone()
            } else {
                format!("{} -> {}", e.preset, e.resolved_preset)
            }
        });
        s += &format!(
            "ddo run: {} on {}, budget {}, preset {preset}\n",
            self.model,
            self.device,
            self.budget.map_or("none".into(), format_bytes)
        );
        s += &format!(
            "  {}x{} px, {} steps, {}, seed {}, prompt {}\n",
            self.width,
            self.height,
            self.steps,
            match &self.guidance {
                Guidance::Flux(g) => format!("guidance {g}"),
                Guidance::TrueCfg { words, .. } => words.clone(),
            },
            self.seed,
            self.prompt
        );
        if let Some(n) = self.size_note {
            s += &format!("  note: {n}\n");
        }
        s += "\n";
        s += &format!(
            "{:<16} {:>10} {:>14} {:>14}  {}\n",
            "phase", "time", "peak (exact)", "after cleanup", "component: route"
        );
        for p in &self.run.phases {
            let comps = if p.components.is_empty() {
                vec!["-".to_string()]
            } else {
                p.components.clone()
            };
            for (i, c) in comps.iter().enumerate() {
                if i == 0 {
                    s += &format!(
                        "{:<16} {:>10} {:>14} {:>14}  {c}\n",
                        p.phase,
                        ms(p.seconds),
                        format_bytes(p.peak.allocator_peak_bytes),
                        format_bytes(p.peak.allocator_end_bytes)
                    );
                } else {
                    s += &format!("{:<16} {:>10} {:>14} {:>14}  {c}\n", "", "", "", "");
                }
            }
            if let Some(n) = &p.note {
                s += &format!("{:<16} {n}\n", "");
            }
            if !p.setup_seconds.is_empty() {
                let setups: Vec<String> = p
                    .setup_seconds
                    .iter()
                    .map(|(c, t)| match p.prepared_seconds.iter().find(|(n, _)| n == c) {
                        Some((_, b)) => format!(
                            "{c} {} (attached in the background during the phase before, in {})",
                            ms(*t),
                            ms(*b)
                        ),
                        None => format!("{c} {}", ms(*t)),
                    })
                    .collect();
                s += &format!("{:<16} attach: {}\n", "", setups.join(", "));
            }
            let first = &p.setup_calls;
            if first.plans_built + first.kernel_loads + first.device_allocs > 0
                || first.plan_wait_ns > 0
            {
                s += &format!(
                    "{:<16} first calls: {} plans built in {}, {} waiting for plans, {} kernel modules loaded in {}, {} device segments allocated in {}\n",
                    "",
                    first.plans_built,
                    ms(first.plan_build_ns as f64 / 1e9),
                    ms(first.plan_wait_ns as f64 / 1e9),
                    first.kernel_loads,
                    ms(first.kernel_load_ns as f64 / 1e9),
                    first.device_allocs,
                    ms(first.device_alloc_ns as f64 / 1e9)
                );
            }
            if let Some(pool) = &p.peak.native_pool {
                s += &format!("{:<16} {}\n", "", pool.format_line());
            }
            if let Some(r) = &p.idle_release {
                s += &format!(
                    "{:<16} native idle cache released: {} in {} chunks ({})\n",
                    "",
                    format_bytes(r.bytes),
                    r.chunks,
                    if r.proven {
                        "proven: the driver's free memory rose by as much"
                    } else {
                        "not proven by the driver"
                    }
                );
            }
        }
        s += &format!(
            "\n{:<16} {:<24} {:>8}  {:>26} {:>12} {:>12} {:>12}  {}\n",
            "component",
            "route",
            "forwards",
            "host->device",
            "resident*",
            "streamed/fwd*",
            "pinned peak",
            "decided by"
        );
        for (e, snap) in self.explanations.iter().zip(self.snapshots) {
            let c = &snap["counters"];
            let num = |k: &str| c[k].as_u64().unwrap_or(0);
            let planned = self.plan.component(&e.component);
            // The resolution's own value, as the JSON's `source.route` and the metrics say.
            let decided = &e.resolution.decided_by;
            s += &format!(
                "{:<16} {:<24} {:>8}  {:>26} {:>12} {:>12} {:>12}  {}\n",
                e.component,
                e.route,
                num("forwards"),
                format!(
                    "{} in {} copies",
                    format_bytes(num("h2d_bytes")),
                    num("h2d_copies")
                ),
                format_bytes(planned.map_or(0, |p| p.footprint.resident_bytes)),
                format_bytes(planned.map_or(0, |p| p.footprint.streamed_bytes_per_forward)),
                format_bytes(num("peak_pinned_host_bytes")),
                decided
            );
        }
        s += "* as planned (the route's footprint)\n";
        s += &coded_lines(
            self.explanations
                .iter()
                .map(|e| e.component.as_str())
                .zip(self.snapshots),
        );
        for c in &self.plan.components {
            if c.footprint.pageable_staging && c.footprint.pinned_limit_to_avoid_pageable > 0 {
                s += &format!(
                    "note: {} copies from pageable memory (the pinned limit is below its {} of streamed weights); \
                     --route {}=...:pinned_limit={} would avoid it\n",
                    c.component,
                    format_bytes(c.footprint.streamed_bytes_per_forward),
                    c.component,
                    c.footprint
                        .pinned_limit_to_avoid_pageable
                        .div_ceil(1 << 30)
                        .max(1)
                        .to_string()
                        + "GiB"
                );
            }
        }
        let images = self.run.image.shape().first().copied().unwrap_or(1);
        let first = self.out.first().map(|p| p.as_path());
        let kind = match first.and_then(|p| p.extension()).and_then(|e| e.to_str()) {
            Some("safetensors") if images > 1 => {
                format!("safetensors: sample and latents of {images} images")
            }
            Some("safetensors") => "safetensors: sample, latents".to_string(),
            _ if images > 1 => format!("{images} images, {}x{} PNG", self.width, self.height),
            _ => format!("{}x{} PNG", self.width, self.height),
        };
        let names: Vec<String> = self.out.iter().map(|p| p.display().to_string()).collect();
        s += &format!("\nwrote {} ({kind})", names.join(", "));
        if let Some(p) = self.save_latents {
            s += &format!(", latents to {}", p.display());
        }
        s += &format!("; total {}\n", ms(self.total));
        let laps: Vec<String> = self
            .laps
            .iter()
            .map(|(stage, t)| format!("{stage} {}", ms(*t)))
            .collect();
        s += &format!(
            "wall time: {} ({} before the first phase)\n",
            laps.join(", "),
            ms(Stopwatch::before_phases(self.laps))
        );
        s += &self.host.line();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_coded_component_gets_a_coded_line_with_its_cache_state() {
        let figures = ddo_metrics::CodedFigures {
            coded_bytes: 650,
            raw_bytes: 1000,
            cache: "unavailable".into(),
            cache_note: Some(
                "coded without a cache: /m/w.safetensors.ddo-coded is a FIFO, not a DDO cache"
                    .into(),
            ),
            cache_path: Some("/m/w.safetensors.ddo-coded".into()),
            ..Default::default()
        };
        let snapshots = [
            json!({ "coded": figures }),
            json!({ "counters": {} }),
            Value::Null,
        ];
        let text = coded_lines([
            ("transformer", &snapshots[0]),
            ("vae", &snapshots[1]),
            ("text_encoder", &snapshots[2]),
        ]);
        assert_eq!(text.lines().count(), 1, "{text}");
        assert!(
            text.starts_with("coded: transformer 650 B of 1000 B (0.650)"),
            "{text}"
        );
        assert!(
            text.contains(
                "cache unavailable at /m/w.safetensors.ddo-coded (coded without a cache: \
                 /m/w.safetensors.ddo-coded is a FIFO"
            ),
            "{text}"
        );
    }
}
