//! The jobs of `ddo serve`: one GPU runs one job at a time, on a thread that owns the
//! [`Session`]; the rest wait in a bounded FIFO queue. Each job keeps its events (per-step
//! progress, then its result or error) for `GET /v1/jobs/{id}/events`, and a cancel flag a
//! client that goes away sets: the job stops at its next step boundary, or never starts.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use base64::Engine;
use serde_json::{Value, json};

use super::api::Parsed;
use crate::error::{CliError, ErrorKind};
use crate::io::{HostTensor, encode_png};
use crate::session::{Observer, Session};

/// Finished jobs kept for `GET /v1/jobs/{id}` and their events (the oldest go first).
pub const KEPT_JOBS: usize = 256;

/// How a job ended, as HTTP says it: a status and a JSON body.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// 200, or the error's status.
    pub status: u16,
    /// The answer (`{"images": [...], "profile": {...}}`) or `{"error": ...}`.
    pub body: Value,
}

/// A job's state, shared between the HTTP handlers and the worker.
#[derive(Debug)]
pub struct JobState {
    /// Its events so far: `{"event": "queued" | "progress" | "done" | "error", ...}`.
    pub events: Vec<Value>,
    /// How it ended, once it has.
    pub outcome: Option<Outcome>,
    /// Set when the client went away: the job stops at the next step boundary.
    pub cancel: Arc<AtomicBool>,
    /// Tells waiting handlers that an event came (its value: the event count).
    pub changed: tokio::sync::watch::Sender<usize>,
}

/// One queued job: its id and request.
pub struct Job {
    /// The job's id.
    pub id: u64,
    /// What it runs.
    pub parsed: Parsed,
    /// The seed it runs with (returned with each image).
    pub seed: u64,
}

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct Counters {
    /// Jobs finished, by outcome (`ok`, `error`, `cancelled`).
    pub finished: BTreeMap<&'static str, u64>,
    /// Requests refused because the queue was full.
    pub refused_full: u64,
    /// Denoising step seconds, summed, and how many.
    pub step_seconds: (f64, u64),
    /// Seconds of whole jobs, summed, and how many.
    pub job_seconds: (f64, u64),
    /// Each component's route in the last plan.
    pub routes: Vec<(String, String)>,
    /// The device's memory after the last job: allocated, pinned host.
    pub device_bytes: (u64, u64),
    /// Host ranges the device has page-locked so far (`Device::host_registrations`).
    pub host_registrations: u64,
    /// After the last job: the process's resident and resident anonymous bytes (its freed
    /// heap returned to the kernel first) and the allocator's in-use bytes (`None` before
    /// the first job, or where they cannot be read).
    pub host_after_job: [Option<u64>; 3],
}

/// What the HTTP side and the worker share.
pub struct Shared {
    /// Jobs by id (running, waiting, and the last [`KEPT_JOBS`] finished).
    jobs: Mutex<BTreeMap<u64, JobState>>,
    /// Finished job ids, oldest first.
    finished: Mutex<VecDeque<u64>>,
    /// The queue's sending side (`None` once the server drains).
    sender: Mutex<Option<SyncSender<Job>>>,
    next_id: AtomicU64,
    /// `--queue`: how many jobs may wait.
    pub queue: usize,
    /// Jobs waiting (not the running one).
    pub waiting: AtomicUsize,
    /// Whether a job runs now.
    pub running: AtomicBool,
    /// Set by SIGTERM: new jobs are refused, waiting ones cancelled.
    pub draining: AtomicBool,
    /// `/metrics`' counters.
    pub counters: Mutex<Counters>,
    /// The model's name, the device's, the family's defaults (for `/health` and the page).
    pub about: Value,
    /// The LoRAs requests may name.
    pub loras: super::api::LoraDir,
    /// `--token`.
    pub token: Option<String>,
}

/// Locks `m`, taking the data of a lock a panicking thread held (the worker catches its
/// panics; the data stays consistent between statements).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Why a job was not queued.
pub enum Refusal {
    /// The queue is full (429).
    Full(usize),
    /// The server is shutting down (503).
    Draining,
}

impl Shared {
    /// A new state with a queue of `queue` waiting jobs; the receiver goes to the worker.
    pub fn new(
        queue: usize,
        about: Value,
        loras: super::api::LoraDir,
        token: Option<String>,
    ) -> (Arc<Self>, Receiver<Job>) {
        let (tx, rx) = std::sync::mpsc::sync_channel(queue);
        (
            Arc::new(Self {
                jobs: Mutex::new(BTreeMap::new()),
                finished: Mutex::new(VecDeque::new()),
                sender: Mutex::new(Some(tx)),
                next_id: AtomicU64::new(1),
                queue,
                waiting: AtomicUsize::new(0),
                running: AtomicBool::new(false),
                draining: AtomicBool::new(false),
                counters: Mutex::new(Counters::default()),
                about,
                loras,
                token,
            }),
            rx,
        )
    }

