//! Renderings for the lifecycle tests and a background client:
//! - `envoy/cluster-discovery.yaml` with a test-private EDS file (workers
//!   taken from the cluster);
//! - `envoy/dprank.yaml` with its listener moved into a file-based LDS
//!   resource (a filter config changed on a running Envoy);
//! - [`Loader`]: requests sent one after the other from a thread, every
//!   outcome recorded, to show nothing fails across a reload or a hot restart.

use super::envoy::{render_config, SHIPPED_CONFIG};
use super::process::{
    atomic_write, cluster_mut, edit_dprank_filter, lb_endpoints, merge, read_yaml, set_port, yaml_of,
};
use super::sim::Sim;
use super::{repo_root, wasm_path, Scenario};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub const DISCOVERY_CONFIG: &str = "envoy/cluster-discovery.yaml";
pub const SHIPPED_EDS: &str = "envoy/eds/sglang.yaml";

/// `envoy/cluster-discovery.yaml` for a test: the admin API on `admin_port`
/// (the `dprank_admin` cluster points there), listener port 0, the `sglang`
/// cluster's EDS read from `eds_path`, the scenario's filter overrides.
pub fn render_discovery(admin_port: u16, eds_path: &Path, overrides: &Value) -> String {
    let mut doc = read_yaml(&repo_root().join(DISCOVERY_CONFIG));
    set_port(&mut doc, &["admin", "address", "socket_address"], admin_port);
    set_port(
        &mut doc["static_resources"]["listeners"][0],
        &["address", "socket_address"],
        0,
    );
    let admin = SocketAddr::from(([127, 0, 0, 1], admin_port));
    cluster_mut(&mut doc, "dprank_admin")["load_assignment"]["endpoints"] = lb_endpoints(&[admin]);
    let eds = &mut cluster_mut(&mut doc, "sglang")["eds_cluster_config"]["eds_config"]["path_config_source"];
    assert!(
        eds.get("path").is_some(),
        "{DISCOVERY_CONFIG}: the sglang cluster reads EDS from a file"
    );
    eds["path"] = json!(eds_path.display().to_string());
    edit_dprank_filter(&mut doc, DISCOVERY_CONFIG, &mut |filter| {
        assert!(
            filter.get("workers_from_cluster").is_some(),
            "{DISCOVERY_CONFIG}: workers_from_cluster"
        );
        merge(filter, overrides);
    });
    yaml_of(&doc)
}

/// Writes (atomically: Envoy watches the file) the shipped EDS file with
/// these endpoints.
pub fn write_eds(eds_path: &Path, workers: &[&Sim]) {
    let mut doc = read_yaml(&repo_root().join(SHIPPED_EDS));
    let addrs: Vec<SocketAddr> = workers.iter().map(|s| s.addr).collect();
    doc["resources"][0]["endpoints"] = lb_endpoints(&addrs);
    atomic_write(eds_path, &yaml_of(&doc));
}

/// `envoy/dprank.yaml` rendered as the other tests do (workers, overrides),
/// with the listener on `listener_port` and moved into the LDS file
/// `lds_path` (written here). Returns the bootstrap.
pub fn render_with_lds(sims: &[Sim], scenario: &Scenario, listener_port: u16, lds_path: &Path) -> String {
    let mut doc: Value = serde_yaml_ng::from_str(&render_with_port(sims, scenario, listener_port))
        .expect("rendered config is YAML");
    let listeners = doc["static_resources"]
        .as_object_mut()
        .and_then(|r| r.remove("listeners"))
        .expect("static listeners");
    let mut listener = listeners[0].clone();
    listener["@type"] = json!("type.googleapis.com/envoy.config.listener.v3.Listener");
    write_lds(lds_path, &listener);
    doc["node"] = json!({"id": "dprank-e2e", "cluster": "dprank"});
    doc["dynamic_resources"] = json!({"lds_config": {
        "resource_api_version": "V3",
        "path_config_source": {"path": lds_path.display().to_string()}
    }});
    yaml_of(&doc)
}

/// Writes the LDS file (atomically) with this one listener.
pub fn write_lds(lds_path: &Path, listener: &Value) {
    atomic_write(lds_path, &yaml_of(&json!({ "resources": [listener] })));
}

/// The listener of an LDS file with `overrides` merged into its dprank
/// filter configuration.
pub fn lds_listener_with(lds_path: &Path, overrides: &Value) -> Value {
    let mut doc = read_yaml(lds_path);
    let mut listener = doc["resources"][0].take();
    edit_dprank_filter(&mut listener, "the LDS listener", &mut |filter| {
        merge(filter, overrides)
    });
    listener
}

/// What one request of the [`Loader`] got.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub seq: u64,
    /// When it was first sent, from the loader's start.
    pub sent: Duration,
    /// Status and `x-sim-worker`, or the connection-level error of the last try.
    pub result: Result<(u16, String), String>,
    /// Connection-level errors (nothing received) that were retried.
    pub retried: Vec<String>,
}

