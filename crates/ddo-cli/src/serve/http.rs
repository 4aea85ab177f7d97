//! `ddo serve`'s HTTP side (axum): the routes, bearer authentication, the JSON errors, the
//! server-sent events of a job, `/health`, `/metrics` (Prometheus text) and the page.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

use super::api::{Endpoint, Parsed, parse_body};
use super::jobs::{Outcome, Refusal, Shared, error_body, lock};
use crate::error::CliError;

/// The web page (plain HTML, CSS and JS; no build step).
const PAGE: &str = include_str!("page.html");

/// The routes of `ddo serve` on `shared`.
pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/", get(page))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/generate", post(generate))
        .route("/v1/images/generations", post(openai))
        .route("/v1/jobs", post(submit))
        .route("/v1/jobs/{id}", get(job))
        .route("/v1/jobs/{id}/events", get(events))
        .fallback(not_found)
        .with_state(shared)
}

/// A JSON answer with `status`.
fn answer(status: u16, body: &Value) -> Response {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        status,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        body.to_string(),
    )
        .into_response()
}

/// The JSON answer of an error, its status from its kind.
fn refuse(e: &CliError) -> Response {
    let body = error_body(e);
    let status = body["error"]["status"].as_u64().unwrap_or(500) as u16;
    answer(status, &body)
}

/// A JSON error with `status`, `message` and `hint`.
fn refuse_with(status: u16, message: &str, hint: &str) -> Response {
    let e = CliError::runtime(message, hint);
    answer(
        status,
        &json!({"error": {"message": e.message, "status": status}}),
    )
}

/// Whether `a` and `b` are equal, in time that depends on their lengths only.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// `Ok` when the server has no token or the request carries it (`Authorization: Bearer`).
fn authorize(shared: &Shared, headers: &HeaderMap) -> Result<(), Response> {
    let Some(token) = &shared.token else {
        return Ok(());
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match given {
        Some(g) if same_secret(g.as_bytes(), token.as_bytes()) => Ok(()),
        Some(_) => Err(refuse_with(
            401,
            "the bearer token is not this server's",
            "send Authorization: Bearer TOKEN with the server's --token",
        )),
        None => Err(refuse_with(
            401,
            "this server needs a bearer token",
            "send Authorization: Bearer TOKEN with the server's --token",
        )),
    }
}

/// A request body as axum read it, or why not (larger than its 2 MiB limit, say).
type Body = Result<Bytes, BytesRejection>;

/// A request to `endpoint` authorized, its body read and parsed; else the answer that
/// refuses it (401, 413 or 400, as JSON).
fn accept(
    shared: &Shared,
    headers: &HeaderMap,
    endpoint: Endpoint,
    body: Body,
) -> Result<Parsed, Response> {
    authorize(shared, headers)?;
    let body = body.map_err(|r| {
        refuse_with(
            r.status().as_u16(),
            &format!("the request body could not be read: {}", r.body_text()),
            "send a JSON object of at most 2 MiB",
        )
    })?;
    parse_body(endpoint, &body, &shared.loras).map_err(|e| refuse(&e))
}

/// Queues `parsed` and waits for its outcome; a client that goes away (the future
/// dropped) cancels the job at its next step boundary.
async fn run_and_wait(shared: &Arc<Shared>, parsed: Parsed) -> Result<Outcome, Response> {
    let id = shared.submit(parsed).map_err(refusal)?;
    let Some((mut rx, cancel)) = shared.watch(id) else {
        return Err(refuse_with(
            500,
            "the job was lost",
            "send the request again",
        ));
    };
    let guard = CancelOnDrop(Some(cancel));
    loop {
        match shared.events(id, usize::MAX) {
            Some((_, Some(outcome))) => {
                guard.disarm();
                // Delivered here: nobody asks for it again (a job queued with POST
                // /v1/jobs is kept for GET /v1/jobs/{id}).
                shared.forget(id);
                return Ok(outcome);
            }
            Some((_, None)) => {}
            None => {
                return Err(refuse_with(
                    500,
                    "the job was lost",
                    "send the request again",
                ));
            }
        }
        if rx.changed().await.is_err() {
            return Err(refuse_with(
                500,
                "the job was lost",
                "send the request again",
            ));
        }
    }
}

/// Sets a job's cancel flag when dropped armed (the client went away).
struct CancelOnDrop(Option<Arc<AtomicBool>>);

impl CancelOnDrop {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            c.store(true, Ordering::SeqCst);
        }
    }
}

/// The answer to a job that was not queued.
fn refusal(r: Refusal) -> Response {
    match r {
        Refusal::Full(n) => refuse_with(
            429,
            &format!("the queue is full ({n} requests wait)"),
            "send it again later, or start the server with a larger --queue",
        ),
        Refusal::Draining => refuse_with(
            503,
            "the server is shutting down",
            "send it to another ddo serve",
        ),
    }
}

async fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:; connect-src 'self'",
            ),
        ],
        PAGE,
    )
        .into_response()
}