    /// Queues `parsed`; returns its id, or why not.
    pub fn submit(&self, parsed: Parsed) -> Result<u64, Refusal> {
        if self.draining.load(Ordering::SeqCst) {
            return Err(Refusal::Draining);
        }
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let seed = parsed.request.seed.unwrap_or(0);
        let (changed, _) = tokio::sync::watch::channel(1);
        lock(&self.jobs).insert(
            id,
            JobState {
                events: vec![json!({"event": "queued", "id": id, "seed": seed})],
                outcome: None,
                cancel: Arc::new(AtomicBool::new(false)),
                changed,
            },
        );
        let sent = match &*lock(&self.sender) {
            Some(tx) => {
                self.waiting.fetch_add(1, Ordering::SeqCst);
                tx.try_send(Job { id, parsed, seed }).map_err(|e| {
                    self.waiting.fetch_sub(1, Ordering::SeqCst);
                    match e {
                        TrySendError::Full(_) => Refusal::Full(self.queue),
                        TrySendError::Disconnected(_) => Refusal::Draining,
                    }
                })
            }
            None => Err(Refusal::Draining),
        };
        if let Err(refusal) = sent {
            lock(&self.jobs).remove(&id);
            if matches!(refusal, Refusal::Full(_)) {
                lock(&self.counters).refused_full += 1;
            }
            return Err(refusal);
        }
        Ok(id)
    }

    /// A receiver of job `id`'s event count, and its cancel flag (`None`: no such job).
    pub fn watch(&self, id: u64) -> Option<(tokio::sync::watch::Receiver<usize>, Arc<AtomicBool>)> {
        lock(&self.jobs)
            .get(&id)
            .map(|j| (j.changed.subscribe(), Arc::clone(&j.cancel)))
    }

    /// Job `id`'s events from `from` on, and its outcome once it has one.
    pub fn events(&self, id: u64, from: usize) -> Option<(Vec<Value>, Option<Outcome>)> {
        lock(&self.jobs).get(&id).map(|j| {
            (
                j.events
                    .get(from..)
                    .map(<[Value]>::to_vec)
                    .unwrap_or_default(),
                j.outcome.clone(),
            )
        })
    }

    /// Adds `event` to job `id`, and its outcome when it is the last.
    fn push(&self, id: u64, event: Value, outcome: Option<Outcome>) {
        let mut jobs = lock(&self.jobs);
        if let Some(j) = jobs.get_mut(&id) {
            j.events.push(event);
            if outcome.is_some() {
                j.outcome = outcome;
            }
            j.changed.send_replace(j.events.len());
        }
    }

    /// Marks job `id` finished and forgets the oldest finished jobs past [`KEPT_JOBS`].
    fn retire(&self, id: u64) {
        let mut finished = lock(&self.finished);
        if !lock(&self.jobs).contains_key(&id) {
            return; // forgotten already: its client had it
        }
        finished.push_back(id);
        while finished.len() > KEPT_JOBS {
            if let Some(old) = finished.pop_front() {
                lock(&self.jobs).remove(&old);
            }
        }
    }

    /// Forgets job `id` (its answer was delivered to the client that waited for it), so it
    /// takes none of the [`KEPT_JOBS`] places of jobs queued with `POST /v1/jobs`. The
    /// locks are taken in `Shared::retire`'s order.
    pub fn forget(&self, id: u64) {
        let mut finished = lock(&self.finished);
        finished.retain(|&f| f != id);
        lock(&self.jobs).remove(&id);
    }

    /// Whether job `id` was cancelled.
    fn cancelled(&self, id: u64) -> Option<Arc<AtomicBool>> {
        lock(&self.jobs).get(&id).map(|j| Arc::clone(&j.cancel))
    }

    /// SIGTERM: refuses new jobs and cancels the waiting ones (the running one finishes);
    /// the worker ends once the queue is empty.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
        lock(&self.sender).take();
    }
}

/// The worker's [`Observer`]: each step an event; the cancel flag read at each boundary.
struct JobObserver<'a> {
    shared: &'a Shared,
    id: u64,
    cancel: Arc<AtomicBool>,
}

impl Observer for JobObserver<'_> {
    fn progress(&mut self, phase: &str, done: usize, total: usize) {
        self.shared.push(
            self.id,
            json!({"event": "progress", "phase": phase, "done": done, "total": total}),
            None,
        );
    }

    fn cancel_flag(&self) -> Option<Arc<AtomicBool>> {
        Some(Arc::clone(&self.cancel))
    }
}

/// The HTTP status of an error: 400 for a bad request, 422 for one that cannot run here
/// (no plan fits the budget), 499 for a cancelled one, 500 otherwise.
pub fn status_of(e: &CliError) -> u16 {
    match e.kind {
        ErrorKind::Usage => 400,
        ErrorKind::DoesNotFit => 422,
        ErrorKind::Cancelled => 499,
        ErrorKind::Runtime => 500,
    }
}

/// The JSON of an error.
pub fn error_body(e: &CliError) -> Value {
    json!({"error": {"message": e.message, "status": status_of(e)}})
}