/// Sends `POST /generate {"text":"<tag> <seq>",...}` one after the other
/// from a thread until stopped. `keep_alive`: one pooled connection (as
/// most clients do); otherwise a new connection per request. A request
/// whose connection failed before any response arrived (reset, closed) is
/// retried, at most twice, on a new connection, and the retry is recorded.
pub struct Loader {
    pub started: Instant,
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<Vec<Outcome>>>,
}

impl Loader {
    pub fn start(url: String, tag: &'static str, keep_alive: bool, pause: Duration) -> Loader {
        let stop = Arc::new(AtomicBool::new(false));
        let started = Instant::now();
        let flag = stop.clone();
        let handle = std::thread::spawn(move || {
            let new_agent = || {
                ureq::AgentBuilder::new()
                    .timeout_connect(Duration::from_secs(5))
                    .timeout(Duration::from_secs(30))
                    .max_idle_connections(if keep_alive { 1 } else { 0 })
                    .build()
            };
            let mut agent = new_agent();
            let mut outcomes = Vec::new();
            let mut seq = 0;
            while !flag.load(Ordering::Relaxed) {
                seq += 1;
                let body = json!({"text": format!("{tag} {seq}"), "sampling_params": {"max_new_tokens": 1}})
                    .to_string();
                let sent = started.elapsed();
                let mut retried = Vec::new();
                let result = loop {
                    let mut request = agent.post(&url).set("content-type", "application/json");
                    if !keep_alive {
                        request = request.set("connection", "close");
                    }
                    match request.send_string(&body) {
                        Ok(r) | Err(ureq::Error::Status(_, r)) => {
                            let worker = r.header("x-sim-worker").unwrap_or_default().to_string();
                            let status = r.status();
                            let _ = r.into_string();
                            break Ok((status, worker));
                        }
                        Err(e) if retried.len() < 2 => {
                            retried.push(e.to_string());
                            agent = new_agent();
                        }
                        Err(e) => break Err(e.to_string()),
                    }
                };
                outcomes.push(Outcome {
                    seq,
                    sent,
                    result,
                    retried,
                });
                std::thread::sleep(pause);
            }
            outcomes
        });
        Loader {
            started,
            stop,
            handle: Some(handle),
        }
    }

    pub fn stop(mut self) -> Vec<Outcome> {
        self.stop.store(true, Ordering::Relaxed);
        self.handle
            .take()
            .expect("loader running")
            .join()
            .expect("the loader thread panicked")
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}

/// The requests of the loader tagged `tag` as the workers received them:
/// seq -> (worker name, body), from every worker's recordings.
pub fn loader_requests(sims: &[Sim], tag: &str) -> HashMap<u64, (String, Value)> {
    let prefix = format!("{tag} ");
    let mut found = HashMap::new();
    for sim in sims {
        for recorded in sim.requests() {
            let body = recorded.body_json();
            let Some(seq) = body["text"]
                .as_str()
                .and_then(|t| t.strip_prefix(&prefix))
                .and_then(|n| n.parse().ok())
            else {
                continue;
            };
            found.insert(seq, (sim.name.clone(), body));
        }
    }
    found
}

/// `envoy/dprank.yaml` rendered as the other tests do, with the listener on
/// a fixed port (a hot-restarted process asks its parent for the socket of
/// the same address).
pub fn render_with_port(sims: &[Sim], scenario: &Scenario, listener_port: u16) -> String {
    let shipped = std::fs::read_to_string(repo_root().join(SHIPPED_CONFIG)).expect("read the shipped config");
    let workers: Vec<(&str, SocketAddr)> = sims.iter().map(|s| (s.name.as_str(), s.addr)).collect();
    let rendered = render_config(&shipped, &workers, &scenario.filter_overrides, &wasm_path(), None);
    let mut doc: Value = serde_yaml_ng::from_str(&rendered).expect("rendered config is YAML");
    set_port(
        &mut doc["static_resources"]["listeners"][0],
        &["address", "socket_address"],
        listener_port,
    );
    yaml_of(&doc)
}

/// The hot-restart shared memory region of a base id Envoy picked
/// (`--base-id-path`); Envoy leaves it in /dev/shm, so it is removed on drop.
pub struct SharedMemory {
    pub base_id: u32,
}

impl SharedMemory {
    pub fn of(base_id_path: &Path) -> SharedMemory {
        let text = std::fs::read_to_string(base_id_path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", base_id_path.display()));
        SharedMemory {
            base_id: text.trim().parse().unwrap_or_else(|_| panic!("base id {text:?}")),
        }
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        // Envoy names it after base id x 10.
        let _ = std::fs::remove_file(format!("/dev/shm/envoy_shared_memory_{}0", self.base_id));
    }
}
