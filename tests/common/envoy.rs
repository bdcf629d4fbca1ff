//! A real Envoy running the shipped `envoy/dprank.yaml`, rendered for a test:
//! ports 0, the started workers as cluster endpoints and filter `workers`,
//! the wasm path made absolute, and the scenario's filter overrides merged in.

use super::http::Client;
use super::{envoy_bin, repo_root, tail, wait_until, wasm_path, Scenario, Sim, TestDir};
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The shipped config the tests (and the demo) run.
pub const SHIPPED_CONFIG: &str = "envoy/dprank.yaml";
/// Prefix Envoy gives the stats a wasm filter defines, plus the filter's own prefix.
const STAT_PREFIX: &str = "wasmcustom.dprank.";

#[derive(Debug, Clone)]
pub struct EnvoyOptions {
    pub concurrency: u32,
    /// Overrides the listener's `per_connection_buffer_limit_bytes`.
    pub listener_buffer_limit: Option<u64>,
    /// Wait, after start, until every worker has been polled successfully.
    pub wait_for_polls: bool,
}

impl Default for EnvoyOptions {
    fn default() -> Self {
        EnvoyOptions {
            concurrency: 2,
            listener_buffer_limit: None,
            wait_for_polls: true,
        }
    }
}

/// Object fields of `over` replace or (for objects) merge into `base`.
fn merge(base: &mut Value, over: &Value) {
    match (base, over) {
        (Value::Object(base), Value::Object(over)) => {
            for (k, v) in over {
                match base.get_mut(k) {
                    Some(slot) if slot.is_object() && v.is_object() => merge(slot, v),
                    _ => {
                        base.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (base, over) => *base = over.clone(),
    }
}

fn object_mut<'a>(value: &'a mut Value, path: &[&str]) -> &'a mut Map<String, Value> {
    let mut at = value;
    for key in path {
        at = at
            .get_mut(*key)
            .unwrap_or_else(|| panic!("{SHIPPED_CONFIG}: no `{}` (path {path:?})", key));
    }
    at.as_object_mut()
        .unwrap_or_else(|| panic!("{SHIPPED_CONFIG}: {path:?} is not a mapping"))
}

fn array_mut<'a>(value: &'a mut Value, key: &str) -> &'a mut Vec<Value> {
    value
        .get_mut(key)
        .and_then(Value::as_array_mut)
        .unwrap_or_else(|| panic!("{SHIPPED_CONFIG}: no list `{key}`"))
}

/// The dprank wasm filters (`envoy.filters.http.wasm` with root_id dprank) of a listener.
fn dprank_filters(listener: &mut Value) -> Vec<&mut Value> {
    let mut found = Vec::new();
    for chain in array_mut(listener, "filter_chains") {
        for network_filter in array_mut(chain, "filters") {
            let Some(http_filters) = network_filter
                .get_mut("typed_config")
                .and_then(|c| c.get_mut("http_filters"))
                .and_then(Value::as_array_mut)
            else {
                continue;
            };
            for filter in http_filters {
                let is_dprank = filter["name"] == "envoy.filters.http.wasm"
                    && filter["typed_config"]["config"]["root_id"] == "dprank";
                if is_dprank {
                    found.push(&mut filter["typed_config"]["config"]);
                }
            }
        }
    }
    found
}

