//! Renders Envoy configurations for the benchmark from the shipped
//! envoy/dprank.yaml, so every variant runs the configuration users get:
//! only ports, worker addresses, the wasm path, the poll interval and (for
//! the variants without dprank) the wasm filter itself are changed.

use std::net::SocketAddr;
use std::path::Path;

#[derive(Debug, Clone, PartialEq)]
pub enum Balancer {
    /// The shipped config: dprank picks worker and rank.
    Dprank(DprankSettings),
    /// Wasm filter removed: the cluster's fallback round robin over workers.
    RoundRobin,
    /// Wasm filter removed, fallback policy least_request over workers.
    LeastRequest,
    /// dprank's filter replaced by the no-op filter (bench/noop-filter) at
    /// the same place with the same settings: the floor of a wasm filter.
    Noop(NoopMode),
}

/// What the no-op filter does (its modes, bench/noop-filter).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoopMode {
    /// Continue at once; the body streams through.
    Pass,
    /// Hold the request until its body is whole, read it once.
    Buffer,
    /// `Pass`, plus the route and rank headers naming the first worker and
    /// rank 0: what routing by header costs in Envoy, without a choice.
    RouteHeader,
    /// `Buffer`, plus the rank field spliced into the body, the body
    /// replaced, and the route header and `content-length` set.
    RouteBody,
    /// `Pass`, plus host calls of the given kinds, so many of each per
    /// request (the filter's `calls kind=n,...`; `dprank-bench host-calls`).
    Calls(&'static [(&'static str, u32)]),
}

impl NoopMode {
    /// The filter's configuration for this mode, naming `first` where it routes.
    fn configuration(self, first: Option<&SocketAddr>) -> Result<String, String> {
        let routed = |mode: &str| {
            first
                .map(|w| format!("{mode} {w}"))
                .ok_or_else(|| format!("no-op filter `{mode}`: no worker to name"))
        };
        match self {
            NoopMode::Pass => Ok("pass".into()),
            NoopMode::Buffer => Ok("buffer".into()),
            NoopMode::RouteHeader => routed("route-header"),
            NoopMode::RouteBody => routed("route-body"),
            NoopMode::Calls(calls) => {
                let list: Vec<String> = calls.iter().map(|(kind, n)| format!("{kind}={n}")).collect();
                Ok(format!("calls {}", list.join(",")))
            }
        }
    }
}

/// What the benchmark changes in dprank's shipped configuration.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DprankSettings {
    pub poll_interval_ms: u64,
    /// Further filter keys, set as given (a variant's `set.<key>=<json>`).
    pub set: serde_json::Map<String, serde_json::Value>,
    /// Simulated seconds per wall second (0 or 1: none). The filter's clock
    /// is the wall's, so its prefix timers are divided by it, as the poll
    /// interval is, to run on the simulated clock virtual time uses.
    pub time_scale: f64,
}

impl DprankSettings {
    pub fn polling_every(poll_interval_ms: u64) -> DprankSettings {
        DprankSettings {
            poll_interval_ms,
            ..DprankSettings::default()
        }
    }

    fn apply(&self, object: &mut serde_json::Map<String, serde_json::Value>) {
        object.insert("poll_interval_ms".into(), self.poll_interval_ms.into());
        for (key, value) in &self.set {
            object.insert(key.clone(), value.clone());
        }
        self.scale_prefix_timers(object);
    }

    /// Writes the prefix timers the filter would use (configured or its
    /// defaults, read through its own parser) divided by the time scale, no
    /// shorter than the filter accepts. Nothing when affinity is off or the
    /// configuration does not parse (the filter then says why).
    fn scale_prefix_timers(&self, object: &mut serde_json::Map<String, serde_json::Value>) {
        let scale = self.time_scale;
        if !(scale.is_finite() && scale > 0.0 && scale != 1.0) {
            return;
        }
        let Ok(bytes) = serde_json::to_vec(object) else {
            return;
        };
        let Ok(dprank::config::Config {
            prefix: Some(prefix), ..
        }) = dprank::config::Config::from_json(&bytes)
        else {
            return;
        };
        let wall = |ms: u64| ((ms as f64 / scale).round() as u64).max(dprank::config::prefix::MIN_TTL_MS);
        let ttl_ms = wall(prefix.ttl_ms);
        object.insert("prefix_ttl_ms".into(), ttl_ms.into());
        object.insert(
            "prefix_private_after_ms".into(),
            wall(prefix.private_after_ms).min(ttl_ms).into(),
        );
    }
}

