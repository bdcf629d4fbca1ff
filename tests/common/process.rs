//! An Envoy process started from any rendered config (PD, LDS, cluster
//! discovery), with the process flags the lifecycle tests need: hot-restart
//! epochs and drain times. Same guards as [`super::Envoy`]: killed and reaped
//! on drop, log dumped on failure, wasm errors fail a passing test. Also the
//! small config-editing helpers those renderers share.

use super::http::Client;
use super::{envoy_bin, tail, wait_until, wasm_path, Reply, TestDir};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Prefix Envoy gives the stats a wasm filter defines, plus the filter's own prefix.
const STAT_PREFIX: &str = "wasmcustom.dprank.";

/// How the process takes part in Envoy's hot restart.
#[derive(Debug, Clone)]
pub enum HotRestart {
    /// `--disable-hot-restart` (several Envoys run at once in the tests).
    Disabled,
    /// Epoch 0 with a base id Envoy picks among the unused ones and writes to
    /// `base_id_path` (`--use-dynamic-base-id`): no clash with other tests.
    First { base_id_path: PathBuf },
    /// A later epoch of the same base id.
    Next { base_id: u32, epoch: u32 },
}

#[derive(Debug, Clone)]
pub struct Launch {
    /// Names the log files (`<label>.log`, `<label>.stderr`).
    pub label: String,
    pub concurrency: u32,
    pub hot_restart: HotRestart,
    /// `--drain-time-s`, `--parent-shutdown-time-s` when set.
    pub drain_time_s: Option<u32>,
    pub parent_shutdown_time_s: Option<u32>,
}

impl Launch {
    pub fn new(label: &str) -> Launch {
        Launch {
            label: label.to_string(),
            concurrency: 2,
            hot_restart: HotRestart::Disabled,
            drain_time_s: None,
            parent_shutdown_time_s: None,
        }
    }
}

pub struct EnvoyProcess {
    child: Option<Child>,
    pub admin: SocketAddr,
    pub listener: SocketAddr,
    pub label: String,
    log_path: PathBuf,
    stderr_path: PathBuf,
    client: Client,
}

fn read_addr(path: &Path) -> Option<SocketAddr> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

impl EnvoyProcess {
    /// Starts Envoy on `config` and waits until it is ready and its first
    /// listener is bound.
    pub fn start(dir: &TestDir, config: &Path, launch: &Launch) -> EnvoyProcess {
        let label = &launch.label;
        let admin_path = dir.file(&format!("{label}.admin-address"));
        let log_path = dir.file(&format!("{label}.log"));
        let stderr_path = dir.file(&format!("{label}.stderr"));
        let stderr = std::fs::File::create(&stderr_path).expect("create Envoy stderr file");
        let mut command = Command::new(envoy_bin());
        command
            .arg("-c")
            .arg(config)
            .args(["--concurrency", &launch.concurrency.to_string()])
            .arg("--admin-address-path")
            .arg(&admin_path)
            .args(["-l", "info", "--log-path"])
            .arg(&log_path)
            .args(["--file-flush-interval-msec", "50"]);
        match &launch.hot_restart {
            HotRestart::Disabled => {
                command.arg("--disable-hot-restart");
            }
            HotRestart::First { base_id_path } => {
                command
                    .args(["--restart-epoch", "0", "--use-dynamic-base-id", "--base-id-path"])
                    .arg(base_id_path);
            }
            HotRestart::Next { base_id, epoch } => {
                command.args([
                    "--restart-epoch",
                    &epoch.to_string(),
                    "--base-id",
                    &base_id.to_string(),
                ]);
            }
        }
        if let Some(s) = launch.drain_time_s {
            command.args(["--drain-time-s", &s.to_string()]);
        }
        if let Some(s) = launch.parent_shutdown_time_s {
            command.args(["--parent-shutdown-time-s", &s.to_string()]);
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", envoy_bin().display()));
        let mut envoy = EnvoyProcess {
            child: Some(child),
            admin: SocketAddr::from(([127, 0, 0, 1], 0)),
            listener: SocketAddr::from(([127, 0, 0, 1], 0)),
            label: label.clone(),
            log_path,
            stderr_path,
            client: Client::new(),
        };
        let startup = Duration::from_secs(60);
        envoy.admin = wait_until(&format!("{label}: admin address file"), startup, || {
            envoy.assert_running();
            read_addr(&admin_path)
        });
        wait_until(&format!("{label}: /ready"), startup, || {
            envoy.assert_running();
            (envoy.admin_get("/ready").status == 200).then_some(())
        });
        envoy.listener = wait_until(&format!("{label}: listener address"), startup, || {
            // A listener Envoy could not create (a port taken) never appears.
            let failed: u64 = envoy
                .stats_matching("listener_manager.listener_create_failure")
                .values()
                .sum();
            assert!(
                failed == 0,
                "{label} could not create its listener; log:\n{}",
                tail(&envoy.log_path, 20)
            );
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
                    "{} exited ({status}); log:\n{}\nstderr:\n{}",
                    self.label,
                    tail(&self.log_path, 60),
                    tail(&self.stderr_path, 20)
                );
            }
        }
    }

