//! One `dprank-sim` process serving one simulated worker.

use super::http::Client;
use super::{sim_bin, tail, TestDir};
use base64::Engine;
use serde_json::Value;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};

pub struct Sim {
    /// The name the filter config gives this worker (stats use it).
    pub name: String,
    pub addr: SocketAddr,
    child: Option<Child>,
    /// Kept open: the simulator prints its ready line here.
    _stdout: Option<BufReader<ChildStdout>>,
    stderr_path: PathBuf,
    client: Client,
}

/// A serving request as the worker received it (`GET /_sim/requests`).
#[derive(Debug, Clone)]
pub struct Recorded {
    pub path: String,
    pub method: String,
    pub headers: serde_json::Map<String, Value>,
    pub body: Vec<u8>,
    pub rank: Option<u64>,
    pub status: Option<u64>,
}

impl Recorded {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(Value::as_str)
    }

    pub fn body_text(&self) -> &str {
        std::str::from_utf8(&self.body).expect("recorded body is not UTF-8")
    }

    pub fn body_json(&self) -> Value {
        serde_json::from_slice(&self.body).expect("recorded body is not JSON")
    }
}

impl Sim {
    /// Starts `dprank-sim --listen 127.0.0.1:0 --dp-size <dp_size> <extra_args>`
    /// and reads the bound address from its `ready <addr> ...` line.
    pub fn start(dir: &TestDir, name: &str, dp_size: u32, extra_args: &[&str]) -> Sim {
        let stderr_path = dir.file(&format!("sim-{name}.stderr"));
        let (child, stdout, line, read) = spawn(&stderr_path, "127.0.0.1:0", dp_size, extra_args);
        let addr = if read {
            line.split_whitespace()
                .collect::<Vec<_>>()
                .get(..2)
                .filter(|w| w[0] == "ready")
                .and_then(|w| w[1].parse::<SocketAddr>().ok())
        } else {
            None
        };
        let Some(addr) = addr else {
            kill_child(&mut Some(child));
            panic!(
                "simulator {name} did not print `ready <addr>` (got {line:?}); stderr:\n{}",
                tail(&stderr_path, 40)
            );
        };
        Sim {
            name: name.to_string(),
            addr,
            child: Some(child),
            _stdout: Some(stdout),
            stderr_path,
            client: Client::new(),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// `POST /_sim/control` with `update`; panics unless the simulator accepts it.
    pub fn control(&self, update: Value) {
        let reply = self.client.post(
            &self.url("/_sim/control"),
            &[("content-type", "application/json")],
            update.to_string().as_bytes(),
        );
        assert_eq!(
            reply.status,
            200,
            "{}: control {update} refused: {}",
            self.name,
            reply.text()
        );
    }

    pub fn set_base_tokens(&self, base: &[u64]) {
        self.control(serde_json::json!({ "base_tokens": base }));
    }

    pub fn set_load_fault(&self, fault: &str) {
        self.control(serde_json::json!({ "load_fault": fault }));
    }

    pub fn requests(&self) -> Vec<Recorded> {
        let reply = self.client.get(&self.url("/_sim/requests"), &[]);
        assert_eq!(reply.status, 200, "{}: /_sim/requests failed", self.name);
        let list = reply.json();
        list.as_array()
            .expect("/_sim/requests is an array")
            .iter()
            .map(|r| {
                let body = match (r.get("body"), r.get("body_base64")) {
                    (Some(Value::String(text)), _) => text.as_bytes().to_vec(),
                    (_, Some(Value::String(b64))) => base64::engine::general_purpose::STANDARD
                        .decode(b64)
                        .expect("body_base64 is base64"),
                    _ => panic!("recorded request without a body: {r}"),
                };
                Recorded {
                    path: r["path"].as_str().unwrap_or_default().to_string(),
                    method: r["method"].as_str().unwrap_or_default().to_string(),
                    headers: r["headers"].as_object().cloned().unwrap_or_default(),
                    body,
                    rank: r["rank"].as_u64(),
                    status: r["status"].as_u64(),
                }
            })
            .collect()
    }

    /// The last request this worker received; panics if none.
    pub fn last_request(&self) -> Recorded {
        self.requests()
            .pop()
            .unwrap_or_else(|| panic!("{} received no request", self.name))
    }

    /// `GET /_sim/counters`.
    pub fn counters(&self) -> Value {
        let reply = self.client.get(&self.url("/_sim/counters"), &[]);
        assert_eq!(reply.status, 200, "{}: /_sim/counters failed", self.name);
        reply.json()
    }

    /// How many times a load endpoint (`/v1/loads` or `/get_load`) was called.
    pub fn load_requests(&self, endpoint: &str) -> u64 {
        self.counters()["load_requests"][endpoint]
            .as_u64()
            .unwrap_or_else(|| panic!("{}: no load_requests[{endpoint}]", self.name))
    }

    /// Kills the process now (a worker going down).
    pub fn kill(&mut self) {
        kill_child(&mut self.child);
    }
}

/// Spawns `dprank-sim --listen <listen> --dp-size <dp_size> <extra_args>`
/// (stderr to `stderr_path`; every request in its log, for the failure
/// report) and reads its first stdout line. Returns the child, its stdout
/// (kept open: the simulator prints its ready line there), that line, and
/// whether a line was read at all.
pub(super) fn spawn(
    stderr_path: &Path,
    listen: &str,
    dp_size: u32,
    extra_args: &[&str],
) -> (Child, BufReader<ChildStdout>, String, bool) {
    let stderr = std::fs::File::create(stderr_path).expect("create sim stderr file");
    let mut child = Command::new(sim_bin())
        .args(["--listen", listen, "--dp-size", &dp_size.to_string()])
        .args(extra_args)
        .env("RUST_LOG", "dprank_sim=debug")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", sim_bin().display()));
    let mut stdout = BufReader::new(child.stdout.take().expect("sim stdout is piped"));
    let mut line = String::new();
    let read = stdout.read_line(&mut line).is_ok_and(|n| n > 0);
    (child, stdout, line, read)
}

/// Kills and reaps the process in `child`, if any (it is taken).
pub(super) fn kill_child(child: &mut Option<Child>) {
    if let Some(mut child) = child.take() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let was_running = self.child.is_some();
        self.kill();
        if std::thread::panicking() && was_running {
            eprintln!(
                "---- simulator {} ({}) stderr, last lines ----\n{}",
                self.name,
                self.addr,
                tail(&self.stderr_path, 30)
            );
        }
    }
}