pub struct EnvoyPorts {
    pub listener: u16,
    pub admin: u16,
}

fn indent_of(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

fn replace_once(text: &str, from: &str, to: &str) -> Result<String, String> {
    match text.matches(from).count() {
        1 => Ok(text.replacen(from, to, 1)),
        n => Err(format!("envoy template: expected `{from}` once, found {n} times")),
    }
}

/// Lines from `start` on that are indented deeper than `start` (its block).
fn block_end(lines: &[String], start: usize) -> usize {
    let base = lines.get(start).map_or(0, |l| indent_of(l));
    let mut end = start + 1;
    while let Some(line) = lines.get(end) {
        if !line.trim().is_empty() && indent_of(line) <= base {
            break;
        }
        end += 1;
    }
    end
}

/// The list item `- name: <name>` and its block.
fn list_item_range(lines: &[String], name: &str) -> Result<(usize, usize), String> {
    let start = lines
        .iter()
        .position(|l| l.trim() == format!("- name: {name}"))
        .ok_or_else(|| format!("envoy template: no `- name: {name}`"))?;
    Ok((start, block_end(lines, start)))
}

/// The template with the listener and admin ports replaced.
fn with_ports(template: &str, ports: &EnvoyPorts) -> Result<String, String> {
    let text = replace_once(
        template,
        "port_value: 10000",
        &format!("port_value: {}", ports.listener),
    )?;
    replace_once(&text, "port_value: 9901", &format!("port_value: {}", ports.admin))
}

/// Replaces the endpoints of the first `lb_endpoints` list with `workers`.
fn replace_endpoints(lines: &mut Vec<String>, workers: &[SocketAddr]) -> Result<(), String> {
    let at = lines
        .iter()
        .position(|l| l.trim() == "- lb_endpoints:")
        .ok_or("envoy template: no lb_endpoints")?;
    let item_indent = indent_of(&lines[at]) + 2;
    let mut end = at + 1;
    while lines
        .get(end)
        .is_some_and(|l| l.trim_start().starts_with("- endpoint:"))
    {
        end += 1;
    }
    let endpoints: Vec<String> = workers
        .iter()
        .map(|w| {
            format!(
                "{:item_indent$}- endpoint: {{ address: {{ socket_address: {{ address: {}, port_value: {} }} }} }}",
                "",
                w.ip(),
                w.port()
            )
        })
        .collect();
    lines.splice(at + 1..end, endpoints);
    Ok(())
}

/// Points the wasm filter at `wasm` and lets `edit` change its JSON
/// configuration, which is written back on one line.
fn rewrite_filter(
    lines: &mut Vec<String>,
    wasm: &Path,
    edit: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>) -> Result<(), String>,
) -> Result<(), String> {
    let (start, end) = list_item_range(lines, "envoy.filters.http.wasm")?;
    let wasm_line = (start..end)
        .find(|i| lines[*i].contains("filename:"))
        .ok_or("envoy template: no wasm filename")?;
    let indent = indent_of(&lines[wasm_line]);
    lines[wasm_line] = format!("{:indent$}local: {{ filename: {} }}", "", wasm.display());
    let value = (start..end)
        .find(|i| lines[*i].trim() == "value: |")
        .ok_or("envoy template: no filter configuration `value: |`")?;
    let value_end = block_end(lines, value);
    let json_text = lines[value + 1..value_end].join("\n");
    let mut config: serde_json::Value = serde_json::from_str(&json_text)
        .map_err(|e| format!("envoy template: filter configuration is not JSON: {e}"))?;
    let object = config
        .as_object_mut()
        .ok_or("envoy template: filter configuration is not an object")?;
    edit(object)?;
    let indent = indent_of(&lines[value]) + 2;
    lines.splice(value + 1..value_end, [format!("{:indent$}{}", "", config)]);
    Ok(())
}

