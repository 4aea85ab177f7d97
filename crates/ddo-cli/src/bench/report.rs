//! `ddo bench`'s report: the figures of one bench (its JSON, as `--json` and `--out-json`
//! write it) and the table it prints.

use std::path::{Path, PathBuf};

use ddo_metrics::format_bytes;
use serde::Serialize;

use super::CandidateResult;
use crate::compute_floor::ComputeFloor;

/// One bench's figures.
#[derive(Debug, Serialize)]
pub struct BenchReport {
    /// `"bench"`.
    pub command: &'static str,
    /// The model's label.
    pub model: String,
    /// The component benched.
    pub component: String,
    /// The device, in words.
    pub device: String,
    /// The workload's size (rounded to whole latent patches).
    pub height: usize,
    /// The workload's width.
    pub width: usize,
    /// Why the size differs from the one asked for.
    pub size_note: Option<String>,
    /// Timed forwards per candidate.
    pub repeats: usize,
    /// Warm-up forwards per candidate.
    pub warmup: usize,
    /// The host→device rate measured first, bytes a second.
    pub link_bytes_per_sec: f64,
    /// The compute floor (none where no forward was counted).
    pub compute_floor: Option<ComputeFloor>,
    /// Why the compute floor was not measured, where it was tried and failed.
    pub compute_floor_error: Option<String>,
    /// `--compute`: `bf16` or `fp8`.
    pub compute: &'static str,
    /// Under `--compute fp8`: whether the device ran the E4M3 linears on fp8 tensor cores
    /// (else the reference implementation ran).
    pub fp8_tensor_cores: Option<bool>,
    /// Under `--compute fp8` without fp8 tensor cores: why the reference ran
    /// ([`ddo_core::Ops::fp8_reference_reason`]).
    pub fp8_reference_reason: Option<String>,
    /// The disk probes (`--weights`).
    pub disk: Vec<ddo_core::disk::DiskRate>,
    /// Each candidate's figures.
    pub candidates: Vec<CandidateResult>,
}

impl BenchReport {
    /// `outputs_line` of the candidates.
    pub fn outputs_line(&self) -> String {
        outputs_line(
            self.candidates
                .iter()
                .map(|r| (r.label.as_str(), r.output_fnv1a.as_deref())),
        )
    }

