//! `ddo serve`'s web page in a real browser (issue 38): headless Chromium (Debian's
//! `chromium` package) driven over the DevTools protocol against `ddo serve --config tiny`
//! on the host backend. The test fills in the form, submits it, watches the progress bar
//! advance, gets the PNG and the plan and phase tables, then asks for a size that does not
//! fit and reads the error message.
//!
//! `.ci/run` installs Chromium and sets `DDO_REQUIRE_BROWSER=1`, so in CI a missing browser
//! fails the test; elsewhere without one it says so and passes nothing off as checked.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use common::server::Server;
use serde_json::{Value, json};
use tungstenite::{Message, WebSocket, stream::MaybeTlsStream};

/// The browser binary: `DDO_CHROMIUM`, else the first of Debian's names on `PATH`.
fn chromium() -> Option<String> {
    if let Ok(p) = std::env::var("DDO_CHROMIUM") {
        return Some(p);
    }
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .find(|name| {
            Command::new("sh")
                .args(["-c", &format!("command -v {name}")])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .map(|s| s.to_string())
}

/// The DevTools targets of the browser at `addr` (`GET /json/list`; its server keeps the
/// connection open, so the body is read by its length).
fn json_list(addr: &str) -> Value {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "GET /json/list HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "DevTools closed the connection");
        raw.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&raw);
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len: usize = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse().ok())?
                })
                .expect("a Content-Length");
            if body.len() >= len {
                return serde_json::from_str(&body[..len]).unwrap();
            }
        }
    }
}

/// A headless browser and a DevTools connection to its page.
struct Browser {
    child: Child,
    socket: WebSocket<MaybeTlsStream<std::net::TcpStream>>,
    next_id: u64,
    _profile: tempfile::TempDir,
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Browser {
    /// Starts `binary` headless on a free DevTools port and connects to its blank page.
    fn start(binary: &str) -> Browser {
        let profile = tempfile::tempdir().unwrap();
        let mut child = Command::new(binary)
            .args([
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--remote-debugging-port=0",
                "about:blank",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            // Its singleton socket folder goes under the profile too, removed with it: a
            // killed browser leaves `org.chromium.Chromium.*` behind in the temp folder.
            .env("TMPDIR", profile.path())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start chromium");
        // "DevTools listening on ws://127.0.0.1:PORT/devtools/browser/ID".
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let mut port = None;
        for line in lines.by_ref() {
            let line = line.unwrap();
            if let Some(rest) = line.split("ws://127.0.0.1:").nth(1) {
                port = rest.split('/').next().map(str::to_string);
                break;
            }
        }
        // The rest of its log is read and dropped: a closed pipe would end the browser.
        std::thread::spawn(move || lines.for_each(drop));
        let port = port.expect("chromium printed no DevTools address");
        let targets = json_list(&format!("127.0.0.1:{port}"));
        let page = targets
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["type"] == "page")
            .expect("a page target")["webSocketDebuggerUrl"]
            .as_str()
            .unwrap()
            .to_string();
        let (socket, _) = tungstenite::connect(page).unwrap();
        Browser {
            child,
            socket,
            next_id: 1,
            _profile: profile,
        }
    }

    /// Sends DevTools `method` with `params` and returns its result.
    fn send(&mut self, method: &str, params: Value) -> Value {
        let id = self.next_id;
        self.next_id += 1;
        let msg = json!({"id": id, "method": method, "params": params}).to_string();
        self.socket.send(Message::text(msg)).unwrap();
        loop {
            let Message::Text(text) = self.socket.read().unwrap() else {
                continue;
            };
            let v: Value = serde_json::from_str(text.as_str()).unwrap();
            if v["id"] == id {
                assert!(v.get("error").is_none(), "{method}: {v}");
                return v["result"].clone();
            }
        }
    }

    /// The value of JavaScript `expression` on the page.
    fn eval(&mut self, expression: &str) -> Value {
        let r = self.send(
            "Runtime.evaluate",
            json!({"expression": expression, "returnByValue": true}),
        );
        r["result"]["value"].clone()
    }

    /// Waits until `expression` is true on the page.
    fn wait_for(&mut self, expression: &str, what: &str) {
        let t = Instant::now();
        while self.eval(expression) != Value::Bool(true) {
            assert!(t.elapsed() < Duration::from_secs(60), "waited for {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

#[test]
fn the_page_makes_an_image_with_live_progress_and_shows_errors() {
    let Some(binary) = chromium() else {
        assert!(
            std::env::var("DDO_REQUIRE_BROWSER").is_err(),
            "DDO_REQUIRE_BROWSER is set and no chromium is installed (apt-get install chromium)"
        );
        eprintln!("skipped: no chromium on PATH (apt-get install chromium, or DDO_CHROMIUM=PATH)");
        return;
    };
    let server = Server::start(&["--config", "tiny"]);
    let mut browser = Browser::start(&binary);
    browser.send(
        "Page.navigate",
        json!({"url": format!("http://{}/", server.addr)}),
    );
    browser.wait_for(
        "document.body && document.body.dataset.ready === '1'",
        "the page",
    );
    assert_eq!(
        browser.eval("document.getElementById('width').value"),
        "128"
    );
    // A run long enough to see the bar move.
    browser.eval(
        "document.getElementById('steps').value = '40';
         document.getElementById('seed').value = '3';
         document.getElementById('go').click(); true",
    );
    let mut seen = Vec::new();
    let t = Instant::now();
    while browser.eval("!!document.getElementById('result')") != Value::Bool(true) {
        assert!(t.elapsed() < Duration::from_secs(60), "no image: {seen:?}");
        let v = browser
            .eval("Number(document.getElementById('progress').value)")
            .as_f64()
            .unwrap_or(0.0);
        if seen.last() != Some(&v) {
            seen.push(v);
        }
    }
    let between: Vec<_> = seen.iter().filter(|&&v| v > 0.0 && v < 40.0).collect();
    assert!(
        between.len() >= 2 && seen.windows(2).all(|w| w[0] <= w[1]),
        "the bar did not advance step by step: {seen:?}"
    );
    let src = browser.eval("document.getElementById('result').src");
    let b64 = src
        .as_str()
        .and_then(|s| s.strip_prefix("data:image/png;base64,"))
        .expect("a PNG data URL");
    let png = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let tables = browser.eval("document.getElementById('tables').textContent");
    let tables = tables.as_str().unwrap();
    assert!(
        tables.contains("transformer") && tables.contains("denoise"),
        "{tables}"
    );
    assert_eq!(
        browser.eval("document.getElementById('error').textContent"),
        ""
    );
    // A size no plan fits: the server's message, shown on the page.
    browser.eval(
        "document.getElementById('width').value = '100000';
         document.getElementById('height').value = '100000';
         document.getElementById('steps').value = '1';
         document.getElementById('go').click(); true",
    );
    browser.wait_for(
        "document.getElementById('error').textContent.length > 0",
        "the error message",
    );
    let error = browser.eval("document.getElementById('error').textContent");
    assert!(
        error
            .as_str()
            .unwrap()
            .contains("too small for the denoise phase"),
        "{error}"
    );
}