/// The worker: runs the queue's jobs one at a time on `session` until the queue closes.
pub fn work(
    mut session: Session,
    rx: Receiver<Job>,
    shared: Arc<Shared>,
    vram_budget: Option<u64>,
) {
    // Jobs run so far: each answer says which it was (FIFO order is visible to clients).
    let mut order = 0u64;
    while let Ok(job) = rx.recv() {
        order += 1;
        shared.waiting.fetch_sub(1, Ordering::SeqCst);
        let Some(cancel) = shared.cancelled(job.id) else {
            continue;
        };
        let outcome = if cancel.load(Ordering::SeqCst) || shared.draining.load(Ordering::SeqCst) {
            Err(CliError {
                kind: ErrorKind::Cancelled,
                message: "the request was cancelled before it ran: the client went away, or the server is shutting down".into(),
            })
        } else {
            shared.running.store(true, Ordering::SeqCst);
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                run_job(&mut session, &job, &shared, &cancel, vram_budget)
            }))
            .unwrap_or_else(|_| {
                Err(CliError::runtime(
                    "internal failure while making the image",
                    "this is a bug in ddo, please report it with the request",
                ))
            });
            shared.running.store(false, Ordering::SeqCst);
            r
        };
        let mut counters = lock(&shared.counters);
        let (event, result) = match outcome {
            Ok(mut body) => {
                body["order"] = json!(order);
                *counters.finished.entry("ok").or_default() += 1;
                (
                    json!({"event": "done", "status": 200}),
                    Outcome { status: 200, body },
                )
            }
            Err(e) => {
                let status = status_of(&e);
                let key = if status == 499 { "cancelled" } else { "error" };
                *counters.finished.entry(key).or_default() += 1;
                let body = error_body(&e);
                (
                    json!({"event": "error", "status": status, "error": body["error"].clone()}),
                    Outcome { status, body },
                )
            }
        };
        let info = session.device().memory_info();
        counters.device_bytes = (info.allocated, info.pinned_host);
        counters.host_registrations = session.device().host_registrations();
        drop(counters);
        // What the request freed goes back to the kernel: the process's resident set
        // after a request is the next one's start. It is read here, on the worker, before
        // the answer is handed to its handler: a reading at scrape time would also count
        // whatever the HTTP threads happen to hold then (the answers in flight, the
        // allocator's free lists of their arenas), which varies by a megabyte or so from
        // one scrape to the next.
        ddo_core::host_memory::return_free_heap();
        lock(&shared.counters).host_after_job = host_now();
        shared.push(job.id, event, Some(result));
        shared.retire(job.id);
    }
}

/// The process's resident and resident anonymous bytes, and the allocator's in-use bytes.
pub fn host_now() -> [Option<u64>; 3] {
    let [rss, anon] = ddo_core::host_memory::process_status_snapshot(["VmRSS", "RssAnon"]);
    [rss, anon, ddo_core::host_memory::heap_in_use()]
}

/// Runs one job: its LoRAs, the request, the PNGs; the answer's JSON.
fn run_job(
    session: &mut Session,
    job: &Job,
    shared: &Shared,
    cancel: &Arc<AtomicBool>,
    vram_budget: Option<u64>,
) -> Result<Value, CliError> {
    let started = Instant::now();
    session.set_loras(&job.parsed.loras)?;
    let mut observer = JobObserver {
        shared,
        id: job.id,
        cancel: Arc::clone(cancel),
    };
    let reused = session.last_plan().cloned();
    let mut generated = session.generate(&job.parsed.request, &mut observer)?;
    let encoding = Instant::now();
    let image = HostTensor::from_tensor(&generated.run.image)?;
    let b64 = base64::engine::general_purpose::STANDARD;
    let images: Vec<Value> = image
        .rows()
        .iter()
        .map(|row| Ok(json!({"b64_png": b64.encode(encode_png(row)?), "seed": job.seed})))
        .collect::<Result<_, CliError>>()?;
    generated.finish_unpinning();
    let mut laps = generated.laps.clone();
    laps.push(("output", encoding.elapsed().as_secs_f64()));
    let total = started.elapsed().as_secs_f64();
    let profile = crate::run::profile(session, &generated, (&[], None), &laps, total, vram_budget);
    let mut profile = profile.json();
    if let Value::Object(m) = &mut profile {
        m.insert(
            "plan_reused".into(),
            Value::Bool(reused.is_some_and(|p| Arc::ptr_eq(&p, &generated.plan))),
        );
        // What the request made the host do again: ranges page-locked and bytes read from
        // storage (both 0 for a warm request after the first).
        m.insert(
            "request_host".into(),
            json!({
                "registrations": generated.registrations,
                "read_bytes": generated.read_bytes,
            }),
        );
    }
    let mut counters = lock(&shared.counters);
    counters.step_seconds.0 += generated.step_seconds.iter().sum::<f64>();
    counters.step_seconds.1 += generated.step_seconds.len() as u64;
    counters.job_seconds.0 += total;
    counters.job_seconds.1 += 1;
    counters.routes = generated
        .explanations
        .iter()
        .map(|e| (e.component.clone(), e.route.clone()))
        .collect();
    drop(counters);
    Ok(json!({"id": job.id, "images": images, "profile": profile}))
}