/// Makes the wasm filter the no-op one (`wasm`), configured with `mode`
/// (`NoopMode::configuration`); everything else about the filter stays as
/// shipped.
fn noop_filter(lines: &mut [String], wasm: &Path, mode: &str) -> Result<(), String> {
    let (start, end) = list_item_range(lines, "envoy.filters.http.wasm")?;
    let mut renamed = 0;
    for line in lines[start..end].iter_mut() {
        let trimmed = line.trim();
        let indent = indent_of(line);
        if trimmed.contains("filename:") {
            *line = format!("{:indent$}local: {{ filename: {} }}", "", wasm.display());
        } else if trimmed == "name: dprank" || trimmed == "root_id: dprank" || trimmed == "vm_id: dprank" {
            *line = line.replace("dprank", "noop");
            renamed += 1;
        }
    }
    if renamed != 3 {
        return Err("envoy template: the wasm filter's name, root_id and vm_id are not `dprank`".into());
    }
    let value = (start..end)
        .find(|i| lines[*i].trim() == "value: |")
        .ok_or("envoy template: no filter configuration `value: |`")?;
    let value_end = block_end(lines, value);
    let indent = indent_of(&lines[value]) + 2;
    for (i, line) in lines[value + 1..value_end].iter_mut().enumerate() {
        *line = if i == 0 {
            format!("{:indent$}{mode}", "")
        } else {
            String::new()
        };
    }
    Ok(())
}

fn join_lines(lines: &[String]) -> String {
    let mut out = lines.join("\n");
    out.push('\n');
    out
}

pub fn render(
    template: &str,
    ports: &EnvoyPorts,
    workers: &[SocketAddr],
    balancer: &Balancer,
    wasm: &Path,
) -> Result<String, String> {
    let mut text = with_ports(template, ports)?;
    if *balancer == Balancer::LeastRequest {
        text = replace_once(
            &text,
            "envoy.load_balancing_policies.round_robin\n",
            "envoy.load_balancing_policies.least_request\n",
        )?;
        text = replace_once(
            &text,
            "round_robin.v3.RoundRobin",
            "least_request.v3.LeastRequest",
        )?;
    }
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();

    // The workers of the `sglang` cluster.
    replace_endpoints(&mut lines, workers)?;

    match balancer {
        Balancer::Dprank(settings) => {
            rewrite_filter(&mut lines, wasm, |object| {
                let named: Vec<serde_json::Value> = workers
                    .iter()
                    .enumerate()
                    .map(
                        |(i, w)| serde_json::json!({"address": w.to_string(), "name": format!("worker_{i}")}),
                    )
                    .collect();
                object.insert("workers".into(), serde_json::Value::Array(named));
                settings.apply(object);
                Ok(())
            })?;
        }
        Balancer::RoundRobin | Balancer::LeastRequest => {
            let (start, end) = list_item_range(&lines, "envoy.filters.http.wasm")?;
            lines.drain(start..end);
        }
        Balancer::Noop(mode) => noop_filter(&mut lines, wasm, &mode.configuration(workers.first())?)?,
    }
    Ok(join_lines(&lines))
}

/// One PD worker for [`render_pd`].
pub struct PdWorker {
    pub addr: SocketAddr,
    /// Prefill workers: the bootstrap port decode workers fetch the KV from.
    pub bootstrap_port: Option<u16>,
}

