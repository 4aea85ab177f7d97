//! `ddo serve` (issue 38): a [`Session`] loaded once and kept warm behind an HTTP API and a
//! web page, on axum and tokio.
//!
//! - `POST /v1/generate`: DDO's request (`ddo run`'s options in snake case, LoRAs by name);
//!   answers `{"id", "images": [{"b64_png", "seed"}], "profile": {...}}` — the profile is
//!   `ddo run --json`'s. The same seed and options give the same PNG bytes as `ddo run`.
//! - `POST /v1/images/generations`: OpenAI's images shape (`prompt`, `n`, `size`,
//!   `response_format: b64_json`).
//! - `POST /v1/jobs` queues a request and answers its id at once; `GET /v1/jobs/{id}` is its
//!   answer once done, `GET /v1/jobs/{id}/events` its server-sent events (each step, then the
//!   answer).
//! - `GET /health`, `GET /metrics` (Prometheus text, `ddo_*`), `GET /` (the page).
//!
//! One device runs one job at a time ([`jobs`]); the rest wait in a FIFO queue of
//! `--queue N` (past it, 429). A client that goes away cancels its job at the next step
//! boundary. SIGTERM (or SIGINT) finishes the running job, refuses new ones, cancels the
//! waiting ones and exits 0. It binds 127.0.0.1:8910 unless told otherwise; any other
//! address needs `--token`. A request never names a server path: LoRAs come from
//! `--lora-dir`, by file name. The server keeps nothing a second process would need, so
//! several behind a load balancer serve as one.

pub mod api;
mod http;
pub mod jobs;
mod metrics;

use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr};

use serde_json::json;

use crate::cli::ServeArgs;
use crate::error::{CliError, CliResult};
use crate::progress::ProgressBar;
use crate::session::{LoadOptions, Request, Session};

/// Where `ddo serve` listens without `--listen`.
pub const DEFAULT_LISTEN: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 8910);

/// Requests that may wait without `--queue`.
pub const DEFAULT_QUEUE: usize = 16;

/// Refuses to listen beyond this machine without a token, and an empty token.
fn check_listen(listen: SocketAddr, token: Option<&str>) -> CliResult<()> {
    if token.is_some_and(|t| t.trim().is_empty()) {
        return Err(CliError::usage(
            "--token is empty",
            "give a secret clients send as Authorization: Bearer SECRET",
        ));
    }
    if !listen.ip().is_loopback() && token.is_none() {
        return Err(CliError::usage(
            format!(
                "--listen {listen} without --token would let anyone who reaches this machine run jobs"
            ),
            "add --token SECRET (clients send Authorization: Bearer SECRET), or listen on 127.0.0.1",
        ));
    }
    Ok(())
}

/// Runs `ddo serve` until SIGTERM or SIGINT; says where it listens on `out`.
pub fn serve(args: &ServeArgs, out: &mut dyn Write) -> CliResult<()> {
    // Before any thread allocates: a server's heap stays where its first requests left it.
    ddo_core::host_memory::one_heap_arena();
    let listen = args.listen.unwrap_or(DEFAULT_LISTEN);
    check_listen(listen, args.token.as_deref())?;
    let loras = api::LoraDir::read(args.lora_dir.as_deref())?;
    let options = LoadOptions::of(&args.load, (&[], args.lora_allow_unmatched, false))?;
    let family = options.family()?;
    let mut bar = ProgressBar::new();
    let mut session = Session::load(&options, &mut bar, &mut *out, args.json)?;
    session.keep_host_between_requests(true);
    bar.finish();
    let defaults = Request::default().check(family, session.is_tiny())?;
    let about = json!({
        "model": session.model_label(),
        "device": session.device().id().to_string(),
        "family": format!("{family:?}"),
        "defaults": {"width": defaults.width, "height": defaults.height, "steps": defaults.steps},
        "compute": options.compute.as_str(),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| CliError::runtime(format!("cannot start the server's runtime: {e}"), ""))?;
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind(listen))
        .map_err(|e| {
            CliError::usage(
                format!("cannot listen on {listen}: {e}"),
                "choose another address or port with --listen ADDR:PORT (port 0: any free one)",
            )
        })?;
    let local = listener
        .local_addr()
        .map_err(|e| CliError::runtime(format!("cannot read the bound address: {e}"), ""))?;
    let (shared, rx) = jobs::Shared::new(
        args.queue.unwrap_or(DEFAULT_QUEUE),
        about,
        loras,
        args.token.clone(),
    );
    let vram_budget = args.load.vram_budget;
    let worker = {
        let shared = std::sync::Arc::clone(&shared);
        std::thread::Builder::new()
            .name("ddo-serve-worker".into())
            .spawn(move || jobs::work(session, rx, shared, vram_budget))
            .map_err(|e| CliError::runtime(format!("cannot start the worker: {e}"), ""))?
    };
    let line = if args.json {
        json!({
            "listening": format!("http://{local}"),
            "model": shared.about["model"],
            "device": shared.about["device"],
        })
        .to_string()
    } else {
        format!(
            "ddo serve: {} on {}; listening on http://{local} (page: http://{local}/)",
            shared.about["model"].as_str().unwrap_or(""),
            shared.about["device"].as_str().unwrap_or(""),
        )
    };
    writeln!(out, "{line}")
        .and_then(|()| out.flush())
        .map_err(|e| CliError::runtime(format!("cannot write: {e}"), ""))?;
    let app = http::router(std::sync::Arc::clone(&shared));
    let served = runtime.block_on(async {
        let stop = {
            let shared = std::sync::Arc::clone(&shared);
            async move {
                let mut term =
                    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    {
                        Ok(s) => s,
                        Err(_) => return std::future::pending().await,
                    };
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
                shared.drain();
            }
        };
        axum::serve(listener, app)
            .with_graceful_shutdown(stop)
            .await
    });
    shared.drain();
    let _ = worker.join();
    served.map_err(|e| CliError::runtime(format!("the server stopped: {e}"), ""))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_listens_without_a_token() {
        let any: SocketAddr = "0.0.0.0:8910".parse().unwrap();
        let e = check_listen(any, None).unwrap_err().to_string();
        assert!(e.contains("--token"), "{e}");
        check_listen(any, Some("secret")).unwrap();
        check_listen(DEFAULT_LISTEN, None).unwrap();
        check_listen("[::1]:0".parse().unwrap(), None).unwrap();
        assert!(check_listen(DEFAULT_LISTEN, Some(" ")).is_err());
    }
}