async fn health(State(shared): State<Arc<Shared>>) -> Response {
    let status = if shared.draining.load(Ordering::SeqCst) {
        "draining"
    } else {
        "ok"
    };
    let mut body = shared.about.clone();
    if let Value::Object(m) = &mut body {
        m.insert("status".into(), json!(status));
        m.insert(
            "queue_depth".into(),
            json!(shared.waiting.load(Ordering::SeqCst)),
        );
        m.insert(
            "running".into(),
            json!(shared.running.load(Ordering::SeqCst)),
        );
        m.insert("loras".into(), json!(shared.loras.names()));
        m.insert("token_required".into(), json!(shared.token.is_some()));
    }
    answer(200, &body)
}

async fn metrics(State(shared): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    if let Err(r) = authorize(&shared, &headers) {
        return r;
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        super::metrics::text(&shared),
    )
        .into_response()
}

async fn generate(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    let parsed = match accept(&shared, &headers, Endpoint::Generate, body) {
        Ok(p) => p,
        Err(r) => return r,
    };
    match run_and_wait(&shared, parsed).await {
        Ok(o) => answer(o.status, &o.body),
        Err(r) => r,
    }
}

async fn openai(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    let parsed = match accept(&shared, &headers, Endpoint::Images, body) {
        Ok(p) => p,
        Err(r) => return r,
    };
    match run_and_wait(&shared, parsed).await {
        Ok(o) if o.status == 200 => {
            let created = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            let data: Vec<Value> = o.body["images"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|i| json!({"b64_json": i["b64_png"]}))
                .collect();
            answer(200, &json!({"created": created, "data": data}))
        }
        Ok(o) => answer(o.status, &o.body),
        Err(r) => r,
    }
}

async fn submit(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Body) -> Response {
    let parsed = match accept(&shared, &headers, Endpoint::Generate, body) {
        Ok(p) => p,
        Err(r) => return r,
    };
    let seed = parsed.request.seed;
    match shared.submit(parsed) {
        Ok(id) => answer(
            202,
            &json!({"id": id, "seed": seed, "events": format!("/v1/jobs/{id}/events")}),
        ),
        Err(r) => refusal(r),
    }
}

/// The job id of a request for `/v1/jobs/{text}...`, once the request is authorized; a
/// text that is no id is a 404.
fn job_id(shared: &Shared, headers: &HeaderMap, text: &str) -> Result<u64, Response> {
    authorize(shared, headers)?;
    text.parse().map_err(|_| {
        refuse_with(
            404,
            &format!("no job `{text}`"),
            "use the id POST /v1/jobs answered",
        )
    })
}

async fn job(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let id = match job_id(&shared, &headers, &id) {
        Ok(i) => i,
        Err(r) => return r,
    };
    match shared.events(id, 0) {
        Some((_, Some(o))) => answer(o.status, &o.body),
        Some((events, None)) => {
            let last = events.last().cloned().unwrap_or(Value::Null);
            answer(
                202,
                &json!({"id": id, "status": "pending", "last_event": last}),
            )
        }
        None => refuse_with(
            404,
            &format!("no job {id}"),
            "a finished job is kept for the last 256 jobs; use the id POST /v1/jobs answered",
        ),
    }
}

/// Where a job's event stream is.
struct Cursor {
    shared: Arc<Shared>,
    id: u64,
    next: usize,
    rx: tokio::sync::watch::Receiver<usize>,
    done: bool,
}

async fn events(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let id = match job_id(&shared, &headers, &id) {
        Ok(i) => i,
        Err(r) => return r,
    };
    let Some((rx, _)) = shared.watch(id) else {
        return refuse_with(
            404,
            &format!("no job {id}"),
            "use the id POST /v1/jobs answered",
        );
    };
    let cursor = Cursor {
        shared: Arc::clone(&shared),
        id,
        next: 0,
        rx,
        done: false,
    };
    let stream = futures_util::stream::unfold(cursor, |mut c| async move {
        loop {
            if c.done {
                return None;
            }
            let (events, outcome) = c.shared.events(c.id, c.next)?;
            if let Some(ev) = events.into_iter().next() {
                c.next += 1;
                let name = ev["event"].as_str().unwrap_or("message").to_string();
                // The last event carries the job's answer: the images and the profile, or
                // the error.
                let data = match (&outcome, name.as_str()) {
                    (Some(o), "done" | "error") => {
                        c.done = true;
                        o.body.to_string()
                    }
                    _ => ev.to_string(),
                };
                let event = Event::default().event(name).data(data);
                return Some((Ok::<_, Infallible>(event), c));
            }
            if outcome.is_some() || c.rx.changed().await.is_err() {
                return None;
            }
        }
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::default())
        .into_response()
}

async fn not_found() -> Response {
    refuse_with(
        404,
        "no such endpoint",
        "use POST /v1/generate, POST /v1/images/generations, POST /v1/jobs, GET /v1/jobs/{id}/events, GET /health, GET /metrics, or GET / for the page",
    )
}

/// Locks the counters for the metrics text.
pub(super) fn counters(shared: &Shared) -> std::sync::MutexGuard<'_, super::jobs::Counters> {
    lock(&shared.counters)
}