/// envoy/pd.yaml with the ports, the prefill and decode workers (the filter's
/// lists and the `sglang_decode` endpoints), the wasm path and the poll
/// interval replaced; nothing else changes.
pub fn render_pd(
    template: &str,
    ports: &EnvoyPorts,
    prefill: &[PdWorker],
    decode: &[SocketAddr],
    settings: &DprankSettings,
    wasm: &Path,
) -> Result<String, String> {
    let text = with_ports(template, ports)?;
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    replace_endpoints(&mut lines, decode)?;
    rewrite_filter(&mut lines, wasm, |object| {
        for key in ["prefill_workers", "decode_workers"] {
            if !object.contains_key(key) {
                return Err(format!("envoy template: filter configuration has no `{key}`"));
            }
        }
        let prefill_json: Vec<serde_json::Value> = prefill
            .iter()
            .enumerate()
            .map(|(i, w)| {
                let mut item =
                    serde_json::json!({"address": w.addr.to_string(), "name": format!("prefill_{i}")});
                if let (Some(port), Some(map)) = (w.bootstrap_port, item.as_object_mut()) {
                    map.insert("bootstrap_port".into(), port.into());
                }
                item
            })
            .collect();
        let decode_json: Vec<serde_json::Value> = decode
            .iter()
            .enumerate()
            .map(|(i, w)| serde_json::json!({"address": w.to_string(), "name": format!("decode_{i}")}))
            .collect();
        object.insert("prefill_workers".into(), serde_json::Value::Array(prefill_json));
        object.insert("decode_workers".into(), serde_json::Value::Array(decode_json));
        settings.apply(object);
        Ok(())
    })?;
    Ok(join_lines(&lines))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template() -> String {
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../envoy/dprank.yaml")).unwrap()
    }

    fn workers() -> Vec<SocketAddr> {
        vec![
            "127.0.0.1:4001".parse().unwrap(),
            "127.0.0.1:4002".parse().unwrap(),
            "127.0.0.1:4003".parse().unwrap(),
        ]
    }

    const PORTS: EnvoyPorts = EnvoyPorts {
        listener: 5000,
        admin: 5001,
    };

    #[test]
    fn dprank_variant_rewrites_workers_ports_and_interval() {
        let out = render(
            &template(),
            &PORTS,
            &workers(),
            &Balancer::Dprank(DprankSettings {
                poll_interval_ms: 250,
                set: serde_json::json!({"cost_estimate": "words"})
                    .as_object()
                    .unwrap()
                    .clone(),
                ..DprankSettings::default()
            }),
            Path::new("/x/d.wasm"),
        )
        .unwrap();
        assert!(out.contains("port_value: 5000") && out.contains("port_value: 5001"));
        assert!(out.contains("port_value: 4003 }"));
        assert!(!out.contains("30001"));
        assert!(out.contains("\"poll_interval_ms\":250"));
        assert!(out.contains("\"cost_estimate\":\"words\""));
        assert!(out.contains("\"address\":\"127.0.0.1:4002\""));
        assert!(out.contains("filename: /x/d.wasm"));
        assert!(out.contains("envoy.filters.http.router"));
    }

    /// The filter's configuration line of a rendered template.
    fn filter_json(rendered: &str) -> serde_json::Value {
        let line = rendered
            .lines()
            .map(str::trim)
            .find(|l| l.starts_with('{') && l.contains("poll_interval_ms"))
            .unwrap();
        serde_json::from_str(line).unwrap()
    }

    #[test]
    fn prefix_timers_run_on_the_simulated_clock() {
        let at = |time_scale: f64, set: serde_json::Value| {
            let settings = DprankSettings {
                poll_interval_ms: 500,
                set: set.as_object().unwrap().clone(),
                time_scale,
            };
            let out = render(
                &template(),
                &PORTS,
                &workers(),
                &Balancer::Dprank(settings),
                Path::new("/x"),
            )
            .unwrap();
            filter_json(&out)
        };
        let defaults = dprank::config::Prefix::default();
        let scaled = at(2.0, serde_json::json!({}));
        assert_eq!(scaled["prefix_ttl_ms"], defaults.ttl_ms / 2);
        assert_eq!(scaled["prefix_private_after_ms"], defaults.private_after_ms / 2);
        let configured = at(2.0, serde_json::json!({"prefix_private_after_ms": 8000}));
        assert_eq!(configured["prefix_private_after_ms"], 4000);
        // Never below what the filter accepts.
        let fast = at(5.0, serde_json::json!({}));
        assert_eq!(
            fast["prefix_private_after_ms"],
            dprank::config::prefix::MIN_TTL_MS
        );
        // Wall clock, affinity off (header transport): nothing written.
        assert!(at(1.0, serde_json::json!({})).get("prefix_ttl_ms").is_none());
        assert!(at(2.0, serde_json::json!({"rank_transport": "header"}))
            .get("prefix_ttl_ms")
            .is_none());
    }

    #[test]
    fn plain_variants_drop_the_filter() {
        let rr = render(
            &template(),
            &PORTS,
            &workers(),
            &Balancer::RoundRobin,
            Path::new("/x"),
        )
        .unwrap();
        assert!(!rr.contains("envoy.filters.http.wasm") && !rr.contains("dprank.wasm"));
        assert!(rr.contains("- name: envoy.filters.http.router"));
        assert!(rr.contains("round_robin.v3.RoundRobin"));
        let lr = render(
            &template(),
            &PORTS,
            &workers(),
            &Balancer::LeastRequest,
            Path::new("/x"),
        )
        .unwrap();
        assert!(lr.contains("least_request.v3.LeastRequest") && !lr.contains("RoundRobin"));
    }

    #[test]
    fn noop_variants_swap_the_filter_and_keep_its_settings() {
        let first = workers()[0];
        for (noop, mode) in [
            (NoopMode::Pass, "pass".to_string()),
            (NoopMode::Buffer, "buffer".to_string()),
            (NoopMode::RouteHeader, format!("route-header {first}")),
            (NoopMode::RouteBody, format!("route-body {first}")),
            (
                NoopMode::Calls(&[("shared-get", 40), ("time", 1)]),
                "calls shared-get=40,time=1".to_string(),
            ),
        ] {
            let out = render(
                &template(),
                &PORTS,
                &workers(),
                &Balancer::Noop(noop),
                Path::new("/x/noop.wasm"),
            )
            .unwrap();
            assert!(out.contains("filename: /x/noop.wasm") && !out.contains("dprank.wasm"));
            assert!(out.contains("root_id: noop") && out.contains("vm_id: noop"));
            assert!(out.contains(&format!("\n                    {mode}\n")), "{out}");
            assert!(!out.contains("\"workers\""), "the dprank configuration is gone");
            assert!(out.contains("allow_on_headers_stop_iteration: true") && out.contains("FAIL_RELOAD"));
            assert!(out.contains("per_connection_buffer_limit_bytes"));
        }
        assert!(
            NoopMode::RouteBody.configuration(None).is_err(),
            "routing names a worker"
        );
    }

    #[test]
    fn pd_template_rewrites_both_worker_lists() {
        let template =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../envoy/pd.yaml")).unwrap();
        let prefill = [
            PdWorker {
                addr: "127.0.0.1:4001".parse().unwrap(),
                bootstrap_port: Some(4101),
            },
            PdWorker {
                addr: "127.0.0.1:4002".parse().unwrap(),
                bootstrap_port: Some(4102),
            },
        ];
        let decode: Vec<SocketAddr> = vec![
            "127.0.0.1:4201".parse().unwrap(),
            "127.0.0.1:4202".parse().unwrap(),
        ];
        let out = render_pd(
            &template,
            &PORTS,
            &prefill,
            &decode,
            &DprankSettings::polling_every(250),
            Path::new("/x/d.wasm"),
        )
        .unwrap();
        assert!(out.contains("port_value: 5000") && out.contains("port_value: 5001"));
        assert!(out.contains("port_value: 4202 }") && !out.contains("32001") && !out.contains("31001"));
        assert!(out.contains("\"bootstrap_port\":4102"));
        assert!(out.contains("\"address\":\"127.0.0.1:4201\""));
        assert!(out.contains("\"poll_interval_ms\":250"));
        assert!(out.contains("filename: /x/d.wasm"));
    }
}