/// Renders the shipped YAML for a test run.
pub fn render_config(
    shipped_yaml: &str,
    workers: &[(&str, SocketAddr)],
    filter_overrides: &Value,
    wasm: &Path,
    listener_buffer_limit: Option<u64>,
) -> String {
    let mut doc: Value =
        serde_yaml_ng::from_str(shipped_yaml).unwrap_or_else(|e| panic!("{SHIPPED_CONFIG} is not YAML: {e}"));
    object_mut(&mut doc, &["admin", "address", "socket_address"]).insert("port_value".into(), json!(0));

    let resources = doc
        .get_mut("static_resources")
        .unwrap_or_else(|| panic!("{SHIPPED_CONFIG}: no static_resources"));
    let mut filters_seen = 0;
    for listener in array_mut(resources, "listeners") {
        object_mut(listener, &["address", "socket_address"]).insert("port_value".into(), json!(0));
        if let Some(limit) = listener_buffer_limit {
            listener["per_connection_buffer_limit_bytes"] = json!(limit);
        }
        for config in dprank_filters(listener) {
            filters_seen += 1;
            object_mut(config, &["vm_config", "code", "local"])
                .insert("filename".into(), json!(wasm.display().to_string()));
            let configuration = object_mut(config, &["configuration"]);
            let shipped_text = configuration
                .get("value")
                .and_then(Value::as_str)
                .unwrap_or_else(|| panic!("{SHIPPED_CONFIG}: filter configuration has no value"));
            let mut filter: Value = serde_json::from_str(shipped_text)
                .unwrap_or_else(|e| panic!("{SHIPPED_CONFIG}: filter configuration is not JSON: {e}"));
            let mut generated: Vec<Value> = workers
                .iter()
                .map(|(name, addr)| json!({"address": addr.to_string(), "name": name}))
                .collect();
            let mut overrides = filter_overrides.clone();
            // Per-worker overrides (e.g. dp_size) merge into the generated entries.
            if let Some(Value::Array(per_worker)) =
                overrides.as_object_mut().and_then(|o| o.remove("workers"))
            {
                for (entry, over) in generated.iter_mut().zip(&per_worker) {
                    merge(entry, over);
                }
            }
            filter["workers"] = Value::Array(generated);
            merge(&mut filter, &overrides);
            configuration.insert(
                "value".into(),
                json!(serde_json::to_string_pretty(&filter).expect("filter config serialises")),
            );
        }
    }
    assert_eq!(
        filters_seen, 1,
        "{SHIPPED_CONFIG}: expected exactly one dprank wasm filter"
    );

    let clusters = array_mut(resources, "clusters");
    let sglang = clusters
        .iter_mut()
        .find(|c| c["name"] == "sglang")
        .unwrap_or_else(|| panic!("{SHIPPED_CONFIG}: no cluster `sglang`"));
    let endpoints: Vec<Value> = workers
        .iter()
        .map(|(_, addr)| {
            json!({"endpoint": {"address": {"socket_address": {
                "address": addr.ip().to_string(), "port_value": addr.port()
            }}}})
        })
        .collect();
    object_mut(sglang, &["load_assignment"])
        .insert("endpoints".into(), json!([{ "lb_endpoints": endpoints }]));

    serde_yaml_ng::to_string(&doc).expect("rendered config serialises")
}

pub struct Envoy {
    child: Option<Child>,
    pub admin: SocketAddr,
    pub listener: SocketAddr,
    log_path: PathBuf,
    stderr_path: PathBuf,
    client: Client,
}

fn read_addr(path: &Path) -> Option<SocketAddr> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

