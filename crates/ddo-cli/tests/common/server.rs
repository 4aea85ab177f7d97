//! `ddo serve` in the integration tests: the binary started on a free loopback port
//! ([`Server`]), and a plain HTTP/1.1 client ([`call`]).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};

use serde_json::Value;

/// A `ddo serve` process and its address.
pub struct Server {
    /// The process.
    pub child: Child,
    /// `127.0.0.1:PORT`.
    pub addr: String,
}

impl Server {
    /// Starts `ddo serve ARGS --listen 127.0.0.1:0` and waits for its address.
    pub fn start(args: &[&str]) -> Server {
        Self::start_with(args, "127.0.0.1:0", &[])
    }

    /// Starts `ddo serve ARGS --listen LISTEN`, with `TMPDIR` set to `tmp` where given, and
    /// waits for its address.
    pub fn start_at(args: &[&str], listen: &str, tmp: Option<&std::path::Path>) -> Server {
        let tmp = tmp.map(|t| t.to_str().expect("a UTF-8 path"));
        Self::start_with(
            args,
            listen,
            &tmp.map(|t| ("TMPDIR", t)).into_iter().collect::<Vec<_>>(),
        )
    }

    /// Starts `ddo serve ARGS --listen LISTEN` with `env` added to its environment (no
    /// `DDO_*` variable of the test's), and waits for its address.
    pub fn start_with(args: &[&str], listen: &str, env: &[(&str, &str)]) -> Server {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_ddo"));
        cmd.arg("serve")
            .args(args)
            .args(["--listen", listen])
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        for (k, _) in std::env::vars() {
            if k.starts_with("DDO_") {
                cmd.env_remove(k);
            }
        }
        cmd.envs(env.iter().copied());
        let mut child = cmd.spawn().expect("start ddo serve");
        // What loading said (a LoRA's, `--compute`'s notes) comes first; the address line
        // last.
        let mut reader = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        while !line.contains("http://") {
            line.clear();
            if reader.read_line(&mut line).unwrap() == 0 {
                break;
            }
        }
        let addr = line
            .split("http://")
            .nth(1)
            .and_then(|r| r.split(|c: char| c.is_whitespace() || c == '"').next())
            .unwrap_or_else(|| panic!("no address in {line:?}"))
            .to_string();
        Server { child, addr }
    }

    /// `METHOD PATH` with `body` and `headers`; the status and the body (de-chunked).
    pub fn call(&self, method: &str, path: &str, body: &str, headers: &[&str]) -> (u16, String) {
        call(&self.addr, method, path, body, headers)
    }

    /// `call` with a JSON answer.
    pub fn json(&self, method: &str, path: &str, body: &str) -> (u16, Value) {
        call_json(&self.addr, method, path, body)
    }

    /// One metric's value from `/metrics`.
    pub fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.call("GET", "/metrics", "", &[]);
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `METHOD PATH` to `addr` with `body` and `headers`; the status and the body (de-chunked).
pub fn call(addr: &str, method: &str, path: &str, body: &str, headers: &[&str]) -> (u16, String) {
    {
        let mut s = TcpStream::connect(addr).unwrap();
        let mut req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        );
        for h in headers {
            req.push_str(h);
            req.push_str("\r\n");
        }
        req.push_str("\r\n");
        req.push_str(body);
        // A server may answer (413, say) and close before the whole body is written: what
        // it answered is read below either way.
        let _ = s.write_all(req.as_bytes());
        let mut raw = Vec::new();
        let _ = s.read_to_end(&mut raw);
        let text = String::from_utf8_lossy(&raw).to_string();
        let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        let body = if head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked")
        {
            dechunk(rest)
        } else {
            rest.to_string()
        };
        (status, body)
    }
}

/// [`call`] with a JSON answer.
pub fn call_json(addr: &str, method: &str, path: &str, body: &str) -> (u16, Value) {
    let (status, text) = call(addr, method, path, body, &[]);
    (
        status,
        serde_json::from_str(&text).unwrap_or_else(|_| panic!("{status}: {text}")),
    )
}

/// A chunked body's bytes.
fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || tail.len() < n {
            break;
        }
        out.push_str(&tail[..n]);
        rest = tail[n..].trim_start_matches("\r\n");
    }
    out
}
