//! A real Envoy running a shipped config (`envoy/dprank.yaml`, or
//! `envoy/vllm.yaml` for vLLM-shaped workers), rendered for a test:
//! ports 0, the started workers as cluster endpoints and filter `workers`,
//! the wasm path made absolute, and the scenario's filter overrides merged in.

use super::process::{lb_endpoints, merge, workers_with_overrides, EnvoyProcess, Launch};
use super::{repo_root, wasm_path, Scenario, Sim, TestDir};
use serde_json::{json, Map, Value};
use std::net::SocketAddr;
use std::ops::{Deref, DerefMut};
use std::path::Path;

/// The shipped config the tests (and the demo) run.
pub const SHIPPED_CONFIG: &str = "envoy/dprank.yaml";

#[derive(Debug, Clone)]
pub struct EnvoyOptions {
    /// The shipped config rendered: `envoy/dprank.yaml`, or `envoy/vllm.yaml`.
    pub shipped: &'static str,
    pub concurrency: u32,
    /// Overrides the listener's `per_connection_buffer_limit_bytes`.
    pub listener_buffer_limit: Option<u64>,
    /// Wait, after start, until every worker has been polled successfully.
    pub wait_for_polls: bool,
}

impl Default for EnvoyOptions {
    fn default() -> Self {
        EnvoyOptions {
            shipped: SHIPPED_CONFIG,
            concurrency: 2,
            listener_buffer_limit: None,
            wait_for_polls: true,
        }
    }
}

fn object_mut<'a>(value: &'a mut Value, path: &[&str]) -> &'a mut Map<String, Value> {
    let mut at = value;
    for key in path {
        at = at
            .get_mut(*key)
            .unwrap_or_else(|| panic!("the shipped config: no `{}` (path {path:?})", key));
    }
    at.as_object_mut()
        .unwrap_or_else(|| panic!("the shipped config: {path:?} is not a mapping"))
}

fn array_mut<'a>(value: &'a mut Value, key: &str) -> &'a mut Vec<Value> {
    value
        .get_mut(key)
        .and_then(Value::as_array_mut)
        .unwrap_or_else(|| panic!("the shipped config: no list `{key}`"))
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
    let mut doc: Value = serde_yaml_ng::from_str(shipped_yaml)
        .unwrap_or_else(|e| panic!("the shipped config is not YAML: {e}"));
    object_mut(&mut doc, &["admin", "address", "socket_address"]).insert("port_value".into(), json!(0));

    let resources = doc
        .get_mut("static_resources")
        .unwrap_or_else(|| panic!("the shipped config: no static_resources"));
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
                .unwrap_or_else(|| panic!("the shipped config: filter configuration has no value"));
            let mut filter: Value = serde_json::from_str(shipped_text)
                .unwrap_or_else(|e| panic!("the shipped config: filter configuration is not JSON: {e}"));
            let generated: Vec<Value> = workers
                .iter()
                .map(|(name, addr)| json!({"address": addr.to_string(), "name": name}))
                .collect();
            let mut overrides = filter_overrides.clone();
            // Per-worker overrides (e.g. dp_size) merge into the generated entries.
            filter["workers"] = workers_with_overrides(generated, &mut overrides, "workers");
            merge(&mut filter, &overrides);
            configuration.insert(
                "value".into(),
                json!(serde_json::to_string_pretty(&filter).expect("filter config serialises")),
            );
        }
    }
    assert_eq!(
        filters_seen, 1,
        "the shipped config: expected exactly one dprank wasm filter"
    );

    // The workers' cluster: the one whose policy is override_host.
    let clusters = array_mut(resources, "clusters");
    let routed = clusters
        .iter_mut()
        .find(|c| {
            c["load_balancing_policy"]["policies"][0]["typed_extension_config"]["name"]
                == "envoy.load_balancing_policies.override_host"
        })
        .unwrap_or_else(|| panic!("the shipped config has no cluster with the override_host policy"));
    let addrs: Vec<SocketAddr> = workers.iter().map(|(_, addr)| *addr).collect();
    object_mut(routed, &["load_assignment"]).insert("endpoints".into(), lb_endpoints(&addrs));

    serde_yaml_ng::to_string(&doc).expect("rendered config serialises")
}

/// Envoy on the rendered shipped config: an [`EnvoyProcess`] labelled
/// `envoy` (same guards: killed and reaped on drop, log dumped on failure,
/// wasm errors fail a passing test).
pub struct Envoy(EnvoyProcess);

impl Envoy {
    pub fn start(dir: &TestDir, scenario: &Scenario, sims: &[Sim], options: &EnvoyOptions) -> Envoy {
        let shipped = std::fs::read_to_string(repo_root().join(options.shipped))
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", options.shipped));
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
        let launch = Launch {
            concurrency: options.concurrency,
            ..Launch::new("envoy")
        };
        Envoy(EnvoyProcess::start(dir, &config_path, &launch))
    }
}

impl Deref for Envoy {
    type Target = EnvoyProcess;

    fn deref(&self) -> &EnvoyProcess {
        &self.0
    }
}

impl DerefMut for Envoy {
    fn deref_mut(&mut self) -> &mut EnvoyProcess {
        &mut self.0
    }
}