impl Envoy {
    pub fn start(dir: &TestDir, scenario: &Scenario, sims: &[Sim], options: &EnvoyOptions) -> Envoy {
        let shipped = std::fs::read_to_string(repo_root().join(SHIPPED_CONFIG))
            .unwrap_or_else(|e| panic!("cannot read {SHIPPED_CONFIG}: {e}"));
        let workers: Vec<(&str, SocketAddr)> = sims.iter().map(|s| (s.name.as_str(), s.addr)).collect();
        let rendered = render_config(
            &shipped,
            &workers,
            &scenario.filter_overrides,
            &wasm_path(),
            options.listener_buffer_limit,
        );
        let config_path = dir.file("envoy.yaml");
        std::fs::write(&config_path, rendered).expect("write rendered Envoy config");
        let admin_path = dir.file("admin-address");
        let log_path = dir.file("envoy.log");
        let stderr_path = dir.file("envoy.stderr");
        let stderr = std::fs::File::create(&stderr_path).expect("create Envoy stderr file");
        let child = Command::new(envoy_bin())
            .arg("-c")
            .arg(&config_path)
            .args(["--concurrency", &options.concurrency.to_string()])
            // Several Envoys run at once: no shared-memory hot-restart region to clash on.
            .arg("--disable-hot-restart")
            .arg("--admin-address-path")
            .arg(&admin_path)
            .args(["-l", "info", "--log-path"])
            .arg(&log_path)
            // The log is read when a test fails, after a SIGKILL: flush it often.
            .args(["--file-flush-interval-msec", "50"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", envoy_bin().display()));
        let mut envoy = Envoy {
            child: Some(child),
            admin: SocketAddr::from(([127, 0, 0, 1], 0)),
            listener: SocketAddr::from(([127, 0, 0, 1], 0)),
            log_path,
            stderr_path,
            client: Client::new(),
        };
        let startup = Duration::from_secs(60);
        envoy.admin = wait_until("Envoy's admin address file", startup, || {
            envoy.assert_running();
            read_addr(&admin_path)
        });
        wait_until("Envoy /ready", startup, || {
            envoy.assert_running();
            (envoy.admin_get("/ready").status == 200).then_some(())
        });
        envoy.listener = wait_until("Envoy's listener address", startup, || {
            let listeners = envoy.admin_get("/listeners?format=json").json();
            let socket = &listeners["listener_statuses"][0]["local_address"]["socket_address"];
            let port = socket["port_value"].as_u64().filter(|p| *p != 0)?;
            let ip = socket["address"].as_str()?;
            format!("{ip}:{port}").parse().ok()
        });
        envoy
    }

    /// Panics (with the log tail) if Envoy has exited.
    pub fn assert_running(&mut self) {
        if let Some(child) = &mut self.child {
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                panic!(
                    "Envoy exited ({status}); log:\n{}\nstderr:\n{}",
                    tail(&self.log_path, 60),
                    tail(&self.stderr_path, 20)
                );
            }
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.listener)
    }

    pub fn admin_get(&self, path: &str) -> super::Reply {
        self.client.get(&format!("http://{}{path}", self.admin), &[])
    }

    /// Every dprank stat (`wasmcustom.dprank.<name>`) by `<name>`, counters and gauges.
    pub fn stats(&self) -> HashMap<String, u64> {
        let reply = self.admin_get("/stats?format=json&filter=wasmcustom");
        assert_eq!(reply.status, 200, "GET /stats failed: {reply:?}");
        let doc = reply.json();
        doc["stats"]
            .as_array()
            .map(|stats| {
                stats
                    .iter()
                    .filter_map(|s| {
                        let name = s.get("name")?.as_str()?.strip_prefix(STAT_PREFIX)?;
                        Some((name.to_string(), s.get("value")?.as_u64()?))
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// One dprank stat (`routed.worker_a.rank_0`, ...); 0 until Envoy has defined it.
    pub fn stat(&self, name: &str) -> u64 {
        self.stats().get(name).copied().unwrap_or(0)
    }

    /// Waits until stat `name` reaches at least `at_least`; returns its value.
    pub fn wait_for_stat(&self, name: &str, at_least: u64, timeout: Duration) -> u64 {
        wait_until(&format!("stat {name} >= {at_least}"), timeout, || {
            let value = self.stat(name);
            (value >= at_least).then_some(value)
        })
    }

    /// Error and critical log lines of the wasm VMs (a panic, a trap, a
    /// refused config): a passing test must leave none.
    pub fn wasm_errors(&self) -> Vec<String> {
        std::fs::read_to_string(&self.log_path)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("][wasm]") && (l.contains("[error]") || l.contains("[critical]")))
            .map(str::to_string)
            .collect()
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // One more log flush (every 50 ms) before the kill.
            std::thread::sleep(Duration::from_millis(120));
            let _ = child.kill();
            let _ = child.wait();
        }
        if !std::thread::panicking() {
            let errors = self.wasm_errors();
            assert!(
                errors.is_empty(),
                "the dprank filter logged errors in Envoy:\n{}",
                errors.join("\n")
            );
        }
        if std::thread::panicking() {
            eprintln!(
                "---- Envoy log, last lines ----\n{}\n---- Envoy stderr ----\n{}",
                tail(&self.log_path, 80),
                tail(&self.stderr_path, 20)
            );
        }
    }
}
