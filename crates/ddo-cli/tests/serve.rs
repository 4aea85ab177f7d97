//! `ddo serve` (issue 38) on the host backend: the binary started on a free loopback port,
//! spoken to over plain HTTP/1.1. The same seed and options give `ddo run`'s PNG bytes;
//! jobs run in FIFO order; bad requests are 4xx with the CLI's message and the server keeps
//! serving; the queue overflows into 429; a token is required where given; a client that
//! goes away cancels its job; SIGTERM finishes the running job and exits 0; many requests
//! in a row leave memory where the first left it.

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use base64::Engine;
use common::server::{Server, call_json};
use common::{ddo, fixture, ok, scratch};
use serde_json::{Value, json};

/// The PNG bytes of an answer's image `i`.
fn png(answer: &Value, i: usize) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD
        .decode(answer["images"][i]["b64_png"].as_str().unwrap())
        .unwrap()
}

/// `ddo run` with `args` (on `--config tiny` unless they give `--weights`): the PNG's bytes.
fn run_png(name: &str, args: &[&str]) -> Vec<u8> {
    let d = scratch(name);
    let out = d.join("run.png");
    let source = if args.contains(&"--weights") {
        vec![]
    } else {
        vec!["--config", "tiny"]
    };
    let mut all = vec!["run", "--out", out.to_str().unwrap()];
    all.extend(source);
    all.extend_from_slice(args);
    ok(&ddo(&all));
    std::fs::read(out).unwrap()
}