    /// The table `ddo bench` prints: the header (link, compute and disk floors), one row per
    /// candidate, then what candidates add (coded streaming, LoRA switches, timelines, and
    /// with `profile` the per-op profiles), and the files written.
    pub fn format_text(
        &self,
        profile: bool,
        out_json: Option<&Path>,
        plotted: Option<&(PathBuf, PathBuf)>,
    ) -> String {
        let mut s = format!(
            "ddo bench: {} of {} on {}, {}x{} px, {} timed forwards ({} warm-up)\n",
            self.component,
            self.model,
            self.device,
            self.width,
            self.height,
            self.repeats,
            self.warmup
        );
        if let Some(n) = &self.size_note {
            s += &format!("  note: {n}\n");
        }
        s += &format!(
            "link floor: host->device {:.2} GB/s measured in this process{}\n",
            self.link_bytes_per_sec / 1e9,
            if self.disk.is_empty() {
                ""
            } else {
                "; a candidate reading from the disk each forward: the larger of that and its disk bytes at the disk's best rate below"
            }
        );
        if let Some(c) = &self.compute_floor {
            s += &format!("{}\n", c.format_line());
        }
        if let Some(e) = &self.compute_floor_error {
            s += &format!("compute floor: not measured: {e}\n");
        }
        if let Some(native) = self.fp8_tensor_cores {
            if native {
                s += "--compute fp8: the E4M3 linears ran on fp8 tensor cores\n";
            } else {
                s += &format!(
                    "--compute fp8: DDO's reference implementation ran ({})\n",
                    self.fp8_reference_reason
                        .as_deref()
                        .unwrap_or("no fp8 tensor cores")
                );
            }
        }
        for d in &self.disk {
            s += &format!(
                "disk: {:.2} GB/s cold, {} of {} file(s) read by {} thread(s){}\n",
                d.bytes_per_sec / 1e9,
                format_bytes(d.bytes),
                d.files,
                d.readers,
                if d.direct {
                    " with O_DIRECT"
                } else {
                    " through the page cache after dropping the files' cached pages"
                }
            );
        }
        s += "\n";
        let lw = self
            .candidates
            .iter()
            .map(|r| r.label.len())
            .max()
            .unwrap_or(9)
            .max(9);
        s += &format!(
            "{:<lw$} {:>10} {:>10} {:>10} {:>12} {:>13} {:>10} {:>8} {:>10}\n",
            "candidate",
            "median",
            "min",
            "max",
            "peak",
            "streamed/fwd",
            "floor",
            "x floor",
            "x compute"
        );
        let ms = |v: f64| format!("{:.2} ms", v * 1e3);
        for r in &self.candidates {
            if let Some(e) = &r.error {
                s += &format!("{:<lw$} refused: {e}\n", r.label);
                continue;
            }
            s += &format!(
                "{:<lw$} {:>10} {:>10} {:>10} {:>12} {:>13} {:>10} {:>8} {:>10}\n",
                r.label,
                ms(r.median_seconds),
                ms(r.min_seconds),
                ms(r.max_seconds),
                format_bytes(r.peak_bytes),
                format_bytes(r.streamed_bytes_per_forward),
                ms(r.floor_seconds),
                r.ratio_to_floor.map_or("-".into(), |x| format!("{x:.2}")),
                r.ratio_to_compute_floor
                    .map_or("-".into(), |x| format!("{x:.2}"))
            );
        }
        // The coded-unit cache's state (and why it was not used) in the text too, not only
        // in the JSON.
        for r in &self.candidates {
            if let Some(c) = &r.coded {
                s += &format!("{}: {}\n", r.label, c.format_line());
            }
        }
        for r in &self.candidates {
            if let Some(w) = &r.lora_switch {
                s += &format!(
                    "{}: LoRA switch {:.1} ms for {} of factors ({:.2}x the bound 0.1 s + bytes over the link, {:.1} ms; reading the files before it {:.1} ms)\n",
                    r.label,
                    w.seconds * 1e3,
                    format_bytes(w.bytes),
                    w.seconds / w.bound_seconds,
                    w.bound_seconds * 1e3,
                    w.read_seconds * 1e3
                );
            }
        }
        s += &self.outputs_line();
        for r in &self.candidates {
            if let Some(t) = &r.timeline {
                s += &format!(
                    "\n{}: {}",
                    r.label,
                    t.format_text((r.floor_seconds > 0.0).then_some(r.floor_seconds * 1e3))
                );
            }
        }
        if profile {
            for r in &self.candidates {
                match &r.op_profile {
                    Some(p) => {
                        s += &format!("\n{}: device time per op class, one forward\n", r.label);
                        s += &p.format_text();
                        if let Some(q) = r.median_enqueued_seconds {
                            s += &format!(
                                "host: a timed forward queued in {:.2} ms (median) of its {:.2} ms\n",
                                q * 1e3,
                                r.median_seconds * 1e3
                            );
                        }
                    }
                    None if r.error.is_none() => {
                        s += &format!("\n{}: this device keeps no per-op profile\n", r.label);
                    }
                    None => {}
                }
            }
        }
        if let Some(p) = out_json {
            s += &format!("\nwrote {}\n", p.display());
        }
        if let Some((svg, png)) = plotted {
            s += &format!("wrote {} and {}\n", svg.display(), png.display());
        }
        s
    }
}

/// Whether candidates' last forwards gave one output, from each candidate's label and the
/// FNV-1a hash of its output bytes (none where it has no output): a line naming the one hash,
/// or each hash with its candidates where they differ (routes move the same bytes, so they
/// should not); empty with fewer than two outputs.
fn outputs_line<'a>(candidates: impl Iterator<Item = (&'a str, Option<&'a str>)>) -> String {
    let mut by_hash: Vec<(&str, Vec<&str>)> = Vec::new();
    for (label, hash) in candidates {
        let Some(h) = hash else {
            continue;
        };
        match by_hash.iter_mut().find(|(k, _)| *k == h) {
            Some((_, labels)) => labels.push(label),
            None => by_hash.push((h, vec![label])),
        }
    }
    match by_hash.as_slice() {
        [] => String::new(),
        [(_, labels)] if labels.len() < 2 => String::new(),
        [(h, labels)] => format!(
            "output: the {} candidates' last forwards gave one output (FNV-1a {h})\n",
            labels.len()
        ),
        groups => {
            let mut s = "output: the candidates' last forwards differ (FNV-1a):\n".to_string();
            for (h, labels) in groups {
                s += &format!("  {h}: {}\n", labels.join(", "));
            }
            s
        }
    }
}

#[cfg(test)]
mod tests {
    use super::outputs_line;

    #[test]
    fn outputs_agree_differ_or_are_too_few_to_compare() {
        let line = |c: &[(&'static str, Option<&'static str>)]| outputs_line(c.iter().copied());
        assert_eq!(
            line(&[("none", Some("ab")), ("leaf", Some("ab")), ("bad", None)]),
            "output: the 2 candidates' last forwards gave one output (FNV-1a ab)\n"
        );
        assert_eq!(
            line(&[
                ("none", Some("ab")),
                ("leaf", Some("cd")),
                ("block", Some("ab"))
            ]),
            "output: the candidates' last forwards differ (FNV-1a):\n  ab: none, block\n  cd: leaf\n"
        );
        assert_eq!(line(&[("none", Some("ab")), ("bad", None)]), "");
        assert_eq!(line(&[]), "");
    }
}