    /// Waits for the process to exit on its own (a drained hot-restart parent).
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let child = self
            .child
            .as_mut()
            .unwrap_or_else(|| panic!("{} is not running", self.label));
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = child.try_wait().expect("try_wait on Envoy") {
                self.child = None;
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "{} still running after {timeout:?}; log:\n{}",
                self.label,
                tail(&self.log_path, 40)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.listener)
    }

    pub fn admin_get(&self, path: &str) -> Reply {
        self.client.get(&format!("http://{}{path}", self.admin), &[])
    }

    /// Every dprank stat (`wasmcustom.dprank.<name>`) by `<name>`.
    pub fn stats(&self) -> HashMap<String, u64> {
        self.stats_matching("wasmcustom")
            .into_iter()
            .filter_map(|(name, v)| Some((name.strip_prefix(STAT_PREFIX)?.to_string(), v)))
            .collect()
    }

    /// Envoy's own stats whose names match `filter` (a regex), by full name.
    pub fn stats_matching(&self, filter: &str) -> HashMap<String, u64> {
        let reply = self.admin_get(&format!("/stats?format=json&filter={filter}"));
        assert_eq!(reply.status, 200, "{}: GET /stats failed: {reply:?}", self.label);
        reply.json()["stats"]
            .as_array()
            .map(|stats| {
                stats
                    .iter()
                    .filter_map(|s| Some((s.get("name")?.as_str()?.to_string(), s.get("value")?.as_u64()?)))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// One dprank stat; 0 until defined.
    pub fn stat(&self, name: &str) -> u64 {
        self.stats().get(name).copied().unwrap_or(0)
    }

    /// Waits until dprank stat `name` reaches at least `at_least`; returns it.
    pub fn wait_for_stat(&self, name: &str, at_least: u64, timeout: Duration) -> u64 {
        wait_until(
            &format!("{}: stat {name} >= {at_least}", self.label),
            timeout,
            || {
                let value = self.stat(name);
                (value >= at_least).then_some(value)
            },
        )
    }

    /// Envoy's resident memory (KiB), from /proc; None once it has exited.
    pub fn rss_kib(&self) -> Option<u64> {
        let pid = self.child.as_ref()?.id();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    }

    /// Envoy's log file.
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// Error and critical lines of the wasm VMs in the log.
    pub fn wasm_errors(&self) -> Vec<String> {
        std::fs::read_to_string(&self.log_path)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("][wasm]") && (l.contains("[error]") || l.contains("[critical]")))
            .map(str::to_string)
            .collect()
    }
}

impl Drop for EnvoyProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // One more log flush (every 50 ms) before the kill.
            std::thread::sleep(Duration::from_millis(120));
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            eprintln!(
                "---- {} log, last lines ----\n{}\n---- {} stderr ----\n{}",
                self.label,
                tail(&self.log_path, 80),
                self.label,
                tail(&self.stderr_path, 20)
            );
        } else {
            let errors = self.wasm_errors();
            assert!(
                errors.is_empty(),
                "{}: the dprank filter logged errors in Envoy:\n{}",
                self.label,
                errors.join("\n")
            );
        }
    }
}

