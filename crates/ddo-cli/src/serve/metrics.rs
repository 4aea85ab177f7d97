//! `GET /metrics`: Prometheus' text format, every series named `ddo_*`.

use std::fmt::Write;
use std::sync::atomic::Ordering;

use super::jobs::Shared;

/// One metric's `# HELP` and `# TYPE` lines and its samples (`labels`, value).
fn metric(out: &mut String, name: &str, kind: &str, help: &str, samples: &[(String, f64)]) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    for (labels, value) in samples {
        let _ = writeln!(out, "{name}{labels} {value}");
    }
}

/// A label value escaped as the text format asks (backslash, quote, newline).
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The metrics of `shared` now.
pub fn text(shared: &Shared) -> String {
    let c = super::http::counters(shared);
    let mut out = String::new();
    let plain = |v: f64| vec![(String::new(), v)];
    metric(
        &mut out,
        "ddo_queue_depth",
        "gauge",
        "Requests waiting behind the running one.",
        &plain(shared.waiting.load(Ordering::SeqCst) as f64),
    );
    metric(
        &mut out,
        "ddo_jobs_running",
        "gauge",
        "Whether a request runs on the device now.",
        &plain(u8::from(shared.running.load(Ordering::SeqCst)).into()),
    );
    let finished: Vec<(String, f64)> = ["ok", "error", "cancelled"]
        .iter()
        .map(|k| {
            (
                format!("{{outcome=\"{k}\"}}"),
                c.finished.get(k).copied().unwrap_or(0) as f64,
            )
        })
        .collect();
    metric(
        &mut out,
        "ddo_jobs_finished_total",
        "counter",
        "Requests finished, by outcome.",
        &finished,
    );
    metric(
        &mut out,
        "ddo_requests_refused_total",
        "counter",
        "Requests refused because the queue was full (429).",
        &plain(c.refused_full as f64),
    );
    metric(
        &mut out,
        "ddo_step_seconds",
        "summary",
        "Denoising step wall time.",
        &[
            ("_sum".into(), c.step_seconds.0),
            ("_count".into(), c.step_seconds.1 as f64),
        ],
    );
    metric(
        &mut out,
        "ddo_job_seconds",
        "summary",
        "Wall time of whole requests (phases and PNG encoding).",
        &[
            ("_sum".into(), c.job_seconds.0),
            ("_count".into(), c.job_seconds.1 as f64),
        ],
    );
    metric(
        &mut out,
        "ddo_device_allocated_bytes",
        "gauge",
        "Device memory DDO holds after the last request.",
        &plain(c.device_bytes.0 as f64),
    );
    metric(
        &mut out,
        "ddo_pinned_host_bytes",
        "gauge",
        "Pinned host memory DDO holds after the last request.",
        &plain(c.device_bytes.1 as f64),
    );
    metric(
        &mut out,
        "ddo_host_registrations_total",
        "counter",
        "Host ranges of the weights page-locked so far (a warm request reuses them: 0 more).",
        &plain(c.host_registrations as f64),
    );
    // Before the first job: now.
    let [rss, anon, heap] = match c.host_after_job {
        [None, None, None] => super::jobs::host_now(),
        sample => sample,
    };
    if let Some(rss) = rss {
        metric(
            &mut out,
            "ddo_host_resident_bytes",
            "gauge",
            "The process's resident memory after the last request (its freed heap returned).",
            &plain(rss as f64),
        );
    }
    if let Some(anon) = anon {
        metric(
            &mut out,
            "ddo_host_anonymous_bytes",
            "gauge",
            "The process's resident anonymous memory after the last request (heap, pinned \
             buffers; not file pages).",
            &plain(anon as f64),
        );
    }
    if let Some(heap) = heap {
        metric(
            &mut out,
            "ddo_host_heap_bytes",
            "gauge",
            "Bytes the allocator has handed out and not had back after the last request (a \
             leak grows it; fragmentation does not).",
            &plain(heap as f64),
        );
    }
    let routes: Vec<(String, f64)> = c
        .routes
        .iter()
        .map(|(component, route)| {
            (
                format!(
                    "{{component=\"{}\",route=\"{}\"}}",
                    label(component),
                    label(route)
                ),
                1.0,
            )
        })
        .collect();
    metric(
        &mut out,
        "ddo_route_info",
        "gauge",
        "Each component's route in the last plan.",
        &routes,
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_escaped() {
        assert_eq!(label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