/// Sends SIGTERM to the server.
fn sigterm(server: &Server) {
    let status = Command::new("kill")
        .args(["-TERM", &server.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
}

#[test]
fn a_request_gives_ddo_runs_bytes_and_a_second_reuses_the_plan() {
    let server = Server::start(&["--config", "tiny"]);
    let body = json!({"prompt": "a red boat", "height": 32, "width": 24, "steps": 2, "seed": 9});
    let (status, a) = server.json("POST", "/v1/generate", &body.to_string());
    assert_eq!(status, 200, "{a}");
    assert_eq!(a["images"][0]["seed"], 9);
    let want = run_png(
        "serve-bytes",
        &[
            "--prompt",
            "a red boat",
            "--height",
            "32",
            "--width",
            "24",
            "--steps",
            "2",
            "--seed",
            "9",
        ],
    );
    assert!(png(&a, 0) == want, "the served PNG differs from ddo run's");
    assert_eq!(a["profile"]["plan_reused"], false);
    assert_eq!(a["profile"]["phases"].as_array().unwrap().len(), 3);
    // The same shape again: the plan is kept; the image is the same.
    let (_, b) = server.json("POST", "/v1/generate", &body.to_string());
    assert_eq!(b["profile"]["plan_reused"], true, "{}", b["profile"]);
    assert!(png(&b, 0) == want);
    // OpenAI's shape: n images of WIDTHxHEIGHT.
    let (status, o) = server.json(
        "POST",
        "/v1/images/generations",
        r#"{"prompt":"a red boat","n":2,"size":"24x32","model":"x","response_format":"b64_json"}"#,
    );
    assert_eq!(status, 200, "{o}");
    assert_eq!(o["data"].as_array().unwrap().len(), 2);
    // Without a seed, a fresh one is drawn and returned; it reproduces the image.
    let (_, c) = server.json(
        "POST",
        "/v1/generate",
        r#"{"height":32,"width":32,"steps":1}"#,
    );
    let seed = c["images"][0]["seed"].as_u64().unwrap();
    let again = json!({"height": 32, "width": 32, "steps": 1, "seed": seed});
    let (_, d) = server.json("POST", "/v1/generate", &again.to_string());
    assert!(png(&c, 0) == png(&d, 0));
    // /health and the page.
    let (status, h) = server.json("GET", "/health", "");
    assert_eq!((status, h["status"].as_str()), (200, Some("ok")));
    assert_eq!(h["compute"], "bf16");
    let (status, page) = server.call("GET", "/", "", &[]);
    assert_eq!(status, 200);
    assert!(page.contains("<progress") && page.contains("/v1/jobs"));
}

/// Issue 38: a request after the first pins nothing again. The transformer streams from
/// page-locked ranges of its checkpoint (a route that registers them); the server keeps the
/// registrations the routes hand back, and the second request's attach reuses every one.
#[test]
fn a_warm_request_pins_nothing_again_and_gives_the_same_bytes() {
    let weights = fixture("flux_pipeline");
    let route = "transformer=diffusers_group_offload:offload_type=leaf_level,use_stream=true";
    let server = Server::start(&["--weights", &weights, "--route", route]);
    let body = json!({"prompt": "a red boat", "height": 32, "width": 32, "steps": 2, "seed": 4});
    let (status, a) = server.json("POST", "/v1/generate", &body.to_string());
    assert_eq!(status, 200, "{a}");
    let first = a["profile"]["request_host"]["registrations"]
        .as_u64()
        .unwrap();
    assert!(
        first > 0,
        "the first request registers the streamed ranges: {}",
        a["profile"]
    );
    let pinned = server.metric("ddo_pinned_host_bytes");
    assert!(pinned > 0.0, "the registrations are kept between requests");
    assert_eq!(server.metric("ddo_host_registrations_total"), first as f64);
    for _ in 0..2 {
        let (status, b) = server.json("POST", "/v1/generate", &body.to_string());
        assert_eq!(status, 200, "{b}");
        assert_eq!(
            b["profile"]["request_host"]["registrations"], 0,
            "{}",
            b["profile"]
        );
        assert_eq!(b["profile"]["plan_reused"], true);
        assert!(png(&b, 0) == png(&a, 0), "a warm request made other bytes");
    }
    assert_eq!(server.metric("ddo_host_registrations_total"), first as f64);
    assert_eq!(server.metric("ddo_pinned_host_bytes"), pinned);
    // Another size plans again; the image matches ddo run's with the same arguments.
    let other = json!({"prompt": "a red boat", "height": 24, "width": 32, "steps": 2, "seed": 4});
    let (status, c) = server.json("POST", "/v1/generate", &other.to_string());
    assert_eq!(status, 200, "{c}");
    assert_eq!(c["profile"]["plan_reused"], false);
    let want = run_png(
        "serve-warm",
        &[
            "--weights",
            &weights,
            "--route",
            route,
            "--prompt",
            "a red boat",
            "--height",
            "24",
            "--width",
            "32",
            "--steps",
            "2",
            "--seed",
            "4",
        ],
    );
    assert!(png(&c, 0) == want, "the served PNG differs from ddo run's");
}

#[test]
fn bad_requests_are_4xx_with_the_clis_message_and_the_server_keeps_serving() {
    let server = Server::start(&["--config", "tiny"]);
    for (body, status, words) in [
        ("{not json", 400, "not a valid request"),
        (r#"{"stpes": 2}"#, 400, "unknown field `stpes`"),
        (r#"{"steps": 0}"#, 400, "--steps 0 is not allowed"),
        (r#"{"height": -5}"#, 400, "not a valid request"),
        (
            r#"{"loras": [{"name": "../../etc/passwd"}]}"#,
            400,
            "never a path",
        ),
        (r#"{"loras": [{"name": "style"}]}"#, 400, "--lora-dir"),
        (
            r#"{"height": 100000, "width": 100000, "steps": 1}"#,
            422,
            "too small for the denoise phase",
        ),
    ] {
        let (got, answer) = server.json("POST", "/v1/generate", body);
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert_eq!(got, status, "{body}: {answer}");
        assert!(message.contains(words), "{body}: {message}");
    }
    // A body past the 2 MiB limit: a JSON 413, not the framework's text.
    let big = format!("{{\"prompt\":\"{}\"}}", "x".repeat((2 << 20) + 1024));
    let (status, answer) = server.json("POST", "/v1/generate", &big);
    assert_eq!(status, 413, "{answer}");
    assert!(
        answer["error"]["message"]
            .as_str()
            .unwrap()
            .contains("2 MiB")
    );
    let (status, answer) = server.json("GET", "/v1/nothing", "");
    assert_eq!(status, 404, "{answer}");
    let (status, answer) = server.json("GET", "/v1/jobs/99/events", "");
    assert_eq!(status, 404, "{answer}");
    // Still serving.
    let (status, _) = server.json(
        "POST",
        "/v1/generate",
        r#"{"height":32,"width":32,"steps":1}"#,
    );
    assert_eq!(status, 200);
    assert_eq!(
        server.metric("ddo_jobs_finished_total{outcome=\"error\"}"),
        1.0
    );
}

#[test]
fn a_token_is_required_where_given_and_beyond_loopback() {
    let o = ddo(&["serve", "--config", "tiny", "--listen", "0.0.0.0:0"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--token"));
    let server = Server::start(&["--config", "tiny", "--token", "s3cret", "--json"]);
    let body = r#"{"height":32,"width":32,"steps":1}"#;
    let (status, _) = server.call("POST", "/v1/generate", body, &[]);
    assert_eq!(status, 401);
    let (status, _) = server.call(
        "POST",
        "/v1/generate",
        body,
        &["Authorization: Bearer wrong"],
    );
    assert_eq!(status, 401);
    let (status, _) = server.call("GET", "/metrics", "", &[]);
    assert_eq!(status, 401);
    let (status, text) = server.call(
        "POST",
        "/v1/generate",
        body,
        &["Authorization: Bearer s3cret"],
    );
    assert_eq!(status, 200, "{text}");
}

#[test]
fn jobs_run_in_fifo_order_with_events_and_the_queue_overflows_into_429() {
    let server = Server::start(&["--config", "tiny", "--queue", "3"]);
    // A long job first, then three that wait, then one too many.
    let (status, first) = server.json(
        "POST",
        "/v1/jobs",
        r#"{"height":128,"width":128,"steps":40,"seed":1}"#,
    );
    assert_eq!(status, 202, "{first}");
    let mut ids = vec![first["id"].as_u64().unwrap()];
    let mut refused = 0;
    for seed in 2..8 {
        let body = json!({"height": 32, "width": 32, "steps": 1, "seed": seed}).to_string();
        match server.json("POST", "/v1/jobs", &body) {
            (202, v) => ids.push(v["id"].as_u64().unwrap()),
            (429, v) => {
                assert!(v["error"]["message"].as_str().unwrap().contains("--queue"));
                refused += 1;
            }
            (s, v) => panic!("{s}: {v}"),
        }
    }
    assert!(refused >= 2, "{refused} refused with a queue of 3");
    assert!(ids.len() >= 2);
    // The first job's events: each denoising step, then its answer.
    let (status, events) = server.call("GET", &format!("/v1/jobs/{}/events", ids[0]), "", &[]);
    assert_eq!(status, 200);
    let steps = events
        .matches("\"event\":\"progress\",\"phase\":\"denoise\"")
        .count();
    assert_eq!(steps, 40, "{}", &events[..events.len().min(3000)]);
    assert!(events.contains("event: done") && events.contains("b64_png"));
    // Each waiting job ran after the one before it.
    let mut last = 0;
    for id in &ids {
        let answer = loop {
            let (status, v) = server.json("GET", &format!("/v1/jobs/{id}"), "");
            if status == 200 {
                break v;
            }
            assert_eq!(status, 202, "{v}");
            std::thread::sleep(Duration::from_millis(20));
        };
        let order = answer["order"].as_u64().unwrap();
        assert!(order > last, "job {id} ran {order}th, after {last}");
        last = order;
    }
    assert!(server.metric("ddo_requests_refused_total") >= 2.0);
}

/// Issue 38's bad input: the server killed with SIGKILL mid-step restarts clean on the same
/// address, and leaves no file behind (its temporary folder stays empty) and nothing to
/// clean up: it serves the next request at once.
#[test]
fn a_server_killed_mid_step_restarts_clean_on_the_same_address() {
    let tmp = scratch("serve-sigkill");
    let mut server = Server::start_at(&["--config", "tiny"], "127.0.0.1:0", Some(&tmp));
    let body = json!({"height": 64, "width": 64, "steps": 500, "seed": 1});
    let (status, v) = server.json("POST", "/v1/jobs", &body.to_string());
    assert_eq!(status, 202, "{v}");
    let id = v["id"].as_u64().unwrap();
    // Killed while the job is between denoising steps (it has made one, not all).
    loop {
        let (status, v) = server.json("GET", &format!("/v1/jobs/{id}"), "");
        assert_eq!(status, 202, "the job ended before it was killed: {v}");
        let last = &v["last_event"];
        if last["phase"] == "denoise" && last["done"].as_u64().is_some_and(|d| d >= 1) {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    let addr = server.addr.clone();
    drop(server);
    let again = Server::start_at(&["--config", "tiny"], &addr, Some(&tmp));
    assert_eq!(again.addr, addr);
    let (status, v) = again.json(
        "POST",
        "/v1/generate",
        r#"{"height":32,"width":32,"steps":1,"seed":1}"#,
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(again.metric("ddo_queue_depth"), 0.0);
    let left: Vec<_> = std::fs::read_dir(&tmp).unwrap().collect();
    assert!(left.is_empty(), "files left in TMPDIR: {left:?}");
}

#[test]
fn concurrent_clients_each_get_their_own_image() {
    let server = std::sync::Arc::new(Server::start(&["--config", "tiny"]));
    let threads: Vec<_> = (0..8u64)
        .map(|seed| {
            let server = std::sync::Arc::clone(&server);
            std::thread::spawn(move || {
                let body = json!({"height": 32, "width": 24, "steps": 1, "seed": 100 + seed});
                let (status, v) = server.json("POST", "/v1/generate", &body.to_string());
                assert_eq!(status, 200, "{v}");
                (seed, png(&v, 0))
            })
        })
        .collect();
    for t in threads {
        let (seed, got) = t.join().unwrap();
        let want = run_png(
            &format!("serve-concurrent-{seed}"),
            &[
                "--height",
                "32",
                "--width",
                "24",
                "--steps",
                "1",
                "--seed",
                &(100 + seed).to_string(),
            ],
        );
        assert!(got == want, "seed {}: not ddo run's bytes", 100 + seed);
    }
}

#[test]
fn a_client_that_goes_away_cancels_its_job_and_sigterm_drains() {
    let mut server = Server::start(&["--config", "tiny"]);
    // A long request whose client goes away once the job has started.
    {
        let mut s = TcpStream::connect(&server.addr).unwrap();
        let body = r#"{"height":128,"width":128,"steps":400}"#;
        write!(
            s,
            "POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let t = Instant::now();
        while server.metric("ddo_jobs_running") == 0.0 {
            assert!(t.elapsed() < Duration::from_secs(30));
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let t = Instant::now();
    while server.metric("ddo_jobs_finished_total{outcome=\"cancelled\"}") < 1.0 {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "the job of a client that went away still runs"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // SIGTERM while a job runs: that job's client gets its image, and the process exits 0.
    let addr = server.addr.clone();
    let client = std::thread::spawn(move || {
        call_json(
            &addr,
            "POST",
            "/v1/generate",
            r#"{"height":64,"width":64,"steps":60}"#,
        )
    });
    let t = Instant::now();
    while server.metric("ddo_jobs_running") == 0.0 {
        assert!(t.elapsed() < Duration::from_secs(30));
        std::thread::sleep(Duration::from_millis(10));
    }
    sigterm(&server);
    let (status, answer) = client.join().unwrap();
    assert_eq!(status, 200, "{answer}");
    let t = Instant::now();
    let code = loop {
        if let Some(s) = server.child.try_wait().unwrap() {
            break s.code();
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "still running after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(code, Some(0));
}

/// The soak's host-memory reference is read after request 100, and over the 100 after it
/// (every size, step count, prompt and LoRA set run many times: the lazily made state of
/// DDO, the runtime and the tokenizers in place).
const WARM_UP: usize = 100;

/// The soak's requests repeat their options every 90 (3 sizes, 2 step counts, 3 LoRA sets
/// changed every 3 requests, 5 prompts).
const PERIOD: usize = 90;

#[test]
fn many_requests_in_a_row_leave_memory_where_the_first_left_it() {
    // Mixed sizes, seeds and LoRAs on the fixture pipeline (its LoRAs fit it).
    let dir = scratch("serve-soak");
    for f in ["peft.safetensors", "kohya.safetensors"] {
        std::fs::copy(fixture(&format!("flux_lora/{f}")), dir.join(f)).unwrap();
    }
    let weights = fixture("flux_pipeline");
    // glibc's per-thread caches of freed blocks (up to 7 of each size in each thread) count
    // as in use and fill at their own pace; off, the heap's figures are what DDO holds.
    // (The server itself keeps one heap arena: `one_heap_arena`.)
    let server = Server::start_with(
        &[
            "--weights",
            &weights,
            "--lora-dir",
            dir.to_str().unwrap(),
            "--lora-allow-unmatched",
        ],
        "127.0.0.1:0",
        &[("GLIBC_TUNABLES", "glibc.malloc.tcache_count=0")],
    );
    let n: usize = std::env::var("DDO_SERVE_SOAK")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let sizes = [(32, 32), (32, 24), (24, 32)];
    let loras = [
        json!([]),
        json!([{"name": "peft", "strength": 0.7}]),
        json!([{"name": "kohya.safetensors"}]),
    ];
    let mut first = None;
    // The most resident anonymous memory over the WARM_UP requests from request WARM_UP
    // (the same options as the last when n - WARM_UP is a multiple of PERIOD).
    let mut anon_ref = 0.0f64;
    for i in 0..n {
        let (h, w) = sizes[i % sizes.len()];
        let body = json!({
            "prompt": format!("prompt {}", i % 5),
            "height": h, "width": w, "steps": 1 + i % 2, "seed": i,
            "loras": loras[(i / 3) % loras.len()],
        });
        let (status, v) = server.json("POST", "/v1/generate", &body.to_string());
        assert_eq!(status, 200, "request {i}: {v}");
        if i % 100 == 0 {
            eprintln!(
                "after request {}: host RSS {} B, anonymous {} B, heap in use {} B",
                i + 1,
                server.metric("ddo_host_resident_bytes"),
                server.metric("ddo_host_anonymous_bytes"),
                server.metric("ddo_host_heap_bytes"),
            );
        }
        if i == 0 {
            first = Some((
                server.metric("ddo_device_allocated_bytes"),
                server.metric("ddo_pinned_host_bytes"),
                server.metric("ddo_host_heap_bytes"),
            ));
        }
        if i + 1 >= WARM_UP && i + 1 < 2 * WARM_UP {
            anon_ref = anon_ref.max(server.metric("ddo_host_anonymous_bytes"));
        }
    }
    let anon_last = server.metric("ddo_host_anonymous_bytes");
    // The last request as the first (no LoRA: none of their factors on the device).
    let body = json!({"prompt": "prompt 0", "height": 32, "width": 32, "steps": 1, "seed": 0, "loras": []});
    let (status, v) = server.json("POST", "/v1/generate", &body.to_string());
    assert_eq!(status, 200, "{v}");
    let (device, pinned, heap) = first.unwrap();
    assert_eq!(
        server.metric("ddo_jobs_finished_total{outcome=\"ok\"}"),
        (n + 1) as f64
    );
    assert_eq!(
        server.metric("ddo_jobs_finished_total{outcome=\"error\"}"),
        0.0
    );
    assert_eq!(server.metric("ddo_device_allocated_bytes"), device);
    assert_eq!(server.metric("ddo_pinned_host_bytes"), pinned);
    // What DDO holds on the heap: where the same request left it the first time.
    let heap_last = server.metric("ddo_host_heap_bytes");
    eprintln!(
        "heap in use after request 1: {heap} B; after request {}: {heap_last} B",
        n + 1
    );
    assert!(
        heap_last <= heap * 1.01,
        "the heap in use grew from {heap} B to {heap_last} B over {} requests",
        n + 1
    );
    // The resident set, which also holds what the allocator keeps of freed blocks.
    eprintln!(
        "anonymous host memory over requests {WARM_UP}-{}: at most {anon_ref} B; after \
         request {n}: {anon_last} B",
        2 * WARM_UP
    );
    if n >= 2 * WARM_UP && (n - WARM_UP).is_multiple_of(PERIOD) {
        assert!(
            anon_last <= anon_ref * 1.01,
            "anonymous host memory grew from {anon_ref} B to {anon_last} B between requests \
             {WARM_UP} and {n}"
        );
    }
}

/// The `serve_request` fuzz target's seeds (`fuzz/corpus/serve_request/`) replay on stable:
/// each parsed and checked as the server does, a refusal a usage error, no panic.
#[test]
fn the_request_fuzz_seeds_replay_on_stable() {
    let dir = common::repo().join("fuzz/corpus/serve_request");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).expect("seed corpus") {
        let path = entry.unwrap().path();
        let data = std::fs::read(&path).unwrap();
        ddo_cli::serve::api::fuzz_one(&data)
            .unwrap_or_else(|problem| panic!("{}: {problem}", path.display()));
        seen += 1;
    }
    assert!(seen >= 5, "{seen} seeds");
}