/// A port free right now on 127.0.0.1, for what must be known before Envoy
/// starts (the admin port a cluster points at, a listener port that must
/// survive a reload or a hot restart).
///
/// Taken below Linux's ephemeral range (32768 and up by default), so no
/// outgoing connection and no bind to port 0 can take it in the second
/// between this call and Envoy's bind: with a listener from LDS, Envoy
/// rejects a port in use quietly and reports ready without a listener.
/// Each process walks the range from its own offset and never hands out a
/// port twice.
pub fn free_port() -> u16 {
    const FIRST: u32 = 20_000;
    const COUNT: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let _ = NEXT.compare_exchange(
        u32::MAX,
        std::process::id().wrapping_mul(2_654_435_761) % COUNT,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    for _ in 0..COUNT {
        let port = (FIRST + NEXT.fetch_add(1, Ordering::Relaxed) % COUNT) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free port in {FIRST}..{}", FIRST + COUNT);
}

static WRITES: AtomicU32 = AtomicU32::new(0);

/// Replaces `path` atomically (write a sibling, then rename), as Envoy's
/// file-based xDS requires.
pub fn atomic_write(path: &Path, text: &str) {
    let tmp = path.with_extension(format!("tmp{}", WRITES.fetch_add(1, Ordering::Relaxed)));
    std::fs::write(&tmp, text).unwrap_or_else(|e| panic!("write {}: {e}", tmp.display()));
    std::fs::rename(&tmp, path).unwrap_or_else(|e| panic!("rename to {}: {e}", path.display()));
}

/// Object fields of `over` replace or (for objects) merge into `base`.
pub fn merge(base: &mut Value, over: &Value) {
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

/// Generated worker entries with the scenario's per-worker overrides (an
/// array under `key`, removed from `overrides`) merged in, in order.
pub fn workers_with_overrides(mut generated: Vec<Value>, overrides: &mut Value, key: &str) -> Value {
    if let Some(Value::Array(per_worker)) = overrides.as_object_mut().and_then(|o| o.remove(key)) {
        for (entry, over) in generated.iter_mut().zip(&per_worker) {
            merge(entry, over);
        }
    }
    Value::Array(generated)
}

/// Calls `edit` on the `config` of every dprank wasm filter (root_id
/// `dprank`) anywhere in `doc`; returns how many there were.
pub fn for_each_dprank_filter(doc: &mut Value, edit: &mut dyn FnMut(&mut Value)) -> usize {
    match doc {
        Value::Object(map) => {
            if map.get("root_id").and_then(Value::as_str) == Some("dprank") && map.contains_key("vm_config") {
                edit(doc);
                return 1;
            }
            map.values_mut().map(|v| for_each_dprank_filter(v, edit)).sum()
        }
        Value::Array(items) => items.iter_mut().map(|v| for_each_dprank_filter(v, edit)).sum(),
        _ => 0,
    }
}

/// The wasm path made absolute and the filter's JSON configuration edited by
/// `edit`, in the one dprank filter of `doc`.
pub fn edit_dprank_filter(doc: &mut Value, what: &str, edit: &mut dyn FnMut(&mut Value)) {
    let wasm = wasm_path().display().to_string();
    let found = for_each_dprank_filter(doc, &mut |config| {
        config["vm_config"]["code"]["local"]["filename"] = json!(wasm);
        let text = config["configuration"]["value"]
            .as_str()
            .unwrap_or_else(|| panic!("{what}: filter configuration has no value"));
        let mut filter: Value = serde_json::from_str(text)
            .unwrap_or_else(|e| panic!("{what}: filter configuration is not JSON: {e}"));
        edit(&mut filter);
        config["configuration"]["value"] = json!(serde_json::to_string_pretty(&filter).expect("serialise"));
    });
    assert_eq!(found, 1, "{what}: expected exactly one dprank wasm filter");
}

/// Sets `port_value` of the socket address at `doc[path...]`.
pub fn set_port(doc: &mut Value, path: &[&str], port: u16) {
    let mut at = &mut *doc;
    for key in path {
        at = at
            .get_mut(*key)
            .unwrap_or_else(|| panic!("no `{key}` in the config (path {path:?})"));
    }
    at["port_value"] = json!(port);
}

/// The static cluster named `name`.
pub fn cluster_mut<'a>(doc: &'a mut Value, name: &str) -> &'a mut Value {
    doc["static_resources"]["clusters"]
        .as_array_mut()
        .expect("static_resources.clusters")
        .iter_mut()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no cluster `{name}`"))
}

/// `lb_endpoints` for these addresses.
pub fn lb_endpoints(addrs: &[SocketAddr]) -> Value {
    let endpoints: Vec<Value> = addrs
        .iter()
        .map(|addr| {
            json!({"endpoint": {"address": {"socket_address": {
                "address": addr.ip().to_string(), "port_value": addr.port()
            }}}})
        })
        .collect();
    json!([{ "lb_endpoints": endpoints }])
}

pub fn yaml_of(doc: &Value) -> String {
    serde_yaml_ng::to_string(doc).expect("config serialises")
}

pub fn read_yaml(path: &Path) -> Value {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("{} is not YAML: {e}", path.display()))
}
